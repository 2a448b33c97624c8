"""Preemption: SIGTERM and SIGINT stop training after the current step, not in the middle of it.

    with GracefulStop() as stop:
        while ...:
            if stop.requested():      # agreed by every process
                break
            train_step()

The first signal only sets a flag (and says so on stderr); the loop finishes its step, saves and raises
`Interrupted`. A second signal exits the process at once (exit code 128 + signal number), whatever it is
doing. Handlers are installed only in the main thread and the previous ones are put back on exit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from jaxring.train.multihost import any_process

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """Training stopped early on a signal (after saving, when there is a checkpoint directory)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _write(text: str) -> None:
    """To stderr, from a signal handler (no buffering surprises)."""
    try:
        os.write(sys.stderr.fileno(), (text + "\n").encode())
    except (OSError, ValueError, AttributeError):
        pass


class GracefulStop:
    """Context manager: the first SIGTERM/SIGINT asks the loop to stop; the second exits at once.

    hard_exit: what the second signal calls (default os._exit); tests pass their own.
    """

    def __init__(self, signals=SIGNALS, hard_exit=os._exit):
        self.signals, self.hard_exit = tuple(signals), hard_exit
        self.signum: int | None = None
        self._previous = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def handle(self, signum, frame=None) -> None:
        if self.signum is not None:
            _write(
                f"{signal.Signals(signum).name} again: exiting now, without waiting (a save in flight is "
                f"left unfinished; the previous checkpoint is intact)"
            )
            self.hard_exit(128 + signum)
            return
        self.signum = signum
        _write(
            f"{signal.Signals(signum).name}: stopping after the current step (and saving, with "
            f"--checkpoint-dir); send it again to exit at once"
        )

    def requested(self) -> bool:
        """True once a signal arrived on any process (every process must call this at the same point)."""
        return any_process(self.signum is not None)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self.handle)
        return self

    def __exit__(self, *exc):
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}
        return False
