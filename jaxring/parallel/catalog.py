"""The built-in entries of the registry, registered in one place: every sequence strategy, tensor method and
pipeline schedule jaxring ships."""

from jaxring.parallel.pipeline import schedules
from jaxring.parallel.registry import register_pipeline_schedule, register_sequence_strategy, register_tensor_method
from jaxring.parallel.sequence import allgather, ring, rsa, ulysses, usp, wallfacer
from jaxring.parallel.tensor import contract, megatron, metp, optimus

# in the listing's order (--help, the planner's tables)
BUILTIN_SEQUENCE_STRATEGIES = tuple(m.STRATEGY for m in (ring, rsa, ulysses, wallfacer, allgather, usp))
BUILTIN_TENSOR_METHODS = (contract.NONE, megatron.METHOD, optimus.METHOD, metp.METHOD)
BUILTIN_PIPELINE_SCHEDULES = schedules.SCHEDULES

for _strategy in BUILTIN_SEQUENCE_STRATEGIES:
    register_sequence_strategy(_strategy)
for _method in BUILTIN_TENSOR_METHODS:
    register_tensor_method(_method)
for _schedule in BUILTIN_PIPELINE_SCHEDULES:
    register_pipeline_schedule(_schedule)
