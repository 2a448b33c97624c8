"""--offload weights: the fp32 weights, their gradients and the AdamW state live in pinned host memory; each
layer's weights reach the device as the layer runs and its gradient leaves as it is formed; the update streams
layer by layer (jaxring.train.streamed_update). The same loss, gradients and updates as the device-resident
step (fp32, 1e-6), on one device and under ZeRO 0 and 3 with sequence and tensor parallelism; the state stays
in host memory and resumes bit-exactly; what it does not compose with is one line; compiled for one H100 the
weights are host arguments and the device keeps none of the stack."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file
from test_memory_techniques import BATCH, CFG, PLANS, SEQ, _assert_same, _batch, _loss_and_grads, _train_step

import jaxring
from jaxring.planner.cluster import Cluster
from jaxring.planner.fit import workload_of
from jaxring.planner.search import search
from jaxring.run.spec import RunSpec
from jaxring.train.loop import train

# (plan, extra settings): remat and the ZeRO stage the weights take over replicas (0 or 3)
CASES = {
    "one device": dict(devices=1),
    "one device, remat full, layer inputs too": dict(devices=1, remat="full", offload="layer_inputs+weights"),
    "ring sp8, zero 3": PLANS["ring zigzag sp8"] | dict(zero=3, remat="full"),
    "ulysses sp4 x dp2, zero 0": PLANS["ulysses sp4 dp2"] | dict(zero=0),
    "metp tp4 x dp2, zero 3": PLANS["metp tp4 dp2"] | dict(zero=3),
}
SLOW_CASES = ("metp tp4 x dp2, zero 3",)  # 16 s; METP's gradients are checked with the weights on the device


@pytest.mark.heavy
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES])
def test_the_same_loss_and_gradients(name):
    settings = dict(CASES[name])
    offload = settings.pop("offload", "weights")
    _assert_same(_loss_and_grads(settings | dict(offload=offload)), _loss_and_grads(settings))


def _two_updates(settings: dict, offload: str):
    """(params, AdamW state, last metrics) after two train steps of the test GPT, and the memory kinds."""
    settings = dict(settings)
    devices = jax.devices()[: settings.pop("devices", 8)]
    remat = settings.pop("remat", "full")
    plan = jaxring.make_plan(devices, **settings)
    tx = optax.adamw(1e-2)
    step, state = _train_step(plan, tx, remat, offload, CFG, BATCH, SEQ)
    step.clip = 0.5  # below the gradients' norm (0.82 at the first step): the clipping is exercised
    params = jax.device_put(nnx.to_pure_dict(state), step.param_shardings())
    opt_specs = step.opt_state_specs(params)
    opt_state = jax.jit(tx.init, out_shardings=step.opt_state_shardings(opt_specs))(params)
    update = step.build(opt_specs)
    for i in range(2):
        params, opt_state, metrics = update(params, opt_state, _batch(plan), jax.random.PRNGKey(i), jnp.float32(9.0))
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves((params, opt_state))}
    return jax.tree.map(np.asarray, (params, opt_state, metrics)), kinds


UPDATE_CASES = {
    "one device": CASES["one device"],
    "ring sp8, zero 3": CASES["ring sp8, zero 3"],
    # the tensor methods whose head is split over tp and whose final norm is not (typed apart in the update)
    "megatron tp2 x ring sp4, zero 3": PLANS["megatron tp2 x ring sp4"] | dict(zero=3),
    "optimus tp4 x dp2, zero 3": PLANS["optimus tp4 dp2"] | dict(zero=3),
}


@pytest.mark.heavy
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("optimus") else n for n in UPDATE_CASES]
)
def test_the_same_updates_with_the_state_in_host_memory(name):
    """Two AdamW steps (clipped at norm 0.5) give the same weights, moments, count and metrics (fp32, relative
    2-norm 1e-6), and every array of the state stays in pinned host memory."""
    want, kinds = _two_updates(UPDATE_CASES[name], "none")
    assert kinds == {"device"}, kinds
    got, kinds = _two_updates(UPDATE_CASES[name], "weights")
    assert kinds == {"pinned_host"}, kinds

    def close(path, a, b):  # relative in the 2-norm, as the gradients (Megatron's reduce-scatter sums in another
        # order: 2.1e-6 of the largest entry in the max norm after two steps); a wrong update is off by O(lr)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        error = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert error <= 1e-6, (jax.tree_util.keystr(path), error)

    jax.tree_util.tree_map_with_path(close, got, want)


def test_a_skipped_step_leaves_the_host_state_as_it_was():
    """A loss over the divergence guard's limit skips the streamed update: weights and moments unchanged."""
    plan = jaxring.make_plan(jax.devices()[:1])
    tx = optax.adamw(1e-2)
    step, state = _train_step(plan, tx, "none", "weights", CFG, BATCH, SEQ)
    params = jax.device_put(nnx.to_pure_dict(state), step.param_shardings())
    opt_specs = step.opt_state_specs(params)
    opt_state = jax.jit(tx.init, out_shardings=step.opt_state_shardings(opt_specs))(params)
    before = jax.tree.map(np.asarray, (params, opt_state))
    params, opt_state, metrics = step.build(opt_specs)(
        params, opt_state, _batch(plan), jax.random.PRNGKey(0), jnp.float32(0.0)
    )
    assert bool(metrics["skipped"])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, (params, opt_state)), before)


SMALL = dict(model="gpt", preset="tiny", overrides={"num_layers": 2, "hidden": 64, "num_heads": 8, "ffn": 128})
RUN = RunSpec.of(
    **SMALL,
    steps=4,
    batch_size=4,
    seq_len=64,
    lr=3e-3,
    warmup=1,
    sample_tokens=0,
    progress=False,
    eval_at_end=False,
    sp=8,
    zero=3,
    offload="weights",
)


def _end_of_run(tmp_path, name: str, **settings) -> tuple[list[str], dict]:
    """(the log lines, the exported tensors) of a 2-step tiny-llama3 run with the held-out loss, a sample and
    --export-hf at its end."""
    said = []
    spec = RUN.updated(
        preset="tiny-llama3",
        steps=2,
        eval_at_end=True,
        sample_tokens=8,
        out_dir=str(tmp_path / f"run-{name}"),
        export_hf=str(tmp_path / f"hf-{name}"),
        **settings,
    )
    train(spec, log=said.append)
    return said, load_file(str(next((tmp_path / f"hf-{name}").glob("*.safetensors"))))


def _same_end(tmp_path, offload: str, **plan) -> None:
    """The end of the run with `offload` equals the same plan's with nothing offloaded: the sample written, the
    held-out loss the same line, the exported checkpoint equal (1e-6: the two programs round differently)."""
    (lines, exported), (lines_r, exported_r) = (
        _end_of_run(tmp_path, name, offload=o, **plan) for name, o in (("offloaded", offload), ("on-device", "none"))
    )
    assert any("--- sample ---" in line for line in lines), lines
    held_out = [next(line for line in x if "held-out loss" in line) for x in (lines, lines_r)]
    assert held_out[0] == held_out[1], held_out
    assert sorted(exported) == sorted(exported_r)
    for name, tensor in exported.items():
        np.testing.assert_allclose(tensor, exported_r[name], atol=1e-6, err_msg=name)


@pytest.mark.heavy
def test_the_end_of_the_run_evaluates_samples_and_exports_with_the_weights_offloaded(tmp_path):
    """With --offload weights the run's end (the held-out loss, the sample, --export-hf) takes the trained
    weights from host memory (sp8, ZeRO-3)."""
    _same_end(tmp_path, "weights")


@pytest.mark.heavy
@pytest.mark.parametrize(
    "offload,plan",
    [
        ("layer_inputs+weights", dict(remat="full", sp=4, tp=2, zero=None, tensor_parallel="megatron")),
        ("layer_inputs+optimizer", dict(remat="full", dp=2, sp=4, zero=1)),
        pytest.param("optimizer", dict(sp=8, zero=2), marks=pytest.mark.slow),
        pytest.param("weights", dict(dp=2, tp=4, sp=1, zero=None, tensor_parallel="metp"), marks=pytest.mark.slow),
        pytest.param("layer_inputs", dict(remat="full", sp=8, zero=0), marks=pytest.mark.slow),
    ],
    ids=["inputs+weights-megatron", "inputs+optimizer-zero1", "optimizer-zero2", "weights-metp", "inputs-zero0"],
)
def test_the_end_of_the_run_on_every_memory_placement(tmp_path, offload, plan):
    """Every --offload part with ZeRO stages and tensor methods: the run's end equals the run without offload."""
    _same_end(tmp_path, offload, **plan)


def _losses(spec: RunSpec) -> list[float]:
    return [r["loss"] for r in train(spec, log=lambda *a: None)]


@pytest.mark.heavy
def test_train_py_resumes_bit_exactly(tmp_path):
    """train.py --offload weights: saved at step 2 and resumed, the same losses as the uninterrupted run; the
    losses are those of the run with the weights on the device (1e-5)."""
    full = _losses(RUN)
    np.testing.assert_allclose(full, _losses(RUN.updated(offload="none")), rtol=1e-5)
    ckpt = str(tmp_path / "ckpt")
    first = _losses(RUN.updated(steps=2, checkpoint_dir=ckpt))
    resumed = _losses(RUN.updated(checkpoint_dir=ckpt, resume=True))
    np.testing.assert_array_equal(first + resumed, full)


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(offload="weights", pp=2, dp=4), r"--offload weights is not supported with pipeline parallelism"),
        (
            dict(offload="weights", grad_accum=2),
            r"--offload weights keeps the gradients in host memory .* "
            r"--grad-accum 2 needs --offload optimizer",
        ),
    ],
)
def test_what_weight_offload_does_not_compose_with_is_one_line(settings, message):
    with pytest.raises(ValueError, match=message):
        RunSpec.of(**settings).validate()


def test_zero_1_and_2_over_replicas_are_refused():
    plan = jaxring.make_plan(jax.devices()[:8], dp=2, sp=4, zero=2)
    with pytest.raises(
        ValueError,
        match=r"--offload weights with --zero 2: .* over the replica axes \(dp, sp\); "
        r"use --zero 3",
    ):
        _train_step(plan, optax.adamw(1e-3), "none", "weights", CFG, BATCH, SEQ)


def test_the_planner_turns_to_weight_offload_on_one_h100():
    """Llama-3-8B at 524,288 tokens on one H100: nothing fits until the weights leave the device; the planner's
    plan offloads them with the layer inputs, and prices the host link in the step time."""
    w = workload_of(RunSpec.of(preset="llama3-8b", seq_len=524288, batch_size=1))
    best = search(w, Cluster.of("h100", 1)).best
    assert (str(best.candidate.memory.offload), best.candidate.memory.remat) == ("layer_inputs+weights", "full")
    assert best.memory.total <= Cluster.of("h100", 1).usable_memory
    assert best.time.offload > 0


@pytest.mark.heavy
@pytest.mark.parametrize(
    "name,offload",
    [
        ("one device", "layer_inputs+weights"),
        ("ring sp8, zero 3", "layer_inputs"),
        ("ring sp8, zero 3", "layer_inputs+weights"),
    ],
)
def test_recompute_blocks_give_the_same_loss_and_gradients(name, offload):
    """--remat-layers 2 (a block of 2 layers keeps, or offloads, one input; its backward recomputes both): the
    loss and gradients of the per-layer remat (fp32, 1e-6)."""
    settings = dict(CASES[name]) | dict(remat="full")
    _assert_same(_loss_and_grads(settings | dict(offload=offload, remat_layers=2)), _loss_and_grads(settings))


def test_recompute_blocks_need_full_remat_and_a_divisor_of_the_layers():
    with pytest.raises(ValueError, match=r"--remat-layers 2 recomputes blocks .* needs --remat full"):
        RunSpec.of(remat="selective", remat_layers=2).validate()
    with pytest.raises(ValueError, match=r"--remat-layers 3 must divide the 2 layers a stack scans \(e.g. 2\)"):
        _loss_and_grads(dict(devices=1, remat="full", remat_layers=3))
