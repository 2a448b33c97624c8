"""Compile any jaxring program for an H100 or H200 topology with no GPU present (deviceless AOT), and read
what the GPU compiler made of it.

    from jaxring.analysis import gpu
    mesh = jaxring.make_mesh(sp=8, devices=gpu.gpu_devices("h200", 8))
    q = gpu.abstract((1, 32768, 8, 128), jnp.bfloat16, mesh, P(None, "sp"))
    report = gpu.compile_for_gpu(jax.jit(step), q, k, v)          # or compile_for_gpu(lowered)
    print(report.summary())

The report holds, for the compiled program of one device:
  kernels    every kernel launch: grid, threads per block, shared memory (from XLA's thunk sequence), and for
             each kernel's PTX what `ptxas -arch=sm_90a -v` says: registers, spill bytes, stack, and whether
             wgmma was serialized for lack of registers (ptxas warning C7511);
  memory     `memory_analysis()`: argument, output, temp and alias bytes;
  loops      every `while` loop that holds collectives (a communication loop: the ring's scan), and for each
             async collective in it whether its start/done pair spans compute (kernels scheduled between the
             start and the done), and which;
  cost       XLA's cost analysis of the optimized per-device module (flops, bytes accessed), computed on the
             host (a deviceless executable has none of its own), with every loop body counted once per
             iteration (XLA's own analysis counts a `while` body once: `weighted_cost`). Custom kernels
             (Pallas/Triton) are opaque to it: their flops are not in it, nor all of their bytes (a
             causal flash fwd+bwd at 4096 tokens counts 17 MB, less than its q, k, v); `flash_flops` counts
             the flash kernels' flops from their launches (see `roofline.py`).

Requirements: the compile-only CUDA plugin and ptxas (`pip install -e ".[gpu-compile]"`, in its own venv:
the plugin makes JAX look for a GPU), and the CPU platform selected before JAX starts a backend
(`JAX_PLATFORMS=cpu`, or `jax.config.update("jax_platforms", "cpu")`): the plugin's device check fails on a
machine without a GPU otherwise. `available()` says whether all of this holds, and why not.

Target configs (XLA's GpuTargetConfigProto, `gpu_targets/*.txtpb`, from openxla/xla) ship as package data.

This module compiles and re-exports the rest, one concern a file: `gpu_target.py` (targets, `available`, abstract
GPUs), `deviceless.py` (shared with `tpu.py`), `gpu_report.py` (the report types), `ptxas.py` (kernels and
ptxas), `hlo_schedule.py` (communication loops and overlap), `hlo_cost.py` (loop-weighted cost, flash flops).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxring.analysis.compiled import host_bytes
from jaxring.analysis.deviceless import abstract, use_deviceless
from jaxring.analysis.gpu_report import AsyncCollective, CommLoop, GpuCompileReport, Kernel
from jaxring.analysis.gpu_target import (
    DEFAULT_TARGET,
    SM_ARCH,
    TARGETS,
    available,
    gpu_devices,
    gpu_mesh,
    lowering_for,
    target_config,
)
from jaxring.analysis.hlo_cost import flash_flops, host_cost_analysis, kernel_executions, weighted_cost
from jaxring.analysis.hlo_schedule import communication_loops, entry_collectives
from jaxring.analysis.ptxas import parse_ptxas, ptxas_path, read_kernels, run_ptxas

__all__ = [
    "DEFAULT_TARGET",
    "SM_ARCH",
    "TARGETS",
    "AsyncCollective",
    "CommLoop",
    "GpuCompileReport",
    "Kernel",
    "abstract",
    "available",
    "communication_loops",
    "compile_for_gpu",
    "entry_collectives",
    "flash_flops",
    "gpu_devices",
    "gpu_mesh",
    "host_cost_analysis",
    "kernel_executions",
    "lowering_for",
    "parse_ptxas",
    "ptxas_path",
    "read_kernels",
    "run_ptxas",
    "target_config",
    "use_deviceless",
    "weighted_cost",
]


def compile_for_gpu(
    fn: Callable[..., Any] | jax.stages.Lowered,
    *args: Any,
    target: str | None = None,
    ptxas: bool | str = True,
    dump_dir: str | None = None,
    compiler_options: dict | None = None,
    fail_on_spills: bool = False,
    **kwargs: Any,
) -> GpuCompileReport:
    """Compiles `fn(*args, **kwargs)` for the GPUs its arguments are sharded on, and reports on it.

    fn: a `jax.jit`-ed function, a plain function (jitted here), or a `Lowered` (then no args; lowered inside
      `lowering_for(device)` if it holds Pallas kernels). Its abstract args (`abstract(...)`) carry shardings
      over a mesh of `gpu_devices(target, N)`.
    target: "h100"/"h200"; default: read from the devices (only used for labels).
    ptxas: True runs ptxas on every kernel's PTX; a string runs it on kernels whose name matches this regex;
      False skips it.
    dump_dir: where XLA dumps the module (default: a temporary directory, removed afterwards).
    compiler_options: extra XLA debug options for this compile (e.g. {"xla_gpu_enable_latency_hiding_scheduler":
      True}).
    fail_on_spills: make a kernel's register spill a compile error (XLA's own check, as ptxas compiles the PTX).
      XLA of jax 0.11 and 0.12 dumps no PTX of the Pallas (Triton) kernels, so `ptxas` finds none to read there
      (their registers and wgmma notes stay None) and this is how a spill shows.
    """
    lowered = fn if hasattr(fn, "compile") and not args and not kwargs and hasattr(fn, "as_text") else None
    if lowered is None:
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
        with lowering_for(_device_of_args(args, kwargs)):
            lowered = jitted.lower(*args, **kwargs)
    own_dir = dump_dir is None
    dump_dir = tempfile.mkdtemp(prefix="jaxring_gpu_") if own_dir else dump_dir
    try:
        # XLA's default backend level (3), as a real GPU build has it: an XLA_FLAGS level (the tests set 0 for
        # XLA:CPU's compile time) would change the kernels' PTX (-O0: 243 registers, serialized wgmma)
        options = {"xla_dump_to": dump_dir, "xla_backend_optimization_level": 3, **(compiler_options or {})}
        if fail_on_spills:
            options["xla_gpu_fail_ptx_compilation_on_register_spilling"] = True
        start = time.perf_counter()
        compiled = lowered.compile(compiler_options=options)
        seconds = time.perf_counter() - start
        hlo = compiled.as_text()
        devices = _devices_of(compiled)
        kernels = read_kernels(dump_dir, ptxas)
    finally:
        if own_dir:
            shutil.rmtree(dump_dir, ignore_errors=True)
    mem = compiled.memory_analysis()
    memory = {
        "argument": mem.argument_size_in_bytes,
        "output": mem.output_size_in_bytes,
        "temp": mem.temp_size_in_bytes,
        "alias": mem.alias_size_in_bytes,
        "host_temp": mem.host_temp_size_in_bytes,  # buffers in host memory (offloaded values)
        # all of the program's host memory per device: offloaded values, and state kept there (--offload)
        "host": int(host_bytes(mem)),
    }
    name = target or _target_of(devices)
    return GpuCompileReport(
        name,
        len(devices) if devices else 0,
        kernels,
        memory,
        communication_loops(hlo),
        host_cost_analysis(compiled),
        hlo,
        seconds,
        entry_collectives(hlo),
    )


def _device_of_args(args: tuple, kwargs: dict) -> Any:
    """A device the abstract arguments are sharded over (None if none is)."""
    for leaf in jax.tree.leaves((args, kwargs)):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and getattr(sharding, "device_set", None):
            return next(iter(sharding.device_set))
    return None


def _devices_of(compiled: jax.stages.Compiled) -> list:
    try:
        leaves = jax.tree.leaves(compiled.input_shardings[0])  # the arguments may be pytrees
        return list(leaves[0].device_set) if leaves else []
    except Exception:
        return []


def _target_of(devices: Sequence[jax.Device]) -> str:
    kind = getattr(devices[0], "device_kind", "") if devices else ""
    return "h200" if "H200" in kind else "h100" if "H100" in kind else kind or "gpu"
