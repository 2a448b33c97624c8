"""The run specification: a whole training run as one typed value, by sections of settings
(`jaxring.run.schema`), with its flat names, its YAML form, its checks and what it resolves to.

    spec = RunSpec.of(sp=8, attention="ring", steps=50)         # flat names: the flags with underscores
    spec = RunSpec.from_yaml(open("run.yaml").read())           # sections, as --print-config writes them
    spec.parallel.sp, spec.training.steps                       # typed sections
    print(spec.to_yaml())
    spec.validate(); spec = spec.resolved(device_count=8); plan = spec.plan()

`train.py`'s command line (`jaxring.run.cli`), the YAML form (`--config`, `--print-config`, the `run.yaml`
every run writes) and the planner's candidates are this spec; `jaxring.make_plan(**settings)`
(`jaxring.run.make_plan`) builds the plan of its parallel section.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import yaml

from jaxring.core.suggest import nearest
from jaxring.parallel.catalog import resolve_options, sequence_strategy
from jaxring.parallel.plan import DEFAULT_TENSOR_PARALLEL, ParallelPlan
from jaxring.run.checks import check_batch_split, check_degrees, check_spec
from jaxring.run.make_plan import plan_on
from jaxring.run.schema import (
    SECTIONS,
    CheckpointSettings,
    ClusterSettings,
    DataSettings,
    GuardSettings,
    MemorySettings,
    ModelSettings,
    OptimizerSettings,
    OutputSettings,
    ParallelSection,
    TrainingSettings,
    check_setting,
    flat_index,
    option_names,
    parsed_setting,
    setting_fields,
)
from jaxring.run.task import model_family

__all__ = ["RunSpec"]


@dataclasses.dataclass
class RunSpec:
    """A whole run: one typed section per concern (see SECTIONS)."""

    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    training: TrainingSettings = dataclasses.field(default_factory=TrainingSettings)
    memory: MemorySettings = dataclasses.field(default_factory=MemorySettings)
    optimizer: OptimizerSettings = dataclasses.field(default_factory=OptimizerSettings)
    parallel: ParallelSection = dataclasses.field(default_factory=ParallelSection)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    checkpoint: CheckpointSettings = dataclasses.field(default_factory=CheckpointSettings)
    output: OutputSettings = dataclasses.field(default_factory=OutputSettings)
    guard: GuardSettings = dataclasses.field(default_factory=GuardSettings)
    cluster: ClusterSettings = dataclasses.field(default_factory=ClusterSettings)
    # the device count `resolved` resolved and validated it for (None: not yet; a changed copy is not)
    resolved_for: int | None = dataclasses.field(default=None, compare=False, repr=False)

    # ---------------------------------------------------------------- flat names
    @classmethod
    def of(cls, **settings) -> RunSpec:
        """A spec from flat setting names (the flags with underscores): RunSpec.of(sp=8, steps=50). A name
        that is no section's setting must be a registered option (team_size=2, ...)."""
        return cls().updated(**settings)

    def updated(self, **settings) -> RunSpec:
        """A copy with the flat `settings` changed (checked by `validate`, not here)."""
        index = flat_index()
        changes = {s: {} for s in SECTIONS}
        options = dict(self.parallel.options)
        for name, value in settings.items():
            if name in index:
                changes[index[name]][name] = parsed_setting(SECTIONS[index[name]], name, value)
            elif name in option_names():
                options[name] = value
            else:
                raise ValueError(f"unknown setting {name!r}{nearest(name, list(index) + list(option_names()))}")
        changes["parallel"]["options"] = options
        return RunSpec(**{s: dataclasses.replace(getattr(self, s), **changes[s]) for s in SECTIONS})

    def flat(self) -> dict:
        """Every setting by its flat name (options included), as written in YAML and JSON (a typed setting such as
        `Offload` as its text form): what checkpoints, multi-host agreement and loggers record."""
        out = {}
        for s in SECTIONS:
            for name in setting_fields(SECTIONS[s]):
                if name != "options":
                    out[name] = _plain(getattr(getattr(self, s), name))
        out.update({k: _plain(v) for k, v in self.parallel.options.items()})
        return out

    # ---------------------------------------------------------------- YAML
    def to_dict(self) -> dict:
        """{section: {setting: value}}, the parallel section's options as flat keys."""
        out = {}
        for s, cls in SECTIONS.items():
            section = getattr(self, s)
            out[s] = {n: _plain(getattr(section, n)) for n in setting_fields(cls) if n != "options"}
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
            names = [n for n in setting_fields(SECTIONS[s]) if n != "options"]
            valid = names + (list(option_names()) if s == "parallel" else [])
            for key, value in values.items():
                if key not in valid:
                    other = flat_index().get(key)
                    hint = f" (it belongs in section {other!r})" if other else nearest(str(key), valid)
                    raise ValueError(f"{source}: unknown key {key!r} in section {s!r}{hint}")
                flat[key] = value
        return (base or cls()).updated(**flat)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    @classmethod
    def from_yaml(cls, text: str, base: RunSpec | None = None, source: str = "config") -> RunSpec:
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
            for name in setting_fields(cls):
                check_setting(cls, name, getattr(section, name))
        check_spec(self)

    def attention(self, device_count: int | None = None) -> str:
        """The sequence strategy: as given, else ring when sp > 1, else dense."""
        return self.parallel.attention_for(self.parallel.degrees(device_count)["sp"])

    @property
    def compute_precision(self) -> str:
        """--precision, else the default: bf16 for the full-size Llama presets (llama3-8b, ...: the long-context
        figures assume it) and for every model on a TPU (its matrix units' type), fp32 for every other model and
        the tiny test twins."""
        if self.training.precision is not None:
            return self.training.precision
        llama = self.model.model == "gpt" and (self.model.preset or "").startswith("llama")
        return "bf16" if llama or jax.default_backend() == "tpu" else "fp32"

    def resolved(self, device_count: int) -> RunSpec:
        """The spec with what defaults derive filled in: mesh degrees, the strategy, layout, tensor method and ZeRO
        stage, the entries' options' defaults, then validated (`validate`): the one place a run is resolved and checked, marked `resolved_for` so
        that the loop and the `Trainer` take it as it is. Degrees that do not multiply to `device_count`,
        micro-batches that do not suit pp, and a batch that does not split over the data axes and
        micro-batches are one-line errors naming a setting that works."""
        if self.resolved_for == device_count:
            return self
        p = dataclasses.replace(self.parallel, **self.parallel.degrees(device_count))
        check_degrees(p, device_count, self.training)
        check_batch_split(p, self.training)
        attention, layout = p.attention_for(p.sp), p.layout
        tensor_parallel = (p.tensor_parallel or DEFAULT_TENSOR_PARALLEL) if p.tp > 1 else p.tensor_parallel
        if p.sp > 1:
            layout = sequence_strategy(attention).layout_for(layout, model_family(self.model.model).causal)
        p = dataclasses.replace(
            p,
            attention=attention,
            layout=layout,
            tensor_parallel=tensor_parallel,
            zero=(3 if p.fsdp > 1 else 0) if p.zero is None else p.zero,
            options=resolve_options(
                attention,
                tensor_parallel if p.tp > 1 else None,
                p.pipeline_schedule,
                p.options,
                sp=p.sp,
                tp=p.tp,
                pp=p.pp,
            ),
        )
        training = dataclasses.replace(self.training, precision=self.compute_precision)
        spec = dataclasses.replace(self, parallel=p, training=training)
        spec.validate()
        return dataclasses.replace(spec, resolved_for=device_count)

    def plan(self, devices: Sequence[jax.Device] | None = None) -> ParallelPlan:
        """The ParallelPlan of the run's parallel settings and tiles on `devices` (default `jax.devices()`)."""
        return plan_on(devices, self.parallel.settings(), self.memory)


def _plain(value: Any):
    """YAML-safe: tuples as lists, mappings as dicts, a typed setting (e.g. `Offload`) as its text form."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
