"""Every notebooks/*.ipynb runs top to bottom (FAST sizes, 8 simulated CPU devices) without an error, and is
what `notebooks/build.py` writes from its source in `notebooks/src/` (edit the source, then rebuild).

The kernel is this interpreter (sys.executable) through a kernelspec written for the test, so the result
does not depend on which "python3" kernelspec a machine has installed. Its environment asks for the small
sizes (JAXRING_NOTEBOOK_FAST=1) and 8 CPU devices. XLA's backend optimisation level 0 cuts compile times
on CPU by about 40% (most of a notebook's time is compiling); the bytes moved and buffer sizes that the
notebooks print came out the same with and without it.

All eight run in the default (CI) run: on an idle 2-core machine the six that were left to -m slow took 261 s
together (02_strategies 95 s, 08_context_extension 54 s, 05_pipeline 40 s, 03_train_gpt 35 s, 06_moe 23 s,
07_planner 14 s), and every notebook is checked against its source. (On a shared machine at a load average of
8-19 the same notebooks took 19 minutes: SLOW_NOTEBOOKS can leave some to -m slow again.)
"""

import importlib.util
import json
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from helpers import ROOT  # noqa: E402
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402  (a dependency of nbclient)
from jupyter_client.manager import KernelManager  # noqa: E402

NOTEBOOKS_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
KERNEL_ENV = {
    "JAXRING_NOTEBOOK_FAST": "1",
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
}
# notebooks that run only with -m slow (none: see the module docstring)
SLOW_NOTEBOOKS: set[str] = set()


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOKS_DIR}"


def _build_module():
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOKS_DIR / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_notebooks_match_their_sources():
    """Each notebook has a source in notebooks/src/ and is exactly what build.py renders from it."""
    build = _build_module()
    sources = {p.stem for p in build.SOURCES.glob("*.py")}
    assert sources == {p.stem for p in NOTEBOOKS}, (sources, [p.name for p in NOTEBOOKS])
    stale = [p.name for p in NOTEBOOKS if p.read_text() != build.render(build.SOURCES / (p.stem + ".py"))]
    assert not stale, f"{stale} differ from notebooks/src/: run `python notebooks/build.py`"


def test_build_reads_markdown_code_and_magics():
    build = _build_module()
    source = "# %% [markdown]\n# # Title\n#\n# text\n\n# %%\nif x:\n    # %pip install -q y\n# a comment\n"
    assert build.cells(source) == [
        ("markdown", "# Title\n\ntext"),
        ("code", "if x:\n    %pip install -q y\n# a comment"),
    ]
    with pytest.raises(ValueError, match="does not start with '# '"):
        build.cells("# %% [markdown]\nplain text\n")


def test_colab_badges_open_the_repository_in_pyproject(tmp_path):
    """Each notebook's first cell has an "Open in Colab" badge for itself in the repository that pyproject.toml
    names ([project.urls] Repository), and a source installing from another repository is refused."""
    build = _build_module()
    repo = build.repository()
    path = repo.removeprefix("https://github.com/")
    for notebook_path in NOTEBOOKS:
        first = nbformat.read(notebook_path, as_version=4).cells[0].source
        badge = f"https://colab.research.google.com/github/{path}/blob/main/notebooks/{notebook_path.name}"
        assert f'<a href="{badge}"' in first, (notebook_path.name, first[:300])
    source = next(build.SOURCES.glob("*.py")).read_text()
    other = tmp_path / "00_other.py"
    other.write_text(source.replace(f"git+{repo}", "git+https://github.com/someone/else"))
    with pytest.raises(ValueError, match=r"installs from https://github\.com/someone/else, but pyproject\.toml"):
        build.notebook(other)


def _kernel_manager(tmp_path) -> KernelManager:
    """A KernelManager whose kernel is `sys.executable -m ipykernel_launcher` with KERNEL_ENV."""
    spec_dir = tmp_path / "kernels" / "jaxring-test"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxring test kernel",
        "language": "python",
        "env": KERNEL_ENV,
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)], ensure_native_kernel=False)
    return KernelManager(kernel_name="jaxring-test", kernel_spec_manager=specs)


def _notebook_params():
    slow = pytest.mark.slow(reason="1.5-8 minutes on 2 cores; see the module docstring")
    return [pytest.param(p, id=p.name, marks=[slow] if p.name in SLOW_NOTEBOOKS else []) for p in NOTEBOOKS]


def test_slow_notebooks_exist():
    """SLOW_NOTEBOOKS names notebooks that exist (a renamed one would otherwise run by default unnoticed)."""
    missing = SLOW_NOTEBOOKS - {p.name for p in NOTEBOOKS}
    assert not missing, missing


@pytest.mark.parametrize("path", _notebook_params())
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") or c.get("execution_count") for c in nb.cells if c.cell_type == "code"), (
        f"{path.name} is stored with outputs; clear them (keep the repository lean)"
    )
    client = nbclient.NotebookClient(
        nb,
        km=_kernel_manager(tmp_path),
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError (with the cell and its traceback) on any error
    print(f"{path.name}: {time.perf_counter() - start:.1f} s")
