"""Will a run fit? The planner's memory estimate of a run specification, checked before anything compiles.

    memory = estimate(spec, devices)                 # jaxring.planner.cost_model.Memory per device, or None
    check_fits(spec, devices)                        # DoesNotFit (one line) when the estimate rules the run out
    decide(estimate, budget, compiler_decides=True)  # "fits", "compile" (the compiled program decides), "refuse"

The estimate is `jaxring.planner.cost_model.memory` of the run's own plan (the spec's mesh, strategies, remat, tiles,
offload, micro-batching) for the run's model: per device, the stored state plus the larger of the backward's
and the update's peak (see `cost_model.Memory`). It is compared with the device memory: --device-memory-gib when
given, else the accelerator's own (`memory_stats()["bytes_limit"]`). Simulated CPU devices have no memory of
their own: they share the host's, so their estimates together are checked against --host-memory-gib, else the
machine's memory (`jaxring.core.host`; instead of the kernel's out-of-memory killer after compiling). A run that
does not fit stops before compiling, in one line naming the estimate, the budget and the first setting change
(--remat full, --loss-tile, --mlp-tile, larger sp) that the estimate says would fit.

On accelerators (and for --compile-for) the compiled program decides (`decide`): the estimate refuses before
compiling only a run estimated at more than FAR_BEYOND times the budget; one estimated above the budget but
within that is compiled and refused only when its compiled program exceeds the budget (`jaxring.aot.fits`). The
same holds for the host memory that --offload keeps on an accelerator's host (`host_decision`). Simulated CPU
devices keep the estimate's check (their budget is the host's memory, which a compile can exhaust).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax

from jaxring.core.host import machine_memory_bytes
from jaxring.nn import Offload
from jaxring.planner import cost_model
from jaxring.planner.cost_model import Memory
from jaxring.planner.params import param_leaves
from jaxring.planner.space import Candidate, Workload
from jaxring.run.task import model_family

if TYPE_CHECKING:
    from jaxring.run.spec import RunSpec

GIB = 2**30

# How far above the budget the estimate must be to refuse a run before compiling it, on accelerators. On the
# recorded compiles (554 rows on CPU, GPU and TPU targets; docs/memory-model.md) the estimate was 0.64 to 1.25 times
# the compiled bytes, so a run estimated at 2x its budget would compile to at least 1.6x it; 2x leaves that room
# for a target or XLA version the calibration was not fitted on. Closer to the budget, the compiler decides.
RECORDED_ERROR = (0.64, 1.25)  # estimate / compiled bytes, least and most, on the recorded compiles
FAR_BEYOND = 2.0


class DoesNotFit(ValueError):
    """The run's estimated memory per device exceeds the device's (one line: estimate, budget, the fix)."""


def workload_of(spec: RunSpec) -> Workload:
    """The planner's workload of a (resolved) run specification: its model, sequence, batch and precision."""
    t = spec.training
    family = model_family(spec.model.model)
    causal = family.causal  # a causal model's default 256 tokens; a DiT: its images
    return Workload.of(
        spec.model.model,
        spec.model.preset,
        seq_len=t.seq_len or (256 if causal else None),
        image_size=t.image_size,
        global_batch=t.batch_size,
        precision=spec.compute_precision,
        documents=family.documents is not None and family.documents(spec.data),
        **spec.model.overrides,
    )


def candidate_of(spec: RunSpec) -> Candidate:
    """The planner's candidate of a resolved run specification (fsdp counts as dp: the same program)."""
    p, m, t = spec.parallel, spec.memory, spec.training
    data = p.dp * p.fsdp * p.ep
    steps = t.grad_accum if p.pp == 1 else (p.microbatches or 2 * p.pp)
    parallel = dataclasses.replace(
        p.settings(),
        dp=p.dp * p.fsdp,
        fsdp=1,
        tensor_parallel=p.tensor_parallel if p.tp > 1 else None,
        microbatches=steps if p.pp > 1 else None,
    )
    return Candidate(parallel, m, micro_batch=max(1, t.batch_size // (data * steps)))


def _memory(w: Workload, c: Candidate, cpu: bool) -> Memory:
    plan = c.check(w)
    return cost_model.memory(w, c, param_leaves(w.model, w.config, plan), cpu=cpu, plan=plan)


def on_cpu(devices: Sequence[jax.Device]) -> bool:
    """Whether `devices` are (simulated) CPU devices, which share the host's memory."""
    return getattr(devices[0], "platform", "cpu") == "cpu"


def estimate(spec: RunSpec, devices: Sequence[jax.Device]) -> Memory | None:
    """The estimated memory per device of the resolved run `spec` on `devices`; None when the planner cannot
    price it (a model loaded from a checkpoint directory, an entry without a cost model, a plan the stand-in
    check refuses: the run itself then reports what is wrong)."""
    if spec.model.init_from is not None:
        return None
    try:
        return _memory(workload_of(spec), candidate_of(spec), on_cpu(devices))
    except (ValueError, NotImplementedError, KeyError, AttributeError, TypeError):
        return None


def device_memory_bytes(spec: RunSpec, devices: Sequence[jax.Device]) -> float | None:
    """The memory budget per device: --device-memory-gib, else the accelerator's allocator limit, else None."""
    given = spec.memory.device_memory_gib
    if given is not None:
        return given * GIB
    if on_cpu(devices):
        return None
    try:
        stats = devices[0].memory_stats() or {}
    except Exception:  # a backend without memory statistics: no budget to check
        return None
    limit = stats.get("bytes_limit")
    return float(limit) if limit else None


def _remedies(spec: RunSpec, c: Candidate, w: Workload) -> list[tuple[str, Candidate]]:
    """Setting changes to try, cumulative, in the order a user would: remat, tiles, offload (the layer inputs,
    then the optimizer state), then more sp."""
    out = []
    if c.memory.remat != "full":
        c = c.with_memory(remat="full")
        out.append(("--remat full", c))
    rows = w.seq_len // max(1, c.sp)
    tile = next((d for d in (4096, 2048, 1024, 512, 256, 128, 64) if d < rows and rows % d == 0), None)
    if tile is not None and c.memory.loss_tile is None and getattr(w.config, "vocab_size", None):
        c = c.with_memory(loss_tile=tile)
        out.append((f"--loss-tile {tile}", c))
    if tile is not None and c.memory.mlp_tile is None:
        c = c.with_memory(mlp_tile=tile)
        out.append((f"--mlp-tile {tile}", c))
    if not c.memory.offload and c.pp == 1:
        c = c.with_memory(offload=Offload(layer_inputs=True))
        out.append(("--offload layer_inputs", c))
    if not (c.memory.offload.parts - {"layer_inputs"}):
        c = c.with_memory(offload=dataclasses.replace(c.memory.offload, optimizer=True))
        out.append((f"--offload {c.memory.offload}", c))
    return out


def advice(spec: RunSpec, devices: Sequence[jax.Device], budget: float, shared_host: bool = False) -> str:
    """The first cumulative setting change whose estimate fits `budget`, as flags; else what is left (more
    devices too, unless `budget` is the devices' share of one host's memory)."""
    w, c = workload_of(spec), candidate_of(spec)
    cpu = on_cpu(devices)
    flags = []
    for flag, changed in _remedies(spec, c, w):
        if cpu and flag.startswith("--offload"):
            continue  # host and device memory are one on CPU
        flags = [f for f in flags if f.split()[0] != flag.split()[0]] + [flag]  # a later --offload replaces
        try:
            if _memory(w, changed, cpu).total <= budget:
                return "use " + " ".join(flags)
        except ValueError:
            continue
    tried = f"even with {' '.join(flags)}; " if flags else ""
    more = "" if shared_host else "a larger --sp (more devices) or --tp, "  # (more CPU devices: one memory still)
    return (
        f"{tried}use {more}a shorter --seq-len or a smaller --batch-size "
        f"(now sp {spec.parallel.sp}, seq-len {w.seq_len}, batch {w.global_batch})"
    )


def host_memory_bytes(spec: RunSpec) -> float | None:
    """The host memory budget: --host-memory-gib, else this machine's (or container's) memory; None: unknown."""
    given = spec.memory.host_memory_gib
    return given * GIB if given is not None else machine_memory_bytes()


def local_devices(devices: Sequence[jax.Device]) -> int:
    """How many of `devices` this process holds (they share its host's memory)."""
    return sum(d.process_index == jax.process_index() for d in devices)


def host_decision(spec: RunSpec, devices: Sequence[jax.Device], memory: Memory) -> str:
    """`decide` for the host memory this host's devices need together: simulated CPU devices keep everything in it
    (their total and what offload moves; refused above the budget), accelerators what host offload keeps there
    (left to the compiled program unless far beyond the budget, as their device memory is)."""
    cpu = on_cpu(devices)
    per_device = memory.total + memory.host if cpu else memory.host
    return decide(per_device * local_devices(devices), host_memory_bytes(spec), compiler_decides=not cpu)


def _check_host(spec: RunSpec, devices: Sequence[jax.Device], memory: Memory) -> None:
    """DoesNotFit when `host_decision` refuses: this host's devices together need more host memory than it has
    (accelerators: far more)."""
    if host_decision(spec, devices, memory) != "refuse":
        return
    local, cpu, budget = local_devices(devices), on_cpu(devices), host_memory_bytes(spec)
    per_device = memory.total + memory.host if cpu else memory.host
    source = "--host-memory-gib" if spec.memory.host_memory_gib is not None else "this machine's memory"
    need = f"{per_device / GIB:.2f} GiB per device x {local} "
    if cpu:
        raise DoesNotFit(
            f"the run does not fit: estimated {need}simulated CPU devices = {per_device * local / GIB:.2f} GiB, "
            f"above the {budget / GIB:.2f} GiB of {source}, which they share; "
            f"{advice(spec, devices, budget / local, shared_host=True)}"
        )
    raise DoesNotFit(
        f"the run does not fit in host memory: --offload {spec.memory.offload} keeps an estimated {need}"
        f"{devices[0].device_kind} devices = {per_device * local / GIB:.2f} GiB there, more than {FAR_BEYOND:g}x the "
        f"{budget / GIB:.2f} GiB of {source}; offload less, or use a shorter --seq-len or a smaller --batch-size"
    )


def decide(estimate: float, budget: float | None, *, compiler_decides: bool) -> str:
    """What the estimate says of a run before compiling: "fits" (within the budget, or no budget), "refuse"
    (above it, unless `compiler_decides`: then only more than FAR_BEYOND times above it), else "compile": the
    compiled program's memory decides. compiler_decides: accelerators and --compile-for's manual plans (not
    simulated CPU devices, whose budget is the host's memory, nor a search's ranked plans)."""
    if budget is None or estimate <= budget:
        return "fits"
    if not compiler_decides or estimate > FAR_BEYOND * budget:
        return "refuse"
    return "compile"


def check_fits(spec: RunSpec, devices: Sequence[jax.Device]) -> Memory | None:
    """The estimate (None when there is none); DoesNotFit (one line) when `decide` refuses it (above the device
    memory on simulated CPU devices, far above it on accelerators), or when the host's devices together exceed
    the host's memory (`_check_host`). A run left to the compiler ("compile") returns its estimate."""
    memory = estimate(spec, devices)
    if memory is None:
        return None
    budget = device_memory_bytes(spec, devices)
    simulated = on_cpu(devices)
    if decide(memory.total, budget, compiler_decides=not simulated) != "refuse":
        _check_host(spec, devices, memory)
        return memory
    source = "--device-memory-gib" if spec.memory.device_memory_gib is not None else devices[0].device_kind
    above = (
        "above"
        if simulated
        else f"more than {FAR_BEYOND:g}x (the estimate is at most {RECORDED_ERROR[1]:g}x the compiled bytes on record)"
    )
    raise DoesNotFit(
        f"the run does not fit: estimated {memory.total / GIB:.2f} GiB per device (weights and Adam "
        f"{(memory.params + memory.optimizer) / GIB:.2f}, activations {memory.activations / GIB:.2f}, working "
        f"{max(memory.working, memory.head, memory.forward) / GIB:.2f}), {above} the {budget / GIB:.2f} GiB device "
        f"memory ({source}); {advice(spec, devices, budget)}"
    )
