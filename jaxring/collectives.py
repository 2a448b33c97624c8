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


def tree_rounds(size: int) -> int:
    """ceil(log2(size)): rounds of a binomial-tree broadcast or reduce over `size` ranks."""
    return max(size - 1, 0).bit_length()


def tree_broadcast(x, axis_name, root):
    """Every rank of `axis_name` gets root's `x`, by a binomial tree of ceil(log2 P) ppermute rounds.

    `root` may be traced (e.g. a scan step). In round t each rank sends to rank + 2^t (a fixed shift, so the
    permutation is static) and a rank keeps what it received when its distance from root is in [2^t, 2^(t+1)).
    Each rank receives one block per round, ceil(log2 P) blocks in all, the log-tree cost the papers assume.
    Never gathers more than the one block. Its transpose (autodiff) is the matching tree reduce onto root.
    """
    size = lax.axis_size(axis_name)
    rel = (lax.axis_index(axis_name) - root) % size
    for t in range(tree_rounds(size)):
        shift = 1 << t
        received = lax.ppermute(x, axis_name, ring_pairs(size, shift))
        x = jnp.where((rel >= shift) & (rel < 2 * shift), received, x)
    return x


def tree_reduce(x, axis_name, root):
    """Sum of `x` over `axis_name`, valid on rank `root` (other ranks hold partial sums).

    The reverse binomial tree: in round t (from the widest) rank root + r sends to root + r - 2^t, which adds
    it when r < 2^t. ceil(log2 P) ppermute rounds, one block received per round.
    """
    size = lax.axis_size(axis_name)
    rel = (lax.axis_index(axis_name) - root) % size
    for t in reversed(range(tree_rounds(size))):
        shift = 1 << t
        received = lax.ppermute(x, axis_name, ring_pairs(size, -shift))
        x = jnp.where((rel < shift) & (rel + shift < size), x + received, x)
    return x
