"""jaxring: sequence- and tensor-parallel Transformer training in JAX, built from shard_map rings."""

import sys

if sys.argv[:1] == ["-m"]:  # `python -m jaxring.<command>` is starting: a stop signal ends it at once, also while
    from jaxring.core.stop_signals import exit_on_stop_signals  # jax imports (stdlib only; see the module)

    exit_on_stop_signals()

from jaxring import analysis
from jaxring.core.mesh import MESH_AXES, factored_mesh, make_mesh
from jaxring.kernels import (
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
    to_layout,
)
from jaxring.parallel import catalog, registry  # noqa: F401 (catalog: registers the built-in entries)
from jaxring.parallel.api import sharded_attention
from jaxring.parallel.plan import ParallelPlan
from jaxring.parallel.sequence.ring import ring_attention
from jaxring.run.make_plan import make_plan
from jaxring.run.spec import RunSpec

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
