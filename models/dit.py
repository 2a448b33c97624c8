"""A class-conditional Diffusion Transformer (DiT, Peebles & Xie 2023) in Flax NNX, trained by flow matching.

    image [b, H, W, C] ──patchify──▶ tokens [b, (H/p)(W/p), hidden] + fixed 2D sin-cos positions
    t ──sinusoid──MLP──▶ ┐
    y ──table (+ null)──▶ ┴─ c [b, hidden]          (the conditioning of every adaLN layer)
    N × DiT block:  x += gate_msa · Attn(LN(x)·(1 + scale_msa) + shift_msa)
                    x += gate_mlp · MLP (LN(x)·(1 + scale_mlp) + shift_mlp)
                    (shift, scale, gate) = Linear(SiLU(c)), zero-initialised: every block starts as the identity
    final: Linear(LN(x)·(1 + scale) + shift) ──unpatchify──▶ v [b, H, W, C]

Attention and MLP are jaxring's parallel blocks: the plan splits the patch sequence over `sp` (ring, ulysses,
wallfacer, ...; non-causal, so the contiguous layout needs no permutation) or the tensors over `tp`.

Training objective: rectified flow (as in SD3, the backbone WallFacer benchmarks), not DiT's DDPM:
x_t = (1 − t)·x0 + t·ε, the model predicts v = ε − x0, loss = MSE; sampling integrates dx/dt = v from t = 1
(noise) to t = 0 (data) with Euler steps, optionally with classifier-free guidance.

Differences from the DiT reference code: no biases in attention/MLP (jaxring's block contract), their weights
use jaxring's normal init instead of Xavier, the timestep is embedded as 1000·t (t ∈ [0, 1]), the output has
C channels (no learned Σ: flow matching has no variance to learn), and the null class row always exists.

    model = DiT(get_config("tiny"), rngs=nnx.Rngs(0))
    loss = model.loss(images, labels, key, plan)          # images [b, H, W, C] in [-1, 1], labels int [b]
    images = sample(model, plan, labels, key, num_steps=50, cfg_scale=4.0)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxring.nn import MLP, Attention, Layers, LayerScan, bias_param, stack, weight_specs
from jaxring.parallel.plan import ParallelPlan
from jaxring.run.task import Objective

TIME_SAMPLING = ("uniform", "logit_normal")


@dataclasses.dataclass(frozen=True)
class DiTConfig:
    image_size: int = 16  # square images (or latents) of image_size × image_size × channels
    channels: int = 1
    patch_size: int = 2
    num_classes: int = 10
    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 4
    mlp_ratio: float = 4.0
    class_dropout: float = 0.1  # label → null class with this probability in training (for CFG)
    freq_dim: int = 256  # sinusoidal timestep features before the MLP
    time_sampling: str = "uniform"  # t ~ U(0, 1), or "logit_normal": t = sigmoid(n), n ~ N(0, 1) (SD3)

    def __post_init__(self):
        for name in (
            "image_size",
            "channels",
            "patch_size",
            "num_classes",
            "num_layers",
            "hidden",
            "num_heads",
            "freq_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} {value!r} must be a positive integer")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by num_heads {self.num_heads}")
        if self.hidden % 4:
            raise ValueError(
                f"hidden {self.hidden} must be divisible by 4 (2D sin-cos position embedding: "
                f"sin and cos for each of the two axes)"
            )
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim {self.freq_dim} must be even (cos and sin halves)")
        if not 0.0 <= self.class_dropout <= 1.0:
            raise ValueError(f"class_dropout {self.class_dropout} must be a probability in [0, 1]")
        if self.mlp_ratio <= 0 or int(self.hidden * self.mlp_ratio) < 1:
            raise ValueError(f"mlp_ratio {self.mlp_ratio} must be positive (ffn = hidden * mlp_ratio >= 1)")
        if self.time_sampling not in TIME_SAMPLING:
            raise ValueError(f"time_sampling {self.time_sampling!r}: expected one of {', '.join(TIME_SAMPLING)}")

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def num_tokens(self) -> int:
        return self.grid**2

    @property
    def patch_dim(self) -> int:
        return self.patch_size**2 * self.channels

    @property
    def ffn_size(self) -> int:
        return int(self.hidden * self.mlp_ratio)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def param_counts(self) -> tuple[int, int]:
        """(weights applied to every token, weights applied once per image)."""
        h, pd = self.hidden, self.patch_dim
        per_token = (
            pd * h
            + h  # patch embedding
            + self.num_layers * (4 * h * h + 2 * h * self.ffn_size)  # attention + MLP
            + h * pd
            + pd
        )  # final linear
        per_image = (
            self.freq_dim * h
            + h
            + h * h
            + h  # timestep MLP
            + (self.num_classes + 1) * h  # class table with the null class
            + self.num_layers * (h * 6 * h + 6 * h)  # adaLN-Zero modulation
            + h * 2 * h
            + 2 * h
        )  # final adaLN
        return per_token, per_image

    def num_params(self) -> int:
        return sum(self.param_counts())

    def flops_per_image(self) -> float:
        """Training FLOPs per image (forward + backward = 3 × forward, 2 FLOPs per multiply-add).

        6 × (per-token weights) × tokens + 12·L·h·s² for the non-causal attention (QKᵀ and PV); the
        conditioning path (timestep MLP, adaLN) runs once per image, 6 × its weights.
        """
        per_token, per_image = self.param_counts()
        s = self.num_tokens
        return 6.0 * per_token * s + 6.0 * per_image + 12.0 * self.num_layers * self.hidden * s * s


PRESETS = {
    # seconds on CPU: 16×16 grey images, 64 tokens (e.g. the digits data set upscaled)
    "tiny": DiTConfig(image_size=16, channels=1, patch_size=2, num_classes=10, num_layers=2, hidden=64, num_heads=4),
    # DiT-S/2 on ImageNet 256² latents (32×32×4): 256 tokens, 33M parameters
    "dit-s": DiTConfig(
        image_size=32, channels=4, patch_size=2, num_classes=1000, num_layers=12, hidden=384, num_heads=6
    ),
    # WallFacer's DiT 1B (24 heads, 24 layers, hidden 1536; SD3-like 16-channel latents). 128² latents give
    # 4096 tokens; long-sequence runs override image_size (e.g. 724 → 362² = 131,044 tokens).
    "dit-1b": DiTConfig(
        image_size=128, channels=16, patch_size=2, num_classes=1000, num_layers=24, hidden=1536, num_heads=24
    ),
}


def get_config(preset: str, **overrides) -> DiTConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown DiT preset {preset!r}; expected one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[preset], **overrides)


# ---------------------------------------------------------------------------------------- fixed embeddings


def _sincos_1d(dim: int, pos):
    """[len(pos), dim]: sin(pos·ω) ‖ cos(pos·ω), ω_i = 10000^(−i/(dim/2))."""
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2))
    out = np.outer(pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


@functools.lru_cache(maxsize=16)
def pos_embed_2d(hidden: int, grid: int) -> np.ndarray:
    """Fixed 2D sin-cos position embedding float32 [grid², hidden] (DiT's get_2d_sincos_pos_embed): token
    r·grid + c gets sincos(c) in the first half of the features and sincos(r) in the second."""
    rows, cols = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    return np.concatenate([_sincos_1d(hidden // 2, cols), _sincos_1d(hidden // 2, rows)], 1).astype(np.float32)


def pos_embed_at(positions, hidden: int, grid: int, dtype=jnp.float32):
    """The rows of `pos_embed_2d(hidden, grid)` for token positions int [..., n], computed on the fly (no
    [grid², hidden] table is stored): [..., n, hidden]."""

    def sincos(pos, dim):
        omega = 1.0 / 10000 ** (jnp.arange(dim // 2, dtype=jnp.float32) / (dim / 2))
        out = pos.astype(jnp.float32)[..., None] * omega
        return jnp.concatenate([jnp.sin(out), jnp.cos(out)], axis=-1)

    rows, cols = positions // grid, positions % grid
    return jnp.concatenate([sincos(cols, hidden // 2), sincos(rows, hidden // 2)], axis=-1).astype(dtype)


def timestep_features(t, dim: int, max_period: float = 10000.0):
    """Sinusoidal features fp32 [b, dim] of t [b] (DiT's TimestepEmbedder.timestep_embedding: cos ‖ sin)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


# ---------------------------------------------------------------------------------------- patches


def patchify(images, p: int):
    """[b, H, W, C] → [b, (H/p)(W/p), p·p·C]; tokens in row-major patch order, features (dy, dx, c)."""
    b, hh, ww, c = images.shape
    x = images.reshape(b, hh // p, p, ww // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (hh // p) * (ww // p), p * p * c)


def unpatchify(tokens, p: int, channels: int):
    """Inverse of `patchify` for square images: [b, g², p·p·C] → [b, g·p, g·p, C]."""
    b, s, _ = tokens.shape
    g = math.isqrt(s)
    x = tokens.reshape(b, g, g, p, p, channels).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, g * p, g * p, channels)


# ---------------------------------------------------------------------------------------- layers


class Dense(nnx.Module):
    """y = x @ w + b with w [d_in, d_out]; fp32 master weights cast to x's dtype.

    init: "xavier" (uniform, DiT's default), "zero" (adaLN-Zero and the output layer) or a float std."""

    def __init__(self, d_in: int, d_out: int, logical_axes, *, init="xavier", rngs: nnx.Rngs):
        if init == "zero":
            w = jnp.zeros((d_in, d_out), jnp.float32)
        elif init == "xavier":
            limit = math.sqrt(6.0 / (d_in + d_out))
            w = jax.random.uniform(rngs.params(), (d_in, d_out), jnp.float32, -limit, limit)
        else:
            w = jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32) * float(init)
        self.w = nnx.Param(w, logical_axes=logical_axes)
        self.b = bias_param((d_out,), (logical_axes[1],))

    def __call__(self, x):
        return x @ self.w[...].astype(x.dtype) + self.b[...].astype(x.dtype)


def _layer_norm(x, eps: float = 1e-6):
    """LayerNorm without affine parameters (adaLN supplies them), computed in fp32, result in x's dtype."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def _modulate(x, shift, scale):
    """x [b, s, h] · (1 + scale) + shift, with shift/scale [b, h] per image."""
    return x * (1 + scale[:, None]) + shift[:, None]


class TimestepEmbedder(nnx.Module):
    """t [b] → Linear(SiLU(Linear(sinusoid(1000·t)))) [b, hidden]; normal(0.02) init as in DiT."""

    def __init__(self, cfg: DiTConfig, *, rngs: nnx.Rngs):
        self.freq_dim = cfg.freq_dim
        self.fc1 = Dense(cfg.freq_dim, cfg.hidden, (None, "embed"), init=0.02, rngs=rngs)
        self.fc2 = Dense(cfg.hidden, cfg.hidden, ("embed", None), init=0.02, rngs=rngs)

    def __call__(self, t, dtype):
        features = timestep_features(1000.0 * t, self.freq_dim).astype(dtype)
        return self.fc2(jax.nn.silu(self.fc1(features)))


class LabelEmbedder(nnx.Module):
    """Class table [num_classes + 1, hidden]; row num_classes is the null class of classifier-free guidance."""

    def __init__(self, cfg: DiTConfig, *, rngs: nnx.Rngs):
        self.table = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.num_classes + 1, cfg.hidden)) * 0.02, logical_axes=(None, "embed")
        )

    def __call__(self, labels, dtype):
        return jnp.take(self.table[...].astype(dtype), labels, axis=0)


class DiTBlock(nnx.Module):
    """adaLN-Zero block: attention and MLP on modulated LayerNorms, each residual scaled by a gate."""

    def __init__(self, cfg: DiTConfig, *, rngs: nnx.Rngs):
        self.attn = Attention(cfg.hidden, cfg.num_heads, causal=False, rope=None, rngs=rngs)
        self.mlp = MLP(cfg.hidden, cfg.ffn_size, "gelu", rngs=rngs)
        self.adaLN = Dense(cfg.hidden, 6 * cfg.hidden, ("embed", None), init="zero", rngs=rngs)

    def __call__(self, x, c, positions, plan: ParallelPlan):
        """x: local [b, s, hidden] (the plan's activation layout), c: local [b, hidden] (the conditioning of
        this device's rows), positions: local int32 [b, s] (token layout)."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(
            self.adaLN(jax.nn.silu(c)), 6, axis=-1
        )
        x = x + gate_msa[:, None] * self.attn(_modulate(_layer_norm(x), shift_msa, scale_msa), positions, plan)
        return x + gate_mlp[:, None] * self.mlp(_modulate(_layer_norm(x), shift_mlp, scale_mlp), plan)


class FinalLayer(nnx.Module):
    """Linear(LN(x)·(1 + scale) + shift) → p·p·C per token; both linears zero-initialised."""

    def __init__(self, cfg: DiTConfig, *, rngs: nnx.Rngs):
        self.adaLN = Dense(cfg.hidden, 2 * cfg.hidden, ("embed", None), init="zero", rngs=rngs)
        self.linear = Dense(cfg.hidden, cfg.patch_dim, ("embed", None), init="zero", rngs=rngs)

    def __call__(self, x, c):
        shift, scale = jnp.split(self.adaLN(jax.nn.silu(c)), 2, axis=-1)
        return self.linear(_modulate(_layer_norm(x), shift, scale))


# ---------------------------------------------------------------------------------------- model


def check_plan(cfg: DiTConfig, plan: ParallelPlan, batch: int) -> None:
    """Raises (one line naming the value and the rule) when a `cfg` DiT cannot run on `plan` with micro-batches
    of `batch` images."""
    if not plan.tensor.whole_hidden:
        raise ValueError(
            f"the DiT cannot use tensor parallelism {plan.tensor.name!r}: its adaLN modulation needs whole "
            "hidden vectors, which it splits over devices; use a method that keeps them whole (megatron, metp)"
        )
    plan.tensor.check_model(
        plan, num_heads=cfg.num_heads, num_kv_heads=cfg.num_heads, hidden=cfg.hidden, ffn=cfg.ffn_size, vocab=None
    )
    plan.check_heads(cfg.num_heads, cfg.num_heads)
    plan.check_layers(cfg.num_layers)
    plan.check_batch(batch, "micro-batch size (batch / grad-accum)")
    plan.check_seq_len(cfg.num_tokens, causal=False)


class DiT(nnx.Module):
    """Class-conditional DiT predicting the flow-matching velocity; the plan is given at every call.

    The compute methods are *local* (inside the plan's shard_map, on this device's shards); `layers` is the
    block stack as the step materializes it (`Layers.of(model.blocks)` outside a train step).
    """

    STACK = "blocks"

    def __init__(self, cfg: DiTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_embed = Dense(cfg.patch_dim, cfg.hidden, (None, "embed"), rngs=rngs)
        self.t_embed = TimestepEmbedder(cfg, rngs=rngs)
        self.y_embed = LabelEmbedder(cfg, rngs=rngs)
        self.blocks = stack(lambda r: DiTBlock(cfg, rngs=r), cfg.num_layers, rngs)
        self.final = FinalLayer(cfg, rngs=rngs)

    # The forward in three parts (the pipeline cuts it there): embed, one block at a time, the final layer.
    def embed_patches(self, patches, t, labels, positions, plan: ParallelPlan, dtype=jnp.float32):
        """The carry entering the blocks: {"x": local [b, s, hidden] (activation layout), "c": the conditioning
        of this device's rows [b, hidden]}. patches: local [b, s, p·p·C] of x_t (activation layout); t: local
        fp32 [b]; labels: local int [b] (num_classes = the null class); positions: local int32 [b, s]."""
        cfg = self.cfg
        x = self.patch_embed(patches.astype(dtype))
        x = x + pos_embed_at(plan.tensor.activation_positions(plan, positions), cfg.hidden, cfg.grid, dtype)
        c = plan.tensor.local_vector(plan, self.t_embed(t, dtype) + self.y_embed(labels, dtype))
        return {"x": x, "c": c}

    @staticmethod
    def block_step(block: DiTBlock, carry, positions, plan: ParallelPlan):
        return {"x": block(carry["x"], carry["c"], positions, plan), "c": carry["c"]}

    def final_tokens(self, carry):
        """Predicted velocity per patch, local [b, s, p·p·C] (activation layout)."""
        return self.final(carry["x"], carry["c"])

    def velocity_tokens(
        self, patches, t, labels, positions, plan: ParallelPlan, layers: LayerScan, *, dtype=jnp.float32
    ):
        """Predicted velocity per patch, local [b, s, p·p·C] (activation layout, compute dtype)."""
        carry = self.embed_patches(patches, t, labels, positions, plan, dtype)
        carry = layers(carry, lambda block, carry: self.block_step(block, carry, positions, plan))
        return self.final_tokens(carry)

    def sample_t(self, key, batch: int):
        """Training times fp32 [batch]: U(0, 1) or logit-normal."""
        if self.cfg.time_sampling == "logit_normal":
            return jax.nn.sigmoid(jax.random.normal(key, (batch,), jnp.float32))
        return jax.random.uniform(key, (batch,), jnp.float32)


def flow_matching_inputs(cfg: DiTConfig, images, labels, key):
    """The rectified-flow training inputs of a batch, on global arrays (t, ε and the label dropout are drawn
    on the global shapes, so they are the same whatever the mesh).

    images [b, H, W, C] float (x0 in [-1, 1]); labels int [b]. Returns {"patches": patchify(x_t) [b, s, p·p·C],
    "target": patchify(ε - x0), "t": fp32 [b], "labels": int32 [b] (dropped to the null class with
    class_dropout), "positions": int32 [b, s]} with x_t = (1 − t)·x0 + t·ε."""
    images, labels = jnp.asarray(images), jnp.asarray(labels)
    shape = (cfg.image_size, cfg.image_size, cfg.channels)
    if images.ndim != 4 or tuple(images.shape[1:]) != shape:
        raise ValueError(
            f"images shape {tuple(images.shape)} must be [batch, {', '.join(map(str, shape))}] "
            f"(image_size × image_size × channels of the config)"
        )
    b = images.shape[0]
    if labels.shape != (b,) or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels {labels.dtype}{tuple(labels.shape)} must be integers of shape [batch] = ({b},)")
    k_t, k_eps, k_drop = jax.random.split(key, 3)
    if cfg.time_sampling == "logit_normal":
        t = jax.nn.sigmoid(jax.random.normal(k_t, (b,), jnp.float32))
    else:
        t = jax.random.uniform(k_t, (b,), jnp.float32)
    x0 = images.astype(jnp.float32)
    eps = jax.random.normal(k_eps, x0.shape, jnp.float32)
    drop = jax.random.uniform(k_drop, (b,)) < cfg.class_dropout
    labels = jnp.where(drop, cfg.num_classes, labels.astype(jnp.int32))
    x_t = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
    positions = jnp.broadcast_to(jnp.arange(cfg.num_tokens, dtype=jnp.int32), (b, cfg.num_tokens))
    return {
        "patches": patchify(x_t, cfg.patch_size),
        "target": patchify(eps - x0, cfg.patch_size),
        "t": t,
        "labels": labels,
        "positions": positions,
    }


@dataclasses.dataclass(frozen=True)
class FlowMatchingObjective(Objective):
    """The rectified-flow loss, mean over pixels of (v_θ(x_t, t, y) − (ε − x0))², of batches {"images" [b, H, W,
    C], "labels" int [b]}: what `jaxring.train.step.TrainStep` optimizes. t, ε and the label dropout are drawn
    from the step's key on global shapes (`flow_matching_inputs`), outside the shard_map."""

    cfg: DiTConfig
    batch_size: int

    def prepare(self, batch, key):
        return flow_matching_inputs(self.cfg, batch["images"], batch["labels"], key)

    def input_specs(self, plan: ParallelPlan) -> dict:
        return {
            "patches": plan.activation_spec(),
            "target": plan.activation_spec(),
            "t": plan.batch_spec(),
            "labels": plan.batch_spec(),
            "positions": plan.token_spec(),
        }

    @property
    def loss_count(self) -> int:
        return self.batch_size * self.cfg.num_tokens * self.cfg.patch_dim

    def embed(self, model: DiT, mb: dict, plan: ParallelPlan, dtype):
        return model.embed_patches(mb["patches"], mb["t"], mb["labels"], mb["positions"], plan, dtype)

    def layer(self, block: DiTBlock, carry, mb: dict, plan: ParallelPlan):
        return DiT.block_step(block, carry, mb["positions"], plan)

    def head(self, model: DiT, carry, mb: dict, plan: ParallelPlan, dtype):
        v = model.final_tokens(carry)
        return jnp.sum(jnp.square(v.astype(jnp.float32) - mb["target"])), {}


# ---------------------------------------------------------------------------------------- sampling


def sample(
    model: DiT, plan: ParallelPlan, labels, key, *, num_steps: int = 50, cfg_scale: float = 1.0, dtype=jnp.float32
):
    """Euler integration of dx/dt = v_θ from noise (t = 1) to data (t = 0) in `num_steps` uniform steps.

    With cfg_scale != 1 each step runs the batch twice (labels and the null class) and uses
    v = v_null + cfg_scale · (v_label − v_null). labels: int [b] in [0, num_classes]. The step is jitted once
    per (model structure, plan, guided or not, dtype) and reused across calls and steps; the velocity runs in
    the plan's shard_map with the weights placed as the tensor method says (no ZeRO sharding).
    Returns images float32 [b, H, W, C] clipped to [-1, 1].
    """
    cfg = model.cfg
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels {labels.dtype}{labels.shape} must be a 1-D integer array [batch]")
    if labels.size and (labels.min() < 0 or labels.max() > cfg.num_classes):
        raise ValueError(
            f"labels must lie in [0, num_classes = {cfg.num_classes}] (num_classes = null class); "
            f"got {labels.min()}..{labels.max()}"
        )
    if not isinstance(num_steps, (int, np.integer)) or num_steps < 1:
        raise ValueError(f"num_steps {num_steps!r} must be a positive integer")
    b = labels.shape[0]
    check_plan(cfg, plan, b)
    guided = float(cfg_scale) != 1.0
    if guided:
        plan.check_batch(2 * b, "guided batch (2 × labels)")

    graphdef, state = nnx.split(model)
    specs = weight_specs(state, plan)
    params = jax.device_put(
        nnx.to_pure_dict(state), jax.tree.map(lambda s: plan.sharding(s), specs, is_leaf=lambda x: isinstance(x, P))
    )
    step = euler_step(graphdef, plan, guided, jnp.dtype(dtype), freeze_specs(specs))
    x = _noise(plan, (b, cfg.image_size, cfg.image_size, cfg.channels))(key)
    labels = jax.device_put(jnp.asarray(labels, jnp.int32), plan.sharding(plan.batch_spec()))
    ts = np.linspace(1.0, 0.0, num_steps + 1, dtype=np.float32)
    scale = np.float32(cfg_scale)
    for i in range(num_steps):
        x = step(params, x, ts[i], ts[i] - ts[i + 1], labels, scale)
    return jnp.clip(x, -1.0, 1.0)


def freeze_specs(tree):
    """A tree of PartitionSpecs as a hashable tuple of (path, spec): a static argument of `euler_step`."""
    return tuple(jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, P))[0])


def _thaw(frozen):
    from flax.traverse_util import unflatten_dict

    return unflatten_dict({tuple(k.key for k in path): spec for path, spec in frozen})


def _images_sharding(plan: ParallelPlan):
    return plan.sharding(plan.batch_spec(4))


@functools.lru_cache(maxsize=32)
def _noise(plan: ParallelPlan, shape):
    """jit(key) → x_1 ~ N(0, 1) float32 `shape`, laid out as the step's output (so the step compiles once)."""
    return jax.jit(
        lambda key: jax.lax.with_sharding_constraint(jax.random.normal(key, shape, jnp.float32), _images_sharding(plan))
    )


def velocity_fn(graphdef, plan: ParallelPlan, dtype, specs):
    """velocity(params, x_t [b, H, W, C], t [b], labels [b]) -> v [b, H, W, C] on global arrays: the local
    model in the plan's shard_map (params placed as `specs`)."""

    def local(params, patches, t, labels, positions):
        m = nnx.merge(graphdef, params)
        return m.velocity_tokens(patches, t, labels, positions, plan, Layers.of(m.blocks), dtype=dtype)

    body = plan.shard_map(
        local,
        in_specs=(specs, plan.activation_spec(), plan.batch_spec(), plan.batch_spec(), plan.token_spec()),
        out_specs=plan.activation_spec(),
    )

    def velocity(params, x, t, labels):
        cfg = nnx.merge(graphdef, params).cfg
        positions = jnp.broadcast_to(jnp.arange(cfg.num_tokens, dtype=jnp.int32), (x.shape[0], cfg.num_tokens))
        v = body(params, patchify(x.astype(jnp.float32), cfg.patch_size), t, labels, positions)
        return unpatchify(v.astype(jnp.float32), cfg.patch_size, cfg.channels)

    return velocity


@functools.lru_cache(maxsize=32)
def euler_step(graphdef, plan: ParallelPlan, guided: bool, dtype, frozen_specs):
    """jit(params, x_t, t, dt, labels, cfg_scale) → x_{t−dt} = x_t − dt · v (guided: v from both label sets)."""
    velocity = velocity_fn(graphdef, plan, dtype, _thaw(frozen_specs))

    @jax.jit
    def step(params, x, t, dt, labels, cfg_scale):
        num_classes = nnx.merge(graphdef, params).cfg.num_classes
        tt = jnp.full((x.shape[0],), t, jnp.float32)
        if guided:
            both = jnp.concatenate([labels, jnp.full_like(labels, num_classes)])
            v = velocity(params, jnp.concatenate([x, x]), jnp.concatenate([tt, tt]), both)
            v_label, v_null = jnp.split(v, 2)
            v = v_null + cfg_scale * (v_label - v_null)
        else:
            v = velocity(params, x, tt, labels)
        return jax.lax.with_sharding_constraint(x - dt * v, _images_sharding(plan))

    return step


def save_image_grid(images, path, nrow: int = 8, padding: int = 2):
    """Writes images [n, H, W, C] (values in [-1, 1], C = 1 or 3) as a PNG grid, `nrow` images per row."""
    from PIL import Image

    images = np.asarray(images, np.float32)
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(f"images shape {images.shape} must be [n, H, W, C] with C = 1 or 3")
    if not isinstance(nrow, (int, np.integer)) or nrow < 1:
        raise ValueError(f"nrow {nrow!r} must be a positive integer")
    if images.shape[0] == 0:
        raise ValueError("images is empty: nothing to draw")
    n, h, w, c = images.shape
    cols, rows = min(nrow, n), -(-n // nrow)
    grid = np.zeros((rows * (h + padding) + padding, cols * (w + padding) + padding, c), np.uint8)
    pixels = np.round((np.clip(np.nan_to_num(images), -1, 1) + 1) * 127.5).astype(np.uint8)
    for i, img in enumerate(pixels):
        r, q = divmod(i, nrow)
        y, x = padding + r * (h + padding), padding + q * (w + padding)
        grid[y : y + h, x : x + w] = img
    Image.fromarray(grid[..., 0] if c == 1 else grid).save(path)  # uint8 2-D → "L", [.., 3] → "RGB"
    return path
