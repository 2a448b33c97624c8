"""Refit the cost model's fitted terms (jaxring/planner/calibrations/<target>.json) from recorded compiles.

    python benchmarks/refit_calibration.py              # each refittable term: its recorded error, the best value
    python benchmarks/refit_calibration.py --write      # and rewrite the terms whose best value differs

Recorded compiles: benchmarks/results/memory_model.json (the compiled CPU step of benchmarks/memory_model.py's
grid, target "cpu") and benchmarks/results/memory_techniques.json (deviceless 8 x H100 compiles of GPT-7B,
target "gpu"); memory_techniques_tpu.json (the same on a deviceless v5p-16) is priced and reported, no TPU term
being fitted yet. Each row is priced again by `jaxring.planner.cost_model.memory` with each candidate value of a
term (the others as they are); the value kept is the one with the most rows within 10% of the compiled bytes
(the criterion the terms were fitted by), the value now in the file on a tie, else the smallest largest error. Terms fitted on compiles not recorded here
(the Llama-3-8B rows of longest_sequence.json, llama3_8b_4m.json) are listed and left as they are.
Record new compiles first (python benchmarks/memory_model.py; the GPU benchmarks with the gpu-compile extra).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxring.planner import calibration
from jaxring.planner import cost_model as cost
from jaxring.planner.params import param_leaves
from jaxring.planner.space import Candidate, Workload

HERE = Path(__file__).resolve().parent
# benchmarks/memory_model.py: the grid's cases, its GPT config and the GPU rows' techniques
_spec = importlib.util.spec_from_file_location("memory_model", HERE / "memory_model.py")
memory_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory_model)

RESULTS = HERE / "results"
CALIBRATIONS = HERE.parent / "jaxring" / "planner" / "calibrations"
TOLERANCE = 0.10

# target: {term: candidate values}; the terms the recorded compiles of that target exercise
GRID = {
    "cpu": {
        "layer_working_share": [round(0.5 + 0.05 * i, 2) for i in range(11)],
        "recomputed_stream_arrays": list(range(4, 15)),
        "pipeline_tick_chunks": [0, 1, 2, 3, 4],
    },
    "gpu": {
        "tiled_mlp_saving": [round(3 + 0.5 * i, 1) for i in range(9)],
    },
}


def cpu_rows() -> list[tuple[Workload, Candidate, float]]:
    """(workload, candidate, compiled bytes) of each row of memory_model.json."""
    recorded = json.loads((RESULTS / "memory_model.json").read_text())
    cases = memory_model.cases()
    out = []
    for r in recorded["results"]:
        if r["case"] not in cases:
            continue
        seq_len, batch, settings = cases[r["case"]]
        w = Workload("gpt", memory_model.config(), seq_len, batch, r.get("precision", "fp32"))
        out.append((w, Candidate.of(**settings), float(r["compiled_bytes"])))
    return out


def gpu_rows() -> list[tuple[Workload, Candidate, float]]:
    """(workload, candidate, compiled bytes) of each row of memory_techniques.json (8 x H100)."""
    return [(w, c, compiled) for _, w, c, compiled in memory_model.technique_rows(RESULTS / "memory_techniques.json")]


def tpu_rows() -> list[tuple[Workload, Candidate, float]]:
    """(workload, candidate, compiled bytes) of each row of memory_techniques_tpu.json (a TPU slice)."""
    path = RESULTS / "memory_techniques_tpu.json"
    return [(w, c, compiled) for _, w, c, compiled in memory_model.technique_rows(path)]


def ratios(rows, cpu: bool) -> list[float]:
    """estimate / compiled bytes of each row, with the calibration now in effect."""
    out = []
    for w, c, compiled in rows:
        plan = c.check(w)
        out.append(cost.memory(w, c, param_leaves(w.model, w.config, plan), cpu=cpu, plan=plan).total / compiled)
    return out


def score(rs: list[float]) -> tuple[int, float]:
    """(rows within TOLERANCE, largest error): more rows first, then the smaller largest error."""
    return sum(abs(r - 1) <= TOLERANCE for r in rs), max(abs(r - 1) for r in rs)


def with_value(data: dict, term: str, value) -> dict:
    """A copy of a calibration file's data with `term` set to `value` (a share: every remat mode)."""
    data = json.loads(json.dumps(data))
    old = data["terms"][term]["value"]
    data["terms"][term]["value"] = {k: value for k in old} if isinstance(old, dict) else value
    return data


def refit(target: str, rows, folder: Path) -> dict:
    """{term: (value now, its score, best value, its score)} over GRID[target]."""
    data = json.loads((CALIBRATIONS / f"{target}.json").read_text())
    found = {}
    for term, values in GRID[target].items():
        now = data["terms"][term]["value"]
        now_scalar = next(iter(now.values())) if isinstance(now, dict) else now
        scores = {}
        for i, value in enumerate(values):
            trial = folder / f"{target}-{term}-{i}"
            trial.mkdir()
            (trial / f"{target}.json").write_text(json.dumps(with_value(data, term, value)))
            os.environ[calibration.ENV] = str(trial)
            scores[value] = score(ratios(rows, cpu=target == "cpu"))
        os.environ.pop(calibration.ENV, None)
        best = max(values, key=lambda v: (scores[v][0], v == now_scalar, -scores[v][1]))
        now_score = scores.get(now_scalar) or score(ratios(rows, cpu=target == "cpu"))
        found[term] = (now_scalar, now_score, best, scores[best])
    return found


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the terms whose best value differs")
    parser.add_argument("--target", choices=sorted(GRID), action="append", help="default: every target")
    parser.add_argument(
        "--out", type=Path, default=CALIBRATIONS, help="--write's folder (default: the package's, %(default)s)"
    )
    args = parser.parse_args()
    os.environ.pop(calibration.ENV, None)
    sources = {"cpu": ("memory_model.json", cpu_rows), "gpu": ("memory_techniques.json", gpu_rows)}
    with tempfile.TemporaryDirectory() as tmp:
        for target in args.target or sorted(GRID):
            record, read = sources[target]
            rows = read()
            found = refit(target, rows, Path(tmp))
            path = CALIBRATIONS / f"{target}.json"
            data = json.loads(path.read_text())
            for term, (now, (n_now, err_now), best, (n_best, err_best)) in found.items():
                print(
                    f"{target} {term}: now {now} ({n_now}/{len(rows)} rows within 10%, largest error "
                    f"{err_now:.1%}); best {best} ({n_best}/{len(rows)}, {err_best:.1%})"
                )
                if args.write and best != now:
                    data = with_value(data, term, best)
                    data["terms"][term]["fitted_on"] = (
                        f"refit by benchmarks/refit_calibration.py on {record} ({n_best} of {len(rows)} rows within "
                        f"10%, largest error {err_best:.1%}), {datetime.date.today()}, commit {_commit()}"
                    )
            fixed = [t for t in data["terms"] if t not in GRID[target]]
            print(f"{target}: left as fitted (their compiles are not recorded here): {', '.join(fixed)}")
            if args.write:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / path.name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    tpu = ratios(tpu_rows(), cpu=False)
    print(
        f"tpu: no term fitted (priced with gpu.json): {sum(abs(r - 1) <= TOLERANCE for r in tpu)}/{len(tpu)} rows of "
        f"memory_techniques_tpu.json within 10%, estimate / compiled {min(tpu):.2f}-{max(tpu):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
