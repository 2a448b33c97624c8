"""DeepSpeed-Ulysses: all-to-all sequence parallelism.

Ulysses, for P devices on the `sp` axis, each holding n = S/P tokens of every head:

  q, k, v = all_to_all(q, k, v)      # [b, n, H, d] -> [b, S, H/P, d]: the whole sequence, H/P heads
  out = attention(q, k, v)           # local flash attention over all S tokens (true positions)
  out = all_to_all(out)              # [b, S, H/P, d] -> [b, n, H, d]

Four all-to-alls forward; their transposes (four more) in the backward, each moving (P-1)/P of a local
block. The local attention is `flash_attention` (FA2 backward, recomputes from out and lse), so nothing of
size S² is stored. With a sliding window the gathered sequence is put in natural order around the local
attention (static gathers), so the kernel visits only the band of tiles the window reaches. Query heads must divide by P. GQA: K/V heads are repeated only as far as needed, to
lcm(kv_heads, P), before the all-to-all (none when P divides kv_heads).

Its hybrid with ring attention, USP, is `usp.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring.kernels.block_compute import get_block_ops, local_attention
from jaxring.kernels.blockwise import BlockOps
from jaxring.kernels.layout import gathered_positions, natural_order
from jaxring.kernels.masking import check_qkv
from jaxring.kernels.window_work import layout_window_share
from jaxring.parallel.cost_terms import F32, AttentionCost, AttentionShape, Transfer, segment_once
from jaxring.parallel.registry import Option, SequenceStrategy
from jaxring.parallel.sequence.head_exchange import check_heads_split, heads_to_seq, repeat_kv_for_split, seq_to_heads
from jaxring.parallel.sequence.ulysses_chunked import (
    check_chunk_count,
    check_head_chunks,
    chunked_ulysses_core,
    untied_ulysses_core,
)


def ulysses_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    axis_name: str | tuple[str, ...] = "sp",
    layout: str = "contiguous",
    causal: bool = True,
    sm_scale: float | None = None,
    block_ops: str | BlockOps = "auto",
    window: int | None = None,
    head_chunks: int = 1,
) -> jax.Array:
    """Ulysses attention inside `shard_map`, sequence already in `layout`; shapes as `ring_attention`
    (window: the sliding window, see `ring_attention`). head_chunks > 1: the attention runs a chunk of each
    device's heads at a time (UPipe, `ulysses_chunked.py`), with the per-block compute of `block_ops`."""
    check_qkv(q, k, v)
    p = lax.axis_size(axis_name)
    check_heads_split(q.shape[2], p)
    n = q.shape[1]
    positions = gathered_positions(layout, 0, p, p, n)  # every rank's tokens, in rank order
    seg = None if segment_ids is None else lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)
    order = None if window is None else natural_order(layout, n * p, p)
    if head_chunks > 1:
        check_head_chunks(head_chunks, q.shape[2], k.shape[2], p)
        seg, positions = _in_natural_order(seg, positions, order)
        return chunked_ulysses_core(
            q,
            k,
            v,
            seg,
            positions,
            axis_name=axis_name,
            chunks=head_chunks,
            ops=get_block_ops(block_ops),
            causal=causal,
            sm_scale=q.shape[-1] ** -0.5 if sm_scale is None else sm_scale,
            window=window,
            order=order,
        )
    k, v = repeat_kv_for_split(k, p), repeat_kv_for_split(v, p)
    q, k, v = (seq_to_heads(x, axis_name) for x in (q, k, v))
    if order is not None:  # the window's keys: one band of tiles
        q, k, v = (x[:, order] for x in (q, k, v))
        seg = None if seg is None else seg[:, order]
        positions = jnp.arange(n * p, dtype=jnp.int32)
    out = local_attention(
        block_ops,
        q,
        k,
        v,
        causal=causal,
        sm_scale=sm_scale,
        q_positions=positions,
        kv_positions=positions,
        segment_ids=seg,
        window=window,
    )
    if order is not None:
        out = out[:, np.argsort(order)]
    return heads_to_seq(out, axis_name)


def _in_natural_order(seg: jax.Array | None, positions: jax.Array, order: np.ndarray | None) -> tuple:
    """A window's band for the chunked cores: the gathered segment ids and positions in natural order."""
    if order is None:
        return seg, positions
    return None if seg is None else seg[:, order], jnp.arange(positions.shape[0], dtype=jnp.int32)


def ulysses_untied_attention(
    project: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]],
    x: jax.Array,
    rope_positions: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    axis_name: str | tuple[str, ...] = "sp",
    layout: str = "contiguous",
    causal: bool = True,
    sm_scale: float | None = None,
    block_ops: str | BlockOps = "auto",
    window: int | None = None,
    head_chunks: int = 2,
) -> jax.Array:
    """UPipe's head chunks with the projections inside each chunk (`untied_ulysses_core`), inside `shard_map`:
    x [b, n, hidden] this device's tokens in `layout`; project(x, rope_positions, g) -> chunk g's q [b, n,
    heads/G, head_dim] and k, v [b, n, kv_heads/G, head_dim]. Returns out [b, n, heads, head_dim], as
    `ulysses_attention` of the whole projections would."""
    p = lax.axis_size(axis_name)
    check_heads_split(heads, p)
    check_head_chunks(head_chunks, heads, kv_heads, p)
    n = x.shape[1]
    positions = gathered_positions(layout, 0, p, p, n)
    seg = None if segment_ids is None else lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)
    order = None if window is None else natural_order(layout, n * p, p)
    seg, positions = _in_natural_order(seg, positions, order)
    return untied_ulysses_core(
        project,
        x,
        rope_positions,
        seg,
        positions,
        heads=heads,
        kv_heads=kv_heads,
        axis_name=axis_name,
        chunks=head_chunks,
        ops=get_block_ops(block_ops),
        causal=causal,
        sm_scale=head_dim**-0.5 if sm_scale is None else sm_scale,
        window=window,
        order=order,
    )


# ---------------------------------------------------------------------------------------- cost


def ulysses_cost(s: AttentionShape, options: dict) -> AttentionCost:
    """The module docstring's traffic (DeepSpeed-Ulysses: 4 all-to-alls a layer each way), each moving
    (P-1)/P of q, k, v (K/V heads repeated to lcm(kv_heads, P)) or out; with G head chunks (UPipe) 4 a chunk
    forward, 8 backward (q, k, v, dout and delta to the heads; dq, dk, dv back), K/V repeated per chunk. Kept: the head-sharded q, k, v, out
    and lse of the local flash attention (the GPU kernels' in the activation dtype, the CPU block ops' in
    fp32). Working: their gradients, the fitted `gradient_copies` times over (one chunk's with UPipe's untied head
    chunks, beside the chunks' results assembled into whole arrays: `untied_chunks_assembly` head-sharded q's
    bytes; without the projections inside the chunks, G is priced as 1); the
    block is the whole sequence for heads / P heads. Packed documents: the segment ids all-gathered
    (`jaxring.parallel.cost_terms.segment_once`). A sliding window: the local kernel visits the band of tiles
    it reaches in the whole sequence, put in natural order (`layout_window_share`)."""
    P, axes = s.sp, tuple(s.axes)
    g = options.get("head_chunks", 1)
    chunks = g if s.tiled_block else 1  # the head chunks that lower memory (their projections inside them)
    kv_sent = math.lcm(s.kv_heads, P)
    token = (P - 1) / P * s.b * s.n * s.d * s.e  # one head of one all-to-all
    forward, backward = token * (2 * s.heads + 2 * kv_sent), token * (2 * s.heads + 2 * kv_sent)
    if g > 1:  # each chunk repeats its K/V heads to a multiple of P; the backward sends q, k, v again (and delta)
        kv_sent_chunks = g * math.lcm(s.kv_heads // g, P)
        forward = token * (2 * s.heads + 2 * kv_sent_chunks)
        backward = token * (3 * s.heads + 4 * kv_sent_chunks) + (P - 1) / P * s.b * s.n * s.heads * F32
    act = F32 if s.cpu else s.em  # the GPU flash kernels keep q, k, v, out in the activation dtype
    q_act, kv_act = s.q_bytes(act), s.b * s.n * s.d * kv_sent * act
    return AttentionCost(
        transfers=(
            Transfer("Ulysses all-to-alls forward (q, k, v, out)", axes, forward, 4 * g),
            Transfer("Ulysses all-to-alls backward", axes, backward, 4 * g if g == 1 else 8 * g),
            *segment_once("Ulysses segment ids all-gather", axes, (P - 1) * s.segment_bytes()),
        ),
        saved=3 * q_act + 2 * kv_act + s.rows_bytes(),
        working=s.fitted["gradient_copies"] * (q_act + s.kv_bytes(act)) / chunks
        + (s.fitted["untied_chunks_assembly"] * q_act if chunks > 1 else 0.0),
        block_q=s.seq_len,
        block_k=s.seq_len,
        tile_heads=max(1, s.heads // P),
        window_share=layout_window_share("contiguous", 1, s.seq_len, s.window, s.cpu, s.d) if s.window else 1.0,
        peak_in_core=True,
    )


# ---------------------------------------------------------------------------------------- registry entry


def _check_heads(q_heads: int, kv_heads: int, sp: int, options: dict) -> None:
    check_heads_split(q_heads, sp)
    check_head_chunks(options.get("head_chunks", 1), q_heads, kv_heads, sp)


STRATEGY = SequenceStrategy(
    "ulysses",
    "DeepSpeed-Ulysses: all-to-all sequence <-> heads around local attention",
    attend=ulysses_attention,
    projects=lambda options: options.get("head_chunks", 1) > 1,  # UPipe: each chunk's projections inside it
    attend_projected=ulysses_untied_attention,
    projected_chunks=lambda options: options.get("head_chunks", 1),
    default_layout="contiguous",
    check_heads=_check_heads,
    cost=ulysses_cost,
    options=(
        Option(
            "head_chunks",
            "G: attention runs a 1/G chunk of each device's query heads at a time (UPipe); 1: all at once",
            check_chunk_count,
            default=1,
            # the planner's: chunks cost transfers (K/V repeated per chunk, q, k, v sent again backward), so a
            # plan takes them where nothing without them fits (their projections inside: the tiled block)
            search=lambda sp: (1, 2, 4),
        ),
    ),
)
