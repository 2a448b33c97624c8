"""`make_plan`: the parallel settings of a run, by the flags' names with underscores, as a `ParallelPlan`."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jaxring.core.mesh import make_mesh
from jaxring.core.suggest import nearest
from jaxring.parallel.plan import ParallelPlan
from jaxring.run.schema import DEGREES, MemorySettings, ParallelSettings, check_setting, option_names, setting_fields

__all__ = ["PLAN_SETTINGS", "make_plan"]

# the settings a ParallelPlan takes besides the mesh degrees and the registry entries' options
PLAN_SETTINGS = (
    "attention",
    "layout",
    "tensor_parallel",
    "zero",
    "pipeline_schedule",
    "microbatches",
    "block_ops",
    "loss_tile",
    "mlp_tile",
)


def make_plan(devices: Sequence[jax.Device] | None = None, **settings) -> ParallelPlan:
    """The `ParallelPlan` that `train.py` builds from the same parallel settings, by the flags' names with
    underscores: make_plan(sp=8, attention="ring", layout="zigzag", tp=2, tensor_parallel="megatron", pp=2,
    pipeline_schedule="1f1b", microbatches=4, team_size=..., ...). Degrees not given are 1; with none given,
    sp is the device count. devices: default `jax.devices()`."""
    options = set(option_names())
    allowed = set(DEGREES) | set(PLAN_SETTINGS) | options
    for name, value in settings.items():
        if name not in allowed:
            raise ValueError(f"make_plan: unknown parallel setting {name!r}{nearest(name, allowed)}")
        for section in (ParallelSettings, MemorySettings):
            if name in setting_fields(section) and value is not None:
                check_setting(section, name, value)
    devices = list(jax.devices() if devices is None else devices)
    p = ParallelSettings(**{k: settings.get(k) for k in DEGREES})
    degrees = p.degrees(len(devices))
    attention = settings.get("attention") or ("ring" if degrees["sp"] > 1 else "dense")
    kwargs = {k: settings[k] for k in PLAN_SETTINGS if settings.get(k) is not None and k != "attention"}
    chosen = {k: v for k, v in settings.items() if k not in allowed - options and v is not None}
    mesh = make_mesh(**degrees, devices=devices)
    return ParallelPlan(mesh, attention=attention, **kwargs, **chosen)
