"""cuDNN's fused-attention call contract, and a dense jnp stand-in with exactly that contract (for CPU tests).

The real calls are `compat.cudnn_attention_forward` / `cudnn_attention_backward` (JAX's private wrapper
primitives of `jax._src.cudnn.fused_attention_stablehlo`, read on jax 0.11.2 and 0.12.1). The contract:

  forward(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k, page_table_v,
          *, scale, seed, dropout_rate, variadic_args, mask_type, layout, sliding_window_length)
      -> out (query's shape and dtype), stats fp32 [B, N, T]
  backward(the ten operands, stats, fwd_output, grad_output, *, the same parameters)
      -> dq, dk, dv in the inputs' dtypes

Layouts: BTNH (0, jaxring's [b, n, h, d]) or BNTH (1). Q has N heads, K/V their own count dividing N (GQA:
never repeated). `stats` is the softmax log-sum-exp of the *scaled* scores, natural log, laid out [B, N, T]
(FlashAttention-2's L; JAX's docstring calls it "the logsumexp tensor"); jaxring's lse is the same numbers
as [B, T, N]. The backward reads P = exp(scale QKᵀ - stats) and D = rowsum(dO ∘ fwd_output) itself, so given
a merged *global* output and lse it returns one block's exact share of the gradients (how ring-flash-attention
uses flash-attn's backward).

Masks (mask_type, the private `MaskType` values): NO_MASK 0; PADDING 1 (query i < q_seqlen[b], key j <
kv_seqlen[b]); CAUSAL 2, aligned top-left by index: query i sees key j <= i whatever T and S are; PADDING_CAUSAL
3. sliding_window_length W (None or 0: none) keeps keys i - W < j (with causal: W keys including the query's
own). Unused operands are empty arrays (`jnp.zeros(0)`), as JAX's public wrapper passes them. Not mirrored
here (they raise): bias, dropout, packed segments (q_offsets of rank 2), paged K/V. A query row that sees no
key gets out 0 and stats -inf here; what cuDNN returns for such a row is not documented, so the block
decomposition (`cudnn_blocks.py`) never makes one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
NO_MASK, PADDING, CAUSAL, PADDING_CAUSAL = 0, 1, 2, 3
BTNH, BNTH = 0, 1


def _unused(x: Array | None) -> bool:
    return x is None or x.size == 0


def _check_params(
    bias: Array, q_offsets: Array, page_table_k: Array, dropout_rate: float, variadic_args: tuple, layout: int
) -> None:
    if not _unused(bias) or any(variadic_args):
        raise NotImplementedError("the cuDNN stand-in has no bias")
    if dropout_rate:
        raise NotImplementedError(f"the cuDNN stand-in has no dropout (rate {dropout_rate})")
    if not _unused(q_offsets) or not _unused(page_table_k):
        raise NotImplementedError("the cuDNN stand-in has no packed segments or paged K/V")
    if layout not in (BTNH, BNTH):
        raise ValueError(f"layout {layout} is neither BTNH (0) nor BNTH (1)")


def _to_btnh(x: Array, layout: int) -> Array:
    return x if layout == BTNH else jnp.swapaxes(x, 1, 2)


def _mask(b: int, t: int, s: int, q_seqlen: Array, kv_seqlen: Array, mask_type: int, window: int | None) -> Array:
    """bool [B, T, S]: which (query, key) pairs the mask keeps."""
    i, j = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
    keep = jnp.ones((b, t, s), bool)
    if mask_type in (CAUSAL, PADDING_CAUSAL):
        keep &= j <= i
    if window:
        keep &= j > i - window
    if mask_type in (PADDING, PADDING_CAUSAL):
        keep &= (i[None] < q_seqlen[:, None, None]) & (j[None] < kv_seqlen[:, None, None])
    return keep


def _scores(
    query: Array, key: Array, q_seqlen: Array, kv_seqlen: Array, scale: float, mask_type: int, window: int | None
) -> tuple[Array, Array]:
    """fp32 masked scores [B, hkv, g, T, S] (-inf where hidden) and the mask, from BTNH inputs."""
    b, t, n, d = query.shape
    s, hkv = key.shape[1], key.shape[2]
    qg = query.astype(jnp.float32).reshape(b, t, hkv, n // hkv, d)
    logits = jnp.einsum("bthgd,bshd->bhgts", qg, key.astype(jnp.float32)) * scale
    keep = _mask(b, t, s, q_seqlen, kv_seqlen, mask_type, window)[:, None, None]
    return jnp.where(keep, logits, -jnp.inf), keep


def forward(
    query: Array, key: Array, value: Array, bias: Array, q_seqlen: Array, kv_seqlen: Array, q_offsets: Array,
    kv_offsets: Array, page_table_k: Array, page_table_v: Array,
    *, scale: float, seed: int, dropout_rate: float, variadic_args: tuple[bool, bool], mask_type: int, layout: int,
    sliding_window_length: int | None,
) -> tuple[Array, Array]:  # fmt: skip
    """The stand-in forward: (out like query, stats fp32 [B, N, T] natural-log lse of the scaled scores)."""
    del seed, kv_offsets, page_table_v
    _check_params(bias, q_offsets, page_table_k, dropout_rate, variadic_args, layout)
    q, k, v = (_to_btnh(x, layout) for x in (query, key, value))
    b, t, n, _ = q.shape
    logits, _ = _scores(q, k, q_seqlen, kv_seqlen, scale, mask_type, sliding_window_length)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, hkv, g, T]; -inf on rows that see nothing
    p = jnp.exp(logits - jnp.where(jnp.isneginf(lse), 0.0, lse)[..., None])
    out = jnp.einsum("bhgts,bshd->bthgd", p, v.astype(jnp.float32)).reshape(b, t, n, v.shape[-1])
    stats = lse.reshape(b, n, t)
    return _to_btnh(out.astype(query.dtype), layout), stats


def backward(
    query: Array, key: Array, value: Array, bias: Array, q_seqlen: Array, kv_seqlen: Array, q_offsets: Array,
    kv_offsets: Array, page_table_k: Array, page_table_v: Array, activation: Array, fwd_output: Array,
    grad_output: Array,
    *, scale: float, seed: int, dropout_rate: float, variadic_args: tuple[bool, bool], mask_type: int, layout: int,
    sliding_window_length: int | None,
) -> tuple[Array, Array, Array]:  # fmt: skip
    """The stand-in backward: (dq, dk, dv) in the inputs' dtypes from stats (`activation`), O and dO.

    P = exp(scale QKᵀ - stats) and D = rowsum(dO ∘ O), as cuDNN computes them: given the global lse and output
    of several merged blocks, this block's share of the gradients."""
    del seed, kv_offsets, page_table_v
    _check_params(bias, q_offsets, page_table_k, dropout_rate, variadic_args, layout)
    q, k, v, o, do = (_to_btnh(x, layout) for x in (query, key, value, fwd_output, grad_output))
    b, t, n, _ = q.shape
    hkv = k.shape[2]
    rows = lambda x: x.astype(jnp.float32).reshape(b, t, hkv, n // hkv, x.shape[-1])  # [B, T, hkv, g, d]
    logits, keep = _scores(q, k, q_seqlen, kv_seqlen, scale, mask_type, sliding_window_length)
    lse = activation.astype(jnp.float32).reshape(b, hkv, n // hkv, t)[..., None]
    p = jnp.where(keep, jnp.exp(logits - lse), 0.0)
    delta = jnp.einsum("bthgd,bthgd->bhgt", rows(do), rows(o))[..., None]
    dp = jnp.einsum("bthgd,bshd->bhgts", rows(do), v.astype(jnp.float32))
    ds = p * (dp - delta)
    dq = jnp.einsum("bhgts,bshd->bthgd", ds, k.astype(jnp.float32)).reshape(q.shape) * scale
    dk = jnp.einsum("bhgts,bthgd->bshd", ds, rows(q)) * scale
    dv = jnp.einsum("bhgts,bthgd->bshd", p, rows(do))
    return tuple(_to_btnh(g.astype(x.dtype), layout) for g, x in zip((dq, dk, dv), (query, key, value)))
