"""Optimus 2D as a tensor method [Optimus] (REFERENCES.md): the q×q grid over tp = q², its layouts, checks
and cost model, with the layer functions of `optimus_layers.py` (the module docstring there has the SUMMA
algorithms and their bytes).

Activations [b/q, s, h/q] (batch over the data axes and the grid rows, hidden over the grid columns), weights
in q×q blocks; every product is a SUMMA, which `layer_transfers` prices block by block.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import DATA_AXES, factored_mesh, spec_entry
from jaxring.parallel.cost_terms import F32, LocalDims, ModelShape, Transfer, tree_rounds
from jaxring.parallel.tensor.contract import AttentionLayer, ParamInfo, TensorMethod
from jaxring.parallel.tensor.optimus_layers import (
    COL,
    GRID,
    ROW,
    attention_2d,
    cross_entropy_2d,
    embed_2d,
    layer_norm_2d,
    mlp_2d,
    rms_norm_2d,
)
from jaxring.parallel.tensor.splits import check_divisible, unusable_mesh_axes

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxring.parallel.plan import ParallelPlan


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
    unusable = unusable_mesh_axes(grid, GRID)
    if unusable:
        raise ValueError(
            f"mesh axes {', '.join(unusable)} > 1 cannot be used by Optimus (it splits the batch "
            f"over dp/fsdp and the q×q grid over tp)"
        )
    data = tuple(a for a in DATA_AXES if a in grid.axis_names)
    return grid, q, data


class Optimus(TensorMethod):
    """Optimus 2D over tp = q²: the run mesh factors tp into the (tpr, tpc) grid; activations [b/q, s, h/q]
    (batch over the data axes and the grid rows, hidden over the columns); weights in q×q blocks."""

    name = "optimus"
    tiles_projections = False  # its projections gather or scatter over tp
    runs_moe = False
    decodes = False
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
            check_divisible(what, value, q, "q")

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
        layer: AttentionLayer,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        return attention_2d(
            x,
            w,
            positions,
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            causal=layer.causal,
            rope_theta=layer.rope,
            window=layer.window,
            norm_eps=layer.norm_eps,
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
