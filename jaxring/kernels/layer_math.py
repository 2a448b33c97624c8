"""The per-device math of a Transformer block that every tensor method, the KV-cache decoder and the
mixture-of-experts FFN share: activations, the QKV head split, QK-norm and RoPE, biases, and the norms.

Nothing here communicates: each function works on the arrays of one device (local shards or whole arrays).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxring.kernels.rope import Rope, as_rope

ACTIVATIONS = ("gelu", "swiglu")


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")


def activate(h_in: jax.Array, h_gate: jax.Array | None, activation: str) -> jax.Array:
    """gelu(h_in) (tanh approximation), or silu(h_gate) * h_in (SwiGLU)."""
    if activation == "swiglu":
        return jax.nn.silu(h_gate) * h_in
    return jax.nn.gelu(h_in, approximate=True)


def split_heads(q: jax.Array, k: jax.Array, v: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[b, s, heads·d] projections -> [b, s, heads, d] (head j owns columns j·d .. (j+1)·d)."""
    b, s = q.shape[:2]
    return tuple(t.reshape(b, s, t.shape[-1] // head_dim, head_dim) for t in (q, k, v))


def merge_heads(out: jax.Array) -> jax.Array:
    """[b, s, heads, d] -> [b, s, heads·d]."""
    return out.reshape(out.shape[0], out.shape[1], -1)


def rope_qk(q: jax.Array, k: jax.Array, positions: jax.Array, rope: Rope | float | None) -> tuple[jax.Array, jax.Array]:
    """RoPE on q and k [b, s, heads, d] at positions int [b, s] (identity when rope is None; a number is
    plain RoPE's theta)."""
    rope = as_rope(rope)
    if rope is None:
        return q, k
    return rope.apply(q, positions), rope.apply(k, positions)


def add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    """y [..., n] + bias [n] (y unchanged when bias is None), in y's dtype."""
    return y if bias is None else y + bias.astype(y.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, *, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last dim in fp32, result in x.dtype; scale, bias [hidden] (bias may be None)."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32)
    return (y if bias is None else y + bias.astype(jnp.float32)).astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over the last dim in fp32, result in x.dtype: x · rsqrt(mean(x²) + eps) · scale."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps) * scale.astype(jnp.float32)
    return y.astype(x.dtype)


def head_norm(t: jax.Array, scale: jax.Array | None, *, eps: float) -> jax.Array:
    """QK-norm: RMSNorm of each head [..., head_dim] with scale [head_dim] (fp32 math, t's dtype); identity
    when scale is None."""
    return t if scale is None else rms_norm(t, scale, eps=eps)


def qk_norm_rope(
    q: jax.Array, k: jax.Array, w: dict, positions: jax.Array, rope: Rope | None, *, eps: float
) -> tuple[jax.Array, jax.Array]:
    """The heads as attention sees them: QK-norm (when w has "q_norm"/"k_norm" [head_dim], Qwen3), then RoPE."""
    q, k = head_norm(q, w.get("q_norm"), eps=eps), head_norm(k, w.get("k_norm"), eps=eps)
    return rope_qk(q, k, positions, rope)
