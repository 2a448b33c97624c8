"""The checks across settings of a run, and the batch arithmetic they need: what no single setting's rule
(`jaxring.run.schema.check_setting`) can see. Each is a one-line ValueError naming the flags and, where one
exists, a setting that works.

    check_spec(spec)                       # paths, checkpointing, data, memory techniques, the model's overrides
    check_degrees(parallel, 8, training)   # the mesh degrees multiply to the device count
    check_batch_split(parallel, training)  # the batch splits over the data axes, micro-batches, accumulation
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from jaxring.core.mesh import DATA_AXES
from jaxring.parallel.catalog import pipeline_schedule, pipeline_schedules
from jaxring.run.schema import DEGREES, ParallelSettings, TrainingSettings
from jaxring.run.task import model_family

if TYPE_CHECKING:
    from jaxring.run.spec import RunSpec

__all__ = [
    "OFFLOAD_WITH_PP",
    "WEIGHTS_OFFLOAD_RULES",
    "batch_parts",
    "check_batch_split",
    "check_block_ops",
    "check_degrees",
    "check_spec",
]

# The pipeline interpreter keeps each micro-batch's residuals in device buffers shared by its schedule's branches
# what --offload weights does not compose with (the train step's refusals)
WEIGHTS_OFFLOAD_RULES = {
    "grad_accum": (
        "--offload {offload} keeps the gradients in host memory and accumulates none there: "
        "--grad-accum {grad_accum} needs --offload optimizer or layer_inputs+optimizer instead"
    ),
    "zero": (
        "--offload {offload} with --zero {zero}: weights in host memory are reduced as the backward forms "
        "their gradients, which ZeRO stage 0 or 3 does over the replica axes ({axes}); use --zero 3"
    ),
}

OFFLOAD_WITH_PP = (
    "--offload {offload} is not supported with pipeline parallelism (pp = {pp}): the pipeline keeps its "
    "micro-batches' layer inputs and its stages' weights in device buffers; use --offload optimizer or pp = 1"
)


# ------------------------------------------------------------------------------------------ the whole spec


# the block computes whose kernels compile for one accelerator: the platform, and what to use elsewhere
KERNEL_PLATFORMS = {
    "pallas": ("gpu", "a GPU", "pallas_interpret (the same kernel, interpreted: slow)"),
    "pallas_tpu": ("tpu", "a TPU", "pallas_tpu_interpret (the same kernels in TPU interpret mode: slow)"),
}


def check_block_ops(block_ops: str, platform: str) -> None:
    """--block-ops pallas (pallas_tpu) compiles the Pallas kernels for a GPU (a TPU): on other devices it would fail
    only when the step compiles (JAX's "Only interpret mode is supported on CPU backend"), so it is refused before
    anything is built."""
    if block_ops not in KERNEL_PLATFORMS or KERNEL_PLATFORMS[block_ops][0] == platform:
        return
    _, accelerator, interpreted = KERNEL_PLATFORMS[block_ops]
    raise ValueError(
        f"--block-ops {block_ops} compiles Pallas kernels for {accelerator}, and this run's devices are "
        f"{platform.upper()}s: use --block-ops auto (or jnp), or {interpreted}"
    )


def check_spec(spec: RunSpec) -> None:
    """The rules across a spec's settings (each setting's own rule is `check_setting`'s)."""
    _check_checkpointing(spec)
    _check_paths(spec)
    _check_data(spec)
    _check_memory(spec)
    family = model_family(spec.model.model)
    for field, value in spec.model.overrides.items():
        family.check_override(field, value)


def _check_checkpointing(spec: RunSpec) -> None:
    c = spec.checkpoint
    if c.resume and not c.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if c.checkpoint_every and not c.checkpoint_dir:
        raise ValueError(f"--checkpoint-every {c.checkpoint_every} needs --checkpoint-dir (where to save)")


def _check_paths(spec: RunSpec) -> None:
    """The files and directories the run reads must exist; those it writes must be creatable."""
    metrics, ckpt, out = spec.output.metrics_file, spec.checkpoint.checkpoint_dir, spec.output.out_dir
    if metrics:
        parent = os.path.dirname(os.path.abspath(metrics))
        if os.path.isdir(metrics):
            raise ValueError(f"--metrics-file {metrics!r} is a directory; give a file name")
        made_by_the_run = {os.path.abspath(p) for p in (out, ckpt) if p}  # directories the run creates
        if not os.path.isdir(parent) and parent not in made_by_the_run:
            raise ValueError(f"--metrics-file {metrics!r}: directory {parent!r} does not exist")
    for flag, path in (("--checkpoint-dir", ckpt), ("--out-dir", out)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {path!r} exists and is not a directory")
    init_from, export_hf = spec.model.init_from, spec.model.export_hf
    if init_from is not None and not os.path.isdir(init_from):
        raise ValueError(f"--init-from {init_from!r} is not a directory (a Hugging Face checkpoint)")
    if export_hf is not None and os.path.exists(export_hf) and not os.path.isdir(export_hf):
        raise ValueError(f"--export-hf {export_hf!r} exists and is not a directory")
    if spec.model.overwrite_export and export_hf is None:
        raise ValueError("--overwrite-export lets --export-hf DIR replace an earlier export; it needs --export-hf")


def _check_data(spec: RunSpec) -> None:
    d = spec.data
    for flag, path in (("--data", d.data), ("--val-data", d.val_data)):
        if path is not None and not os.path.exists(path):
            raise ValueError(f"{flag} {path!r} does not exist")
    if d.tokenizer not in (None, "bytes") and not os.path.exists(d.tokenizer):
        raise ValueError(f"--tokenizer {d.tokenizer!r} does not exist (give bytes, or a tokenizer.json)")
    if d.val_fraction >= 1:
        raise ValueError(f"--val-fraction {d.val_fraction} must be below 1 (it would hold out every document)")


def _check_memory(spec: RunSpec) -> None:
    """Gradient accumulation, host offload and remat against each other and the pipeline."""
    t, m = spec.training, spec.memory
    if t.batch_size % t.grad_accum:
        raise ValueError(f"--batch-size {t.batch_size} is not divisible by --grad-accum {t.grad_accum}")
    layer_inputs = m.offload.layer_inputs
    if layer_inputs and m.remat != "full":
        raise ValueError(
            f"--offload {m.offload} keeps each layer's input in host memory and recomputes the rest: "
            f"it needs --remat full (got --remat {m.remat})"
        )
    if m.remat_layers > 1 and m.remat != "full":
        raise ValueError(
            f"--remat-layers {m.remat_layers} recomputes blocks of layers from their inputs: it needs --remat full "
            f"(got --remat {m.remat})"
        )
    pp = spec.parallel.degrees()["pp"]
    if pp > 1 and m.offload.beyond_optimizer:
        raise ValueError(OFFLOAD_WITH_PP.format(offload=m.offload, pp=pp))
    if m.offload.weights and t.grad_accum > 1:
        raise ValueError(WEIGHTS_OFFLOAD_RULES["grad_accum"].format(offload=m.offload, grad_accum=t.grad_accum))
    if pp > 1 and t.grad_accum > 1:
        raise ValueError(
            f"--grad-accum {t.grad_accum} with --pp {pp}: the pipeline's micro-batches are the "
            f"gradient accumulation; use --microbatches instead"
        )


# ------------------------------------------------------------------------------------------ degrees and batches


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
    for axis in DEGREES:
        n = degrees.get(axis, 1)
        if axis == "dp" or n == 1:
            continue
        near[axis] = min((d for d in range(1, left + 1) if left % d == 0), key=lambda d: (abs(d - n), -d))
        left //= near[axis]
    near["dp"] = left
    fix = {a: near.get(a, 1) for a in DEGREES}
    parts = batch_parts(dataclasses.replace(p, **fix), t)[0]
    batch = "" if t.batch_size % parts == 0 else f" --batch-size {-(-t.batch_size // parts) * parts}"
    raise ValueError(
        f"mesh degrees {_degree_flags(degrees)} multiply to {product}, but there are {device_count} devices (the "
        f"degrees' product must equal the device count); e.g. {_degree_flags(fix)}{batch}"
    )


def batch_parts(p: ParallelSettings, t: TrainingSettings) -> tuple[int, dict[str, int], int]:
    """(the equal parts --batch-size splits into, the data degrees above 1, the micro-batches) for p's degrees."""
    m = (2 * p.pp if p.microbatches is None else p.microbatches) if p.pp > 1 else 1
    data = {a: getattr(p, a) for a in DATA_AXES if getattr(p, a) > 1}
    return math.prod(data.values()) * m * t.grad_accum, data, m


def _schedule_refusal(p: ParallelSettings, m: int) -> str | None:
    """What the pipeline schedule's own rule says against m micro-batches at p.pp stages (None: it takes them,
    or the schedule is unknown, which its setting's check reports)."""
    if p.pipeline_schedule not in pipeline_schedules():
        return None
    entry = pipeline_schedule(p.pipeline_schedule)
    if entry.check is None:
        return None
    options = {o.name: p.options.get(o.name, o.default) for o in entry.options}
    try:
        entry.check(p.pp, m, **options)
    except ValueError as e:
        return str(e)
    return None


def _microbatch_counts(p: ParallelSettings, t: TrainingSettings, counts: range) -> list[int]:
    """The micro-batch counts among `counts` that the pipeline schedule takes and the batch splits into."""
    rows, rest = divmod(t.batch_size, batch_parts(dataclasses.replace(p, pp=1), t)[0])
    ok = [k for k in counts if _schedule_refusal(p, k) is None]
    return [k for k in ok if not rest and rows % k == 0]


def check_batch_split(p: ParallelSettings, t: TrainingSettings) -> None:
    """ValueError naming the flags and a batch size (or micro-batch count) that works, unless --microbatches
    suits --pp and the schedule, and --batch-size splits into dp·fsdp·ep × micro-batches × --grad-accum equal
    parts. `p` has its degrees filled in."""
    m = p.microbatches
    if p.pp == 1 and m is not None:
        raise ValueError(f"--microbatches {m} sets the pipeline's micro-batches, but --pp is 1; drop it or set --pp")
    refusal = _schedule_refusal(p, m) if p.pp > 1 and m is not None and m >= p.pp else None
    if p.pp > 1 and m is not None and (m < p.pp or refusal is not None):
        works = _microbatch_counts(p, t, range(p.pp, 2 * p.pp + 1))
        fix = f"use --microbatches {works[0]}" if works else f"use --microbatches {2 * p.pp} (the default, 2·pp)"
        if m < p.pp:
            raise ValueError(
                f"--microbatches {m} is less than --pp {p.pp}: every pipeline stage needs a micro-batch in flight; "
                f"{fix}"
            )
        raise ValueError(f"--microbatches {m}: {refusal}; {fix}")
    parts, data, m = batch_parts(p, t)
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
