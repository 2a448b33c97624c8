"""Every sequence-parallel strategy on the same inputs: bytes moved, compiled peak memory, time.

Causal, forward+backward, batch 1, heads 8, head dim 64, fp32, on 8 devices (simulated CPU devices without
an accelerator). Bytes and memory come from the compiled program (exact, any length); time is measured only
for lengths in --time-seqs (running 64k on a CPU host takes too long, and RSA's L²/N score block alone
would need 16 GiB per simulated device there).

    python benchmarks/sequence_parallel.py                 # writes benchmarks/results/sequence_parallel.json
    python benchmarks/sequence_parallel.py --seqs 4096 --time-seqs 4096 --out /tmp/sp.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

import jaxring
from jaxring.analysis import compile_stats
from jaxring.analysis.records import benchmark_record, save_record
from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator
from jaxring.core.timing import median_seconds

# name -> sharded_attention keywords
CONFIGS = {
    "ring-zigzag": dict(strategy="ring", layout="zigzag"),
    "rsa": dict(strategy="rsa", layout="contiguous"),
    "wallfacer-C1": dict(strategy="wallfacer", layout="zigzag", team_size=1),
    "wallfacer-C2": dict(strategy="wallfacer", layout="zigzag", team_size=2),
    "ulysses": dict(strategy="ulysses", layout="zigzag"),
    "allgather": dict(strategy="allgather", layout="zigzag"),
    "usp-U2": dict(strategy="usp", layout="zigzag", ulysses_size=2),
    "usp-U4": dict(strategy="usp", layout="zigzag", ulysses_size=4),
}


def fwd_bwd(mesh, options):
    def run(q, k, v, dout):
        out, vjp = jax.vjp(
            lambda q, k, v: jaxring.sharded_attention(q, k, v, mesh=mesh, causal=True, **options), q, k, v
        )
        return out, vjp(dout)

    return jax.jit(run)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--time-seqs", type=int, nargs="*", default=[16384])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sequence_parallel.json"))
    args = parser.parse_args(argv)

    devices = use_cpu_devices_if_no_accelerator(args.cpu_devices)
    mesh = jaxring.make_mesh(sp=len(devices), devices=devices)
    record = benchmark_record(
        "sequence_parallel",
        devices,
        {
            "batch": 1,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "causal": True,
            "dtype": "float32",
            "devices": len(devices),
            "runs": args.runs,
        },
    )
    record["bytes_note"] = "per device, received, from the compiled HLO (fp32; includes the layout permutation)"
    for seq in args.seqs:
        shape = jax.ShapeDtypeStruct((1, seq, args.heads, args.head_dim), jnp.float32)
        for name in args.configs:
            options = CONFIGS[name]
            row = {"seq": seq, "config": name, **options}
            if options["strategy"] not in jaxring.parallel.registry.sequence_strategies():
                row["error"] = f"strategy {options['strategy']!r} is not implemented in this version"
            else:
                fn = fwd_bwd(mesh, options)
                try:
                    stats = compile_stats(fn, shape, shape, shape, shape)
                    row.update(
                        bytes_moved=stats.bytes_moved,
                        total_bytes_moved=stats.total_bytes_moved,
                        peak_bytes=stats.peak_bytes,
                        temp_bytes=stats.temp_bytes,
                    )
                    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                    shared_host = devices[0].platform == "cpu"
                    if seq in args.time_seqs and shared_host and stats.peak_bytes * len(devices) > 0.6 * host_bytes:
                        row["time_skipped"] = (
                            f"simulated devices share host memory: {len(devices)} x "
                            f"{stats.peak_bytes / 2**30:.1f} GiB peak > 60% of "
                            f"{host_bytes / 2**30:.0f} GiB"
                        )
                    elif seq in args.time_seqs:
                        keys = jax.random.split(jax.random.PRNGKey(seq), 4)
                        arrays = [jax.random.normal(k, shape.shape, jnp.float32) for k in keys]
                        row["median_s"] = median_seconds(fn, *arrays, runs=args.runs)
                except Exception as e:  # recorded, not fatal: one strategy's failure must not hide the rest
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            record["results"].append(row)
            print(json.dumps(row), flush=True)
            save_record(record, args.out)
    return record


if __name__ == "__main__":
    start = time.time()
    main()
    print(f"done in {time.time() - start:.0f} s")
