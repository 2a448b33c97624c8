"""USP: the hybrid of DeepSpeed-Ulysses and ring attention (Fang & Zhao, USP in the bibliography).

The sequence axis of P devices is factored as (ring R) × (Ulysses U), U × R = P. The all-to-alls run over the
U devices of a Ulysses group, which then holds the tokens of U layout ranks for H/U heads; ring attention over
the R groups finishes the job:

  q, k, v = all_to_all_U(q, k, v)    # [b, n, H, d] -> [b, U·n, H/U, d]: U ranks' tokens, H/U heads
  out = ring_attention_R(q, k, v)    # blocks U times longer, H/U heads, over the R ring groups
  out = all_to_all_U(out)            # back to [b, n, H, d]

Traffic: 4 all-to-alls over U, plus ring attention over R on blocks U times larger with H/U heads. A sliding
window is the ring's: its steps outside every query's window are skipped (the hop stays, the FLOPs go).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh

from jaxring.core.mesh import factored_mesh
from jaxring.kernels.blockwise import BlockOps
from jaxring.kernels.layout import RankTokens
from jaxring.kernels.masking import check_qkv
from jaxring.parallel.cost_terms import F32, AttentionCost, AttentionShape, Transfer, segment_once, segment_ring
from jaxring.parallel.registry import Option, SequenceStrategy
from jaxring.parallel.sequence.head_exchange import check_heads_split, heads_to_seq, repeat_kv_for_split, seq_to_heads
from jaxring.parallel.sequence.ring import q_tiles, ring_attention, ring_window_share

USP_AXES = ("usp_ring", "usp_ulysses")


def usp_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    axis_name: tuple[str, str] = USP_AXES,
    layout: str = "zigzag",
    causal: bool = True,
    sm_scale: float | None = None,
    block_ops: str | BlockOps = "auto",
    window: int | None = None,
    ulysses_size: int | None = None,
) -> jax.Array:
    """USP inside `shard_map`; shapes as `ring_attention`.

    axis_name: (ring axis, Ulysses axis), the sequence rank is ring * U + ulysses (`factored_mesh` of sp into
      USP_AXES, as the registry's view does). ulysses_size: U, checked against the Ulysses axis when given.
    window: the sliding window (see `ring_attention`)."""
    check_qkv(q, k, v)
    ring_axis, ulysses_axis = axis_name
    u = lax.axis_size(ulysses_axis)
    if ulysses_size is not None and ulysses_size != u:
        raise ValueError(f"ulysses_size U={ulysses_size} does not match the Ulysses axis {ulysses_axis!r} of size {u}")
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
        window=window,
    )
    if order is not None:
        out = out[:, np.argsort(order)]
    return heads_to_seq(out, ulysses_axis)


# ---------------------------------------------------------------------------------------- cost


def usp_cost(s: AttentionShape, options: dict) -> AttentionCost:
    """Ulysses' 4 all-to-alls each way over U (K/V heads repeated to lcm(kv_heads, U)), and ring attention
    over R = P/U on blocks U× longer with 1/U of the heads (hidden behind the block compute). Kept: the ring's
    out and lse per step and Q tile on CPU, the head-sharded q, k, v. Working: the ring's. Packed documents:
    the segment ids all-gathered over U, then riding the ring's hops (U× longer blocks). A sliding window: the
    ring's steps outside it compute nothing (`ring_window_share` of the R ring ranks' U·n tokens: a rank's
    gathered zig-zag shards are the zig-zag runs of a ring of R)."""
    U = options["ulysses_size"]
    r = s.sp // U
    ring_axis, ulysses_axis = s.axes
    kv_u = math.lcm(s.kv_heads, U)
    a2a = (U - 1) / U * s.b * s.n * s.d * s.e * (2 * s.heads + 2 * kv_u)
    blk = s.b * s.n * U * (kv_u // U) * s.d  # the ring's block: U× the tokens, 1/U of the heads
    transfers = []
    if U > 1:
        transfers += [
            Transfer("USP Ulysses all-to-alls forward", (ulysses_axis,), a2a, 4),
            Transfer("USP Ulysses all-to-alls backward", (ulysses_axis,), a2a, 4),
            *segment_once("USP segment ids all-gather", (ulysses_axis,), (U - 1) * s.segment_bytes()),
        ]
    if r > 1:
        transfers += [
            Transfer("USP ring K/V forward", (ring_axis,), 2 * (r - 1) * blk * s.e, r - 1, "attention"),
            Transfer("USP ring backward", (ring_axis,), 2 * (r - 1) * blk * s.e + 2 * r * blk * F32, r, "attention"),
            *segment_ring("USP ring segment ids", (ring_axis,), r - 1, U * s.segment_bytes(), s.cpu),
        ]
    q32, kv32 = s.q_bytes(F32), s.kv_bytes(F32)
    return AttentionCost(
        transfers=tuple(transfers),
        saved=(r if s.cpu else 1) * q_tiles(s.n * U, s.cpu) * (q32 + s.rows_bytes()) + q32 + 2 * kv32,
        working=4 * s.kv_bytes(s.em) + 4 * kv32 + q32,
        window_share=ring_window_share(s.layout, r, s.n * U, s.window) if s.window and r > 1 else 1.0,
        peak_in_core=True,
    )


# ---------------------------------------------------------------------------------------- registry entry


def _view(mesh: Mesh, options: dict, axis: str):
    sp, u = mesh.shape[axis], options["ulysses_size"]
    return factored_mesh(mesh, axis, USP_AXES, (sp // u, u)), USP_AXES


def _check_ulysses_size(u: object, sp: int) -> None:
    if isinstance(u, bool) or not isinstance(u, int) or u < 1 or sp % u:
        raise ValueError(f"ulysses_size U={u!r} must be a positive integer dividing sp = {sp}")


def _check_heads(q_heads: int, kv_heads: int, sp: int, options: dict) -> None:
    del kv_heads, sp
    check_heads_split(q_heads, options["ulysses_size"], "ulysses_size")


STRATEGY = SequenceStrategy(
    "usp",
    "USP: Ulysses over U devices × ring over sp / U",
    attend=usp_attention,
    view=_view,
    check_heads=_check_heads,
    cost=usp_cost,
    options=(
        Option(
            "ulysses_size",
            "U, the Ulysses degree: U dividing sp",
            _check_ulysses_size,
            required=True,
            search=lambda sp: [u for u in range(2, sp) if sp % u == 0],
        ),
    ),
)
