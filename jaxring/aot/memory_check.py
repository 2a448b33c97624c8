"""Checking the planner's memory prediction against the compiled train step.

    peak = compiled_peak(workload, candidate, target="h200")     # deviceless GPU compile (gpu-compile extra)
    peak = compiled_peak(workload, candidate)                    # this process's devices (e.g. simulated CPUs)
    peak = compiled_bytes_on(spec, devices)                      # a run specification's step on its devices
    note = compile_check(result, "h200", top=3)  # `python -m jaxring.planner --compile-check 3`: fills the
                                                 # top plans' `compiled_memory`, returns a note (or "")

The step is the trainer's (`jaxring.aot.train_step.build_train_step`) on abstract inputs: nothing is
allocated. For a GPU target the attention runs its Pallas kernels (block_ops="pallas": "auto" would pick the
CPU path, as a deviceless compile runs on the CPU platform). Peak = arguments + outputs + temporaries - aliased
(donated weights and optimizer state come back in place).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax

from jaxring.analysis import gpu, tpu
from jaxring.analysis.compiled import device_bytes, host_bytes
from jaxring.aot.train_step import compile_train_step
from jaxring.planner.fit import workload_of
from jaxring.planner.search import Result
from jaxring.planner.space import Candidate, Workload

if TYPE_CHECKING:
    from jaxring.run.spec import RunSpec

# the planner's device: the GPU target config it is compiled for (no A100 target config ships with jaxring)
GPU_TARGETS = {"h100": "h100", "h200": "h200", "a100-40gb": "h100", "a100-80gb": "h100"}


def gpu_target_available() -> tuple[bool, str]:
    """(whether deviceless GPU compilation works here, why not)."""
    return gpu.available()


def compiled_peak(
    w: Workload, c: Candidate, *, target: str | None = None, devices: Sequence[jax.Device] | None = None
) -> float:
    """Per-device peak bytes of the compiled step of `c` for `w`: on the GPU topology `target` ("h100",
    "h200"), or on `devices` (default: the first c.devices of jax.devices())."""
    block_ops = None  # the candidate's own
    if target is not None and target in tpu.TARGETS:
        devices = tpu.tpu_devices(target)
        block_ops = tpu.BLOCK_OPS
    elif target is not None:
        devices = gpu.gpu_devices(target, c.devices)
        block_ops = "pallas"
    elif devices is None:
        devices = jax.devices()[: c.devices]
        if len(devices) < c.devices:
            raise ValueError(f"the plan needs {c.devices} devices; this process has {len(jax.devices())}")
    plan = c.check(w, devices=devices, block_ops=block_ops)
    compiled = compile_train_step(
        w.model,
        w.config,
        plan,
        batch=w.global_batch,
        seq_len=w.seq_len,
        precision=w.precision,
        memory=c.memory.policy,
        grad_accum=c.steps(w) if c.pp == 1 else 1,
        documents=w.documents,
    )
    return device_bytes(compiled.memory_analysis())


def compiled_bytes_on(spec: RunSpec, devices: Sequence[jax.Device]) -> float:
    """Peak device bytes per device of the (unresolved) run's train step compiled on `devices` (see
    `compiled_memory_on`)."""
    return compiled_memory_on(spec, devices)[0]


def compiled_memory_on(spec: RunSpec, devices: Sequence[jax.Device]) -> tuple[float, float]:
    """(peak device bytes, host bytes) per device of the (unresolved) run's train step compiled on `devices` with
    its own plan, block compute, remat, offload, tiles, accumulation and clipping; nothing is allocated."""
    spec = spec.resolved(len(devices))
    w, t, ms = workload_of(spec), spec.training, spec.memory
    compiled = compile_train_step(
        w.model,
        w.config,
        spec.plan(list(devices)),
        batch=t.batch_size,
        seq_len=w.seq_len,
        precision=spec.compute_precision,
        memory=ms.policy,
        grad_accum=t.grad_accum,
        clip=spec.optimizer.clip,
        documents=w.documents,
    )
    m = compiled.memory_analysis()
    return device_bytes(m), host_bytes(m)


def compile_check(result: Result, device: str, top: int) -> str:
    """Compiles the `top` ranked plans of `result` for `device` (a planner device name: its GPU target,
    deviceless; "cpu": this process's devices) and sets each one's `compiled_memory`. Returns a note for the
    output ("" when none): the target that stood in for the device, or why the check was skipped."""
    if device == "cpu":
        target = None
    elif device.startswith("tpu"):  # the Cloud TPU slice of this device and size
        count = result.ranked[0].candidate.devices if result.ranked else 0
        slices = [n for n, t in tpu.TARGETS.items() if t.device == device and t.devices == count]
        if not slices:
            return f"compile check skipped: no TPU target of {device} with {count} devices"
        ok, why = tpu.available()
        if not ok:
            return f"compile check skipped: {why}"
        target = slices[0]
    else:
        target = GPU_TARGETS[device]
        ok, why = gpu_target_available()
        if not ok:
            return f"compile check skipped: {why}"
    for ev in result.ranked[:top]:
        ev.compiled_memory = compiled_peak(result.workload, ev.candidate, target=target)
    if target is not None and target != device and target not in tpu.TARGETS:
        return f"compiled for the {target} target (no {device} target config ships with jaxring)"
    return ""
