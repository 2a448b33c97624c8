"""DiT: shapes, fixed embeddings, adaLN-Zero init, the flow-matching loss and every gradient against a plain jnp
reference on one device and under sequence/tensor-parallel plans, the Euler/CFG sampler, the PNG grid, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close
from PIL import Image

import jaxring
from jaxring.models.dit import (
    DiT,
    DiTConfig,
    FlowMatchingObjective,
    check_plan,
    euler_step,
    flow_matching_inputs,
    freeze_specs,
    get_config,
    patchify,
    pos_embed_2d,
    pos_embed_at,
    sample,
    save_image_grid,
    unpatchify,
    weight_specs,
)
from jaxring.nn import Layers, MemoryPolicy, remat_policy
from jaxring.parallel.plan import ParallelPlan
from jaxring.train.step import value_and_grad

CFG = get_config("tiny", class_dropout=0.5, num_layers=1)  # 16×16×1, patch 2 → 64 tokens, hidden 64
BATCH = 4
KEY = jax.random.PRNGKey(3)


def _single_plan():
    return ParallelPlan(jaxring.make_mesh(dp=1, devices=jax.devices()[:1]))


@pytest.fixture(scope="module")
def setup():
    """(graphdef, param state, perturbed params as a pure dict, images, labels).

    At init the adaLN and output layers are zero, so most gradients would be zero: every parameter is
    perturbed so that each gradient is informative (numpy draws: no per-shape compiles)."""
    graphdef, state = nnx.split(DiT(CFG, rngs=nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(0)
    pure = jax.tree.map(lambda a: a + 0.05 * rng.standard_normal(a.shape, np.float32), nnx.to_pure_dict(state))
    images = rng.uniform(-1, 1, (BATCH, CFG.image_size, CFG.image_size, CFG.channels)).astype(np.float32)
    labels = rng.integers(0, CFG.num_classes, (BATCH,)).astype(np.int32)
    return graphdef, state, pure, images, labels


# ---------------------------------------------------------------------------------------- the jnp reference


def _ln(v):
    return (v - v.mean(-1, keepdims=True)) / jnp.sqrt(v.var(-1, keepdims=True) + 1e-6)


def _lin(d, v):
    return v @ d["w"] + d["b"]


def reference_velocity(p, x, t, y, cfg=CFG):
    """DiT forward written out in plain jnp (dense attention) on the pure parameter dict: v [b, H, W, C]."""
    b, pz, g = x.shape[0], cfg.patch_size, cfg.grid
    tokens = x.reshape(b, g, pz, g, pz, cfg.channels).transpose(0, 1, 3, 2, 4, 5).reshape(b, g * g, -1)
    h = _lin(p["patch_embed"], tokens) + pos_embed_2d(cfg.hidden, g)
    half = cfg.freq_dim // 2
    arg = 1000 * t[:, None] * jnp.exp(-math.log(10000) * jnp.arange(half) / half)
    temb = jnp.concatenate([jnp.cos(arg), jnp.sin(arg)], -1)
    c = _lin(p["t_embed"]["fc2"], jax.nn.silu(_lin(p["t_embed"]["fc1"], temb))) + p["y_embed"]["table"][y]
    heads, s = cfg.num_heads, g * g
    for i in range(cfg.num_layers):
        blk = jax.tree.map(lambda a, i=i: a[i], p["blocks"])  # the stacked layers' slice i
        sh1, sc1, g1, sh2, sc2, g2 = jnp.split(_lin(blk["adaLN"], jax.nn.silu(c))[:, None], 6, -1)
        z = _ln(h) * (1 + sc1) + sh1
        q, k, v = (z @ blk["attn"][n] for n in ("wq", "wk", "wv"))
        q, k, v = (a.reshape(b, s, heads, -1) for a in (q, k, v))
        o = jax.nn.dot_product_attention(q, k, v).reshape(b, s, -1) @ blk["attn"]["wo"]
        h = h + g1 * o
        z = _ln(h) * (1 + sc2) + sh2
        h = h + g2 * (jax.nn.gelu(z @ blk["mlp"]["w_in"], approximate=True) @ blk["mlp"]["w_out"])
    sh, sc = jnp.split(_lin(p["final"]["adaLN"], jax.nn.silu(c))[:, None], 2, -1)
    out = _lin(p["final"]["linear"], _ln(h) * (1 + sc) + sh)
    return out.reshape(b, g, g, pz, pz, cfg.channels).transpose(0, 1, 3, 2, 4, 5).reshape(x.shape)


def reference_loss(p, images, labels, key, cfg=CFG):
    """Rectified flow with the draws the model promises: split(key, 3) → t ~ U(0,1), ε ~ N(0,1), dropout."""
    k_t, k_eps, k_drop = jax.random.split(key, 3)
    b = images.shape[0]
    t = jax.random.uniform(k_t, (b,))
    eps = jax.random.normal(k_eps, images.shape)
    y = jnp.where(jax.random.uniform(k_drop, (b,)) < cfg.class_dropout, cfg.num_classes, labels)
    x_t = (1 - t)[:, None, None, None] * images + t[:, None, None, None] * eps
    return jnp.mean(jnp.square(reference_velocity(p, x_t, t, y, cfg) - (eps - images)))


@pytest.fixture(scope="module")
def reference(setup):
    _, _, pure, images, labels = setup
    dropped = jax.random.uniform(jax.random.split(KEY, 3)[2], (BATCH,)) < CFG.class_dropout
    assert 0 < int(dropped.sum()) < BATCH, "the key should drop some labels and keep others"
    loss, grads = jax.jit(jax.value_and_grad(reference_loss))(pure, images, labels, KEY)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert float(jnp.abs(g).max()) > 0, f"reference gradient {jax.tree_util.keystr(path)} is zero"
    return loss, grads


# ---------------------------------------------------------------------------------------- layout pieces


def test_shapes_patchify_and_position_embedding():
    cfg = get_config("tiny")
    assert (cfg.grid, cfg.num_tokens, cfg.patch_dim) == (8, 64, 4)
    x = np.random.default_rng(1).normal(size=(2, 8, 12, 3)).astype(np.float32)
    tok = np.asarray(patchify(jnp.asarray(x), 4))
    assert tok.shape == (2, 6, 48)
    for r in range(2):
        for c in range(3):  # token r*3 + c is the patch at row r, column c, features (dy, dx, channel)
            np.testing.assert_array_equal(tok[:, r * 3 + c], x[:, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4].reshape(2, -1))
    sq = x[:, :8, :8]
    np.testing.assert_array_equal(unpatchify(patchify(jnp.asarray(sq), 2), 2, 3), sq)

    # DiT's get_2d_sincos_pos_embed, as written in its repository (w-grid first, then h)
    def one_d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid = np.stack(np.meshgrid(np.arange(5, dtype=np.float32), np.arange(5, dtype=np.float32)), 0)
    expected = np.concatenate([one_d(8, grid[0]), one_d(8, grid[1])], axis=1)
    np.testing.assert_allclose(pos_embed_2d(16, 5), expected, rtol=1e-6, atol=1e-6)

    # the position embedding is no state; parameter count matches the config's
    model = DiT(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert sum(a.size for a in jax.tree.leaves(state)) == cfg.num_params() == 178_436
    final = model.final  # zero-initialised output layer and its modulation: v = 0 at init
    assert all(np.abs(np.asarray(a)).max() == 0 for a in jax.tree.leaves(nnx.state(final)))


def test_same_seed_same_parameters():
    leaves = lambda seed: jax.tree.leaves(nnx.state(DiT(CFG, rngs=nnx.Rngs(seed)), nnx.Param))
    a, b, c = leaves(0), leaves(0), leaves(1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_adaln_zero_blocks_start_as_identity(setup):
    _graphdef, _template, pure, _, _ = setup
    plan = _single_plan()
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    x = jax.random.normal(ks[0], (2, CFG.num_tokens, CFG.hidden))
    c = jax.random.normal(ks[1], (2, CFG.hidden))
    pos = jnp.broadcast_to(jnp.arange(CFG.num_tokens, dtype=jnp.int32), (2, CFG.num_tokens))
    layer_gd, fresh = nnx.split(DiT(CFG, rngs=nnx.Rngs(0)).blocks)
    run = jax.jit(lambda layer, x, c: nnx.merge(layer_gd, layer)(x, c, pos, plan))
    fresh = nnx.to_pure_dict(fresh)
    for i in range(CFG.num_layers):
        layer = jax.tree.map(lambda a, i=i: a[i], fresh)
        assert np.abs(np.asarray(layer["adaLN"]["w"])).max() == 0
        np.testing.assert_array_equal(run(layer, x, c), x)
    perturbed = jax.tree.map(lambda a: a[0], pure["blocks"])  # the check can fail: a trained block is no identity
    assert np.abs(np.asarray(run(perturbed, x, c) - x)).max() > 1e-3


def test_position_embedding_on_the_fly_equals_the_table():
    pos = jnp.asarray([[0, 5, 17, 63]], jnp.int32)
    np.testing.assert_allclose(pos_embed_at(pos, 16, 8)[0], pos_embed_2d(16, 8)[np.asarray(pos[0])], atol=1e-6)


# ---------------------------------------------------------------------------------------- loss and grads

PLANS = {
    "single": (dict(dp=1), {}, "none"),
    "ring-sp8": (dict(sp=8), dict(attention="ring"), "none"),
    "ulysses-dp2-sp4": (dict(dp=2, sp=4), dict(attention="ulysses"), "full"),
    "megatron-dp4-tp2": (dict(dp=4, tp=2), {}, "selective"),
    "megatron-tp2-ring-sp4-zero2": (dict(tp=2, sp=4), dict(attention="ring", zero=2), "none"),
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(PLANS))
def test_loss_and_gradients_match_reference(name, setup, reference):
    """Same draws, same numbers: the loss and every parameter gradient under each plan equal the jnp reference
    (rtol 1e-4), computed by the train step's own path (one shard_map over the mesh)."""
    graphdef, _template, pure, images, labels = setup
    mesh_kw, plan_kw, remat = PLANS[name]
    if name == "single":
        mesh_kw = dict(dp=1, devices=jax.devices()[:1])
    plan = ParallelPlan(jaxring.make_mesh(**mesh_kw), **plan_kw)
    model = nnx.merge(graphdef, pure)
    batch = {"images": jnp.asarray(images), "labels": jnp.asarray(labels)}
    loss, grads = value_and_grad(
        model, plan, FlowMatchingObjective(CFG, BATCH), batch, KEY, memory=MemoryPolicy(remat=remat)
    )
    ref_loss, ref_grads = reference
    assert loss.dtype == jnp.float32 and loss.shape == ()
    assert_close(loss, ref_loss, 1e-4, "loss")
    for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        assert_close(g, g_ref, 1e-4, f"{name} d{jax.tree_util.keystr(path)}")


def test_time_sampling_and_label_dropout_rules():
    model = DiT(get_config("tiny", time_sampling="logit_normal"), rngs=nnx.Rngs(0))
    key = jax.random.PRNGKey(0)
    t = model.sample_t(key, 1000)
    np.testing.assert_allclose(t, jax.nn.sigmoid(jax.random.normal(key, (1000,))), rtol=1e-6)
    assert float(t.min()) > 0 and float(t.max()) < 1 and abs(float(jnp.median(t)) - 0.5) < 0.05


@pytest.mark.heavy
def test_remat_modes_trade_memory(setup):
    """The layer stack is one checkpointed scan body; remat full saves nothing, selective the weight matmuls'
    outputs, none everything it computes: compiled temporaries order as full < selective <= none."""
    cfg = get_config("tiny", num_layers=6)  # residuals across layers are what remat trades
    graphdef, state = nnx.split(DiT(cfg, rngs=nnx.Rngs(0)))
    pure = nnx.to_pure_dict(state)
    plan = _single_plan()
    x = jnp.ones((8, cfg.num_tokens, cfg.hidden))
    c = jnp.ones((8, cfg.hidden))
    pos = jnp.broadcast_to(jnp.arange(cfg.num_tokens, dtype=jnp.int32), (8, cfg.num_tokens))
    temp = {}
    for remat in ("none", "selective", "full"):

        def out(p, remat=remat):
            m = nnx.merge(graphdef, p)
            return Layers.of(m.blocks, remat)(x, lambda blk, x: blk(x, c, pos, plan)).sum()

        assert str(jax.make_jaxpr(jax.grad(out))(pure)).count("scan[") >= 1, remat
        temp[remat] = jax.jit(jax.grad(out)).lower(pure).compile().memory_analysis().temp_size_in_bytes
    assert temp["full"] < temp["selective"] <= temp["none"], temp


# ---------------------------------------------------------------------------------------- sampling and images


def test_sample_is_euler_with_guidance(setup):
    """2 Euler steps with cfg 3 on sp=8 ring equal the same steps written with the jnp reference."""
    graphdef, _template, pure, _, _ = setup
    model = nnx.merge(graphdef, pure)
    plan = ParallelPlan(jaxring.make_mesh(sp=8), attention="ring")
    labels, key, scale = np.array([0, 3, 9, 10]), jax.random.PRNGKey(11), 3.0
    out = sample(model, plan, labels, key, num_steps=2, cfg_scale=scale)
    specs = freeze_specs(weight_specs(nnx.state(model), plan))
    assert euler_step(nnx.graphdef(model), plan, True, jnp.dtype(jnp.float32), specs)._cache_size() == 1
    assert out.shape == (4, 16, 16, 1) and out.dtype == jnp.float32
    assert np.isfinite(np.asarray(out)).all() and float(jnp.abs(out).max()) <= 1.0

    ref_v = jax.jit(reference_velocity)
    x = jax.random.normal(key, out.shape)
    null = np.full_like(labels, CFG.num_classes)
    for t, dt in ((1.0, 0.5), (0.5, 0.5)):
        tt = jnp.full((4,), t)
        v_label, v_null = ref_v(pure, x, tt, labels), ref_v(pure, x, tt, null)
        x = x - dt * (v_null + scale * (v_label - v_null))
    assert_close(out, jnp.clip(x, -1, 1), 1e-4, "sample")
    assert float(jnp.abs(x).max()) > 1.0 > float(jnp.abs(out).max()) - 1e-6  # clipping did something


def test_save_image_grid(tmp_path):
    grey = np.stack([np.full((4, 5, 1), v, np.float32) for v in (-1.0, 0.0, 1.0)])
    path = save_image_grid(grey, tmp_path / "grey.png", nrow=2, padding=1)
    img = np.asarray(Image.open(path))
    assert img.shape == (2 * 5 + 1, 2 * 6 + 1)  # 2 rows × 2 columns of 4×5 with 1-pixel borders
    assert (img[1, 1], img[1, 7], img[6, 1], img[0, 0], img[6, 7]) == (0, 128, 255, 0, 0)
    rgb = np.random.default_rng(0).uniform(-1, 1, (5, 3, 3, 3))
    img = Image.open(save_image_grid(rgb, tmp_path / "rgb.png", nrow=8))
    assert img.mode == "RGB" and img.size == (5 * 5 + 2, 3 + 4)


# ---------------------------------------------------------------------------------------- presets and errors


def test_presets_parameters_and_flops():
    dit_s = get_config("dit-s")
    assert (dit_s.hidden, dit_s.num_heads, dit_s.num_layers, dit_s.patch_size, dit_s.num_tokens) == (384, 6, 12, 2, 256)
    assert abs(dit_s.num_params() / 33e6 - 1) < 0.02  # DiT paper, Table 1/4: DiT-S/2 has 33M params
    assert abs(dit_s.flops_per_image() / 6 / 6.06e9 - 1) < 0.01  # Table 4: 6.06 GFLOPs (multiply-adds) forward
    big = get_config("dit-1b")
    assert (big.num_heads, big.num_layers, big.hidden) == (24, 24, 1536)
    assert 1.0e9 < big.num_params() < 1.1e9
    long = get_config("dit-1b", image_size=724)
    assert long.num_tokens == 362**2
    per_token, per_image = long.param_counts()
    assert long.flops_per_image() == 6 * per_token * long.num_tokens + 6 * per_image + 12 * 24 * 1536 * 362**4


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="image_size 15 is not divisible by patch_size 2"):
        get_config("tiny", image_size=15)
    with pytest.raises(ValueError, match="unknown DiT preset 'dit-xxl'"):
        get_config("dit-xxl")
    with pytest.raises(ValueError, match="hidden 66 is not divisible by num_heads 4"):
        DiTConfig(hidden=66)
    with pytest.raises(ValueError, match="hidden 6 must be divisible by 4"):
        DiTConfig(hidden=6, num_heads=2)
    with pytest.raises(ValueError, match=r"class_dropout 1.5"):
        DiTConfig(class_dropout=1.5)
    with pytest.raises(ValueError, match="time_sampling 'cosine'"):
        DiTConfig(time_sampling="cosine")
    with pytest.raises(ValueError, match="channels 0 must be a positive integer"):
        DiTConfig(channels=0)

    model = DiT(CFG, rngs=nnx.Rngs(0))
    plan, key = _single_plan(), jax.random.PRNGKey(0)
    x, y = jnp.zeros((4, 16, 16, 1)), jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match=r"images shape \(4, 16, 16, 3\) must be \[batch, 16, 16, 1\]"):
        flow_matching_inputs(CFG, jnp.zeros((4, 16, 16, 3)), y, key)
    with pytest.raises(ValueError, match=r"labels float32\(4,\) must be integers"):
        flow_matching_inputs(CFG, x, jnp.zeros((4,)), key)
    with pytest.raises(
        ValueError, match=r"micro-batch size .* 3 is not divisible by the data-parallel degree dp\*fsdp\*ep = 2"
    ):
        check_plan(CFG, ParallelPlan(jaxring.make_mesh(dp=2, sp=4), attention="ring"), 3)
    with pytest.raises(ValueError, match="seq 9 is not divisible by sp = 8"):  # 9 tokens over sp = 8
        check_plan(
            get_config("tiny", image_size=6, num_layers=1), ParallelPlan(jaxring.make_mesh(sp=8), attention="ring"), 1
        )
    with pytest.raises(ValueError, match="cannot use tensor parallelism 'optimus'"):
        check_plan(CFG, ParallelPlan(jaxring.make_mesh(dp=2, tp=4), tensor_parallel="optimus"), 8)
    with pytest.raises(ValueError, match="unknown remat 'some'"):
        remat_policy("some")
    with pytest.raises(ValueError, match=r"labels must lie in \[0, num_classes = 10\]"):
        sample(model, plan, [0, 11], key)
    with pytest.raises(ValueError, match="num_steps 0 must be a positive integer"):
        sample(model, plan, [0, 1], key, num_steps=0)
    with pytest.raises(ValueError, match="must be \\[n, H, W, C\\] with C = 1 or 3"):
        save_image_grid(np.zeros((2, 4, 4, 2)), tmp_path / "x.png")
    with pytest.raises(ValueError, match="nrow 0 must be a positive integer"):
        save_image_grid(np.zeros((2, 4, 4, 1)), tmp_path / "x.png", nrow=0)
