"""jaxring.models.hf against Hugging Face transformers, through committed fixtures (tools/make_hf_fixtures.py; no torch
here): per family (Llama, Llama 3.1 scaling with the older config.json form, Mistral's sliding window, Qwen2's
biases and tied embeddings, Qwen3's QK-norm, head_dim and YaRN), float32 logits and the gradients of the mean
loss on one device and on several plans; load -> save -> load bit-exact; bad checkpoints as one line."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FIXTURES

import jaxring
from jaxring.models import gpt, hf
from jaxring.models.hf import load as hf_load
from jaxring.parallel.plan import ParallelPlan
from jaxring.train.step import value_and_grad

FIXTURES = str(FIXTURES / "hf")
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")
# CI's default run: one device for the two families no plan below covers alone, and three plans; the rest
# (one device for llama, mistral, qwen2; ulysses sp8 and METP tp4) are `slow` (python -m pytest -m "")
SLOW = pytest.mark.slow
TOL = 1e-4  # max abs error relative to the oracle's scale


def oracle(family):
    return dict(np.load(os.path.join(FIXTURES, family, "oracle.npz")))


def plan_of(devices=1, **settings):
    degrees = {k: settings.pop(k) for k in ("dp", "pp", "tp", "sp") if k in settings}
    mesh = jaxring.make_mesh(devices=jax.devices()[:devices], **degrees)
    return ParallelPlan(mesh, **settings)


def assert_relative(got, want, name):
    scale = float(np.abs(want).max())
    err = float(np.abs(np.asarray(got) - want).max())
    assert err <= TOL * max(scale, 1e-6), f"{name}: max abs error {err:.3g} vs scale {scale:.3g}"


def check_logits(family, plan=None):
    data = oracle(family)
    model, _ = hf.load_pretrained(os.path.join(FIXTURES, family), plan)
    assert_relative(hf.logits(model, data["tokens"], plan), data["logits"], f"{family} logits")


def check_grads(family, plan):
    """Loss and every parameter's gradient of the mean next-token loss vs transformers' autograd."""
    data = oracle(family)
    model, cfg = hf.load_pretrained(os.path.join(FIXTURES, family), plan)
    b, s = data["tokens"].shape
    gpt.check_plan(cfg, plan, b, s)
    (tokens, targets), positions = plan.layout_tokens(data["tokens"], data["targets"], causal=True)
    batch = {"tokens": tokens, "targets": targets, "positions": np.broadcast_to(positions, (b, s)).astype(np.int32)}
    loss, grads = value_and_grad(model, plan, gpt.NextTokenObjective(b, s), batch, jax.random.PRNGKey(0))
    np.testing.assert_allclose(float(loss), float(data["loss"]), rtol=TOL)
    check_grad_tree(family, grads, data)


def check_grad_tree(family, grads, data):
    got = hf.to_hf_tensors(grads)
    want = {k[len("grad/") :]: v for k, v in data.items() if k.startswith("grad/")}
    assert set(got) == set(want), set(got) ^ set(want)
    for name in want:
        assert_relative(got[name], want[name], f"{family} grad {name}")


@pytest.mark.parametrize("family", [f if f in ("llama3", "qwen3") else pytest.param(f, marks=SLOW) for f in FAMILIES])
def test_one_device_matches_transformers(family):
    """Logits, mean loss and its gradients in one compiled program (model.logits on one device, no train step)."""
    from flax import nnx

    from jaxring.nn import Layers

    data = oracle(family)
    model, _ = hf.load_pretrained(os.path.join(FIXTURES, family))
    plan = plan_of()
    graphdef, state = nnx.split(model)
    tokens, targets = data["tokens"], data["targets"]
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)

    def loss_and_logits(params):
        m = nnx.merge(graphdef, params)
        logits = m.logits(tokens, positions, plan, Layers.of(m.blocks))
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return (jax.nn.logsumexp(logits, axis=-1) - picked).mean(), logits

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_and_logits, has_aux=True))(nnx.to_pure_dict(state))
    assert_relative(logits, data["logits"], f"{family} logits")
    np.testing.assert_allclose(float(loss), float(data["loss"]), rtol=TOL)
    check_grad_tree(family, grads, data)


PLANS = {  # each plan with the family whose features it stresses most
    "ring-zigzag-sp8": ("mistral", dict(devices=8, sp=8, attention="ring", layout="zigzag")),
    "ulysses-sp8": ("qwen3", dict(devices=8, sp=8, attention="ulysses")),
    "megatron-tp2-sp4": ("qwen2", dict(devices=8, tp=2, sp=4, attention="ring", tensor_parallel="megatron")),
    "metp-tp4": ("qwen3", dict(devices=8, dp=2, tp=4, tensor_parallel="metp")),
    "pp2-1f1b": ("llama3", dict(devices=2, pp=2, pipeline_schedule="1f1b", microbatches=2)),
}


@pytest.mark.heavy
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=SLOW) if n in ("ulysses-sp8", "metp-tp4") else n for n in PLANS]
)
def test_plans_match_transformers(name):
    family, settings = PLANS[name]
    plan = plan_of(**dict(settings))
    if plan.pp == 1:
        check_logits(family, plan)
    check_grads(family, plan)


@pytest.mark.parametrize(
    "strategy, options",
    [("rsa", {}), ("ulysses", {}), ("wallfacer", {"team_size": 2}), ("allgather", {}), ("usp", {"ulysses_size": 2})],
    ids=["rsa", "ulysses", "wallfacer", "allgather", "usp"],
)
def test_sliding_window_logits_on_every_sequence_strategy(strategy, options):
    """Mistral's window (W = 8 over sp = 8 shards of 4 tokens) through every other sequence strategy (the ring's
    logits and gradients are in test_plans_match_transformers), the forward against transformers."""
    check_logits("mistral", plan_of(devices=8, sp=8, attention=strategy, **options))


@pytest.mark.parametrize(
    "strategy, options",
    [
        ("ulysses", {}),
        pytest.param("rsa", {}, marks=SLOW),
        pytest.param("wallfacer", {"team_size": 2}, marks=SLOW),
        pytest.param("allgather", {}, marks=SLOW),
        pytest.param("usp", {"ulysses_size": 2}, marks=SLOW),
    ],
    ids=["ulysses", "rsa", "wallfacer", "allgather", "usp"],
)
def test_sliding_window_gradients_on_every_sequence_strategy(strategy, options):
    """The loss and every parameter's gradient of Mistral's windowed model (W = 8 over sp = 8 shards of 4 tokens)
    through the other sequence strategies against transformers' autograd (the ring's in the plans above; the
    attention alone, dq/dk/dv against jax.nn, per strategy in test_window.py). Ulysses by default, the rest slow."""
    check_grads("mistral", plan_of(devices=8, sp=8, attention=strategy, **options))


def test_load_save_load_is_bit_exact(tmp_path):
    """Qwen3 (norms, head_dim) written as several shards and read back: every parameter bit-identical, and the
    written tensors are the fixture's own; the tokenizer is copied."""
    src = os.path.join(FIXTURES, "qwen3")
    model, cfg = hf.load_pretrained(src)
    tokenizer = tmp_path / "tokenizer.json"
    _word_tokenizer(tokenizer, 100)
    written = hf.save_pretrained(model, cfg, str(tmp_path / "out"), max_shard_size="40KB", tokenizer=str(tokenizer))
    assert sum(f.endswith(".safetensors") for f in written) > 2 and "tokenizer.json" in written
    again, cfg2 = hf.load_pretrained(str(tmp_path / "out"))
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, nnx_pure(model))), jax.tree.leaves(nnx_pure(again))):
        np.testing.assert_array_equal(a, np.asarray(b))
    from safetensors.numpy import load_file

    original = load_file(os.path.join(src, "model.safetensors"))
    exported = {}
    for f in written:
        if f.endswith(".safetensors"):
            exported.update(load_file(str(tmp_path / "out" / f)))
    assert set(exported) == set(original)
    for name, value in original.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_sharded_load_reads_runs_of_rows_and_keeps_no_file_mapped(monkeypatch):
    """Under ZeRO-3 over 8 devices (each device's block strided across a tensor's columns) with reads cut into
    runs of 1 KB, every parameter equals the one-device load bit for bit, and every memory map of a file was
    closed (benchmarks/hf_loading.py measures the host memory this bounds on the 1B shape)."""
    from safetensors import safe_open

    src = os.path.join(FIXTURES, "qwen3")
    whole, _ = hf.load_pretrained(src)
    opened, closed = [], []

    class Counted:
        def __init__(self, *args, **kwargs):
            self.handle = safe_open(*args, **kwargs)
            opened.append(1)

        def __enter__(self):
            return self.handle.__enter__()

        def __exit__(self, *exc):
            closed.append(1)
            return self.handle.__exit__(*exc)

    monkeypatch.setattr(hf_load, "READ_BYTES", 1024)
    monkeypatch.setattr("safetensors.safe_open", Counted)
    sharded, _ = hf.load_pretrained(src, plan_of(devices=8, dp=8, zero=3))
    tensors = len(hf.CheckpointFiles(src).weight_map)
    assert len(opened) == len(closed) > 4 * 8 * tensors, (len(opened), len(closed))  # many runs, each map closed
    for a, b in zip(jax.tree.leaves(nnx_pure(whole)), jax.tree.leaves(nnx_pure(sharded))):
        assert len(b.sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _tensors(directory) -> dict:
    """{name: (safetensors dtype, numpy array)} of every tensor of a saved directory."""
    from safetensors import safe_open

    out = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(directory, file), framework="numpy") as f:
                out.update({name: (f.get_slice(name).get_dtype(), f.get_tensor(name)) for name in f.keys()})  # noqa: SIM118
    return out


def test_save_in_bfloat16_and_load_again_bit_exact(tmp_path):
    """save_pretrained(..., dtype="bfloat16") writes BF16 tensors (the float32 ones rounded to nearest even, as
    torch's .to(torch.bfloat16)) with dtype/torch_dtype "bfloat16" in config.json; loaded in bfloat16 and saved
    again (its own dtype by default), every tensor is bit-identical."""
    import ml_dtypes
    from safetensors.numpy import load_file

    src = os.path.join(FIXTURES, "qwen3")
    model, cfg = hf.load_pretrained(src)
    first, second = tmp_path / "bf16", tmp_path / "again"
    hf.save_pretrained(model, cfg, str(first), dtype="bfloat16", max_shard_size="40KB")
    config = json.loads((first / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    saved = _tensors(first)
    original = load_file(os.path.join(src, "model.safetensors"))
    assert set(saved) == set(original) and {d for d, _ in saved.values()} == {"BF16"}
    for name, value in original.items():
        want = value.astype(ml_dtypes.bfloat16).view(np.uint16)
        np.testing.assert_array_equal(saved[name][1].view(np.uint16), want, err_msg=name)
    again, cfg2 = hf.load_pretrained(str(first), dtype=jnp.bfloat16)
    assert cfg2 == cfg and {a.dtype for a in jax.tree.leaves(nnx_pure(again))} == {jnp.dtype(jnp.bfloat16)}
    hf.save_pretrained(again, cfg2, str(second), max_shard_size="40KB")
    assert json.loads((second / "config.json").read_text())["torch_dtype"] == "bfloat16"
    resaved = _tensors(second)
    for name, (dtype, value) in saved.items():
        assert resaved[name][0] == dtype
        np.testing.assert_array_equal(resaved[name][1].view(np.uint16), value.view(np.uint16), err_msg=name)
    with pytest.raises(ValueError, match="save_pretrained dtype 'int8': expected one of float32, float16, bfloat16"):
        hf.save_pretrained(model, cfg, str(tmp_path / "no"), dtype="int8")


def nnx_pure(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model))


def test_older_config_form_and_unsupported_architectures():
    """llama3's fixture has the released form (rope_theta + rope_scaling with "type"); both forms agree."""
    cfg = hf.read_config(os.path.join(FIXTURES, "llama3"))
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_positions, cfg.rope_theta) == (
        "llama3",
        8.0,
        16,
        500000.0,
    )
    assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg
    with pytest.raises(hf.CheckpointError, match=r"^config.json: architectures \['GPT2LMHeadModel'\] not supported"):
        hf.config_from_hf({"architectures": ["GPT2LMHeadModel"]})


def _copy(tmp_path, family="llama"):
    dst = tmp_path / family
    shutil.copytree(os.path.join(FIXTURES, family), dst)
    return dst


def _rewrite_weights(path, change):
    from safetensors.numpy import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: os.remove(p / "config.json"), r"config\.json: missing"),
        (lambda p: (p / "config.json").write_text("{"), r"config\.json: not readable JSON"),
        (lambda p: os.remove(p / "model.safetensors"), r"neither model\.safetensors nor"),
        (lambda p: _rewrite_weights(p, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
         r"tensor model\.layers\.1\.mlp\.up_proj\.weight missing"),
        (lambda p: _rewrite_weights(p, lambda t: t.update({"model.norm.weight": np.ones(8, np.float32)})),
         r"model\.safetensors: tensor model\.norm\.weight has shape \[8\]; expected \[64\]"),
        (lambda p: _rewrite_weights(p, lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)})),
         r"model\.safetensors: tensor model\.norm\.weight has dtype I32"),
        (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:1000]),
         r"model\.safetensors: not a readable safetensors file"),
        (lambda p: (p / "config.json").write_text(
            json.dumps({**json.loads((p / "config.json").read_text()), "architectures": ["MixtralForCausalLM"]})),
         r"architectures \['MixtralForCausalLM'\] not supported; expected one of LlamaForCausalLM"),
    ],
    ids=["no-config", "bad-json", "no-weights", "missing-tensor", "wrong-shape", "wrong-dtype", "truncated", "arch"],
)  # fmt: skip
def test_bad_checkpoints_are_one_line(tmp_path, damage, message):
    path = _copy(tmp_path)
    damage(path)
    with pytest.raises(hf.CheckpointError, match=message) as info:
        hf.load_pretrained(str(path))
    assert "\n" not in str(info.value)


@pytest.mark.heavy
def test_train_py_init_from_and_export_hf(tmp_path, capsys):
    """train.py --init-from DIR starts from the checkpoint's weights (one step at lr 1e-6 moves them by less than
    1e-4) with a RoPE override for context extension, and --export-hf writes what load_pretrained reads; an
    override of a shape field is one line naming it."""
    from flax import nnx

    import train as cli

    cfg = gpt.get_config("tiny-llama3", vocab_size=384, num_layers=1)
    src, out = tmp_path / "src", tmp_path / "out"
    hf.save_pretrained(gpt.GPT(cfg, rngs=nnx.Rngs(3)), cfg, str(src))
    common = ["--init-from", str(src), "--steps", "1", "--batch-size", "2", "--seq-len", "32", "--sample-tokens", "0"]
    common += ["--no-progress", "--no-eval-at-end", "--out-dir", str(tmp_path / "run"), "--dp", "2", "--sp", "4"]
    common += ["--attention", "ring"]
    assert cli.main([*common, "--override", "hidden=32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--override hidden=32 contradicts --init-from" in err[0], err
    from jaxring.models.gpt_train import pretrained_config

    assert (
        pretrained_config(str(src), {"hidden": cfg.hidden}, 0).hidden == cfg.hidden
    )  # an equal value is no contradiction
    rc = cli.main([*common, "--lr", "1e-6", "--warmup", "0", "--export-hf", str(out), "--override", "rope_factor=16"])
    assert rc == 0
    assert f"gpt {src}:" in capsys.readouterr().out  # the header names the checkpoint, not the default preset
    before, _ = hf.load_pretrained(str(src))
    after, cfg_after = hf.load_pretrained(str(out))
    assert cfg_after == gpt.dataclasses.replace(cfg, rope_factor=16.0, head_dim=cfg.attn_head_dim)
    a, b = hf.to_hf_tensors(nnx_pure(before)), hf.to_hf_tensors(nnx_pure(after))
    assert set(a) == set(b)
    moved = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert 0 < moved < 1e-4, moved


@pytest.mark.parametrize(
    "preset, billions",
    [("llama3-8b", 8.030), ("llama3.1-8b", 8.030), ("llama3-70b", 70.554), ("mistral-7b", 7.242),
     ("qwen2.5-7b", 7.616), ("qwen3-8b", 8.191)],
)  # fmt: skip
def test_presets_have_the_published_shapes(preset, billions):
    """Parameter counts of the released checkpoints; each preset (and its tiny twin) maps to an HF config and
    back unchanged."""
    cfg = gpt.PRESETS[preset]
    assert round(cfg.num_params() / 1e9, 3) == billions
    twin = {
        "llama3-8b": "tiny-llama3",
        "mistral-7b": "tiny-mistral",
        "qwen2.5-7b": "tiny-qwen2",
        "qwen3-8b": "tiny-qwen3",
    }
    for c in (cfg, gpt.PRESETS.get(twin.get(preset, ""), cfg)):
        back = hf.config_from_hf(hf.config_to_hf(c))
        assert back == gpt.dataclasses.replace(c, head_dim=c.attn_head_dim)


def _word_tokenizer(path, size):
    """A tokenizer.json of `size` ids (word-level, with <|endoftext|>), written to `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def _tiny_hf_dir(tmp_path, tokenizer_size):
    from flax import nnx

    cfg = gpt.get_config("tiny-llama3", vocab_size=384, num_layers=1)
    src = tmp_path / "src"
    hf.save_pretrained(gpt.GPT(cfg, rngs=nnx.Rngs(0)), cfg, str(src))
    _word_tokenizer(src / "tokenizer.json", tokenizer_size)  # written beside: save_pretrained checks its size
    return src


def test_init_from_refuses_data_of_another_tokenizer(tmp_path, capsys):
    """--init-from a directory with its own tokenizer.json, on data tokenized otherwise (the bundled corpus in
    bytes): one line naming both tokenizers, before anything is built."""
    import train as cli

    src = _tiny_hf_dir(tmp_path, 300)
    argv = ["--init-from", str(src), "--steps", "1", "--seq-len", "32", "--no-progress", "--out-dir", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "was tokenized with bytes, not with --init-from" in err[0] and "tokenizer.json (sha256 " in err[0], err
    from jaxring.data.token_data import open_token_data
    from jaxring.models.gpt_train import check_data_tokenizer
    from jaxring.run.spec import RunSpec

    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"text": f"w{i} w{i + 1} w7"}) + "\n" for i in range(2, 40))
    )
    same = open_token_data(RunSpec.of(data=str(tmp_path / "docs.jsonl"), tokenizer=str(src)).data)
    check_data_tokenizer(str(src), same)  # prepared with the checkpoint's own tokenizer: accepted


def test_eval_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path, capsys):
    """A tokenizer.json of 500 ids beside a model of 384: jaxring.eval needle says so in one line."""
    from jaxring.eval import cli

    src = _tiny_hf_dir(tmp_path, 500)
    assert cli.main(["needle", str(src), "--lengths", "96", "--no-progress", "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has a vocabulary of 500, more than the vocab_size 384" in err[0], err


def test_tokenizer_larger_than_the_vocabulary_is_one_line(tmp_path):
    """A tokenizer.json with more ids than config.json's vocab_size: load_pretrained and save_pretrained refuse
    it in one line naming the file and both sizes, before reading or writing any tensor; a smaller one (HF
    checkpoints pad the embedding) loads."""
    path = _copy(tmp_path)
    vocab = hf.read_config(str(path)).vocab_size
    _word_tokenizer(path / "tokenizer.json", vocab - 6)
    model, cfg = hf.load_pretrained(str(path))
    assert model.hf_tokenizer == str(path / "tokenizer.json")
    _word_tokenizer(path / "tokenizer.json", vocab + 1)
    os.remove(path / "model.safetensors")  # the tokenizer is checked first
    message = (
        rf"^{path}/tokenizer\.json: the tokenizer has a vocabulary of {vocab + 1}, more than the vocab_size {vocab}"
    )
    with pytest.raises(hf.CheckpointError, match=message + rf" of {path}/config\.json") as info:
        hf.load_pretrained(str(path))
    assert "\n" not in str(info.value)
    with pytest.raises(hf.CheckpointError, match=message):
        hf.save_pretrained(model, cfg, str(tmp_path / "out"), tokenizer=str(path / "tokenizer.json"))
    assert not (tmp_path / "out").exists()


def test_bpe_tokenizer_end_to_end(tmp_path):
    """A BPE tokenizer trained here with `tokenizers` (nothing downloaded) beside the Llama fixture: loaded with
    the checkpoint, it encodes text (as `tokenizers` itself does) into ids the model scores; save_pretrained
    copies it byte for byte and the export scores them the same."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from jaxring.data.tokenizer import load_tokenizer

    path = _copy(tmp_path)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["the ring passes keys and values around", "long sequences need many devices", "rings of devices"] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=96, special_tokens=["<|endoftext|>", "[UNK]"]))
    tok.save(str(path / "tokenizer.json"))
    model, cfg = hf.load_pretrained(str(path))
    text = load_tokenizer(model.hf_tokenizer)
    ids = text.encode("the rings pass long sequences")
    assert (
        text.vocab_size <= cfg.vocab_size
        and ids.size > 4
        and text.decode(ids).replace(" ", "") == "theringspasslongsequences"
    )
    assert np.all(ids == tok.encode("the rings pass long sequences").ids)
    out = hf.logits(model, ids[None])
    assert out.shape == (1, ids.size, cfg.vocab_size) and np.isfinite(out).all()
    written = hf.save_pretrained(model, cfg, str(tmp_path / "out"))
    assert "tokenizer.json" in written
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    again, _ = hf.load_pretrained(str(tmp_path / "out"))
    np.testing.assert_array_equal(hf.logits(again, ids[None]), out)
