"""Deviceless GPU compiles (H200): flash kernels without spills, ring transfers overlapping the block compute.

The compile tests need the compile-only CUDA plugin (`pip install -e ".[dev,gpu-compile]"`, its own venv);
elsewhere they skip and say why. The parsers (ptxas output, scheduled HLO) and the roofline run everywhere.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxring.analysis import gpu
from jaxring.analysis.roofline import attention_flops, roofline
from jaxring.core.accelerators import DEVICES

AVAILABLE, WHY = gpu.available()
needs_plugin = pytest.mark.skipif(not AVAILABLE, reason=f"deviceless GPU compile unavailable: {WHY}")


# ------------------------------------------------------------------------------ everywhere (plain install)


def test_target_configs_ship_as_package_data():
    for target in gpu.TARGETS:
        text = gpu.target_config(target)
        assert "gpu_device_info" in text and "sm_9.0a" in text
        assert "collective_memory_granularity:" not in text  # a field unknown to jax 0.10.2's XLA
    assert "H200" in gpu.target_config("h200") and "H100" in gpu.target_config("h100")
    with pytest.raises(ValueError, match="unknown GPU target 'a100'"):
        gpu.target_config("a100")


def test_unavailable_reason_names_what_is_missing():
    if not AVAILABLE:
        assert "plugin" in WHY or "jax_platforms" in WHY or "topology" in WHY


PTXAS_OUTPUT = """\
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the wgmma pipeline in the function 'k_bad'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_bad' for 'sm_90a'
ptxas info    : Function properties for k_bad
    24 bytes stack frame, 24 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size
ptxas info    : Compiling entry function 'k_good' for 'sm_90a'
ptxas info    : Function properties for k_good
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
"""


def test_ptxas_output_parsing():
    info = gpu.parse_ptxas(PTXAS_OUTPUT)
    assert info["k_bad"]["registers"] == 255 and info["k_bad"]["wgmma_serialized"]
    assert (info["k_bad"]["spill_stores"], info["k_bad"]["spill_loads"]) == (24, 20)
    assert info["k_good"]["registers"] == 168 and not info["k_good"]["wgmma_serialized"]
    assert info["k_good"]["spill_stores"] == 0


SCHEDULED_HLO = """\
HloModule m, is_scheduled=true

%kernel_body (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %cc = f32[4]{0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton"
}

%body (param: (s32[], f32[4], f32[4])) -> (s32[], f32[4], f32[4]) {
  %param = (s32[], f32[4]{0}, f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%param), index=1
  %y = f32[4]{0} get-tuple-element(%param), index=2
  %cp-start = (f32[4]{0}, f32[4]{0}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %k = f32[4]{0} fusion(%x), kind=kCustom, calls=%kernel_body
  %cp-done = f32[4]{0} collective-permute-done(%cp-start)
  %cp-start.1 = (f32[4]{0}, f32[4]{0}) collective-permute-start(%k), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %cp-done.1 = f32[4]{0} collective-permute-done(%cp-start.1)
  %i = s32[] get-tuple-element(%param), index=0
  ROOT %t = (s32[], f32[4]{0}, f32[4]{0}) tuple(%i, %cp-done, %cp-done.1)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %c = s32[] constant(0)
  %init = (s32[], f32[4]{0}, f32[4]{0}) tuple(%c, %a, %a)
  %w = (s32[], f32[4]{0}, f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_schedule_analysis_finds_transfers_that_span_compute():
    (loop,) = gpu.communication_loops(SCHEDULED_HLO)
    assert loop.trip_count == 3 and loop.compute == ["k"]
    first, second = loop.collectives
    assert first.spans == ["k"] and first.spans_compute
    assert second.spans == [] and not second.spans_compute  # started after the kernel, done right away
    assert not loop.overlapped


def test_roofline():
    h200 = DEVICES["h200"]
    est = roofline(2 * 989.4e12, 1.0e12, "h200")  # 2 s of compute, 0.21 s of HBM
    assert est.bound == "compute" and est.time_s == pytest.approx(2.0) and est.mfu == pytest.approx(1.0)
    est = roofline(989.4e12, 9.6e12, "h200", model_flops=0.5 * 989.4e12)  # 1 s compute, 2 s memory
    assert est.bound == "memory" and est.time_s == pytest.approx(2.0) and est.mfu == pytest.approx(0.25)
    est = roofline(989.4e12, 0.0, h200, comm_bytes=900e9, overlap_comm=False)  # + 2 s on the links
    assert est.time_s == pytest.approx(3.0)
    assert roofline(989.4e12, 0.0, h200, comm_bytes=900e9).bound == "communication"
    assert attention_flops(1, 1024, 1024, 8, 64, causal=True, backward=False) == 2 * 1024 * 1024 * 8 * 64
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        roofline(1.0, 1.0, "tpu")


# ------------------------------------------------------------------------------- with the CUDA plugin


def _fwd_bwd(local):
    def run(q, k, v, dout):
        out, vjp = jax.vjp(local, q, k, v)
        return out, vjp(dout)

    return run


@needs_plugin
@pytest.mark.parametrize("head_dim,kv_heads", [(64, 8), (128, 8), (128, 2)], ids=["d64", "d128", "d128-gqa"])
def test_flash_kernels_compile_without_spills_or_serialized_wgmma(head_dim, kv_heads):
    """The three kernels compile for sm_90a with XLA failing the compile on any register spill. Where XLA dumps
    their PTX (jax 0.10's), ptxas's registers and wgmma notes are checked too; XLA of jax 0.11 and 0.12 dumps
    none for Triton kernels, so there the spill check is XLA's (shown to fire by the test below)."""
    from jaxring.kernels.flash import flash_attention

    mesh = Mesh(np.array(gpu.gpu_devices("h200", 1)), ("x",))
    q = gpu.abstract((1, 4096, 8, head_dim), jnp.bfloat16, mesh)
    kv = gpu.abstract((1, 4096, kv_heads, head_dim), jnp.bfloat16, mesh)
    local = lambda q, k, v: flash_attention(q, k, v, causal=True, implementation="pallas")
    report = gpu.compile_for_gpu(jax.jit(_fwd_bwd(local)), q, kv, kv, q, ptxas="jaxring_", fail_on_spills=True)
    kernels = {k.name: k for k in report.custom_kernels()}
    assert set(kernels) == {"jaxring_flash_fwd", "jaxring_flash_dkv", "jaxring_flash_dq"}
    for k in kernels.values():
        assert k.shared_memory > 0 and k.threads[0] in (128, 256), k
        if k.registers is not None:  # the PTX was dumped and read by ptxas
            assert k.spills == 0, (k.name, k.spill_stores, k.spill_loads, k.registers)
            assert not k.wgmma_serialized, (k.name, k.ptxas_notes)
            assert k.registers <= 255


@needs_plugin
def test_a_kernel_that_spills_fails_the_spill_checked_compile():
    """fp32 at head dim 256 in 64 x 64 tiles needs more than 255 registers a thread: compiled with
    fail_on_spills the compile fails, without it it compiles (so the check above can fail)."""
    from jaxring.kernels.flash import flash_attention

    mesh = Mesh(np.array(gpu.gpu_devices("h100", 1)), ("x",))
    q = gpu.abstract((1, 1024, 2, 256), jnp.float32, mesh)
    local = lambda q: flash_attention(q, q, q, causal=True, implementation="pallas", block_q=64, block_k=64)
    assert gpu.compile_for_gpu(jax.jit(local), q, ptxas=False).custom_kernels()
    with pytest.raises(Exception, match="register spilling"):
        gpu.compile_for_gpu(jax.jit(local), q, ptxas=False, fail_on_spills=True)


def _strategy(name, devices):
    from jaxring.parallel.sequence.ring import ring_attention
    from jaxring.parallel.sequence.usp import usp_attention
    from jaxring.parallel.sequence.wallfacer import WF_AXES, wallfacer_attention, wallfacer_mesh

    flat = Mesh(np.array(gpu.gpu_devices("h200", devices)), ("sp",))
    if name == "ring":
        return flat, "sp", functools.partial(ring_attention, axis_name="sp", layout="zigzag", block_ops="pallas")
    if name == "wallfacer":
        return (
            wallfacer_mesh(flat, 2),
            WF_AXES,
            functools.partial(wallfacer_attention, team_size=2, layout="zigzag", block_ops="pallas"),
        )
    mesh = Mesh(np.array(flat.devices).reshape(devices // 2, 2), ("ring", "ulysses"))
    return (
        mesh,
        ("ring", "ulysses"),
        functools.partial(usp_attention, axis_name=("ring", "ulysses"), layout="zigzag", block_ops="pallas"),
    )


@needs_plugin
@pytest.mark.parametrize("strategy,devices", [("ring", 8), ("wallfacer", 16), ("usp", 8)])
def test_ring_transfers_span_the_block_compute_forward_and_backward(strategy, devices):
    """In every ring loop of the compiled H200 program (forward and backward), each transfer of the next
    blocks (K/V; in the backward with the dK/dV, or WallFacer's Q-side and dQ, accumulators) is started
    before the block kernels and waited for after them."""
    mesh, axes, local = _strategy(strategy, devices)
    spec = P(None, axes)
    # 4096 tokens per device: K, V, dK, dV of one step (48 MiB) exceed XLA's ~30 MiB permute-combining limit
    x = gpu.abstract((1, 4096 * devices, 8, 128), jnp.bfloat16, mesh, spec)
    run = jax.shard_map(_fwd_bwd(local), mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, (spec,) * 3))
    report = gpu.compile_for_gpu(jax.jit(run), x, x, x, x, ptxas=False)
    assert len(report.loops) == 2, report.summary()  # the forward ring and the backward ring
    for loop in report.loops:
        assert loop.compute and not loop.sync_collectives, report.summary()
        permutes = [c for c in loop.collectives if c.kind == "collective-permute"]
        assert len(permutes) == 1, report.summary()  # one fused transfer per step
        assert permutes[0].spans_compute and loop.overlapped, report.summary()


@needs_plugin
def test_metp_inner_ring_transfers_span_the_block_compute_forward_and_backward():
    """METP attention (Algorithms 3-6) on 8 H200s with the flash kernel: in each head group's inner ring,
    forward and backward, every hop (K, V, positions; in the backward with the previous block's fp32 ΔK/ΔV,
    one hop behind) is one transfer started before the block kernels and waited for after them."""
    from jaxring.parallel.tensor.metp_mha import metp_attention

    p, hidden, heads, head_dim, local_seq = 8, 1024, 8, 128, 2048  # one head per group
    mesh = Mesh(np.array(gpu.gpu_devices("h200", p)), ("tp",))
    rows, cols = P(None, "tp"), P("tp", None)
    x = gpu.abstract((1, local_seq * p, hidden), jnp.bfloat16, mesh, rows)
    w = gpu.abstract((hidden, heads * head_dim), jnp.bfloat16, mesh, rows)
    wo = gpu.abstract((heads * head_dim, hidden), jnp.bfloat16, mesh, cols)
    pos = gpu.abstract((1, local_seq * p), jnp.int32, mesh, rows)

    def local(x, wq, wk, wv, wo, positions, do):
        attend = lambda *a: metp_attention(*a, positions, num_heads=heads, block_ops="pallas")
        out, vjp = jax.vjp(attend, x, wq, wk, wv, wo)
        return out, vjp(do)

    run = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, rows, cols, rows, rows),
        out_specs=(rows, (rows, rows, rows, rows, cols)),
    )
    report = gpu.compile_for_gpu(jax.jit(run), x, w, w, w, wo, pos, x, ptxas=False)
    block = local_seq * (heads // p) * head_dim  # elements of one K (or V) block
    hop = {
        "forward": 2 * 2 * block + 4 * local_seq,  # K, V bf16 + positions int32
        "backward": 2 * 2 * block + 2 * 4 * block + 4 * local_seq,
    }  # + ΔK, ΔV fp32

    def size(c):  # (u8[N], u8[N]): one fused buffer
        arrays = set(re.findall(r"(\w+)\[([\d,]*)\]", c.shape))
        return int(arrays.pop()[1]) if len(arrays) == 1 and tuple(a[0] for a in arrays) == ("u8",) else None

    for direction, nbytes in hop.items():
        rings = [
            loop
            for loop in report.loops  # the inner rings' step loops
            if loop.collectives and all(size(c) == nbytes for c in loop.collectives)
        ]
        assert rings, (direction, nbytes, report.summary())
        for loop in rings:
            assert len(loop.collectives) == 1 and not loop.sync_collectives, report.summary()
            transfer = loop.collectives[0]
            assert transfer.spans_compute and loop.overlapped, report.summary()
            assert any(op.startswith("conditional") for op in transfer.spans), report.summary()  # block kernels
    fused = [c for loop in report.loops for c in loop.collectives] + list(report.entry.collectives)
    fused = [c for c in fused if size(c) is not None]  # with the peeled first and last hops
    assert len(fused) >= 8 and all(c.spans_compute for c in fused), report.summary()
