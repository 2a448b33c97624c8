"""A run's train step built on abstract inputs, lowered and compiled without running it.

    compiled = compile_train_step("gpt", config, plan, batch=8, seq_len=1024)   # nothing allocated
    compiled.memory_analysis(), compiled.as_text()     # per-device bytes; the HLO (`jaxring.analysis`)

`build_train_step` builds the same `TrainStep` the trainer builds (`jaxring.train.trainer`: AdamW, clipping,
remat, offload, gradient accumulation, precision), on the plan's devices: simulated CPU devices, or a GPU
topology from `jaxring.analysis.gpu.gpu_devices` (deviceless); weights, optimizer state and the batch are
ShapeDtypeStructs with the trainer's shardings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxring.analysis import gpu
from jaxring.core.compat import place_in_host_memory
from jaxring.core.precision import compute_dtype
from jaxring.nn import MemoryPolicy
from jaxring.run.task import model_family
from jaxring.train.step import TrainStep

if TYPE_CHECKING:
    from jaxring.parallel.plan import ParallelPlan


# what an abstract step keeps by default: each layer's input only (the long-sequence runs' setting)
FULL_REMAT = MemoryPolicy(remat="full")


def _abstract(tree: Any, shardings: Any):
    """ShapeDtypeStructs of `tree`'s arrays with `shardings` (nothing allocated)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def build_train_step(
    model_kind: str,
    config: Any,
    plan: ParallelPlan,
    *,
    batch: int,
    seq_len: int | None = None,
    grad_accum: int = 1,
    precision: str = "bf16",
    memory: MemoryPolicy = FULL_REMAT,
    clip: float | None = 1.0,
    documents: bool = False,
) -> tuple[Callable[..., Any], tuple]:
    """(step, abstract args) of the trainer's jitted update for a `config` GPT or DiT on `plan` with a global
    batch of `batch` sequences (images), without allocating anything; documents: batches of packed documents
    (the family's objective with their segment ids, as the trainer builds it from a document store); memory: what
    the layer stack keeps, recomputes and offloads (`spec.memory.policy`; default: full remat)."""
    family = model_family(model_kind)
    packed = {"documents": True} if documents else {}  # a family without documents takes no such argument
    objective = family.objective(config, batch, seq_len, **packed)
    model = nnx.eval_shape(lambda: family.build(config, nnx.Rngs(0)))
    tx = optax.adamw(1e-3)
    step = TrainStep(
        plan, model, tx, objective, memory=memory, dtype=compute_dtype(precision), grad_accum=grad_accum, clip=clip
    )
    params = _abstract(nnx.to_pure_dict(nnx.state(model)), step.param_shardings())
    opt_specs = step.opt_state_specs(params)
    opt = _abstract(jax.eval_shape(tx.init, params), step.opt_state_shardings(opt_specs))
    data = family.abstract_batch(config, plan, batch, seq_len, **packed)
    args = (params, opt, data, jax.ShapeDtypeStruct((2,), jnp.uint32), jax.ShapeDtypeStruct((), jnp.float32))
    return step.build(opt_specs), args


def _lists_host_memory(device: jax.Device) -> bool:
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except Exception:  # an abstract device of a topology (deviceless compile) lists none
        return False


def compile_train_step(model_kind: str, config: Any, plan: ParallelPlan, **kwargs) -> jax.stages.Compiled:
    """The compiled train step (see `lower_train_step`): `.memory_analysis()`, `.as_text()`."""
    return lower_train_step(model_kind, config, plan, **kwargs).compile()


def lower_train_step(model_kind: str, config: Any, plan: ParallelPlan, **kwargs) -> jax.stages.Lowered:
    """The lowered train step (see `build_train_step`). With the optimizer state (or the weights and it)
    offloaded on abstract GPUs (which list no host memory), its arguments and results are marked as pinned host
    memory in the lowered program, as jit marks them on real devices."""
    fn, args = build_train_step(model_kind, config, plan, **kwargs)
    with gpu.lowering_for(plan.run_mesh.devices.flat[0]):
        lowered = fn.lower(*args)
    abstract = not _lists_host_memory(plan.run_mesh.devices.flat[0])
    offload = kwargs.get("memory", FULL_REMAT).offload
    if offload.optimizer and abstract:
        first = len(jax.tree.leaves(args[0]))  # (params, opt_state, ...) in, (params, opt_state, metrics) out
        state = set(range(first, first + len(jax.tree.leaves(args[1]))))
        if offload.weights:
            state |= set(range(first))
        place_in_host_memory(lowered, state, state)
    return lowered
