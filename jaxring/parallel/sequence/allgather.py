"""All-gather context parallelism (the Llama-3 style): gather K/V, attend locally, reduce-scatter dK/dV.

For P devices on the `sp` axis, each holding n = S/P tokens:

  k, v = all_gather(k, v)            # [b, n, Hkv, d] -> [b, S, Hkv, d], every rank's tokens in rank order
  out = attention(q, k, v)           # local Q (true positions) against the whole K/V: flash attention

Backward (the transpose of the all-gather): dK, dV of the whole sequence are reduce-scattered
(`psum_scatter`) back to their owners. Forward traffic 2 all-gathers of (P-1) K/V blocks; backward the same
again as reduce-scatters of dK/dV (in the input dtype). Simpler than the ring and it overlaps nothing, and it
keeps the gathered K/V (S tokens) alive for the backward: memory O(S) per device, unlike the ring's O(S/P).

With a sliding window the gathered K/V are put in natural order first (one static gather; its transpose in
the backward), so each query tile's window is one contiguous band of key tiles and the kernel visits only
that band (in rank order a zig-zag or striped layout scatters it over several ranks' shards).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.kernels.block_compute import local_attention
from jaxring.kernels.blockwise import BlockOps
from jaxring.kernels.layout import gathered_positions, layout_positions, natural_order
from jaxring.kernels.masking import check_qkv
from jaxring.kernels.window_work import layout_window_share
from jaxring.parallel.cost_terms import F32, AttentionCost, AttentionShape, Transfer, segment_once
from jaxring.parallel.registry import SequenceStrategy


def allgather_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    axis_name: str | tuple[str, ...] = "sp",
    layout: str = "zigzag",
    causal: bool = True,
    sm_scale: float | None = None,
    block_ops: str | BlockOps = "auto",
    window: int | None = None,
) -> jax.Array:
    """All-gather attention inside `shard_map`, sequence already in `layout`; shapes as `ring_attention`
    (window: the sliding window, see `ring_attention`; the local flash attention visits only its band)."""
    check_qkv(q, k, v)
    p, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
    n = q.shape[1]
    q_positions = layout_positions(layout, rank, p, n)
    kv_positions = gathered_positions(layout, 0, p, p, n)  # every rank's tokens, in rank order
    k, v = (lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (k, v))
    kv_seg = None if segment_ids is None else lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)
    order = None if window is None else natural_order(layout, n * p, p)
    if order is not None:  # the window's keys: one band of tiles
        k, v = k[:, order], v[:, order]
        kv_seg = None if kv_seg is None else kv_seg[:, order]
        kv_positions = jnp.arange(n * p, dtype=jnp.int32)
    return local_attention(
        block_ops,
        q,
        k,
        v,
        causal=causal,
        sm_scale=sm_scale,
        q_positions=q_positions,
        kv_positions=kv_positions,
        segment_ids=segment_ids,
        kv_segment_ids=kv_seg,
        window=window,
    )


# ---------------------------------------------------------------------------------------- cost


def allgather_cost(s: AttentionShape, options: dict) -> AttentionCost:
    """The module docstring's traffic: all-gathers of (P-1) K and V blocks forward, reduce-scatters of the
    same backward, nothing overlapped. Kept: the gathered K/V (the whole sequence, fp32 here), out and lse.
    Working: the gathered K/V and their fp32 gradients; the block's columns are the whole sequence. Packed
    documents: the K/V segment ids all-gathered (`jaxring.parallel.cost_terms.segment_once`). A sliding window: the local
    kernel visits the band of key tiles (put in natural order) its layout shard reaches; the busiest rank's
    share (`layout_window_share`)."""
    del options
    P, axes = s.sp, tuple(s.axes)
    kv = s.kv_bytes(s.e)
    # On CPU the gathered K/V of the layer's backward are its saved ones read back (dynamic slices of the
    # residual stack, which the layer's working share already counts): GPT sp8 of benchmarks/memory_model.py,
    # fp32, at the peak two f32[1,2048,8,16] slices (2 MiB) beside the fp32 dK/dV (2 MiB); counted twice the
    # estimate was 1.14x the compiled step
    gathered = 0 if s.cpu else 2 * P * s.kv_bytes(s.em)
    return AttentionCost(
        transfers=(
            Transfer("all-gather K/V forward", axes, 2 * (P - 1) * kv, 2),
            Transfer("reduce-scatter dK/dV backward", axes, 2 * (P - 1) * kv, 2),
            *segment_once("K/V segment ids all-gather", axes, (P - 1) * s.segment_bytes()),
        ),
        saved=2 * P * s.kv_bytes(F32) + s.q_bytes(F32) + s.rows_bytes(),
        working=gathered + 2 * P * s.kv_bytes(F32) + s.q_bytes(F32),
        block_k=s.seq_len,
        window_share=layout_window_share(s.layout, P, s.n, s.window, s.cpu, s.d) if s.window else 1.0,
    )


# ---------------------------------------------------------------------------------------- registry entry


STRATEGY = SequenceStrategy(
    "allgather",
    "all-gather context parallelism: gather K/V, reduce-scatter dK/dV (Llama 3)",
    attend=allgather_attention,
    cost=allgather_cost,
)
