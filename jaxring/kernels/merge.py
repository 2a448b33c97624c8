"""The one online-softmax merge of partial attention results (out, lse)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_partials(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Merges two partial softmax-attention results over disjoint key sets.

    out_*: [..., heads, head_dim] fp32 (each normalised over its own keys); lse_*: [..., heads] fp32 natural
    log, -inf where a row saw no key. A fully masked side contributes nothing; never produces NaN.
    Returns (out, lse) in fp32.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    pivot = jnp.where(jnp.isneginf(lse), 0.0, lse)
    w_a = jnp.exp(lse_a - pivot)[..., None]
    w_b = jnp.exp(lse_b - pivot)[..., None]
    out = w_a * out_a.astype(jnp.float32) + w_b * out_b.astype(jnp.float32)
    return out, lse


def empty_partial(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The identity of `merge_partials` for queries `q` [b, n, heads, dim]: zero output, lse = -inf (fp32).

    Built "like" q, so inside `shard_map` it varies over the same mesh axes as q (check_vma-safe).
    """
    return jnp.zeros_like(q, jnp.float32), jnp.full_like(q[..., 0], -jnp.inf, jnp.float32)
