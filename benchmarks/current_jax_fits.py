"""The long-sequence fits on the installed jax's XLA (deviceless compiles, `train.py --plan auto --compile-for`):
Llama-3-8B at 655,360 tokens on one H100, at 8,388,608 on eight (the planner's plan, and with the tables or the
UPipe head chunks held off) and at 4,194,304 on eight. Per command the verdict line: compiled and estimated
device GiB, host GiB.

    VENV=.venv-gpu bash tools/setup.sh gpu-compile
    .venv-gpu/bin/python benchmarks/current_jax_fits.py     # -> benchmarks/results/current_jax_fits.json
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless GPU compiles need the CPU platform selected

import jax

from jaxring.analysis import gpu
from jaxring.analysis.records import benchmark_record, save_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = ["--preset", "llama3-8b", "--batch-size", "1", "--plan", "auto"]
COMMANDS = {
    "655,360 tokens, one H100": [*LLAMA, "--seq-len", "655360", "--compile-for", "h100x1"],
    "8,388,608 tokens, eight H100": [*LLAMA, "--seq-len", "8388608", "--compile-for", "h100x8"],
    "8,388,608, tables replicated": [
        *LLAMA,
        "--seq-len",
        "8388608",
        "--compile-for",
        "h100x8",
        "--vocab-split",
        "none",
    ],
    "8,388,608, tables replicated, no head chunks": [
        *LLAMA,
        *("--seq-len", "8388608", "--compile-for", "h100x8", "--vocab-split", "none", "--head-chunks", "1"),
    ],
    "4,194,304 tokens, eight H100": [*LLAMA, "--seq-len", "4194304", "--compile-for", "h100x8"],
}
VERDICT = re.compile(
    r"(fits|does not fit): compiled ([\d.]+) GiB per device, estimate ([\d.]+) GiB, budget ([\d.]+) GiB"
    r"(?:; host memory ([\d.]+) GiB per device, estimate ([\d.]+) GiB)?"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="", help="only the commands whose name contains this")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "current_jax_fits.json"))
    args = parser.parse_args()
    ok, why = gpu.available()
    if not ok:
        sys.exit(f"error: {why}")
    record = benchmark_record("current_jax_fits", gpu.gpu_devices("h100", 1), {"jaxlib": jax.__version__})
    for name, argv in COMMANDS.items():
        if args.rows not in name:
            continue
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True, text=True)
        lines = run.stdout.strip().splitlines()
        m = VERDICT.search(lines[-1]) if lines else None
        row = {"name": name, "command": "python train.py " + " ".join(argv), "exit": run.returncode}
        row["seconds"] = round(time.perf_counter() - start, 1)
        if m:
            row |= {"verdict": m.group(1), "compiled_gib": float(m.group(2)), "estimate_gib": float(m.group(3))}
            row |= {
                "budget_gib": float(m.group(4)),
                "estimate_over_compiled": round(float(m.group(3)) / float(m.group(2)), 3),
            }
            if m.group(5):
                row |= {"host_gib": float(m.group(5)), "host_estimate_gib": float(m.group(6))}
            row["plan"] = lines[0]
        else:
            row["error"] = (run.stderr.strip().splitlines() or lines or [""])[-1]
        print(row, flush=True)
        record["results"].append(row)
        save_record(record, args.out)


if __name__ == "__main__":
    main()
