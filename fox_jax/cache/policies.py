"""Cache policies: which cached keys a query still sees, and therefore which the cache may free.

Every policy is a *monotone* visibility rule: once key j is invisible to query i it is invisible to every
later query, so the cache frees it for good (``fox_jax.cache.slots``) and generation equals a full
recomputation under the policy's mask. Positions p are token positions (0 = a row's first real token).

  dense        every earlier token.
  window:W     the last W tokens, itself included: p_i − p_j < W (W ≥ 1).
  sinks:S+W    StreamingLLM: the first S tokens ("attention sinks") and the last W: p_j < S or p_i − p_j < W.
  dcp          Dynamic Context Pruning at inference (docs/design/dcp.md §5.2): key j survives query i iff
               every query n ∈ (j, i] voted to keep it, z_{n,j} = q_int_n·k_int_jᵀ/√r + β > 0. Needs a
               model trained or fine-tuned with DCP.
  acp[:LOG_EPS] forget-gate eviction (docs/design/inference.md §3): key j is invisible to query i once the
               decay Λ_i − Λ_j < δ, δ = −(2U + log N) + log ε the ACP threshold (fox_acp.md §5.1), so the
               attention weight the query loses is ≤ ε (default log ε = −10). Λ is non-increasing, so the
               decay of key j only falls as i grows: the eviction is irreversible. With QK-norm, U comes from
               the norm weights and the bound is **provable**; without QK-norm U is estimated from the
               chunk's own q and k norms and the eviction is a **heuristic** (``provable`` says which).
               Per (row, key/value head): with GQA a key/value head keeps a token while any of its query
               heads sees it. Needs a forget gate (FoX).

This module is jax-free (the CLI parses policies before importing jax).
"""

from __future__ import annotations

import dataclasses
import math

POLICY_FORMS = "dense, dcp, acp[:LOG_EPS], window:W, sinks:S+W"
KINDS = ("dense", "dcp", "acp", "window", "sinks")
DEFAULT_LOG_EPSILON = -10.0  # = fox_jax.ops.acp.DEFAULT_LOG_EPSILON (the ACP repository's tolerance)


@dataclasses.dataclass(frozen=True)
class CachePolicy:
    """A parsed cache policy (see the module docstring for the rules).

    Attributes:
      kind: one of ``KINDS``.
      window: W for ``window`` and ``sinks`` (tokens), else None.
      sinks: S for ``sinks`` (tokens), else 0.
      log_epsilon: log ε of ``acp`` (nats, < 0): the attention weight a query may lose.
    """

    kind: str = "dense"
    window: int | None = None
    sinks: int = 0
    log_epsilon: float = DEFAULT_LOG_EPSILON

    @property
    def spec(self) -> str:
        """The canonical string form, which ``parse_policy`` reads back."""
        if self.kind == "window":
            return f"window:{self.window}"
        if self.kind == "sinks":
            return f"sinks:{self.sinks}+{self.window}"
        if self.kind == "acp" and self.log_epsilon != DEFAULT_LOG_EPSILON:
            return f"acp:{self.log_epsilon:g}"
        return self.kind

    @property
    def per_head(self) -> bool:
        """Whether the live set differs per key/value head (``acp``) or is one per row."""
        return self.kind == "acp"

    def max_live(self, context: int) -> int:
        """The most tokens a row (or head) holds after ``context`` tokens were fed: the slots that never
        overflow (≥ 1)."""
        if self.kind == "window":
            return min(self.window, context)
        if self.kind == "sinks":
            return min(self.sinks + self.window, context)
        return max(1, context)

    def __str__(self) -> str:
        return self.spec


def _int(text: str, what: str, spec: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"cache policy {spec!r}: {what} must be an int ≥ {minimum}, got {text!r} "
                         f"(policies: {POLICY_FORMS})")
    return value


def parse_policy(spec) -> CachePolicy:
    """Parse ``dense``, ``dcp``, ``acp``, ``acp:LOG_EPS``, ``window:W`` or ``sinks:S+W`` (or pass a
    ``CachePolicy`` through).

    Raises:
      ValueError: an unknown policy or bad numbers (one line naming the accepted forms).
    """
    if isinstance(spec, CachePolicy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"cache policy must be a string ({POLICY_FORMS}), got {type(spec).__name__}")
    text = spec.strip().lower()
    kind, _, arg = text.partition(":")
    if kind in ("dense", "dcp") and not arg:
        return CachePolicy(kind)
    if kind == "acp":
        if not arg:
            return CachePolicy("acp")
        try:
            log_eps = float(arg)
        except ValueError:
            log_eps = math.nan
        if not (log_eps < 0 and math.isfinite(log_eps)):
            raise ValueError(f"cache policy {spec!r}: acp:LOG_EPS needs a finite log ε < 0, e.g. acp:-10")
        return CachePolicy("acp", log_epsilon=log_eps)
    if kind == "window" and arg:
        return CachePolicy("window", window=_int(arg, "W", spec))
    if kind == "sinks" and "+" in arg:
        s, _, w = arg.partition("+")
        return CachePolicy("sinks", window=_int(w, "W", spec), sinks=_int(s, "S", spec, minimum=0))
    raise ValueError(f"unknown cache policy {spec!r}; expected one of: {POLICY_FORMS}")


__all__ = ["CachePolicy", "DEFAULT_LOG_EPSILON", "KINDS", "POLICY_FORMS", "parse_policy"]
