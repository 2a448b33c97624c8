"""Writing a GPT as a Hugging Face directory, and the rule for the directory an export goes to.

    save_pretrained(model, cfg, "out/")                             # config.json + sharded safetensors + index

Saving gathers one layer's tensor at a time, into a directory staged beside the target and renamed onto it.
"""

from __future__ import annotations

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
from flax.traverse_util import flatten_dict

from jaxring.eval import output_files
from jaxring.models.gpt import GPT, GPTConfig
from jaxring.models.hf.config import (
    CONFIG,
    INDEX,
    SAVE_DTYPES,
    TOKENIZER,
    WEIGHTS,
    CheckpointError,
    abstract_model,
    architecture_of,
    check_tokenizer,
    config_to_hf,
    hf_name,
)


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
