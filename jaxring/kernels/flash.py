"""Flash attention: the public API over the Pallas kernels (GPU/Triton), with a jnp path on CPU.

    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)

Shapes: q [batch, q_len, q_heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim] with
q_heads % kv_heads == 0 (GQA/MQA: query head h reads key/value head h // (q_heads // kv_heads); K/V are never
repeated, the kernels index the shared head in their BlockSpecs). out has q's shape and dtype; lse is fp32
[batch, q_len, q_heads], natural log, -inf on rows that see no key (their out is 0 and their gradients 0).

Masking is by *positions*, never by array index, so a Q block and a K/V block taken from anywhere in a
sequence (ring steps, zigzag or striped layouts) are masked exactly: with `causal`, query i sees key j iff
q_positions[i] >= kv_positions[j]; with a sliding `window` W also q_positions[i] - kv_positions[j] < W (W keys
including itself; the kernels visit only the band of tiles the window can reach). Segment ids (0 = padding)
restrict attention to equal, non-zero ids.

Three files: `flash_tiles.py` (per-kernel tiles, padding, block skipping), `flash_kernels.py` (the forward,
dK/dV and dQ kernels, FlashAttention-2), and this one: validation, the differentiable `flash_attention`
(custom_vjp: delta = rowsum(dO * O) minus the cotangent of lse, so lse is differentiable too, then the two
backward kernels) and the `BlockOps` interface for the distributed strategies.

Implementations (`implementation=`): "pallas" (compiled Pallas/Triton, GPU), "pallas_interpret" (the same
kernels run by the Pallas interpreter, any backend: how the CPU tests check the kernel logic), "jnp" (the
tiled jnp path of blockwise.py), None/"auto" ("pallas" when jax.default_backend() == "gpu", else "jnp").

Block interface: `flash_block_forward` / `flash_block_backward` implement the `BlockOps` pair documented
in blockwise.py (fp32 results, caller-supplied *global* lse and delta), and `flash_block_ops(interpret)`
packages them for the distributed strategies. Padded query rows carry dO = 0 and lse = +inf in the backward,
so they contribute exactly nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxring.kernels.blockwise import BlockOps, block_backward, block_forward
from jaxring.kernels.flash_kernels import pallas_backward, pallas_forward
from jaxring.kernels.flash_tiles import (
    IMPLEMENTATIONS,
    Config,
    default_block_config,
    kernel_tiles,
    make_config,
    pad_axis,
    pad_tokens,
    prepare,
)
from jaxring.kernels.masking import check_qkv

__all__ = [
    "IMPLEMENTATIONS",
    "default_block_config",
    "flash_attention",
    "flash_block_backward",
    "flash_block_forward",
    "flash_block_ops",
]

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------


def _check_inputs(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
):
    check_qkv(q, k, v)  # ranks, batch, head_dim, GQA divisibility
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {jnp.dtype(x.dtype).name}; flash attention supports bfloat16, "
                f"float16 and float32 inputs (fp32 accumulation)"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype; got {jnp.dtype(q.dtype).name}, "
            f"{jnp.dtype(k.dtype).name} and {jnp.dtype(v.dtype).name}"
        )
    batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
    for name, x, n in (("q_positions", q_positions, q_len), ("kv_positions", kv_positions, kv_len)):
        if x is None:
            continue
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} has dtype {jnp.dtype(x.dtype).name}; positions must be integers")
        if x.shape not in ((n,), (batch, n)):
            raise ValueError(f"{name} has shape {x.shape}; expected ({n},) or ({batch}, {n})")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("segment ids must be given for both queries and keys, or for neither")
    for name, x, n in (("q segment ids", q_segment_ids, q_len), ("kv segment ids", kv_segment_ids, kv_len)):
        if x is None:
            continue
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} have dtype {jnp.dtype(x.dtype).name}; segment ids must be integers")
        if x.shape != (batch, n):
            raise ValueError(f"{name} have shape {x.shape}; expected ({batch}, {n})")


# ----------------------------------------------------------------------------------------------------------
# Unpadded forward / backward on one (Q, K/V) pair, for every implementation
# ----------------------------------------------------------------------------------------------------------


def _jnp_call(
    fn: Callable[..., Any], q_positions: jax.Array | None, kv_positions: jax.Array | None, args: tuple, kwargs: dict
):
    """block_forward/backward take [n] positions; batched [b, n] positions run them per batch row."""
    if q_positions.ndim == 1 and kv_positions.ndim == 1:
        return fn(*args[:-4], q_positions, kv_positions, *args[-2:], **kwargs)
    b = args[0].shape[0]
    qp = jnp.broadcast_to(q_positions, (b,) + q_positions.shape[-1:])
    kp = jnp.broadcast_to(kv_positions, (b,) + kv_positions.shape[-1:])

    def one(*row):
        arrays, (qpi, kpi, qsi, ksi) = row[:-4], row[-4:]
        add = lambda x: None if x is None else x[None]
        out = fn(*(add(x) for x in arrays), qpi, kpi, add(qsi), add(ksi), **kwargs)
        return jax.tree.map(lambda x: x[0], out)

    return jax.vmap(one)(*args[:-4], qp, kp, *args[-2:])


def _default_positions(q_positions: jax.Array | None, kv_positions: jax.Array | None, q_len: int, kv_len: int):
    qp = jnp.arange(q_len, dtype=jnp.int32) if q_positions is None else jnp.asarray(q_positions)
    kp = jnp.arange(kv_len, dtype=jnp.int32) if kv_positions is None else jnp.asarray(kv_positions)
    return qp, kp


def _forward(
    cfg: Config,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
    out_dtype: jax.typing.DTypeLike,
):
    """-> out [b, nq, hq, d] (out_dtype), lse [b, nq, hq] fp32."""
    if cfg.implementation == "jnp":
        qp, kp = _default_positions(q_positions, kv_positions, q.shape[1], k.shape[1])
        out, lse = _jnp_call(
            block_forward,
            qp,
            kp,
            (q, k, v, qp, kp, q_segment_ids, kv_segment_ids),
            dict(causal=cfg.causal, sm_scale=cfg.sm_scale, window=cfg.window),
        )
        return out.astype(out_dtype), lse
    tiles = kernel_tiles(cfg, q.shape[3], q.shape[1], k.shape[1])
    *padded, layout = prepare(cfg, tiles, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    out, lse = pallas_forward(cfg, tiles, layout, *padded, out_dtype)
    q_len, d = layout["q_len"], layout["head_dim"]
    return out[:, :q_len, :, :d], jnp.swapaxes(lse, 1, 2)[:, :q_len]


def _backward(
    cfg: Config,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
    dtypes: Sequence[jax.typing.DTypeLike],
):
    """lse, delta [b, nq, hq] (global values) -> dq, dk, dv in `dtypes`."""
    if cfg.implementation == "jnp":
        qp, kp = _default_positions(q_positions, kv_positions, q.shape[1], k.shape[1])
        grads = _jnp_call(
            block_backward,
            qp,
            kp,
            (q, k, v, dout, lse, delta, qp, kp, q_segment_ids, kv_segment_ids),
            dict(causal=cfg.causal, sm_scale=cfg.sm_scale, window=cfg.window),
        )
        return tuple(g.astype(dt) for g, dt in zip(grads, dtypes))
    tiles = kernel_tiles(cfg, q.shape[3], q.shape[1], k.shape[1])
    q_p, k_p, v_p, qpos, kpos, qseg, kseg, layout = prepare(
        cfg, tiles, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids
    )
    nq, d_pad = layout["nq"], layout["d_pad"]
    # dO in the inputs' dtype for the tensor-core matmuls; padded rows: dO = 0, lse = +inf, delta = 0.
    do_p = pad_tokens(dout.astype(q.dtype), nq, d_pad)
    lse_p = pad_axis(jnp.swapaxes(lse.astype(jnp.float32), 1, 2), 2, nq, jnp.inf)
    delta_p = pad_axis(jnp.swapaxes(delta.astype(jnp.float32), 1, 2), 2, nq, 0.0)
    dq, dk, dv = pallas_backward(
        cfg, tiles, layout, q_p, k_p, v_p, do_p, lse_p, delta_p, qpos, kpos, qseg, kseg, dtypes
    )
    d = layout["head_dim"]
    return dq[:, : layout["q_len"], :, :d], dk[:, : layout["kv_len"], :, :d], dv[:, : layout["kv_len"], :, :d]


# ----------------------------------------------------------------------------------------------------------
# Differentiable attention (custom_vjp: FA2 backward from out and lse)
# ----------------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(
    cfg: Config,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
):
    return _forward(cfg, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, q.dtype)


def _attention_fwd(
    cfg: Config,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
):
    out, lse = _forward(cfg, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, q.dtype)
    return (out, lse), (q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, out, lse)


def _attention_bwd(cfg: Config, res: tuple, cts: tuple[jax.Array, jax.Array]):
    q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, out, lse = res
    dout, dlse = cts
    # delta = rowsum(dO * O); d lse / d S = P, so a cotangent on lse enters as delta - dlse.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - dlse.astype(jnp.float32)
    dq, dk, dv = _backward(
        cfg,
        q,
        k,
        v,
        dout,
        lse,
        delta,
        q_positions,
        kv_positions,
        q_segment_ids,
        kv_segment_ids,
        (q.dtype, k.dtype, v.dtype),
    )
    return dq, dk, dv, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
_attention_jit = jax.jit(_attention, static_argnums=0)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    return_lse: bool = False,
    window: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Memory-efficient exact attention; differentiable (FA2 backward).

    Args:
      q: [batch, q_len, q_heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim]; one dtype among
        bfloat16, float16, float32 (accumulation is fp32). q_heads % kv_heads == 0 (GQA/MQA).
      causal: query i sees key j iff q_positions[i] >= kv_positions[j].
      sm_scale: score scale, default 1/sqrt(head_dim).
      q_positions, kv_positions: int [q_len] / [kv_len] (or [batch, len]); default arange. Only used when
        causal.
      segment_ids: int [batch, q_len]; kv_segment_ids: int [batch, kv_len], default segment_ids. Tokens attend
        within equal ids; 0 is padding (attends to nothing, attended by nothing).
      return_lse: also return lse fp32 [batch, q_len, q_heads] (natural log; differentiable).
      window: sliding window W >= 1 (needs causal): query i sees keys with i - W < j <= i (by positions);
        None: unlimited.
      block_q, block_k: tile sizes (powers of two >= 16) overriding the Hopper defaults of every kernel
        (forward, dK/dV and dQ); num_warps, num_stages: Triton launch settings. Ignored by "jnp".
      implementation: None/"auto", "pallas", "pallas_interpret" or "jnp" (see the module docstring).

    Returns:
      out [batch, q_len, q_heads, head_dim] in q.dtype, or (out, lse) when return_lse.
    """
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    _check_inputs(q, k, v, q_positions, kv_positions, segment_ids, kv_segment_ids)
    cfg = make_config(causal, sm_scale, q.shape[3], implementation, block_q, block_k, num_warps, num_stages, window)
    out, lse = _attention_jit(cfg, q, k, v, q_positions, kv_positions, segment_ids, kv_segment_ids)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------------------
# Block interface (see blockwise.py): used by the distributed strategies
# ----------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1))
def _block_forward_jit(
    cfg: Config,
    dtype: jnp.dtype,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
):
    return _forward(cfg, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, dtype)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _block_backward_jit(
    cfg: Config,
    dtype: jnp.dtype,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
):
    return _backward(
        cfg, q, k, v, dout, lse, delta, q_positions, kv_positions, q_segment_ids, kv_segment_ids, (dtype,) * 3
    )


def flash_block_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    causal: bool,
    sm_scale: float,
    window: int | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dtype: jax.typing.DTypeLike = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """BlockOps forward: attention of one Q block over one K/V block.

    Returns out [b, nq, hq, d] in `dtype` (normalised over this block's keys) and lse fp32 [b, nq, hq] (-inf on
    rows that see none of this block's keys). Positions int [n] (or [b, n]); segment ids [b, n] or None.
    """
    _check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    cfg = make_config(causal, sm_scale, q.shape[3], implementation, block_q, block_k, num_warps, num_stages, window)
    dtype = jnp.dtype(dtype)
    return _block_forward_jit(cfg, dtype, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)


def flash_block_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    causal: bool,
    sm_scale: float,
    window: int | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dtype: jax.typing.DTypeLike = jnp.float32,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """BlockOps backward: (dq, dk, dv) of one (Q block, K/V block) pair, in `dtype` (fp32 accumulation).

    lse and delta = rowsum(dout * out) are the *global* per-row values [b, nq, hq] (over all K/V blocks), so
    this block's probabilities are the global ones and the gradients of all blocks simply add up.
    """
    _check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    b, nq, hq = q.shape[:3]
    for name, x in (("dout", dout), ("lse", lse), ("delta", delta)):
        want = q.shape if name == "dout" else (b, nq, hq)
        if x.shape != want:
            raise ValueError(f"{name} has shape {x.shape}; expected {want}")
    cfg = make_config(causal, sm_scale, q.shape[3], implementation, block_q, block_k, num_warps, num_stages, window)
    dtype = jnp.dtype(dtype)
    return _block_backward_jit(
        cfg, dtype, q, k, v, dout, lse, delta, q_positions, kv_positions, q_segment_ids, kv_segment_ids
    )


def flash_block_ops(interpret: bool = False, **kernel_options) -> BlockOps:
    """The Pallas kernels as a `BlockOps` pair: compiled ("pallas") or interpreted ("pallas_interpret").

    `kernel_options` (block_q, block_k, num_warps, num_stages) are passed to both functions.
    """
    name = "pallas_interpret" if interpret else "pallas"
    return BlockOps(
        name,
        functools.partial(flash_block_forward, implementation=name, **kernel_options),
        functools.partial(flash_block_backward, implementation=name, **kernel_options),
    )
