"""Ring attention (context parallelism) with contiguous, zig-zag and striped layouts.

The Ultra-Scale Playbook's ring, for P devices on the `sp` axis, each holding n = S/P tokens of Q, K, V:

  for step in 0 .. P-1:
      send the current K/V block to the next rank (non-blocking: issued before this step's compute)
      attend the local Q to the current K/V block, merge (out, lse) with an online softmax
      receive the previous rank's K/V block (it becomes current)

At step t, rank r holds the K/V block of rank (r - t) mod P; its true positions follow from the layout, so
the causal mask is exact for every layout. Each rank's tokens are split into position runs (two for zig-zag),
and a (Q run, K/V run) pair that the causal mask hides completely is skipped: with zig-zag every rank then
does the same work (2P+1 half-chunk pairs), with contiguous rank r does r+1 blocks.

Backward (`jax.custom_vjp`): residuals are only q, k, v, out, lse (local, no received K/V, no scores).
K/V travel the ring again, in the opposite direction, with their dK/dV accumulators (fp32); after P sends
dK/dV are home:

  delta = rowsum(dO * O)
  for step in 0 .. P-1:
      send K/V to the previous rank (except at the last step)
      dQ += block_dq;  dK/dV(current block) += block_dk/dv   (global lse and delta: block grads add up)
      send the dK/dV accumulators to the previous rank, with their block

Communication per rank: forward 2(P-1) K/V blocks; backward 2(P-1) K/V blocks + 2P fp32 dK/dV blocks
(plus the int32 segment ids with K/V when given). The per-block compute is a `BlockOps` pair
(`blockwise.py`): jnp on CPU, the Pallas flash kernel on GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.attention.blockwise import BlockOps, get_block_ops
from jaxring.attention.layout import RankTokens
from jaxring.attention.masking import check_qkv
from jaxring.attention.merge import empty_partial
from jaxring.attention.schedule import backward_run_pairs, forward_run_pairs, pair_work, split_runs
from jaxring.collectives import ring_steps, send_to_next

# The backward ring turns the other way (rank r sends to r-1). Either direction is correct; a permutation
# different from the forward's also keeps XLA from merging the backward's K/V sends with the forward's,
# which would hold every received K/V block alive between the passes.
BACKWARD_SHIFT = -1


def ring_attention(q, k, v, segment_ids=None, *, axis_name="sp", layout: str = "zigzag", causal: bool = True,
                   sm_scale: float | None = None, block_ops: str | BlockOps = "auto", inner_ranks: int = 1):
    """Ring attention over `axis_name`; call inside `shard_map` with the sequence already in `layout`.

    Args:
      q: local [batch, n, q_heads, head_dim]; k, v: local [batch, n, kv_heads, head_dim] (GQA: only the
        existing K/V heads travel).
      segment_ids: local int [batch, n] or None; 0 = padding.
      layout: "contiguous", "zigzag" or "striped": how this rank's tokens were chosen (see layout.py).
      inner_ranks: each ring rank holds the layout shards of this many consecutive layout ranks (USP).
    Returns: out, local [batch, n, q_heads, head_dim] in q.dtype.
    """
    check_qkv(q, k, v)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k/v local seq {k.shape[1]} must equal q local seq {q.shape[1]} (self-attention)")
    tokens = RankTokens(layout, inner_ranks)
    if q.shape[1] % (tokens.runs() * inner_ranks):
        raise ValueError(f"local seq {q.shape[1]} must split into {inner_ranks} rank shards of "
                         f"{tokens.runs()} position runs each ({layout} layout)")
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    return _ring(q, k, v, segment_ids, axis_name, tokens, causal, scale, get_block_ops(block_ops))


def _parts(tokens: RankTokens, causal):
    """Position runs to split a rank's tokens into: only causal masking can skip a run pair."""
    return tokens.runs() if causal else 1


def ring_forward(q, k, v, segment_ids, axis_name, tokens: RankTokens, causal, sm_scale, ops: BlockOps):
    """The forward ring. Returns out fp32, lse fp32 [b, n, hq] and the work done here (query-key pairs, fp32)."""
    p, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
    n, parts = q.shape[1], _parts(tokens, causal)
    q_pos = tokens.positions(rank, p, n)

    def attend(carry, kv, step):
        acc, work = carry
        k, v, kv_seg = kv
        kv_pos = tokens.positions((rank - step) % p, p, n)
        acc, pairs = forward_run_pairs(ops, acc, q, q_pos, segment_ids, k, v, kv_pos, kv_seg, parts=parts,
                                       causal=causal, sm_scale=sm_scale)
        return acc, work + sum(pair_work(*pair) for pair in pairs)

    init = (tuple(empty_partial(x) for x in split_runs(q, parts, 1)), jnp.zeros_like(q_pos[0], jnp.float32))
    acc, work = ring_steps(attend, init, (k, v, segment_ids), p, lambda kv: send_to_next(kv, axis_name))
    out = jnp.concatenate([a[0] for a in acc], axis=1)
    lse = jnp.concatenate([a[1] for a in acc], axis=1)
    return out, lse, work


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ring(q, k, v, segment_ids, axis_name, tokens, causal, sm_scale, ops):
    out, _, _ = ring_forward(q, k, v, segment_ids, axis_name, tokens, causal, sm_scale, ops)
    return out.astype(q.dtype)


def _ring_fwd(q, k, v, segment_ids, axis_name, tokens, causal, sm_scale, ops):
    out, lse, _ = ring_forward(q, k, v, segment_ids, axis_name, tokens, causal, sm_scale, ops)
    out = out.astype(q.dtype)
    return out, (q, k, v, segment_ids, out, lse)


def _ring_bwd(axis_name, tokens, causal, sm_scale, ops, residuals, dout):
    q, k, v, segment_ids, out, lse = residuals
    p, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
    n, parts = q.shape[1], _parts(tokens, causal)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    q_pos = tokens.positions(rank, p, n)
    send = lambda tree: send_to_next(tree, axis_name, shift=BACKWARD_SHIFT)

    def grads(carry, kv, step):
        dq, dkv = carry
        k, v, kv_seg = kv
        kv_pos = tokens.positions((rank - BACKWARD_SHIFT * step) % p, p, n)
        dq, dk, dv = backward_run_pairs(ops, (dq, *dkv), q, dout, lse, delta, q_pos, segment_ids, k, v, kv_pos,
                                        kv_seg, parts=parts, causal=causal, sm_scale=sm_scale)
        return dq, send((dk, dv))  # dK/dV travel with their K/V block; the P-th send brings them home

    init = (jnp.zeros_like(q, jnp.float32), (jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)))
    dq, dkv = ring_steps(grads, init, (k, v, segment_ids), p, send)
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)
