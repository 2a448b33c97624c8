"""Collective byte counting on compiled programs, loops and conditionals included."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring.analysis import compile_stats
from jaxring.analysis.compiled import branch_runs, replica_groups


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


def test_a_switch_counts_the_branch_each_device_runs():
    """A lax.switch in a 6-trip loop, its branch index data (tick + pp rank): each device runs each branch twice,
    2 ring hops of 64 B, an all-gather over 4 receiving 3 x 64 B, or nothing: 2 x 128 + 2 x 192 = 640 B. Declared
    (`branch_runs`: each branch runs 4 of the 6 x 2 (tick, stage) pairs) the count is exact; undeclared the
    index is unknown and the largest branch counts every tick (6 x 192 B, an upper bound), never the sum of
    the branches (6 x 320 B, what every tick would move if a device ran them all)."""
    mesh = jaxring.make_mesh(pp=2, sp=4)
    ring = [(i, (i + 1) % 4) for i in range(4)]
    branches = [
        lambda x: lax.ppermute(lax.ppermute(x, "sp", ring), "sp", ring),
        lambda x: lax.all_gather(x, "sp", tiled=True)[:16] * 2,
        lambda x: x + 1,
    ]

    def stats(declare: bool):
        def declared(branch):
            def run(x):
                if not declare:
                    return branch(x)
                with branch_runs(4, 12):
                    return branch(x)

            return run

        def local(x):
            tick = lambda t, x: lax.switch((t + lax.axis_index("pp")) % 3, [declared(b) for b in branches], x)
            return lax.fori_loop(0, 6, tick, x)

        run = jax.shard_map(local, mesh=mesh, in_specs=P(("pp", "sp")), out_specs=P(("pp", "sp")))
        return compile_stats(run, jax.ShapeDtypeStruct((128,), jnp.float32))

    exact = stats(declare=True)
    assert exact.bytes_moved["collective-permute"] == 2 * 2 * 64
    assert exact.bytes_moved["all-gather"] == 2 * 3 * 64
    assert exact.collective_ops["collective-permute"] == 4 and exact.collective_ops["all-gather"] == 2
    bound = stats(declare=False)
    assert bound.bytes_moved["collective-permute"] == 0  # the smaller branch: not taken for the bound
    assert bound.bytes_moved["all-gather"] == 6 * 3 * 64


def test_a_pipeline_counts_the_stage_branches_each_device_runs():
    """1F1B over pp=2 (m=4) with a ring hop over sp=4 in every stage's forward (and its transpose backward):
    each device runs 4 forwards and 4 backwards of its stage's branch, 8 hops of one activation (b=1, 8 tokens
    of 16 floats: 512 B), however the ticks fall into loops and switch branches. Over pp, outside the switch:
    one activation per sending tick, 4 forward and 4 backward. Once a step, the weight's gradient (one float) is
    all-reduced over sp: 2 (4 - 1) / 4 x 4 B."""
    from jaxring.analysis.axis_traffic import axis_traffic
    from jaxring.core.collectives import ppermute
    from jaxring.parallel.pipeline import make_schedule, pipeline_loss_and_grads

    mesh = jaxring.make_mesh(pp=2, sp=4)
    m, ring = 4, [(i, (i + 1) % 4) for i in range(4)]

    def local(w, x):
        out = pipeline_loss_and_grads(
            make_schedule("1f1b", 2, m),
            embed_fn=lambda shared, mb: mb * shared,
            stage_fn=lambda chunk, x, mb: x + ppermute(x * chunk[0], "sp", ring),
            loss_fn=lambda shared, y, mb: (jnp.sum(y**2), {"z": jnp.sum(y)}),
            stage_params=w,
            shared_params=jnp.ones(()),
            microbatches=x,
            stage_permute="ppermute",
        )
        return out[2]

    run = jax.shard_map(local, mesh=mesh, in_specs=(P("pp"), P(None, None, "sp")), out_specs=P("pp"))
    w = jax.ShapeDtypeStruct((2, 1), jnp.float32)
    compiled = jax.jit(run).lower(w, jax.ShapeDtypeStruct((m, 1, 32, 16), jnp.float32)).compile()
    activation = 8 * 16 * 4
    assert axis_traffic(compiled.as_text(), mesh) == {("pp",): 2 * m * activation, ("sp",): 2 * m * activation + 6}


def test_replica_groups_in_each_of_xlas_forms():
    """Listed, iota (with a transpose) and, since jax 0.11's XLA, mesh axes: the same groups of a 2 x 4 mesh."""
    over_b = [[0, 1, 2, 3], [4, 5, 6, 7]]
    over_a = [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert replica_groups("x, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", 8) == over_b
    assert replica_groups("x, replica_groups=[2,4]<=[8], dimensions={0}", 8) == over_b
    assert replica_groups("x, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add", 8) == over_a
    assert replica_groups("x, replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}", 8) == over_b
    assert replica_groups("x, replica_groups=mesh['a'=2,'b'=4] {'a'}, to_apply=%add", 8) == over_a
    assert replica_groups("x, replica_groups=mesh['a'=2,'b'=4] {'a','b'}, to_apply=%add", 8) == [list(range(8))]
    assert replica_groups("x, replica_groups={}, to_apply=%add", 8) == [list(range(8))]
    with pytest.raises(ValueError, match="do not name axes of a mesh of 4 devices"):
        replica_groups("x, replica_groups=mesh['a'=2,'b'=4] {'b'}", 4)
