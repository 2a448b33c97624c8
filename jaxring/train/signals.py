"""Preemption: SIGTERM, SIGINT and SIGHUP stop training after the current step, not in the middle of it.

    with GracefulStop() as stop:
        while ...:
            if stop.requested():      # agreed by every process
                break
            train_step()

The first signal only sets a flag (and says so on stderr); the loop finishes its step, saves and raises
`TrainingStopped`. A second signal exits the process at once (exit code 128 + signal number), whatever it is
doing. SIGHUP (the terminal or ssh session closed) is treated like SIGTERM: a run started in a terminal that
goes away finishes its step and saves instead of dying on the spot. Handlers are installed only in the main
thread and the previous ones are put back on exit.

The watchdog: a step that cannot finish (a collective waiting for a process that is gone or stuck, a
multi-host mismatch) would make the first signal powerless. So the first signal also starts a daemon thread
that, if the context is still open `grace_s` seconds later (default 300 s, env JAXRING_STOP_GRACE_S: enough
for a step and a save), writes one line and exits the process hard (`os._exit`) with the signal's code,
128 + signal number. A graceful stop that ends in time disarms it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from jaxring.core.stop_signals import SIGNALS, Interrupted
from jaxring.train.multihost import any_process

DEFAULT_GRACE_S = 300.0  # after a stop signal, the watchdog's wait before a hard exit


def grace_seconds() -> float:
    """The watchdog's grace period: JAXRING_STOP_GRACE_S if set (a positive number), else DEFAULT_GRACE_S."""
    value = os.environ.get("JAXRING_STOP_GRACE_S")
    try:
        grace = float(value) if value else DEFAULT_GRACE_S
    except ValueError:
        grace = DEFAULT_GRACE_S
    return grace if grace > 0 and grace == grace else DEFAULT_GRACE_S


class TrainingStopped(Interrupted):
    """Training stopped early on a signal, after its step (and after saving it, when there is a checkpoint
    directory); the loop has said so."""


def _write(text: str) -> None:
    """To stderr, from a signal handler (no buffering surprises)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.write(sys.stderr.fileno(), (text + "\n").encode())


class GracefulStop:
    """Context manager: the first SIGTERM/SIGINT/SIGHUP asks the loop to stop (and arms the watchdog); the
    second exits at once.

    hard_exit: what the second signal and the watchdog call (default os._exit); tests pass their own.
    grace_s: the watchdog's wait (default: `grace_seconds()`).

    Python runs a signal handler only when the main thread returns to the interpreter, which a thread stuck
    in XLA (a collective that never completes) never does. So the signals also reach a thread of their own
    through `signal.set_wakeup_fd` (the C-level handler writes the signal's number to a socket at once): it
    arms the watchdog on the first signal and exits on the second, whatever the main thread is doing.
    """

    def __init__(
        self, signals: Iterable[int] = SIGNALS, hard_exit: Callable[[int], Any] = os._exit, grace_s: float | None = None
    ):
        self.signals, self.hard_exit = tuple(signals), hard_exit
        self.grace_s = grace_seconds() if grace_s is None else grace_s
        self.signum: int | None = None
        self._previous = {}
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._armed = False
        self._seen = 0  # signals seen by the wakeup thread
        self._wakeup = None  # (reading socket, writing socket, the previous wakeup fd)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def handle(self, signum: int, frame: Any = None) -> None:
        """The Python-level handler (main thread)."""
        if self.signum is not None:
            self._exit_now(signum)
            return
        self.signum = signum
        _write(
            f"{signal.Signals(signum).name}: stopping after the current step (and saving, with "
            f"--checkpoint-dir); send it again to exit at once"
        )
        self._arm(signum)

    def _exit_now(self, signum: int) -> None:
        _write(
            f"{signal.Signals(signum).name} again: exiting now, without waiting (a save in flight is "
            f"left unfinished; the previous checkpoint is intact)"
        )
        self.hard_exit(128 + signum)

    def _arm(self, signum: int) -> None:
        with self._lock:
            if self._armed:
                return
            self._armed = True
        threading.Thread(target=self._watchdog, args=(signum,), name="jaxring-stop-watchdog", daemon=True).start()

    def _watchdog(self, signum: int) -> None:
        if self._done.wait(self.grace_s):
            return
        _write(
            f"{signal.Signals(signum).name}: the run did not stop within {self.grace_s:g} s of the signal (a step "
            f"or save that cannot finish: a stuck collective or process?); exiting now"
        )
        self.hard_exit(128 + signum)

    def _listen(self, reader: socket.socket) -> None:
        """The wakeup thread: every signal's number as the C handler writes it."""
        while not self._done.is_set():
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum not in self.signals or self._done.is_set():
                    continue
                self._seen += 1
                if self._seen >= 2:
                    self._exit_now(signum)
                else:
                    self._arm(signum)

    def requested(self) -> bool:
        """True once a signal arrived on any process (every process must call this at the same point)."""
        return any_process(self.signum is not None)

    def __enter__(self):
        self._done.clear()
        if threading.current_thread() is threading.main_thread() and self.signals:
            for s in self.signals:
                self._previous[s] = signal.signal(s, self.handle)
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._wakeup = (reader, writer, previous)
            threading.Thread(target=self._listen, args=(reader,), name="jaxring-signal-wakeup", daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._done.set()  # the watchdog and the wakeup thread stand down
        if self._wakeup is not None:
            reader, writer, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            writer.close()
            reader.close()
            self._wakeup = None
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}
        return False
