"""A decoder-only GPT in Flax NNX, built from jaxring's parallel blocks.

Pre-LN; RoPE or learned positions; GELU or SwiGLU MLP; optional GQA; tied or untied embeddings. The parallel
strategy is not part of the model: every call takes a `ParallelPlan`, so the same parameters run on any mesh.

    model = GPT(PRESETS["tiny"], rngs=nnx.Rngs(0))
    loss = model.loss(tokens, targets, positions, plan)     # tokens [batch, seq], positions [batch, seq]
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxring.nn import MLP, Attention, Embed, block_runner, token_cross_entropy
from jaxring.plan import ParallelPlan


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    num_layers: int = 4
    hidden: int = 128
    num_heads: int = 8
    num_kv_heads: int | None = None
    ffn: int | None = None                # default 4 * hidden
    positions: str = "rope"               # "rope" or "learned"
    max_seq_len: int = 1024               # learned positions only
    activation: str = "gelu"              # "gelu" or "swiglu"
    tie_embeddings: bool = True
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.positions not in ("rope", "learned"):
            raise ValueError(f"positions {self.positions!r}: expected 'rope' or 'learned'")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % (self.num_kv_heads or self.num_heads):
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def num_params(self, embeddings: bool = True) -> int:
        kv = (self.num_kv_heads or self.num_heads) * self.head_dim
        attn = self.hidden * (2 * self.hidden + 2 * kv)
        mlp = (3 if self.activation == "swiglu" else 2) * self.hidden * self.ffn_size
        per_layer = attn + mlp + 4 * self.hidden
        emb = self.vocab_size * self.hidden * (1 if self.tie_embeddings else 2)
        emb += self.max_seq_len * self.hidden if self.positions == "learned" else 0
        return self.num_layers * per_layer + 2 * self.hidden + (emb if embeddings else 0)

    def flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Training FLOPs per token (the playbook's 6N + attention, causal attention counted as half)."""
        attention = 12 * self.num_layers * self.hidden * seq_len * (0.5 if causal else 1.0)
        return 6 * self.num_params(embeddings=False) + 6 * self.vocab_size * self.hidden + attention


PRESETS = {
    # runs in seconds on CPU; byte-level vocabulary
    "tiny": GPTConfig(vocab_size=256, num_layers=4, hidden=128, num_heads=8, ffn=512),
    "gpt2-124m": GPTConfig(vocab_size=50304, num_layers=12, hidden=768, num_heads=12, positions="learned",
                           max_seq_len=1024),
    "1b": GPTConfig(vocab_size=50304, num_layers=24, hidden=2048, num_heads=16, activation="swiglu",
                    ffn=5632, tie_embeddings=False),
    # GPT 7B of WallFacer / LLaMA-7B of METP: 32 layers, 32 heads, hidden 4096
    "7b": GPTConfig(vocab_size=32000, num_layers=32, hidden=4096, num_heads=32, activation="swiglu",
                    ffn=11008, tie_embeddings=False),
}


def get_config(preset: str, **overrides) -> GPTConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown GPT preset {preset!r}; expected one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[preset], **overrides)


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        out_std = (2 * cfg.num_layers) ** -0.5 * cfg.hidden ** -0.5  # GPT-2's scaled residual init
        self.ln1 = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        self.attn = Attention(cfg.hidden, cfg.num_heads, cfg.num_kv_heads, causal=True, out_std=out_std,
                              rope_theta=cfg.rope_theta if cfg.positions == "rope" else None, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        self.mlp = MLP(cfg.hidden, cfg.ffn_size, cfg.activation, out_std=out_std, rngs=rngs)

    def __call__(self, x, positions, plan: ParallelPlan):
        x = x + self.attn(_norm(self.ln1, x), positions, plan)
        return x + self.mlp(_norm(self.ln2, x), plan)


def _norm(ln, x):
    """LayerNorm in fp32, result in the compute dtype."""
    return ln(x.astype(jnp.float32)).astype(x.dtype)


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.hidden, rngs=rngs)
        if cfg.positions == "learned":
            self.pos_embed = nnx.Param(jax.random.normal(rngs.params(), (cfg.max_seq_len, cfg.hidden)) * 0.01,
                                       logical_axes=(None, "embed"))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.ln_f = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = nnx.Param(jax.random.normal(rngs.params(), (cfg.hidden, cfg.vocab_size)) * cfg.hidden ** -0.5,
                                  logical_axes=("embed", "vocab"))

    def features(self, tokens, positions, plan: ParallelPlan, *, dtype=jnp.float32, remat: str = "none"):
        """Final hidden states [batch, seq, hidden] for tokens/positions int32 [batch, seq]."""
        x = self.embed(tokens, plan, dtype)
        if self.cfg.positions == "learned":
            if tokens.shape[1] > self.cfg.max_seq_len:
                raise ValueError(f"seq {tokens.shape[1]} exceeds the learned positions' max_seq_len "
                                 f"{self.cfg.max_seq_len}")
            x = x + jnp.take(self.pos_embed[...], positions, axis=0).astype(dtype)
        run_block = block_runner(plan, remat)
        for block in self.blocks:
            x = run_block(block, x, positions)
        return _norm(self.ln_f, x)

    def head_weight(self, dtype):
        return (self.embed.table[...].T if self.cfg.tie_embeddings else self.head[...]).astype(dtype)

    def token_losses(self, tokens, targets, positions, plan: ParallelPlan, *, dtype=jnp.float32,
                     remat: str = "none"):
        """Cross-entropy fp32 [batch, seq] of predicting `targets` (logits never gathered under TP)."""
        x = self.features(tokens, positions, plan, dtype=dtype, remat=remat)
        return token_cross_entropy(x, self.head_weight(dtype), targets, plan)

    def loss(self, tokens, targets, positions, plan: ParallelPlan, **kw):
        return self.token_losses(tokens, targets, positions, plan, **kw).mean()

    def logits(self, tokens, positions, plan: ParallelPlan, *, dtype=jnp.float32):
        x = self.features(tokens, positions, plan, dtype=dtype)
        return (x @ self.head_weight(dtype)).astype(jnp.float32)


def generate(model: GPT, plan: ParallelPlan, prompt, num_tokens: int, *, key, window: int,
             temperature: float = 0.8):
    """Samples `num_tokens` after `prompt` (int list), recomputing a causal window of fixed length (one compile).

    Returns the generated ids (list of int).
    """
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_logits(state, tokens, index):
        m = nnx.merge(graphdef, state)
        positions = jnp.arange(window, dtype=jnp.int32)[None]
        logits = m.logits(tokens, positions, plan)
        return logits[0, index]

    ids = list(prompt)[-window:] or [0]
    out = []
    for _ in range(num_tokens):
        ctx = ids[-window:]
        tokens = jnp.zeros((1, window), jnp.int32).at[0, :len(ctx)].set(jnp.asarray(ctx, jnp.int32))
        logits = next_logits(state, tokens, len(ctx) - 1)
        key, sub = jax.random.split(key)
        token = int(jax.random.categorical(sub, logits / max(temperature, 1e-6)))
        ids.append(token)
        out.append(token)
    return out
