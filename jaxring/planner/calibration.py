"""The cost model's fitted terms, as data: one JSON file per target in `jaxring/planner/calibrations/`.

    k = calibration("gpu")          # Calibration: k.recomputed_stream_arrays, k.layer_working_share["full"], ...
    JAXRING_CALIBRATION=DIR_OR_FILE # another calibration: a folder of <target>.json, or one file for every target

`cost_model.py` keeps the structure of the memory and time model; the numbers fitted on recorded compiles live
here, each with its unit, meaning and the compiles it was fitted on (`fitted_on`). Targets: "cpu" (simulated
CPU devices, XLA:CPU) and "gpu" (accelerators; TPU estimates use it until a TPU fit is recorded: on the recorded
v5p-16 compiles it is 0.69-1.14x the compiled bytes, docs/memory-model.md). A file's
`by_xla_version` maps a JAX version prefix ("0.13") to the values that differ there. A term named
"<entry>.<term>" is a registry entry's own (a sequence strategy's: `Calibration.fitted_terms`, read by its cost
model as `shape.fitted[term]`). The files are rewritten by
`benchmarks/refit_calibration.py` from recorded compiles; `docs/memory-model.md` tells how each was fitted.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from importlib import resources
from pathlib import Path

import jax

from jaxring.parallel.cost_terms import FittedTerms

__all__ = ["ENV", "TARGETS", "Calibration", "calibration", "load"]

ENV = "JAXRING_CALIBRATION"
TARGETS = ("cpu", "gpu")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One target's fitted terms (units and meanings: the JSON's entries)."""

    target: str
    source: str  # the file it was read from
    recomputed_stream_arrays: float
    recomputed_untiled_mlp_arrays: float
    untiled_mlp_backward_arrays: float
    layer_working_share: dict  # remat mode: share
    tiled_mlp_saving: float
    tiled_mlp_saving_recomputed: float
    tiled_block_saving: float
    tiled_block_saving_core_peak: float
    tiled_block_saving_in_blocks: float
    pipeline_tick_chunks: int
    offloaded_moments_in_flight: float
    offloaded_update_in_flight: float
    offloaded_weights_gathers_saving: float
    update_peak_zero0: float
    kernels_per_layer: int
    kernel_overhead_s: float
    block_compute_speed: dict  # block_ops: the attention FLOPs' speed relative to the stated efficiency's
    # the registry entries' own terms, from the file's "<entry>.<term>" names: {entry: {term: value}}
    entry_terms: dict = dataclasses.field(default_factory=dict)

    def fitted_terms(self, entry: str) -> FittedTerms:
        """`entry`'s own terms (a sequence strategy's, read by its cost model as `shape.fitted[term]`)."""
        return FittedTerms(entry, self.source, tuple(sorted(self.entry_terms.get(entry, {}).items())))


TERMS = tuple(f.name for f in dataclasses.fields(Calibration) if f.name not in ("target", "source", "entry_terms"))


def _file(target: str, override: str | None) -> tuple[str, str]:
    """(the JSON text, where it came from) of `target`'s calibration."""
    if target not in TARGETS:
        raise ValueError(f"calibration target {target!r} is not one of {', '.join(TARGETS)}")
    if override:
        path = Path(override)
        path = path / f"{target}.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(
                f"{ENV}={override!r}: no calibration file {str(path)!r} (a folder of <target>.json or one file)"
            )
        return path.read_text(), str(path)
    entry = resources.files("jaxring.planner").joinpath("calibrations", f"{target}.json")
    return entry.read_text(), f"jaxring/planner/calibrations/{target}.json"


def load(text: str, source: str, target: str, xla_version: str) -> Calibration:
    """The Calibration of a calibration file's text for `xla_version` (its `by_xla_version` entries whose key
    prefixes the version override the terms, longest key last). ValueError naming a missing or unknown term."""
    data = json.loads(text)
    values = {name: entry["value"] for name, entry in data["terms"].items()}
    for prefix in sorted(data.get("by_xla_version", {}), key=len):
        if xla_version == prefix or xla_version.startswith(prefix + "."):
            values.update(data["by_xla_version"][prefix])
    entry_terms: dict = {}
    for name in [n for n in values if "." in n]:  # a registry entry's own term, "<entry>.<term>"
        entry, term = name.split(".", 1)
        entry_terms.setdefault(entry, {})[term] = values.pop(name)
    missing = [t for t in TERMS if t not in values]
    unknown = [t for t in values if t not in TERMS]
    if missing or unknown:
        raise ValueError(
            f"calibration {source}: missing terms {missing}, unknown terms {unknown} (expected exactly {list(TERMS)})"
        )
    return Calibration(target=target, source=source, entry_terms=entry_terms, **values)


@functools.lru_cache(maxsize=16)
def _cached(target: str, override: str | None, xla_version: str) -> Calibration:
    text, source = _file(target, override)
    return load(text, source, target, xla_version)


def calibration(target: str) -> Calibration:
    """The fitted terms for `target` ("cpu" or "gpu") at this JAX version: the packaged file, or the one
    JAXRING_CALIBRATION names."""
    return _cached(target, os.environ.get(ENV) or None, jax.__version__)
