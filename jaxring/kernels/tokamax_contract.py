"""tokamax's attention call contract (as `compat.tokamax_attention_forward` / `_backward` wrap it), and a jnp
stand-in of its Mosaic GPU backward with exactly that contract (for CPU tests).

Read on tokamax 0.0.17 (`tokamax._src.ops.attention`: `base.py`, `pallas_mosaic_gpu.py`,
`pallas_mosaic_gpu_vjp.py`, `pallas_mosaic_gpu_vjp_kernel_sm90.py`):

  forward(q, k, v, *, k_start, k_end, sm_scale) -> out (q's shape and dtype), max fp32 [b, hq, nq], sum fp32 [b, hq, nq]
  backward(max, sum, out, dout, q, k, v, *, k_start, k_end, sm_scale) -> dq, dk, dv (the inputs' shapes)

q [b, nq, hq, d], k/v [b, nk, hkv, d] with hkv dividing hq (query head h reads K/V head h // (hq / hkv)); the
key-range mask keeps keys k_start <= j < k_end for each query row (int [1, 1, nq]; None: no bound). The
residuals are the softmax's (max, sum) of the scaled scores in natural log, so lse = max + log(sum); an empty
row has max -inf and sum 0. The Mosaic GPU backward reads P = exp(sm_scale q kᵀ - max) / sum and
D = rowsum(out ∘ dout) (fp32 accumulation, `out` in whatever dtype it is given) from what it is passed: given
a *global* lse as (max, sum) = (lse, 1) and an output whose rowsum with dO is the global delta, it returns one
block's exact share of the gradients. tokamax's XLA backward (`base.DotProductAttentionVjp`) does not: it
recomputes the softmax from q and k and ignores the residuals and the output it is given (checked on CPU:
gradients unchanged with false ones), hence this stand-in for the CPU tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _visible(nq: int, nk: int, k_start: Array | None, k_end: Array | None) -> Array:
    """bool [nq, nk]: the key-range mask (keys k_start <= j < k_end per query row)."""
    j = jnp.arange(nk)[None, :]
    keep = jnp.ones((nq, nk), bool)
    if k_start is not None:
        keep &= j >= jnp.reshape(k_start, (nq, 1))
    if k_end is not None:
        keep &= j < jnp.reshape(k_end, (nq, 1))
    return keep


def backward(
    m: Array,
    s: Array,
    out: Array,
    dout: Array,
    q: Array,
    k: Array,
    v: Array,
    *,
    k_start: Array | None,
    k_end: Array | None,
    sm_scale: float,
) -> tuple[Array, Array, Array]:
    """The stand-in Mosaic GPU backward: (dq, dk, dv) in the inputs' dtypes from the residuals (m, s)
    [b, hq, nq], out and dout [b, nq, hq, d], as the kernel reads them (module docstring)."""
    b, nq, hq = q.shape[:3]
    nk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    rows = lambda x: x.astype(jnp.float32).reshape(b, nq, hkv, g, x.shape[-1])  # [b, nq, hkv, g, d]
    stat = lambda x: x.astype(jnp.float32).reshape(b, hkv, g, nq)[..., None]  # [b, hkv, g, nq, 1]
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    logits = jnp.einsum("bthgd,bshd->bhgts", rows(q), kf) * sm_scale
    keep = _visible(nq, nk, k_start, k_end)
    p = jnp.where(keep, jnp.exp(logits - stat(m)) / stat(s), 0.0)
    delta = jnp.einsum("bthgd,bthgd->bhgt", rows(out), rows(dout))[..., None]
    dp = jnp.einsum("bthgd,bshd->bhgts", rows(dout), vf)
    ds = p * (dp - delta)
    dq = jnp.einsum("bhgts,bshd->bthgd", ds, kf).reshape(q.shape) * sm_scale
    dk = jnp.einsum("bhgts,bthgd->bshd", ds, rows(q)) * sm_scale
    dv = jnp.einsum("bhgts,bthgd->bshd", p, rows(dout))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
