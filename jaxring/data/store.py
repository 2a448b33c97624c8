"""Tokenized document stores: tokenize once (`prepare`), then read memory-mapped.

A store is a directory:

    tokens.bin     every document's tokens, back to back (uint16 when the vocabulary fits, else uint32)
    offsets.npy    int64 [documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]] (no EOS stored)
    meta.json      {"format", "tokenizer": {"name", "hash", "vocab_size", "eos_id"}, "dtype", "documents",
                    "tokens", "max_token_id", "empty_skipped", "source": {"name", "fingerprint", "field"}}
    tokenizer.json a copy of the tokenizer (not for "bytes"), so the store decodes itself

meta.json is written last: a directory without it is no store (a crash mid-way leaves none).

    python -m jaxring.data prepare corpus.jsonl out/ --tokenizer path/to/tokenizer.json --workers 4
    store = DocumentStore.open("out/")                   # refuses another tokenizer than the store's
    store = open_store(path, tokenizer=None)             # train.py --data: a store, a file prepared on first
                                                         # use into PATH.jaxring-cache/, or the bundled corpus
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from jaxring.data.inputs import input_files, read_documents
from jaxring.data.sources import STDLIB_FILES, TEXT_SUFFIXES
from jaxring.data.tokenizer import BYTES, Tokenizer, load_tokenizer

__all__ = [
    "FORMAT_VERSION",
    "DocumentStore",
    "bundled_store",
    "cache_dir",
    "is_store",
    "open_store",
    "prepare",
    "token_dtype",
]

FORMAT_VERSION = 1
TOKENS, OFFSETS, META, TOKENIZER = "tokens.bin", "offsets.npy", "meta.json", "tokenizer.json"
CACHE_SUFFIX = ".jaxring-cache"
CHUNK_BYTES = 1 << 20  # text sent to a worker at a time


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
        meta = _meta(tokenizer, tokens.dtype, len(ids), int(offsets[-1]), int(tokens.max()), 0, {"name": name})
        return cls(tokens, offsets, tokenizer, name, meta)

    @classmethod
    def open(cls, path: str | os.PathLike, tokenizer: str | None = None) -> DocumentStore:
        """The store in directory `path`, checked (files, sizes, offsets, ids); with `tokenizer` given ("bytes"
        or a tokenizer.json), a store made with another tokenizer is refused (one line naming both hashes)."""
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
        tokens = np.memmap(root / TOKENS, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
        if int(meta["max_token_id"]) >= tok.vocab_size:
            raise ValueError(
                f"store {str(root)!r}: token id {meta['max_token_id']} is beyond its tokenizer's vocab_size "
                f"{tok.vocab_size}"
            )
        return cls(tokens, offsets, tok, meta.get("source", {}).get("name") or root.name, meta)


def _meta(tokenizer: Tokenizer, dtype: np.dtype, docs: int, tokens: int, max_id: int, empty: int, source: str) -> dict:
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


# ---------------------------------------------------------------------------------------------- prepare

_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str, pooled: bool = True) -> None:
    global _worker_tokenizer
    if pooled:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
    _worker_tokenizer = load_tokenizer(spec)


def _encode_chunk(chunk: tuple[list[str], int]) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens [n] int64, lengths [docs] int64, bytes read) of a chunk of documents."""
    texts, nbytes = chunk
    ids = _worker_tokenizer.encode_batch(texts)
    lengths = np.array([len(t) for t in ids], np.int64)
    tokens = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, np.int64)
    return tokens, lengths, nbytes


def _chunks(documents: Iterable[tuple[str, int]]) -> Iterator[tuple[list[str], int]]:
    texts, size = [], 0
    for text, nbytes in documents:
        texts.append(text)
        size += nbytes
        if size >= CHUNK_BYTES or len(texts) >= 4096:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size


def fingerprint(path: str | os.PathLike, field: str) -> str:
    """sha256 of the input's files (relative paths, sizes, modification times) and the field read."""
    root = Path(path)
    h = hashlib.sha256(field.encode())
    for f in input_files(root):
        st = f.stat()
        rel = f.relative_to(root) if root.is_dir() else f.name
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _check_out_dir(out: Path, tokenizer: Tokenizer) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {str(out)!r} exists and is not a directory")
    if is_store(out):
        old = tokenizer.hash  # a damaged meta.json: the store is rewritten
        with contextlib.suppress(ValueError, KeyError, TypeError, UnicodeDecodeError):
            old = json.loads((out / META).read_text("utf-8"))["tokenizer"]["hash"]
        if old != tokenizer.hash:
            raise ValueError(
                f"{str(out)!r} holds a store made with tokenizer {old}, not {tokenizer.hash} "
                f"({tokenizer.describe()}): prepare into another directory"
            )
    elif out.is_dir() and any(out.iterdir()):
        raise ValueError(f"output {str(out)!r} is a non-empty directory and no document store; give a new directory")


def prepare(
    input: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | None = BYTES,
    field: str = "text",
    workers: int = 1,
    progress: bool = True,
) -> DocumentStore:
    """Tokenizes `input` (see `jaxring.data.inputs`) with `tokenizer` into a store in `out_dir`, `workers`
    processes in parallel (1: in this process), documents in input order. Returns the opened store."""
    tok = load_tokenizer(tokenizer)
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers {workers!r} must be a positive integer")
    out = Path(out_dir)
    files = input_files(input)  # checks the input before anything is written
    _check_out_dir(out, tok)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        _write_store(out, tok, input, files, field, workers, progress)
    except BaseException:
        for name in (f"{TOKENS}.tmp", f"{OFFSETS}.tmp.npy", f"{META}.tmp"):
            (out / name).unlink(missing_ok=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    return DocumentStore.open(out)


def _write_store(
    out: Path, tok: Tokenizer, input: str | os.PathLike, files: list[Path], field: str, workers: int, progress: bool
) -> None:
    """Tokenizes into out/*.tmp, renames them, writes meta.json last."""
    (out / META).unlink(missing_ok=True)  # no store until this one is complete
    dtype = token_dtype(tok.vocab_size)
    counts: dict = {}
    lengths, max_id = [], -1
    total = sum(f.stat().st_size for f in files)
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing {Path(input).name}", disable=not progress)
    chunks = _chunks(read_documents(input, field=field, counts=counts))
    spec = tok.name if not tok.is_bytes else BYTES
    try:
        with open(out / f"{TOKENS}.tmp", "wb") as sink:
            if workers == 1:
                _init_worker(spec, pooled=False)
                results = map(_encode_chunk, chunks)
                pool = None
            else:
                # a fresh server process (never a fork of this one, whose JAX threads may hold locks) imports
                # this module once; the workers fork from it
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload([__name__])
                pool = context.Pool(workers, _init_worker, (spec,))
                results = pool.imap(_encode_chunk, chunks)
            try:
                for ids, lens, nbytes in results:
                    if ids.size:
                        max_id = max(max_id, int(ids.max()))
                    sink.write(ids.astype(dtype).tobytes())
                    lengths.append(lens)
                    bar.update(nbytes)
            finally:
                if pool is not None:
                    pool.terminate()
    finally:
        bar.close()
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    if lengths.size == 0:
        skipped = f" ({counts['empty']} empty ones skipped)" if counts.get("empty") else ""
        raise ValueError(f"input {str(input)!r} holds no documents{skipped}")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(out / f"{OFFSETS}.tmp.npy", offsets)
    os.replace(out / f"{TOKENS}.tmp", out / TOKENS)
    os.replace(out / f"{OFFSETS}.tmp.npy", out / OFFSETS)
    if not tok.is_bytes:
        shutil.copyfile(tok.name, out / TOKENIZER)
    source = {"name": Path(input).name, "fingerprint": fingerprint(input, field), "field": field}
    meta = _meta(tok, dtype, len(lengths), int(offsets[-1]), max_id, counts.get("empty", 0), source)
    tmp = out / f"{META}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / META)


# ---------------------------------------------------------------------------------------------- for --data


def cache_dir(path: str | os.PathLike, tokenizer: Tokenizer) -> Path:
    """Where `open_store` prepares a text/.jsonl/.parquet input: PATH.jaxring-cache/<bytes or hash[:16]>."""
    key = BYTES if tokenizer.is_bytes else tokenizer.hash[:16]
    return Path(str(Path(path)).rstrip("/") + CACHE_SUFFIX) / key


def bundled_store(tokenizer: str | None = None) -> DocumentStore:
    """The bundled corpus: the Python standard library's own files (`sources.STDLIB_FILES`, in that fixed
    order, those this Python has), one document per file, in memory."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / n).read_text("utf-8") for n in STDLIB_FILES if (root / n).is_file()]
    if not texts:
        raise FileNotFoundError(
            f"none of the bundled corpus's standard-library files were found under {root}; pass --data: a store, "
            f"a text file, a directory of {'/'.join(TEXT_SUFFIXES)} files, a .jsonl or a .parquet file"
        )
    return DocumentStore.from_texts(texts, load_tokenizer(tokenizer), "python-stdlib")


def open_store(
    path: str | os.PathLike,
    tokenizer: str | None = None,
    field: str = "text",
    log: Callable[[str], None] | None = None,
) -> DocumentStore:
    """The documents `train.py --data PATH` names: None, the bundled corpus; a store directory (checked
    against `tokenizer` when given); any other input prepared on first use into `cache_dir` beside it
    (again when the input changed), with `tokenizer` (default: bytes)."""
    if path is None:
        return bundled_store(tokenizer)
    if is_store(path):
        return DocumentStore.open(path, tokenizer)
    tok = load_tokenizer(tokenizer)
    cache = cache_dir(path, tok)
    if is_store(cache):
        with contextlib.suppress(ValueError, KeyError):
            store = DocumentStore.open(cache, tokenizer)
            if store.meta.get("source", {}).get("fingerprint") == fingerprint(path, field):
                return store
    if log is not None:
        log(f"preparing {path} into {cache} (tokenizer {tok.describe()}; once, until the input changes)")
    try:
        shutil.rmtree(cache, ignore_errors=True)
        workers = (
            max(1, min(os.cpu_count() or 1, 8)) if sum(f.stat().st_size for f in input_files(path)) > 64 << 20 else 1
        )
        return prepare(path, cache, tokenizer=tokenizer or BYTES, field=field, workers=workers, progress=False)
    except PermissionError as e:
        raise ValueError(
            f"--data {path!r}: cannot write its cache {str(cache)!r} ({e.strerror}); prepare it elsewhere with "
            f"python -m jaxring.data prepare {path} OUT_DIR and pass --data OUT_DIR"
        ) from None
