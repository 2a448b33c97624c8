"""Train a GPT or DiT with jaxring's parallel strategies, chosen by mesh flags.

    python train.py                                   # tiny GPT, 8 simulated CPU devices, ring (zigzag)
    python train.py --sp 8 --attention wallfacer --team-size 2
    python train.py --tp 4 --dp 2 --tensor-parallel optimus
    python train.py --tp 2 --sp 4                     # Megatron TP+SP × ring attention (tensor × sequence)
    python train.py --pp 2 --dp 4 --pipeline-schedule zero-bubble --microbatches 4 --batch-size 16
    python train.py --preset tiny-moe --ep 4 --dp 2   # mixture of experts, experts over ep
    python train.py --model dit --preset tiny --sp 4 --dp 2 --steps 100
    python train.py --print-config --sp 8 > run.yaml; python train.py --config run.yaml --steps 20

Every setting is a flag (below, with its default) and a key of the run's YAML (`--config`, `--print-config`);
each run writes its resolved settings to OUT_DIR/run.yaml. Without an accelerator, --cpu-devices N simulated
CPU devices are used (default 8). With no mesh flag the whole machine is one sequence-parallel ring.

`--compile-for h100x8` (h200x8, h100x1, h200x1; TPU slices v5e-8, v5p-8, v5p-128, v6e-8, tpu7x-8, ...) compiles
the run's step for that machine with no GPU or TPU (needs jax[cuda12], or libtpu: the tpu-compile extra) and exits: its last line `fits: compiled X GiB per device, estimate Y GiB, budget Z GiB; host memory
...` (exit 0) or `does not fit: ...` (exit 3); with --plan auto, the planner's best plan for that machine that fits.

Exit codes: 0 done; 2 a bad flag, config, data file, checkpoint or multi-host set-up (one line on stderr;
--debug shows the traceback); 3 training diverged (see --on-divergence); 128 + N stopped by signal N
(SIGTERM: 143, SIGINT: 130, SIGHUP: 129) after finishing the step and saving it (a step or save that
cannot finish is ended by a watchdog after JAXRING_STOP_GRACE_S seconds, default 300, with the same code).

Multi-host: --coordinator, --num-processes, --process-id on every process; inside a SLURM job or an Open MPI
launch, no flags are needed (jax.distributed finds them; see examples/slurm.sh).
"""

from __future__ import annotations

import os
import signal
import sys

if __name__ == "__main__":  # a stop signal while jax imports ends the command at once, in one line (see below)

    def _exit_at_once(signum: int, frame: object) -> None:
        os.write(
            2, ("interrupted\n" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}\n").encode()
        )
        os._exit(128 + signum)

    for _s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_s, _exit_at_once)

from jaxring.aot.compile_for import check_target, compile_for
from jaxring.aot.fits import check_compiled_fits
from jaxring.aot.margin import apply_auto_plan_at_the_margin
from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator
from jaxring.core.stop_signals import exit_code
from jaxring.planner.auto import apply_auto_plan
from jaxring.planner.search import NoPlanError
from jaxring.run.checks import check_block_ops
from jaxring.run.cli import EXIT_USER_ERROR, parse_command_line
from jaxring.train.guard import Diverged
from jaxring.train.loop import prepare, train
from jaxring.train.multihost import shared_settings, start_processes
from jaxring.train.signals import TrainingStopped

EXIT_DIVERGED = 3


def main(argv=None) -> int:
    spec, meta = parse_command_line(argv, prog="train.py", description=__doc__)
    try:
        if meta.compile_for:
            return compile_only(spec, meta.compile_for)
        return run(spec, print_config=meta.print_config)
    except TrainingStopped as e:  # the loop saved and said so
        return e.exit_code
    except KeyboardInterrupt as e:  # before the loop: jaxring.data's preparation says what it left, and its code
        print(str(e) or "interrupted", file=sys.stderr)
        return exit_code(e)
    except Diverged as e:
        if meta.debug:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_DIVERGED
    except (ValueError, OSError) as e:  # bad flags, data, checkpoints, multi-host set-up
        if meta.debug:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def compile_only(spec, target: str) -> int:
    """--compile-for TARGET: the run's step compiled for a GPU machine or TPU slice without one; 0 fits, 3 does not."""
    spec.validate()
    check_target(target)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless: the CUDA plugin and libtpu need the CPU platform
    return compile_for(spec, target)


def run(spec, *, print_config: bool = False) -> int:
    """Starts the processes and devices, resolves the plan (--plan auto: the planner's), then prints the
    resolved run (--print-config) or trains it."""
    spec.validate()  # every setting's rule, before any process or device starts
    start_processes(spec.cluster, shared_settings(spec))  # checks that every process has the same settings
    devices = use_cpu_devices_if_no_accelerator(spec.cluster.cpu_devices)
    check_block_ops(spec.parallel.block_ops, devices[0].platform)
    if spec.parallel.plan == "auto":
        log = (lambda *a: None) if print_config else print
        try:
            spec = apply_auto_plan(spec, devices, log=log)
        except NoPlanError as refused:
            if devices[0].platform == "cpu":  # simulated devices: the estimate is the host's check
                raise
            spec = apply_auto_plan_at_the_margin(spec, devices, refused, log=log)
    if print_config:
        resolved = prepare(spec, len(devices))
        resolved.output.out_dir = spec.output.out_dir  # as given: a fresh run directory each time, unless named
        print(resolved.to_yaml(), end="")
        return 0
    if devices[0].platform != "cpu":  # accelerators: a run estimated above the budget is compiled, which decides
        check_compiled_fits(spec, devices)
    train(spec, devices=devices)
    return 0


if __name__ == "__main__":
    sys.exit(main())
