"""Choosing devices: the accelerator when there is one, else N simulated CPU devices."""

from __future__ import annotations

import jax


def use_cpu_devices_if_no_accelerator(count: int) -> list:
    """Asks for `count` CPU devices (only the CPU backend reads this) and returns the devices to use.

    Must run before anything queries JAX's devices; on a GPU/TPU machine the accelerators are returned.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"--cpu-devices {count!r} must be a positive integer (simulated CPU devices)")
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # a backend already started: keep what it has
        pass
    return jax.devices()


def describe_devices(devices) -> str:
    d = devices[0]
    kind = getattr(d, "device_kind", d.platform)
    return f"{len(devices)} x {kind} ({d.platform})"


def benchmark_record(name: str, devices, config: dict) -> dict:
    """The header every benchmark result file carries: what ran, where, with which versions."""
    import os
    import platform
    import sys

    import numpy as np

    return {
        "benchmark": name,
        "command": " ".join(["python"] + sys.argv),
        "device": describe_devices(devices),
        "host_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "numpy": np.__version__,
        "config": config,
        "results": [],
    }


def save_record(record: dict, path: str) -> None:
    """Writes a benchmark record as JSON (after every row, so a long run keeps what it measured)."""
    import json
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
