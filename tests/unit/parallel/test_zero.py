"""Explicit ZeRO stages on the compiled train step, per device (dp = 8, N = 8, fp32: 4 bytes a parameter).

The Ultra-Scale Playbook's figures with Ψ parameters: bytes moved, stage 0 an all-reduce of 2Ψ, stages 1-2 a
reduce-scatter of Ψ and an all-gather of Ψ, stage 3 3Ψ (all-gather forward and backward, reduce-scatter), each
times (N−1)/N; memory 2Ψ + 2Ψ + kΨ/N, 2Ψ + (2Ψ + kΨ)/N, (2Ψ + 2Ψ + kΨ)/N, here with fp32 weights, fp32 gradients
and k = 8 bytes of Adam moments. Scalars (the loss, the norm's pieces) are left out of the byte counts.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxring
from jaxring.analysis.compiled import collective_traffic
from jaxring.models import gpt
from jaxring.nn import param_placements
from jaxring.parallel.plan import ParallelPlan
from jaxring.train.step import TrainStep

N, B, S, LAYERS = 8, 8, 16, 4
CFG = gpt.GPTConfig(vocab_size=64, num_layers=LAYERS, hidden=64, num_heads=4, ffn=256)


def _compile(stage, grad_accum=1, batch=B):
    model = gpt.GPT(CFG, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    plan = ParallelPlan(jaxring.make_mesh(dp=N), zero=stage)
    tx = optax.adamw(1e-3)
    step = TrainStep(plan, model, tx, gpt.NextTokenObjective(batch, S), grad_accum=grad_accum)
    abstract = lambda tree, shardings: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
    params = abstract(nnx.to_pure_dict(state), step.shardings(step.param_specs))
    opt_specs = step.opt_state_specs(params)
    opt = abstract(jax.eval_shape(tx.init, params), step.shardings(opt_specs))
    tok = jax.ShapeDtypeStruct((batch, S), jnp.int32, sharding=plan.tokens_sharding())
    compiled = (
        step.build(opt_specs)
        .lower(
            params,
            opt,
            {"tokens": tok, "targets": tok, "positions": tok},
            jax.ShapeDtypeStruct((2,), jnp.uint32),
            jax.ShapeDtypeStruct((), jnp.float32),
        )
        .compile()
    )
    return compiled, nnx.to_pure_dict(state)


@pytest.fixture(scope="module")
def stages():
    return {stage: _compile(stage) for stage in (0, 1, 2, 3)}


def _bytes(compiled):
    """Bytes received per device by collective kind, rank-0 (scalar) arrays left out."""
    text = re.sub(r"\b(f32|s32|u32|pred)\[\]", r"\1[0]", compiled.as_text())
    return collective_traffic(text, N)[0]


def _psi(params, select=lambda path: True):
    return sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params) if select(jax.tree_util.keystr(path)))


@pytest.mark.heavy
def test_every_weight_is_sharded(stages):
    _, _params = stages[0]
    plan = ParallelPlan(jaxring.make_mesh(dp=N), zero=3)
    placements = param_placements(nnx.split(gpt.GPT(CFG, rngs=nnx.Rngs(0)))[1], plan)
    assert all(pl.zero_dim is not None for pl in jax.tree.leaves(placements, is_leaf=lambda x: hasattr(x, "zero_dim")))


def test_bytes_moved_per_stage(stages):
    psi4 = 4 * _psi(stages[0][1])
    share = (N - 1) / N
    moved = {stage: _bytes(compiled) for stage, (compiled, _) in stages.items()}
    assert moved[0]["all-reduce"] == round(2 * share * psi4)  # 2Ψ
    assert moved[0]["reduce-scatter"] == moved[0]["all-gather"] == 0
    for stage in (1, 2):  # Ψ + Ψ
        assert moved[stage]["reduce-scatter"] == moved[stage]["all-gather"] == round(share * psi4), stage
        assert moved[stage]["all-reduce"] == 0
    # 3Ψ for the weights the backward reads again: the layers' weights, not their LayerNorm biases (read only
    # forward). The embedding table and final norm (outside the layer scan) are gathered once and held: their
    # backward re-gather is the same HLO as the forward's, and XLA merges the two.
    reread = _psi(stages[0][1], lambda p: p.startswith("['blocks']") and "bias" not in p)
    assert moved[3]["all-gather"] == round(share * (psi4 + 4 * reread))
    assert moved[3]["reduce-scatter"] == round(share * psi4)
    assert moved[3]["all-reduce"] == 0


@pytest.mark.heavy
def test_accumulation_scatters_per_micro_batch_only_from_stage_2():
    """Stage 1 keeps the full gradient across micro-batches and scatters once; stage 2 scatters each
    micro-batch's gradient at once (no full gradient buffer) and accumulates the shards."""
    compiled1, params = _compile(1, grad_accum=2, batch=2 * B)
    compiled2, _ = _compile(2, grad_accum=2, batch=2 * B)
    psi4 = 4 * _psi(params)
    assert _bytes(compiled1)["reduce-scatter"] == round((N - 1) / N * psi4)
    assert _bytes(compiled2)["reduce-scatter"] == round(2 * (N - 1) / N * psi4)


def test_memory_falls_stage_by_stage(stages):
    """Arguments (weights + Adam moments + the step count + the batch) exactly as the formulas; temporaries
    fall from stage 1 to 2 by the full gradient, less one layer's gradient in flight; the total falls from
    each stage to the next by the formula's difference, within one layer's weights."""
    params = stages[0][1]
    psi4 = 4 * _psi(params)
    layer4 = 4 * _psi(params, lambda p: p.startswith("['blocks']")) // LAYERS
    batch = 3 * (B // N) * S * 4 + 4 + 4  # tokens, targets, positions; the step count, max_loss
    mem = {stage: compiled.memory_analysis() for stage, (compiled, _) in stages.items()}
    args = {stage: m.argument_size_in_bytes for stage, m in mem.items()}
    assert args[0] == psi4 + 2 * psi4 + batch  # weights and moments replicated
    assert args[1] == args[2] == psi4 + 2 * psi4 // N + batch  # moments sharded
    assert args[3] == 3 * psi4 // N + batch  # everything sharded
    temp = {stage: m.temp_size_in_bytes for stage, m in mem.items()}
    total = {stage: args[stage] + temp[stage] for stage in mem}
    formula = {0: 4 * psi4, 1: 2 * psi4 + 2 * psi4 // N, 2: psi4 + 3 * psi4 // N, 3: 4 * psi4 // N}
    assert temp[1] - temp[2] >= (psi4 - psi4 // N) - layer4, temp
    for stage in (0, 1, 2):
        drop = formula[stage] - formula[stage + 1]
        assert total[stage] - total[stage + 1] >= drop - layer4, (stage, total)
        assert total[stage + 1] < total[stage], total
