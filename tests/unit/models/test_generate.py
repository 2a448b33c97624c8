"""KV-cache generation (models/generate.py, jaxring/inference): greedy tokens equal those of recomputing the
whole sequence every step (fp32; the oracle is the model's full forward on one device, argmax of the last
row), for a batch of prompts of different lengths, on one device and on sp = 8 plans (ring zigzag, ulysses,
Megatron tp2 × sp4), with GQA and a sliding window (tiny-mistral, prompts longer than the window); the
prefill's cache is the one-device cache in the plan's layout; the decode step's per-device cache is 1/sp of
the one-device cache in the compiled program; sampling rules; bad input as one line."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxring
from jaxring.models import gpt
from jaxring.models.generate import Decoder, generate
from jaxring.nn import Layers
from jaxring.nn.inference import sample
from jaxring.parallel.plan import ParallelPlan

SLOW = pytest.mark.slow
NEW = 6  # tokens generated per prompt
PLANS = {
    "one": None,
    "ring-zigzag-sp8": dict(sp=8, attention="ring", layout="zigzag"),
    "ulysses-sp8": dict(sp=8, attention="ulysses"),
    "megatron-tp2-sp4": dict(sp=4, tp=2, attention="ring", tensor_parallel="megatron"),
    "ring-striped-sp8": dict(sp=8, attention="ring", layout="striped"),
}


def plan_of(name):
    settings = PLANS[name]
    if settings is None:
        return None
    settings = dict(settings)
    degrees = {k: settings.pop(k) for k in ("tp", "sp") if k in settings}
    return ParallelPlan(jaxring.make_mesh(**degrees), **settings)


@functools.cache
def model_of(preset):
    overrides = {"num_layers": 2, "hidden": 64, "ffn": 128} if preset == "tiny" else {}
    return gpt.GPT(gpt.get_config(preset, **overrides), rngs=nnx.Rngs(0))


@functools.cache
def decoder_of(preset, plan_name):
    return Decoder(model_of(preset), plan_of(plan_name))


def prompts_of(seed=0):
    """Two prompts of different lengths; the longer passes tiny-mistral's window of 16."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 19).tolist(), rng.integers(0, 256, 7).tolist()]


@functools.cache
def _full_logits(preset):
    model = model_of(preset)
    graphdef, state = nnx.split(model)
    one = ParallelPlan(jaxring.make_mesh(devices=jax.devices()[:1]))

    @jax.jit
    def logits(state, tokens):
        m = nnx.merge(graphdef, state)
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        return m.logits(tokens, positions, one, Layers.of(m.blocks))

    return lambda tokens: np.asarray(logits(state, tokens))


def recompute_greedy(preset, prompts, new):
    """The oracle: every step, the whole sequence through the full forward (no cache); argmax of its last row.
    Sequences right-padded to one length (causal: the padding after a row's last token does not change it)."""
    logits = _full_logits(preset)
    seqs = [list(p) for p in prompts]
    width = max(map(len, seqs)) + new
    for _ in range(new):
        tokens = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = s
        out = logits(tokens)
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(out[i, len(s) - 1])))
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


@pytest.mark.heavy
@pytest.mark.parametrize(
    "preset, plan_name",
    [
        ("tiny", "one"),
        ("tiny", "ring-zigzag-sp8"),
        ("tiny", "ulysses-sp8"),
        ("tiny-mistral", "megatron-tp2-sp4"),  # GQA (2 kv heads, one per tp rank) and the sliding window
        pytest.param("tiny", "megatron-tp2-sp4", marks=SLOW),
        pytest.param("tiny", "ring-striped-sp8", marks=SLOW),
        pytest.param("tiny-mistral", "one", marks=SLOW),
        pytest.param("tiny-mistral", "ring-zigzag-sp8", marks=SLOW),
        pytest.param("tiny-qwen3", "ring-zigzag-sp8", marks=SLOW),  # QK-norm, head_dim != hidden / heads
        pytest.param("tiny-llama3", "megatron-tp2-sp4", marks=SLOW),  # llama3 RoPE scaling
    ],
)
def test_greedy_decoding_equals_recomputing_the_sequence(preset, plan_name):
    prompts = prompts_of()
    decoder = decoder_of(preset, plan_name)
    got = generate(model_of(preset), decoder.plan, prompts, NEW, temperature=0, decoder=decoder)
    assert got == recompute_greedy(preset, prompts, NEW)


def test_prefill_cache_is_the_one_device_cache_in_the_plan_layout():
    """The sp = 8 zigzag cache, gathered, is the one-device cache with its slots in the zigzag order; each
    device holds 1/8 of it."""
    tokens = np.zeros((2, 32), np.int32)
    tokens[:] = np.arange(32) % 256
    k1, v1 = decoder_of("tiny", "one").prefill(tokens)
    decoder = decoder_of("tiny", "ring-zigzag-sp8")
    k8, v8 = decoder.prefill(tokens)
    perm = decoder.plan.token_permutation(32)
    np.testing.assert_array_equal(np.asarray(decoder.cache_positions(32)), perm)
    for got, want in ((k8, k1), (v8, v1)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want)[:, :, perm], atol=2e-5, rtol=2e-5)
        assert got.addressable_shards[0].data.shape == (2, 2, 4, 8, 8)  # [layers, b, 32/8, kv heads, d]


def _decode_step_argument_bytes(decoder, batch, length):
    compiled = decoder.step.lower(*decoder.abstract_step_inputs(batch, length)).compile()
    return compiled.memory_analysis().argument_size_in_bytes


def test_decode_step_holds_one_sp_th_of_the_cache_per_device():
    """From the compiled decode steps: per-device arguments on sp = 8 are the one-device arguments less 7/8 of
    the K and V caches (and of the slots' positions); the weights are the same."""
    batch, length = 2, 256
    one, sp8 = decoder_of("tiny", "one"), decoder_of("tiny", "ring-zigzag-sp8")
    cache_bytes = 2 * 4 * int(np.prod(one.cache_shape(batch, length)))  # K and V, fp32
    slots_bytes = 4 * length
    whole = _decode_step_argument_bytes(one, batch, length)
    split = _decode_step_argument_bytes(sp8, batch, length)
    assert whole - split == (cache_bytes + slots_bytes) * 7 // 8, (whole, split, cache_bytes)
    assert split < whole - cache_bytes // 2


def test_sampling_rules_on_the_model():
    """top_k = 1 and a tiny top_p are greedy at any temperature; a seeded sample is reproducible."""
    decoder = decoder_of("tiny", "one")
    model, prompts = model_of("tiny"), prompts_of(1)
    run = functools.partial(generate, model, None, prompts, 5, decoder=decoder)
    greedy = run(temperature=0)
    assert run(temperature=1.5, top_k=1, key=jax.random.PRNGKey(3)) == greedy
    assert run(temperature=1.5, top_p=1e-6, key=jax.random.PRNGKey(4)) == greedy
    a = run(temperature=1.0, top_k=50, top_p=0.9, key=jax.random.PRNGKey(5))
    assert a == run(temperature=1.0, top_k=50, top_p=0.9, key=jax.random.PRNGKey(5))
    assert all(len(row) == 5 for row in a)


def test_sample_keeps_to_top_k_and_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    key = jax.random.PRNGKey(0)
    drawn = np.asarray(sample(logits, key, temperature=1.0, top_k=2))
    assert set(drawn.tolist()) == {0, 1}
    drawn = np.asarray(sample(logits, key, temperature=1.0, top_p=0.7))  # 0.5 < 0.7 <= 0.8: tokens 0, 1
    assert set(drawn.tolist()) == {0, 1}
    assert abs((drawn == 0).mean() - 0.5 / 0.8) < 0.05
    drawn = np.asarray(sample(logits, key, temperature=1.0))
    assert set(drawn.tolist()) == {0, 1, 2, 3}
    assert np.asarray(sample(logits[:1], key, temperature=0)).tolist() == [0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompts=[]), "prompts must be a non-empty list"),
        (dict(prompts=[[1, 2], []]), "prompt 1 must be a non-empty list"),
        (dict(prompts=[[1, 300]]), "prompt 0: token ids must be integers in [0, vocab_size = 256)"),
        (dict(temperature=-1.0), "temperature -1.0 must be a number >= 0"),
        (dict(top_k=0), "top_k 0 must be a positive integer"),
        (dict(top_p=1.5), "top_p 1.5 must be a number in (0, 1]"),
        (dict(max_new_tokens=-2), "max_new_tokens -2 must be an integer >= 0"),
    ],
)
def test_bad_input_is_one_line(kwargs, message):
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=2) | kwargs
    with pytest.raises(ValueError) as err:
        generate(model_of("tiny"), None, args.pop("prompts"), args.pop("max_new_tokens"), **args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_plans_the_decoder_cannot_run_are_refused():
    plan = ParallelPlan(jaxring.make_mesh(tp=4, devices=jax.devices()[:4]), tensor_parallel="optimus")
    with pytest.raises(ValueError, match="generate decodes with tensor parallelism none, megatron; got 'optimus'"):
        generate(model_of("tiny"), plan, [[1, 2]], 2)


def test_stop_tokens_end_each_prompt_at_its_first_stop():
    """A prompt's list ends with the first stop id it produces (the greedy ids are the oracle); decoding ends
    once every prompt has stopped (counted decode steps); a prompt that never produces one runs to the end."""
    decoder = decoder_of("tiny", "one")
    model, prompts = model_of("tiny"), prompts_of(2)
    full = generate(model, None, prompts, 8, temperature=0, decoder=decoder)
    stops = [full[0][2], full[1][4]]  # each prompt stops by its 3rd and 5th new id at the latest
    first = [min(j + 1 for j, t in enumerate(row) if t in stops) for row in full]
    calls = []
    step = decoder.step

    class Counting:  # the decoder with its step counted
        def __getattr__(self, name):
            return getattr(decoder, name)

        def step(self, *args):
            calls.append(1)
            return step(*args)

    got = generate(model, None, prompts, 8, temperature=0, decoder=Counting(), stop_tokens=stops)
    assert got == [row[:n] for row, n in zip(full, first)], (got, full, stops)
    assert len(calls) == max(first) < 8, (len(calls), first)
    assert generate(model, None, prompts, 8, temperature=0, decoder=decoder, stop_tokens=full[0][0])[0] == full[0][:1]
    with pytest.raises(ValueError, match=r"stop_tokens \[256\] must be token ids .* vocab_size = 256\)"):
        generate(model, None, prompts, 2, temperature=0, decoder=decoder, stop_tokens=[256])
