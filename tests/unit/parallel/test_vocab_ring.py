"""The embedding and LM head split over the vocabulary on a ring (`jaxring.parallel.tensor.vocab_ring`): the
lookup and the per-token cross-entropy, forward and every gradient, against the whole-table jnp computation
(jnp.take, optax's cross-entropy), on dp2 x tp4 and tp8, with row tiles; the bytes the rings move, read from
the compiled program; in the model under METP (over tp) and the sequence strategies (over sp: ring, Ulysses,
USP's two axes), against the replicated tables. fp32 (XLA:CPU would widen bf16 collectives)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close
from jax.sharding import PartitionSpec as P
from test_memory_techniques import _assert_same, _loss_and_grads
from test_weight_offload import RUN, _losses

import jaxring
from jaxring.analysis.compiled import collective_traffic
from jaxring.models import gpt
from jaxring.nn import param_shardings
from jaxring.nn.inference import check_decodable
from jaxring.parallel.tensor.vocab_ring import ring_cross_entropy, ring_embed

B, S, H, V = 2, 32, 16, 48
MESHES = {4: dict(dp=2, tp=4), 8: dict(tp=8)}
RTOL = 1e-5


def normal(seed, shape, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def ids(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, shape), jnp.int32)


def sharded(mesh, fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


@pytest.mark.parametrize("p", [4, 8])
def test_ring_embedding_is_the_lookup_with_its_gradient(p):
    mesh = jaxring.make_mesh(**MESHES[p])
    data = "dp" if "dp" in MESHES[p] else None
    tokens, table, dx = ids(0, (B, S)), normal(1, (V, H)), normal(2, (B, S, H))

    def ring(table):
        run = sharded(mesh, lambda t, e: ring_embed(t, e, "tp"), (P(data, "tp"), P("tp", None)), P(data, "tp", None))
        return run(tokens, table)

    got, vjp = jax.vjp(ring, table)
    want, vjp_want = jax.vjp(lambda table: jnp.take(table, tokens, axis=0), table)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # adds of exact zeros: the lookup itself
    assert_close(vjp(dx)[0], vjp_want(dx)[0], RTOL, "dtable")


@pytest.mark.parametrize("p,tiles", [(4, 1), (4, 4), (8, 2)])
def test_ring_cross_entropy_is_the_whole_heads_with_its_gradients(p, tiles):
    mesh = jaxring.make_mesh(**MESHES[p])
    data = "dp" if "dp" in MESHES[p] else None
    x, w, targets = normal(3, (B, S, H)), normal(4, (H, V), H**-0.5) * 4, ids(5, (B, S))
    dloss = normal(6, (B, S))

    def ring(x, w):
        fn = lambda x, w, t: ring_cross_entropy(x, w, t, "tp", tiles)
        run = sharded(mesh, fn, (P(data, "tp", None), P(None, "tp"), P(data, "tp")), P(data, "tp"))
        return run(x, w, targets)

    def whole(x, w):
        return optax.softmax_cross_entropy_with_integer_labels(x @ w, targets)

    got, vjp = jax.vjp(ring, x, w)
    want, vjp_want = jax.vjp(whole, x, w)
    assert_close(got, want, RTOL, "loss")
    for name, g, r in zip(("dx", "dw"), vjp(dloss), vjp_want(dloss)):
        assert_close(g, r, RTOL, name)


def test_the_rings_move_blocks_not_tables():
    """Per device at p = 8 (the module docstring): embedding (p-1) blocks forward and (p-1) fp32 accumulators
    backward; head (p-1) blocks forward, (p-1) blocks and p fp32 gradients backward. No all-gather: no device
    holds the whole table."""
    p, mesh = 8, jaxring.make_mesh(tp=8)
    tokens, targets, x = ids(0, (B, S)), ids(5, (B, S)), normal(3, (B, S, H))
    table, w = normal(1, (V, H)), normal(4, (H, V))
    block = V // p * H * 4

    def step(table, w):
        def local(t, e, x, w, y):
            return jnp.sum(ring_embed(t, e, "tp")) + jnp.sum(ring_cross_entropy(x, w, y, "tp"))

        spec = (P(None, "tp"), P("tp", None), P(None, "tp", None), P(None, "tp"), P(None, "tp"))
        loss = jax.shard_map(lambda *a: jax.lax.psum(local(*a), "tp"), mesh=mesh, in_specs=spec, out_specs=P())
        return jax.value_and_grad(loss, argnums=(1, 3))(tokens, table, x, w, targets)

    compiled = jax.jit(step).lower(table, w).compile()
    traffic = collective_traffic(compiled.as_text(), jax.device_count())[0]
    assert traffic["all-gather"] == 0 and traffic["all-reduce"] == 2 * (p - 1) / p * 4, traffic  # the loss' psum
    assert traffic["collective-permute"] == (p - 1) * block * 2 + (p - 1) * block + (2 * p - 1) * block, traffic


def test_tiles_must_divide_the_rows():
    with pytest.raises(ValueError, match="3 loss tiles must divide the 32 rows"):
        ring_cross_entropy(jnp.zeros((1, 32, 4)), jnp.zeros((4, 8)), jnp.zeros((1, 32), jnp.int32), "tp", 3)


# ---------------------------------------------------------------------------------------- in the model

METP = dict(dp=2, tp=4, tensor_parallel="metp")


@pytest.mark.heavy
@pytest.mark.parametrize(
    "name,settings,cfg",
    [
        ("untied, ZeRO-3, loss tiles", dict(zero=3, loss_tile=2), {}),
        (
            "tied, weights offloaded",
            dict(zero=3, remat="full", offload="layer_inputs+weights"),
            {"tie_embeddings": True},
        ),
    ],
)
def test_the_model_gives_the_replicated_tables_loss_and_gradients(name, settings, cfg):
    """The GPT under METP tp4 x dp2 with --vocab-split ring: the loss and every gradient of the run with the
    tables replicated (fp32, relative 2-norm 1e-6); the tables are stored split over tp."""

    ring = _loss_and_grads(METP | settings | dict(vocab_split="ring"), cfg)
    _assert_same(ring, _loss_and_grads(METP | settings, cfg))


# with no tensor parallelism the ring runs over the sequence strategy's axes (USP: its two views of sp)
SEQUENCE_PLANS = {
    "ring zigzag sp8": dict(sp=8, attention="ring", layout="zigzag"),
    "ulysses sp4 dp2": dict(dp=2, sp=4, attention="ulysses"),
    "usp sp4 (2 x 2) dp2": dict(dp=2, sp=4, attention="usp", ulysses_size=2),
}


@pytest.mark.heavy
@pytest.mark.parametrize(
    "name,settings,cfg",
    [
        ("ring zigzag sp8", dict(zero=3, loss_tile=2), {}),
        ("ulysses sp4 dp2", dict(zero=3, remat="full", offload="layer_inputs+weights"), {"tie_embeddings": True}),
        ("usp sp4 (2 x 2) dp2", dict(zero=1, mlp_tile=2), {}),
    ],
)
def test_the_sequence_strategies_give_the_replicated_tables_loss_and_gradients(name, settings, cfg):
    """--vocab-split ring with no tensor parallelism: the tables split over sp, their blocks on a ring there;
    the loss and every gradient of the run with them replicated (fp32, relative 2-norm 1e-6)."""
    plan = SEQUENCE_PLANS[name] | settings
    _assert_same(_loss_and_grads(plan | dict(vocab_split="ring"), cfg), _loss_and_grads(plan, cfg))


@pytest.mark.parametrize(
    "settings,split_spec",
    [(METP, "tp"), (SEQUENCE_PLANS["ulysses sp4 dp2"], "sp"), (SEQUENCE_PLANS["usp sp4 (2 x 2) dp2"], None)],
)
def test_the_tables_are_stored_split_over_the_ring(settings, split_spec):
    model = gpt.GPT(gpt.GPTConfig(vocab_size=64, num_layers=1, hidden=32, num_heads=4, ffn=64), rngs=nnx.Rngs(0))
    for split in ("ring", "none"):
        plan = jaxring.make_plan(jax.devices(), **settings, vocab_split=split)
        want = plan.seq_axis if split_spec is None else split_spec  # USP: its view's two axes
        shardings = param_shardings(nnx.state(model, nnx.Param), plan)
        assert tuple(shardings["embed"]["table"].spec)[:1] == ((want,) if split == "ring" else (None,)), (
            split,
            shardings["embed"]["table"],
        )


@pytest.mark.parametrize(
    "settings,message",
    [
        (METP, r"vocab 66 is not divisible by tp = 4 \(--vocab-split ring"),
        (SEQUENCE_PLANS["ulysses sp4 dp2"], r"vocab 66 is not divisible by sp = 4 \(--vocab-split ring"),
        (dict(dp=8), r"--vocab-split ring splits the tables over sp: it needs sp > 1 \(got 1\)"),
    ],
)
def test_a_vocabulary_the_ring_does_not_divide_is_one_line(settings, message):
    cfg = gpt.GPTConfig(vocab_size=66, num_layers=1, hidden=32, num_heads=4, ffn=64)
    plan = jaxring.make_plan(jax.devices(), **settings, vocab_split="ring")
    with pytest.raises(ValueError, match=message):
        gpt.check_plan(cfg, plan, 4, 64)


def test_decoding_needs_the_tables_whole():
    with pytest.raises(ValueError, match="generate reads the embedding and LM head whole"):
        check_decodable(jaxring.make_plan(jax.devices(), **SEQUENCE_PLANS["ulysses sp4 dp2"], vocab_split="ring"))


@pytest.mark.heavy
@pytest.mark.parametrize(
    "plan",
    [
        dict(sp=1, tp=4, dp=2, tensor_parallel="metp"),
        # the same checkpoint path as METP's, the tables split over sp instead (about 40 s)
        pytest.param(dict(sp=4, dp=2, attention="ulysses"), marks=pytest.mark.slow),
    ],
)
def test_train_py_resumes_bit_exactly(tmp_path, plan):
    """train.py with --vocab-split ring (METP over tp; Ulysses over sp): saved at step 2 and resumed, the same
    losses as the uninterrupted run (the tables' checkpointed shards are the ring's vocab blocks)."""

    run = RUN.updated(**plan, offload="none", vocab_split="ring")
    full = _losses(run)
    ckpt = str(tmp_path / "ckpt")
    first = _losses(run.updated(steps=2, checkpoint_dir=ckpt))
    resumed = _losses(run.updated(checkpoint_dir=ckpt, resume=True))
    np.testing.assert_array_equal(first + resumed, full)
