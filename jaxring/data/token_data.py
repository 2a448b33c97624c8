"""What a run's data settings (`spec.DataSettings`) name for a token model: its documents, tokenizer, and the
packed batches of its train and val splits.

    data = open_token_data(spec.data)                # prepares a text/.jsonl/.parquet input on first use
    data.vocab_size, data.tokenizer.encode("def "), data.name
    train = data.batches("train", batch_size=8, seq_len=256, seed=0, vocab_size=model_vocab)

Sources: a document store, or an input `cache.open_store` prepares (packed documents, `loader.PackedBatches`);
a nanoGPT ``.bin`` (or a directory holding train.bin): random windows of one token stream, no documents
(`loader.WindowBatches` over `token_sources.TokenBatches`). Validation: --val-data (all its documents, with the
same tokenizer), else the --val-fraction share of --data's documents (`loader.split_documents`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxring.data.cache import open_store
from jaxring.data.inputs import MissingField
from jaxring.data.loader import PackedBatches, WindowBatches, split_documents
from jaxring.data.store import DocumentStore
from jaxring.data.token_sources import TokenBatches, TokenSource, load_tokens

__all__ = ["TokenData", "is_token_file", "open_token_data"]


def is_token_file(path: str | os.PathLike) -> bool:
    """A nanoGPT-style uint16 .bin, or a directory holding train.bin: read as random windows."""
    if path is None:
        return False
    p = Path(path)
    return p.suffix == ".bin" or (p.is_dir() and (p / "train.bin").is_file())


def _tokenizer_spec(store: DocumentStore) -> str:
    """How to ask for `store`'s tokenizer again (for a --val-data input prepared with it)."""
    return "bytes" if store.tokenizer.is_bytes else store.tokenizer.name


@dataclasses.dataclass
class TokenData:
    """train/val: a DocumentStore (with `packing`, `val_fraction` saying how it splits) or a TokenSource."""

    train: DocumentStore | TokenSource
    val: DocumentStore | TokenSource
    packing: str = "split"
    val_fraction: float = 0.1

    @property
    def is_windows(self) -> bool:
        return isinstance(self.train, TokenSource)

    @property
    def vocab_size(self) -> int:
        return self.train.vocab_size

    @property
    def tokenizer(self) -> Any:
        """encode(text) -> ids, decode(ids) -> text."""
        return self.train if self.is_windows else self.train.tokenizer

    @property
    def name(self) -> str:
        return self.train.name

    def batches(
        self,
        split: str,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        vocab_size: int | None = None,
    ) -> PackedBatches | WindowBatches:
        """The packed batches of `split` ("train" or "val") for a model of `vocab_size`."""
        hosts = {"process_index": process_index, "process_count": process_count}
        if self.is_windows:
            source = self.train if split == "train" else self.val
            windows = TokenBatches(source, batch_size=batch_size, seq_len=seq_len, seed=seed, **hosts)
            return WindowBatches(windows, vocab_size)
        store = self.train if split == "train" else self.val
        docs = split_documents(store, split if store is self.train else "all", self.val_fraction)
        return PackedBatches(
            store,
            docs,
            batch_size=batch_size,
            seq_len=seq_len,
            seed=seed,
            packing=self.packing,
            split=split,
            vocab_size=vocab_size,
            **hosts,
        )


def open_token_data(
    settings: Any, log: Callable[[str], None] | None = None, bin_vocab_size: int | None = None
) -> TokenData:
    """The data `settings` (a `spec.DataSettings`) names; text inputs are prepared on first use (`log` says so).
    bin_vocab_size: a .bin's vocabulary as the user stated it (None: GPT-2's, `token_sources.load_tokens`)."""
    if is_token_file(settings.data):
        if settings.tokenizer not in (None, "bytes") or settings.val_data is not None:
            raise ValueError(
                f"--data {settings.data!r} is a token file (.bin): it takes neither --tokenizer nor --val-data "
                f"(its val split is val.bin beside it, else its last 10%)"
            )
        return TokenData(
            load_tokens(settings.data, split="train", vocab_size=bin_vocab_size),
            load_tokens(settings.data, split="val", vocab_size=bin_vocab_size),
        )
    try:
        train = open_store(settings.data, settings.tokenizer, settings.text_field, log=log)
        val = train
        if settings.val_data is not None:
            if is_token_file(settings.val_data):
                raise ValueError(f"--val-data {settings.val_data!r} is a token file (.bin); give documents")
            val = open_store(settings.val_data, _tokenizer_spec(train), settings.text_field, log=log)
    except MissingField as e:  # the run's flag, not prepare's --field
        raise e.with_flag("--text-field") from None
    return TokenData(train, val, settings.packing, settings.val_fraction)
