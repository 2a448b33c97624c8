# %% [markdown]
# # Extending a model's context: RoPE scaling, ring attention, and proving the long context is used
#
# Long-context models are rarely trained long from scratch. They are trained at a short context, then their
# RoPE is rescaled (a larger `rope_theta`, or YaRN / llama3 factors) and training continues for a while on
# long documents, with the sequence split over devices (ring attention). Whether it worked is judged by
# **loss by position** (do tokens far into the context get predicted better?) and **pass-key retrieval**
# (needle in a haystack: a five-digit key hidden at some depth of filler text, asked for at the end).
#
# This notebook does the whole recipe on a CPU in a few minutes, at toy scale:
#
# 1. train a tiny Llama-shaped byte-level model at **256 tokens** (plain RoPE, theta 10,000);
# 2. export it as a Hugging Face directory, change its RoPE to **YaRN with factor 8** (original context 256),
#    and continue training at **2,048 tokens** with **ring attention, zig-zag layout, over 8 devices**;
# 3. evaluate both models at 2,048 tokens on the same 8-device ring plan with `jaxring.eval`: loss by
#    position bucket, and a pass-key heatmap over context lengths × needle depths.
#
# The same commands scale to Llama-3.1-8B on 8 GPUs (docs/context_extension.md). The data is the
# bundled corpus (the Python standard library's source files, one document each, many longer than 2,048
# bytes), so nothing is downloaded. The numbers printed are whatever this run gets; at this size do not
# expect the model to find pass keys.

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

from jaxring.core.device_setup import describe_devices, use_cpu_devices_if_no_accelerator

devices = use_cpu_devices_if_no_accelerator(8)
print("devices:", describe_devices(devices), "| FAST mode" if FAST else "")

# %% [markdown]
# ## 1. A short-context model
#
# The `tiny-llama3` preset (RMSNorm, SwiGLU, GQA, untied head: the Llama layout at 0.1M parameters) with
# plain RoPE (theta 10,000), trained data-parallel on 256-byte rows. `export_hf` writes it as a Hugging Face
# directory (`config.json` + safetensors), the form a released checkpoint has.

# %%
import json
import tempfile

import matplotlib.pyplot as plt
from IPython.display import Image, display

import jaxring
from jaxring.run.spec import RunSpec
from jaxring.train.loop import train

N = min(8, 2 ** (len(devices).bit_length() - 1))  # a power of two of the devices, at most 8
use = devices[:N]
work = tempfile.mkdtemp(prefix="context-extension-")
BASE_DIR, LONG_DIR = os.path.join(work, "base"), os.path.join(work, "long")
SHORT, LONG = 256, 2048

base_spec = RunSpec.of(
    preset="tiny-llama3",
    overrides={"rope_scaling": "none", "rope_theta": 10000.0, "max_seq_len": SHORT},
    seq_len=SHORT,
    dp=N,
    batch_size=2 * N,
    steps=60 if FAST else 300,
    lr=3e-3,
    log_every=20 if FAST else 50,
    progress=False,
    sample_tokens=0,
    export_hf=BASE_DIR,
    out_dir=os.path.join(work, "run-base"),
)
history_base = train(base_spec, devices=use)

# %% [markdown]
# ## 2. Rescale RoPE, train at 2,048 tokens on a ring
#
# `init_from` loads the exported directory; the overrides change only RoPE (the one kind of change a
# pre-trained config accepts, with `max_seq_len`): YaRN with factor 8 over an original context of 256 keeps
# the high-frequency dimensions as they were and interpolates the low-frequency ones, so positions up to
# 2,048 map to angles the model has seen. Each 2,048-token row is split over the 8 devices; ring attention
# passes the key/value blocks around the ring, and the zig-zag layout gives every device the same share of
# the causal work. Long documents are packed into the rows.

# %%
ring = dict(sp=N, attention="ring", layout="zigzag") if N > 1 else {}
long_spec = RunSpec.of(
    init_from=BASE_DIR,
    overrides={"rope_scaling": "yarn", "rope_factor": 8.0, "rope_original_max_positions": SHORT, "max_seq_len": LONG},
    seq_len=LONG,
    batch_size=2,
    steps=20 if FAST else 120,
    lr=1e-3,
    warmup=5,
    log_every=10 if FAST else 20,
    progress=False,
    sample_tokens=0,
    export_hf=LONG_DIR,
    out_dir=os.path.join(work, "run-long"),
    **ring,
)
history_long = train(long_spec, devices=use)
with open(os.path.join(LONG_DIR, "config.json")) as f:
    print(json.load(f)["rope_parameters"])  # the exported config.json: YaRN over the original 256

# %% [markdown]
# ## 3. Loss by position, before and after
#
# `jaxring.eval.perplexity.evaluate` runs held-out rows of 2,048 tokens through the model, one sharded
# forward pass per batch on the same ring plan, and averages every token's loss in buckets of its position
# in the row: 0–256, 256–512, 512–1,024, 1,024–2,048. The base model has never seen a position past 256: a
# loss that climbs in the later buckets is the symptom of a context it cannot use. The command-line form is
# `python -m jaxring.eval perplexity DIR --seq-len 2048 --sp 8 --attention ring --layout zigzag`.

# %%
from jaxring.eval import load_model, needle, perplexity, plots

plan = jaxring.make_plan(devices=use, **ring)
models = {
    "before (256, RoPE)": load_model(BASE_DIR, plan),
    "after (2048, YaRN x8)": load_model(LONG_DIR, plan),
}
ppl = {
    label: perplexity.evaluate(m, plan, seq_len=LONG, batches=2 if FAST else 8, label=label)
    for label, m in models.items()
}
for result in ppl.values():
    print(perplexity.table(result), "\n")
png = plots.perplexity_plot(list(ppl.values()), os.path.join(work, "perplexity.png"), "held-out loss by position")
display(Image(png))

# %% [markdown]
# ## 4. Pass-key retrieval, before and after
#
# `jaxring.eval.needle.evaluate` hides "The pass key is NNNNN. Remember it." at depths 0–100% of filler text,
# asks "What is the pass key? The pass key is" at the end, and scores exact match of the greedy answer,
# for each context length. Greedy decoding reproduces the answer iff, at every answer position, the argmax
# of one teacher-forced forward pass over prompt + answer is the answer's token, so each length costs one
# sharded forward pass (`tests/integration/test_eval.py` checks this against token-by-token decoding).

# %%
lengths = [256, 512, 1024, 2048]
depths = [0.0, 0.5, 1.0] if FAST else [0.0, 0.25, 0.5, 0.75, 1.0]
found = {
    label: needle.evaluate(m, plan, lengths=lengths, depths=depths, samples=1 if FAST else 4, label=label)
    for label, m in models.items()
}
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
for ax, (label, result) in zip(axes, found.items()):
    print(needle.table(result), "\n")
    grid = [[row[j] for row in result["accuracy"]] for j in range(len(depths))]
    ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), lengths)
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length")
    ax.set_ylabel("needle depth")
    ax.set_title(label)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. What this run shows
#
# The summary below is computed from the results above, not written in advance. At toy scale (0.1M
# parameters, a few hundred steps on bytes of Python source) expect the loss by position to tell the story:
# the extended model's loss in the buckets past 256 should be lower than the base model's. Pass-key retrieval
# needs a model that has learnt to copy from far back, which a model this small trained this briefly on
# source code has not: zeros in both heatmaps are the honest outcome here, and the same evaluation on a real
# model (docs/context_extension.md) is where it becomes informative.

# %%
before, after = ppl.values()
for b0, b1 in zip(before["buckets"], after["buckets"]):
    change = b1["loss"] - b0["loss"]
    print(f"positions {b0['start']:>5}-{b0['end']:<5} loss {b0['loss']:.3f} -> {b1['loss']:.3f} ({change:+.3f})")
for label, result in found.items():
    hits = sum(c["hit"] for c in result["cells"])
    print(f"{label}: pass key found in {hits} of {len(result['cells'])} sequences")
