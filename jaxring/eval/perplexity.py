"""Loss by position: does a token far into the context get predicted better than one near its start?

Held-out rows of `seq_len` tokens (the val split of a document store, a text/.jsonl file prepared on first
use, or the bundled corpus; `jaxring.data`) run through the model in one sharded forward pass each; every
token's loss is put in the bucket of its position in the row (the number of tokens the model saw before it):
[0, first), [first, 2·first), [2·first, 4·first), ... up to seq_len, powers of two. Tokens the batch masks
out (padding) are left out. Rows of packed documents (a document store) are scored as training sees them:
attention inside each document, positions from each document's start, and a token's bucket is its position in
its document. A model that uses its context has a lower loss in the later buckets; one pushed
past the context it was trained for shows the loss rising there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np

from jaxring.data.loader import StepBatches
from jaxring.data.token_data import open_token_data
from jaxring.data.tokenizer import Tokenizer
from jaxring.eval.loading import LoadedModel
from jaxring.eval.scoring import check_context, token_scores
from jaxring.parallel.plan import ParallelPlan
from jaxring.run.spec import RunSpec


def bucket_edges(seq_len: int, first: int | None = None) -> list[int]:
    """[0, first, 2·first, 4·first, ..., seq_len]; first defaults to seq_len/8 rounded down to a power of two,
    at most 256 (so 2048 tokens give 0, 256, 512, 1024, 2048)."""
    if first is None:
        first = min(256, 2 ** max(0, int(math.log2(seq_len)) - 3))
    if first < 1 or first >= seq_len:
        raise ValueError(f"--first-bucket {first} must lie in [1, seq_len = {seq_len})")
    edges, end = [0], first
    while end < seq_len:
        edges.append(end)
        end *= 2
    return edges + [seq_len]


def held_out_rows(
    data: str | None, tokenizer: Tokenizer | None, seq_len: int, batch_size: int, batches: int, vocab_size: int
) -> Iterator[dict]:
    """Yields `batches` dicts {"tokens", "targets", "loss_mask"} of int [batch_size, seq_len] rows of the val
    split of `data` (see `jaxring.run.schema.DataSettings.data`; None: the bundled corpus), tokenized by `tokenizer`."""
    settings = RunSpec.of(data=data, tokenizer=None if tokenizer is None else tokenizer.name).data
    token_data = open_token_data(settings)
    if token_data.vocab_size > vocab_size:
        raise ValueError(
            f"the data {token_data.name} has token ids up to {token_data.vocab_size - 1}, outside the model's "
            f"vocabulary of {vocab_size}; give data of the model's tokenizer (--tokenizer)"
        )
    rows = StepBatches(
        token_data.batches("val", batch_size=batch_size, seq_len=seq_len, seed=0, vocab_size=vocab_size), prefetch=0
    )
    for step in range(batches):
        batch = rows.get(step)
        yield documents_of({k: np.asarray(v) for k, v in batch.items()})


def documents_of(batch: dict) -> dict:
    """{"tokens", "targets", "loss_mask", "positions"} int/bool [b, s] of a data batch, plus "segment_ids" when
    its rows hold more than one document or padding (packed documents: positions restart in each)."""
    shape = batch["tokens"].shape
    out = {
        "tokens": batch["tokens"].astype(np.int32),
        "targets": batch["targets"].astype(np.int32),
        "loss_mask": np.ones(shape, bool) if batch.get("loss_mask") is None else batch["loss_mask"].astype(bool),
        "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape),
    }
    segments = batch.get("segment_ids")
    if segments is not None and not (np.asarray(segments) == 1).all():
        out["segment_ids"] = segments.astype(np.int32)
        out["positions"] = batch["positions"].astype(np.int32)
    return out


def evaluate(
    loaded: LoadedModel,
    plan: ParallelPlan,
    *,
    seq_len: int,
    data: str | None = None,
    batch_size: int = 1,
    batches: int = 4,
    first_bucket: int | None = None,
    progress: Callable | None = None,
    label: str | None = None,
) -> dict:
    """{"model", "label", "data", "plan", "seq_len", "tokens", "loss", "perplexity", "buckets": [{"start", "end",
    "tokens", "loss", "perplexity"}]} over `batches` held-out batches of `batch_size` rows of `seq_len` tokens.
    progress: wraps the batches' iterator (a tqdm bar), or None."""
    if batch_size < 1 or batches < 1:
        raise ValueError(f"--batch-size {batch_size} and --batches {batches} must be positive")
    edges = bucket_edges(seq_len, first_bucket)
    check_context(loaded, plan, batch_size, seq_len)
    sums, counts = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1, np.int64)
    rows = held_out_rows(data, loaded.tokenizer, seq_len, batch_size, batches, loaded.config.vocab_size)
    for batch in progress(rows) if progress else rows:
        documents = {k: batch[k] for k in ("segment_ids", "positions")} if "segment_ids" in batch else {}
        losses, _ = token_scores(loaded, plan, batch["tokens"], batch["targets"], **documents)
        mask = batch["loss_mask"]
        bucket_of = np.searchsorted(edges, batch["positions"], side="right") - 1  # by position in its document
        np.add.at(sums, bucket_of[mask], losses[mask])
        np.add.at(counts, bucket_of[mask], 1)
    buckets = []
    for i in range(len(edges) - 1):
        loss = float(sums[i] / counts[i]) if counts[i] else float("nan")
        buckets.append(
            {
                "start": edges[i],
                "end": edges[i + 1],
                "tokens": int(counts[i]),
                "loss": loss,
                "perplexity": math.exp(loss),
            }
        )
    total = float(sums.sum() / max(counts.sum(), 1))
    return {
        "model": loaded.name,
        "label": label or loaded.name,
        "data": data or "bundled",
        "plan": plan.describe(),
        "seq_len": seq_len,
        "tokens": int(counts.sum()),
        "loss": total,
        "perplexity": math.exp(total),
        "buckets": buckets,
    }


def table(result: dict) -> str:
    """The buckets as a text table."""
    lines = [f"{result['label']}: {result['tokens']} tokens of {result['data']} at seq_len {result['seq_len']}"]
    lines.append(f"{'positions':>15} {'tokens':>9} {'loss':>8} {'ppl':>9}")
    for b in result["buckets"]:
        lines.append(f"{b['start']:>7}-{b['end']:<7} {b['tokens']:>9} {b['loss']:>8.4f} {b['perplexity']:>9.2f}")
    lines.append(f"{'all':>15} {result['tokens']:>9} {result['loss']:>8.4f} {result['perplexity']:>9.2f}")
    return "\n".join(lines)
