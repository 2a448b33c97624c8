"""Tokenize once: `prepare(input, out_dir)` writes a document store (`jaxring.data.store`'s format).

    python -m jaxring.data prepare corpus.jsonl out/ --tokenizer path/to/tokenizer.json --workers 4
    store = prepare("corpus.jsonl", "out/", tokenizer="bytes", workers=4)

Documents are read in input order, tokenized in chunks of about CHUNK_BYTES (by `workers` processes of a
`concurrent.futures.ProcessPoolExecutor`, or in this process), and written to temporary files that replace the
store's only when complete; meta.json (with the files' sha256) is written last. What can go wrong ends in one
line and leaves no temporary file, and an earlier store in OUT_DIR stays as it was until the new one is done:
  * a stop signal (SIGINT, SIGTERM, SIGHUP; `jaxring.core.stop_signals`) ends it between chunks: `Interrupted`
    (exit code 128 + the signal's number);
  * a worker process that dies (the out-of-memory killer): ChildProcessError, not a hang;
  * a write that fails (a full or read-only disk): `StoreWriteError` (an OSError).
Preparations of one OUT_DIR take turns: an exclusive lock on OUT_DIR/.prepare.lock (fcntl.flock, released by
the system when a process dies), waited for while signals are still honoured. Under the lock, files a killed
run left behind (*.tmp) are removed, so a run after a SIGKILL just works.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import hashlib
import json
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxring.core.stop_signals import StopSignals
from jaxring.data.checksums import VERIFIED, file_checksum
from jaxring.data.inputs import describe_skipped, input_files, read_documents, skipped_files
from jaxring.data.store import META, OFFSETS, TOKENIZER, TOKENS, DocumentStore, is_store, store_meta, token_dtype
from jaxring.data.tokenizer import BYTES, Tokenizer, load_tokenizer

__all__ = ["CHUNK_BYTES", "LOCK", "StoreWriteError", "check_out_dir", "fingerprint", "locked", "prepare", "write_store"]

CHUNK_BYTES = 1 << 20  # text sent to a worker at a time
LOCK = ".prepare.lock"
TMP = {TOKENS: f"{TOKENS}.tmp", OFFSETS: f"{OFFSETS}.tmp.npy", TOKENIZER: f"{TOKENIZER}.tmp", META: f"{META}.tmp"}
OURS = {TOKENS, OFFSETS, TOKENIZER, META, LOCK, VERIFIED, *TMP.values()}  # what a store directory may hold
POLL_S = 0.1  # how often a wait looks at the stop signal


class StoreWriteError(OSError):
    """A store's file could not be written (errno kept: ENOSPC, EROFS, EACCES, ...); str(): the message alone."""

    def __str__(self) -> str:
        return self.strerror


# ---------------------------------------------------------------------------------------------- workers

_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str, main_pid: int | None = None) -> None:
    """Loads the tokenizer; in a pool process (`main_pid`: the preparing process) also: Ctrl-C is the main
    process's to handle, and the worker exits quietly once that process is gone (a SIGKILL)."""
    global _worker_tokenizer
    if main_pid is not None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=_exit_without, args=(main_pid,), daemon=True).start()
    _worker_tokenizer = load_tokenizer(spec)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a killed one that its parent has not reaped yet is a zombie: not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:  # no /proc: the signal test alone
        return True


def _exit_without(main_pid: int) -> None:
    """A worker's watch on the main process: the forkserver that forked the worker outlives the main process
    (every worker keeps it alive), so the worker looks at the main process itself."""
    while _alive(main_pid):
        time.sleep(0.5)
    os._exit(0)


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


def _result(future: Future, stop: StopSignals, message: str):
    while not wait([future], timeout=POLL_S, return_when=FIRST_COMPLETED)[0]:
        stop.check(message)
    return future.result()


def _encoded(chunks: Iterator, spec: str, workers: int, stop: StopSignals, message: str) -> Iterator[tuple]:
    """`_encode_chunk` of every chunk, in order; `stop` looked at between chunks (and while waiting)."""
    if workers == 1:
        _init_worker(spec)
        for chunk in chunks:
            stop.check(message)
            yield _encode_chunk(chunk)
        return
    # a fresh server process (never a fork of this one, whose JAX threads may hold locks) imports this module
    # once; the workers fork from it
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(spec, os.getpid()))
    pending: collections.deque[Future] = collections.deque()
    try:
        for chunk in chunks:
            stop.check(message)
            pending.append(pool.submit(_encode_chunk, chunk))
            if len(pending) >= 2 * workers:  # a bounded number of chunks in flight
                yield _result(pending.popleft(), stop, message)
        while pending:
            yield _result(pending.popleft(), stop, message)
    except BrokenProcessPool:  # from submit or a result
        raise ChildProcessError(
            "a tokenizing worker process died (killed by the system: out of memory?); nothing was written; "
            "retry with fewer --workers"
        ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # the running chunks finish (about a second)


# ---------------------------------------------------------------------------------------------- the lock


@contextlib.contextmanager
def locked(out: Path, stop: StopSignals, log: Callable[[str], None] | None = None) -> Iterator[bool]:
    """Holds OUT/.prepare.lock (creating OUT), waiting for another process's turn; yields whether OUT was
    created here. A stop signal ends the wait (`Interrupted`)."""
    said = False
    while True:
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not said and log is not None:
                        log(f"waiting for another process preparing {str(out)!r} (it holds {LOCK})")
                        said = True
                    stop.check(f"interrupted while waiting for the lock of {str(out)!r}; nothing written")
                    time.sleep(POLL_S)
            try:
                same = os.fstat(fd).st_ino == os.stat(out / LOCK).st_ino
            except FileNotFoundError:  # the holder removed OUT (its run failed): take a fresh one
                same = False
            if same:
                yield created
                return
        finally:
            os.close(fd)  # releases the lock


# ---------------------------------------------------------------------------------------------- prepare


def fingerprint(path: str | os.PathLike, field: str) -> str:
    """sha256 of the input's files (relative paths, sizes, modification times) and the field read."""
    root = Path(path)
    h = hashlib.sha256(field.encode())
    for f in input_files(root):
        st = f.stat()
        rel = f.relative_to(root) if root.is_dir() else f.name
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def check_out_dir(out: Path, tokenizer: Tokenizer) -> None:
    """OUT_DIR must be new, a store of the same tokenizer (rewritten), or what an unfinished run left."""
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
    elif out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in OURS)
        if foreign:
            raise ValueError(
                f"output {str(out)!r} is a non-empty directory and no document store (it holds {foreign[0]!r}); "
                f"give a new directory"
            )


def prepare(
    input: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | None = BYTES,
    field: str = "text",
    workers: int = 1,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> DocumentStore:
    """Tokenizes `input` (see `jaxring.data.inputs`) with `tokenizer` into a store in `out_dir`, `workers`
    processes in parallel (1: in this process), documents in input order. Returns the opened store."""
    tok = load_tokenizer(tokenizer)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"--workers {workers!r} must be a positive integer")
    out = Path(out_dir)
    files = input_files(input)  # checks the input before anything is written
    if log is not None and skipped_files(input):
        log(f"{input}: {describe_skipped(input)}")
    check_out_dir(out, tok)
    try:
        with StopSignals() as stop, locked(out, stop, log) as created:
            check_out_dir(out, tok)  # again: another process may have written it meanwhile
            write_store(out, tok, input, files, field, workers, progress, stop, created)
    except StoreWriteError:
        raise
    except OSError as e:  # OUT_DIR or its lock cannot be created (a read-only filesystem)
        if not str(e.filename or "").startswith(str(out)):
            raise
        raise StoreWriteError(
            e.errno or errno.EIO, f"OUT_DIR {str(out)!r} cannot be written ({e.strerror or e}): give a writable one"
        ) from None
    return DocumentStore.open(out)


@contextlib.contextmanager
def _writing(out: Path):
    """An OSError while writing the store becomes a StoreWriteError naming the store and the reason."""
    try:
        yield
    except OSError as e:
        reason = e.strerror or " ".join(str(e).split())
        raise StoreWriteError(
            e.errno or errno.EIO, f"cannot write the store {str(out)!r} ({reason}); nothing was written"
        ) from None


def _remove(out: Path, names: Iterable[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            (out / name).unlink()


def write_store(
    out: Path,
    tok: Tokenizer,
    input: str | os.PathLike,
    files: list[Path],
    field: str,
    workers: int,
    progress: bool,
    stop: StopSignals,
    created: bool,
) -> None:
    """Writes the store of `input` into `out` (whose lock the caller holds); on any failure removes what it
    wrote (and `out` itself when `created`), keeping an earlier store there intact."""
    _remove(out, TMP.values())  # a killed run's leftovers (no process writes here but us)
    kept = "nothing written to" if created or not is_store(out) else "kept the previous store in"
    message = f"interrupted; {kept} {str(out)!r}"
    try:
        _write(out, tok, input, files, field, workers, progress, stop, message)
    except BaseException:
        _remove(out, TMP.values())
        if created and not is_store(out):
            _remove(out, OURS)
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


def _write(
    out: Path,
    tok: Tokenizer,
    input: str | os.PathLike,
    files: list[Path],
    field: str,
    workers: int,
    progress: bool,
    stop: StopSignals,
    message: str,
) -> None:
    """Tokenizes into out/*.tmp, then replaces the store's files by them, meta.json last."""
    dtype = token_dtype(tok.vocab_size)
    counts: dict = {}
    lengths, max_id = [], -1
    digest = hashlib.sha256()
    total = sum(f.stat().st_size for f in files)
    chunks = _chunks(read_documents(input, field=field, counts=counts))
    spec = tok.name if not tok.is_bytes else BYTES
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing {Path(input).name}", disable=not progress)
    try:
        with _writing(out):
            sink = open(out / TMP[TOKENS], "wb")  # noqa: SIM115 (its OSError is a StoreWriteError)
        with sink, contextlib.closing(_encoded(chunks, spec, workers, stop, message)) as results:
            for ids, lens, nbytes in results:
                if ids.size:
                    max_id = max(max_id, int(ids.max()))
                data = ids.astype(dtype).tobytes()
                with _writing(out):
                    sink.write(data)
                digest.update(data)
                lengths.append(lens)
                bar.update(nbytes)
            with _writing(out):
                sink.flush()
                os.fsync(sink.fileno())
    finally:
        bar.close()
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    if lengths.size == 0:
        skipped = f" ({counts['empty']} empty ones skipped)" if counts.get("empty") else ""
        raise ValueError(f"input {str(input)!r} holds no documents{skipped}")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    source = {"name": Path(input).name, "fingerprint": fingerprint(input, field), "field": field}
    meta = store_meta(tok, dtype, len(lengths), int(offsets[-1]), max_id, counts.get("empty", 0), source)
    with _writing(out):
        np.save(out / TMP[OFFSETS], offsets)
        meta["checksums"] = {TOKENS: f"sha256:{digest.hexdigest()}", OFFSETS: file_checksum(out / TMP[OFFSETS])}
        (out / TMP[META]).write_text(json.dumps(meta, indent=1))
        if not tok.is_bytes:
            (out / TMP[TOKENIZER]).write_bytes(Path(tok.name).read_bytes())
        stop.check(message)  # the last chance to stop before the store is replaced
        _remove(out, (META, VERIFIED))  # no store until this one is complete
        for name in (TOKENS, OFFSETS, TOKENIZER, META):  # meta.json last
            if (out / TMP[name]).exists():
                os.replace(out / TMP[name], out / name)
