"""How the tensor methods split a model's sizes over their devices: divisibility checks with the values in
the message, the K/V heads over a tensor group (fewer K/V heads than tp: each replicated, every rank keeping
its own), and the mesh axes a global-array entry point may not use.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax

from jaxring.core.mesh import DATA_AXES

if TYPE_CHECKING:
    from jax.sharding import Mesh


def check_divisible(what: str, value: int, by: int, by_name: str, why: str = "") -> None:
    """Raises "{what} {value} is not divisible by {by_name} = {by}{why}" unless by divides value."""
    if value % by:
        raise ValueError(f"{what} {value} is not divisible by {by_name} = {by}{why}")


def check_kv_heads(num_heads: int, num_kv_heads: int, tp: int, method: str) -> None:
    """Heads split over tp; K/V heads split too, or (fewer than tp) each replicated on tp / kv_heads ranks."""
    check_divisible("num_heads", num_heads, tp, "tp", f" ({method} splits the heads over tp)")
    if num_kv_heads >= tp:
        check_divisible(
            "num_kv_heads", num_kv_heads, tp, "tp", " (kv heads >= tp are split over tp; fewer than tp must divide tp)"
        )
    elif tp % num_kv_heads:
        raise ValueError(
            f"num_kv_heads {num_kv_heads} < tp = {tp} must divide tp (each kv head is replicated on "
            f"tp / num_kv_heads ranks)"
        )


def own_kv_head(w: dict, num_kv_heads: int, tp: int, head_dim: int, axis_name: str = "tp") -> dict:
    """K/V heads replicated over a tensor group (num_kv_heads < tp, dividing it; Megatron-LM's way): w's wk,
    wv [h, hkv·d] (and bk, bv) are whole on every rank, and rank r keeps its K/V head r // (tp / hkv). The
    slice's transpose, with the weights typed replicated over the axis, sums the replicas' gradients.
    Returns w unchanged when num_kv_heads >= tp."""
    if num_kv_heads >= tp:
        return w
    head = jax.lax.axis_index(axis_name) // (tp // num_kv_heads)
    w = dict(w)
    for name in ("wk", "wv", "bk", "bv"):
        if name in w:
            w[name] = jax.lax.dynamic_slice_in_dim(w[name], head * head_dim, head_dim, axis=w[name].ndim - 1)
    return w


def unusable_mesh_axes(mesh: Mesh, used: tuple[str, ...]) -> list[str]:
    """ "name=size" of the mesh axes larger than 1 that are neither data axes (dp, fsdp) nor in `used`."""
    return [f"{a}={mesh.shape[a]}" for a in mesh.axis_names if a not in DATA_AXES + used and mesh.shape[a] > 1]


def check_data_split(batch: int, mesh: Mesh, data_axes: tuple[str, ...]) -> None:
    """Raises unless the batch splits over the data axes (dp, fsdp) it is placed on."""
    data = math.prod(mesh.shape[a] for a in data_axes)
    if batch % data:
        raise ValueError(f"batch {batch} is not divisible by the data-parallel degree dp*fsdp = {data}")
