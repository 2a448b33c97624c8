# %% [markdown]
# # Pipeline parallelism: four schedules in one SPMD program
#
# Pipeline parallelism splits the model's layers into `p` consecutive **stages**, one per device on the
# `pp` mesh axis, and cuts the batch into `m` **micro-batches** that flow through the stages one after
# another: stage 1 works on micro-batch 0 while stage 0 already works on micro-batch 1. Activations go
# forward from stage to stage, their gradients backward. While the pipeline fills and drains, some stages
# have nothing to do: the **bubble**. The order in which each stage runs its forwards and backwards is the
# **schedule**, and it decides both the bubble and how many micro-batches' activations a stage holds.
#
# jaxring has the four schedules of the Ultra-Scale Playbook's pipeline section, all in **one** SPMD
# program (one `jit`, one `shard_map` over the whole mesh) and composed with data, sequence and tensor
# parallelism and ZeRO:
#
# | schedule | what each stage runs | bubble | micro-batches held per stage |
# |---|---|---|---|
# | `gpipe` (all-forward-all-backward) | every forward, then every backward | `(p−1)/m` | `m` |
# | `1f1b` (PipeDream-flush) | `p−1−s` warm-up forwards, then one forward / one backward alternating | `(p−1)/m` | `≤ p` |
# | `interleaved` (Megatron-LM) | the same on `v` chunks of layers per stage ("virtual stages") | `(p−1)/(v·m)` | `≤ v·p` chunks (each `1/v` of a stage) |
# | `zero-bubble` (ZB-H1, Qi et al. 2023) | the backward split into input gradient `B` and weight gradient `W`; the `W`s fill the bubble | `(p−1)/(3m)` | `≤ p` |
#
# (The bubble is the idle time over the useful time, as the Playbook counts it, with the papers' costs: a
# forward `t_F`, a whole backward `t_B + t_W = 2 t_F`.) In JAX today MaxText and praxis run GPipe and its
# circular variant in one program; 1F1B, interleaved 1F1B and zero-bubble exist only in runtimes that run a
# separate program per stage (MPMD). jaxring writes each schedule as a **table** (tick → what each stage
# does), and one interpreter runs any table inside the train step's `shard_map`: each tick, every stage
# picks its action with a `lax.switch` on its own table entry, then the activations and gradients that the
# table says are sent this tick move with `lax.ppermute` between neighbouring stages.
#
# This notebook draws the four schedules, checks their simulated bubbles against the formulas on two
# clocks (and says what one SPMD program pays), trains a GPT with `pp=2` under each schedule next to a run
# without a pipeline, and reads each schedule's memory from the compiled train step as `m` grows.

# %%
# On Colab: install jaxring beside the runtime's own jax and its GPU or TPU plugin (kept as they are).
# Locally: bash tools/setup.sh notebooks.
import os
import sys

if "google.colab" in sys.modules:
    # %pip install -q "jaxring @ git+https://github.com/jaxring/jaxring"
    pass

# FAST=1 (set by the tests) keeps every size small; leave it unset to see realistic sizes.
FAST = os.environ.get("JAXRING_NOTEBOOK_FAST", "0") == "1"

import jax

import jaxring
from jaxring.core.device_setup import describe_devices, use_cpu_devices_if_no_accelerator

# The meshes below need 8 devices: 8 accelerators if there are that many, else 8 simulated CPU devices.
# This must run before anything asks JAX for its devices (afterwards the CPU device count is fixed).
devices = use_cpu_devices_if_no_accelerator(8)
devices = devices[:8] if len(devices) >= 8 else jax.devices("cpu")[:8]
print("devices:", describe_devices(devices), "| FAST mode" if FAST else "")

# %% [markdown]
# ## 1. A schedule is a table
#
# `jaxring.parallel.pipeline.make_schedule(name, num_stages, num_microbatches, virtual_stages=1)` builds the table:
# for every tick, each stage's action (`F` forward, `BW` whole backward, or for zero-bubble `B` and `W`),
# the micro-batch it works on, and for interleaved the chunk. Each schedule is written as every stage's
# *order* of actions (the paper's algorithm box, in `jaxring/parallel/pipeline/schedules.py`), and each action is put
# on the earliest tick its inputs allow. Here is 1F1B with `p = 4` stages and `m = 8` micro-batches
# (`F3` is the forward of micro-batch 3, `.` an idle tick):

# %%
from jaxring.parallel.pipeline import make_schedule, plot_schedule, simulate

P, M = 4, 8
print(make_schedule("1f1b", num_stages=P, num_microbatches=M))

# %% [markdown]
# Stage `s` runs `p−1−s` forwards to fill the pipeline, then alternates one forward with one backward, and
# ends with the backwards left. Stage 3 (the last) runs each micro-batch's backward right after its
# forward; stage 0 holds at most 4 micro-batches between their forward and their backward, whatever `m`.
#
# ## 2. The four schedules, on two clocks
#
# `simulate(schedule, costs, lockstep)` times a table and `plot_schedule` draws it: stages down, time
# across, each box labelled with its micro-batch (and its chunk after a colon). The costs are the papers':
# `t_F = t_B = t_W = 1`, a whole backward `BW = 2`. Two clocks:
#
# * **per stage** (left): each stage starts its next action as soon as that action's inputs are there:
#   how the papers analyse a schedule, and how a runtime with one program per stage runs it;
# * **lockstep** (right): the table's ticks run one after another and a tick lasts as long as its slowest
#   action: how **one SPMD program** runs it, and so how jaxring's interpreter runs it (every device
#   executes the same tick, then the stages exchange their messages).

# %%
import matplotlib.pyplot as plt
import numpy as np

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zero-bubble": 1}  # name -> virtual stages v


def chunks(name):
    """The schedule's option: v chunks per stage (only the interleaved schedule takes it)."""
    return {"virtual_stages": SCHEDULES[name]} if SCHEDULES[name] > 1 else {}


tables = {name: make_schedule(name, P, M, v) for name, v in SCHEDULES.items()}
longest = max(simulate(t, lockstep=lock).makespan for t in tables.values() for lock in (False, True))
fig, axes = plt.subplots(len(tables), 2, figsize=(18, 2.3 * len(tables)))
for table, (left, right) in zip(tables.values(), axes):
    plot_schedule(table, costs="paper", lockstep=False, ax=left)
    plot_schedule(table, costs="paper", lockstep=True, ax=right)
    left.set_xlabel("time, per-stage clock (t_F = 1)")
    right.set_xlabel("time, lockstep clock (t_F = 1)")
for ax in axes.flat:
    ax.set_xlim(0, longest)  # one time scale for all eight pictures
plt.tight_layout()
plt.show()

# %% [markdown]
# On the per-stage clock (left) each picture is the paper's: GPipe and 1F1B end at the same time (the same
# bubble, `(p−1)/m`); interleaving (`v = 2` chunks per stage, each half as long) halves the fill and drain;
# zero-bubble fills the tail with the weight-gradient passes `W` that nothing waits for.
#
# On the lockstep clock (right) GPipe and zero-bubble do not change: every tick of GPipe is all forwards or
# all backwards, and zero-bubble's actions all cost the same. 1F1B and interleaved do change: in their steady
# state one stage runs a forward while its neighbour runs a backward in the same tick, and the forward's
# stage waits for the backward (`t_BW − t_F` every tick). The next section puts numbers on it.
#
# ## 3. Simulated bubbles against the formulas
#
# **Per-stage clock**: the formulas of the table at the top. **Lockstep clock**: GPipe and ZB-H1 keep their
# formulas. For 1F1B and interleaved, count ticks: the table has `2(v·m + p − 1)` ticks; only the first
# `v·p` hold forwards alone (the first backward waits for micro-batch 0 to leave the last virtual stage),
# and every later tick holds a backward and lasts `t_BW / v = 2/v`. The useful work per stage is `3m`, so
#
#     lockstep bubble (1F1B, interleaved) = (m + 4(p−1)/v − p) / (3m)   →  1/3 as m grows,
#
# (for 1F1B, `v = 1`: `(m + 3p − 4)/(3m)`) where the per-stage clock's bubble goes to 0.

# %%
from fractions import Fraction


def formula(name, p, m, v, lockstep):
    """The bubble of schedule `name` on the per-stage clock, or on the lockstep clock."""
    if name == "gpipe":
        return Fraction(p - 1, m)
    if name == "zero-bubble":
        return Fraction(p - 1, 3 * m)
    if lockstep:  # 1f1b (v = 1) and interleaved
        return (m + Fraction(4 * (p - 1), v) - p) / (3 * m)
    return Fraction(p - 1, v * m)


def exact(x):
    return Fraction(x).limit_denominator(10_000)


print(f"{'schedule':>12s}{'p':>3s}{'m':>4s}{'v':>3s}  {'per-stage clock':>26s}  {'lockstep clock':>26s}")
print(f"{'':>22s}  {'simulated':>12s}{'formula':>14s}  {'simulated':>12s}{'formula':>14s}")
for p, m in ((2, 4), (4, 8), (4, 16), (8, 32)):
    for name, v in SCHEDULES.items():
        table = make_schedule(name, p, m, v)
        stage_clock, lockstep_clock = simulate(table).bubble, simulate(table, lockstep=True).bubble
        f_stage, f_lock = formula(name, p, m, v, False), formula(name, p, m, v, True)
        assert exact(stage_clock) == f_stage and exact(lockstep_clock) == f_lock, (name, p, m, v)
        print(
            f"{name:>12s}{p:3d}{m:4d}{v:3d}  {stage_clock:12.4f}{f_stage!s:>14s}  {lockstep_clock:12.4f}{f_lock!s:>14s}"
        )
    print()

# %% [markdown]
# Every simulated bubble equals its formula exactly (the cell asserts it). Stated plainly, what running in
# lockstep costs:
#
# * **GPipe** and **zero-bubble** lose nothing: their lockstep bubbles are the papers' `(p−1)/m` and
#   `(p−1)/(3m)`.
# * **1F1B** keeps its memory advantage but not its bubble: with `p = 4, m = 16` it idles 50% of the useful
#   time where the paper's clock says 19%, and however many micro-batches there are it never drops below a
#   third. Per tick, a forward and a backward run side by side and the forward waits. In one SPMD program,
#   GPipe with many micro-batches is faster than 1F1B, at the price of holding all `m` micro-batches'
#   activations (section 5).
# * **Interleaved** helps less than the paper says for the same reason: `(m + p − 2)/(3m)` with `v = 2`
#   (`1/3` for `p = 2`, whatever `m`), instead of `(p−1)/(2m)`.
#
# Zero-bubble is the schedule that suits one SPMD program: its three actions cost about the same, so no
# stage waits for a slower neighbour, and it holds no more than 1F1B. (Real `B` and `W` passes need not cost
# exactly one forward each; the simulator takes any costs: `simulate(table, costs={...})`.)
#
# ## 4. Training a GPT with `pp = 2`
#
# `RunSpec.of(pp=2, pipeline_schedule=..., microbatches=m, virtual_stages=v)` (`python train.py --pp 2
# --pipeline-schedule ... --microbatches m --virtual-stages v`) splits the GPT's stacked layers over `pp`:
# the embedding runs on the first stage, the final LayerNorm, the head and the loss on the last, and the
# layers in between are cut into `p·v` equal chunks. The micro-batches are the step's gradient
# accumulation: one optimizer update per step, after all `m` micro-batches, on the gradients of the whole
# batch, exactly as without a pipeline. So the losses must be the same as a run on one device.
#
# We train the same small GPT (4 layers, byte-level, the bundled corpus of Python's standard library) from
# the same seed: on one device, then with each schedule on `pp = 2 × dp = 4` (each micro-batch split over
# 4 data-parallel replicas of each stage), and once more with 1F1B on `pp = 2 × sp = 4` (each stage's
# sequence split over 4 devices, ring attention inside the stage). FAST mode (the test run) trains 3 steps
# with zero-bubble only, to save compiles; `tests/integration/test_pipeline_model.py` checks every schedule.

# %%

import tempfile

from matplotlib.ticker import MaxNLocator

from jaxring.run.spec import RunSpec
from jaxring.train.loop import train

STEPS = 3 if FAST else 30
BATCH = 8 if FAST else 16
MICROBATCHES = 2 if FAST else 4  # each micro-batch: BATCH / m sequences, split over dp = 4
BASE = RunSpec.of(
    model="gpt",
    preset="tiny",
    seed=0,
    steps=STEPS,
    batch_size=BATCH,
    seq_len=64 if FAST else 256,
    overrides=dict(num_layers=4, hidden=64, num_heads=8, ffn=128) if FAST else dict(num_layers=4),
    lr=3e-3,
    warmup=2 if FAST else 10,
    sample_tokens=0,
    eval_at_end=False,
    progress=False,
    log_every=STEPS,
)
PIPELINE = dict(pp=2, microbatches=MICROBATCHES)
# FAST mode trains one schedule (each run is one more compile); tests/integration/test_pipeline_model.py trains them all
TRAINED = ("zero-bubble",) if FAST else tuple(SCHEDULES)
RUNS = {name: (BASE.updated(dp=4, pipeline_schedule=name, **chunks(name), **PIPELINE), devices) for name in TRAINED}
if not FAST:  # (FAST mode leaves it out to save a compile; tests/integration/test_pipeline_model.py runs pp x sp)
    RUNS["1f1b, pp × sp"] = (BASE.updated(sp=4, attention="ring", pipeline_schedule="1f1b", **PIPELINE), devices)


def losses_of(cfg, use):
    """The per-step losses of one run (its run.yaml and metrics.jsonl go to a temporary directory)."""
    history = train(cfg.updated(out_dir=tempfile.mkdtemp(prefix="jaxring-run-")), devices=use, log=lambda *a: None)
    return np.array([r["loss"] for r in history])


losses = {"no pipeline": losses_of(BASE, devices[:1])}  # no pipeline, one device
names = {"no pipeline": "1 device"}
for label, (cfg, use) in RUNS.items():
    losses[label] = losses_of(cfg, use)
    names[label] = cfg.plan(use).describe()
    print(f"{label:>14s}: {names[label]}")

# %%
steps = np.arange(1, STEPS + 1)
fig, ax = plt.subplots(figsize=(8, 4))
ax.plot(steps, losses["no pipeline"], lw=8, alpha=0.25, color="k", label="no pipeline (1 device)")
for i, label in enumerate(RUNS):
    ax.plot(steps, losses[label], ls=["-", "--", ":", "-.", (0, (1, 3))][i], lw=1.5, label=names[label])
ax.set_xlabel("step")
ax.set_ylabel("training loss (nats per byte)")
ax.set_title("Same seed, same batches: no pipeline and pp = 2")
ax.xaxis.set_major_locator(MaxNLocator(integer=True))
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

TOL = (1e-4 if FAST else 2e-3) if devices[0].platform == "cpu" else 2e-2
for label in RUNS:
    relative = np.abs(losses[label] - losses["no pipeline"]) / losses["no pipeline"]
    print(f"max |loss - loss without pipeline| / loss over {STEPS} steps, {label:>14s}: {relative.max():.1e}")
    assert relative.max() < TOL, label

# %% [markdown]
# The curves coincide: every schedule computes the same gradients of the same batch, only in another order
# and on other devices, so the runs differ by floating-point rounding alone. The interleaved run keeps its
# layer stack in pipeline order on the devices (each stage's two chunks together) and checkpoints in the
# natural order, so checkpoints move between schedules and meshes.
#
# ## 5. Memory per device against `m`
#
# What a stage holds between a micro-batch's forward and its backward are the activations its backward
# needs. GPipe runs every forward first, so it holds all `m` micro-batches; 1F1B and zero-bubble start the
# backwards early and hold at most `p` (the simulator's `peak_in_flight`). With a fixed micro-batch size,
# GPipe's memory should grow with `m` and the others' stay flat. We compile the whole train step (forward,
# backward, gradient reduction, AdamW) of the GPT above on `pp = 2 × dp = 4` for several `m`, with abstract
# inputs (nothing runs), and read `memory_analysis()` per device: the temporaries (activations kept for the
# backward, the pipeline's buffers, gradients, working copies) and the peak (arguments + outputs +
# temporaries, less what is shared).

# %%
import jax.numpy as jnp
import optax
from flax import nnx

from jaxring.models import gpt
from jaxring.parallel.pipeline.traffic import stage_link_bytes
from jaxring.parallel.plan import ParallelPlan
from jaxring.train.step import TrainStep

MICRO = 4  # sequences per micro-batch: one per dp replica
SEQ = BASE.training.seq_len
model_config = gpt.get_config("tiny", **BASE.model.overrides)
model = gpt.GPT(model_config, rngs=nnx.Rngs(0))
state = nnx.state(model)
mesh = jaxring.make_mesh(pp=2, dp=4, devices=devices)


def abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def compiled_train_step(name, m):
    """The GPT train step on pp = 2 x dp = 4 under schedule `name` with m micro-batches of MICRO sequences,
    compiled for abstract inputs."""
    plan = ParallelPlan(mesh, pipeline_schedule=name, microbatches=m, **chunks(name))
    tx = optax.adamw(1e-3)
    step = TrainStep(plan, model, tx, gpt.NextTokenObjective(m * MICRO, SEQ))
    params = abstract(nnx.to_pure_dict(state), step.shardings(step.param_specs))
    opt_specs = step.opt_state_specs(params)
    opt_state = abstract(jax.eval_shape(tx.init, params), step.shardings(opt_specs))
    tokens = jax.ShapeDtypeStruct((m * MICRO, SEQ), jnp.int32, sharding=plan.tokens_sharding())
    batch = {"tokens": tokens, "targets": tokens, "positions": tokens}
    key, max_loss = jax.ShapeDtypeStruct((2,), jnp.uint32), jax.ShapeDtypeStruct((), jnp.float32)
    return step.build(opt_specs).lower(params, opt_state, batch, key, max_loss).compile()


MEMORY_M = (4, 8) if FAST else (2, 4, 8)
MEMORY_SCHEDULES = ("gpipe", "1f1b") if FAST else tuple(SCHEDULES)  # FAST: two compiles fewer per m
MiB = 2**20
memory, links = {}, {}
for name in MEMORY_SCHEDULES:
    for m in MEMORY_M:
        compiled = compiled_train_step(name, m)
        mem = compiled.memory_analysis()
        memory[name, m] = dict(
            temp=mem.temp_size_in_bytes,
            peak=mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes,
        )
        links[name, m] = stage_link_bytes(compiled.as_text(), mesh)

print(f"per device, MiB (micro-batch of {MICRO} sequences x {SEQ} tokens, split over dp = 4)")
print(f"{'schedule':>12s}{'m':>4s}{'held (sim.)':>13s}{'temporaries':>13s}{'peak':>9s}")
for name in MEMORY_SCHEDULES:
    for m in MEMORY_M:
        held = max(simulate(make_schedule(name, 2, m, SCHEDULES[name])).peak_in_flight)
        print(f"{name:>12s}{m:4d}{held:13d}{memory[name, m]['temp'] / MiB:13.2f}{memory[name, m]['peak'] / MiB:9.2f}")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for i, name in enumerate(MEMORY_SCHEDULES):
    ax.plot(MEMORY_M, [memory[name, m]["temp"] / MiB for m in MEMORY_M], "o-", color=f"C{i}", label=name)
ax.set_xscale("log", base=2)
ax.set_xticks(MEMORY_M, [str(m) for m in MEMORY_M])
ax.set_xlabel("micro-batches m (fixed micro-batch size)")
ax.set_ylabel("temporaries per device (MiB)")
ax.set_title("Compiled GPT train step, pp = 2 x dp = 4")
ax.grid(True, alpha=0.3)
ax.legend()
plt.tight_layout()
plt.show()

low, high = MEMORY_M[0], MEMORY_M[-1]
per_microbatch = (memory["gpipe", high]["temp"] - memory["gpipe", low]["temp"]) / (high - low)
print(f"gpipe: {per_microbatch / MiB:+.2f} MiB of temporaries per extra micro-batch (m = {low} -> {high})")
for name in MEMORY_SCHEDULES:
    if name != "gpipe":  # flat from m = 2p on (at m = p there is no steady state: see below)
        steady = tuple(m for m in MEMORY_M if m >= 4)
        temps = [memory[name, m]["temp"] for m in steady]
        print(f"{name}: temporaries {min(temps) / MiB:.2f} .. {max(temps) / MiB:.2f} MiB over m = {steady}")
# What the schedule itself says a stage holds (exact; the compiled temporaries above depend on XLA's buffer
# assignment, which differs between machines and versions, so they are shown, not asserted):
for m in MEMORY_M:
    assert max(simulate(make_schedule("gpipe", 2, m)).peak_in_flight) == m
    assert max(simulate(make_schedule("1f1b", 2, m)).peak_in_flight) <= 2

# %% [markdown]
# GPipe's temporaries grow by one micro-batch's saved activations (for the two layers of its stage) with
# every micro-batch added; 1F1B's do not move with `m`: it never holds more than `p` micro-batches. (With
# the full settings the table starts at `m = p = 2`, where 1F1B is GPipe: the warm-up and the first forward
# already cover both micro-batches, and the program has no steady-state loop.)
#
# The full settings add zero-bubble and interleaved (FAST mode leaves out their compiles). Both are flat in
# `m` too. Zero-bubble holds more than 1F1B at the same `m`: between a micro-batch's `B` and its `W` it
# keeps what the weight gradient needs (each layer's inputs and output gradients), which 1F1B's whole
# backward frees at once; a constant, not a multiple of `m`. Interleaved holds up to about `v·p` chunks of
# `1/v` of a stage each. `benchmarks/results/pipeline.json` has the same measurements for a larger GPT at
# `pp = 4 × dp = 2` and `pp = 2 × dp = 4`.
#
# ## 6. What crosses the stage boundary
#
# From the same compiled programs: the bytes of every `ppermute` between the two stages (`stage_link_bytes`,
# per data-parallel replica, loop bodies counted as often as they run). Each micro-batch sends its
# activations `[micro-batch / dp, seq, hidden]` (fp32) forward once and their gradient backward once.

# %%
activation = 4 * (MICRO // 4) * SEQ * model_config.hidden
print(f"one micro-batch's activations on one replica: {activation:,} B")
for (name, m), link in links.items():
    forward, backward = link[(0, 1)], link[(1, 0)]
    print(
        f"{name:>12s} m = {m:2d}: stage 0 -> 1 {forward:>9,} B = {forward / activation:4.1f} activations, "
        f"stage 1 -> 0 {backward:>9,} B = {backward / activation:4.1f}"
    )
    boundaries = SCHEDULES[name] * 2 - 1  # virtual-stage boundaries: v·p − 1
    assert forward + backward == 2 * boundaries * m * activation, (name, m)

# %% [markdown]
# Exactly `m` activations forward and `m` gradients backward per step over the stage boundary, whatever the
# schedule: the interpreter sends only what the table sends (a tick's `ppermute` carries only the stages
# that send then; ticks that repeat run as a loop). Interleaved has `v·p − 1` boundaries between virtual
# stages instead of `p − 1`, each carrying `m` each way: with `p = v = 2` (full settings) that is three, two
# of them from device 0 to device 1 and one back from device 1 to device 0 (the last stage's first chunk
# feeding the first stage's second), and the gradients take the same boundaries back: `3m` messages each
# way between the two devices.
#
# ## From the command line
#
# ```
# python train.py --preset tiny --pp 2 --dp 4 --pipeline-schedule zero-bubble --microbatches 4
# python train.py --preset tiny --pp 2 --dp 4 --pipeline-schedule interleaved --virtual-stages 2 --microbatches 4
# python train.py --preset tiny --pp 2 --sp 4 --attention ring --microbatches 4 --zero 1
# ```
#
# `--pp` composes with `--dp`, `--sp`, `--tp`, `--zero 0/1/3` and mixture-of-experts models (`--ep`,
# `06_moe.ipynb`). Bad settings stop with one line: fewer micro-batches than stages, layers not divisible
# by `pp·v`, `--virtual-stages` with a schedule other than interleaved, an unknown schedule.
# `benchmarks/pipeline.py` records each schedule's simulated bubble, compiled memory and tokens/s against
# `m` at `pp = 4 × dp = 2` and `pp = 2 × dp = 4`, for a toy model and the GPT.
