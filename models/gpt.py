"""A decoder-only GPT in Flax NNX, built from jaxring's parallel blocks; the Llama family by configuration.

Pre-norm (LayerNorm or RMSNorm); RoPE (with linear, llama3 or yarn scaling) or learned positions; GELU or
SwiGLU MLP; GQA/MQA; head_dim independent of hidden / heads; optional biases on q/k/v (Qwen2), the output
projection and the MLP; QK-norm (Qwen3); a sliding window (Mistral); tied or untied embeddings. Presets with
the published shapes of Llama 3 / 3.1, Mistral 7B, Qwen2.5 and Qwen3, each with a tiny twin for tests
(`tiny-llama3`, ...); `jaxring.models.hf` reads and writes their Hugging Face checkpoints. The parallel strategy is
not part of the model: every call takes a `ParallelPlan`, so the same parameters run on any mesh. Generation
with a KV cache sharded over the plan is `jaxring.models.generate.generate(model, plan, prompts, max_new_tokens)`.

    model = GPT(PRESETS["tiny"], rngs=nnx.Rngs(0))
    trainer = jaxring.train.trainer.Trainer(...)            # or, inside plan.shard_map on local shards:
    losses = model.token_losses(tokens, targets, positions, plan, Layers.of(model.blocks))
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxring.kernels.layer_math import ACTIVATIONS
from jaxring.kernels.rope import ROPE_SCALINGS, Rope
from jaxring.nn import MLP, NORMS, Attention, Embed, LayerScan, MoE, stack, token_cross_entropy
from jaxring.nn.moe import MoEConfig, moe_ffn
from jaxring.nn.tiled_block import runs_tiled, tiled_block
from jaxring.parallel.plan import ParallelPlan
from jaxring.run.task import Objective


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} {value!r} must be a positive integer")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    num_layers: int = 4
    hidden: int = 128
    num_heads: int = 8
    num_kv_heads: int | None = None
    ffn: int | None = None  # default 4 * hidden
    positions: str = "rope"  # "rope" or "learned"
    max_seq_len: int = 1024  # learned positions only
    activation: str = "gelu"  # "gelu" or "swiglu"
    tie_embeddings: bool = True
    rope_theta: float = Rope.theta
    # RoPE scaling (context extension; defaults are jaxring.kernels.rope.Rope's): none, linear (factor), llama3 (factor, low/high_freq_factor,
    # original_max_positions), yarn (factor, beta_fast/slow, original_max_positions, attention_factor)
    rope_scaling: str = "none"
    rope_factor: float = Rope.factor
    rope_low_freq_factor: float = Rope.low_freq_factor
    rope_high_freq_factor: float = Rope.high_freq_factor
    rope_original_max_positions: int | None = Rope.original_max_positions
    rope_beta_fast: float = Rope.beta_fast
    rope_beta_slow: float = Rope.beta_slow
    rope_attention_factor: float | None = Rope.attention_factor  # yarn; None: 0.1 ln(factor) + 1
    norm: str = "layernorm"  # "layernorm" or "rmsnorm"
    norm_eps: float = 1e-5
    head_dim: int | None = None  # default hidden // num_heads
    qkv_bias: bool = False  # biases on q, k, v (Qwen2)
    proj_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False  # biases on the MLP's linears
    qk_norm: bool = False  # RMSNorm per head on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # query i attends keys i - W < j <= i (Mistral)
    # mixture of experts in every block's FFN (None: a dense MLP); see jaxring.nn.moe.MoEConfig
    num_experts: int | None = None
    experts_per_token: int = 2
    expert_ffn: int | None = None  # each expert's hidden size (default: ffn)
    shared_expert_ffn: int | None = None
    capacity_factor: float | None = None  # None: dropless
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "hidden", "num_heads", "max_seq_len"):
            _check_positive_int(name, getattr(self, name))
        for name in ("num_kv_heads", "ffn", "head_dim", "sliding_window", "rope_original_max_positions"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        for name in ("tie_embeddings", "qkv_bias", "proj_bias", "mlp_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} {getattr(self, name)!r} must be true or false")
        if self.norm not in NORMS:
            raise ValueError(f"norm {self.norm!r}: expected one of {', '.join(NORMS)}")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not self.norm_eps > 0:
            raise ValueError(f"norm_eps {self.norm_eps!r} must be a positive number")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling {self.rope_scaling!r}: expected one of {', '.join(ROPE_SCALINGS)}")
        if self.positions == "rope":
            _ = self.rope  # Rope's own checks (factor > 0, llama3/yarn need rope_original_max_positions, ...)
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) or self.rope_theta <= 0:
            raise ValueError(f"rope_theta {self.rope_theta!r} must be a positive number")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: expected one of {', '.join(ACTIVATIONS)}")
        if self.num_experts is not None:
            _ = self.moe  # MoEConfig's own checks (top-k <= experts, capacity > 0, ...)
        if self.positions not in ("rope", "learned"):
            raise ValueError(f"positions {self.positions!r}: expected 'rope' or 'learned'")
        if self.head_dim is None and self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by num_heads {self.num_heads} (or set head_dim)")
        if self.positions == "rope" and self.attn_head_dim % 2:
            raise ValueError(f"head_dim {self.attn_head_dim} must be even for RoPE")
        if self.num_heads % (self.num_kv_heads or self.num_heads):
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def attn_head_dim(self) -> int:
        """The head dimension in force: head_dim, else hidden // num_heads."""
        return self.head_dim or self.hidden // self.num_heads

    @property
    def rope(self) -> Rope | None:
        """The RoPE of the attention (None with learned positions)."""
        if self.positions != "rope":
            return None
        return Rope(
            theta=float(self.rope_theta),
            scaling=self.rope_scaling,
            factor=float(self.rope_factor),
            low_freq_factor=float(self.rope_low_freq_factor),
            high_freq_factor=float(self.rope_high_freq_factor),
            original_max_positions=self.rope_original_max_positions,
            beta_fast=float(self.rope_beta_fast),
            beta_slow=float(self.rope_beta_slow),
            attention_factor=None if self.rope_attention_factor is None else float(self.rope_attention_factor),
        )

    @property
    def moe(self) -> MoEConfig | None:
        """The blocks' mixture-of-experts FFN, or None for dense MLPs."""
        if self.num_experts is None:
            return None
        return MoEConfig(
            num_experts=self.num_experts,
            experts_per_token=self.experts_per_token,
            ffn=self.expert_ffn or self.ffn_size,
            activation=self.activation,
            shared_expert_ffn=self.shared_expert_ffn,
            capacity_factor=self.capacity_factor,
            aux_loss_weight=self.aux_loss_weight,
            z_loss_weight=self.z_loss_weight,
        )

    def num_params(self, embeddings: bool = True, active: bool = False) -> int:
        """Parameters (all of them, or `active`: those one token uses, k of the E experts)."""
        q = self.num_heads * self.attn_head_dim
        kv = (self.num_kv_heads or self.num_heads) * self.attn_head_dim
        attn = self.hidden * (2 * q + 2 * kv)
        attn += (q + 2 * kv) * self.qkv_bias + self.hidden * self.proj_bias + 2 * self.attn_head_dim * self.qk_norm
        matrices = 3 if self.activation == "swiglu" else 2
        moe = self.moe
        if moe is None:
            mlp = matrices * self.hidden * self.ffn_size
        else:
            experts = moe.experts_per_token if active else moe.num_experts
            mlp = (
                experts * matrices * self.hidden * moe.ffn
                + self.hidden * moe.num_experts
                + matrices * self.hidden * (moe.shared_expert_ffn or 0)
            )
        if self.mlp_bias and moe is None:
            mlp += (matrices - 1) * self.ffn_size + self.hidden
        norm = self.hidden * (2 if self.norm == "layernorm" else 1)
        per_layer = attn + mlp + 2 * norm
        emb = self.vocab_size * self.hidden * (1 if self.tie_embeddings else 2)
        emb += self.max_seq_len * self.hidden if self.positions == "learned" else 0
        return self.num_layers * per_layer + norm + (emb if embeddings else 0)

    def flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Training FLOPs per token (the playbook's 6N + attention, causal attention counted as half; N counts
        the active parameters of a mixture of experts). The attention core (QKᵀ and PV, 2 FLOPs per
        multiply-add, backward twice the forward) is as wide as heads × head_dim, not hidden (Qwen3)."""
        width = self.num_heads * self.attn_head_dim
        attention = 12 * self.num_layers * width * seq_len * (0.5 if causal else 1.0)
        return 6 * self.num_params(embeddings=False, active=True) + 6 * self.vocab_size * self.hidden + attention


PRESETS = {
    # runs in seconds on CPU; byte-level vocabulary
    "tiny": GPTConfig(vocab_size=256, num_layers=4, hidden=128, num_heads=8, ffn=512),
    "gpt2-124m": GPTConfig(
        vocab_size=50304, num_layers=12, hidden=768, num_heads=12, positions="learned", max_seq_len=1024
    ),
    "1b": GPTConfig(
        vocab_size=50304, num_layers=24, hidden=2048, num_heads=16, activation="swiglu", ffn=5632, tie_embeddings=False
    ),
    # GPT 7B of WallFacer / LLaMA-7B of METP: 32 layers, 32 heads, hidden 4096
    "7b": GPTConfig(
        vocab_size=32000, num_layers=32, hidden=4096, num_heads=32, activation="swiglu", ffn=11008, tie_embeddings=False
    ),
    # seconds on CPU: 8 experts, top-2, dropless
    "tiny-moe": GPTConfig(
        vocab_size=256,
        num_layers=2,
        hidden=64,
        num_heads=4,
        ffn=128,
        activation="swiglu",
        num_experts=8,
        experts_per_token=2,
    ),
    # Mixtral 8x7B's shape: 32 layers, hidden 4096, 32 heads (8 K/V), 8 experts of 14336, top-2; 46.7B params,
    # 12.9B active
    "mixtral": GPTConfig(
        vocab_size=32000,
        num_layers=32,
        hidden=4096,
        num_heads=32,
        num_kv_heads=8,
        activation="swiglu",
        ffn=14336,
        tie_embeddings=False,
        rope_theta=1e6,
        max_seq_len=32768,
        num_experts=8,
        experts_per_token=2,
    ),
}

# The Llama family: RMSNorm, SwiGLU, RoPE, GQA, untied embeddings (as released on Hugging Face)
_LLAMA = dict(norm="rmsnorm", activation="swiglu", tie_embeddings=False)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, num_kv_heads=8, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=8192)
_LLAMA31_ROPE = dict(
    rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
    rope_original_max_positions=8192, max_seq_len=131072,
)  # fmt: skip
_QWEN = dict(_LLAMA, rope_theta=1e6, norm_eps=1e-6)
PRESETS.update(
    {
        "llama3-8b": GPTConfig(num_layers=32, hidden=4096, num_heads=32, ffn=14336, **_LLAMA3),
        "llama3.1-8b": GPTConfig(num_layers=32, hidden=4096, num_heads=32, ffn=14336, **{**_LLAMA3, **_LLAMA31_ROPE}),
        "llama3-70b": GPTConfig(num_layers=80, hidden=8192, num_heads=64, ffn=28672, **_LLAMA3),
        "mistral-7b": GPTConfig(
            vocab_size=32000, num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, ffn=14336,
            norm_eps=1e-5, sliding_window=4096, max_seq_len=32768, **_LLAMA,
        ),
        "qwen2.5-7b": GPTConfig(
            vocab_size=152064, num_layers=28, hidden=3584, num_heads=28, num_kv_heads=4, ffn=18944,
            qkv_bias=True, max_seq_len=32768, **_QWEN,
        ),
        "qwen3-8b": GPTConfig(
            vocab_size=151936, num_layers=36, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, ffn=12288,
            qk_norm=True, max_seq_len=40960, **_QWEN,
        ),
        # tiny twins (the same features, seconds on CPU): tests and notebooks
        "tiny-llama3": GPTConfig(
            num_layers=2, hidden=64, num_heads=4, ffn=128,
            **{**_LLAMA3, **_LLAMA31_ROPE, "vocab_size": 256, "num_kv_heads": 2, "rope_original_max_positions": 32,
               "max_seq_len": 256},
        ),
        "tiny-mistral": GPTConfig(
            vocab_size=256, num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, ffn=128, norm_eps=1e-5,
            sliding_window=16, max_seq_len=256, **_LLAMA,
        ),
        "tiny-qwen2": GPTConfig(
            vocab_size=256, num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, ffn=128, qkv_bias=True,
            max_seq_len=256, **_QWEN,
        ),
        "tiny-qwen3": GPTConfig(
            vocab_size=256, num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=32, ffn=128,
            qk_norm=True, max_seq_len=256, **_QWEN,
        ),
    }
)  # fmt: skip


def check_plan(cfg: GPTConfig, plan: ParallelPlan, batch: int, seq_len: int) -> None:
    """Raises (one line naming the value and the rule) when a `cfg` model cannot run on `plan` with
    micro-batches of `batch` sequences of `seq_len` tokens."""
    num_kv = cfg.num_kv_heads or cfg.num_heads
    plan.tensor.check_model(
        plan, num_heads=cfg.num_heads, num_kv_heads=num_kv, hidden=cfg.hidden, ffn=cfg.ffn_size, vocab=cfg.vocab_size
    )
    plan.check_heads(cfg.num_heads, num_kv)
    if cfg.moe is not None:
        if not plan.tensor.runs_moe:
            raise ValueError(
                f"mixture-of-experts layers cannot run with tensor parallelism '{plan.tensor.name}'; "
                "use megatron (or none) with --ep"
            )
        cfg.moe.check_parallel(plan.ep, plan.tp)
    elif plan.ep > 1:
        raise ValueError(
            f"ep = {plan.ep} splits experts, but the model has none (num_experts is None); use the "
            f"tiny-moe or mixtral preset, or --override num_experts=N"
        )
    plan.check_layers(cfg.num_layers)
    plan.check_batch(batch, "micro-batch size (batch / grad-accum)")
    plan.check_seq_len(seq_len, causal=True)
    if cfg.positions == "learned" and seq_len > cfg.max_seq_len:
        raise ValueError(f"seq {seq_len} exceeds the learned positions' max_seq_len {cfg.max_seq_len}")


def get_config(preset: str, **overrides) -> GPTConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown GPT preset {preset!r}; expected one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[preset], **overrides)


MOE_METRICS = ("aux_loss", "z_loss", "drop_rate", "load_imbalance")  # averaged over the layers


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        out_std = (2 * cfg.num_layers) ** -0.5 * cfg.hidden**-0.5  # GPT-2's scaled residual init
        norm = NORMS[cfg.norm]
        self.ln1 = norm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = Attention(
            cfg.hidden,
            cfg.num_heads,
            cfg.num_kv_heads,
            head_dim=cfg.attn_head_dim,
            causal=True,
            rope=cfg.rope,
            window=cfg.sliding_window,
            qkv_bias=cfg.qkv_bias,
            proj_bias=cfg.proj_bias,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            out_std=out_std,
            rngs=rngs,
        )
        self.ln2 = norm(cfg.hidden, eps=cfg.norm_eps)
        if cfg.moe is None:
            self.mlp = MLP(cfg.hidden, cfg.ffn_size, cfg.activation, bias=cfg.mlp_bias, out_std=out_std, rngs=rngs)
        else:
            self.mlp = MoE(cfg.hidden, cfg.moe, out_std=out_std, rngs=rngs)

    def __call__(self, x, positions, plan: ParallelPlan, segment_ids=None):
        """x -> x (dense MLP), or -> (x, MoE statistics) (mixture of experts). positions: RoPE positions
        (each packed document's restart at 0); segment_ids: each token's document, or None (see Attention).
        With --mlp-tile and per-token projections the whole block but attention's core runs in tiles
        (`jaxring.nn.tiled_block`)."""
        if runs_tiled(plan, x, not isinstance(self.mlp, MoE)):
            return tiled_block(x, positions, plan, self.ln1, self.attn, self.ln2, self.mlp, segment_ids)
        x = x + self.attn(self.ln1(x, plan), positions, plan, segment_ids)
        if not isinstance(self.mlp, MoE):
            return x + self.mlp(self.ln2(x, plan), plan)
        y, stats = self.mlp(self.ln2(x, plan), plan)
        return x + y, {k: stats[k] for k in ("loss",) + MOE_METRICS}

    def decode(self, x, positions, cache: tuple, cache_positions, plan: ParallelPlan):
        """One decoding step of the block (see `jaxring.models.generate`): x [b, 1, hidden] new tokens at positions
        int [b]; cache (k, v) local [b, n, kv heads, head_dim] at cache_positions int [n]. Returns (x, the new
        tokens' (k, v) [b, kv heads, head_dim])."""
        y, kv = self.attn.decode(self.ln1(x, plan), positions, cache, cache_positions, plan)
        x = x + y
        h = self.ln2(x, plan)
        if not isinstance(self.mlp, MoE):
            return x + self.mlp.decode(h, plan), kv
        y, _ = moe_ffn(
            h,
            self.mlp.params(),
            config=self.mlp.config,
            ep_axis="ep" if plan.ep > 1 else None,
            tp_axis="tp" if plan.tp > 1 else None,
            token_axes=plan.batch_axes,
        )
        return x + y, kv


class GPT(nnx.Module):
    """Embedding, `num_layers` stacked blocks (scanned), final norm and the LM head (tied: the table).

    Every compute method is *local*: it runs inside the plan's shard_map (the train step's, or
    `plan.shard_map`) on this device's shards; `layers` is the block stack as the step materializes it
    (`jaxring.nn.LayerScan`: the step's `Layers` on its weights; `Layers.of(model.blocks)` outside a train step).
    """

    STACK = "blocks"

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.hidden, rngs=rngs)
        if cfg.positions == "learned":
            self.pos_embed = nnx.Param(
                jax.random.normal(rngs.params(), (cfg.max_seq_len, cfg.hidden)) * 0.01, logical_axes=(None, "embed")
            )
        self.blocks = stack(lambda r: Block(cfg, rngs=r), cfg.num_layers, rngs)
        self.ln_f = NORMS[cfg.norm](cfg.hidden, eps=cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.head = nnx.Param(
                jax.random.normal(rngs.params(), (cfg.hidden, cfg.vocab_size)) * cfg.hidden**-0.5,
                logical_axes=("embed", "vocab"),
            )

    # The forward in three parts (the pipeline cuts it there): embed, one block at a time, the head.
    def embed_tokens(self, tokens, positions, dtype=jnp.float32, *, plan: ParallelPlan):
        """The carry entering the blocks: {"x": local [batch, seq, hidden] (activation layout)} for local
        tokens and positions int32 [batch, seq] (token layout), plus {"moe": zeroed statistics} for MoE."""
        pos_table = self.pos_embed[...] if self.cfg.positions == "learned" else None
        carry = {"x": self.embed(tokens, plan, dtype, positions=positions, pos_table=pos_table)}
        if self.cfg.moe is not None:
            carry["moe"] = {k: jnp.zeros((), jnp.float32) for k in ("loss",) + MOE_METRICS}
        return carry

    @staticmethod
    def block_step(block: Block, carry, positions, plan: ParallelPlan, segment_ids=None):
        """One block on the carry (MoE statistics summed over the layers)."""
        out = block(carry["x"], positions, plan, segment_ids)
        if "moe" not in carry:
            return {"x": out}
        x, stats = out
        return {"x": x, "moe": jax.tree.map(jnp.add, carry["moe"], stats)}

    def head_losses(self, carry, targets, plan: ParallelPlan, dtype=jnp.float32):
        """Cross-entropy fp32 [batch, seq] (token layout) of predicting `targets` from the blocks' carry
        (final LayerNorm and the LM head; logits never gathered under TP)."""
        x = self.ln_f(carry["x"], plan)
        w, tied = self.head_weight(dtype)
        return token_cross_entropy(x, w, targets, plan, tied=tied)

    def features(
        self, tokens, positions, plan: ParallelPlan, layers: LayerScan, *, dtype=jnp.float32, segment_ids=None
    ):
        """Final hidden states, local [batch, seq, hidden] (activation layout)."""
        carry = self.embed_tokens(tokens, positions, dtype, plan=plan)
        carry = layers(carry, lambda block, carry: self.block_step(block, carry, positions, plan, segment_ids))
        return self.ln_f(carry["x"], plan)

    def head_weight(self, dtype):
        """(w, tied): the embedding table [vocab, hidden] when tied, else the head [hidden, vocab]."""
        w = self.embed.table[...] if self.cfg.tie_embeddings else self.head[...]
        return w.astype(dtype), self.cfg.tie_embeddings

    def token_losses(
        self, tokens, targets, positions, plan: ParallelPlan, layers: LayerScan, *, dtype=jnp.float32, segment_ids=None
    ):
        """Cross-entropy fp32 [batch, seq] (token layout) of predicting `targets`. positions: int32 [batch, seq],
        RoPE's (and learned positions'); with packed documents they restart at 0 in each, and segment_ids
        int32 [batch, seq] (1, 2, ... per document, 0 padding) keep each token's attention inside its document."""
        carry = self.embed_tokens(tokens, positions, dtype, plan=plan)
        carry = layers(carry, lambda block, carry: self.block_step(block, carry, positions, plan, segment_ids))
        return self.head_losses(carry, targets, plan, dtype)

    def logits(self, tokens, positions, plan: ParallelPlan, layers: LayerScan, *, dtype=jnp.float32):
        """fp32 [batch, seq, vocab] on a plan without tensor parallelism (generation)."""
        x = self.features(tokens, positions, plan, layers, dtype=dtype)
        w, tied = self.head_weight(dtype)
        return (x @ (w.T if tied else w)).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class NextTokenObjective(Objective):
    """Mean next-token cross-entropy of batches {"tokens", "targets", "positions"} (int32 [batch, seq], laid out
    by the plan on the data side): what `jaxring.train.step.TrainStep` optimizes. For a mixture of experts,
    aux["extra_loss"] is the layers' load-balancing and z losses (over the whole micro-batch: the step adds it
    to the mean token loss) and the MoE metrics are averaged over the layers.

    documents: the batches are packed documents (`jaxring.data.packing`'s convention): also "segment_ids" and
    "loss_mask", and "positions" restart at 0 in every document (RoPE by document position; the causal mask
    follows the row). Attention stays inside each document, and the loss is the mean over the targets with
    loss_mask 1 of the whole step's batch (every micro-batch, pipeline stage and data shard): `prepare` turns
    the mask into "loss_weights" = loss_mask · (batch·seq / unmasked count), so that the step's division by
    `loss_count` = batch·seq gives that mean.
    """

    batch_size: int
    seq_len: int
    documents: bool = False

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """The arrays a batch holds (each int32 [batch, seq], laid out by the plan like the tokens)."""
        return ("tokens", "targets", "positions") + (("segment_ids", "loss_mask") if self.documents else ())

    def prepare(self, batch: dict, key) -> dict:
        del key
        if not self.documents:
            return batch
        inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
        mask = batch["loss_mask"].astype(jnp.float32)
        unmasked = jnp.maximum(jnp.sum(mask), 1.0)  # the whole step's batch: a global array here
        inputs["loss_weights"] = mask * (self.loss_count / unmasked)
        return inputs

    def input_specs(self, plan: ParallelPlan) -> dict:
        names = ("tokens", "targets", "positions") + (("segment_ids", "loss_weights") if self.documents else ())
        return {name: plan.token_spec() for name in names}

    @property
    def loss_count(self) -> int:
        return self.batch_size * self.seq_len

    def embed(self, model: GPT, mb: dict, plan: ParallelPlan, dtype):
        return model.embed_tokens(mb["tokens"], mb["positions"], dtype, plan=plan)

    def layer(self, block: Block, carry, mb: dict, plan: ParallelPlan):
        return GPT.block_step(block, carry, mb["positions"], plan, mb.get("segment_ids"))

    def head(self, model: GPT, carry, mb: dict, plan: ParallelPlan, dtype):
        losses = model.head_losses(carry, mb["targets"], plan, dtype)
        if self.documents:
            losses = losses * mb["loss_weights"]
        if "moe" not in carry:
            return losses.sum(), {}
        stats, num_layers = carry["moe"], model.cfg.num_layers
        aux = {"extra_loss": stats["loss"], "moe_loss": stats["loss"]}
        aux.update({f"moe_{k}" if k in ("aux_loss", "z_loss") else k: stats[k] / num_layers for k in MOE_METRICS})
        return losses.sum(), aux
