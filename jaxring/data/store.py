"""Tokenized document stores, read memory-mapped (`jaxring.data.prepare` writes them).

A store is a directory:

    tokens.bin     every document's tokens, back to back (uint16 when the vocabulary fits, else uint32)
    offsets.npy    int64 [documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]] (no EOS stored)
    meta.json      {"format", "tokenizer": {"name", "hash", "vocab_size", "eos_id"}, "dtype", "documents",
                    "tokens", "max_token_id", "empty_skipped", "source": {"name", "fingerprint", "field"},
                    "checksums": {"tokens.bin": "sha256:...", "offsets.npy": "sha256:..."}}
    tokenizer.json a copy of the tokenizer (not for "bytes"), so the store decodes itself

meta.json is written last: a directory without it is no store (a crash mid-way leaves none). Opening a store
checks its files' sizes, offsets and ids and verifies their checksums (`jaxring.data.checksums`); a store made
before checksums were written (no "checksums" in meta.json) is opened with a one-line note.

    store = DocumentStore.open("out/")                   # refuses another tokenizer than the store's
    store = bundled_store()                              # the bundled corpus, in memory
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from jaxring.data.checksums import verify
from jaxring.data.token_sources import STDLIB_FILES, TEXT_SUFFIXES
from jaxring.data.tokenizer import BYTES, Tokenizer, load_tokenizer

__all__ = ["FORMAT_VERSION", "DocumentStore", "bundled_store", "is_store", "store_meta", "token_dtype"]

FORMAT_VERSION = 1
TOKENS, OFFSETS, META, TOKENIZER = "tokens.bin", "offsets.npy", "meta.json", "tokenizer.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def is_store(path: str | os.PathLike) -> bool:
    return path is not None and (Path(path) / META).is_file()


class DocumentStore:
    """Documents as token ranges of one array.

    tokens: [num_tokens] uint16/uint32 (a read-only ``np.memmap`` for a store on disk); offsets: int64
    [num_docs + 1]; tokenizer: the store's (`Tokenizer`); name: what it is (shown in the run's header).
    """

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, tokenizer: Tokenizer, name: str, meta: dict):
        self.tokens, self.offsets, self.tokenizer, self.name, self.meta = tokens, offsets, tokenizer, name, meta

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def max_token_id(self) -> int:
        return int(self.meta["max_token_id"])

    def lengths(self) -> np.ndarray:
        """int64 [num_docs]: tokens per document."""
        return np.diff(self.offsets)

    def document(self, d: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[d] : self.offsets[d + 1]])

    def identity(self) -> dict:
        """What a data-loader state is valid for: the same documents and tokens."""
        return {"tokenizer": self.tokenizer.hash, "documents": self.num_docs, "tokens": self.num_tokens}

    # ------------------------------------------------------------------------ building and opening
    @classmethod
    def from_texts(cls, texts: Iterable[str], tokenizer: Tokenizer, name: str) -> DocumentStore:
        """An in-memory store of `texts` (one document each; empty ones skipped)."""
        ids = [t for t in tokenizer.encode_batch([t for t in texts if t]) if t.size]
        if not ids:
            raise ValueError(f"{name} holds no non-empty documents")
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in ids])]).astype(np.int64)
        tokens = np.concatenate(ids).astype(token_dtype(tokenizer.vocab_size))
        meta = store_meta(tokenizer, tokens.dtype, len(ids), int(offsets[-1]), int(tokens.max()), 0, {"name": name})
        return cls(tokens, offsets, tokenizer, name, meta)

    @classmethod
    def open(
        cls, path: str | os.PathLike, tokenizer: str | None = None, log: Callable[[str], None] | None = None
    ) -> DocumentStore:
        """The store in directory `path`, checked (files, sizes, offsets, ids, checksums); with `tokenizer` given
        ("bytes" or a tokenizer.json), a store made with another tokenizer is refused (one line naming both
        hashes). `log` gets the note on a store without checksums."""
        root = Path(path)
        meta = _read_meta(root)
        saved = meta["tokenizer"]
        if tokenizer is not None:
            wanted = load_tokenizer(tokenizer)
            if wanted.hash != saved["hash"]:
                raise ValueError(
                    f"store {str(root)!r} was made with tokenizer {saved['hash']}, not --tokenizer {tokenizer} "
                    f"({wanted.hash}): prepare the data again with this tokenizer, or leave --tokenizer out"
                )
        tok = load_tokenizer(BYTES if saved["hash"] == BYTES else str(root / TOKENIZER))
        if tok.hash != saved["hash"] or tok.vocab_size != saved["vocab_size"]:
            raise ValueError(
                f"store {str(root)!r}: its {TOKENIZER} (sha256 {tok.hash}) is not the tokenizer meta.json names "
                f"({saved['hash']}); prepare the data again"
            )
        tok.eos_id = int(saved["eos_id"])
        offsets = _read_offsets(root / OFFSETS, meta)
        dtype = np.dtype(meta["dtype"])
        size = (root / TOKENS).stat().st_size if (root / TOKENS).exists() else None
        if size != int(offsets[-1]) * dtype.itemsize:
            raise ValueError(
                f"store {str(root)!r}: {TOKENS} has {size} bytes, not the {int(offsets[-1])} {dtype.name} tokens "
                f"offsets.npy ends at; prepare the data again"
            )
        if "checksums" in meta:
            verify(root, meta["checksums"], str(root))
        elif log is not None:
            log(f"note: store {str(root)!r} has no checksums (made by an older jaxring): not verified")
        tokens = np.memmap(root / TOKENS, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
        if int(meta["max_token_id"]) >= tok.vocab_size:
            raise ValueError(
                f"store {str(root)!r}: token id {meta['max_token_id']} is beyond its tokenizer's vocab_size "
                f"{tok.vocab_size}"
            )
        return cls(tokens, offsets, tok, meta.get("source", {}).get("name") or root.name, meta)


def store_meta(
    tokenizer: Tokenizer, dtype: np.dtype, docs: int, tokens: int, max_id: int, empty: int, source: str
) -> dict:
    return {
        "format": FORMAT_VERSION,
        "tokenizer": {
            "name": BYTES if tokenizer.is_bytes else (Path(tokenizer.name).parent.name or Path(tokenizer.name).name),
            "hash": tokenizer.hash,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        },
        "dtype": np.dtype(dtype).name,
        "documents": docs,
        "tokens": tokens,
        "max_token_id": max_id,
        "empty_skipped": empty,
        "source": source,
    }


def _read_meta(root: Path) -> dict:
    if not (root / META).is_file():
        raise FileNotFoundError(
            f"{str(root)!r} is no document store (no {META}); make one with python -m jaxring.data prepare"
        )
    try:
        meta = json.loads((root / META).read_text("utf-8"))
        missing = [k for k in ("hash", "vocab_size", "eos_id") if k not in meta["tokenizer"]]
        if missing:
            raise KeyError(f"tokenizer.{missing[0]}")
        if "checksums" in meta and set(meta["checksums"]) != {TOKENS, OFFSETS}:
            raise KeyError(f"checksums of {TOKENS} and {OFFSETS}")
        np.dtype(meta["dtype"])
        int(meta["max_token_id"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"store {str(root)!r}: {META} is damaged ({type(e).__name__}: {e}); prepare the data again"
        ) from None
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"store {str(root)!r} has format {meta.get('format')!r}, this jaxring reads format {FORMAT_VERSION}; "
            f"prepare the data again"
        )
    return meta


def _read_offsets(path: Path, meta: dict) -> np.ndarray:
    try:
        offsets = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(path)!r} cannot be read ({' '.join(str(e).split())}); prepare the data again") from None
    if offsets.dtype != np.int64 or offsets.ndim != 1:
        raise ValueError(
            f"{str(path)!r} holds {offsets.dtype} {list(offsets.shape)}; document offsets must be int64 [documents + 1]"
        )
    if len(offsets) != int(meta["documents"]) + 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise ValueError(
            f"{str(path)!r} is not {meta['documents']} + 1 non-decreasing offsets from 0; prepare the data again"
        )
    return offsets


def bundled_store(tokenizer: str | None = None) -> DocumentStore:
    """The bundled corpus: the Python standard library's own files (`token_sources.STDLIB_FILES`, in that fixed
    order, those this Python has), one document per file, in memory."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / n).read_text("utf-8") for n in STDLIB_FILES if (root / n).is_file()]
    if not texts:
        raise FileNotFoundError(
            f"none of the bundled corpus's standard-library files were found under {root}; pass --data: a store, "
            f"a text file, a directory of {'/'.join(TEXT_SUFFIXES)} files, a .jsonl or a .parquet file"
        )
    return DocumentStore.from_texts(texts, load_tokenizer(tokenizer), "python-stdlib")
