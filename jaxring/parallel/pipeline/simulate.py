"""Bubble fraction and in-flight micro-batches of a schedule table, and its picture.

How the bubble is counted. Each stage does the same useful work: v·m forwards and v·m backwards of its chunks,
`busy` = v·m·(t_F + t_B + t_W) / v time units with the costs below. The step takes `makespan`; the bubble is
the idle time relative to the useful time, as the playbook's r_bubble = t_pb / t_id:

    bubble = (makespan - busy) / busy

Costs are per action of a whole stage (a chunk costs 1/v of it). `costs="paper"` is the zero-bubble paper's
T_F = T_B = T_W = 1 with the whole backward BW = B + W = 2 (the playbook's t_b = 2 t_f); `costs="unit"` makes
every action 1, the plain tick count. Communication is free in both.

Two clocks:
  lockstep=False  every stage starts its next action (in table order) as soon as that action's inputs are done:
                  the timing the papers analyse (separate programs per stage, MPMD). With paper costs this gives
                  (p-1)/m for gpipe and 1f1b, (p-1)/(v·m) for interleaved, (p-1)/(3m) for ZB-H1.
  lockstep=True   the table's ticks run one after another and a tick lasts as long as its slowest action: how
                  one SPMD program (jaxring's interpreter) runs it. Equal to the above with unit costs; with
                  paper costs, ticks where one stage runs F while another runs BW cost t_BW for both.

In flight: micro-batch-chunks whose forward has run on a stage and whose backward has not finished (BW, or W
for split backwards): what the stage holds residuals for. It depends on the table only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxring.parallel.pipeline.schedules import BW, IDLE, KIND_NAMES, B, F, Schedule, W

COSTS = {"paper": {F: 1.0, B: 1.0, W: 1.0, BW: 2.0}, "unit": {F: 1.0, B: 1.0, W: 1.0, BW: 1.0}}


@dataclasses.dataclass
class Simulation:
    schedule: Schedule
    costs: dict
    lockstep: bool
    start: np.ndarray  # float [ticks, stages]: when each action starts (NaN for idle cells)
    end: np.ndarray  # float [ticks, stages]
    makespan: float
    busy: float  # useful time per stage (the same on every stage)
    peak_in_flight: list[int]  # per stage

    @property
    def bubble(self) -> float:
        return (self.makespan - self.busy) / self.busy


def _costs(costs: str | Mapping[str, float]) -> dict:
    if isinstance(costs, str):
        if costs not in COSTS:
            raise ValueError(f"costs {costs!r} must be one of {sorted(COSTS)} or a dict of action costs")
        return COSTS[costs]
    return dict(costs)


def simulate(schedule: Schedule, costs: str | Mapping[str, float] = "paper", lockstep: bool = False) -> Simulation:
    """Times the table's actions (see the module docstring) and counts in-flight micro-batches."""
    costs = _costs(costs)
    p, v = schedule.num_stages, schedule.virtual_stages
    kind, mb, chunk = schedule.kind, schedule.microbatch, schedule.chunk
    duration = np.vectorize(lambda k: costs.get(int(k), 0.0) / v if k != IDLE else 0.0)(kind)
    start = np.full(kind.shape, np.nan)
    end = np.full(kind.shape, np.nan)
    if lockstep:
        tick_len = duration.max(axis=1)
        tick_start = np.concatenate([[0.0], np.cumsum(tick_len)[:-1]])
        busy_cells = kind != IDLE
        start[busy_cells] = np.broadcast_to(tick_start[:, None], kind.shape)[busy_cells]
        end[busy_cells] = start[busy_cells] + duration[busy_cells]
        makespan = float(tick_len.sum())
    else:
        finish: dict[tuple[int, int, int], float] = {}  # (kind, microbatch, virtual stage) -> end time
        free = [0.0] * p
        last = v * p - 1
        # visit cells in tick order: every dependency sits in an earlier tick of the table
        for t in range(schedule.num_ticks):
            for s in range(p):
                k = int(kind[t, s])
                if k == IDLE:
                    continue
                i, vs = int(mb[t, s]), int(chunk[t, s]) * p + s
                deps = []
                if k == F and vs > 0:
                    deps.append(finish[(F, i, vs - 1)])
                if k in (B, BW):
                    deps.append(finish[(F, i, vs)])
                    if vs < last:
                        deps.append(finish[(k, i, vs + 1)])
                if k == W:
                    deps.append(finish[(B, i, vs)])
                start[t, s] = max([free[s], *deps])
                end[t, s] = start[t, s] + duration[t, s]
                free[s] = end[t, s]
                finish[(k, i, vs)] = end[t, s]
        makespan = float(np.nanmax(end))
    busy = float(duration[:, 0].sum())
    return Simulation(schedule, costs, lockstep, start, end, makespan, busy, peak_in_flight(schedule))


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage: the most micro-batch-chunks between their F and the end of their backward at any tick."""
    peaks = []
    done_kind = W if schedule.split_backward else BW
    for s in range(schedule.num_stages):
        held = peak = 0
        for t in range(schedule.num_ticks):
            k = schedule.kind[t, s]
            held += int(k == F) - int(k == done_kind)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def bubble_fraction(schedule: Schedule, costs: str | Mapping[str, float] = "paper", lockstep: bool = False) -> float:
    return simulate(schedule, costs, lockstep).bubble


_COLORS = {F: "#4c72b0", B: "#55a868", W: "#c4ad66", BW: "#dd8452"}


def plot_schedule(
    schedule: Schedule, costs: str | Mapping[str, float] = "unit", lockstep: bool = True, ax: Any = None
) -> Any:
    """Draws the timeline (stages down, time across; boxes labelled with the micro-batch, chunk after a colon)
    with matplotlib and returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    sim = simulate(schedule, costs, lockstep)
    p = schedule.num_stages
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.35 * sim.makespan * schedule.virtual_stages + 2), 0.5 * p + 1))
    for t in range(schedule.num_ticks):
        for s in range(p):
            k = int(schedule.kind[t, s])
            if k == IDLE:
                continue
            x0, width = sim.start[t, s], sim.end[t, s] - sim.start[t, s]
            ax.add_patch(Rectangle((x0, s - 0.4), width, 0.8, facecolor=_COLORS[k], edgecolor="white"))
            label = str(schedule.microbatch[t, s])
            if schedule.virtual_stages > 1:
                label += f":{schedule.chunk[t, s]}"
            ax.text(x0 + width / 2, s, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, sim.makespan)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_xlabel("time (lockstep ticks)" if lockstep else "time")
    kinds = [k for k in (F, BW, B, W) if (schedule.kind == k).any()]
    ax.legend(
        handles=[Patch(color=_COLORS[k], label=KIND_NAMES[k]) for k in kinds],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        ncol=len(kinds),
        frameon=False,
    )
    ax.set_title(
        f"{schedule.name}: pp={p}, m={schedule.num_microbatches}, v={schedule.virtual_stages}, bubble {sim.bubble:.3f}",
        loc="left",
        fontsize=9,
    )
    return ax
