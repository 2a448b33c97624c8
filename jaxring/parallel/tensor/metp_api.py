"""METP on global arrays: each entry point checks its arguments, places them (batch over dp/fsdp, the sequence
over tp, weights by columns or rows over tp: head group j on rank j) and runs the layer functions of
`metp_ring.py` and `metp_mha.py` in its own shard_map (`jaxring.core.sharded.run_local`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import DATA_AXES, mesh_axis_size
from jaxring.core.sharded import run_local
from jaxring.kernels.block_compute import get_block_ops
from jaxring.kernels.blockwise import BlockOps
from jaxring.kernels.layer_math import check_activation
from jaxring.kernels.masking import check_window
from jaxring.parallel.tensor.metp_mha import metp_attention
from jaxring.parallel.tensor.metp_ring import metp_mlp
from jaxring.parallel.tensor.splits import check_data_split, check_divisible, unusable_mesh_axes

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = ["attention_block", "mlp_block", "param_specs"]

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
    unused = unusable_mesh_axes(mesh, ("tp",))
    if unused:
        raise ValueError(
            f"METP uses only the tp axis (and dp/fsdp for the batch); mesh axes {', '.join(unused)} must be 1"
        )
    return tuple(a for a in DATA_AXES if mesh_axis_size(mesh, a) > 1), mesh.shape["tp"]


def _check_x(x: jax.Array, data_axes: tuple[str, ...], mesh: Mesh, tp: int):
    if x.ndim != 3:
        raise ValueError(f"x has shape {x.shape}; expected [batch, seq, hidden]")
    check_data_split(x.shape[0], mesh, data_axes)
    check_divisible("seq", x.shape[1], tp, "tp", " (METP splits the sequence over tp)")


def mlp_block(x: jax.Array, params: dict[str, jax.Array], *, mesh: Mesh, activation: str = "gelu") -> jax.Array:
    """The FFN y = f(x W_in) W_out with METP over the mesh's tp axis (batch over dp/fsdp, sequence over tp).

    x: global [batch, seq, hidden]; params {"w_in": [hidden, ffn], "w_out": [ffn, hidden]} plus "w_gate":
    [hidden, ffn] for swiglu (y = (silu(x@w_gate) * (x@w_in)) @ w_out); gelu: y = gelu(x @ w_in) @ w_out
    (approximate=True). No biases. Returns y [batch, seq, hidden] in x.dtype.
    """
    check_activation(activation)
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
    check_divisible("ffn", ffn, tp, "tp", " (each rank holds ffn/tp columns of W_in)")
    x_spec = P(data_axes or None, "tp", None)
    specs = (x_spec,) + tuple(_PARAM_SPECS[n] for n in names)
    return run_local(metp_mlp, mesh, specs, x_spec, x, *(params[n] for n in names), activation=activation)


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
    # The Pallas interpreter (jax 0.11.2, 0.12.1) cannot type-check varying mesh axes (see flash.py).
    check_vma = get_block_ops(block_ops).name != "pallas_interpret"
    return run_local(
        metp_attention,
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
