"""moe_ffn: the mixture-of-experts FFN as a local function, run inside a shard_map the caller owns.

  y = sum_{j<k} gate_tj * Expert_{e_tj}(x_t)  [+ Shared(x_t)]

The caller's shard_map hands in this device's tokens (batch split over the data axes dp, fsdp and ep,
sequence possibly over sp: the MoE just sees local tokens). The experts are split over `ep_axis` (expert e on
ep rank e // E_l) and each expert's FFN over `tp_axis` (Megatron column/row split; x replicated over tp).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import DATA_AXES
from jaxring.core.vma import varying_axes
from jaxring.nn.moe.config import MoEConfig
from jaxring.nn.moe.dispatch import capacity_dispatch, combine, dropless_exchange, dropless_local, sort_by_expert
from jaxring.nn.moe.experts import dense_ffn
from jaxring.nn.moe.router import balance_losses, route, sum_over

# the mesh axes that split tokens (ep is data parallel outside the MoE layers)
TOKEN_AXES = DATA_AXES + ("sp",)


def _axis_size(name: str | None, role: str) -> int:
    if name is None:
        return 1
    try:
        return lax.axis_size(name)
    except NameError:
        raise ValueError(
            f"{role}={name!r} is not an axis of the enclosing shard_map; call moe_ffn inside "
            f"one with that axis, or pass {role}=None"
        ) from None


def _check_params(params: dict, config: MoEConfig, hidden: int, ep: int, tp: int) -> None:
    num_experts, experts_local = config.num_experts, config.num_experts // ep
    if params["router"].shape != (hidden, num_experts):
        raise ValueError(
            f"router shape {params['router'].shape} must be [hidden, num_experts] = {(hidden, num_experts)}"
        )
    names = ("w_in", "w_gate", "w_out") if config.activation == "swiglu" else ("w_in", "w_out")
    ffn = config.ffn // tp
    for name in names:
        want = (experts_local, ffn, hidden) if name == "w_out" else (experts_local, hidden, ffn)
        got = params["experts"][name].shape
        if got != want:
            raise ValueError(
                f"experts {name} shape {got} must be the local shard {want} "
                f"(num_experts/ep = {num_experts}/{ep}, ffn/tp = {config.ffn}/{tp})"
            )
    if config.shared_expert_ffn is not None and "shared" not in params:
        raise ValueError("config.shared_expert_ffn is set but params has no 'shared' weights")


def moe_ffn(
    x: jax.Array,
    params: dict,
    *,
    config: MoEConfig,
    ep_axis: str | None = "ep",
    tp_axis: str | None = None,
    token_axes: tuple[str, ...] | None = None,
) -> tuple[jax.Array, dict]:
    """The MoE FFN on this device's tokens.

    Args:
      x: [batch, seq, hidden] local tokens (any float dtype; replicated over tp_axis).
      params: {"router": fp32 [hidden, E],
               "experts": {"w_in", "w_gate" (swiglu only): [E_l, hidden, ffn/tp], "w_out": [E_l, ffn/tp, hidden]},
               "shared" (config.shared_expert_ffn): {"w_in", "w_gate"?: [hidden, f_s/tp], "w_out": [f_s/tp, hidden]},
               "router_bias" (optional): fp32 [E], selection only}
        with E_l = E / ep the experts of this ep rank (e // E_l = its rank).
      config: the MoEConfig.
      ep_axis: the expert-parallel mesh axis, or None (all experts here).
      tp_axis: the tensor-parallel axis splitting every expert's FFN, or None.
      token_axes: the mesh axes the batch's tokens are split over; the load statistics and the losses are
        summed over them, so they describe the whole batch exactly as on one device. Default: the axes of
        dp, fsdp, ep, sp (and ep_axis) that x varies over (needs check_vma=True; else pass them).
    Returns:
      y: [batch, seq, hidden] in x.dtype (summed over tp_axis: replicated there).
      stats: fp32 "loss" (= aux_loss_weight*aux_loss + z_loss_weight*z_loss, to add to the training loss
        once), "aux_loss", "z_loss", "drop_rate", "load_imbalance" (max/mean load); int32 "load" [E]
        (assignments per expert, before drops) and "dropped" (assignments dropped). All over the whole batch,
        identical on every device.
    """
    if x.ndim != 3:
        raise ValueError(f"moe_ffn x shape {x.shape} must be [batch, seq, hidden]")
    batch, seq, hidden = x.shape
    ep, tp = _axis_size(ep_axis, "ep_axis"), _axis_size(tp_axis, "tp_axis")
    config.check_parallel(ep, tp)
    _check_params(params, config, hidden, ep, tp)
    vma = varying_axes(x)
    if tp_axis is not None and tp_axis in vma:
        raise ValueError(
            f"moe_ffn x varies over tp_axis={tp_axis!r}; the experts' FFN is split over tp, the "
            f"tokens must be replicated there (gather a sequence-parallel x first)"
        )
    if token_axes is None:
        token_axes = tuple(a for a in dict.fromkeys(TOKEN_AXES + ((ep_axis,) if ep_axis else ())) if a in vma)
    token_axes = tuple(token_axes)

    num_tokens = batch * seq
    tokens = x.reshape(num_tokens, hidden)
    experts = {name: w.astype(x.dtype) for name, w in params["experts"].items()}
    routing = route(tokens, params["router"], config, params.get("router_bias"))
    assignments = sort_by_expert(routing.experts, config.num_experts)

    if config.dropless:
        if ep > 1:
            rows = dropless_exchange(tokens, assignments, experts, config, ep_axis, ep)
        else:
            rows = dropless_local(tokens, assignments, experts, config)
        dropped = jnp.zeros((), jnp.int32)
    else:
        rows, dropped = capacity_dispatch(
            tokens, assignments, config.capacity(num_tokens), experts, config, ep_axis, ep
        )
    y = combine(rows, assignments, routing.gates).astype(x.dtype)
    if config.shared_expert_ffn is not None:
        shared = {name: w.astype(x.dtype) for name, w in params["shared"].items()}
        y = y + dense_ffn(tokens, shared, config.activation)
    if tp_axis is not None:
        y = lax.psum(y, tp_axis)  # routed + shared partial sums, once (free when tp = 1)

    total_tokens = num_tokens * math.prod(lax.axis_size(a) for a in token_axes)
    load = sum_over(assignments.counts, token_axes)
    aux, z = balance_losses(routing, load, total_tokens, token_axes)
    dropped = sum_over(dropped.astype(jnp.int32), token_axes)
    stats = {
        "loss": config.aux_loss_weight * aux + config.z_loss_weight * z,
        "aux_loss": aux,
        "z_loss": z,
        "load": load,
        "dropped": dropped,
        "drop_rate": dropped.astype(jnp.float32) / (total_tokens * config.experts_per_token),
        "load_imbalance": jnp.max(load).astype(jnp.float32) / jnp.mean(load.astype(jnp.float32)),
    }
    return y.reshape(batch, seq, hidden), stats


def param_specs(config: MoEConfig, ep_axis: str | None = "ep", tp_axis: str | None = "tp") -> dict:
    """PartitionSpecs of moe_ffn's params (global arrays): experts over ep_axis, FFN columns/rows over tp_axis,
    router (and bias) replicated."""
    names = ("w_in", "w_gate", "w_out") if config.activation == "swiglu" else ("w_in", "w_out")
    col, row = P(None, tp_axis), P(tp_axis, None)
    specs = {
        "router": P(),
        "experts": {n: P(ep_axis, tp_axis, None) if n == "w_out" else P(ep_axis, None, tp_axis) for n in names},
    }
    if config.shared_expert_ffn is not None:
        specs["shared"] = {n: row if n == "w_out" else col for n in names}
    if config.router_bias:
        specs["router_bias"] = P()
    return specs


def sharded_moe_ffn(x: jax.Array, params: dict, *, mesh: Mesh, config: MoEConfig) -> tuple[jax.Array, dict]:
    """moe_ffn on global arrays over a jaxring mesh: x [batch, seq, hidden] with batch over dp, fsdp, ep and
    seq over sp; experts over ep, their FFN over tp. Returns (y global, stats)."""
    x_spec = P(DATA_AXES, "sp", None)
    specs = {k: v for k, v in param_specs(config).items() if k in params}

    def local(x: jax.Array, params: dict) -> tuple[jax.Array, dict]:
        return moe_ffn(x, params, config=config, ep_axis="ep", tp_axis="tp")

    return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, specs), out_specs=(x_spec, P()))(x, params)
