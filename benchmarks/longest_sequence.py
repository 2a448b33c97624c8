"""The longest sequence Llama-3-8B trains on, per machine, plan and memory technique, by deviceless compile.

    python benchmarks/longest_sequence.py                         # every row -> benchmarks/results/longest_sequence.json
    python benchmarks/longest_sequence.py --targets h100x8 --rows "ring zigzag sp8" "metp tp8: all"
    python benchmarks/longest_sequence.py --report                # the table (markdown) and the plot, no compile

The run: the `llama3-8b` preset (128,256-token vocabulary, GQA 32/8 heads), bf16 compute with fp32 master
weights and AdamW moments, batch 1, `--remat full`, the flash kernels; the sequence strategies hold the
weights and AdamW state ZeRO-3-sharded over sp, the tensor methods over tp. A row is (target, plan,
technique):

  targets     h100x8, h200x8, h100x1 (`jaxring.aot.compile_for.TARGETS`); the budget per device is the
              planner's usable memory (what `train.py --compile-for` checks against)
  plans       ring zigzag sp8, ulysses sp8, ulysses sp8 with the vocabulary split (--vocab-split ring) and with
              UPipe's head chunks too (--head-chunks 4: the rows "all", "all + weights" and its blocks), usp sp8
              (ring 4 x ulysses 2), megatron tp8, metp tp8 and with the vocabulary split, and `auto`: at each
              length, the plan `train.py --plan auto` picks (the planner's best that its estimate fits); on
              one GPU: one gpu, auto
  techniques  none; loss tile (--loss-tile); mlp tile (--mlp-tile); offload (--offload layer_inputs); all;
              all + optimizer (--offload layer_inputs+optimizer: the AdamW state in host memory too); all +
              weights (--offload layer_inputs+weights: the fp32 weights and gradients as well); all + weights,
              blocks (and --remat-layers 4: recompute blocks of four layers, the planner's √L; a block's
              layers' inputs go to host memory in its backward)

How a row is found, cheapest first:
  1. bisection on the planner's memory ESTIMATE (`jaxring.planner.cost_model.memory`, no compile) to --unit tokens:
     the longest length whose estimate fits the budget;
  2. at most three compiles of the exact train step for the target with no GPU (`train.py --compile-for`'s
     program: `jaxring.aot.compile_for.lowered_step`): the estimate's length, one --unit up (if it fits)
     or down (if not), and, when both agree, the length the two compiles' affine memory predicts (upward, half
     way to it: near the device's limit the compiled bytes grow faster than affine). Every
     compile records the estimate and the compiled bytes per device (argument + output + temp - alias of
     `memory_analysis()`), so the estimate's agreement can be read per row. `longest` is the longest compiled
     length that fits; `bracketed` says the next --unit up was compiled and did not fit.
  3. at the longest length: the roofline step time and tokens/s per GPU (`jaxring.analysis.roofline`: the
     compiled program's flops, bytes and collectives plus the flash kernels' flops, against the GPU's peaks;
     a bound: no real step is faster).

Resumable: the JSON is written after every row and a rerun skips the rows it holds (--redo recomputes them).
Needs the compile-only CUDA plugin (the `gpu-compile` extra, its own venv) for everything but --report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless GPU compiles need the CPU platform selected

GIB = 2**30
PRESET = "llama3-8b"
TILE = 4096  # tokens per tile of the loss and of the MLP
TARGETS = ("h100x8", "h200x8", "h100x1")
# TPU slices (`jaxring.analysis.tpu.TARGETS`, the tpu-compile extra): the planner's plan (auto) only, with the
# block compute of `jaxring.analysis.tpu.BLOCK_OPS`; no roofline (it reads GPU kernels)
TPU_TARGETS = ("v5p-8", "v5p-128", "v6e-8")
UNIT = {64: 262144, 8: 65536, 4: 32768, 1: 16384}  # bisection resolution (tokens) by device count
MAX_SEQ = 2**28  # the estimate bisection's ceiling
BASE = dict(model="gpt", batch_size=1, precision="bf16", remat="full")
# plan -> run-spec settings; None: the planner's choice (train.py --plan auto)
PLANS_8 = {
    "ring zigzag sp8": dict(sp=8, attention="ring", layout="zigzag", zero=3),
    "ulysses sp8": dict(sp=8, attention="ulysses", zero=3),
    # the embedding and LM head split over sp by vocab rows, their blocks on the sequence ring
    "ulysses sp8, vocab ring": dict(sp=8, attention="ulysses", zero=3, vocab_split="ring"),
    # and UPipe's untied head chunks (--head-chunks 4: q, k, v made a quarter of the heads at a time; they pay
    # with the tiled block, so only its rows with the MLP tile are run)
    "ulysses sp8, vocab ring, upipe 4": dict(sp=8, attention="ulysses", zero=3, vocab_split="ring", head_chunks=4),
    "usp sp8": dict(sp=8, attention="usp", ulysses_size=2, zero=3),
    "megatron tp8": dict(tp=8, tensor_parallel="megatron"),
    "metp tp8": dict(tp=8, tensor_parallel="metp"),
    # the embedding and LM head split over tp by vocab rows, their blocks on a ring (--vocab-split ring)
    "metp tp8, vocab ring": dict(tp=8, tensor_parallel="metp", vocab_split="ring"),
    "auto": None,
}
PLANS_1 = {"one gpu": {}, "auto": None}
TECHNIQUES = {
    "none": {},
    "loss tile": dict(loss_tile=TILE),
    "mlp tile": dict(mlp_tile=TILE),
    "offload": dict(offload="layer_inputs"),
    "all": dict(loss_tile=TILE, mlp_tile=TILE, offload="layer_inputs"),
    # and the AdamW state in host memory between updates (--offload layer_inputs+optimizer)
    "all + optimizer": dict(loss_tile=TILE, mlp_tile=TILE, offload="layer_inputs+optimizer"),
    # and the fp32 weights and their gradients too, streamed to the device layer by layer (--offload
    # layer_inputs+weights)
    "all + weights": dict(loss_tile=TILE, mlp_tile=TILE, offload="layer_inputs+weights"),
    # and recompute blocks of 4 layers (--remat-layers 4, the planner's √L blocks for 32 layers): 8 block inputs in
    # host memory, and a block's 4 layers' while its backward runs
    "all + weights, blocks": dict(loss_tile=TILE, mlp_tile=TILE, offload="layer_inputs+weights", remat_layers=4),
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One (target, plan, technique) of the table."""

    target: str
    plan: str
    technique: str

    @property
    def key(self) -> str:
        return f"{self.target} | {self.plan} | {self.technique}"

    @property
    def devices(self) -> int:
        if self.target in TPU_TARGETS:
            from jaxring.aot.compile_for import check_target

            return check_target(self.target)[1]
        return 1 if self.target.endswith("x1") else 8

    @property
    def gpu(self) -> str:
        """The planner's device (a GPU, or a TPU of a slice target)."""
        if self.target in TPU_TARGETS:
            from jaxring.aot.compile_for import check_target

            return check_target(self.target)[0]
        return self.target.split("x")[0]

    @property
    def held(self) -> dict:
        """What plan auto must hold beyond the row's settings: with no technique, no offload (else the planner
        turns to the techniques itself when nothing fits without them)."""
        return {"offload": "none"} if self.technique == "none" else {}

    def settings(self, seq: int, preset: str = PRESET) -> dict:
        """The run spec's flat settings of this row at `seq` tokens (plan auto: the plan left to the planner)."""
        plans = PLANS_1 if self.devices == 1 else PLANS_8
        plan = None if self.target in TPU_TARGETS else plans[self.plan]
        return {
            **BASE,
            "preset": preset,
            "seq_len": seq,
            **(dict(plan="auto") if plan is None else plan),
            **TECHNIQUES[self.technique],
        }


def all_rows(targets=TARGETS) -> list[Row]:
    """Every row, target by target (the order a run takes)."""
    return [
        Row(t, p, tech)
        for t in targets
        for p in (("auto",) if t in TPU_TARGETS else PLANS_1 if t.endswith("x1") else PLANS_8)
        for tech in TECHNIQUES
        if _runs(p, tech)
    ]


def _runs(plan: str, technique: str) -> bool:
    """Head chunks pay only in the tiled block (an MLP tile, with the projections inside the chunks): a plan
    with them runs the techniques that tile, "all" and after."""
    chunked = (PLANS_8.get(plan) or {}).get("head_chunks", 1) > 1
    return not chunked or technique.startswith("all")


def selected(rows: list[Row], patterns: list[str] | None) -> list[Row]:
    """The rows whose "plan: technique" (or key) contains one of `patterns` (all when none)."""
    if not patterns:
        return rows
    return [r for r in rows if any(p in f"{r.plan}: {r.technique}" or p in r.key for p in patterns)]


# ------------------------------------------------------------------------------------- the search


def longest_fitting(fits: Callable[[int], bool], unit: int, ceiling: int = MAX_SEQ) -> int:
    """The longest multiple of `unit` (up to `ceiling`) for which `fits` holds, `fits` being monotone (true
    below some length, false above); 0 when not even `unit` fits. Doubling, then bisection."""
    if not fits(unit):
        return 0
    lo = unit
    while 2 * lo <= ceiling and fits(2 * lo):
        lo *= 2
    hi = 2 * lo  # does not fit (or is past the ceiling)
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        if mid > ceiling or not fits(mid):
            hi = mid
        else:
            lo = mid
    return lo


EXTRA_COMPILES = 4  # when none of the three fits


def confirm(start: int, unit: int, fits: Callable[[int], bool], compiled: Callable[[int], float], budget: float):
    """(longest compiled length that fits or 0, bracketed) after at most three compiles (see the module
    docstring): `start`, one `unit` toward the boundary, then the two compiles' affine prediction (half way
    to it upward: XLA's GPU scheduler fills memory up to the device's limit, so near it the compiled bytes
    grow faster than the two close compiles' slope says); when none fits, up to EXTRA_COMPILES more below."""
    probes = {}

    def probe(seq):
        probes[seq] = fits(seq)
        return probes[seq]

    first = probe(start)
    second_at = start + unit if first else start - unit
    if second_at >= unit:
        second = probe(second_at)
        if second == first:
            slope = (compiled(second_at) - compiled(start)) / (second_at - start)
            if slope > 0:
                guess = start + (budget - compiled(start)) / slope
                if first:  # half way up: near the limit compiled memory grows faster than affine
                    guess = second_at + (guess - second_at) / 2
                guess = int(guess) // unit * unit
            else:
                guess = second_at + (unit if first else -unit)
            guess = max(guess, second_at + unit) if first else min(guess, second_at - unit)
            if guess >= unit:
                probe(guess)
    # XLA's compiled bytes are not monotone in the length near the device's limit (8 x H200, Ulysses, all three
    # techniques: 119.6 GiB at 6,356,992 tokens, 127.3 GiB at 6,225,920): when no compile fit, step down
    # 2, 4, 8, ... units below the lowest (at most EXTRA_COMPILES more) for a length that does
    lowest, step = min(probes), 2 * unit
    for _ in range(EXTRA_COMPILES if not any(probes.values()) else 0):
        seq = lowest - step
        if seq < unit or probe(seq):
            break
        step *= 2
    fitting = [s for s, ok in probes.items() if ok]
    longest = max(fitting, default=0)
    bracketed = probes.get(longest + unit) is False
    return longest, bracketed


# ------------------------------------------------------------------------------ estimate and compile


def estimate_bytes(row: Row, seq: int, preset: str = PRESET) -> tuple[float, dict, float]:
    """(the planner's estimate per device, the plan's settings, its host bytes per device) of `row` at `seq`;
    the planner's best plan for plan auto (inf when none fits); ValueError when the plan cannot run that
    length."""
    from jaxring.planner import cost_model as cost
    from jaxring.planner.auto import held_settings
    from jaxring.planner.cluster import Cluster
    from jaxring.planner.fit import candidate_of, workload_of
    from jaxring.planner.params import param_leaves
    from jaxring.planner.search import NoPlanError, search
    from jaxring.run.spec import RunSpec

    spec = RunSpec.of(**row.settings(seq, preset))
    if spec.parallel.plan == "auto":
        try:
            cluster = Cluster.of(row.gpu, row.devices, host_memory=host_budget_bytes(row))
            result = search(workload_of(spec), cluster, only=held_settings(spec) | row.held)
        except NoPlanError:  # "no plan fits in memory ...": the least any plan needs is above the budget
            return math.inf, {}, 0.0
        if not result.ranked:
            return math.inf, {}, 0.0
        best = result.ranked[0]
        return best.memory.total, best.candidate.settings(result.workload), best.memory.host
    spec = spec.resolved(row.devices)
    spec.validate()
    w, c = workload_of(spec), candidate_of(spec)
    memory = cost.memory(w, c, param_leaves(w.model, w.config, c.check(w)), cpu=False)
    return memory.total, {}, memory.host


class NoPlan(ValueError):
    """--plan auto at this length: the planner's estimate fits no plan, so there is nothing to compile."""


def compile_probe(row: Row, seq: int, preset: str = PRESET) -> dict:
    """One compile of `row` at `seq` for its target (the planner's best plan for plan auto): the estimate
    and the compiled bytes per device, and the roofline of the compiled program."""
    from jaxring.analysis import gpu
    from jaxring.analysis.roofline import roofline_of
    from jaxring.aot.compile_for import lowered_step, ranked_specs
    from jaxring.planner.fit import workload_of
    from jaxring.run.spec import RunSpec

    spec = RunSpec.of(**row.settings(seq, preset))
    if spec.parallel.plan == "auto":
        from jaxring.planner.search import NoPlanError

        try:
            ranked = ranked_specs(spec, row.gpu, row.devices, tries=1, hold=row.held, target=row.target)
        except NoPlanError as e:
            raise NoPlan(str(e).splitlines()[0]) from e
        if not ranked:
            raise NoPlan(f"the planner finds no plan for {seq} tokens on {row.target}")
        spec = ranked[0]
    if row.target in TPU_TARGETS:
        return _tpu_probe(row, spec, seq)
    devices = gpu.gpu_devices(row.gpu, row.devices)
    lowered, estimate, plan = lowered_step(spec, devices)
    report = gpu.compile_for_gpu(lowered, ptxas=False)
    config = workload_of(spec).config
    model_flops = config.flops_per_token(seq, causal=True) * seq / row.devices
    roof = roofline_of(report, causal=True, model_flops=model_flops)
    return {
        "seq": seq,
        "plan": plan,
        "estimate_gib": estimate / GIB,
        "compiled_gib": report.peak_bytes / GIB,
        "estimate_over_compiled": estimate / report.peak_bytes,
        "host_gib": report.memory.get("host", report.memory.get("host_temp", 0)) / GIB,
        "compile_s": round(report.compile_seconds, 1),
        "step_s": roof.time_s,
        "tokens_per_s_per_gpu": seq / roof.time_s / row.devices,
        "roofline": roof.to_dict(),
    }


def _tpu_probe(row: Row, spec, seq: int) -> dict:
    """compile_probe for a TPU slice: the estimate, the compiled bytes and the Mosaic calls (no roofline)."""
    from jaxring.analysis import tpu
    from jaxring.aot.compile_for import lowered_step

    lowered, estimate, plan = lowered_step(spec, tpu.tpu_devices(row.target))
    report = tpu.compile_for_tpu(lowered, target=row.target)
    return {
        "seq": seq,
        "plan": plan,
        "estimate_gib": estimate / GIB,
        "compiled_gib": report.peak_bytes / GIB,
        "estimate_over_compiled": estimate / report.peak_bytes,
        # XLA:TPU's own peak, what its compile-time HBM check reads (below compiled_gib: `tpu.memory_of`)
        "xla_peak_gib": None if report.xla_peak_bytes is None else report.xla_peak_bytes / GIB,
        "estimate_over_xla_peak": estimate / report.xla_peak_bytes if report.xla_peak_bytes else None,
        "host_gib": report.memory["host"] / GIB,
        "compile_s": round(report.compile_seconds, 1),
        "block_ops": tpu.BLOCK_OPS,
        "mosaic_calls": report.mosaic_calls,
        "step_s": None,
        "tokens_per_s_per_gpu": None,
    }


def budget_bytes(row: Row) -> float:
    """The usable memory per device that `train.py --compile-for` checks against."""
    from jaxring.planner.cluster import Cluster

    return Cluster.of(row.gpu, 1).usable_memory


def host_budget_bytes(row: Row | None = None) -> float:
    """The host memory per device that `train.py --compile-for` checks --offload against (a DGX node's share;
    a TPU slice's VM memory over its devices)."""
    from jaxring.analysis import tpu
    from jaxring.aot.compile_for import HOST_GIB_PER_GPU

    if row is not None and row.target in TPU_TARGETS:
        return tpu.TARGETS[row.target].host_gib_per_device * GIB
    return HOST_GIB_PER_GPU * GIB


def _bytes(probe: dict) -> float:
    """A probe's compiled bytes per device (inf when plan auto had no plan to compile)."""
    return math.inf if probe["compiled_gib"] is None else probe["compiled_gib"] * GIB


def measure_row(
    row: Row, *, estimate=estimate_bytes, compile_one=compile_probe, budget=None, unit=None, host=None, log=print
):
    """The row's record: the estimate's longest length, the compiles that confirm it, the roofline there. A
    length fits when its device bytes are within `budget` and its host bytes within `host` (per device)."""
    budget = budget_bytes(row) if budget is None else budget
    host = host_budget_bytes(row) if host is None else host
    unit = unit or UNIT[row.devices]
    start = time.time()
    out = {"key": row.key, "target": row.target, "plan": row.plan, "technique": row.technique}
    out.update(budget_gib=budget / GIB, unit=unit, settings=row.settings(0))
    out["settings"].pop("seq_len")
    out["command"] = (
        f'python benchmarks/longest_sequence.py --targets {row.target} --rows "{row.plan}: {row.technique}"'
    )
    estimated = {}

    def estimate_fits(seq):
        try:
            guess = estimate(row, seq)
            estimated[seq] = guess[0] if len(guess) < 3 or guess[2] <= host else math.inf
        except ValueError as e:
            if seq == unit:
                raise
            log(f"  {row.key}: {seq} refused by the plan's rules ({e}); treated as too long")
            estimated[seq] = math.inf
        return estimated[seq] <= budget

    try:
        longest_estimate = longest_fitting(estimate_fits, unit)
    except ValueError as e:
        out.update(error=str(e).splitlines()[0], search_s=time.time() - start)
        return out
    out["estimate_longest"] = longest_estimate
    out["estimate_gib_at_longest"] = estimated.get(longest_estimate, math.inf) / GIB if longest_estimate else None
    log(f"  {row.key}: estimate fits up to {longest_estimate} tokens ({len(estimated)} estimates)")
    probes = {}

    def compiled_fits(seq):
        log(f"  {row.key}: compiling {seq} tokens ...")
        try:
            probes[seq] = compile_one(row, seq)
        except NoPlan as e:  # plan auto: no plan at this length is what --plan auto would answer
            probes[seq] = {"seq": seq, "plan": None, "refused": str(e), "compiled_gib": None}
            log(f"  {row.key}: {e}")
            return False
        p = probes[seq]
        log(
            f"  {row.key}: {seq} tokens: compiled {p['compiled_gib']:.2f} GiB, estimate {p['estimate_gib']:.2f} "
            f"GiB (x{p['estimate_over_compiled']:.3f}), budget {budget / GIB:.1f} GiB, host "
            f"{p.get('host_gib', 0):.1f} GiB of {host / GIB:.0f}, {p['compile_s']:.0f} s"
            + (f"; XLA:TPU's peak {p['xla_peak_gib']:.2f} GiB" if p.get("xla_peak_gib") is not None else "")
        )
        return p["compiled_gib"] * GIB <= budget and p.get("host_gib", 0) * GIB <= host

    try:
        if longest_estimate:
            longest, bracketed = confirm(longest_estimate, unit, compiled_fits, lambda s: _bytes(probes[s]), budget)
        elif row.plan != "auto":  # not even `unit` fits by the estimate: one compile says whether it does
            longest = unit if compiled_fits(unit) else 0
            bracketed = longest == 0
        else:  # the planner finds no plan: nothing to compile
            longest, bracketed = 0, False
    except Exception as e:  # a compile the plan or XLA refuses: the row records it and the run goes on
        out.update(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500])
        fitting = [s for s, p in probes.items() if _bytes(p) <= budget]
        longest, bracketed = max(fitting, default=0), False
    out.update(longest=longest, bracketed=bracketed)
    out["probes"] = [{k: v for k, v in probes[s].items() if k != "roofline"} for s in sorted(probes)]
    if longest:
        at = probes[longest]
        out.update(
            plan_at_longest=at["plan"],
            compiled_gib=at["compiled_gib"],
            host_gib=at.get("host_gib"),
            estimate_gib=at["estimate_gib"],
            estimate_over_compiled=at["estimate_over_compiled"],
            step_s=at["step_s"],
            tokens_per_s_per_gpu=at["tokens_per_s_per_gpu"],
            roofline=at.get("roofline"),  # none on a TPU slice
        )
    peaks = [p for p in probes.values() if p.get("xla_peak_gib") is not None]
    if peaks:  # a TPU slice: the longest compile whose XLA:TPU peak (its compile-time HBM check's) fits as well
        fitting = [p["seq"] for p in peaks if p["xla_peak_gib"] * GIB <= budget and p.get("host_gib", 0) * GIB <= host]
        out["longest_by_xla_peak"] = max(fitting, default=0)
    out["search_s"] = round(time.time() - start, 1)
    return out


# ------------------------------------------------------------------------------------ the record


def load(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def run(rows: list[Row], record: dict, path: str, *, redo: bool = False, log=print, **measure) -> dict:
    """Measures every row not in `record` (all with `redo`), writing the record after each one."""
    from jaxring.analysis.records import save_record

    done = {r["key"] for r in record["results"]}
    for row in rows:
        if row.key in done and not redo:
            log(f"{row.key}: recorded, skipped")
            continue
        log(f"{row.key}: ...")
        result = {**measure_row(row, log=log, **measure), "commit": record.get("commit")}  # rows of reruns differ
        record["results"] = [r for r in record["results"] if r["key"] != row.key] + [result]
        record["results"].sort(key=lambda r: _order(r["key"]))
        record["summary"] = summary(record)
        save_record(record, path)
        log(f"{row.key}: longest {result.get('longest')} tokens ({result.get('search_s', 0):.0f} s)")
    return record


def summary(record: dict) -> dict:
    """Per target: the longest row, and the estimate / compiled range over every compile of its rows."""
    out = {}
    for target in (*TARGETS, *TPU_TARGETS):
        rows = [r for r in record["results"] if r["target"] == target]
        if not rows:
            continue
        best = max(rows, key=lambda r: r.get("longest") or 0)
        ratios = [p["estimate_over_compiled"] for r in rows for p in r.get("probes", []) if "refused" not in p]
        out[target] = {
            "rows": len(rows),
            "longest": best.get("longest") or 0,
            "longest_row": best["key"],
            "plan_at_longest": best.get("plan_at_longest"),
            "estimate_over_compiled_range": [min(ratios), max(ratios)] if ratios else None,
        }
    return out


def _order(key: str) -> int:
    keys = [r.key for r in all_rows((*TARGETS, *TPU_TARGETS))]
    return keys.index(key) if key in keys else len(keys)


def header(command: list[str]) -> dict:
    """The record's header: the run's settings, the targets, the versions and the command."""
    from importlib.metadata import PackageNotFoundError, version

    import jax

    from jaxring.analysis.records import benchmark_record

    record = benchmark_record("longest_sequence", jax.devices("cpu")[:1], {})
    try:
        plugin = version("jax-cuda12-plugin")
    except PackageNotFoundError:
        plugin = None
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here)
    record.update(
        date=time.strftime("%Y-%m-%d", time.gmtime()),
        commit=commit.stdout.strip(),
        command=" ".join(["python", "benchmarks/longest_sequence.py", *command]),
        device="deviceless compile for each row's target (XLA GpuTargetConfigProto: 8 x H100 SXM, 8 x H200, "
        "1 x H100 SXM), on a CPU host: " + record["device"],
        jaxlib=jax.__version__,
        jax_cuda12_plugin=plugin,
        config={
            "preset": PRESET,
            **BASE,
            "tile": TILE,
            "unit_by_devices": UNIT,
            "zero_over_sp": 3,
            "block_ops": "pallas",
            "optimizer": "adamw (fp32 weights and moments)",
            "budget": "the planner's usable memory per device (train.py --compile-for's budget)",
        },
    )
    return record


# ------------------------------------------------------------------------------------ the report


def table(record: dict) -> str:
    """Markdown: per target, the longest sequence of each plan under each technique (compiled; the
    estimate's in brackets when it differs), and per row the estimate's agreement and the roofline."""
    lines = []
    by_key = {r["key"]: r for r in record["results"]}
    for target in TARGETS:
        rows = [r for r in all_rows((target,)) if r.key in by_key]
        if not rows:
            continue
        lines += [
            f"**{target}** (budget {by_key[rows[0].key]['budget_gib']:.1f} GiB per device)",
            "",
            "| plan | technique | longest (compiled) | estimate's longest | compiled GiB | host GiB | estimate / "
            "compiled | roofline step s | tokens/s/GPU |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            r = by_key[row.key]
            if r.get("error") and not r.get("longest"):
                lines.append(f"| {row.plan} | {row.technique} | refused: {r['error'][:80]} | | | | | | |")
                continue
            longest = f"{r['longest']:,}" + ("" if r.get("bracketed") else " (≥)") if r.get("longest") else "0"
            if r.get("longest"):
                ratios = [p["estimate_over_compiled"] for p in r["probes"] if "refused" not in p]
                agree = f"{min(ratios):.3f}–{max(ratios):.3f}" if len(ratios) > 1 else f"{ratios[0]:.3f}"
                plan = f" ({r['plan_at_longest']})" if row.plan == "auto" else ""
                lines.append(
                    f"| {row.plan}{plan} | {row.technique} | {longest} | {r['estimate_longest']:,} | "
                    f"{r['compiled_gib']:.1f} | {_host(r)} | {agree} | {r['step_s']:.2f} | "
                    f"{r['tokens_per_s_per_gpu']:,.0f} |"
                )
            else:
                shortest = next((p for p in r.get("probes", []) if "refused" not in p), None)
                at = (
                    f"{shortest['compiled_gib']:.1f} at {shortest['seq']:,} | {_host(shortest)} | "
                    f"{shortest['estimate_over_compiled']:.3f}"
                    if shortest
                    else "no plan (planner) | | "
                )
                lines.append(f"| {row.plan} | {row.technique} | 0 | {r.get('estimate_longest', 0):,} | {at} | | |")
        lines.append("")
    tpu_rows = [by_key[r.key] for r in all_rows(TPU_TARGETS) if r.key in by_key]
    if tpu_rows:
        lines += [
            "**TPU slices**, plan auto (compiled: arguments + outputs + temporaries - aliased; XLA:TPU's peak: "
            "`peak_memory_in_bytes`, what its compile-time HBM check reads; the plan and GiB at the longest, or "
            "where none fits by the compiled bytes at the peak's longest)",
            "",
            "| target | technique | plan | longest (compiled) | longest by XLA:TPU's peak | estimate's "
            "longest | compiled GiB | XLA:TPU's peak GiB | estimate GiB | budget GiB | compile s |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in tpu_rows:
            # the figures at the longest length, or (none fitting by the allocated bytes) at the peak's longest
            seq = r.get("longest") or r.get("longest_by_xla_peak")
            at = next((p for p in r.get("probes", []) if p["seq"] == seq and "refused" not in p), None)
            cells = (
                [f"{at['compiled_gib']:.1f}", _gib(at.get("xla_peak_gib")), f"{at['estimate_gib']:.1f}"]
                if at
                else ["", "", ""]
            )
            longest = f"{r.get('longest') or 0:,}" + ("" if r.get("bracketed") or not r.get("longest") else " (≥)")
            seconds = "/".join(f"{p['compile_s']:.0f}" for p in r.get("probes", []) if "refused" not in p)
            lines.append(
                f"| {r['target']} | {r['technique']} | {at['plan'] if at else r.get('error', '')[:60]} | "
                f"{longest} | {_by_peak(r)} | {r.get('estimate_longest', 0):,} | "
                f"{' | '.join(cells)} | {r['budget_gib']:.1f} | {seconds} |"
            )
        lines.append("")
    return "\n".join(lines)


def _gib(v: float | None) -> str:
    return "" if v is None else f"{v:.1f}"


def _by_peak(r: dict) -> str:
    """A TPU row's longest length by XLA:TPU's peak, "(≥)" when no longer compile's peak was over the budget."""
    n = r.get("longest_by_xla_peak")
    if n is None:
        return ""
    over = any(p["seq"] > n and p.get("xla_peak_gib", 0) > r["budget_gib"] for p in r.get("probes", []))
    return f"{n:,}" + ("" if over else " (≥)")


def _host(r: dict) -> str:
    """A row's (or probe's) host memory per device, GiB ("" in records from before it was kept)."""
    return "" if r.get("host_gib") is None else f"{r['host_gib']:.1f}"


def _tokens(n: float, _pos=None) -> str:
    """256K, 1M, 2.5M."""
    return f"{n / 2**20:g}M" if n >= 2**20 else f"{n / 2**10:g}K"


def plot(record: dict, path: str) -> None:
    """PNG: per target where anything fits, the longest compiled sequence of each plan (bars) under each
    technique, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    by_key = {r["key"]: r for r in record["results"]}
    targets = [t for t in TARGETS if any(by_key.get(r.key, {}).get("longest") for r in all_rows((t,)))]
    if not targets:  # TPU rows only (no GPU target to draw)
        return
    fig, axes = plt.subplots(1, len(targets), figsize=(5.5 * len(targets), 4.2), squeeze=False, sharey=True)
    for ax, target in zip(axes[0], targets):
        plans = list(PLANS_1 if target.endswith("x1") else PLANS_8)
        width = 0.8 / len(plans)
        for j, plan in enumerate(plans):
            xs, ys = [], []
            for i, tech in enumerate(TECHNIQUES):
                r = by_key.get(Row(target, plan, tech).key)
                if r and r.get("longest"):
                    xs.append(i - 0.4 + (j + 0.5) * width)
                    ys.append(r["longest"])
            if xs:
                ax.bar(xs, ys, width, label=plan, color=f"C{j}")
        ax.set_xticks(range(len(TECHNIQUES)), list(TECHNIQUES), rotation=30, ha="right")
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_tokens))
        ax.set_title(f"Llama-3-8B on {target}")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("longest sequence (tokens, compiled)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="*", default=list(TARGETS), choices=(*TARGETS, *TPU_TARGETS))
    parser.add_argument("--rows", nargs="*", default=None, help='substrings of "plan: technique" (default: all)')
    parser.add_argument("--redo", action="store_true", help="recompute rows the results already hold")
    parser.add_argument(
        "--report", action="store_true", help="print the table, write the plot and the summary; no compile"
    )
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    parser.add_argument("--out", default=os.path.join(here, "longest_sequence.json"))
    parser.add_argument("--plot", default=os.path.join(here, "longest_sequence.png"))
    args = parser.parse_args(argv)
    record = load(args.out)
    if args.report:
        if record is None:
            sys.exit(f"no results at {args.out}: run the benchmark first")
        from jaxring.analysis.records import save_record

        record["summary"] = summary(record)
        save_record(record, args.out)
        print(table(record))
        plot(record, args.plot)
        print(f"wrote {args.plot}")
        return 0
    from jaxring.analysis import gpu, tpu

    on_tpu = all(t in TPU_TARGETS for t in args.targets)
    ok, why = tpu.available() if on_tpu else gpu.available()
    if not ok:
        sys.exit(f"cannot compile for {'TPU' if on_tpu else 'GPU'} here: {why}")
    fresh = header(sys.argv[1:] if argv is None else argv)
    if on_tpu:
        from importlib.metadata import version

        fresh.update(
            device="deviceless compile for each row's Cloud TPU slice (libtpu topologies: v5p-8 = 4 chips "
            "v5p:2x2x1, v5p-128 = 64 chips v5p:4x4x4, v6e-8 = 8 chips v6e:2x4), on a CPU host",
            libtpu=version("libtpu"),
            jax_cuda12_plugin=None,
        )
        fresh["config"]["block_ops"] = tpu.BLOCK_OPS
    if record is None:
        record = fresh
    else:
        record.update({k: v for k, v in fresh.items() if k != "results"})
    rows = selected(all_rows(tuple(args.targets)), args.rows)
    run(rows, record, args.out, redo=args.redo, log=lambda s: print(s, flush=True))
    print(table(record))
    plot(record, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
