# %% [markdown]
# # Sequence- and tensor-parallel strategies side by side
#
# Every sequence-parallel strategy in `jaxring.sharded_attention` runs here on the same inputs, forward and
# backward. For each we check the result against dense attention, then read from the **compiled program**
# how many bytes each device receives and how much memory each device needs as the sequence grows, and put
# two papers' claims beside the measurements.
#
# | `strategy=` | from | what moves between devices |
# |---|---|---|
# | `"dense"` | — | nothing: the whole sequence on one device (the reference) |
# | `"ring"` | Ring attention / context parallelism | K/V blocks passed round a ring, one per step; online softmax |
# | `"rsa"` | Ring Self-Attention (Li et al., *Sequence Parallelism*) | K then V round the ring; the full `L/N × L` score rows are kept |
# | `"ulysses"` | DeepSpeed-Ulysses | all-to-alls: sequence-split → head-split, full-sequence attention per head group, and back |
# | `"allgather"` | all-gather context parallelism (Llama 3) | all of K/V gathered to every device; dK/dV reduce-scattered |
# | `"wallfacer"` | WallFacer (`team_size=C`) | teams of C devices all-gather Q/K/V; C² shorter sub-rings; a reduce-scatter combines |
# | `"usp"` | USP (`ulysses_size=U`) | Ulysses over groups of U devices × ring over `sp/U` groups |
#
# Options: `layout=` (`"contiguous"`, `"zigzag"`, `"striped"`; WallFacer takes the first two) for all;
# `team_size=C` (C² divides `sp`) and `placement=` (`"team_inner"` / `"ring_inner"`: which devices are
# neighbours) for WallFacer; `ulysses_size=U` (U divides `sp`) for USP. The strategies, their options and
# their rules come from one registry, `jaxring.parallel.registry.sequence_strategies()`, which `sharded_attention`,
# `ParallelPlan`, `train.py`'s flags and the error messages all read.
#
# Section 4 does the same for tensor parallelism: Megatron TP+SP, Optimus (2D SUMMA) and METP, the three
# methods of `jaxring.parallel.tensor`, on one layer's MLP and attention. Section 5 combines the two families,
# Megatron over `tp` with each sequence strategy over `sp` in one program, and section 6 measures the ZeRO
# stages of a whole train step: the bytes each moves and the memory each saves.

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

# The accelerators if there are any, else 8 simulated CPU devices. This must run before anything asks JAX
# for its devices (afterwards the CPU device count is fixed).
devices = use_cpu_devices_if_no_accelerator(8)
print("devices:", describe_devices(devices), "| FAST mode" if FAST else "")

# %%
import math

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from jaxring.analysis import compile_stats

P = len(devices)
mesh = jaxring.make_mesh(sp=P)
HEADS = math.lcm(8, P)  # Ulysses splits the heads over sp: heads divisible by sp
BATCH, HEAD_DIM = 1, 32 if FAST else 64


def configs(sp):
    """name -> sharded_attention keywords; the options this device count allows."""
    out = {"dense": dict(strategy="dense")}
    for layout in ("contiguous", "zigzag", "striped"):
        out[f"ring {layout}"] = dict(strategy="ring", layout=layout)
    out["rsa"] = dict(strategy="rsa")
    out["ulysses"] = dict(strategy="ulysses")
    out["allgather"] = dict(strategy="allgather")
    for c in (1, 2, 4):
        if sp % (c * c) == 0:
            out[f"wallfacer C={c}"] = dict(strategy="wallfacer", team_size=c)
    if sp % 4 == 0:
        out["wallfacer C=2 ring_inner"] = dict(strategy="wallfacer", team_size=2, placement="ring_inner")
    for u in (2, 4):
        if sp % u == 0 and u < sp:
            out[f"usp U={u}"] = dict(strategy="usp", ulysses_size=u)
    return out


CONFIGS = configs(P)


def forward_backward(options):
    """(q, k, v, dout) -> (out, (dq, dk, dv)), causal, for one strategy (jit it to run it)."""

    def run(q, k, v, dout):
        out, vjp = jax.vjp(
            lambda q, k, v: jaxring.sharded_attention(q, k, v, mesh=mesh, causal=True, **options), q, k, v
        )
        return out, vjp(dout)

    return run


# One function object per strategy: jax.jit and compile_stats (which jits it too) then share compilations.
FORWARD_BACKWARD = {name: forward_backward(options) for name, options in CONFIGS.items()}


from jaxring.parallel.registry import sequence_strategies

print("the registry (jaxring.parallel.registry.sequence_strategies()):")
for name, strategy in sequence_strategies().items():
    options = ", ".join(strategy.option_names()) or "-"
    print(f"  {name:10s} options: {options:23s} {strategy.summary}")
print(f"\nsp = {P}, heads = {HEADS}, head_dim = {HEAD_DIM}; the configurations run here:")
for name, options in CONFIGS.items():
    print(f"  {name:26s} {options}")

# %% [markdown]
# ## 1. Same inputs, same answer
#
# Forward and backward of every strategy on one set of random inputs, against
# `jaxring.attention_reference` (dense attention in fp32) with the same output cotangent.

# %%
SWEEP_SEQS = (256, 512) if FAST else (2048, 4096, 8192, 16384)  # for section 2
SEQ = SWEEP_SEQS[0]
keys = jax.random.split(jax.random.PRNGKey(0), 4)
q, k, v, dout = (jax.random.normal(key, (BATCH, SEQ, HEADS, HEAD_DIM), jnp.float32) for key in keys)


@jax.jit
def reference(q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: jaxring.attention_reference(q, k, v, causal=True)[0], q, k, v)
    return out, vjp(dout)


expected = reference(q, k, v, dout)
TOL = 1e-4 if devices[0].platform == "cpu" else 2e-2  # relative; GPUs may use TF32 for fp32 matmuls
rows = []
for name in CONFIGS:
    got = jax.jit(FORWARD_BACKWARD[name])(q, k, v, dout)
    errors = [
        float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected))
    ]
    rows.append((name, *errors))

header = f"{'strategy':26s} {'out':>9s} {'dq':>9s} {'dk':>9s} {'dv':>9s}   max error / max |reference|"
print(f"seq {SEQ}, causal, fp32\n{header}\n{'-' * len(header)}")
for name, *errors in rows:
    print(f"{name:26s} " + " ".join(f"{e:9.1e}" for e in errors))
bad = [row[0] for row in rows if max(row[1:]) > TOL]
assert not bad, f"strategies off the reference by more than {TOL}: {bad}"

# %% [markdown]
# ## 2. Bytes moved and memory per device against sequence length
#
# `jaxring.analysis.compile_stats(fn, *args)` compiles `fn` for the given shapes (no data needed) and
# reads two exact properties of the per-device program:
#
# * **bytes moved**: what each device receives through its collectives (`collective-permute` for ring
#   sends, `all-gather`, `reduce-scatter`, `all-to-all`), with ring loops counted once per iteration;
# * **peak memory**: arguments + outputs + temporaries of one device's program (`memory_analysis()`).
#
# Here `fn` is the jitted forward + backward from above, which includes the re-layout of the tokens
# (`zigzag` moves two half-chunks per tensor per device).

# %%
SWEEP = [
    name
    for name in ("dense", "ring zigzag", "rsa", "ulysses", "allgather", "wallfacer C=2", "usp U=2")
    if name in CONFIGS
]

stats = {}  # (name, seq) -> CompiledStats
for seq in SWEEP_SEQS:
    x = jax.ShapeDtypeStruct((BATCH, seq, HEADS, HEAD_DIM), jnp.float32)
    for name in SWEEP:
        stats[name, seq] = compile_stats(FORWARD_BACKWARD[name], x, x, x, x)

seq = SWEEP_SEQS[-1]
print(f"per device, forward + backward, seq {seq}, heads {HEADS}, head_dim {HEAD_DIM}, fp32 (MiB)")
kinds = ("collective-permute", "all-gather", "reduce-scatter", "all-to-all")
header = f"{'strategy':16s}" + "".join(f"{kind:>20s}" for kind in kinds) + f"{'total':>10s}{'peak memory':>13s}"
print(header + "\n" + "-" * len(header))
for name in SWEEP:
    s = stats[name, seq]
    print(
        f"{name:16s}"
        + "".join(f"{s.bytes_moved[kind] / 2**20:20.2f}" for kind in kinds)
        + f"{s.total_bytes_moved / 2**20:10.2f}{s.peak_bytes / 2**20:13.1f}"
    )

# %%
from matplotlib.ticker import FuncFormatter, NullFormatter

fig, (ax_bytes, ax_mem) = plt.subplots(1, 2, figsize=(13, 4.5))
for i, name in enumerate(SWEEP):
    style = dict(
        color=f"C{i}",
        marker="o",
        linestyle="--" if name == "dense" else "-",
        label="dense (one device)" if name == "dense" else name,
    )
    if name != "dense":  # dense runs on one device and moves nothing
        ax_bytes.plot(SWEEP_SEQS, [stats[name, s].total_bytes_moved / 2**20 for s in SWEEP_SEQS], **style)
    ax_mem.plot(SWEEP_SEQS, [stats[name, s].peak_bytes / 2**20 for s in SWEEP_SEQS], **style)
for ax, title in ((ax_bytes, "bytes received per device"), (ax_mem, "peak memory per device")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(SWEEP_SEQS, [str(s) for s in SWEEP_SEQS])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("sequence length")
    ax.set_ylabel("MiB")
    ax.set_title(f"{title} (forward + backward, sp = {P})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Reading the plots (per device, `sp` devices, one local block = `seq / sp` tokens of K or V):
#
# * **Bytes** grow linearly with the sequence for every strategy. The ring sends each K/V block `sp − 1`
#   hops forward, and again in the backward together with the fp32 dK/dV accumulators. RSA sends K and
#   V round the ring and reduce-scatters dK/dV. All-gather gathers all of K/V and reduce-scatters their
#   gradients. Ulysses moves the least: eight all-to-alls (four forward, four backward), each sending
#   `(sp − 1)/sp` of one local tensor once. WallFacer and USP fall between the ring and Ulysses.
# * **Memory**: dense attention and RSA keep score matrices (`seq²` on one device, `seq²/sp` for RSA), so
#   their curves are twice as steep on this log–log plot. The others grow linearly: all-gather holds the
#   whole K/V for the backward, Ulysses the whole sequence for `1/sp` of the heads, and the ring, WallFacer
#   and USP only `seq / sp`-sized blocks (WallFacer `C` times larger ones: its teams share their queries
#   and keys).
#
# ## 3. The papers' claims beside the measurements
#
# ### WallFacer: point-to-point volume divided by C
#
# The WallFacer paper (Eqs. 3–4) counts, per device and forward pass, ring attention's point-to-point
# volume as `P · 2BNH/P` (P sends of a K/V block) and WallFacer's as `1/C` of it, plus team collectives
# (three all-gathers and a reduce-scatter, `4(C−1)·BNH/P`), so the total is `1/C + 2(C−1)/P` of the ring's.
# We measure the forward attention kernels alone (no re-layout), each inside its own `shard_map`.

# %%
import itertools

from jax.sharding import PartitionSpec as PS

from jaxring.parallel.sequence.wallfacer import WF_AXES, wallfacer_attention, wallfacer_mesh


def forward_kernel_bytes(local, kernel_mesh, seq_axes, x):
    spec = PS(None, seq_axes, None, None)
    return compile_stats(
        jax.shard_map(local, mesh=kernel_mesh, in_specs=(spec,) * 3, out_specs=spec), x, x, x
    ).bytes_moved


x = jax.ShapeDtypeStruct((BATCH, SWEEP_SEQS[-1], HEADS, HEAD_DIM), jnp.float32)
block = 4 * BATCH * (x.shape[1] // P) * HEADS * HEAD_DIM  # bytes of one local K (or V) block, fp32
ring_fwd = forward_kernel_bytes(
    lambda q, k, v: jaxring.ring_attention(q, k, v, axis_name="sp", layout="zigzag"), mesh, "sp", x
)
ring_p2p = ring_fwd["collective-permute"] / block
print(
    f"forward kernels, seq {x.shape[1]}, sp = P = {P}; volume per device in local K/V blocks "
    f"({block / 2**20:.3f} MiB each)"
)
print(
    f"ring attention   point-to-point {ring_p2p:6.2f}   paper 2P = {2 * P}; jaxring's ring makes P-1 hops "
    f"(no send after the last step): 2(P-1) = {2 * (P - 1)}"
)
for c in (2, 4):
    if P % (c * c):
        continue
    wf = forward_kernel_bytes(
        lambda q, k, v, c=c: wallfacer_attention(q, k, v, team_size=c, layout="zigzag"),
        wallfacer_mesh(mesh, c),
        WF_AXES,
        x,
    )
    p2p = wf["collective-permute"] / block
    collectives = (sum(wf.values()) - wf["collective-permute"]) / block
    print(f"WallFacer C={c}    point-to-point {p2p:6.2f}   paper 2P/C = {2 * P / c:g}")
    print(
        f"                 collectives    {collectives:6.2f}   paper 4(C-1) = {4 * (c - 1)} "
        f"(+ lse rows, 1/head_dim of a block each, which the paper leaves out)"
    )
    print(
        f"  WallFacer / ring: point-to-point {p2p / ring_p2p:.3f} (paper 1/C = {1 / c:.3f}), "
        f"total {(p2p + collectives) / ring_p2p:.3f} (paper 1/C + 2(C-1)/P = {1 / c + 2 * (c - 1) / P:.3f})"
    )
if P % 4:
    print(f"WallFacer with teams needs C ≥ 2 with C² dividing sp = {P}: nothing to compare here")

# %% [markdown]
# WallFacer moves what the paper counts: `2P/C` blocks point to point and `4(C−1)` in team collectives
# (all-gathers of Q, K and V, one reduce-scatter of the output), plus the lse rows. Its ratios to the ring
# come out a little above the paper's only because the paper counts the ring as `P` sends per pass where
# jaxring's ring makes `P − 1`. On 8 devices `C = 2` is the only WallFacer with teams (`C²` must divide
# `P`); the saving grows with `C` on larger machines (`C ≤ √P`), and is paid for in memory: each device
# holds its team's `C·n` queries and `C·n`-token K/V blocks (the memory plot above).
#
# ### Ring Self-Attention: `L²/N` score memory
#
# RSA (Li et al.) keeps each device's full score rows: `B · Z · (L/N) · L` elements for `Z` heads,
# sequence `L` and `N` devices, so its per-device memory grows as `L²/N`, while the ring's grows as `L/N`.
# Below: the compiled temporary memory per device against that score block (`4·B·Z·L²/N` bytes in fp32),
# and the growth exponent between consecutive lengths (2 = quadratic, 1 = linear).

# %%
print(f"{'seq':>7s} {'score block':>12s} {'rsa temp':>10s} {'/ block':>8s} {'ring temp':>10s}   (MiB per device)")
for s in SWEEP_SEQS:
    block = 4 * BATCH * HEADS * s * s / P
    rsa_t, ring_t = stats["rsa", s].temp_bytes, stats["ring zigzag", s].temp_bytes
    print(f"{s:7d} {block / 2**20:12.2f} {rsa_t / 2**20:10.2f} {rsa_t / block:8.2f} {ring_t / 2**20:10.2f}")
for name in ("rsa", "ring zigzag"):
    growth = [
        math.log2(stats[name, b].temp_bytes / stats[name, a].temp_bytes) / math.log2(b / a)
        for a, b in itertools.pairwise(SWEEP_SEQS)
    ]
    print(f"{name:12s} temp memory grows as seq^" + ", seq^".join(f"{g:.2f}" for g in growth))

# %% [markdown]
# RSA's temporaries are a nearly fixed multiple (about 5) of the score block: the scores, the probabilities
# it keeps for the backward, their gradients. Its memory per device grows as `L²/N`, as the paper says, and
# that is what limits its sequence length. The ring's exponent stays well below 2: with an online softmax
# (as in WallFacer and USP too) no device ever holds a score row of length `L`.
#
# For timings of all strategies at longer sequences (and on GPUs), see `benchmarks/sequence_parallel.py`
# and its recorded results in `benchmarks/results/`.

# %% [markdown]
# ## 4. Tensor parallelism: Megatron TP+SP, Optimus and METP
#
# The strategies above split attention over the sequence and leave the weights whole on every device.
# `jaxring.parallel.tensor` splits the **layer** instead, three ways:
#
# | module | paper | mesh here | each device holds | what moves between devices |
# |---|---|---|---|---|
# | `megatron` | Megatron-LM TP + sequence parallelism | `tp = 8` | the token shard `[b, s/p, h]` between blocks; inside a block the whole sequence for `1/p` of the heads / FFN columns | activations: all-gather before the column-linear, reduce-scatter after the row-linear (and again in the backward) |
# | `optimus` | Optimus (Xu et al.): 2D SUMMA | `dp = 2 × tp = 4`, the tp axis a 2×2 grid | `[b/q, s, h/q]` and one `q×q` block of every weight | for each of `q` SUMMA steps one block of an operand, broadcast along a grid row or column by a binomial tree |
# | `metp` | METP (memory-efficient TP) | `tp = 8` | the token shard `[b, s/p, h]` and `1/p` of every weight | weights: the FFN's weight blocks go round a ring; attention broadcasts each head group's weights and rings K/V |
#
# Inside a model, each method is a `TensorMethod` (`jaxring/parallel/tensor/contract.py`): local layer functions that
# run inside the train step's one `shard_map`, and the layout of the arrays between layers (section 5 uses
# it). For a single layer on global arrays, all three also give the same convenience functions, thin
# wrappers that run the same local functions in their own `jax.shard_map`: `mlp_block(x, params, mesh=)`,
# `attention_block(x, params, positions, mesh=, num_heads=, num_kv_heads=)` and
# `param_specs(mesh, shapes)` (a `NamedSharding` per weight); this section uses those. Optimus needs
# `tp = q²`, so on 8 devices it runs as a 2×2 grid twice (data parallel over `dp = 2`), and its batch must
# divide by `dp · q = 4`: every method gets that batch here.

# %%
from functools import partial

from jaxring.kernels.rope import apply_rope
from jaxring.parallel.tensor import megatron_api, metp_api, optimus_api

Q = max(q for q in range(1, P + 1) if P % (q * q) == 0)  # Optimus: the largest q×q grid that divides P
TP_METHODS = {  # name -> (module, mesh)
    "megatron": (megatron_api, jaxring.make_mesh(tp=P)),
    "optimus": (optimus_api, jaxring.make_mesh(dp=P // (Q * Q), tp=Q * Q)),
    "metp": (metp_api, jaxring.make_mesh(tp=P)),
}
TP_BATCH = P // (Q * Q) * Q  # divisible by Optimus's dp · q; used by all three
ATTN_NAMES, MLP_NAMES = ("wq", "wk", "wv", "wo"), ("w_in", "w_out")


def tp_shapes(hidden):
    """The weights of one layer (multi-head attention and a GELU MLP with ffn = 4 · hidden), no biases."""
    return {
        "wq": (hidden, hidden),
        "wk": (hidden, hidden),
        "wv": (hidden, hidden),
        "wo": (hidden, hidden),
        "w_in": (hidden, 4 * hidden),
        "w_out": (4 * hidden, hidden),
    }


def reference_attention(x, w, positions, heads, kv_heads=None):
    """Plain jnp on one device: RoPE'd causal multi-head attention (GQA with kv_heads < heads), the formula
    every method computes."""
    b, s, _ = x.shape
    q = (x @ w["wq"]).reshape(b, s, heads, -1)
    k, v = ((x @ w[n]).reshape(b, s, kv_heads or heads, -1) for n in ("wk", "wv"))
    q, k = apply_rope(q, positions), apply_rope(k, positions)
    out, _ = jaxring.attention_reference(q, k, v, causal=True, q_positions=positions, kv_positions=positions)
    return out.reshape(b, s, -1) @ w["wo"]


def reference_mlp(x, w, positions):
    return jax.nn.gelu(x @ w["w_in"], approximate=True) @ w["w_out"]


def attention_of(module, mesh, heads):
    """f(x, w, positions) for a method (module None: the reference)."""
    if module is None:
        return partial(reference_attention, heads=heads)
    return lambda x, w, positions: module.attention_block(
        x, w, positions, mesh=mesh, num_heads=heads, num_kv_heads=heads, causal=True
    )


def mlp_of(module, mesh):
    if module is None:
        return reference_mlp
    return lambda x, w, positions: module.mlp_block(x, w, mesh=mesh)


def layer_of(module, mesh, heads):
    """One layer without norms: y = x + attention(x); out = y + mlp(y)."""
    attention, mlp = attention_of(module, mesh, heads), mlp_of(module, mesh)

    def layer(x, w, positions):
        y = x + attention(x, {n: w[n] for n in ATTN_NAMES}, positions)
        return y + mlp(y, {n: w[n] for n in MLP_NAMES}, positions)

    return layer


def forward_backward(f):
    """f(x, w, positions) -> run(x, w, positions, dy) = (out, (dx, dw)), dw a dict like w."""

    def run(x, w, positions, dy):
        out, vjp = jax.vjp(lambda x, w: f(x, w, positions), x, w)
        return out, vjp(dy)

    return run


for name, (_module, mesh) in TP_METHODS.items():
    print(f"{name:9s} mesh {dict((a, n) for a, n in mesh.shape.items() if n > 1)}")

# %% [markdown]
# ### 4.1 Same inputs, same answer
#
# `mlp_block` and `attention_block` of each method, forward and backward, on one set of random inputs and
# one output cotangent, against the plain `jnp` formulas on one device (`y = gelu(x W_in) W_out`; causal
# attention with RoPE on q and k). Errors are `max |got − reference| / max |reference|` per output.

# %%
CHECK_SEQ, CHECK_HIDDEN = (256, 64) if FAST else (1024, 256)
CHECK_HEADS = math.lcm(8, P)  # heads split over tp: a multiple of P
keys = jax.random.split(jax.random.PRNGKey(1), 8)
tp_w = {
    n: jax.random.normal(key, shape) / math.sqrt(shape[0])
    for key, (n, shape) in zip(keys, tp_shapes(CHECK_HIDDEN).items())
}
tp_x, tp_dy = (jax.random.normal(key, (TP_BATCH, CHECK_SEQ, CHECK_HIDDEN)) for key in keys[6:])
tp_positions = jnp.broadcast_to(jnp.arange(CHECK_SEQ, dtype=jnp.int32), (TP_BATCH, CHECK_SEQ))


def block_fn(kind, module=None, mesh=None):
    f = attention_of(module, mesh, CHECK_HEADS) if kind == "attention" else mlp_of(module, mesh)
    return forward_backward(f)


def rel_error(a, b):
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


# one function object per (block, method): section 4.3 measures the same compiled programs
CHECK_FNS = {
    (kind, name): block_fn(kind, module, mesh)
    for kind in ("attention", "mlp")
    for name, (module, mesh) in TP_METHODS.items()
}
print(f"batch {TP_BATCH}, seq {CHECK_SEQ}, hidden {CHECK_HIDDEN}, heads {CHECK_HEADS}, ffn {4 * CHECK_HIDDEN}, fp32")
worst = {}
for kind, names in (("attention", ATTN_NAMES), ("mlp", MLP_NAMES)):
    w = {n: tp_w[n] for n in names}
    out0, (dx0, dw0) = jax.jit(block_fn(kind))(tp_x, w, tp_positions, tp_dy)
    cols = ["out", "dx"] + ["d" + n for n in names]
    header = f"{kind + '_block':16s}" + "".join(f"{c:>9s}" for c in cols)
    print(f"\n{header}\n{'-' * len(header)}")
    for name in TP_METHODS:
        out, (dx, dw) = jax.jit(CHECK_FNS[kind, name])(tp_x, w, tp_positions, tp_dy)
        errors = [rel_error(out, out0), rel_error(dx, dx0)] + [rel_error(dw[n], dw0[n]) for n in names]
        worst[kind, name] = max(errors)
        print(f"{name:16s}" + "".join(f"{e:9.1e}" for e in errors))
bad = {key: e for key, e in worst.items() if e > TOL}
assert not bad, f"off the reference by more than {TOL}: {bad}"

# %% [markdown]
# ### 4.2 Bytes moved and memory of one layer against sequence length
#
# One layer (attention + MLP with their residuals, forward + backward), compiled with `compile_stats` for
# each method. Nothing runs, so the sizes are realistic even in the fast mode: hidden 1024 and 16 heads as in
# the METP paper's BERT-Large, ffn 4096, fp32, batch 4. (With a tiny hidden size the attention score tiles
# would outweigh every activation and hide what the methods differ in.)

# %%
LAYER_HIDDEN, LAYER_HEADS = 1024, math.lcm(16, P)
LAYER_SEQS = (2048, 8192) if FAST else (2048, 8192, 32768)
LAYER_FNS = {name: forward_backward(layer_of(module, mesh, LAYER_HEADS)) for name, (module, mesh) in TP_METHODS.items()}


def layer_args(module, mesh, seq, hidden=LAYER_HIDDEN):
    """Abstract (x, w, positions, dy): the weights in the method's own sharding (param_specs)."""
    shapes = tp_shapes(hidden)
    specs = module.param_specs(mesh, shapes)
    w = {n: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=specs[n]) for n, shape in shapes.items()}
    x = jax.ShapeDtypeStruct((TP_BATCH, seq, hidden), jnp.float32)
    return x, w, jax.ShapeDtypeStruct((TP_BATCH, seq), jnp.int32), x


tp_stats = {}  # (name, seq) -> CompiledStats
for seq in LAYER_SEQS:
    for name, (module, mesh) in TP_METHODS.items():
        tp_stats[name, seq] = compile_stats(LAYER_FNS[name], *layer_args(module, mesh, seq))

MiB = 2**20
tp_kinds = ("all-gather", "reduce-scatter", "collective-permute", "all-reduce")
print(f"one layer, forward + backward, per device, batch {TP_BATCH}, hidden {LAYER_HIDDEN}, fp32 (MiB)")
header = f"{'method':9s}{'seq':>7s}" + "".join(f"{k:>20s}" for k in tp_kinds) + f"{'total':>9s}{'peak':>9s}"
print(header + "\n" + "-" * len(header))
for name in TP_METHODS:
    for seq in LAYER_SEQS:
        s = tp_stats[name, seq]
        print(
            f"{name:9s}{seq:7d}"
            + "".join(f"{s.bytes_moved[k] / MiB:20.1f}" for k in tp_kinds)
            + f"{s.total_bytes_moved / MiB:9.1f}{s.peak_bytes / MiB:9.1f}"
        )

# %%
from matplotlib.ticker import LogLocator

fig, (ax_bytes, ax_mem) = plt.subplots(1, 2, figsize=(13, 4.5))
for i, name in enumerate(TP_METHODS):
    style = dict(color=f"C{i}", marker="o", label=name)
    ax_bytes.plot(LAYER_SEQS, [tp_stats[name, s].total_bytes_moved / MiB for s in LAYER_SEQS], **style)
    ax_mem.plot(LAYER_SEQS, [tp_stats[name, s].peak_bytes / MiB for s in LAYER_SEQS], **style)
for ax, title in ((ax_bytes, "bytes received per device"), (ax_mem, "peak memory per device")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(LAYER_SEQS, [str(s) for s in LAYER_SEQS])
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("sequence length")
    ax.set_ylabel("MiB")
    ax.set_title(f"{title} (one layer, forward + backward, {P} devices)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Megatron moves activations (a multiple of `bsh`), so its bytes grow with the sequence at a fixed rate.
# METP moves weights too: a fixed `h²` part, which dominates short sequences, plus the K/V ring of attention,
# which grows with the sequence. Optimus moves blocks of both and the fewest bytes here: on a 2×2 grid every
# broadcast is a single hop, and part of it is shared by all steps (see 4.3). Its `all-reduce` is the
# data-parallel sum of the weight gradients over `dp = 2`, not tensor parallelism.
# In memory METP is far below the others: it never gathers a whole sequence, where Megatron gathers
# `[b, s, h]` activations inside each block and Optimus keeps whole sequences on every device.
#
# ### 4.3 The papers' claims beside the measurements
#
# #### METP: peak memory `r(p) = (3 + 2p) / (p(4 + p))` of Megatron's
#
# The METP paper's Eq. (10) compares the activation memory at the forward peak of multi-head attention with
# FlashAttention: Megatron TP+SP holds `4bsh/p + bsh` (the gathered input), METP `2bsh/p + 3bsh/p²`, so METP
# needs `r(p)` of Megatron's (0.198 at `p = 8`, an 80% saving). Below: the ratio of the compiled peaks of our
# whole layer, and of their growth from one sequence length to the next (which cancels the parts that do
# not grow with the sequence).

# %%
r_p = (3 + 2 * P) / (P * (4 + P))
print(f"paper: r(p) = (3 + 2p) / (p(4 + p)) = {r_p:.3f} at p = {P}")
print(f"{'seq':>7s} {'megatron':>10s} {'metp':>10s} {'metp / megatron':>16s}   (peak MiB per device)")
for seq in LAYER_SEQS:
    meg, me = tp_stats["megatron", seq].peak_bytes, tp_stats["metp", seq].peak_bytes
    print(f"{seq:7d} {meg / MiB:10.1f} {me / MiB:10.1f} {me / meg:16.3f}")
for a, b in itertools.pairwise(LAYER_SEQS):
    growth = {name: tp_stats[name, b].peak_bytes - tp_stats[name, a].peak_bytes for name in ("megatron", "metp")}
    print(f"growth {a} -> {b}: metp / megatron = {growth['metp'] / growth['megatron']:.3f}")
longest = LAYER_SEQS[-1]
assert P == 1 or tp_stats["metp", longest].peak_bytes < tp_stats["megatron", longest].peak_bytes

fig, ax = plt.subplots(figsize=(6.5, 3.5))
ax.plot(
    LAYER_SEQS,
    [tp_stats["metp", s].peak_bytes / tp_stats["megatron", s].peak_bytes for s in LAYER_SEQS],
    marker="o",
    label="measured: METP peak / Megatron peak",
)
ax.axhline(r_p, color="k", linestyle="--", label=f"paper: r({P}) = {r_p:.3f}")
ax.set_xscale("log", base=2)
ax.set_xticks(LAYER_SEQS, [str(s) for s in LAYER_SEQS])
ax.set_ylim(0, 1.05 * max(ax.get_ylim()[1], r_p))
ax.set_xlabel("sequence length")
ax.set_title("METP's peak memory relative to Megatron TP+SP")
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The measured ratio is above `r(p)` and falls towards it as the sequence grows (the full-size run, with
# `JAXRING_NOTEBOOK_FAST` unset, reaches about 0.23 at 32k tokens). It differs from the paper's number
# because it measures something larger:
#
# * the **whole layer forward and backward** (the MLP as well as attention, and the backward's own
#   temporaries: Megatron's backward gathers its input and output gradient again, METP's carries fp32
#   gradient accumulators round the ring), not the forward peak of attention alone;
# * **arguments and outputs** (weights, `x`, `dy` and all gradients) are in the peak; the paper's `r(p)`
#   leaves out the weights and optimizer states (a fixed term that short sequences feel most);
# * METP's **double buffer** (the next weight block arrives while this one is used) and CPU attention
#   **tiles** (512 × 512 scores per head and batch row in the `jnp` path, the paper's `k = 0` with
#   FlashAttention assumes none), and XLA:CPU's buffer assignment rather than a hand-made allocator.
#
# What the paper claims does hold: METP's memory grows about 4–5 times more slowly with the sequence than
# Megatron's, because it never holds a whole sequence of activations.
#
# #### Megatron: `5(p − 1)/p · bsh` per FFN
#
# Megatron TP+SP's FFN all-gathers its input, reduce-scatters its output, and in the backward all-gathers
# the output gradient and (recomputing, as Megatron-LM does) the input again and reduce-scatters the input
# gradient: five transitions of `(p − 1)/p · bsh` elements per device (METP's Table 1). The attention block
# moves the same five plus its token positions (int32, `(p − 1)/p · bs`). We read the MLP block's bytes from
# the program checked in 4.1, and the layer's from 4.2; the METP row uses the counts in the docstrings of `metp_ring.py` and `metp_mha.py`
# (the paper's `24(p−1)/p · h²` for the FFN and `12 log₂p · h² + 6(p−1)/p · bsh` for attention, plus the
# gradients' extra hop home and the token positions that travel with K/V).


# %%
def megatron_bytes(b, s, h, p, blocks):
    """fp32 bytes per device: 5 transitions of (p-1)/p·bsh per block, and the int32 positions of attention."""
    return 4 * (5 * len(blocks) * (p - 1) * b * s * h // p + ("attention" in blocks) * (p - 1) * b * s // p)


def metp_bytes(b, s, h, p):
    """fp32 bytes per device of one METP layer (FFN ffn = 4h, MHA n_kv = n), forward + backward."""
    rounds = math.ceil(math.log2(p)) if p > 1 else 0
    w_group, kv, pos = 4 * h * h // p, b * (s // p) * (h // p), b * (s // p)  # elements
    mha = 3 * p * rounds * w_group + p * (p - 1) * (2 * kv + pos) + p * (2 * p - 1) * 2 * kv + p * (p - 1) * pos
    ffn = (3 * p - 2) * 8 * h * h // p
    return 4 * (mha + ffn)


x_check = jax.ShapeDtypeStruct(tp_x.shape, jnp.float32)
mlp_w = {n: jax.ShapeDtypeStruct(tp_w[n].shape, jnp.float32) for n in MLP_NAMES}
ffn = compile_stats(CHECK_FNS["mlp", "megatron"], x_check, mlp_w, tp_positions, x_check)
b, s, h = TP_BATCH, CHECK_SEQ, CHECK_HIDDEN
print(f"Megatron MLP block, forward + backward, b = {b}, s = {s}, h = {h}, p = {P}:")
print(
    f"  measured {ffn.total_bytes_moved:>12,d} B  ({ffn.bytes_moved['all-gather']:,d} all-gather + "
    f"{ffn.bytes_moved['reduce-scatter']:,d} reduce-scatter)"
)
print(f"  5(p-1)/p·bsh = {megatron_bytes(b, s, h, P, ['mlp']):>8,d} B")
print(f"\nlayer (attention + MLP), forward + backward, h = {LAYER_HIDDEN}, b = {TP_BATCH}  (MiB per device)")
print(f"{'seq':>7s} {'megatron':>10s} {'count':>10s} {'metp':>10s} {'count':>10s}")
counts = {}
for seq in LAYER_SEQS:
    counts["megatron", seq] = megatron_bytes(TP_BATCH, seq, LAYER_HIDDEN, P, ["mlp", "attention"])
    counts["metp", seq] = metp_bytes(TP_BATCH, seq, LAYER_HIDDEN, P)
    print(
        f"{seq:7d}"
        + "".join(
            f" {tp_stats[name, seq].total_bytes_moved / MiB:10.2f} {counts[name, seq] / MiB:10.2f}"
            for name in ("megatron", "metp")
        )
    )
# exact, byte for byte (at p = 2 METP's one-hop loops are unrolled and XLA sends the positions only once)
assert ffn.total_bytes_moved == megatron_bytes(b, s, h, P, ["mlp"])
assert all(
    tp_stats[name, seq].total_bytes_moved == count
    for (name, seq), count in counts.items()
    if name == "megatron" or P != 2
), counts

# %% [markdown]
# Both are exact to the byte: Megatron's bytes are the paper's formula (plus the positions), METP's the
# paper's plus the two additions named above. At these sizes (batch 4) METP moves fewer bytes than Megatron
# beyond about 4,500 tokens: its `h²` weight traffic does not grow with the sequence, and its K/V ring carries
# `(6p − 4)/p · bsh` against Megatron's `10(p − 1)/p · bsh`.
#
# #### Optimus: SUMMA one block at a time
#
# Optimus's Table 1 gives a layer's forward communication per device as `log(p)/(2√p) · (7bsh + 12h²)`
# elements on `p = q²` devices (`b` the batch of one grid): each SUMMA product broadcasts `q` blocks of each
# operand, each over `log₂ q` tree rounds. In the compiled program a broadcast costs less: a binomial tree's
# first round does not depend on which rank is the root (every rank sends its own block to its neighbour),
# so XLA computes it once for all `q` steps, and a broadcast costs `1 + q(log₂q − 1)` blocks instead of
# `q log₂q`, half at `q = 2`. We compile the layer's forward alone for Optimus and Megatron (Table 1 counts
# Megatron's forward as `4(p − 1)/p · bsh`).

# %%
seq = LAYER_SEQS[-1]
fwd = {}
for name in ("megatron", "optimus"):
    module, mesh = TP_METHODS[name]
    x, w, positions, _ = layer_args(module, mesh, seq)
    fwd[name] = compile_stats(layer_of(module, mesh, LAYER_HEADS), x, w, positions).total_bytes_moved

h, p_grid, rounds = LAYER_HIDDEN, Q * Q, math.ceil(math.log2(Q)) if Q > 1 else 0
b_grid = TP_BATCH // (P // p_grid)  # the batch of one grid
table1 = (math.log2(p_grid) / (2 * math.sqrt(p_grid)) * (7 * b_grid * seq * h + 12 * h * h)) * 4
hoisted = (1 + Q * (rounds - 1)) / (Q * rounds) if Q > 1 else 0
meg_table1 = 4 * (P - 1) / P * TP_BATCH * seq * h * 4
print(f"layer forward, seq {seq}, per device (MiB):")
print(
    f"  Megatron p = {P}: measured {fwd['megatron'] / MiB:8.2f}   Table 1 4(p-1)/p·bsh = {meg_table1 / MiB:8.2f}"
    f"   (+ positions)"
)
print(
    f"  Optimus {Q}×{Q}:   measured {fwd['optimus'] / MiB:8.2f}   Table 1 log(p)/(2√p)·(7bsh+12h²) = "
    f"{table1 / MiB:8.2f}   × {hoisted:.2f} (tree round 0 hoisted) = {table1 * hoisted / MiB:8.2f}"
)
if Q > 1:
    fb = tp_stats["optimus", seq].bytes_moved["collective-permute"]
    print(f"  Optimus forward + backward: {fb / MiB:.2f} MiB of tree steps = {fb / fwd['optimus']:.2f} × its forward")
    assert math.isclose(fwd["optimus"], table1 * hoisted), (fwd["optimus"], table1 * hoisted)

# %% [markdown]
# The forward moves exactly the hoisted count. The backward of each product is made of the other two SUMMA
# forms, a broadcast and a reduction each. A reduction carries step-dependent partial sums, so nothing is
# hoisted: `q log₂q` blocks (2 at `q = 2`). At `q = 2` a broadcast is nothing but the hoisted round-0 block,
# the same operation as in the forward, and XLA reuses the forward's received block instead of sending it
# again; so forward + backward is three times the forward here. The paper's backward count, three times
# its forward, is the two backward products (twice the forward) plus the forward recomputed under its
# activation checkpointing; jaxring does not recompute it.
#
# What the SUMMA loop buys is memory: it is a `lax.scan` over the `q` steps, so a device holds the current
# and the next block of each operand, never a whole row or column *panel* of `q` blocks as an all-gather
# would. Compare `optimus_layers.summa_ab` with the collapsed product `all_gather(A) @ all_gather(B)` on the grid:

# %%
from jax.sharding import NamedSharding

from jaxring.parallel.tensor.optimus import grid_mesh
from jaxring.parallel.tensor.optimus_layers import GRID, summa_ab

grid, q_grid, _ = grid_mesh(TP_METHODS["optimus"][1])
block = PS(*GRID)
rows, cols = 16, 1024  # A blocks [16, 1024], B blocks [1024, 16]
a = jax.ShapeDtypeStruct((rows * q_grid, cols * q_grid), jnp.float32, sharding=NamedSharding(grid, block))
b = jax.ShapeDtypeStruct((cols * q_grid, rows * q_grid), jnp.float32, sharding=NamedSharding(grid, block))
pair = 2 * rows * cols * 4  # bytes of one A block and one B block


def collapsed_ab(a, b):
    return jax.lax.all_gather(a, "tpc", axis=1, tiled=True) @ jax.lax.all_gather(b, "tpr", axis=0, tiled=True)


for label, fn in (("stepwise SUMMA (optimus.summa_ab)", summa_ab), ("gathered panels", collapsed_ab)):
    s = compile_stats(jax.shard_map(fn, mesh=grid, in_specs=(block, block), out_specs=block), a, b)
    print(
        f"q = {q_grid}: {label:34s} temporaries {s.temp_bytes / pair:4.1f} block pairs, "
        f"moved {s.total_bytes_moved / pair:4.1f} block pairs"
    )

# %% [markdown]
# At `q = 2` a panel is only two blocks, so the difference is small here. `tests/unit/parallel/test_optimus.py` compiles
# the same pair at `q = 8` (64 simulated devices, in a subprocess): the stepwise product keeps 3.5 block
# pairs of temporaries, the gathered panels 12, while moving 17 block pairs over its three-round trees
# against the all-gather's 7. Optimus pays in bytes for memory that stays flat as `q` grows; METP pays in bytes (its
# weight traffic) so that no device ever holds a whole sequence.
#
# For timings of the three methods, and the longest sequence each fits in a memory budget, see
# `benchmarks/tensor_parallel.py` and its results in `benchmarks/results/`.

# %% [markdown]
# ## 5. Tensor × sequence parallelism
#
# Long-context training combines the two families: tensor parallelism inside a node, where the links are
# fastest, and a sequence strategy across nodes (NeMo runs Megatron TP8 × context parallel 32, for
# example). In jaxring the whole train step is one `shard_map` over the mesh and every layer is a *local*
# function inside it, so the two compose: a `ParallelPlan` names a strategy per axis,
#
# ```python
# plan = ParallelPlan(jaxring.make_mesh(tp=2, sp=4), tensor_parallel="megatron", attention="ring")
# ```
#
# and Megatron's attention block runs over `tp` as in section 4 (all-gather the sequence shard, project to
# this device's heads, ..., reduce-scatter the output), with the plan's sequence strategy over `sp` as its
# attention core, on the heads that `tp` left to the device. Between blocks the residual stream is split
# over both axes (`plan.activation_spec()`: the sequence over `sp` and then over `tp`, Megatron's
# sequence-parallel regions); inside attention each device holds `1/sp` of the sequence for `1/tp` of the
# heads. `plan.run_mesh` is the mesh the step runs on: the same devices, with `sp` factored where the
# strategy needs it (WallFacer's teams and sub-rings, USP's Ulysses × ring).
#
# The block is `jaxring.nn.Attention`, the attention layer of jaxring's models: hidden 64, 8 query heads
# and 4 K/V heads (GQA), causal, RoPE. We run it with every sequence strategy on `tp = 2 × sp = 4`,
# forward and backward inside `plan.shard_map`, and compare the output and every gradient with the dense
# block on one device (the plain `jnp` formula of section 4). The plan lays the tokens out once on the data
# side (`plan.layout_tokens`: zigzag for the ring, contiguous for Ulysses, ...) together with their
# positions; the outputs are put back into natural order before the comparison.

# %%
from flax import nnx

from jaxring.nn import Attention, param_placements
from jaxring.parallel.plan import ParallelPlan

TPSP_TP, TPSP_SP = (2, P // 2) if P >= 4 else (1, P)
TPSP_OPTIONS = {"wallfacer": dict(team_size=2), "usp": dict(ulysses_size=2)}  # the strategies' required options
tpsp_mesh = jaxring.make_mesh(tp=TPSP_TP, sp=TPSP_SP)
TPSP_PLANS = (
    {
        name: ParallelPlan(tpsp_mesh, attention=name, tensor_parallel="megatron", **TPSP_OPTIONS.get(name, {}))
        for name in sequence_strategies()
        if name != "dense"
    }
    if P >= 4
    else {}
)
B5, S5, H5, HEADS5, KV5 = 2, 128, 64, 8, 4  # batch, seq, hidden, query heads, K/V heads
block = Attention(H5, HEADS5, KV5, causal=True, rngs=nnx.Rngs(0))
block_w = nnx.to_pure_dict(nnx.split(block)[1])  # {"wq": [64, 64], "wk": [64, 32], "wv": .., "wo": ..}


def block_forward_backward(module, plan):
    """(w, x, positions, dy) -> (y, dx, dw): the nnx block `module` on the plan's mesh, forward and backward.
    Inside the shard_map everything is local: x [b, s/(sp·tp), h] in plan.activation_spec(), positions
    [b, s/sp] in plan.token_spec(), each weight as the tensor method splits it."""
    graphdef, state = nnx.split(module)
    specs = jax.tree.map(
        lambda placement: placement.param_spec(0),
        param_placements(state, plan),
        is_leaf=lambda x: hasattr(x, "param_spec"),
    )

    def local(w, x, positions):
        return nnx.merge(graphdef, w)(x, positions, plan)

    layer = plan.shard_map(
        local, in_specs=(specs, plan.activation_spec(), plan.token_spec()), out_specs=plan.activation_spec()
    )

    def run(w, x, positions, dy):
        y, vjp = jax.vjp(lambda w, x: layer(w, x, positions), w, x)
        dw, dx = vjp(dy)
        return y, dx, dw

    return run


def dense_forward_backward(w, x, positions, dy):
    y, vjp = jax.vjp(lambda w, x: reference_attention(x, w, positions, HEADS5, KV5), w, x)
    dw, dx = vjp(dy)
    return y, dx, dw


rng = np.random.default_rng(5)
x5, dy5 = (rng.standard_normal((B5, S5, H5)).astype(np.float32) for _ in range(2))
natural = np.broadcast_to(np.arange(S5, dtype=np.int32), (B5, S5))
y_ref, dx_ref, dw_ref = jax.jit(dense_forward_backward)(block_w, x5, natural, dy5)

# one function object per plan: section 5's byte counts reuse these compilations
TPSP_FNS = {name: block_forward_backward(block, plan) for name, plan in TPSP_PLANS.items()}
print(f"Attention block: batch {B5}, seq {S5}, hidden {H5}, {HEADS5} query / {KV5} K/V heads, causal, fp32")
print(f"plans: Megatron over tp = {TPSP_TP} × each sequence strategy over sp = {TPSP_SP}\n")
header = f"{'sequence strategy':26s}" + "".join(f"{c:>9s}" for c in ("y", "dx", "dwq", "dwk", "dwv", "dwo"))
print(header + "\n" + "-" * len(header))
tpsp_worst = {}
for name, plan in TPSP_PLANS.items():
    (x_l, dy_l), perm = plan.layout_tokens(x5, dy5)  # the plan's token layout, applied once
    positions = np.broadcast_to(perm, (B5, S5))
    y, dx, dw = jax.jit(TPSP_FNS[name])(block_w, x_l, positions, dy_l)
    order = np.argsort(perm)  # back to natural token order
    errors = [rel_error(np.asarray(y)[:, order], y_ref), rel_error(np.asarray(dx)[:, order], dx_ref)]
    errors += [rel_error(dw[n], dw_ref[n]) for n in ("wq", "wk", "wv", "wo")]
    tpsp_worst[name] = max(errors)
    label = " ".join([name] + [f"{k}={v}" for k, v in TPSP_OPTIONS.get(name, {}).items()])
    print(f"{label:26s}" + "".join(f"{e:9.1e}" for e in errors))
bad = {name: e for name, e in tpsp_worst.items() if e > TOL}
assert not bad, f"off the dense block by more than {TOL}: {bad}"

# %% [markdown]
# Every combination computes the dense block, forward and in every gradient. The heads rule composes too:
# Ulysses splits the heads that `tp` left over `sp` (8 heads / `tp` 2 = 4, divisible by `sp` = 4), and a
# plan that cannot work says why before anything runs, e.g. Ulysses with 4 heads here, or Optimus with
# `sp > 1`:

# %%
for make in (
    lambda: ParallelPlan(tpsp_mesh, attention="ulysses", tensor_parallel="megatron").check_heads(4, 4),
    lambda: ParallelPlan(tpsp_mesh, attention="ring", tensor_parallel="optimus"),
):
    try:
        make()
    except ValueError as e:
        print("ValueError:", e)

# %% [markdown]
# ### Bytes: Megatron's plus the sequence strategy's
#
# Composed in one program, the two axes should move exactly what each moves alone. Megatron's attention
# block makes five transitions of `(tp − 1)/tp · b·(S/sp)·h` elements per device (section 4.3), now on the
# `sp` shard of `S/sp` tokens; the ring over `sp` sends `2(sp − 1)` K/V blocks forward and, backward,
# `2(sp − 1)` K/V blocks and `2·sp` fp32 dK/dV accumulator blocks (they make one extra hop home), each
# block `b·(S/sp)·(kv_heads/tp)·head_dim` elements: K and V of the device's own K/V heads. The weights are
# replicated over `sp`, so their gradients are also summed over `sp` (an all-reduce of the device's
# `1/tp` of the weights; in a train step that is the ZeRO stage's gradient reduction, section 6).
#
# Below, the compiled forward + backward of each tp × sp block (the programs run above), and for the ring
# the two halves measured alone on the same per-device shapes: Megatron on `dp = 4 × tp = 2` with `S/sp`
# tokens per sequence, and the ring on `dp = 2 × sp = 4` with an attention of the `1/tp` of the heads
# that one `tp` rank holds.


# %%
def block_args(batch, seq, w):
    x = jax.ShapeDtypeStruct((batch, seq, H5), jnp.float32)
    return (
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w),
        x,
        jax.ShapeDtypeStruct((batch, seq), jnp.int32),
        x,
    )


tpsp_stats = {name: compile_stats(TPSP_FNS[name], *block_args(B5, S5, block_w)) for name in TPSP_PLANS}
kinds5 = ("all-gather", "reduce-scatter", "collective-permute", "all-to-all", "all-reduce")
print(f"per device, forward + backward of the attention block on tp = {TPSP_TP} × sp = {TPSP_SP} (bytes)")
header = f"{'sequence strategy':18s}" + "".join(f"{k:>20s}" for k in kinds5)
print(header + "\n" + "-" * len(header))
for name, s in tpsp_stats.items():
    print(f"{name:18s}" + "".join(f"{s.bytes_moved[k]:20,d}" for k in kinds5))

if P >= 4:
    tp, sp, n, d = TPSP_TP, TPSP_SP, S5 // TPSP_SP, H5 // HEADS5
    megatron_plan = ParallelPlan(jaxring.make_mesh(dp=sp, tp=tp), tensor_parallel="megatron")
    ring_plan = ParallelPlan(jaxring.make_mesh(dp=tp, sp=sp), attention="ring")
    local_heads = Attention(H5, HEADS5 // tp, KV5 // tp, head_dim=d, rngs=nnx.Rngs(0))  # one tp rank's heads
    alone = {
        "Megatron alone": compile_stats(block_forward_backward(block, megatron_plan), *block_args(B5 * sp, n, block_w)),
        "ring alone": compile_stats(
            block_forward_backward(local_heads, ring_plan),
            *block_args(B5 * tp, S5, nnx.to_pure_dict(nnx.split(local_heads)[1])),
        ),
    }
    megatron_formula = 5 * (tp - 1) * B5 * n * H5 * 4 // tp
    kv_block = B5 * n * (KV5 // tp) * d * 4
    ring_formula = (2 * (sp - 1) + 2 * (sp - 1) + 2 * sp) * kv_block
    local_w = 4 * H5 * d * (2 * HEADS5 + 2 * KV5) // tp
    grad_sum_formula = round(2 * (sp - 1) / sp * local_w)
    rows = [
        (f"Megatron alone (dp={sp} × tp={tp}, {n} tokens)", alone["Megatron alone"]),
        (f"ring alone (dp={tp} × sp={sp}, {HEADS5 // tp}/{KV5 // tp} heads)", alone["ring alone"]),
        ("tp × sp (Megatron × ring)", tpsp_stats["ring"]),
    ]
    print(
        f"\nMegatron × ring, bytes per device{'':14s}{'all-gather + reduce-scatter':>29s}{'collective-permute':>20s}"
        f"{'all-reduce':>12s}"
    )
    for label, s in rows:
        print(
            f"  {label:45s}{s.bytes_moved['all-gather'] + s.bytes_moved['reduce-scatter']:29,d}"
            f"{s.bytes_moved['collective-permute']:20,d}{s.bytes_moved['all-reduce']:12,d}"
        )
    print(f"  {'formula':45s}{megatron_formula:29,d}{ring_formula:20,d}{grad_sum_formula:12,d}")
    print(
        "    Megatron 5(tp-1)/tp·b(S/sp)h; ring (4(sp-1) + 2sp) K/V blocks of b(S/sp)(kv/tp)d; "
        "dW summed over sp: 2(sp-1)/sp · |W|/tp"
    )
    ring = tpsp_stats["ring"].bytes_moved
    assert ring["all-gather"] + ring["reduce-scatter"] == megatron_formula
    assert ring["collective-permute"] == ring_formula and ring["all-to-all"] == 0
    assert ring["all-reduce"] == grad_sum_formula
    assert (
        alone["Megatron alone"].bytes_moved["all-gather"] + alone["Megatron alone"].bytes_moved["reduce-scatter"]
        == megatron_formula
        and alone["ring alone"].bytes_moved["collective-permute"] == ring_formula
    )

# %% [markdown]
# The tp × sp layer moves exactly Megatron's bytes plus the ring's: each axis does its own work and nothing
# is added for combining them. The all-reduce differs between the rows only because the weights are
# replicated over different axes (`sp`, `dp`, or `dp × sp`). The other strategies compose the same way,
# with their own sequence traffic in place of the ring's: Ulysses's all-to-alls, all-gather's gathers and
# reduce-scatters of K/V, WallFacer's team collectives and shorter rings, USP's all-to-alls over `U` and
# ring over `sp/U`. Each moves only the K/V heads of its own `tp` rank (`1/tp` of them when there are at
# least `tp` K/V heads), so its sequence traffic is that fraction of what it would move with all heads.

# %% [markdown]
# ## 6. ZeRO stages
#
# Data parallelism replicates the model: every device holds the weights, their gradient and the optimizer
# state. ZeRO (Rajbhandari et al.; the Ultra-Scale Playbook's section on it) shards them over the `N`
# data-parallel devices, one more at each stage. With `Ψ` parameters, per device (the Playbook's figures):
#
# | stage | sharded over the N devices | collectives of one step | bytes moved | memory (weights + gradients + optimizer) |
# |---|---|---|---|---|
# | 0 | nothing | all-reduce of the gradients | `2Ψ` | `2Ψ + 2Ψ + kΨ` |
# | 1 | optimizer state | reduce-scatter of the gradients; each device updates its slice; all-gather of the new weights | `Ψ + Ψ` | `2Ψ + 2Ψ + kΨ/N` |
# | 2 | + gradients | the same, each layer's gradient reduce-scattered as the backward produces it (no full gradient) | `Ψ + Ψ` | `2Ψ + (2Ψ + kΨ)/N` |
# | 3 | + weights | each layer's weights all-gathered in the forward and again in the backward; gradients reduce-scattered | `3Ψ` | `(2Ψ + 2Ψ + kΨ)/N` |
#
# (Bytes moved are these times `(N − 1)/N`. The Playbook counts bf16 weights and gradients, 2 bytes each,
# and `k = 12` bytes of fp32 master weights and Adam moments.) Here everything is fp32: weights and
# gradients 4 bytes each, and `k = 8` bytes of Adam moments (fp32 weights are their own master copy).
#
# `ParallelPlan(mesh, zero=stage)` (`RunSpec.of(zero=...)`, `train.py --zero`) picks the stage, and
# `jaxring/parallel/zero.py` writes each as exactly those collectives inside the train step's `shard_map`, over the
# plan's replica axes (the data axes and `sp`: every axis a weight is replicated on). We compile the train
# step (`jaxring.train.step.TrainStep`, what `Trainer` runs: forward, backward, gradient reduction,
# clipping and AdamW) of a 4-layer GPT on `dp = 8` for each stage, with abstract inputs (nothing runs), and
# read the bytes each device receives and the memory `memory_analysis()` reports: arguments (what is
# stored between steps: weights, optimizer state and the batch) and temporaries.

# %%
import re

import optax

from jaxring.analysis.compiled import collective_traffic
from jaxring.models import gpt
from jaxring.train.step import TrainStep

ZERO_N = P
ZERO_CFG = gpt.GPTConfig(vocab_size=256, num_layers=4, hidden=128, num_heads=4, ffn=512)
ZERO_BATCH, ZERO_SEQ = ZERO_N, 16  # one sequence of 16 tokens per device
zero_model = gpt.GPT(ZERO_CFG, rngs=nnx.Rngs(0))
zero_params = nnx.to_pure_dict(nnx.state(zero_model))  # params["blocks"][...] stacked [4, ...]


def abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def compiled_train_step(stage):
    """The train step on dp = N at this ZeRO stage, compiled for abstract inputs."""
    plan = ParallelPlan(jaxring.make_mesh(dp=ZERO_N), zero=stage)
    tx = optax.adamw(1e-3)
    step = TrainStep(plan, zero_model, tx, gpt.NextTokenObjective(ZERO_BATCH, ZERO_SEQ))
    params = abstract(zero_params, step.shardings(step.param_specs))
    opt_specs = step.opt_state_specs(params)
    opt_state = abstract(jax.eval_shape(tx.init, params), step.shardings(opt_specs))
    tokens = jax.ShapeDtypeStruct((ZERO_BATCH, ZERO_SEQ), jnp.int32, sharding=plan.tokens_sharding())
    batch = {"tokens": tokens, "targets": tokens, "positions": tokens}
    key, max_loss = jax.ShapeDtypeStruct((2,), jnp.uint32), jax.ShapeDtypeStruct((), jnp.float32)
    return step.build(opt_specs).lower(params, opt_state, batch, key, max_loss).compile()


def array_bytes(compiled):
    """Bytes received per device by collective kind, with the scalars (the loss and the pieces of the
    gradient norm, a few bytes) left out: rank-0 shapes are read as empty."""
    text = re.sub(r"\b(f32|s32|u32|pred)\[\]", r"\1[0]", compiled.as_text())
    return collective_traffic(text, ZERO_N)[0]


STAGES = (0, 1, 2, 3)
compiled_steps = {stage: compiled_train_step(stage) for stage in STAGES}
zero_moved = {stage: array_bytes(c) for stage, c in compiled_steps.items()}
zero_memory = {stage: c.memory_analysis() for stage, c in compiled_steps.items()}

PSI = sum(x.size for x in jax.tree.leaves(zero_params))
W = 4 * PSI  # bytes of one fp32 copy of the weights
share = (ZERO_N - 1) / ZERO_N
playbook_moved = {0: 2 * share * W, 1: 2 * share * W, 2: 2 * share * W, 3: 3 * share * W}
print(
    f"GPT {ZERO_CFG.num_layers} layers, hidden {ZERO_CFG.hidden}: Ψ = {PSI:,} parameters, "
    f"W = 4Ψ = {W / MiB:.2f} MiB; dp = N = {ZERO_N}"
)
print("\nbytes received per device in one step (MiB)")
header = (
    f"{'stage':>5s}{'all-reduce':>12s}{'reduce-scatter':>16s}{'all-gather':>12s}{'total':>9s}{'Playbook':>10s}  formula"
)
print(header + "\n" + "-" * (len(header) + 14))
for stage in STAGES:
    m = zero_moved[stage]
    total = m["all-reduce"] + m["reduce-scatter"] + m["all-gather"]
    formula = {0: "2W", 1: "(W + W)", 2: "(W + W)", 3: "3W"}[stage]
    print(
        f"{stage:5d}{m['all-reduce'] / MiB:12.3f}{m['reduce-scatter'] / MiB:16.3f}{m['all-gather'] / MiB:12.3f}"
        f"{total / MiB:9.3f}{playbook_moved[stage] / MiB:10.3f}  {formula} · (N-1)/N"
    )

# %% [markdown]
# Stages 0 to 2 move exactly the Playbook's bytes. Stage 3 moves a little less than `3Ψ`, and exactly what
# it should: the backward gathers again only the weights it reads. Every layer's weights come back for the
# backward (the remat policy never saves a gathered weight), except the LayerNorm biases, whose gradient
# does not depend on their value; the embedding table and the final LayerNorm, outside the scanned layer
# stack, are gathered once and kept for the backward (the two gathers are the same operation, and XLA
# merges them).

# %%
layer_weights = sum(
    x.size
    for path, x in jax.tree_util.tree_leaves_with_path(zero_params)
    if jax.tree_util.keystr(path).startswith("['blocks']") and "bias" not in jax.tree_util.keystr(path)
)
stage3_gather = round(share * (W + 4 * layer_weights))
print(
    f"stage 3 all-gather: measured {zero_moved[3]['all-gather']:,} B = (N-1)/N · (all weights + the layers' "
    f"weights but their LayerNorm biases, {layer_weights:,} parameters) = {stage3_gather:,} B"
)
assert zero_moved[0]["all-reduce"] == round(2 * share * W) and zero_moved[0]["all-gather"] == 0
for stage in (1, 2):
    assert zero_moved[stage]["reduce-scatter"] == zero_moved[stage]["all-gather"] == round(share * W)
    assert zero_moved[stage]["all-reduce"] == 0
assert zero_moved[3]["reduce-scatter"] == round(share * W) and zero_moved[3]["all-gather"] == stage3_gather

# %% [markdown]
# ### Memory per device
#
# The arguments are what each device stores between steps: the weights `W` (4Ψ bytes) and Adam's moments
# `M = 2W`, replicated or sharded as the stage says, plus a few hundred bytes: this device's batch
# (tokens, targets, positions) and scalars such as Adam's step count. The Playbook's totals also count the gradient `G = W`, which lives only during
# the step, in the temporaries: whole at stages 0 and 1, a `1/N` shard from stage 2 on. The temporaries
# also hold what the formulas leave out: the activations kept for the backward, the logits, the results
# of the collectives and of the optimizer update before they replace the stored state, and at stage 3 the
# gathered weights of the layer being computed.

# %%
M, G = 2 * W, W
stored_formula = {0: W + M, 1: W + M // ZERO_N, 2: W + M // ZERO_N, 3: (W + M) // ZERO_N}
playbook_memory = {0: W + G + M, 1: W + G + M // ZERO_N, 2: W + (G + M) // ZERO_N, 3: (W + G + M) // ZERO_N}
args = {stage: m.argument_size_in_bytes for stage, m in zero_memory.items()}
temps = {stage: m.temp_size_in_bytes for stage, m in zero_memory.items()}
total = {stage: args[stage] + temps[stage] for stage in STAGES}
rest = {stage: args[stage] - stored_formula[stage] for stage in STAGES}  # the batch and a few scalars
batch_bytes = 3 * (ZERO_BATCH // ZERO_N) * ZERO_SEQ * 4  # tokens, targets, positions (int32)
print(
    f"per device (MiB; W = {W / MiB:.2f}); arguments = W + M as stored + {rest[0]} B "
    f"({batch_bytes} B of batch and {rest[0] - batch_bytes} B of scalars) at every stage"
)
header = (
    f"{'stage':>5s}{'arguments':>11s}{'W + M stored':>14s}{'temporaries':>13s}{'(/ W)':>7s}{'total':>9s}"
    f"{'saved':>8s}{'Playbook W + G + M':>20s}{'saved':>8s}"
)
print(header + "\n" + "-" * len(header))
for stage in STAGES:
    saved = "" if stage == 0 else f"{(total[stage - 1] - total[stage]) / MiB:8.3f}"
    saved_playbook = "" if stage == 0 else f"{(playbook_memory[stage - 1] - playbook_memory[stage]) / MiB:8.3f}"
    print(
        f"{stage:5d}{args[stage] / MiB:11.3f}{stored_formula[stage] / MiB:14.3f}"
        f"{temps[stage] / MiB:13.3f}{temps[stage] / W:7.2f}{total[stage] / MiB:9.3f}{saved:>8s}"
        f"{playbook_memory[stage] / MiB:20.3f}{saved_playbook:>8s}"
    )
# the stored state exactly as the formulas; each stage saves what the Playbook says, within two layers'
# weights (the full gradient of the layer being computed and of the one being reduce-scattered)
one_layer = 4 * sum(x.size for x in jax.tree.leaves(zero_params["blocks"])) // ZERO_CFG.num_layers
assert len(set(rest.values())) == 1 and batch_bytes <= rest[0] < batch_bytes + 64, rest
for a, b in itertools.pairwise(STAGES):
    assert total[b] < total[a], (a, b)
    assert total[a] - total[b] >= playbook_memory[a] - playbook_memory[b] - 2 * one_layer, (a, b)

fig, (ax_bytes, ax_mem) = plt.subplots(1, 2, figsize=(13, 4.5))
xs = np.arange(len(STAGES))
bottom = np.zeros(len(STAGES))
for i, kind in enumerate(("all-reduce", "reduce-scatter", "all-gather")):
    values = np.array([zero_moved[stage][kind] / MiB for stage in STAGES])
    ax_bytes.bar(xs, values, 0.6, bottom=bottom, color=f"C{i}", label=kind)
    bottom += values
ax_bytes.hlines(
    [playbook_moved[stage] / MiB for stage in STAGES],
    xs - 0.4,
    xs + 0.4,
    color="k",
    lw=2,
    label="Playbook: 2Ψ, Ψ + Ψ, Ψ + Ψ, 3Ψ (× (N-1)/N)",
)
ax_bytes.set_title(f"bytes received per device per step (dp = {ZERO_N})")
stored = np.array([args[stage] for stage in STAGES]) / MiB
ax_mem.bar(xs, stored, 0.6, color="C4", label="arguments (stored between steps)")
ax_mem.bar(xs, np.array([temps[stage] for stage in STAGES]) / MiB, 0.6, bottom=stored, color="C7", label="temporaries")
ax_mem.hlines(
    [playbook_memory[stage] / MiB for stage in STAGES],
    xs - 0.4,
    xs + 0.4,
    color="k",
    lw=2,
    label="Playbook: weights + gradients + Adam moments",
)
ax_mem.set_title("memory per device (compiled train step)")
for ax in (ax_bytes, ax_mem):
    ax.set_xticks(xs, [f"ZeRO-{stage}" for stage in STAGES])
    ax.set_ylabel("MiB")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Each stage trades bytes for memory as the Playbook says. Stages 1 and 2 move the same bytes as stage 0
# (a reduce-scatter and an all-gather are the two halves of an all-reduce) and save memory for free:
# stage 1 the optimizer state, stage 2 the gradient buffer as well. Stage 3 adds `Ψ` of all-gathers, the
# price of storing only `1/N` of the weights.
#
# The stored state shrinks exactly as the formulas say, and each stage saves what the Playbook says it
# saves (the two `saved` columns), within two layers' weights (how many layers' full gradients are alive at
# once before their reduce-scatter is up to XLA's schedule); stage 1 saves more, because stage 0's
# temporaries come to about three times `W` (the gradient, the all-reduce's result beside it, and the
# update's working copies of the state), and those shrink with the optimizer state too. The totals stay
# above the Playbook's because of the temporaries it does not count: from stage 2 on, where the formulas
# leave only `G/N` of gradient, they are mostly buffers that do not shrink with `N`: the activations, and
# at stage 3 the weights of the layer in flight, gathered whole.
#
# `tests/unit/parallel/test_zero.py` asserts these figures, and `tests/integration/test_train.py` that every stage trains to the
# same losses as one device; `03_train_gpt.ipynb` trains with ZeRO-3.
