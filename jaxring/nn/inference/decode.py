"""One decoding step against a KV cache sharded over `sp` (in the plan's layout) and over `tp` by heads.

Prefill leaves, per layer, K and V as attention sees them (after QK-norm and RoPE; GQA's kv heads, not
repeated) for every cached position, each device holding the positions its training shard would hold
(`plan.layout_tokens`: zigzag/striped keep their laid-out order; `cache_positions` says which true position
each slot has). A decoding step, for one new token per sequence at position t_b:

  every device        q, k_t, v_t = x W_q, x W_k, x W_v            (x: the new token, replicated over sp)
  every device        (o_i, lse_i) = softmax-attention of q over its shard, keys j with
                      j < t_b and j > t_b - W (sliding window; slots from t_b on hold stale values)
  once                gather (o_i, lse_i) over sp; (o, lse) = merge_partials over i   (log-sum-exp, not a ring)
  every device        o = merge_partials(o, lse, v_t, q·k_t)      (the new token's own key)
  the owner of t_b    K[slot(t_b)], V[slot(t_b)] = k_t, v_t   (`write_cache`, after all layers: one scatter
                      into the donated cache, which is never copied)

The heads split over tp as Megatron's: local q heads hq/tp, kv heads hkv/tp (or each rank its own kv head when
hkv < tp); the output projection and the MLP's second linear are summed over tp, the vocab-split logits
gathered. Everything runs inside the plan's shard_map on local shards; x is [b, 1, hidden], the same on
every device of a data-parallel group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import spec_entry
from jaxring.core.vma import gather_invariant, vary_like
from jaxring.kernels.layer_math import activate, add_bias, head_norm, qk_norm_rope, split_heads
from jaxring.kernels.merge import merge_partials
from jaxring.kernels.rope import Rope, as_rope
from jaxring.parallel.catalog import tensor_methods
from jaxring.parallel.plan import ParallelPlan
from jaxring.parallel.tensor.splits import own_kv_head


def check_decodable(plan: ParallelPlan) -> None:
    """Raises (one line) on a plan the KV-cache decoder cannot run: a pipeline, the tables split over the
    vocabulary, or a tensor method that does not declare `decodes` (the heads split over tp as Megatron's, or
    nothing split)."""
    if plan.pp > 1:
        raise ValueError(f"generate runs without a pipeline (pp = {plan.pp}); use a plan with pp = 1")
    plan.tensor.check_whole_tables(plan, "generate")
    if not plan.tensor.decodes:
        decoding = ", ".join(name for name, method in tensor_methods().items() if method.decodes)
        raise ValueError(
            f"generate decodes with tensor parallelism {decoding}; got {plan.tensor.name!r} (use megatron, or tp = 1)"
        )


def cache_length(plan: ParallelPlan, needed: int) -> int:
    """The cache length: the smallest length >= needed that splits over the plan (its layout's multiple: 2·sp
    for zigzag, sp·tp under Megatron, ...)."""
    for length in range(needed, needed + 64 * plan.mesh.devices.size + 1):
        try:
            plan.check_seq_len(length, causal=True)
        except ValueError:
            continue
        return length
    plan.check_seq_len(needed, causal=True)  # raises the plan's own message
    return needed


def local_kv_heads(plan: ParallelPlan, num_kv_heads: int) -> int:
    """KV heads a device holds: all of them (tp = 1), hkv / tp, or its own one when hkv < tp."""
    if plan.tp == 1:
        return num_kv_heads
    return num_kv_heads // plan.tp if num_kv_heads >= plan.tp else 1


def cache_spec(plan: ParallelPlan) -> P:
    """PartitionSpec of a stacked cache [layers, batch, length, kv_heads·, head_dim]: batch over the data axes,
    length over the sequence axes (in the layout), heads over tp (where hkv < tp the global head dim holds
    each tp rank's own copy: tp entries)."""
    return P(None, spec_entry(plan.batch_axes), plan.seq_axis, "tp" if plan.tp > 1 else None, None)


def prefill_kv(
    plan: ParallelPlan,
    x: jax.Array,
    w: dict,
    positions: jax.Array,
    *,
    num_kv_heads: int,
    head_dim: int,
    rope: Rope | float | None,
    norm_eps: float,
) -> tuple[jax.Array, jax.Array]:
    """The cache entries of one layer from its normed input x (local, the plan's activation layout) and the
    token-layout positions int [b, n]: (k, v) [b, n, local kv heads, head_dim], k after QK-norm and RoPE.
    n = this device's sp shard (Megatron's sub-shards gathered over tp, as its attention does)."""
    if plan.tp > 1:
        w = own_kv_head(w, num_kv_heads, plan.tp, head_dim)
        x = lax.all_gather(x, "tp", axis=1, tiled=True)
    b, n = x.shape[:2]
    k = add_bias(x @ w["wk"], w.get("bk")).reshape(b, n, -1, head_dim)
    v = add_bias(x @ w["wv"], w.get("bv")).reshape(b, n, -1, head_dim)
    k = head_norm(k, w.get("k_norm"), eps=norm_eps)
    rope = as_rope(rope)
    return (k if rope is None else rope.apply(k, positions)), v


def write_cache(cache: jax.Array, new: jax.Array, cache_positions: jax.Array, positions: jax.Array) -> jax.Array:
    """cache [layers, b, n, h, d] with new [layers, b, h, d] written where cache_positions [n] equals
    positions [b] (on the device holding that position; elsewhere unchanged)."""
    match = cache_positions[None, :] == positions[:, None]  # [b, n]
    owned, slot = match.any(axis=-1), jnp.argmax(match, axis=-1)
    rows = jnp.arange(cache.shape[1])
    new = vary_like(new.astype(cache.dtype), cache)
    return cache.at[:, rows, slot].set(jnp.where(owned[None, :, None, None], new, cache[:, rows, slot]))


def attend_cache_shard(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_positions: jax.Array,
    positions: jax.Array,
    *,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Partial attention of one query per sequence over this device's cache shard.

    q [b, hq, d]; k, v [b, n, hkv, d] (query head j reads kv head j // (hq / hkv)); key_positions int [n];
    positions int [b] (the queries'). Keys j < t (and j > t - window) are seen: the query's own key is not in
    the cache yet. Returns (o [b, hq, d], lse
    [b, hq]) fp32, o normalised over the seen keys, lse = -inf (o = 0) where none is seen.
    """
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d) * d**-0.5
    scores = jnp.einsum("bkgd,bnkd->bkgn", qg, k.astype(jnp.float32))
    seen = key_positions[None, :] < positions[:, None]
    if window is not None:
        seen &= key_positions[None, :] > positions[:, None] - window
    scores = jnp.where(seen[:, None, None, :], scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [b, hkv, g]
    p = jnp.exp(scores - jnp.where(jnp.isneginf(lse), 0.0, lse)[..., None])
    o = jnp.einsum("bkgn,bnkd->bkgd", p, v.astype(jnp.float32))
    return o.reshape(b, hq, d), lse.reshape(b, hq)


def merge_over(o: jax.Array, lse: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """The partial results (o [b, h, d], lse [b, h]) of every device over `axes` merged by their log-sum-exp:
    one all-gather of (o, lse), then `merge_partials`. Returns (o, lse), the same on every device of `axes`."""
    if not axes:
        return o, lse
    os_, lses = (gather_invariant(t[None], axes, 0) for t in (o, lse))
    out, total = os_[0], lses[0]
    for i in range(1, os_.shape[0]):
        out, total = merge_partials(out, total, os_[i], lses[i])
    return out, total


def own_key(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The partial result of each query q [b, hq, d] over its own token's key alone, k, v [b, hkv, d]:
    (o = v [b, hq, d], lse = q·k / sqrt(d) [b, hq]) fp32."""
    group = q.shape[1] // k.shape[1]
    k, v = (jnp.repeat(t.astype(jnp.float32), group, axis=1) for t in (k, v))
    return v, jnp.sum(q.astype(jnp.float32) * k, axis=-1) * q.shape[-1] ** -0.5


def decode_attention(
    plan: ParallelPlan,
    x: jax.Array,
    w: dict,
    positions: jax.Array,
    cache: tuple,
    cache_positions: jax.Array,
    *,
    num_kv_heads: int,
    head_dim: int,
    rope: Rope | float | None,
    window: int | None,
    norm_eps: float,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One attention layer for the new tokens x [b, 1, hidden] at positions int [b], attending the local cache
    (k, v) [b, n, local kv heads, d] (the positions before theirs) and their own keys. Returns (y [b, 1, hidden],
    (k_t, v_t) [b, local kv heads, d]): the new K/V, for `write_cache`."""
    if plan.tp > 1:
        w = own_kv_head(w, num_kv_heads, plan.tp, head_dim)
    q, k, v = split_heads(*(add_bias(x @ w[f"w{n}"], w.get(f"b{n}")) for n in "qkv"), head_dim)
    q, k = qk_norm_rope(q, k, w, positions[:, None], rope, eps=norm_eps)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]
    o, lse = attend_cache_shard(q, cache[0], cache[1], cache_positions, positions, window=window)
    o, lse = merge_over(o, lse, plan.seq_axes)
    o, _ = merge_partials(o, lse, *own_key(q, k, v))
    y = o.reshape(x.shape[0], 1, -1).astype(x.dtype) @ w["wo"]
    if plan.tp > 1:
        y = lax.psum(y, "tp")
    return add_bias(y, w.get("bo")), (k, v)


def decode_mlp(plan: ParallelPlan, x: jax.Array, w: dict, *, activation: str) -> jax.Array:
    """The MLP on the new tokens x [b, 1, hidden] (replicated): column-split first linear(s), row-split second
    summed over tp."""
    gate = add_bias(x @ w["w_gate"], w.get("b_gate")) if activation == "swiglu" else None
    y = activate(add_bias(x @ w["w_in"], w.get("b_in")), gate, activation) @ w["w_out"]
    if plan.tp > 1:
        y = lax.psum(y, "tp")
    return add_bias(y, w.get("b_out"))


def decode_embed(
    plan: ParallelPlan,
    tokens: jax.Array,
    table: jax.Array,
    positions: jax.Array | None = None,
    pos_table: jax.Array | None = None,
) -> jax.Array:
    """tokens int [b] -> x [b, 1, hidden]: the table's rows (split by vocab over tp: masked lookups summed),
    plus the learned position rows of positions int [b] when pos_table is given."""
    if plan.tp > 1:
        rows = table.shape[0]
        local = tokens - lax.axis_index("tp") * rows
        mine = (local >= 0) & (local < rows)
        x = jnp.where(mine[:, None], jnp.take(table, jnp.where(mine, local, 0), axis=0), 0)
        x = lax.psum(x, "tp")
    else:
        x = jnp.take(table, tokens, axis=0)
    if pos_table is not None:
        x = x + jnp.take(pos_table, positions, axis=0)
    return x[:, None, :]


def decode_logits(plan: ParallelPlan, x: jax.Array, w: jax.Array, *, tied: bool) -> jax.Array:
    """fp32 logits [b, vocab] of normed x [b, 1, hidden]: w is the head [hidden, vocab] or the tied table
    [vocab, hidden] (vocab split over tp: the pieces gathered)."""
    logits = (x[:, 0] @ (w.T if tied else w)).astype(jnp.float32)
    return gather_invariant(logits, "tp", 1) if plan.tp > 1 else logits
