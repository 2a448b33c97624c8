"""The jnp per-block compute (tiled, with tile skipping) against the dense reference, at any offsets."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_close, qkv

from jaxring import attention_reference
from jaxring.kernels.blockwise import block_backward, block_forward


@pytest.mark.parametrize("q_offset,kv_offset", [(20, 5), (0, 30), (8, 8)])  # after, before, overlapping
@pytest.mark.parametrize("with_segments", [False, True])
def test_block_pair_matches_reference(q_offset, kv_offset, with_segments):
    q, k, v, dout = qkv(0, 2, 32, 4, 2, 16)
    q = q[:, :24]
    dout = dout[:, :24]
    q_pos, kv_pos = jnp.arange(24) + q_offset, jnp.arange(32) + kv_offset
    q_seg = kv_seg = None
    if with_segments:
        q_seg = jnp.array([[1] * 10 + [2] * 14, [0] * 24])
        kv_seg = jnp.array([[1] * 20 + [2] * 12, [3] * 32])
    ref = lambda q, k, v: attention_reference(
        q, k, v, causal=True, q_positions=q_pos, kv_positions=kv_pos, segment_ids=q_seg, kv_segment_ids=kv_seg
    )
    (out_r, lse_r), vjp = jax.vjp(ref, q, k, v)
    out, lse = block_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal=True, sm_scale=0.25, q_tile=8, kv_tile=8)
    assert_close(out, out_r, 2e-5, "out")
    assert (jnp.isneginf(lse) == jnp.isneginf(lse_r)).all()
    assert_close(jnp.where(jnp.isneginf(lse), 0, lse), jnp.where(jnp.isneginf(lse_r), 0, lse_r), 2e-5, "lse")
    delta = jnp.sum(dout * out_r, axis=-1)
    grads = block_backward(
        q, k, v, dout, lse_r, delta, q_pos, kv_pos, q_seg, kv_seg, causal=True, sm_scale=0.25, q_tile=8, kv_tile=8
    )
    for name, g, g_r in zip("qkv", grads, vjp((dout, jnp.zeros_like(lse_r)))):
        assert_close(g, g_r, 2e-5, "d" + name)


def test_accumulating_forms_merge_and_add():
    """`into=` continues the online softmax from a running (out, lse) and adds gradients in place: the same
    as merging two blocks' partials and adding their gradients."""
    from jaxring.kernels.merge import merge_partials

    q, k, v, dout = qkv(1, 1, 32, 4, 2, 16)
    pos = jnp.arange(32)
    kw = dict(causal=True, sm_scale=0.25, q_tile=8, kv_tile=8)
    halves = [(k[:, :16], v[:, :16], pos[:16]), (k[:, 16:], v[:, 16:], pos[16:])]
    parts = [block_forward(q, kh, vh, pos, ph, **kw) for kh, vh, ph in halves]
    merged = merge_partials(*parts[0], *parts[1])
    running = block_forward(q, *halves[1][:2], pos, halves[1][2], **kw, into=parts[0])
    assert_close(running[0], merged[0], 1e-6, "out")
    assert_close(running[1], merged[1], 1e-6, "lse")
    out, lse = merged
    delta = jnp.sum(dout * out, axis=-1)
    first = block_backward(q, *halves[0][:2], dout, lse, delta, pos, halves[0][2], **kw)
    second = block_backward(q, *halves[1][:2], dout, lse, delta, pos, halves[1][2], **kw)
    dk0, dv0 = jnp.zeros_like(first[1]) + 1.0, jnp.zeros_like(first[2]) - 1.0
    added = block_backward(q, *halves[1][:2], dout, lse, delta, pos, halves[1][2], **kw, into=(first[0], dk0, dv0))
    assert_close(added[0], first[0] + second[0], 1e-6, "dq")
    assert_close(added[1], dk0 + second[1], 1e-6, "dk")
    assert_close(added[2], dv0 + second[2], 1e-6, "dv")
