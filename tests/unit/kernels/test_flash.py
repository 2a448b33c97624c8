"""The Pallas flash-attention kernel (run by the Pallas interpreter on CPU) against the dense reference.

Every case checks out, lse and dq/dk/dv (with a cotangent on lse too). Small shapes and 16/32 tiles keep the
interpreter fast while still giving several tiles per row, partial tiles and skipped tiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from jax.sharding import PartitionSpec as P

from jaxring import attention_reference, merge_partials
from jaxring.kernels import flash_tiles
from jaxring.kernels.blockwise import BlockOps
from jaxring.kernels.flash import flash_attention, flash_block_backward, flash_block_forward, flash_block_ops

INTERPRET = dict(implementation="pallas_interpret", block_q=16, block_k=16)


def make_inputs(seed, batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (batch, q_len, q_heads, head_dim)).astype(dtype)
    k = jax.random.normal(ks[1], (batch, kv_len, kv_heads, head_dim)).astype(dtype)
    v = jax.random.normal(ks[2], (batch, kv_len, kv_heads, head_dim)).astype(dtype)
    dout = jax.random.normal(ks[3], q.shape).astype(dtype)
    dlse = jax.random.normal(ks[4], (batch, q_len, q_heads))
    return q, k, v, dout, dlse


def assert_lse_close(lse, lse_ref, rtol):
    lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref), err_msg="-inf rows differ")
    assert_close(np.where(np.isneginf(lse), 0, lse), np.where(np.isneginf(lse_ref), 0, lse_ref), rtol, "lse")


def check_against_reference(q, k, v, dout, dlse, rtol=2e-4, **kwargs):
    """flash_attention (interpreted kernel) vs attention_reference: out, lse, dq, dk, dv; no NaN anywhere."""
    options = {**INTERPRET, **{n: kwargs.pop(n) for n in ("block_q", "block_k", "implementation") if n in kwargs}}
    flash_fn = lambda q, k, v: flash_attention(q, k, v, return_lse=True, **options, **kwargs)
    ref_fn = lambda q, k, v: attention_reference(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), **kwargs
    )
    (out, lse), vjp = jax.vjp(flash_fn, q, k, v)
    (out_r, lse_r), vjp_r = jax.vjp(ref_fn, q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
    assert_close(out, out_r, rtol, "out")
    assert_lse_close(lse, lse_r, rtol)
    grads = vjp((dout, dlse))
    grads_r = vjp_r((dout.astype(jnp.float32), dlse))
    for name, g, g_r, x in zip("qkv", grads, grads_r, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert_close(g, g_r, rtol, "d" + name)
    return out, lse, grads


# --------------------------------------------------------------------------------------------------------
# Shapes: causal / full, GQA / MQA, lengths that are not a multiple of the tile, odd head dims
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "causal,q_len,kv_len,q_heads,kv_heads,head_dim,blocks",
    [
        (True, 64, 64, 2, 2, 64, (32, 16)),  # plain causal self-attention, several tiles per row
        (False, 40, 40, 4, 2, 24, (16, 16)),  # full, GQA, 40 = 2.5 tiles, head_dim 24 padded to 32
        (True, 40, 72, 4, 1, 80, (16, 32)),  # causal MQA, different lengths, head_dim 80 padded to 128
        # full cross-attention with MQA, partial tiles on both sides: -m slow (full, MQA, partial tiles and different
        # lengths each run in the cases above)
        pytest.param(False, 24, 56, 2, 1, 64, (16, 16), marks=pytest.mark.slow),
    ],
)
def test_matches_reference(causal, q_len, kv_len, q_heads, kv_heads, head_dim, blocks):
    q, k, v, dout, dlse = make_inputs(0, 2, q_len, kv_len, q_heads, kv_heads, head_dim)
    check_against_reference(q, k, v, dout, dlse, causal=causal, block_q=blocks[0], block_k=blocks[1])


def test_matches_jax_dot_product_attention():
    q, k, v, _, _ = make_inputs(1, 2, 48, 48, 4, 2, 32)
    out = flash_attention(q, k, v, causal=True, **INTERPRET)
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert_close(out, expected, 2e-4, "out")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])  # one path
def test_half_precision(dtype):
    q, k, v, dout, dlse = make_inputs(2, 2, 48, 48, 4, 2, 64, dtype)
    _, lse, _ = check_against_reference(q, k, v, dout, dlse, rtol=2e-2, causal=True)
    assert lse.dtype == jnp.float32


def test_sm_scale():
    q, k, v, dout, dlse = make_inputs(3, 1, 32, 32, 2, 2, 16)
    check_against_reference(q, k, v, dout, dlse, causal=True, sm_scale=0.7)


# --------------------------------------------------------------------------------------------------------
# Positions: offset blocks, batched and unsorted positions; fully masked rows
# --------------------------------------------------------------------------------------------------------


# "after" (every key visible: the unmasked tiles) with -m slow; test_block_entry_points_sum_to_reference and the
# causal cases of test_matches_reference take that path too
@pytest.mark.parametrize(
    "q_offset,kv_offset",
    [
        pytest.param(48, 0, id="after", marks=pytest.mark.slow),
        pytest.param(0, 40, id="before"),
        pytest.param(16, 0, id="overlap"),
    ],
)
def test_offset_blocks(q_offset, kv_offset):
    q, k, v, dout, dlse = make_inputs(4, 2, 32, 48, 4, 2, 32)
    q_pos, kv_pos = jnp.arange(32) + q_offset, jnp.arange(48) + kv_offset
    out, lse, grads = check_against_reference(q, k, v, dout, dlse, causal=True, q_positions=q_pos, kv_positions=kv_pos)
    if q_offset < kv_offset:  # every query precedes every key: nothing is visible
        assert (out == 0).all() and jnp.isneginf(lse).all()
        assert all((g == 0).all() for g in grads)


def test_batched_and_unsorted_positions():
    # Per-batch positions [b, n]. Row 0: permuted query positions (every tile takes the masked path).
    # Row 1: key tiles at positions [0, 16), [100, 116), [16, 32): for queries 50..97 the fully visible
    # tiles 0 and 2 are not contiguous, so the kernel must not run tile 1 unmasked.
    q, k, v, dout, dlse = make_inputs(5, 2, 48, 48, 2, 2, 16)
    perm = jax.random.permutation(jax.random.PRNGKey(7), 48)
    q_pos = jnp.stack([perm, jnp.arange(48) + 50])
    kv_pos = jnp.stack([jnp.arange(48), jnp.concatenate([jnp.arange(16), jnp.arange(16) + 100, jnp.arange(16) + 16])])
    check_against_reference(q, k, v, dout, dlse, causal=True, q_positions=q_pos, kv_positions=kv_pos)


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])  # full: -m slow
def test_segment_ids_with_padding(causal):
    q, k, v, dout, dlse = make_inputs(6, 3, 40, 40, 2, 1, 32)
    seg = jnp.array(
        [
            [1] * 10 + [0] * 4 + [2] * 18 + [0] * 8,  # packed sequences with padding inside a tile
            [0] * 40,  # a fully padded batch row
            [3] * 40,
        ]
    )  # one sequence
    out, lse, grads = check_against_reference(q, k, v, dout, dlse, causal=causal, segment_ids=seg)
    assert (out[1] == 0).all() and jnp.isneginf(lse[1]).all()
    assert jnp.isneginf(lse[0, 10:14]).all() and jnp.isneginf(lse[0, 32:]).all()
    for g in grads:
        assert (g[1] == 0).all()


def test_block_ranges_skip_hidden_tiles():
    """Causal self-attention: row i loops over tiles [0, i], unmasked [0, i), masked only the diagonal."""
    pos = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (1, 64))
    vis, full = flash_tiles.visibility(True, pos, pos, None, None, 1, 64, 64, 64, 16, 16)
    ranges = np.asarray(flash_tiles.loop_ranges(vis, full))[0]
    np.testing.assert_array_equal(ranges, [[i, i, i, i + 1] if i == 0 else [0, 0, i, i + 1] for i in range(4)])
    # Queries entirely before the keys: nothing to loop over.
    vis, full = flash_tiles.visibility(True, pos, pos + 100, None, None, 1, 64, 64, 64, 16, 16)
    assert (np.asarray(flash_tiles.loop_ranges(vis, full)) == 0).all()
    # Segments: two 32-token documents, no causal mask: tiles of the other document are skipped.
    seg = jnp.array([[1] * 32 + [2] * 32], jnp.int32)
    vis, full = flash_tiles.visibility(False, None, None, seg, seg, 1, 64, 64, 64, 16, 16)
    np.testing.assert_array_equal(
        np.asarray(flash_tiles.loop_ranges(vis, full))[0], [[0, 0, 2, 2], [0, 0, 2, 2], [2, 2, 4, 4], [2, 2, 4, 4]]
    )


# --------------------------------------------------------------------------------------------------------
# Sliding window: query i sees keys i - W < j <= i (by positions); the tile loops cover only the band
# --------------------------------------------------------------------------------------------------------


@pytest.mark.heavy
@pytest.mark.parametrize(
    "window,q_len,kv_len,q_offset,segments",
    [
        (5, 64, 64, 0, False),  # inside a 16-tile: the diagonal tile and its left neighbour
        (23, 40, 40, 0, True),  # spanning tiles, packed documents; 40 = 2.5 tiles: padded queries and keys
        (20, 32, 64, 24, False),  # offset queries 24..55 over keys 0..63
    ],
    ids=["inside-a-tile", "spanning-padded-segments", "offset"],
)
def test_sliding_window(window, q_len, kv_len, q_offset, segments):
    """out, lse, dq, dk, dv (GQA, a cotangent on lse too) against the reference with the same window; the
    self-attention case against jax.nn's local window too."""
    q, k, v, dout, dlse = make_inputs(11, 2, q_len, kv_len, 4, 2, 16)
    kw = dict(q_positions=jnp.arange(q_len) + q_offset, kv_positions=jnp.arange(kv_len))
    if segments:
        kw["segment_ids"] = jnp.array([[1] * 15 + [2] * 19 + [0] * 6, [3] * 40])
    out, _, _ = check_against_reference(q, k, v, dout, dlse, causal=True, window=window, **kw)
    if q_len == kv_len and not (q_offset or segments):
        expected = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window - 1, 0))
        assert_close(out, expected, 2e-4, "out vs jax.nn")


def test_window_tile_ranges_are_a_band():
    """128 tokens in 16-tiles, window 40: row i loops over tiles i-3 .. i, unmasked only tile i-1 (whose every
    pair is within 40 and causal); the tiles left of i-3 are never visited."""
    pos = jnp.broadcast_to(jnp.arange(128, dtype=jnp.int32), (1, 128))
    vis, full = flash_tiles.visibility(True, pos, pos, None, None, 1, 128, 128, 128, 16, 16, window=40)
    ranges = np.asarray(flash_tiles.loop_ranges(vis, full))[0]
    expected = [[0, 0, 0, 1]] + [[max(0, i - 3), i - 1, i, i + 1] for i in range(1, 8)]
    np.testing.assert_array_equal(ranges, expected)


@pytest.mark.heavy
@pytest.mark.parametrize("slab", [7, 64, 100])
def test_tile_loop_ranges_slab_by_slab_equal_the_whole_tables(monkeypatch, slab):
    """The kernels' loop ranges, built a few tile rows at a time, are the whole visibility table's: both loop
    directions (Q tiles over K tiles; the dK/dV kernel's K tiles over Q tiles), causal or not, packed
    documents, a window, padded keys, unsorted tiles and a batch of 2."""
    rng = np.random.default_rng(3)
    b, nq, nk, bq, bk, kv_len = 2, 256, 192, 16, 32, 180
    qpos, kpos = (jnp.asarray(rng.permutation(300)[:n][None].repeat(b, 0), jnp.int32) for n in (nq, nk))
    qseg, kseg = (jnp.asarray(np.sort(rng.integers(0, 4, (b, n)), axis=1), jnp.int32) for n in (nq, nk))
    for causal, seg, window in [(True, True, None), (True, False, 40), (False, True, None), (False, False, None)]:
        args = (causal, qpos, kpos, *((qseg, kseg) if seg else (None, None)), b, nq, nk, kv_len, bq, bk, window)
        vis, full = flash_tiles.visibility(*args)
        monkeypatch.setattr(flash_tiles, "VISIBILITY_SLAB", slab)
        by_q = flash_tiles.tile_loop_ranges(*args)
        by_k = flash_tiles.tile_loop_ranges(*args, over_queries=True)
        monkeypatch.undo()
        np.testing.assert_array_equal(by_q, flash_tiles.loop_ranges(vis, full))
        np.testing.assert_array_equal(by_k, flash_tiles.loop_ranges(vis.swapaxes(1, 2), full.swapaxes(1, 2)))


def test_tile_loop_ranges_memory_is_not_quadratic_in_the_tokens():
    """At 4M tokens in tiles of 64 x 32 the whole visibility table would be 8 GiB of booleans (at 5.7M tokens a
    device, Ulysses sp8 on 8 x H200, three such tables held 44 GiB); the compiled ranges need under 256 MiB."""
    n = 1 << 22
    pos = jax.ShapeDtypeStruct((1, n), jnp.int32)
    ranges = jax.jit(lambda qp, kp: flash_tiles.tile_loop_ranges(True, qp, kp, None, None, 1, n, n, n, 64, 32))
    temp = ranges.lower(pos, pos).compile().memory_analysis().temp_size_in_bytes
    assert temp < 256 * 2**20, f"{temp / 2**30:.2f} GiB of temporaries for the loop ranges"


# --------------------------------------------------------------------------------------------------------
# Block interface (BlockOps) with global lse / delta, alone and inside shard_map
# --------------------------------------------------------------------------------------------------------


def test_block_entry_points_sum_to_reference():
    q, k, v, dout, _ = make_inputs(8, 2, 32, 64, 4, 2, 32)
    q_pos, kv_pos = jnp.arange(32) + 24, jnp.arange(64)  # queries overlap the second K/V half
    ref = lambda q, k, v: attention_reference(
        q, k, v, causal=True, q_positions=q_pos, kv_positions=kv_pos, sm_scale=0.3
    )
    (out_r, lse_r), vjp_r = jax.vjp(ref, q, k, v)
    dq_r, dk_r, dv_r = vjp_r((dout, jnp.zeros_like(lse_r)))

    ops = flash_block_ops(interpret=True, block_q=16, block_k=16)
    assert isinstance(ops, BlockOps) and ops.name == "pallas_interpret"
    assert flash_block_ops(interpret=False).name == "pallas"
    halves = [(k[:, :40], v[:, :40], kv_pos[:40]), (k[:, 40:], v[:, 40:], kv_pos[40:])]  # uneven split
    parts = [ops.forward(q, kb, vb, q_pos, pb, None, None, causal=True, sm_scale=0.3) for kb, vb, pb in halves]
    for o, l in parts:
        assert o.dtype == jnp.float32 and l.dtype == jnp.float32
    out, lse = merge_partials(*parts[0], *parts[1])
    assert_close(out, out_r, 2e-4, "merged out")
    assert_lse_close(lse, lse_r, 2e-4)

    delta = jnp.sum(dout * out_r, axis=-1)  # global delta, from the global out
    grads = [
        ops.backward(q, kb, vb, dout, lse_r, delta, q_pos, pb, None, None, causal=True, sm_scale=0.3)
        for kb, vb, pb in halves
    ]
    assert_close(grads[0][0] + grads[1][0], dq_r, 2e-4, "dq")
    assert_close(jnp.concatenate([grads[0][1], grads[1][1]], 1), dk_r, 2e-4, "dk")
    assert_close(jnp.concatenate([grads[0][2], grads[1][2]], 1), dv_r, 2e-4, "dv")


def test_block_forward_inside_shard_map():
    # Each of 2 devices holds one Q block and the whole K/V; positions come from the device index.
    # The interpreter needs check_vma=False (it interprets kernels without vma types); the compiled kernel
    # declares its outputs' varying axes and also lowers with check_vma=True (see the GPU test below).
    q, k, v, dout, _ = make_inputs(9, 2, 64, 64, 2, 2, 16)
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    delta = jnp.sum(dout * ref_out, axis=-1)

    def local(q, dout, lse, delta, k, v):
        q_pos = jnp.arange(32) + jax.lax.axis_index("sp") * 32
        kwargs = dict(causal=True, sm_scale=0.25, implementation="pallas_interpret", block_q=16, block_k=16)
        out, lse_block = flash_block_forward(q, k, v, q_pos, jnp.arange(64), None, None, **kwargs)
        dq, dk, dv = flash_block_backward(q, k, v, dout, lse, delta, q_pos, jnp.arange(64), None, None, **kwargs)
        return out, lse_block, dq, jax.lax.psum(dk, "sp"), jax.lax.psum(dv, "sp")

    seq = P(None, "sp")
    run = jax.shard_map(
        local, mesh=mesh, in_specs=(seq, seq, seq, seq, P(), P()), out_specs=(seq, seq, seq, P(), P()), check_vma=False
    )
    out, lse, dq, dk, dv = jax.jit(run)(q, dout, ref_lse, delta, k, v)
    _, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=True)[0], q, k, v)
    assert_close(out, ref_out, 2e-4, "out")
    assert_lse_close(lse, ref_lse, 2e-4)
    for name, g, g_r in zip("qkv", (dq, dk, dv), vjp(dout)):
        assert_close(g, g_r, 2e-4, "d" + name)

    # the interpreter cannot type-check varying axes (jax 0.11.2, 0.12.1): with check_vma=True, a clear error
    strict = jax.shard_map(
        local, mesh=mesh, in_specs=(seq, seq, seq, seq, P(), P()), out_specs=(seq, seq, seq, P(), P()), check_vma=True
    )
    with pytest.raises(ValueError, match="pass check_vma=False"):
        jax.jit(strict)(q, dout, ref_lse, delta, k, v)


# --------------------------------------------------------------------------------------------------------
# Implementations, GPU lowering, errors
# --------------------------------------------------------------------------------------------------------


def test_jnp_implementation_and_auto_on_cpu():
    q, k, v, dout, dlse = make_inputs(10, 2, 40, 40, 4, 2, 16)
    seg = jnp.array([[1] * 30 + [0] * 10, [2] * 40])
    pos = jnp.stack([jnp.arange(40), jnp.arange(40) + 3])  # batched positions take the vmapped jnp path
    for implementation in ("jnp", None):
        check_against_reference(
            q,
            k,
            v,
            dout,
            dlse,
            causal=True,
            segment_ids=seg,
            q_positions=pos,
            kv_positions=pos,
            implementation=implementation,
        )
    assert flash_tiles.resolve_implementation(None) == ("pallas" if jax.default_backend() == "gpu" else "jnp")


@pytest.mark.parametrize("window", [None, 37], ids=["causal", "window"])
def test_kernels_lower_to_triton_for_gpu(window):
    """The compiled path lowers to Triton IR for CUDA from a CPU-only machine (no GPU needed to trace),
    inside shard_map with check_vma=True too: catches ops the Triton lowering rejects. The mesh is abstract,
    of H100s: Pallas' Triton lowering (jax 0.11, 0.12) reads the GPU it compiles for from the mesh."""
    h100 = jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", None, "gpu")
    mesh = jax.sharding.AbstractMesh((2,), ("sp",), (jax.sharding.AxisType.Auto,), abstract_device=h100)
    x = jax.ShapeDtypeStruct((2, 200, 4, 80), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 200, 2, 80), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 200), jnp.int32)

    def loss(q, k, v, seg):
        pos = jnp.arange(100) + jax.lax.axis_index("sp") * 100
        out = flash_attention(
            q,
            k,
            v,
            causal=True,
            q_positions=pos,
            kv_positions=pos,
            segment_ids=seg,
            window=window,
            implementation="pallas",
        )
        return jax.lax.psum(out.astype(jnp.float32).sum(), "sp")

    grad = jax.grad(loss, argnums=(0, 1, 2))
    run = jax.shard_map(
        grad,
        mesh=mesh,
        in_specs=(P(None, "sp"),) * 3 + (P(None, "sp"),),
        out_specs=(P(None, "sp"),) * 3,
        check_vma=True,
    )
    try:
        text = jax.jit(run).trace(x, kv, kv, seg).lower(lowering_platforms=("cuda",)).as_text()
    except (RuntimeError, NotImplementedError) as e:
        if "cuda" in str(e).lower() and "triton" not in str(e).lower():
            pytest.skip(f"this jaxlib cannot lower for CUDA: {e}")
        raise
    assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dK/dV, dQ


def test_errors_name_the_value_and_rule():
    q = jnp.zeros((1, 16, 4, 32))
    with pytest.raises(ValueError, match="head_dim 32 and k head_dim 16"):
        flash_attention(q, jnp.zeros((1, 16, 2, 16)), jnp.zeros((1, 16, 2, 16)))
    with pytest.raises(ValueError, match="query heads 4 must be a multiple of key/value heads 3"):
        flash_attention(q, jnp.zeros((1, 16, 3, 32)), jnp.zeros((1, 16, 3, 32)))
    with pytest.raises(TypeError, match=r"dtype int32.*bfloat16, float16 and float32"):
        x = jnp.zeros((1, 16, 4, 32), jnp.int32)
        flash_attention(x, x, x)
    with pytest.raises(TypeError, match="dtype float64"):
        x = np.zeros((1, 16, 4, 32), np.float64)
        flash_attention(x, x, x)
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attention(q, q.astype(jnp.bfloat16), q.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="block_q=24 must be a power of two >= 16"):
        flash_attention(q, q, q, block_q=24)
    with pytest.raises(ValueError, match="implementation 'triton'"):
        flash_attention(q, q, q, implementation="triton")
    with pytest.raises(ValueError, match=r"q_positions has shape \(8,\); expected \(16,\)"):
        flash_attention(q, q, q, q_positions=jnp.arange(8))
    with pytest.raises(ValueError, match="lse has shape"):
        flash_block_backward(
            q,
            q,
            q,
            q,
            jnp.zeros((1, 16)),
            jnp.zeros((1, 16, 4)),
            jnp.arange(16),
            jnp.arange(16),
            causal=True,
            sm_scale=1.0,
        )


@pytest.mark.parametrize(
    "shape",
    [(1, 16, 4, 0), (1, 0, 4, 32), (0, 16, 4, 32), (1, 16, 0, 32)],
    ids=["head_dim0", "seq0", "batch0", "heads0"],
)
def test_degenerate_shapes_raise_one_line_errors(shape):
    x = jnp.zeros(shape)
    with pytest.raises(ValueError, match=r"must all be >= 1") as info:
        flash_attention(x, x, x)
    assert "\n" not in str(info.value) and str(shape) in str(info.value)
