"""Packed documents through the GPT: on every sequence strategy and layout, tensor method and the pipeline, the
loss and every parameter gradient of a batch of packed documents equal the documents computed alone.

The oracle is independent of segment ids: each document piece runs as its own row on one device (its tokens
at positions 0.., the rest of the row after it, which causal attention never lets it see), and the loss is the
sum of its masked token losses over the count of unmasked targets of the whole batch. The distributed run is
`jaxring.train.step.value_and_grad` of `NextTokenObjective(documents=True)`: segment ids, document positions
(RoPE) and the loss mask, laid out by the plan like the tokens.

Default rows (CI): ring zigzag on sp = 8, tp2 × sp4 Megatron (ring), METP tp4 (× dp2), pp2 (1F1B, × dp2 × sp2
ring), the leak test, and the Pallas kernel (interpret mode): the whole model on one device, and the ring on
sp = 8 with packed segment ids (attention level). The other rows are `slow`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close

from jaxring import make_plan
from jaxring.data.packing import check_batch
from jaxring.models.gpt import GPT, GPTConfig, NextTokenObjective
from jaxring.nn import Layers
from jaxring.train.step import TrainStep

BATCH, SEQ, VOCAB, EOS = 4, 64, 64, 63
CFG = GPTConfig(vocab_size=VOCAB, num_layers=2, hidden=32, num_heads=8, ffn=64, norm="rmsnorm", activation="swiglu")
RTOL = 1e-5


def packed_documents(seed: int = 0) -> dict:
    """numpy int32 [BATCH, SEQ] rows in `jaxring.data.packing`'s convention: documents of random lengths
    (1 to SEQ/2 tokens), each followed by EOS, packed in order; the last row ends in padding (segment 0), the
    others cut their last document at the row's end (its last target continues the document)."""
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((BATCH, SEQ), np.int32) for k in ("tokens", "targets", "segment_ids", "positions", "loss_mask")}
    for row in range(BATCH):
        i, seg = 0, 1
        end = SEQ - 9 if row == BATCH - 1 else SEQ  # the last row: padding after its documents
        while i < end:
            doc = rng.integers(0, EOS, size=int(rng.integers(1, SEQ // 2)))
            stream = np.concatenate([doc, [EOS], rng.integers(0, EOS, size=1)])  # + the next document's first id
            n = min(len(doc) + 1, end - i)
            out["tokens"][row, i : i + n] = stream[:n]
            out["targets"][row, i : i + n] = stream[1 : n + 1]
            out["segment_ids"][row, i : i + n] = seg
            out["positions"][row, i : i + n] = np.arange(n)
            out["loss_mask"][row, i : i + n] = 1
            if n == len(doc) + 1:  # the EOS's target is the next document's first id
                out["loss_mask"][row, i + n - 1] = 0
            i, seg = i + n, seg + 1
        out["tokens"][row, i:] = out["targets"][row, i:] = EOS  # padding
    check_batch(out, VOCAB, "the test's batch")
    return out


def pieces(batch: dict) -> list[tuple[int, int, int]]:
    """(row, start, end) of every non-padding segment."""
    found = []
    for row in range(BATCH):
        seg = batch["segment_ids"][row]
        for s in np.unique(seg[seg > 0]):
            where = np.flatnonzero(seg == s)
            found.append((row, int(where[0]), int(where[-1]) + 1))
    return found


def oracle(model: GPT, batch: dict):
    """(loss, grads): every document piece alone on one device, its own row, no segment ids or masks in the
    attention; sum of its unmasked token losses over the batch's unmasked count."""
    rows = pieces(batch)
    tokens, targets, mask = (np.zeros((len(rows), SEQ), np.int32) for _ in range(3))
    for r, (row, a, b) in enumerate(rows):
        tokens[r, : b - a] = batch["tokens"][row, a:b]
        targets[r, : b - a] = batch["targets"][row, a:b]
        mask[r, : b - a] = batch["loss_mask"][row, a:b]
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), tokens.shape)
    one = make_plan(devices=jax.devices()[:1])
    graphdef, state = nnx.split(model)
    count = batch["loss_mask"].sum()

    @jax.jit
    def loss(state):
        m = nnx.merge(graphdef, state)
        losses = m.token_losses(tokens, targets, positions, one, Layers.of(m.blocks))
        return jnp.sum(losses * mask) / count

    value, grads = jax.value_and_grad(loss)(state)
    return value, nnx.to_pure_dict(grads)


@pytest.fixture(scope="module")
def setup():
    model = GPT(CFG, rngs=nnx.Rngs(0))
    batch = packed_documents()
    return model, batch, oracle(model, batch)


def grads_fn(model: GPT, **settings):
    """batch -> (loss, grads) of packed batches on `make_plan(**settings)` (one compile for every batch), each
    batch laid out by the plan like the tokens: the train step's own path (`jaxring.train.step`)."""
    plan = make_plan(**settings)
    state = nnx.state(model)
    step = TrainStep(plan, model, None, NextTokenObjective(BATCH, SEQ, documents=True))
    params = jax.device_put(nnx.to_pure_dict(state), step.shardings(step.param_specs))
    run = step.build_grads()

    def loss_and_grads(batch: dict):
        names = ("tokens", "targets", "positions", "segment_ids", "loss_mask")
        laid_out, _ = plan.layout_tokens(*(batch[k] for k in names), causal=True)
        loss, _, grads = run(params, {k: jnp.asarray(v) for k, v in zip(names, laid_out)}, jax.random.key(0))
        return loss, grads

    return loss_and_grads


def check(got, want):
    (loss, grads), (loss_r, grads_r) = got, want
    assert_close(loss, loss_r, RTOL, "loss")
    flat, flat_r = jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves_with_path(grads_r)
    assert [p for p, _ in flat] == [p for p, _ in flat_r]
    for (path, g), (_, g_r) in zip(flat, flat_r):
        assert_close(g, g_r, RTOL, jax.tree_util.keystr(path))


slow = pytest.mark.slow
MESHES = {
    "sp8-ring-zigzag": dict(sp=8, attention="ring", layout="zigzag"),
    "tp2-sp4-megatron-ring": dict(tp=2, sp=4, attention="ring", tensor_parallel="megatron"),
    "dp2-tp4-metp": dict(dp=2, tp=4, tensor_parallel="metp"),
    "pp2-dp2-sp2-1f1b": dict(pp=2, dp=2, sp=2, attention="ring", microbatches=2),
    "1-device": pytest.param(dict(devices=jax.devices()[:1]), marks=slow),
    "sp8-ring-contiguous": pytest.param(dict(sp=8, attention="ring", layout="contiguous"), marks=slow),
    "sp8-ring-striped": pytest.param(dict(sp=8, attention="ring", layout="striped"), marks=slow),
    "sp8-ulysses": pytest.param(dict(sp=8, attention="ulysses"), marks=slow),
    "sp8-usp": pytest.param(dict(sp=8, attention="usp", ulysses_size=2), marks=slow),
    "sp8-wallfacer": pytest.param(dict(sp=8, attention="wallfacer", team_size=2), marks=slow),
    "sp8-allgather": pytest.param(dict(sp=8, attention="allgather"), marks=slow),
    "sp8-rsa": pytest.param(dict(sp=8, attention="rsa"), marks=slow),
    "dp2-tp4-optimus": pytest.param(dict(dp=2, tp=4, tensor_parallel="optimus"), marks=slow),
    "pp2-sp4-ring": pytest.param(dict(pp=2, sp=4, attention="ring", microbatches=4), marks=slow),
    "pp2-dp2-tp2-gpipe": pytest.param(dict(pp=2, dp=2, tp=2, pipeline_schedule="gpipe", microbatches=2), marks=slow),
}


@pytest.mark.parametrize("settings", list(MESHES.values()), ids=list(MESHES))
def test_packed_documents_equal_each_document_alone(setup, settings):
    model, batch, want = setup
    check(grads_fn(model, **settings)(batch), want)


def test_pallas_kernel_interpret_packed_documents(setup):
    """The Pallas flash kernel (interpret mode) as the attention of the whole model, on one device. (The
    interpreter of jax 0.10 cannot run inside the train step's shard_map with check_vma; the kernel with
    segment ids inside the strategies: tests/unit/parallel/test_ring.py and this file's next test.)"""
    model, batch, want = setup
    check(grads_fn(model, devices=jax.devices()[:1], block_ops="pallas_interpret")(batch), want)


@pytest.mark.parametrize("layout", ["zigzag", pytest.param("striped", marks=pytest.mark.slow)])
def test_pallas_kernel_interpret_ring_with_documents(layout):
    """The ring on sp = 8 with the Pallas kernel (interpreted) as block compute, segment ids of packed
    documents laid out by the layout: the dense reference per document, forward and dq, dk, dv."""
    from helpers import check as check_attention
    from helpers import qkv, with_reference

    from jaxring import make_mesh, sharded_attention

    batch = packed_documents(seed=2)
    seg = jnp.asarray(batch["segment_ids"])
    q, k, v, dout = qkv(3, BATCH, SEQ, 4, 2, 16)
    mesh = make_mesh(sp=8)
    fn = lambda q, k, v: sharded_attention(
        q, k, v, mesh=mesh, causal=True, layout=layout, segment_ids=seg, block_ops="pallas_interpret"
    )
    check_attention(*with_reference(fn, q, k, v, dout, causal=True, segment_ids=seg), rtol=1e-4)


def test_documents_do_not_leak():
    """With learned positions (absolute, unlike RoPE's relative angles, so a wrong position shows): document B's
    loss (the mask keeps only its targets) equals B alone at the start of a row, and does not move when the
    tokens of document A, before it in the same row, change; with one segment per row and row positions it
    does, so the check has teeth. One compile for the four batches."""
    model = GPT(dataclasses.replace(CFG, positions="learned", max_seq_len=SEQ), rngs=nnx.Rngs(1))
    batch = packed_documents(seed=1)
    (row, a, b), (row_b, c, d) = [p for p in pieces(batch) if p[0] == 0][:2]
    assert row == row_b == 0 and b == c
    only_b = dict(batch, loss_mask=np.zeros_like(batch["loss_mask"]))
    only_b["loss_mask"][0, c:d] = batch["loss_mask"][0, c:d]
    changed = {k: v.copy() for k, v in only_b.items()}
    changed["tokens"][0, a : b - 1] = (changed["tokens"][0, a : b - 1] + 7) % EOS  # A's tokens (its EOS kept)
    alone = {k: v.copy() for k, v in only_b.items()}  # row 0: B first, then padding
    for k, fill in (("tokens", EOS), ("targets", EOS), ("segment_ids", 0), ("positions", 0), ("loss_mask", 0)):
        alone[k][0] = fill
        alone[k][0, : d - c] = only_b[k][0, c:d]
    alone["segment_ids"][0, : d - c] = 1
    run = grads_fn(model, sp=8, attention="ring", layout="zigzag")
    loss_b = float(run(only_b)[0])
    assert float(run(alone)[0]) == pytest.approx(loss_b, rel=1e-5)
    assert float(run(changed)[0]) == pytest.approx(loss_b, rel=1e-6)
    rows = np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1))
    whole = lambda bt: dict(bt, segment_ids=np.ones_like(bt["segment_ids"]), positions=rows)
    assert abs(float(run(whole(only_b))[0]) - float(run(whole(changed))[0])) > 1e-4
    assert abs(float(run(whole(only_b))[0]) - loss_b) > 1e-4  # row positions: B's loss is not its own


@slow
def test_mixture_of_experts_packed_documents():
    """MoE blocks (dropless, top-2 of 4, balance and z losses off so the loss is the tokens' alone) on ep2 × sp4
    ring zigzag: the same per-document oracle."""
    cfg = dataclasses.replace(CFG, num_experts=4, experts_per_token=2, aux_loss_weight=0.0, z_loss_weight=0.0)
    model, batch = GPT(cfg, rngs=nnx.Rngs(2)), packed_documents(seed=3)
    check(grads_fn(model, ep=2, sp=4, attention="ring", layout="zigzag")(batch), oracle(model, batch))
