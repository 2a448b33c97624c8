"""Loading a Hugging Face checkpoint directory onto a plan, and the logits of a loaded model.

    model, cfg = load_pretrained("path/to/Llama-3.1-8B", plan)   # config.json + safetensors, onto the plan
    out = logits(model, tokens, plan)                               # float32 [batch, seq, vocab], token order

Loading reads, for every device shard of every parameter, only that shard's slice of the file
(`safe_open(...).get_slice`), in runs of at most READ_BYTES with the file mapped only during each run, so a
process holds its devices' shards plus one run (benchmarks/hf_loading.py measures it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import SingleDeviceSharding

from jaxring.core.mesh import make_mesh
from jaxring.eval import finite
from jaxring.models.gpt import GPT, GPTConfig
from jaxring.models.hf.config import (
    CONFIG,
    FLOAT_DTYPES,
    INDEX,
    TOKENIZER,
    WEIGHTS,
    CheckpointError,
    DamagedWeights,
    abstract_model,
    check_tokenizer,
    hf_name,
    read_config,
)
from jaxring.nn import Layers, param_shardings, weight_specs
from jaxring.parallel.plan import ParallelPlan

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
