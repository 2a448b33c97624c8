"""The per-block compute by name: the jnp tiles (`blockwise.py`, CPU) or the Pallas flash kernels (`flash.py`, GPU).

Every distributed strategy takes `block_ops=` as a name or a `BlockOps` pair (the interface documented in
`blockwise.py`) and resolves it here, above both implementations.
"""

from __future__ import annotations

import jax

from jaxring.kernels.blockwise import JNP_BLOCK_OPS, BlockOps
from jaxring.kernels.flash import flash_block_ops

# the per-block computes by name ("auto": pallas on GPU, jnp elsewhere)
BLOCK_OPS = ("auto", "jnp", "pallas", "pallas_interpret")


def get_block_ops(impl: str | BlockOps = "auto") -> BlockOps:
    """The per-block compute by name, or a BlockOps as given.

    "jnp" (`blockwise.py`), "pallas" (the compiled flash kernel, GPU), "pallas_interpret" (the same kernel run
    by the Pallas interpreter, for CPU tests); "auto" is "pallas" on GPU and "jnp" elsewhere.
    """
    if isinstance(impl, BlockOps):
        return impl
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "jnp"
    if impl == "jnp":
        return JNP_BLOCK_OPS
    if impl in ("pallas", "pallas_interpret"):
        return flash_block_ops(interpret=impl == "pallas_interpret")
    raise ValueError(f"unknown block implementation {impl!r}; expected one of {', '.join(BLOCK_OPS)} or a BlockOps")
