"""The TPU flash kernels compiled by Mosaic on a real TPU (block_ops "pallas_tpu") against the dense reference:
out, lse and dq/dk/dv for a ring step's blocks (shifted, zig-zag's two runs, striped, a window across blocks,
documents with padding, GQA/MQA), fp32 and bf16, and the zig-zag ring over every TPU chip of the host.

Skipped where JAX has no TPU backend (CI: the same kernels run in TPU interpret mode in test_tpu_blocks.py, and
compile for v5e, v5p, v6e and TPU7x without a TPU in test_tpu_compile.py). On a TPU VM:
`JAX_PLATFORMS= python -m pytest tests/device/test_tpu_kernels.py` (benchmarks/tpu_session.sh runs it).
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import relative_error
from test_tpu_blocks import BLOCKS, SCALE, _segments

import jaxring
from jaxring import attention_reference
from jaxring.kernels.block_compute import get_block_ops


def _tpus():
    try:
        return jax.devices("tpu")
    except RuntimeError:
        return []


TPUS = _tpus()
pytestmark = pytest.mark.skipif(not TPUS, reason="needs a TPU (run with JAX_PLATFORMS= to use every backend)")
# max |error| / max |reference|: the reference's fp32 dots at full precision; the kernel's fp32 dots at
# HIGHEST, bf16 inputs compared against the fp32 reference of the same bf16 values
TOLERANCE = {jnp.float32: 5e-3, jnp.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_matches_reference(name, dtype):
    qp, kp, causal, window, hq, hkv, documents = BLOCKS[name]
    qp, kp = jnp.asarray(qp, jnp.int32), jnp.asarray(kp, jnp.int32)
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (2, qp.shape[0], hq, 128)).astype(dtype)
    k = jax.random.normal(ks[1], (2, kp.shape[0], hkv, 128)).astype(dtype)
    v = jax.random.normal(ks[2], (2, kp.shape[0], hkv, 128)).astype(dtype)
    do = jax.random.normal(ks[3], q.shape).astype(dtype)
    q_seg = kv_seg = None
    if documents:
        q_seg, kv_seg = (
            jnp.asarray(_segments(512, (100, 300))[:, 128:384]),
            jnp.asarray(_segments(512, (100, 300))[:, :384]),
        )
    f32 = lambda x: x.astype(jnp.float32)
    ref = lambda q, k, v: attention_reference(
        q, k, v, causal=causal, q_positions=qp, kv_positions=kp, sm_scale=SCALE, window=window,
        segment_ids=q_seg, kv_segment_ids=kv_seg,
    )  # fmt: skip
    (out_r, lse_r), vjp = jax.vjp(ref, f32(q), f32(k), f32(v))
    ops = get_block_ops("pallas_tpu")
    kw = dict(causal=causal, sm_scale=SCALE, **({} if window is None else {"window": window}))
    out, lse = jax.jit(lambda q, k, v: ops.forward(q, k, v, qp, kp, q_seg, kv_seg, **kw))(q, k, v)
    delta = jnp.sum(f32(do) * out_r, axis=-1)
    grads = jax.jit(lambda *a: ops.backward(*a, qp, kp, q_seg, kv_seg, **kw))(q, k, v, do, lse_r, delta)
    tol = TOLERANCE[dtype]
    assert relative_error(out, out_r) < tol
    assert relative_error(lse, lse_r) < tol
    for g, g_r in zip(grads, vjp((f32(do), jnp.zeros_like(lse_r)))):
        assert relative_error(g, g_r) < tol


def test_ring_on_every_chip():
    """The zig-zag ring over the host's TPU chips, bf16, GQA, 8K tokens: forward and dq/dk/dv."""
    mesh = jaxring.make_mesh(sp=len(jax.devices()))
    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    shape = (1, 8192, 8, 128)
    q, do = (jax.random.normal(kk, shape).astype(jnp.bfloat16) for kk in (ks[0], ks[3]))
    k, v = (jax.random.normal(kk, (1, 8192, 2, 128)).astype(jnp.bfloat16) for kk in ks[1:3])
    fn = lambda q, k, v: jaxring.sharded_attention(
        q, k, v, mesh=mesh, strategy="ring", layout="zigzag", causal=True, block_ops="pallas_tpu"
    )
    out, vjp = jax.vjp(fn, q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    out_r, vjp_r = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=True)[0], f32(q), f32(k), f32(v))
    assert relative_error(out, out_r) < 3e-2
    for g, g_r in zip(vjp(do), vjp_r(f32(do))):
        assert relative_error(g, g_r) < 3e-2
