"""The training loop behind `train.py`: step the trainer, log metrics (loss, tokens/s, MFU), checkpoint.

    history = train(TrainConfig(model="gpt", preset="tiny", sp=8, attention="ring", steps=50))

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
import signal
import time

import jax

from jaxring.train.checkpoint import Checkpointer, DamagedCheckpointError, NonFiniteStateError  # noqa: F401
from jaxring.train.config import TrainConfig, check_config, make_plan  # noqa: F401  (re-exported)
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
)


def train(
    cfg: TrainConfig, *, devices=None, log=print, guard: DivergenceGuard | None = None, signals=SIGNALS
) -> list[dict]:
    """Trains; returns the per-step metrics (a dict per step: every metric the step returns, plus timing).

    guard: the divergence guard (default: stop on a non-finite loss or a 3x spike). signals: the signals
    that stop training gracefully (() leaves the process's handlers alone).
    """
    guard = guard if guard is not None else DivergenceGuard()
    is_main = jax.process_index() == 0
    say = log if is_main else (lambda *a, **k: None)
    with GracefulStop(signals) as stop:
        check_config(cfg)
        ckpt = Checkpointer(cfg.checkpoint_dir, keep=cfg.keep_checkpoints) if cfg.checkpoint_dir else None
        try:
            if ckpt is not None and not cfg.resume and ckpt.all_steps():
                raise ValueError(
                    f"--checkpoint-dir {cfg.checkpoint_dir!r} already holds checkpoints (steps "
                    f"{ckpt.all_steps()}); pass --resume to continue from them, or use another "
                    f"directory"
                )
            trainer = Trainer(cfg, devices)
            if cfg.resume:
                _resume(cfg, trainer, ckpt, guard, say)
            if trainer.step_count >= cfg.steps:
                say(
                    f"nothing to run: the checkpoint is at step {trainer.step_count}, --steps is {cfg.steps} "
                    f"(raise --steps to train further)"
                )
                return []
            _describe(cfg, trainer, say)
            history = _run(cfg, trainer, ckpt, guard, stop, say, is_main)
            if stop.requested():
                _stop_on_signal(stop, trainer, ckpt, guard, say)
            if ckpt is not None:
                _save(ckpt, trainer, guard)
        finally:
            if ckpt is not None:
                ckpt.close()  # waits for pending saves, also when stopping on an error
    if history and cfg.eval_at_end:
        say(f"final loss {history[-1]['loss']:.4f}; held-out loss {trainer.val_loss():.4f}")
    if is_main and cfg.sample_tokens:
        trainer.task.finish(trainer.model(), say)
    return history


def _describe(cfg, trainer, say):
    task = trainer.task
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    mesh = trainer.plan.mesh
    say(
        f"{cfg.model} {cfg.preset}: {n_params / 1e6:.2f}M params | {trainer.plan.describe()} | "
        f"{mesh.devices.size} x {mesh.devices.flat[0].device_kind} | batch {cfg.batch_size} × "
        f"{task.tokens_per_step // cfg.batch_size} tokens | data {task.source.name}"
    )


def _run(cfg, trainer, ckpt, guard, stop, say, is_main) -> list[dict]:
    task = trainer.task
    peak = peak_flops(jax.devices()[0], cfg.precision)
    history = []
    metrics_file = open(cfg.metrics_file, "a") if (cfg.metrics_file and is_main) else None
    bar = progress_bar(cfg, trainer.step_count, is_main)
    profiling = False
    profile_window = profile_steps(trainer.step_count, cfg.steps) if cfg.profile else None
    try:
        while trainer.step_count < cfg.steps and not stop.requested():
            step = trainer.step_count
            if profile_window and step == profile_window[0]:
                jax.profiler.start_trace(cfg.profile)
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
            elif is_main and (step + 1) % cfg.log_every == 0:
                say(f"step {step + 1}: loss {record['loss']:.4f}, {record['tokens_per_s']:,.0f} tokens/s")
            if profiling and step + 1 == profile_window[1]:
                jax.profiler.stop_trace()
                profiling = False
                say(f"wrote a profile of steps {profile_window[0] + 1}..{profile_window[1]} to {cfg.profile}")
            if ckpt is not None and cfg.checkpoint_every and trainer.step_count % cfg.checkpoint_every == 0:
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
    metadata = {**trainer.metadata(), "guard": guard.state_dict()}
    try:
        return ckpt.save(trainer.step_count, trainer.state(), metadata=metadata)
    except NonFiniteStateError as e:
        raise Diverged(f"{e}; stopping (newest checkpoint: step {ckpt.latest_step()})") from None


def _resume(cfg, trainer, ckpt, guard, say):
    if not ckpt.all_steps():
        say(f"--resume: no checkpoint in {cfg.checkpoint_dir} yet; starting from step 0")
        return
    step, _ = ckpt.newest_intact(lambda s: trainer.restore(ckpt, s), report=say)
    saved = ckpt.metadata(step)
    guard.load_state_dict(saved.get("guard"))
    _warn_schedule(cfg, saved.get("config") or {}, step, say)
    if cfg.metrics_file and jax.process_index() == 0:
        dropped = drop_rows_after(cfg.metrics_file, step)
        if dropped:
            say(f"dropped {dropped} rows after step {step} from {cfg.metrics_file} (those steps run again)")
    say(f"resumed from {cfg.checkpoint_dir} at step {trainer.step_count}")


def _warn_schedule(cfg, saved: dict, step: int, say):
    """One warning line when the run's schedule or batches differ from the checkpoint's run."""
    now = dataclasses.asdict(cfg)
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
