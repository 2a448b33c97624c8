"""Output files and directories written whole or not at all, and checked before the work that fills them.

    check_output_dir("eval", "--out")                    # before scoring: a directory we can write in
    check_free_space("hf", 2**30, "--export-hf", "the export")
    write_atomically("eval/perplexity.json", lambda tmp: ...)   # tmp file beside it, renamed into place
    with staged_directory("hf", replace=True) as tmp:    # a hidden sibling, renamed onto `hf` at the end
        ...

A failure is a one-line ValueError (before the work) or the OSError of the write (after it), and never leaves
an empty or partial file or directory behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

__all__ = ["check_free_space", "check_output_dir", "existing_ancestor", "staged_directory", "write_atomically"]

FREE_SPACE_MARGIN = 1.05  # headers, the index, config.json: a few percent over the tensors' bytes


def existing_ancestor(path: str) -> str:
    """`path` itself if it exists, else its nearest existing parent directory (where it would be created)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _one_line(e: BaseException) -> str:
    return " ".join(str(getattr(e, "strerror", None) or e).split()) or type(e).__name__


def check_output_dir(path: str, flag: str) -> None:
    """ValueError (one line) unless `path` is a directory, or can be created as one, that this process can write
    in: a file there, or a read-only or unwritable parent, is said now, with nothing created. A probe file is
    written in the nearest existing directory and removed (os.access says yes to root on a read-only mount)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} exists and is not a directory; give a directory")
    where = existing_ancestor(path)
    if not os.path.isdir(where):
        raise ValueError(f"{flag} {path!r}: {where!r} is a file, so the directory cannot be created")
    try:
        with tempfile.TemporaryFile(dir=where, prefix=".jaxring-write-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot write in {where!r} ({_one_line(e)})") from None


def check_free_space(path: str, nbytes: int, flag: str, what: str) -> None:
    """ValueError (one line) when the filesystem that would hold `path` has less than `nbytes` (and a margin)
    free."""
    where = existing_ancestor(path)
    free = shutil.disk_usage(where).free
    need = int(nbytes * FREE_SPACE_MARGIN)
    if free < need:
        raise ValueError(
            f"{flag} {path!r}: {what} needs about {_size(need)}, but the filesystem of {where!r} has "
            f"{_size(free)} free; free space or give a directory on another filesystem"
        )


def _size(nbytes: int) -> str:
    """'362 kB', '4.1 GB': bytes in the decimal unit that keeps three significant digits readable."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} bytes"


def write_atomically(path: str, write: Callable[[str], object]) -> None:
    """Calls `write(tmp)` to write a temporary file beside `path`, then renames it onto `path`; on any failure
    the temporary file is removed (an earlier `path` stays as it was) and the error raised."""
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_directory(path: str, replace: bool = False) -> Iterator[str]:
    """Yields a new hidden directory beside `path` to write into; when the block ends it becomes `path` (an empty
    directory there is replaced; a non-empty one only with replace=True, moved aside and removed after the
    rename). On an error or an interrupt the staged directory is removed and `path` is as it was."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    staged = tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".tmp")
    try:
        os.chmod(staged, 0o777 & ~_umask())
        yield staged
        old = None
        if os.path.isdir(path) and os.listdir(path):
            if not replace:
                raise FileExistsError(f"{path!r} is not empty")
            old = tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".old")
            os.replace(path, old)  # onto the empty directory just made
        elif os.path.isdir(path):
            os.rmdir(path)
        try:
            os.replace(staged, path)
        except OSError:
            if old is not None:  # the earlier directory back in its place
                os.replace(old, path)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
