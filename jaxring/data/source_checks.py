"""What the token and image sources share (numpy only, no JAX): the splits, and the one-line checks of a data
path (a regular file or directory), a split, a host's share of a batch, and a seed and step."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np

SPLITS = ("train", "val")


def check_regular(path: Path, what: str) -> None:
    """Only regular files (and directories, of which only the regular files are read) are data: a FIFO would
    block the read for ever, a device such as /dev/zero never ends. ValueError in one line otherwise."""
    if path.is_dir() or path.is_file():  # (is_file: a regular file, through symlinks)
        return
    mode = path.stat().st_mode
    kind = (
        "a named pipe (FIFO)"
        if stat.S_ISFIFO(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a regular file"
    )
    raise ValueError(f"{what} {str(path)!r} is {kind}: give a regular file or a directory of them")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} must be one of {SPLITS}")


def check_hosts(batch_size: int, process_index: int, process_count: int) -> int:
    """The rows each host reads (batch_size / process_count); ValueError (one line) for a bad split."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size {batch_size!r} must be a positive integer")
    if not isinstance(process_count, int) or process_count < 1:
        raise ValueError(f"process_count {process_count!r} must be a positive integer")
    if not isinstance(process_index, int) or not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index!r} must be in [0, process_count={process_count})")
    if batch_size % process_count:
        raise ValueError(
            f"batch_size {batch_size} is not divisible by process_count {process_count}: "
            f"each host takes batch_size / process_count rows"
        )
    return batch_size // process_count


def check_seed_step(seed: int, step: int) -> None:
    """ValueError (one line) unless the seed and the step are non-negative integers."""
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed {seed!r} must be a non-negative integer")
    if not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step {step!r} must be a non-negative integer")
