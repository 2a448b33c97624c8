# %% [markdown]
# # Planning a long-sequence run
#
# Which mesh, sequence strategy, tensor method, ZeRO stage, pipeline schedule, remat and micro-batch should a
# run use? `jaxring.planner` answers by searching every plan the library can run for a workload on a cluster
# and ranking the ones that fit in memory by a predicted step time. Its cost model
# (`jaxring/planner/cost_model.py`, one file) writes down the papers' formulas: the bytes each strategy moves over
# each mesh axis (ring attention, Ulysses, USP, WallFacer, RSA, Megatron, METP, Optimus, ZeRO, pipelines,
# experts), what each device keeps for the backward, and FLOPs.
#
# This notebook
#
# 1. prints the planner's ranked table for GPT-7B at 128k tokens on H100s (what
#    `python -m jaxring.planner ...` prints), with the reasons other plans were rejected;
# 2. checks the predictions for a small GPT on 8 simulated CPU devices against the compiled train step:
#    predicted vs compiled memory per device (with remat none, selective and full) and bytes moved per mesh
#    axis;
# 3. shows the planner's choice for the WallFacer and METP papers' settings beside the configurations the
#    papers found best (from `benchmarks/results/planner.json`, written by `benchmarks/planner.py`).
#
# Nothing here needs a GPU: the planner predicts, and the checks compile (never run) the step.

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

from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator

# 8 simulated CPU devices for the compile checks of section 2 (the planner itself runs nothing on a device).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
devices = use_cpu_devices_if_no_accelerator(8)
print(len(devices), "devices:", devices[0].platform, "| FAST mode" if FAST else "")

# %% [markdown]
# ## 1. The ranked table
#
# A workload is a model preset, a sequence length and a global batch; a cluster is a device type and count
# (8 per node, NVLink inside a node, one 50 GB/s NIC per GPU across nodes, the FLOPs at 50% of the dense bf16
# peak: all settable). `search` validates every candidate with the library's own rules (the same one-line
# errors `train.py` gives), predicts its memory and step time, and ranks the plans that fit.
#
# The same from a shell:
#
#     python -m jaxring.planner --model gpt --preset 7b --seq-len 131072 --global-batch-tokens 4M \
#         --devices 64 --device h200 --top 10          # --json for the whole result

# %%
import time

from jaxring.planner import Cluster, Workload, search

DEVICES = 8 if FAST else 64
w = Workload.of("gpt", "7b", seq_len=131072, global_batch_tokens=131072 * DEVICES // 8, precision="bf16")
cluster = Cluster.of("h100", DEVICES)
t = time.perf_counter()
result = search(w, cluster)
print(f"{w.describe()} on {cluster.describe()}")
print(
    f"{result.considered:,} plans considered, {len(result.ranked):,} fit "
    f"(searched in {time.perf_counter() - t:.1f} s)\n"
)
print(result.table(top=8))
print()
print(result.rejections())

# %% [markdown]
# Each row is a plan (mesh degrees, sequence strategy and its options, tensor method, ZeRO stage, pipeline
# schedule, remat, micro-batch), its predicted step time, throughput and MFU, its predicted memory per
# device, and the communication it cannot hide (the ring loops' transfers overlap the attention compute;
# other collectives are exposed). The best plan's step, split into its parts:

# %%
best = result.best
print("best:", best.candidate.describe())
print("train.py flags:", " ".join(best.candidate.train_flags()))
t_ = best.time
print(
    f"step {t_.total:.2f} s = compute {t_.compute:.2f} + exposed communication "
    f"{sum(t_.communication.values()):.2f} + bubble {t_.bubble:.2f} + optimizer {t_.optimizer:.3f} "
    f"(communication hidden behind compute: {t_.hidden:.2f} s)"
)
m = best.memory
GiB = 2**30
print(
    f"memory per device {m.total / GiB:.1f} GiB = weights {m.params / GiB:.1f} + Adam {m.optimizer / GiB:.1f} "
    f"+ batch {m.other / GiB:.2f} + max(backward: saved activations {m.activations / GiB:.1f} + max(gradients "
    f"{m.gradients / GiB:.1f} + working {m.working / GiB:.1f}, head {m.head / GiB:.1f}), update {m.update / GiB:.1f})"
)

# %% [markdown]
# An impossible request gets one line naming the tightest constraint:

# %%
from jaxring.planner import NoPlanError

try:
    search(Workload.of("gpt", "7b", seq_len=1 << 21, global_batch=1), Cluster.of("h100", 8))
except NoPlanError as e:
    print(e)

# %% [markdown]
# ## 2. Predictions against the compiled step
#
# The cost model is only as good as its agreement with what XLA compiles. For a small GPT on the 8 simulated
# CPU devices we ask the planner for its best plan, compile that plan's train step (the trainer's own, on
# abstract inputs: nothing runs), and compare
#
# * memory per device: the compiled program's arguments + outputs + temporaries - donated buffers, against
#   the prediction (weights, Adam moments, gradients, the activations each layer saves for the backward,
#   one layer's backward working set), for remat none, selective and full: the remat policy decides what
#   each layer saves (none: every residual; selective: the layer input and the weight matmuls' outputs;
#   full: the layer input only);
# * bytes received per device over each mesh axis group, read from the compiled HLO (loop bodies counted
#   times their trip count), against the formulas. (XLA:CPU sends collectives in fp32, so the CPU check
#   counts 4 bytes per element.)

# %%

from jaxring.analysis.axis_traffic import axis_traffic
from jaxring.aot.train_step import compile_train_step
from jaxring.models import gpt
from jaxring.planner import cost_model as cost
from jaxring.planner.params import param_leaves

small = Workload(
    "gpt",
    gpt.GPTConfig(vocab_size=128, num_layers=2, hidden=64, num_heads=8, ffn=256),
    seq_len=512 if FAST else 2048,
    global_batch=1,
    precision="fp32",
)
cpu_result = search(small, Cluster.of("cpu", 8))
top = cpu_result.best.candidate
print(f"{small.describe()}: the planner's best plan on 8 CPU devices is {top.describe()}\n")


def compiled_step(w, c):
    plan = c.check(w, devices=devices[: c.devices])
    return plan, compile_train_step(
        w.model,
        w.config,
        plan,
        batch=w.global_batch,
        seq_len=w.seq_len,
        precision=w.precision,
        memory=c.memory.policy,
        grad_accum=c.steps(w) if c.pp == 1 else 1,
    )


MB = 1e6
rows = []
for remat in ("none", "selective", "full"):
    c = top.with_memory(remat=remat)
    plan, compiled = compiled_step(small, c)
    ma = compiled.memory_analysis()
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes
    predicted = cost.memory(small, c, param_leaves(small.model, small.config, plan), cpu=True)
    rows.append((remat, predicted, peak))
    if remat == "none":
        top_plan, top_compiled = plan, compiled
print(f"{'remat':10s} {'predicted MB':>13s} {'compiled MB':>12s} {'ratio':>6s}   saved activations (predicted)")
for remat, predicted, peak in rows:
    print(
        f"{remat:10s} {predicted.total / MB:13.2f} {peak / MB:12.2f} {predicted.total / peak:6.2f}   "
        f"{predicted.activations / MB:.2f} MB"
    )

# %% [markdown]
# Remat shrinks the saved activations as predicted (the compiled step applies the layers' checkpoint policy).
# With full remat the prediction errs high at these tiny sizes: it counts one layer's recomputed residuals
# and the attention core's buffers as live together, which the compiled step partly avoids; on the GPU
# topology at real sizes the top plans' predictions are within 15% (`tests/unit/planner/test_planner.py`).

# %%
leaves = param_leaves(small.model, small.config, top_plan)
predicted_bytes = cost.bytes_by_axes(cost.traffic(small, top, leaves, cpu=True))
measured_bytes = axis_traffic(top_compiled.as_text(), top_plan.run_mesh)
print(f"bytes received per device per step, {top.describe()}:")
print(f"{'axes':24s} {'predicted':>12s} {'compiled':>12s}")
for axes in sorted(set(predicted_bytes) | set(measured_bytes)):
    print(f"{'×'.join(axes):24s} {predicted_bytes.get(axes, 0):12,.0f} {measured_bytes.get(axes, 0):12,.0f}")
print("\nwhat the formulas count:")
for tr in cost.traffic(small, top, leaves, cpu=True):
    print(f"  {'×'.join(tr.axes):10s} {tr.bytes:12,.0f}  {tr.what}")

# %% [markdown]
# `tests/unit/planner/test_planner.py` makes the same checks for every sequence strategy, tensor method, ZeRO stage,
# a pipeline, experts and the DiT (bytes exactly equal), and for the top plans of three workloads (memory
# within 15%). Where the compile-only CUDA plugin is installed (`pip install -e ".[gpu-compile]"` in a venv
# of its own) the planner compiles its top plans for the real GPU topology without a GPU:
# `python -m jaxring.planner ... --compile-check 3` adds a "compiled" column to the table.

# %% [markdown]
# ## 3. The papers' settings
#
# `benchmarks/planner.py` runs the planner on the settings of the WallFacer paper (GPT-7B on 8-64 H100 at
# 64k-512k tokens; DiT-1B on A100-40GB nodes joined by Ethernet) and the METP paper (LLaMA-7B on one node of
# 8 A100-80GB at 32k-256k), and predicts the configurations those papers found best (WallFacer with C = 4 on
# 8-GPU nodes; METP at tp = 8) and their baselines (ring attention; Megatron TP+SP), with --remat full as
# both papers checkpoint every layer. These are predictions of the cost model, not measured step times.

# %%
import json
import pathlib

RESULTS = pathlib.Path("../benchmarks/results/planner.json")
if not RESULTS.exists():
    RESULTS = pathlib.Path("benchmarks/results/planner.json")
if RESULTS.exists():
    record = json.loads(RESULTS.read_text())

    def brief(p):
        if "none" in p:
            return "nothing fits"
        if "refused" in p:
            return f"{p['plan']} (refused)"
        fits = "" if p.get("fits", True) else ", does not fit"
        return f"{p['plan']}: {p['step_s']:.3g} s, {p['memory_bytes']['total'] / GiB:.0f} GiB{fits}"

    for row in record["results"]:
        print(f"{row['paper']:9s} {row['setting']}")
        print(f"  planner            {brief(row['planner'])}")
        print(f"  within paper space {brief(row['planner_in_paper_space'])}")
        print(f"  paper's best       {brief(row['paper_best'])}")
        print(f"  paper's baseline   {brief(row['paper_baseline'])}")
else:
    print("benchmarks/results/planner.json is not here (run python benchmarks/planner.py from the repository)")

# %% [markdown]
# Where the planner's overall choice differs from the paper's, it found a plan outside the paper's search
# space (another mesh, a tensor method with the sequence split, a pipeline) that the cost model predicts to
# be faster; "within paper space" restricts the search to the paper's own choices (WallFacer's Eq. 8:
# every GPU on the sequence, any team size and placement; METP: tp = 8) and shows whether the cost model
# agrees with the paper's ranking there.
