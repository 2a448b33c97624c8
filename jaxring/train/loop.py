"""The training loop behind `train.py`: step the trainer, log metrics (loss, tokens/s, MFU), checkpoint.

    history = train(RunSpec.of(model="gpt", preset="tiny", sp=8, attention="ring", steps=50))

The run's resolved specification is written to OUT_DIR/run.yaml before the first step (`--config` of it
repeats the run); metrics go to OUT_DIR/metrics.jsonl unless --metrics-file says otherwise.

Failures end in one exception, each with a one-line message (train.py turns them into exit codes):
  * ValueError / FileNotFoundError: a bad setting, data or checkpoint directory (before any step runs).
  * `Diverged`: the loss went non-finite or spiked (see guard.py), or the state to save holds NaN/Inf; the
    bad state is never saved, the last checkpoint stays the newest.
  * `Interrupted`: SIGTERM/SIGINT; the current step was finished, saved (with a checkpoint directory) and
    every pending save waited for. A second signal exits at once.
On resume, a damaged newest checkpoint is reported and the newest intact one used.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time

import jax

from jaxring.spec import RunSpec
from jaxring.train.checkpoint import Checkpointer, NonFiniteStateError
from jaxring.train.guard import Diverged, DivergenceGuard
from jaxring.train.metrics import (
    drop_rows_after,
    peak_flops,
    peak_memory_bytes,
    profile_steps,
    progress_bar,
    progress_postfix,
    step_metrics,
)
from jaxring.train.signals import SIGNALS, GracefulStop, Interrupted
from jaxring.train.trainer import Trainer

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


def train(
    spec: RunSpec, *, devices=None, log=print, guard: DivergenceGuard | None = None, signals=SIGNALS
) -> list[dict]:
    """Trains; returns the per-step metrics (a dict per step: every metric the step returns, plus timing).

    spec: the run (resolved here for the devices); devices: default `jax.devices()`. guard: the divergence
    guard (default: the spec's). signals: the signals that stop training gracefully (() leaves the process's
    handlers alone).
    """
    devices = list(jax.devices() if devices is None else devices)
    spec = prepare(spec, len(devices))
    if guard is None:
        g = spec.guard
        guard = DivergenceGuard(g.on_divergence, g.spike_factor, g.spike_window)
    is_main = jax.process_index() == 0
    say = log if is_main else (lambda *a, **k: None)
    history = []
    with GracefulStop(signals) as stop:
        c = spec.checkpoint
        ckpt = Checkpointer(c.checkpoint_dir, keep=c.keep_checkpoints) if c.checkpoint_dir else None
        try:
            if ckpt is not None and not c.resume and ckpt.all_steps():
                raise ValueError(
                    f"--checkpoint-dir {c.checkpoint_dir!r} already holds checkpoints (steps {ckpt.all_steps()}); "
                    f"pass --resume to continue from them, or use another directory"
                )
            trainer = Trainer(spec, devices)
            if is_main:
                os.makedirs(spec.output.out_dir, exist_ok=True)
                spec.save(os.path.join(spec.output.out_dir, RUN_FILE))
            if c.resume:
                _resume(spec, trainer, ckpt, guard, say)
            if trainer.step_count >= spec.training.steps:
                say(
                    f"nothing to run: the checkpoint is at step {trainer.step_count}, --steps is "
                    f"{spec.training.steps} (raise --steps to train further)"
                )
                return []
            _describe(spec, trainer, say)
            history = _run(spec, trainer, ckpt, guard, stop, say, is_main)
            if stop.requested():
                _stop_on_signal(stop, trainer, ckpt, guard, say)
            if ckpt is not None:
                _save(ckpt, trainer, guard)
        finally:
            if ckpt is not None:
                ckpt.close()  # waits for pending saves, also when stopping on an error
    if history and spec.output.eval_at_end:
        say(f"final loss {history[-1]['loss']:.4f}; held-out loss {trainer.val_loss():.4f}")
    if is_main and spec.output.sample_tokens:
        trainer.task.finish(trainer.model(), say, spec.output.out_dir)
    return history


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
    spec = spec.resolved(device_count)
    spec.validate()
    out = spec.output
    out_dir = out.out_dir or spec.checkpoint.checkpoint_dir or _fresh_run_dir()
    return dataclasses.replace(spec, output=dataclasses.replace(out, out_dir=out_dir))


def _describe(spec, trainer, say):
    task = trainer.task
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    mesh = trainer.plan.mesh
    say(
        f"{spec.model.model} {spec.model.preset}: {n_params / 1e6:.2f}M params | {trainer.plan.describe()} | "
        f"{mesh.devices.size} x {mesh.devices.flat[0].device_kind} | batch {spec.training.batch_size} × "
        f"{task.tokens_per_step // spec.training.batch_size} tokens | data {task.source_name}"
    )


def _run(spec, trainer, ckpt, guard, stop, say, is_main) -> list[dict]:
    task = trainer.task
    peak = peak_flops(jax.devices()[0], spec.training.precision)
    history = []
    metrics_file = open(spec.output.metrics_path(), "a") if is_main else None
    bar = progress_bar(spec, trainer.step_count, is_main)
    profiling = False
    profile_window = profile_steps(trainer.step_count, spec.training.steps) if spec.output.profile else None
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
            metrics, progress = step_metrics(trainer.step(max_loss=limit))  # waits for the step
            dt = time.perf_counter() - t0
            verdict = guard.check(step + 1, metrics["loss"])
            if verdict is not None and verdict.action == "stop":
                last = f" (newest checkpoint: step {ckpt.latest_step()})" if ckpt and ckpt.all_steps() else ""
                raise Diverged(verdict.message + last)
            if verdict is not None:  # skip: the step kept the old state
                if not metrics.get("skipped"):
                    raise AssertionError(f"the guard skipped step {step + 1}, but the step applied its update")
                say(verdict.message)
            mfu = None if peak is None else task.flops_per_step() / dt / (peak * jax.device_count())
            record = {
                "step": step + 1,
                "loss": metrics["loss"],
                **metrics,
                "tokens_per_s": task.tokens_per_step / dt,
                "mfu": mfu,
                "step_time_s": dt,
                "peak_memory_bytes": peak_memory_bytes(),
            }
            if verdict is not None:
                record["skipped"] = True
            history.append(record)
            if metrics_file:
                metrics_file.write(json.dumps(_json_safe(record)) + "\n")
                metrics_file.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(progress_postfix(record, progress))
            elif is_main and (step + 1) % spec.output.log_every == 0:
                say(f"step {step + 1}: loss {record['loss']:.4f}, {record['tokens_per_s']:,.0f} tokens/s")
            if profiling and step + 1 == profile_window[1]:
                jax.profiler.stop_trace()
                profiling = False
                say(f"wrote a profile of steps {profile_window[0] + 1}..{profile_window[1]} to {spec.output.profile}")
            if (
                ckpt is not None
                and spec.checkpoint.checkpoint_every
                and trainer.step_count % spec.checkpoint.checkpoint_every == 0
            ):
                _save(ckpt, trainer, guard)
    finally:
        if profiling:
            jax.profiler.stop_trace()
        if bar is not None:
            bar.close()
        if metrics_file:
            metrics_file.close()
    return history


# ------------------------------------------------------------------------------------------------ checkpoints


def _save(ckpt, trainer, guard) -> bool:
    """Saves the current step (not again if saved); Diverged if the state holds NaN/Inf (then nothing is saved)."""
    metadata = {**trainer.metadata(), "guard": guard.state_dict(), "data": _data_state(trainer)}
    try:
        return ckpt.save(trainer.step_count, trainer.state(), metadata=metadata)
    except NonFiniteStateError as e:
        raise Diverged(f"{e}; stopping (newest checkpoint: step {ckpt.latest_step()})") from None


def _resume(spec, trainer, ckpt, guard, say):
    if not ckpt.all_steps():
        say(f"--resume: no checkpoint in {spec.checkpoint.checkpoint_dir} yet; starting from step 0")
        return
    step, _ = ckpt.newest_intact(lambda s: trainer.restore(ckpt, s), report=say)
    saved = ckpt.metadata(step)
    guard.load_state_dict(saved.get("guard"))
    _restore_data_state(trainer, saved.get("data"), step, say)
    _warn_schedule(spec, saved.get("config") or {}, step, say)
    if jax.process_index() == 0:
        dropped = drop_rows_after(spec.output.metrics_path(), step)
        if dropped:
            say(f"dropped {dropped} rows after step {step} from {spec.output.metrics_path()} (those steps run again)")
    say(f"resumed from {spec.checkpoint.checkpoint_dir} at step {trainer.step_count}")


# ---- the data loader's position (jaxring.data): a JSON dict in the checkpoint's metadata, under "data". A task
# that keeps one has data_state() -> dict | None and restore_data_state(state, step, log) (models/gpt_train.py).


def _data_state(trainer):
    get = getattr(trainer.task, "data_state", None)
    return None if get is None else get()


def _restore_data_state(trainer, state, step: int, say):
    restore = getattr(trainer.task, "restore_data_state", None)
    if restore is not None:
        restore(state, step, say)


def _warn_schedule(spec, saved: dict, step: int, say):
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


def _stop_on_signal(stop, trainer, ckpt, guard, say):
    """After a SIGTERM/SIGINT: save this step, wait for every pending save, raise Interrupted."""
    signum = stop.signum or signal.SIGTERM  # another process's signal: SIGTERM-like
    name = signal.Signals(signum).name
    if ckpt is None:
        message = f"{name}: stopped after step {trainer.step_count}; no --checkpoint-dir, so nothing was saved"
    else:
        _save(ckpt, trainer, guard)
        ckpt.wait()
        message = (
            f"{name}: stopped after step {trainer.step_count} and saved it to {ckpt.directory}; continue with --resume"
        )
    say(message)
    raise Interrupted(signum, message)


def _json_safe(record: dict) -> dict:
    """NaN/Inf as null (JSON has no NaN)."""

    def fix(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return {k: fix(v) for k, v in record.items()}
