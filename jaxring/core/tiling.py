"""Tiling a per-token computation over the sequence, so its widest intermediate never exists whole.

The LM head with its cross-entropy ([tokens, vocab] logits) and the MLP ([tokens, ffn]) act on each token on
its own. Arctic Long Sequence Training [ALST] runs them tile by tile: the tokens of a device are cut into T
tiles, each tile's logits (or FFN activations) are computed, used and dropped, and the backward recomputes
them tile by tile (a custom VJP: see `over_tiles`). Memory: one tile's [tokens/T, vocab] instead of [tokens, vocab]; compute: the tile's
forward again in the backward (as remat does); results and gradients: the same as untiled.

    y = over_tiles(lambda x: mlp(x), tiles=4, arrays=(x,))        # x [b, n, h] -> y [b, n, h]

Inside the step's shard_map the arrays are this device's shards; a tensor method whose layer gathers its
tokens over tp (Megatron) still sees each tile as a block of its own rows: the per-token result comes back to
the same rows (`TensorMethod.tile_targets` arranges the token-layout targets to match).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.core.vma import vary_like

__all__ = ["over_tiles", "tile_count"]


def tile_count(rows: int, tile: int | None, what: str) -> int:
    """How many tiles of `tile` rows cut `rows` (1 when untiled); one line when they do not divide."""
    if tile is None or tile >= rows:
        return 1
    if rows % tile:
        divisors = [d for d in range(1, rows + 1) if rows % d == 0 and d <= tile]
        raise ValueError(
            f"{what} {tile} does not divide the {rows} rows of the residual stream on a device; use a divisor "
            f"of {rows} (e.g. {divisors[-1]})"
        )
    return rows // tile


def over_tiles(fn: Callable[..., Any], tiles: int, arrays: tuple, axis: int = 1) -> Any:
    """fn(*tile_of_each_array) on `tiles` equal consecutive tiles along `axis` of every array, one tile at a
    time (a `lax.map`); the results (a pytree of arrays with the same tiled axis) concatenated back along
    `axis`. The backward recomputes each tile's forward from its inputs and takes its VJP, one tile at a time,
    summing the gradients of what `fn` closes over (the weights): a custom VJP, so that no remat policy of an
    enclosing `jax.checkpoint` can save the tiles' intermediates (a nested checkpoint's own policy yields to
    the outer one's in JAX). Residuals: the tiled inputs and the closed-over arrays."""
    if tiles == 1:
        return fn(*arrays)

    def split(a: jax.Array):
        n = a.shape[axis]
        return jnp.moveaxis(a.reshape(a.shape[:axis] + (tiles, n // tiles) + a.shape[axis + 1 :]), axis, 0)

    def merge(o: jax.Array):
        o = jnp.moveaxis(o, 0, axis)
        return o.reshape(o.shape[:axis] + (o.shape[axis] * o.shape[axis + 1],) + o.shape[axis + 2 :])

    parts = tuple(split(a) for a in arrays)
    closed, consts = jax.closure_convert(fn, *(p[0] for p in parts))
    return jax.tree.map(merge, _tiled(closed, parts, tuple(consts)))


def _differentiable(a: jax.Array) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled(fn: Callable[..., Any], parts: tuple[jax.Array, ...], consts: tuple[jax.Array, ...]):
    return lax.map(lambda p: fn(*p, *consts), parts)


def _tiled_fwd(fn: Callable[..., Any], parts: tuple[jax.Array, ...], consts: tuple[jax.Array, ...]):
    return _tiled(fn, parts, consts), (parts, consts)


def _tiled_bwd(fn: Callable[..., Any], residuals: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]], g: Any):
    """Per tile: its forward again and its VJP; d(consts) summed over the tiles (the first tile's seeds the
    sum, so it has the type the VJP gives; the sum is fp32, cast back at the end), d(parts) written in place into one stacked buffer per part. The
    tiles are read where they lie (a dynamic index of the stacked inputs and cotangents): no copy of the
    tiles after the first, nor of the stacked gradients, beside them."""
    parts, consts = residuals
    diff = [i for i, p in enumerate(parts) if _differentiable(p)]
    tiles = parts[0].shape[0]

    def tile_vjp(i: jax.Array | int):
        p, g_tile = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), (parts, g))

        def f(dp: list[jax.Array], c: tuple[jax.Array, ...]):
            q = list(p)
            for k, a in zip(diff, dp, strict=True):
                q[k] = a
            return fn(*q, *c)

        _, vjp = jax.vjp(f, [p[k] for k in diff], consts)
        return vjp(g_tile)

    def stacked(d: jax.Array) -> jax.Array:  # the first tile's gradient in a buffer for all of them
        buffer = vary_like(jnp.zeros((tiles,) + d.shape, d.dtype), d)
        return lax.dynamic_update_index_in_dim(buffer, d, 0, 0)

    d_first, d_consts = tile_vjp(0)

    def step(i: jax.Array, carry: tuple) -> tuple:
        acc, out = carry
        d_parts, d_c = tile_vjp(i)
        out = jax.tree.map(lambda o, d: lax.dynamic_update_index_in_dim(o, d, i, 0), out, d_parts)
        return jax.tree.map(lambda a, d: a + _fp32(d), acc, d_c), out

    sums = jax.tree.map(_fp32, d_consts)
    sums, d_diff = lax.fori_loop(1, tiles, step, (sums, jax.tree.map(stacked, d_first)))
    d_consts = jax.tree.map(lambda total, d: total.astype(d.dtype) if _differentiable(d) else total, sums, d_consts)
    d_parts = [None] * len(parts)
    for k, d in zip(diff, d_diff, strict=True):
        d_parts[k] = d
    return tuple(d_parts), d_consts


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def _fp32(d: jax.Array) -> jax.Array:
    """A weight gradient as the tiles' sum accumulates it: in fp32 (a bf16 weight's tiles are not rounded to
    bf16 at every addition); an integer const's float0 cotangent as it is."""
    return d.astype(jnp.float32) if _differentiable(d) else d
