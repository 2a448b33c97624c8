"""Llama-3-8B at 4,194,304 tokens on 8 x H100 (deviceless compile): per-device memory of the plans that get
there, compiled and estimated, and what `--plan auto` picks.

    python benchmarks/llama3_8b_4m.py                         # -> benchmarks/results/llama3_8b_4m.json
    python benchmarks/llama3_8b_4m.py --seq-len 2097152 --target h200 --no-longer --out /tmp/r.json

Each row is the run spec `train.py` would build (batch 1, bf16 compute, fp32 weights and AdamW moments,
clipping, the Pallas flash kernel), compiled for the target's 8 GPUs with no GPU by
`jaxring.aot.train_step.compile_train_step` (what `train.py --compile-for` compiles). Figures per device:
`memory_analysis()`'s argument + output + temp - alias bytes (device), its host bytes (the offloaded layer
inputs and optimizer state), and the planner's estimate (`jaxring.planner.cost_model.memory`) of the same plan.
The auto pick is also compiled at 4.5M, 5M and 6M tokens (the longest that fits).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless GPU compiles need the CPU platform selected

from jaxring.analysis import gpu
from jaxring.analysis.records import benchmark_record, save_record
from jaxring.aot.compile_for import lowered_step
from jaxring.planner import cost_model as cost
from jaxring.planner.cluster import Cluster
from jaxring.planner.fit import candidate_of, workload_of
from jaxring.planner.params import param_leaves
from jaxring.run.spec import RunSpec

GIB = 2**30
BASE = dict(preset="llama3-8b", batch_size=1, tp=8, tensor_parallel="metp", remat="full", loss_tile=4096, mlp_tile=4096)
AUTO = "metp tp8, tiles 4096, offload layer_inputs+optimizer (--plan auto's pick at 4M)"
ROWS = {
    "metp tp8, tiles 4096, offload layer_inputs": BASE | dict(offload="layer_inputs"),
    AUTO: BASE | dict(offload="layer_inputs+optimizer"),
}
LONGER = (4718592, 5242880, 6291456)  # the auto pick at 4.5M, 5M and 6M tokens: the longest that fits


def measure(settings: dict, seq_len: int, target: str) -> dict:
    """The compiled and estimated bytes per device of the run `settings` at `seq_len` on 8 GPUs of `target`:
    the step `train.py --compile-for` lowers (`jaxring.aot.compile_for.lowered_step`)."""

    devices = gpu.gpu_devices(target, 8)
    spec = RunSpec.of(seq_len=seq_len, **settings).resolved(len(devices))
    pallas = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, block_ops="pallas"))
    w, c = workload_of(pallas), candidate_of(pallas)
    estimate = cost.memory(w, c, param_leaves(w.model, w.config, c.check(w)), cpu=False)
    start = time.perf_counter()
    lowered, _, _ = lowered_step(spec, devices)
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    device = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return {
        "seq_len": seq_len,
        "precision": spec.compute_precision,
        "compiled_gib": device / GIB,
        "estimate_gib": estimate.total / GIB,
        "ratio": estimate.total / device,
        "argument_gib": m.argument_size_in_bytes / GIB,
        "temp_gib": m.temp_size_in_bytes / GIB,
        "host_argument_gib": m.host_argument_size_in_bytes / GIB,
        "host_temp_gib": m.host_temp_size_in_bytes / GIB,
        "host_gib": (
            m.host_argument_size_in_bytes
            + m.host_output_size_in_bytes
            + m.host_temp_size_in_bytes
            - m.host_alias_size_in_bytes
        )
        / GIB,
        "host_estimate_gib": estimate.host / GIB,
        "estimate_parts_gib": {k: round(v / GIB, 3) for k, v in estimate.as_dict().items()},
        "compile_s": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4194304)
    parser.add_argument("--target", default="h100", choices=("h100", "h200"))
    parser.add_argument("--out", default="benchmarks/results/llama3_8b_4m.json")
    parser.add_argument("--no-longer", dest="longer", action="store_false", help="skip the 4.5M, 5M and 6M rows")
    args = parser.parse_args()

    budget = Cluster.of(args.target, 1).usable_memory / GIB
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = benchmark_record(
        "llama3_8b_4m",
        gpu.gpu_devices(args.target, 8),
        {"model": "llama3-8b", "batch": 1, "target": f"{args.target} x 8 (deviceless)", "budget_gib": budget},
    )
    record["results"] = []
    runs = [(name, settings, args.seq_len) for name, settings in ROWS.items()]
    runs += [(AUTO, ROWS[AUTO], n) for n in (LONGER if args.longer else ())]
    for name, settings, seq_len in runs:
        row = {"plan": name, **measure(settings, seq_len, args.target), "commit": commit}
        row["fits"] = row["compiled_gib"] <= budget
        record["results"].append(row)
        print(
            f"{name} at {seq_len}: compiled {row['compiled_gib']:.2f} GiB, estimate {row['estimate_gib']:.2f} GiB",
            flush=True,
        )
        save_record(record, args.out)


if __name__ == "__main__":
    main()
