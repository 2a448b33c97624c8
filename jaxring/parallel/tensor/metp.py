"""METP as a tensor method [METP] (REFERENCES.md): its layouts, checks and cost model (Tables 1-2), with the
layer functions of `metp_ring.py` (the FFN) and `metp_mha.py` (attention) (their docstrings have the algorithms and their bytes).

The sequence is split over tp (activations [b, s/p, h] never move); the FFN's weight blocks go round a ring and
the attention broadcasts each head group's weights and rings K/V. The embedding and LM head stay replicated, as
in the paper, or with `--vocab-split ring` are split over tp by vocab rows and go round a ring too
(`vocab_ring.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import spec_entry
from jaxring.parallel.cost_terms import F32, AttentionCost, LocalDims, ModelShape, Transfer, tree_rounds
from jaxring.parallel.tensor.contract import (
    AttentionLayer,
    ParamInfo,
    TensorMethod,
    attention_extras,
    modulation_gradients,
)
from jaxring.parallel.tensor.metp_mha import metp_attention
from jaxring.parallel.tensor.metp_ring import metp_mlp
from jaxring.parallel.tensor.splits import check_divisible, check_kv_heads, own_kv_head
from jaxring.parallel.tensor.vocab_split import VocabSplit, vocab_ring_transfers

if TYPE_CHECKING:
    from jaxring.parallel.plan import ParallelPlan


def _token_id_transfers(m: ModelShape, x: LocalDims) -> list[Transfer]:
    """The int32 [b, s/p] token arrays that ride the inner K/V ring with their block (`metp_mha`'s
    inner ring, forward and backward): the tokens' order in the row when causal, their segment ids with packed documents;
    p-1 hops per head group forward and again backward. Every group and layer sends the same arrays forward:
    XLA:CPU hoists those p-1 hops out of both loops (once per micro-step) and keeps the backward's p(p-1) in
    each layer, and at p = 2 the backward's hop is the forward's (one ring of two: the same permutation),
    sent once (measured on the compiled CPU step: tests/unit/planner/test_planner.py). The GPU ring (`fuse_sends`)
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


class METP(VocabSplit, TensorMethod):
    """METP over `tp`: the sequence split over tp (activations [b, s/p, h] never move), weights circulate.
    The embedding and LM head stay replicated (the paper distributes only the blocks)."""

    name = "metp"
    tiles_projections = False  # its projections gather or scatter over tp
    runs_moe = False
    decodes = False
    axes = ("tp",)
    summary = "METP: activations stay, weights circulate on rings (FFN) and head groups are broadcast (MHA)"
    sequence_parallel = False
    sequence_parallel_rule = (
        "METP already splits the sequence over tp (its K/V ring runs over tp); "
        "use megatron for tensor × sequence parallelism"
    )

    def vocab_axes(self, plan: ParallelPlan) -> tuple[str, ...]:
        return ("tp",)

    def check_model(
        self, plan: ParallelPlan, *, num_heads: int, num_kv_heads: int, hidden: int, ffn: int, vocab: int | None
    ) -> None:
        tp = plan.tp
        check_kv_heads(num_heads, num_kv_heads, tp, "METP, one head group per rank,")
        check_divisible("ffn", ffn, tp, "tp", " (each rank holds ffn/tp columns of W_in)")
        self.check_vocab(plan, vocab, tp, "tp")

    def check_seq(self, plan: ParallelPlan, seq_len: int) -> None:
        check_divisible("seq", seq_len, plan.tp, "tp", " (METP splits the sequence over tp)")

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
            if name == "vocab":
                return self.vocab_axis(plan)
            return "tp" if name in ("heads", "mlp") else None

        return tuple(axis(a) for a in info.logical_axes)

    def attention(
        self,
        plan: ParallelPlan,
        x: jax.Array,
        w: dict,
        positions: jax.Array,
        layer: AttentionLayer,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        num_kv_heads = layer.num_kv_heads
        if num_kv_heads < plan.tp:  # each rank's group reads one replicated K/V head
            w, num_kv_heads = own_kv_head(w, num_kv_heads, plan.tp, layer.head_dim), plan.tp
        b, n = positions.shape  # the tokens are contiguous over tp (no layout at sp = 1): rank r holds r·n ..
        order = jnp.broadcast_to(lax.axis_index("tp") * n + jnp.arange(n, dtype=jnp.int32), (b, n))
        return metp_attention(
            x,
            w["wq"],
            w["wk"],
            w["wv"],
            w["wo"],
            positions,
            num_heads=layer.num_heads,
            num_kv_heads=num_kv_heads,
            axis_name="tp",
            causal=layer.causal,
            rope_theta=layer.rope,
            block_ops=plan.block_ops,
            extras=attention_extras(w),
            norm_eps=layer.norm_eps,
            window=layer.window,
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
        vocab = m.vocab // m.tp if m.vocab is not None and m.vocab_ring else m.vocab  # one block's logits
        return LocalDims(m.b, n, n, m.hidden, m.heads, m.kv_heads, m.ffn // m.tp, vocab, token_split=m.tp)

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
        """The embedding and head replicated (nothing moves) or on their vocab rings; the final layer's
        modulation gradients are summed."""
        ring = vocab_ring_transfers(m, m.tp, ("tp",)) if m.vocab is not None and m.vocab_ring and m.tp > 1 else []
        return ring + modulation_gradients(
            m.final_modulation, m, x, "DiT final layer's modulation gradients (shift, scale)"
        )

    def attention_core_cost(self, m: ModelShape, x: LocalDims) -> AttentionCost:
        """METP's own attention (no sequence strategy): it keeps A_i (activation dtype) and its lse (fp32) of
        every head group (Table 2: 2bsh/p) and works on one head group at a time (its K/V ring is in
        `layer_transfers`); its backward keeps every group's ΔQ, ΔK, ΔV (activation dtype) for ΔX_i after the
        loop (`metp_mha`, summed chunk by chunk) beside one group's Q, K, V and fp32 ΔQ, ΔK, ΔV."""
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
