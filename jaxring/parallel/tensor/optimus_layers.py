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
1 + q(R-1) blocks (reductions carry step-dependent partial sums: qR). tests/unit/parallel/test_optimus.py asserts both.

Layer mapping (Fig. 4): QKV (one SUMMA on the local blocks of wq|wk|wv side by side, so x is broadcast once)
→ each device holds n/q heads of b/q whole sequences, attention is local (`flash_attention`) → output
projection SUMMA. MLP: two SUMMAs with the nonlinearity local. Layernorm: Σx and Σx² all-reduced within
the row. Embedding: tokens [b/q, s] replicated within a row, table [v, h] in q×q blocks; the lookup is
Alg 1 with the one-hot matrix built locally (only table blocks travel). LM head: Alg 1 with w_head [h, v]
or, tied, Alg 2 with the table [v, h]; the cross-entropy takes a stable max (pmax) and Σe^x within the row
and the label logit from the column that owns it.

This module holds the layer functions (`summa_ab`, `mlp_2d`, `attention_2d`, ...), run inside
`jax.shard_map` on the grid mesh; `optimus.py` is the tensor method (the grid view, layouts and cost model)
and `optimus_api.py` the same layers on global arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.core.collectives import prefetch_steps, tree_broadcast, tree_reduce
from jaxring.core.vma import common_vma
from jaxring.kernels.flash import flash_attention
from jaxring.kernels.layer_math import add_bias, check_activation, qk_norm_rope

if TYPE_CHECKING:
    from jaxring.kernels.rope import Rope

ROW, COL = "tpr", "tpc"  # grid axes: device (i, j) has tpr = i, tpc = j
GRID = (ROW, COL)

__all__ = [
    "COL",
    "GRID",
    "ROW",
    "attention_2d",
    "cross_entropy_2d",
    "embed_2d",
    "layer_norm_2d",
    "mlp_2d",
    "rms_norm_2d",
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
    check_activation(activation)
    if activation == "gelu":
        act = jax.nn.gelu(add_bias(_matmul(x, params["w_in"], axes), params.get("b_in")), approximate=True)
    else:
        fq = params["w_in"].shape[1]
        both = _matmul(x, jnp.concatenate([params["w_gate"], params["w_in"]], axis=1), axes)
        gate, inner = add_bias(both[..., :fq], params.get("b_gate")), add_bias(both[..., fq:], params.get("b_in"))
        act = jax.nn.silu(gate) * inner
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
