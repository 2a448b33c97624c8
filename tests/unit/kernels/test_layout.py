"""Layout round-trips with rank-coded inputs: every token's value is its natural position."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring import from_layout, layout_permutation, layout_positions, to_layout

MESHES = {2: dict(sp=2, dp=4), 4: dict(sp=4, dp=2), 8: dict(sp=8)}


@pytest.mark.parametrize("layout", jaxring.LAYOUTS)
@pytest.mark.parametrize("sp", [2, 4, 8])
def test_round_trip_is_exact(layout, sp):
    mesh = jaxring.make_mesh(**MESHES[sp])
    seq = 2 * sp * sp
    # [batch=2, seq, heads=3] coded with the position (and batch/head offsets so nothing aliases)
    x = (
        jnp.arange(seq)[None, :, None] + 1000 * jnp.arange(2)[:, None, None] + 100000 * jnp.arange(3)[None, None, :]
    ).astype(jnp.int32)
    spec = P(None, "sp", None)
    there = jax.shard_map(lambda a: to_layout(a, layout, "sp"), mesh=mesh, in_specs=spec, out_specs=spec)
    back = jax.shard_map(lambda a: from_layout(a, layout, "sp"), mesh=mesh, in_specs=spec, out_specs=spec)
    perm = layout_permutation(layout, seq, sp)
    laid = there(x)
    np.testing.assert_array_equal(np.asarray(laid), np.asarray(x)[:, perm])
    np.testing.assert_array_equal(np.asarray(back(laid)), np.asarray(x))
    # each rank's positions are the tokens it holds
    n = seq // sp
    held = np.asarray(laid)[0, :, 0].reshape(sp, n)
    for r in range(sp):
        np.testing.assert_array_equal(held[r], np.asarray(layout_positions(layout, r, sp, n)))


def test_zigzag_holds_chunks_r_and_2p_minus_1_minus_r():
    sp, seq = 4, 16
    perm = layout_permutation("zigzag", seq, sp).reshape(sp, 2, 2)
    for r in range(sp):
        assert perm[r, 0, 0] // 2 == r and perm[r, 1, 0] // 2 == 2 * sp - 1 - r


def test_layout_errors():
    with pytest.raises(ValueError, match="seq 12 is not divisible by 2\\*sp = 8"):
        layout_permutation("zigzag", 12, 4)
    with pytest.raises(ValueError, match="unknown layout 'spiral'"):
        layout_permutation("spiral", 16, 4)
