"""Hugging Face causal-LM checkpoints in and out of `jaxring.models.gpt` (the Llama family by configuration).

    model, cfg = load_pretrained("path/to/Llama-3.1-8B", plan)   # config.json + safetensors, onto the plan
    out = logits(model, tokens, plan)                               # float32 [batch, seq, vocab], token order
    save_pretrained(model, cfg, "out/")                             # config.json + sharded safetensors + index

Supported architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.
Weights: PyTorch `Linear` stores [out, in], the transpose of our kernels [in, out]; the per-layer tensors
`model.layers.{i}.*` are stacked into our [layers, ...] parameters. Loading reads, for every device shard
of every parameter, only that shard's slice of the file (`safe_open(...).get_slice`), in runs of at most
READ_BYTES with the file mapped only during each run, so a process holds its devices' shards plus one run
(benchmarks/hf_loading.py measures it); saving gathers one layer's tensor at a time.
Every refusal is one `CheckpointError` line naming the file and the tensor or setting.

    python -m jaxring.models.hf export CHECKPOINT_DIR OUT_DIR [--step N]   # a training checkpoint (models/hf_export.py,
                                                                          # run by models/hf/__main__.py)
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import SingleDeviceSharding

from jaxring.core.mesh import make_mesh
from jaxring.eval import finite, output_files
from jaxring.models.gpt import GPT, GPTConfig
from jaxring.nn import Layers, param_shardings, weight_specs
from jaxring.parallel.plan import ParallelPlan

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


# ---------------------------------------------------------------------------------------- load


READ_BYTES = 16 * 2**20  # file bytes per read: loading holds the parameters' shards plus one such run


class CheckpointFiles:
    """The safetensors files of a checkpoint directory: which file holds each tensor, their dtypes and shapes
    (from the headers), and reads of a block of a tensor. Each read maps its file only while it copies one run
    of rows (at most READ_BYTES): a device's block strided across a tensor (ZeRO shards the hidden dim, the
    columns of a Linear's [out, in] weight) never keeps the whole tensor's pages resident, and nothing of a file
    stays mapped between reads."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self._open, self.path, self.headers = safe_open, path, {}
        index, single = os.path.join(path, INDEX), os.path.join(path, WEIGHTS)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    self.weight_map = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e})") from None
        elif os.path.exists(single):
            self.weight_map = dict.fromkeys(self._header(WEIGHTS), WEIGHTS)
        else:
            raise CheckpointError(f"{path}: neither {WEIGHTS} nor {INDEX} found")

    def _header(self, file: str) -> dict:
        """{tensor name: (safetensors dtype, shape)} of one file (its header only; no tensor data is read)."""
        if file not in self.headers:
            full = os.path.join(self.path, file)
            if not os.path.exists(full):
                raise CheckpointError(f"{full}: missing (named by {INDEX})")
            try:
                with self._open(full, framework="numpy") as f:
                    slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118
                    self.headers[file] = {n: (s.get_dtype(), tuple(s.get_shape())) for n, s in slices.items()}
            except Exception as e:  # safetensors raises its own errors for truncated or corrupt headers
                raise CheckpointError(f"{full}: not a readable safetensors file ({e})") from None
        return self.headers[file]

    def info(self, name: str) -> tuple[str, tuple[int, ...], str]:
        """(safetensors dtype, shape, file path) of tensor `name`."""
        if name not in self.weight_map:
            raise CheckpointError(f"{self.path}: tensor {name} missing")
        file = self.weight_map[name]
        header = self._header(file)
        if name not in header:
            raise CheckpointError(f"{os.path.join(self.path, file)}: tensor {name} missing (named by {INDEX})")
        return (*header[name], os.path.join(self.path, file))

    def read(self, name: str, index: tuple, out: np.ndarray) -> None:
        """out[...] = tensor `name`[index] (explicit slices, one per dim), read in runs of rows of at most
        READ_BYTES of the file, each through its own memory map."""
        dtype, shape, file = self.info(name)
        if not index:
            index = tuple(slice(0, n) for n in shape)
        rows, rest = index[0], index[1:]
        row_bytes = np.dtype(FLOAT_DTYPES[dtype]).itemsize * math.prod(shape[1:])
        step = max(1, READ_BYTES // max(row_bytes, 1))
        for r in range(rows.start, rows.stop, step):
            stop = min(r + step, rows.stop)
            try:
                with self._open(file, framework="numpy") as f:
                    out[r - rows.start : stop - rows.start] = f.get_slice(name)[(slice(r, stop), *rest)]
            except Exception as e:
                raise CheckpointError(f"{file}: tensor {name} unreadable ({e})") from None


def _read_block(
    files: CheckpointFiles, pattern: str, transposed: bool, stacked: bool, index: tuple, dtype
) -> np.ndarray:
    """Our parameter's block `index` (explicit slices of our layout) read from the HF tensors."""
    inner = index[1:] if stacked else index
    hf_index = tuple(reversed(inner)) if transposed else tuple(inner)
    layers = range(index[0].start, index[0].stop) if stacked else (None,)
    out = np.empty(((len(layers),) if stacked else ()) + tuple(s.stop - s.start for s in inner), dtype)
    for k, i in enumerate(layers):
        dest = out[k] if stacked else out
        files.read(pattern.format(i=i), hf_index, dest.T if transposed else dest)
    return out


def _check_tensor(files: CheckpointFiles, name: str, want: tuple):
    dtype, shape, file = files.info(name)
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}; expected one of {', '.join(FLOAT_DTYPES)}")
    if shape != want:
        raise CheckpointError(f"{file}: tensor {name} has shape {list(shape)}; expected {list(want)}")


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


def load_pretrained(
    path: str, plan: ParallelPlan | None = None, *, dtype=None, overrides: dict | None = None
) -> tuple[GPT, GPTConfig]:
    """The model of a Hugging Face checkpoint directory, each parameter placed on its shards under `plan`
    (as `jaxring.nn.param_shardings` lays it out: tensor method, ZeRO-3, pp stages; None: one device).

    dtype: the parameters' dtype (default float32). Every tensor's presence, shape and dtype is checked before
    any is read (and a tokenizer.json beside it against vocab_size), so a bad checkpoint fails in one line
    before anything is placed. overrides: GPTConfig fields changed from config.json's that keep every
    parameter's shape (RoPE scaling for context extension).

    The layer stack is in the checkpoint's (natural) layer order. A plan whose pipeline schedule stores its
    stack in another order (`plan.layer_order(num_layers)` not None: interleaved stages) is reordered by the
    training loop; code that calls the plan's step itself applies `stack[plan.layer_order(n)]` first."""
    cfg = read_config(path)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    tokenizer = os.path.join(path, TOKENIZER)
    if os.path.exists(tokenizer):
        check_tokenizer(tokenizer, cfg.vocab_size, os.path.join(path, CONFIG))
    files = CheckpointFiles(path)
    dtype = jnp.dtype(dtype or jnp.float32)
    graphdef, state = abstract_model(cfg)
    if plan is None:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, nnx.to_pure_dict(state))
    else:
        shardings = param_shardings(state, plan)
    flat_shapes = flatten_dict(nnx.to_pure_dict(state))
    flat_shardings = flatten_dict(shardings)
    for path_, var in flat_shapes.items():  # everything checked before anything is read
        pattern, transposed, stacked = hf_name(path_)
        shape = tuple(var.shape[1:] if stacked else var.shape)
        want = tuple(reversed(shape)) if transposed else shape
        for i in range(cfg.num_layers if stacked else 1):
            _check_tensor(files, pattern.format(i=i), want)
    loaded = {}
    for path_, var in flat_shapes.items():
        pattern, transposed, stacked = hf_name(path_)
        read = lambda index, p=pattern, t=transposed, s=stacked, v=var: _read_block(
            files, p, t, s, _full(index, v), dtype
        )
        loaded[path_] = jax.make_array_from_callback(tuple(var.shape), flat_shardings[path_], read)
    _check_finite(files, unflatten_dict(loaded))
    nnx.replace_by_pure_dict(state, unflatten_dict(loaded))
    model = nnx.merge(graphdef, state)
    model.hf_tokenizer = tokenizer if os.path.exists(tokenizer) else None  # copied again by save_pretrained
    return model, cfg


def _check_finite(files: CheckpointFiles, params: dict) -> None:
    """DamagedWeights naming the first HF tensor (and its file) that holds NaN or Inf: one reduction per
    parameter on its devices, per layer for the stacked ones."""
    bad = finite.nonfinite_tensors(params, stacked=lambda path: hf_name(path)[2])
    if not bad:
        return
    path_, layer, nans, infs = bad[0]
    name = hf_name(path_)[0].format(i=layer)
    more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    detail = f"tensor {name} has {finite.describe_counts(nans, infs)}{more}; the checkpoint is damaged"
    raise DamagedWeights(files.path, f"{detail} ({os.path.basename(files.info(name)[2])})")


def _full(index, var) -> tuple:
    """A shard index with every slice explicit (None bounds filled from the shape)."""
    return tuple(slice(*s.indices(n)) for s, n in zip(index, var.shape)) if index else ()


# ---------------------------------------------------------------------------------------- logits


def logits(model: GPT, tokens, plan: ParallelPlan | None = None) -> np.ndarray:
    """float32 [batch, seq, vocab] of int32 tokens [batch, seq] (one global array, natural order), run as the
    plan's SPMD program (its layout inside; the result in token order). plan=None: one device. The final
    hidden states come out of the shard_map in the plan's activation layout; the head is applied on them."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be int [batch, seq]; got {tokens.dtype} {list(tokens.shape)}")
    cfg = model.cfg
    if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
        raise ValueError(
            f"token ids must lie in [0, vocab_size = {cfg.vocab_size}); got {tokens.min()}..{tokens.max()}"
        )
    if plan is None:
        plan = ParallelPlan(make_mesh(devices=jax.devices()[:1]))
    if plan.pp > 1:
        raise ValueError(f"logits runs without a pipeline (pp = {plan.pp}); load the model on a plan with pp = 1")
    b, s = tokens.shape
    (laid,), positions = plan.layout_tokens(tokens.astype(np.int32), causal=True)
    graphdef, state = nnx.split(model)
    specs = weight_specs(state, plan)
    pos = np.broadcast_to(positions, (b, s)).astype(np.int32)

    def local(params, tokens, positions):
        m = nnx.merge(graphdef, params)
        return m.features(tokens, positions, plan, Layers.of(m.blocks))

    features = jax.jit(
        plan.shard_map(local, in_specs=(specs, plan.token_spec(), plan.token_spec()), out_specs=plan.activation_spec())
    )(nnx.to_pure_dict(state), laid, pos)
    w, tied = model.head_weight(jnp.float32)
    out = np.asarray(jax.jit(lambda x, w: x @ (w.T if tied else w))(features, w), np.float32)
    perm = plan.token_permutation(s, causal=True)
    if perm is not None:
        out = out[:, np.argsort(perm)]
    return out


# ---------------------------------------------------------------------------------------- save


def size_bytes(size) -> int:
    """Bytes of a shard size: an int, or text such as '5GB', '500MB', '2GiB' (max_shard_size's forms)."""
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    text = str(size).strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * units[unit])
            except ValueError:
                break
    raise ValueError(f"max_shard_size {size!r}: expected bytes or a size such as '5GB' or '500MB'")


EXPORT_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def is_export_file(name: str) -> bool:
    """A file name save_pretrained writes (config.json, the index, the shards, tokenizer.json, or a single
    model.safetensors): a directory of only these, with a config.json, is an earlier export."""
    return name in (CONFIG, INDEX, WEIGHTS, TOKENIZER) or EXPORT_SHARD.fullmatch(name) is not None


def is_export_dir(path: str) -> bool:
    """`path` is a directory holding an earlier export: a config.json and only files an export writes."""
    entries = os.listdir(path) if os.path.isdir(path) else []
    return CONFIG in entries and all(is_export_file(e) for e in entries)


def check_export_dir(path: str, overwrite: bool, flag: str = "path", overwrite_flag: str = "overwrite=True") -> None:
    """The rule for the directory an export goes to (one line, a CheckpointError): new, empty, or an earlier
    export that `overwrite` allows to replace; never a directory of other files."""
    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise CheckpointError(f"{flag} {path!r} exists and is not a directory")
    entries = sorted(os.listdir(path))
    if not entries:
        return
    others = [e for e in entries if not is_export_file(e)]
    if others or CONFIG not in entries:
        shown = ", ".join((others or entries)[:3]) + (", ..." if len(others or entries) > 3 else "")
        raise CheckpointError(
            f"{flag} {path!r} holds files that are not an export ({shown}); give a new or empty directory"
        )
    if not overwrite:
        raise CheckpointError(
            f"{flag} {path!r} holds an earlier export ({CONFIG}, safetensors); pass {overwrite_flag} to replace it, "
            f"or give a new directory"
        )


def export_bytes(cfg: GPTConfig, dtype: str) -> int:
    """The bytes of the tensors save_pretrained writes for `cfg` in `dtype` (SAVE_DTYPES' names)."""
    _, state = abstract_model(cfg)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.to_pure_dict(state)))
    return count * jnp.dtype(SAVE_DTYPES[dtype]).itemsize


def check_export(cfg: GPTConfig, path: str, dtype: str, *, overwrite: bool, flag: str, overwrite_flag: str) -> None:
    """Everything about an export that can fail, said before the work that produces the model (one line, a
    ValueError): an architecture Hugging Face stores (`architecture_of`, the exporter's own rule), the directory
    (`check_export_dir`), that this process can write there and that its filesystem has room for the tensors."""
    try:
        architecture_of(cfg)
    except CheckpointError as e:
        raise CheckpointError(f"{flag} {path!r}: {e}; nothing can be exported") from None
    check_export_dir(path, overwrite, flag, overwrite_flag)
    output_files.check_output_dir(path, flag)
    output_files.check_free_space(path, export_bytes(cfg, dtype), flag, f"the export ({dtype})")


def _write_tensors(data: dict, file: str) -> None:
    """safetensors' save_file, its write failures (a SafetensorError on a full disk) raised as OSError."""
    from safetensors.numpy import save_file

    try:
        save_file(data, file, metadata={"format": "pt"})
    except OSError:
        raise
    except Exception as e:
        text = " ".join(str(e).split())
        code = re.search(r"(?:code: |os error )(\d+)", text)  # the OS error inside safetensors' message
        raise OSError(int(code.group(1)) if code else errno.EIO, f"{os.path.basename(file)}: {text}") from None


def save_pretrained(
    model: GPT,
    cfg: GPTConfig,
    path: str,
    *,
    max_shard_size="5GB",
    tokenizer: str | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Writes `config.json`, `model-0000k-of-0000n.safetensors` (each at most max_shard_size, one tensor
    possibly more) and `model.safetensors.index.json`; copies `tokenizer` (a tokenizer.json; default: the one
    of the directory the model was loaded from, if any). dtype: "float32", "bfloat16" or "float16", the
    tensors' dtype in the files and config.json's `dtype`/`torch_dtype` (default: the parameters' own).
    Gathered one HF tensor (one layer's slice) at a time. Returns the list of files written.

    `path` must be new, empty, or (with overwrite=True) an earlier export (`check_export_dir`). The files are
    written into a hidden directory beside `path`, renamed onto it when all are written: a failed write (an
    OSError, e.g. a full disk) or an interrupt leaves `path` as it was and no partial files."""
    limit = size_bytes(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size {max_shard_size!r} must be positive")
    state = nnx.to_pure_dict(nnx.state(model))
    if dtype is None:
        own = {jnp.dtype(a.dtype).name for a in jax.tree.leaves(state)}
        dtype = own.pop() if len(own) == 1 else "float32"
    dtype = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save_pretrained dtype {dtype!r}: expected one of {', '.join(SAVE_DTYPES)}")
    np_dtype = jnp.dtype(SAVE_DTYPES[dtype])
    hf = config_to_hf(cfg, dtype)
    tokenizer = tokenizer or getattr(model, "hf_tokenizer", None)
    if tokenizer is not None:
        check_tokenizer(tokenizer, cfg.vocab_size, "the model's config")
    check_export_dir(path, overwrite)
    tensors = []  # (HF name, a function producing it as numpy)
    for path_, arr in flatten_dict(state).items():
        pattern, transposed, stacked = hf_name(path_)
        nbytes = np_dtype.itemsize * math.prod(arr.shape[1 if stacked else 0 :])
        for i in range(arr.shape[0] if stacked else 1):
            get = lambda a=arr, i=i, st=stacked, t=transposed: _gather(a[i] if st else a, t).astype(
                np_dtype, copy=False
            )
            tensors.append((pattern.format(i=i), get, nbytes))
    tensors.sort(key=lambda t: file_order_key(t[0]))
    shards, current, size = [], [], 0
    for name, get, nbytes in tensors:
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append((name, get))
        size += nbytes
    shards.append(current)
    weight_map, written, total = {}, [], 0
    with output_files.staged_directory(path, replace=overwrite) as staged:
        for k, shard in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            data = {name: get() for name, get in shard}  # one shard's tensors on the host at a time
            total += sum(a.nbytes for a in data.values())
            _write_tensors(data, os.path.join(staged, file))
            weight_map.update(dict.fromkeys(data, file))
            written.append(file)
        with open(os.path.join(staged, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(staged, CONFIG), "w") as f:
            json.dump(hf, f, indent=2)
        written += [INDEX, CONFIG]
        if tokenizer is not None:
            shutil.copyfile(tokenizer, os.path.join(staged, TOKENIZER))
            written.append(TOKENIZER)
    return written


def to_hf_tensors(tree: dict) -> dict:
    """{HF tensor name: numpy array} of a tree shaped like `nnx.to_pure_dict(nnx.state(model))` (parameters or
    their gradients), gathered whole: for small models and tests."""
    out = {}
    for path_, arr in flatten_dict(tree).items():
        pattern, transposed, stacked = hf_name(path_)
        for i in range(arr.shape[0] if stacked else 1):
            out[pattern.format(i=i)] = _gather(arr[i] if stacked else arr, transposed)
    return out


def _gather(arr, transposed: bool) -> np.ndarray:
    out = np.asarray(jax.device_get(arr))
    return np.ascontiguousarray(out.T if transposed else out)


def file_order_key(name: str):
    """Embedding first, then layer by layer, then the final norm and the head."""
    parts = name.split(".")
    if "layers" in parts:
        return (1, int(parts[2]), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


__all__ = [
    "ARCHITECTURES",
    "CheckpointError",
    "DamagedWeights",
    "abstract_model",
    "check_export",
    "check_export_dir",
    "check_tokenizer",
    "config_from_hf",
    "config_to_hf",
    "export_bytes",
    "file_order_key",
    "hf_name",
    "is_export_dir",
    "is_export_file",
    "load_pretrained",
    "logits",
    "save_pretrained",
    "size_bytes",
    "to_hf_tensors",
]
