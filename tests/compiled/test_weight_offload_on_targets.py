"""Deviceless compile checks beside tests/unit/train/test_weight_offload.py:
the compiled tier, which needs the gpu-compile or tpu-compile extra and skips without it."""

from __future__ import annotations

import re

import jax
import pytest
from flax import nnx

import jaxring
import train as cli
from jaxring.analysis import gpu
from jaxring.aot.train_step import compile_train_step
from jaxring.models import gpt
from jaxring.nn import MemoryPolicy


@pytest.mark.skipif(not gpu.available()[0], reason="deviceless GPU compile unavailable (see jaxring/analysis/gpu.py)")
def test_compiled_for_one_h100_the_weights_are_host_arguments():
    """The compiled step of an 8-layer GPT on one H100: weights and moments are host arguments (4Ψ fp32 less the
    gradients, which are host temporaries), and the device holds less than one tenth of the stack's weights
    beside the run with them on the device."""
    cfg = gpt.GPTConfig(vocab_size=256, num_layers=8, hidden=512, num_heads=4, ffn=2048)
    plan = jaxring.make_plan(gpu.gpu_devices("h100", 1))
    kw = dict(batch=1, seq_len=256)
    on_device = compile_train_step(
        "gpt", cfg, plan, memory=MemoryPolicy(remat="full", offload="optimizer"), **kw
    ).memory_analysis()
    on_host = compile_train_step(
        "gpt", cfg, plan, memory=MemoryPolicy(remat="full", offload="weights"), **kw
    ).memory_analysis()
    weights = (
        sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0)))))) * 4
    )
    # the weights and the two moments (and the step count); with the optimizer state alone offloaded, the moments
    assert abs(on_host.host_argument_size_in_bytes - 3 * weights) <= 64, on_host.host_argument_size_in_bytes
    assert abs(on_device.host_argument_size_in_bytes - 2 * weights) <= 64, on_device.host_argument_size_in_bytes
    device = lambda m: m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    assert device(on_device) - device(on_host) >= 0.9 * 2 * weights, (device(on_device), device(on_host), weights)


@pytest.mark.slow  # a deviceless compile, about 15 s; skips without the compile-only CUDA plugin
@pytest.mark.skipif(not gpu.available()[0], reason="deviceless GPU compile unavailable (see jaxring/analysis/gpu.py)")
def test_llama3_8b_at_655360_tokens_fits_one_h100(capsys):
    """Issue 35's command: the planner turns to the weights in host memory and recompute blocks of √L = 4 layers;
    the program compiled for one H100 fits its device (estimate within 10%) and the host's 256 GiB."""
    args = ["--preset", "llama3-8b", "--seq-len", "655360", "--batch-size", "1", "--plan", "auto"]
    assert cli.main([*args, "--compile-for", "h100x1"]) == 0
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    numbers = re.match(
        r"fits: compiled ([\d.]+) GiB per device, estimate ([\d.]+) GiB, budget 67.1 GiB; host memory ([\d.]+) GiB "
        r"per device, estimate [\d.]+ GiB, budget 256.0 GiB",
        verdict,
    )
    assert numbers, verdict
    compiled, estimate, host = map(float, numbers.groups())
    assert compiled <= 67.1 and abs(estimate / compiled - 1) <= 0.1 and host <= 256, verdict


@pytest.mark.slow  # three deviceless compiles, about 25 s each; skips without the compile-only CUDA plugin
@pytest.mark.skipif(not gpu.available()[0], reason="deviceless GPU compile unavailable (see jaxring/analysis/gpu.py)")
@pytest.mark.parametrize("held", [(), ("--vocab-split", "none"), ("--vocab-split", "none", "--head-chunks", "1")])
def test_llama3_8b_at_8388608_tokens_fits_eight_h100(capsys, held):
    """Issue 35's second command: the planner's plan (the vocabulary split over sp, √L recompute blocks whose
    layers' inputs go to host memory too) fits the device (estimate within 10%) and the host's 256 GiB. With the
    tables held replicated the planner takes UPipe's head chunks as well; with those held off too nothing fits
    by the estimate, so the plans estimated within 10% above the budget are compiled, and one fits."""
    args = ["--preset", "llama3-8b", "--seq-len", "8388608", "--batch-size", "1", "--plan", "auto", *held]
    assert cli.main([*args, "--compile-for", "h100x8"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert ("the estimate is within 10% of the compiled bytes" in out[0]) == ("--head-chunks" in held), out[0]
    assert ("head_chunks=1" in out[0]) == (held != ("--vocab-split", "none")), out[0]
    numbers = re.match(
        r"fits: compiled ([\d.]+) GiB per device, estimate ([\d.]+) GiB, budget 67.1 GiB; host memory ([\d.]+) GiB "
        r"per device, estimate [\d.]+ GiB, budget 256.0 GiB",
        out[-1],
    )
    assert numbers, out[-1]
    compiled, estimate, host = map(float, numbers.groups())
    assert compiled <= 67.1 and abs(estimate / compiled - 1) <= 0.1 and host <= 256, out[-1]
