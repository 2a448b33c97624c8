"""The cost of one execution of a compiled module: XLA's cost analysis with every loop body counted once per
iteration (`weighted_cost`), and the flops of the flash kernels from their launches (`flash_flops`; custom
kernels are opaque to XLA's analysis)."""

from __future__ import annotations

import re

import jax

from jaxring.analysis.compiled import computation_runs, hlo_computations
from jaxring.analysis.hlo_schedule import TRIP_COUNT, callees, parse_schedule
from jaxring.core import compat

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
    comps, _ = parse_schedule(hlo)
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
                trip = TRIP_COUNT.search(instr.rest)
                found.append((re.search(r"body=%([\w.\-]+)", instr.rest).group(1), int(trip.group(1)) if trip else 1))
            elif instr.opcode in ("conditional", "call", "async-start"):
                for callee in callees(instr):
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
