"""The train step: one `jit` holding one `shard_map` over the plan's whole mesh (dp, fsdp, ep, sp, tp).

    step = TrainStep(plan, model, tx, task, memory=MemoryPolicy(remat="full"), dtype=jnp.float32)
    params, opt_state, metrics = step(params, opt_state, batch, key)

Inside the shard_map every array is this device's shard; the model's layers are local functions (the plan's
tensor method and sequence strategy), the layer stack is one `lax.scan`, and the gradient path is explicit:

  1. per weight, (diff, const) = zero.inputs(stage, p): the step differentiates w.r.t. diff;
  2. the loss, summed over micro-batches (gradient accumulation in a scan), psummed over the axes it varies
     over and divided by the global token count;
  3. gradients reduced as the ZeRO stage says (all-reduce, reduce-scatter, or already scattered);
  4. clipping by the global norm (each piece counted once: `zero.global_norm`);
  5. AdamW on this rank's slice, then the all-gather (stages 1-2).
Only the task's data preparation (e.g. DiT's noise, drawn on global shapes so it is the same on any mesh)
runs outside the shard_map, under the same jit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring.core.vma import vary, vary_like, varying_axes
from jaxring.nn import NO_MEMORY_POLICY, Layers, MemoryPolicy, param_placements
from jaxring.parallel import zero
from jaxring.parallel.pipeline import pipeline_loss_and_grads
from jaxring.run.checks import OFFLOAD_WITH_PP, WEIGHTS_OFFLOAD_RULES
from jaxring.train.streamed_update import streamed_norm, streamed_update

if TYPE_CHECKING:
    from jaxring.parallel.plan import ParallelPlan
    from jaxring.run.task import Objective


def psum_varying(x: jax.Array, exclude: Iterable[str] = ()) -> jax.Array:
    """Sum of local x over every mesh axis it varies over (a replicated x is counted once), but `exclude`."""
    axes = tuple(sorted(varying_axes(x) - set(exclude)))
    return lax.psum(x, axes) if axes else x


def replicated(x: jax.Array, exclude: Iterable[str] = ()) -> jax.Array:
    """x, a value equal on every device but typed as varying (e.g. carried through the pipeline with the
    activations), as a replicated value: the mean of its equal copies."""
    axes = tuple(sorted(varying_axes(x) - set(exclude)))
    if not axes:
        return x
    return lax.psum(x, axes) / math.prod(lax.axis_size(a) for a in axes)


def _split(tree: Any, placements: Any, fn: Callable[[jax.Array, zero.Placement], tuple[Any, Any]]):
    """Applies fn(leaf, placement) -> (a, b) leafwise; returns the two trees."""
    leaves, treedef = jax.tree.flatten(tree)
    pls = treedef.flatten_up_to(placements)
    pairs = [fn(x, pl) for x, pl in zip(leaves, pls)]
    return treedef.unflatten([a for a, _ in pairs]), treedef.unflatten([b for _, b in pairs])


def _map(fn: Callable[..., Any], tree: Any, placements: Any, *rest):
    leaves, treedef = jax.tree.flatten(tree)
    others = [treedef.flatten_up_to(r) for r in (placements,) + rest]
    return treedef.unflatten([fn(x, *o) for x, *o in zip(leaves, *others)])


class TrainStep:
    """The jitted update and held-out loss of a model on a plan (see the module docstring).

    task: the objective, with `prepare(batch, key) -> inputs` (global arrays, outside the shard_map),
    `input_specs(plan)`, `embed`/`layer`/`head` on local shards (`jaxring.run.task.Objective`; aux: dict of fp32
    sums, e.g. MoE statistics) and `loss_count` (the global count the loss is a mean over);
    e.g. `jaxring.models.gpt.NextTokenObjective`, `jaxring.models.dit.FlowMatchingObjective`. tx may be None for
    `build_grads`/`build_eval`.
    """

    def __init__(
        self,
        plan: ParallelPlan,
        model: nnx.Module,
        tx: optax.GradientTransformation | None,
        task: Objective,
        *,
        memory: MemoryPolicy = NO_MEMORY_POLICY,
        dtype: jax.typing.DTypeLike = jnp.float32,
        grad_accum: int = 1,
        clip: float | None = 1.0,
    ):
        """model: the nnx model (its weights may be abstract, `nnx.eval_shape`), whose `STACK` attribute names
        its stacked layers; only its graph and its weights' placements on `plan` are kept."""
        graphdef, state = nnx.split(model)
        placements = param_placements(state, plan)
        self.plan, self.graphdef, self.placements, self.tx, self.task = plan, graphdef, placements, tx, task
        self.dtype, self.memory, self.grad_accum, self.clip = dtype, memory, grad_accum, clip
        self.stack = model.STACK
        offload = memory.offload
        # the optimizer state in pinned host memory between updates: moved in for the update, out after it
        self.offload_optimizer = offload.optimizer
        # the weights, their gradients and the optimizer state in pinned host memory: each layer's weights
        # moved in for its forward and again for its backward, its gradient out as soon as it is formed, the
        # update streamed through the device layer by layer (`jaxring.train.streamed_update`)
        self.offload_weights = offload.weights
        if offload.beyond_optimizer and plan.pp > 1:
            raise ValueError(OFFLOAD_WITH_PP.format(offload=offload, pp=plan.pp))
        # the layer stack, built once: every trace of the step (update, held-out loss, pipeline stages) scans it
        self.layers = Layers(
            graphdef=nnx.split(getattr(model, self.stack))[0], placements=placements[self.stack], memory=memory
        )
        self.stage = plan.zero_stage
        is_pl = lambda x: isinstance(x, zero.Placement)
        if self.offload_weights:
            replicated = [pl for pl in jax.tree.leaves(placements, is_leaf=is_pl) if pl.replica]
            if grad_accum > 1:
                raise ValueError(WEIGHTS_OFFLOAD_RULES["grad_accum"].format(offload=offload, grad_accum=grad_accum))
            if replicated and self.stage in (1, 2):
                axes = ", ".join(sorted({a for pl in replicated for a in pl.replica}))
                raise ValueError(WEIGHTS_OFFLOAD_RULES["zero"].format(offload=offload, zero=self.stage, axes=axes))
        self.param_specs = jax.tree.map(lambda pl: pl.param_spec(self.stage), placements, is_leaf=is_pl)
        self.moment_specs = jax.tree.map(lambda pl: pl.state_spec(self.stage), placements, is_leaf=is_pl)
        self.input_specs = task.input_specs(plan)

    # ------------------------------------------------------------------ layouts
    def shardings(self, specs: Any, memory_kind: str | None = None) -> Any:
        return jax.tree.map(
            lambda s: NamedSharding(self.plan.run_mesh, s, memory_kind=memory_kind),
            specs,
            is_leaf=lambda x: isinstance(x, P),
        )

    def param_shardings(self) -> Any:
        """The stored weights' shardings: their specs on the run mesh, in pinned host memory when offloaded."""
        return self.shardings(self.param_specs, "pinned_host" if self.offload_weights else None)

    def opt_state_shardings(self, opt_specs: Any) -> Any:
        """The optimizer state's shardings: its specs on the run mesh, in pinned host memory when offloaded."""
        return self.shardings(opt_specs, "pinned_host" if self.offload_optimizer else None)

    def opt_state_specs(self, abstract_params: Any) -> Any:
        """Specs of the optimizer state: moments like their weights' ZeRO layout, counts replicated."""
        abstract = jax.eval_shape(self.tx.init, abstract_params)
        return optax.tree_map_params(
            self.tx,
            lambda _, spec: spec,
            abstract,
            self.moment_specs,
            transform_non_params=lambda _: P(),
            is_leaf=lambda x: isinstance(x, P),
        )

    # ------------------------------------------------------------------ the local loss
    def _loss(self, diff: dict, const: dict, inputs: Any, stage: int):
        """(mean-loss contribution, aux) of one micro-batch, on local shards: the objective's embed, the layer
        stack (`self.layers`: a scan whose layers remat by `self.memory`, `nn.remat_policy`) and head. The weights outside the
        stack are materialized once and held through the backward (ZeRO-3: gathered once)."""
        task, plan = self.task, self.plan
        top = {k: v for k, v in diff.items() if k != self.stack}
        top_const = {k: v for k, v in const.items() if k != self.stack}
        top_pl = {k: v for k, v in self.placements.items() if k != self.stack}
        if self.offload_weights:
            weights = _map(lambda d, pl: zero.fetch(stage, d, pl), top, top_pl)
        else:
            weights = _map(lambda d, pl, c: zero.materialize(stage, d, c, pl), top, top_pl, top_const)
        model = nnx.merge(self.graphdef, {**weights, self.stack: diff[self.stack]})
        carry = task.embed(model, inputs, plan, self.dtype)
        layer = lambda block, carry: task.layer(block, carry, inputs, plan)
        carry = self.layers.scan(carry, layer, diff[self.stack], const[self.stack], stage)
        loss_sum, aux = task.head(model, carry, inputs, plan, self.dtype)
        count = float(self.task.loss_count)
        aux = {k: replicated(v) for k, v in aux.items()}
        data_loss = psum_varying(loss_sum) / count
        # "extra_loss" (e.g. MoE load balancing, already over the whole micro-batch) joins the objective; the
        # reported loss stays the data loss
        objective = data_loss + aux.pop("extra_loss", 0.0) / self.grad_accum
        return objective, {"loss": data_loss, **aux}

    def _pipeline_value_and_grad(self, params: dict, inputs: Any):
        """Loss, aux and gradients with the layer stack split over pp, run by the plan's schedule
        (`jaxring.parallel.pipeline`): embed on the first virtual stage, chunks of `Layers` on every stage, the head and
        loss on the last. The pipeline's micro-batches are the step's gradient accumulation."""
        stage, plan, task = self.stage, self.plan, self.task
        schedule = plan.schedule
        v, m = schedule.virtual_stages, schedule.num_microbatches
        diff, const = _split(params, self.placements, lambda p, pl: zero.inputs(stage, p, pl))
        top = {k: x for k, x in diff.items() if k != self.stack}
        top_const = {k: x for k, x in const.items() if k != self.stack}
        top_pl = {k: x for k, x in self.placements.items() if k != self.stack}
        chunks = jax.tree.map(lambda a: a.reshape((v, a.shape[0] // v) + a.shape[1:]), diff[self.stack])
        micro = jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), inputs)
        count = float(task.loss_count)

        def model_of(shared: dict):
            weights = _map(lambda d, pl, c: zero.materialize(stage, d, c, pl), shared, top_pl, top_const)
            return nnx.merge(self.graphdef, {**weights, self.stack: diff[self.stack]})

        def embed_fn(shared: dict, mb: Any):
            return task.embed(model_of(shared), mb, plan, self.dtype)

        def stage_fn(chunk: Any, carry: Any, mb: Any):
            return self.layers.scan(carry, lambda block, carry: task.layer(block, carry, mb, plan), chunk, None, stage)

        def loss_fn(shared: dict, carry: Any, mb: Any):
            # runs on the last stage alone (inside its switch branch): sums over the data axes, never over pp
            loss_sum, aux = task.head(model_of(shared), carry, mb, plan, self.dtype)
            aux = {k: replicated(x, exclude=("pp",)) for k, x in aux.items()}
            data_loss = psum_varying(loss_sum, exclude=("pp",)) / count
            objective = data_loss + aux.pop("extra_loss", 0.0) / m
            return objective, {"loss": data_loss, **aux}

        _, aux, d_chunks, d_top = pipeline_loss_and_grads(
            schedule,
            embed_fn=embed_fn,
            stage_fn=stage_fn,
            loss_fn=loss_fn,
            stage_params=chunks,
            shared_params=top,
            microbatches=micro,
            data_axes=plan.replica_axes,
            reduce_data_axes=False,
        )
        d_stack = jax.tree.map(lambda g: g.reshape((-1,) + g.shape[2:]), d_chunks)
        grads = _map(lambda g, pl: zero.reduce(stage, g, pl), {**d_top, self.stack: d_stack}, self.placements)
        # loss_fn summed its metrics over the data axes already; the interpreter (which leaves the gradients
        # unreduced for ZeRO) types them as varying there: average the equal copies into a replicated value
        data = plan.replica_axes
        n = math.prod(lax.axis_size(a) for a in data)
        same = (lambda x: lax.psum(vary(x, data), data) / n) if data else (lambda x: x)
        aux = {k: same(x) if k == "loss" else same(x) / m for k, x in aux.items()}
        return aux.pop("loss"), aux, grads

    def _inputs(self, stage: int, params: dict) -> tuple[dict, dict]:
        """(diff, const) of the stored weights (`zero.inputs`, or `zero.stored_in_host_memory`)."""
        split = zero.stored_in_host_memory if self.offload_weights else zero.inputs
        return _split(params, self.placements, lambda p, pl: split(stage, p, pl))

    def _value_and_grad(self, params: dict, inputs: Any):
        if self.plan.pp > 1:
            return self._pipeline_value_and_grad(params, inputs)
        stage = self.stage
        diff, const = self._inputs(stage, params)
        loss_fn = lambda d, x: self._loss(d, const, x, stage)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if self.grad_accum == 1:
            (_, aux), grads = grad_fn(diff, inputs)
        else:
            accum = self.grad_accum
            micro = jax.tree.map(lambda x: x.reshape((accum, x.shape[0] // accum) + x.shape[1:]), inputs)

            def body(carry: tuple[jax.Array, dict, dict], mb: Any):
                (loss, aux), grads = grad_fn(diff, mb)
                return jax.tree.map(jnp.add, carry, (loss, aux, grads)), None

            (_, aux_shapes), grad_shapes = jax.eval_shape(grad_fn, diff, jax.tree.map(lambda x: x[0], micro))
            zeros = (
                jnp.zeros((), jnp.float32),
                jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shapes),
                jax.tree.map(lambda g, d: vary_like(jnp.zeros(g.shape, g.dtype), d), grad_shapes, diff),
            )
            (_, aux, grads), _ = lax.scan(body, zeros, micro)
            # every micro-batch's loss is a share of the step's mean; its other metrics are averaged
            aux = {k: v if k == "loss" else v / accum for k, v in aux.items()}
        if not self.offload_weights:  # offloaded ones were reduced by `zero.fetch`'s transpose
            grads = _map(lambda g, pl: zero.reduce(stage, g, pl), grads, self.placements)
        return aux.pop("loss"), aux, grads

    # ------------------------------------------------------------------ the step
    def _local_step(self, params: dict, opt_state: optax.OptState, inputs: Any, max_loss: jax.Array):
        stage = self.stage
        loss, aux, grads = self._value_and_grad(params, inputs)
        # a non-finite loss, or one over max_loss (the divergence guard's limit), leaves the state as it was
        ok = jnp.isfinite(loss) & (loss <= max_loss)
        if self.offload_weights:
            norm = streamed_norm(grads, self.stack)
            scale = 1.0 if self.clip is None else jnp.where(norm <= self.clip, 1.0, self.clip / norm)
            params, opt_state = streamed_update(self.tx, params, opt_state, grads, stack=self.stack, scale=scale, ok=ok)
            return params, opt_state, {"loss": loss, "grad_norm": norm, "skipped": ~ok, **aux}
        norm = zero.global_norm(grads)
        if self.clip is not None:
            scale = jnp.where(norm <= self.clip, 1.0, self.clip / norm)
            grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)

        def update(params: dict, opt_state: optax.OptState):
            if self.offload_optimizer:  # in from host memory for the update alone
                opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
            mine = _map(lambda p, pl: zero.update_slice(stage, p, pl), params, self.placements)
            updates, opt_state = self.tx.update(grads, opt_state, mine)
            new = optax.apply_updates(mine, updates)
            if self.offload_optimizer:
                opt_state = jax.device_put(opt_state, jax.memory.Space.Host)
            return _map(lambda p, pl: zero.updated(stage, p, pl), new, self.placements), opt_state

        params, opt_state = lax.cond(ok, update, lambda p, o: (p, o), params, opt_state)
        return params, opt_state, {"loss": loss, "grad_norm": norm, "skipped": ~ok, **aux}

    def build(self, opt_specs: Any) -> Callable[..., tuple[dict, optax.OptState, dict]]:
        """The jitted step(params, opt_state, batch, key, max_loss) -> (params, opt_state, metrics). The update
        is not applied (metrics["skipped"]) when the loss is not finite or exceeds max_loss (fp32 scalar)."""
        body = self.plan.shard_map(
            self._local_step,
            in_specs=(self.param_specs, opt_specs, self.input_specs, P()),
            out_specs=(self.param_specs, opt_specs, P()),
        )

        def step(params: dict, opt_state: optax.OptState, batch: dict, key: jax.Array, max_loss: jax.Array):
            params, opt_state = self._typed_in_host_memory(params, opt_state)
            return body(params, opt_state, self.task.prepare(batch, key), max_loss)

        replicated = NamedSharding(self.plan.run_mesh, P())
        return jax.jit(
            step,
            donate_argnums=(0, 1),
            out_shardings=(self.param_shardings(), self.opt_state_shardings(opt_specs), replicated),
        )

    def _typed_in_host_memory(self, params: dict, opt_state: Any = None) -> tuple[dict, Any]:
        """The offloaded state typed as living in host memory: already there on real devices; on abstract ones
        (which list no host memory, see jaxring.core.compat.place_in_host_memory) so typed that the step moves
        it in and out the same way."""
        host = lambda tree: jax.device_put(tree, jax.memory.Space.Host)
        if self.offload_optimizer and opt_state is not None:
            opt_state = host(opt_state)
        return (host(params) if self.offload_weights else params), opt_state

    def build_eval(self) -> Callable[[dict, dict, jax.Array], jax.Array]:
        """The jitted held-out loss(params, batch, key) -> fp32 scalar (no gradients; under pp the pipeline
        runs its whole schedule and the gradients are dropped)."""
        stage = 3 if self.stage == 3 else 0

        def local(params: dict, inputs: Any):
            if self.plan.pp > 1:
                return self._pipeline_value_and_grad(params, inputs)[0]
            diff, const = self._inputs(stage, params)
            return self._loss(diff, const, inputs, stage)[1]["loss"]

        body = self.plan.shard_map(local, in_specs=(self.param_specs, self.input_specs), out_specs=P())
        return jax.jit(
            lambda params, batch, key: body(self._typed_in_host_memory(params)[0], self.task.prepare(batch, key))
        )

    def build_grads(self) -> Callable[[dict, dict, jax.Array], tuple[jax.Array, dict, dict]]:
        """The jitted (params, batch, key) -> (loss, aux, grads): gradients summed over the replica axes, in the
        optimizer's layout (ZeRO shards for stages >= 1), before clipping."""

        def local(params: dict, inputs: Any):
            return self._value_and_grad(params, inputs)

        body = self.plan.shard_map(
            local, in_specs=(self.param_specs, self.input_specs), out_specs=(P(), P(), self.moment_specs)
        )
        return jax.jit(
            lambda params, batch, key: body(self._typed_in_host_memory(params)[0], self.task.prepare(batch, key))
        )


def value_and_grad(
    model: nnx.Module,
    plan: ParallelPlan,
    objective: Objective,
    batch: dict,
    key: jax.Array,
    *,
    dtype: jax.typing.DTypeLike = jnp.float32,
    memory: MemoryPolicy = NO_MEMORY_POLICY,
    grad_accum: int = 1,
) -> tuple[jax.Array, dict]:
    """(loss, grads) of `objective` for an nnx `model` on `plan`, through the train step's own path (one
    shard_map, the plan's ZeRO stage): loss fp32 scalar, grads a nested dict like `nnx.to_pure_dict`.
    For tests and notebooks; training uses `TrainStep` directly."""
    step = TrainStep(plan, model, None, objective, dtype=dtype, memory=memory, grad_accum=grad_accum)
    params = jax.device_put(nnx.to_pure_dict(nnx.state(model)), step.param_shardings())
    loss, _, grads = step.build_grads()(params, batch, key)
    return loss, grads
