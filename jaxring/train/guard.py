"""The divergence guard: stop (or skip the step) when the loss is not finite or spikes.

A step's loss spikes when it exceeds `spike_factor` × the lowest running mean seen so far, the running mean
being that of the last `window` accepted losses. Against the *lowest* running mean, not the current one, so
that a loss climbing step by step (each step only a little above the mean of the last few) is caught as
well as a sudden jump: a run whose loss is three times its best level has diverged.

    guard = DivergenceGuard(mode="stop", spike_factor=3.0, window=20)
    verdict = guard.check(step, loss)      # None, or a Verdict("stop" | "skip", one-line message)

In "skip" mode the caller undoes the step's update (see loop.py) and the loss does not enter the mean; after
`max_skips` skips in a row the guard stops anyway. The guard's state travels with checkpoints
(`state_dict` / `load_state_dict`), so a resumed run judges its losses exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

MODES = ("stop", "skip")


class Diverged(RuntimeError):
    """Training stopped because the loss (or the state) went non-finite or spiked."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    action: str  # "stop" or "skip"
    message: str


class DivergenceGuard:
    def __init__(self, mode: str = "stop", spike_factor: float = 3.0, window: int = 20, max_skips: int = 10):
        """mode: "stop" or "skip". spike_factor: > 1, or 0 to check only for NaN/Inf. window: losses in the
        running mean. max_skips: consecutive skipped steps after which skip mode stops too."""
        if mode not in MODES:
            raise ValueError(f"--on-divergence {mode!r} must be one of {', '.join(MODES)}")
        if (
            isinstance(spike_factor, bool)
            or not isinstance(spike_factor, (int, float))
            or not (spike_factor == 0 or (math.isfinite(spike_factor) and spike_factor > 1))
        ):
            raise ValueError(f"--spike-factor {spike_factor!r} must be a number > 1 (or 0: no spike check)")
        for name, value in (("--spike-window", window), ("max_skips", max_skips)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} must be a positive integer")
        self.mode, self.spike_factor, self.window, self.max_skips = mode, float(spike_factor), window, max_skips
        self.recent: deque[float] = deque(maxlen=window)
        self.lowest_mean = math.inf
        self.skips_in_a_row = 0

    @property
    def limit(self) -> float:
        """The loss above which a step spikes (inf before any loss, or with the spike check off)."""
        return self.spike_factor * self.lowest_mean if self.spike_factor else math.inf

    def check(self, step: int, loss: float) -> Verdict | None:
        """Judges the loss of `step` (1-based): None accepts it (and updates the mean)."""
        if not math.isfinite(loss):
            problem = f"loss {loss} is not finite"
        elif loss > self.limit:
            problem = (
                f"loss {loss:.4g} is {loss / self.lowest_mean:.1f}x its lowest running mean "
                f"{self.lowest_mean:.4g} (limit {self.spike_factor:g}x, --spike-factor)"
            )
        else:
            self.recent.append(float(loss))
            self.lowest_mean = min(self.lowest_mean, sum(self.recent) / len(self.recent))
            self.skips_in_a_row = 0
            return None
        if self.mode == "skip" and self.skips_in_a_row < self.max_skips:
            self.skips_in_a_row += 1
            return Verdict(
                "skip", f"step {step}: {problem}; skipped (its update undone, {self.skips_in_a_row} in a row)"
            )
        more = f" after {self.skips_in_a_row} skipped steps in a row" if self.skips_in_a_row else ""
        advice = (
            f"lower --lr, or check the data: skip mode gives up after {self.max_skips} skipped steps in a row"
            if self.mode == "skip"
            else "lower --lr, or pass --on-divergence skip to skip such steps"
        )
        return Verdict("stop", f"diverged at step {step}: {problem}{more}; stopping ({advice})")

    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "lowest_mean": None if math.isinf(self.lowest_mean) else self.lowest_mean}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        self.recent = deque((float(x) for x in state.get("recent", [])), maxlen=self.window)
        lowest = state.get("lowest_mean")
        self.lowest_mean = math.inf if lowest is None else float(lowest)
