"""A compiled program's bytes per mesh-axis group, read from its HLO.

    traffic = axis_traffic(compiled.as_text(), plan.run_mesh)   # {("sp",): bytes, ("dp", "sp"): bytes, ...}

`axis_traffic` splits what `jaxring.analysis.compiled.collective_traffic` counts (bytes received per device,
loop bodies times their trip count, a conditional's branches as they run, the same per-kind factors) by the
mesh axes each op's devices differ in: an all-reduce over replica groups spanning dp and sp counts under
("dp", "sp"); a collective-permute under the axes its source-target pairs differ in. Device index i in the HLO
is `mesh.devices.flat[i]`. Rank-0 (scalar) arrays are left out: the loss and the norm's pieces move a few bytes.
The planner's cost model (`jaxring.planner.cost_model.bytes_by_axes`) predicts these numbers; tests/unit/planner/test_planner.py
compares the two on compiled train steps (`jaxring.aot.train_step`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
from jax.sharding import Mesh

from jaxring.analysis.compiled import collective_ops, received_factor, replica_groups

_PAIRS = re.compile(r"source_target_pairs=\{(.*?)\}\}")


def _axes_spanned(
    members: Sequence[int], coords: Mapping[int, tuple[int, ...]], names: Sequence[str]
) -> tuple[str, ...]:
    """The mesh axes along which the devices `members` differ (in mesh order)."""
    c = np.array([coords[i] for i in members])
    return tuple(n for j, n in enumerate(names) if len(set(c[:, j])) > 1)


def axis_traffic(hlo_text: str, mesh: Mesh, *, skip_scalars: bool = True) -> dict[tuple[str, ...], int]:
    """{mesh axes an op spans: bytes received per device} for a program compiled over `mesh`."""
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
            groups = replica_groups(line, mesh.devices.size)
            g = len(groups[0])
            key = tuple(n for n in names if any(n in _axes_spanned(gr, coords, names) for gr in groups))
        if not key:
            continue  # a device talking to itself moves nothing
        out[key] = out.get(key, 0) + round(size * received_factor(kind, g)) * times
    return {key: round(v) for key, v in out.items()}  # a conditional's declared branch shares: Fractions
