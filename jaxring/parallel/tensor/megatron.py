"""Megatron-LM tensor parallelism with sequence parallelism (TP+SP), as in the Ultra-Scale Playbook [Playbook] (REFERENCES.md).

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
gathered once more, (p-1)/p·bs. tests/test_megatron.py asserts both totals exactly on the compiled program,
and the saved residuals (jax.vjp) of the FFN.

Everything here runs inside `jax.shard_map` with check_vma=True (the default): the varying-axes types carry
the gradient reductions of replicated values (JAX transposes `pcast(to="varying")` into a psum), and the
layer functions make them explicit where Megatron does (f, LayerNorm parameters, weights under dp).
The model-facing entry points `mlp_block`, `attention_block`, `embed` and `cross_entropy` take global
arrays and do their own shard_map: batch over dp and fsdp, sequence (SP regions) and hidden/heads/vocab
(TP regions) over tp.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import DATA_AXES, mesh_axis_size, spec_entry
from jaxring.core.sharded import run_local
from jaxring.core.vma import common_vma, gather_invariant, vary, varying_axes
from jaxring.kernels.flash import flash_attention
from jaxring.kernels.masking import check_window
from jaxring.parallel.cost_terms import F32, LocalDims, ModelShape, Transfer
from jaxring.parallel.tensor.contract import (
    ACTIVATIONS,
    MATMUL_OUTPUT,
    ParamInfo,
    TensorMethod,
    activate,
    add_bias,
    modulation_gradients,
    own_kv_head,
    qk_norm_rope,
)

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxring.kernels.rope import Rope
    from jaxring.parallel.plan import ParallelPlan

__all__ = [
    "attention",
    "attention_block",
    "column_parallel_linear",
    "copy_to_tp",
    "cross_entropy",
    "embed",
    "gather_from_sp",
    "layer_norm",
    "mlp",
    "mlp_block",
    "param_specs",
    "reduce_from_tp",
    "rms_norm",
    "row_parallel_linear",
    "scatter_to_sp",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embed",
]


# ----------------------------------------------------------------------------------------------------------
# Varying mesh axes (check_vma types)
# ----------------------------------------------------------------------------------------------------------

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


def _check_activation(activation: str):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")


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
    _check_activation(activation)
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


# ----------------------------------------------------------------------------------------------------------
# Global entry points (the model-facing contract)
# ----------------------------------------------------------------------------------------------------------


def _mesh_axes(mesh: Mesh, batch: int):
    """(data axes spec entry, tp) after checking the mesh: a tp axis; only dp, fsdp, tp larger than 1."""
    if "tp" not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} have no 'tp' axis; Megatron TP+SP splits over it")
    unusable = [f"{a}={mesh.shape[a]}" for a in mesh.axis_names if a not in DATA_AXES + ("tp",) and mesh.shape[a] > 1]
    if unusable:
        raise ValueError(
            f"mesh axes {', '.join(unusable)} cannot be used by Megatron TP+SP (it splits the batch "
            f"over dp/fsdp and everything else over tp); make them 1"
        )
    data_axes = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    data = math.prod(mesh_axis_size(mesh, a) for a in data_axes)
    if batch % data:
        raise ValueError(f"batch {batch} is not divisible by the data-parallel degree dp*fsdp = {data}")
    return (data_axes or None), mesh.shape["tp"]


def _check_divisible(what: str, value: int, tp: int, extra: str = ""):
    if value % tp:
        raise ValueError(f"{what} {value} is not divisible by tp = {tp}{extra}")


def _check_x(x: jax.Array, tp: int):
    if x.ndim != 3:
        raise ValueError(f"x has shape {x.shape}; expected [batch, seq, hidden]")
    _check_divisible("seq", x.shape[1], tp, " (sequence parallelism splits the sequence over tp)")


def _run(mesh: Mesh, local: Callable, in_specs: Any, out_specs: Any, *args: Any, **options: Any):
    return run_local(local, mesh, in_specs, out_specs, *args, **options)


def mlp_block(x: jax.Array, params: dict[str, jax.Array], *, mesh: Mesh, activation: str = "gelu") -> jax.Array:
    """TP+SP MLP on global arrays.

    Args:
      x: [batch, seq, hidden]; params {"w_in": [hidden, ffn], "w_out": [ffn, hidden]} plus "w_gate":
        [hidden, ffn] for swiglu: y = (silu(x @ w_gate) * (x @ w_in)) @ w_out; gelu: y = gelu(x @ w_in) @ w_out
        (tanh approximation). No biases.
      mesh: batch over dp/fsdp; inside, the sequence over tp (SP regions), ffn over tp (TP region).
    Returns: y [batch, seq, hidden].
    """
    _check_activation(activation)
    _check_x(x, 1)
    data, tp = _mesh_axes(mesh, x.shape[0])
    _check_x(x, tp)
    names = ("w_in", "w_gate", "w_out") if activation == "swiglu" else ("w_in", "w_out")
    missing = set(names) - set(params)
    if missing or set(params) - set(names):
        raise ValueError(f"{activation} mlp params must be exactly {names}; got {tuple(sorted(params))}")
    h, ffn = params["w_in"].shape
    if h != x.shape[2] or params["w_out"].shape != (ffn, h) or params.get("w_gate", params["w_in"]).shape != (h, ffn):
        raise ValueError(
            f"mlp params { ({k: v.shape for k, v in params.items()}) } must be w_in/w_gate "
            f"[hidden={x.shape[2]}, ffn], w_out [ffn, hidden]"
        )
    _check_divisible("ffn", ffn, tp, " (column/row-linears split it over tp)")
    x_spec, col, row = P(data, "tp", None), P(None, "tp"), P("tp", None)
    ws = tuple(params[n] for n in names)
    return _run(
        mesh,
        _mlp_local,
        (x_spec,) + tuple(row if n == "w_out" else col for n in names),
        x_spec,
        x,
        *ws,
        activation=activation,
    )


def _mlp_local(x: jax.Array, w_in: jax.Array, *rest: jax.Array, activation: str):
    w_gate, w_out = rest if activation == "swiglu" else (None, rest[0])
    return mlp(x, w_in, w_out, w_gate, activation=activation)


def _check_heads(num_heads: int, num_kv_heads: int, tp: int):
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    _check_divisible("num_heads", num_heads, tp, " (heads are split over tp)")
    if num_kv_heads >= tp:
        _check_divisible(
            "num_kv_heads", num_kv_heads, tp, " (kv heads >= tp are split over tp; fewer than tp must divide tp)"
        )
    elif tp % num_kv_heads:
        raise ValueError(
            f"num_kv_heads {num_kv_heads} < tp = {tp} must divide tp (each kv head is replicated on "
            f"tp / num_kv_heads ranks)"
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
    """TP+SP self-attention on global arrays.

    Args:
      x: [batch, seq, hidden]; params {"wq": [hidden, num_heads*head_dim], "wk", "wv": [hidden,
        num_kv_heads*head_dim], "wo": [num_heads*head_dim, hidden]}; head j owns columns j*d:(j+1)*d.
      positions: int32 [batch, seq]: RoPE (q and k, when rope_theta is not None) and the causal mask.
      window: sliding window W (needs causal): the query at position i sees keys i - W < j <= i.
      num_heads % tp == 0. K/V heads: split over tp when num_kv_heads % tp == 0; when num_kv_heads < tp
        divides tp, each K/V head is REPLICATED on the tp / num_kv_heads ranks whose query heads read it (its
        gradient is the sum of the replicas'); anything else raises.
    Returns: y [batch, seq, hidden].
    """
    _check_x(x, 1)
    data, tp = _mesh_axes(mesh, x.shape[0])
    _check_x(x, tp)
    if set(params) != {"wq", "wk", "wv", "wo"}:
        raise ValueError(f"attention params must be wq, wk, wv, wo; got {tuple(sorted(params))}")
    _check_heads(num_heads, num_kv_heads, tp)
    window = check_window(window, bool(causal))
    b, s, h = x.shape
    wq, wk, wv, wo = (params[n] for n in ("wq", "wk", "wv", "wo"))
    if wq.shape[0] != h or wq.shape[1] % num_heads:
        raise ValueError(f"wq {wq.shape} must be [hidden={h}, num_heads={num_heads} * head_dim]")
    d = wq.shape[1] // num_heads
    if wk.shape != (h, num_kv_heads * d) or wv.shape != wk.shape or wo.shape != (num_heads * d, h):
        raise ValueError(
            f"wk {wk.shape}, wv {wv.shape} must be [{h}, num_kv_heads={num_kv_heads} * {d}] and "
            f"wo {wo.shape} [{num_heads * d}, {h}]"
        )
    if positions.shape != (b, s):
        raise ValueError(f"positions shape {positions.shape} must be [batch, seq] = {(b, s)}")
    if num_kv_heads < tp:  # replicate: rank r reads kv head r // (tp / num_kv_heads)
        rep = lambda w: jnp.repeat(w.reshape(h, num_kv_heads, d), tp // num_kv_heads, axis=1).reshape(h, tp * d)
        wk, wv = rep(wk), rep(wv)
    x_spec, col, row = P(data, "tp", None), P(None, "tp"), P("tp", None)
    return _run(
        mesh,
        _attention_local,
        (x_spec, col, col, col, row, P(data, "tp")),
        x_spec,
        x,
        wq,
        wk,
        wv,
        wo,
        jnp.asarray(positions, jnp.int32),
        head_dim=d,
        causal=bool(causal),
        rope_theta=None if rope_theta is None else float(rope_theta),
        window=window,
    )


def _attention_local(
    x: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array, wo: jax.Array, positions: jax.Array, **kw: Any
):
    return attention(x, wq, wk, wv, wo, positions, **kw)


def embed(tokens: jax.Array, table: jax.Array, *, mesh: Mesh) -> jax.Array:
    """Vocab-parallel embedding lookup: tokens int [batch, seq], table [vocab, hidden] (vocab over tp).

    Returns [batch, seq, hidden], sequence-sharded over tp (the SP region that follows)."""
    if tokens.ndim != 2 or table.ndim != 2:
        raise ValueError(f"tokens {tokens.shape} must be [batch, seq] and table {table.shape} [vocab, hidden]")
    data, tp = _mesh_axes(mesh, tokens.shape[0])
    _check_divisible("seq", tokens.shape[1], tp, " (the embedding output is sequence-sharded over tp)")
    _check_divisible("vocab", table.shape[0], tp, " (the table is split by vocab rows over tp)")
    return _run(mesh, _embed_local, (P(data, None), P("tp", None)), P(data, "tp", None), tokens, table)


def _embed_local(tokens: jax.Array, table: jax.Array):
    return vocab_parallel_embed(tokens, table)


def cross_entropy(x: jax.Array, w_head: jax.Array, targets: jax.Array, *, mesh: Mesh) -> jax.Array:
    """Per-token loss of a vocab-parallel LM head: x [batch, seq, hidden], w_head [hidden, vocab] (vocab over
    tp), targets int [batch, seq]. Logits [b, s, vocab/tp] stay sharded (never gathered).

    Returns loss fp32 [batch, seq] = logsumexp(x @ w_head) - (x @ w_head)[target]."""
    _check_x(x, 1)
    data, tp = _mesh_axes(mesh, x.shape[0])
    _check_x(x, tp)
    if w_head.ndim != 2 or w_head.shape[0] != x.shape[2]:
        raise ValueError(f"w_head {w_head.shape} must be [hidden={x.shape[2]}, vocab]")
    if targets.shape != x.shape[:2]:
        raise ValueError(f"targets shape {targets.shape} must be [batch, seq] = {x.shape[:2]}")
    _check_divisible("vocab", w_head.shape[1], tp, " (the head is split by vocab columns over tp)")
    return _run(
        mesh,
        _cross_entropy_local,
        (P(data, "tp", None), P(None, "tp"), P(data, None)),
        P(data, None),
        x,
        w_head,
        targets,
    )


def _cross_entropy_local(x: jax.Array, w_head: jax.Array, targets: jax.Array):
    return vocab_parallel_cross_entropy(column_parallel_linear(x, w_head), targets)


_SPECS = {
    "w_in": P(None, "tp"),
    "w_gate": P(None, "tp"),
    "w_out": P("tp", None),
    "wq": P(None, "tp"),
    "wk": P(None, "tp"),
    "wv": P(None, "tp"),
    "wo": P("tp", None),
    "table": P("tp", None),
    "embedding": P("tp", None),
    "w_head": P(None, "tp"),
    "gamma": P(),
    "beta": P(),
    "scale": P(),
}


def param_specs(mesh: Mesh, params_shapes: dict[str, Any], *, num_kv_heads: int | None = None) -> dict:
    """NamedSharding per parameter name: column-linears (w_in, w_gate, wq, wk, wv, w_head) split their
    columns over tp, row-linears (w_out, wo) their rows, the embedding table (table/embedding) its vocab
    rows; norm parameters (gamma, beta, scale) are replicated.

    wk/wv are replicated when num_kv_heads < tp (the block replicates each K/V head itself) or, without
    num_kv_heads, when their columns do not divide by tp.
    """
    tp = mesh_axis_size(mesh, "tp")
    unknown = set(params_shapes) - set(_SPECS)
    if unknown:
        raise ValueError(f"unknown Megatron parameter names {sorted(unknown)}; known: {sorted(_SPECS)}")
    specs = {}
    for name, shape in params_shapes.items():
        shape = tuple(getattr(shape, "shape", shape))
        spec = _SPECS[name]
        if name in ("wk", "wv") and ((num_kv_heads is not None and num_kv_heads < tp) or shape[1] % tp):
            spec = P()
        for dim, axis in enumerate(spec):
            if axis == "tp" and shape[dim] % tp:
                raise ValueError(f"{name} dim {dim} of shape {shape} is not divisible by tp = {tp}")
        specs[name] = NamedSharding(mesh, spec)
    return specs


# ----------------------------------------------------------------------------------------------------------
# The method, for the train step's shard_map (tensor × sequence parallelism)
# ----------------------------------------------------------------------------------------------------------


class Megatron(TensorMethod):
    """Megatron TP+SP over `tp`, composable with any sequence strategy over `sp` (Megatron CP+TP).

    The residual stream is [b, s/(sp·tp), h]: the sequence split over the sequence axes, then over tp in the
    norm regions. The attention's g (all-gather over tp) gives each device its sp shard [b, s/sp] for h/tp
    heads; the plan's sequence strategy attends over sp on those heads (Ulysses: heads/tp must divide sp);
    g* reduce-scatters back. Tokens, targets and positions are [b, s/sp] (replicated over tp).
    """

    name = "megatron"
    axes = ("tp",)
    summary = "Megatron TP+SP: column/row linears, heads over tp, sequence over tp in the norm regions"

    def check_model(
        self, plan: ParallelPlan, *, num_heads: int, num_kv_heads: int, hidden: int, ffn: int, vocab: int | None
    ) -> None:
        tp = plan.tp
        _check_heads(num_heads, num_kv_heads, tp)
        _check_divisible("ffn", ffn, tp, " (column/row-linears split it over tp)")
        if vocab is not None:
            _check_divisible("vocab", vocab, tp, " (the embedding and head split the vocabulary over tp)")

    def check_seq(self, plan: ParallelPlan, seq_len: int) -> None:
        local = seq_len // plan.sp
        if local % plan.tp:
            where = f"the sp = {plan.sp} shard of {local} tokens" if plan.sp > 1 else f"seq {seq_len}"
            raise ValueError(
                f"{where} is not divisible by tp = {plan.tp} (Megatron's sequence-parallel regions split it over tp)"
            )

    def head_split(self, plan: ParallelPlan) -> int:
        return plan.tp

    def local_rows(self, plan: ParallelPlan, seq_len: int) -> int:
        return seq_len // (plan.sp * plan.tp)

    def tile_targets(self, plan: ParallelPlan, targets: jax.Array, tiles: int) -> jax.Array:
        # tile j of the rows, gathered over tp, is every rank's tile j in rank order: [b, tp, T, n/T] -> [b, T·tp·n/T]
        b, n = targets.shape
        return targets.reshape(b, plan.tp, tiles, n // (plan.tp * tiles)).transpose(0, 2, 1, 3).reshape(b, n)

    def untile_losses(self, plan: ParallelPlan, losses: jax.Array, tiles: int) -> jax.Array:
        b, n = losses.shape
        return losses.reshape(b, tiles, plan.tp, n // (plan.tp * tiles)).transpose(0, 2, 1, 3).reshape(b, n)

    def activation_spec(self, plan: ParallelPlan) -> P:
        return P(spec_entry(plan.batch_axes), spec_entry(plan.seq_axes + ("tp",)), None)

    def param_spec(self, plan: ParallelPlan, info: ParamInfo) -> tuple:
        spec = []
        for axis in info.logical_axes:
            if axis in ("heads", "mlp", "vocab"):
                spec.append("tp")
            elif axis == "kv_heads":  # fewer K/V heads than tp: replicated, each rank reads its own
                spec.append("tp" if info.heads is not None and info.heads % plan.tp == 0 else None)
            else:
                spec.append(None)
        return tuple(spec)

    def embed(
        self,
        plan: ParallelPlan,
        tokens: jax.Array,
        table: jax.Array,
        positions: jax.Array | None = None,
        pos_table: jax.Array | None = None,
    ) -> jax.Array:
        x = vocab_parallel_embed(tokens, table)  # [b, s_sp/tp, h]
        if pos_table is not None:
            x = x + jnp.take(pos_table, self.activation_positions(plan, positions), axis=0)
        return x

    def activation_positions(self, plan: ParallelPlan, positions: jax.Array) -> jax.Array:
        n = positions.shape[1] // plan.tp  # this rank's SP sub-shard
        return lax.dynamic_slice_in_dim(positions, lax.axis_index("tp") * n, n, axis=1)

    def norm(
        self, plan: ParallelPlan, x: jax.Array, scale: jax.Array, bias: jax.Array | None, *, eps: float = 1e-5
    ) -> jax.Array:
        return layer_norm(x, scale, bias, eps=eps)

    def rms_norm(self, plan: ParallelPlan, x: jax.Array, scale: jax.Array, *, eps: float = 1e-6) -> jax.Array:
        return rms_norm(x, scale, eps=eps)

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
        w = own_kv_head(w, num_kv_heads, plan.tp, head_dim)  # fewer K/V heads than tp: replicated

        def attend(
            q: jax.Array, k: jax.Array, v: jax.Array, rope_positions: jax.Array, segment_ids: jax.Array | None
        ) -> jax.Array:
            del rope_positions  # the mask follows the token order (the plan's layout), not RoPE positions
            return plan.attend(q, k, v, causal=causal, window=window, segment_ids=segment_ids)

        extras = {n: w[n] for n in ("bq", "bk", "bv", "bo", "q_norm", "k_norm") if n in w}
        return attention(
            x,
            w["wq"],
            w["wk"],
            w["wv"],
            w["wo"],
            positions,
            head_dim=head_dim,
            causal=causal,
            rope_theta=rope,
            attend=attend,
            extras=extras,
            norm_eps=norm_eps,
            segment_ids=segment_ids,
        )

    def mlp(self, plan: ParallelPlan, x: jax.Array, w: dict, *, activation: str) -> jax.Array:
        biases = {n: w[n] for n in ("b_in", "b_gate", "b_out") if n in w}
        return mlp(x, w["w_in"], w["w_out"], w.get("w_gate"), activation=activation, **biases)

    def moe(
        self, plan: ParallelPlan, x: jax.Array, moe: Callable[..., tuple[jax.Array, dict]]
    ) -> tuple[jax.Array, dict]:
        """Experts' FFN split over tp (column/row, Megatron-style): the sequence shard is all-gathered over tp
        (typed replicated: moe_ffn needs the tokens the same on every tp rank), moe_ffn all-reduces its output
        over tp, and this rank keeps its shard. That is an all-reduce where a dense Megatron MLP has a
        reduce-scatter: (tp-1)/tp·bsh more bytes forward, the same again backward."""
        full = gather_invariant(x, "tp", 1)  # [b, s_sp, h], replicated
        y, stats = moe(
            full, ep_axis="ep" if plan.ep > 1 else None, tp_axis="tp", token_axes=plan.batch_axes + plan.seq_axes
        )
        n = x.shape[1]
        return lax.dynamic_slice_in_dim(y, lax.axis_index("tp") * n, n, axis=1), stats

    def cross_entropy(
        self, plan: ParallelPlan, x: jax.Array, w: jax.Array, targets: jax.Array, *, tied: bool
    ) -> jax.Array:
        head = w.T if tied else w  # local [h, vocab/tp]
        return vocab_parallel_cross_entropy(column_parallel_linear(x, head.astype(x.dtype)), targets)

    # --- cost model (the module docstring's bytes; METP Table 1: 5(p-1)/p·bsh per block)
    def local_dims(self, m: ModelShape) -> LocalDims:
        p = m.tp
        kv = m.kv_heads // p if m.kv_heads % p == 0 else 1  # fewer K/V heads than tp: each rank reads one
        vocab = None if m.vocab is None else m.vocab // p
        return LocalDims(m.b, m.n, m.n // p, m.hidden, m.heads // p, kv, m.ffn // p, vocab)

    def layer_transfers(self, m: ModelShape, x: LocalDims) -> list[Transfer]:
        """g and g* of the attention and MLP blocks: 2 transitions forward, 3 backward (X gathered again), of
        (p-1)/p·b·n·h each; an MoE block all-gathers in and all-reduces out (7)."""
        p = m.tp
        U = (p - 1) / p * x.b * x.n * m.hidden * m.e
        mlp = (
            "Megatron MoE block: all-gather in, all-reduce out (7 transitions)"
            if m.moe
            else "Megatron MLP block g, g* (5 transitions)"
        )
        return [
            *modulation_gradients(m.modulation, m, x, "DiT modulation gradients (shift, scale, gate × 2)"),
            Transfer("Megatron attention block g, g* (5 transitions)", ("tp",), 5 * U, 5),
            Transfer(mlp, ("tp",), (7 if m.moe else 5) * U, 5),
        ]

    def head_transfers(self, m: ModelShape, x: LocalDims) -> list[Transfer]:
        """The vocab-parallel embedding and head (5 transitions) and cross-entropy (max, Σexp, label: fp32 per
        token); the final layer's modulation gradients."""
        out = modulation_gradients(m.final_modulation, m, x, "DiT final layer's modulation gradients (shift, scale)")
        if m.vocab is None:
            return out
        p = m.tp
        U = (p - 1) / p * x.b * x.n * m.hidden * m.e
        rows = x.b * x.n * F32  # fp32 per token of the sp shard
        return out + [
            Transfer("Megatron vocab-parallel embedding and head (5 transitions)", ("tp",), 5 * U, 5),
            Transfer(
                "Megatron vocab-parallel cross-entropy (max, Σexp, label)", ("tp",), 3 * 2 * (p - 1) / p * rows, 3
            ),
        ]

    def layer_working(self, m: ModelShape, x: LocalDims) -> float:
        """The tp-gathered input of a block, its gradient, and the next gather in flight (XLA overlaps it): 3
        full-sequence [b, n, hidden] arrays in the activation dtype. The deviceless H100 compiles of Llama-3-8B
        at 0.98M-1.6M tokens hold 3 or 4 (benchmarks/results/longest_sequence.json, megatron tp8 rows)."""
        return 3 * x.b * x.n * m.hidden * m.em


METHOD = Megatron()
