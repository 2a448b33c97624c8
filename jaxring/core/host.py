"""This machine's memory: what simulated CPU devices share, and what the kernel's out-of-memory killer enforces.

machine_memory_bytes()    # physical memory, or the container's (cgroup) limit when that is lower
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["machine_memory_bytes"]

# where a container's memory limit is (cgroup v2, then v1); "max" or a huge number means none
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _cgroup_limit() -> int | None:
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def machine_memory_bytes() -> int | None:
    """Bytes of memory this process's machine (or container) has; None where the system does not say."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # (not every system names these)
        physical = None
    limit = _cgroup_limit()
    known = [b for b in (physical, limit) if b is not None and b > 0]
    return min(known) if known else None
