"""Train a GPT or DiT with jaxring's parallel strategies, chosen by mesh flags.

    python train.py                                   # tiny GPT, 8 simulated CPU devices, ring (zigzag)
    python train.py --sp 8 --attention wallfacer --team-size 2
    python train.py --tp 4 --dp 2 --tensor-parallel optimus
    python train.py --dp 2 --sp 4 --attention ulysses
    python train.py --tp 2 --sp 4                     # Megatron TP+SP × ring attention (tensor × sequence)
    python train.py --dp 8 --zero 3                   # explicit ZeRO-3 over the data axis
    python train.py --pp 2 --dp 4 --pipeline-schedule zero-bubble --microbatches 4
    python train.py --preset tiny-moe --ep 4 --dp 2    # mixture of experts, experts over ep
    python train.py --model dit --preset tiny --sp 4 --dp 2 --steps 100

Without an accelerator, --cpu-devices N simulated CPU devices are used (default 8). With no mesh flag the
whole machine is one sequence-parallel ring (sp = device count).

Exit codes: 0 done; 2 a bad flag, data file, checkpoint or multi-host set-up (one line on stderr; --debug
shows the traceback); 3 training diverged (see --on-divergence); 128 + N stopped by signal N (SIGTERM: 143,
SIGINT: 130) after finishing the step and saving it.
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_USER_ERROR, EXIT_DIVERGED = 2, 3
MESH_FLAGS = (
    ("dp", "data"),
    ("fsdp", "data, parameters sharded (ZeRO-3 by default)"),
    ("pp", "pipeline"),
    ("tp", "tensor"),
    ("sp", "sequence/context"),
    ("ep", "expert (data parallel outside MoE layers)"),
)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line (not the usage block), exit code 2."""
        self.exit(EXIT_USER_ERROR, f"error: {message} (see python train.py --help)\n")


def parse_args(argv=None):
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    g.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="change a preset field, e.g. --override num_layers=2 (repeatable)",
    )
    from jaxring.plan import ZERO_STAGES
    from jaxring.registry import ALL_LAYOUTS, SEQUENCE_STRATEGIES, strategy_options
    from jaxring.tensor import TENSOR_METHODS

    g = p.add_argument_group("mesh (degrees multiply to the device count)")
    for axis, text in MESH_FLAGS:
        g.add_argument(f"--{axis}", type=int, default=None, help=f"{text} parallel degree")
    g.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices when there is no accelerator")
    g.add_argument(
        "--plan",
        choices=("auto",),
        help="auto: the planner's best plan for the devices at hand "
        "(python -m jaxring.planner); mesh and strategy flags given "
        "with it are held fixed",
    )
    g.add_argument(
        "--zero",
        type=int,
        choices=ZERO_STAGES,
        help="ZeRO stage over the data and sequence axes: 0 replicated, 1 optimizer state sharded, "
        "2 gradients too, 3 parameters too (default: 3 with --fsdp > 1, else 0)",
    )
    g = p.add_argument_group("strategies (from jaxring.registry)")
    g.add_argument(
        "--attention",
        choices=tuple(SEQUENCE_STRATEGIES),
        metavar="{" + ",".join(SEQUENCE_STRATEGIES) + "}",
        help="; ".join(f"{s.name}: {s.summary}" for s in SEQUENCE_STRATEGIES.values()),
    )
    g.add_argument("--layout", choices=ALL_LAYOUTS, help="token layout over sp (default: the strategy's)")
    for name, (option, users) in strategy_options().items():
        g.add_argument(
            "--" + name.replace("_", "-"),
            type=option.type,
            choices=option.choices,
            help=f"{'/'.join(users)}: {option.help}",
        )
    from jaxring.pipeline import SCHEDULES

    g.add_argument(
        "--pipeline-schedule",
        choices=SCHEDULES,
        default="1f1b",
        help="pp > 1: gpipe (all forward, all backward), 1f1b, interleaved (with --virtual-stages) or "
        "zero-bubble (ZB-H1: input and weight gradients split)",
    )
    g.add_argument("--microbatches", type=int, help="pp > 1: micro-batches per step (default 2·pp)")
    g.add_argument("--virtual-stages", type=int, default=1, help="interleaved: layer chunks per pipeline stage")
    methods = tuple(m for m in TENSOR_METHODS if m != "none")
    g.add_argument(
        "--tensor-parallel",
        choices=methods,
        help="; ".join(f"{TENSOR_METHODS[m].name}: {TENSOR_METHODS[m].summary}" for m in methods),
    )
    g = p.add_argument_group("numerics and memory")
    g.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="compute dtype; master weights and optimizer state stay fp32",
    )
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
    g.add_argument("--debug", action="store_true", help="show the traceback of an error, not only its line")
    g = p.add_argument_group("divergence guard")
    g.add_argument(
        "--on-divergence",
        choices=("stop", "skip"),
        default="stop",
        help="when the loss is NaN/Inf or spikes: stop (exit 3), or skip the step (undo its update)",
    )
    g.add_argument(
        "--spike-factor",
        type=float,
        default=3.0,
        help="a loss above this multiple of its lowest running mean is a spike (0: NaN/Inf only)",
    )
    g.add_argument("--spike-window", type=int, default=20, help="losses in the running mean")
    g = p.add_argument_group("multi-host")
    g.add_argument("--coordinator", help="HOST:PORT of process 0 (default: $JAX_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=int, help="default: $JAX_NUM_PROCESSES")
    g.add_argument("--process-id", type=int, help="0 .. num-processes - 1 (default: $JAX_PROCESS_ID)")
    g.add_argument(
        "--init-timeout", type=float, default=300, help="seconds to wait for every process to reach the coordinator"
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxring.train.guard import Diverged
    from jaxring.train.signals import Interrupted

    try:
        return run(args)
    except Interrupted as e:  # the loop saved and said so
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Diverged as e:
        if args.debug:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_DIVERGED
    except (ValueError, OSError) as e:  # bad flags, data, checkpoints, multi-host set-up
        if args.debug:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def run(args) -> int:
    from jaxring.train.guard import DivergenceGuard
    from jaxring.train.multihost import env_int, initialize
    from jaxring.train.validate import parse_overrides

    guard = DivergenceGuard(args.on_divergence, args.spike_factor, args.spike_window)
    overrides = parse_overrides(args.model, args.override)
    coordinator = args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = args.num_processes if args.num_processes is not None else env_int("JAX_NUM_PROCESSES")
    process_id = args.process_id if args.process_id is not None else env_int("JAX_PROCESS_ID")
    if isinstance(args.cpu_devices, bool) or args.cpu_devices < 1:
        raise ValueError(f"--cpu-devices {args.cpu_devices} must be a positive integer (simulated CPU devices)")
    if coordinator or num_processes is not None:
        initialize(coordinator, num_processes, process_id, timeout_s=args.init_timeout, cpu_devices=args.cpu_devices)
    from jaxring.platform import use_cpu_devices_if_no_accelerator

    devices = use_cpu_devices_if_no_accelerator(args.cpu_devices)
    from jaxring.train.loop import TrainConfig, train

    if args.plan == "auto":
        from jaxring.planner.auto import apply_auto_plan

        apply_auto_plan(args, devices, overrides)
    degrees = {a: getattr(args, a) for a, _ in MESH_FLAGS}
    if all(v is None for v in degrees.values()):
        degrees["sp"] = len(devices)  # default: one sequence-parallel ring over every device
    degrees = {a: 1 if v is None else v for a, v in degrees.items()}  # 0 or less: refused by the config
    cfg = TrainConfig(
        model=args.model,
        preset=args.preset,
        steps=args.steps,
        seed=args.seed,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        image_size=args.image_size,
        lr=args.lr,
        warmup=args.warmup,
        grad_accum=args.grad_accum,
        **degrees,
        attention=args.attention,
        layout=args.layout,
        team_size=args.team_size,
        ulysses_size=args.ulysses_size,
        placement=args.placement,
        tensor_parallel=args.tensor_parallel,
        zero=args.zero,
        pipeline=args.pipeline_schedule,
        microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
        precision=args.precision,
        remat=args.remat,
        data=args.data,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        metrics_file=args.metrics_file,
        profile=args.profile,
        sample_tokens=args.sample_tokens,
        sample_path=args.sample_path,
        progress=not args.no_progress,
        log_every=args.log_every,
        model_overrides=overrides,
    )
    train(cfg, guard=guard)
    return 0


if __name__ == "__main__":
    sys.exit(main())
