"""Document stores: prepare -> store round trips (bytes and a locally trained BPE tokenizer; text, directories,
.jsonl, .parquet; parallel workers), the tokenizer check, the --data cache, and every bad input as one line."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from jaxring.data.__main__ import main as data_main
from jaxring.data.cache import cache_dir, open_store
from jaxring.data.loader import PackedBatches, split_documents
from jaxring.data.packing import check_batch
from jaxring.data.prepare import prepare
from jaxring.data.store import DocumentStore, bundled_store
from jaxring.data.tokenizer import load_tokenizer

TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld ünïcode ✓\n", "a" * 300, "import os\nprint(os.sep)\n"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A small byte-level BPE tokenizer trained here (nothing downloaded), with <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 20, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def write_corpus(root):
    root.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(TEXTS):
        (root / f"doc{i}.txt").write_text(t, encoding="utf-8")
    (root / "empty.py").write_text("")  # skipped, counted
    (root / "notes.csv").write_text("ignored,suffix\n")
    return root


def test_prepare_round_trip_bytes_and_workers(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    store = prepare(corpus, tmp_path / "one", workers=1, progress=False)
    assert store.num_docs == len(TEXTS) and store.meta["empty_skipped"] == 1
    assert store.tokens.dtype == np.uint16 and store.vocab_size == 257 and store.eos_id == 256
    assert [store.tokenizer.decode(store.document(d)) for d in range(store.num_docs)] == TEXTS
    assert store.offsets.dtype == np.int64 and store.num_tokens == sum(len(t.encode()) for t in TEXTS)
    meta = json.loads((tmp_path / "one" / "meta.json").read_text())
    assert meta["tokenizer"]["hash"] == "bytes" and meta["format"] == 1 and meta["documents"] == 4
    assert meta["max_token_id"] == max(max(t.encode()) for t in TEXTS)
    # two worker processes write the same store
    two = prepare(corpus, tmp_path / "two", workers=2, progress=False)
    np.testing.assert_array_equal(np.asarray(two.tokens), np.asarray(store.tokens))
    np.testing.assert_array_equal(two.offsets, store.offsets)
    # reopened from disk: memory-mapped
    again = DocumentStore.open(tmp_path / "one")
    assert isinstance(again.tokens, np.memmap) and again.identity() == store.identity()


def test_bpe_tokenizer_store_and_refusal(tmp_path, bpe):
    corpus = write_corpus(tmp_path / "corpus")
    store = prepare(corpus, tmp_path / "bpe", tokenizer=bpe, progress=False)
    tok = load_tokenizer(bpe)
    assert store.tokenizer.hash == tok.hash and len(tok.hash) == 64 and store.eos_id == 0
    assert store.vocab_size == tok.vocab_size <= 400 and store.tokens.dtype == np.uint16
    assert store.num_tokens < sum(len(t.encode()) for t in TEXTS)  # merges happened
    assert [store.tokenizer.decode(store.document(d)) for d in range(store.num_docs)] == TEXTS
    assert (tmp_path / "bpe" / "tokenizer.json").read_bytes() == Path(bpe).read_bytes()
    # the same store, refused under another tokenizer: one line naming both hashes
    with pytest.raises(ValueError, match=rf"made with tokenizer {tok.hash}, not --tokenizer bytes \(bytes\)"):
        DocumentStore.open(tmp_path / "bpe", tokenizer="bytes")
    with pytest.raises(ValueError, match=rf"store made with tokenizer {tok.hash}, not bytes"):
        prepare(corpus, tmp_path / "bpe", tokenizer="bytes", progress=False)
    assert DocumentStore.open(tmp_path / "bpe", tokenizer=bpe).num_docs == 4


def test_jsonl_field_and_parquet(tmp_path):
    rows = [{"body": t, "id": i} for i, t in enumerate(TEXTS)] + [{"body": "", "id": 9}]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    store = prepare(path, tmp_path / "j", field="body", progress=False)
    assert [store.tokenizer.decode(store.document(d)) for d in range(store.num_docs)] == TEXTS
    assert store.meta["empty_skipped"] == 1
    pa = pytest.importorskip("pyarrow", reason="pyarrow (the 'parquet' extra) reads .parquet inputs")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": TEXTS, "n": list(range(4))}), tmp_path / "docs.parquet")
    store = prepare(tmp_path / "docs.parquet", tmp_path / "p", progress=False)
    assert [store.tokenizer.decode(store.document(d)) for d in range(store.num_docs)] == TEXTS
    with pytest.raises(ValueError, match=r"docs.parquet' has no column 'body' \(its columns: text, n\)"):
        prepare(tmp_path / "docs.parquet", tmp_path / "p2", field="body", progress=False)


def test_data_cache_beside_a_text_input(tmp_path):
    """--data FILE is prepared once into FILE.jaxring-cache/<tokenizer>/, again only when the file changes."""
    path = tmp_path / "input.txt"
    path.write_text("one document\n" * 50)
    lines = []
    store = open_store(path, log=lines.append)
    cache = cache_dir(path, load_tokenizer("bytes"))
    assert cache == tmp_path / "input.txt.jaxring-cache" / "bytes" and (cache / "meta.json").is_file()
    assert len(lines) == 1 and "preparing" in lines[0] and store.num_docs == 1
    stamp = (cache / "meta.json").stat().st_mtime_ns
    assert open_store(path, log=lines.append).num_tokens == 650 and len(lines) == 1  # reused
    assert (cache / "meta.json").stat().st_mtime_ns == stamp
    path.write_text("another, longer document\n" * 50)
    assert open_store(path, log=lines.append).num_tokens == 1250 and len(lines) == 2  # prepared again
    # a one-document store holds out the last tokens
    train, val = split_documents(store, "train", 0.1), split_documents(store, "val", 0.1)
    assert train.tolist() == [[0, 585]] and val.tolist() == [[585, 650]]


def test_bundled_store_is_the_stdlib_files_as_documents():
    store = bundled_store()
    from jaxring.data.token_sources import STDLIB_FILES, stdlib_files

    assert 40 <= store.num_docs <= len(STDLIB_FILES) and store.vocab_size == 257
    first = store.tokenizer.decode(store.document(0))
    assert first.startswith((Path(os.__file__).parent / STDLIB_FILES[0]).read_text()[:200])
    val = split_documents(store, "val", 0.1)
    assert len(val) == len(stdlib_files("val")) == store.num_docs // 10


# ---- bad input: one line naming the file, line or value ------------------------------------------------


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text, text
    return text


def test_not_a_regular_file(tmp_path):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    with pytest.raises(ValueError) as e:
        prepare(fifo, tmp_path / "out", progress=False)
    assert "pipe.txt' is a FIFO, not a regular file" in one_line(e)
    with pytest.raises(ValueError, match=r"'/dev/zero' is a character device, not a regular file"):
        prepare("/dev/zero", tmp_path / "out", progress=False)
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "d" / "x.jsonl")
    with pytest.raises(ValueError, match=r"x.jsonl' is a FIFO"):
        open_store(tmp_path / "d")
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_not_utf8_empty_and_bad_jsonl(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("ok\nline two caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError) as e:
        prepare(bad, tmp_path / "o1", progress=False)
    assert one_line(e).endswith("latin1.txt' is not UTF-8 text: byte 0xe9 at line 2, column 13")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.txt' is empty \(0 bytes\): no documents"):
        prepare(tmp_path / "empty.txt", tmp_path / "o2", progress=False)
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"content": "x", "id": 2}\n')
    with pytest.raises(ValueError) as e:
        prepare(jsonl, tmp_path / "o3", progress=False)
    assert "d.jsonl' line 2 has no 'text' field (its keys: 'content', 'id'); name the text field with --field" in (
        one_line(e)
    )
    jsonl.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"d.jsonl' line 2: field 'text' is a int, not a string"):
        prepare(jsonl, tmp_path / "o4", progress=False)
    jsonl.write_text('{"text": "fine"}\n\n{"text": "x",\n')
    with pytest.raises(ValueError, match=r"d.jsonl' line 3 is not JSON \("):
        prepare(jsonl, tmp_path / "o5", progress=False)
    jsonl.write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match=r"d.jsonl' holds no documents \(1 empty ones skipped\)"):
        prepare(jsonl, tmp_path / "o6", progress=False)


def test_damaged_store_files(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    prepare(corpus, tmp_path / "s", progress=False)
    offsets = np.load(tmp_path / "s" / "offsets.npy")
    np.save(tmp_path / "s" / "offsets.npy", offsets.astype(np.float64))
    with pytest.raises(ValueError, match=r"offsets.npy' holds float64 \[5\]; document offsets must be int64"):
        DocumentStore.open(tmp_path / "s")
    np.save(tmp_path / "s" / "offsets.npy", offsets)
    with open(tmp_path / "s" / "tokens.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match=r"tokens.bin has \d+ bytes, not the \d+ uint16 tokens"):
        DocumentStore.open(tmp_path / "s")


def test_ids_beyond_the_vocabulary_and_float_segment_ids():
    store = DocumentStore.from_texts(TEXTS, load_tokenizer("bytes"), "texts")
    docs = split_documents(store, "all", 0.0)
    with pytest.raises(ValueError, match=r"token id 256 of texts is beyond the model's vocab_size 200"):
        PackedBatches(store, docs, batch_size=2, seq_len=16, seed=0, vocab_size=200)
    batch = next(iter(PackedBatches(store, docs, batch_size=2, seq_len=16, seed=0)))
    check_batch(batch, 257)
    with pytest.raises(ValueError, match=r"segment_ids are float32 \(e.g. 1.0\); they must be integers"):
        check_batch({**batch, "segment_ids": batch["segment_ids"].astype(np.float32)}, 257)
    with pytest.raises(ValueError, match=r"token id 300 in tokens is outside the model's vocabulary \[0, 257\)"):
        check_batch({**batch, "tokens": np.full_like(batch["tokens"], 300)}, 257)


def test_cli_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    assert data_main(["prepare", str(tmp_path / "bad.txt"), str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "bad.txt' is not UTF-8 text: byte 0xff" in err[0]
    write_corpus(tmp_path / "c")
    assert data_main(["prepare", str(tmp_path / "c"), str(tmp_path / "o"), "--workers", "1", "--no-progress"]) == 0
    assert "4 documents" in capsys.readouterr().out


def test_bad_data_stops_before_any_step(tmp_path):
    """train(...) with a FIFO or a non-UTF-8 file as --data: one-line error while the task is built."""
    from test_train import BASE

    from jaxring.train.loop import train

    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"pipe.txt' is a FIFO"):
        train(BASE.updated(data=str(fifo)), log=lambda *a: None)
    (tmp_path / "x.txt").write_bytes(b"abc\x80")
    with pytest.raises(ValueError, match=r"x.txt' is not UTF-8 text: byte 0x80 at line 1, column 4"):
        train(BASE.updated(data=str(tmp_path / "x.txt")), log=lambda *a: None)
