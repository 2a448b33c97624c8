"""The packed-document loader: packing invariants against an independent concatenation of the documents,
determinism by seed, per-host rows, the iterator state's resume, the GPT task's batches, and a kill-and-resume
training run from a store with bit-exact losses."""

import json

import jax
import numpy as np
import pytest

from jaxring.data.loader import DocumentOrder, PackedBatches, StepBatches, held_out, split_documents
from jaxring.data.store import DocumentStore
from jaxring.data.tokenizer import load_tokenizer

EOS = 256
SEQ = 32
B = 4


@pytest.fixture(scope="module")
def store():
    """Documents of lengths 1..90 bytes (some longer than a row), each a distinct repeated letter."""
    rng = np.random.default_rng(0)
    texts = [chr(ord("a") + i % 26) * int(n) for i, n in enumerate(rng.integers(1, 90, size=23))]
    return DocumentStore.from_texts(texts, load_tokenizer("bytes"), "letters")


def batches(store, packing="split", seed=0, batch_size=B, steps=6, **kw):
    ds = PackedBatches(
        store, split_documents(store, "all", 0), batch_size=batch_size, seq_len=SEQ, seed=seed, packing=packing, **kw
    )
    it = iter(ds)
    return [next(it) for _ in range(steps)]


def lane_stream(store, seed, lane, count):
    """The oracle: lane `lane`'s documents (ordinals lane, lane + B, ...) of the documented per-epoch order
    np.random.default_rng([seed, epoch]).permutation, each followed by EOS, concatenated."""
    k, out, i = store.num_docs, [], lane
    while len(out) < count:
        e, j = divmod(i, k)
        d = np.random.default_rng([seed, e]).permutation(k)[j]
        out += [*store.document(d).tolist(), EOS]
        i += B
    return out


def check_row(row):
    """Invariants of one packed row (packing.py's convention)."""
    seg, pos, tok, tgt, mask = (row[k] for k in ("segment_ids", "positions", "tokens", "targets", "loss_mask"))
    real = seg > 0
    assert seg[0] == 1 and np.all(np.diff(seg[real]) >= 0) and np.all(np.diff(seg[real]) <= 1)
    if not real.all():
        assert not real[np.argmin(real) :].any()  # padding only at the end
    starts = np.flatnonzero(np.diff(seg, prepend=0) != 0)
    for a, b in zip(starts, [*starts[1:], len(seg)]):
        if seg[a]:
            np.testing.assert_array_equal(pos[a:b], np.arange(b - a))  # restart at 0 in every document piece
    np.testing.assert_array_equal(tgt[:-1], tok[1:])
    # a counted target never crosses a document: the next input is the same segment, or the row ends
    inner = np.flatnonzero(mask[:-1])
    assert np.all(seg[inner + 1] == seg[inner])
    # an EOS input is never counted (its target is the next document's), every other real input is
    assert np.all(mask[tok == EOS] == 0) and np.all(mask[(tok != EOS) & real] == 1)
    assert np.all(mask[~real] == 0) and np.all(tok[~real] == EOS) and np.all(pos[~real] == 0)


def test_split_packing_is_the_lanes_document_stream(store):
    out = batches(store, "split", seed=3)
    for b in out:
        assert all(v.dtype == np.int32 and v.shape == (B, SEQ) for v in b.values())
        for r in range(B):
            check_row({k: v[r] for k, v in b.items()})
    for lane in range(B):
        stream = lane_stream(store, 3, lane, SEQ * len(out) + 1)
        got = np.concatenate([b["tokens"][lane] for b in out])
        np.testing.assert_array_equal(got, stream[: len(got)])
        np.testing.assert_array_equal(out[-1]["targets"][lane, -1], stream[len(got)])  # the lookahead
    assert (np.concatenate([b["segment_ids"] for b in out]) > 0).all()  # no padding


def test_drop_packing_keeps_whole_documents(store):
    out = batches(store, "drop", seed=3)
    lengths = set(store.lengths().tolist())
    for b in out:
        for r in range(B):
            row = {k: v[r] for k, v in b.items()}
            check_row(row)
            seg = row["segment_ids"]
            for s in range(1, seg.max() + 1):
                piece = row["tokens"][seg == s]
                assert piece[-1] == EOS and EOS not in piece[:-1]  # one whole document + its EOS
                assert len(piece) - 1 in lengths and len(piece) <= SEQ
    # documents that fit are all there, in lane order; longer ones are skipped
    stream = [t for t in lane_stream(store, 3, 0, 10_000)]
    docs, cur = [], []
    for t in stream:
        cur.append(t)
        if t == EOS:
            docs.append(cur) if len(cur) <= SEQ else None
            cur = []
    got = [t for b in out for t in b["tokens"][0][b["segment_ids"][0] > 0].tolist()]
    assert got == [t for d in docs for t in d][: len(got)]


def test_deterministic_by_seed_and_documents_shuffled(store):
    a, b, c = batches(store, seed=1), batches(store, seed=1), batches(store, seed=2)
    for x, y in zip(a, b):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert any(not np.array_equal(x["tokens"], z["tokens"]) for x, z in zip(a, c))
    # every document once per epoch, a new order the next epoch
    order = DocumentOrder(split_documents(store, "all", 0), seed=1)
    k = store.num_docs
    first = [order[i] for i in range(k)]
    second = [order[i] for i in range(k, 2 * k)]
    assert sorted(first) == sorted(second) == sorted(zip(store.offsets[:-1].tolist(), store.lengths().tolist()))
    assert first != second


def test_grain_index_shuffle_order_beyond_the_permutation_limit(store):
    """Splits beyond PERMUTATION_LIMIT documents use grain's index shuffle: each document once per epoch."""
    docs = split_documents(store, "all", 0)
    order = DocumentOrder(docs, seed=5, limit=0)
    k = store.num_docs
    for e in range(2):
        assert sorted(order[i] for i in range(e * k, (e + 1) * k)) == sorted(
            zip(docs[:, 0].tolist(), (docs[:, 1] - docs[:, 0]).tolist())
        )
    assert [order[i] for i in range(k)] == [DocumentOrder(docs, seed=5, limit=0)[i] for i in range(k)]


def test_each_host_reads_its_rows(store):
    whole = batches(store, batch_size=8, steps=3)
    hosts = [batches(store, batch_size=8, steps=3, process_index=h, process_count=2) for h in range(2)]
    for step in range(3):
        for k in whole[step]:
            np.testing.assert_array_equal(np.concatenate([h[step][k] for h in hosts]), whole[step][k])


def test_iterator_state_resumes_exactly(store):
    for packing in ("split", "drop"):
        ds = PackedBatches(store, split_documents(store, "all", 0), batch_size=B, seq_len=SEQ, seed=0, packing=packing)
        it = iter(ds)
        for _ in range(3):
            next(it)
        state = json.loads(json.dumps(it.get_state()))  # as a checkpoint's JSON metadata keeps it
        expected = [next(it) for _ in range(4)]
        fresh = iter(ds)
        fresh.set_state(state)
        for want in expected:
            got = next(fresh)
            for k in want:
                np.testing.assert_array_equal(got[k], want[k])
        # planning only (no token read) reaches the same position
        skipped = iter(ds)
        skipped.skip(3)
        assert skipped.get_state() == state
        other = PackedBatches(store, split_documents(store, "all", 0), batch_size=B, seq_len=SEQ, seed=1)
        with pytest.raises(ValueError, match="the saved data position is for another document stream"):
            iter(other).set_state(state)


def test_step_batches_prefetch_seek_and_restore(store):
    ds = PackedBatches(store, split_documents(store, "all", 0), batch_size=B, seq_len=SEQ, seed=0)
    seq = StepBatches(ds)
    want = [seq.get(s) for s in range(5)]
    assert seq.seeks == 0
    jump = StepBatches(ds, prefetch=0)
    np.testing.assert_array_equal(jump.get(3)["tokens"], want[3]["tokens"])
    assert jump.seeks == 1
    again = StepBatches(ds)
    again.restore(seq_state := StepBatches(ds).state())
    assert seq_state["step"] == 0
    for s in range(5):
        np.testing.assert_array_equal(again.get(s)["tokens"], want[s]["tokens"])
    assert again.seeks == 0
    for b in (seq, jump, again):
        b.close()


def test_held_out_share():
    assert np.flatnonzero(held_out(40, 0.1)).tolist() == [9, 19, 29, 39]
    assert np.flatnonzero(held_out(3, 0.1)).tolist() == [2]  # at least one
    assert not held_out(30, 0.0).any()


# ---- the GPT task and a training run from a store --------------------------------------------------------


def _task(spec, **parallel):
    from jaxring.run.task import model_family

    spec = spec.updated(**parallel).resolved(8)
    return model_family("gpt").task(spec, spec.plan(jax.devices()))


def _natural(task, batch, key):
    perm = task.plan.token_permutation(task.seq_len, True)
    a = np.asarray(jax.device_get(batch[key]))
    out = np.empty_like(a)
    out[:, perm if perm is not None else slice(None)] = a
    return out


def test_gpt_task_batches_on_two_meshes_and_document_fields():
    """The same restored position gives the same global batch on sp=8 (zigzag) and dp=2 x sp=4; the GPT's
    objective takes documents from a store, so the batch holds the document fields, laid out like the tokens."""
    from test_train import BASE

    spec = BASE.updated(seq_len=64, batch_size=4)
    a, b = _task(spec, sp=8, attention="ring", layout="zigzag"), _task(spec, dp=2, sp=4, attention="ring")
    assert a.objective.documents and set(a.batch(0)) == {"tokens", "targets", "positions", "segment_ids", "loss_mask"}
    state = a.data_state()
    for step in range(1, 3):
        a.batch(step)
    b.restore_data_state(json.loads(json.dumps(a.data_state())), 3, print)
    np.testing.assert_array_equal(_natural(a, a.batch(3), "tokens"), _natural(b, b.batch(3), "tokens"))
    assert b.batches.seeks == 0
    assert state["step"] == 1
    c = _task(spec, sp=8, attention="ring", layout="zigzag")
    batch = c.batch(0)
    assert set(batch) == {"tokens", "targets", "positions", "segment_ids", "loss_mask"}
    rows = c.batches.dataset
    want = next(iter(rows))
    for k in batch:
        np.testing.assert_array_equal(_natural(c, batch, k), want[k])  # document positions, permuted


@pytest.mark.heavy
def test_kill_and_resume_from_a_store_is_bit_exact(tmp_path, monkeypatch):
    """4 steps uninterrupted = 2 steps, checkpoint, a new run resumed from it for steps 3-4 (same losses, bit
    for bit); the resumed run continues from the saved data position (it never seeks)."""
    from test_train import run

    from jaxring.data.loader import StepBatches as SB
    from jaxring.data.prepare import prepare
    from jaxring.train.checkpoint import Checkpointer

    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(12):
        (texts / f"{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * (i + 2))
    prepare(texts, tmp_path / "store", progress=False)
    one = dict(devices=jax.devices()[:1], data=str(tmp_path / "store"), seq_len=32, packing="split")
    full = run(steps=4, **one)
    ckpt = str(tmp_path / "ckpt")
    first = run(steps=2, checkpoint_dir=ckpt, **one)
    saved = Checkpointer(ckpt).metadata(2)["data"]
    assert saved["step"] == 2 and len(saved["cursors"]) == 4
    monkeypatch.setattr(SB, "_seek", lambda self, step: pytest.fail(f"the resumed run sought step {step}"))
    resumed = run(steps=4, checkpoint_dir=ckpt, resume=True, **one)
    np.testing.assert_array_equal(first + resumed, full)
