"""The training loop behind `train.py`: step the trainer, log metrics (loss, tokens/s, MFU), checkpoint.

    history = train(RunSpec.of(model="gpt", preset="tiny", sp=8, attention="ring", steps=50))

The run's resolved specification is written to OUT_DIR/run.yaml before the first step (`--config` of it
repeats the run); metrics go to OUT_DIR/metrics.jsonl unless --metrics-file says otherwise.

Failures end in one exception, each with a one-line message (train.py turns them into exit codes):
  * ValueError / FileNotFoundError: a bad setting, data or checkpoint directory (before any step runs).
  * `Diverged`: the loss went non-finite or spiked (see guard.py), or the state to save holds NaN/Inf; the
    bad state is never saved, the last checkpoint stays the newest.
  * `TrainingStopped`: SIGTERM/SIGINT/SIGHUP; the current step was finished, saved (with a checkpoint directory)
    and every pending save waited for. A second signal exits at once (see signals.py for the watchdog).
  * `OutOfMemory` (a ValueError): an allocation failed (MemoryError, XLA's RESOURCE_EXHAUSTED) while
    building the state, compiling or running a step; the message names the settings to shrink.
  * `CheckpointSaveError` (an OSError): a save failed (full disk, read-only directory), also one that failed
    in the background (checked after every step); its temporary directory is removed.
On resume, a damaged newest checkpoint is reported and the newest intact one used.

Before anything is built, the planner's memory estimate of the run (`estimated_memory_bytes`) is checked
against the device memory (--device-memory-gib, else the accelerator's): a run it rules out (above the memory on
simulated CPU devices; on accelerators more than `jaxring.planner.fit.FAR_BEYOND` times it, closer the compiled
program decides: `jaxring.aot.fits`, asked by train.py) stops in one line (`jaxring.planner.fit.DoesNotFit`, a
ValueError: exit 2) naming the estimate, the device memory and the setting to change. What a run reports: a header with the plan (mesh, strategies, layout, precision, remat,
tiles, offload) and the estimated memory per device (where the planner can price the run); a
line per checkpoint save; a line before the held-out loss and the samples. Each step's metrics row
(metrics.jsonl; TensorBoard with --tensorboard, W&B with --wandb) has: step, wall_time (Unix seconds),
elapsed_s, lr, loss, grad_norm, tokens_per_s, mfu, step_time_s, peak_memory_bytes (the device's, null on
CPU), host_memory_bytes, val_loss (every --eval-every steps), every other metric of the step; the first
step of a run also has compile_s (its time, compilation included: its tokens_per_s and mfu are not the
run's speed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from jaxring.core.stop_signals import Interrupted, stop_message, stops_on_signals
from jaxring.planner.fit import check_fits
from jaxring.run.spec import RunSpec
from jaxring.train.checkpoint import Checkpointer, NonFiniteStateError
from jaxring.train.guard import Diverged, DivergenceGuard
from jaxring.train.metrics import (
    MetricsLog,
    drop_rows_after,
    host_memory_bytes,
    peak_flops,
    peak_memory_bytes,
    profile_steps,
    progress_bar,
    progress_postfix,
    step_metrics,
)
from jaxring.train.signals import SIGNALS, GracefulStop, TrainingStopped
from jaxring.train.trainer import Trainer, lr_schedule

RUN_FILE = "run.yaml"
RUNS_DIR = "runs"  # where a run that names no output directory gets one (DATE-TIME)

# settings that shape the optimizer schedule or the batches: a resume with other values gives other losses
SCHEDULE_FIELDS = (
    "steps",
    "warmup",
    "lr",
    "min_lr_ratio",
    "weight_decay",
    "clip",
    "batch_size",
    "grad_accum",
    "seed",
    "seq_len",
    "image_size",
    "data",
    "tokenizer",
    "text_field",
    "packing",
)


class OutOfMemory(ValueError):
    """An allocation failed; the message names the settings to shrink."""


def _is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    text = str(e)
    return isinstance(e, (RuntimeError, ValueError)) and (
        "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text
    )


@contextlib.contextmanager
def _reporting_out_of_memory(spec: RunSpec, where: str, devices: int):
    """MemoryError / XLA RESOURCE_EXHAUSTED inside becomes OutOfMemory: one line naming what to shrink."""
    try:
        yield
    except Exception as e:
        if not _is_out_of_memory(e):
            raise
        t = spec.training
        size = f"--seq-len {t.seq_len}" if t.seq_len else (f"--image-size {t.image_size}" if t.image_size else "")
        shrink = " or ".join(x for x in (f"--batch-size {t.batch_size}", size) if x)
        raise OutOfMemory(
            f"out of memory {where} ({type(e).__name__}: {_first_line(e)}); lower {shrink}, or use --remat full, "
            f"more sequence or tensor parallelism, or more devices (now {devices})"
        ) from None


def _first_line(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def estimated_memory_bytes(spec: RunSpec, devices: Sequence[jax.Device]) -> int | None:
    """Per-device memory the run is estimated to need (the planner's `jaxring.planner.fit.check_fits`); None:
    no estimate. Raises `DoesNotFit` (a ValueError, one line: the estimate, the device memory and the setting
    to change) when the estimate rules the run out (`check_fits`), before anything is built or compiled."""
    memory = check_fits(spec, list(devices))
    return None if memory is None else round(memory.total)


def train(
    spec: RunSpec,
    *,
    devices: Sequence[jax.Device] | None = None,
    log: Callable[..., object] = print,
    guard: DivergenceGuard | None = None,
    signals: Iterable[int] = SIGNALS,
) -> list[dict]:
    """Trains; returns the per-step metrics (a dict per step: every metric the step returns, plus timing).

    spec: the run (resolved here for the devices); devices: default `jax.devices()`. guard: the divergence
    guard (default: the spec's). signals: the signals that stop training gracefully (() leaves the process's
    handlers alone).
    """
    devices = list(jax.devices() if devices is None else devices)
    signals = tuple(signals)
    out_dir_given = spec.output.out_dir is not None
    spec = prepare(spec, len(devices))
    if guard is None:
        g = spec.guard
        guard = DivergenceGuard(g.on_divergence, g.spike_factor, g.spike_window)
    is_main = jax.process_index() == 0
    say = log if is_main else (lambda *a, **k: None)
    history = []
    with GracefulStop(signals) as stop:
        c = spec.checkpoint
        ckpt = None
        if c.checkpoint_dir:
            ckpt = Checkpointer(c.checkpoint_dir, keep=c.keep_checkpoints, lock=True, report=say)
        try:
            if ckpt is not None and not c.resume and ckpt.all_steps():
                raise ValueError(
                    f"--checkpoint-dir {c.checkpoint_dir!r} already holds checkpoints (steps {ckpt.all_steps()}); "
                    f"pass --resume to continue from them, or use another directory"
                )
            if is_main and spec.output.profile:  # said now, not by the profiler at the profiled step (a traceback)
                _make_profile_dir(spec.output.profile)
            estimate = estimated_memory_bytes(spec, devices)  # a run that cannot fit stops here, in one line
            with _reporting_out_of_memory(spec, "building the model and optimizer state", len(devices)):
                trainer = Trainer(spec, devices)
            _check_validation_data(trainer)
            if is_main:
                _write_run_file(spec, out_dir_given)
            if c.resume:
                _resume(spec, trainer, ckpt, guard, say)
            if trainer.step_count >= spec.training.steps:
                say(
                    f"nothing to run: the checkpoint is at step {trainer.step_count}, --steps is "
                    f"{spec.training.steps} (raise --steps to train further)"
                )
                return []
            _describe(spec, trainer, say, estimate)
            for line in contradictions(spec):
                say(f"warning: {line}")
            history = _run(spec, trainer, ckpt, guard, stop, say, is_main)
            if stop.requested():
                _stop_on_signal(stop, trainer, ckpt, guard, say)
            if ckpt is not None:
                _save(ckpt, trainer, guard, say)
        finally:
            if ckpt is not None:
                ckpt.close()  # waits for pending saves, also when stopping on an error
    try:
        with stops_on_signals() if signals else contextlib.nullcontext():  # a stop raises: the state is kept first
            _after_training(spec, trainer, history, say, is_main, len(devices))
    except (Exception, KeyboardInterrupt) as e:
        if not history:
            raise
        kept = _keep_trained_state(spec, trainer, ckpt, guard, say, str(e))
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(
                getattr(e, "signum", signal.SIGINT), f"{stop_message(e)} after training; {kept}"
            ) from None
        raise AfterTraining(f"{_first_line(e, limit=400)}; {kept}" if kept else _first_line(e, limit=400)) from None
    return history


class AfterTraining(OSError):
    """What runs after the last step (export, held-out loss, sample) failed; the trained state was kept first and
    the one-line message says where and how to go on from it."""


def _after_training(
    spec: RunSpec, trainer: Trainer, history: list, say: Callable[..., object], is_main: bool, devices: int
) -> None:
    """The task's export (gpt: --export-hf), the held-out loss, the sample. The export goes first, so that the
    trained model is written before what can fail (out of memory)."""
    if is_main and history:
        trainer.task.export(trainer.model(), say)
    if history and spec.output.eval_at_end:
        say("evaluating the held-out loss...")
        with _reporting_out_of_memory(spec, "evaluating the held-out loss", devices):
            say(f"final loss {history[-1]['loss']:.4f}; held-out loss {trainer.val_loss():.4f}")
    if is_main and spec.output.sample_tokens:
        say(f"sampling from the trained model ({spec.output.sample_tokens} tokens/images)...")
        trainer.task.finish(trainer.model(), say, spec.output.out_dir)


FINAL_STATE_DIR = "final-checkpoint"  # OUT_DIR/final-checkpoint: the trained state of a run with no --checkpoint-dir


def _keep_trained_state(
    spec: RunSpec,
    trainer: Trainer,
    ckpt: Checkpointer | None,
    guard: DivergenceGuard,
    say: Callable[..., object],
    failure: str,
) -> str:
    """After a failure past the last step: the trained state saved (the final checkpoint with --checkpoint-dir,
    else OUT_DIR/final-checkpoint) and a clause naming where it is and the commands that continue or export it
    ("" when the failure's own message says so already)."""
    if ckpt is not None:
        where = str(ckpt.directory)
        if where in failure or spec.checkpoint.checkpoint_dir in failure:
            return ""
    else:
        where = os.path.join(os.path.abspath(spec.output.out_dir), FINAL_STATE_DIR)
        try:
            final = Checkpointer(where, lock=True, report=say)
            try:
                _save(final, trainer, guard)
            finally:
                final.close()
        except (Exception, KeyboardInterrupt) as e:
            return f"saving the trained state to {where!r} failed too ({_first_line(e)}): it is lost"
    run_file = os.path.join(spec.output.out_dir, RUN_FILE)
    return (
        f"the trained state (step {trainer.step_count}) is saved in {where!r}: continue it with python train.py "
        f"--config {run_file} --checkpoint-dir {where} --resume --steps N, or export it with "
        f"python -m jaxring.models.hf export {where} DIR"
    )


def contradictions(spec: RunSpec) -> list[str]:
    """Settings that each pass their rule but contradict the run's length, one line each (said before step 1)."""
    steps, lines = spec.training.steps, []
    warmup, every = spec.optimizer.warmup, spec.output.eval_every
    if warmup > steps:
        lines.append(
            f"--warmup {warmup} is longer than the whole run (--steps {steps}): the learning rate rises for every "
            f"step and never reaches --lr {spec.optimizer.lr:g} (lower --warmup)"
        )
    if every and every > steps:
        lines.append(f"--eval-every {every} is beyond --steps {steps}: no held-out loss is logged during the run")
    return lines


def _write_run_file(spec: RunSpec, out_dir_given: bool) -> None:
    """OUT_DIR/run.yaml; an OSError (a read-only filesystem, a full disk) names the flag that chose OUT_DIR."""
    out = spec.output.out_dir
    try:
        os.makedirs(out, exist_ok=True)
        spec.save(os.path.join(out, RUN_FILE))
    except OSError as e:
        if out_dir_given:
            role = f"--out-dir {out!r}"
        elif spec.checkpoint.checkpoint_dir:
            role = f"the run's output directory {out!r} (--checkpoint-dir's, as no --out-dir is given)"
        else:
            role = f"the run's output directory {out!r} (none given: {RUNS_DIR}/DATE-TIME)"
        raise OSError(f"{role} cannot be written ({e.strerror or e}): give --out-dir a writable directory") from None


def _make_profile_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(
            f"--profile {path!r} cannot be written ({e.strerror or e}): give --profile a writable directory"
        ) from None


def _check_validation_data(trainer: Trainer) -> None:
    """The held-out batches' token ids checked against the vocabulary before the first step (a bad id
    would otherwise surface only at the end, after the whole run)."""
    trainer.task.check_validation_data()


def _fresh_run_dir() -> str:
    """RUNS_DIR/DATE-TIME, with a suffix when that exists already."""
    base = os.path.join(RUNS_DIR, time.strftime("%Y%m%d-%H%M%S"))
    path, i = base, 1
    while os.path.exists(path):
        path, i = f"{base}-{i}", i + 1
    return path


def prepare(spec: RunSpec, device_count: int) -> RunSpec:
    """The spec resolved for `device_count` devices and validated, with its output directory (OUT_DIR: as
    given, else the checkpoint directory, else runs/DATE-TIME) filled in (metrics go to OUT_DIR/metrics.jsonl unless
    --metrics-file says otherwise)."""
    out = spec.output
    if out.out_dir is None:  # filled in before the checks, which read it (e.g. --metrics-file's directory)
        out_dir = spec.checkpoint.checkpoint_dir or _fresh_run_dir()
        spec = dataclasses.replace(spec, output=dataclasses.replace(out, out_dir=out_dir), resolved_for=None)
    return spec.resolved(device_count)  # validated there


def _describe(spec: RunSpec, trainer: Trainer, say: Callable[..., object], estimate: int | None = None):
    """The run's header: model, the plan (mesh, strategies, layout), numerics, batch, data, memory."""
    task = trainer.task
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    mesh, p, t = trainer.plan.mesh, spec.parallel, spec.training
    layout = f", layout={p.layout}" if p.layout and p.sp > 1 else ""
    memory = f" | estimated memory {estimate / 2**30:.2f} GiB per device" if estimate else ""
    m = spec.memory
    kept = (
        f"remat {m.remat}"
        + (f" in blocks of {m.remat_layers} layers" if m.remat_layers > 1 else "")
        + "".join(
            f", {name} {value}"
            for name, value in (("loss tile", m.loss_tile), ("mlp tile", m.mlp_tile), ("offload", m.offload))
            if value is not None and str(value) != "none"
        )
    )
    say(
        f"{spec.model.model} {spec.model.init_from or spec.model.preset}: {n_params / 1e6:.2f}M params | plan: {trainer.plan.describe()}"
        f"{layout} | precision {spec.compute_precision}, {kept} | {mesh.devices.size} x "
        f"{mesh.devices.flat[0].device_kind} | batch {t.batch_size} × {task.tokens_per_step // t.batch_size} "
        f"tokens | data {task.source_name}{memory}"
    )


def _run(
    spec: RunSpec,
    trainer: Trainer,
    ckpt: Checkpointer,
    guard: DivergenceGuard,
    stop: GracefulStop,
    say: Callable[..., object],
    is_main: bool,
) -> list[dict]:
    task = trainer.task
    peak = peak_flops(jax.devices()[0], spec.compute_precision)
    lr = lr_schedule(spec)
    history = []
    metrics = MetricsLog(spec, is_main)
    bar = progress_bar(spec, trainer.step_count, is_main)
    if bar is not None:  # lines between the bar's updates (saves, skips) go above it
        say = _above_bar(bar, say)
    profiling = False
    profile_window = profile_steps(trainer.step_count, spec.training.steps) if spec.output.profile else None
    eval_every, devices = spec.output.eval_every, trainer.plan.mesh.devices.size
    started = time.perf_counter()
    first = True
    try:
        while trainer.step_count < spec.training.steps and not stop.requested():
            step = trainer.step_count
            if profile_window and step == profile_window[0]:
                jax.profiler.start_trace(spec.output.profile)
                profiling = True
            t0 = time.perf_counter()
            # skip mode: the step itself keeps the old state when the loss exceeds the guard's limit (or is
            # not finite, as in every mode), so the guard's "skip" needs no undo here
            limit = guard.limit if guard.mode == "skip" else None
            where = f"at step {step + 1}" + (" (compiling the step)" if first else "")
            with _reporting_out_of_memory(spec, where, devices):
                out, progress = step_metrics(trainer.step(max_loss=limit))  # waits for the step
            dt = time.perf_counter() - t0
            verdict = guard.check(step + 1, out["loss"])
            if verdict is not None and verdict.action == "stop":
                last = f" (newest checkpoint: step {ckpt.latest_step()})" if ckpt and ckpt.all_steps() else ""
                raise Diverged(verdict.message + last)
            if verdict is not None:  # skip: the step kept the old state
                if not out.get("skipped"):
                    raise AssertionError(f"the guard skipped step {step + 1}, but the step applied its update")
                say(verdict.message)
            mfu = None if peak is None else task.flops_per_step() / dt / (peak * jax.device_count())
            record = {
                "step": step + 1,
                "wall_time": time.time(),
                "elapsed_s": time.perf_counter() - started,
                "lr": float(lr(step)),
                "loss": out["loss"],
                **out,
                "tokens_per_s": task.tokens_per_step / dt,
                "mfu": mfu,
                "step_time_s": dt,
                "peak_memory_bytes": peak_memory_bytes(),
                "host_memory_bytes": host_memory_bytes(),
            }
            if first:
                record["compile_s"] = dt  # the first step of the run compiles: its speed is not the run's
                first = False
            if verdict is not None:
                record["skipped"] = True
            if eval_every and (step + 1) % eval_every == 0:
                with _reporting_out_of_memory(spec, f"evaluating the held-out loss at step {step + 1}", devices):
                    record["val_loss"] = trainer.val_loss()
            history.append(record)
            metrics.write(record)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(progress_postfix(record, progress))
            elif is_main and (step + 1) % spec.output.log_every == 0:
                val = f", held-out {record['val_loss']:.4f}" if "val_loss" in record else ""
                say(f"step {step + 1}: loss {record['loss']:.4f}{val}, {record['tokens_per_s']:,.0f} tokens/s")
            if profiling and step + 1 == profile_window[1]:
                jax.profiler.stop_trace()
                profiling = False
                say(f"wrote a profile of steps {profile_window[0] + 1}..{profile_window[1]} to {spec.output.profile}")
            if ckpt is not None:
                ckpt.check()  # a save that failed in the background stops the run here
                every = spec.checkpoint.checkpoint_every
                if every and trainer.step_count % every == 0:
                    _save(ckpt, trainer, guard, say)
    finally:
        if profiling:
            jax.profiler.stop_trace()
        if bar is not None:
            bar.close()
        metrics.close()
    return history


def _above_bar(bar: Any, say: Callable[..., object]):
    """`say` for lines printed while the progress bar is up: through tqdm, above the bar (when `say` is the
    plain print; a caller's own log function is kept)."""
    if say is not print:
        return say
    return lambda *args, **kwargs: bar.write(" ".join(str(a) for a in args))


# ------------------------------------------------------------------------------------------------ checkpoints


def _save(
    ckpt: Checkpointer, trainer: Trainer, guard: DivergenceGuard, say: Callable[..., object] | None = None
) -> bool:
    """Saves the current step (not again if saved) and says so; Diverged if the state holds NaN/Inf (then
    nothing is saved)."""
    metadata = {**trainer.metadata(), "guard": guard.state_dict(), "data": _data_state(trainer)}
    try:
        saved = ckpt.save(trainer.step_count, trainer.state(), metadata=metadata)
    except NonFiniteStateError as e:
        raise Diverged(f"{e}; stopping (newest checkpoint: step {ckpt.latest_step()})") from None
    if saved and say is not None:
        say(f"saving checkpoint step {trainer.step_count} to {ckpt.directory}")
    return saved


def _resume(spec: RunSpec, trainer: Trainer, ckpt: Checkpointer, guard: DivergenceGuard, say: Callable[..., object]):
    if not ckpt.all_steps():  # (e.g. the first save was killed: the steps logged before it run again)
        _drop_metrics_after(spec, 0, say)
        say(f"--resume: no checkpoint in {spec.checkpoint.checkpoint_dir} yet; starting from step 0")
        return
    step, _ = ckpt.newest_intact(lambda s: trainer.restore(ckpt, s), report=say)
    saved = ckpt.metadata(step)
    guard.load_state_dict(saved.get("guard"))
    _restore_data_state(trainer, saved.get("data"), step, say)
    _warn_schedule(spec, saved.get("config") or {}, step, say)
    _drop_metrics_after(spec, step, say)
    say(f"resumed from {spec.checkpoint.checkpoint_dir} at step {trainer.step_count}")


def _drop_metrics_after(spec: RunSpec, step: int, say: Callable[..., object]) -> None:
    """The metrics file's rows after `step` removed: those steps run again, and no step is logged twice."""
    if jax.process_index() == 0:
        dropped = drop_rows_after(spec.output.metrics_path(), step)
        if dropped:
            say(f"dropped {dropped} rows after step {step} from {spec.output.metrics_path()} (those steps run again)")


# ---- the data loader's position (jaxring.data): a JSON dict in the checkpoint's metadata, under "data" (the
# task's `data_state` / `restore_data_state` hooks; models/gpt_train.py keeps one).


def _data_state(trainer: Trainer):
    return trainer.task.data_state()


def _restore_data_state(trainer: Trainer, state: dict | None, step: int, say: Callable[..., object]):
    trainer.task.restore_data_state(state, step, say)


def _warn_schedule(spec: RunSpec, saved: dict, step: int, say: Callable[..., object]):
    """One warning line when the run's schedule or batches differ from the checkpoint's run."""
    now = spec.flat()
    diffs = [
        f"--{k.replace('_', '-')} {saved[k]} -> {now[k]}"
        for k in SCHEDULE_FIELDS
        if k in saved and k in now and saved[k] != now[k]
    ]
    if diffs:
        say(
            f"warning: resuming step {step} with other settings than the run that saved it ({', '.join(diffs)}): "
            f"the learning-rate schedule or the batches change, so the losses differ from one uninterrupted run"
        )


def _stop_on_signal(
    stop: GracefulStop, trainer: Trainer, ckpt: Checkpointer, guard: DivergenceGuard, say: Callable[..., object]
):
    """After a SIGTERM/SIGINT: save this step, wait for every pending save, raise TrainingStopped."""
    signum = stop.signum or signal.SIGTERM  # another process's signal: SIGTERM-like
    name = signal.Signals(signum).name
    if trainer.step_count == 0:  # (stopped while building or compiling: an untrained state is not worth a save)
        message = f"{name}: stopped before the first step; nothing was saved"
    elif ckpt is None:
        message = f"{name}: stopped after step {trainer.step_count}; no --checkpoint-dir, so nothing was saved"
    else:
        _save(ckpt, trainer, guard, say)
        ckpt.wait()
        message = (
            f"{name}: stopped after step {trainer.step_count} and saved it to {ckpt.directory}; continue with --resume"
        )
    say(message)
    raise TrainingStopped(signum, message)
