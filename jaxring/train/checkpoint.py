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
step. A state holding a NaN or an Inf is never saved (`NonFiniteStateError`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxring.train import checksum
from jaxring.train.multihost import all_processes_agree, is_primary, sync_processes


class DamagedCheckpointError(ValueError):
    """A saved step cannot be read back intact (the message names the step and what is wrong)."""


class NonFiniteStateError(ValueError):
    """The state to save holds a NaN or an Inf; it is not saved (it would poison every resume)."""


def _ignore_closed_loop_callbacks() -> None:
    """Drops one kind of noise: when orbax gives up reading a damaged step, tensorstore still completes the
    step's other pending reads and calls back into orbax's already closed asyncio loop, which prints a
    "RuntimeError: Event loop is closed" traceback per array. Every other unraisable error still goes to the
    previous hook. Idempotent."""
    previous = sys.unraisablehook
    if getattr(previous, "_jaxring_filter", False):
        return

    def hook(unraisable):
        e = unraisable.exc_value
        if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
            return
        previous(unraisable)

    hook._jaxring_filter = True
    sys.unraisablehook = hook


@contextlib.contextmanager
def _orbax_logs_quiet():
    """Orbax's own (absl) log lines off, except CRITICAL, for the duration."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _one_line(e: BaseException, limit: int = 240) -> str:
    """An exception as one short line: its root cause's message (orbax wraps tensorstore's precise one, e.g.
    "OUT_OF_RANGE: ... byte range [0, 15253) is not valid for value of size 1000", in a vaguer one)."""
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _paths(tree) -> dict[str, object]:
    """{"opt/0/mu/kernel": leaf}: leaves by normalised path (orbax's metadata tree uses dicts throughout)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(checksum.key_name(k) for k in path): leaf for path, leaf in flat}


def _flat_dict(d, prefix="") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _abstract(path: str, leaf):
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

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep {keep!r} must be a positive integer (how many checkpoints to keep)")
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {str(self.directory)!r} exists and is not a directory")
        self.keep = keep
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=False
        )  # created by the first save, not by opening
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "metadata": ocp.JsonCheckpointHandler(),
            "checksums": ocp.JsonCheckpointHandler(),
        }
        with _orbax_logs_quiet():  # a junk step directory is reported on restore, not here
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    # -- saving ---------------------------------------------------------------------------------------

    def save(self, step: int, state, *, metadata: dict) -> bool:
        """Saves `state` (a pytree of possibly sharded jax arrays and python scalars) as `step`.

        metadata: a JSON-able dict; its "model" entry is what restore(expected_metadata=) compares.
        Returns False (and writes nothing) when `step` is already saved; a step before the latest one is
        an error. Every array's checksums are computed (on its devices) before this returns and saved with
        it; a state holding a NaN or an Inf raises NonFiniteStateError and nothing is written.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step!r} must be a non-negative integer")
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
        return bool(
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    metadata=ocp.args.JsonSave(metadata),
                    checksums=ocp.args.JsonSave(sums),
                ),
            )
        )

    def wait(self) -> None:
        """Blocks until every pending asynchronous save is on disk (renamed into place)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager's background threads."""
        self._manager.wait_until_finished()
        self._manager.close()

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

    def _check_step(self, step):
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
        """The metadata dict saved with `step` (default: the latest); DamagedCheckpointError if unreadable."""
        step = self._check_step(step)
        return self._read_json(step, "metadata")

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

    def restore(self, step: int | None, target, *, expected_metadata: dict | None = None, verify: bool = True):
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
        _ignore_closed_loop_callbacks()
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
        if not all_processes_agree(error is None):
            detail = _one_line(error) if error is not None else "another process could not read its shards"
            raise DamagedCheckpointError(f"{where}: cannot read its arrays ({detail})") from error
        if saved_sums is not None:
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

    def restore_latest(self, target, *, expected_metadata: dict | None = None, report=print):
        """(step, state) from the newest intact step (see newest_intact), or (None, None) if none is saved."""
        return self.newest_intact(
            lambda step: self.restore(step, target, expected_metadata=expected_metadata), report=report
        )

    def newest_intact(self, restore_step, *, report=print):
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
                with _orbax_logs_quiet():  # its warnings about the damage would repeat ours
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

    def _set_aside(self, steps, report) -> None:
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

    def _check_metadata(self, step, expected):
        if not isinstance(expected, dict):
            raise ValueError(f"expected_metadata must be a dict, got {type(expected).__name__}")
        if "model" not in expected:
            raise ValueError(f"expected_metadata has no 'model' entry to compare (keys: {sorted(expected)})")
        saved = self._read_json(step, "metadata").get("model")
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

    def _check_shapes(self, step, targets: dict):
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
