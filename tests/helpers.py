"""Shared test helpers: random inputs and a relative-error assertion."""
import jax
import jax.numpy as jnp
import numpy as np


def qkv(seed, batch, seq, q_heads, kv_heads, head_dim, dtype=jnp.float32):
    """Random q, k, v and an output cotangent."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (batch, seq, q_heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
    dout = jax.random.normal(ks[3], (batch, seq, q_heads, head_dim), jnp.float32).astype(dtype)
    return q, k, v, dout


def assert_close(actual, expected, rtol, name=""):
    """max |actual - expected| <= rtol * max |expected| (and everything finite)."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    assert np.isfinite(actual).all(), f"{name}: non-finite values"
    err = np.abs(actual - expected).max()
    scale = max(np.abs(expected).max(), 1e-6)
    assert err <= rtol * scale, f"{name}: max error {err:.3g} > {rtol} * {scale:.3g}"


def value_and_grads(fn, q, k, v, dout):
    """fn's output and its (dq, dk, dv) for cotangent dout."""
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(dout)
