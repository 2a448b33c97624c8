"""Llama-3-8B at 8,388,608 tokens on 8 x H100 (deviceless compile): the plans that fit and those that come close;
per device the compiled and estimated device bytes, and the host bytes against the 256 GiB a GPU of a DGX
node has.

    python benchmarks/llama3_8b_8m.py                    # -> benchmarks/results/llama3_8b_8m.json
    python benchmarks/llama3_8b_8m.py --rows "ulysses"   # the rows whose name contains "ulysses"

At this length the 32 layers' checkpointed inputs alone are 32 x 8 GiB = 256 GiB of host memory a device with
any plan (the sequence is split 8 ways either way), so a plan that offloads them all is host-bound here.
Recompute blocks of K layers keep 32/K block inputs, and while a block's backward runs its K layers' inputs,
in host memory too (32/K + K inputs: 12 at K = 4); the vocabulary split over sp takes the fp32 tables off the
device. Each row is compiled as `train.py --compile-for h100x8` compiles it (`llama3_8b_4m.measure`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless GPU compiles need the CPU platform selected
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling llama3_8b_4m.py, however it is run

from llama3_8b_4m import GIB, measure

from jaxring.analysis import gpu
from jaxring.analysis.records import benchmark_record, save_record
from jaxring.planner.cluster import Cluster

SEQ = 8388608
HOST_BUDGET_GIB = 256.0  # a DGX H100 node's host memory per GPU (`jaxring.aot.compile_for.TARGETS`)
TILES = dict(preset="llama3-8b", batch_size=1, remat="full", loss_tile=4096, mlp_tile=4096)
ULYSSES = TILES | dict(sp=8, attention="ulysses", zero=3, offload="layer_inputs+weights")
METP = TILES | dict(tp=8, tensor_parallel="metp", vocab_split="ring", offload="layer_inputs+weights")
ROWS = {
    "ulysses sp8, tiled block, weights offloaded": ULYSSES,
    "the same, UPipe head chunks 2": ULYSSES | dict(head_chunks=2),
    "the same, UPipe head chunks 4": ULYSSES | dict(head_chunks=4),
    "the same, recompute blocks of 2": ULYSSES | dict(remat_layers=2),
    "the same, recompute blocks of 4": ULYSSES | dict(remat_layers=4),
    "the same, and UPipe head chunks 2 (--plan auto with --vocab-split none)": ULYSSES
    | dict(remat_layers=4, head_chunks=2),
    "ulysses sp8, vocab ring, tiled block, weights offloaded, blocks of 4": ULYSSES
    | dict(vocab_split="ring", remat_layers=4),
    "the same, and UPipe head chunks 4": ULYSSES | dict(vocab_split="ring", remat_layers=4, head_chunks=4),
    "metp tp8, vocab ring, weights offloaded": METP,
    "metp tp8, vocab ring, weights offloaded, recompute blocks of 2": METP | dict(remat_layers=2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/llama3_8b_8m.json")
    parser.add_argument("--rows", nargs="*", help="only the rows whose name contains one of these")
    args = parser.parse_args()

    budget = Cluster.of("h100", 1).usable_memory / GIB
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = benchmark_record(
        "llama3_8b_8m",
        gpu.gpu_devices("h100", 8),
        {"model": "llama3-8b", "batch": 1, "seq_len": SEQ, "target": "h100 x 8 (deviceless)", "budget_gib": budget},
    )
    record["results"] = []
    for name, settings in ROWS.items():
        if args.rows and not any(r in name for r in args.rows):
            continue
        row = {"plan": name, "settings": settings, **measure(settings, SEQ, "h100"), "commit": commit}
        host = row["host_gib"]
        row.update(fits_device=row["compiled_gib"] <= budget, fits_host=host <= HOST_BUDGET_GIB)
        record["results"].append(row)
        print(
            f"{name}: device {row['compiled_gib']:.1f} GiB (estimate {row['estimate_gib']:.1f}, budget {budget:.1f}), "
            f"host {host:.1f} GiB (estimate {row['host_estimate_gib']:.1f}, budget {HOST_BUDGET_GIB:.0f})",
            flush=True,
        )
        save_record(record, args.out)


if __name__ == "__main__":
    main()
