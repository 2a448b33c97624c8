"""What a layer stack keeps, recomputes and offloads between its forward and backward, as one typed value.

    MemoryPolicy()                                         # remat none, blocks of 1 layer, nothing offloaded
    MemoryPolicy(remat="full", remat_layers=2, offload=Offload.parse("layer_inputs"))
    spec.memory.policy                                     # the run's (`jaxring.run.schema.MemorySettings`)

`Layers` and `TrainStep` take it as it is. The tiles (--loss-tile, --mlp-tile) are the plan's: the layers read
them from `ParallelPlan.loss_tiles` / `mlp_tiles`.
"""

from __future__ import annotations

import dataclasses

from jaxring.nn.offload import NO_OFFLOAD, Offload

__all__ = ["NO_MEMORY_POLICY", "REMAT", "MemoryPolicy"]

REMAT = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPolicy:
    """remat: none/selective/full per layer (`jaxring.nn.remat_policy`); remat_layers: with remat full, layers per
    recompute block (Megatron's --recompute-num-layers); offload: the parts kept in pinned host memory (an
    `Offload`, or its --offload text)."""

    remat: str = "none"
    remat_layers: int = 1
    offload: Offload = NO_OFFLOAD

    def __post_init__(self):
        if self.remat not in REMAT:
            raise ValueError(f"unknown remat {self.remat!r}; expected one of {', '.join(REMAT)}")
        if isinstance(self.remat_layers, bool) or not isinstance(self.remat_layers, int) or self.remat_layers < 1:
            raise ValueError(f"remat_layers {self.remat_layers!r} must be a positive integer")
        object.__setattr__(self, "offload", Offload.parse(self.offload))


# the default: nothing recomputed, nothing offloaded
NO_MEMORY_POLICY = MemoryPolicy()
