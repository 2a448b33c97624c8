"""Single-device attention kernels: TFLOP/s of forward and forward+backward, bf16.

Compares jaxring's Pallas flash kernel ("jaxring") and jaxring's cuDNN and tokamax block computes ("jaxring-cudnn",
"jaxring-tokamax": the BlockOps of kernels/cudnn_blocks.py and kernels/tokamax_blocks.py through block_attention,
as Ulysses and dense attention call them) with `jax.nn.dot_product_attention` (cuDNN "cudnn" and XLA), JAX's own
Pallas `mha` (jax.experimental.pallas.ops.gpu.attention) and the optional tokamax package's Mosaic GPU attention
called directly ("tokamax": `tokamax.dot_product_attention(implementation="mosaic")`); on a TPU, jaxring's TPU block
compute ("jaxring-tpu": kernels/tpu_blocks.py through block_attention) with JAX's splash attention ("splash"). Shapes follow the FlashAttention papers' benchmark: batch * seq =
16k tokens, hidden = heads * head_dim = 2048 (--tokens, --hidden); --kv-heads N adds GQA rows (K/V with N heads,
e.g. --hidden 4096 --head-dims 128 --kv-heads 8: 32 query heads over 8).

FLOPs (the FlashAttention-2 benchmark's convention): forward 4 * batch * heads * seq^2 * head_dim (two
matmuls), backward 2.5x the forward, so forward+backward = 3.5x the forward; causal counts half.
Each figure is the median of --runs timed calls after --warmup calls, each waited for with
block_until_ready. A bf16 8192^3 matmul gives the measured peak. Any implementation that fails (not available
on this device, out of memory, unsupported shape) is recorded as an error string.

    python benchmarks/flash_attention.py                 # GPU: writes benchmarks/results/flash_attention_<device>.json
    python benchmarks/flash_attention.py --head-dims 64 --merge    # run in parts; --merge adds to the file
    python benchmarks/flash_attention.py --quick --out /tmp/flash_quick.json   # CPU smoke run (jnp path)
    python benchmarks/flash_attention.py --quick --impls jaxring jaxring-cudnn xla --kv-heads 2 --out /tmp/q.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxring.analysis.records import save_record
from jaxring.core.timing import median_seconds
from jaxring.kernels.block_compute import local_attention
from jaxring.kernels.flash import default_block_config, flash_attention

TOKENS = 16384
HIDDEN = 2048
IMPLS = (
    "jaxring",
    "jaxring-cudnn",
    "jaxring-tokamax",
    "jaxring-tpu",
    "cudnn",
    "xla",
    "pallas_mha",
    "tokamax",
    "splash",
)
OURS = ("jaxring", "jaxring-cudnn", "jaxring-tokamax", "jaxring-tpu")  # the rows checked against a reference (accuracy)


def attention_fn(impl: str, causal: bool, head_dim: int, jaxring_impl: str, cudnn_block_ops: str = "cudnn"):
    """out = f(q, k, v) for one implementation (bf16 [batch, seq, heads, head_dim]; K/V may have fewer heads)."""
    scale = head_dim**-0.5
    if impl == "jaxring":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, sm_scale=scale, implementation=jaxring_impl)
    if impl == "jaxring-cudnn":
        return lambda q, k, v: local_attention(cudnn_block_ops, q, k, v, causal=causal, sm_scale=scale)
    if impl == "jaxring-tokamax":
        return lambda q, k, v: local_attention("tokamax", q, k, v, causal=causal, sm_scale=scale)
    if impl == "jaxring-tpu":  # the TPU block compute (kernels/tpu_blocks.py), as Ulysses and dense attention call it
        return lambda q, k, v: local_attention("pallas_tpu", q, k, v, causal=causal, sm_scale=scale)
    if impl == "splash":  # JAX's splash attention (TPU), heads-major; GQA through its K/V heads
        return lambda q, k, v: splash_attention(q, k, v, causal=causal, scale=scale)
    if impl in ("cudnn", "xla"):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale, implementation=impl)
    if impl == "pallas_mha":
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        return lambda q, k, v: pallas_attention.mha(q, k, v, None, sm_scale=scale, causal=causal)
    if impl == "tokamax":  # the optional package; an ImportError is recorded as this row's error
        import tokamax

        return lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="mosaic"
        )
    raise ValueError(f"unknown implementation {impl!r}")


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, scale: float) -> jax.Array:
    """JAX's splash attention kernel on [batch, seq, heads, head_dim] inputs (the TPU baseline)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    seq, heads = q.shape[1], q.shape[2]
    one = masks.CausalMask((seq, seq)) if causal else masks.FullMask((seq, seq))
    kernel = splash.make_splash_mha(masks.MultiHeadMask([one] * heads), head_shards=1, q_seq_shards=1)
    heads_major = lambda x: jnp.swapaxes(x, 1, 2)
    out = jax.vmap(kernel)(heads_major(q * scale), heads_major(k), heads_major(v))
    return heads_major(out)


def forward_and_backward(fn):
    """Jitted forward, and jitted forward+backward (the backward's recomputation included)."""
    fwd = jax.jit(fn)

    def fwd_bwd(q, k, v, dout):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(dout)

    return fwd, jax.jit(fwd_bwd)


def attention_flops(batch, seq, heads, head_dim, causal):
    fwd = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return fwd, 3.5 * fwd


def timed(fn, args, warmup, runs):
    """(median seconds, error string); compile happens in the first warm-up call."""
    try:
        jax.block_until_ready(fn(*args))
        return median_seconds(fn, *args, runs=runs, warmup=warmup), None
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def matmul_peak(n, warmup, runs):
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    a = jax.random.normal(keys[0], (n, n), jnp.bfloat16)
    b = jax.random.normal(keys[1], (n, n), jnp.bfloat16)
    seconds, error = timed(jax.jit(lambda a, b: a @ b), (a, b), warmup, runs)
    return {
        "n": n,
        "dtype": "bfloat16",
        "median_s": seconds,
        "error": error,
        "tflops": None if seconds is None else 2.0 * n**3 / seconds / 1e12,
    }


def accuracy_check(fns, args, ours_name="jaxring"):
    """Max |difference| of out and dq/dk/dv between `ours_name` and the first reference that runs (bf16)."""
    names = ("out", "dq", "dk", "dv")

    def run(name):
        out, grads = jax.block_until_ready(fns[name][1](*args))
        return [np.asarray(x, np.float32) for x in (out, *grads)]

    try:
        ours = run(ours_name)
    except Exception as e:
        return {"error": f"{ours_name}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    errors = {}
    for ref_name in (n for n in ("cudnn", "xla", "pallas_mha", "tokamax", "jaxring") if n in fns and n != ours_name):
        try:
            ref = run(ref_name)
        except Exception as e:
            errors[ref_name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            continue
        return {
            "reference": ref_name,
            "max_abs_diff": {n: float(np.abs(a - b).max()) for n, a, b in zip(names, ours, ref)},
            "max_abs_reference": {n: float(np.abs(b).max()) for n, b in zip(names, ref)},
        }
    return {"error": f"no reference ran: {errors}"}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "unknown"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+")
    parser.add_argument("--head-dims", type=int, nargs="+")
    parser.add_argument("--causal", choices=["both", "true", "false"], default="both")
    parser.add_argument("--impls", nargs="+", choices=IMPLS)
    parser.add_argument(
        "--jaxring-implementation",
        default=None,
        help="flash_attention(implementation=...): default 'pallas' ('jnp' with --quick)",
    )
    parser.add_argument(
        "--cudnn-block-ops",
        default=None,
        help="block_ops of the jaxring-cudnn rows: default 'cudnn' ('cudnn_reference', its CPU stand-in, with --quick)",
    )
    parser.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA); default: as many as the query's")
    parser.add_argument(
        "--xla-max-seq",
        type=int,
        default=16384,
        help="skip the XLA implementation (it materialises seq^2 scores) above this length",
    )
    parser.add_argument("--tokens", type=int, help=f"batch * seq, batch >= 1 (default {TOKENS})")
    parser.add_argument("--hidden", type=int, help=f"heads * head_dim (default {HIDDEN})")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--runs", type=int)
    parser.add_argument("--matmul-n", type=int)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CPU smoke run: seq 256, head dim 64, 512 tokens, 4 heads, jaxring (jnp path) "
        "and xla, 1 run; flags given explicitly still apply",
    )
    parser.add_argument("--merge", action="store_true", help="add to (replace matching rows of) the output file")
    parser.add_argument(
        "--out", default=None, help="output JSON (default benchmarks/results/flash_attention_<device kind>.json)"
    )
    args = parser.parse_args(argv)
    defaults = dict(
        seqs=[1024, 2048, 4096, 8192, 16384, 32768],
        head_dims=[64, 128],
        impls=list(IMPLS),
        warmup=2,
        runs=5,
        matmul_n=8192,
        tokens=TOKENS,
        hidden=HIDDEN,
        jaxring_implementation="pallas",
        cudnn_block_ops="cudnn",
    )
    if args.quick:
        defaults.update(
            seqs=[256],
            head_dims=[64],
            impls=["jaxring", "xla"],
            warmup=1,
            runs=1,
            matmul_n=1024,
            tokens=512,
            hidden=256,
            jaxring_implementation="jnp",
            cudnn_block_ops="cudnn_reference",
        )
    for name, value in defaults.items():  # flags given explicitly win over --quick
        if getattr(args, name) is None:
            setattr(args, name, value)
    jaxring_impl = args.jaxring_implementation

    device = jax.devices()[0]
    device_kind = getattr(device, "device_kind", device.platform)
    out_path = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"flash_attention_{slug(device_kind)}.json"
    )
    try:
        import jaxlib

        jaxlib_version = jaxlib.__version__
    except (ImportError, AttributeError):
        jaxlib_version = None
    record = {
        "benchmark": "flash_attention",
        "command": " ".join(["python"] + [os.path.relpath(sys.argv[0])] + sys.argv[1:])
        if argv is None
        else "main(" + repr(argv) + ")",
        "device": f"{len(jax.devices())} x {device_kind} ({device.platform})",
        "device_kind": device_kind,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib_version,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "config": {
            "dtype": "bfloat16",
            "tokens_per_batch": args.tokens,
            "hidden": args.hidden,
            "warmup": args.warmup,
            "runs": args.runs,
            "jaxring_implementation": jaxring_impl,
            "jaxring_cudnn_block_ops": args.cudnn_block_ops,
            "jaxring_default_tiles": {
                d: {k: vars(t) for k, t in default_block_config(d).items()} for d in args.head_dims
            },
        },
        "flop_model": "fwd = 4*b*h*s^2*d (x0.5 causal); fwd+bwd = 3.5 x fwd (bwd = 2.5 x fwd)",
        "matmul_peak": None,
        "results": [],
        "accuracy": [],
        "summary": [],
    }
    if args.merge and os.path.exists(out_path):
        with open(out_path) as f:
            old = json.load(f)
        record["results"], record["accuracy"] = old.get("results", []), old.get("accuracy", [])
        record["matmul_peak"] = old.get("matmul_peak")

    def save():
        record["summary"] = summarize(record)
        save_record(record, out_path)

    peak = matmul_peak(args.matmul_n, args.warmup, args.runs)
    if peak["tflops"] is not None or record["matmul_peak"] is None:
        record["matmul_peak"] = peak
    print(
        f"{device_kind}: bf16 {args.matmul_n}^3 matmul {peak['error'] or format(peak['tflops'], '.4g') + ' TFLOP/s'}",
        flush=True,
    )

    causals = {"both": [True, False], "true": [True], "false": [False]}[args.causal]
    for head_dim in args.head_dims:
        heads = max(1, args.hidden // head_dim)
        kv_heads = heads if args.kv_heads is None else args.kv_heads
        if heads % kv_heads:
            raise SystemExit(f"--kv-heads {kv_heads} does not divide the {heads} query heads (hidden / head dim)")
        for seq in args.seqs:
            batch = max(1, args.tokens // seq)
            keys = jax.random.split(jax.random.PRNGKey(seq + head_dim), 4)
            shapes = [(batch, seq, h, head_dim) for h in (heads, kv_heads, kv_heads, heads)]
            qkvd = [jax.random.normal(key, s, jnp.float32).astype(jnp.bfloat16) for key, s in zip(keys, shapes)]
            for causal in causals:
                flops_fwd, flops_fwd_bwd = attention_flops(batch, seq, heads, head_dim, causal)
                fns = {}
                for impl in args.impls:
                    row = {
                        "impl": impl,
                        "seq": seq,
                        "head_dim": head_dim,
                        "causal": causal,
                        "batch": batch,
                        "heads": heads,
                        "kv_heads": kv_heads,
                        "flops_fwd": flops_fwd,
                        "flops_fwd_bwd": flops_fwd_bwd,
                    }
                    if impl == "xla" and seq > args.xla_max_seq:
                        row["fwd_error"] = row["fwd_bwd_error"] = f"skipped: seq {seq} > --xla-max-seq"
                    else:
                        try:
                            fn = attention_fn(impl, causal, head_dim, jaxring_impl, args.cudnn_block_ops)
                            fns[impl] = forward_and_backward(fn)
                            fwd_s, fwd_err = timed(fns[impl][0], qkvd[:3], args.warmup, args.runs)
                            fb_s, fb_err = timed(fns[impl][1], qkvd, args.warmup, args.runs)
                        except Exception as e:
                            fwd_s = fb_s = None
                            fwd_err = fb_err = f"{type(e).__name__}: {e}"[:300]
                        row.update(fwd_s=fwd_s, fwd_error=fwd_err, fwd_bwd_s=fb_s, fwd_bwd_error=fb_err)
                        row["fwd_tflops"] = None if fwd_s is None else flops_fwd / fwd_s / 1e12
                        row["fwd_bwd_tflops"] = None if fb_s is None else flops_fwd_bwd / fb_s / 1e12
                    record["results"] = [
                        r
                        for r in record["results"]
                        if _key(r) + (r["impl"],) != (seq, head_dim, causal, heads, kv_heads, impl)
                    ] + [row]
                    fmt = lambda x, e: f"{x:7.3g}" if x is not None else f"error ({(e or '')[:60]})"
                    print(
                        f"d={head_dim:3d} seq={seq:6d} heads={heads}/{kv_heads} causal={causal!s:5} {impl:13s} "
                        f"fwd {fmt(row.get('fwd_tflops'), row.get('fwd_error'))} "
                        f"fwd+bwd {fmt(row.get('fwd_bwd_tflops'), row.get('fwd_bwd_error'))} TFLOP/s",
                        flush=True,
                    )
                for ours_name in (n for n in OURS if n in fns):
                    if seq != min(args.seqs) or len(fns) < 2:
                        break
                    check = accuracy_check(fns, qkvd, ours_name)
                    check.update(impl=ours_name, seq=seq, head_dim=head_dim, causal=causal, heads=heads)
                    check["kv_heads"] = kv_heads
                    record["accuracy"] = [
                        c
                        for c in record["accuracy"]
                        if _key(c) + (c.get("impl", "jaxring"),) != (seq, head_dim, causal, heads, kv_heads, ours_name)
                    ] + [check]
                    print(
                        f"  {ours_name} accuracy vs {check.get('reference')}: "
                        f"{check.get('max_abs_diff', check.get('error'))}",
                        flush=True,
                    )
                save()
            del qkvd
    save()
    print(f"wrote {out_path}")
    return record


def _key(row: dict) -> tuple:
    """(seq, head_dim, causal, heads, kv_heads) of a result or accuracy row (rows of older files: MHA)."""
    heads = row.get("heads")
    return (row["seq"], row["head_dim"], row["causal"], heads, row.get("kv_heads", heads))


def summarize(record):
    """Per (seq, head_dim, causal, heads, kv_heads): jaxring fwd / matmul peak, jaxring fwd+bwd / cuDNN fwd+bwd,
    jaxring-cudnn fwd+bwd / cuDNN fwd+bwd and jaxring-tokamax fwd+bwd / tokamax fwd+bwd (the block
    decompositions' overhead over one direct call)."""
    peak = (record.get("matmul_peak") or {}).get("tflops")
    by_key = {}
    for r in record["results"]:
        by_key.setdefault(_key(r), {})[r["impl"]] = r
    summary = []
    for (seq, head_dim, causal, heads, kv_heads), rows in sorted(by_key.items(), key=lambda kv: str(kv[0])):
        ours, cudnn = rows.get("jaxring", {}), rows.get("cudnn", {})
        fwd, fb, cudnn_fb = ours.get("fwd_tflops"), ours.get("fwd_bwd_tflops"), cudnn.get("fwd_bwd_tflops")
        blocks_fb = rows.get("jaxring-cudnn", {}).get("fwd_bwd_tflops")
        tok_blocks_fb = rows.get("jaxring-tokamax", {}).get("fwd_bwd_tflops")
        tok_fb = rows.get("tokamax", {}).get("fwd_bwd_tflops")
        summary.append(
            {
                "seq": seq,
                "head_dim": head_dim,
                "causal": causal,
                "heads": heads,
                "kv_heads": kv_heads,
                "jaxring_cudnn_fwd_bwd_tflops": blocks_fb,
                "jaxring_cudnn_over_cudnn_fwd_bwd": None if not (blocks_fb and cudnn_fb) else blocks_fb / cudnn_fb,
                "jaxring_tokamax_fwd_bwd_tflops": tok_blocks_fb,
                "jaxring_tokamax_over_tokamax_fwd_bwd": None
                if not (tok_blocks_fb and tok_fb)
                else tok_blocks_fb / tok_fb,
                "jaxring_fwd_tflops": fwd,
                "jaxring_fwd_bwd_tflops": fb,
                "cudnn_fwd_bwd_tflops": cudnn_fb,
                "jaxring_fwd_over_matmul_peak": None if not (fwd and peak) else fwd / peak,
                "jaxring_fwd_bwd_over_cudnn_fwd_bwd": None if not (fb and cudnn_fb) else fb / cudnn_fb,
            }
        )
    return summary


if __name__ == "__main__":
    main()
