"""How the library sees a model: an objective in three local parts, and a model family it can train and plan.

jaxring never imports a model package. A model family (`models/gpt.py`'s GPT, `models/dit.py`'s DiT, or
your own) is a `ModelFamily`, found by name through the `jaxring.models` entry-point group of the installed
packages (pyproject: `[project.entry-points."jaxring.models"] gpt = "jaxring.models.gpt:FAMILY"`) or registered
in-process with `register_family`. The training loop, the run specification's checks and the planner use
only what is declared here.

An objective (e.g. `jaxring.models.gpt.NextTokenObjective`) gives, on this device's shards inside the step's
shard_map:

  embed(model, mb, plan, dtype) -> carry          the first stage: tokens/patches to the residual stream
  layer(block, carry, mb, plan) -> carry          one block of the stack (the carry keeps its shapes)
  head(model, carry, mb, plan, dtype) -> (loss_sum, aux)
                                                  the last stage: this device's sum of per-element losses;
                                                  aux: fp32 scalars already over the whole micro-batch (the
                                                  same on every device), "extra_loss" (e.g. MoE balance) a
                                                  term of the objective, the others metrics
  prepare(batch, key) -> inputs, input_specs(plan), loss_count

The train step composes them over a whole `Layers` stack; the pipeline (`jaxring.parallel.pipeline`) runs embed on its
first virtual stage, chunks of the stack on every stage and head on the last.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import yaml

from jaxring.core.suggest import nearest

if TYPE_CHECKING:
    import jax

    from jaxring.parallel.plan import ParallelPlan

__all__ = [
    "ENTRY_POINT_GROUP",
    "ModelFamily",
    "Objective",
    "Task",
    "model_families",
    "model_family",
    "register_family",
]

ENTRY_POINT_GROUP = "jaxring.models"


class Objective:
    def prepare(self, batch: Any, key: jax.Array) -> Any:
        """The step's inputs from a batch (global arrays, outside the shard_map); default: the batch itself."""
        del key
        return batch

    def input_specs(self, plan: ParallelPlan) -> dict:
        raise NotImplementedError

    @property
    def loss_count(self) -> int:
        raise NotImplementedError

    def embed(self, model: Any, mb: Any, plan: ParallelPlan, dtype: jax.typing.DTypeLike) -> Any:
        raise NotImplementedError

    def layer(self, block: Any, carry: Any, mb: Any, plan: ParallelPlan) -> Any:
        raise NotImplementedError

    def head(self, model: Any, carry: Any, mb: Any, plan: ParallelPlan, dtype: jax.typing.DTypeLike) -> Any:
        raise NotImplementedError


class Task:
    """A training run's model and data, as the loop (`jaxring.train`) drives it: a family's task subclasses it
    and implements the required methods; the optional hooks have defaults that do nothing.

    config: the model's config; objective: its `Objective`; progress: metric names for the progress bar;
    source_name: what the data is (shown in the run's header).
    """

    config: Any
    objective: Objective
    progress: tuple[str, ...] = ()
    source_name: str = ""

    # ---------------------------------------------------------------- required
    def model(self, seed: int) -> Any:
        """The nnx model (the same for a seed on any mesh), with a STACK attribute."""
        raise NotImplementedError

    def batch(self, step: int, val: bool = False) -> dict:
        """Global arrays for `step` (a pure function of it)."""
        raise NotImplementedError

    @property
    def tokens_per_step(self) -> int:
        raise NotImplementedError

    def flops_per_step(self) -> float:
        raise NotImplementedError

    def metadata(self) -> dict:
        """What a checkpoint must match to be restored (the model's config)."""
        raise NotImplementedError

    def finish(self, model: Any, log: Callable[[str], None], out_dir: str) -> dict:
        """Samples after training."""
        raise NotImplementedError

    # ---------------------------------------------------------------- optional hooks
    def export(self, model: Any, log: Callable[[str], None]) -> None:
        """Writes the trained model where the run asks (gpt: --export-hf); default: nothing."""

    def check_validation_data(self) -> None:
        """Raises (one line) on held-out data the model cannot read, before the first step; default: nothing."""

    def data_state(self) -> dict | None:
        """The data loader's position, kept in a checkpoint's metadata (JSON); default: None (none kept)."""
        return None

    def restore_data_state(self, state: dict | None, step: int, log: Callable[[str], None]) -> None:
        """Continues the data loader from a checkpoint's `data_state` at `step`; default: nothing."""


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """A model the library can train, validate and plan, described by functions (see the module docstring).

    name, summary; causal: its attention is causal (the data-side layout balances it); config_class: a
    frozen dataclass; presets: {name: config};
    build(config, rngs) -> nnx module with a STACK attribute naming its scanned layer stack;
    objective(config, batch, seq_len) -> Objective;
    check_plan(config, plan, batch, seq_len): one-line ValueError when the model cannot run on the plan;
    tokens(config, seq_len) -> tokens per sequence (a GPT: seq_len; a DiT: its patches);
    flops_per_step(config, seq_len, batch) -> model FLOPs of one step (MFU, the planner);
    abstract_batch(config, plan, batch, seq_len) -> {name: jax.ShapeDtypeStruct} of one global batch;
    task(spec, plan) -> Task: the model with its data, for `jaxring.train`;
    workload_config(preset, seq_len, image_size, overrides) -> config for a planner workload (default:
        the preset with the overrides);
    planner_terms: a `jaxring.parallel.cost_terms.WorkloadTerms`, what the planner's cost model adds for the family beyond
        its blocks (default: a token model's);
    documents(data settings) -> True when a run's batches are packed documents (their int32 segment ids travel
        with K/V; the family's objective and abstract_batch then take documents=True); None: it packs none.
    Optional, for `python -m jaxring.eval` (None: the family is not evaluated there):
    load_pretrained(path, plan, overrides) -> (model, config): a Hugging Face checkpoint directory, placed on
        the plan, with config fields overridden (e.g. RoPE scaling);
    token_scores(model, tokens, targets, plan, *, segment_ids=None, positions=None) -> (losses fp32 [b, s],
        hits bool [b, s]) as numpy arrays in token order, from ONE sharded forward pass: each token's
        cross-entropy of `targets` and whether the target is the argmax of its logits; with packed documents'
        segment_ids and positions, attention stays inside each document.
    """

    name: str
    summary: str
    causal: bool
    config_class: type
    presets: Mapping[str, Any]
    build: Callable
    objective: Callable
    check_plan: Callable
    tokens: Callable
    flops_per_step: Callable
    abstract_batch: Callable
    task: Callable
    workload_config: Callable | None = None
    planner_terms: Any = (
        None  # a jaxring.parallel.cost_terms.WorkloadTerms: what the planner adds for this family (None: a GPT's)
    )
    documents: Callable | None = None  # (data settings) -> the batches are packed documents (None: never)
    load_pretrained: Callable | None = None
    token_scores: Callable | None = None

    def get_config(self, preset: str, **overrides: Any) -> Any:
        """The preset's config with `overrides` (each checked by `check_override`)."""
        if preset not in self.presets:
            raise ValueError(f"unknown {self.name} preset {preset!r}; expected one of {', '.join(self.presets)}")
        for field, value in overrides.items():
            self.check_override(field, value)
        return dataclasses.replace(self.presets[preset], **overrides)

    def config_for_workload(
        self, preset: str, *, seq_len: int | None, image_size: int | None = None, **overrides: Any
    ) -> Any:
        if self.workload_config is not None:
            return self.workload_config(preset, seq_len, image_size, overrides)
        return self.get_config(preset, **overrides)

    # ---------------------------------------------------------------- overrides of preset fields
    def fields(self) -> dict[str, tuple[tuple[type, ...], bool]]:
        """{field: (accepted python types, None allowed)} of the config class."""
        hints = typing.get_type_hints(self.config_class)
        out = {}
        for f in dataclasses.fields(self.config_class):
            hint = hints.get(f.name, object)
            union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
            args = typing.get_args(hint) if union else (hint,)
            out[f.name] = (tuple(a for a in args if a is not type(None)), type(None) in args)
        return out

    def check_override(self, field: str, value: Any) -> None:
        """ValueError unless `field` is a config field and `value` fits its type and range (sizes and counts
        positive, numbers finite and non-negative)."""
        name = self.config_class.__name__
        fields = self.fields()
        if field not in fields:
            raise ValueError(f"--override {field}: {name} has no field {field!r}{nearest(field, fields)}")
        accepted, optional = fields[field]
        label = f"--override {field}="
        if value is None:
            if not optional:
                raise ValueError(f"{label}None: {name}.{field} cannot be None")
            return
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if int in accepted and is_int:
            positive = _is_size(field)
            if value < (1 if positive else 0):
                kind = "a positive" if positive else "a non-negative"
                raise ValueError(f"{label}{value}: {name}.{field} must be {kind} integer")
            return
        if float in accepted and (is_int or isinstance(value, float)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{label}{value}: {name}.{field} must be a finite number >= 0")
            return
        if (bool in accepted and isinstance(value, bool)) or (str in accepted and isinstance(value, str)):
            return
        if dict in accepted and isinstance(value, Mapping):
            return
        simple = [t for t in accepted if t in _KIND_TEXT]
        if not simple:
            return  # a field of another type: left to the config's own checks
        kinds = " or ".join(_KIND_TEXT[t] for t in simple)
        raise ValueError(f"{label}{value!r}: {name}.{field} must be {kinds}{' or None' if optional else ''}")

    def parse_override(self, item: str) -> tuple[str, Any]:
        """("FIELD", value) from "FIELD=VALUE", the value parsed as the field's type and checked."""
        field, sep, text = item.partition("=")
        field = field.strip()
        if not sep or not field:
            raise ValueError(f"--override {item!r} must be FIELD=VALUE")
        fields = self.fields()
        if field not in fields:
            self.check_override(field, text)  # raises: no such field
        value = _parse_value(text, *fields[field])
        self.check_override(field, value)
        return field, value


_KIND_TEXT = {int: "an integer", float: "a number", bool: "true/false", str: "a string"}
SIZE_NAMES = ("hidden", "ffn", "top_k")


def _is_size(field: str) -> bool:
    """Config int fields that are sizes or counts (must be >= 1); others must be >= 0."""
    return field in SIZE_NAMES or field.startswith("num_") or field.endswith(("_size", "_dim", "_len"))


def _parse_value(text: str, accepted: tuple[type, ...], optional: bool):
    """The override's text as the field's type ("2" -> 2, "0.5" -> 0.5, "true" -> True, "none" -> None)."""
    word = text.strip().lower()
    if optional and word in ("none", "null"):
        return None
    if bool in accepted and word in ("true", "false"):
        return word == "true"
    for kind in (int, float):
        if kind in accepted:
            try:
                return kind(text)
            except ValueError:
                pass
    if dict in accepted:
        return yaml.safe_load(text)
    return text  # a string, or the wrong type (check_override names the field and what it takes)


# ---------------------------------------------------------------------------------------- the families

_FAMILIES: dict[str, ModelFamily] = {}
_discovered = False


def register_family(family: ModelFamily) -> ModelFamily:
    old = _FAMILIES.get(family.name)
    if old is not None and old is not family:
        raise ValueError(f"model family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def _discover() -> None:
    """Loads the families the installed packages declare under the `jaxring.models` entry-point group."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _FAMILIES:
            family = ep.load()
            if not isinstance(family, ModelFamily):
                raise TypeError(f"entry point {ep.name} = {ep.value} is not a jaxring.run.task.ModelFamily")
            register_family(family)


def model_families() -> dict[str, ModelFamily]:
    _discover()
    return dict(_FAMILIES)


def model_family(name: str) -> ModelFamily:
    families = model_families()
    if name not in families:
        known = ", ".join(families) or "none (install the package that declares them: pip install -e .)"
        raise ValueError(f"unknown model {name!r}; expected one of {known}")
    return families[name]
