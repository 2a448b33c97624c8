"""Varying mesh axes (shard_map's check_vma types): which axes a value varies over, and casts to more.

Casting a replicated value to "varying" is the identity forward; its transpose is a psum over the added
axes, which is how a weight replicated over the data axes gets its summed gradient.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
from jax import lax


def varying_axes(x: jax.typing.ArrayLike) -> frozenset:
    """The mesh axes x varies over (empty outside shard_map, or with check_vma=False)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", frozenset()))


def vary(x: jax.Array, axes: Iterable[str]) -> jax.Array:
    """x made varying over `axes` as well."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """x made varying over every axis `like` varies over (e.g. a loop carry that will mix with `like`)."""
    return vary(x, varying_axes(like))


def sum_like(g: jax.Array, like: jax.Array) -> jax.Array:
    """g summed over the axes it varies over and `like` does not: a custom VJP's gradient of a weight replicated
    over the data axes (the psum of its per-shard gradients), typed as the weight."""
    extra = tuple(sorted(varying_axes(g) - varying_axes(like)))
    return lax.psum(g, extra) if extra else g


def common_vma(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """Every array of the pytree(s) cast to the union of their varying axes (None leaves stay None)."""
    axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(xs)))
    return jax.tree.map(lambda x: vary(x, axes), xs)


def gather_invariant(x: jax.Array, axes: str | tuple[str, ...], axis: int) -> jax.Array:
    """All-gather of x's pieces along `axis` over the mesh `axes`, typed replicated over them (its transpose is
    a slice: the caller's cotangent is already the same everywhere)."""
    return lax.all_gather(x, axes, axis=axis, tiled=True, to="invarying")
