"""Rotary position embedding (RoPE), applied per token from its true position.

Positions follow the tokens: under a causal load-balance layout (zigzag, striped) each token keeps its
original position, so RoPE stays exact whatever order the sequence is stored in.

The rotation is "rotate half", as Hugging Face's Llama family stores it: the head dim splits into halves
(x1, x2) rotated to (x1·cos − x2·sin, x2·cos + x1·sin), frequency i for both halves. A `Rope` holds the
settings (hashable: a static argument of the layers) and computes its inverse frequencies once:

  none    inv_freq_i = theta^(-2i/d)
  linear  inv_freq_i / factor                                     (position interpolation)
  llama3  wavelengths 2π/inv_freq_i longer than original/low_freq_factor divided by factor, shorter than
          original/high_freq_factor kept, smoothly blended in between (Llama 3.1)
  yarn    interpolation (inv_freq/factor) for the low frequencies, extrapolation (inv_freq) for the high
          ones, a linear ramp between the correction dims of beta_fast and beta_slow rotations over the
          original context; cos and sin scaled by the attention factor (default 0.1·ln(factor) + 1), which
          scales the attention logits by its square (as transformers does)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class Rope:
    """RoPE settings. theta: the base; scaling: one of ROPE_SCALINGS with its parameters (factor for all
    scalings; low/high_freq_factor and original_max_positions for llama3; beta_fast, beta_slow,
    original_max_positions and attention_factor (None: 0.1·ln(factor) + 1) for yarn)."""

    theta: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def __post_init__(self):
        if self.scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling {self.scaling!r}: expected one of {', '.join(ROPE_SCALINGS)}")
        if not (isinstance(self.theta, (int, float)) and math.isfinite(self.theta) and self.theta > 0):
            raise ValueError(f"rope theta {self.theta!r} must be a positive number")
        if self.scaling != "none" and not self.factor > 0:
            raise ValueError(f"rope factor {self.factor!r} must be > 0 for {self.scaling} scaling")
        if self.scaling in ("llama3", "yarn") and not self.original_max_positions:
            raise ValueError(f"rope scaling {self.scaling} needs original_max_positions (the pre-extension context)")
        if self.scaling == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 rope: high_freq_factor {self.high_freq_factor} must exceed low_freq_factor "
                f"{self.low_freq_factor}"
            )

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies fp32 [head_dim // 2] (computed once per head_dim)."""
        return _inv_freq(self, head_dim)

    @property
    def attention_scaling(self) -> float:
        """The factor on cos and sin (yarn's attention factor; 1 otherwise)."""
        if self.scaling != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def cos_sin(self, positions: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array]:
        """(cos, sin) fp32 [..., head_dim // 2] at positions int [...], scaled by `attention_scaling`."""
        angles = jnp.asarray(positions, jnp.float32)[..., None] * jnp.asarray(self.inv_freq(head_dim))
        scale = self.attention_scaling
        return jnp.cos(angles) * scale, jnp.sin(angles) * scale

    def apply(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [batch, seq, heads, head_dim] rotated at positions int [batch, seq] or [seq]; x's dtype (fp32 math)."""
        cos, sin = self.cos_sin(positions, x.shape[-1])  # [(b,) s, d/2]
        if cos.ndim == 2:
            cos, sin = cos[None], sin[None]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def as_rope(value: Rope | float | None) -> Rope | None:
    """A `Rope` from a Rope, a theta (plain RoPE) or None (no RoPE)."""
    if value is None or isinstance(value, Rope):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"rope {value!r} must be a jaxring.kernels.rope.Rope, a theta or None")
    return Rope(theta=float(value))


@functools.lru_cache(maxsize=64)
def _inv_freq(rope: Rope, head_dim: int) -> np.ndarray:
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    base = 1.0 / rope.theta**exponents
    if rope.scaling == "linear":
        base = base / rope.factor
    elif rope.scaling == "llama3":
        base = _llama3(base, rope)
    elif rope.scaling == "yarn":
        base = _yarn(base, rope, head_dim)
    return base.astype(np.float32)


def _llama3(inv_freq: np.ndarray, rope: Rope):
    original = rope.original_max_positions
    low_wavelen, high_wavelen = original / rope.low_freq_factor, original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled)


def _yarn(inv_freq: np.ndarray, rope: Rope, head_dim: int):
    original = rope.original_max_positions

    def correction_dim(rotations: float):  # the dim whose wavelength makes `rotations` turns over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency (high frequencies), 0: interpolate
    return inv_freq / rope.factor * (1 - extrapolation) + inv_freq * extrapolation


def apply_rope(x: jax.Array, positions: jax.Array, rope: Rope | float = 10000.0) -> jax.Array:
    """Rotates halves (x[..., :d/2], x[..., d/2:]) by angle position · inv_freq (see `Rope.apply`).

    Args:
      x: [batch, seq, heads, head_dim]; positions: int [batch, seq] or [seq]; rope: a `Rope` or a theta.
    Returns: same shape and dtype as x (computed in fp32).
    """
    return as_rope(rope).apply(x, positions)
