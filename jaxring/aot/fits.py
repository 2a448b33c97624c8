"""On accelerators the compiled program decides whether a run fits: `train.py` asks before training.

    check_compiled_fits(spec, devices)   # None, or DoesNotFit (one line) naming the compiled bytes

A run whose planner estimate exceeds the device budget (--device-memory-gib, else the device's allocator limit)
but by no more than `jaxring.planner.fit.FAR_BEYOND` times (`fit.decide` says "compile") has its train step
compiled on the devices (on abstract inputs: nothing allocated) and is refused only when the compiled program's
memory (argument + output + temp - alias bytes of `memory_analysis()`) exceeds the budget. A run estimated
within the budget is not compiled here (the trainer compiles it); one far beyond it is refused by the estimate
(`fit.check_fits`, in the training loop); simulated CPU devices keep the estimate's check. The host memory that
--offload keeps on an accelerator's host is decided the same way (`fit.host_decision`): its compiled bytes
(`memory_analysis()`'s host bytes) times this host's devices against --host-memory-gib, else the machine's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from jaxring.aot.memory_check import compiled_memory_on
from jaxring.planner.fit import (
    GIB,
    DoesNotFit,
    decide,
    device_memory_bytes,
    estimate,
    host_decision,
    host_memory_bytes,
    local_devices,
    on_cpu,
)

if TYPE_CHECKING:
    import jax

    from jaxring.run.spec import RunSpec


def check_compiled_fits(
    spec: RunSpec,
    devices: Sequence[jax.Device],
    log: Callable[[str], object] = print,
    compiled: Callable[[RunSpec, Sequence[jax.Device]], tuple[float, float]] = compiled_memory_on,
) -> float | None:
    """spec: the run as given (resolved here for `devices`). The compiled device bytes per device when the
    compiler decided (None when the estimate did); DoesNotFit (one line: compiled, estimate, budget) when the
    compiled program exceeds the device budget, or its host bytes (what --offload keeps there) times this host's
    devices exceed the host's memory. compiled(spec, devices) -> (device bytes, host bytes) per device of the
    run's compiled step."""
    memory = estimate(spec.resolved(len(devices)), devices)
    if memory is None:
        return None
    budget, host_budget = device_memory_bytes(spec, devices), host_memory_bytes(spec)
    says = (decide(memory.total, budget, compiler_decides=not on_cpu(devices)), host_decision(spec, devices, memory))
    if "compile" not in says or "refuse" in says:  # the estimate decides (its check refuses in the loop)
        return None
    peak, host = compiled(spec, devices)
    local = local_devices(devices)
    figures = f"compiled {peak / GIB:.2f} GiB per device, estimate {memory.total / GIB:.2f} GiB"
    figures += "" if budget is None else f", budget {budget / GIB:.2f} GiB"
    if budget is not None and peak > budget:
        raise DoesNotFit(
            f"the run does not fit: {figures} ({devices[0].device_kind}); use --remat full, tiles (--loss-tile, "
            f"--mlp-tile), --offload, a larger --sp or --tp, or a shorter --seq-len"
        )
    host_figures = (
        f"compiled {host / GIB:.2f} GiB per device x {local} devices, estimate {memory.host / GIB:.2f} GiB per "
        f"device, this host's {host_budget / GIB:.2f} GiB"
        if host_budget is not None
        else "no budget"
    )
    if host_budget is not None and host * local > host_budget:
        raise DoesNotFit(
            f"the run does not fit in host memory: {host_figures} (--offload {spec.memory.offload}); offload less, "
            f"or use a shorter --seq-len or a smaller --batch-size"
        )
    which = "estimate" if says[0] == "compile" else "host estimate"
    log(
        f"fits by the compiled step: {figures}; host memory: {host_figures} (the {which} is above the budget; "
        "the compiler decides)"
    )
    return peak
