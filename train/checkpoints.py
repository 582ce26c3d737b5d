"""Checkpoints with orbax: train state + data-iterator position, saved together per step.

Layout: ``<workdir>/checkpoints/<step>/{state,data}`` managed by ``ocp.CheckpointManager``
(periodic saves, keep N, asynchronous; ``close()`` waits for the last save).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match the model being restored."""


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True, create: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=create)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict | None, *, force: bool = False) -> bool:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state or {}),
        )
        return self.manager.save(step, args=args, force=force)

    def restore(self, step: int | None, abstract_state: Any) -> tuple[Any, dict]:
        """Restore (state, data_state) at ``step`` (default: latest) onto ``abstract_state``'s
        structure, shapes, dtypes and shardings.

        Raises:
          CheckpointError: no checkpoint, or one that cannot be read or does not match the model.
        """
        if step is None:
            step = self.latest_step()
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
        )
        try:
            restored = self.manager.restore(step, args=args)
        except FileNotFoundError as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is incomplete: {e}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} does not match this model/config "
                f"({type(e).__name__}: {_first_line(e)})") from None
        except Exception as e:  # orbax/tensorstore raise a variety of errors for corrupt files
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} could not be read "
                f"({type(e).__name__}: {_first_line(e)})") from None
        _check_shapes(abstract_state, restored["state"], step, self.directory)
        return restored["state"], dict(restored["data"] or {})

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _check_shapes(abstract, restored, step, directory):
    a_leaves, a_tree = jax.tree_util.tree_flatten(abstract)
    r_leaves, r_tree = jax.tree_util.tree_flatten(restored)
    if a_tree != r_tree:
        raise CheckpointError(f"checkpoint step {step} in {directory} has a different parameter structure")
    for a, r in zip(a_leaves, r_leaves):
        if getattr(a, "shape", None) != getattr(r, "shape", None):
            raise CheckpointError(
                f"checkpoint step {step} in {directory} has shape {r.shape} where the model expects {a.shape}")


def restore_run(workdir: str, abstract_state: Any, step: int | None = None) -> Any:
    """Read the train state of ``<workdir>/checkpoints`` (latest, or ``step``) without changing it.

    Raises:
      CheckpointError: no checkpoints directory, no such step, or an unreadable / mismatched checkpoint.
    """
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{workdir} has no checkpoints/ directory; train first or pass the right --workdir")
    ckpt = Checkpointer(ckpt_dir, async_save=False, create=False)
    try:
        if step is not None and step not in ckpt.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {ckpt_dir}; available: {ckpt.all_steps()}")
        state, _ = ckpt.restore(step, abstract_state)
    finally:
        ckpt.close()
    return state
