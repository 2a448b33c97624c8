"""Orbax's background threads, joined after a failed save."""

import threading

from jaxring.train.orbax_quiet import join_orbax_threads


class _SaveThread(threading.Thread):
    """Stands for orbax's save thread, whose `join` raises the error its save ended in."""

    __module__ = "orbax.checkpoint._src.futures.future"

    def __init__(self, release: threading.Event):
        super().__init__(target=release.wait, daemon=True)

    def join(self, timeout=None):
        super().join(timeout)
        raise ValueError("INTERNAL: Error writing local file: [OS error 28: No space left on device]")


def test_a_failed_save_thread_is_joined_without_raising_its_error_again():
    """CI once failed in Checkpointer.close: the save's failure, already reported as CheckpointSaveError, came
    back out of join_orbax_threads as a raw ValueError when the thread ended during the join."""
    release = threading.Event()
    thread = _SaveThread(release)
    thread.start()
    release.set()
    join_orbax_threads(timeout_s=5)
    assert not thread.is_alive()
