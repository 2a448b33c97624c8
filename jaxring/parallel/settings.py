"""The parallel settings, declared once: the mesh degrees, the strategy for each axis and the chosen registry
entries' own options, as one immutable value.

    settings = ParallelSettings.of(sp=4, tp=2, attention="wallfacer", team_size=2, tensor_parallel="megatron")
    plan = ParallelPlan(mesh, settings)          # jaxring.parallel.plan: checked against the mesh and resolved
    settings.degrees(8), settings.options        # {"dp": 1, ..., "sp": 4, "tp": 2}, {"team_size": 2}

The run specification's parallel section (`jaxring.run.schema.ParallelSection`: these settings and how they are
chosen), the planner's candidates (`jaxring.planner.space.Candidate`) and `ParallelPlan` hold this type as it
is. A field's default, help and choices are its flag's (`jaxring.core.settings.setting`); None means "derived":
a degree of 1 (all of them None: sp takes every device), the attention from sp (`attention_for`), the tensor
method and ZeRO stage as `ParallelPlan` resolves them.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from jaxring.core.mesh import MESH_AXES
from jaxring.core.settings import setting
from jaxring.kernels.block_compute import BLOCK_OPS
from jaxring.kernels.layout import LAYOUTS
from jaxring.parallel.catalog import pipeline_schedules, sequence_strategies, tensor_methods

__all__ = ["DEGREES", "FIELDS", "ParallelSettings", "StrategyOptions", "read_by_name"]


class StrategyOptions(Mapping):
    """The chosen registry entries' own options, {name: value}: immutable and hashable, sorted by name; a None
    value is an option not set and is left out."""

    __slots__ = ("_items", "_values")

    def __init__(self, options: Mapping | Iterable[tuple[str, Any]] = ()):
        pairs = options.items() if isinstance(options, Mapping) else options
        self._items = tuple(sorted((k, v) for k, v in pairs if v is not None))
        self._values = dict(self._items)

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StrategyOptions):
            return self._items == other._items
        return isinstance(other, Mapping) and self._values == dict(other.items())

    def __repr__(self) -> str:
        return repr(self._values)

    def __reduce__(self):
        return StrategyOptions, (self._items,)


# ------------------------------------------------------------------------------------------ choices
# the registry can gain entries after import (`registered(...)`, an installed package's): the choices are
# functions, read when a setting is checked or the parser is built


def _attentions() -> tuple[str, ...]:
    return tuple(sequence_strategies())


def _tensor_methods() -> tuple[str, ...]:
    return tuple(n for n in tensor_methods() if n != "none")


def _schedules() -> tuple[str, ...]:
    return tuple(pipeline_schedules())


@dataclasses.dataclass(frozen=True)
class ParallelSettings:
    """The mesh (degrees multiply to the device count) and the strategy for each axis; the chosen strategy's,
    tensor method's and schedule's own options are in the "strategy options" group."""

    dp: int | None = setting(None, "data-parallel degree (default 1)", rule="int>=1")
    fsdp: int | None = setting(
        None, "data-parallel degree with parameters sharded (ZeRO-3 by default; default 1)", rule="int>=1"
    )
    pp: int | None = setting(None, "pipeline-parallel degree (default 1)", rule="int>=1")
    tp: int | None = setting(None, "tensor-parallel degree (default 1)", rule="int>=1")
    sp: int | None = setting(
        None, "sequence/context-parallel degree (default with no degree given: every device)", rule="int>=1"
    )
    ep: int | None = setting(
        None, "expert-parallel degree, data parallel outside MoE layers (default 1)", rule="int>=1"
    )
    attention: str | None = setting(
        None, "sequence strategy over sp (default: ring when sp > 1)", choices=_attentions, entries=sequence_strategies
    )
    layout: str | None = setting(None, "token layout over sp (default: the strategy's)", choices=LAYOUTS)
    tensor_parallel: str | None = setting(
        None,
        "tensor method over tp (default: megatron when tp > 1)",
        choices=_tensor_methods,
        entries=tensor_methods,
    )
    zero: int | None = setting(
        None,
        "ZeRO stage over the data and sequence axes: 0 replicated, 1 optimizer state sharded, 2 gradients too, "
        "3 parameters too (default: 3 with fsdp > 1, else 0)",
        choices=(0, 1, 2, 3),
    )
    pipeline_schedule: str = setting(
        "1f1b", "pipeline schedule (pp > 1)", choices=_schedules, entries=pipeline_schedules
    )
    microbatches: int | None = setting(None, "pipeline micro-batches per step (pp > 1; default 2·pp)", rule="int>=1")
    block_ops: str = setting("auto", "attention's per-block compute", choices=BLOCK_OPS)
    options: StrategyOptions = setting(
        StrategyOptions(), "options of the chosen strategy, tensor method and schedule (registry)"
    )

    def __post_init__(self):
        if not isinstance(self.options, StrategyOptions):
            object.__setattr__(self, "options", StrategyOptions(self.options))

    @classmethod
    def of(cls, **settings) -> ParallelSettings:
        """The settings by flat names: the fields, and any other name as a registry entry's option
        (ParallelSettings.of(sp=8, attention="wallfacer", team_size=2); `options=` a mapping of them too)."""
        fields = {k: v for k, v in settings.items() if k in FIELDS}
        options = {k: v for k, v in settings.items() if k not in FIELDS and k != "options"}
        return cls(**fields, options={**settings.get("options", {}), **options})

    def degrees(self, device_count: int | None = None) -> dict[str, int]:
        """Mesh degrees with the defaults filled in: 1, or with none given, sp = device_count."""
        given = {a: getattr(self, a) for a in DEGREES}
        if all(v is None for v in given.values()) and device_count is not None:
            given["sp"] = device_count
        return {a: 1 if v is None else v for a, v in given.items()}

    def attention_for(self, sp: int) -> str:
        """The sequence strategy: as given, else ring when sp > 1, else dense."""
        if self.attention is not None:
            return self.attention
        return "ring" if sp > 1 else "dense"

    def option(self, name: str, default: object = None) -> object:
        """The value of an entry's option (default when not set)."""
        return self.options.get(name, default)


# the field names (a name outside them is an entry's option), and the mesh degrees in the order of their flags
FIELDS = frozenset(f.name for f in dataclasses.fields(ParallelSettings)) - {"options"}
DEGREES = tuple(f.name for f in dataclasses.fields(ParallelSettings) if f.name in MESH_AXES)


def read_by_name(cls: type, holder: str, names: Iterable[str]) -> None:
    """Gives `cls` a read-only property per name that reads it from the settings its instances hold in `holder`
    (`plan.attention` is `plan.settings.attention`): the names are the settings' own, declared once."""
    for name in names:
        setattr(cls, name, property(operator.attrgetter(f"{holder}.{name}"), doc=f"`{holder}.{name}`"))
