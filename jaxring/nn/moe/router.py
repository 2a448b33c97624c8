"""The top-k softmax router, its load-balancing losses, and the aux-loss-free bias update.

For T tokens x [T, h] and a router W_r [h, E] (fp32):

  logits = x W_r                 [T, E]
  p      = softmax(logits)       [T, E]
  experts = top_k(p + b, k)      [T, k]   (b: DeepSeek-V3 selection bias, zero unless enabled)
  gates  = p[experts]            [T, k]   (divided by their sum when renormalised)

Load-balancing losses over the N tokens of the whole batch (summed over the mesh axes the tokens are split
over, so every mesh gives the one-device value):

  f_e = load_e / (N k)           fraction of the N k assignments routed to e (no gradient)
  P_e = (1/N) sum_t p_te         mean router probability of e
  aux = E sum_e f_e P_e          (Switch Transformer eq. 4; GShard's with k choices; 1 when balanced)
  z   = (1/N) sum_t logsumexp(logits_t)^2          (ST-MoE router z-loss)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.core.vma import vary
from jaxring.nn.moe.config import MoEConfig


class Routing(NamedTuple):
    """A router's decision for T tokens."""

    experts: jax.Array  # int32 [T, k]: chosen experts, best first
    gates: jax.Array  # fp32 [T, k]: their combine weights
    logits: jax.Array  # fp32 [T, E]
    probs: jax.Array  # fp32 [T, E]


def route(x: jax.Array, router: jax.Array, config: MoEConfig, bias: jax.Array | None = None) -> Routing:
    """x [T, h] (any float dtype), router [h, E]; bias [E] or None (selection only, never in the gates)."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    scores = probs if bias is None else probs + lax.stop_gradient(bias.astype(jnp.float32))
    _, experts = lax.top_k(scores, config.experts_per_token)
    gates = jnp.take_along_axis(probs, experts, axis=-1)
    if config.renormalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), gates, logits, probs)


def sum_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """psum over `axes` (x first made varying over them), or x itself when there are none."""
    return lax.psum(vary(x, axes), axes) if axes else x


def balance_losses(
    routing: Routing, load: jax.Array, num_tokens: jax.typing.ArrayLike, token_axes: tuple[str, ...]
) -> tuple[jax.Array, jax.Array]:
    """(aux, z) fp32 scalars over the whole batch.

    load: int32 [E] assignments per expert over the whole batch; num_tokens: N, the batch's token count;
    token_axes: the mesh axes this device's routing.probs/logits must be summed over.
    """
    k = routing.experts.shape[-1]
    num_experts = routing.probs.shape[-1]
    fraction = lax.stop_gradient(load.astype(jnp.float32)) / (num_tokens * k)
    mean_prob = sum_over(jnp.sum(routing.probs, axis=0), token_axes) / num_tokens
    aux = num_experts * jnp.sum(fraction * mean_prob)
    z = sum_over(jnp.sum(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1))), token_axes) / num_tokens
    return aux, z


def update_router_bias(bias: jax.Array, load: jax.Array, rate: float = 1e-3) -> jax.Array:
    """DeepSeek-V3's aux-loss-free balancing: b_e += rate * sign(mean load - load_e), outside the gradient.

    bias: fp32 [E]; load: [E] assignments per expert of the last step (stats["load"]). Overloaded experts
    are made less likely to be chosen, underloaded ones more; the gates are unaffected.
    """
    load = jnp.asarray(load, jnp.float32)
    return bias + rate * jnp.sign(jnp.mean(load) - load).astype(bias.dtype)
