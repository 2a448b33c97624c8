"""UPipe's head chunks (Ulysses `--head-chunks G`, the projections inside the chunks) on Llama-3-8B, 8 x H100
(deviceless compile): the compiled and estimated bytes per device for G = 1, 2, 4 at two lengths, the points
the calibration term `ulysses.untied_chunks_assembly` (jaxring/planner/calibrations/gpu.json) is fitted on.

    python benchmarks/upipe_chunks.py        # -> benchmarks/results/upipe_chunks.json

The run is `llama3_8b_8m.py`'s Ulysses row: sp8, ZeRO-3, tiles of 4096 (the tiled block), remat full, the layer
inputs and the weights offloaded; each row is compiled as `train.py --compile-for h100x8` compiles it.
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless GPU compiles need the CPU platform selected
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, however it is run

from llama3_8b_4m import measure
from llama3_8b_8m import ULYSSES

from jaxring.analysis import gpu
from jaxring.analysis.records import benchmark_record, save_record

LENGTHS = (6291456, 8388608)
CHUNKS = (1, 2, 4)


def main() -> None:
    out = "benchmarks/results/upipe_chunks.json"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = benchmark_record(
        "upipe_chunks", gpu.gpu_devices("h100", 8), {"model": "llama3-8b", "settings": ULYSSES, "target": "h100 x 8"}
    )
    record["results"] = []
    for seq in LENGTHS:
        for g in CHUNKS:
            row = {"head_chunks": g, **measure(ULYSSES | dict(head_chunks=g), seq, "h100"), "commit": commit}
            record["results"].append(row)
            print(
                f"{seq:,} tokens, G = {g}: compiled {row['compiled_gib']:.1f} GiB, estimate "
                f"{row['estimate_gib']:.1f} ({row['ratio']:.3f})",
                flush=True,
            )
            save_record(record, out)


if __name__ == "__main__":
    main()
