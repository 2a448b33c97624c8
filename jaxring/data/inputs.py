"""The documents of `prepare`'s input, checked as they are read: text files, directories, .jsonl, .parquet.

    for text, done in read_documents("corpus/", field="text", counts=counts): ...

  * a text file (any other suffix): one document, UTF-8.
  * a directory: its .txt/.py/.md/.jsonl/.parquet files (recursively, sorted by path), each read as below;
    empty text files in it are skipped (counted).
  * .jsonl: one document per line, the string in field `field` ("text"); blank lines and empty texts skipped.
  * .parquet (needs pyarrow): one document per row of column `field`.

Bad input is a one-line ValueError naming the file, line or row and the rule, raised as soon as it is read:
a path that is not a regular file (a FIFO, a device), an empty file given alone, bytes that are not UTF-8, a
.jsonl line that is not JSON, is not an object, lacks the field or holds a non-string, a parquet file without
the column.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from jaxring.data.store import META, OFFSETS, TOKENS

__all__ = [
    "INPUT_SUFFIXES",
    "MissingField",
    "check_regular_file",
    "describe_skipped",
    "input_files",
    "read_documents",
    "skipped_files",
]

TEXT_SUFFIXES = (".txt", ".py", ".md")
INPUT_SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")


class MissingField(ValueError):
    """A record without the text field; the message ends naming the flag that sets it (`with_flag`): --field
    (python -m jaxring.data prepare) unless the command's own is another (train.py's --text-field)."""

    def __init__(self, head: str, flag: str = "--field"):
        super().__init__(f"{head} {flag}")
        self.head = head

    def with_flag(self, flag: str) -> MissingField:
        return MissingField(self.head, flag)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_regular_file(path: str | os.PathLike, what: str = "input") -> None:
    """ValueError unless `path` is a regular file (following links): never opens it (a FIFO would block)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist") from None
    if not stat.S_ISREG(mode):
        raise ValueError(
            f"{what} {str(path)!r} is {_kind(mode)}, not a regular file: give a text, .jsonl or .parquet file, or "
            f"a directory of them"
        )


def input_files(path: str | os.PathLike) -> list[Path]:
    """The files `path` stands for: itself (a regular file), or a directory's accepted files, sorted."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"input {str(path)!r} does not exist")
    if not p.is_dir():
        if p.suffix == ".bin":
            raise ValueError(f"input {str(path)!r} is a token file (.bin), not text: train.py --data reads it as is")
        check_regular_file(p)
        return [p]
    parts = [name for name in (TOKENS, OFFSETS) if (p / name).is_file()]
    if parts and not (p / META).is_file():  # a store's files without the meta.json written last
        raise ValueError(
            f"directory {str(path)!r} is a damaged store: it holds {' and '.join(parts)} but no {META}; prepare it "
            f"again (python -m jaxring.data prepare INPUT {path})"
        )
    files = sorted(q for q in p.rglob("*") if q.suffix.lower() in INPUT_SUFFIXES and not q.is_dir())
    for q in files:
        check_regular_file(q)
    if not files:
        raise FileNotFoundError(f"directory {str(path)!r} holds no {'/'.join(INPUT_SUFFIXES)} files{_skipped(p)}")
    return files


def skipped_files(path: str | os.PathLike) -> list[Path]:
    """The files of directory `path` that `input_files` leaves out (not .txt/.py/.md/.jsonl/.parquet), sorted."""
    p = Path(path)
    if not p.is_dir():
        return []
    return sorted(
        q for q in p.rglob("*") if q.is_file() and q.suffix.lower() not in INPUT_SUFFIXES and not q.name.startswith(".")
    )


def _skipped(path: Path) -> str:
    """' (it holds ...)' naming the files left out and why, or ''."""
    skipped = skipped_files(path)
    return f"; {describe_skipped(path, skipped)}" if skipped else ""


def describe_skipped(path: str | os.PathLike, skipped: list[Path] | None = None) -> str:
    """'N files that are no input, skipped: a.bin, b.dat (...)' for directory `path`'s left-out files."""
    p = Path(path)
    skipped = skipped_files(p) if skipped is None else skipped
    names = ", ".join(str(q.relative_to(p)) for q in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
    why = f"only {'/'.join(INPUT_SUFFIXES)} files are read as documents"
    if any(q.suffix == ".bin" for q in skipped):
        why += "; a .bin is token ids: train.py --data FILE.bin reads one as it is"
    return f"{len(skipped)} file{'s' if len(skipped) != 1 else ''} skipped ({names}): {why}"


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(
            f"{where} is not UTF-8 text: byte 0x{data[e.start]:02x} at line {line}, column {column}"
        ) from None


def _read_text(f: Path, alone: bool, counts: dict) -> Iterator[tuple[str, int]]:
    data = f.read_bytes()
    if not data:
        if alone:
            raise ValueError(f"input {str(f)!r} is empty (0 bytes): no documents")
        counts["empty"] = counts.get("empty", 0) + 1
        return
    yield _utf8(data, repr(str(f))), len(data)


def _read_jsonl(f: Path, field: str, alone: bool, counts: dict) -> Iterator[tuple[str, int]]:
    if alone and f.stat().st_size == 0:
        raise ValueError(f"input {str(f)!r} is empty (0 bytes): no documents")
    with open(f, "rb") as lines:
        for number, raw in enumerate(lines, 1):
            where = f"{str(f)!r} line {number}"
            if not raw.strip():
                continue
            try:
                record = json.loads(_utf8(raw, where))
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object with a {field!r} field")
            if field not in record:
                keys = ", ".join(map(repr, list(record)[:6])) or "none"
                raise MissingField(f"{where} has no {field!r} field (its keys: {keys}); name the text field with")
            text = record[field]
            if not isinstance(text, str):
                raise ValueError(f"{where}: field {field!r} is a {type(text).__name__}, not a string")
            if text:
                yield text, len(raw)
            else:
                counts["empty"] = counts.get("empty", 0) + 1


def _read_parquet(f: Path, field: str, counts: dict) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {str(f)!r} needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.ParquetFile(f)
    except Exception as e:
        raise ValueError(f"{str(f)!r} is not a readable parquet file ({' '.join(str(e).split())})") from None
    names = table.schema_arrow.names
    if field not in names:
        raise MissingField(f"{str(f)!r} has no column {field!r} (its columns: {', '.join(names)}); name it with")
    kind = table.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{str(f)!r}: column {field!r} holds {kind}, not strings")
    size, rows, row = f.stat().st_size, max(table.metadata.num_rows, 1), 0
    for batch in table.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                raise ValueError(f"{str(f)!r} row {row}: field {field!r} is null")
            if text:
                yield text, size // rows
            else:
                counts["empty"] = counts.get("empty", 0) + 1


def read_documents(
    path: str | os.PathLike, *, field: str = "text", counts: dict | None = None
) -> Iterator[tuple[str, int]]:
    """Yields (text, bytes read) per document of `path` (see the module docstring); counts["empty"] counts the
    empty documents skipped."""
    counts = {} if counts is None else counts
    files = input_files(path)
    alone = not Path(path).is_dir()
    for f in files:
        suffix = f.suffix.lower()
        if suffix == ".jsonl":
            yield from _read_jsonl(f, field, alone, counts)
        elif suffix == ".parquet":
            yield from _read_parquet(f, field, counts)
        else:
            yield from _read_text(f, alone, counts)
