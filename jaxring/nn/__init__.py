"""Model blocks: the Flax NNX layers a model is built from (`modules.py`), mixture of experts (`moe/`) and
KV-cache inference (`inference/`). Each layer runs the plan's tensor method and sequence strategy inside the
train step's one shard_map; `stack`/`Layers` scan a stack of layers, as a
`MemoryPolicy` says (remat, recompute blocks, offload).

    from jaxring import nn
    layers = nn.stack(lambda rngs: Block(cfg, plan, rngs), cfg.num_layers, rngs)
"""

from jaxring.nn.memory_policy import NO_MEMORY_POLICY, REMAT, MemoryPolicy
from jaxring.nn.modules import (
    BIAS,
    MLP,
    NORMS,
    STACKED,
    Attention,
    Embed,
    LayerNorm,
    Layers,
    LayerScan,
    MoE,
    RMSNorm,
    bias_param,
    constant,
    param,
    param_placements,
    param_shardings,
    remat_policy,
    stack,
    token_cross_entropy,
    weight_specs,
)
from jaxring.nn.offload import NO_OFFLOAD, OFFLOAD, OFFLOAD_PARTS, Offload

__all__ = [
    "BIAS",
    "MLP",
    "NORMS",
    "NO_MEMORY_POLICY",
    "NO_OFFLOAD",
    "OFFLOAD",
    "OFFLOAD_PARTS",
    "REMAT",
    "STACKED",
    "Attention",
    "Embed",
    "LayerNorm",
    "LayerScan",
    "Layers",
    "MemoryPolicy",
    "MoE",
    "Offload",
    "RMSNorm",
    "bias_param",
    "constant",
    "param",
    "param_placements",
    "param_shardings",
    "remat_policy",
    "stack",
    "token_cross_entropy",
    "weight_specs",
]
