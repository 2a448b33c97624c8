"""`train.py --data PATH`'s documents: a store, the bundled corpus, or an input prepared on first use.

    store = open_store("corpus.jsonl", tokenizer=None, log=print)   # prepared into corpus.jsonl.jaxring-cache/bytes/

An input that is no store is prepared (`jaxring.data.prepare`) into `cache_dir` beside it, once, and again when
its files change (their sizes and modification times: `prepare.fingerprint`). Runs started together on one
input take turns on the cache's lock: the first prepares, the others wait and open its store. A stop signal
ends the preparation or the wait within a second (`jaxring.core.stop_signals.Interrupted`).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path

from jaxring.core.stop_signals import StopSignals
from jaxring.data.inputs import describe_skipped, input_files, skipped_files
from jaxring.data.prepare import check_out_dir, fingerprint, locked, write_store
from jaxring.data.store import DocumentStore, bundled_store, is_store
from jaxring.data.tokenizer import BYTES, Tokenizer, load_tokenizer

__all__ = ["CACHE_SUFFIX", "cache_dir", "open_store"]

CACHE_SUFFIX = ".jaxring-cache"
PARALLEL_BYTES = 64 << 20  # inputs larger than this are tokenized by several processes


def cache_dir(path: str | os.PathLike, tokenizer: Tokenizer) -> Path:
    """Where `open_store` prepares a text/.jsonl/.parquet input: PATH.jaxring-cache/<bytes or hash[:16]>."""
    key = BYTES if tokenizer.is_bytes else tokenizer.hash[:16]
    return Path(str(Path(path)).rstrip("/") + CACHE_SUFFIX) / key


def _cached(
    cache: Path, tokenizer: str | None, path: str | os.PathLike, field: str, log: Callable[[str], None] | None
) -> DocumentStore | None:
    """The cache's store when it is intact and made from the input as it is now."""
    if not is_store(cache):
        return None
    with contextlib.suppress(ValueError, KeyError, OSError):
        store = DocumentStore.open(cache, tokenizer, log=log)
        if store.meta.get("source", {}).get("fingerprint") == fingerprint(path, field):
            return store
    return None


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
        return DocumentStore.open(path, tokenizer, log=log)
    tok = load_tokenizer(tokenizer)
    files = input_files(path)
    cache = cache_dir(path, tok)
    store = _cached(cache, tokenizer, path, field, log)
    if store is not None:
        return store
    workers = max(1, min(os.cpu_count() or 1, 8)) if sum(f.stat().st_size for f in files) > PARALLEL_BYTES else 1
    try:
        with StopSignals() as stop, locked(cache, stop, log) as created:
            store = _cached(cache, tokenizer, path, field, log)  # another run may have prepared it meanwhile
            if store is not None:
                return store
            if log is not None:
                log(f"preparing {path} into {cache} (tokenizer {tok.describe()}; once, until the input changes)")
                if skipped_files(path):
                    log(f"{path}: {describe_skipped(path)}")
            check_out_dir(cache, tok)
            write_store(cache, tok, path, files, field, workers, False, stop, created)
    except BaseException as e:
        with contextlib.suppress(OSError):
            cache.parent.rmdir()  # PATH.jaxring-cache/ when this run made it and left nothing in it
        if not (isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)):
            raise
        raise ValueError(
            f"--data {path!r}: cannot write its cache {str(cache)!r} ({e.strerror}); prepare it elsewhere with "
            f"python -m jaxring.data prepare {path} OUT_DIR and pass --data OUT_DIR"
        ) from None
    return DocumentStore.open(cache, log=log)
