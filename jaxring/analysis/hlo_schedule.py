"""The schedule of a compiled HLO module: its computations in schedule order, and for every loop that holds
collectives (a ring) whether each async collective's start/done pair spans compute, and which."""

from __future__ import annotations

import dataclasses
import re

from jaxring.analysis.gpu_report import AsyncCollective, CommLoop

_COMP_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_INSTR = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_OPERANDS = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
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


def parse_schedule(hlo: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """Computations of an HLO module (instructions in schedule order) and the entry computation's name."""
    comps, current, entry = {}, None, None
    for line in hlo.splitlines():
        if not line.startswith(" ") and (m := _COMP_HEADER.match(line)) and line.rstrip().endswith("{"):
            current = comps.setdefault(m.group(1), [])
            entry = m.group(1) if line.startswith("ENTRY") else entry
        elif current is not None and (m := _INSTR.match(line)):
            current.append(_Instr(m.group(1), m.group(2), m.group(3), m.group(4)))
    return comps, entry


def callees(instr: _Instr) -> list[str]:
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
        for callee in callees(instr):
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
        return any(_computation_computes(c, comps, memo) for c in callees(instr))
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
    comps, entry = parse_schedule(hlo)
    return None if entry is None else _loop_report(entry, comps, {}, 1)


def communication_loops(hlo: str) -> list[CommLoop]:
    """Every while loop of a scheduled HLO module whose body holds collectives, with their overlap."""
    comps, _ = parse_schedule(hlo)
    memo: dict = {}
    loops = []
    for instrs in comps.values():
        for w in instrs:
            if w.opcode != "while":
                continue
            body = re.search(r"body=%([\w.\-]+)", w.rest).group(1)
            trip = TRIP_COUNT.search(w.rest)
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
