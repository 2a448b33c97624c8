"""What a training run reports: per-device peak FLOP/s for MFU, device memory, the progress bar."""
from __future__ import annotations

import jax

# dense bf16 (fp32: TF32) peak FLOP/s per device, by jax device_kind substring
PEAK_FLOPS = {"H200": (989e12, 495e12), "H100": (989e12, 495e12), "A100": (312e12, 156e12),
              "L4": (121e12, 60e12), "A10": (125e12, 62e12), "TPU v5p": (459e12, 459e12),
              "TPU v5 lite": (197e12, 197e12), "TPU v4": (275e12, 275e12)}


def peak_flops(device, precision: str):
    """Per-device peak FLOP/s for MFU, or None (CPU, unknown device)."""
    kind = getattr(device, "device_kind", "")
    for name, (bf16, fp32) in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return bf16 if precision == "bf16" else fp32
    return None


def peak_memory_bytes():
    """Peak bytes in use on the first local device, or None where the backend does not say (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


PROFILE_STEPS = 3


def profile_steps(start: int, end: int) -> tuple[int, int] | None:
    """[first, last) steps to trace: up to PROFILE_STEPS steps after the first one of this run (which
    compiles), or the first step itself when the run is that short."""
    if end <= start:
        return None
    first = start + 1 if end - start > 1 else start
    return first, min(first + PROFILE_STEPS, end)


def progress_bar(cfg, start: int, is_main: bool):
    """A tqdm bar over the run's steps (None when progress is off or on other hosts)."""
    if not (cfg.progress and is_main):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=cfg.steps, initial=start, desc="train", dynamic_ncols=True)
