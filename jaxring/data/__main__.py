"""python -m jaxring.data prepare INPUT OUT_DIR [--tokenizer bytes|PATH] [--field text] [--workers N]

Tokenizes INPUT (a text file, a directory, .jsonl or .parquet) once into a memory-mapped document store in
OUT_DIR (`jaxring.data.store`), which `train.py --data OUT_DIR` trains from. Bad input is one line on stderr
naming the file and line, exit code 2; a stop signal (Ctrl-C) one line saying what was left, exit code
128 + the signal's number (SIGINT 130, SIGTERM 143), with no temporary file left behind.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxring.core.stop_signals import Interrupted
from jaxring.data.prepare import prepare


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        """One line (not the usage block), exit code 2, as every jaxring command."""
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m jaxring.data", description=__doc__.split("\n\n")[1])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = commands.add_parser("prepare", help="tokenize documents into a store")
    p.add_argument("input", help="a text file, a directory of .txt/.py/.md/.jsonl/.parquet files, .jsonl or .parquet")
    p.add_argument("out_dir", help="the store's directory (new, or a store made with the same tokenizer)")
    p.add_argument(
        "--tokenizer", default="bytes", help="bytes (default), or a tokenizer.json / a directory holding one"
    )
    p.add_argument("--field", default="text", help="the text field of .jsonl/.parquet records (default: text)")
    p.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8), help="tokenizing processes")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        store = prepare(
            args.input,
            args.out_dir,
            tokenizer=args.tokenizer,
            field=args.field,
            workers=args.workers,
            progress=args.progress,
            log=lambda line: print(line, file=sys.stderr),
        )
    except Interrupted as e:
        if args.debug:
            raise
        print(str(e), file=sys.stderr)
        return e.exit_code
    except (ValueError, OSError) as e:
        if args.debug:
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    m = store.meta
    skipped = f", {m['empty_skipped']} empty skipped" if m["empty_skipped"] else ""
    print(
        f"{args.out_dir}: {m['documents']:,} documents, {m['tokens']:,} tokens ({m['dtype']}), tokenizer "
        f"{store.tokenizer.describe()}, vocab {store.vocab_size}, EOS {store.eos_id}{skipped}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
