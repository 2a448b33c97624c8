"""Tensor-parallel methods: Megatron TP+SP, Optimus 2D SUMMA (seed 002) and METP (seed 000).

Each module holds the paper's layer functions (called inside `shard_map`), its `TensorMethod` (the typed
contract of `contract.py`, used by the train step's one shard_map), and convenience entry points on global
arrays: `mlp_block(x, params, mesh=)`, `attention_block(x, params, positions, mesh=, ...)`,
`param_specs(mesh, shapes)`; Megatron and Optimus also give `embed` and `cross_entropy` (logits stay split).
"""

from jaxring.tensor import contract, megatron, metp, optimus

TENSOR_METHODS = {m.name: m for m in (contract.NONE, megatron.METHOD, optimus.METHOD, metp.METHOD)}
METHODS = tuple(name for name in TENSOR_METHODS if name != "none")
