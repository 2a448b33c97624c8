"""The tokamax block compute on CPU (skipped unless the optional tokamax package is installed): block_ops
"tokamax_reference" (tokamax's own XLA forward, which returns the Mosaic op's residuals, and a jnp stand-in of
the Mosaic GPU backward's contract) against the dense reference, forward out/lse and dq/dk/dv fed the global
lse and delta, for whole, causal, shifted-causal, windowed and GQA blocks, a two-block merge and a ring; the
classes of the key-range decomposition; and why the stand-in: tokamax's XLA backward ignores given residuals.

Not checkable here: the Mosaic GPU kernels themselves (no CPU or interpret path; tokamax raises "Not supported
on cpu"), so that they read the residuals and D = rowsum(out * dout) as tokamax's source says is checked on a GPU
(tests/device/test_gpu_kernels.py's tokamax case via benchmarks/gpu_session.sh) and by the deviceless H100 compile.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, check, qkv, with_reference

import jaxring
from jaxring.analysis import gpu
from jaxring.core import compat
from jaxring.kernels import tokamax_contract
from jaxring.kernels.block_compute import get_block_ops
from jaxring.kernels.flash import flash_block_ops
from jaxring.kernels.merge import merge_partials
from jaxring.kernels.reference import attention_reference
from jaxring.kernels.tokamax_blocks import (
    FALLBACK,
    MOSAIC_CALLS,
    RANGES,
    REFERENCE_CALLS,
    SKIP,
    WHOLE,
    block_class,
    delta_output,
    key_ranges,
    tokamax_block_ops,
)

tokamax = pytest.importorskip(
    "tokamax", reason="the optional tokamax package is not installed (pip install 'jaxring[tokamax]')"
)

SCALE = 0.3
OPS = get_block_ops("tokamax_reference") if compat.has_tokamax_attention() else None


def assert_lse_close(lse, lse_ref, rtol):
    lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref), err_msg="-inf rows differ")
    assert_close(np.where(np.isneginf(lse), 0, lse), np.where(np.isneginf(lse_ref), 0, lse_ref), rtol, "lse")


def _reference(q, k, v, qp, kp, causal, window=None):
    fn = lambda q, k, v: attention_reference(
        q, k, v, causal=causal, q_positions=qp, kv_positions=kp, sm_scale=SCALE, window=window
    )
    return jax.vjp(fn, q, k, v)


def test_names():
    assert OPS.name == "tokamax_reference"
    with pytest.raises(ValueError, match="'tokamax' needs an NVIDIA GPU"):
        get_block_ops("tokamax")


def test_xla_backward_ignores_given_residuals():
    """Why the CPU backward is a stand-in: tokamax's XLA VJP recomputes the softmax, so false residuals and a
    false output change nothing (the Mosaic GPU one reads them)."""
    q, k, v, do = qkv(1, 1, 32, 4, 2, 16)
    op = compat.tokamax_xla_attention(with_vjp=True)
    ranges = dict(k_start=None, k_end=None, sm_scale=SCALE)
    out, m, s = compat.tokamax_attention_forward(op, q, k, v, **ranges)
    true = compat.tokamax_attention_backward(op, m, s, out, do, q, k, v, **ranges)
    false = compat.tokamax_attention_backward(op, m + 5.0, s * 3.0, out * 7.0 + 1.0, do, q, k, v, **ranges)
    for g, g_false in zip(true, false):
        np.testing.assert_array_equal(g, g_false)


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_stand_in_backward_matches_tokamax(gqa):
    """With the block's own residuals and output (no global ones: tokamax's recomputation then agrees), the
    stand-in of the Mosaic backward equals tokamax's XLA backward, key-range mask included."""
    q, k, v, do = qkv(2, 2, 32, 4, 2 if gqa else 4, 16)
    k_start = (jnp.arange(32) // 3)[None, None].astype(jnp.int32)
    k_end = (jnp.arange(32) + 1)[None, None].astype(jnp.int32)
    ranges = dict(k_start=k_start, k_end=k_end, sm_scale=SCALE)
    op = compat.tokamax_xla_attention(with_vjp=True)
    out, m, s = compat.tokamax_attention_forward(op, q, k, v, **ranges)
    want = compat.tokamax_attention_backward(op, m, s, out, do, q, k, v, **ranges)
    got = tokamax_contract.backward(m, s, out, do, q, k, v, **ranges)
    for n, g, w in zip("qkv", got, want):
        assert_close(g, w, 1e-5, "d" + n)


def test_delta_output_rowsum():
    _, _, _, do = qkv(3, 2, 16, 4, 4, 16, jnp.bfloat16)
    do = do.at[0, 3, 1].set(0)  # a row with dO = 0: delta 0 from O
    delta = jax.random.normal(jax.random.PRNGKey(4), do.shape[:3]).at[0, 3, 1].set(0.0)
    o = delta_output(do, delta)
    assert o.dtype == jnp.float32
    rowsum = jnp.einsum("bnhd,bnhd->bnh", o, do.astype(jnp.float32))
    assert_close(rowsum, delta, 1e-6, "rowsum")


# (q positions, kv positions, causal, window, q heads, kv heads, class)
BLOCKS = {
    "whole": (np.arange(32) + 64, np.arange(48), False, None, 4, 4, WHOLE),
    "whole-causal": (np.arange(32) + 64, np.arange(48), True, None, 4, 4, WHOLE),
    "causal": (np.arange(32), np.arange(32), True, None, 4, 4, RANGES),
    "causal-overlap-gqa": (np.arange(32) + 24, np.arange(48), True, None, 4, 2, RANGES),
    "shifted-striped": (np.arange(32) * 4 + 1, np.arange(32) * 4 + 2, True, None, 4, 1, RANGES),
    "zigzag-kv": (np.arange(32) + 8, np.r_[np.arange(16), np.arange(16) + 48], True, None, 4, 2, RANGES),
    "window": (np.arange(32) + 16, np.arange(48), True, 9, 4, 2, RANGES),
    "skip": (np.arange(32), np.arange(32) + 40, True, None, 4, 4, SKIP),
    "unsorted-kv": (np.arange(32) + 16, np.arange(48)[::-1].copy(), True, None, 4, 2, FALLBACK),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_matches_reference(name):
    """One block: its class, forward (out, lse) and backward fed the global lse and delta vs the dense
    reference (one block: global = the block's)."""
    qp, kp, causal, window, hq, hkv, cls = BLOCKS[name]
    qp, kp = jnp.asarray(qp, jnp.int32), jnp.asarray(kp, jnp.int32)
    q, _, _, do = qkv(5, 2, qp.shape[0], hq, hkv, 16)
    _, k, v, _ = qkv(6, 2, kp.shape[0], hq, hkv, 16)
    assert int(block_class(qp, kp, causal=causal, window=window)) == cls
    kw = dict(causal=causal, sm_scale=SCALE, **({} if window is None else {"window": window}))
    (out_r, lse_r), vjp = _reference(q, k, v, qp, kp, causal, window)
    out, lse = jax.jit(lambda q, k, v: OPS.forward(q, k, v, qp, kp, None, None, **kw))(q, k, v)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert_close(out, out_r, 1e-5, "out")
    assert_lse_close(lse, lse_r, 1e-5)
    delta = jnp.sum(do * out_r, axis=-1)
    grads = jax.jit(lambda *a: OPS.backward(*a, qp, kp, None, None, **kw))(q, k, v, do, lse_r, delta)
    for n, g, g_r in zip("qkv", grads, vjp((do, jnp.zeros_like(lse_r)))):
        assert_close(g, g_r, 1e-5, "d" + n)


def test_key_ranges():
    """Ascending K/V positions: each query's visible keys are the index range [k_start, k_end)."""
    qp, kp = jnp.array([3, 9, 20]), jnp.array([0, 2, 4, 8, 9, 15, 30])
    k_start, k_end = key_ranges(qp, kp, causal=True, window=6)
    np.testing.assert_array_equal(k_end, [2, 5, 6])  # keys <= 3, <= 9, <= 20
    np.testing.assert_array_equal(k_start, [0, 2, 5])  # keys <= -3, <= 3, <= 14 are out of the window
    assert key_ranges(qp, kp, causal=False) == (None, None)


def test_two_blocks_merged_with_global_lse_and_delta():
    """K/V split unevenly into two blocks (one partly visible, GQA): merged forward = reference; each block's
    backward fed the *global* lse and delta, summed, = reference (the ring's use)."""
    q, _, _, do = qkv(7, 2, 32, 4, 2, 16)
    _, k, v, _ = qkv(8, 2, 64, 4, 2, 16)
    qp, kp = jnp.arange(32) + 24, jnp.arange(64)
    (out_r, lse_r), vjp = _reference(q, k, v, qp, kp, True)
    dq_r, dk_r, dv_r = vjp((do, jnp.zeros_like(lse_r)))
    halves = [(k[:, :40], v[:, :40], kp[:40]), (k[:, 40:], v[:, 40:], kp[40:])]
    kw = dict(causal=True, sm_scale=SCALE)
    parts = [OPS.forward(q, kb, vb, qp, pb, None, None, **kw) for kb, vb, pb in halves]
    out, lse = merge_partials(*parts[0], *parts[1])
    assert_close(out, out_r, 1e-5, "merged out")
    assert_lse_close(lse, lse_r, 1e-5)
    delta = jnp.sum(do * out_r, axis=-1)
    grads = [OPS.backward(q, kb, vb, do, lse_r, delta, qp, pb, None, None, **kw) for kb, vb, pb in halves]
    assert_close(grads[0][0] + grads[1][0], dq_r, 1e-5, "dq")
    assert_close(jnp.concatenate([grads[0][1], grads[1][1]], 1), dk_r, 1e-5, "dk")
    assert_close(jnp.concatenate([grads[0][2], grads[1][2]], 1), dv_r, 1e-5, "dv")


def test_bf16_block_and_documents_fall_back():
    """bf16 inputs take the tokamax path (gradients rounded once per block); segment ids go to the fallback."""
    q, k, v, do = qkv(9, 1, 32, 4, 2, 16, jnp.bfloat16)
    pos = jnp.arange(32)
    (out_r, lse_r), vjp = _reference(q, k, v, pos, pos, True)
    out, lse = OPS.forward(q, k, v, pos, pos, None, None, causal=True, sm_scale=SCALE)
    assert_close(out, out_r, 2e-2, "bf16 out")
    assert_lse_close(lse, lse_r, 1e-2)
    delta = jnp.sum(do.astype(jnp.float32) * out_r.astype(jnp.float32), axis=-1)
    grads = OPS.backward(q, k, v, do, lse_r, delta, pos, pos, None, None, causal=True, sm_scale=SCALE)
    for n, g, g_r in zip("qkv", grads, vjp((do, jnp.zeros_like(lse_r)))):
        assert_close(g, g_r, 3e-2, "bf16 d" + n)
    seg = jnp.asarray(np.r_[np.ones(20), 2 * np.ones(12)][None], jnp.int32)
    out_s, _ = OPS.forward(q, k, v, pos, pos, seg, seg, causal=True, sm_scale=SCALE)
    out_d = attention_reference(q, k, v, causal=True, segment_ids=seg, sm_scale=SCALE)[0]
    assert_close(out_s, out_d, 2e-2, "documents out")
    assert REFERENCE_CALLS.name == OPS.name


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_ring_matches_reference(layout):
    """The ring over 8 CPU devices with block_ops="tokamax_reference", GQA: forward and dq/dk/dv."""
    q, k, v, dout = qkv(10, 1, 128, 4, 2, 16)
    mesh = jaxring.make_mesh(sp=8)

    def fn(q, k, v):
        return jaxring.sharded_attention(
            q, k, v, mesh=mesh, strategy="ring", causal=True, layout=layout, block_ops="tokamax_reference"
        )

    check(*with_reference(fn, q, k, v, dout, causal=True), 2e-4)


@pytest.mark.skipif(not gpu.available()[0], reason="needs the gpu-compile extra (CUDA plugin and ptxas)")
def test_deviceless_h100_compile_has_mosaic_kernels():
    """block_ops "tokamax" compiles for an H100 with no GPU (bf16 1 x 4096 x 8 x 128 causal, GQA 8:2, forward and
    backward): tokamax's Mosaic GPU kernels (two forwards, WHOLE and RANGES; their dq and dk/dv kernels) beside
    the Pallas fallback's Triton ones; dk/dv come back with the K/V heads (GQA not repeated)."""
    devices = gpu.gpu_devices("h100", 1)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    x = lambda heads: gpu.abstract((1, 4096, heads, 128), jnp.bfloat16, mesh)
    ops = tokamax_block_ops(MOSAIC_CALLS, flash_block_ops())  # get_block_ops("tokamax") wants a real NVIDIA GPU

    def block(q, k, v, do):
        pos = jnp.arange(4096, dtype=jnp.int32)
        out, lse = ops.forward(q, k, v, pos, pos, causal=True, sm_scale=128**-0.5)
        delta = jnp.sum(do.astype(jnp.float32) * out, -1)
        return out, ops.backward(q, k, v, do, lse, delta, pos, pos, causal=True, sm_scale=128**-0.5)

    # tokamax picks its kernels by the default device's compute capability; cross_compile lifts its device check
    with tokamax.config.cross_compile(True), jax.default_device(devices[0]):
        lowered = jax.jit(block).lower(x(8), x(2), x(2), x(8))
    text = lowered.compile().as_text()
    calls = [line for line in text.splitlines() if 'custom_call_target="mosaic_gpu_v2"' in line]
    assert len(calls) == 6, len(calls)
    assert sum("flash_attention_sm90" in line for line in calls) == 2
    assert sum("(bf16[4096,2,128]{2,1,0}, bf16[4096,2,128]{2,1,0}) custom-call" in line for line in calls) == 2
    assert 'custom_call_target="__gpu$xla.gpu.triton"' in text
