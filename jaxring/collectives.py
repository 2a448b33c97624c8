"""Ring communication shared by every ring-based strategy (used inside `shard_map`)."""
from __future__ import annotations

import jax
from jax import lax


def ring_pairs(size: int, shift: int = 1) -> list[tuple[int, int]]:
    """ppermute pairs sending rank i to rank (i + shift) % size."""
    return [(i, (i + shift) % size) for i in range(size)]


def send_to_next(tree, axis_name, shift: int = 1):
    """ppermute every array of `tree` one hop along the ring over `axis_name` (None leaves stay None)."""
    size = lax.axis_size(axis_name)
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, ring_pairs(size, shift)), tree)
