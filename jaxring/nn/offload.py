"""What host offload moves to pinned host memory, as one typed value: the parts of an `--offload` setting.

    Offload.parse("layer_inputs+weights")   # Offload(layer_inputs=True, optimizer=True, weights=True)
    str(Offload.parse("weights"))           # "weights": the flag's text form (run.yaml, --print-config)
    Offload().weights, bool(Offload())      # False, False: nothing offloaded ("none")

The parts: the layers' checkpointed inputs (between forward and backward), the optimizer state (between
updates), the weights (the fp32 master weights, their gradients and the optimizer state: each layer's weights
reach the device just before the layer runs, its gradient leaves as the backward produces it, and the update
streams the state through the device layer by layer). "weights" therefore holds the optimizer state too.
`Offload.parse` is the one parser of the flag's text; everything past the run specification takes the value.
"""

from __future__ import annotations

import dataclasses

__all__ = ["NO_OFFLOAD", "OFFLOAD", "OFFLOAD_PARTS", "Offload"]

# the parts, in the order the text form joins them with "+"
OFFLOAD_PARTS = ("layer_inputs", "optimizer", "weights")
# the accepted text forms (the choices of --offload)
OFFLOAD = ("none", "layer_inputs", "optimizer", "layer_inputs+optimizer", "weights", "layer_inputs+weights")


@dataclasses.dataclass(frozen=True)
class Offload:
    """The parts of a step's state kept in pinned host memory; `weights` implies `optimizer`."""

    layer_inputs: bool = False
    optimizer: bool = False
    weights: bool = False

    def __post_init__(self):
        if self.weights and not self.optimizer:  # the weights take their optimizer state with them
            object.__setattr__(self, "optimizer", True)

    @classmethod
    def parse(cls, value: str | Offload) -> Offload:
        """The value of an --offload text (one of OFFLOAD); an Offload is returned as it is. A text not in
        OFFLOAD is a one-line ValueError naming it and the accepted forms."""
        if isinstance(value, Offload):
            return value
        if value not in OFFLOAD:
            raise ValueError(f"--offload {value!r} is not one of {', '.join(OFFLOAD)}")
        parts = () if value == "none" else value.split("+")
        return cls(**{p: True for p in parts})

    @property
    def parts(self) -> frozenset[str]:
        """The parts moved (OFFLOAD_PARTS' names; "weights" with "optimizer")."""
        return frozenset(p for p in OFFLOAD_PARTS if getattr(self, p))

    @property
    def beyond_optimizer(self) -> bool:
        """Whether anything besides the optimizer state moves (the layer inputs or the weights): what a
        pipeline (pp > 1) cannot offload."""
        return self.layer_inputs or self.weights

    def __bool__(self) -> bool:
        return bool(self.parts)

    def __str__(self) -> str:
        shown = [p for p in OFFLOAD_PARTS if getattr(self, p) and not (p == "optimizer" and self.weights)]
        return "+".join(shown) or "none"


# nothing offloaded (--offload none): the default
NO_OFFLOAD = Offload()
