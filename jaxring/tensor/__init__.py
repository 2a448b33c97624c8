"""Tensor-parallel families: Megatron TP+SP, Optimus 2D SUMMA (seed 002) and METP (seed 000).

Each module holds the paper's layer functions (called inside `shard_map`) and model-facing entry points
on global arrays: `mlp_block(x, params, mesh=)`, `attention_block(x, params, positions, mesh=, ...)` and
`param_specs(mesh, shapes)`; Megatron and Optimus also give `embed` and `cross_entropy` (logits stay split).
"""
from jaxring.tensor import megatron, metp, optimus

METHODS = ("megatron", "optimus", "metp")
