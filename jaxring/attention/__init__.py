"""Attention: the dense reference, the per-block compute, layouts and the sequence-parallel strategies."""

from jaxring.attention.api import STRATEGIES, sharded_attention
from jaxring.attention.blockwise import BlockOps, get_block_ops
from jaxring.attention.flash import flash_attention, flash_block_ops
from jaxring.attention.layout import LAYOUTS, from_layout, layout_permutation, layout_positions, to_layout
from jaxring.attention.merge import merge_partials
from jaxring.attention.reference import attention_reference
from jaxring.attention.ring import ring_attention
