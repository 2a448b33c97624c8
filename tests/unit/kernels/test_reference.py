"""The dense reference against jax.nn.dot_product_attention and against first principles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, qkv, value_and_grads

from jaxring import attention_reference, merge_partials
from jaxring.kernels.merge import empty_partial


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_matches_jax_nn(causal, q_heads, kv_heads):
    q, k, v, dout = qkv(0, 2, 24, q_heads, kv_heads, 16)
    out, grads = value_and_grads(lambda q, k, v: attention_reference(q, k, v, causal=causal)[0], q, k, v, dout)
    out_nn, grads_nn = value_and_grads(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal), q, k, v, dout
    )
    assert_close(out, out_nn, 1e-5, "out")
    for name, g, g_nn in zip("qkv", grads, grads_nn):
        assert_close(g, g_nn, 1e-5, "d" + name)


def test_lse_is_logsumexp_of_scaled_scores():
    q, k, v, _ = qkv(1, 1, 16, 2, 2, 8)
    _, lse = attention_reference(q, k, v, causal=False, sm_scale=0.3)
    s = jnp.einsum("bqhd,bkhd->bqhk", q, k) * 0.3
    assert_close(lse, jax.nn.logsumexp(s, axis=-1), 1e-6, "lse")


def test_segments_match_jax_nn_with_mask():
    q, k, v, dout = qkv(2, 2, 20, 4, 2, 8)
    seg = jnp.array([[1] * 7 + [2] * 13, [3] * 12 + [4] * 8])
    out, grads = value_and_grads(
        lambda q, k, v: attention_reference(q, k, v, causal=True, segment_ids=seg)[0], q, k, v, dout
    )
    mask = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((20, 20), bool))
    out_nn, grads_nn = value_and_grads(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask[:, None]), q, k, v, dout
    )
    assert_close(out, out_nn, 1e-5, "out")
    for name, g, g_nn in zip("qkv", grads, grads_nn):
        assert_close(g, g_nn, 1e-5, "d" + name)


def test_positions_mask_any_order():
    """Shuffling the keys and passing their positions gives the same causal attention."""
    q, k, v, _ = qkv(3, 1, 16, 2, 1, 8)
    perm = np.random.default_rng(0).permutation(16)
    out, lse = attention_reference(q, k, v, causal=True)
    out_p, lse_p = attention_reference(q, k[:, perm], v[:, perm], causal=True, kv_positions=jnp.asarray(perm))
    assert_close(out_p, out, 1e-6, "out")
    assert_close(lse_p, lse, 1e-6, "lse")


def test_padding_rows_are_zero_with_finite_grads():
    q, k, v, dout = qkv(4, 1, 8, 2, 2, 4)
    seg = jnp.array([[1, 1, 1, 0, 0, 2, 2, 0]])
    fn = lambda q, k, v: attention_reference(q, k, v, causal=True, segment_ids=seg)
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    pad = np.asarray(seg[0] == 0)
    assert np.all(np.asarray(out)[0, pad] == 0) and np.all(np.isneginf(np.asarray(lse)[0, pad]))
    grads = vjp((dout, jnp.zeros_like(lse)))
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[0])[0, pad] == 0)


def test_merge_of_halves_equals_whole():
    q, k, v, _ = qkv(5, 2, 16, 4, 2, 8)
    out, lse = attention_reference(q, k, v, causal=False)
    a = attention_reference(q, k[:, :6], v[:, :6], causal=False, kv_positions=jnp.arange(6))
    b = attention_reference(q, k[:, 6:], v[:, 6:], causal=False, kv_positions=jnp.arange(6, 16))
    m_out, m_lse = merge_partials(a[0].astype(jnp.float32), a[1], b[0].astype(jnp.float32), b[1])
    assert_close(m_out, out, 1e-6, "out")
    assert_close(m_lse, lse, 1e-6, "lse")


def test_merge_with_fully_masked_partial_is_identity_and_nan_free():
    out = jnp.ones((1, 3, 2, 4))
    lse = jnp.array([[[0.5, -jnp.inf], [1.0, 2.0], [-jnp.inf, -jnp.inf]]])
    e_out, e_lse = empty_partial(out)
    m_out, m_lse = merge_partials(out, lse, e_out, e_lse)
    assert np.isfinite(np.asarray(m_out)).all()
    np.testing.assert_array_equal(np.asarray(m_lse), np.asarray(lse))
    expected = np.where(np.isneginf(np.asarray(lse))[..., None], 0.0, 1.0) * np.ones(out.shape)
    np.testing.assert_array_equal(np.asarray(m_out), expected)
