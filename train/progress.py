"""Progress output of every command: one rule for bars, and a heartbeat for logs.

* ``progress_bar``: a tqdm bar only when stderr is a terminal (and the command's ``--no-progress`` is not
  given); in a log file or a pipe no bar is drawn, so no carriage returns are written.
* ``Heartbeat``: where no bar is drawn, a short line (step, elapsed time, ETA) every ``interval``
  seconds between the log lines of a long loop (``train``'s steps, ``passkey``'s prompts).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable

import tqdm as tqdm_module

from tqdm.auto import tqdm


def bars_shown(progress: bool = True) -> bool:
    """Whether a progress bar is drawn: ``progress`` asked for and stderr is a terminal."""
    try:
        return bool(progress) and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def progress_bar(iterable=None, *, progress: bool = True, **kwargs) -> tqdm:
    """``tqdm(iterable, **kwargs)``, disabled unless ``bars_shown(progress)``."""
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, disable=not bars_shown(progress), **kwargs)


@contextlib.contextmanager
def foreign_bars(progress: bool = True):
    """Within: other libraries' tqdm bars (lm-eval's) follow the same rule, disabled unless
    ``bars_shown(progress)`` (they pass ``disable=`` themselves, which TQDM_DISABLE does not override)."""
    if bars_shown(progress):
        yield
        return
    cls = tqdm_module.std.tqdm
    original = cls.__init__

    def quiet(self, *args, **kwargs):
        kwargs["disable"] = True
        original(self, *args, **kwargs)

    cls.__init__ = quiet
    try:
        yield
    finally:
        cls.__init__ = original


def _duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def elapsed_eta(elapsed: float, done: int, total: int) -> str:
    """``4.2 min elapsed | ETA 8.1 min``: the ETA extrapolates the rate of the ``done`` units of ``total``
    (none before the first unit, or when all are done)."""
    line = f"{_duration(elapsed)} elapsed"
    if 0 < done < total:
        line += f" | ETA {_duration(elapsed / done * (total - done))}"
    return line


class Heartbeat:
    """Writes ``step 3/300 | 2.1 min elapsed | ETA 3.4 h`` every ``interval`` seconds of a loop whose
    progress is not otherwise visible (``enabled`` False or ``interval`` <= 0: silent). ``label`` names
    what is counted (default ``step``).

    Call ``tick(step)`` after each step and ``reset()`` after each regular log line (the next heartbeat
    comes ``interval`` seconds after it). The ETA extrapolates the rate of the steps done since the
    heartbeat was created.
    """

    def __init__(self, total: int, interval: float, *, start_step: int = 0, enabled: bool = True,
                 write: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 label: str = "step"):
        self.total, self.interval, self.start_step, self.label = total, interval, start_step, label
        self.enabled = enabled and interval > 0
        self._write = write or tqdm.write
        self._clock = clock
        self._t0 = self._last = clock()

    def reset(self) -> None:
        self._last = self._clock()

    def tick(self, step: int) -> None:
        if not self.enabled:
            return
        now = self._clock()
        if now - self._last < self.interval:
            return
        self._last = now
        done = step - self.start_step
        self._write(f"{self.label} {step}/{self.total} | "
                    + elapsed_eta(now - self._t0, done, done + max(self.total - step, 0)))
