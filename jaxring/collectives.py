"""Ring communication shared by every ring-based strategy (used inside `shard_map`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def ring_pairs(size: int, shift: int = 1) -> list[tuple[int, int]]:
    """ppermute pairs sending rank i to rank (i + shift) % size."""
    return [(i, (i + shift) % size) for i in range(size)]


def send_to_next(tree, axis_name, shift: int = 1):
    """ppermute every array of `tree` one hop along the ring over `axis_name` (None leaves stay None)."""
    size = lax.axis_size(axis_name)
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, ring_pairs(size, shift)), tree)


def ring_steps(step_fn, carry, kv, num_steps, send):
    """for step in 0..P-1: send the K/V block on (not after the last step), then `step_fn` on it.

    A `lax.scan` over the first P-1 steps and the last step on its own: a hop cannot be hoisted out of its
    iteration, so a device holds the current and the incoming block only (O(S/P) memory, not O(S)), and
    exactly P-1 hops are made. Returns the final carry.
    """
    def body(state, step):
        carry, kv = state
        kv_next = send(kv)  # issued before this step's compute, so the two can overlap
        return (step_fn(carry, kv, step), kv_next), None

    if num_steps > 1:
        (carry, kv), _ = lax.scan(body, (carry, kv), jnp.arange(num_steps - 1))
    return step_fn(carry, kv, num_steps - 1)
