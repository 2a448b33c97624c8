"""Type and range checks of every numeric training setting and every model override, before anything runs.

    validate_config(cfg)                      # called by check_config; ValueError naming the value and rule
    overrides = parse_overrides("gpt", "tiny", ["num_layers=2", "tie_embeddings=false"])

Overrides are checked against the preset's config dataclass (models/gpt.py: GPTConfig, models/dit.py:
DiTConfig): the field must exist, the value must have the field's type (int, float, bool, str, or None where
the field allows it), sizes must be positive and numbers finite. The dataclass's own checks (divisibility
and the like) still run when the model is built.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing

# TrainConfig field -> (kind, rule); "int>=1": positive int, "int>=0", "float>0", ... None allowed if "?".
RULES = {
    "steps": "int>=1",
    "seed": "seed",
    "batch_size": "int>=1",
    "seq_len": "int>=1?",
    "image_size": "int>=1?",
    "lr": "float>0",
    "warmup": "int>=0",
    "min_lr_ratio": "float[0,1]",
    "weight_decay": "float>=0",
    "clip": "float>0",
    "grad_accum": "int>=1",
    "dp": "int>=1",
    "fsdp": "int>=1",
    "pp": "int>=1",
    "tp": "int>=1",
    "sp": "int>=1",
    "ep": "int>=1",
    "team_size": "int>=1?",
    "ulysses_size": "int>=1?",
    "checkpoint_every": "int>=0",
    "keep_checkpoints": "int>=1",
    "log_every": "int>=1",
    "sample_tokens": "int>=0",
    "zero": "zero?",
    "microbatches": "int>=1?",
    "virtual_stages": "int>=1",
}
RULE_TEXT = {
    "int>=1": "a positive integer",
    "int>=0": "a non-negative integer",
    "float>0": "a finite number > 0",
    "float>=0": "a finite number >= 0",
    "float[0,1]": "a number in [0, 1]",
    "seed": "an integer in [0, 2**32)",
    "zero": "a ZeRO stage 0, 1, 2 or 3",
}

# Model config int fields that are sizes or counts (must be >= 1); other int fields must be >= 0.
SIZE_PREFIXES = ("num_",)
SIZE_SUFFIXES = ("_size", "_dim", "_len")
SIZE_NAMES = ("hidden", "ffn", "top_k")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_value(label: str, value, rule: str) -> None:
    """ValueError "LABEL VALUE must be RULE" unless `value` obeys `rule` (see RULES)."""
    optional = rule.endswith("?")
    rule = rule.rstrip("?")
    if value is None and optional:
        return
    if rule.startswith("int"):
        ok = _is_int(value) and value >= (1 if rule == "int>=1" else 0)
    elif rule == "seed":
        ok = _is_int(value) and 0 <= value < 2**32
    elif rule == "zero":
        ok = _is_int(value) and 0 <= value <= 3
    elif rule == "float>0":
        ok = _is_number(value) and math.isfinite(value) and value > 0
    elif rule == "float>=0":
        ok = _is_number(value) and math.isfinite(value) and value >= 0
    elif rule == "float[0,1]":
        ok = _is_number(value) and 0 <= value <= 1
    else:
        raise AssertionError(rule)
    if not ok:
        raise ValueError(f"{label} {value!r} must be {RULE_TEXT[rule]}")


def validate_config(cfg) -> None:
    """Checks every numeric field of a TrainConfig, the model overrides and the output paths."""
    for name, rule in RULES.items():
        if hasattr(cfg, name):
            check_value(_flag(name), getattr(cfg, name), rule)
    for name, (accepted, optional) in _field_types(type(cfg)).items():  # fields without a rule: their type
        value = getattr(cfg, name)
        if name in RULES or (value is None and optional) or bool in accepted:
            continue
        if int in accepted and float not in accepted:
            check_value(_flag(name), value, "int>=0")
        elif float in accepted:
            check_value(_flag(name), value, "float>=0")
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise ValueError(f"--checkpoint-every {cfg.checkpoint_every} needs --checkpoint-dir (where to save)")
    if cfg.metrics_file:
        parent = os.path.dirname(os.path.abspath(cfg.metrics_file))
        if os.path.isdir(cfg.metrics_file):
            raise ValueError(f"--metrics-file {cfg.metrics_file!r} is a directory; give a file name")
        if not os.path.isdir(parent):
            raise ValueError(f"--metrics-file {cfg.metrics_file!r}: directory {parent!r} does not exist")
    if cfg.checkpoint_dir and os.path.exists(cfg.checkpoint_dir) and not os.path.isdir(cfg.checkpoint_dir):
        raise ValueError(f"--checkpoint-dir {cfg.checkpoint_dir!r} exists and is not a directory")
    if not isinstance(cfg.model_overrides, dict):
        raise ValueError(f"model_overrides must be a dict of FIELD: VALUE, got {type(cfg.model_overrides).__name__}")
    config_class = model_config_class(cfg.model)
    if config_class is not None:
        for field, value in cfg.model_overrides.items():
            check_override(config_class, field, value)


# ------------------------------------------------------------------------------------------ model overrides


def model_config_class(model: str):
    """GPTConfig / DiTConfig for "gpt" / "dit" (None for another model name: check_config reports it)."""
    if model == "gpt":
        from models.gpt import GPTConfig

        return GPTConfig
    if model == "dit":
        from models.dit import DiTConfig

        return DiTConfig
    return None


def _field_types(config_class) -> dict[str, tuple[tuple[type, ...], bool]]:
    """{field: (accepted python types, None allowed)} from the dataclass's annotations."""
    hints = typing.get_type_hints(config_class)
    out = {}
    for f in dataclasses.fields(config_class):
        hint = hints.get(f.name, object)
        args = (
            typing.get_args(hint)
            if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
            else (hint,)
        )
        optional = type(None) in args
        out[f.name] = (tuple(a for a in args if a is not type(None)), optional)
    return out


def _is_size(field: str) -> bool:
    return field in SIZE_NAMES or field.startswith(SIZE_PREFIXES) or field.endswith(SIZE_SUFFIXES)


def check_override(config_class, field, value) -> None:
    """ValueError unless `field` is a field of `config_class` and `value` fits its type and range."""
    name = config_class.__name__
    fields = _field_types(config_class)
    if field not in fields:
        raise ValueError(f"--override {field}: {name} has no field {field!r}; fields: {', '.join(fields)}")
    accepted, optional = fields[field]
    label = f"--override {field}="
    if value is None:
        if not optional:
            raise ValueError(f"{label}None: {name}.{field} cannot be None")
        return
    if int in accepted and _is_int(value):
        if value < (1 if _is_size(field) else 0):
            raise ValueError(
                f"{label}{value}: {name}.{field} must be "
                f"{'a positive' if _is_size(field) else 'a non-negative'} integer"
            )
        return
    if float in accepted and _is_number(value):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{label}{value}: {name}.{field} must be a finite number >= 0")
        return
    if bool in accepted and isinstance(value, bool):
        return
    if str in accepted and isinstance(value, str):
        return
    if not any(t in (int, float, bool, str) for t in accepted):
        return  # a field of another type (tuple, nested config): left to the dataclass
    kinds = " or ".join(
        {int: "an integer", float: "a number", bool: "true/false", str: "a string"}[t]
        for t in accepted
        if t in (int, float, bool, str)
    )
    raise ValueError(f"{label}{value!r}: {name}.{field} must be {kinds}{' or None' if optional else ''}")


def _parse_value(text: str, accepted: tuple[type, ...], optional: bool):
    """The override's text as the field's type ("2" -> 2, "0.5" -> 0.5, "true" -> True, "none" -> None)."""
    if optional and text.strip().lower() in ("none", "null"):
        return None
    if bool in accepted and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    if int in accepted:
        try:
            return int(text)
        except ValueError:
            pass
    if float in accepted:
        try:
            return float(text)
        except ValueError:
            pass
    if str in accepted:
        return text
    return text  # the wrong type: check_override names the field and what it takes


def parse_overrides(model: str, items) -> dict:
    """{field: value} from "FIELD=VALUE" strings, each value parsed as its field's type and checked."""
    items = list(items)
    config_class = model_config_class(model) if items else None
    fields = _field_types(config_class) if config_class is not None else {}
    out = {}
    for item in items:
        field, sep, text = item.partition("=")
        field = field.strip()
        if not sep or not field:
            raise ValueError(f"--override {item!r} must be FIELD=VALUE")
        if config_class is None:
            out[field] = text
            continue
        if field not in fields:
            check_override(config_class, field, text)  # raises: no such field
        out[field] = _parse_value(text, *fields[field])
        check_override(config_class, field, out[field])
    return out
