"""A pre-norm transformer block whose per-token parts run a tile of tokens at a time (ALST's tiling, carried
from the MLP to the whole layer but attention's core).

    q, k, v = over_tiles(x -> rope(norm1(x) @ Wqkv))                      # residual: x
    out     = attention(q, k, v)                                           # the plan's sequence strategy
    y       = over_tiles((x, out) -> h + mlp(norm2(h)), h = x + out @ Wo)  # residuals: x, out

With UPipe's head chunks (G > 1 under Ulysses: `ParallelPlan.projected_chunks`) the first line runs inside the strategy, a chunk of
heads at a time (`ParallelPlan.attend_projected`): q, k, v and their gradients are never whole.

Only x, q, k, v and out exist for the whole sequence (plus their gradients in the backward): the normed
inputs, the projections' outputs, the attention residual h and the MLP's activations live one tile at a time
and are recomputed per tile in the backward (`jaxring.core.tiling.over_tiles`). Results and gradients: the
untiled block's. Runs where the tensor method's projections are per-token (`TensorMethod.tiles_projections`)
and the FFN is dense; `--mlp-tile` sets the tile.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax import lax

from jaxring.core.tiling import over_tiles
from jaxring.nn.modules import MLP, Attention
from jaxring.parallel.plan import ParallelPlan

__all__ = ["head_chunk_weights", "runs_tiled", "tiled_block"]


def runs_tiled(plan: ParallelPlan, x: jax.Array, dense_ffn: bool) -> bool:
    """Whether `tiled_block` runs this layer: tiles set, a dense FFN, per-token projections."""
    return dense_ffn and plan.tensor.tiles_projections and plan.mlp_tiles(x) > 1


def tiled_block(
    x: jax.Array,
    positions: jax.Array,
    plan: ParallelPlan,
    norm1: nnx.Module,
    attn: Attention,
    norm2: nnx.Module,
    mlp: MLP,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """x + attn(norm1(x)), then + mlp(norm2(.)), in `plan.mlp_tiles(x)` tiles of tokens. x [b, n, hidden]
    (local), positions int [b, n] (RoPE), segment_ids int [b, n] or None. Returns y like x."""
    tiles, layer, method = plan.mlp_tiles(x), attn.layer(), plan.tensor
    w = attn.weights(x.dtype)
    if plan.attends_projected:  # UPipe: q, k, v made a chunk of heads at a time, inside the strategy
        heads, kv_heads = (w[n].shape[1] // layer.head_dim for n in ("wq", "wk"))

        def project(x: jax.Array, pos: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            w_g = head_chunk_weights(w, g, plan.projected_chunks, layer.head_dim)
            return over_tiles(
                lambda x, pos: method.attention_qkv(plan, norm1(x, plan), w_g, pos, layer), tiles, (x, pos)
            )

        out = plan.attend_projected(
            project,
            x,
            positions,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=layer.head_dim,
            causal=layer.causal,
            window=layer.window,
            segment_ids=segment_ids,
        )
    else:
        q, k, v = over_tiles(
            lambda x, pos: method.attention_qkv(plan, norm1(x, plan), w, pos, layer), tiles, (x, positions)
        )
        out = plan.attend(q, k, v, causal=layer.causal, window=layer.window, segment_ids=segment_ids)

    def rest(x: jax.Array, out: jax.Array) -> jax.Array:  # one tile: the rows are a tile, so mlp runs untiled
        h = x + method.attention_out(plan, out, w)
        return h + mlp(norm2(h, plan), plan)

    return over_tiles(rest, tiles, (x, out))


def head_chunk_weights(w: dict, g: jax.Array, chunks: int, head_dim: int) -> dict:
    """The q/k/v projection weights of head chunk g of `chunks` (query heads [g·H/G, (g+1)·H/G), K/V heads
    likewise, so each chunk keeps whole GQA groups): wq [h, H·d] -> [h, H/G·d], wk/wv, bq/bk/bv sliced the same
    way; the QK-norm scales [d] as they are."""
    sliced = {}
    for name, axis in (("wq", 1), ("wk", 1), ("wv", 1), ("bq", 0), ("bk", 0), ("bv", 0)):
        if name in w:
            size = w[name].shape[axis] // chunks
            sliced[name] = lax.dynamic_slice_in_dim(w[name], g * size, size, axis=axis)
    return {n: sliced.get(n, a) for n, a in w.items() if n not in ("wo", "bo")}
