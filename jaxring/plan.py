"""A parallel plan: which strategy runs each mesh axis, and where each logical axis lives.

Models name their axes logically (`batch`, `seq`, `embed`, `heads`, `kv_heads`, `mlp`, `vocab`); the plan
maps them onto the mesh and names the strategy for each parallel axis:

- `seq` on `sp` → `attention` in {ring, rsa, ulysses, wallfacer, allgather, usp} (with `layout`);
- the tensor dimensions on `tp` → `tensor_parallel` in {megatron, optimus, metp};
- `batch` on `dp` × `fsdp`; with fsdp > 1 parameters are also split over `fsdp` on their `embed` axis.

The causal load-balance layout is applied once on the data side (`layout_tokens`): tokens, targets and
positions are permuted together, and the model never permutes per layer.
"""
from __future__ import annotations

import dataclasses
import importlib
import math

import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring.attention.api import STRATEGIES
from jaxring.attention.layout import LAYOUTS, check_seq_len, layout_permutation
from jaxring.mesh import DATA_AXES

TENSOR_PARALLEL = ("megatron", "optimus", "metp")
# strategies whose natural layout is contiguous (every device sees the whole sequence, or every block)
_CONTIGUOUS_STRATEGIES = ("dense", "ulysses", "rsa")


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """How a model runs on `mesh` (a mesh from `jaxring.make_mesh`)."""
    mesh: Mesh
    attention: str = "dense"
    layout: str | None = None
    team_size: int | None = None
    ulysses_size: int | None = None
    tensor_parallel: str | None = None

    def __post_init__(self):
        if self.attention not in STRATEGIES:
            raise ValueError(f"unknown attention strategy {self.attention!r}; expected one of "
                             f"{', '.join(STRATEGIES)}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; expected one of {', '.join(LAYOUTS)}")
        if self.sp > 1 and self.attention == "dense":
            raise ValueError(f"sp = {self.sp} splits the sequence, but attention 'dense' does not; pick one of "
                             f"{', '.join(s for s in STRATEGIES if s != 'dense')}")
        if self.sp == 1 and self.attention != "dense":
            raise ValueError(f"attention {self.attention!r} splits the sequence over sp, but sp = 1")
        if self.attention == "wallfacer" and self.team_size is None:
            raise ValueError("attention 'wallfacer' needs a team size (--team-size C, C² dividing sp)")
        if self.attention == "usp" and self.ulysses_size is None:
            raise ValueError("attention 'usp' needs a Ulysses degree (--ulysses-size U, U dividing sp)")
        if self.tensor_parallel is not None and self.tensor_parallel not in TENSOR_PARALLEL:
            raise ValueError(f"unknown tensor parallelism {self.tensor_parallel!r}; expected one of "
                             f"{', '.join(TENSOR_PARALLEL)}")
        if self.tp > 1 and self.tensor_parallel is None:
            object.__setattr__(self, "tensor_parallel", "megatron")
        if self.tensor_parallel is not None and self.tp == 1:
            raise ValueError(f"tensor parallelism {self.tensor_parallel!r} needs tp > 1, got tp = 1")
        if self.tp > 1 and self.sp > 1:
            raise ValueError(f"tp = {self.tp} together with sp = {self.sp} is not supported yet: use one of "
                             f"sequence or tensor parallelism (each with dp/fsdp)")
        if self.pp > 1:
            raise ValueError(f"pp = {self.pp}: pipeline parallelism is not implemented yet")

    # ------------------------------------------------------------------ degrees
    def _size(self, axis: str) -> int:
        return self.mesh.shape[axis] if axis in self.mesh.axis_names else 1

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
    def data_degree(self) -> int:
        return math.prod(self._size(a) for a in DATA_AXES)

    @property
    def batch_axes(self):
        axes = tuple(a for a in DATA_AXES if self._size(a) > 1)
        return axes or None

    @property
    def seq_axis(self):
        return "sp" if self.sp > 1 else None

    def seq_layout(self, causal: bool = True) -> str:
        """The data-side token layout: zigzag balances causal work; contiguous where nothing is to balance."""
        if self.layout is not None:
            return self.layout
        if self.attention in _CONTIGUOUS_STRATEGIES or not causal:
            return "contiguous"
        return "zigzag"

    @property
    def tensor_module(self):
        """jaxring.tensor.<method>, or None without tensor parallelism."""
        if self.tensor_parallel is None:
            return None
        return importlib.import_module(f"jaxring.tensor.{self.tensor_parallel}")

    # ------------------------------------------------------------------ checks
    def check_batch(self, batch: int, what: str = "batch size") -> None:
        if batch % self.data_degree:
            raise ValueError(f"{what} {batch} is not divisible by the data-parallel degree dp*fsdp = "
                             f"{self.data_degree}")

    def check_seq_len(self, seq_len: int, causal: bool = True) -> None:
        """seq must split over sp in the layout, and over tp for the methods that shard it there."""
        if self.sp > 1:
            check_seq_len(seq_len, self.sp, self.seq_layout(causal))
        if self.tensor_parallel in ("megatron", "metp") and seq_len % self.tp:
            raise ValueError(f"seq {seq_len} is not divisible by tp = {self.tp}, needed by "
                             f"{self.tensor_parallel} (the sequence is split over tp)")

    # ------------------------------------------------------------------ data side
    def token_permutation(self, seq_len: int, causal: bool = True):
        """Index map applied once to tokens, targets and positions (None when the layout is the identity)."""
        layout = self.seq_layout(causal)
        if self.sp == 1 or layout == "contiguous":
            return None
        return layout_permutation(layout, seq_len, self.sp)

    def layout_tokens(self, *arrays, causal: bool = True):
        """Permutes each [batch, seq, ...] array along seq into the plan's layout; returns the arrays and the
        positions int32 [seq] of the laid-out tokens (arange when no layout applies)."""
        seq_len = arrays[0].shape[1]
        perm = self.token_permutation(seq_len, causal)
        if perm is None:
            return arrays, np.arange(seq_len, dtype=np.int32)
        return tuple(np.asarray(a)[:, perm] for a in arrays), perm.astype(np.int32)

    # ------------------------------------------------------------------ shardings
    def sharding(self, *spec) -> NamedSharding:
        return NamedSharding(self.mesh, P(*spec))

    def tokens_sharding(self) -> NamedSharding:
        """[batch, seq] tokens/targets/positions."""
        return self.sharding(self.batch_axes, self.seq_axis)

    def activation_sharding(self) -> NamedSharding:
        """[batch, seq, embed] activations between blocks."""
        return self.sharding(self.batch_axes, self.seq_axis, None)

    def param_sharding(self, logical_axes, shape) -> NamedSharding:
        """A parameter's sharding from its logical axes: `embed` over fsdp (ZeRO-3 style), else replicated.
        Tensor-parallel blocks override this with their method's own `param_specs`."""
        spec = []
        for name, dim in zip(logical_axes or (None,) * len(shape), shape):
            spec.append("fsdp" if name == "embed" and self.fsdp > 1 and dim % self.fsdp == 0 else None)
        while spec and spec[-1] is None:  # P(None,) and P() are the same placement; keep one spelling
            spec.pop()
        return self.sharding(*spec)

    def describe(self) -> str:
        degrees = " × ".join(f"{a}={self.mesh.shape[a]}" for a in self.mesh.axis_names if self.mesh.shape[a] > 1)
        parts = [degrees or "1 device"]
        if self.sp > 1:
            extra = {"team_size": self.team_size, "ulysses_size": self.ulysses_size}
            opts = ", ".join(f"{k}={v}" for k, v in extra.items() if v is not None)
            parts.append(f"attention={self.attention}" + (f" ({opts})" if opts else ""))
        if self.tensor_parallel:
            parts.append(f"tensor={self.tensor_parallel}")
        return ", ".join(parts)

    def attention_options(self) -> dict:
        options = {}
        if self.attention == "wallfacer":
            options["team_size"] = self.team_size
        if self.attention == "usp":
            options["ulysses_size"] = self.ulysses_size
        return options
