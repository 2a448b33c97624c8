"""Sliding-window attention (the query at position i sees keys i - W < j <= i) through every sequence strategy,
layout, the jnp block compute and the tensor methods: forward and dq/dk/dv against
jax.nn.dot_product_attention(local_window_size=(W - 1, 0)) and the dense reference; ring steps outside every
window (or with no common segment) skipped, counted where the blocks run; one-line refusals.

The Pallas kernel's window is tested in interpret mode in test_flash.py. Windows: inside one block (3 < the
smallest block, 4 tokens), spanning blocks (21) and beyond the sequence (100 > 64: plain causal attention).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, attention_block_reference, check, padded_segments, qkv
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring import attention_reference
from jaxring.kernels.block_compute import get_block_ops
from jaxring.kernels.blockwise import block_backward, block_forward
from jaxring.kernels.layout import RankTokens
from jaxring.nn import Attention, param_placements
from jaxring.parallel.plan import ParallelPlan
from jaxring.parallel.sequence.ring import RingConfig, ring_forward, ring_window_share
from jaxring.parallel.sequence.wallfacer import WF_AXES, WallFacerConfig, wallfacer_forward, wallfacer_mesh
from jaxring.parallel.tensor import metp_api, optimus_api
from jaxring.parallel.tensor.contract import AttentionLayer
from jaxring.planner.calibration import calibration

WINDOWS = (3, 21, 100)


def nn_attention(q, k, v, window):
    """The independent oracle: jax.nn's local window (left W - 1, right 0) with the causal mask."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window - 1, 0))


def out_and_grads(fn, q, k, v, dout):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(dout)


@functools.cache
def oracles(seed, shape, window):
    """(q, k, v, dout) of qkv(seed, *shape) and, for `window`, (out, grads) of jax.nn and of the dense
    reference: computed once and shared by every test on the same inputs (fewer compiles)."""
    q, k, v, dout = qkv(seed, *shape)

    @jax.jit
    def run(q, k, v, dout):
        nn = out_and_grads(functools.partial(nn_attention, window=window), q, k, v, dout)
        ref = out_and_grads(lambda q, k, v: attention_reference(q, k, v, window=window)[0], q, k, v, dout)
        return nn, ref

    return (q, k, v, dout), run(q, k, v, dout)


def check_windows(fn, seed, shape, windows=WINDOWS, rtol=2e-4):
    """fn(q, k, v, window) for every window, on qkv(seed, *shape), against jax.nn and the dense reference:
    out, dq, dk, dv (fn's programs in one jit)."""
    (q, k, v, dout), _ = oracles(seed, shape, windows[0])
    run = jax.jit(lambda *x: [out_and_grads(functools.partial(fn, window=w), *x[:3], x[3]) for w in windows])
    for w, got in zip(windows, run(q, k, v, dout)):
        nn, ref = oracles(seed, shape, w)[1]
        check(got, nn, rtol)
        check(got, ref, rtol)


def test_reference_is_jax_nn_local_window():
    """The dense reference's window is jax.nn's (W - 1, 0) local window, GQA, forward and gradients; W = 1 is
    each token alone (out = v of its own position)."""
    check_windows(lambda q, k, v, window: attention_reference(q, k, v, window=window)[0], 0, (2, 48, 8, 2, 16), (1, 17))
    q, k, v, _ = qkv(0, 2, 48, 8, 2, 16)
    out = jax.jit(lambda q, k, v: attention_reference(q, k, v, window=1)[0])(q, k, v)
    assert_close(out, jnp.repeat(v, 4, axis=2), 1e-6, "W=1")


def test_reference_masks_by_positions():
    """Positions, not indices: a reversed K/V block with its positions gives the same attention."""
    q, k, v, _ = qkv(1, 1, 32, 4, 2, 8)
    pos = jnp.arange(32)

    @jax.jit
    def both(q, k, v):
        ref = attention_reference(q, k, v, window=6)[0]
        return ref, attention_reference(q, k[:, ::-1], v[:, ::-1], q_positions=pos, kv_positions=pos[::-1], window=6)[0]

    ref, flipped = both(q, k, v)
    assert_close(flipped, ref, 1e-5, "reversed keys")


# ------------------------------------------------------------------------------------- every strategy

STRATEGIES = {
    "ring-contiguous": dict(strategy="ring", layout="contiguous"),
    "ring-zigzag": dict(strategy="ring", layout="zigzag"),
    "ring-striped": dict(strategy="ring", layout="striped"),
    "rsa": dict(strategy="rsa"),
    "ulysses": dict(strategy="ulysses"),
    "usp": dict(strategy="usp", ulysses_size=2),
    "wallfacer": dict(strategy="wallfacer", team_size=2),
    "allgather": dict(strategy="allgather"),
}
MESHES = {"sp8": dict(sp=8), "dp2xsp4": dict(dp=2, sp=4)}
MESH_WINDOWS = {"sp8": WINDOWS, "dp2xsp4": WINDOWS[:2]}  # fewer compiles: beyond the sequence once is enough


# every strategy on sp8 by default; on dp2 x sp4 (the same local functions, the batch split over dp) the zig-zag
# ring by default and the others with -m slow
@pytest.mark.heavy
@pytest.mark.parametrize(
    "name,mesh_name",
    [
        pytest.param(n, m, id=f"{n}-{m}", marks=[pytest.mark.slow] if m != "sp8" and n != "ring-zigzag" else [])
        for m in MESHES
        for n in STRATEGIES
    ],
)
def test_strategy_matches_jax_nn_and_reference(name, mesh_name):
    """GQA (8 query heads, 2 K/V heads), seq 64: blocks of 8 (sp=8) or 16 (sp=4) tokens, zig-zag runs of 4 or 8."""
    mesh = jaxring.make_mesh(**MESHES[mesh_name])
    fn = lambda q, k, v, window: jaxring.sharded_attention(q, k, v, mesh=mesh, window=window, **STRATEGIES[name])
    check_windows(fn, 2, (2, 64, 8, 2, 16), MESH_WINDOWS[mesh_name])


def test_packed_segments_with_a_window():
    """Packed documents, padding and an all-padding device together with the window: ring (zig-zag, whose steps
    skip by window and by segment) and Ulysses, forward and gradients against the reference."""
    sp, seq = 8, 64
    mesh = jaxring.make_mesh(sp=sp)
    seg = jnp.asarray(padded_segments("zigzag", seq, sp))
    q, k, v, dout = qkv(3, 2, seq, 8, 2, 16)
    ref = lambda q, k, v: attention_reference(q, k, v, segment_ids=seg, window=13)[0]
    for strategy in ("ring", "ulysses"):
        fn = lambda q, k, v, strategy=strategy: jaxring.sharded_attention(
            q, k, v, mesh=mesh, strategy=strategy, layout="zigzag", segment_ids=seg, window=13
        )
        got, want = jax.jit(lambda q, k, v, d, fn=fn: (out_and_grads(fn, q, k, v, d), out_and_grads(ref, q, k, v, d)))(
            q, k, v, dout
        )
        check(got, want)
        assert np.all(np.asarray(got[0])[np.asarray(seg) == 0] == 0)


def test_ring_with_the_pallas_kernel_and_a_window():
    """The interpreted Pallas kernel as the ring's block compute (dp2 x sp4, zig-zag): window inside a block."""
    mesh = jaxring.make_mesh(dp=2, sp=4)
    fn = lambda q, k, v, window: jaxring.sharded_attention(
        q, k, v, mesh=mesh, layout="zigzag", block_ops="pallas_interpret", window=window
    )
    check_windows(fn, 2, (2, 64, 8, 2, 16), windows=(3,))


# ------------------------------------------------------------------------- the jnp block compute, tiled


def test_block_ops_with_small_tiles():
    """The jnp block pair with 8-token tiles on offset blocks (queries 24..55, keys 0..63), windows inside a
    tile, spanning tiles and beyond the keys: forward, and the backward from the global lse and delta,
    against the reference."""
    q, k, v, dout = qkv(5, 2, 64, 4, 2, 16)
    q, dout = q[:, :32], dout[:, :32]
    q_pos, kv_pos = jnp.arange(32) + 24, jnp.arange(64)

    @jax.jit
    def run(q, k, v, dout):
        rows = []
        for window in (3, 13, 70):
            kw = dict(q_positions=q_pos, kv_positions=kv_pos, sm_scale=0.25, window=window)
            ref = out_and_grads(lambda q, k, v, kw=kw: attention_reference(q, k, v, **kw)[0], q, k, v, dout)
            tiles = dict(q_tile=8, kv_tile=8, window=window, causal=True, sm_scale=0.25)
            out, lse = block_forward(q, k, v, q_pos, kv_pos, **tiles)
            delta = jnp.sum(dout * ref[0], axis=-1)  # the global delta, from the global out
            rows.append(((out, block_backward(q, k, v, dout, lse, delta, q_pos, kv_pos, **tiles)), ref))
        return rows

    for got, ref in run(q, k, v, dout):
        check(got, ref)


# --------------------------------------------------------------- whole steps skipped, where blocks run


def ring_work(layout, window, seq=128, sp=8, segment_ids=None, causal=True):
    """Query-key pairs of the run pairs each device computes in the forward (ring_forward's count)."""
    mesh = jaxring.make_mesh(sp=sp)
    q, k, v, _ = qkv(6, 1, seq, 2, 2, 8)
    spec = P(None, "sp", None, None)
    ops = get_block_ops("jnp")

    def local(q, k, v, *seg):
        seg = seg[0] if seg else None
        _, _, work = ring_forward(q, k, v, seg, RingConfig("sp", RankTokens(layout), causal, 0.3, ops, window=window))
        return work[None]

    args, specs = (q, k, v), (spec,) * 3
    if segment_ids is not None:
        args, specs = (*args, segment_ids), (*specs, P(None, "sp"))
    run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("sp"))
    return np.asarray(jax.jit(run)(*args))


def test_ring_skips_steps_outside_the_window():
    """seq 128 on sp=8, window 16 = seq/8 (one block). Contiguous: rank r computes its own block and block r-1
    only (r+1 blocks without the window). Zig-zag (half-chunks of 8): query chunk c reaches chunks c, c-1 and
    c-2, so rank r (chunks r and 15-r) computes 4, 5, then 6 run pairs instead of 2P+1 = 17."""
    n, h = 16, 8
    contiguous = ring_work("contiguous", 16)
    np.testing.assert_array_equal(contiguous, np.minimum(np.arange(8) + 1, 2) * n * n)
    zigzag = ring_work("zigzag", 16)
    np.testing.assert_array_equal(zigzag, np.array([4, 5, 6, 6, 6, 6, 6, 6]) * h * h)
    # without a window: the causal counts (ring.py's balance), so the window is what skipped the rest
    np.testing.assert_array_equal(ring_work("zigzag", None), 17 * h * h)


def test_ring_cost_prices_the_steps_the_ring_computes():
    """The planner's share of the causal work a windowed ring still computes (`ring_window_share`, from the
    layout's run bounds) is the busiest rank's count of the ring itself, with the window over without."""
    for layout in ("contiguous", "zigzag"):
        full = ring_work(layout, None).max()
        for window in (9, 16, 17, 40):  # 9, 17: one past a half-chunk and a block
            share = ring_window_share(layout, 8, 16, window)
            assert share == pytest.approx(ring_work(layout, window).max() / full), (layout, window)
            assert share < 1


def _kernel_visits(q_positions, kv_len, window, cpu, head_dim):
    """The local kernels' own loop bounds, summed: for each kernel of a forward and backward, the tiles
    between each outer tile's (lo, hi) (the jnp pair: `blockwise.tile_ranges`; Pallas: `visibility` and
    `loop_ranges` as pallas_forward and pallas_backward form them, dK/dV over the transposed tiles), times
    its matmuls and tile size (`kernel_passes`)."""
    from jaxring.kernels.blockwise import tile_ranges
    from jaxring.kernels.flash_tiles import loop_ranges, visibility
    from jaxring.kernels.window_work import kernel_passes

    qp, kp = jnp.asarray(q_positions, jnp.int32), jnp.arange(kv_len, dtype=jnp.int32)
    total = 0
    for over, bq, bk, matmuls in kernel_passes(cpu, len(q_positions), kv_len, head_dim):
        if cpu:
            ranges = tile_ranges(qp, kp, None, None, causal=True, q_tile=bq, kv_tile=bk, window=window)
        else:
            vis, full = visibility(True, qp[None], kp[None], None, None, 1, len(qp), kv_len, kv_len, bq, bk, window)
            if over == "k":
                vis, full = jnp.swapaxes(vis, 1, 2), jnp.swapaxes(full, 1, 2)
            ranges = loop_ranges(vis, full)[0]
        ranges = np.asarray(ranges)
        total += matmuls * bq * bk * int((ranges[:, 3] - ranges[:, 0]).sum())
    return total


@pytest.mark.parametrize("cpu", [True, False], ids=["jnp", "pallas"])
def test_local_kernels_price_the_tiles_they_visit(cpu):
    """Ulysses and dense attention (the whole sequence in order) and the all-gather (each rank's layout shard
    against the keys in order) price what their kernels visit under a window (`window_share`): the busiest
    rank's count of the kernels' own loop bounds, with the window over without (seq 1024, head_dim 16;
    windows inside a tile, one past it, and beyond the sequence)."""
    from jaxring.kernels.layout import layout_positions
    from jaxring.parallel.cost_terms import AttentionShape
    from jaxring.parallel.registry import sequence_strategy

    seq, d = 1024, 16
    for name, layout, p in (
        ("dense", "contiguous", 1),
        ("ulysses", "contiguous", 4),
        ("allgather", "zigzag", 4),
        ("allgather", "contiguous", 4),
        ("allgather", "striped", 4),
    ):
        q_ranks = 1 if name != "allgather" else p  # Ulysses' kernel sees the whole sequence
        queries = [np.asarray(layout_positions(layout, r, q_ranks, seq // q_ranks)) for r in range(q_ranks)]
        for window in (16, 33, 300, 2000):
            axes = {} if name == "dense" else {"sp": p}
            n = seq // (p if name != "dense" else 1)
            fitted = calibration("cpu" if cpu else "gpu").fitted_terms(name)
            shape = AttentionShape(
                2, n, 8, 8, d, 4, 4, seq, True, cpu, axes, window=window, layout=layout, fitted=fitted
            )
            share = sequence_strategy(name).cost(shape, {}).window_share
            visits = {w: max(_kernel_visits(q, seq, w, cpu, d) for q in queries) for w in (window, None)}
            assert share == pytest.approx(visits[window] / visits[None]), (name, layout, window)
            assert share < 1 or window >= seq, (name, layout, window)


def test_ring_skips_steps_with_no_common_segment():
    """Documents of 16 tokens on 8-token blocks (contiguous): a step whose Q and K/V blocks share no segment is
    skipped, causal or not; with causal, rank r computes its own block and, when odd, block r-1."""
    seg = jnp.asarray(np.repeat(np.arange(1, 5), 16)[None], jnp.int32)
    n = 8
    causal = ring_work("contiguous", None, seq=64, segment_ids=seg)
    np.testing.assert_array_equal(causal, np.array([1, 2] * 4) * n * n)
    full = ring_work("contiguous", None, seq=64, segment_ids=seg, causal=False)
    np.testing.assert_array_equal(full, 2 * n * n)


def test_wallfacer_counts_exactly_the_window_pairs():
    """WallFacer (C=2, sp=8, zig-zag, seq 128, window 16): every query-key pair inside the window is computed
    once over the devices (sum_i min(i + 1, W)), and the run pairs computed shrink from the causal ones."""
    seq, window = 128, 16
    mesh = wallfacer_mesh(jaxring.make_mesh(sp=8), 2)
    q, k, v, _ = qkv(7, 1, seq, 2, 2, 8)
    spec = P(None, WF_AXES, None, None)
    ops = get_block_ops("jnp")

    def local(q, k, v, window):
        _, _, work = wallfacer_forward(q, k, v, None, WallFacerConfig(2, "zigzag", True, 0.3, ops, window=window))
        return work[None]

    run = lambda w: jax.jit(
        jax.shard_map(functools.partial(local, window=w), mesh=mesh, in_specs=(spec,) * 3, out_specs=P(WF_AXES))
    )
    work = {w: np.asarray(run(w)(q, k, v)) for w in (window, None)}
    assert work[window][:, 1].sum() == sum(min(i + 1, window) for i in range(seq))
    assert work[None][:, 1].sum() == seq * (seq + 1) // 2
    assert work[window][:, 0].sum() < 0.5 * work[None][:, 0].sum()


def test_usp_and_wallfacer_price_the_steps_they_compute():
    """USP's ring (R = 4 ranks, each U = 2 gathered shards: `RankTokens(layout, 2)`) and WallFacer's sub-ring
    (C = 2, sp = 8) under a window, seq 128: their cost's `window_share` is the busiest device's run-pair work
    of `ring_forward`'s and `wallfacer_forward`'s own counts, with the window over without."""
    from jax.sharding import Mesh

    from jaxring.parallel.cost_terms import AttentionShape
    from jaxring.parallel.registry import sequence_strategy

    seq, windows, ops = 128, (9, 17, 40, None), get_block_ops("jnp")
    q, k, v, _ = qkv(6, 1, seq, 2, 2, 8)

    def usp_ring(q, k, v, layout):  # the ring USP runs over its 4 groups of gathered shards
        configs = [RingConfig("sp", RankTokens(layout, 2), True, 0.3, ops, window=w) for w in windows]
        work = [ring_forward(q, k, v, None, cfg)[2] for cfg in configs]
        return jnp.stack(work)[None]

    def wallfacer(q, k, v, layout):  # work[0]: query-key pairs of the run pairs computed
        configs = [WallFacerConfig(2, layout, True, 0.3, ops, window=w) for w in windows]
        work = [wallfacer_forward(q, k, v, None, cfg)[2][0] for cfg in configs]
        return jnp.stack(work)[None]

    cases = (
        ("usp", usp_ring, Mesh(np.array(jax.devices()[:4]), ("sp",)), "sp", {"usp_ring": 4, "usp_ulysses": 2}),
        ("wallfacer", wallfacer, wallfacer_mesh(jaxring.make_mesh(sp=8), 2), WF_AXES, dict.fromkeys(WF_AXES, 2)),
    )
    for name, local, mesh, spec, axes in cases:
        options = {"ulysses_size": 2} if name == "usp" else {"team_size": 2}
        for layout in ("contiguous", "zigzag"):
            blocks = P(None, spec, None, None)
            run = jax.shard_map(
                functools.partial(local, layout=layout), mesh=mesh, in_specs=(blocks,) * 3, out_specs=P(spec)
            )
            work = np.asarray(jax.jit(run)(q, k, v))  # [devices, windows]
            for i, w in enumerate(windows[:-1]):
                fitted = calibration("cpu").fitted_terms(name)
                shape = AttentionShape(
                    1, seq // 8, 2, 2, 8, 4, 4, seq, True, True, axes, window=w, layout=layout, fitted=fitted
                )
                share = sequence_strategy(name).cost(shape, options).window_share
                assert share == pytest.approx(work[:, i].max() / work[:, -1].max()), (name, layout, w)
                assert share < 1 or w > 17, (name, layout, w)  # 40: the last team still computes all


# ----------------------------------------------------------------------------------- tensor methods

B, S, H, HEADS, KV = 2, 64, 32, 8, 4


def _weights(seed, hidden, heads, kv_heads, head_dim):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    shapes = {"wq": (hidden, heads * head_dim), "wk": (hidden, kv_heads * head_dim)}
    shapes |= {"wv": shapes["wk"], "wo": (heads * head_dim, hidden)}
    return {n: 0.3 * jax.random.normal(kk, s, jnp.float32) for kk, (n, s) in zip(keys, shapes.items())}


def _block_check(block, reference, x, params, dy, rtol=2e-4):
    """y, dx and every weight gradient of block(x, params) against reference(x, params), each in its own jit
    (XLA's SPMD partitioner miscomputes some auto-sharded dot chains of a reference traced beside a sharded
    program: see test_optimus.py's `_compare`)."""

    def run(fn):
        y, vjp = jax.vjp(fn, x, params)
        return (y, *vjp(dy))

    (y, dx, dw), (y_r, dx_r, dw_r) = (jax.jit(functools.partial(run, fn))() for fn in (block, reference))
    assert_close(y, y_r, rtol, "y")
    assert_close(dx, dx_r, rtol, "dx")
    for name in dw_r:
        assert_close(dw[name], dw_r[name], rtol, "d" + name)


def test_megatron_tp2_x_ring_sp4_with_a_window():
    """Megatron over tp=2 with the zig-zag ring over sp=4 (GQA), through the tensor method's attention inside
    the plan's shard_map (as a model layer calls it)."""
    window = 11
    plan = ParallelPlan(jaxring.make_mesh(tp=2, sp=4), tensor_parallel="megatron", attention="ring")
    module = Attention(H, HEADS, KV, rngs=nnx.Rngs(0))
    state = nnx.split(module)[1]
    params = _weights(1, H, HEADS, KV, H // HEADS)
    specs = jax.tree.map(
        lambda pl: pl.param_spec(0), param_placements(state, plan), is_leaf=lambda v: hasattr(v, "param_spec")
    )
    rng = np.random.default_rng(0)
    (x, dy), positions = plan.layout_tokens(*(rng.standard_normal((B, S, H)).astype(np.float32) for _ in range(2)))
    x, dy, positions = jnp.asarray(x), jnp.asarray(dy), jnp.asarray(np.broadcast_to(positions, (B, S)))
    layer = AttentionLayer(HEADS, KV, H // HEADS, causal=True, rope=10000.0, window=window)
    sharded = plan.shard_map(
        lambda x, w, pos: plan.tensor.attention(plan, x, w, pos, layer),
        in_specs=(plan.activation_spec(), specs, plan.token_spec()),
        out_specs=plan.activation_spec(),
    )
    _block_check(
        lambda x, w: sharded(x, w, positions),
        lambda x, w: attention_block_reference(x, w, positions, HEADS, KV, True, 10000.0, window),
        x,
        params,
        dy,
    )


def test_metp_tp4_attention_block_with_a_window():
    """METP's two-level attention (dp2 x tp4): its inner K/V ring masks by positions and skips by the window."""
    mesh = jaxring.make_mesh(dp=2, tp=4)
    x, dy = (jax.random.normal(jax.random.PRNGKey(s), (B, 32, H)) for s in (2, 3))
    params = _weights(4, H, HEADS, KV, H // HEADS)
    positions = jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (B, 32))
    kw = dict(num_heads=HEADS, num_kv_heads=KV, causal=True, rope_theta=10000.0)
    _block_check(
        lambda x, p: metp_api.attention_block(x, p, positions, mesh=mesh, window=5, **kw),
        lambda x, p: attention_block_reference(x, p, positions, HEADS, KV, True, 10000.0, 5),
        x,
        params,
        dy,
    )


def test_optimus_tp4_attention_block_with_a_window():
    """Optimus on the 2 x 2 grid (tp=4, dp=2): local flash attention of whole sequences, with the window."""
    mesh = jaxring.make_mesh(dp=2, tp=4)
    x, dy = (jax.random.normal(jax.random.PRNGKey(s), (4, 16, H)) for s in (5, 6))
    params = _weights(7, H, HEADS, KV, H // HEADS)
    positions = jnp.arange(16, dtype=jnp.int32)[None, :] + 3 * jnp.arange(4, dtype=jnp.int32)[:, None]
    kw = dict(num_heads=HEADS, num_kv_heads=KV, causal=True, rope_theta=10000.0)
    _block_check(
        lambda x, p: optimus_api.attention_block(x, p, positions, mesh=mesh, window=6, **kw),
        lambda x, p: attention_block_reference(x, p, positions, HEADS, KV, True, 10000.0, 6),
        x,
        params,
        dy,
    )


# ------------------------------------------------------------------------------------------- errors


def test_refusals_name_the_value_and_the_rule():
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, _ = qkv(8, 1, 32, 4, 2, 8)
    with pytest.raises(ValueError, match="window 4 needs causal=True"):
        jaxring.sharded_attention(q, k, v, mesh=mesh, causal=False, window=4)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"window {bad!r} must be a positive integer"):
            jaxring.sharded_attention(q, k, v, mesh=mesh, window=bad)
    with pytest.raises(ValueError, match="window 0 must be a positive integer"):
        jaxring.flash_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="window 2 needs causal=True"):
        attention_reference(q, k, v, causal=False, window=2)
    x = jnp.zeros((4, 32, H))
    params = _weights(0, H, HEADS, KV, H // HEADS)
    pos = jnp.zeros((4, 32), jnp.int32)
    kw = dict(mesh=jaxring.make_mesh(dp=2, tp=4), num_heads=HEADS, num_kv_heads=KV)
    for block in (metp_api.attention_block, optimus_api.attention_block):
        with pytest.raises(ValueError, match="window 8 needs causal=True"):
            block(x, params, pos, causal=False, window=8, **kw)
