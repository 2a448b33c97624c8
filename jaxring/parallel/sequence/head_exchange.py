"""The head exchange of Ulysses-style attention: the all-to-alls between sequence shards and head shards, the
rule that query heads split over the degree, and the K/V head repeat GQA needs for it. Shared by Ulysses
(`ulysses.py`), its head-chunked form (`ulysses_chunked.py`) and USP (`usp.py`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def check_heads_split(q_heads: int, degree: int, what: str = "sp") -> None:
    if q_heads % degree:
        raise ValueError(
            f"query heads {q_heads} are not divisible by the Ulysses degree {what} = {degree}: "
            f"each device takes query heads / {what} of them"
        )


def repeat_kv_for_split(k: jax.Array, degree: int) -> jax.Array:
    """Repeats each K/V head so the head count becomes lcm(kv_heads, degree) (unchanged when divisible)."""
    kv_heads = k.shape[2]
    factor = math.lcm(kv_heads, degree) // kv_heads
    return k if factor == 1 else jnp.repeat(k, factor, axis=2)


def seq_to_heads(x: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """[b, n, h, d] sequence shard -> [b, n*P, h/P, d] head shard (one all-to-all)."""
    return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """Inverse of `seq_to_heads`."""
    return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)
