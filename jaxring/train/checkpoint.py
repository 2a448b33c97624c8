"""Sharded, asynchronous, atomic checkpoints (orbax-checkpoint), restorable onto a different mesh.

Each step is a directory ``<directory>/<step>/`` holding two items: ``state`` (the pytree of jax arrays
and python scalars, written shard by shard by the hosts that own them) and ``metadata`` (a JSON dict: the
model config under "model", the mesh description, anything else). Orbax writes a step into a temporary
directory ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>`` only once every host has
finished: a save is atomic, and a crash mid-save leaves a temporary directory that ``latest_step`` and
``restore`` ignore, never a half-written step.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp

def _key_name(k) -> str:
    """One path element as a plain name: dict keys, attribute names (NamedTuples, flax) and indices alike."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _paths(tree) -> dict[str, object]:
    """{"opt/0/mu/kernel": leaf}: leaves by normalised path (orbax's metadata tree uses dicts throughout)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(_key_name(k) for k in path): leaf for path, leaf in flat}


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
        raise ValueError(f"restore target {path!r} is a ShapeDtypeStruct without a sharding; give every array "
                         f"leaf the NamedSharding it should have on the new mesh")
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
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=False)   # created by the first save, not by opening
        handlers = {"state": ocp.StandardCheckpointHandler(), "metadata": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    # -- saving ---------------------------------------------------------------------------------------

    def save(self, step: int, state, *, metadata: dict) -> bool:
        """Saves `state` (a pytree of possibly sharded jax arrays and python scalars) as `step`.

        metadata: a JSON-able dict; its "model" entry is what restore(expected_metadata=) compares.
        Returns False (and writes nothing) when `step` is already saved; a step before the latest one is
        an error.
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
            raise ValueError(f"step {step} is before the latest checkpoint step {latest} in "
                             f"{str(self.directory)!r}; steps are saved in increasing order")
        return bool(self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave(metadata))))

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
                raise FileNotFoundError(f"no checkpoint in {str(self.directory)!r} (an unfinished save leaves "
                                        f"only a temporary directory, which is ignored)")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {str(self.directory)!r}; "
                                    f"saved steps: {steps}")
        return step

    def metadata(self, step: int | None = None) -> dict:
        """The metadata dict saved with `step` (default: the latest)."""
        step = self._check_step(step)
        return self._manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))["metadata"]

    def restore(self, step: int | None, target, *, expected_metadata: dict | None = None):
        """The state saved at `step` (None: the latest), laid out as `target` says.

        target: the state's pytree with a ``jax.ShapeDtypeStruct`` (or a jax array) for every array leaf,
          each with ``.sharding`` set to its NamedSharding on the mesh to restore onto — which may differ
          from the mesh it was saved from (e.g. saved on sp=8, restored onto dp=2 × sp=4); every host reads
          only its own shards. Python scalar leaves are restored as python scalars.
        expected_metadata: if given, its "model" entry must equal the checkpoint's, else ValueError naming
          every differing key ("checkpoint from an incompatible model: num_layers 2 != 4").
        Returns the restored pytree, with target's structure.
        """
        step = self._check_step(step)
        if expected_metadata is not None:
            self._check_metadata(step, expected_metadata)
        targets = _paths(target)
        leaves, treedef = jax.tree_util.tree_flatten(target)
        abstract = jax.tree_util.tree_unflatten(treedef, [_abstract(p, x) for p, x in zip(targets, leaves)])
        self._check_shapes(step, targets)
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        return restored["state"]

    def _check_metadata(self, step, expected):
        if not isinstance(expected, dict):
            raise ValueError(f"expected_metadata must be a dict, got {type(expected).__name__}")
        if "model" not in expected:
            raise ValueError(f"expected_metadata has no 'model' entry to compare (keys: {sorted(expected)})")
        saved = self.metadata(step).get("model")
        if saved is None:
            raise ValueError(f"checkpoint step {step} in {str(self.directory)!r} records no 'model' metadata")
        want = _flat_dict(json.loads(json.dumps(expected["model"])))   # tuples → lists, as saved
        have = _flat_dict(saved)
        missing = "<absent>"
        diffs = [f"{k} {have.get(k, missing)} != {want.get(k, missing)}"
                 for k in sorted(set(have) | set(want)) if have.get(k, missing) != want.get(k, missing)]
        if diffs:
            raise ValueError(f"checkpoint from an incompatible model: {', '.join(diffs)} "
                             f"(checkpoint step {step} != expected)")

    def _check_shapes(self, step, targets: dict):
        meta = self._manager.item_metadata(step)["state"]
        saved = _paths(getattr(meta, "tree", meta))
        only_saved = sorted(set(saved) - set(targets))
        only_target = sorted(set(targets) - set(saved))
        if only_saved or only_target:
            raise ValueError(f"restore target does not match checkpoint step {step}'s structure: "
                             f"only in the checkpoint {only_saved[:5]}, only in the target {only_target[:5]}")
        for path, t in targets.items():
            have, want = getattr(saved[path], "shape", None), getattr(t, "shape", None)
            if have is not None and want is not None and tuple(have) != tuple(want):
                raise ValueError(f"checkpoint step {step} has {path!r} of shape {tuple(have)}, but the restore "
                                 f"target expects {tuple(want)}")
