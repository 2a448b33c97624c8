"""Every notebooks/*.ipynb runs top to bottom (FAST sizes, 8 simulated CPU devices) without an error, and is
what `notebooks/build.py` writes from its source in `notebooks/src/` (edit the source, then rebuild).

The kernel is this interpreter (sys.executable) through a kernelspec written for the test, so the result
does not depend on which "python3" kernelspec a machine has installed. Its environment asks for the small
sizes (JAXRING_NOTEBOOK_FAST=1) and 8 CPU devices. XLA's backend optimisation level 0 cuts compile times
on CPU by about 40% (most of a notebook's time is compiling); the bytes moved and buffer sizes that the
notebooks print came out the same with and without it.
"""

import importlib.util
import json
import pathlib
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402  (a dependency of nbclient)
from jupyter_client.manager import KernelManager  # noqa: E402

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
KERNEL_ENV = {
    "JAXRING_NOTEBOOK_FAST": "1",
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
}


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
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
