"""Compiled per-device memory of the GPT train step's gradient path under --remat none/selective/full.

    python benchmarks/remat_memory.py

A 6-layer tiny GPT (hidden 64, 4 heads, ffn 256, vocab 256), batch 8 × seq 256, fp32, on 8 simulated CPU
devices: sp8 ring and dp2 × tp2 × sp2 (Megatron × ring). Temporaries from `memory_analysis()` of the compiled
program; exact, no timing. Writes benchmarks/results/remat_memory.json.
"""
import os

from jaxring.platform import benchmark_record, save_record, use_cpu_devices_if_no_accelerator

MESHES = {"sp8 ring": dict(sp=8), "dp2 x tp2 x sp2 ring megatron": dict(dp=2, tp=2, sp=2)}
B, S = 8, 256


def main():
    devices = use_cpu_devices_if_no_accelerator(8)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxring
    from jaxring.nn import param_placements
    from jaxring.plan import ParallelPlan
    from jaxring.train.step import TrainStep
    from models import gpt

    cfg = gpt.GPTConfig(vocab_size=256, num_layers=6, hidden=64, num_heads=4, ffn=256)
    model = gpt.GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((B, S), jnp.int32)
    batch = {"tokens": tokens, "targets": tokens,
             "positions": jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))}
    record = benchmark_record("remat_memory", devices, {"model": "gpt", "num_layers": 6, "hidden": 64,
                                                       "batch": B, "seq_len": S, "dtype": "fp32"})
    out = os.path.join(os.path.dirname(__file__), "results", "remat_memory.json")
    record["results"] = []
    for name, degrees in MESHES.items():
        plan = ParallelPlan(jaxring.make_mesh(**degrees, devices=devices), attention="ring",
                            **({"tensor_parallel": "megatron"} if degrees.get("tp") else {}))
        placements = param_placements(state, plan)
        for remat in ("none", "selective", "full"):
            step = TrainStep(plan, graphdef, placements, None, gpt.NextTokenObjective(B, S), remat=remat,
                             stack=model.STACK, layer_graphdef=nnx.split(getattr(model, model.STACK))[0])
            params = jax.device_put(nnx.to_pure_dict(state), step.shardings(step.param_specs))
            memory = step.build_grads().lower(params, batch, jax.random.PRNGKey(0)).compile().memory_analysis()
            row = {"mesh": name, "remat": remat, "temp_bytes": memory.temp_size_in_bytes,
                   "argument_bytes": memory.argument_size_in_bytes}
            record["results"].append(row)
            save_record(record, out)
            print(row, flush=True)


if __name__ == "__main__":
    main()
