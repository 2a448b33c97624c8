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

Kept for the backward: q, k, v and out (the sequence shards) and the fp32 lse; the backward sends q, k, v to
the heads again (Ulysses keeps them head-sharded instead). K/V heads are repeated per chunk to a multiple of
P, so with GQA they move up to G times Ulysses' bytes. Rules: G divides the K/V heads, P divides H/G.

That alone leaves q, k, v, dq, dk, dv whole on the device, and they set the peak of a layer's backward at
long context (8 GiB each for Llama-3-8B at 8M tokens on 8 GPUs). UPipe's untied heads take the projections
into the chunks too (`untied_ulysses_core`, from the tiled block): chunk g's q, k, v are made from the layer's
input x by its slice of Wq, Wk, Wv, forward and backward, so only x, out, dout and dx are whole. Each chunk
is a whole attention: the kernels write its results in the inputs' dtype. The chunks run one after another
(`_after`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

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
        def chunk(g: jax.Array | int, before: tuple) -> tuple[jax.Array, jax.Array]:  # chunk g's out, lse
            inputs = chunk_inputs(*_after(before, (q, k, v)), g)
            out_g, lse_g = ops.forward(*inputs, positions, positions, seg, seg, **kw)
            return to_seq(out_g), lse_g

        out, lse = _each_chunk(chunk, chunks, hq, q.shape[2], q.dtype)
        return out, (q, k, v, seg, positions, out, lse)

    def backward(res: tuple, dout: jax.Array) -> tuple:
        q, k, v, seg, positions, out, lse = res
        delta = jnp.sum(dout.astype(F32) * out.astype(F32), axis=-1, keepdims=True)  # [b, n, H, 1]

        def chunk(g: jax.Array | int, before: tuple = ()) -> tuple:  # chunk g's dq, dk, dv (sequence shards)
            q_g, k_g, v_g = chunk_inputs(*_after(before, (q, k, v)), g)
            dout_g = to_heads(_heads(dout, g * hq, hq))
            delta_g = to_heads(_heads(delta, g * hq, hq))[..., 0]
            lse_g = lax.dynamic_index_in_dim(lse, g, axis=0, keepdims=False)
            dq_g, dk_g, dv_g = ops.backward(q_g, k_g, v_g, dout_g, lse_g, delta_g, positions, positions, seg, seg, **kw)
            return to_seq(dq_g), *(_unrepeat(to_seq(d), hkv, repeat) for d in (dk_g, dv_g))

        def put(grads: tuple, parts: tuple, g: jax.Array | int) -> tuple:
            return tuple(
                lax.dynamic_update_slice_in_dim(d, part, g * h, axis=2)
                for d, part, h in zip(grads, parts, (hq, hkv, hkv), strict=True)
            )

        first = chunk(0)
        seeded = put(tuple(_zeros(x.shape, x.dtype, d) for x, d in zip((q, k, v), first, strict=True)), first, 0)
        grads = lax.fori_loop(1, chunks, lambda g, grads: put(grads, chunk(g, grads), g), seeded)
        return *grads, None, None

    attend.defvjp(forward, backward)
    return attend(q, k, v, seg, positions)


def _after(before: object, x: object) -> object:
    """x, held back until `before` (the previous chunk's results) exists: chunks run one after the other, never
    side by side (XLA unrolls a loop of one trip, G = 2, and would schedule both chunks' buffers at once)."""
    return lax.optimization_barrier((x, before))[0]


def _each_chunk(chunk: Callable, chunks: int, hq: int, heads: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """out [b, n, heads, d] and lse [G, b, S, hq/P] of chunk(g, before) -> (out_g [b, n, hq, d], lse_g) for
    every chunk g in turn; the first seeds the buffers, so they are allocated when it is done (not as zeros
    hoisted before it)."""

    def body(g: jax.Array, carry: tuple) -> tuple:
        out, lse = carry
        out_g, lse_g = chunk(g, carry)
        out = lax.dynamic_update_slice_in_dim(out, out_g, g * hq, axis=2)
        return out, lax.dynamic_update_index_in_dim(lse, lse_g, g, axis=0)

    out_0, lse_0 = chunk(0, ())
    shape = (*out_0.shape[:2], heads, out_0.shape[3])
    out = lax.dynamic_update_slice_in_dim(_zeros(shape, dtype, out_0), out_0, 0, axis=2)
    lse = lax.dynamic_update_index_in_dim(_zeros((chunks, *lse_0.shape), F32, lse_0), lse_0, 0, axis=0)
    return lax.fori_loop(1, chunks, body, (out, lse))


def _unrepeat(d: jax.Array, hkv: int, repeat: int) -> jax.Array:
    """[b, n, hkv·repeat, d] -> [b, n, hkv, d]: the repeated K/V heads' gradients summed (in fp32)."""
    return d.reshape(*d.shape[:2], hkv, repeat, d.shape[-1]).sum(3, dtype=F32).astype(d.dtype)


def _inexact(a: jax.Array) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


def _zeros(shape: tuple[int, ...], dtype: jnp.dtype, like: jax.Array) -> jax.Array:
    return vary_like(jnp.zeros(shape, dtype), like)


def untied_ulysses_core(
    project: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]],
    x: jax.Array,
    rope_positions: jax.Array,
    seg: jax.Array | None,
    positions: jax.Array,
    *,
    heads: int,
    kv_heads: int,
    axis_name: str | tuple[str, ...],
    chunks: int,
    ops: BlockOps,
    causal: bool,
    sm_scale: float,
    window: int | None,
    order: np.ndarray | None,
) -> jax.Array:
    """UPipe with its projections per chunk ("untied heads"): the module docstring's loops, with chunk g's q, k,
    v made from x by `project(x, rope_positions, g)` (-> q_g [b, n, H/G, d], k_g, v_g [b, n, KV/G, d], this
    device's sequence shard) inside each chunk, forward and backward. So q, k, v and their gradients exist a
    chunk at a time, never whole: the backward holds x, out, dout and dx whole, and one chunk's projections.

        backward, for each chunk g:
            (q_g, k_g, v_g), vjp = vjp(project, x, weights, g)        # the chunk's projections again
            dq_g, dk_g, dv_g = the chunk's all-to-alls and attention backward (from out and lse)
            dx, dweights += vjp(dq_g, dk_g, dv_g)

    x [b, n, h] (the layer's input, sequence shard); rope_positions int [b, n]; seg, positions, order as
    `chunked_ulysses_core`; what `project` closes over (weights, norm scales) gets its gradient. Returns out
    [b, n, H, d] in x's dtype."""
    p = lax.axis_size(axis_name)
    ops = with_window(ops, window)
    inverse = None if order is None else np.argsort(order)
    kw = dict(causal=causal, sm_scale=sm_scale, dtype=x.dtype)  # a chunk is a whole attention: no fp32 sums
    hq, hkv = heads // chunks, kv_heads // chunks
    repeat = math.lcm(hkv, p) // hkv
    closed, consts = jax.closure_convert(project, x, rope_positions, jnp.int32(0))

    def to_heads(y: jax.Array) -> jax.Array:
        y = seq_to_heads(y, axis_name)
        return y if order is None else y[:, order]

    def to_seq(y: jax.Array) -> jax.Array:
        return heads_to_seq(y if inverse is None else y[:, inverse], axis_name)

    def heads_of(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple:
        return to_heads(q), to_heads(repeat_kv_for_split(k, p)), to_heads(repeat_kv_for_split(v, p))

    @jax.custom_vjp
    def attend(x: jax.Array, consts: list, rope_positions: jax.Array, seg: jax.Array | None, positions: jax.Array):
        return forward(x, consts, rope_positions, seg, positions)[0]

    def forward(x: jax.Array, consts: list, rope_positions: jax.Array, seg: jax.Array | None, positions: jax.Array):
        def chunk(g: jax.Array | int, before: tuple) -> tuple[jax.Array, jax.Array]:
            q_g, k_g, v_g = closed(_after(before, x), rope_positions, jnp.int32(g), *consts)
            out_g, lse_g = ops.forward(*heads_of(q_g, k_g, v_g), positions, positions, seg, seg, **kw)
            return to_seq(out_g), lse_g

        out, lse = _each_chunk(chunk, chunks, hq, heads, x.dtype)
        return out, (x, consts, rope_positions, seg, positions, out, lse)

    def backward(res: tuple, dout: jax.Array) -> tuple:
        x, consts, rope_positions, seg, positions, out, lse = res
        delta = jnp.sum(dout.astype(F32) * out.astype(F32), axis=-1, keepdims=True)  # [b, n, H, 1]

        def chunk(g: jax.Array | int, before: tuple = ()) -> tuple:  # chunk g's d(x), d(consts)
            g = jnp.int32(g)
            (q_g, k_g, v_g), vjp = jax.vjp(lambda x, c: closed(x, rope_positions, g, *c), _after(before, x), consts)
            dout_g = to_heads(_heads(dout, g * hq, hq))
            delta_g = to_heads(_heads(delta, g * hq, hq))[..., 0]
            lse_g = lax.dynamic_index_in_dim(lse, g, axis=0, keepdims=False)
            heads = heads_of(q_g, k_g, v_g)
            dq_g, dk_g, dv_g = ops.backward(*heads, dout_g, lse_g, delta_g, positions, positions, seg, seg, **kw)
            return vjp((to_seq(dq_g), *(_unrepeat(to_seq(d), hkv, repeat) for d in (dk_g, dv_g))))

        def add(total: tuple, part: tuple) -> tuple:  # d(x) in x's dtype (as autodiff sums q, k, v's), weights fp32
            return jax.tree.map(lambda t, d: t + d.astype(t.dtype) if _inexact(d) else t, total, part)

        dx, dconsts = chunk(0)
        total = (dx, jax.tree.map(lambda d: d.astype(F32) if _inexact(d) else d, dconsts))
        dx, sums = lax.fori_loop(1, chunks, lambda g, total: add(total, chunk(g, total)), total)
        dconsts = jax.tree.map(lambda t, d: t.astype(d.dtype) if _inexact(d) else d, sums, dconsts)
        return dx, dconsts, None, None, None

    attend.defvjp(forward, backward)
    return attend(x, consts, rope_positions, seg, positions)


__all__ = ["check_chunk_count", "check_head_chunks", "chunked_ulysses_core", "untied_ulysses_core"]
