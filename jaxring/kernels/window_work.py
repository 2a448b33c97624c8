"""What a local attention kernel still computes under a sliding window: its share of the causal tile work.

Every kernel (the jnp tiles of `blockwise.py` on CPU; the Pallas forward, dK/dV and dQ kernels of
`flash_kernels.py` on GPU) runs, for each tile of its outer axis, one loop over the inner axis's tiles from the
first that may hold a visible pair to the last (`flash_tiles.loop_ranges` of `visibility`; tile bounds by
`masking.may_see`: causal q_max >= k_min, window q_min < k_max + W). A window narrows those loops to a band.
Ulysses, the all-gather and dense attention put the keys in natural order under a window; their queries are
the whole sequence (Ulysses, dense) or a layout shard (all-gather). The count here is the kernels' own loop
bounds, found by binary search within each increasing run of tiles (no [tiles, tiles] matrix: planner sizes),
each kernel weighted by its matmuls per tile pair (forward 2; jnp backward 5; Pallas dK/dV 4, dQ 3).
Segment ids skip more tiles; that is not claimed. A partial last tile takes its last token's bounds.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from jaxring.kernels.blockwise import BACKWARD_TILE, FORWARD_TILE, tile_size
from jaxring.kernels.flash_tiles import Config, kernel_tiles
from jaxring.kernels.layout import layout_positions

_NO_WINDOW = np.iinfo(np.int64).max // 4


def _tile_bounds(positions: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) position of each tile of `tile` tokens, int64 [ceil(n / tile)]."""
    pos = np.asarray(positions, np.int64)
    pad = -len(pos) % tile
    tiles = np.concatenate([pos, np.full(pad, pos[-1])]).reshape(-1, tile)
    return tiles.min(-1), tiles.max(-1)


def _runs(first: np.ndarray) -> list[slice]:
    """Slices of tiles whose first positions increase (a layout's runs: zig-zag 2 per rank, else 1)."""
    cuts = [0, *(np.flatnonzero(np.diff(first) < 0) + 1), len(first)]
    return [slice(a, b) for a, b in itertools.pairwise(cuts)]


def visited_tiles(
    q_positions: np.ndarray, kv_positions: np.ndarray, q_tile: int, kv_tile: int, window: int | None, over: str = "q"
) -> int:
    """Tile pairs a causal kernel visits: for each tile of the outer axis (`over` "q": a row of K/V tiles per Q
    tile, the forward and dQ loops; "k": a column of Q tiles per K/V tile, the dK/dV loop), the inner tiles from
    the first that may hold a visible pair to the last (`loop_ranges`), summed."""
    w = _NO_WINDOW if window is None else window
    q_min, q_max = _tile_bounds(q_positions, q_tile)
    k_min, k_max = _tile_bounds(kv_positions, kv_tile)
    outer = len(q_min) if over == "q" else len(k_min)
    lo, hi = np.full(outer, np.iinfo(np.int64).max), np.full(outer, -1)
    for run in _runs(q_min if over == "k" else k_min):
        if over == "q":  # K/V tiles j with k_min <= q_max and q_min < k_max + W
            start = np.searchsorted(k_max[run] + w, q_min, side="right")
            end = np.searchsorted(k_min[run], q_max, side="right")
        else:  # Q tiles i with q_max >= k_min and q_min < k_max + W
            start = np.searchsorted(q_max[run], k_min, side="left")
            end = np.searchsorted(q_min[run], k_max + w, side="left")
        some = start < end
        lo = np.where(some, np.minimum(lo, run.start + start), lo)
        hi = np.where(some, np.maximum(hi, run.start + end), hi)
    return int(np.where(hi >= 0, hi - lo, 0).sum())


def kernel_passes(cpu: bool, q_len: int, kv_len: int, head_dim: int) -> list[tuple[str, int, int, int]]:
    """(outer axis, q tile, kv tile, matmuls per tile pair) of each kernel of one forward and backward: jnp
    (`block_forward` 256-token tiles, `block_backward` 128, each the largest divisor not above) or Pallas
    (`kernel_tiles`' defaults for head_dim)."""
    if cpu:
        fwd, bwd = FORWARD_TILE, BACKWARD_TILE
        return [
            ("q", tile_size(q_len, fwd), tile_size(kv_len, fwd), 2),
            ("q", tile_size(q_len, bwd), tile_size(kv_len, bwd), 5),
        ]
    tiles = kernel_tiles(Config(True, 1.0, "pallas"), head_dim, q_len, kv_len)
    return [
        ("q", tiles["fwd"].block_q, tiles["fwd"].block_k, 2),
        ("k", tiles["dkv"].block_q, tiles["dkv"].block_k, 4),
        ("q", tiles["dq"].block_q, tiles["dq"].block_k, 3),
    ]


def kernel_window_share(q_positions: np.ndarray, kv_len: int, window: int, cpu: bool, head_dim: int) -> float:
    """The share of its causal work a windowed kernel still computes, for queries at `q_positions` int [ranks,
    n] (each rank's) against keys 0..kv_len-1 in natural order: the busiest rank's visited tile pairs, each
    kernel weighted by its matmuls and tile size, with the window over without."""
    q_positions = np.atleast_2d(np.asarray(q_positions))
    keys = np.arange(kv_len)
    passes = kernel_passes(cpu, q_positions.shape[1], kv_len, head_dim)

    def busiest(w: int | None) -> float:
        return max(
            sum(m * bq * bk * visited_tiles(q, keys, bq, bk, w, over) for over, bq, bk, m in passes)
            for q in q_positions
        )

    return busiest(window) / busiest(None)


@functools.lru_cache(maxsize=256)
def layout_window_share(layout: str, ranks: int, n: int, window: int, cpu: bool, head_dim: int) -> float:
    """`kernel_window_share` for the queries of `ranks` ranks of n tokens each in `layout` (one rank: the whole
    sequence in order, as Ulysses and dense attention see it) against all ranks·n keys in natural order."""
    queries = np.stack([np.asarray(layout_positions(layout, r, ranks, n)) for r in range(ranks)])
    return kernel_window_share(queries, ranks * n, window, cpu, head_dim)
