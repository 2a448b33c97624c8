"""One ring step's block compute, shared by the ring-based strategies, and the causal work it implies.

A ring step attends a Q block to the K/V block it holds with one `BlockOps` call: the block ops skip the
tiles a causal mask hides (by the tiles' true positions), and a block hidden entirely is skipped with one
`lax.cond`. The work a rank must do is counted at the granularity of its position runs (one run per rank,
two for zig-zag): a (Q run, K/V run) pair counts unless the causal mask hides all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.kernels.blockwise import BlockOps, tile_visible, unless_hidden
from jaxring.kernels.merge import empty_partial, merge_partials


def split_runs(x: jax.Array | None, parts: int, axis: int) -> list[jax.Array | None]:
    """Splits x into `parts` equal slices along axis (a rank's position runs)."""
    if x is None:
        return [None] * parts
    size = x.shape[axis] // parts
    return [lax.slice_in_dim(x, i * size, (i + 1) * size, axis=axis) for i in range(parts)]


def when_visible(
    causal: bool,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    compute: Callable[[], Any],
    skip: Callable[[], Any],
    *,
    lockstep: bool = False,
) -> tuple[Any, bool | jax.Array]:
    """Runs `compute` unless the causal mask hides the whole (Q, K/V) pair: (result, computed?). Lockstep block
    ops (`BlockOps.lockstep`) compute every pair."""
    if not causal:
        return compute(), True
    visible = tile_visible(q_pos, kv_pos, causal=True)
    return unless_hidden(lockstep, visible, compute, skip), visible


def pair_work(q_pos: jax.Array, kv_pos: jax.Array, computed: bool | jax.Array) -> jax.Array:
    """Query-key pairs a run pair computed, as fp32 (int32 would overflow past 2³¹ pairs per block)."""
    return jnp.where(computed, float(q_pos.shape[0] * kv_pos.shape[0]), 0.0).astype(jnp.float32)


def run_pairs(
    q_pos: jax.Array, kv_pos: jax.Array, parts: int, causal: bool
) -> list[tuple[jax.Array, jax.Array, bool | jax.Array]]:
    """[(q run positions, kv run positions, visible?)] for every (Q run, K/V run) pair of two blocks."""
    pairs = []
    for qp in split_runs(q_pos, parts, 0):
        for kp in split_runs(kv_pos, parts, 0):
            pairs.append((qp, kp, tile_visible(qp, kp, causal=causal) if causal else True))
    return pairs


def run_work(q_pos: jax.Array, kv_pos: jax.Array, parts: int, causal: bool) -> jax.Array:
    """Query-key pairs of the run pairs the causal mask does not hide entirely (fp32)."""
    return sum(pair_work(qp, kp, visible) for qp, kp, visible in run_pairs(q_pos, kv_pos, parts, causal))


def attend_block(
    ops: BlockOps,
    acc: tuple[jax.Array, jax.Array],
    q: jax.Array,
    q_pos: jax.Array,
    q_seg: jax.Array | None,
    k: jax.Array,
    v: jax.Array,
    kv_pos: jax.Array,
    kv_seg: jax.Array | None,
    *,
    causal: bool,
    sm_scale: float,
) -> tuple[jax.Array, jax.Array]:
    """acc (out, lse fp32) merged with the attention of Q over one K/V block (skipped if hidden)."""
    if ops.accumulates:
        return when_visible(
            causal,
            q_pos,
            kv_pos,
            lambda: ops.forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal=causal, sm_scale=sm_scale, into=acc),
            lambda: acc,
            lockstep=ops.lockstep,
        )[0]
    part, _ = when_visible(
        causal,
        q_pos,
        kv_pos,
        lambda: ops.forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal=causal, sm_scale=sm_scale),
        lambda: empty_partial(q),
        lockstep=ops.lockstep,
    )
    return merge_partials(*acc, *part)


def add_block_grads(
    ops: BlockOps,
    grads: tuple[jax.Array | None, jax.Array | None, jax.Array | None],
    q: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    q_pos: jax.Array,
    q_seg: jax.Array | None,
    k: jax.Array,
    v: jax.Array,
    kv_pos: jax.Array,
    kv_seg: jax.Array | None,
    *,
    causal: bool,
    sm_scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """grads (dq, dk, dv) fp32 plus those of one (Q block, K/V block) pair given the global lse and delta.

    Any of them may be None (no sum yet: it starts at this pair's). Hidden blocks add nothing. Block ops that
    accumulate add in place; otherwise the block's gradients are computed first and added after, so a
    received accumulator is only needed once the block compute is done (it can be in flight meanwhile).
    """
    dq, dk, dv = grads
    if ops.accumulates:
        into = tuple(jnp.zeros_like(x, jnp.float32) if acc is None else acc for acc, x in ((dq, q), (dk, k), (dv, v)))
        return when_visible(
            causal,
            q_pos,
            kv_pos,
            lambda: ops.backward(
                q, k, v, dout, lse, delta, q_pos, kv_pos, q_seg, kv_seg, causal=causal, sm_scale=sm_scale, into=into
            ),
            lambda: into,
            lockstep=ops.lockstep,
        )[0]
    zeros = lambda: (jnp.zeros_like(q, jnp.float32), jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32))
    (dq_j, dk_j, dv_j), _ = when_visible(
        causal,
        q_pos,
        kv_pos,
        lambda: ops.backward(q, k, v, dout, lse, delta, q_pos, kv_pos, q_seg, kv_seg, causal=causal, sm_scale=sm_scale),
        zeros,
        lockstep=ops.lockstep,
    )
    add = lambda acc, x: x if acc is None else acc + x
    return add(dq, dq_j), add(dk, dk_j), add(dv, dv_j)
