"""Runs that never hang and never lie: checkpoint faults, bad data files, signals, allocation failures,
multi-host mismatches, contradictions that used to be accepted, and what a run reports (issue 26).

Every test that starts processes gives them a timeout and kills them; a user's mistake ends in one line.
"""

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT
from test_reliability import CLI, SMALL_FLAGS, _env, steps_in
from test_train import BASE

from jaxring.train import loop
from jaxring.train.checkpoint import Checkpointer, CheckpointSaveError, DamagedCheckpointError
from jaxring.train.directory_lock import LOCK_FILE, CheckpointDirectoryInUse
from jaxring.train.guard import DivergenceGuard
from jaxring.train.multihost import (
    MultiHostError,
    initialize,
    rendezvous_coordinator,
    rendezvous_peer,
    shared_settings,
    start_processes,
)
from jaxring.train.signals import GracefulStop

TIMEOUT = 240  # seconds any child process of these tests may run


def _run(log=None, **changes):
    """A tiny run on one device; (its history, the lines it said)."""
    lines = []
    spec = BASE.updated(**{"steps": 3, "log_every": 1, **changes})
    history = loop.train(spec, devices=jax.devices()[:1], log=log or lines.append)
    return history, lines


def _cli(argv, capsys):
    """train.py's main in this process: (exit code, stderr lines)."""
    try:
        code = CLI.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


def _train_py(args, timeout=TIMEOUT, **kw):
    """train.py in a child process (killed at the timeout): CompletedProcess."""
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        env=kw.pop("env", _env()),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


# ---- checkpoint directories: unwritable, full, shared --------------------------------------------------


def test_a_checkpoint_directory_that_cannot_be_created_fails_at_once(tmp_path):
    """It used to train on with every save failing in the background, and the process never exited."""
    (tmp_path / "file").write_text("not a directory")
    out = _train_py(
        [*SMALL_FLAGS, "--cpu-devices", "1", "--steps", "2", "--checkpoint-dir", str(tmp_path / "file" / "ck")]
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert re.match(r"error: checkpoint directory '.*/file/ck' cannot be created \(Not a directory\)", out.stderr)


def test_a_read_only_checkpoint_directory_fails_at_once(tmp_path, monkeypatch):
    """(As root no directory is read-only to us: the write is made to fail as on a read-only mount.)"""
    real = Path.write_bytes

    def read_only(self, data):
        if self.parent == tmp_path / "ck":
            raise OSError(errno.EROFS, "Read-only file system")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    with pytest.raises(
        CheckpointSaveError, match=r"checkpoint directory '.*/ck' is not writable \(Read-only file system\)"
    ):
        _run(checkpoint_dir=str(tmp_path / "ck"))


def _disk_full(monkeypatch):
    """Every metadata/checksums write fails as on a full disk (in orbax's background save thread)."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    async def full(self, item, directory):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", full)


@pytest.mark.slow  # a 1-3 minute run on a small filesystem
def test_a_full_disk_stops_the_run_in_one_line_and_leaves_no_temporary_directory(tmp_path, monkeypatch, capfd):
    _disk_full(monkeypatch)
    ck = tmp_path / "ck"
    with pytest.raises(CheckpointSaveError) as failed:
        _run(steps=6, checkpoint_dir=str(ck), checkpoint_every=2)
    message = str(failed.value)
    assert message.startswith(f"saving checkpoint step 2 to '{ck}' failed: [Errno 28] No space left on device")
    assert "the disk is full" in message and "\n" not in message
    assert sorted(os.listdir(ck)) == ["metrics.jsonl", "run.yaml"]  # no step, no temporary dir, no lock
    assert "Traceback" not in capfd.readouterr().err  # orbax's own tracebacks are not printed
    assert CLI  # (train.py turns CheckpointSaveError, an OSError, into one line and exit code 2)


def test_a_directory_in_use_is_refused_and_a_dead_runs_lock_taken_over(tmp_path, capsys):
    ck = tmp_path / "ck"
    with Checkpointer(ck, lock=True) as first:
        holder = json.loads((ck / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(CheckpointDirectoryInUse, match=rf"is in use by another run \(pid {os.getpid()} on "):
            Checkpointer(ck, lock=True)
        code, err = _cli([*SMALL_FLAGS, "--steps", "1", "--checkpoint-dir", str(ck)], capsys)
        assert code == 2 and len(err) == 1, err
        assert f"is in use by another run (pid {os.getpid()}" in err[0]
        assert first.all_steps() == []
    assert not (ck / LOCK_FILE).exists()  # released on close
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    (ck / LOCK_FILE).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "since": "then"}))
    said = []
    with Checkpointer(ck, lock=True, report=said.append):
        assert json.loads((ck / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert said == [f"warning: {str(ck)!r}: taking over the lock of pid {gone.pid}, which is gone"]


def test_the_unraisable_hook_is_set_only_while_a_checkpointer_is_open(tmp_path):
    before = sys.unraisablehook
    ck = Checkpointer(tmp_path / "ck")
    assert sys.unraisablehook is not before
    ck.close()
    assert sys.unraisablehook is before


# ---- the metadata item is checksummed -----------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 3-step run checkpointed every step (steps 1, 2, 3 kept)."""
    root = tmp_path_factory.mktemp("saved")
    history, _ = _run(checkpoint_dir=str(root / "ck"), checkpoint_every=1)
    return root / "ck", [r["loss"] for r in history]


def _copy_with_metadata(saved, tmp_path, edit):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    path = ck / "3" / "metadata" / "metadata"
    path.write_text(edit(path.read_text()))
    return ck


@pytest.mark.parametrize(
    "what,edit",
    [
        # an edited running loss: every resume used to stop as diverged
        ("running loss", lambda t: re.sub(r'"lowest_mean": [0-9.e+-]+', '"lowest_mean": 1e-06', t)),
        # one flipped bit in the model's description: a false "incompatible model", no fallback
        ("flipped bit", lambda t: t.replace('"hidden": 64', '"hidden": 66', 1)),
    ],
)
def test_damaged_metadata_falls_back_to_the_newest_intact_step(saved_run, tmp_path, what, edit):
    saved, losses = saved_run
    ck = _copy_with_metadata(saved, tmp_path, edit)
    history, lines = _run(steps=3, checkpoint_dir=str(ck), resume=True)
    assert lines[0].startswith(f"warning: checkpoint step 3 in '{ck}': its metadata does not match its checksum")
    assert lines[0].endswith("trying step 2")
    assert [r["loss"] for r in history] == losses[2:]  # step 3 again, from step 2: bit-exact
    assert (ck / "3.damaged").is_dir()


def test_checkpointer_metadata_is_verified(saved_run, tmp_path):
    ck = _copy_with_metadata(saved_run[0], tmp_path, lambda t: t.replace('"kind": "gpt"', '"kind": "gpu"'))
    with Checkpointer(ck) as c:
        assert c.metadata(2)["model"]["kind"] == "gpt"
        with pytest.raises(DamagedCheckpointError, match=r"step 3 .*: its metadata does not match its checksum"):
            c.metadata(3)


# ---- data files -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_only_regular_files_are_data(tmp_path, kind):
    """A FIFO used to block the read for ever; /dev/zero used to read until memory ran out (the child's
    address space is capped at 4 GiB here, so that cannot take the machine down)."""
    if kind == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
        expected = "is a FIFO"
    else:
        path, expected = Path("/dev/zero"), "is a character device"

    def cap_memory():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    out = _train_py([*SMALL_FLAGS, "--cpu-devices", "1", "--data", str(path)], timeout=120, preexec_fn=cap_memory)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr == (
        f"error: input {str(path)!r} {expected}, not a regular file: give a text, .jsonl or .parquet file, "
        "or a directory of them\n"
    )


def test_held_out_ids_beyond_the_vocabulary_are_reported_before_the_first_step(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    np.arange(5000, dtype=np.uint16).tofile(data / "train.bin")
    np.array([1, 2, 60000, 3] * 100, dtype=np.uint16).tofile(data / "val.bin")
    metrics = tmp_path / "m.jsonl"
    with pytest.raises(
        ValueError, match=r"held-out data val.bin\[val\] has token id 60000, outside the vocabulary of 50304"
    ):
        _run(data=str(data), metrics_file=str(metrics), overrides={"num_layers": 1, "hidden": 32, "num_heads": 4})
    assert not metrics.exists()  # no step ran


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "vocab_size=100000",
            r"--override vocab_size=100000: the data bytes has a vocabulary of 257; rows past 384",
        ),
        (
            "vocab_size=100",
            r"--override vocab_size=100: the data bytes has a vocabulary of 257 \(token ids up to 256\)",
        ),
        ("max_seq_len=4096", r"--override max_seq_len=4096: the data is cut into sequences of --seq-len 64;"),
    ],
)
def test_overrides_beyond_the_data_are_refused(override, message, capsys):
    code, err = _cli([*SMALL_FLAGS, "--steps", "1", "--override", override], capsys)
    assert code == 2 and len(err) == 1 and re.search(message, err[0]), err


# ---- signals ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # a train.py child run to a save
def test_sighup_stops_after_the_step_and_saves(tmp_path):
    """A closed terminal used to kill the run at once (exit 129), with nothing saved."""
    ck = tmp_path / "ck"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *SMALL_FLAGS, "--cpu-devices", "1", "--log-every", "1"]
        + ["--steps", "500", "--checkpoint-dir", str(ck)],
        env={**_env(), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        timer = threading.Timer(TIMEOUT, proc.kill)
        timer.start()
        for line in proc.stdout:
            if line.startswith("step 2:"):
                proc.send_signal(signal.SIGHUP)
                break
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        timer.cancel()
        proc.kill()
    assert proc.returncode == 129, err
    assert "Traceback" not in err and err.startswith("SIGHUP: stopping after the current step")
    step = int(out.strip().splitlines()[-1].split("stopped after step ")[1].split()[0])
    assert steps_in(ck) == [str(step)]


def test_the_watchdog_exits_when_a_stop_cannot_finish():
    exits = []
    with GracefulStop((), hard_exit=exits.append, grace_s=0.2) as stop:
        stop.handle(signal.SIGTERM)  # the step never finishes: the watchdog ends the process
        time.sleep(1.0)
    assert exits == [128 + signal.SIGTERM]
    exits.clear()
    with GracefulStop((), hard_exit=exits.append, grace_s=0.5) as stop:
        stop.handle(signal.SIGHUP)  # the run stops in time: the watchdog stands down
    time.sleep(0.8)
    assert exits == []


STUCK = """
import ctypes, sys
from jaxring.train.signals import GracefulStop
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(256)
libc.pthread_mutex_init(mutex, None)
with GracefulStop(grace_s=float(sys.argv[1])):
    print("ready", flush=True)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # stuck for ever in C, as in a collective that never completes
"""


@pytest.mark.parametrize("grace,signals", [(1.0, 1), (600.0, 2)], ids=["watchdog", "second-signal"])
def test_a_main_thread_stuck_in_c_still_ends_on_sigterm(grace, signals):
    """Python's handler never runs while the main thread is stuck in C: the signal reaches the wakeup
    thread, which arms the watchdog (exit after the grace period) or, on a second signal, exits at once."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK, str(grace)],
        env={**_env(), "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    expected = "did not stop within 1 s of the signal" if signals == 1 else "SIGTERM again: exiting now"
    assert expected in err


# ---- allocation failures, impossible sizes, contradictions ------------------------------------------------


def test_out_of_memory_names_the_settings_to_shrink(monkeypatch, capsys):
    def exhausted(self, max_loss=None):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00TiB.")

    monkeypatch.setattr(loop.Trainer, "step", exhausted)
    code, err = _cli([*SMALL_FLAGS, "--cpu-devices", "1", "--steps", "1"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: out of memory at step 1 (compiling the step) (JaxRuntimeError: RESOURCE_EXHAUSTED")
    assert "lower --batch-size 4 or --seq-len 64" in err[0]

    def no_memory(self, spec, devices=None):
        raise MemoryError()

    monkeypatch.setattr(loop.Trainer, "__init__", no_memory)
    code, err = _cli([*SMALL_FLAGS, "--cpu-devices", "1", "--steps", "1"], capsys)
    assert code == 2 and len(err) == 1 and "out of memory building the model and optimizer state" in err[0], err


BAD_SETTINGS = [
    (["--cpu-devices", "100000"], r"--cpu-devices 100000 is more simulated CPU devices than this host can run"),
    (
        ["--fsdp", "8", "--zero", "0", "--batch-size", "8"],
        r"--fsdp 8 with --zero 0: fsdp means the parameters are sharded \(ZeRO-3\)",
    ),
    (
        ["--init-timeout", "1e20", "--num-processes", "2", "--process-id", "1", "--coordinator", "h:1"],
        r"--init-timeout 1e\+20 must be a finite number of seconds in \(0, 1e6\]",
    ),
]


@pytest.mark.parametrize("argv,message", BAD_SETTINGS, ids=[" ".join(a) for a, _ in BAD_SETTINGS])
def test_bad_settings_are_one_line(argv, message, capsys):
    code, err = _cli([*SMALL_FLAGS, "--steps", "1", *argv], capsys)
    assert code == 2 and len(err) == 1 and re.search(message, err[0]), err


def test_multihost_checks_bound_the_timeout_and_the_devices():
    """initialize() itself (not only the flags): 1e20 s used to end in an OverflowError traceback."""
    with pytest.raises(MultiHostError, match=r"--init-timeout 1e\+20 must be a finite number of seconds in \(0, 1e6\]"):
        initialize("127.0.0.1:1", 2, 1, timeout_s=1e20)
    with pytest.raises(MultiHostError, match="--cpu-devices 100000 is more simulated CPU devices"):
        initialize("127.0.0.1:1", 2, 1, timeout_s=1, cpu_devices=100000)


def test_planner_refuses_nan_bandwidths_and_uneven_nodes(capsys):
    from jaxring.planner.__main__ import main as planner
    from jaxring.planner.cluster import Cluster

    for bad, message in (
        (dict(intra_bw=float("nan")), r"intra_bw nan must be a finite number > 0"),
        (dict(inter_bw=0.0), r"inter_bw 0.0 must be a finite number > 0"),
        (dict(efficiency=float("nan")), r"efficiency nan must be a number in \(0, 1\]"),
        (dict(devices_per_node=3), r"devices per node 3 does not divide the 8 devices"),
    ):
        with pytest.raises(ValueError, match=message):
            Cluster.of("h100", 8, **bad)
    assert (
        planner(["--device", "h100", "--devices", "8", "--preset", "tiny", "--seq-len", "1024", "--intra-bw", "nan"])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: intra_bw nan must be a finite number > 0") and err.count("\n") == 1


def test_attention_refuses_float_segment_ids_and_bad_scales():
    from jaxring import flash_attention, make_mesh, sharded_attention

    q = jnp.ones((1, 16, 2, 8))
    mesh = make_mesh(sp=8)
    with pytest.raises(TypeError, match="segment_ids have dtype float32; segment ids must be integers"):
        sharded_attention(q, q, q, mesh=mesh, strategy="ring", segment_ids=jnp.ones((1, 16), jnp.float32))
    for scale in (float("nan"), 0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match=r"sm_scale .* must be a finite number > 0"):
            sharded_attention(q, q, q, mesh=mesh, strategy="ring", sm_scale=scale)
        with pytest.raises(ValueError, match=r"sm_scale .* must be a finite number > 0"):
            flash_attention(q, q, q, sm_scale=scale)


def test_the_skip_mode_message_does_not_advise_skip_mode():
    guard = DivergenceGuard(mode="skip", max_skips=1)
    guard.check(1, 2.0)
    assert guard.check(2, float("nan")).action == "skip"
    message = guard.check(3, float("nan")).message
    assert "--on-divergence skip" not in message and "skip mode gives up after 1 skipped steps in a row" in message


# ---- multi-host: settings that differ, cluster detection ---------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_processes_with_different_settings_stop_naming_the_setting():
    """In threads: process 0 has sp 8, process 1 dp 2 × sp 4 (before: both ran on, waiting for each other)."""
    port, errors = _free_port(), {}
    ours = shared_settings(BASE.updated(sp=8))
    theirs = shared_settings(BASE.updated(dp=2, sp=4, process_id=1, out_dir="elsewhere"))

    def peer():
        try:
            rendezvous_peer("127.0.0.1", port, 1, 2, 20, "process 1", theirs)
        except MultiHostError as e:
            errors["peer"] = str(e)

    thread = threading.Thread(target=peer)
    thread.start()
    with pytest.raises(MultiHostError) as coordinator:
        rendezvous_coordinator(port, 2, 20, "process 0", ours)
    thread.join(timeout=30)
    expected = "process 1 (on 127.0.0.1) was given --dp 2 but process 0 --dp (not given)"
    assert expected in str(coordinator.value) and expected in errors["peer"]
    assert "every process must be given the same run settings" in errors["peer"]


def test_two_train_py_processes_with_different_meshes_both_exit(tmp_path):
    """The real thing: --sp 8 on one process and --dp 2 --sp 4 on the other (before: both still running
    after 3 minutes, deaf to SIGTERM). Both end within the timeout with one line and exit code 2."""
    port = _free_port()
    common = [*SMALL_FLAGS, "--steps", "2", "--cpu-devices", "4", "--coordinator", f"127.0.0.1:{port}"]
    meshes = (["--sp", "8"], ["--dp", "2", "--sp", "4"])
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *common, "--num-processes", "2", "--process-id", str(i), *mesh],
            env=_env(),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, mesh in enumerate(meshes)
    ]
    try:
        results = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 2, err[-2000:]
        assert err.count("\n") == 1 and "was given --dp 2 but process 0 --dp (not given)" in err


def test_slurm_and_open_mpi_start_without_flags(monkeypatch):
    from jaxring.run.schema import ClusterSettings

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_"))]:
        monkeypatch.delenv(key)
    assert start_processes(ClusterSettings(), {}, log=lambda *a: None) is None and calls == []
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "0")
    said = []
    assert start_processes(ClusterSettings(init_timeout=60.0), {"sp": 8}, log=said.append) == "SLURM"
    assert calls == [((), {"initialization_timeout": 60})]  # no coordinator: jax.distributed finds it
    assert said[0].startswith("SLURM: process 0 of 1")
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert start_processes(ClusterSettings(), None, log=lambda *a: None) == "Open MPI"
    # --coordinator overrides the detection: jaxring's own checked start-up (here: nobody at the port)
    cluster = ClusterSettings(coordinator=f"127.0.0.1:{_free_port()}", num_processes=2, process_id=1, init_timeout=1.0)
    with pytest.raises(MultiHostError, match="could not reach the coordinator within 1 s"):
        start_processes(cluster, {})


# ---- what a run reports -----------------------------------------------------------------------------------


def test_metrics_rows_tensorboard_events_and_the_runs_lines(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    _, lines = _run(
        steps=4,
        metrics_file=str(metrics),
        tensorboard=str(tb),
        eval_every=2,
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=2,
        eval_at_end=True,
    )
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert {"step", "wall_time", "lr", "loss", "grad_norm", "tokens_per_s", "mfu", "step_time_s"} <= set(row)
        assert {"peak_memory_bytes", "host_memory_bytes"} <= set(row) and row["host_memory_bytes"] > 0
    assert "compile_s" in rows[0] and not any("compile_s" in r for r in rows[1:])
    assert [("val_loss" in r) for r in rows] == [False, True, False, True]
    assert rows[0]["lr"] == 0.0 and rows[1]["lr"] > 0  # warmup 1
    events = EventAccumulator(str(tb))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in rows]
    np.testing.assert_allclose([e.value for e in loss], [r["loss"] for r in rows], rtol=1e-6)
    assert [e.step for e in events.Scalars("train/val_loss")] == [2, 4]
    header = lines[0]
    assert "plan: 1 device" in header and "precision fp32, remat none" in header
    assert (
        f"saving checkpoint step 2 to {tmp_path / 'ck'}" in lines
        and f"saving checkpoint step 4 to {tmp_path / 'ck'}" in lines
    )
    assert lines[-2] == "evaluating the held-out loss..." and lines[-1].startswith("final loss")


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install 'jaxring[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    history, _ = _run(steps=2, wandb="jaxring-test", out_dir=str(tmp_path / "out"))
    assert len(history) == 2
    assert list((tmp_path / "out").rglob("*.wandb"))


def test_resume_after_a_killed_first_save_logs_no_step_twice(tmp_path):
    """kill -9 during the first save leaves the steps logged before it and no step: the resumed run starts at
    step 0 and must drop those rows, not append a second step 1 (as it did)."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2)) + '{"step": 3, "lo')
    (tmp_path / "ck").mkdir()  # (the killed save left no step)
    _, lines = _run(steps=2, checkpoint_dir=str(tmp_path / "ck"), resume=True, metrics_file=str(metrics))
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    assert any(line.startswith("dropped 3 rows after step 0 from ") for line in lines), lines
