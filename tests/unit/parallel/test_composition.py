"""Tensor × sequence parallelism in one shard_map: jaxring.nn blocks under Megatron over tp with every sequence
strategy over sp, forward and every gradient against the dense single-device reference; the bytes of a tp×sp
layer are Megatron's plus the ring's; the registry's refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, attention_block_reference, mlp_block_reference
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring.analysis import compile_stats
from jaxring.nn import MLP, Attention, param_placements
from jaxring.parallel.plan import ParallelPlan
from jaxring.parallel.registry import sequence_strategy

B, S, H, HEADS, KV = 2, 64, 32, 8, 4


def _weights(module):
    pure = nnx.to_pure_dict(nnx.split(module)[1])
    rng = np.random.default_rng(1)  # away from the init so every gradient is informative
    return jax.tree.map(lambda a: jnp.asarray(a + 0.05 * rng.standard_normal(a.shape, np.float32)), pure)


def _inputs(plan, causal):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, S, H)).astype(np.float32)
    dy = rng.standard_normal((B, S, H)).astype(np.float32)
    (x, dy), positions = plan.layout_tokens(x, dy, causal=causal)
    return jnp.asarray(x), jnp.asarray(dy), jnp.asarray(np.broadcast_to(positions, (B, S)))


def _run_block(module, plan, weights, x, positions, dy, call):
    """(y, dx, dweights) of `call(block, x, positions)` run inside plan.shard_map on local shards."""
    graphdef = nnx.split(module)[0]
    specs = jax.tree.map(
        lambda pl: pl.param_spec(0),
        param_placements(nnx.split(module)[1], plan),
        is_leaf=lambda v: hasattr(v, "param_spec"),
    )

    def local(w, x, positions):
        return call(nnx.merge(graphdef, w), x, positions)

    fn = plan.shard_map(
        local, in_specs=(specs, plan.activation_spec(), plan.token_spec()), out_specs=plan.activation_spec()
    )
    y, vjp = jax.vjp(lambda w, x: fn(w, x, positions), weights, x)
    dw, dx = vjp(dy)
    return y, dx, dw


def _check_against(got, reference, w, x, dy, rtol=2e-4):
    """y, dx and every weight gradient of a block against the single-device reference(w, x)."""
    y, dx, dw = got
    y_ref, vjp = jax.vjp(reference, w, x)
    dw_ref, dx_ref = vjp(dy)
    assert_close(y, y_ref, rtol, "y")
    assert_close(dx, dx_ref, rtol, "dx")
    for name in dw_ref:
        assert_close(dw[name], dw_ref[name], rtol, "d" + name)


TPxSP = {
    "ring": dict(attention="ring"),
    "ring-contiguous": dict(attention="ring", layout="contiguous"),
    "ulysses": dict(attention="ulysses"),
    "wallfacer": dict(attention="wallfacer", team_size=2),
    "usp": dict(attention="usp", ulysses_size=2),
    "allgather": dict(attention="allgather"),
}


# by default every strategy causal and the zig-zag ring full too; with -m slow also the others full and the
# contiguous ring (the layouts against the reference: test_ring.py)
@pytest.mark.heavy
@pytest.mark.parametrize(
    "name,causal",
    [
        pytest.param(
            n,
            c,
            id=f"{n}-{'causal' if c else 'full'}",
            marks=[pytest.mark.slow] if n == "ring-contiguous" or (not c and n != "ring") else [],
        )
        for n in TPxSP
        for c in (True, False)
    ],
)
def test_attention_block_tp_x_sp_matches_dense(name, causal):
    """Megatron over tp=2 (heads, and the sequence in the norm regions) × a sequence strategy over sp=4, GQA:
    output, dx and every weight gradient equal the single-device block (dense attention)."""
    plan = ParallelPlan(jaxring.make_mesh(tp=2, sp=4), tensor_parallel="megatron", **TPxSP[name])
    attn = Attention(H, HEADS, KV, causal=causal, rngs=nnx.Rngs(0))
    w = _weights(attn)
    x, dy, positions = _inputs(plan, causal)
    y, dx, dw = jax.jit(
        lambda w, x, dy: _run_block(attn, plan, w, x, positions, dy, lambda blk, x, p: blk(x, p, plan))
    )(w, x, dy)

    _check_against(
        (y, dx, dw), lambda w, x: attention_block_reference(x, w, positions, HEADS, KV, causal, 10000.0), w, x, dy
    )


def test_attention_block_dp_x_tp_x_sp_with_replicated_kv_heads():
    """dp=2 × tp=2 × sp=2, one K/V head (fewer than tp: each tp rank reads its replica): all gradients."""
    plan = ParallelPlan(jaxring.make_mesh(dp=2, tp=2, sp=2), tensor_parallel="megatron", attention="ring")
    attn = Attention(H, HEADS, 1, rngs=nnx.Rngs(0))
    w = _weights(attn)
    x, dy, positions = _inputs(plan, True)
    y, dx, dw = jax.jit(
        lambda w, x, dy: _run_block(attn, plan, w, x, positions, dy, lambda blk, x, p: blk(x, p, plan))
    )(w, x, dy)
    _check_against(
        (y, dx, dw), lambda w, x: attention_block_reference(x, w, positions, HEADS, 1, True, 10000.0), w, x, dy
    )


def test_mlp_block_tp_x_sp_matches_dense():
    plan = ParallelPlan(jaxring.make_mesh(tp=2, sp=4), tensor_parallel="megatron", attention="ring")
    mlp = MLP(H, 64, "swiglu", rngs=nnx.Rngs(0))
    w = _weights(mlp)
    x, dy, positions = _inputs(plan, True)
    y, dx, dw = jax.jit(lambda w, x, dy: _run_block(mlp, plan, w, x, positions, dy, lambda blk, x, p: blk(x, plan)))(
        w, x, dy
    )
    _check_against((y, dx, dw), lambda w, x: mlp_block_reference(x, w, "swiglu"), w, x, dy)


def test_tp_x_sp_attention_bytes_are_megatron_plus_ring():
    """Forward + backward of the attention block on tp=2 × sp=4 (ring, zigzag, MHA), fp32, bytes received per
    device: Megatron's 5·(tp−1)/tp·b·(S/sp)·h all-gathers and reduce-scatters, on each sp shard, plus the ring's
    2(P−1) K/V blocks forward and 2(P−1) K/V + 2P fp32 dK/dV blocks backward, blocks of the local heads."""
    tp, sp = 2, 4
    plan = ParallelPlan(jaxring.make_mesh(tp=tp, sp=sp), tensor_parallel="megatron", attention="ring")
    attn = Attention(H, HEADS, HEADS, rngs=nnx.Rngs(0))
    w = _weights(attn)
    x, dy, positions = _inputs(plan, True)
    stats = compile_stats(
        lambda w, x, dy: _run_block(attn, plan, w, x, positions, dy, lambda blk, x, p: blk(x, p, plan)), w, x, dy
    )
    n = S // sp  # the sp shard Megatron gathers
    megatron = 5 * (tp - 1) * B * n * H * 4 // tp
    kv_block = B * n * (HEADS // tp) * (H // HEADS) * 4  # one K (or V) block of the local heads
    ring = 2 * (sp - 1) * kv_block + 2 * (sp - 1) * kv_block + 2 * sp * kv_block
    assert stats.bytes_moved["all-gather"] + stats.bytes_moved["reduce-scatter"] == megatron
    assert stats.bytes_moved["collective-permute"] == ring
    assert stats.bytes_moved["all-to-all"] == 0


# ---------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("method", ["optimus", "metp"])
def test_methods_that_split_the_sequence_themselves_refuse_sp(method):
    with pytest.raises(ValueError, match=f"tensor parallelism '{method}' cannot run with sp = 2: .*use megatron"):
        ParallelPlan(jaxring.make_mesh(tp=4, sp=2), tensor_parallel=method, attention="ring")


def test_refusals_name_the_value_and_the_rule():
    mesh = jaxring.make_mesh(tp=2, sp=4)
    with pytest.raises(ValueError, match="unknown attention strategy 'rings'; expected one of dense, ring"):
        ParallelPlan(mesh, attention="rings")
    with pytest.raises(ValueError, match="unknown tensor parallelism 'megatronn'; expected one of megatron"):
        ParallelPlan(mesh, attention="ring", tensor_parallel="megatronn")
    with pytest.raises(ValueError, match="strategy 'wallfacer' needs team_size"):
        ParallelPlan(mesh, attention="wallfacer")
    with pytest.raises(ValueError, match="team_size C=3: C² = 9 must divide sp = 4"):
        ParallelPlan(mesh, attention="wallfacer", team_size=3)
    with pytest.raises(ValueError, match="ulysses_size U=3 must be a positive integer dividing sp = 4"):
        ParallelPlan(mesh, attention="usp", ulysses_size=3)
    with pytest.raises(ValueError, match="strategy 'ring' takes no option team_size"):
        sequence_strategy("ring").resolve_options({"team_size": 2}, 4)
    with pytest.raises(ValueError, match="layout 'striped' is not supported by wallfacer"):
        ParallelPlan(mesh, attention="wallfacer", team_size=2, layout="striped")
    with pytest.raises(ValueError, match="zero stage 4 must be one of 0, 1, 2, 3"):
        ParallelPlan(mesh, attention="ring", zero=4)
    plan = ParallelPlan(mesh, attention="ulysses")
    with pytest.raises(ValueError, match="query heads 2 are not divisible by the Ulysses degree sp = 4"):
        plan.check_heads(4, 4)  # 4 heads / tp 2 = 2 local heads over sp = 4
    plan = ParallelPlan(mesh, attention="ring")
    with pytest.raises(
        ValueError,
        match=r"the sp = 4 shard of 8 tokens is not divisible by tp = 2|seq 36 is not divisible by 2\*sp = 8",
    ):
        plan.check_seq_len(36)
    with pytest.raises(ValueError, match="num_heads 6 is not divisible by tp = 4"):
        ParallelPlan(jaxring.make_mesh(tp=4, sp=2), attention="ring").tensor.check_model(
            ParallelPlan(jaxring.make_mesh(tp=4, sp=2), attention="ring"),
            num_heads=6,
            num_kv_heads=6,
            hidden=48,
            ffn=96,
            vocab=256,
        )


def test_plan_axes_and_specs():
    plan = ParallelPlan(
        jaxring.make_mesh(dp=2, tp=2, sp=2), tensor_parallel="megatron", attention="usp", ulysses_size=2
    )
    assert plan.seq_axes == ("usp_ring", "usp_ulysses") and plan.batch_axes == ("dp",)
    assert plan.activation_spec() == P("dp", ("usp_ring", "usp_ulysses", "tp"), None)
    assert plan.token_spec() == P("dp", ("usp_ring", "usp_ulysses"))
    assert plan.replica_axes == ("dp", "usp_ring", "usp_ulysses")
    assert sorted(plan.run_mesh.devices.flat, key=lambda d: d.id) == sorted(plan.mesh.devices.flat, key=lambda d: d.id)
    assert "attention=usp (ulysses_size=2)" in plan.describe() and "tensor=megatron" in plan.describe()
