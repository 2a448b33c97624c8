"""One GPT train step (forward, backward, AdamW update) under several meshes: tokens/s and compiled
per-device memory; compile time against the layer count; on a GPU, single-device MFU for gpt2-124m and 1b at
seq 8k with the flash kernel.

    python benchmarks/train_step.py                      # simulated CPU devices -> benchmarks/results/train_step.json
    python benchmarks/train_step.py --compile-layers 2 8 32   # -> benchmarks/results/train_step_compile.json
    python benchmarks/train_step.py --gpu-mfu            # on a GPU -> benchmarks/results/train_step_gpu.json

Timing runs the tiny preset (median of --steps steps after 2 warm-up steps); memory is read from the
compiled step (`compile().memory_analysis()`, per device) for the tiny and gpt2-124m presets. Compile time
is `lower(...).compile()` of the train step (the layer stack is one scan: it should not grow with depth).
"""

from __future__ import annotations

import argparse
import os
import time

from jaxring.analysis.records import benchmark_record, save_record
from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator

MESHES = {
    "1 device": dict(devices=1),
    "dp8": dict(dp=8),
    "sp8 ring zigzag": dict(sp=8, attention="ring"),
    "dp2 x sp4 ring": dict(dp=2, sp=4, attention="ring"),
    "sp8 ulysses": dict(sp=8, attention="ulysses"),
    "sp8 wallfacer C2": dict(sp=8, attention="wallfacer", team_size=2),
    "sp8 usp U2": dict(sp=8, attention="usp", ulysses_size=2),
    "fsdp2 x sp4 ring": dict(fsdp=2, sp=4, attention="ring"),
    "tp8 megatron": dict(tp=8, tensor_parallel="megatron"),
    "dp2 x tp4 megatron": dict(dp=2, tp=4, tensor_parallel="megatron"),
    "dp2 x tp4 optimus": dict(dp=2, tp=4, tensor_parallel="optimus"),
    "tp8 metp": dict(tp=8, tensor_parallel="metp"),
    # tensor x sequence parallelism: Megatron over tp with a sequence strategy over sp
    "tp2 x sp4 ring": dict(tp=2, sp=4, attention="ring"),
    "tp2 x sp4 ulysses": dict(tp=2, sp=4, attention="ulysses"),
    "tp2 x sp4 wallfacer C2": dict(tp=2, sp=4, attention="wallfacer", team_size=2),
    "tp2 x sp4 usp U2": dict(tp=2, sp=4, attention="usp", ulysses_size=2),
    "dp2 x tp2 x sp2 ring": dict(dp=2, tp=2, sp=2, attention="ring"),
    # explicit ZeRO stages over the data axis
    "dp8 zero0": dict(dp=8, zero=0),
    "dp8 zero1": dict(dp=8, zero=1),
    "dp8 zero2": dict(dp=8, zero=2),
    "dp8 zero3": dict(dp=8, zero=3),
    "dp2 x sp4 ring zero3": dict(dp=2, sp=4, attention="ring", zero=3),
}


def step_memory(trainer):
    """Per-device bytes of the compiled train step (arguments, outputs, temporaries)."""
    compiled = trainer.lower_step().compile()
    mem = compiled.memory_analysis()
    return {
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "peak_bytes": mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes,
    }


def measure(cfg, devices, steps, timed):
    import jax

    from jaxring.train.loop import Trainer

    trainer = Trainer(cfg, devices)
    row = {"memory": step_memory(trainer)}
    if timed:
        times = []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            float(trainer.step()["loss"])
            if i >= 2:
                times.append(time.perf_counter() - t0)
        median = sorted(times)[len(times) // 2]
        row.update(step_time_s=median, tokens_per_s=trainer.task.tokens_per_step / median)
        from jaxring.train.loop import peak_flops

        peak = peak_flops(jax.devices()[0], cfg.compute_precision)
        row["mfu"] = (
            None
            if peak is None
            else trainer.task.flops_per_step() / median / (peak * len(trainer.plan.mesh.devices.flat))
        )
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--meshes", nargs="*", default=list(MESHES))
    p.add_argument("--presets", nargs="*", default=["tiny", "gpt2-124m"])
    p.add_argument("--gpu-mfu", action="store_true")
    p.add_argument("--compile-layers", type=int, nargs="*", help="layer counts to time the compile of")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    devices = use_cpu_devices_if_no_accelerator(8)
    from jaxring.run.spec import RunSpec

    if args.gpu_mfu:
        return gpu_mfu(args, devices)
    if args.compile_layers:
        return compile_time(args, devices)
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "train_step.json")
    presets = {
        "tiny": dict(seq_len=1024, batch_size=8, timed=True),
        "gpt2-124m": dict(seq_len=1024, batch_size=8, timed=False),
    }
    record = benchmark_record(
        "train_step",
        devices,
        {"presets": presets, "steps": args.steps, "precision": "fp32", "note": "memory per device"},
    )
    for preset, spec in presets.items():
        if preset not in args.presets:
            continue
        for name in args.meshes:
            mesh = dict(MESHES[name])
            count = mesh.pop("devices", None)
            cfg = RunSpec.of(
                model="gpt",
                preset=preset,
                seq_len=spec["seq_len"],
                batch_size=spec["batch_size"],
                steps=10**6,
                sample_tokens=0,
                progress=False,
                **mesh,
            )
            try:
                row = measure(cfg, devices[:count] if count else devices, args.steps, spec["timed"])
            except (ValueError, ImportError, ModuleNotFoundError) as e:
                row = {"error": str(e)}
            row.update(preset=preset, mesh=name, seq_len=spec["seq_len"], batch_size=spec["batch_size"])
            record["results"].append(row)
            save_record(record, out)
            print(row, flush=True)


COMPILE_MESHES = {
    "sp8 ring zigzag": dict(sp=8, attention="ring"),
    "dp2 x tp2 x sp2 ring": dict(dp=2, tp=2, sp=2, attention="ring"),
    "dp8 zero3": dict(dp=8, zero=3),
}


def compile_time(args, devices):
    """Seconds to lower and compile one train step of the tiny GPT (seq 256, batch 8) at each layer count."""
    from jaxring.run.spec import RunSpec
    from jaxring.train.loop import Trainer

    out = args.out or os.path.join(os.path.dirname(__file__), "results", "train_step_compile.json")
    record = benchmark_record(
        "train_step_compile_time",
        devices,
        {"preset": "tiny", "seq_len": 256, "batch_size": 8, "layers": args.compile_layers},
    )
    for name, mesh in COMPILE_MESHES.items():
        for layers in args.compile_layers:
            cfg = RunSpec.of(
                model="gpt",
                preset="tiny",
                seq_len=256,
                batch_size=8,
                steps=10**6,
                sample_tokens=0,
                progress=False,
                overrides={"num_layers": layers},
                **mesh,
            )
            trainer = Trainer(cfg, devices)
            t0, c0 = time.perf_counter(), time.process_time()
            lowered = trainer.lower_step()
            t1, c1 = time.perf_counter(), time.process_time()
            lowered.compile()
            t2, c2 = time.perf_counter(), time.process_time()
            row = {
                "mesh": name,
                "layers": layers,
                "lower_s": t1 - t0,
                "compile_s": t2 - t1,
                "total_s": t2 - t0,
                # CPU seconds of this process (all threads): less sensitive to other load than wall time
                "lower_cpu_s": c1 - c0,
                "compile_cpu_s": c2 - c1,
                "stablehlo_chars": len(lowered.as_text()),
            }  # the program's size: load-independent
            record["results"].append(row)
            save_record(record, out)
            print(row, flush=True)


def gpu_mfu(args, devices):
    from jaxring.run.spec import RunSpec

    out = args.out or os.path.join(os.path.dirname(__file__), "results", "train_step_gpu.json")
    record = benchmark_record("train_step_gpu_mfu", devices[:1], {"seq_len": 8192, "precision": "bf16"})
    for preset, batch in (("gpt2-124m", 1), ("1b", 1)):
        cfg = RunSpec.of(
            model="gpt",
            preset=preset,
            seq_len=8192,
            batch_size=batch,
            precision="bf16",
            remat="selective",
            steps=10**6,
            sample_tokens=0,
            progress=False,
        )
        try:
            row = measure(cfg, devices[:1], args.steps, True)
        except Exception as e:  # record what failed (e.g. out of memory) and go on
            row = {"error": f"{type(e).__name__}: {e}"[:2000]}
        row.update(preset=preset, seq_len=8192, batch_size=batch)
        record["results"].append(row)
        save_record(record, out)
        print(row, flush=True)


if __name__ == "__main__":
    main()
