"""Ring attention on 8 devices against a public pure-JAX ring attention: fwd+bwd time, memory, compile time.

Causal, forward+backward, batch 1, heads 8, head dim 64, fp32, on 8 devices (simulated CPU devices without an
accelerator). Each implementation runs its local ring function inside one `shard_map` on sequence shards
already in its layout (the data side lays tokens out once): jaxring's `ring_attention` (zigzag, contiguous,
striped), and, when it can be imported, the peer: `ringattention` (lhao499/ringattention on PyPI, its
pure-JAX `ring_attention` with blockwise chunks, contiguous layout, causal) at several chunk sizes.
The peer is never a dependency of jaxring: install it anywhere and point --peer-path at it, e.g.

    pip install --no-deps --target /tmp/peer ringattention einops
    python benchmarks/ring_attention.py --peer-path /tmp/peer            # seq 4k, 8k, 16k -> benchmarks/results/
    python benchmarks/ring_attention.py --seqs 1024 --rounds 1 --out /tmp/ring.json

Timing: the host is shared, so configurations are interleaved: each round runs every configuration once,
and the figure is the minimum over rounds (the median, and the process CPU time, which other programs on
the host do not inflate, are recorded too). Memory is the compiled program's
per-device temp bytes (`memory_analysis()`); compile time is lower + compile of the fwd+bwd program.
"ratio" rows compare jaxring's fastest layout with the peer's fastest chunk size (time and temp memory).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring.analysis.records import benchmark_record, save_record
from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator
from jaxring.parallel.sequence.ring import ring_attention

SPEC = P(None, "sp", None, None)


def load_peer(path: str | None):
    """The peer's pure-JAX module (ringattention/ringattention_jax.py), or None. Loaded as a file: the
    package's __init__ picks a backend-specific kernel at import and needs TPU/GPU-only modules."""
    if path:
        sys.path.insert(0, path)
    spec = importlib.util.find_spec("ringattention")
    if spec is None or not spec.submodule_search_locations:
        return None
    file = os.path.join(next(iter(spec.submodule_search_locations)), "ringattention_jax.py")
    module_spec = importlib.util.spec_from_file_location("peer_ringattention_jax", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def peer_local(peer, chunk):
    kwargs = dict(
        causal_block_size=1,
        query_chunk_size=chunk,
        key_chunk_size=chunk,
        deterministic=True,
        dropout_rng=None,
        attn_pdrop=0.0,
        dtype=jnp.float32,
        policy=jax.checkpoint_policies.nothing_saveable,
        precision=None,
        prevent_cse=True,
    )
    return lambda q, k, v: peer.ring_attention(q, k, v, None, None, None, "sp", True, kwargs)


def fwd_bwd(local, mesh, check_vma=True):
    def run(q, k, v, dout):
        out, vjp = jax.vjp(local, q, k, v)
        return out, vjp(dout)

    return jax.jit(
        jax.shard_map(run, mesh=mesh, in_specs=(SPEC,) * 4, out_specs=(SPEC, (SPEC,) * 3), check_vma=check_vma)
    )


def prepare(fn, args):
    """Compiles once: (compiled, compile seconds, per-device temp bytes)."""
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    seconds = time.perf_counter() - start
    return compiled, seconds, compiled.memory_analysis().temp_size_in_bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--layouts", nargs="+", default=["zigzag", "contiguous", "striped"])
    parser.add_argument("--peer-path", default=os.environ.get("JAXRING_PEER_PATH"))
    parser.add_argument("--peer-chunks", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ring_attention.json"))
    args = parser.parse_args(argv)

    devices = use_cpu_devices_if_no_accelerator(args.cpu_devices)
    p = len(devices)
    mesh = jaxring.make_mesh(sp=p, devices=devices)
    peer = load_peer(args.peer_path)
    record = benchmark_record(
        "ring_attention",
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
            "peer": "ringattention 0.1.2 (lhao499), ringattention_jax.ring_attention" if peer else None,
        },
    )
    if peer is None:
        print("peer (ringattention) not importable: jaxring only (pass --peer-path)", flush=True)
    for seq in args.seqs:
        keys = jax.random.split(jax.random.PRNGKey(seq), 4)
        natural = [jax.random.normal(key, (1, seq, args.heads, args.head_dim), jnp.float32) for key in keys]
        configs = {}
        for layout in args.layouts:
            perm = jaxring.layout_permutation(layout, seq, p)
            local = functools.partial(ring_attention, axis_name="sp", layout=layout, causal=True)
            configs[f"jaxring {layout}"] = (fwd_bwd(local, mesh), [x[:, perm] for x in natural])
        if peer is not None:
            for chunk in args.peer_chunks:
                if (seq // p) % chunk == 0:
                    configs[f"peer chunk {chunk}"] = (fwd_bwd(peer_local(peer, chunk), mesh, check_vma=False), natural)
        rows = {}
        for name, (fn, xs) in configs.items():
            compiled, seconds, temp = prepare(fn, xs)
            jax.block_until_ready(compiled(*xs))
            rows[name] = {
                "compile_s": seconds,
                "temp_bytes": temp,
                "times_s": [],
                "cpu_s": [],
                "compiled": compiled,
                "xs": xs,
            }
        for _ in range(args.rounds):
            for row in rows.values():
                start, cpu = time.perf_counter(), time.process_time()
                jax.block_until_ready(row["compiled"](*row["xs"]))
                row["times_s"].append(time.perf_counter() - start)
                row["cpu_s"].append(time.process_time() - cpu)
        result = {"seq": seq, "configs": {}}
        for name, row in rows.items():
            result["configs"][name] = {
                "min_s": min(row["times_s"]),
                "median_s": statistics.median(row["times_s"]),
                "times_s": row["times_s"],
                "cpu_min_s": min(row["cpu_s"]),
                "cpu_s": row["cpu_s"],
                "temp_bytes": row["temp_bytes"],
                "compile_s": row["compile_s"],
            }
            r = result["configs"][name]
            print(
                f"seq {seq:6d} {name:20s} {r['min_s']:.3f} s (median {r['median_s']:.3f}, cpu {r['cpu_min_s']:.3f})"
                f"  temp {r['temp_bytes'] / 2**20:6.1f} MiB  compile {r['compile_s']:.1f} s",
                flush=True,
            )
        ours = {n: r for n, r in result["configs"].items() if n.startswith("jaxring")}
        theirs = {n: r for n, r in result["configs"].items() if n.startswith("peer")}
        if theirs:
            best_ours = min(ours, key=lambda n: ours[n]["min_s"])
            best_peer = min(theirs, key=lambda n: theirs[n]["min_s"])
            result["ratio"] = {
                "jaxring": best_ours,
                "peer": best_peer,
                "time": ours[best_ours]["min_s"] / theirs[best_peer]["min_s"],
                "time_median": min(r["median_s"] for r in ours.values()) / min(r["median_s"] for r in theirs.values()),
                "cpu_time": min(r["cpu_min_s"] for r in ours.values()) / min(r["cpu_min_s"] for r in theirs.values()),
                "temp_memory": ours[best_ours]["temp_bytes"] / theirs[best_peer]["temp_bytes"],
                "temp_memory_vs_peer_smallest": ours[best_ours]["temp_bytes"]
                / min(r["temp_bytes"] for r in theirs.values()),
                "per_layout_time": {n: r["min_s"] / theirs[best_peer]["min_s"] for n, r in ours.items()},
                "per_layout_temp_memory": {
                    n: r["temp_bytes"] / theirs[best_peer]["temp_bytes"] for n, r in ours.items()
                },
            }
            ratio = result["ratio"]
            print(
                f"  {best_ours} vs {best_peer}: time {ratio['time']:.2f}x, temp memory {ratio['temp_memory']:.2f}x",
                flush=True,
            )
        record["results"].append(result)
        save_record(record, args.out)
    return record


if __name__ == "__main__":
    start = time.time()
    main()
    print(f"done in {time.time() - start:.0f} s")
