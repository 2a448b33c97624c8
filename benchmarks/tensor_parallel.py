"""One GPT layer (LN → attention → residual → LN → MLP → residual) under Megatron TP+SP, Optimus 2D and METP:
compiled per-device peak memory against sequence length, bytes moved, median forward+backward time, and
the largest sequence whose forward+backward fits a per-device budget (found by compiling; nothing is run).

    python benchmarks/tensor_parallel.py                  # -> benchmarks/results/tensor_parallel.json

Settings follow METP's comparison: p = 8, hidden 1024, 16 heads, ffn 4h, GELU, causal, batch 1, fp32.
Optimus needs p = q²: it runs as a 2×2 grid × dp 2 on 8 devices (batch must then be a multiple of q·dp = 4)
and as 2×2 on 4 devices. The memory ratio is compared with METP's r(p) = (3+2p)/(p(4+p)).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

from jaxring.analysis.records import benchmark_record, save_record
from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator

METHODS = {  # name -> (module, mesh degrees, devices, batch)
    "megatron": ("megatron", dict(tp=8), 8, 1),
    "metp": ("metp", dict(tp=8), 8, 1),
    "optimus-2x2-dp2": ("optimus", dict(dp=2, tp=4), 8, 4),
    "optimus-2x2": ("optimus", dict(tp=4), 4, 2),
}


def layer_fn(module, mesh, heads):
    """f(x, params, positions, dy) -> (y, grads): one pre-LN block's forward and backward on global arrays."""

    def block(x, params, positions):
        ln = lambda z: (z - z.mean(-1, keepdims=True)) * jax.lax.rsqrt(z.var(-1, keepdims=True) + 1e-5)
        attn = {k: params[k] for k in ("wq", "wk", "wv", "wo")}
        x = x + module.attention_block(
            ln(x), attn, positions, mesh=mesh, num_heads=heads, num_kv_heads=heads, causal=True, rope_theta=10000.0
        )
        return x + module.mlp_block(ln(x), {"w_in": params["w_in"], "w_out": params["w_out"]}, mesh=mesh)

    def fwd_bwd(x, params, positions, dy):
        y, vjp = jax.vjp(lambda x, p: block(x, p, positions), x, params)
        return y, vjp(dy)

    return fwd_bwd


def abstract_args(module, mesh, batch, seq, hidden, ffn):
    shapes = {
        "wq": (hidden, hidden),
        "wk": (hidden, hidden),
        "wv": (hidden, hidden),
        "wo": (hidden, hidden),
        "w_in": (hidden, ffn),
        "w_out": (ffn, hidden),
    }
    specs = {}
    specs.update(module.param_specs(mesh, {k: shapes[k] for k in ("wq", "wk", "wv", "wo")}))
    specs.update(module.param_specs(mesh, {k: shapes[k] for k in ("w_in", "w_out")}))
    params = {k: jax.ShapeDtypeStruct(v, jnp.float32, sharding=specs[k]) for k, v in shapes.items()}
    x = jax.ShapeDtypeStruct((batch, seq, hidden), jnp.float32)
    pos = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return x, params, pos, x


def stats(method, seq, hidden, heads, devices):
    import importlib

    from jaxring.analysis import compile_stats
    from jaxring.core.mesh import make_mesh

    name, degrees, count, batch = METHODS[method]
    module = importlib.import_module(f"jaxring.parallel.tensor.{name}")
    mesh = make_mesh(devices=devices[:count], **degrees)
    args = abstract_args(module, mesh, batch, seq, hidden, 4 * hidden)
    s = compile_stats(layer_fn(module, mesh, heads), *args, num_devices=count)
    return (
        {
            "peak_bytes": s.peak_bytes,
            "temp_bytes": s.temp_bytes,
            "argument_bytes": s.argument_bytes,
            "bytes_moved": s.bytes_moved,
            "total_bytes_moved": s.total_bytes_moved,
            "batch": batch,
        },
        module,
        mesh,
    )


def max_seq(method, budget, hidden, heads, devices, step, limit):
    """Largest multiple of `step` (≤ limit) whose compiled forward+backward peak fits `budget` bytes."""
    lo, hi = 0, limit // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            fits = stats(method, mid * step, hidden, heads, devices)[0]["peak_bytes"] <= budget
        except Exception:
            fits = False
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo * step


def time_fwd_bwd(method, seq, hidden, heads, devices):
    from jaxring.core.timing import median_seconds

    _, module, mesh = stats(method, seq, hidden, heads, devices)
    batch = METHODS[method][3]
    key = jax.random.PRNGKey(0)
    x, params, _pos, _dy = abstract_args(module, mesh, batch, seq, hidden, 4 * hidden)
    real = {k: jax.device_put(jax.random.normal(key, v.shape) * 0.02, v.sharding) for k, v in params.items()}
    xv = jax.random.normal(key, x.shape)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    fn = jax.jit(layer_fn(module, mesh, heads))
    return median_seconds(fn, xv, real, positions, xv, runs=3)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqs", type=int, nargs="*", default=[2048, 8192, 32768])
    p.add_argument("--time-seqs", type=int, nargs="*", default=[2048])
    p.add_argument("--budget-gib", type=float, default=2.0)
    p.add_argument("--methods", nargs="*", default=list(METHODS))
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tensor_parallel.json"))
    args = p.parse_args()
    devices = use_cpu_devices_if_no_accelerator(8)
    record = benchmark_record("tensor_parallel", devices, vars(args))
    rows = record["results"]
    for method in args.methods:
        for seq in args.seqs:
            row = {"method": method, "seq": seq}
            try:
                row.update(stats(method, seq, args.hidden, args.heads, devices)[0])
                if seq in args.time_seqs:
                    row["fwd_bwd_s"] = time_fwd_bwd(method, seq, args.hidden, args.heads, devices)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            rows.append(row)
            print(row, flush=True)
            save_record(record, args.out)
    budget = int(args.budget_gib * 2**30)
    fits = {}
    for method in args.methods:
        fits[method] = max_seq(method, budget, args.hidden, args.heads, devices, step=4096, limit=2**21)
        print(method, "max seq", fits[method], flush=True)
    record["max_seq_within_budget"] = {"budget_bytes": budget, **fits}
    summary = {}
    if fits.get("megatron") and fits.get("metp"):
        summary["metp_over_megatron_max_seq"] = fits["metp"] / fits["megatron"]
        summary["paper_claim_max_seq_ratio"] = "2.38-2.99 (8 A100, FlashAttention)"
    by = {(r["method"], r["seq"]): r for r in rows if "peak_bytes" in r}
    p8 = 8
    summary["paper_r_p8"] = (3 + 2 * p8) / (p8 * (4 + p8))
    summary["measured_peak_ratio_metp_over_megatron"] = {
        seq: by[("metp", seq)]["peak_bytes"] / by[("megatron", seq)]["peak_bytes"]
        for seq in args.seqs
        if ("metp", seq) in by and ("megatron", seq) in by
    }
    record["summary"] = summary
    save_record(record, args.out)
    print(summary)


if __name__ == "__main__":
    main()
