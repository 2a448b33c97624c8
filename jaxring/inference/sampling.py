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
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
) -> jax.Array:
    """int32 [b] drawn from logits [b, vocab] (fp32): argmax when temperature is 0; else softmax(logits / T)
    restricted to the top_k largest and to the smallest set of largest whose probability reaches top_p (the
    most likely token always kept)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the larger tokens
        kept = jnp.where(before < top_p, ordered, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
