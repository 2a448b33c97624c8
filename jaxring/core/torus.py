"""A ring of TPU chips along their ICI torus: each device's ring neighbour one link away.

    order = torus_ring(devices)        # the devices along a closed path of the chip grid (a Hamiltonian cycle)
    ring_hops(order)                   # ICI hops between ring neighbours, [1, 1, ..., 1] for a torus ring

`jax.make_mesh` orders TPU devices torus-aware (mesh_utils.create_device_mesh), but for a one-axis mesh over
a 2x4 (v5e, v6e) or 2x2 (v5p-8) grid its ring steps alternate 1 and 2 hops (jax 0.12.0, deviceless topologies);
`jaxring.make_mesh` uses this order when one axis spans all the TPUs, jax's otherwise. A chip's cores (TPU7x:
two devices per chip) sit next to each other in the ring.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import numpy as np


def _coords(d: jax.Device) -> tuple[int, ...] | None:
    c = getattr(d, "coords", None)
    return tuple(int(x) for x in c) if c is not None else None


def is_tpu_grid(devices: Sequence[jax.Device]) -> bool:
    """Whether every device is a TPU with chip coordinates."""
    return bool(devices) and all(getattr(d, "platform", "") == "tpu" and _coords(d) is not None for d in devices)


def _snake(dims: Sequence[int]) -> list[tuple[int, ...]]:
    """Every point of a grid of `dims`, consecutive points one step apart (reflected mixed-radix order)."""
    if not dims:
        return [()]
    rest = _snake(dims[1:])
    return [(i, *p) for i in range(dims[0]) for p in (rest if i % 2 == 0 else rest[::-1])]


def _cycle(dims: Sequence[int]) -> list[tuple[int, ...]]:
    """A closed path through every point of a grid (one step between neighbours, the last back to the first),
    when some dimension is even; else the snake path (its closing step is longer)."""
    dims = list(dims)
    even = next((i for i, n in enumerate(dims) if n % 2 == 0 and n > 1), None)
    big = [i for i, n in enumerate(dims) if n > 1]
    if even is None or len(big) < 2:
        return _snake(dims)
    other = next(i for i in big if i != even)
    rest = [i for i in range(len(dims)) if i not in (even, other)]
    # a 2D cycle over (the even axis) x (a snake path through the other axes), the first column kept for the return
    path = _snake([dims[other]] + [dims[i] for i in rest])
    rows, cols = dims[even], len(path)
    cells = [(0, c) for c in range(cols)]
    for r in range(1, rows):
        span = range(cols - 1, 0, -1) if r % 2 == 1 else range(1, cols)
        cells += [(r, c) for c in span]
    cells += [(r, 0) for r in range(rows - 1, 0, -1)]
    out = []
    for r, c in cells:
        p = [0] * len(dims)
        p[even] = r
        p[other] = path[c][0]
        for i, v in zip(rest, path[c][1:]):
            p[i] = v
        out.append(tuple(p))
    return out


def torus_ring(devices: Sequence[jax.Device]) -> list[jax.Device]:
    """`devices` (TPUs) ordered along a closed path of their chip grid; a chip's devices kept together."""
    if not is_tpu_grid(devices):
        raise ValueError("torus_ring needs TPU devices with chip coordinates")
    chips: dict[tuple[int, ...], list] = {}
    for d in devices:
        chips.setdefault(_coords(d), []).append(d)
    lo = np.min(list(chips), axis=0)
    dims = tuple(int(n) for n in np.max(list(chips), axis=0) - lo + 1)
    if int(np.prod(dims)) != len(chips):
        raise ValueError(f"the {len(chips)} chips do not fill their {'x'.join(map(str, dims))} grid")
    order = [tuple(int(x) for x in np.add(p, lo)) for p in _cycle(dims)]
    return list(itertools.chain.from_iterable(sorted(chips[p], key=lambda d: d.id) for p in order))


def ring_hops(ring: Sequence[jax.Device], wrap: bool = False) -> list[int]:
    """ICI hops from each device of `ring` to the next (the last to the first): the chips' Manhattan distance
    (0 between a chip's own devices); wrap: the grid's edges are joined (a torus: v5p from 4x4x4)."""
    coords = np.array([_coords(d) for d in ring])
    dims = coords.max(axis=0) - coords.min(axis=0) + 1
    step = np.abs(coords - np.roll(coords, -1, axis=0))
    if wrap:
        step = np.minimum(step, dims - step)
    return [int(x) for x in step.sum(axis=1)]
