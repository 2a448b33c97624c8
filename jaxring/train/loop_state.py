"""What the training loop carries from one step to the next, as one value: the steps done, the weights and the
optimizer state.

    state = trainer.loop_state                  # LoopState(step=0, params, opt_state) after building
    state = state.advanced(params, opt_state)   # after one update: step + 1
    state.arrays()                              # {"params", "opt_state"}: the arrays a checkpoint holds

Everything else a step needs follows from it: the batch is the task's for `step` (its loader's position is
saved beside the arrays, in the checkpoint's metadata), the random key is the seed folded with `step`, the
learning rate is the schedule's at `step`. The divergence guard keeps its own window of recent losses
(`jaxring.train.guard`), saved in the metadata too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["LoopState"]


@dataclasses.dataclass(frozen=True)
class LoopState:
    """step: the updates done (the next step's index); params: the weights as stored between steps (nested dict
    of arrays, on the plan's mesh); opt_state: the optimizer state in its stored layout."""

    step: int
    params: Any
    opt_state: Any

    def __post_init__(self):
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"the loop's step {self.step!r} must be a non-negative integer")

    def advanced(self, params: Any, opt_state: Any) -> LoopState:
        """The state after one more update, which produced params and opt_state."""
        return LoopState(self.step + 1, params, opt_state)

    def arrays(self) -> dict:
        """{"params", "opt_state"}: the arrays of the state (as a checkpoint saves them)."""
        return {"params": self.params, "opt_state": self.opt_state}
