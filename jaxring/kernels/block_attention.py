"""Differentiable attention on one device from a `BlockOps` pair: how the strategies that attend locally (Ulysses,
the all-gather, dense) use a block compute that `flash_attention` does not implement (cuDNN's).

    out = block_attention(ops, q, k, v, q_positions=..., kv_positions=..., causal=True, sm_scale=s)

Forward: one `ops.forward` over the whole (Q, K/V) pair; backward (`jax.custom_vjp`): one `ops.backward` with
that forward's lse (the global one: there is a single block) and delta = rowsum(dO ∘ O). Shapes as
`flash_attention`: q [b, nq, hq, d], k/v [b, nk, hkv, d], positions int [n], segment ids [b, n] or None.

When Q and K/V are the same tokens (self-attention: Ulysses and dense attention see the whole sequence in its
layout's order), the tokens are first put in position order (a gather by argsort of the positions, undone on
the output), so a zig-zag or striped sequence becomes one run that a cuDNN call covers with its causal mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxring.kernels.blockwise import BlockOps, with_window

Array = jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attend(
    ops: BlockOps,
    causal: bool,
    sm_scale: float,
    q: Array,
    k: Array,
    v: Array,
    q_pos: Array,
    kv_pos: Array,
    q_seg: Array | None,
    kv_seg: Array | None,
) -> Array:
    out, _ = ops.forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal=causal, sm_scale=sm_scale)
    return out.astype(q.dtype)


def _attend_fwd(
    ops: BlockOps,
    causal: bool,
    sm_scale: float,
    q: Array,
    k: Array,
    v: Array,
    q_pos: Array,
    kv_pos: Array,
    q_seg: Array | None,
    kv_seg: Array | None,
) -> tuple[Array, tuple]:
    out, lse = ops.forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal=causal, sm_scale=sm_scale)
    out = out.astype(q.dtype)
    return out, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _attend_bwd(ops: BlockOps, causal: bool, sm_scale: float, res: tuple, dout: Array) -> tuple:
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse = res
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    dq, dk, dv = ops.backward(q, k, v, dout, lse, delta, q_pos, kv_pos, q_seg, kv_seg, causal=causal, sm_scale=sm_scale)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def block_attention(
    ops: BlockOps,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    window: int | None = None,
) -> jax.Array:
    """Attention of q over k, v with `ops` (see the module docstring); out in q's dtype."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    q_pos = jnp.arange(q.shape[1], dtype=jnp.int32) if q_positions is None else jnp.asarray(q_positions, jnp.int32)
    kv_pos = jnp.arange(k.shape[1], dtype=jnp.int32) if kv_positions is None else jnp.asarray(kv_positions, jnp.int32)
    ops = with_window(ops, window)
    if q_positions is not None and q_positions is kv_positions:  # self-attention: into position order
        order = jnp.argsort(q_pos)
        take = lambda x: None if x is None else jnp.take(x, order, axis=1)
        q, k, v, seg, kv_seg = (take(x) for x in (q, k, v, segment_ids, kv_segment_ids))
        pos = q_pos[order]
        out = _attend(ops, causal, scale, q, k, v, pos, pos, seg, kv_seg)
        return jnp.zeros_like(out).at[:, order].set(out)
    return _attend(ops, causal, scale, q, k, v, q_pos, kv_pos, segment_ids, kv_segment_ids)
