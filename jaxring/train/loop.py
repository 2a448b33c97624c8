"""The training loop behind `train.py`: a plan from mesh flags, a GPT or DiT task, optax AdamW, orbax
checkpoints, metrics (loss, tokens/s, MFU) and a progress bar.

    history = train(TrainConfig(model="gpt", preset="tiny", sp=8, attention="ring", steps=50))
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxring.mesh import make_mesh
from jaxring.nn import param_shardings
from jaxring.plan import ParallelPlan
from jaxring.train.checkpoint import Checkpointer
from jaxring.train.data import ImageBatches, TokenBatches, load_images, load_tokens

PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
REMAT = ("none", "selective", "full")
# dense bf16 (fp32: TF32) peak FLOP/s per device, by jax device_kind substring
PEAK_FLOPS = {"H200": (989e12, 495e12), "H100": (989e12, 495e12), "A100": (312e12, 156e12),
              "L4": (121e12, 60e12), "A10": (125e12, 62e12), "TPU v5p": (459e12, 459e12),
              "TPU v5 lite": (197e12, 197e12), "TPU v4": (275e12, 275e12)}


@dataclasses.dataclass
class TrainConfig:
    model: str = "gpt"
    preset: str = "tiny"
    steps: int = 200
    seed: int = 0
    batch_size: int = 8
    seq_len: int | None = None        # GPT only (default 256)
    model_overrides: dict = dataclasses.field(default_factory=dict)  # preset fields to change, e.g. num_layers
    image_size: int | None = None     # DiT only (default: the preset's)
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    grad_accum: int = 1
    # mesh and strategies
    dp: int = 1
    fsdp: int = 1
    pp: int = 1
    tp: int = 1
    sp: int = 1
    attention: str | None = None      # default: ring when sp > 1, else dense
    layout: str | None = None
    team_size: int | None = None
    ulysses_size: int | None = None
    tensor_parallel: str | None = None
    # numerics and memory
    precision: str = "fp32"
    remat: str = "none"
    # output
    data: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    metrics_file: str | None = None
    profile: str | None = None
    log_every: int = 10
    sample_tokens: int = 200          # GPT: tokens generated at the end; DiT: 0 skips the sample grid
    eval_at_end: bool = True          # report the held-out loss after training
    sample_path: str = "samples.png"
    progress: bool = True


def check_config(cfg: TrainConfig) -> None:
    if cfg.model not in ("gpt", "dit"):
        raise ValueError(f"unknown model {cfg.model!r}; expected gpt or dit")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {cfg.precision!r}; expected one of {', '.join(PRECISIONS)}")
    if cfg.remat not in REMAT:
        raise ValueError(f"unknown remat {cfg.remat!r}; expected one of {', '.join(REMAT)}")
    for name in ("steps", "batch_size", "grad_accum", "dp", "fsdp", "pp", "tp", "sp"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value!r} must be a positive integer")
    if cfg.batch_size % cfg.grad_accum:
        raise ValueError(f"batch size {cfg.batch_size} is not divisible by grad-accum {cfg.grad_accum}")
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if cfg.data is not None and not os.path.exists(cfg.data):
        raise FileNotFoundError(f"--data {cfg.data!r} does not exist")


def make_plan(cfg: TrainConfig, devices=None) -> ParallelPlan:
    """The mesh (degrees must multiply to the device count) and the strategy for each axis."""
    mesh = make_mesh(dp=cfg.dp, fsdp=cfg.fsdp, pp=cfg.pp, tp=cfg.tp, sp=cfg.sp, devices=devices)
    attention = cfg.attention or ("ring" if cfg.sp > 1 else "dense")
    return ParallelPlan(mesh, attention=attention, layout=cfg.layout, team_size=cfg.team_size,
                        ulysses_size=cfg.ulysses_size, tensor_parallel=cfg.tensor_parallel)


# ---------------------------------------------------------------------------------------------- tasks

def _global_array(plan: ParallelPlan, sharding, global_shape, local_rows, row0):
    """A global array from this host's rows [row0, row0 + len(local_rows)) of the global batch."""
    def part(index):
        rows = index[0]
        start = (rows.start or 0) - row0
        stop = (rows.stop if rows.stop is not None else global_shape[0]) - row0
        return local_rows[(slice(start, stop),) + tuple(index[1:])]
    return jax.make_array_from_callback(global_shape, sharding, part)


def _host_rows(sharding, global_shape):
    """The contiguous range of global batch rows this host's devices hold."""
    rows = [idx[0] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    lo = min(r.start or 0 for r in rows)
    hi = max(r.stop if r.stop is not None else global_shape[0] for r in rows)
    return lo, hi


class GPTTask:
    kind = "gpt"
    causal = True

    def __init__(self, cfg: TrainConfig, plan: ParallelPlan):
        from models import gpt
        self.gpt = gpt
        self.seq_len = cfg.seq_len or 256
        self.source = load_tokens(cfg.data)
        overrides = {"vocab_size": self.source.vocab_size}
        base = gpt.get_config(cfg.preset, **cfg.model_overrides)
        if base.positions == "learned":
            overrides["max_seq_len"] = max(base.max_seq_len, self.seq_len)
        if base.vocab_size > self.source.vocab_size:
            overrides.pop("vocab_size")  # keep the preset's (padded) vocabulary
        self.config = gpt.get_config(cfg.preset, **{**cfg.model_overrides, **overrides})
        plan.check_batch(cfg.batch_size // cfg.grad_accum, "micro-batch size (batch / grad-accum)")
        plan.check_seq_len(self.seq_len, self.causal)
        self.plan, self.cfg = plan, cfg
        self.sharding = plan.tokens_sharding()
        shape = (cfg.batch_size, self.seq_len)
        self.row0, row1 = _host_rows(self.sharding, shape)
        per_host = row1 - self.row0
        host, hosts = self.row0 // per_host, cfg.batch_size // per_host
        self.batches = TokenBatches(self.source, batch_size=cfg.batch_size, seq_len=self.seq_len, seed=cfg.seed,
                                    process_index=host, process_count=hosts)
        self.val_batches = TokenBatches(load_tokens(cfg.data, split="val"), batch_size=cfg.batch_size,
                                        seq_len=self.seq_len, seed=cfg.seed + 1, process_index=host,
                                        process_count=hosts)

    def model(self, seed):
        return self.gpt.GPT(self.config, rngs=nnx.Rngs(seed))

    def metadata(self):
        return {"kind": "gpt", **dataclasses.asdict(self.config)}

    def batch(self, step, val=False):
        rows = (self.val_batches if val else self.batches).get(step)
        (tokens, targets), positions = self.plan.layout_tokens(rows[:, :-1], rows[:, 1:], causal=self.causal)
        positions = np.broadcast_to(positions, tokens.shape)
        shape = (self.cfg.batch_size, self.seq_len)
        return {name: _global_array(self.plan, self.sharding, shape, np.ascontiguousarray(a), self.row0)
                for name, a in (("tokens", tokens), ("targets", targets), ("positions", positions))}

    def loss(self, model, batch, key, dtype, remat):
        del key
        return model.loss(batch["tokens"], batch["targets"], batch["positions"], self.plan, dtype=dtype,
                          remat=remat)

    @property
    def tokens_per_step(self):
        return self.cfg.batch_size * self.seq_len

    def flops_per_step(self):
        return self.config.flops_per_token(self.seq_len, causal=True) * self.tokens_per_step

    def finish(self, model, log):
        """A generated sample from the trained model, on one device."""
        one = ParallelPlan(make_mesh(devices=jax.devices()[:1]))
        single = nnx.merge(*_to_device(nnx.split(model), jax.devices()[0]))
        prompt = self.source.encode("def ")
        ids = self.gpt.generate(single, one, list(prompt), self.cfg.sample_tokens, key=jax.random.PRNGKey(0),
                                window=min(self.seq_len, 256))
        text = self.source.decode(list(prompt) + ids)
        log(f"--- sample ---\n{text}\n--------------")
        return {"sample": text}


class DiTTask:
    kind = "dit"
    causal = False

    def __init__(self, cfg: TrainConfig, plan: ParallelPlan):
        from models import dit
        self.dit = dit
        base = dit.get_config(cfg.preset, **cfg.model_overrides)
        self.source = load_images(cfg.data, image_size=cfg.image_size or base.image_size)
        self.config = dit.get_config(cfg.preset, **{**cfg.model_overrides, "image_size": cfg.image_size or base.image_size},
                                     channels=self.source.images.shape[-1], num_classes=self.source.num_classes)
        plan.check_batch(cfg.batch_size // cfg.grad_accum, "micro-batch size (batch / grad-accum)")
        plan.check_seq_len(self.config.num_tokens, self.causal)
        self.plan, self.cfg = plan, cfg
        img_shape = (cfg.batch_size,) + self.source.images.shape[1:]
        self.img_sharding = plan.sharding(plan.batch_axes, None, None, None)
        self.label_sharding = plan.sharding(plan.batch_axes)
        self.row0, row1 = _host_rows(self.label_sharding, (cfg.batch_size,))
        per_host = row1 - self.row0
        self.batches = ImageBatches(self.source, batch_size=cfg.batch_size, seed=cfg.seed,
                                    process_index=self.row0 // per_host, process_count=cfg.batch_size // per_host)
        self.img_shape = img_shape

    def model(self, seed):
        return self.dit.DiT(self.config, rngs=nnx.Rngs(seed))

    def metadata(self):
        return {"kind": "dit", **dataclasses.asdict(self.config)}

    def batch(self, step, val=False):
        images, labels = self.batches.get(step + (10 ** 6 if val else 0))
        return {"images": _global_array(self.plan, self.img_sharding, self.img_shape, images, self.row0),
                "labels": _global_array(self.plan, self.label_sharding, (self.cfg.batch_size,), labels, self.row0)}

    def loss(self, model, batch, key, dtype, remat):
        return model.loss(batch["images"], batch["labels"], key, self.plan, dtype=dtype, remat=remat)

    @property
    def tokens_per_step(self):
        return self.cfg.batch_size * self.config.num_tokens

    def flops_per_step(self):
        return self.config.flops_per_image() * self.cfg.batch_size

    def finish(self, model, log):
        labels = jnp.arange(16) % self.config.num_classes
        one = ParallelPlan(make_mesh(devices=jax.devices()[:1]))
        single = nnx.merge(*_to_device(nnx.split(model), jax.devices()[0]))
        images = self.dit.sample(single, one, labels, jax.random.PRNGKey(0))
        self.dit.save_image_grid(np.asarray(images), self.cfg.sample_path, nrow=4)
        log(f"wrote {len(labels)} samples to {self.cfg.sample_path}")
        return {"samples": self.cfg.sample_path}


def _to_device(split, device):
    graphdef, state = split
    state = jax.tree.map(lambda x: jax.device_put(_fully_replicated(x), device), state)
    return graphdef, state


def _fully_replicated(x):
    """A host copy of a (possibly multi-host) global array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(x, tiled=True)
    return x


TASKS = {"gpt": GPTTask, "dit": DiTTask}


# ------------------------------------------------------------------------------------------- training

def optimizer(cfg: TrainConfig):
    """AdamW with linear warmup and cosine decay to min_lr_ratio·lr, after global-norm clipping."""
    warmup = min(cfg.warmup, cfg.steps)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1),
                                                  end_value=cfg.lr * cfg.min_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(cfg.clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))


class Trainer:
    """Holds the plan, task, parameters and optimizer state; `step()` runs one jitted update."""

    def __init__(self, cfg: TrainConfig, devices=None):
        check_config(cfg)
        self.cfg = cfg
        self.plan = make_plan(cfg, devices)
        self.task = TASKS[cfg.model](cfg, self.plan)
        self.dtype = PRECISIONS[cfg.precision]
        self.tx = optimizer(cfg)
        model = self.task.model(cfg.seed)
        self.graphdef, state = nnx.split(model)
        self.shardings = param_shardings(state, self.plan)
        host_params = nnx.to_pure_dict(state)
        # the same seed gives the same values on any mesh: built on the host, then placed
        self.params = jax.tree.map(lambda x, s: jax.device_put(x, s), host_params, self.shardings)
        # optimizer moments sharded like their parameters, scalars (step counts) replicated on the mesh
        replicated = self.plan.sharding()
        self.opt_shardings = optax.tree_map_params(
            self.tx, lambda _, sharding: sharding, jax.eval_shape(self.tx.init, self.params), self.shardings,
            transform_non_params=lambda _: replicated)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)
        self._step = jax.jit(self._train_step, donate_argnums=(0, 1),
                             out_shardings=(self.shardings, self.opt_shardings, replicated))
        self._eval = jax.jit(self._eval_loss)
        self.step_count = 0

    # --- jitted bodies
    def _loss(self, params, batch, key):
        model = nnx.merge(self.graphdef, params)
        return self.task.loss(model, batch, key, self.dtype, self.cfg.remat)

    def _train_step(self, params, opt_state, batch, key):
        accum = self.cfg.grad_accum
        grad_fn = jax.value_and_grad(self._loss)
        if accum == 1:
            loss, grads = grad_fn(params, batch, key)
        else:
            micro = jax.tree.map(lambda x: x.reshape((accum, x.shape[0] // accum) + x.shape[1:]), batch)

            def body(carry, inputs):
                mb, k = inputs
                loss, grads = grad_fn(params, mb, k)
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(body, zeros, (micro, jax.random.split(key, accum)))
            loss, grads = jax.tree.map(lambda x: x / accum, (loss, grads))
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        params = jax.tree.map(jax.lax.with_sharding_constraint, params, self.shardings)
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    def _eval_loss(self, params, batch, key):
        return self._loss(params, batch, key)

    # --- host side
    def key(self, step):
        return jax.random.fold_in(jax.random.PRNGKey(self.cfg.seed), step)

    def step(self):
        batch = self.task.batch(self.step_count)
        self.params, self.opt_state, out = self._step(self.params, self.opt_state, batch, self.key(self.step_count))
        self.step_count += 1
        return out

    def val_loss(self):
        return float(self._eval(self.params, self.task.batch(0, val=True), self.key(2 ** 31 - 1)))

    def model(self):
        return nnx.merge(self.graphdef, self.params)

    # --- checkpoints
    def state(self):
        return {"params": self.params, "opt_state": self.opt_state}

    def metadata(self):
        return {"model": self.task.metadata(), "mesh": self.plan.describe(), "config": dataclasses.asdict(self.cfg)}

    def restore(self, ckpt: Checkpointer, step=None):
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state())
        step = ckpt.latest_step() if step is None else step
        state = ckpt.restore(step, target, expected_metadata={"model": self.task.metadata()})
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.step_count = step


def peak_flops(device, precision: str):
    """Per-device peak FLOP/s for MFU, or None (CPU, unknown device)."""
    kind = getattr(device, "device_kind", "")
    for name, (bf16, fp32) in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return bf16 if precision == "bf16" else fp32
    return None


def _peak_memory():
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


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
    bar = _progress(cfg, trainer.step_count, is_main)
    profiling = False
    try:
        while trainer.step_count < cfg.steps:
            step = trainer.step_count
            if cfg.profile and step == min(trainer.step_count + 2, cfg.steps - 1) and not profiling:
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
                      "peak_memory_bytes": _peak_memory()}
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
            if profiling and step >= 4:
                jax.profiler.stop_trace()
                profiling = False
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


def _progress(cfg, start, is_main):
    if not (cfg.progress and is_main):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=cfg.steps, initial=start, desc="train", dynamic_ncols=True)
