"""A plan's train step compiled on abstract inputs, and its bytes per mesh-axis group read from the HLO.

    compiled = compile_train_step(spec, plan)            # nothing allocated: weights are ShapeDtypeStructs
    traffic = axis_traffic(compiled.as_text(), plan.run_mesh)   # {("sp",): bytes, ("dp", "sp"): bytes, ...}

`compile_train_step` builds the same `TrainStep` the trainer builds (`jaxring.train.trainer`), on the plan's
devices: simulated CPU devices, or a GPU topology from `jaxring.analysis.gpu.gpu_devices` (deviceless).

`axis_traffic` splits what `jaxring.analysis.compiled.collective_traffic` counts (bytes received per device,
loop bodies times their trip count, a conditional's branches as they run, the same per-kind factors) by the
run-mesh axes each op's devices differ in: an all-reduce over replica groups spanning dp and sp counts under
("dp", "sp"); a collective-permute under the axes its source-target pairs differ in. Device index i in the HLO is `run_mesh.devices.flat[i]`.
Rank-0 (scalar) arrays are left out: the loss and the norm's pieces move a few bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxring.analysis.compiled import collective_ops, received_factor
from jaxring.core.precision import compute_dtype

if TYPE_CHECKING:
    from jaxring.parallel.plan import ParallelPlan

_PAIRS = re.compile(r"source_target_pairs=\{(.*?)\}\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")


def _groups(line: str, num_devices: int) -> list[list[int]]:
    if m := _GROUPS_IOTA.search(line):
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    if m := _GROUPS_LIST.search(line):
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
        if groups and any(groups):
            return groups
    return [list(range(num_devices))]


def _axes_spanned(
    members: Sequence[int], coords: Mapping[int, tuple[int, ...]], names: Sequence[str]
) -> tuple[str, ...]:
    """The mesh axes along which the devices `members` differ (in mesh order)."""
    c = np.array([coords[i] for i in members])
    return tuple(n for j, n in enumerate(names) if len(set(c[:, j])) > 1)


def axis_traffic(hlo_text: str, mesh: Mesh, *, skip_scalars: bool = True) -> dict[tuple[str, ...], int]:
    """{run-mesh axes an op spans: bytes received per device} for a program compiled over `mesh`."""
    names = mesh.axis_names
    coords = {i: np.unravel_index(i, mesh.devices.shape) for i in range(mesh.devices.size)}
    if skip_scalars:
        hlo_text = re.sub(r"\b(f32|s32|u32|pred|bf16|f16)\[\]", r"\1[0]", hlo_text)
    out: dict[tuple[str, ...], int] = {}
    for line, kind, size, times in collective_ops(hlo_text):
        if size == 0:
            continue
        if kind == "collective-permute":
            pairs = [(int(a), int(b)) for a, b in re.findall(r"(\d+),(\d+)", _PAIRS.search(line).group(1))]
            axes = set()
            for a, b in pairs:
                axes |= set(_axes_spanned((a, b), coords, names))
            key, g = tuple(n for n in names if n in axes), 2
        else:
            groups = _groups(line, mesh.devices.size)
            g = len(groups[0])
            key = tuple(n for n in names if any(n in _axes_spanned(gr, coords, names) for gr in groups))
        if not key:
            continue  # a device talking to itself moves nothing
        out[key] = out.get(key, 0) + round(size * received_factor(kind, g)) * times
    return {key: round(v) for key, v in out.items()}  # a conditional's declared branch shares: Fractions


def user_axes(run_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The user mesh axes (dp, pp, fsdp, ep, sp, tp) behind run-mesh axes (WallFacer's and USP's factored
    sequence axes are sp; Optimus's grid axes are tp)."""
    from jaxring.core.mesh import MESH_AXES

    found = set()
    for a in run_axes:
        if a in MESH_AXES:
            found.add(a)
        elif a.startswith(("wf_", "usp_")):
            found.add("sp")
        else:
            found.add("tp")
    return tuple(a for a in MESH_AXES if a in found)


# ------------------------------------------------------------------------------------ compiling a step


def _abstract(tree: Any, shardings: Any):
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
    remat: str = "full",
    offload: str = "none",
    clip: float | None = 1.0,
    documents: bool = False,
) -> tuple[Callable[..., Any], tuple]:
    """(step, abstract args) of the trainer's jitted update for a `config` GPT or DiT on `plan` with a global
    batch of `batch` sequences (images), without allocating anything; documents: batches of packed documents
    (the family's objective with their segment ids, as the trainer builds it from a document store)."""
    from jaxring.nn import param_placements
    from jaxring.run.task import model_family
    from jaxring.train.step import TrainStep

    family = model_family(model_kind)
    packed = {"documents": True} if documents else {}  # a family without documents takes no such argument
    objective = family.objective(config, batch, seq_len, **packed)
    model = nnx.eval_shape(lambda: family.build(config, nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    tx = optax.adamw(1e-3)
    step = TrainStep(
        plan,
        graphdef,
        param_placements(state, plan),
        tx,
        objective,
        dtype=compute_dtype(precision),
        remat=remat,
        offload=offload,
        grad_accum=grad_accum,
        clip=clip,
        stack=model.STACK,
        layer_graphdef=nnx.split(getattr(model, model.STACK))[0],
    )
    params = _abstract(nnx.to_pure_dict(state), step.shardings(step.param_specs))
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
    """The lowered train step (see `build_train_step`). With the optimizer state offloaded on abstract GPUs
    (which list no host memory), its arguments and results are marked as pinned host memory in the lowered
    program, as jit marks them on real devices."""
    from jaxring.nn import offloaded

    fn, args = build_train_step(model_kind, config, plan, **kwargs)
    lowered = fn.lower(*args)
    abstract = not _lists_host_memory(plan.run_mesh.devices.flat[0])
    if "optimizer" in offloaded(kwargs.get("offload", "none")) and abstract:
        from jaxring.core.compat import place_in_host_memory

        first = len(jax.tree.leaves(args[0]))  # (params, opt_state, ...) in, (params, opt_state, metrics) out
        state = set(range(first, first + len(jax.tree.leaves(args[1]))))
        place_in_host_memory(lowered, state, state)
    return lowered
