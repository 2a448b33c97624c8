"""What a training run reports: per-device peak FLOP/s for MFU, device memory, the progress bar."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxring.core.accelerators import device_spec_of

if TYPE_CHECKING:
    from jaxring.run.spec import RunSpec


def peak_flops(device: jax.Device, precision: str) -> float | None:
    """Per-device peak FLOP/s for MFU (`jaxring.core.accelerators`), or None (CPU, unknown device)."""
    spec = device_spec_of(device)
    return None if spec is None else spec.peak_flops(precision)


def peak_memory_bytes() -> int | None:
    """Peak bytes in use on the first local device, or None where the backend does not say (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


PROFILE_STEPS = 3


def profile_steps(start: int, end: int) -> tuple[int, int] | None:
    """[first, last) steps to trace: up to PROFILE_STEPS steps after the first one of this run (which
    compiles), or the first step itself when the run is that short."""
    if end <= start:
        return None
    first = start + 1 if end - start > 1 else start
    return first, min(first + PROFILE_STEPS, end)


def progress_bar(spec: RunSpec, start: int, is_main: bool) -> Any:
    """A tqdm bar over the run's steps (None when progress is off or on other hosts)."""
    if not (spec.output.progress and is_main):
        return None
    return tqdm(total=spec.training.steps, initial=start, desc="train", dynamic_ncols=True)


# ------------------------------------------------------------------------------------- what a step returns

PROGRESS_KEY = "progress"  # trainer.step()'s entry naming the metrics to show on the progress bar
MAX_LOGGED_VECTOR = 1024  # 1-D metrics up to this length are logged as lists (e.g. per-expert load)


def step_metrics(out: dict) -> tuple[dict, tuple[str, ...]]:
    """(every metric of one step as python numbers, the names to show on the progress bar).

    `out` is what `trainer.step()` returns: device scalars (or short vectors) by name, fetched here in one
    transfer; 0-d values become floats (ints for integer dtypes, bools for bool), 1-d values up to
    MAX_LOGGED_VECTOR elements become lists, larger arrays are left out. The convention for the bar:
    ``out["progress"]`` may hold a tuple of metric names (a host-side entry, not logged); "loss" is always
    shown.
    """
    progress = tuple(out.get(PROGRESS_KEY, ()))
    values = jax.device_get({k: v for k, v in out.items() if k != PROGRESS_KEY})
    record = {}
    for name, value in values.items():
        a = np.asarray(value)
        if a.dtype.kind not in "biuf":
            continue
        if a.ndim == 0:
            record[name] = bool(a) if a.dtype.kind == "b" else int(a) if a.dtype.kind in "iu" else float(a)
        elif a.ndim == 1 and a.size <= MAX_LOGGED_VECTOR:
            record[name] = a.tolist()
    return record, progress


def progress_postfix(record: dict, keys: tuple[str, ...]) -> dict:
    """The progress bar's fields: loss, the step's progress metrics, tokens/s and MFU."""
    fields = {"loss": f"{record['loss']:.4f}"}
    for key in keys:
        value = record.get(key)
        if isinstance(value, float):
            fields[key] = f"{value:.4g}"
        elif value is not None:
            fields[key] = str(value)
    fields["tok_s"] = f"{record['tokens_per_s']:,.0f}"
    fields["mfu"] = "n/a" if record.get("mfu") is None else f"{100 * record['mfu']:.1f}%"
    return fields


def drop_rows_after(path: str | os.PathLike, step: int) -> int:
    """Removes the rows of metrics file `path` whose "step" is after `step` (and unreadable lines: a row cut
    short by a kill), so a resumed run does not log those steps twice. Returns how many rows went."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.read().splitlines()
    keep = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            keep.append(line)
    if len(keep) != len(lines):
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
    return len(lines) - len(keep)


# ------------------------------------------------------------------------------------- where metrics go


def _scalars(record: dict) -> dict[str, float]:
    """The record's numbers (bools and lists left out): what TensorBoard and W&B plot."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
    }


class TensorBoardWriter:
    """Scalars as TensorBoard event files in `directory` (the `tensorboard` package's event writer: the
    optional extra ``tensorboard``). One event per metric per step, tagged "train/NAME"."""

    def __init__(self, directory: str):
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ValueError(
                f"--tensorboard {directory!r} needs the tensorboard package: pip install 'jaxring[tensorboard]'"
            ) from None
        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(directory)

    def write(self, record: dict) -> None:
        values = [self._summary.Value(tag=f"train/{k}", simple_value=v) for k, v in _scalars(record).items()]
        self._writer.add_event(
            self._event(
                step=int(record["step"]), wall_time=record.get("wall_time", 0.0), summary=self._summary(value=values)
            )
        )
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """Scalars to a Weights & Biases run of `project` (the optional extra ``wandb``; WANDB_MODE=offline
    writes locally)."""

    def __init__(self, project: str, config: dict, directory: str | None):
        try:
            import wandb
        except ImportError:
            raise ValueError(f"--wandb {project!r} needs the wandb package: pip install 'jaxring[wandb]'") from None
        self._run = wandb.init(project=project, config=config, dir=directory, reinit=True)

    def write(self, record: dict) -> None:
        self._run.log(_scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


class MetricsLog:
    """Every logged step to the JSON-lines file and, when asked for, TensorBoard and W&B (primary process
    only). write(record) takes one step's record; close() flushes and closes them all."""

    def __init__(self, spec: RunSpec, is_main: bool):
        out = spec.output
        self.sinks = []
        path = out.metrics_path()
        self.file = open(path, "a") if (path and is_main) else None  # noqa: SIM115 (closed by close())
        if is_main and out.tensorboard:
            self.sinks.append(TensorBoardWriter(out.tensorboard))
        if is_main and out.wandb:
            try:
                self.sinks.append(WandbWriter(out.wandb, spec.flat(), out.out_dir))
            except BaseException:
                self.close()
                raise

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(json_safe(record)) + "\n")
            self.file.flush()
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def json_safe(record: dict) -> dict:
    """NaN/Inf as null (JSON has no NaN)."""

    def fix(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return {k: fix(v) for k, v in record.items()}


def host_memory_bytes() -> int:
    """This process's peak resident memory (bytes): the memory figure where the device gives none (CPU)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
