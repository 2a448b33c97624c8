"""Stop signals, one convention for every command: SIGINT (Ctrl-C), SIGTERM and SIGHUP end it in one line, after
its clean-up, with the shell's code for the signal, 128 + N (130, 143, 129).

Two ways to receive them (training has a third, after its step: `jaxring.train.signals.GracefulStop`):

    with stops_on_signals():             # short commands (jaxring.eval, hf export): the signal raises
        ...                              # Interrupted at once, so `finally` clean-up runs
    with StopSignals() as stop:          # loops with a safe point (data preparation, between chunks)
        for chunk in chunks:
            stop.check("nothing written")    # raises Interrupted once a signal arrived
    except KeyboardInterrupt as e:
        print(stop_message(e), file=sys.stderr); return exit_code(e)

Handlers are installed only in the main thread (elsewhere Python cannot: then nothing is received) and the
previous ones come back on exit. Python runs them when the main thread next executes bytecode: a C call in
progress (a jitted batch, or a sleep when one of XLA's threads took the process's signal) finishes first. So
the signal ends a command between its batches; training's `GracefulStop` adds a thread that acts at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

__all__ = [
    "SIGNALS",
    "Interrupted",
    "StopSignals",
    "exit_code",
    "exit_on_stop_signals",
    "stop_message",
    "stops_on_signals",
]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal ended the work; str(): one line saying what was left; exit_code: 128 + signum."""

    def __init__(self, signum: int, message: str | None = None):
        super().__init__(message or signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def exit_code(e: KeyboardInterrupt) -> int:
    """128 + the signal number (a plain KeyboardInterrupt is SIGINT's: 130)."""
    return 128 + getattr(e, "signum", signal.SIGINT)


def stop_message(e: KeyboardInterrupt, what: str = "") -> str:
    """'interrupted' (Ctrl-C) or 'stopped by SIGTERM', then `what` (e.g. ': nothing written to OUT')."""
    signum = getattr(e, "signum", signal.SIGINT)
    head = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    return head + what


def _exit_at_once(signum: int, frame: object) -> None:
    """One line, then exit 128 + N: nothing to clean up. Raising KeyboardInterrupt instead could land in one of
    jax's gc callbacks, which swallows it ("Exception ignored in: <function _xla_gc_callback>") and runs on."""
    os.write(2, (stop_message(Interrupted(signum)) + "\n").encode())
    os._exit(128 + signum)


def exit_on_stop_signals() -> None:
    """A command's first handlers, installed before jax imports (jaxring/__init__ for `python -m jaxring.*`,
    train.py itself): SIGINT, SIGTERM or SIGHUP end the process at once, in one line. The command's own
    handlers (`StopSignals`, `stops_on_signals`, training's stop) replace them where there is work to finish
    and put them back after."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _exit_at_once)


def _raise(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def _installed(handler: Callable[[int, object], None]) -> dict:
    """The handlers before `handler` was installed for SIGNALS (none outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in SIGNALS}


def _put_back(before: dict) -> None:
    for s, handler in before.items():
        signal.signal(s, handler)


@contextlib.contextmanager
def stops_on_signals() -> Iterator[None]:
    """Inside, SIGINT, SIGTERM and SIGHUP raise `Interrupted` in the main thread."""
    before = _installed(_raise)
    try:
        yield
    finally:
        _put_back(before)


class StopSignals:
    """Context manager: the first SIGINT/SIGTERM/SIGHUP is remembered (`signum`); `check()` raises on it. A
    further signal while cleaning up is ignored (a process-wide handler of the caller, such as training's stop,
    may still act on it)."""

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
        self._previous = _installed(self._note)
        return self

    def __exit__(self, *exc) -> bool:
        _put_back(self._previous)
        self._previous = {}
        return False
