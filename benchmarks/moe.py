"""One MoE FFN layer (jaxring.moe) under expert parallelism: tokens/s of forward+backward, compiled peak memory
and all-to-all bytes per device, for ep in {1, 2, 4, 8} (the other devices data parallel: dp = 8/ep), dropless
against capacity factor 1.25.

    python benchmarks/moe.py                              # -> benchmarks/results/moe.json

Sizes: "tiny" (hidden 64, 8 experts top-2, ffn 128, 1024 tokens) and "mid" (hidden 256, 16 experts top-2,
ffn 512, 4096 tokens), SwiGLU, fp32, the same global batch on every mesh. Dropless is measured with both
grouped matmuls ("blocked", jaxring's CPU default, and "ragged_dot", which jax lowers on CPU to a masked dense
matmul: E_local times the FLOPs and an [rows, E_local*hidden] temporary). Simulated CPU devices share the
host's cores: read the times as relative, for this host.
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

from jaxring.platform import benchmark_record, save_record, use_cpu_devices_if_no_accelerator

SIZES = {  # name -> (hidden, experts, top-k, ffn, batch, seq)
    "tiny": (64, 8, 2, 128, 8, 128),
    "mid": (256, 16, 2, 512, 16, 256),
}


def setup(size, ep, capacity_factor, grouped_matmul, devices):
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxring.mesh import DATA_AXES, make_mesh
    from jaxring.moe import MoE, MoEConfig, param_specs, sharded_moe_ffn

    hidden, experts, k, ffn, batch, seq = SIZES[size]
    config = MoEConfig(num_experts=experts, experts_per_token=k, ffn=ffn, activation="swiglu",
                       capacity_factor=capacity_factor, grouped_matmul=grouped_matmul)
    mesh = make_mesh(dp=len(devices) // ep, ep=ep, devices=devices)
    params = MoE(hidden, config, rngs=nnx.Rngs(0)).params()
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, param_specs(config))
    x_sharding = NamedSharding(mesh, P(DATA_AXES, "sp", None))
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (batch, seq, hidden)), x_sharding)
    dy = jax.device_put(jax.random.normal(jax.random.PRNGKey(2), (batch, seq, hidden)), x_sharding)

    def train_step(x, params, dy):
        def loss(x, params):
            y, stats = sharded_moe_ffn(x, params, mesh=mesh, config=config)
            return jnp.sum(y * dy) + stats["loss"], stats
        (_, stats), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
        return grads, stats

    return train_step, (x, params, dy), config, batch * seq


def measure(size, ep, capacity_factor, grouped_matmul, devices, runs):
    from jaxring.analysis import compile_stats
    from jaxring.timing import median_seconds

    step, args, config, tokens = setup(size, ep, capacity_factor, grouped_matmul, devices)
    s = compile_stats(step, *args, num_devices=len(devices))
    fn = jax.jit(step)
    seconds = median_seconds(fn, *args, runs=runs)
    stats = fn(*args)[1]
    return {"size": size, "ep": ep, "dp": len(devices) // ep,
            "dispatch": f"dropless ({grouped_matmul})" if capacity_factor is None else f"capacity {capacity_factor}",
            "tokens": tokens, "fwd_bwd_s": seconds, "tokens_per_s": tokens / seconds,
            "peak_bytes": s.peak_bytes, "temp_bytes": s.temp_bytes, "argument_bytes": s.argument_bytes,
            "all_to_all_bytes": s.bytes_moved["all-to-all"], "bytes_moved": s.bytes_moved,
            "drop_rate": float(stats["drop_rate"]), "load_imbalance": float(stats["load_imbalance"])}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="*", default=list(SIZES))
    p.add_argument("--eps", type=int, nargs="*", default=[1, 2, 4, 8])
    p.add_argument("--capacity-factors", type=float, nargs="*", default=[1.25])
    p.add_argument("--grouped-matmuls", nargs="*", default=["blocked", "ragged_dot"],
                   help="dropless grouped matmul implementations to measure")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "moe.json"))
    args = p.parse_args()
    devices = use_cpu_devices_if_no_accelerator(8)
    record = benchmark_record("moe", devices, vars(args) | {"sizes_def": {s: SIZES[s] for s in args.sizes},
                                                            "sizes_fields": "hidden, experts, k, ffn, batch, seq"})
    dispatches = [(None, gm) for gm in args.grouped_matmuls] + [(cf, "auto") for cf in args.capacity_factors]
    for size in args.sizes:
        for ep in args.eps:
            for cf, gm in dispatches:
                row = measure(size, ep, cf, gm, devices, args.runs)
                record["results"].append(row)
                print({k: v for k, v in row.items() if k != "bytes_moved"}, flush=True)
                save_record(record, args.out)


if __name__ == "__main__":
    main()
