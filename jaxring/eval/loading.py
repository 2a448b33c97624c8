"""The model to evaluate: a jaxring checkpoint directory (`train.py --checkpoint-dir`) or a Hugging Face one.

A jaxring checkpoint's metadata names the model family ("kind") and its config; only the parameters are read
(orbax's partial restore: the optimizer state stays on disk), each straight onto its shards under the plan,
and their checksums are compared with the saved ones. A Hugging Face directory (it has a config.json) goes
through its family's `load_pretrained` entry point. Either may have config fields overridden (RoPE scaling).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxring.data.tokenizer import load_tokenizer
from jaxring.eval import finite
from jaxring.nn import param_shardings
from jaxring.parallel.plan import ParallelPlan
from jaxring.run.task import ModelFamily, model_family
from jaxring.train import checksum
from jaxring.train.checkpoint import Checkpointer

HF_CONFIG = "config.json"
HF_TOKENIZER = "tokenizer.json"


@dataclasses.dataclass
class LoadedModel:
    """model: the nnx module on the plan; config: its config; family: its ModelFamily; tokenizer: encode/decode
    of its data (bytes unless told); name: where it came from (shown in tables and JSON)."""

    model: Any
    config: Any
    family: ModelFamily
    tokenizer: Any
    name: str


def load_model(
    path: str,
    plan: ParallelPlan,
    *,
    family: str = "gpt",
    overrides: dict | None = None,
    tokenizer: str | None = None,
    step: int | None = None,
) -> LoadedModel:
    """The model at `path` placed on `plan`. family: the model family of a Hugging Face directory (a jaxring
        checkpoint names its own); overrides: config fields to change; tokenizer: "bytes" or a tokenizer.json
        (default: the directory's tokenizer.json, else the run's --tokenizer, else bytes); step: the checkpoint
        step (default: the newest). Errors (a missing directory, a damaged step, NaN or Inf in a parameter, named
    with its layer) are one-line ValueErrors."""
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint {path!r}: no such directory")
    if plan.pp > 1:
        raise ValueError(f"evaluation runs without a pipeline (pp = {plan.pp}); use a plan with pp = 1")
    if os.path.isfile(os.path.join(path, HF_CONFIG)):
        fam = model_family(family)
        if fam.load_pretrained is None:
            raise ValueError(f"model family {fam.name!r} cannot load a Hugging Face directory ({path})")
        model, config = fam.load_pretrained(path, plan, overrides or {})
        default_tok = os.path.join(path, HF_TOKENIZER) if os.path.isfile(os.path.join(path, HF_TOKENIZER)) else None
        return LoadedModel(model, config, fam, load_tokenizer(tokenizer or default_tok), path)
    return _load_jaxring(path, plan, overrides or {}, tokenizer, step)


def check_tokenizer_fits(loaded: LoadedModel) -> None:
    """The ids of `loaded`'s tokenizer must lie inside the model's vocabulary (the model's may be larger: padded);
    for text the evaluation tokenizes itself (perplexity checks its data's ids)."""
    vocab = getattr(loaded.config, "vocab_size", None)
    tok = loaded.tokenizer
    if vocab is not None and tok.vocab_size > vocab:
        raise ValueError(
            f"tokenizer {tok.describe()} has a vocabulary of {tok.vocab_size}, more than the vocab_size {vocab} of "
            f"the model {loaded.name}; give the model's own tokenizer (--tokenizer)"
        )


def checkpoint_metadata(path: str, step: int | None = None) -> tuple[int, dict]:
    """(step, metadata) of a jaxring checkpoint directory's step `step` (default: the newest); a directory
    with no saved steps or without that step is a one-line ValueError."""
    ckpt = Checkpointer(path, report=lambda _: None)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise ValueError(
                f"checkpoint {path!r}: neither a jaxring checkpoint directory (no saved steps) "
                f"nor a Hugging Face one (no {HF_CONFIG})"
            )
        if step is not None and step not in steps:
            raise ValueError(f"checkpoint {path!r} has no step {step}; saved steps: {steps}")
        step = steps[-1] if step is None else step
        return step, ckpt.metadata(step)
    finally:
        ckpt.close()


def _load_jaxring(path: str, plan: ParallelPlan, overrides: dict, tokenizer: str | None, step: int | None):
    step, metadata = checkpoint_metadata(path, step)
    saved = dict(metadata.get("model") or {})
    kind = saved.pop("kind", None)
    if kind is None:
        raise ValueError(f"checkpoint {path!r} step {step} records no model kind in its metadata")
    fam = model_family(kind)
    config = dataclasses.replace(fam.config_class(**saved), **overrides)
    abstract = nnx.eval_shape(lambda: fam.build(config, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shardings = param_shardings(state, plan)
    params = restore_params(os.path.join(path, str(step)), state, shardings)
    _check_finite(params, getattr(abstract, "STACK", None), f"checkpoint {path!r} step {step}")
    nnx.replace_by_pure_dict(state, params)
    run_tokenizer = (metadata.get("config") or {}).get("tokenizer")
    tok = load_tokenizer(tokenizer or run_tokenizer)
    return LoadedModel(nnx.merge(graphdef, state), config, fam, tok, f"{path} (step {step})")


def _check_finite(params: dict, stack: str | None, where: str) -> None:
    """One line naming the first parameter (and layer, in the stacked ones) that holds NaN or Inf."""
    bad = finite.nonfinite_tensors(params, stacked=lambda path: path[0] == stack)
    if bad:
        path, layer, nans, infs = bad[0]
        name = ".".join(map(str, path)) + ("" if layer is None else f" (layer {layer})")
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise ValueError(
            f"{where}: parameter {name} has {finite.describe_counts(nans, infs)}{more}; the checkpoint is damaged"
        )


def restore_params(step_dir: str, abstract_state: Any, shardings: dict) -> dict:
    """The "params" of a saved step (its `state` item), each array read onto `shardings`' shards; their
    checksums checked against the step's saved ones (a damaged file is a one-line ValueError)."""
    shapes = nnx.to_pure_dict(abstract_state)
    item = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
    args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), item)
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            os.path.abspath(os.path.join(step_dir, "state")),  # orbax takes absolute paths only
            args=ocp.args.PyTreeRestore(item={"params": item}, restore_args={"params": args}, partial_restore=True),
        )
    except Exception as e:  # orbax raises many kinds; the user sees one line
        detail = " ".join(str(e).split())[:240]
        raise ValueError(f"checkpoint {step_dir!r}: cannot read its parameters ({detail})") from None
    params = {"params": restored["params"]}
    saved = Checkpointer(os.path.dirname(step_dir), report=lambda _: None)
    try:
        sums = saved.checksums(int(os.path.basename(step_dir)))
    finally:
        saved.close()
    got = checksum.state_checksums(params)
    bad = checksum.mismatches({k: v for k, v in sums.items() if k in got}, got)
    if bad:
        raise ValueError(f"checkpoint {step_dir!r}: checksum mismatch in {', '.join(bad[:3])}")
    return restored["params"]
