"""make_mesh and sharded_attention with unsharded, Auto- and Explicit-sharded inputs."""

import jax
import pytest
from helpers import assert_close, qkv
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxring


def test_axes_and_degrees():
    mesh = jaxring.make_mesh(dp=2, sp=4)
    assert mesh.axis_names == jaxring.MESH_AXES
    assert dict(mesh.shape) == {"dp": 2, "pp": 1, "fsdp": 1, "ep": 1, "sp": 4, "tp": 1}


def test_product_must_equal_device_count():
    with pytest.raises(ValueError, match=r"dp=2 × sp=2 multiply to 4, but there are 8 devices"):
        jaxring.make_mesh(dp=2, sp=2)
    with pytest.raises(ValueError, match=r"tp=0"):
        jaxring.make_mesh(tp=0, sp=8)


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
@pytest.mark.parametrize("presharded", [False, True])
def test_attention_on_auto_and_explicit_meshes(axis_types, presharded):
    mesh = jaxring.make_mesh(dp=2, sp=4, axis_types=axis_types)
    q, k, v, _ = qkv(0, 2, 32, 4, 2, 8)
    if presharded:  # the caller's own sharding (batch over dp, heads replicated), not the one we need
        q, k, v = (jax.device_put(x, NamedSharding(mesh, P("dp"))) for x in (q, k, v))
    out = jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="ring", layout="zigzag")
    out_jit = jax.jit(lambda q, k, v: jaxring.sharded_attention(q, k, v, mesh=mesh))(q, k, v)
    expected = jaxring.attention_reference(q, k, v, causal=True)[0]
    assert_close(out, expected, 2e-5, "eager")
    assert_close(out_jit, expected, 2e-5, "jit")


@pytest.mark.parametrize(
    "strategy,options",
    [("rsa", {}), ("ulysses", {}), ("allgather", {}), ("usp", dict(ulysses_size=2)), ("wallfacer", dict(team_size=2))],
)
def test_every_strategy_on_an_explicit_mesh(strategy, options):
    """Factored views (USP, WallFacer) keep the axis types; inputs sharded the caller's way are resharded."""
    mesh = jaxring.make_mesh(dp=2, sp=4, axis_types="explicit")
    q, k, v, _ = qkv(1, 2, 32, 4, 2, 8)
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P("dp"))) for x in (q, k, v))
    out = jax.jit(lambda q, k, v: jaxring.sharded_attention(q, k, v, mesh=mesh, strategy=strategy, **options))(q, k, v)
    assert_close(out, jaxring.attention_reference(q, k, v, causal=True)[0], 2e-5, strategy)
