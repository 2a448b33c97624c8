"""What every deviceless compile (GPU or TPU targets, no accelerator present) needs: the CPU platform selected
before JAX starts a backend, and abstract arguments sharded over a mesh of the target's abstract devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax

from jaxring.core import compat

if TYPE_CHECKING:
    from jax.sharding import Mesh, PartitionSpec


def use_deviceless() -> None:
    """Selects the CPU platform (required by deviceless GPU compilation) if no backend has started yet."""
    if not compat.backends_started():
        jax.config.update("jax_platforms", "cpu")


def abstract(
    shape: Sequence[int], dtype: jax.typing.DTypeLike, mesh: Mesh, spec: PartitionSpec | None = None
) -> jax.ShapeDtypeStruct:
    """A `jax.ShapeDtypeStruct` sharded as `spec` (default replicated) over `mesh`."""
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, spec or PartitionSpec()))
