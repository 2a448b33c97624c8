"""Per-device memory of the GPT train step with none / tiled loss / tiled MLP / host offload / all three,
compiled for 8 x H100 with no GPU (deviceless AOT; see jaxring/analysis/gpu.py), or for a TPU slice with no TPU
(jaxring/analysis/tpu.py; the tpu-compile extra).

    python benchmarks/memory_techniques.py                    # -> benchmarks/results/memory_techniques.json
    python benchmarks/memory_techniques.py --preset tiny --seqs 4096 --out /tmp/m.json
    python benchmarks/memory_techniques.py --target v5p-16    # -> benchmarks/results/memory_techniques_tpu.json

The step is `TrainStep` as `Trainer` builds it (AdamW, fp32 master weights and moments, bf16 compute,
clipping), batch 1, the flash kernel (on a TPU slice: the Pallas TPU kernel), ring attention (zigzag) over sp = 8
(a TPU slice: its device count) with ZeRO-3 over sp. The model is
GPT-7B's shape with Llama 3's vocabulary (128,256 tokens: the logits a long sequence makes are the largest
activation). Techniques (jaxring.run.schema.MemorySettings):

  none        remat full (each layer keeps its input only)
  loss tile   + --loss-tile: the LM head's [tokens, vocab] logits one tile of rows at a time
  mlp tile    + --mlp-tile: the MLP's [tokens, ffn] one tile of rows at a time
  offload     + --offload layer_inputs: the layer inputs kept in host memory (pinned_host) between forward
              and backward
  all         the three together

Every figure is read from the compiled per-device program: `memory_analysis()` (device argument, output, temp
and alias bytes; the host buffers' bytes) and, from its HLO, the async transfers to and from host memory
(`jaxring.analysis.compiled.host_memory_traffic`).
"""

from __future__ import annotations

import argparse
import os
import subprocess

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless GPU compiles need the CPU platform selected

import jax
import jax.numpy as jnp

from jaxring.analysis import gpu, tpu
from jaxring.analysis.compiled import host_memory_traffic
from jaxring.analysis.records import benchmark_record, save_record

GIB = 2**30
TECHNIQUES = {
    "none": {},
    "loss tile": {"loss_tile": True},
    "mlp tile": {"mlp_tile": True},
    "offload": {"offload": "layer_inputs"},
    "all": {"loss_tile": True, "mlp_tile": True, "offload": "layer_inputs"},
}


def target_devices(target, sp):
    """The abstract devices: sp GPUs of a GPU target, or a TPU slice's devices (sp must be their count)."""
    if target not in tpu.TARGETS:
        return gpu.gpu_devices(target, sp)
    devices = tpu.tpu_devices(target)
    if len(devices) != sp:
        raise SystemExit(f"--target {target} has {len(devices)} devices: give --sp {len(devices)}")
    return devices


def compile_memory(lowered, target):
    """(the compiled per-device memory: peak (argument + output + temp - alias), temp, argument, host bytes (all the
    host memory space's), XLA:TPU's own peak (`peak_memory_in_bytes`, what its HBM check reads; None on a GPU);
    the HLO; compile seconds)."""
    if target in tpu.TARGETS:
        report = tpu.compile_for_tpu(lowered, target=target)
    else:
        report = gpu.compile_for_gpu(lowered, ptxas=False)
    m = report.memory
    return report.peak_bytes, m["temp"], m["argument"], m["host"], m.get("peak"), report.hlo, report.compile_seconds


def step_program(cfg, seq, *, sp, target, loss_tile=None, mlp_tile=None, offload="none"):
    """The lowered train step of GPT `cfg` at `seq` tokens (batch 1) on `sp` abstract GPUs of `target`."""
    from flax import nnx

    import jaxring
    from jaxring.models import gpt
    from jaxring.nn import MemoryPolicy
    from jaxring.run.spec import RunSpec
    from jaxring.train.step import TrainStep
    from jaxring.train.trainer import optimizer

    devices = target_devices(target, sp)
    plan = jaxring.make_plan(
        devices,
        sp=sp,
        attention="ring" if sp > 1 else "dense",
        layout="zigzag",
        zero=3 if sp > 1 else 0,
        block_ops=tpu.BLOCK_OPS if target in tpu.TARGETS else "pallas",
        loss_tile=loss_tile,
        mlp_tile=mlp_tile,
    )
    gpt.check_plan(cfg, plan, 1, seq)
    model = nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model)
    tx = optimizer(RunSpec.of(model="gpt", preset="7b", seq_len=seq, batch_size=1, steps=1000))
    memory = MemoryPolicy(remat="full", offload=offload)
    step = TrainStep(plan, model, tx, gpt.NextTokenObjective(1, seq), memory=memory, dtype=jnp.bfloat16)
    shaped = lambda tree, shardings: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
    params = shaped(nnx.to_pure_dict(state), step.shardings(step.param_specs))
    opt_specs = step.opt_state_specs(params)
    opt_state = shaped(jax.eval_shape(tx.init, params), step.shardings(opt_specs))
    tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=plan.tokens_sharding())
    return step.build(opt_specs).lower(
        params,
        opt_state,
        {"tokens": tokens, "targets": tokens, "positions": tokens},
        jax.ShapeDtypeStruct((2,), jnp.uint32),
        jax.ShapeDtypeStruct((), jnp.float32),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="7b", help="GPT preset (its vocabulary replaced by --vocab)")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary (Llama 3's by default)")
    parser.add_argument("--layers", type=int, default=None, help="layers (default: the preset's)")
    parser.add_argument("--seqs", type=int, nargs="+", default=[65536, 262144])
    parser.add_argument("--sp", type=int, default=8)
    parser.add_argument("--tile", type=int, default=4096, help="rows per loss and MLP tile")
    parser.add_argument("--target", default="h100", choices=sorted(gpu.TARGETS) + sorted(tpu.TARGETS))
    parser.add_argument("--techniques", nargs="+", default=list(TECHNIQUES), choices=list(TECHNIQUES))
    parser.add_argument(
        "--out", help="default: results/memory_techniques.json (a TPU target: memory_techniques_tpu.json)"
    )
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    name = "memory_techniques_tpu.json" if args.target in tpu.TARGETS else "memory_techniques.json"
    args.out = args.out or os.path.join(os.path.dirname(__file__), "results", name)
    from jaxring.models import gpt

    overrides = {"vocab_size": args.vocab} | ({"num_layers": args.layers} if args.layers else {})
    cfg = gpt.get_config(args.preset, **overrides)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__)
    ).stdout.strip()
    record = benchmark_record(
        "memory_techniques",
        target_devices(args.target, args.sp),
        {
            "model": f"gpt {args.preset}",
            "vocab": cfg.vocab_size,
            "num_layers": cfg.num_layers,
            "hidden": cfg.hidden,
            "ffn": cfg.ffn,
            "batch": 1,
            "dtype": "bf16 compute, fp32 weights and AdamW moments",
            "plan": f"ring zigzag sp{args.sp}, ZeRO-3 over sp, remat full, "
            + ("Pallas TPU kernel" if args.target in tpu.TARGETS else "flash kernel"),
            "tile_rows": args.tile,
            "target": f"{args.target} x {args.sp} (deviceless compile)"
            if args.target not in tpu.TARGETS
            else f"{args.target} ({args.sp} devices, deviceless compile)",
        },
    )
    for seq in args.seqs:
        for name in args.techniques:
            t = TECHNIQUES[name]
            lowered = step_program(
                cfg,
                seq,
                sp=args.sp,
                target=args.target,
                loss_tile=args.tile if t.get("loss_tile") else None,
                mlp_tile=args.tile if t.get("mlp_tile") else None,
                offload=t.get("offload", "none"),
            )
            peak, temp, argument, host_bytes, xla_peak, hlo, seconds = compile_memory(lowered, args.target)
            host = host_memory_traffic(hlo)
            row = {
                "seq": seq,
                "technique": name,
                "peak_gib": peak / GIB,
                "temp_gib": temp / GIB,
                "argument_gib": argument / GIB,
                "host_gib": host_bytes / GIB,
                **({"xla_peak_gib": xla_peak / GIB} if xla_peak is not None else {}),
                "host_transfers": host,
                "compile_s": round(seconds, 1),
                "commit": commit,
                "note": args.note,
            }
            record["results"].append(row)
            save_record(record, args.out)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


if __name__ == "__main__":
    main()
