"""Will an evaluation's context fit? The planner's memory estimate of one forward pass, checked before compiling.

    check_context_fits(spec, devices, loaded, seq_len=100_000_000, batch=1, flag="--seq-len")

As training's check (`jaxring.planner.fit.check_fits`), priced by the cost model for the run's plan, but of a
forward pass only: the weights, the last layer's forward transients and the head's logits (no gradients, no
optimizer state, no saved activations). The budget is the device memory (--device-memory-gib, else the
accelerator's); simulated CPU devices share the host's memory. A context that does not fit stops in one line
naming the estimate, the budget and the longest context the estimate says fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from jaxring.eval.loading import LoadedModel
from jaxring.planner import cost_model
from jaxring.planner.fit import GIB, candidate_of, device_memory_bytes, host_memory_bytes
from jaxring.planner.params import param_leaves
from jaxring.planner.space import Workload
from jaxring.run.spec import RunSpec

__all__ = ["check_context_fits", "forward_bytes"]


def forward_bytes(spec: RunSpec, loaded: LoadedModel, seq_len: int, batch: int, cpu: bool) -> float | None:
    """Per-device bytes of one forward pass of `batch` sequences of `seq_len` tokens; None: not priced."""
    try:
        w = Workload(loaded.family.name, loaded.config, seq_len, batch, spec.compute_precision)
        c = dataclasses.replace(candidate_of(spec), micro_batch=max(1, batch // spec.parallel.dp)).with_memory(
            remat="full"
        )
        plan = c.check(w)
        m = cost_model.memory(w, c, param_leaves(w.model, w.config, plan), cpu=cpu, plan=plan)
    except (ValueError, NotImplementedError, KeyError, AttributeError, TypeError):
        return None
    return m.params + m.other + max(m.head, m.forward)


def _budget(spec: RunSpec, devices: Sequence[jax.Device]) -> tuple[float, str] | None:
    """(bytes per device, what they are) or None: no budget known."""
    if devices[0].platform != "cpu":
        budget = device_memory_bytes(spec, devices)
        return None if budget is None else (budget, f"of device memory ({devices[0].device_kind})")
    host = host_memory_bytes(spec)
    local = sum(d.process_index == jax.process_index() for d in devices)
    return None if host is None else (host / local, f"of host memory each of {local} simulated CPU devices has")


def check_context_fits(
    spec: RunSpec, devices: Sequence[jax.Device], loaded: LoadedModel, *, seq_len: int, batch: int, flag: str
) -> None:
    """ValueError (one line) when the forward pass at `seq_len` tokens is estimated above the memory per device,
    naming the longest context (a multiple of 2·sp) that fits."""
    budget = _budget(spec, devices)
    cpu = devices[0].platform == "cpu"
    need = forward_bytes(spec, loaded, seq_len, batch, cpu) if budget else None
    if need is None or need <= budget[0]:
        return
    step = 2 * max(1, spec.parallel.sp)
    low, high = 0, seq_len // step  # the longest multiple of `step` whose estimate fits
    while low < high:
        mid = (low + high + 1) // 2
        fits = forward_bytes(spec, loaded, mid * step, batch, cpu)
        if fits is not None and fits <= budget[0]:
            low = mid
        else:
            high = mid - 1
    longest = f"the longest that fits is about {low * step:,} tokens" if low else "no context fits"
    raise ValueError(
        f"{flag} {seq_len}: a forward pass of {batch} x {seq_len:,} tokens needs an estimated {need / GIB:,.1f} GiB "
        f"per device, above the {budget[0] / GIB:,.1f} GiB {budget[1]}; {longest} (or use more devices: --sp)"
    )
