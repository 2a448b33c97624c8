"""`train.py --plan auto`: the planner's best plan for the devices at hand, as settings of the run spec.

    spec = apply_auto_plan(RunSpec.of(plan="auto", preset="tiny"), jax.devices())
    spec.parallel.sp, spec.parallel.attention, spec.training.grad_accum, ...

The cluster is read from the devices: their count, how many one process holds (a node), and their kind (H100
or H200 by name; anything else: the nominal "cpu" device, so the ranking still follows the bytes and FLOPs).
Settings the user gave (a mesh degree, --attention, --zero, an option, ...) are held fixed in the search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from jaxring.core.accelerators import DEVICES as ACCELERATORS
from jaxring.core.accelerators import device_spec_of
from jaxring.planner.cluster import DEVICES, Cluster
from jaxring.planner.fit import workload_of
from jaxring.planner.search import Result, search
from jaxring.planner.space import DEFAULT_MEMORY_CHOICES, NOT_CHOSEN, PARALLEL_FIELDS

if TYPE_CHECKING:
    import jax

    from jaxring.run.spec import RunSpec

# the parallel settings a search does not hold: fsdp (a candidate's dp counts it), those no plan chooses (the
# per-block compute: kept as given) and the pipeline schedule (its default names no pipeline: the search picks
# one where pp > 1)
_NOT_HELD = ("fsdp", *NOT_CHOSEN, "pipeline_schedule")


def device_kind(devices: Sequence[jax.Device]) -> str:
    """The planner's name of the devices (`cluster.DEVICES`: an NVIDIA GPU or a TPU by its device_kind), else "cpu"."""
    spec = device_spec_of(devices[0]) if getattr(devices[0], "platform", "cpu") != "cpu" else None
    name = next((n for n, s in ACCELERATORS.items() if s is spec), None)
    return name if name in DEVICES else "cpu"


def cluster_of(devices: Sequence[jax.Device]) -> Cluster:
    per_node = max(1, len([d for d in devices if d.process_index == devices[0].process_index]))
    if getattr(devices[0], "platform", "") == "cpu":
        per_node = len(devices)  # simulated devices share one host
    return Cluster.of(device_kind(devices), len(devices), devices_per_node=per_node)


def held_settings(spec: RunSpec) -> dict:
    """The spec's given parallel settings and its memory choices that are not the defaults (remat none, the
    default, is searched), held fixed in a search."""
    p = spec.parallel
    held = {k: getattr(p, k) for k in PARALLEL_FIELDS if k not in _NOT_HELD and getattr(p, k) is not None}
    held.update(p.options)
    held.update({k: v for k, v in spec.memory.choices().items() if v != DEFAULT_MEMORY_CHOICES[k]})
    return held


def auto_plan(spec: RunSpec, devices: Sequence[jax.Device]) -> tuple[dict, Result]:
    """(the spec's settings of the best plan, the search result); the spec's given parallel settings held."""
    result = search(workload_of(spec), cluster_of(list(devices)), only=held_settings(spec))
    return result.best.candidate.settings(result.workload), result  # grad_accum too (pp = 1)


def apply_auto_plan(spec: RunSpec, devices: Sequence[jax.Device], log: Callable[[str], object] = print) -> RunSpec:
    """`train.py --plan auto`: the spec with its parallel settings (and grad_accum, remat) from the planner's
    best plan for `devices`, settings the user gave held fixed; `plan` becomes "manual"."""
    settings, result = auto_plan(spec, devices)
    best, w = result.best, result.workload
    log(
        f"--plan auto: {best.candidate.describe()} on {result.cluster.devices} × {result.cluster.device.name} "
        f"(predicted {best.step_s:.3g} s/step, {best.memory.total / 2**30:.2f} GiB per device; "
        f"{len(result.ranked)} of {result.considered} plans fit) for {w.describe()}"
    )
    parallel = dataclasses.replace(spec.parallel, options={}, plan="manual")
    return dataclasses.replace(spec, parallel=parallel).updated(**settings)
