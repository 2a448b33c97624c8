"""`train.py --plan auto` at the margin, on GPUs: when no plan fits by the planner's estimate, the plans
estimated within `ESTIMATE_MARGIN` above the usable memory are compiled on the devices, least first, and the
first whose compiled program fits is run. The compiler, not the estimate, decides (the estimate is within 10%
of the compiled bytes on the longest-sequence rows), as `--compile-for` does for a target without one.

    spec = apply_auto_plan_at_the_margin(spec, devices, refused)   # refused: the search's NoPlanError
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from jaxring.aot.memory_check import compiled_peak
from jaxring.planner.auto import cluster_of, held_settings
from jaxring.planner.fit import workload_of
from jaxring.planner.search import ESTIMATE_MARGIN, NoPlanError, margin_search

if TYPE_CHECKING:
    import jax

    from jaxring.run.spec import RunSpec

TRIES = 3  # plans compiled at most


def apply_auto_plan_at_the_margin(
    spec: RunSpec,
    devices: Sequence[jax.Device],
    refused: NoPlanError,
    log: Callable[[str], object] = print,
    peak: Callable = compiled_peak,
) -> RunSpec:
    """The spec with the settings of the first plan estimated within the margin whose step, compiled on
    `devices`, fits their usable memory; raises `refused` when none does (or none is within the margin).
    peak(workload, candidate, devices=...) -> compiled bytes per device."""
    cluster = cluster_of(list(devices))
    try:
        result = margin_search(workload_of(spec), cluster, only=held_settings(spec))
    except NoPlanError:
        raise refused from None
    log(
        f"--plan auto: {refused}; the estimate is within {ESTIMATE_MARGIN - 1:.0%} of the compiled bytes, so the "
        f"plans estimated least above the budget are compiled: the compiler decides"
    )
    usable = cluster.usable_memory
    for ev in result.ranked[:TRIES]:
        compiled = peak(result.workload, ev.candidate, devices=list(devices)[: ev.candidate.devices])
        fits = compiled <= usable
        log(
            f"--plan auto: {ev.candidate.describe()}: compiled {compiled / 2**30:.1f} GiB per device, estimate "
            f"{ev.memory.total / 2**30:.1f}, usable {usable / 2**30:.1f}: {'fits' if fits else 'does not fit'}"
        )
        if fits:
            parallel = dataclasses.replace(spec.parallel, options={}, plan="manual")
            return dataclasses.replace(spec, parallel=parallel).updated(**ev.candidate.settings(result.workload))
    raise refused
