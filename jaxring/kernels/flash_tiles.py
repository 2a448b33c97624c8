"""Tile metadata of the flash kernels: per-kernel tile sizes, padding to kernel shapes, and block skipping.

Tiles (`default_block_config`): each kernel ("fwd", "dkv", "dq") has its own (block_q, block_k, num_warps,
num_stages), chosen per padded head dim for Hopper so that every kernel compiles for sm_90a with no register
spills and no serialized wgmma (checked by `tests/compiled/test_gpu_compile.py` on the deviceless H200 compile).

Padding (`prepare`): head_dim is zero-padded to a power of two >= 16 and sequences to a multiple of the block
sizes (Triton tiles are powers of two); zero head columns change no score and are sliced off. Padded keys are
masked (the largest int32 position under causal, segment 0 with segment ids, an index mask otherwise);
padded query rows are sliced off.

Block skipping (`tile_loop_ranges`: `visibility`, `loop_ranges`): a few small jnp reductions compare block bounds (min/max
position per block for causal and the sliding window, min/max non-zero segment id per block; the tests are
`masking.may_see` / `sees_all`) and give every row of tiles a range [lo, hi) of tiles that may hold a visible
pair, and inside it a sub-range [full_lo, full_hi) of tiles where every pair is visible; the kernels run
masked [lo, full_lo), unmasked [full_lo, full_hi), masked [full_hi, hi). With a window W the visible tiles of
a row form a band of about (W + block_q) / block_k tiles along the diagonal: the work is O(seq · W), not
O(seq²), and the tiles wholly inside the band take the unmasked path. The visibility table is built a slab
of tile rows at a time, so that its memory does not grow with the square of the tokens.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxring.kernels.masking import INT_MAX, INT_MIN, check_window, may_see, sees_all, segment_bounds

IMPLEMENTATIONS = ("auto", "pallas", "pallas_interpret", "jnp")
MIN_BLOCK = 16  # Triton's dot needs every tile dimension >= 16.


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """Static settings of one call (hashable: a jit static argument)."""

    causal: bool
    sm_scale: float
    implementation: str  # resolved: "pallas", "pallas_interpret" or "jnp"
    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    window: int | None = None  # sliding window (causal only): query i sees keys i - window < j <= i


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch settings of one kernel."""

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


def default_block_config(head_dim: int) -> dict[str, Tiles]:
    """Default tiles for the three kernels ("fwd", "dkv", "dq"), chosen for Hopper (H100/H200).

    Start: the Triton FlashAttention-2 tutorial's Hopper configurations (128-row query tiles, 64-key tiles,
    3 pipeline stages; narrow 32-wide inner tiles in the backward). Then retuned on the deviceless sm_90a
    compile (bf16, causal, `benchmarks/gpu_compile.py`) until ptxas reports no spills and no serialized wgmma:
    the dK/dV kernel holds two fp32 accumulators of block_k x head_dim, which at 4 warps took all 255
    registers and spilled (740 B at head dim 64 with block_k 128; 24 B and wgmma serialized at 128 with
    block_k 64); 8 warps halve the accumulator registers per thread (202 and 198 registers, no spills).
    Not autotuned for speed on a GPU (none was available); `benchmarks/flash_attention.py` measures them
    where one is. Every value is overridable through `block_q`, `block_k`, `num_warps`, `num_stages`.
    """
    d = padded_head_dim(head_dim)
    if d <= 64:
        return {"fwd": Tiles(128, 64, 4, 3), "dkv": Tiles(32, 128, 8, 3), "dq": Tiles(128, 32, 4, 3)}
    if d <= 128:
        return {"fwd": Tiles(128, 64, 8, 3), "dkv": Tiles(32, 64, 8, 3), "dq": Tiles(64, 32, 4, 3)}
    return {"fwd": Tiles(64, 32, 4, 2), "dkv": Tiles(16, 32, 4, 2), "dq": Tiles(32, 16, 4, 2)}


def padded_head_dim(head_dim: int) -> int:
    return max(MIN_BLOCK, pl.next_power_of_2(head_dim))


def kernel_tiles(cfg: Config, head_dim: int, q_len: int, kv_len: int) -> dict[str, Tiles]:
    """Per-kernel tiles after user overrides, shrunk for short sequences (never below 16)."""
    out = {}
    for name, t in default_block_config(head_dim).items():
        bq = cfg.block_q if cfg.block_q is not None else t.block_q
        bk = cfg.block_k if cfg.block_k is not None else t.block_k
        bq = min(bq, max(MIN_BLOCK, pl.next_power_of_2(q_len)))
        bk = min(bk, max(MIN_BLOCK, pl.next_power_of_2(kv_len)))
        out[name] = Tiles(bq, bk, cfg.num_warps or t.num_warps, cfg.num_stages or t.num_stages)
    return out


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def resolve_implementation(implementation: str | None) -> str:
    if implementation is None or implementation == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "jnp"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation {implementation!r} is not one of {IMPLEMENTATIONS} (or None)")
    return implementation


def check_block(name: str, value: int | None) -> None:
    if value is None:
        return
    if not isinstance(value, (int, np.integer)) or value < MIN_BLOCK or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a power of two >= {MIN_BLOCK} (a Triton tile size)")


def make_config(
    causal: bool,
    sm_scale: float | None,
    head_dim: int,
    implementation: str,
    block_q: int | None,
    block_k: int | None,
    num_warps: int | None,
    num_stages: int | None,
    window: int | None = None,
) -> Config:
    window = check_window(window, causal)
    check_block("block_q", block_q)
    check_block("block_k", block_k)
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer")
    scale = head_dim**-0.5 if sm_scale is None else float(sm_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"sm_scale {sm_scale!r} must be a finite number > 0 (the scores' scale)")
    return Config(
        bool(causal),
        scale,
        resolve_implementation(implementation),
        None if block_q is None else int(block_q),
        None if block_k is None else int(block_k),
        num_warps,
        num_stages,
        window,
    )


# ----------------------------------------------------------------------------------------------------------
# Padding and block ranges (plain jnp, outside the kernels)
# ----------------------------------------------------------------------------------------------------------


def pad_axis(x: jax.Array | None, axis: int, size: int, value: int = 0) -> jax.Array | None:
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def pad_tokens(x: jax.Array, seq_len: int, head_dim: int) -> jax.Array:
    """[b, n, h, d] -> [b, seq_len, h, head_dim] with zeros."""
    return pad_axis(pad_axis(x, 1, seq_len), 3, head_dim)


def as_batched(x: jax.Array | None, batch: int, length: int, padded: int, fill: int) -> jax.Array | None:
    """[n] or [b, n] ints -> [b, padded] int32, padded with `fill`."""
    if x is None:
        return None
    x = jnp.asarray(x).astype(jnp.int32)
    x = jnp.broadcast_to(x, (batch, length)) if x.ndim == 1 else x
    return pad_axis(x, 1, padded, fill)


def block_stats(pos: jax.Array | None, seg: jax.Array | None, block: int) -> dict[str, jax.Array]:
    """Per-tile bounds: min/max position, min/max non-zero segment id, 'one segment, no padding'."""
    b, n = (pos if pos is not None else seg).shape
    stats = {}
    if pos is not None:
        p = pos.reshape(b, n // block, block)
        stats["pmin"], stats["pmax"] = p.min(-1), p.max(-1)
    if seg is not None:
        s = seg.reshape(b, n // block, block)
        smin, smax = segment_bounds(s)
        stats["smin"], stats["smax"] = smin, smax
        stats["uniform"] = (smin == smax) & jnp.all(s != 0, axis=-1)
    return stats


def _tile_stats(
    causal: bool,
    qpos: jax.Array | None,
    kpos: jax.Array | None,
    qseg: jax.Array | None,
    kseg: jax.Array | None,
    batch: int,
    nq: int,
    nk: int,
    kv_len: int,
    bq: int,
    bk: int,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Per-tile bounds of the Q tiles [b, nq/bq] and the K tiles [b, nk/bk] (`block_stats`), each with its
    "index"; the K tiles' "pad": it holds padded keys."""
    qs = block_stats(qpos if causal else None, qseg, bq) if causal or qseg is not None else {}
    ks = block_stats(kpos if causal else None, kseg, bk) if causal or qseg is not None else {}
    qs["index"] = jnp.broadcast_to(jnp.arange(nq // bq), (batch, nq // bq))
    ks["index"] = jnp.broadcast_to(jnp.arange(nk // bk), (batch, nk // bk))
    if nk > kv_len:
        ks["pad"] = (ks["index"] + 1) * bk > kv_len
    return qs, ks


def _visible_tiles(
    qs: dict[str, jax.Array], ks: dict[str, jax.Array], causal: bool, window: int | None
) -> tuple[jax.Array, jax.Array]:
    """(vis, full) [b, Q tiles, K tiles] of the tiles `qs` [b, r] against `ks` [b, c] (see `visibility`)."""
    vis = jnp.ones(qs["index"].shape + ks["index"].shape[-1:], bool)
    full = vis
    if causal:
        bounds = (qs["pmin"][:, :, None], qs["pmax"][:, :, None], ks["pmin"][:, None, :], ks["pmax"][:, None, :])
        vis = vis & may_see(*bounds, causal=True, window=window)
        full = full & sees_all(*bounds, causal=True, window=window)
    if "smin" in qs:
        vis = (
            vis
            & (qs["smin"][:, :, None] <= ks["smax"][:, None, :])
            & (ks["smin"][:, None, :] <= qs["smax"][:, :, None])
        )
        full = full & qs["uniform"][:, :, None] & ks["uniform"][:, None, :]
        full = full & (qs["smin"][:, :, None] == ks["smin"][:, None, :])
    if "pad" in ks:  # tiles holding padded keys always take the masked path
        full = full & ~ks["pad"][:, None, :]
    return vis, full & vis


def visibility(
    causal: bool,
    qpos: jax.Array | None,
    kpos: jax.Array | None,
    qseg: jax.Array | None,
    kseg: jax.Array | None,
    batch: int,
    nq: int,
    nk: int,
    kv_len: int,
    bq: int,
    bk: int,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """vis[b, i, j]: tile (q block i, k block j) may hold a visible pair; full[b, i, j]: all its pairs are."""
    qs, ks = _tile_stats(causal, qpos, kpos, qseg, kseg, batch, nq, nk, kv_len, bq, bk)
    return _visible_tiles(qs, ks, causal, window)


# A kernel's loop ranges are built this many tiles of the visibility table at a time: the whole table is
# [b, nq/bq, nk/bk] booleans, quadratic in the tokens (5.7M tokens a device in tiles of 64 x 32 made three
# of 14.8 GiB each in the deviceless H200 compile of Llama-3-8B under Ulysses sp8)
VISIBILITY_SLAB = 1 << 24


def tile_loop_ranges(
    causal: bool,
    qpos: jax.Array | None,
    kpos: jax.Array | None,
    qseg: jax.Array | None,
    kseg: jax.Array | None,
    batch: int,
    nq: int,
    nk: int,
    kv_len: int,
    bq: int,
    bk: int,
    window: int | None = None,
    *,
    over_queries: bool = False,
) -> jax.Array:
    """`loop_ranges` of `visibility`: int32 [b, nq/bq, 4] (each Q tile's loop over K tiles) or, over_queries
    (the dK/dV kernel), [b, nk/bk, 4] (each K tile's loop over Q tiles). Rows of tiles are done a slab at a
    time (`lax.map`) so that no more than VISIBILITY_SLAB tiles of the table exist at once."""
    qs, ks = _tile_stats(causal, qpos, kpos, qseg, kseg, batch, nq, nk, kv_len, bq, bk)
    rows, cols = (ks, qs) if over_queries else (qs, ks)

    def ranges(row_stats: dict[str, jax.Array]) -> jax.Array:
        if over_queries:
            vis, full = _visible_tiles(cols, row_stats, causal, window)
            return loop_ranges(jnp.swapaxes(vis, 1, 2), jnp.swapaxes(full, 1, 2))
        return loop_ranges(*_visible_tiles(row_stats, cols, causal, window))

    n_rows, n_cols = rows["index"].shape[1], cols["index"].shape[1]
    per_slab = max(1, VISIBILITY_SLAB // (batch * n_cols))
    if per_slab >= n_rows:
        return ranges(rows)
    slabs = -(-n_rows // per_slab)
    padded = {k: jnp.pad(v, ((0, 0), (0, slabs * per_slab - n_rows)), mode="edge") for k, v in rows.items()}
    stacked = {k: v.reshape(batch, slabs, per_slab).swapaxes(0, 1) for k, v in padded.items()}
    out = jax.lax.map(ranges, stacked)  # [slabs, b, per_slab, 4]
    return out.swapaxes(0, 1).reshape(batch, slabs * per_slab, 4)[:, :n_rows]


def loop_ranges(vis: jax.Array, full: jax.Array) -> jax.Array:
    """For each row of tiles (last axis = the loop axis): int32 [..., 4] = (lo, full_lo, full_hi, hi).

    Tiles outside [lo, hi) are skipped; [full_lo, full_hi) need no mask. When the fully visible tiles are
    not contiguous (unusual positions), full_lo = full_hi = lo and the whole range takes the masked path.
    """
    n = vis.shape[-1]

    def first_last(x: jax.Array):
        anyx = jnp.any(x, axis=-1)
        first = jnp.argmax(x, axis=-1)
        last = n - jnp.argmax(x[..., ::-1], axis=-1)
        return anyx, jnp.where(anyx, first, 0), jnp.where(anyx, last, 0)

    _, lo, hi = first_last(vis)
    any_f, flo, fhi = first_last(full)
    contiguous = any_f & (jnp.sum(full, axis=-1) == fhi - flo)
    flo = jnp.where(contiguous, flo, lo)
    fhi = jnp.where(contiguous, fhi, lo)
    return jnp.stack([lo, flo, fhi, hi], axis=-1).astype(jnp.int32)


def prepare(
    cfg: Config,
    tiles: dict[str, Tiles],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
) -> tuple[
    jax.Array,
    jax.Array,
    jax.Array,
    jax.Array | None,
    jax.Array | None,
    jax.Array | None,
    jax.Array | None,
    dict[str, int],
]:
    """Pads everything to kernel shapes; returns the padded arrays and the static layout."""
    b, q_len, hq, d = q.shape
    kv_len, hkv = k.shape[1], k.shape[2]
    d_pad = padded_head_dim(d)
    nq = round_up(q_len, max(t.block_q for t in tiles.values()))
    nk = round_up(kv_len, max(t.block_k for t in tiles.values()))
    if cfg.causal:
        qpos = jnp.arange(q_len, dtype=jnp.int32) if q_positions is None else q_positions
        kpos = jnp.arange(kv_len, dtype=jnp.int32) if kv_positions is None else kv_positions
        # Padded queries get the lowest position (they see nothing), padded keys the highest (never seen).
        qpos = as_batched(qpos, b, q_len, nq, INT_MIN)
        kpos = as_batched(kpos, b, kv_len, nk, INT_MAX)
    else:
        qpos = kpos = None
    qseg = as_batched(q_segment_ids, b, q_len, nq, 0)
    kseg = as_batched(kv_segment_ids, b, kv_len, nk, 0)
    layout = dict(batch=b, q_len=q_len, kv_len=kv_len, q_heads=hq, kv_heads=hkv, head_dim=d, d_pad=d_pad, nq=nq, nk=nk)
    return (
        pad_tokens(q, nq, d_pad),
        pad_tokens(k, nk, d_pad),
        pad_tokens(v, nk, d_pad),
        qpos,
        kpos,
        qseg,
        kseg,
        layout,
    )
