# %% [markdown]
# # jaxring quick start: ring attention on a device mesh
#
# This notebook takes one attention layer's inputs, splits the **sequence** over all devices with
# **ring attention**, checks the result against dense attention, times both, and shows how the
# **zig-zag layout** balances causal attention across devices.
#
# It runs on any runtime: on a CPU-only machine JAX simulates 8 devices (they share the host's cores, so
# they show *what* is computed and communicated, not the speed of real accelerators); on a GPU or a TPU
# runtime (Colab's included) it uses the chips it finds, unchanged, and the attention's per-block compute is
# chosen for them (`block_ops="auto"`: jaxring's Pallas kernels on a GPU, its Pallas TPU kernels on a TPU).

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

import jaxring
from jaxring.core.device_setup import describe_devices, use_cpu_devices_if_no_accelerator
from jaxring.kernels.block_compute import resolve_name

# The accelerators if there are any, else 8 simulated CPU devices. This must run before anything asks JAX
# for its devices (afterwards the CPU device count is fixed).
devices = use_cpu_devices_if_no_accelerator(8)
print("devices:", describe_devices(devices), "| block compute:", resolve_name("auto"), "| FAST mode" if FAST else "")

# %% [markdown]
# ## 1. A device mesh
#
# `jaxring.make_mesh` builds a `jax.sharding.Mesh` with jaxring's six axis names,
# `dp` (data), `pp` (pipeline), `fsdp` (sharded data), `ep` (experts), `sp` (sequence) and `tp` (tensor);
# every axis is present, size-1 axes included, and the degrees must multiply to the device count. Here all
# devices go to `sp`: each one holds `seq / sp` tokens.

# %%
import jax
import jax.numpy as jnp
import numpy as np

P = len(devices)
mesh = jaxring.make_mesh(sp=P)
print("mesh axes:", dict(mesh.shape))

# %% [markdown]
# ## 2. Ring attention vs dense attention
#
# Attention tensors are `[batch, seq, heads, head_dim]`, as for `jax.nn.dot_product_attention`.
# `jaxring.sharded_attention` takes global arrays in natural token order, lays the sequence out over `sp`
# (zig-zag by default), runs the ring (each device attends its queries to one K/V block per step and
# passes the block on to its neighbour), and returns the output in natural order again, split over the same
# devices. The oracle is `jaxring.attention_reference`, plain dense softmax attention in fp32.
# (`sharded_attention` is the entry point for one layer on global arrays. Inside a model the same ring is a
# local function that runs in the train step's one `shard_map`, with the tokens laid out once on the data
# side: `03_train_gpt.ipynb` trains that way.)

# %%
BATCH, HEADS, HEAD_DIM = 1, 8, 64
SEQ = 512 if FAST else 4096
SEQ = -(-SEQ // (2 * P)) * 2 * P  # zig-zag needs seq divisible by 2 * sp

kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(0), 4)
q = jax.random.normal(kq, (BATCH, SEQ, HEADS, HEAD_DIM), jnp.float32)
k = jax.random.normal(kk, (BATCH, SEQ, HEADS, HEAD_DIM), jnp.float32)
v = jax.random.normal(kv, (BATCH, SEQ, HEADS, HEAD_DIM), jnp.float32)


def ring_fn(q, k, v):
    return jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="ring", causal=True, layout="zigzag")


def reference_fn(q, k, v):
    return jaxring.attention_reference(q, k, v, causal=True)[0]  # returns (out, lse)


def xla_fn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


ring, reference, xla = jax.jit(ring_fn), jax.jit(reference_fn), jax.jit(xla_fn)
out_ring, out_ref, out_xla = ring(q, k, v), reference(q, k, v), xla(q, k, v)

# fp32 on CPU agrees to ~1e-6; GPUs may use TF32 matmuls for fp32, hence the looser bound there.
TOL = 1e-4 if devices[0].platform == "cpu" else 2e-2
scale = float(jnp.abs(out_ref).max())
err_ref = float(jnp.abs(out_ring - out_ref).max())
err_xla = float(jnp.abs(out_ring - out_xla).max())
print(f"q, k, v {q.shape}, causal, seq split over sp={P}")
print(f"output sharding: {out_ring.sharding.spec}")
print(f"max |ring - attention_reference|          = {err_ref:.2e}")
print(f"max |ring - jax.nn.dot_product_attention| = {err_xla:.2e}")
assert err_ref <= TOL * scale and err_xla <= TOL * scale

# %% [markdown]
# The ring is differentiable: its backward pass (a `jax.custom_vjp`) sends K/V round the ring again
# together with their gradient accumulators, and keeps only `q, k, v, out` and the log-sum-exp per device.

# %%
dout = jax.random.normal(kd, q.shape, jnp.float32)


def grads_of(fn):
    """(q, k, v, dout) -> (dq, dk, dv) of sum(fn(q, k, v) * dout): one forward + backward."""
    return jax.grad(lambda q, k, v, dout: jnp.sum(fn(q, k, v) * dout), argnums=(0, 1, 2))


ring_grad_fn, reference_grad_fn = grads_of(ring_fn), grads_of(reference_fn)
ring_grad, reference_grad = jax.jit(ring_grad_fn), jax.jit(reference_grad_fn)
for name, g, g_ref in zip(("dq", "dk", "dv"), ring_grad(q, k, v, dout), reference_grad(q, k, v, dout)):
    err = float(jnp.abs(g - g_ref).max())
    print(f"{name}: max |ring - reference| = {err:.2e}")
    assert err <= TOL * float(jnp.abs(g_ref).max())

# %% [markdown]
# ### Time and memory
#
# Each function is compiled once (`jax.jit`), then `jaxring.core.timing.median_seconds` runs it once to warm up
# and reports the median of a few timed runs (it waits for the result with `jax.block_until_ready`).
# `jaxring.analysis.compile_stats(fn, *args)` jits `fn` too (the compiled program comes from jit's cache) and
# reads the **per-device** memory of the compiled program (`memory_analysis()`: arguments, outputs and
# temporaries; the table shows the temporaries) and the bytes its collectives move.

# %%
from jaxring.analysis import compile_stats
from jaxring.core.timing import median_seconds

RUNS = 2 if FAST else 3
print(f"{'':34s} {'median time':>12s} {'temp memory / device':>21s} {'bytes sent / device':>20s}")
for name, fn, args in [
    ("ring (forward)", ring_fn, (q, k, v)),
    ("attention_reference (forward)", reference_fn, (q, k, v)),
    ("jax.nn.dot_product_attention", xla_fn, (q, k, v)),
    ("ring (forward + backward)", ring_grad_fn, (q, k, v, dout)),
    ("reference (forward + backward)", reference_grad_fn, (q, k, v, dout)),
]:
    seconds = median_seconds(jax.jit(fn), *args, runs=RUNS)  # compiled above: jit finds it in its cache
    stats = compile_stats(fn, *args)  # the same compiled program
    print(
        f"{name:34s} {seconds * 1e3:9.1f} ms {stats.temp_bytes / 2**20:17.1f} MiB "
        f"{stats.total_bytes_moved / 2**20:16.1f} MiB"
    )

# %% [markdown]
# How to read this:
#
# * **Memory** is the point of ring attention. Dense attention builds the `seq × seq` score matrix
#   (`heads · seq² · 4` bytes in fp32) on one device; with the ring, each device holds `seq / sp` tokens and
#   one incoming K/V block at a time, so its memory is O(seq / sp) and the longest sequence grows with the
#   number of devices.
# * **Time** on simulated CPU devices is not a parallel speed-up: the 8 "devices" share the host's cores.
#   What differs there is how the work is done: the dense versions build the whole `seq × seq` score
#   matrix in memory and compute its masked half too, while the ring works block by block and skips the
#   blocks the causal mask hides. On real accelerators every device computes its share at the same time,
#   and each step's K/V transfer is issued before that step's compute so that the two can overlap.
# * **Bytes sent** counts what each device receives over the links, read from the compiled program.
#   The dense reference runs on one device and sends nothing.

# %% [markdown]
# ## 3. The zig-zag layout
#
# With a causal mask, token `i` attends to tokens `0..i`. If device `r` simply held the `r`-th contiguous
# chunk, the last device would have the most work and the first almost none. The **zig-zag** layout cuts
# the sequence into `2·sp` chunks and gives device `r` the chunks `r` and `2·sp − 1 − r`: one early and
# one late chunk, so every device has about the same work. (`striped` deals the tokens out round-robin.)
#
# `jaxring.layout_permutation(layout, seq, sp)` is the global index map (`x_layout = x[..., perm, ...]`; device
# `r` holds `perm[r·n:(r+1)·n]`), and `jaxring.layout_positions(layout, r, sp, n)` gives the true positions
# device `r` holds; masks are computed from those positions, so they are exact in every layout.

# %%
import matplotlib.pyplot as plt

P_PIC = P if P > 1 else 8  # the picture works for any device count
S_PIC = 8 * P_PIC  # tokens in the picture
n_pic = S_PIC // P_PIC
for r in range(min(P_PIC, 3)):
    print(
        f"zigzag: device {r} holds positions {np.asarray(jaxring.layout_positions('zigzag', r, P_PIC, n_pic)).tolist()}"
    )

layouts = ("contiguous", "zigzag", "striped")
fig, axes = plt.subplots(len(layouts), 1, figsize=(12, 0.9 * len(layouts) + 0.8), sharex=True)
for ax, layout in zip(axes, layouts):
    perm = jaxring.layout_permutation(layout, S_PIC, P_PIC)
    owner = np.empty(S_PIC, int)
    owner[perm] = np.arange(S_PIC) // n_pic  # owner[position] = device holding that token
    ax.imshow(
        owner[None, :], cmap="tab20" if P_PIC > 10 else "tab10", aspect="auto", vmin=0, vmax=19 if P_PIC > 10 else 9
    )
    for t in range(S_PIC):
        ax.text(t, 0, str(owner[t]), ha="center", va="center", fontsize=7)
    ax.set_yticks([])
    ax.set_ylabel(layout, rotation=0, ha="right", va="center")
axes[-1].set_xlabel(f"token position (the number is the device holding it; {P_PIC} devices)")
fig.suptitle("Which device holds which tokens")
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Causal work per device
#
# Count the query–key pairs each device must compute under the causal mask (key position ≤ query
# position), for its own queries against every key. A kernel that skips fully masked tiles (jaxring's ring
# skips every masked (query run, key run) pair) does work proportional to these counts.
#
# The ring is also **synchronous**: at step `t` device `r` holds the K/V block of device `(r − t) mod sp`, and
# nobody can start step `t + 1` before the slowest device finishes step `t`. So the time is
# Σ over steps of the *largest* per-device work, shown as "ring time" below in units of pairs.


# %%
def causal_pairs(layout, sp, seq):
    """work[r, t]: query-key pairs with key <= query for device r's queries against the K/V block it
    holds at ring step t (that of device (r - t) mod sp)."""
    n = seq // sp
    pos = [np.sort(np.asarray(jaxring.layout_positions(layout, r, sp, n))) for r in range(sp)]
    work = np.zeros((sp, sp), np.int64)
    for r in range(sp):
        for t in range(sp):
            keys = pos[(r - t) % sp]
            work[r, t] = np.searchsorted(keys, pos[r], side="right").sum()
    return work


SP_WORK = P_PIC
SEQ_WORK = 2 * SP_WORK * 512
fig, ax = plt.subplots(figsize=(8, 3.5))
width = 0.4
for i, layout in enumerate(("contiguous", "zigzag")):
    work = causal_pairs(layout, SP_WORK, SEQ_WORK)
    per_device = work.sum(axis=1)
    ring_time = work.max(axis=0).sum()  # each step waits for the slowest device
    ideal = per_device.sum() / SP_WORK
    ax.bar(
        np.arange(SP_WORK) + (i - 0.5) * width,
        per_device / 1e6,
        width,
        label=f"{layout}: max/mean {per_device.max() / per_device.mean():.2f}",
    )
    print(
        f"{layout:10s}: pairs per device {per_device.min():,} .. {per_device.max():,}; "
        f"ring time {ring_time:,} = {ring_time / ideal:.2f} x the balanced ideal"
    )
ax.set_xlabel("device (sp rank)")
ax.set_ylabel("causal query-key pairs (millions)")
ax.set_title(f"Causal work per device, seq {SEQ_WORK:,} over {SP_WORK} devices")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# With the contiguous layout the last device does `2·sp − 1` times the work of the first, and the
# synchronous ring runs at the pace of the busiest device in each step. Zig-zag gives every device the
# same number of pairs, so no device waits for another. The layout is applied once to the tokens and their
# positions; the model never permutes anything per layer.
#
# **Next:** `02_strategies.ipynb` compares every sequence-parallel strategy in jaxring (ring, Ring
# Self-Attention, DeepSpeed-Ulysses, all-gather, WallFacer, USP) on the same inputs: accuracy, bytes moved
# and per-device memory against sequence length; then the tensor-parallel methods, tensor × sequence
# parallelism, and the ZeRO stages of a whole train step.
