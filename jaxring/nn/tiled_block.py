"""A pre-norm transformer block whose per-token parts run a tile of tokens at a time (ALST's tiling, carried
from the MLP to the whole layer but attention's core).

    q, k, v = over_tiles(x -> rope(norm1(x) @ Wqkv))                      # residual: x
    out     = attention(q, k, v)                                           # the plan's sequence strategy
    y       = over_tiles((x, out) -> h + mlp(norm2(h)), h = x + out @ Wo)  # residuals: x, out

Only x, q, k, v and out exist for the whole sequence (plus their gradients in the backward): the normed
inputs, the projections' outputs, the attention residual h and the MLP's activations live one tile at a time
and are recomputed per tile in the backward (`jaxring.core.tiling.over_tiles`). Results and gradients: the
untiled block's. Runs where the tensor method's projections are per-token (`TensorMethod.tiles_projections`)
and the FFN is dense; `--mlp-tile` sets the tile.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxring.core.tiling import over_tiles
from jaxring.nn.modules import MLP, Attention
from jaxring.parallel.plan import ParallelPlan

__all__ = ["runs_tiled", "tiled_block"]


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
    q, k, v = over_tiles(
        lambda x, pos: method.attention_qkv(plan, norm1(x, plan), w, pos, layer), tiles, (x, positions)
    )
    out = plan.attend(q, k, v, causal=layer.causal, window=layer.window, segment_ids=segment_ids)

    def rest(x: jax.Array, out: jax.Array) -> jax.Array:  # one tile: the rows are a tile, so mlp runs untiled
        h = x + method.attention_out(plan, out, w)
        return h + mlp(norm2(h, plan), plan)

    return over_tiles(rest, tiles, (x, out))
