"""jaxring: sequence- and tensor-parallel Transformer training in JAX, built from shard_map rings."""

from jaxring import analysis
from jaxring.attention import (
    LAYOUTS,
    STRATEGIES,
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

__version__ = "0.1.0"
