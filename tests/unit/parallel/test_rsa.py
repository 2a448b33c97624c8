"""Ring Self-Attention [RSA] against the dense reference: forward, dQ/dK/dV, bytes moved, memory, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, check, padded_segments, qkv
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring import attention_reference, layout_permutation
from jaxring.analysis import compile_stats
from jaxring.parallel.sequence.rsa import rsa_attention

SPEC = P(("dp", "fsdp"), "sp", None, None)
SEG_SPEC = P(("dp", "fsdp"), "sp")
MESHES = {"sp8": dict(sp=8), "dp2xsp4": dict(dp=2, sp=4)}


def _local_rsa(mesh, with_segments=False, **kw):
    """A jitted shard_map of rsa_attention on inputs already in the layout's order."""
    specs = (SPEC,) * 3 + ((SEG_SPEC,) if with_segments else ())
    return jax.jit(
        jax.shard_map(
            lambda q, k, v, *seg: rsa_attention(q, k, v, *seg, **kw), mesh=mesh, in_specs=specs, out_specs=SPEC
        )
    )


def rsa_and_reference(mesh, q, k, v, dout, *, causal, layout, segment_ids=None):
    """(out, grads) of RSA and of the reference, on global arrays in natural order, in one jitted program.

    RSA gets its inputs permuted into the layout (`layout_permutation`) and its output permuted back; the
    VJP goes through the permutations, so its gradients are in natural order too.
    """
    sp = mesh.shape["sp"]
    perm = layout_permutation(layout, q.shape[1], sp)
    inv = np.argsort(perm)
    with_seg = segment_ids is not None
    local = _local_rsa(mesh, with_seg, layout=layout, causal=causal)
    seg = (segment_ids[:, perm],) if with_seg else ()

    def rsa(q, k, v):
        return local(q[:, perm], k[:, perm], v[:, perm], *seg)[:, inv]

    def ref(q, k, v):
        return attention_reference(q, k, v, causal=causal, segment_ids=segment_ids)[0]

    @jax.jit
    def run(q, k, v, dout):
        def both(fn):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(dout)

        return both(rsa), both(ref)

    return run(q, k, v, dout)


@pytest.mark.parametrize(
    "mesh_name,layout,causal,q_heads,kv_heads,head_dim",
    [
        ("sp8", "contiguous", True, 4, 2, 32),
        ("sp8", "zigzag", False, 4, 2, 64),
        ("sp8", "striped", True, 4, 1, 32),
        ("dp2xsp4", "zigzag", True, 4, 2, 64),
        ("dp2xsp4", "contiguous", False, 4, 4, 32),
    ],
    ids=[
        "sp8-contiguous-causal-gqa-d32",
        "sp8-zigzag-full-gqa-d64",
        "sp8-striped-causal-mqa-d32",
        "dp2xsp4-zigzag-causal-gqa-d64",
        "dp2xsp4-contiguous-full-mha-d32",
    ],
)
def test_matches_reference(mesh_name, layout, causal, q_heads, kv_heads, head_dim):
    kw = MESHES[mesh_name]
    mesh = jaxring.make_mesh(**kw)
    q, k, v, dout = qkv(hash((mesh_name, layout, causal)) % 1000, 2, 32, q_heads, kv_heads, head_dim)
    check(*rsa_and_reference(mesh, q, k, v, dout, causal=causal, layout=layout))


def test_matches_jax_nn():
    mesh = jaxring.make_mesh(dp=2, sp=4)
    q, k, v, dout = qkv(7, 2, 32, 4, 2, 32)
    got, _ = rsa_and_reference(mesh, q, k, v, dout, causal=True, layout="zigzag")
    out_nn, vjp_nn = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), q, k, v)
    check(got, (out_nn, vjp_nn(dout)))


def test_bf16_inputs_accumulate_in_fp32():
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, dout = qkv(2, 1, 64, 4, 2, 32, dtype=jnp.bfloat16)
    (out, grads), _ = rsa_and_reference(mesh, q, k, v, dout, causal=True, layout="zigzag")
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    f32 = lambda x: x.astype(jnp.float32)
    out_r, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=True)[0], f32(q), f32(k), f32(v))
    check((out, grads), (out_r, vjp(f32(dout))), 2e-2)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_segments_with_padding_and_an_all_padding_device(layout):
    sp, seq = 8, 32
    mesh = jaxring.make_mesh(sp=sp)
    seg = padded_segments(layout, seq, sp)
    q, k, v, dout = qkv(3, 2, seq, 4, 2, 32)
    got, ref = rsa_and_reference(mesh, q, k, v, dout, causal=True, layout=layout, segment_ids=jnp.asarray(seg))
    check(got, ref)
    out, grads = got
    assert np.all(np.asarray(out)[seg == 0] == 0)
    assert all(np.all(np.asarray(g)[seg == 0] == 0) for g in grads)


def test_all_padding_gives_zeros_and_no_nan():
    """Every row fully masked: output 0 and gradients 0 (assert_close also checks everything is finite)."""
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, dout = qkv(4, 1, 32, 4, 2, 32)
    seg = jnp.zeros((1, 32), jnp.int32)
    (out, grads), _ = rsa_and_reference(
        mesh, q, k, v, dout, causal=False, layout="contiguous", segment_ids=jnp.asarray(seg)
    )
    for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert_close(x, jnp.zeros_like(x), 0.0, name)


def test_bytes_moved_match_the_paper_formula():
    """Per device, at fp32 (XLA:CPU widens bf16 collectives), sp N = 8, B = 2, L = 64, Hkv = 2, D = 32.

    One K or V chunk: c = B·(L/N)·Hkv·D = 2·8·2·32 = 1024 elements = 4096 bytes.
    Forward: two ring passes of N-1 hops (K, then V): 2(N-1)·c·4 = 14·4096 = 57344 bytes of collective-permute.
    Backward: the paper's two ring-style P2P (V, K) = 14·4096 = 57344 bytes; its two all-reduces of the
    [B, L, Hkv, D] dK/dV partials done as reduce-scatters: 2(N-1)·c·4 = 57344 bytes.
    """
    mesh = jaxring.make_mesh(sp=8)
    q = jax.ShapeDtypeStruct((2, 64, 4, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 64, 2, 32), jnp.float32)
    rsa = _local_rsa(mesh, layout="zigzag", causal=True)

    fwd = compile_stats(rsa, q, kv, kv)
    assert fwd.collective_ops["collective-permute"] == 14
    assert fwd.bytes_moved["collective-permute"] == 57344
    assert fwd.total_bytes_moved == 57344

    # value_and_grad: with jax.grad alone XLA drops pass 2 (the output itself is then unused)
    grad = lambda q, k, v: jax.value_and_grad(lambda *a: rsa(*a).sum(), argnums=(0, 1, 2))(q, k, v)
    both = compile_stats(grad, q, kv, kv)
    assert both.bytes_moved["collective-permute"] == 57344 + 57344  # no forward ring is re-run
    assert both.collective_ops["collective-permute"] == 28
    assert both.bytes_moved["reduce-scatter"] == 57344
    assert both.collective_ops["reduce-scatter"] == 2
    assert both.bytes_moved["all-gather"] == both.bytes_moved["all-to-all"] == 0
    assert both.bytes_moved["all-reduce"] <= 16  # only the scalar loss

    # segment ids ride with K in pass 1 only: + (N-1)·B·(L/N) int32 = 7·2·8·4 = 448 bytes; backward needs none
    seg = jax.ShapeDtypeStruct((2, 64), jnp.int32)
    rsa_seg = _local_rsa(mesh, with_segments=True, layout="zigzag", causal=True)
    assert compile_stats(rsa_seg, q, kv, kv, seg).bytes_moved["collective-permute"] == 57344 + 448
    grad_seg = lambda q, k, v, s: jax.value_and_grad(lambda *a: rsa_seg(*a, s).sum(), argnums=(0, 1, 2))(q, k, v)
    both_seg = compile_stats(grad_seg, q, kv, kv, seg)
    assert both_seg.bytes_moved["collective-permute"] == 57344 + 448 + 57344
    assert both_seg.bytes_moved["reduce-scatter"] == 57344


def _forward_temp_bytes(seq):
    mesh = jaxring.make_mesh(sp=8)
    q = jax.ShapeDtypeStruct((1, seq, 2, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, 2, 16), jnp.float32)
    return compile_stats(_local_rsa(mesh, layout="contiguous", causal=True), q, kv, kv).temp_bytes


def test_scores_are_materialised_memory_grows_as_l_squared():
    """RSA keeps the (B, H, L/N, L) score block: doubling L at fixed N multiplies temp memory by ~4."""
    small, large = _forward_temp_bytes(512), _forward_temp_bytes(1024)
    score_block = 1 * 2 * (512 // 8) * 512 * 4
    assert small >= score_block, (small, score_block)
    assert 3.5 <= large / small <= 4.5, (small, large)


def test_errors_name_the_value_and_rule():
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, _ = qkv(0, 1, 24, 4, 2, 8)
    with pytest.raises(ValueError, match="seq 24 is not divisible by 2\\*sp = 16, needed by the zigzag layout"):
        _local_rsa(mesh, layout="zigzag")(q, k, v)
    with pytest.raises(ValueError, match="seq 24 is not divisible by 2\\*sp = 16"):
        layout_permutation("zigzag", 24, 8)
    with pytest.raises(ValueError, match="seq 20 is not divisible by sp = 8"):
        layout_permutation("contiguous", 20, 8)
    with pytest.raises(ValueError, match="unknown layout 'diagonal'"):
        _local_rsa(mesh, layout="diagonal")(q, k, v)
    q, k, v, _ = qkv(0, 1, 32, 4, 3, 8)
    with pytest.raises(ValueError, match="query heads 4 must be a multiple of key/value heads 3"):
        _local_rsa(mesh)(q, k, v)
    q, k, v, _ = qkv(0, 1, 32, 4, 2, 8)
    with pytest.raises(ValueError, match="q head_dim 8 and k head_dim 4 must match"):
        _local_rsa(mesh)(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="k/v local seq 2 must equal q local seq 4"):
        _local_rsa(mesh)(q, k[:, :16], v[:, :16])
