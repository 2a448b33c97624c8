"""The search: every plan the library can run for a workload on a cluster, ranked by predicted step time.

    result = search(workload, cluster)
    result.best.candidate, result.best.time.total, result.best.memory.total
    print(result.table(top=10)); print(result.rejections())

The recipe is the playbook's ("fit a step in memory, reach the global batch, then maximise throughput") as a
grid search, WallFacer's Eq. 8 autoscheduler widened from (C, placement) to every axis: mesh degrees
(dp, pp, tp, sp, ep: their product is the device count), and the registry's entries (`jaxring.parallel.registry`):
every sequence strategy (for sp > 1; "dense" for sp = 1) with each combination of the values its options'
`Option.search` lists (USP's every U, WallFacer's every C and both placements), every tensor method that
accepts the tp degree and, with sp > 1, runs beside a sequence strategy (`TensorMethod.accepts`,
`sequence_parallel`), every pipeline schedule with its options' values (interleaved's virtual stages) and the
micro-batches; the ZeRO stage, remat, and the micro-batch. A plan is kept when the library accepts it
(`ParallelPlan`, `models/*.check_plan`: the same one-line errors train.py gives) and its predicted memory
fits; kept plans are ranked by the step time their entries' cost models predict (`jaxring/planner/cost_model.py`).
fsdp is not searched: dp with a ZeRO stage is the same program.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from jaxring.nn import REMAT, Offload
from jaxring.parallel.catalog import (
    all_options,
    pipeline_schedule,
    pipeline_schedules,
    sequence_strategies,
    tensor_method,
    tensor_methods,
)
from jaxring.parallel.pipeline import make_schedule
from jaxring.parallel.settings import ParallelSettings
from jaxring.planner import cost_model as cost
from jaxring.planner.cluster import Cluster
from jaxring.planner.params import param_leaves
from jaxring.planner.space import MEMORY_CHOICES, NO_MEMORY_CHOICES, ONE_DEVICE, Candidate, Workload
from jaxring.run.checks import OFFLOAD_WITH_PP, WEIGHTS_OFFLOAD_RULES
from jaxring.run.schema import MemorySettings

if TYPE_CHECKING:
    from jaxring.parallel.plan import ParallelPlan

# the memory choices each candidate is built with (`candidates`); the others are held or set by MEMORY_LEVELS
SEARCHED_MEMORY = ("remat",)


class NoPlanError(ValueError):
    """Nothing fits: the message names the tightest constraint (one line)."""


@dataclasses.dataclass
class Evaluated:
    candidate: Candidate
    workload: Workload
    memory: cost.Memory
    time: cost.StepTime
    transfers: list
    fits: bool
    compiled_memory: float | None = None  # filled by a compile check

    @property
    def plan(self) -> ParallelPlan:
        """The candidate's ParallelPlan (on stand-in devices)."""
        return self.candidate.check(self.workload)

    @property
    def step_s(self) -> float:
        return self.time.total

    def tokens_per_s(self, workload: Workload) -> float:
        return workload.tokens_per_step / self.step_s

    def mfu(self, workload: Workload, cluster: Cluster) -> float:
        return workload.flops_per_step() / (self.step_s * cluster.devices * cluster.device.flops)

    def bytes_by_axes(self) -> dict:
        return cost.bytes_by_axes(self.transfers)


@dataclasses.dataclass
class Rejection:
    reason: str
    count: int
    example: Candidate
    detail: str
    best_memory: float | None = None  # memory rejections: the least memory among them


@dataclasses.dataclass
class Result:
    workload: Workload
    cluster: Cluster
    ranked: list[Evaluated]
    rejected: dict[str, Rejection]
    considered: int

    @property
    def best(self) -> Evaluated:
        return self.ranked[0]

    # ---------------------------------------------------------------- text
    def table(self, top: int = 10) -> str:
        w, cl = self.workload, self.cluster
        rows = [("#", "plan", "step s", "tok/s", "MFU", "mem GiB", "compiled", "exposed comm", "bubble")]
        for i, ev in enumerate(self.ranked[:top], 1):
            comm = sorted(ev.time.communication.items(), key=lambda kv: -kv[1])
            comm_text = ", ".join(f"{'×'.join(k) or '-'} {v:.3g}s" for k, v in comm[:2] if v > 0) or "-"
            compiled = "-" if ev.compiled_memory is None else f"{ev.compiled_memory / 2**30:.1f}"
            rows.append(
                (
                    str(i),
                    ev.candidate.describe(),
                    f"{ev.step_s:.3g}",
                    f"{ev.tokens_per_s(w):,.0f}",
                    f"{ev.mfu(w, cl):.1%}",
                    f"{ev.memory.total / 2**30:.1f}",
                    compiled,
                    comm_text,
                    f"{ev.time.bubble:.3g}" if ev.candidate.pp > 1 else "-",
                )
            )
        widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * width for width in widths))
        return "\n".join(lines)

    def rejections(self) -> str:
        if not self.rejected:
            return "rejected: none"
        lines = [f"rejected {sum(r.count for r in self.rejected.values())} of {self.considered} plans:"]
        for r in sorted(self.rejected.values(), key=lambda r: -r.count):
            lines.append(f"  {r.count:6d}  {r.detail}  (e.g. {r.example.describe()})")
        return "\n".join(lines)

    def to_json(self, top: int = 10) -> dict:
        w, cl = self.workload, self.cluster
        return {
            "workload": {
                "model": w.model,
                "preset": w.preset,
                "seq_len": w.seq_len,
                "global_batch": w.global_batch,
                "tokens_per_step": w.tokens_per_step,
                "precision": w.precision,
                "documents": w.documents,
                "config": dataclasses.asdict(w.config),
            },
            "cluster": {
                "device": cl.device.name,
                "devices": cl.devices,
                "devices_per_node": cl.devices_per_node,
                "intra_bw": cl.intra_bw,
                "inter_bw": cl.inter_bw,
                "efficiency": cl.efficiency,
                "usable_memory": cl.usable_memory,
            },
            "considered": self.considered,
            "plans": [plan_json(ev, w, cl) for ev in self.ranked[:top]],
            "rejected": [
                {"reason": r.reason, "count": r.count, "detail": r.detail, "example": r.example.describe()}
                for r in sorted(self.rejected.values(), key=lambda r: -r.count)
            ],
        }


def plan_json(ev: Evaluated, w: Workload, cl: Cluster) -> dict:
    return {
        "plan": ev.candidate.describe(),
        "settings": {
            k: v if v is None or isinstance(v, (str, int, float)) else str(v)
            for k, v in ev.candidate.settings(w).items()
        },
        "micro_batch": ev.candidate.micro_batch,
        "train_flags": ev.candidate.train_flags(),
        "step_s": ev.step_s,
        "tokens_per_s": ev.tokens_per_s(w),
        "mfu": ev.mfu(w, cl),
        "time": {
            "compute": ev.time.compute,
            "bubble": ev.time.bubble,
            "optimizer": ev.time.optimizer,
            "offload": ev.time.offload,
            "hidden_communication": ev.time.hidden,
            "exposed_communication": {"×".join(k): v for k, v in ev.time.communication.items()},
        },
        "memory_bytes": ev.memory.as_dict(),
        "compiled_memory_bytes": ev.compiled_memory,
        "bytes_by_axes": {"×".join(k): v for k, v in ev.bytes_by_axes().items()},
    }


# ---------------------------------------------------------------------------------------- the search space


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(n: int, k: int):
    """Ordered k-tuples of positive integers with product n."""
    if k == 1:
        yield (n,)
        return
    for d in _divisors(n):
        for rest in _factorizations(n // d, k - 1):
            yield (d,) + rest


def sequence_choices(sp: int) -> list[tuple[str, dict]]:
    """(strategy, options) for sp: when sp = 1 the entries that split nothing (no `attend`: "dense"), else every
    entry that splits the sequence, with each combination of the values its options' `search` lists."""
    return [
        (name, opts)
        for name, e in sequence_strategies().items()
        if (e.attend is None) == (sp == 1)
        for opts in e.option_grid(sp)
    ]


def tensor_choices(tp: int, sp: int) -> list[tuple[str | None, dict]]:
    """(method, options) for tp: the registered methods that accept tp devices (`TensorMethod.accepts`) and, when
    sp > 1, run beside a sequence strategy (`sequence_parallel`); None when tp = 1."""
    out = []
    for name, method in tensor_methods().items():
        if method.accepts(tp) and (sp == 1 or method.sequence_parallel):
            out += [(name if method.axes else None, opts) for opts in method.option_grid(tp)]
    return out


def schedule_choices(pp: int, layers: int) -> list[tuple[str, dict]]:
    """(schedule, options) for pp > 1: every registered schedule with each combination of its options' search
    values, less the ones that cut a stage into chunks (virtual stages) the layers do not fill evenly (layers
    that pp alone does not split are left to the library's rule, which names them)."""
    out = []
    for name, entry in pipeline_schedules().items():
        for opts in entry.option_grid(pp):
            chunks = _stage_chunks(name, pp, tuple(sorted(opts.items())))
            if chunks is None or chunks == 1 or layers % (pp * chunks) == 0:
                out.append((name, opts))
    return out


@functools.lru_cache(maxsize=256)
def _stage_chunks(schedule: str, pp: int, options: tuple) -> int | None:
    """Layer chunks per stage of the schedule's table (its virtual stages), None when the options are refused."""
    try:
        return make_schedule(schedule, pp, pp, **dict(options)).virtual_stages
    except ValueError:
        return None


def candidates(w: Workload, cluster: Cluster, remat_modes: Sequence[str] | None = None) -> Iterator[Candidate]:
    """Every candidate for `w` on `cluster.devices` devices (before validation)."""
    n = cluster.devices
    layers = w.config.num_layers
    experts = w.moe.num_experts if w.moe is not None else 1
    remat_modes = remat_modes or REMAT
    memory = {r: dataclasses.replace(NO_MEMORY_CHOICES, remat=r) for r in remat_modes}  # built once per mode
    for dp, pp, tp, sp, ep in _factorizations(n, 5):
        if ep > 1 and (w.moe is None or experts % ep):
            continue
        if pp > layers:
            continue
        data = dp * ep
        if w.global_batch % data:
            yield Candidate(dataclasses.replace(ONE_DEVICE, dp=dp, pp=pp, tp=tp, sp=sp, ep=ep))  # rejected: batch split
            continue
        replica_batch = w.global_batch // data
        replicas = dp * ep * sp
        schedules = schedule_choices(pp, layers) if pp > 1 else [("1f1b", {})]
        for attention, seq_options in sequence_choices(sp):
            for tensor, tensor_options in tensor_choices(tp, sp):
                for zero in (0, 1, 2, 3) if replicas > 1 else (0,):
                    for mb in _divisors(replica_batch):
                        steps = replica_batch // mb
                        for schedule, schedule_options in schedules:
                            parallel = ParallelSettings(
                                dp=dp,
                                fsdp=1,
                                pp=pp,
                                tp=tp,
                                sp=sp,
                                ep=ep,
                                attention=attention,
                                tensor_parallel=tensor,
                                zero=zero,
                                pipeline_schedule=schedule,
                                microbatches=steps if pp > 1 else None,
                                options={**seq_options, **tensor_options, **schedule_options},
                            )
                            for remat in remat_modes:
                                yield Candidate(parallel, memory[remat], micro_batch=mb)


# ---------------------------------------------------------------------------------------- evaluation


class _Cache:
    """Per-search caches: leaves and locality by the plan's structure (degrees, strategy, method, options)."""

    def __init__(self, w: Workload, cluster: Cluster):
        self.w, self.cluster = w, cluster
        self.leaves: dict = {}
        self.local: dict = {}

    @staticmethod
    def _key(c: Candidate) -> tuple:
        return (c.dp, c.pp, c.tp, c.sp, c.ep, c.attention, c.tensor_parallel, c.options)

    def param_leaves(self, c: Candidate, plan: ParallelPlan):
        key = self._key(c)
        if key not in self.leaves:
            self.leaves[key] = param_leaves(self.w.model, self.w.config, plan)
        return self.leaves[key]

    def locality(self, c: Candidate, plan: ParallelPlan, axes_list: Iterable[tuple[str, ...]]):
        have = self.local.setdefault(self._key(c), {})
        missing = [a for a in set(axes_list) if a not in have]
        if missing:
            have.update(cost.locality(plan, missing, self.cluster.devices_per_node))
        return have


def evaluate(
    w: Workload, c: Candidate, cluster: Cluster, plan: ParallelPlan | None = None, cache: _Cache | None = None
) -> Evaluated:
    """The cost model's prediction for one candidate (it must be valid: see Candidate.check). plan: its
    ParallelPlan, or one of the same mesh and strategies (the cost model reads its run mesh and weights).
    Raises ValueError naming a registry entry that has no cost model."""
    cache = cache or _Cache(w, cluster)
    plan = plan or c.check(w)
    leaves = cache.param_leaves(c, plan)
    shapes = cost.shapes(w, c, plan, cpu=cluster.cpu)
    transfers = cost.traffic(w, c, leaves, s=shapes)
    local = cache.locality(c, plan, [t.axes for t in transfers])
    mem = cost.memory(w, c, leaves, cpu=cluster.cpu, s=shapes)
    time = cost.step_time(w, c, transfers, cluster, local, leaves, s=shapes)
    return Evaluated(c, w, mem, time, transfers, mem.total <= cluster.usable_memory and mem.host <= cluster.host_memory)


def _weights_offload_rule(c: Candidate, w: Workload) -> str | None:
    """The train step's refusal of a held --offload with the weights (`WEIGHTS_OFFLOAD_RULES`, pp > 1), or None."""
    if not c.memory.offload.weights:
        return None
    if c.pp > 1:
        return OFFLOAD_WITH_PP.format(offload=c.memory.offload, pp=c.pp)
    if c.steps(w) > 1:
        return WEIGHTS_OFFLOAD_RULES["grad_accum"].format(offload=c.memory.offload, grad_accum=c.steps(w))
    replicas = [a for a, n in (("dp", c.dp), ("sp", c.sp), ("ep", c.ep)) if n > 1]
    if replicas and c.zero in (1, 2):
        return WEIGHTS_OFFLOAD_RULES["zero"].format(offload=c.memory.offload, zero=c.zero, axes=", ".join(replicas))
    return None


def _pipeline_rule(c: Candidate, w: Workload):
    """A key for the pipeline rules ParallelPlan enforces (fewer micro-batches than stages, ZeRO-2 with pp, the
    schedule's own check of its micro-batches), so the search asks the library once per rule."""
    if c.pp == 1:
        return None
    m = c.steps(w)
    if m < c.pp:
        return ("microbatches < pp", c.pp)
    if c.zero == 2:
        return ("zero 2 with pp",)
    entry = pipeline_schedule(c.pipeline_schedule)
    if entry.check is not None:
        try:
            entry.check(c.pp, m, **entry.resolve_options(dict(c.options), c.pp, strict=False))
        except ValueError as e:
            return (c.pipeline_schedule, c.pp, _rule_key(str(e)))
    return None


def _structure(c: Candidate) -> Candidate:
    """The candidate less its micro-batching and remat (what the library's rules see)."""
    return Candidate(dataclasses.replace(c.parallel, microbatches=None), _without_remat(c.memory), 1)


@functools.lru_cache(maxsize=256)
def _without_remat(memory: MemorySettings) -> MemorySettings:
    return dataclasses.replace(memory, remat="none")


def _split(c: Candidate) -> int:
    """The tensor method's batch split (Optimus: its grid's rows)."""
    return tensor_method(c.tensor_parallel).batch_split_at(c.tp)


def _canonical(c: Candidate) -> Candidate:
    """The candidate with the fewest micro-batches its structure allows (pp of them), micro-batch = the tensor
    method's batch split."""
    return Candidate(dataclasses.replace(c.parallel, microbatches=c.pp if c.pp > 1 else None), c.memory, _split(c))


def _canonical_workload(c: Candidate, w: Workload) -> Workload:
    return dataclasses.replace(w, global_batch=c.data_degree * _split(c) * c.pp)


def _batch_rule(c: Candidate, w: Workload) -> bool:
    """True when the candidate's micro-batching breaks a batch rule (global batch split, Optimus's batch split)."""
    return w.global_batch % (c.data_degree * c.micro_batch) != 0 or c.micro_batch % _split(c) != 0


def _rule_key(message: str) -> str:
    """A rule's message with its numbers blanked, to count plans refused by the same rule."""
    return re.sub(r"\d+", "#", message)


# When no plan fits as it is, the search tries again with the memory techniques, cumulative, cheapest first:
# the loss and MLP tiles, then the layer inputs in host memory (remat full, pp = 1), then the optimizer state too.
MEMORY_LEVELS = (
    ("tiles",),
    ("tiles", "layer_inputs"),
    ("tiles", "layer_inputs", "optimizer"),
    ("tiles", "layer_inputs", "weights"),
    ("tiles", "layer_inputs", "weights", "blocks"),  # recompute blocks of √L layers: fewer layer inputs kept
)
TILE_ROWS = (4096, 2048, 1024, 512, 256, 128, 64)


def recompute_block(layers: int) -> int:
    """Layers per recompute block for a stack of `layers`: the divisor k > 1 that keeps the fewest layer inputs
    at once, layers / k block inputs and, in a block's backward, its k layers' (Chen et al. 2016's √L
    checkpointing: 32 layers -> 4, 12 inputs); 1 when `layers` has no such divisor."""
    ks = [k for k in range(2, layers + 1) if layers % k == 0]
    return min(ks, key=lambda k: (layers // k + k, k)) if ks else 1


def with_memory_techniques(c: Candidate, w: Workload, level: tuple[str, ...]) -> Candidate:
    """`c` with the memory techniques of `level` (one of MEMORY_LEVELS): tiles of the largest of TILE_ROWS
    that divides the rows on a device (untiled when none does), the layer inputs offloaded where remat is
    full and pp = 1, the optimizer state offloaded wherever asked, the weights (with it) where pp = 1 and the
    ZeRO stage is 0 or 3 (or nothing is replicated), else the optimizer state alone; "blocks": recompute
    blocks of `recompute_block` layers under remat full (`--remat-layers`)."""
    rows = w.seq_len // max(1, c.sp * c.tp) if w.seq_len else 0
    tile = next((t for t in TILE_ROWS if t < rows and rows % t == 0), None)
    parts = set(level) - {"tiles"}
    if c.memory.remat != "full" or c.pp > 1:
        parts.discard("layer_inputs")
    replicated = c.dp * c.sp * c.ep > 1
    if "weights" in parts and (c.pp > 1 or (replicated and c.zero in (1, 2)) or c.steps(w) > 1):
        parts = parts - {"weights"} | {"optimizer"}
    if "weights" in parts:
        parts.discard("optimizer")
    blocks = recompute_block(w.config.num_layers // c.pp) if "blocks" in parts and c.memory.remat == "full" else 1
    offload = Offload(**{p: True for p in parts - {"blocks"}})
    vocab = getattr(w.config, "vocab_size", None)
    return c.with_memory(loss_tile=tile if vocab else None, mlp_tile=tile, offload=offload, remat_layers=blocks)


def search(w: Workload, cluster: Cluster, *, only: dict | None = None, keep: int | None = None) -> Result:
    """Every candidate validated and costed; the ones that fit, ranked by step time. When none fits and no
    memory setting is held, the search runs again with the memory techniques of each of MEMORY_LEVELS in turn
    (`with_memory_techniques`) and returns the first that fits. Raises NoPlanError (one line naming the tightest
    constraint, with every technique) when nothing fits.

    only: settings held fixed, by the run specification's names (Candidate fields and registry options), a value
    or a tuple of allowed values (e.g. {"sp": 64, "attention": ("ring", "wallfacer")} for WallFacer's own
    search over team_size and placement; {"team_size": 4})."""
    if cluster.devices < 1:
        raise NoPlanError(f"{cluster.devices} devices: nothing to plan")
    only = dict(only or {})
    fields = set(Candidate.setting_names())
    unknown = set(only) - fields - set(all_options())
    if unknown:
        raise ValueError(
            f"cannot hold {', '.join(sorted(unknown))} fixed; plan settings are {', '.join(sorted(fields))} and "
            f"the registry's options {', '.join(sorted(all_options()))}"
        )

    # the memory choices other than remat are not searched: held ones apply to every candidate
    memory = {k: only.pop(k) for k in MEMORY_CHOICES if k in only and k not in SEARCHED_MEMORY}
    try:
        return _search(w, cluster, only, memory, None, keep)
    except NoPlanError:
        if memory or not w.seq_len:
            raise
        for i, level in enumerate(MEMORY_LEVELS):
            try:
                return _search(w, cluster, only, memory, level, keep)
            except NoPlanError:
                if i == len(MEMORY_LEVELS) - 1:
                    raise


# The planner's device-memory estimate is within 10% of the compiled program's on every compiled row of
# benchmarks/results/longest_sequence.json. When no plan fits by the estimate, `--plan auto` compiles the plans
# estimated within this factor of the budget (`margin_search`) and takes the first whose compiled bytes fit.
ESTIMATE_MARGIN = 1.10


def margin_search(w: Workload, cluster: Cluster, *, only: dict | None = None) -> Result:
    """The plans whose estimate is within ESTIMATE_MARGIN above the cluster's usable memory (and within its
    host memory), least device memory first: the ones to compile when `search` finds none. NoPlanError when
    none is."""
    wide = dataclasses.replace(cluster, memory_fraction=cluster.memory_fraction * ESTIMATE_MARGIN)
    result = search(w, wide, only=only)
    ranked = sorted(result.ranked, key=lambda ev: ev.memory.total)
    return dataclasses.replace(result, cluster=cluster, ranked=ranked)


def _search(
    w: Workload, cluster: Cluster, only: dict, memory: dict, level: tuple[str, ...] | None, keep: int | None
) -> Result:
    """`search` with the memory settings `memory` held, or the techniques of `level` on every candidate."""
    cache = _Cache(w, cluster)
    fits, over, rejected, considered = [], [], {}, 0
    seen_rules: dict = {}
    structures: dict = {}

    def reject(c: Candidate, e: Exception, quick: tuple | None = None):
        msg = " ".join(str(e).split())
        key = _rule_key(msg)
        if quick is not None:
            seen_rules[quick] = key
        if key in rejected:
            rejected[key].count += 1
        else:
            rejected[key] = Rejection("rule", 1, c, msg)

    for c in candidates(w, cluster):
        if memory:
            c = c.with_memory(**memory)
        elif level is not None:
            c = with_memory_techniques(c, w, level)
        if only and not all(
            c.setting(k) in v if isinstance(v, (tuple, list, set, frozenset)) else c.setting(k) == v
            for k, v in only.items()
        ):
            continue
        considered += 1
        refused = _weights_offload_rule(c, w)
        if refused is not None:
            reject(c, ValueError(refused))
            continue
        quick = _pipeline_rule(c, w)
        if quick is not None and quick in seen_rules:  # the library's pipeline rules, known to fail
            rejected[seen_rules[quick]].count += 1
            continue
        if quick is not None or _batch_rule(c, w):
            try:  # the library's own message, once per rule
                c.check(w)
            except ValueError as e:
                reject(c, e, quick)
            continue
        # the mesh, strategies and model rules do not depend on the micro-batching: validated once per structure
        key = _structure(c)
        if key not in structures:
            try:
                structures[key] = _canonical(c).check(_canonical_workload(c, w))
            except ValueError as e:
                structures[key] = e
        plan = structures[key]
        if isinstance(plan, ValueError):
            reject(c, plan)
            continue
        ev = evaluate(w, c, cluster, plan, cache)
        (fits if ev.fits else over).append(ev)
    if over:
        least = min(over, key=lambda ev: ev.memory.total)
        rejected["memory"] = Rejection(
            "memory",
            len(over),
            least.candidate,
            f"predicted memory above the {cluster.usable_memory / 2**30:.1f} GiB usable per device (the least of them: "
            f"{least.memory.total / 2**30:.1f} GiB)",
            least.memory.total,
        )
    if not considered:
        held = ", ".join(f"{k}={v}" for k, v in only.items())
        raise NoPlanError(
            f"no candidate has {held} on {cluster.devices} devices (degrees multiply to the device "
            f"count; sequence options need sp > 1, tensor methods tp > 1)"
        )
    if not fits:
        raise NoPlanError(_tightest(w, cluster, over, rejected, considered))
    fits.sort(key=lambda ev: (ev.step_s, ev.memory.total))
    return Result(w, cluster, fits[:keep] if keep else fits, rejected, considered)


def _tightest(
    w: Workload, cluster: Cluster, over: list[Evaluated], rejected: dict[str, Rejection], considered: int
) -> str:
    """One line: why nothing fits, naming the constraint closest to being met."""
    where = f"{w.describe()} on {cluster.devices} × {cluster.device.name}"
    if over and all(ev.memory.total <= cluster.usable_memory for ev in over):  # the host is what binds
        least = min(over, key=lambda ev: ev.memory.host)
        return (
            f"no plan fits in host memory for {where}: the least any valid plan keeps there is "
            f"{least.memory.host / 2**30:.1f} GiB per device ({least.candidate.describe()}), above the "
            f"{cluster.host_memory / 2**30:.1f} GiB per device the host has (a larger host, more devices or a "
            f"shorter sequence)"
        )
    if over:
        least = min((ev for ev in over if ev.memory.total > cluster.usable_memory), key=lambda ev: ev.memory.total)
        parts = least.memory.as_dict()
        biggest = max(("params", "optimizer", "gradients", "activations", "working", "head"), key=lambda k: parts[k])
        return (
            f"no plan fits in memory for {where}: the least any valid plan needs is "
            f"{least.memory.total / 2**30:.1f} GiB per device ({least.candidate.describe()}; its largest part: "
            f"{biggest} {parts[biggest] / 2**30:.1f} GiB), above the {cluster.usable_memory / 2**30:.1f} GiB usable "
            f"(more devices, a shorter sequence or a smaller batch)"
        )
    refusal = f"no valid plan for {where}: every one of the {considered} candidates breaks a rule"
    seq = _sequence_divisibility(w, rejected)
    if seq is not None:  # the workload's own rule: the plans that split the sequence all break it
        return f"{refusal}; the one that binds: {seq}"
    top = max(rejected.values(), key=lambda r: r.count)
    return f"{refusal}; the most common: {top.detail}"


def _sequence_divisibility(w: Workload, rejected: dict[str, Rejection]) -> str | None:
    """When plans were refused for the sequence length's divisibility: that rule, and the lengths nearest the
    given one that the largest split takes. The most common refusal (micro-batches of a pipeline, a vocabulary
    split) is then only a consequence: without a split sequence, the model fits nowhere."""
    seq_len = getattr(w, "seq_len", None)
    if not seq_len:
        return None
    rules = [r.detail for r in rejected.values() if r.detail.startswith(f"seq {seq_len} is not divisible by")]
    if not rules:
        return None
    divisors = [int(m) for rule in rules for m in re.findall(r"= (\d+)", rule)]
    if not divisors:
        return None
    d = max(divisors)
    below, above = seq_len // d * d, (seq_len // d + 1) * d
    nearest = f"--seq-len {below:,} or {above:,}" if below else f"--seq-len {above:,}"
    named = "; ".join(sorted(set(rules), key=rules.index)[:2])
    return (
        f"the sequence length {seq_len:,} does not divide over the devices ({named}): e.g. {nearest} (multiples of {d})"
    )
