"""Shared mask and validation helpers for every attention implementation.

Masks are built from *positions*, never from array indices, so a block whose queries and keys come from any
ring step or any layout is masked exactly.
"""

from __future__ import annotations

import jax.numpy as jnp


def check_heads(q_heads: int, kv_heads: int) -> int:
    """Returns the GQA group size Hq // Hkv, or raises if the heads don't divide."""
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} must be a multiple of key/value heads {kv_heads} (GQA/MQA groups)")
    return q_heads // kv_heads


def check_qkv(q, k, v) -> None:
    """Validates [batch, seq, heads, head_dim] shapes shared by q, k and v."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} has shape {x.shape}; expected [batch, seq, heads, head_dim]")
        if 0 in x.shape:
            raise ValueError(f"{name} has shape {x.shape}; batch, seq, heads and head_dim must all be >= 1")
    if k.shape != v.shape:
        raise ValueError(f"k shape {k.shape} and v shape {v.shape} must match")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q batch {q.shape[0]} and k batch {k.shape[0]} must match")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q head_dim {q.shape[3]} and k head_dim {k.shape[3]} must match")
    check_heads(q.shape[2], k.shape[2])


def attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids, *, causal: bool):
    """Boolean mask broadcastable to [batch, q_len, kv_len], or None when nothing is masked.

    q_positions [q_len] or [batch, q_len]; kv_positions [kv_len] or [batch, kv_len] (int).
    Segment ids [batch, len]; 0 marks padding, which attends to nothing and is attended by nothing.
    """
    mask = None
    if causal:
        qp = jnp.asarray(q_positions)
        kp = jnp.asarray(kv_positions)
        mask = qp[..., :, None] >= kp[..., None, :]
        if mask.ndim == 2:
            mask = mask[None]
    if q_segment_ids is not None:
        seg = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (q_segment_ids[:, :, None] != 0)
        mask = seg if mask is None else mask & seg
    return mask
