"""Pass-key retrieval (needle in a haystack) over context lengths × needle depths.

Each sequence is filler text with the needle "The pass key is NNNNN. Remember it." at a depth d in [0, 1] of
the filler (0: at the start, 1: just before the question), then the question "What is the pass key? The pass
key is" and the answer " NNNNN", cut to exactly `length` tokens of input. A cell's score is the share of its
samples whose answer the model reproduces exactly.

Scoring by one forward pass. Greedy decoding writes answer token k as the argmax of the model's logits given
the prompt and the answer tokens it wrote before it. If the first k answer tokens it wrote are the correct
ones, those logits are exactly the logits at answer position k of ONE causal forward pass over prompt + the
correct answer (teacher forcing): the causal model sees the same tokens before position k either way. So,
by induction over k, greedy decoding reproduces the answer exactly iff at every answer position the
teacher-forced argmax is the correct token. That is what is scored here, with one sharded forward pass per
context length on any plan (tests/integration/test_eval.py checks it against token-by-token greedy decoding and
`jaxring.models.generate.generate(temperature=0)`). Ties in the logits go to the first maximum, as jnp.argmax and greedy
decoding take them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jaxring.data.tokenizer import Tokenizer
from jaxring.eval.loading import LoadedModel, check_tokenizer_fits
from jaxring.eval.scoring import check_context, token_scores
from jaxring.parallel.plan import ParallelPlan

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    "The river runs to the sea. A bird sings in the tree. "
)
NEEDLE = "The pass key is {key}. Remember it. "
QUESTION = "What is the pass key? The pass key is"
ANSWER = " {key}"


def pass_key(seed: int, length: int, depth_index: int, sample: int) -> int:
    """A five-digit pass key, a pure function of where it is used."""
    return int(np.random.default_rng([seed, length, depth_index, sample]).integers(10000, 100000))


def check_depths(depths: Sequence[float]) -> None:
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"--depths {d}: a needle depth must lie in [0, 1] (0: start of the filler, 1: its end)")


def sequence(tokenizer: Tokenizer, length: int, depth: float, key: int, filler: str = FILLER) -> tuple[np.ndarray, int]:
    """(ids int32 [length + 1], answer_tokens): filler, the needle at `depth` of the filler, the question and
    the answer; inputs are ids[:-1], targets ids[1:], and the answer is the last `answer_tokens` targets."""
    needle = tokenizer.encode(NEEDLE.format(key=key))
    question = tokenizer.encode(QUESTION)
    answer = tokenizer.encode(ANSWER.format(key=key))
    room = length + 1 - len(needle) - len(question) - len(answer)
    if room < 1:
        raise ValueError(
            f"--lengths {length}: too short for the needle, question and answer "
            f"({length + 1 - room} tokens); use at least {length + 1 - room}"
        )
    unit = tokenizer.encode(filler)
    hay = np.tile(unit, -(-room // len(unit)))[:room]
    at = round(depth * room)
    ids = np.concatenate([hay[:at], needle, hay[at:], question, answer]).astype(np.int32)
    return ids, len(answer)


def evaluate(
    loaded: LoadedModel,
    plan: ParallelPlan,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int = 1,
    seed: int = 0,
    batch_size: int | None = None,
    filler: str = FILLER,
    progress: Callable | None = None,
    label: str | None = None,
) -> dict:
    """{"model", "label", "plan", "lengths", "depths", "samples", "accuracy" [len(lengths)][len(depths)],
    "cells": [{"length", "depth", "sample", "pass_key", "hit", "answer_loss"}]}. Every length is checked
    against the model and plan before any runs. batch_size: sequences per forward pass (default: all
    len(depths) * samples of a length in one). progress(total) -> a bar with update(n), or None."""
    check_depths(depths)
    check_tokenizer_fits(loaded)
    if samples < 1:
        raise ValueError(f"--samples {samples} must be a positive integer")
    rows = len(depths) * samples
    batch_size = rows if batch_size is None else batch_size
    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size} must be a positive integer")
    for length in lengths:
        check_context(loaded, plan, min(batch_size, rows), length)
        sequence(loaded.tokenizer, length, 0.0, 10000, filler)  # too short for the needle: said now
    bar = progress(len(lengths) * rows) if progress else None
    accuracy, cells = [], []
    for length in lengths:
        keys, seqs, answer_lens = [], [], []
        for j, depth in enumerate(depths):
            for k in range(samples):
                key = pass_key(seed, length, j, k)
                ids, n = sequence(loaded.tokenizer, length, depth, key, filler)
                keys.append(key)
                seqs.append(ids)
                answer_lens.append(n)
        batch = np.stack(seqs)
        losses, hits = [], []
        for i in range(0, rows, batch_size):
            part = batch[i : i + batch_size]
            loss, hit = token_scores(loaded, plan, part[:, :-1], part[:, 1:])
            losses.append(loss)
            hits.append(hit)
            if bar is not None:
                bar.update(len(part))
        losses, hits = np.concatenate(losses), np.concatenate(hits)
        row = np.zeros(len(depths))
        for r, (key, n) in enumerate(zip(keys, answer_lens)):
            j, k = divmod(r, samples)
            hit = bool(hits[r, -n:].all())
            row[j] += hit / samples
            cells.append(
                {
                    "length": length,
                    "depth": float(depths[j]),
                    "sample": k,
                    "pass_key": key,
                    "hit": hit,
                    "answer_loss": float(losses[r, -n:].sum()),
                }
            )
        accuracy.append([float(a) for a in row])
    if bar is not None:
        bar.close()
    return {
        "model": loaded.name,
        "label": label or loaded.name,
        "plan": plan.describe(),
        "lengths": [int(n) for n in lengths],
        "depths": [float(d) for d in depths],
        "samples": samples,
        "accuracy": accuracy,
        "cells": cells,
    }


def table(result: dict) -> str:
    """Accuracy as a text table: a row per depth, a column per length."""
    head = f"{'depth':>7} " + " ".join(f"{n:>7}" for n in result["lengths"])
    lines = [f"{result['label']}: pass key exact match ({result['samples']} per cell)", head]
    for j, d in enumerate(result["depths"]):
        lines.append(f"{d:>7.0%} " + " ".join(f"{row[j]:>7.2f}" for row in result["accuracy"]))
    return "\n".join(lines)
