"""A stop signal during data preparation: noted by a handler, acted on between chunks.

    with StopSignals() as stop:          # SIGINT, SIGTERM, SIGHUP; the previous handlers come back on exit
        for chunk in chunks:
            stop.check()                 # raises Interrupted once a signal arrived
            ...

Preparation checks between chunks of about a megabyte, so it ends within a second or so of the signal, cleans
up, and `Interrupted` (a KeyboardInterrupt) carries the exit code 128 + signal number. A further signal while
cleaning up is ignored (a process-wide handler of the caller, such as training's stop, may still act on it).
Outside the main thread no handler can be installed: then `check` never raises.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["SIGNALS", "Interrupted", "StopSignals"]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal ended the preparation; str(): one line saying what was left; exit_code: 128 + signum."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Context manager: the first SIGINT/SIGTERM/SIGHUP is remembered (`signum`); `check()` raises on it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict = {}

    def _note(self, signum: int, frame: object = None) -> None:
        if self.signum is None:
            self.signum = signum

    def check(self, message: str = "interrupted") -> None:
        """Raises Interrupted(signum, "SIGNAME: message") once a signal arrived."""
        if self.signum is not None:
            raise Interrupted(self.signum, f"{signal.Signals(self.signum).name}: {message}")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> bool:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        return False
