"""cuDNN's fused attention as a `BlockOps` pair: a block's visibility cut into what cuDNN's masks express.

cuDNN masks by *index*, with four shapes that matter here (`cudnn_contract.py`): none, causal aligned top-left
(query i sees key j <= i), a sliding window on that diagonal, and padding. jaxring masks by *position*, and a
ring block's positions are traced values (the K/V block's owner changes each step). So each (Q run, K/V run)
pair is classified at run time and `lax.switch` picks one of the compiled calls:

  SKIP     causal (and window) hide every pair (position bounds)         -> nothing (out 0, lse -inf)
  WHOLE    every pair visible (k_max <= q_min; window: q_max - k_min < W) -> cuDNN, no mask
  CAUSAL   both runs arithmetic with one stride s, q_start - k_start in [0, s): key j visible iff j <= i
           -> cuDNN causal (window W only when s = 1: then the band is the index band)
  SHIFTED  the same with q_start - k_start in [-s, 0): visible iff j <= i - 1 (striped, a rank after the
           K/V owner) -> cuDNN causal on Q rows 1.. and K/V rows ..-2; Q row 0 sees nothing
  FALLBACK anything else                                                  -> the fallback BlockOps (Pallas/jnp)

A block is first classified whole (one cuDNN call: contiguous-layout ring steps, striped ones, the dense
diagonal); failing that, Q and K/V are cut into chunks of c = nq/2 tokens (when nq is even and c divides nk)
and every chunk pair is classified alone, the partial results merged (`merge_partials`) and the gradients
summed. A zig-zag rank's two runs are exactly such chunks, so every ring step of every layout maps to cuDNN
calls with no fallback (tests/unit/kernels/test_cudnn_blocks.py checks the classes). What falls back, honestly:
  - segment ids (packed documents, padding): the whole block, statically (cuDNN's seq lengths/offsets would
    need the per-row document boundaries as counts, which the segment-id interface does not carry);
  - a window with stride > 1 (striped) or on an off-diagonal chunk that is neither whole nor hidden;
  - positions of no such structure (an all-gather's contiguous K against one Q shard is cut into chunks of
    nq/2, each then WHOLE/CAUSAL/SKIP: no fallback, but 2·nk/c chunk pairs, each a `lax.switch`);
  - inputs cuDNN does not take (fp32 for "cudnn"; head dim above 256 or not a multiple of 8): statically.

Backward: cuDNN's backward takes the forward output O and recomputes D = rowsum(dO ∘ O) itself, while
`BlockOps.backward` gets delta (= rowsum(dO ∘ O_global), possibly minus an lse cotangent). Instead of widening
the interface (and sending O around WallFacer's rings), each row gets a stand-in output with the same
rowsum: O' = a·e_m + b·e_m2 on the two largest |dO| entries, a = delta / dO_m rounded to the input dtype, b
the rounding's remainder over dO_m2, so rowsum(dO ∘ O') = delta to about the input dtype's precision squared.
A row with dO = 0 has delta = 0 from O (O' = 0 then). That D is computed in fp32 from the dtype's values is
cuDNN's documented behaviour; the GPU test of benchmarks/gpu_session.sh checks it. lse enters as cuDNN's stats
([b, h, n], natural log; -inf rows as +inf so P = 0). cuDNN returns gradients in the input dtype (bf16):
each block's dq/dk/dv is rounded once before the ring sums them in fp32 (the Pallas kernel keeps fp32).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.core import compat
from jaxring.core.vma import vary, varying_axes
from jaxring.kernels import cudnn_contract
from jaxring.kernels.blockwise import BlockOps, in_callers_dtype
from jaxring.kernels.masking import may_see, sees_all
from jaxring.kernels.merge import merge_partials

Array = jax.Array
SKIP, WHOLE, CAUSAL, SHIFTED, FALLBACK = range(5)
CLASS_NAMES = ("skip", "whole", "causal", "shifted", "fallback")
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256  # Hopper and later (128 before): check_is_flash_attention of jax 0.11.2 and 0.12.1


@dataclasses.dataclass(frozen=True)
class CudnnCalls:
    """A forward/backward pair with cuDNN's call contract (`cudnn_contract.py`), and the dtypes it takes."""

    name: str
    forward: Callable
    backward: Callable
    dtypes: tuple[jnp.dtype, ...]


def _private_forward(*operands: Array, mask_type: int, **params: object) -> tuple[Array, Array]:
    return compat.cudnn_attention_forward(*operands, mask_type=compat.cudnn_mask_types()[_MASKS[mask_type]], **params)


def _private_backward(*operands: Array, mask_type: int, **params: object) -> tuple[Array, Array, Array]:
    return compat.cudnn_attention_backward(*operands, mask_type=compat.cudnn_mask_types()[_MASKS[mask_type]], **params)


_MASKS = {cudnn_contract.NO_MASK: "none", cudnn_contract.CAUSAL: "causal"}
REAL_CALLS = CudnnCalls("cudnn", _private_forward, _private_backward, CUDNN_DTYPES)
# the stand-in also takes fp32, so CPU tests compare the decomposition tightly
REFERENCE_CALLS = CudnnCalls(
    "cudnn_reference", cudnn_contract.forward, cudnn_contract.backward, (*CUDNN_DTYPES, jnp.dtype(jnp.float32))
)


# ------------------------------------------------------------------------------------------ classification


def _arithmetic(pos: jax.Array, stride: jax.Array) -> jax.Array:
    """Scalar bool: pos [n] == pos[0] + stride * arange(n)."""
    return jnp.all(pos == pos[0] + stride * jnp.arange(pos.shape[0], dtype=pos.dtype))


def classify(q_pos: jax.Array, kv_pos: jax.Array, *, causal: bool, window: int | None = None) -> jax.Array:
    """int32 scalar: the class (SKIP .. FALLBACK, module docstring) of a (Q positions [nq], K/V [nk]) pair."""
    if not causal:
        return jnp.int32(WHOLE)
    q_pos, kv_pos = q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32)
    bounds = (q_pos.min(), q_pos.max(), kv_pos.min(), kv_pos.max())
    hidden = ~may_see(*bounds, causal=True, window=window)
    full = sees_all(*bounds, causal=True, window=window)
    # one stride for both runs (a run of one token takes the other's)
    step = lambda p: p[1] - p[0] if p.shape[0] > 1 else None
    stride = step(q_pos) if step(q_pos) is not None else step(kv_pos)
    stride = jnp.int32(1) if stride is None else stride
    runs = (stride >= 1) & _arithmetic(q_pos, stride) & _arithmetic(kv_pos, stride)
    offset = q_pos[0] - kv_pos[0]
    band_ok = jnp.bool_(True) if window is None else stride == 1
    diagonal = runs & band_ok & (offset >= 0) & (offset < stride)
    shifted = runs & band_ok & (offset < 0) & (offset >= -stride) & (q_pos.shape[0] > 1) & (kv_pos.shape[0] > 1)
    cls = jnp.where(shifted, SHIFTED, FALLBACK)
    cls = jnp.where(diagonal, CAUSAL, cls)
    cls = jnp.where(full, WHOLE, cls)
    return jnp.where(hidden, SKIP, cls).astype(jnp.int32)


# ------------------------------------------------------------------------------------------------ calls


def _params(sm_scale: float, mask_type: int, window: int | None) -> dict:
    return dict(
        scale=float(sm_scale),
        seed=0,
        dropout_rate=0.0,
        variadic_args=(False, False),
        mask_type=mask_type,
        layout=cudnn_contract.BTNH,
        sliding_window_length=window,
    )


def _unused(q: jax.Array) -> list[jax.Array]:
    """bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page tables: empty, as JAX's wrapper passes them."""
    return [jnp.zeros(0, q.dtype)] + [jnp.zeros(0, jnp.int32)] * 4 + [jnp.zeros(0, q.dtype)] * 2


def _call_forward(
    calls: CudnnCalls, q: Array, k: Array, v: Array, *, sm_scale: float, mask_type: int, window: int | None
) -> tuple[Array, Array]:
    """cuDNN forward of one pair -> out fp32 [b, nq, hq, d], lse fp32 [b, nq, hq]."""
    out, stats = calls.forward(q, k, v, *_unused(q), **_params(sm_scale, mask_type, window))
    return out.astype(jnp.float32), jnp.swapaxes(stats, 1, 2)


def stand_in_output(dout: jax.Array, delta: jax.Array) -> jax.Array:
    """O' in dout's dtype [b, n, h, d] with rowsum(dO ∘ O') = delta [b, n, h] (two terms; module docstring)."""
    do = dout.astype(jnp.float32)
    mag = jnp.abs(do)
    first = jnp.argmax(mag, axis=-1)
    second = jnp.argmax(jnp.where(jax.nn.one_hot(first, do.shape[-1], dtype=bool), -1.0, mag), axis=-1)
    pick = lambda idx: jnp.take_along_axis(do, idx[..., None], axis=-1)[..., 0]
    safe = lambda x: jnp.where(x == 0.0, 1.0, x)
    d1, d2 = pick(first), pick(second)
    a = jnp.where(d1 == 0.0, 0.0, delta / safe(d1)).astype(dout.dtype)
    rest = delta - d1 * a.astype(jnp.float32)
    b = jnp.where(d2 == 0.0, 0.0, rest / safe(d2)).astype(dout.dtype)
    one_hot = lambda idx, x: jax.nn.one_hot(idx, do.shape[-1], dtype=jnp.float32) * x.astype(jnp.float32)[..., None]
    return (one_hot(first, a) + one_hot(second, b)).astype(dout.dtype)


def _call_backward(
    calls: CudnnCalls,
    q: Array,
    k: Array,
    v: Array,
    dout: Array,
    lse: Array,
    delta: Array,
    *,
    sm_scale: float,
    mask_type: int,
    window: int | None,
) -> tuple[Array, Array, Array]:
    """cuDNN backward of one pair given the global lse and delta -> fp32 dq, dk, dv."""
    stats = jnp.swapaxes(jnp.where(jnp.isneginf(lse), jnp.inf, lse), 1, 2).astype(jnp.float32)
    o = stand_in_output(dout.astype(q.dtype), delta.astype(jnp.float32))
    grads = calls.backward(q, k, v, *_unused(q), stats, o, dout.astype(q.dtype), **_params(sm_scale, mask_type, window))
    return tuple(g.astype(jnp.float32) for g in grads)


def varying_all(inputs: tuple, tree: object) -> object:
    """`tree` typed as varying over every mesh axis any of `inputs` varies over (lax.switch branches must agree)."""
    axes = frozenset().union(*(varying_axes(x) for x in inputs if x is not None))
    return jax.tree.map(lambda x: vary(x, axes), tree)


def _pad_rows(x: jax.Array, before: int, after: int, value: float) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[1] = (before, after)
    return jnp.pad(x, pad, constant_values=value)


# --------------------------------------------------------------------------------------------- one pair


def _pair_forward(
    calls: CudnnCalls,
    fallback: BlockOps,
    q: Array,
    k: Array,
    v: Array,
    q_pos: Array,
    kv_pos: Array,
    *,
    causal: bool,
    sm_scale: float,
    window: int | None,
) -> tuple[Array, Array]:
    """(out fp32, lse fp32) of one (Q run, K/V run) pair by its class."""
    call = functools.partial(_call_forward, calls, sm_scale=sm_scale, window=None)

    def skip():
        return jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)

    def shifted():
        out, lse = _call_forward(
            calls, q[:, 1:], k[:, :-1], v[:, :-1], sm_scale=sm_scale, mask_type=cudnn_contract.CAUSAL, window=window
        )
        return _pad_rows(out, 1, 0, 0.0), _pad_rows(lse, 1, 0, -jnp.inf)

    branches = (
        skip,
        lambda: call(q, k, v, mask_type=cudnn_contract.NO_MASK),
        lambda: _call_forward(calls, q, k, v, sm_scale=sm_scale, mask_type=cudnn_contract.CAUSAL, window=window),
        shifted,
        lambda: _fallback_forward(fallback, q, k, v, q_pos, kv_pos, causal=causal, sm_scale=sm_scale, window=window),
    )
    inputs = (q, k, v, q_pos, kv_pos)
    cls = classify(q_pos, kv_pos, causal=causal, window=window)
    return lax.switch(cls, [lambda b=b: varying_all(inputs, b()) for b in branches])


def _pair_backward(
    calls: CudnnCalls,
    fallback: BlockOps,
    q: Array,
    k: Array,
    v: Array,
    dout: Array,
    lse: Array,
    delta: Array,
    q_pos: Array,
    kv_pos: Array,
    *,
    causal: bool,
    sm_scale: float,
    window: int | None,
) -> tuple[Array, Array, Array]:
    """fp32 (dq, dk, dv) of one pair by its class."""
    kw = dict(sm_scale=sm_scale)

    def skip():
        return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))

    def shifted():
        dq, dk, dv = _call_backward(
            calls, q[:, 1:], k[:, :-1], v[:, :-1], dout[:, 1:], lse[:, 1:], delta[:, 1:],
            mask_type=cudnn_contract.CAUSAL, window=window, **kw,
        )  # fmt: skip
        return _pad_rows(dq, 1, 0, 0.0), _pad_rows(dk, 0, 1, 0.0), _pad_rows(dv, 0, 1, 0.0)

    args = (q, k, v, dout, lse, delta)
    branches = (
        skip,
        lambda: _call_backward(calls, *args, mask_type=cudnn_contract.NO_MASK, window=None, **kw),
        lambda: _call_backward(calls, *args, mask_type=cudnn_contract.CAUSAL, window=window, **kw),
        shifted,
        lambda: _fallback_backward(fallback, *args, q_pos, kv_pos, causal=causal, sm_scale=sm_scale, window=window),
    )
    inputs = (*args, q_pos, kv_pos)
    cls = classify(q_pos, kv_pos, causal=causal, window=window)
    return lax.switch(cls, [lambda b=b: varying_all(inputs, b()) for b in branches])


def _window_kw(window: int | None) -> dict:
    return {} if window is None else {"window": window}


def _fallback_forward(
    fallback: BlockOps,
    q: Array,
    k: Array,
    v: Array,
    q_pos: Array,
    kv_pos: Array,
    q_seg: Array | None = None,
    kv_seg: Array | None = None,
    *,
    causal: bool,
    sm_scale: float,
    window: int | None,
) -> tuple[Array, Array]:
    return fallback.forward(
        q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal=causal, sm_scale=sm_scale, **_window_kw(window)
    )


def _fallback_backward(
    fallback: BlockOps,
    q: Array,
    k: Array,
    v: Array,
    dout: Array,
    lse: Array,
    delta: Array,
    q_pos: Array,
    kv_pos: Array,
    q_seg: Array | None = None,
    kv_seg: Array | None = None,
    **kw: object,
) -> tuple[Array, Array, Array]:
    window = kw.pop("window")
    return fallback.backward(q, k, v, dout, lse, delta, q_pos, kv_pos, q_seg, kv_seg, **kw, **_window_kw(window))


# ------------------------------------------------------------------------------------------ whole blocks


def chunk_size(nq: int, nk: int) -> int | None:
    """The chunk the second level cuts both sides into (nq/2, a zig-zag run), or None if it does not fit."""
    c = nq // 2
    return c if nq % 2 == 0 and c > 0 and nk % c == 0 else None


def supported(calls: CudnnCalls, q: Array, k: Array, q_segment_ids: Array | None, kv_segment_ids: Array | None) -> bool:
    """Static: whether cuDNN may take this block at all (else the fallback does all of it)."""
    d = q.shape[-1]
    return (
        q_segment_ids is None
        and kv_segment_ids is None
        and jnp.dtype(q.dtype) in calls.dtypes
        and q.dtype == k.dtype
        and d <= MAX_HEAD_DIM
        and d % 8 == 0
    )


def _chunks(x: jax.Array, c: int, axis: int = 1) -> list[jax.Array]:
    return [lax.slice_in_dim(x, i, i + c, axis=axis) for i in range(0, x.shape[axis], c)]


def _forward_fp32(
    calls: CudnnCalls, fallback: BlockOps, q: Array, k: Array, v: Array, q_positions: Array, kv_positions: Array,
    q_segment_ids: Array | None = None, kv_segment_ids: Array | None = None,
    *, causal: bool, sm_scale: float, window: int | None = None,
) -> tuple[Array, Array]:  # fmt: skip
    """BlockOps forward (blockwise.py's interface) through cuDNN, out in fp32: out [b, nq, hq, d], lse fp32 [b, nq, hq]."""
    kw = dict(causal=causal, sm_scale=sm_scale, window=window)
    if not supported(calls, q, k, q_segment_ids, kv_segment_ids):
        return _fallback_forward(fallback, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, **kw)
    whole = lambda: _pair_forward(calls, fallback, q, k, v, q_positions, kv_positions, **kw)
    c = chunk_size(q.shape[1], k.shape[1])
    if c is None:
        return whole()

    def chunked():
        rows = []
        for q_c, qp_c in zip(_chunks(q, c), _chunks(q_positions, c, 0)):
            acc = None
            for k_c, v_c, kp_c in zip(_chunks(k, c), _chunks(v, c), _chunks(kv_positions, c, 0)):
                part = _pair_forward(calls, fallback, q_c, k_c, v_c, qp_c, kp_c, **kw)
                acc = part if acc is None else merge_partials(*acc, *part)
            rows.append(acc)
        return tuple(jnp.concatenate(parts, axis=1) for parts in zip(*rows))

    inputs = (q, k, v, q_positions, kv_positions)
    one_call = classify(q_positions, kv_positions, causal=causal, window=window) != FALLBACK
    return lax.cond(one_call, lambda: varying_all(inputs, whole()), lambda: varying_all(inputs, chunked()))


def _backward_fp32(
    calls: CudnnCalls, fallback: BlockOps, q: Array, k: Array, v: Array, dout: Array, lse: Array, delta: Array,
    q_positions: Array, kv_positions: Array, q_segment_ids: Array | None = None, kv_segment_ids: Array | None = None,
    *, causal: bool, sm_scale: float, window: int | None = None,
) -> tuple[Array, Array, Array]:  # fmt: skip
    """BlockOps backward through cuDNN given the global lse and delta: fp32 dq, dk, dv."""
    kw = dict(causal=causal, sm_scale=sm_scale, window=window)
    args = (q, k, v, dout, lse, delta)
    if not supported(calls, q, k, q_segment_ids, kv_segment_ids):
        return _fallback_backward(fallback, *args, q_positions, kv_positions, q_segment_ids, kv_segment_ids, **kw)
    whole = lambda: _pair_backward(calls, fallback, *args, q_positions, kv_positions, **kw)
    c = chunk_size(q.shape[1], k.shape[1])
    if c is None:
        return whole()

    def chunked():
        dq_rows, dk, dv = [], None, None
        q_side = zip(*(_chunks(x, c) for x in (q, dout, lse, delta)), _chunks(q_positions, c, 0))
        for q_c, do_c, lse_c, delta_c, qp_c in q_side:
            dq_c, dk_cols, dv_cols = None, [], []
            for k_c, v_c, kp_c in zip(_chunks(k, c), _chunks(v, c), _chunks(kv_positions, c, 0)):
                g = _pair_backward(calls, fallback, q_c, k_c, v_c, do_c, lse_c, delta_c, qp_c, kp_c, **kw)
                dq_c = g[0] if dq_c is None else dq_c + g[0]
                dk_cols.append(g[1])
                dv_cols.append(g[2])
            dq_rows.append(dq_c)
            dk_row, dv_row = jnp.concatenate(dk_cols, axis=1), jnp.concatenate(dv_cols, axis=1)
            dk = dk_row if dk is None else dk + dk_row
            dv = dv_row if dv is None else dv + dv_row
        return jnp.concatenate(dq_rows, axis=1), dk, dv

    inputs = (*args, q_positions, kv_positions)
    one_call = classify(q_positions, kv_positions, causal=causal, window=window) != FALLBACK
    return lax.cond(one_call, lambda: varying_all(inputs, whole()), lambda: varying_all(inputs, chunked()))


def cudnn_block_ops(calls: CudnnCalls, fallback: BlockOps) -> BlockOps:
    """cuDNN (`calls`: REAL_CALLS or the stand-in REFERENCE_CALLS) as a BlockOps pair; `fallback` computes the
    blocks and chunk pairs cuDNN's masks cannot express."""
    return in_callers_dtype(
        calls.name,
        functools.partial(_forward_fp32, calls, fallback),
        functools.partial(_backward_fp32, calls, fallback),
    )


def planned_classes(q_positions: Array, kv_positions: Array, *, causal: bool, window: int | None = None) -> list[int]:
    """The classes the cudnn forward runs for a block with these (concrete) positions: the whole block's, or
    failing that (FALLBACK) each chunk pair's. For tests and reports of what falls back."""
    whole = int(classify(q_positions, kv_positions, causal=causal, window=window))
    c = chunk_size(q_positions.shape[0], kv_positions.shape[0])
    if whole != FALLBACK or c is None:
        return [whole]
    return [
        int(classify(qp, kp, causal=causal, window=window))
        for qp in _chunks(q_positions, c, 0)
        for kp in _chunks(kv_positions, c, 0)
    ]
