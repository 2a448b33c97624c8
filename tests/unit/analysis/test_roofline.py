"""The roofline's inputs from a compiled program: FLOPs and bytes with loop bodies weighted by trip counts.

XLA's own cost analysis counts a `while` body once; `gpu.weighted_cost` multiplies each body by its trip
count (nested loops too). Checked on CPU-compiled programs whose matmul count is known.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jaxring.analysis.gpu import weighted_cost
from jaxring.analysis.roofline import roofline

M, K, LAYERS = 32, 64, 7
MATMUL = 2 * M * K * K  # flops of one [M, K] @ [K, K]


def _layers(h, ws):
    return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)[0]


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def _bookkeeping(iterations: int, loops: int) -> int:
    """Scalar flops of the loop counters (an add per iteration, a compare per entry): an upper bound."""
    return 2 * (iterations + loops)


def test_scan_body_counted_once_per_iteration():
    x, ws = jnp.ones((M, K)), jnp.ones((LAYERS, K, K))
    compiled = _compiled(_layers, x, ws)
    cost = weighted_cost(compiled.as_text())
    assert cost["loops_weighted"] == 1.0
    assert LAYERS * MATMUL <= cost["flops"] <= LAYERS * MATMUL + _bookkeeping(LAYERS, 1)
    assert cost["transcendentals"] == LAYERS * M * K  # one tanh per element per layer
    xla_once = compiled.cost_analysis()["flops"]  # XLA's own: the body once
    assert xla_once < 2 * MATMUL
    # every layer reads its weight block: at least the stack's bytes
    assert cost["bytes accessed"] >= LAYERS * K * K * 4


def test_nested_loops_multiply():
    x, ws = jnp.ones((M, K)), jnp.ones((LAYERS, K, K))
    repeat = 3

    def twice_nested(h, ws):
        return lax.scan(lambda h, _: (_layers(h, ws), None), h, None, length=repeat)[0]

    cost = weighted_cost(_compiled(twice_nested, x, ws).as_text())
    matmuls = repeat * LAYERS * MATMUL
    assert matmuls <= cost["flops"] <= matmuls + _bookkeeping(repeat * LAYERS + repeat, repeat + 1)
    assert cost["transcendentals"] == repeat * LAYERS * M * K


def test_not_a_module_is_refused():
    with pytest.raises(ValueError, match="HloModule"):
        weighted_cost("ENTRY %main () -> f32[] {}")


def test_serial_time_adds_compute_memory_and_links():
    est = roofline(989.4e12, 4.8e12, "h200", comm_bytes=450e9, model_flops=0.5 * 989.4e12)
    assert est.serial_s == pytest.approx(est.compute_s + est.memory_s + est.comm_s)
    assert est.serial_mfu == pytest.approx(0.5 * est.compute_s / est.serial_s)
    assert est.serial_mfu < est.mfu


def test_mfu_peak_is_the_device_tables():
    """The training loop's MFU divides by jaxring.core.accelerators' peak: by device_kind, A100 before A10, fp32 runs at
    TF32 on NVIDIA and bf16 on TPUs, none on CPU; roofline reads the same table."""
    from jaxring.core.accelerators import DEVICES
    from jaxring.train.metrics import peak_flops

    kind = lambda name: type("Device", (), {"device_kind": name})
    assert peak_flops(kind("NVIDIA H200"), "bf16") == DEVICES["h200"].flops_per_s["bf16"] == 989.4e12
    assert peak_flops(kind("NVIDIA A100-SXM4-40GB"), "fp32") == 156e12
    assert peak_flops(kind("NVIDIA A10G"), "bf16") == 125e12
    assert peak_flops(kind("TPU v5 lite"), "fp32") == 197e12
    assert peak_flops(kind("cpu"), "bf16") is None
    assert roofline(989.4e12, 0.0, "h100").time_s == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no link_bytes_per_s"):
        roofline(1.0, 1.0, "l4", dtype="bf16")
