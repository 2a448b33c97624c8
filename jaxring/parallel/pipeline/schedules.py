"""Pipeline schedules as tables: tick -> per-stage action (idle, F, B, W or BW) with its micro-batch and chunk.

p stages (devices on the `pp` axis), m micro-batches, v chunks per stage (virtual stages, interleaved only).
Chunk c of stage s is virtual stage c*p + s, so a micro-batch visits stages 0..p-1 v times over ("looping").

Actions (each takes one tick of the table; a tick is one lockstep step of the SPMD program):
  F   forward of one micro-batch through one chunk (the first virtual stage embeds, the last computes the loss)
  BW  its whole backward (input and weight gradient together)       gpipe, 1f1b, interleaved
  B   the input gradient only (sent on at once)                      zero-bubble
  W   the weight gradient of a micro-batch whose B is done           zero-bubble

Every schedule is written as each stage's *order* of actions (the paper's algorithm box); `_timetable` then
places the actions on ticks as early as their data allows (a message sent at the end of tick t is usable from
tick t+1), without reordering a stage's actions:

  gpipe        (all-forward-all-backward, GPipe / the playbook's AFAB): F for every micro-batch, then BW.
  1f1b         (PipeDream-flush): p-1-s warm-up forwards, then F/BW alternating, then the remaining BWs.
  interleaved  (Megatron-LM interleaved 1F1B): the same on v·m chunk-steps, forwards taken in groups of p
               micro-batches per chunk; warm-up 2(p-1-s) + (v-1)p. Needs m % p == 0.
  zero-bubble  (ZB-H1, Qi et al. 2023, sec. 2.1): p-1-s warm-up forwards, s (F, B) pairs with W held back,
               then (F, B, W) triples, then (B, W), then the s held-back Ws that fill the tail bubble. At most
               p-s micro-batches are between their F and their W on stage s, as 1F1B keeps between F and BW.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxring.parallel.registry import Option, PipelineSchedule, pipeline_schedule

IDLE, F, B, W, BW = 0, 1, 2, 3, 4
KIND_NAMES = {IDLE: ".", F: "F", B: "B", W: "W", BW: "BW"}


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A schedule's table. Arrays are int32 [num_ticks, num_stages]; idle cells hold kind IDLE and -1 elsewhere."""

    name: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    kind: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray

    @property
    def num_ticks(self) -> int:
        return self.kind.shape[0]

    @property
    def split_backward(self) -> bool:
        """True when the backward is split into B and W (zero-bubble), False when it is one BW action."""
        return bool((self.kind == B).any())

    def virtual_stage(self, tick: int, stage: int) -> int:
        return int(self.chunk[tick, stage]) * self.num_stages + stage

    def actions(self, stage: int) -> list[tuple[int, int, int, int]]:
        """Stage `stage`'s actions in order, as (tick, kind, microbatch, chunk)."""
        return [
            (t, int(self.kind[t, stage]), int(self.microbatch[t, stage]), int(self.chunk[t, stage]))
            for t in range(self.num_ticks)
            if self.kind[t, stage] != IDLE
        ]

    def chart(self) -> str:
        """The table as text: one row per stage, one column per tick; cells like F3 (F of micro-batch 3), with
        the chunk after a colon when v > 1 (F3:1)."""

        def cell(t: int, s: int) -> str:
            k = int(self.kind[t, s])
            if k == IDLE:
                return "."
            text = f"{KIND_NAMES[k]}{self.microbatch[t, s]}"
            return text + (f":{self.chunk[t, s]}" if self.virtual_stages > 1 else "")

        cells = [[cell(t, s) for t in range(self.num_ticks)] for s in range(self.num_stages)]
        width = max(len(c) for row in cells for c in row)
        return "\n".join(f"stage {s}: " + " ".join(c.ljust(width) for c in row) for s, row in enumerate(cells))

    def __str__(self) -> str:
        return (
            f"{self.name} schedule, pp={self.num_stages}, m={self.num_microbatches}, "
            f"v={self.virtual_stages}, {self.num_ticks} ticks\n{self.chart()}"
        )


def make_schedule(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1, **options: Any
) -> Schedule:
    """The table of the registered schedule `name` for p = num_stages, m = num_microbatches and its options
    (the interleaved schedule's `virtual_stages`: v chunks per stage)."""
    entry = pipeline_schedule(name)
    p, m = num_stages, num_microbatches
    for label, value in (("pp (num_stages)", p), ("num_microbatches", m), ("virtual_stages", virtual_stages)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label}={value!r} must be a positive integer")
    if m < p:
        raise ValueError(
            f"num_microbatches={m} is less than pp={p}: every stage needs a micro-batch in flight, "
            f"so a pipeline of {p} stages needs at least {p} micro-batches"
        )
    if virtual_stages != 1 or "virtual_stages" in entry.option_names():
        options = {"virtual_stages": virtual_stages, **options}
    options = entry.resolve_options(options, p)
    if entry.check is not None:
        entry.check(p, m, **options)
    v = options.get("virtual_stages", 1)
    orders = [entry.build(s, p, m, v) for s in range(p)]
    kind, mb, chunk = _timetable(orders, p, v)
    return Schedule(name, p, m, v, kind, mb, chunk)


# Each order is a list of (kind, microbatch, chunk) for one stage.


def _gpipe(s: int, p: int, m: int, v: int) -> list[tuple[int, int, int]]:
    return [(F, i, 0) for i in range(m)] + [(BW, i, 0) for i in range(m)]


def _one_f_one_b(s: int, p: int, m: int, v: int) -> list[tuple[int, int, int]]:
    warmup = min(p - 1 - s, m)
    order = [(F, i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(F, warmup + i, 0), (BW, i, 0)]
    return order + [(BW, i, 0) for i in range(m - warmup, m)]


def _interleaved(s: int, p: int, m: int, v: int) -> list[tuple[int, int, int]]:
    def unit(k: int, backward: bool) -> tuple[int, int]:  # the k-th chunk-step of this stage: (microbatch, chunk)
        group, r = divmod(k, p * v)
        c = r // p
        return group * p + r % p, (v - 1 - c if backward else c)

    total = v * m
    warmup = min((p - 1 - s) * 2 + (v - 1) * p, total)
    order = [(F, *unit(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [(F, *unit(warmup + k, False)), (BW, *unit(k, True))]
    return order + [(BW, *unit(k, True)) for k in range(total - warmup, total)]


def _zero_bubble_h1(s: int, p: int, m: int, v: int) -> list[tuple[int, int, int]]:
    warmup = p - 1 - s
    order = [(F, i, 0) for i in range(warmup)]
    f, b, w = warmup, 0, 0
    for _ in range(s):  # F, B: W held back
        order += [(F, f, 0), (B, b, 0)]
        f, b = f + 1, b + 1
    while f < m:  # F, B, W
        order += [(F, f, 0), (B, b, 0), (W, w, 0)]
        f, b, w = f + 1, b + 1, w + 1
    while b < m:  # B, W
        order += [(B, b, 0), (W, w, 0)]
        b, w = b + 1, w + 1
    return order + [(W, i, 0) for i in range(w, m)]  # the held-back Ws fill the tail


def _timetable(orders: list[list[tuple[int, int, int]]], p: int, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Places each stage's ordered actions on ticks as early as their inputs allow (lockstep, one per tick)."""
    last = v * p - 1
    done: dict[tuple[int, int, int], int] = {}  # (kind, microbatch, virtual stage) -> tick it ran
    position = [0] * p
    rows = []
    while any(position[s] < len(orders[s]) for s in range(p)):
        t = len(rows)
        row = [(IDLE, -1, -1)] * p
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            kind, i, c = orders[s][position[s]]
            vs = c * p + s
            before = lambda k, stage, i=i, t=t: done.get((k, i, stage), t) < t
            if kind == F:
                ready = vs == 0 or before(F, vs - 1)
            elif kind in (B, BW):
                ready = before(F, vs) and (vs == last or before(kind, vs + 1))
            else:
                ready = before(B, vs)
            if ready:
                row[s] = (kind, i, c)
                position[s] += 1
        for s, (kind, i, c) in enumerate(row):
            if kind != IDLE:
                done[(kind, i, c * p + s)] = t
        if all(k == IDLE for k, _, _ in row):
            raise RuntimeError("pipeline schedule deadlocked")  # the orders above never do this
        rows.append(row)
    table = np.array(rows, dtype=np.int32).reshape(len(rows), p, 3)
    return table[..., 0], table[..., 1], table[..., 2]


# ---------------------------------------------------------------------------------------- registry entries


def _check_virtual_stages(v: int, pp: int) -> None:
    del pp
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 2:
        raise ValueError(
            f"virtual_stages={v}: the 'interleaved' schedule needs at least 2 chunks per stage (with 1 it is '1f1b')"
        )


def _check_interleaved(p: int, m: int, virtual_stages: int) -> None:
    del virtual_stages
    if m % p:
        raise ValueError(
            f"num_microbatches={m} is not divisible by pp={p}, which the 'interleaved' schedule needs (it runs "
            f"micro-batches in groups of pp per chunk)"
        )


SCHEDULES = (
    PipelineSchedule("gpipe", "all forwards, then all backwards (GPipe; the playbook's AFAB)", build=_gpipe),
    PipelineSchedule(
        "1f1b", "one forward, one backward after p - 1 - s warm-up forwards (PipeDream-flush)", build=_one_f_one_b
    ),
    PipelineSchedule(
        "interleaved",
        "Megatron-LM's interleaved 1F1B: v chunks of layers per stage",
        build=_interleaved,
        check=_check_interleaved,
        options=(
            Option(
                "virtual_stages",
                "v, layer chunks per pipeline stage (interleaved)",
                _check_virtual_stages,
                default=2,
                search=lambda pp: (2, 4),
            ),
        ),
    ),
    PipelineSchedule(
        "zero-bubble", "ZB-H1: input and weight gradients split, W fills the bubble (Qi et al.)", build=_zero_bubble_h1
    ),
)
