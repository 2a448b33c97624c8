"""python -m jaxring.eval at tiny sizes on 8 simulated devices: the commands run on a ring plan and write JSON of
the expected shape and valid PNGs; a checkpoint's parameters come back as saved; the sharded scores equal
transformers' logits (committed fixture); teacher-forced argmax scoring equals greedy decoding; bad input
ends in one line."""

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FIXTURES

import jaxring
from jaxring.eval import cli, load_model, needle
from jaxring.eval.scoring import token_scores
from jaxring.models import gpt
from jaxring.models.generate import generate
from jaxring.nn import Layers
from jaxring.parallel.plan import ParallelPlan
from jaxring.run.spec import RunSpec
from jaxring.train.checkpoint import Checkpointer
from jaxring.train.trainer import Trainer

pytest.importorskip("matplotlib")

RING = ["--sp", "8", "--attention", "ring", "--layout", "zigzag"]
TINY = {"num_layers": 2, "hidden": 32, "num_heads": 4, "ffn": 64}
FIXTURES = str(FIXTURES / "hf")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def ring_plan() -> ParallelPlan:
    return jaxring.make_plan(sp=8, attention="ring", layout="zigzag")


@pytest.fixture(scope="module")
def trainer():
    return Trainer(RunSpec.of(sp=8, attention="ring", layout="zigzag", seq_len=64, batch_size=1, overrides=TINY))


@pytest.fixture(scope="module")
def checkpoint(trainer, tmp_path_factory):
    """A jaxring checkpoint as train.py saves it (params and optimizer state, the trainer's metadata)."""
    path = str(tmp_path_factory.mktemp("ckpt"))
    with Checkpointer(path, lock=True) as ckpt:
        ckpt.save(3, trainer.state(), metadata=trainer.metadata())
    return path


def run(argv, capsys):
    code = cli.main(argv + ["--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


def check_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC, path
    import matplotlib.pyplot as plt

    assert plt.imread(path).ndim == 3


def test_loaded_parameters_are_the_saved_ones(trainer, checkpoint):
    loaded = load_model(checkpoint, ring_plan())
    assert loaded.config == trainer.task.config and loaded.name.endswith("(step 3)")
    got = nnx.to_pure_dict(nnx.state(loaded.model))
    want = trainer.state()["params"]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)


def test_perplexity_and_needle_commands(checkpoint, tmp_path, capsys):
    out = str(tmp_path / "eval")
    code, text, err = run(["perplexity", checkpoint, "--seq-len", "64", "--batches", "2", "--out", out, *RING], capsys)
    assert code == 0, err
    result = json.loads(pathlib.Path(out, "perplexity.json").read_text())
    assert {"model", "label", "data", "plan", "seq_len", "tokens", "loss", "perplexity", "buckets"} <= set(result)
    assert [(b["start"], b["end"]) for b in result["buckets"]] == [(0, 8), (8, 16), (16, 32), (32, 64)]
    assert sum(b["tokens"] for b in result["buckets"]) == result["tokens"] == 2 * 64
    assert all(np.isfinite(b["loss"]) and b["loss"] > 0 for b in result["buckets"])
    assert "ring" in result["plan"] and "32-64" in text.replace(" ", "")
    check_png(os.path.join(out, "perplexity.png"))

    argv = ["needle", checkpoint, "--lengths", "96", "--depths", "0,0.5,1", "--samples", "2", "--batch-size", "3"]
    argv += ["--out", out, *RING]  # 6 sequences in two batches of 3
    code, text, err = run(argv, capsys)
    assert code == 0, err
    result = json.loads(pathlib.Path(out, "needle.json").read_text())
    assert result["lengths"] == [96] and result["depths"] == [0.0, 0.5, 1.0] and result["samples"] == 2
    assert np.shape(result["accuracy"]) == (1, 3)
    assert len(result["cells"]) == 6 and all(0 <= a <= 1 for a in result["accuracy"][0])
    assert {"length", "depth", "sample", "pass_key", "hit", "answer_loss"} == set(result["cells"][0])
    check_png(os.path.join(out, "needle.png"))


SCORE_PLANS = [
    pytest.param(dict(sp=8, attention="ring", layout="zigzag"), id="ring-zigzag-sp8"),
    pytest.param(
        dict(tp=2, sp=4, attention="ring", tensor_parallel="megatron"),
        id="megatron-tp2-ring-sp4",
        marks=pytest.mark.slow(reason="a second compile of the same path under tensor parallelism"),
    ),
]


@pytest.mark.parametrize("settings", SCORE_PLANS)
def test_sharded_scores_equal_transformers_logits(settings):
    """A Hugging Face directory on a sharded plan: losses and argmax hits from the committed logits."""
    data = dict(np.load(os.path.join(FIXTURES, "llama3", "oracle.npz")))
    plan = jaxring.make_plan(**settings)
    loaded = load_model(os.path.join(FIXTURES, "llama3"), plan)
    losses, hits = token_scores(loaded, plan, data["tokens"], data["targets"])
    logits, targets = data["logits"].astype(np.float64), data["targets"]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    want = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1) - picked
    np.testing.assert_allclose(losses, want, atol=1e-4 * np.abs(logits).max())
    top2 = np.sort(logits, -1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 1e-3  # not a near tie
    np.testing.assert_array_equal(hits[clear], (logits.argmax(-1) == targets)[clear])
    # the scores also say hit where the target is the argmax (the fixture's targets are random: few are)
    argmax_targets = logits.argmax(-1).astype(np.int32)
    _, all_hits = token_scores(loaded, plan, data["tokens"], argmax_targets)
    assert all_hits[clear].all()


def test_teacher_forced_argmax_is_greedy_decoding():
    """needle's scoring rule: greedy decoding reproduces an answer iff every teacher-forced argmax over prompt +
    answer is the answer's token. Oracle: greedy decoding by recomputing the full sequence on one device (the
    argmax of the logits, token by token), which `jaxring.models.generate.generate(temperature=0)` reproduces."""
    cfg = gpt.GPTConfig(vocab_size=64, **TINY)
    model = gpt.GPT(cfg, rngs=nnx.Rngs(0))
    one = ParallelPlan(jaxring.make_mesh(devices=jax.devices()[:1]))
    graphdef, state = nnx.split(model)
    window, prompt_len, new = 32, 12, 8

    @jax.jit
    def next_token(state, tokens, index):
        m = nnx.merge(graphdef, state)
        positions = jnp.arange(window, dtype=jnp.int32)[None]
        return jnp.argmax(m.logits(tokens, positions, one, Layers.of(m.blocks))[0, index])

    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len).tolist()
    ids = list(prompt)
    for _ in range(new):
        tokens = np.zeros((1, window), np.int32)
        tokens[0, : len(ids)] = ids
        ids.append(int(next_token(state, tokens, len(ids) - 1)))
    greedy = ids[prompt_len:]
    assert generate(model, None, [prompt], new, temperature=0) == [greedy]  # the KV-cache decoder agrees

    loaded = jaxring.eval.LoadedModel(model, cfg, jaxring.run.task.model_family("gpt"), None, "tiny")
    answers = [greedy]
    for k in (0, 3, new - 1):  # one wrong token at k: the hits hold before k and fail at k
        wrong = list(greedy)
        wrong[k] = (wrong[k] + 1) % cfg.vocab_size
        answers.append(wrong)
    seqs = np.array([prompt + a for a in answers], np.int32)
    seqs = np.pad(seqs, ((0, 0), (0, window + 1 - seqs.shape[1])))  # the scored window, right-padded
    _, hits = token_scores(loaded, one, seqs[:, :-1], seqs[:, 1:])
    answer_hits = hits[:, prompt_len - 1 : prompt_len - 1 + new]
    assert answer_hits[0].all()  # greedy's own output: exact match
    for row, k in zip(answer_hits[1:], (0, 3, new - 1)):
        assert row[:k].all() and not row[k], (k, row)


def test_needle_sequence_places_the_key():
    tok = jaxring.data.tokenizer.load_tokenizer("bytes")
    for depth in (0.0, 0.5, 1.0):
        ids, n = needle.sequence(tok, 200, depth, 12345)
        text = tok.decode(ids)
        assert len(ids) == 201 and text.endswith("What is the pass key? The pass key is 12345") and n == 6
        at = text.index("The pass key is 12345.")
        assert abs(at / (201 - n - 37 - 35) - depth) < 0.05, (depth, at)


@pytest.fixture(scope="module")
def learned_checkpoint(tmp_path_factory):
    """A GPT with learned positions for 64 tokens, saved as {"params"} only (random init)."""
    cfg = gpt.GPTConfig(vocab_size=256, positions="learned", max_seq_len=64, **TINY)
    params = nnx.to_pure_dict(nnx.state(gpt.GPT(cfg, rngs=nnx.Rngs(0))))
    path = str(tmp_path_factory.mktemp("learned"))
    with Checkpointer(path, lock=True) as ckpt:
        ckpt.save(1, {"params": params}, metadata={"model": {"kind": "gpt", **dataclasses.asdict(cfg)}})
    return path


@pytest.mark.parametrize(
    "argv,message",
    [
        (["needle", "/nonexistent/ckpt", "--lengths", "96"], "checkpoint '/nonexistent/ckpt': no such directory"),
        (["needle", "CKPT", "--lengths", "96", "--depths", "0,1.5"], "--depths 1.5: a needle depth must lie in [0, 1]"),
        (["perplexity", "LEARNED", "--seq-len", "128"], "seq 128 exceeds the learned positions' max_seq_len 64"),
        (["needle", "CKPT", "--lengths", "100", *RING], "seq 100 is not divisible by 2*sp = 16"),
        (["needle", "CKPT", "--lengths", "48"], "--lengths 48: too short for the needle"),
        (["perplexity", "CKPT", "--seq-len", "64", "--step", "7"], "has no step 7; saved steps: [3]"),
    ],
)
def test_bad_input_is_one_line(argv, message, checkpoint, learned_checkpoint, capsys):
    argv = [{"CKPT": checkpoint, "LEARNED": learned_checkpoint}.get(a, a) for a in argv]
    code, _, err = run(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_packed_documents_score_as_each_document_alone():
    """Rows of packed documents (segment ids, positions restarting in each, padding at the end) on the ring
    zigzag sp8 plan: every document's losses and hits equal those of the document alone on one device (the
    per-document oracle); a row of one document without segment ids is left as it was."""
    from jaxring.eval.perplexity import documents_of

    cfg = gpt.GPTConfig(vocab_size=64, **TINY)
    loaded = jaxring.eval.LoadedModel(
        gpt.GPT(cfg, rngs=nnx.Rngs(1)), cfg, jaxring.run.task.model_family("gpt"), None, "t"
    )
    one = ParallelPlan(jaxring.make_mesh(devices=jax.devices()[:1]))
    rng = np.random.default_rng(0)
    docs = [[40, 24], [13, 45, 6]]  # row 1 ends in 6 tokens of padding (segment 0)
    seq = rng.integers(0, cfg.vocab_size, (2, 65)).astype(np.int32)
    seg = np.array([np.repeat(np.arange(1, len(d) + 1), d) for d in docs], np.int32)
    seg[1, -6:] = 0
    pos = np.array([np.concatenate([np.arange(n) for n in d]) for d in docs], np.int32)
    batch = documents_of({"tokens": seq[:, :-1], "targets": seq[:, 1:], "segment_ids": seg, "positions": pos})
    assert "segment_ids" in batch and (batch["positions"] == pos).all()
    losses, hits = token_scores(loaded, ring_plan(), batch["tokens"], batch["targets"], segment_ids=seg, positions=pos)
    for r, lengths in enumerate(docs):
        start = 0
        for i, n in enumerate(lengths):
            if r == 1 and i == 2:
                break  # padding
            # the document's own targets: its next tokens, the last one's target is the row's next token
            alone_loss, alone_hit = token_scores(
                loaded, one, seq[r : r + 1, start : start + n], seq[r : r + 1, start + 1 : start + n + 1]
            )
            np.testing.assert_allclose(losses[r, start : start + n], alone_loss[0], rtol=2e-5, atol=2e-5)
            np.testing.assert_array_equal(hits[r, start : start + n], alone_hit[0])
            start += n
    whole = documents_of(
        {"tokens": seq[:, :-1], "targets": seq[:, 1:], "segment_ids": np.ones_like(seg), "positions": pos}
    )
    assert "segment_ids" not in whole and (whole["positions"] == np.arange(64)).all()
