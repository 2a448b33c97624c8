"""The flash-attention Pallas kernels (Triton, GPU): forward, dK/dV and dQ, and their `pallas_call`s.

Algorithm (FlashAttention-2, https://arxiv.org/abs/2307.08691), on padded inputs (`flash_tiles.prepare`):
  forward   grid (q block, batch, q head): keep a Q tile in registers, stream K/V tiles, keep the running
            max m, the running sum l and the unnormalised accumulator (online softmax), write
            out = acc / l and lse = m + log l. The exponentials use exp2 on log2(e)-scaled scores (cheaper on
            GPUs); lse is converted back to the natural log before it is written.
  backward  recompute from (out, lse), FA2 style, as two kernels with no atomics: a dK/dV kernel, grid
            (k block, batch, kv head), holds one K/V tile and loops over the q blocks of every query head of
            its GQA group, so dK/dV of a shared head are summed in registers; a dQ kernel, grid (q block,
            batch, q head), holds one Q tile and loops over K/V tiles. Both recompute P = exp(S - lse):
            dV += P^T dO, dP = dO V^T, dS = P * (dP - delta), dQ += dS K * scale, dK += dS^T Q * scale.
Each kernel runs three loops over its row of tiles (masked, unmasked, masked; `flash_tiles.loop_ranges`):
tiles outside them are never loaded. A sliding window (cfg.window, with causal) narrows the ranges to the
band of tiles near the diagonal and adds `i - j < W` to the masked tiles' mask. fp32 inputs use full-precision (ieee) products, not tf32.

Inside `jax.shard_map` the compiled kernels work with check_vma=False and with check_vma=True: the inputs are
cast to a common set of varying mesh axes (`lax.pcast`) and the pallas_call outputs are declared with it.
The Pallas *interpreter* (jax 0.11.2, 0.12.1) cannot run under check_vma=True (it type-checks the kernel body without
vma), so "pallas_interpret" inside shard_map needs check_vma=False; it raises a clear error otherwise.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxring.core.vma import common_vma, varying_axes
from jaxring.kernels.flash_tiles import Config, Tiles, tile_loop_ranges

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

_CompilerParams = plgpu.CompilerParams


# ----------------------------------------------------------------------------------------------------------
# shard_map support: pallas_call outputs must state their varying mesh axes when check_vma=True
# ----------------------------------------------------------------------------------------------------------


def _check_interpretable(*xs: jax.Array | None, interpret: bool) -> None:
    """The Pallas interpreter (jax 0.11.2 and 0.12.1) cannot type-check varying mesh axes: inside a shard_map
    with check_vma=True it fails deep in a dynamic_slice; say so in one line instead."""
    axes = frozenset().union(*(varying_axes(x) for x in xs if x is not None))
    if axes and interpret:
        raise ValueError(
            f"implementation='pallas_interpret' inside jax.shard_map with check_vma=True (inputs vary over mesh "
            f"axes {sorted(axes)}) is not supported by the Pallas interpreter of jax {jax.__version__}; pass "
            f"check_vma=False to shard_map, or use 'pallas' (GPU) or 'jnp'"
        )


def _out_struct(shape: tuple[int, ...], dtype: jax.typing.DTypeLike, like: jax.Array):
    """ShapeDtypeStruct carrying `like`'s varying mesh axes (its `manual_axis_type`; None outside shard_map)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=getattr(jax.typeof(like), "manual_axis_type", None))


# ----------------------------------------------------------------------------------------------------------
# Kernel helpers
# ----------------------------------------------------------------------------------------------------------


def _dot_general(a: jax.Array, b: jax.Array, contract: tuple[tuple[int, ...], tuple[int, ...]]):
    # fp32 inputs: full-precision (ieee) products; Triton's default for fp32 would be tf32.
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _dot_nt(a: jax.Array, b: jax.Array):
    """a @ b.T with fp32 accumulation."""
    return _dot_general(a, b, ((1,), (1,)))


def _dot_tn(a: jax.Array, b: jax.Array):
    """a.T @ b with fp32 accumulation."""
    return _dot_general(a, b, ((0,), (0,)))


def _dot(a: jax.Array, b: jax.Array):
    """a @ b with fp32 accumulation."""
    return _dot_general(a, b, ((1,), (0,)))


def _tile_mask(
    causal: bool,
    kv_len: int | None,
    qpos: jax.Array | None,
    kpos: jax.Array | None,
    qseg: jax.Array | None,
    kseg: jax.Array | None,
    k_start: int | jax.Array,
    block_k: int,
    window: int | None = None,
):
    """Boolean [block_q, block_k] visibility of one tile (None: everything visible)."""
    mask = None

    def both(a: jax.Array | None, b: jax.Array):
        return b if a is None else a & b

    if causal:
        mask = both(mask, qpos[:, None] >= kpos[None, :])
        if window is not None:  # sliding window: i - W < j (no overflow where j <= i)
            mask = both(mask, qpos[:, None] - kpos[None, :] < window)
    if qseg is not None:
        mask = both(mask, (qseg[:, None] == kseg[None, :]) & (qseg[:, None] != 0))
    if kv_len is not None:  # only when keys were padded and nothing above masks them
        mask = both(mask, (k_start + jnp.arange(block_k))[None, :] < kv_len)
    return mask


def _three_loops(ranges_ref: jax.Ref, row: int | jax.Array, body: Callable[..., Any], carry: Any):
    """Runs body over tiles [lo, full_lo) masked, [full_lo, full_hi) unmasked, [full_hi, hi) masked."""
    lo, flo, fhi, hi = (ranges_ref[row, c] for c in range(4))
    carry = lax.fori_loop(lo, flo, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(flo, fhi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(fhi, hi, functools.partial(body, masked=True), carry)


def _load_rows_lse(lse_ref: jax.Ref, idx: slice | tuple):
    """lse (natural log) -> log2 domain; -inf rows (see nothing) -> 0 so exp2(-inf - 0) = 0, never NaN."""
    lse = lse_ref[idx]
    return jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)


# ----------------------------------------------------------------------------------------------------------
# Forward kernel
# ----------------------------------------------------------------------------------------------------------


def _fwd_kernel(
    ranges_ref: jax.Ref,
    q_ref: jax.Ref,
    k_ref: jax.Ref,
    v_ref: jax.Ref,
    qpos_ref: jax.Ref | None,
    kpos_ref: jax.Ref | None,
    qseg_ref: jax.Ref | None,
    kseg_ref: jax.Ref | None,
    o_ref: jax.Ref,
    lse_ref: jax.Ref,
    *,
    causal: bool,
    sm_scale: float,
    block_k: int,
    index_mask_len: int | None,
    window: int | None = None,
):
    """One (q block, batch, q head): out = softmax(q k^T * scale) v over the visible keys, and lse.

    q_ref [block_q, d]; k_ref, v_ref [nk, d] (the whole padded K/V of the shared head); positions and
    segment ids [block_q] / [nk]; ranges_ref [num_q_blocks, 4]; o_ref [block_q, d]; lse_ref [block_q].
    """
    i = pl.program_id(0)
    q = q_ref[...]
    block_q = q.shape[0]
    qpos = qpos_ref[...] if causal else None
    qseg = qseg_ref[...] if qseg_ref is not None else None
    qk_scale = sm_scale * LOG2E  # scores in log2 units: exp(x) = exp2(x * log2 e)

    def body(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array], *, masked: bool):
        acc, m_prev, l_prev = carry
        start = pl.multiple_of(j * block_k, block_k)
        keys = pl.ds(start, block_k)
        k = k_ref[keys, :]
        s = _dot_nt(q, k) * qk_scale  # S = Q K^T  [block_q, block_k]
        if masked:
            mask = _tile_mask(
                causal,
                index_mask_len,
                qpos,
                kpos_ref[keys] if causal else None,
                qseg,
                kseg_ref[keys] if qseg is not None else None,
                start,
                block_k,
                window,
            )
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))  # running row max
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet: no NaN
        alpha = jnp.exp2(m_prev - m_safe)  # rescales the old partial sums
        p = jnp.exp2(s - m_safe[:, None])  # P~ = exp(S - m)
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        v = v_ref[keys, :]
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)  # O~ = diag(alpha) O~ + P~ V
        return acc, m_new, l_new

    init = (
        jnp.zeros(o_ref.shape, jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, m, l = _three_loops(ranges_ref, i, body, init)

    empty = l == 0.0  # no visible key in the whole row
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)  # O = diag(l)^-1 O~
    lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)  # natural-log lse


def pallas_forward(
    cfg: Config,
    tiles: dict[str, Tiles],
    layout: dict[str, int],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    qpos: jax.Array | None,
    kpos: jax.Array | None,
    qseg: jax.Array | None,
    kseg: jax.Array | None,
    out_dtype: jax.typing.DTypeLike,
) -> list[jax.Array]:
    """Padded inputs -> out [b, nq, hq, d_pad] (out_dtype), lse [b, hq, nq] fp32."""
    t = tiles["fwd"]
    b, hq, hkv, nq, nk, d_pad = (layout[n] for n in ("batch", "q_heads", "kv_heads", "nq", "nk", "d_pad"))
    groups = hq // hkv
    ranges = tile_loop_ranges(
        cfg.causal, qpos, kpos, qseg, kseg, b, nq, nk, layout["kv_len"], t.block_q, t.block_k, cfg.window
    )  # [b, nq/bq, 4]
    _check_interpretable(q, k, v, qpos, kpos, qseg, kseg, interpret=cfg.implementation == "pallas_interpret")
    q, k, v, qpos, kpos, qseg, kseg, ranges = common_vma(q, k, v, qpos, kpos, qseg, kseg, ranges)
    nqb = nq // t.block_q
    seg = qseg is not None
    index_mask_len = layout["kv_len"] if nk > layout["kv_len"] and not (cfg.causal or seg) else None

    q_tile = pl.BlockSpec((None, t.block_q, None, d_pad), lambda i, bi, h: (bi, i, h, 0))
    kv_all = pl.BlockSpec((None, nk, None, d_pad), lambda i, bi, h: (bi, 0, lax.div(h, groups), 0))
    q_row = pl.BlockSpec((None, t.block_q), lambda i, bi, h: (bi, i))
    k_row = pl.BlockSpec((None, nk), lambda i, bi, h: (bi, 0))
    in_specs = [
        pl.BlockSpec((None, nqb, 4), lambda i, bi, h: (bi, 0, 0)),
        q_tile,
        kv_all,
        kv_all,
        q_row if cfg.causal else None,
        k_row if cfg.causal else None,
        q_row if seg else None,
        k_row if seg else None,
    ]
    out_specs = [q_tile, pl.BlockSpec((None, None, t.block_q), lambda i, bi, h: (bi, h, i))]
    out_shape = [_out_struct(q.shape, out_dtype, q), _out_struct((b, hq, nq), jnp.float32, q)]
    kernel = functools.partial(
        _fwd_kernel,
        causal=cfg.causal,
        sm_scale=cfg.sm_scale,
        block_k=t.block_k,
        index_mask_len=index_mask_len,
        window=cfg.window,
    )
    return pl.pallas_call(
        kernel,
        grid=(nqb, b, hq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=cfg.implementation == "pallas_interpret",
        name="jaxring_flash_fwd",
    )(ranges, q, k, v, qpos, kpos, qseg, kseg)


# ----------------------------------------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------------------------------------


def _dkv_kernel(
    ranges_ref: jax.Ref,
    q_ref: jax.Ref,
    k_ref: jax.Ref,
    v_ref: jax.Ref,
    do_ref: jax.Ref,
    lse_ref: jax.Ref,
    delta_ref: jax.Ref,
    qpos_ref: jax.Ref | None,
    kpos_ref: jax.Ref | None,
    qseg_ref: jax.Ref | None,
    kseg_ref: jax.Ref | None,
    dk_ref: jax.Ref,
    dv_ref: jax.Ref,
    *,
    causal: bool,
    sm_scale: float,
    block_q: int,
    groups: int,
    index_mask_len: int | None,
    window: int | None = None,
):
    """One (k block, batch, kv head): dK, dV summed over the q blocks of all `groups` query heads.

    k_ref, v_ref [block_k, d]; q_ref, do_ref [nq, groups, d] (the query heads sharing this K/V head);
    lse_ref, delta_ref [groups, nq]; ranges_ref [num_k_blocks, 4] (loop range over q blocks).
    """
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    block_k = k.shape[0]
    k_start = j * block_k
    kpos = kpos_ref[...] if causal else None
    kseg = kseg_ref[...] if kseg_ref is not None else None
    qk_scale = sm_scale * LOG2E

    def body(i: jax.Array, carry: tuple[jax.Array, jax.Array], *, head: int | jax.Array, masked: bool):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        q = q_ref[rows, head, :]
        do = do_ref[rows, head, :]
        s = _dot_nt(q, k) * qk_scale  # S [block_q, block_k], log2 units
        if masked:
            mask = _tile_mask(
                causal,
                index_mask_len,
                qpos_ref[rows] if causal else None,
                kpos,
                qseg_ref[rows] if kseg is not None else None,
                kseg,
                k_start,
                block_k,
                window,
            )
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp2(s - _load_rows_lse(lse_ref, (head, rows))[:, None])  # P = exp(S - lse)
        dv = dv + _dot_tn(p.astype(do.dtype), do)  # dV += P^T dO
        dp = _dot_nt(do, v)  # dP = dO V^T
        ds = p * (dp - delta_ref[head, rows][:, None])  # dS = P * (dP - delta)
        dk = dk + _dot_tn(ds.astype(q.dtype), q)  # dK += dS^T Q   (scale at the end)
        return dk, dv

    def one_head(head: int | jax.Array, carry: tuple[jax.Array, jax.Array]):
        return _three_loops(ranges_ref, j, functools.partial(body, head=head), carry)

    zeros = jnp.zeros(dk_ref.shape, jnp.float32)
    if groups == 1:
        dk, dv = one_head(0, (zeros, zeros))
    else:
        dk, dv = lax.fori_loop(0, groups, one_head, (zeros, zeros))
    dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
    ranges_ref: jax.Ref,
    q_ref: jax.Ref,
    k_ref: jax.Ref,
    v_ref: jax.Ref,
    do_ref: jax.Ref,
    lse_ref: jax.Ref,
    delta_ref: jax.Ref,
    qpos_ref: jax.Ref | None,
    kpos_ref: jax.Ref | None,
    qseg_ref: jax.Ref | None,
    kseg_ref: jax.Ref | None,
    dq_ref: jax.Ref,
    *,
    causal: bool,
    sm_scale: float,
    block_k: int,
    index_mask_len: int | None,
    window: int | None = None,
):
    """One (q block, batch, q head): dQ = scale * sum over K/V tiles of dS K.

    q_ref, do_ref [block_q, d]; k_ref, v_ref [nk, d]; lse_ref, delta_ref [block_q];
    ranges_ref [num_q_blocks, 4] (loop range over k blocks).
    """
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse = _load_rows_lse(lse_ref, slice(None))
    delta = delta_ref[...]
    qpos = qpos_ref[...] if causal else None
    qseg = qseg_ref[...] if qseg_ref is not None else None
    qk_scale = sm_scale * LOG2E

    def body(j: jax.Array, dq: jax.Array, *, masked: bool):
        start = pl.multiple_of(j * block_k, block_k)
        keys = pl.ds(start, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        s = _dot_nt(q, k) * qk_scale
        if masked:
            mask = _tile_mask(
                causal,
                index_mask_len,
                qpos,
                kpos_ref[keys] if causal else None,
                qseg,
                kseg_ref[keys] if qseg is not None else None,
                start,
                block_k,
                window,
            )
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp2(s - lse[:, None])  # P = exp(S - lse)
        dp = _dot_nt(do, v)  # dP = dO V^T
        ds = p * (dp - delta[:, None])  # dS = P * (dP - delta)
        return dq + _dot(ds.astype(k.dtype), k)  # dQ += dS K

    dq = _three_loops(ranges_ref, i, body, jnp.zeros(dq_ref.shape, jnp.float32))
    dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


def pallas_backward(
    cfg: Config,
    tiles: dict[str, Tiles],
    layout: dict[str, int],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    do: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    qpos: jax.Array | None,
    kpos: jax.Array | None,
    qseg: jax.Array | None,
    kseg: jax.Array | None,
    dtypes: Sequence[jax.typing.DTypeLike],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Padded inputs (lse, delta [b, hq, nq]) -> dq, dk, dv padded, in `dtypes`."""
    b, hq, hkv, nq, nk, d_pad = (layout[n] for n in ("batch", "q_heads", "kv_heads", "nq", "nk", "d_pad"))
    groups = hq // hkv
    seg = qseg is not None
    interpret = cfg.implementation == "pallas_interpret"
    index_mask_len = layout["kv_len"] if nk > layout["kv_len"] and not (cfg.causal or seg) else None
    _check_interpretable(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, interpret=interpret)
    (q, k, v, do, lse, delta, qpos, kpos, qseg, kseg) = common_vma(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg)

    # dK/dV: grid over (k block, batch, kv head); loops over q blocks of the group's query heads.
    t = tiles["dkv"]
    ranges = tile_loop_ranges(
        cfg.causal,
        qpos,
        kpos,
        qseg,
        kseg,
        b,
        nq,
        nk,
        layout["kv_len"],
        t.block_q,
        t.block_k,
        cfg.window,
        over_queries=True,
    )  # [b, nk/bk, 4]
    (ranges,) = common_vma(ranges, q)[:1]
    nkb = nk // t.block_k
    k_tile = pl.BlockSpec((None, t.block_k, None, d_pad), lambda j, bi, h: (bi, j, h, 0))
    q_group = pl.BlockSpec((None, nq, groups, d_pad), lambda j, bi, h: (bi, 0, h, 0))
    row_group = pl.BlockSpec((None, groups, nq), lambda j, bi, h: (bi, h, 0))
    q_row = pl.BlockSpec((None, nq), lambda j, bi, h: (bi, 0))
    k_row = pl.BlockSpec((None, t.block_k), lambda j, bi, h: (bi, j))
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkv_kernel,
            causal=cfg.causal,
            sm_scale=cfg.sm_scale,
            block_q=t.block_q,
            groups=groups,
            index_mask_len=index_mask_len,
            window=cfg.window,
        ),
        grid=(nkb, b, hkv),
        in_specs=[
            pl.BlockSpec((None, nkb, 4), lambda j, bi, h: (bi, 0, 0)),
            q_group,
            k_tile,
            k_tile,
            q_group,
            row_group,
            row_group,
            q_row if cfg.causal else None,
            k_row if cfg.causal else None,
            q_row if seg else None,
            k_row if seg else None,
        ],
        out_specs=[k_tile, k_tile],
        out_shape=[_out_struct(k.shape, dtypes[1], q), _out_struct(v.shape, dtypes[2], q)],
        compiler_params=_CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name="jaxring_flash_dkv",
    )(ranges, q, k, v, do, lse, delta, qpos, kpos, qseg, kseg)

    # dQ: grid over (q block, batch, q head); loops over k blocks.
    t = tiles["dq"]
    ranges = tile_loop_ranges(
        cfg.causal, qpos, kpos, qseg, kseg, b, nq, nk, layout["kv_len"], t.block_q, t.block_k, cfg.window
    )
    (ranges,) = common_vma(ranges, q)[:1]
    nqb = nq // t.block_q
    q_tile = pl.BlockSpec((None, t.block_q, None, d_pad), lambda i, bi, h: (bi, i, h, 0))
    kv_all = pl.BlockSpec((None, nk, None, d_pad), lambda i, bi, h: (bi, 0, lax.div(h, groups), 0))
    row_tile = pl.BlockSpec((None, None, t.block_q), lambda i, bi, h: (bi, h, i))
    q_row = pl.BlockSpec((None, t.block_q), lambda i, bi, h: (bi, i))
    k_row = pl.BlockSpec((None, nk), lambda i, bi, h: (bi, 0))
    dq = pl.pallas_call(
        functools.partial(
            _dq_kernel,
            causal=cfg.causal,
            sm_scale=cfg.sm_scale,
            block_k=t.block_k,
            index_mask_len=index_mask_len,
            window=cfg.window,
        ),
        grid=(nqb, b, hq),
        in_specs=[
            pl.BlockSpec((None, nqb, 4), lambda i, bi, h: (bi, 0, 0)),
            q_tile,
            kv_all,
            kv_all,
            q_tile,
            row_tile,
            row_tile,
            q_row if cfg.causal else None,
            k_row if cfg.causal else None,
            q_row if seg else None,
            k_row if seg else None,
        ],
        out_specs=q_tile,
        out_shape=_out_struct(q.shape, dtypes[0], q),
        compiler_params=_CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name="jaxring_flash_dq",
    )(ranges, q, k, v, do, lse, delta, qpos, kpos, qseg, kseg)
    return dq, dk, dv
