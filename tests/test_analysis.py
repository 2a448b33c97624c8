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


def test_counts_the_results_of_combined_async_collectives():
    """A GPU program's async starts: (operands, results) with a tuple of each when XLA combined several arrays
    into one op (the fused ring hop of K, V and segment ids; WallFacer's Q, K, V team gather): every result
    counts, not the second operand (lines from the deviceless H100 compile of WallFacer with documents)."""
    from jaxring.analysis.compiled import collective_traffic

    hlo = """HloModule step

ENTRY %main (p: f32[4]) -> f32[4] {
  %cp = ((u8[533504]{0}, f32[1,256,4,64]{3,2,1,0}), (u8[533504]{0}, f32[1,256,4,64]{3,2,1,0})) collective-permute-start(%a, %b), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %cp.1 = (s32[1,256]{1,0}, s32[1,256]{1,0}) collective-permute-start(%c), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %ag = ((f32[128,4]{1,0}, f32[128,4,64]{2,1,0}), (f32[256,4]{1,0}, f32[256,4,64]{2,1,0})) all-gather-start(%d, %e), channel_id=3, replica_groups={{0,1}}, dimensions={0}
  %ar = (f32[16]{0}, f32[8]{0}) all-reduce-start(%f, %g), channel_id=4, replica_groups={{0,1}}, to_apply=%add
}
"""
    moved, count = collective_traffic(hlo, 2)
    assert moved["collective-permute"] == 533504 + 1 * 256 * 4 * 64 * 4 + 256 * 4
    assert moved["all-gather"] == (256 * 4 + 256 * 4 * 64) * 4 // 2  # received: (g - 1) / g of the results
    assert moved["all-reduce"] == (16 + 8) * 4  # 2 (g - 1) / g of its results (its shape holds only them)
    assert count["collective-permute"] == 2
