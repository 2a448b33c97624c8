"""Tensor-parallel families: Megatron TP+SP, Optimus 2D SUMMA (seed 002) and METP (seed 000).

Each module holds the paper's layer functions (called inside `shard_map`) and model-facing entry points
on global arrays: `mlp_block`, `attention_block` and `param_specs`.
"""
