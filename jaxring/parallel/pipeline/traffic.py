"""Bytes each pair of pipeline stages exchanges in a compiled program, read from its HLO.

`jaxring.analysis.compiled` counts a collective-permute's bytes per op; a pipeline tick's permute has only the
pairs that really send, so what matters is per (source, target) pair: every collective-permute's result bytes
are added to each of its source-target pairs, loop bodies weighted by their trip count (the same conventions
and HLO walk as compiled.py).
"""

from __future__ import annotations

import re

import numpy as np
from jax.sharding import Mesh

from jaxring.analysis.compiled import computation_runs, hlo_computations, shape_bytes

_PERMUTE = re.compile(r"=\s*(\(.*?\)|\S+)\s+collective-permute(-start)?\(")
_ARRAY = re.compile(r"[a-z]+[0-9]*\[[0-9,]*\]")


def permute_bytes_by_pair(hlo_text: str) -> dict[tuple[int, int], int]:
    """{(source, target) device index in the program: bytes sent per run}."""
    comps, entry = hlo_computations(hlo_text)
    moved: dict[tuple[int, int], int] = {}
    for name, times in computation_runs(comps, entry).items():
        for line in comps[name]:
            op = _PERMUTE.search(line)
            if not op:
                continue
            size = shape_bytes(op.group(1))
            if op.group(2):  # async start: (operand, result, ...): the result
                size = shape_bytes(_ARRAY.findall(op.group(1))[1])
            pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line).group(1)
            for a, b in re.findall(r"(\d+),(\d+)", pairs):
                moved[(int(a), int(b))] = moved.get((int(a), int(b)), 0) + size * times
    return moved


def stage_link_bytes(hlo_text: str, mesh: Mesh, axis_name: str = "pp") -> dict[tuple[int, int], int]:
    """{(source stage, target stage): bytes per replica} for a program compiled over `mesh` (device index i is
    mesh.devices.flat[i]). Raises if a permute connects devices that differ in another mesh axis, or if the
    replicas (the other axes' coordinates) do not all move the same bytes."""
    coords = {i: np.array(np.unravel_index(i, mesh.devices.shape)) for i in range(mesh.devices.size)}
    axis = mesh.axis_names.index(axis_name)
    per_link: dict[tuple[int, int], dict[tuple, int]] = {}
    for (src, dst), size in permute_bytes_by_pair(hlo_text).items():
        a, b = coords[src], coords[dst]
        rest = tuple(np.delete(a, axis))
        if rest != tuple(np.delete(b, axis)):
            raise ValueError(
                f"a collective-permute connects devices {src} and {dst}, which differ outside {axis_name!r}"
            )
        per_link.setdefault((int(a[axis]), int(b[axis])), {})[rest] = size
    replicas = mesh.devices.size // mesh.shape[axis_name]
    out = {}
    for link, sizes in per_link.items():
        if len(sizes) != replicas or len(set(sizes.values())) != 1:
            raise ValueError(
                f"stage link {link} moves {sorted(sizes.values())} bytes over {len(sizes)} of "
                f"{replicas} replicas; expected the same on every replica"
            )
        out[link] = next(iter(sizes.values()))
    return dict(sorted(out.items()))
