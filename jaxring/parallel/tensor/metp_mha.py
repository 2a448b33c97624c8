"""Memory-efficient tensor parallelism, METP [METP] (REFERENCES.md), its two-level MHA (attention).

Everything here runs inside `shard_map` over one axis (`tp`) of size p (`metp.py` is the tensor method, its
layouts and cost model; `metp_api.py` the same layers on global arrays). METP splits the *sequence* over
tp: rank i holds the token shard X_i = A_(i,:) and 1/p of every weight; activations never move, weights do.

Two-level MHA, Algorithms 3-6 (`metp_attention`): head group j = heads j·n/p .. (j+1)·n/p.

  for j in 0 .. p-1:                                              (outer loop, Algorithm 5)
      rank j broadcasts W_qkv_j (its q, k, v columns) and W_proj_j (log-tree ppermutes; the next group's
          broadcast is issued before this group's compute)
      (Q_ij, K_ij, V_ij) = X_i W_qkv_j  (+ RoPE from the tokens' positions)
      A_ij = K/V ring over the sequence shards with the online softmax  (inner loop, Algorithm 3)
      O_i += A_ij W_proj_j

Backward (Algorithm 6, custom_vjp): residuals X_i, A_i and the logsumexp only (plus the inputs). For each j:
broadcast the weights again, ΔW_proj_j = A_ijᵀ ΔO_i, recompute Q, K, V, ΔA_ij = ΔO_i W_proj_jᵀ, the inner
backward ring (Algorithm 4, ΔK/ΔV travel with K/V and make p hops; on GPU one hop behind their K/V, each hop
one fused transfer issued before the block kernels, `_inner_backward`), ΔX_i += [ΔQ ΔK ΔV] W_qkv_jᵀ,
ΔW_qkv_j = X_iᵀ [ΔQ ΔK ΔV]; then ΔW_qkv_j and ΔW_proj_j are tree-reduced onto rank j (at the end of step j,
not overlapped with the next step; ΔW, ΔK, ΔV in fp32). Per device, elements: forward p·ceil(log2 p)·|W_j| + p(p-1)·2|K_j|;
backward 2p·ceil(log2 p)·|W_j| + p(2p-1)·2|K_j| (|K_j| = b(s/p)(n_kv/p)d; with n_kv = n the paper's
4·log2(p)·h² + 2(p-1)/p·bsh forward, and (4p-2)/p·bsh instead of its 4(p-1)/p·bsh backward: the extra hop).

Causal masking (the paper omits it) uses the tokens' positions, so it is exact for any token layout: each
K/V block travels with its int32 positions (b·s/p a hop), and a block entirely in the future of the local
queries is skipped (`lax.cond`). A sliding window W (query i sees keys i - W < j <= i) masks by the same
positions, and an inner-ring step whose block lies wholly outside every local query's window is skipped too
(its hop stays, its FLOPs go; forward and backward). GQA: the kv heads split into the same p groups (num_kv_heads % p == 0).
The per-block attention is a `BlockOps` pair (jnp on CPU, the Pallas flash kernel on GPU), called per batch
row when causal (positions are per row).

Weights replicated over dp/fsdp: the custom VJPs return each shard's weight gradient summed over the data
axes (one psum of the rank's blocks at the end), which is what shard_map's varying-axes types expect.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxring.core.collectives import (
    BACKWARD,
    FORWARD,
    prefetch_steps,
    ring_steps,
    ring_steps_accumulating,
    send_to_next,
    tree_broadcast,
    tree_reduce,
    waits_for,
)
from jaxring.core.vma import sum_like, vary_like
from jaxring.kernels.block_compute import get_block_ops
from jaxring.kernels.blockwise import BlockOps, unless_hidden, with_window
from jaxring.kernels.layer_math import add_bias, head_norm
from jaxring.kernels.masking import check_window, positions_may_meet, segments_may_meet
from jaxring.kernels.merge import empty_partial, merge_partials
from jaxring.kernels.rope import Rope, as_rope
from jaxring.parallel.sequence.ring import fuse_by_default
from jaxring.parallel.sequence.ring_step import when_visible
from jaxring.parallel.tensor.contract import KEPT_RESIDUAL, MATMUL_OUTPUT
from jaxring.parallel.tensor.metp_matmul import mm, outer, row_sum

__all__ = ["PROJECTION_ROWS", "metp_attention"]


# Rows of the local sequence per chunk of the projections summed over the head groups (`_grouped_projection`)
PROJECTION_ROWS = 4096


def _grouped_projection(ts: Sequence[jax.Array], ws: Sequence[jax.Array], dtype: jnp.dtype, rows: int) -> jax.Array:
    """Σ_i Σ_j T_i[j] W_i[j] over the p head groups j, chunk by chunk of rows: [b, n, h] in `dtype`.

    ts: per-group activations stacked [p, b, n, k_i] (x.dtype); ws: the groups' weight blocks stacked
    [p, k_i, h]. Each chunk of `rows` tokens is summed in fp32 and cast once, so no fp32 [b, n, h] (nor one
    per group) is ever whole: at 512K tokens a device, one is 8 GiB. The same sums as accumulating
    T_i[j] W_i[j] group by group in fp32 (Algorithm 5's O_i += A_ij W_proj_j, Algorithm 6's ΔX_i)."""
    b, n = ts[0].shape[1:3]
    size = next(d for d in range(min(rows, n), 0, -1) if n % d == 0)

    def chunk(start: jax.Array | int) -> jax.Array:
        rows_of = lambda t: lax.dynamic_slice_in_dim(t, start, size, axis=2)
        out = sum(
            jnp.einsum("pbnk,pkh->bnh", rows_of(t), w, preferred_element_type=jnp.float32) for t, w in zip(ts, ws)
        )
        return out.astype(dtype)

    if size == n:
        return chunk(0)
    out = jnp.zeros_like(ts[0], dtype, shape=(b, n, ws[0].shape[-1]))
    write = lambda i, out: lax.dynamic_update_slice_in_dim(out, chunk(i * size), i * size, axis=1)
    return lax.fori_loop(0, n // size, write, out)


# ---------------------------------------------------------------------------------------------------------
# Two-level MHA (Algorithms 3-6)
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _MhaConfig:
    axis_name: str
    heads: int  # query heads per group, n/p
    kv_heads: int  # kv heads per group, n_kv/p
    head_dim: int
    causal: bool
    rope: Rope | None
    sm_scale: float
    ops: BlockOps
    fuse: bool = False  # the inner ring's hops as one buffer each, dK/dV one hop behind (GPU form)
    norm_eps: float = 1e-6  # QK-norm's RMSNorm eps
    window: int | None = None  # sliding window (causal): query i sees keys i - window < j <= i
    projection_rows: int = PROJECTION_ROWS  # rows per chunk of the summed projections (O_i, ΔX_i)


def metp_attention(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    wo: jax.Array,
    positions: jax.Array,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    axis_name: str = "tp",
    causal: bool = True,
    rope_theta: Rope | float | None = 10000.0,
    block_ops: str | BlockOps = "auto",
    fuse_sends: bool | None = None,
    extras: dict | None = None,
    norm_eps: float = 1e-6,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    token_order: jax.Array | None = None,
) -> jax.Array:
    """Two-level METP multi-head self-attention (Algorithms 3-6), inside `shard_map` over `axis_name` (p).

    Args:
      x: local sequence shard X_i [batch, s/p, hidden].
      wq: local [hidden, (num_heads/p)·head_dim], rank i's head group (heads i·n/p .. (i+1)·n/p, head-major
        columns); wk, wv: [hidden, (num_kv_heads/p)·head_dim] (the same group's kv heads); wo: [(num_heads/p)
        ·head_dim, hidden] (the group's rows of W_proj).
      positions: local int [batch, s/p], the tokens' RoPE positions (and the causal mask's, unless
        `token_order` is given).
      num_heads, num_kv_heads: global head counts (GQA when num_kv_heads < num_heads).
      rope_theta: a theta (plain RoPE), a `jaxring.kernels.rope.Rope`, or None.
      extras: optional biases bq [(num_heads/p)·head_dim], bk/bv [(num_kv_heads/p)·head_dim] (the group's,
        broadcast with its weights), bo [hidden] (added to O_i), and the QK-norm scales q_norm/k_norm
        [head_dim] (replicated; RMSNorm per head with eps `norm_eps`, before RoPE).
      fuse_sends: the inner ring's GPU form: each hop's K, V and positions (in the backward with the
        previous block's ΔK/ΔV, one hop behind) as one buffer sent before the block kernels, so a GPU
        overlaps every hop with them. Default: with the compiled Pallas kernels (GPU) only.
      window: sliding window W (needs causal): the query at position i sees keys i - W < j <= i; inner-ring
        steps outside every local query's window are skipped. None: unlimited.
      segment_ids: local int [batch, s/p] or None: packed documents, a query sees only keys of its segment
        (0: padding). They travel the inner ring with K/V; a step whose blocks share no segment is skipped.
      token_order: local int [batch, s/p], the tokens' order in the row for the causal mask and the window
        (packed documents restart their RoPE positions; the mask follows the row); default `positions`.
    Returns: O_i [batch, s/p, hidden] in x.dtype. Differentiable in x and the weights (custom_vjp).
    """
    p = lax.axis_size(axis_name)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    window = check_window(window, bool(causal))
    if x.ndim != 3:
        raise ValueError(f"x has shape {x.shape}; expected [batch, s/p, hidden]")
    if num_heads % p or num_kv_heads % p:
        raise ValueError(
            f"num_heads {num_heads} and num_kv_heads {num_kv_heads} must be divisible by the "
            f"METP degree p = {p} (one head group per rank)"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads} (GQA)")
    heads, kv_heads = num_heads // p, num_kv_heads // p
    if wq.ndim != 2 or wq.shape[1] % heads:
        raise ValueError(f"wq block has shape {wq.shape}; expected [hidden, (num_heads/p)·head_dim]")
    d = wq.shape[1] // heads
    h = x.shape[-1]
    for name, w, want in (
        ("wq", wq, (h, heads * d)),
        ("wk", wk, (h, kv_heads * d)),
        ("wv", wv, (h, kv_heads * d)),
        ("wo", wo, (heads * d, h)),
    ):
        if w.shape != want:
            raise ValueError(
                f"{name} block has shape {w.shape}; expected {want} (hidden {h}, {heads} q heads "
                f"and {kv_heads} kv heads of dim {d} per group)"
            )
    order = positions if token_order is None else token_order
    for name, t in (("positions", positions), ("token_order", order), ("segment_ids", segment_ids)):
        if t is not None and t.shape != x.shape[:2]:
            raise ValueError(f"{name} has shape {t.shape}; expected [batch, s/p] = {x.shape[:2]}")
    if rope_theta is not None and d % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {d}")
    extras = extras or {}
    biases = tuple(extras[n] for n in ("bq", "bk", "bv") if n in extras)
    norms = tuple(extras[n] for n in ("q_norm", "k_norm") if n in extras)
    for name, group, count in (("bq, bk, bv", biases, 3), ("q_norm, k_norm", norms, 2)):
        if group and len(group) != count:
            raise ValueError(f"extras must hold all of {name} or none of them; got {sorted(extras)}")
    for name, bias, w in zip(("bq", "bk", "bv"), biases, (wq, wk, wv)):
        if bias.shape != w.shape[1:]:
            raise ValueError(f"{name} block has shape {bias.shape}; expected {w.shape[1:]}")
    for name, scale in zip(("q_norm", "k_norm"), norms):
        if scale.shape != (d,):
            raise ValueError(f"{name} has shape {scale.shape}; expected [head_dim] = {(d,)}")
    ops = get_block_ops(block_ops)
    cfg = _MhaConfig(
        axis_name,
        heads,
        kv_heads,
        d,
        bool(causal),
        as_rope(rope_theta),
        d**-0.5,
        ops,
        fuse_by_default(ops, fuse_sends),
        float(norm_eps),
        window,
        PROJECTION_ROWS,
    )
    # O_i = Σ_j A_ij W_proj_j is a weight matmul's output: named, so selective remat keeps it (the layer's
    # MLP input depends on it) instead of running the two-level rings again in the backward
    tokens = _Tokens(positions, order, segment_ids)
    out = checkpoint_name(_mha(x, (wq, wk, wv, wo), biases, norms, tokens, cfg), MATMUL_OUTPUT)
    return add_bias(out, extras.get("bo"))


class _Tokens(typing.NamedTuple):
    """The local tokens' int [b, s/p] arrays: RoPE positions, order in the row (the causal mask's), and
    segment ids (None: one document)."""

    rope: jax.Array
    order: jax.Array
    segments: jax.Array | None


def _heads(t: jax.Array, scale: jax.Array | None, positions: jax.Array, cfg: _MhaConfig):
    """A projection [b, s/p, heads, d] as attention sees it: QK-norm (scale [d], or None), then RoPE."""
    t = head_norm(t, scale, eps=cfg.norm_eps)
    return t if cfg.rope is None else cfg.rope.apply(t, positions)


def _linear(x: jax.Array, w: jax.Array, bias: jax.Array | None, cfg: _MhaConfig):
    """X_i W_j (+ b_j) as heads [b, s/p, heads, d] in x.dtype."""
    b, n = x.shape[:2]
    y = mm(x, w)
    y = y if bias is None else y + bias.astype(jnp.float32)
    return y.astype(x.dtype).reshape(b, n, -1, cfg.head_dim)


def _project(
    x: jax.Array,
    w_j: tuple[jax.Array, ...],
    biases_j: tuple[jax.Array, ...],
    norms: tuple[jax.Array, ...],
    positions: jax.Array,
    cfg: _MhaConfig,
):
    """(Q_ij, K_ij, V_ij) = X_i W_qkv_j (+ b_qkv_j, QK-norm, RoPE): [b, s/p, heads, d] in x.dtype."""
    biases_j = biases_j or (None, None, None)
    q, k, v = (_linear(x, w, bias, cfg) for w, bias in zip(w_j[:3], biases_j))
    q_norm, k_norm = norms or (None, None)
    return _heads(q, q_norm, positions, cfg), _heads(k, k_norm, positions, cfg), v


def _block_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    cfg: _MhaConfig,
):
    """One (Q block, K/V block) through the BlockOps forward, positions (and segment ids) per batch row."""
    if not cfg.causal:
        zeros = jnp.zeros((q.shape[1],), jnp.int32)
        return cfg.ops.forward(q, k, v, zeros, zeros, q_seg, kv_seg, causal=False, sm_scale=cfg.sm_scale)

    ops = with_window(cfg.ops, cfg.window)

    def one_row(
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        qp: jax.Array,
        kp: jax.Array,
        qs: jax.Array | None,
        ks: jax.Array | None,
    ) -> tuple[jax.Array, jax.Array]:
        qs, ks = (None, None) if qs is None else (qs[None], ks[None])
        o, lse = ops.forward(q[None], k[None], v[None], qp, kp, qs, ks, causal=True, sm_scale=cfg.sm_scale)
        return o[0], lse[0]

    return jax.vmap(one_row)(q, k, v, q_pos, kv_pos, q_seg, kv_seg)


def _block_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    da: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    cfg: _MhaConfig,
):
    if not cfg.causal:
        zeros = jnp.zeros((q.shape[1],), jnp.int32)
        return cfg.ops.backward(
            q, k, v, da, lse, delta, zeros, zeros, q_seg, kv_seg, causal=False, sm_scale=cfg.sm_scale
        )

    ops = with_window(cfg.ops, cfg.window)

    def one_row(
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        da: jax.Array,
        lse: jax.Array,
        delta: jax.Array,
        qp: jax.Array,
        kp: jax.Array,
        qs: jax.Array | None,
        ks: jax.Array | None,
    ) -> tuple[jax.Array, ...]:
        qs, ks = (None, None) if qs is None else (qs[None], ks[None])
        g = ops.backward(
            q[None], k[None], v[None], da[None], lse[None], delta[None], qp, kp, qs, ks, causal=True,
            sm_scale=cfg.sm_scale,
        )  # fmt: skip
        return tuple(x[0] for x in g)

    return jax.vmap(one_row)(q, k, v, da, lse, delta, q_pos, kv_pos, q_seg, kv_seg)


def _when_visible(
    cfg: _MhaConfig,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    compute: Callable[[], Any],
    skip: Callable[[], Any],
):
    """`schedule.when_visible`, also skipping a block wholly outside every query's window (by position bounds)
    or sharing no segment with the queries (by segment-id bounds: packed documents are numbered in order)."""
    if cfg.window is None and q_seg is None:
        return when_visible(cfg.causal, q_pos, kv_pos, compute, skip, lockstep=cfg.ops.lockstep)
    visible = positions_may_meet(q_pos, kv_pos, causal=cfg.causal, window=cfg.window)
    if q_seg is not None:
        visible = visible & segments_may_meet(q_seg, kv_seg)
    return unless_hidden(cfg.ops.lockstep, visible, compute, skip), visible


def _inner_forward(q: jax.Array, k: jax.Array, v: jax.Array, tokens: _Tokens, cfg: _MhaConfig):
    """Algorithm 3 (with the safe online softmax): Q_i stays, K/V of the head group go round the ring (with
    their order in the row when causal, and their segment ids). Returns A_ij fp32 [b, s/p, heads, d] and lse
    fp32 [b, s/p, heads].
    """
    p = lax.axis_size(cfg.axis_name)
    order, seg = tokens.order, tokens.segments

    def attend(acc: tuple[jax.Array, jax.Array], kv: tuple, j: jax.Array) -> tuple[jax.Array, jax.Array]:
        k_j, v_j, kv_pos, kv_seg = kv
        part, _ = _when_visible(
            cfg,
            order,
            kv_pos,  # a block wholly in the future (or of other documents): skipped
            seg,
            kv_seg,
            lambda: _block_forward(q, k_j, v_j, order, kv_pos, seg, kv_seg, cfg),
            lambda: empty_partial(q),
        )
        return merge_partials(*acc, *part)

    send = lambda kv: send_to_next(kv, cfg.axis_name, shift=FORWARD, fuse=cfg.fuse)
    return ring_steps(attend, empty_partial(q), (k, v, order if cfg.causal else None, seg), p, send)


def _inner_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    da: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    tokens: _Tokens,
    cfg: _MhaConfig,
):
    """Algorithm 4: ΔQ stays, ΔK/ΔV travel with K/V (p hops: home at the end). fp32 results.

    CPU form: each step adds its block's ΔK/ΔV and sends the sums on with the block (K, V, positions and
    ΔK, ΔV as separate transfers after the block kernels). GPU form (cfg.fuse): the sums travel one hop behind
    their block (`collectives.ring_steps_accumulating`), so each step's one fused transfer is issued before
    its block kernels and does not wait for them. Same sums, same hops. The CPU form stays on CPU because
    XLA:CPU gives every collective-permute the same op id, and the freer order let its in-process rendezvous
    pair different transfers there (see tests/unit/parallel/test_metp.py, test_attention_forward_backward_repeatable).
    """
    p = lax.axis_size(cfg.axis_name)
    send = lambda tree: send_to_next(tree, cfg.axis_name, shift=BACKWARD, fuse=cfg.fuse)

    order, seg = tokens.order, tokens.segments

    def block_grads(kv: tuple) -> tuple[jax.Array, jax.Array, jax.Array]:
        k_j, v_j, kv_pos, kv_seg = kv
        zeros = lambda: (
            jnp.zeros_like(q, jnp.float32),
            jnp.zeros_like(k_j, jnp.float32),
            jnp.zeros_like(v_j, jnp.float32),
        )
        grads, _ = _when_visible(
            cfg,
            order,
            kv_pos,
            seg,
            kv_seg,
            lambda: _block_backward(q, k_j, v_j, da, lse, delta, order, kv_pos, seg, kv_seg, cfg),
            zeros,
        )
        return grads

    kv = (k, v, order if cfg.causal else None, seg)
    if cfg.fuse:

        def accumulate(
            dq: jax.Array, kv: tuple, j: jax.Array, acc: tuple[jax.Array, jax.Array] | None
        ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            dq_j, dk_j, dv_j = block_grads(kv)
            dkv = (dk_j, dv_j) if acc is None else (acc[0] + dk_j, acc[1] + dv_j)  # after the kernels
            return dq + dq_j, dkv

        return ring_steps_accumulating(accumulate, jnp.zeros_like(q, jnp.float32), kv, p, send)

    def grads(carry: tuple, kv: tuple, j: jax.Array) -> tuple:
        dq, (dk, dv) = carry
        dq_j, dk_j, dv_j = block_grads(kv)
        return dq + dq_j, send((dk + dk_j, dv + dv_j))

    init = (jnp.zeros_like(q, jnp.float32), (jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)))
    return ring_steps(grads, init, kv, p, send)


def _outer_steps(
    step_fn: Callable[[Any, Any, jax.Array], Any], carry: Any, own: Any, axis_name: str, reverse: bool = False
):
    """for each head group j: carry = step_fn(carry, W_j, j), W_j = rank j's `own` blocks broadcast to all.

    Groups 0..p-1 (p-1..0 when `reverse`). The next group's broadcast is issued before this group's compute
    (double buffer): p broadcasts in all, each ceil(log2 p) ppermute rounds (`tree_broadcast`); a lax.scan
    over the first p-1 groups and the last alone.
    """
    p, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
    group = (lambda s: p - 1 - s) if reverse else (lambda s: s)
    # Only root's block matters; the tree never keeps what the other ranks send, so they send a fill. This
    # makes every round depend on root: otherwise XLA sees that the first round (every rank sends its own
    # block to rank + 1) is the same for every root and hoists it out of the loop (not the paper's schedule,
    # one more block held). The backward fills with another value so that XLA cannot merge its broadcasts
    # with the forward's when both passes are in one program (that would hold W_j from forward to backward).
    fill = 1.0 if reverse else 0.0
    broadcast = lambda root: jax.tree.map(
        lambda w: tree_broadcast(jnp.where(rank == root, w, jnp.full_like(w, fill)), axis_name, root), own
    )

    return prefetch_steps(
        lambda carry, w, s: step_fn(carry, w, group(s)),
        carry,
        broadcast(group(0)),
        lambda _, s: broadcast(group(s + 1)),
        p,
    )


def _mha_forward(
    x: jax.Array,
    weights: tuple[jax.Array, ...],
    biases: tuple[jax.Array, ...],
    norms: tuple[jax.Array, ...],
    tokens: _Tokens,
    cfg: _MhaConfig,
):
    """Algorithm 5. Returns O_i (x.dtype), A_i [p, b, s/p, heads, d] (x.dtype) and lse fp32 [p, b, s/p, heads].

    O_i = Σ_j A_ij W_proj_j is formed after the loop, from every group's A_ij and its W_proj_j (kept as they
    arrive: |W_proj| in all), chunk by chunk of rows (`_grouped_projection`): the same broadcasts as the
    paper's loop, without an fp32 [b, s/p, h] accumulator."""
    p = lax.axis_size(cfg.axis_name)
    b, n, _ = x.shape

    def head_group(carry: tuple, own_j: tuple, j: jax.Array) -> tuple:
        a_all, lse_all, wo_all = carry
        w_j, biases_j = own_j  # broadcast from rank j
        q, k, v = _project(x, w_j, biases_j, norms, tokens.rope, cfg)  # (Q_ij, K_ij, V_ij) = X_i W_qkv_j
        a, lse = _inner_forward(q, k, v, tokens, cfg)  # A_ij = METP_Attention(Q, K, V)
        return a_all.at[j].set(a.astype(x.dtype)), lse_all.at[j].set(lse), wo_all.at[j].set(w_j[3])

    wo = weights[3]
    init = (
        jnp.zeros_like(x, shape=(p, b, n, cfg.heads, cfg.head_dim)),
        jnp.zeros_like(x, jnp.float32, shape=(p, b, n, cfg.heads)),
        jnp.zeros_like(wo, shape=(p,) + wo.shape),
    )
    a_all, lse_all, wo_all = _outer_steps(head_group, init, (weights, biases), cfg.axis_name)
    o = _grouped_projection([a_all.reshape(p, b, n, -1)], [wo_all], x.dtype, cfg.projection_rows)
    return o, a_all, lse_all


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _mha(
    x: jax.Array,
    weights: tuple[jax.Array, ...],
    biases: tuple[jax.Array, ...],
    norms: tuple[jax.Array, ...],
    tokens: _Tokens,
    cfg: _MhaConfig,
):
    return _mha_forward(x, weights, biases, norms, tokens, cfg)[0]


def _mha_fwd(
    x: jax.Array,
    weights: tuple[jax.Array, ...],
    biases: tuple[jax.Array, ...],
    norms: tuple[jax.Array, ...],
    tokens: _Tokens,
    cfg: _MhaConfig,
):
    o, a, lse = _mha_forward(x, weights, biases, norms, tokens, cfg)
    # stored: X_i, the attention output A_i and its lse (+ the rank's own weight blocks and token arrays); named,
    # so that selective remat around the layer keeps them rather than running this forward again
    a, lse = checkpoint_name(a, KEPT_RESIDUAL), checkpoint_name(lse, KEPT_RESIDUAL)
    return o, (x, weights, biases, norms, tokens, a, lse)


def _mha_bwd(cfg: _MhaConfig, residuals: tuple, do: jax.Array):
    """Algorithm 6: broadcast W_j again, recompute Q, K, V, inner backward ring, tree-reduce ΔW_j onto rank j.

    The head groups go in reverse order (any order is correct). Weight gradients are fp32 until the end.
    """
    x, weights, biases, norms, tokens, a_all, lse_all = residuals
    rank = lax.axis_index(cfg.axis_name)
    b, n, _ = x.shape
    flat = lambda g: g.astype(x.dtype).reshape(b, n, -1)
    # the QK-norm scales as varying copies: their vjp is then this rank's share (an invariant scale's vjp
    # would already be psummed over tp, and sum_like below sums the shares once)
    q_norm, k_norm = jax.tree.map(lambda t: vary_like(t, x), norms) if norms else (None, None)
    post = lambda t, scale: _heads(t, scale, tokens.rope, cfg)

    def head_group(carry: tuple, own_j: tuple, j: jax.Array) -> tuple:
        dqkv_all, wqkv_all, dw_own, dnorms = carry
        w_j, biases_j = own_j  # broadcast from rank j (again)
        wq, wk, wv, wo = w_j
        a, lse = a_all[j], lse_all[j]
        dwo = outer(a.reshape(b, n, -1), do)  # ΔW_proj_j = A_ijᵀ ΔO_i
        q, k, v = (_linear(x, w, bias, cfg) for w, bias in zip(w_j[:3], biases_j or (None,) * 3))
        (q, q_vjp), (k, k_vjp) = jax.vjp(post, q, q_norm), jax.vjp(post, k, k_norm)  # recompute Q, K (QK-norm, RoPE)
        da = mm(do, wo.T).reshape(a.shape).astype(x.dtype)  # ΔA_ij = ΔO_i W_proj_jᵀ
        delta = jnp.sum(da.astype(jnp.float32) * a.astype(jnp.float32), axis=-1)  # D_i = rowsum(ΔA ⊙ A)
        dq, (dk, dv) = _inner_backward(q, k, v, da, lse, delta, tokens, cfg)
        dq, dq_norm = q_vjp(dq.astype(x.dtype))  # through RoPE (a rotation: its transpose) and the QK-norm
        dq = flat(dq)
        dwq = outer(x, dq)  # ΔQ's GEMM first: in the GPU form
        if cfg.fuse:  # ΔK/ΔV are still on their last hop home
            (dk, dv), dwq = lax.optimization_barrier(((dk, dv), dwq))
        dk, dk_norm = k_vjp(dk.astype(x.dtype))
        dk, dv = flat(dk), flat(dv)
        # ΔX_i += [ΔQ ΔK ΔV] W_qkv_jᵀ: after the loop, from every group's (kept here with its W_qkv_jᵀ)
        dqkv_all = tuple(t.at[j].set(g) for t, g in zip(dqkv_all, (dq, dk, dv)))
        wqkv_all = tuple(t.at[j].set(w.T) for t, w in zip(wqkv_all, (wq, wk, wv)))
        dw = (dwq, outer(x, dk), outer(x, dv), dwo)  # ΔW_qkv_j = X_iᵀ [ΔQ ΔK ΔV], ΔW_proj_j
        db = tuple(row_sum(g) for g in (dq, dk, dv)) if biases else ()  # Δb_qkv_j
        dw = waits_for(dw, (dk, dv))  # XLA:CPU: ΔW_proj's reduce after the inner ring, not beside it
        reduced = jax.tree.map(lambda g: tree_reduce(g, cfg.axis_name, j), (dw, db))  # Reduce onto rank j
        dw_own = jax.tree.map(lambda new, old: jnp.where(rank == j, new, old), reduced, dw_own)
        if norms:  # the QK-norm scales are shared by every head: summed here, over tp at the end
            dnorms = (dnorms[0] + dq_norm.astype(jnp.float32), dnorms[1] + dk_norm.astype(jnp.float32))
        return dqkv_all, wqkv_all, dw_own, dnorms

    p = lax.axis_size(cfg.axis_name)
    zeros = lambda w: vary_like(jnp.zeros_like(w, jnp.float32), x)
    stacks = tuple(jnp.zeros_like(x, shape=(p, b, n, w.shape[1])) for w in weights[:3])
    blocks = tuple(jnp.zeros_like(w, shape=(p, w.shape[1], w.shape[0])) for w in weights[:3])
    init = (stacks, blocks, jax.tree.map(zeros, (weights, biases)), jax.tree.map(zeros, norms))
    dqkv, wqkv, (dw, db), dn = _outer_steps(head_group, init, (weights, biases), cfg.axis_name, reverse=True)
    dx = _grouped_projection(dqkv, wqkv, x.dtype, cfg.projection_rows)
    grads = lambda gs, ws: tuple(sum_like(g, w).astype(w.dtype) for g, w in zip(gs, ws))
    return dx, grads(dw, weights), grads(db, biases), grads(dn, norms), None


_mha.defvjp(_mha_fwd, _mha_bwd)
