"""Tree broadcast and reduce (used by Optimus SUMMA and METP's head-group weights): values and bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxring.analysis import compile_stats
from jaxring.core.collectives import tree_broadcast, tree_reduce, tree_rounds


def _mesh(n):
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_tree_broadcast_and_reduce(n):
    mesh = _mesh(n)
    x = jnp.arange(n * 3, dtype=jnp.float32).reshape(n, 3) ** 2

    @jax.jit
    def both(a, root):
        def local(a):
            return tree_broadcast(a, "x", root[0]), tree_reduce(a, "x", root[0])

        return jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x")))(a)

    for root in range(n):
        bcast, reduced = both(x, jnp.array([root]))
        np.testing.assert_array_equal(bcast, np.broadcast_to(x[root], x.shape))
        np.testing.assert_allclose(reduced[root], x.sum(0))


def test_tree_broadcast_bytes_are_log_rounds():
    n, block = 8, (64, 32)
    mesh = _mesh(n)

    def fn(a):
        return jax.shard_map(lambda a: tree_broadcast(a, "x", 3), mesh=mesh, in_specs=P("x"), out_specs=P("x"))(a)

    stats = compile_stats(fn, jax.ShapeDtypeStruct((n * block[0], block[1]), jnp.float32), num_devices=n)
    assert tree_rounds(n) == 3
    assert stats.bytes_moved["collective-permute"] == 3 * block[0] * block[1] * 4
    assert stats.total_bytes_moved == stats.bytes_moved["collective-permute"]


def test_every_cpu_collective_permute_has_its_own_channel():
    """XLA:CPU keys a collective-permute's in-process rendezvous by its channel id, and inside shard_map JAX
    gives every collective channel 1: back-to-back permutes (a tree broadcast's rounds) could meet in one
    rendezvous and abort (METP's tp=8 train step did, 3 runs in 5). jaxring lowers each with its own."""
    import re

    mesh = _mesh(8)
    run = jax.jit(jax.shard_map(lambda a: tree_broadcast(a, "x", 0), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jnp.arange(8.0)
    channels = re.findall(r"collective-permute(?:-start)?\(.*channel_id=(\d+)", run.lower(x).compile().as_text())
    assert len(channels) == tree_rounds(8) and len(set(channels)) == len(channels), channels
    np.testing.assert_array_equal(run(x), np.zeros(8))
