"""Checkpointer: bit-exact round trips, retention, atomicity, restoring onto another mesh, clear errors."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import make_mesh
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
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    params = {
        "w": put(jax.random.normal(k[0], (16, 8)), P("sp", None)),
        "b": put(jax.random.normal(k[1], (8,)).astype(jnp.bfloat16), P()),
    }
    opt = optax.adam(1e-3).init(params)
    return {
        "params": params,
        "opt": opt,
        "step": 7,
        "tokens": put(jnp.arange(64, dtype=jnp.int32), P("sp")),
        "rng": jax.random.key_data(k[2]),
    }


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
    for shard in w.addressable_shards:  # each device holds its [8, 2] block of the new layout
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
    assert Checkpointer(tmp_path / "ck").all_steps() == [30, 40]  # a fresh reader sees the same


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
    with pytest.raises(
        ValueError,
        match=r"incompatible model: attention.layout zigzag != striped, "
        r"num_layers 2 != 4",
    ):
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
    assert not ck.save(4, state, metadata=META)  # already saved: nothing written
    with pytest.raises(ValueError, match="step 2 is before the latest checkpoint step 4"):
        ck.save(2, state, metadata=META)
    ck.close()
    with pytest.raises(ValueError, match="keep 0 must be a positive integer"):
        Checkpointer(tmp_path / "ck", keep=0)


def test_missing_directory(tmp_path, sp8):
    state = make_state(sp8)
    ck = Checkpointer(tmp_path / "nowhere")
    assert ck.latest_step() is None
    assert not (tmp_path / "nowhere").exists()  # opening does not create it
    with pytest.raises(FileNotFoundError, match=r"checkpoint directory .*nowhere' does not exist"):
        ck.restore(None, as_target(state))
    (tmp_path / "nowhere").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in .*nowhere"):
        ck.restore(None, as_target(state))
    ck.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        Checkpointer(tmp_path / "file")


# ---- damage, checksums, non-finite states -------------------------------------------------------------


def _largest_array_file(step_dir):
    """The largest data file of the step: the chunks of its largest array (small arrays sit inline in the
    OCDBT index files)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def _flip_bytes(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated array file": lambda d: os.truncate(_largest_array_file(d), _largest_array_file(d).stat().st_size // 2),
    "bit-flipped array file": lambda d: _flip_bytes(_largest_array_file(d)),
    "empty manifest.ocdbt": lambda d: (d / "state" / "manifest.ocdbt").write_bytes(b""),
    "garbage metadata": lambda d: (d / "metadata" / "metadata").write_text("{garbage"),
    "garbage array metadata": lambda d: (d / "state" / "_METADATA").write_text("{garbage"),
    "missing state": lambda d: __import__("shutil").rmtree(d / "state"),
    "missing checksums": lambda d: __import__("shutil").rmtree(d / "checksums"),
}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, sp8):
    """Steps 1 and 2 of two different states, saved once; each test damages its own copy."""
    root = tmp_path_factory.mktemp("two_steps")
    states = {
        s: {
            **make_state(sp8, seed=s),
            "big": jax.device_put(jax.random.normal(jax.random.key(s), (64, 64)), NamedSharding(sp8, P("sp"))),
        }
        for s in (1, 2)
    }
    with Checkpointer(root / "ck", async_save=False) as ck:
        for step, state in states.items():
            ck.save(step, state, metadata=META)
    return root / "ck", states


def _copy(src, tmp_path):
    import shutil

    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage", list(DAMAGE) + ["empty step directory", "junk step directory"])
def test_damaged_latest_step_falls_back_to_the_previous(damage, two_steps, tmp_path):
    src, states = two_steps
    ck_dir = _copy(src, tmp_path)
    if damage in DAMAGE:
        DAMAGE[damage](ck_dir / "2")
        bad = 2
    else:  # a numeric directory that is no checkpoint
        (ck_dir / "3").mkdir()
        if damage == "junk step directory":
            (ck_dir / "3" / "junk").write_text("x")
        bad = 3
    good = bad - 1
    lines = []
    ck = Checkpointer(ck_dir)
    step, restored = ck.restore_latest(as_target(states[2]), expected_metadata=META, report=lines.append)
    assert step == good
    assert_bit_exact(restored, states[good])
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert lines[0].startswith(f"warning: checkpoint step {bad} in ") and lines[0].endswith(f"trying step {good}")
    if damage == "bit-flipped array file":
        assert "checksum mismatch in" in lines[0]  # only the checksums see it (see below)
    assert f"moved damaged checkpoint step {bad} aside" in lines[1]
    assert (ck_dir / f"{bad}.damaged").is_dir() and ck.all_steps() == list(range(1, good + 1))
    assert ck.save(bad, states[2], metadata=META)  # that step number can be saved again
    ck.close()


def test_bit_flip_restores_silently_without_checksums(two_steps, tmp_path):
    """Why the checksums exist: orbax reads a flipped byte back as a different value, without an error."""
    src, states = two_steps
    ck_dir = _copy(src, tmp_path)
    _flip_bytes(_largest_array_file(ck_dir / "2"))
    ck = Checkpointer(ck_dir)
    unverified = ck.restore(2, as_target(states[2]), verify=False)
    differs = [
        not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        for a, b in zip(jax.tree.leaves(unverified), jax.tree.leaves(states[2]))
        if isinstance(b, jax.Array)
    ]
    assert any(differs)
    from jaxring.train.checkpoint import DamagedCheckpointError

    with pytest.raises(DamagedCheckpointError, match=r"checkpoint step 2 .*checksum mismatch in '"):
        ck.restore(2, as_target(states[2]))
    ck.close()


def test_every_step_damaged_is_an_error(two_steps, tmp_path):
    from jaxring.train.checkpoint import DamagedCheckpointError

    src, states = two_steps
    ck_dir = _copy(src, tmp_path)
    for step in (1, 2):
        DAMAGE["missing state"](ck_dir / str(step))
    lines = []
    with pytest.raises(DamagedCheckpointError, match=r"every checkpoint in .* is damaged \(steps \[1, 2\]\)"):
        Checkpointer(ck_dir).restore_latest(as_target(states[2]), report=lines.append)
    assert lines[-1].endswith("no older step to try")
    assert Checkpointer(tmp_path / "none").restore_latest(as_target(states[2])) == (None, None)


def test_another_model_is_not_damage(two_steps, tmp_path):
    """An intact step of another model is refused (ValueError), never skipped as if it were damaged."""
    src, states = two_steps
    ck = Checkpointer(_copy(src, tmp_path))
    with pytest.raises(ValueError, match="incompatible model: num_layers 2 != 4"):
        ck.restore_latest(as_target(states[2]), expected_metadata={"model": {**MODEL, "num_layers": 4}})
    assert ck.all_steps() == [1, 2]
    ck.close()


def test_non_finite_state_is_never_saved(tmp_path, sp8):
    from jaxring.train.checkpoint import NonFiniteStateError

    state = make_state(sp8)
    state["params"]["w"] = state["params"]["w"].at[3, 1].set(jnp.nan)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        with pytest.raises(NonFiniteStateError, match=r"not saving step 5: NaN or Inf values in 'params/w'"):
            ck.save(5, state, metadata=META)
        assert ck.all_steps() == []
    assert not (tmp_path / "ck" / "5").exists()


def test_checksums_do_not_depend_on_the_layout(sp8, dp2_sp4):
    """Integer sums mod 2^32 are order-free: the same array on another mesh has the same checksums, and a
    single flipped bit changes them."""
    from jaxring.train.checksum import state_checksums

    state = make_state(sp8)
    other = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(dp2_sp4, new_spec(None, x))) if isinstance(x, jax.Array) else x, state
    )
    sums = state_checksums(state)
    assert sums == state_checksums(other)
    assert all(s["finite"] for s in sums.values())
    w = np.asarray(state["params"]["w"]).copy()
    w.view(np.uint32)[5, 2] ^= 1 << 20
    flipped = state_checksums({"params": {"w": jnp.asarray(w)}})["params/w"]
    assert flipped["h1"] != sums["params/w"]["h1"] and flipped["h2"] != sums["params/w"]["h2"]


def test_abandoned_orbax_reads_are_quiet_while_open(tmp_path, monkeypatch):
    """When orbax gives up reading a damaged step, the reads it abandons raise their own errors as they are
    collected ("Exception ignored in: <coroutine object _read_array_index_and_device_put>", then a 60-line
    TensorStore spec: thousands of lines before the one-line report in 1 run of 3). While a Checkpointer is
    open those are dropped; anyone else's unraisable errors still go to the hook there before."""
    import sys

    def coroutine_from(filename):
        space = {}
        exec(compile("async def read():\n    pass\n", filename, "exec"), space)
        return space["read"]()

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.object))
    orbax_read = coroutine_from(os.path.join(os.sep, "site-packages", "orbax", "serialization.py"))
    own_read = coroutine_from(os.path.join(os.sep, "project", "mine.py"))
    error = Exception("Encountered error while reading array index")
    with Checkpointer(tmp_path / "ck"):
        for read in (orbax_read, own_read):
            sys.unraisablehook(type("Unraisable", (), {"exc_value": error, "object": read})())
    assert seen == [own_read]
    orbax_read.close(), own_read.close()


def test_abandoned_orbax_tasks_are_not_logged_while_open(tmp_path, caplog):
    """The abandoned reads that finish after the fallback are reported by asyncio's logger instead ("Task
    exception was never retrieved", 165 lines in 1 train.py resume of 10): dropped while a Checkpointer is open,
    anyone else's kept."""
    import logging

    log = logging.getLogger("asyncio")
    orbax_task = (
        "Task exception was never retrieved\nfuture: <Task coro=<async_deserialize() defined at "
        + os.path.join(os.sep, "site-packages", "orbax", "serialization.py")
    )
    own_task = "Task exception was never retrieved\nfuture: <Task coro=<mine() defined at /project/mine.py"
    orbax_future = (
        "_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture finished exception=Exception("
        '"Encountered error while reading array index: (slice(0, 4, 1),). See full TensorStore details: ...'
    )
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with Checkpointer(tmp_path / "ck"):
            log.error(orbax_task)
            log.error(orbax_future)
            log.error(own_task)
        log.error(orbax_task)  # (closed: no longer filtered)
    assert [r.getMessage() for r in caplog.records] == [own_task, orbax_task]


_RESTORE_TRUNCATED = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxring.train.checkpoint import Checkpointer
mesh = jax.make_mesh((8,), ("sp",))
state = lambda s: {f"a{i}": jax.device_put(jax.random.normal(jax.random.key(s + i), (64, 128)),
                                            NamedSharding(mesh, P("sp"))) for i in range(64)}
if sys.argv[2] == "save":  # (a process of its own: a restore in the saving process reads from its caches)
    with Checkpointer(sys.argv[1], async_save=False) as ck:
        for s in (1, 2):
            ck.save(s, state(s), metadata={"model": {}})
    step2 = os.path.join(sys.argv[1], "2", "state")
    files = [os.path.join(d, f) for d, _, fs in os.walk(step2) for f in fs if os.path.basename(d) == "d"]
    big = max(files, key=os.path.getsize)
    os.truncate(big, os.path.getsize(big) // 2)
else:
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(1))
    with Checkpointer(sys.argv[1]) as ck:
        print("restored step", ck.restore_latest(target, report=print)[0])
"""


@pytest.mark.slow  # timing-dependent: before the fix 5 runs of 6 printed orbax tracebacks on an idle machine, 0 of 3 on a busy one
def test_truncated_newest_step_falls_back_in_two_lines_without_orbax_tracebacks(tmp_path):
    """A truncated array file fails orbax's read of 64 arrays part-way: the reads it abandons raise again when
    collected ("Exception ignored in: <coroutine object _read_array_index_and_device_put>", a 60-line
    TensorStore spec each: 5 runs of 6 printed 3,000-22,000 lines before the fix). The fallback is the two report
    lines and nothing on stderr."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for mode in ("save", "restore"):
        run = subprocess.run(
            [sys.executable, "-c", _RESTORE_TRUNCATED, str(tmp_path / "ck"), mode],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr == ""
    lines = run.stdout.splitlines()
    assert lines[0].startswith("warning: checkpoint step 2 in ") and lines[0].endswith("trying step 1")
    assert lines[1].startswith("moved damaged checkpoint step 2 aside") and lines[2] == "restored step 1"
