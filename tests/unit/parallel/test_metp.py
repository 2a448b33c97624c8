"""METP [METP]: the O = f(AB)C ring (FFN) and two-level MHA against unsharded jnp references (forward and
every gradient), collective bytes read from the compiled programs, saved residuals and memory, errors.

Bytes are per device, as jaxring.analysis counts them: the bytes a device receives over the links, by
collective kind, loop bodies weighted by their trip count (a collective-permute of an array of N bytes counts
N; an all-reduce over g devices 2(g-1)/g·N). fp32 everywhere (XLA:CPU would widen bf16 collectives).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, attention_block_reference, mlp_block_reference
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring.analysis import compile_stats
from jaxring.analysis.compiled import collective_traffic
from jaxring.core.collectives import tree_rounds
from jaxring.parallel.tensor import megatron_api, metp_api, metp_mha, metp_ring

RTOL = 2e-4
MESHES = {2: dict(dp=2, fsdp=2, tp=2), 4: dict(dp=2, tp=4), 8: dict(tp=8)}  # p = tp; batch over dp/fsdp
B, S, H, FFN = 4, 32, 16, 64
HEADS, HEAD_DIM = 8, 4
F32 = 4


def mesh_of(p):
    return jaxring.make_mesh(**MESHES[p])


def data_degree(p):
    return 8 // p


def normal(seed, shape, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def compiled_run(fn, *args):
    """(fn(*args), bytes moved per device by kind) from one compilation."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled(*args), collective_traffic(compiled.as_text(), jax.device_count())[0]


def out_and_grads(fn, cotangent):
    """(x, params, ...) -> (fn's output, its VJP w.r.t. x and params for `cotangent`)."""

    def run(x, params, *rest):
        out, vjp = jax.vjp(lambda x, params: fn(x, params, *rest), x, params)
        return out, vjp(cotangent)

    return run


def check_tree(got, ref, name):
    assert jax.tree.structure(got) == jax.tree.structure(ref), name
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
        assert_close(g, r, RTOL, name + jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------------------------------------
# FFN: O = f(X W_in) W_out on the (W_in, W_out) ring
# ---------------------------------------------------------------------------------------------------------


def mlp_params(seed, hidden, ffn, activation):
    p = {"w_in": normal(seed, (hidden, ffn), hidden**-0.5), "w_out": normal(seed + 1, (ffn, hidden), ffn**-0.5)}
    if activation == "swiglu":
        p["w_gate"] = normal(seed + 2, (hidden, ffn), hidden**-0.5)
    return p


FFN_CASES = [(2, "gelu"), (4, "swiglu"), (8, "gelu")]


@functools.cache
def ffn_case(p, activation):
    """METP and reference (output, grads) and the bytes of METP's forward+backward program."""
    x, dy = normal(1, (B, S, H)), normal(2, (B, S, H))
    params = mlp_params(3, H, FFN, activation)
    mesh = mesh_of(p)
    got, moved = compiled_run(
        out_and_grads(lambda x, w: metp_api.mlp_block(x, w, mesh=mesh, activation=activation), dy), x, params
    )
    ref = jax.jit(out_and_grads(lambda x, w: mlp_block_reference(x, w, activation), dy))(x, params)
    return got, ref, moved


@pytest.mark.parametrize("p,activation", FFN_CASES, ids=[f"p{p}-{a}" for p, a in FFN_CASES])
def test_mlp_matches_reference(p, activation):
    got, ref, _ = ffn_case(p, activation)
    check_tree(got, ref, f"mlp p={p} {activation}")


def ffn_block_elements(p, activation):
    """Elements of one rank's (B, C) blocks: (k1·k2 + k2·n)/p, with two B blocks (W_gate, W_in) for SwiGLU."""
    return ((2 if activation == "swiglu" else 1) * H * FFN + FFN * H) // p


@pytest.mark.parametrize("p,activation", FFN_CASES, ids=[f"p{p}-{a}" for p, a in FFN_CASES])
def test_mlp_bytes(p, activation):
    """Forward: p-1 hops of the (B, C) blocks. Backward: p-1 hops of the blocks and p of their fp32 gradient
    accumulators (the extra hop brings them home): (3p-2)/p·(k1k2 + k2n) per device in all. The weight
    gradients are then summed over the data axes (one all-reduce of the rank's blocks)."""
    mesh = mesh_of(p)
    blocks = ffn_block_elements(p, activation) * F32
    x = jax.ShapeDtypeStruct((B, S, H), jnp.float32)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), mlp_params(0, H, FFN, activation))
    fwd = compile_stats(lambda x, w: metp_api.mlp_block(x, w, mesh=mesh, activation=activation), x, params)
    assert fwd.bytes_moved == {**dict.fromkeys(fwd.bytes_moved, 0), "collective-permute": (p - 1) * blocks}

    _, _, moved = ffn_case(p, activation)
    g = data_degree(p)
    assert moved["collective-permute"] == (3 * p - 2) * blocks
    assert moved["all-reduce"] == round(2 * (g - 1) / g * blocks)
    assert moved["all-gather"] == moved["reduce-scatter"] == moved["all-to-all"] == 0


def saved_residuals(fn, *args):
    """The arrays jax.vjp keeps for the backward of fn at args (the VJP closure's leaves)."""
    return jax.jit(lambda *a: jax.tree.leaves(jax.vjp(fn, *a)[1]))(*args)


def test_mlp_saves_only_x_and_weights():
    """The custom_vjp keeps A = X and the rank's own weight blocks (model states): no X W_in, no GeLU(X W_in)."""
    mesh = mesh_of(4)
    x, params = normal(1, (B, S, H)), mlp_params(3, H, FFN, "swiglu")
    saved = saved_residuals(lambda x, w: metp_api.mlp_block(x, w, mesh=mesh, activation="swiglu"), x, params)
    assert sorted(r.shape for r in saved) == sorted([x.shape] + [w.shape for w in params.values()])


def test_mlp_forward_memory_does_not_grow_with_width():
    """Compiled forward-with-residuals (p = 8): doubling ffn adds the weight blocks and the (m/p)×(k2/p) tiles
    only, less than half of one [b, s/p, Δffn] activation per device. The same ring under plain autodiff (no
    custom_vjp: it keeps every tile's T and f(T)) grows by more than a whole one."""
    p, b, s, h = 8, 2, 512, 8
    mesh = mesh_of(p)
    specs = (P(None, "tp", None), P(None, "tp"), P("tp", None))
    plain_ring = jax.shard_map(
        lambda x, w_in, w_out: metp_ring.metp_forward(x, (w_in,), (), w_out, metp_ring.gelu, "tp"),
        mesh=mesh,
        in_specs=specs,
        out_specs=specs[0],
    )
    layers = {
        "metp": lambda x, w: metp_api.mlp_block(x, w, mesh=mesh),
        "plain": lambda x, w: plain_ring(x, w["w_in"], w["w_out"]),
    }

    def memory(name, ffn):
        x = jax.ShapeDtypeStruct((b, s, h), jnp.float32)
        w = {"w_in": jax.ShapeDtypeStruct((h, ffn), jnp.float32), "w_out": jax.ShapeDtypeStruct((ffn, h), jnp.float32)}

        def forward_with_residuals(x, w):
            out, vjp = jax.vjp(layers[name], x, w)
            return out, jax.tree.leaves(vjp)

        stats = compile_stats(forward_with_residuals, x, w)
        return stats.temp_bytes + stats.output_bytes

    activation = b * (s // p) * 64 * F32  # one [b, s/p, Δffn] fp32 activation per device
    growth = {name: memory(name, 128) - memory(name, 64) for name in layers}
    assert growth["metp"] < activation / 2 < activation < growth["plain"], (growth, activation)


def test_mlp_bf16():
    """bf16 in, bf16 out; products accumulate in fp32, the gradient accumulators ride the ring in fp32."""
    mesh = mesh_of(4)
    x, dy = normal(1, (B, S, H)), normal(2, (B, S, H))
    params = mlp_params(3, H, FFN, "gelu")
    bf16 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)
    got = jax.jit(out_and_grads(lambda x, w: metp_api.mlp_block(x, w, mesh=mesh), bf16(dy)))(bf16(x), bf16(params))
    ref = jax.jit(out_and_grads(lambda x, w: mlp_block_reference(x, w, "gelu"), dy))(x, params)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert g.dtype == jnp.bfloat16
        assert_close(g, r, 2e-2, "bf16")


# ---------------------------------------------------------------------------------------------------------
# MHA: two-level METP
# ---------------------------------------------------------------------------------------------------------


def attn_params(seed, hidden, heads, kv_heads, d):
    return {
        "wq": normal(seed, (hidden, heads * d), hidden**-0.5),
        "wk": normal(seed + 1, (hidden, kv_heads * d), hidden**-0.5),
        "wv": normal(seed + 2, (hidden, kv_heads * d), hidden**-0.5),
        "wo": normal(seed + 3, (heads * d, hidden), (heads * d) ** -0.5),
    }


def positions_of(b, s):
    """Per-row positions: natural, reversed, shuffled, shifted (masks and RoPE must follow them exactly)."""
    rows = [np.arange(s), np.arange(s)[::-1], np.random.default_rng(0).permutation(s), np.arange(s) + 5]
    return jnp.asarray(np.stack([rows[i % 4] for i in range(b)]), jnp.int32)


def mha_config(p, causal):
    """kv heads (GQA below p = 8) and RoPE (off for one case)."""
    kv_heads = HEADS if p == 8 else HEADS // 2
    rope = None if (p, causal) == (4, False) else 10000.0
    return dict(num_heads=HEADS, num_kv_heads=kv_heads, causal=causal, rope_theta=rope)


MHA_CASES = [(p, c) for p in (2, 4, 8) for c in (True, False)]
MHA_IDS = [f"p{p}-{'causal' if c else 'full'}" for p, c in MHA_CASES]
# full attention on p = 2 and p = 8 (two compiles each, shared by the reference and bytes tests) with -m slow: every
# p runs causal and p = 4 full by default
SLOW_MHA = ((2, False), (8, False))


def _mha_params(cases):
    return [
        pytest.param(*c, id=MHA_IDS[MHA_CASES.index(c)], marks=[pytest.mark.slow] if c in SLOW_MHA else [])
        for c in cases
    ]


@functools.cache
def mha_case(p, causal, **options):
    cfg = {**mha_config(p, causal), **options}
    x, dy, pos = normal(11, (B, S, H)), normal(12, (B, S, H)), positions_of(B, S)
    params = attn_params(13, H, HEADS, cfg["num_kv_heads"], HEAD_DIM)
    mesh = mesh_of(p)
    got, moved = compiled_run(
        out_and_grads(lambda x, w, pos: metp_api.attention_block(x, w, pos, mesh=mesh, **cfg), dy), x, params, pos
    )
    cfg.pop("fuse_sends", None)
    ref = jax.jit(out_and_grads(lambda x, w, pos: attention_block_reference(x, w, pos, **cfg), dy))(x, params, pos)
    return got, ref, moved


@pytest.mark.parametrize("p,causal", _mha_params(MHA_CASES))
def test_attention_matches_reference(p, causal):
    got, ref, _ = mha_case(p, causal)
    check_tree(got, ref, f"attention p={p} causal={causal}")


# the GPU form (also checked at S 64 by test_attention_gpu_form_matches_reference_and_bytes) with -m slow
@pytest.mark.heavy
@pytest.mark.parametrize(
    "fuse_sends", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["cpu-form", "gpu-form"]
)
def test_attention_forward_backward_repeatable(fuse_sends):
    """Jitted forward + backward at tp = 8 with longer sequences (S 256, hidden 64, traced positions), run three
    times from one compilation: each run matches the reference, in the CPU form of the inner rings and in the
    GPU form (fuse_sends: one transfer a hop, ΔK/ΔV one hop behind their block). (Overlap changes of 3d11809,
    tree rounds under the GEMMs with the accumulating ring, gave wrong outputs here on XLA:CPU, or crashed.)"""
    b, s, hidden, heads = 4, 256, 64, 8
    cfg = dict(num_heads=heads, num_kv_heads=heads, causal=True, rope_theta=10000.0, fuse_sends=fuse_sends)
    mesh = jaxring.make_mesh(tp=8)
    x, dy = normal(21, (b, s, hidden)), normal(22, (b, s, hidden))
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    params = attn_params(23, hidden, heads, heads, hidden // heads)
    run = jax.jit(out_and_grads(lambda x, w, pos: metp_api.attention_block(x, w, pos, mesh=mesh, **cfg), dy))
    cfg.pop("fuse_sends")
    ref = jax.jit(out_and_grads(lambda x, w, pos: attention_block_reference(x, w, pos, **cfg), dy))(x, params, pos)
    for attempt in range(3):
        check_tree(run(x, params, pos), ref, f"attention S={s} run {attempt}")


def mha_bytes(p, causal, kv_heads, *, backward):
    """Collective-permute bytes per device of the two-level METP MHA (b = local batch).

    Forward: p broadcasts × ceil(log2 p) rounds × (W_qkv_j + W_proj_j) = h(n + 2n_kv)d/p + ndh/p elements,
    and per head group p-1 hops of the K, V blocks b(s/p)(n_kv/p)d each (+ their int32 positions b·s/p when
    causal). Backward: the broadcasts again, the tree reduces of ΔW_j (same size), K/V p-1 hops, ΔK/ΔV p hops
    (fp32), positions p-1 hops. With n_kv = n, d = h/n: forward 4·log2(p)·h² + 2(p-1)/p·bsh (the paper's
    Table 2), backward 8·log2(p)·h² + (4p-2)/p·bsh (the paper has 4(p-1)/p: the gradients' extra hop).
    """
    b, rounds = B // data_degree(p), tree_rounds(p)
    weights = (H * (HEADS + 2 * kv_heads) * HEAD_DIM + HEADS * HEAD_DIM * H) // p
    kv = b * (S // p) * (kv_heads // p) * HEAD_DIM
    pos = b * (S // p) if causal else 0
    fwd = p * rounds * weights + p * (p - 1) * (2 * kv + pos)
    bwd = 2 * p * rounds * weights + p * ((p - 1) + p) * 2 * kv + p * (p - 1) * pos
    return F32 * (fwd + bwd if backward else fwd)


@pytest.mark.parametrize("p,causal", _mha_params([c for c in MHA_CASES if c != (2, True)]))
def test_attention_bytes(p, causal):
    """Forward + backward, exact. (p = 2 causal is left out: its one-hop loops are unrolled and XLA then sends
    the positions, the same for every head group, once instead of once per group.)"""
    _, _, moved = mha_case(p, causal)
    cfg = mha_config(p, causal)
    g = data_degree(p)
    weights = (H * (HEADS + 2 * cfg["num_kv_heads"]) * HEAD_DIM + HEADS * HEAD_DIM * H) // p
    assert moved["collective-permute"] == mha_bytes(p, causal, cfg["num_kv_heads"], backward=True)
    assert moved["all-reduce"] == round(2 * (g - 1) / g * weights * F32)  # ΔW summed over dp/fsdp
    assert moved["all-gather"] == moved["reduce-scatter"] == moved["all-to-all"] == 0


@pytest.mark.heavy
@pytest.mark.parametrize("p,causal", [(8, True), (4, False)], ids=["p8-causal", "p4-full"])
def test_attention_gpu_form_matches_reference_and_bytes(p, causal):
    """The inner rings' GPU form (fuse_sends=True: each hop one buffer; in the backward ΔK/ΔV one hop behind
    their K/V, sent before the block kernels) on CPU: forward and every gradient against the reference, and
    the same hops as the CPU form (exact bytes: K/V and positions p-1 hops, ΔK/ΔV p hops per head group)."""
    got, ref, moved = mha_case(p, causal, fuse_sends=True)
    check_tree(got, ref, f"attention gpu form p={p} causal={causal}")
    cfg = mha_config(p, causal)
    assert moved["collective-permute"] == mha_bytes(p, causal, cfg["num_kv_heads"], backward=True)


@pytest.mark.parametrize("p,causal", [(8, True), (4, False)], ids=["p8-causal", "p4-full"])
def test_attention_forward_bytes_and_residuals(p, causal):
    """The forward's bytes (exact), and the residuals it saves: X_i, the attention output A_i and its lse, plus
    the inputs (weights, positions) — no Q, K, V, no scores, nothing received."""
    cfg = mha_config(p, causal)
    mesh = mesh_of(p)
    x, pos = normal(11, (B, S, H)), positions_of(B, S)
    params = attn_params(13, H, HEADS, cfg["num_kv_heads"], HEAD_DIM)

    def forward_with_residuals(x, w, pos):
        out, vjp = jax.vjp(lambda x, w: metp_api.attention_block(x, w, pos, mesh=mesh, **cfg), x, w)
        return out, jax.tree.leaves(vjp)

    (_, saved), moved = compiled_run(forward_with_residuals, x, params, pos)
    assert moved == {
        **dict.fromkeys(moved, 0),
        "collective-permute": mha_bytes(p, causal, cfg["num_kv_heads"], backward=False),
    }
    extra = [(r.shape, r.dtype) for r in saved]
    for a in (x, pos, *params.values()):
        extra.remove((a.shape, a.dtype))  # the inputs, kept by reference
    # lse and A, sharded over all devices: [p, b, s/p, n/p, (d)] each, i.e. bsh/p (+ bsn/p) per device
    assert sorted((np.prod(shape), dtype) for shape, dtype in extra) == [
        (B * S * HEADS, jnp.float32),
        (B * S * HEADS * HEAD_DIM, jnp.float32),
    ], extra


@pytest.mark.slow  # (compiles both layers at s = 1024) METP's residuals and per-width memory run by default above
def test_layer_peak_below_megatron():
    """One FFN + MHA layer, forward and backward, compiled peak per device: METP below Megatron TP+SP at a long
    sequence (Megatron holds the gathered X [b, s, h] and [b, s, ffn/p]; METP only sequence shards and tiles)."""
    p, b, s, h, heads, d, ffn = 4, 2, 1024, 32, 4, 8, 128
    mesh = mesh_of(p)
    x = jax.ShapeDtypeStruct((b, s, h), jnp.float32)
    pos = jax.ShapeDtypeStruct((b, s), jnp.int32)
    shapes = {
        "wq": (h, heads * d),
        "wk": (h, heads * d),
        "wv": (h, heads * d),
        "wo": (heads * d, h),
        "w_in": (h, ffn),
        "w_out": (ffn, h),
    }
    params = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}

    def train_step(module):
        def layer(x, w, pos):
            attn = {k: w[k] for k in ("wq", "wk", "wv", "wo")}
            y = x + module.attention_block(x, attn, pos, mesh=mesh, num_heads=heads, num_kv_heads=heads)
            return y + module.mlp_block(y, {"w_in": w["w_in"], "w_out": w["w_out"]}, mesh=mesh)

        def step(x, w, pos, dy):
            out, vjp = jax.vjp(lambda x, w: layer(x, w, pos), x, w)
            return out, vjp(dy)

        return compile_stats(step, x, params, pos, x)

    ours, theirs = train_step(metp_api), train_step(megatron_api)
    assert ours.peak_bytes < theirs.peak_bytes, (ours.peak_bytes, theirs.peak_bytes)


# ---------------------------------------------------------------------------------------------------------
# Errors and parameter specs
# ---------------------------------------------------------------------------------------------------------


def test_errors():
    mesh = mesh_of(4)
    x, pos = jnp.zeros((2, S, H)), jnp.zeros((2, S), jnp.int32)
    w = mlp_params(0, H, FFN, "gelu")
    with pytest.raises(ValueError, match="ffn 66 is not divisible by tp = 4"):
        metp_api.mlp_block(x, mlp_params(0, H, 66, "gelu"), mesh=mesh)
    with pytest.raises(ValueError, match="seq 30 is not divisible by tp = 4"):
        metp_api.mlp_block(jnp.zeros((2, 30, H)), w, mesh=mesh)
    with pytest.raises(ValueError, match="batch 3 is not divisible"):
        metp_api.mlp_block(jnp.zeros((3, S, H)), w, mesh=mesh)
    with pytest.raises(ValueError, match="w_gate"):
        metp_api.mlp_block(x, w, mesh=mesh, activation="swiglu")
    with pytest.raises(ValueError, match="activation 'relu'"):
        metp_api.mlp_block(x, w, mesh=mesh, activation="relu")
    with pytest.raises(ValueError, match="sp=2 must be 1"):
        metp_api.mlp_block(x, w, mesh=jaxring.make_mesh(sp=2, tp=4))
    a = attn_params(0, H, 6, 6, HEAD_DIM)
    with pytest.raises(ValueError, match="num_heads 6 and num_kv_heads 6 must be divisible by tp = 4"):
        metp_api.attention_block(x, a, pos, mesh=mesh, num_heads=6, num_kv_heads=6)
    a = attn_params(0, H, 8, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="num_kv_heads 2 must be divisible by tp = 4"):
        metp_api.attention_block(x, a, pos, mesh=mesh, num_heads=8, num_kv_heads=2)
    a = attn_params(0, H, 8, 8, HEAD_DIM)
    with pytest.raises(ValueError, match="seq 30 is not divisible by tp = 4"):
        metp_api.attention_block(jnp.zeros((2, 30, H)), a, pos[:, :30], mesh=mesh, num_heads=8, num_kv_heads=8)
    with pytest.raises(ValueError, match="positions has shape"):
        metp_api.attention_block(x, a, pos[:, :16], mesh=mesh, num_heads=8, num_kv_heads=8)
    with pytest.raises(ValueError, match=r"params\['wk'\] has shape"):
        metp_api.attention_block(x, {**a, "wk": jnp.zeros((H, 12))}, pos, mesh=mesh, num_heads=8, num_kv_heads=8)


def test_param_specs():
    mesh = mesh_of(4)
    specs = metp_api.param_specs(mesh, {"w_in": (H, FFN), "w_out": (FFN, H), "attn": {"wq": (H, 32), "wo": (32, H)}})
    assert specs["w_in"].spec == P(None, "tp") and specs["w_out"].spec == P("tp", None)
    assert specs["attn"]["wq"].spec == P(None, "tp") and specs["attn"]["wo"].spec == P("tp", None)
    with pytest.raises(ValueError, match="unknown parameter 'bias'"):
        metp_api.param_specs(mesh, {"bias": (H,)})
    with pytest.raises(ValueError, match="divisible by tp = 4"):
        metp_api.param_specs(mesh, {"w_in": (H, 66)})


def test_attention_projections_in_row_chunks_match_reference(monkeypatch):
    """O_i and ΔX_i summed over the head groups chunk by chunk of rows (`PROJECTION_ROWS`; here 4 rows, so
    several chunks a device) equal the reference, forward and gradients (p = 4, causal)."""
    monkeypatch.setattr(metp_mha, "PROJECTION_ROWS", 4)
    x, dy, pos = normal(11, (B, S, H)), normal(12, (B, S, H)), positions_of(B, S)
    cfg = mha_config(4, True)
    params = attn_params(13, H, HEADS, cfg["num_kv_heads"], HEAD_DIM)
    mesh = mesh_of(4)
    got = jax.jit(out_and_grads(lambda x, w, pos: metp_api.attention_block(x, w, pos, mesh=mesh, **cfg), dy))(
        x, params, pos
    )
    ref = jax.jit(out_and_grads(lambda x, w, pos: attention_block_reference(x, w, pos, **cfg), dy))(x, params, pos)
    check_tree(got, ref, "attention p=4 causal, projections in chunks of 4 rows")
