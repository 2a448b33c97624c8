"""Each host's rows of a global batch: building global arrays from them, and copies on one device.

On a multi-host run every process reads only the rows of the global batch its devices hold
(`host_rows`) and builds the global array from them (`global_array`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["global_array", "host_rows", "to_one_device"]


def host_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """The contiguous range [lo, hi) of global batch rows this host's devices hold."""
    rows = [idx[0] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    lo = min(r.start or 0 for r in rows)
    hi = max(r.stop if r.stop is not None else global_shape[0] for r in rows)
    return lo, hi


def global_array(
    sharding: jax.sharding.Sharding, global_shape: tuple[int, ...], local_rows: np.ndarray, row0: int
) -> jax.Array:
    """A global array from this host's rows [row0, row0 + len(local_rows)) of the global batch."""

    def part(index: tuple[slice, ...]) -> np.ndarray:
        rows = index[0]
        start = (rows.start or 0) - row0
        stop = (rows.stop if rows.stop is not None else global_shape[0]) - row0
        return local_rows[(slice(start, stop), *tuple(index[1:]))]

    return jax.make_array_from_callback(global_shape, sharding, part)


def to_one_device(tree: Any, device: jax.Device) -> Any:
    """Every array of `tree` whole on `device` (gathered from the other hosts first when it spans them)."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            x = multihost_utils.process_allgather(x, tiled=True)
        return jax.device_put(x, device)

    return jax.tree.map(one, tree)
