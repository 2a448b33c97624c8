"""What the planner searches: a workload (model, sequence, global batch) and candidate plans for it.

    workload = Workload.of("gpt", "7b", seq_len=131072, global_batch_tokens=4 * 2**20)
    candidate = Candidate.of(sp=16, tp=4, attention="wallfacer", team_size=2, tensor_parallel="megatron", zero=1)
    plan = candidate.check(workload)         # a jaxring.ParallelPlan on stand-in devices (validation only)
    candidate.settings(workload)             # the run specification's flat settings (train.py's flags)

A candidate is what `train.py` takes as settings: mesh degrees, the sequence strategy, the tensor method, the
ZeRO stage, the pipeline schedule, the memory choices (the run's own `MemorySettings`: remat, tiles, offload),
the registry entries' own options (by their names) and the micro-batch. `plan()` builds the
`ParallelPlan` (the library's own validation: one-line ValueErrors) on stand-in devices, so a 64-device plan can
be checked on a laptop; `check(workload)` adds the model's own rules (`models/*.check_plan`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from jax.sharding import AxisType, Mesh

from jaxring.core.mesh import MESH_AXES, make_mesh
from jaxring.core.precision import PRECISIONS
from jaxring.parallel.catalog import pipeline_schedule, sequence_strategy, tensor_method
from jaxring.parallel.cost_terms import WorkloadTerms
from jaxring.parallel.plan import ParallelPlan
from jaxring.parallel.settings import ParallelSettings, read_by_name
from jaxring.run.schema import MEMORY_BUDGETS, MemorySettings, parsed_setting
from jaxring.run.task import model_family

if TYPE_CHECKING:
    import jax

    from jaxring.nn.moe.config import MoEConfig
    from jaxring.parallel.registry import HasOptions
    from jaxring.run.task import ModelFamily


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model (GPT or DiT config), tokens per sequence, sequences per step and the compute precision;
    documents: the batches are packed documents (int32 segment ids travel with K/V; the family must pack them:
    its `ModelFamily.documents`)."""

    model: str
    config: object
    seq_len: int
    global_batch: int
    precision: str = "bf16"
    preset: str | None = None
    documents: bool = False

    def __post_init__(self):
        if self.documents and self.family.documents is None:
            raise ValueError(f"documents=True: the {self.model} family trains on no packed documents")

    @classmethod
    def of(
        cls,
        model: str,
        preset: str,
        *,
        seq_len: int | None = None,
        global_batch_tokens: int | None = None,
        global_batch: int | None = None,
        precision: str = "bf16",
        image_size: int | None = None,
        documents: bool = False,
        **overrides,
    ) -> Workload:
        """A workload from a preset. GPT: seq_len tokens per sequence. DiT: image_size (or the square patch grid
        nearest to seq_len, its side a multiple of 8 so the tokens split over sp). The global batch is given in
        sequences, or in tokens (rounded down to whole sequences, at least one)."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
        family = model_family(model)
        if family.causal and seq_len is None:
            raise ValueError(f"a {model} workload needs --seq-len")
        config = family.config_for_workload(preset, seq_len=seq_len, image_size=image_size, **overrides)
        tokens = family.tokens(config, seq_len)
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"seq_len {tokens!r} must be a positive integer")
        if global_batch is None:
            if global_batch_tokens is None:
                global_batch = 1
            else:
                if global_batch_tokens < 1:
                    raise ValueError(f"global batch {global_batch_tokens} tokens must be positive")
                global_batch = max(1, global_batch_tokens // tokens)
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"global batch {global_batch!r} must be a positive number of sequences")
        return cls(model, config, tokens, global_batch, precision, preset, documents)

    @property
    def family(self) -> ModelFamily:
        return model_family(self.model)

    @property
    def causal(self) -> bool:
        return self.family.causal

    @property
    def terms(self) -> WorkloadTerms:
        """The family's `jaxring.parallel.cost_terms.WorkloadTerms` (what the cost model adds beyond the blocks)."""
        return self.family.planner_terms or WorkloadTerms()

    @property
    def image_size(self) -> int | None:
        """The image side of an image workload (its config's image_size), else None."""
        return getattr(self.config, "image_size", None)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch

    @property
    def moe(self) -> MoEConfig | None:
        return getattr(self.config, "moe", None)

    def flops_per_step(self) -> float:
        """Model FLOPs of one step (the playbook's 6N per token plus attention, causal halved)."""
        return self.family.flops_per_step(self.config, self.seq_len, self.global_batch)

    def describe(self) -> str:
        name = self.preset or self.model
        what = f"{self.image_size}² images = {self.seq_len:,} tokens" if self.image_size else f"{self.seq_len:,} tokens"
        what += " of packed documents" if self.documents else ""
        return f"{self.model} {name}, {what} × {self.global_batch} per step, {self.precision}"


# a candidate's memory choices by default: nothing recomputed, tiled or offloaded
NO_MEMORY_CHOICES = MemorySettings()


# a candidate's parallel settings by default: one device, nothing split
ONE_DEVICE = ParallelSettings(dp=1, fsdp=1, pp=1, tp=1, sp=1, ep=1, zero=0)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan the planner may pick: the run's own parallel settings (`parallel`: degrees, strategies, the
    entries' options; dp counts fsdp, whose program is the same) and memory choices (`memory`: the run's
    `MemorySettings`, budgets left out) as they are, and the micro-batch. A parallel setting reads by its name
    (c.sp, c.attention, c.options: `read_by_name`); `Candidate.of`, `with_parallel` and `with_memory` take
    settings by their flat names (sp=8, team_size=2, remat="full", offload="layer_inputs")."""

    parallel: ParallelSettings = ONE_DEVICE
    memory: MemorySettings = NO_MEMORY_CHOICES
    micro_batch: int = 1  # sequences per data replica in one micro-step (pp = 1) or micro-batch (pp > 1)

    def __post_init__(self):
        p = self.parallel
        if type(p) is not ParallelSettings or None in (p.dp, p.fsdp, p.pp, p.tp, p.sp, p.ep, p.zero, p.attention):
            # the defaults a candidate states: degrees of 1, ZeRO stage 0, the attention sp implies
            plain = {f: getattr(p, f) for f in READ_BY_NAME} | p.degrees() | {"zero": p.zero or 0}
            plain["attention"] = p.attention_for(plain["sp"])
            object.__setattr__(self, "parallel", ParallelSettings(**plain))
        if any(getattr(self.memory, b) is not None for b in MEMORY_BUDGETS):
            object.__setattr__(self, "memory", self.memory.choice())

    @classmethod
    def of(cls, **settings) -> Candidate:
        """A candidate from flat settings: the parallel settings, the memory choices, the micro-batch and any
        other name as an entry's option (Candidate.of(sp=8, attention="wallfacer", team_size=2, remat="full"))."""
        memory = {k: v for k, v in settings.items() if k in MEMORY_CHOICES}
        own = {k: settings[k] for k in ("memory", "micro_batch") if k in settings}
        parallel = {k: v for k, v in settings.items() if k not in memory and k not in own}
        return cls(ParallelSettings.of(**parallel), **own).with_memory(**memory)

    def with_parallel(self, **settings) -> Candidate:
        """A copy with parallel settings changed by their names (options: `options=`, the whole mapping)."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, **settings))

    def with_memory(self, **choices) -> Candidate:
        """A copy with memory choices changed by their flat names (a typed one's text form is parsed)."""
        if not choices:
            return self
        parsed = {k: parsed_setting(MemorySettings, k, v) for k, v in choices.items()}
        return dataclasses.replace(self, memory=dataclasses.replace(self.memory, **parsed))

    def option(self, name: str, default: object = None) -> object:
        """The value of an entry's option (default when the candidate does not set it)."""
        return self.parallel.option(name, default)

    def setting(self, name: str) -> object:
        """A setting by its flat name: a parallel setting, a memory choice, the micro-batch or an entry's option
        (None when not set)."""
        if name in PARALLEL_FIELDS or name == "micro_batch":
            return getattr(self, name)
        if name in MEMORY_CHOICES:
            return getattr(self.memory, name)
        return self.option(name)

    @staticmethod
    def setting_names() -> tuple[str, ...]:
        """The flat names of its parallel settings, the micro-batch and the memory choices (options aside)."""
        return (*PARALLEL_FIELDS, "micro_batch", *MEMORY_CHOICES)

    @property
    def devices(self) -> int:
        return self.dp * self.pp * self.tp * self.sp * self.ep

    @property
    def data_degree(self) -> int:
        return self.dp * self.ep

    def mesh_degrees(self) -> dict:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "sp": self.sp, "ep": self.ep}

    def _entries(self) -> list:
        """The registry entries the candidate uses, with their option names: strategy, method, schedule."""
        out = [sequence_strategy(self.attention), tensor_method(self.tensor_parallel)]
        if self.pp > 1:
            out.append(pipeline_schedule(self.pipeline_schedule))
        return out

    def _live_options(self) -> list[tuple[str, object]]:
        """The options, those of the entries in force in their entries' order, then any other (which the plan
        refuses, naming the entries that take it)."""
        given = self.options
        names = [n for e in self._entries() for n in e.option_names()]
        return [(n, given[n]) for n in names if n in given] + [(n, v) for n, v in given.items() if n not in names]

    def steps(self, workload: Workload) -> int:
        """Micro-steps per step: gradient accumulation (pp = 1) or the pipeline's micro-batches."""
        return workload.global_batch // (self.data_degree * self.micro_batch)

    def plan(self, devices: Sequence[jax.Device] | None = None, block_ops: str | None = None) -> ParallelPlan:
        """The ParallelPlan (raises the library's one-line ValueError when the combination is not allowed).
        devices: real devices (a list of device count), or None for stand-ins (validation and the run-mesh
        view only; nothing can be compiled on them). block_ops: the attention's per-block compute, default the
        candidate's ("pallas" for a GPU target compiled without a GPU, where "auto" would pick the CPU path)."""
        mesh = _mesh(self.dp, self.pp, self.tp, self.sp, self.ep) if devices is None else _real_mesh(self, devices)
        return ParallelPlan(mesh, self._plan_settings(block_ops or self.block_ops), **self.memory.plan_keywords())

    def _plan_settings(self, block_ops: str) -> ParallelSettings:
        """The parallel settings as the plan takes them: the options in force only (a schedule's aside when
        pp = 1), those of no entry kept for the plan to refuse."""
        p = self.parallel
        if self.pp == 1:
            p = dataclasses.replace(p, pipeline_schedule=ONE_DEVICE.pipeline_schedule, microbatches=None)
        return dataclasses.replace(p, block_ops=block_ops, options=self._live_options())

    def check(
        self, workload: Workload, devices: Sequence[jax.Device] | None = None, block_ops: str | None = None
    ) -> ParallelPlan:
        """The plan, after the model's own rules (heads, layers vs pp, experts vs ep, batch and sequence splits)
        for this workload. Raises ValueError (one line)."""
        plan = self.plan(devices, block_ops)
        _ = plan.run_mesh  # the strategy's and the method's views of the devices (their errors)
        steps = self.steps(workload)
        if steps < 1 or workload.global_batch % (self.data_degree * self.micro_batch):
            raise ValueError(
                f"global batch {workload.global_batch} is not divisible by data degree "
                f"dp*ep {self.data_degree} × micro-batch {self.micro_batch}"
            )
        if self.pp > 1 and plan.schedule.num_microbatches != steps:
            raise ValueError(
                f"pipeline micro-batches {plan.schedule.num_microbatches} != global batch / "
                f"(data degree × micro-batch) = {steps}"
            )
        batch = workload.global_batch // max(1, steps if self.pp == 1 else 1)
        workload.family.check_plan(workload.config, plan, batch, workload.seq_len)
        return plan

    def settings(self, workload: Workload | None = None) -> dict:
        """The run specification's flat settings of this plan (`RunSpec.updated(**settings)`, `make_plan`): every
        parallel setting but those the planner does not choose (NOT_CHOSEN; the schedule's when pp = 1), the memory
        choices and the options; with the workload, grad_accum too (the micro-steps when pp = 1)."""
        unset = (*NOT_CHOSEN, *(PIPELINE_FIELDS if self.pp == 1 else ()))
        out = {name: getattr(self, name) for name in PARALLEL_FIELDS if name not in unset}
        out["attention"] = self.attention if self.sp > 1 else None
        out.update(self.memory.choices())
        out.update(self._live_options())
        if workload is not None:
            out["grad_accum"] = self.steps(workload) if self.pp == 1 else 1
        return out

    def train_flags(self) -> list[str]:
        """The train.py flags of this plan: its settings that differ from the run specification's defaults."""
        flags = []
        for name, value in self.settings().items():
            if value is None or value == _FLAG_DEFAULTS.get(name):
                continue
            flags += ["--" + name.replace("_", "-"), str(value)]
        return flags

    def describe(self) -> str:
        degrees = " ".join(f"{a}{s}" for a, s in self.mesh_degrees().items() if s > 1) or "1 device"
        parts = [degrees]
        entries = self._entries()
        given = dict(self._live_options())

        def opts(entry: HasOptions, *first):
            items = [*first, *(f"{n}={given[n]}" for n in entry.option_names() if n in given)]
            return f"({','.join(items)})" if items else ""

        if self.sp > 1:
            parts.append(self.attention + opts(entries[0]))
        if self.tensor_parallel:
            parts.append(self.tensor_parallel + opts(entries[1]))
        elif changed := entries[1].changed_options(given):  # no tensor method: its options (over sp)
            parts.append(",".join(f"{k}={v}" for k, v in changed.items()))
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.pp > 1:
            parts.append(self.pipeline_schedule + opts(entries[2], f"m={self.microbatches}"))
        parts += [f"{n}={v}" for n, v in self.memory.choices().items() if v != DEFAULT_MEMORY_CHOICES[n]]
        parts.append(f"mb={self.micro_batch}")
        return " ".join(parts)


# the parallel settings a candidate reads by name (options included), their flat names, the memory choices' names
READ_BY_NAME = frozenset(f.name for f in dataclasses.fields(ParallelSettings))
PARALLEL_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelSettings) if f.name != "options")
# the parallel settings a plan of the planner leaves as the run has them: the per-block compute (not searched:
# `--plan auto` keeps the user's); and those of the pipeline schedule, which only pp > 1 sets
NOT_CHOSEN = ("block_ops",)
PIPELINE_FIELDS = ("pipeline_schedule", "microbatches")
DEFAULT_MEMORY_CHOICES = NO_MEMORY_CHOICES.choices()
MEMORY_CHOICES = tuple(DEFAULT_MEMORY_CHOICES)
# settings train.py need not be told: a candidate's defaults (degrees of 1, ZeRO 0, ...) and no memory choice
_FLAG_DEFAULTS = {name: getattr(ONE_DEVICE, name) for name in PARALLEL_FIELDS} | DEFAULT_MEMORY_CHOICES
# c.sp, c.attention, c.options, ...: the candidate's parallel settings, read by their names
read_by_name(Candidate, "parallel", sorted(READ_BY_NAME))


class _StandIn:
    """A device stand-in: a mesh of these validates a plan and builds its run-mesh view (never compiled)."""

    def __init__(self, i: int):
        self.id = i
        self.platform = "stand-in"
        self.process_index = 0

    def __repr__(self):
        return f"StandIn({self.id})"


@functools.lru_cache(maxsize=4096)
def _mesh(dp: int, pp: int, tp: int, sp: int, ep: int) -> Mesh:
    sizes = {"dp": dp, "pp": pp, "fsdp": 1, "ep": ep, "sp": sp, "tp": tp}
    n = dp * pp * tp * sp * ep
    devices = np.array([_StandIn(i) for i in range(n)], dtype=object).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _real_mesh(c: Candidate, devices: Sequence[jax.Device]) -> Mesh:
    return make_mesh(dp=c.dp, pp=c.pp, tp=c.tp, sp=c.sp, ep=c.ep, devices=list(devices))
