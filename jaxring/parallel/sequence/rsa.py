"""Ring Self-Attention [RSA] ("Sequence Parallelism", Li et al.; REFERENCES.md): materialised scores, two rings.

N devices on the `sp` axis, each holding n = L/N tokens of Q, K, V (in any layout). Rank r:

  pass 1 (QKᵀ): for t in 0 .. N-1: hold the K chunk of owner o = (r - t) mod N (its own at t = 0, then one
                received from the previous rank per step, N-1 hops); fill S^r[:, :, o*n:(o+1)*n] = Q^r K^oᵀ
  locally:      P^r = softmax(mask(S^r * sm_scale)) over complete rows of length L
  pass 2 (PV):  for t in 0 .. N-1: hold the V chunk of owner o = (r - t) mod N; O^r += P^r[:, o-block] V^o

The score block S^r is [batch, q_heads, n, L] fp32: RSA's documented L²/N memory per device (no online
softmax; this is deliberately not flash attention). Columns are ordered by owner rank, and each column block
carries its owner's true positions (`layout_positions`), so causal and segment masks are exact in every layout.
The paper leaves causal masking open; here every rank computes all N score blocks, fully masked ones included
(no block skipping, so the causal work per rank is the same in every layout, and half of it is wasted). A
sliding window (query i sees keys i - W < j <= i) is one more term of the mask, with no skipping either: RSA's
cost does not shrink with the window.

Backward (`jax.custom_vjp`; the paper's "two ring-style P2P and two all-reduce", with the all-reduces done as
reduce-scatters: a reduce-scatter moves half the bytes of an all-reduce and each rank needs only its own shard):

  pass V (ring):  dP^r[:, o-block] = dO^r V^oᵀ                            (N-1 hops of V)
  locally:        dS^r = P^r ⊙ (dP^r - rowsum(dP^r ⊙ P^r)) * sm_scale
  pass K (ring):  dQ^r = Σ_o dS^r[:, o-block] K^o                          (N-1 hops of K)
  locally:        dK_full = dS^rᵀ Q^r, dV_full = P^rᵀ dO^r                 ([batch, L, kv_heads, head_dim] fp32)
  psum_scatter:   dK, dV = psum_scatter(dK_full), psum_scatter(dV_full) over the owner-ordered column blocks,
                  so rank r keeps block r: exactly its own chunk, whatever the layout.

The backward rings turn the other way (rank r sends to r-1, owner o = (r + t) mod N), so XLA cannot merge
their sends with the forward's.

Residuals: q, k, v (local chunks, input dtype) and P^r, the [batch, q_heads, n, L] fp32 probability matrix, as
the paper keeps it (B·Hq·L²/N·4 bytes per device). Nothing received over the ring is kept; the backward
ring-passes V and K again. The mask is folded into P (masked entries are exactly 0), so segment ids are not
kept. Rows with no visible key (padding, segment id 0) have P = 0: output 0, gradients 0, never NaN.

GQA: K/V travel with their kv_heads as they are (never repeated); query head h reads kv head h // (Hq/Hkv).

Communication per device, with c = B·n·Hkv·D elements (one local K or V chunk; n = L/N, Hkv kv heads,
D head_dim) and s = bytes per element of k/v:

  forward:   collective-permute 2(N-1)·c elements = 2(N-1)·B·(L/N)·Hkv·D      bytes 2(N-1)·c·s
             (N-1 K chunks in pass 1, N-1 V chunks in pass 2)
  backward:  collective-permute 2(N-1)·c elements (V for dP, K for dQ)       bytes 2(N-1)·c·s
             reduce-scatter     2(N-1)·c elements (dK and dV, fp32)          bytes 2(N-1)·c·4
             (each: received (N-1)/N of the [B, L, Hkv, D] partial = (N-1)·c)
  total:     6(N-1)·c elements; backward 4(N-1)·c.

The paper counts 2(N-1)·BZ(L/N)A forward and 6(N-1)·BZ(L/N)A backward (Z = heads, A = head size) with two
all-reduces (2(N-1)·c each); reducing with psum_scatter instead moves half of that, hence 4(N-1)·c backward.
With segment_ids, the forward's pass 1 also carries the K chunk's int32 ids: +(N-1)·B·n elements, 4(N-1)·B·n
bytes (the backward needs none). At fp32 (s = 4): forward 8(N-1)·c bytes; forward + backward 16(N-1)·c bytes
of collective-permute and 8(N-1)·c bytes of reduce-scatter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.core.collectives import BACKWARD, ring_steps, send_to_next
from jaxring.kernels.blockwise import BlockOps
from jaxring.kernels.layout import check_seq_len, layout_permutation, layout_positions
from jaxring.kernels.masking import attention_mask, check_qkv, check_window
from jaxring.parallel.cost_terms import F32, AttentionCost, AttentionShape, Transfer, segment_once
from jaxring.parallel.registry import SequenceStrategy


@dataclasses.dataclass(frozen=True)
class RsaConfig:
    """The static settings of one RSA call (hashable: the one nondiff argument of its custom_vjp)."""

    axis_name: str | tuple[str, ...]
    layout: str  # each column block's true positions
    causal: bool
    sm_scale: float
    window: int | None = None  # sliding window (causal): query i sees keys i - window < j <= i


def rsa_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    axis_name: str | tuple[str, ...] = "sp",
    layout: str = "contiguous",
    causal: bool = True,
    sm_scale: float | None = None,
    block_ops: str | BlockOps = "auto",
    window: int | None = None,
) -> jax.Array:
    """Ring Self-Attention over `axis_name`; call inside `shard_map` with the sequence already in `layout`.

    Args:
      q: local [batch, n, q_heads, head_dim]; k, v: local [batch, n, kv_heads, head_dim] (GQA: only the
        existing K/V heads travel).
      segment_ids: local int [batch, n] or None; 0 = padding (attends to nothing, output 0).
      layout: "contiguous", "zigzag" or "striped": how this rank's tokens were chosen (see layout.py).
      causal: mask keys after the query (by true positions); sm_scale: default 1/sqrt(head_dim).
      block_ops: ignored (the registry's call contract passes it): RSA materialises its score rows and has no
        per-block compute.
      window: sliding window W (needs causal): query i sees keys i - W < j <= i; None: unlimited.
    Returns: out, local [batch, n, q_heads, head_dim] in q.dtype. Differentiable in q, k, v with the paper's
    backward (see the module docstring for its communication).
    """
    del block_ops
    check_qkv(q, k, v)
    window = check_window(window, causal)
    batch, n = q.shape[:2]
    if k.shape[1] != n:
        raise ValueError(f"k/v local seq {k.shape[1]} must equal q local seq {n} for self-attention")
    if segment_ids is not None and tuple(segment_ids.shape) != (batch, n):
        raise ValueError(f"segment_ids local shape {tuple(segment_ids.shape)} must be [batch, n] = {(batch, n)}")
    num = lax.axis_size(axis_name)
    check_seq_len(n * num, num, layout)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    return _rsa(q, k, v, segment_ids, RsaConfig(axis_name, layout, bool(causal), scale, window))


def _einsum(spec: str, a: jax.Array, b: jax.Array):
    return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32), preferred_element_type=jnp.float32)


def _grouped(x: jax.Array, kv_heads: int):
    """[b, n, hq, d] -> fp32 [b, n, hkv, groups, d] (query head h reads kv head h // groups)."""
    b, n, hq, d = x.shape
    return x.astype(jnp.float32).reshape(b, n, kv_heads, hq // kv_heads, d)


def rsa_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, cfg: RsaConfig
) -> tuple[jax.Array, jax.Array]:
    """The two forward rings. Returns out fp32 [b, n, hq, d] and P fp32 [b, hkv, groups, n, L]."""
    num, rank = lax.axis_size(cfg.axis_name), lax.axis_index(cfg.axis_name)
    batch, n, _, _ = q.shape
    kv_heads, length = k.shape[2], n * num
    qg = _grouped(q, kv_heads)
    send = lambda tree: send_to_next(tree, cfg.axis_name)

    # pass 1: K chunks (with their segment ids) go round; fill the score columns of each chunk's owner
    def fill_scores(
        carry: tuple[jax.Array, jax.Array | None], kv: tuple[jax.Array, jax.Array | None], step: int | jax.Array
    ):
        s, kv_seg = carry
        k_o, seg_o = kv
        col = ((rank - step) % num) * n
        s = lax.dynamic_update_slice_in_dim(s, _einsum("bqhgd,bkhd->bhgqk", qg, k_o), col, axis=4)
        if seg_o is not None:
            kv_seg = lax.dynamic_update_slice_in_dim(kv_seg, seg_o, col, axis=1)
        return s, kv_seg

    s0 = jnp.zeros_like(q, jnp.float32, shape=(batch, kv_heads, qg.shape[3], n, length))
    seg0 = None if segment_ids is None else jnp.zeros_like(segment_ids, shape=(batch, length))
    s, kv_seg = ring_steps(fill_scores, (s0, seg0), (k, segment_ids), num, send)

    # locally: scale, mask (true positions of every column block), softmax over complete rows
    q_pos = layout_positions(cfg.layout, rank, num, n)
    with jax.ensure_compile_time_eval():  # static: column o*n + i holds owner o's i-th position
        kv_pos = jnp.asarray(layout_permutation(cfg.layout, length, num), jnp.int32)
    mask = attention_mask(q_pos, kv_pos, segment_ids, kv_seg, causal=cfg.causal, window=cfg.window)
    s = s * cfg.sm_scale
    if mask is not None:
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0.0, 1.0, l)  # rows with no visible key: P = 0

    # pass 2: V chunks go round; O += P[:, owner block] V_owner
    def attend(o: jax.Array, v_o: jax.Array, step: int | jax.Array):
        p_o = lax.dynamic_slice_in_dim(p, ((rank - step) % num) * n, n, axis=4)
        return o + _einsum("bhgqk,bkhd->bqhgd", p_o, v_o)

    out = ring_steps(attend, jnp.zeros_like(qg), v, num, send)
    return out.reshape(q.shape), p


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rsa(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, cfg: RsaConfig):
    out, _ = rsa_forward(q, k, v, segment_ids, cfg)
    return out.astype(q.dtype)


def _rsa_fwd(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, cfg: RsaConfig):
    out, p = rsa_forward(q, k, v, segment_ids, cfg)
    return out.astype(q.dtype), (q, k, v, p)


def _rsa_bwd(cfg: RsaConfig, residuals: tuple, dout: jax.Array):
    """The mask (causal, window, segments) is folded into P: only the axis and the scale are needed."""
    axis_name, sm_scale = cfg.axis_name, cfg.sm_scale
    q, k, v, p = residuals
    num, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
    n, kv_heads = q.shape[1], k.shape[2]
    qg, dog = _grouped(q, kv_heads), _grouped(dout, kv_heads)
    send = lambda tree: send_to_next(tree, axis_name, shift=BACKWARD)
    owner_col = lambda step: ((rank - BACKWARD * step) % num) * n

    # ring V: dP = dO Vᵀ, column block by owner
    def fill_dp(dp: jax.Array, v_o: jax.Array, step: int | jax.Array):
        return lax.dynamic_update_slice_in_dim(dp, _einsum("bqhgd,bkhd->bhgqk", dog, v_o), owner_col(step), axis=4)

    dp = ring_steps(fill_dp, jnp.zeros_like(p), v, num, send)
    ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True)) * sm_scale

    # ring K: dQ = Σ_o dS[:, owner block] K_owner
    def add_dq(dq: jax.Array, k_o: jax.Array, step: int | jax.Array):
        return dq + _einsum("bhgqk,bkhd->bqhgd", lax.dynamic_slice_in_dim(ds, owner_col(step), n, axis=4), k_o)

    dq = ring_steps(add_dq, jnp.zeros_like(qg), k, num, send)

    # full-length partials of dK, dV from this rank's queries; reduce-scatter: rank r keeps column block r
    dk_full = _einsum("bhgqk,bqhgd->bkhd", ds, qg)
    dv_full = _einsum("bhgqk,bqhgd->bkhd", p, dog)
    dk = lax.psum_scatter(dk_full, axis_name, scatter_dimension=1, tiled=True)
    dv = lax.psum_scatter(dv_full, axis_name, scatter_dimension=1, tiled=True)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_rsa.defvjp(_rsa_fwd, _rsa_bwd)


# ---------------------------------------------------------------------------------------- cost


def _cpu_hoisted_score_rows(s: AttentionShape) -> float:
    """Score-row-sized arrays XLA:CPU materialises once, outside the layer scan, and keeps through the forward:
    with a mask, the -inf it writes and the mask itself (1 byte an element). jax 0.10's XLA:CPU also kept the
    zeros the rows start from (`*-live-range.txt` at its peak); 0.11.2's and 0.12.1's compiled step (GPT sp8,
    causal) holds 18.1 MB less, one score-row array (16.8 MB) and change."""
    if not s.cpu:
        return 0.0
    masked = s.causal or s.segments or s.window is not None
    return 1.0 + 1 / F32 if masked else 0.0


def rsa_cost(s: AttentionShape, options: dict) -> AttentionCost:
    """The module docstring's traffic (RSA: 8(N-1)·BZ(L/N)A): the K then V rings forward, V then K backward
    (hidden behind the score blocks), the fp32 dK/dV reduce-scatters. Kept: P^r fp32 [b, heads, n, L] and the
    local q, k, v. Working: the score rows again (dP, dS); in the forward S and P (and on CPU the hoisted
    arrays of `_cpu_hoisted_score_rows`). It computes every causal block: the masked half of
    the causal scores is extra work. Packed documents: the K chunks' segment ids ride pass 1 of the forward,
    (P-1) hops of layer-invariant sends (`jaxring.parallel.cost_terms.segment_once`)."""
    del options
    P, axes = s.sp, tuple(s.axes)
    kv = s.kv_bytes(s.e)
    scores = s.b * s.heads * s.n * s.seq_len * F32
    return AttentionCost(
        transfers=(
            Transfer("RSA K then V rings forward", axes, 2 * (P - 1) * kv, 2 * (P - 1), "attention"),
            Transfer("RSA V then K rings backward", axes, 2 * (P - 1) * kv, 2 * (P - 1), "attention"),
            Transfer("RSA dK, dV reduce-scatter", axes, 2 * (P - 1) * s.kv_bytes(F32), 2),
            *segment_once("RSA segment ids with the K chunks (forward)", axes, (P - 1) * s.segment_bytes()),
        ),
        saved=scores + s.b * s.n * (s.heads + 2 * s.kv_heads) * s.d * s.em,
        working=2 * scores,
        forward=(2 + _cpu_hoisted_score_rows(s)) * scores,
        extra_attention=1.0 if s.causal else 0.0,
    )


# ---------------------------------------------------------------------------------------- registry entry


STRATEGY = SequenceStrategy(
    "rsa",
    "Ring Self-Attention: K then V rings over materialised score rows (Li et al.)",
    attend=rsa_attention,
    default_layout="contiguous",
    uses_block_ops=False,
    cost=rsa_cost,
)
