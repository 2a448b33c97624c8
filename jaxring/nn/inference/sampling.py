"""The next token from logits: greedy (temperature 0), temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """One-line errors for sampling settings out of their ranges."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature {temperature!r} must be a number >= 0 (0: greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k {top_k!r} must be a positive integer or None")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p {top_p!r} must be a number in (0, 1] or None")


def sample(
    logits: jax.Array,
    key: jax.Array,
    *,
    temperature: float | jax.Array,
    top_k: int | jax.Array | None = None,
    top_p: float | jax.Array | None = None,
) -> jax.Array:
    """int32 [b] drawn from logits [b, vocab] (fp32): argmax when temperature is 0; else softmax(logits / T)
    restricted to the top_k largest and to the smallest set of largest whose probability reaches top_p (the
    most likely token always kept). The settings may be traced scalars (one compiled step serves them all):
    top_k >= vocab and top_p = 1 keep everything."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if isinstance(temperature, (int, float)) and temperature == 0:
        return greedy
    t = jnp.asarray(temperature, jnp.float32)
    scaled = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
    ordered = jnp.sort(scaled, axis=-1)[..., ::-1]
    if top_k is not None:
        k = jnp.clip(jnp.asarray(top_k, jnp.int32), 1, logits.shape[-1])
        kth = jnp.take(ordered, k - 1, axis=-1)[..., None]  # the k-th largest of each row
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        ordered = jnp.where(jnp.arange(logits.shape[-1]) < k, ordered, -jnp.inf)
    if top_p is not None:
        p = jnp.asarray(top_p, jnp.float32)
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the larger tokens
        threshold = jnp.min(jnp.where(before < p, ordered, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where((scaled < threshold) & (p < 1), -jnp.inf, scaled)
    drawn = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    return jnp.where(t > 0, drawn, greedy)
