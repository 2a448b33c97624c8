"""Causal work skipping shared by the ring-based strategies: position runs and run pairs the mask hides.

A rank's tokens form a few contiguous position runs (one, or two for zig-zag); a (Q run, K/V run) pair that
the causal mask hides completely is skipped with `lax.cond`, so the work actually done can be counted.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxring.attention.blockwise import tile_visible


def split_runs(x, parts: int, axis: int):
    """Splits x into `parts` equal slices along axis (a rank's position runs)."""
    if x is None:
        return [None] * parts
    size = x.shape[axis] // parts
    return [lax.slice_in_dim(x, i * size, (i + 1) * size, axis=axis) for i in range(parts)]


def when_visible(causal, q_pos, kv_pos, compute, skip):
    """Runs `compute` unless the causal mask hides the whole (Q run, K/V run) pair; returns (result, work)."""
    if not causal:
        return compute(), q_pos.shape[0] * kv_pos.shape[0]
    visible = tile_visible(q_pos, kv_pos, causal=True)
    work = jnp.where(visible, q_pos.shape[0] * kv_pos.shape[0], 0)
    return lax.cond(visible, compute, skip), work
