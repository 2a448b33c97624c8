"""Training tasks: what a batch is, how the model's loss is computed on it, and what is shown at the end.

`GPTTask` (next-token prediction on byte-level text) and `DiTTask` (rectified flow on labelled images). A
task builds its model from the config, reads this host's rows of every global batch, lays the tokens out as
the plan says (once, on the data side) and reports FLOPs for MFU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxring.mesh import make_mesh
from jaxring.plan import ParallelPlan
from jaxring.train.config import TrainConfig
from jaxring.train.data import ImageBatches, TokenBatches, load_images, load_tokens


def _global_array(plan: ParallelPlan, sharding, global_shape, local_rows, row0):
    """A global array from this host's rows [row0, row0 + len(local_rows)) of the global batch."""

    def part(index):
        rows = index[0]
        start = (rows.start or 0) - row0
        stop = (rows.stop if rows.stop is not None else global_shape[0]) - row0
        return local_rows[(slice(start, stop),) + tuple(index[1:])]

    return jax.make_array_from_callback(global_shape, sharding, part)


def _host_rows(sharding, global_shape):
    """The contiguous range of global batch rows this host's devices hold."""
    rows = [idx[0] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    lo = min(r.start or 0 for r in rows)
    hi = max(r.stop if r.stop is not None else global_shape[0] for r in rows)
    return lo, hi


class GPTTask:
    kind = "gpt"
    causal = True

    def __init__(self, cfg: TrainConfig, plan: ParallelPlan):
        from models import gpt

        self.gpt = gpt
        self.seq_len = cfg.seq_len or 256
        self.source = load_tokens(cfg.data)
        overrides = {"vocab_size": self.source.vocab_size}
        base = gpt.get_config(cfg.preset, **cfg.model_overrides)
        if base.positions == "learned":
            overrides["max_seq_len"] = max(base.max_seq_len, self.seq_len)
        if base.vocab_size > self.source.vocab_size:
            overrides.pop("vocab_size")  # keep the preset's (padded) vocabulary
        self.config = gpt.get_config(cfg.preset, **{**cfg.model_overrides, **overrides})
        gpt.check_plan(self.config, plan, cfg.batch_size // cfg.grad_accum, self.seq_len)
        self.objective = gpt.NextTokenObjective(cfg.batch_size, self.seq_len)
        # the progress bar's MoE metrics (metrics.step_metrics' convention)
        self.progress = ("moe_aux_loss", "load_imbalance", "drop_rate") if self.config.moe is not None else ()
        self.plan, self.cfg = plan, cfg
        self.sharding = plan.tokens_sharding()
        shape = (cfg.batch_size, self.seq_len)
        self.row0, row1 = _host_rows(self.sharding, shape)
        per_host = row1 - self.row0
        host, hosts = self.row0 // per_host, cfg.batch_size // per_host
        self.batches = TokenBatches(
            self.source,
            batch_size=cfg.batch_size,
            seq_len=self.seq_len,
            seed=cfg.seed,
            process_index=host,
            process_count=hosts,
        )
        self.val_batches = TokenBatches(
            load_tokens(cfg.data, split="val"),
            batch_size=cfg.batch_size,
            seq_len=self.seq_len,
            seed=cfg.seed + 1,
            process_index=host,
            process_count=hosts,
        )

    def model(self, seed):
        return self.gpt.GPT(self.config, rngs=nnx.Rngs(seed))

    def metadata(self):
        return {"kind": "gpt", **dataclasses.asdict(self.config)}

    def batch(self, step, val=False):
        rows = (self.val_batches if val else self.batches).get(step)
        (tokens, targets), positions = self.plan.layout_tokens(rows[:, :-1], rows[:, 1:], causal=self.causal)
        positions = np.broadcast_to(positions, tokens.shape)
        shape = (self.cfg.batch_size, self.seq_len)
        return {
            name: _global_array(self.plan, self.sharding, shape, np.ascontiguousarray(a), self.row0)
            for name, a in (("tokens", tokens), ("targets", targets), ("positions", positions))
        }

    @property
    def tokens_per_step(self):
        return self.cfg.batch_size * self.seq_len

    def flops_per_step(self):
        return self.config.flops_per_token(self.seq_len, causal=True) * self.tokens_per_step

    def finish(self, model, log):
        """A generated sample from the trained model, on one device."""
        one = ParallelPlan(make_mesh(devices=jax.devices()[:1]))
        single = nnx.merge(*_to_device(nnx.split(model), jax.devices()[0]))
        prompt = self.source.encode("def ")
        ids = self.gpt.generate(
            single, one, list(prompt), self.cfg.sample_tokens, key=jax.random.PRNGKey(0), window=min(self.seq_len, 256)
        )
        text = self.source.decode(list(prompt) + ids)
        log(f"--- sample ---\n{text}\n--------------")
        return {"sample": text}


class DiTTask:
    kind = "dit"
    causal = False

    def __init__(self, cfg: TrainConfig, plan: ParallelPlan):
        from models import dit

        self.dit = dit
        base = dit.get_config(cfg.preset, **cfg.model_overrides)
        self.source = load_images(cfg.data, image_size=cfg.image_size or base.image_size, split="train")
        val_source = load_images(cfg.data, image_size=cfg.image_size or base.image_size, split="val")
        self.config = dit.get_config(
            cfg.preset,
            **{**cfg.model_overrides, "image_size": cfg.image_size or base.image_size},
            channels=self.source.images.shape[-1],
            num_classes=self.source.num_classes,
        )
        dit.check_plan(self.config, plan, cfg.batch_size // cfg.grad_accum)
        self.objective = dit.FlowMatchingObjective(self.config, cfg.batch_size)
        self.plan, self.cfg = plan, cfg
        img_shape = (cfg.batch_size,) + self.source.images.shape[1:]
        self.img_sharding = plan.sharding(plan.batch_spec(4))
        self.label_sharding = plan.sharding(plan.batch_spec(1))
        self.row0, row1 = _host_rows(self.label_sharding, (cfg.batch_size,))
        per_host = row1 - self.row0
        hosts = dict(process_index=self.row0 // per_host, process_count=cfg.batch_size // per_host)
        self.batches = ImageBatches(self.source, batch_size=cfg.batch_size, seed=cfg.seed, **hosts)
        self.val_batches = ImageBatches(val_source, batch_size=cfg.batch_size, seed=cfg.seed + 1, **hosts)
        self.img_shape = img_shape

    def model(self, seed):
        return self.dit.DiT(self.config, rngs=nnx.Rngs(seed))

    def metadata(self):
        return {"kind": "dit", **dataclasses.asdict(self.config)}

    def batch(self, step, val=False):
        images, labels = (self.val_batches if val else self.batches).get(step)
        return {
            "images": _global_array(self.plan, self.img_sharding, self.img_shape, images, self.row0),
            "labels": _global_array(self.plan, self.label_sharding, (self.cfg.batch_size,), labels, self.row0),
        }

    @property
    def tokens_per_step(self):
        return self.cfg.batch_size * self.config.num_tokens

    def flops_per_step(self):
        return self.config.flops_per_image() * self.cfg.batch_size

    def finish(self, model, log):
        labels = jnp.arange(16) % self.config.num_classes
        one = ParallelPlan(make_mesh(devices=jax.devices()[:1]))
        single = nnx.merge(*_to_device(nnx.split(model), jax.devices()[0]))
        images = self.dit.sample(single, one, labels, jax.random.PRNGKey(0))
        self.dit.save_image_grid(np.asarray(images), self.cfg.sample_path, nrow=4)
        log(f"wrote {len(labels)} samples to {self.cfg.sample_path}")
        return {"samples": self.cfg.sample_path}


def _to_device(split, device):
    graphdef, state = split
    state = jax.tree.map(lambda x: jax.device_put(_fully_replicated(x), device), state)
    return graphdef, state


def _fully_replicated(x):
    """A host copy of a (possibly multi-host) global array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(x, tiled=True)
    return x


TASKS = {"gpt": GPTTask, "dit": DiTTask}
