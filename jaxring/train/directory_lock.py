"""The lock of a checkpoint directory: ``<directory>/jaxring.lock`` (``{"pid", "host", "since"}``), created
atomically, keeps a second run from mixing its steps into a directory a live run writes; the lock of a
process that is gone (same host, pid not alive) is taken over. `Checkpointer(lock=True)` holds one."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path


class CheckpointDirectoryInUse(ValueError):
    """Another live run holds the checkpoint directory's lock."""


LOCK_FILE = "jaxring.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class DirectoryLock:
    """``<directory>/jaxring.lock`` held by one live run: {"pid", "host", "since"}, created atomically.

    A second run refuses in one line naming the holder; a lock left by a process that is gone (this host,
    pid not alive) is taken over with a warning through `report`. Released (deleted) by `release`.
    """

    def __init__(self, directory: Path, report: Callable[[str], None] = print):
        self.path = Path(directory) / LOCK_FILE
        self.held = False
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and not self._stale(holder):
                    raise CheckpointDirectoryInUse(
                        f"checkpoint directory {str(directory)!r} is in use by another run (pid {holder.get('pid')} "
                        f"on {holder.get('host')}, since {holder.get('since')}); use another --checkpoint-dir, or "
                        f"delete {str(self.path)!r} if that run is gone"
                    ) from None
                what = "an unreadable lock" if holder is None else f"the lock of pid {holder.get('pid')}, which is gone"
                report(f"warning: {str(directory)!r}: taking over {what}")
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise CheckpointDirectoryInUse(f"could not take the lock {str(self.path)!r} (another run keeps taking it)")

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    @staticmethod
    def _stale(holder: dict) -> bool:
        pid = holder.get("pid")
        if holder.get("host") != socket.gethostname():
            return False  # another host's process: cannot tell, so it holds
        return not (isinstance(pid, int) and pid > 0 and _pid_alive(pid))

    def release(self) -> None:
        if self.held:
            holder = self._holder()
            if holder is not None and holder.get("pid") == os.getpid():
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            self.held = False
