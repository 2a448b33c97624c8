"""Megatron TP+SP as a tensor method [Playbook] (REFERENCES.md): its layouts, checks and cost model, with the
layer functions of `megatron_layers.py` (the module docstring there has the math and the bytes).

The residual stream is [b, s/(sp·tp), h]: the sequence split over the sequence axes, then over tp in the
norm regions; heads, FFN columns and the vocabulary split over tp. A block moves 5 (p-1)/p · bsh per device
(METP Table 1, row "Megatron TP+SP"), which `layer_transfers` prices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import spec_entry
from jaxring.core.vma import gather_invariant
from jaxring.parallel.cost_terms import F32, LocalDims, ModelShape, Transfer
from jaxring.parallel.tensor.contract import (
    AttentionLayer,
    ParamInfo,
    TensorMethod,
    attention_extras,
    modulation_gradients,
)
from jaxring.parallel.tensor.megatron_layers import (
    attention,
    column_parallel_linear,
    mlp,
    vocab_parallel_cross_entropy,
    vocab_parallel_embed,
)
from jaxring.parallel.tensor.splits import check_divisible, check_kv_heads, own_kv_head

if TYPE_CHECKING:
    from jaxring.parallel.plan import ParallelPlan


def check_heads(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Raises unless the heads split over tp as Megatron needs: query heads a positive multiple of the K/V heads,
    both split over tp, or fewer K/V heads than tp (dividing it) each replicated."""
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    check_kv_heads(num_heads, num_kv_heads, tp, "Megatron")


class Megatron(TensorMethod):
    """Megatron TP+SP over `tp`, composable with any sequence strategy over `sp` (Megatron CP+TP).

    The residual stream is [b, s/(sp·tp), h]: the sequence split over the sequence axes, then over tp in the
    norm regions. The attention's g (all-gather over tp) gives each device its sp shard [b, s/sp] for h/tp
    heads; the plan's sequence strategy attends over sp on those heads (Ulysses: heads/tp must divide sp);
    g* reduce-scatters back. Tokens, targets and positions are [b, s/sp] (replicated over tp).
    """

    name = "megatron"
    tiles_projections = False  # its projections gather or scatter over tp
    axes = ("tp",)
    summary = "Megatron TP+SP: column/row linears, heads over tp, sequence over tp in the norm regions"

    def check_model(
        self, plan: ParallelPlan, *, num_heads: int, num_kv_heads: int, hidden: int, ffn: int, vocab: int | None
    ) -> None:
        tp = plan.tp
        check_heads(num_heads, num_kv_heads, tp)
        check_divisible("ffn", ffn, tp, "tp", " (column/row-linears split it over tp)")
        if vocab is not None:
            check_divisible("vocab", vocab, tp, "tp", " (the embedding and head split the vocabulary over tp)")

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

    def attention(
        self,
        plan: ParallelPlan,
        x: jax.Array,
        w: dict,
        positions: jax.Array,
        layer: AttentionLayer,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        w = own_kv_head(w, layer.num_kv_heads, plan.tp, layer.head_dim)  # fewer K/V heads than tp: replicated

        def attend(
            q: jax.Array, k: jax.Array, v: jax.Array, rope_positions: jax.Array, segment_ids: jax.Array | None
        ) -> jax.Array:
            del rope_positions  # the mask follows the token order (the plan's layout), not RoPE positions
            return plan.attend(q, k, v, causal=layer.causal, window=layer.window, segment_ids=segment_ids)

        return attention(
            x,
            w["wq"],
            w["wk"],
            w["wv"],
            w["wo"],
            positions,
            head_dim=layer.head_dim,
            causal=layer.causal,
            rope_theta=layer.rope,
            attend=attend,
            extras=attention_extras(w),
            norm_eps=layer.norm_eps,
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
