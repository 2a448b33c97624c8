# %% [markdown]
# # A Diffusion Transformer with sequence parallelism
#
# A DiT (Peebles & Xie, *Scalable Diffusion Models with Transformers*) turns an image into a sequence of
# patch tokens and runs a Transformer over them, conditioned on the class and the noise level through
# adaptive LayerNorm (adaLN-Zero). jaxring's DiT (`models/dit.py`) is trained by flow matching: it sees
# `x_t = (1 - t)·image + t·noise` and predicts the velocity `noise - image`; sampling integrates that
# velocity from pure noise (`t = 1`) back to an image (`t = 0`) in Euler steps.
#
# High-resolution images and videos give long patch sequences, which is where sequence parallelism helps.
# Here the images are tiny (scikit-learn's 8×8 digits, scaled to 16×16: 2×2 patches make 64 tokens), but
# the mechanics are the same: on 8 devices we train with `dp=2 × sp=4`, each device holding half of the
# batch and a quarter of every image's patch tokens, with **DeepSpeed-Ulysses** attention (all-to-alls
# that swap the sequence split for a head split around attention). DiT attention is not causal, so no
# load-balancing layout is needed.
#
# With fewer devices the mesh shrinks (a power of two of the devices is used; a single GPU trains alone).

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

# The accelerators if there are any, else 8 simulated CPU devices. This must run before anything asks JAX
# for its devices (afterwards the CPU device count is fixed).
devices = use_cpu_devices_if_no_accelerator(8)
print("devices:", describe_devices(devices), "| FAST mode" if FAST else "")

# %% [markdown]
# ## 1. Settings and data
#
# The same run specification (`RunSpec`) and `Trainer` as for the GPT (`03_train_gpt.ipynb`), with
# `model="dit"`. The `tiny` DiT preset has 2 layers of width 64 and 4 heads; FAST mode keeps one layer and
# trains only a few steps. Without `data=`, the bundled digits are used (1797 images, 10 classes, pixel
# values in [-1, 1]).

# %%

import jax
import matplotlib.pyplot as plt
import numpy as np

from jaxring.models import dit
from jaxring.run.spec import RunSpec
from jaxring.train.loop import Trainer

N = min(8, 2 ** (len(devices).bit_length() - 1))  # a power of two of the devices, at most 8
use = devices[:N]
ATTENTION = "ulysses"  # or "ring"; Ulysses needs sp to divide the 4 heads
MESH = {8: dict(dp=2, sp=4), 4: dict(dp=2, sp=2), 2: dict(sp=2), 1: {}}[N]
if MESH.get("sp", 1) > 1:
    MESH["attention"] = ATTENTION

STEPS = 30 if FAST else 1000
CFG = RunSpec.of(
    model="dit",
    preset="tiny",
    seed=0,
    steps=STEPS,
    batch_size=16 if FAST else 64,
    overrides=dict(num_layers=1) if FAST else {},
    lr=3e-3,
    warmup=5 if FAST else 50,
    **MESH,
)
trainer = Trainer(CFG, devices=use)
config = trainer.task.config
print(f"mesh: {trainer.plan.describe()}")
print(
    f"DiT: {config.num_layers} layer(s), hidden {config.hidden}, {config.num_heads} heads, "
    f"{config.image_size}x{config.image_size} images in {config.patch_size}x{config.patch_size} patches "
    f"-> {config.num_tokens} tokens, {config.num_params() / 1e3:.0f}k parameters"
)


def show(images, titles=None, ncols=10, size=0.9):
    """A grid of [n, H, W, 1] images with values in [-1, 1]."""
    n = len(images)
    nrows = -(-n // ncols)
    _fig, axes = plt.subplots(nrows, ncols, figsize=(size * ncols, size * nrows + 0.3), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < n:
            ax.imshow(np.asarray(images[i])[..., 0], cmap="gray", vmin=-1, vmax=1)
            if titles is not None:
                ax.set_title(str(titles[i]), fontsize=8)
    plt.tight_layout()
    plt.show()


data = trainer.task.source
first = [int(np.flatnonzero(data.labels == c)[0]) for c in range(10)]
print(f"{len(data)} training images {data.images.shape[1:]}, one of each class:")
show(data.images[first], titles=[data.class_names[data.labels[i]] for i in first])

# %% [markdown]
# ## 2. Training
#
# `trainer.step()` runs one jitted update: noise levels, noise and class dropout are drawn from the step's
# key on the global batch (so they do not depend on the mesh), and the model runs with the batch split over
# `dp` and the patch sequence over `sp`. The loss is the mean squared error of the predicted velocity.

# %%
import time

log_every = 10 if FAST else 100
losses = []
start = time.perf_counter()
for step in range(1, STEPS + 1):
    losses.append(float(trainer.step()["loss"]))
    if step % log_every == 0 or step == 1:
        print(f"step {step:5d}: loss {losses[-1]:.4f}  ({time.perf_counter() - start:.1f} s)")
losses = np.array(losses)

fig, ax = plt.subplots(figsize=(8, 3.5))
ax.plot(np.arange(1, STEPS + 1), losses, alpha=0.4, label="per step")
window = max(2, STEPS // 20)
smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
ax.plot(np.arange(window, STEPS + 1), smooth, label=f"mean of {window} steps")
ax.set_xlabel("step")
ax.set_ylabel("flow-matching loss (MSE)")
ax.set_title(f"DiT on digits, {trainer.plan.describe()}")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# The loss starts near 1.5: with adaLN-Zero every block starts as the identity (its gates are initialised
# to zero) and the output layer starts at zero, so the untrained model predicts a velocity of 0, and the target `noise - image` has a mean square of about
# 1 (the noise) plus that of the images. It falls as the model learns to predict the velocity. A
# per-step loss stays noisy because each step draws new noise levels `t`, and the error depends strongly
# on `t` (near `t = 0` the noise to be predicted is barely visible in `x_t`).

# %% [markdown]
# ## 3. Sampling
#
# `jaxring.models.dit.sample(model, plan, labels, key, num_steps=..., cfg_scale=...)` starts from Gaussian noise
# and takes `num_steps` Euler steps of `dx/dt = v`. With `cfg_scale > 1` it uses classifier-free guidance:
# each step also runs the model with the "null" class (the model learnt it from the 10% of training labels
# that were dropped) and moves further in the direction the class label adds. Sampling runs on the
# training plan, so every model evaluation is sequence-parallel too. Two samples per class, one class per
# column:

# %%
labels = np.tile(np.arange(10), 2)
images = dit.sample(
    trainer.model(), trainer.plan, labels, jax.random.PRNGKey(1), num_steps=10 if FAST else 50, cfg_scale=2.0
)
print(f"{len(labels)} samples {images.shape[1:]}, {10 if FAST else 50} Euler steps, sharding {images.sharding.spec}")
show(images, titles=[data.class_names[c] for c in labels])

# %% [markdown]
# What the samples look like depends on the training time: after the few steps of FAST mode they are
# still mostly noise. With the full settings (1000 steps of 64 images, about 3 minutes on 8 simulated CPU
# devices) most samples show the digit of their column, if blurred, and a few are not yet recognisable.
# `python train.py --model dit` trains the same model from the command line and writes a grid of samples
# to `OUT_DIR/samples.png`, beside the run's `run.yaml` and `metrics.jsonl` (`--out-dir`); `--preset dit-s`
# or `dit-1b` with `--image-size` and a folder of images (`--data`) gives the long patch sequences that
# sequence parallelism is for.
