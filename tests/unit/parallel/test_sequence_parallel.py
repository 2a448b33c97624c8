"""Every strategy through sharded_attention against the dense reference; Ulysses, all-gather and USP traffic."""

import functools

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_close, check, qkv, with_reference
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring import attention_reference
from jaxring.analysis import compile_stats
from jaxring.parallel.sequence.allgather import allgather_attention
from jaxring.parallel.sequence.ulysses import ulysses_attention
from jaxring.parallel.sequence.usp import usp_attention

CASES = [  # strategy, options, mesh, layout, causal, q heads, kv heads, head dim
    ("ulysses", {}, dict(sp=8), "zigzag", True, 8, 2, 32),  # GQA, kv heads < P: repeated as needed
    ("ulysses", {}, dict(dp=2, sp=4), "contiguous", False, 4, 4, 64),
    ("ulysses", {}, dict(sp=8), "striped", True, 8, 1, 32),  # MQA
    ("allgather", {}, dict(sp=8), "zigzag", True, 4, 2, 32),
    ("allgather", {}, dict(dp=2, sp=4), "striped", False, 4, 1, 64),
    ("usp", dict(ulysses_size=2), dict(sp=8), "zigzag", True, 4, 2, 32),
    ("usp", dict(ulysses_size=4), dict(dp=2, sp=4), "zigzag", True, 8, 2, 64),
    ("usp", dict(ulysses_size=2), dict(dp=2, sp=4), "contiguous", False, 4, 4, 32),
    ("rsa", {}, dict(sp=8), "zigzag", True, 4, 2, 32),
    ("wallfacer", dict(team_size=2, placement="ring_inner"), dict(sp=8), "zigzag", True, 4, 2, 64),
]


@pytest.mark.parametrize(
    "strategy,options,mesh_kw,layout,causal,q_heads,kv_heads,head_dim",
    CASES,
    ids=[
        f"{c[0]}-{'x'.join(f'{k}{v}' for k, v in c[2].items())}-{c[3]}-"
        f"{'causal' if c[4] else 'full'}-{c[5]}/{c[6]}-d{c[7]}"
        for c in CASES
    ],
)
def test_matches_reference(strategy, options, mesh_kw, layout, causal, q_heads, kv_heads, head_dim):
    mesh = jaxring.make_mesh(**mesh_kw)
    q, k, v, dout = qkv(7, 2, 64, q_heads, kv_heads, head_dim)

    sharded = lambda q, k, v: jaxring.sharded_attention(
        q, k, v, mesh=mesh, strategy=strategy, causal=causal, layout=layout, **options
    )
    check(*with_reference(sharded, q, k, v, dout, causal=causal))


def test_segments_with_padding():
    mesh = jaxring.make_mesh(sp=4, dp=2)
    q, k, v, _ = qkv(8, 2, 32, 4, 2, 16)
    seg = jnp.array([[1] * 12 + [2] * 14 + [0] * 6, [3] * 32])
    expected = attention_reference(q, k, v, causal=True, segment_ids=seg)[0]
    for strategy, options in (
        ("ulysses", {}),
        ("allgather", {}),
        ("usp", dict(ulysses_size=2)),
        ("rsa", {}),
        ("wallfacer", dict(team_size=2)),
    ):
        out = jaxring.sharded_attention(q, k, v, mesh=mesh, strategy=strategy, segment_ids=seg, **options)
        assert_close(out, expected, 2e-4, strategy)


# Traffic, per device, from the compiled program (fp32: XLA:CPU widens bf16 collectives).
B, S, HQ, D = 1, 256, 8, 16


def _stats(local, mesh, seq_spec, kv_heads, backward, seq=S):
    spec = P(None, seq_spec, None, None)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    q = jax.ShapeDtypeStruct((B, seq, HQ, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, seq, kv_heads, D), jnp.float32)
    if not backward:
        return compile_stats(fn, q, kv, kv)

    # the output is used and the cotangent is an argument, as in a training step (XLA would drop the output
    # all-to-all of an unused output, and fold the transpose of a constant cotangent)
    def out_and_grads(q, k, v, dout):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(dout)

    return compile_stats(out_and_grads, q, kv, kv, q)


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_ulysses_moves_four_all_to_alls_forward_eight_with_backward(kv_heads):
    p = 8
    mesh = jaxring.make_mesh(sp=p)
    local = functools.partial(ulysses_attention, layout="contiguous", causal=True)
    kv_sent = max(kv_heads, p)  # K/V heads repeated only up to lcm(kv_heads, P) = 8 here
    one_pass = (p - 1) / p * 4 * B * (S // p) * D * (HQ + kv_sent + kv_sent + HQ)  # q, k, v, out
    fwd = _stats(local, mesh, "sp", kv_heads, backward=False)
    assert fwd.collective_ops["all-to-all"] == 4
    assert fwd.bytes_moved["all-to-all"] == one_pass
    both = _stats(local, mesh, "sp", kv_heads, backward=True)
    assert both.collective_ops["all-to-all"] == 8
    assert both.bytes_moved["all-to-all"] == 2 * one_pass
    assert both.bytes_moved["collective-permute"] == 0


def test_allgather_gathers_kv_and_reduce_scatters_their_gradients():
    p, kv_heads = 8, 2
    mesh = jaxring.make_mesh(sp=p)
    local = functools.partial(allgather_attention, layout="contiguous", causal=True)
    kv_block = 4 * B * (S // p) * kv_heads * D
    fwd = _stats(local, mesh, "sp", kv_heads, backward=False)
    assert fwd.bytes_moved["all-gather"] == 2 * (p - 1) * kv_block
    both = _stats(local, mesh, "sp", kv_heads, backward=True)
    assert both.bytes_moved["reduce-scatter"] == 2 * (p - 1) * kv_block
    assert both.bytes_moved["all-gather"] == 2 * (p - 1) * kv_block  # not gathered again: kept from forward


def test_usp_traffic_is_ulysses_over_u_plus_ring_over_r():
    u, r, kv_heads = 2, 4, 2
    mesh = jaxring.factored_mesh(jaxring.make_mesh(sp=u * r), "sp", ("ring", "uly"), (r, u))
    local = functools.partial(usp_attention, axis_name=("ring", "uly"), layout="zigzag")
    n = S // (u * r)
    all_to_all = (u - 1) / u * 4 * B * n * D * (HQ + 2 * kv_heads + HQ)
    kv_block = 4 * B * (n * u) * (kv_heads // u) * D  # after the all-to-all: u times the tokens, 1/u the heads
    fwd = _stats(local, mesh, ("ring", "uly"), kv_heads, backward=False)
    assert fwd.bytes_moved["all-to-all"] == all_to_all
    assert fwd.bytes_moved["collective-permute"] == 2 * (r - 1) * kv_block
    both = _stats(local, mesh, ("ring", "uly"), kv_heads, backward=True)
    assert both.bytes_moved["all-to-all"] == 2 * all_to_all
    assert both.bytes_moved["collective-permute"] == 4 * (r - 1) * kv_block + 2 * r * kv_block


def test_allgather_memory_grows_with_devices_ring_does_not():
    """Same local length on 2 and 8 devices: all-gather keeps S tokens of K/V, the ring one block."""

    def temp(local, p, local_len=64):
        mesh = jaxring.make_mesh(sp=p, dp=8 // p)
        local = functools.partial(local, layout="contiguous", causal=False)
        return _stats(local, mesh, "sp", 8, backward=True, seq=p * local_len).temp_bytes

    assert temp(allgather_attention, 8) > 2 * temp(allgather_attention, 2)
    assert temp(jaxring.ring_attention, 8) <= 1.1 * temp(jaxring.ring_attention, 2)


def test_errors():
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, _ = qkv(0, 1, 64, 4, 2, 8)
    with pytest.raises(ValueError, match="query heads 4 are not divisible by the Ulysses degree sp = 8"):
        jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="ulysses")
    with pytest.raises(ValueError, match="ulysses_size U=3 must be a positive integer dividing sp = 8"):
        jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="usp", ulysses_size=3)
    with pytest.raises(ValueError, match="strategy 'usp' needs ulysses_size"):
        jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="usp")
    with pytest.raises(ValueError, match="strategy 'ring' takes no option ulysses_size"):
        jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="ring", ulysses_size=2)
    with pytest.raises(ValueError, match="block_ops 'jnp': rsa materialises its score rows"):
        jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="rsa", block_ops="jnp")
    with pytest.raises(ValueError, match="strategy 'wallfacer' takes no option ulysses_size"):
        jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="wallfacer", team_size=2, ulysses_size=2)
    with pytest.raises(ValueError, match="query heads 4 are not divisible by the Ulysses degree ulysses_size = 8"):
        jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="usp", ulysses_size=8)
    with pytest.raises(ValueError, match="q, k, v dtypes float32, bfloat16, float32 must be the same"):
        jaxring.sharded_attention(q, k.astype(jnp.bfloat16), v, mesh=mesh)
    with pytest.raises(ValueError, match="q, k, v dtype int32 is not supported"):
        jaxring.sharded_attention(*(x.astype(jnp.int32) for x in (q, k, v)), mesh=mesh)
    with pytest.raises(ValueError, match="causal 'yes' must be True or False"):
        jaxring.sharded_attention(q, k, v, mesh=mesh, causal="yes")


@pytest.mark.parametrize(
    "strategy,options", [("ring", {}), ("ulysses", {}), ("usp", {"ulysses_size": 2}), ("wallfacer", {"team_size": 2})]
)
def test_laid_out_tokens_need_no_relayout(strategy, options):
    """Tokens laid out once on the data side (as the models do) give the laid-out rows of the natural output."""
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, _ = qkv(3, 1, 64, 8, 8, 16) if strategy != "ring" else qkv(3, 1, 64, 8, 2, 16)
    perm = jaxring.layout_permutation("zigzag", 64, 8)
    natural = jaxring.sharded_attention(q, k, v, mesh=mesh, strategy=strategy, layout="zigzag", **options)
    laid = jaxring.sharded_attention(
        q[:, perm], k[:, perm], v[:, perm], mesh=mesh, strategy=strategy, layout="zigzag", laid_out=True, **options
    )
    assert_close(laid, natural[:, perm], 1e-5, strategy)
