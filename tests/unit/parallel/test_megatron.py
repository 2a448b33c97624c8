"""Megatron TP+SP (jaxring.parallel.tensor.megatron) against unsharded jnp references: forward and every gradient;
communication counted on the compiled program; saved residuals of the gather-recompute column-linear."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_close, attention_block_reference, mlp_block_reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring.analysis import compile_stats
from jaxring.parallel.tensor import megatron_api as mt
from jaxring.parallel.tensor import megatron_layers

B, S, H, FFN, VOCAB, HEADS, HEAD_DIM = 4, 16, 32, 64, 64, 8, 4
RTOL = 1e-4

MESHES = {"dp2-fsdp2-tp2": dict(dp=2, fsdp=2, tp=2), "tp4": dict(tp=4), "tp8": dict(tp=8), "dp2-tp4": dict(dp=2, tp=4)}


@functools.cache
def mesh_of(name):
    kw = MESHES[name]
    n = int(np.prod(list(kw.values())))
    return jaxring.make_mesh(**kw, devices=jax.devices()[:n])


def normal(seed, shape, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def check_all(got, ref, rtol=RTOL, name=""):
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        r = functools.reduce(lambda t, k: t[k.key if hasattr(k, "key") else k.idx], path, ref)
        assert_close(g, r, rtol, name + jax.tree_util.keystr(path))


def out_and_grads(fn, args, cotangent):
    @jax.jit
    def run(args, ct):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(ct)

    return run(args, cotangent)


# ------------------------------------------------------------------------------------------------------
# References (one device, the contract's formulas)
# ------------------------------------------------------------------------------------------------------


def mlp_params(activation, h=H, ffn=FFN):
    p = {"w_in": normal(1, (h, ffn), h**-0.5), "w_out": normal(2, (ffn, h), ffn**-0.5)}
    if activation == "swiglu":
        p["w_gate"] = normal(3, (h, ffn), h**-0.5)
    return p


def attention_params(num_heads, num_kv_heads, h=H, d=HEAD_DIM):
    return {
        "wq": normal(4, (h, num_heads * d), h**-0.5),
        "wk": normal(5, (h, num_kv_heads * d), h**-0.5),
        "wv": normal(6, (h, num_kv_heads * d), h**-0.5),
        "wo": normal(7, (num_heads * d, h), 0.3),
    }


def shuffled_positions(b=B, s=S):
    """Row 0 in order, the others permuted and offset: the causal mask must follow the positions."""
    rows = [np.arange(s)] + [np.random.default_rng(r).permutation(s) + 5 * r for r in range(1, b)]
    return jnp.asarray(np.stack(rows), jnp.int32)


# ------------------------------------------------------------------------------------------------------
# Contract blocks: forward and grads of x and every weight
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh_name,activation",
    [("dp2-fsdp2-tp2", "gelu"), ("tp4", "swiglu"), ("tp8", "gelu"), ("dp2-tp4", "gelu"), ("dp2-tp4", "swiglu")],
)
def test_mlp_block(mesh_name, activation):
    mesh = mesh_of(mesh_name)
    x, dy, p = normal(10, (B, S, H)), normal(11, (B, S, H)), mlp_params(activation)
    got = out_and_grads(lambda x, p: mt.mlp_block(x, p, mesh=mesh, activation=activation), (x, p), dy)
    ref = out_and_grads(lambda x, p: mlp_block_reference(x, p, activation), (x, p), dy)
    check_all(got, ref)


ATTENTION_CASES = [  # mesh, q heads, kv heads, causal, rope
    ("dp2-fsdp2-tp2", 8, 8, True, 10000.0),
    ("tp4", 8, 4, True, 10000.0),  # GQA, 2 q heads and 1 kv head per rank
    ("tp8", 8, 2, True, 500.0),  # kv heads < tp: each kv head replicated on 4 ranks
    ("dp2-tp4", 8, 1, False, None),  # MQA (replicated), full attention, no RoPE
]


@pytest.mark.parametrize("mesh_name,num_heads,num_kv_heads,causal,rope_theta", ATTENTION_CASES)
def test_attention_block(mesh_name, num_heads, num_kv_heads, causal, rope_theta):
    mesh = mesh_of(mesh_name)
    x, dy, pos = normal(12, (B, S, H)), normal(13, (B, S, H)), shuffled_positions()
    p = attention_params(num_heads, num_kv_heads)
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, causal=causal, rope_theta=rope_theta)
    got = out_and_grads(lambda x, p: mt.attention_block(x, p, pos, mesh=mesh, **kw), (x, p), dy)
    ref = out_and_grads(
        lambda x, p: attention_block_reference(x, p, pos, num_heads, num_kv_heads, causal, rope_theta), (x, p), dy
    )
    check_all(got, ref)


@pytest.mark.parametrize("mesh_name", ["dp2-tp4", "tp8"])
def test_norms_in_sequence_parallel_region(mesh_name):
    """LayerNorm and RMSNorm on sequence shards: dgamma/dbeta are the sums over every shard (psum over tp and
    the data axes), and equal the unsharded reference; the plain-TP region (x replicated) sums nothing."""
    mesh = mesh_of(mesh_name)
    data = ("dp", "fsdp")
    x = normal(14, (B, S, H), 2.0)
    params = {"gamma": normal(15, (H,), 0.1), "beta": normal(16, (H,), 0.1), "scale": normal(17, (H,), 0.1)}
    params = {k: v + 1 if k != "beta" else v for k, v in params.items()}
    cts = (normal(18, (B, S, H)), normal(19, (B, S, H)), normal(20, (B, S, H)))

    def norms(x, p):
        return (
            megatron_layers.layer_norm(x, p["gamma"], p["beta"]),
            megatron_layers.rms_norm(x, p["scale"]),
            megatron_layers.layer_norm(x, p["gamma"]),
        )

    def sharded(x, p):
        sp_out = jax.shard_map(norms, mesh=mesh, in_specs=(P(data, "tp", None), P()), out_specs=P(data, "tp", None))(
            x, p
        )
        tp_out = jax.shard_map(
            lambda x, p: norms(x, p)[0], mesh=mesh, in_specs=(P(data, None, None), P()), out_specs=P(data, None, None)
        )(x, p)  # plain TP: x replicated over tp
        return sp_out + (tp_out,)

    def reference(x, p):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        ln = (x - mean) / jnp.sqrt(var + 1e-5) * p["gamma"]
        rms = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["scale"]
        return ln + p["beta"], rms, ln, ln + p["beta"]

    ct = cts + (cts[0],)
    got = out_and_grads(sharded, (x, params), ct)
    ref = out_and_grads(reference, (x, params), ct)
    check_all(got, ref)


@pytest.mark.parametrize("mesh_name", ["dp2-fsdp2-tp2", "tp8"])
def test_vocab_parallel_embedding_and_cross_entropy(mesh_name):
    mesh = mesh_of(mesh_name)
    tokens = jnp.asarray(np.random.default_rng(21).integers(0, VOCAB, (B, S)), jnp.int32)
    targets = jnp.asarray(np.random.default_rng(22).integers(0, VOCAB, (B, S)), jnp.int32)
    table, w_head = normal(23, (VOCAB, H)), normal(24, (H, VOCAB), 0.5)
    x, d_emb, d_loss = normal(25, (B, S, H)), normal(26, (B, S, H)), normal(27, (B, S))

    def sharded(table, x, w_head):
        return mt.embed(tokens, table, mesh=mesh), mt.cross_entropy(x, w_head, targets, mesh=mesh)

    def reference(table, x, w_head):
        return table[tokens], optax.softmax_cross_entropy_with_integer_labels(x @ w_head, targets)

    got = out_and_grads(sharded, (table, x, w_head), (d_emb, d_loss))
    ref = out_and_grads(reference, (table, x, w_head), (d_emb, d_loss))
    assert got[0][1].dtype == jnp.float32 and got[0][1].shape == (B, S)
    check_all(got, ref)
    # the sequence-parallel output really is sequence-sharded over tp
    assert got[0][0].sharding.spec[1] == "tp"


def test_plain_tensor_parallel_mlp_f_and_f_star():
    """sequence_parallel=False: f (identity / all-reduce) and f* (all-reduce / identity) on replicated x."""
    mesh = mesh_of("dp2-tp4")
    x, dy, p = normal(28, (B, S, H)), normal(29, (B, S, H)), mlp_params("swiglu")
    local = lambda x, w_in, w_gate, w_out: megatron_layers.mlp(
        x, w_in, w_out, w_gate, activation="swiglu", sequence_parallel=False
    )
    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(P("dp"), P(None, "tp"), P(None, "tp"), P("tp", None)), out_specs=P("dp")
    )
    got = out_and_grads(lambda x, p: fn(x, p["w_in"], p["w_gate"], p["w_out"]), (x, p), dy)
    check_all(got, out_and_grads(lambda x, p: mlp_block_reference(x, p, "swiglu"), (x, p), dy))


# ------------------------------------------------------------------------------------------------------
# Communication (fp32, per device, elements received as jaxring.analysis counts them)
# ------------------------------------------------------------------------------------------------------
# compile_stats counts the bytes a device receives: an all-gather with per-device result |y| = b·s·h
# elements moves (p-1)/p·|y|; a reduce-scatter with per-device result b·(s/p)·h moves (p-1)·|y| = (p-1)/p·bsh.
# So each transition g or g* of a [b, s, h] activation moves (p-1)/p·bsh elements, 4 bytes each in fp32.


def _fwd_and_bwd(fn):
    def run(x, p, dy):
        y, vjp = jax.vjp(fn, x, p)
        return y, vjp(dy)

    return run


def _tp4_stats(fn, x, p, backward):
    mesh = mesh_of("tp4")
    f = lambda x, p: fn(x, p, mesh)
    sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    if backward:
        return compile_stats(_fwd_and_bwd(f), sds(x), jax.tree.map(sds, p), sds(x), num_devices=4)
    return compile_stats(f, sds(x), jax.tree.map(sds, p), num_devices=4)


def test_ffn_moves_two_transitions_forward_five_with_backward():
    p_, b, s, h = 4, 2, 16, 32
    x, p = normal(30, (b, s, h)), mlp_params("gelu", h, 4 * h)
    unit = (p_ - 1) / p_ * b * s * h * 4  # one transition, bytes
    fwd = _tp4_stats(lambda x, p, mesh: mt.mlp_block(x, p, mesh=mesh), x, p, backward=False)
    assert fwd.bytes_moved == {
        "collective-permute": 0,
        "all-gather": unit,
        "reduce-scatter": unit,
        "all-to-all": 0,
        "all-reduce": 0,
    }
    both = _tp4_stats(lambda x, p, mesh: mt.mlp_block(x, p, mesh=mesh), x, p, backward=True)
    # forward AG(X) + RS(O); backward AG(dO) + AG(X) again + RS(dY): 5 (p-1)/p·bsh
    assert both.collective_ops["all-gather"] == 3 and both.collective_ops["reduce-scatter"] == 2
    assert both.bytes_moved["all-gather"] == 3 * unit and both.bytes_moved["reduce-scatter"] == 2 * unit
    assert both.total_bytes_moved == 5 * (p_ - 1) / p_ * b * s * h * 4 == 15360

    # plain TP for comparison: f* forward and f backward, one all-reduce each, 2 (p-1)/p·bsh apiece
    mesh = mesh_of("tp4")
    local = lambda x, w_in, w_out: megatron_layers.mlp(x, w_in, w_out, sequence_parallel=False)
    tp = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp", None)), out_specs=P())
    plain = _tp4_stats(lambda x, p, mesh: tp(x, p["w_in"], p["w_out"]), x, p, backward=True)
    assert plain.bytes_moved["all-reduce"] == 4 * unit == plain.total_bytes_moved


def test_attention_block_moves_five_transitions_and_the_positions():
    p_, b, s, h = 4, 2, 16, 32
    x, p = normal(31, (b, s, h)), attention_params(8, 4, h)
    pos = jnp.tile(jnp.arange(s, dtype=jnp.int32), (b, 1))
    block = lambda x, p, mesh: mt.attention_block(x, p, pos, mesh=mesh, num_heads=8, num_kv_heads=4)
    unit = (p_ - 1) / p_ * b * s * h * 4
    positions = (p_ - 1) / p_ * b * s * 4  # int32 positions gathered once
    fwd = _tp4_stats(block, x, p, backward=False)
    assert fwd.bytes_moved["all-gather"] == unit + positions and fwd.bytes_moved["reduce-scatter"] == unit
    both = _tp4_stats(block, x, p, backward=True)
    assert both.bytes_moved["all-gather"] == 3 * unit + positions
    assert both.bytes_moved["reduce-scatter"] == 2 * unit
    assert both.total_bytes_moved == 5 * unit + positions


# ------------------------------------------------------------------------------------------------------
# Memory after forward: what the column-linear with gather saves
# ------------------------------------------------------------------------------------------------------


def test_ffn_saves_the_local_shard_not_the_gathered_input():
    """Residuals of jax.vjp (what stays alive from forward to backward), per device: the gather-recompute
    custom_vjp keeps X_i [b, s/p, h], the pre-activation [b, s, ffn/p] and the weight shards — 5bsh/p
    activations at ffn = 4h (METP Table 1); plain autodiff would keep the gathered X [b, s, h] instead."""
    p_, b, s, h = 4, 2, 16, 32
    ffn = 4 * h
    mesh = mesh_of("tp4")
    specs = (P(None, "tp", None), {"w_in": P(None, "tp"), "w_out": P("tp", None)})
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    # placed as the block takes them, so saved inputs count as their shards
    x, p = jax.tree.map(put, (normal(32, (b, s, h)), mlp_params("gelu", h, ffn)), specs)

    def residual_bytes(recompute_gather):
        local = lambda x, w_in, w_out: megatron_layers.mlp(x, w_in, w_out, recompute_gather=recompute_gather)
        fn = jax.shard_map(
            local, mesh=mesh, in_specs=(specs[0], specs[1]["w_in"], specs[1]["w_out"]), out_specs=specs[0]
        )
        res = jax.jit(lambda x, p: jax.vjp(lambda x, p: fn(x, p["w_in"], p["w_out"]), x, p)[1])(x, p)
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(res))

    weights = 2 * h * ffn // p_
    assert residual_bytes(True) == 4 * (b * s * h // p_ + b * s * ffn // p_ + weights)
    assert b * s * h // p_ + b * s * ffn // p_ == 5 * b * s * h // p_
    assert residual_bytes(False) == 4 * (b * s * h + b * s * ffn // p_ + weights)


# ------------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------------


def test_errors_name_the_values():
    mesh = mesh_of("tp4")
    x, pos = jnp.zeros((2, 16, 32)), jnp.zeros((2, 16), jnp.int32)
    with pytest.raises(ValueError, match="seq 14 is not divisible by tp = 4"):
        mt.mlp_block(jnp.zeros((2, 14, 32)), mlp_params("gelu"), mesh=mesh)
    with pytest.raises(ValueError, match="ffn 66 is not divisible by tp = 4"):
        mt.mlp_block(x, mlp_params("gelu", 32, 66), mesh=mesh)
    with pytest.raises(ValueError, match="w_gate"):
        mt.mlp_block(x, mlp_params("gelu"), mesh=mesh, activation="swiglu")
    with pytest.raises(ValueError, match="activation 'relu'"):
        mt.mlp_block(x, mlp_params("gelu"), mesh=mesh, activation="relu")
    with pytest.raises(ValueError, match="num_heads 6 is not divisible by tp = 4"):
        mt.attention_block(x, attention_params(6, 6), pos, mesh=mesh, num_heads=6, num_kv_heads=6)
    with pytest.raises(ValueError, match="num_kv_heads 6 is not divisible by tp = 4"):
        mt.attention_block(x, attention_params(12, 6), pos, mesh=mesh, num_heads=12, num_kv_heads=6)
    with pytest.raises(ValueError, match="num_kv_heads 3 < tp = 4 must divide tp"):
        mt.attention_block(x, attention_params(12, 3), pos, mesh=mesh, num_heads=12, num_kv_heads=3)
    with pytest.raises(ValueError, match="vocab 30 is not divisible by tp = 4"):
        mt.embed(jnp.zeros((2, 16), jnp.int32), jnp.zeros((30, 32)), mesh=mesh)
    with pytest.raises(ValueError, match="vocab 30 is not divisible by tp = 4"):
        mt.cross_entropy(x, jnp.zeros((32, 30)), jnp.zeros((2, 16), jnp.int32), mesh=mesh)
    with pytest.raises(ValueError, match="batch 3 is not divisible by the data-parallel degree dp\\*fsdp = 2"):
        mt.mlp_block(jnp.zeros((3, 16, 32)), mlp_params("gelu"), mesh=mesh_of("dp2-tp4"))
    with pytest.raises(ValueError, match="sp=2 cannot be used by Megatron"):
        mt.mlp_block(x, mlp_params("gelu"), mesh=jaxring.make_mesh(sp=2, tp=4))


def test_param_specs():
    mesh = mesh_of("tp4")
    shapes = {**mlp_params("swiglu"), **attention_params(8, 2), "table": (64, 32), "w_head": (32, 64), "gamma": (32,)}
    specs = mt.param_specs(mesh, shapes, num_kv_heads=2)
    assert {k: tuple(v.spec) for k, v in specs.items()} == {
        "w_in": (None, "tp"),
        "w_gate": (None, "tp"),
        "w_out": ("tp", None),
        "wq": (None, "tp"),
        "wk": (),
        "wv": (),
        "wo": ("tp", None),
        "table": ("tp", None),
        "w_head": (None, "tp"),
        "gamma": (),
    }
    assert tuple(mt.param_specs(mesh, attention_params(8, 4))["wk"].spec) == (None, "tp")
    with pytest.raises(ValueError, match="unknown Megatron parameter names \\['bias'\\]"):
        mt.param_specs(mesh, {"bias": (32,)})
