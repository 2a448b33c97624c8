"""Pipeline parallelism: schedule tables, their simulated bubble, and the interpreter against a sequential stack.

The toy model: token embedding -> L residual-MLP layers (stacked, scanned; w1 columns and w2 rows split over
tp with a psum, as Megatron) -> norm-scaled head and cross-entropy. The activation passed between stages is a
pytree (hidden [b, s, h], and a per-sequence auxiliary sum that each layer adds to and the head puts into the
loss, the way an MoE balance loss travels), so gradients flow through both.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring.core.vma import varying_axes
from jaxring.parallel.pipeline import lower, make_schedule, peak_in_flight, pipeline_loss_and_grads, simulate
from jaxring.parallel.pipeline.schedules import BW, B, F, W
from jaxring.parallel.pipeline.traffic import permute_bytes_by_pair, stage_link_bytes
from jaxring.parallel.registry import pipeline_schedules
from tests.helpers import assert_close

VOCAB, HIDDEN, SEQ, BATCH = 32, 16, 8, 2  # BATCH: micro-batch size per data-parallel rank
AUX_WEIGHT = 0.01


# ---------------------------------------------------------------- schedules and the simulator (no compiling)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (3, 5), (4, 4), (4, 8), (4, 12), (8, 16)])
def test_simulated_bubble_matches_the_formulas(p, m):
    """Paper costs (T_F = T_B = T_W, BW = B + W), each stage starting when its inputs are ready."""
    for name, expected in (("gpipe", (p - 1) / m), ("1f1b", (p - 1) / m), ("zero-bubble", (p - 1) / (3 * m))):
        assert simulate(make_schedule(name, p, m)).bubble == pytest.approx(expected), name
        # a tick per action: the playbook's count for gpipe/1f1b, the table's own length
        unit = {"gpipe": (p - 1) / m, "1f1b": (p - 1) / m, "zero-bubble": (p - 1) / (3 * m)}[name]
        assert simulate(make_schedule(name, p, m), "unit", lockstep=True).bubble == pytest.approx(unit), name


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2)])
def test_simulated_interleaved_bubble(p, m, v):
    schedule = make_schedule("interleaved", p, m, v)
    assert simulate(schedule).bubble == pytest.approx((p - 1) / (v * m))
    assert simulate(schedule, "unit", lockstep=True).bubble == pytest.approx((p - 1) / (v * m))
    assert schedule.num_ticks == 2 * v * m + 2 * (p - 1)


def test_lockstep_clock_charges_mixed_ticks():
    """In one SPMD program a tick lasts as long as its slowest action: 1F1B's steady state mixes F and BW, so
    with t_BW = 2 t_F it loses time; gpipe's ticks are uniform and zero-bubble's actions are all one unit."""
    p, m = 4, 16
    one_f_one_b = make_schedule("1f1b", p, m)
    assert simulate(one_f_one_b, lockstep=True).bubble > 2 * simulate(one_f_one_b).bubble
    for name in ("gpipe", "zero-bubble"):
        schedule = make_schedule(name, p, m)
        assert simulate(schedule, lockstep=True).bubble == pytest.approx(simulate(schedule).bubble)


def test_in_flight_micro_batches():
    p, m = 4, 12
    assert peak_in_flight(make_schedule("gpipe", p, m)) == [m] * p
    assert peak_in_flight(make_schedule("1f1b", p, m)) == [p - s for s in range(p)]
    assert peak_in_flight(make_schedule("zero-bubble", p, m)) == [p] * p  # F..W; as 1f1b's peak on stage 0
    # residual slots (the interpreter's memory) follow the same counts
    assert lower(make_schedule("gpipe", p, m)).slots["res"] == m
    assert lower(make_schedule("1f1b", p, m)).slots["res"] == p
    zb = lower(make_schedule("zero-bubble", p, m)).slots
    assert (zb["res"], zb["wres"], zb["stash"]) == (p, p, p)


def test_tables_respect_dependencies_and_chart():
    for name in pipeline_schedules():
        v = 2 if name == "interleaved" else 1
        schedule = make_schedule(name, 4, 8, v)
        ticks = {}
        for s in range(4):
            for t, kind, i, c in schedule.actions(s):
                ticks[(kind, i, c * 4 + s)] = t
        last = 4 * v - 1
        for (kind, i, vs), t in ticks.items():
            if kind == F and vs > 0:  # F after the previous virtual stage's F
                assert ticks[(F, i, vs - 1)] < t
            if kind in (B, BW):  # B / BW after own F and the next stage's
                assert ticks[(F, i, vs)] < t and (vs == last or ticks[(kind, i, vs + 1)] < t)
            if kind == W:
                assert ticks[(B, i, vs)] < t
        assert len(ticks) == (3 if name == "zero-bubble" else 2) * 8 * v * 4
    chart = make_schedule("1f1b", 2, 2).chart().splitlines()
    assert chart == ["stage 0: F0  F1  .   BW0 .   BW1", "stage 1: .   F0  BW0 F1  BW1 .  "]


def test_schedule_picture():
    import matplotlib

    matplotlib.use("Agg")
    from jaxring.parallel.pipeline import plot_schedule

    schedule = make_schedule("zero-bubble", 4, 8)
    ax = plot_schedule(schedule, costs="paper", lockstep=False)
    assert len(ax.patches) == 3 * 8 * 4  # one box per action
    assert ax.get_xlim()[1] == pytest.approx(simulate(schedule).makespan)


@pytest.mark.parametrize(
    "args,message",
    [
        (("pipedream", 4, 8), "unknown pipeline schedule 'pipedream'"),
        (("1f1b", 4, 2), "num_microbatches=2 is less than pp=4"),
        (("gpipe", 4, 8, 2), "pipeline schedule 'gpipe' takes no option virtual_stages"),
        (("zero-bubble", 2, 4, 2), "pipeline schedule 'zero-bubble' takes no option virtual_stages"),
        (("interleaved", 4, 6, 2), "num_microbatches=6 is not divisible by pp=4"),
        (("interleaved", 4, 8, 1), "virtual_stages=1: the 'interleaved' schedule needs at least 2"),
        (("1f1b", 0, 8), "pp (num_stages)=0 must be a positive integer"),
    ],
)
def test_refused_schedules(args, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        make_schedule(*args)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- the toy model


def init(num_layers, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    stack = {
        "w1": jax.random.normal(k[0], (num_layers, HIDDEN, 4 * HIDDEN)) * HIDDEN**-0.5,
        "b1": jax.random.normal(k[1], (num_layers, 4 * HIDDEN)) * 0.1,
        "w2": jax.random.normal(k[2], (num_layers, 4 * HIDDEN, HIDDEN)) * (4 * HIDDEN) ** -0.5,
    }
    shared = {
        "embed": jax.random.normal(k[3], (VOCAB, HIDDEN)),
        "head": jax.random.normal(k[4], (HIDDEN, VOCAB)) * HIDDEN**-0.5,
        "norm": 1 + 0.1 * jax.random.normal(k[5], (HIDDEN,)),
    }
    return stack, shared


def embed_fn(shared, mb):
    h = shared["embed"][mb["tokens"]]
    return {"h": h, "aux": jnp.zeros(h.shape[:1], h.dtype)}


def make_stage_fn(tp_axis):
    def stage_fn(chunk, x, mb):
        def layer(x, w):
            out = jax.nn.gelu(x["h"] @ w["w1"] + w["b1"]) @ w["w2"]
            out = lax.psum(out, tp_axis) if tp_axis else out
            return {"h": x["h"] + out, "aux": x["aux"] + jnp.mean(out**2, axis=(1, 2))}, None

        return lax.scan(layer, x, chunk)[0]

    return stage_fn


def loss_fn(shared, x, mb):
    logits = (x["h"] * shared["norm"]) @ shared["head"]
    lse = jax.nn.logsumexp(logits, -1)
    target = jnp.take_along_axis(logits, mb["targets"][..., None], -1)[..., 0]
    balance = jnp.sum(x["aux"])
    return jnp.sum(lse - target) + AUX_WEIGHT * balance, {"balance": balance, "z": jnp.sum(lse**2)}


def sequential(stack, shared, microbatches):
    """The reference: the whole stack on one device, loss summed over micro-batches, and its gradients."""
    stage_fn = make_stage_fn(None)

    def total(stack, shared):
        def one(mb):
            return loss_fn(shared, stage_fn(stack, embed_fn(shared, mb), mb), mb)

        losses, aux = jax.vmap(one)(microbatches)
        return losses.sum(), jax.tree.map(jnp.sum, aux)

    return jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))(stack, shared)


STACK_SPEC = {
    "w1": P("pp", None, None, None, "tp"),
    "b1": P("pp", None, None, "tp"),
    "w2": P("pp", None, None, "tp", None),
}


def pipelined_step(mesh, schedule, check_vma=True, **options):
    """jit(shard_map(...)) of the pipelined loss and gradients. Stage parameters as [pp, v, layers, ...].
    With reduce_data_axes=False the results must vary over dp; the body then sums them over dp itself."""

    def body(staged, shared, microbatches):
        chunks = jax.tree.map(lambda a: a[0], staged)
        out = pipeline_loss_and_grads(
            schedule,
            embed_fn=embed_fn,
            stage_fn=make_stage_fn("tp"),
            loss_fn=loss_fn,
            stage_params=chunks,
            shared_params=shared,
            microbatches=microbatches,
            **options,
        )
        if not options.get("reduce_data_axes", True):
            assert all("dp" in varying_axes(a) for a in jax.tree.leaves(out)), "unreduced results must vary over dp"
            out = lax.psum(out, "dp")
        loss, aux, d_stage, d_shared = out
        return loss, aux, jax.tree.map(lambda a: a[None], d_stage), d_shared

    batch_spec = {"tokens": P(None, "dp"), "targets": P(None, "dp")}
    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(STACK_SPEC, P(), batch_spec),
            out_specs=(P(), P(), STACK_SPEC, P()),
            check_vma=check_vma,
        )
    )


def to_stages(stack, pp, v):
    """[L, ...] -> [pp, v, L/(pp v), ...]: chunk c of stage s is virtual stage c*pp + s."""
    return jax.tree.map(lambda a: jnp.swapaxes(a.reshape(v, pp, -1, *a.shape[1:]), 0, 1), stack)


def from_stages(staged):
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[3:]), staged)


def make_batch(m, dp, seed=1):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "tokens": jax.random.randint(k1, (m, BATCH * dp, SEQ), 0, VOCAB),
        "targets": jax.random.randint(k2, (m, BATCH * dp, SEQ), 0, VOCAB),
    }


# (schedule, m, v, layers per chunk, mesh degrees, options): pp=4 alone, pp=2 x dp=4, pp=2 x tp=2 x dp=2; one
# case without check_vma (data axes named), one leaving the data-axis reduction to the caller
CASES = [
    ("gpipe", 4, 1, 1, dict(pp=4), {}),
    ("1f1b", 4, 1, 2, dict(pp=4), {}),
    ("zero-bubble", 5, 1, 1, dict(pp=4), {}),
    ("interleaved", 4, 2, 1, dict(pp=4), {}),
    ("gpipe", 3, 1, 2, dict(pp=2, dp=4), dict(check_vma=False, data_axes=("dp",))),
    ("1f1b", 4, 1, 1, dict(pp=2, dp=4), dict(reduce_data_axes=False)),
    ("zero-bubble", 4, 1, 2, dict(pp=2, tp=2, dp=2), {}),
    ("interleaved", 4, 2, 1, dict(pp=2, tp=2, dp=2), {}),
]


def _case_id(case):
    name, m, _, _, degrees, options = case
    return "-".join([name, f"m{m}", "x".join(f"{k}{d}" for k, d in degrees.items()), *options])


# with -m slow only: gpipe and zero-bubble at pp=4 (each schedule runs at pp=2 by default, and 1F1B and
# interleaved at pp=4, the middle stages' path)
SLOW_CASES = ("gpipe-m4-pp4", "zero-bubble-m5-pp4")


@pytest.mark.heavy
@pytest.mark.parametrize(
    "name,m,v,layers,degrees,options",
    [pytest.param(*c, id=_case_id(c), marks=[pytest.mark.slow] if _case_id(c) in SLOW_CASES else []) for c in CASES],
)
def test_pipelined_gradients_equal_sequential(name, m, v, layers, degrees, options):
    """Loss, aux and every gradient equal the sequential stack's, with every buffer slot and unsent message
    poisoned with NaN (a wrong read would show); and the compiled program moves exactly the schedule's bytes."""
    pp, dp = degrees["pp"], degrees.get("dp", 1)
    n = pp * dp * degrees.get("tp", 1)
    mesh = jaxring.make_mesh(**degrees, devices=jax.devices()[:n])
    stack, shared = init(pp * v * layers)
    batch = make_batch(m, dp)
    schedule = make_schedule(name, pp, m, v)
    staged = to_stages(stack, pp, v)
    compiled = pipelined_step(mesh, schedule, poison=True, **options).lower(staged, shared, batch).compile()
    loss, aux, d_staged, d_shared = compiled(staged, shared, batch)
    (ref_loss, ref_aux), (ref_stack, ref_shared) = sequential(stack, shared, batch)
    assert_close(loss, ref_loss, 1e-5, "loss")
    for key in ref_aux:
        assert_close(aux[key], ref_aux[key], 1e-5, key)
    for key, g in from_stages(d_staged).items():
        assert_close(g, ref_stack[key], 1e-5, "d_" + key)
    for key, g in d_shared.items():
        assert_close(g, ref_shared[key], 1e-5, "d_" + key)

    # bytes between stages: one micro-batch's activation (hidden + aux) per message, 2m per boundary per step
    activation = 4 * BATCH * SEQ * HIDDEN + 4 * BATCH
    want = {}
    for s in range(pp - 1):  # within each loop over the stages: v·m each way
        want[(s, s + 1)] = want[(s + 1, s)] = v * m * activation
    if v > 1:  # the wrap-around link: (v-1)·m each way
        want[(pp - 1, 0)] = want.get((pp - 1, 0), 0) + (v - 1) * m * activation
        want[(0, pp - 1)] = want.get((0, pp - 1), 0) + (v - 1) * m * activation
    hlo = compiled.as_text()
    assert stage_link_bytes(hlo, mesh) == dict(sorted(want.items()))  # the same on every dp / tp replica
    assert sum(permute_bytes_by_pair(hlo).values()) == sum(want.values()) * (n // pp)
    # 2·m activations per boundary between consecutive virtual stages, v·pp - 1 boundaries
    assert sum(want.values()) == 2 * m * activation * (v * pp - 1)


def compiled_temp_bytes(name, pp, m):
    mesh = jaxring.make_mesh(pp=pp, devices=jax.devices()[:pp])
    stack, shared = init(pp)
    step = pipelined_step(mesh, make_schedule(name, pp, m))
    args = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (to_stages(stack, pp, 1), shared, make_batch(m, 1))
    )
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.heavy
def test_compiled_memory_grows_with_m_only_for_gpipe():
    """gpipe keeps m micro-batches' residuals; 1f1b and zero-bubble at most pp, whatever m."""
    pp = 2
    temp = {(name, m): compiled_temp_bytes(name, pp, m) for name in ("gpipe", "1f1b", "zero-bubble") for m in (4, 8)}
    gpipe_growth = temp[("gpipe", 8)] - temp[("gpipe", 4)]
    # residuals of 4 more micro-batches: per micro-batch at least the MLP's hidden activation
    assert gpipe_growth > 4 * BATCH * SEQ * 4 * HIDDEN * 4
    # 1f1b and zero-bubble: not one micro-batch's hidden activation more (XLA:CPU of jax 0.11+ adds 8 bytes of
    # scalars at m = 8 to 1f1b; jax 0.10's added none)
    one_residual = BATCH * SEQ * HIDDEN * 4
    assert abs(temp[("1f1b", 8)] - temp[("1f1b", 4)]) < one_residual, temp
    assert abs(temp[("zero-bubble", 8)] - temp[("zero-bubble", 4)]) < one_residual, temp
    assert temp[("1f1b", 8)] < temp[("gpipe", 8)] and temp[("zero-bubble", 8)] < temp[("gpipe", 8)]


@pytest.mark.parametrize(
    "case,message",
    [
        ("stages", "schedule has 2 stages but mesh axis 'pp' has size 4"),
        ("chunks", "every leaf needs a leading chunk dimension of virtual_stages = 2"),
        ("microbatches", "every leaf needs a leading micro-batch dimension of num_microbatches = 8"),
    ],
)
def test_refused_calls(case, message):
    mesh = jaxring.make_mesh(pp=4, devices=jax.devices()[:4])
    stack, shared = init(8)
    schedule = {
        "stages": make_schedule("1f1b", 2, 4),
        "chunks": make_schedule("interleaved", 4, 4, 2),
        "microbatches": make_schedule("1f1b", 4, 8),
    }[case]
    step = pipelined_step(mesh, schedule)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        step.lower(to_stages(stack, 4, 1), shared, make_batch(4, 1))
    assert "\n" not in str(info.value)
