"""What each accelerator can do: peak FLOP/s per dtype, memory, HBM and link bandwidth. The one table that MFU
(`jaxring.train.metrics`), rooflines (`jaxring.analysis.roofline`) and the planner read.

    spec = DEVICES["h200"]                     # by short name
    spec = device_spec_of(jax.devices()[0])    # by jax's device_kind (None: CPU, unknown device)
    spec.peak_flops("bf16")                    # dense peak FLOP/s of a run at this precision

Figures: the vendors' datasheets, dense (no sparsity). NVIDIA: the SXM parts; NVLink 4 (H100/H200) moves 900
GB/s in all, 450 GB/s each way, NVLink 3 (A100) 300 GB/s each way; between nodes one 400 Gb/s (H100/H200,
ConnectX-7) or 200 Gb/s (A100, HDR) NIC per GPU: 50 / 25 GB/s. A figure not known here is None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

import dataclasses

__all__ = ["DEVICES", "DeviceSpec", "device_spec", "device_spec_of"]


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    flops_per_s: dict[str, float]  # dtype name -> dense peak FLOP/s (tensor cores where they apply)
    hbm_bytes_per_s: float | None
    memory_bytes: int | None
    link_bytes_per_s: float | None = None  # to another device of the node, per direction (NVLink)
    nic_bytes_per_s: float | None = None  # default inter-node bandwidth per device and direction
    kinds: tuple[str, ...] = ()  # substrings of jax's `device_kind` that name this device
    fp32_matmuls: str = "tf32"  # the dtype whose peak an fp32 run's matmuls reach (TPUs: bf16 passes)
    torus_dims: int | None = None  # TPUs: the ICI torus' dimensions (2 or 3); each chip has 2 links per dimension
    devices_per_chip: int = 1  # JAX devices per chip (TPU7x: 2)

    @property
    def ici_links(self) -> int | None:
        """ICI links per chip (TPUs), None elsewhere."""
        return None if self.torus_dims is None else 2 * self.torus_dims

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s of a run at `precision` ("bf16" or "fp32", jaxring.core.precision's names)."""
        return self.flops_per_s["bf16" if precision == "bf16" else self.fp32_matmuls]


_HOPPER_FLOPS = {"bf16": 989.4e12, "f16": 989.4e12, "tf32": 494.7e12, "f32": 66.9e12, "fp8": 1978.9e12}
_AMPERE_FLOPS = {"bf16": 312e12, "f16": 312e12, "tf32": 156e12, "f32": 19.5e12}

# The order matters for `device_spec_of`: the first entry with a matching kind wins ("A100" before "A10").
DEVICES = {
    "h100": DeviceSpec("NVIDIA H100 SXM 80GB", _HOPPER_FLOPS, 3.35e12, 80 * 10**9, 450e9, 50e9, kinds=("H100",)),
    "h200": DeviceSpec("NVIDIA H200 SXM 141GB", _HOPPER_FLOPS, 4.8e12, 141 * 10**9, 450e9, 50e9, kinds=("H200",)),
    "a100-80gb": DeviceSpec(
        "NVIDIA A100 SXM 80GB", _AMPERE_FLOPS, 2.039e12, 80 * 10**9, 300e9, 25e9, kinds=("A100-SXM4-80GB", "A100 80GB")
    ),
    "a100-40gb": DeviceSpec("NVIDIA A100 SXM 40GB", _AMPERE_FLOPS, 1.555e12, 40 * 10**9, 300e9, 25e9, kinds=("A100",)),
    "l4": DeviceSpec("NVIDIA L4", {"bf16": 121e12, "tf32": 60e12}, 300e9, 24 * 10**9, kinds=("L4",)),
    "a10": DeviceSpec("NVIDIA A10", {"bf16": 125e12, "tf32": 62e12}, 600e9, 24 * 10**9, kinds=("A10",)),
    # TPUs, per JAX device (a chip; a TPU7x chip shows as two devices, one per TensorCore die, each given half
    # the chip's figures). Memory in GiB as Cloud TPU states it; link_bytes_per_s is one ICI link's one-way
    # bandwidth (what a ring step to a torus neighbour gets), nic_bytes_per_s the data-centre network per chip.
    # Sources: Cloud TPU's system-architecture pages (v5e, v5p, v6e: peak bf16, HBM, ICI per chip, DCN) and, for
    # the one-way per-link ICI figures, the JAX scaling book's TPU table (v5e 4.5e10, v5p and v6e 9e10 B/s);
    # TPU7x (Ironwood): Google's announcement (192 GiB HBM at 7.37 TB/s, 4,614 FP8 TFLOP/s = 2,307 bf16, ICI
    # 1.2 TB/s bidirectional per chip: 100 GB/s one way on each of 6 links).
    "tpu-v5e": DeviceSpec(
        "TPU v5e",
        {"bf16": 197e12},
        819e9,
        16 * 2**30,
        45e9,
        25e9 / 8,
        kinds=("TPU v5 lite", "TPU v5e"),
        fp32_matmuls="bf16",
        torus_dims=2,
    ),
    "tpu-v5p": DeviceSpec(
        "TPU v5p",
        {"bf16": 459e12},
        2.765e12,
        95 * 2**30,
        90e9,
        50e9 / 8,
        kinds=("TPU v5p", "TPU v5"),
        fp32_matmuls="bf16",
        torus_dims=3,
    ),
    "tpu-v6e": DeviceSpec(
        "TPU v6e",
        {"bf16": 918e12},
        1.64e12,
        32 * 2**30,
        90e9,
        100e9 / 8,
        kinds=("TPU v6 lite", "TPU v6e"),
        fp32_matmuls="bf16",
        torus_dims=2,
    ),
    "tpu7x": DeviceSpec(
        "TPU7x (one of a chip's two devices)",
        {"bf16": 2307e12 / 2},
        7.37e12 / 2,
        96 * 2**30,
        100e9,
        None,
        kinds=("TPU7x",),
        fp32_matmuls="bf16",
        torus_dims=3,
        devices_per_chip=2,
    ),
    "tpu-v4": DeviceSpec(
        "TPU v4", {"bf16": 275e12}, 1.2e12, 32 * 2**30, 45e9, kinds=("TPU v4",), fp32_matmuls="bf16", torus_dims=3
    ),
    # simulated CPU devices (tests, the planner without an accelerator): nominal figures; no device_kind matches
    "cpu": DeviceSpec("simulated CPU device", {"bf16": 50e9}, 20e9, 4 * 10**9, 10e9, 10e9),
}


def device_spec(device: str | DeviceSpec) -> DeviceSpec:
    """The spec of a short name in `DEVICES` (a DeviceSpec is returned as it is)."""
    if isinstance(device, DeviceSpec):
        return device
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)} or a DeviceSpec")
    return DEVICES[device]


def device_spec_of(device: jax.Device) -> DeviceSpec | None:
    """The spec of a jax device from its `device_kind`, or None (CPU, a device not in `DEVICES`)."""
    kind = getattr(device, "device_kind", "").lower()
    return next((s for s in DEVICES.values() if any(k.lower() in kind for k in s.kinds)), None)
