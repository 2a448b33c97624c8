"""Ring attention (context parallelism) with contiguous, zig-zag and striped layouts.

The Ultra-Scale Playbook's ring, for P devices on the `sp` axis, each holding n = S/P tokens of Q, K, V:

  for step in 0 .. P-1:
      send the current K/V block to the next rank (non-blocking: issued before this step's compute)
      attend the local Q to the current K/V block, merge (out, lse) with an online softmax
      receive the previous rank's K/V block (it becomes current)

At step t, rank r holds the K/V block of rank (r - t) mod P; its true positions follow from the layout, so
the causal mask is exact for every layout. One `BlockOps` call per step attends the whole blocks; it skips
the tiles the causal mask hides (a block hidden entirely is skipped with one `lax.cond`). Each rank's tokens
form position runs (two for zig-zag): with zig-zag every rank does the same work (2P+1 half-chunk pairs),
with contiguous rank r does r+1 blocks.

Sliding window W (query i sees keys i - W < j <= i) and segment ids skip whole steps the same way
(`attend_step`, `grads_step`): a step none of whose (Q run, K/V run) pairs has a key inside some query's
window, or whose Q and K/V blocks share no segment (by the blocks' segment-id bounds: packed documents are
numbered in order), is a `lax.cond` that returns its carry untouched. Such a step still costs its hop: the
K/V block is sent on regardless (the next rank may need it; the ring's communication is unchanged, 2(P-1)
K/V blocks forward), but no FLOPs (no score, exponential or matmul of that block, forward or backward).
Inside a computed step the block ops visit only the tiles within the window. With W <= S/P a contiguous
rank computes at most 2 of its P steps (2 blocks instead of r+1); a zig-zag half-chunk of queries reaches
at most 3 half-chunks, so a rank computes at most 6 of its 2P+1 run pairs: with a window the contiguous
layout is the balanced one (tests/unit/kernels/test_window.py counts both; `benchmarks/sliding_window.py` times them).

Backward (`jax.custom_vjp`): residuals are only q, k, v, out, lse (local, no received K/V, no scores).
K/V travel the ring again, in the opposite direction, with their dK/dV accumulators (fp32) one hop behind
(`collectives.ring_steps_accumulating`); after P accumulator hops dK/dV are home:

  delta = rowsum(dO * O)
  for step in 0 .. P-1:
      send K/V to the previous rank (except at the last step)
      send the dK/dV accumulator of the previous step's block to the previous rank (not at step 0)
      dQ += block_dq;  dK/dV(current block) = received accumulator + block_dk/dv
  send the last accumulator to the previous rank (the P-th hop: home)

Both sends of a step are independent of its block compute, so on a GPU each transfer spans the kernels
(the compiled schedule is checked by tests/compiled/test_gpu_compile.py).

Communication per rank: forward 2(P-1) K/V blocks; backward 2(P-1) K/V blocks + 2P fp32 dK/dV blocks
(plus the int32 segment ids with K/V when given). The per-block compute is a `BlockOps` pair
(`blockwise.py`): jnp on CPU, the Pallas flash kernel on GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring.core.collectives import BACKWARD, ring_steps, ring_steps_accumulating, send_to_next
from jaxring.core.vma import vary_like
from jaxring.kernels.block_compute import get_block_ops
from jaxring.kernels.blockwise import FORWARD_TILE, BlockOps, tile_size, unless_hidden, with_window
from jaxring.kernels.layout import RankTokens
from jaxring.kernels.masking import check_qkv, check_window, positions_may_meet, segments_may_meet
from jaxring.kernels.merge import empty_partial
from jaxring.parallel.cost_terms import F32, AttentionCost, AttentionShape, Transfer, segment_ring
from jaxring.parallel.registry import SequenceStrategy
from jaxring.parallel.sequence.ring_step import add_block_grads, attend_block, pair_work, run_work, split_runs


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """The static settings of one ring (hashable: the one nondiff argument of its custom_vjp)."""

    axis_name: str | tuple[str, ...]
    tokens: RankTokens  # the layout (and USP's inner ranks): each block's true positions
    causal: bool
    sm_scale: float
    ops: BlockOps
    fuse: bool = False  # each hop's arrays as one buffer (`collectives.fused_ppermute`)
    window: int | None = None  # sliding window (causal): query i sees keys i - window < j <= i


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    axis_name: str | tuple[str, ...] = "sp",
    layout: str = "zigzag",
    causal: bool = True,
    sm_scale: float | None = None,
    block_ops: str | BlockOps = "auto",
    inner_ranks: int = 1,
    fuse_sends: bool | None = None,
    window: int | None = None,
) -> jax.Array:
    """Ring attention over `axis_name`; call inside `shard_map` with the sequence already in `layout`.

    Args:
      q: local [batch, n, q_heads, head_dim]; k, v: local [batch, n, kv_heads, head_dim] (GQA: only the
        existing K/V heads travel).
      segment_ids: local int [batch, n] or None; 0 = padding.
      layout: "contiguous", "zigzag" or "striped": how this rank's tokens were chosen (see layout.py).
      inner_ranks: each ring rank holds the layout shards of this many consecutive layout ranks (USP).
      fuse_sends: send each hop's arrays (K, V, segment ids; in the backward with dK, dV) as one buffer, so
        one transfer per step overlaps the block compute on GPU (`collectives.fused_ppermute`). Default:
        with the compiled Pallas kernels (GPU) only.
      window: sliding window W (needs causal): query i sees keys i - W < j <= i; steps outside every query's
        window are skipped (see the module docstring). None: unlimited.
    Returns: out, local [batch, n, q_heads, head_dim] in q.dtype.
    """
    check_qkv(q, k, v)
    window = check_window(window, causal)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k/v local seq {k.shape[1]} must equal q local seq {q.shape[1]} (self-attention)")
    tokens = RankTokens(layout, inner_ranks)
    if q.shape[1] % (tokens.runs() * inner_ranks):
        raise ValueError(
            f"local seq {q.shape[1]} must split into {inner_ranks} rank shards of "
            f"{tokens.runs()} position runs each ({layout} layout)"
        )
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    ops = get_block_ops(block_ops)
    cfg = RingConfig(axis_name, tokens, causal, scale, ops, fuse_by_default(ops, fuse_sends), window)
    return _ring(q, k, v, segment_ids, cfg)


def fuse_by_default(ops: BlockOps, fuse_sends: bool | None) -> bool:
    """fuse_sends as given, or True for the GPU block computes (compiled Pallas kernels, cuDNN), else False."""
    return ops.name in ("pallas", "cudnn") if fuse_sends is None else bool(fuse_sends)


def _parts(tokens: RankTokens, causal: bool):
    """Position runs a rank's tokens form (work is counted per run pair; only causal masking hides one)."""
    return tokens.runs() if causal else 1


# ------------------------------------------------------------- whole steps skipped: window and segments


def step_visible(
    q_pos: jax.Array,
    kv_pos: jax.Array,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    *,
    parts: int,
    causal: bool,
    window: int | None,
) -> jax.Array | None:
    """Scalar bool: the (Q block, K/V block) step may hold a visible pair; None when only the causal test
    applies (no window, no segment ids: `schedule.when_visible` does that one). The window is tested per
    (Q run, K/V run) pair (exact for contiguous runs: a zig-zag step whose four run pairs all lie outside
    the window is skipped although its block bounds overlap); segment ids by their per-row bounds."""
    tests = []
    if window is not None:
        runs = [(qp, kp) for qp in split_runs(q_pos, parts, 0) for kp in split_runs(kv_pos, parts, 0)]
        seen = [positions_may_meet(qp, kp, causal=causal, window=window) for qp, kp in runs]
        tests.append(functools.reduce(jnp.logical_or, seen))
    if q_seg is not None:
        tests.append(segments_may_meet(q_seg, kv_seg))
    return functools.reduce(jnp.logical_and, tests) if tests else None


def step_work(
    q_pos: jax.Array, kv_pos: jax.Array, parts: int, causal: bool, window: int | None, computed: jax.Array | None = None
) -> jax.Array:
    """Query-key pairs of the run pairs a step computes (fp32): those the causal mask and the window do not
    hide entirely, and none when the whole step is skipped (`computed` False)."""
    if window is None:
        work = run_work(q_pos, kv_pos, parts, causal)
    else:
        work = sum(
            pair_work(qp, kp, positions_may_meet(qp, kp, causal=causal, window=window))
            for qp in split_runs(q_pos, parts, 0)
            for kp in split_runs(kv_pos, parts, 0)
        )
    return work if computed is None else jnp.where(computed, work, 0.0)


def attend_step(
    ops: BlockOps,
    acc: tuple[jax.Array, jax.Array],
    q: jax.Array,
    q_pos: jax.Array,
    q_seg: jax.Array | None,
    k: jax.Array,
    v: jax.Array,
    kv_pos: jax.Array,
    kv_seg: jax.Array | None,
    *,
    parts: int,
    causal: bool,
    sm_scale: float,
    window: int | None,
) -> tuple[tuple[jax.Array, jax.Array], jax.Array | None]:
    """`schedule.attend_block` with the window, the whole step skipped (one `lax.cond`: the carry untouched,
    no FLOPs) unless `step_visible`. Returns (acc, computed: scalar bool or None)."""
    ops = with_window(ops, window)
    compute = lambda: attend_block(ops, acc, q, q_pos, q_seg, k, v, kv_pos, kv_seg, causal=causal, sm_scale=sm_scale)
    visible = step_visible(q_pos, kv_pos, q_seg, kv_seg, parts=parts, causal=causal, window=window)
    if visible is None:
        return compute(), None
    return unless_hidden(ops.lockstep, visible, compute, lambda: acc), visible


def grads_step(
    ops: BlockOps,
    grads: tuple[jax.Array | None, jax.Array | None, jax.Array | None],
    q: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    q_pos: jax.Array,
    q_seg: jax.Array | None,
    k: jax.Array,
    v: jax.Array,
    kv_pos: jax.Array,
    kv_seg: jax.Array | None,
    *,
    parts: int,
    causal: bool,
    sm_scale: float,
    window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`schedule.add_block_grads` with the window, the block's gradients skipped whole unless `step_visible`.

    grads (dq, dk, dv) fp32, any of them None (the sum starts here). For block ops that do not accumulate,
    the step's own gradients come out of the `lax.cond` and are added after it, so a received accumulator is
    still not needed before the block compute is done (it stays in flight meanwhile)."""
    ops = with_window(ops, window)

    def block(g: tuple[jax.Array | None, jax.Array | None, jax.Array | None]):
        return add_block_grads(
            ops, g, q, dout, lse, delta, q_pos, q_seg, k, v, kv_pos, kv_seg, causal=causal, sm_scale=sm_scale
        )

    visible = step_visible(q_pos, kv_pos, q_seg, kv_seg, parts=parts, causal=causal, window=window)
    if visible is None:
        return block(grads)
    zeros = tuple(jnp.zeros_like(x, jnp.float32) for x in (q, k, v))
    if ops.accumulates:  # added in place: the running sums pass through the cond
        grads = tuple(z if g is None else g for g, z in zip(grads, zeros))
        return unless_hidden(ops.lockstep, visible, lambda: block(grads), lambda: grads)
    own = unless_hidden(ops.lockstep, visible, lambda: block((None, None, None)), lambda: zeros)
    return tuple(x if acc is None else acc + x for acc, x in zip(grads, own))


# ---------------------------------------------------------------------------------------------- the ring


def ring_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, cfg: RingConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The forward ring. Returns out fp32, lse fp32 [b, n, hq] and the work here: query-key pairs of the
    (Q run, K/V run) pairs computed, those the causal mask and the window do not hide entirely (fp32)."""
    p, rank = lax.axis_size(cfg.axis_name), lax.axis_index(cfg.axis_name)
    n, parts = q.shape[1], _parts(cfg.tokens, cfg.causal)
    q_pos = cfg.tokens.positions(rank, p, n)

    def attend(
        carry: tuple[tuple[jax.Array, jax.Array], jax.Array],
        kv: tuple[jax.Array, jax.Array, jax.Array | None],
        step: int | jax.Array,
    ):
        acc, work = carry
        k, v, kv_seg = kv
        kv_pos = cfg.tokens.positions((rank - step) % p, p, n)
        acc, computed = attend_step(
            cfg.ops,
            acc,
            q,
            q_pos,
            segment_ids,
            k,
            v,
            kv_pos,
            kv_seg,
            parts=parts,
            causal=cfg.causal,
            sm_scale=cfg.sm_scale,
            window=cfg.window,
        )
        return acc, work + step_work(q_pos, kv_pos, parts, cfg.causal, cfg.window, computed)

    work0 = jnp.zeros_like(q_pos[0], jnp.float32)
    if segment_ids is not None:  # the steps skipped by segment vary with them (check_vma)
        work0 = vary_like(work0, segment_ids)
    init = (empty_partial(q), work0)
    (out, lse), work = ring_steps(
        attend, init, (k, v, segment_ids), p, lambda kv: send_to_next(kv, cfg.axis_name, fuse=cfg.fuse)
    )
    return out, lse, work


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, cfg: RingConfig):
    out, _, _ = ring_forward(q, k, v, segment_ids, cfg)
    return out.astype(q.dtype)


def _ring_fwd(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, cfg: RingConfig):
    out, lse, _ = ring_forward(q, k, v, segment_ids, cfg)
    out = out.astype(q.dtype)
    return out, (q, k, v, segment_ids, out, lse)


def _ring_bwd(cfg: RingConfig, residuals: tuple, dout: jax.Array):
    q, k, v, segment_ids, out, lse = residuals
    p, rank = lax.axis_size(cfg.axis_name), lax.axis_index(cfg.axis_name)
    n, parts = q.shape[1], _parts(cfg.tokens, cfg.causal)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    q_pos = cfg.tokens.positions(rank, p, n)

    def grads(
        dq: jax.Array,
        kv: tuple[jax.Array, jax.Array, jax.Array | None],
        step: int | jax.Array,
        dkv: tuple[jax.Array, jax.Array] | None,
    ):
        k, v, kv_seg = kv
        kv_pos = cfg.tokens.positions((rank - BACKWARD * step) % p, p, n)
        dk, dv = (None, None) if dkv is None else dkv
        dq, dk, dv = grads_step(
            cfg.ops,
            (dq, dk, dv),
            q,
            dout,
            lse,
            delta,
            q_pos,
            segment_ids,
            k,
            v,
            kv_pos,
            kv_seg,
            parts=parts,
            causal=cfg.causal,
            sm_scale=cfg.sm_scale,
            window=cfg.window,
        )
        return dq, (dk, dv)  # dK/dV: summed by the ranks the block visits, home after P hops

    send = lambda tree: send_to_next(tree, cfg.axis_name, shift=BACKWARD, fuse=cfg.fuse)
    dq, (dk, dv) = ring_steps_accumulating(grads, jnp.zeros_like(q, jnp.float32), (k, v, segment_ids), p, send)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------------------------------- cost


def q_tiles(n: int, cpu: bool) -> int:
    """Q tiles of a block of n rows in the CPU path (the jnp block ops keep a running (out, lse) per tile and
    ring step); 1 on GPU (the Pallas kernels' residuals are the block's out and lse)."""
    if not cpu:
        return 1
    return n // tile_size(n, FORWARD_TILE)


def run_bounds(layout: str, p: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) true position of each rank's position runs, int [p, runs] (`RankTokens.runs`: zigzag 2,
    else 1; a striped rank's one "run" spans its tokens' bounds, as the step tests see them)."""
    r = np.arange(p)[:, None]
    if layout == "zigzag":
        h = n // 2
        first = np.concatenate([r * h, (2 * p - 1 - r) * h], axis=1)
        return first, first + h - 1
    if layout == "striped":
        return r, (n - 1) * p + r
    return r * n, r * n + n - 1


def ring_window_share(layout: str, p: int, n: int, window: int) -> float:
    """The share of its causal work a ring of p ranks (n tokens each) still computes under a sliding window:
    the busiest rank's query-key pairs of the (Q run, K/V run) pairs that `step_work` counts (run pairs
    wholly outside the window are skipped, `step_visible`), with the window over without."""
    first, last = run_bounds(layout, p, n)
    size = (last - first + 1) if layout != "striped" else np.full_like(first, n)
    q_first, q_last, q_size = first[:, None, :, None], last[:, None, :, None], size[:, None, :, None]
    src = (np.arange(p)[:, None] - np.arange(p)[None, :]) % p  # [rank, step]: whose K/V the rank holds
    k_first, k_last, k_size = first[src][:, :, None, :], last[src][:, :, None, :], size[src][:, :, None, :]
    causal = q_last >= k_first
    pairs = q_size * k_size

    def busiest(visible: np.ndarray) -> float:
        return (pairs * visible).sum(axis=(1, 2, 3)).max()

    return float(busiest(causal & (q_first < k_last + window)) / busiest(causal))


def cpu_kept_pairs(p: int, tiles: int, causal: bool) -> int:
    """q-sized (out, lse) fp32 pairs a layer of the CPU ring (jnp block ops, differentiated through its loop)
    keeps for the backward. Causal: per step after the first, each Q tile's running pair and the step's merged
    one (the step's visibility `cond` keeps its operands and results); otherwise one pair per Q tile. Read from
    the compiled CPU steps' layer-scan stacks: ring sp8 (GPT of benchmarks/memory_model.py, 2,048 tokens, one
    Q tile) f32[4,7,1,1,256,8,16] and f32[4,7,1,256,8,16], 14 pairs a layer (P = 8 counted before: the
    mlp-tile row's estimate 0.83 of the compiled step); tp2 x ring sp4 (512 rows: 2 Q tiles) f32[4,3,2,1,512,4,16]
    and f32[4,3,1,512,4,16], 9; dp2 x ring sp4 (64 rows) 6; the non-causal DiT of tests/unit/planner/test_planner.py,
    ring sp4, f32[2,1,4,64,8,8], 1 (P = 4 counted before: its estimate 1.14x the compiled step)."""
    return (p - 1) * (tiles + 1) if causal else tiles


def ring_cost(s: AttentionShape, options: dict) -> AttentionCost:
    """The module docstring's traffic (the playbook; WallFacer Eq. 2: P·2BNH/P): forward 2(P-1) K/V blocks,
    backward 2(P-1) K/V blocks + 2P fp32 dK/dV blocks, both hidden behind the block compute. Kept: out and
    lse (fp32; on CPU `cpu_kept_pairs` of them). Working: the received and sent K/V (2 each) and
    the fp32 dK/dV accumulators in flight (4), dQ, and the fitted `backward_extra_q_arrays` q-sized arrays of the
    activation dtype (the GPU flash kernels' per-step dQ, dK, dV, the recomputed out and its cotangent). Packed documents: their segment ids ride the K/V hops
    (`jaxring.parallel.cost_terms.segment_ring`). A sliding window: the hops stay, the steps outside it compute nothing
    (`ring_window_share`)."""
    del options
    P, axes = s.sp, tuple(s.axes)
    kv, kv32, q32 = s.kv_bytes(s.e), s.kv_bytes(F32), s.q_bytes(F32)
    return AttentionCost(
        transfers=(
            Transfer("ring K/V forward", axes, 2 * (P - 1) * kv, P - 1, "attention"),
            Transfer("ring K/V + fp32 dK/dV backward", axes, 2 * (P - 1) * kv + 2 * P * kv32, P, "attention"),
            *segment_ring("ring segment ids", axes, P - 1, s.segment_bytes(), s.cpu),
        ),
        saved=(cpu_kept_pairs(P, q_tiles(s.n, True), s.causal) if s.cpu else 1) * (q32 + s.rows_bytes()),
        working=4 * s.kv_bytes(s.em) + 4 * kv32 + q32 + s.fitted["backward_extra_q_arrays"] * s.q_bytes(s.em),
        window_share=ring_window_share(s.layout, P, s.n, s.window) if s.window and P > 1 else 1.0,
    )


# ---------------------------------------------------------------------------------------- registry entry


STRATEGY = SequenceStrategy(
    "ring",
    "ring attention: K/V blocks circulate with ppermute, online softmax (Playbook)",
    attend=ring_attention,
    cost=ring_cost,
)
