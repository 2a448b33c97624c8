"""Train a GPT or DiT with jaxring's parallel strategies, chosen by mesh flags.

    python train.py                                   # tiny GPT, 8 simulated CPU devices, ring (zigzag)
    python train.py --sp 8 --attention wallfacer --team-size 2
    python train.py --tp 4 --dp 2 --tensor-parallel optimus
    python train.py --dp 2 --sp 4 --attention ulysses
    python train.py --model dit --preset tiny --sp 4 --dp 2 --steps 100

Without an accelerator, --cpu-devices N simulated CPU devices are used (default 8). With no mesh flag the
whole machine is one sequence-parallel ring (sp = device count).
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and run")
    g.add_argument("--model", choices=("gpt", "dit"), default="gpt")
    g.add_argument("--preset", default="tiny", help="gpt: tiny, gpt2-124m, 1b, 7b; dit: tiny, dit-s, dit-1b")
    g.add_argument("--steps", type=int, default=150)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch-size", type=int, default=8, help="global batch (sequences or images)")
    g.add_argument("--seq-len", type=int, default=None, help="GPT tokens per sequence (default 256)")
    g.add_argument("--image-size", type=int, default=None, help="DiT image side (default: the preset's)")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--warmup", type=int, default=20)
    g.add_argument("--grad-accum", type=int, default=1)
    g.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                   help="change a preset field, e.g. --override num_layers=2 (repeatable)")
    g = p.add_argument_group("mesh (degrees multiply to the device count)")
    for axis, text in (("dp", "data"), ("fsdp", "data, parameters sharded (ZeRO-3)"), ("pp", "pipeline"),
                       ("tp", "tensor"), ("sp", "sequence/context")):
        g.add_argument(f"--{axis}", type=int, default=None, help=f"{text} parallel degree")
    g.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices when there is no accelerator")
    g = p.add_argument_group("strategies")
    g.add_argument("--attention", choices=("dense", "ring", "rsa", "ulysses", "wallfacer", "allgather", "usp"))
    g.add_argument("--layout", choices=("contiguous", "zigzag", "striped"))
    g.add_argument("--team-size", type=int, help="wallfacer team size C (C² divides sp)")
    g.add_argument("--ulysses-size", type=int, help="usp: Ulysses degree U (divides sp)")
    g.add_argument("--tensor-parallel", choices=("megatron", "optimus", "metp"))
    g = p.add_argument_group("numerics and memory")
    g.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="compute dtype; master weights and optimizer state stay fp32")
    g.add_argument("--remat", choices=("none", "selective", "full"), default="none")
    g = p.add_argument_group("output")
    g.add_argument("--data", help="text file/dir, nanoGPT .bin, or (DiT) image folder; default: bundled")
    g.add_argument("--checkpoint-dir")
    g.add_argument("--checkpoint-every", type=int, default=0)
    g.add_argument("--keep-checkpoints", type=int, default=3)
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    g.add_argument("--metrics-file", help="append one JSON line per step")
    g.add_argument("--profile", help="write a JAX profiler trace of a few steps to this directory")
    g.add_argument("--sample-tokens", type=int, default=200, help="GPT: tokens to generate at the end (0: none)")
    g.add_argument("--sample-path", default="samples.png", help="DiT: where to write the sample grid")
    g.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    g.add_argument("--log-every", type=int, default=10, help="steps between log lines without a progress bar")
    g = p.add_argument_group("multi-host")
    g.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"))
    g.add_argument("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"))
    g.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"))
    return p.parse_args(argv)


def _overrides(items) -> dict:
    out = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--override {item!r} must be FIELD=VALUE")
        try:
            out[field] = json.loads(value)
        except json.JSONDecodeError:
            out[field] = value
    return out


def _env_int(name):
    value = os.environ.get(name)
    return int(value) if value is not None else None


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    if args.coordinator or args.num_processes:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices across processes
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    from jaxring.platform import use_cpu_devices_if_no_accelerator
    devices = use_cpu_devices_if_no_accelerator(args.cpu_devices)
    from jaxring.train.loop import TrainConfig, train

    degrees = {a: getattr(args, a) for a in ("dp", "fsdp", "pp", "tp", "sp")}
    if all(v is None for v in degrees.values()):
        degrees["sp"] = len(devices)        # default: one sequence-parallel ring over every device
    degrees = {a: v or 1 for a, v in degrees.items()}
    cfg = TrainConfig(model=args.model, preset=args.preset, steps=args.steps, seed=args.seed,
                      batch_size=args.batch_size, seq_len=args.seq_len, image_size=args.image_size, lr=args.lr,
                      warmup=args.warmup, grad_accum=args.grad_accum, **degrees, attention=args.attention,
                      layout=args.layout, team_size=args.team_size, ulysses_size=args.ulysses_size,
                      tensor_parallel=args.tensor_parallel, precision=args.precision, remat=args.remat,
                      data=args.data, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                      keep_checkpoints=args.keep_checkpoints, resume=args.resume, metrics_file=args.metrics_file,
                      profile=args.profile, sample_tokens=args.sample_tokens, sample_path=args.sample_path,
                      progress=not args.no_progress, log_every=args.log_every)
    try:
        cfg.model_overrides = _overrides(args.override)
        train(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
