"""Shared test helpers: the repository's paths, random inputs and a relative-error assertion."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent  # the repository
FIXTURES = ROOT / "tests" / "fixtures"


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


def relative_error(x, ref) -> float:
    """max |x - ref| / max |ref| over ref's finite entries (the -inf/NaN pattern must match)."""
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    finite = np.isfinite(ref)
    assert np.array_equal(finite, np.isfinite(x)), "-inf/NaN pattern differs"
    scale = max(float(np.abs(ref[finite]).max()), 1e-6)
    return float(np.abs(x[finite] - ref[finite]).max()) / scale


def value_and_grads(fn, q, k, v, dout):
    """fn's output and its (dq, dk, dv) for cotangent dout."""
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(dout)


def with_reference(fn, q, k, v, dout, *, causal, segment_ids=None):
    """((out, grads) of fn, (out, grads) of the dense reference), both from one jitted forward + VJP."""
    from jaxring import attention_reference

    @jax.jit
    def run(q, k, v, dout):
        def both(f):
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(dout)

        return both(fn), both(lambda q, k, v: attention_reference(q, k, v, causal=causal, segment_ids=segment_ids)[0])

    return run(q, k, v, dout)


def check(got, ref, rtol=2e-4):
    """Output and dq, dk, dv of `got` against `ref`, each as (out, (dq, dk, dv))."""
    (out, grads), (out_r, grads_r) = got, ref
    assert_close(out, out_r, rtol, "out")
    for name, g, g_r in zip("qkv", grads, grads_r):
        assert_close(g, g_r, rtol, "d" + name)


def padded_segments(layout, seq, sp, padded_device=3):
    """numpy int32 [2, seq] segment ids: row 0 packs three segments and a padded tail; row 1 has two segments and
    every token of `padded_device` (in `layout`) is padding (0)."""
    from jaxring import layout_permutation

    seg = np.ones((2, seq), np.int32)
    a, b, c = (seq * 5) // 16, (seq * 45) // 64, (seq * 7) // 8
    seg[0, a:b], seg[0, b:c], seg[0, c:] = 2, 3, 0
    seg[1, seq // 2 :] = 2
    seg[1, layout_permutation(layout, seq, sp).reshape(sp, -1)[padded_device]] = 0
    return seg


def mlp_block_reference(x, params, activation):
    """The tensor modules' MLP contract on one device: gelu(x w_in) w_out, or (silu(x w_gate) * x w_in) w_out."""
    if activation == "gelu":
        return jax.nn.gelu(x @ params["w_in"], approximate=True) @ params["w_out"]
    return (jax.nn.silu(x @ params["w_gate"]) * (x @ params["w_in"])) @ params["w_out"]


def attention_block_reference(x, params, positions, num_heads, num_kv_heads, causal, rope_theta, window=None):
    """The tensor modules' attention contract on one device: projections, RoPE, dense attention (with a sliding
    window when given), output."""
    from jaxring import attention_reference
    from jaxring.kernels.rope import apply_rope

    b, s, _ = x.shape
    d = params["wq"].shape[1] // num_heads
    q = (x @ params["wq"]).reshape(b, s, num_heads, d)
    k = (x @ params["wk"]).reshape(b, s, num_kv_heads, d)
    v = (x @ params["wv"]).reshape(b, s, num_kv_heads, d)
    if rope_theta is not None:
        q, k = apply_rope(q, positions, rope_theta), apply_rope(k, positions, rope_theta)
    out = attention_reference(q, k, v, causal=causal, q_positions=positions, kv_positions=positions, window=window)[0]
    return out.reshape(b, s, num_heads * d) @ params["wo"]
