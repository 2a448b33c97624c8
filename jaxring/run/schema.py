"""The run settings, declared once: every setting of a training run with its default, help and rule, in
typed sections (model, training, memory, optimizer, parallel, data, checkpoint, output, guard, cluster).

    setting(150, "optimizer steps", rule="int>=1")       # one field of a section's dataclass
    check_setting(TrainingSettings, "steps", 0)          # ValueError: --steps 0 must be a positive integer

The command line (`jaxring.run.cli`), the YAML form and `RunSpec` (`jaxring.run.spec`) and `make_plan`
(`jaxring.run.make_plan`) are generated from these dataclasses. A sequence strategy's, tensor method's or
pipeline schedule's own options come from its registry entry (`jaxring.parallel.catalog`): they are settings of
the parallel section (`registered_options`), flags and YAML keys with no edit here.

A setting's rule is checked in one place (`check_setting`): one line naming the flag, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

from jaxring.core.precision import PRECISIONS
from jaxring.core.settings import setting
from jaxring.core.suggest import nearest
from jaxring.data.packing import PACKINGS
from jaxring.nn import NO_OFFLOAD, OFFLOAD, REMAT, MemoryPolicy, Offload
from jaxring.parallel.catalog import all_options, pipeline_schedules, sequence_strategies, tensor_methods
from jaxring.parallel.registry import Option
from jaxring.parallel.settings import DEGREES, ParallelSettings
from jaxring.run.task import model_families

__all__ = [
    "DEGREES",
    "MEMORY_BUDGETS",
    "RULE_TEXT",
    "RUN_SETTINGS",
    "SECTIONS",
    "CheckpointSettings",
    "ClusterSettings",
    "DataSettings",
    "GuardSettings",
    "MemorySettings",
    "ModelSettings",
    "OptimizerSettings",
    "OutputSettings",
    "ParallelSection",
    "ParallelSettings",
    "TrainingSettings",
    "accepted_types",
    "check_rule",
    "check_setting",
    "flag_name",
    "flat_index",
    "option_names",
    "parsed_setting",
    "registered_options",
    "setting",
    "setting_choices",
    "setting_fields",
]

RULE_TEXT = {
    "int>=1": "a positive integer",
    "int>=0": "a non-negative integer",
    "float>0": "a finite number > 0",
    "float>=0": "a finite number >= 0",
    "float[0,1]": "a number in [0, 1]",
    "seconds": "a finite number of seconds in (0, 1e6]",
    "seed": "an integer in [0, 2**32)",
}


# ------------------------------------------------------------------------------------------ choices
# registries can gain entries after import (an installed model family, `registered(...)`): their choices are
# functions, read when a setting is checked or the parser is built


def _models() -> tuple[str, ...]:
    return tuple(model_families())


# ------------------------------------------------------------------------------------------ sections


@dataclasses.dataclass
class ModelSettings:
    """What is trained."""

    model: str = setting("gpt", "model family", choices=_models, entries=model_families)
    preset: str = setting("tiny", "a preset of the family")
    overrides: dict = setting(
        {}, "change a preset field, e.g. --override num_layers=2 (repeatable)", flag="override", metavar="FIELD=VALUE"
    )
    init_from: str | None = setting(
        None,
        "start from a Hugging Face checkpoint directory (config.json + safetensors; gpt): its config replaces "
        "--preset; --override may change only rope_* and max_seq_len (context extension)",
        metavar="DIR",
    )
    export_hf: str | None = setting(
        None, "write the trained model as a Hugging Face checkpoint directory at the end (gpt)", metavar="DIR"
    )
    overwrite_export: bool = setting(False, "--export-hf may replace an earlier export in DIR (as a whole)")


@dataclasses.dataclass
class TrainingSettings:
    """How long, on what batches, in which numerics."""

    steps: int = setting(150, "optimizer steps", rule="int>=1")
    seed: int = setting(0, "initial parameters and data order", rule="seed")
    batch_size: int = setting(8, "global batch (sequences or images)", rule="int>=1")
    seq_len: int | None = setting(None, "tokens per sequence (gpt; default 256)", rule="int>=1")
    image_size: int | None = setting(None, "image side (dit; default: the preset's)", rule="int>=1")
    grad_accum: int = setting(1, "micro-steps accumulated per update (pp = 1)", rule="int>=1")
    precision: str | None = setting(
        None,
        "compute dtype (default: bf16 for the full-size Llama presets and on a TPU, fp32 otherwise); weights and "
        "optimizer state stay fp32",
        choices=tuple(PRECISIONS),
    )


@dataclasses.dataclass(frozen=True)
class MemorySettings:
    """What a step keeps, recomputes, tiles and offloads to fit long sequences (the plan's memory choices), and
    the memory it may use (the budgets, MEMORY_BUDGETS). Immutable: the planner's candidates hold one."""

    remat: str = setting(
        "none",
        "recompute in the backward: none; selective (keeps the weight matmuls' outputs, recomputes attention "
        "cores, activations, norms); full (keeps each layer's input only)",
        choices=REMAT,
    )
    remat_layers: int = setting(
        1,
        "with --remat full, layers per recompute block (Megatron's --recompute-num-layers, uniform): a block "
        "keeps, or with --offload layer_inputs offloads, one input for its K layers, and its backward "
        "recomputes their forward keeping each layer's input on the device (one more forward a layer)",
        rule="int>=1",
    )
    loss_tile: int | None = setting(
        None, "tokens per tile of the LM head's loss (logits never whole; default: untiled)", rule="int>=1"
    )
    mlp_tile: int | None = setting(
        None, "tokens per tile of the MLP ([tokens, ffn] never whole; default: untiled)", rule="int>=1"
    )
    offload: Offload = setting(
        NO_OFFLOAD,
        "host offload: none; layer_inputs (each layer's checkpointed input lives in host memory between the "
        "forward and the backward; with --remat full); optimizer (the AdamW state lives in host memory between "
        "updates); weights (the fp32 weights, their gradients and the AdamW state live in host memory: each "
        "layer's weights reach the device as the layer runs, its gradient leaves as it is formed, the update "
        "streams layer by layer; pp = 1, ZeRO stage 0 or 3); layer_inputs+optimizer, layer_inputs+weights (both)",
        choices=OFFLOAD,
        parse=Offload.parse,
    )
    device_memory_gib: float | None = setting(
        None,
        "memory per device (GiB) the run's estimated memory is checked against before compiling (default: the "
        "accelerator's own; simulated CPU devices: their share of --host-memory-gib)",
        rule="float>0",
    )
    host_memory_gib: float | None = setting(
        None,
        "host memory (GiB) the run may use: simulated CPU devices share it, --offload keeps its buffers in it; "
        "this host's devices' estimates together are checked against it before compiling (default: this "
        "machine's memory, or its container's limit)",
        rule="float>0",
    )

    def choices(self) -> dict:
        """{name: value} of the plan's memory choices (every setting but the budgets), in the flags' order."""
        return {n: getattr(self, n) for n in setting_fields(MemorySettings) if n not in MEMORY_BUDGETS}

    def plan_keywords(self) -> dict:
        """The memory choices `ParallelPlan` takes (the tiles: the layers read them from the plan)."""
        return {"loss_tile": self.loss_tile, "mlp_tile": self.mlp_tile}

    def choice(self) -> MemorySettings:
        """These settings with the budgets at their defaults: what a planner's candidate holds."""
        return dataclasses.replace(self, **{n: None for n in MEMORY_BUDGETS})

    @property
    def policy(self) -> MemoryPolicy:
        """What the layer stack keeps, recomputes and offloads (remat, recompute blocks, offload), as `Layers`
        and `TrainStep` take it; the tiles go to the plan (`RunSpec.plan`)."""
        return MemoryPolicy(remat=self.remat, remat_layers=self.remat_layers, offload=self.offload)


# the memory settings that are the run's budgets, not a choice of its plan
MEMORY_BUDGETS = ("device_memory_gib", "host_memory_gib")


@dataclasses.dataclass
class OptimizerSettings:
    """AdamW with linear warmup and cosine decay; clipping by the global norm."""

    lr: float = setting(3e-3, "peak learning rate", rule="float>0")
    warmup: int = setting(20, "linear warmup steps", rule="int>=0")
    min_lr_ratio: float = setting(0.1, "final learning rate / peak", rule="float[0,1]")
    weight_decay: float = setting(0.1, "AdamW weight decay", rule="float>=0")
    clip: float = setting(1.0, "clip gradients to this global norm", rule="float>0")


@dataclasses.dataclass(frozen=True)
class ParallelSection(ParallelSettings):
    """The mesh (degrees multiply to the device count), the strategy for each axis and the chosen entries' own
    options (`jaxring.parallel.settings.ParallelSettings`, the type the plan and the planner take), and how they
    are chosen (--plan)."""

    plan: str = setting(
        "manual",
        "auto: the planner's best plan for the devices at hand; degrees and strategies given with it are held",
        choices=("manual", "auto"),
    )

    def settings(self) -> ParallelSettings:
        """The parallel settings themselves (--plan aside)."""
        return ParallelSettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelSettings)})


@dataclasses.dataclass
class DataSettings:
    """Where the batches come from."""

    data: str | None = setting(
        None,
        "a document store (python -m jaxring.data prepare), a text/.jsonl/.parquet file or a directory of them "
        "(prepared on first use into PATH.jaxring-cache/), a nanoGPT .bin (random windows), or (dit) an image "
        "folder; default: bundled (the Python standard library's files, one document each)",
    )
    tokenizer: str | None = setting(
        None, "bytes, or a tokenizer.json / a directory holding one (default: the store's own; bytes to prepare)"
    )
    text_field: str = setting("text", "the text field of .jsonl/.parquet inputs")
    packing: str = setting(
        "split",
        "documents into rows (each + EOS): split (a long document continues in the next row) or drop (whole "
        "documents only; longer ones skipped, rows padded)",
        choices=PACKINGS,
    )
    val_data: str | None = setting(None, "held-out documents from this store or file (default: a share of --data's)")
    val_fraction: float = setting(
        0.1, "share of --data's documents held out for validation (ignored with --val-data)", rule="float[0,1]"
    )


@dataclasses.dataclass
class CheckpointSettings:
    """Orbax checkpoints: atomic, checksummed, restored onto any mesh."""

    checkpoint_dir: str | None = setting(None, "directory of the run's checkpoints")
    checkpoint_every: int = setting(0, "steps between saves (0: only at the end and on a stop signal)", rule="int>=0")
    keep_checkpoints: int = setting(3, "newest checkpoints kept", rule="int>=1")
    resume: bool = setting(False, "continue from the newest intact checkpoint")


@dataclasses.dataclass
class OutputSettings:
    """What the run writes and shows."""

    out_dir: str | None = setting(
        None, "directory for run.yaml, metrics and samples (default: the checkpoint directory, else runs/TIME)"
    )
    metrics_file: str | None = setting(None, "append one JSON line per logged step (default: OUT_DIR/metrics.jsonl)")
    log_every: int = setting(10, "steps between log lines without a progress bar", rule="int>=1")
    progress: bool = setting(True, "a progress bar (--no-progress: log lines)")
    profile: str | None = setting(None, "write a JAX profiler trace of a few steps to this directory")
    eval_at_end: bool = setting(True, "report the held-out loss after training")
    eval_every: int = setting(
        0, "steps between held-out losses in the metrics (0: none during training)", rule="int>=0"
    )
    sample_tokens: int = setting(200, "gpt: tokens to generate at the end; dit: 0 skips the samples", rule="int>=0")
    tensorboard: str | None = setting(None, "also write TensorBoard event files to this directory (extra: tensorboard)")
    wandb: str | None = setting(None, "also log to this Weights & Biases project (extra: wandb; WANDB_MODE=offline)")

    METRICS_FILE: typing.ClassVar[str] = "metrics.jsonl"

    def metrics_path(self) -> str | None:
        """Where the metrics go: --metrics-file, else OUT_DIR/metrics.jsonl (None before out_dir is known)."""
        if self.metrics_file:
            return self.metrics_file
        return os.path.join(self.out_dir, self.METRICS_FILE) if self.out_dir else None


@dataclasses.dataclass
class GuardSettings:
    """What a diverging loss does."""

    on_divergence: str = setting(
        "stop", "when the loss is NaN/Inf or spikes: stop (exit 3), or skip the step", choices=("stop", "skip")
    )
    spike_factor: float = setting(
        3.0, "a loss above this multiple of its lowest running mean is a spike (0: NaN/Inf only)", rule="float>=0"
    )
    spike_window: int = setting(20, "losses in the running mean", rule="int>=1")


@dataclasses.dataclass
class ClusterSettings:
    """Devices and processes."""

    cpu_devices: int = setting(8, "simulated CPU devices when there is no accelerator", rule="int>=1")
    coordinator: str | None = setting(None, "HOST:PORT of process 0 (default: $JAX_COORDINATOR_ADDRESS)")
    num_processes: int | None = setting(None, "processes in the run (default: $JAX_NUM_PROCESSES)", rule="int>=1")
    process_id: int | None = setting(
        None, "this process, 0 .. num-processes - 1 (default: $JAX_PROCESS_ID)", rule="int>=0"
    )
    init_timeout: float = setting(300.0, "seconds to wait for every process to reach the coordinator", rule="seconds")


SECTIONS: dict[str, type] = {
    "model": ModelSettings,
    "training": TrainingSettings,
    "memory": MemorySettings,
    "optimizer": OptimizerSettings,
    "parallel": ParallelSection,
    "data": DataSettings,
    "checkpoint": CheckpointSettings,
    "output": OutputSettings,
    "guard": GuardSettings,
    "cluster": ClusterSettings,
}


@functools.cache
def setting_fields(section: type) -> Mapping[str, dataclasses.Field]:
    """{name: dataclass field} of a section's settings (read-only; computed once per section: the planner asks
    for the memory section's in its inner loop)."""
    return types.MappingProxyType(
        {f.name: f for f in dataclasses.fields(section) if f.metadata.get("help") is not None}
    )


# every setting's name ("options" included): a registry entry's option may not take one
RUN_SETTINGS = frozenset(name for cls in SECTIONS.values() for name in setting_fields(cls))


def flat_index() -> dict[str, str]:
    """{flat setting name: its section} ("options" is not a flat name: its keys are)."""
    return {name: s for s, cls in SECTIONS.items() for name in setting_fields(cls) if name != "options"}


def flag_name(name: str) -> str:
    """The flag of a setting or option: --NAME-WITH-DASHES."""
    return "--" + name.replace("_", "-")


# ------------------------------------------------------------------------------------------ registry options


def registered_options() -> dict[str, tuple[Option, tuple[str, ...]]]:
    """Every registered entry's options by name (the catalog's `all_options`): (the first entry's Option, the
    entries that take it). An option named like a run setting is a one-line ValueError naming the entry."""
    for table, kind in (
        (sequence_strategies(), "sequence strategy"),
        (tensor_methods(), "tensor method"),
        (pipeline_schedules(), "pipeline schedule"),
    ):
        for entry in table.values():
            for option in entry.options:
                if option.name in RUN_SETTINGS:
                    raise ValueError(f"{kind} {entry.name!r}: option {option.name!r} would shadow a run setting")
    return all_options()


def option_names() -> tuple[str, ...]:
    """The names of every registered entry's options: settings of the parallel section."""
    return tuple(registered_options())


# ------------------------------------------------------------------------------------------ rules


def accepted_types(section: type, name: str) -> tuple[tuple[type, ...], bool]:
    """(python types the field takes, None allowed) from its annotation."""
    hint = typing.get_type_hints(section)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
    else:
        args = (hint,)
    return tuple(a for a in args if a is not type(None)), type(None) in args


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_rule(label: str, value: object, rule: str) -> None:
    """ValueError "LABEL VALUE must be RULE" unless `value` obeys `rule` (a key of RULE_TEXT)."""
    if rule == "int>=1":
        ok = _is_int(value) and value >= 1
    elif rule == "int>=0":
        ok = _is_int(value) and value >= 0
    elif rule == "seed":
        ok = _is_int(value) and 0 <= value < 2**32
    elif rule == "float>0":
        ok = _is_number(value) and math.isfinite(value) and value > 0
    elif rule == "float>=0":
        ok = _is_number(value) and math.isfinite(value) and value >= 0
    elif rule == "float[0,1]":
        ok = _is_number(value) and 0 <= value <= 1
    elif rule == "seconds":
        ok = _is_number(value) and math.isfinite(value) and 0 < value <= 1e6
    else:
        raise AssertionError(f"unknown rule {rule!r}")
    if not ok:
        raise ValueError(f"{label} {value!r} must be {RULE_TEXT[rule]}")


def setting_choices(meta: Mapping[str, Any]) -> tuple | None:
    """The choices a setting's field metadata names (a function's are read now), or None."""
    choices = meta.get("choices")
    return choices() if callable(choices) else choices


def parsed_setting(section: type, name: str, value: object) -> object:
    """A typed setting's value from its text form where that is one of its choices (the setting's `parse`);
    any other value as it is (a bad one is `check_setting`'s one-line error)."""
    meta = setting_fields(section)[name].metadata
    parse = meta.get("parse")
    if parse is None or not isinstance(value, str) or value not in (setting_choices(meta) or ()):
        return value
    return parse(value)


def check_setting(section: type, name: str, value: object) -> None:
    """One setting's type, rule and choices; ValueError naming the flag, the value and the rule."""
    f = setting_fields(section)[name]
    label = flag_name(f.metadata.get("flag") or name)
    accepted, optional = accepted_types(section, name)
    if value is None:
        if not optional:
            raise ValueError(f"{label} cannot be null")
        return
    if f.metadata.get("parse") is not None and isinstance(value, accepted):  # a typed value: parsed already
        return
    choices = setting_choices(f.metadata)
    if choices is not None:
        if value not in choices:
            if not choices:  # e.g. the model families of a clone that was not installed
                raise ValueError(f"{label} {value!r}: none is installed (pip install -e . declares them)")
            shown = ", ".join(map(str, choices))
            raise ValueError(f"{label} {value!r} is not one of {shown}{nearest(str(value), map(str, choices))}")
        return
    rule = f.metadata.get("rule")
    if rule is not None:
        check_rule(label, value, rule)
        return
    if bool in accepted:
        if not isinstance(value, bool):
            raise ValueError(f"{label} {value!r} must be true or false")
    elif any(isinstance(t, type) and issubclass(t, Mapping) for t in accepted):
        if not isinstance(value, Mapping):
            raise ValueError(f"{label} {value!r} must be a mapping of NAME: VALUE")
    elif str in accepted and not isinstance(value, str):
        raise ValueError(f"{label} {value!r} must be a string")
