"""Shared mask and validation helpers for every attention implementation.

Masks are built from *positions*, never from array indices, so a block whose queries and keys come from any
ring step or any layout is masked exactly. Query position i sees key position j when

  causal:            j <= i
  sliding window W:  i - W < j <= i      (W keys, itself included; needs causal; None = unlimited)
  segment ids:       seg_q == seg_k != 0 (0 is padding)

A tile or block is skipped from the bounds of its positions and segment ids (`may_see`, `sees_all`,
`segments_may_meet`): no pair of it can be visible. The bounds tests are conservative (they may keep a block
with no visible pair, never drop a visible one) and exact for contiguous position runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

INT_MIN = int(np.iinfo(np.int32).min)
INT_MAX = int(np.iinfo(np.int32).max)


def check_heads(q_heads: int, kv_heads: int) -> int:
    """Returns the GQA group size Hq // Hkv, or raises if the heads don't divide."""
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} must be a multiple of key/value heads {kv_heads} (GQA/MQA groups)")
    return q_heads // kv_heads


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
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


def check_window(window: int | None, causal: bool) -> int | None:
    """The sliding window as an int (None: unlimited), or a one-line error naming the value and the rule."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(
            f"window {window!r} must be a positive integer (query i sees keys i - window < j <= i) or None"
        )
    if not causal:
        raise ValueError(f"window {window} needs causal=True (a sliding window looks back from each query)")
    return int(window)


def attention_mask(
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
    *,
    causal: bool,
    window: int | None = None,
) -> jax.Array | None:
    """Boolean mask broadcastable to [batch, q_len, kv_len], or None when nothing is masked.

    q_positions [q_len] or [batch, q_len]; kv_positions [kv_len] or [batch, kv_len] (int).
    Segment ids [batch, len]; 0 marks padding, which attends to nothing and is attended by nothing.
    window: sliding window W (with causal): query i sees keys i - W < j <= i.
    """
    mask = None
    if causal:
        qp = jnp.asarray(q_positions)
        kp = jnp.asarray(kv_positions)
        mask = qp[..., :, None] >= kp[..., None, :]
        if window is not None:  # where j <= i, i - j cannot overflow (padded keys sit at INT_MAX)
            mask = mask & (qp[..., :, None] - kp[..., None, :] < window)
        if mask.ndim == 2:
            mask = mask[None]
    if q_segment_ids is not None:
        seg = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (q_segment_ids[:, :, None] != 0)
        mask = seg if mask is None else mask & seg
    return mask


# ----------------------------------------------------------------------------------- skipping by bounds


def _plus_window(x: jax.Array, window: int):
    """x + window, saturating at INT_MAX (padded keys carry INT_MAX positions)."""
    return jnp.where(x > INT_MAX - window, INT_MAX, x + window)


def may_see(
    q_min: jax.Array, q_max: jax.Array, k_min: jax.Array, k_max: jax.Array, *, causal: bool, window: int | None = None
) -> jax.Array:
    """True where some query in [q_min, q_max] may see some key in [k_min, k_max] (elementwise on bounds).

    causal: q_max >= k_min; window: q_min - k_max < W, written q_min < k_max + W (saturating: padded
    queries at INT_MIN, keys at INT_MAX never overflow). Exact when both sides are contiguous runs.
    """
    vis = jnp.bool_(True)
    if causal:
        vis = q_max >= k_min
        if window is not None:
            vis = vis & (q_min < _plus_window(k_max, window))
    return vis


def sees_all(
    q_min: jax.Array, q_max: jax.Array, k_min: jax.Array, k_max: jax.Array, *, causal: bool, window: int | None = None
) -> jax.Array:
    """True where every query in [q_min, q_max] sees every key in [k_min, k_max]: no mask needed."""
    full = jnp.bool_(True)
    if causal:
        full = q_min >= k_max
        if window is not None:
            full = full & (q_max < _plus_window(k_min, window))
    return full


def positions_may_meet(
    q_positions: jax.Array, kv_positions: jax.Array, *, causal: bool, window: int | None = None
) -> jax.Array:
    """Scalar bool: some query of the block may see some key of it, from the blocks' position bounds."""
    if not causal:
        return jnp.bool_(True)
    q, k = jnp.asarray(q_positions), jnp.asarray(kv_positions)
    return may_see(jnp.min(q), jnp.max(q), jnp.min(k), jnp.max(k), causal=True, window=window)


def segment_bounds(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(min, max) of the non-zero segment ids along the last axis (INT_MAX, INT_MIN where all padding)."""
    smin = jnp.where(segment_ids == 0, INT_MAX, segment_ids).min(-1)
    smax = jnp.where(segment_ids == 0, INT_MIN, segment_ids).max(-1)
    return smin, smax


def segments_may_meet(q_segment_ids: jax.Array, kv_segment_ids: jax.Array) -> jax.Array:
    """Scalar bool: in some batch row a query and a key may share a non-zero segment id (bounds overlap).

    q_segment_ids [b, nq], kv_segment_ids [b, nk]; packed documents are numbered in sequence order, so two
    blocks of different documents (or of padding) have disjoint ranges and the pair is skipped."""
    qmin, qmax = segment_bounds(q_segment_ids)
    kmin, kmax = segment_bounds(kv_segment_ids)
    return jnp.any((qmin <= kmax) & (kmin <= qmax))
