"""Compiled per-device memory and collective bytes of the GPT train step's gradient path under
--remat none/selective/full.

    python benchmarks/remat_memory.py [--out FILE] [--note TEXT]

A 6-layer tiny GPT (hidden 64, 4 heads, ffn 256, vocab 256), batch 8 × seq 256, fp32, on 8 simulated CPU
devices: sp8 ring, dp2 × tp2 × sp2 (Megatron × ring) and dp2 × tp4 METP. Per mode, temporaries from
`memory_analysis()` and the bytes each collective kind moves per device (`collective_traffic`) from the
compiled program; exact, no timing. What a mode recomputes shows in the bytes: a recomputed Megatron column
linear gathers its input again, a recomputed ring or METP forward makes its hops again. Writes
benchmarks/results/remat_memory.json (each row with the commit it was measured at).
"""

import argparse
import os
import subprocess

from jaxring.analysis.records import benchmark_record, save_record
from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator

MESHES = {
    "sp8 ring": (dict(sp=8), dict(attention="ring")),
    "dp2 x tp2 x sp2 ring megatron": (dict(dp=2, tp=2, sp=2), dict(attention="ring", tensor_parallel="megatron")),
    "dp2 x tp4 metp": (dict(dp=2, tp=4), dict(attention="dense", tensor_parallel="metp")),
}
B, S = 8, 256


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "remat_memory.json"))
    parser.add_argument("--note", default="", help="recorded with every row")
    args = parser.parse_args()
    devices = use_cpu_devices_if_no_accelerator(8)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxring
    from jaxring.analysis.compiled import collective_traffic
    from jaxring.models import gpt
    from jaxring.nn import MemoryPolicy
    from jaxring.parallel.plan import ParallelPlan
    from jaxring.train.step import TrainStep

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(jaxring.__file__)
    ).stdout.strip()
    cfg = gpt.GPTConfig(vocab_size=256, num_layers=6, hidden=64, num_heads=4, ffn=256)
    model = gpt.GPT(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    tokens = jnp.zeros((B, S), jnp.int32)
    batch = {"tokens": tokens, "targets": tokens, "positions": jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))}
    record = benchmark_record(
        "remat_memory",
        devices,
        {"model": "gpt", "num_layers": 6, "hidden": 64, "batch": B, "seq_len": S, "dtype": "fp32"},
    )
    record["results"] = []
    for name, (degrees, options) in MESHES.items():
        plan = ParallelPlan(jaxring.make_mesh(**degrees, devices=devices), **options)
        for remat in ("none", "selective", "full"):
            step = TrainStep(plan, model, None, gpt.NextTokenObjective(B, S), memory=MemoryPolicy(remat=remat))
            params = jax.device_put(nnx.to_pure_dict(state), step.shardings(step.param_specs))
            compiled = step.build_grads().lower(params, batch, jax.random.PRNGKey(0)).compile()
            memory = compiled.memory_analysis()
            moved = collective_traffic(compiled.as_text(), len(devices))[0]
            row = {
                "mesh": name,
                "remat": remat,
                "temp_bytes": memory.temp_size_in_bytes,
                "argument_bytes": memory.argument_size_in_bytes,
                "collective_bytes": {kind: n for kind, n in moved.items() if n},
                "commit": commit,
                "note": args.note,
            }
            record["results"].append(row)
            save_record(record, args.out)
            print(row, flush=True)


if __name__ == "__main__":
    main()
