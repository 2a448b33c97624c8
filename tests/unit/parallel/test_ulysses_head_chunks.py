"""Ulysses with attention chunked over heads (UPipe, `jaxring/parallel/sequence/ulysses_chunked.py`): the output
and every gradient equal `jax.nn.dot_product_attention`'s (an independent oracle) with GQA, packed documents,
a sliding window and the zig-zag layout, on sp8 and dp2 x sp4; the model's loss and gradients equal plain
Ulysses'; in bf16 the chunks' results stay bf16 (the block ops write the inputs' dtype: a chunk is a whole
attention, nothing is summed over blocks); the chunk rules are one line each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, qkv
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_memory_techniques import _assert_same, _loss_and_grads

import jaxring
from jaxring.kernels.block_compute import get_block_ops
from jaxring.nn.tiled_block import head_chunk_weights
from jaxring.parallel.sequence.ulysses import ulysses_untied_attention


def _oracle_mask(seq: int, segments: np.ndarray | None, window: int | None) -> jax.Array:
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    mask = j <= i
    if window is not None:
        mask &= i - j < window
    mask = np.broadcast_to(mask, (1, 1, seq, seq))
    if segments is not None:
        mask = mask & (segments[:, None, :, None] == segments[:, None, None, :]) & (segments[:, None, :, None] > 0)
    return jnp.asarray(mask)


CASES = {
    # mesh, q heads, kv heads, chunks, documents, window, layout
    "sp8 gqa 2 chunks": (dict(sp=8), 16, 4, 2, False, None, None),
    "sp8 4 chunks, one kv head each": (dict(sp=8), 32, 4, 4, False, None, None),
    "dp2 x sp4 documents": (dict(dp=2, sp=4), 8, 2, 2, True, None, None),
    "sp8 window zigzag": (dict(sp=8), 16, 8, 2, False, 40, "zigzag"),
}


@pytest.mark.heavy
@pytest.mark.parametrize("case", list(CASES))
def test_output_and_gradients_equal_the_oracle(case):
    axes, hq, hkv, chunks, documents, window, layout = CASES[case]
    mesh = jaxring.make_mesh(**axes)
    batch, seq = 2, 128
    q, k, v, dout = qkv(3, batch, seq, hq, hkv, 8)
    segments = np.repeat(np.array([[1, 2, 3, 0], [1, 1, 2, 2]]), seq // 4, axis=1) if documents else None
    mask = _oracle_mask(seq, segments, window)

    def chunked(q, k, v):
        kw = dict(segment_ids=None if segments is None else jnp.asarray(segments, jnp.int32), window=window)
        return jaxring.sharded_attention(
            q, k, v, mesh=mesh, strategy="ulysses", layout=layout, head_chunks=chunks, **kw
        )

    def oracle(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask)

    # padding rows (segment 0) attend nothing here, and everything in the oracle: neither is compared
    keep = 1.0 if segments is None else jnp.asarray(segments > 0, jnp.float32)[:, :, None, None]

    def with_grads(fn):
        out, vjp = jax.vjp(jax.jit(fn), q, k, v)
        return out * keep, *vjp(dout * keep)

    got, want = with_grads(chunked), with_grads(oracle)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert_close(a, b, 2e-5, f"{case}: {name}")


@pytest.mark.heavy
def test_the_model_matches_plain_ulysses_with_zero3():
    settings = dict(dp=2, sp=4, attention="ulysses", zero=3, remat="full", mlp_tile=4)
    base = _loss_and_grads(settings, cfg=_CFG)
    _assert_same(_loss_and_grads(settings | dict(head_chunks=2), cfg=_CFG), base)


_CFG = dict(num_heads=8, num_kv_heads=2)


@pytest.mark.parametrize(
    "hq,hkv,chunks,message",
    [
        (16, 4, 3, "head_chunks 3 does not divide the 4 K/V heads"),
        (16, 8, 4, "head_chunks 4 leaves 4 query heads a chunk, not divisible by the Ulysses degree sp = 8"),
        (16, 8, 0, "head_chunks 0 must be a positive integer"),
    ],
)
def test_chunk_rules_are_one_line(hq, hkv, chunks, message):
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, _ = qkv(0, 1, 64, hq, hkv, 8)
    with pytest.raises(ValueError, match=message):
        jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="ulysses", head_chunks=chunks)


@pytest.mark.heavy
@pytest.mark.parametrize("impl", ["jnp", "pallas_interpret", "cudnn_reference"])
def test_block_ops_write_the_asked_dtype(impl):
    """dtype=bf16: out, dq, dk, dv are the fp32 results rounded once (the same values, half the bytes)."""
    ops = get_block_ops(impl)
    q, k, v, dout = qkv(4, 2, 64, 4, 2, 16, jnp.bfloat16)
    pos = jnp.arange(64, dtype=jnp.int32)
    kw = dict(causal=True, sm_scale=0.25)
    (out32, lse), (out16, lse16) = (ops.forward(q, k, v, pos, pos, None, None, **kw, dtype=t) for t in (F32, BF16))
    delta = jnp.sum(dout.astype(F32) * out32, axis=-1)
    grads32, grads16 = (
        ops.backward(q, k, v, dout, lse, delta, pos, pos, None, None, **kw, dtype=t) for t in (F32, BF16)
    )
    assert out32.dtype == F32 and out16.dtype == BF16 and lse16.dtype == F32
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out16, *grads16), (out32, *grads32), strict=True):
        assert a.dtype == BF16, name
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b.astype(BF16), np.float32), err_msg=name)


def test_bf16_chunks_equal_plain_ulysses_in_bf16():
    """sp8, 2 chunks with GQA (K/V repeated within a chunk): bf16 output and gradients, within bf16 rounding of
    plain Ulysses' (both from the same fp32 accumulation)."""
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, dout = qkv(5, 2, 128, 16, 4, 8, jnp.bfloat16)

    def run(chunks):
        fn = lambda q, k, v: jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="ulysses", head_chunks=chunks)
        out, vjp = jax.vjp(jax.jit(fn), q, k, v)
        return out, *vjp(dout)

    for name, a, b in zip(("out", "dq", "dk", "dv"), run(2), run(1), strict=True):
        assert a.dtype == BF16, name
        assert_close(a, b, 2e-2, name)


F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)


UNTIED = {
    # mesh (dp, sp), q heads, kv heads, chunks, documents, window
    "sp8 gqa 2 chunks": ((1, 8), 16, 4, 2, False, None),
    "sp8 4 chunks, one kv head each": ((1, 8), 32, 4, 4, False, None),
    "dp2 x sp4 documents": ((2, 4), 8, 2, 2, True, None),
    "sp8 window": ((1, 8), 16, 8, 2, False, 40),
}


@pytest.mark.heavy
@pytest.mark.parametrize("case", list(UNTIED))
def test_untied_chunks_equal_the_oracle(case):
    """UPipe with the projections inside each chunk (`ulysses_untied_attention`): out = attention(x Wq, x Wk,
    x Wv) and the gradients of x, Wq, Wk, Wv equal `jax.nn.dot_product_attention`'s on the whole projections."""
    (dp, sp), hq, hkv, chunks, documents, window = UNTIED[case]
    mesh = Mesh(np.array(jax.devices()[: dp * sp]).reshape(dp, sp), ("dp", "sp"))
    batch, seq, hidden, d = 2, 128, 16, 8
    keys = jax.random.split(jax.random.PRNGKey(7), 5)
    x = jax.random.normal(keys[0], (batch, seq, hidden), jnp.float32)
    wq, wk, wv = (jax.random.normal(k, (hidden, h * d), jnp.float32) / 4 for k, h in zip(keys[1:4], (hq, hkv, hkv)))
    dout = jax.random.normal(keys[4], (batch, seq, hq, d), jnp.float32)
    segments = np.repeat(np.array([[1, 2, 3, 0], [1, 1, 2, 2]]), seq // 4, axis=1) if documents else None
    seg = None if segments is None else jnp.asarray(segments, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))

    def projections(x, w):
        return tuple((x @ w[n]).reshape(*x.shape[:2], -1, d) for n in ("wq", "wk", "wv"))

    def untied(x, wq, wk, wv):
        def local(x, wq, wk, wv, pos, *seg):
            project = lambda x, pos, g: projections(x, head_chunk_weights(dict(wq=wq, wk=wk, wv=wv), g, chunks, d))
            kw = dict(heads=hq, kv_heads=hkv, head_dim=d, head_chunks=chunks, window=window, block_ops="jnp")
            return ulysses_untied_attention(project, x, pos, *(seg or (None,)), axis_name="sp", **kw)

        rows = P("dp", "sp")
        specs = (P("dp", "sp", None), P(), P(), P(), rows) + ((rows,) if documents else ())
        fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("dp", "sp", None, None))
        return fn(x, wq, wk, wv, positions, *(() if seg is None else (seg,)))

    def oracle(x, wq, wk, wv):
        q, k, v = projections(x, dict(wq=wq, wk=wk, wv=wv))
        return jax.nn.dot_product_attention(q, k, v, mask=_oracle_mask(seq, segments, window))

    keep = 1.0 if segments is None else jnp.asarray(segments > 0, jnp.float32)[:, :, None, None]

    def with_grads(fn):
        out, vjp = jax.vjp(jax.jit(fn), x, wq, wk, wv)
        return out * keep, *vjp(dout * keep)

    for name, a, b in zip(("out", "dx", "dwq", "dwk", "dwv"), with_grads(untied), with_grads(oracle), strict=True):
        assert_close(a, b, 2e-5, f"{case}: {name}")


@pytest.mark.heavy
@pytest.mark.parametrize(
    "cfg",
    [dict(num_heads=16, num_kv_heads=4), dict(num_heads=8, num_kv_heads=2, qkv_bias=True, qk_norm=True)],
    ids=["4 chunks", "2 chunks, qkv bias, qk-norm"],
)
def test_the_untied_model_matches_plain_ulysses(cfg):
    """The tiled block's projections inside the chunks (the model path of UPipe): loss and every gradient equal
    plain Ulysses' on dp2 x sp4 with ZeRO-3, layer inputs offloaded."""
    chunks = cfg["num_kv_heads"]
    settings = dict(dp=2, sp=4, attention="ulysses", zero=3, remat="full", offload="layer_inputs", mlp_tile=4)
    base = _loss_and_grads(settings, cfg=cfg)
    _assert_same(_loss_and_grads(settings | dict(head_chunks=chunks), cfg=cfg), base)
