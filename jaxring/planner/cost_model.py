"""The planner's cost model: what one training step of a plan moves over each mesh axis, what it keeps in
memory per device, and how long it takes on a cluster.

The registry's entries price themselves, each next to its own forward and backward (`jaxring.parallel.cost_terms` is the
vocabulary): the sequence strategy's `cost(AttentionShape, options) -> AttentionCost` (ring.py, rsa.py,
ulysses.py, usp.py, wallfacer.py, allgather.py; "dense" in registry.py), the tensor method's cost methods
(`TensorMethod.local_dims`, `layer_transfers`, `head_transfers`, `attention_core_cost`, `layer_working`) and
the pipeline schedule's table (`jaxring.parallel.pipeline`: its sends, micro-batches in flight and lockstep bubble).
This file builds the shapes they receive from a workload and a plan, scales their per-layer prices to a step,
and adds what no entry owns; it names no strategy or method. An entry without a cost model is an error naming
it, never 0 bytes.

Units: bytes per device (what one device receives, as `jaxring.analysis.compiled` counts them), one step =
`steps` micro-steps (gradient accumulation, or the pipeline's micro-batches) and one optimizer update.
Notation (per device, one micro-step): b rows, n tokens of the sequence shard, h hidden, e bytes per
activation element (2 bf16, 4 fp32; collectives on XLA:CPU move 4), F = 4 (fp32 weights, gradients and
accumulators), L' = layers on this device, Ψ parameters per device. A workload of packed documents
(`Workload.documents`: the GPT from a document store) prices their int32 segment ids where the strategy moves
them; a move every layer repeats identically (phase "micro-step") counts once per micro-step.

Gradients over the replica axes (data and sequence, R devices, the playbook's ZeRO): stage 0 all-reduce
2(R-1)/R·Ψ·F; stages 1-2 reduce-scatter + all-gather (R-1)/R·Ψ·F each (stage 2 scatters every micro-step);
stage 3 all-gathers forward and again backward (weights the backward reads) and reduce-scatters each micro-step.
Weights a tensor method leaves whole are psummed over its axes each micro-step. Pipeline: each tick with a send
moves one activation b·n_act·h·e; the bubble comes from the schedule simulator (`jaxring.parallel.pipeline.simulate`,
lockstep clock: one SPMD program). Experts: 4 all-to-alls of the dispatch buffer per layer (MoE, the
playbook's EP).

Memory: weights, Adam moments and the batch, plus the larger of the backward's peak (gradients, every layer's
saved activations, one layer's backward working set) and the update's. A layer saves (no remat) the residual
stream and norms (8 arrays [b, n_act, h] in fp32 and 4 of statistics), a K/V projection, the fp32 rotary
halves of q and k, the attention core's residuals (its entry's `saved`) and 6 FFN-wide arrays; with selective
remat its input and the weight matmuls' outputs; with full remat its input only. A pipeline stage keeps the
residuals of the micro-batch-chunks its schedule holds at once, more in the tick that runs (the slot it reads
and its switch's own: `pipeline_tick_chunks`), its inboxes, and the switch's chunk gradients.

Fitted terms (how many arrays XLA keeps live where the structure alone cannot say) are data, per target and
XLA version: `jaxring.planner.calibration` (jaxring/planner/calibrations/*.json, refitted by
benchmarks/refit_calibration.py); docs/memory-model.md tells how each was fitted.

Step time = compute (model FLOPs + recomputation, at a stated efficiency of peak) + exposed communication
(bytes / link bandwidth + latency per message; the ring-family P2P of the attention loops overlaps the
attention compute, as the GPU compile shows; every other collective is exposed; launch overhead: the
calibrated kernels per layer times the overhead of one) + the pipeline bubble + the optimizer update (HBM-bound).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxring.core.precision import BYTES_PER_ELEMENT as DTYPE_BYTES
from jaxring.kernels.blockwise import BACKWARD_TILE, FORWARD_TILE, tile_size
from jaxring.parallel.cost_terms import (
    F32,
    AttentionCost,
    AttentionShape,
    LocalDims,
    ModelShape,
    Transfer,
)
from jaxring.parallel.pipeline import lower, make_schedule, peak_in_flight, simulate
from jaxring.parallel.pipeline.schedules import BW, B, F, W
from jaxring.parallel.tensor.vocab_ring import RING_LOSS_ROWS
from jaxring.planner.calibration import calibration
from jaxring.planner.space import Candidate, Workload

if TYPE_CHECKING:
    from jaxring.parallel.plan import ParallelPlan
    from jaxring.planner.cluster import Cluster
    from jaxring.planner.params import ParamLeaf

__all__ = [
    "DTYPE_BYTES",
    "Memory",
    "PipelineInfo",
    "Shapes",
    "StepTime",
    "Transfer",
    "bytes_by_axes",
    "locality",
    "memory",
    "pipeline_info",
    "shapes",
    "step_time",
    "traffic",
]

# XLA:CPU sends bf16 collectives as f32 (convert, send, convert back): bytes measured on simulated CPU
# devices are 4 per element whatever the precision.
CPU_COLLECTIVE_BYTES = 4


# ---------------------------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class Shapes:
    """A candidate as its registry entries see it: the model's sizes, the tensor method's split of them, the
    attention core's shape and price, and the run mesh's axes."""

    steps: int  # micro-steps per step
    layers: int  # layers on this device (L / pp)
    model: ModelShape
    local: LocalDims
    attention: AttentionShape
    core: AttentionCost  # the attention core's price (the strategy's, or the tensor method's own core)
    method: object  # the TensorMethod
    sizes: dict  # run-mesh axis: size, in run-mesh order
    replica: dict  # the batch and sequence axes (size > 1): weights replicated there, gradients reduced
    tensor: dict  # the tensor method's axes (size > 1)
    schedule: tuple  # the pipeline schedule's options, (name, value) pairs


def shapes(w: Workload, c: Candidate, plan: ParallelPlan | None = None, cpu: bool = False) -> Shapes:
    """The shapes and the attention core's price of `c` for `w`. plan: its ParallelPlan (default: on stand-in
    devices), or one of the same mesh and strategies. cpu: priced for XLA:CPU (fp32 collectives, jnp block
    ops). Raises ValueError naming an entry that has no cost model."""
    plan = plan if plan is not None else c.plan()
    cfg = w.config
    heads = cfg.num_heads
    kv = getattr(cfg, "num_kv_heads", None) or heads
    terms = w.terms  # what the family adds beyond its blocks (a DiT's adaLN vectors, ...)
    em = DTYPE_BYTES[w.precision]
    m = ModelShape(
        b=c.micro_batch,
        seq_len=w.seq_len,
        sp=c.sp,
        tp=c.tp,
        hidden=cfg.hidden,
        heads=heads,
        kv_heads=kv,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden // heads,  # a GPT may set its own (Qwen3)
        ffn=cfg.ffn_size,
        ffn_matrices=3 if getattr(cfg, "activation", "gelu") == "swiglu" else 2,
        vocab=getattr(cfg, "vocab_size", None),
        tied=bool(getattr(cfg, "tie_embeddings", False)),
        moe=w.moe is not None,
        causal=w.causal,
        modulation=terms.modulation,
        final_modulation=terms.final_modulation,
        e=CPU_COLLECTIVE_BYTES if cpu else em,
        em=em,
        cpu=cpu,
        segments=w.documents,
        vocab_ring=plan.tensor.splits_vocab(plan),
        seq_axes=plan.seq_axes,
    )
    method = plan.tensor
    if not method.has_cost():
        raise ValueError(
            f"tensor method {method.name!r} has no cost model: the planner cannot price it (its TensorMethod "
            f"must define layer_transfers and the other cost methods, see jaxring/parallel/tensor/contract.py)"
        )
    x = method.local_dims(m)
    tiled_block = (
        terms.tiled_block
        and method.tiles_projections
        and w.moe is None
        and c.memory.mlp_tile is not None
        and c.memory.mlp_tile < x.n
    )
    mesh = plan.run_mesh
    sizes = {a: mesh.shape[a] for a in mesh.axis_names}
    shape = AttentionShape(
        b=x.b,
        n=x.n,
        heads=x.heads,
        kv_heads=x.kv_heads,
        d=m.head_dim,
        e=m.e,
        em=em,
        seq_len=w.seq_len,
        causal=m.causal,
        cpu=cpu,
        axes={a: sizes[a] for a in plan.seq_axes},
        segments=w.documents,
        window=getattr(cfg, "sliding_window", None) if w.causal else None,
        layout=plan.seq_layout(w.causal) if plan.seq_axes else "contiguous",
        tiled_block=tiled_block,
        fitted=calibration("cpu" if cpu else "gpu").fitted_terms(plan.strategy.name),
    )
    core = method.attention_core_cost(m, x)
    if core is None:
        strategy = plan.strategy
        if strategy.cost is None:
            raise ValueError(
                f"sequence strategy {strategy.name!r} has no cost model: the planner cannot price it (register it "
                f"with cost=(jaxring.parallel.cost_terms.AttentionShape, options) -> jaxring.parallel.cost_terms.AttentionCost)"
            )
        core = strategy.cost(shape, plan.strategy_options)
    return Shapes(
        steps=c.steps(w),
        layers=cfg.num_layers // c.pp,
        model=m,
        local=x,
        attention=shape,
        core=core,
        method=method,
        sizes=sizes,
        replica={a: sizes[a] for a in plan.replica_axes if sizes[a] > 1},
        tensor={a: sizes[a] for a in plan.tensor_axes if sizes.get(a, 1) > 1},
        schedule=tuple(sorted(plan.schedule_options.items())),
    )


def _on_mesh(transfers: list[Transfer], s: Shapes) -> list[Transfer]:
    """The transfers with their axes in run-mesh order, axes of size 1 dropped (an entry may name its whole
    view); an axis the run mesh lacks is an error naming the transfer."""
    placed: dict = {}
    out = []
    for t in transfers:
        axes = placed.get(t.axes)
        if axes is None:
            unknown = [a for a in t.axes if a not in s.sizes]
            if unknown:
                raise ValueError(
                    f"transfer {t.what!r} names {', '.join(unknown)}, not axes of the run mesh ({', '.join(s.sizes)})"
                )
            axes = placed[t.axes] = tuple(a for a in s.sizes if a in t.axes and s.sizes[a] > 1)
        out.append(t if axes == t.axes else dataclasses.replace(t, axes=axes))
    return out


# ---------------------------------------------------------------------------------------------- experts


def moe_layer(w: Workload, s: Shapes) -> list[Transfer]:
    """One MoE layer's expert exchange over ep (dispatch and combine, forward and backward) and its routing
    statistics, one micro-step."""
    moe = w.moe
    if moe is None:
        return []
    out = []
    x, e = s.local, s.model.e
    tokens = x.b * x.n
    R = math.prod(s.replica.values())
    if R > 1:
        out.append(Transfer("MoE load statistics", tuple(s.replica), 2 * (R - 1) / R * 2 * moe.num_experts * 4, 2))
    ep = s.sizes.get("ep", 1)
    if ep == 1:
        return out
    E, k = moe.num_experts, moe.experts_per_token
    if moe.capacity_factor is None:
        buffer = ep * tokens * min(k, E // ep) * s.model.hidden * e
        counts = (ep - 1) * E * 4 / ep
    else:
        cap = min(tokens, math.ceil(moe.capacity_factor * tokens * k / E))
        buffer, counts = E * cap * s.model.hidden * e, 0
    out.append(
        Transfer(
            "MoE dispatch + combine all-to-alls (forward and backward)", ("ep",), 4 * (ep - 1) / ep * buffer + counts, 5
        )
    )
    return out


# ---------------------------------------------------------------------------------------------- gradients


def gradient_sync(w: Workload, c: Candidate, s: Shapes, leaves: Sequence[ParamLeaf]) -> list[Transfer]:
    """Weight gradients: psums over the tensor axes a weight is replicated on (each micro-step), the pipeline's
    shared weights over pp, and the ZeRO stage's reduction over the replica axes (see the module docstring)."""
    out = []
    by_axes: dict[tuple, dict[str, float]] = {}
    A = s.steps
    for leaf in leaves:
        psi = leaf.size * F32
        # a conditioning path (the DiT's timestep, label, adaLN) runs on per-sequence vectors the tensor axes do
        # not split: its gradients come out whole (the modulation vectors' gradients are summed instead)
        conditioning = any(k in leaf.path for k in w.terms.conditioning)
        if leaf.unsplit_tensor and not conditioning:
            g = math.prod(s.tensor[a] for a in leaf.unsplit_tensor)
            # a tied table left whole over the tensor axes is read by the lookup and the head: two psums
            reads = 2 if (s.model.tied and leaf.path == "['embed']['table']") else 1
            key = ("tensor", tuple(leaf.unsplit_tensor))
            by_axes.setdefault(key, {}).setdefault("psum", 0.0)
            by_axes[key]["psum"] += A * reads * 2 * (g - 1) / g * psi
        if c.pp > 1 and not leaf.stacked:
            by_axes.setdefault(("pp", ("pp",)), {}).setdefault("psum", 0.0)
            by_axes[("pp", ("pp",))]["psum"] += 2 * (c.pp - 1) / c.pp * psi
        if not leaf.replica:
            continue
        R = math.prod(s.replica[a] for a in leaf.replica)
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
            messages = A * s.layers if per_micro_step else 1
            out.append(Transfer(what, axes, v, messages, None, "layer" if per_micro_step else "step"))
    return out


# ---------------------------------------------------------------------------------------------- pipeline


def activation_bytes(w: Workload, s: Shapes, e: int) -> float:
    """One micro-batch's residual stream as it crosses a stage boundary (plus the family's per-sequence rows:
    the DiT's conditioning row)."""
    x = s.local
    return x.b * x.n_act * s.model.hidden * e + w.terms.boundary_rows * x.b * s.model.hidden * e


@dataclasses.dataclass(frozen=True)
class PipelineInfo:
    """What the cost model reads from a schedule's table: ticks that send (forward, backward), the most
    micro-batch-chunks a stage holds, the lockstep makespan and busy time with a micro-batch's stage work
    costing 1 (F 1/3, B and W 1/3 each, BW 2/3: the playbook's t_b = 2 t_f), the chunks per stage and the
    interpreter's inbox slots (arriving activations and gradients, each one micro-batch's boundary stream)."""

    send_ticks: int
    peak_in_flight: int
    makespan: float
    busy: float
    virtual_stages: int = 1
    inbox_slots: int = 2


@functools.lru_cache(maxsize=1024)
def pipeline_info(schedule: str, pp: int, microbatches: int, options: tuple = ()) -> PipelineInfo:
    """The table of `schedule` for pp stages and `microbatches`, its options as (name, value) pairs."""
    sched = make_schedule(schedule, pp, microbatches, **dict(options))
    low = lower(sched)
    ticks = sum(1 for pairs in low.fwd_pairs if pairs) + sum(1 for pairs in low.bwd_pairs if pairs)
    sim = simulate(sched, {F: 1 / 3, B: 1 / 3, W: 1 / 3, BW: 2 / 3}, lockstep=True)
    return PipelineInfo(
        ticks,
        max(peak_in_flight(sched)),
        sim.makespan / microbatches,
        sim.busy / microbatches,
        sched.virtual_stages,
        low.slots["x"] + low.slots["dy"],
    )


def pipeline_sends(w: Workload, c: Candidate, s: Shapes) -> list[Transfer]:
    if c.pp == 1:
        return []
    ticks = pipeline_info(c.pipeline_schedule, c.pp, s.steps, s.schedule).send_ticks
    return [
        Transfer(
            "pipeline activations and their gradients (one per sending tick)",
            ("pp",),
            ticks * activation_bytes(w, s, s.model.e),
            ticks,
            None,
            "pipeline",
        )
    ]


# ---------------------------------------------------------------------------------------------- the step


def traffic(
    w: Workload,
    c: Candidate,
    leaves: Sequence[ParamLeaf],
    cpu: bool = False,
    plan: ParallelPlan | None = None,
    s: Shapes | None = None,
) -> list[Transfer]:
    """Every transfer of one step, per device (bytes of a layer times the layers and micro-steps)."""
    s = s if s is not None else shapes(w, c, plan, cpu)
    per_layer = list(s.core.transfers) + s.method.layer_transfers(s.model, s.local) + moe_layer(w, s)
    out = [
        dataclasses.replace(t, bytes=t.bytes * n * s.steps, messages=t.messages * n * s.steps)
        for t in per_layer
        for n in [1 if t.phase == "micro-step" else s.layers]  # "micro-step": layer-invariant (segment ids)
    ]
    out += [
        dataclasses.replace(t, bytes=t.bytes * s.steps, messages=t.messages * s.steps)
        for t in s.method.head_transfers(s.model, s.local)
    ]
    out += gradient_sync(w, c, s, leaves)
    out += pipeline_sends(w, c, s)
    return [t for t in _on_mesh(out, s) if t.bytes > 0 and t.axes]


def bytes_by_axes(transfers: Sequence[Transfer]) -> dict[tuple[str, ...], float]:
    """{run-mesh axes: bytes per device per step}, as `jaxring.analysis.axis_traffic.axis_traffic` reads them."""
    out: dict[tuple[str, ...], float] = {}
    for t in transfers:
        out[t.axes] = out.get(t.axes, 0.0) + t.bytes
    return out


# ---------------------------------------------------------------------------------------------- memory


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes. The step's stored state (weights, Adam moments, the batch) plus the larger of its two
    peaks: the backward (every saved activation and the largest of its phases: the layers', with the gradient
    buffers and one layer's working set, the head's before it, with its logits and the gradients formed by
    then, and the last layer's forward before that, with the attention core's `forward`) and the update
    (gradients, their reduction, the new moments: the calibration's `update_peak_zero0` fp32 copies of the
    weights at ZeRO-0). `host`: what host offload keeps in host memory (not in the total)."""

    params: float
    optimizer: float
    gradients: float
    activations: float
    working: float
    update: float
    other: float = 0.0
    host: float = 0.0
    head: float = 0.0
    forward: float = 0.0  # the last layer's forward transients beside every layer's residuals (the core's)

    @property
    def backward(self) -> float:
        return self.activations + max(self.gradients + self.working, self.head, self.forward)

    @property
    def total(self) -> float:
        return self.params + self.optimizer + self.other + max(self.backward, self.update)

    def as_dict(self) -> dict:
        keys = (
            "params",
            "optimizer",
            "gradients",
            "activations",
            "working",
            "head",
            "forward",
            "update",
            "other",
            "host",
        )
        return {k: round(getattr(self, k)) for k in keys} | {"total": round(self.total)}


STREAM_ARRAYS = 8  # the residual stream's and the norms' arrays [b, n_act, h] a layer saves without remat


def saved_per_layer(w: Workload, s: Shapes, remat: str, mlp_tile: int | None = None) -> float:
    """Bytes one layer keeps for its backward, one micro-batch (what the compiled step's layer scan stacks).

    none       the residual stream and norms (8 arrays [b, n_act, h] in fp32: the compiled GPU step's layer
               scan stacks 6 fp32 and 2 bf16 of them for Llama-3, 8 fp32 and 1 bf16 for GPT-1B; and 4 fp32
               of statistics), a K/V projection, the fp32 rotary halves of q
               and k, the attention core's residuals (its entry's), 6 FFN-wide arrays (the playbook's
               sbh(34 + 5as/h) without scores: flash attention); a method that recomputes its forward
               (METP) keeps `recomputed_stream_arrays` (calibrated) arrays [b, n_act, h] in the activation dtype and its core's
               residuals only
    selective  the layer input and the outputs of the weight matmuls the backward needs (`jax.checkpoint`'s
               dots_with_no_batch_dims_saveable keeps only residuals): q, k, v, the o projection (the residual
               sum and its norm are recomputed from it) and the FFN's up (and gate) projection; the FFN's
               down projection output is not a residual (measured per layer on the compiled CPU step)
    full       the layer input (WallFacer's and the playbook's per-layer checkpoint)

    mlp_tile: a tiled MLP (`--mlp-tile`) keeps its input only; its FFN-wide arrays are recomputed per tile.
    """
    m, x, core = s.model, s.local, s.core
    em, d = m.em, m.head_dim
    b, n, na, h, f = x.b, x.n, x.n_act, m.hidden, x.ffn
    if remat == "full":
        return b * na * h * em + core.kept(remat)
    qkvo = b * n * (2 * x.heads + 2 * x.kv_heads) * d * em
    tiled = mlp_tile is not None and mlp_tile < n
    if remat == "selective":
        ffn = b * n * h * em if tiled else (m.ffn_matrices - 1) * b * n * f * em
        return b * na * h * em + qkvo + ffn + core.kept(remat)
    if s.method.recomputes_forward:
        arrays = calibration("cpu" if m.cpu else "gpu").recomputed_stream_arrays
        return arrays * b * na * x.h_act * em + core.kept(remat)
    stream = STREAM_ARRAYS * b * na * x.h_act * F32 + 4 * b * na * F32
    rope = b * n * (x.heads + x.kv_heads) * d * (F32 if w.terms.rotary_fp32 else em)
    mlp = b * n * h * em if tiled else _mlp_saved(w, s)
    return stream + b * n * x.kv_heads * d * em + rope + core.kept(remat) + mlp


def _mlp_saved(w: Workload, s: Shapes) -> float:
    """The FFN's part of what a layer keeps without remat: 6 FFN-wide arrays (MoE: per routed expert, and the
    router's fp32 probabilities)."""
    em, x = s.model.em, s.local
    if w.moe is not None:
        moe, tokens = w.moe, x.b * x.n
        return 6 * tokens * moe.experts_per_token * moe.ffn * em + 2 * tokens * moe.num_experts * F32
    return 6 * x.b * x.n * x.ffn * em


def _attention_working(s: Shapes, recomputes_forward: bool) -> float:
    """The attention core's transient buffers during one layer's backward (its entry's, the tensor method's
    and, on CPU, the jnp block ops' score tiles: S/P, dP, dS of a backward tile, or, where the backward runs the
    layer's forward again (remat), S and P of one forward tile if larger; without remat no forward tile)."""
    core, x = s.core, s.local
    out = core.working + s.method.layer_working(s.model, x)
    if s.model.cpu:
        block_q, block_k = core.block_q or x.n, core.block_k or x.n
        heads = core.tile_heads or x.heads
        fwd = 2 * tile_size(block_q, FORWARD_TILE) * tile_size(block_k, FORWARD_TILE) if recomputes_forward else 0
        bwd = 3 * tile_size(block_q, BACKWARD_TILE) * tile_size(block_k, BACKWARD_TILE)
        out += x.b * heads * max(fwd, bwd) * F32
    return out


def memory(
    w: Workload,
    c: Candidate,
    leaves: Sequence[ParamLeaf],
    *,
    cpu: bool = False,
    plan: ParallelPlan | None = None,
    s: Shapes | None = None,
) -> Memory:
    """Per-device bytes of the step's peak (see `Memory`), with the candidate's remat, tiles and offload.
    The fitted terms are `calibration(target)`'s (docs/memory-model.md tells how each was fitted)."""
    s = s if s is not None else shapes(w, c, plan, cpu)
    k = calibration("cpu" if cpu else "gpu")
    remat, x, em = c.memory.remat, s.local, s.model.em
    params = optimizer = grads = update = 0.0
    layer_grad = head_grads = 0.0  # one layer's gradient; the gradients formed by the head's backward
    layer_stored = 0.0  # one layer's fp32 weights as a device stores them (its ZeRO-3 shard)
    top = 0.0  # the fp32 bytes of the weights outside the layer stack, as a device holds them in the step
    top_grads = 0.0  # their gradients as stored (ZeRO-2/3: the device's shard)
    top_moments = 0.0  # their AdamW moments as stored (ZeRO-1..3: the device's shard)
    for leaf in leaves:
        R = math.prod(s.replica[a] for a in leaf.replica) if leaf.replica else 1
        stage = c.zero if leaf.zero_sharded and R > 1 else 0
        psi = leaf.size * F32
        params += psi / (R if stage == 3 else 1)
        optimizer += 2 * psi / (R if stage >= 1 else 1)
        grads += psi / (R if stage >= 2 else 1)
        # the update: gradients and their reduction, new weights, new moments (stages 1-2 update the shard)
        update += {0: k.update_peak_zero0 * psi, 1: psi + 4 * psi / R, 2: psi + 4 * psi / R, 3: 4 * psi / R}[stage]
        if leaf.stacked:
            layer_grad += psi / max(s.layers, 1)
            layer_stored += psi / (R if stage == 3 else 1) / max(s.layers, 1)
        else:  # its gradient, and under ZeRO-3 its gathered weights
            top += psi
            top_moments += 2 * psi / (R if stage >= 1 else 1)
            top_grads += psi / (R if stage >= 2 else 1)
            head_grads += psi / (R if stage >= 2 else 1) + (psi / F32 * em if stage == 3 else 0)
    if s.steps > 1 and c.pp == 1:
        head_grads += grads  # the accumulator
        grads *= 2  # the accumulator and one micro-batch's gradients
    if c.pp > 1 or cpu:  # the last stage's head beside other micro-batches'; XLA:CPU: every gradient buffer
        head_grads = grads
    stored_grads = grads
    if c.zero >= 2:
        grads += layer_grad  # one layer's gradient before its reduce-scatter
    if c.zero == 3:
        grads += 2 * layer_grad / F32 * em  # one layer's weights gathered (forward and backward)
    per_layer = saved_per_layer(w, s, remat, c.memory.mlp_tile)
    host = 0.0
    parts = c.memory.offload.parts
    if "optimizer" in parts and not cpu:  # the moments in host memory; the update streams a share of them
        host += optimizer
        update += (k.offloaded_moments_in_flight - 1) * optimizer
        optimizer = 0.0
    if "weights" in parts and not cpu:  # weights and layer gradients in host memory; the top weights on device
        host += params + stored_grads - top_grads
        blocks_in = c.memory.remat_layers if remat == "full" else 1  # a recompute block's weights move in at once
        params, grads = top, 2 * layer_grad + 2 * (blocks_in - 1) * layer_stored
        head_grads = top
        update = k.offloaded_update_in_flight * top
        if c.devices == 1:  # one device: the top weights' moments come in before the layers' backward
            grads += top_moments
    blocks = c.memory.remat_layers if remat == "full" else 1  # layers per recompute block: one input kept per block
    if "layer_inputs" in parts and not cpu:  # each block's input in host memory (on CPU: one memory)
        inputs = x.b * x.n_act * s.model.hidden * em
        host += s.layers // blocks * inputs
        per_layer -= inputs
        if blocks > 1:  # a block's backward recomputes its layers' inputs into host memory too
            host += blocks * inputs
    # layers per block whose inputs a block's backward keeps on the device
    blocks_on_device = 1 if "layer_inputs" in parts and not cpu else blocks
    if c.pp > 1:
        info = pipeline_info(c.pipeline_schedule, c.pp, s.steps, s.schedule)
        chunk = (s.layers // info.virtual_stages) * per_layer  # one micro-batch-chunk's residuals
        activations = (info.peak_in_flight + k.pipeline_tick_chunks) * chunk
        activations += info.inbox_slots * activation_bytes(w, s, em)
        # the switch's weight gradients of the chunk it ran (fp32), beside the accumulator they are added to
        grads += (s.layers // info.virtual_stages) * layer_grad
    else:
        activations = s.layers // blocks * per_layer
    # one layer's backward: its residuals formed again as the backward walks it, the stream in the activation dtype
    layer = saved_per_layer(w, s, "none", c.memory.mlp_tile)
    if not s.method.recomputes_forward:
        layer -= STREAM_ARRAYS * x.b * x.n_act * x.h_act * (F32 - em)
    if c.memory.mlp_tile is not None and c.memory.mlp_tile < x.n:
        layer += 6 * x.b * c.memory.mlp_tile * x.ffn * em  # one MLP tile's FFN-wide arrays, live in its backward
    elif s.method.recomputes_forward:  # the device's tokens through the whole FFN, recomputed in the backward
        layer += k.recomputed_untiled_mlp_arrays * x.b * x.n * s.model.ffn * em
    elif w.moe is None:  # of the 6 FFN-wide arrays _mlp_saved counts, those the backward holds
        layer += (k.untiled_mlp_backward_arrays - 6) * x.b * x.n * x.ffn * em
    working = k.layer_working_share[remat] * layer + _attention_working(s, remat != "none")
    working += (blocks_on_device - 1) * x.b * x.n_act * s.model.hidden * em  # a block's other layers' inputs
    if c.memory.mlp_tile is not None and c.memory.mlp_tile < x.n:  # what the tiles take off one layer's backward
        saving = k.tiled_mlp_saving_recomputed if s.method.recomputes_forward else k.tiled_mlp_saving
        if w.terms.tiled_block and s.method.tiles_projections and w.moe is None:
            if blocks_on_device > 1:
                saving += k.tiled_block_saving_in_blocks
            else:
                saving += k.tiled_block_saving_core_peak if s.core.peak_in_core else k.tiled_block_saving
        working -= saving * x.b * x.n_act * s.model.hidden * em
    if "weights" in parts and not cpu and blocks == 1 and x.n > x.n_act:  # streamed weights: fewer gathers held
        working -= k.offloaded_weights_gathers_saving * x.b * x.n * s.model.hidden * em
    # the step's batch as stored (the family's: tokens, targets, positions int32, packed documents' segment ids
    # and loss mask; a DiT's images and labels)
    rows = w.global_batch // c.data_degree // x.batch_split
    other = w.terms.stored_batch(w.config, rows, w.seq_len // (c.sp * x.token_split), w.documents)
    head = 0.0
    if x.vocab is not None:
        # the head's backward, before the layers': the logits (or one tile) in the activation dtype, softmax fp32
        rows_at_once = x.n if c.memory.loss_tile is None else min(c.memory.loss_tile, x.n)
        if s.model.vocab_ring and c.memory.loss_tile is None:  # the vocab ring tiles its loss itself
            rows_at_once = min(RING_LOSS_ROWS, x.n)
        head = x.b * rows_at_once * x.vocab * (em + F32) + head_grads
        if s.model.vocab_ring:  # the vocab ring's ΔX, summed in fp32 over the blocks (`vocab_ring`)
            head += x.b * x.n_act * x.h_act * F32
    return Memory(params, optimizer, grads, activations, working, update, other, host, head, s.core.forward)


# ---------------------------------------------------------------------------------------------- time


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step: compute, exposed communication by run-mesh axes, the pipeline bubble, the update."""

    compute: float
    communication: dict
    hidden: float  # communication hidden behind compute (ring loops), not in the total
    bubble: float
    optimizer: float
    offload: float = 0.0  # host-memory transfers (--offload) not hidden behind the layers' compute

    @property
    def total(self) -> float:
        return self.compute + sum(self.communication.values()) + self.bubble + self.optimizer + self.offload


def compute_flops(w: Workload, c: Candidate, remat: str, s: Shapes) -> tuple[float, float, float]:
    """(FLOPs per device per step, of which the attention core's, of which the FFN's), with what the plan
    recomputes: full remat a layer's forward again (+1/3 of the layers' FLOPs), selective the attention
    core's forward, a method that recomputes its forward (METP: Q, K, V and f(AB), Algorithms 2 and 6) the
    same as full remat, and the attention core's own extra work (RSA: the masked half of causal scores), less
    what it skips outside a sliding window (its `window_share`)."""
    cfg, seq = w.config, w.seq_len
    tokens = w.tokens_per_step
    causal = 0.5 if w.causal else 1.0
    width = s.model.heads * s.model.head_dim  # QKᵀ and PV are as wide as the heads, not hidden (Qwen3)
    attention = 12 * cfg.num_layers * width * seq * causal * tokens
    mats, moe = s.model.ffn_matrices, w.moe
    ffn_params = (
        mats * cfg.hidden * cfg.ffn_size if moe is None else moe.experts_per_token * mats * cfg.hidden * moe.ffn
    )
    ffn = 6 * cfg.num_layers * ffn_params * tokens
    computed = attention * s.core.window_share
    total = w.flops_per_step() - (attention - computed)
    layers = total - (6 * s.model.vocab * cfg.hidden * tokens if s.model.vocab is not None else 0)
    extra = 0.0
    if remat == "full" or s.method.recomputes_forward:
        extra += layers / 3
        if remat == "full" and c.memory.remat_layers > 1:  # a block's backward runs each layer's forward once more
            extra += layers / 3
    elif remat == "selective":
        extra += computed / 3
    if s.core.extra_attention:
        extra += s.core.extra_attention * attention
    n = c.devices
    return (total + extra) / n, computed / n, ffn / n


def link(axes: tuple[str, ...], locality: dict, cluster: Cluster) -> tuple[float, float]:
    """(bandwidth, latency) of a transfer over `axes`: NVLink when every group of it lies in one node."""
    if locality.get(axes, False):
        return cluster.intra_bw, cluster.intra_latency
    return cluster.inter_bw, cluster.inter_latency


def step_time(
    w: Workload,
    c: Candidate,
    transfers: Sequence[Transfer],
    cluster: Cluster,
    locality: dict,
    leaves: Sequence[ParamLeaf] = (),
    plan: ParallelPlan | None = None,
    s: Shapes | None = None,
) -> StepTime:
    """The step's seconds on `cluster` (see the module docstring). locality: {axes: True when intra-node}.
    The attention's FLOPs run at the calibration's `block_compute_speed` of the candidate's per-block compute
    (`c.block_ops`) times the others' rate."""
    s = s if s is not None else shapes(w, c, plan, cluster.cpu)
    remat = c.memory.remat
    rate = cluster.device.flops * cluster.efficiency
    k = calibration("cpu" if cluster.cpu else "gpu")
    flops, attn_flops, ffn_flops = compute_flops(w, c, remat, s)
    attention_s = attn_flops / (rate * k.block_compute_speed.get(c.block_ops, 1.0))
    compute = (
        (flops - attn_flops) / rate
        + attention_s
        + c.steps(w) * (w.config.num_layers // c.pp) * k.kernels_per_layer * k.kernel_overhead_s
    )
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
    exposed_attention = max(0.0, overlappable["attention"] - attention_s)
    exposed_ffn = max(0.0, overlappable["ffn"] - ffn_flops / (3 * rate))  # the forward FFN matmuls
    hidden = overlappable["attention"] + overlappable["ffn"] - exposed_attention - exposed_ffn
    if exposed_attention or exposed_ffn:
        key = tuple(sorted({a for t in transfers if t.overlap for a in t.axes}))
        layer_comm[key] = layer_comm.get(key, 0.0) + exposed_attention + exposed_ffn
    bubble = 0.0
    if c.pp > 1:
        info = pipeline_info(c.pipeline_schedule, c.pp, c.steps(w), s.schedule)
        inside = compute + sum(v for k, v in layer_comm.items() if k != ("pp",))
        bubble = max(0.0, (info.makespan - info.busy) * inside)
    # the update: read weights, gradients and both moments, write weights and moments (fp32), HBM-bound
    updated = sum(
        l.size / (math.prod(s.replica[a] for a in l.replica) if l.zero_sharded and c.zero >= 1 else 1) for l in leaves
    )
    optimizer = 28 * updated / cluster.device.hbm_bytes_per_s
    comm = dict(layer_comm)
    for k, v in step_comm.items():
        comm[k] = comm.get(k, 0.0) + v
    offload = 0.0
    if c.memory.offload and not cluster.cpu:
        layers_s, update_s = host_transfer_seconds(w, c, s, updated * F32, cluster.device.host_bytes_per_s)
        offload = max(0.0, layers_s - compute) + update_s
        if c.memory.offload.weights:
            optimizer = 0.0  # streamed: the host link, not HBM, bounds it (update_s)
    return StepTime(compute, comm, hidden, bubble, optimizer, offload)


def host_transfer_seconds(w: Workload, c: Candidate, s: Shapes, weights: float, host_bw: float) -> tuple[float, float]:
    """(seconds the layers' host transfers take, overlapping their compute; seconds of the update's, exposed)
    of --offload, per direction at `host_bw` (the link is full duplex: the busier direction counts).
    weights: the fp32 bytes of this device's weights as the optimizer updates them.

    layer_inputs  each layer's input out after its forward, in before its backward (with recompute blocks,
                  each block's, then its layers' as the block's backward recomputes them)
    optimizer     the moments (2 x weights) in for the update and out after it
    weights       each layer's fp32 weights in for its forward and again for its backward, its gradient out;
                  the update reads weights, gradients (twice: the norm first) and moments, writes weights and
                  moments"""
    parts = c.memory.offload.parts
    to_device = from_device = update_in = update_out = 0.0
    if "layer_inputs" in parts:
        # the blocks' inputs, and with recompute blocks every layer's again in its block's backward
        blocks = c.memory.remat_layers if c.memory.remat == "full" else 1
        moved = s.layers // blocks + (s.layers if blocks > 1 else 0)
        inputs = moved * s.local.b * s.local.n_act * s.model.hidden * s.model.em
        to_device, from_device = to_device + inputs, from_device + inputs
    if "weights" in parts:
        to_device, from_device = to_device + 2 * weights, from_device + weights
        update_in, update_out = 5 * weights, 3 * weights
    elif "optimizer" in parts:
        update_in, update_out = 2 * weights, 2 * weights
    return max(to_device, from_device) / host_bw, max(update_in, update_out) / host_bw


def locality(plan: ParallelPlan, axes_list: Sequence[tuple[str, ...]], devices_per_node: int) -> dict:
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
