"""The optimizer step for a training state that lives in pinned host memory (--offload weights): the fp32
weights, their gradients and the AdamW moments stay on the host; the device holds one layer's slice of each at
a time, inside the step's shard_map.

    norm = streamed_norm(grads, stack)                                    pass 1: Σ g², layer by layer
    params, opt_state = streamed_update(tx, params, opt_state, grads,     pass 2: the update, layer by layer,
                                        stack=stack, scale=s, ok=ok)      then the weights outside the stack

The update is elementwise per weight (AdamW: moments and decay per entry, one step count for all), so one call
of `tx.update` on layer i's slices of every stacked weight, for each i, and one on the weights outside the
stack, is the update of the whole tree; each call starts from the same step count and ends with the same new one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxring.core.vma import vary_like
from jaxring.parallel import zero

STACKED, WHOLE, OTHER = "stacked", "whole", "other"  # a state leaf's kind: a layer-stacked weight's, another's, a count


def _each(tree: Any, value: str) -> Any:
    return jax.tree.map(lambda _: value, tree)


def _device(tree: Any) -> Any:
    return jax.device_put(tree, jax.memory.Space.Device)


def _host(tree: Any) -> Any:
    return jax.device_put(tree, jax.memory.Space.Host)


def streamed_norm(grads: dict, stack: str) -> jax.Array:
    """The global gradient norm (`zero.global_norm`) of gradients in host memory: the stack's summed one layer
    at a time on the device, the other weights' one weight at a time."""

    def layer_by_layer(g: jax.Array) -> jax.Array:
        def add(total: jax.Array, g_i: jax.Array) -> tuple[jax.Array, None]:
            return total + zero.square_sum(_device(g_i)), None

        return lax.scan(add, vary_like(jnp.zeros((), jnp.float32), g), g)[0]

    top = {k: v for k, v in grads.items() if k != stack}
    stacked = zero.global_norm(grads[stack], layer_by_layer)
    whole = zero.global_norm(top, lambda g: zero.square_sum(_device(g)))
    return jnp.sqrt(jnp.square(stacked) + jnp.square(whole))


def streamed_update(
    tx: optax.GradientTransformation,
    params: dict,
    opt_state: optax.OptState,
    grads: dict,
    *,
    stack: str,
    scale: jax.Array,
    ok: jax.Array,
) -> tuple[dict, optax.OptState]:
    """(new params, new state), both in host memory: grads times `scale` applied by `tx`, where `ok` (else the
    old ones kept). params, grads: nested dicts of local pieces in host memory, the layers' stacked under
    `stack` (leading dim: the layer); opt_state: tx's state of them, in host memory."""
    kinds = {k: _each(v, STACKED if k == stack else WHOLE) for k, v in params.items()}
    p_leaves, p_def = jax.tree.flatten(params)
    g_leaves = p_def.flatten_up_to(grads)
    s_leaves, s_def = jax.tree.flatten(opt_state)
    p_kind = p_def.flatten_up_to(kinds)
    s_kind = jax.tree.leaves(
        optax.tree_map_params(tx, lambda _, k: k, opt_state, kinds, transform_non_params=lambda _: OTHER)
    )
    at_p = {kind: [i for i, k in enumerate(p_kind) if k == kind] for kind in (STACKED, WHOLE)}
    at_s = {kind: [i for i, k in enumerate(s_kind) if k == kind] for kind in (STACKED, WHOLE, OTHER)}
    counts = _device([s_leaves[i] for i in at_s[OTHER]])

    def filled(like: list, at: list, values: list) -> list:
        """`like`'s leaves, `values` at positions `at` and empty stand-ins elsewhere."""
        out = [jnp.zeros((0,), x.dtype) for x in like]
        for i, v in zip(at, values):
            out[i] = v
        return out

    def update(kind: str, p: list, g: list, s: list) -> tuple[list, list]:
        """tx's update of the weights of `kind` (device arrays in leaf order): (new weights, new state leaves
        of theirs, then the new counts)."""
        at_state = at_s[kind] + at_s[OTHER]
        params_in = filled(p_leaves, at_p[kind], p)
        grads_in = filled(p_leaves, at_p[kind], [(x * scale).astype(x.dtype) for x in g])
        state_in = filled(s_leaves, at_state, list(s) + list(counts))
        updates, state_out = tx.update(p_def.unflatten(grads_in), s_def.unflatten(state_in), p_def.unflatten(params_in))
        new_p = jax.tree.leaves(optax.apply_updates(p_def.unflatten(params_in), updates))
        new_s = jax.tree.leaves(state_out)
        keep = lambda i, new, old: jnp.where(ok, new[i], old[i])  # a skipped step keeps the state as it was
        return [keep(i, new_p, params_in) for i in at_p[kind]], [keep(i, new_s, state_in) for i in at_state]

    pick = lambda leaves, at: [leaves[i] for i in at]
    grads_stack = pick(g_leaves, at_p[STACKED])

    def layer(i: jax.Array, stored: tuple) -> tuple:
        # layer i's slices in, updated, and written back in place (the stacks are the loop's carry)
        at_i = lambda tree: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)
        new_p, new_s = update(STACKED, *_device((at_i(stored[0]), at_i(grads_stack), at_i(stored[1]))))
        new = _host((new_p, new_s[: len(at_s[STACKED])]))
        return jax.tree.map(lambda a, x: lax.dynamic_update_index_in_dim(a, x, i, 0), stored, new)

    layers = jax.tree.leaves(params[stack])[0].shape[0]
    stored = (pick(p_leaves, at_p[STACKED]), pick(s_leaves, at_s[STACKED]))
    stack_p, stack_s = lax.fori_loop(0, layers, layer, stored)
    top = (pick(p_leaves, at_p[WHOLE]), pick(g_leaves, at_p[WHOLE]), pick(s_leaves, at_s[WHOLE]))
    # a barrier per weight and its gradient: the step's forward moved these weights to the device already, and
    # XLA would keep that copy (the embedding's and the head's, 4 GiB for Llama-3-8B) through the layers'
    # backward for this update (one barrier for all would type every output as varying where any input does)
    top_p, top_g = zip(*(lax.optimization_barrier(pair) for pair in zip(top[0], top[1]))) if top[0] else ((), ())
    top = (list(top_p), list(top_g), top[2])
    top_p, top_s = _host(update(WHOLE, *_device(top)))

    new_p, new_s = list(p_leaves), list(s_leaves)
    for at, values in ((at_p[STACKED], stack_p), (at_p[WHOLE], top_p)):
        for i, v in zip(at, values):
            new_p[i] = v
    for at, values in ((at_s[STACKED], stack_s), (at_s[WHOLE] + at_s[OTHER], top_s)):
        for i, v in zip(at, values):
            new_s[i] = v
    return p_def.unflatten(new_p), s_def.unflatten(new_s)
