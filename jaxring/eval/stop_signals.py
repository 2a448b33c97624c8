"""SIGTERM and SIGHUP as Ctrl-C is: an exception, so that a command's clean-up runs (a staged directory or a
temporary file removed) and it ends in one line with the shell's code for the signal (128 + N).

    with stops_on_signals():
        ...                      # SIGINT, SIGTERM, SIGHUP raise Stopped (a KeyboardInterrupt)
    except KeyboardInterrupt as e:
        return exit_code(e)      # 130, 143, 129

For the short commands (`python -m jaxring.eval`, `python -m jaxring.models.hf export`); training stops
after its step instead (`jaxring.train.signals`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["Stopped", "exit_code", "stop_message", "stops_on_signals"]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived; `signum` is its number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(e: KeyboardInterrupt) -> int:
    """128 + the signal number (a plain KeyboardInterrupt is SIGINT's: 130)."""
    return 128 + getattr(e, "signum", signal.SIGINT)


def stop_message(e: KeyboardInterrupt, what: str = "") -> str:
    """'interrupted' (Ctrl-C) or 'stopped by SIGTERM', then `what` (e.g. ': nothing written to OUT')."""
    signum = getattr(e, "signum", signal.SIGINT)
    head = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    return head + what


def _raise(signum: int, frame: object) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stops_on_signals() -> Iterator[None]:
    """Inside, SIGINT, SIGTERM and SIGHUP raise `Stopped` in the main thread; the handlers before are put back
    after (nothing is changed outside the main thread, where Python cannot set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, _raise) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
