"""Bytes moved per device, read from the compiled HLO, and per-device memory from `memory_analysis()`.

Both are exact properties of the compiled SPMD program (one program per device), repeatable, and need no
accelerator: papers' communication and memory claims are checked against them.

Bytes are counted as the data each device *receives* over the links, by collective kind, with g the size
of the op's replica group and |x| the op's per-device result in bytes:

  collective-permute  |x|              (a device that only sends to itself moves nothing, not subtracted)
  all-gather          (g-1)/g * |x|
  reduce-scatter      (g-1) * |x|      (= (g-1)/g of the input)
  all-to-all          (g-1)/g * |x|
  all-reduce          2(g-1)/g * |x|   (ring reduce-scatter + all-gather)

XLA:CPU widens bf16 collectives to f32 (convert, send, convert back), so on simulated CPU devices bf16
traffic reads as 4 bytes an element; GPU programs send bf16 as is.

An op inside a `while` loop (a `lax.scan` ring) counts once per iteration, from the loop's known trip
count; a loop without one raises if it holds collectives, rather than give a wrong figure (data-dependent
loops without collectives, like the jnp tile loops, move nothing).

A `conditional` (`lax.switch`, `lax.cond`) runs one of its branches on each device each time: its branch index
is data, unknown to the program's text, so it counts as
  - its branches weighted by how often they run, where the branches declare it (`branch_runs(k, n)`: this
    branch runs k of n times, over the conditional's executions and the devices): the mean over the devices,
    exact. jaxring's pipeline declares each tick's switch from its schedule table (every stage runs one
    branch of its own per tick), so a pp x sp step's ring hops inside the stages' branches count as the
    stages run them;
  - else its branch that receives the most bytes: an upper bound (exact when the branches move the same).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import jax
import numpy as np

KINDS = ("collective-permute", "all-gather", "reduce-scatter", "all-to-all", "all-reduce")
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
# XLA of jax 0.11 and 0.12: the mesh's axes and sizes, and the axes the op spans, e.g.
# replica_groups=mesh['dp'=2,'sp'=4] {'sp'} (device i of the HLO is the mesh's i-th in row-major order)
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")


def shape_bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _tuple_elements(shape_text: str) -> list[str]:
    """The top-level elements of an HLO tuple shape "(a, (b, c), ...)" (commas inside [dims], {layouts} and
    nested tuples kept)."""
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape_text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                out.append(shape_text[start:i].strip())
        elif ch == "," and depth == 1:
            out.append(shape_text[start:i].strip())
            start = i + 1
    return [e for e in out if e]


def _async_result_bytes(kind: str, shape_text: str) -> int:
    """Bytes of an async start op's result. An all-reduce-start's shape is its results (a tuple when combined);
    the others' is (operands, results, context...), the operands and results each one array, or a tuple of
    them when the op moves several (a combined collective-permute)."""
    if kind == "all-reduce":
        return shape_bytes(shape_text)
    elements = _tuple_elements(shape_text)
    return shape_bytes(elements[1] if len(elements) > 1 else elements[0])


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """The replica groups (device indices) of a collective's HLO line, in any of XLA's forms: listed
    ({{0,1},{2,3}}), iota ([2,2]<=[4], with a transpose T(1,0)) or mesh axes (mesh['a'=2,'b'=2] {'b'}); none
    given: every device."""
    if m := _GROUPS_MESH.search(line):
        axes = [(name, int(size)) for name, size in _MESH_AXIS.findall(m.group(1))]
        spanned = set(re.findall(r"'([^']+)'", m.group(2)))
        names = [name for name, _ in axes]
        if not spanned <= set(names) or math.prod(size for _, size in axes) != num_devices:
            raise ValueError(f"replica groups {m.group(0)!r} do not name axes of a mesh of {num_devices} devices")
        ids = np.arange(num_devices).reshape([size for _, size in axes])
        order = [i for i, n in enumerate(names) if n not in spanned] + [i for i, n in enumerate(names) if n in spanned]
        group = math.prod(size for name, size in axes if name in spanned)
        return ids.transpose(order).reshape(-1, group).tolist()
    if m := _GROUPS_IOTA.search(line):
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    if m := _GROUPS_LIST.search(line):
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
        if groups and any(groups):
            return groups
    return [list(range(num_devices))]


def _group_size(line: str, num_devices: int) -> int:
    return len(replica_groups(line, num_devices)[0])


_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_WHILE = re.compile(r"\bwhile\(.*body=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLEES = re.compile(r"(?:to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")


def hlo_computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """HLO computations by name (their instruction lines), and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        if not line.startswith(" ") and (m := _COMPUTATION.match(line)) and line.rstrip().endswith("{"):
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and line.startswith(" "):
            comps[current].append(line)
    return comps, entry


def _calls_any(name: str, comps: dict[str, list[str]], matches: Callable[[str], bool], seen: set | None = None) -> bool:
    """Whether a computation, or any computation it calls (loop bodies and conditions, branches, fusions),
    has an op line for which `matches` holds."""
    seen = set() if seen is None else seen
    if name in seen:
        return False
    seen.add(name)
    for line in comps.get(name, []):
        if matches(line):
            return True
        callees = _CALLEES.findall(line) + re.findall(r"body=%([\w.\-]+)", line)
        for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
            callees += re.findall(r"%([\w.\-]+)", group)
        if any(_calls_any(c, comps, matches, seen) for c in callees):
            return True
    return False


def _has_collectives(name: str, comps: dict[str, list[str]]) -> bool:
    """Whether a computation, or any computation it calls, holds a collective op."""
    return _calls_any(name, comps, lambda line: bool(_OP.search(line)))


_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_RUNS = re.compile(r"jaxring_runs_(\d+)_of_(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def branch_runs(k: int, n: int) -> contextlib.AbstractContextManager:
    """Wrap the body of a `lax.switch` branch: it runs k of n times (over the conditional's executions and the
    devices; the counts of all branches add up to n). A name scope, carried to the compiled HLO as the
    metadata of the ops traced inside it, so the collective counter weights the branch's collectives by k/n
    instead of taking the conditional's largest branch."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"branch runs {k} of {n}: need 0 <= k <= n and n >= 1")
    return jax.named_scope(f"jaxring_runs_{k}_of_{n}")


def _declared_share(line: str) -> Fraction | None:
    """The share of executions declared by `branch_runs` scopes in an op's metadata (their product), or None."""
    name = _OP_NAME.search(line)
    runs = _RUNS.findall(name.group(1)) if name else []
    return math.prod((Fraction(int(k), int(n)) for k, n in runs), start=Fraction(1)) if runs else None


def _declares_runs(name: str, comps: dict[str, list[str]]) -> bool:
    """Whether a computation, or any computation it calls, holds a collective under a `branch_runs` scope."""
    return _calls_any(name, comps, lambda line: bool(_OP.search(line)) and _declared_share(line) is not None)


def _defined(name: str, lines: list[str]) -> str | None:
    """The instruction line that defines %name among `lines`."""
    return next((x for x in lines if re.match(rf"\s*(?:ROOT )?%{re.escape(name)} = ", x)), None)


def _constant(name: str, lines: list[str]) -> int | None:
    """The integer a scalar %name holds when it is a constant (through copies), else None."""
    for _ in range(8):
        line = _defined(name, lines)
        if line is None:
            return None
        if m := re.search(r"\bconstant\((-?\d+)\)", line):
            return int(m.group(1))
        if not (m := re.search(r"\bcopy\(%([\w.\-]+)\)", line)):
            return None
        name = m.group(1)
    return None


def _counted_trip(line: str, caller: list[str], comps: dict[str, list[str]]):
    """The trip count of a `while` whose HLO states none (XLA:TPU's): a counter in tuple element i, started at a
    constant K and compared `< N` with a constant in the condition, runs N - K times (as `fori_loop` and `scan`
    lower). A match object's stand-in (`.group(1)`), or None."""
    cond = re.search(r"condition=%([\w.\-]+)", line)
    init = re.search(r"\bwhile\(%([\w.\-]+)\)", line)
    lines = comps.get(cond.group(1), []) if cond else []
    root = next((x for x in lines if x.lstrip().startswith("ROOT")), "")
    cmp = re.search(r"compare\(%([\w.\-]+), %([\w.\-]+)\), direction=LT", root)
    if not (cmp and init):
        return None
    gte = _defined(cmp.group(1), lines) or ""
    index = re.search(r"get-tuple-element\(.*\), index=(\d+)", gte)
    limit = _constant(cmp.group(2), lines)
    tuple_line = _defined(init.group(1), caller) or ""
    operands = re.search(r"\btuple\((.*?)\)(?:, |$)", tuple_line)
    if not (index and limit is not None and operands):
        return None
    names = re.findall(r"%([\w.\-]+)", re.sub(r"/\*index=\d+\*/", "", operands.group(1)))
    start = _constant(names[int(index.group(1))], caller) if int(index.group(1)) < len(names) else None
    if start is None:
        return None
    return re.match(r"(\d+)", str(max(limit - start, 0)))


def computation_runs(
    comps: dict[str, list[str]], entry: str, *, one_branch: bool = False, devices: int = 1
) -> dict[str, int]:
    """How many times each computation runs per program execution (loop bodies times their trip count).
    Every branch of a conditional counts as running each time, unless `one_branch`: then branches that
    declare their runs (`branch_runs`) are all visited (their ops weighted by the caller) and otherwise only
    the branch whose collectives receive the most bytes (an op without replica groups spans `devices`)."""
    runs: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        runs[name] = runs.get(name, 0) + times
        for line in comps.get(name, []):
            if m := _WHILE.search(line):
                trip = _TRIP.search(line) or _counted_trip(line, comps.get(name, []), comps)
                if trip is None:
                    if _has_collectives(m.group(1), comps):
                        raise ValueError(f"while loop {m.group(1)} has no known trip count; its traffic is unknown")
                    continue  # a data-dependent loop without collectives (e.g. a tile loop): moves nothing
                visit(m.group(1), times * int(trip.group(1)))
            for callee in _CALLEES.findall(line):
                if callee in comps and not callee.startswith(("fused", "wrapped")):
                    visit(callee, times)
            for group in _BRANCHES.findall(line):
                branches = re.findall(r"%([\w.\-]+)", group)
                if one_branch and not any(_declares_runs(c, comps) for c in branches):
                    branches = [max(branches, key=lambda c: _received(comps, c, devices))]  # the first of equals
                for c in branches:
                    visit(c, times)

    visit(entry, 1)
    return runs


def received_factor(kind: str, group: int) -> float:
    """Bytes a device receives per byte of an op's result, for a collective of `kind` over `group` devices
    (ring algorithms: an all-reduce is a reduce-scatter plus an all-gather)."""
    g = group
    return {
        "collective-permute": 1.0,
        "all-gather": (g - 1) / g,
        "reduce-scatter": g - 1,
        "all-to-all": (g - 1) / g,
        "all-reduce": 2 * (g - 1) / g,
    }[kind]


def _ops(comps: dict[str, list[str]], root: str, devices: int) -> Iterator[tuple[str, str, int, int | Fraction]]:
    for name, times in computation_runs(comps, root, one_branch=True, devices=devices).items():
        for line in comps[name]:
            m = _OP.search(line)
            if not m:
                continue
            shape_text, kind, start = m.groups()
            size = shape_bytes(shape_text)
            if start and shape_text.startswith("("):
                size = _async_result_bytes(kind, shape_text)
            share = _declared_share(line)
            yield line, kind, size, times if share is None else times * share


def _received(comps: dict[str, list[str]], root: str, devices: int) -> float:
    """Bytes a device receives in one run of computation `root`."""
    ops = _ops(comps, root, devices)
    return sum(size * received_factor(kind, _group_size(line, devices)) * times for line, kind, size, times in ops)


def collective_ops(hlo_text: str) -> Iterator[tuple[str, str, int, int | Fraction]]:
    """Yields (line, kind, result bytes, executions) for every collective in compiled HLO; loop bodies count
    once per iteration, a conditional's branches as the module docstring says (executions are then a Fraction
    where declared shares do not divide them). Async start ops return (operand, result, ...): the result is
    counted."""
    comps, entry = hlo_computations(hlo_text)
    partitions = re.search(r"num_partitions=(\d+)", hlo_text)
    yield from _ops(comps, entry, int(partitions.group(1)) if partitions else 1)


def collective_traffic(hlo_text: str, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes received per device, number of op executions), each by collective kind, from compiled HLO."""
    moved = {k: 0 for k in KINDS}
    count = {k: 0 for k in KINDS}
    for line, kind, size, times in collective_ops(hlo_text):
        moved[kind] += round(size * received_factor(kind, _group_size(line, num_devices))) * times
        count[kind] += times
    return {k: round(v) for k, v in moved.items()}, {k: round(v) for k, v in count.items()}


@dataclasses.dataclass
class CompiledStats:
    """Per-device figures of one compiled program."""

    bytes_moved: dict[str, int]
    collective_ops: dict[str, int]
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int

    @property
    def total_bytes_moved(self) -> int:
        return sum(self.bytes_moved.values())

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs + temporaries, less buffers aliased between them."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def device_bytes(m: Any) -> float:
    """Device bytes per device of a `memory_analysis()` (jax.stages.CompiledMemoryStats): arguments + outputs +
    temporaries, less the aliased."""
    return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def host_bytes(m: Any) -> float:
    """Host-memory bytes per device of a `memory_analysis()` (what --offload keeps there): the host memory space's
    arguments + outputs + temporaries, less the aliased."""
    return float(
        m.host_argument_size_in_bytes
        + m.host_output_size_in_bytes
        + m.host_temp_size_in_bytes
        - m.host_alias_size_in_bytes
    )


def compile_stats(fn: Callable[..., Any], *args: Any, num_devices: int | None = None, **kwargs: Any) -> CompiledStats:
    """Compiles `jax.jit(fn)(*args, **kwargs)` (args may be `jax.ShapeDtypeStruct`s) and measures it."""
    compiled = jax.jit(fn).lower(*args, **kwargs).compile()
    mem = compiled.memory_analysis()
    moved, count = collective_traffic(compiled.as_text(), num_devices or jax.device_count())
    return CompiledStats(
        moved,
        count,
        mem.argument_size_in_bytes,
        mem.output_size_in_bytes,
        mem.temp_size_in_bytes,
        mem.alias_size_in_bytes,
    )


_HOST_SPACE = re.compile(r"\{[^}]*S\(5\)[^}]*\}")  # a layout in memory space 5: host memory
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = ")


def host_memory_traffic(hlo_text: str) -> dict[str, int]:
    """The host-memory transfers of a compiled GPU program, as instructions of its HLO (each once, not per loop
    trip). XLA marks a buffer placed in host memory by its layout's memory space 5 (`{...:S(5)}`), allocates
    it with an `AllocateBuffer` custom call and moves data in and out with async fusions: a
    `dynamic-update-slice-start` writes a device value into the host buffer, a `dynamic-slice-start` reads a
    slice of it back. Returns {"to_host", "from_host", "host_buffers"}: zero for a program that keeps
    everything on the device."""
    counts = {"to_host": 0, "from_host": 0, "host_buffers": 0}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m or not _HOST_SPACE.search(line):
            continue
        name, rest = m.group(1), line[m.end() :]
        if "AllocateBuffer" in rest:
            counts["host_buffers"] += 1
        elif name.startswith("dynamic-update-slice-start"):
            counts["to_host"] += 1
        elif name.startswith("dynamic-slice-start"):
            counts["from_host"] += 1
    return counts
