"""The fp32-accumulating products both METP algorithms use (`metp_ring.py`, `metp_mha.py`): x @ w, a weight
gradient xᵀ dy summed over rows, a bias gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mm(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., k] @ w [k, n] with fp32 accumulation.

    Written as a dot with a unit batch dimension (XLA removes it): selective remat keeps the outputs of dots
    without batch dimensions, and would keep these products from inside METP's loops too, though METP's
    custom VJPs recompute them (their residuals are X_i, A_i and the lse only).
    """
    out = jnp.einsum("zmk,zkn->zmn", x.reshape(1, -1, x.shape[-1]), w[None], preferred_element_type=jnp.float32)
    return out.reshape(*x.shape[:-1], w.shape[-1])


def row_sum(dy: jax.Array) -> jax.Array:
    """Σ over rows of dy [..., n] -> [n] fp32 (a bias gradient)."""
    return jnp.sum(dy.reshape(-1, dy.shape[-1]).astype(jnp.float32), axis=0)


def outer(x: jax.Array, dy: jax.Array) -> jax.Array:
    """Σ over rows of xᵀ dy: x [..., k], dy [..., n] -> [k, n] fp32 (a weight gradient)."""
    return jnp.einsum("...k,...n->kn", x, dy, preferred_element_type=jnp.float32)
