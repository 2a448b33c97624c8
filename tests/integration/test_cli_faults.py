"""Every command-line entry point meets every fault class (issue 46, item 5): a table of the commands (how to
run each on tiny local inputs, which flags read a path, which write one, which values and flag pairs are
refused) and tests parametrized over (command x fault class), so a new flag or command meets them by default.

Each case ends in exit code 2 (a usage error) or 128 + N (signal N), exactly one line on stderr (`error: ...`,
or `interrupted...` for Ctrl-C), no traceback, and that line names the offending flag or path.
`test_every_path_flag_is_in_the_table` fails when a command gains a flag that looks like a path and is neither in
the table nor in NOT_PATHS.

Read-only filesystems are faked (creating a directory or opening a file under a root raises EROFS, as
tests/integration/test_probe_faults.py does): tests may run as root, to whom a chmod-read-only directory is writable. An
output under a regular file fails with ENOTDIR for root too. Everything runs in this process (each command's
`main(argv)` returns its exit code) but the signal cases, which start the command as a child process.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from flax import nnx
from helpers import ROOT
from test_probe_faults import _read_only_under
from test_reliability import CLI, SMALL_FLAGS, _env
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxring.data import __main__ as data_cli
from jaxring.data.prepare import prepare
from jaxring.eval import cli as eval_cli
from jaxring.models import gpt
from jaxring.models.hf import cli as hf_export
from jaxring.planner import __main__ as planner_cli
from jaxring.run import cli as run_cli
from jaxring.train.checkpoint import Checkpointer

HF_FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama"
TIMEOUT = 120  # seconds a signal case's child process may run


# ---- the inputs the commands read, whole and damaged -------------------------------------------------------


def _text(path: Path) -> Path:
    path.write_text("".join(f"document {i}: the quick brown fox jumps over the lazy dog\n" for i in range(64)))
    return path


def _jsonl(path: Path) -> Path:
    path.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(8)))
    return path


def _store(path: Path) -> Path:
    """A store of the word tokenizer's 64 ids: data that fits the HF fixture's vocabulary of 128 (--init-from)."""

    text = path.parent / f"{path.name}.txt"
    text.write_text("".join(" ".join(f"w{(i * j) % 60 + 2}" for j in range(40)) + "\n" for i in range(64)))
    prepare(text, path, tokenizer=str(_tokenizer(path.parent / f"{path.name}-tokenizer.json")), progress=False)
    return path


def _hf(path: Path) -> Path:
    shutil.copytree(HF_FIXTURE, path, ignore=shutil.ignore_patterns("oracle.npz"))
    return path


def _tokenizer(path: Path) -> Path:

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, 64)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def _yaml(path: Path) -> Path:
    path.write_text('{"training": {"steps": 1, "seed": 0}}\n')  # (flow style: cut in half, not YAML)
    return path


def _checkpoint(path: Path) -> Path:
    """A jaxring checkpoint of a one-layer tiny-llama3 (its parameters only, as the exporter reads them)."""

    config = gpt.get_config("tiny-llama3", vocab_size=384, num_layers=1)
    params = nnx.to_pure_dict(nnx.state(gpt.GPT(config, rngs=nnx.Rngs(0))))
    with Checkpointer(path, lock=True) as ckpt:
        ckpt.save(1, {"params": params}, metadata={"model": {"kind": "gpt", **dataclasses.asdict(config)}})
    return path


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 - 3])  # (not at a line's end)


def _damaged(kind: str, path: Path) -> Path:
    """An input of `kind` at `path` that is damaged: a store without meta.json, a file cut in half."""
    make = MAKE[kind]
    if kind == "store":
        make(path)
        (path / "meta.json").unlink()
    elif kind == "hf":
        make(path)
        _truncate(path / "model.safetensors")
    elif kind == "checkpoint":
        make(path)
        _truncate(path / "1" / "metadata" / "metadata")  # the run's metadata: the model's config
    else:
        _truncate(make(path))
    return path


MAKE: dict[str, Callable[[Path], Path]] = {
    "text": _text,
    "jsonl": _jsonl,
    "store": _store,
    "hf": _hf,
    "tokenizer": _tokenizer,
    "yaml": _yaml,
    "checkpoint": _checkpoint,
}
SUFFIX = {"text": ".txt", "jsonl": ".jsonl", "tokenizer": ".json", "yaml": ".yaml"}


# ---- the table ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Command:
    """One entry point (and sub-command). argv: a minimal valid command line, whose IN:kind placeholders are
    inputs built by the tests and OUT the output; inputs: the flags (or positional names, as placeholders in
    argv) that read a path, with the kind of input; outputs: those that write one (positional: their argv
    element); bad_values and contradictions: (extra arguments, what the line must name)."""

    name: str
    main: Callable[[list[str]], int]
    child: tuple[str, ...]  # the command in a child process: python + these + argv
    argv: tuple[str, ...]
    inputs: dict[str, str]
    outputs: tuple[str, ...]
    bad_values: tuple[tuple[tuple[str, ...], str], ...]
    contradictions: tuple[tuple[tuple[str, ...], str], ...] = ()
    parser: Callable[[], argparse.ArgumentParser] | None = None


def _train_main(argv: list[str]) -> int:
    return CLI.main(argv)


# tiny-llama3: a GPT a Hugging Face architecture stores (--export-hf), no --override (which --init-from refuses)
TRAIN_BASE = ("--preset", "tiny-llama3", *SMALL_FLAGS[4:], "--cpu-devices", "1", "--steps", "1", "--data", "IN:--data")
TRAIN_BASE += ("--out-dir", "OUT")

COMMANDS = [
    Command(
        name="train.py",
        main=_train_main,
        child=(str(ROOT / "train.py"),),
        argv=TRAIN_BASE,
        inputs={
            "--data": "store",
            "--val-data": "store",
            "--init-from": "hf",
            "--tokenizer": "tokenizer",
            "--config": "yaml",
        },
        outputs=("--out-dir", "--checkpoint-dir", "--metrics-file", "--export-hf", "--profile"),
        bad_values=(
            (("--attention", "spiral"), "--attention"),
            (("--steps", "-1"), "--steps"),
            (("--seq-len", "0"), "--seq-len"),
            (("--lr", "nan"), "--lr"),
            (("--no-such-flag",), "--no-such-flag"),
        ),
        contradictions=(
            (("--sp", "2"), "--sp"),
            (("--resume",), "--resume"),
            (("--offload", "layer_inputs"), "--offload"),
        ),
        parser=run_cli.build_parser,
    ),
    Command(
        name="data prepare",
        main=data_cli.main,
        child=("-m", "jaxring.data"),
        argv=("prepare", "IN:INPUT", "OUT", "--no-progress", "--workers", "1"),
        inputs={"INPUT": "jsonl", "--tokenizer": "tokenizer"},
        outputs=("OUT",),
        bad_values=(
            (("--workers", "0"), "--workers"),
            (("--no-such-flag",), "--no-such-flag"),
        ),
        contradictions=(),
        parser=data_cli.build_parser,
    ),
    Command(
        name="eval perplexity",
        main=eval_cli.main,
        child=("-m", "jaxring.eval"),
        argv=("perplexity", "IN:CHECKPOINT", "--tokenizer", "IN:--tokenizer", "--seq-len", "32", "--batches", "1")
        + ("--no-progress", "--out", "OUT"),
        inputs={"CHECKPOINT": "hf", "--data": "store", "--tokenizer": "tokenizer"},
        outputs=("--out",),
        bad_values=(
            (("--batches", "0"), "--batches"),
            (("--seq-len", "-5"), "--seq-len"),
            (("--no-such-flag",), "--no-such-flag"),
        ),
        contradictions=(
            (("--pp", "2"), "--pp"),
            (("--first-bucket", "64"), "--first-bucket"),
        ),
        parser=eval_cli.build_parser,
    ),
    Command(
        name="eval needle",
        main=eval_cli.main,
        child=("-m", "jaxring.eval"),
        argv=("needle", "IN:CHECKPOINT", "--tokenizer", "IN:--tokenizer", "--lengths", "64", "--depths", "0.5")
        + ("--samples", "1", "--no-progress", "--out", "OUT"),
        inputs={"CHECKPOINT": "hf", "--tokenizer": "tokenizer"},
        outputs=("--out",),
        bad_values=(
            (("--depths", "2"), "--depths"),
            (("--lengths", "0"), "--lengths"),
            (("--samples", "0"), "--samples"),
        ),
        contradictions=((("--pp", "2"), "--pp"),),
    ),
    Command(
        name="hf export",
        main=hf_export.main,
        child=("-m", "jaxring.models.hf"),
        argv=("export", "IN:CHECKPOINT_DIR", "OUT", "--cpu-devices", "1"),
        inputs={"CHECKPOINT_DIR": "checkpoint"},
        outputs=("OUT",),
        bad_values=(
            (("--dtype", "int8"), "--dtype"),
            (("--step", "7"), "step 7"),
            (("--cpu-devices", "0"), "--cpu-devices"),
        ),
        contradictions=(),
        parser=hf_export.build_parser,
    ),
    Command(
        name="planner",
        main=planner_cli.main,
        child=("-m", "jaxring.planner"),
        argv=("--preset", "7b", "--seq-len", "4096", "--devices", "8", "--device", "h100"),
        inputs={},
        outputs=(),
        bad_values=(
            (("--device", "z80"), "--device"),
            (("--top", "0"), "--top"),
            (("--efficiency", "2"), "efficiency 2.0"),  # (the planner's Cluster names its settings, not flags)
            (("--devices", "-8"), "devices -8"),
        ),
        contradictions=(
            (("--global-batch", "1", "--global-batch-tokens", "4M"), "--global-batch"),
            (("--only", "sp=3"), "sp"),
        ),
        parser=planner_cli.build_parser,
    ),
]
BY_NAME = {c.name: c for c in COMMANDS}

# path flags the fault classes leave out, by command: why
NOT_IN_THE_TABLE = {
    "train.py": {
        "--tensorboard": "a directory, written only with the tensorboard extra: tests/integration/test_faults.py"
    },
}
# commands the table leaves out: why
COMMANDS_NOT_IN_THE_TABLE = {
    "-m jaxring.demo": "a timing demo of ring attention: no path flags, no files (issue 46 lists five commands)",
}
# a flag reads or writes a path when it is positional, or a word of its name or its metavar is one of these
PATH_WORDS = {"dir", "file", "path", "out", "data", "config", "from", "hf", "tokenizer", "profile", "tensorboard"}
PATH_WORDS |= {"yaml", "checkpoint", "input", "store"}


# ---- running a case ------------------------------------------------------------------------------------------


def _fill(command: Command, tmp: Path, **replace: str) -> list[str]:
    """command.argv with its inputs built under tmp, OUT as tmp/out, and flags (or placeholders) replaced or
    added from `replace` ({flag or placeholder: value})."""
    argv = []
    for arg in command.argv:
        if arg.startswith("IN:"):
            name, kind = arg[3:], command.inputs[arg[3:]]
            if name in replace:
                argv.append(replace.pop(name))
            else:
                argv.append(str(MAKE[kind](tmp / f"in-{name.strip('-')}{SUFFIX.get(kind, '')}")))
        elif arg == "OUT":
            argv.append(replace.pop("OUT", str(tmp / "out")))
        else:
            argv.append(arg)
    for flag, value in replace.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


def _read_only(monkeypatch, root: Path) -> None:
    """Under `root`, directories cannot be created nor files opened for writing (tests/integration/test_probe_faults.py's
    fault, and Python's open too)."""

    _read_only_under(monkeypatch, root)
    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and str(file).startswith(str(root)) and set(mode) & set("wax+"):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)


def _run(command: Command, argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = command.main(argv)
    except SystemExit as e:  # argparse's exit (its own one line)
        code = e.code
    return code, capsys.readouterr().err


def _assert_one_line(code: int, err: str, names: list[str], want_code: int = 2) -> str:
    lines = err.strip().splitlines()
    assert code == want_code, (code, err[-3000:])
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("error: "), lines[0]
    assert any(n in lines[0] for n in names), f"{lines[0]!r} names none of {names}"
    print(lines[0])  # (pytest -s shows every case's line)
    return lines[0]


def _cases(field: str) -> list:
    out = []
    for c in COMMANDS:
        items = getattr(c, field)
        for item in items.items() if isinstance(items, dict) else items:
            key = item[0] if field == "inputs" or field == "outputs" else " ".join(item[0])
            out.append(pytest.param(c.name, item, id=f"{c.name}:{key if field != 'outputs' else item}"))
    return out


# ---- the fault classes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, item", _cases("inputs"))
def test_a_missing_input_is_named(name, item, tmp_path, capsys):
    command, (flag, _) = BY_NAME[name], item
    missing = str(tmp_path / "no-such-input")
    code, err = _run(command, _fill(command, tmp_path, **{flag: missing}), capsys)
    _assert_one_line(code, err, [missing, flag])


@pytest.mark.parametrize("name, item", _cases("inputs"))
def test_a_damaged_input_is_named(name, item, tmp_path, capsys):
    command, (flag, kind) = BY_NAME[name], item
    damaged = _damaged(kind, tmp_path / f"damaged{SUFFIX.get(kind, '')}")
    code, err = _run(command, _fill(command, tmp_path, **{flag: str(damaged)}), capsys)
    _assert_one_line(code, err, [str(damaged), flag])


@pytest.mark.parametrize("fault", ["under-a-file", "read-only"])
@pytest.mark.parametrize("name, flag", _cases("outputs"))
def test_an_unwritable_output_is_named(name, flag, fault, tmp_path, capsys, monkeypatch):
    command = BY_NAME[name]
    if fault == "under-a-file":
        (tmp_path / "a-file").write_text("not a directory")
        out = tmp_path / "a-file" / "sub"
    else:
        (tmp_path / "ro").mkdir()  # a read-only mount
        out = tmp_path / "ro" / "sub"
    argv = _fill(command, tmp_path, **{flag: str(out)})
    if fault == "read-only":
        _read_only(monkeypatch, tmp_path / "ro")
    code, err = _run(command, argv, capsys)
    _assert_one_line(code, err, [str(out), flag if flag != "OUT" else "OUT_DIR"])


@pytest.mark.parametrize("name, item", _cases("bad_values"))
def test_a_bad_value_is_named(name, item, tmp_path, capsys):
    command, (extra, named) = BY_NAME[name], item
    code, err = _run(command, [*_fill(command, tmp_path), *extra], capsys)
    _assert_one_line(code, err, [named])


@pytest.mark.parametrize("name, item", _cases("contradictions"))
def test_a_contradiction_is_named(name, item, tmp_path, capsys):
    command, (extra, named) = BY_NAME[name], item
    code, err = _run(command, [*_fill(command, tmp_path), *extra], capsys)
    _assert_one_line(code, err, [named])


SEED = int(os.environ.get("JAXRING_FAULT_SEED", time.time_ns() % 10**6))


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
def test_ctrl_c_at_a_random_early_moment_is_one_line(name, tmp_path):
    """SIGINT at a moment drawn from [0.1, 4] s (JAXRING_FAULT_SEED=N repeats a draw): while jax imports, while
    the command reads its inputs or while it works. A command that finished first must have succeeded."""
    command = BY_NAME[name]
    moment = random.Random(f"{SEED}:{name}").uniform(0.1, 4.0)
    args = [sys.executable, *command.child, *_fill(command, tmp_path)]
    child = subprocess.Popen(args, env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(moment)
    sent = child.poll() is None
    if sent:
        child.send_signal(signal.SIGINT)
    try:
        out, err = child.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        raise
    where = f"SIGINT at {moment:.2f} s (JAXRING_FAULT_SEED={SEED})"
    if not sent or child.returncode == 0:
        assert child.returncode == 0, (where, err[-2000:])
        return
    if child.returncode == -signal.SIGINT and out.strip() and not err.strip():
        return  # it finished (its output written) and the signal met the interpreter's exit, which drops handlers
    lines = err.strip().splitlines()
    assert child.returncode == 128 + signal.SIGINT, (where, child.returncode, err[-2000:])
    # Before training starts: "interrupted ..."; once the loop runs, its graceful stop says so and ends the step.
    one_line = lines[0].startswith("interrupted") or lines[0].startswith("SIGINT: stopping after the current step")
    assert "Traceback" not in err and len(lines) == 1 and one_line, (where, err[-2000:])


# ---- the table covers every path flag ----------------------------------------------------------------------


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option and positional of a parser and its sub-parsers, by flag (positionals: their upper-case name)."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _flags(sub)
        elif action.option_strings:
            out[action.option_strings[0]] = action
        elif action.dest != argparse.SUPPRESS:
            out[(action.metavar or action.dest).upper()] = action
    return out


def _looks_like_a_path(flag: str, action: argparse.Action) -> bool:
    if action.nargs == 0 or action.type not in (None, str):  # switches, numbers
        return False
    words = set(flag.lower().strip("-").replace("_", "-").split("-"))
    words |= set((action.metavar or "").lower().replace("_", "-").split("-"))
    return not action.option_strings or bool(words & PATH_WORDS)


@pytest.mark.parametrize("name", [c.name for c in COMMANDS if c.parser])
def test_every_path_flag_is_in_the_table(name):
    """A flag that reads or writes a path (a positional, a name or metavar with dir, file, path, out, data, ...)
    is an input or an output of the table, or in NOT_IN_THE_TABLE: a new one fails here until it is covered."""
    command = BY_NAME[name]
    covered = set(NOT_IN_THE_TABLE.get(name, ()))
    for other in COMMANDS:  # the sub-commands of one parser share it
        if other.child == command.child:
            covered |= set(other.inputs) | {"OUT_DIR" if o == "OUT" else o for o in other.outputs}
    paths = {flag for flag, action in _flags(command.parser()).items() if _looks_like_a_path(flag, action)}
    assert paths <= covered, f"{name}: path flags in no fault class: {sorted(paths - covered)}"
    assert paths or not covered, f"{name}: no path flag found: is the parser the command's?"


def _module(path: Path) -> str:
    """`-m NAME` of a module file in jaxring/ or models/ (installed as jaxring.models)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "models":
        parts.insert(0, "jaxring")
    return "-m " + ".".join(parts[:-1] if parts[-1] == "__main__" else parts)


def test_every_command_is_in_the_table():
    """Every module that runs as a command (`if __name__ == "__main__"`, a __main__.py) and every script at the
    top of the repository is a row, or in COMMANDS_NOT_IN_THE_TABLE."""
    files = [*(ROOT / "jaxring").rglob("*.py"), *(ROOT / "models").rglob("*.py")]
    found = {_module(p) for p in files if p.name == "__main__.py" or '__name__ == "__main__"' in p.read_text()}
    found |= {p.name for p in ROOT.glob("*.py") if '__name__ == "__main__"' in p.read_text()}
    rows = {" ".join(c.child) if c.child[0] == "-m" else Path(c.child[0]).name for c in COMMANDS}
    missing = found - rows - set(COMMANDS_NOT_IN_THE_TABLE)
    assert not missing, f"commands with no row in the table: {sorted(missing)}"


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
def test_the_table_s_commands_run(name, tmp_path, capsys):
    """Each row's command as the table gives it succeeds: the faults above are the only thing wrong."""
    command = BY_NAME[name]
    code, err = _run(command, _fill(command, tmp_path), capsys)
    assert code == 0, err[-3000:]
