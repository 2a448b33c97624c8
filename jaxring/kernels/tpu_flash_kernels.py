"""jaxring's flash-attention kernels for TPU (Pallas Mosaic): forward, dQ and dK/dV, masked by positions.

Why a kernel of our own and not JAX's splash attention: splash's masks are static objects, chosen when the
kernel is built, so a ring step's block — its offset known only at run time (zig-zag's shifted causal halves,
a window reaching across blocks, documents crossing block boundaries) — would need a `lax.switch` over mask
classes with a jnp fallback for the rest, as the cuDNN block compute has. These kernels read the query and key
*positions* and segment ids, like the GPU kernels (`flash_kernels.py`), so one kernel serves every block of
every layout, and the tiles a block's mask hides are skipped from a table of tile ranges.

Layout (heads-major, so each grid step holds a [tile, d] slab; the caller transposes):
  q, dO, out  [b, hq, nq, d]      k, v, dK, dV  [b, hkv, nk, d]      (hkv divides hq: GQA, K/V not repeated)
  lse, delta  [b, hq, 1, nq] fp32 (a row per tile: TPU lanes)
  q_pos, q_seg    [1 or b, nq, 128] int32  (a query's position or segment id along the 128 lanes)
  kv_pos, kv_seg  [1 or b, 8, nk] int32    (a key's position or segment id along the 8 sublanes)
                  (positions are shared by the batch: [1, ...]; segment ids [b, ...])
  ranges      int32 [b * rows * 4] in SMEM (scalar prefetch): each row of tiles' (lo, full_lo, full_hi, hi),
              from `flash_tiles.tile_loop_ranges` (rows = Q tiles for forward and dQ, K tiles for dK/dV)

Algorithm (FlashAttention-2, https://arxiv.org/abs/2307.08691), on a grid whose last axis walks the loop:
  forward  grid (b, hq, Q tile i, K tile j):  S = scale Q_i K_jᵀ (masked where the range says so);
           online softmax into VMEM scratch m, l [tq, 128] and acc [tq, d]; at the last j:
           out = acc / l, lse = m + log l (rows that see nothing: out 0, lse -inf)
  dQ       grid (b, hq, Q tile i, K tile j):  P = exp(S - lse); dS = P (dO V_jᵀ - delta); dQ_i += scale dS K_j
  dK/dV    grid (b, hkv, K tile j, t = (head in group, Q tile)): dV_j += Pᵀ dO_i; dK_j += scale dSᵀ Q_i
           (the group's query heads are summed in VMEM: no atomics, no repeated K/V)
A tile outside [lo, hi) does no work and its block index is clamped into the range, so the pipeline fetches
nothing new for it; tiles in [full_lo, full_hi) skip the mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxring.core.vma import common_vma, varying_axes

LANES, SUBLANES = 128, 8
Ref = jax.Ref
Index = jax.Array  # a grid index inside an index map or kernel
RANGE_FIELDS = 4  # lo, full_lo, full_hi, hi


def _out_struct(shape: tuple[int, ...], dtype: jax.typing.DTypeLike, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A pallas_call output typed with `like`'s varying mesh axes (inside shard_map with check_vma=True)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=getattr(jax.typeof(like), "manual_axis_type", None))


def _interpreter(interpret: bool, *xs: jax.Array | None) -> bool | pltpu.InterpretParams:
    """pallas_call's `interpret`: False (Mosaic), else Pallas' TPU interpret mode where the inputs vary over mesh
    axes (inside shard_map with check_vma: the HLO interpreter cannot type it), else the HLO interpreter (no
    effects, so it also runs under jax.checkpoint's AD, and no barrier across devices)."""
    if not interpret:
        return False
    axes = frozenset().union(*(varying_axes(x) for x in xs if x is not None))
    return pltpu.InterpretParams() if axes else True


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """a·b contracting a's axis contract[0] with b's contract[1], fp32 accumulation (full precision for fp32)."""
    # explicit both ways: Mosaic refuses a bf16 matmul at HIGHEST, which jax_default_matmul_precision may ask for
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _range(ranges_ref: jax.Ref, row: jax.Array) -> tuple[jax.Array, ...]:
    """(lo, full_lo, full_hi, hi) of a row of tiles from the flattened SMEM table."""
    return tuple(ranges_ref[row * RANGE_FIELDS + f] for f in range(RANGE_FIELDS))


def _clamped(step: jax.Array, ranges_ref: jax.Ref, row: jax.Array, last: int) -> jax.Array:
    """The tile a grid step fetches: `step` inside the row's range, else the nearest end (fetched already)."""
    lo, _, _, hi = _range(ranges_ref, row)
    return jnp.clip(step, jnp.minimum(lo, last), jnp.clip(hi - 1, 0, last))


def _mask(
    q_info: tuple[jax.Ref | None, jax.Ref | None],
    kv_info: tuple[jax.Ref | None, jax.Ref | None],
    shape: tuple[int, int],
    *,
    causal: bool,
    window: int | None,
) -> jax.Array | None:
    """bool [tq, tk]: the visible (query, key) pairs of a tile (None: all), from positions and segment ids."""
    tk = shape[1]

    def rows(ref: jax.Ref) -> jax.Array:  # [tq, 128] lanes -> [tq, tk]
        return jnp.tile(ref[...], (1, tk // LANES)) if tk % LANES == 0 else jnp.broadcast_to(ref[:, :1], shape)

    def cols(ref: jax.Ref) -> jax.Array:  # [8, tk] sublanes -> [tq, tk]
        return jnp.broadcast_to(ref[:1, :], shape)

    (q_pos, q_seg), (kv_pos, kv_seg) = q_info, kv_info
    mask = None
    if causal:
        qp, kp = rows(q_pos), cols(kv_pos)
        mask = qp >= kp
        if window is not None:  # sliding window: q - W < k (no overflow where k <= q)
            mask &= qp - kp < window
    if q_seg is not None:
        qs, ks = rows(q_seg), cols(kv_seg)
        same = (qs == ks) & (qs != 0)
        mask = same if mask is None else mask & same
    return mask


def _in_range(ranges_ref: jax.Ref, row: jax.Array, step: jax.Array, body: Callable[..., None]) -> None:
    """Runs body(masked) for a step inside its row's range: masked outside [full_lo, full_hi)."""
    lo, flo, fhi, hi = _range(ranges_ref, row)
    inside = (step >= lo) & (step < hi)
    unmasked = (step >= flo) & (step < fhi)
    pl.when(inside & unmasked)(functools.partial(body, masked=False))
    pl.when(inside & ~unmasked)(functools.partial(body, masked=True))


def _split_refs(refs: list, has: tuple[bool, ...]) -> list:
    """refs for the optional inputs in `has` order: the next ref where present, None where absent."""
    it = iter(refs)
    return [next(it) if h else None for h in has]


# ------------------------------------------------------------------------------------------------ forward


def _fwd_kernel(
    ranges_ref: Ref, *refs: Ref, has: tuple[bool, ...], causal: bool, window: int | None, sm_scale: float, n_rows: int
) -> None:
    q_ref, k_ref, v_ref = refs[:3]
    q_pos, q_seg, kv_pos, kv_seg = _split_refs(refs[3:], has)
    out_ref, lse_ref, m_scr, l_scr, acc_scr = refs[3 + sum(has) :]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    tq, tk = q_ref.shape[0], k_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def step(masked: bool):
        s = _dot(q_ref[...], k_ref[...], (1, 1)) * sm_scale  # [tq, tk]
        mask = _mask((q_pos, q_seg), (kv_pos, kv_seg), (tq, tk), causal=causal, window=window) if masked else None
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        m_prev = m_scr[...]  # [tq, 128], every lane the same
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows with no key yet: no NaN
        p = jnp.exp(s - m_safe[:, :1])
        alpha = jnp.exp(m_prev - m_safe)
        l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=-1, keepdims=True)
        m_scr[...] = m_next
        v = v_ref[...]
        acc_scr[...] = alpha[:, :1] * acc_scr[...] + _dot(p.astype(v.dtype), v, (1, 0))

    _in_range(ranges_ref, b * n_rows + i, j, step)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        l = l_scr[...]
        empty = l == 0.0
        out_ref[...] = (acc_scr[...] / jnp.where(empty, 1.0, l)[:, :1]).astype(out_ref.dtype)
        lse = jnp.where(empty, -jnp.inf, m_scr[...] + jnp.log(jnp.where(empty, 1.0, l)))  # [tq, 128]
        lse_ref[...] = jnp.transpose(lse)[:1, :]  # -> a row [1, tq]


def _info_specs(
    has: tuple[bool, ...], tq: int, tk: int, q_tile: Callable[..., Index], kv_tile: Callable[..., Index]
) -> list:
    """BlockSpecs of the optional inputs q_pos, q_seg, kv_pos, kv_seg, given the index maps q_tile(*grid) and
    kv_tile(*grid) of the Q and K tile a grid step reads; positions ([1, ...]) are shared by the batch."""

    def q_spec(batched: bool):
        return pl.BlockSpec((None, tq, LANES), lambda *g: (g[0] if batched else 0, q_tile(*g), 0))

    def kv_spec(batched: bool):
        return pl.BlockSpec((None, SUBLANES, tk), lambda *g: (g[0] if batched else 0, 0, kv_tile(*g)))

    specs = (q_spec(False), q_spec(True), kv_spec(False), kv_spec(True))
    return [spec for spec, h in zip(specs, has) if h]


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    info: tuple[jax.Array | None, ...],
    ranges: jax.Array,
    *,
    tiles: tuple[int, int],
    causal: bool,
    window: int | None,
    sm_scale: float,
    out_dtype: jax.typing.DTypeLike,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """Heads-major q [b, hq, nq, d], k/v [b, hkv, nk, d], info = (q_pos, q_seg, kv_pos, kv_seg) in the module's
    lane layouts (None: absent), ranges [b, nq/tq, 4] -> out [b, hq, nq, d] (out_dtype), lse [b, hq, 1, nq]."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = hq // hkv
    tq, tk = tiles
    n_rows, n_cols = nq // tq, nk // tk
    has = tuple(x is not None for x in info)
    q, k, v, ranges, info = common_vma(q, k, v, ranges, info)

    def kv_index(bi: Index, h: Index, i: Index, j: Index, r: Ref) -> tuple:
        return bi, h // g, _clamped(j, r, bi * n_rows + i, n_cols - 1), 0

    in_specs = [
        pl.BlockSpec((None, None, tq, d), lambda bi, h, i, j, r: (bi, h, i, 0)),
        pl.BlockSpec((None, None, tk, d), kv_index),
        pl.BlockSpec((None, None, tk, d), kv_index),
        *_info_specs(has, tq, tk, lambda bi, h, i, j, r: i, lambda bi, h, i, j, r: kv_index(bi, h, i, j, r)[2]),
    ]
    out_specs = [
        pl.BlockSpec((None, None, tq, d), lambda bi, h, i, j, r: (bi, h, i, 0)),
        pl.BlockSpec((None, None, 1, tq), lambda bi, h, i, j, r: (bi, h, 0, i)),
    ]
    kernel = functools.partial(_fwd_kernel, has=has, causal=causal, window=window, sm_scale=sm_scale, n_rows=n_rows)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hq, n_rows, n_cols),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((tq, LANES), jnp.float32),
                pltpu.VMEM((tq, LANES), jnp.float32),
                pltpu.VMEM((tq, d), jnp.float32),
            ],
        ),
        out_shape=[_out_struct(q.shape, out_dtype, q), _out_struct((b, hq, 1, nq), jnp.float32, q)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_interpreter(interpret, q),
        name="jaxring_tpu_flash_fwd",
    )(ranges.reshape(-1), q, k, v, *(x for x in info if x is not None))


# ------------------------------------------------------------------------------------------------ backward


def _probabilities(
    q: jax.Array,
    k: jax.Array,
    lse_row: jax.Array,
    masks: Callable[[], jax.Array | None],
    *,
    masked: bool,
    sm_scale: float,
) -> jax.Array:
    """P = exp(scale Q Kᵀ - lse) [tq, tk] (0 where masked or where the row sees nothing)."""
    s = _dot(q, k, (1, 1)) * sm_scale
    mask = masks() if masked else None
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    lse = _column(lse_row)
    return jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse))


def _column(row: jax.Array) -> jax.Array:
    """A [1, t] row as a [t, 1] column (through an [8, t] -> [t, 8] transpose, TPU's tile)."""
    return jnp.transpose(jnp.broadcast_to(row, (SUBLANES, row.shape[-1])))[:, :1]


def _dq_kernel(
    ranges_ref: Ref, *refs: Ref, has: tuple[bool, ...], causal: bool, window: int | None, sm_scale: float, n_rows: int
) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    q_pos, q_seg, kv_pos, kv_seg = _split_refs(refs[6:], has)
    dq_ref, dq_scr = refs[6 + sum(has) :]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    tq, tk = q_ref.shape[0], k_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def step(masked: bool):
        k, v = k_ref[...], v_ref[...]
        masks = lambda: _mask((q_pos, q_seg), (kv_pos, kv_seg), (tq, tk), causal=causal, window=window)
        p = _probabilities(q_ref[...], k, lse_ref[...], masks, masked=masked, sm_scale=sm_scale)
        dp = _dot(do_ref[...], v, (1, 1))
        ds = p * (dp - _column(delta_ref[...]))
        dq_scr[...] += _dot(ds.astype(k.dtype), k, (1, 0)) * sm_scale

    _in_range(ranges_ref, b * n_rows + i, j, step)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = dq_scr[...].astype(dq_ref.dtype)


def _dkv_kernel(
    ranges_ref: Ref,
    *refs: Ref,
    has: tuple[bool, ...],
    causal: bool,
    window: int | None,
    sm_scale: float,
    n_rows: int,
    n_q_tiles: int,
) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    q_pos, q_seg, kv_pos, kv_seg = _split_refs(refs[6:], has)
    dk_ref, dv_ref, dk_scr, dv_scr = refs[6 + sum(has) :]
    b, j, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    tq, tk = q_ref.shape[0], k_ref.shape[0]

    @pl.when(t == 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def step(masked: bool):
        q, do = q_ref[...], do_ref[...]
        masks = lambda: _mask((q_pos, q_seg), (kv_pos, kv_seg), (tq, tk), causal=causal, window=window)
        p = _probabilities(q, k_ref[...], lse_ref[...], masks, masked=masked, sm_scale=sm_scale)
        dv_scr[...] += _dot(p.astype(do.dtype), do, (0, 0))
        dp = _dot(do, v_ref[...], (1, 1))
        ds = p * (dp - _column(delta_ref[...]))
        dk_scr[...] += _dot(ds.astype(q.dtype), q, (0, 0)) * sm_scale

    _in_range(ranges_ref, b * n_rows + j, t % n_q_tiles, step)

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    info: tuple[jax.Array | None, ...],
    q_ranges: jax.Array,
    kv_ranges: jax.Array,
    *,
    tiles: tuple[int, int],
    causal: bool,
    window: int | None,
    sm_scale: float,
    out_dtype: jax.typing.DTypeLike,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Heads-major q, dout [b, hq, nq, d], k/v [b, hkv, nk, d], the global lse and delta [b, hq, 1, nq] fp32,
    info as `forward`'s, q_ranges [b, nq/tq, 4] (K tiles per Q tile), kv_ranges [b, nk/tk, 4] (Q tiles per K
    tile) -> dq [b, hq, nq, d], dk, dv [b, hkv, nk, d], in out_dtype."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = hq // hkv
    tq, tk = tiles
    nqt, nkt = nq // tq, nk // tk
    has = tuple(x is not None for x in info)
    q, k, v, dout, lse, delta, q_ranges, kv_ranges, info = common_vma(
        q, k, v, dout, lse, delta, q_ranges, kv_ranges, info
    )
    params = dict(has=has, causal=causal, window=window, sm_scale=sm_scale)
    mosaic = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    interpret_params = _interpreter(interpret, q)
    extra = [x for x in info if x is not None]

    # dQ: grid (b, hq, Q tile, K tile)
    def kv_index(bi: Index, h: Index, i: Index, j: Index, r: Ref) -> tuple:
        return bi, h // g, _clamped(j, r, bi * nqt + i, nkt - 1), 0

    q_spec = pl.BlockSpec((None, None, tq, d), lambda bi, h, i, j, r: (bi, h, i, 0))
    row_spec = pl.BlockSpec((None, None, 1, tq), lambda bi, h, i, j, r: (bi, h, 0, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, n_rows=nqt, **params),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hq, nqt, nkt),
            in_specs=[
                q_spec,
                pl.BlockSpec((None, None, tk, d), kv_index),
                pl.BlockSpec((None, None, tk, d), kv_index),
                q_spec,
                row_spec,
                row_spec,
                *_info_specs(has, tq, tk, lambda bi, h, i, j, r: i, lambda bi, h, i, j, r: kv_index(bi, h, i, j, r)[2]),
            ],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((tq, d), jnp.float32)],
        ),
        out_shape=_out_struct(q.shape, out_dtype, q),
        compiler_params=mosaic,
        interpret=interpret_params,
        name="jaxring_tpu_flash_dq",
    )(q_ranges.reshape(-1), q, k, v, dout, lse, delta, *extra)

    # dK/dV: grid (b, hkv, K tile, (query head in the group, Q tile))
    def q_tile(bi: Index, hk: Index, j: Index, t: Index, r: Ref) -> Index:
        return _clamped(t % nqt, r, bi * nkt + j, nqt - 1)

    def q_index(bi: Index, hk: Index, j: Index, t: Index, r: Ref) -> tuple:
        return bi, hk * g + t // nqt, q_tile(bi, hk, j, t, r), 0

    def row_index(bi: Index, hk: Index, j: Index, t: Index, r: Ref) -> tuple:
        return bi, hk * g + t // nqt, 0, q_tile(bi, hk, j, t, r)

    kv_spec = pl.BlockSpec((None, None, tk, d), lambda bi, hk, j, t, r: (bi, hk, j, 0))
    q_tiled = pl.BlockSpec((None, None, tq, d), q_index)
    rows = pl.BlockSpec((None, None, 1, tq), row_index)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, n_rows=nkt, n_q_tiles=nqt, **params),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, nkt, g * nqt),
            in_specs=[
                q_tiled,
                kv_spec,
                kv_spec,
                q_tiled,
                rows,
                rows,
                *_info_specs(has, tq, tk, q_tile, lambda bi, hk, j, t, r: j),
            ],
            out_specs=[kv_spec, kv_spec],
            scratch_shapes=[pltpu.VMEM((tk, d), jnp.float32), pltpu.VMEM((tk, d), jnp.float32)],
        ),
        out_shape=[_out_struct(k.shape, out_dtype, q), _out_struct(v.shape, out_dtype, q)],
        compiler_params=mosaic,
        interpret=interpret_params,
        name="jaxring_tpu_flash_dkv",
    )(kv_ranges.reshape(-1), q, k, v, dout, lse, delta, *extra)
    return dq, dk, dv
