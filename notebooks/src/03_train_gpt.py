# %% [markdown]
# # Training a GPT on different meshes
#
# This notebook trains jaxring's tiny GPT (byte-level, on a bundled corpus made of the Python standard
# library's own source files, so nothing is downloaded) from the same seed on four different device meshes:
#
# * **A**: the sequence split over all devices (`sp`), **ring attention** with the zig-zag layout;
# * **B**: data parallel × **Megatron tensor parallel** (`dp=2 × tp=4`): weights split by heads and MLP
#   columns, activations split along the sequence between blocks;
# * **C**: **tensor × sequence parallel** (`dp=2 × tp=2 × sp=2`): Megatron over `tp` inside ring attention
#   over `sp`, as long-context runs combine them (tensor parallel within a node, context parallel across);
# * **D**: **ZeRO-3** over `dp=4 × sp=2`: parameters, gradients and optimizer state sharded over all 8
#   devices between steps, each layer's weights all-gathered when the layer runs.
#
# The four loss curves coincide. Then we generate text from the trained model, save a checkpoint from mesh B,
# restore it onto a fifth mesh **E** (`dp=2 × sp=4`, ring attention), check that every restored parameter is
# bit-for-bit the saved one, and keep training there.
#
# Every run is one SPMD program: the whole train step (forward, backward, gradient reduction and the
# optimizer update) is one `jit` over one `shard_map` across the mesh, and the layers are stacked and run
# by one `lax.scan`, so the step compiles once whatever the depth.
#
# On a CPU-only machine JAX simulates 8 devices. With fewer devices the meshes shrink (a power of two of
# them is used); on a runtime with a single GPU all the runs use that one device. On a TPU runtime (a TPU VM
# or Colab's) the runs use its chips, in bf16, with jaxring's Pallas TPU kernels as the attention's block
# compute (both chosen by default there).

# %%
# On Colab: install jaxring beside the runtime's own jax and its GPU or TPU plugin (kept as they are).
# Locally: bash tools/setup.sh notebooks.
import os
import shutil
import sys

if "google.colab" in sys.modules:
    # %pip install -q "jaxring @ git+https://github.com/jaxring/jaxring"
    pass

# FAST=1 (set by the tests) keeps every size small; leave it unset to see realistic sizes.
FAST = os.environ.get("JAXRING_NOTEBOOK_FAST", "0") == "1"

import jaxring
from jaxring.core.device_setup import describe_devices, use_cpu_devices_if_no_accelerator

# The accelerators if there are any, else 8 simulated CPU devices. This must run before anything asks JAX
# for its devices (afterwards the CPU device count is fixed).
devices = use_cpu_devices_if_no_accelerator(8)
print("devices:", describe_devices(devices), "| FAST mode" if FAST else "")

# %% [markdown]
# ## 1. Settings
#
# `jaxring.run.spec.RunSpec` is the run specification: everything `python train.py` takes as flags, in typed
# sections (`model`, `training`, `optimizer`, `parallel`, `output`, ...). `RunSpec.of(...)` takes the flags'
# names with underscores (`--batch-size` is `batch_size=`) and `spec.updated(...)` changes some of them in a
# copy. Among them: the model preset, the mesh degrees (`dp`, `fsdp`, `tp`, `sp`; they must multiply to the
# number of devices used), each axis's strategy (`attention=`, `layout=`, `tensor_parallel=`), the ZeRO
# stage (`zero=`), the optimizer (AdamW with linear warmup and cosine decay), and output options.
# `overrides` (`--override FIELD=VALUE`) changes fields of the preset; in FAST mode the tiny preset is cut
# down to two layers of width 64 and 64-token sequences. `spec.plan(devices)` is the `ParallelPlan` the
# run would use (what `jaxring.make_plan(**settings)` builds from the same settings).
#
# `sample_tokens=0` and `eval_at_end=False` switch off what `train()` does after the last step (a text
# sample and a held-out loss): we do those ourselves below. `progress=False` prints a line every
# `log_every` steps instead of a progress bar. `out_dir` is where a run writes its resolved settings
# (`run.yaml`) and its metrics (`metrics.jsonl`); here a temporary directory.

# %%

import tempfile

import jax
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

from jaxring.run.spec import RunSpec
from jaxring.train.loop import Trainer, train

N = min(8, 2 ** (len(devices).bit_length() - 1))  # a power of two of the devices, at most 8
use = devices[:N]
half = N // 2
MESHES = {
    "A": dict(sp=N, attention="ring", layout="zigzag") if N > 1 else {},
    "B": dict(dp=2, tp=half, tensor_parallel="megatron") if half > 1 else dict(dp=N),
    "C": dict(dp=N // 4, tp=2, sp=2, attention="ring", tensor_parallel="megatron") if N >= 4 else dict(dp=N),
    "D": dict(dp=half, sp=2, attention="ring", zero=3) if N > 1 else {},
    "E": dict(dp=2, sp=half, attention="ring") if half > 1 else dict(dp=N),
}

STEPS = 20 if FAST else 150
BASE = RunSpec.of(
    model="gpt",
    preset="tiny",
    seed=0,
    steps=STEPS,
    batch_size=8,
    seq_len=64 if FAST else 128,
    overrides=dict(num_layers=2, hidden=64, num_heads=8, ffn=128) if FAST else {},
    lr=3e-3,
    warmup=5 if FAST else 20,
    sample_tokens=0,
    eval_at_end=False,
    progress=False,
    log_every=5 if FAST else 50,
    out_dir=tempfile.mkdtemp(prefix="jaxring-run-"),
)
CFG = {label: BASE.updated(**mesh) for label, mesh in MESHES.items()}
NAME = {label: cfg.plan(use).describe() for label, cfg in CFG.items()}
print(f"{STEPS} steps of {BASE.training.batch_size} sequences x {BASE.training.seq_len} tokens on {N} devices")
for label, name in NAME.items():
    print(f"  mesh {label}: {name}")

# %% [markdown]
# ## 2. Four meshes, one loss curve
#
# `train(cfg, devices=...)` is what `python train.py` runs: it builds the mesh and the plan, the model and
# the optimizer, trains, and returns one dict per step (`loss`, `grad_norm`, `tokens_per_s`, `step_time_s`,
# ...). Its first line describes the run. Mesh A first:

# %%
history_a = train(CFG["A"], devices=use)
losses = {"A": np.array([record["loss"] for record in history_a])}

# %% [markdown]
# Like every `python train.py` run, it wrote its resolved settings to `OUT_DIR/run.yaml` (the defaults filled
# in: the mesh degrees, the layout, the ZeRO stage, the strategy's options) and one JSON line per step to
# `OUT_DIR/metrics.jsonl`. `python train.py --config run.yaml` repeats the run; flags given with it override
# the file (`--print-config` prints the resolved YAML without training).

# %%
import json

out_dir = CFG["A"].output.out_dir
print(f"{out_dir}: {sorted(os.listdir(out_dir))}")
with open(os.path.join(out_dir, "run.yaml")) as f:
    run_yaml = f.read()
print(run_yaml[run_yaml.index("parallel:") : run_yaml.index("data:")], end="")  # the mesh and its strategies
assert RunSpec.load(os.path.join(out_dir, "run.yaml")).parallel.layout == "zigzag"  # a spec again
with open(os.path.join(out_dir, "metrics.jsonl")) as f:
    first = json.loads(f.readline())
print("metrics.jsonl, step 1:", {k: first[k] for k in ("step", "loss", "grad_norm", "tokens_per_s")})

# %% [markdown]
# `train()` is a loop around a `Trainer`, which holds the plan, the parameters (placed with their
# shardings on the mesh) and the optimizer state. `trainer.step()` runs one jitted update on the next batch
# and returns its loss and gradient norm. We drive meshes B, C and D with a `Trainer` directly, because we
# keep using their trained models below.

# %%
trainers = {}
for label in ("B", "C", "D"):
    trainers[label] = Trainer(CFG[label], devices=use)
    losses[label] = np.array([float(trainers[label].step()["loss"]) for _ in range(STEPS)])
    print(f"mesh {label} ({trainers[label].plan.describe()}): loss {losses[label][0]:.4f} -> {losses[label][-1]:.4f}")
trainer_b = trainers["B"]

# %%
steps = np.arange(1, STEPS + 1)
fig, ax = plt.subplots(figsize=(8, 4))
ax.plot(steps, losses["A"], lw=6, alpha=0.3, label=f"A: {NAME['A']}")
for label, style, width in (("B", "k--", 1.2), ("C", "C1:", 3.0), ("D", "C2-.", 1.2)):
    ax.plot(steps, losses[label], style, lw=width, label=f"{label}: {NAME[label]}")
ax.set_xlabel("step")
ax.set_ylabel("training loss (cross-entropy, nats per byte)")
ax.set_title("Same seed, four meshes")
ax.xaxis.set_major_locator(MaxNLocator(integer=True))
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# The meshes differ only in rounding (the order of sums): about 1e-7 of the loss at first. Training amplifies
# such differences: on CPU they stay near 1e-7 for some 40 steps, then grow (mesh B: 1e-6 at step 60, 2e-4 at
# 100, 2e-3 at 150), as any two runs of the same model do. GPUs may use TF32 matmuls for fp32.
EARLY = min(STEPS, 40)
TOL_EARLY, TOL = (1e-5, 2e-2) if devices[0].platform == "cpu" else (2e-2, 5e-2)
for label in ("B", "C", "D"):
    relative = np.abs(losses[label] - losses["A"]) / np.abs(losses["A"])
    print(
        f"|loss_{label} - loss_A| / loss_A: at most {relative[:EARLY].max():.1e} over the first {EARLY} steps, "
        f"{relative.max():.1e} over all {STEPS}"
    )
    assert relative[:EARLY].max() < TOL_EARLY and relative.max() < TOL, label

# %% [markdown]
# The four curves lie on top of each other. All runs start from the same parameters (the model is built
# on the host from the seed, then placed on the mesh) and see the same batches (each batch is a function of
# the seed and the step), so the meshes differ only in how each step's arithmetic is split across devices.
# The printed differences are floating-point rounding: sums are taken in a different order when the work is
# split differently.
#
# What each device holds and sends differs a lot between them. On C every attention layer runs Megatron's
# all-gathers and reduce-scatters over `tp` around a ring over `sp`: inside attention each device holds
# half of the sequence for half of the heads, and between layers a quarter of the sequence. On D every
# weight lives in eighths between steps; the step all-gathers each layer's weights just before the layer
# runs (again in the backward) and reduce-scatters its gradient, so a device holds whole weights only for
# the layer it is computing (and the embedding table), never the whole model, its gradient or its
# optimizer state.
# `02_strategies.ipynb` measures both: the bytes of a tensor × sequence parallel layer and each ZeRO
# stage's bytes and memory.

# %% [markdown]
# ## 3. Generating text
#
# `jaxring.models.generate.generate(model, plan, prompts, max_new_tokens, temperature=..., top_k=..., top_p=..., key=...)`
# samples one byte at a time for a batch of prompts (`stop_tokens=` ends a prompt at its first end-of-sequence
# id, as `eos_token_id` does in transformers): one forward pass over the prompts fills a KV cache
# (sharded over the plan's `sp` like the training sequence), then each new token attends that cache. Here we
# gather the trained parameters onto a single device and use a one-device plan (`plan=None` does the same).
# The corpus object encodes text to byte ids and decodes ids back to text.

# %%
from flax import nnx

from jaxring.models.generate import generate
from jaxring.parallel.plan import ParallelPlan

one_device = ParallelPlan(jaxring.make_mesh(devices=use[:1]))
graphdef, state = nnx.split(trainer_b.model())
model = nnx.merge(graphdef, jax.device_put(state, use[0]))  # the trained weights, all on one device

corpus = trainer_b.task.source
prompt = list(corpus.encode("def "))
(ids,) = generate(model, one_device, [prompt], 120 if FAST else 400, temperature=0.8, key=jax.random.PRNGKey(0))
print(corpus.decode(prompt + ids))

# %% [markdown]
# How Python-like this looks depends on how long the model trained: after the few steps of FAST mode the
# model has learnt little more than which bytes are common, so expect mostly noise there. After the 300
# steps of the full settings it writes indented, Python-shaped lines (`if ...:`, `name = thing(...)`,
# `self.`) made mostly of invented words.

# %% [markdown]
# ## 4. Save on one mesh, restore onto another
#
# `jaxring.train.checkpoint.Checkpointer` writes orbax checkpoints: each host writes the shards it owns, in
# the background, into a temporary directory that is renamed to the step number only when complete.
# `trainer.state()` is what a checkpoint holds (parameters and optimizer state) and `trainer.metadata()`
# records the model config and the mesh.

# %%
from jaxring.train.checkpoint import Checkpointer

ckpt_dir = tempfile.mkdtemp(prefix="jaxring-gpt-")
ckpt = Checkpointer(ckpt_dir, keep=2)
ckpt.save(trainer_b.step_count, trainer_b.state(), metadata=trainer_b.metadata())
ckpt.wait()  # the save runs in the background
saved = jax.tree.map(np.asarray, trainer_b.params)  # host copies, to compare with below
print(f"saved steps {ckpt.all_steps()} in {ckpt_dir}: {sorted(os.listdir(ckpt_dir))}")
print("saved from mesh:", ckpt.metadata()["mesh"])

# %% [markdown]
# A `Trainer` for mesh E builds its own (freshly initialised) state with mesh E's shardings;
# `trainer.restore(ckpt)` replaces it with the latest checkpoint, every array read directly into its layout
# on the new mesh. It first checks that the checkpoint's model config equals this trainer's (restoring a
# different model is an error).

# %%
trainer_e = Trainer(CFG["E"], devices=use)
trainer_e.restore(ckpt)

restored = jax.tree.map(np.asarray, trainer_e.params)
leaves_saved, leaves_restored = jax.tree.leaves(saved), jax.tree.leaves(restored)
identical = sum(np.array_equal(a, b) for a, b in zip(leaves_saved, leaves_restored))
print(
    f"restored at step {trainer_e.step_count}: {identical} of {len(leaves_saved)} parameter arrays "
    f"are bit-for-bit the saved ones"
)
assert identical == len(leaves_saved)

# The layers' weights are stacked: params["blocks"]["attn"]["wq"] is [num_layers, hidden, heads * head_dim]
for label, trainer in (*trainers.items(), ("E", trainer_e)):
    wq = trainer.params["blocks"]["attn"]["wq"]
    print(
        f"mesh {label} ({trainer.plan.describe()}):\n    attention wq {wq.shape} has spec "
        f"{wq.sharding.spec}, each device holds {wq.addressable_shards[0].data.shape}"
    )

# %% [markdown]
# The layers are stacked, so each weight has a leading layer dimension that no mesh splits (a pipeline
# would). Under Megatron (mesh B) each device holds only its heads' columns of `wq`, a quarter of them;
# with `tp=2` on mesh C, half of them. Under ZeRO-3 (mesh D) each device holds an eighth of every weight
# between steps, split over both replica axes (`dp` and `sp`) along a dimension that divides. On mesh E the
# weights are replicated and each device holds all of them. The checkpoint does not depend on the mesh it
# was written from. The optimizer state (Adam's moments and its step counter) came back too, so training
# resumes where it stopped. Below, B and E each take a few more steps from the same state; the
# learning-rate schedule has ended after `STEPS` steps, so both continue at its final value.

# %%
EXTRA = 5 if FAST else 20
more_b = np.array([float(trainer_b.step()["loss"]) for _ in range(EXTRA)])
more_e = np.array([float(trainer_e.step()["loss"]) for _ in range(EXTRA)])
ckpt.close()
shutil.rmtree(ckpt_dir)  # the checkpoint was only for this demo

after = np.arange(STEPS + 1, STEPS + EXTRA + 1)
shown = steps > STEPS - 2 * EXTRA  # the steps just before the checkpoint
fig, ax = plt.subplots(figsize=(8, 4))
ax.plot(
    np.concatenate([steps[shown], after]),
    np.concatenate([losses["B"][shown], more_b]),
    "k-",
    lw=1.2,
    label=f"B: {NAME['B']}",
)
ax.plot(after, more_e, "o", color="C1", ms=5, label=f"E: {NAME['E']}, restored from B's checkpoint")
ax.axvline(STEPS + 0.5, color="gray", ls=":", label=f"checkpoint (step {STEPS})")
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.xaxis.set_major_locator(MaxNLocator(integer=True))
ax.legend()
plt.tight_layout()
plt.show()

relative = np.abs(more_b - more_e) / np.abs(more_b)
print(f"losses at steps {STEPS + 1}..{STEPS + min(EXTRA, 5)}")
print(f"  B: {np.round(more_b[:5], 4).tolist()}")
print(f"  E: {np.round(more_e[:5], 4).tolist()}")
print(f"max |loss_B - loss_E| / loss_B: {relative.max():.1e}")
assert relative.max() < TOL

# %% [markdown]
# Training continues on mesh E exactly as it does on mesh B, up to rounding. This is what
# `python train.py --checkpoint-dir DIR --resume` does with different mesh flags: move a run to another
# device layout without losing anything.
#
# **Next:** `04_dit.ipynb` trains a Diffusion Transformer on images, with its patch sequence split over
# devices, and shows the images it samples.
