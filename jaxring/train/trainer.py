"""The trainer: parameters and optimizer state on the plan's mesh, and the jitted update step.

trainer = Trainer(RunSpec.of(sp=8, steps=10))
out = trainer.step()          # {"loss", "grad_norm"}, device arrays
trainer.loop_state            # LoopState(step=1, params, opt_state): what the loop carries
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxring.core.precision import compute_dtype
from jaxring.run.spec import RunSpec
from jaxring.run.task import model_family
from jaxring.train.checkpoint import Checkpointer
from jaxring.train.loop_state import LoopState
from jaxring.train.step import TrainStep


def lr_schedule(spec: RunSpec) -> optax.Schedule:
    """step -> learning rate: linear warmup, then cosine decay to min_lr_ratio·lr."""
    cfg, steps = spec.optimizer, spec.training.steps
    warmup = min(cfg.warmup, steps)
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup, max(steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio
    )


def optimizer(spec: RunSpec) -> optax.GradientTransformation:
    """AdamW on `lr_schedule`. Clipping by the global norm is done by the step itself (`TrainStep`), which
    sees the sharded gradients whole."""
    cfg = spec.optimizer
    return optax.adamw(lr_schedule(spec), b1=0.9, b2=0.95, weight_decay=cfg.weight_decay)


# Checkpoints record how parameters are laid out; an older layout is refused with a clear message.
PARAM_LAYOUT = "stacked-layers-v1"


class Trainer:
    """Holds the plan, task, parameters and optimizer state; `step()` runs one jitted update (one SPMD
    program over the whole mesh: `jaxring.train.step.TrainStep`)."""

    def __init__(self, spec: RunSpec, devices: Sequence[jax.Device] | None = None):
        """spec: the run (resolved and validated for the devices here, unless `prepare` did); devices: default
        `jax.devices()`."""
        devices = list(jax.devices() if devices is None else devices)
        spec = spec.resolved(len(devices))
        self.spec = spec
        self.plan = spec.plan(devices)
        self.task = model_family(spec.model.model).task(spec, self.plan)
        self.dtype = compute_dtype(spec.compute_precision)
        self.tx = optimizer(spec)
        model = self.task.model(spec.training.seed)
        self.train_step = TrainStep(
            self.plan,
            model,
            self.tx,
            self.task.objective,
            memory=spec.memory.policy,
            dtype=self.dtype,
            grad_accum=spec.training.grad_accum,
            clip=spec.optimizer.clip,
        )
        self.graphdef, self.placements = self.train_step.graphdef, self.train_step.placements
        state = nnx.state(model)
        self.shardings = self.train_step.param_shardings()
        host_params = nnx.to_pure_dict(state)
        # interleaved pipelines keep the layer stack in pipeline order (each pp rank's chunks together);
        # checkpoints and model() see the natural order
        self.stack = model.STACK
        self.layer_order = self.plan.layer_order(jax.tree.leaves(host_params[self.stack])[0].shape[0])
        if self.layer_order is not None:
            host_params = {
                **host_params,
                self.stack: jax.tree.map(lambda a: a[self.layer_order], host_params[self.stack]),
            }
        # the same seed gives the same values on any mesh: built on the host, then placed
        params = jax.tree.map(lambda x, s: jax.device_put(x, s), host_params, self.shardings)
        self.opt_specs = self.train_step.opt_state_specs(params)
        self.opt_shardings = self.train_step.opt_state_shardings(self.opt_specs)
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
        # what the loop carries from step to step, as one value (the step, the weights, the optimizer state)
        self.loop_state = LoopState(0, params, opt_state)
        self._step = self.train_step.build(self.opt_specs)
        self._eval = self.train_step.build_eval()

    # --- the loop's state (`loop_state`), by its parts
    @property
    def step_count(self) -> int:
        """The updates done."""
        return self.loop_state.step

    @property
    def params(self) -> dict:
        """The weights as stored between steps (the plan's layer order)."""
        return self.loop_state.params

    @params.setter
    def params(self, params: dict) -> None:
        self.loop_state = dataclasses.replace(self.loop_state, params=params)

    @property
    def opt_state(self) -> optax.OptState:
        """The optimizer state as stored between steps (the plan's layer order)."""
        return self.loop_state.opt_state

    # --- host side
    def key(self, step: int) -> jax.Array:
        return jax.random.fold_in(jax.random.PRNGKey(self.spec.training.seed), step)

    def step(self, max_loss: float | None = None) -> dict:
        """One update; returns its metrics (device scalars). The update is skipped inside the step (the state
        stays as it was, metrics["skipped"] is true) when the loss is not finite or exceeds max_loss."""
        state = self.loop_state
        batch = self.task.batch(state.step)
        limit = jnp.float32(jnp.inf if max_loss is None else max_loss)
        params, opt_state, out = self._step(state.params, state.opt_state, batch, self.key(state.step), limit)
        self.loop_state = state.advanced(params, opt_state)
        return {**out, "progress": self.task.progress}

    def lower_step(self) -> jax.stages.Lowered:
        """The jitted update lowered on the current state and the first batch (what `step` runs: benchmarks
        compile it to read its memory and HLO)."""
        return self._step.lower(self.params, self.opt_state, self.task.batch(0), self.key(0), jnp.float32(jnp.inf))

    def set_state(self, state: dict, step: int | None = None) -> None:
        """Puts a state like `state()`'s back (natural layer order, e.g. restored), at `step` (default: the
        current one)."""
        if self.layer_order is not None:
            state = self._reorder(state, self.layer_order)
        step = self.step_count if step is None else int(step)
        self.loop_state = LoopState(step, state["params"], state["opt_state"])

    def val_loss(self) -> float:
        return float(self._eval(self.params, self.task.batch(0, val=True), self.key(2**31 - 1)))

    def model(self) -> nnx.Module:
        """The trained model for what runs after training (sampling, evaluation, export), its weights in device
        memory: with --offload weights they live in host memory, which the jitted sampling and export programs,
        sharded for the device, do not take."""
        params = self.state()["params"]
        if any(a.sharding.memory_kind == "pinned_host" for a in jax.tree.leaves(params)):
            device = jax.tree.map(lambda a: a.sharding.with_memory_kind("device"), params)
            params = jax.jit(lambda p: p, out_shardings=device)(params)  # one copy in (XLA:CPU's device_put can't)
        return nnx.merge(self.graphdef, params)

    # --- checkpoints
    def state(self) -> dict:
        """{"params", "opt_state"} with the layer stack in natural order (as saved in checkpoints)."""
        state = self.loop_state.arrays()
        return state if self.layer_order is None else self._reorder(state, np.argsort(self.layer_order))

    def _reorder(self, state: dict, order: np.ndarray):
        """The state with every layer-stacked array (weights and their optimizer moments) taken in `order`."""
        stacked = {k: jax.tree.map(lambda _, k=k: k == self.stack, v) for k, v in self.params.items()}
        take = lambda a, is_stacked: a[order] if is_stacked else a

        @functools.partial(jax.jit, out_shardings=(self.shardings, self.opt_shardings))
        def reorder(params: dict, opt_state: optax.OptState):
            params = jax.tree.map(take, params, stacked)
            opt_state = optax.tree_map_params(self.tx, take, opt_state, stacked)
            return params, opt_state

        params, opt_state = reorder(state["params"], state["opt_state"])
        return {"params": params, "opt_state": opt_state}

    def metadata(self) -> dict:
        return {
            "model": self.task.metadata(),
            "mesh": self.plan.describe(),
            "config": self.spec.flat(),
            "param_layout": PARAM_LAYOUT,
        }

    def restore(self, ckpt: Checkpointer, step: int | None = None) -> None:
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state())
        step = ckpt.latest_step() if step is None else step
        layout = ckpt.metadata(step).get("param_layout")
        if layout != PARAM_LAYOUT:
            raise ValueError(
                f"checkpoint step {step} in {ckpt.directory} has parameter layout {layout or 'per-layer (jaxring 0.1)'}"
                f", this jaxring needs {PARAM_LAYOUT!r} (layers stacked [num_layers, ...] and scanned); "
                f"its optimizer state does not carry over: retrain, or restore it with jaxring 0.1"
            )
        state = ckpt.restore(step, target, expected_metadata={"model": self.task.metadata()})
        self.set_state(state, step)
