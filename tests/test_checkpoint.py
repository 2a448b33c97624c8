"""Checkpointer: bit-exact round trips, retention, atomicity, restoring onto another mesh, clear errors."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxring.mesh import make_mesh
from jaxring.train.checkpoint import Checkpointer

MODEL = {"num_layers": 2, "hidden": 16, "attention": {"strategy": "ring", "layout": "zigzag"}}
META = {"model": MODEL, "mesh": {"sp": 8}}


@pytest.fixture(scope="module")
def sp8():
    return make_mesh(sp=8)


@pytest.fixture(scope="module")
def dp2_sp4():
    return make_mesh(dp=2, sp=4)


def make_state(mesh, seed=0):
    """A train-state-like pytree: sharded f32 weights, bf16, int32, an optimizer NamedTuple, python ints."""
    import optax
    k = jax.random.split(jax.random.key(seed), 3)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))   # noqa: E731
    params = {"w": put(jax.random.normal(k[0], (16, 8)), P("sp", None)),
              "b": put(jax.random.normal(k[1], (8,)).astype(jnp.bfloat16), P())}
    opt = optax.adam(1e-3).init(params)
    return {"params": params, "opt": opt, "step": 7, "tokens": put(jnp.arange(64, dtype=jnp.int32), P("sp")),
            "rng": jax.random.key_data(k[2])}


def as_target(state, mesh=None, spec_of=None):
    """ShapeDtypeStructs carrying the shardings to restore onto (the state's own, or `mesh` + spec_of)."""
    def one(path, x):
        if not isinstance(x, jax.Array):
            return x
        sharding = x.sharding if mesh is None else NamedSharding(mesh, spec_of(path, x))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree_util.tree_map_with_path(one, state)


def assert_bit_exact(restored, state):
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        if isinstance(b, jax.Array):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
        else:
            assert a == b and type(a) is type(b)


def test_round_trip_bit_exact(tmp_path, sp8):
    state = make_state(sp8)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        assert ck.save(7, state, metadata=META)
        assert ck.latest_step() == 7
        restored = ck.restore(7, as_target(state), expected_metadata=META)
        assert ck.metadata(7) == META
    assert_bit_exact(restored, state)
    assert restored["params"]["w"].sharding == state["params"]["w"].sharding


def new_spec(path, x):
    """The dp=2 × sp=4 layout: matrices split over both axes, long vectors over sp, the rest replicated."""
    if x.ndim == 2:
        return P("dp", "sp")
    if x.ndim == 1 and x.shape[0] % 4 == 0:
        return P("sp")
    return P()


def test_restore_onto_another_mesh(tmp_path, sp8, dp2_sp4):
    """Saved sharded over sp=8; restored onto dp=2 × sp=4 with every array split over both axes."""
    state = make_state(sp8)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state, metadata=META)
        ck.wait()
        restored = ck.restore(None, as_target(state, dp2_sp4, new_spec), expected_metadata={"model": MODEL})
    assert_bit_exact(restored, state)
    w = restored["params"]["w"]
    assert w.sharding == NamedSharding(dp2_sp4, P("dp", "sp"))
    full = np.asarray(state["params"]["w"])
    for shard in w.addressable_shards:            # each device holds its [8, 2] block of the new layout
        assert shard.data.shape == (8, 2)
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
    assert restored["tokens"].sharding == NamedSharding(dp2_sp4, P("sp"))


def test_keep_last_k(tmp_path, sp8):
    state = make_state(sp8)
    with Checkpointer(tmp_path / "ck", keep=2) as ck:
        for step in (10, 20, 30, 40):
            ck.save(step, state, metadata=META)
        ck.wait()
        assert ck.all_steps() == [30, 40]
    on_disk = sorted(int(n) for n in os.listdir(tmp_path / "ck") if n.isdigit())
    assert on_disk == [30, 40]
    assert Checkpointer(tmp_path / "ck").all_steps() == [30, 40]      # a fresh reader sees the same


def test_async_save_then_wait(tmp_path, sp8):
    """The arrays are copied before save returns: deleting them right after does not spoil the write."""
    state = make_state(sp8, seed=1)
    host_copy = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, state)
    target = as_target(state)
    ck = Checkpointer(tmp_path / "ck", async_save=True)
    assert ck.save(3, state, metadata=META)
    for x in jax.tree.leaves(state):
        if isinstance(x, jax.Array):
            x.delete()
    ck.wait()
    assert (tmp_path / "ck" / "3").is_dir()
    restored = ck.restore(3, target)
    ck.close()
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(host_copy)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_unfinished_save_is_ignored(tmp_path, sp8):
    """An interrupted save leaves only orbax's temporary directory: not a step, never restored."""
    state = make_state(sp8)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(5, state, metadata=META)
    partial = tmp_path / "ck" / "9.orbax-checkpoint-tmp-1700000000000000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\0" * 10)
    ck = Checkpointer(tmp_path / "ck")
    assert ck.latest_step() == 5 and ck.all_steps() == [5]
    assert_bit_exact(ck.restore(None, as_target(state)), state)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 9 .*saved steps: \[5\]"):
        ck.restore(9, as_target(state))
    ck.close()


def test_incompatible_model_and_shape_errors(tmp_path, sp8):
    state = make_state(sp8)
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(1, state, metadata=META)
    other = {"model": {**MODEL, "num_layers": 4, "attention": {"strategy": "ring", "layout": "striped"}}}
    with pytest.raises(ValueError, match=r"incompatible model: attention.layout zigzag != striped, "
                                         r"num_layers 2 != 4"):
        ck.restore(1, as_target(state), expected_metadata=other)
    with pytest.raises(ValueError, match=r"vocab <absent> != 100"):
        ck.restore(1, as_target(state), expected_metadata={"model": {**MODEL, "vocab": 100}})
    with pytest.raises(ValueError, match="no 'model' entry"):
        ck.restore(1, as_target(state), expected_metadata={"mesh": {}})
    bad = as_target(state)
    bad["params"]["w"] = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=bad["params"]["w"].sharding)
    with pytest.raises(ValueError, match=r"'params/w' of shape \(16, 8\), but the restore target expects \(16, 4\)"):
        ck.restore(1, bad)
    extra = {**as_target(state), "ema": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=bad["params"]["b"].sharding)}
    with pytest.raises(ValueError, match=r"only in the target \['ema'\]"):
        ck.restore(1, extra)
    nosharding = as_target(state)
    nosharding["tokens"] = jax.ShapeDtypeStruct((64,), jnp.int32)
    with pytest.raises(ValueError, match="'tokens' is a ShapeDtypeStruct without a sharding"):
        ck.restore(1, nosharding)
    ck.close()


def test_save_errors_and_repeats(tmp_path, sp8):
    state = make_state(sp8)
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    with pytest.raises(ValueError, match="JSON-serialisable"):
        ck.save(1, state, metadata={"model": {"dtype": jnp.float32}})
    with pytest.raises(ValueError, match="metadata must be a dict"):
        ck.save(1, state, metadata=[1])
    with pytest.raises(ValueError, match="step -1 must be a non-negative integer"):
        ck.save(-1, state, metadata=META)
    assert ck.save(4, state, metadata=META)
    assert not ck.save(4, state, metadata=META)                   # already saved: nothing written
    with pytest.raises(ValueError, match="step 2 is before the latest checkpoint step 4"):
        ck.save(2, state, metadata=META)
    ck.close()
    with pytest.raises(ValueError, match="keep 0 must be a positive integer"):
        Checkpointer(tmp_path / "ck", keep=0)


def test_missing_directory(tmp_path, sp8):
    state = make_state(sp8)
    ck = Checkpointer(tmp_path / "nowhere")
    assert ck.latest_step() is None
    assert not (tmp_path / "nowhere").exists()           # opening does not create it
    with pytest.raises(FileNotFoundError, match="checkpoint directory .*nowhere' does not exist"):
        ck.restore(None, as_target(state))
    (tmp_path / "nowhere").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint in .*nowhere"):
        ck.restore(None, as_target(state))
    ck.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        Checkpointer(tmp_path / "file")
