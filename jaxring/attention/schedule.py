"""Causal work skipping shared by the ring-based strategies: position runs and run pairs the mask hides.

A rank's tokens form a few contiguous position runs (one, or two for zig-zag); a (Q run, K/V run) pair that
the causal mask hides completely is skipped with `lax.cond`, so the work actually done can be counted.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxring.attention.blockwise import tile_visible
from jaxring.attention.merge import empty_partial, merge_partials


def split_runs(x, parts: int, axis: int):
    """Splits x into `parts` equal slices along axis (a rank's position runs)."""
    if x is None:
        return [None] * parts
    size = x.shape[axis] // parts
    return [lax.slice_in_dim(x, i * size, (i + 1) * size, axis=axis) for i in range(parts)]


def when_visible(causal, q_pos, kv_pos, compute, skip):
    """Runs `compute` unless the causal mask hides the whole (Q run, K/V run) pair: (result, computed?)."""
    if not causal:
        return compute(), True
    visible = tile_visible(q_pos, kv_pos, causal=True)
    return lax.cond(visible, compute, skip), visible


def pair_work(q_pos, kv_pos, computed):
    """Query-key pairs a run pair computed, as fp32 (int32 would overflow past 2³¹ pairs per block)."""
    return jnp.where(computed, float(q_pos.shape[0] * kv_pos.shape[0]), 0.0).astype(jnp.float32)


def forward_run_pairs(ops, acc, q, q_pos, q_seg, k, v, kv_pos, kv_seg, *, parts, causal, sm_scale):
    """One (Q block, K/V block) forward through `ops`, run pair by run pair, hidden pairs skipped.

    acc: tuple of (out, lse) fp32 partials, one per Q run (merged into). q, k, v, positions and segment ids
    are whole blocks, split here into `parts` runs. Returns (acc, pairs) with pairs a list of
    (q_positions, kv_positions, computed) per run pair (computed: False when the mask hid it).
    """
    q_runs, qpos_runs, qseg_runs = split_runs(q, parts, 1), split_runs(q_pos, parts, 0), split_runs(q_seg, parts, 1)
    k_runs, v_runs = split_runs(k, parts, 1), split_runs(v, parts, 1)
    kpos_runs, kseg_runs = split_runs(kv_pos, parts, 0), split_runs(kv_seg, parts, 1)
    acc, pairs = list(acc), []
    for i in range(parts):
        for j in range(parts):
            compute = lambda i=i, j=j: ops.forward(
                q_runs[i], k_runs[j], v_runs[j], qpos_runs[i], kpos_runs[j], qseg_runs[i], kseg_runs[j],
                causal=causal, sm_scale=sm_scale)
            skip = lambda i=i: empty_partial(q_runs[i])
            part, computed = when_visible(causal, qpos_runs[i], kpos_runs[j], compute, skip)
            acc[i] = merge_partials(*acc[i], *part)
            pairs.append((qpos_runs[i], kpos_runs[j], computed))
    return tuple(acc), pairs


def backward_run_pairs(ops, grads, q, dout, lse, delta, q_pos, q_seg, k, v, kv_pos, kv_seg, *, parts, causal,
                       sm_scale):
    """One (Q block, K/V block) backward through `ops` (global lse, delta), run pair by run pair.

    grads: (dq, dk, dv) fp32 accumulators of the whole blocks; returns them with this pair's gradients added.
    """
    dq, dk, dv = grads
    run_q, run_k = q.shape[1] // parts, k.shape[1] // parts
    q_args = [split_runs(x, parts, 1) for x in (q, dout, lse, delta)]
    qpos_runs, qseg_runs = split_runs(q_pos, parts, 0), split_runs(q_seg, parts, 1)
    k_runs, v_runs = split_runs(k, parts, 1), split_runs(v, parts, 1)
    kpos_runs, kseg_runs = split_runs(kv_pos, parts, 0), split_runs(kv_seg, parts, 1)
    for i in range(parts):
        q_i, do_i, lse_i, delta_i = (x[i] for x in q_args)
        for j in range(parts):
            compute = lambda i=i, j=j, q_i=q_i, do_i=do_i, lse_i=lse_i, delta_i=delta_i: ops.backward(
                q_i, k_runs[j], v_runs[j], do_i, lse_i, delta_i, qpos_runs[i], kpos_runs[j], qseg_runs[i],
                kseg_runs[j], causal=causal, sm_scale=sm_scale)
            skip = lambda q_i=q_i, j=j: (jnp.zeros_like(q_i, jnp.float32), jnp.zeros_like(k_runs[j], jnp.float32),
                                         jnp.zeros_like(v_runs[j], jnp.float32))
            (dq_ij, dk_ij, dv_ij), _ = when_visible(causal, qpos_runs[i], kpos_runs[j], compute, skip)
            dq = dq.at[:, i * run_q:(i + 1) * run_q].add(dq_ij)
            dk = dk.at[:, j * run_k:(j + 1) * run_k].add(dk_ij)
            dv = dv.at[:, j * run_k:(j + 1) * run_k].add(dv_ij)
    return dq, dk, dv
