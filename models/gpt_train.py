"""The GPT as jaxring trains and plans it: its `ModelFamily` (config, presets, objective, checks) and its
training task (byte-level or token-id corpora, the data-side layout, a generated sample at the end).

Declared to jaxring by the `jaxring.models` entry point `gpt = "models.gpt_train:FAMILY"` (pyproject.toml).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxring.data import TokenBatches, global_array, host_rows, load_tokens, to_one_device
from jaxring.mesh import make_mesh
from jaxring.plan import ParallelPlan
from jaxring.task import ModelFamily
from models import gpt

DEFAULT_SEQ_LEN = 256


class GPTTask:
    """Next-token prediction on a token source, batches laid out by the plan once on the data side."""

    def __init__(self, spec, plan: ParallelPlan):
        t = spec.training
        self.seq_len = t.seq_len or DEFAULT_SEQ_LEN
        self.source = load_tokens(spec.data.data)
        self.source_name = self.source.name
        overrides = dict(spec.model.overrides)
        _check_overrides_fit_the_data(overrides, self.source, self.seq_len)
        base = gpt.get_config(spec.model.preset, **overrides)
        derived = {"vocab_size": self.source.vocab_size}
        if base.positions == "learned":
            derived["max_seq_len"] = max(base.max_seq_len, self.seq_len)
        if base.vocab_size > self.source.vocab_size:
            derived.pop("vocab_size")  # keep the preset's (padded) vocabulary
        self.config = gpt.get_config(spec.model.preset, **{**overrides, **derived})
        gpt.check_plan(self.config, plan, t.batch_size // t.grad_accum, self.seq_len)
        self.objective = gpt.NextTokenObjective(t.batch_size, self.seq_len)
        # the progress bar's MoE metrics (metrics.step_metrics' convention)
        self.progress = ("moe_aux_loss", "load_imbalance", "drop_rate") if self.config.moe is not None else ()
        self.plan, self.spec = plan, spec
        self.sharding = plan.tokens_sharding()
        shape = (t.batch_size, self.seq_len)
        self.row0, row1 = host_rows(self.sharding, shape)
        per_host = row1 - self.row0
        host, hosts = self.row0 // per_host, t.batch_size // per_host
        self.batches = TokenBatches(
            self.source,
            batch_size=t.batch_size,
            seq_len=self.seq_len,
            seed=t.seed,
            process_index=host,
            process_count=hosts,
        )
        self.val_batches = TokenBatches(
            load_tokens(spec.data.data, split="val"),
            batch_size=t.batch_size,
            seq_len=self.seq_len,
            seed=t.seed + 1,
            process_index=host,
            process_count=hosts,
        )

    def model(self, seed: int):
        return gpt.GPT(self.config, rngs=nnx.Rngs(seed))

    def check_validation_data(self) -> None:
        """Every held-out token id inside the model's vocabulary, checked before training (not at the end)."""
        source = self.val_batches.source
        top = max_token_id(source.tokens)
        if top is not None and top >= self.config.vocab_size:
            raise ValueError(
                f"the held-out data {source.name} has token id {top}, outside the vocabulary of {self.config.vocab_size} "
                f"(the training data's); use held-out data of the same tokenizer"
            )

    def metadata(self) -> dict:
        return {"kind": "gpt", **dataclasses.asdict(self.config)}

    def batch(self, step: int, val: bool = False) -> dict:
        rows = (self.val_batches if val else self.batches).get(step)
        (tokens, targets), positions = self.plan.layout_tokens(rows[:, :-1], rows[:, 1:], causal=True)
        positions = np.broadcast_to(positions, tokens.shape)
        shape = (self.spec.training.batch_size, self.seq_len)
        return {
            name: global_array(self.sharding, shape, np.ascontiguousarray(a), self.row0)
            for name, a in (("tokens", tokens), ("targets", targets), ("positions", positions))
        }

    @property
    def tokens_per_step(self) -> int:
        return self.spec.training.batch_size * self.seq_len

    def flops_per_step(self) -> float:
        return self.config.flops_per_token(self.seq_len, causal=True) * self.tokens_per_step

    def finish(self, model, log, out_dir: str) -> dict:
        """A generated sample from the trained model, on one device."""
        del out_dir
        device = jax.devices()[0]
        one = ParallelPlan(make_mesh(devices=[device]))
        graphdef, state = nnx.split(model)
        single = nnx.merge(graphdef, to_one_device(state, device))
        prompt = self.source.encode("def ")
        ids = gpt.generate(
            single,
            one,
            list(prompt),
            self.spec.output.sample_tokens,
            key=jax.random.PRNGKey(0),
            window=min(self.seq_len, 256),
        )
        text = self.source.decode(list(prompt) + ids)
        log(f"--- sample ---\n{text}\n--------------")
        return {"sample": text}


VOCAB_PADDING = 128  # a vocab_size override may pad the data's vocabulary up to a multiple of this


def _check_overrides_fit_the_data(overrides: dict, source, seq_len: int) -> None:
    """A vocab_size override must cover the data's ids and stay within padding of them; a max_seq_len override
    must not exceed the trained sequence length (positions beyond it are never trained)."""
    vocab = overrides.get("vocab_size")
    if isinstance(vocab, int):
        padded = -(-source.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
        if vocab < source.vocab_size:
            raise ValueError(
                f"--override vocab_size={vocab}: the data {source.name} has a vocabulary of {source.vocab_size} "
                f"(token ids up to {source.vocab_size - 1}); leave vocab_size out to take the data's"
            )
        if vocab > padded:
            raise ValueError(
                f"--override vocab_size={vocab}: the data {source.name} has a vocabulary of {source.vocab_size}; "
                f"rows past {padded} (padding to a multiple of {VOCAB_PADDING}) would never be used"
            )
    max_len = overrides.get("max_seq_len")
    if isinstance(max_len, int) and max_len > seq_len:
        raise ValueError(
            f"--override max_seq_len={max_len}: the data is cut into sequences of --seq-len {seq_len}; positions "
            f"past {seq_len} would never be trained (raise --seq-len, or leave max_seq_len out)"
        )


def max_token_id(tokens, chunk: int = 1 << 24) -> int | None:
    """The largest id in a token array (read in chunks: it may be a memory-mapped file), None when empty."""
    if len(tokens) == 0:
        return None
    return max(int(np.asarray(tokens[i : i + chunk]).max()) for i in range(0, len(tokens), chunk))


def _abstract_batch(config, plan: ParallelPlan, batch: int, seq_len: int) -> dict:
    tok = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=plan.tokens_sharding())
    return {"tokens": tok, "targets": tok, "positions": tok}


FAMILY = ModelFamily(
    name="gpt",
    summary="decoder-only Transformer, next-token prediction",
    causal=True,
    config_class=gpt.GPTConfig,
    presets=gpt.PRESETS,
    build=lambda config, rngs: gpt.GPT(config, rngs=rngs),
    objective=lambda config, batch, seq_len: gpt.NextTokenObjective(batch, seq_len),
    check_plan=gpt.check_plan,
    tokens=lambda config, seq_len: seq_len,
    flops_per_step=lambda config, seq_len, batch: config.flops_per_token(seq_len, causal=True) * seq_len * batch,
    abstract_batch=_abstract_batch,
    task=GPTTask,
)
