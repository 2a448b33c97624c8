"""Fault injection: bad flags, damaged checkpoints, SIGTERM, NaN steps, divergence, multi-host set-up.

Every user error ends in one line on stderr and exit code 2; a damaged newest checkpoint falls back to the
previous one; SIGTERM finishes the step, saves it and a resume continues bit-exactly; a non-finite state is
never saved; a lone multi-host process times out with a message naming the coordinator and its id.
"""

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT
from PIL import Image
from test_train import BASE

from jaxring.run.task import model_family
from jaxring.train import loop
from jaxring.train.guard import Diverged, DivergenceGuard
from jaxring.train.metrics import drop_rows_after, progress_postfix, step_metrics
from jaxring.train.multihost import MultiHostError, initialize, rendezvous_coordinator, rendezvous_peer
from jaxring.train.signals import GracefulStop, TrainingStopped

SMALL_FLAGS = [
    "--override=num_layers=1",
    "--override=hidden=64",
    "--override=num_heads=8",
    "--override=ffn=128",
    "--seq-len",
    "64",
    "--batch-size",
    "4",
    "--warmup",
    "1",
    "--sample-tokens",
    "0",
    "--no-progress",
]


def _load_cli():
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CLI = _load_cli()


def steps_in(directory) -> list[str]:
    """The step directories of a checkpoint directory (run.yaml and metrics.jsonl sit beside them)."""
    return sorted(e for e in os.listdir(directory) if e.isdigit())


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return env


# ---- user errors: one line, exit code 2 ----------------------------------------------------------------


def _data(tmp_path, kind):
    if kind == "empty-bin":
        (tmp_path / "empty.bin").write_bytes(b"")
        return str(tmp_path / "empty.bin")
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(12):
        Image.new("L", (8, 8), i * 20).save(folder / f"{i}.png")
    good = (folder / "0.png").read_bytes()
    (folder / "5.png").write_bytes(good[: len(good) // 2])
    return str(folder)


BAD_INPUTS = [
    (["--override", "foo=1"], r"--override foo: GPTConfig has no field 'foo'"),
    (["--override", "num_layers=abc"], r"--override num_layers='abc': GPTConfig.num_layers must be an integer"),
    (["--override", "hidden=0"], r"--override hidden=0: GPTConfig.hidden must be a positive integer"),
    (["--override", "num_layers=-1"], r"--override num_layers=-1: .* must be a positive integer"),
    (["--override", "rope_theta=nan"], r"--override rope_theta=nan: .* must be a finite number"),
    (["--override", "novalue"], r"--override 'novalue' must be FIELD=VALUE"),
    (["--log-every", "0"], r"--log-every 0 must be a positive integer"),
    (["--dp", "0"], r"--dp 0 must be a positive integer"),
    (["--cpu-devices", "0"], r"--cpu-devices 0 must be a positive integer"),
    (["--cpu-devices", "-1"], r"--cpu-devices -1 must be a positive integer"),
    (["--lr", "nan"], r"--lr nan must be a finite number > 0"),
    (["--lr", "inf"], r"--lr inf must be a finite number > 0"),
    (["--lr", "-1"], r"--lr -1.0 must be a finite number > 0"),
    (["--seq-len", "0"], r"--seq-len 0 must be a positive integer"),
    (["--model", "dit", "--image-size", "0"], r"--image-size 0 must be a positive integer"),
    (["--warmup", "-5"], r"--warmup -5 must be a non-negative integer"),
    (["--checkpoint-every", "-2", "--checkpoint-dir", "ck"], r"--checkpoint-every -2 must be a non-negative integer"),
    (["--checkpoint-every", "2"], r"--checkpoint-every 2 needs --checkpoint-dir"),
    (["--keep-checkpoints", "0"], r"--keep-checkpoints 0 must be a positive integer"),
    (["--seed", "-3"], r"--seed -3 must be an integer in \[0, 2\*\*32\)"),
    (["--steps", "abc"], r"argument --steps: invalid int value: 'abc'"),
    (["--spike-factor", "0.5"], r"--spike-factor 0.5 must be a number > 1"),
    (["--metrics-file", "no/such/dir/m.jsonl"], r"--metrics-file 'no/such/dir/m.jsonl': directory .* does not exist"),
    (
        ["--num-processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:1"],
        r"--process-id 2 must be in \[0, --num-processes = 2\)",
    ),
    (
        ["--num-processes", "0", "--process-id", "0", "--coordinator", "127.0.0.1:1"],
        r"--num-processes 0 must be a positive integer",
    ),
    (
        ["--num-processes", "2", "--process-id", "1", "--coordinator", "nohost"],
        r"--coordinator 'nohost' must be HOST:PORT",
    ),
    (["--num-processes", "2"], r"missing --coordinator, --process-id"),
    (
        ["--init-timeout", "-1", "--num-processes", "1", "--process-id", "0", "--coordinator", "h:1"],
        r"--init-timeout -1.0 must be a finite number of seconds in \(0, 1e6\]",
    ),
    (["--data", "DATA:empty-bin"], r"token file '.*empty.bin' is empty \(0 bytes\)"),
    (["--model", "dit", "--data", "DATA:corrupt-image"], r"image '.*5.png' cannot be read"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [_data(tmp_path, a[5:]) if a.startswith("DATA:") else a for a in argv]
    code = None
    try:
        code = CLI.main(argv + ["--steps", "1"])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert __import__("re").search(message, lines[0]), lines[0]


def test_env_process_id_not_an_int(capsys, monkeypatch):
    monkeypatch.setenv("JAX_PROCESS_ID", "abc")
    assert CLI.main(["--steps", "1"]) == 2
    assert capsys.readouterr().err == "error: environment variable JAX_PROCESS_ID='abc' must be an integer\n"


def test_existing_checkpoints_need_resume(tmp_path, capsys):
    (tmp_path / "ck" / "4").mkdir(parents=True)
    assert CLI.main(["--checkpoint-dir", str(tmp_path / "ck")]) == 2
    assert "already holds checkpoints (steps [4]); pass --resume" in capsys.readouterr().err


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="--lr nan must be a finite number"):
        CLI.main(["--lr", "nan", "--debug"])


def parse_overrides(model, items):
    return dict(model_family(model).parse_override(item) for item in items)


def test_override_values_take_the_field_type():
    assert parse_overrides(
        "gpt", ["num_layers=2", "rope_theta=5e5", "tie_embeddings=false", "num_kv_heads=none", "positions=learned"]
    ) == {
        "num_layers": 2,
        "rope_theta": 500000.0,
        "tie_embeddings": False,
        "num_kv_heads": None,
        "positions": "learned",
    }
    with pytest.raises(ValueError, match=r"--override num_layers='2.5': GPTConfig.num_layers must be an integer"):
        parse_overrides("gpt", ["num_layers=2.5"])
    with pytest.raises(ValueError, match=r"--override hidden='none': GPTConfig.hidden must be an integer"):
        parse_overrides("gpt", ["hidden=none"])
    with pytest.raises(ValueError, match=r"--override hidden=None: GPTConfig.hidden cannot be None"):
        BASE.updated(overrides={"hidden": None}).validate()


# ---- the lone multi-host process, and the set-up checks -------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lone_multihost_process_times_out_with_its_message():
    """A real train.py process 1 of 2 with nobody at the coordinator: one line, exit 2, no hang."""
    port = _free_port()
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            "1",
            "--init-timeout",
            "2",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith(
        f"error: coordinator 127.0.0.1:{port}, process 1 of 2: could not reach the coordinator within 2 s"
    )


def test_lone_coordinator_times_out_naming_the_missing_process():
    port = _free_port()
    with pytest.raises(
        MultiHostError,
        match=rf"coordinator 127.0.0.1:{port}, process 0 of 3: timed out after "
        rf"1 s waiting for process\(es\) \[1, 2\]",
    ):
        initialize(f"127.0.0.1:{port}", 3, 0, timeout_s=1)


def _rendezvous(hellos, num_processes=3, timeout_s=20):
    """Process 0 in this thread, each (process_id, num_processes) of `hellos` in its own thread: the errors."""
    port = _free_port()
    errors = {}

    def peer(i, pid, count):
        try:
            rendezvous_peer("127.0.0.1", port, pid, count, timeout_s, f"process {pid}")
        except MultiHostError as e:
            errors[i] = str(e)

    threads = [threading.Thread(target=peer, args=(i, *h)) for i, h in enumerate(hellos)]
    for t in threads:
        t.start()
    try:
        rendezvous_coordinator(port, num_processes, timeout_s, "process 0")
    except MultiHostError as e:
        errors["coordinator"] = str(e)
    for t in threads:
        t.join()
    return errors


def test_duplicate_ids_and_wrong_counts_are_caught_before_any_hang():
    assert _rendezvous([(1, 3), (2, 3)]) == {}
    errors = _rendezvous([(1, 3), (1, 3)])
    assert set(errors) == {"coordinator", 0, 1}
    assert all("two processes say --process-id 1" in e for e in errors.values())
    errors = _rendezvous([(1, 3), (2, 4)])
    assert "process 2 (on 127.0.0.1) says --num-processes 4 but process 0 says 3" in errors["coordinator"]
    assert set(errors) == {"coordinator", 0, 1}


# ---- training runs with faults (one device, a 1-layer model) ---------------------------------------------


def _run(log=None, guard=None, **changes):
    cfg = BASE.updated(**{"steps": 4, "log_every": 1, **changes})
    lines = []
    history = loop.train(cfg, devices=jax.devices()[:1], log=log or lines.append, guard=guard)
    return [r["loss"] for r in history], history


def _rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 4-step run, checkpointed every step (steps 2, 3, 4 kept)."""
    root = tmp_path_factory.mktemp("straight")
    losses, _ = _run(checkpoint_dir=str(root / "ck"), checkpoint_every=1, metrics_file=str(root / "m.jsonl"))
    return root, losses


def test_sigterm_saves_the_step_and_resume_is_bit_exact(straight, tmp_path):
    _, full = straight
    ck = str(tmp_path / "ck")
    lines = []

    def log(line):
        lines.append(line)
        if line.startswith("step 2:"):
            os.kill(os.getpid(), signal.SIGTERM)  # preempted during step 2's logging

    with pytest.raises(TrainingStopped) as stop:
        _run(log=log, checkpoint_dir=ck, metrics_file=str(tmp_path / "m.jsonl"))
    assert stop.value.exit_code == 128 + signal.SIGTERM
    assert lines[-1] == f"SIGTERM: stopped after step 2 and saved it to {tmp_path / 'ck'}; continue with --resume"
    assert steps_in(ck) == ["2"]
    resumed, _ = _run(checkpoint_dir=ck, resume=True, metrics_file=str(tmp_path / "m.jsonl"))
    assert resumed == full[2:]  # bit-exact
    assert [r["step"] for r in _rows(tmp_path / "m.jsonl")] == [1, 2, 3, 4]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers put back


def test_sigterm_before_the_first_step_saves_nothing(tmp_path):
    """A signal while the run is built or compiled (e.g. during a first-use data preparation) stops it before
    step 1 without saving an untrained step 0 (it did)."""
    ck = str(tmp_path / "ck")
    lines = []

    def log(line):
        lines.append(line)
        if "plan:" in line:  # the run's header, said before the first step
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(TrainingStopped) as stop:
        _run(log=log, checkpoint_dir=ck)
    assert stop.value.exit_code == 128 + signal.SIGTERM
    assert lines[-1] == "SIGTERM: stopped before the first step; nothing was saved"
    assert steps_in(ck) == []


def test_sigterm_to_train_py_saves_and_exits_143(tmp_path):
    """The real process: SIGTERM during step 2 → step finished, saved, one message, exit 143, no traceback."""
    ck = tmp_path / "ck"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *SMALL_FLAGS,
            "--cpu-devices",
            "1",
            "--log-every",
            "1",
            "--steps",
            "500",
            "--checkpoint-dir",
            str(ck),
        ],
        env={**_env(), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("step 2:"):
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "Traceback" not in err and err.startswith("SIGTERM: stopping after the current step")
    step = int(out.strip().splitlines()[-1].split("stopped after step ")[1].split()[0])
    assert 2 <= step < 500 and steps_in(ck) == [str(step)]
    assert out.strip().endswith(f"saved it to {ck}; continue with --resume")


def test_damaged_latest_checkpoint_falls_back_and_reruns_bit_exactly(straight, tmp_path):
    root, full = straight
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    shutil.copy(root / "m.jsonl", tmp_path / "m.jsonl")
    data = max(
        (p for p in (ck / "4" / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x10  # one flipped bit in the newest step
    data.write_bytes(bytes(blob))
    lines = []
    losses, _ = _run(log=lines.append, checkpoint_dir=str(ck), resume=True, metrics_file=str(tmp_path / "m.jsonl"))
    # (a flipped bit inside zstd-compressed chunks reads back as other values: the checksums catch it)
    assert lines[0].startswith(f"warning: checkpoint step 4 in '{ck}': checksum mismatch in '")
    assert lines[0].endswith("trying step 3")
    assert "dropped 1 rows after step 3" in lines[2] and lines[3] == f"resumed from {ck} at step 3"
    assert losses == full[3:]  # step 4 again, from step 3: bit-exact
    rows = _rows(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[3]["loss"] == full[3]
    assert (ck / "4.damaged").is_dir() and (ck / "4").is_dir()  # kept aside; step 4 saved anew


def test_resume_says_nothing_is_left_and_warns_about_the_schedule(straight, tmp_path):
    root, _ = straight
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    lines = []
    assert _run(log=lines.append, checkpoint_dir=str(ck), resume=True)[0] == []
    assert lines[-1] == "nothing to run: the checkpoint is at step 4, --steps is 4 (raise --steps to train further)"
    lines.clear()
    losses, _ = _run(log=lines.append, steps=5, checkpoint_dir=str(ck), resume=True)
    assert len(losses) == 1
    assert lines[0] == (
        "warning: resuming step 4 with other settings than the run that saved it (--steps 4 -> 5): "
        "the learning-rate schedule or the batches change, so the losses differ from one "
        "uninterrupted run"
    )


class PoisonedTrainer(loop.Trainer):
    """Fault injection: at step `at` (1-based) the update makes every parameter NaN; `bad_loss` also reports
    a NaN loss for that step (a bad batch), else the loss is the true (finite) one. Adds an extra metric."""

    at, bad_loss = 2, False

    def step(self, max_loss=None):
        out = dict(super().step(max_loss=max_loss))
        out["aux_metric"] = jnp.float32(self.step_count * 0.5)
        out["progress"] = ("aux_metric",)
        if self.step_count == self.at:
            self.params = jax.tree.map(lambda x: x * jnp.nan, self.params)
            if self.bad_loss:
                out["loss"] = jnp.float32(jnp.nan)
        return out


def test_nan_parameters_are_never_saved(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "Trainer", PoisonedTrainer)
    ck = tmp_path / "ck"
    with pytest.raises(
        Diverged,
        match=r"not saving step 2: NaN or Inf values in 'params/.*; stopping "
        r"\(newest checkpoint: step 1\)",
    ):
        _run(checkpoint_dir=str(ck), checkpoint_every=1)
    assert steps_in(ck) == ["1"]
    # without a save due, the next step's NaN loss stops the run, and the final save is not made
    with pytest.raises(
        Diverged,
        match=r"diverged at step 3: loss nan is not finite; stopping .*"
        r"\(newest checkpoint: step 1\)",
    ):
        _run(checkpoint_dir=str(ck), resume=True)
    assert steps_in(ck) == ["1"]


def test_skip_mode_undoes_the_bad_step_and_logs_every_metric(tmp_path, monkeypatch):
    class BadBatch(loop.Trainer):
        """Step 3 is a bad batch: the in-step check rejects it (forced here with max_loss = -inf, as a NaN or
        too-high loss would) and it reports a NaN loss, as such a batch would."""

        def step(self, max_loss=None):
            if self.step_count == 3:  # after the skip of step 3: the state after step 2 is back
                assert all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(self.state()), self.kept))
            bad = self.step_count == 2
            out = dict(super().step(max_loss=-np.inf if bad else max_loss))
            out["aux_metric"] = jnp.float32(self.step_count * 0.5)
            out["progress"] = ("aux_metric",)
            if bad:
                assert bool(out["skipped"])
                out["loss"] = jnp.float32(jnp.nan)
            if self.step_count == 2:
                self.kept = [np.asarray(x) for x in jax.tree.leaves(self.state())]
            return out

    monkeypatch.setattr(loop, "Trainer", BadBatch)
    lines = []
    losses, _history = _run(
        log=lines.append, steps=5, metrics_file=str(tmp_path / "m.jsonl"), guard=DivergenceGuard(mode="skip")
    )
    assert "step 3: loss nan is not finite; skipped (its update undone, 1 in a row)" in lines
    assert np.isnan(losses[2]) and np.isfinite(losses[3:]).all() and losses[4] < losses[0]
    rows = _rows(tmp_path / "m.jsonl")
    assert [r.get("skipped", False) for r in rows] == [False, False, True, False, False]
    assert rows[2]["loss"] is None  # NaN is written as null (valid JSON)
    assert [r["aux_metric"] for r in rows] == [0.5, 1.0, 1.5, 2.0, 2.5]  # every scalar of the step is logged
    assert {"grad_norm", "tokens_per_s", "mfu", "step_time_s"} <= set(rows[0])


# ---- the pieces on their own ---------------------------------------------------------------------------


def test_guard_stops_on_nan_jumps_and_slow_climbs():
    guard = DivergenceGuard(spike_factor=3.0, window=3)
    assert all(guard.check(i + 1, x) is None for i, x in enumerate([5.0, 4.0, 3.0, 2.0, 2.0]))
    assert guard.lowest_mean == pytest.approx(7 / 3)
    verdict = guard.check(6, 7.5)
    assert verdict.action == "stop" and verdict.message.startswith(
        "diverged at step 6: loss 7.5 is 3.2x its lowest running mean 2.333 (limit 3x, --spike-factor)"
    )
    climb = DivergenceGuard(spike_factor=3.0, window=3)  # each step 1.3x the last: no single jump
    verdicts = [climb.check(i + 1, 2.0 * 1.3**i) for i in range(12)]
    first = next(i for i, v in enumerate(verdicts) if v is not None)
    assert 2.0 * 1.3**first > 3 * 2.0 and verdicts[first].action == "stop"
    assert DivergenceGuard(spike_factor=0).check(1, 1e9) is None
    assert DivergenceGuard().check(1, float("inf")).message.startswith("diverged at step 1: loss inf is not finite")


def test_guard_skip_mode_gives_up_and_state_round_trips():
    guard = DivergenceGuard(mode="skip", max_skips=2)
    guard.check(1, 4.0)
    assert guard.check(2, float("nan")).action == "skip"
    assert guard.check(3, 100.0).action == "skip"
    last = guard.check(4, float("nan"))
    assert last.action == "stop" and "after 2 skipped steps in a row" in last.message
    other = DivergenceGuard()
    other.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert list(other.recent) == [4.0] and other.lowest_mean == 4.0
    for bad, message in (
        (dict(mode="retry"), "--on-divergence 'retry'"),
        (dict(spike_factor=1.0), "--spike-factor 1.0"),
        (dict(window=0), "--spike-window 0"),
    ):
        with pytest.raises(ValueError, match=message):
            DivergenceGuard(**bad)


def test_second_signal_exits_at_once():
    exits = []
    with GracefulStop(hard_exit=exits.append) as stop:
        assert not stop.requested()
        stop.handle(signal.SIGINT)
        assert stop.requested() and stop.signum == signal.SIGINT and exits == []
        stop.handle(signal.SIGTERM)
        assert exits == [128 + signal.SIGTERM]


def test_step_metrics_and_progress_convention():
    out = {
        "loss": jnp.float32(2.5),
        "grad_norm": jnp.float32(1.0),
        "tokens": jnp.int32(7),
        "dropped": jnp.bool_(False),
        "expert_load": jnp.arange(4, dtype=jnp.float32),
        "big": jnp.zeros((2, 2)),
        "progress": ("expert_load", "tokens"),
    }
    record, progress = step_metrics(out)
    assert record == {"loss": 2.5, "grad_norm": 1.0, "tokens": 7, "dropped": False, "expert_load": [0.0, 1.0, 2.0, 3.0]}
    assert progress == ("expert_load", "tokens")
    shown = progress_postfix({**record, "tokens_per_s": 1234.0, "mfu": None}, progress)
    assert shown == {
        "loss": "2.5000",
        "expert_load": "[0.0, 1.0, 2.0, 3.0]",
        "tokens": "7",
        "tok_s": "1,234",
        "mfu": "n/a",
    }


def test_drop_rows_after(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')  # the last row cut by a kill
    assert drop_rows_after(path, 2) == 2
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert drop_rows_after(tmp_path / "none.jsonl", 2) == 0
