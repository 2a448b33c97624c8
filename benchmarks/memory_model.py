"""The planner's per-device memory estimate against the compiled train step's, on 8 simulated CPU devices.

    python benchmarks/memory_model.py [--out FILE] [--only SUBSTRING] [--note TEXT]

The compared quantity, per device: compiled = argument + output + temp - alias bytes of `memory_analysis()`
(what `jaxring.aot.memory_check.compiled_peak` reads: weights, Adam moments and the batch as arguments, the new
state as outputs, donated state aliased, plus the temporaries at the program's peak); estimate =
`jaxring.planner.cost_model.memory(...).total` of the same plan (`cpu=True`: XLA:CPU's collectives and block ops).
The step is the trainer's (`jaxring.aot.train_step.build_train_step`: AdamW, clipping, remat, offload,
the tiles) on abstract inputs. A row passes when |estimate / compiled - 1| <= 10%.

The grid: a 4-layer GPT (hidden 128, 8 heads, ffn 512, vocab 1024), fp32, one sequence of 2,048 tokens (and
a batch of 8 × 256 for the data-parallel rows), under every sequence strategy, every tensor method, each remat
mode, the memory section's loss and MLP tiles and host offload, ZeRO stages, gradient accumulation and a
pipeline. Then, priced for the GPU, the deviceless 8 x H100 compiles of GPT-7B recorded in
benchmarks/results/memory_techniques.json (each technique at 65,536 and 262,144 tokens; not compiled again
here). Writes benchmarks/results/memory_model.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from jaxring.analysis.records import benchmark_record, save_record
from jaxring.aot.train_step import compile_train_step
from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator
from jaxring.planner import cost_model as cost
from jaxring.planner.params import param_leaves
from jaxring.planner.space import Candidate, Workload

TOLERANCE = 0.10


def config():
    from jaxring.models import gpt

    return gpt.GPTConfig(vocab_size=1024, num_layers=4, hidden=128, num_heads=8, ffn=512)


def cases() -> dict:
    """{name: (seq_len, global batch, Candidate settings)}."""
    long, wide = (2048, 1), (256, 8)
    rows = {
        # every sequence strategy, sp 8 (causal: zigzag where the strategy takes it)
        "ring sp8": (*long, dict(sp=8, attention="ring")),
        "rsa sp8": (*long, dict(sp=8, attention="rsa")),
        "ulysses sp8": (*long, dict(sp=8, attention="ulysses")),
        "usp sp8 u2": (*long, dict(sp=8, attention="usp", ulysses_size=2)),
        "wallfacer sp8 c2": (*long, dict(sp=8, attention="wallfacer", team_size=2)),
        "allgather sp8": (*long, dict(sp=8, attention="allgather")),
        # every tensor method
        "megatron tp2 x ring sp4": (*long, dict(tp=2, sp=4, attention="ring", tensor_parallel="megatron")),
        "megatron tp8": (*long, dict(tp=8, tensor_parallel="megatron")),
        "metp tp4 x dp2": (*wide, dict(dp=2, tp=4, tensor_parallel="metp", micro_batch=4)),
        "optimus tp4 x dp2": (*wide, dict(dp=2, tp=4, tensor_parallel="optimus", micro_batch=4)),
        # remat modes
        "ring sp8 selective": (*long, dict(sp=8, attention="ring", remat="selective")),
        "ring sp8 full": (*long, dict(sp=8, attention="ring", remat="full")),
        "megatron tp2 x ring sp4 selective": (
            *long,
            dict(tp=2, sp=4, attention="ring", tensor_parallel="megatron", remat="selective"),
        ),
        "megatron tp2 x ring sp4 full": (
            *long,
            dict(tp=2, sp=4, attention="ring", tensor_parallel="megatron", remat="full"),
        ),
        "ulysses sp8 full": (*long, dict(sp=8, attention="ulysses", remat="full")),
        "metp tp4 x dp2 full": (*wide, dict(dp=2, tp=4, tensor_parallel="metp", micro_batch=4, remat="full")),
        # the memory section: tiles and offload
        "ring sp8 loss tile 64": (*long, dict(sp=8, attention="ring", loss_tile=64)),
        "ring sp8 mlp tile 64": (*long, dict(sp=8, attention="ring", mlp_tile=64)),
        "ring sp8 full offload": (*long, dict(sp=8, attention="ring", remat="full", offload="layer_inputs")),
        "ring sp8 full, all three": (
            *long,
            dict(sp=8, attention="ring", remat="full", offload="layer_inputs", loss_tile=64, mlp_tile=64),
        ),
        "megatron tp2 x ring sp4 loss tile 64": (
            *long,
            dict(tp=2, sp=4, attention="ring", tensor_parallel="megatron", loss_tile=64),
        ),
        # ZeRO, accumulation, pipeline
        "dp2 x ring sp4 zero1": (*wide, dict(dp=2, sp=4, attention="ring", zero=1, micro_batch=4)),
        "dp2 x ring sp4 zero3": (*wide, dict(dp=2, sp=4, attention="ring", zero=3, micro_batch=4)),
        "dp8 zero2 accumulation": (256, 16, dict(dp=8, zero=2, micro_batch=1)),  # 2 micro-steps
        "pp2 x dp4 1f1b": (256, 16, dict(dp=4, pp=2, pipeline_schedule="1f1b", microbatches=4, micro_batch=1)),
    }
    return rows


def measure(
    name: str, seq_len: int, batch: int, settings: dict, devices, precision: str = "fp32", earlier: dict | None = None
) -> dict:
    """One row: the estimate's parts, the compiled bytes and their ratio. earlier: a row of an earlier run of
    the same case, whose compiled figures are reused (the compiled program does not depend on the cost model)."""
    w = Workload("gpt", config(), seq_len, batch, precision)
    c = Candidate.of(**settings)
    estimate = cost.memory(w, c, param_leaves(w.model, w.config, c.check(w)), cpu=True)
    case = (c.describe(), seq_len, batch)
    if earlier is not None and (earlier.get("plan"), earlier.get("seq_len"), earlier.get("global_batch")) == case:
        return _row(name, c, seq_len, batch, precision, estimate, earlier["compiled_parts"], earlier["compile_s"])
    plan = c.check(w, devices=devices[: c.devices])
    t0 = time.perf_counter()
    compiled = compile_train_step(
        w.model,
        w.config,
        plan,
        batch=w.global_batch,
        seq_len=w.seq_len,
        precision=w.precision,
        memory=c.memory.policy,
        grad_accum=c.steps(w) if c.pp == 1 else 1,
    )
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    parts = {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "alias": m.alias_size_in_bytes,
        "host_temp": getattr(m, "host_temp_size_in_bytes", 0),
    }
    return _row(name, c, seq_len, batch, precision, estimate, parts, round(seconds, 1))


def _row(name, c, seq_len, batch, precision, estimate, parts, seconds) -> dict:
    peak = parts["argument"] + parts["output"] + parts["temp"] - parts["alias"]
    ratio = estimate.total / peak
    return {
        "case": name,
        "plan": c.describe(),
        "seq_len": seq_len,
        "global_batch": batch,
        "precision": precision,
        "estimate_bytes": round(estimate.total),
        "compiled_bytes": int(peak),
        "ratio": round(ratio, 4),
        "within_10_percent": abs(ratio - 1) <= TOLERANCE,
        "estimate_parts": estimate.as_dict(),
        "compiled_parts": parts,
        "compile_s": seconds,
    }


# benchmarks/results/memory_techniques.json (memory_techniques_tpu.json): GPT-7B shapes, Llama 3's vocabulary, ring
# zigzag over sp = 8 (a TPU slice's devices), ZeRO-3, remat full, bf16, tiles of 4,096 rows, compiled for 8 x H100
# (a TPU slice) without the accelerator
TECHNIQUES = {
    "none": {},
    "loss tile": dict(loss_tile=4096),
    "mlp tile": dict(mlp_tile=4096),
    "offload": dict(offload="layer_inputs"),
    "all": dict(loss_tile=4096, mlp_tile=4096, offload="layer_inputs"),
}


def technique_rows(path: str) -> list[tuple[dict, object, object, float]]:
    """(recorded row, workload, candidate, compiled bytes) of each row of a memory_techniques record."""
    with open(path) as f:
        recorded = json.load(f)
    sp = int(recorded["config"]["plan"].split(" sp")[1].split(",")[0])
    out = []
    for r in recorded["results"]:
        w = Workload.of("gpt", "7b", seq_len=r["seq"], global_batch=1, precision="bf16", vocab_size=128256)
        c = Candidate.of(sp=sp, attention="ring", zero=3, remat="full", **TECHNIQUES[r["technique"]])
        out.append((r, w, c, r["peak_gib"] * 2**30))
    return out


def accelerator_rows(path: str) -> list[dict]:
    """The estimate (priced for an accelerator) against the deviceless compiles recorded in `path`."""
    with open(path) as f:
        target = json.load(f)["config"]["target"]
    out = []
    for r, w, c, compiled in technique_rows(path):
        estimate = cost.memory(w, c, param_leaves(w.model, w.config, c.check(w)))
        ratio = estimate.total / compiled
        out.append(
            {
                "case": f"gpt-7b vocab 128256, {r['seq']} tokens, {r['technique']}",
                "plan": c.describe(),
                "target": target,
                "compiled_at_commit": r.get("commit"),
                "estimate_bytes": round(estimate.total),
                "compiled_bytes": round(compiled),
                "ratio": round(ratio, 4),
                "within_10_percent": abs(ratio - 1) <= TOLERANCE,
                "estimate_parts": estimate.as_dict(),
            }
        )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "memory_model.json"))
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    parser.add_argument("--note", default="", help="recorded in the file")
    parser.add_argument(
        "--compiled-from",
        default=None,
        help="an earlier results file: reuse its compiled figures for the same plans (the compiled program does "
        "not depend on the cost model), re-estimating only",
    )
    args = parser.parse_args()
    devices = use_cpu_devices_if_no_accelerator(8)
    cfg = config()
    record = benchmark_record(
        "memory_model",
        devices,
        {
            "model": "gpt",
            **{k: v for k, v in dataclasses.asdict(cfg).items() if k in ("vocab_size", "num_layers", "hidden")},
            "num_heads": cfg.num_heads,
            "ffn": cfg.ffn,
            "compared": "argument + output + temp - alias bytes of memory_analysis() vs cost.memory().total",
            "tolerance": TOLERANCE,
        },
    )
    record["note"] = args.note
    record["results"] = []
    earlier = {}
    if args.compiled_from:
        with open(args.compiled_from) as f:
            earlier = {r["case"]: r for r in json.load(f)["results"]}
        record["compiled_from"] = os.path.basename(args.compiled_from)
    for name, (seq, batch, settings) in cases().items():
        if args.only and args.only not in name:
            continue
        row = measure(name, seq, batch, settings, devices, earlier=earlier.get(name))
        record["results"].append(row)
        save_record(record, args.out)
        flag = "ok " if row["within_10_percent"] else "OFF"
        print(
            f"{flag} {row['ratio']:.3f}  {name:40s} est {row['estimate_bytes'] / 2**20:8.2f} MiB  compiled "
            f"{row['compiled_bytes'] / 2**20:8.2f} MiB  ({row['compile_s']} s)",
            flush=True,
        )
    results = os.path.join(os.path.dirname(__file__), "results")
    record["gpu_results"] = accelerator_rows(os.path.join(results, "memory_techniques.json"))
    record["tpu_results"] = accelerator_rows(os.path.join(results, "memory_techniques_tpu.json"))
    for row in record["gpu_results"] + record["tpu_results"]:
        flag = "ok " if row["within_10_percent"] else "OFF"
        print(
            f"{flag} {row['ratio']:.3f}  {row['case']} ({row['target']}, compiled {row['compiled_bytes'] / 2**30:.2f} GiB)"
        )
    rows = record["results"] + record["gpu_results"] + record["tpu_results"]
    record["summary"] = {
        "rows": len(rows),
        "within_10_percent": sum(r["within_10_percent"] for r in rows),
        "worst_ratio": max((r["ratio"] for r in rows), key=lambda x: abs(x - 1), default=None),
    }
    save_record(record, args.out)
    print(record["summary"])


if __name__ == "__main__":
    main()
