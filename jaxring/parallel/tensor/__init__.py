"""Tensor-parallel methods: Megatron TP+SP, Optimus 2D SUMMA and METP (see the bibliography in REFERENCES.md).

`contract.py` is the typed contract every method fulfils (`TensorMethod`, and "none": no tensor parallelism);
`splits.py` the size checks and K/V-head split they share. Each method has three files, one concern each:

  <method>_layers.py   the paper's layer functions, on local shards inside `shard_map` (the kernels)
  <method>.py          the `TensorMethod` (its layouts, checks and cost model) as `METHOD`, registered by
                       `jaxring.parallel.catalog`, used by the train step's one shard_map
  <method>_api.py      the same layers on global arrays, each in its own shard_map: `mlp_block(x, params,
                       mesh=)`, `attention_block(x, params, positions, mesh=, ...)`, `param_specs(mesh,
                       shapes)`; Megatron and Optimus also `embed` and `cross_entropy` (logits stay split)
"""

from jaxring.parallel.tensor import contract, megatron, metp, optimus

__all__ = ["contract", "megatron", "metp", "optimus"]
