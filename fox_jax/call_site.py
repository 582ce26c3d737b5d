"""Warnings that name the user's line, not fox_jax's.

``warnings.warn(..., stacklevel=n)`` names the frame ``n`` levels above the call, which is right for one call
path only. fox_jax warns deep inside its calls: a cache policy's check (``HeuristicEvictionWarning``) runs in
``new_slot_cache``, under ``ModelConfig.init_cache``, under ``fox_jax.decoding.generate`` or
``token_losses_under_policy``, under ``fox_jax.train.evaluate.evaluate_run(cache=...)``, at a depth that
differs by entry point; a fixed ``stacklevel`` names fox_jax's own files on all paths but one.

``caller_stacklevel()`` is the ``stacklevel`` of the innermost frame outside fox_jax and outside the
libraries whose transforms can sit between the user's call and fox_jax code they trace (jax, jaxlib, flax):
the user's line, whatever the path. It walks the frames as ``warnings.warn`` counts them (frames of
``importlib._bootstrap`` are not counted), so it is the same as Python 3.12's
``warnings.warn(..., skip_file_prefixes=...)`` and works on every Python the package supports::

    warnings.warn(message, SomeWarning, stacklevel=caller_stacklevel())

Called from fox_jax's command line, where every frame is fox_jax's, it names the outermost one outside
(the ``fox-jax`` script or ``runpy``); the CLI prints fox_jax's warnings as one ``warning: ...`` line anyway.
Imports nothing of the project (the jax-free modules may use it).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import Sequence

# libraries whose frames lie between a user's call and the fox_jax code it reaches (a jit trace, a flax apply)
THROUGH = ("jax", "jaxlib", "flax")


@functools.lru_cache(maxsize=None)
def _package_prefixes() -> tuple[str, ...]:
    """fox_jax's directory, and the targets of the subpackages that are symlinks in a checkout
    (``fox_jax/train -> ../train``): a frame's file name may be either form."""
    root = os.path.dirname(os.path.abspath(__file__))
    dirs = {root}
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.is_symlink() and entry.is_dir():
                dirs.add(os.path.realpath(entry.path))
    return tuple(sorted(d.rstrip(os.sep) + os.sep for d in dirs))


def skipped_prefixes() -> tuple[str, ...]:
    """The file-name prefixes ``caller_stacklevel`` skips: fox_jax, and ``THROUGH`` where imported."""
    out = list(_package_prefixes())
    for name in THROUGH:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            out.append(os.path.dirname(os.path.abspath(path)).rstrip(os.sep) + os.sep)
    return tuple(out)


def _internal(frame) -> bool:
    """A frame ``warnings.warn`` does not count (CPython's ``is_internal_frame``)."""
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


def caller_stacklevel(skip: Sequence[str] | None = None) -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` call, made by the function that calls this one, name
    the innermost frame whose file name starts with none of ``skip`` (default ``skipped_prefixes()``).

    Beyond the outermost frame (every frame skipped) it returns a level past the stack, for which
    ``warnings`` names ``sys``."""
    prefixes = tuple(skipped_prefixes() if skip is None else skip)
    frame, level = sys._getframe(1), 1  # the function calling warnings.warn: stacklevel 1
    while frame is not None and frame.f_code.co_filename.startswith(prefixes):
        frame = frame.f_back
        while frame is not None and _internal(frame):
            frame = frame.f_back
        level += 1
    return level


def warn_at_caller(message: str, category: type[Warning] = UserWarning, *,
                   skip: Sequence[str] | None = None) -> None:
    """``warnings.warn(message, category)`` naming the innermost frame outside ``skip`` (``caller_stacklevel``)."""
    warnings.warn(message, category, stacklevel=caller_stacklevel(skip))


__all__ = ["THROUGH", "caller_stacklevel", "skipped_prefixes", "warn_at_caller"]
