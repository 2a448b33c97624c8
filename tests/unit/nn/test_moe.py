"""Mixture of experts (jaxring.nn.moe): the block against a dense per-token reference (forward, every gradient,
losses and load, dropless and capacity), expert parallelism on four meshes against one device, the
all-to-all bytes on the compiled program, load balancing in a short run, and every validation error."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring.analysis import compile_stats
from jaxring.nn.moe import MoE, MoEConfig, RouterBias, moe_ffn, param_specs, sharded_moe_ffn, update_router_bias

H, E, K, FFN, SHARED = 16, 8, 2, 32, 16
RTOL = 1e-4
LOSS_SCALE = 10.0  # the MoE losses enter the checked objective with this weight, so their gradients count

MESHES = {"ep8": dict(ep=8), "dp2-ep4": dict(dp=2, ep=4), "sp4-ep2": dict(sp=4, ep=2), "tp2-ep4": dict(tp=2, ep=4)}

# blocked grouped matmul with blocks of 4 rows: groups span several blocks and end mid-block
DROPLESS = MoEConfig(
    num_experts=E,
    experts_per_token=K,
    ffn=FFN,
    activation="swiglu",
    shared_expert_ffn=SHARED,
    aux_loss_weight=0.5,
    z_loss_weight=0.1,
    grouped_matmul="blocked",
    block_rows=4,
)
# gelu, raw top-k gates, a selection bias, and a capacity small enough to drop
CAPACITY = MoEConfig(
    num_experts=E,
    experts_per_token=K,
    ffn=FFN,
    activation="gelu",
    capacity_factor=1.0,
    renormalize=False,
    router_bias=True,
    aux_loss_weight=0.5,
    z_loss_weight=0.1,
)


@functools.cache
def mesh_of(name):
    return jaxring.make_mesh(**MESHES[name])


def normal(seed, shape, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def make_params(config, seed=0):
    names = ("w_in", "w_gate", "w_out") if config.activation == "swiglu" else ("w_in", "w_out")
    p = {
        "router": normal(seed, (H, E)),
        "experts": {
            n: normal(seed + i + 1, (E, FFN, H) if n == "w_out" else (E, H, FFN), H**-0.5) for i, n in enumerate(names)
        },
    }
    if config.shared_expert_ffn:
        p["shared"] = {
            n: normal(seed + i + 5, (SHARED, H) if n == "w_out" else (H, SHARED), H**-0.5) for i, n in enumerate(names)
        }
    if config.router_bias:
        p["router_bias"] = normal(seed + 9, (E,), 0.2)
    return p


# ------------------------------------------------------------------------------------------------------
# The dense per-token reference
# ------------------------------------------------------------------------------------------------------


def reference_routing(x, params, config, groups=None):
    """numpy float64: top-k choices [T, k] and the kept mask [T, k].

    Drop rule (capacity path): per group (the tokens of one device), expert e keeps its first C assignments
    in the order "all first choices, then all second choices, ...", each in token order; C = config.capacity
    of the group's token count.
    """
    x2 = np.asarray(x, np.float64).reshape(-1, H)
    logits = x2 @ np.asarray(params["router"], np.float64)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    scores = probs + np.asarray(params.get("router_bias", np.zeros(E)), np.float64)
    choice = np.argsort(-scores, axis=1, kind="stable")[:, : config.experts_per_token]
    keep = np.ones(choice.shape, bool)
    if not config.dropless:
        groups = np.zeros(len(x2), int) if groups is None else groups
        for g in np.unique(groups):
            members = np.flatnonzero(groups == g)
            capacity, used = config.capacity(len(members)), np.zeros(E, int)
            for j in range(config.experts_per_token):
                for t in members:
                    keep[t, j] = used[choice[t, j]] < capacity
                    used[choice[t, j]] += 1
    return choice, keep


def _ffn(v, w, activation, e=None):
    pick = (lambda a: a[e]) if e is not None else (lambda a: a)
    up = v @ pick(w["w_in"])
    h = jax.nn.silu(v @ pick(w["w_gate"])) * up if activation == "swiglu" else jax.nn.gelu(up, approximate=True)
    return h @ pick(w["w_out"])


def reference_moe(x, params, config, choice, keep):
    """Loop over tokens and their top-k experts: y_t = sum_j kept_tj gate_tj FFN_{e_tj}(x_t) [+ shared(x_t)];
    returns (y, MoE loss, aux, z) with the Switch/GShard aux loss and z-loss over all tokens."""
    x2 = x.reshape(-1, H)
    logits = x2 @ params["router"]
    probs = jax.nn.softmax(logits, axis=-1)
    rows = []
    for t in range(x2.shape[0]):
        gates = probs[t, choice[t]]
        if config.renormalize:
            gates = gates / jnp.sum(gates)
        y = jnp.zeros(H)
        for j in range(config.experts_per_token):
            if keep[t, j]:
                y = y + gates[j] * _ffn(x2[t], params["experts"], config.activation, int(choice[t, j]))
        if config.shared_expert_ffn:
            y = y + _ffn(x2[t], params["shared"], config.activation)
        rows.append(y)
    load = np.bincount(choice.ravel(), minlength=E)
    aux = E * jnp.sum(load / choice.size * jnp.mean(probs, axis=0))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    loss = config.aux_loss_weight * aux + config.z_loss_weight * z
    return jnp.stack(rows).reshape(x.shape), loss, aux, z


def objective(y, loss, cotangent):
    return jnp.sum(y * cotangent) + LOSS_SCALE * loss


def check_tree(got, ref, rtol=RTOL, name=""):
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
        assert_close(g, r, rtol, name + jax.tree_util.keystr(path))


def reference_grads(x, params, config, cotangent, groups=None):
    choice, keep = reference_routing(x, params, config, groups)

    def f(x, params):
        y, loss, aux, z = reference_moe(x, params, config, choice, keep)
        return objective(y, loss, cotangent), (y, aux, z)

    (_, (y, aux, z)), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, params)
    load = np.bincount(choice.ravel(), minlength=E)
    return y, grads, {"aux_loss": aux, "z_loss": z, "load": load, "dropped": int((~keep).sum())}


def moe_grads(fn, x, params, cotangent):
    """(y, grads wrt (x, params), stats) of fn(x, params) -> (y, stats), jitted once."""

    @jax.jit
    def run(x, params, cotangent):
        def f(x, params):
            y, stats = fn(x, params)
            return objective(y, stats["loss"], cotangent), (y, stats)

        (_, (y, stats)), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, params)
        return y, grads, stats

    return run(x, params, cotangent)


def check_stats(stats, ref):
    assert_close(stats["aux_loss"], ref["aux_loss"], RTOL, "aux_loss")
    assert_close(stats["z_loss"], ref["z_loss"], RTOL, "z_loss")
    np.testing.assert_array_equal(np.asarray(stats["load"]), ref["load"])
    assert int(stats["dropped"]) == ref["dropped"]


# ------------------------------------------------------------------------------------------------------
# One device against the reference
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [DROPLESS, dataclasses.replace(DROPLESS, grouped_matmul="ragged_dot"), CAPACITY],
    ids=["dropless-blocked", "dropless-ragged_dot", "capacity"],
)
def test_block_matches_per_token_reference(config):
    x, ct = normal(11, (2, 16, H)), normal(12, (2, 16, H))
    params = make_params(config)
    y, grads, stats = moe_grads(lambda x, p: moe_ffn(x, p, config=config, ep_axis=None), x, params, ct)
    y_ref, grads_ref, stats_ref = reference_grads(x, params, config, ct)
    assert_close(y, y_ref, RTOL, "y")
    check_tree(grads, grads_ref, name="grad")
    check_stats(stats, stats_ref)
    if not config.dropless:
        assert 0 < stats_ref["dropped"] < 32, "the capacity case must drop some assignments, not most"
        assert_close(stats["drop_rate"], stats_ref["dropped"] / (32 * K), 1e-6, "drop_rate")
        assert np.abs(np.asarray(grads[1]["router_bias"])).max() == 0  # selection only
    load = stats_ref["load"]
    assert_close(stats["load_imbalance"], load.max() / load.mean(), 1e-6, "load_imbalance")


# ------------------------------------------------------------------------------------------------------
# Expert parallelism on meshes
# ------------------------------------------------------------------------------------------------------


def token_groups(mesh, batch, seq):
    """The device group of every token (row-major [batch, seq]) under batch over dp·fsdp·ep, seq over sp."""
    nb = mesh.shape["dp"] * mesh.shape["fsdp"] * mesh.shape["ep"]
    ns = mesh.shape["sp"]
    b, s = np.meshgrid(np.arange(batch), np.arange(seq), indexing="ij")
    return ((b // (batch // nb)) * ns + s // (seq // ns)).ravel()


# dp2-ep4 (dp only splits the batch further) with -m slow
@pytest.mark.heavy
@pytest.mark.parametrize(
    "mesh_name,grouped_matmul",
    [pytest.param(m, "blocked", marks=[pytest.mark.slow] if m == "dp2-ep4" else []) for m in MESHES]
    + [("ep8", "ragged_dot")],
)
def test_dropless_on_mesh_equals_one_device(mesh_name, grouped_matmul):
    mesh = mesh_of(mesh_name)
    config = dataclasses.replace(DROPLESS, grouped_matmul=grouped_matmul)
    x, ct = normal(21, (8, 16, H)), normal(22, (8, 16, H))
    params = make_params(config, seed=3)
    got = moe_grads(lambda x, p: sharded_moe_ffn(x, p, mesh=mesh, config=config), x, params, ct)
    ref = moe_grads(lambda x, p: moe_ffn(x, p, config=DROPLESS, ep_axis=None), x, params, ct)
    assert_close(got[0], ref[0], RTOL, "y")
    check_tree(got[1], ref[1], name="grad")
    for name in ("loss", "aux_loss", "z_loss", "load_imbalance"):
        assert_close(got[2][name], ref[2][name], RTOL, name)
    np.testing.assert_array_equal(np.asarray(got[2]["load"]), np.asarray(ref[2]["load"]))


@pytest.mark.heavy
@pytest.mark.parametrize("mesh_name", ["ep8", "tp2-ep4", "sp4-ep2"])
def test_capacity_on_mesh_matches_reference(mesh_name):
    """Capacity is per device (its T local tokens), so the reference drops per device group."""
    mesh = mesh_of(mesh_name)
    x, ct = normal(31, (8, 8, H)), normal(32, (8, 8, H))
    params = make_params(CAPACITY, seed=5)
    y, grads, stats = moe_grads(lambda x, p: sharded_moe_ffn(x, p, mesh=mesh, config=CAPACITY), x, params, ct)
    y_ref, grads_ref, stats_ref = reference_grads(x, params, CAPACITY, ct, token_groups(mesh, 8, 8))
    assert stats_ref["dropped"] > 0
    assert_close(y, y_ref, RTOL, "y")
    check_tree(grads, grads_ref, name="grad")
    check_stats(stats, stats_ref)


def test_grads_taken_inside_shard_map_are_already_reduced():
    """The lead's pattern: jax.grad inside one shard_map (check_vma=True). Router and shared-expert gradients come
    out summed over the token axes (here sp, ep), expert gradients over the token axes but ep (each ep rank owns
    its experts), dx summed over tp: out_specs P() / P("ep", ...) accept them and they equal one device's."""
    mesh = jaxring.make_mesh(sp=2, ep=2, tp=2)
    x, ct = normal(25, (4, 16, H)), normal(26, (4, 16, H))
    params = make_params(DROPLESS, seed=4)
    x_spec, specs = P(("dp", "fsdp", "ep"), "sp", None), param_specs(DROPLESS)

    def local(x, params, ct):
        def loss(x, params):
            y, stats = moe_ffn(x, params, config=DROPLESS, ep_axis="ep", tp_axis="tp")
            return jax.lax.psum(jnp.sum(y * ct), ("ep", "sp")) + LOSS_SCALE * stats["loss"]

        return jax.grad(loss, argnums=(0, 1))(x, params)

    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(x_spec, specs, x_spec), out_specs=(x_spec, specs)))(
        x, params, ct
    )
    ref = moe_grads(lambda x, p: moe_ffn(x, p, config=DROPLESS, ep_axis=None), x, params, ct)[1]
    check_tree(got, ref, name="grad")


# ------------------------------------------------------------------------------------------------------
# Bytes moved per MoE layer (compiled program)
# ------------------------------------------------------------------------------------------------------


@pytest.mark.heavy
@pytest.mark.parametrize(
    "mesh_name,dropless",
    [
        ("ep8", True),
        ("dp2-ep4", True),
        ("tp2-ep4", True),
        ("sp4-ep2", True),
        ("ep8", False),
        pytest.param("dp2-ep4", False, marks=pytest.mark.slow),  # capacity's bytes run on ep8, dp2-ep4's dropless
    ],
)
def test_all_to_all_bytes(mesh_name, dropless):
    """Per device, each all_to_all receives (ep-1)/ep of the exchanged fp32 buffer:

      dropless  buffer [ep, B, h], B = T*min(k, E/ep) rows per destination (T = local tokens; the most one
                device can send one rank, so nothing drops), plus one int32 [ep, E/ep] count exchange
                (forward only: integers have no gradient)
      capacity  buffer [E, C, h], C = min(T, ceil(cf*T*k/E)) slots per expert

    Forward = 2 token exchanges (+ counts), forward + backward = 4 (+ counts).
    """
    config = DROPLESS if dropless else CAPACITY
    mesh = mesh_of(mesh_name)
    ep = mesh.shape["ep"]
    batch, seq = 8, 16
    x, ct = normal(41, (batch, seq, H)), normal(42, (batch, seq, H))
    params = make_params(config)
    tokens = batch * seq // (mesh.shape["dp"] * mesh.shape["fsdp"] * ep * mesh.shape["sp"])
    if dropless:
        buffer = ep * tokens * min(K, E // ep) * H * 4
        counts = (ep - 1) * E * 4 // ep
    else:
        buffer = E * config.capacity(tokens) * H * 4
        counts = 0
    exchange = (ep - 1) * buffer // ep

    def forward(x, p):
        return sharded_moe_ffn(x, p, mesh=mesh, config=config)

    def train(x, p):
        return jax.grad(lambda x, p: objective(*(lambda y, s: (y, s["loss"]))(*forward(x, p)), ct), argnums=(0, 1))(
            x, p
        )

    fwd, bwd = compile_stats(forward, x, params), compile_stats(train, x, params)
    assert fwd.bytes_moved["all-to-all"] == 2 * exchange + counts
    assert bwd.bytes_moved["all-to-all"] == 4 * exchange + counts
    assert fwd.collective_ops["all-to-all"] == 2 + bool(counts)
    assert bwd.collective_ops["all-to-all"] == 4 + bool(counts)


# ------------------------------------------------------------------------------------------------------
# Load balancing
# ------------------------------------------------------------------------------------------------------


def skewed_setup():
    """Tokens with a common direction and a router column leaning towards it: expert 0 is most tokens' first
    choice (load max/mean 3.44, of at most 4)."""
    config = MoEConfig(
        num_experts=E,
        experts_per_token=K,
        ffn=FFN,
        activation="gelu",
        aux_loss_weight=1.0,
        z_loss_weight=0.0,
        router_bias=True,
    )
    x = normal(51, (4, 64, H)) + 0.5
    params = make_params(config, seed=7)
    params["router"] = normal(52, (H, E), 0.3).at[:, 0].add(0.4)
    params["router_bias"] = jnp.zeros((E,))
    return config, x, params


def test_aux_loss_balances_a_skewed_router():
    config, x, params = skewed_setup()
    opt = optax.adam(0.05)

    @jax.jit
    def step(router, state):
        def loss(router):
            _, stats = moe_ffn(x, {**params, "router": router}, config=config, ep_axis=None)
            return stats["loss"], stats["load_imbalance"]

        (_, imbalance), g = jax.value_and_grad(loss, has_aux=True)(router)
        updates, state = opt.update(g, state)
        return optax.apply_updates(router, updates), state, imbalance

    router, state = params["router"], opt.init(params["router"])
    history = []
    for _ in range(40):
        router, state, imbalance = step(router, state)
        history.append(float(imbalance))
    assert history[0] > 3.0
    assert history[-1] < 0.4 * history[0], history


def test_bias_update_balances_without_gradients():
    config, x, params = skewed_setup()
    run = jax.jit(lambda p: moe_ffn(x, p, config=config, ep_axis=None)[1])
    bias, history = params["router_bias"], []
    for _ in range(40):
        stats = run({**params, "router_bias": bias})
        history.append(float(stats["load_imbalance"]))
        bias = update_router_bias(bias, stats["load"], rate=0.01)
    assert history[0] > 3.0
    assert history[-1] < 0.6 * history[0], history


# ------------------------------------------------------------------------------------------------------
# The NNX module
# ------------------------------------------------------------------------------------------------------


def test_module_init_axes_and_call():
    config = MoEConfig(num_experts=E, experts_per_token=K, ffn=FFN, shared_expert_ffn=SHARED, router_bias=True)
    a, b, c = (MoE(H, config, rngs=nnx.Rngs(s)) for s in (0, 0, 1))
    pa, pb, pc = a.params(), b.params(), c.params()
    check_tree(pa, pb, rtol=0)
    assert not np.allclose(pa["experts"]["w_in"], pc["experts"]["w_in"])
    axes = {"/".join(map(str, path)): v.get_metadata()["logical_axes"] for path, v in nnx.to_flat_state(nnx.state(a))}
    assert axes == {
        "router": ("embed", None),
        "router_bias": (None,),
        "experts/w_in": ("expert", "embed", "mlp"),
        "experts/w_gate": ("expert", "embed", "mlp"),
        "experts/w_out": ("expert", "mlp", "embed"),
        "shared/w_in": ("embed", "mlp"),
        "shared/w_gate": ("embed", "mlp"),
        "shared/w_out": ("mlp", "embed"),
    }
    assert "router_bias" not in nnx.state(a, nnx.Param)
    assert isinstance(a.router_bias, RouterBias)
    x = normal(61, (2, 8, H))
    y, y_ref = nnx.jit(lambda m, x: (m(x, ep_axis=None)[0], moe_ffn(x, pa, config=config, ep_axis=None)[0]))(a, x)
    assert_close(y, y_ref, 0, "y")


# ------------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(experts_per_token=9), "experts_per_token=9 must be <= num_experts=8"),
        (dict(capacity_factor=0.0), "capacity_factor=0.0 must be > 0"),
        (dict(capacity_factor=-1.0), "capacity_factor=-1.0 must be > 0"),
        (dict(num_experts=0), "num_experts=0 must be a positive integer"),
        (dict(activation="relu"), "activation='relu' must be one of gelu, swiglu"),
        (dict(shared_expert_ffn=0), "shared_expert_ffn=0 must be a positive integer or None"),
        (dict(grouped_matmul="dense"), "grouped_matmul='dense' must be one of auto, ragged_dot, blocked"),
        (dict(block_rows=0), "block_rows=0 must be a positive integer"),
    ],
)
def test_config_errors(kwargs, message):
    args = dict(num_experts=E, experts_per_token=K, ffn=FFN) | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        MoEConfig(**args)
    assert "\n" not in str(err.value)


TOKEN_SPEC = P(("dp", "fsdp", "ep"), "sp", None)


def _trace_local(mesh_name, config, params, x_spec=TOKEN_SPEC, specs=None, tp_axis="tp"):
    mesh = mesh_of(mesh_name)
    specs = specs if specs is not None else jax.tree.map(lambda _: P(), params)
    fn = jax.shard_map(
        lambda x, p: moe_ffn(x, p, config=config, ep_axis="ep", tp_axis=tp_axis)[0],
        mesh=mesh,
        in_specs=(x_spec, specs),
        out_specs=x_spec,
    )
    jax.eval_shape(fn, jax.ShapeDtypeStruct((8, 16, H), jnp.float32), params)


def test_parallel_errors():
    config = MoEConfig(num_experts=12, experts_per_token=K, ffn=FFN)
    params = {
        "router": jnp.zeros((H, 12)),
        "experts": {
            "w_in": jnp.zeros((12, H, FFN)),
            "w_gate": jnp.zeros((12, H, FFN)),
            "w_out": jnp.zeros((12, FFN, H)),
        },
    }
    with pytest.raises(ValueError, match=r"num_experts=12 is not divisible by ep=8"):
        _trace_local("ep8", config, params)
    with pytest.raises(ValueError, match=r"expert ffn=30 is not divisible by tp=4"):
        MoEConfig(num_experts=E, experts_per_token=K, ffn=30).check_parallel(ep=2, tp=4)
    with pytest.raises(ValueError, match=r"shared_expert_ffn=6 is not divisible by tp=4"):
        MoEConfig(num_experts=E, experts_per_token=K, ffn=32, shared_expert_ffn=6).check_parallel(ep=2, tp=4)
    # experts handed in whole instead of split over ep
    params = make_params(DROPLESS)
    with pytest.raises(ValueError, match=r"experts w_in shape \(8, 16, 32\) must be the local shard \(2, 16, 16\)"):
        _trace_local("tp2-ep4", DROPLESS, params)
    # a sequence split over tp: the experts' FFN is split there, the tokens must not be
    with pytest.raises(ValueError, match=r"x varies over tp_axis='tp'"):
        _trace_local(
            "tp2-ep4", DROPLESS, params, x_spec=P(("dp", "fsdp", "ep"), "tp", None), specs=param_specs(DROPLESS)
        )
    with pytest.raises(ValueError, match=r"ep_axis='ep' is not an axis of the enclosing shard_map"):
        moe_ffn(jnp.zeros((1, 4, H)), params, config=DROPLESS)
    with pytest.raises(ValueError, match=r"moe_ffn x shape \(4, 16\) must be \[batch, seq, hidden\]"):
        moe_ffn(jnp.zeros((4, H)), params, config=DROPLESS, ep_axis=None)
