"""The search: every plan the library can run for a workload on a cluster, ranked by predicted step time.

    result = search(workload, cluster)
    result.best.candidate, result.best.time.total, result.best.memory.total
    print(result.table(top=10)); print(result.rejections())

The recipe is the playbook's ("fit a step in memory, reach the global batch, then maximise throughput") as a
grid search, WallFacer's Eq. 8 autoscheduler widened from (C, placement) to every axis: mesh degrees
(dp, pp, tp, sp, ep: their product is the device count), the sequence strategy and its options (ring, Ulysses,
all-gather, RSA, USP with every U, WallFacer with every C and both placements), the tensor method (Megatron;
Optimus and METP where sp = 1), the ZeRO stage, the pipeline schedule and micro-batches, remat, and the
micro-batch. A plan is kept when the library accepts it (`ParallelPlan`, `models/*.check_plan`: the same
one-line errors train.py gives) and its predicted memory fits; kept plans are ranked by the cost model's step
time (`jaxring/planner/cost.py`). fsdp is not searched: dp with a ZeRO stage is the same program.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxring.nn import REMAT
from jaxring.planner import cost
from jaxring.planner.cluster import Cluster
from jaxring.planner.params import param_leaves
from jaxring.planner.space import Candidate, Workload
from jaxring.registry import pipeline_schedules


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
    def plan(self):
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
        "candidate": dataclasses.asdict(ev.candidate),
        "train_flags": ev.candidate.train_flags(),
        "step_s": ev.step_s,
        "tokens_per_s": ev.tokens_per_s(w),
        "mfu": ev.mfu(w, cl),
        "time": {
            "compute": ev.time.compute,
            "bubble": ev.time.bubble,
            "optimizer": ev.time.optimizer,
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


def sequence_choices(sp: int) -> list[dict]:
    if sp == 1:
        return [dict(attention="dense")]
    out = [dict(attention=a) for a in ("ring", "ulysses", "allgather", "rsa")]
    out += [dict(attention="usp", ulysses_size=u) for u in _divisors(sp) if 1 < u < sp]
    for c in range(2, math.isqrt(sp) + 1):
        if sp % (c * c) == 0:
            out += [dict(attention="wallfacer", team_size=c, placement=p) for p in ("team_inner", "ring_inner")]
    return out


def tensor_choices(tp: int, sp: int) -> list[str | None]:
    if tp == 1:
        return [None]
    out = ["megatron"]
    if sp == 1:
        out.append("metp")
        if math.isqrt(tp) ** 2 == tp:
            out.append("optimus")
    return out


def candidates(w: Workload, cluster: Cluster, remat_modes=None):
    """Every candidate for `w` on `cluster.devices` devices (before validation)."""
    n = cluster.devices
    layers = w.config.num_layers
    experts = w.moe.num_experts if w.moe is not None else 1
    remat_modes = remat_modes or REMAT
    for dp, pp, tp, sp, ep in _factorizations(n, 5):
        if ep > 1 and (w.moe is None or experts % ep):
            continue
        if pp > layers:
            continue
        data = dp * ep
        if w.global_batch % data:
            yield Candidate(dp=dp, pp=pp, tp=tp, sp=sp, ep=ep, micro_batch=1)  # rejected: batch split
            continue
        replica_batch = w.global_batch // data
        replicas = dp * ep * sp
        for seq in sequence_choices(sp):
            for tensor in tensor_choices(tp, sp):
                for zero in (0, 1, 2, 3) if replicas > 1 else (0,):
                    for mb in _divisors(replica_batch):
                        steps = replica_batch // mb
                        for remat in remat_modes:
                            base = dict(
                                dp=dp,
                                pp=pp,
                                tp=tp,
                                sp=sp,
                                ep=ep,
                                tensor=tensor,
                                zero=zero,
                                remat=remat,
                                micro_batch=mb,
                                **seq,
                            )
                            if pp == 1:
                                yield Candidate(**base)
                                continue
                            for sched in pipeline_schedules():
                                if sched == "interleaved":
                                    for v in (2, 4):
                                        if layers % (pp * v) == 0:
                                            yield Candidate(
                                                pipeline=sched, microbatches=steps, virtual_stages=v, **base
                                            )
                                else:
                                    yield Candidate(pipeline=sched, microbatches=steps, **base)


# ---------------------------------------------------------------------------------------- evaluation


class _Cache:
    """Per-search caches: leaves by (tensor method, degrees, sequence axes); locality by run-mesh structure."""

    def __init__(self, w: Workload, cluster: Cluster):
        self.w, self.cluster = w, cluster
        self.leaves: dict = {}
        self.local: dict = {}

    def param_leaves(self, c: Candidate, plan):
        key = (c.dp, c.pp, c.tp, c.sp, c.ep, c.tensor, c.attention, c.team_size, c.ulysses_size)
        if key not in self.leaves:
            self.leaves[key] = param_leaves(self.w.model, self.w.config, plan)
        return self.leaves[key]

    def locality(self, c: Candidate, plan, axes_list):
        key = (c.dp, c.pp, c.tp, c.sp, c.ep, c.tensor, c.attention, c.team_size, c.ulysses_size, c.placement)
        have = self.local.setdefault(key, {})
        missing = [a for a in set(axes_list) if a not in have]
        if missing:
            have.update(cost.locality(plan, missing, self.cluster.devices_per_node))
        return have


def evaluate(w: Workload, c: Candidate, cluster: Cluster, plan=None, cache: _Cache | None = None) -> Evaluated:
    """The cost model's prediction for one candidate (it must be valid: see Candidate.check). plan: its
    ParallelPlan, or one of the same mesh and strategies (the cost model reads its run mesh and weights)."""
    cache = cache or _Cache(w, cluster)
    plan = plan or c.check(w)
    leaves = cache.param_leaves(c, plan)
    transfers = cost.traffic(w, c, leaves, cpu=cluster.cpu)
    local = cache.locality(c, plan, [t.axes for t in transfers])
    mem = cost.memory(w, c, leaves, cpu=cluster.cpu)
    time = cost.step_time(w, c, transfers, cluster, local, leaves)
    return Evaluated(c, w, mem, time, transfers, mem.total <= cluster.usable_memory)


def _pipeline_rule(c: Candidate, w: Workload):
    """A key for the pipeline rules ParallelPlan enforces (fewer micro-batches than stages, ZeRO-2 with pp,
    interleaved micro-batches not a multiple of pp), so the search asks the library once per rule."""
    if c.pp == 1:
        return None
    m = c.steps(w)
    if m < c.pp:
        return ("microbatches < pp", c.pp)
    if c.zero == 2:
        return ("zero 2 with pp",)
    if c.pipeline == "interleaved" and m % c.pp:
        return ("interleaved m % pp", c.pp)
    return None


def _structure(c: Candidate) -> tuple:
    return dataclasses.astuple(dataclasses.replace(c, micro_batch=1, microbatches=None, remat="none"))


def _split(c: Candidate) -> int:
    return math.isqrt(c.tp) if c.tensor == "optimus" else 1


def _canonical(c: Candidate) -> Candidate:
    """The candidate with the fewest micro-batches its structure allows (pp of them), micro-batch = the tensor
    method's batch split."""
    return dataclasses.replace(c, micro_batch=_split(c), microbatches=c.pp if c.pp > 1 else None)


def _canonical_workload(c: Candidate, w: Workload) -> Workload:
    return dataclasses.replace(w, global_batch=c.data_degree * _split(c) * c.pp)


def _batch_rule(c: Candidate, w: Workload) -> bool:
    """True when the candidate's micro-batching breaks a batch rule (global batch split, Optimus's batch split)."""
    return w.global_batch % (c.data_degree * c.micro_batch) != 0 or c.micro_batch % _split(c) != 0


def _rule_key(message: str) -> str:
    """A rule's message with its numbers blanked, to count plans refused by the same rule."""
    return re.sub(r"\d+", "#", message)


def search(w: Workload, cluster: Cluster, *, only: dict | None = None, keep: int | None = None) -> Result:
    """Every candidate validated and costed; the ones that fit, ranked by step time. Raises NoPlanError (one line
    naming the tightest constraint) when nothing fits.

    only: Candidate fields held fixed, a value or a tuple of allowed values (e.g. {"sp": 64, "attention":
    ("ring", "wallfacer")} for WallFacer's own search over C and placement)."""
    if cluster.devices < 1:
        raise NoPlanError(f"{cluster.devices} devices: nothing to plan")
    only = dict(only or {})
    fields = {f.name for f in dataclasses.fields(Candidate)}
    unknown = set(only) - fields
    if unknown:
        raise ValueError(f"cannot hold {', '.join(sorted(unknown))} fixed; plan fields are {', '.join(sorted(fields))}")
    cache = _Cache(w, cluster)
    fits, over, rejected, considered = [], [], {}, 0
    seen_rules: dict = {}
    structures: dict = {}

    def reject(c, e, quick=None):
        msg = " ".join(str(e).split())
        key = _rule_key(msg)
        if quick is not None:
            seen_rules[quick] = key
        if key in rejected:
            rejected[key].count += 1
        else:
            rejected[key] = Rejection("rule", 1, c, msg)

    for c in candidates(w, cluster):
        if only and not all(
            getattr(c, k) in v if isinstance(v, (tuple, list, set, frozenset)) else getattr(c, k) == v
            for k, v in only.items()
        ):
            continue
        considered += 1
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


def _tightest(w: Workload, cluster: Cluster, over, rejected, considered) -> str:
    """One line: why nothing fits, naming the constraint closest to being met."""
    where = f"{w.describe()} on {cluster.devices} × {cluster.device.name}"
    if over:
        least = min(over, key=lambda ev: ev.memory.total)
        parts = least.memory.as_dict()
        biggest = max(("params", "optimizer", "gradients", "activations", "working"), key=lambda k: parts[k])
        return (
            f"no plan fits in memory for {where}: the least any valid plan needs is "
            f"{least.memory.total / 2**30:.1f} GiB per device ({least.candidate.describe()}; its largest part: "
            f"{biggest} {parts[biggest] / 2**30:.1f} GiB), above the {cluster.usable_memory / 2**30:.1f} GiB usable "
            f"(more devices, a shorter sequence or a smaller batch)"
        )
    top = max(rejected.values(), key=lambda r: r.count)
    return (
        f"no valid plan for {where}: every one of the {considered} candidates breaks a rule; the most common: "
        f"{top.detail}"
    )
