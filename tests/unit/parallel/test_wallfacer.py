"""WallFacer attention [WallFacer]: accuracy against the dense reference (forward and dQ/dK/dV), C = 1 against
ring attention, the factored mesh and the init map, bytes moved against the paper's formulas, causal
balance of the team-level zigzag, and error messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check, qkv, with_reference
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring import attention_reference, layout_permutation
from jaxring.analysis import compile_stats
from jaxring.kernels.block_compute import get_block_ops
from jaxring.parallel.sequence.wallfacer import (
    WF_AXES,
    WallFacerConfig,
    get_init_send,
    get_p2p_config,
    init_pairs,
    wallfacer_attention,
    wallfacer_forward,
    wallfacer_mesh,
    wallfacer_permutation,
)


def sharded_wallfacer(q, k, v, segment_ids=None, **options):
    return jaxring.sharded_attention(q, k, v, segment_ids=segment_ids, strategy="wallfacer", **options)


def wallfacer_and_reference(mesh, q, k, v, dout, *, team_size, placement, causal, layout, segment_ids=None):
    """(out, grads) of wallfacer and of the reference, each from one jitted forward + VJP."""
    wf = lambda q, k, v: sharded_wallfacer(
        q, k, v, segment_ids, mesh=mesh, team_size=team_size, placement=placement, causal=causal, layout=layout
    )
    return with_reference(wf, q, k, v, dout, causal=causal, segment_ids=segment_ids)


# (mesh degrees, C, placement, layout, causal, q heads, kv heads, head dim, batch): every axis value covered
CASES = {
    "sp8-C1-zigzag-causal-gqa": (dict(sp=8), 1, "team_inner", "zigzag", True, 4, 2, 32, 1),
    "sp8-C2-zigzag-causal-gqa": (dict(sp=8), 2, "team_inner", "zigzag", True, 4, 2, 32, 1),
    "sp8-C2-ringinner-contiguous-causal-d64": (dict(sp=8), 2, "ring_inner", "contiguous", True, 4, 4, 64, 1),
    "sp8-C2-ringinner-zigzag-full-gqa-d64": (dict(sp=8), 2, "ring_inner", "zigzag", False, 4, 2, 64, 1),
    "sp8-C1-contiguous-full": (dict(sp=8), 1, "ring_inner", "contiguous", False, 4, 4, 32, 1),
    "dp2xsp4-C2-zigzag-causal-gqa-d64": (dict(dp=2, sp=4), 2, "team_inner", "zigzag", True, 4, 2, 64, 2),
    "dp2xsp4-C2-ringinner-contiguous-full": (dict(dp=2, sp=4), 2, "ring_inner", "contiguous", False, 4, 2, 32, 2),
    "sp4xtp2-C2-zigzag-causal-gqa": (dict(sp=4, tp=2), 2, "team_inner", "zigzag", True, 4, 2, 32, 1),
}


# with -m slow only: C = 1 contiguous full (C = 1 is ring attention, test_team_size_one_is_ring_attention) and the
# dp2 x sp4 ring-inner contiguous full case (dp2 x sp4 and ring-inner placement both run by default)
SLOW_CASES = ("sp8-C1-contiguous-full", "dp2xsp4-C2-ringinner-contiguous-full")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def test_matches_reference(case):
    degrees, c, placement, layout, causal, hq, hkv, d, batch = CASES[case]
    mesh = jaxring.make_mesh(**degrees)
    q, k, v, dout = qkv(len(case), batch, 32, hq, hkv, d)
    got = wallfacer_and_reference(mesh, q, k, v, dout, team_size=c, placement=placement, causal=causal, layout=layout)
    check(*got, 2e-4)


@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)])
def test_segments_with_padding_and_an_all_padding_device(layout, causal):
    sp, seq = 8, 64
    mesh = jaxring.make_mesh(sp=sp)
    seg = np.ones((1, seq), np.int32)
    seg[0, 20:45], seg[0, 45:58], seg[0, 58:] = 2, 3, 0  # packed segments, padded tail
    seg[0, layout_permutation(layout, seq, sp).reshape(sp, -1)[5]] = 0  # every token of device 5 is padding
    q, k, v, dout = qkv(3, 1, seq, 4, 2, 16)
    got = wallfacer_and_reference(
        mesh, q, k, v, dout, team_size=2, placement="team_inner", causal=causal, layout=layout, segment_ids=seg
    )
    check(*got, 2e-4)
    out, grads = got[0]
    assert np.all(np.asarray(out)[seg == 0] == 0)
    assert all(np.all(np.asarray(g)[seg == 0] == 0) for g in grads)


@pytest.mark.parametrize("layout", [pytest.param("contiguous", marks=pytest.mark.slow), "zigzag"])
def test_team_size_one_is_ring_attention(layout):
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, dout = qkv(7, 1, 32, 4, 2, 16)

    @jax.jit
    def run(q, k, v, dout):
        def both(fn):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(dout)

        wf = both(lambda q, k, v: sharded_wallfacer(q, k, v, mesh=mesh, team_size=1, layout=layout))
        ring = both(lambda q, k, v: jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="ring", layout=layout))
        return wf, ring

    check(*run(q, k, v, dout), 1e-6)


@pytest.mark.slow  # the block kernels' fp32 accumulation runs by default in test_ring.py's bf16 case
def test_bf16_inputs_accumulate_in_fp32():
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, dout = qkv(2, 1, 64, 4, 2, 32, dtype=jnp.bfloat16)
    (out, grads), _ = wallfacer_and_reference(
        mesh, q, k, v, dout, team_size=2, placement="team_inner", causal=True, layout="zigzag"
    )
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    f32 = lambda x: x.astype(jnp.float32)  # oracle: fp32 reference on the same bf16-rounded inputs
    out_r, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=True)[0], f32(q), f32(k), f32(v))
    check((out, grads), (out_r, vjp(f32(dout))), 2e-2)


def test_with_the_pallas_kernel_interpreted():
    """The Pallas flash kernel's block entry points as the per-block compute (interpreted on CPU)."""
    mesh = jaxring.make_mesh(dp=2, sp=4)
    q, k, v, dout = qkv(6, 2, 32, 4, 2, 16)

    @jax.jit
    def run(q, k, v, dout):
        out, vjp = jax.vjp(
            lambda q, k, v: sharded_wallfacer(
                q, k, v, mesh=mesh, team_size=2, layout="zigzag", block_ops="pallas_interpret"
            ),
            q,
            k,
            v,
        )
        return out, vjp(dout)

    out_r, vjp_r = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=True)[0], q, k, v)
    check(run(q, k, v, dout), (out_r, vjp_r(dout)), 2e-4)


# --------------------------------------------------------------------------------- mesh, maps, layouts


@pytest.mark.parametrize("placement", ["team_inner", "ring_inner"])
def test_factored_mesh_placement(placement):
    mesh = jaxring.make_mesh(sp=8)
    wf = wallfacer_mesh(mesh, 2, placement)
    i = mesh.axis_names.index("sp")
    assert wf.axis_names == mesh.axis_names[:i] + ("wf_group", "wf_ring", "wf_team") + mesh.axis_names[i + 1 :]
    assert dict(wf.shape)["wf_group"] == 2 and dict(wf.shape)["wf_ring"] == 2 and dict(wf.shape)["wf_team"] == 2
    ids = np.vectorize(lambda d: d.id)(wf.devices).reshape(2, 2, 2)  # [g, j, a]
    sp_ids = [d.id for d in mesh.devices.reshape(-1)]
    for g in range(2):
        for j in range(2):
            for a in range(2):
                sp_index = g * 4 + (j * 2 + a if placement == "team_inner" else a * 2 + j)
                assert ids[g, j, a] == sp_ids[sp_index]
    other = wallfacer_mesh(jaxring.make_mesh(dp=2, sp=4), 2)
    assert {k: v for k, v in dict(other.shape).items() if v > 1 or k.startswith("wf_")} == dict(
        dp=2, wf_group=2, wf_ring=1, wf_team=2
    )


@pytest.mark.parametrize("p,c", [(8, 1), (8, 2), (4, 2), (16, 2), (16, 4), (32, 4)])
def test_init_map_and_sub_rings(p, c):
    tgs = p // (c * c)
    pairs = init_pairs(p, c)
    target = dict(pairs)
    assert sorted(target.values()) == list(range(p))  # a bijection
    for r in range(p):  # the digest's closed form
        assert target[r] == ((r % c) * tgs + (r // c) // c) * c + (r // c) % c
    if c == 1:
        assert all(s == t for s, t in pairs)
    # after the init map rank R holds team chunk R mod P/C; at step s the device (g, j, a) holds the chunk
    # of (g, j - s, a); every team's members then see every team chunk exactly once, all of them together
    holds = {t: s // c for s, t in pairs}
    for team in range(p // c):
        g, j = divmod(team, tgs)
        seen = [holds[g * (p // c) + ((j - s) % tgs) * c + a] for a in range(c) for s in range(tgs)]
        assert sorted(seen) == list(range(p // c))
    # Algorithm 3: next/last are the wf_ring neighbours inside the same (group, member)
    for r in range(p):
        t, a = divmod(r, c)
        nxt, last = get_p2p_config(t, a, p // c, c)
        g, j = divmod(t, tgs)
        assert nxt == (g * tgs + (j + 1) % tgs) * c + a and last == (g * tgs + (j - 1) % tgs) * c + a
    assert get_init_send(1, 0, p // c, c) == target[c]


@pytest.mark.parametrize("c", [1, 2])
def test_permutation_is_the_device_zigzag_and_teams_hold_the_zigzag_chunks(c):
    p, seq = 8, 64
    assert np.array_equal(wallfacer_permutation("contiguous", seq, p, c), np.arange(seq))
    perm = wallfacer_permutation("zigzag", seq, p, c)
    assert np.array_equal(perm, layout_permutation("zigzag", seq, p))
    chunk = seq * c // (2 * p)  # 2P/C chunks of the team zigzag
    for team in range(p // c):
        held = np.sort(perm.reshape(p // c, -1)[team])
        want = np.concatenate(
            [
                np.arange(team * chunk, (team + 1) * chunk),
                np.arange((2 * p // c - 1 - team) * chunk, (2 * p // c - team) * chunk),
            ]
        )
        assert np.array_equal(held, want)


# ------------------------------------------------------------------------------------------------ bytes

B, SEQ, HQ, HKV, D = 1, 256, 4, 2, 16


def _local(mesh, c, layout):
    spec = P(None, WF_AXES, None, None)
    return jax.shard_map(
        lambda q, k, v: wallfacer_attention(q, k, v, team_size=c, layout=layout),
        mesh=mesh,
        in_specs=(spec,) * 3,
        out_specs=spec,
    )


def _shapes():
    # fp32: XLA:CPU widens bf16 collectives to f32, which would hide a 2-byte count
    q = jax.ShapeDtypeStruct((B, SEQ, HQ, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, SEQ, HKV, D), jnp.float32)
    return q, kv, kv


@pytest.mark.parametrize("sp,c,layout", [(8, 2, "zigzag"), (8, 1, "zigzag"), (4, 2, "contiguous")])
def test_forward_bytes_match_the_paper(sp, c, layout):
    mesh = wallfacer_mesh(jaxring.make_mesh(sp=sp, dp=8 // sp), c)
    stats = compile_stats(_local(mesh, c, layout), *_shapes())
    n = SEQ // sp
    kv_block = B * n * HKV * D * 4  # one device's K (or V) shard, fp32 bytes
    ring_all_p_sends = sp * 2 * kv_block  # ring attention's P(2BNH/P) (Eq. 2), K and V
    ring_p2p = 2 * (sp - 1) * kv_block  # ring.py: the last hop is skipped
    if c == 1:
        assert stats.bytes_moved["collective-permute"] == ring_p2p
    else:
        init = 2 * c * kv_block  # the team's K/V along the init map
        sub_ring = (sp // c**2 - 1) * 2 * c * kv_block
        assert stats.bytes_moved["collective-permute"] == init + sub_ring == ring_all_p_sends // c
    # team collectives: Eq. 3 with GQA, 3 all-gathers + 1 reduce-scatter, plus the fp32 lse rows
    q_block = B * n * HQ * D * 4
    lse_rows = B * n * HQ * 4
    assert stats.bytes_moved["all-gather"] == (c - 1) * (q_block + 2 * kv_block) + (c - 1) * lse_rows
    assert stats.bytes_moved["reduce-scatter"] == (c - 1) * q_block
    assert stats.bytes_moved["all-to-all"] == (c - 1) * lse_rows
    assert stats.bytes_moved["all-reduce"] == 0


def test_forward_and_backward_bytes():
    sp, c = 8, 2
    mesh = wallfacer_mesh(jaxring.make_mesh(sp=sp), c)
    f = _local(mesh, c, "zigzag")
    q, k, v = _shapes()
    dout = jax.ShapeDtypeStruct(q.shape, jnp.float32)  # an argument, so XLA cannot fold dO away

    def grads(q, k, v, dout):
        return jax.vjp(f, q, k, v)[1](dout)

    stats = compile_stats(grads, q, k, v, dout)
    n, tgs = SEQ // sp, sp // c**2
    q_block, kv_block, rows = B * n * HQ * D * 4, B * n * HKV * D * 4, B * n * HQ * 4
    fwd_p2p = 2 * c * kv_block + (tgs - 1) * 2 * c * kv_block
    # Q, dO, lse, delta around the sub-ring; dQ (fp32) with them plus the hop home; dK/dV back (inverse map)
    bwd_p2p = (tgs - 1) * c * (2 * q_block + 2 * rows) + tgs * c * q_block + 2 * c * kv_block
    assert stats.bytes_moved["collective-permute"] == fwd_p2p + bwd_p2p
    fwd_gather = (c - 1) * (q_block + 2 * kv_block + rows)
    bwd_gather = (c - 1) * (q_block + rows)  # dO and delta
    assert stats.bytes_moved["all-gather"] == fwd_gather + bwd_gather
    assert stats.bytes_moved["reduce-scatter"] == (c - 1) * q_block + (c - 1) * (q_block + 2 * kv_block)
    assert stats.bytes_moved["all-to-all"] == (c - 1) * rows


# ---------------------------------------------------------------------------------------------- balance


def per_device_work(layout, sp, c, seq):
    """[P, 2] (computed run-pair query-key pairs, causally visible ones) per logical rank, causal forward."""
    mesh = wallfacer_mesh(jaxring.make_mesh(sp=sp, dp=8 // sp), c)
    q, k, v, _ = qkv(4, 1, seq, 2, 2, 8)
    spec = P(None, WF_AXES, None, None)
    ops = get_block_ops("jnp")

    def local(q, k, v):
        _, _, work = wallfacer_forward(q, k, v, None, WallFacerConfig(c, layout, True, 0.3, ops))
        return work[None]

    run = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=P(WF_AXES))
    return np.asarray(jax.jit(run)(q, k, v))


@pytest.mark.parametrize("sp,c", [(8, 2), (4, 2)])
def test_team_zigzag_balances_causal_work(sp, c):
    seq = 16 * sp
    zigzag, contiguous = per_device_work("zigzag", sp, c, seq), per_device_work("contiguous", sp, c, seq)
    tgs, h = sp // c**2, seq * c // (2 * sp)  # sub-ring length, team zigzag chunk
    # every (Q team, K/V team chunk) pair: 2 of 4 chunk pairs, except a team meeting its own chunk (member
    # T mod C), which computes 3 (two of them diagonal, half visible)
    own = np.array([(r // c) % c == r % c for r in range(sp)], np.int64)
    np.testing.assert_array_equal(zigzag[:, 0], (2 * tgs + own) * h * h)
    np.testing.assert_array_equal(zigzag[:, 1], 2 * tgs * h * h + own * h)
    visible = zigzag[:, 1]
    assert visible.max() <= 1.05 * visible.min()
    assert contiguous[:, 1].max() >= 2 * contiguous[:, 1].min()
    assert visible.sum() == contiguous[:, 1].sum() == seq * (seq + 1) // 2  # every visible pair once


# ----------------------------------------------------------------------------------------------- errors


def test_errors_name_the_value_and_rule():
    mesh = jaxring.make_mesh(sp=8)
    q, k, v, _ = qkv(0, 1, 32, 4, 2, 8)
    with pytest.raises(ValueError, match="team_size C=3: C² = 9 must divide sp = 8"):
        sharded_wallfacer(q, k, v, mesh=mesh, team_size=3)
    with pytest.raises(ValueError, match="team_size C=4: C² = 16 must divide sp = 8"):
        wallfacer_mesh(mesh, 4)
    with pytest.raises(ValueError, match="team_size C=0 must be an integer ≥ 1"):
        sharded_wallfacer(q, k, v, mesh=mesh, team_size=0)
    with pytest.raises(ValueError, match="placement 'diagonal' is not one of team_inner, ring_inner"):
        sharded_wallfacer(q, k, v, mesh=mesh, team_size=2, placement="diagonal")
    with pytest.raises(ValueError, match="layout 'striped' is not supported by wallfacer"):
        sharded_wallfacer(q, k, v, mesh=mesh, team_size=2, layout="striped")
    with pytest.raises(ValueError, match="seq 24 is not divisible by 2\\*sp = 16"):
        sharded_wallfacer(q[:, :24], k[:, :24], v[:, :24], mesh=mesh, team_size=2, layout="zigzag")
    with pytest.raises(ValueError, match="seq 20 is not divisible by sp = 8"):
        sharded_wallfacer(q[:, :20], k[:, :20], v[:, :20], mesh=mesh, team_size=2, layout="contiguous")
    with pytest.raises(ValueError, match=r"batch 1 is not divisible by the data-parallel degree dp\*fsdp(\*ep)? = 2"):
        sharded_wallfacer(q, k, v, mesh=jaxring.make_mesh(dp=2, sp=4), team_size=2)
    with pytest.raises(ValueError, match="mesh axes \\('data',\\) have no 'sp' axis"):
        sharded_wallfacer(q, k, v, mesh=jax.make_mesh((8,), ("data",)), team_size=2)
    wf = wallfacer_mesh(mesh, 2)
    spec = P(None, WF_AXES, None, None)
    local = jax.shard_map(
        lambda q, k, v: wallfacer_attention(q, k, v, team_size=1), mesh=wf, in_specs=(spec,) * 3, out_specs=spec
    )
    with pytest.raises(ValueError, match="team_size C=1 does not match the mesh"):
        jax.eval_shape(local, q, k, v)
