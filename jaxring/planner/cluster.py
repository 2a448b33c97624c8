"""The cluster a plan runs on: the device (peak FLOP/s, HBM, memory), how many share a node, the links.

    cluster = Cluster.of("h200", devices=64)                       # 8 per node, NVLink + 8×400 Gb/s IB
    cluster = Cluster.of("tpu-v5p", devices=64)                    # one ICI slice: a ring step on one link
    cluster = Cluster.of("a100-40gb", devices=32, devices_per_node=8, inter_bw=100e9 / 8 / 8)

Bandwidths are bytes per second per device and direction: what one device can receive while all of them
communicate. NVLink: H100/H200 450 GB/s (NVLink 4, 900 GB/s both ways), A100 300 GB/s (NVLink 3). Between
nodes the default is one 400 Gb/s (H100/H200, ConnectX-7) or 200 Gb/s (A100, HDR) NIC per GPU: 50 / 25 GB/s.
Latency per message: 10 µs within a node, 20 µs across (NCCL's small-message times are of this order).
The compute efficiency (fraction of dense bf16 peak a step's FLOPs run at) is stated, default 0.5.
"""

from __future__ import annotations

import dataclasses
import math

from jaxring.core.accelerators import DEVICES as PEAKS


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    flops: float  # dense bf16 peak FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float  # per direction
    nic_bytes_per_s: float  # default inter-node bandwidth per device and direction
    # to and from its host's pinned memory, per direction (what --offload moves): PCIe Gen5 x16 is 64 GB/s
    # nominal for an H100/H200 SXM, Gen4 x16 32 GB/s for an A100; pinned copies reach about 80% of it
    host_bytes_per_s: float = 50e9
    # TPUs: every device of a slice is on the ICI torus (one "node"); nvlink_bytes_per_s is one ICI link's
    # one-way bandwidth, what a ring along a torus axis gets per step
    ici: bool = False


def _tpu(name: str) -> Device:
    """A TPU of `jaxring.core.accelerators` as a planner device: the host link is PCIe, about 15 GB/s per chip
    (the JAX scaling book's figure for v5e/v6e hosts; taken for every TPU here)."""
    p = PEAKS[name]
    return Device(
        p.name,
        p.flops_per_s["bf16"],
        p.hbm_bytes_per_s,
        p.memory_bytes,
        p.link_bytes_per_s,
        p.nic_bytes_per_s or p.link_bytes_per_s,
        15e9,
        ici=True,
    )


DEVICES = {
    "h100": Device(
        PEAKS["h100"].name,
        PEAKS["h100"].flops_per_s["bf16"],
        PEAKS["h100"].hbm_bytes_per_s,
        PEAKS["h100"].memory_bytes,
        PEAKS["h100"].link_bytes_per_s,
        50e9,
    ),
    "h200": Device(
        PEAKS["h200"].name,
        PEAKS["h200"].flops_per_s["bf16"],
        PEAKS["h200"].hbm_bytes_per_s,
        PEAKS["h200"].memory_bytes,
        PEAKS["h200"].link_bytes_per_s,
        50e9,
    ),
    # NVIDIA's A100 SXM datasheet: 312 TFLOP/s dense bf16, HBM2 1.555 / HBM2e 2.039 TB/s, NVLink 3 600 GB/s
    "a100-40gb": Device("NVIDIA A100 SXM 40GB", 312e12, 1.555e12, 40 * 10**9, 300e9, 25e9, 25e9),
    "a100-80gb": Device("NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 80 * 10**9, 300e9, 25e9, 25e9),
    **{name: _tpu(name) for name in ("tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu7x")},
    # simulated CPU devices (tests, train.py --plan auto without an accelerator): nominal figures
    "cpu": Device("simulated CPU device", 50e9, 20e9, 4 * 10**9, 10e9, 10e9, 10e9),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    device: Device
    devices: int
    devices_per_node: int
    intra_bw: float
    inter_bw: float
    intra_latency: float = 10e-6
    inter_latency: float = 20e-6
    efficiency: float = 0.5
    memory_fraction: float = 0.9  # of device memory a plan may use (the rest: allocator, runtime, fragments)
    host_memory: float = math.inf  # host bytes per device a plan's --offload may keep there (`Memory.host`)

    @classmethod
    def of(
        cls,
        device: str,
        devices: int,
        *,
        devices_per_node: int | None = None,
        intra_bw: float | None = None,
        inter_bw: float | None = None,
        efficiency: float = 0.5,
        memory_fraction: float = 0.9,
        memory_bytes: float | None = None,
        host_memory: float = math.inf,
    ) -> Cluster:
        if device not in DEVICES:
            raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
        if not _is_int(devices) or devices < 1:
            raise ValueError(f"devices {devices!r} must be a positive integer")
        spec = DEVICES[device]
        default_per_node = devices if spec.ici else min(devices, 8)  # a TPU slice: one ICI domain
        per_node = default_per_node if devices_per_node is None else devices_per_node
        if not _is_int(per_node) or per_node < 1:
            raise ValueError(f"devices per node {per_node!r} must be a positive integer")
        if devices > per_node and devices % per_node:
            raise ValueError(
                f"devices per node {per_node} does not divide the {devices} devices (nodes hold the same number "
                f"of devices)"
            )
        for name, value in (("efficiency", efficiency), ("memory fraction", memory_fraction)):
            if not _is_number(value) or not 0 < value <= 1:
                raise ValueError(f"{name} {value!r} must be a number in (0, 1]")
        if memory_bytes is not None:
            if not _is_number(memory_bytes) or not math.isfinite(memory_bytes) or memory_bytes <= 0:
                raise ValueError(f"memory bytes {memory_bytes!r} must be a finite number > 0")
            spec = dataclasses.replace(spec, memory_bytes=memory_bytes)
        for name, value in (("intra_bw", intra_bw), ("inter_bw", inter_bw)):
            if value is not None and (not _is_number(value) or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} {value!r} must be a finite number > 0 (bytes per second)")
        return cls(
            spec,
            devices,
            per_node,
            spec.nvlink_bytes_per_s if intra_bw is None else intra_bw,
            spec.nic_bytes_per_s if inter_bw is None else inter_bw,
            efficiency=efficiency,
            memory_fraction=memory_fraction,
            host_memory=host_memory,
        )

    @property
    def cpu(self) -> bool:
        """Simulated CPU devices: the program takes the CPU path (jnp block ops, f32 collectives)."""
        return self.device is DEVICES["cpu"] or self.device.name == DEVICES["cpu"].name

    @property
    def usable_memory(self) -> float:
        return self.device.memory_bytes * self.memory_fraction

    def describe(self) -> str:
        nodes = -(-self.devices // self.devices_per_node)
        return (
            f"{self.devices} × {self.device.name} ({nodes} node{'s' * (nodes > 1)} of {self.devices_per_node}), "
            f"{self.intra_bw / 1e9:g} GB/s within a node, {self.inter_bw / 1e9:g} GB/s across, compute at "
            f"{self.efficiency:.0%} of {self.device.flops / 1e12:g} TFLOP/s, "
            f"{self.usable_memory / 2**30:.1f} GiB usable"
        )
