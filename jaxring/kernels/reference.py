"""Dense attention with log-sum-exp: the oracle every strategy is tested against.

It materialises the full [batch, heads, q_len, kv_len] score matrix, so use it for tests and small inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxring.kernels.masking import attention_mask, check_qkv, check_window


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention computed densely in fp32.

    Args:
      q: [batch, q_len, q_heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim], q_heads % kv_heads == 0.
        Query head h reads key/value head h // (q_heads // kv_heads), as `jax.nn.dot_product_attention`.
      causal: mask keys whose position is greater than the query's.
      q_positions, kv_positions: int [q_len] / [kv_len] (or with a leading batch dim); default arange.
      segment_ids: int [batch, q_len]; tokens attend only within their segment; 0 is padding.
      kv_segment_ids: int [batch, kv_len]; defaults to segment_ids (self-attention).
      sm_scale: score scale, default 1/sqrt(head_dim).
      window: sliding window W (needs causal): query i sees keys i - W < j <= i; None: unlimited.

    Returns:
      out [batch, q_len, q_heads, head_dim] in q.dtype (rows with no visible key are 0) and
      lse [batch, q_len, q_heads] fp32, natural log (-inf for rows with no visible key).
    """
    check_qkv(q, k, v)
    window = check_window(window, causal)
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    groups = q_heads // kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    if q_positions is None:
        q_positions = jnp.arange(q_len)
    if kv_positions is None:
        kv_positions = jnp.arange(kv_len)
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("segment_ids and kv_segment_ids must be given together")

    qg = q.astype(jnp.float32).reshape(batch, q_len, kv_heads, groups, head_dim)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32)) * scale
    mask = attention_mask(q_positions, kv_positions, segment_ids, kv_segment_ids, causal=causal, window=window)
    o, lse = softmax_attend(s, v, mask)
    return o.reshape(batch, q_len, q_heads, head_dim).astype(q.dtype), lse.reshape(batch, q_len, q_heads)


def softmax_attend(s: jax.Array, v: jax.Array, mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Masked softmax of grouped scores times V: the core shared by the reference and the jnp block path.

    s: fp32 scores [batch, kv_heads, groups, q_len, kv_len]; v: [batch, kv_len, kv_heads, head_dim];
    mask: bool broadcastable to [batch, q_len, kv_len] or None.
    Returns out fp32 [batch, q_len, kv_heads, groups, head_dim] (0 on rows with no visible key) and
    lse fp32 [batch, q_len, kv_heads, groups] (-inf on those rows). Gradients are NaN-free.
    """
    if mask is not None:
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    empty = l == 0.0
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p / jnp.where(empty, 1.0, l), v.astype(jnp.float32))
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))[..., 0]
    return o, jnp.transpose(lse, (0, 3, 1, 2))
