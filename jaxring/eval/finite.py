"""NaN and Inf in loaded weights, named by tensor: one isfinite reduction per parameter, on its devices.

    bad = nonfinite_tensors(params, stacked=lambda path: path[0] == "blocks")
    # [(("blocks", "mlp", "w_in"), 3, 12, 0)]: layer 3 of blocks.mlp.w_in has 12 NaN and no Inf values

A stacked parameter ([layers, ...]) is counted per layer (the layer axis kept), so a message can name the one
layer's tensor (a Hugging Face checkpoint stores one tensor per layer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict

__all__ = ["describe_counts", "nonfinite_tensors"]


@functools.partial(jax.jit, static_argnums=1)
def _counts(leaves: list, keep_first: tuple) -> list:
    """[(NaN count, Inf count)] per leaf, summed over every axis but the first where keep_first says so."""
    out = []
    for x, keep in zip(leaves, keep_first):
        axes = tuple(range(1, x.ndim)) if keep else None
        out.append((jnp.isnan(x).sum(axes), jnp.isinf(x).sum(axes)))
    return out


def nonfinite_tensors(
    tree: dict, stacked: Callable[[tuple], bool] = lambda path: False
) -> list[tuple[tuple, int | None, int, int]]:
    """[(path, layer or None, NaN count, Inf count)] of the floating-point leaves of the nested dict `tree` that
    hold any NaN or Inf, in the tree's order; `stacked(path)`: the leaf's first axis is the layer."""
    flat = {
        path: x
        for path, x in flatten_dict(tree).items()
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    }
    paths = list(flat)
    keep = tuple(bool(stacked(p)) and flat[p].ndim >= 1 for p in paths)
    counts = jax.device_get(_counts([flat[p] for p in paths], keep))
    bad = []
    for path, keep_first, (nans, infs) in zip(paths, keep, counts):
        nans, infs = np.atleast_1d(nans), np.atleast_1d(infs)
        for layer in np.flatnonzero((nans > 0) | (infs > 0)):
            bad.append((path, int(layer) if keep_first else None, int(nans[layer]), int(infs[layer])))
    return bad


def describe_counts(nans: int, infs: int) -> str:
    """'12 NaN values', '3 Inf values' or '12 NaN and 3 Inf values'."""
    parts = [f"{n} {kind}" for n, kind in ((nans, "NaN"), (infs, "Inf")) if n]
    return " and ".join(parts) + " values"
