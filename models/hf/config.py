"""The Hugging Face side of a GPT's description: config.json <-> `GPTConfig`, the tensor names <-> our parameter
paths, a tokenizer.json against the vocabulary, and the errors every part of `jaxring.models.hf` raises.

Supported architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.
Weights: PyTorch `Linear` stores [out, in], the transpose of our kernels [in, out]; the per-layer tensors
`model.layers.{i}.*` are stacked into our [layers, ...] parameters (`hf_name`).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxring.models.gpt import GPT, GPTConfig

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MODEL_TYPES = dict(zip(ARCHITECTURES, ("llama", "mistral", "qwen2", "qwen3")))
CONFIG, WEIGHTS, INDEX, TOKENIZER = "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json"
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}
SAVE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": jnp.bfloat16}  # config.json's names


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read or written as asked (one line: the file and the tensor)."""


class DamagedWeights(CheckpointError):
    """A tensor of a checkpoint holds NaN or Inf. `detail`: the message without the directory, for a caller
    that names the directory by its flag ("--init-from X: tensor ... has 12 NaN values; ...")."""

    def __init__(self, path: str, detail: str):
        super().__init__(f"{path}: {detail}")
        self.detail = detail


# ---------------------------------------------------------------------------------------- config.json


def _rope_settings(hf: dict, where: str) -> dict:
    """GPTConfig's rope_* fields from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    if hf.get("rope_scaling"):
        params = {**dict(hf["rope_scaling"]), **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind not in ("linear", "llama3", "yarn"):
        raise CheckpointError(f"{where}: rope type {kind!r} is not supported (default, linear, llama3, yarn)")
    if kind == "yarn" and (params.get("mscale") or params.get("mscale_all_dim") or params.get("truncate") is False):
        raise CheckpointError(f"{where}: yarn with mscale/mscale_all_dim/truncate=false is not supported")
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and kind == "yarn" and original:
        factor = hf["max_position_embeddings"] / original
    if factor is None:
        raise CheckpointError(f"{where}: rope type {kind} needs 'factor'")
    out.update(rope_scaling=kind, rope_factor=float(factor))
    if kind in ("llama3", "yarn"):
        out["rope_original_max_positions"] = int(original or hf["max_position_embeddings"])
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]))
        out.update(rope_high_freq_factor=float(params["high_freq_factor"]))
    if kind == "yarn":
        out.update(
            rope_beta_fast=float(params.get("beta_fast") or 32), rope_beta_slow=float(params.get("beta_slow") or 1)
        )
        if params.get("attention_factor") is not None:
            out["rope_attention_factor"] = float(params["attention_factor"])
    return out


def config_from_hf(hf: dict, where: str = CONFIG) -> GPTConfig:
    """A GPTConfig from a Hugging Face config.json's dict (one of ARCHITECTURES)."""
    archs = hf.get("architectures") or []
    arch = archs[0] if len(archs) == 1 else None
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{where}: architectures {archs!r} not supported; expected one of {', '.join(ARCHITECTURES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {hf['hidden_act']!r} not supported (silu: SwiGLU)")
    try:
        bias = bool(hf.get("attention_bias", False))
        window = hf.get("sliding_window") if arch == "MistralForCausalLM" else None
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and hf.get("use_sliding_window"):
            raise CheckpointError(f"{where}: use_sliding_window (per-layer windows of Qwen) is not supported")
        return GPTConfig(
            vocab_size=int(hf["vocab_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            hidden=int(hf["hidden_size"]),
            num_heads=int(hf["num_attention_heads"]),
            num_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            head_dim=int(hf["head_dim"]) if hf.get("head_dim") else None,
            ffn=int(hf["intermediate_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", 4096)),
            positions="rope",
            activation="swiglu",
            norm="rmsnorm",
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bias,
            proj_bias=bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(window) if window else None,
            **_rope_settings(hf, where),
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: missing setting {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{where}: {e}") from None


def architecture_of(cfg: GPTConfig) -> str:
    """The HF architecture that stores `cfg` (raises when none does)."""
    problems = [
        f"{name} {getattr(cfg, name)!r}"
        for name, want in (("positions", "rope"), ("activation", "swiglu"), ("norm", "rmsnorm"))
        if getattr(cfg, name) != want
    ]
    if cfg.num_experts is not None:
        problems.append(f"num_experts {cfg.num_experts}")
    if problems:
        raise CheckpointError(f"no Hugging Face architecture stores a GPT with {', '.join(problems)}")
    if cfg.qk_norm:
        arch = "Qwen3ForCausalLM"
    elif cfg.qkv_bias and not cfg.proj_bias:
        arch = "Qwen2ForCausalLM"
    elif cfg.sliding_window:
        arch = "MistralForCausalLM"
    else:
        arch = "LlamaForCausalLM"
    biased = cfg.qkv_bias or cfg.proj_bias
    if (arch != "Qwen2ForCausalLM" and cfg.qkv_bias != cfg.proj_bias) or (
        arch in ("MistralForCausalLM", "Qwen2ForCausalLM")
        and (cfg.mlp_bias or (arch == "MistralForCausalLM" and biased))
    ):
        raise CheckpointError(
            f"{arch} cannot store qkv_bias={cfg.qkv_bias}, proj_bias={cfg.proj_bias}, mlp_bias={cfg.mlp_bias}"
        )
    if cfg.sliding_window and arch != "MistralForCausalLM":
        raise CheckpointError(f"{arch} with sliding_window {cfg.sliding_window} is not supported")
    return arch


def config_to_hf(cfg: GPTConfig, dtype: str = "float32") -> dict:
    """The config.json dict of `cfg` (transformers 5 form, `rope_parameters`; rope_theta also at top level) whose
    tensors are stored in `dtype` (`dtype`, and `torch_dtype` as transformers 4 reads it)."""
    arch = architecture_of(cfg)
    rope = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = cfg.rope_original_max_positions
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    if cfg.rope_scaling == "yarn":
        rope.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
        if cfg.rope_attention_factor is not None:
            rope["attention_factor"] = cfg.rope_attention_factor
    hf = {
        "architectures": [arch],
        "model_type": MODEL_TYPES[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads,
        "head_dim": cfg.attn_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        hf["attention_bias"] = cfg.qkv_bias
    if arch == "LlamaForCausalLM":
        hf["mlp_bias"] = cfg.mlp_bias
    if arch == "MistralForCausalLM":
        hf["sliding_window"] = cfg.sliding_window
    return hf


# ---------------------------------------------------------------------------------------- tensor names

_LAYER = "model.layers.{i}."
_NAMES = {  # our parameter path -> (HF name, transposed)
    ("embed", "table"): ("model.embed_tokens.weight", False),
    ("ln_f", "scale"): ("model.norm.weight", False),
    ("head",): ("lm_head.weight", True),
    ("blocks", "ln1", "scale"): (_LAYER + "input_layernorm.weight", False),
    ("blocks", "ln2", "scale"): (_LAYER + "post_attention_layernorm.weight", False),
    ("blocks", "attn", "wq"): (_LAYER + "self_attn.q_proj.weight", True),
    ("blocks", "attn", "wk"): (_LAYER + "self_attn.k_proj.weight", True),
    ("blocks", "attn", "wv"): (_LAYER + "self_attn.v_proj.weight", True),
    ("blocks", "attn", "wo"): (_LAYER + "self_attn.o_proj.weight", True),
    ("blocks", "attn", "bq"): (_LAYER + "self_attn.q_proj.bias", False),
    ("blocks", "attn", "bk"): (_LAYER + "self_attn.k_proj.bias", False),
    ("blocks", "attn", "bv"): (_LAYER + "self_attn.v_proj.bias", False),
    ("blocks", "attn", "bo"): (_LAYER + "self_attn.o_proj.bias", False),
    ("blocks", "attn", "q_norm"): (_LAYER + "self_attn.q_norm.weight", False),
    ("blocks", "attn", "k_norm"): (_LAYER + "self_attn.k_norm.weight", False),
    ("blocks", "mlp", "w_gate"): (_LAYER + "mlp.gate_proj.weight", True),
    ("blocks", "mlp", "w_in"): (_LAYER + "mlp.up_proj.weight", True),
    ("blocks", "mlp", "w_out"): (_LAYER + "mlp.down_proj.weight", True),
    ("blocks", "mlp", "b_gate"): (_LAYER + "mlp.gate_proj.bias", False),
    ("blocks", "mlp", "b_in"): (_LAYER + "mlp.up_proj.bias", False),
    ("blocks", "mlp", "b_out"): (_LAYER + "mlp.down_proj.bias", False),
}


def hf_name(path: tuple) -> tuple[str, bool, bool]:
    """(HF name pattern, transposed, stacked over layers) of our parameter at `path`."""
    if path not in _NAMES:
        raise CheckpointError(f"parameter {'.'.join(path)} has no Hugging Face name")
    name, transposed = _NAMES[path]
    return name, transposed, path[0] == "blocks"


def abstract_model(cfg: GPTConfig):
    """(graphdef, abstract state) of a GPT of `cfg`: shapes only, nothing allocated."""
    return nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))


def read_config(path: str) -> GPTConfig:
    """The GPTConfig of a Hugging Face checkpoint directory (its config.json)."""
    file = os.path.join(path, CONFIG)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory")
    try:
        with open(file) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return config_from_hf(hf, file)


def check_tokenizer(file: str, vocab_size: int, config: str = CONFIG) -> int:
    """The number of ids of the tokenizer.json `file` (read with `tokenizers`, added tokens counted); more
    than the model's `vocab_size` is a one-line CheckpointError (fewer is fine: checkpoints pad the embedding)."""
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(file).get_vocab_size(with_added_tokens=True)
    except Exception as e:
        raise CheckpointError(f"{file}: not a readable tokenizer.json ({' '.join(str(e).split())})") from None
    if size > vocab_size:
        raise CheckpointError(
            f"{file}: the tokenizer has a vocabulary of {size}, more than the vocab_size {vocab_size} of {config}; "
            f"its ids past {vocab_size - 1} have no embedding"
        )
    return size
