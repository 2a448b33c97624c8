"""Compile any jaxring program for a Cloud TPU slice with no TPU present (deviceless AOT), and read what the TPU
compiler made of it: the TPU counterpart of `jaxring.analysis.gpu`.

    from jaxring.analysis import tpu
    mesh = jaxring.make_mesh(sp=8, devices=tpu.tpu_devices("v6e-8"))
    q = tpu.abstract((1, 32768, 8, 128), jnp.bfloat16, mesh, P(None, "sp"))
    report = tpu.compile_for_tpu(jax.jit(step), q, k, v)       # or compile_for_tpu(lowered)
    print(report.summary())

Targets are named as Cloud TPU names its slices (`TARGETS`): v5p counts TensorCores (v5p-8 is 4 chips), v5e and
v6e count chips, TPU7x counts TensorCores (tpu7x-8 is 4 chips, which jax shows as 8 devices). The devices come
from `jax.experimental.topologies.get_topology_desc` (libtpu's topology, no TPU needed); a one-axis mesh over them
rings along the torus (`jaxring.core.torus`).

The report holds, per device: `memory_analysis()` (argument, output, temp, alias bytes, and host bytes with
--offload) and the Mosaic kernels in the compiled HLO (`tpu_custom_call`: the Pallas TPU block compute).

Requirements: libtpu (`pip install -e ".[tpu-compile]"`, jax[tpu] of the project's jax) and the CPU platform
selected before JAX starts a backend (`JAX_PLATFORMS=cpu`), as for GPU targets. libtpu's multi-process lock is
waived (ALLOW_MULTIPLE_LIBTPU_LOAD): a deviceless compile holds no TPU, and several may run at once.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxring.analysis.compiled import host_bytes
from jaxring.analysis.deviceless import abstract, use_deviceless
from jaxring.core import compat

__all__ = ["BLOCK_OPS", "TARGETS", "TpuCompileReport", "TpuTarget", "abstract", "available", "compile_for_tpu"]

# The attention's per-block compute on a TPU target: jaxring's Pallas TPU (Mosaic) kernels (kernels/tpu_blocks.py)
BLOCK_OPS = "pallas_tpu"
MOSAIC_CALL = "tpu_custom_call"  # the custom-call target of a Mosaic kernel in the compiled HLO


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """A Cloud TPU slice: libtpu's topology name, its chips and JAX devices, the planner's device, host memory."""

    topology: str  # get_topology_desc's name, e.g. "v5p:2x2x1"
    chips: int
    devices: int  # JAX devices (TPU7x: two per chip)
    device: str  # the planner's (jaxring.planner.cluster.DEVICES) and accelerators' name
    host_gib_per_device: float  # the VM's memory over its devices (what --offload may keep there)
    hbm_gib_per_chip: int
    wrap: bool = False  # the slice is a torus (v5p from a 4x4x4 cube); smaller slices are open grids


# Host memory: Cloud TPU's VM types: v5e ct5lp-hightpu-8t 384 GB over 8 chips, v5p ct5p-hightpu-4t 448 GB over
# 4, v6e ct6e-standard-8t 1,440 GB over 8, TPU7x tpu7x-standard-4t 960 GB over 4 chips (8 devices).
TARGETS = {
    "v5e-4": TpuTarget("v5e:2x2", 4, 4, "tpu-v5e", 384 / 8, 16),
    "v5e-8": TpuTarget("v5e:2x4", 8, 8, "tpu-v5e", 384 / 8, 16),
    "v5p-8": TpuTarget("v5p:2x2x1", 4, 4, "tpu-v5p", 448 / 4, 95),
    "v5p-16": TpuTarget("v5p:2x2x2", 8, 8, "tpu-v5p", 448 / 4, 95),
    "v5p-128": TpuTarget("v5p:4x4x4", 64, 64, "tpu-v5p", 448 / 4, 95, wrap=True),
    "v6e-4": TpuTarget("v6e:2x2", 4, 4, "tpu-v6e", 1440 / 8, 32),
    "v6e-8": TpuTarget("v6e:2x4", 8, 8, "tpu-v6e", 1440 / 8, 32),
    "tpu7x-8": TpuTarget("tpu7x:2x2x1", 4, 8, "tpu7x", 960 / 8, 192),
}
TARGETS["v5litepod-4"], TARGETS["v5litepod-8"] = TARGETS["v5e-4"], TARGETS["v5e-8"]  # Cloud's v5e type names
INSTALL = 'pip install -e ".[tpu-compile]"'


def target(name: str) -> TpuTarget:
    """The slice called `name`; ValueError naming the known ones."""
    if name not in TARGETS:
        raise ValueError(f"unknown TPU target {name!r}; expected one of {', '.join(TARGETS)}")
    return TARGETS[name]


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def available() -> tuple[bool, str]:
    """(True, "") when TPU targets can be compiled here, else (False, the reason in one line)."""
    if not libtpu_installed():
        return False, f"libtpu is not installed: {INSTALL} (jax[tpu] of this jax, {jax.__version__})"
    platforms = jax.config.jax_platforms
    if platforms not in ("cpu", None, ""):
        return False, f"jax_platforms is {platforms!r}; deviceless TPU compilation needs 'cpu' (JAX_PLATFORMS=cpu)"
    if not platforms and compat.backends_started():
        return False, "JAX started its backends without jax_platforms='cpu'; set JAX_PLATFORMS=cpu before JAX starts"
    try:
        _topology("v5e-4")
    except Exception as e:
        return False, f"the TPU topology is not available: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return True, ""


@functools.cache
def _topology(name: str):
    from jax.experimental import topologies

    t = target(name)
    use_deviceless()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu's lock guards real TPUs; there are none
    dims = len(t.topology.split(":")[1].split("x"))
    return topologies.get_topology_desc(
        platform="tpu",
        topology_name=t.topology,
        chip_config_name="default",
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
        wrap=(t.wrap,) * 3 if dims == 3 else (t.wrap, t.wrap, False),
    )


def tpu_devices(name: str) -> list:
    """The abstract devices of a target slice (no TPU needed): pass them to `jaxring.make_mesh(devices=...)`."""
    devices = list(_topology(name).devices)
    if len(devices) != target(name).devices:
        raise ValueError(f"libtpu's {target(name).topology} has {len(devices)} devices, not {target(name).devices}")
    return devices


# ---------------------------------------------------------------------------------------------- report


@dataclasses.dataclass
class TpuCompileReport:
    target: str
    num_devices: int
    memory: dict[str, int]  # argument, output, temp, alias, host, peak (bytes per device)
    mosaic_calls: int  # Mosaic (Pallas TPU) custom calls in the compiled HLO
    hlo: str = dataclasses.field(repr=False)
    compile_seconds: float = 0.0

    @property
    def peak_bytes(self) -> int:
        m = self.memory
        return m["argument"] + m["output"] + m["temp"] - m["alias"]

    @property
    def xla_peak_bytes(self) -> int | None:
        """XLA:TPU's own peak (`peak_memory_in_bytes`): what its compile-time HBM check (E1000 CompileTimeHbmOom)
        compares with the chip's HBM. Below `peak_bytes`: XLA:TPU's `temp` is larger than the buffer assignment's
        preallocated temporaries (see `memory_of`). None with host offload: the peak then counts the host memory
        space too (v6e-8, Llama-3-8B at 3,014,656 tokens, --offload layer_inputs+optimizer: 103.7 GiB, of which
        99.97 the host's; the device's buffer assignment 30.6)."""
        return None if self.memory["host"] else self.memory["peak"]

    def summary(self) -> str:
        m = self.memory
        return (
            f"{self.target} x {self.num_devices}: compiled in {self.compile_seconds:.1f} s; per device args "
            f"{m['argument'] / 2**20:.1f} MiB, temp {m['temp'] / 2**20:.1f} MiB, out {m['output'] / 2**20:.1f} MiB, "
            f"host {m['host'] / 2**20:.1f} MiB; {self.mosaic_calls} Mosaic kernel calls ({MOSAIC_CALL})"
        )


def memory_of(compiled: jax.stages.Compiled) -> dict[str, int]:
    """`memory_analysis()` per device: argument, output, temp, alias and host bytes (host: what --offload keeps),
    and XLA:TPU's peak (`peak_memory_in_bytes`).

    On TPU targets argument + output + temp - alias is above that peak: XLA:TPU (libtpu 0.0.50.1) reports a
    `temp` larger than its buffer assignment's preallocated temporaries (Llama-3-8B, METP tp8 on v6e-8 at
    262,144 tokens: temp 23.27 GiB, the buffer assignment's 16.74, peak 27.64 GiB beside 11.22 of arguments),
    and its compile-time HBM check reads the peak: a scan of 32 layers on v6e-8 compiles with argument + temp at
    31.78 GiB (peak 29.0) and is refused one length up with "HLO temporaries (33.64G) exceeds available HBM
    (31.24G)", its peak by the same slope."""
    m = compiled.memory_analysis()
    host = int(host_bytes(m))
    return {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "alias": m.alias_size_in_bytes,
        "host": host,
        "peak": getattr(m, "peak_memory_in_bytes", 0),
    }


def mosaic_calls(hlo: str) -> int:
    """How many Mosaic kernel calls a compiled TPU module holds (each kernel's call sites)."""
    return len(re.findall(rf'custom_call_target="{MOSAIC_CALL}"', hlo))


def compile_for_tpu(
    fn: Callable[..., Any] | jax.stages.Lowered, *args: Any, target: str = "", **kwargs
) -> TpuCompileReport:
    """Compiles `fn(*args, **kwargs)` for the TPUs its abstract arguments are sharded on (a `jax.jit`-ed or
    plain function, or a `Lowered` with no args), and reports on it. target: a label for the report."""
    if hasattr(fn, "compile") and hasattr(fn, "as_text") and not args and not kwargs:
        lowered = fn
    else:
        lowered = (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*args, **kwargs)
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    hlo = compiled.as_text()
    devices = compiled.input_shardings[0]
    n = len(jax.tree.leaves(devices)[0].device_set) if jax.tree.leaves(devices) else 1
    return TpuCompileReport(target, n, memory_of(compiled), mosaic_calls(hlo), hlo, seconds)
