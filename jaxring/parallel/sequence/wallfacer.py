"""WallFacer attention [WallFacer] (REFERENCES.md): multi-ring sequence parallelism with teams of C devices.

P devices hold the sequence (n = S/P tokens each). They form P/C *teams* of C devices; P/C² teams make a
*team group* (C groups). Within a group, the devices with the same rank a inside their team form a
*sub-ring* of P/C² devices (C² sub-rings in all). C = 1 is ring attention; C = √P has no ring hops at all.
Inside `shard_map` the devices are the factored mesh axes ("wf_group", "wf_ring", "wf_team") of sizes
(C, P/C², C): the device at (g, j, a) has logical rank R = g·P/C + j·C + a, is member a of team
T = g·P/C² + j = R // C, and holds the sequence shard R (see "Layouts"). `wallfacer_mesh` builds that view
of the `sp` devices; the placement only decides which physical device gets which (g, j, a):

  team_inner  sp device g·P/C + j·C + a: team members are neighbours (all-gather/reduce-scatter intra-node)
  ring_inner  sp device g·P/C + a·P/C² + j: sub-ring neighbours are neighbours (ring hops intra-node)

Forward (Algorithm 1), on device (g, j, a), tgs = P/C²:

  Q_T, K_T, V_T = all_gather over wf_team of the members' q, k, v     # the team's C·n tokens
  K, V = K_T, V_T sent along the init map (Algorithm 2)                # one ppermute over all three axes
  O, lse = 0, -inf
  for s in 0 .. tgs-1:
      send K, V to the next device of the sub-ring (wf_ring j -> j+1; not after the last step)
      O, lse = merge(O, lse, block(Q_T, K, V))                          # now holding team chunk
                                                                        # ((j - s) mod tgs)·C + a
  out = ReduceScatter_combine(O, lse) over wf_team                      # each member: its own n rows

Init map (Algorithm 2 with d_t = P/C teams, d_a = C): rank R = (team t, member a) sends its team's K/V to
team a·tgs + t // C, member t % C; so device (g, j, a) then holds team chunk U = j·C + a, and member a of
every team meets exactly the team chunks ≡ a (mod C): a team's C members partition the P/C team chunks.
For C = 1 the map is the identity and no ppermute is issued. The sub-ring next/last (Algorithm 3) is
wf_ring j -> (j ± 1) mod tgs inside the same (g, a).

ReduceScatter_combine: the partial lse rows go to their owner with one all_to_all over wf_team, the owner
takes their log-sum-exp and all-gathers it back (so every member knows the team lse of all C·n rows), each
member weights its partial O by exp(lse_partial − lse_team) and one fp32 `psum_scatter` sums them.

Backward (`jax.custom_vjp`, the paper's Q-rotating pass): K/V stay where the forward's init map put them
(residuals: the team's Q, the K/V chunk this device ends the init map with, out and lse); dK/dV accumulate
in place. dO and delta = rowsum(dO∘O) are all-gathered over the team (the transpose of the reduce-scatter;
lse is the team-combined one kept from the forward); Q_T, dO_T, lse_T, delta_T and the fp32 dQ accumulator
circulate on the sub-ring:

  for s in 0 .. tgs-1:
      send Q_T, dO_T, lse_T, delta_T on (wf_ring j -> j+1; not after the last step)
      send the dQ accumulator of the previous step's Q on (not at s = 0; it travels one hop behind its Q,
          `collectives.ring_steps_accumulating`, so both transfers overlap the block compute)
      dQ = received dQ + block_dq;  dK, dV += block_dk, block_dv   (global lse and delta: grads add up)
  send the last dQ on (the tgs-th hop brings it home: the paper's extra hop)
  dQ -> psum_scatter over wf_team;  dK, dV -> back along the inverse init map -> psum_scatter over wf_team

Layouts (`wallfacer_positions`, `wallfacer_permutation`), S divisible by P (contiguous) or 2P (zigzag):

  contiguous  device R holds tokens [R·n, (R+1)·n); team T holds [T·Cn, (T+1)·Cn)
  zigzag      team-level zigzag: the sequence is cut in 2P/C chunks of h = Cn/2 tokens; team T holds chunks
              T and 2P/C−1−T; member a holds the a-th n/2-slice of chunk T and the (C−1−a)-th n/2-slice of
              chunk 2P/C−1−T. That is exactly ring.py's device-level zigzag (device R holds half-chunks R and
              2P−1−R), so the global permutation is `layout_permutation("zigzag", S, P)` for every C.

`sharded_attention(strategy="wallfacer")` takes natural order and moves the shards into the layout (and back) inside its
shard_map with layout.py's point-to-point `to_layout` / `from_layout`, over the three axes as one.

A team's gathered tokens are kept in *team order*: [chunk T ; chunk 2P/C−1−T] (two ascending position runs)
for zigzag, plain order for contiguous. Each block carries its true positions (the closed forms above), so
masks are exact, and a causal (Q run, K/V run) pair hidden entirely is skipped with `lax.cond`. With zigzag
every (Q team, K/V team chunk) pair costs 2 of the 4 run pairs, except the one member per team that meets
its own team chunk (3 of 4, the diagonal ones only half visible): max/min computed work 1 + C²/(2P) at run
level, 1 + 1/(2·(P/C²)·h) in causally visible query-key pairs.

A sliding window W (query i sees keys i - W < j <= i) skips sub-ring steps the same way (ring.py's
`attend_step` / `grads_step`, forward and backward): a step none of whose run pairs reaches inside the window,
or whose Q and K/V team chunks share no segment id, keeps its hop (the K/V, or in the backward the Q side,
still move on) and computes nothing.

Communication per device, elements (b batch, n = S/P, hq / hkv query / key-value heads per device, d head
dim, tgs = P/C²; GQA: K/V travel with their own hkv heads; fp32 = accumulators, sent as fp32):

  forward   all-gather      (C−1)·b·n·(hq + 2·hkv)·d  [Q, K, V]  +  (C−1)·b·n·hq  [team lse, fp32]
            all-to-all      (C−1)·b·n·hq  [partial lse, fp32]
            reduce-scatter  (C−1)·b·n·hq·d  [out, fp32]
            P2P             2·C·b·n·hkv·d [init map, C > 1]  +  (tgs−1)·2·C·b·n·hkv·d [sub-ring]
                            = 2·(P/C)·b·n·hkv·d for C > 1: ring attention's P·2·b·n·hkv·d divided by C
                            (the paper's Eq. 4); C = 1: 2·(P−1)·b·n·hkv·d, exactly ring.py's forward.
  backward  all-gather      (C−1)·b·n·(hq·d + hq)  [dO, delta fp32]
            P2P             (tgs−1)·C·b·n·(2·hq·d + 2·hq)  [Q, dO, lse fp32, delta fp32]
                            + tgs·C·b·n·hq·d  [dQ fp32, including the hop home]
                            + 2·C·b·n·hkv·d  [dK, dV fp32 back along the inverse init map, C > 1]
            reduce-scatter  (C−1)·b·n·(hq + 2·hkv)·d  [dQ, dK, dV fp32]
  segment ids (int32, when given) add (C−1)·b·n all-gathered, C·b·n with the init map, (tgs−1)·C·b·n per
  sub-ring pass (K/V side forward, Q side backward).

Memory: the backward's residuals per device are the team's Q (C·b·n·hq·d), the K/V chunk held after the
init map (2·C·b·n·hkv·d), the team lse (C·b·n·hq fp32) and out (b·n·hq·d): the paper's 3C·A against ring
attention's 3A; one K/V (forward) or Q-side (backward) block is in flight on the sub-ring at a time.

With H = hq·d = hkv·d the forward collectives are 3(C−1)BNH/P + (C−1)BNH/P = 4(C−1)BNH/P (Eq. 3) plus the
2(C−1)·b·n·hq lse elements the paper leaves out. For C = 1 the backward is the paper's Q-rotating one, not
ring.py's K/V-rotating one: (P−1)·b·n·(2·hq·d + 2·hq) + P·b·n·hq·d elements instead of
(4P−2)·b·n·hkv·d (less for MHA, more for GQA).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from jaxring.core.collectives import ppermute, ring_steps, ring_steps_accumulating, send_to_next
from jaxring.core.vma import vary_like
from jaxring.kernels.block_compute import get_block_ops
from jaxring.kernels.blockwise import BlockOps
from jaxring.kernels.layout import check_seq_len
from jaxring.kernels.masking import check_qkv, check_window, positions_may_meet
from jaxring.kernels.merge import empty_partial
from jaxring.parallel.cost_terms import F32, AttentionCost, AttentionShape, Transfer, segment_once, segment_ring
from jaxring.parallel.registry import Option, SequenceStrategy
from jaxring.parallel.sequence.ring import attend_step, fuse_by_default, grads_step, run_bounds
from jaxring.parallel.sequence.ring_step import pair_work, split_runs

WF_AXES = ("wf_group", "wf_ring", "wf_team")
GROUP, RING, TEAM = WF_AXES
PLACEMENTS = ("team_inner", "ring_inner")
WF_LAYOUTS = ("contiguous", "zigzag")


# ----------------------------------------------------------------------------------------------- checks


def check_team_size(team_size: int, sp: int) -> int:
    """Returns tgs = sp / C² (the sub-ring length), or raises naming C, sp and the rule."""
    if isinstance(team_size, bool) or not isinstance(team_size, int) or team_size < 1:
        raise ValueError(f"team_size C={team_size!r} must be an integer ≥ 1 with C² dividing sp = {sp}")
    if sp % (team_size * team_size):
        raise ValueError(f"team_size C={team_size}: C² = {team_size * team_size} must divide sp = {sp}")
    return sp // (team_size * team_size)


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; expected one of {', '.join(PLACEMENTS)}")


def check_wf_layout(layout: str) -> None:
    if layout not in WF_LAYOUTS:
        raise ValueError(f"layout {layout!r} is not supported by wallfacer; expected one of {', '.join(WF_LAYOUTS)}")


# -------------------------------------------------------------------------------------- mesh and maps


def wallfacer_mesh(mesh: Mesh, team_size: int, placement: str = "team_inner", seq_axis: str = "sp") -> Mesh:
    """The same devices with `seq_axis` (size P) replaced by ("wf_group", "wf_ring", "wf_team") of sizes
    (C, P/C², C); other axes unchanged.

    The mesh coordinates (g, j, a) are always the logical ones (rank R = g·P/C + j·C + a); the placement picks
    the sp device that has them: "team_inner" sp device R (team members adjacent), "ring_inner" sp device
    g·P/C + a·P/C² + j (sub-ring neighbours adjacent).
    """
    if seq_axis not in mesh.axis_names:
        raise ValueError(
            f"mesh axes {mesh.axis_names} have no {seq_axis!r} axis; wallfacer splits the sequence over it"
        )
    sp = mesh.shape[seq_axis]
    tgs = check_team_size(team_size, sp)
    check_placement(placement)
    c = team_size
    i = mesh.axis_names.index(seq_axis)
    devices = np.asarray(mesh.devices)
    pre, post = devices.shape[:i], devices.shape[i + 1 :]
    if placement == "team_inner":
        devices = devices.reshape(pre + (c, tgs, c) + post)
    else:  # sp index g·P/C + a·tgs + j
        devices = np.swapaxes(devices.reshape(pre + (c, c, tgs) + post), i + 1, i + 2)
    names = mesh.axis_names[:i] + WF_AXES + mesh.axis_names[i + 1 :]
    types = mesh.axis_types[:i] + (mesh.axis_types[i],) * 3 + mesh.axis_types[i + 1 :]
    return Mesh(devices, names, axis_types=types)


def get_init_send(r_t: int, r_a: int, d_t: int, d_a: int) -> int:
    """Algorithm 2: the global rank that inter-team rank r_t, intra-team rank r_a sends its team's K/V to."""
    team_group_size = d_t // d_a
    target_team = r_a * team_group_size + r_t // d_a
    return target_team * d_a + r_t % d_a


def get_p2p_config(r_t: int, r_a: int, d_t: int, d_a: int) -> tuple[int, int]:
    """Algorithm 3: (next, last) global rank on the sub-ring (= wf_ring j ± 1 inside the same (g, a))."""
    tgs = d_t // d_a
    group = r_t // tgs
    nxt, last = (r_t + 1) % tgs + tgs * group, (r_t - 1) % tgs + tgs * group
    return r_a + nxt * d_a, r_a + last * d_a


def init_pairs(num_devices: int, team_size: int, inverse: bool = False) -> list[tuple[int, int]]:
    """ppermute pairs (source, target) of the init map over the logical ranks (or of its inverse)."""
    c = team_size
    pairs = [(r, get_init_send(r // c, r % c, num_devices // c, c)) for r in range(num_devices)]
    return [(t, s) for s, t in pairs] if inverse else pairs


# ------------------------------------------------------------------------------------------ positions


def team_positions(layout: str, team: int | jax.Array, num_devices: int, team_size: int, local_len: int) -> jax.Array:
    """int32 [C·n]: the true positions of team `team`'s tokens in team order (int or traced team)."""
    check_wf_layout(layout)
    c, n = team_size, local_len
    team = jnp.asarray(team, jnp.int32)
    if layout == "contiguous":
        return team * (c * n) + jnp.arange(c * n, dtype=jnp.int32)
    h = c * n // 2
    i = jnp.arange(h, dtype=jnp.int32)
    return jnp.concatenate([team * h + i, (2 * num_devices // c - 1 - team) * h + i])


def _team_order(x: jax.Array, c: int, zigzag: bool, axis: int = 1):
    """Member order (as all-gathered: member 0's n tokens, member 1's, ...) -> team order."""
    if not zigzag or c == 1 or x is None:
        return x
    h = x.shape[axis] // (2 * c)
    x = x.reshape(x.shape[:axis] + (c, 2, h) + x.shape[axis + 1 :])
    first = lax.index_in_dim(x, 0, axis + 1, keepdims=False)  # chunk T, slices 0..C-1
    second = jnp.flip(lax.index_in_dim(x, 1, axis + 1, keepdims=False), axis)  # chunk 2P/C-1-T, ascending
    flat = lambda y: y.reshape(y.shape[:axis] + (c * h,) + y.shape[axis + 2 :])
    return jnp.concatenate([flat(first), flat(second)], axis)


def _member_order(x: jax.Array, c: int, zigzag: bool, axis: int = 1):
    """Inverse of `_team_order`."""
    if not zigzag or c == 1 or x is None:
        return x
    h = x.shape[axis] // (2 * c)
    first, second = (lax.slice_in_dim(x, s * c * h, (s + 1) * c * h, axis=axis) for s in range(2))
    split = lambda y: y.reshape(y.shape[:axis] + (c, h) + y.shape[axis + 1 :])
    x = jnp.stack([split(first), jnp.flip(split(second), axis)], axis + 1)  # [.., C, 2, h, ..]
    return x.reshape(x.shape[:axis] + (2 * c * h,) + x.shape[axis + 3 :])


def wallfacer_positions(
    layout: str, rank: int | jax.Array, num_devices: int, team_size: int, local_len: int
) -> jax.Array:
    """int32 [n]: true positions of the tokens device `rank` (logical rank R = g·P/C + j·C + a) holds."""
    c, n = team_size, local_len
    team_pos = _member_order(team_positions(layout, rank // c, num_devices, c, n), c, layout == "zigzag", 0)
    return lax.dynamic_slice_in_dim(team_pos, (rank % c) * n, n)


def check_wf_seq_len(seq_len: int, num_devices: int, layout: str) -> None:
    """S divisible by P (contiguous) or by 2P (zigzag: 2P/C chunks, each cut into C slices of n/2)."""
    check_wf_layout(layout)
    check_seq_len(seq_len, num_devices, layout)


def wallfacer_permutation(layout: str, seq_len: int, num_devices: int, team_size: int) -> np.ndarray:
    """Global index map: x_layout = x_natural[..., perm, ...] along the sequence, shard R on rank R."""
    check_team_size(team_size, num_devices)
    check_wf_seq_len(seq_len, num_devices, layout)
    n = seq_len // num_devices
    with jax.ensure_compile_time_eval():  # concrete even when called under jit
        return np.concatenate(
            [np.asarray(wallfacer_positions(layout, r, num_devices, team_size, n)) for r in range(num_devices)]
        )


# ------------------------------------------------------------------------------------- communication


def _gather(x: jax.Array | None, c: int, zigzag: bool):
    """The team's C·n tokens of x (team order) from every member's n tokens."""
    if x is None or c == 1:
        return x
    return _team_order(lax.all_gather(x, TEAM, axis=1, tiled=True), c, zigzag)


def _scatter(x: jax.Array, c: int, zigzag: bool):
    """Sums the members' team-order [.., C·n, ..] partials; each member keeps its own n rows."""
    if c == 1:
        return x
    return lax.psum_scatter(_member_order(x, c, zigzag), TEAM, scatter_dimension=1, tiled=True)


def _init_map(tree: Any, num_devices: int, c: int, inverse: bool = False):
    """Algorithm 2's initial send (or its inverse) over all three axes; nothing to do for C = 1."""
    if c == 1:
        return tree
    pairs = init_pairs(num_devices, c, inverse)
    return jax.tree.map(lambda x: ppermute(x, WF_AXES, pairs), tree)


def _team_combine(out_t: jax.Array, lse_t: jax.Array, c: int, zigzag: bool):
    """ReduceScatter_combine: (own rows' out, own rows' team lse, team lse of all C·n rows in team order)."""
    if c == 1:
        return out_t, lse_t, lse_t
    lse_m = _member_order(lse_t, c, zigzag)
    b, cn, hq = lse_m.shape
    parts = lax.all_to_all(lse_m.reshape(b, c, cn // c, hq), TEAM, split_axis=1, concat_axis=1, tiled=True)
    top = jnp.max(parts, axis=1)
    top = jnp.where(jnp.isneginf(top), 0.0, top)
    lse_own = top + jnp.log(jnp.sum(jnp.exp(parts - top[:, None]), axis=1))  # -inf where nothing visible
    lse_all = lax.all_gather(lse_own, TEAM, axis=1, tiled=True)  # member order
    weight = jnp.exp(lse_m - jnp.where(jnp.isneginf(lse_all), 0.0, lse_all))
    out = lax.psum_scatter(_member_order(out_t, c, zigzag) * weight[..., None], TEAM, scatter_dimension=1, tiled=True)
    return out, lse_own, _team_order(lse_all, c, zigzag)


def _visible_pairs(q_pos: jax.Array, kv_pos: jax.Array, causal: bool, window: int | None = None):
    """Visible (query, key) pairs of a run pair (kv_pos one ascending contiguous run): keys
    max(k0, i - W + 1) .. min(i, k_last) for each query i (k0 .. i without a window)."""
    if not causal:
        return jnp.float32(q_pos.shape[0] * kv_pos.shape[0])
    first, last = kv_pos[0], kv_pos[-1]
    lo = first if window is None else jnp.maximum(first, q_pos - window + 1)
    return jnp.sum(jnp.clip(jnp.minimum(q_pos, last) - lo + 1, 0).astype(jnp.float32))


# --------------------------------------------------------------------------------------------- forward


@dataclasses.dataclass(frozen=True)
class WallFacerConfig:
    """The static settings of one WallFacer call (hashable: the one nondiff argument of its custom_vjp)."""

    team_size: int  # C
    layout: str  # "contiguous" or "zigzag" (team-level)
    causal: bool
    sm_scale: float
    ops: BlockOps
    fuse: bool = False  # each sub-ring hop's arrays as one buffer (`collectives.fused_ppermute`)
    window: int | None = None  # sliding window (causal): query i sees keys i - window < j <= i


def _coords():
    g, j, a = (lax.axis_index(x) for x in WF_AXES)
    return g, j, a, lax.axis_size(RING)


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, cfg: WallFacerConfig):
    layout, causal, window = cfg.layout, cfg.causal, cfg.window
    c, zigzag = cfg.team_size, layout == "zigzag"
    g, j, a, tgs = _coords()
    p, n = c * c * tgs, q.shape[1]
    parts = 2 if zigzag and causal else 1
    q_t, k_t, v_t, seg_t = (_gather(x, c, zigzag) for x in (q, k, v, segment_ids))
    kv = _init_map((k_t, v_t, seg_t), p, c)
    q_pos = team_positions(layout, g * tgs + j, p, c, n)

    def attend(
        carry: tuple[tuple[jax.Array, jax.Array], jax.Array],
        kv: tuple[jax.Array, jax.Array, jax.Array | None],
        step: int | jax.Array,
    ):
        acc, work = carry
        k_c, v_c, kseg_c = kv
        kv_pos = team_positions(layout, ((j - step) % tgs) * c + a, p, c, n)  # the team chunk held now
        acc, step_computed = attend_step(
            cfg.ops,
            acc,
            q_t,
            q_pos,
            seg_t,
            k_c,
            v_c,
            kv_pos,
            kseg_c,
            parts=parts,
            causal=causal,
            sm_scale=cfg.sm_scale,
            window=window,
        )
        for qpos_i in split_runs(q_pos, parts, 0):
            for kpos_j in split_runs(kv_pos, parts, 0):
                computed = positions_may_meet(qpos_i, kpos_j, causal=causal, window=window)
                if step_computed is not None:
                    computed = computed & step_computed
                seen = jnp.where(computed, _visible_pairs(qpos_i, kpos_j, causal, window), 0.0)
                work = work + jnp.stack([pair_work(qpos_i, kpos_j, computed), seen]).astype(work.dtype)
        return acc, work

    # varies over all three axes, like the work it accumulates (check_vma)
    work0 = jnp.zeros((2,), jnp.float32) + 0 * (g + j + a)
    if seg_t is not None:  # steps skipped by segment: the count varies with the ids too
        work0 = vary_like(work0, seg_t)
    send = lambda tree: send_to_next(tree, RING, fuse=cfg.fuse)
    acc, work = ring_steps(attend, (empty_partial(q_t), work0), kv, tgs, send)
    out_t, lse_t = acc
    out, lse, lse_team = _team_combine(out_t, lse_t, c, zigzag)
    return out, lse, work, (q_t, seg_t, kv, lse_team)


def wallfacer_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, cfg: WallFacerConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The forward pass inside shard_map. Returns out fp32 [b, n, hq, d], lse fp32 [b, n, hq] (own rows) and
    work fp32 [2] on this device: (query-key pairs of the run pairs computed, visible ones: causal, window)."""
    out, lse, work, _ = _forward(q, k, v, segment_ids, cfg)
    return out, lse, work


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _wallfacer(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, cfg: WallFacerConfig):
    out, _, _, _ = _forward(q, k, v, segment_ids, cfg)
    return out.astype(q.dtype)


def _wallfacer_fwd(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, cfg: WallFacerConfig):
    out, _, _, (q_t, seg_t, kv, lse_team) = _forward(q, k, v, segment_ids, cfg)
    out = out.astype(q.dtype)
    return out, (q_t, seg_t, kv, out, lse_team)


# -------------------------------------------------------------------------------------------- backward


def _wallfacer_bwd(cfg: WallFacerConfig, residuals: tuple, dout: jax.Array):
    q_t, qseg_t, (k_u, v_u, kseg_u), out, lse_t = residuals
    layout, causal = cfg.layout, cfg.causal
    c, zigzag = cfg.team_size, layout == "zigzag"
    parts = 2 if zigzag and causal else 1
    g, j, a, tgs = _coords()
    p, n = c * c * tgs, out.shape[1]
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    do_t, delta_t = _gather(dout, c, zigzag), _gather(delta, c, zigzag)
    # K/V stay put: this device holds team chunk j·C + a for the whole pass
    kv_pos = team_positions(layout, j * c + a, p, c, n)
    send = (lambda tree: send_to_next(tree, RING, fuse=cfg.fuse)) if tgs > 1 else (lambda tree: tree)

    def grads(
        dkv: tuple[jax.Array, jax.Array],
        q_side: tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None],
        step: int | jax.Array,
        dq: jax.Array | None,
    ):
        q_c, do_c, lse_c, delta_c, qseg_c = q_side
        q_pos = team_positions(layout, g * tgs + (j - step) % tgs, p, c, n)
        dq, dk, dv = grads_step(
            cfg.ops,
            (dq, *dkv),
            q_c,
            do_c,
            lse_c,
            delta_c,
            q_pos,
            qseg_c,
            k_u,
            v_u,
            kv_pos,
            kseg_u,
            parts=parts,
            causal=causal,
            sm_scale=cfg.sm_scale,
            window=cfg.window,
        )
        return (dk, dv), dq  # dQ travels with its Q (one hop behind); the tgs-th hop brings it home

    init = (jnp.zeros_like(k_u, jnp.float32), jnp.zeros_like(v_u, jnp.float32))
    (dk, dv), dq = ring_steps_accumulating(grads, init, (q_t, do_t, lse_t, delta_t, qseg_t), tgs, send)
    dq = _scatter(dq, c, zigzag)
    dk, dv = _init_map((dk, dv), p, c, inverse=True)
    dk, dv = _scatter(dk, c, zigzag), _scatter(dv, c, zigzag)
    return dq.astype(q_t.dtype), dk.astype(k_u.dtype), dv.astype(v_u.dtype), None


_wallfacer.defvjp(_wallfacer_fwd, _wallfacer_bwd)


# ---------------------------------------------------------------------------------------- public API


def wallfacer_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    team_size: int,
    axis_name: str | tuple[str, ...] = WF_AXES,
    causal: bool = True,
    sm_scale: float | None = None,
    layout: str = "contiguous",
    block_ops: str | BlockOps = "auto",
    fuse_sends: bool | None = None,
    window: int | None = None,
    placement: str = "team_inner",
) -> jax.Array:
    """WallFacer attention; call inside `shard_map` over a `wallfacer_mesh` with the sequence sharded over
    ("wf_group", "wf_ring", "wf_team") in `layout` (see `wallfacer_permutation`).

    Args:
      q: local [batch, n, q_heads, head_dim]; k, v: local [batch, n, kv_heads, head_dim] (GQA: only the
        existing K/V heads travel).
      segment_ids: local int [batch, n] or None; 0 = padding.
      team_size: C, the size of the wf_team axis (C² divides P).
      axis_name: the mesh's wallfacer axes, WF_AXES (the only value: the view `wallfacer_mesh` makes).
      layout: "contiguous" or "zigzag" (the team-level zigzag of the module docstring).
      fuse_sends: each sub-ring hop's arrays as one buffer (see `ring_attention`); default with the
        compiled Pallas kernels only.
      window: sliding window W (needs causal): query i sees keys i - W < j <= i; sub-ring steps outside
        every query's window are skipped. None: unlimited.
      placement: "team_inner" or "ring_inner", which devices the mesh view made neighbours
        (`wallfacer_mesh`); checked here, it changes nothing in the local computation.
    Returns: out, local [batch, n, q_heads, head_dim] in q.dtype; differentiable (Q-rotating backward).
    """
    check_qkv(q, k, v)
    check_wf_layout(layout)
    check_placement(placement)
    if ((axis_name,) if isinstance(axis_name, str) else tuple(axis_name)) != WF_AXES:
        raise ValueError(f"axis_name {axis_name!r}: wallfacer runs over the axes {WF_AXES} of `wallfacer_mesh`")
    window = check_window(window, causal)
    sizes = tuple(lax.axis_size(x) for x in WF_AXES)
    if sizes != (team_size, sizes[1], team_size):
        raise ValueError(
            f"team_size C={team_size} does not match the mesh: (wf_group, wf_ring, wf_team) = "
            f"{sizes} must be (C, P/C², C)"
        )
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"local seq {q.shape[1]} must be even for the zigzag layout")
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    ops = get_block_ops(block_ops)
    cfg = WallFacerConfig(team_size, layout, causal, scale, ops, fuse_by_default(ops, fuse_sends), window)
    return _wallfacer(q, k, v, segment_ids, cfg)


# ---------------------------------------------------------------------------------------- cost


def wallfacer_window_share(layout: str, p: int, team_size: int, n: int, window: int) -> float:
    """The share of its causal work WallFacer still computes under a sliding window: the busiest device's
    query-key pairs of the (Q run, K/V run) pairs its sub-ring forward computes (`_forward`'s work: device
    (g, j, a) holds Q team g·tgs + j and, at step s, K/V team chunk ((j - s) mod tgs)·C + a; a team's runs are a
    ring's of p/C ranks of C·n tokens), with the window over without."""
    c = team_size
    tgs = p // (c * c)
    first, last = run_bounds(layout, p // c, c * n)  # [teams, runs]
    size = last - first + 1
    devices = [
        (g * tgs + j, [((j - s) % tgs) * c + a for s in range(tgs)])
        for g in range(c)
        for j in range(tgs)
        for a in range(c)
    ]

    def busiest(w: int | None) -> float:
        def work(q: int, k: int) -> int:
            visible = last[q][:, None] >= first[k][None, :]
            if w is not None:
                visible &= first[q][:, None] < last[k][None, :] + w
            return int((size[q][:, None] * size[k][None, :] * visible).sum())

        return max(sum(work(q, k) for k in held) for q, held in devices)

    return busiest(window) / busiest(None)


def wallfacer_cost(s: AttentionShape, options: dict) -> AttentionCost:
    """WallFacer Eqs. 2-4 for C = team_size, tgs = P/C² (collectives 4BNH(C-1)/(PW), P2P 2BNH/(CW)): the team
    all-gathers of Q, K, V, the lse exchange and the fp32 reduce-scatter of O; the init map 2C K/V blocks; the
    sub-ring (tgs-1)·2C K/V blocks forward; backward dO and Δ gathered, Q, dO, lse, Δ round the sub-ring with
    dQ one hop behind (tgs hops), dQ, dK, dV reduce-scattered and dK/dV back along the inverse map. Kept: the
    team's Q, K/V chunk and lse. Working: the team's blocks (C·n rows and columns) and their fp32 gradients.
    Packed documents: the segment ids all-gathered over the team and sent with the init map (once per
    micro-step), and riding the sub-ring's hops (C·n ids a hop; `jaxring.parallel.cost_terms.segment_ring`). A sliding
    window: the sub-ring's run pairs outside it compute nothing (`wallfacer_window_share`)."""
    C = options["team_size"]
    tgs = s.sp // (C * C)
    q, q32, rows = s.q_bytes(s.e), s.q_bytes(F32), s.rows_bytes()
    kv, kv32 = s.kv_bytes(s.e), s.kv_bytes(F32)
    transfers = []
    if C > 1:
        transfers += [
            Transfer(
                "WallFacer team all-gather Q, K, V + lse exchange, reduce-scatter O (forward)",
                (TEAM,),
                (C - 1) * (q + 2 * kv) + 2 * (C - 1) * rows + (C - 1) * q32,
                4,
            ),
            Transfer(
                "WallFacer team all-gather dO, Δ; reduce-scatter dQ, dK, dV (backward)",
                (TEAM,),
                (C - 1) * (q + rows) + (C - 1) * q32 + 2 * (C - 1) * kv32,
                5,
            ),
            Transfer("WallFacer init map K/V (forward)", WF_AXES, 2 * C * kv, 1),
            Transfer("WallFacer inverse init map dK/dV (backward)", WF_AXES, 2 * C * kv32, 1),
            *segment_once("WallFacer segment ids team all-gather", (TEAM,), (C - 1) * s.segment_bytes()),
            *segment_once("WallFacer segment ids init map", WF_AXES, C * s.segment_bytes()),
        ]
    if tgs > 1:
        transfers += [
            Transfer("WallFacer sub-ring K/V forward", (RING,), (tgs - 1) * 2 * C * kv, tgs - 1, "attention"),
            Transfer(
                "WallFacer sub-ring Q, dO, lse, Δ and dQ backward",
                (RING,),
                (tgs - 1) * C * (2 * q + 2 * rows) + tgs * C * q32,
                tgs,
                "attention",
            ),
            *segment_ring("WallFacer sub-ring segment ids", (RING,), tgs - 1, C * s.segment_bytes(), s.cpu, False),
        ]
    # On CPU the layer scan stacks the team's Q once (f32[1, C·n, heads, d]: GPT sp8 c2 of
    # benchmarks/memory_model.py, fp32, 256 KiB a layer, not 2C·q32's 512), and the team's K/V of the layer's
    # backward are its saved ones read back (two f32[1,512,8,16] dynamic slices of the stack at the peak, which
    # the layer's working share already counts); with both the estimate was 1.13x the compiled step
    team_q, team_kv = (C * q32, 0) if s.cpu else (2 * C * q32, 2 * C * s.kv_bytes(s.em))
    return AttentionCost(
        transfers=tuple(transfers),
        saved=team_q + 2 * C * kv32 + 2 * C * rows + q32,
        working=team_kv + 2 * C * kv32 + 2 * C * q32,
        block_q=C * s.n,
        block_k=C * s.n,
        window_share=wallfacer_window_share(s.layout, s.sp, C, s.n, s.window) if s.window else 1.0,
    )


# ---------------------------------------------------------------------------------------- registry entry


def _view(mesh: Mesh, options: dict, axis: str):
    return wallfacer_mesh(mesh, options["team_size"], options.get("placement", "team_inner"), axis), WF_AXES


def _team_sizes(sp: int) -> list[int]:
    """C ≥ 2 with C² dividing sp (C = 1 is the plain ring)."""
    return [c for c in range(2, math.isqrt(sp) + 1) if sp % (c * c) == 0]


STRATEGY = SequenceStrategy(
    "wallfacer",
    "WallFacer: teams of C devices, C² sub-rings, 1/C of the ring's P2P volume",
    attend=wallfacer_attention,
    layouts=WF_LAYOUTS,
    view=_view,
    cost=wallfacer_cost,
    options=(
        Option(
            "team_size",
            "C, the team size: C² dividing sp",
            lambda c, sp: check_team_size(c, sp),
            required=True,
            search=_team_sizes,
        ),
        Option(
            "placement",
            "which devices are neighbours: team members or sub-ring members",
            lambda placement, sp: check_placement(placement),
            default="team_inner",
            type=str,
            choices=PLACEMENTS,
            search=lambda sp: PLACEMENTS,
        ),
    ),
)
