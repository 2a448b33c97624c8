"""The embedding and the LM head split over the vocabulary, their blocks on a ring: for layouts that split the
sequence over the same axes as the vocabulary (`--vocab-split ring`, `vocab_split.py`: METP over tp, the
sequence strategies over sp).

Rank r keeps the vocab rows [r·V/p, (r+1)·V/p) of the table [V, h] (and the same columns of the head [h, V]) and
its own tokens [b, n]. The tokens stay; the vocab blocks go round the ring, so no device ever holds a whole
table, its gradient or a whole row of logits. Rank r holds block (r - j) mod p at step j (`collectives.FORWARD`).

Embedding (`ring_embed`), each token's row lies in exactly one block:

    for j in 0 .. p-1:  X += E^(j)[tokens in block j]      (send E^(j) on, issued before the lookup)

  Backward: the table is not needed. An fp32 gradient accumulator per block goes round the other way
  (`collectives.BACKWARD`; rank r holds block (r + 1 + j) mod p's at step j) and ends on its owner:
  ΔE^(j) += scatter-add of ΔX's rows of the tokens in block j.

LM head and cross-entropy (`ring_cross_entropy`), the online logsumexp of flash attention over the vocab blocks,
one tile of rows at a time (`tiles`: the plan's --loss-tile, else tiles of at most RING_LOSS_ROWS rows) so that a
logits block is [b, n/tiles, V/p]:

    for j in 0 .. p-1:  T = X W^(j) (fp32);  m, Z <- max, Σexp online;  l_t += T[target] if it is in block j
    loss = log Z + m - l_t

  Backward (custom VJP; residuals X, the rank's own block and lse = m + log Z, fp32 [b, n]):

    for j:  T = X W^(j);  ΔT = (exp(T - lse) - onehot) · Δloss;  ΔX += ΔT W^(j)ᵀ;  ΔW^(j) += Xᵀ ΔT

  The blocks go round the other way (rank r holds block (r + j) mod p at step j): a hop identical to the
  forward's would let XLA keep the forward's received blocks for the backward. ΔW^(j) travels with its block
  and makes p hops, ending on its owner (as METP's FFN ring, Algorithm 2). ΔX is summed in fp32 over the
  blocks (one fp32 [b, n, h] in the head's backward).

Bytes per device, v = V·h/p a block: embedding forward (p-1)·v, backward (p-1)·v fp32; head forward (p-1)·v,
backward (p-1)·v and p·v fp32. The blocks never meet the whole table: the peak holds two blocks and one
accumulator, against the whole table, its fp32 gradient and a whole row of logits replicated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.core.collectives import BACKWARD, FORWARD, ring_steps, send_to_next
from jaxring.core.vma import sum_like, vary_like


def _in_block(ids: jax.Array, owner: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """(local index, whether the id is in `owner`'s block of `rows` vocab ids): int, bool like ids."""
    local = ids - owner * rows
    mine = (local >= 0) & (local < rows)
    return jnp.where(mine, local, 0), mine


# Rows of ΔX scattered into the table's gradient at once in the embedding's backward
EMBED_CHUNK_ROWS = 8192
# Rows of a logits block at once when the run sets no --loss-tile: the ring's loss is tiled by design
RING_LOSS_ROWS = 4096


def ring_loss_tiles(rows: int, loss_tile: int | None, tiles: int) -> int:
    """Row tiles of the ring's loss over a device's `rows`: the plan's `tiles` of --loss-tile when it is set,
    else tiles of at most RING_LOSS_ROWS rows (the same per-row sums: only the memory changes)."""
    return tiles if loss_tile is not None else rows // _divisor_at_most(rows, RING_LOSS_ROWS)


def _divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of n not above limit."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


# ---------------------------------------------------------------------------------------- the embedding


def ring_embed(tokens: jax.Array, block: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """tokens int [b, n] (this rank's), block [V/p, h] (this rank's vocab rows) -> x [b, n, h] in block's dtype."""
    return _ring_embed(tokens, block, axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ring_embed(tokens: jax.Array, block: jax.Array, axis_name: str) -> jax.Array:
    p, rank, rows = lax.axis_size(axis_name), lax.axis_index(axis_name), block.shape[0]

    def step(x: jax.Array, held: jax.Array, j: jax.Array) -> jax.Array:
        local, mine = _in_block(tokens, (rank - j) % p, rows)
        # ids outside the block read zeros (fill), so the sum over the blocks is the plain lookup, exactly
        return x + jnp.take(held, jnp.where(mine, local, rows), axis=0, mode="fill", fill_value=0)

    x = vary_like(jnp.zeros(tokens.shape + block.shape[1:], block.dtype), tokens)
    x = vary_like(x, block)
    return ring_steps(step, x, block, p, lambda b: send_to_next(b, axis_name, shift=FORWARD))


def _ring_embed_fwd(tokens: jax.Array, block: jax.Array, axis_name: str) -> tuple:
    return _ring_embed(tokens, block, axis_name), (tokens, block)


def _ring_embed_bwd(axis_name: str, residuals: tuple, dx: jax.Array) -> tuple:
    tokens, block = residuals
    p, rank, rows = lax.axis_size(axis_name), lax.axis_index(axis_name), block.shape[0]
    ids, flat_dx = tokens.reshape(-1), dx.reshape(-1, dx.shape[-1])
    chunk = _divisor_at_most(ids.shape[0], EMBED_CHUNK_ROWS)

    def add_rows(acc: jax.Array, owner: jax.Array) -> jax.Array:
        def one(c: jax.Array, acc: jax.Array) -> jax.Array:  # a chunk of rows at a time: no fp32 copy of the whole ΔX
            local, mine = _in_block(lax.dynamic_slice_in_dim(ids, c * chunk, chunk), owner, rows)
            rows_dx = lax.dynamic_slice_in_dim(flat_dx, c * chunk, chunk).astype(jnp.float32)
            return acc.at[jnp.where(mine, local, rows)].add(rows_dx, mode="drop")  # other blocks' ids dropped

        return lax.fori_loop(0, ids.shape[0] // chunk, one, acc)

    acc = vary_like(vary_like(jnp.zeros(block.shape, jnp.float32), block), dx)
    for j in range(p):  # p small; the last step keeps its sum (it is the owner's)
        acc = add_rows(acc, (rank + 1 + j) % p)
        if j < p - 1:
            acc = send_to_next(acc, axis_name, shift=BACKWARD)
    return None, sum_like(acc, block).astype(block.dtype)  # None: the tokens are integers


_ring_embed.defvjp(_ring_embed_fwd, _ring_embed_bwd)


# ---------------------------------------------------------------------------------------- the head's loss


def ring_cross_entropy(
    x: jax.Array, w: jax.Array, targets: jax.Array, axis_name: str | tuple[str, ...], tiles: int = 1
) -> jax.Array:
    """Per-token loss fp32 [b, n] of logits x @ [the whole head]: x [b, n, h] (this rank's rows), w [h, V/p] (this
    rank's vocab columns), targets int [b, n] in [0, V). tiles: row tiles of the logits (n % tiles == 0)."""
    if x.shape[1] % tiles:
        raise ValueError(f"{tiles} loss tiles must divide the {x.shape[1]} rows of a device")
    return _ring_cross_entropy(x, w, targets, axis_name, tiles)


def _tile(a: jax.Array, t: jax.Array, size: int) -> jax.Array:
    """Rows [t·size, (t+1)·size) of a [b, n, ...] along n."""
    return lax.dynamic_slice_in_dim(a, t * size, size, axis=1)


def _logits(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [b, r, h] @ w [h, c] -> fp32 [b, r, c]."""
    return jnp.einsum("brh,hc->brc", x, w, preferred_element_type=jnp.float32)


def _forward_stats(x: jax.Array, w: jax.Array, targets: jax.Array, axis_name: str, tiles: int) -> tuple:
    """(m, Z, l_t) fp32 [b, n]: the running max, Σexp(T - m) and the target's logit over every vocab block."""
    p, rank, cols = lax.axis_size(axis_name), lax.axis_index(axis_name), w.shape[1]
    size = x.shape[1] // tiles

    def step(stats: tuple, held: jax.Array, j: jax.Array) -> tuple:
        local, mine = _in_block(targets, (rank - j) % p, cols)

        def tile(t: jax.Array, stats: tuple) -> tuple:
            m, z, lt = stats
            logits = _logits(_tile(x, t, size), held)  # T, one tile of rows
            m_t, z_t, lt_t = (_tile(a, t, size) for a in (m, z, lt))
            new_m = jnp.maximum(m_t, jnp.max(logits, axis=-1))
            z_new = z_t * jnp.exp(m_t - new_m) + jnp.sum(jnp.exp(logits - new_m[..., None]), axis=-1)
            picked = jnp.take_along_axis(logits, _tile(local, t, size)[..., None], axis=-1)[..., 0]
            lt_new = lt_t + jnp.where(_tile(mine, t, size), picked, 0.0)
            put = lambda a, v: lax.dynamic_update_slice_in_dim(a, v, t * size, axis=1)
            return put(m, new_m), put(z, z_new), put(lt, lt_new)

        return lax.fori_loop(0, tiles, tile, stats)

    like = lambda a: vary_like(vary_like(vary_like(a, x), w), targets)
    shape = targets.shape
    stats = tuple(like(jnp.full(shape, v, jnp.float32)) for v in (-jnp.inf, 0.0, 0.0))
    return ring_steps(step, stats, w, p, lambda b: send_to_next(b, axis_name, shift=FORWARD))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ring_cross_entropy(x: jax.Array, w: jax.Array, targets: jax.Array, axis_name: str, tiles: int) -> jax.Array:
    m, z, lt = _forward_stats(x, w, targets, axis_name, tiles)
    return jnp.log(z) + m - lt


def _ring_cross_entropy_fwd(x: jax.Array, w: jax.Array, targets: jax.Array, axis_name: str, tiles: int) -> tuple:
    m, z, lt = _forward_stats(x, w, targets, axis_name, tiles)
    lse = jnp.log(z) + m
    return lse - lt, (x, w, targets, lse)


def _ring_cross_entropy_bwd(axis_name: str, tiles: int, residuals: tuple, dloss: jax.Array) -> tuple:
    x, w, targets, lse = residuals
    p, rank, cols = lax.axis_size(axis_name), lax.axis_index(axis_name), w.shape[1]
    size = x.shape[1] // tiles
    # the other way round from the forward (rank r holds block (r + j) mod p at step j): a hop identical to
    # the forward's would let XLA reuse it, holding the received blocks from the forward to the backward
    send = lambda tree: send_to_next(tree, axis_name, shift=BACKWARD)

    def step(carry: tuple, held: jax.Array, j: jax.Array) -> tuple:
        dx, dw = carry  # dw: the held block's gradient so far (it travels with the block)
        local, mine = _in_block(targets, (rank + j) % p, cols)

        def tile(t: jax.Array, carry: tuple) -> tuple:
            dx, dw = carry
            x_t = _tile(x, t, size)
            logits = _logits(x_t, held)
            probs = jnp.exp(logits - _tile(lse, t, size)[..., None])
            onehot = jax.nn.one_hot(_tile(local, t, size), cols, dtype=jnp.float32) * _tile(mine, t, size)[..., None]
            # ΔT [b, size, V/p], formed in the compute dtype in one pass (the operand of both products, as
            # the untiled head's backward casts it): beside the fp32 logits no other block-wide array
            dt = ((probs - onehot) * _tile(dloss, t, size)[..., None]).astype(x.dtype)
            dx_t = _tile(dx, t, size) + jnp.einsum("brc,hc->brh", dt, held, preferred_element_type=jnp.float32)
            dw = dw + jnp.einsum("brh,brc->hc", x_t, dt, preferred_element_type=jnp.float32)
            return lax.dynamic_update_slice_in_dim(dx, dx_t, t * size, axis=1), dw

        dx, dw = lax.fori_loop(0, tiles, tile, (dx, dw))
        return dx, dw

    def step_and_pass(carry: tuple, held: jax.Array, j: jax.Array) -> tuple:
        dx, dw = step(carry, held, j)
        return dx, send(dw)  # the gradient moves on with its block: p hops, home at the end

    dx = vary_like(vary_like(jnp.zeros(x.shape, jnp.float32), x), w)
    dw = vary_like(vary_like(jnp.zeros(w.shape, jnp.float32), w), x)
    dx, dw = ring_steps(step_and_pass, (dx, dw), w, p, send)
    return dx.astype(x.dtype), sum_like(dw, w).astype(w.dtype), None


_ring_cross_entropy.defvjp(_ring_cross_entropy_fwd, _ring_cross_entropy_bwd)
