"""The package's structure: imports in one direction, at the top of the file, and no top-level `models`.

`lint-imports` (import-linter, the contracts in pyproject.toml, run by .ci/run) holds the layers between the
top-level imports; these tests also count the imports written inside functions (`tools/import_graph.py`), which
import-linter cannot tell apart, and the `models/` folder, which installs as `jaxring.models`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib

from helpers import ROOT

spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
sys.modules["import_graph"] = import_graph  # its dataclass looks its module up while the class is built
spec.loader.exec_module(import_graph)

# at most this many imports of the project's own modules inside functions, each with its reason in a comment
MAX_FUNCTION_LEVEL_IMPORTS = 5


def test_no_import_cycle():
    """Counting imports inside functions too (TYPE_CHECKING blocks aside), no module reaches itself."""
    loops = import_graph.cycles(import_graph.imports())
    assert not loops, "import cycles:\n" + "\n".join(" ".join(loop) for loop in loops)


def test_function_level_imports_are_few_and_say_why():
    lazy = [i for i in import_graph.imports() if i.in_function]
    listing = "\n".join(f"{i.importer}:{i.line} -> {i.imported}  # {i.reason}" for i in lazy)
    assert len(lazy) <= MAX_FUNCTION_LEVEL_IMPORTS, f"{len(lazy)} function-level imports:\n{listing}"
    assert all(i.reason for i in lazy), f"a function-level import without its reason:\n{listing}"


def test_the_library_never_imports_the_models():
    """jaxring/ below the applications does not know the model families: they register through entry points."""
    wrong = [
        i
        for i in import_graph.imports()
        if i.imported.startswith("jaxring.models") and not i.importer.startswith("jaxring.models")
    ]
    assert not wrong, wrong


def test_the_models_install_under_jaxrings_name_only(tmp_path):
    """From outside the checkout, `import models` fails and `import jaxring.models.gpt` works."""
    code = (
        "import importlib.util, jaxring.models.gpt\n"
        "assert importlib.util.find_spec('models') is None, importlib.util.find_spec('models')\n"
        "print('ok')\n"
    )
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_pyproject_lists_every_package():
    """pyproject.toml lists the packages by name (the models/ folder's mapping needs it): none may be missing."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    library = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "jaxring").rglob("__init__.py")}
    models = {".".join(("jaxring", *p.parent.relative_to(ROOT).parts)) for p in (ROOT / "models").rglob("__init__.py")}
    folders = library | models
    assert listed == folders, (sorted(listed - folders), sorted(folders - listed))
    assert config["package-dir"] == {"jaxring.models": "models"}
