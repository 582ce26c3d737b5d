"""Checkpoints with orbax: train state + data-iterator position, saved together per step.

Layout: ``<workdir>/checkpoints/<step>/{state,data}`` managed by ``ocp.CheckpointManager``
(periodic saves, keep N, asynchronous; ``close()`` waits for the last save). Training restores the
whole state (``Checkpointer.restore``); evaluation restores the parameters only
(``Checkpointer.restore_params``: orbax's partial restore, no optimizer state is read).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match the model being restored."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint step whose files cannot be read (unreadable or truncated metadata or array data), as
    opposed to a readable checkpoint of another model (a plain ``CheckpointError``).

    Attributes:
      step: the corrupt step. directory: the checkpoints directory. reason: what could not be read.
      intact_step: the newest older step whose metadata reads, matches the model and whose files are
        all there (a cheap check: its arrays are not read), or None.
    """

    def __init__(self, step: int, directory: str, reason: str, intact_step: int | None):
        self.step, self.directory, self.reason, self.intact_step = step, directory, reason, intact_step
        super().__init__(self.describe())

    def describe(self, continue_with: str | None = None) -> str:
        """One line: the corrupt step, why, and the intact step (``continue_with``: how to use it)."""
        msg = f"checkpoint step {self.step} in {self.directory} is corrupt ({self.reason})"
        if self.intact_step is None:
            return msg + "; no older checkpoint is intact"
        msg += f"; step {self.intact_step} is intact"
        return msg + (f": continue from it with {continue_with}" if continue_with else "")


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True, create: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=create)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict | None, *, force: bool = False) -> bool:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state or {}),
        )
        return self.manager.save(step, args=args, force=force)

    def restore(self, step: int | None, abstract_state: Any) -> tuple[Any, dict]:
        """Restore (state, data_state) at ``step`` (default: latest) onto ``abstract_state``'s
        structure, shapes, dtypes and shardings.

        The step's metadata is read and compared with ``abstract_state`` first: unreadable metadata, or
        arrays that cannot be read after the metadata matched, are corruption; a readable checkpoint with
        other parameter names or shapes is a mismatch.

        Raises:
          CorruptCheckpointError: the step's files cannot be read (it names the newest intact older step).
          CheckpointError: no checkpoint (at ``step``), or one that does not match the model.
        """
        step = self._checked(step, abstract_state)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
        )
        try:
            restored = self.manager.restore(step, args=args)
        except Exception as e:
            raise self._corrupt(step, f"its arrays cannot be read: {_root_cause(e)}", abstract_state) from None
        return restored["state"], dict(restored["data"] or {})

    def restore_params(self, step: int | None, abstract_params: Any, *, subset: bool = False) -> Any:
        """Restore only ``state.params`` at ``step`` (default: latest) onto ``abstract_params``' structure,
        shapes and dtypes (leaves without a sharding land on the first device).

        Nothing else of the step is read: no optimizer state, rng or data-iterator position (orbax's
        partial restore, ``ocp.args.PyTreeRestore(partial_restore=True)``), so evaluation needs no
        optimizer and reads about a third of a train state's bytes. ``subset``: the checkpoint's params may
        hold more leaves than ``abstract_params`` (e.g. a DCP model read as its dense part); those are
        not read either.

        Raises:
          CorruptCheckpointError: the step's metadata or parameter arrays cannot be read.
          CheckpointError: no checkpoint (at ``step``), or parameters that do not match ``abstract_params``.
        """
        view = dict(part="params", subset=subset)
        step = self._checked(step, abstract_params, **view)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = {"params": jax.tree_util.tree_map(
            lambda x: x if getattr(x, "sharding", None) is not None else
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_params)}
        args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                      partial_restore=True)
        try:
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
                restored = reader.restore(epath.Path(self.directory) / str(step) / "state", args=args)
        except Exception as e:
            raise self._corrupt(step, f"its arrays cannot be read: {_root_cause(e)}", abstract_params, **view) from None
        return restored["params"]

    def _checked(self, step: int | None, abstract: Any, *, part: str | None = None, subset: bool = False) -> int:
        """``step`` (default: latest) after checking that it exists and that its metadata reads and matches
        ``abstract``: the whole state, or the entry ``part`` of it (``subset``: the checkpoint may hold more
        arrays there). Raises as ``restore``."""
        if step is None:
            step = self.latest_step()
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if step not in self.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available: {self.all_steps()}")
        try:
            metadata = self._state_metadata(step, part)
        except Exception as e:  # orbax/tensorstore raise a variety of errors for corrupt files
            raise self._corrupt(step, f"its metadata cannot be read: {_root_cause(e)}", abstract, part=part,
                                subset=subset) from None
        mismatch = _mismatch(abstract, metadata, subset=subset)
        if mismatch:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} does not match this model/config: "
                                  f"{mismatch}")
        return step

    def is_intact(self, step: int, abstract_state: Any, *, part: str | None = None, subset: bool = False) -> bool:
        """Cheap check of a step (no array is read): every file is non-empty, the state metadata (of its
        entry ``part``) reads and matches ``abstract_state``'s names and shapes (``subset``: holds them), and
        the data-iterator JSON reads."""
        step_dir = os.path.join(self.directory, str(step))
        try:
            files = [os.path.join(root, f) for root, _, names in os.walk(step_dir) for f in names]
            if not files or any(os.path.getsize(f) == 0 for f in files):
                return False
            if _mismatch(abstract_state, self._state_metadata(step, part), subset=subset):
                return False
            ocp.JsonCheckpointHandler().restore(epath.Path(step_dir) / "data")
        except Exception:
            return False
        return True

    def set_aside_after(self, step: int, destination: str) -> list[int]:
        """Move the checkpoints of the steps after ``step`` out of the checkpoints directory into
        ``destination`` (a resume from an earlier step; nothing is deleted), so the run can save those
        steps again. Process 0 moves them; every process then reloads the step list. Returns the steps."""
        steps = [s for s in self.all_steps() if s > step]
        if not steps:
            return []
        for s in steps:
            target, n = os.path.join(destination, str(s)), 1
            while os.path.exists(target):
                target, n = os.path.join(destination, f"{s}.{n}"), n + 1
            if jax.process_index() == 0:
                os.makedirs(destination, exist_ok=True)
                shutil.move(os.path.join(self.directory, str(s)), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("fox_jax.train.checkpoints.set_aside_after")
        self.manager.reload()
        return steps

    def _state_metadata(self, step: int, part: str | None = None):
        metadata = ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory) / str(step) / "state")
        return metadata if part is None else metadata[part]

    def _corrupt(self, step: int, reason: str, abstract_state: Any, **view) -> CorruptCheckpointError:
        intact = next((s for s in reversed(self.all_steps()) if s < step and self.is_intact(s, abstract_state, **view)),
                      None)
        return CorruptCheckpointError(step, self.directory, reason, intact)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _root_cause(e: BaseException) -> str:
    """``Type: first line`` of the innermost cause (tensorstore wraps the useful message)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).split("See full TensorStore details")[0].strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _leaf_name(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _mismatch(abstract: Any, metadata: Any, *, subset: bool = False) -> str | None:
    """The first difference between the arrays ``abstract`` expects and a checkpoint's metadata (names
    and shapes), or None. ``subset``: the checkpoint may hold more arrays than ``abstract``."""
    want = {_leaf_name(p): tuple(getattr(x, "shape", ())) for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    have = {_leaf_name(p): tuple(getattr(x, "shape", ())) for p, x in jax.tree_util.tree_flatten_with_path(metadata)[0]}
    extra = sorted(have.keys() - want.keys())
    if want.keys() - have.keys() or (extra and not subset):
        missing = sorted(want.keys() - have.keys())
        return (f"a different parameter structure (missing {', '.join(missing[:3]) or 'nothing'}; "
                f"unexpected {', '.join(extra[:3]) or 'nothing'})")
    for name, shape in want.items():
        if have[name] != shape:
            return f"{name} has shape {have[name]} where the model expects {shape}"
    return None
