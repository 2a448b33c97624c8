"""Per-device attention compute: the dense reference, masks by position, causal layouts, the online-softmax
merge, the per-block compute (jnp tiles on CPU, Pallas flash kernels on GPU) and RoPE. Nothing here
communicates; the parallel layer above builds its rings and all-to-alls from these pieces."""

from jaxring.kernels.block_compute import get_block_ops
from jaxring.kernels.blockwise import BlockOps
from jaxring.kernels.flash import flash_attention, flash_block_ops
from jaxring.kernels.layout import LAYOUTS, from_layout, layout_permutation, layout_positions, to_layout
from jaxring.kernels.merge import merge_partials
from jaxring.kernels.reference import attention_reference

__all__ = [
    "LAYOUTS",
    "BlockOps",
    "attention_reference",
    "flash_attention",
    "flash_block_ops",
    "from_layout",
    "get_block_ops",
    "layout_permutation",
    "layout_positions",
    "merge_partials",
    "to_layout",
]
