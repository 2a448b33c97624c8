"""Tensor-parallel methods: Megatron TP+SP, Optimus 2D SUMMA and METP (see the bibliography in README.md).

Each module holds the paper's layer functions (called inside `shard_map`), its `TensorMethod` (the typed
contract of `contract.py`, used by the train step's one shard_map) registered in `jaxring.parallel.registry`, and
convenience entry points on global arrays: `mlp_block(x, params, mesh=)`, `attention_block(x, params,
positions, mesh=, ...)`, `param_specs(mesh, shapes)`; Megatron and Optimus also give `embed` and
`cross_entropy` (logits stay split).
"""

from jaxring.parallel.tensor import contract, megatron, metp, optimus

__all__ = ["contract", "megatron", "metp", "optimus"]
