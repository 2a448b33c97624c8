"""Global-array entry points built on local functions: one shared `shard_map` runner.

Layers are local functions that run inside a shard_map the caller owns (the train step's). The convenience
entry points on global arrays (`sharded_attention`, the tensor methods' `mlp_block`, `attention_block`, ...)
are thin wrappers: they place their arguments and call `run_local`, which jits one shard_map per
(function, mesh, specs, static options) and reuses it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxring.core.mesh import place


def run_local(
    local_fn: Callable[..., Any],
    mesh: Mesh,
    in_specs: Sequence[Any],
    out_specs: Any,
    *args,
    check_vma: bool = True,
    **static,
) -> Any:
    """`local_fn(*args, **static)` inside `shard_map` over `mesh`, on global args placed as `in_specs` says.

    static: hashable keyword options (they key the compiled program)."""
    placed = [
        {k: place(v, mesh, spec[k]) for k, v in a.items()} if isinstance(a, dict) else place(a, mesh, spec)
        for a, spec in zip(args, in_specs)
    ]
    return _compiled(local_fn, mesh, _freeze(in_specs), out_specs, check_vma, tuple(sorted(static.items())))(*placed)


def _freeze(specs: Any):
    """Spec trees with dicts as sorted item tuples (hashable cache keys)."""
    if isinstance(specs, dict):
        return ("__dict__", tuple((k, _freeze(v)) for k, v in sorted(specs.items())))
    if isinstance(specs, (list, tuple)) and not isinstance(specs, jax.sharding.PartitionSpec):
        return tuple(_freeze(s) for s in specs)
    return specs


def _thaw(specs: Any):
    if isinstance(specs, tuple) and len(specs) == 2 and specs[0] == "__dict__":
        return {k: _thaw(v) for k, v in specs[1]}
    if isinstance(specs, tuple) and not isinstance(specs, jax.sharding.PartitionSpec):
        return tuple(_thaw(s) for s in specs)
    return specs


@functools.lru_cache(maxsize=512)
def _compiled(
    local_fn: Callable[..., Any],
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool,
    static: tuple[tuple[str, Hashable], ...],
):
    fn = functools.partial(local_fn, **dict(static))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=_thaw(in_specs), out_specs=out_specs, check_vma=check_vma))
