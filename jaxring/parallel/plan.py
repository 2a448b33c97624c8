"""A parallel plan: which strategy runs each mesh axis, how arrays are laid out, and the ZeRO stage.

The train step is ONE `shard_map` over the plan's mesh; every layer is a local function inside it. The plan
takes the run's parallel settings (`jaxring/parallel/settings.py`: one type, which the run specification and the
planner hold too) and names from them, in the registry (looked up through `jaxring/parallel/catalog.py`):

- `attention`: the sequence strategy over `sp` (default: "ring" when sp > 1, "dense" when sp = 1), with its
  options and `layout`;
- `tensor_parallel`: the tensor method over `tp` (none when tp = 1);
- `zero`: the ZeRO stage over the replica axes (see `jaxring/parallel/zero.py`): 0 replicated, 1 optimizer state
  sharded, 2 gradients too, 3 parameters too (the default when fsdp > 1);
- `pipeline_schedule`, `microbatches`: the schedule over `pp` (see `jaxring/parallel/pipeline/`): the layer stack
  splits over pp, embedding on the first stage and head on the last;
- `options`: the chosen entries' own options (e.g. a strategy's `team_size`, a schedule's
  `virtual_stages`), checked and completed by their registry entries.

`plan.mesh` is the user's mesh (`jaxring.make_mesh`); `plan.run_mesh` is the same devices with `sp` factored
as the strategy needs (WallFacer's teams and sub-rings, USP's ring × Ulysses) and `tp` as the method needs
(Optimus's q×q grid). Axis names inside the step: `batch_axes` (dp, fsdp, ep: the data-parallel ones),
`seq_axes` (the sequence strategy's), `tensor_axes` (the method's); `replica_axes` = batch + sequence axes,
over which a weight is replicated and its gradient reduced.

The causal load-balance layout is applied once on the data side (`layout_tokens`): tokens, targets and
positions are permuted together, and the model never permutes per layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import DATA_AXES, mesh_axis_size, spec_entry
from jaxring.core.tiling import tile_count
from jaxring.kernels.block_compute import local_attention
from jaxring.kernels.layout import check_seq_len, layout_permutation
from jaxring.kernels.masking import check_window
from jaxring.parallel.catalog import (
    pipeline_schedule,
    resolve_options,
    sequence_strategies,
    sequence_strategy,
    tensor_method,
)
from jaxring.parallel.pipeline.schedules import Schedule, make_schedule
from jaxring.parallel.settings import DEGREES, ParallelSettings, read_by_name

if TYPE_CHECKING:
    from jaxring.parallel.registry import HasOptions, SequenceStrategy
    from jaxring.parallel.tensor.contract import TensorMethod

ZERO_STAGES = (0, 1, 2, 3)

# the settings a plan reads by name from `plan.settings` (its degrees are the mesh's: properties below)
SETTING_FIELDS = frozenset(f.name for f in dataclasses.fields(ParallelSettings)) - set(DEGREES)


# the tensor method over tp > 1 when none is named
DEFAULT_TENSOR_PARALLEL = "megatron"


class ParallelPlan:
    """How a model runs on `mesh` (a mesh from `jaxring.make_mesh`); immutable.

    ParallelPlan(mesh, settings) takes the parallel settings as one value (`jaxring.parallel.settings`), or by
    their flat names: ParallelPlan(mesh, attention="wallfacer", team_size=2). Their degrees, where given, must be
    the mesh's. `plan.settings` holds them resolved (degrees, attention, tensor method, ZeRO stage, the entries'
    options with defaults), and `plan.attention`, `plan.options`, ... read them. `loss_tile`, `mlp_tile`: the
    memory settings' tiles (rows per tile of the head's loss, of the MLP) that the layers read from the plan."""

    def __init__(
        self,
        mesh: Mesh,
        settings: ParallelSettings | None = None,
        /,
        *,
        loss_tile: int | None = None,
        mlp_tile: int | None = None,
        **flat,
    ):
        if settings is None:
            settings = ParallelSettings.of(**flat)
        elif flat:
            raise TypeError(f"ParallelPlan takes its settings as one value or by name, not both ({', '.join(flat)})")
        self.mesh, self.loss_tile, self.mlp_tile = mesh, loss_tile, mlp_tile
        for axis, given in zip(DEGREES, (getattr(settings, a) for a in DEGREES)):
            if given is not None and given != self._size(axis):
                raise ValueError(
                    f"{axis}={given} in the parallel settings, but the mesh's {axis} is {self._size(axis)}"
                )
        attention, tensor_parallel, zero = settings.attention_for(self.sp), settings.tensor_parallel, settings.zero
        self.settings = settings  # checked and resolved below
        strategy = sequence_strategy(attention)
        if self.sp > 1 and attention == "dense":
            others = ", ".join(s for s in sequence_strategies() if s != "dense")
            raise ValueError(
                f"sp = {self.sp} splits the sequence, but attention 'dense' does not; pick one of {others}"
            )
        if self.sp == 1 and attention != "dense":
            raise ValueError(f"attention {attention!r} splits the sequence over sp, but sp = 1")
        if self.tp > 1 and tensor_parallel is None:
            tensor_parallel = DEFAULT_TENSOR_PARALLEL
        method = tensor_method(tensor_parallel)
        if tensor_parallel is not None and self.tp == 1:
            raise ValueError(f"tensor parallelism {tensor_parallel!r} needs tp > 1, got tp = 1")
        if self.pp == 1 and settings.microbatches is not None:
            raise ValueError(f"microbatches={settings.microbatches!r} sets the pipeline schedule, but pp = 1")
        options = resolve_options(
            attention, tensor_parallel, settings.pipeline_schedule, settings.options, sp=self.sp, tp=self.tp, pp=self.pp
        )
        if settings.layout is not None:
            strategy.layout_for(settings.layout, causal=True)
        if zero is not None and (isinstance(zero, bool) or zero not in ZERO_STAGES):
            raise ValueError(f"zero stage {zero!r} must be one of {', '.join(map(str, ZERO_STAGES))}")
        self.settings = dataclasses.replace(
            settings,
            **{a: self._size(a) for a in DEGREES},
            attention=attention,
            tensor_parallel=tensor_parallel,
            zero=(3 if self.fsdp > 1 else 0) if zero is None else zero,
            options=options,
        )
        if self.sp > 1 and not method.sequence_parallel:
            raise ValueError(
                f"tensor parallelism {method.name!r} cannot run with sp = {self.sp}: {method.sequence_parallel_rule}"
            )
        method.check_mesh(self)
        if self.fsdp > 1 and self.zero_stage < 3:
            raise ValueError(
                f"--fsdp {self.fsdp} with --zero {self.zero_stage}: fsdp means the parameters are sharded (ZeRO-3); "
                f"use --dp {self.fsdp} for a data axis with ZeRO stage {self.zero_stage}, or leave --zero out"
            )
        if self.pp > 1:
            _ = self.schedule  # make_schedule's one-line errors (unknown schedule, m < pp, ...)
            if self.zero_stage == 2:
                raise ValueError(
                    "zero stage 2 does not combine with pp > 1: the pipeline accumulates each stage's gradient "
                    "over its micro-batches, so use --zero 1 (the same bytes: one reduce-scatter per step) or "
                    "--zero 3"
                )

    def __repr__(self) -> str:
        return f"ParallelPlan({self.describe()})"

    # ------------------------------------------------------------------ degrees
    def _size(self, axis: str) -> int:
        return mesh_axis_size(self.mesh, axis)

    @property
    def sp(self) -> int:
        return self._size("sp")

    @property
    def tp(self) -> int:
        return self._size("tp")

    @property
    def pp(self) -> int:
        return self._size("pp")

    @property
    def fsdp(self) -> int:
        return self._size("fsdp")

    @property
    def ep(self) -> int:
        return self._size("ep")

    @property
    def data_degree(self) -> int:
        return math.prod(self._size(a) for a in DATA_AXES)

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in force: as given, else 3 with fsdp > 1 (parameters sharded), else 0."""
        return self.settings.zero

    # ------------------------------------------------------------------ registry entries and their options
    @property
    def strategy(self) -> SequenceStrategy:
        return sequence_strategy(self.attention)

    @property
    def tensor(self) -> TensorMethod:
        """The TensorMethod (its `name` is "none" without tensor parallelism)."""
        return tensor_method(self.tensor_parallel)

    def _entry_options(self, entry: HasOptions) -> dict:
        return {k: v for k, v in self.options.items() if k in entry.option_names()}

    @property
    def strategy_options(self) -> dict:
        """The sequence strategy's options, defaults filled in."""
        return self._entry_options(self.strategy)

    @property
    def tensor_options(self) -> dict:
        return self._entry_options(self.tensor)

    @property
    def schedule_options(self) -> dict:
        return self._entry_options(pipeline_schedule(self.pipeline_schedule)) if self.pp > 1 else {}

    # ------------------------------------------------------------------ pipeline
    @functools.cached_property
    def schedule(self) -> Schedule | None:
        """The pipeline's table (`jaxring.parallel.pipeline.make_schedule`), None when pp = 1."""
        if self.pp == 1:
            return None
        m = 2 * self.pp if self.microbatches is None else self.microbatches
        return make_schedule(self.pipeline_schedule, self.pp, m, **self.schedule_options)

    @property
    def virtual_stages(self) -> int:
        """Layer chunks per pipeline stage (1 unless the schedule interleaves them)."""
        return self.schedule.virtual_stages if self.pp > 1 else 1

    def check_layers(self, num_layers: int) -> None:
        """The layer stack splits into pp · virtual_stages equal chunks."""
        chunks = self.pp * self.virtual_stages
        if self.pp > 1 and num_layers % chunks:
            v = f" × virtual_stages {self.virtual_stages}" if self.virtual_stages > 1 else ""
            raise ValueError(
                f"num_layers {num_layers} is not divisible by pp {self.pp}{v} = {chunks} (each pipeline chunk "
                f"holds the same number of layers)"
            )

    def layer_order(self, num_layers: int) -> np.ndarray | None:
        """Where each stored layer comes from: None (natural order), or for interleaved stages the index map
        `stored = natural[order]` that puts pp rank s's chunks (virtual stages c·pp + s) next to each other, so
        the stack splits over pp as P("pp")."""
        if self.pp == 1 or self.virtual_stages == 1:
            return None
        v, chunk = self.virtual_stages, num_layers // (self.pp * self.virtual_stages)
        return np.array(
            [(c * self.pp + s) * chunk + i for s in range(self.pp) for c in range(v) for i in range(chunk)],
            np.int32,
        )

    # ------------------------------------------------------------------ the run mesh and its axes
    @functools.cached_property
    def _view(self):
        mesh, seq_axes = self.mesh, ()
        if self.sp > 1:
            mesh, seq_axes = self.strategy.seq_view(mesh, self.strategy_options)
        return self.tensor.view(mesh), tuple(seq_axes)

    @property
    def run_mesh(self) -> Mesh:
        return self._view[0]

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Data-parallel axes of size > 1 (dp, fsdp, ep), outermost first."""
        return tuple(a for a in DATA_AXES if self._size(a) > 1)

    @property
    def seq_axes(self) -> tuple[str, ...]:
        """The run mesh's axes that split the sequence (empty when sp = 1)."""
        return self._view[1]

    @property
    def tensor_axes(self) -> tuple[str, ...]:
        return self.tensor.tensor_axes(self)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """Axes over which weights are replicated while the work is split: gradients are reduced over them,
        and ZeRO shards over them."""
        return self.batch_axes + self.seq_axes

    @property
    def seq_axis(self) -> str | tuple[str, ...] | None:
        """The sequence entry of a PartitionSpec (None when sp = 1)."""
        return spec_entry(self.seq_axes)

    def seq_layout(self, causal: bool = True) -> str:
        """The data-side token layout: zigzag balances causal work; contiguous where nothing is to balance."""
        return self.strategy.layout_for(self.layout, causal)

    # ------------------------------------------------------------------ the attention core (inside shard_map)
    def attend(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        token_order: jax.Array | None = None,
        *,
        causal: bool,
        window: int | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Local attention of q [b, n, hq, d], k/v [b, n, hkv, d] (this device's tokens, in the layout):
        the plan's sequence strategy over `seq_axes`, or flash attention when sp = 1.

        The causal mask (and a sliding window W: query i sees keys i - W < j <= i) is by the tokens' order in
        the row, never by RoPE positions (which restart in every packed document): at sp = 1 the layout is the
        identity and the order is `token_order` int [n] (default arange(n)); at sp > 1 the strategy derives
        each block's order from the layout. segment_ids int [b, n] (the token layout, like the tokens): a
        query sees only keys of its own document; 0 is padding (sees nothing, output 0). None: one document.
        """
        if self.sp == 1:
            order = jnp.arange(q.shape[1], dtype=jnp.int32) if token_order is None else token_order
            return local_attention(
                self.block_ops,
                q,
                k,
                v,
                causal=causal,
                q_positions=order,
                kv_positions=order,
                segment_ids=segment_ids,
                window=window,
            )
        check_window(window, causal)  # here, so that the error comes before any strategy's collectives
        windowed = {} if window is None else {"window": window}  # strategies registered without it still run
        return self.strategy.attend(
            q,
            k,
            v,
            segment_ids,
            axis_name=self.seq_axes,
            layout=self.seq_layout(causal),
            causal=causal,
            sm_scale=None,
            block_ops=self.block_ops,
            **self.strategy_options,
            **windowed,
        )

    @property
    def attends_projected(self) -> bool:
        """Whether the sequence strategy runs the attention layer's q/k/v projections itself, a chunk of heads at
        a time (`attend_projected`; UPipe's head chunks under Ulysses)."""
        s = self.strategy
        return self.sp > 1 and s.projects is not None and s.projects(self.strategy_options)

    @property
    def projected_chunks(self) -> int:
        """G, the head chunks `attend_projected` calls `project` for (1 unless `attends_projected`): the
        strategy's `projected_chunks` of its options."""
        chunks = self.strategy.projected_chunks
        return chunks(self.strategy_options) if self.attends_projected and chunks is not None else 1

    def attend_projected(
        self,
        project: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]],
        x: jax.Array,
        rope_positions: jax.Array,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        causal: bool,
        window: int | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """`attend` of the q, k, v that project(x, rope_positions, g) makes for head chunk g (q [b, n, heads/G,
        head_dim], k, v [b, n, kv_heads/G, head_dim]); x [b, n, hidden] local. Returns out [b, n, heads,
        head_dim]. Only when `attends_projected`."""
        check_window(window, causal)
        windowed = {} if window is None else {"window": window}
        return self.strategy.attend_projected(
            project,
            x,
            rope_positions,
            segment_ids,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            axis_name=self.seq_axes,
            layout=self.seq_layout(causal),
            causal=causal,
            block_ops=self.block_ops,
            **self.strategy_options,
            **windowed,
        )

    # ------------------------------------------------------------------ checks
    def check_batch(self, batch: int, what: str = "batch size") -> None:
        split = self.tensor.batch_split(self)
        m = self.schedule.num_microbatches if self.pp > 1 else 1
        degree = self.data_degree * split * m
        if batch % degree:
            extra = "" if split == 1 else f" × the {self.tensor.name} batch split {split}"
            extra += "" if m == 1 else f" × the pipeline's micro-batches {m}"
            fix = degree * max(1, round(batch / degree))
            raise ValueError(
                f"{what} {batch} is not divisible by the data-parallel degree dp*fsdp*ep{extra} = {degree}; "
                f"use a multiple of {degree} (e.g. {fix})"
            )

    def check_seq_len(self, seq_len: int, causal: bool = True) -> None:
        """seq must split over sp in the layout, and further as the tensor method needs."""
        if self.sp > 1:
            check_seq_len(seq_len, self.sp, self.seq_layout(causal))
        self.tensor.check_seq(self, seq_len)
        rows = self.tensor.local_rows(self, seq_len)
        tile_count(rows, self.loss_tile, "--loss-tile")
        tile_count(rows, self.mlp_tile, "--mlp-tile")

    def loss_tiles(self, x: jax.Array) -> int:
        """Tiles of the LM head's loss over the rows of the local residual stream x [b, rows, h] (1: untiled)."""
        return tile_count(x.shape[1], self.loss_tile, "--loss-tile")

    def mlp_tiles(self, x: jax.Array) -> int:
        return tile_count(x.shape[1], self.mlp_tile, "--mlp-tile")

    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """Heads after the tensor method's split must still suit the sequence strategy (Ulysses: divide sp)."""
        local_q = num_heads // max(self.tensor.head_split(self), 1)
        if self.sp > 1 and self.strategy.check_heads is not None:
            self.strategy.check_heads(local_q, num_kv_heads, self.sp, self.strategy_options)

    # ------------------------------------------------------------------ data side
    def token_permutation(self, seq_len: int, causal: bool = True) -> np.ndarray | None:
        """Index map applied once to tokens, targets and positions (None when the layout is the identity)."""
        layout = self.seq_layout(causal)
        if self.sp == 1 or layout == "contiguous":
            return None
        return layout_permutation(layout, seq_len, self.sp)

    def layout_tokens(self, *arrays: np.ndarray | jax.Array, causal: bool = True) -> tuple[tuple, np.ndarray]:
        """Permutes each [batch, seq, ...] array along seq into the plan's layout; returns the arrays and the
        positions int32 [seq] of the laid-out tokens (arange when no layout applies)."""
        seq_len = arrays[0].shape[1]
        perm = self.token_permutation(seq_len, causal)
        if perm is None:
            return arrays, np.arange(seq_len, dtype=np.int32)
        return tuple(np.asarray(a)[:, perm] for a in arrays), perm.astype(np.int32)

    # ------------------------------------------------------------------ specs and shardings
    def activation_spec(self) -> P:
        """[batch, seq, hidden] residual stream, as the tensor method lays it out."""
        return self.tensor.activation_spec(self)

    def token_spec(self) -> P:
        """[batch, seq] tokens, targets and positions."""
        return self.tensor.token_spec(self)

    def batch_spec(self, ndim: int = 1) -> P:
        """[batch, ...] arrays split over the data axes only (images, labels, per-sequence vectors)."""
        return P(spec_entry(self.batch_axes), *([None] * (ndim - 1)))

    def sharding(self, *spec) -> NamedSharding:
        if len(spec) == 1 and isinstance(spec[0], P):
            return NamedSharding(self.run_mesh, spec[0])
        return NamedSharding(self.run_mesh, P(*spec))

    def tokens_sharding(self) -> NamedSharding:
        return self.sharding(self.token_spec())

    def activation_sharding(self) -> NamedSharding:
        return self.sharding(self.activation_spec())

    def shard_map(self, fn: Callable, in_specs: Any, out_specs: Any) -> Callable:
        """`jax.shard_map(fn)` over the run mesh (check_vma on: gradient reductions follow the types)."""
        return jax.shard_map(fn, mesh=self.run_mesh, in_specs=in_specs, out_specs=out_specs)

    def describe(self) -> str:
        degrees = " × ".join(f"{a}={self.mesh.shape[a]}" for a in self.mesh.axis_names if self.mesh.shape[a] > 1)
        parts = [degrees or "1 device"]
        if self.sp > 1:
            opts = ", ".join(f"{k}={v}" for k, v in self.strategy_options.items())
            parts.append(f"attention={self.attention}" + (f" ({opts})" if opts else ""))
        if self.tensor_parallel:
            opts = ", ".join(f"{k}={v}" for k, v in self.tensor_options.items())
            parts.append(f"tensor={self.tensor_parallel}" + (f" ({opts})" if opts else ""))
        elif changed := self.tensor.changed_options(self.tensor_options):  # no tensor method: its options (sp's)
            parts.append(", ".join(f"{k}={v}" for k, v in changed.items()))
        if self.zero_stage:
            parts.append(f"zero={self.zero_stage}")
        if self.pp > 1:
            sched = self.schedule
            v = f", v={sched.virtual_stages}" if sched.virtual_stages > 1 else ""
            parts.append(f"pipeline={sched.name} (m={sched.num_microbatches}{v})")
        return ", ".join(parts)

    def attention_options(self) -> dict:
        """The options to pass to `sharded_attention` for this plan's strategy."""
        return self.strategy_options


# plan.attention, plan.layout, plan.options, ...: the resolved settings, read by their names
read_by_name(ParallelPlan, "settings", sorted(SETTING_FIELDS))
