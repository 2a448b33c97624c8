"""Choosing devices: the accelerator when there is one, else N simulated CPU devices."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence

import jax

from jaxring.core.collectives import own_channel_per_cpu_permute


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
    devices = jax.devices()
    no_compilation_cache_on_simulated_devices(devices)
    return devices


CACHE_OFF = (
    "jaxring: the persistent compilation cache ({where}) is off on {count} simulated CPU devices: an XLA:CPU "
    "program read back from it can run its collectives in a different order on different devices and hang "
    "(train.py's default run did, 3 times in 3); it stays on for accelerators"
)


def no_compilation_cache_on_simulated_devices(devices: Sequence[jax.Device]) -> bool:
    """Turns JAX's persistent compilation cache off when `devices` are several simulated CPU devices and a cache
    directory is set (`JAX_COMPILATION_CACHE_DIR`), with one line on stderr; returns whether it did.

    Why: XLA:CPU runs each simulated device's program on its own thread and every collective waits for all of
    them. A step read back from the cache (same HLO) ran two independent collectives in different orders on
    different devices: the first run of `python train.py --steps 3` with the cache set passed, the second
    waited at a collective-permute on one device and an all-reduce on the seven others until XLA's rendezvous
    timeout aborted the process (jax 0.10.2, with or without jaxring's own CPU ppermute lowering). A compiled
    program is cheap to rebuild on small CPU shapes; a hang is not. Must run before the first compile.
    """
    where = jax.config.jax_compilation_cache_dir
    if len(devices) < 2 or devices[0].platform != "cpu" or not where or not jax.config.jax_enable_compilation_cache:
        return False
    jax.config.update("jax_enable_compilation_cache", False)
    print(CACHE_OFF.format(where=where, count=len(devices)), file=sys.stderr)
    return True


def describe_devices(devices: Sequence[jax.Device]) -> str:
    """'8 x NVIDIA H100 80GB HBM3 (gpu)'; devices of a compile-only topology (not among this process's
    devices: `jaxring.analysis.gpu`) are marked '(gpu, deviceless compile)'."""
    d = devices[0]
    kind = getattr(d, "device_kind", d.platform)
    try:
        attached = d in jax.devices(d.platform)
    except RuntimeError:  # no backend of that platform in this process
        attached = False
    return f"{len(devices)} x {kind} ({d.platform}{'' if attached else ', deviceless compile'})"
