"""Ring attention (each layout) against single-device attention: fwd+bwd time and per-device memory.

Causal, forward+backward, heads 8, head dim 64, on 8 devices (simulated CPU devices without an
accelerator). "single" is the same blockwise attention on one device over the whole sequence (with causal
tile skipping): the ideal ring time is single / P. Memory is compiled per-device temp memory.

    python benchmarks/ring_attention.py                       # seq 4k..32k, writes benchmarks/results/
    python benchmarks/ring_attention.py --seqs 1024 --runs 1 --out /tmp/ring.json
"""
from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp

import jaxring
from jaxring.analysis import compile_stats
from jaxring.platform import benchmark_record, save_record, use_cpu_devices_if_no_accelerator
from jaxring.timing import median_seconds


def fwd_bwd(mesh, layout, causal):
    def run(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: jaxring.sharded_attention(
            q, k, v, mesh=mesh, strategy="ring", causal=causal, layout=layout), q, k, v)
        return out, vjp(dout)
    return jax.jit(run)


def measure(fn, args, runs):
    stats = compile_stats(fn, *args)
    seconds = median_seconds(fn, *args, runs=runs)
    return {"median_s": seconds, "temp_bytes": stats.temp_bytes, "argument_bytes": stats.argument_bytes,
            "output_bytes": stats.output_bytes, "bytes_moved": stats.total_bytes_moved}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--layouts", nargs="+", default=list(jaxring.LAYOUTS))
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ring_attention.json"))
    args = parser.parse_args(argv)

    devices = use_cpu_devices_if_no_accelerator(args.cpu_devices)
    p = len(devices)
    ring_mesh = jaxring.make_mesh(sp=p, devices=devices)
    single_mesh = jaxring.make_mesh(sp=1, devices=devices[:1])
    record = benchmark_record("ring_attention", devices, {
        "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "causal": True, "dtype": "float32",
        "devices": p, "runs": args.runs})
    for seq in args.seqs:
        keys = jax.random.split(jax.random.PRNGKey(seq), 4)
        shape = (args.batch, seq, args.heads, args.head_dim)
        qkvd = [jax.random.normal(key, shape, jnp.float32) for key in keys]
        single = measure(fwd_bwd(single_mesh, "contiguous", True), qkvd, args.runs)
        row = {"seq": seq, "single_device": single, "ring": {}}
        print(f"seq {seq}: single device {single['median_s']:.3f} s, temp {single['temp_bytes'] / 2**20:.1f} MiB",
              flush=True)
        for layout in args.layouts:
            r = measure(fwd_bwd(ring_mesh, layout, True), qkvd, args.runs)
            r["ratio_to_single_over_p"] = r["median_s"] / (single["median_s"] / p)
            row["ring"][layout] = r
            print(f"  ring {layout:10s} {r['median_s']:.3f} s  ({r['ratio_to_single_over_p']:.2f}x single/P)  "
                  f"temp {r['temp_bytes'] / 2**20:.1f} MiB  sent {r['bytes_moved'] / 2**20:.1f} MiB", flush=True)
        record["results"].append(row)
        save_record(record, args.out)
    return record


if __name__ == "__main__":
    start = time.time()
    main()
    print(f"done in {time.time() - start:.0f} s")
