"""tokamax's Mosaic GPU flash attention as a `BlockOps` pair: a block's visibility as one key range per query.

tokamax's attention op (the optional `tokamax` package, 0.0.17; its calls in `compat.py`, their contract in
`tokamax_contract.py`) masks by key *index* with a range per query row, k_start <= j < k_end, and its sm90
kernels skip the K/V tiles outside a Q tile's ranges. Positions in ascending order map onto it exactly: when
a block's K/V positions ascend (every ring layout's K/V block does: contiguous, zig-zag's two runs, striped),
the keys query position p sees are one index range,

  causal:    j < k_end   = #{keys at positions <= p}          (searchsorted(kv_pos, p, "right"))
  window W:  j >= k_start = #{keys at positions <= p - W}     (keys p - W < position <= p)

so one call covers any causal or windowed block with ascending K/V positions, whatever the Q positions: no
chunk pairs, no SHIFTED class (cuDNN's index masks need them, `cudnn_blocks.py`). Each block is classified at
run time by cuDNN's classification (`cudnn_blocks.classify`) and `lax.switch` picks a call:

  SKIP        causal (and window) hide every pair          -> nothing (out 0, lse -inf)
  WHOLE       every pair visible                           -> tokamax, no mask
  RANGES      any other block whose K/V positions ascend   -> tokamax with the key ranges
  FALLBACK    K/V positions out of order                   -> the fallback BlockOps (Pallas on GPU, jnp on CPU)

Statically to the fallback: segment ids (packed documents, padding), dtypes tokamax's backward does not take
(fp32 for "tokamax": it takes bf16/f16), head dims above 256 or not a multiple of 8.

Forward: tokamax returns (out, (max, sum)); lse = max + log(sum). A row whose range is empty is written here
as out 0, lse -inf, whatever the kernel leaves there. Backward: the Mosaic backward reads P = exp(s - max) /
sum and D = rowsum(O ∘ dO) from what it is given, so the global lse enters as (max, sum) = (lse, 1) (-inf
rows as +inf: P = 0) and delta as a stand-in output O' in fp32 with one nonzero entry per row, on dO's
largest |entry| m: O'_m = delta / dO_m, so rowsum(O' ∘ dO) = delta to fp32 rounding (one term, not cuDNN's
two: O' is not rounded to the inputs' dtype). A row with dO = 0 gets D = 0 (an lse cotangent alone is lost,
as with cuDNN). dO is rounded to the inputs' dtype first (the kernel takes it so); dq/dk/dv come back in the
inputs' dtype, each block's rounded once before a ring sums them in fp32. GQA: K/V keep their own heads.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.core import compat
from jaxring.kernels import tokamax_contract
from jaxring.kernels.blockwise import BlockOps, in_callers_dtype
from jaxring.kernels.cudnn_blocks import SKIP, WHOLE, classify, varying_all

Array = jax.Array
RANGES, FALLBACK = 2, 3  # after SKIP 0 and WHOLE 1
CLASS_NAMES = ("skip", "whole", "ranges", "fallback")
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256  # as cuDNN's; tokamax pads the head dim to its swizzle itself (only d = 128 compiled here)


@dataclasses.dataclass(frozen=True)
class TokamaxCalls:
    """A forward/backward pair with tokamax's call contract (`tokamax_contract.py`), and the dtypes it takes."""

    name: str
    forward: Callable
    backward: Callable
    dtypes: tuple[jnp.dtype, ...]


def _mosaic_forward(q: Array, k: Array, v: Array, **kw: object) -> tuple[Array, Array, Array]:
    return compat.tokamax_attention_forward(compat.tokamax_mosaic_attention(), q, k, v, **kw)


def _mosaic_backward(*operands: Array, **kw: object) -> tuple[Array, Array, Array]:
    return compat.tokamax_attention_backward(compat.tokamax_mosaic_attention(), *operands, **kw)


def _xla_forward(q: Array, k: Array, v: Array, **kw: object) -> tuple[Array, Array, Array]:
    return compat.tokamax_attention_forward(compat.tokamax_xla_attention(), q, k, v, **kw)


MOSAIC_CALLS = TokamaxCalls("tokamax", _mosaic_forward, _mosaic_backward, HALF_DTYPES)
# CPU: tokamax's own XLA forward (same residuals) and the jnp stand-in of the Mosaic backward (tokamax's XLA
# backward recomputes the softmax, so it cannot take a global lse); fp32 too, so tests compare tightly
REFERENCE_CALLS = TokamaxCalls(
    "tokamax_reference", _xla_forward, tokamax_contract.backward, (*HALF_DTYPES, jnp.dtype(jnp.float32))
)


# ------------------------------------------------------------------------------------------ classification


def key_ranges(
    q_pos: Array, kv_pos: Array, *, causal: bool, window: int | None = None
) -> tuple[Array | None, Array | None]:
    """(k_start, k_end) int32 [nq] (None: no bound): the keys each query sees, valid when kv_pos ascends."""
    if not causal:
        return None, None
    q_pos, kv_pos = q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32)
    k_end = jnp.searchsorted(kv_pos, q_pos, side="right").astype(jnp.int32)
    if window is None:
        return None, k_end
    return jnp.searchsorted(kv_pos, q_pos - window, side="right").astype(jnp.int32), k_end


def block_class(q_pos: Array, kv_pos: Array, *, causal: bool, window: int | None = None) -> Array:
    """int32 scalar: SKIP, WHOLE, RANGES or FALLBACK (module docstring) of a (Q positions, K/V positions) pair."""
    cls = classify(q_pos, kv_pos, causal=causal, window=window)
    ascending = jnp.all(kv_pos[1:] >= kv_pos[:-1])
    ranged = jnp.where(ascending, RANGES, FALLBACK)
    return jnp.where((cls == SKIP) | (cls == WHOLE), cls, ranged).astype(jnp.int32)


def supported(
    calls: TokamaxCalls, q: Array, k: Array, q_segment_ids: Array | None, kv_segment_ids: Array | None
) -> bool:
    """Static: whether tokamax may take this block at all (else the fallback does all of it)."""
    d = q.shape[-1]
    return (
        q_segment_ids is None
        and kv_segment_ids is None
        and jnp.dtype(q.dtype) in calls.dtypes
        and q.dtype == k.dtype
        and d <= MAX_HEAD_DIM
        and d % 8 == 0
    )


# ------------------------------------------------------------------------------------------------ calls


def _as_rows(r: Array | None) -> Array | None:
    """A key bound [nq] as tokamax's mask operand [1, 1, nq] (batch and heads broadcast)."""
    return None if r is None else r[None, None, :]


def _empty_rows(k_start: Array | None, k_end: Array | None, nq: int) -> Array:
    """bool [nq]: the rows whose key range is empty."""
    lo = jnp.zeros(nq, jnp.int32) if k_start is None else k_start
    return jnp.zeros(nq, bool) if k_end is None else k_end <= lo


def _call_forward(
    calls: TokamaxCalls, q: Array, k: Array, v: Array, k_start: Array | None, k_end: Array | None, *, sm_scale: float
) -> tuple[Array, Array]:
    """One tokamax forward -> out fp32 [b, nq, hq, d], lse fp32 [b, nq, hq] (empty rows: 0, -inf)."""
    out, m, s = calls.forward(q, k, v, k_start=_as_rows(k_start), k_end=_as_rows(k_end), sm_scale=sm_scale)
    lse = jnp.swapaxes(m + jnp.log(s), 1, 2).astype(jnp.float32)  # [b, hq, nq] -> [b, nq, hq]
    empty = _empty_rows(k_start, k_end, q.shape[1])[None, :, None]
    out = jnp.where(empty[..., None], 0.0, out.astype(jnp.float32))
    return out, jnp.where(empty, -jnp.inf, lse)


def delta_output(dout: Array, delta: Array) -> Array:
    """O' fp32 [b, n, h, d] with rowsum(O' ∘ dout) = delta [b, n, h]: delta / dout_m on dout's largest |entry|."""
    do = dout.astype(jnp.float32)
    first = jnp.argmax(jnp.abs(do), axis=-1)
    d1 = jnp.take_along_axis(do, first[..., None], axis=-1)[..., 0]
    a = jnp.where(d1 == 0.0, 0.0, delta / jnp.where(d1 == 0.0, 1.0, d1))
    return jax.nn.one_hot(first, do.shape[-1], dtype=jnp.float32) * a[..., None]


def _call_backward(
    calls: TokamaxCalls,
    q: Array,
    k: Array,
    v: Array,
    dout: Array,
    lse: Array,
    delta: Array,
    k_start: Array | None,
    k_end: Array | None,
    *,
    sm_scale: float,
) -> tuple[Array, Array, Array]:
    """One tokamax backward given the global lse [b, nq, hq] and delta -> fp32 dq, dk, dv."""
    m = jnp.swapaxes(jnp.where(jnp.isneginf(lse), jnp.inf, lse), 1, 2).astype(jnp.float32)
    do = dout.astype(q.dtype)
    o = delta_output(do, delta.astype(jnp.float32))
    grads = calls.backward(
        m, jnp.ones_like(m), o, do, q, k, v, k_start=_as_rows(k_start), k_end=_as_rows(k_end), sm_scale=sm_scale
    )
    return tuple(g.astype(jnp.float32) for g in grads)


def _window_kw(window: int | None) -> dict:
    return {} if window is None else {"window": window}


# ------------------------------------------------------------------------------------------------ blocks


def _forward_fp32(
    calls: TokamaxCalls, fallback: BlockOps, q: Array, k: Array, v: Array, q_positions: Array, kv_positions: Array,
    q_segment_ids: Array | None = None, kv_segment_ids: Array | None = None,
    *, causal: bool, sm_scale: float, window: int | None = None,
) -> tuple[Array, Array]:  # fmt: skip
    """BlockOps forward (blockwise.py's interface) through tokamax, out in fp32: out [b, nq, hq, d], lse fp32 [b, nq, hq]."""
    kw = dict(causal=causal, sm_scale=sm_scale, **_window_kw(window))
    pos = (q_positions, kv_positions)
    if not supported(calls, q, k, q_segment_ids, kv_segment_ids):
        return fallback.forward(q, k, v, *pos, q_segment_ids, kv_segment_ids, **kw)
    k_start, k_end = key_ranges(*pos, causal=causal, window=window)

    def skip():
        return jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)

    branches = (
        skip,
        lambda: _call_forward(calls, q, k, v, None, None, sm_scale=sm_scale),
        lambda: _call_forward(calls, q, k, v, k_start, k_end, sm_scale=sm_scale),
        lambda: fallback.forward(q, k, v, *pos, None, None, **kw),
    )
    inputs = (q, k, v, *pos)
    cls = block_class(*pos, causal=causal, window=window)
    return lax.switch(cls, [lambda b=b: varying_all(inputs, b()) for b in branches])


def _backward_fp32(
    calls: TokamaxCalls, fallback: BlockOps, q: Array, k: Array, v: Array, dout: Array, lse: Array, delta: Array,
    q_positions: Array, kv_positions: Array, q_segment_ids: Array | None = None, kv_segment_ids: Array | None = None,
    *, causal: bool, sm_scale: float, window: int | None = None,
) -> tuple[Array, Array, Array]:  # fmt: skip
    """BlockOps backward through tokamax given the global lse and delta: fp32 dq, dk, dv."""
    kw = dict(causal=causal, sm_scale=sm_scale, **_window_kw(window))
    args, pos = (q, k, v, dout, lse, delta), (q_positions, kv_positions)
    if not supported(calls, q, k, q_segment_ids, kv_segment_ids):
        return fallback.backward(*args, *pos, q_segment_ids, kv_segment_ids, **kw)
    k_start, k_end = key_ranges(*pos, causal=causal, window=window)

    def skip():
        return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))

    branches = (
        skip,
        lambda: _call_backward(calls, *args, None, None, sm_scale=sm_scale),
        lambda: _call_backward(calls, *args, k_start, k_end, sm_scale=sm_scale),
        lambda: tuple(g.astype(jnp.float32) for g in fallback.backward(*args, *pos, None, None, **kw)),
    )
    inputs = (*args, *pos)
    cls = block_class(*pos, causal=causal, window=window)
    return lax.switch(cls, [lambda b=b: varying_all(inputs, b()) for b in branches])


def tokamax_block_ops(calls: TokamaxCalls, fallback: BlockOps) -> BlockOps:
    """tokamax (`calls`: MOSAIC_CALLS or the CPU REFERENCE_CALLS) as a BlockOps pair; `fallback` computes the
    blocks tokamax's key ranges cannot express (module docstring)."""
    return in_callers_dtype(
        calls.name,
        functools.partial(_forward_fp32, calls, fallback),
        functools.partial(_backward_fp32, calls, fallback),
    )
