"""Compute precisions: the names a run takes (`--precision`) and what they mean.

Weights and optimizer state stay fp32 whatever the precision (mixed precision: master weights in fp32, the
matmuls and activations in the compute dtype).
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["BYTES_PER_ELEMENT", "PRECISIONS", "bytes_per_element", "compute_dtype"]

PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
BYTES_PER_ELEMENT = {name: jnp.dtype(dtype).itemsize for name, dtype in PRECISIONS.items()}


def compute_dtype(precision: str) -> jnp.dtype:
    """The activation and matmul dtype of `precision`."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def bytes_per_element(precision: str) -> int:
    """Bytes of one activation element in `precision`."""
    return jnp.dtype(compute_dtype(precision)).itemsize
