"""The typed contract every tensor-parallel method fulfils, and the block math they share.

A method is a `TensorMethod`: its layer functions run *inside* the train step's one `shard_map` (the caller
owns it) on local shards, and it says how the arrays between layers are laid out:

  activation_spec(plan)  the residual stream [batch, seq, hidden] (e.g. Megatron: seq over sp then tp)
  token_spec(plan)       tokens, targets and positions [batch, seq] (the sequence attention sees)
  param_spec(plan, p)    one parameter's mesh axes per dim, from its logical axes ("heads", "mlp", "vocab")
  embed, norm, attention, mlp, cross_entropy
                         the layers, on local shards, with the plan's sequence strategy as the attention core

and what it costs (the planner's cost model, in the vocabulary of `jaxring.parallel.cost_terms`):

  accepts(tp)            the degrees it runs on (the planner searches those), with `sequence_parallel`
  local_dims(shape)      its split of one micro-step: rows, tokens, heads, FFN and vocab columns per device
  layer_transfers, head_transfers, attention_core_cost, layer_working
                         bytes over its axes per layer and outside the layers, and its memory terms

This base class is the method "none" (tensors replicated over tp = 1): plain local layers, the sequence split
over the plan's sequence axes and attention by the plan's strategy. Megatron, Optimus and METP override what
they change. The per-device math they share (head split, QK-norm and RoPE, activations, norms) is
`jaxring.kernels.layer_math`; the size checks and the K/V heads over tp are `splits.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import spec_entry
from jaxring.kernels.layer_math import activate, add_bias, layer_norm, merge_heads, qk_norm_rope, rms_norm, split_heads
from jaxring.parallel.cost_terms import F32, AttentionCost, LocalDims, ModelShape, Transfer
from jaxring.parallel.registry import HasOptions
from jaxring.parallel.tensor.vocab_split import VocabSplit, vocab_ring_transfers

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxring.kernels.rope import Rope
    from jaxring.parallel.plan import ParallelPlan

# The name a weight matmul's output carries when it is computed inside a custom_vjp (Megatron's column linear
# with its all-gather), where the selective remat policy cannot see the dot: `nn.remat_policy` saves it.
MATMUL_OUTPUT = "jaxring_weight_matmul"
# The name of a residual a custom_vjp keeps that is not a matmul output (METP attention's A_i and lse): selective
# remat keeps it, rather than running the forward again in the backward.
KEPT_RESIDUAL = "jaxring_kept_residual"


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """What a method needs to place one parameter: its logical axes, per-layer shape and head count."""

    name: str
    logical_axes: tuple
    shape: tuple
    heads: int | None = None  # heads along the "heads"/"kv_heads" axis (attention projections)


# ----------------------------------------------------------------------------------------- the contract


@dataclasses.dataclass(frozen=True)
class AttentionLayer:
    """An attention layer's static settings, as every tensor method's `attention` takes them: the global head
    counts, the head dim, causal or not, RoPE (a `Rope`, a theta, or None), a sliding window W (None:
    unlimited) and the QK-norm's eps."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool = True
    rope: Rope | float | None = None
    window: int | None = None
    norm_eps: float = 1e-6


def attention_extras(w: dict) -> dict:
    """The optional weights of an attention layer present in `w`: biases and QK-norm scales."""
    return {n: w[n] for n in ("bq", "bk", "bv", "bo", "q_norm", "k_norm") if n in w}


class TensorMethod(HasOptions):
    """No tensor parallelism ("none"); the base of every method (see the module docstring)."""

    name = "none"
    kind = "tensor method"
    summary = "no tensor parallelism: weights replicated, the sequence split over sp"
    sequence_parallel = True  # may run together with a sequence strategy over sp > 1
    sequence_parallel_rule = ""  # why not, when it may not
    runs_moe = True  # runs mixture-of-experts FFNs (its experts' FFN split as its MLP)
    whole_hidden = True  # each token's hidden vector is whole on a device (no hidden-dim split of activations)
    decodes = True  # `jaxring.nn.inference` decodes with it (heads over tp as Megatron's, or nothing split)
    # its attention is `attention_qkv`, `plan.attend`, `attention_out` with no collective in the projections,
    # so a tiled layer (`jaxring.nn.tiled_layer`) can run them a tile of tokens at a time
    tiles_projections = True
    axes: tuple[str, ...] = ()  # the mesh axes the method splits tensors over (tp, or a view of it)

    # --- mesh view and checks
    def view(self, mesh: Mesh) -> Mesh:
        """The mesh with tp factored as the method needs (Optimus: a q×q grid); unchanged by default."""
        return mesh

    def tensor_axes(self, plan: ParallelPlan) -> tuple[str, ...]:
        """The mesh axes the method splits tensors over."""
        return self.axes

    def check_mesh(self, plan: ParallelPlan) -> None:
        """Raises on degrees the method cannot use (called by the plan)."""
        if plan.tp > 1 and not self.axes:
            raise ValueError(f"tp = {plan.tp} needs a tensor-parallel method (--tensor-parallel)")

    def check_model(
        self, plan: ParallelPlan, *, num_heads: int, num_kv_heads: int, hidden: int, ffn: int, vocab: int | None
    ) -> None:
        """Raises when the model's sizes do not split as the method needs (heads, hidden, ffn, vocab)."""

    def check_seq(self, plan: ParallelPlan, seq_len: int) -> None:
        """Raises when the sequence does not split as the method needs (beyond the sequence strategy's rule)."""

    def batch_split(self, plan: ParallelPlan) -> int:
        """How many ways the method splits the batch beyond the data axes (Optimus: q)."""
        return self.batch_split_at(plan.tp)

    def batch_split_at(self, tp: int) -> int:
        """`batch_split` for tp devices."""
        return 1

    def head_split(self, plan: ParallelPlan) -> int:
        """How many ways the method splits the attention heads (the local heads are num_heads / this)."""
        return 1

    # --- layouts
    def activation_spec(self, plan: ParallelPlan) -> P:
        return P(spec_entry(plan.batch_axes), spec_entry(plan.seq_axes), None)

    def token_spec(self, plan: ParallelPlan) -> P:
        return P(spec_entry(plan.batch_axes), spec_entry(plan.seq_axes))

    def param_spec(self, plan: ParallelPlan, info: ParamInfo) -> tuple:
        """Mesh axes per dim of one layer's parameter (None: not split by the tensor method)."""
        return (None,) * len(info.shape)

    def vector_spec(self, plan: ParallelPlan) -> P:
        """Per-sequence vectors [batch, hidden] (e.g. DiT's conditioning), as the residual stream's rows."""
        return P(spec_entry(plan.batch_axes), None)

    # --- layers (local shards, inside the plan's shard_map)
    def embed(
        self,
        plan: ParallelPlan,
        tokens: jax.Array,
        table: jax.Array,
        positions: jax.Array | None = None,
        pos_table: jax.Array | None = None,
    ) -> jax.Array:
        """tokens int [b, s_tok] -> x [b, s_act, hidden] (plus learned positions when pos_table is given)."""
        x = jnp.take(table, tokens, axis=0)
        if pos_table is not None:
            x = x + jnp.take(pos_table, positions, axis=0)
        return x

    def norm(
        self, plan: ParallelPlan, x: jax.Array, scale: jax.Array, bias: jax.Array | None, *, eps: float = 1e-5
    ) -> jax.Array:
        """LayerNorm of the residual stream x [b, s_act, hidden] (local); scale, bias [hidden] (local blocks)."""
        return layer_norm(x, scale, bias, eps=eps)

    def rms_norm(self, plan: ParallelPlan, x: jax.Array, scale: jax.Array, *, eps: float = 1e-6) -> jax.Array:
        """RMSNorm of the residual stream x [b, s_act, hidden] (local); scale [hidden] (local block)."""
        return rms_norm(x, scale, eps=eps)

    def attention(
        self,
        plan: ParallelPlan,
        x: jax.Array,
        w: dict,
        positions: jax.Array,
        layer: AttentionLayer,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """x [b, s_act, hidden]; w: wq [h, hq·d], wk/wv [h, hkv·d], wo [hq·d, h] (local blocks of the global
        layer.num_heads / num_kv_heads), optionally biases bq [hq·d], bk/bv [hkv·d], bo [h] and the QK-norm
        scales q_norm/k_norm [d] (RMSNorm per head with eps `layer.norm_eps`, before RoPE); positions int [b, s_tok]: the
        RoPE positions (restarting at 0 in every packed document); segment_ids int [b, s_tok] or None: each
        token's document (0: padding), attention stays inside it. The causal mask and a sliding window W (query
        i sees keys i - W < j <= i; None: unlimited) follow the tokens' order in the row (the plan's layout).
        Returns [b, s_act, h]."""
        q, k, v = self.attention_qkv(plan, x, w, positions, layer)
        out = plan.attend(q, k, v, causal=layer.causal, window=layer.window, segment_ids=segment_ids)
        return self.attention_out(plan, out, w)

    def attention_qkv(
        self, plan: ParallelPlan, x: jax.Array, w: dict, positions: jax.Array, layer: AttentionLayer
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The per-token first half of `attention` (methods with `tiles_projections`): x [b, n, hidden] ->
        q [b, n, hq, d], k, v [b, n, hkv, d] after the QK-norm and RoPE at positions int [b, n]."""
        del plan
        q, k, v = (add_bias(x @ w[f"w{n}"], w.get(f"b{n}")) for n in "qkv")
        q, k, v = split_heads(q, k, v, layer.head_dim)
        q, k = qk_norm_rope(q, k, w, positions, layer.rope, eps=layer.norm_eps)
        return q, k, v

    def attention_out(self, plan: ParallelPlan, out: jax.Array, w: dict) -> jax.Array:
        """The per-token last half of `attention`: out [b, n, hq, d] -> [b, n, hidden] (wo, bo)."""
        del plan
        return add_bias(merge_heads(out) @ w["wo"], w.get("bo"))

    def mlp(self, plan: ParallelPlan, x: jax.Array, w: dict, *, activation: str) -> jax.Array:
        """x [b, s_act, hidden]; w: w_in [h, f] (and w_gate for swiglu), w_out [f, h] (local blocks), optionally
        biases b_in, b_gate [f] and b_out [h]."""
        gate = add_bias(x @ w["w_gate"], w.get("b_gate")) if activation == "swiglu" else None
        h = activate(add_bias(x @ w["w_in"], w.get("b_in")), gate, activation)
        return add_bias(h @ w["w_out"], w.get("b_out"))

    def moe(
        self, plan: ParallelPlan, x: jax.Array, moe: Callable[..., tuple[jax.Array, dict]]
    ) -> tuple[jax.Array, dict]:
        """(y, stats) of a `jaxring.nn.moe.MoE` module on the residual stream x [b, s_act, hidden]: this device's
        tokens go to their experts over ep; stats are summed over the batch and sequence axes."""
        return moe(x, ep_axis="ep" if plan.ep > 1 else None, tp_axis=None, token_axes=plan.batch_axes + plan.seq_axes)

    def cross_entropy(
        self, plan: ParallelPlan, x: jax.Array, w: jax.Array, targets: jax.Array, *, tied: bool
    ) -> jax.Array:
        """Per-token loss fp32 [b, s_tok] of logits x @ head: w is the head [h, vocab], or the embedding
        table [vocab, h] when `tied`."""
        head = w.T if tied else w
        logits = (x @ head.astype(x.dtype)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets)

    def tiles_loss_itself(self, plan: ParallelPlan) -> bool:
        """Whether `cross_entropy` cuts the rows into the plan's loss tiles itself (False: the caller runs it a
        tile at a time, `jaxring.nn.modules.token_cross_entropy`)."""
        return False

    def local_rows(self, plan: ParallelPlan, seq_len: int) -> int:
        """Tokens of the residual stream on a device: the rows a tiled MLP or loss cuts (seq / sp here)."""
        return seq_len // plan.sp

    def tile_targets(self, plan: ParallelPlan, targets: jax.Array, tiles: int) -> jax.Array:
        """Token-layout targets [b, s_tok] arranged so that tile j of them (along axis 1) holds the targets of
        tile j of the residual stream's rows (the identity when both layouts have the same rows)."""
        return targets

    def untile_losses(self, plan: ParallelPlan, losses: jax.Array, tiles: int) -> jax.Array:
        """The inverse of `tile_targets` for per-token losses [b, s_tok]."""
        return losses

    def activation_positions(self, plan: ParallelPlan, positions: jax.Array) -> jax.Array:
        """The positions [b, s_act] of the residual stream's tokens, from the token-layout positions [b, s_tok]
        (the same unless the method splits the sequence further, as Megatron does over tp)."""
        return positions

    def local_vector(self, plan: ParallelPlan, c: jax.Array) -> jax.Array:
        """This device's part of a per-sequence vector c [b_local, hidden] that matches the residual stream's
        columns (identity unless the method splits hidden)."""
        return c

    # --- cost model (jaxring.parallel.cost_terms; bytes per device, one layer and one micro-step unless said otherwise)
    recomputes_forward = False  # its backward runs the layer's forward again (METP): FLOPs, and few residuals

    def accepts(self, tp: int) -> bool:
        """Whether the method runs on tp devices (the planner searches the degrees it accepts)."""
        return (tp > 1) == bool(self.axes)

    def splits_vocab(self, plan: ParallelPlan) -> bool:
        """Whether the plan's options split the embedding and LM head by vocab rows (`VocabSplit`)."""
        return False

    def check_whole_tables(self, plan: ParallelPlan, user: str) -> None:
        """Raises (one line) where `user` (e.g. "generate") needs the embedding and LM head whole and the plan
        splits them (`VocabSplit`); nothing otherwise."""

    def has_cost(self) -> bool:
        """Whether the method prices its own traffic (a method over tensor axes must override
        `layer_transfers`; the base's "nothing moves" is only right for "none")."""
        return not self.axes or type(self).layer_transfers is not TensorMethod.layer_transfers

    def local_dims(self, m: ModelShape) -> LocalDims:
        """This device's share of one micro-step (nothing split: the sequence shard n = seq / sp)."""
        return LocalDims(m.b, m.n, m.n, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab)

    def layer_transfers(self, m: ModelShape, x: LocalDims) -> list[Transfer]:
        """One layer's traffic over the method's axes (attention and MLP blocks), forward and backward."""
        return []

    def head_transfers(self, m: ModelShape, x: LocalDims) -> list[Transfer]:
        """The traffic outside the layer stack (embedding, final norm, head, loss), one micro-step."""
        return []

    def attention_core_cost(self, m: ModelShape, x: LocalDims) -> AttentionCost | None:
        """The price of the method's own attention core, when it replaces the plan's sequence strategy
        (METP); None: the strategy's entry prices it."""
        return None

    def layer_working(self, m: ModelShape, x: LocalDims) -> float:
        """Buffers of one layer's backward the method adds to the attention core's."""
        return 0.0


def modulation_gradients(
    vectors: int, m: ModelShape, x: LocalDims, what: str, axes: tuple[str, ...] = ("tp",)
) -> list[Transfer]:
    """A method that splits the tokens over `axes` meets per-sequence [b, hidden] vectors (DiT's adaLN
    modulation) whole on every device: their fp32 gradients are summed over the split (all-reduce)."""
    if not vectors:
        return []
    p = m.tp
    return [Transfer(what, axes, vectors * 2 * (p - 1) / p * x.b * m.hidden * F32, 1)]


class NoTensorParallel(VocabSplit, TensorMethod):
    """No tensor parallelism ("none"): the base's layers, and with `--vocab-split ring` the embedding and LM
    head split by vocab rows over the sequence strategy's axes, their blocks on a ring there (`vocab_split.py`)."""

    def vocab_axes(self, plan: ParallelPlan) -> tuple[str, ...]:
        return plan.seq_axes

    def check_model(
        self, plan: ParallelPlan, *, num_heads: int, num_kv_heads: int, hidden: int, ffn: int, vocab: int | None
    ) -> None:
        self.check_vocab(plan, vocab, plan.sp, "sp")

    def param_spec(self, plan: ParallelPlan, info: ParamInfo) -> tuple:
        return tuple(self.vocab_axis(plan) if a == "vocab" else None for a in info.logical_axes)

    def local_dims(self, m: ModelShape) -> LocalDims:
        vocab = m.vocab // m.sp if m.vocab is not None and m.vocab_ring else m.vocab  # one block's logits
        return LocalDims(m.b, m.n, m.n, m.hidden, m.heads, m.kv_heads, m.ffn, vocab)

    def head_transfers(self, m: ModelShape, x: LocalDims) -> list[Transfer]:
        if m.vocab is None or not m.vocab_ring or m.sp == 1:
            return []
        return vocab_ring_transfers(m, m.sp, m.seq_axes)


NONE = NoTensorParallel()  # no tensor parallelism
