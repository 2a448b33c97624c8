"""Choosing devices: the accelerator when there is one, else N simulated CPU devices."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import jax


def max_cpu_devices() -> int:
    """The most simulated CPU devices jaxring starts: 64 per host core, at most 4096 (at least 8).

    Why: XLA:CPU runs every simulated device's program on a thread of its own, and each collective waits
    for all of them; far beyond the cores, start-up and every collective crawl (`--cpu-devices 100000` sat
    for minutes before doing anything), so a larger count is a mistake to report, not a run to attempt.
    """
    return max(8, min(4096, 64 * (os.cpu_count() or 1)))


def check_cpu_devices(count: int | str, flag: str = "--cpu-devices") -> int:
    """`count` if it is a sensible number of simulated CPU devices; else ValueError in one line."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{flag} {count!r} must be a positive integer (simulated CPU devices)")
    bound = max_cpu_devices()
    if count > bound:
        raise ValueError(
            f"{flag} {count} is more simulated CPU devices than this host can run ({bound}: 64 per core, at most "
            f"4096; each simulated device is a thread that every collective waits for)"
        )
    return count


def use_simulated_devices() -> None:
    """What simulating devices on the CPU needs, asked for explicitly by the entry points that do it
    (`use_cpu_devices_if_no_accelerator` below: train.py, the notebooks, the benchmarks; tests/conftest.py):
    every CPU collective-permute lowered with its own channel id (`collectives.own_channel_per_cpu_permute`,
    which replaces JAX's CPU lowering of ppermute for the whole process). Idempotent; harmless on GPU/TPU."""
    from jaxring.collectives import own_channel_per_cpu_permute

    own_channel_per_cpu_permute()


def use_cpu_devices_if_no_accelerator(count: int) -> list:
    """Asks for `count` CPU devices (only the CPU backend reads this) and returns the devices to use.

    Must run before anything queries JAX's devices; on a GPU/TPU machine the accelerators are returned.
    Also calls `use_simulated_devices`.
    """
    check_cpu_devices(count)
    use_simulated_devices()
    with contextlib.suppress(RuntimeError):  # a backend already started: keep what it has
        jax.config.update("jax_num_cpu_devices", count)
    return jax.devices()


def describe_devices(devices: Sequence[jax.Device]) -> str:
    d = devices[0]
    kind = getattr(d, "device_kind", d.platform)
    return f"{len(devices)} x {kind} ({d.platform})"


def benchmark_record(name: str, devices: Sequence[jax.Device], config: dict) -> dict:
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
