"""Training configuration: the flags of `train.py` as one dataclass, their validation, and the plan they name.

cfg = TrainConfig(model="gpt", preset="tiny", sp=8, attention="ring", steps=50)
plan = make_plan(cfg)                # mesh degrees -> ParallelPlan
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jaxring.mesh import make_mesh
from jaxring.plan import ParallelPlan
from jaxring.train.validate import validate_config

PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
REMAT = ("none", "selective", "full")


@dataclasses.dataclass
class TrainConfig:
    model: str = "gpt"
    preset: str = "tiny"
    steps: int = 200
    seed: int = 0
    batch_size: int = 8
    seq_len: int | None = None  # GPT only (default 256)
    model_overrides: dict = dataclasses.field(default_factory=dict)  # preset fields to change, e.g. num_layers
    image_size: int | None = None  # DiT only (default: the preset's)
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    grad_accum: int = 1
    # mesh and strategies
    dp: int = 1
    fsdp: int = 1
    pp: int = 1
    tp: int = 1
    sp: int = 1
    attention: str | None = None  # default: ring when sp > 1, else dense
    layout: str | None = None
    ep: int = 1  # expert parallel (data parallel outside MoE layers)
    team_size: int | None = None
    ulysses_size: int | None = None
    placement: str | None = None  # wallfacer: team_inner or ring_inner
    tensor_parallel: str | None = None
    zero: int | None = None  # ZeRO stage 0-3 over the replica axes (default: 3 with fsdp > 1, else 0)
    pipeline: str = "1f1b"  # pp > 1: gpipe, 1f1b, interleaved or zero-bubble
    microbatches: int | None = None  # pp > 1: micro-batches per step (default 2·pp)
    virtual_stages: int = 1  # interleaved: layer chunks per pipeline stage
    # numerics and memory
    precision: str = "fp32"
    remat: str = "none"
    # output
    data: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    metrics_file: str | None = None
    profile: str | None = None
    log_every: int = 10
    sample_tokens: int = 200  # GPT: tokens generated at the end; DiT: 0 skips the sample grid
    eval_at_end: bool = True  # report the held-out loss after training
    sample_path: str = "samples.png"
    progress: bool = True


def check_config(cfg: TrainConfig) -> None:
    validate_config(cfg)  # every numeric setting and model override: type and range
    if cfg.model not in ("gpt", "dit"):
        raise ValueError(f"unknown model {cfg.model!r}; expected gpt or dit")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {cfg.precision!r}; expected one of {', '.join(PRECISIONS)}")
    if cfg.remat not in REMAT:
        raise ValueError(f"unknown remat {cfg.remat!r}; expected one of {', '.join(REMAT)}")
    for name in ("steps", "batch_size", "grad_accum", "dp", "fsdp", "pp", "tp", "sp", "ep"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value!r} must be a positive integer")
    if cfg.pp > 1 and cfg.grad_accum > 1:
        raise ValueError(
            f"--grad-accum {cfg.grad_accum} with --pp {cfg.pp}: the pipeline's micro-batches are the "
            f"gradient accumulation; use --microbatches instead"
        )
    if cfg.batch_size % cfg.grad_accum:
        raise ValueError(f"batch size {cfg.batch_size} is not divisible by grad-accum {cfg.grad_accum}")
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if cfg.data is not None and not os.path.exists(cfg.data):
        raise FileNotFoundError(f"--data {cfg.data!r} does not exist")


def make_plan(cfg: TrainConfig, devices=None) -> ParallelPlan:
    """The mesh (degrees must multiply to the device count) and the strategy for each axis."""
    mesh = make_mesh(dp=cfg.dp, fsdp=cfg.fsdp, pp=cfg.pp, tp=cfg.tp, sp=cfg.sp, ep=cfg.ep, devices=devices)
    attention = cfg.attention or ("ring" if cfg.sp > 1 else "dense")
    return ParallelPlan(
        mesh,
        attention=attention,
        layout=cfg.layout,
        team_size=cfg.team_size,
        ulysses_size=cfg.ulysses_size,
        placement=cfg.placement,
        tensor_parallel=cfg.tensor_parallel,
        zero=cfg.zero,
        pipeline=cfg.pipeline,
        microbatches=cfg.microbatches,
        virtual_stages=cfg.virtual_stages,
    )
