"""Attention: the dense reference, the per-block compute, layouts and the sequence-parallel strategies.

Importing this package registers every built-in sequence strategy (each file registers its own entry).
"""

# the strategies: one file each, registering its entry in jaxring.registry (in this order: the listing's)
# isort: off
from jaxring.attention import ring, rsa, ulysses, wallfacer, allgather, usp

# isort: on
from jaxring.attention.api import sharded_attention
from jaxring.attention.blockwise import BlockOps, get_block_ops
from jaxring.attention.flash import flash_attention, flash_block_ops
from jaxring.attention.layout import LAYOUTS, from_layout, layout_permutation, layout_positions, to_layout
from jaxring.attention.merge import merge_partials
from jaxring.attention.reference import attention_reference
from jaxring.attention.ring import ring_attention

__all__ = [
    "LAYOUTS",
    "BlockOps",
    "allgather",
    "attention_reference",
    "flash_attention",
    "flash_block_ops",
    "from_layout",
    "get_block_ops",
    "layout_permutation",
    "layout_positions",
    "merge_partials",
    "ring",
    "ring_attention",
    "rsa",
    "sharded_attention",
    "to_layout",
    "ulysses",
    "usp",
    "wallfacer",
]
