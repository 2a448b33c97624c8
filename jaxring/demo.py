"""Ring attention on every device (8 simulated CPU devices when there is no accelerator), checked against
dense attention (forward and dq/dk/dv), with timing and compiled per-device memory. Exit code 0 when they
agree, 1 when they do not, 2 for a bad flag.

    python -m jaxring.demo                      # sp=8, zigzag, causal, seq 4096
    python -m jaxring.demo --dp 2 --sp 4 --layout striped --seq 8192 --kv-heads 2
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxring
from jaxring.analysis import compile_stats
from jaxring.core.device_setup import describe_devices, use_cpu_devices_if_no_accelerator
from jaxring.core.timing import median_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, default=None, help="sequence-parallel degree (default: all devices / dp)")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices without an accelerator")
    parser.add_argument("--layout", default="zigzag", choices=jaxring.LAYOUTS)
    parser.add_argument("--full", action="store_true", help="no causal mask")
    parser.add_argument("--batch", type=int, default=None, help="sequences (default: dp, one per replica)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:  # a bad mesh or shape: one line naming the value and the rule
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    """Prints the comparison and the timings; 0 when ring attention agrees with dense attention, else 1."""
    devices = use_cpu_devices_if_no_accelerator(args.cpu_devices)
    sp = args.sp or len(devices) // args.dp
    if args.dp * sp > len(devices):
        raise ValueError(f"--dp {args.dp} × --sp {sp} = {args.dp * sp} devices, but there are {len(devices)}")
    mesh = jaxring.make_mesh(dp=args.dp, sp=sp, devices=devices[: args.dp * sp])
    args.batch = args.batch or args.dp
    causal = not args.full
    dtype = jnp.dtype(args.dtype)
    kv_heads = args.kv_heads or args.heads
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (args.batch, args.seq, args.heads, args.head_dim), dtype)
    k = jax.random.normal(keys[1], (args.batch, args.seq, kv_heads, args.head_dim), dtype)
    v = jax.random.normal(keys[2], (args.batch, args.seq, kv_heads, args.head_dim), dtype)
    dout = jax.random.normal(keys[3], q.shape, dtype)

    def fwd_bwd(strategy: str) -> Callable[..., Any]:
        layout = {} if strategy == "dense" else {"layout": args.layout}  # dense attends the natural order

        def run(q: jax.Array, k: jax.Array, v: jax.Array, dout: jax.Array) -> Any:
            out, vjp = jax.vjp(
                lambda q, k, v: jaxring.sharded_attention(
                    q, k, v, mesh=mesh, strategy=strategy, causal=causal, **layout
                ),
                q,
                k,
                v,
            )
            return out, vjp(dout)

        return jax.jit(run)

    print(
        f"devices: {describe_devices(devices)}; mesh dp={args.dp} sp={sp}; {args.layout} layout, "
        f"{'causal' if causal else 'full'}; q {q.shape} kv heads {kv_heads} {dtype.name}"
    )
    ring, dense = fwd_bwd("ring"), fwd_bwd("dense")
    (out, grads), (out_d, grads_d) = ring(q, k, v, dout), dense(q, k, v, dout)
    tol = 2e-4 if dtype == jnp.float32 else 2e-2
    ok = True
    for name, a, b in [("out", out, out_d), *zip(("dq", "dk", "dv"), grads, grads_d)]:
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        rel = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))
        ok &= rel <= tol
        print(f"  {name:3s} max error relative to dense: {rel:.2e} {'ok' if rel <= tol else 'FAIL'}")
    for name, fn in (("ring", ring), ("dense", dense)):
        stats = compile_stats(fn, q, k, v, dout)
        t = median_seconds(fn, q, k, v, dout, runs=args.runs)
        print(
            f"  {name:5s} fwd+bwd {t * 1e3:9.1f} ms   per-device temp {stats.temp_bytes / 2**20:8.1f} MiB   "
            f"args {stats.argument_bytes / 2**20:7.1f} MiB   sent {stats.total_bytes_moved / 2**20:7.1f} MiB"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
