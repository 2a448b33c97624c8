"""Optimus: 2D tensor parallelism with SUMMA products [Optimus] (Xu et al.; REFERENCES.md).

tp = p = q² devices form a q×q grid (the `tp` axis split into rows `tpr` and columns `tpc`, tpc innermost;
device (i, j) has tpr = i, tpc = j). Every matrix is split into q×q blocks, block (i, j) on device (i, j):

  activations [b, s, h]  device (i, j) holds [b/q, s, h/q]: batch block i, hidden block j, whole sequences
                         (PartitionSpec P((*data, "tpr"), None, "tpc"): the batch is split over dp/fsdp first,
                         then over the grid row)
  weights [h, f]         block (i, j) = [h/q, f/q]                     P("tpr", "tpc")
  layernorm affine [h]   hidden block j, replicated over the rows      P("tpc") (gradients summed over rows)

SUMMA (Algorithms 1-3). "Within a row" is over tpc, "within a column" over tpr:

  Alg 1  C = AB      for l in 0..q-1: broadcast A_il within row i, B_lj within column j; C_ij += A_il B_lj
  Alg 2  C = ABᵀ     for l in 0..q-1: broadcast B_lj within column j; reduce A_ij B_ljᵀ within row i onto C_il
  Alg 3  C = AᵀB     for l in 0..q-1: broadcast A_il within row i; reduce A_ilᵀ B_ij within column j onto C_lj

Each step moves one block with a binomial tree (`tree_broadcast` / `tree_reduce`: ceil(log2 q) ppermute
rounds, one block received per round); a step's broadcast is issued one step ahead, before the previous
step's matmul, so they can overlap. The loop is a `lax.scan`, so a device holds a few blocks whatever q is
(the current and the prefetched one, plus the tree's shared round-0 block, see below), never a whole row or
column panel of q blocks: that is the method's memory claim (stepwise vs gathered panels: tests).

The three products are closed under differentiation (eqs. 1-3), and the backward of each is a `custom_vjp`
made of the other two SUMMA forms (residuals: the two local input blocks only):

  C = AB   → dA = dC Bᵀ (Alg 2), dB = Aᵀ dC (Alg 3)
  C = ABᵀ  → dA = dC B  (Alg 1), dB = dCᵀ A (Alg 3)
  C = AᵀB  → dA = B dCᵀ (Alg 2), dB = A dC  (Alg 1)

Communication, elements received per device for one product with local blocks |A|, |B|, |C| and
R = ceil(log2 q) tree rounds: the paper counts qR blocks per broadcast and per reduce, e.g. Alg 1
qR·(|A| + |B|); for X [bs, h] @ W [h, 4h] that is log2(q)/q·(bsh + 4h²) = log(p)/(2√p)·(bsh + 4h²), Table 1's
term, and a layer's forward (QKV, output projection, h→4h, 4h→h) adds up to log(p)/(2√p)·(7bsh + 12h²).
The compiled program moves a little less: round 0 of the binomial tree does not depend on the root (each
rank sends its own block to rank + 1), so XLA computes it once for all q steps and a broadcast costs
1 + q(R-1) blocks (reductions carry step-dependent partial sums: qR). tests/test_optimus.py asserts both.

Layer mapping (Fig. 4): QKV (one SUMMA on the local blocks of wq|wk|wv side by side, so x is broadcast once)
→ each device holds n/q heads of b/q whole sequences, attention is local (`flash_attention`) → output
projection SUMMA. MLP: two SUMMAs with the nonlinearity local. Layernorm: Σx and Σx² all-reduced within
the row. Embedding: tokens [b/q, s] replicated within a row, table [v, h] in q×q blocks; the lookup is
Alg 1 with the one-hot matrix built locally (only table blocks travel). LM head: Alg 1 with w_head [h, v]
or, tied, Alg 2 with the table [v, h]; the cross-entropy takes a stable max (pmax) and Σe^x within the row
and the label logit from the column that owns it.

Layer functions (`summa_ab`, `mlp_2d`, `attention_2d`, ...) run inside `jax.shard_map` on the grid mesh;
`mlp_block`, `attention_block`, `layer_norm`, `embed`, `cross_entropy` and `param_specs` take global arrays
and a mesh from `jaxring.make_mesh` (tp = q²) and build the grid themselves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring.core.collectives import prefetch_steps, tree_broadcast, tree_reduce
from jaxring.core.mesh import DATA_AXES, factored_mesh, spec_entry
from jaxring.core.sharded import run_local
from jaxring.core.vma import common_vma
from jaxring.kernels.flash import flash_attention
from jaxring.kernels.masking import check_window
from jaxring.parallel.cost_terms import F32, LocalDims, ModelShape, Transfer, tree_rounds
from jaxring.parallel.tensor.contract import ACTIVATIONS, ParamInfo, TensorMethod, add_bias, qk_norm_rope

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxring.kernels.rope import Rope
    from jaxring.parallel.plan import ParallelPlan

ROW, COL = "tpr", "tpc"  # grid axes: device (i, j) has tpr = i, tpc = j
GRID = (ROW, COL)

__all__ = [
    "attention_2d",
    "attention_block",
    "cross_entropy",
    "cross_entropy_2d",
    "embed",
    "embed_2d",
    "grid_mesh",
    "layer_norm",
    "layer_norm_2d",
    "mlp_2d",
    "mlp_block",
    "param_specs",
    "summa_ab",
    "summa_abt",
    "summa_atb",
]


# ----------------------------------------------------------------------------------------------------------
# SUMMA (inside shard_map)
# ----------------------------------------------------------------------------------------------------------


def _vary(*xs: jax.Array):
    """Casts every x to the union of their varying mesh axes (so a custom_vjp sees one type, and the
    gradient of a weight replicated over the data axes is summed over them by its transpose)."""
    return common_vma(*xs)


def _zeros(shape: tuple[int, ...], dtype: jnp.dtype, like: jax.Array):
    """Zeros varying over the same mesh axes as `like` (a scan carry must keep its type)."""
    (z,) = _vary(jnp.zeros(shape, dtype), like)[:1]
    return z


def _steps(
    q: int,
    fetch: Callable[[int | jax.Array], Any],
    compute: Callable[[Any, Any, Any], Any],
    carry: Any,
    compute_communicates: bool = True,
):
    """for l in 0..q-1: carry = compute(carry, fetch(l), l), with fetch(l + 1) issued before compute(.., l)
    (`collectives.prefetch_steps`: a step's broadcast stays in its iteration, so XLA cannot issue every
    broadcast up front and hold all q blocks)."""
    return prefetch_steps(compute, carry, fetch(0), lambda _, l: fetch(l + 1), q, compute_communicates)


def _dot(a: jax.Array, b: jax.Array):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _ab(a: jax.Array, b: jax.Array, axes: tuple[str, str]):
    """Algorithm 1: C_ij = Σ_l A_il B_lj."""
    row, col = axes
    q = lax.axis_size(col)

    def fetch(l: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        return tree_broadcast(a, col, l), tree_broadcast(b, row, l)  # A_il within row i, B_lj within column j

    def compute(c: jax.Array, blocks: tuple[jax.Array, jax.Array], l: int | jax.Array) -> jax.Array:
        a_il, b_lj = blocks
        return c + _dot(a_il, b_lj)

    c = _steps(q, fetch, compute, _zeros((a.shape[0], b.shape[1]), jnp.float32, a), compute_communicates=False)
    return c.astype(jnp.result_type(a, b))


def _abt(a: jax.Array, b: jax.Array, axes: tuple[str, str]):
    """Algorithm 2: C_il = Σ_j A_ij B_ljᵀ (the sum over j reduced within row i onto column l)."""
    row, col = axes
    q, j = lax.axis_size(col), lax.axis_index(col)
    dtype = jnp.result_type(a, b)

    def fetch(l: int | jax.Array) -> jax.Array:
        return tree_broadcast(b, row, l)  # B_lj within column j

    def compute(c: jax.Array, b_lj: jax.Array, l: int | jax.Array) -> jax.Array:
        partial = _dot(a, b_lj.T).astype(dtype)  # A_ij B_ljᵀ
        return jnp.where(j == l, tree_reduce(partial, col, l), c)  # reduced within row i onto (i, l)

    return _steps(q, fetch, compute, _zeros((a.shape[0], b.shape[0]), dtype, a))


def _atb(a: jax.Array, b: jax.Array, axes: tuple[str, str]):
    """Algorithm 3: C_lj = Σ_i A_ilᵀ B_ij (the sum over i reduced within column j onto row l)."""
    row, col = axes
    q, i = lax.axis_size(row), lax.axis_index(row)
    dtype = jnp.result_type(a, b)

    def fetch(l: int | jax.Array) -> jax.Array:
        return tree_broadcast(a, col, l)  # A_il within row i

    def compute(c: jax.Array, a_il: jax.Array, l: int | jax.Array) -> jax.Array:
        partial = _dot(a_il.T, b).astype(dtype)  # A_ilᵀ B_ij
        return jnp.where(i == l, tree_reduce(partial, row, l), c)  # reduced within column j onto (l, j)

    return _steps(q, fetch, compute, _zeros((a.shape[1], b.shape[1]), dtype, a))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _summa_ab(a: jax.Array, b: jax.Array, axes: tuple[str, str]):
    return _ab(a, b, axes)


def _summa_ab_fwd(a: jax.Array, b: jax.Array, axes: tuple[str, str]):
    return _ab(a, b, axes), (a, b)


def _fresh(res: tuple[jax.Array, jax.Array]):
    """The residual blocks behind an optimization barrier: the backward's broadcasts of them then differ
    from the forward's, so XLA cannot merge the two (which would keep received blocks alive in between).
    Like jax.checkpoint's barrier, XLA:CPU drops it before CSE; GPU and TPU keep it."""
    return lax.optimization_barrier(res)


def _summa_ab_bwd(axes: tuple[str, str], res: tuple[jax.Array, jax.Array], g: jax.Array):
    a, b = _fresh(res)
    return _summa_abt(g, b, axes).astype(a.dtype), _summa_atb(a, g, axes).astype(b.dtype)  # dC Bᵀ, Aᵀ dC


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _summa_abt(a: jax.Array, b: jax.Array, axes: tuple[str, str]):
    return _abt(a, b, axes)


def _summa_abt_fwd(a: jax.Array, b: jax.Array, axes: tuple[str, str]):
    return _abt(a, b, axes), (a, b)


def _summa_abt_bwd(axes: tuple[str, str], res: tuple[jax.Array, jax.Array], g: jax.Array):
    a, b = _fresh(res)
    return _summa_ab(g, b, axes).astype(a.dtype), _summa_atb(g, a, axes).astype(b.dtype)  # dC B, dCᵀ A


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _summa_atb(a: jax.Array, b: jax.Array, axes: tuple[str, str]):
    return _atb(a, b, axes)


def _summa_atb_fwd(a: jax.Array, b: jax.Array, axes: tuple[str, str]):
    return _atb(a, b, axes), (a, b)


def _summa_atb_bwd(axes: tuple[str, str], res: tuple[jax.Array, jax.Array], g: jax.Array):
    a, b = _fresh(res)
    return _summa_abt(b, g, axes).astype(a.dtype), _summa_ab(a, g, axes).astype(b.dtype)  # B dCᵀ, A dC


_summa_ab.defvjp(_summa_ab_fwd, _summa_ab_bwd)
_summa_abt.defvjp(_summa_abt_fwd, _summa_abt_bwd)
_summa_atb.defvjp(_summa_atb_fwd, _summa_atb_bwd)


def _check_blocks(name: str, a: jax.Array, b: jax.Array, a_dim: int, b_dim: int, rule: str):
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"{name}: local blocks must be 2D, got A {a.shape} and B {b.shape}")
    if a.shape[a_dim] != b.shape[b_dim]:
        raise ValueError(f"{name}: A block {a.shape} and B block {b.shape} do not fit ({rule})")


def summa_ab(a: jax.Array, b: jax.Array, *, row_axis: str = ROW, col_axis: str = COL) -> jax.Array:
    """C = AB by Algorithm 1 (inside shard_map); differentiable by Algorithms 2 and 3.

    a: local block A_ij [m, k] of A [M, K]; b: local B_ij [k, n] of B [K, N]. Returns C_ij [m, n].
    """
    _check_blocks("summa_ab", a, b, 1, 0, "A block columns must equal B block rows")
    return _summa_ab(*_vary(a, b), (row_axis, col_axis))


def summa_abt(a: jax.Array, b: jax.Array, *, row_axis: str = ROW, col_axis: str = COL) -> jax.Array:
    """C = ABᵀ by Algorithm 2 (inside shard_map); differentiable by Algorithms 1 and 3.

    a: local A_ij [m, k] of A [M, K]; b: local B_ij [n, k] of B [N, K]. Returns C_ij [m, n] of C [M, N].
    """
    _check_blocks("summa_abt", a, b, 1, 1, "A and B blocks must have the same number of columns")
    return _summa_abt(*_vary(a, b), (row_axis, col_axis))


def summa_atb(a: jax.Array, b: jax.Array, *, row_axis: str = ROW, col_axis: str = COL) -> jax.Array:
    """C = AᵀB by Algorithm 3 (inside shard_map); differentiable by Algorithms 1 and 2.

    a: local A_ij [k, m] of A [K, M]; b: local B_ij [k, n] of B [K, N]. Returns C_ij [m, n] of C [M, N].
    """
    _check_blocks("summa_atb", a, b, 0, 0, "A and B blocks must have the same number of rows")
    return _summa_atb(*_vary(a, b), (row_axis, col_axis))


# ----------------------------------------------------------------------------------------------------------
# Layers (inside shard_map on the grid): activations [b/q, s, h/q]
# ----------------------------------------------------------------------------------------------------------


def _matmul(x: jax.Array, w: jax.Array, axes: Sequence[str]):
    """[b/q, s, k/q] activations times a [k, n] weight in q×q blocks: [b/q, s, n/q] by Algorithm 1."""
    lead = x.shape[:-1]
    y = summa_ab(x.reshape(-1, x.shape[-1]), w, row_axis=axes[0], col_axis=axes[1])
    return y.reshape(*lead, y.shape[-1])


def mlp_2d(
    x: jax.Array, params: dict[str, jax.Array], *, activation: str = "gelu", axes: Sequence[str] = GRID
) -> jax.Array:
    """y = gelu(x @ w_in) @ w_out, or (silu(x @ w_gate) * (x @ w_in)) @ w_out: two SUMMA products.

    x: local [b/q, s, h/q]; params: local blocks w_in, w_gate [h/q, f/q], w_out [f/q, h/q], optionally the
    biases' column blocks b_in, b_gate [f/q] and b_out [h/q].
    swiglu puts the w_gate and w_in blocks side by side, so x is broadcast once for both.
    Returns local [b/q, s, h/q].
    """
    if activation == "gelu":
        act = jax.nn.gelu(add_bias(_matmul(x, params["w_in"], axes), params.get("b_in")), approximate=True)
    elif activation == "swiglu":
        fq = params["w_in"].shape[1]
        both = _matmul(x, jnp.concatenate([params["w_gate"], params["w_in"]], axis=1), axes)
        gate, inner = add_bias(both[..., :fq], params.get("b_gate")), add_bias(both[..., fq:], params.get("b_in"))
        act = jax.nn.silu(gate) * inner
    else:
        raise ValueError(f"activation {activation!r} must be one of {ACTIVATIONS}")
    return add_bias(_matmul(act, params["w_out"], axes), params.get("b_out"))


def attention_2d(
    x: jax.Array,
    params: dict[str, jax.Array],
    positions: jax.Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    causal: bool = True,
    rope_theta: Rope | float | None = 10000.0,
    axes: Sequence[str] = GRID,
    window: int | None = None,
    norm_eps: float = 1e-6,
    segment_ids: jax.Array | None = None,
    token_order: jax.Array | None = None,
) -> jax.Array:
    """Self-attention with n/q heads of b/q whole sequences per device (Fig. 4).

    x: local [b/q, s, h/q]; positions: local int [b/q, s], RoPE's (and the causal mask's unless `token_order`
    int [s] or [b/q, s] is given: packed documents restart their positions, the mask follows the row);
    segment_ids: local int [b/q, s] or None, a query sees only keys of its segment (0: padding); params: local blocks wq [h/q, n·d/q],
    wk, wv [h/q, n_kv·d/q], wo [n·d/q, h/q] (column block j of wq/wk/wv = heads of group j), optionally
    the biases' column blocks bq [n·d/q], bk/bv [n_kv·d/q], bo [h/q] and the QK-norm scales q_norm/k_norm [d]
    (whole: heads are whole on a device). rope_theta: a theta, a `jaxring.kernels.rope.Rope` or None.
    QKV is one SUMMA on the wq|wk|wv blocks side by side; softmax(QKᵀ)V is local (with a sliding `window` W,
    needing causal, the query at position i sees keys i - W < j <= i); wo is a second SUMMA.
    Returns local [b/q, s, h/q].
    """
    q = lax.axis_size(axes[1])
    heads, kv_heads = num_heads // q, num_kv_heads // q
    head_dim = params["wq"].shape[1] // heads
    bq, s, _ = x.shape
    w_qkv = jnp.concatenate([params["wq"], params["wk"], params["wv"]], axis=1)
    qkv = _matmul(x, w_qkv, axes)  # [b/q, s, (n + 2 n_kv) d / q]
    sizes = (heads * head_dim, kv_heads * head_dim)
    parts = (qkv[..., : sizes[0]], qkv[..., sizes[0] : sizes[0] + sizes[1]], qkv[..., sizes[0] + sizes[1] :])
    qh, kh, vh = (add_bias(t, params.get(f"b{n}")).reshape(bq, s, -1, head_dim) for t, n in zip(parts, "qkv"))
    qh, kh = qk_norm_rope(qh, kh, params, positions, rope_theta, eps=norm_eps)
    order = positions if token_order is None else token_order
    out = flash_attention(
        qh, kh, vh, causal=causal, q_positions=order, kv_positions=order, segment_ids=segment_ids, window=window
    )
    return add_bias(_matmul(out.reshape(bq, s, heads * head_dim), params["wo"], axes), params.get("bo"))


def layer_norm_2d(
    x: jax.Array, scale: jax.Array, bias: jax.Array, *, eps: float = 1e-5, col_axis: str = COL
) -> jax.Array:
    """LayerNorm over a hidden dimension split across the row: Σx and Σx² all-reduced within the row (one
    psum over `col_axis`); backward (autodiff) all-reduces Σ x̂·g and Σ g the same way.

    x: local [..., h/q]; scale, bias: local [h/q] (replicated over the rows; the transpose of that
    replication sums their gradients over the rows). Returns local [..., h/q] in x.dtype.
    """
    h = x.shape[-1] * lax.axis_size(col_axis)
    xf = x.astype(jnp.float32)
    sums = lax.psum(jnp.stack([xf.sum(-1), (xf * xf).sum(-1)]), col_axis)
    mean = sums[0] / h
    var = jnp.maximum(sums[1] / h - mean * mean, 0.0)  # E[X²] - E[X]²
    y = (xf - mean[..., None]) * lax.rsqrt(var + eps)[..., None]
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def rms_norm_2d(x: jax.Array, scale: jax.Array, *, eps: float = 1e-6, col_axis: str = COL) -> jax.Array:
    """RMSNorm over a hidden dimension split across the row: Σx² all-reduced within the row (one psum over
    `col_axis`, as LayerNorm's statistics). x: local [..., h/q]; scale: local [h/q]. Returns x.dtype."""
    h = x.shape[-1] * lax.axis_size(col_axis)
    xf = x.astype(jnp.float32)
    mean_square = lax.psum((xf * xf).sum(-1), col_axis) / h
    return (xf * lax.rsqrt(mean_square + eps)[..., None] * scale.astype(jnp.float32)).astype(x.dtype)


def _lookup(tokens: jax.Array, e_lj: jax.Array, l: int | jax.Array):
    """Rows of the broadcast table block e_lj for the tokens in vocab block l; zero for the others."""
    local = tokens - l * e_lj.shape[0]
    hit = (local >= 0) & (local < e_lj.shape[0])
    return jnp.where(hit[..., None], jnp.take(e_lj, jnp.clip(local, 0, e_lj.shape[0] - 1), axis=0), 0)


def _embed_fwd_impl(tokens: jax.Array, table: jax.Array, axes: tuple[str, ...]):
    """Algorithm 1 with A = onehot(tokens) built locally (tokens are replicated within the row): for l,
    broadcast E_lj within column j and add the rows it holds."""
    row = axes[0]
    q = lax.axis_size(row)

    def compute(out: jax.Array, e_lj: jax.Array, l: int | jax.Array) -> jax.Array:
        return out + _lookup(tokens, e_lj, l).astype(jnp.float32)

    out = _steps(
        q, lambda l: tree_broadcast(table, row, l), compute, _zeros(tokens.shape + table.shape[1:], jnp.float32, table)
    )
    return out.astype(table.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _embed(tokens: jax.Array, table: jax.Array, axes: tuple[str, ...]):
    return _embed_fwd_impl(tokens, table, axes)


def _embed_fwd(tokens: jax.Array, table: jax.Array, axes: tuple[str, ...]):
    return _embed_fwd_impl(tokens, table, axes), (tokens, table)


def _embed_bwd(axes: tuple[str, ...], res: tuple[jax.Array, jax.Array], g: jax.Array):
    """Algorithm 3: dE_lj = Σ_i onehot_ilᵀ dOut_ij, a local scatter-add reduced within column j onto row l."""
    tokens, table = res
    row = axes[0]
    q, i = lax.axis_size(row), lax.axis_index(row)
    vq = table.shape[0]
    g = g.reshape(-1, g.shape[-1])

    def step(d_table: jax.Array, l: jax.Array) -> tuple[jax.Array, None]:
        local = tokens.reshape(-1) - l * vq
        hit = (local >= 0) & (local < vq)
        partial = (
            _zeros(table.shape, jnp.float32, g)
            .at[jnp.clip(local, 0, vq - 1)]
            .add(jnp.where(hit[:, None], g, 0).astype(jnp.float32))
            .astype(g.dtype)
        )  # onehot_ilᵀ dOut_ij
        return jnp.where(i == l, tree_reduce(partial, row, l), d_table), None

    d_table, _ = lax.scan(step, _zeros(table.shape, g.dtype, g), jnp.arange(q))
    return None, d_table.astype(table.dtype)


_embed.defvjp(_embed_fwd, _embed_bwd)


def embed_2d(tokens: jax.Array, table: jax.Array, *, axes: Sequence[str] = GRID) -> jax.Array:
    """Embedding lookup: tokens local int [b/q, s] (replicated within the row), table local E_ij [v/q, h/q].
    Returns local [b/q, s, h/q] in table.dtype; only table blocks travel (one per step, down the column)."""
    tokens, table = _vary(tokens, table)
    return _embed(tokens, table, tuple(axes))


def cross_entropy_2d(
    x: jax.Array, w_head: jax.Array, targets: jax.Array, *, tied: bool = False, axes: Sequence[str] = GRID
) -> jax.Array:
    """Per-token loss log Σ_v e^{x_v} - x_label with the vocabulary split across the row.

    x: local [b/q, s, h/q]; w_head: local [h/q, v/q] block of w_head [h, v] (logits by Algorithm 1) or, when
    `tied`, the embedding table block [v/q, h/q] (logits = x Eᵀ by Algorithm 2); targets: local int
    [b/q, s] (a target outside [0, v) picks no label: its loss is log Σ e^x). Returns fp32 [b/q, s],
    identical within the row.
    """
    col = axes[1]
    bq, s, hq = x.shape
    product = summa_abt if tied else summa_ab
    logits = product(x.reshape(bq * s, hq), w_head, row_axis=axes[0], col_axis=col).astype(jnp.float32)
    vq = logits.shape[1]
    m = lax.pmax(lax.stop_gradient(logits.max(-1)), col)  # stable max over the whole row
    sumexp = lax.psum(jnp.exp(logits - m[:, None]).sum(-1), col)
    local = targets.reshape(-1) - lax.axis_index(col) * vq
    hit = (local >= 0) & (local < vq)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, vq - 1)[:, None], axis=1)[:, 0]
    label = lax.psum(jnp.where(hit, picked, 0.0), col)  # from the column that owns it
    return (jnp.log(sumexp) + m - label).reshape(bq, s)


# ----------------------------------------------------------------------------------------------------------
# Global-array entry points
# ----------------------------------------------------------------------------------------------------------


def grid_mesh(mesh: Mesh) -> tuple[Mesh, int, tuple[str, ...]]:
    """(grid mesh with tp split into (tpr, tpc) = (q, q), q, data axes). Raises on meshes Optimus can't use."""
    names = mesh.axis_names
    if ROW in names and COL in names:
        grid, q = mesh, mesh.shape[ROW]
        if mesh.shape[COL] != q:
            raise ValueError(f"grid {ROW}={q} × {COL}={mesh.shape[COL]} must be square")
    else:
        if "tp" not in names:
            raise ValueError(f"mesh axes {names} have no 'tp' axis; Optimus lays its q×q grid over tp = q²")
        tp = mesh.shape["tp"]
        q = math.isqrt(tp)
        if q * q != tp:
            raise ValueError(f"tp = {tp} is not a perfect square; Optimus needs tp = q² devices for a q×q grid")
        grid = factored_mesh(mesh, "tp", GRID, (q, q))
    unusable = [f"{a}={grid.shape[a]}" for a in grid.axis_names if a not in DATA_AXES + GRID and grid.shape[a] > 1]
    if unusable:
        raise ValueError(
            f"mesh axes {', '.join(unusable)} > 1 cannot be used by Optimus (it splits the batch "
            f"over dp/fsdp and the q×q grid over tp)"
        )
    data = tuple(a for a in DATA_AXES if a in grid.axis_names)
    return grid, q, data


def _specs(data: tuple[str, ...]):
    rows = data + (ROW,)
    return P(rows, None, COL), P(rows, None)  # activations [b, s, h], tokens / positions [b, s]


def _check_divisible(what: str, value: int, by: int, rule: str):
    if value % by:
        raise ValueError(f"{what} {value} is not divisible by {rule} = {by}")


def _check_batch(x: jax.Array, grid: Mesh, q: int, data: tuple[str, ...], name: str = "x"):
    if x.ndim != 3:
        raise ValueError(f"{name} must be [batch, seq, hidden], got shape {x.shape}")
    d = math.prod(grid.shape[a] for a in data)
    _check_divisible("batch", x.shape[0], d * q, f"data degree × q = {d}×{q}")
    _check_divisible("hidden", x.shape[2], q, "q")


def _check_weight(name: str, w: jax.Array, shape: tuple[int, ...], q: int):
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {tuple(shape)}")
    for dim in w.shape:
        _check_divisible(f"{name} dimension", dim, q, "q")


def _mlp_local(x: jax.Array, params: dict[str, jax.Array], *, activation: str, names: tuple[str, ...]):
    del names
    return mlp_2d(x, params, activation=activation)


def _attention_local(x: jax.Array, params: dict[str, jax.Array], positions: jax.Array, **kw: Any):
    return attention_2d(x, params, positions, **kw)


def _layer_norm_local(x: jax.Array, scale: jax.Array, bias: jax.Array, *, eps: float):
    return layer_norm_2d(x, scale, bias, eps=eps)


def _embed_local(tokens: jax.Array, table: jax.Array):
    return embed_2d(tokens, table)


def _cross_entropy_local(x: jax.Array, w_head: jax.Array, targets: jax.Array, *, tied: bool):
    return cross_entropy_2d(x, w_head, targets, tied=tied)


def _run(kind: str, grid: Mesh, data: tuple[str, ...], static: tuple, args: tuple, specs: tuple):
    x_spec, tok_spec = _specs(data)
    local, options = {
        "mlp": (_mlp_local, dict(zip(("activation", "names"), static))),
        "attention": (
            _attention_local,
            dict(zip(("num_heads", "num_kv_heads", "causal", "rope_theta", "window"), static)),
        ),
        "layer_norm": (_layer_norm_local, dict(zip(("eps",), static))),
        "embed": (_embed_local, {}),
        "cross_entropy": (_cross_entropy_local, dict(zip(("tied",), static))),
    }[kind]
    out_spec = tok_spec if kind == "cross_entropy" else x_spec
    return run_local(local, grid, tuple(specs), out_spec, *args, **options)


def mlp_block(x: jax.Array, params: dict[str, jax.Array], *, mesh: Mesh, activation: str = "gelu") -> jax.Array:
    """x: global [batch, seq, hidden]; params {"w_in": [hidden, ffn], "w_out": [ffn, hidden]} plus
    "w_gate": [hidden, ffn] when activation == "swiglu" (y = (silu(x@w_gate) * (x@w_in)) @ w_out);
    gelu: y = gelu(x @ w_in) @ w_out (tanh approximation). No biases. Returns y [batch, seq, hidden].

    Two SUMMA products on the tp = q² grid; batch over (dp, fsdp, grid rows), hidden over the grid columns.
    """
    grid, q, data = grid_mesh(mesh)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} must be one of {ACTIVATIONS}")
    _check_batch(x, grid, q, data)
    hidden = x.shape[2]
    if "w_in" not in params or "w_out" not in params:
        raise ValueError(f"mlp params need 'w_in' and 'w_out', got {sorted(params)}")
    ffn = params["w_in"].shape[-1]
    names = ("w_in", "w_out") + (("w_gate",) if activation == "swiglu" else ())
    if activation == "swiglu" and "w_gate" not in params:
        raise ValueError("activation 'swiglu' needs params['w_gate'] [hidden, ffn]")
    for name in names:
        _check_weight(name, params[name], (ffn, hidden) if name == "w_out" else (hidden, ffn), q)
    params = {n: params[n] for n in names}
    x_spec, _ = _specs(data)
    return _run(
        "mlp", grid, data, (activation, tuple(sorted(names))), (x, params), (x_spec, {n: P(*GRID) for n in names})
    )


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
    window: int | None = None,
) -> jax.Array:
    """params {"wq": [hidden, num_heads*head_dim], "wk": [hidden, num_kv_heads*head_dim], "wv": as wk,
    "wo": [num_heads*head_dim, hidden]}; head h's columns are h*head_dim:(h+1)*head_dim. positions: global
    int32 [batch, seq] (RoPE on q and k when rope_theta is not None; the causal mask uses the same
    positions). window: sliding window W (needs causal): the query at position i sees keys i - W < j <= i.
    Returns y [batch, seq, hidden].

    Each device attends n/q heads of b/q sequences; num_heads and num_kv_heads must be divisible by q.
    """
    grid, q, data = grid_mesh(mesh)
    _check_batch(x, grid, q, data)
    window = check_window(window, bool(causal))
    batch, seq, hidden = x.shape
    if not (isinstance(num_heads, int) and isinstance(num_kv_heads, int) and num_heads > 0 and num_kv_heads > 0):
        raise ValueError(f"num_heads {num_heads!r} and num_kv_heads {num_kv_heads!r} must be positive integers")
    _check_divisible("num_heads", num_heads, q, "q (each device holds num_heads/q heads)")
    _check_divisible("num_kv_heads", num_kv_heads, q, "q (each device holds num_kv_heads/q K/V heads)")
    _check_divisible("num_heads", num_heads, num_kv_heads, "num_kv_heads (GQA groups)")
    missing = {"wq", "wk", "wv", "wo"} - set(params)
    if missing:
        raise ValueError(f"attention params miss {sorted(missing)}")
    _check_divisible("wq columns", params["wq"].shape[-1], num_heads, "num_heads")
    head_dim = params["wq"].shape[-1] // num_heads
    if rope_theta is not None and head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for RoPE")
    for name, shape in (
        ("wq", (hidden, num_heads * head_dim)),
        ("wk", (hidden, num_kv_heads * head_dim)),
        ("wv", (hidden, num_kv_heads * head_dim)),
        ("wo", (num_heads * head_dim, hidden)),
    ):
        _check_weight(name, params[name], shape, q)
    if tuple(positions.shape) != (batch, seq):
        raise ValueError(f"positions shape {tuple(positions.shape)} must be [batch, seq] = {(batch, seq)}")
    params = {n: params[n] for n in ("wq", "wk", "wv", "wo")}
    x_spec, tok_spec = _specs(data)
    theta = None if rope_theta is None else float(rope_theta)
    return _run(
        "attention",
        grid,
        data,
        (num_heads, num_kv_heads, bool(causal), theta, window),
        (x, params, positions),
        (x_spec, {n: P(*GRID) for n in params}, tok_spec),
    )


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, *, mesh: Mesh, eps: float = 1e-5) -> jax.Array:
    """LayerNorm of global x [batch, seq, hidden] with scale, bias [hidden], on the 2D layout (the affine
    parameters held once per grid column). Returns [batch, seq, hidden]."""
    grid, q, data = grid_mesh(mesh)
    _check_batch(x, grid, q, data)
    for name, p in (("scale", scale), ("bias", bias)):
        if tuple(p.shape) != (x.shape[2],):
            raise ValueError(f"{name} shape {tuple(p.shape)} must be [hidden] = {(x.shape[2],)}")
    x_spec, _ = _specs(data)
    return _run("layer_norm", grid, data, (float(eps),), (x, scale, bias), (x_spec, P(COL), P(COL)))


def _check_tokens(name: str, tokens: jax.Array, grid: Mesh, q: int, data: tuple[str, ...]):
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{name} must be int [batch, seq], got {tokens.dtype} {tuple(tokens.shape)}")
    d = math.prod(grid.shape[a] for a in data)
    _check_divisible("batch", tokens.shape[0], d * q, f"data degree × q = {d}×{q}")


def embed(tokens: jax.Array, table: jax.Array, *, mesh: Mesh) -> jax.Array:
    """Embedding lookup on the 2D layout. tokens: int [batch, seq]; table: [vocab, hidden] in q×q blocks.
    Returns [batch, seq, hidden] in table.dtype (batch over rows, hidden over columns)."""
    grid, q, data = grid_mesh(mesh)
    _check_tokens("tokens", tokens, grid, q, data)
    if table.ndim != 2:
        raise ValueError(f"table must be [vocab, hidden], got shape {tuple(table.shape)}")
    _check_divisible("vocab", table.shape[0], q, "q")
    _check_divisible("hidden", table.shape[1], q, "q")
    _, tok_spec = _specs(data)
    return _run("embed", grid, data, (), (tokens, table), (tok_spec, P(*GRID)))


def cross_entropy(x: jax.Array, w_head: jax.Array, targets: jax.Array, *, mesh: Mesh, tied: bool = False) -> jax.Array:
    """Per-token LM loss fp32 [batch, seq] = log Σ_v exp(logits) - logits[target], logits = x @ w_head.

    x: [batch, seq, hidden]; w_head: [hidden, vocab] (Algorithm 1), or with `tied` the embedding table
    [vocab, hidden] (logits = x @ tableᵀ by Algorithm 2); targets: int [batch, seq].
    """
    grid, q, data = grid_mesh(mesh)
    _check_batch(x, grid, q, data)
    _check_tokens("targets", targets, grid, q, data)
    if tuple(targets.shape) != tuple(x.shape[:2]):
        raise ValueError(f"targets shape {tuple(targets.shape)} must be [batch, seq] = {tuple(x.shape[:2])}")
    hidden = x.shape[2]
    if w_head.ndim != 2 or w_head.shape[1 if tied else 0] != hidden:
        want = "[vocab, hidden]" if tied else "[hidden, vocab]"
        raise ValueError(f"w_head shape {tuple(w_head.shape)} must be {want} with hidden = {hidden}")
    _check_divisible("vocab", w_head.shape[0 if tied else 1], q, "q")
    x_spec, tok_spec = _specs(data)
    return _run("cross_entropy", grid, data, (bool(tied),), (x, w_head, targets), (x_spec, P(*GRID), tok_spec))


def param_specs(mesh: Mesh, params_shapes: dict[str, Any]) -> dict:
    """name -> NamedSharding on the grid mesh: 2D weights in q×q blocks P("tpr", "tpc"), 1D vectors (layernorm
    affine) P("tpc") replicated over the rows; replicated over the data axes. params_shapes: name -> array,
    ShapeDtypeStruct or shape tuple."""
    grid, q, _ = grid_mesh(mesh)
    out = {}
    for name, p in params_shapes.items():
        shape = tuple(getattr(p, "shape", p))
        if len(shape) not in (1, 2):
            raise ValueError(f"param {name} shape {shape}: Optimus shards 2D weights and 1D vectors only")
        for dim in shape:
            _check_divisible(f"param {name} dimension", dim, q, "q")
        out[name] = NamedSharding(grid, P(*GRID) if len(shape) == 2 else P(COL))
    return out


# ----------------------------------------------------------------------------------------------------------
# The method, for the train step's shard_map
# ----------------------------------------------------------------------------------------------------------


class Optimus(TensorMethod):
    """Optimus 2D over tp = q²: the run mesh factors tp into the (tpr, tpc) grid; activations [b/q, s, h/q]
    (batch over the data axes and the grid rows, hidden over the columns); weights in q×q blocks."""

    name = "optimus"
    runs_moe = False
    whole_hidden = False
    axes = GRID
    summary = "Optimus 2D: SUMMA products on a q×q grid, activations [b/q, s, h/q]"
    sequence_parallel = False
    sequence_parallel_rule = (
        "Optimus keeps whole sequences on each grid row (activations [b/q, s, h/q]) and "
        "splits batch and hidden instead; use megatron for tensor × sequence parallelism"
    )

    def view(self, mesh: Mesh) -> Mesh:
        return grid_mesh(mesh)[0]

    def check_mesh(self, plan: ParallelPlan) -> None:
        if not self.accepts(plan.tp):
            raise ValueError(f"tp = {plan.tp} is not a perfect square; Optimus needs tp = q² devices for a q×q grid")

    def accepts(self, tp: int) -> bool:
        """tp = q² > 1: a q×q grid."""
        return tp > 1 and math.isqrt(tp) ** 2 == tp

    def _q(self, plan: ParallelPlan):
        return math.isqrt(plan.tp)

    def check_model(
        self, plan: ParallelPlan, *, num_heads: int, num_kv_heads: int, hidden: int, ffn: int, vocab: int | None
    ) -> None:
        q = self._q(plan)
        for what, value in (
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
            ("hidden", hidden),
            ("ffn", ffn),
        ) + ((("vocab", vocab),) if vocab is not None else ()):
            _check_divisible(what, value, q, "q")

    def batch_split_at(self, tp: int) -> int:
        return math.isqrt(tp)

    def head_split(self, plan: ParallelPlan) -> int:
        return self._q(plan)

    def local_rows(self, plan: ParallelPlan, seq_len: int) -> int:
        return seq_len

    def activation_spec(self, plan: ParallelPlan) -> P:
        return P(spec_entry(plan.batch_axes + (ROW,)), None, COL)

    def token_spec(self, plan: ParallelPlan) -> P:
        return P(spec_entry(plan.batch_axes + (ROW,)), None)

    def vector_spec(self, plan: ParallelPlan) -> P:
        return P(spec_entry(plan.batch_axes + (ROW,)), COL)

    def param_spec(self, plan: ParallelPlan, info: ParamInfo) -> tuple:
        named = [a is not None for a in info.logical_axes]
        if len(info.shape) == 2 and all(named):
            return GRID  # q×q blocks
        if len(info.shape) == 2 and named == [False, True]:
            return (None, COL)  # e.g. learned positions: rows whole, hidden split
        if len(info.shape) == 1 and named == [True]:
            return (COL,)  # layernorm vectors: held once per column
        return (None,) * len(info.shape)

    def embed(
        self,
        plan: ParallelPlan,
        tokens: jax.Array,
        table: jax.Array,
        positions: jax.Array | None = None,
        pos_table: jax.Array | None = None,
    ) -> jax.Array:
        x = embed_2d(tokens, table)
        if pos_table is not None:
            x = x + jnp.take(pos_table, positions, axis=0)
        return x

    def norm(
        self, plan: ParallelPlan, x: jax.Array, scale: jax.Array, bias: jax.Array | None, *, eps: float = 1e-5
    ) -> jax.Array:
        return layer_norm_2d(x, scale, bias, eps=eps)

    def rms_norm(self, plan: ParallelPlan, x: jax.Array, scale: jax.Array, *, eps: float = 1e-6) -> jax.Array:
        return rms_norm_2d(x, scale, eps=eps)

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
        del head_dim
        return attention_2d(
            x,
            w,
            positions,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            causal=causal,
            rope_theta=rope,
            window=window,
            norm_eps=norm_eps,
            segment_ids=segment_ids,
            token_order=jnp.arange(positions.shape[1], dtype=jnp.int32),  # whole rows: the layout's order
        )

    def mlp(self, plan: ParallelPlan, x: jax.Array, w: dict, *, activation: str) -> jax.Array:
        return mlp_2d(x, w, activation=activation)

    def cross_entropy(
        self, plan: ParallelPlan, x: jax.Array, w: jax.Array, targets: jax.Array, *, tied: bool
    ) -> jax.Array:
        return cross_entropy_2d(x, w, targets, tied=tied)

    def moe(
        self, plan: ParallelPlan, x: jax.Array, moe: Callable[..., tuple[jax.Array, dict]]
    ) -> tuple[jax.Array, dict]:
        raise ValueError(
            f"mixture-of-experts layers cannot run with tensor parallelism '{self.name}': its "
            f"layout splits what the experts' all-to-all exchanges; use megatron (or none) with --ep"
        )

    # --- cost model: SUMMA (Algorithms 1-3) per product; Table 1: log(p)/(2√p)·(7bsh + 12h²) forward
    def local_dims(self, m: ModelShape) -> LocalDims:
        q = math.isqrt(m.tp)
        vocab = None if m.vocab is None else m.vocab // q
        return LocalDims(
            m.b // q, m.n, m.n, m.hidden // q, m.heads // q, m.kv_heads // q, m.ffn // q, vocab, batch_split=q
        )

    def layer_transfers(self, m: ModelShape, x: LocalDims) -> list[Transfer]:
        """The four products of a layer (QKV, the output projection, the FFN's in (and gate) and out) as
        C = AB: forward A within the row, B down the column; backward dA = dC·Bᵀ (B down the column, dA
        reduced in the row) and dB = Aᵀ·dC (A in the row, dB reduced down the column); plus the two 2D layer
        norms' row sums (Σx, Σx² forward; Σx̂g, Σg backward)."""
        q, h, d = math.isqrt(m.tp), m.hidden, m.head_dim
        rows = x.b * m.seq_len  # [b/q·s] rows of the local activation block
        hq, fq = h // q, m.ffn // q
        qkv = (m.heads + 2 * m.kv_heads) * d // q
        products = [
            (rows * hq, hq * qkv),
            (rows * m.heads * d // q, m.heads * d // q * hq),
            (rows * hq, hq * (m.ffn_matrices - 1) * fq),
            (rows * fq, fq * hq),
        ]
        row = col = 0.0
        for a, b in products:
            r_, c_ = _summa_bytes(q, a, b, m.e)
            row, col = row + r_, col + c_
        ln = 2 * 2 * (2 * 2 * (q - 1) / q * rows * F32)
        return [
            Transfer("Optimus SUMMA within rows (activation blocks)", (COL,), row + ln, 8 * q),
            Transfer("Optimus SUMMA down columns (weight blocks)", (ROW,), col, 8 * q),
        ]

    def head_transfers(self, m: ModelShape, x: LocalDims) -> list[Transfer]:
        """The embedding lookup and head (Algorithms 1-2) with the final 2D norm and the row-wise
        cross-entropy (max, Σexp, label)."""
        if m.vocab is None:
            return []
        q, e = math.isqrt(m.tp), m.e
        rows = x.b * m.seq_len
        hq, vq = m.hidden // q, m.vocab // q
        table = vq * hq
        if m.tied:
            # lookup (Alg 1 with a local one-hot: the table down the column) and head (Alg 2, logits = x·Eᵀ):
            # the table blocks are broadcast once for the lookup, the head and its dA (XLA merges the three
            # identical broadcasts); the head's dC is broadcast once within the row for dA and dB
            col = _bcast_bytes(q, table) * e + _reduce_bytes(q, table) * F32 + _reduce_bytes(q, table) * F32
            row = _reduce_bytes(q, rows * vq) * F32 + _bcast_bytes(q, rows * vq) * e
        else:
            r_, c_ = _summa_bytes(q, rows * hq, hq * vq, e)
            col = _bcast_bytes(q, table) * e + _reduce_bytes(q, table) * F32 + c_
            row = r_
        ln = 2 * (2 * 2 * (q - 1) / q * rows * F32)
        ce = 3 * 2 * (q - 1) / q * rows * F32
        return [
            Transfer("Optimus embedding and head within rows; norm; cross-entropy", (COL,), row + ln + ce, 6),
            Transfer("Optimus embedding and head down columns", (ROW,), col, 4),
        ]


def _bcast_bytes(q: int, size: float) -> float:
    """Blocks received by a SUMMA step broadcast over q ranks (binomial tree; round 0 shared by the q steps)."""
    return (1 + q * (tree_rounds(q) - 1)) * size


def _reduce_bytes(q: int, size: float) -> float:
    return q * tree_rounds(q) * size


def _summa_bytes(q: int, a: float, b: float, e: int) -> tuple[float, float]:
    """(bytes within the row (tpc), bytes down the column (tpr)) of C = AB forward and backward, |A|, |B| in
    elements: forward A in the row, B down the column; dA = dC·Bᵀ: B down the column, dA reduced (fp32) in the
    row; dB = Aᵀ·dC: A in the row, dB reduced (fp32) down the column."""
    row = 2 * _bcast_bytes(q, a) * e + _reduce_bytes(q, a) * F32
    col = 2 * _bcast_bytes(q, b) * e + _reduce_bytes(q, b) * F32
    return row, col


METHOD = Optimus()
