"""The per-block compute by name: the jnp tiles (`blockwise.py`, CPU), the Pallas flash kernels (`flash.py`, GPU),
cuDNN's fused attention (`cudnn_blocks.py`, NVIDIA GPU; its jnp stand-in on CPU) or the optional tokamax package's
Mosaic GPU attention (`tokamax_blocks.py`, sm90/sm100; tokamax's XLA forward and a jnp backward on CPU), or
jaxring's Pallas TPU kernels (`tpu_blocks.py`, TPU; TPU interpret mode on CPU).

Every distributed strategy takes `block_ops=` as a name or a `BlockOps` pair (the interface documented in
`blockwise.py`) and resolves it here, above the implementations.
"""

from __future__ import annotations

import jax

from jaxring.core import compat
from jaxring.kernels.block_attention import block_attention
from jaxring.kernels.blockwise import JNP_BLOCK_OPS, BlockOps
from jaxring.kernels.cudnn_blocks import REAL_CALLS, REFERENCE_CALLS, cudnn_block_ops
from jaxring.kernels.flash import flash_attention, flash_block_ops
from jaxring.kernels.tokamax_blocks import MOSAIC_CALLS, tokamax_block_ops
from jaxring.kernels.tokamax_blocks import REFERENCE_CALLS as TOKAMAX_REFERENCE_CALLS
from jaxring.kernels.tpu_blocks import tpu_block_ops

# the per-block computes by name ("auto": the backend's entry of AUTO_BLOCK_OPS, `auto_block_ops`)
BLOCK_OPS = (
    "auto", "jnp", "pallas", "pallas_interpret", "cudnn", "cudnn_reference", "tokamax", "tokamax_reference",
    "pallas_tpu", "pallas_tpu_interpret",
)  # fmt: skip

# What "auto" (the default of `block_ops=` and --block-ops) means, by JAX backend; any other backend: "jnp".
# The GPU entry is the Pallas kernel, which has run on an H100; cuDNN ("cudnn") becomes it once
# benchmarks/gpu_session.sh has run the cuDNN path on a real GPU (tests/device/test_gpu_kernels.py and the flash
# benchmark): until then cuDNN is checked on CPU (its stand-in) and in the deviceless H100 compile only.
AUTO_BLOCK_OPS = {"gpu": "pallas", "tpu": "pallas_tpu", "cpu": "jnp"}


def nvidia_gpu() -> bool:
    """Whether JAX's default backend is a CUDA GPU (not ROCm)."""
    return jax.default_backend() == "gpu" and "cuda" in jax.devices()[0].client.platform_version.lower()


def check_cudnn_available() -> None:
    """Raises (one line) unless cuDNN's fused attention can run here: an NVIDIA GPU and JAX's primitives."""
    if not nvidia_gpu():
        raise ValueError(
            f"block_ops 'cudnn' needs an NVIDIA GPU (the default backend is {jax.default_backend()!r}); "
            f"use 'cudnn_reference' for its CPU stand-in"
        )
    if not compat.has_cudnn_attention():
        raise ValueError(
            f"block_ops 'cudnn': jax {jax.__version__} lacks the cuDNN attention primitives jaxring uses (checked on 0.11.2 and 0.12.1)"
        )


def check_tokamax_available(name: str = "tokamax") -> None:
    """Raises (one line) unless block_ops `name` can run here: tokamax installed with the names jaxring uses and,
    for "tokamax", an NVIDIA GPU (its Mosaic GPU backward needs sm90 or sm100)."""
    if not compat.has_tokamax_attention():
        raise ValueError(
            f"block_ops {name!r} needs the optional tokamax package (pip install 'jaxring[tokamax]'; checked on 0.0.17)"
        )
    if name == "tokamax" and not nvidia_gpu():
        raise ValueError(
            f"block_ops 'tokamax' needs an NVIDIA GPU (the default backend is {jax.default_backend()!r}); "
            f"use 'tokamax_reference' for its CPU stand-in"
        )


def auto_block_ops(backend: str | None = None) -> str:
    """The block compute "auto" stands for on `backend` (default: JAX's default backend): its AUTO_BLOCK_OPS
    entry, "jnp" for a backend without one. A "cudnn" entry runs only on an NVIDIA GPU whose JAX has the
    primitives; elsewhere (ROCm, an older JAX) it is "pallas"."""
    backend = backend or jax.default_backend()
    name = AUTO_BLOCK_OPS.get(backend, "jnp")
    if name == "cudnn" and not (nvidia_gpu() and compat.has_cudnn_attention()):
        return "pallas"
    return name


def resolve_name(impl: str) -> str:
    """The concrete name "auto" stands for here (`auto_block_ops`; other names as given)."""
    return auto_block_ops() if impl == "auto" else impl


def get_block_ops(impl: str | BlockOps = "auto") -> BlockOps:
    """The per-block compute by name, or a BlockOps as given.

    "jnp" (`blockwise.py`), "pallas" (the compiled flash kernel, GPU), "pallas_interpret" (the same kernel run
    by the Pallas interpreter, for CPU tests), "cudnn" (cuDNN's fused attention, NVIDIA GPU only; blocks its
    masks cannot express go to the Pallas kernel), "cudnn_reference" (the same decomposition over a jnp
    stand-in with cuDNN's call contract, falling back to the jnp pair: CPU tests), "tokamax" (the optional tokamax
    package's Mosaic GPU attention, sm90/sm100; blocks its key ranges cannot express go to the Pallas kernel),
    "tokamax_reference" (the same decomposition over tokamax's XLA forward and a jnp stand-in of its backward,
    falling back to the jnp pair: CPU tests), "pallas_tpu" (jaxring's Pallas TPU kernels, every block of every
    layout) and "pallas_tpu_interpret" (the same in TPU interpret mode, CPU tests); "auto" is the backend's
    entry of AUTO_BLOCK_OPS ("pallas" on GPU, "pallas_tpu" on TPU, "jnp" elsewhere: `auto_block_ops`).
    """
    if isinstance(impl, BlockOps):
        return impl
    impl = resolve_name(impl)
    if impl == "jnp":
        return JNP_BLOCK_OPS
    if impl in ("pallas", "pallas_interpret"):
        return flash_block_ops(interpret=impl == "pallas_interpret")
    if impl == "cudnn":
        check_cudnn_available()
        return cudnn_block_ops(REAL_CALLS, flash_block_ops())
    if impl == "cudnn_reference":
        return cudnn_block_ops(REFERENCE_CALLS, JNP_BLOCK_OPS)
    if impl in ("tokamax", "tokamax_reference"):
        check_tokamax_available(impl)
        if impl == "tokamax":
            return tokamax_block_ops(MOSAIC_CALLS, flash_block_ops())
        return tokamax_block_ops(TOKAMAX_REFERENCE_CALLS, JNP_BLOCK_OPS)
    if impl == "pallas_tpu_interpret":
        return tpu_block_ops(interpret=True)
    if impl == "pallas_tpu":
        return tpu_block_ops()
    raise ValueError(f"unknown block implementation {impl!r}; expected one of {', '.join(BLOCK_OPS)} or a BlockOps")


# flash_attention's implementations among the names (the others run through `block_attention`)
FLASH_IMPLEMENTATIONS = ("jnp", "pallas", "pallas_interpret")


def local_attention(block_ops: str | BlockOps, q: jax.Array, k: jax.Array, v: jax.Array, **kwargs) -> jax.Array:
    """Differentiable attention on one device with the named block compute (the strategies that attend
    locally: Ulysses, the all-gather, dense): `flash_attention` for its implementations, `block_attention`
    over the BlockOps otherwise (cuDNN). kwargs: flash_attention's (causal, sm_scale, positions, segment ids,
    window)."""
    name = block_ops.name if isinstance(block_ops, BlockOps) else resolve_name(block_ops)
    if name in FLASH_IMPLEMENTATIONS:
        return flash_attention(q, k, v, implementation=name, **kwargs)
    return block_attention(get_block_ops(block_ops), q, k, v, **kwargs)
