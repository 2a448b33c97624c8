"""The GPT train step compiled for 8 x H200 with no GPU (deviceless AOT): per-device memory, the longest
sequence each parallel configuration fits, and a roofline MFU per step.

Needs the compile-only CUDA plugin (`pip install -e ".[dev,gpu-compile]"`, its own venv; see
jaxring/analysis/gpu.py). Runs on the CPU host; nothing executes on a GPU. Every figure is read from the
compiled per-device program: `memory_analysis()` (arguments + outputs + temporaries - aliased) and the
optimized HLO.

The step is `jaxring.train.step.TrainStep` as `Trainer` builds it (AdamW with fp32 master weights and moments,
bf16 compute, clipping), batch 1, the flash kernel (block_ops="pallas"), selective remat, the whole 32-layer
GPT-7B (WallFacer's GPT-7B / METP's LLaMA-7B shape: hidden 4096, 32 heads, SwiGLU 11008, vocab 32000). The
layer stack is one scan, so a 32-layer compile costs what a 2-layer one does: nothing is extrapolated.

  longest    per configuration, the longest sequence whose step fits the budget (default 95% of the H200's
             141 GiB: the rest is for the CUDA context, cuBLAS/NCCL workspaces and fragmentation; run with
             XLA_PYTHON_CLIENT_MEM_FRACTION=.95), by bisection on compiles to --unit tokens; every probe is
             recorded (memory is affine in the sequence length: the probes show it). Sequence strategies shard
             the model states with ZeRO-3 over sp (--zero), so every configuration holds 1/8 of them.
             XLA's GPU scheduler fills memory up to its limit (xla_gpu_memory_limit_slop_factor, 95% by
             default) to overlap more, so at the default a step's peak says what XLA chose, not the least it
             needs (ring, 64k tokens: 96 GiB at the default, 36 GiB at --slop 50); run both (--note names
             the rows).
  wallfacer  WallFacer C=2 against ring (zigzag) at equal sequence lengths with ZeRO-2 (WallFacer's setting)
  remat      the same step with remat none / selective / full at one length (does the policy take effect?)
  mfu        roofline per step (jaxring/analysis/roofline.py): the compiled program's flops and bytes (loops
             times their trip counts) plus the flash kernels' flops, against the H200's peaks; beside it the MFU
             the training loop logs (task.flops_per_step() / step time / (peak_flops x devices)) were the step
             to take the roofline time. 7B (ring zigzag, Ulysses, Megatron, METP) and 1B (ring zigzag) at 32k on 8 GPUs.

    python benchmarks/gpu_memory.py                     # everything -> benchmarks/results/gpu_memory.json
    python benchmarks/gpu_memory.py --only longest --configs "ring zigzag" metp
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless GPU compiles need the CPU platform selected

import jax
import jax.numpy as jnp

from jaxring.analysis import gpu
from jaxring.analysis.records import benchmark_record, save_record
from jaxring.analysis.roofline import roofline_of

# name -> make_mesh degrees and ParallelPlan options (8 GPUs each)
CONFIGS = {
    "ring contiguous": (dict(sp=8), dict(attention="ring", layout="contiguous")),
    "ring zigzag": (dict(sp=8), dict(attention="ring", layout="zigzag")),
    "wallfacer C=2": (dict(sp=8), dict(attention="wallfacer", team_size=2)),
    "ulysses": (dict(sp=8), dict(attention="ulysses")),
    "usp ring4 x ulysses2": (dict(sp=8), dict(attention="usp", ulysses_size=2)),
    "megatron tp8": (dict(tp=8), dict(tensor_parallel="megatron")),
    "metp tp8": (dict(tp=8), dict(tensor_parallel="metp")),
    "megatron tp2 x ring sp4": (dict(tp=2, sp=4), dict(attention="ring", tensor_parallel="megatron")),
    "megatron tp4 x ring sp2": (dict(tp=4, sp=2), dict(attention="ring", tensor_parallel="megatron")),
}
MFU_RUNS = [("7b", name, 32768) for name in ("ring zigzag", "ulysses", "megatron tp8", "metp tp8")] + [
    ("1b", "ring zigzag", 32768)
]
GIB = 2**30
STAMP = {}  # commit and note, recorded with every row


def step_program(preset, config, seq, *, zero=3, remat="selective", target="h200", batch=1, layers=None):
    """(lowered train step, model config, plan) of `preset` under `config` at `seq` tokens, on abstract GPUs."""
    from flax import nnx

    import jaxring
    from jaxring.models import gpt
    from jaxring.nn import MemoryPolicy
    from jaxring.parallel.plan import ParallelPlan
    from jaxring.run.spec import RunSpec
    from jaxring.train.step import TrainStep
    from jaxring.train.trainer import optimizer

    degrees, options = CONFIGS[config] if config != "1 gpu" else ({}, {})
    devices = gpu.gpu_devices(target, math.prod(degrees.values()) if degrees else 1)
    if degrees.get("sp", 1) > 1:
        options = {**options, "zero": zero}
    plan = ParallelPlan(jaxring.make_mesh(devices=devices, **degrees), block_ops="pallas", **options)
    overrides = {} if layers is None else {"num_layers": layers}
    base = gpt.get_config(preset)
    if base.positions == "learned":
        overrides["max_seq_len"] = max(base.max_seq_len, seq)  # as the GPT task does
    cfg = gpt.get_config(preset, **overrides)
    gpt.check_plan(cfg, plan, batch, seq)
    model = nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model)
    tx = optimizer(RunSpec.of(model="gpt", preset=preset, seq_len=seq, batch_size=batch, steps=1000))
    objective = gpt.NextTokenObjective(batch, seq)
    step = TrainStep(plan, model, tx, objective, memory=MemoryPolicy(remat=remat), dtype=jnp.bfloat16)
    shaped = lambda tree, shardings: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
    params = shaped(nnx.to_pure_dict(state), step.shardings(step.param_specs))
    opt_specs = step.opt_state_specs(params)
    opt_state = shaped(jax.eval_shape(tx.init, params), step.shardings(opt_specs))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=plan.tokens_sharding())
    lowered = step.build(opt_specs).lower(
        params,
        opt_state,
        {"tokens": tokens, "targets": tokens, "positions": tokens},
        jax.ShapeDtypeStruct((2,), jnp.uint32),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    return lowered, cfg, plan


COMPILER_OPTIONS = {}  # --slop: {"xla_gpu_memory_limit_slop_factor": percent}


def compile_step(preset, config, seq, **kw):
    lowered, cfg, plan = step_program(preset, config, seq, **kw)
    return gpu.compile_for_gpu(lowered, ptxas=False, compiler_options=COMPILER_OPTIONS or None), cfg, plan


def memory_row(report, seq):
    m = report.memory
    return {
        **STAMP,
        "seq": seq,
        "peak_gib": report.peak_bytes / GIB,
        "argument_gib": m["argument"] / GIB,
        "temp_gib": m["temp"] / GIB,
        "output_gib": m["output"] / GIB,
        "alias_gib": m["alias"] / GIB,
        "compile_s": report.compile_seconds,
    }


def longest_sequence(config, budget, unit, zero, first=65536, log=print):
    """Longest multiple of `unit` whose compiled step fits `budget` bytes per device: two probes fit the
    affine memory(seq), a bracket around its prediction is checked, then bisection to `unit`."""
    probes = {}

    def fits(seq):
        if seq not in probes:
            report, _, _ = compile_step("7b", config, seq, zero=zero)
            probes[seq] = memory_row(report, seq)
            log(f"  {config} seq {seq}: {probes[seq]['peak_gib']:.2f} GiB ({report.compile_seconds:.0f} s)")
        return probes[seq]["peak_gib"] * GIB <= budget

    a = first
    while not fits(a):
        a //= 2
        if a < unit:
            return {"longest_seq": 0, "probes": sorted(probes.values(), key=lambda r: r["seq"])}
    b = 2 * a
    fits(b)
    slope = (probes[b]["peak_gib"] - probes[a]["peak_gib"]) * GIB / (b - a)
    guess = a + (budget - probes[a]["peak_gib"] * GIB) / slope if slope > 0 else 64 * a
    lo = max(unit, int(guess * 0.98) // unit * unit)
    while not fits(lo):
        lo = max(unit, (lo // 2) // unit * unit)
    hi = max(lo + unit, -(-int(guess * 1.02) // unit) * unit)
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        if fits(mid):
            lo = mid
        else:
            hi = mid
    rows = sorted(probes.values(), key=lambda r: r["seq"])
    return {
        "longest_seq": lo,
        "first_too_long": hi,
        "at_longest": probes[lo],
        "activation_bytes_per_token": slope,
        "probes": rows,
    }


def longest_rows(args, record, out):
    budget = args.budget_fraction * gpu_memory_bytes(args.target)
    record["config"]["budget_bytes"] = budget
    for name in args.configs:
        start = time.time()
        print(f"{name}: bisection", flush=True)
        row = {
            "section": "longest",
            "config": name,
            **STAMP,
            "zero": args.zero if CONFIGS[name][0].get("sp", 1) > 1 else None,
            **longest_sequence(name, budget, args.unit, args.zero, first=args.first),
        }
        row["search_s"] = time.time() - start
        print(f"{name}: longest {row['longest_seq']} tokens ({row['search_s']:.0f} s)", flush=True)
        record["results"].append(row)
        save_record(record, out)
    summarize(record)
    save_record(record, out)


def summarize(record):
    """METP/Megatron longest-sequence ratio (paper: 2.38-2.99x) and WallFacer's memory over ring's."""
    label = lambda r: r["config"] + (f" [{r['note']}]" if r.get("note") else "")
    longest = {label(r): r["longest_seq"] for r in record["results"] if r.get("section") == "longest"}
    summary = record.setdefault("summary", {})
    ratio = {}
    for r in record["results"]:
        if r.get("section") == "longest" and r["config"] == "metp tp8":
            tag = f" [{r['note']}]" if r.get("note") else ""
            if longest.get("megatron tp8" + tag):
                ratio[r.get("note") or "default"] = r["longest_seq"] / longest["megatron tp8" + tag]
    if ratio:
        summary["metp_over_megatron_longest_seq"] = ratio  # by note (XLA memory-limit setting)
    pairs = {}
    for r in record["results"]:
        if r.get("section") == "wallfacer":
            pairs.setdefault(r["seq"], {})[r["config"]] = r["peak_gib"]
    less = {
        str(seq): 1 - p["ring zigzag"] / p["wallfacer C=2"]
        for seq, p in sorted(pairs.items())
        if "ring zigzag" in p and "wallfacer C=2" in p
    }
    if less:
        summary["ring_uses_less_than_wallfacer_zero2"] = less
    probed = {}  # the bisection's probes (ZeRO-3) at lengths both ran
    for r in record["results"]:
        if r.get("section") == "longest" and r["config"] in ("ring zigzag", "wallfacer C=2"):
            for probe in r["probes"]:
                probed.setdefault((r.get("note") or "default", probe["seq"]), {})[r["config"]] = probe["peak_gib"]
    less = {}
    for (note, seq), p in sorted(probed.items()):
        if len(p) == 2:
            less.setdefault(note, {})[str(seq)] = 1 - p["ring zigzag"] / p["wallfacer C=2"]
    if less:
        summary["ring_uses_less_than_wallfacer_zero3"] = less  # by note, at the lengths both probed
    if longest:
        summary["longest_seq"] = longest
    mfu = {
        f"{r['preset']} {r['config']} {r['seq']}": {
            "roofline_mfu": r["roofline"]["mfu"],
            "loop_mfu_at_roofline_time": r["loop_mfu_at_roofline_time"],
            "loop_mfu_with_nothing_overlapped": r["loop_mfu_with_nothing_overlapped"],
            "bound": r["roofline"]["bound"],
        }
        for r in record["results"]
        if r.get("section") == "mfu"
    }
    if mfu:
        summary["mfu"] = mfu


def gpu_memory_bytes(target):
    import re

    return int(re.search(r"device_memory_size:\s*(\d+)", gpu.target_config(target)).group(1))


def wallfacer_rows(args, record, out):
    for seq in args.wallfacer_seqs:
        for name in ("ring zigzag", "wallfacer C=2"):
            report, _, _ = compile_step("7b", name, seq, zero=2)
            row = {"section": "wallfacer", "config": name, "zero": 2, **memory_row(report, seq)}
            print(row, flush=True)
            record["results"].append(row)
            save_record(record, out)
    summarize(record)
    save_record(record, out)


def remat_rows(args, record, out):
    for remat in ("none", "selective", "full"):
        report, _, _ = compile_step("7b", "ring zigzag", args.remat_seq, zero=args.zero, remat=remat)
        row = {
            "section": "remat",
            "config": "ring zigzag",
            "remat": remat,
            "zero": args.zero,
            **memory_row(report, args.remat_seq),
        }
        print(row, flush=True)
        record["results"].append(row)
        save_record(record, out)


def mfu_rows(args, record, out):
    from jaxring.train.metrics import peak_flops

    for preset, name, seq in MFU_RUNS:
        if args.mfu_configs and name not in args.mfu_configs:
            continue
        report, cfg, _plan = compile_step(preset, name, seq, zero=args.zero)
        n = report.num_devices
        model_flops = cfg.flops_per_token(seq, causal=True) * seq  # task.flops_per_step(), batch 1
        est = roofline_of(report, causal=True, model_flops=model_flops / n)
        peak = peak_flops(gpu.gpu_devices(args.target, 1)[0], "bf16")  # what the training loop divides by
        row = {
            "section": "mfu",
            "preset": preset,
            "config": name,
            "seq": seq,
            "devices": n,
            "batch": 1,
            "flops_per_step": model_flops,
            "loop_peak_flops": peak,
            "loop_mfu_at_roofline_time": model_flops / est.time_s / (peak * n),
            "loop_mfu_with_nothing_overlapped": model_flops / est.serial_s / (peak * n),
            "hardware_over_model_flops": est.flops / (model_flops / n),
            "flash_flops": est.flops - report.cost["flops"],
            "xla_flops": report.cost["flops"],
            "roofline": est.to_dict(),
            **memory_row(report, seq),
        }
        print({k: v for k, v in row.items() if k != "roofline"}, flush=True)
        record["results"].append(row)
        save_record(record, out)


SECTIONS = {"remat": remat_rows, "longest": longest_rows, "wallfacer": wallfacer_rows, "mfu": mfu_rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="h200", choices=sorted(gpu.TARGETS))
    parser.add_argument("--only", nargs="*", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--mfu-configs", nargs="*", default=None)
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=0.95,
        help="fraction of the device memory a step may use (default 0.95)",
    )
    parser.add_argument("--unit", type=int, default=8192, help="bisection resolution in tokens")
    parser.add_argument("--zero", type=int, default=3, help="ZeRO stage over sp for sequence strategies")
    parser.add_argument("--wallfacer-seqs", type=int, nargs="*", default=[65536, 131072])
    parser.add_argument("--remat-seq", type=int, default=65536)
    parser.add_argument(
        "--slop",
        type=int,
        default=None,
        help="xla_gpu_memory_limit_slop_factor (percent of device memory XLA's GPU scheduler "
        "may fill; XLA's default 95): XLA trades memory for overlap up to that limit, so "
        "memory_analysis() at the default measures the scheduler's budget as much as the "
        "step's needs; a lower factor makes it schedule for memory",
    )
    parser.add_argument("--first", type=int, default=65536, help="the bisection's first probe (tokens)")
    parser.add_argument("--note", default="", help="recorded with the results (e.g. what was patched)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu_memory.json"))
    args = parser.parse_args(argv)
    if args.slop is not None:
        COMPILER_OPTIONS["xla_gpu_memory_limit_slop_factor"] = args.slop
    ok, why = gpu.available()
    if not ok:
        sys.exit(f"cannot compile for GPU here: {why}")

    import subprocess
    from importlib.metadata import version

    import jaxlib

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout.strip()
    STAMP.update(commit=commit, note=args.note, xla_gpu_memory_limit_slop_factor=args.slop)
    config = {
        "model": "7b",
        "dtype": "bfloat16",
        "remat": "selective",
        "block_ops": "pallas",
        "batch": 1,
        "optimizer": "adamw (fp32 weights and moments)",
        "zero_over_sp": args.zero,
        "device_memory_bytes": gpu_memory_bytes(args.target),
        "budget_fraction": args.budget_fraction,
        "unit": args.unit,
        "xla_gpu_memory_limit_slop_factor": args.slop,
    }
    record = benchmark_record("gpu_memory", gpu.gpu_devices(args.target, 8), config)
    record.update(
        device=f"deviceless compile for 8 x {args.target} (XLA GpuTargetConfigProto), on a CPU host: "
        + record["device"],
        jaxlib=jaxlib.__version__,
        jax_cuda12_plugin=version("jax-cuda12-plugin"),
        commit=commit,
        note=args.note,
    )
    if os.path.exists(args.out):
        import json

        with open(args.out) as f:
            previous = json.load(f)
        # rows this run replaces: its sections (longest: its configs) under the same note
        replaced = lambda r: (
            r.get("section") in args.only
            and r.get("note", "") == args.note
            and (r.get("section") != "longest" or r.get("config") in args.configs)
        )
        record["results"] = [r for r in previous.get("results", []) if not replaced(r)]
    start = time.time()
    for section in SECTIONS:
        if section in args.only:
            SECTIONS[section](args, record, args.out)
    summarize(record)
    save_record(record, args.out)
    print(f"done in {time.time() - start:.0f} s; wrote {args.out}; summary {record.get('summary')}")
    return record


if __name__ == "__main__":
    main()
