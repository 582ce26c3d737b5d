"""What every config dataclass checks: numeric field ranges and the shared choices.

The model configs (``fox_jax.models.lm.ModelConfig``, ``fox_jax.models.gpt2.GPT2Config``) and the
training configs (``fox_jax.train.config``) call ``check_ranges`` from ``__post_init__``. This module
imports nothing of the project, so every layer may use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

GPT2_VOCAB = 50257
REMAT_POLICIES = ("none", "full", "dots")  # ModelFamily.remat: no remat, save only block inputs, save matmuls
DTYPES = ("float32", "bfloat16", "float16")  # compute dtype names (params are always float32)


# Numeric ranges of config fields ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric config field accepts.

    Attributes:
      lo, hi: bounds (None = unbounded); ``lo_open`` / ``hi_open`` exclude them.
      integer: the value must be an ``int`` (``bool`` is refused); otherwise an int or a finite float.
      optional: ``None`` is accepted too (a default resolved later).
    """

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    optional: bool = False

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value < self.lo or self.lo_open and value == self.lo):
            return False
        return self.hi is None or not (value > self.hi or self.hi_open and value == self.hi)

    def describe(self) -> str:
        kind = "an int" if self.integer else "a finite number"
        if self.lo is not None and self.hi is not None:
            text = (f"{kind} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                    f"{')' if self.hi_open else ']'}")
        elif self.lo is not None:
            text = f"{kind} {'>' if self.lo_open else '>='} {self.lo:g}"
        elif self.hi is not None:
            text = f"{kind} {'<' if self.hi_open else '<='} {self.hi:g}"
        else:
            text = kind
        return f"None or {text}" if self.optional else text


POSITIVE_INT = Range(1, integer=True)
NON_NEGATIVE_INT = Range(0, integer=True)
POSITIVE = Range(0, lo_open=True)
NON_NEGATIVE = Range(0)
FINITE = Range()


def check_ranges(obj: Any, prefix: str = "") -> None:
    """Check every field named in ``type(obj).RANGES`` (a dict field name -> ``Range``).

    The config dataclasses call this from ``__post_init__``, so every way of building one (presets,
    ``key=value`` overrides, flags, saved JSON) is checked once.

    Raises:
      ValueError: ``"<prefix><field> must be <range>, got <value>"`` for the first field out of range.
    """
    for name, allowed in type(obj).RANGES.items():
        value = getattr(obj, name)
        if not allowed.accepts(value):
            raise ValueError(f"{prefix}{name} must be {allowed.describe()}, got {value!r}")
