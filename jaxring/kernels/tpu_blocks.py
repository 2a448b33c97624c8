"""The TPU flash kernels (`tpu_flash_kernels.py`) as a `BlockOps` pair: block_ops "pallas_tpu" (Mosaic, TPU)
and "pallas_tpu_interpret" (the same kernels interpreted on CPU, for tests: Pallas' TPU interpret mode inside
shard_map, its HLO interpreter elsewhere; `tpu_flash_kernels._interpreter`).

Every block of every layout goes to the kernels — ring contiguous, zig-zag and striped, Ulysses, USP,
WallFacer, the all-gather and dense attention, decoding — since they mask by positions and segment ids:

  forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, causal, sm_scale[, window], dtype)
      q [b, nq, hq, d] -> heads-major [b, hq, nq, d] (a transpose), the kernel, back: out [b, nq, hq, d] in
      dtype, lse fp32 [b, nq, hq]
  backward(q, k, v, dout, lse, delta, ...)  the global lse and delta in, dq, dk, dv out (K/V keep their heads)

Tiles: the largest multiple of 128 dividing the block length up to the target (512 forward, 256 backward
queries), else the whole block when it is at most WHOLE_BLOCK_LIMIT tokens (TPU blocks are multiples of 128 or
the whole axis); a longer block whose length has no such divisor is refused in one line.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxring.kernels import tpu_flash_kernels as kernels
from jaxring.kernels.blockwise import BlockOps
from jaxring.kernels.flash_tiles import tile_loop_ranges

Array = jax.Array
FORWARD_TILES = (512, 512)  # (queries, keys)
BACKWARD_TILES = (256, 512)
WHOLE_BLOCK_LIMIT = 2048


def tile_for(n: int, target: int) -> int:
    """The tile along a block of n tokens: the largest multiple of 128 dividing n up to target, else n."""
    for t in range(min(target, n) // kernels.LANES * kernels.LANES, 0, -kernels.LANES):
        if n % t == 0:
            return t
    if n > WHOLE_BLOCK_LIMIT:
        raise ValueError(
            f"block_ops 'pallas_tpu': a block of {n} tokens has no tile that is a multiple of 128 (TPU tiles are) "
            f"and is too long for one tile (> {WHOLE_BLOCK_LIMIT}); use a sequence length whose per-device blocks "
            f"are multiples of 128"
        )
    return n


def _heads_major(x: Array) -> Array:
    """[b, n, h, d] <-> [b, h, n, d]."""
    return jnp.swapaxes(x, 1, 2)


def _info(
    q_positions: Array, kv_positions: Array, q_segment_ids: Array | None, kv_segment_ids: Array | None, causal: bool
) -> tuple[Array | None, ...]:
    """(q_pos, q_seg, kv_pos, kv_seg) in the kernels' lane layouts (None where the mask does not need them)."""
    q_lanes = lambda x: jnp.broadcast_to(x.astype(jnp.int32)[..., None], (*x.shape, kernels.LANES))
    kv_sublanes = lambda x: jnp.broadcast_to(
        x.astype(jnp.int32)[..., None, :], (*x.shape[:-1], kernels.SUBLANES, x.shape[-1])
    )
    seg = q_segment_ids is not None
    return (
        q_lanes(q_positions[None]) if causal else None,
        q_lanes(q_segment_ids) if seg else None,
        kv_sublanes(kv_positions[None]) if causal else None,
        kv_sublanes(kv_segment_ids) if seg else None,
    )


def _ranges(
    q_positions: Array,
    kv_positions: Array,
    q_segment_ids: Array | None,
    kv_segment_ids: Array | None,
    *,
    batch: int,
    tiles: tuple[int, int],
    causal: bool,
    window: int | None,
    over_queries: bool = False,
) -> Array:
    """int32 [b, rows, 4]: each row of tiles' loop range (`flash_tiles.tile_loop_ranges`)."""
    nq, nk = q_positions.shape[0], kv_positions.shape[0]
    seg = q_segment_ids is not None
    rows = q_segment_ids.shape[0] if seg else 1
    qpos = jnp.broadcast_to(q_positions.astype(jnp.int32), (rows, nq))
    kpos = jnp.broadcast_to(kv_positions.astype(jnp.int32), (rows, nk))
    ranges = tile_loop_ranges(
        causal, qpos, kpos, q_segment_ids, kv_segment_ids, rows, nq, nk, nk, *tiles, window, over_queries=over_queries
    )
    return jnp.broadcast_to(ranges, (batch, *ranges.shape[1:]))


def _check(q: Array, k: Array) -> None:
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"block_ops 'pallas_tpu': {q.shape[2]} query heads are not a multiple of {k.shape[2]} K/V heads"
        )


def tpu_block_forward(
    q: Array, k: Array, v: Array, q_positions: Array, kv_positions: Array,
    q_segment_ids: Array | None = None, kv_segment_ids: Array | None = None,
    *, causal: bool, sm_scale: float, window: int | None = None, dtype: jax.typing.DTypeLike = jnp.float32,
    interpret: bool = False,
) -> tuple[Array, Array]:  # fmt: skip
    """BlockOps forward (`blockwise.py`'s interface): out [b, nq, hq, d] in dtype, lse fp32 [b, nq, hq]."""
    _check(q, k)
    tiles = (tile_for(q.shape[1], FORWARD_TILES[0]), tile_for(k.shape[1], FORWARD_TILES[1]))
    seg = (q_segment_ids, kv_segment_ids)
    ranges = _ranges(q_positions, kv_positions, *seg, batch=q.shape[0], tiles=tiles, causal=causal, window=window)
    out, lse = kernels.forward(
        _heads_major(q), _heads_major(k), _heads_major(v), _info(q_positions, kv_positions, *seg, causal), ranges,
        tiles=tiles, causal=causal, window=window, sm_scale=sm_scale, out_dtype=dtype, interpret=interpret,
    )  # fmt: skip
    return _heads_major(out), jnp.swapaxes(lse[:, :, 0, :], 1, 2)


def tpu_block_backward(
    q: Array, k: Array, v: Array, dout: Array, lse: Array, delta: Array, q_positions: Array, kv_positions: Array,
    q_segment_ids: Array | None = None, kv_segment_ids: Array | None = None,
    *, causal: bool, sm_scale: float, window: int | None = None, dtype: jax.typing.DTypeLike = jnp.float32,
    interpret: bool = False,
) -> tuple[Array, Array, Array]:  # fmt: skip
    """BlockOps backward given the global lse and delta [b, nq, hq]: dq, dk, dv in dtype."""
    _check(q, k)
    tiles = (tile_for(q.shape[1], BACKWARD_TILES[0]), tile_for(k.shape[1], BACKWARD_TILES[1]))
    seg = (q_segment_ids, kv_segment_ids)
    ranges = functools.partial(
        _ranges, q_positions, kv_positions, *seg, batch=q.shape[0], tiles=tiles, causal=causal, window=window
    )
    rows = lambda x: jnp.swapaxes(x.astype(jnp.float32), 1, 2)[:, :, None, :]  # [b, nq, hq] -> [b, hq, 1, nq]
    dq, dk, dv = kernels.backward(
        _heads_major(q), _heads_major(k), _heads_major(v), _heads_major(dout.astype(q.dtype)), rows(lse), rows(delta),
        _info(q_positions, kv_positions, *seg, causal), ranges(), ranges(over_queries=True),
        tiles=tiles, causal=causal, window=window, sm_scale=sm_scale, out_dtype=dtype, interpret=interpret,
    )  # fmt: skip
    return _heads_major(dq), _heads_major(dk), _heads_major(dv)


def tpu_block_ops(interpret: bool = False) -> BlockOps:
    """The TPU kernels as a BlockOps ("pallas_tpu"; "pallas_tpu_interpret" runs them in TPU interpret mode)."""
    return BlockOps(
        "pallas_tpu_interpret" if interpret else "pallas_tpu",
        functools.partial(tpu_block_forward, interpret=interpret),
        functools.partial(tpu_block_backward, interpret=interpret),
        lockstep=interpret,  # TPU interpret mode (inside shard_map) synchronises every device at each kernel call
    )
