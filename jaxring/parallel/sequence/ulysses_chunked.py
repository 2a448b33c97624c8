"""Ulysses with attention chunked over heads (UPipe, "Untied Ulysses", arXiv 2602.21196).

Plain Ulysses exchanges every head at once: the head-sharded q, out, dout and dq ([b, S, H/P, d], each the
size of a whole [b, n, H, d] shard) live together in the backward. With G head chunks the heads are taken
H/G at a time (chunk g: query heads Hg = [g·H/G, (g+1)·H/G), K/V heads KVg likewise), each chunk a whole
Ulysses of its own, and only one chunk's head-sharded arrays are on the device:

  for g in 0..G-1:                                          # forward
      q_g, k_g, v_g = all_to_all(q[:, :, Hg], k[:, :, KVg], v[:, :, KVg])     # [b, S, H/(G·P), d]
      out_g, lse_g = attention(q_g, k_g, v_g)
      out[:, :, Hg] = all_to_all(out_g)
  delta = rowsum(dout · out)                                # backward (FA2, from out and lse)
  for g in 0..G-1:
      q_g, k_g, v_g, dout_g, delta_g = all_to_all(the chunk's heads of q, k, v, dout, delta)
      dq_g, dk_g, dv_g = attention_backward(q_g, k_g, v_g, dout_g, lse_g, delta_g)
      dq[:, :, Hg], dk[:, :, KVg], dv[:, :, KVg] = all_to_all(dq_g, dk_g, dv_g)

Kept for the backward: q, k, v and out (the sequence shards the layer holds anyway) and the fp32 lse. The
traffic of q and out is Ulysses' own (plus delta, 1/d of out); K/V heads are repeated per chunk to a multiple
of P, so with GQA they move up to G times Ulysses' bytes. Rules: G divides the K/V heads, P divides H/G.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring.core.vma import vary_like
from jaxring.kernels.blockwise import BlockOps, with_window
from jaxring.parallel.sequence.head_exchange import heads_to_seq, repeat_kv_for_split, seq_to_heads

F32 = jnp.float32


def check_chunk_count(chunks: object, degree: int = 1) -> None:
    """Raises (one line) unless `chunks` is a positive integer (degree: the registry's, unused)."""
    del degree
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"head_chunks {chunks!r} must be a positive integer")


def check_head_chunks(chunks: int, q_heads: int, kv_heads: int, degree: int) -> None:
    """Raises (one line) unless each of `chunks` head chunks is a Ulysses of its own over `degree` devices."""
    check_chunk_count(chunks)
    if kv_heads % chunks:
        raise ValueError(f"head_chunks {chunks} does not divide the {kv_heads} K/V heads (a chunk takes whole groups)")
    if (q_heads // chunks) % degree:
        raise ValueError(
            f"head_chunks {chunks} leaves {q_heads // chunks} query heads a chunk, not divisible by the Ulysses "
            f"degree sp = {degree}"
        )


def _heads(x: jax.Array, first: int, count: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, first, count, axis=2)


def chunked_ulysses_core(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seg: jax.Array | None,
    positions: jax.Array,
    *,
    axis_name: str | tuple[str, ...],
    chunks: int,
    ops: BlockOps,
    causal: bool,
    sm_scale: float,
    window: int | None,
    order: np.ndarray | None,
) -> jax.Array:
    """The module docstring's loops. q [b, n, H, d], k/v [b, n, KV, d] (this device's sequence shards), seg
    [b, S] gathered or None, positions int [S] of the gathered sequence (natural order, and seg too, when
    `order` reorders it for a window). Returns out [b, n, H, d] in q's dtype."""
    p = lax.axis_size(axis_name)
    ops = with_window(ops, window)
    inverse = None if order is None else np.argsort(order)
    kw = dict(causal=causal, sm_scale=sm_scale, dtype=q.dtype)  # a chunk is a whole attention: no fp32 sums
    hq, hkv = q.shape[2] // chunks, k.shape[2] // chunks  # a chunk's query and K/V heads
    repeat = math.lcm(hkv, p) // hkv  # K/V heads repeated within a chunk to a multiple of P

    def to_heads(x: jax.Array) -> jax.Array:  # [b, n, h, ...] -> [b, S, h/P, ...] (natural order with a window)
        y = seq_to_heads(x, axis_name)
        return y if order is None else y[:, order]

    def to_seq(x: jax.Array) -> jax.Array:
        return heads_to_seq(x if inverse is None else x[:, inverse], axis_name)

    def chunk_inputs(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array | int) -> tuple:
        kv = (repeat_kv_for_split(_heads(x, g * hkv, hkv), p) for x in (k, v))
        return to_heads(_heads(q, g * hq, hq)), *(to_heads(x) for x in kv)

    @jax.custom_vjp
    def attend(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None, positions: jax.Array) -> jax.Array:
        return forward(q, k, v, seg, positions)[0]

    def forward(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None, positions: jax.Array) -> tuple:
        def chunk(g: jax.Array | int) -> tuple[jax.Array, jax.Array]:  # chunk g's out (sequence shard), lse
            out_g, lse_g = ops.forward(*chunk_inputs(q, k, v, g), positions, positions, seg, seg, **kw)
            return to_seq(out_g), lse_g

        def body(g: jax.Array, carry: tuple) -> tuple:
            out, lse = carry
            out_g, lse_g = chunk(g)
            out = lax.dynamic_update_slice_in_dim(out, out_g, g * hq, axis=2)
            return out, lax.dynamic_update_index_in_dim(lse, lse_g, g, axis=0)

        # the first chunk seeds the buffers, so they are allocated when it is done (not hoisted as zeros)
        out_0, lse_0 = chunk(0)
        out = lax.dynamic_update_slice_in_dim(_zeros(q.shape, q.dtype, out_0), out_0, 0, axis=2)
        lse = lax.dynamic_update_index_in_dim(_zeros((chunks, *lse_0.shape), F32, lse_0), lse_0, 0, axis=0)
        out, lse = lax.fori_loop(1, chunks, body, (out, lse))
        return out, (q, k, v, seg, positions, out, lse)

    def backward(res: tuple, dout: jax.Array) -> tuple:
        q, k, v, seg, positions, out, lse = res
        delta = jnp.sum(dout.astype(F32) * out.astype(F32), axis=-1, keepdims=True)  # [b, n, H, 1]

        def unrepeat(d: jax.Array) -> jax.Array:  # [b, n, hkv·repeat, d] -> [b, n, hkv, d] (summed in fp32)
            return d.reshape(*d.shape[:2], hkv, repeat, d.shape[-1]).sum(3, dtype=F32).astype(k.dtype)

        def chunk(g: jax.Array | int) -> tuple:  # chunk g's dq, dk, dv (sequence shards)
            q_g, k_g, v_g = chunk_inputs(q, k, v, g)
            dout_g = to_heads(_heads(dout, g * hq, hq))
            delta_g = to_heads(_heads(delta, g * hq, hq))[..., 0]
            lse_g = lax.dynamic_index_in_dim(lse, g, axis=0, keepdims=False)
            dq_g, dk_g, dv_g = ops.backward(q_g, k_g, v_g, dout_g, lse_g, delta_g, positions, positions, seg, seg, **kw)
            return to_seq(dq_g), unrepeat(to_seq(dk_g)), unrepeat(to_seq(dv_g))

        def put(grads: tuple, parts: tuple, g: jax.Array | int) -> tuple:
            return tuple(
                lax.dynamic_update_slice_in_dim(d, part, g * h, axis=2)
                for d, part, h in zip(grads, parts, (hq, hkv, hkv), strict=True)
            )

        first = chunk(0)
        seeded = put(tuple(_zeros(x.shape, x.dtype, d) for x, d in zip((q, k, v), first, strict=True)), first, 0)
        grads = lax.fori_loop(1, chunks, lambda g, grads: put(grads, chunk(g), g), seeded)
        return *grads, None, None

    attend.defvjp(forward, backward)
    return attend(q, k, v, seg, positions)


def _zeros(shape: tuple[int, ...], dtype: jnp.dtype, like: jax.Array) -> jax.Array:
    return vary_like(jnp.zeros(shape, dtype), like)


__all__ = ["check_chunk_count", "check_head_chunks", "chunked_ulysses_core"]
