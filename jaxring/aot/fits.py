"""On accelerators the compiled program decides whether a run fits: `train.py` asks before training.

    check_compiled_fits(spec, devices)   # None, or DoesNotFit (one line) naming the compiled bytes

A run whose planner estimate exceeds the device budget (--device-memory-gib, else the device's allocator limit)
but by no more than `jaxring.planner.fit.FAR_BEYOND` times (`fit.decide` says "compile") has its train step
compiled on the devices (on abstract inputs: nothing allocated) and is refused only when the compiled program's
memory (argument + output + temp - alias bytes of `memory_analysis()`) exceeds the budget. A run estimated
within the budget is not compiled here (the trainer compiles it); one far beyond it is refused by the estimate
(`fit.check_fits`, in the training loop); simulated CPU devices keep the estimate's check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from jaxring.aot.memory_check import compiled_bytes_on
from jaxring.planner.fit import GIB, DoesNotFit, decide, device_memory_bytes, estimate, on_cpu

if TYPE_CHECKING:
    import jax

    from jaxring.run.spec import RunSpec


def check_compiled_fits(
    spec: RunSpec,
    devices: Sequence[jax.Device],
    log: Callable[[str], object] = print,
    compiled: Callable[[RunSpec, Sequence[jax.Device]], float] = compiled_bytes_on,
) -> float | None:
    """spec: the run as given (resolved here for `devices`). The compiled bytes per device when the compiler decided (None when the estimate did); DoesNotFit (one
    line: compiled, estimate, budget) when the compiled program exceeds the budget. compiled(spec, devices) ->
    bytes per device of the run's compiled step."""
    memory = estimate(spec.resolved(len(devices)), devices)
    budget = device_memory_bytes(spec, devices)
    if memory is None or decide(memory.total, budget, compiler_decides=not on_cpu(devices)) != "compile":
        return None
    peak = compiled(spec, devices)
    figures = f"compiled {peak / GIB:.2f} GiB per device, estimate {memory.total / GIB:.2f} GiB, budget {budget / GIB:.2f} GiB"
    if peak > budget:
        raise DoesNotFit(
            f"the run does not fit: {figures} ({devices[0].device_kind}); use --remat full, tiles (--loss-tile, "
            f"--mlp-tile), --offload, a larger --sp or --tp, or a shorter --seq-len"
        )
    log(f"fits by the compiled step: {figures} (the estimate is above the budget; the compiler decides)")
    return peak
