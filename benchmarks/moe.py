"""One MoE FFN layer (jaxring.nn.moe), and whole MoE GPTs, under expert parallelism: tokens/s, compiled peak memory
and all-to-all bytes per device, for ep in {1, 2, 4, 8} (the other devices data parallel: dp = 8/ep), dropless
against capacity factor 1.25.

    python benchmarks/moe.py                              # block rows -> benchmarks/results/moe.json
    python benchmarks/moe.py --scope model                # GPT rows, added to the rows already in that file

Sizes: "tiny" (hidden 64, 8 experts top-2, ffn 128, 1024 tokens) and "mid" (hidden 256, 16 experts top-2,
ffn 512, 4096 tokens), SwiGLU, fp32, the same global batch on every mesh. Dropless is measured with both
grouped matmuls ("blocked", jaxring's CPU default, and "ragged_dot", which jax lowers on CPU to a masked dense
matmul: E_local times the FLOPs and an [rows, E_local*hidden] temporary). Simulated CPU devices share the
host's cores: read the times as relative, for this host.

--scope model: the whole GPT train step as `train.py --preset P --ep E --dp 8/E` runs it (forward, backward,
gradient reduction, clipping, AdamW; `jaxring.train.trainer.Trainer`), for "tiny-moe" (the preset: 2 layers, hidden 64,
8 experts top-2 of ffn 128, SwiGLU; batch 8 x seq 128) and "mid-moe" (2 layers, hidden 256, 8 heads, 16 experts
top-2 of ffn 512, SwiGLU: the block benchmark's "mid" experts in a GPT; batch 16 x seq 256), fp32. Per row:
compiled peak/temp/argument bytes per device, all-to-all bytes per device per step and the formula (per MoE
layer: 4 exchanges of the dispatch buffer, (ep-1)/ep of it received, plus dropless's int32 counts: see
tests/unit/nn/test_moe.py), compile time, median step time of --model-steps steps after one warm-up, tokens/s, and the
first step's loss, drop rate and load imbalance. Rows carry "scope": "model" (the block rows have no "scope").
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp

from jaxring.analysis.records import benchmark_record, save_record
from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator

SIZES = {  # name -> (hidden, experts, top-k, ffn, batch, seq)
    "tiny": (64, 8, 2, 128, 8, 128),
    "mid": (256, 16, 2, 512, 16, 256),
}


def setup(size, ep, capacity_factor, grouped_matmul, devices):
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxring.core.mesh import DATA_AXES, make_mesh
    from jaxring.nn.moe import MoE, MoEConfig, param_specs, sharded_moe_ffn

    hidden, experts, k, ffn, batch, seq = SIZES[size]
    config = MoEConfig(
        num_experts=experts,
        experts_per_token=k,
        ffn=ffn,
        activation="swiglu",
        capacity_factor=capacity_factor,
        grouped_matmul=grouped_matmul,
    )
    mesh = make_mesh(dp=len(devices) // ep, ep=ep, devices=devices)
    params = MoE(hidden, config, rngs=nnx.Rngs(0)).params()
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, param_specs(config))
    x_sharding = NamedSharding(mesh, P(DATA_AXES, "sp", None))
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (batch, seq, hidden)), x_sharding)
    dy = jax.device_put(jax.random.normal(jax.random.PRNGKey(2), (batch, seq, hidden)), x_sharding)

    def train_step(x, params, dy):
        def loss(x, params):
            y, stats = sharded_moe_ffn(x, params, mesh=mesh, config=config)
            return jnp.sum(y * dy) + stats["loss"], stats

        (_, stats), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
        return grads, stats

    return train_step, (x, params, dy), config, batch * seq


def measure(size, ep, capacity_factor, grouped_matmul, devices, runs):
    from jaxring.analysis import compile_stats
    from jaxring.core.timing import median_seconds

    step, args, _config, tokens = setup(size, ep, capacity_factor, grouped_matmul, devices)
    s = compile_stats(step, *args, num_devices=len(devices))
    fn = jax.jit(step)
    seconds = median_seconds(fn, *args, runs=runs)
    stats = fn(*args)[1]
    return {
        "size": size,
        "ep": ep,
        "dp": len(devices) // ep,
        "dispatch": f"dropless ({grouped_matmul})" if capacity_factor is None else f"capacity {capacity_factor}",
        "tokens": tokens,
        "fwd_bwd_s": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_bytes": s.peak_bytes,
        "temp_bytes": s.temp_bytes,
        "argument_bytes": s.argument_bytes,
        "all_to_all_bytes": s.bytes_moved["all-to-all"],
        "bytes_moved": s.bytes_moved,
        "drop_rate": float(stats["drop_rate"]),
        "load_imbalance": float(stats["load_imbalance"]),
    }


MODELS = {  # name -> (preset, overrides, batch, seq)
    "tiny-moe": ("tiny-moe", {}, 8, 128),
    "mid-moe": ("tiny-moe", dict(num_layers=2, hidden=256, num_heads=8, ffn=512, num_experts=16), 16, 256),
}


def all_to_all_formula(moe, num_layers, tokens_per_device, ep, hidden):
    """All-to-all bytes received per device in one train step (see tests/unit/nn/test_moe.py::test_all_to_all_bytes)."""
    if ep == 1:
        return 0
    k, e = moe.experts_per_token, moe.num_experts
    if moe.dropless:
        buffer = ep * tokens_per_device * min(k, e // ep) * hidden * 4
        counts = (ep - 1) * e * 4 // ep
    else:
        buffer = e * moe.capacity(tokens_per_device) * hidden * 4
        counts = 0
    return num_layers * (4 * ((ep - 1) * buffer // ep) + counts)


def measure_model(name, ep, capacity_factor, devices, steps):
    from jaxring.analysis.compiled import collective_traffic
    from jaxring.run.spec import RunSpec
    from jaxring.train.loop import Trainer

    preset, overrides, batch, seq = MODELS[name]
    cfg = RunSpec.of(
        model="gpt",
        preset=preset,
        overrides={**overrides, "capacity_factor": capacity_factor},
        seq_len=seq,
        batch_size=batch,
        steps=10**6,
        sample_tokens=0,
        eval_at_end=False,
        progress=False,
        ep=ep,
        dp=len(devices) // ep,
    )
    trainer = Trainer(cfg, devices)
    config = trainer.task.config
    start = time.perf_counter()
    # the trainer's own jitted step (its compiled executable is cached: the steps below reuse it)
    compiled = trainer.lower_step().compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    moved, ops = collective_traffic(compiled.as_text(), len(devices))
    formula = all_to_all_formula(config.moe, config.num_layers, batch * seq // len(devices), ep, config.hidden)
    first, times = None, []
    for i in range(1 + steps):
        t0 = time.perf_counter()
        out = trainer.step()
        loss = float(out["loss"])  # waits for the step
        if i:
            times.append(time.perf_counter() - t0)
        else:
            first = {"loss": loss, "drop_rate": float(out["drop_rate"]), "load_imbalance": float(out["load_imbalance"])}
    seconds = sorted(times)[len(times) // 2]
    return {
        "scope": "model",
        "model": name,
        "ep": ep,
        "dp": len(devices) // ep,
        "dispatch": "dropless" if capacity_factor is None else f"capacity {capacity_factor}",
        "params": config.num_params(),
        "active_params": config.num_params(active=True),
        "tokens": batch * seq,
        "compile_s": compile_s,
        "step_s": seconds,
        "tokens_per_s": batch * seq / seconds,
        "peak_bytes": mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "all_to_all_bytes": moved["all-to-all"],
        "all_to_all_formula": formula,
        "all_to_all_ops": ops["all-to-all"],
        "bytes_moved": moved,
        **{f"first_step_{k}": v for k, v in first.items()},
    }


def main_model(args, devices):
    """Whole-model rows appended to the existing record (the block rows stay as they are)."""
    import json

    record = benchmark_record("moe", devices, {})
    if os.path.exists(args.out):
        with open(args.out) as f:
            record = json.load(f)
    run = benchmark_record(
        "moe",
        devices,
        {k: v for k, v in vars(args).items() if k != "out"}
        | {"models_def": {m: MODELS[m] for m in args.models}, "models_fields": "preset, overrides, batch, seq"},
    )
    del run["results"]
    run["host_load_average_start"] = os.getloadavg()
    record.setdefault("model_runs", []).append(run)
    for name in args.models:
        for ep in args.eps:
            for cf in [None] + args.capacity_factors:
                try:
                    row = measure_model(name, ep, cf, devices, args.model_steps)
                except Exception as e:
                    row = {
                        "scope": "model",
                        "model": name,
                        "ep": ep,
                        "capacity_factor": cf,
                        "error": f"{type(e).__name__}: {e}"[:500],
                    }
                record["results"].append(row)
                print({k: v for k, v in row.items() if k != "bytes_moved"}, flush=True)
                run["host_load_average_end"] = os.getloadavg()
                save_record(record, args.out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="*", default=list(SIZES))
    p.add_argument("--eps", type=int, nargs="*", default=[1, 2, 4, 8])
    p.add_argument("--capacity-factors", type=float, nargs="*", default=[1.25])
    p.add_argument(
        "--grouped-matmuls",
        nargs="*",
        default=["blocked", "ragged_dot"],
        help="dropless grouped matmul implementations to measure",
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--scope",
        choices=("block", "model"),
        default="block",
        help="block: the MoE layer alone (replaces the record); model: whole MoE GPTs (adds rows)",
    )
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--model-steps", type=int, default=3, help="timed train steps per model row")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "moe.json"))
    args = p.parse_args()
    devices = use_cpu_devices_if_no_accelerator(8)
    if args.scope == "model":
        return main_model(args, devices)
    record = benchmark_record(
        "moe",
        devices,
        vars(args)
        | {"sizes_def": {s: SIZES[s] for s in args.sizes}, "sizes_fields": "hidden, experts, k, ffn, batch, seq"},
    )
    dispatches = [(None, gm) for gm in args.grouped_matmuls] + [(cf, "auto") for cf in args.capacity_factors]
    for size in args.sizes:
        for ep in args.eps:
            for cf, gm in dispatches:
                row = measure(size, ep, cf, gm, devices, args.runs)
                record["results"].append(row)
                print({k: v for k, v in row.items() if k != "bytes_moved"}, flush=True)
                save_record(record, args.out)


if __name__ == "__main__":
    main()
