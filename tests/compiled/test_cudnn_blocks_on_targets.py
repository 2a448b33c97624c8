"""Deviceless compile checks beside tests/unit/kernels/test_cudnn_blocks.py:
the compiled tier, which needs the gpu-compile or tpu-compile extra and skips without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cudnn_blocks import DEVICELESS, WHY_NOT

from jaxring.analysis import gpu
from jaxring.kernels.cudnn_blocks import REAL_CALLS, cudnn_block_ops
from jaxring.kernels.flash import flash_block_ops


@pytest.mark.skipif(not DEVICELESS, reason=f"deviceless GPU compile unavailable: {WHY_NOT}")
def test_deviceless_h100_compile_has_cudnn_calls():
    """The cuDNN block compute compiles for an H100 with no GPU: XLA emits cuDNN's fused-attention custom calls
    (forward and backward); the Pallas fallback's Triton kernels are compiled beside them."""
    devices = gpu.gpu_devices("h100", 1)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    x = lambda heads: gpu.abstract((1, 1024, heads, 128), jnp.bfloat16, mesh)
    ops = cudnn_block_ops(REAL_CALLS, flash_block_ops())  # get_block_ops("cudnn") wants a real NVIDIA backend

    def block(q, k, v, do):
        pos = jnp.arange(1024, dtype=jnp.int32)
        out, lse = ops.forward(q, k, v, pos, pos, causal=True, sm_scale=0.1)
        delta = jnp.sum(do.astype(jnp.float32) * out, -1)
        return out, ops.backward(q, k, v, do, lse, delta, pos, pos, causal=True, sm_scale=0.1)

    with gpu.lowering_for(devices[0]):  # the GPU the Pallas fallback's Triton kernels are lowered for
        text = jax.jit(block).lower(x(8), x(2), x(2), x(8)).compile().as_text()
    assert '"__cudnn$fmhaSoftmax"' in text and '"__cudnn$fmhaSoftmaxBackward"' in text
