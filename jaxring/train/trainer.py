"""The trainer: parameters and optimizer state on the plan's mesh, and the jitted update step.

    trainer = Trainer(TrainConfig(sp=8, steps=10))
    out = trainer.step()          # {"loss", "grad_norm"}, device arrays
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxring.nn import param_shardings
from jaxring.train.checkpoint import Checkpointer
from jaxring.train.config import PRECISIONS, TrainConfig, check_config, make_plan
from jaxring.train.tasks import TASKS

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
