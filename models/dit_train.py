"""The DiT as jaxring trains and plans it: its `ModelFamily` and its training task (labelled images,
rectified flow, a grid of samples beside the run's outputs at the end).

Declared to jaxring by the `jaxring.models` entry point `dit = "jaxring.models.dit_train:FAMILY"` (pyproject.toml).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxring.core.mesh import make_mesh
from jaxring.data.hosts import global_array, host_rows, to_one_device
from jaxring.data.image_sources import ImageBatches, load_images
from jaxring.models import dit
from jaxring.parallel.cost_terms import WorkloadTerms
from jaxring.parallel.plan import ParallelPlan
from jaxring.run.task import ModelFamily, Task

SAMPLES_FILE = "samples.png"


class DiTTask(Task):
    """Rectified flow on labelled images; the images split over the data axes."""

    def __init__(self, spec, plan: ParallelPlan):
        t = spec.training
        overrides = dict(spec.model.overrides)
        base = dit.get_config(spec.model.preset, **overrides)
        image_size = t.image_size or base.image_size
        self.source = load_images(spec.data.data, image_size=image_size, split="train")
        self.source_name = self.source.name
        val_source = load_images(spec.data.data, image_size=image_size, split="val")
        self.config = dit.get_config(
            spec.model.preset,
            **{**overrides, "image_size": image_size},
            channels=self.source.images.shape[-1],
            num_classes=self.source.num_classes,
        )
        dit.check_plan(self.config, plan, t.batch_size // t.grad_accum)
        self.objective = dit.FlowMatchingObjective(self.config, t.batch_size)
        self.progress = ()
        self.plan, self.spec = plan, spec
        self.img_shape = (t.batch_size, *self.source.images.shape[1:])
        self.img_sharding = plan.sharding(plan.batch_spec(4))
        self.label_sharding = plan.sharding(plan.batch_spec(1))
        self.row0, row1 = host_rows(self.label_sharding, (t.batch_size,))
        per_host = row1 - self.row0
        hosts = dict(process_index=self.row0 // per_host, process_count=t.batch_size // per_host)
        self.batches = ImageBatches(self.source, batch_size=t.batch_size, seed=t.seed, **hosts)
        self.val_batches = ImageBatches(val_source, batch_size=t.batch_size, seed=t.seed + 1, **hosts)

    def model(self, seed: int):
        return dit.DiT(self.config, rngs=nnx.Rngs(seed))

    def metadata(self) -> dict:
        return {"kind": "dit", **dataclasses.asdict(self.config)}

    def batch(self, step: int, val: bool = False) -> dict:
        images, labels = (self.val_batches if val else self.batches).get(step)
        batch = self.spec.training.batch_size
        return {
            "images": global_array(self.img_sharding, self.img_shape, images, self.row0),
            "labels": global_array(self.label_sharding, (batch,), labels, self.row0),
        }

    @property
    def tokens_per_step(self) -> int:
        return self.spec.training.batch_size * self.config.num_tokens

    def flops_per_step(self) -> float:
        return self.config.flops_per_image() * self.spec.training.batch_size

    def finish(self, model, log, out_dir: str) -> dict:
        """A grid of 16 class-conditional samples, written to OUT_DIR/samples.png."""
        labels = jnp.arange(16) % self.config.num_classes
        device = jax.devices()[0]
        one = ParallelPlan(make_mesh(devices=[device]))
        graphdef, state = nnx.split(model)
        single = nnx.merge(graphdef, to_one_device(state, device))
        images = dit.sample(single, one, labels, jax.random.PRNGKey(0))
        path = os.path.join(out_dir, SAMPLES_FILE)
        dit.save_image_grid(np.asarray(images), path, nrow=4)
        log(f"wrote {len(labels)} samples to {path}")
        return {"samples": path}


def _workload_config(preset: str, seq_len: int | None, image_size: int | None, overrides: dict):
    """A planner workload's config: image_size as given, or the square patch grid nearest to seq_len tokens
    (its side a multiple of 8, so the tokens split over sp), or the preset's."""
    base = dit.get_config(preset, **overrides)
    if image_size is None:
        if seq_len is None:
            image_size = base.image_size
        else:
            grid = max(8, round(math.sqrt(seq_len) / 8) * 8)
            image_size = grid * base.patch_size
    return dit.get_config(preset, **{**overrides, "image_size": image_size})


def _abstract_batch(config, plan: ParallelPlan, batch: int, seq_len: int | None) -> dict:
    del seq_len
    shape = (batch, config.image_size, config.image_size, config.channels)
    return {
        "images": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=plan.sharding(plan.batch_spec(4))),
        "labels": jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=plan.sharding(plan.batch_spec(1))),
    }


FAMILY = ModelFamily(
    name="dit",
    summary="class-conditional diffusion Transformer, rectified flow",
    causal=False,
    config_class=dit.DiTConfig,
    presets=dit.PRESETS,
    build=lambda config, rngs: dit.DiT(config, rngs=rngs),
    objective=lambda config, batch, seq_len: dit.FlowMatchingObjective(config, batch),
    check_plan=lambda config, plan, batch, seq_len: dit.check_plan(config, plan, batch),
    tokens=lambda config, seq_len: config.num_tokens,
    flops_per_step=lambda config, seq_len, batch: config.flops_per_image() * batch,
    abstract_batch=_abstract_batch,
    task=DiTTask,
    workload_config=_workload_config,
    # adaLN: 6 modulation vectors per block and 2 in the final layer, a conditioning path on per-image vectors
    # (its gradients whole over tp), the conditioning row beside the stream at a pipeline boundary; the stored
    # batch is the images (fp32) and their labels
    planner_terms=WorkloadTerms(
        modulation=6,
        final_modulation=2,
        conditioning=("adaLN", "t_embed", "y_embed"),
        boundary_rows=1,
        rotary_fp32=False,
        tiled_block=False,  # its blocks tile the MLP only
        batch_bytes=lambda config, rows, tokens: rows * (config.image_size**2 * config.channels * 4 + 4),
    ),
)
