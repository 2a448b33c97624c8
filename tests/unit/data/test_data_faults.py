"""Data preparation and stores under faults (issue 36, items 3-4): stop signals, dead workers and parents, a
full disk, two runs preparing one input, damaged stores, implausible .bin files, a .bin run's sample.

The preparations that a test interrupts are slowed down in their child processes by a `sitecustomize` module
(SLOW_CHUNK_S seconds per chunk, in the workers too) that also records each tokenizing process's pid.
"""

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT
from test_reliability import SMALL_FLAGS, _env

from jaxring.data import prepare as prepare_module
from jaxring.data.cache import open_store
from jaxring.data.checksums import VERIFIED
from jaxring.data.loader import PackedBatches, split_documents
from jaxring.data.prepare import LOCK, StoreWriteError, prepare
from jaxring.data.store import DocumentStore
from jaxring.data.token_sources import load_tokens

TIMEOUT = 120  # seconds any child process of these tests may run

SITECUSTOMIZE = """
import os, time
if os.environ.get("SLOW_CHUNK_S"):
    from jaxring.data import tokenizer

    encode = tokenizer.Tokenizer.encode_batch

    def slow(self, texts):
        open(os.path.join(os.environ["PIDS_DIR"], str(os.getpid())), "w").close()
        time.sleep(float(os.environ["SLOW_CHUNK_S"]))
        return encode(self, texts)

    tokenizer.Tokenizer.encode_batch = slow
"""


@pytest.fixture
def slow_env(tmp_path):
    """The environment of a child whose tokenizing is slow (0.5 s a chunk); its pids land in tmp_path/pids."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tmp_path / "pids").mkdir()
    env = _env()
    env.update(PYTHONPATH=str(site), SLOW_CHUNK_S="0.5", PIDS_DIR=str(tmp_path / "pids"))
    return env


def corpus(path: Path, megabytes: int = 6) -> Path:
    """A .jsonl of `megabytes` 1 MB-chunks of documents (one chunk per CHUNK_BYTES)."""
    line = json.dumps({"text": "the quick brown fox jumps over the lazy dog. " * 20}) + "\n"
    path.write_text(line * (megabytes * (1 << 20) // len(line)))
    return path


def start_prepare(inp: Path, out: Path, env: dict, workers: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "jaxring.data", "prepare", str(inp), str(out), "--workers", str(workers)]
    return subprocess.Popen(
        [*argv, "--no-progress"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group: a terminal's Ctrl-C reaches it and its workers
    )  # fmt: skip


def wait_for_pids(pids: Path, n: int, proc: subprocess.Popen) -> list[int]:
    """The pids of the first `n` processes that started tokenizing."""
    deadline = time.monotonic() + TIMEOUT
    while len(os.listdir(pids)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the preparation never started tokenizing"
        time.sleep(0.05)
    return [int(p) for p in os.listdir(pids)]


def finish(proc: subprocess.Popen) -> tuple[int, list[str], float]:
    """(exit code, stderr lines, seconds until it exited)."""
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"no exit within {TIMEOUT} s: {proc.communicate()}")
    return proc.returncode, err.strip().splitlines(), time.monotonic() - t0


def leftovers(out: Path) -> list[str]:
    return (
        sorted(p.name for p in out.iterdir() if p.name.endswith((".tmp", ".npy.tmp", ".tmp.npy")))
        if out.exists()
        else []
    )


# ---- item 3: stop signals, dead workers, dead parents -----------------------------------------------------


@pytest.mark.heavy
@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_ends_prepare_in_one_line_and_leaves_nothing(tmp_path, slow_env, workers):
    """Ctrl-C (SIGINT to the process group, workers included): one line, exit 130, no traceback from the
    parent or the workers, no store and no temporary file; a re-run just works."""
    inp, out = corpus(tmp_path / "in.jsonl"), tmp_path / "out"
    proc = start_prepare(inp, out, slow_env, workers)
    wait_for_pids(tmp_path / "pids", workers, proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, err, seconds = finish(proc)
    assert code == 130 and err == [f"SIGINT: interrupted; nothing written to {str(out)!r}"], err
    assert seconds < 5, f"{seconds:.1f} s from SIGINT to exit"
    assert not out.exists()
    store = prepare(inp, out, progress=False)
    assert store.num_docs > 1000 and leftovers(out) == []


@pytest.mark.heavy
def test_sigterm_and_sigkill_of_the_parent(tmp_path, slow_env):
    """SIGTERM to the parent alone: one line, exit 143, no worker traceback. SIGKILL: its tokens.bin.tmp stays,
    the workers exit by themselves, and the next run cleans it up and succeeds."""
    inp, out = corpus(tmp_path / "in.jsonl"), tmp_path / "out"
    proc = start_prepare(inp, out, slow_env, 2)
    wait_for_pids(tmp_path / "pids", 2, proc)
    proc.send_signal(signal.SIGTERM)
    code, err, _ = finish(proc)
    assert code == 143 and err == [f"SIGTERM: interrupted; nothing written to {str(out)!r}"], err
    assert not out.exists()

    for p in (tmp_path / "pids").iterdir():
        p.unlink()
    proc = start_prepare(inp, out, slow_env, 2)
    workers = [p for p in wait_for_pids(tmp_path / "pids", 2, proc) if p != proc.pid]
    proc.send_signal(signal.SIGKILL)
    code, err, _ = finish(proc)
    assert code == -signal.SIGKILL and "Traceback" not in "\n".join(err)
    assert leftovers(out) == ["tokens.bin.tmp"]
    deadline = time.monotonic() + 10
    while any(
        Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2] for p in workers
    ):
        assert time.monotonic() < deadline, "the workers outlived their parent"
        time.sleep(0.1)
    store = prepare(inp, out, progress=False)  # the dead run's files are cleaned up
    assert store.num_docs > 1000 and leftovers(out) == []


def test_a_killed_worker_is_one_line_not_a_hang(tmp_path, slow_env):
    """A pool worker killed (as by the out-of-memory killer): the parent reports it and exits 2."""
    inp, out = corpus(tmp_path / "in.jsonl"), tmp_path / "out"
    proc = start_prepare(inp, out, slow_env, 2)
    victim = next(p for p in wait_for_pids(tmp_path / "pids", 1, proc) if p != proc.pid)
    os.kill(victim, signal.SIGKILL)
    code, err, seconds = finish(proc)
    assert code == 2 and len(err) == 1 and "a tokenizing worker process died" in err[0], err
    assert seconds < 10 and not out.exists()


def _full_disk(monkeypatch):
    """Every write to a store's temporary tokens fails with ENOSPC."""
    real = open

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(prepare_module, "open", lambda *a, **k: Full(real(*a, **k)), raising=False)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, workers):
    _full_disk(monkeypatch)
    inp, out = corpus(tmp_path / "in.jsonl", megabytes=3), tmp_path / "out"
    with pytest.raises(StoreWriteError) as e:
        prepare(inp, out, workers=workers, progress=False)
    assert str(e.value) == f"cannot write the store {str(out)!r} (No space left on device); nothing was written"
    assert e.value.errno == errno.ENOSPC and not out.exists()


def test_two_first_use_preparations_take_turns(tmp_path, slow_env):
    """Two processes preparing one --data input at once: one prepares, the other waits and opens its store."""
    inp = corpus(tmp_path / "in.jsonl", megabytes=2)
    code = (
        "import sys; from jaxring.data.cache import open_store; "
        "s = open_store(sys.argv[1], log=print); print('documents', s.num_docs)"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(inp)], env=slow_env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    said = [o.strip().splitlines() for o, _ in outs]
    assert said[0][-1] == said[1][-1] and said[0][-1].startswith("documents ")
    assert sum(any(line.startswith("preparing") for line in lines) for lines in said) == 1, said
    assert not any(e.strip() for _, e in outs)


def test_the_lock_wait_honours_a_stop_signal(tmp_path):
    """A run waiting for another's preparation stops on SIGINT in one line."""
    inp = corpus(tmp_path / "in.jsonl", megabytes=1)
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process's preparation
    proc = start_prepare(inp, out, _env(), 1)
    try:
        deadline = time.monotonic() + TIMEOUT
        line = proc.stderr.readline()
        assert line.startswith("waiting for another process preparing"), line
        proc.send_signal(signal.SIGINT)
        code, err, _ = finish(proc)
        assert time.monotonic() < deadline
        assert code == 130 and err[-1].startswith("SIGINT: interrupted while waiting for the lock"), err
    finally:
        os.close(fd)


def test_sigint_during_train_py_first_use_preparation(tmp_path, slow_env):
    """train.py --data FILE.jsonl stops within seconds of SIGINT while preparing, saves no step-0 checkpoint."""
    inp, ckpt = corpus(tmp_path / "in.jsonl"), tmp_path / "ckpt"
    argv = [sys.executable, str(ROOT / "train.py"), "--data", str(inp), "--checkpoint-dir", str(ckpt),
            "--steps", "2", "--cpu-devices", "1", "--no-progress", *SMALL_FLAGS]  # fmt: skip
    proc = subprocess.Popen(argv, env=slow_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_pids(tmp_path / "pids", 1, proc)
    proc.send_signal(signal.SIGINT)
    code, err, seconds = finish(proc)
    cache = f"{inp}.jaxring-cache/bytes"
    assert code == 130 and err == [f"SIGINT: interrupted; nothing written to {cache!r}"], err
    assert seconds < 5, f"{seconds:.1f} s from SIGINT to exit"
    assert not Path(cache).parent.exists() and not (ckpt.exists() and any(p.name.isdigit() for p in ckpt.iterdir()))


# ---- item 4: checksums, the vocabulary, .bin files ---------------------------------------------------------


@pytest.fixture
def store_dir(tmp_path):
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"text": f"document {i} " * (i + 3)}) + "\n" for i in range(20))
    )
    prepare(tmp_path / "docs.jsonl", tmp_path / "s", progress=False)
    return tmp_path / "s"


def flip(path: Path, offset: int, bit: int = 1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("file,offset", [("tokens.bin", 101), ("offsets.npy", -8 * 10)])
def test_a_flipped_byte_is_refused_by_its_checksum(store_dir, file, offset):
    flip(store_dir / file, offset)
    with pytest.raises(ValueError) as e:
        DocumentStore.open(store_dir)
    text = str(e.value)
    assert f"store {str(store_dir)!r}: {file} checksum mismatch (sha256:" in text and "\n" not in text
    assert text.endswith("the file changed or is damaged; prepare the data again")


def test_large_stores_are_verified_once_per_version(store_dir, monkeypatch):
    monkeypatch.setattr("jaxring.data.checksums.FULL_VERIFY_BYTES", 0)
    DocumentStore.open(store_dir)
    assert set(json.loads((store_dir / VERIFIED).read_text())) == {"tokens.bin", "offsets.npy"}
    calls = []
    real = prepare_module.file_checksum
    monkeypatch.setattr("jaxring.data.checksums.file_checksum", lambda p: calls.append(p) or real(p))
    DocumentStore.open(store_dir)
    assert calls == []  # verified before, unchanged since
    flip(store_dir / "tokens.bin", 7)
    with pytest.raises(ValueError, match=r"tokens\.bin checksum mismatch"):
        DocumentStore.open(store_dir)


def test_a_store_without_checksums_opens_with_a_note(store_dir):
    meta = json.loads((store_dir / "meta.json").read_text())
    del meta["checksums"]
    (store_dir / "meta.json").write_text(json.dumps(meta))
    notes = []
    assert DocumentStore.open(store_dir, log=notes.append).num_docs == 20
    assert notes == [f"note: store {str(store_dir)!r} has no checksums (made by an older jaxring): not verified"]


def test_a_damaged_training_store_stops_at_the_batch_not_as_divergence(store_dir):
    """A flipped high byte in an unchecked (older) store: the batch holding it is refused in one line."""
    meta = json.loads((store_dir / "meta.json").read_text())
    del meta["checksums"]
    (store_dir / "meta.json").write_text(json.dumps(meta))
    tokens = np.fromfile(store_dir / "tokens.bin", np.uint16)
    tokens[:] = tokens.clip(max=200)
    tokens[5] = 40000
    tokens.tofile(store_dir / "tokens.bin")
    store = DocumentStore.open(store_dir)
    ds = PackedBatches(store, split_documents(store, "all", 0), batch_size=2, seq_len=64, seed=0, vocab_size=384)
    with pytest.raises(ValueError) as e:
        for _ in zip(range(50), ds):
            pass
    assert "token id 40000 in batch" in str(e.value) and "the store's tokens are damaged" in str(e.value)


def test_random_bytes_as_a_bin_are_refused(tmp_path):
    """Random bytes read as uint16 reach ids a GPT-2 .bin never holds; a stated vocabulary admits them."""
    data = np.random.default_rng(0).integers(0, 256, 20000, np.uint8).tobytes()
    (tmp_path / "random.bin").write_bytes(data)
    with pytest.raises(ValueError) as e:
        load_tokens(tmp_path / "random.bin")
    top = int(np.frombuffer(data, np.uint16).max())
    assert f"holds token id {top}, beyond GPT-2's vocabulary of 50257" in str(e.value)
    assert f"--override vocab_size=N (N > {top})" in str(e.value)
    assert load_tokens(tmp_path / "random.bin", vocab_size=65536).vocab_size == 65536
    with pytest.raises(ValueError, match=rf"holds token id {top}, beyond the vocab_size 60000 stated for it"):
        load_tokens(tmp_path / "random.bin", vocab_size=60000)


def test_a_bin_run_notes_that_it_has_no_sample(tmp_path, capsys):
    """A nanoGPT .bin has no tokenizer: the run says at the start it writes no sample, and ends fine."""
    from test_faults import _run

    ids = (np.arange(4000) * 7919 % 50257).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    small = {"num_layers": 1, "hidden": 32, "num_heads": 4}
    history, lines = _run(data=str(tmp_path / "train.bin"), steps=1, sample_tokens=8, overrides=small)
    out = capsys.readouterr().out
    assert len(history) == 1
    assert f"note: --data {tmp_path / 'train.bin'} is token ids with no tokenizer: no text sample" in out
    assert not any("sampling" in str(line) for line in lines)


def test_open_store_cache_is_reused_by_a_second_opener(tmp_path):
    """The cache is no longer removed before a preparation: a reader of the old store keeps a whole store."""
    inp = tmp_path / "in.txt"
    inp.write_text("one document\n" * 50)
    first = open_store(inp)
    inp.write_text("another document\n" * 50)
    second = open_store(inp)
    assert first.num_tokens == 650 and second.num_tokens == 850
    assert bytes(np.asarray(first.tokens[:3]).astype(np.uint8)) == b"one"  # still readable


def test_prepare_in_a_thread_is_not_stoppable_but_works(tmp_path):
    """Outside the main thread no handler is installed; preparation still works."""
    inp = corpus(tmp_path / "in.jsonl", megabytes=1)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("s", prepare(inp, tmp_path / "o", progress=False)))
    t.start()
    t.join(TIMEOUT)
    assert result["s"].num_docs > 100
