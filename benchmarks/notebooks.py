"""Wall time of every notebook at its full sizes (what a reader sees: JAXRING_NOTEBOOK_FAST unset), top to
bottom in a fresh kernel on 8 simulated CPU devices, as a Colab/JupyterLab user on a small machine runs it.

    python benchmarks/notebooks.py                          # all -> benchmarks/results/notebooks.json
    python benchmarks/notebooks.py --only 02_strategies     # some (a rerun keeps the other rows)

The tests run the same notebooks at their FAST sizes (tests/integration/test_notebooks.py); this measures the sizes the
notebooks are written for. The record says how many CPUs the host has and its load average before and after
each notebook: figures taken while something else ran are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import nbclient
import nbclient.exceptions
import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 1800


def run_one(path: pathlib.Path) -> dict:
    """{notebook, seconds, error, load averages}: one notebook executed in a fresh kernel at full sizes (error:
    the last line of the failing cell's error, None when every cell ran)."""
    nb = nbformat.read(path, as_version=4)
    os.environ.pop("JAXRING_NOTEBOOK_FAST", None)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    error = None
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:  # recorded, and the other notebooks still run
        error = str(e).strip().splitlines()[-1]
    seconds = time.perf_counter() - start
    return {
        "notebook": path.name,
        "seconds": round(seconds, 1),
        "error": error,
        "under_10_min": error is None and seconds < 600,
        "load_1min_before": round(load_before, 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="notebook stems to run (default: all)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "notebooks.json"))
    args = parser.parse_args(argv)

    import jax

    from jaxring.analysis.records import benchmark_record, save_record

    chosen = [p for p in NOTEBOOKS if args.only is None or p.stem in args.only]
    unknown = set(args.only or ()) - {p.stem for p in NOTEBOOKS}
    if unknown:
        parser.error(f"--only {sorted(unknown)}: no such notebook (choices: {[p.stem for p in NOTEBOOKS]})")
    record = benchmark_record("notebooks", jax.devices("cpu")[:1], {"sizes": "full (JAXRING_NOTEBOOK_FAST unset)"})
    record["device"] = f"8 simulated CPU devices on {os.cpu_count()} host CPUs"
    out = pathlib.Path(args.out)
    if out.exists():  # keep the rows of notebooks not rerun
        old = json.loads(out.read_text())
        record["results"] = [r for r in old.get("results", []) if r["notebook"] not in {p.name for p in chosen}]
    for path in chosen:
        row = run_one(path)
        print(json.dumps(row), flush=True)
        record["results"] = sorted([*record["results"], row], key=lambda r: r["notebook"])
        save_record(record, str(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
