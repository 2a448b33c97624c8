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


def _nearest_seq_len(plan: ParallelPlan, seq_len: int) -> int:
    """The sequence length nearest `seq_len` that the plan splits (the longer one on a tie)."""
    for distance in range(1, seq_len + 1):
        for n in (seq_len + distance, seq_len - distance):
            try:
                plan.check_seq_len(n, causal=True)
            except ValueError:
                continue
            if n > 0:
                return n
    raise AssertionError(f"no sequence length near {seq_len} splits over {plan.describe()}")


class GPTTask:
    """Next-token prediction on a token source, batches laid out by the plan once on the data side."""

    def __init__(self, spec, plan: ParallelPlan):
        t = spec.training
        self.seq_len = t.seq_len or DEFAULT_SEQ_LEN
        self.source = load_tokens(spec.data.data)
        self.source_name = self.source.name
        overrides = dict(spec.model.overrides)
        base = gpt.get_config(spec.model.preset, **overrides)
        derived = {"vocab_size": self.source.vocab_size}
        if base.positions == "learned":
            derived["max_seq_len"] = max(base.max_seq_len, self.seq_len)
        if base.vocab_size > self.source.vocab_size:
            derived.pop("vocab_size")  # keep the preset's (padded) vocabulary
        self.config = gpt.get_config(spec.model.preset, **{**overrides, **derived})
        try:
            plan.check_seq_len(self.seq_len, causal=True)
        except ValueError as e:
            raise ValueError(
                f"--seq-len {self.seq_len}: {e}; e.g. --seq-len {_nearest_seq_len(plan, self.seq_len)}"
            ) from None
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
