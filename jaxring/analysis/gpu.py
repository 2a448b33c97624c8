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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import importlib.resources
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from jaxring.analysis.compiled import computation_runs, hlo_computations
from jaxring.core import compat

if TYPE_CHECKING:
    from jax.sharding import Mesh, PartitionSpec

TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
DEFAULT_TARGET = "h200"
SM_ARCH = "sm_90a"


# ---------------------------------------------------------------------------------------------- set-up


def target_config(target: str = DEFAULT_TARGET) -> str:
    """The GpuTargetConfigProto text of a target ("h100" or "h200")."""
    if target not in TARGETS:
        raise ValueError(f"unknown GPU target {target!r}; expected one of {', '.join(TARGETS)}")
    return (importlib.resources.files("jaxring.analysis") / "gpu_targets" / TARGETS[target]).read_text()


def ptxas_path() -> str | None:
    """ptxas from the nvidia-cuda-nvcc-cu12 wheel (or PATH), or None."""
    try:
        import nvidia.cuda_nvcc

        for root in list(getattr(nvidia.cuda_nvcc, "__path__", [])):
            candidate = os.path.join(root, "bin", "ptxas")
            if os.access(candidate, os.X_OK):
                return candidate
    except ImportError:
        pass
    return shutil.which("ptxas")


def _cuda_plugin_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ImportError:
        return False


def available() -> tuple[bool, str]:
    """(True, "") when GPU targets can be compiled here, else (False, the reason)."""
    if not _cuda_plugin_installed():
        return False, (
            "the compile-only CUDA plugin (jax-cuda12-plugin) is not installed: "
            "install the gpu-compile extra in a venv of its own (VENV=.venv-gpu bash tools/setup.sh gpu-compile)"
        )
    platforms = jax.config.jax_platforms
    if platforms not in ("cpu", None, ""):
        return False, f"jax_platforms is {platforms!r}; deviceless GPU compilation needs 'cpu' (JAX_PLATFORMS=cpu)"
    if not platforms and compat.backends_started():
        return False, (
            "JAX started its backends without jax_platforms='cpu'; set JAX_PLATFORMS=cpu before "
            "JAX starts (the CUDA plugin's device check fails without a GPU)"
        )
    try:
        _topology(DEFAULT_TARGET, 1)
    except Exception as e:
        return False, f"the cuda topology is not available: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return True, ""


def use_deviceless() -> None:
    """Selects the CPU platform (required by deviceless GPU compilation) if no backend has started yet."""
    if not compat.backends_started():
        jax.config.update("jax_platforms", "cpu")


@functools.cache
def _topology(target: str, num_devices: int):
    from jax.experimental import topologies

    use_deviceless()
    return topologies.get_topology_desc(
        platform="cuda", target_config=target_config(target), topology=f"1x1x{num_devices}"
    )


def gpu_devices(target: str = DEFAULT_TARGET, num_devices: int = 8) -> list:
    """`num_devices` abstract GPUs of one host (no GPU needed): pass them to `jaxring.make_mesh(devices=...)`."""
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r} must be a positive integer")
    return list(_topology(target, num_devices).devices)


def lowering_for(device: Any) -> contextlib.AbstractContextManager:
    """The context in which `jax.jit(f).lower(...)` lowers for `device`'s GPU (an abstract GPU of a topology).

    Pallas' Triton lowering reads the GPU it compiles for from the context's abstract mesh, else from JAX's
    default device (jax 0.11.2, 0.12.x), which in a deviceless compile is the host's CPU ("No supported GPU
    devices found"). An empty abstract mesh naming the device's kind is all it needs; nothing else reads it. A
    device that is not a GPU gets a context that changes nothing."""
    if getattr(device, "platform", None) != "gpu":
        return contextlib.nullcontext()
    kind = jax.sharding.AbstractDevice(device.device_kind, getattr(device, "core_count", None), "gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=kind))


def gpu_mesh(axes: dict[str, int], target: str = DEFAULT_TARGET) -> Mesh:
    """A `jax.sharding.Mesh` (Auto axes) of abstract GPUs, e.g. gpu_mesh({"sp": 8})."""
    import math

    import numpy as np
    from jax.sharding import Mesh

    devices = gpu_devices(target, math.prod(axes.values()))
    return Mesh(np.array(devices).reshape(tuple(axes.values())), tuple(axes))


def abstract(
    shape: Sequence[int], dtype: jax.typing.DTypeLike, mesh: Mesh, spec: PartitionSpec | None = None
) -> jax.ShapeDtypeStruct:
    """A `jax.ShapeDtypeStruct` sharded as `spec` (default replicated) over `mesh`."""
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, spec or PartitionSpec()))


# ---------------------------------------------------------------------------------------------- report


@dataclasses.dataclass
class Kernel:
    """One GPU kernel: launch shape from the thunk sequence, resources from ptxas."""

    name: str
    launches: int
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    shared_memory: int  # bytes per block
    registers: int | None = None  # per thread (None: ptxas not run)
    spill_stores: int | None = None  # bytes
    spill_loads: int | None = None
    stack_frame: int | None = None
    wgmma_serialized: bool | None = None  # ptxas C7511
    ptxas_notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def spills(self) -> int | None:
        return None if self.spill_stores is None else self.spill_stores + self.spill_loads


@dataclasses.dataclass
class AsyncCollective:
    """One async collective in a loop body and what the schedule puts between its start and its done."""

    name: str
    kind: str
    shape: str
    spans: list[str]  # compute ops (kernels) scheduled between start and done
    carried: bool = False  # started in an earlier iteration (or before the loop)

    @property
    def spans_compute(self) -> bool:
        return self.carried or bool(self.spans)


@dataclasses.dataclass
class CommLoop:
    """A `while` loop whose body holds collectives (a ring)."""

    body: str
    trip_count: int | None
    compute: list[str]  # compute ops of the body, in schedule order
    collectives: list[AsyncCollective]
    sync_collectives: list[str]  # collectives issued synchronously (no start/done pair)

    @property
    def overlapped(self) -> bool:
        """Every collective is async and spans compute (trivially true for a loop without compute)."""
        return not self.sync_collectives and all(c.spans_compute for c in self.collectives)


@dataclasses.dataclass
class GpuCompileReport:
    target: str
    num_devices: int
    kernels: list[Kernel]
    memory: dict[str, int]
    loops: list[CommLoop]
    cost: dict[str, float]
    hlo: str = dataclasses.field(repr=False)
    compile_seconds: float = 0.0
    entry: CommLoop | None = None  # collectives outside loops, with the same overlap analysis

    def kernel(self, name: str) -> Kernel:
        """The kernel called `name` (exactly, or as the only kernel whose name starts with it)."""
        hits = [k for k in self.kernels if k.name == name] or [k for k in self.kernels if k.name.startswith(name)]
        if len(hits) != 1:
            raise KeyError(f"{len(hits)} kernels match {name!r}: {[k.name for k in self.kernels][:40]}")
        return hits[0]

    def custom_kernels(self, prefix: str = "jaxring_") -> list[Kernel]:
        return [k for k in self.kernels if k.name.startswith(prefix)]

    @property
    def peak_bytes(self) -> int:
        m = self.memory
        return m["argument"] + m["output"] + m["temp"] - m["alias"]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("hlo")
        pairs = list(zip(d["loops"], self.loops)) + ([(d["entry"], self.entry)] if self.entry else [])
        for loop, src in pairs:
            loop["overlapped"] = src.overlapped
            for c, c_src in zip(loop["collectives"], src.collectives):
                c["spans_compute"] = c_src.spans_compute
        d["peak_bytes"] = self.peak_bytes
        return d

    def summary(self, kernel_prefix: str = "jaxring_") -> str:
        lines = [
            f"{self.target} x {self.num_devices}: compiled in {self.compile_seconds:.1f} s; per device "
            f"args {self.memory['argument'] / 2**20:.1f} MiB, temp {self.memory['temp'] / 2**20:.1f} MiB, "
            f"out {self.memory['output'] / 2**20:.1f} MiB"
        ]
        for k in self.custom_kernels(kernel_prefix) or self.kernels:
            lines.append(
                f"  kernel {k.name}: grid {list(k.grid)}, threads {k.threads[0]}, smem {k.shared_memory} B,"
                f" regs {k.registers}, spills {k.spill_stores}/{k.spill_loads} B, "
                f"wgmma serialized {k.wgmma_serialized}"
            )
        for loop in self.loops + ([self.entry] if self.entry else []):
            what = "outside loops" if loop is self.entry else f"loop {loop.body} (x{loop.trip_count})"
            lines.append(f"  {what}: {len(loop.compute)} compute ops, overlapped {loop.overlapped}")
            for c in loop.collectives:
                what = "carried across iterations" if c.carried else f"spans {len(c.spans)} compute ops"
                lines.append(f"    {c.kind} {c.name} {c.shape}: {what}")
            for name in loop.sync_collectives:
                lines.append(f"    synchronous {name}")
        return "\n".join(lines)


# -------------------------------------------------------------------------------------------- compiling


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
    import time

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
        "host": mem.host_argument_size_in_bytes
        + mem.host_output_size_in_bytes
        + mem.host_temp_size_in_bytes
        - mem.host_alias_size_in_bytes,
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


_COST_KEYS = ("flops", "transcendentals", "bytes accessed")


def host_cost_analysis(compiled: jax.stages.Compiled) -> dict[str, float]:
    """XLA's HloCostAnalysis of the compiled (optimized, per-device) module, run by the host's CPU client,
    loop bodies weighted by their trip counts (`weighted_cost`). {} when it cannot be computed. The key
    "loops_weighted" is 1.0, or 0.0 where the module could not be re-parsed and the figures are XLA's own
    (every loop body counted once)."""
    try:
        return weighted_cost(compiled.as_text())
    except Exception:
        pass
    try:
        costs = compat.executable_cost_analysis(compiled)
    except Exception:
        return {}
    return {k: float(sum(c.get(k, 0.0) for c in costs)) for k in _COST_KEYS} | {"loops_weighted": 0.0}


def weighted_cost(hlo: str) -> dict[str, float]:
    """flops, transcendentals and bytes accessed of one execution of a compiled module (its `as_text()`).

    XLA's HloCostAnalysis counts a `while` body once (it does not read trip counts), so a scanned layer
    stack or a ring loop is undercounted by its trip count. Here the module is re-parsed with each loop body
    as the entry, each body analysed on its own, and a computation's cost is
        cost(c) = XLA(c) - sum over loops w in c of XLA(body_w) + trip_w * cost(body_w)
    (nested loops recursively; a loop without a known trip count counts once). Conditionals are XLA's
    (the costlier branch).
    """
    lines = hlo.split("\n")
    if not lines or not lines[0].startswith("HloModule"):
        raise ValueError("not an HLO module text (no 'HloModule' header)")
    lines[0] = lines[0].split(",")[0]  # drop schedule, aliasing and layout attributes
    unrooted = "\n".join(lines)
    entry = re.search(r"^ENTRY %([\w.\-]+) ", unrooted, re.M)
    if entry is None:
        raise ValueError("the HLO module has no ENTRY computation")
    unrooted = unrooted.replace("ENTRY %", "%", 1)
    comps, _ = _parse(hlo)
    xla_memo: dict[str, dict] = {}

    def xla(name: str) -> dict[str, float]:
        if name not in xla_memo:
            text = re.sub(r"^%" + re.escape(name) + r" ", "ENTRY %" + name + " ", unrooted, count=1, flags=re.M)
            cost = compat.hlo_cost_analysis(text)
            xla_memo[name] = {k: float(cost.get(k, 0.0)) for k in _COST_KEYS}
        return xla_memo[name]

    def loops_in(name: str, seen: set[str]) -> list[tuple[str, int]]:
        """(body, trip) of the while loops run by `name` itself or by what it calls, loops not entered."""
        found = []
        for instr in comps.get(name, []):
            if instr.opcode == "while":
                trip = _TRIP.search(instr.rest)
                found.append((re.search(r"body=%([\w.\-]+)", instr.rest).group(1), int(trip.group(1)) if trip else 1))
            elif instr.opcode in ("conditional", "call", "async-start"):
                for callee in _callees(instr):
                    if callee not in seen:
                        seen.add(callee)
                        found += loops_in(callee, seen)
        return found

    memo: dict[str, dict] = {}

    def cost(name: str) -> dict[str, float]:
        if name not in memo:
            total = dict(xla(name))
            for body, trip in loops_in(name, {name}):
                inner, once = cost(body), xla(body)
                for k in _COST_KEYS:
                    total[k] += trip * inner[k] - once[k]
            memo[name] = total
        return memo[name]

    return cost(entry.group(1)) | {"loops_weighted": 1.0}


# flash kernels: matmuls per (query row, key column, head dim) of each kernel, 2 flops a multiply-add
_FLASH_MATMULS = {
    "jaxring_flash_fwd": 2,  # S = Q Kᵀ, O += P V
    "jaxring_flash_dq": 3,  # S, dP = dO Vᵀ, dQ += dS K
    "jaxring_flash_dkv": 4,
}  # S, dP, dV += Pᵀ dO, dK += dSᵀ Q
_LAUNCH_NAME = re.compile(r"\b(jaxring_flash_(?:fwd|dq|dkv))\b")
_CONSTRAINTS = re.compile(r"operand_layout_constraints=\{(.*?)\}, [a-z_]+=")


def kernel_executions(hlo: str) -> dict[str, list[tuple[list[str], int]]]:
    """The flash kernels' launches of one program execution: name -> [(operand shapes, executions)], one
    entry per launch site, executions from the enclosing loops' trip counts (both branches of a conditional
    count, as if no block were skipped)."""
    comps, entry = hlo_computations(hlo)
    runs = computation_runs(comps, entry)
    found: dict[str, list] = {}
    for comp, times in runs.items():
        for line in comps.get(comp, []):
            if "custom-call(" not in line or not (name := _LAUNCH_NAME.search(line)):
                continue
            shapes = re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", m.group(1)) if (m := _CONSTRAINTS.search(line)) else []
            found.setdefault(name.group(1), []).append((shapes, times))
    return found


def flash_flops(hlo: str, causal: bool = True) -> float:
    """FLOPs of the flash kernels in one execution of a compiled program, from their launches: per launch
    (matmuls) x 2·b·h·n·m·d with q [b, n, h, d] and k [b, m, h_kv, d] its first two 4-D operands; causal
    programs count half (the tiles above the diagonal are skipped; exact up to the diagonal tiles). Blocks a
    ring skips at run time (lax.cond) are counted as run."""
    total = 0.0
    for name, launches in kernel_executions(hlo).items():
        for shapes, times in launches:
            four_d = [[int(d) for d in s[s.index("[") + 1 : -1].split(",")] for s in shapes if s.count(",") == 3]
            if len(four_d) < 2:
                raise ValueError(f"{name}: cannot read q and k shapes from its launch ({shapes})")
            (b, n, h, d), (_, m, _, _) = four_d[0], four_d[1]
            total += times * _FLASH_MATMULS[name] * 2.0 * b * h * n * m * d
    return total * (0.5 if causal else 1.0)


# ------------------------------------------------------------------------------------------- kernels

_THUNK = re.compile(
    r"kCustomKernel.*?\]\s+(\S+)\s+grid:\s*\[(\d+),\s*(\d+),\s*(\d+)\]\s+threads:\s*"
    r"\[(\d+),\s*(\d+),\s*(\d+)\]\s+shared_memory:\s*(\d+)"
)
_ENTRY = re.compile(r"\.visible\s+\.entry\s+([\w$.]+)\(")
_PTXAS_FN = re.compile(r"Function properties for ([\w$.]+)")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_NOTE_FN = re.compile(r"in (?:the )?function '([\w$.]+)'")


def read_kernels(dump_dir: str, ptxas: bool | str = True) -> list[Kernel]:
    """Kernels of the dumped module: launch shapes from `*thunk_sequence.txt`, resources from ptxas."""
    kernels: dict[str, Kernel] = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt"))):
        for m in _THUNK.finditer(pathlib.Path(path).read_text()):
            name = m.group(1)
            dims = [int(x) for x in m.groups()[1:8]]
            if name in kernels:
                kernels[name].launches += 1
            else:
                kernels[name] = Kernel(name, 1, tuple(dims[0:3]), tuple(dims[3:6]), dims[6])
    if ptxas:
        pattern = re.compile(ptxas) if isinstance(ptxas, str) else None
        exe = ptxas_path()
        if exe is None:
            raise RuntimeError("ptxas was not found (pip install nvidia-cuda-nvcc-cu12, or pass ptxas=False)")
        for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
            names = _ENTRY.findall(pathlib.Path(path).read_text())
            if pattern is not None and not any(pattern.search(n) for n in names):
                continue
            for name, info in run_ptxas(path, exe).items():
                k = kernels.setdefault(name, Kernel(name, 0, (0, 0, 0), (0, 0, 0), 0))
                for field, value in info.items():
                    setattr(k, field, value)
    return list(kernels.values())


def run_ptxas(ptx_path: str, exe: str | None = None) -> dict[str, dict]:
    """`ptxas -arch=sm_90a -v` on one PTX file: see `parse_ptxas`."""
    exe = exe or ptxas_path()
    out = subprocess.run(
        [exe, f"-arch={SM_ARCH}", "-v", ptx_path, "-o", os.devnull], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise RuntimeError(f"ptxas failed on {ptx_path}: {(out.stdout + out.stderr)[-2000:]}")
    return parse_ptxas(out.stdout + out.stderr)


def parse_ptxas(text: str) -> dict[str, dict]:
    """ptxas -v output -> {entry: registers, spill_stores, spill_loads, stack_frame, wgmma_serialized,
    ptxas_notes (the lines naming the entry, e.g. C7511: wgmma serialized for lack of registers)}."""
    info: dict[str, dict] = {}
    notes: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if m := _NOTE_FN.search(line):
            notes.setdefault(m.group(1), []).append(line.split(":", 1)[-1].strip())
        if m := _PTXAS_FN.search(line):
            current = info.setdefault(m.group(1), {})
        elif current is not None and (m := _SPILLS.search(line)):
            current.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _REGS.search(line)):
            current["registers"] = int(m.group(1))
    for name, d in info.items():
        d["ptxas_notes"] = notes.get(name, [])
        d["wgmma_serialized"] = any("C7511" in n for n in d["ptxas_notes"])
    return info


# ---------------------------------------------------------------------------------------- schedule

_COMP_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_INSTR = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_OPERANDS = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_COLLECTIVES = (
    "collective-permute",
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-broadcast",
    "ragged-all-to-all",
)
_NOT_COMPUTE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "copy-start",
    "copy-done",
    "partition-id",
    "replica-id",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "iota",
    "send",
    "send-done",
    "recv",
    "recv-done",
    "copy",
}


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    rest: str


def _parse(hlo: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """Computations of an HLO module (instructions in schedule order) and the entry computation's name."""
    comps, current, entry = {}, None, None
    for line in hlo.splitlines():
        if not line.startswith(" ") and (m := _COMP_HEADER.match(line)) and line.rstrip().endswith("{"):
            current = comps.setdefault(m.group(1), [])
            entry = m.group(1) if line.startswith("ENTRY") else entry
        elif current is not None and (m := _INSTR.match(line)):
            current.append(_Instr(m.group(1), m.group(2), m.group(3), m.group(4)))
    return comps, entry


def _callees(instr: _Instr) -> list[str]:
    names = _CALLED.findall(instr.rest)
    for group in _BRANCHES.findall(instr.rest):
        names += _OPERANDS.findall(group)
    return names


def _collective_kind(instr: _Instr, comps: dict[str, list[_Instr]]) -> str | None:
    """The collective an instruction is (or starts), else None."""
    op = instr.opcode.removesuffix("-start").removesuffix("-done")
    if op in _COLLECTIVES:
        return op
    if instr.opcode in ("async-start", "async-done"):
        for callee in _callees(instr):
            for inner in comps.get(callee, []):
                if inner.opcode in _COLLECTIVES:
                    return inner.opcode
    return None


def _is_compute(instr: _Instr, comps: dict[str, list[_Instr]], memo: dict) -> bool:
    """Heavy work: custom calls (Pallas/Triton kernels, cuBLAS/cuDNN), dots and convolutions, fusions holding
    them, and control flow (conditional, call, while) holding any of these. Elementwise fusions, copies and
    slices do not count: overlap is about hiding a transfer behind the block compute."""
    if instr.opcode in _NOT_COMPUTE or instr.opcode.endswith(("-start", "-done")) or _collective_kind(instr, comps):
        return False
    if instr.opcode in ("custom-call", "dot", "convolution"):
        return True
    if instr.opcode == "fusion" and "kind=kCustom" in instr.rest:
        return True
    if instr.opcode in ("fusion", "conditional", "call", "while"):
        return any(_computation_computes(c, comps, memo) for c in _callees(instr))
    return False


def _computation_computes(name: str, comps: dict[str, list[_Instr]], memo: dict) -> bool:
    if name not in memo:
        memo[name] = False
        memo[name] = any(_is_compute(i, comps, memo) for i in comps.get(name, []))
    return memo[name]


def _short(shape: str) -> str:
    """HLO shape text without layouts: bf16[1,4096,8,128]{3,2,1,0} -> bf16[1,4096,8,128]."""
    return re.sub(r"\{[0-9,]*\}", "", shape)


def entry_collectives(hlo: str) -> CommLoop | None:
    """The collectives of the entry computation (outside any loop: a ring XLA unrolled, team collectives)."""
    comps, entry = _parse(hlo)
    return None if entry is None else _loop_report(entry, comps, {}, 1)


def communication_loops(hlo: str) -> list[CommLoop]:
    """Every while loop of a scheduled HLO module whose body holds collectives, with their overlap."""
    comps, _ = _parse(hlo)
    memo: dict = {}
    loops = []
    for instrs in comps.values():
        for w in instrs:
            if w.opcode != "while":
                continue
            body = re.search(r"body=%([\w.\-]+)", w.rest).group(1)
            trip = _TRIP.search(w.rest)
            loop = _loop_report(body, comps, memo, int(trip.group(1)) if trip else None)
            if loop is not None:
                loops.append(loop)
    return loops


def _loop_report(body: str, comps: dict[str, list[_Instr]], memo: dict, trip: int | None) -> CommLoop | None:
    instrs = comps.get(body, [])
    position = {i.name: n for n, i in enumerate(instrs)}
    compute = [i.name for i in instrs if _is_compute(i, comps, memo)]
    compute_at = {i.name: n for n, i in enumerate(instrs) if i.name in set(compute)}
    asyncs, sync, started = [], [], set()
    for n, instr in enumerate(instrs):
        kind = _collective_kind(instr, comps)
        if kind is None:
            continue
        if instr.opcode.endswith("-start"):
            started.add(instr.name)
            done = next(
                (
                    j
                    for j in instrs[n + 1 :]
                    if j.opcode.endswith("-done") and instr.name in _OPERANDS.findall(j.rest.split("),")[0] + ")")
                ),
                None,
            )
            end = position[done.name] if done else len(instrs)
            spans = [c for c, at in compute_at.items() if n < at < end]
            asyncs.append(AsyncCollective(instr.name, kind, _short(instr.shape), spans, carried=done is None))
        elif instr.opcode.endswith("-done"):
            start = _OPERANDS.findall(instr.rest)
            if start and start[0] not in position:  # started outside this body: in flight across iterations
                asyncs.append(AsyncCollective(start[0], kind, _short(instr.shape), [], carried=True))
        else:
            sync.append(instr.name)
    if not asyncs and not sync:
        return None
    return CommLoop(body, trip, compute, asyncs, sync)
