"""Packing documents into rows of seq_len tokens, and the batch convention the model consumes.

THE CONVENTION. A packed row of length L holds five int32 [L] arrays (a batch stacks rows: [batch, L]):

  tokens       input ids: documents in stream order, each followed by one EOS (the store's eos_id)
  targets      the next id of the row's stream after each input (tokens shifted by one, the last one the
               stream's next id), so targets[j] == tokens[j + 1] for j < L - 1
  segment_ids  1, 2, ... for the row's document pieces in order; 0 = padding
  positions    the token's index within its piece: 0 at each document's start and at the row's start (a
               document continued from the previous row starts again at 0: positions stay < L)
  loss_mask    1 where the target continues the same document; 0 where the input is a document's EOS (its
               target is the next document's first id) and on padding

Attention under this convention: query i sees key j iff segment_ids[i] == segment_ids[j] and
positions[j] <= positions[i] (padding, segment 0, sees only padding; its loss is masked). The loss is the
mean cross-entropy of `targets` over loss_mask == 1. Padding inputs and targets are the EOS id.

The layout permutation of a sequence-parallel plan (zigzag, striped) permutes all five arrays along the
sequence, as the tokens; positions then stay document positions (the layout's row positions are not needed:
within a segment, document order is row order).

PACKING MODES (`--packing`):
  split: the stream (documents, each + EOS) is cut into consecutive windows: row k holds stream tokens
         [kL, kL + L) and stream[kL + L] as its last target. A document longer than what is left of a row
         continues in the next one. No padding.
  drop:  whole documents only: a row takes the next documents while they fit (length + 1 <= L), the rest of
         the row is padding; documents longer than L - 1 tokens are skipped.

A piece of a row is (first token of its document in the store, lo, hi, n): items [lo, hi) of the document's
item (its n tokens, then the EOS at index n).
"""

from __future__ import annotations

import numpy as np

__all__ = ["BATCH_KEYS", "PACKINGS", "assemble_row", "check_batch", "plan_drop", "plan_split"]

PACKINGS = ("split", "drop")
BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")

Piece = tuple[int, int, int, int]


def plan_split(order: np.ndarray, cursor: tuple[int, int], seq_len: int) -> tuple[list[Piece], Piece, tuple[int, int]]:
    """The pieces of the next `split` row from `cursor` = (document ordinal, items of it already taken), the
    lookahead item (the last target) and the cursor after the row. order[i] -> (first token, length)."""
    i, o = cursor
    pieces, need = [], seq_len
    start, n = order[i]
    while need:
        take = min(n + 1 - o, need)
        pieces.append((start, o, o + take, n))
        need -= take
        o += take
        if o == n + 1:
            i, o = i + 1, 0
            start, n = order[i]
    return pieces, (start, o, o + 1, n), (i, o)


def plan_drop(order: np.ndarray, cursor: tuple[int, int], seq_len: int) -> tuple[list[Piece], None, tuple[int, int]]:
    """The whole documents of the next `drop` row from `cursor` (offset 0), and the cursor after it.
    Documents longer than seq_len - 1 are skipped (some document must fit; the loader checks)."""
    i, used, pieces = cursor[0], 0, []
    while True:
        start, n = order[i]
        if n + 1 > seq_len:
            i += 1
            continue
        if used + n + 1 > seq_len:
            return pieces, None, (i, 0)
        pieces.append((start, 0, n + 1, n))
        used += n + 1
        i += 1


def assemble_row(tokens: np.ndarray, pieces: list[Piece], lookahead: Piece | None, seq_len: int, eos: int) -> dict:
    """The row's five int32 [seq_len] arrays (see the module docstring) from the store's `tokens`."""
    ext = np.full(seq_len + 1, eos, np.int32)
    seg = np.zeros(seq_len, np.int32)
    pos = np.zeros(seq_len, np.int32)
    mask = np.zeros(seq_len, np.int32)
    at = 0
    for k, (start, lo, hi, n) in enumerate(pieces, 1):
        width, body = hi - lo, min(hi, n) - lo
        if body > 0:
            ext[at : at + body] = tokens[start + lo : start + lo + body]
        seg[at : at + width] = k
        pos[at : at + width] = np.arange(width, dtype=np.int32)
        mask[at : at + width] = 1
        if hi == n + 1:
            mask[at + width - 1] = 0  # the EOS: its target is another document's
        at += width
    if lookahead is not None:
        start, o, _, n = lookahead
        ext[seq_len] = tokens[start + o] if o < n else eos
    return {"tokens": ext[:-1], "targets": ext[1:], "segment_ids": seg, "positions": pos, "loss_mask": mask}


def check_batch(batch: dict, vocab_size: int, where: str = "batch") -> None:
    """One-line ValueError unless `batch` follows the convention: integer [rows, L] arrays of the five keys,
    ids in [0, vocab_size), segment ids >= 0 and non-decreasing along a row, positions >= 0, loss_mask 0/1."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)} (a packed batch has {', '.join(BATCH_KEYS)})")
    shape = np.shape(batch["tokens"])
    for k in BATCH_KEYS:
        a = np.asarray(batch[k])
        if not np.issubdtype(a.dtype, np.integer):
            sample = a.reshape(-1)[:1].tolist()
            raise ValueError(f"{where}: {k} are {a.dtype} (e.g. {sample[0] if sample else '-'}); they must be integers")
        if a.shape != shape or a.ndim != 2:
            raise ValueError(f"{where}: {k} has shape {list(a.shape)}, not [rows, seq_len] like tokens {list(shape)}")
    for k in ("tokens", "targets"):
        a = np.asarray(batch[k])
        if a.size and (a.min() < 0 or a.max() >= vocab_size):
            bad = int(a.max()) if a.max() >= vocab_size else int(a.min())
            raise ValueError(f"{where}: token id {bad} in {k} is outside the model's vocabulary [0, {vocab_size})")
    seg = np.asarray(batch["segment_ids"])
    if seg.size and (seg.min() < 0 or np.any(np.diff(np.where(seg == 0, seg.max() + 1, seg), axis=1) < 0)):
        raise ValueError(f"{where}: segment_ids must be >= 0 and non-decreasing along a row (padding 0 at the end)")
    if np.asarray(batch["positions"]).min(initial=0) < 0:
        raise ValueError(f"{where}: positions must be >= 0")
    if not np.isin(np.asarray(batch["loss_mask"]), (0, 1)).all():
        raise ValueError(f"{where}: loss_mask must hold only 0 and 1")
