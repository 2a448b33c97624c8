"""Flash attention as a Pallas kernel (GPU/Triton), with a jnp fallback on CPU.

    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)

Shapes: q [batch, q_len, q_heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim] with
q_heads % kv_heads == 0 (GQA/MQA: query head h reads key/value head h // (q_heads // kv_heads); K/V are never
repeated, the kernels index the shared head in their BlockSpecs). out has q's shape and dtype; lse is fp32
[batch, q_len, q_heads], natural log, -inf on rows that see no key (their out is 0 and their gradients 0).

Masking is by *positions*, never by array index, so a Q block and a K/V block taken from anywhere in a
sequence (ring steps, zigzag or striped layouts) are masked exactly: with `causal`, query i sees key j iff
q_positions[i] >= kv_positions[j]. Segment ids (0 = padding) restrict attention to equal, non-zero ids.

Algorithm (FlashAttention-2, https://arxiv.org/abs/2307.08691):
  forward   grid (q block, batch, q head): keep a Q tile in registers, stream K/V tiles, keep the running
            max m, the running sum l and the unnormalised accumulator (online softmax), write
            out = acc / l and lse = m + log l. The exponentials use exp2 on log2(e)-scaled scores (cheaper on
            GPUs); lse is converted back to the natural log before it is written.
  backward  recompute from (out, lse), FA2 style, as two kernels with no atomics:
            delta = rowsum(dO * O) (minus the cotangent of lse, so lse is differentiable too) is a plain
            XLA reduction; a dK/dV kernel, grid (k block, batch, kv head), holds one K/V tile and loops over
            the q blocks of every query head of its GQA group, so dK/dV of a shared head are summed in
            registers; a dQ kernel, grid (q block, batch, q head), holds one Q tile and loops over K/V tiles.
            Both recompute P = exp(S - lse): dV += P^T dO, dP = dO V^T, dS = P * (dP - delta),
            dQ += dS K * scale, dK += dS^T Q * scale.

Block skipping: before each kernel a few small jnp reductions compare block bounds (min/max position per
block for causal, min/max non-zero segment id per block) and give every row of tiles a range
[lo, hi) of tiles that may hold a visible pair, and inside it a sub-range [full_lo, full_hi) of tiles where
every pair is visible. The kernel runs three loops: masked [lo, full_lo), unmasked [full_lo, full_hi), masked
[full_hi, hi). Tiles outside [lo, hi) are never loaded; for causal self-attention with sorted positions this
is the usual "skip the upper triangle, mask only the diagonal". The ranges are conservative (exact for any
positions and segment layout; they only save work when the visible tiles are contiguous, as in every
layout jaxring uses).

Padding: head_dim is zero-padded to a power of two >= 16 and sequences to a multiple of the block sizes
(Triton tiles are powers of two); zero head columns change no score and are sliced off. This costs a copy
only when a dimension is not already aligned. Padded keys are masked (the largest int32 position under
causal, segment 0 with segment ids, an index mask otherwise); padded query rows are sliced off, and in the
backward they carry dO = 0 and lse = +inf so they contribute exactly nothing. fp32 inputs use full-precision
(ieee) products in the kernel, not tf32.

Implementations (`implementation=`): "pallas" (compiled Pallas/Triton, GPU), "pallas_interpret" (the same
kernels run by the Pallas interpreter, any backend: how the CPU tests check the kernel logic), "jnp" (the
tiled jnp path of blockwise.py), None/"auto" ("pallas" when jax.default_backend() == "gpu", else "jnp").

Block interface: `flash_block_forward` / `flash_block_backward` implement the `BlockOps` pair documented
in blockwise.py (fp32 results, caller-supplied *global* lse and delta), and `flash_block_ops(interpret)`
packages them for the distributed strategies. Inside `jax.shard_map` the compiled kernels work with
check_vma=False and with check_vma=True: the inputs are cast to a common set of varying mesh axes
(`lax.pcast`) and the pallas_call outputs are declared with it. The Pallas *interpreter* of JAX 0.10 cannot
run under check_vma=True (it type-checks the kernel body without vma), so "pallas_interpret" inside
shard_map needs check_vma=False; it raises a clear error otherwise.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxring.attention.blockwise import BlockOps, block_backward, block_forward
from jaxring.attention.masking import check_qkv
from jaxring.vma import vary, varying_axes

__all__ = ["flash_attention", "flash_block_forward", "flash_block_backward", "flash_block_ops",
           "IMPLEMENTATIONS", "default_block_config"]

IMPLEMENTATIONS = ("auto", "pallas", "pallas_interpret", "jnp")
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_INT_MIN = int(np.iinfo(np.int32).min)
_INT_MAX = int(np.iinfo(np.int32).max)
_MIN_BLOCK = 16  # Triton's dot needs every tile dimension >= 16.

_CompilerParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call (hashable: a jit static argument)."""
    causal: bool
    sm_scale: float
    implementation: str  # resolved: "pallas", "pallas_interpret" or "jnp"
    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """Tile sizes and launch settings of one kernel."""
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


def default_block_config(head_dim: int) -> dict[str, _Tiles]:
    """Default tiles for the three kernels ("fwd", "dkv", "dq"), chosen for Hopper (H100/H200).

    These follow the Triton FlashAttention-2 tutorial's Hopper configurations (128-row query tiles,
    64-key tiles, 4 warps for head_dim <= 64 and 8 for 128, 3 pipeline stages; narrow 32-wide inner tiles
    in the backward, where each program holds two fp32 accumulators). They have not been autotuned on this
    project's hardware; `benchmarks/flash_attention.py` measures them. Every value is overridable through
    `block_q`, `block_k`, `num_warps`, `num_stages`.
    """
    d = _padded_head_dim(head_dim)
    if d <= 64:
        return {"fwd": _Tiles(128, 64, 4, 3), "dkv": _Tiles(32, 128, 4, 3), "dq": _Tiles(128, 32, 4, 3)}
    if d <= 128:
        return {"fwd": _Tiles(128, 64, 8, 3), "dkv": _Tiles(32, 64, 4, 3), "dq": _Tiles(64, 32, 4, 3)}
    return {"fwd": _Tiles(64, 32, 4, 2), "dkv": _Tiles(16, 32, 4, 2), "dq": _Tiles(32, 16, 4, 2)}


def _padded_head_dim(head_dim: int) -> int:
    return max(_MIN_BLOCK, pl.next_power_of_2(head_dim))


def _tiles(cfg: _Config, head_dim: int, q_len: int, kv_len: int) -> dict[str, _Tiles]:
    """Per-kernel tiles after user overrides, shrunk for short sequences (never below 16)."""
    out = {}
    for name, t in default_block_config(head_dim).items():
        bq = cfg.block_q if cfg.block_q is not None else t.block_q
        bk = cfg.block_k if cfg.block_k is not None else t.block_k
        bq = min(bq, max(_MIN_BLOCK, pl.next_power_of_2(q_len)))
        bk = min(bk, max(_MIN_BLOCK, pl.next_power_of_2(kv_len)))
        out[name] = _Tiles(bq, bk, cfg.num_warps or t.num_warps, cfg.num_stages or t.num_stages)
    return out


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _resolve_implementation(implementation: str | None) -> str:
    if implementation is None or implementation == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "jnp"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation {implementation!r} is not one of {IMPLEMENTATIONS} (or None)")
    return implementation


def _check_block(name: str, value: int | None) -> None:
    if value is None:
        return
    if not isinstance(value, (int, np.integer)) or value < _MIN_BLOCK or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a power of two >= {_MIN_BLOCK} (a Triton tile size)")


def _make_config(causal, sm_scale, head_dim, implementation, block_q, block_k, num_warps, num_stages):
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer")
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    return _Config(bool(causal), scale, _resolve_implementation(implementation),
                   None if block_q is None else int(block_q), None if block_k is None else int(block_k),
                   num_warps, num_stages)


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    check_qkv(q, k, v)  # ranks, batch, head_dim, GQA divisibility
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {jnp.dtype(x.dtype).name}; flash attention supports bfloat16, "
                            f"float16 and float32 inputs (fp32 accumulation)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got {jnp.dtype(q.dtype).name}, "
                        f"{jnp.dtype(k.dtype).name} and {jnp.dtype(v.dtype).name}")
    batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
    for name, x, n in (("q_positions", q_positions, q_len), ("kv_positions", kv_positions, kv_len)):
        if x is None:
            continue
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} has dtype {jnp.dtype(x.dtype).name}; positions must be integers")
        if x.shape not in ((n,), (batch, n)):
            raise ValueError(f"{name} has shape {x.shape}; expected ({n},) or ({batch}, {n})")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("segment ids must be given for both queries and keys, or for neither")
    for name, x, n in (("q segment ids", q_segment_ids, q_len), ("kv segment ids", kv_segment_ids, kv_len)):
        if x is None:
            continue
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} have dtype {jnp.dtype(x.dtype).name}; segment ids must be integers")
        if x.shape != (batch, n):
            raise ValueError(f"{name} have shape {x.shape}; expected ({batch}, {n})")


# ----------------------------------------------------------------------------------------------------------
# shard_map support: pallas_call outputs must state their varying mesh axes when check_vma=True
# ----------------------------------------------------------------------------------------------------------

def _common_vma(*xs, interpret: bool = False):
    """Casts every array to the union of their varying mesh axes (a no-op outside shard_map)."""
    axes = frozenset().union(*(varying_axes(x) for x in xs if x is not None))
    if axes and interpret and _JAX_VERSION < (0, 11):
        raise ValueError(f"implementation='pallas_interpret' inside jax.shard_map with check_vma=True (inputs "
                         f"vary over mesh axes {sorted(axes)}) is not supported by the Pallas interpreter of "
                         f"jax {jax.__version__}; pass check_vma=False to shard_map, or use 'pallas' (GPU) or "
                         f"'jnp'")
    return [None if x is None else vary(x, axes) for x in xs]


_JAX_VERSION = tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2])
_SDS_PARAMS = inspect.signature(jax.ShapeDtypeStruct.__init__).parameters


def _out_struct(shape, dtype, like):
    """ShapeDtypeStruct carrying `like`'s varying mesh axes (jax 0.10: manual_axis_type; other versions: vma)."""
    aval = jax.typeof(like)
    if "manual_axis_type" in _SDS_PARAMS and getattr(aval, "manual_axis_type", None) is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
    if "vma" in _SDS_PARAMS and getattr(aval, "vma", None):
        return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)
    return jax.ShapeDtypeStruct(shape, dtype)


# ----------------------------------------------------------------------------------------------------------
# Padding and block ranges (plain jnp, outside the kernels)
# ----------------------------------------------------------------------------------------------------------

def _pad_axis(x, axis: int, size: int, value=0):
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _pad_tokens(x, seq_len: int, head_dim: int):
    """[b, n, h, d] -> [b, seq_len, h, head_dim] with zeros."""
    return _pad_axis(_pad_axis(x, 1, seq_len), 3, head_dim)


def _as_batched(x, batch: int, length: int, padded: int, fill: int):
    """[n] or [b, n] ints -> [b, padded] int32, padded with `fill`."""
    if x is None:
        return None
    x = jnp.asarray(x).astype(jnp.int32)
    x = jnp.broadcast_to(x, (batch, length)) if x.ndim == 1 else x
    return _pad_axis(x, 1, padded, fill)


def _block_stats(pos, seg, block: int):
    """Per-tile bounds: min/max position, min/max non-zero segment id, 'one segment, no padding'."""
    b, n = (pos if pos is not None else seg).shape
    stats = {}
    if pos is not None:
        p = pos.reshape(b, n // block, block)
        stats["pmin"], stats["pmax"] = p.min(-1), p.max(-1)
    if seg is not None:
        s = seg.reshape(b, n // block, block)
        smin = jnp.where(s == 0, _INT_MAX, s).min(-1)
        smax = jnp.where(s == 0, _INT_MIN, s).max(-1)
        stats["smin"], stats["smax"] = smin, smax
        stats["uniform"] = (smin == smax) & jnp.all(s != 0, axis=-1)
    return stats


def _visibility(causal, qpos, kpos, qseg, kseg, batch, nq, nk, kv_len, bq, bk):
    """vis[b, i, j]: tile (q block i, k block j) may hold a visible pair; full[b, i, j]: all its pairs are."""
    nqb, nkb = nq // bq, nk // bk
    vis = jnp.ones((batch, nqb, nkb), bool)
    full = vis
    if causal or qseg is not None:
        qs = _block_stats(qpos if causal else None, qseg, bq)
        ks = _block_stats(kpos if causal else None, kseg, bk)
        if causal:
            vis = vis & (qs["pmax"][:, :, None] >= ks["pmin"][:, None, :])
            full = full & (qs["pmin"][:, :, None] >= ks["pmax"][:, None, :])
        if qseg is not None:
            vis = vis & (qs["smin"][:, :, None] <= ks["smax"][:, None, :]) \
                      & (ks["smin"][:, None, :] <= qs["smax"][:, :, None])
            full = full & qs["uniform"][:, :, None] & ks["uniform"][:, None, :] \
                        & (qs["smin"][:, :, None] == ks["smin"][:, None, :])
    if nk > kv_len:  # tiles holding padded keys always take the masked path
        has_pad = (jnp.arange(nkb) + 1) * bk > kv_len
        full = full & ~has_pad[None, None, :]
    return vis, full & vis


def _loop_ranges(vis, full):
    """For each row of tiles (last axis = the loop axis): int32 [..., 4] = (lo, full_lo, full_hi, hi).

    Tiles outside [lo, hi) are skipped; [full_lo, full_hi) need no mask. When the fully visible tiles are
    not contiguous (unusual positions), full_lo = full_hi = lo and the whole range takes the masked path.
    """
    n = vis.shape[-1]

    def first_last(x):
        anyx = jnp.any(x, axis=-1)
        first = jnp.argmax(x, axis=-1)
        last = n - jnp.argmax(x[..., ::-1], axis=-1)
        return anyx, jnp.where(anyx, first, 0), jnp.where(anyx, last, 0)

    any_v, lo, hi = first_last(vis)
    any_f, flo, fhi = first_last(full)
    contiguous = any_f & (jnp.sum(full, axis=-1) == fhi - flo)
    flo = jnp.where(contiguous, flo, lo)
    fhi = jnp.where(contiguous, fhi, lo)
    return jnp.stack([lo, flo, fhi, hi], axis=-1).astype(jnp.int32)


def _prepare(cfg, tiles, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """Pads everything to kernel shapes; returns the padded arrays and the static layout."""
    b, q_len, hq, d = q.shape
    kv_len, hkv = k.shape[1], k.shape[2]
    d_pad = _padded_head_dim(d)
    nq = _round_up(q_len, max(t.block_q for t in tiles.values()))
    nk = _round_up(kv_len, max(t.block_k for t in tiles.values()))
    if cfg.causal:
        qpos = jnp.arange(q_len, dtype=jnp.int32) if q_positions is None else q_positions
        kpos = jnp.arange(kv_len, dtype=jnp.int32) if kv_positions is None else kv_positions
        # Padded queries get the lowest position (they see nothing), padded keys the highest (never seen).
        qpos = _as_batched(qpos, b, q_len, nq, _INT_MIN)
        kpos = _as_batched(kpos, b, kv_len, nk, _INT_MAX)
    else:
        qpos = kpos = None
    qseg = _as_batched(q_segment_ids, b, q_len, nq, 0)
    kseg = _as_batched(kv_segment_ids, b, kv_len, nk, 0)
    layout = dict(batch=b, q_len=q_len, kv_len=kv_len, q_heads=hq, kv_heads=hkv, head_dim=d,
                  d_pad=d_pad, nq=nq, nk=nk)
    return (_pad_tokens(q, nq, d_pad), _pad_tokens(k, nk, d_pad), _pad_tokens(v, nk, d_pad),
            qpos, kpos, qseg, kseg, layout)


# ----------------------------------------------------------------------------------------------------------
# Kernel helpers
# ----------------------------------------------------------------------------------------------------------

def _dot_general(a, b, contract):
    # fp32 inputs: full-precision (ieee) products; Triton's default for fp32 would be tf32.
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _dot_nt(a, b):
    """a @ b.T with fp32 accumulation."""
    return _dot_general(a, b, ((1,), (1,)))


def _dot_tn(a, b):
    """a.T @ b with fp32 accumulation."""
    return _dot_general(a, b, ((0,), (0,)))


def _dot(a, b):
    """a @ b with fp32 accumulation."""
    return _dot_general(a, b, ((1,), (0,)))


def _tile_mask(causal, kv_len, qpos, kpos, qseg, kseg, k_start, block_k):
    """Boolean [block_q, block_k] visibility of one tile (None: everything visible)."""
    mask = None

    def both(a, b):
        return b if a is None else a & b

    if causal:
        mask = both(mask, qpos[:, None] >= kpos[None, :])
    if qseg is not None:
        mask = both(mask, (qseg[:, None] == kseg[None, :]) & (qseg[:, None] != 0))
    if kv_len is not None:  # only when keys were padded and nothing above masks them
        mask = both(mask, (k_start + jnp.arange(block_k))[None, :] < kv_len)
    return mask


def _three_loops(ranges_ref, row, body, carry):
    """Runs body over tiles [lo, full_lo) masked, [full_lo, full_hi) unmasked, [full_hi, hi) masked."""
    lo, flo, fhi, hi = (ranges_ref[row, c] for c in range(4))
    carry = lax.fori_loop(lo, flo, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(flo, fhi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(fhi, hi, functools.partial(body, masked=True), carry)


def _load_rows_lse(lse_ref, idx):
    """lse (natural log) -> log2 domain; -inf rows (see nothing) -> 0 so exp2(-inf - 0) = 0, never NaN."""
    lse = lse_ref[idx]
    return jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)


# ----------------------------------------------------------------------------------------------------------
# Forward kernel
# ----------------------------------------------------------------------------------------------------------

def _fwd_kernel(ranges_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, o_ref, lse_ref, *,
                causal, sm_scale, block_k, index_mask_len):
    """One (q block, batch, q head): out = softmax(q k^T * scale) v over the visible keys, and lse.

    q_ref [block_q, d]; k_ref, v_ref [nk, d] (the whole padded K/V of the shared head); positions and
    segment ids [block_q] / [nk]; ranges_ref [num_q_blocks, 4]; o_ref [block_q, d]; lse_ref [block_q].
    """
    i = pl.program_id(0)
    q = q_ref[...]
    block_q = q.shape[0]
    qpos = qpos_ref[...] if causal else None
    qseg = qseg_ref[...] if qseg_ref is not None else None
    qk_scale = sm_scale * LOG2E  # scores in log2 units: exp(x) = exp2(x * log2 e)

    def body(j, carry, *, masked):
        acc, m_prev, l_prev = carry
        start = pl.multiple_of(j * block_k, block_k)
        keys = pl.ds(start, block_k)
        k = k_ref[keys, :]
        s = _dot_nt(q, k) * qk_scale                                   # S = Q K^T  [block_q, block_k]
        if masked:
            mask = _tile_mask(causal, index_mask_len, qpos, kpos_ref[keys] if causal else None, qseg,
                              kseg_ref[keys] if qseg is not None else None, start, block_k)
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))                # running row max
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)              # rows with no key yet: no NaN
        alpha = jnp.exp2(m_prev - m_safe)                              # rescales the old partial sums
        p = jnp.exp2(s - m_safe[:, None])                              # P~ = exp(S - m)
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        v = v_ref[keys, :]
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)        # O~ = diag(alpha) O~ + P~ V
        return acc, m_new, l_new

    init = (jnp.zeros(o_ref.shape, jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc, m, l = _three_loops(ranges_ref, i, body, init)

    empty = l == 0.0                                                   # no visible key in the whole row
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)          # O = diag(l)^-1 O~
    lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)  # natural-log lse


def _pallas_forward(cfg, tiles, layout, q, k, v, qpos, kpos, qseg, kseg, out_dtype):
    """Padded inputs -> out [b, nq, hq, d_pad] (out_dtype), lse [b, hq, nq] fp32."""
    t = tiles["fwd"]
    b, hq, hkv, nq, nk, d_pad = (layout[n] for n in ("batch", "q_heads", "kv_heads", "nq", "nk", "d_pad"))
    groups = hq // hkv
    vis, full = _visibility(cfg.causal, qpos, kpos, qseg, kseg, b, nq, nk, layout["kv_len"],
                            t.block_q, t.block_k)
    ranges = _loop_ranges(vis, full)                                   # [b, nq/bq, 4]
    q, k, v, qpos, kpos, qseg, kseg, ranges = _common_vma(
        q, k, v, qpos, kpos, qseg, kseg, ranges, interpret=cfg.implementation == "pallas_interpret")
    nqb = nq // t.block_q
    seg = qseg is not None
    index_mask_len = layout["kv_len"] if nk > layout["kv_len"] and not (cfg.causal or seg) else None

    q_tile = pl.BlockSpec((None, t.block_q, None, d_pad), lambda i, bi, h: (bi, i, h, 0))
    kv_all = pl.BlockSpec((None, nk, None, d_pad), lambda i, bi, h: (bi, 0, lax.div(h, groups), 0))
    q_row = pl.BlockSpec((None, t.block_q), lambda i, bi, h: (bi, i))
    k_row = pl.BlockSpec((None, nk), lambda i, bi, h: (bi, 0))
    in_specs = [
        pl.BlockSpec((None, nqb, 4), lambda i, bi, h: (bi, 0, 0)),
        q_tile, kv_all, kv_all,
        q_row if cfg.causal else None, k_row if cfg.causal else None,
        q_row if seg else None, k_row if seg else None,
    ]
    out_specs = [q_tile, pl.BlockSpec((None, None, t.block_q), lambda i, bi, h: (bi, h, i))]
    out_shape = [_out_struct(q.shape, out_dtype, q), _out_struct((b, hq, nq), jnp.float32, q)]
    kernel = functools.partial(_fwd_kernel, causal=cfg.causal, sm_scale=cfg.sm_scale, block_k=t.block_k,
                               index_mask_len=index_mask_len)
    return pl.pallas_call(
        kernel, grid=(nqb, b, hq), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=_CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=cfg.implementation == "pallas_interpret", name="jaxring_flash_fwd",
    )(ranges, q, k, v, qpos, kpos, qseg, kseg)


# ----------------------------------------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------------------------------------

def _dkv_kernel(ranges_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref,
                kseg_ref, dk_ref, dv_ref, *, causal, sm_scale, block_q, groups, index_mask_len):
    """One (k block, batch, kv head): dK, dV summed over the q blocks of all `groups` query heads.

    k_ref, v_ref [block_k, d]; q_ref, do_ref [nq, groups, d] (the query heads sharing this K/V head);
    lse_ref, delta_ref [groups, nq]; ranges_ref [num_k_blocks, 4] (loop range over q blocks).
    """
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    block_k = k.shape[0]
    k_start = j * block_k
    kpos = kpos_ref[...] if causal else None
    kseg = kseg_ref[...] if kseg_ref is not None else None
    qk_scale = sm_scale * LOG2E

    def body(i, carry, *, head, masked):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        q = q_ref[rows, head, :]
        do = do_ref[rows, head, :]
        s = _dot_nt(q, k) * qk_scale                                   # S [block_q, block_k], log2 units
        if masked:
            mask = _tile_mask(causal, index_mask_len, qpos_ref[rows] if causal else None, kpos,
                              qseg_ref[rows] if kseg is not None else None, kseg, k_start, block_k)
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp2(s - _load_rows_lse(lse_ref, (head, rows))[:, None])   # P = exp(S - lse)
        dv = dv + _dot_tn(p.astype(do.dtype), do)                      # dV += P^T dO
        dp = _dot_nt(do, v)                                            # dP = dO V^T
        ds = p * (dp - delta_ref[head, rows][:, None])                 # dS = P * (dP - delta)
        dk = dk + _dot_tn(ds.astype(q.dtype), q)                       # dK += dS^T Q   (scale at the end)
        return dk, dv

    def one_head(head, carry):
        return _three_loops(ranges_ref, j, functools.partial(body, head=head), carry)

    zeros = jnp.zeros(dk_ref.shape, jnp.float32)
    if groups == 1:
        dk, dv = one_head(0, (zeros, zeros))
    else:
        dk, dv = lax.fori_loop(0, groups, one_head, (zeros, zeros))
    dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(ranges_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref,
               kseg_ref, dq_ref, *, causal, sm_scale, block_k, index_mask_len):
    """One (q block, batch, q head): dQ = scale * sum over K/V tiles of dS K.

    q_ref, do_ref [block_q, d]; k_ref, v_ref [nk, d]; lse_ref, delta_ref [block_q];
    ranges_ref [num_q_blocks, 4] (loop range over k blocks).
    """
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse = _load_rows_lse(lse_ref, slice(None))
    delta = delta_ref[...]
    qpos = qpos_ref[...] if causal else None
    qseg = qseg_ref[...] if qseg_ref is not None else None
    qk_scale = sm_scale * LOG2E

    def body(j, dq, *, masked):
        start = pl.multiple_of(j * block_k, block_k)
        keys = pl.ds(start, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        s = _dot_nt(q, k) * qk_scale
        if masked:
            mask = _tile_mask(causal, index_mask_len, qpos, kpos_ref[keys] if causal else None, qseg,
                              kseg_ref[keys] if qseg is not None else None, start, block_k)
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp2(s - lse[:, None])                                 # P = exp(S - lse)
        dp = _dot_nt(do, v)                                            # dP = dO V^T
        ds = p * (dp - delta[:, None])                                 # dS = P * (dP - delta)
        return dq + _dot(ds.astype(k.dtype), k)                        # dQ += dS K

    dq = _three_loops(ranges_ref, i, body, jnp.zeros(dq_ref.shape, jnp.float32))
    dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


def _pallas_backward(cfg, tiles, layout, q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, dtypes):
    """Padded inputs (lse, delta [b, hq, nq]) -> dq, dk, dv padded, in `dtypes`."""
    b, hq, hkv, nq, nk, d_pad = (layout[n] for n in ("batch", "q_heads", "kv_heads", "nq", "nk", "d_pad"))
    groups = hq // hkv
    seg = qseg is not None
    interpret = cfg.implementation == "pallas_interpret"
    index_mask_len = layout["kv_len"] if nk > layout["kv_len"] and not (cfg.causal or seg) else None
    (q, k, v, do, lse, delta, qpos, kpos, qseg, kseg) = _common_vma(q, k, v, do, lse, delta, qpos, kpos,
                                                                    qseg, kseg, interpret=interpret)

    # dK/dV: grid over (k block, batch, kv head); loops over q blocks of the group's query heads.
    t = tiles["dkv"]
    vis, full = _visibility(cfg.causal, qpos, kpos, qseg, kseg, b, nq, nk, layout["kv_len"],
                            t.block_q, t.block_k)
    ranges = _loop_ranges(jnp.swapaxes(vis, 1, 2), jnp.swapaxes(full, 1, 2))  # [b, nk/bk, 4]
    (ranges,) = _common_vma(ranges, q)[:1]
    nkb = nk // t.block_k
    k_tile = pl.BlockSpec((None, t.block_k, None, d_pad), lambda j, bi, h: (bi, j, h, 0))
    q_group = pl.BlockSpec((None, nq, groups, d_pad), lambda j, bi, h: (bi, 0, h, 0))
    row_group = pl.BlockSpec((None, groups, nq), lambda j, bi, h: (bi, h, 0))
    q_row = pl.BlockSpec((None, nq), lambda j, bi, h: (bi, 0))
    k_row = pl.BlockSpec((None, t.block_k), lambda j, bi, h: (bi, j))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, causal=cfg.causal, sm_scale=cfg.sm_scale, block_q=t.block_q,
                          groups=groups, index_mask_len=index_mask_len),
        grid=(nkb, b, hkv),
        in_specs=[pl.BlockSpec((None, nkb, 4), lambda j, bi, h: (bi, 0, 0)),
                  q_group, k_tile, k_tile, q_group, row_group, row_group,
                  q_row if cfg.causal else None, k_row if cfg.causal else None,
                  q_row if seg else None, k_row if seg else None],
        out_specs=[k_tile, k_tile],
        out_shape=[_out_struct(k.shape, dtypes[1], q), _out_struct(v.shape, dtypes[2], q)],
        compiler_params=_CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret, name="jaxring_flash_dkv",
    )(ranges, q, k, v, do, lse, delta, qpos, kpos, qseg, kseg)

    # dQ: grid over (q block, batch, q head); loops over k blocks.
    t = tiles["dq"]
    vis, full = _visibility(cfg.causal, qpos, kpos, qseg, kseg, b, nq, nk, layout["kv_len"],
                            t.block_q, t.block_k)
    (ranges,) = _common_vma(_loop_ranges(vis, full), q)[:1]
    nqb = nq // t.block_q
    q_tile = pl.BlockSpec((None, t.block_q, None, d_pad), lambda i, bi, h: (bi, i, h, 0))
    kv_all = pl.BlockSpec((None, nk, None, d_pad), lambda i, bi, h: (bi, 0, lax.div(h, groups), 0))
    row_tile = pl.BlockSpec((None, None, t.block_q), lambda i, bi, h: (bi, h, i))
    q_row = pl.BlockSpec((None, t.block_q), lambda i, bi, h: (bi, i))
    k_row = pl.BlockSpec((None, nk), lambda i, bi, h: (bi, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, causal=cfg.causal, sm_scale=cfg.sm_scale, block_k=t.block_k,
                          index_mask_len=index_mask_len),
        grid=(nqb, b, hq),
        in_specs=[pl.BlockSpec((None, nqb, 4), lambda i, bi, h: (bi, 0, 0)),
                  q_tile, kv_all, kv_all, q_tile, row_tile, row_tile,
                  q_row if cfg.causal else None, k_row if cfg.causal else None,
                  q_row if seg else None, k_row if seg else None],
        out_specs=q_tile,
        out_shape=_out_struct(q.shape, dtypes[0], q),
        compiler_params=_CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret, name="jaxring_flash_dq",
    )(ranges, q, k, v, do, lse, delta, qpos, kpos, qseg, kseg)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------
# Unpadded forward / backward on one (Q, K/V) pair, for every implementation
# ----------------------------------------------------------------------------------------------------------

def _jnp_call(fn, q_positions, kv_positions, args, kwargs):
    """block_forward/backward take [n] positions; batched [b, n] positions run them per batch row."""
    if q_positions.ndim == 1 and kv_positions.ndim == 1:
        return fn(*args[:-4], q_positions, kv_positions, *args[-2:], **kwargs)
    b = args[0].shape[0]
    qp = jnp.broadcast_to(q_positions, (b,) + q_positions.shape[-1:])
    kp = jnp.broadcast_to(kv_positions, (b,) + kv_positions.shape[-1:])

    def one(*row):
        arrays, (qpi, kpi, qsi, ksi) = row[:-4], row[-4:]
        add = lambda x: None if x is None else x[None]
        out = fn(*(add(x) for x in arrays), qpi, kpi, add(qsi), add(ksi), **kwargs)
        return jax.tree.map(lambda x: x[0], out)

    return jax.vmap(one)(*args[:-4], qp, kp, *args[-2:])


def _default_positions(q_positions, kv_positions, q_len, kv_len):
    qp = jnp.arange(q_len, dtype=jnp.int32) if q_positions is None else jnp.asarray(q_positions)
    kp = jnp.arange(kv_len, dtype=jnp.int32) if kv_positions is None else jnp.asarray(kv_positions)
    return qp, kp


def _forward(cfg, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, out_dtype):
    """-> out [b, nq, hq, d] (out_dtype), lse [b, nq, hq] fp32."""
    if cfg.implementation == "jnp":
        qp, kp = _default_positions(q_positions, kv_positions, q.shape[1], k.shape[1])
        out, lse = _jnp_call(block_forward, qp, kp, (q, k, v, qp, kp, q_segment_ids, kv_segment_ids),
                             dict(causal=cfg.causal, sm_scale=cfg.sm_scale))
        return out.astype(out_dtype), lse
    tiles = _tiles(cfg, q.shape[3], q.shape[1], k.shape[1])
    *padded, layout = _prepare(cfg, tiles, q, k, v, q_positions, kv_positions, q_segment_ids,
                               kv_segment_ids)
    out, lse = _pallas_forward(cfg, tiles, layout, *padded, out_dtype)
    q_len, d = layout["q_len"], layout["head_dim"]
    return out[:, :q_len, :, :d], jnp.swapaxes(lse, 1, 2)[:, :q_len]


def _backward(cfg, q, k, v, dout, lse, delta, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
              dtypes):
    """lse, delta [b, nq, hq] (global values) -> dq, dk, dv in `dtypes`."""
    if cfg.implementation == "jnp":
        qp, kp = _default_positions(q_positions, kv_positions, q.shape[1], k.shape[1])
        grads = _jnp_call(block_backward, qp, kp,
                          (q, k, v, dout, lse, delta, qp, kp, q_segment_ids, kv_segment_ids),
                          dict(causal=cfg.causal, sm_scale=cfg.sm_scale))
        return tuple(g.astype(dt) for g, dt in zip(grads, dtypes))
    tiles = _tiles(cfg, q.shape[3], q.shape[1], k.shape[1])
    q_p, k_p, v_p, qpos, kpos, qseg, kseg, layout = _prepare(
        cfg, tiles, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    nq, d_pad = layout["nq"], layout["d_pad"]
    # dO in the inputs' dtype for the tensor-core matmuls; padded rows: dO = 0, lse = +inf, delta = 0.
    do_p = _pad_tokens(dout.astype(q.dtype), nq, d_pad)
    lse_p = _pad_axis(jnp.swapaxes(lse.astype(jnp.float32), 1, 2), 2, nq, jnp.inf)
    delta_p = _pad_axis(jnp.swapaxes(delta.astype(jnp.float32), 1, 2), 2, nq, 0.0)
    dq, dk, dv = _pallas_backward(cfg, tiles, layout, q_p, k_p, v_p, do_p, lse_p, delta_p, qpos, kpos,
                                  qseg, kseg, dtypes)
    d = layout["head_dim"]
    return dq[:, :layout["q_len"], :, :d], dk[:, :layout["kv_len"], :, :d], dv[:, :layout["kv_len"], :, :d]


# ----------------------------------------------------------------------------------------------------------
# Differentiable attention (custom_vjp: FA2 backward from out and lse)
# ----------------------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    return _forward(cfg, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, q.dtype)


def _attention_fwd(cfg, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    out, lse = _forward(cfg, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, q.dtype)
    return (out, lse), (q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, out, lse)


def _attention_bwd(cfg, res, cts):
    q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, out, lse = res
    dout, dlse = cts
    # delta = rowsum(dO * O); d lse / d S = P, so a cotangent on lse enters as delta - dlse.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - dlse.astype(jnp.float32)
    dq, dk, dv = _backward(cfg, q, k, v, dout, lse, delta, q_positions, kv_positions, q_segment_ids,
                           kv_segment_ids, (q.dtype, k.dtype, v.dtype))
    return dq, dk, dv, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
_attention_jit = jax.jit(_attention, static_argnums=0)


def flash_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None, q_positions=None,
                    kv_positions=None, segment_ids=None, kv_segment_ids=None, return_lse: bool = False,
                    block_q: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, implementation: str | None = None):
    """Memory-efficient exact attention; differentiable (FA2 backward).

    Args:
      q: [batch, q_len, q_heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim]; one dtype among
        bfloat16, float16, float32 (accumulation is fp32). q_heads % kv_heads == 0 (GQA/MQA).
      causal: query i sees key j iff q_positions[i] >= kv_positions[j].
      sm_scale: score scale, default 1/sqrt(head_dim).
      q_positions, kv_positions: int [q_len] / [kv_len] (or [batch, len]); default arange. Only used when
        causal.
      segment_ids: int [batch, q_len]; kv_segment_ids: int [batch, kv_len], default segment_ids. Tokens attend
        within equal ids; 0 is padding (attends to nothing, attended by nothing).
      return_lse: also return lse fp32 [batch, q_len, q_heads] (natural log; differentiable).
      block_q, block_k: tile sizes (powers of two >= 16) overriding the Hopper defaults of every kernel
        (forward, dK/dV and dQ); num_warps, num_stages: Triton launch settings. Ignored by "jnp".
      implementation: None/"auto", "pallas", "pallas_interpret" or "jnp" (see the module docstring).

    Returns:
      out [batch, q_len, q_heads, head_dim] in q.dtype, or (out, lse) when return_lse.
    """
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    _check_inputs(q, k, v, q_positions, kv_positions, segment_ids, kv_segment_ids)
    cfg = _make_config(causal, sm_scale, q.shape[3], implementation, block_q, block_k, num_warps, num_stages)
    out, lse = _attention_jit(cfg, q, k, v, q_positions, kv_positions, segment_ids, kv_segment_ids)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------------------
# Block interface (see blockwise.py): used by the distributed strategies
# ----------------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=0)
def _block_forward_jit(cfg, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    return _forward(cfg, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _block_backward_jit(cfg, q, k, v, dout, lse, delta, q_positions, kv_positions, q_segment_ids,
                        kv_segment_ids):
    return _backward(cfg, q, k, v, dout, lse, delta, q_positions, kv_positions, q_segment_ids,
                     kv_segment_ids, (jnp.float32,) * 3)


def flash_block_forward(q, k, v, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None, *,
                        causal: bool, sm_scale: float, implementation: str | None = None,
                        block_q: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                        num_stages: int | None = None):
    """BlockOps forward: attention of one Q block over one K/V block.

    Returns out fp32 [b, nq, hq, d] (normalised over this block's keys) and lse fp32 [b, nq, hq] (-inf on
    rows that see none of this block's keys). Positions int [n] (or [b, n]); segment ids [b, n] or None.
    """
    _check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    cfg = _make_config(causal, sm_scale, q.shape[3], implementation, block_q, block_k, num_warps, num_stages)
    return _block_forward_jit(cfg, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)


def flash_block_backward(q, k, v, dout, lse, delta, q_positions, kv_positions, q_segment_ids=None,
                         kv_segment_ids=None, *, causal: bool, sm_scale: float,
                         implementation: str | None = None, block_q: int | None = None,
                         block_k: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None):
    """BlockOps backward: fp32 (dq, dk, dv) of one (Q block, K/V block) pair.

    lse and delta = rowsum(dout * out) are the *global* per-row values [b, nq, hq] (over all K/V blocks), so
    this block's probabilities are the global ones and the gradients of all blocks simply add up.
    """
    _check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    b, nq, hq = q.shape[:3]
    for name, x in (("dout", dout), ("lse", lse), ("delta", delta)):
        want = q.shape if name == "dout" else (b, nq, hq)
        if x.shape != want:
            raise ValueError(f"{name} has shape {x.shape}; expected {want}")
    cfg = _make_config(causal, sm_scale, q.shape[3], implementation, block_q, block_k, num_warps, num_stages)
    return _block_backward_jit(cfg, q, k, v, dout, lse, delta, q_positions, kv_positions, q_segment_ids,
                               kv_segment_ids)


def flash_block_ops(interpret: bool = False, **kernel_options) -> BlockOps:
    """The Pallas kernels as a `BlockOps` pair: compiled ("pallas") or interpreted ("pallas_interpret").

    `kernel_options` (block_q, block_k, num_warps, num_stages) are passed to both functions.
    """
    name = "pallas_interpret" if interpret else "pallas"
    return BlockOps(name, functools.partial(flash_block_forward, implementation=name, **kernel_options),
                    functools.partial(flash_block_backward, implementation=name, **kernel_options))
