"""Tokenizers of document stores: the byte-level vocabulary, or a Hugging Face `tokenizer.json`.

    tok = load_tokenizer("bytes")                    # UTF-8 bytes are ids 0..255, EOS = 256 (vocab 257)
    tok = load_tokenizer("path/to/dir_or_tokenizer.json")   # read with the `tokenizers` library
    tok.encode("text") -> int32 [n];  tok.decode(ids) -> str;  tok.hash, tok.vocab_size, tok.eos_id

A tokenizer is known by its hash: "bytes", or the sha256 of its tokenizer.json. A store records it, and a
store is never read with another tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BYTES", "EOS_NAMES", "Tokenizer", "load_tokenizer", "tokenizer_file"]

BYTES = "bytes"
# end-of-document tokens by the names tokenizers give them, in order of preference
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")


class Tokenizer:
    """name: "bytes" or the tokenizer.json path; hash: "bytes" or its sha256; vocab_size (ids are in
    [0, vocab_size)); eos_id: the token between documents."""

    def __init__(self, name: str, hash: str, vocab_size: int, eos_id: int, hf: Any = None):
        self.name, self.hash, self.vocab_size, self.eos_id, self._hf = name, hash, vocab_size, eos_id, hf

    @property
    def is_bytes(self) -> bool:
        return self.hash == BYTES

    def encode(self, text: str) -> np.ndarray:
        """int32 [n] ids of `text` (no EOS added)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if self._hf is None:
            return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]
        return [np.asarray(e.ids, np.int32) for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; the EOS shows as a blank line, ids outside the vocabulary are dropped."""
        runs: list[list[int]] = [[]]
        for i in np.asarray(ids).reshape(-1).tolist():
            if i == self.eos_id:
                runs.append([])
            elif 0 <= i < self.vocab_size:
                runs[-1].append(i)
        return "\n\n".join(self._decode_run(r) for r in runs)

    def _decode_run(self, ids: list[int]) -> str:
        if self._hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=False)

    def describe(self) -> str:
        return "bytes" if self.is_bytes else f"{self.name} (sha256 {self.hash[:12]})"


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json that `spec` (the file, or a directory holding it) names; FileNotFoundError otherwise."""
    p = Path(spec)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"--tokenizer {spec!r}: no tokenizer.json there; give 'bytes', a tokenizer.json file or a directory "
            f"holding one"
        )
    return p


def _eos_id(hf: Any, path: Path) -> int:
    """The tokenizer's end-of-document id: tokenizer_config.json's eos_token beside it, else the first of
    EOS_NAMES it knows."""
    config = path.with_name("tokenizer_config.json")
    names = list(EOS_NAMES)
    if config.is_file():
        try:
            eos = json.loads(config.read_text("utf-8")).get("eos_token")
        except (ValueError, UnicodeDecodeError):
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        i = hf.token_to_id(name)
        if i is not None:
            return int(i)
    raise ValueError(
        f"tokenizer {str(path)!r} has no end-of-document token (none of {', '.join(EOS_NAMES)}, nor an eos_token "
        f"in tokenizer_config.json); add one"
    )


def load_tokenizer(spec: str | None) -> Tokenizer:
    """ "bytes" (or None), or a tokenizer.json / a directory holding one (read with `tokenizers`)."""
    if spec is None or spec == BYTES:
        return Tokenizer(BYTES, BYTES, 257, 256)
    path = tokenizer_file(spec)
    raw = path.read_bytes()
    from tokenizers import Tokenizer as HFTokenizer

    try:
        hf = HFTokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"--tokenizer {str(path)!r} cannot be read ({reason})") from None
    return Tokenizer(
        str(path), hashlib.sha256(raw).hexdigest(), hf.get_vocab_size(with_added_tokens=True), _eos_id(hf, path), hf
    )
