"""Collective byte counting on compiled programs, loops included."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring.analysis import compile_stats


def test_counts_each_kind_and_loop_iterations():
    mesh = jaxring.make_mesh(dp=2, sp=4)

    def local(x):
        def hop(c, _):
            return lax.ppermute(c, "sp", [(i, (i + 1) % 4) for i in range(4)]) * 2, None

        y, _ = lax.scan(hop, x, jnp.arange(3))  # 3 hops of 16 floats
        g = lax.all_gather(y, "sp", tiled=True)  # receives 3 x 16 floats
        s = lax.psum_scatter(g, "sp", tiled=True)  # 3 x 16 received
        a = lax.all_to_all(s.reshape(4, 4), "sp", 0, 0, tiled=True)  # 3/4 of 16
        return a.reshape(-1) + lax.psum(y, "dp")  # all-reduce over 2: 16

    run = jax.shard_map(local, mesh=mesh, in_specs=P(("dp", "sp")), out_specs=P(("dp", "sp")))
    stats = compile_stats(run, jax.ShapeDtypeStruct((128,), jnp.float32))
    assert stats.collective_ops["collective-permute"] == 3
    assert stats.bytes_moved == {
        "collective-permute": 3 * 64,
        "all-gather": 3 * 64,
        "reduce-scatter": 3 * 64,
        "all-to-all": 48,
        "all-reduce": 64,
    }
    assert stats.temp_bytes >= 0 and stats.argument_bytes == 64
