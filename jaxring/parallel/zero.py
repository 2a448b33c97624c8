"""Explicit ZeRO stages over the replica axes, written as the collectives they are (inside the step's shard_map).

The replica axes R of a weight are the plan's batch and sequence axes it is not already split over: the
devices that hold the same weight while working on different tokens, so its gradient is a sum over R. With
N = |R| devices and Ψ parameters ([Playbook] in REFERENCES.md; Adam's k = 8 bytes of fp32 moments
here, fp32 master weights and gradients):

  stage 0  weights, gradients and optimizer state replicated; gradient all-reduce (psum over R): 2Ψ moved
  stage 1  optimizer state sharded: gradients reduce-scattered (psum_scatter), each rank updates its slice,
           the new weights all-gathered: Ψ + Ψ moved
  stage 2  gradients sharded too: each layer's gradient is reduce-scattered as the backward produces it (no
           full gradient buffer; with accumulation the shards accumulate): Ψ + Ψ moved
  stage 3  weights sharded too: all-gathered per layer in the forward and again in the backward (never
           saved for it), gradients reduce-scattered: 3Ψ moved

A weight is sharded along its `zero_dim`: its "embed" dimension when it splits N ways, else its largest that
does (after any tensor-parallel split of that dim); a weight with none stays replicated and is all-reduced
(stage 0 behaviour) whatever the stage.

How the step uses this module, per weight leaf (`Placement`):
  diff, const = inputs(stage, p)            what is differentiated, what is only read
  w = materialize(stage, diff, const)       the weight as the layer uses it (per layer inside the scan)
  g = reduce(stage, grad_of_diff)           the gradient in the optimizer's layout
  p, opt = update(...)                      the sharded (or replicated) update, then the all-gather
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import spec_entry
from jaxring.core.vma import gather_invariant, vary, varying_axes


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one weight lives. spec: mesh axes per dim from the tensor method and the pipeline (not ZeRO);
    zero_dim: the dim sharded over `replica` (None: not sharded by ZeRO); replica: R for this weight."""

    spec: tuple
    zero_dim: int | None
    replica: tuple[str, ...]

    def with_zero(self) -> tuple:
        """spec with the replica axes added (minor) to zero_dim."""
        if self.zero_dim is None:
            return self.spec
        spec = list(self.spec)
        have = spec[self.zero_dim]
        have = () if have is None else (have,) if isinstance(have, str) else tuple(have)
        spec[self.zero_dim] = spec_entry(have + self.replica)
        return tuple(spec)

    def param_spec(self, stage: int) -> P:
        """How the weight is stored between steps."""
        return P(*(self.with_zero() if stage == 3 else self.spec))

    def state_spec(self, stage: int) -> P:
        """How its optimizer moments are stored."""
        return P(*(self.with_zero() if stage >= 1 else self.spec))


def _axes_of(entry: str | Sequence[str] | None) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def place(
    spec: tuple,
    shape: tuple,
    logical_axes: tuple | None,
    replica: tuple[str, ...],
    mesh_shape: dict,
    zero_sharding: bool = True,
) -> Placement:
    """The Placement of a weight of `shape` split as `spec`, replicated over `replica` (size N)."""
    used = {a for e in spec for a in _axes_of(e)}
    replica = tuple(a for a in replica if a not in used)
    n = math.prod(mesh_shape[a] for a in replica)
    if n == 1 or not zero_sharding:
        return Placement(tuple(spec), None, replica)
    local = [d // math.prod(mesh_shape[a] for a in _axes_of(e)) for d, e in zip(shape, spec)]
    logical = tuple(logical_axes or (None,) * len(shape))
    candidates = [i for i, d in enumerate(local) if d % n == 0 and d > 0]
    if not candidates:
        return Placement(tuple(spec), None, replica)
    embed = [i for i in candidates if logical[i] == "embed"]
    zero_dim = embed[0] if embed else max(candidates, key=lambda i: (local[i], -i))
    return Placement(tuple(spec), zero_dim, replica)


# ---------------------------------------------------------------------------------------- collectives


def _scatter(x: jax.Array, placement: Placement) -> jax.Array:
    return lax.psum_scatter(x, placement.replica, scatter_dimension=placement.zero_dim, tiled=True)


def _slice(x: jax.Array, placement: Placement) -> jax.Array:
    """This rank's ZeRO slice of a replicated x (the part psum_scatter would leave here)."""
    n = math.prod(lax.axis_size(a) for a in placement.replica)
    size = x.shape[placement.zero_dim] // n
    return lax.dynamic_slice_in_dim(x, lax.axis_index(placement.replica) * size, size, placement.zero_dim)


def gather_replicated(x: jax.Array, placement: Placement) -> jax.Array:
    """All-gather of the ZeRO shards into the replicated weight (its type: replicated over R)."""
    return gather_invariant(x, placement.replica, placement.zero_dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _attach(w: jax.Array, shard: jax.Array, placement: Placement) -> jax.Array:
    """Stage 2: the replicated weight as the layer uses it (varying over R); the gradient goes to `shard`,
    reduce-scattered right away, so no full gradient of the weight outlives its layer's backward."""
    del shard
    return vary(w, placement.replica)


def _attach_fwd(w: jax.Array, shard: jax.Array, placement: Placement) -> tuple[jax.Array, None]:
    return _attach(w, shard, placement), None


def _attach_bwd(placement: Placement, _: None, g: jax.Array) -> tuple[None, jax.Array]:
    return None, _scatter(g, placement)


_attach.defvjp(_attach_fwd, _attach_bwd)


# ---------------------------------------------------------------------------------------- the stages


def inputs(stage: int, p: jax.Array, placement: Placement) -> tuple[jax.Array, jax.Array | None]:
    """(diff, const) for weight p as stored: the step differentiates the loss w.r.t. diff."""
    if placement.zero_dim is None or stage in (0, 1):
        return vary(p, placement.replica), None  # each rank's own, unreduced gradient
    if stage == 2:
        shard = vary(jnp.zeros_like(_slice(p, placement)), placement.replica)
        return shard, p
    return p, None  # stage 3: the shard itself


def materialize(stage: int, diff: jax.Array, const: jax.Array | None, placement: Placement) -> jax.Array:
    """The weight as a layer reads it."""
    if placement.zero_dim is None or stage in (0, 1):
        return diff
    if stage == 2:
        return _attach(const, diff, placement)
    # Untiled (a new axis, merged by the reshape): the one all-gather in jaxring that the layer remat policy
    # never saves (`no_weights_saved`), so the backward gathers it again. Backward: reduce-scatter.
    zd = placement.zero_dim
    w = lax.all_gather(diff, placement.replica, axis=zd, tiled=False)
    return w.reshape(diff.shape[:zd] + (-1,) + diff.shape[zd + 1 :])


def stored_in_host_memory(stage: int, p: jax.Array, placement: Placement) -> tuple[jax.Array, None]:
    """(diff, const) for weight p stored in pinned host memory (--offload weights; stage 0 or 3): p itself,
    reduced by `fetch`'s transpose (no `reduce` after it)."""
    if placement.replica and placement.zero_dim is not None and stage in (1, 2):
        raise ValueError(f"weights in host memory take ZeRO stage 0 or 3, not {stage}")
    return p, None


def fetch(stage: int, stored: jax.Array, placement: Placement) -> jax.Array:
    """The weight as a layer reads it, from its form stored in pinned host memory (`stored_in_host_memory`):
    moved to the device, then all-gathered (stage 3) or marked varying over R (stage 0). The transpose
    reduce-scatters (psums) the gradient over R on the device, then moves it back to host memory."""
    here = jax.device_put(stored, jax.memory.Space.Device)
    if placement.zero_dim is not None and stage == 3:
        return materialize(3, here, None, placement)
    return vary(here, placement.replica)


def reduce(stage: int, g: jax.Array, placement: Placement) -> jax.Array:
    """The gradient of diff, reduced into the optimizer's layout (summed over R)."""
    if placement.zero_dim is None or stage == 0:
        return lax.psum(g, placement.replica) if placement.replica else g
    if stage == 1:
        return _scatter(g, placement)
    return g  # stages 2, 3: reduce-scattered by the backward itself


def update_slice(stage: int, p: jax.Array, placement: Placement) -> jax.Array:
    """The part of weight p this rank updates (its ZeRO slice for stages 1, 2)."""
    if placement.zero_dim is not None and stage in (1, 2):
        return _slice(p, placement)
    return p


def updated(stage: int, new_slice: jax.Array, placement: Placement) -> jax.Array:
    """The stored weight after the update: stages 1, 2 all-gather the new slices."""
    if placement.zero_dim is not None and stage in (1, 2):
        return gather_replicated(new_slice, placement)
    return new_slice


def square_sum(g: jax.Array) -> jax.Array:
    """Σ g² of one local gradient piece, fp32."""
    return jnp.sum(jnp.square(g.astype(jnp.float32)))


def global_norm(tree: Any, squares: Callable[[jax.Array], jax.Array] = square_sum) -> jax.Array:
    """sqrt(Σ g²) over a tree of local gradient pieces: each leaf's sum of squares (`squares(leaf)`) is summed
    over the mesh axes the leaf varies over (its distinct pieces), and not over those it is replicated on."""
    total = jnp.zeros((), jnp.float32)
    for g in jax.tree.leaves(tree):
        sq = squares(g)
        axes = tuple(sorted(varying_axes(sq)))
        total = total + (lax.psum(sq, axes) if axes else sq)
    return jnp.sqrt(total)


def is_weight_gather(prim: Any, params: dict) -> bool:
    """A stage-3 weight all-gather (the untiled all_gather of `materialize`)."""
    return prim.name == "all_gather" and not params.get("tiled", True)


# Ops that only move, cast or view data: free to recompute. A weight reaches its matmuls through these alone
# (a slice, a move from host memory, a cast to the compute dtype, a reshape into heads, the varying cast), so
# when none of them is saved, the backward rebuilds each weight from its stored form instead of keeping a copy.
_FREE_OPS = frozenset(
    {
        "pvary",
        "reshape",
        "convert_element_type",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "concatenate",
        "copy",
        "copy_p",
        "device_put",  # a weight's move from host memory (--offload weights): moved again for the backward
    }
)


def _free_custom_vjp(prim: Any, params: dict) -> bool:
    """A custom_vjp whose primal is free data movement (stage 2's `_attach`: a varying cast)."""
    jaxpr = params.get("call_jaxpr")
    if prim.name != "custom_vjp_call" or jaxpr is None:
        return False
    eqns = getattr(getattr(jaxpr, "jaxpr", jaxpr), "eqns", None)
    return eqns is not None and all(e.primitive.name in _FREE_OPS for e in eqns)


def no_weights_saved(stage: int, policy: Callable[..., bool] | None = None) -> Callable[..., bool]:
    """A remat policy that saves what `policy` saves (None: everything computed), except the weights as the
    layers read them: stage 3's all-gathered weights are gathered again in the backward (3Ψ moved), stage 2's
    replicated weights are read again from their stored copy. Free data movement (`_FREE_OPS`) is recomputed."""

    def keep(prim: Any, *args: Any, **params: Any) -> bool:
        if is_weight_gather(prim, params) or prim.name in _FREE_OPS or _free_custom_vjp(prim, params):
            return False
        return True if policy is None else policy(prim, *args, **params)

    del stage
    return keep
