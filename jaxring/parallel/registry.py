"""The one registry of parallel strategies: sequence strategies over `sp`, tensor methods over `tp`, pipeline
schedules over `pp`. A leaf: the entry types, the tables, `register` and the lookups, importing no module of
the project. Each strategy's own file defines its entry (`STRATEGY`, `METHOD`, `SCHEDULES`); the catalog
(`jaxring/parallel/catalog.py`) registers jaxring's own and those of the `jaxring.parallel` entry-point group,
and code above the parallel layer looks entries up through the catalog.

Adding a sequence strategy is one file that defines

    STRATEGY = SequenceStrategy("mine", "what it is", attend=mine_attention, cost=mine_cost,
                                options=(Option("chunks", "...", check_chunks, default=2),))

plus its line in the catalog (or, from another package, an entry point in the group `jaxring.parallel`).
Its options are then settings of the run specification (`jaxring.run.schema`): flags of `train.py`, keys of
its YAML, keywords of `jaxring.make_plan` and of `sharded_attention`; the planner (`jaxring.planner`)
searches the values `Option.search` lists and prices the entry with its own `cost`.

A sequence strategy entry:
  attend(q, k, v, segment_ids=None, *, axis_name, layout, causal, sm_scale, block_ops, window=None, **options)
      -> out: the local attention ([batch, n, heads, head_dim] shards, n = seq / sp, in `layout`) inside a
      shard_map, over the mesh axes `axis_name` (the plan's `seq_axes`); `window` is passed only when set;
  layouts and the default layout for causal attention (non-causal attention needs no balance: contiguous);
  options, each with its check, default and the values the planner tries;
  view(mesh, options, axis) -> (mesh, seq_axes): the devices of `sp` seen as the factored axes the strategy
      needs (WallFacer's teams and sub-rings, USP's ring × Ulysses), the same devices in every case;
  check_heads(q_heads, kv_heads, sp, options): its head rule (Ulysses splits heads over sp);
  capabilities: GQA without repeating K/V, segment ids, per-block compute (`block_ops`);
  cost(shape, options) -> `jaxring.parallel.cost_terms.AttentionCost`: bytes per collective and memory per layer.
A tensor method is a `jaxring.parallel.tensor.contract.TensorMethod` (its layers, layouts, checks and cost). A pipeline
schedule entry builds its table (`jaxring.parallel.pipeline.schedules`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = [
    "HasOptions",
    "Option",
    "PipelineSchedule",
    "SequenceStrategy",
    "all_options",
    "known_layouts",
    "option_owners",
    "pipeline_schedule",
    "pipeline_schedules",
    "register",
    "registered",
    "resolve_options",
    "sequence_strategies",
    "sequence_strategy",
    "tensor_method",
    "tensor_methods",
]


@dataclasses.dataclass(frozen=True)
class Option:
    """An entry's own setting: its name (the spec's flat name; the flag is --NAME-WITH-DASHES), its help,
    check(value, degree) (degree: sp for a sequence strategy, tp for a tensor method, pp for a schedule),
    whether it must be given, its default, its type and choices, and `search(degree)`: the values the
    planner tries (None: only the default)."""

    name: str
    help: str
    check: Callable[[Any, int], None]
    required: bool = False
    default: Any = None
    type: type = int
    choices: tuple | None = None
    search: Callable[[int], Iterable] | None = None


class HasOptions:
    """An entry's options: checking them, filling in defaults, and the grid the planner searches. Entries
    have `name`, `kind` and `options` (a tuple of Option)."""

    name: str
    kind = "entry"
    options: tuple[Option, ...] = ()

    def option_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.options)

    def resolve_options(self, given: dict, degree: int, *, strict: bool = True) -> dict:
        """Its options with defaults filled in, after checking their values; `strict`: a name it does not
        take is an error."""
        unknown = set(given) - set(self.option_names())
        if strict and unknown:
            takes = ", ".join(self.option_names()) or "no options"
            raise ValueError(
                f"{self.kind} {self.name!r} takes no option {', '.join(sorted(unknown))} (it takes {takes})"
            )
        options = {}
        for o in self.options:
            value = given.get(o.name, o.default)
            if value is None:
                if o.required:
                    raise ValueError(f"{self.kind} {self.name!r} needs {o.name} ({o.help})")
                continue
            if o.choices is not None and value not in o.choices:
                raise ValueError(f"{o.name} {value!r} is not one of {', '.join(map(str, o.choices))}")
            o.check(value, degree)
            options[o.name] = value
        return options

    def changed_options(self, given: dict) -> dict:
        """The entry's options in `given` whose values differ from their defaults, in the entry's order (what a
        plan's description shows)."""
        return {o.name: given[o.name] for o in self.options if given.get(o.name, o.default) != o.default}

    def option_grid(self, degree: int) -> list[dict]:
        """Every combination of the values the planner tries for this entry's options at `degree`."""
        grid = [{}]
        for o in self.options:
            values = [v for v in (o.search(degree) if o.search is not None else [o.default]) if v is not None]
            if not values:
                if o.required:
                    return []
                continue
            grid = [{**g, o.name: v} for g in grid for v in values]
        return grid


@dataclasses.dataclass(frozen=True)
class SequenceStrategy(HasOptions):
    """A sequence strategy over `sp` (its fields: see the module docstring)."""

    name: str
    summary: str
    attend: Callable | None = None  # None: "dense" (no sequence parallelism)
    # (options) -> True when `attend_projected` should run the layer's projections inside the strategy
    projects: Callable[[dict], bool] | None = None
    attend_projected: Callable | None = None  # (project, x, rope_positions, segment_ids, *, heads, ...) -> out
    # (options) -> G, the chunks of heads `attend_projected` calls `project` for (None: 1)
    projected_chunks: Callable[[dict], int] | None = None
    default_layout: str = "zigzag"  # for causal attention
    layouts: tuple[str, ...] = ("contiguous", "zigzag", "striped")
    view: Callable[[Mesh, dict, str], tuple[Mesh, tuple[str, ...]]] | None = None
    check_heads: Callable[[int, int, int, dict], None] | None = None
    options: tuple[Option, ...] = ()
    uses_block_ops: bool = True  # takes `block_ops` (jnp / Pallas per-block compute)
    gqa: bool = True  # K/V with fewer heads than Q, without repeating them
    segment_ids: bool = True  # packed sequences (tokens attend within their segment)
    cost: Callable | None = (
        None  # (jaxring.parallel.cost_terms.AttentionShape, options) -> jaxring.parallel.cost_terms.AttentionCost
    )

    kind = "strategy"

    def layout_for(self, layout: str | None, causal: bool) -> str:
        """The token layout to run: `layout` as given (it must be one the strategy takes), else its default
        for causal attention, contiguous for non-causal attention."""
        if layout is None:
            return self.default_layout if causal else "contiguous"
        if layout not in self.layouts:
            known = known_layouts()
            if layout not in known:
                raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(known)}")
            raise ValueError(
                f"layout {layout!r} is not supported by {self.name}; expected one of {', '.join(self.layouts)}"
            )
        return layout

    def seq_view(self, mesh: Mesh, options: dict, axis: str = "sp") -> tuple[Mesh, tuple[str, ...]]:
        """(mesh, sequence axes): `axis` factored as the strategy needs (unchanged for most)."""
        if self.view is None:
            return mesh, (axis,)
        return self.view(mesh, options, axis)


@dataclasses.dataclass(frozen=True)
class PipelineSchedule(HasOptions):
    """A pipeline schedule: its per-stage order of actions (`jaxring.parallel.pipeline.schedules`), options and rules."""

    name: str
    summary: str
    build: Callable | None = None  # (stage, p, m, v) -> that stage's order of (kind, microbatch, chunk)
    options: tuple[Option, ...] = ()
    check: Callable | None = None  # (p, m, **options): rules that involve the micro-batches
    kind = "pipeline schedule"


_SEQUENCE: dict[str, SequenceStrategy] = {}
_TENSOR: dict[str, Any] = {}
_SCHEDULES: dict[str, PipelineSchedule] = {}


def _table(entry: HasOptions) -> tuple[dict, str]:
    """The table an entry goes in, and what its kind is called in errors."""
    if isinstance(entry, SequenceStrategy):
        return _SEQUENCE, "sequence strategy"
    if isinstance(entry, PipelineSchedule):
        return _SCHEDULES, "pipeline schedule"
    if isinstance(entry, HasOptions):
        return _TENSOR, "tensor method"
    raise TypeError(f"{entry!r} is not a registry entry (a SequenceStrategy, a TensorMethod or a PipelineSchedule)")


def register(entry: HasOptions) -> HasOptions:
    """Adds `entry` (a SequenceStrategy, a `jaxring.parallel.tensor.contract.TensorMethod` or a
    PipelineSchedule) to its table; registering the same entry again is a no-op, another one of the same name
    an error."""
    table, kind = _table(entry)
    if not entry.name or not isinstance(entry.name, str):
        raise ValueError(f"a {kind} needs a name, got {entry.name!r}")
    old = table.get(entry.name)
    if old is not None and old is not entry:
        raise ValueError(f"{kind} {entry.name!r} is already registered")
    table[entry.name] = entry
    return entry


@contextlib.contextmanager
def registered(entry: HasOptions) -> Iterator[Any]:
    """Registers `entry` (a SequenceStrategy, TensorMethod or PipelineSchedule) for the `with` block only, then
    removes it: an experiment or a test that must leave the registry as it found it."""
    table, _ = _table(entry)
    was_registered = table.get(entry.name) is entry
    register(entry)
    try:
        yield entry
    finally:
        if not was_registered and table.get(entry.name) is entry:
            del table[entry.name]


def sequence_strategies() -> dict[str, SequenceStrategy]:
    return dict(_SEQUENCE)


def tensor_methods() -> dict[str, Any]:
    """Every tensor method by name, "none" (no tensor parallelism) included."""
    return dict(_TENSOR)


def pipeline_schedules() -> dict[str, PipelineSchedule]:
    return dict(_SCHEDULES)


def _lookup(table: dict, name: str, what: str, hidden: tuple[str, ...] = ()):
    if name not in table:
        names = ", ".join(n for n in table if n not in hidden)
        raise ValueError(f"unknown {what} {name!r}; expected one of {names}")
    return table[name]


def sequence_strategy(name: str) -> SequenceStrategy:
    return _lookup(_SEQUENCE, name, "attention strategy")


def tensor_method(name: str | None) -> Any:
    """The `jaxring.parallel.tensor.contract.TensorMethod` registered as `name` (None: no tensor parallelism)."""
    return _lookup(_TENSOR, "none" if name is None else name, "tensor parallelism", hidden=("none",))


def pipeline_schedule(name: str) -> PipelineSchedule:
    return _lookup(_SCHEDULES, name, "pipeline schedule")


def known_layouts() -> tuple[str, ...]:
    """The token layouts some registered sequence strategy takes (ring takes every one of
    `jaxring.kernels.layout.LAYOUTS`), in the order the strategies list them."""
    return tuple(dict.fromkeys(layout for entry in _SEQUENCE.values() for layout in entry.layouts))


def all_options() -> dict[str, tuple[Option, tuple[str, ...]]]:
    """Every option of every entry by name: (the first entry's Option, the entries that take it)."""
    out: dict[str, tuple[Option, tuple[str, ...]]] = {}
    for table in (sequence_strategies(), tensor_methods(), pipeline_schedules()):
        for entry in table.values():
            for option in entry.options:
                first, users = out.get(option.name, (option, ()))
                out[option.name] = (first, (*users, entry.name))
    return out


def option_owners(name: str) -> tuple[str, ...]:
    return all_options().get(name, (None, ()))[1]


def resolve_options(
    attention: str, tensor_parallel: str | None, schedule: str | None, given: dict, *, sp: int, tp: int, pp: int
) -> dict:
    """The options of the chosen strategy (at sp), tensor method (at tp) and schedule (at pp > 1), defaults
    filled in. An option that none of them takes is a one-line error naming the entries that do."""
    entries = [(sequence_strategy(attention), sp), (tensor_method(tensor_parallel), tp)]
    if pp > 1 and schedule is not None:
        entries.append((pipeline_schedule(schedule), pp))
    taken = {o.name for e, _ in entries for o in e.options}
    for name, value in given.items():
        if name not in taken and value is not None:
            owners = option_owners(name)
            chosen = f"attention {attention!r}" + (f", tensor parallelism {tensor_parallel!r}" if tp > 1 else "")
            if pp > 1:
                chosen += f", pipeline schedule {schedule!r}"
            if owners:
                raise ValueError(f"{name}={value!r} is an option of {', '.join(owners)}, not of the chosen {chosen}")
            raise ValueError(f"unknown option {name!r}")
    out = {}
    for entry, degree in entries:
        out.update(entry.resolve_options({k: v for k, v in given.items() if v is not None}, degree, strict=False))
    return out
