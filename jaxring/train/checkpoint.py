"""Sharded, asynchronous, atomic checkpoints (orbax-checkpoint), restorable onto a different mesh.

Each step is a directory ``<directory>/<step>/`` holding two items: ``state`` (the pytree of jax arrays
and python scalars, written shard by shard by the hosts that own them) and ``metadata`` (a JSON dict: the
model config under "model", the mesh description, anything else). Orbax writes a step into a temporary
directory ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>`` only once every host has
finished: a save is atomic, and a crash mid-save leaves a temporary directory that ``latest_step`` and
``restore`` ignore, never a half-written step.

Damage after the fact (a truncated or bit-flipped array file, an empty manifest, garbage metadata, a missing
item, a junk step directory) is caught on restore: a third item, ``checksums``, records two 32-bit sums of
every array's bits (see `checksum.py`; orbax itself checks no array data), and restore recomputes them on
the restored arrays. A damaged step raises `DamagedCheckpointError` naming the step and what is wrong;
``restore_latest`` reports it, moves it aside to ``<step>.damaged`` and falls back to the newest intact
step. A state holding a NaN or an Inf is never saved (`NonFiniteStateError`). The metadata item is
checksummed too (a SHA-256 of its JSON, under ``checksums``): an edited or bit-flipped metadata file is damage
like any other, never a false "incompatible model" or a false divergence on resume.

Saving can fail in the background (a full disk, a directory made read-only, a vanished mount): `check()`
(the training loop calls it after every step), `save`, `wait` and `close` raise `CheckpointSaveError` with one
line, the unfinished temporary directory is removed, and orbax's own log lines are silenced while a
Checkpointer is open (its error tracebacks would repeat ours hundreds of times). Opened with ``lock=True``
(training), the directory is created and tried for writing at once, and a lock file ``jaxring.lock``
(``{"pid", "host", "since"}``) keeps a second run from mixing its steps into it; the lock of a process that
is gone (same host, pid not alive) is taken over (`directory_lock.py`; orbax's noise: `orbax_quiet.py`).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxring.train import checksum
from jaxring.train.directory_lock import DirectoryLock
from jaxring.train.multihost import all_processes_agree, is_primary, sync_processes
from jaxring.train.orbax_quiet import OrbaxQuiet, join_orbax_threads, orbax_logs_quiet


class DamagedCheckpointError(ValueError):
    """A saved step cannot be read back intact (the message names the step and what is wrong)."""


class NonFiniteStateError(ValueError):
    """The state to save holds a NaN or an Inf; it is not saved (it would poison every resume)."""


class CheckpointSaveError(OSError):
    """A save could not be written (full disk, read-only or vanished directory); the message is one line."""


METADATA_SUM = "__metadata_sha256__"  # the metadata item's checksum, an entry of the checksums item


def _metadata_sum(metadata: dict) -> str:
    """SHA-256 of the metadata's canonical JSON (sorted keys), as saved and as read back."""
    return hashlib.sha256(json.dumps(metadata, sort_keys=True).encode()).hexdigest()


def _root_cause(e: BaseException) -> BaseException:
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return e


def _disk_full(e: BaseException) -> bool:
    """ENOSPC, as an OSError or in the words of tensorstore's error (a ValueError naming the file first)."""
    if isinstance(e, OSError):
        return e.errno == errno.ENOSPC
    text = str(e)
    return "No space left on device" in text or "OS error 28" in text or "errno 28" in text.lower()


def _one_line(e: BaseException, limit: int = 240) -> str:
    """An exception as one short line: its root cause's message (orbax wraps tensorstore's precise one, e.g.
    "OUT_OF_RANGE: ... byte range [0, 15253) is not valid for value of size 1000", in a vaguer one)."""
    e = _root_cause(e)
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _paths(tree: Any) -> dict[str, object]:
    """{"opt/0/mu/kernel": leaf}: leaves by normalised path (orbax's metadata tree uses dicts throughout)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(checksum.key_name(k) for k in path): leaf for path, leaf in flat}


def _flat_dict(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _abstract(path: str, leaf: Any) -> Any:
    """A restore target leaf: arrays become ShapeDtypeStructs; every array leaf must carry its sharding."""
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
        raise ValueError(
            f"restore target {path!r} is a ShapeDtypeStruct without a sharding; give every array "
            f"leaf the NamedSharding it should have on the new mesh"
        )
    return leaf


class Checkpointer:
    """Keeps the last `keep` checkpoints of a training run in `directory`.

    save() is asynchronous by default: the arrays are copied to host memory before it returns (so the
    next train step may overwrite or donate them) and written to disk in the background; wait() blocks
    until the write is finalized. Saves are atomic (temporary directory, then rename; see the module
    docstring). Use as a context manager, or call close() at the end so the last save is finished.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int = 3,
        async_save: bool = True,
        lock: bool = False,
        report: Callable[[str], None] = print,
    ):
        """lock: create the directory now, check it takes writes and hold its lock file (a training run);
        False: open for reading (the directory is created by the first save)."""
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep {keep!r} must be a positive integer (how many checkpoints to keep)")
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {str(self.directory)!r} exists and is not a directory")
        self.keep = keep
        self._lock = None
        if lock and is_primary():
            self._prepare_for_writing()
            self._lock = DirectoryLock(self.directory, report)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=False
        )  # created by the first save, not by opening
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "metadata": ocp.JsonCheckpointHandler(),
            "checksums": ocp.JsonCheckpointHandler(),
        }
        self._noise = OrbaxQuiet()  # a junk step directory is reported on restore, not here
        self._closed = False
        self._failed = self._failed_step = None
        self._saving = None  # the step whose save may still be in flight
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        except BaseException:
            self._release()
            raise

    def _prepare_for_writing(self) -> None:
        """Creates the directory and writes (and removes) a probe file: a directory that cannot be created
        or written fails here, in one line, before any step runs."""
        where = f"checkpoint directory {str(self.directory)!r}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointSaveError(f"{where} cannot be created ({e.strerror or e})") from None
        probe = self.directory / f".jaxring-write-test-{os.getpid()}"
        try:
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            with contextlib.suppress(OSError):
                probe.unlink()
            raise CheckpointSaveError(f"{where} is not writable ({e.strerror or e})") from None

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if getattr(self, "_noise", None) is not None:
            self._noise.restore()
            self._noise = None

    # -- saving ---------------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, metadata: dict) -> bool:
        """Saves `state` (a pytree of possibly sharded jax arrays and python scalars) as `step`.

        metadata: a JSON-able dict; its "model" entry is what restore(expected_metadata=) compares.
        Returns False (and writes nothing) when `step` is already saved; a step before the latest one is
        an error. Every array's checksums are computed (on its devices) before this returns and saved with
        it; a state holding a NaN or an Inf raises NonFiniteStateError and nothing is written.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step!r} must be a non-negative integer")
        self.check()
        if not isinstance(metadata, dict):
            raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
        try:
            metadata = json.loads(json.dumps(metadata))
        except (TypeError, ValueError) as e:
            raise ValueError(f"metadata must be JSON-serialisable: {e}") from None
        latest = self.latest_step()
        if step in self.all_steps():
            return False
        if latest is not None and step < latest:
            raise ValueError(
                f"step {step} is before the latest checkpoint step {latest} in "
                f"{str(self.directory)!r}; steps are saved in increasing order"
            )
        sums = checksum.state_checksums(state)
        bad = checksum.non_finite(sums)
        if bad:
            raise NonFiniteStateError(
                f"not saving step {step}: NaN or Inf values in {_some(bad)} (a non-finite "
                f"state would poison every resume)"
            )
        sums = {**sums, METADATA_SUM: _metadata_sum(metadata)}
        self._saving = step
        try:
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    metadata=ocp.args.JsonSave(metadata),
                    checksums=ocp.args.JsonSave(sums),
                ),
            )
        except Exception as e:
            self._fail(step, e)
            raise CheckpointSaveError(self._failed) from None
        return bool(saved)

    def check(self) -> None:
        """Raises CheckpointSaveError (one line) if a save has failed, in the background or before; returns at
        once while a save is still running. The training loop calls it after every step; on a multi-host run
        every process must call it at the same point (they agree: one process's failure stops them all)."""
        if self._saving is not None and self._failed is None and not self._manager.is_saving_in_progress():
            self._finish(raise_error=False)
        if not all_processes_agree(self._failed is None):
            raise CheckpointSaveError(self._failed or "a checkpoint save failed on another process (see its message)")

    def _finish(self, raise_error: bool = True) -> None:
        """Waits for the save in flight; its failure is recorded (and raised as CheckpointSaveError)."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._fail(self._saving, e)
        self._saving = None
        if raise_error and self._failed is not None:
            raise CheckpointSaveError(self._failed)

    def _fail(self, step: int, e: BaseException) -> None:
        """Records a failed save in one line (its temporary directory is removed on close, once orbax's
        threads are done with it)."""
        reason, root = _one_line(e), _root_cause(e)
        if _disk_full(root):
            if not isinstance(root, OSError):  # tensorstore's own words, long: the cause stated whole
                reason = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"
            reason += f" (the disk is full; {self._intact_before(step)})"
        elif isinstance(root, OSError) and root.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            reason += " (the directory does not take writes)"
        self._failed_step = step
        self._saving = None
        self._failed = f"saving checkpoint step {step} to {str(self.directory)!r} failed: {reason}"

    def _intact_before(self, step: int) -> str:
        """Which step a failed save of `step` leaves intact, and how to go on from it."""
        with contextlib.suppress(Exception):
            earlier = [s for s in self.all_steps() if s < step]
            if earlier:
                return f"step {earlier[-1]} in it is intact: free space and continue from it with --resume"
        return "no earlier step was saved: free space, or point --checkpoint-dir elsewhere, and run again"

    def _remove_temporary(self, step: int) -> None:
        if not is_primary() or not self.directory.is_dir():
            return
        for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def wait(self) -> None:
        """Blocks until every pending asynchronous save is on disk (renamed into place); CheckpointSaveError
        if it failed."""
        if self._failed is not None:
            raise CheckpointSaveError(self._failed)
        self._finish()

    def close(self) -> None:
        """Waits for pending saves and releases the manager's background threads, the lock and the quieted
        logs; CheckpointSaveError (after releasing everything) if the last save failed."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._failed is None:
                self._finish()
        finally:
            if self._failed is not None:
                with contextlib.suppress(Exception):
                    self._manager.wait_until_finished()
                join_orbax_threads()  # a failed save's other writes go on after orbax reports the failure
            with contextlib.suppress(Exception):
                self._manager.close()
            if self._failed_step is not None:
                self._remove_temporary(self._failed_step)
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- reading --------------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps saved (finalized on disk when opened, or saved through this object), ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step, or None. Temporary (unfinished) step directories are never counted. A step
        whose async save through this object is still in flight is counted: call wait() to be sure."""
        return self._manager.latest_step()

    def _check_step(self, step: int | None) -> int:
        if not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(self.directory)!r} does not exist")
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(
                    f"no checkpoint in {str(self.directory)!r} (an unfinished save leaves "
                    f"only a temporary directory, which is ignored)"
                )
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {str(self.directory)!r}; saved steps: {steps}")
        return step

    def metadata(self, step: int | None = None) -> dict:
        """The metadata dict saved with `step` (default: the latest); DamagedCheckpointError if unreadable or
        if it does not match its saved checksum (steps saved before metadata checksums are not checked)."""
        step = self._check_step(step)
        metadata = self._read_json(step, "metadata")
        sums = self._read_json(step, "checksums") if (self.directory / str(step) / "checksums").is_dir() else {}
        saved = sums.get(METADATA_SUM)
        if saved is not None and saved != _metadata_sum(metadata):
            raise DamagedCheckpointError(
                f"checkpoint step {step} in {str(self.directory)!r}: its metadata does not match its checksum "
                f"(the metadata file changed after the save)"
            )
        return metadata

    def checksums(self, step: int | None = None) -> dict:
        """The checksums saved with `step` (default: the latest): {array path: checksum} and the metadata's;
        DamagedCheckpointError if the step has none or they cannot be read. For readers that restore only
        part of a state (`jaxring.eval.loading` restores the parameters) and check that part."""
        return self._read_json(self._check_step(step), "checksums")

    def _read_json(self, step: int, item: str) -> dict:
        if not (self.directory / str(step) / item).is_dir():
            raise DamagedCheckpointError(f"checkpoint step {step} in {str(self.directory)!r} has no {item!r} item")
        try:
            value = self._manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]
        except Exception as e:
            raise DamagedCheckpointError(
                f"checkpoint step {step} in {str(self.directory)!r}: cannot read its {item!r} item ({_one_line(e)})"
            ) from e
        if not isinstance(value, dict):
            raise DamagedCheckpointError(
                f"checkpoint step {step} in {str(self.directory)!r}: its {item!r} item "
                f"is a {type(value).__name__}, not a JSON object"
            )
        return value

    def restore(
        self, step: int | None, target: Any, *, expected_metadata: dict | None = None, verify: bool = True
    ) -> Any:
        """The state saved at `step` (None: the latest), laid out as `target` says.

        target: the state's pytree with a ``jax.ShapeDtypeStruct`` (or a jax array) for every array leaf,
          each with ``.sharding`` set to its NamedSharding on the mesh to restore onto — which may differ
          from the mesh it was saved from (e.g. saved on sp=8, restored onto dp=2 × sp=4); every host reads
          only its own shards. Python scalar leaves are restored as python scalars.
        expected_metadata: if given, its "model" entry must equal the checkpoint's, else ValueError naming
          every differing key ("checkpoint from an incompatible model: num_layers 2 != 4").
        verify: recompute every array's checksums and compare them with the saved ones (also refuses a
          state with NaN/Inf values). False skips that (e.g. steps saved before checksums were recorded).
        Returns the restored pytree, with target's structure. Raises DamagedCheckpointError when the step
        cannot be read back intact; ValueError when it is intact but does not fit `target`.
        """
        step = self._check_step(step)
        if expected_metadata is not None:
            self._check_metadata(step, expected_metadata)
        targets = _paths(target)
        leaves, treedef = jax.tree_util.tree_flatten(target)
        abstract = jax.tree_util.tree_unflatten(treedef, [_abstract(p, x) for p, x in zip(targets, leaves)])
        self._check_shapes(step, targets)
        saved_sums = self._read_json(step, "checksums") if verify else None
        where = f"checkpoint step {step} in {str(self.directory)!r}"
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
            restored = restored["state"]
            error = None
        except Exception as e:
            restored, error = None, e
            gc.collect()  # orbax's abandoned reads are finalised now, while `OrbaxQuiet` keeps them quiet
        if not all_processes_agree(error is None):
            detail = _one_line(error) if error is not None else "another process could not read its shards"
            raise DamagedCheckpointError(f"{where}: cannot read its arrays ({detail})") from error
        if saved_sums is not None:
            saved_sums = {k: v for k, v in saved_sums.items() if k != METADATA_SUM}
            sums = checksum.state_checksums(restored)
            bad = checksum.mismatches(saved_sums, sums)
            if bad:
                raise DamagedCheckpointError(
                    f"{where}: checksum mismatch in {_some(bad)} (the array data changed after the save)"
                )
            nonfinite = checksum.non_finite(sums)
            if nonfinite:
                raise DamagedCheckpointError(f"{where}: NaN or Inf values in {_some(nonfinite)}")
        return restored

    def restore_latest(
        self, target: Any, *, expected_metadata: dict | None = None, report: Callable[[str], None] = print
    ) -> tuple[int | None, Any]:
        """(step, state) from the newest intact step (see newest_intact), or (None, None) if none is saved."""
        return self.newest_intact(
            lambda step: self.restore(step, target, expected_metadata=expected_metadata), report=report
        )

    def newest_intact(
        self, restore_step: Callable[[int], Any], *, report: Callable[[str], None] = print
    ) -> tuple[int | None, Any]:
        """(step, restore_step(step)) for the newest step that restores intact, or (None, None) if none is saved.

        restore_step(step) restores one step (e.g. ``lambda s: trainer.restore(ckpt, s)``); when it raises
        DamagedCheckpointError the damage is reported in one line through `report`, and once an older
        step restores, the damaged newer ones are moved aside to ``<step>.damaged`` (kept for inspection;
        later saves of those step numbers are then possible). Raises DamagedCheckpointError when every
        saved step is damaged; any other error (another model, a shape mismatch) is raised as it is.
        """
        steps = self.all_steps() if self.directory.is_dir() else []
        damaged = []
        for step in reversed(steps):
            try:
                with orbax_logs_quiet():  # its warnings about the damage would repeat ours
                    result = restore_step(step)
            except DamagedCheckpointError as e:
                damaged.append(step)
                older = [s for s in steps if s < step]
                report(f"warning: {e}; {'trying step ' + str(older[-1]) if older else 'no older step to try'}")
                continue
            if damaged:
                self._set_aside(damaged, report)
            return step, result
        if damaged:
            raise DamagedCheckpointError(
                f"every checkpoint in {str(self.directory)!r} is damaged (steps "
                f"{sorted(damaged)}); move them away to start afresh"
            )
        return None, None

    def _set_aside(self, steps: list[int], report: Callable[[str], None]) -> None:
        """Renames damaged step directories to <step>.damaged (kept for inspection, ignored as steps)."""
        if is_primary():
            for step in steps:
                src = self.directory / str(step)
                dst = self.directory / f"{step}.damaged"
                n = 1
                while dst.exists():
                    n += 1
                    dst = self.directory / f"{step}.damaged-{n}"
                src.rename(dst)
                report(f"moved damaged checkpoint step {step} aside to {str(dst)!r}")
        sync_processes("jaxring-checkpoint-set-aside")
        self._manager.reload()

    def _check_metadata(self, step: int, expected: dict | None) -> None:
        if not isinstance(expected, dict):
            raise ValueError(f"expected_metadata must be a dict, got {type(expected).__name__}")
        if "model" not in expected:
            raise ValueError(f"expected_metadata has no 'model' entry to compare (keys: {sorted(expected)})")
        saved = self.metadata(step).get("model")
        if saved is None:
            raise ValueError(f"checkpoint step {step} in {str(self.directory)!r} records no 'model' metadata")
        want = _flat_dict(json.loads(json.dumps(expected["model"])))  # tuples → lists, as saved
        have = _flat_dict(saved)
        missing = "<absent>"
        diffs = [
            f"{k} {have.get(k, missing)} != {want.get(k, missing)}"
            for k in sorted(set(have) | set(want))
            if have.get(k, missing) != want.get(k, missing)
        ]
        if diffs:
            raise ValueError(
                f"checkpoint from an incompatible model: {', '.join(diffs)} (checkpoint step {step} != expected)"
            )

    def _check_shapes(self, step: int, targets: dict) -> None:
        try:
            meta = self._manager.item_metadata(step)["state"]
            saved = _paths(getattr(meta, "tree", meta))
        except Exception as e:
            raise DamagedCheckpointError(
                f"checkpoint step {step} in {str(self.directory)!r}: cannot read its array metadata ({_one_line(e)})"
            ) from e
        if not saved:
            raise DamagedCheckpointError(f"checkpoint step {step} in {str(self.directory)!r} holds no arrays")
        only_saved = sorted(set(saved) - set(targets))
        only_target = sorted(set(targets) - set(saved))
        if only_saved or only_target:
            raise ValueError(
                f"restore target does not match checkpoint step {step}'s structure: "
                f"only in the checkpoint {only_saved[:5]}, only in the target {only_target[:5]}"
            )
        for path, t in targets.items():
            have, want = getattr(saved[path], "shape", None), getattr(t, "shape", None)
            if have is not None and want is not None and tuple(have) != tuple(want):
                raise ValueError(
                    f"checkpoint step {step} has {path!r} of shape {tuple(have)}, but the restore "
                    f"target expects {tuple(want)}"
                )


def _some(paths: list[str], count: int = 3) -> str:
    """'a, b, c and 4 more'."""
    shown = ", ".join(repr(p) for p in paths[:count])
    return shown + (f" and {len(paths) - count} more" if len(paths) > count else "")
