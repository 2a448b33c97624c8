"""Deviceless compile checks beside tests/unit/train/test_memory_techniques.py:
the compiled tier, which needs the gpu-compile or tpu-compile extra and skips without it."""

from __future__ import annotations

import pytest
from test_memory_techniques import _compiled

from jaxring.analysis import gpu
from jaxring.analysis.compiled import host_memory_traffic
from jaxring.models import gpt


@pytest.mark.skipif(not gpu.available()[0], reason="deviceless GPU compile unavailable (see jaxring/analysis/gpu.py)")
def test_offload_moves_the_layer_inputs_to_host_memory_on_h100():
    """Compiled for one H100 (no GPU needed): the offloaded step writes the layer inputs into a host buffer and
    reads them back, and its device temporaries shrink (by less than what the host holds: the device keeps
    buffers for the transfers in flight)."""
    cfg = gpt.GPTConfig(vocab_size=256, num_layers=8, hidden=128, num_heads=4, ffn=256)
    batch, seq = 1, 2048
    devices = gpu.gpu_devices("h100", 1)
    kept = _compiled(cfg, batch, seq, devices, remat="full")
    offloaded = _compiled(cfg, batch, seq, devices, remat="full", offload="layer_inputs")
    assert host_memory_traffic(kept.as_text()) == {"to_host": 0, "from_host": 0, "host_buffers": 0}
    moved = host_memory_traffic(offloaded.as_text())
    assert moved["to_host"] >= 1 and moved["from_host"] >= 1 and moved["host_buffers"] >= 1, moved
    layer_inputs = cfg.num_layers * batch * seq * cfg.hidden * 4  # fp32 [b, s, h] per layer
    k, o = kept.memory_analysis(), offloaded.memory_analysis()
    assert (k.host_temp_size_in_bytes, o.host_temp_size_in_bytes) == (0, layer_inputs)
    drop = k.temp_size_in_bytes - o.temp_size_in_bytes
    assert drop >= layer_inputs // 2, (drop, layer_inputs)


@pytest.mark.skipif(not gpu.available()[0], reason="deviceless GPU compile unavailable (see jaxring/analysis/gpu.py)")
def test_recompute_blocks_offload_their_layers_inputs_too_on_h100():
    """Compiled for one H100: with --remat-layers 2 and the layer inputs offloaded, host memory holds the
    blocks' inputs and, while a block's backward runs, the inputs of its layers recomputed; the device holds
    no more than with one layer a block (it held the block's recomputed inputs before: one [b, s, h] more)."""
    cfg = gpt.GPTConfig(vocab_size=256, num_layers=8, hidden=128, num_heads=4, ffn=256)
    batch, seq = 1, 32768  # tiled, so that the layer inputs are what the device's peak is made of
    devices = gpu.gpu_devices("h100", 1)
    settings = dict(remat="full", offload="layer_inputs", loss_tile=1024, mlp_tile=1024)
    one = _compiled(cfg, batch, seq, devices, **settings).memory_analysis()
    # the inner inputs kept on the device instead: 0.85 of a layer input more than `one`
    two = _compiled(cfg, batch, seq, devices, **settings, remat_layers=2).memory_analysis()
    layer_input = batch * seq * cfg.hidden * 4  # fp32 [b, s, h]
    assert one.host_temp_size_in_bytes == cfg.num_layers * layer_input
    assert two.host_temp_size_in_bytes == (cfg.num_layers // 2 + 2) * layer_input
    assert two.temp_size_in_bytes <= one.temp_size_in_bytes + layer_input // 2, (two, one)
