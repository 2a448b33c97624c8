"""The run specification: every setting of a training run, declared once, with its default, help and rule.

    spec = RunSpec.of(sp=8, attention="ring", steps=50)         # flat names: the flags with underscores
    spec = RunSpec.from_yaml(open("run.yaml").read())           # sections, as --print-config writes them
    spec.parallel.sp, spec.training.steps                       # typed sections
    print(spec.to_yaml())

Everything else is generated from these dataclasses: `train.py`'s command line (one flag per setting, grouped
by section, defaults in `--help`), the YAML form (`--config`, `--print-config`, the `run.yaml` every run
writes), `jaxring.make_plan(**settings)` (the parallel section) and the planner's candidates (settings of the
parallel and training sections). A sequence strategy's, tensor method's or pipeline schedule's own options
come from its registry entry (`jaxring.parallel.registry`): they are settings of the parallel section, flags and YAML
keys with no edit here.

A setting's rule is checked in one place (`check_setting`): one line naming the flag, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax

    from jaxring.parallel.plan import ParallelPlan

__all__ = [
    "SECTIONS",
    "CheckpointSettings",
    "ClusterSettings",
    "DataSettings",
    "GuardSettings",
    "MemorySettings",
    "ModelSettings",
    "OptimizerSettings",
    "OutputSettings",
    "ParallelSettings",
    "RunSpec",
    "TrainingSettings",
    "check_setting",
    "make_plan",
    "nearest",
    "setting",
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


def setting(
    default: Any,
    help: str,
    *,
    rule: str | None = None,
    choices: Callable[[], tuple] | tuple | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    entries: Callable[[], dict] | None = None,
) -> Any:
    """A dataclass field that is a run setting: its default, its help, its rule (see RULE_TEXT) or choices
    (a tuple, or a function returning one: registries fill in late), its flag if not --NAME-WITH-DASHES, and
    `entries`: a function returning {name: registry entry} whose summaries the help lists."""
    meta = {"help": help, "rule": rule, "choices": choices, "flag": flag, "metavar": metavar, "entries": entries}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ------------------------------------------------------------------------------------------ choices


def _families() -> dict:
    from jaxring.run.task import model_families

    return model_families()


def _models() -> tuple[str, ...]:
    return tuple(_families())


def _sequence_entries() -> dict:
    from jaxring.parallel.registry import sequence_strategies

    return sequence_strategies()


def _attentions() -> tuple[str, ...]:
    return tuple(_sequence_entries())


def _layouts() -> tuple[str, ...]:
    from jaxring.kernels.layout import LAYOUTS

    return LAYOUTS


def _tensor_entries() -> dict:
    from jaxring.parallel.registry import tensor_methods

    return tensor_methods()


def _tensor_methods() -> tuple[str, ...]:
    return tuple(n for n in _tensor_entries() if n != "none")


def _schedule_entries() -> dict:
    from jaxring.parallel.registry import pipeline_schedules

    return pipeline_schedules()


def _schedules() -> tuple[str, ...]:
    return tuple(_schedule_entries())


def _precisions() -> tuple[str, ...]:
    from jaxring.core.precision import PRECISIONS

    return tuple(PRECISIONS)


def _remat_modes() -> tuple[str, ...]:
    from jaxring.nn import REMAT

    return REMAT


def _offloads() -> tuple[str, ...]:
    from jaxring.nn import OFFLOAD

    return OFFLOAD


def _packings() -> tuple[str, ...]:
    from jaxring.data.packing import PACKINGS

    return PACKINGS


def _block_ops() -> tuple[str, ...]:
    from jaxring.kernels.block_compute import BLOCK_OPS

    return BLOCK_OPS


# ------------------------------------------------------------------------------------------ sections


@dataclasses.dataclass
class ModelSettings:
    """What is trained."""

    model: str = setting("gpt", "model family", choices=_models, entries=_families)
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
        "compute dtype (default: bf16 for the full-size Llama presets, fp32 otherwise); weights and optimizer "
        "state stay fp32",
        choices=_precisions,
    )


@dataclasses.dataclass
class MemorySettings:
    """What a step keeps, recomputes, tiles and offloads to fit long sequences."""

    remat: str = setting(
        "none",
        "recompute in the backward: none; selective (keeps the weight matmuls' outputs, recomputes attention "
        "cores, activations, norms); full (keeps each layer's input only)",
        choices=_remat_modes,
    )
    loss_tile: int | None = setting(
        None, "tokens per tile of the LM head's loss (logits never whole; default: untiled)", rule="int>=1"
    )
    mlp_tile: int | None = setting(
        None, "tokens per tile of the MLP ([tokens, ffn] never whole; default: untiled)", rule="int>=1"
    )
    offload: str = setting(
        "none",
        "host offload: none; layer_inputs (each layer's checkpointed input lives in host memory between the "
        "forward and the backward; with --remat full); optimizer (the AdamW state lives in host memory between "
        "updates); layer_inputs+optimizer (both)",
        choices=_offloads,
    )
    device_memory_gib: float | None = setting(
        None,
        "memory per device (GiB) the run's estimated memory is checked against before compiling (default: the "
        "accelerator's own; simulated CPU devices: no check)",
        rule="float>0",
    )


@dataclasses.dataclass
class OptimizerSettings:
    """AdamW with linear warmup and cosine decay; clipping by the global norm."""

    lr: float = setting(3e-3, "peak learning rate", rule="float>0")
    warmup: int = setting(20, "linear warmup steps", rule="int>=0")
    min_lr_ratio: float = setting(0.1, "final learning rate / peak", rule="float[0,1]")
    weight_decay: float = setting(0.1, "AdamW weight decay", rule="float>=0")
    clip: float = setting(1.0, "clip gradients to this global norm", rule="float>0")


@dataclasses.dataclass
class ParallelSettings:
    """The mesh (degrees multiply to the device count) and the strategy for each axis; the chosen strategy's,
    tensor method's and schedule's own options are in the "strategy options" group."""

    dp: int | None = setting(None, "data-parallel degree (default 1)", rule="int>=1")
    fsdp: int | None = setting(
        None, "data-parallel degree with parameters sharded (ZeRO-3 by default; default 1)", rule="int>=1"
    )
    pp: int | None = setting(None, "pipeline-parallel degree (default 1)", rule="int>=1")
    tp: int | None = setting(None, "tensor-parallel degree (default 1)", rule="int>=1")
    sp: int | None = setting(
        None, "sequence/context-parallel degree (default with no degree given: every device)", rule="int>=1"
    )
    ep: int | None = setting(
        None, "expert-parallel degree, data parallel outside MoE layers (default 1)", rule="int>=1"
    )
    plan: str = setting(
        "manual",
        "auto: the planner's best plan for the devices at hand; degrees and strategies given with it are held",
        choices=("manual", "auto"),
    )
    attention: str | None = setting(
        None, "sequence strategy over sp (default: ring when sp > 1)", choices=_attentions, entries=_sequence_entries
    )
    layout: str | None = setting(None, "token layout over sp (default: the strategy's)", choices=_layouts)
    tensor_parallel: str | None = setting(
        None,
        "tensor method over tp (default: megatron when tp > 1)",
        choices=_tensor_methods,
        entries=_tensor_entries,
    )
    zero: int | None = setting(
        None,
        "ZeRO stage over the data and sequence axes: 0 replicated, 1 optimizer state sharded, 2 gradients too, "
        "3 parameters too (default: 3 with fsdp > 1, else 0)",
        choices=(0, 1, 2, 3),
    )
    pipeline_schedule: str = setting(
        "1f1b", "pipeline schedule (pp > 1)", choices=_schedules, entries=_schedule_entries
    )
    microbatches: int | None = setting(None, "pipeline micro-batches per step (pp > 1; default 2·pp)", rule="int>=1")
    block_ops: str = setting("auto", "attention's per-block compute", choices=_block_ops)
    options: dict = setting({}, "options of the chosen strategy, tensor method and schedule (registry)")

    DEGREES: typing.ClassVar[tuple[str, ...]] = ("dp", "fsdp", "pp", "tp", "sp", "ep")

    def degrees(self, device_count: int | None = None) -> dict[str, int]:
        """Mesh degrees with the defaults filled in: 1, or with none given, sp = device_count."""
        given = {a: getattr(self, a) for a in self.DEGREES}
        if all(v is None for v in given.values()) and device_count is not None:
            given["sp"] = device_count
        return {a: 1 if v is None else v for a, v in given.items()}


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
        choices=_packings,
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
    "parallel": ParallelSettings,
    "data": DataSettings,
    "checkpoint": CheckpointSettings,
    "output": OutputSettings,
    "guard": GuardSettings,
    "cluster": ClusterSettings,
}


def _fields(section: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section) if f.metadata.get("help") is not None}


def _flat_index() -> dict[str, str]:
    """{flat setting name: its section} ("options" is not a flat name: its keys are)."""
    return {name: s for s, cls in SECTIONS.items() for name in _fields(cls) if name != "options"}


def nearest(name: str, names: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest of `names`, or ''."""
    match = difflib.get_close_matches(name, list(names), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ------------------------------------------------------------------------------------------ rules


def _accepts(section: type, name: str) -> tuple[tuple[type, ...], bool]:
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


def _choices(meta: Mapping[str, Any]) -> tuple | None:
    choices = meta.get("choices")
    return choices() if callable(choices) else choices


def check_setting(section: type, name: str, value: object) -> None:
    """One setting's type, rule and choices; ValueError naming the flag, the value and the rule."""
    f = _fields(section)[name]
    label = (f.metadata.get("flag") and _flag(f.metadata["flag"])) or _flag(name)
    accepted, optional = _accepts(section, name)
    if value is None:
        if not optional:
            raise ValueError(f"{label} cannot be null")
        return
    choices = _choices(f.metadata)
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
    elif dict in accepted:
        if not isinstance(value, Mapping):
            raise ValueError(f"{label} {value!r} must be a mapping of NAME: VALUE")
    elif str in accepted and not isinstance(value, str):
        raise ValueError(f"{label} {value!r} must be a string")


# ------------------------------------------------------------------------------------------ the spec


@dataclasses.dataclass
class RunSpec:
    """A whole run: one typed section per concern (see SECTIONS)."""

    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    training: TrainingSettings = dataclasses.field(default_factory=TrainingSettings)
    memory: MemorySettings = dataclasses.field(default_factory=MemorySettings)
    optimizer: OptimizerSettings = dataclasses.field(default_factory=OptimizerSettings)
    parallel: ParallelSettings = dataclasses.field(default_factory=ParallelSettings)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    checkpoint: CheckpointSettings = dataclasses.field(default_factory=CheckpointSettings)
    output: OutputSettings = dataclasses.field(default_factory=OutputSettings)
    guard: GuardSettings = dataclasses.field(default_factory=GuardSettings)
    cluster: ClusterSettings = dataclasses.field(default_factory=ClusterSettings)

    # ---------------------------------------------------------------- flat names
    @classmethod
    def of(cls, **settings) -> RunSpec:
        """A spec from flat setting names (the flags with underscores): RunSpec.of(sp=8, steps=50). A name
        that is no section's setting must be a registered option (team_size=2, ...)."""
        return cls().updated(**settings)

    def updated(self, **settings) -> RunSpec:
        """A copy with the flat `settings` changed (checked by `validate`, not here)."""
        index = _flat_index()
        sections = {s: dataclasses.replace(getattr(self, s)) for s in SECTIONS}
        options = dict(sections["parallel"].options)
        for name, value in settings.items():
            if name in index:
                setattr(sections[index[name]], name, value)
            elif name in _option_names():
                options[name] = value
            else:
                raise ValueError(f"unknown setting {name!r}{nearest(name, list(index) + list(_option_names()))}")
        sections["parallel"].options = options
        return RunSpec(**sections)

    def flat(self) -> dict:
        """Every setting by its flat name (options included)."""
        out = {}
        for s in SECTIONS:
            for name in _fields(SECTIONS[s]):
                if name != "options":
                    out[name] = getattr(getattr(self, s), name)
        out.update(self.parallel.options)
        return out

    # ---------------------------------------------------------------- YAML
    def to_dict(self) -> dict:
        """{section: {setting: value}}, the parallel section's options as flat keys."""
        out = {}
        for s, cls in SECTIONS.items():
            section = getattr(self, s)
            out[s] = {n: _plain(getattr(section, n)) for n in _fields(cls) if n != "options"}
        out["parallel"].update({k: _plain(v) for k, v in sorted(self.parallel.options.items())})
        return out

    @classmethod
    def from_dict(cls, data: Mapping, base: RunSpec | None = None, source: str = "config") -> RunSpec:
        """A spec from {section: {setting: value}} over `base` (default: the defaults). Unknown sections and
        keys are one-line errors naming the key and the nearest valid one."""
        if not isinstance(data, Mapping):
            raise ValueError(
                f"{source}: expected a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__}"
            )
        flat = {}
        for s, values in data.items():
            if s not in SECTIONS:
                raise ValueError(
                    f"{source}: unknown section {s!r}{nearest(str(s), SECTIONS)}; sections: {', '.join(SECTIONS)}"
                )
            if values is None:
                continue
            if not isinstance(values, Mapping):
                raise ValueError(f"{source}: section {s!r} must be a mapping of settings, got {values!r}")
            names = [n for n in _fields(SECTIONS[s]) if n != "options"]
            valid = names + (list(_option_names()) if s == "parallel" else [])
            for key, value in values.items():
                if key not in valid:
                    other = _flat_index().get(key)
                    hint = f" (it belongs in section {other!r})" if other else nearest(str(key), valid)
                    raise ValueError(f"{source}: unknown key {key!r} in section {s!r}{hint}")
                flat[key] = value
        return (base or cls()).updated(**flat)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    @classmethod
    def from_yaml(cls, text: str, base: RunSpec | None = None, source: str = "config") -> RunSpec:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{source}: not valid YAML ({' '.join(str(e).split())})") from None
        return cls.from_dict(data or {}, base, source)

    @classmethod
    def load(cls, path: str, base: RunSpec | None = None) -> RunSpec:
        """A spec from a YAML file (`train.py --config PATH`)."""
        if not os.path.isfile(path):
            raise ValueError(f"--config {path!r} is not a file")
        with open(path, encoding="utf-8") as f:
            return cls.from_yaml(f.read(), base, source=path)

    def save(self, path: str) -> None:
        """Writes the YAML form atomically (write, then rename)."""
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_yaml())
        os.replace(tmp, path)

    # ---------------------------------------------------------------- checks and derived values
    def validate(self) -> None:
        """Every setting's type and rule; the strategy options by their registry entries; the model's
        overrides by its config class. Raises ValueError (one line)."""
        for s, cls in SECTIONS.items():
            section = getattr(self, s)
            for name in _fields(cls):
                check_setting(cls, name, getattr(section, name))
        if self.checkpoint.resume and not self.checkpoint.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        if self.checkpoint.checkpoint_every and not self.checkpoint.checkpoint_dir:
            raise ValueError(
                f"--checkpoint-every {self.checkpoint.checkpoint_every} needs --checkpoint-dir (where to save)"
            )
        paths = self.output.metrics_file, self.checkpoint.checkpoint_dir, self.output.out_dir
        metrics, ckpt, out = paths
        if metrics:
            parent = os.path.dirname(os.path.abspath(metrics))
            if os.path.isdir(metrics):
                raise ValueError(f"--metrics-file {metrics!r} is a directory; give a file name")
            if not os.path.isdir(parent) and parent != os.path.abspath(out or ckpt or parent):
                raise ValueError(f"--metrics-file {metrics!r}: directory {parent!r} does not exist")
        for flag, path in (("--checkpoint-dir", ckpt), ("--out-dir", out)):
            if path and os.path.exists(path) and not os.path.isdir(path):
                raise ValueError(f"{flag} {path!r} exists and is not a directory")
        init_from, export_hf = self.model.init_from, self.model.export_hf
        if init_from is not None and not os.path.isdir(init_from):
            raise ValueError(f"--init-from {init_from!r} is not a directory (a Hugging Face checkpoint)")
        if export_hf is not None and os.path.exists(export_hf) and not os.path.isdir(export_hf):
            raise ValueError(f"--export-hf {export_hf!r} exists and is not a directory")
        d = self.data
        for flag, path in (("--data", d.data), ("--val-data", d.val_data)):
            if path is not None and not os.path.exists(path):
                raise ValueError(f"{flag} {path!r} does not exist")
        if d.tokenizer not in (None, "bytes") and not os.path.exists(d.tokenizer):
            raise ValueError(f"--tokenizer {d.tokenizer!r} does not exist (give bytes, or a tokenizer.json)")
        if d.val_fraction >= 1:
            raise ValueError(f"--val-fraction {d.val_fraction} must be below 1 (it would hold out every document)")
        t = self.training
        if t.batch_size % t.grad_accum:
            raise ValueError(f"--batch-size {t.batch_size} is not divisible by --grad-accum {t.grad_accum}")
        from jaxring.nn import offloaded

        layer_inputs = "layer_inputs" in offloaded(self.memory.offload)
        if layer_inputs and self.memory.remat != "full":
            raise ValueError(
                f"--offload {self.memory.offload} keeps each layer's input in host memory and recomputes the rest: "
                f"it needs --remat full (got --remat {self.memory.remat})"
            )
        degrees = self.parallel.degrees()
        if degrees["pp"] > 1 and layer_inputs:
            from jaxring.train.step import OFFLOAD_WITH_PP

            raise ValueError(OFFLOAD_WITH_PP.format(offload=self.memory.offload, pp=degrees["pp"]))
        if degrees["pp"] > 1 and t.grad_accum > 1:
            raise ValueError(
                f"--grad-accum {t.grad_accum} with --pp {degrees['pp']}: the pipeline's micro-batches are the "
                f"gradient accumulation; use --microbatches instead"
            )
        from jaxring.run.task import model_family

        family = model_family(self.model.model)
        for field, value in self.model.overrides.items():
            family.check_override(field, value)

    def attention(self, device_count: int | None = None) -> str:
        """The sequence strategy: as given, else ring when sp > 1, else dense."""
        if self.parallel.attention is not None:
            return self.parallel.attention
        return "ring" if self.parallel.degrees(device_count)["sp"] > 1 else "dense"

    @property
    def compute_precision(self) -> str:
        """--precision, else the model's default: bf16 for the full-size Llama presets (llama3-8b, ...: the
        long-context figures assume it), fp32 for every other model and the tiny test twins."""
        if self.training.precision is not None:
            return self.training.precision
        llama = self.model.model == "gpt" and (self.model.preset or "").startswith("llama")
        return "bf16" if llama else "fp32"

    def resolved(self, device_count: int) -> RunSpec:
        """The spec with what defaults derive filled in: mesh degrees, the strategy, its options' defaults.
        Degrees that do not multiply to `device_count`, micro-batches that do not suit pp, and a batch that
        does not split over the data axes and micro-batches are one-line errors naming a setting that works."""
        p = dataclasses.replace(self.parallel, **self.parallel.degrees(device_count))
        check_degrees(p, device_count, self.training)
        check_batch_split(p, self.training)
        p.attention = self.attention(device_count)
        from jaxring.parallel.registry import resolve_options, sequence_strategy
        from jaxring.run.task import model_family

        if p.sp > 1:
            p.layout = sequence_strategy(p.attention).layout_for(p.layout, model_family(self.model.model).causal)
        if p.zero is None:
            p.zero = 3 if p.fsdp > 1 else 0
        p.options = resolve_options(
            p.attention,
            p.tensor_parallel if p.tp > 1 else None,
            p.pipeline_schedule,
            p.options,
            sp=p.sp,
            tp=p.tp,
            pp=p.pp,
        )
        training = dataclasses.replace(self.training, precision=self.compute_precision)
        return dataclasses.replace(self, parallel=p, training=training)

    def plan(self, devices: Sequence[jax.Device] | None = None) -> ParallelPlan:
        """The ParallelPlan the run's parallel settings name (see `make_plan`)."""
        p = self.parallel
        return make_plan(
            devices,
            **{a: getattr(p, a) for a in ParallelSettings.DEGREES},
            attention=p.attention,
            layout=p.layout,
            tensor_parallel=p.tensor_parallel,
            zero=p.zero,
            pipeline_schedule=p.pipeline_schedule,
            microbatches=p.microbatches,
            block_ops=p.block_ops,
            loss_tile=self.memory.loss_tile,
            mlp_tile=self.memory.mlp_tile,
            **p.options,
        )


def _degree_flags(degrees: Mapping[str, int]) -> str:
    return " ".join(f"--{a} {n}" for a, n in degrees.items() if n > 1) or "(every degree 1)"


def check_degrees(p: ParallelSettings, device_count: int, t: TrainingSettings) -> None:
    """ValueError naming the flags and degrees near them that work, unless p's degrees multiply to
    `device_count`. The suggestion keeps each given degree's nearest divisor of what is left, gives dp the
    rest, and adds the batch size those degrees need when --batch-size does not split over them."""
    degrees = p.degrees()
    product = math.prod(degrees.values())
    if product == device_count:
        return
    left, near = device_count, {}
    for axis in ParallelSettings.DEGREES:
        n = degrees.get(axis, 1)
        if axis == "dp" or n == 1:
            continue
        near[axis] = min((d for d in range(1, left + 1) if left % d == 0), key=lambda d: (abs(d - n), -d))
        left //= near[axis]
    near["dp"] = left
    fix = {a: near.get(a, 1) for a in ParallelSettings.DEGREES}
    parts = _batch_parts(dataclasses.replace(p, **fix), t)[0]
    batch = "" if t.batch_size % parts == 0 else f" --batch-size {-(-t.batch_size // parts) * parts}"
    raise ValueError(
        f"mesh degrees {_degree_flags(degrees)} multiply to {product}, but there are {device_count} devices (the "
        f"degrees' product must equal the device count); e.g. {_degree_flags(fix)}{batch}"
    )


def _batch_parts(p: ParallelSettings, t: TrainingSettings) -> tuple[int, dict[str, int], int]:
    """(the equal parts --batch-size splits into, the data degrees above 1, the micro-batches) for p's degrees."""
    m = (2 * p.pp if p.microbatches is None else p.microbatches) if p.pp > 1 else 1
    data = {a: getattr(p, a) for a in ("dp", "fsdp", "ep") if getattr(p, a) > 1}
    return math.prod(data.values()) * m * t.grad_accum, data, m


def _microbatch_counts(p: ParallelSettings, t: TrainingSettings, counts: range) -> list[int]:
    """The micro-batch counts among `counts` that the pipeline schedule takes and the batch splits into."""
    rows, rest = divmod(t.batch_size, _batch_parts(dataclasses.replace(p, pp=1), t)[0])
    ok = [k for k in counts if p.pipeline_schedule != "interleaved" or k % p.pp == 0]
    return [k for k in ok if not rest and rows % k == 0]


def check_batch_split(p: ParallelSettings, t: TrainingSettings) -> None:
    """ValueError naming the flags and a batch size (or micro-batch count) that works, unless --microbatches
    suits --pp and --batch-size splits into dp·fsdp·ep × micro-batches × --grad-accum equal parts. `p` has its
    degrees filled in."""
    m = p.microbatches
    if p.pp == 1 and m is not None:
        raise ValueError(f"--microbatches {m} sets the pipeline's micro-batches, but --pp is 1; drop it or set --pp")
    if p.pp > 1 and m is not None and (m < p.pp or (p.pipeline_schedule == "interleaved" and m % p.pp)):
        works = _microbatch_counts(p, t, range(p.pp, 2 * p.pp + 1))
        fix = f"use --microbatches {works[0]}" if works else f"use --microbatches {2 * p.pp} (the default, 2·pp)"
        if m < p.pp:
            raise ValueError(
                f"--microbatches {m} is less than --pp {p.pp}: every pipeline stage needs a micro-batch in flight; "
                f"{fix}"
            )
        raise ValueError(
            f"--microbatches {m} is not divisible by --pp {p.pp}, which the interleaved schedule needs (it runs "
            f"the micro-batches in groups of pp); {fix}"
        )
    parts, data, m = _batch_parts(p, t)
    if t.batch_size % parts == 0:
        return
    terms = [f"--{a} {n}" for a, n in data.items()]
    if m > 1:
        terms.append(f"--microbatches {m}" if p.microbatches is not None else f"the default --microbatches {m} = 2·pp")
    if t.grad_accum > 1:
        terms.append(f"--grad-accum {t.grad_accum}")
    fix = f"use --batch-size {-(-t.batch_size // parts) * parts}"
    fewer = _microbatch_counts(p, t, range(p.pp, m)) if m > 1 else []
    if fewer:
        fix += f", or --microbatches {max(fewer)}"
    raise ValueError(
        f"--batch-size {t.batch_size} does not split into {parts} equal parts ({' × '.join(terms)}); {fix}"
    )


def _plain(value: Any):
    """YAML-safe: tuples as lists, mappings as dicts."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _option_names() -> tuple[str, ...]:
    from jaxring.parallel.registry import all_options

    return tuple(all_options())


_PLAN_SETTINGS = (
    "attention",
    "layout",
    "tensor_parallel",
    "zero",
    "pipeline_schedule",
    "microbatches",
    "block_ops",
    "loss_tile",
    "mlp_tile",
)


def make_plan(devices: Sequence[jax.Device] | None = None, **settings) -> ParallelPlan:
    """The `ParallelPlan` that `train.py` builds from the same parallel settings, by the flags' names with
    underscores: make_plan(sp=8, attention="ring", layout="zigzag", tp=2, tensor_parallel="megatron", pp=2,
    pipeline_schedule="1f1b", microbatches=4, team_size=..., ...). Degrees not given are 1; with none given,
    sp is the device count. devices: default `jax.devices()`."""
    import jax

    from jaxring.core.mesh import make_mesh
    from jaxring.parallel.plan import ParallelPlan

    allowed = set(ParallelSettings.DEGREES) | set(_PLAN_SETTINGS) | set(_option_names())
    for name, value in settings.items():
        if name not in allowed:
            raise ValueError(f"make_plan: unknown parallel setting {name!r}{nearest(name, allowed)}")
        for section in (ParallelSettings, MemorySettings):
            if name in _fields(section) and value is not None:
                check_setting(section, name, value)
    devices = list(jax.devices() if devices is None else devices)
    p = ParallelSettings(**{k: settings.get(k) for k in ParallelSettings.DEGREES})
    degrees = p.degrees(len(devices))
    attention = settings.get("attention") or ("ring" if degrees["sp"] > 1 else "dense")
    kwargs = {k: settings[k] for k in _PLAN_SETTINGS if settings.get(k) is not None and k != "attention"}
    options = {k: v for k, v in settings.items() if k not in allowed - set(_option_names()) and v is not None}
    mesh = make_mesh(**degrees, devices=devices)
    return ParallelPlan(mesh, attention=attention, **kwargs, **options)
