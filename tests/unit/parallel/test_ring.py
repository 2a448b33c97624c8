"""Ring attention against the dense reference and jax.nn.dot_product_attention, forward and dQ/dK/dV."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, check, padded_segments, qkv, with_reference
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring import attention_reference
from jaxring.analysis import compile_stats
from jaxring.kernels.block_compute import get_block_ops
from jaxring.kernels.blockwise import BlockOps, block_backward, block_forward
from jaxring.kernels.layout import RankTokens
from jaxring.parallel.sequence.ring import RingConfig, ring_attention, ring_forward

# (sp4 is the dp2 x sp4 mesh: a fourth entry "dp2xsp4" repeated its six cases on the same mesh)
MESHES = {"sp2": dict(sp=2, dp=4), "sp4": dict(sp=4, dp=2), "sp8": dict(sp=8)}
SLOW = pytest.mark.slow


def ring_and_reference(mesh, q, k, v, dout, *, causal, layout, segment_ids=None):
    """(out, grads) of the ring and of the reference, each from one jitted forward + VJP."""
    ring = lambda q, k, v: jaxring.sharded_attention(
        q, k, v, mesh=mesh, strategy="ring", causal=causal, layout=layout, segment_ids=segment_ids
    )
    return with_reference(ring, q, k, v, dout, causal=causal, segment_ids=segment_ids)


def _reference_cases():
    """(mesh, layout, causal) for every mesh and layout; full attention (where a layout only permutes the tokens)
    on sp2 and sp4 only for zig-zag by default, the others with -m slow."""
    return [
        pytest.param(
            m, layout, causal, id=f"{m}-{layout}-{'causal' if causal else 'full'}", marks=[SLOW] if slow else []
        )
        for m in MESHES
        for layout in jaxring.LAYOUTS
        for causal in (True, False)
        for slow in [not causal and m != "sp8" and layout != "zigzag"]
    ]


@pytest.mark.parametrize("mesh_name,layout,causal", _reference_cases())
def test_matches_reference(mesh_name, layout, causal):
    kw = MESHES[mesh_name]
    mesh = jaxring.make_mesh(**kw)
    sp = kw["sp"]
    batch = 2 if "dp" in kw and kw["dp"] <= 2 else 4 if kw.get("dp") == 4 else 1
    q, k, v, dout = qkv(hash((mesh_name, layout)) % 1000, batch, sp * sp * 2, 4, 2, 16)
    check(*ring_and_reference(mesh, q, k, v, dout, causal=causal, layout=layout), 2e-4)


@pytest.mark.heavy
@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim",
    [(8, 2, 16), (8, 1, 16), pytest.param(4, 4, 64, marks=SLOW), (4, 2, 80)],  # dim64: the unpadded case, slow
    ids=["gqa8/2", "mqa", "dim64", "dim80"],
)
def test_heads_and_dims_against_jax_nn(q_heads, kv_heads, head_dim):
    mesh = jaxring.make_mesh(dp=2, sp=4)
    q, k, v, dout = qkv(1, 2, 32, q_heads, kv_heads, head_dim)
    ring, ref = ring_and_reference(mesh, q, k, v, dout, causal=True, layout="zigzag")
    check(ring, ref, 2e-4)
    out_nn, vjp_nn = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), q, k, v)
    check(ring, (out_nn, vjp_nn(dout)), 2e-4)


@pytest.mark.parametrize("layout", ["zigzag", pytest.param("striped", marks=SLOW)])  # striped: the same kernel
def test_bf16_inputs_accumulate_in_fp32(layout):
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, dout = qkv(2, 1, 128, 4, 2, 32, dtype=jnp.bfloat16)
    (out, grads), _ = ring_and_reference(mesh, q, k, v, dout, causal=True, layout=layout)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    # oracle: fp32 reference on the same bf16-rounded inputs
    f32 = lambda x: x.astype(jnp.float32)
    out_r, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=True)[0], f32(q), f32(k), f32(v))
    check((out, grads), (out_r, vjp(f32(dout))), 2e-2)


@pytest.mark.heavy
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_segments_with_padding_and_an_all_padding_device(layout, causal):
    sp, seq = 8, 64
    mesh = jaxring.make_mesh(sp=sp)
    seg = padded_segments(layout, seq, sp)
    q, k, v, dout = qkv(3, 2, seq, 4, 2, 16)
    ring, ref = ring_and_reference(mesh, q, k, v, dout, causal=causal, layout=layout, segment_ids=jnp.asarray(seg))
    check(ring, ref, 2e-4)
    out, grads = ring
    assert np.all(np.asarray(out)[seg == 0] == 0)
    assert all(np.all(np.asarray(g)[seg == 0] == 0) for g in grads)


def per_device_work(layout, sp, seq):
    """Query-key pairs each device computes in the causal forward, counted where the blocks run."""
    mesh = jaxring.make_mesh(sp=sp, dp=8 // sp)
    q, k, v, _ = qkv(4, 1, seq, 2, 2, 8)
    spec = P(None, "sp", None, None)
    ops = get_block_ops("jnp")

    def local(q, k, v):
        _, _, work = ring_forward(q, k, v, None, RingConfig("sp", RankTokens(layout), True, 0.3, ops))
        return work[None]

    run = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=P("sp"))
    return np.asarray(jax.jit(run)(q, k, v))


@pytest.mark.parametrize("sp", [4, 8])
def test_zigzag_balances_causal_work(sp):
    seq = 4 * sp
    zigzag = per_device_work("zigzag", sp, seq)
    contiguous = per_device_work("contiguous", sp, seq)
    half = seq // (2 * sp)
    # every zigzag device does 2P+1 half-chunk pairs; contiguous rank r does r+1 whole blocks
    np.testing.assert_array_equal(zigzag, (2 * sp + 1) * half * half)
    np.testing.assert_array_equal(contiguous, (np.arange(sp) + 1) * (2 * half) ** 2)
    assert zigzag.max() <= 1.05 * zigzag.min()
    assert contiguous.max() >= 2 * contiguous.min()
    assert zigzag.sum() < contiguous.sum() + sp * (2 * half) ** 2  # skipping saves the same total


def _local_ring(mesh, **kw):
    spec = P(None, "sp", None, None)
    return jax.shard_map(lambda q, k, v: ring_attention(q, k, v, **kw), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)


@pytest.mark.parametrize("layout", [pytest.param("contiguous", marks=SLOW), "zigzag"])  # one formula for both
def test_bytes_moved_match_the_ring_formula(layout):
    sp, batch, seq, kv_heads, head_dim = 8, 1, 256, 2, 16
    mesh = jaxring.make_mesh(sp=sp)
    # fp32: XLA:CPU widens bf16 collectives to f32, which would hide a 2-byte count
    q = jax.ShapeDtypeStruct((batch, seq, 4, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.float32)
    ring = _local_ring(mesh, layout=layout)
    chunk = batch * (seq // sp) * kv_heads * head_dim
    fwd = compile_stats(ring, q, kv, kv)
    assert fwd.collective_ops["collective-permute"] == 2 * (sp - 1)
    assert fwd.bytes_moved["collective-permute"] == 2 * (sp - 1) * chunk * 4  # K and V
    grad = lambda q, k, v: jax.grad(lambda *a: ring(*a).sum(), argnums=(0, 1, 2))(q, k, v)
    both = compile_stats(grad, q, kv, kv)
    # forward 2(P-1) K/V; backward 2(P-1) K/V again (not kept from the forward) + 2P fp32 dK/dV
    assert both.bytes_moved["collective-permute"] == 4 * (sp - 1) * chunk * 4 + 2 * sp * chunk * 4
    assert sum(both.bytes_moved.values()) - both.bytes_moved["collective-permute"] <= 16  # the loss psum


def _ring_grad_temp_bytes(sp, seq, block_ops="auto"):
    mesh = jaxring.make_mesh(sp=sp, dp=8 // sp)
    ring = _local_ring(mesh, layout="zigzag", block_ops=block_ops)
    grad = lambda q, k, v: jax.grad(lambda *a: ring(*a).sum(), argnums=(0, 1, 2))(q, k, v)
    q = jax.ShapeDtypeStruct((1, seq, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, 2, 16), jnp.float32)
    return compile_stats(grad, q, kv, kv).temp_bytes


def test_memory_is_linear_in_local_sequence():
    """Doubling the sequence at a fixed tile size doubles temp memory: no S² term."""
    tiles = functools.partial
    ops = BlockOps("jnp-16", tiles(block_forward, q_tile=16, kv_tile=16), tiles(block_backward, q_tile=16, kv_tile=16))
    temps = [_ring_grad_temp_bytes(8, seq, ops) for seq in (512, 1024)]
    assert temps[1] / temps[0] < 2.3, temps  # an S² term would give 4


def test_memory_does_not_grow_with_ring_length():
    """Same local length on 2 and 8 devices: the same memory, so no device keeps the other ranks' K/V."""
    two, eight = _ring_grad_temp_bytes(2, 2 * 128), _ring_grad_temp_bytes(8, 8 * 128)
    assert eight <= 1.1 * two, (two, eight)


def test_errors_name_the_value_and_rule():
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, _ = qkv(0, 1, 24, 4, 2, 8)
    with pytest.raises(ValueError, match="seq 24 is not divisible by 2\\*sp = 16"):
        jaxring.sharded_attention(q, k, v, mesh=mesh, layout="zigzag")
    with pytest.raises(ValueError, match="seq 20 is not divisible by sp = 8"):
        jaxring.sharded_attention(q[:, :20], k[:, :20], v[:, :20], mesh=mesh, layout="contiguous")
    q, k, v, _ = qkv(0, 1, 32, 4, 3, 8)
    with pytest.raises(ValueError, match="query heads 4 must be a multiple of key/value heads 3"):
        jaxring.sharded_attention(q, k, v, mesh=mesh)
    q, k, v, _ = qkv(0, 1, 32, 4, 2, 8)
    with pytest.raises(ValueError, match=r"unknown (attention )?strategy 'spiral'"):
        jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="spiral")
    with pytest.raises(ValueError, match="unknown layout 'diagonal'"):
        jaxring.sharded_attention(q, k, v, mesh=mesh, layout="diagonal")
    flat = jax.make_mesh((8,), ("data",))
    with pytest.raises(ValueError, match="mesh axes \\('data',\\) have no 'sp' axis"):
        jaxring.sharded_attention(q, k, v, mesh=flat)
    with pytest.raises(ValueError, match="q head_dim 8 and k head_dim 4 must match"):
        jaxring.sharded_attention(q, k[..., :4], v[..., :4], mesh=mesh)


def test_dense_strategy_is_the_reference():
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, _ = qkv(5, 1, 32, 4, 2, 8)
    out = jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="dense", causal=False)
    assert_close(out, jax.nn.dot_product_attention(q, k, v), 1e-5, "out")


@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("striped", False)])
def test_ring_with_the_pallas_kernel_interpreted(layout, causal):
    """The Pallas flash kernel's block entry points plugged into the ring (interpreted on CPU)."""
    mesh = jaxring.make_mesh(sp=4, dp=2)
    q, k, v, dout = qkv(6, 2, 64, 4, 2, 16)

    @jax.jit
    def run(q, k, v, dout):
        out, vjp = jax.vjp(
            lambda q, k, v: jaxring.sharded_attention(
                q, k, v, mesh=mesh, causal=causal, layout=layout, block_ops="pallas_interpret"
            ),
            q,
            k,
            v,
        )
        return out, vjp(dout)

    out_r, vjp_r = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=causal)[0], q, k, v)
    check(run(q, k, v, dout), (out_r, vjp_r(dout)), 2e-4)


@pytest.mark.parametrize("strategy,options", [("ring", {}), ("wallfacer", dict(team_size=2))])
def test_million_token_sequences_trace(strategy, options):
    """Blocks of more than 2³¹ query-key pairs: nothing may overflow int32 while tracing."""
    mesh = jaxring.make_mesh(sp=8)
    x = jax.ShapeDtypeStruct((1, 1 << 20, 2, 16), jnp.bfloat16)
    grad = jax.grad(
        lambda q, k, v: (
            jaxring.sharded_attention(q, k, v, mesh=mesh, strategy=strategy, **options).astype(jnp.float32).sum()
        )
    )
    assert jax.eval_shape(grad, x, x, x).shape == x.shape


def test_fused_sends_keep_each_arrays_varying_axes():
    """On a ring × tp mesh K/V vary over (sp, tp) (heads split over tp) and the segment ids over sp only: the
    fused sends (the GPU form) pack each set apart, so the ring's loop carries keep their types (one buffer for
    all made the ids vary over tp: "scan body function carry input and carry output must have equal types",
    found compiling sp4 × tp2 Megatron with packed documents for 8 H200s), and the results are the reference's."""
    sp, tp, seq, layout = 4, 2, 64, "zigzag"
    mesh = jaxring.make_mesh(sp=sp, tp=tp)
    q, k, v, dout = qkv(8, 1, seq, 4, 2, 8)
    seg = jnp.asarray(padded_segments(layout, seq, sp))[:1]
    spec, seg_spec = P(None, "sp", "tp", None), P(None, "sp")
    perm = jaxring.layout_permutation(layout, seq, sp)
    local = lambda q, k, v, s: ring_attention(q, k, v, s, layout=layout, fuse_sends=True)
    ring = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3 + (seg_spec,), out_specs=spec)
    laid = [x[:, perm] for x in (q, k, v)] + [seg[:, perm]]
    out, vjp = jax.jit(lambda *a: jax.vjp(lambda q, k, v: ring(q, k, v, a[3]), *a[:3]))(*laid)
    out_r, vjp_r = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=True, segment_ids=seg)[0], q, k, v)
    inv = np.argsort(perm)
    check((out[:, inv], tuple(g[:, inv] for g in vjp(dout[:, perm]))), (out_r, vjp_r(dout)), 2e-4)


@pytest.mark.heavy
def test_fused_sends_match_and_move_the_same_bytes():
    """fuse_sends=True (the GPU default: one packed buffer per hop) gives the reference results and moves the
    same bytes as one ppermute per array, in fewer collective-permutes."""
    sp, seq, layout = 8, 64, "zigzag"
    mesh = jaxring.make_mesh(sp=sp)
    q, k, v, dout = qkv(7, 1, seq, 2, 1, 8)
    seg = jnp.asarray(padded_segments(layout, seq, sp))[:1]
    spec, seg_spec = P(None, "sp", None, None), P(None, "sp")
    perm = jaxring.layout_permutation(layout, seq, sp)

    def ring(fuse):
        local = lambda q, k, v, s: ring_attention(q, k, v, s, layout=layout, fuse_sends=fuse)
        return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3 + (seg_spec,), out_specs=spec)

    laid = [x[:, perm] for x in (q, k, v)] + [seg[:, perm]]
    out, vjp = jax.jit(lambda *a: jax.vjp(lambda q, k, v: ring(True)(q, k, v, a[3]), *a[:3]))(*laid)
    out_r, vjp_r = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=True, segment_ids=seg)[0], q, k, v)
    inv = np.argsort(perm)
    check((out[:, inv], tuple(g[:, inv] for g in vjp(dout[:, perm]))), (out_r, vjp_r(dout)), 2e-4)
    struct = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in laid]
    loss = lambda fuse: lambda *a: jax.grad(lambda q, k, v: ring(fuse)(q, k, v, a[3]).sum(), argnums=(0, 1, 2))(*a[:3])
    fused, unfused = compile_stats(loss(True), *struct), compile_stats(loss(False), *struct)
    assert fused.bytes_moved == unfused.bytes_moved
    assert fused.collective_ops["collective-permute"] < unfused.collective_ops["collective-permute"]
