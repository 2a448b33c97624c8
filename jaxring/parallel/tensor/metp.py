"""Memory-efficient tensor parallelism, METP [METP] (REFERENCES.md): O = f(AB)C on a ring, and two-level METP for MHA.

Everything here runs inside `shard_map` over one axis (`tp`) of size p, except the model-facing entry points
(`mlp_block`, `attention_block`, `param_specs`) which take global arrays. METP splits the *sequence* over
tp: rank i holds the token shard X_i = A_(i,:) and 1/p of every weight; activations never move, weights do.

Generic ring, Eq. (1), Algorithms 1-2 (`metp`): rank i holds A_i (rows), B_(:,i) and C_(i,:) and owns
O_i = Σ_r f(A_i B_r) C_r. The (B, C) blocks circulate; rank i holds block (i - j) mod p at step j:

  for j in 0 .. p-1:
      send (B, C) to rank i+1, receive the next pair from rank i-1 (issued before the compute: double buffer)
      T = A_i B^(j);  O_i += f(T) C^(j)

(Algorithm 1 sends to i-1; jaxring's rings all turn one way, `collectives.FORWARD`: the direction does not
change the sums or the bytes.)

Backward (`jax.custom_vjp`, recompute): the residuals are A_i and the rank's own B, C blocks only (no T, no
f(T)). The blocks go round again, with their gradient accumulators:

      T = A_i B^(j);  D = f(T);  ΔD = ΔO_i C^(j)ᵀ;  ΔC^(j) += Dᵀ ΔO_i;  ΔT = f'(T) ⊙ ΔD
      ΔA_i += ΔT B^(j)ᵀ;  ΔB^(j) += A_iᵀ ΔT;  send (ΔB, ΔC) on with their block

ΔB, ΔC make p hops (not p-1) so that they end on their owner: per device the forward moves (p-1) block pairs
and the backward (p-1) pairs plus p gradient pairs, (3p-2)/p·(k1k2 + k2n) elements in all (fp32
accumulators). The backward ring turns the other way (`collectives.BACKWARD`: rank i sends to i-1, holding
block (i + j) mod p) and carries the blocks transposed (Bᵀ, Cᵀ, the operands of ΔT Bᵀ
and ΔO Cᵀ): a hop identical to the forward's would let XLA reuse it when both passes are in one program,
holding the received blocks from forward to backward. The FFN is A = X, B = W_in (and W_gate for SwiGLU:
f takes both products, both blocks circulate), C = W_out.

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
import math
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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
from jaxring.core.mesh import DATA_AXES, mesh_axis_size, spec_entry
from jaxring.core.sharded import run_local
from jaxring.core.vma import vary_like, varying_axes
from jaxring.kernels.block_compute import get_block_ops
from jaxring.kernels.blockwise import BlockOps, with_window
from jaxring.kernels.masking import check_window, positions_may_meet, segments_may_meet
from jaxring.kernels.merge import empty_partial, merge_partials
from jaxring.kernels.rope import Rope, as_rope
from jaxring.parallel.cost_terms import F32, AttentionCost, LocalDims, ModelShape, Transfer, tree_rounds
from jaxring.parallel.sequence.ring import fuse_by_default
from jaxring.parallel.sequence.ring_step import when_visible
from jaxring.parallel.tensor.contract import (
    ACTIVATIONS,
    KEPT_RESIDUAL,
    MATMUL_OUTPUT,
    ParamInfo,
    TensorMethod,
    add_bias,
    check_kv_heads,
    head_norm,
    modulation_gradients,
    own_kv_head,
)

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxring.parallel.plan import ParallelPlan


def _mm(x: jax.Array, w: jax.Array):
    """x [..., k] @ w [k, n] with fp32 accumulation.

    Written as a dot with a unit batch dimension (XLA removes it): selective remat keeps the outputs of dots
    without batch dimensions, and would keep these products from inside METP's loops too, though METP's
    custom VJPs recompute them (their residuals are X_i, A_i and the lse only).
    """
    out = jnp.einsum("zmk,zkn->zmn", x.reshape(1, -1, x.shape[-1]), w[None], preferred_element_type=jnp.float32)
    return out.reshape(*x.shape[:-1], w.shape[-1])


def _sum_to(g: jax.Array, like: jax.Array):
    """A weight's gradient summed over the axes it varies over and the weight does not (the data axes:
    a weight replicated over dp/fsdp gets the psum of its per-shard gradients)."""
    extra = tuple(sorted(varying_axes(g) - varying_axes(like)))
    return lax.psum(g, extra) if extra else g


def _row_sum(dy: jax.Array):
    """Σ over rows of dy [..., n] -> [n] fp32 (a bias gradient)."""
    return jnp.sum(dy.reshape(-1, dy.shape[-1]).astype(jnp.float32), axis=0)


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


def _outer(x: jax.Array, dy: jax.Array):
    """Σ over rows of xᵀ dy: x [..., k], dy [..., n] -> [k, n] fp32 (a weight gradient)."""
    return jnp.einsum("...k,...n->kn", x, dy, preferred_element_type=jnp.float32)


def gelu(t: jax.Array) -> jax.Array:
    """f of the GeLU FFN (Eq. 2): tanh-approximate GeLU."""
    return jax.nn.gelu(t, approximate=True)


def swiglu(t_gate: jax.Array, t_in: jax.Array) -> jax.Array:
    """f of the SwiGLU FFN: silu(X W_gate) ⊙ (X W_in)."""
    return jax.nn.silu(t_gate) * t_in


# ---------------------------------------------------------------------------------------------------------
# O = f(AB)C (Algorithms 1-2)
# ---------------------------------------------------------------------------------------------------------


def metp(
    a: jax.Array,
    b: jax.Array | Sequence[jax.Array],
    c: jax.Array,
    *,
    f: Callable[..., jax.Array] = gelu,
    axis_name: str = "tp",
    b_bias: jax.Array | Sequence[jax.Array] | None = None,
) -> jax.Array:
    """O_i = Σ_r f(A_i B_r + β_r) C_r on a ring over `axis_name` (call inside `shard_map`).

    Args:
      a: local rows A_i [..., k1] (e.g. this rank's sequence shard [batch, s/p, hidden]); never moves.
      b: local column block B_(:,i) [k1, k2/p], or a tuple of them when f takes several products
        (SwiGLU: (W_gate block, W_in block)).
      c: local row block C_(i,:) [k2/p, n].
      f: element-wise function of the product(s) A_i B_r (one argument per B block).
      b_bias: optional bias blocks β_(i) [k2/p] of the products, one per B block (like b); they travel with
        their B block (and their gradients with ΔB).
    Returns: O_i [..., n] in a.dtype. Differentiable (custom_vjp: recompute, gradients ride the ring).
    """
    bs = tuple(b) if isinstance(b, (tuple, list)) else (b,)
    biases = () if b_bias is None else tuple(b_bias) if isinstance(b_bias, (tuple, list)) else (b_bias,)
    if biases and (len(biases) != len(bs) or any(x.shape != bs[0].shape[1:] for x in biases)):
        raise ValueError(f"b_bias {[x.shape for x in biases]} must be one [k2/p] = {bs[0].shape[1:]} block per B block")
    if not bs:
        raise ValueError("b must be an array or a non-empty tuple of arrays")
    for i, b_ in enumerate(bs):
        if b_.ndim != 2 or b_.shape != bs[0].shape:
            raise ValueError(f"b[{i}] has shape {b_.shape}; every B block must be [k1, k2/p] = {bs[0].shape}")
    if bs[0].shape[0] != a.shape[-1]:
        raise ValueError(f"a's last dim {a.shape[-1]} must equal B's rows k1 = {bs[0].shape[0]}")
    if c.ndim != 2 or c.shape[0] != bs[0].shape[1]:
        raise ValueError(f"c has shape {c.shape}; expected [k2/p, n] with k2/p = {bs[0].shape[1]}")
    return _metp(a, bs, biases, c, f, axis_name)


def _products(a: jax.Array, bs: Sequence[jax.Array], biases: Sequence[jax.Array]):
    """T_ij = A_i B^(j) (+ β^(j)), fp32."""
    t = [_mm(a, b_j) for b_j in bs]
    return [t_r + beta.astype(jnp.float32) for t_r, beta in zip(t, biases)] if biases else t


def _metp_forward(
    a: jax.Array,
    bs: tuple[jax.Array, ...],
    biases: tuple[jax.Array, ...],
    c: jax.Array,
    f: Callable[..., jax.Array],
    axis_name: str,
):
    """Algorithm 1. Returns O_i fp32."""
    p = lax.axis_size(axis_name)

    def step(o: jax.Array, blocks: tuple, j: jax.Array) -> jax.Array:
        bs_j, biases_j, c_j = blocks
        t = _products(a, bs_j, biases_j)  # T_ij = A_i B^(j)
        d = f(*t).astype(c_j.dtype)  # D_ij = f(T_ij)
        return o + _mm(d, c_j)  # O_i += D_ij C^(j)

    o = jnp.zeros_like(a, jnp.float32, shape=a.shape[:-1] + (c.shape[1],))
    send = lambda blocks: send_to_next(blocks, axis_name, shift=FORWARD)
    return ring_steps(step, o, (bs, biases, c), p, send)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _metp(
    a: jax.Array,
    bs: tuple[jax.Array, ...],
    biases: tuple[jax.Array, ...],
    c: jax.Array,
    f: Callable[..., jax.Array],
    axis_name: str,
):
    return _metp_forward(a, bs, biases, c, f, axis_name).astype(a.dtype)


def _metp_fwd(
    a: jax.Array,
    bs: tuple[jax.Array, ...],
    biases: tuple[jax.Array, ...],
    c: jax.Array,
    f: Callable[..., jax.Array],
    axis_name: str,
):
    return _metp(a, bs, biases, c, f, axis_name), (a, bs, biases, c)  # A_i (and the rank's own blocks) only


def _metp_bwd(f: Callable[..., jax.Array], axis_name: str, residuals: tuple, do: jax.Array):
    """Algorithm 2: recompute T, ΔB/ΔC accumulators travel with their blocks (p hops: home at the end).

    The blocks circulate transposed (Bᵀ, Cᵀ: the operands of ΔT Bᵀ and ΔO Cᵀ). Besides, at p = 2 both rings
    are the same permutation, and XLA would otherwise reuse the forward's first hop in the backward when both
    passes are in one program, holding the received blocks from forward to backward.
    """
    a, bs, biases, c = residuals
    p = lax.axis_size(axis_name)
    send = lambda tree: send_to_next(tree, axis_name, shift=BACKWARD)

    def step(carry: tuple, blocks: tuple, j: jax.Array) -> tuple:
        da, (dbs, dbiases, dc) = carry
        bts_j, biases_j, ct_j = blocks  # B^(j)ᵀ, β^(j), C^(j)ᵀ
        t = _products(a, [bt.T for bt in bts_j], biases_j)  # T_ij = A_i B^(j) (+ β^(j))  (fp32, as forward)
        d, f_vjp = jax.vjp(f, *t)  # D_ij = f(T_ij)
        dd = _mm(do, ct_j)  # ΔD_ij = ΔO_i C^(j)ᵀ
        dc = dc + _outer(d.astype(ct_j.dtype), do)  # ΔC^(j) += D_ijᵀ ΔO_i
        dt = [g.astype(a.dtype) for g in f_vjp(dd)]  # ΔT_ij = f'(T_ij) ⊙ ΔD_ij
        da = da + sum(_mm(dt_r, bt) for dt_r, bt in zip(dt, bts_j))  # ΔA_i += ΔT_ij B^(j)ᵀ
        dbs = tuple(db + _outer(a, dt_r) for db, dt_r in zip(dbs, dt))  # ΔB^(j) += A_iᵀ ΔT_ij
        dbiases = tuple(dbeta + _row_sum(dt_r) for dbeta, dt_r in zip(dbiases, dt))  # Δβ^(j) += Σ_rows ΔT_ij
        return da, send((dbs, dbiases, dc))  # ΔB, Δβ, ΔC move on with their block

    zeros = lambda w: vary_like(jnp.zeros_like(w, jnp.float32), a)
    init = (
        jnp.zeros_like(a, jnp.float32),
        (tuple(zeros(b_) for b_ in bs), tuple(zeros(beta) for beta in biases), zeros(c)),
    )
    blocks = (tuple(b_.T for b_ in bs), biases, c.T)
    da, (dbs, dbiases, dc) = ring_steps(step, init, blocks, p, send)
    dbs = tuple(_sum_to(db, b_).astype(b_.dtype) for db, b_ in zip(dbs, bs))
    dbiases = tuple(_sum_to(g, beta).astype(beta.dtype) for g, beta in zip(dbiases, biases))
    return da.astype(a.dtype), dbs, dbiases, _sum_to(dc, c).astype(c.dtype)


_metp.defvjp(_metp_fwd, _metp_bwd)


def metp_mlp(
    x: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    w_gate: jax.Array | None = None,
    *,
    activation: str = "gelu",
    axis_name: str = "tp",
    b_in: jax.Array | None = None,
    b_gate: jax.Array | None = None,
    b_out: jax.Array | None = None,
) -> jax.Array:
    """The FFN as METP (Eq. 2), inside `shard_map`.

    x: local [batch, s/p, hidden]; w_in (and w_gate for swiglu): local [hidden, ffn/p]; w_out: [ffn/p, hidden].
    gelu: gelu(x W_in) W_out; swiglu: (silu(x W_gate) ⊙ x W_in) W_out (both column blocks circulate).
    Optional biases: b_in, b_gate local [ffn/p] (circulate with their blocks), b_out [hidden] (added after).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} must be one of {ACTIVATIONS}")
    if (w_gate is not None) != (activation == "swiglu"):
        raise ValueError(f"w_gate must be given exactly when activation == 'swiglu' (activation {activation!r})")
    if activation == "swiglu":
        biases = None if b_in is None else (b_gate, b_in)
        out = metp(x, (w_gate, w_in), w_out, f=swiglu, axis_name=axis_name, b_bias=biases)
    else:
        out = metp(x, w_in, w_out, f=gelu, axis_name=axis_name, b_bias=b_in)
    return add_bias(out, b_out)


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
    y = _mm(x, w)
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
        return when_visible(cfg.causal, q_pos, kv_pos, compute, skip)
    visible = positions_may_meet(q_pos, kv_pos, causal=cfg.causal, window=cfg.window)
    if q_seg is not None:
        visible = visible & segments_may_meet(q_seg, kv_seg)
    return lax.cond(visible, compute, skip), visible


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
    pair different transfers there (see tests/test_metp.py, test_attention_forward_backward_repeatable).
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
    # would already be psummed over tp, and _sum_to below sums the shares once)
    q_norm, k_norm = jax.tree.map(lambda t: vary_like(t, x), norms) if norms else (None, None)
    post = lambda t, scale: _heads(t, scale, tokens.rope, cfg)

    def head_group(carry: tuple, own_j: tuple, j: jax.Array) -> tuple:
        dqkv_all, wqkv_all, dw_own, dnorms = carry
        w_j, biases_j = own_j  # broadcast from rank j (again)
        wq, wk, wv, wo = w_j
        a, lse = a_all[j], lse_all[j]
        dwo = _outer(a.reshape(b, n, -1), do)  # ΔW_proj_j = A_ijᵀ ΔO_i
        q, k, v = (_linear(x, w, bias, cfg) for w, bias in zip(w_j[:3], biases_j or (None,) * 3))
        (q, q_vjp), (k, k_vjp) = jax.vjp(post, q, q_norm), jax.vjp(post, k, k_norm)  # recompute Q, K (QK-norm, RoPE)
        da = _mm(do, wo.T).reshape(a.shape).astype(x.dtype)  # ΔA_ij = ΔO_i W_proj_jᵀ
        delta = jnp.sum(da.astype(jnp.float32) * a.astype(jnp.float32), axis=-1)  # D_i = rowsum(ΔA ⊙ A)
        dq, (dk, dv) = _inner_backward(q, k, v, da, lse, delta, tokens, cfg)
        dq, dq_norm = q_vjp(dq.astype(x.dtype))  # through RoPE (a rotation: its transpose) and the QK-norm
        dq = flat(dq)
        dwq = _outer(x, dq)  # ΔQ's GEMM first: in the GPU form
        if cfg.fuse:  # ΔK/ΔV are still on their last hop home
            (dk, dv), dwq = lax.optimization_barrier(((dk, dv), dwq))
        dk, dk_norm = k_vjp(dk.astype(x.dtype))
        dk, dv = flat(dk), flat(dv)
        # ΔX_i += [ΔQ ΔK ΔV] W_qkv_jᵀ: after the loop, from every group's (kept here with its W_qkv_jᵀ)
        dqkv_all = tuple(t.at[j].set(g) for t, g in zip(dqkv_all, (dq, dk, dv)))
        wqkv_all = tuple(t.at[j].set(w.T) for t, w in zip(wqkv_all, (wq, wk, wv)))
        dw = (dwq, _outer(x, dk), _outer(x, dv), dwo)  # ΔW_qkv_j = X_iᵀ [ΔQ ΔK ΔV], ΔW_proj_j
        db = tuple(_row_sum(g) for g in (dq, dk, dv)) if biases else ()  # Δb_qkv_j
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
    grads = lambda gs, ws: tuple(_sum_to(g, w).astype(w.dtype) for g, w in zip(gs, ws))
    return dx, grads(dw, weights), grads(db, biases), grads(dn, norms), None


_mha.defvjp(_mha_fwd, _mha_bwd)


# ---------------------------------------------------------------------------------------------------------
# Model-facing entry points (global arrays)
# ---------------------------------------------------------------------------------------------------------

_COLUMN = P(None, "tp")  # w_in, w_gate, wq, wk, wv: columns (heads) over tp
_ROW = P("tp", None)  # w_out, wo: rows over tp
_PARAM_SPECS = {
    "w_in": _COLUMN,
    "w_gate": _COLUMN,
    "w_out": _ROW,
    "wq": _COLUMN,
    "wk": _COLUMN,
    "wv": _COLUMN,
    "wo": _ROW,
}


def _check_mesh(mesh: Mesh):
    """(data axes with size > 1, tp). METP uses tp (sequence and weights) and dp/fsdp (batch) only."""
    if "tp" not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} have no 'tp' axis; METP splits over it")
    unused = [f"{a}={mesh.shape[a]}" for a in mesh.axis_names if a not in DATA_AXES + ("tp",) and mesh.shape[a] > 1]
    if unused:
        raise ValueError(
            f"METP uses only the tp axis (and dp/fsdp for the batch); mesh axes {', '.join(unused)} must be 1"
        )
    return tuple(a for a in DATA_AXES if mesh_axis_size(mesh, a) > 1), mesh.shape["tp"]


def _check_x(x: jax.Array, data_axes: tuple[str, ...], mesh: Mesh, tp: int):
    if x.ndim != 3:
        raise ValueError(f"x has shape {x.shape}; expected [batch, seq, hidden]")
    batch, seq, _ = x.shape
    data = math.prod(mesh.shape[a] for a in data_axes)
    if batch % data:
        raise ValueError(f"batch {batch} is not divisible by the data-parallel degree dp*fsdp = {data}")
    if seq % tp:
        raise ValueError(f"seq {seq} is not divisible by tp = {tp} (METP splits the sequence over tp)")


def mlp_block(x: jax.Array, params: dict[str, jax.Array], *, mesh: Mesh, activation: str = "gelu") -> jax.Array:
    """The FFN y = f(x W_in) W_out with METP over the mesh's tp axis (batch over dp/fsdp, sequence over tp).

    x: global [batch, seq, hidden]; params {"w_in": [hidden, ffn], "w_out": [ffn, hidden]} plus "w_gate":
    [hidden, ffn] for swiglu (y = (silu(x@w_gate) * (x@w_in)) @ w_out); gelu: y = gelu(x @ w_in) @ w_out
    (approximate=True). No biases. Returns y [batch, seq, hidden] in x.dtype.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} must be one of {ACTIVATIONS}")
    data_axes, tp = _check_mesh(mesh)
    _check_x(x, data_axes, mesh, tp)
    names = ("w_in", "w_out") + (("w_gate",) if activation == "swiglu" else ())
    if set(params) != set(names):
        raise ValueError(
            f"{activation} mlp params must be exactly {names} (w_gate only for swiglu); got {tuple(sorted(params))}"
        )
    hidden = x.shape[-1]
    ffn = params["w_in"].shape[1]
    for name in names:
        want = (ffn, hidden) if name == "w_out" else (hidden, ffn)
        if params[name].shape != want:
            raise ValueError(f"params[{name!r}] has shape {params[name].shape}; expected {want}")
    if ffn % tp:
        raise ValueError(f"ffn {ffn} is not divisible by tp = {tp} (each rank holds ffn/tp columns of W_in)")
    x_spec = P(data_axes or None, "tp", None)
    specs = (x_spec,) + tuple(_PARAM_SPECS[n] for n in names)
    return run_local(_mlp_local, mesh, specs, x_spec, x, *(params[n] for n in names), activation=activation)


def _mlp_local(x: jax.Array, w_in: jax.Array, w_out: jax.Array, *gate: jax.Array, activation: str):
    return metp_mlp(x, w_in, w_out, *gate, activation=activation, axis_name="tp")


def attention_block(
    x: jax.Array,
    params: dict[str, jax.Array],
    positions: jax.Array,
    *,
    mesh: Mesh,
    num_heads: int,
    num_kv_heads: int,
    causal: bool = True,
    rope_theta: float | None = 10000.0,
    block_ops: str | BlockOps = "auto",
    fuse_sends: bool | None = None,
    window: int | None = None,
) -> jax.Array:
    """Self-attention with two-level METP over the mesh's tp axis (batch over dp/fsdp, sequence over tp).

    params {"wq": [hidden, num_heads*head_dim], "wk": [hidden, num_kv_heads*head_dim], "wv": like wk,
    "wo": [num_heads*head_dim, hidden]}; head h's columns are h*head_dim:(h+1)*head_dim, so rank j's slice
    of each is head group j. positions: global int [batch, seq] (RoPE on q and k when rope_theta is not None;
    the causal mask uses the same positions). fuse_sends: see `metp_attention`. window: sliding window W
    (needs causal): the query at position i sees keys i - W < j <= i. Returns y [batch, seq, hidden] in x.dtype.
    """
    data_axes, tp = _check_mesh(mesh)
    _check_x(x, data_axes, mesh, tp)
    window = check_window(window, bool(causal))
    if set(params) != {"wq", "wk", "wv", "wo"}:
        raise ValueError(f"attention params must be exactly wq, wk, wv, wo; got {tuple(sorted(params))}")
    hidden = x.shape[-1]
    if num_heads % tp or num_kv_heads % tp:
        raise ValueError(
            f"num_heads {num_heads} and num_kv_heads {num_kv_heads} must be divisible by tp = {tp} "
            f"(METP broadcasts one head group per rank)"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads} (GQA)")
    if params["wq"].ndim != 2 or params["wq"].shape[1] % num_heads:
        raise ValueError(f"wq has shape {params['wq'].shape}; expected [hidden, num_heads*head_dim]")
    d = params["wq"].shape[1] // num_heads
    for name, want in (
        ("wq", (hidden, num_heads * d)),
        ("wk", (hidden, num_kv_heads * d)),
        ("wv", (hidden, num_kv_heads * d)),
        ("wo", (num_heads * d, hidden)),
    ):
        if params[name].shape != want:
            raise ValueError(f"params[{name!r}] has shape {params[name].shape}; expected {want}")
    if positions.shape != x.shape[:2]:
        raise ValueError(f"positions has shape {positions.shape}; expected [batch, seq] = {x.shape[:2]}")
    x_spec = P(data_axes or None, "tp", None)
    pos_spec = P(data_axes or None, "tp")
    specs = (x_spec, _COLUMN, _COLUMN, _COLUMN, _ROW, pos_spec)
    # The Pallas interpreter of JAX 0.10 cannot type-check varying mesh axes (see flash.py).
    check_vma = get_block_ops(block_ops).name != "pallas_interpret"
    return run_local(
        _attention_local,
        mesh,
        specs,
        x_spec,
        x,
        *(params[n] for n in ("wq", "wk", "wv", "wo")),
        jnp.asarray(positions, jnp.int32),
        check_vma=check_vma,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        causal=bool(causal),
        rope_theta=None if rope_theta is None else float(rope_theta),
        block_ops=block_ops,
        fuse_sends=fuse_sends,
        window=window,
    )


def _attention_local(
    x: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array, wo: jax.Array, positions: jax.Array, **kw: Any
):
    return metp_attention(x, wq, wk, wv, wo, positions, axis_name="tp", **kw)


def param_specs(mesh: Mesh, params_shapes: dict[str, Any]) -> dict:
    """name -> NamedSharding for METP's weights: w_in, w_gate, wq, wk, wv by columns over tp (head group j
    on rank j), w_out and wo by rows; replicated over the other axes. Nested dicts are mapped recursively.

    params_shapes: {name: shape tuple or anything with .shape}.
    """
    _, tp = _check_mesh(mesh)
    specs = {}
    for name, shape in params_shapes.items():
        if isinstance(shape, dict):
            specs[name] = param_specs(mesh, shape)
            continue
        if name not in _PARAM_SPECS:
            raise ValueError(f"unknown parameter {name!r}; METP shards {', '.join(_PARAM_SPECS)}")
        shape = tuple(getattr(shape, "shape", shape))
        axis = 1 if _PARAM_SPECS[name] == _COLUMN else 0
        if len(shape) != 2 or shape[axis] % tp:
            raise ValueError(f"parameter {name!r} of shape {shape} must be 2-D with dim {axis} divisible by tp = {tp}")
        specs[name] = NamedSharding(mesh, _PARAM_SPECS[name])
    return specs


# ---------------------------------------------------------------------------------------------------------
# The method, for the train step's shard_map
# ---------------------------------------------------------------------------------------------------------


def _token_id_transfers(m: ModelShape, x: LocalDims) -> list[Transfer]:
    """The int32 [b, s/p] token arrays that ride the inner K/V ring with their block (`_inner_forward`,
    `_inner_backward`): the tokens' order in the row when causal, their segment ids with packed documents;
    p-1 hops per head group forward and again backward. Every group and layer sends the same arrays forward:
    XLA:CPU hoists those p-1 hops out of both loops (once per micro-step) and keeps the backward's p(p-1) in
    each layer, and at p = 2 the backward's hop is the forward's (one ring of two: the same permutation),
    sent once (measured on the compiled CPU step: tests/test_planner.py). The GPU ring (`fuse_sends`)
    carries them in every hop's buffer: 2p(p-1) per layer."""
    p = m.tp
    ids = x.b * (m.seq_len // p) * 4 * (int(m.causal) + int(m.segments))
    if not ids or p < 2:
        return []
    what = "METP MHA token order / segment ids with K/V"
    if not m.cpu:
        return [
            Transfer(f"{what} (in each hop's buffer)", ("tp",), 2 * p * (p - 1) * ids, 2 * p * (p - 1), "attention")
        ]
    out = [Transfer(f"{what}: the forward's p-1 hops", ("tp",), (p - 1) * ids, p - 1, "attention", "micro-step")]
    if p > 2:
        out.append(
            Transfer(f"{what}: the backward's p(p-1) hops", ("tp",), p * (p - 1) * ids, p * (p - 1), "attention")
        )
    return out


# [b, n/p, h/p] fp32 blocks of the head-group loop live at the compiled CPU step's layer-backward peak (27 in
# the live ranges of dp2 x METP tp4, remat full, 2 and 4 layers; `METP.layer_working`)
CPU_GROUP_LOOP_BLOCKS = 27


class METP(TensorMethod):
    """METP over `tp`: the sequence split over tp (activations [b, s/p, h] never move), weights circulate.
    The embedding and LM head stay replicated (the paper distributes only the blocks)."""

    name = "metp"
    runs_moe = False
    axes = ("tp",)
    summary = "METP: activations stay, weights circulate on rings (FFN) and head groups are broadcast (MHA)"
    sequence_parallel = False
    sequence_parallel_rule = (
        "METP already splits the sequence over tp (its K/V ring runs over tp); "
        "use megatron for tensor × sequence parallelism"
    )

    def check_model(
        self, plan: ParallelPlan, *, num_heads: int, num_kv_heads: int, hidden: int, ffn: int, vocab: int | None
    ) -> None:
        tp = plan.tp
        check_kv_heads(num_heads, num_kv_heads, tp, "METP, one head group per rank,")
        if ffn % tp:
            raise ValueError(f"ffn {ffn} is not divisible by tp = {tp} (each rank holds ffn/tp columns of W_in)")

    def check_seq(self, plan: ParallelPlan, seq_len: int) -> None:
        if seq_len % plan.tp:
            raise ValueError(f"seq {seq_len} is not divisible by tp = {plan.tp} (METP splits the sequence over tp)")

    def head_split(self, plan: ParallelPlan) -> int:
        return plan.tp

    def local_rows(self, plan: ParallelPlan, seq_len: int) -> int:
        return seq_len // plan.tp

    def activation_spec(self, plan: ParallelPlan) -> P:
        return P(spec_entry(plan.batch_axes), "tp", None)

    def token_spec(self, plan: ParallelPlan) -> P:
        return P(spec_entry(plan.batch_axes), "tp")

    def param_spec(self, plan: ParallelPlan, info: ParamInfo) -> tuple:
        def axis(name: str | None) -> str | None:
            if name == "kv_heads":  # fewer K/V heads than tp: replicated, each rank reads its own
                return "tp" if info.heads is not None and info.heads % plan.tp == 0 else None
            return "tp" if name in ("heads", "mlp") else None

        return tuple(axis(a) for a in info.logical_axes)

    def attention(
        self,
        plan: ParallelPlan,
        x: jax.Array,
        w: dict,
        positions: jax.Array,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        causal: bool,
        rope: Rope | None,
        window: int | None = None,
        norm_eps: float = 1e-6,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        if num_kv_heads < plan.tp:  # each rank's group reads one replicated K/V head
            w, num_kv_heads = own_kv_head(w, num_kv_heads, plan.tp, head_dim), plan.tp
        b, n = positions.shape  # the tokens are contiguous over tp (no layout at sp = 1): rank r holds r·n ..
        order = jnp.broadcast_to(lax.axis_index("tp") * n + jnp.arange(n, dtype=jnp.int32), (b, n))
        return metp_attention(
            x,
            w["wq"],
            w["wk"],
            w["wv"],
            w["wo"],
            positions,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            axis_name="tp",
            causal=causal,
            rope_theta=rope,
            block_ops=plan.block_ops,
            extras={n: w[n] for n in ("bq", "bk", "bv", "bo", "q_norm", "k_norm") if n in w},
            norm_eps=norm_eps,
            window=window,
            segment_ids=segment_ids,
            token_order=order,
        )

    def mlp(self, plan: ParallelPlan, x: jax.Array, w: dict, *, activation: str) -> jax.Array:
        biases = {n: w[n] for n in ("b_in", "b_gate", "b_out") if n in w}
        return metp_mlp(x, w["w_in"], w["w_out"], w.get("w_gate"), activation=activation, axis_name="tp", **biases)

    # --- cost model (the module docstring's bytes; METP Tables 1-2)
    recomputes_forward = True  # Q, K, V and f(AB) again in the backward (Algorithms 2 and 6)

    def local_dims(self, m: ModelShape) -> LocalDims:
        n = m.n // m.tp  # the device's s/p tokens, for the attention too
        return LocalDims(m.b, n, n, m.hidden, m.heads, m.kv_heads, m.ffn // m.tp, m.vocab, token_split=m.tp)

    def layer_transfers(self, m: ModelShape, x: LocalDims) -> list[Transfer]:
        """FFN: (3p-2)/p·(k1k2 + k2n) (Algorithms 1-2 with the extra gradient hop: p-1 weight hops forward,
        p-1 + p backward; W_gate too for SwiGLU); MHA: head-group broadcasts p·⌈log2 p⌉ (forward, twice
        backward) and the K/V ring p(p-1) forward, p(2p-1) backward (Section 4, Table 2)."""
        p, e, h, d = m.tp, m.e, m.hidden, m.head_dim
        rounds = tree_rounds(p)
        ffn_blocks = (m.ffn_matrices * h * m.ffn) // p  # (k1·k2 + k2·n)/p, W_gate too for SwiGLU
        weights = (h * (m.heads + 2 * m.kv_heads) * d + m.heads * d * h) // p
        kvb = x.b * (m.seq_len // p) * (m.kv_heads // p) * d
        return [
            *modulation_gradients(m.modulation, m, x, "DiT modulation gradients (shift, scale, gate × 2)"),
            Transfer("METP FFN ring: (B, C) blocks p-1 hops forward", ("tp",), (p - 1) * ffn_blocks * e, p - 1, "ffn"),
            Transfer(
                "METP FFN ring backward: blocks p-1 hops, fp32 gradients p hops",
                ("tp",),
                (p - 1) * ffn_blocks * e + p * ffn_blocks * F32,
                p,
                "ffn",
            ),
            Transfer(
                "METP MHA head-group broadcasts (forward; again with the ΔW reduces backward)",
                ("tp",),
                p * rounds * weights * e + p * rounds * weights * (e + F32),
                3 * p * rounds,
            ),
            Transfer(
                "METP MHA K/V ring: p(p-1) hops forward, p(p-1) + p² (fp32 dK/dV) backward",
                ("tp",),
                p * (p - 1) * 2 * kvb * e + p * (p - 1) * 2 * kvb * e + p * p * 2 * kvb * F32,
                2 * p * p,
                "attention",
            ),
            *_token_id_transfers(m, x),
        ]

    def head_transfers(self, m: ModelShape, x: LocalDims) -> list[Transfer]:
        """The embedding and head stay replicated; the final layer's modulation gradients are summed."""
        return modulation_gradients(m.final_modulation, m, x, "DiT final layer's modulation gradients (shift, scale)")

    def attention_core_cost(self, m: ModelShape, x: LocalDims) -> AttentionCost:
        """METP's own attention (no sequence strategy): it keeps A_i (activation dtype) and its lse (fp32) of
        every head group (Table 2: 2bsh/p) and works on one head group at a time (its K/V ring is in
        `layer_transfers`); its backward keeps every group's ΔQ, ΔK, ΔV (activation dtype) for ΔX_i after the
        loop (`_grouped_projection`) beside one group's Q, K, V and fp32 ΔQ, ΔK, ΔV."""
        qkv = x.b * x.n * (x.heads + 2 * x.kv_heads) * m.head_dim
        return AttentionCost(
            saved=x.b * x.n * x.heads * (m.head_dim * m.em + F32),
            working=qkv * m.em + qkv // m.tp * (m.em + F32),
            tile_heads=max(1, x.heads // m.tp),
        )

    def layer_working(self, m: ModelShape, x: LocalDims) -> float:
        """On XLA:CPU, what the compiled step holds at its layer backward's peak (inside the head-group loop)
        beyond the attention core's `working` and the layer's share of residuals, read from the live ranges at
        the peak of dp2 x METP tp4, remat full, GPT of benchmarks/memory_model.py (2 and 4 layers; estimate
        0.85 and 0.87 of the compiled step without these, the live peak 0.99 of it): every head group's ΔW_Q,
        ΔW_K, ΔW_V whole before their reduce (fp32 [p, h/p, h] each, 0.19 MiB there); the head-group loop's
        blocks beyond the one group's Q, K, V, ΔQ, ΔK, ΔV the core prices (its K/V ring's received, sent and
        carried blocks and their copies: CPU_GROUP_LOOP_BLOCKS in all, 0.84 MiB there); and a tied
        embedding's second gradient, the take's zero-filled scatter buffer, allocated before the forward and
        live beside the head's ΔW through the layers' backward (fp32 [vocab, h], 0.5 MiB there). None on GPU."""
        if not m.cpu:
            return 0.0
        delta_w = (m.heads + 2 * m.kv_heads) * m.head_dim * m.hidden * F32
        block = x.b * x.n * max(1, x.heads // m.tp) * m.head_dim * F32
        embedding = m.vocab * m.hidden * F32 if m.tied and m.vocab else 0
        return delta_w + (CPU_GROUP_LOOP_BLOCKS - 6) * block + embedding

    def moe(
        self, plan: ParallelPlan, x: jax.Array, moe: Callable[..., tuple[jax.Array, dict]]
    ) -> tuple[jax.Array, dict]:
        raise ValueError(
            f"mixture-of-experts layers cannot run with tensor parallelism '{self.name}': its "
            f"layout splits what the experts' all-to-all exchanges; use megatron (or none) with --ep"
        )


METHOD = METP()
