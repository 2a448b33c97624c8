"""Device meshes with jaxring's axis names: dp, pp, fsdp, ep, sp, tp (outermost to innermost)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxring.core.torus import is_tpu_grid, torus_ring

# tp innermost (neighbouring devices, fastest links), then sp, then ep; data axes outermost.
MESH_AXES = ("dp", "pp", "fsdp", "ep", "sp", "tp")
# the axes that split the batch; ep (expert parallel) is data parallel outside the MoE layers
DATA_AXES = ("dp", "fsdp", "ep")


def make_mesh(
    dp: int = 1,
    fsdp: int = 1,
    pp: int = 1,
    tp: int = 1,
    sp: int = 1,
    ep: int = 1,
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_types: str = "auto",
) -> Mesh:
    """A mesh with all six axes (size-1 axes included, so every PartitionSpec can name them). Devices are
    ordered by `jax.make_mesh` (torus-aware on TPUs), except one axis over all of a TPU slice: along a closed
    path of the torus (`jaxring.core.torus`: one ICI hop per ring step, which jax's order misses on 2x4 grids).

    Args:
      dp, fsdp, pp, tp, sp, ep: degrees; their product must equal the number of devices.
      devices: the devices to use (default: all of `jax.devices()`).
      axis_types: "auto" (XLA places arrays; shard_map reshards its inputs) or "explicit" (sharding is part
        of the array type, as `jax.make_mesh` defaults to). `sharded_attention` accepts either.
    """
    degrees = {"dp": dp, "pp": pp, "fsdp": fsdp, "ep": ep, "sp": sp, "tp": tp}
    for name, size in degrees.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh degree {name}={size!r} must be a positive integer")
    devices = list(jax.devices() if devices is None else devices)
    product = math.prod(degrees.values())
    if product != len(devices):
        given = " × ".join(f"{n}={s}" for n, s in degrees.items() if s > 1) or "all 1"
        raise ValueError(
            f"mesh degrees {given} multiply to {product}, but there are {len(devices)} devices; "
            f"the product must equal the device count"
        )
    kinds = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
    if axis_types not in kinds:
        raise ValueError(f"axis_types {axis_types!r} must be 'auto' or 'explicit'")
    shape = tuple(degrees[a] for a in MESH_AXES)
    types = (kinds[axis_types],) * len(MESH_AXES)
    if is_tpu_grid(devices) and sum(s > 1 for s in shape) == 1:  # one ring over the whole slice: along the torus
        return Mesh(np.array(torus_ring(devices), dtype=object).reshape(shape), MESH_AXES, axis_types=types)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    except NotImplementedError:  # a TPU axis that is no product of whole torus axes (sp8 on 4x4x4): split them
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=types)


def mesh_axis_size(mesh: Mesh, axis: str) -> int:
    """The size of `axis` in `mesh` (1 when the mesh has no such axis)."""
    return mesh.shape[axis] if axis in mesh.axis_names else 1


def spec_entry(axes: str | Sequence[str] | None) -> str | tuple[str, ...] | None:
    """The PartitionSpec entry for a tuple of mesh axes: None, one name, or the tuple."""
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def is_explicit(mesh: Mesh) -> bool:
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def place(x: jax.typing.ArrayLike, mesh: Mesh, spec: PartitionSpec) -> jax.Array:
    """Puts x in `spec` on `mesh`: needed before a shard_map on Explicit axes, harmless on Auto ones."""
    sharding = NamedSharding(mesh, spec)
    if is_explicit(mesh):
        return jax.sharding.reshard(x, sharding)
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)


def factored_mesh(mesh: Mesh, axis: str, names: tuple[str, ...], sizes: tuple[int, ...]) -> Mesh:
    """The same devices with `axis` split into `names` of `sizes` (the last one innermost)."""
    if math.prod(sizes) != mesh.shape[axis]:
        raise ValueError(
            f"{' × '.join(f'{n}={s}' for n, s in zip(names, sizes))} must multiply to {axis} = {mesh.shape[axis]}"
        )
    i = mesh.axis_names.index(axis)
    devices = np.asarray(mesh.devices)
    devices = devices.reshape(devices.shape[:i] + tuple(sizes) + devices.shape[i + 1 :])
    axis_names = mesh.axis_names[:i] + tuple(names) + mesh.axis_names[i + 1 :]
    axis_types = mesh.axis_types[:i] + (mesh.axis_types[i],) * len(names) + mesh.axis_types[i + 1 :]
    return Mesh(devices, axis_names, axis_types=axis_types)
