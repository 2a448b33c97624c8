"""Every token's loss and argmax hit from one sharded forward pass of a loaded model on a plan (the family's
`token_scores` entry point), with the batch padded to a size the plan's data axes split."""

from __future__ import annotations

import numpy as np

from jaxring.eval.loading import LoadedModel
from jaxring.parallel.plan import ParallelPlan


def padded_batch(plan: ParallelPlan, rows: int) -> int:
    """The least batch >= rows that the plan's data-parallel degree divides."""
    degree = plan.data_degree
    return -(-rows // degree) * degree


def check_context(loaded: LoadedModel, plan: ParallelPlan, rows: int, seq_len: int) -> None:
    """One-line ValueError when `rows` sequences of `seq_len` tokens cannot run on the plan (the sequence
    split, the heads, learned positions shorter than seq_len, ...): asked before any work is done."""
    if loaded.family.token_scores is None:
        raise ValueError(f"model family {loaded.family.name!r} declares no token_scores: it cannot be evaluated here")
    loaded.family.check_plan(loaded.config, plan, padded_batch(plan, rows), seq_len)


def token_scores(
    loaded: LoadedModel,
    plan: ParallelPlan,
    tokens: np.ndarray,
    targets: np.ndarray,
    *,
    segment_ids: np.ndarray | None = None,
    positions: np.ndarray | None = None,
) -> tuple:
    """(losses fp32 [b, s], hits bool [b, s]) of int tokens/targets [b, s] in natural order; with packed
    documents, their segment_ids and positions int [b, s] (attention inside each document)."""
    if loaded.family.token_scores is None:
        raise ValueError(f"model family {loaded.family.name!r} declares no token_scores for evaluation")
    b = tokens.shape[0]
    pad = padded_batch(plan, b) - b
    rows = [tokens, targets] + ([] if segment_ids is None else [segment_ids, positions])
    if pad:  # padding rows: one document of zeros
        rows = [np.concatenate([a, np.zeros((pad, a.shape[1]), a.dtype) + (i == 2)]) for i, a in enumerate(rows)]
    documents = {} if segment_ids is None else {"segment_ids": rows[2], "positions": rows[3]}
    losses, hits = loaded.family.token_scores(loaded.model, rows[0], rows[1], plan, **documents)
    return np.asarray(losses)[:b], np.asarray(hits)[:b]
