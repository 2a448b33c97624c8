"""A schedule table lowered to what the SPMD interpreter needs, all static (numpy):

- per (tick, stage) the integer fields of its action: which branch to run, micro-batch, chunk, and the buffer
  slots it reads and writes (inboxes for arriving activations / gradients, residual slots, the B->W stash);
- per tick the point-to-point pairs that really send (forward: F to the next virtual stage's device; backward:
  B/BW to the previous one), so no idle stage ever sends;
- the tick sequence cut into segments: runs whose send pattern repeats with a period become one loop (its
  body unrolled over the period), the rest are single ticks, so the program stays small without sending
  garbage on idle ticks.

Slots are allocated per stage by replaying the table (a slot freed by a read in tick t can take a message that
arrives at the end of tick t); a buffer has as many slots as the busiest stage needs (SPMD shapes are equal on
every stage). So the residual buffer holds m slots for gpipe and at most p for 1f1b and zero-bubble.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import numpy as np

from jaxring.parallel.pipeline.schedules import BW, IDLE, B, F, Schedule, W

FIELDS = (
    "branch",
    "mb",
    "chunk",
    "x_slot",
    "dy_slot",
    "res_slot",
    "wres_slot",
    "stash_slot",
    "recv_x_slot",
    "recv_dy_slot",
)
BUFFERS = ("x", "dy", "res", "wres", "stash")


@dataclasses.dataclass(frozen=True)
class Branch:
    """What one switch branch does: an action kind on the first / last virtual stage or in between, on pipeline
    stage `stage` (-1: idle, any stage). Each stage has branches of its own, so the collectives inside a branch
    are executed by exactly the devices that take it (see `jaxring.core.collectives.stage_local`)."""

    kind: int
    first: bool = False
    last: bool = False
    stage: int = -1


@dataclasses.dataclass
class Segment:
    """Ticks [start, start + period * repeats): one loop of `repeats` iterations over `period` unrolled ticks
    (repeats == 1: plain ticks). branches[j]: the branches tick position j can take."""

    start: int
    period: int
    repeats: int
    branches: list[list[Branch]]


@dataclasses.dataclass
class Lowered:
    schedule: Schedule
    fields: np.ndarray  # int32 [ticks, stages, len(FIELDS)]; -1 where unused
    slots: dict[str, int]  # slots per buffer (at least 1)
    fwd_pairs: list[tuple[tuple[int, int], ...]]  # per tick: (source, target) stages on the pp axis
    bwd_pairs: list[tuple[tuple[int, int], ...]]
    segments: list[Segment]

    def field(self, name: str) -> int:
        return FIELDS.index(name)


class _Slots:
    """Per-stage slot allocator for one buffer: lowest free slot first."""

    def __init__(self, p: int):
        self.free = [[] for _ in range(p)]
        self.size = [0] * p
        self.where: dict = {}

    def take(self, s: int, key: Hashable) -> int:
        if self.free[s]:
            slot = min(self.free[s])
            self.free[s].remove(slot)
        else:
            slot = self.size[s]
            self.size[s] += 1
        self.where[(s, key)] = slot
        return slot

    def give(self, s: int, key: Hashable) -> int:
        slot = self.where.pop((s, key))
        self.free[s].append(slot)
        return slot


def lower(schedule: Schedule, max_period: int | None = None) -> Lowered:
    p, v = schedule.num_stages, schedule.virtual_stages
    last = v * p - 1
    T = schedule.num_ticks
    split = schedule.split_backward
    fields = np.full((T, p, len(FIELDS)), -1, np.int32)
    col = {name: i for i, name in enumerate(FIELDS)}
    alloc = {name: _Slots(p) for name in BUFFERS}
    fwd_pairs, bwd_pairs, branch_of = [], [], np.empty((T, p), object)
    for t in range(T):
        arrivals = []  # (buffer, stage, key) arriving at the end of t
        sends_f, sends_b = [], []
        for s in range(p):
            k = int(schedule.kind[t, s])
            if k == IDLE:
                branch_of[t, s] = Branch(IDLE)
                continue
            i, c = int(schedule.microbatch[t, s]), int(schedule.chunk[t, s])
            vs = c * p + s
            key = (i, vs)
            f = fields[t, s]
            f[col["mb"]], f[col["chunk"]] = i, c
            if k == F:
                if vs > 0:
                    f[col["x_slot"]] = alloc["x"].give(s, key)
                f[col["res_slot"]] = alloc["res"].take(s, key)
                if split:
                    f[col["wres_slot"]] = alloc["wres"].take(s, key)
                if vs == last:
                    f[col["dy_slot"]] = alloc["dy"].take(s, key)  # the loss gradient, kept for B/BW
                else:
                    sends_f.append((s, (s + 1) % p))
                    arrivals.append(("x", (s + 1) % p, (i, vs + 1)))
                branch_of[t, s] = Branch(F, vs == 0, vs == last, s)
            elif k in (B, BW):
                f[col["dy_slot"]] = alloc["dy"].give(s, key)
                f[col["res_slot"]] = alloc["res"].give(s, key)
                if k == B:
                    f[col["stash_slot"]] = alloc["stash"].take(s, key)
                if vs > 0:
                    sends_b.append((s, (s - 1) % p))
                    arrivals.append(("dy", (s - 1) % p, (i, vs - 1)))
                branch_of[t, s] = Branch(k, vs == 0, stage=s)
            elif k == W:
                f[col["wres_slot"]] = alloc["wres"].give(s, key)
                f[col["stash_slot"]] = alloc["stash"].give(s, key)
                branch_of[t, s] = Branch(W, stage=s)
        for buffer, s, key in arrivals:
            fields[t, s, col["recv_" + buffer + "_slot"]] = alloc[buffer].take(s, key)
        fwd_pairs.append(tuple(sends_f))
        bwd_pairs.append(tuple(sends_b))
    for name, a in alloc.items():
        if a.where:
            raise RuntimeError(f"buffer {name} still holds {sorted(a.where)} at the end of the schedule")
    slots = {name: max(1, max(a.size)) for name, a in alloc.items()}
    segments = _segments(list(zip(fwd_pairs, bwd_pairs)), max_period or 2 * p * v + 2)
    for seg in segments:
        for j in range(seg.period):
            ticks = range(seg.start + j, seg.start + seg.period * seg.repeats, seg.period)
            used = sorted(
                {branch_of[t, s] for t in ticks for s in range(p)}, key=lambda b: (b.kind, b.first, b.last, b.stage)
            )
            seg.branches.append(used)
            for t in ticks:
                for s in range(p):
                    fields[t, s, col["branch"]] = used.index(branch_of[t, s])
    return Lowered(schedule, fields, slots, fwd_pairs, bwd_pairs, segments)


def _segments(signature: list, max_period: int) -> list[Segment]:
    """Greedy cover of the ticks by periodic runs (at least 2 repeats) and single ticks."""
    T, t, out = len(signature), 0, []
    while t < T:
        best = (1, 1)  # (period, repeats)
        for period in range(1, max_period + 1):
            repeats = 1
            while (
                t + (repeats + 1) * period <= T
                and signature[t + repeats * period : t + (repeats + 1) * period] == signature[t : t + period]
            ):
                repeats += 1
            if repeats >= 2 and period * repeats > best[0] * best[1] + (period - best[0]):
                best = (period, repeats)
        period, repeats = best
        out.append(Segment(t, period, repeats, []))
        t += period * repeats
    return out
