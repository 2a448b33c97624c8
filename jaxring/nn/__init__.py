"""Model blocks: the Flax NNX layers a model is built from (`modules.py`), mixture of experts (`moe/`) and
KV-cache inference (`inference/`). Each layer runs the plan's tensor method and sequence strategy inside the
train step's one shard_map; `stack`/`Layers` scan a stack of layers.

    from jaxring import nn
    layers = nn.stack(lambda rngs: Block(cfg, plan, rngs), cfg.num_layers, rngs)
"""

from jaxring.nn.modules import (
    BIAS,
    MLP,
    NORMS,
    REMAT,
    STACKED,
    Attention,
    Embed,
    LayerNorm,
    Layers,
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
    "NO_OFFLOAD",
    "OFFLOAD",
    "OFFLOAD_PARTS",
    "REMAT",
    "STACKED",
    "Attention",
    "Embed",
    "LayerNorm",
    "Layers",
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
