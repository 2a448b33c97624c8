"""jaxring: sequence- and tensor-parallel Transformer training in JAX, built from shard_map rings."""

from jaxring import analysis, registry
from jaxring.attention import (
    LAYOUTS,
    BlockOps,
    attention_reference,
    flash_attention,
    flash_block_ops,
    from_layout,
    get_block_ops,
    layout_permutation,
    layout_positions,
    merge_partials,
    ring_attention,
    sharded_attention,
    to_layout,
)
from jaxring.mesh import MESH_AXES, factored_mesh, make_mesh
from jaxring.plan import ParallelPlan
from jaxring.spec import RunSpec, make_plan

__version__ = "0.1.0"

__all__ = [
    "LAYOUTS",
    "MESH_AXES",
    "BlockOps",
    "ParallelPlan",
    "RunSpec",
    "analysis",
    "attention_reference",
    "factored_mesh",
    "flash_attention",
    "flash_block_ops",
    "from_layout",
    "get_block_ops",
    "layout_permutation",
    "layout_positions",
    "make_mesh",
    "make_plan",
    "merge_partials",
    "registry",
    "ring_attention",
    "sharded_attention",
    "to_layout",
]
