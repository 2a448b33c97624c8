"""The GPT as jaxring trains and plans it: its `ModelFamily` (config, presets, objective, checks) and its
training task (packed documents of a store, or a .bin's windows; the data-side layout; a sample at the end).

Declared to jaxring by the `jaxring.models` entry point `gpt = "jaxring.models.gpt_train:FAMILY"` (pyproject.toml).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxring.core.mesh import make_mesh
from jaxring.data.hosts import global_array, host_rows, to_one_device
from jaxring.data.loader import StepBatches
from jaxring.data.store import DocumentStore
from jaxring.data.token_data import is_token_file, open_token_data
from jaxring.data.token_sources import TokenSource
from jaxring.data.tokenizer import load_tokenizer
from jaxring.models import gpt, gpt_eval, hf
from jaxring.models.generate import generate
from jaxring.parallel.plan import ParallelPlan
from jaxring.run.task import ModelFamily, Task

DEFAULT_SEQ_LEN = 256


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _log_main(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)


VOCAB_MULTIPLE = 128  # a vocabulary the data needs beyond the preset's is padded to this multiple (tp splits it)


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


class GPTTask(Task):
    """Next-token prediction on packed documents (or a .bin's windows), laid out by the plan on the data side.

    Batches follow `jaxring.data.packing`'s convention ("tokens", "targets", "segment_ids", "positions" within
    each document, "loss_mask"). The batch holds the keys the objective declares (`batch_keys`): from a
    document store the objective takes documents (`NextTokenObjective.documents`: attention inside each
    document, RoPE by document position, the loss over loss_mask); a .bin's windows are one stream with no
    documents, so it gets "tokens", "targets" and the row's positions (the same computation as one segment
    per row, without the masks' work).
    """

    def __init__(self, spec, plan: ParallelPlan):
        t = spec.training
        self.seq_len = t.seq_len or DEFAULT_SEQ_LEN
        overrides = dict(spec.model.overrides)
        self.data = open_token_data(spec.data, log=_log_main, bin_vocab_size=_stated_vocab(spec, overrides))
        self.source = self.data.tokenizer  # encode/decode (the sample at the end, notebooks)
        if self.data.is_windows and spec.output.sample_tokens:
            _log_main(
                f"note: --data {spec.data.data} is token ids with no tokenizer: no text sample at the end "
                f"(--sample-tokens {spec.output.sample_tokens} ignored)"
            )
            spec.output.sample_tokens = 0  # the run's settings as it will run them (run.yaml, the loop)
        _check_overrides_fit_the_data(overrides, self.source, self.seq_len)
        if spec.model.init_from is not None:
            check_data_tokenizer(spec.model.init_from, self.data)
            self.config = pretrained_config(spec.model.init_from, overrides, self.data.vocab_size)
        else:
            base = gpt.get_config(spec.model.preset, **overrides)
            derived = {}
            if base.vocab_size < self.data.vocab_size:  # else keep the preset's (padded) vocabulary
                derived["vocab_size"] = -(-self.data.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
            if base.positions == "learned":
                derived["max_seq_len"] = max(base.max_seq_len, self.seq_len)
            self.config = gpt.get_config(spec.model.preset, **{**overrides, **derived})
        try:
            plan.check_seq_len(self.seq_len, causal=True)
        except ValueError as e:
            raise ValueError(
                f"--seq-len {self.seq_len}: {e}; e.g. --seq-len {_nearest_seq_len(plan, self.seq_len)}"
            ) from None
        gpt.check_plan(self.config, plan, t.batch_size // t.grad_accum, self.seq_len)
        self.spec = spec
        self._check_export()  # before the first step: an export that cannot be written must not wait for the end
        self.objective = gpt.NextTokenObjective(t.batch_size, self.seq_len, documents=not self.data.is_windows)
        # the progress bar's MoE metrics (metrics.step_metrics' convention)
        self.progress = ("moe_aux_loss", "load_imbalance", "drop_rate") if self.config.moe is not None else ()
        self.plan, self.spec = plan, spec
        self.sharding = plan.tokens_sharding()
        shape = (t.batch_size, self.seq_len)
        self.row0, row1 = host_rows(self.sharding, shape)
        per_host = row1 - self.row0
        rows = dict(
            batch_size=t.batch_size,
            seq_len=self.seq_len,
            process_index=self.row0 // per_host,
            process_count=t.batch_size // per_host,
            vocab_size=self.config.vocab_size,
        )
        self.batches = StepBatches(self.data.batches("train", seed=t.seed, **rows))
        self._val = lambda: StepBatches(self.data.batches("val", seed=t.seed + 1, **rows), prefetch=0)
        self.val_batches = None  # built when first asked for
        self.source_name = self.batches.dataset.describe()
        self.inputs = self.objective.batch_keys

    # ---- the data loader's position, saved in checkpoints (jaxring.train.loop)
    def data_state(self) -> dict:
        return self.batches.state()

    def restore_data_state(self, state: dict | None, step: int, log) -> None:
        """Continues the stream where the checkpoint's run was at `step`; without a usable state (an older
        checkpoint, other data, another batch size) batch `step` is found by replaying the plans from 0."""
        if state is not None and state.get("step") == step:
            try:
                self.batches.restore(state)
                return
            except ValueError as e:
                log(f"warning: {e}; finding step {step}'s batch from the start of this run's stream")

    def model(self, seed: int):
        init_from = self.spec.model.init_from
        if init_from is None:
            return gpt.GPT(self.config, rngs=nnx.Rngs(seed))
        try:
            model, _ = hf.load_pretrained(
                init_from, self.plan, overrides=_changed(hf.read_config(init_from), self.config)
            )
        except hf.DamagedWeights as e:  # NaN/Inf named by tensor here, not as a divergence at step 1
            raise ValueError(f"--init-from {init_from}: {e.detail}") from None
        _log_main(f"initialized from {init_from} ({self.config.num_params() / 1e6:.1f}M parameters)")
        return model

    def check_validation_data(self) -> None:
        """Every token id of the training and the held-out data inside the model's vocabulary, checked before
        training (not at the end): a store's largest id as its meta.json says (its files verified by checksum
        when opened), a .bin's held-out ids scanned (the training file's were scanned when it was opened)."""
        for source, what in ((self.data.train, "training"), (self.data.val, "held-out")):
            top = _largest_id(source, scan=source is not self.data.train)
            if top is None or top < self.config.vocab_size:
                continue
            if what == "held-out":
                raise ValueError(
                    f"the held-out data {source.name} has token id {top}, outside the vocabulary of "
                    f"{self.config.vocab_size} (the training data's); use held-out data of the same tokenizer"
                )
            raise ValueError(
                f"the training data {source.name} has token id {top}, outside the model's vocabulary of "
                f"{self.config.vocab_size}; give data of the model's tokenizer"
            )

    def metadata(self) -> dict:
        return {"kind": "gpt", **dataclasses.asdict(self.config)}

    def batch(self, step: int, val: bool = False) -> dict:
        if val and self.val_batches is None:
            self.val_batches = self._val()
        rows = (self.val_batches if val else self.batches).get(step)
        if "segment_ids" not in self.inputs:  # a model without document masks: rows attended whole
            rows = {"tokens": rows["tokens"], "targets": rows["targets"]}
        names = list(rows)
        laid_out, row_positions = self.plan.layout_tokens(*(rows[k] for k in names), causal=True)
        batch = dict(zip(names, laid_out))
        batch.setdefault("positions", np.broadcast_to(row_positions, batch["tokens"].shape))
        shape = (self.spec.training.batch_size, self.seq_len)
        return {
            name: global_array(self.sharding, shape, np.ascontiguousarray(batch[name]), self.row0)
            for name in self.inputs
        }

    @property
    def tokens_per_step(self) -> int:
        return self.spec.training.batch_size * self.seq_len

    def flops_per_step(self) -> float:
        return self.config.flops_per_token(self.seq_len, causal=True) * self.tokens_per_step

    def _export_dtype(self) -> str:
        return "bfloat16" if self.spec.compute_precision == "bf16" else "float32"  # the weights are fp32 masters

    def _check_export(self) -> None:
        """--export-hf DIR checked as the exporter would refuse it (`jaxring.models.hf.check_export`): an
        architecture Hugging Face stores, the tokenizer.json it ships, DIR new, empty or an earlier export with
        --overwrite-export, writable, and room on its filesystem for the parameters in the export's dtype."""
        m = self.spec.model
        if m.export_hf is not None:
            tokenizer = self._tokenizer_file()
            if tokenizer is not None:  # the tokenizer.json it ships must fit the vocabulary
                hf.check_tokenizer(tokenizer, self.config.vocab_size, "the model's config")
            hf.check_export(
                self.config,
                m.export_hf,
                self._export_dtype(),
                overwrite=m.overwrite_export,
                flag="--export-hf",
                overwrite_flag="--overwrite-export",
            )

    def export(self, model, log) -> None:
        """--export-hf DIR: the trained model written as a Hugging Face checkpoint (with the tokenizer.json of
        --init-from or --tokenizer, when there is one), in bfloat16 when trained in --precision bf16.

        A write that fails anyway (the disk filled during training) leaves DIR as it was and raises one OSError
        line saying where the trained model is: the run's final checkpoint when there is a --checkpoint-dir,
        else an export written to a fallback directory (OUT_DIR/export-hf, else a new directory in the system's
        temporary directory), or that both failed too."""
        export = self.spec.model.export_hf
        if export is None:
            return
        write = lambda path, overwrite: hf.save_pretrained(
            model, self.config, path, tokenizer=self._tokenizer_file(), dtype=self._export_dtype(), overwrite=overwrite
        )
        try:
            files = write(export, self.spec.model.overwrite_export)
        except (OSError, hf.CheckpointError) as e:  # a full disk; files put in DIR during training
            failed = f"--export-hf {export!r}: writing the export failed ({_one_line(e)})"
            checkpoints = self.spec.checkpoint.checkpoint_dir
            if checkpoints is not None:  # the loop saved the final step before exporting
                raise OSError(
                    f"{failed}; the trained model is the final checkpoint in {checkpoints!r}: export it with "
                    f"python -m jaxring.models.hf export {checkpoints} DIR"
                ) from None
            raise OSError(f"{failed}; {self._fallback_export(write, log)}") from None
        log(f"exported the model to {export} ({len(files)} files)")

    def _fallback_export(self, write, log) -> str:
        """The export written to the first fallback directory that takes it; what happened, as a clause."""
        tried = []
        for where in (os.path.join(self.spec.output.out_dir or ".", "export-hf"), None):
            made = where is None
            try:
                where = where or tempfile.mkdtemp(prefix="jaxring-export-hf-")
                write(where, hf.is_export_dir(where))
            except (OSError, ValueError) as e:
                tried.append(f"{where or tempfile.gettempdir()}: {_one_line(e)}")
                if made and where is not None:
                    shutil.rmtree(where, ignore_errors=True)
                continue
            log(f"exported the model to the fallback directory {where}")
            return f"the trained model was exported to {where!r} instead"
        return f"the fallback exports failed too ({'; '.join(tried)}): the trained model is lost"

    def _tokenizer_file(self) -> str | None:
        """The tokenizer.json to ship with an export: --init-from's, else --tokenizer's (a file or a directory)."""
        candidates = [self.spec.model.init_from, self.spec.data.tokenizer]
        for c in candidates:
            if c and c != "bytes":
                path = c if c.endswith(".json") else os.path.join(c, "tokenizer.json")
                if os.path.isfile(path):
                    return path
        return None

    def finish(self, model, log, out_dir: str) -> dict:
        """A generated sample from the trained model, on one device (none from token ids without a tokenizer)."""
        del out_dir
        if self.data.is_windows:
            return {}
        device = jax.devices()[0]
        one = ParallelPlan(make_mesh(devices=[device]))
        graphdef, state = nnx.split(model)
        single = nnx.merge(graphdef, to_one_device(state, device))
        prompt = self.source.encode("def ")
        (ids,) = generate(
            single,
            one,
            [list(prompt)],
            self.spec.output.sample_tokens,
            temperature=0.8,
            key=jax.random.PRNGKey(0),
            progress=self.spec.output.progress,
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


def _stated_vocab(spec, overrides: dict) -> int | None:
    """The vocabulary a .bin's token ids are read with: --override vocab_size, else --init-from's, else None
    (GPT-2's, `jaxring.data.token_sources`)."""
    if isinstance(overrides.get("vocab_size"), int):
        return overrides["vocab_size"]
    if spec.model.init_from is not None and is_token_file(spec.data.data):
        return hf.read_config(spec.model.init_from).vocab_size
    return None


def _largest_id(source: DocumentStore | TokenSource, scan: bool) -> int | None:
    """A document store's largest id (meta.json's, or its EOS); a .bin's: scanned when `scan`, else bounded by
    its vocabulary (checked when it was opened)."""
    if isinstance(source, DocumentStore):
        return max(source.max_token_id, source.eos_id)
    return max_token_id(source.tokens) if scan else source.vocab_size - 1


def max_token_id(tokens, chunk: int = 1 << 24) -> int | None:
    """The largest id in a token array (read in chunks: it may be a memory-mapped file), None when empty."""
    if len(tokens) == 0:
        return None
    return max(int(np.asarray(tokens[i : i + chunk]).max()) for i in range(0, len(tokens), chunk))


def _abstract_batch(config, plan: ParallelPlan, batch: int, seq_len: int, documents: bool = False) -> dict:
    tok = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=plan.tokens_sharding())
    return dict.fromkeys(gpt.NextTokenObjective(batch, seq_len, documents).batch_keys, tok)


def _packs_documents(data) -> bool:
    """GPTTask's rule: a document store (or text prepared into one) is packed documents; a .bin's windows not."""
    return not is_token_file(data.data)


FAMILY = ModelFamily(
    name="gpt",
    summary="decoder-only Transformer, next-token prediction",
    causal=True,
    config_class=gpt.GPTConfig,
    presets=gpt.PRESETS,
    build=lambda config, rngs: gpt.GPT(config, rngs=rngs),
    objective=lambda config, batch, seq_len, documents=False: gpt.NextTokenObjective(batch, seq_len, documents),
    check_plan=gpt.check_plan,
    tokens=lambda config, seq_len: seq_len,
    flops_per_step=lambda config, seq_len, batch: config.flops_per_token(seq_len, causal=True) * seq_len * batch,
    abstract_batch=_abstract_batch,
    task=GPTTask,
    load_pretrained=gpt_eval.load_pretrained,
    token_scores=gpt_eval.token_scores,
    documents=_packs_documents,
)


CONTEXT_EXTENSION = ("max_seq_len",)  # with every rope_* field: what --override may change under --init-from


def pretrained_config(path: str, overrides: dict, data_vocab: int) -> gpt.GPTConfig:
    """The GPTConfig of a Hugging Face checkpoint, with the overrides a context extension may make."""
    config = hf.read_config(path)
    fixed = sorted(
        k
        for k, value in overrides.items()
        if not (k.startswith("rope_") or k in CONTEXT_EXTENSION) and value != getattr(config, k, None)
    )
    if fixed:
        raise ValueError(
            f"--override {fixed[0]}={overrides[fixed[0]]} contradicts --init-from {path}'s config.json "
            f"({fixed[0]} = {getattr(config, fixed[0], None)!r}); only rope_* and max_seq_len may change"
        )
    if data_vocab > config.vocab_size:
        raise ValueError(
            f"the data's token ids reach {data_vocab - 1}, outside --init-from {path}'s vocabulary of "
            f"{config.vocab_size}; give data of the checkpoint's tokenizer"
        )
    return dataclasses.replace(config, **overrides)


def check_data_tokenizer(path: str, data) -> None:
    """The data of a run from --init-from must be tokenized with the checkpoint's own tokenizer.json when it has
    one (compared by sha256; a .bin's windows record no tokenizer and are checked by their ids only)."""
    file = os.path.join(path, "tokenizer.json")
    if data.is_windows or not os.path.isfile(file):
        return
    own, used = load_tokenizer(file), data.tokenizer
    if own.hash != used.hash:
        used_text = "bytes" if used.is_bytes else f"{used.name} (sha256 {used.hash[:12]})"
        raise ValueError(
            f"the data {data.name} was tokenized with {used_text}, not with --init-from {path}'s tokenizer.json "
            f"(sha256 {own.hash[:12]}); prepare the data with --tokenizer {path}"
        )


def _changed(base: gpt.GPTConfig, config: gpt.GPTConfig) -> dict:
    """The fields of `config` that differ from `base`."""
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(base, f.name)
    }
