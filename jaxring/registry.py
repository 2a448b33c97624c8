"""The one registry of parallel strategies: sequence-parallel attention over `sp`, tensor methods over `tp`.

Adding a strategy is one file (its local function, run inside a `shard_map` the caller owns) plus one entry
here. `ParallelPlan`, `sharded_attention`, `train.py`'s choices, `describe()` and the error messages all read
these tables.

A sequence strategy entry gives:
  attend(q, k, v, segment_ids, *, seq_axes, layout, causal, sm_scale, block_ops, **options) -> out
      the local attention ([batch, n, heads, head_dim] shards, n = seq / sp, in `layout`);
  layouts and the default layout for causal attention (non-causal attention needs no balance: contiguous);
  options with their validation (`team_size`, `ulysses_size`, `placement`);
  view(mesh, options) -> (mesh, seq_axes): the devices of `sp` seen as the factored axes the strategy
      needs (WallFacer's teams and sub-rings, USP's ring × Ulysses), the same devices in every case;
  check_heads(q_heads, kv_heads, sp, options): the head rule (Ulysses splits heads over sp).
Tensor methods share the `TensorMethod` contract of `jaxring/tensor/contract.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from jaxring.attention.allgather import allgather_attention
from jaxring.attention.ring import ring_attention
from jaxring.attention.rsa import rsa_attention
from jaxring.attention.ulysses import check_heads_split, ulysses_attention, usp_attention
from jaxring.attention.wallfacer import (
    PLACEMENTS,
    WF_AXES,
    WF_LAYOUTS,
    check_placement,
    check_team_size,
    wallfacer_attention,
    wallfacer_mesh,
)
from jaxring.mesh import factored_mesh

ALL_LAYOUTS = ("contiguous", "zigzag", "striped")
USP_AXES = ("usp_ring", "usp_ulysses")


@dataclasses.dataclass(frozen=True)
class Option:
    """A strategy option: its name, its check(value, sp), whether it must be given, its default, and how a
    command line takes it (`type`, `choices`: train.py builds its flags from these)."""

    name: str
    help: str
    check: Callable[[Any, int], None]
    required: bool = False
    default: Any = None
    type: type = int
    choices: tuple | None = None


@dataclasses.dataclass(frozen=True)
class SequenceStrategy:
    name: str
    summary: str
    attend: Callable | None  # None: "dense" (no sequence parallelism)
    default_layout: str = "zigzag"  # for causal attention
    layouts: tuple[str, ...] = ALL_LAYOUTS
    options: tuple[Option, ...] = ()
    view: Callable[[Mesh, dict, str], tuple[Mesh, tuple[str, ...]]] | None = None
    check_heads: Callable[[int, int, int, dict], None] | None = None
    uses_block_ops: bool = True  # takes `block_ops` (jnp / Pallas per-block compute)

    def option_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.options)

    def resolve_options(self, given: dict, sp: int) -> dict:
        """The full option dict (defaults filled in), after checking names and values."""
        unknown = set(given) - set(self.option_names())
        if unknown:
            takes = ", ".join(self.option_names()) or "no options"
            raise ValueError(f"strategy {self.name!r} takes no option {', '.join(sorted(unknown))} (it takes {takes})")
        options = {}
        for o in self.options:
            value = given.get(o.name, o.default)
            if value is None:
                if o.required:
                    raise ValueError(f"attention {self.name!r} needs {o.name} ({o.help})")
                continue
            o.check(value, sp)
            options[o.name] = value
        return options

    def layout_for(self, layout: str | None, causal: bool) -> str:
        if layout is None:
            return self.default_layout if causal else "contiguous"
        if layout not in ALL_LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(ALL_LAYOUTS)}")
        if layout not in self.layouts:
            raise ValueError(
                f"layout {layout!r} is not supported by {self.name}; expected one of {', '.join(self.layouts)}"
            )
        return layout

    def seq_view(self, mesh: Mesh, options: dict, axis: str = "sp") -> tuple[Mesh, tuple[str, ...]]:
        """(mesh, sequence axes): `axis` factored as the strategy needs (unchanged for most)."""
        if self.view is None:
            return mesh, (axis,)
        return self.view(mesh, options, axis)


# ------------------------------------------------------------------------------------ option checks


def _check_ulysses_size(u, sp: int) -> None:
    if isinstance(u, bool) or not isinstance(u, int) or u < 1 or sp % u:
        raise ValueError(f"ulysses_size U={u!r} must be a positive integer dividing sp = {sp}")


def _check_team_size(c, sp: int) -> None:
    check_team_size(c, sp)


def _check_placement(placement, sp: int) -> None:
    del sp
    check_placement(placement)


def _ulysses_heads(q_heads: int, kv_heads: int, sp: int, options: dict) -> None:
    del kv_heads, options
    check_heads_split(q_heads, sp)


def _usp_heads(q_heads: int, kv_heads: int, sp: int, options: dict) -> None:
    del kv_heads, sp
    check_heads_split(q_heads, options["ulysses_size"], "ulysses_size")


# ------------------------------------------------------------------------------------ factored views


def _usp_view(mesh: Mesh, options: dict, axis: str):
    sp, u = mesh.shape[axis], options["ulysses_size"]
    return factored_mesh(mesh, axis, USP_AXES, (sp // u, u)), USP_AXES


def _wallfacer_view(mesh: Mesh, options: dict, axis: str):
    return wallfacer_mesh(mesh, options["team_size"], options.get("placement", "team_inner"), axis), WF_AXES


# ------------------------------------------------------------------------------------ local functions
# Every entry takes the same keywords; each adapts them to its strategy's local function.


def _ring(q, k, v, segment_ids, *, seq_axes, layout, causal, sm_scale, block_ops):
    return ring_attention(
        q, k, v, segment_ids, axis_name=seq_axes, layout=layout, causal=causal, sm_scale=sm_scale, block_ops=block_ops
    )


def _rsa(q, k, v, segment_ids, *, seq_axes, layout, causal, sm_scale, block_ops):
    del block_ops  # RSA materialises its score rows: no per-block compute
    return rsa_attention(q, k, v, segment_ids, axis_name=seq_axes, layout=layout, causal=causal, sm_scale=sm_scale)


def _ulysses(q, k, v, segment_ids, *, seq_axes, layout, causal, sm_scale, block_ops):
    return ulysses_attention(
        q, k, v, segment_ids, axis_name=seq_axes, layout=layout, causal=causal, sm_scale=sm_scale, block_ops=block_ops
    )


def _allgather(q, k, v, segment_ids, *, seq_axes, layout, causal, sm_scale, block_ops):
    return allgather_attention(
        q, k, v, segment_ids, axis_name=seq_axes, layout=layout, causal=causal, sm_scale=sm_scale, block_ops=block_ops
    )


def _usp(q, k, v, segment_ids, *, seq_axes, layout, causal, sm_scale, block_ops, ulysses_size):
    del ulysses_size  # the factored view carries it
    ring_axis, ulysses_axis = seq_axes
    return usp_attention(
        q,
        k,
        v,
        segment_ids,
        ring_axis=ring_axis,
        ulysses_axis=ulysses_axis,
        layout=layout,
        causal=causal,
        sm_scale=sm_scale,
        block_ops=block_ops,
    )


def _wallfacer(
    q, k, v, segment_ids, *, seq_axes, layout, causal, sm_scale, block_ops, team_size, placement="team_inner"
):
    del seq_axes, placement  # WF_AXES, laid out by the factored view
    return wallfacer_attention(
        q, k, v, segment_ids, team_size=team_size, causal=causal, sm_scale=sm_scale, layout=layout, block_ops=block_ops
    )


SEQUENCE_STRATEGIES: dict[str, SequenceStrategy] = {
    s.name: s
    for s in (
        SequenceStrategy(
            "dense",
            "no sequence parallelism: every device attends its own whole sequences",
            None,
            default_layout="contiguous",
            layouts=("contiguous",),
        ),
        SequenceStrategy(
            "ring", "ring attention: K/V blocks circulate with ppermute, online softmax (Playbook)", _ring
        ),
        SequenceStrategy(
            "rsa",
            "Ring Self-Attention: K then V rings over materialised score rows (Li et al.)",
            _rsa,
            default_layout="contiguous",
            uses_block_ops=False,
        ),
        SequenceStrategy(
            "ulysses",
            "DeepSpeed-Ulysses: all-to-all sequence <-> heads around local attention",
            _ulysses,
            default_layout="contiguous",
            check_heads=_ulysses_heads,
        ),
        SequenceStrategy(
            "wallfacer",
            "WallFacer: teams of C devices, C² sub-rings, 1/C of the ring's P2P volume",
            _wallfacer,
            layouts=WF_LAYOUTS,
            view=_wallfacer_view,
            options=(
                Option("team_size", "--team-size C, C² dividing sp", _check_team_size, required=True),
                Option(
                    "placement",
                    "which devices are neighbours: team members or sub-ring members",
                    _check_placement,
                    default="team_inner",
                    type=str,
                    choices=PLACEMENTS,
                ),
            ),
        ),
        SequenceStrategy(
            "allgather", "all-gather context parallelism: gather K/V, reduce-scatter dK/dV (Llama 3)", _allgather
        ),
        SequenceStrategy(
            "usp",
            "USP: Ulysses over U devices × ring over sp / U",
            _usp,
            view=_usp_view,
            check_heads=_usp_heads,
            options=(Option("ulysses_size", "--ulysses-size U, U dividing sp", _check_ulysses_size, required=True),),
        ),
    )
}


def strategy_options() -> dict[str, tuple[Option, tuple[str, ...]]]:
    """Every strategy option by name, with the strategies that take it (for command lines)."""
    out: dict[str, tuple[Option, tuple[str, ...]]] = {}
    for strategy in SEQUENCE_STRATEGIES.values():
        for option in strategy.options:
            first, users = out.get(option.name, (option, ()))
            out[option.name] = (first, users + (strategy.name,))
    return out


def sequence_strategy(name: str) -> SequenceStrategy:
    if name not in SEQUENCE_STRATEGIES:
        raise ValueError(f"unknown attention strategy {name!r}; expected one of {', '.join(SEQUENCE_STRATEGIES)}")
    return SEQUENCE_STRATEGIES[name]


def tensor_method(name: str | None):
    """The TensorMethod registered as `name` (None: no tensor parallelism)."""
    from jaxring.tensor import TENSOR_METHODS

    key = "none" if name is None else name
    if key not in TENSOR_METHODS:
        raise ValueError(
            f"unknown tensor parallelism {name!r}; expected one of "
            f"{', '.join(n for n in TENSOR_METHODS if n != 'none')}"
        )
    return TENSOR_METHODS[key]
