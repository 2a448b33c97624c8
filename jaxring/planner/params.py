"""The model's weights as a plan places them: per leaf, its per-device size and the axes its gradient is
reduced over (read from the model and `jaxring.nn.param_placements`, never allocated).

    leaves = param_leaves(workload, plan)      # [ParamLeaf(path, size, stacked, ...), ...]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from jaxring.nn import BIAS, param_placements
from jaxring.parallel.zero import Placement
from jaxring.run.task import model_family

if TYPE_CHECKING:
    from jaxring.parallel.plan import ParallelPlan


@dataclasses.dataclass(frozen=True)
class ParamLeaf:
    path: str
    size: int  # elements per device as stored without ZeRO (tensor / pipeline / expert split)
    stacked: bool  # a layer-stack weight (read inside the layer scan)
    bias: bool  # a bias (its gradient needs no weight: not read again in the backward)
    zero_sharded: bool  # ZeRO shards it (stage >= 1) over `replica`; else it stays all-reduced
    replica: tuple[str, ...]  # run-mesh axes (size > 1) its gradient is summed over (data and sequence)
    unsplit_tensor: tuple[str, ...]  # tensor axes (size > 1) it is replicated over: its gradient is psummed there


@functools.lru_cache(maxsize=16)
def abstract_state(model: str, config: Any) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract nnx.State) of the model, nothing allocated."""
    build = model_family(model).build
    return nnx.split(nnx.eval_shape(lambda: build(config, nnx.Rngs(0))))


def param_leaves(model: str, config: Any, plan: ParallelPlan) -> list[ParamLeaf]:
    _, state = abstract_state(model, config)
    placements = param_placements(state, plan)
    biases = {
        "".join(f"[{k!r}]" for k in path) for path, var in nnx.to_flat_state(state) if var.get_metadata().get(BIAS)
    }
    shapes = nnx.to_pure_dict(state)
    sizes = dict(plan.run_mesh.shape)
    tensor_axes = tuple(a for a in plan.tensor_axes if sizes.get(a, 1) > 1)
    out = []
    flat_pl = jax.tree_util.tree_leaves_with_path(placements, is_leaf=lambda x: isinstance(x, Placement))
    flat_shape = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(shapes)}
    for path, pl in flat_pl:
        key = jax.tree_util.keystr(path)
        shape = flat_shape[key].shape
        used = set()
        split = 1
        for entry in pl.spec:
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            for a in axes:
                used.add(a)
                split *= sizes[a]
        replica = tuple(a for a in pl.replica if sizes.get(a, 1) > 1)
        out.append(
            ParamLeaf(
                key,
                math.prod(shape) // split,
                key.startswith("['blocks']"),
                key in biases,
                pl.zero_dim is not None,
                replica,
                tuple(a for a in tensor_axes if a not in used),
            )
        )
    return out
