"""Sliding-window ring attention on 8 devices: what skipping the steps outside the window saves.

Causal ring attention, forward+backward, batch 1, heads 8, head dim 64, fp32, sp = 8 (simulated CPU devices
without an accelerator), contiguous and zig-zag layouts, with window = seq/8 (one rank's block) against no
window. Each configuration runs `ring_attention` inside one `shard_map` on shards already in its layout.

Per configuration it records
  time            forward+backward wall time, min (and median) over interleaved rounds, and process CPU time;
  flops_static    XLA's cost analysis of the compiled program (`compile().cost_analysis()`), which counts
                  every `lax.cond` at its costlier branch and every loop of dynamic length once: it cannot
                  see a runtime skip, so it is the same with and without the window (recorded to show that);
  pairs_computed  per device, the query-key pairs of the (Q run, K/V run) pairs the forward computes
                  (`ring_forward`'s own count, taken where the blocks run: skipped steps add nothing);
  flops_executed  14·b·hq·d per computed pair (forward QKᵀ and PV, backward S, dV, dP, dQ, dK: 7 matmuls of
                  2 flops per multiply-add), the max over devices (the step's critical path), an upper bound
                  at run granularity (the block ops also skip the tiles outside the window inside a step);
  collectives     bytes each device receives by collective (`compile_stats`): the ring's hops are unchanged
                  by the window (a skipped step still passes its K/V block on).

    python benchmarks/sliding_window.py                     # seq 4096 and 8192 -> benchmarks/results/
    python benchmarks/sliding_window.py --seqs 1024 --rounds 1 --out /tmp/window.json
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring.analysis import compile_stats
from jaxring.analysis.records import benchmark_record, save_record
from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator
from jaxring.kernels.block_compute import get_block_ops
from jaxring.kernels.layout import RankTokens
from jaxring.parallel.sequence.ring import RingConfig, ring_attention, ring_forward

SPEC = P(None, "sp", None, None)


def fwd_bwd(mesh, layout, window):
    local = functools.partial(ring_attention, axis_name="sp", layout=layout, causal=True, window=window)

    def run(q, k, v, dout):
        out, vjp = jax.vjp(local, q, k, v)
        return out, vjp(dout)

    return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(SPEC,) * 4, out_specs=(SPEC, (SPEC,) * 3)))


def pairs_per_device(mesh, layout, window, xs):
    """Query-key pairs of the run pairs each device's forward computes (ring_forward's count)."""
    ops = get_block_ops("auto")

    def local(q, k, v):
        cfg = RingConfig("sp", RankTokens(layout), True, q.shape[-1] ** -0.5, ops, window=window)
        _, _, work = ring_forward(q, k, v, None, cfg)
        return work[None]

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=P("sp")))
    return [float(x) for x in np.asarray(run(*xs[:3]))]


def static_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    return None if not cost or "flops" not in cost else float(cost["flops"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sliding_window.json"))
    args = parser.parse_args(argv)

    devices = use_cpu_devices_if_no_accelerator(args.cpu_devices)
    p = len(devices)
    mesh = jaxring.make_mesh(sp=p, devices=devices)
    record = benchmark_record(
        "sliding_window",
        devices,
        {
            "batch": 1,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "causal": True,
            "dtype": "float32",
            "devices": p,
            "rounds": args.rounds,
            "pass": "forward+backward",
            "window": "seq / devices (one rank's block), against none",
            "flops_executed": "14 * batch * heads * head_dim * pairs computed, max over devices",
        },
    )
    for seq in args.seqs:
        window = seq // p
        keys = jax.random.split(jax.random.PRNGKey(seq), 4)
        natural = [jax.random.normal(key, (1, seq, args.heads, args.head_dim), jnp.float32) for key in keys]
        rows = {}
        for layout in args.layouts:
            xs = [x[:, jaxring.layout_permutation(layout, seq, p)] for x in natural]
            for w in (None, window):
                name = f"{layout} window {w}" if w else f"{layout} no window"
                fn = fwd_bwd(mesh, layout, w)
                start = time.perf_counter()
                compiled = fn.lower(*xs).compile()
                compile_s = time.perf_counter() - start
                jax.block_until_ready(compiled(*xs))
                pairs = pairs_per_device(mesh, layout, w, xs)
                stats = compile_stats(fn, *xs)
                rows[name] = {
                    "layout": layout,
                    "window": w,
                    "compiled": compiled,
                    "xs": xs,
                    "times_s": [],
                    "cpu_s": [],
                    "compile_s": compile_s,
                    "flops_static": static_flops(compiled),
                    "pairs_computed": pairs,
                    "flops_executed": 14.0 * args.heads * args.head_dim * max(pairs),
                    "collective_bytes": dict(stats.bytes_moved),
                    "temp_bytes": stats.temp_bytes,
                }
        for _ in range(args.rounds):  # interleaved: the host is shared
            for row in rows.values():
                start, cpu = time.perf_counter(), time.process_time()
                jax.block_until_ready(row["compiled"](*row["xs"]))
                row["times_s"].append(time.perf_counter() - start)
                row["cpu_s"].append(time.process_time() - cpu)
        result = {"seq": seq, "window": window, "configs": {}}
        for name, row in rows.items():
            r = {k: v for k, v in row.items() if k not in ("compiled", "xs")}
            r |= {"min_s": min(row["times_s"]), "median_s": statistics.median(row["times_s"])}
            r["cpu_min_s"] = min(row["cpu_s"])
            result["configs"][name] = r
            print(
                f"seq {seq:6d} {name:24s} {r['min_s']:.3f} s (median {r['median_s']:.3f}, cpu {r['cpu_min_s']:.3f})"
                f"  pairs max {max(r['pairs_computed']):.3g}  static flops {r['flops_static']}"
                f"  permute bytes {r['collective_bytes'].get('collective-permute')}",
                flush=True,
            )
        result["speedup"] = {}
        for layout in args.layouts:
            full, win = result["configs"][f"{layout} no window"], result["configs"][f"{layout} window {window}"]
            result["speedup"][layout] = {
                "time": full["min_s"] / win["min_s"],
                "cpu_time": full["cpu_min_s"] / win["cpu_min_s"],
                "flops_executed": full["flops_executed"] / win["flops_executed"],
                "collective_bytes_equal": full["collective_bytes"] == win["collective_bytes"],
            }
            print(f"  {layout}: {result['speedup'][layout]}", flush=True)
        record["results"].append(result)
        save_record(record, args.out)
    return record


if __name__ == "__main__":
    main()
