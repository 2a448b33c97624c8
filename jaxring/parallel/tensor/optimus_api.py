"""Optimus 2D on global arrays: each entry point checks its arguments, lays the q×q grid over the mesh's
tp = q² (`optimus.grid_mesh`), places them (batch over the data axes and the grid rows, hidden over the grid
columns, weights in q×q blocks) and runs the layer functions of `optimus_layers.py` in its own shard_map
(`jaxring.core.sharded.run_local`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring.core.sharded import run_local
from jaxring.kernels.layer_math import check_activation
from jaxring.kernels.masking import check_window
from jaxring.parallel.tensor.optimus import grid_mesh
from jaxring.parallel.tensor.optimus_layers import (
    COL,
    GRID,
    ROW,
    attention_2d,
    cross_entropy_2d,
    embed_2d,
    layer_norm_2d,
    mlp_2d,
)
from jaxring.parallel.tensor.splits import check_divisible

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = ["attention_block", "cross_entropy", "embed", "layer_norm", "mlp_block", "param_specs"]


def _specs(data: tuple[str, ...]):
    rows = data + (ROW,)
    return P(rows, None, COL), P(rows, None)  # activations [b, s, h], tokens / positions [b, s]


def _check_batch(x: jax.Array, grid: Mesh, q: int, data: tuple[str, ...], name: str = "x"):
    if x.ndim != 3:
        raise ValueError(f"{name} must be [batch, seq, hidden], got shape {x.shape}")
    d = math.prod(grid.shape[a] for a in data)
    check_divisible("batch", x.shape[0], d * q, f"data degree × q = {d}×{q}")
    check_divisible("hidden", x.shape[2], q, "q")


def _check_weight(name: str, w: jax.Array, shape: tuple[int, ...], q: int):
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {tuple(shape)}")
    for dim in w.shape:
        check_divisible(f"{name} dimension", dim, q, "q")


def mlp_block(x: jax.Array, params: dict[str, jax.Array], *, mesh: Mesh, activation: str = "gelu") -> jax.Array:
    """x: global [batch, seq, hidden]; params {"w_in": [hidden, ffn], "w_out": [ffn, hidden]} plus
    "w_gate": [hidden, ffn] when activation == "swiglu" (y = (silu(x@w_gate) * (x@w_in)) @ w_out);
    gelu: y = gelu(x @ w_in) @ w_out (tanh approximation). No biases. Returns y [batch, seq, hidden].

    Two SUMMA products on the tp = q² grid; batch over (dp, fsdp, grid rows), hidden over the grid columns.
    """
    grid, q, data = grid_mesh(mesh)
    check_activation(activation)
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
    return run_local(mlp_2d, grid, (x_spec, {n: P(*GRID) for n in names}), x_spec, x, params, activation=activation)


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
    check_divisible("num_heads", num_heads, q, "q (each device holds num_heads/q heads)")
    check_divisible("num_kv_heads", num_kv_heads, q, "q (each device holds num_kv_heads/q K/V heads)")
    check_divisible("num_heads", num_heads, num_kv_heads, "num_kv_heads (GQA groups)")
    missing = {"wq", "wk", "wv", "wo"} - set(params)
    if missing:
        raise ValueError(f"attention params miss {sorted(missing)}")
    check_divisible("wq columns", params["wq"].shape[-1], num_heads, "num_heads")
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
    return run_local(
        attention_2d,
        grid,
        (x_spec, {n: P(*GRID) for n in params}, tok_spec),
        x_spec,
        x,
        params,
        positions,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        causal=bool(causal),
        rope_theta=theta,
        window=window,
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
    return run_local(layer_norm_2d, grid, (x_spec, P(COL), P(COL)), x_spec, x, scale, bias, eps=float(eps))


def _check_tokens(name: str, tokens: jax.Array, grid: Mesh, q: int, data: tuple[str, ...]):
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{name} must be int [batch, seq], got {tokens.dtype} {tuple(tokens.shape)}")
    d = math.prod(grid.shape[a] for a in data)
    check_divisible("batch", tokens.shape[0], d * q, f"data degree × q = {d}×{q}")


def embed(tokens: jax.Array, table: jax.Array, *, mesh: Mesh) -> jax.Array:
    """Embedding lookup on the 2D layout. tokens: int [batch, seq]; table: [vocab, hidden] in q×q blocks.
    Returns [batch, seq, hidden] in table.dtype (batch over rows, hidden over columns)."""
    grid, q, data = grid_mesh(mesh)
    _check_tokens("tokens", tokens, grid, q, data)
    if table.ndim != 2:
        raise ValueError(f"table must be [vocab, hidden], got shape {tuple(table.shape)}")
    check_divisible("vocab", table.shape[0], q, "q")
    check_divisible("hidden", table.shape[1], q, "q")
    x_spec, tok_spec = _specs(data)
    return run_local(embed_2d, grid, (tok_spec, P(*GRID)), x_spec, tokens, table)


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
    check_divisible("vocab", w_head.shape[0 if tied else 1], q, "q")
    x_spec, tok_spec = _specs(data)
    return run_local(
        cross_entropy_2d, grid, (x_spec, P(*GRID), tok_spec), tok_spec, x, w_head, targets, tied=bool(tied)
    )


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
            check_divisible(f"param {name} dimension", dim, q, "q")
        out[name] = NamedSharding(grid, P(*GRID) if len(shape) == 2 else P(COL))
    return out
