"""Megatron-LM tensor parallelism with sequence parallelism (TP+SP): the layer functions, as in the Ultra-Scale Playbook [Playbook] (REFERENCES.md).

A Transformer block on p = tp devices, with a local activation X_i of shape [b, s/p, h] on rank i:

  SP region  (s split)   Y_i  = LayerNorm(X_i)                  LN gradients all-reduced over tp
  g          (SP -> TP)  Y    = all_gather_s(Y_i)                backward: reduce-scatter
  column     (h split)   Z_i  = act(Y A_i)   or Q_i, K_i, V_i = Y Wq_i, Y Wk_i, Y Wv_i  (heads over tp)
  row        (h split)   W_i  = Z_i B_i      (partial sums [b, s, h])
  g*         (TP -> SP)  O_i  = reduce_scatter_s(sum_j W_j)      backward: all-gather

Plain TP (`sequence_parallel=False`) keeps X replicated and uses the conjugate pair f (identity forward,
all-reduce backward) before the column-linear and f* (all-reduce forward, identity backward) after the
row-linear.

Backward of the column-linear with gather (`column_parallel_linear`, a `jax.custom_vjp`): as Megatron-LM it
saves only the LOCAL shard X_i, not the gathered Y, and all-gathers it again in the backward to form
dA = Yᵀ dZ; dY = dZ Aᵀ is reduce-scattered back to the sequence shard. Communication of an FFN per device,
in elements received (b local batch):
  forward   all-gather X (p-1)/p·bsh + reduce-scatter O (p-1)/p·bsh
  backward  all-gather dO (p-1)/p·bsh + all-gather X again (p-1)/p·bsh + reduce-scatter dY (p-1)/p·bsh
  total     5 (p-1)/p · bsh          (METP Table 1, row "Megatron TP+SP": (p-1)/p·(3mk1 + 2mn))
Memory after forward of the FFN: X_i (bsh/p) and the pre-activation Y A_i (bs·ffn/p); the activation is
recomputed in the backward (elementwise), so at ffn = 4h that is the table's 5bsh/p (plus weight shards).
The attention block has the same pattern (Q, K, V share one gather of X); its positions ([b, s] int32) are
gathered once more, (p-1)/p·bs. tests/unit/parallel/test_megatron.py asserts both totals exactly on the compiled program,
and the saved residuals (jax.vjp) of the FFN.

Everything here runs inside `jax.shard_map` with check_vma=True (the default): the varying-axes types carry
the gradient reductions of replicated values (JAX transposes `pcast(to="varying")` into a psum), and the
layer functions make them explicit where Megatron does (f, LayerNorm parameters, weights under dp).

This module holds those layer functions (the kernels); `megatron.py` is the tensor method (its layouts and
cost model) and `megatron_api.py` the same layers on global arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxring.core.vma import common_vma, vary, varying_axes
from jaxring.kernels.flash import flash_attention
from jaxring.kernels.layer_math import activate, add_bias, check_activation, qk_norm_rope
from jaxring.parallel.tensor.contract import MATMUL_OUTPUT

if TYPE_CHECKING:
    from jaxring.kernels.rope import Rope

__all__ = [
    "attention",
    "column_parallel_linear",
    "copy_to_tp",
    "gather_from_sp",
    "layer_norm",
    "mlp",
    "reduce_from_tp",
    "rms_norm",
    "row_parallel_linear",
    "scatter_to_sp",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embed",
]


# ----------------------------------------------------------------------------------------------------------
# The conjugate transitions: f / f* (plain TP) and g / g* (TP with SP)
# ----------------------------------------------------------------------------------------------------------


def copy_to_tp(x: jax.Array, axis_name: str = "tp") -> jax.Array:
    """f: identity forward, all-reduce (psum over `axis_name`) backward. x is replicated over the axis
    (a no-op when x already varies over it: then its gradient is reduced wherever it became varying)."""
    return vary(x, (axis_name,))


def reduce_from_tp(x: jax.Array, axis_name: str = "tp") -> jax.Array:
    """f*: all-reduce forward, identity backward (psum's transpose under check_vma)."""
    return lax.psum(x, axis_name)


def gather_from_sp(x: jax.Array, axis_name: str = "tp", axis: int = 1) -> jax.Array:
    """g: all-gather the sequence shards [b, s/p, ...] -> [b, s, ...]; backward: reduce-scatter."""
    return lax.all_gather(x, axis_name, axis=axis, tiled=True)


def scatter_to_sp(x: jax.Array, axis_name: str = "tp", axis: int = 1) -> jax.Array:
    """g*: reduce-scatter partial sums [b, s, ...] -> summed shard [b, s/p, ...]; backward: all-gather."""
    return lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)


# ----------------------------------------------------------------------------------------------------------
# Column- and row-parallel linears
# ----------------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_linear(axis_name: str, x: jax.Array, ws: tuple[jax.Array, ...]):
    y = gather_from_sp(x, axis_name)  # g: [b, s, h]
    return tuple(jnp.einsum("bsh,hn->bsn", y, w) for w in ws)


def _gather_linear_fwd(axis_name: str, x: jax.Array, ws: tuple[jax.Array, ...]):
    # residuals: the LOCAL shard x [b, s/p, h] and the weight shards, never the gathered [b, s, h]
    return _gather_linear(axis_name, x, ws), (x, ws)


def _gather_linear_bwd(axis_name: str, res: tuple, dzs: tuple[jax.Array, ...]):
    x, ws = res
    # X is all-gathered again. The barrier orders the gather after dZ exists; gathering it as [b, p, s/p, h]
    # (reshaped for free) makes it a different HLO op from the forward's gather, so XLA's CSE cannot merge
    # the two and keep the gathered [b, s, h] alive from forward to backward (XLA:CPU drops barriers first).
    x, dzs = lax.optimization_barrier((x, dzs))
    y = lax.all_gather(x, axis_name, axis=1).reshape(x.shape[0], -1, x.shape[2])
    dy = sum(jnp.einsum("bsn,hn->bsh", dz, w) for dz, w in zip(dzs, ws))  # dY = dZ Aᵀ (overlaps the gather)
    dx = scatter_to_sp(dy, axis_name)  # reduce-scatter to [b, s/p, h]
    dws = tuple(jnp.einsum("bsh,bsn->hn", y, dz).astype(w.dtype) for w, dz in zip(ws, dzs))  # dA = Yᵀ dZ
    return dx.astype(x.dtype), dws


_gather_linear.defvjp(_gather_linear_fwd, _gather_linear_bwd)


def column_parallel_linear(
    x: jax.Array,
    w: jax.Array | Sequence[jax.Array],
    *,
    axis_name: str = "tp",
    sequence_parallel: bool = True,
    recompute_gather: bool = True,
) -> jax.Array | tuple[jax.Array, ...]:
    """Y A_i with A split by columns over `axis_name`.

    Args:
      x: sequence parallel: the local sequence shard [b, s/p, h] (gathered here, g); plain TP: [b, s, h],
        replicated over the axis (entered through f).
      w: the local column block [h, n/p], or a tuple of blocks that share x (Q, K, V; SwiGLU's two inputs):
        x is gathered once for all of them.
      recompute_gather: (SP) save only x and all-gather it again in the backward, as Megatron-LM does; False
        lets autodiff save the gathered [b, s, h] instead (one all-gather less, p times the memory).
    Returns: [b, s, n/p] (a tuple when w is a tuple): full sequence, columns of this rank.
    """
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    for wi in ws:
        if wi.ndim != 2 or wi.shape[0] != x.shape[-1]:
            raise ValueError(
                f"column-linear weight shape {wi.shape} must be [hidden, n/p] with hidden = "
                f"{x.shape[-1]} (the last dim of x {x.shape})"
            )
    if not sequence_parallel:
        y = copy_to_tp(x, axis_name)  # f
        out = tuple(jnp.einsum("bsh,hn->bsn", y, wi) for wi in ws)
    elif recompute_gather:
        # a common vma, so the custom_vjp's cotangents have their primals' types: the weights' gradient
        # psum over the data axes happens in the transpose of this cast
        x, ws = common_vma(x, ws)
        # named: selective remat saves them (the dots are hidden in the custom_vjp), so the backward neither
        # gathers X nor multiplies again to recompute Q, K, V or the MLP's inputs
        out = tuple(checkpoint_name(o, MATMUL_OUTPUT) for o in _gather_linear(axis_name, x, ws))
    else:
        y = gather_from_sp(x, axis_name)
        out = tuple(jnp.einsum("bsh,hn->bsn", y, wi) for wi in ws)
    return out if isinstance(w, (tuple, list)) else out[0]


def row_parallel_linear(
    x: jax.Array, w: jax.Array, *, axis_name: str = "tp", sequence_parallel: bool = True
) -> jax.Array:
    """Z_i B_i with B split by rows over `axis_name`, then summed over ranks.

    Args:
      x: [b, s, n/p] (full sequence, this rank's columns of the previous column-linear); w: [n/p, h].
    Returns: sequence parallel: the summed local sequence shard [b, s/p, h] (g*, reduce-scatter);
      plain TP: [b, s, h] (f*, all-reduce).
    """
    if w.ndim != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(
            f"row-linear weight shape {w.shape} must be [n/p, hidden] with n/p = {x.shape[-1]} "
            f"(the last dim of x {x.shape})"
        )
    partial = jnp.einsum("bsn,nh->bsh", x, w)
    return scatter_to_sp(partial, axis_name) if sequence_parallel else reduce_from_tp(partial, axis_name)


# ----------------------------------------------------------------------------------------------------------
# MLP and attention (inside shard_map)
# ----------------------------------------------------------------------------------------------------------


def mlp(
    x: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    w_gate: jax.Array | None = None,
    *,
    activation: str = "gelu",
    axis_name: str = "tp",
    sequence_parallel: bool = True,
    recompute_gather: bool = True,
    b_in: jax.Array | None = None,
    b_gate: jax.Array | None = None,
    b_out: jax.Array | None = None,
) -> jax.Array:
    """Column-linear, activation, row-linear: gelu(X A) B, or SwiGLU (silu(X G) * (X A)) B.

    Args:
      x: [b, s/p, h] (sequence parallel) or [b, s, h] (plain TP). w_in, w_gate: local columns [h, ffn/p];
      w_out: local rows [ffn/p, h]. Optional biases: b_in, b_gate local [ffn/p] (added to the column outputs),
      b_out [h] (added once, after the reduction).
    Returns: the same layout as x. The activation is recomputed in the backward (jax.checkpoint), so the
    block keeps x and the pre-activation(s) [b, s, ffn/p] after its forward.
    """
    check_activation(activation)
    if (activation == "swiglu") != (w_gate is not None):
        raise ValueError(
            f"w_gate is needed by swiglu and only by it; activation={activation!r}, "
            f"w_gate {'given' if w_gate is not None else 'missing'}"
        )
    kw = dict(axis_name=axis_name, sequence_parallel=sequence_parallel)
    ws = (w_in,) if w_gate is None else (w_in, w_gate)
    pre = column_parallel_linear(x, ws, recompute_gather=recompute_gather, **kw)
    pre = tuple(add_bias(t, b) for t, b in zip(pre, (b_in, b_gate)))

    @jax.checkpoint  # saves pre and w_out; the activation is recomputed for dB = act(pre)ᵀ dO
    def act_linear(pre: tuple[jax.Array, ...], w_out: jax.Array) -> jax.Array:
        a = activate(pre[0], pre[1] if activation == "swiglu" else None, activation)
        return jnp.einsum("bsn,nh->bsh", a, w_out)

    if w_out.ndim != 2 or w_out.shape[0] != pre[0].shape[-1]:
        raise ValueError(f"w_out shape {w_out.shape} must be [ffn/p, hidden] with ffn/p = {pre[0].shape[-1]}")
    partial = act_linear(pre, w_out)  # row-linear, partial sums
    out = scatter_to_sp(partial, axis_name) if sequence_parallel else reduce_from_tp(partial, axis_name)
    return add_bias(out, b_out)


def attention(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    wo: jax.Array,
    positions: jax.Array,
    *,
    head_dim: int,
    causal: bool = True,
    rope_theta: Rope | float | None = 10000.0,
    axis_name: str = "tp",
    sequence_parallel: bool = True,
    recompute_gather: bool = True,
    attend: Callable[..., jax.Array] | None = None,
    extras: dict | None = None,
    norm_eps: float = 1e-6,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Self-attention with heads split over `axis_name`: Q, K, V column-linears, attention on the local heads
    over the whole (tp-gathered) sequence, output projection as a row-linear.

    Args:
      x: [b, s/p, h] (sequence parallel) or [b, s, h] (plain TP).
      wq: local [h, hq*head_dim]; wk, wv: local [h, hkv*head_dim] with hq % hkv == 0 (query head j of this
        rank reads its K/V head j // (hq / hkv)); wo: local [hq*head_dim, h].
      positions: int [b, s/p] like x (then gathered with x) or already [b, s]: RoPE angles (and the default
        core's causal mask).
      rope_theta: a theta (plain RoPE), a `jaxring.kernels.rope.Rope`, or None.
      attend: attend(q, k, v, positions, segment_ids) -> out on [b, s, heads, d]: the attention core, e.g. a
        sequence strategy over another mesh axis (tensor × sequence parallelism); default flash attention.
      segment_ids: int [b, s/p] or [b, s] like positions (gathered with them), or None: packed documents
        (a query sees only keys of its segment; 0 is padding).
      extras: optional local biases bq [hq·d], bk/bv [hkv·d] (on the column outputs), bo [h] (after the
        reduction), and QK-norm scales q_norm/k_norm [d] (RMSNorm per head with eps `norm_eps`, before RoPE).
      window: sliding window W of the default core (needs causal): the query at position i sees keys
        i - W < j <= i; None: unlimited. A given `attend` applies its own.
    Returns: the same layout as x.
    """
    extras = extras or {}
    if wq.shape[1] % head_dim or wk.shape[1] % head_dim or wk.shape != wv.shape:
        raise ValueError(
            f"wq {wq.shape}, wk {wk.shape}, wv {wv.shape}: columns must be whole heads of "
            f"head_dim {head_dim}, wk and wv alike"
        )
    hq, hkv = wq.shape[1] // head_dim, wk.shape[1] // head_dim
    if hkv == 0 or hq % hkv:
        raise ValueError(f"local query heads {hq} must be a multiple of local kv heads {hkv}")
    kw = dict(axis_name=axis_name, sequence_parallel=sequence_parallel)
    q, k, v = column_parallel_linear(x, (wq, wk, wv), recompute_gather=recompute_gather, **kw)
    q, k, v = (add_bias(t, extras.get(f"b{n}")) for t, n in zip((q, k, v), "qkv"))
    b, s = q.shape[:2]
    q, k, v = (t.reshape(b, s, -1, head_dim) for t in (q, k, v))
    gather = sequence_parallel and positions.shape[1] != s
    pos = gather_from_sp(positions, axis_name) if gather else positions  # [b, s]
    seg = gather_from_sp(segment_ids, axis_name) if gather and segment_ids is not None else segment_ids
    q, k = qk_norm_rope(q, k, extras, pos, rope_theta, eps=norm_eps)
    if attend is None:
        out = flash_attention(q, k, v, causal=causal, q_positions=pos, kv_positions=pos, segment_ids=seg, window=window)
    else:
        out = attend(q, k, v, pos, seg)  # [b, s, hq, d]
    return add_bias(row_parallel_linear(out.reshape(b, s, hq * head_dim), wo, **kw), extras.get("bo"))


# ----------------------------------------------------------------------------------------------------------
# Norms in the sequence-parallel region
# ----------------------------------------------------------------------------------------------------------


def _replicated_params(x: jax.Array, *params: jax.Array | None):
    """Replicated parameters entering x's region. Where x differs per rank (SP region: the tp axis; the
    data axes) this is f — identity forward, all-reduce of the gradient backward — the Playbook's "LayerNorm
    grads all-reduced over TP" (and DP's). Where x is replicated (plain TP) nothing is reduced."""
    axes = varying_axes(x)
    return tuple(None if p is None else vary(p, axes) for p in params)


def layer_norm(x: jax.Array, gamma: jax.Array, beta: jax.Array | None = None, *, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the hidden dim of a sequence shard x [b, s/p, h]; gamma, beta [h] replicated.

    Computed in fp32, returned in x.dtype. Gradients of gamma/beta are summed over the ranks x varies over.
    """
    if gamma.shape != x.shape[-1:] or (beta is not None and beta.shape != gamma.shape):
        raise ValueError(
            f"gamma {gamma.shape} / beta {None if beta is None else beta.shape} must be [hidden] = {x.shape[-1:]}"
        )
    gamma, beta = _replicated_params(x, gamma, beta)
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * lax.rsqrt(var + eps) * gamma
    return (y if beta is None else y + beta).astype(x.dtype)


def rms_norm(x: jax.Array, gamma: jax.Array, *, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over the hidden dim of x [b, s/p, h]; gamma [h] replicated (gradient summed as layer_norm)."""
    if gamma.shape != x.shape[-1:]:
        raise ValueError(f"gamma {gamma.shape} must be [hidden] = {x.shape[-1:]}")
    (gamma,) = _replicated_params(x, gamma)
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps) * gamma
    return y.astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# Vocab-parallel embedding and cross-entropy
# ----------------------------------------------------------------------------------------------------------


def vocab_parallel_embed(
    tokens: jax.Array, table: jax.Array, *, axis_name: str = "tp", sequence_parallel: bool = True
) -> jax.Array:
    """Embedding with the table split by vocab rows: rank r holds ids [r·v/p, (r+1)·v/p).

    Args:
      tokens: int [b, s], the whole sequence (replicated over the axis); table: local rows [v/p, h].
    Returns: sequence parallel: [b, s/p, h] (reduce-scatter of the masked lookups, g*); plain TP: [b, s, h]
      (all-reduce, f*).
    """
    rows = table.shape[0]
    local = tokens - lax.axis_index(axis_name) * rows
    mine = (local >= 0) & (local < rows)
    emb = jnp.take(table, jnp.where(mine, local, 0), axis=0)
    emb = jnp.where(mine[..., None], emb, jnp.zeros((), table.dtype))
    return scatter_to_sp(emb, axis_name) if sequence_parallel else reduce_from_tp(emb, axis_name)


def vocab_parallel_cross_entropy(logits: jax.Array, targets: jax.Array, *, axis_name: str = "tp") -> jax.Array:
    """Cross-entropy over logits split by vocab, never gathered: rank r holds ids [r·v/p, (r+1)·v/p).

      m = pmax(max_j l_j);  Z = psum(sum_j exp(l_j - m));  l_t = psum(l_target if mine else 0)
      loss = log Z + m - l_t

    Args:
      logits: [b, s, v/p] (any float dtype; computed in fp32); targets: int [b, s] in [0, v).
    Returns: per-token loss fp32 [b, s], the same on every rank. Gradient: softmax - onehot, local.
    """
    logits = logits.astype(jnp.float32)
    cols = logits.shape[-1]
    m = lax.pmax(lax.stop_gradient(jnp.max(logits, axis=-1)), axis_name)  # the loss does not depend on m
    sum_exp = lax.psum(jnp.sum(jnp.exp(logits - m[..., None]), axis=-1), axis_name)
    local = targets - lax.axis_index(axis_name) * cols
    mine = (local >= 0) & (local < cols)
    picked = jnp.take_along_axis(logits, jnp.where(mine, local, 0)[..., None], axis=-1)[..., 0]
    target_logit = lax.psum(jnp.where(mine, picked, 0.0), axis_name)
    return jnp.log(sum_exp) + m - target_logit
