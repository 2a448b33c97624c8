"""The training loop behind `train.py`: step the trainer, log metrics (loss, tokens/s, MFU), checkpoint.

    history = train(TrainConfig(model="gpt", preset="tiny", sp=8, attention="ring", steps=50))
"""
from __future__ import annotations

import json
import math
import time

import jax

from jaxring.train.checkpoint import Checkpointer
from jaxring.train.config import TrainConfig, check_config, make_plan  # noqa: F401  (re-exported)
from jaxring.train.metrics import peak_flops, peak_memory_bytes, profile_steps, progress_bar
from jaxring.train.trainer import Trainer  # noqa: F401  (re-exported)


def train(cfg: TrainConfig, *, devices=None, log=print) -> list[dict]:
    """Trains; returns the per-step metrics (a dict per step)."""
    trainer = Trainer(cfg, devices)
    is_main = jax.process_index() == 0
    say = log if is_main else (lambda *a, **k: None)
    ckpt = Checkpointer(cfg.checkpoint_dir, keep=cfg.keep_checkpoints) if cfg.checkpoint_dir else None
    if cfg.resume and ckpt is not None and ckpt.latest_step() is not None:
        trainer.restore(ckpt)
        say(f"resumed from {cfg.checkpoint_dir} at step {trainer.step_count}")
    task = trainer.task
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    say(f"{cfg.model} {cfg.preset}: {n_params / 1e6:.2f}M params | {trainer.plan.describe()} | "
        f"{trainer.plan.mesh.devices.size} x {trainer.plan.mesh.devices.flat[0].device_kind} | batch {cfg.batch_size} × "
        f"{task.tokens_per_step // cfg.batch_size} tokens | data {task.source.name}")
    peak = peak_flops(jax.devices()[0], cfg.precision)
    history = []
    metrics_file = open(cfg.metrics_file, "a") if (cfg.metrics_file and is_main) else None
    bar = progress_bar(cfg, trainer.step_count, is_main)
    profiling = False
    profile_window = profile_steps(trainer.step_count, cfg.steps) if cfg.profile else None
    try:
        while trainer.step_count < cfg.steps:
            step = trainer.step_count
            if profile_window and step == profile_window[0]:
                jax.profiler.start_trace(cfg.profile)
                profiling = True
            t0 = time.perf_counter()
            out = trainer.step()
            loss = float(out["loss"])  # waits for the step
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step}; stopping (lower --lr or use fp32)")
            tokens_per_s = task.tokens_per_step / dt
            mfu = None if peak is None else task.flops_per_step() / dt / (peak * jax.device_count())
            record = {"step": step + 1, "loss": loss, "grad_norm": float(out["grad_norm"]),
                      "tokens_per_s": tokens_per_s, "mfu": mfu, "step_time_s": dt,
                      "peak_memory_bytes": peak_memory_bytes()}
            history.append(record)
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}",
                                mfu="n/a" if mfu is None else f"{100 * mfu:.1f}%")
            elif is_main and (step + 1) % cfg.log_every == 0:
                say(f"step {step + 1}: loss {loss:.4f}, {tokens_per_s:,.0f} tokens/s")
            if profiling and step + 1 == profile_window[1]:
                jax.profiler.stop_trace()
                profiling = False
                say(f"wrote a profile of steps {profile_window[0] + 1}..{profile_window[1]} to {cfg.profile}")
            if ckpt is not None and cfg.checkpoint_every and trainer.step_count % cfg.checkpoint_every == 0:
                ckpt.save(trainer.step_count, trainer.state(), metadata=trainer.metadata())
    finally:
        if profiling:
            jax.profiler.stop_trace()
        if bar is not None:
            bar.close()
        if metrics_file:
            metrics_file.close()
    if ckpt is not None:
        ckpt.save(trainer.step_count, trainer.state(), metadata=trainer.metadata())
        ckpt.close()
    if history and cfg.eval_at_end:
        say(f"final loss {history[-1]['loss']:.4f}; held-out loss {trainer.val_loss():.4f}")
    if is_main and cfg.sample_tokens:
        task.finish(trainer.model(), say)
    return history
