"""`python -m jaxring.eval perplexity|needle CHECKPOINT [options] [plan flags]`.

CHECKPOINT: a jaxring checkpoint directory (`train.py --checkpoint-dir`) or a Hugging Face one. The plan
flags are train.py's (`--sp 8 --attention ring --layout zigzag`, `--tp 2 --tensor-parallel megatron`, ...:
`jaxring.run.cli`); the model runs as one SPMD program on it. Writes OUT/perplexity.json + perplexity.png or
OUT/needle.json + needle.png and prints a table. A mistake (a missing checkpoint, a context the model or plan
cannot take, a depth outside [0, 1], an --out that is a file or cannot be written in, --pp: evaluation does
not pipeline) ends in one line and exit code 2, before the model is scored. The table is printed before the
files are written; each file is written whole or not at all (a temporary file renamed), and one that cannot
be written (a full disk) is one line, exit code 2. Ctrl-C, SIGTERM, SIGHUP: one line, exit code 128 + N.

    python -m jaxring.eval perplexity runs/ckpt --seq-len 2048 --sp 8 --attention ring --layout zigzag
    python -m jaxring.eval needle HF_DIR --lengths 1024,2048 --depths 0,0.5,1 --sp 8 --attention ring
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from tqdm.auto import tqdm

from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator
from jaxring.core.stop_signals import exit_code, stop_message, stops_on_signals
from jaxring.eval import loading, needle, output_files, perplexity, plots
from jaxring.eval.fits import check_context_fits
from jaxring.run.checks import check_block_ops
from jaxring.run.cli import EXIT_USER_ERROR, parse_command_line
from jaxring.run.spec import RunSpec
from jaxring.run.task import model_family

PROG = "python -m jaxring.eval"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        self.exit(EXIT_USER_ERROR, f"error: {message} (see {self.prog} --help)\n")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1024,2048") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a positive integer")
    return value


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers, e.g. 0,0.5,1") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, text in (
        ("perplexity", "loss by position bucket on held-out data"),
        ("needle", "pass-key retrieval over context lengths x needle depths"),
    ):
        s = sub.add_parser(name, help=text, description=text + "; plan flags as train.py's (--sp, --attention, ...)")
        s.add_argument("checkpoint", help="a jaxring checkpoint directory or a Hugging Face directory")
        s.add_argument("--out", default="eval", help="directory of the JSON and PNG (default: eval)")
        s.add_argument("--label", help="the model's name in the table, JSON and plot (default: its path)")
        s.add_argument("--model", default="gpt", help="model family of a Hugging Face directory (default: gpt)")
        s.add_argument("--step", type=int, help="the checkpoint step (default: the newest)")
        s.add_argument("--tokenizer", help="bytes or a tokenizer.json (default: the model's)")
        s.add_argument(
            "--override", action="append", default=[], metavar="FIELD=VALUE", help="change a config field (RoPE)"
        )
        s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
        s.add_argument("--debug", action="store_true", help="show the traceback of an error")
        if name == "perplexity":
            s.add_argument("--seq-len", type=_positive, required=True, help="tokens per row (the context evaluated)")
            s.add_argument("--data", help="a store, text/.jsonl file or directory (default: the bundled corpus)")
            s.add_argument("--batch-size", type=_positive, default=1, help="rows per forward pass (default: 1)")
            s.add_argument("--batches", type=_positive, default=4, help="forward passes (default: 4)")
            s.add_argument(
                "--first-bucket", type=_positive, help="end of the first bucket (default: seq_len/8, <= 256)"
            )
        else:
            s.add_argument("--lengths", type=_ints, required=True, help="context lengths, e.g. 1024,2048,4096")
            s.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="in [0, 1]")
            s.add_argument("--samples", type=_positive, default=2, help="pass keys per cell (default: 2)")
            s.add_argument("--seed", type=int, default=0, help="seed of the pass keys (default: 0)")
            s.add_argument("--batch-size", type=_positive, help="sequences per forward pass (default: a length's all)")
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    spec, _ = parse_command_line(rest, prog=f"{PROG} {args.command}")  # the plan flags (one line when bad)
    try:
        with stops_on_signals():
            return _run(args, spec)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP: one line, 128 + N; nothing partial was written
        print(stop_message(e), file=sys.stderr)
        return exit_code(e)
    except (ValueError, FileNotFoundError) as e:
        if args.debug:
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USER_ERROR


def _check_no_pipeline(spec: RunSpec) -> None:
    """Evaluation runs one forward pass of the whole stack per batch: no pipeline. Said before the plan flags
    are resolved (whose rules are train.py's, about --batch-size and micro-batches)."""
    pp = spec.parallel.pp
    if pp is not None and pp > 1:
        raise ValueError(
            f"--pp {pp}: evaluation does not pipeline (one forward pass of the whole stack); a checkpoint "
            f"restores onto any mesh, so drop --pp (and the pipeline flags) and give its devices to another axis, "
            f"e.g. --dp or --sp"
        )


def _check_no_training_memory_flags(spec: RunSpec) -> None:
    """--offload and --remat-layers place what a training step keeps for its backward and its optimizer;
    evaluation runs forward passes only, so they are refused rather than silently ignored."""
    memory = spec.memory
    if memory.offload:
        raise ValueError(
            f"--offload {memory.offload}: evaluation runs forward passes only (no layer inputs kept for a backward, "
            f"no optimizer state), so there is nothing to offload; drop --offload"
        )
    if memory.remat_layers > 1:
        raise ValueError(
            f"--remat-layers {memory.remat_layers}: evaluation runs forward passes only (nothing is recomputed); "
            f"drop --remat-layers"
        )


def _run(args: argparse.Namespace, spec: RunSpec) -> int:
    _check_no_pipeline(spec)
    _check_no_training_memory_flags(spec)
    if args.command == "needle":  # said before anything loads
        needle.check_depths(args.depths)
    output_files.check_output_dir(args.out, "--out")  # before scoring, not after it
    plots.check_available()
    devices = use_cpu_devices_if_no_accelerator(spec.cluster.cpu_devices)  # as train.py: --cpu-devices
    check_block_ops(spec.parallel.block_ops, devices[0].platform)
    spec = spec.resolved(len(devices))
    plan = spec.plan(devices)
    overrides = dict(model_family(args.model).parse_override(item) for item in args.override)
    loaded = loading.load_model(
        args.checkpoint, plan, family=args.model, overrides=overrides, tokenizer=args.tokenizer, step=args.step
    )
    if args.command == "perplexity":  # before compiling: the planner's estimate of the forward pass
        check_context_fits(spec, devices, loaded, seq_len=args.seq_len, batch=args.batch_size, flag="--seq-len")
    else:
        batch = args.batch_size or len(args.depths) * args.samples
        for length in sorted(args.lengths, reverse=True):
            check_context_fits(spec, devices, loaded, seq_len=length, batch=batch, flag="--lengths")
    if args.command == "perplexity":
        bar = lambda rows: tqdm(rows, total=args.batches, desc="perplexity", unit="batch", disable=not args.progress)
        result = perplexity.evaluate(
            loaded,
            plan,
            seq_len=args.seq_len,
            data=args.data,
            batch_size=args.batch_size,
            batches=args.batches,
            first_bucket=args.first_bucket,
            progress=bar,
            label=args.label,
        )
        text, plot = perplexity.table(result), lambda path: plots.perplexity_plot([result], path)
    else:
        bar = lambda total: tqdm(total=total, desc="needle", unit="seq", disable=not args.progress)
        result = needle.evaluate(
            loaded,
            plan,
            lengths=args.lengths,
            depths=args.depths,
            samples=args.samples,
            seed=args.seed,
            batch_size=args.batch_size,
            progress=bar,
            label=args.label,
        )
        text, plot = needle.table(result), lambda path: plots.needle_heatmap(result, path)
    print(text, flush=True)  # the result first: a failed write below loses no numbers
    return _write_outputs(args.out, args.command, result, plot)


def _write_outputs(out: str, name: str, result: dict, plot: Callable[[str], object]) -> int:
    """OUT/NAME.json and OUT/NAME.png, each written whole or not at all; a failure is one line (exit code 2)."""
    written, failed = [], []
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        failed.append(f"{out}: {_one_line(e)}")
    else:
        for path, write in (
            (os.path.join(out, f"{name}.json"), lambda tmp: _dump_json(result, tmp)),
            (os.path.join(out, f"{name}.png"), plot),
        ):
            try:
                output_files.write_atomically(path, write)
                written.append(path)
            except OSError as e:
                failed.append(f"{path}: {_one_line(e)}")
    if failed:
        kept = f"; wrote {' and '.join(written)}" if written else ""
        print(f"error: could not write {'; '.join(failed)}{kept} (the table above is the result)", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {' and '.join(written)}")
    return 0


def _dump_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
