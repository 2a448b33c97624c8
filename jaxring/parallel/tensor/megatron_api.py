"""Megatron TP+SP on global arrays: each entry point checks its arguments, places them (batch over dp and
fsdp, sequence (SP regions) and hidden/heads/vocab (TP regions) over tp) and runs the layer functions of
`megatron_layers.py` in its own shard_map (`jaxring.core.sharded.run_local`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import DATA_AXES, mesh_axis_size
from jaxring.core.sharded import run_local
from jaxring.kernels.layer_math import check_activation
from jaxring.kernels.masking import check_window
from jaxring.parallel.tensor.megatron import check_heads
from jaxring.parallel.tensor.megatron_layers import (
    attention,
    column_parallel_linear,
    mlp,
    vocab_parallel_cross_entropy,
    vocab_parallel_embed,
)
from jaxring.parallel.tensor.splits import check_data_split, check_divisible, unusable_mesh_axes

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = ["attention_block", "cross_entropy", "embed", "mlp_block", "param_specs"]


def _mesh_axes(mesh: Mesh, batch: int) -> tuple[tuple[str, ...] | None, int]:
    """(data axes spec entry, tp) after checking the mesh: a tp axis; only dp, fsdp, tp larger than 1."""
    if "tp" not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} have no 'tp' axis; Megatron TP+SP splits over it")
    unusable = unusable_mesh_axes(mesh, ("tp",))
    if unusable:
        raise ValueError(
            f"mesh axes {', '.join(unusable)} cannot be used by Megatron TP+SP (it splits the batch "
            f"over dp/fsdp and everything else over tp); make them 1"
        )
    data_axes = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    check_data_split(batch, mesh, data_axes)
    return (data_axes or None), mesh_axis_size(mesh, "tp")


def _check_x(x: jax.Array, tp: int) -> None:
    if x.ndim != 3:
        raise ValueError(f"x has shape {x.shape}; expected [batch, seq, hidden]")
    check_divisible("seq", x.shape[1], tp, "tp", " (sequence parallelism splits the sequence over tp)")


def mlp_block(x: jax.Array, params: dict[str, jax.Array], *, mesh: Mesh, activation: str = "gelu") -> jax.Array:
    """TP+SP MLP on global arrays.

    Args:
      x: [batch, seq, hidden]; params {"w_in": [hidden, ffn], "w_out": [ffn, hidden]} plus "w_gate":
        [hidden, ffn] for swiglu: y = (silu(x @ w_gate) * (x @ w_in)) @ w_out; gelu: y = gelu(x @ w_in) @ w_out
        (tanh approximation). No biases.
      mesh: batch over dp/fsdp; inside, the sequence over tp (SP regions), ffn over tp (TP region).
    Returns: y [batch, seq, hidden].
    """
    check_activation(activation)
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
    check_divisible("ffn", ffn, tp, "tp", " (column/row-linears split it over tp)")
    x_spec, col, row = P(data, "tp", None), P(None, "tp"), P("tp", None)
    ws = tuple(params[n] for n in names)
    return run_local(
        _mlp_local,
        mesh,
        (x_spec,) + tuple(row if n == "w_out" else col for n in names),
        x_spec,
        x,
        *ws,
        activation=activation,
    )


def _mlp_local(x: jax.Array, w_in: jax.Array, *rest: jax.Array, activation: str):
    w_gate, w_out = rest if activation == "swiglu" else (None, rest[0])
    return mlp(x, w_in, w_out, w_gate, activation=activation)


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
    check_heads(num_heads, num_kv_heads, tp)
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
    return run_local(
        attention,
        mesh,
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


def embed(tokens: jax.Array, table: jax.Array, *, mesh: Mesh) -> jax.Array:
    """Vocab-parallel embedding lookup: tokens int [batch, seq], table [vocab, hidden] (vocab over tp).

    Returns [batch, seq, hidden], sequence-sharded over tp (the SP region that follows)."""
    if tokens.ndim != 2 or table.ndim != 2:
        raise ValueError(f"tokens {tokens.shape} must be [batch, seq] and table {table.shape} [vocab, hidden]")
    data, tp = _mesh_axes(mesh, tokens.shape[0])
    check_divisible("seq", tokens.shape[1], tp, "tp", " (the embedding output is sequence-sharded over tp)")
    check_divisible("vocab", table.shape[0], tp, "tp", " (the table is split by vocab rows over tp)")
    return run_local(vocab_parallel_embed, mesh, (P(data, None), P("tp", None)), P(data, "tp", None), tokens, table)


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
    check_divisible("vocab", w_head.shape[1], tp, "tp", " (the head is split by vocab columns over tp)")
    return run_local(
        _cross_entropy_local,
        mesh,
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
