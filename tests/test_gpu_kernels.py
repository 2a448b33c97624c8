"""The compiled Pallas flash kernel on a real GPU against the dense reference: out, lse and dq/dk/dv.

Skipped where JAX has no GPU backend (CI, and the CPU tests, which check the same kernels through the Pallas
interpreter in test_flash.py). On a GPU machine: `JAX_PLATFORMS= python -m pytest tests/test_gpu_kernels.py`.
Shapes are the kernel's real tiles (the Hopper defaults): several tiles per row, a partial last tile, skipped
tiles (causal, windows, documents), GQA, head dims 64 and 128, fp32 and bf16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxring import attention_reference
from jaxring.kernels.flash import flash_attention


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


def _relative_error(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    finite = np.isfinite(ref)
    assert np.array_equal(finite, np.isfinite(x)), "-inf/NaN pattern differs"
    scale = max(float(np.abs(ref[finite]).max()), 1e-6)
    return float(np.abs(x[finite] - ref[finite]).max()) / scale


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
    errors = {"out": _relative_error(out, out_r), "lse": _relative_error(lse, lse_r)}
    errors.update({f"d{n}": _relative_error(g, g_r) for n, g, g_r in zip("qkv", grads, grads_r, strict=True)})
    tolerance = TOLERANCE[dtype]
    assert all(e < tolerance for e in errors.values()), f"{name} {jnp.dtype(dtype).name}: {errors} > {tolerance}"
