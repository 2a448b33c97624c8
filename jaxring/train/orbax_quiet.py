"""Orbax's noise off while a `Checkpointer` is open: its log lines, the unraisable errors and asyncio reports
its abandoned reads leave behind when it gives up on a damaged step, and a join of its background save threads.
The Checkpointer reports every failure itself, in one line."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any


class OrbaxQuiet:
    """Orbax's noise off while a Checkpointer is open, put back on close (nothing process-wide is left
    changed behind the caller's back):

    * its (absl) log lines below CRITICAL: a failed background save logs the same traceback from several
      threads; the Checkpointer reports the failure itself, in one line;
    * two kinds of unraisable error, both left behind when orbax gives up reading a damaged step (which the
      Checkpointer reports in one line): tensorstore still completes the step's other pending reads and calls
      back into orbax's already closed asyncio loop ("RuntimeError: Event loop is closed", a traceback per
      array), and orbax's abandoned read coroutines, when collected, raise their own read errors ("Exception
      ignored in: <coroutine object _read_array_index_and_device_put>", a 60-line TensorStore spec each).
      Every other unraisable error goes to the hook that was there before.
    """

    def __init__(self):
        self.logger = logging.getLogger("absl")
        self.level = self.logger.level
        self.logger.setLevel(logging.CRITICAL)
        self.previous_hook = sys.unraisablehook
        previous = self.previous_hook

        def hook(unraisable: Any) -> None:
            e = unraisable.exc_value
            if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
                return
            if _is_orbax_coroutine(unraisable.object):
                return
            previous(unraisable)

        self.hook = hook
        sys.unraisablehook = hook
        # the abandoned reads that finish later are logged by asyncio instead ("Task exception was never
        # retrieved", with orbax's coroutine named in the message)
        self.asyncio_logger = logging.getLogger("asyncio")
        self.asyncio_logger.addFilter(_drop_abandoned_orbax_tasks)

    def restore(self) -> None:
        self.asyncio_logger.removeFilter(_drop_abandoned_orbax_tasks)
        self.logger.setLevel(self.level)
        if sys.unraisablehook is self.hook:  # (another hook installed since stays)
            sys.unraisablehook = self.previous_hook


# what names an orbax read in asyncio's report of an abandoned task or future (its coroutine, or its error)
ORBAX_READ_MARKS = (f"{os.sep}orbax{os.sep}", "TensorStore", "OCDBT")


def _drop_abandoned_orbax_tasks(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's report of an orbax read whose exception nobody retrieved ("Task", "Future" or
    "_GatheringFuture exception was never retrieved")."""
    message = record.getMessage()
    return not ("exception was never retrieved" in message and any(m in message for m in ORBAX_READ_MARKS))


def _is_orbax_coroutine(obj: Any) -> bool:
    """Whether `obj` is a coroutine of orbax's own code (one it abandoned when a read failed)."""
    code = getattr(obj, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def join_orbax_threads(timeout_s: float = 60.0) -> None:
    """Waits (up to `timeout_s` in all) for orbax's background save threads still running. Orbax's threads
    re-raise their own error from `join`; the caller has the save's failure already, so that is not raised again."""
    deadline = time.monotonic() + timeout_s
    for t in threading.enumerate():
        if t is not threading.current_thread() and type(t).__module__.startswith("orbax"):
            with contextlib.suppress(Exception):
                t.join(max(deadline - time.monotonic(), 0))


@contextlib.contextmanager
def orbax_logs_quiet() -> Iterator[None]:
    """Orbax's own (absl) log lines off, except CRITICAL, for the duration."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
