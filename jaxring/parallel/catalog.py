"""The built-in entries of the registry: importing this module registers every sequence strategy, tensor
method and pipeline schedule jaxring ships (each module registers its own entry)."""

# isort: off
from jaxring.parallel.sequence import ring, rsa, ulysses, wallfacer, allgather, usp  # noqa: F401
from jaxring.parallel import pipeline, tensor  # noqa: F401
