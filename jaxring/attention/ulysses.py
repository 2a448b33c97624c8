"""DeepSpeed-Ulysses (all-to-all sequence parallelism) and its hybrid with ring attention (USP).

Ulysses, for P devices on the `sp` axis, each holding n = S/P tokens of every head:

  q, k, v = all_to_all(q, k, v)      # [b, n, H, d] -> [b, S, H/P, d]: the whole sequence, H/P heads
  out = attention(q, k, v)           # local flash attention over all S tokens (true positions)
  out = all_to_all(out)              # [b, S, H/P, d] -> [b, n, H, d]

Four all-to-alls forward; their transposes (four more) in the backward, each moving (P-1)/P of a local
block. The local attention is `flash_attention` (FA2 backward, recomputes from out and lse), so nothing of
size S² is stored. Query heads must divide by P. GQA: K/V heads are repeated only as far as needed, to
lcm(kv_heads, P), before the all-to-all (none when P divides kv_heads).

USP (`usp_attention`): the sequence axis factored as (ring R) × (Ulysses U), U × R = P. The all-to-alls run
over the U devices of a Ulysses group, which then holds the tokens of U layout ranks for H/U heads; ring
attention over the R groups finishes the job. Traffic: 4 all-to-alls over U, plus ring attention over R on
blocks U times larger with H/U heads.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring.attention.blockwise import BlockOps
from jaxring.attention.flash import flash_attention
from jaxring.attention.layout import RankTokens, gathered_positions
from jaxring.attention.masking import check_qkv
from jaxring.attention.ring import ring_attention


def local_implementation(block_ops) -> str | None:
    """The `flash_attention` implementation matching a block-ops choice."""
    name = block_ops.name if isinstance(block_ops, BlockOps) else block_ops
    if name in ("auto", "jnp", "pallas", "pallas_interpret"):
        return None if name == "auto" else name
    raise ValueError(
        f"block_ops {name!r}: this strategy computes locally with flash_attention, which takes "
        f"'auto', 'jnp', 'pallas' or 'pallas_interpret'"
    )


def check_heads_split(q_heads: int, degree: int, what: str = "sp") -> None:
    if q_heads % degree:
        raise ValueError(
            f"query heads {q_heads} are not divisible by the Ulysses degree {what} = {degree}: "
            f"each device takes query heads / {what} of them"
        )


def repeat_kv_for_split(k, degree: int):
    """Repeats each K/V head so the head count becomes lcm(kv_heads, degree) (unchanged when divisible)."""
    kv_heads = k.shape[2]
    factor = math.lcm(kv_heads, degree) // kv_heads
    return k if factor == 1 else jnp.repeat(k, factor, axis=2)


def seq_to_heads(x, axis_name):
    """[b, n, h, d] sequence shard -> [b, n*P, h/P, d] head shard (one all-to-all)."""
    return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x, axis_name):
    """Inverse of `seq_to_heads`."""
    return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def ulysses_attention(
    q,
    k,
    v,
    segment_ids=None,
    *,
    axis_name="sp",
    layout: str = "contiguous",
    causal: bool = True,
    sm_scale: float | None = None,
    block_ops="auto",
):
    """Ulysses attention inside `shard_map`, sequence already in `layout`; shapes as `ring_attention`."""
    check_qkv(q, k, v)
    p = lax.axis_size(axis_name)
    check_heads_split(q.shape[2], p)
    n = q.shape[1]
    k, v = repeat_kv_for_split(k, p), repeat_kv_for_split(v, p)
    positions = gathered_positions(layout, 0, p, p, n)  # every rank's tokens, in rank order
    seg = None if segment_ids is None else lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)
    q, k, v = (seq_to_heads(x, axis_name) for x in (q, k, v))
    out = flash_attention(
        q,
        k,
        v,
        causal=causal,
        sm_scale=sm_scale,
        q_positions=positions,
        kv_positions=positions,
        segment_ids=seg,
        implementation=local_implementation(block_ops),
    )
    return heads_to_seq(out, axis_name)


def usp_attention(
    q,
    k,
    v,
    segment_ids=None,
    *,
    ring_axis,
    ulysses_axis,
    layout: str = "zigzag",
    causal: bool = True,
    sm_scale: float | None = None,
    block_ops="auto",
):
    """USP inside `shard_map` over (ring_axis, ulysses_axis); the sequence rank is ring * U + ulysses."""
    check_qkv(q, k, v)
    u = lax.axis_size(ulysses_axis)
    check_heads_split(q.shape[2], u, "ulysses_size")
    k, v = repeat_kv_for_split(k, u), repeat_kv_for_split(v, u)
    seg = None if segment_ids is None else lax.all_gather(segment_ids, ulysses_axis, axis=1, tiled=True)
    q, k, v = (seq_to_heads(x, ulysses_axis) for x in (q, k, v))
    order = RankTokens(layout, u).run_order(q.shape[1])  # gathered shards -> contiguous position runs
    if order is not None:
        q, k, v = (x[:, order] for x in (q, k, v))
        seg = None if seg is None else seg[:, order]
    out = ring_attention(
        q,
        k,
        v,
        seg,
        axis_name=ring_axis,
        layout=layout,
        causal=causal,
        sm_scale=sm_scale,
        block_ops=block_ops,
        inner_ranks=u,
    )
    if order is not None:
        out = out[:, np.argsort(order)]
    return heads_to_seq(out, ulysses_axis)
