"""`python -m jaxring.models.hf export CHECKPOINT_DIR OUT_DIR [--step N] [--dtype D]`: a training checkpoint of a GPT
run (`train.py --checkpoint-dir`) written as a Hugging Face directory (config.json, safetensors, tokenizer.json).

Only the parameters are read (`jaxring.eval.loading`: orbax's partial restore, checksums compared), each
sharded ZeRO-3-style over the local devices, in layer order whatever pipeline trained them (the trainer saves
interleaved stages in layer order); `jaxring.models.hf.save_pretrained` gathers one tensor at a time, in bfloat16 for
a run trained in --precision bf16 (--dtype to choose). The tokenizer.json shipped is the run's: its
--init-from directory's, else its --tokenizer's, else its --data store's (none for a byte-level run). A
mistake (a missing directory, a checkpoint of another model family or of a GPT no Hugging Face architecture
stores, an OUT_DIR that holds other files or an earlier export without --overwrite, one this process cannot
write in or whose filesystem has no room for the tensors) is one line and exit code 2, said before anything is
read. The files are written beside OUT_DIR and renamed onto it at the end: a write that fails anyway (a full
disk) is one line, exit code 2, and leaves no partial directory; Ctrl-C, SIGTERM or SIGHUP likewise (exit
code 128 + N).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator
from jaxring.core.mesh import make_mesh
from jaxring.core.stop_signals import exit_code, stop_message, stops_on_signals
from jaxring.data.tokenizer import tokenizer_file
from jaxring.eval import loading
from jaxring.models import gpt, hf
from jaxring.parallel.plan import ParallelPlan
from jaxring.run.cli import EXIT_USER_ERROR

PROG = "python -m jaxring.models.hf"


def run_tokenizer_file(run_config: dict) -> str | None:
    """The tokenizer.json of a run (its flat settings, as saved in the checkpoint's metadata), or None."""
    for spec in (run_config.get("init_from"), run_config.get("tokenizer"), run_config.get("data")):
        if spec and spec != "bytes":
            try:
                return str(tokenizer_file(spec))
            except FileNotFoundError:
                continue
    return None


def export(
    checkpoint: str, out: str, step: int | None = None, dtype: str | None = None, overwrite: bool = False
) -> tuple[int, list[str]]:
    """Writes step `step` (default: the newest) of the jaxring checkpoint directory `checkpoint` to `out` as a
    Hugging Face directory, its tensors in `dtype` (default: bfloat16 for a run trained in --precision bf16, as
    released checkpoints are, else the parameters' own). overwrite: `out` may be an earlier export (replaced
    whole). Returns (the step, the files written). Bad input: a one-line ValueError; a failed write: OSError."""
    if not os.path.isdir(checkpoint):
        raise ValueError(f"checkpoint {checkpoint!r}: no such directory")
    if os.path.isfile(os.path.join(checkpoint, loading.HF_CONFIG)):
        raise ValueError(
            f"checkpoint {checkpoint!r} holds a {loading.HF_CONFIG}: it is a Hugging Face directory already"
        )
    hf.check_export_dir(out, overwrite, "OUT_DIR", "--overwrite")  # said before the checkpoint is opened
    step, metadata = loading.checkpoint_metadata(checkpoint, step)
    saved = dict(metadata.get("model") or {})
    kind = saved.pop("kind", None)
    if kind != "gpt":
        raise ValueError(f"checkpoint {checkpoint!r} step {step} is of model family {kind!r}, not a GPT")
    try:
        config = gpt.GPTConfig(**saved)
    except TypeError as e:  # a checkpoint of another jaxring version's GPTConfig
        raise ValueError(
            f"checkpoint {checkpoint!r} step {step}: its model config is not this GPTConfig ({e})"
        ) from None
    run_config = metadata.get("config") or {}
    if dtype is None and run_config.get("precision") == "bf16":
        dtype = "bfloat16"
    if dtype is not None and dtype not in hf.SAVE_DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(hf.SAVE_DTYPES)}")
    # the architecture, OUT_DIR writable and room for the tensors: said before anything is read
    hf.check_export(config, out, dtype or "float32", overwrite=overwrite, flag="OUT_DIR", overwrite_flag="--overwrite")
    devices = jax.devices()
    plan = ParallelPlan(make_mesh(dp=len(devices), devices=devices), zero=3)
    loaded = loading.load_model(checkpoint, plan, step=step, tokenizer="bytes")
    tokenizer = run_tokenizer_file(run_config)
    files = hf.save_pretrained(loaded.model, loaded.config, out, tokenizer=tokenizer, dtype=dtype, overwrite=overwrite)
    return step, files


def build_parser() -> argparse.ArgumentParser:
    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:
            self.exit(EXIT_USER_ERROR, f"error: {message} (see {self.prog} --help)\n")

    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    s = sub.add_parser("export", help="a training checkpoint as a Hugging Face directory")
    s.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a jaxring checkpoint directory (--checkpoint-dir)")
    s.add_argument(
        "out", metavar="OUT_DIR", help="the Hugging Face directory to write (new, empty, or an export with --overwrite)"
    )
    s.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT_DIR (as a whole)")
    s.add_argument("--step", type=int, help="the checkpoint step (default: the newest)")
    s.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="the tensors' dtype (default: bfloat16 for a run in --precision bf16, else the parameters' own)",
    )
    s.add_argument(
        "--cpu-devices", type=int, default=8, help="simulated CPU devices when there is no accelerator (train.py's)"
    )
    s.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        use_cpu_devices_if_no_accelerator(args.cpu_devices)  # the devices every entry point sets up
        with stops_on_signals():
            step, files = export(args.checkpoint, args.out, args.step, args.dtype, args.overwrite)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP: the files were being written beside OUT_DIR
        print(stop_message(e, f": nothing written to {args.out}"), file=sys.stderr)
        return exit_code(e)
    except (ValueError, FileNotFoundError) as e:  # jaxring.models.hf.CheckpointError is a ValueError
        if args.debug:
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as e:  # a write that failed (a full disk, a read-only mount): nothing partial is left
        if args.debug:
            raise
        print(f"error: writing {args.out} failed ({' '.join(str(e).split())}); nothing was written", file=sys.stderr)
        return EXIT_USER_ERROR  # as train.py reports an OSError
    print(f"exported {args.checkpoint} step {step} to {args.out} ({', '.join(files)})")
    return 0
