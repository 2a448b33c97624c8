"""Deviceless compile checks beside tests/unit/planner/test_planner.py:
the compiled tier, which needs the gpu-compile or tpu-compile extra and skips without it."""

from __future__ import annotations

import pytest

from jaxring.analysis.axis_traffic import axis_traffic
from jaxring.aot.train_step import compile_train_step
from jaxring.models import gpt
from jaxring.planner import Cluster, Workload, search
from jaxring.planner import cost_model as cost
from jaxring.planner.params import param_leaves
from jaxring.planner.space import Candidate

GPU_CASES = {
    "gpt-1b, 8 × 8k on 8 H100": (Workload.of("gpt", "1b", seq_len=8192, global_batch=8), "h100"),
    "gpt-7b, 32k on 8 H200": (Workload.of("gpt", "7b", seq_len=32768, global_batch=1), "h200"),
    "dit-1b, 64k tokens on 8 H100": (Workload.of("dit", "dit-1b", seq_len=65536, global_batch=1), "h100"),
}


# (candidate, bytes the counter sees beyond the model: the 7 bytes of flags; METP's weights' psum over tp
# also carries 4 fp32 scalars of the step that XLA's all-reduce combiner merges in, 16 B × 2(p-1)/p = 24)
GPU_BYTES_CASES = {
    "ring": (Candidate.of(sp=8, attention="ring", micro_batch=1), 7),
    "wallfacer": (Candidate.of(sp=8, attention="wallfacer", team_size=2, micro_batch=1), 7),
    "metp": (Candidate.of(tp=4, tensor_parallel="metp", micro_batch=1), 24),
}


@pytest.mark.parametrize("name", list(GPU_CASES))
def test_predicted_memory_of_the_top_plan_on_the_gpu_target(name):
    """The same check on the program compiled for the GPU (Pallas attention kernels, bf16): needs the
    compile-only CUDA plugin (pip install -e ".[dev,gpu-compile]", its own venv); skips elsewhere."""
    from jaxring.aot.memory_check import compiled_peak, gpu_target_available

    ok, why = gpu_target_available()
    if not ok:
        pytest.skip(f"deviceless GPU compile unavailable: {why}")
    w, target = GPU_CASES[name]
    best = search(w, Cluster.of(target, 8)).best
    peak = compiled_peak(w, best.candidate, target=target)
    assert abs(best.memory.total / peak - 1) <= 0.15, (name, best.candidate.describe(), best.memory.total, peak)


@pytest.mark.slow  # about a minute of deviceless compile each
@pytest.mark.parametrize("name", list(GPU_BYTES_CASES))
def test_predicted_bytes_with_packed_documents_on_the_gpu_target(name):
    """The GPU program sends each ring hop's arrays as one buffer, segment ids included, in every layer (not
    hoisted as on CPU): its bytes per axis (its combined async collectives counted whole) equal the cost
    model's for the GPU (cpu=False), within the case's slack. Needs the compile-only CUDA plugin; skips
    elsewhere."""
    from jaxring.analysis import gpu
    from jaxring.aot.memory_check import gpu_target_available

    ok, why = gpu_target_available()
    if not ok:
        pytest.skip(f"deviceless GPU compile unavailable: {why}")
    config = gpt.GPTConfig(vocab_size=128, num_layers=3, hidden=256, num_heads=4, ffn=512)
    (c, slack), w = GPU_BYTES_CASES[name], Workload("gpt", config, 1024, 1, "fp32", documents=True)
    plan = c.check(w, devices=gpu.gpu_devices("h100", c.devices), block_ops="pallas")
    compiled = compile_train_step(
        "gpt", config, plan, batch=1, seq_len=1024, precision="fp32", memory=c.memory.policy, documents=True
    )
    measured = axis_traffic(compiled.as_text(), plan.run_mesh)
    leaves = param_leaves("gpt", config, c.check(w))
    predicted = cost.bytes_by_axes(cost.traffic(w, c, leaves, cpu=False))
    assert set(predicted) == set(measured), name
    assert all(0 <= measured[k] - round(v) <= slack for k, v in predicted.items()), (name, predicted, measured)
