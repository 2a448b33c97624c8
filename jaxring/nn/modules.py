"""Flax NNX building blocks that run the strategies a `ParallelPlan` names, inside one shard_map.

Blocks are *local*: they are called inside the train step's `shard_map` over the plan's mesh (see
`jaxring.train.step` or `plan.shard_map`), on this device's shards, and never jit or place anything
themselves. The plan's tensor method (none, megatron, optimus, metp) gives each layer's math and layout; its
sequence strategy (ring, ulysses, wallfacer, ...) is the attention core.

    attn = Attention(hidden=512, num_heads=8, num_kv_heads=2, rngs=rngs)
    y = attn(x, positions, plan)        # x: local [batch, seq, hidden] in plan.activation_spec()

Parameters carry logical axis names in a `logical_axes` metadata field ("embed", "heads", "kv_heads", "mlp",
"vocab"); `param_placements(state, plan)` turns them into each weight's split (tensor method, pipeline,
ZeRO) and `param_shardings` into NamedShardings. Weights are kept in their dtype (fp32 master weights) and
cast to the compute dtype at use. Layer stacks are stacked ([num_layers, ...] parameters, `stack`) and run
under `lax.scan` by `Layers`, so compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.traverse_util import unflatten_dict
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding

from jaxring.core.tiling import over_tiles
from jaxring.kernels.layer_math import check_activation
from jaxring.kernels.rope import Rope, as_rope
from jaxring.nn import inference
from jaxring.nn import moe as moe_lib
from jaxring.nn.memory_policy import NO_MEMORY_POLICY, REMAT, MemoryPolicy
from jaxring.nn.offload import NO_OFFLOAD, Offload
from jaxring.parallel import zero
from jaxring.parallel.plan import ParallelPlan
from jaxring.parallel.tensor.contract import KEPT_RESIDUAL, MATMUL_OUTPUT, AttentionLayer, ParamInfo

# The name of a layer's input in the layer stack (`Layers`): host offload keeps it in host memory. With
# recompute blocks (--remat-layers k) this names a block's input, and the layers inside the block name theirs
# INNER_LAYER_INPUT: offloaded only while the block's backward recomputes it (a distinct name, so the block's
# own forward keeps none of them).
LAYER_INPUT = "jaxring_layer_input"
INNER_LAYER_INPUT = "jaxring_inner_layer_input"
STACKED = "stacked"  # metadata flag of parameters with a leading layer dim


def param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    logical_axes: Sequence[str | None],
    std: float,
    *,
    heads: int | None = None,
    dtype: jnp.dtype = jnp.float32,
) -> nnx.Param:
    """A normal(0, std) nnx.Param with its logical axes (and head count along a heads axis)."""
    return nnx.Param(
        jax.random.normal(rngs.params(), shape, dtype) * std, logical_axes=tuple(logical_axes), heads=heads
    )


def constant(
    shape: tuple[int, ...],
    logical_axes: Sequence[str | None],
    value: float,
    *,
    heads: int | None = None,
    dtype: jnp.dtype = jnp.float32,
) -> nnx.Param:
    """An nnx.Param filled with `value` (norm scales 1), with its logical axes."""
    return nnx.Param(jnp.full(shape, value, dtype), logical_axes=tuple(logical_axes), heads=heads)


BIAS = "is_bias"  # a parameter's metadata: an additive bias (its backward reads no weight; see bias_param())


def bias_param(shape: tuple[int, ...], logical_axes: Sequence[str | None], *, heads: int | None = None) -> nnx.Param:
    """An additive bias: an fp32 nnx.Param of zeros with its logical axes, marked `BIAS` in its metadata (its
    gradient is the output's, so ZeRO-3's backward gathers no copy of it: `jaxring.planner.params`)."""
    return nnx.Param(jnp.zeros(shape, jnp.float32), logical_axes=tuple(logical_axes), heads=heads, **{BIAS: True})


class Attention(nnx.Module):
    """Multi-head self-attention with GQA and RoPE; the tensor method and the attention core come from the plan.

    Params: wq [hidden, heads·head_dim], wk/wv [hidden, kv_heads·head_dim], wo [heads·head_dim, hidden];
    with `qkv_bias` bq [heads·head_dim], bk/bv [kv_heads·head_dim]; with `proj_bias` bo [hidden]; with
    `qk_norm` q_norm/k_norm [head_dim] (an RMSNorm per head before RoPE, Qwen3). head_dim defaults to
    hidden / heads. rope: a `jaxring.kernels.rope.Rope`, a theta (plain RoPE) or None; window: a sliding window.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        causal: bool = True,
        rope: Rope | float | None = 10000.0,
        window: int | None = None,
        qkv_bias: bool = False,
        proj_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        out_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
        if head_dim is None and hidden % num_heads:
            raise ValueError(f"hidden {hidden} is not divisible by num_heads {num_heads}")
        head_dim = head_dim or hidden // num_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal, self.rope, self.window, self.norm_eps = causal, as_rope(rope), window, norm_eps
        std = hidden**-0.5
        self.wq = param(rngs, (hidden, num_heads * head_dim), ("embed", "heads"), std, heads=num_heads)
        self.wk = param(rngs, (hidden, num_kv_heads * head_dim), ("embed", "kv_heads"), std, heads=num_kv_heads)
        self.wv = param(rngs, (hidden, num_kv_heads * head_dim), ("embed", "kv_heads"), std, heads=num_kv_heads)
        self.wo = param(rngs, (num_heads * head_dim, hidden), ("heads", "embed"), out_std or std, heads=num_heads)
        if qkv_bias:
            self.bq = bias_param((num_heads * head_dim,), ("heads",), heads=num_heads)
            self.bk = bias_param((num_kv_heads * head_dim,), ("kv_heads",), heads=num_kv_heads)
            self.bv = bias_param((num_kv_heads * head_dim,), ("kv_heads",), heads=num_kv_heads)
        if proj_bias:
            self.bo = bias_param((hidden,), ("embed",))
        if qk_norm:
            self.q_norm = constant((head_dim,), (None,), 1.0)
            self.k_norm = constant((head_dim,), (None,), 1.0)

    WEIGHTS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm")

    def weights(self, dtype: jnp.dtype) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...].astype(dtype) for name in self.WEIGHTS if hasattr(self, name)}

    def __call__(
        self, x: jax.Array, positions: jax.Array, plan: ParallelPlan, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """x: local [batch, seq, hidden] (the plan's activation layout); positions: local int32 [batch, seq]
        (the plan's token layout), the RoPE positions: each packed document's restart at 0; segment_ids: local
        int32 [batch, seq] like positions, each token's document (0: padding), or None (one document per row).
        The causal mask follows the tokens' order in the row (the plan's layout). Returns y like x."""
        return plan.tensor.attention(
            plan,
            x,
            self.weights(x.dtype),
            positions,
            self.layer(),
            segment_ids,
        )

    def layer(self) -> AttentionLayer:
        return AttentionLayer(
            self.num_heads, self.num_kv_heads, self.head_dim, self.causal, self.rope, self.window, self.norm_eps
        )

    def kv(self, x: jax.Array, positions: jax.Array, plan: ParallelPlan) -> tuple[jax.Array, jax.Array]:
        """The KV-cache entries of x (normed input, local, activation layout) at token-layout positions int
        [b, n]: (k, v) [b, n, local kv heads, head_dim] as attention sees them (QK-norm, RoPE; see
        `jaxring.nn.inference.prefill_kv`)."""
        return inference.prefill_kv(
            plan,
            x,
            self.weights(x.dtype),
            positions,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope=self.rope,
            norm_eps=self.norm_eps,
        )

    def decode(
        self, x: jax.Array, positions: jax.Array, cache: tuple, cache_positions: jax.Array, plan: ParallelPlan
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """One decoding step (`jaxring.nn.inference.decode_attention`): x [b, 1, hidden] new tokens at positions
        int [b] attend the cache (k, v) local [b, n, local kv heads, head_dim] at cache_positions int [n] and
        themselves. Returns (y [b, 1, hidden], their (k, v) [b, local kv heads, head_dim] to write)."""
        if not self.causal:
            raise ValueError("decoding with a KV cache needs causal attention")
        return inference.decode_attention(
            plan,
            x,
            self.weights(x.dtype),
            positions,
            cache,
            cache_positions,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope=self.rope,
            window=self.window,
            norm_eps=self.norm_eps,
        )


class MLP(nnx.Module):
    """GELU (w_in, w_out) or SwiGLU (w_gate, w_in, w_out) feed-forward, with `bias`: b_in, b_gate [ffn] and
    b_out [hidden]; the tensor method from the plan."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        activation: str = "gelu",
        *,
        bias: bool = False,
        out_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        check_activation(activation)
        self.activation = activation
        self.w_in = param(rngs, (hidden, ffn), ("embed", "mlp"), hidden**-0.5)
        if activation == "swiglu":
            self.w_gate = param(rngs, (hidden, ffn), ("embed", "mlp"), hidden**-0.5)
        self.w_out = param(rngs, (ffn, hidden), ("mlp", "embed"), out_std or ffn**-0.5)
        if bias:
            self.b_in = bias_param((ffn,), ("mlp",))
            if activation == "swiglu":
                self.b_gate = bias_param((ffn,), ("mlp",))
            self.b_out = bias_param((hidden,), ("embed",))

    WEIGHTS = ("w_in", "w_gate", "w_out", "b_in", "b_gate", "b_out")

    def weights(self, dtype: jnp.dtype) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...].astype(dtype) for name in self.WEIGHTS if hasattr(self, name)}

    def __call__(self, x: jax.Array, plan: ParallelPlan) -> jax.Array:
        """x [b, s_act, hidden] -> like x; over `plan.mlp_tiles(x)` tiles of its rows (one when untiled)."""
        w = self.weights(x.dtype)
        return over_tiles(lambda x: plan.tensor.mlp(plan, x, w, activation=self.activation), plan.mlp_tiles(x), (x,))

    def decode(self, x: jax.Array, plan: ParallelPlan) -> jax.Array:
        """x [b, 1, hidden] (new tokens, replicated over sp and tp) -> like x (`jaxring.nn.inference.decode_mlp`)."""
        return inference.decode_mlp(plan, x, self.weights(x.dtype), activation=self.activation)


class Embed(nnx.Module):
    """Token embedding table [vocab, hidden]; vocab-parallel under Megatron, 2D under Optimus."""

    def __init__(self, vocab: int, hidden: int, *, rngs: nnx.Rngs, std: float = 0.02):
        self.table = param(rngs, (vocab, hidden), ("vocab", "embed"), std)

    def __call__(
        self,
        tokens: jax.Array,
        plan: ParallelPlan,
        dtype: jnp.dtype = jnp.float32,
        *,
        positions: jax.Array | None = None,
        pos_table: jax.Array | None = None,
    ) -> jax.Array:
        """tokens: local int [batch, seq] (token layout) -> x local [batch, seq, hidden] (activation layout),
        plus the learned position rows of `positions` when `pos_table` [max_seq, hidden] is given."""
        table = self.table[...].astype(dtype)
        pos_table = None if pos_table is None else pos_table.astype(dtype)
        return plan.tensor.embed(plan, tokens, table, positions, pos_table)


class LayerNorm(nnx.Module):
    """LayerNorm over hidden with scale and bias [hidden]; under Optimus the hidden dim is split (2D norm)."""

    def __init__(self, hidden: int, *, eps: float = 1e-5, rngs: nnx.Rngs | None = None):
        del rngs
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((hidden,), jnp.float32), logical_axes=("embed",))
        self.bias = bias_param((hidden,), ("embed",))

    def __call__(self, x: jax.Array, plan: ParallelPlan) -> jax.Array:
        """Computed in fp32, returned in x's dtype."""
        return plan.tensor.norm(plan, x, self.scale[...], self.bias[...], eps=self.eps)


class RMSNorm(nnx.Module):
    """RMSNorm over hidden with scale [hidden] (Llama): x · rsqrt(mean(x²) + eps) · scale; under Optimus the
    hidden dim is split (the sum of squares is summed across the grid row)."""

    def __init__(self, hidden: int, *, eps: float = 1e-6, rngs: nnx.Rngs | None = None):
        del rngs
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((hidden,), jnp.float32), logical_axes=("embed",))

    def __call__(self, x: jax.Array, plan: ParallelPlan) -> jax.Array:
        """Computed in fp32, returned in x's dtype."""
        return plan.tensor.rms_norm(plan, x, self.scale[...], eps=self.eps)


NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


class MoE(moe_lib.MoE):
    """Mixture-of-experts FFN (`jaxring.nn.moe`: top-k router, dropless or capacity dispatch, aux and z losses),
    run as the plan's tensor method says: experts over ep (tokens exchanged by all-to-all), their FFN over tp
    under Megatron. `y, stats = moe(x, plan)`: x local [batch, seq, hidden] (activation layout); stats fp32
    scalars over the whole batch ("loss": the weighted aux + z loss to add once per layer, "aux_loss", "z_loss",
    "drop_rate", "load_imbalance") and "load" int32 [E]."""

    def __call__(self, x: jax.Array, plan: ParallelPlan) -> tuple[jax.Array, dict[str, jax.Array]]:
        return plan.tensor.moe(plan, x, functools.partial(moe_lib.moe_ffn, params=self.params(), config=self.config))


def token_cross_entropy(x: jax.Array, w: jax.Array, targets: jax.Array, plan: ParallelPlan, *, tied: bool) -> jax.Array:
    """Per-token cross-entropy fp32 [batch, seq] (token layout) of logits x @ head; w is the head [hidden,
    vocab], or the embedding table [vocab, hidden] when `tied`. Under Megatron and Optimus the logits stay
    split over the vocabulary; with `plan.loss_tile` the logits exist one tile of rows at a time."""
    method, tiles = plan.tensor, plan.loss_tiles(x)
    if tiles == 1 or method.tiles_loss_itself(plan):
        return method.cross_entropy(plan, x, w, targets, tied=tied)
    losses = over_tiles(
        lambda x, t: method.cross_entropy(plan, x, w, t, tied=tied),
        tiles,
        (x, method.tile_targets(plan, targets, tiles)),
    )
    return method.untile_losses(plan, losses, tiles)


# ---------------------------------------------------------------------------------------- layer stacks


def stack(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs) -> nnx.Module:
    """`num_layers` layers made by make_layer(rngs), as one module whose parameters are stacked [L, ...]
    (flagged `stacked` in their metadata). Deterministic in the seed, whatever the mesh."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers {num_layers!r} must be a positive integer")

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return make_layer(rngs)

    layers = make(rngs)
    for _, var in nnx.to_flat_state(nnx.split(layers)[1]):
        var.set_metadata(STACKED, True)
    return layers


REMAT_LAYERS_RULE = {
    "remat": "--remat-layers {k} recomputes blocks of {k} layers from their inputs: it needs --remat full (got "
    "--remat {remat})",
    "layers": "--remat-layers {k} must divide the {layers} layers a stack scans (e.g. {divisor})",
}


def remat_policy(
    remat: str, zero_stage: int = 0, offload: Offload = NO_OFFLOAD, name: str = LAYER_INPUT
) -> Callable[..., bool]:
    """The jax.checkpoint policy of one layer for remat none/selective/full: none saves everything it computes,
    selective only the weight matmuls' outputs (dots without batch dims, and those computed inside a custom_vjp,
    named `MATMUL_OUTPUT`) and the residuals custom VJPs name `KEPT_RESIDUAL`, full nothing. In every mode the weights as the layer reads them
    are never saved for the backward (`zero.no_weights_saved`): ZeRO-3 gathers them again, the others slice
    them again from the stack.

    offload.layer_inputs (--offload layer_inputs, alone or with optimizer or weights; with remat full): each
    layer's input, named `LAYER_INPUT` by `Layers`, is the one value kept, and it is kept in host memory
    ("pinned_host") between the forward and the backward [ALST]; XLA moves it out after the layer's forward
    and back before its backward. name: the checkpoint name of the value offloaded (INNER_LAYER_INPUT for the layers inside a recompute block)."""
    if remat not in REMAT:
        raise ValueError(f"unknown remat {remat!r}; expected one of {', '.join(REMAT)}")
    if offload.layer_inputs:
        if remat != "full":
            raise ValueError(
                f"offload {str(offload)!r} needs remat 'full' (it keeps the layer inputs only), got {remat!r}"
            )
        host = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[name],
            offload_src="device",
            offload_dst="pinned_host",
        )
        return zero.no_weights_saved(zero_stage, host)
    selective = jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(MATMUL_OUTPUT, KEPT_RESIDUAL),
    )
    base = {"none": None, "selective": selective, "full": jax.checkpoint_policies.nothing_saveable}[remat]
    return zero.no_weights_saved(zero_stage, base)


# a layer stack ready to run on its weights: (carry, call) -> carry, call(layer, carry) -> carry for every layer
LayerScan = Callable[[Any, Callable[[nnx.Module, Any], Any]], Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layers:
    """A stacked layer stack inside the step, built once per step: `layers.scan(carry, call, diff, const, stage)`
    runs call(layer, carry) for every layer under `lax.scan`, materializing each layer's weights from their
    stored form (ZeRO) inside the scan body.

    graphdef: one layer's graph; placements: the stacked weights' Placements; memory: what each layer keeps,
    recomputes and offloads (`MemoryPolicy`). With memory.remat_layers k > 1 (remat full) the stack is scanned a
    block of k layers at a time (Megatron's uniform --recompute-num-layers): a block keeps (or offloads) only
    its input, and its backward recomputes its layers' forward keeping each layer's input (on the device, or
    with offload.layer_inputs in host memory until that layer's backward): one more forward per layer.
    """

    graphdef: object
    placements: object
    memory: MemoryPolicy = NO_MEMORY_POLICY

    def on(self, diff: Any, const: Any = None, stage: int = 0) -> LayerScan:
        """The stack on these weights: (carry, call) -> carry (what a model's `features` takes)."""
        return functools.partial(self.scan, diff=diff, const=const, stage=stage)

    def scan(
        self, carry: Any, call: Callable[[nnx.Module, Any], Any], diff: Any, const: Any = None, stage: int = 0
    ) -> Any:
        """call(layer, carry) -> carry for every layer in order, under `lax.scan`; carry: any pytree (e.g.
        {"x": [b, s, h] activations, plus MoE statistics or DiT's conditioning}) keeping its shapes. diff/const:
        the stacked stored leaves [num_layers, ...] (see `jaxring.parallel.zero.inputs`; const None: none);
        stage: the ZeRO stage they are stored for."""
        remat, offload = self.memory.remat, self.memory.offload
        layer_placements = jax.tree.map(_per_layer, self.placements, is_leaf=_is_placement)
        const = const if const is not None else jax.tree.map(lambda _: None, diff)
        num_layers = jax.tree.leaves(diff)[0].shape[0]
        at = lambda tree, i: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)
        stack = diff

        def body(carry: Any, i: jax.Array) -> tuple[Any, None]:
            # the stacks are read as constants, layer i sliced here: a layer's weights are never copied into
            # a stacked residual for the backward (the policy recomputes the slice)
            diff, const_i = at(stack, i), at(const, i)
            weights = jax.tree.map(
                lambda d, c, pl: zero.materialize(stage, d, c, pl),
                diff,
                const_i,
                layer_placements,
                is_leaf=lambda v: v is None,
            )
            return call(nnx.merge(self.graphdef, weights), carry), None

        if offload.weights:
            # the stored weights live in host memory: the scan walks them as its xs, and each layer's reach the
            # device just before the layer runs (again in its backward: never saved); its gradient, the
            # transfer's transpose, goes back to host memory as the backward produces it
            def body(carry: Any, stored: Any) -> tuple[Any, None]:
                weights = jax.tree.map(lambda d, pl: zero.fetch(stage, d, pl), stored, layer_placements)
                return call(nnx.merge(self.graphdef, weights), carry), None

            xs = stack
        else:
            xs = jnp.arange(num_layers)
        k = self.memory.remat_layers
        if k > 1:
            if remat != "full":
                raise ValueError(REMAT_LAYERS_RULE["remat"].format(k=k, remat=remat))
            if num_layers % k:
                divisor = max(d for d in range(1, k) if num_layers % d == 0)
                raise ValueError(REMAT_LAYERS_RULE["layers"].format(k=k, layers=num_layers, divisor=divisor))
            one = body
            if offload.layer_inputs:
                # the block's backward recomputes its layers' forward: their inputs go to host memory then,
                # and come back one at a time for each layer's backward (so the device holds one, not k)
                def one(carry: Any, x: Any, layer: Callable = body) -> tuple[Any, None]:
                    return layer(jax.tree.map(lambda a: checkpoint_name(a, INNER_LAYER_INPUT), carry), x)

            inner = remat_policy("full", stage, offload, name=INNER_LAYER_INPUT)
            one = jax.checkpoint(one, policy=inner, prevent_cse=False)

            def body(carry: Any, block: Any) -> tuple[Any, None]:  # k layers, each keeping its input alone
                if offload.weights:  # the block's weights moved in at once (their
                    block = jax.device_put(block, jax.memory.Space.Device)  # gradients out at once)
                return lax.scan(one, carry, block)[0], None

            xs = jax.tree.map(lambda a: a.reshape((num_layers // k, k) + a.shape[1:]), xs)
        if offload.layer_inputs:
            layer = body

            def body(carry: Any, x: Any) -> tuple[Any, None]:
                return layer(jax.tree.map(lambda a: checkpoint_name(a, LAYER_INPUT), carry), x)

        body = jax.checkpoint(body, policy=remat_policy(remat, stage, offload), prevent_cse=False)
        carry, _ = lax.scan(body, carry, xs)
        return carry

    @classmethod
    def of(cls, module: nnx.Module, remat: str = "none") -> LayerScan:
        """The layers of a stacked nnx module as they are (no ZeRO), ready to run: for use outside a train step,
        e.g. on one device or inside your own shard_map."""
        pure = nnx.to_pure_dict(nnx.split(module)[1])
        placements = jax.tree.map(lambda x: zero.Placement((None,) * x.ndim, None, ()), pure)
        layers = cls(graphdef=_layer_graphdef(module), placements=placements, memory=MemoryPolicy(remat=remat))
        return layers.on(pure)


def _layer_graphdef(module: nnx.Module):
    """The graphdef of one layer of a stacked module (the same graph: nnx graphs carry no shapes)."""
    return nnx.split(module)[0]


def _is_placement(x: Any):
    return isinstance(x, zero.Placement)


def _per_layer(pl: zero.Placement) -> zero.Placement:
    """A stacked weight's placement for one layer's slice (the leading layer dim dropped)."""
    return zero.Placement(pl.spec[1:], None if pl.zero_dim is None else pl.zero_dim - 1, pl.replica)


# ---------------------------------------------------------------------------------------- placements


def _info(path: tuple, var: nnx.Variable) -> tuple[ParamInfo, bool]:
    meta = var.get_metadata()
    shape = tuple(var.shape)
    stacked = bool(meta.get(STACKED))
    return ParamInfo(
        path[-1],
        tuple(meta.get("logical_axes") or (None,) * (len(shape) - stacked)),
        shape[1:] if stacked else shape,
        meta.get("heads"),
    ), stacked


def param_placements(state: nnx.State, plan: ParallelPlan) -> dict:
    """zero.Placement of every parameter of an nnx.State, as a nested dict like `nnx.to_pure_dict(state)`.

    The tensor method splits a weight by its logical axes; a stacked weight's layer dim stays whole (pp
    splits it in the pipeline); ZeRO picks a dim to shard over the plan's replica axes."""
    mesh_shape = dict(plan.run_mesh.shape)
    flat = {}
    for path, var in nnx.to_flat_state(state):
        info, stacked = _info(path, var)
        spec = tuple(plan.tensor.param_spec(plan, info))
        if len(spec) != len(info.shape):
            raise AssertionError(f"{plan.tensor.name} param_spec {spec} for {path} of shape {info.shape}")
        if plan.ep > 1:  # experts are split over ep whatever the tensor method (their FFN dims follow it)
            spec = tuple("ep" if axis == "expert" else entry for entry, axis in zip(spec, info.logical_axes))
        _check_split(path, info.shape, spec, mesh_shape)
        if stacked:  # the layer dim: split over pp (the pipeline's stages), else whole
            pl = zero.place(spec, info.shape, info.logical_axes, plan.replica_axes, mesh_shape)
            layer_axis = "pp" if plan.pp > 1 else None
            pl = zero.Placement((layer_axis,) + pl.spec, None if pl.zero_dim is None else pl.zero_dim + 1, pl.replica)
        else:
            pl = zero.place(spec, info.shape, info.logical_axes, plan.replica_axes, mesh_shape)
        flat[path] = pl
    return unflatten_dict(flat)


def _check_split(path: tuple, shape: tuple[int, ...], spec: tuple, mesh_shape: dict[str, int]):
    for dim, entry in zip(shape, spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        size = 1
        for a in axes:
            size *= mesh_shape[a]
        if dim % size:
            raise ValueError(
                f"parameter {'.'.join(map(str, path))} dim {dim} is not divisible by {' × '.join(axes)} = {size}"
            )


def weight_specs(state: nnx.State, plan: ParallelPlan) -> dict:
    """PartitionSpec of every parameter as the plan's tensor method (and pipeline) split it, without ZeRO:
    the in_specs of the weights for running blocks inside `plan.shard_map` (inference, tests, your own step).
    Nested like `nnx.to_pure_dict(state)`."""
    return jax.tree.map(lambda pl: pl.param_spec(0), param_placements(state, plan), is_leaf=_is_placement)


def param_shardings(state: nnx.State, plan: ParallelPlan) -> dict:
    """NamedSharding of every parameter as stored between steps (ZeRO-3 shards them), nested like
    `nnx.to_pure_dict(state)`."""
    stage = plan.zero_stage
    return jax.tree.map(
        lambda pl: NamedSharding(plan.run_mesh, pl.param_spec(stage)),
        param_placements(state, plan),
        is_leaf=_is_placement,
    )
