"""The GPT's entry points for `python -m jaxring.eval`: loading a Hugging Face directory, and every token's loss
and argmax hit from one sharded forward pass (declared on `jaxring.models.gpt_train.FAMILY`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxring.models import hf
from jaxring.models.gpt import GPT, GPTConfig
from jaxring.nn import Layers, weight_specs
from jaxring.parallel.plan import ParallelPlan

HEAD_ROWS = 2048  # the LM head runs on this many positions at a time (the logits never exist whole)


def load_pretrained(path: str, plan: ParallelPlan, overrides: dict | None = None) -> tuple[GPT, GPTConfig]:
    """The model of a Hugging Face directory on `plan` (`jaxring.models.hf.load_pretrained`, whose errors are
    ValueErrors of one line)."""
    return hf.load_pretrained(path, plan, overrides=overrides or None)


def token_scores(
    model: GPT,
    tokens: np.ndarray,
    targets: np.ndarray,
    plan: ParallelPlan,
    *,
    segment_ids: np.ndarray | None = None,
    positions: np.ndarray | None = None,
) -> tuple:
    """(losses fp32 [b, s], hits bool [b, s]) in token order for int tokens/targets [b, s] (natural order).

    One forward pass of the blocks as the plan's SPMD program (tokens laid out by the plan, its sequence
    strategy and tensor method inside); the final hidden states leave the shard_map in the activation layout
    and the LM head runs on HEAD_ROWS positions at a time: losses = logsumexp(logits) - logits[target], hits =
    argmax(logits) == target (the first maximum, as jnp.argmax and greedy decoding take it).

    segment_ids, positions: int [b, s] of packed documents (`jaxring.data.packing`'s convention, as training
    on documents feeds them): attention stays inside each document and RoPE counts from each document's
    start. None: every row is one sequence at positions 0..s-1."""
    if plan.pp > 1:
        raise ValueError(f"evaluation runs without a pipeline (pp = {plan.pp}); use a plan with pp = 1")
    tokens, targets = np.asarray(tokens, np.int32), np.asarray(targets, np.int32)
    b, s = tokens.shape
    documents = segment_ids is not None
    arrays = [tokens, targets]
    if documents:
        if positions is None:
            raise ValueError("token_scores: segment_ids need the documents' positions too")
        arrays += [np.asarray(segment_ids, np.int32), np.asarray(positions, np.int32)]
    laid, row_positions = plan.layout_tokens(*arrays, causal=True)
    pos = laid[3] if documents else np.broadcast_to(row_positions, (b, s))
    graphdef, state = nnx.split(model)
    inputs = [laid[0], np.ascontiguousarray(pos, np.int32)] + ([laid[2]] if documents else [])
    features = _forward(graphdef, state, plan, documents)(nnx.to_pure_dict(state), *inputs)
    w, tied = model.head_weight(jnp.float32)
    laid_targets = laid[1]
    losses, hits = [], []
    for i in range(0, s, HEAD_ROWS):
        loss, hit = _head(features[:, i : i + HEAD_ROWS], w, jnp.asarray(laid_targets[:, i : i + HEAD_ROWS]), tied=tied)
        losses.append(np.asarray(loss))
        hits.append(np.asarray(hit))
    losses, hits = np.concatenate(losses, axis=1), np.concatenate(hits, axis=1)
    perm = plan.token_permutation(s, causal=True)
    if perm is not None:
        order = np.argsort(perm)
        losses, hits = losses[:, order], hits[:, order]
    return losses, hits


_FORWARDS: dict = {}  # (graphdef, plan) -> the jitted sharded forward (one compile per shape)


def _forward(graphdef, state, plan: ParallelPlan, documents: bool = False):
    """jit(params, tokens, positions[, segment_ids]) -> final hidden states [b, s, hidden] in the plan's
    activation layout."""
    key = (graphdef, id(plan), documents)
    if key not in _FORWARDS:

        def local(params, tokens, positions, segment_ids=None):
            m = nnx.merge(graphdef, params)
            return m.features(tokens, positions, plan, Layers.of(m.blocks), segment_ids=segment_ids)

        token_spec = plan.token_spec()
        specs = weight_specs(state, plan)
        in_specs = (specs, token_spec, token_spec) + ((token_spec,) if documents else ())
        body = plan.shard_map(local, in_specs=in_specs, out_specs=plan.activation_spec())
        _FORWARDS[key] = (plan, jax.jit(body))  # the plan is kept alive, so its id stays its own
    return _FORWARDS[key][1]


@functools.partial(jax.jit, static_argnames="tied")
def _head(x, w, t, *, tied: bool):
    """(loss, hit) fp32/bool [b, c] of hidden states x [b, c, hidden] and targets t [b, c]."""
    logits = (x @ (w.T if tied else w)).astype(jnp.float32)
    picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked, jnp.argmax(logits, axis=-1) == t
