"""Faults found by a probe of every command (issue 46): each ends in one line naming the value and the rule, with
no traceback; and a trained model is never lost to a failure after the last step.
"""

import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT
from orbax.checkpoint._src.handlers import json_checkpoint_handler
from test_faults import BASE, _cli, _run
from test_reliability import SMALL_FLAGS, _env

from jaxring.data.__main__ import main as data_main
from jaxring.data.prepare import prepare
from jaxring.data.token_data import open_token_data
from jaxring.data.token_sources import load_tokens
from jaxring.eval.cli import main as eval_main
from jaxring.models.gpt_train import GPTTask
from jaxring.planner.__main__ import main as planner_main
from jaxring.run.schema import DataSettings
from jaxring.train import loop
from jaxring.train.checkpoint import Checkpointer, CheckpointSaveError
from jaxring.train.trainer import Trainer

TIMEOUT = 240  # seconds any child process of these tests may run


def _command(args, timeout=TIMEOUT, **kw):
    """A command in a child process (killed at the timeout): CompletedProcess."""
    return subprocess.run(
        [sys.executable, *args], env=kw.pop("env", _env()), capture_output=True, text=True, timeout=timeout, **kw
    )


def _one_line(err: str) -> str:
    """stderr that is one `error: ...` line and no traceback: that line."""
    assert "Traceback" not in err and err.count("\n") == 1, err[-3000:]
    assert err.startswith("error: "), err
    return err.strip()


# ---- data: text named .bin, a store without its meta.json, the field flag, files prepare leaves out ----------


def test_a_text_file_named_bin_is_refused(tmp_path):
    """ASCII read as uint16 stays below 32,383, inside GPT-2's vocabulary: it used to train on it silently."""
    path = tmp_path / "notes.bin"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 500)
    with pytest.raises(ValueError, match=r"holds text, not uint16 token ids .*give the text a \.txt name"):
        load_tokens(path)


def test_a_store_without_meta_json_is_a_damaged_store(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("a document\n")
    prepare(tmp_path / "in.txt", tmp_path / "store", progress=False)
    (tmp_path / "store" / "meta.json").unlink()
    want = f"error: directory '{tmp_path / 'store'}' is a damaged store: it holds tokens.bin and offsets.npy but no"
    code, err = _cli([*SMALL_FLAGS, "--cpu-devices", "1", "--steps", "1", "--data", str(tmp_path / "store")], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(want), err
    assert "prepare it again" in err[0]
    with pytest.raises(ValueError, match="is a damaged store"):  # jaxring.eval perplexity --data opens it so too
        open_token_data(DataSettings(data=str(tmp_path / "store")))


def test_train_py_names_its_own_text_field_flag(tmp_path, capsys):
    (tmp_path / "docs.jsonl").write_text('{"content": "abc"}\n')
    code, err = _cli(
        [*SMALL_FLAGS, "--cpu-devices", "1", "--steps", "1", "--data", str(tmp_path / "docs.jsonl")], capsys
    )
    assert code == 2 and len(err) == 1, err
    assert err[0].endswith("has no 'text' field (its keys: 'content'); name the text field with --text-field"), err
    assert data_main(["prepare", str(tmp_path / "docs.jsonl"), str(tmp_path / "st"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().endswith("name the text field with --field")


def test_prepare_says_which_files_it_skipped_and_why(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("a document\n")
    (tmp_path / "in" / "ids.bin").write_bytes(b"\0\1" * 8)
    (tmp_path / "in" / "x.dat").write_bytes(b"\0")
    assert data_main(["prepare", str(tmp_path / "in"), str(tmp_path / "st"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "2 files skipped (ids.bin, x.dat): only .txt/.py/.md/.jsonl/.parquet files are read as documents" in err
    assert "a .bin is token ids" in err


@pytest.mark.parametrize(
    "devices, seq_len, nearest",
    [(8, 100003, "--seq-len 100,000 or 100,016 (multiples of 16)"), (3, 131072, "--seq-len 131,070 or 131,076")],
)
def test_the_planner_names_the_sequence_lengths_divisibility(devices, seq_len, nearest, capsys):
    """It named the most common refusal (the pipeline's micro-batches; --vocab-split), a consequence."""
    argv = ["--preset", "7b", "--seq-len", str(seq_len), "--global-batch", "1", "--devices", str(devices)]
    assert planner_main([*argv, "--device", "h100"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"the one that binds: the sequence length {seq_len:,} does not divide over the devices" in line
    assert nearest in line and "micro-batch" not in line and "vocab" not in line


@pytest.mark.parametrize("block_ops,accelerator", [("pallas", "a GPU"), ("pallas_tpu", "a TPU")])
def test_block_ops_pallas_on_cpu_is_refused_up_front(capsys, block_ops, accelerator):
    """It ended after the build and compile with JAX's 'Only interpret mode is supported on CPU backend'."""
    code, err = _cli([*SMALL_FLAGS, "--cpu-devices", "1", "--steps", "1", "--block-ops", block_ops], capsys)
    assert code == 2 and len(err) == 1, err
    assert (
        err[0].startswith(f"error: --block-ops {block_ops} compiles Pallas kernels for {accelerator}")
        and "Traceback" not in err[0]
    )
    assert f"use --block-ops auto (or jnp), or {block_ops}_interpret" in err[0]


# ---- checkpoints: a full disk ----------------------------------------------------------------------------------


@pytest.mark.parametrize("long", [False, True], ids=["oserror", "tensorstore-words"])
def test_a_full_disk_during_a_save_names_the_cause_the_intact_step_and_the_resume(tmp_path, monkeypatch, long):
    """The line was cut at 240 characters before its cause when the error was tensorstore's (a long path first),
    and said neither which step was left intact nor how to go on."""

    ck = Checkpointer(tmp_path / "ck")
    state = {"w": jnp.ones(4)}
    ck.save(1, state, metadata={})
    ck.wait()

    async def full(self, item, directory):
        if long:
            raise ValueError(
                f'INTERNAL: Error writing local file "{"x/" * 150}f": [OS error 28: No space left on device]'
            )
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", full)
    with pytest.raises(CheckpointSaveError) as failed:
        ck.save(2, {"w": jnp.zeros(4)}, metadata={})
        ck.wait()
    message = str(failed.value)
    assert message.startswith(f"saving checkpoint step 2 to '{tmp_path / 'ck'}' failed: [Errno 28] No space left on")
    assert message.endswith("(the disk is full; step 1 in it is intact: free space and continue from it with --resume)")
    assert "\n" not in message
    ck.close()
    assert Checkpointer(tmp_path / "ck").all_steps() == [1]


# ---- read-only output directories (as root no directory is read-only to us: the write is made to fail) ---------


def _read_only_under(monkeypatch, root: Path):
    """Creating a directory or writing a file under `root` fails as on a read-only mount."""

    def refuse(path):
        if str(path).startswith(str(root)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    real_makedirs, real_mkdir, real_open = os.makedirs, Path.mkdir, os.open

    def makedirs(path, *a, **k):
        refuse(path)
        return real_makedirs(path, *a, **k)

    def mkdir(self, *a, **k):
        refuse(self)
        return real_mkdir(self, *a, **k)

    def open_(path, *a, **k):
        refuse(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "makedirs", makedirs)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)


def test_a_read_only_out_dir_names_the_flag(tmp_path, capsys, monkeypatch):
    _read_only_under(monkeypatch, tmp_path / "ro")
    out = tmp_path / "ro" / "run"
    code, err = _cli([*SMALL_FLAGS, "--cpu-devices", "1", "--steps", "1", "--out-dir", str(out)], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0] == (
        f"error: --out-dir '{out}' cannot be written (Read-only file system): give --out-dir a writable directory"
    )


def test_prepare_into_a_read_only_directory_names_it(tmp_path, capsys, monkeypatch):
    (tmp_path / "in.txt").write_text("a document\n")
    _read_only_under(monkeypatch, tmp_path / "ro")
    out = tmp_path / "ro" / "store"
    assert data_main(["prepare", str(tmp_path / "in.txt"), str(out), "--no-progress"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line == f"error: OUT_DIR '{out}' cannot be written (Read-only file system): give a writable one"


# ---- Ctrl-C while a command starts ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        [str(ROOT / "train.py"), "--steps", "1"],
        ["-m", "jaxring.planner", "--preset", "7b", "--seq-len", "4096", "--devices", "8", "--device", "h100"],
        ["-m", "jaxring.data", "prepare", "IN", "OUT"],
        ["-m", "jaxring.eval", "needle", "CKPT", "--lengths", "64"],
        ["-m", "jaxring.models.hf", "export", "CKPT", "OUT"],
    ],
    ids=["train.py", "planner", "data", "eval", "hf"],
)
def test_ctrl_c_while_jax_imports_stops_the_command_in_one_line(tmp_path, args):
    """A KeyboardInterrupt raised while jax imports could land in jax's gc callback, which swallowed it
    ("Exception ignored in: <function _xla_gc_callback>") and the command ran to completion."""

    args = [str(tmp_path / a) if a in ("IN", "OUT", "CKPT") else a for a in args]
    child = subprocess.Popen(
        [sys.executable, *args], env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(0.5)  # (importing jax takes seconds)
    child.send_signal(signal.SIGINT)
    try:
        _, err = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        raise
    assert child.returncode == 130 and err == "interrupted\n", err[-2000:]


# ---- contradictions ----------------------------------------------------------------------------------------


def test_a_warmup_longer_than_the_run_is_named_before_the_first_step():
    """--warmup 5 --steps 2 was accepted without a word: the learning rate never reached --lr."""

    history, lines = _run(steps=2, warmup=5, eval_every=4)
    first_step = next(i for i, line in enumerate(lines) if str(line).startswith("step 1:"))
    warnings = [str(line) for line in lines[:first_step] if str(line).startswith("warning: ")]
    assert warnings == [
        "warning: --warmup 5 is longer than the whole run (--steps 2): the learning rate rises for every step and "
        "never reaches --lr 0.003 (lower --warmup)",
        "warning: --eval-every 4 is beyond --steps 2: no held-out loss is logged during the run",
    ]
    assert len(history) == 2


# ---- item 2: what fails after the last step never loses the trained state -------------------------------------


def _fail_after_training(monkeypatch, stage):
    """The stage of the run's end that fails: the export, the held-out loss or the sample."""

    def boom(*args, **kwargs):
        raise RuntimeError(f"injected failure in the {stage}")

    target = {"export": (GPTTask, "export"), "eval": (Trainer, "val_loss"), "sample": (GPTTask, "finish")}[stage]
    monkeypatch.setattr(*target, boom)


@pytest.mark.parametrize("stage", ["export", "eval", "sample"])
@pytest.mark.parametrize("checkpoint_dir", [False, True], ids=["no-checkpoint-dir", "checkpoint-dir"])
def test_a_failure_after_the_last_step_keeps_the_trained_state(tmp_path, monkeypatch, stage, checkpoint_dir):

    trainers = []

    class Recorded(loop.Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            trainers.append(self)

    monkeypatch.setattr(loop, "Trainer", Recorded)
    _fail_after_training(monkeypatch, stage)

    changes = {"steps": 2, "out_dir": str(tmp_path / "run"), "sample_tokens": 4, "eval_at_end": True}
    if checkpoint_dir:
        changes["checkpoint_dir"] = str(tmp_path / "ck")
    spec = BASE.updated(**changes)
    with pytest.raises(loop.AfterTraining) as failed:
        loop.train(spec, devices=jax.devices()[:1], log=lambda *a: None, signals=())
    where = tmp_path / "ck" if checkpoint_dir else tmp_path / "run" / loop.FINAL_STATE_DIR
    message = str(failed.value)
    assert message.startswith(f"injected failure in the {stage}; the trained state (step 2) is saved in '{where}'")
    assert f"--checkpoint-dir {where} --resume" in message and f"jaxring.models.hf export {where} DIR" in message
    assert "\n" not in message
    trained = trainers[0].state()["params"]
    restored = Recorded(spec.updated(checkpoint_dir=str(where)), jax.devices()[:1])
    restored.restore(Checkpointer(where))
    assert restored.step_count == 2
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(restored.state()["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- item 3: an evaluation's context that cannot fit stops before compiling ------------------------------------


@pytest.mark.parametrize(
    "command, flag",
    [(["needle", "--lengths", "100000000"], "--lengths"), (["perplexity", "--seq-len", "100000000"], "--seq-len")],
)
def test_an_eval_context_that_cannot_fit_is_refused_naming_the_one_that_fits(tmp_path, capsys, command, flag):
    """It compiled (for minutes) and then ran out of memory; now the planner's estimate of the forward pass."""
    argv = [command[0], str(ROOT / "tests" / "fixtures" / "hf" / "llama"), *command[1:], "--out", str(tmp_path)]
    assert eval_main([*argv, "--no-progress", "--host-memory-gib", "16"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"error: {flag} 100000000: a forward pass of ")
    budget = re.search(r"GiB per device, above the ([\d.]+) GiB of host memory each of (\d+) simulated CPU", line)
    assert budget and float(budget[1]) == pytest.approx(16 / int(budget[2]), abs=0.05), line  # (devices: the process's)
    longest = int(re.search(r"the longest that fits is about ([\d,]+) tokens", line)[1].replace(",", ""))
    assert 0 < longest < 100_000_000 and longest % 2 == 0
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    "flags,named",
    [(["--offload", "weights"], "--offload weights"), (["--remat", "full", "--remat-layers", "2"], "--remat-layers 2")],
)
def test_eval_refuses_training_only_memory_flags(tmp_path, capsys, flags, named):
    """jaxring.eval accepted --offload weights and --remat-layers and ignored them: refused in one line."""
    code = eval_main(
        ["needle", str(ROOT / "tests/fixtures/hf/llama"), "--lengths", "64", *flags, "--out", str(tmp_path)]
    )
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and line.startswith(f"error: {named}") and "forward passes only" in line
