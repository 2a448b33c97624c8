"""Flax NNX building blocks that run the strategy a `ParallelPlan` names.

Use them in your own model to get jaxring's parallelism:

    attn = jaxring.nn.Attention(hidden=512, num_heads=8, num_kv_heads=2, rngs=rngs)
    y = attn(x, positions, plan)            # x [batch, seq, hidden] global; the plan picks ring/ulysses/megatron/...

Parameters carry logical axis names in a `logical_axes` metadata field (`embed`, `heads`, `kv_heads`, `mlp`,
`vocab`); `param_shardings(state, plan)` turns them into shardings. Weights are kept in `param_dtype` (fp32
master weights) and cast to the compute `dtype` at use.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.traverse_util import unflatten_dict
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring.attention.api import sharded_attention
from jaxring.attention.flash import flash_attention
from jaxring.plan import ParallelPlan
from jaxring.rope import apply_rope

ACTIVATIONS = ("gelu", "swiglu")
REMAT = ("none", "selective", "full")


def _param(rngs, shape, logical_axes, std, dtype=jnp.float32):
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * std, logical_axes=logical_axes)


def _constrain(x, plan: ParallelPlan):
    return jax.lax.with_sharding_constraint(x, plan.activation_sharding())


class Attention(nnx.Module):
    """Multi-head self-attention with GQA and RoPE; the sequence/tensor strategy comes from the plan.

    Params: wq [hidden, heads*head_dim], wk/wv [hidden, kv_heads*head_dim], wo [heads*head_dim, hidden].
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int | None = None, *, head_dim: int | None = None,
                 causal: bool = True, rope_theta: float | None = 10000.0, out_std: float | None = None,
                 rngs: nnx.Rngs):
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
        if head_dim is None and hidden % num_heads:
            raise ValueError(f"hidden {hidden} is not divisible by num_heads {num_heads}")
        head_dim = head_dim or hidden // num_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal, self.rope_theta = causal, rope_theta
        std = hidden ** -0.5
        self.wq = _param(rngs, (hidden, num_heads * head_dim), ("embed", "heads"), std)
        self.wk = _param(rngs, (hidden, num_kv_heads * head_dim), ("embed", "kv_heads"), std)
        self.wv = _param(rngs, (hidden, num_kv_heads * head_dim), ("embed", "kv_heads"), std)
        self.wo = _param(rngs, (num_heads * head_dim, hidden), ("heads", "embed"), out_std or std)

    def weights(self, dtype):
        return {name: getattr(self, name)[...].astype(dtype) for name in ("wq", "wk", "wv", "wo")}

    def __call__(self, x, positions, plan: ParallelPlan):
        """x: [batch, seq, hidden] (seq in the plan's layout); positions: int32 [batch, seq]."""
        w = self.weights(x.dtype)
        if plan.tensor_module is not None:
            return plan.tensor_module.attention_block(
                x, w, positions, mesh=plan.mesh, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                causal=self.causal, rope_theta=self.rope_theta)
        b, s, _ = x.shape
        q = (x @ w["wq"]).reshape(b, s, self.num_heads, self.head_dim)
        k = (x @ w["wk"]).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = (x @ w["wv"]).reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.rope_theta is not None:
            q, k = apply_rope(q, positions, self.rope_theta), apply_rope(k, positions, self.rope_theta)
        if plan.sp > 1:
            out = sharded_attention(q, k, v, mesh=plan.mesh, strategy=plan.attention, causal=self.causal,
                                    layout=plan.seq_layout(self.causal), laid_out=True, **plan.attention_options())
        else:
            out = _local_attention(plan, self.causal)(q, k, v, positions)
        return _constrain(out.reshape(b, s, -1) @ w["wo"], plan)


@functools.lru_cache(maxsize=64)
def _local_attention(plan: ParallelPlan, causal: bool):
    """Flash attention per device, batch split over the data axes (no sequence parallelism)."""
    spec = P(plan.batch_axes, None, None, None)

    def local(q, k, v, positions):
        return flash_attention(q, k, v, causal=causal, q_positions=positions, kv_positions=positions)

    return jax.shard_map(local, mesh=plan.mesh, in_specs=(spec, spec, spec, P(plan.batch_axes, None)),
                         out_specs=spec)


class MLP(nnx.Module):
    """GELU (w_in, w_out) or SwiGLU (w_gate, w_in, w_out) feed-forward; tensor strategy from the plan."""

    def __init__(self, hidden: int, ffn: int, activation: str = "gelu", *, out_std: float | None = None,
                 rngs: nnx.Rngs):
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.w_in = _param(rngs, (hidden, ffn), ("embed", "mlp"), hidden ** -0.5)
        if activation == "swiglu":
            self.w_gate = _param(rngs, (hidden, ffn), ("embed", "mlp"), hidden ** -0.5)
        self.w_out = _param(rngs, (ffn, hidden), ("mlp", "embed"), out_std or ffn ** -0.5)

    def weights(self, dtype):
        names = ("w_in", "w_out") + (("w_gate",) if self.activation == "swiglu" else ())
        return {name: getattr(self, name)[...].astype(dtype) for name in names}

    def __call__(self, x, plan: ParallelPlan):
        w = self.weights(x.dtype)
        if plan.tensor_module is not None:
            return plan.tensor_module.mlp_block(x, w, mesh=plan.mesh, activation=self.activation)
        if self.activation == "swiglu":
            h = jax.nn.silu(x @ w["w_gate"]) * (x @ w["w_in"])
        else:
            h = jax.nn.gelu(x @ w["w_in"], approximate=True)
        return _constrain(h @ w["w_out"], plan)


class Embed(nnx.Module):
    """Token embedding table [vocab, hidden]; vocab-parallel under Megatron, 2D under Optimus."""

    def __init__(self, vocab: int, hidden: int, *, rngs: nnx.Rngs, std: float = 0.02):
        self.table = _param(rngs, (vocab, hidden), ("vocab", "embed"), std)

    def __call__(self, tokens, plan: ParallelPlan, dtype=jnp.float32):
        table = self.table[...].astype(dtype)
        module = plan.tensor_module
        if module is not None and hasattr(module, "embed"):
            return module.embed(tokens, table, mesh=plan.mesh)
        return _constrain(jnp.take(table, tokens, axis=0), plan)


def token_cross_entropy(x, w_head, targets, plan: ParallelPlan):
    """Per-token cross-entropy fp32 [batch, seq] of logits x @ w_head ([hidden, vocab]).

    Under Megatron and Optimus the logits stay split over vocab (their `cross_entropy`); else computed here.
    """
    module = plan.tensor_module
    if module is not None and hasattr(module, "cross_entropy"):
        return module.cross_entropy(x, w_head, targets, mesh=plan.mesh)
    logits = (x @ w_head).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def block_runner(plan: ParallelPlan, remat: str = "none"):
    """run(block, *arrays) = block(*arrays, plan): the plan bound (it is not an array), the block recomputed
    in the backward pass when remat is "full", or with its weight matmuls kept ("selective")."""
    if remat not in REMAT:
        raise ValueError(f"unknown remat {remat!r}; expected one of {', '.join(REMAT)}")

    def run(block, *arrays):
        return block(*arrays, plan)

    if remat == "full":
        return nnx.remat(run)
    if remat == "selective":
        return nnx.remat(run, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return run


# ---------------------------------------------------------------------------------------- shardings

_BLOCK_PARAMS = {"wq", "wk", "wv", "wo", "w_in", "w_out", "w_gate"}
_VOCAB_PARAMS = {"table": "table", "head": "w_head"}  # jaxring.nn name -> tensor module name


def param_shardings(state, plan: ParallelPlan) -> dict:
    """NamedSharding for every parameter of an nnx.State, as a nested dict like `state.to_pure_dict()`.

    Attention and MLP weights under tensor parallelism follow their method's `param_specs`; everything
    else follows its logical axes through `plan.param_sharding`.
    """
    module = plan.tensor_module
    # the method's own names: blocks always; the embedding table and LM head where it splits them itself
    names = {n: n for n in _BLOCK_PARAMS}
    if module is not None and hasattr(module, "embed"):
        names.update(_VOCAB_PARAMS)
    flat, groups = {}, {}
    for path, var in nnx.to_flat_state(state):
        vocab_param = path[-1] in _VOCAB_PARAMS and "vocab" in (var.get_metadata().get("logical_axes") or ())
        if module is not None and path[-1] in names and (path[-1] in _BLOCK_PARAMS or vocab_param):
            groups.setdefault(path[:-1], {})[names[path[-1]]] = var.shape
        else:
            flat[path] = plan.param_sharding(var.get_metadata().get("logical_axes"), var.shape)
    ours = {v: k for k, v in names.items()}
    for parent, shapes in groups.items():
        for name, sharding in module.param_specs(plan.mesh, shapes).items():
            flat[parent + (ours[name],)] = (sharding if isinstance(sharding, NamedSharding)
                                            else NamedSharding(plan.mesh, sharding))
    return unflatten_dict(flat)
