"""The TPU block compute (block_ops "pallas_tpu_interpret": jaxring's Pallas TPU kernels in TPU interpret mode on
CPU) against the dense reference, forward and dQ/dK/dV: single blocks with a ring step's positions (shifted,
zig-zag's two runs, striped, window, documents, GQA/MQA), every strategy and layout on 8 simulated devices, and
the GPT model's loss and gradients on a plan using it. Mutations of the kernel's mask and lse must fail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, check, padded_segments, qkv
from test_documents_model import check as check_model
from test_documents_model import grads_fn
from test_documents_model import setup as documents_setup  # noqa: F401  (a fixture)

import jaxring
from jaxring import attention_reference
from jaxring.kernels import tpu_blocks
from jaxring.kernels import tpu_flash_kernels as kernels
from jaxring.kernels.block_compute import get_block_ops, resolve_name
from jaxring.kernels.merge import merge_partials

SLOW = pytest.mark.slow
SCALE = 0.3
OPS = get_block_ops("pallas_tpu_interpret")


def test_names():
    assert OPS.name == "pallas_tpu_interpret" and get_block_ops("pallas_tpu").name == "pallas_tpu"
    assert resolve_name("auto") == "jnp"  # on this CPU; "pallas_tpu" where the default backend is a TPU


@pytest.mark.parametrize("n,target,tile", [(1024, 512, 512), (384, 512, 384), (640, 256, 128), (96, 512, 96)])
def test_tiles(n, target, tile):
    """TPU tiles are multiples of 128 dividing the block, else the whole (short) block."""
    assert tpu_blocks.tile_for(n, target) == tile


def test_a_long_block_without_a_128_tile_is_one_line():
    with pytest.raises(ValueError, match="multiple of 128"):
        tpu_blocks.tile_for(4100, 512)


def assert_lse_close(lse, lse_ref, rtol):
    lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref), err_msg="-inf rows differ")
    assert_close(np.where(np.isneginf(lse), 0, lse), np.where(np.isneginf(lse_ref), 0, lse_ref), rtol, "lse")


def _segments(n: int, cuts: tuple[int, ...]) -> np.ndarray:
    """int32 [2, n]: row 0 documents 1, 2, ... split at `cuts`; row 1 the same with the last 8 tokens padding."""
    row = np.searchsorted(np.asarray(cuts), np.arange(n), side="right") + 1
    return np.stack([row, np.where(np.arange(n) >= n - 8, 0, row)]).astype(np.int32)


ZIGZAG_Q = np.r_[np.arange(128) + 128, np.arange(128) + 768]
ZIGZAG_KV = np.r_[np.arange(128), np.arange(128) + 896]
# (q positions, kv positions, causal, window, q heads, kv heads, documents): a ring step's blocks, tiles of 128
BLOCKS = {
    "full": (np.arange(256) + 512, np.arange(384), False, None, 4, 4, False),
    "causal-diagonal": (np.arange(256), np.arange(256), True, None, 4, 2, False),
    "shifted-mqa": (np.arange(256) + 128, np.arange(384), True, None, 4, 1, False),
    "zigzag-two-runs": (ZIGZAG_Q, ZIGZAG_KV, True, None, 4, 2, False),
    "striped": (np.arange(256) * 4 + 1, np.arange(256) * 4 + 2, True, None, 4, 2, False),
    "window-across-blocks": (np.arange(256) + 256, np.arange(384), True, 200, 4, 2, False),
    "hidden": (np.arange(128), np.arange(128) + 512, True, None, 4, 4, False),
    "documents": (np.arange(256) + 128, np.arange(384), True, None, 4, 2, True),
}


def _reference(q, k, v, qp, kp, causal, window, q_seg, kv_seg):
    fn = lambda q, k, v: attention_reference(
        q, k, v, causal=causal, q_positions=qp, kv_positions=kp, sm_scale=SCALE, window=window,
        segment_ids=q_seg, kv_segment_ids=kv_seg,
    )  # fmt: skip
    return jax.vjp(fn, q, k, v)


def _block_errors(name: str, ops=OPS) -> None:
    """Asserts one block's forward (out, lse) and backward (fed the global lse and delta) equal the reference."""
    qp, kp, causal, window, hq, hkv, documents = BLOCKS[name]
    qp, kp = jnp.asarray(qp, jnp.int32), jnp.asarray(kp, jnp.int32)
    q, _, _, do = qkv(5, 2, qp.shape[0], hq, hkv, 32)
    _, k, v, _ = qkv(6, 2, kp.shape[0], hq, hkv, 32)
    q_seg = kv_seg = None
    if documents:  # the K/V block starts 128 tokens before the Q block
        q_seg = jnp.asarray(_segments(512, (100, 300))[:, 128:384])
        kv_seg = jnp.asarray(_segments(512, (100, 300))[:, :384])
    kw = dict(causal=causal, sm_scale=SCALE, **({} if window is None else {"window": window}))
    (out_r, lse_r), vjp = _reference(q, k, v, qp, kp, causal, window, q_seg, kv_seg)
    out, lse = jax.jit(lambda q, k, v: ops.forward(q, k, v, qp, kp, q_seg, kv_seg, **kw))(q, k, v)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert_close(out, out_r, 1e-5, "out")
    assert_lse_close(lse, lse_r, 1e-5)
    delta = jnp.sum(do * out_r, axis=-1)
    grads = jax.jit(lambda *a: ops.backward(*a, qp, kp, q_seg, kv_seg, **kw))(q, k, v, do, lse_r, delta)
    for n, g, g_r in zip("qkv", grads, vjp((do, jnp.zeros_like(lse_r)))):
        assert g.shape == g_r.shape  # dk, dv with the K/V heads: GQA not repeated
        assert_close(g, g_r, 1e-5, "d" + n)


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_matches_reference(name):
    """One block of several tiles (128 x 128 backward, up to 256 x 384 forward): skipped, masked and unmasked
    tiles, GQA/MQA, window, documents with padding (rows that see nothing: out 0, lse -inf)."""
    _block_errors(name)


@pytest.mark.parametrize(
    "mutation",
    [
        # causal: q >= k -> q > k
        (
            "_mask",
            lambda q_info, kv_info, shape, *, causal, window: (
                None
                if not causal
                else (jnp.tile(q_info[0][...], (1, shape[1] // 128)) > jnp.broadcast_to(kv_info[0][:1, :], shape))
            ),
        ),
        # the tile ranges: one K tile fewer per row
        ("_range", lambda ranges_ref, row: (*RANGE(ranges_ref, row)[:3], RANGE(ranges_ref, row)[3] - 1)),
    ],
    ids=["mask-off-by-one", "range-one-short"],
)
def test_a_mutated_kernel_fails(monkeypatch, mutation):
    """The block tests are strong enough: an off-by-one causal mask or a K tile range one short must fail them."""
    monkeypatch.setattr(kernels, *mutation)
    with pytest.raises(AssertionError):
        _block_errors("shifted-mqa", tpu_blocks.tpu_block_ops(interpret=True))


RANGE = kernels._range


def _merged_two_blocks(ops) -> None:
    """K/V split in two blocks (the second partly visible, GQA): the merged forward and each block's backward
    fed the global lse and delta, summed, equal the dense reference (a ring of two steps)."""
    q, _, _, do = qkv(7, 2, 128, 4, 2, 32)
    _, k, v, _ = qkv(8, 2, 256, 4, 2, 32)
    qp, kp = jnp.arange(128) + 128, jnp.arange(256)
    kw = dict(causal=True, sm_scale=SCALE)
    halves = [(k[:, s], v[:, s], kp[s]) for s in (slice(0, 128), slice(128, 256))]
    parts = [ops.forward(q, kb, vb, qp, kpb, **kw) for kb, vb, kpb in halves]
    out, lse = merge_partials(*parts[0], *parts[1])
    (out_r, lse_r), vjp = jax.vjp(
        lambda q, k, v: attention_reference(q, k, v, q_positions=qp, kv_positions=kp, **kw), q, k, v
    )
    assert_close(out, out_r, 1e-5, "out")
    assert_lse_close(lse, lse_r, 1e-5)
    delta = jnp.sum(do * out, axis=-1)
    grads = [ops.backward(q, kb, vb, do, lse, delta, qp, kpb, **kw) for kb, vb, kpb in halves]
    dq = grads[0][0] + grads[1][0]
    dk, dv = (jnp.concatenate([grads[0][i], grads[1][i]], axis=1) for i in (1, 2))
    for n, g, g_r in zip("qkv", (dq, dk, dv), vjp((do, jnp.zeros_like(lse_r)))):
        assert_close(g, g_r, 1e-5, "d" + n)


def test_two_blocks_merged_with_global_lse_and_delta():
    _merged_two_blocks(OPS)


def test_a_mutated_lse_fails_the_merge(monkeypatch):
    """The forward's lse weighs the blocks in the merge: each block's lse off by 0.1% must fail the test."""
    forward = kernels.forward

    def scaled(*a, **kw):
        out, lse = forward(*a, **kw)
        return out, lse * 1.001

    monkeypatch.setattr(kernels, "forward", scaled)
    with pytest.raises(AssertionError, match="out"):
        _merged_two_blocks(tpu_blocks.tpu_block_ops(interpret=True))


def _apart(fn, ref, q, k, v, dout):
    """((out, grads) of fn, (out, grads) of ref), each from its own jitted forward + VJP: in one program, XLA:CPU
    may run the reference's collectives on one device while the others wait in TPU interpret mode's per-kernel
    barrier (a deadlock the interpreter ends by aborting)."""

    def run(f):
        def both(q, k, v, dout):
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(dout)

        return jax.jit(both)(q, k, v, dout)

    return run(fn), run(ref)


def _dense(causal=True, **kw):
    """The dense reference as a function of (q, k, v)."""
    return lambda q, k, v: attention_reference(q, k, v, causal=causal, **kw)[0]


def _strategy(mesh_kw, strategy, layout, *, causal=True, segment_ids=None, window=None, **options):
    mesh = jaxring.make_mesh(**mesh_kw)

    def fn(q, k, v):
        return jaxring.sharded_attention(
            q, k, v, mesh=mesh, strategy=strategy, causal=causal, layout=layout, segment_ids=segment_ids,
            block_ops="pallas_tpu_interpret", window=window, **options,
        )  # fmt: skip

    return fn


CASES = [
    pytest.param("ring", "zigzag", {}, 4, 2, id="ring-zigzag-gqa"),
    pytest.param("ring", "striped", {}, 4, 4, id="ring-striped", marks=SLOW),  # striped blocks: BLOCKS
    pytest.param("ring", "contiguous", {}, 4, 1, id="ring-contiguous-mqa", marks=SLOW),
    pytest.param("ulysses", "zigzag", {}, 8, 8, id="ulysses-zigzag"),
    pytest.param("ulysses", "contiguous", {"head_chunks": 2}, 16, 16, id="ulysses-head-chunks", marks=SLOW),
    pytest.param("usp", "zigzag", {"ulysses_size": 2}, 4, 2, id="usp-zigzag"),
    pytest.param("allgather", "zigzag", {}, 4, 2, id="allgather-zigzag", marks=SLOW),
    pytest.param("wallfacer", "zigzag", {"team_size": 2}, 4, 2, id="wallfacer-zigzag"),
]


@pytest.mark.heavy
@pytest.mark.parametrize("strategy,layout,options,q_heads,kv_heads", CASES)
def test_strategies_match_reference(strategy, layout, options, q_heads, kv_heads):
    """Each sequence strategy on sp = 8 with the TPU kernels as its block compute vs the dense reference."""
    q, k, v, dout = qkv(hash(strategy) % 100, 1, 128, q_heads, kv_heads, 16)
    fn = _strategy(dict(sp=8), strategy, layout, **options)
    check(*_apart(fn, _dense(), q, k, v, dout), 2e-4)


@pytest.mark.heavy
def test_window_on_the_ring():
    """A window reaching across ring blocks on the zig-zag ring (steps it hides on some devices: lockstep)."""
    q, k, v, dout = qkv(6, 1, 64, 4, 2, 16)
    fn = _strategy(dict(sp=8), "ring", "zigzag", window=6)
    check(*_apart(fn, _dense(window=6), q, k, v, dout), 2e-4)


@SLOW
def test_documents_on_the_ring():
    """Packed documents with padding on the zig-zag ring (one block of documents: test_block_matches_reference)."""
    q, k, v, dout = qkv(6, 2, 128, 4, 2, 16)
    seg = jnp.asarray(padded_segments("zigzag", 128, 8))
    fn = _strategy(dict(sp=8), "ring", "zigzag", segment_ids=seg)
    check(*_apart(fn, _dense(segment_ids=seg), q, k, v, dout), 2e-4)


def test_bf16_block():
    """bf16 inputs (the TPU's): products in bf16 with fp32 accumulation, within bf16's rounding of the reference."""
    q, k, v, _ = qkv(9, 1, 256, 4, 2, 32, jnp.bfloat16)
    pos = jnp.arange(256)
    out, lse = OPS.forward(q, k, v, pos, pos, causal=True, sm_scale=SCALE, dtype=jnp.bfloat16)
    f32 = lambda x: x.astype(jnp.float32)
    out_r, lse_r = attention_reference(f32(q), f32(k), f32(v), causal=True, sm_scale=SCALE)
    assert out.dtype == jnp.bfloat16
    assert_close(out, out_r, 2e-2, "out")
    assert_lse_close(lse, lse_r, 1e-2)


def test_model_on_the_tpu_block_compute(documents_setup):  # noqa: F811
    """The GPT model's loss and every gradient with the TPU kernels as its attention, packed documents, on one
    device: equal to each document alone (the oracle of tests/integration/test_documents_model.py). One device: in a train
    step over several, XLA:CPU may run a gradient reduction on one device while the others wait in TPU interpret
    mode's per-kernel barrier; the kernels inside every strategy over 8 devices are the tests above."""
    model, batch, want = documents_setup
    check_model(grads_fn(model, devices=jax.devices()[:1], block_ops="pallas_tpu_interpret")(batch), want)
