"""Host-side training data for GPT: token streams and random windows of them (numpy only, no JAX).

Every batch is a pure function of (seed, step): resuming at step k gives exactly the batches an
uninterrupted run would have seen. On a multi-host run each host asks for its own rows of the global
batch (``process_index`` of ``process_count``) and reads only those rows from the corpus.

Token sources (``load_tokens``):
  * ``None``: a bundled corpus that needs no download: a fixed list of the Python standard library's own
    ``.py`` files (byte-level, vocab 256); every 10th file of the list is the held-out "val" split, so
    train and val never share a file.
  * a text file, or a directory of ``.txt``/``.py``/``.md`` files: byte-level, vocab 256; val = last 10%.
  * a nanoGPT-style ``.bin`` (uint16 token ids, read through ``np.memmap``), or a directory holding
    ``train.bin``: vocab 50257 (GPT-2), or the vocab_size stated for it; a larger id is refused (random or
    non-token bytes read as uint16 reach 65535); val = ``val.bin`` beside it if present, else the last 10%.
    An even number of bytes. No tokenizer is bundled: ``decode`` writes the ids as text.

Images for DiT: `image_sources.py`; the checks both share: `source_checks.py`.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from jaxring.data.source_checks import check_hosts, check_regular, check_seed_step, check_split

GPT2_VOCAB = 50257
TEXT_SUFFIXES = (".txt", ".py", ".md")
VAL_FRACTION = 0.1

# The bundled corpus: standard-library modules by path, in a FIXED order (never re-sorted, so the
# held-out files stay the same whichever ones a given Python lacks). Entry i is "val" when i % 10 == 9.
STDLIB_FILES = (
    "abc.py",
    "argparse.py",
    "ast.py",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "codecs.py",
    "collections/__init__.py",
    "colorsys.py",
    "configparser.py",
    "contextlib.py",
    "copy.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "difflib.py",
    "dis.py",
    "enum.py",
    "fnmatch.py",
    "fractions.py",
    "functools.py",
    "getopt.py",
    "gettext.py",
    "glob.py",
    "gzip.py",
    "heapq.py",
    "hmac.py",
    "html/__init__.py",
    "inspect.py",
    "ipaddress.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "keyword.py",
    "linecache.py",
    "locale.py",
    "logging/__init__.py",
    "mimetypes.py",
    "numbers.py",
    "operator.py",
    "optparse.py",
    "os.py",
    "pathlib.py",
    "pickle.py",
    "posixpath.py",
    "pprint.py",
    "queue.py",
    "random.py",
    "re/__init__.py",
    "sched.py",
    "secrets.py",
    "selectors.py",
    "shlex.py",
    "shutil.py",
    "socket.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "timeit.py",
    "tokenize.py",
    "traceback.py",
    "types.py",
    "typing.py",
    "unittest/case.py",
    "urllib/parse.py",
    "uuid.py",
    "warnings.py",
)
STDLIB_VAL_EVERY = 10


def stdlib_files(split: str) -> list[str]:
    """The bundled corpus's file names in `split` (fixed order; before skipping missing files)."""
    check_split(split)
    held_out = [i % STDLIB_VAL_EVERY == STDLIB_VAL_EVERY - 1 for i in range(len(STDLIB_FILES))]
    return [name for name, val in zip(STDLIB_FILES, held_out) if val == (split == "val")]


@dataclasses.dataclass(frozen=True)
class TokenSource:
    """A 1-D token stream.

    tokens: [num_tokens] int32 (byte-level sources) or a uint16 ``np.memmap`` (``.bin`` sources).
    vocab_size: ids are in [0, vocab_size).
    tokenizer: "bytes" (UTF-8 bytes are the ids) or "none" (``.bin`` files: no tokenizer is bundled, so
      ``decode`` writes the ids as space-separated numbers and ``encode`` reads them back).
    files: for text sources, the files concatenated (in order).
    """

    tokens: np.ndarray
    vocab_size: int
    name: str
    split: str
    tokenizer: str
    files: tuple[str, ...] = ()

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.asarray(ids).reshape(-1)
        if self.tokenizer == "bytes":
            if ids.size and (ids.min() < 0 or ids.max() > 255):
                raise ValueError(f"byte-level ids must be in [0, 255], got range [{ids.min()}, {ids.max()}]")
            return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
        return " ".join(str(int(i)) for i in ids)  # no tokenizer bundled: the ids themselves

    def encode(self, text: str) -> np.ndarray:
        if self.tokenizer == "bytes":
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        try:
            ids = np.array([int(t) for t in text.split()], np.int32)
        except ValueError:
            raise ValueError(
                f"{self.name} has no tokenizer (token ids only); encode takes space-separated "
                f"integer ids, got {text[:40]!r}"
            ) from None
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got range [{ids.min()}, {ids.max()}]")
        return ids


def _file_separator(name: str) -> bytes:
    return f"\n\n# ==== {name} ====\n\n".encode()


def _byte_tokens(parts: list[tuple[str, bytes]]) -> np.ndarray:
    """Concatenates files (each preceded by a one-line separator naming it) into int32 byte ids."""
    blob = b"".join(_file_separator(name) + data for name, data in parts)
    return np.frombuffer(blob, np.uint8).astype(np.int32)


def _split_tail(n: int, split: str) -> slice:
    """train = the first 90%, val = the last 10% (at least one token each way)."""
    cut = min(max(round(n * (1 - VAL_FRACTION)), 1), max(n - 1, 1))
    return slice(0, cut) if split == "train" else slice(cut, n)


def _load_stdlib(split: str) -> TokenSource:
    root = Path(sysconfig.get_paths()["stdlib"])
    names = [n for n in stdlib_files(split) if (root / n).is_file()]
    if not names:
        raise FileNotFoundError(
            f"none of the bundled corpus's standard-library files were found under {root}; "
            f"pass a text file, a directory of {'/'.join(TEXT_SUFFIXES)} files or a .bin file"
        )
    tokens = _byte_tokens([(n, (root / n).read_bytes()) for n in names])
    return TokenSource(tokens, 256, f"python-stdlib[{split}]", split, "bytes", tuple(names))


def _load_text(path: Path, split: str) -> TokenSource:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise FileNotFoundError(
                f"directory {str(path)!r} holds no {'/'.join(TEXT_SUFFIXES)} files (nor a "
                f"train.bin); pass a text file, such a directory, or a .bin token file"
            )
        names = [str(p.relative_to(path)) for p in files]
        tokens = _byte_tokens([(n, p.read_bytes()) for n, p in zip(names, files)])
    else:
        names = [path.name]
        tokens = np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32)
    tokens = tokens[_split_tail(len(tokens), split)]
    return TokenSource(tokens, 256, f"{path.name}[{split}]", split, "bytes", tuple(names))


BIN_SCAN_LIMIT = 1 << 29  # token files up to 1 GiB are scanned for their largest id


def _bin_vocab(path: Path, tokens: np.ndarray, stated: int | None, chunk: int = 1 << 24) -> int:
    """A .bin's vocabulary: `stated` (the user's), else 50257 (GPT-2). The file's largest id must be below it:
    uint16 ids of GPT-2 never reach 50257, while random or non-token bytes reach 65535 almost surely, so a larger
    id without a stated vocabulary is refused (one line). Files over BIN_SCAN_LIMIT tokens are not scanned
    (each host reads only its batches; TokenBatches.get checks every batch's ids instead)."""
    vocab = GPT2_VOCAB if stated is None else stated
    if len(tokens) > BIN_SCAN_LIMIT:
        return vocab
    top = max(int(tokens[start : start + chunk].max()) for start in range(0, len(tokens), chunk))
    if top >= vocab and stated is None:
        raise ValueError(
            f"token file {str(path)!r} holds token id {top}, beyond GPT-2's vocabulary of {GPT2_VOCAB} that a .bin "
            f"is read with: if it holds uint16 ids of a larger vocabulary, state it with --override vocab_size=N "
            f"(N > {top}); else it is not a file of uint16 token ids"
        )
    if top >= vocab:
        raise ValueError(f"token file {str(path)!r} holds token id {top}, beyond the vocab_size {vocab} stated for it")
    return vocab


TEXT_SAMPLE_BYTES = 1 << 16  # a .bin's first bytes read to tell text from token ids


def _looks_like_text(data: bytes) -> bool:
    """UTF-8 text without control bytes (but tab, newline, carriage return). uint16 GPT-2 ids hold a NUL or
    another control byte within a few tokens (every id below 256 and most high bytes are one), so a token
    file's first 64 KiB are never text; ASCII text read as uint16 stays below 32,383, inside GPT-2's vocabulary,
    which the vocabulary check therefore admits."""
    if not data or any(b < 0x20 and b not in (9, 10, 13) for b in data) or b"\x7f" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(data) - 3  # only a character cut at the sample's end
    return True


def _check_bin(path: Path) -> None:
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"token file {str(path)!r} is empty (0 bytes): no tokens to train on")
    with open(path, "rb") as f:
        head = f.read(TEXT_SAMPLE_BYTES)
    if _looks_like_text(head):
        raise ValueError(
            f"token file {str(path)!r} holds text, not uint16 token ids (its first {len(head):,} bytes are UTF-8 "
            f"text): a .bin is read as token ids; give the text a .txt name to train on it (tokenized on first use)"
        )
    if size % 2:
        raise ValueError(f"{str(path)!r} has {size} bytes, not a whole number of uint16 tokens")


def _load_bin(path: Path, split: str, vocab_size: int | None) -> TokenSource:
    _check_bin(path)
    val_file = path.with_name("val.bin")
    name = path.name
    if path.name == "train.bin" and val_file.is_file():
        chosen = path if split == "train" else val_file
        _check_bin(chosen)
        tokens = np.memmap(chosen, dtype=np.uint16, mode="r")
        name = chosen.name
    else:
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        tokens = tokens[_split_tail(len(tokens), split)]
    # both splits share one vocabulary, the training file's (its ids checked here, the val file's by the task)
    vocab = _bin_vocab(path, np.memmap(path, dtype=np.uint16, mode="r"), vocab_size)
    return TokenSource(tokens, int(vocab), f"{name}[{split}]", split, "none", (name,))


def load_tokens(path: str | os.PathLike | None, *, split: str = "train", vocab_size: int | None = None) -> TokenSource:
    """The token stream of `split` ("train" or "val") from `path`.

    Args:
      path: None (the bundled standard-library corpus), a text file, a directory of .txt/.py/.md files, a
        nanoGPT-style uint16 ``.bin`` file, or a directory holding ``train.bin`` (see the module docstring).
      split: "train" or "val".
      vocab_size: for ``.bin`` files only, the vocabulary size (default: 50257, GPT-2's; a larger id in the
        file is refused unless a vocab_size above it is given).
    Returns:
      a TokenSource; ``len(source)`` tokens in ``source.tokens``.
    """
    check_split(split)
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
        raise ValueError(f"vocab_size {vocab_size!r} must be a positive integer")
    if path is None:
        return _load_stdlib(split)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"token data {str(path)!r} does not exist; accepted: None (the bundled Python "
            f"standard-library corpus), a text file, a directory of "
            f"{'/'.join(TEXT_SUFFIXES)} files, or a uint16 .bin token file (nanoGPT format)"
        )
    check_regular(p, "token data")
    if p.is_dir() and (p / "train.bin").is_file():
        p = p / "train.bin"
    if p.suffix == ".bin":
        return _load_bin(p, split, vocab_size)
    if vocab_size not in (None, 256):
        raise ValueError(f"vocab_size {vocab_size} given for byte-level text {str(path)!r}, whose vocab is 256")
    return _load_text(p, split)


class TokenBatches:
    """Random windows of seq_len + 1 tokens: batch `step` is a pure function of (seed, step).

    The global batch's row r starts at ``starts[r]``, with ``starts`` drawn from
    ``np.random.default_rng([seed, step])``; host ``process_index`` returns rows
    ``[process_index * local, (process_index + 1) * local)`` (local = batch_size / process_count) and reads
    only those windows, so the hosts' batches concatenate to the one-host batch.
    """

    def __init__(
        self,
        source: TokenSource,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.local_batch_size = check_hosts(batch_size, process_index, process_count)
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len {seq_len!r} must be a positive integer")
        check_seed_step(seed, 0)
        if len(source) < seq_len + 1:
            raise ValueError(
                f"corpus {source.name} has {len(source)} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1} needed for one window of inputs and shifted targets"
            )
        self.source, self.batch_size, self.seq_len, self.seed = source, batch_size, seq_len, seed
        self.process_index, self.process_count = process_index, process_count

    def starts(self, step: int) -> np.ndarray:
        """[batch_size] int64: the window starts of the whole global batch at `step`."""
        check_seed_step(self.seed, step)
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.source) - self.seq_len, size=self.batch_size)

    def get(self, step: int) -> np.ndarray:
        """int32 [batch_size / process_count, seq_len + 1]: inputs = [:, :-1], targets = [:, 1:]."""
        lo = self.process_index * self.local_batch_size
        mine = self.starts(step)[lo : lo + self.local_batch_size]
        rows = np.stack([np.asarray(self.source.tokens[s : s + self.seq_len + 1]) for s in mine]).astype(np.int32)
        if rows.max() >= self.source.vocab_size:
            raise ValueError(
                f"token id {rows.max()} at step {step} is outside {self.source.name}'s vocab_size "
                f"{self.source.vocab_size}; pass load_tokens(..., vocab_size=) large enough"
            )
        return rows
