"""Roofline estimates: the fastest a compiled program can run on a device, and the MFU that allows.

    est = roofline(flops=3.1e15, bytes_accessed=2.0e12, device="h200", model_flops=2.9e15)
    est.time_s, est.bound, est.mfu

For one device's program (SPMD: every device runs the same one):

  compute_s = flops / peak_flops[dtype]          memory_s = bytes_accessed / hbm_bandwidth
  comm_s    = bytes received over links / link bandwidth (per direction)
  time_s    = max(compute_s, memory_s, comm_s)   if communication overlaps compute (overlap_comm=True)
            = max(compute_s, memory_s) + comm_s  otherwise
  mfu       = model_flops / (time_s * peak_flops[dtype])   (an upper bound: no real step is faster)
  serial_s  = compute_s + memory_s + comm_s      nothing overlaps: every flop at peak, then every byte at
                                                 full bandwidth, then every transfer (serial_mfu from it)

`model_flops` is what MFU counts (e.g. 6·params·tokens plus attention, causal halved: what the training
loop logs); without it the compiled flops are used (a hardware-FLOPs utilisation bound).

`roofline_of(report)` reads a GPU compile report (`gpu.py`):
  flops, bytes   XLA's cost analysis of the optimized per-device module, loop bodies times their trip
                 counts (`gpu.weighted_cost`): every matmul (cuBLAS or Triton GEMM fusion), elementwise op,
                 reduction, copy and transpose; bytes are each op's operands plus results, as XLA counts them
                 (no cache reuse between ops);
  kernel flops   custom kernels are opaque to XLA (their flops are not counted, their bytes only in part):
                 with `causal=` the flash kernels' flops are added from their launches (`gpu.flash_flops`:
                 the matmuls each kernel runs, 9 per (query, key, dim) for fwd + dq + dkv against the usual
                 7, since the dq and dkv kernels both recompute S and dP; half of them for causal);
  comm bytes     collective bytes received per device from the compiled HLO (`compiled.collective_traffic`).
What it leaves out: kernel launch and synchronisation latency, the tensor cores' efficiency below peak
(tile shapes, pipeline bubbles: real kernels reach a fraction of it), HBM efficiency below peak, imbalance
between devices (a causal ring with the contiguous layout; blocks a ring skips at run time are counted as
run), NVLink latency, and the host (data loading, Python dispatch). So `mfu` bounds what a real step can
reach; a measured MFU on the GPU will be lower.

Peak figures, HBM and link bandwidth: `jaxring.core.accelerators` (the link bandwidth is per direction).
"""

from __future__ import annotations

import dataclasses

from jaxring.analysis.compiled import CompiledStats, collective_traffic
from jaxring.analysis.hlo_cost import flash_flops
from jaxring.core.accelerators import DeviceSpec, device_spec


@dataclasses.dataclass(frozen=True)
class Roofline:
    device: str
    dtype: str
    flops: float
    bytes_accessed: float
    comm_bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    time_s: float
    bound: str  # "compute", "memory" or "communication"
    model_flops: float
    mfu: float  # model_flops / (time_s * peak): the best MFU this program allows
    serial_s: float = 0.0  # compute_s + memory_s + comm_s: nothing overlapped
    serial_mfu: float = 0.0  # model_flops / (serial_s * peak)

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes_accessed if self.bytes_accessed else float("inf")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"arithmetic_intensity": self.arithmetic_intensity}


def roofline(
    flops: float,
    bytes_accessed: float,
    device: str | DeviceSpec = "h200",
    dtype: str = "bf16",
    *,
    comm_bytes: float = 0.0,
    overlap_comm: bool = True,
    model_flops: float | None = None,
) -> Roofline:
    """The roofline time of one device's program and the MFU it allows (see the module docstring)."""
    dev = device_spec(device)
    if dtype not in dev.flops_per_s:
        raise ValueError(f"dtype {dtype!r} has no peak for {dev.name}; expected one of {', '.join(dev.flops_per_s)}")
    for name, value in (("flops", flops), ("bytes_accessed", bytes_accessed), ("comm_bytes", comm_bytes)):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    for name in ("hbm_bytes_per_s", "link_bytes_per_s"):
        if getattr(dev, name) is None:
            raise ValueError(f"{dev.name} has no {name} in jaxring.core.accelerators; pass a DeviceSpec that states it")
    top = dev.flops_per_s[dtype]
    compute_s, memory_s = flops / top, bytes_accessed / dev.hbm_bytes_per_s
    comm_s = comm_bytes / dev.link_bytes_per_s
    local = max(compute_s, memory_s)
    time_s = max(local, comm_s) if overlap_comm else local + comm_s
    bound = "compute" if compute_s >= memory_s else "memory"
    if overlap_comm and comm_s > local:
        bound = "communication"
    model = flops if model_flops is None else float(model_flops)
    mfu = model / (time_s * top) if time_s > 0 else 0.0
    serial_s = compute_s + memory_s + comm_s
    serial_mfu = model / (serial_s * top) if serial_s > 0 else 0.0
    return Roofline(
        dev.name,
        dtype,
        float(flops),
        float(bytes_accessed),
        float(comm_bytes),
        compute_s,
        memory_s,
        comm_s,
        time_s,
        bound,
        model,
        mfu,
        serial_s,
        serial_mfu,
    )


def roofline_of(
    report: CompiledStats,
    device: str | DeviceSpec | None = None,
    dtype: str = "bf16",
    *,
    causal: bool | None = None,
    extra_flops: float = 0.0,
    extra_bytes: float = 0.0,
    model_flops: float | None = None,
    overlap_comm: bool = True,
) -> Roofline:
    """Roofline of a `gpu.GpuCompileReport`: XLA's flops/bytes of the module (loops weighted by their trip
    counts), plus the flash kernels' flops when `causal` is given (True/False: the attention's masking), plus
    `extra_flops`/`extra_bytes` for other opaque kernels."""
    if not report.cost:
        raise ValueError("the report has no cost analysis (flops, bytes accessed)")
    kernels = 0.0 if causal is None else flash_flops(report.hlo, causal=causal)
    moved, _ = collective_traffic(report.hlo, max(report.num_devices, 1))
    return roofline(
        report.cost["flops"] + kernels + extra_flops,
        report.cost["bytes accessed"] + extra_bytes,
        device or report.target,
        dtype,
        comm_bytes=sum(moved.values()),
        overlap_comm=overlap_comm,
        model_flops=model_flops,
    )


def attention_flops(
    batch: int,
    q_len: int,
    kv_len: int,
    q_heads: int,
    head_dim: int,
    *,
    causal: bool,
    backward: bool = True,
    recompute: bool = True,
) -> float:
    """Matmul FLOPs of attention (the FlashAttention papers' count): forward 4·b·h·Sq·Skv·d (QKᵀ and PV),
    causal halved; the backward adds 2.5× the forward with recomputation of QKᵀ (2× without)."""
    fwd = 4.0 * batch * q_heads * q_len * kv_len * head_dim * (0.5 if causal else 1.0)
    if not backward:
        return fwd
    return fwd * (3.5 if recompute else 3.0)
