"""Mixture of experts with expert parallelism: router, dropless and capacity dispatch over `ep`.

config = MoEConfig(num_experts=8, experts_per_token=2, ffn=128)
y, stats = moe_ffn(x, params, config=config, ep_axis="ep")   # inside the caller's shard_map
loss = task_loss + stats["loss"]
"""

from jaxring.nn.moe.config import MoEConfig
from jaxring.nn.moe.dispatch import sort_by_expert
from jaxring.nn.moe.layer import TOKEN_AXES, moe_ffn, param_specs, sharded_moe_ffn
from jaxring.nn.moe.module import MoE, RouterBias
from jaxring.nn.moe.router import Routing, balance_losses, route, update_router_bias

__all__ = [
    "TOKEN_AXES",
    "MoE",
    "MoEConfig",
    "RouterBias",
    "Routing",
    "balance_losses",
    "moe_ffn",
    "param_specs",
    "route",
    "sharded_moe_ffn",
    "sort_by_expert",
    "update_router_bias",
]
