"""The packed-document loader: grain datasets with a checkpointable position.

    docs = split_documents(store, "train", val_fraction=0.1)            # [k, 2] token ranges
    ds = PackedBatches(store, docs, batch_size=8, seq_len=256, seed=0, packing="split")
    it = iter(ds); batch = next(it)        # {"tokens", "targets", "segment_ids", "positions", "loss_mask"}
    state = it.get_state()                 # JSON: {"step", "cursors", "stream"}
    it.set_state(state)                    # the same next batches, on any mesh and host count

The documents of a split are shuffled by seed, a new order every epoch (`DocumentOrder`), and packed into rows (`jaxring.data.packing`, which defines
the batch convention). Row r of every global batch of B rows is lane r: the rows packed, one after the
other, from documents r, r + B, r + 2B, ... of that order, so a batch holds B different documents and a
long document continues in its lane's next row. Every host plans the rows of all lanes (document lengths
only) and reads the tokens of its own rows, [process_index·B/P, (process_index + 1)·B/P): the batches do not
depend on the number of hosts. The lanes' cursors are the iterator's state, the same on every host; a
checkpoint saves it (see the GPT task's `data_state`).

`StepBatches` gives batch(step) over such a dataset: sequential steps come from a prefetching iterator
(grain's ThreadPrefetchIterDataset keeps the consumer's state), any other step seeks (planning only).
`WindowBatches` puts the nanoGPT ``.bin`` random windows (`token_sources.TokenBatches`) behind the same interface.
"""

from __future__ import annotations

import atexit
import copy
import weakref
from fractions import Fraction

import grain
import numpy as np

from jaxring.data.packing import PACKINGS, assemble_row, check_batch, plan_drop, plan_split
from jaxring.data.source_checks import check_hosts, check_seed_step
from jaxring.data.store import DocumentStore
from jaxring.data.token_sources import TokenBatches

__all__ = ["PackedBatches", "StepBatches", "WindowBatches", "held_out", "split_documents"]


def held_out(num_docs: int, fraction: float) -> np.ndarray:
    """bool [num_docs]: the held-out share, spread evenly: document i is held out when floor((i + 1)·f) >
    floor(i·f) (f = 0.1: documents 9, 19, 29, ...); at least one when f > 0 and there are two or more."""
    f = Fraction(str(fraction))
    i = np.arange(num_docs, dtype=np.int64)
    out = (i + 1) * f.numerator // f.denominator > i * f.numerator // f.denominator
    if f > 0 and num_docs >= 2 and not out.any():
        out[-1] = True
    return out


def split_documents(store: DocumentStore, split: str, val_fraction: float) -> np.ndarray:
    """int64 [k, 2]: the (start, stop) token ranges of `split`'s documents ("train", "val", or "all").

    A store of one document (e.g. one text file) holds out the last val_fraction of its tokens instead."""
    if split not in ("train", "val", "all"):
        raise ValueError(f"split {split!r} must be 'train', 'val' or 'all'")
    ranges = np.stack([store.offsets[:-1], store.offsets[1:]], axis=1)
    if split == "all" or val_fraction == 0:
        if split == "val":
            raise ValueError(f"{store.name}: --val-fraction 0 holds out no documents; give --val-data")
        return ranges
    if store.num_docs == 1:
        n = int(ranges[0, 1])
        cut = min(max(round(n * (1 - val_fraction)), 1), max(n - 1, 1))
        if n < 2:
            raise ValueError(f"{store.name} holds one token: too few to hold out --val-fraction {val_fraction}")
        return np.array([[0, cut]] if split == "train" else [[cut, n]], np.int64)
    val = held_out(store.num_docs, val_fraction)
    keep = val if split == "val" else ~val
    if not keep.any():
        raise ValueError(
            f"{store.name} has {store.num_docs} documents: --val-fraction {val_fraction} leaves none for {split!r}"
        )
    return ranges[keep]


PERMUTATION_LIMIT = 1 << 24  # splits of up to this many documents keep each epoch's order as an array


class DocumentOrder:
    """Ordinal i of the stream -> (first token, length) of its document, in a new seeded order every epoch.

    Up to PERMUTATION_LIMIT documents, epoch e's order is ``np.random.default_rng([seed, e]).permutation``
    (a few epochs cached: int32, 4 bytes a document); beyond, grain's index shuffle
    (``MapDataset.range(k).shuffle(seed).repeat()``: O(1) memory, ~10-50 µs a document)."""

    def __init__(self, ranges: np.ndarray, seed: int, limit: int = PERMUTATION_LIMIT):
        self.starts, self.lengths = ranges[:, 0].copy(), ranges[:, 1] - ranges[:, 0]
        self._k, self._seed = len(ranges), seed
        self._grain = None if self._k <= limit else grain.MapDataset.range(self._k).shuffle(seed=seed).repeat()
        self._epochs: dict[int, np.ndarray] = {}

    def _epoch(self, e: int) -> np.ndarray:
        if e not in self._epochs:
            if len(self._epochs) >= 4:
                self._epochs.pop(min(self._epochs))
            self._epochs[e] = np.random.default_rng([self._seed, e]).permutation(self._k).astype(np.int32)
        return self._epochs[e]

    def __getitem__(self, i: int) -> tuple[int, int]:
        if self._grain is not None:
            d = self._grain[i] % self._k
        else:
            e, k = divmod(i, self._k)
            d = self._epoch(e)[k]
        return int(self.starts[d]), int(self.lengths[d])

    def lane(self, r: int, lanes: int) -> _Lane:
        return _Lane(self, r, lanes)


class _Lane:
    """Lane r of `lanes`: the stream's ordinals r, r + lanes, r + 2·lanes, ..."""

    def __init__(self, order: DocumentOrder, r: int, lanes: int):
        self.order, self.r, self.lanes = order, r, lanes

    def __getitem__(self, j: int) -> tuple[int, int]:
        return self.order[j * self.lanes + self.r]


class PackedBatches(grain.IterDataset):
    """Global batches of packed rows of `documents` (token ranges of `store`); this host's rows of each.

    Element `step`: a dict of int32 [batch_size / process_count, seq_len] arrays (`packing.BATCH_KEYS`).
    vocab_size: the model's vocabulary (default the store's); a larger id is refused here, before training (the
    store's meta.json max_token_id), and in every batch (a damaged store whose tokens exceed it).
    """

    def __init__(
        self,
        store: DocumentStore,
        documents: np.ndarray,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        packing: str = "split",
        process_index: int = 0,
        process_count: int = 1,
        split: str = "train",
        vocab_size: int | None = None,
    ):
        super().__init__()
        self.local_batch_size = check_hosts(batch_size, process_index, process_count)
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len {seq_len!r} must be a positive integer")
        check_seed_step(seed, 0)
        if packing not in PACKINGS:
            raise ValueError(f"--packing {packing!r} is not one of {', '.join(PACKINGS)}")
        documents = np.asarray(documents, np.int64).reshape(-1, 2)
        if not len(documents):
            raise ValueError(f"{store.name}[{split}] holds no documents")
        lengths = documents[:, 1] - documents[:, 0]
        fits = lengths + 1 <= seq_len
        if packing == "drop" and not fits.any():
            raise ValueError(
                f"no document of {store.name}[{split}] fits in --seq-len {seq_len} with --packing drop (the shortest "
                f"has {int(lengths.min())} tokens + EOS); use --packing split or a longer --seq-len"
            )
        vocab = store.vocab_size if vocab_size is None else vocab_size
        if store.max_token_id >= vocab or store.eos_id >= vocab:
            bad = max(store.max_token_id, store.eos_id)
            raise ValueError(
                f"token id {bad} of {store.name} is beyond the model's vocab_size {vocab} (the store's tokenizer has "
                f"{store.vocab_size}); give the model a vocabulary of at least {bad + 1}"
            )
        self.store, self.documents, self.batch_size, self.seq_len = store, documents, batch_size, seq_len
        self.seed, self.packing, self.split, self.vocab_size = seed, packing, split, vocab
        self.process_index, self.process_count = process_index, process_count
        self.dropped = (int((~fits).sum()), int(lengths[~fits].sum())) if packing == "drop" else (0, 0)
        self.order = DocumentOrder(documents, seed)
        self._plan = plan_split if packing == "split" else plan_drop

    def stream(self) -> dict:
        """What a saved position is valid for: the store's documents, the split, the seed and the packing."""
        return {
            "store": self.store.identity(),
            "split": self.split,
            "documents": len(self.documents),
            "seed": self.seed,
            "packing": self.packing,
            "batch_size": self.batch_size,
        }

    def describe(self) -> str:
        text = f"{self.store.name}[{self.split}]: {len(self.documents):,} documents, packing {self.packing}"
        if self.dropped[0]:
            share = self.dropped[1] / max(int((self.documents[:, 1] - self.documents[:, 0]).sum()), 1)
            text += f" ({self.dropped[0]:,} longer than seq_len - 1 dropped: {share:.0%} of the tokens)"
        return text

    def __iter__(self) -> PackedBatchIterator:
        return PackedBatchIterator(self)

    def __str__(self) -> str:
        return f"PackedBatches({self.describe()})"


class PackedBatchIterator(grain.DatasetIterator):
    """The position in a `PackedBatches` stream: the next step, and for every row r of the global batch
    (lane r, fed by documents r, r + B, r + 2B, ... of the shuffled order) its cursor: (document ordinal in
    the lane, items of that document already taken)."""

    def __init__(self, ds: PackedBatches):
        super().__init__()
        self._ds = ds
        self._lanes = [ds.order.lane(r, ds.batch_size) for r in range(ds.batch_size)]
        self._step, self._cursors = 0, [(0, 0)] * ds.batch_size

    def _rows(self) -> list:
        """Plans every lane's next row (lengths only) and moves the cursors past them."""
        ds, plans = self._ds, []
        for r, lane in enumerate(self._lanes):
            pieces, lookahead, self._cursors[r] = ds._plan(lane, self._cursors[r], ds.seq_len)
            plans.append((pieces, lookahead))
        return plans

    def __next__(self) -> dict:
        ds = self._ds
        plans = self._rows()
        lo = ds.process_index * ds.local_batch_size
        rows = [
            assemble_row(ds.store.tokens, pieces, lookahead, ds.seq_len, ds.store.eos_id)
            for pieces, lookahead in plans[lo : lo + ds.local_batch_size]
        ]
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        top = int(max(batch["tokens"].max(), batch["targets"].max()))
        if top >= ds.vocab_size:  # meta.json's max_token_id was checked: the tokens read are not what it says
            raise ValueError(
                f"token id {top} in batch {self._step} of {ds.store.name}[{ds.split}] is beyond the model's vocab_size "
                f"{ds.vocab_size} (the store's largest id is {ds.store.max_token_id}): the store's tokens are damaged; "
                f"prepare the data again"
            )
        self._step += 1
        return batch

    def skip(self, steps: int) -> None:
        """Moves past `steps` batches without reading any token (plans only)."""
        for _ in range(steps):
            self._rows()
            self._step += 1

    def get_state(self) -> dict:
        return {"step": self._step, "cursors": [list(c) for c in self._cursors], "stream": self._ds.stream()}

    def set_state(self, state: dict) -> None:
        if state.get("stream") != self._ds.stream():
            raise ValueError(
                f"the saved data position is for another document stream ({state.get('stream')}), not "
                f"{self._ds.stream()}"
            )
        self._step, self._cursors = int(state["step"]), [(int(j), int(o)) for j, o in state["cursors"]]


class WindowBatches(grain.IterDataset):
    """`token_sources.TokenBatches` (random windows of a token stream, no documents) as a packed-batch dataset:
    one segment per row, positions 0..L-1, every target counted. State: the step (batches are a pure
    function of (seed, step))."""

    def __init__(self, batches: TokenBatches, vocab_size: int | None = None):
        super().__init__()
        self.batches = batches
        self.vocab_size = batches.source.vocab_size if vocab_size is None else vocab_size

    def stream(self) -> dict:
        s = self.batches
        return {"windows": s.source.name, "tokens": len(s.source), "seed": s.seed}

    def describe(self) -> str:
        return f"{self.batches.source.name} (random windows, no documents)"

    def __iter__(self):
        return _WindowIterator(self)


class _WindowIterator(grain.DatasetIterator):
    def __init__(self, ds: WindowBatches):
        super().__init__()
        self._ds, self._step = ds, 0

    def __next__(self) -> dict:
        rows = self._ds.batches.get(self._step)
        if rows.max() >= self._ds.vocab_size:
            raise ValueError(
                f"token id {rows.max()} at step {self._step} of {self._ds.batches.source.name} is beyond the model's "
                f"vocab_size {self._ds.vocab_size}"
            )
        self._step += 1
        shape = (rows.shape[0], rows.shape[1] - 1)
        return {
            "tokens": rows[:, :-1],
            "targets": rows[:, 1:],
            "segment_ids": np.ones(shape, np.int32),
            "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy(),
            "loss_mask": np.ones(shape, np.int32),
        }

    def skip(self, steps: int) -> None:
        self._step += steps

    def get_state(self) -> dict:
        return {"step": self._step, "stream": self._ds.stream()}

    def set_state(self, state: dict) -> None:
        if state.get("stream") != self._ds.stream():
            raise ValueError(f"the saved data position is for another stream ({state.get('stream')})")
        self._step = int(state["step"])


class StepBatches:
    """batch(step) over a `PackedBatches` or `WindowBatches`: the next step comes from a prefetching iterator
    (`prefetch` batches ahead in a thread; 0: none), any other step seeks. `state()` is the position of the
    next batch; `restore(state)` puts it back. The first batch is checked against the convention."""

    def __init__(self, dataset: PackedBatches | WindowBatches, prefetch: int = 2):
        self.dataset = dataset
        self._source = (
            grain.experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=prefetch)
            if prefetch
            else dataset
        )
        self._it = iter(self._source)
        # stop the prefetch thread before the interpreter tears its modules down
        atexit.register(_close, weakref.ref(self))
        self._next = 0
        self.seeks = 0  # how often a step was not the next one (tests)
        self._checked = False

    def get(self, step: int) -> dict:
        if step != self._next:
            self._seek(step)
        batch = next(self._it)
        self._next = step + 1
        if not self._checked:
            check_batch(batch, self.dataset.vocab_size, where=f"batch {step} of {self.dataset.describe()}")
            self._checked = True
        return batch

    def _seek(self, step: int) -> None:
        raw = iter(self.dataset)
        raw.skip(step)
        self._it.set_state(raw.get_state())
        self.seeks += 1

    def state(self) -> dict:
        state = copy.deepcopy(self._it.get_state())
        if state["step"] != self._next:
            raise AssertionError(f"data iterator at step {state['step']}, expected {self._next}")
        return state

    def restore(self, state: dict) -> None:
        """Puts the position back (ValueError if it belongs to another stream)."""
        self._it.set_state(state)
        self._next = int(state["step"])

    def close(self) -> None:
        """Stops the prefetch thread and lets the iterator go (also done at exit, while the modules its
        finalizer needs are still there)."""
        it, self._it = self._it, None
        if it is not None:
            it.close()


def _close(ref: weakref.ref) -> None:
    batches = ref()
    if batches is not None:
        batches.close()
