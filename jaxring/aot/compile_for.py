"""`train.py ... --compile-for TARGET`: will this run fit on that machine? Compiled for it, with no GPU or TPU.

    python train.py --preset 7b --seq-len 262144 --sp 8 --remat full --compile-for h100x8
    ...
    fits: compiled 41.2 GiB per device, estimate 39.8 GiB, budget 67.1 GiB; host memory 0.000 GiB per device, ...

The run's exact train step (`jaxring.aot.train_step.build_train_step`: the trainer's `TrainStep` with the
run's plan, remat, offload, tiles, accumulation, precision and clipping; the attention's Pallas kernels) is
compiled for the target's GPU topology without a GPU (deviceless AOT: `jaxring.analysis.gpu`), on abstract
inputs: nothing is allocated. The last line compares the compiled program's memory per device (argument +
output + temp - alias bytes of `memory_analysis()`) and the planner's estimate (`jaxring.planner.cost_model.memory`)
with the budget: --device-memory-gib, else the device's memory times the planner's usable fraction (0.9). Beside
it, the host memory per device (what --offload keeps there: the compiled program's host bytes, and the
estimate's) against the target's host budget: `HOST_GIB_PER_GPU` (a DGX node's share), or --host-memory-gib over
the target's GPUs. The compiled program decides: a manual plan is refused before compiling only when its estimate
is more than `jaxring.planner.fit.FAR_BEYOND` times a budget (device or host); otherwise it is compiled and the
verdict is the compiled bytes', whatever the estimate says. A ranked plan (--plan auto) estimated above the
host's budget is skipped.
Exit 0 when it fits, 3 when not. With --plan auto, the planner's ranked plans for the target are compiled in
order until one fits (at most `TRIES`); when none fits by the estimate, the plans estimated within
`ESTIMATE_MARGIN` above the budget are compiled, least first (the estimate's error is within that margin).

Needs the compile-only CUDA plugin (`pip install "jax[cuda12]"`, the `gpu-compile` extra, in its own venv):
without it the flag is refused in one line (exit 2).

TPU targets (`jaxring.analysis.tpu.TARGETS`, Cloud TPU's slice names: v5e-8, v5p-8 (4 chips), v5p-128 (64),
v6e-8, tpu7x-8, ...) compile the same step for libtpu's topology of that slice (the `tpu-compile` extra), with
the attention's block compute `jaxring.analysis.tpu.BLOCK_OPS` (the Pallas TPU kernel); the log says how many
Mosaic kernel calls the compiled step holds. The host budget per device is the slice's VM memory over its
devices; the estimate is the planner's for that TPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax

from jaxring.analysis import gpu, tpu
from jaxring.analysis.compiled import device_bytes, host_bytes
from jaxring.aot.train_step import lower_train_step
from jaxring.planner import cost_model
from jaxring.planner.auto import held_settings
from jaxring.planner.cluster import Cluster
from jaxring.planner.fit import FAR_BEYOND, RECORDED_ERROR, DoesNotFit, candidate_of, decide, workload_of
from jaxring.planner.params import param_leaves
from jaxring.planner.search import ESTIMATE_MARGIN, NoPlanError, Result, margin_search, search

if TYPE_CHECKING:
    from jaxring.run.spec import RunSpec

GIB = 2**30
EXIT_DOES_NOT_FIT = 3
TRIES = 3  # ranked plans compiled at most with --plan auto

# target: (the GPU, how many); the GPU names a target config of jaxring.analysis.gpu and a planner device
TARGETS = {"h100x8": ("h100", 8), "h200x8": ("h200", 8), "h100x1": ("h100", 1), "h200x1": ("h200", 1)}
# Host memory per GPU of a target (--host-memory-gib overrides it for the whole target): a typical 8-GPU node,
# NVIDIA's DGX H100 / DGX H200, has 2 TiB of system memory, 256 GiB per GPU; a one-GPU target gets one GPU's
# share of such a node.
HOST_GIB_PER_GPU = 256


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What --compile-for found: the plan compiled, its bytes per device, the budget."""

    plan: str
    compiled: float
    estimate: float
    budget: float
    host: float = 0.0  # host-memory bytes per device of the compiled program (what --offload keeps there)
    host_estimate: float = 0.0
    host_budget: float = float("inf")  # per device

    @property
    def fits(self) -> bool:
        return self.compiled <= self.budget and self.host <= self.host_budget

    def line(self) -> str:
        head = "fits" if self.fits else "does not fit"
        return (
            f"{head}: compiled {_gib(self.compiled)} GiB per device, estimate {_gib(self.estimate)} GiB, "
            f"budget {_gib(self.budget)} GiB; host memory {_gib(self.host)} GiB per device, estimate "
            f"{_gib(self.host_estimate)} GiB, budget {_gib(self.host_budget)} GiB"
        )


def _gib(n: float) -> str:
    """GiB with one decimal (three below 1 GiB)."""
    return f"{n / GIB:.1f}" if n >= GIB else f"{n / GIB:.3f}"


def is_tpu(target: str) -> bool:
    return target in tpu.TARGETS


def check_target(target: str) -> tuple[str, int]:
    """(the planner's device, devices) of a target name; ValueError naming the known targets."""
    if is_tpu(target):
        t = tpu.TARGETS[target]
        return t.device, t.devices
    if target not in TARGETS:
        known = ", ".join([*TARGETS, *tpu.TARGETS])
        raise ValueError(f"--compile-for {target!r} is not a known target; expected one of {known}")
    return TARGETS[target]


def require_plugin(target: str) -> None:
    """ValueError (one line: what to install) unless deviceless compilation for `target` works here."""
    ok, why = tpu.available() if is_tpu(target) else gpu.available()
    if not ok:
        what = "a TPU" if is_tpu(target) else "a GPU"
        raise ValueError(
            f"--compile-for {target} compiles for {what} without one, which this environment cannot: {why}"
        )


def target_devices(target: str) -> list:
    """The abstract devices of a target (a GPU node or a TPU slice)."""
    if is_tpu(target):
        return tpu.tpu_devices(target)
    name, count = check_target(target)
    return gpu.gpu_devices(name, count)


def block_ops_for(devices: list) -> str:
    """The attention's block compute on a target's devices: the flash kernels (GPU), Pallas TPU (TPU)."""
    return tpu.BLOCK_OPS if devices[0].platform == "tpu" else "pallas"


def budget_bytes(spec: RunSpec, gpu: str) -> float:
    """--device-memory-gib, else the device's memory times the planner's usable fraction."""
    if spec.memory.device_memory_gib is not None:
        return spec.memory.device_memory_gib * GIB
    return Cluster.of(gpu, 1).usable_memory


def host_budget_bytes(spec: RunSpec, count: int, target: str | None = None) -> float:
    """Host memory per device of a target: --host-memory-gib over its `count` devices, else `HOST_GIB_PER_GPU`
    (a TPU slice: its VM's memory over its devices)."""
    if spec.memory.host_memory_gib is not None:
        return spec.memory.host_memory_gib * GIB / count
    if target is not None and is_tpu(target):
        return tpu.TARGETS[target].host_gib_per_device * GIB
    return HOST_GIB_PER_GPU * GIB


def estimated_memory(spec: RunSpec, count: int) -> cost_model.Memory:
    """The planner's estimate per device of the (unresolved) run on `count` GPUs."""
    spec = spec.resolved(count)
    w, c = workload_of(spec), candidate_of(spec)
    return cost_model.memory(w, c, param_leaves(w.model, w.config, c.check(w)), cpu=False)


def lowered_step(spec: RunSpec, devices: list) -> tuple[jax.stages.Lowered, float, str]:
    """(the lowered train step, its estimated bytes per device, the plan) of the resolved run on `devices`
    (abstract GPUs or TPUs), with the flash kernels (`block_ops_for`); nothing is allocated."""
    spec = spec.resolved(len(devices))  # validated there
    spec = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, block_ops=block_ops_for(devices)))
    w, c = workload_of(spec), candidate_of(spec)
    plan = spec.plan(devices)
    t = spec.training
    w.family.check_plan(w.config, plan, t.batch_size // t.grad_accum, w.seq_len)
    estimate = cost_model.memory(w, c, param_leaves(w.model, w.config, c.check(w)), cpu=False).total
    lowered = lower_train_step(
        w.model,
        w.config,
        plan,
        batch=t.batch_size,
        seq_len=w.seq_len,
        precision=spec.compute_precision,
        memory=spec.memory.policy,
        grad_accum=t.grad_accum,
        clip=spec.optimizer.clip,
        documents=w.documents,
    )
    return lowered, float(estimate), plan.describe()


def _compile(spec: RunSpec, devices: list, log: Callable[[str], None] = print) -> tuple[float, float, float, str]:
    """(compiled device bytes, estimated bytes, compiled host bytes, the plan) of the resolved run's step on the
    abstract devices; on TPUs it logs the Mosaic kernel calls of the compiled step."""
    lowered, estimate, plan = lowered_step(spec, devices)
    compiled = lowered.compile()
    if devices[0].platform == "tpu":
        log(tpu_kernel_line(compiled.as_text()))
    m = compiled.memory_analysis()
    peak, host = device_bytes(m), host_bytes(m)
    ms = spec.memory
    kept = [
        f"remat {ms.remat}" + (f" in blocks of {ms.remat_layers} layers" if ms.remat_layers > 1 else ""),
        spec.compute_precision,
    ]
    kept += [f"{n} {v}" for n, v in (("loss tile", ms.loss_tile), ("mlp tile", ms.mlp_tile), ("offload", ms.offload))]
    settings = ", ".join(k for k in kept if not k.endswith((" None", " none")))
    return float(peak), estimate, float(host), f"{plan}; {settings}"


def tpu_kernel_line(hlo: str) -> str:
    """Whether the compiled TPU step runs the attention in the Pallas TPU kernel (its Mosaic calls)."""
    calls = tpu.mosaic_calls(hlo)
    if not calls:
        return "TPU block compute: pallas_tpu, but the compiled step holds no Mosaic call (tpu_custom_call)"
    return (
        f"TPU block compute: pallas_tpu, {calls} Mosaic kernel calls (tpu_custom_call) in the compiled step; "
        f"no jnp fallback (block_ops pallas_tpu has none)"
    )


def ranked_specs(
    spec: RunSpec, gpu: str, count: int, tries: int = TRIES, hold: dict | None = None, target: str | None = None
) -> list[RunSpec]:
    """--plan auto: the planner's best plans for the target (settings the user gave held, and `hold`), as run
    specs."""
    cluster = Cluster.of(gpu, count, host_memory=host_budget_bytes(spec, count, target))
    result = search(workload_of(spec), cluster, only=held_settings(spec) | (hold or {}))
    return _as_specs(spec, result, result.ranked[:tries])


def margin_specs(spec: RunSpec, gpu: str, count: int, tries: int = TRIES, target: str | None = None) -> list[RunSpec]:
    """--plan auto when no plan fits by the estimate: the plans estimated within ESTIMATE_MARGIN above the
    device budget (and within the host's), least device memory first; NoPlanError when there are none."""
    cluster = Cluster.of(gpu, count, host_memory=host_budget_bytes(spec, count, target))
    result = margin_search(workload_of(spec), cluster, only=held_settings(spec))
    return _as_specs(spec, result, result.ranked[:tries])


def _as_specs(spec: RunSpec, result: Result, ranked: list) -> list[RunSpec]:
    parallel = dataclasses.replace(spec.parallel, options={}, plan="manual")
    base = dataclasses.replace(spec, parallel=parallel)
    return [base.updated(**ev.candidate.settings(result.workload)) for ev in ranked]


def compile_for(spec: RunSpec, target: str, log: Callable[[str], None] = print) -> int:
    """Compiles the run's step for `target` and logs what it found, the verdict last; 0 fits, 3 does not.
    Raises ValueError (one line) for a bad target, a missing plugin or a plan the model refuses."""
    gpu_name, count = check_target(target)
    require_plugin(target)
    devices = target_devices(target)
    budget, host_budget = budget_bytes(spec, gpu_name), host_budget_bytes(spec, count, target)
    auto = spec.parallel.plan == "auto"
    specs = [spec]
    if auto:
        try:
            specs = ranked_specs(spec, gpu_name, count, target=target)
        except NoPlanError as refused:
            try:
                specs = margin_specs(spec, gpu_name, count, target=target)
            except NoPlanError:
                raise refused from None
            log(
                f"--compile-for {target}: {refused}; the estimate is within {ESTIMATE_MARGIN - 1:.0%} of the "
                f"compiled bytes, so the {len(specs)} plans estimated least within that above the budget are "
                f"compiled: the compiler decides"
            )
    verdict = None
    for i, candidate in enumerate(specs, 1):
        which = f"plan {i} of the planner's ranking: " if auto else ""
        estimated = estimated_memory(candidate, count)
        host_estimate = estimated.host
        # refused before compiling: a ranked plan above the host's budget; a manual plan only far above a budget
        host_refused = decide(host_estimate, host_budget, compiler_decides=not auto) == "refuse"
        if host_refused:
            above = "above" if auto else f"more than {FAR_BEYOND:g}x"
            line = (
                f"--compile-for {target}: {which}--offload {candidate.memory.offload} keeps an estimated "
                f"{_gib(host_estimate)} GiB per device in host memory, {above} the target's {_gib(host_budget)} GiB "
                f"per device ({_host_source(spec, count, target)})"
            )
            if not auto:
                raise DoesNotFit(f"{line}; offload less, or give --host-memory-gib for a larger host")
            log(line)
            continue
        if not auto and decide(estimated.total, budget, compiler_decides=True) == "refuse":
            raise DoesNotFit(
                f"--compile-for {target}: estimated {_gib(estimated.total)} GiB per device, more than "
                f"{FAR_BEYOND:g}x the budget of {_gib(budget)} GiB (the estimate is at most "
                f"{RECORDED_ERROR[1]:g}x the compiled bytes on record), so it is not compiled; use --remat full, "
                f"tiles, --offload, more devices or a shorter --seq-len"
            )
        compiled, estimate, host, plan = _compile(candidate, devices, log)
        verdict = Verdict(plan, compiled, estimate, budget, host, host_estimate, host_budget)
        log(f"--compile-for {target}: {which}{plan}: {verdict.line()}")
        if verdict.fits:
            break
    if verdict is None:
        raise DoesNotFit(f"--compile-for {target}: no ranked plan fits the target's host memory")
    log(verdict.line())
    return 0 if verdict.fits else EXIT_DOES_NOT_FIT


def _host_source(spec: RunSpec, count: int, target: str | None = None) -> str:
    if spec.memory.host_memory_gib is not None:
        return f"--host-memory-gib {spec.memory.host_memory_gib:g} over {count} devices"
    if target is not None and is_tpu(target):
        return f"{target}'s VM memory over its devices; --host-memory-gib sets the target's"
    return f"{HOST_GIB_PER_GPU} GiB per GPU, a DGX node's 2 TiB over 8; --host-memory-gib sets the target's"
