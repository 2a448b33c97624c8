"""Every command README.md and docs/*.md show runs and exits 0: the shell commands of their ```bash blocks,
shortened, and `--help` of every benchmark script they name. The commands not run are reported as skipped, each
with its reason (SKIPPED): the set-up (`pip install`, `bash tools/setup.sh`: CI runs it first), the test command
(`pytest`: this test runs inside it), and the commands of ```sh blocks (written down for hardware the tests do not
have, e.g. Llama-3.1-8B on 8 GPUs; the page says so above the block).

Each page's commands run in page order in one working directory of the page's own, as a reader would type them (`--config run.yaml`
reads the file the `--print-config ... > run.yaml` before it wrote; `--resume` continues the checkpoint the
command before it saved). Each runs in a child process with a fresh shell's environment (no XLA device flags,
no JAX platform: `clean_environment`), so it sets up its own devices as it would for a reader; each is shortened
only in sizes: `python train.py` with its steps cut to two (four after a resume), a smaller model, no sample or
held-out loss, and its outputs in a temporary directory; `python -m jaxring.demo` at a short sequence; `python -m jaxring.data prepare` with one worker, on
a `corpus.jsonl` and a `path/to/tokenizer.json` this file writes first (the reader's own files in the docs);
`python -m jaxring.planner` as shown (it runs nothing); `python -m jaxring.eval` on one 64-token batch or one
96-token needle length; `python -m jaxring.models.hf export` on the newest step (the shortened run saved only its last);
`python benchmarks/tables.py --check` as shown (it reads the recorded results and writes nothing).
A command this file does not know how to run is a failure, so a new kind of command gets a runner here.

Every command runs in the default (CI) run: the ten training commands that repeat a code path the others cover
took 75 s together on an idle 2-core machine (SLOW stays empty; a command put in it runs only with -m slow).
The docs hold the README's former commands, none added but `benchmarks/tables.py --check` (a few seconds: its TPU
table prices ten rows with the cost model).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from helpers import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]  # the front door, then the docs it links to

# exact commands of README or docs (after joining continuation lines and dropping comments) that run only with -m slow
SLOW: set[str] = set()
SLOW_REASON = "repeats a code path the default README commands cover (a compile each, ~10 s on 2 cores)"


SETUP_REASON = "the set-up: CI runs it before the tests"
TEST_COMMAND_REASON = "the test command: this test runs inside it"
SH_BLOCK_REASON = "a ```sh block: written down for hardware the tests do not have (the page says which)"


def block_commands(text: str, language: str = "bash") -> list[str]:
    """The commands of the ```LANGUAGE blocks: continuation lines joined, comments dropped, whitespace
    collapsed."""
    commands = []
    for block in re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def skip_reason(command: str) -> str | None:
    """Why a ```bash command is not run here (None: it runs)."""
    words = shlex.split(command)
    if words[:2] == ["pip", "install"] or words[:2] == ["bash", "tools/setup.sh"]:
        return SETUP_REASON
    if "pytest" in words or words[:2] == ["bash", "tools/test.sh"]:
        return TEST_COMMAND_REASON
    return None


def readme_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks: continuation lines joined, comments dropped, whitespace collapsed;
    `pip install`, the set-up (`bash tools/setup.sh ...`) and `pytest` left out."""
    return [c for c in block_commands(text) if skip_reason(c) is None]


def skipped_commands(text: str) -> list[tuple[str, str]]:
    """(command, reason) of every command shown but not run: the set-up and test commands of the ```bash
    blocks, and every command of the ```sh blocks."""
    shown = [(c, skip_reason(c)) for c in block_commands(text)]
    return [(c, r) for c, r in shown if r is not None] + [(c, SH_BLOCK_REASON) for c in block_commands(text, "sh")]


def benchmark_scripts(text: str) -> list[str]:
    """The benchmark scripts a page names (`python benchmarks/NAME.py`), in order, once each."""
    return list(dict.fromkeys(re.findall(r"python (benchmarks/\w+\.py)", text)))


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


PAGE_COMMANDS = {_name(page): readme_commands(page.read_text()) for page in PAGES}
COMMANDS = [c for commands in PAGE_COMMANDS.values() for c in commands]  # README's, then each page's
ALL_TEXT = "\n".join(page.read_text() for page in PAGES)


def test_readme_shows_commands():
    """The extraction finds the main job and the strategies (it would pass vacuously otherwise)."""
    assert "python train.py" in PAGE_COMMANDS["README.md"]  # the main job, at the front door
    assert "python train.py" in COMMANDS
    assert any("--print-config" in c for c in COMMANDS) and any("--config" in c for c in COMMANDS)
    assert len(COMMANDS) >= 10, COMMANDS
    assert len(DOCS) >= 5 and PAGE_COMMANDS["docs/training.md"], DOCS  # the pages the README commands moved to


def test_skipped_commands_are_the_setup_the_tests_and_sh_blocks():
    text = "```bash\npip install -e .\npython -m pytest -q\npython a.py\n```\n```sh\npython big.py --gpus 8\n```\n"
    assert skipped_commands(text) == [
        ("pip install -e .", SETUP_REASON),
        ("python -m pytest -q", TEST_COMMAND_REASON),
        ("python big.py --gpus 8", SH_BLOCK_REASON),
    ]
    assert readme_commands(text) == ["python a.py"]


def test_extraction_joins_lines_and_drops_comments():
    text = "x\n```bash\npip install -e .\npython a.py --x 1 \\\n    --y 2   # note\n\n# only a comment\n```\n"
    assert readme_commands(text) == ["python a.py --x 1 --y 2"]


@functools.cache
def _train_module():
    """train.py (the repository root need not be on sys.path)."""
    spec = importlib.util.spec_from_file_location("jaxring_train_cli", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flag(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def shortened(argv: list[str], out_dir: pathlib.Path) -> list[str]:
    """train.py's arguments with flags appended (argparse keeps the last value) that cut the run to two steps
    (four after --resume, so it continues) of a smaller model, without the sample and held-out loss, writing
    to `out_dir`."""
    if "--help" in argv or "-h" in argv:
        return argv
    extra = ["--steps", "4" if "--resume" in argv else "2", "--no-progress", "--sample-tokens", "0"]
    extra += ["--no-eval-at-end", "--out-dir", str(out_dir)]
    model, preset = _flag(argv, "--model", "gpt"), _flag(argv, "--preset", "tiny")
    overrides = {}
    if model == "gpt":
        extra += ["--seq-len", "64"]
        if preset == "tiny" and "--init-from" not in argv:  # a pre-trained model keeps its shapes
            overrides = {"num_layers": 2, "hidden": 64, "ffn": 128}
    elif model == "dit":
        overrides = {"num_layers": 1}
    given = " ".join(argv)
    for field, value in overrides.items():
        if f"{field}=" not in given:  # the command's own override stays (pipelines need their num_layers)
            extra += ["--override", f"{field}={value}"]
    return argv + extra


def eval_shortened(argv: list[str]) -> list[str]:
    """python -m jaxring.eval's arguments cut to one short batch (64 tokens) or one needle length (96 tokens:
    the needle, question and answer in bytes take 79), two depths, one sample, no progress bar."""
    extra = ["--no-progress"]
    if argv[0] == "perplexity":
        extra += ["--seq-len", "64", "--batches", "1"]
    elif argv[0] == "needle":
        extra += ["--lengths", "96", "--depths", "0,1", "--samples", "1"]
    return argv + extra


def hf_export_shortened(argv: list[str]) -> list[str]:
    """python -m jaxring.models.hf export's arguments without `--step N`: the shortened run before it saved only its
    last step (the newest, exported by default)."""
    if "--step" in argv:
        at = argv.index("--step")
        argv = argv[:at] + argv[at + 2 :]
    return argv


# the files a page's command takes from the reader (its placeholders), made in the working directory first
CORPUS_JSONL = "corpus.jsonl"
TOKENIZER_JSON = "path/to/tokenizer.json"


def write_reader_files(root: pathlib.Path) -> None:
    """`corpus.jsonl` (documents with a "text" field: the modules of the jaxring package) and
    `path/to/tokenizer.json` (a small byte-level BPE with <|endoftext|>, trained here on them; nothing is
    downloaded)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [f.read_text(encoding="utf-8") for f in sorted((ROOT / "jaxring").glob("*.py"))]
    (root / CORPUS_JSONL).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>"]
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(vocab_size=384, special_tokens=special))
    (root / TOKENIZER_JSON).parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / TOKENIZER_JSON))


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """One working directory per page, for its commands in order (they build on each other's files), holding
    the files the reader brings (write_reader_files); made when the page's first command runs."""
    made: dict[str, pathlib.Path] = {}

    def workdir(page: str) -> pathlib.Path:
        if page not in made:
            made[page] = tmp_path_factory.mktemp(pathlib.Path(page).stem)
            write_reader_files(made[page])
        return made[page]

    return workdir


def _params():
    out = []
    for page, commands in PAGE_COMMANDS.items():
        for i, command in enumerate(commands):
            marks = [pytest.mark.slow(reason=SLOW_REASON)] if command in SLOW else []
            ident = f"{page}: {command.removeprefix('python ')}"[:100]
            out.append(pytest.param(page, i, command, marks=marks, id=ident))
    return out


def _skipped_params():
    out = []
    for page in PAGES:
        for command, reason in skipped_commands(page.read_text()):
            ident = f"{_name(page)}: {command}"[:100]
            out.append(pytest.param(command, marks=pytest.mark.skip(reason=reason), id=ident))
    return out


def clean_environment() -> dict[str, str]:
    """A fresh shell's environment: none of the test process's JAX or XLA settings (its 8 simulated devices, its
    platform), so a command that does not set up its own devices fails here as it would for a reader. The one
    flag kept is XLA:CPU's backend optimisation level 0 (tests/conftest.py: compile time only, the same
    programs and results), which says nothing about devices."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "VIRTUAL_ENV", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
    env = {name: os.environ[name] for name in keep if name in os.environ}
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    return env


def child_argv(words: list[str], workdir: pathlib.Path, index: int) -> list[str]:
    """The README command's arguments for the child's `python`, shortened only in sizes (steps, model,
    sequence, batches, workers)."""
    if words[:2] == ["python", "train.py"]:
        return [str(ROOT / "train.py"), *shortened(words[2:], workdir / f"out{index}")]
    module, args = (words[2], words[3:]) if words[:2] == ["python", "-m"] and len(words) > 2 else (None, [])
    if module == "jaxring.demo":
        return ["-m", module, *args, "--seq", "256", "--runs", "1"]
    if module == "jaxring.data":
        return ["-m", module, *args, "--workers", "1", "--no-progress"]  # 1 worker: CI has 2 cores
    if module == "jaxring.eval":
        return ["-m", module, *eval_shortened(args)]
    if module == "jaxring.models.hf" and args[:1] == ["export"]:
        return ["-m", module, *hf_export_shortened(args)]
    if module == "jaxring.planner":
        return ["-m", module, *args]
    if words[:2] == ["python", "benchmarks/tables.py"] and words[2:] == ["--check"]:  # reads, writes nothing
        return [str(ROOT / words[1]), *words[2:]]
    if words[:2] == ["python", "benchmarks/refit_calibration.py"]:  # --write: into the page's folder, not the package
        return [
            str(ROOT / words[1]),
            *words[2:],
            *(["--out", str(workdir / "calibrations")] if "--write" in words else []),
        ]
    pytest.fail(
        f"tests/integration/test_readme.py does not know how to run the docs' command {shlex.join(words)!r}: teach it"
    )


@pytest.mark.parametrize("page,index,command", _params())
def test_readme_command_runs(page, index, command, workdirs):
    """The command runs as a reader types it: `python ...` in a child process, in the working directory of the
    page's earlier commands, with a fresh shell's environment."""
    workdir = workdirs(page)
    words = shlex.split(command)
    redirect = None
    if ">" in words:  # `... > FILE`: the command's stdout goes to FILE
        at = words.index(">")
        words, redirect = words[:at], words[at + 1]
    argv = child_argv(words, workdir, index)
    if "--config" in argv:
        path = _flag(argv, "--config", "")
        assert (workdir / path).is_file(), f"{path} is written by a {page} command before this one"
    if "--resume" in argv:
        ckpt = _flag(argv, "--checkpoint-dir", "")
        assert (workdir / ckpt).is_dir(), f"{ckpt}/ is written by a {page} command before this one"
    result = subprocess.run(
        [sys.executable, *argv], cwd=workdir, env=clean_environment(), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, f"{command!r} exited with {result.returncode}:\n{result.stderr[-3000:]}"
    if redirect is not None:
        (workdir / redirect).write_text(result.stdout)


@pytest.mark.parametrize("command", _skipped_params())
def test_shown_command_not_run(command):
    """A command shown but not run here: reported as skipped with its reason (never reached)."""


def _exit_code(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2)
        return e.code if isinstance(e.code, int) else 1


def test_train_help_lists_every_flag_the_readme_uses(capsys):
    """Each `--flag` of a README or docs train.py command is one train.py accepts (`--help` lists it)."""
    code = _exit_code(_train_module().main, ["--help"])
    shown = capsys.readouterr().out
    assert code == 0
    used = {w for c in COMMANDS if c.startswith("python train.py") for w in shlex.split(c) if w.startswith("--")}
    missing = sorted(flag for flag in used if not re.search(rf"{re.escape(flag)}\b", shown))
    assert not missing, f"README or docs use flags train.py --help does not list: {missing}"


def test_benchmarks_the_readme_names_show_their_help():
    """`python benchmarks/NAME.py --help` exits 0 for every script README or docs name (one interpreter for all:
    each script's imports and argument parser run; nothing is benchmarked)."""
    scripts = benchmark_scripts(ALL_TEXT)
    assert len(scripts) >= 5, scripts
    missing = [s for s in scripts if not (ROOT / s).is_file()]
    assert not missing, f"README or docs name benchmark scripts that do not exist: {missing}"
    program = (
        "import contextlib, io, runpy, sys\n"
        "for path in sys.argv[1:]:\n"
        "    sys.argv = [path, '--help']\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(io.StringIO()):\n"
        "            runpy.run_path(path, run_name='__main__')\n"
        "        code = 0\n"
        "    except SystemExit as e:\n"
        "        code = e.code or 0\n"
        "    print(path, code, flush=True)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program, *scripts], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    codes = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines() if line.startswith("benchmarks/"))
    failed = {s: codes.get(s, "did not run") for s in scripts if codes.get(s) != "0"}
    assert result.returncode == 0 and not failed, f"{failed}\n{result.stderr[-3000:]}"


def test_notebooks_extra_installs_jupyterlab():
    """`bash tools/setup.sh notebooks` (README's notebook set-up: the `notebooks` extra) brings JupyterLab and a
    kernel."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[; ]", r, maxsplit=1)[0].lower() for r in extras["notebooks"]}
    assert {"jupyterlab", "ipykernel", "matplotlib"} <= names, names


def test_setup_is_the_readme_setup_and_ci_runs_it():
    """README's set-up is `bash tools/setup.sh`, and `.ci/run` runs that same script (then the test command)."""
    assert "bash tools/setup.sh && . .venv/bin/activate" in README.read_text()
    assert "bash tools/setup.sh" in (ROOT / ".ci" / "run").read_text()


def test_ci_runs_the_readme_test_command_first():
    """README's test command is `bash tools/test.sh`, and `.ci/run` runs it right after the set-up."""
    assert "```bash\nbash tools/test.sh\n```" in README.read_text()
    lines = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line]
    setup = commands.index("bash tools/setup.sh dev && . .venv/bin/activate")
    assert commands[setup + 1] == "bash tools/test.sh", commands


FAKE_OLD_PYTHON = """#!/bin/sh
case "$*" in *platform*) echo 3.11.7 ;; *) exit 1 ;; esac
"""


@pytest.mark.parametrize("given", [None, "fake"], ids=["search", "PYTHON="])
def test_setup_without_a_new_enough_python_says_so_in_one_line(tmp_path, given):
    """With only a Python 3.11 about (no pyenv), tools/setup.sh makes nothing and says, in one line, what it found
    and what it needs; a PYTHON= that is too old is named. (The search's success is CI's own set-up.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3", "python"):
        (bin_dir / name).write_text(FAKE_OLD_PYTHON)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "VENV": str(tmp_path / "venv")}
    if given:
        env["PYTHON"] = str(bin_dir / "python3")
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / "setup.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and not (tmp_path / "venv").exists(), result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Python >= 3.12" in lines[0], lines
    assert ("python3 is 3.11.7" if given is None else f"PYTHON={env.get('PYTHON')}") in lines[0], lines


# (flags, the one line's text, the flags with its suggestion applied)
FIRST_RUN_MISTAKES = [
    (["--sp", "3"], "mesh degrees --sp 3 multiply to 3, but there are 8 devices", ["--dp", "2", "--sp", "4"]),
    (["--tp", "3"], "mesh degrees --tp 3 multiply to 3, but there are 8 devices", ["--dp", "2", "--tp", "4"]),
    (
        ["--pp", "2"],
        "mesh degrees --pp 2 multiply to 2, but there are 8 devices (the degrees' product must equal the device "
        "count); e.g. --dp 4 --pp 2 --batch-size 16",
        ["--dp", "4", "--pp", "2", "--batch-size", "16"],
    ),
    (
        ["--pp", "2", "--dp", "4", "--microbatches", "4"],
        "--batch-size 8 does not split into 16 equal parts (--dp 4 × --microbatches 4); use --batch-size 16, "
        "or --microbatches 2",
        ["--pp", "2", "--dp", "4", "--microbatches", "4", "--batch-size", "16"],
    ),
    (
        ["--pp", "4", "--dp", "2", "--microbatches", "2"],
        "--microbatches 2 is less than --pp 4: every pipeline stage needs a micro-batch in flight; use "
        "--microbatches 4",
        ["--pp", "4", "--dp", "2", "--microbatches", "4"],
    ),
    (
        ["--seq-len", "100"],
        "--seq-len 100: seq 100 is not divisible by 2*sp = 16, needed by the zigzag layout; e.g. --seq-len 96",
        ["--seq-len", "96"],
    ),
]


@pytest.mark.parametrize("flags,message,fixed", FIRST_RUN_MISTAKES, ids=[" ".join(m[0]) for m in FIRST_RUN_MISTAKES])
def test_first_run_mistakes_name_a_setting_that_works(flags, message, fixed, tmp_path, capsys):
    """A common first-run mistake ends in one line (exit 2) naming the value, the rule and a setting that
    works, and that setting passes the run's checks (--print-config resolves and validates the run)."""
    main = _train_module().main
    assert main([*flags, "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert main(["--print-config", *fixed, "--out-dir", str(tmp_path)]) == 0, capsys.readouterr().err


def test_readme_is_a_front_door_linking_every_page():
    """README.md stays short (≤ 250 lines) and links every page of docs/."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    unlinked = [p.name for p in DOCS if f"(docs/{p.name}" not in text]
    assert not unlinked, f"README.md does not link {unlinked}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_resolve():
    """Every relative link of README and docs names a file that exists, and a heading of it after `#`."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{_name(page)}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{_name(page)}: {target}")
    assert not broken, broken
