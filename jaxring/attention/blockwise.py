"""Per-block attention compute in plain jnp, tiled flash-style: the CPU path of the block interface.

Every distributed strategy calls a `BlockOps` pair on one (Q block, K/V block):

  forward(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, *, causal, sm_scale)
      -> out fp32 [b, nq, hq, d] (normalised over this block's keys), lse fp32 [b, nq, hq]
  backward(q, k, v, dout, lse, delta, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
           *, causal, sm_scale)
      -> dq fp32 [b, nq, hq, d], dk fp32 [b, nk, hkv, d], dv fp32 [b, nk, hkv, d]

where `lse` and `delta = rowsum(dout * out)` are the *global* (whole-row) values, so the block's
probabilities exp(s - lse) are exactly the global ones and the block gradients simply add up.
Positions are int [n]; segment ids int [b, n] or None (0 = padding). K/V keep their own head count (GQA);
they are never repeated.

This jnp version tiles Q and K/V (`q_tile`, `kv_tile` elements), so memory is linear in the block length
(no [nq, nk] score matrix), and skips tiles that the causal mask hides completely. The Pallas kernel in
`flash.py` provides the same pair on GPU.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxring.attention.masking import attention_mask
from jaxring.attention.merge import empty_partial, merge_partials
from jaxring.attention.reference import softmax_attend

DEFAULT_Q_TILE = 512
DEFAULT_KV_TILE = 512


@dataclasses.dataclass(frozen=True)
class BlockOps:
    """A per-block forward/backward pair with the interface documented in this module."""
    name: str
    forward: Callable
    backward: Callable


def _tile_size(n: int, target: int) -> int:
    """Largest divisor of n not above target; n itself (one tile) when no divisor reaches target / 8."""
    t = min(n, target)
    while n % t:
        t -= 1
    return t if t * 8 >= min(n, target) else n


def _split_tiles(x, tile: int, axis: int):
    """[.., n, ..] -> [n // tile, .., tile, ..] (tile index leading, for scan)."""
    if x is None:
        return None
    shape = x.shape[:axis] + (x.shape[axis] // tile, tile) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _merge_tiles(x, axis: int):
    """Inverse of `_split_tiles`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def tile_visible(q_positions, kv_positions, *, causal: bool):
    """False when the causal mask hides every (query, key) pair of the tile: it can be skipped."""
    if not causal:
        return jnp.bool_(True)
    return jnp.max(q_positions) >= jnp.min(kv_positions)


def _grouped(q, kv_heads):
    b, n, hq, d = q.shape
    return q.astype(jnp.float32).reshape(b, n, kv_heads, hq // kv_heads, d)


def _check_positions(q, k, q_positions, kv_positions):
    """Positions are shared by the batch: int [n] (per-row positions would be split along the wrong axis)."""
    for name, pos, n in (("q_positions", q_positions, q.shape[1]), ("kv_positions", kv_positions, k.shape[1])):
        if pos.shape != (n,):
            raise ValueError(f"{name} shape {pos.shape} must be [{n}] (one position per token, shared by the "
                             f"batch; vmap over rows for per-row positions)")


def block_forward(q, k, v, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None, *,
                  causal: bool, sm_scale: float, q_tile: int = DEFAULT_Q_TILE, kv_tile: int = DEFAULT_KV_TILE):
    """Attention of one Q block over one K/V block; see the module docstring for shapes."""
    _check_positions(q, k, q_positions, kv_positions)
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    tq, tk = _tile_size(nq, q_tile), _tile_size(nk, kv_tile)
    k_t, v_t = _split_tiles(k, tk, 1), _split_tiles(v, tk, 1)
    kpos_t, kseg_t = _split_tiles(kv_positions, tk, 0), _split_tiles(kv_segment_ids, tk, 1)

    def one_q_tile(args):
        q_i, qpos_i, qseg_i = args
        qg = _grouped(q_i, hkv)

        def attend(kv_tile_args):
            k_j, v_j, kpos_j, kseg_j = kv_tile_args
            s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k_j.astype(jnp.float32)) * sm_scale
            mask = attention_mask(qpos_i, kpos_j, qseg_i, kseg_j, causal=causal)
            o, lse = softmax_attend(s, v_j, mask)
            return o.reshape(b, tq, hq, d), lse.reshape(b, tq, hq)

        def step(acc, kv_tile_args):
            visible = tile_visible(qpos_i, kv_tile_args[2], causal=causal)
            part = jax.lax.cond(visible, attend, lambda _: empty_partial(q_i), kv_tile_args)
            return merge_partials(*acc, *part), None

        if tk == nk:  # one K/V tile: no loop (the caller decides whether the pair is visible at all)
            return attend((k, v, kv_positions, kv_segment_ids))
        acc, _ = jax.lax.scan(step, empty_partial(q_i), (k_t, v_t, kpos_t, kseg_t))
        return acc

    if tq == nq:
        return one_q_tile((q, q_positions, q_segment_ids))
    out, lse = jax.lax.map(one_q_tile, (_split_tiles(q, tq, 1), _split_tiles(q_positions, tq, 0),
                                        _split_tiles(q_segment_ids, tq, 1)))
    return _merge_tiles(out, 1), _merge_tiles(lse, 1)


def block_backward(q, k, v, dout, lse, delta, q_positions, kv_positions, q_segment_ids=None,
                   kv_segment_ids=None, *, causal: bool, sm_scale: float, q_tile: int = DEFAULT_Q_TILE,
                   kv_tile: int = DEFAULT_KV_TILE):
    """Gradients of one (Q block, K/V block) pair given the global lse and delta; fp32 results."""
    _check_positions(q, k, q_positions, kv_positions)
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    tq, tk = _tile_size(nq, q_tile), _tile_size(nk, kv_tile)
    kv_tiles = (_split_tiles(k, tk, 1), _split_tiles(v, tk, 1), _split_tiles(kv_positions, tk, 0),
                _split_tiles(kv_segment_ids, tk, 1))
    q_tiles = (_split_tiles(q, tq, 1), _split_tiles(dout, tq, 1), _split_tiles(lse, tq, 1),
               _split_tiles(delta, tq, 1), _split_tiles(q_positions, tq, 0), _split_tiles(q_segment_ids, tq, 1))

    def one_q_tile(dkv, q_tile_args):
        q_i, do_i, lse_i, delta_i, qpos_i, qseg_i = q_tile_args
        qg, dog = _grouped(q_i, hkv), _grouped(do_i, hkv)
        # [b, tq, hq] -> [b, hkv, g, tq, 1]
        as_rows = lambda x: jnp.transpose(x.reshape(b, tq, hkv, g), (0, 2, 3, 1))[..., None]
        lse_rows = as_rows(lse_i)
        lse_rows = jnp.where(jnp.isneginf(lse_rows), 0.0, lse_rows)
        delta_rows = as_rows(delta_i)

        def grads(kv_tile_args):
            k_j, v_j, kpos_j, kseg_j = kv_tile_args
            kf, vf = k_j.astype(jnp.float32), v_j.astype(jnp.float32)
            s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kf) * sm_scale
            mask = attention_mask(qpos_i, kpos_j, qseg_i, kseg_j, causal=causal)
            if mask is not None:
                s = jnp.where(mask[:, None, None], s, -jnp.inf)
            p = jnp.exp(s - lse_rows)
            dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, dog)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, vf)
            ds = p * (dp - delta_rows) * sm_scale
            dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, kf)
            dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg)
            return dq, dk, dv

        def skip(kv_tile_args):
            kz = jnp.zeros_like(kv_tile_args[0], jnp.float32)
            return jnp.zeros_like(qg), kz, kz

        def step(dq_acc, kv_tile_args):
            visible = tile_visible(qpos_i, kv_tile_args[2], causal=causal)
            dq, dk, dv = jax.lax.cond(visible, grads, skip, kv_tile_args)
            return dq_acc + dq, (dk, dv)

        if tk == nk:  # one K/V tile: no loop
            dq, dk, dv = grads((k, v, kv_positions, kv_segment_ids))
            return (dkv[0] + dk, dkv[1] + dv), dq.reshape(b, tq, hq, d)
        dq, (dk, dv) = jax.lax.scan(step, jnp.zeros_like(qg), kv_tiles)
        dkv = (dkv[0] + _merge_tiles(dk, 1), dkv[1] + _merge_tiles(dv, 1))
        return dkv, dq.reshape(b, tq, hq, d)

    zeros_kv = jnp.zeros_like(k, jnp.float32)
    if tq == nq:
        (dk, dv), dq = one_q_tile((zeros_kv, zeros_kv), (q, dout, lse, delta, q_positions, q_segment_ids))
        return dq, dk, dv
    (dk, dv), dq = jax.lax.scan(one_q_tile, (zeros_kv, zeros_kv), q_tiles)
    return _merge_tiles(dq, 1), dk, dv


JNP_BLOCK_OPS = BlockOps("jnp", block_forward, block_backward)


def get_block_ops(impl: str | BlockOps = "auto") -> BlockOps:
    """The per-block compute by name, or a BlockOps as given.

    "jnp" (this module), "pallas" (the compiled flash kernel, GPU), "pallas_interpret" (the same kernel run by
    the Pallas interpreter, for CPU tests); "auto" is "pallas" on GPU and "jnp" elsewhere.
    """
    if isinstance(impl, BlockOps):
        return impl
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "jnp"
    if impl == "jnp":
        return JNP_BLOCK_OPS
    if impl in ("pallas", "pallas_interpret"):
        from jaxring.attention.flash import flash_block_ops  # flash.py imports this module
        return flash_block_ops(interpret=impl == "pallas_interpret")
    raise ValueError(f"unknown block implementation {impl!r}; expected 'auto', 'jnp', 'pallas', "
                     f"'pallas_interpret' or a BlockOps")
