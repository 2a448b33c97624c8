# %% [markdown]
# # Mixture of experts with expert parallelism
#
# A mixture-of-experts (MoE) layer replaces a Transformer block's MLP by `E` smaller MLPs, the **experts**,
# and a **router** that sends each token to `k` of them (top-`k` of a softmax over the experts); the
# token's output is the gate-weighted sum of its `k` experts' outputs. The model holds `E` experts' weights
# but each token pays for `k`: Mixtral 8x7B has 46.7B parameters and uses 12.9B per token.
#
# **Expert parallelism** (the Ultra-Scale Playbook's fifth axis, `ep`) splits the experts over devices:
# each device routes its own tokens, sends each token to the device that holds its expert with an
# **all-to-all**, runs its experts on what it receives, and sends the results back with a second all-to-all
# (the backward runs the transposes: four per layer). Outside the MoE layers `ep` is one more data-parallel
# axis, so `ep = 8` alone is a valid mesh, and it composes with `dp`, `sp` (the experts see each device's
# local tokens) and `tp` (each expert's MLP split over `tp`, Megatron-style).
#
# Two ways to handle experts that receive more tokens than others:
#
# * **dropless** (jaxring's default): every assignment is computed; the tokens are sorted by expert and run
#   through a grouped matrix multiplication;
# * **capacity factor** `c`: each expert takes at most `C = ceil(c·T·k/E)` of a device's `T` tokens and
#   the rest are **dropped** (the residual connection carries them past the layer).
#
# Routers tend to send most tokens to a few experts, so training adds the Switch Transformer's
# load-balancing loss `E·Σᵢ fᵢ·Pᵢ` (`fᵢ` the fraction of assignments expert `i` gets, `Pᵢ` its mean router
# probability; 1 when perfectly balanced) and a router z-loss (the squared log-sum-exp of the router logits,
# which keeps them small).
#
# This notebook trains a tiny MoE GPT on three expert-parallel meshes next to one device, follows the MoE
# metrics over training, compares dropless with capacity 1.25, and counts the all-to-all bytes per layer on
# the compiled train step against the formula.

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
# ## 1. The `tiny-moe` GPT
#
# `RunSpec.of(preset="tiny-moe")` (`python train.py --preset tiny-moe`) is a 2-layer byte-level GPT of
# width 64 whose every block has 8 SwiGLU experts (hidden size 128 each), top-2 routing with the two gates
# renormalised to sum to 1 (as Mixtral), load-balancing loss weight 0.01 and z-loss weight 0.001, dropless.
# Any GPT preset becomes an MoE with `overrides` (`--override num_experts=8`); the fields are
# `num_experts`, `experts_per_token`, `expert_ffn`, `shared_expert_ffn`, `capacity_factor`,
# `aux_loss_weight`, `z_loss_weight`.

# %%
import dataclasses
import tempfile

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

from jaxring.models import gpt
from jaxring.run.spec import RunSpec
from jaxring.train.loop import train

STEPS = 3 if FAST else 300
BASE = RunSpec.of(
    model="gpt",
    preset="tiny-moe",
    seed=0,
    steps=STEPS,
    batch_size=8,
    seq_len=32 if FAST else 128,
    lr=3e-3,
    warmup=2 if FAST else 20,
    sample_tokens=0,
    eval_at_end=False,
    progress=False,
    log_every=STEPS,
)
config = gpt.get_config("tiny-moe")
moe = config.moe
print(
    f"tiny-moe: {config.num_layers} layers, hidden {config.hidden}, {moe.num_experts} experts of ffn {moe.ffn} "
    f"({moe.activation}), top-{moe.experts_per_token}, {'dropless' if moe.dropless else 'capacity'}; "
    f"{config.num_params() / 1e3:.0f}k parameters, {config.num_params(active=True) / 1e3:.0f}k used per token"
)
print(f"{STEPS} steps of {BASE.training.batch_size} sequences x {BASE.training.seq_len} tokens")

# %% [markdown]
# ## 2. Expert parallelism on three meshes, one loss curve
#
# * `ep = 4 × dp = 2`: two experts on each `ep` rank; the batch split over all 8 devices;
# * `ep = 2 × sp = 4`: four experts per rank; each sequence split over 4 devices (ring attention), the MoE
#   routing each device's quarter of the tokens;
# * `ep = 4 × tp = 2`: Megatron tensor parallelism for attention, and each expert's MLP split over `tp`.
#
# (FAST mode, the test run, trains 3 steps on the first mesh only; `tests/integration/test_moe_model.py` checks all.)
#
# `train()` returns each step's metrics, the MoE ones included: `moe_aux_loss` (the load-balancing loss),
# `moe_z_loss`, `load_imbalance` (the busiest expert's assignments over the mean), `drop_rate` (the
# fraction of assignments dropped), all averaged over the layers, and `moe_loss` (what the MoE adds to the
# objective: `0.01·aux + 0.001·z`, summed over the layers). The reported `loss` is the data loss alone.

# %%
MESHES = {
    "ep=4 × dp=2": dict(ep=4, dp=2),
    "ep=2 × sp=4": dict(ep=2, sp=4, attention="ring"),
    "ep=4 × tp=2": dict(ep=4, tp=2, tensor_parallel="megatron"),
}
if FAST:  # one compile per mesh: the test run keeps the first (tests/integration/test_moe_model.py covers the others)
    MESHES = {"ep=4 × dp=2": MESHES["ep=4 × dp=2"]}
METRICS = ("loss", "moe_aux_loss", "moe_z_loss", "load_imbalance", "drop_rate")


def run(cfg, use):
    """{metric: np.array over steps} of one training run (its run.yaml and metrics.jsonl go to a temporary
    directory)."""
    history = train(cfg.updated(out_dir=tempfile.mkdtemp(prefix="jaxring-run-")), devices=use, log=lambda *a: None)
    return {k: np.array([r[k] for r in history]) for k in METRICS}


runs = {"1 device": run(BASE, devices[:1])}
names = {"1 device": "1 device"}
for label, mesh in MESHES.items():
    cfg = BASE.updated(**mesh)
    runs[label] = run(cfg, devices)
    names[label] = cfg.plan(devices).describe()
    print(f"{label}: {names[label]}; loss {runs[label]['loss'][0]:.4f} -> {runs[label]['loss'][-1]:.4f}")

# %%
steps = np.arange(1, STEPS + 1)
fig, (ax_loss, ax_aux) = plt.subplots(1, 2, figsize=(13, 4))
for ax, key, title in (
    (ax_loss, "loss", "training loss (nats per byte)"),
    (ax_aux, "moe_aux_loss", "load-balancing loss (1 = balanced)"),
):
    ax.plot(steps, runs["1 device"][key], lw=8, alpha=0.25, color="k", label="1 device")
    for i, label in enumerate(MESHES):
        ax.plot(steps, runs[label][key], ls=["-", "--", ":"][i], lw=1.5, label=names[label])
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# Routing is a discrete choice: once rounding (a different order of the sums on another mesh) flips one
# token's top-2, the runs part ways, slowly. So the runs are compared where they must agree to rounding: the
# first 50 steps (all of them in FAST mode); the rest is printed.
SAME_STEPS = min(STEPS, 50)
TOL = 1e-4 if devices[0].platform == "cpu" else 2e-2
for label in MESHES:
    for key in ("loss", "moe_aux_loss"):
        relative = np.abs(runs[label][key] - runs["1 device"][key]) / np.abs(runs["1 device"][key])
        print(
            f"{label}, {key}: max relative difference from 1 device over the first {SAME_STEPS} steps "
            f"{relative[:SAME_STEPS].max():.1e}, over all {STEPS} steps {relative.max():.1e}"
        )
        assert relative[:SAME_STEPS].max() < TOL, (label, key)
    assert np.all(runs[label]["drop_rate"] == 0)

# %% [markdown]
# The curves coincide: dropless routing computes every assignment, so splitting the experts over devices
# changes only where each expert runs. The load statistics and losses are taken over the whole batch (summed
# over the devices that split the tokens), so the load-balancing loss is the one-device value too, and with
# it the gradient it adds. With the full settings, `ep = 4 × dp = 2` agrees with one device to about `1e-6`
# for some 80 steps; then a flipped routing decision makes the two runs drift apart, by under 1% of the loss
# at step 300 (measured on 8 simulated CPU devices).
#
# ## 3. The MoE metrics over training, dropless and with capacity 1.25
#
# Now the same model on `ep = 4 × dp = 2` with `capacity_factor = 1.25`: each expert takes at most
# `C = ceil(1.25·T·k/E)` assignments of a device's `T` tokens (here `T = 8·seq/8`, one device's share of
# the batch), 25% more than a perfectly balanced router would send it.

# %%
capacity_cfg = BASE.updated(**MESHES["ep=4 × dp=2"], overrides=dict(capacity_factor=1.25))
runs["capacity 1.25"] = run(capacity_cfg, devices)
local_tokens = BASE.training.batch_size * BASE.training.seq_len // 8
capacity = dataclasses.replace(moe, capacity_factor=1.25).capacity(local_tokens)
print(
    f"T = {local_tokens} tokens per device, k = {moe.experts_per_token}, E = {moe.num_experts}: "
    f"C = {capacity} slots per expert per device ({local_tokens * moe.experts_per_token / moe.num_experts:g} "
    f"if the router were balanced)"
)

fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
panels = (
    ("moe_aux_loss", "load-balancing loss"),
    ("moe_z_loss", "router z-loss"),
    ("load_imbalance", "load imbalance (max / mean)"),
    ("drop_rate", "drop rate"),
)
for ax, (key, title) in zip(axes, panels):
    ax.plot(steps, runs["ep=4 × dp=2"][key], "C0-", label="dropless")
    ax.plot(steps, runs["capacity 1.25"][key], "C3--", label="capacity 1.25")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
axes[2].axhline(1.0, color="gray", lw=0.8, ls=":")
axes[0].legend()
plt.tight_layout()
plt.show()

dropless, capped = runs["ep=4 × dp=2"], runs["capacity 1.25"]
print(f"{'':>14s}{'first step':>22s}{'last step':>22s}")
print(f"{'':>14s}{'dropless':>11s}{'cap. 1.25':>11s}{'dropless':>11s}{'cap. 1.25':>11s}")
for key in METRICS:
    print(f"{key:>14s}{dropless[key][0]:11.4f}{capped[key][0]:11.4f}{dropless[key][-1]:11.4f}{capped[key][-1]:11.4f}")
assert np.all(dropless["drop_rate"] == 0) and np.all(capped["drop_rate"] > 0)

# %% [markdown]
# At initialisation the router is far from balanced: in the first step (before any update) the busiest
# expert gets several times the mean load (about 2.5 in FAST mode, 3.1 with the full settings), because the
# embedded tokens share common directions that the router's random columns score unequally. With the full
# settings the load-balancing loss starts at about 1.6, rises for some steps while the imbalance grows
# (to about 3.6), then falls to about 1.0 by step 300, the load imbalance to about 1.3 with it. The z-loss
# (the mean squared log-sum-exp of the router logits) falls from about 7 to about 2 as the logits shrink.
#
# With capacity 1.25 the overloaded experts drop what does not fit: a large fraction of the assignments
# (an expert with 2.5 times the mean load needs twice its capacity), falling as the router balances.
# Dropped assignments skip their expert (the token keeps its residual, and its other expert if that one
# had room), so the losses differ from the dropless run's; how much is dropped depends on the mesh, since
# the capacity counts each device's own tokens.
#
# ## 4. All-to-all bytes per MoE layer
#
# Per MoE layer and step, each device sends its tokens to their experts' devices and receives them back:
# two all-to-alls forward, and their two transposes in the backward. Each all-to-all exchanges a buffer of
# fixed shape, of which a device keeps `1/ep` and receives `(ep − 1)/ep` from the others (fp32, `h = 64`):
#
# | dispatch | buffer per device | all-to-alls per layer and step |
# |---|---|---|
# | dropless | `[ep, T·min(k, E/ep), h]`: room for every token's assignments to each rank | 4, plus one of int32 `[ep, E/ep]` counts (forward only) |
# | capacity `c` | `[E, C, h]`, `C = min(T, ceil(c·T·k/E))` | 4 |
#
# We compile the whole train step (forward, backward, gradient reduction, AdamW) on `ep = 4 × dp = 2` with
# abstract inputs and count the all-to-all bytes each device receives in the compiled program (loop bodies,
# here the scan over the layers, counted as often as they run).

# %%
import jax.numpy as jnp
import optax
from flax import nnx

from jaxring.analysis.compiled import collective_traffic
from jaxring.parallel.plan import ParallelPlan
from jaxring.train.step import TrainStep

EP_MESH = dict(ep=4, dp=2)
plan = ParallelPlan(jaxring.make_mesh(devices=devices, **EP_MESH))
H, E, K, L = config.hidden, moe.num_experts, moe.experts_per_token, config.num_layers
ep = EP_MESH["ep"]
T = BASE.training.batch_size * BASE.training.seq_len // (EP_MESH["ep"] * EP_MESH["dp"])  # tokens per device


def abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def compiled_train_step(model_config):
    """The GPT train step on `plan`, compiled for abstract inputs."""
    model = gpt.GPT(model_config, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    tx = optax.adamw(1e-3)
    step = TrainStep(plan, model, tx, gpt.NextTokenObjective(BASE.training.batch_size, BASE.training.seq_len))
    params = abstract(nnx.to_pure_dict(state), step.shardings(step.param_specs))
    opt_specs = step.opt_state_specs(params)
    opt_state = abstract(jax.eval_shape(tx.init, params), step.shardings(opt_specs))
    tokens = jax.ShapeDtypeStruct(
        (BASE.training.batch_size, BASE.training.seq_len), jnp.int32, sharding=plan.tokens_sharding()
    )
    batch = {"tokens": tokens, "targets": tokens, "positions": tokens}
    key, max_loss = jax.ShapeDtypeStruct((2,), jnp.uint32), jax.ShapeDtypeStruct((), jnp.float32)
    return step.build(opt_specs).lower(params, opt_state, batch, key, max_loss).compile()


def formula_bytes(capacity_factor):
    """(bytes per layer and step, all-to-alls per layer and step) received per device."""
    if capacity_factor is None:
        buffer = ep * T * min(K, E // ep) * H * 4
        counts = (ep - 1) * E * 4 // ep  # int32 [ep, E/ep], forward only
        return 4 * ((ep - 1) * buffer // ep) + counts, 5
    capacity = dataclasses.replace(moe, capacity_factor=capacity_factor).capacity(T)
    return 4 * ((ep - 1) * E * capacity * H * 4 // ep), 4


print(f"ep = {ep} x dp = {EP_MESH['dp']}: T = {T} tokens per device, k = {K}, E = {E}, h = {H}, {L} MoE layers")
print(f"{'dispatch':>14s}{'measured / layer':>18s}{'formula':>10s}{'all-to-alls / layer':>21s}{'buffer rows':>18s}")
measured = {}
for label, cf in (("dropless", None), ("capacity 1.25", 1.25)):
    compiled = compiled_train_step(dataclasses.replace(config, capacity_factor=cf))
    moved, ops = collective_traffic(compiled.as_text(), len(devices))
    per_layer, formula = moved["all-to-all"] / L, formula_bytes(cf)
    rows = ep * T * min(K, E // ep) if cf is None else E * dataclasses.replace(moe, capacity_factor=cf).capacity(T)
    measured[label] = per_layer
    print(f"{label:>14s}{per_layer:>18,.0f}{formula[0]:>10,}{ops['all-to-all'] / L:>21g}{rows:>12,} rows")
    assert per_layer == formula[0] and ops["all-to-all"] == formula[1] * L, (label, moved, ops)
print(f"the tokens' assignments: T·k = {T * K} rows per device")

# %% [markdown]
# The compiled program moves exactly the formula's bytes: four all-to-alls of the token buffer per layer and
# step, plus the dropless path's small exchange of counts (how many rows each rank sends to each of the
# receiver's experts, so it can run them as groups).
#
# The buffers are static shapes, so they have room for the worst case, not for the assignments the router
# made. The dropless buffer holds `T·min(k, E/ep)` rows per destination (every token could send all its
# `k` assignments to one rank), `ep·min(k, E/ep)` = 8 times `T` here against the `T·k = 2T` assignments a
# device actually has: four times the routed tokens, the price of never dropping with fixed shapes. The
# capacity buffer holds `E·C ≈ c·T·k` rows, 1.25 times the assignments, so capacity 1.25 moves less than a
# third of dropless's bytes here, at the cost of the drops in section 3. (An exchange sized by the actual
# counts, as `lax.ragged_all_to_all` does where it runs, would move about `T·k·(ep−1)/ep` rows.)
#
# ## From the command line
#
# ```
# python train.py --preset tiny-moe --ep 4 --dp 2
# python train.py --preset tiny-moe --ep 2 --sp 4 --attention ring
# python train.py --preset tiny-moe --ep 4 --tp 2 --override capacity_factor=1.25
# python train.py --preset tiny-moe --ep 2 --pp 2 --dp 2 --microbatches 2
# ```
#
# The progress bar shows `moe_aux_loss`, `load_imbalance` and `drop_rate`, and `--metrics-file` records
# every MoE metric per step. Experts not divisible by `ep`, `experts_per_token` above `num_experts` and a
# capacity factor ≤ 0 are refused with one line. `benchmarks/moe.py` records tokens/s, compiled peak
# memory and all-to-all bytes per device for the MoE block and for whole MoE GPTs at `ep` = 1, 2, 4, 8,
# dropless against capacity 1.25; `05_pipeline.ipynb` covers pipeline parallelism (`--pp`), which the MoE
# GPT composes with.
