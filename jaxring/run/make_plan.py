"""`make_plan`: the parallel settings of a run, by the flags' names with underscores, as a `ParallelPlan`."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jaxring.core.mesh import make_mesh
from jaxring.core.suggest import nearest
from jaxring.parallel.plan import ParallelPlan
from jaxring.parallel.settings import FIELDS, ParallelSettings
from jaxring.run.schema import MemorySettings, check_setting, option_names, setting_fields

__all__ = ["PLAN_MEMORY", "make_plan", "plan_on"]

# the memory settings a ParallelPlan takes (the tiles: the layers read them from the plan)
PLAN_MEMORY = ("loss_tile", "mlp_tile")


def plan_on(
    devices: Sequence[jax.Device] | None, parallel: ParallelSettings, memory: MemorySettings | None = None
) -> ParallelPlan:
    """The `ParallelPlan` of the parallel settings on `devices` (default `jax.devices()`): their degrees, filled in
    (`ParallelSettings.degrees`), make the mesh; the memory settings' tiles go to the plan."""
    devices = list(jax.devices() if devices is None else devices)
    mesh = make_mesh(**parallel.degrees(len(devices)), devices=devices)
    tiles = {} if memory is None else {k: getattr(memory, k) for k in PLAN_MEMORY}
    return ParallelPlan(mesh, parallel, **tiles)


def make_plan(devices: Sequence[jax.Device] | None = None, **settings) -> ParallelPlan:
    """The `ParallelPlan` that `train.py` builds from the same parallel settings, by the flags' names with
    underscores: make_plan(sp=8, attention="ring", layout="zigzag", tp=2, tensor_parallel="megatron", pp=2,
    pipeline_schedule="1f1b", microbatches=4, team_size=..., loss_tile=..., ...). Degrees not given are 1; with
    none given, sp is the device count. devices: default `jax.devices()`."""
    options = set(option_names())
    allowed = FIELDS | set(PLAN_MEMORY) | options
    for name, value in settings.items():
        if name not in allowed:
            raise ValueError(f"make_plan: unknown parallel setting {name!r}{nearest(name, allowed)}")
        for section in (ParallelSettings, MemorySettings):
            if name in setting_fields(section) and value is not None:
                check_setting(section, name, value)
    given = {k: v for k, v in settings.items() if v is not None}
    memory = MemorySettings(**{k: given.pop(k) for k in PLAN_MEMORY if k in given})
    return plan_on(devices, ParallelSettings.of(**given), memory)
