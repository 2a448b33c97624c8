"""Every entry of the registry, registered in one place: the sequence strategies, tensor methods and pipeline
schedules jaxring ships, then those that installed packages declare in the entry-point group `jaxring.parallel`
(pyproject: `[project.entry-points."jaxring.parallel"] mine = "my_package.mine:STRATEGY"`, each naming one
SequenceStrategy, TensorMethod or PipelineSchedule instance).

Code above the parallel layer (the plan, the run specification, the planner, the train step) looks entries up
here: importing this module guarantees they are registered.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points

from jaxring.parallel.pipeline import schedules
from jaxring.parallel.registry import (
    PipelineSchedule,
    SequenceStrategy,
    all_options,
    option_owners,
    pipeline_schedule,
    pipeline_schedules,
    register,
    registered,
    resolve_options,
    sequence_strategies,
    sequence_strategy,
    tensor_method,
    tensor_methods,
)
from jaxring.parallel.sequence import allgather, dense, ring, rsa, ulysses, usp, wallfacer
from jaxring.parallel.tensor import contract, megatron, metp, optimus
from jaxring.parallel.tensor.contract import TensorMethod

__all__ = [
    "BUILTIN_PIPELINE_SCHEDULES",
    "BUILTIN_SEQUENCE_STRATEGIES",
    "BUILTIN_TENSOR_METHODS",
    "ENTRY_POINT_GROUP",
    "all_options",
    "load_entry_points",
    "option_owners",
    "pipeline_schedule",
    "pipeline_schedules",
    "registered",
    "resolve_options",
    "sequence_strategies",
    "sequence_strategy",
    "tensor_method",
    "tensor_methods",
]

ENTRY_POINT_GROUP = "jaxring.parallel"

# in the listing's order (--help, the planner's tables); "dense" (no sequence parallelism) first
BUILTIN_SEQUENCE_STRATEGIES = tuple(m.STRATEGY for m in (dense, ring, rsa, ulysses, wallfacer, allgather, usp))
BUILTIN_TENSOR_METHODS = (contract.NONE, megatron.METHOD, optimus.METHOD, metp.METHOD)
BUILTIN_PIPELINE_SCHEDULES = schedules.SCHEDULES


def load_entry_points(points: Iterable[EntryPoint]) -> None:
    """Registers the entry each entry point names. One that does not load, is not a SequenceStrategy,
    TensorMethod or PipelineSchedule, or clashes with a registered name is a one-line ValueError naming it."""
    for point in points:
        try:
            entry = point.load()
            if not isinstance(entry, (SequenceStrategy, TensorMethod, PipelineSchedule)):
                raise TypeError(f"{entry!r} is not a SequenceStrategy, TensorMethod or PipelineSchedule")
            register(entry)
        except Exception as e:  # whatever the package's module raises: named in one line
            reason = " ".join(f"{type(e).__name__}: {e}".split())
            raise ValueError(
                f"entry point {point.name} = {point.value} (group {ENTRY_POINT_GROUP}) is broken: {reason}"
            ) from e


for _entry in (*BUILTIN_SEQUENCE_STRATEGIES, *BUILTIN_TENSOR_METHODS, *BUILTIN_PIPELINE_SCHEDULES):
    register(_entry)
load_entry_points(entry_points(group=ENTRY_POINT_GROUP))
