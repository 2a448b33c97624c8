"""Per-block attention compute in plain jnp, tiled flash-style: the CPU path of the block interface.

Every distributed strategy calls a `BlockOps` pair on one (Q block, K/V block):

  forward(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, *, causal, sm_scale[, window],
          dtype=fp32)
      -> out [b, nq, hq, d] in dtype (normalised over this block's keys), lse fp32 [b, nq, hq]
  backward(q, k, v, dout, lse, delta, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
           *, causal, sm_scale[, window], dtype=fp32)
      -> dq [b, nq, hq, d], dk [b, nk, hkv, d], dv [b, nk, hkv, d], in dtype

where `lse` and `delta = rowsum(dout * out)` are the *global* (whole-row) values, so the block's
probabilities exp(s - lse) are exactly the global ones and the block gradients simply add up.
Positions are int [n]; segment ids int [b, n] or None (0 = padding). K/V keep their own head count (GQA);
they are never repeated. `window` (a sliding window W, with causal: query i sees keys i - W < j <= i) is
passed only when one is set (`with_window`), so a BlockOps without it still serves unwindowed attention.
`dtype` is fp32 where the results of several blocks are summed (a ring); a caller whose block is the whole
attention (UPipe's head chunks) passes the inputs' dtype, and the kernels write it directly (half the bytes).

The jnp pair is the Pallas kernel's algorithm (`flash_kernels.py`) written with lax loops, so memory is
linear in the block length (no [nq, nk] score matrix) and hidden tiles cost nothing:

  for each Q tile i (a loop over tile indices; out, dQ written in place):
      [lo, full_lo, full_hi, hi) = the K/V tiles that may be visible to tile i, and the fully visible ones
      for j in [lo, full_lo) masked, [full_lo, full_hi) unmasked, [full_hi, hi) masked:
          forward:  S = (Q_i scale) K_j^T;  online softmax (running max m, sum l, accumulator)
          backward: P = exp(S - lse);  dV_j += P^T dO_i;  dS = P (dO_i V_j^T - delta);
                    dQ_i += dS K_j;  dK_j += dS^T (Q_i scale)      (one pass: S and P computed once)

The ranges come from each tile's min/max position and segment id (`flash_tiles.visibility`), shared by the
batch. Tiles are `q_tile` x `kv_tile` (the largest divisors of the block lengths not above them); a ring's
position runs (zig-zag has two per rank) stay tile-aligned whenever the tile divides the run, so the tiles a
causal mask hides are skipped exactly. With `into=` the pair continues a running result (the online softmax
from (out, lse); gradients added to (dq, dk, dv)), so a ring needs no merge or add pass per step
(`BlockOps.accumulates`). The Pallas kernel in `flash.py` provides the same pair on GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.core.vma import vary, varying_axes
from jaxring.kernels.flash_tiles import loop_ranges, visibility
from jaxring.kernels.masking import attention_mask, positions_may_meet

# Tiles of the jnp pair, tuned on 8 simulated CPU devices (benchmarks/ring_attention.py): the forward keeps
# one [tq, tk] score tile per head, the backward three (S/P, dP, dS), so it takes smaller ones.
FORWARD_TILE = 256
BACKWARD_TILE = 128


@dataclasses.dataclass(frozen=True)
class BlockOps:
    """A per-block forward/backward pair with the interface documented in this module.

    accumulates: forward and backward also take `into=` (the running (out, lse), or (dq, dk, dv)) and
    return it updated, saving the ring a merge or an add pass per step (the jnp pair does).
    lockstep: every device must make the same calls (Pallas' TPU interpret mode synchronises all devices at each
    kernel call), so callers compute a hidden block (it adds nothing) instead of skipping it (`unless_hidden`).
    """

    name: str
    forward: Callable
    backward: Callable
    accumulates: bool = False
    lockstep: bool = False


def unless_hidden(lockstep: bool, visible: jax.Array, compute: Callable[[], Any], skip: Callable[[], Any]) -> Any:
    """`lax.cond(visible, compute, skip)`: a hidden block skipped; for lockstep block ops (BlockOps.lockstep)
    compute() on every device (a hidden block's result equals skip()'s)."""
    return compute() if lockstep else lax.cond(visible, compute, skip)


def in_callers_dtype(name: str, forward_fp32: Callable, backward_fp32: Callable) -> BlockOps:
    """A BlockOps of a pair that computes in fp32 (a library kernel's decomposition: cuDNN's, tokamax's): out and
    dq, dk, dv cast to the caller's `dtype=` (fp32 by default), lse kept fp32."""

    def forward(*args: Any, dtype: jnp.dtype = jnp.float32, **kw: Any) -> tuple[jax.Array, jax.Array]:
        out, lse = forward_fp32(*args, **kw)
        return out.astype(dtype), lse

    def backward(*args: Any, dtype: jnp.dtype = jnp.float32, **kw: Any) -> tuple[jax.Array, ...]:
        return tuple(g.astype(dtype) for g in backward_fp32(*args, **kw))

    return BlockOps(name, forward, backward)


def with_window(ops: BlockOps, window: int | None) -> BlockOps:
    """`ops` with the sliding window bound into both functions (`ops` itself when window is None)."""
    if window is None:
        return ops
    return dataclasses.replace(
        ops,
        name=f"{ops.name}, window {window}",
        forward=functools.partial(ops.forward, window=window),
        backward=functools.partial(ops.backward, window=window),
    )


def tile_size(n: int, target: int) -> int:
    """Largest divisor of n not above target; n itself (one tile) when no divisor reaches target / 8."""
    t = min(n, target)
    while n % t:
        t -= 1
    return t if t * 8 >= min(n, target) else n


def tile_visible(
    q_positions: jax.Array, kv_positions: jax.Array, *, causal: bool, window: int | None = None
) -> jax.Array:
    """False when the causal mask (and the window) hides every (query, key) pair of the tile: it can be skipped."""
    return positions_may_meet(q_positions, kv_positions, causal=causal, window=window)


def _check_positions(q: jax.Array, k: jax.Array, q_positions: jax.Array, kv_positions: jax.Array):
    """Positions are shared by the batch: int [n] (per-row positions would be split along the wrong axis)."""
    for name, pos, n in (("q_positions", q_positions, q.shape[1]), ("kv_positions", kv_positions, k.shape[1])):
        if pos.shape != (n,):
            raise ValueError(
                f"{name} shape {pos.shape} must be [{n}] (one position per token, shared by the "
                f"batch; vmap over rows for per-row positions)"
            )


def tile_ranges(
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
    *,
    causal: bool,
    q_tile: int,
    kv_tile: int,
    window: int | None = None,
) -> jax.Array:
    """int32 [nq / q_tile, 4]: for each Q tile the K/V tile loop (lo, full_lo, full_hi, hi), batch-wide."""
    nq, nk = q_positions.shape[0], kv_positions.shape[0]
    seg = q_segment_ids is not None
    batch = q_segment_ids.shape[0] if seg else 1
    qpos = jnp.broadcast_to(q_positions.astype(jnp.int32), (batch, nq)) if causal else None
    kpos = jnp.broadcast_to(kv_positions.astype(jnp.int32), (batch, nk)) if causal else None
    vis, full = visibility(
        causal, qpos, kpos, q_segment_ids, kv_segment_ids, batch, nq, nk, nk, q_tile, kv_tile, window
    )
    return loop_ranges(jnp.any(vis, axis=0), jnp.all(full, axis=0))


def _tiles(q: jax.Array, k: jax.Array, q_tile: int, kv_tile: int):
    return tile_size(q.shape[1], q_tile), tile_size(k.shape[1], kv_tile)


def _slice(x: jax.Array | None, start: int | jax.Array, size: int, axis: int = 1):
    return None if x is None else lax.dynamic_slice_in_dim(x, start, size, axis)


def _three_loops(rng: jax.Array, body: Callable[..., Any], carry: tuple[jax.Array, ...]):
    """body(j, carry, masked=...) over K/V tiles [lo, full_lo) masked, [full_lo, full_hi) unmasked, [full_hi, hi)."""
    lo, flo, fhi, hi = rng[0], rng[1], rng[2], rng[3]
    carry = lax.fori_loop(lo, flo, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(flo, fhi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(fhi, hi, functools.partial(body, masked=True), carry)


def _heads_major(x: jax.Array, kv_heads: int):
    """[b, t, hq, d] -> [b, kv_heads, groups, t, d] (query heads grouped by the K/V head they read)."""
    b, t, hq, d = x.shape
    return jnp.transpose(x.reshape(b, t, kv_heads, hq // kv_heads, d), (0, 2, 3, 1, 4))


def _varying(inputs: Iterable[jax.Array | None], tree: Any):
    """`tree` (loop carries) made varying over every mesh axis any input varies over (check_vma)."""
    axes = frozenset().union(*(varying_axes(x) for x in inputs if x is not None))
    return jax.tree.map(lambda x: vary(x, axes), tree)


def _mask_scores(
    s: jax.Array,
    qpos: jax.Array,
    kpos: jax.Array,
    qseg: jax.Array | None,
    kseg: jax.Array | None,
    causal: bool,
    window: int | None,
):
    """s [b, hkv, g, tq, tk] with invisible pairs set to -inf."""
    mask = attention_mask(qpos, kpos, qseg, kseg, causal=causal, window=window)
    return s if mask is None else jnp.where(mask[:, None, None], s, -jnp.inf)


def block_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    causal: bool,
    sm_scale: float,
    q_tile: int = FORWARD_TILE,
    kv_tile: int = FORWARD_TILE,
    into: tuple[jax.Array, jax.Array] | None = None,
    window: int | None = None,
    dtype: jax.typing.DTypeLike = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """Attention of one Q block over one K/V block; see the module docstring for shapes.

    into: optional running (out, lse) fp32 of the same queries over other keys; the online softmax then
    continues from it and the result is their merge (`merge_partials(*into, *this block)`), with no
    separate merge pass. dtype: out's when `into` is None (each tile is written in it).
    """
    _check_positions(q, k, q_positions, kv_positions)
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    tq, tk = _tiles(q, k, q_tile, kv_tile)
    ranges = tile_ranges(
        q_positions, kv_positions, q_segment_ids, kv_segment_ids, causal=causal, q_tile=tq, kv_tile=tk, window=window
    )
    inputs = (q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, ranges)

    def q_tile_body(i: jax.Array, outputs: tuple[jax.Array, jax.Array]):
        out, lse = outputs
        rows = i * tq
        q_i = _heads_major(_slice(q, rows, tq).astype(jnp.float32) * sm_scale, hkv)  # [b, hkv, g, tq, d]
        qpos_i, qseg_i = _slice(q_positions, rows, tq, 0), _slice(q_segment_ids, rows, tq)

        def kv_tile_body(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array], *, masked: bool):
            acc, m, l = carry
            keys = j * tk
            s = jnp.einsum("bhgqd,bkhd->bhgqk", q_i, _slice(k, keys, tk).astype(jnp.float32))
            if masked:
                s = _mask_scores(
                    s,
                    qpos_i,
                    _slice(kv_positions, keys, tk, 0),
                    qseg_i,
                    _slice(kv_segment_ids, keys, tk),
                    causal,
                    window,
                )
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows with no key yet: no NaN
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            pv = jnp.einsum("bhgqk,bkhd->bhgqd", p, _slice(v, keys, tk).astype(jnp.float32))
            return acc * alpha[..., None] + pv, m_new, l * alpha + jnp.sum(p, axis=-1)

        if into is None:
            init = (
                jnp.zeros((b, hkv, g, tq, d), jnp.float32),
                jnp.full((b, hkv, g, tq), -jnp.inf, jnp.float32),
                jnp.zeros((b, hkv, g, tq), jnp.float32),
            )
        else:  # continue from the running result: acc = out, m = lse, l = 1 (l = 0 on rows seen empty)
            lse_in = jnp.transpose(_slice(lse, rows, tq).reshape(b, tq, hkv, g), (0, 2, 3, 1))
            init = (
                _heads_major(_slice(out, rows, tq).astype(jnp.float32), hkv),
                lse_in,
                jnp.where(jnp.isneginf(lse_in), 0.0, 1.0),
            )
        acc, m, l = _three_loops(ranges[i], kv_tile_body, _varying(inputs, init))
        empty = l == 0.0
        o = acc / jnp.where(empty, 1.0, l)[..., None]
        lse_i = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
        o = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, tq, hq, d)
        lse_i = jnp.transpose(lse_i, (0, 3, 1, 2)).reshape(b, tq, hq)
        out = lax.dynamic_update_slice_in_dim(out, o.astype(out.dtype), rows, 1)
        return out, lax.dynamic_update_slice_in_dim(lse, lse_i, rows, 1)

    if into is None:
        into = (jnp.zeros((b, nq, hq, d), dtype), jnp.full((b, nq, hq), -jnp.inf, jnp.float32))
    return lax.fori_loop(0, nq // tq, q_tile_body, _varying(inputs, into))


def block_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    causal: bool,
    sm_scale: float,
    q_tile: int = BACKWARD_TILE,
    kv_tile: int = BACKWARD_TILE,
    into: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    window: int | None = None,
    dtype: jax.typing.DTypeLike = jnp.float32,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of one (Q block, K/V block) pair given the global lse and delta, in `dtype` (dq written in it
    tile by tile; dk and dv summed over the Q tiles in fp32, then cast).

    into: optional fp32 (dq, dk, dv) accumulators; this pair's gradients are added to them in place (`dtype`
    is then theirs).
    """
    _check_positions(q, k, q_positions, kv_positions)
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    tq, tk = _tiles(q, k, q_tile, kv_tile)
    ranges = tile_ranges(
        q_positions, kv_positions, q_segment_ids, kv_segment_ids, causal=causal, q_tile=tq, kv_tile=tk, window=window
    )
    inputs = (q, k, v, dout, lse, delta, q_positions, kv_positions, q_segment_ids, kv_segment_ids, ranges)
    # [b, tq, hq] -> [b, hkv, g, tq]
    as_rows = lambda x: jnp.transpose(x.reshape(b, tq, hkv, g), (0, 2, 3, 1))

    def q_tile_body(i: jax.Array, grads: tuple[jax.Array, jax.Array, jax.Array]):
        dq, dk, dv = grads
        rows = i * tq
        q_i = _heads_major(_slice(q, rows, tq).astype(jnp.float32) * sm_scale, hkv)  # [b, hkv, g, tq, d]
        do_i = _heads_major(_slice(dout, rows, tq).astype(jnp.float32), hkv)
        lse_i = as_rows(_slice(lse, rows, tq))
        lse_i = jnp.where(jnp.isneginf(lse_i), 0.0, lse_i)[..., None]  # rows that see nothing: P = 0
        delta_i = as_rows(_slice(delta, rows, tq))[..., None]
        qpos_i, qseg_i = _slice(q_positions, rows, tq, 0), _slice(q_segment_ids, rows, tq)

        def kv_tile_body(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array], *, masked: bool):
            dq_i, dk, dv = carry
            keys = j * tk
            k_j = _slice(k, keys, tk).astype(jnp.float32)
            v_j = _slice(v, keys, tk).astype(jnp.float32)
            s = jnp.einsum("bhgqd,bkhd->bhgqk", q_i, k_j)
            if masked:
                s = _mask_scores(
                    s,
                    qpos_i,
                    _slice(kv_positions, keys, tk, 0),
                    qseg_i,
                    _slice(kv_segment_ids, keys, tk),
                    causal,
                    window,
                )
            p = jnp.exp(s - lse_i)
            dp = jnp.einsum("bhgqd,bkhd->bhgqk", do_i, v_j)
            ds = p * (dp - delta_i)
            dv_j = jnp.einsum("bhgqk,bhgqd->bkhd", p, do_i)
            dk_j = jnp.einsum("bhgqk,bhgqd->bkhd", ds, q_i)
            dq_i = dq_i + jnp.einsum("bhgqk,bkhd->bhgqd", ds, k_j)
            add = lambda acc, x: lax.dynamic_update_slice_in_dim(acc, _slice(acc, keys, tk) + x, keys, 1)
            return dq_i, add(dk, dk_j), add(dv, dv_j)

        dq_i, dk, dv = _three_loops(ranges[i], kv_tile_body, (_varying(inputs, jnp.zeros_like(q_i)), dk, dv))
        dq_i = jnp.transpose(dq_i * sm_scale, (0, 3, 1, 2, 4)).reshape(b, tq, hq, d)
        if into is not None:
            dq_i = _slice(dq, rows, tq) + dq_i
        return lax.dynamic_update_slice_in_dim(dq, dq_i.astype(dq.dtype), rows, 1), dk, dv

    if into is not None:
        return lax.fori_loop(0, nq // tq, q_tile_body, _varying(inputs, into))
    zeros = (
        jnp.zeros((b, nq, hq, d), dtype),
        jnp.zeros((b, nk, hkv, d), jnp.float32),
        jnp.zeros((b, nk, hkv, d), jnp.float32),
    )
    dq, dk, dv = lax.fori_loop(0, nq // tq, q_tile_body, _varying(inputs, zeros))
    return dq, dk.astype(dtype), dv.astype(dtype)


JNP_BLOCK_OPS = BlockOps("jnp", block_forward, block_backward, accumulates=True)
