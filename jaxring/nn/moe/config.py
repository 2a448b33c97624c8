"""MoEConfig: the mixture-of-experts hyper-parameters and their validation."""

from __future__ import annotations

import dataclasses
import math

from jaxring.kernels.layer_math import ACTIVATIONS

GROUPED_MATMULS = ("auto", "ragged_dot", "blocked")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts FFN.

    num_experts: E routed experts; experts_per_token: k (top-k of the router's softmax scores).
    ffn: each expert's hidden size; activation: "swiglu" (w_gate, w_in, w_out) or "gelu" (w_in, w_out).
    shared_expert_ffn: hidden size of a dense shared expert every token goes through, or None.
    capacity_factor: None = dropless; else each expert takes at most
      C = min(T, ceil(capacity_factor * T * k / E)) assignments per device (T = the device's tokens), the rest
      are dropped (they contribute 0: the residual carries the token).
    aux_loss_weight, z_loss_weight: weights of the Switch/GShard load-balancing loss and the router z-loss in
      stats["loss"].
    renormalize: the k gates are divided by their sum (Mixtral); else they are the raw softmax scores.
    router_bias: a per-expert bias added to the scores for the top-k choice only (DeepSeek-V3's aux-loss-free
      balancing; updated outside the gradient by `update_router_bias`).
    grouped_matmul: the dropless grouped matmul, "ragged_dot", "blocked" (row blocks of `block_rows`, one
      expert each) or "auto" (blocked on CPU, where jax's ragged_dot is a masked dense matmul; else ragged_dot).
    """

    num_experts: int
    experts_per_token: int
    ffn: int
    activation: str = "swiglu"
    shared_expert_ffn: int | None = None
    capacity_factor: float | None = None
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    renormalize: bool = True
    router_bias: bool = False
    grouped_matmul: str = "auto"
    block_rows: int = 128

    def __post_init__(self):
        for name in ("num_experts", "experts_per_token", "ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig {name}={value!r} must be a positive integer")
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"MoEConfig experts_per_token={self.experts_per_token} must be <= "
                f"num_experts={self.num_experts} (top-k picks distinct experts)"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig activation={self.activation!r} must be one of {', '.join(ACTIVATIONS)}")
        if self.shared_expert_ffn is not None and (
            not isinstance(self.shared_expert_ffn, int) or self.shared_expert_ffn < 1
        ):
            raise ValueError(
                f"MoEConfig shared_expert_ffn={self.shared_expert_ffn!r} must be a positive integer or None"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig capacity_factor={self.capacity_factor!r} must be > 0 (or None for dropless)")
        if self.grouped_matmul not in GROUPED_MATMULS:
            raise ValueError(
                f"MoEConfig grouped_matmul={self.grouped_matmul!r} must be one of {', '.join(GROUPED_MATMULS)}"
            )
        if not isinstance(self.block_rows, int) or self.block_rows < 1:
            raise ValueError(f"MoEConfig block_rows={self.block_rows!r} must be a positive integer")
        for name in ("aux_loss_weight", "z_loss_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"MoEConfig {name}={getattr(self, name)!r} must be >= 0")

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    def capacity(self, tokens: int) -> int:
        """Slots per expert on one device holding `tokens` tokens (capacity path)."""
        k, e = self.experts_per_token, self.num_experts
        return min(tokens, math.ceil(self.capacity_factor * tokens * k / e))

    def check_parallel(self, ep: int = 1, tp: int = 1) -> None:
        """Raises ValueError unless the experts split evenly over ep and every FFN over tp."""
        if self.num_experts % ep:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by ep={ep} "
                f"(each ep rank holds num_experts/ep whole experts)"
            )
        if self.ffn % tp:
            raise ValueError(f"expert ffn={self.ffn} is not divisible by tp={tp} (the experts' FFN is split over tp)")
        if self.shared_expert_ffn is not None and self.shared_expert_ffn % tp:
            raise ValueError(
                f"shared_expert_ffn={self.shared_expert_ffn} is not divisible by tp={tp} "
                f"(the shared expert's FFN is split over tp)"
            )
