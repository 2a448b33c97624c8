"""Rotary position embedding (RoPE), applied per token from its true position.

Positions follow the tokens: under a causal load-balance layout (zigzag, striped) each token keeps its
original position, so RoPE stays exact whatever order the sequence is stored in.
"""

import jax.numpy as jnp


def rope_frequencies(head_dim: int, theta: float = 10000.0):
    """Inverse frequencies fp32 [head_dim // 2]."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(x, positions, theta: float = 10000.0):
    """Rotates pairs (x[..., :d/2], x[..., d/2:]) by angle position * freq.

    Args:
      x: [batch, seq, heads, head_dim]; positions: int [batch, seq] or [seq].
    Returns: same shape and dtype as x (computed in fp32).
    """
    freqs = rope_frequencies(x.shape[-1], theta)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * freqs  # [(b,) s, d/2]
    if angles.ndim == 2:
        angles = angles[None]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
