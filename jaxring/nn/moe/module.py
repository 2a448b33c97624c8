"""MoE: the Flax NNX module around `moe_ffn` (parameters with logical axes, deterministic init)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxring.nn.moe.config import MoEConfig
from jaxring.nn.moe.layer import moe_ffn


class RouterBias(nnx.Variable):
    """DeepSeek-V3's selection bias [E]: not a Param (no gradient, no optimizer), set by update_router_bias."""


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], logical_axes: tuple, std: float) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * std, logical_axes=logical_axes)


class SharedExpert(nnx.Module):
    """A dense FFN every token goes through: w_in, w_gate (swiglu) [hidden, ffn], w_out [ffn, hidden]."""

    def __init__(self, hidden: int, ffn: int, activation: str, *, out_std: float | None, rngs: nnx.Rngs):
        self.w_in = _param(rngs, (hidden, ffn), ("embed", "mlp"), hidden**-0.5)
        if activation == "swiglu":
            self.w_gate = _param(rngs, (hidden, ffn), ("embed", "mlp"), hidden**-0.5)
        self.w_out = _param(rngs, (ffn, hidden), ("mlp", "embed"), out_std or ffn**-0.5)


class Experts(nnx.Module):
    """E expert FFNs stacked: w_in, w_gate (swiglu) [E, hidden, ffn], w_out [E, ffn, hidden]."""

    def __init__(self, hidden: int, config: MoEConfig, *, out_std: float | None, rngs: nnx.Rngs):
        e, f = config.num_experts, config.ffn
        self.w_in = _param(rngs, (e, hidden, f), ("expert", "embed", "mlp"), hidden**-0.5)
        if config.activation == "swiglu":
            self.w_gate = _param(rngs, (e, hidden, f), ("expert", "embed", "mlp"), hidden**-0.5)
        self.w_out = _param(rngs, (e, f, hidden), ("expert", "mlp", "embed"), out_std or f**-0.5)


class MoE(nnx.Module):
    """Mixture-of-experts FFN. Params (global shapes; logical axes):

      router           [hidden, E]           ("embed", None)   replicated over ep: every token scores all E
      experts.w_in     [E, hidden, ffn]      ("expert", "embed", "mlp")
      experts.w_gate   [E, hidden, ffn]      ("expert", "embed", "mlp")   (swiglu)
      experts.w_out    [E, ffn, hidden]      ("expert", "mlp", "embed")
      shared.w_in/w_gate [hidden, f_s]       ("embed", "mlp")   (config.shared_expert_ffn)
      shared.w_out     [f_s, hidden]         ("mlp", "embed")
      router_bias      [E]  RouterBias       (None,)           (config.router_bias; not a Param)

    `__call__` runs on local arrays inside the caller's shard_map (experts split over ep, ffn over tp).
    """

    def __init__(
        self,
        hidden: int,
        config: MoEConfig,
        *,
        out_std: float | None = None,
        router_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.router = _param(rngs, (hidden, config.num_experts), ("embed", None), router_std or hidden**-0.5)
        self.experts = Experts(hidden, config, out_std=out_std, rngs=rngs)
        if config.shared_expert_ffn is not None:
            self.shared = SharedExpert(hidden, config.shared_expert_ffn, config.activation, out_std=out_std, rngs=rngs)
        if config.router_bias:
            self.router_bias = RouterBias(jnp.zeros((config.num_experts,), jnp.float32), logical_axes=(None,))

    def params(self) -> dict:
        """The arrays moe_ffn takes (whatever shards this module holds)."""
        names = ("w_in", "w_gate", "w_out") if self.config.activation == "swiglu" else ("w_in", "w_out")
        out = {"router": self.router[...], "experts": {n: getattr(self.experts, n)[...] for n in names}}
        if self.config.shared_expert_ffn is not None:
            out["shared"] = {n: getattr(self.shared, n)[...] for n in names}
        if self.config.router_bias:
            out["router_bias"] = self.router_bias[...]
        return out

    def __call__(
        self,
        x: jax.Array,
        *,
        ep_axis: str | None = "ep",
        tp_axis: str | None = None,
        token_axes: tuple[str, ...] | None = None,
    ) -> tuple[jax.Array, dict]:
        """x [batch, seq, hidden] local tokens -> (y [batch, seq, hidden], stats); see moe_ffn."""
        return moe_ffn(x, self.params(), config=self.config, ep_axis=ep_axis, tp_axis=tp_axis, token_axes=token_axes)
