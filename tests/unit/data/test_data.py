"""Training data: deterministic (seed, step) batches, per-host rows, every source kind, every error."""

import numpy as np
import pytest
from PIL import Image

from jaxring.data.image_sources import ImageBatches, load_images
from jaxring.data.token_sources import STDLIB_FILES, TokenBatches, load_tokens, stdlib_files


@pytest.fixture(scope="module")
def stdlib_train():
    return load_tokens(None)


@pytest.fixture(scope="module")
def digits():
    return load_images(None, image_size=16)


# ---- tokens ----------------------------------------------------------------------------------------


def test_stdlib_corpus_train_val_disjoint(stdlib_train):
    val = load_tokens(None, split="val")
    assert stdlib_train.vocab_size == val.vocab_size == 256
    assert stdlib_train.tokens.dtype == np.int32 and stdlib_train.tokens.ndim == 1
    assert 40 <= len(STDLIB_FILES) <= 80
    assert set(stdlib_train.files).isdisjoint(val.files)
    assert len(stdlib_train.files) >= 40 and len(val.files) >= 4
    assert set(stdlib_train.files) | set(val.files) <= set(STDLIB_FILES)
    assert set(stdlib_files("val")) == set(STDLIB_FILES[9::10])
    assert len(stdlib_train) > 1_000_000 and len(val) > 50_000
    text = stdlib_train.decode(stdlib_train.tokens[:4000])
    assert "# ==== abc.py ====" in text and "def " in text
    np.testing.assert_array_equal(stdlib_train.encode(text), stdlib_train.tokens[:4000])
    assert "argparse.py" in stdlib_train.files


def test_token_batches_deterministic_and_shape(stdlib_train):
    a = TokenBatches(stdlib_train, batch_size=8, seq_len=32, seed=3)
    b = TokenBatches(stdlib_train, batch_size=8, seq_len=32, seed=3)
    x = a.get(5)
    assert x.shape == (8, 33) and x.dtype == np.int32
    np.testing.assert_array_equal(x, b.get(5))  # same (seed, step): same batch
    a.get(6)
    np.testing.assert_array_equal(a.get(5), x)  # independent of call history
    assert not np.array_equal(a.get(6), x)  # another step: another batch
    c = TokenBatches(stdlib_train, batch_size=8, seq_len=32, seed=4)
    assert not np.array_equal(c.get(5), x)  # another seed: another batch
    starts = a.starts(5)
    for row, s in zip(x, starts):  # rows are contiguous corpus windows
        np.testing.assert_array_equal(row, stdlib_train.tokens[s : s + 33])


def test_per_host_rows_concatenate_to_one_host_batch(stdlib_train):
    whole = TokenBatches(stdlib_train, batch_size=8, seq_len=16, seed=1).get(2)
    parts = [
        TokenBatches(stdlib_train, batch_size=8, seq_len=16, seed=1, process_index=i, process_count=4).get(2)
        for i in range(4)
    ]
    assert all(p.shape == (2, 17) for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts), whole)


class ReadCounter:
    """A token array that records which windows were read."""

    def __init__(self, tokens):
        self.tokens, self.reads = tokens, []
        self.shape = tokens.shape

    def __getitem__(self, idx):
        self.reads.append(idx)
        return self.tokens[idx]


def test_each_host_reads_only_its_rows(stdlib_train):
    import dataclasses

    counted = ReadCounter(stdlib_train.tokens)
    src = dataclasses.replace(stdlib_train, tokens=counted)
    batches = TokenBatches(src, batch_size=8, seq_len=16, seed=1, process_index=3, process_count=4)
    batches.get(2)
    assert [r.start for r in counted.reads] == list(batches.starts(2)[6:8])


def test_text_file_and_directory(tmp_path):
    text = "hello, wörld\n" * 100
    f = tmp_path / "a.txt"
    f.write_text(text, encoding="utf-8")
    train, val = load_tokens(f), load_tokens(str(f), split="val")
    raw = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
    np.testing.assert_array_equal(np.concatenate([train.tokens, val.tokens]), raw)  # val = last 10%
    assert len(val) == len(raw) - round(0.9 * len(raw))
    assert train.vocab_size == 256 and train.decode(train.encode("wörld")) == "wörld"
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "b.md").write_text("# title\n")
    (d / "sub" / "c.py").write_text("x = 1\n")
    (d / "skip.bin.bak").write_text("ignored")
    src = load_tokens(d)
    assert src.files == ("b.md", "sub/c.py")
    whole = src.decode(np.concatenate([src.tokens, load_tokens(d, split="val").tokens]))
    assert "# title" in whole and "x = 1" in whole and "# ==== sub/c.py ====" in whole
    batch = TokenBatches(load_tokens(f), batch_size=2, seq_len=8, seed=0).get(0)
    assert batch.shape == (2, 9) and batch.max() < 256


def test_bin_files(tmp_path):
    ids = (np.arange(3000) * 7919 % 50257).astype(np.uint16)
    ids.tofile(tmp_path / "data.bin")
    train, val = load_tokens(tmp_path / "data.bin"), load_tokens(tmp_path / "data.bin", split="val")
    assert isinstance(train.tokens, np.memmap) and train.tokens.dtype == np.uint16
    assert train.vocab_size == 50257 and len(train) == 2700 and len(val) == 300
    np.testing.assert_array_equal(np.concatenate([train.tokens, val.tokens]), ids)
    assert train.decode([1, 50256]) == "1 50256"  # no tokenizer: the ids as text
    np.testing.assert_array_equal(train.encode("1 50256"), [1, 50256])
    with pytest.raises(ValueError, match="has no tokenizer"):
        train.encode("hello")
    x = TokenBatches(train, batch_size=4, seq_len=10, seed=0).get(1)
    assert x.dtype == np.int32 and x.shape == (4, 11)
    # train.bin + val.bin (nanoGPT layout), found from the directory too; a larger id than GPT-2's needs the
    # vocabulary stated (random bytes would otherwise train as ids)
    big = np.array([1, 2, 60000, 3] * 10, np.uint16)
    big.tofile(tmp_path / "train.bin")
    np.arange(20, dtype=np.uint16).tofile(tmp_path / "val.bin")
    for p in (tmp_path / "train.bin", tmp_path):
        with pytest.raises(ValueError, match=r"holds token id 60000, beyond GPT-2's vocabulary of 50257"):
            load_tokens(p)
        tr, va = load_tokens(p, vocab_size=60001), load_tokens(p, split="val", vocab_size=60001)
        assert len(tr) == 40 and tr.vocab_size == 60001
        np.testing.assert_array_equal(va.tokens, np.arange(20))
        assert va.vocab_size == 60001
    with pytest.raises(ValueError, match=r"holds token id 60000, beyond the vocab_size 1000 stated for it"):
        load_tokens(tmp_path, vocab_size=1000)
    (tmp_path / "odd.bin").write_bytes(b"\0\0\0")
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        load_tokens(tmp_path / "odd.bin")


def test_token_errors(tmp_path, stdlib_train):
    with pytest.raises(FileNotFoundError, match=r"'.*nope.txt' does not exist; accepted: None .*\.bin"):
        load_tokens(tmp_path / "nope.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds no .txt/.py/.md files"):
        load_tokens(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"split 'test' must be one of \('train', 'val'\)"):
        load_tokens(None, split="test")
    (tmp_path / "t.txt").write_text("abcdefghij" * 2)
    with pytest.raises(ValueError, match="vocab_size 500 given for byte-level text"):
        load_tokens(tmp_path / "t.txt", vocab_size=500)
    short = load_tokens(tmp_path / "t.txt")  # 18 tokens
    with pytest.raises(ValueError, match=r"has 18 tokens, fewer than seq_len \+ 1 = 33"):
        TokenBatches(short, batch_size=2, seq_len=32, seed=0)
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by process_count 4"):
        TokenBatches(stdlib_train, batch_size=6, seq_len=8, seed=0, process_count=4)
    with pytest.raises(ValueError, match=r"process_index 4 must be in \[0, process_count=4\)"):
        TokenBatches(stdlib_train, batch_size=8, seq_len=8, seed=0, process_index=4, process_count=4)
    with pytest.raises(ValueError, match="batch_size 0 must be a positive integer"):
        TokenBatches(stdlib_train, batch_size=0, seq_len=8, seed=0)
    with pytest.raises(ValueError, match="seq_len 0 must be a positive integer"):
        TokenBatches(stdlib_train, batch_size=2, seq_len=0, seed=0)
    with pytest.raises(ValueError, match="seed -1 must be a non-negative integer"):
        TokenBatches(stdlib_train, batch_size=2, seq_len=8, seed=-1)
    with pytest.raises(ValueError, match="step -2 must be a non-negative integer"):
        TokenBatches(stdlib_train, batch_size=2, seq_len=8, seed=0).get(-2)
    with pytest.raises(ValueError, match=r"byte-level ids must be in \[0, 255\]"):
        stdlib_train.decode([300])


# ---- images ----------------------------------------------------------------------------------------


def test_digits(digits):
    assert digits.images.shape == (1797, 16, 16, 1) and digits.images.dtype == np.float32
    assert digits.labels.shape == (1797,) and digits.labels.dtype == np.int32
    assert digits.num_classes == 10 and set(np.unique(digits.labels)) == set(range(10))
    assert digits.images.min() == -1.0 and digits.images.max() <= 1.0 and digits.images.max() > 0.9
    assert load_images(None, image_size=8).images.shape == (1797, 8, 8, 1)


def test_image_batches_deterministic_epochs_and_hosts(digits):
    b = ImageBatches(digits, batch_size=64, seed=0)
    x, y = b.get(3)
    assert x.shape == (64, 16, 16, 1) and y.shape == (64,)
    x2, y2 = ImageBatches(digits, batch_size=64, seed=0).get(3)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert not np.array_equal(ImageBatches(digits, batch_size=64, seed=1).indices(3), b.indices(3))
    parts = [ImageBatches(digits, batch_size=64, seed=0, process_index=i, process_count=4).get(3) for i in range(4)]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
    small = ImageBatches(digits, batch_size=599, seed=0)  # 3 steps = one epoch of 1797
    epoch = np.concatenate([small.indices(s) for s in range(3)])
    assert sorted(epoch) == list(range(1797))
    with pytest.raises(ValueError, match="batch_size 10 is not divisible by process_count 4"):
        ImageBatches(digits, batch_size=10, seed=0, process_count=4)


def _write_image(path, color, size=(12, 8)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def test_image_folder(tmp_path):
    _write_image(tmp_path / "cls" / "cat" / "a.png", (255, 0, 0))
    _write_image(tmp_path / "cls" / "cat" / "b.jpg", (255, 0, 0))
    _write_image(tmp_path / "cls" / "dog" / "c.PNG", (0, 0, 255))
    src = load_images(tmp_path / "cls", image_size=4)
    assert src.images.shape == (3, 4, 4, 3) and src.num_classes == 2 and src.class_names == ("cat", "dog")
    np.testing.assert_array_equal(src.labels, [0, 0, 1])
    np.testing.assert_allclose(src.images[2, 0, 0], [-1, -1, 1])
    np.testing.assert_allclose(src.images[0, 0, 0], [1, -1, -1], atol=0.02)  # jpg: lossy
    _write_image(tmp_path / "flat" / "x.png", (0, 255, 0))
    flat = load_images(tmp_path / "flat", image_size=5)
    assert flat.images.shape == (1, 5, 5, 3) and flat.num_classes == 1 and list(flat.labels) == [0]
    x, y = ImageBatches(flat, batch_size=2, seed=0).get(0)
    assert x.shape == (2, 5, 5, 3) and list(y) == [0, 0]


def test_image_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"image folder '.*nope' does not exist .*accepted: None"):
        load_images(tmp_path / "nope", image_size=8)
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"'.*empty' holds no .png/.jpg/.jpeg images"):
        load_images(tmp_path / "empty", image_size=8)
    _write_image(tmp_path / "mixed" / "a" / "1.png", (0, 0, 0))
    _write_image(tmp_path / "mixed" / "loose.png", (0, 0, 0))
    with pytest.raises(ValueError, match="mixes class subfolders with loose images"):
        load_images(tmp_path / "mixed", image_size=8)
    with pytest.raises(ValueError, match="image_size 0 must be a positive integer"):
        load_images(None, image_size=0)


def test_damaged_data_files_name_the_file(tmp_path):
    """An empty .bin and a corrupt or truncated image are one-line ValueErrors naming the file."""
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"token file '.*empty.bin' is empty \(0 bytes\)"):
        load_tokens(empty)
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(folder / "good.png")
    good = (folder / "good.png").read_bytes()
    (folder / "cut.png").write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(ValueError, match=r"image '.*cut.png' cannot be read \(.*\); remove or replace it"):
        load_images(folder, image_size=8)
    (folder / "cut.png").write_bytes(b"not an image at all")  # junk with an image suffix
    with pytest.raises(ValueError, match=r"image '.*cut.png' cannot be read"):
        load_images(folder, image_size=8)
