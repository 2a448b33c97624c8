"""The planner's cost model: what one training step of a plan moves over each mesh axis, what it keeps in
memory per device, and how long it takes on a cluster. One file, the papers' formulas, term by term.

Units: bytes per device (what one device receives, as `jaxring.analysis.compiled` counts them), one step =
`steps` micro-steps (gradient accumulation, or the pipeline's micro-batches) and one optimizer update.
Notation (per device, one micro-step): b local sequences (rows), n = s / sp tokens of the sequence shard,
h hidden, H / K query / K-V heads (after the tensor split), d head dim, f the FFN width (after the tensor
split), e bytes per activation element (2 for bf16, 4 for fp32), F = 4 (fp32: weights, gradients, and the
accumulators the kernels keep in fp32), L' = layers on this device, Ψ parameters per device.

Sequence strategies, per layer (forward F, backward B), over the sequence axes; KV = b·n·K·d·e, KV32 the same
in fp32, Q = b·n·H·d·e, r = b·n·H·F (one fp32 per row and head):
  ring       P2P: F 2(P-1)·KV, B 2(P-1)·KV + 2P·KV32            (the playbook; WallFacer Eq. 2: P(2BNH/PW))
  rsa        two rings: F 2(P-1)·KV, B 2(P-1)·KV + reduce-scatter 2(P-1)·KV32   (RSA: 8(N-1)·BZ(L/N)A)
  ulysses    all-to-all: F = B = (P-1)/P·b·n·d·e·(2H + 2·lcm(K, P))              (DeepSpeed-Ulysses: 4 / layer)
  allgather  F all-gather 2(P-1)·KV, B reduce-scatter 2(P-1)·KV
  usp        Ulysses over U (heads) × ring over P/U (the ring's blocks are U× longer, 1/U of the heads)
  wallfacer  C = team size, P/C² sub-ring length (WallFacer Eqs. 2-4: collectives 4BNH(C-1)/(PW), P2P
             2BNH/(CW)): team all-gathers (C-1)(Q + 2KV + r), lse exchange, reduce-scatter (C-1)·Q32; the
             init map 2C·KV; sub-ring (P/C²-1)·2C·KV; backward: Q, dO, lse, Δ round the sub-ring, dQ home,
             dK/dV back along the inverse map and reduce-scattered.
Tensor methods, per layer, over the tensor axes (U = (p-1)/p·b·n·h·e, p = tp):
  megatron   5U per block (attention, MLP): 2 forward, 3 backward (Megatron TP+SP, METP Table 1: 5(p-1)/p·bsh)
  metp       FFN: (3p-2)/p·(k1k2 + k2n) (METP Algorithms 1-2 with the extra gradient hop: p-1 weight hops
             forward, p-1 + p backward); MHA: head-group broadcasts p·⌈log2 p⌉ (forward, twice backward) and
             the K/V ring p(p-1) forward, p(2p-1) backward (METP Section 4, Table 2)
  optimus    SUMMA (Optimus Algorithms 1-3) per product C = AB: forward A within the row, B within the column,
             backward dA = dC·Bᵀ (B down the column, dA reduced in the row) and dB = Aᵀ·dC (A in the row, dB
             reduced down the column); a broadcast costs (1 + q(R-1)) blocks, a reduce qR, R = ⌈log2 q⌉
             (Table 1: log(p)/(2√p)·(7bsh + 12h²) forward)
Gradients over the replica axes (data and sequence, R devices, the playbook's ZeRO): stage 0 all-reduce
2(R-1)/R·Ψ·F; stages 1-2 reduce-scatter + all-gather (R-1)/R·Ψ·F each (stage 2 scatters every micro-step);
stage 3 all-gathers forward and again backward (weights the backward reads) and reduce-scatters each micro-step.
Pipeline: each tick with a send moves one activation b·n_act·h·e; the bubble comes from the schedule
simulator (`jaxring.pipeline.simulate`, lockstep clock: one SPMD program). Experts: 4 all-to-alls of the
dispatch buffer per layer (MoE, the playbook's EP).

Step time = compute (model FLOPs + recomputation, at a stated efficiency of peak) + exposed communication
(bytes / link bandwidth + latency per message; the ring-family P2P of the attention loops overlaps the
attention compute, as the GPU compile shows (`benchmarks/results/gpu_compile.json`); every other collective is
exposed) + the pipeline bubble + the optimizer update (HBM-bound).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxring.planner.space import Candidate, Workload
from jaxring.precision import BYTES_PER_ELEMENT as DTYPE_BYTES

F32 = 4
# XLA:CPU sends bf16 collectives as f32 (convert, send, convert back): bytes measured on simulated CPU
# devices are 4 per element whatever the precision.
CPU_COLLECTIVE_BYTES = 4


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Bytes one device receives per step over the run-mesh axes `axes`, in `messages` sequential messages;
    `overlap` names the compute it hides behind ("attention": a ring loop's per-step transfer), or None."""

    what: str
    axes: tuple[str, ...]
    bytes: float
    messages: int = 1
    overlap: str | None = None
    phase: str = "layer"  # "layer": inside the micro-steps (pipeline ticks); "step": once per update


# ---------------------------------------------------------------------------------------------- dimensions


@dataclasses.dataclass(frozen=True)
class Dims:
    """Per-device sizes of one micro-step (see the module docstring)."""

    steps: int  # micro-steps per step
    b: int  # local rows (sequences) per micro-step
    n: int  # tokens of the sequence shard (s / sp)
    n_act: int  # tokens of the residual stream per device (activation layout)
    h: int
    heads: int  # query heads on this device (after the tensor split)
    kv_heads: int  # K/V heads on this device
    d: int
    ffn: int  # FFN columns on this device
    layers: int  # layers on this device (L / pp)
    e: int  # activation bytes
    seq_axes: dict  # run-mesh sequence axes and sizes (size > 1)
    tensor_axes: dict  # run-mesh tensor axes and sizes (size > 1)


def seq_axes(c: Candidate) -> dict:
    """The run-mesh axes the sequence strategy factors sp into (jaxring.registry's views)."""
    if c.sp == 1:
        return {}
    if c.attention == "usp":
        axes = {"usp_ring": c.sp // c.ulysses_size, "usp_ulysses": c.ulysses_size}
    elif c.attention == "wallfacer":
        C = c.team_size
        axes = {"wf_group": C, "wf_ring": c.sp // (C * C), "wf_team": C}
    else:
        axes = {"sp": c.sp}
    return {a: s for a, s in axes.items() if s > 1}


def tensor_axes(c: Candidate) -> dict:
    if c.tp == 1:
        return {}
    if c.tensor == "optimus":
        q = math.isqrt(c.tp)
        return {"tpr": q, "tpc": q}
    return {"tp": c.tp}


def batch_axes(c: Candidate) -> dict:
    return {a: s for a, s in (("dp", c.dp), ("ep", c.ep)) if s > 1}


def dims(w: Workload, c: Candidate, cpu: bool = False) -> Dims:
    cfg = w.config
    heads = cfg.num_heads
    kv = getattr(cfg, "num_kv_heads", None) or heads
    d = cfg.hidden // heads
    tensor = c.tensor if c.tp > 1 else None
    q = math.isqrt(c.tp) if tensor == "optimus" else 1
    b = c.micro_batch // q
    n = w.seq_len // c.sp
    if tensor == "megatron":
        loc_heads, loc_kv, n_act = heads // c.tp, (kv // c.tp if kv % c.tp == 0 else 1), n // c.tp
    elif tensor == "optimus":
        loc_heads, loc_kv, n_act = heads // q, kv // q, n
    elif tensor == "metp":
        loc_heads, loc_kv, n_act = heads, kv, n // c.tp
        n = n_act  # METP's attention works on the device's s/p tokens
    else:
        loc_heads, loc_kv, n_act = heads, kv, n
    split = {"megatron": c.tp, "metp": c.tp, "optimus": q}.get(tensor, 1)
    e = CPU_COLLECTIVE_BYTES if cpu else DTYPE_BYTES[w.precision]
    return Dims(
        c.steps(w),
        b,
        n,
        n_act,
        cfg.hidden,
        loc_heads,
        loc_kv,
        d,
        cfg.ffn_size // split,
        cfg.num_layers // c.pp,
        e,
        seq_axes(c),
        tensor_axes(c),
    )


def _axes(*names_sizes: dict) -> tuple[str, ...]:
    """Axis names (size > 1) in run-mesh order."""
    order = (
        "dp",
        "pp",
        "fsdp",
        "ep",
        "sp",
        "usp_ring",
        "usp_ulysses",
        "wf_group",
        "wf_ring",
        "wf_team",
        "tp",
        "tpr",
        "tpc",
    )
    have = {a for ns in names_sizes for a, s in ns.items() if s > 1}
    return tuple(a for a in order if a in have)


# ---------------------------------------------------------------------------------------- sequence strategies


def sequence_attention(w: Workload, c: Candidate, x: Dims) -> list[Transfer]:
    """One layer's attention core over the sequence axes, forward and backward, one micro-step."""
    if c.sp == 1:
        return []
    P, e = c.sp, x.e
    KV = x.b * x.n * x.kv_heads * x.d * e
    KV32 = x.b * x.n * x.kv_heads * x.d * F32
    Q = x.b * x.n * x.heads * x.d * e
    Q32 = x.b * x.n * x.heads * x.d * F32
    rows = x.b * x.n * x.heads * F32
    sp = ("sp",)
    if c.attention == "ring":
        return [
            Transfer("ring K/V forward", sp, 2 * (P - 1) * KV, P - 1, "attention"),
            Transfer("ring K/V + fp32 dK/dV backward", sp, 2 * (P - 1) * KV + 2 * P * KV32, P, "attention"),
        ]
    if c.attention == "rsa":
        return [
            Transfer("RSA K then V rings forward", sp, 2 * (P - 1) * KV, 2 * (P - 1), "attention"),
            Transfer("RSA V then K rings backward", sp, 2 * (P - 1) * KV, 2 * (P - 1), "attention"),
            Transfer("RSA dK, dV reduce-scatter", sp, 2 * (P - 1) * KV32, 2),
        ]
    if c.attention == "ulysses":
        kv_sent = math.lcm(x.kv_heads, P)
        one = (P - 1) / P * x.b * x.n * x.d * e * (2 * x.heads + 2 * kv_sent)
        return [
            Transfer("Ulysses all-to-alls forward (q, k, v, out)", sp, one, 4),
            Transfer("Ulysses all-to-alls backward", sp, one, 4),
        ]
    if c.attention == "allgather":
        return [
            Transfer("all-gather K/V forward", sp, 2 * (P - 1) * KV, 2),
            Transfer("reduce-scatter dK/dV backward", sp, 2 * (P - 1) * KV, 2),
        ]
    if c.attention == "usp":
        U = c.ulysses_size
        r = P // U
        kv_u = math.lcm(x.kv_heads, U)
        a2a = (U - 1) / U * x.b * x.n * x.d * e * (2 * x.heads + 2 * kv_u)
        blk = x.b * x.n * U * (kv_u // U) * x.d  # the ring's block: U× the tokens, 1/U of the heads
        out = []
        if U > 1:
            out += [
                Transfer("USP Ulysses all-to-alls forward", ("usp_ulysses",), a2a, 4),
                Transfer("USP Ulysses all-to-alls backward", ("usp_ulysses",), a2a, 4),
            ]
        if r > 1:
            out += [
                Transfer("USP ring K/V forward", ("usp_ring",), 2 * (r - 1) * blk * e, r - 1, "attention"),
                Transfer("USP ring backward", ("usp_ring",), 2 * (r - 1) * blk * e + 2 * r * blk * F32, r, "attention"),
            ]
        return out
    if c.attention == "wallfacer":
        C = c.team_size
        tgs = P // (C * C)
        team, ring = ("wf_team",), ("wf_ring",)
        init = _axes(x.seq_axes)
        out = []
        if C > 1:
            out += [
                Transfer(
                    "WallFacer team all-gather Q, K, V + lse exchange, reduce-scatter O (forward)",
                    team,
                    (C - 1) * (Q + 2 * KV) + 2 * (C - 1) * rows + (C - 1) * Q32,
                    4,
                ),
                Transfer(
                    "WallFacer team all-gather dO, Δ; reduce-scatter dQ, dK, dV (backward)",
                    team,
                    (C - 1) * (Q + rows) + (C - 1) * Q32 + 2 * (C - 1) * KV32,
                    5,
                ),
                Transfer("WallFacer init map K/V (forward)", init, 2 * C * KV, 1),
                Transfer("WallFacer inverse init map dK/dV (backward)", init, 2 * C * KV32, 1),
            ]
        if tgs > 1:
            out += [
                Transfer("WallFacer sub-ring K/V forward", ring, (tgs - 1) * 2 * C * KV, tgs - 1, "attention"),
                Transfer(
                    "WallFacer sub-ring Q, dO, lse, Δ and dQ backward",
                    ring,
                    (tgs - 1) * C * (2 * Q + 2 * rows) + tgs * C * Q32,
                    tgs,
                    "attention",
                ),
            ]
        return out
    raise ValueError(f"no cost formula for attention {c.attention!r}")


# ---------------------------------------------------------------------------------------------- tensor methods


def _tree_rounds(q: int) -> int:
    return max(q - 1, 0).bit_length()


def _bcast(q: int, size: float) -> float:
    """Blocks received by a SUMMA step broadcast over q ranks (binomial tree; round 0 shared by the q steps)."""
    return (1 + q * (_tree_rounds(q) - 1)) * size


def _reduce(q: int, size: float) -> float:
    return q * _tree_rounds(q) * size


def _summa_ab(q: int, a: float, b: float, e: int) -> tuple[float, float]:
    """(bytes within the row (tpc), bytes down the column (tpr)) of C = AB forward and backward, |A|, |B| in
    elements: forward A in the row, B down the column; dA = dC·Bᵀ: B down the column, dA reduced (fp32) in the
    row; dB = Aᵀ·dC: A in the row, dB reduced (fp32) down the column."""
    row = 2 * _bcast(q, a) * e + _reduce(q, a) * F32
    col = 2 * _bcast(q, b) * e + _reduce(q, b) * F32
    return row, col


def tensor_layer(w: Workload, c: Candidate, x: Dims) -> list[Transfer]:
    """One layer's tensor-parallel traffic (attention and MLP blocks), forward and backward, one micro-step."""
    if c.tp == 1:
        return []
    cfg, e, p = w.config, x.e, c.tp
    kv = getattr(cfg, "num_kv_heads", None) or cfg.num_heads
    mats = 3 if cfg_activation(w) == "swiglu" else 2
    out = []
    if w.model == "dit" and c.tensor in ("megatron", "metp"):
        # adaLN: the 6 modulation vectors [b, h] of a block meet tokens split over tp; their gradients are summed
        out.append(
            Transfer(
                "DiT modulation gradients (shift, scale, gate × 2)", ("tp",), 6 * 2 * (p - 1) / p * x.b * x.h * F32, 1
            )
        )
    if c.tensor == "megatron":
        U = (p - 1) / p * x.b * x.n * x.h * e
        moe = w.moe is not None
        out += [
            Transfer("Megatron attention block g, g* (5 transitions)", ("tp",), 5 * U, 5),
            Transfer(
                "Megatron MLP block g, g* (5 transitions)"
                if not moe
                else "Megatron MoE block: all-gather in, all-reduce out (7 transitions)",
                ("tp",),
                (7 if moe else 5) * U,
                5,
            ),
        ]
        return out
    if c.tensor == "metp":
        rounds = _tree_rounds(p)
        h, d = x.h, x.d
        ffn_blocks = (mats * h * cfg.ffn_size) // p  # (k1·k2 + k2·n)/p, W_gate too for SwiGLU
        weights = (h * (cfg.num_heads + 2 * kv) * d + cfg.num_heads * d * h) // p
        kvb = x.b * (w.seq_len // p) * (kv // p) * d
        pos = x.b * (w.seq_len // p) if w.causal else 0
        return out + [
            Transfer("METP FFN ring: (B, C) blocks p-1 hops forward", ("tp",), (p - 1) * ffn_blocks * e, p - 1, "ffn"),
            Transfer(
                "METP FFN ring backward: blocks p-1 hops, fp32 gradients p hops",
                ("tp",),
                (p - 1) * ffn_blocks * e + p * ffn_blocks * F32,
                p,
                "ffn",
            ),
            Transfer(
                "METP MHA head-group broadcasts (forward; again with the ΔW reduces backward)",
                ("tp",),
                p * rounds * weights * e + p * rounds * weights * (e + F32),
                3 * p * rounds,
            ),
            Transfer(
                "METP MHA K/V ring: p(p-1) hops forward, p(p-1) + p² (fp32 dK/dV) backward; positions",
                ("tp",),
                p * (p - 1) * 2 * kvb * e
                + p * (p - 1) * 2 * kvb * e
                + p * p * 2 * kvb * F32
                # causal positions ride with K/V: p(p-1) hops forward; backward they are the same for
                # every head group and XLA sends them once per hop (p-1); p = 2 unrolls and sends less
                + (p * p - 1) * pos * 4,
                2 * p * p,
                "attention",
            ),
        ]
    if c.tensor == "optimus":
        q = math.isqrt(p)
        rows = x.b * w.seq_len  # [b/q·s] rows of the local activation block
        hq, fq = x.h // q, cfg.ffn_size // q
        qkv = (cfg.num_heads + 2 * kv) * x.d // q
        products = [
            (rows * hq, hq * qkv),
            (rows * cfg.num_heads * x.d // q, cfg.num_heads * x.d // q * hq),
            (rows * hq, hq * (mats - 1) * fq),
            (rows * fq, fq * hq),
        ]
        row = col = 0.0
        for a, bb in products:
            r_, c_ = _summa_ab(q, a, bb, e)
            row, col = row + r_, col + c_
        # two 2D layernorms: Σx, Σx² all-reduced in the row forward, Σx̂g, Σg backward (fp32 per row)
        ln = 2 * 2 * (2 * 2 * (q - 1) / q * rows * F32)
        return [
            Transfer("Optimus SUMMA within rows (activation blocks)", ("tpc",), row + ln, 8 * q),
            Transfer("Optimus SUMMA down columns (weight blocks)", ("tpr",), col, 8 * q),
        ]
    raise ValueError(f"no cost formula for tensor parallelism {c.tensor!r}")


def cfg_activation(w: Workload) -> str:
    return getattr(w.config, "activation", "gelu")


def head_and_embedding(w: Workload, c: Candidate, x: Dims) -> list[Transfer]:
    """The embedding, final norm, head and loss outside the layer stack, one micro-step."""
    if c.tp == 1:
        return []
    cfg, e, p = w.config, x.e, c.tp
    if w.model == "dit":
        if c.tensor not in ("megatron", "metp"):
            return []
        return [
            Transfer(
                "DiT final layer's modulation gradients (shift, scale)",
                ("tp",),
                2 * 2 * (p - 1) / p * x.b * x.h * F32,
                1,
            )
        ]
    if c.tensor == "megatron":
        U = (p - 1) / p * x.b * x.n * x.h * e
        rows = x.b * x.n * F32  # fp32 per token of the sp shard
        return [
            Transfer("Megatron vocab-parallel embedding and head (5 transitions)", ("tp",), 5 * U, 5),
            Transfer(
                "Megatron vocab-parallel cross-entropy (max, Σexp, label)", ("tp",), 3 * 2 * (p - 1) / p * rows, 3
            ),
        ]
    if c.tensor == "optimus":
        q = math.isqrt(p)
        rows = x.b * w.seq_len
        hq, vq = x.h // q, cfg.vocab_size // q
        table = vq * hq
        if cfg.tie_embeddings:
            # lookup (Alg 1 with a local one-hot: the table down the column) and head (Alg 2, logits = x·Eᵀ):
            # the table blocks are broadcast once for the lookup, the head and its dA (XLA merges the three
            # identical broadcasts); the head's dC is broadcast once within the row for dA and dB
            col = _bcast(q, table) * e + _reduce(q, table) * F32 + _reduce(q, table) * F32
            row = _reduce(q, rows * vq) * F32 + _bcast(q, rows * vq) * e
        else:
            r_, c_ = _summa_ab(q, rows * hq, hq * vq, e)
            col = _bcast(q, table) * e + _reduce(q, table) * F32 + c_
            row = r_
        ln = 2 * (2 * 2 * (q - 1) / q * rows * F32)
        ce = 3 * 2 * (q - 1) / q * rows * F32
        return [
            Transfer("Optimus embedding and head within rows; norm; cross-entropy", ("tpc",), row + ln + ce, 6),
            Transfer("Optimus embedding and head down columns", ("tpr",), col, 4),
        ]
    return []


# ---------------------------------------------------------------------------------------------- experts


def moe_layer(w: Workload, c: Candidate, x: Dims) -> list[Transfer]:
    """One MoE layer's expert exchange over ep (dispatch and combine, forward and backward) and its routing
    statistics, one micro-step."""
    moe = w.moe
    if moe is None:
        return []
    out = []
    tokens = x.b * x.n
    token_axes = {**batch_axes(c), **x.seq_axes}
    R = math.prod(token_axes.values())
    if R > 1:
        out.append(Transfer("MoE load statistics", _axes(token_axes), 2 * (R - 1) / R * 2 * moe.num_experts * 4, 2))
    if c.ep == 1:
        return out
    ep, E, k = c.ep, moe.num_experts, moe.experts_per_token
    if moe.capacity_factor is None:
        buffer = ep * tokens * min(k, E // ep) * x.h * x.e
        counts = (ep - 1) * E * 4 / ep
    else:
        cap = min(tokens, math.ceil(moe.capacity_factor * tokens * k / E))
        buffer, counts = E * cap * x.h * x.e, 0
    out.append(
        Transfer(
            "MoE dispatch + combine all-to-alls (forward and backward)", ("ep",), 4 * (ep - 1) / ep * buffer + counts, 5
        )
    )
    return out


# ---------------------------------------------------------------------------------------------- gradients


def gradient_sync(w: Workload, c: Candidate, x: Dims, leaves) -> list[Transfer]:
    """Weight gradients: psums over the tensor axes a weight is replicated on (each micro-step), the pipeline's
    shared weights over pp, and the ZeRO stage's reduction over the replica axes (see the module docstring)."""
    out = []
    by_axes: dict[tuple, dict[str, float]] = {}
    A = x.steps
    for leaf in leaves:
        psi = leaf.size * F32
        # the DiT's conditioning path (timestep, label, adaLN) runs on per-sequence vectors the tensor axes do not
        # split: its gradients come out whole (the modulation vectors' gradients are summed instead, below)
        conditioning = w.model == "dit" and any(k in leaf.path for k in ("adaLN", "t_embed", "y_embed"))
        if leaf.unsplit_tensor and not conditioning:
            g = math.prod(x.tensor_axes[a] for a in leaf.unsplit_tensor)
            reads = (
                2
                if (
                    c.tensor in ("metp", None)
                    and leaf.path == "['embed']['table']"
                    and getattr(w.config, "tie_embeddings", False)
                )
                else 1
            )
            key = ("tensor", tuple(leaf.unsplit_tensor))
            by_axes.setdefault(key, {}).setdefault("psum", 0.0)
            by_axes[key]["psum"] += A * reads * 2 * (g - 1) / g * psi
        if c.pp > 1 and not leaf.stacked:
            by_axes.setdefault(("pp", ("pp",)), {}).setdefault("psum", 0.0)
            by_axes[("pp", ("pp",))]["psum"] += 2 * (c.pp - 1) / c.pp * psi
        if not leaf.replica:
            continue
        sizes = {**batch_axes(c), **x.seq_axes}
        R = math.prod(sizes[a] for a in leaf.replica)
        share = (R - 1) / R * psi
        stage = c.zero if leaf.zero_sharded else 0
        kinds = by_axes.setdefault(("zero", leaf.replica), {})
        if stage == 0:
            kinds["all-reduce"] = kinds.get("all-reduce", 0.0) + 2 * share
        elif stage == 1:
            kinds["reduce-scatter"] = kinds.get("reduce-scatter", 0.0) + share
            kinds["all-gather"] = kinds.get("all-gather", 0.0) + share
        elif stage == 2:
            kinds["reduce-scatter"] = kinds.get("reduce-scatter", 0.0) + A * share
            kinds["all-gather"] = kinds.get("all-gather", 0.0) + share
        else:
            reread = 1 if (leaf.stacked and not leaf.bias) else 0
            kinds["reduce-scatter"] = kinds.get("reduce-scatter", 0.0) + A * share
            kinds["all-gather"] = kinds.get("all-gather", 0.0) + A * (1 + reread) * share
    names = {
        "all-reduce": "gradient all-reduce (ZeRO-0: 2Ψ)",
        "reduce-scatter": "gradient reduce-scatter",
        "all-gather": "weight all-gather",
        "psum": "gradient psum",
    }
    for (kind, axes), kinds in by_axes.items():
        for k, v in kinds.items():
            what = {
                "tensor": "replicated weights' " + names[k] + " over the tensor axes",
                "pp": "shared weights' gradient psum over pp (embedding, head, final norm)",
                "zero": f"ZeRO-{c.zero} " + names[k],
            }[kind]
            per_micro_step = kind == "tensor" or (
                kind == "zero" and (c.zero == 3 or (c.zero == 2 and k == "reduce-scatter"))
            )
            messages = A * x.layers if per_micro_step else 1
            out.append(Transfer(what, axes, v, messages, None, "layer" if per_micro_step else "step"))
    return out


# ---------------------------------------------------------------------------------------------- pipeline


def activation_bytes(w: Workload, x: Dims) -> float:
    """One micro-batch's residual stream as it crosses a stage boundary (DiT: plus its conditioning row)."""
    act = x.b * x.n_act * x.h * x.e
    if w.model == "dit":
        act += x.b * x.h * x.e
    return act


@dataclasses.dataclass(frozen=True)
class PipelineInfo:
    """What the cost model reads from a schedule's table: ticks that send (forward, backward), the most
    micro-batch-chunks a stage holds, and the lockstep makespan and busy time with a micro-batch's stage work
    costing 1 (F 1/3, B and W 1/3 each, BW 2/3: the playbook's t_b = 2 t_f)."""

    send_ticks: int
    peak_in_flight: int
    makespan: float
    busy: float


@functools.lru_cache(maxsize=1024)
def pipeline_info(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> PipelineInfo:
    from jaxring.pipeline import lower, make_schedule, peak_in_flight, simulate
    from jaxring.pipeline.schedules import BW, B, F, W

    sched = make_schedule(schedule, pp, microbatches, virtual_stages)
    low = lower(sched)
    ticks = sum(1 for pairs in low.fwd_pairs if pairs) + sum(1 for pairs in low.bwd_pairs if pairs)
    sim = simulate(sched, {F: 1 / 3, B: 1 / 3, W: 1 / 3, BW: 2 / 3}, lockstep=True)
    return PipelineInfo(ticks, max(peak_in_flight(sched)), sim.makespan / microbatches, sim.busy / microbatches)


def pipeline_sends(w: Workload, c: Candidate, x: Dims) -> list[Transfer]:
    if c.pp == 1:
        return []
    ticks = pipeline_info(c.pipeline, c.pp, x.steps, c.virtual_stages).send_ticks
    return [
        Transfer(
            "pipeline activations and their gradients (one per sending tick)",
            ("pp",),
            ticks * activation_bytes(w, x),
            ticks,
            None,
            "pipeline",
        )
    ]


# ---------------------------------------------------------------------------------------------- the step


def traffic(w: Workload, c: Candidate, leaves, cpu: bool = False) -> list[Transfer]:
    """Every transfer of one step, per device (bytes of a layer times the layers and micro-steps)."""
    x = dims(w, c, cpu)
    per_layer = sequence_attention(w, c, x) + tensor_layer(w, c, x) + moe_layer(w, c, x)
    out = [
        dataclasses.replace(t, bytes=t.bytes * x.layers * x.steps, messages=t.messages * x.layers * x.steps)
        for t in per_layer
    ]
    out += [
        dataclasses.replace(t, bytes=t.bytes * x.steps, messages=t.messages * x.steps)
        for t in head_and_embedding(w, c, x)
    ]
    out += gradient_sync(w, c, x, leaves)
    out += pipeline_sends(w, c, x)
    return [t for t in out if t.bytes > 0 and t.axes]


def bytes_by_axes(transfers) -> dict[tuple[str, ...], float]:
    """{run-mesh axes: bytes per device per step}, as `jaxring.planner.compiled.axis_traffic` reads them."""
    out: dict[tuple[str, ...], float] = {}
    for t in transfers:
        out[t.axes] = out.get(t.axes, 0.0) + t.bytes
    return out


# ---------------------------------------------------------------------------------------------- memory


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes. The step's stored state (weights, Adam moments, the batch) plus the larger of its two
    peaks: the start of the backward (gradient buffers, every saved activation, one layer's backward working
    set) and the update (gradients, their reduction, the new moments: 16 bytes a parameter at ZeRO-0,
    measured on the compiled GPU program)."""

    params: float
    optimizer: float
    gradients: float
    activations: float
    working: float
    update: float
    other: float = 0.0

    @property
    def backward(self) -> float:
        return self.gradients + self.activations + self.working

    @property
    def total(self) -> float:
        return self.params + self.optimizer + self.other + max(self.backward, self.update)

    def as_dict(self) -> dict:
        keys = ("params", "optimizer", "gradients", "activations", "working", "update", "other")
        return {k: round(getattr(self, k)) for k in keys} | {"total": round(self.total)}


def _q_tiles(n: int, cpu: bool) -> int:
    """Q tiles of a block of n rows in the CPU path (jnp block ops keep a running (out, lse) per tile and
    ring step); 1 on GPU (the Pallas kernels' residuals are the block's out and lse)."""
    if not cpu:
        return 1
    from jaxring.attention.blockwise import FORWARD_TILE, _tile_size

    return n // _tile_size(n, FORWARD_TILE)


def _core_saved(w: Workload, c: Candidate, x: Dims, cpu: bool) -> float:
    """What the attention core keeps per layer without remat (out and lse in fp32: the strategies accumulate
    in fp32; with the jnp block ops of the CPU path, every ring step's running result per Q tile)."""
    Q32 = x.b * x.n * x.heads * x.d * F32
    KV32 = x.b * x.n * x.kv_heads * x.d * F32
    rows = x.b * x.n * x.heads * F32
    P = c.sp
    if c.tensor == "metp" and c.tp > 1:
        return Q32 + rows  # A_i and its lse (METP Table 2: 2bsh/p)
    if P == 1 or c.attention == "dense":
        return Q32 + rows  # flash: out and lse
    if c.attention == "ring":
        return (P if cpu else 1) * _q_tiles(x.n, cpu) * (Q32 + rows)
    if c.attention == "usp":
        r = P // c.ulysses_size
        return (r if cpu else 1) * _q_tiles(x.n * c.ulysses_size, cpu) * (Q32 + rows) + Q32 + 2 * KV32
    if c.attention == "ulysses":
        return 3 * Q32 + 2 * x.b * x.n * x.d * math.lcm(x.kv_heads, P) * F32 + rows
    if c.attention == "allgather":
        return 2 * P * KV32 + Q32 + rows  # the gathered K/V, whole sequence
    if c.attention == "wallfacer":
        C = c.team_size
        return 2 * C * Q32 + 2 * C * KV32 + 2 * C * rows + Q32  # the team's Q, K, V and lse
    if c.attention == "rsa":
        em = DTYPE_BYTES[w.precision]
        return x.b * x.heads * x.n * w.seq_len * F32 + (x.b * x.n * (x.heads + 2 * x.kv_heads) * x.d * em)
    raise ValueError(f"no memory formula for attention {c.attention!r}")


def saved_per_layer(w: Workload, c: Candidate, x: Dims, remat: str, cpu: bool = False) -> float:
    """Bytes one layer keeps for its backward, one micro-batch (what the compiled step's layer scan stacks).

    none       the residual stream and norms in fp32 (8 arrays [b, n_act, h] and 4 of statistics), a K/V
               projection, the fp32 rotary halves of q and k, the attention core's residuals (per strategy),
               6 FFN-wide arrays (the playbook's sbh(34 + 5as/h) without scores: flash attention)
    selective  the layer input and the outputs of the weight matmuls the backward needs (`jax.checkpoint`'s
               dots_with_no_batch_dims_saveable keeps only residuals): q, k, v, the o projection (the residual
               sum and its norm are recomputed from it) and the FFN's up (and gate) projection; the FFN's
               down projection output is not a residual (measured per layer on the compiled CPU step)
    full       the layer input (WallFacer's and the playbook's per-layer checkpoint)
    METP keeps X_i and A_i (2bsh/p, Table 2) and the FFN input; Optimus its [b/q, s, h/q] blocks.
    """
    em = DTYPE_BYTES[w.precision]
    b, n, na, h, f = x.b, x.n, x.n_act, x.h, x.ffn
    if remat == "full":
        return b * na * h * em
    qkvo = b * n * (2 * x.heads + 2 * x.kv_heads) * x.d * em
    if remat == "selective":
        up = 2 if cfg_activation(w) == "swiglu" else 1
        return b * na * h * em + qkvo + up * b * n * f * em
    hs = h // math.isqrt(c.tp) if c.tensor == "optimus" else h  # Optimus: [b/q, s, h/q] blocks
    stream = 8 * b * na * hs * F32 + 4 * b * na * F32
    if c.tensor == "metp" and c.tp > 1:  # METP recomputes Q, K, V and f(AB)
        return stream + _core_saved(w, c, x, cpu)
    rope = b * n * (x.heads + x.kv_heads) * x.d * (F32 if w.model == "gpt" else em)
    return stream + b * n * x.kv_heads * x.d * em + rope + _core_saved(w, c, x, cpu) + _mlp_saved(w, x)


def _mlp_saved(w: Workload, x: Dims) -> float:
    """The FFN's part of what a layer keeps without remat: 6 FFN-wide arrays (MoE: per routed expert, and the
    router's fp32 probabilities)."""
    em = DTYPE_BYTES[w.precision]
    if w.moe is not None:
        moe, tokens = w.moe, x.b * x.n
        return 6 * tokens * moe.experts_per_token * moe.ffn * em + 2 * tokens * moe.num_experts * F32
    return 6 * x.b * x.n * x.ffn * em


def _attention_working(w: Workload, c: Candidate, x: Dims, cpu: bool) -> float:
    """The attention core's transient buffers during one layer's backward (received blocks, fp32 gradient
    accumulators; on CPU the jnp block ops' score tiles)."""
    em = DTYPE_BYTES[w.precision]
    KV = x.b * x.n * x.kv_heads * x.d * em
    KV32 = x.b * x.n * x.kv_heads * x.d * F32
    Q32 = x.b * x.n * x.heads * x.d * F32
    P = c.sp
    block_q, block_k = x.n, x.n
    if P == 1 or c.attention == "dense":
        out = 2 * KV32 + Q32
    elif c.attention in ("ring", "usp"):
        out = 4 * KV + 4 * KV32 + Q32
    elif c.attention == "wallfacer":
        C = c.team_size
        out = 2 * C * (KV + KV32) + 2 * C * Q32
        block_q, block_k = C * x.n, C * x.n
    elif c.attention == "allgather":
        out = 2 * P * (KV + KV32) + Q32
        block_k = w.seq_len
    elif c.attention == "ulysses":
        out = 4 * Q32 + 4 * KV32
        block_q, block_k = w.seq_len, w.seq_len
    elif c.attention == "rsa":
        out = 2 * x.b * x.heads * x.n * w.seq_len * F32
    else:
        out = 0.0
    if c.tensor == "megatron" and c.tp > 1:
        out += 2 * x.b * x.n * x.h * F32  # the tp-gathered input of a block and its gradient
    if cpu:
        # the jnp block ops' score tiles: S and P of one forward tile, or S/P, dP, dS of a backward tile
        from jaxring.attention.blockwise import BACKWARD_TILE, FORWARD_TILE, _tile_size

        heads = x.heads if c.attention != "ulysses" else max(1, x.heads // P)
        if c.tensor == "metp" and c.tp > 1:
            heads = max(1, x.heads // c.tp)  # one head group at a time
        fwd = 2 * _tile_size(block_q, FORWARD_TILE) * _tile_size(block_k, FORWARD_TILE)
        bwd = 3 * _tile_size(block_q, BACKWARD_TILE) * _tile_size(block_k, BACKWARD_TILE)
        out += x.b * heads * max(fwd, bwd) * F32
    return out


def memory(w: Workload, c: Candidate, leaves, *, cpu: bool = False) -> Memory:
    """Per-device bytes of the step's peak (see `Memory`)."""
    remat = c.remat
    x = dims(w, c)
    em = DTYPE_BYTES[w.precision]
    sizes = {**batch_axes(c), **x.seq_axes}
    params = optimizer = grads = update = 0.0
    layer_grad = 0.0
    for leaf in leaves:
        R = math.prod(sizes[a] for a in leaf.replica) if leaf.replica else 1
        stage = c.zero if leaf.zero_sharded and R > 1 else 0
        psi = leaf.size * F32
        params += psi / (R if stage == 3 else 1)
        optimizer += 2 * psi / (R if stage >= 1 else 1)
        grads += psi / (R if stage >= 2 else 1)
        # the update: gradients and their reduction, new weights, new moments (the playbook's 16Ψ at stage 0).
        # Measured on the compiled GPU step (gpt-1b, dp = 8): 4Ψ, 1.40Ψ, 1.40Ψ, 0.50Ψ at stages 0-3 (stage 1
        # reduce-scatters and updates the shard as stage 2 does); XLA:CPU writes the new weights and moments
        # in place at stage 0 (2Ψ)
        update += {0: (2 if cpu else 4) * psi, 1: psi + 4 * psi / R, 2: psi + 4 * psi / R, 3: 4 * psi / R}[stage]
        if leaf.stacked:
            layer_grad += psi / max(x.layers, 1)
    if x.steps > 1 and c.pp == 1:
        grads *= 2  # the accumulator and one micro-batch's gradients
    if c.zero >= 2:
        grads += layer_grad  # one layer's gradient before its reduce-scatter
    if c.zero == 3:
        grads += 2 * layer_grad / F32 * em  # one layer's weights gathered (forward and backward)
    per_layer = saved_per_layer(w, c, x, remat, cpu)
    if c.pp > 1:
        chunks = pipeline_info(c.pipeline, c.pp, x.steps, c.virtual_stages).peak_in_flight
        activations = chunks * (x.layers // c.virtual_stages) * per_layer
        activations += 2 * chunks * activation_bytes(w, x)  # pipeline buffers (inbox, gradients)
    else:
        activations = x.layers * per_layer
    # one layer's backward: with full remat its forward again, keeping every residual (tried: the FFN's freed
    # before the attention core's buffers: under-predicts by up to 14% on the compiled CPU step); otherwise
    # about half a layer's residuals live beside the attention core's buffers
    layer_work = saved_per_layer(w, c, x, "none", cpu) * (1.0 if remat == "full" else 0.5)
    working = layer_work + _attention_working(w, c, x, cpu)
    # the step's batch as stored (tokens, targets, positions int32; DiT: images, labels)
    rows = w.global_batch // c.data_degree // (math.isqrt(c.tp) if c.tensor == "optimus" else 1)
    if w.model == "gpt":
        other = 3 * rows * w.seq_len // (c.sp * (c.tp if c.tensor == "metp" else 1)) * 4
    else:
        other = rows * (w.config.image_size**2 * w.config.channels * 4 + 4)
    if w.model == "gpt":
        vocab = w.config.vocab_size // (c.tp if c.tensor == "megatron" else 1)
        if c.tensor == "optimus":
            vocab = w.config.vocab_size // math.isqrt(c.tp)
        # the logits and their gradient in the activation dtype, the softmax in fp32
        working += x.b * (x.n if c.tensor != "metp" else x.n_act) * vocab * (2 * em + F32)
    return Memory(params, optimizer, grads, activations, working, update, other)


# ---------------------------------------------------------------------------------------------- time

# Launch and loop overhead: ~40 kernels per layer per micro-step (forward and backward) at ~5 µs each, so
# more, smaller micro-steps cost something even when their FLOPs and bytes are the same.
KERNELS_PER_LAYER = 40
KERNEL_OVERHEAD_S = 5e-6


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step: compute, exposed communication by run-mesh axes, the pipeline bubble, the update."""

    compute: float
    communication: dict
    hidden: float  # communication hidden behind compute (ring loops), not in the total
    bubble: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.compute + sum(self.communication.values()) + self.bubble + self.optimizer


def compute_flops(w: Workload, c: Candidate, remat: str) -> tuple[float, float, float]:
    """(FLOPs per device per step, of which the attention core's, of which the FFN's), with what the plan
    recomputes: full remat a layer's forward again (+1/3 of the layers' FLOPs), selective the attention
    core's forward, METP its Q, K, V and f(AB) (a forward of the layer, Algorithms 2 and 6), RSA the masked
    half of causal scores it cannot skip."""
    cfg, s = w.config, w.seq_len
    tokens = w.tokens_per_step
    causal = 0.5 if w.causal else 1.0
    attention = 12 * cfg.num_layers * cfg.hidden * s * causal * tokens
    if w.model == "gpt":
        mats = 3 if cfg.activation == "swiglu" else 2
        moe = w.moe
        ffn_params = (
            mats * cfg.hidden * cfg.ffn_size if moe is None else moe.experts_per_token * mats * cfg.hidden * moe.ffn
        )
    else:
        ffn_params = 2 * cfg.hidden * cfg.ffn_size
    ffn = 6 * cfg.num_layers * ffn_params * tokens
    total = w.flops_per_step()
    layers = total - (6 * cfg.vocab_size * cfg.hidden * tokens if w.model == "gpt" else 0)
    extra = 0.0
    if remat == "full" or (c.tensor == "metp" and c.tp > 1):
        extra += layers / 3
    elif remat == "selective":
        extra += attention / 3
    if c.attention == "rsa" and c.sp > 1 and w.causal:
        extra += attention
    n = c.devices
    return (total + extra) / n, attention / n, ffn / n


def link(axes: tuple[str, ...], locality: dict, cluster) -> tuple[float, float]:
    """(bandwidth, latency) of a transfer over `axes`: NVLink when every group of it lies in one node."""
    if locality.get(axes, False):
        return cluster.intra_bw, cluster.intra_latency
    return cluster.inter_bw, cluster.inter_latency


def step_time(w: Workload, c: Candidate, transfers, cluster, locality: dict, leaves=()) -> StepTime:
    """The step's seconds on `cluster` (see the module docstring). locality: {axes: True when intra-node}."""
    remat = c.remat
    rate = cluster.device.flops * cluster.efficiency
    flops, attn_flops, ffn_flops = compute_flops(w, c, remat)
    compute = flops / rate + c.steps(w) * (w.config.num_layers // c.pp) * KERNELS_PER_LAYER * KERNEL_OVERHEAD_S
    layer_comm: dict = {}
    step_comm: dict = {}
    overlappable = {"attention": 0.0, "ffn": 0.0}
    for t in transfers:
        bw, lat = link(t.axes, locality, cluster)
        seconds = t.bytes / bw + t.messages * lat
        if t.overlap in overlappable:
            overlappable[t.overlap] += seconds
            continue
        target = step_comm if t.phase == "step" else layer_comm
        target[t.axes] = target.get(t.axes, 0.0) + seconds
    exposed_attention = max(0.0, overlappable["attention"] - attn_flops / rate)
    exposed_ffn = max(0.0, overlappable["ffn"] - ffn_flops / (3 * rate))  # the forward FFN matmuls
    hidden = overlappable["attention"] + overlappable["ffn"] - exposed_attention - exposed_ffn
    if exposed_attention or exposed_ffn:
        key = tuple(sorted({a for t in transfers if t.overlap for a in t.axes}))
        layer_comm[key] = layer_comm.get(key, 0.0) + exposed_attention + exposed_ffn
    bubble = 0.0
    if c.pp > 1:
        m = c.steps(w)
        info = pipeline_info(c.pipeline, c.pp, m, c.virtual_stages)
        inside = compute + sum(v for k, v in layer_comm.items() if k != ("pp",))
        bubble = max(0.0, (info.makespan - info.busy) * inside)
    # the update: read weights, gradients and both moments, write weights and moments (fp32), HBM-bound
    sizes = {**batch_axes(c), **seq_axes(c)}
    updated = sum(
        l.size / (math.prod(sizes[a] for a in l.replica) if l.zero_sharded and c.zero >= 1 else 1) for l in leaves
    )
    optimizer = 28 * updated / cluster.device.hbm_bytes_per_s
    comm = dict(layer_comm)
    for k, v in step_comm.items():
        comm[k] = comm.get(k, 0.0) + v
    return StepTime(compute, comm, hidden, bubble, optimizer)


def locality(plan, axes_list, devices_per_node: int) -> dict:
    """{axes: True when every group of devices that differ only along `axes` lies within one node} for the
    run mesh of `plan` (stand-in or real devices; device i is on node i // devices_per_node)."""
    import numpy as np

    mesh = plan.run_mesh
    ids = np.vectorize(lambda d: d.id)(np.asarray(mesh.devices, dtype=object))
    names = list(mesh.axis_names)
    out = {}
    for axes in set(axes_list):
        if not axes or any(a not in names for a in axes):
            out[axes] = True
            continue
        moved = np.moveaxis(ids, [names.index(a) for a in axes], list(range(-len(axes), 0)))
        groups = moved.reshape(-1, math.prod(mesh.shape[a] for a in axes)) // devices_per_node
        out[axes] = bool((groups == groups[:, :1]).all())
    return out
