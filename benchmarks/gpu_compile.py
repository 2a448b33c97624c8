"""jaxring compiled for H100/H200 with no GPU present (deviceless AOT): kernels, memory and overlap.

Needs the compile-only CUDA plugin: `pip install -e ".[dev,gpu-compile]"` in its own venv (see
jaxring/analysis/gpu.py). Runs on the CPU host; nothing executes on a GPU.

  flash   the Pallas flash kernels, fwd + bwd, bf16, causal, batch 1 x 4096 tokens x 8 heads, head dims 64
          and 128, one GPU: per kernel grid, threads, shared memory, registers, spills, wgmma serialization
  ring    the ring-family strategies (ring zigzag, WallFacer C=2, USP ring 4 x Ulysses 2), fwd + bwd, bf16,
          causal, 8 GPUs (16 for WallFacer, whose sub-rings are P/C² long), 1 x 32768 tokens x 8 heads x 128,
          Pallas block kernels: per-device memory and, for each communication loop, whether every transfer's
          start/done pair spans the block compute

    python benchmarks/gpu_compile.py                        # both, H200; writes benchmarks/results/gpu_compile.json
    python benchmarks/gpu_compile.py --only flash --target h100 --out /tmp/h100.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless GPU compiles need the CPU platform selected

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxring.analysis import gpu
from jaxring.analysis.records import save_record
from jaxring.analysis.roofline import attention_flops, roofline_of
from jaxring.kernels.flash import default_block_config, flash_attention
from jaxring.parallel.sequence.ring import ring_attention
from jaxring.parallel.sequence.usp import usp_attention
from jaxring.parallel.sequence.wallfacer import WF_AXES, wallfacer_attention, wallfacer_mesh


def fwd_bwd(local):
    def run(q, k, v, dout):
        out, vjp = jax.vjp(local, q, k, v)
        return out, vjp(dout)

    return run


def flash_program(target, head_dim, seq, heads, batch=1):
    mesh = Mesh(np.array(gpu.gpu_devices(target, 1)), ("x",))
    x = gpu.abstract((batch, seq, heads, head_dim), jnp.bfloat16, mesh)
    local = lambda q, k, v: flash_attention(q, k, v, causal=True, implementation="pallas")
    return jax.jit(fwd_bwd(local)), (x, x, x, x)


def ring_program(target, strategy, seq, heads, head_dim, devices=8, batch=1):
    """A strategy's local function in a shard_map over `devices` GPUs, on sequence shards already laid out."""
    flat = Mesh(np.array(gpu.gpu_devices(target, devices)), ("sp",))
    if strategy == "ring":
        mesh, axes = flat, "sp"
        local = functools.partial(ring_attention, axis_name="sp", layout="zigzag", causal=True, block_ops="pallas")
    elif strategy == "wallfacer":
        mesh, axes = wallfacer_mesh(flat, 2), WF_AXES
        local = functools.partial(wallfacer_attention, team_size=2, layout="zigzag", causal=True, block_ops="pallas")
    elif strategy == "usp":
        mesh = Mesh(np.array(flat.devices).reshape(devices // 2, 2), ("ring", "ulysses"))
        axes = ("ring", "ulysses")
        local = functools.partial(
            usp_attention, axis_name=("ring", "ulysses"), layout="zigzag", causal=True, block_ops="pallas"
        )
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    spec = P(None, axes)
    x = gpu.abstract((batch, seq, heads, head_dim), jnp.bfloat16, mesh, spec)
    run = jax.shard_map(fwd_bwd(local), mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, (spec,) * 3))
    return jax.jit(run), (x, x, x, x)


def flash_rows(target, seq, heads):
    rows = []
    for head_dim in (64, 128):
        fn, args = flash_program(target, head_dim, seq, heads)
        report = gpu.compile_for_gpu(fn, *args, ptxas="jaxring_")
        tiles = {k: vars(t) for k, t in default_block_config(head_dim).items()}
        kernels = [vars(k) | {"spills": k.spills} for k in report.custom_kernels()]
        flops = attention_flops(1, seq, seq, heads, head_dim, causal=True)
        est = roofline_of(report, extra_flops=flops, model_flops=flops)
        rows.append(
            {
                "program": f"flash fwd+bwd d{head_dim}",
                "head_dim": head_dim,
                "seq": seq,
                "heads": heads,
                "tiles": tiles,
                "kernels": kernels,
                "memory": report.memory,
                "compile_s": report.compile_seconds,
                "roofline": est.to_dict(),
            }
        )
        print(report.summary(), flush=True)
    return rows


def ring_rows(target, seq, heads, head_dim, devices):
    rows = []
    for strategy in ("ring", "wallfacer", "usp"):
        # WallFacer C=2 on 8 GPUs has sub-rings of P/C² = 2 (one hop, no loop): 16 GPUs give sub-rings of 4
        devices_here = 2 * devices if strategy == "wallfacer" else devices
        fn, args = ring_program(target, strategy, seq, heads, head_dim, devices_here)
        report = gpu.compile_for_gpu(fn, *args, ptxas=False)
        loops = [
            {
                "body": loop.body,
                "trip_count": loop.trip_count,
                "overlapped": loop.overlapped,
                "compute": loop.compute,
                "transfers": [
                    {"kind": c.kind, "shape": c.shape, "spans_compute": c.spans_compute, "spans": c.spans}
                    for c in loop.collectives
                ],
                "synchronous": loop.sync_collectives,
            }
            for loop in report.loops
        ]
        rows.append(
            {
                "program": f"{strategy} fwd+bwd",
                "strategy": strategy,
                "seq": seq,
                "heads": heads,
                "head_dim": head_dim,
                "devices": devices_here,
                "memory": report.memory,
                "peak_bytes": report.peak_bytes,
                "compile_s": report.compile_seconds,
                "loops": loops,
                "all_loops_overlapped": all(loop.overlapped for loop in report.loops),
            }
        )
        print(report.summary(), flush=True)
    return rows


def metp_row(target, seq, heads, head_dim, devices):
    """METP attention fwd+bwd (tensor/metp_mha.py): its inner ring's schedule (each hop one fused transfer spanning
    the block kernels, forward and backward; guarded by tests/compiled/test_gpu_compile.py)."""
    from jaxring.parallel.tensor.metp_mha import metp_attention

    mesh = Mesh(np.array(gpu.gpu_devices(target, devices)), ("tp",))
    hidden = heads * head_dim
    x = gpu.abstract((1, seq, hidden), jnp.bfloat16, mesh, P(None, "tp"))
    w = gpu.abstract((hidden, hidden), jnp.bfloat16, mesh, P(None, "tp"))
    wo = gpu.abstract((hidden, hidden), jnp.bfloat16, mesh, P("tp", None))
    pos = gpu.abstract((1, seq), jnp.int32, mesh, P(None, "tp"))

    def local(x, wq, wk, wv, wo, pos):
        loss = lambda *a: metp_attention(*a, pos, num_heads=heads, block_ops="pallas").astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, wq, wk, wv, wo)

    specs = (P(None, "tp"),) * 4 + (P("tp", None),)
    run = jax.shard_map(local, mesh=mesh, in_specs=specs + (P(None, "tp"),), out_specs=specs, check_vma=False)
    report = gpu.compile_for_gpu(jax.jit(run), x, w, w, w, wo, pos, ptxas=False)
    print(report.summary(), flush=True)
    return {
        "program": "metp attention fwd+bwd",
        "strategy": "metp",
        "seq": seq,
        "heads": heads,
        "head_dim": head_dim,
        "devices": devices,
        "memory": report.memory,
        "peak_bytes": report.peak_bytes,
        "compile_s": report.compile_seconds,
        "loops": [
            {
                "body": loop.body,
                "trip_count": loop.trip_count,
                "overlapped": loop.overlapped,
                "transfers": [
                    {"kind": c.kind, "shape": c.shape, "spans_compute": c.spans_compute} for c in loop.collectives
                ],
            }
            for loop in report.loops
        ],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="h200", choices=sorted(gpu.TARGETS))
    parser.add_argument("--only", choices=["flash", "ring"])
    parser.add_argument("--flash-seq", type=int, default=4096)
    parser.add_argument("--ring-seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu_compile.json"))
    args = parser.parse_args(argv)
    ok, why = gpu.available()
    if not ok:
        sys.exit(f"cannot compile for GPU here: {why}")

    from importlib.metadata import version

    import jaxlib

    record = {
        "benchmark": "gpu_compile",
        "command": " ".join(["python"] + sys.argv),
        "device": f"deviceless compile for {args.target} (XLA GpuTargetConfigProto), on a CPU host",
        "host_cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "jax_cuda12_plugin": version("jax-cuda12-plugin"),
        "ptxas": version("nvidia-cuda-nvcc-cu12"),
        "target": args.target,
        "config": {
            "dtype": "bfloat16",
            "causal": True,
            "heads": args.heads,
            "flash_seq": args.flash_seq,
            "ring_seq": args.ring_seq,
            "devices": args.devices,
        },
        "results": [],
    }
    start = time.time()
    if args.only in (None, "flash"):
        record["results"] += flash_rows(args.target, args.flash_seq, args.heads)
        save_record(record, args.out)
    if args.only in (None, "ring"):
        record["results"] += ring_rows(args.target, args.ring_seq, args.heads, 128, args.devices)
        save_record(record, args.out)
        record["results"].append(metp_row(args.target, args.ring_seq, args.heads, 128, args.devices))
        save_record(record, args.out)
    print(f"done in {time.time() - start:.0f} s; wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
