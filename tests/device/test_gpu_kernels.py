"""The compiled Pallas flash kernel and the cuDNN and tokamax block computes on a real GPU against the dense
reference: out, lse and dq/dk/dv (cuDNN, tokamax: out and dq/dk/dv, through `block_attention`, with zig-zag and
striped block positions; tokamax only where the optional package is installed and the GPU is sm90 or sm100).

Skipped where JAX has no GPU backend (CI, and the CPU tests, which check the same kernels through the Pallas
interpreter in test_flash.py). On a GPU machine: `JAX_PLATFORMS= python -m pytest tests/device/test_gpu_kernels.py`.
Shapes are the kernel's real tiles (the Hopper defaults): several tiles per row, a partial last tile, skipped
tiles (causal, windows, documents), GQA, head dims 64 and 128, fp32 and bf16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import relative_error

from jaxring import attention_reference
from jaxring.core import compat
from jaxring.kernels.block_attention import block_attention
from jaxring.kernels.block_compute import get_block_ops, nvidia_gpu
from jaxring.kernels.cudnn_blocks import FALLBACK, planned_classes
from jaxring.kernels.flash import flash_attention
from jaxring.kernels.layout import layout_positions
from jaxring.kernels.tokamax_blocks import FALLBACK as TOKAMAX_FALLBACK
from jaxring.kernels.tokamax_blocks import block_class


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


GPU = _gpu()
pytestmark = pytest.mark.skipif(GPU is None, reason="needs a GPU (run with JAX_PLATFORMS= to use every backend)")

# max |error| / max |reference|: the reference runs fp32 dots at full precision (conftest); the kernel's
# Triton dots may use TF32 on fp32 inputs, accumulating in fp32; bf16 inputs are compared against the fp32
# reference of the same bf16 values
TOLERANCE = {jnp.float32: 5e-3, jnp.bfloat16: 2e-2}


def _inputs(seed, batch, seq, q_heads, kv_heads, head_dim, dtype):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    shape_q, shape_kv = (batch, seq, q_heads, head_dim), (batch, seq, kv_heads, head_dim)
    q = jax.random.normal(ks[0], shape_q).astype(dtype)
    k = jax.random.normal(ks[1], shape_kv).astype(dtype)
    v = jax.random.normal(ks[2], shape_kv).astype(dtype)
    dout = jax.random.normal(ks[3], shape_q).astype(dtype)
    dlse = jax.random.normal(ks[4], (batch, seq, q_heads))
    return [jax.device_put(x, GPU) for x in (q, k, v, dout, dlse)]


CASES = [
    # name, seq, q_heads, kv_heads, head_dim, causal, window, documents
    ("causal d128", 2048, 8, 8, 128, True, None, False),
    ("full d64", 1536, 4, 4, 64, False, None, False),
    ("causal GQA 8:2 partial tile", 1000, 8, 2, 128, True, None, False),
    ("sliding window 256", 2048, 4, 1, 128, True, 256, False),
    ("packed documents", 2048, 4, 2, 64, True, None, True),
]


# every case in bf16 (the training dtype), the GQA one in fp32 too: each case compiles its own kernels
PARAMS = [pytest.param(*c, jnp.bfloat16, id=f"{c[0]} bf16") for c in CASES]
PARAMS.append(pytest.param(*CASES[2], jnp.float32, id=f"{CASES[2][0]} fp32"))


@pytest.mark.parametrize("name,seq,q_heads,kv_heads,head_dim,causal,window,documents,dtype", PARAMS)
def test_compiled_kernel_matches_reference(name, seq, q_heads, kv_heads, head_dim, causal, window, documents, dtype):
    q, k, v, dout, dlse = _inputs(len(name), 2, seq, q_heads, kv_heads, head_dim, dtype)
    options = dict(causal=causal, window=window)
    if documents:  # three documents and trailing padding (id 0) in row 0; one document in row 1
        ids = np.ones((2, seq), np.int32)
        ids[0, seq // 3 :] = 2
        ids[0, 2 * seq // 3 :] = 3
        ids[0, -50:] = 0
        options["segment_ids"] = jax.device_put(jnp.asarray(ids), GPU)

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)) + jnp.sum(lse * dlse), (out, lse)

    def kernel(q, k, v):
        return flash_attention(q, k, v, return_lse=True, implementation="pallas", **options)

    def reference(q, k, v):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return attention_reference(*f32, **options)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(lambda *a: loss(kernel, *a), (0, 1, 2), has_aux=True))(q, k, v)
    (_, (out_r, lse_r)), grads_r = jax.jit(jax.value_and_grad(lambda *a: loss(reference, *a), (0, 1, 2), has_aux=True))(
        q, k, v
    )
    assert out.dtype == dtype and out.devices() == {GPU}
    errors = {"out": relative_error(out, out_r), "lse": relative_error(lse, lse_r)}
    errors.update({f"d{n}": relative_error(g, g_r) for n, g, g_r in zip("qkv", grads, grads_r, strict=True)})
    tolerance = TOLERANCE[dtype]
    assert all(e < tolerance for e in errors.values()), f"{name} {jnp.dtype(dtype).name}: {errors} > {tolerance}"


# cuDNN: (name, seq, q heads, kv heads, head dim, causal, window, documents, block positions) with positions
# "natural" (one run), or (layout, ranks, q rank, kv rank): one ring step's block of that layout
CUDNN_CASES = [
    ("causal d128", 2048, 8, 8, 128, True, None, False, "natural"),
    ("full GQA 32:8", 2048, 32, 8, 128, False, None, False, "natural"),
    ("zigzag diagonal GQA", 2048, 8, 2, 128, True, None, False, ("zigzag", 4, 1, 1)),
    ("zigzag off-diagonal", 2048, 8, 2, 128, True, None, False, ("zigzag", 4, 1, 3)),
    ("striped shifted", 2048, 8, 2, 64, True, None, False, ("striped", 4, 1, 2)),
    ("window 256", 2048, 4, 1, 128, True, 256, False, "natural"),
    ("documents (fallback)", 2048, 4, 2, 64, True, None, True, "natural"),
]
CUDNN = nvidia_gpu() if GPU is not None else False


@pytest.mark.skipif(
    not (CUDNN and compat.has_cudnn_attention()), reason="needs an NVIDIA GPU and JAX's cuDNN primitives"
)
@pytest.mark.parametrize(
    "name,seq,q_heads,kv_heads,head_dim,causal,window,documents,blocks",
    [pytest.param(*c, id=c[0]) for c in CUDNN_CASES],
)
def test_cudnn_blocks_match_reference(name, seq, q_heads, kv_heads, head_dim, causal, window, documents, blocks):
    """bf16 through cuDNN (block_ops "cudnn"): the block decomposition, the stats conversion and the backward
    from the global lse and the stand-in output O' (rowsum(dO O') = delta), against the fp32 reference."""
    no_fallback = lambda qp, kp: FALLBACK not in planned_classes(qp, kp, causal=causal)
    _blocks_match_reference(
        "cudnn", no_fallback, name, seq, q_heads, kv_heads, head_dim, causal, window, documents, blocks
    )


TOKAMAX = CUDNN and compat.has_tokamax_attention() and float(getattr(GPU, "compute_capability", 0)) >= 9


@pytest.mark.skipif(not TOKAMAX, reason="needs the optional tokamax package and an sm90/sm100 NVIDIA GPU")
@pytest.mark.parametrize(
    "name,seq,q_heads,kv_heads,head_dim,causal,window,documents,blocks",
    [pytest.param(*c, id=c[0]) for c in CUDNN_CASES],
)
def test_tokamax_blocks_match_reference(name, seq, q_heads, kv_heads, head_dim, causal, window, documents, blocks):
    """bf16 through tokamax's Mosaic GPU kernels (block_ops "tokamax"): the key ranges, (max, sum) -> lse, and the
    backward from the global lse as (lse, 1) and the stand-in output O' in fp32, against the fp32 reference."""
    no_fallback = lambda qp, kp: int(block_class(qp, kp, causal=causal, window=window)) != TOKAMAX_FALLBACK
    _blocks_match_reference(
        "tokamax", no_fallback, name, seq, q_heads, kv_heads, head_dim, causal, window, documents, blocks
    )


def _blocks_match_reference(
    block_ops, no_fallback, name, seq, q_heads, kv_heads, head_dim, causal, window, documents, blocks
):
    """One CUDNN_CASES case through `block_attention` with the named block compute vs the fp32 reference."""
    q, k, v, dout, _ = _inputs(len(name), 2, seq, q_heads, kv_heads, head_dim, jnp.bfloat16)
    options = dict(causal=causal, window=window)
    if blocks == "natural":
        qp = kp = None
    else:
        layout, ranks, qr, kr = blocks
        qp, kp = (layout_positions(layout, r, ranks, seq) for r in (qr, kr))
        assert no_fallback(qp, kp)
        options.update(q_positions=qp, kv_positions=kp)
    if documents:
        ids = np.ones((2, seq), np.int32)
        ids[0, seq // 3 :] = 2
        ids[0, -50:] = 0
        options["segment_ids"] = jax.device_put(jnp.asarray(ids), GPU)
    ops = get_block_ops(block_ops)

    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    def reference(q, k, v):
        return attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), **options)[0]

    grad = lambda f: jax.jit(jax.value_and_grad(lambda *a: loss(f, *a), (0, 1, 2), has_aux=True))
    (_, out), grads = grad(lambda q, k, v: block_attention(ops, q, k, v, **options))(q, k, v)
    (_, out_r), grads_r = grad(reference)(q, k, v)
    errors = {"out": relative_error(out, out_r)}
    errors.update({f"d{n}": relative_error(g, g_r) for n, g, g_r in zip("qkv", grads, grads_r, strict=True)})
    assert all(e < TOLERANCE[jnp.bfloat16] for e in errors.values()), f"{name}: {errors}"
