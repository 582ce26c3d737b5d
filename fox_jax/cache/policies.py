"""Cache policies: which cached keys a query still sees, and therefore which the cache may free.

One class per policy, registered under its name (``POLICIES``; ``parse_policy`` reads the registry). A policy
answers everything the engine asks about it: its canonical ``spec``, whether its live set is per key/value head
(``per_head``), whether a pool below ``max_live`` is an error (``fixed_budget``) or an overflow to count, the
storage it wants (``storage``: a ring indexed by column, or a slot pool), the capacity a requested pool
becomes (``capacity``), the flash-op form of a first prefill (``flash_prefill``), what the model must provide
(``needs``, ``check``) and whether its promise is proven for a model (``provable``). How a policy decides
visibility (jax) is its rule in ``fox_jax.cache.visibility``; a new policy is a class here and a rule there.

Every policy is a *monotone* visibility rule: once key j is invisible to query i it is invisible to every
later query, so the cache frees it for good (``fox_jax.cache.slots``) and generation equals a full
recomputation under the policy's mask. Positions p are token positions (0 = a row's first real token).

  dense        every earlier token.
  window:W     the last W tokens, itself included: p_i − p_j < W (W ≥ 1).
  sinks:S+W    StreamingLLM: the first S tokens ("attention sinks") and the last W: p_j < S or p_i − p_j < W.
  dcp          Dynamic Context Pruning at inference (docs/design/dcp.md §5.2): key j survives query i iff
               every query n ∈ (j, i] voted to keep it, z_{n,j} = q_int_n·k_int_jᵀ/√r + β > 0. Needs a
               model trained or fine-tuned with DCP.
  acp[:LOG_EPS] forget-gate eviction (docs/design/inference.md §3): key j is invisible to the query heads of
               a key/value head once, for some query n ∈ (j, i], the decay Λ_n − Λ_j fell below the ACP
               threshold δ_n = −(2U_n + log N) + log ε (fox_acp.md §5.1) for *every* query head of that
               key/value head (a key/value head keeps a token while any of its query heads sees it; each
               query head then sees at least what its own rule keeps, so its lost weight stays ≤ ε). Λ is
               non-increasing, so each (row, key/value head) keeps a suffix of the context. Default
               log ε = −10. With QK-norm, U comes from the norm weights and the bound is **provable**;
               without QK-norm U_n is the running maximum of the observed logit bound
               scale·max‖q‖·max‖k‖ over the tokens up to n, a **heuristic** (``provable`` says which; the
               rule is cumulative, so the result does not depend on how the context was chunked). Needs a
               forget gate (FoX).

This module is jax-free (the CLI parses policies before importing jax).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import ClassVar

from fox_jax.call_site import caller_stacklevel

DEFAULT_LOG_EPSILON = -10.0  # = fox_jax.ops.acp.DEFAULT_LOG_EPSILON (the ACP repository's tolerance)
RING_BLOCK = 64  # every ring's capacity (behind any pinned slots) is a multiple of this: the decode kernel's key block
PIN_BLOCK = 16  # pinned slots come in a power of two ≥ this: the decode kernel reads them as one block (its MIN_BLOCK)


class HeuristicEvictionWarning(UserWarning):
    """A cache policy runs without its guarantee on this model (``acp`` without QK-norm)."""


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` ≥ max(n, 1)."""
    return -(-max(int(n), 1) // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class CachePolicy:
    """A parsed cache policy: the base of the policy classes (see the module docstring for the rules).

    Class attributes (what the engine asks instead of testing a name):
      name: the registry key and the spec's head ("dense", "window", ...).
      form: the accepted spec form, for error messages ("window:W").
      per_head: the live set differs per key/value head (one eviction state per (row, key/value head)).
      fixed_budget: the live count is known in advance (``max_live``): a smaller pool is an error, not an
        overflow.
      storage: "ring" (slot of column c is c mod C; the live set is a suffix [start, length) per row or
        head, plus ``pinned`` first positions) or "pool" (slots freed by the rule and reused lowest first).
      needs: {layout key: what it means} the model's cache layout must provide (``check``).
      forward_exact: the model's own full forward (no cache) applies exactly this visibility (dense; dcp on
        a DCP model, at α = ∞), so scoring may skip the cache.
    """

    name: ClassVar[str] = ""
    form: ClassVar[str] = ""
    per_head: ClassVar[bool] = False
    fixed_budget: ClassVar[bool] = True
    storage: ClassVar[str] = "ring"
    needs: ClassVar[dict] = {}
    forward_exact: ClassVar[bool] = False

    @classmethod
    def parse(cls, arg: str, spec: str) -> CachePolicy:
        """The policy of ``spec`` = ``name`` or ``name:arg``. Raises ValueError (one line) for bad ``arg``."""
        if arg:
            raise ValueError(f"cache policy {spec!r} takes no argument (policies: {policy_forms()})")
        return cls()

    @property
    def spec(self) -> str:
        """The canonical string form, which ``parse_policy`` reads back."""
        return self.name

    @property
    def pinned(self) -> int:
        """Positions 0 .. pinned − 1 of a row kept for good in slots of their own (``sinks``: S), else 0."""
        return 0

    @property
    def pin_slots(self) -> int:
        """The slots in front of the ring that hold the ``pinned`` positions (0 without)."""
        return 0

    def max_live(self, context: int) -> int:
        """The most tokens a row (or head) holds after ``context`` tokens were fed: the slots that never
        overflow (≥ 1)."""
        return max(1, context)

    def capacity(self, slots: int, block: int = RING_BLOCK) -> int:
        """Entries per row (and head) a cache allocates when ``slots`` are asked for: ``slots`` rounded up to
        a multiple of ``block`` (the decode kernel reads whole blocks; a ring never has a block across its
        wrap)."""
        return round_up(slots, block)

    def flash_prefill(self) -> dict | None:
        """Keyword arguments of ``fox_jax.ops.forgetting_attention`` that express the policy for a first
        chunk on a fresh cache ({} for dense, {"window_size": W} for a window), or None: the masked path."""
        return None

    def missing(self, layout: dict) -> str | None:
        """What the model lacks to run this policy (from ``needs``), or None."""
        for key, what in self.needs.items():
            if not layout.get(key):
                return what
        return None

    def provable(self, layout: dict) -> bool:
        """Whether the policy's promise holds by construction for a model with this cache layout. The
        positional rules and DCP's learned votes are exact by definition (True); ``acp``'s promise, each
        query loses ≤ ε of its attention weight, is proven only with QK-norm."""
        return True

    def check(self, layout: dict) -> None:
        """Refuse a model the policy cannot run; warn (once per process and message, ``warnings``) when it
        runs as a heuristic.

        Args:
          layout: the model's cache layout (``FamilyModules.cache_layout``: forget_gate, interaction_dim,
            qk_norm, ...).

        Raises:
          ValueError: one line naming what is missing (e.g. "cache policy 'dcp' needs a DCP model ...").
        """
        what = self.missing(layout)
        if what is not None:
            raise ValueError(f"cache policy {self.spec!r} needs {what}")
        if not self.provable(layout):
            warnings.warn(f"cache policy {self.spec!r} runs as a heuristic on this model: {self.heuristic_note}",
                          HeuristicEvictionWarning, stacklevel=caller_stacklevel())

    heuristic_note: ClassVar[str] = ""

    def __str__(self) -> str:
        return self.spec


POLICIES: dict[str, type[CachePolicy]] = {}


def register_policy(cls: type[CachePolicy]) -> type[CachePolicy]:
    """Class decorator: make ``cls`` parseable as ``cls.name[:arg]`` (its rule goes in
    ``fox_jax.cache.visibility``)."""
    POLICIES[cls.name] = cls
    return cls


def _int(text: str, what: str, spec: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"cache policy {spec!r}: {what} must be an int ≥ {minimum}, got {text!r} "
                         f"(policies: {policy_forms()})")
    return value


@register_policy
@dataclasses.dataclass(frozen=True)
class Dense(CachePolicy):
    """Every earlier token: a ring of at least the context (it never wraps while one sequence is served)."""

    name: ClassVar[str] = "dense"
    form: ClassVar[str] = "dense"
    forward_exact: ClassVar[bool] = True

    def flash_prefill(self) -> dict:
        return {}


@register_policy
@dataclasses.dataclass(frozen=True)
class DCP(CachePolicy):
    """DCP's learned votes: survivors in a slot pool (freed entries reused lowest first)."""

    name: ClassVar[str] = "dcp"
    form: ClassVar[str] = "dcp"
    fixed_budget: ClassVar[bool] = False
    storage: ClassVar[str] = "pool"
    needs: ClassVar[dict] = {"interaction_dim": "a DCP model (trained or fine-tuned with DCP: cfg.dcp=True)"}
    forward_exact: ClassVar[bool] = True


@register_policy
@dataclasses.dataclass(frozen=True)
class ACP(CachePolicy):
    """Forget-gate eviction: a per (row, key/value head) suffix in a ring of that head group's capacity.

    Attributes:
      log_epsilon: log ε (nats, < 0): the attention weight a query may lose.
    """

    log_epsilon: float = DEFAULT_LOG_EPSILON
    name: ClassVar[str] = "acp"
    form: ClassVar[str] = "acp[:LOG_EPS]"
    per_head: ClassVar[bool] = True
    fixed_budget: ClassVar[bool] = False
    needs: ClassVar[dict] = {"forget_gate": "a FoX model (a forget gate): it evicts by forget-gate decay"}
    heuristic_note: ClassVar[str] = ("without QK-norm no bound on future logits exists, so the threshold comes "
                                     "from the running maxima of the observed q and k norms and the ε bound "
                                     "on the lost attention weight is not guaranteed")

    @classmethod
    def parse(cls, arg: str, spec: str) -> ACP:
        if not arg:
            return cls()
        try:
            log_eps = float(arg)
        except ValueError:
            log_eps = math.nan
        if not (log_eps < 0 and math.isfinite(log_eps)):
            raise ValueError(f"cache policy {spec!r}: acp:LOG_EPS needs a finite log ε < 0, e.g. acp:-10")
        return cls(log_eps)

    @property
    def spec(self) -> str:
        return self.name if self.log_epsilon == DEFAULT_LOG_EPSILON else f"acp:{self.log_epsilon:g}"

    def provable(self, layout: dict) -> bool:
        return bool(layout.get("qk_norm"))


@register_policy
@dataclasses.dataclass(frozen=True)
class Window(CachePolicy):
    """The last W tokens: a ring of at least W entries.

    Attributes:
      window: W ≥ 1 (tokens, the query itself included).
    """

    window: int
    name: ClassVar[str] = "window"
    form: ClassVar[str] = "window:W"

    @classmethod
    def parse(cls, arg: str, spec: str) -> Window:
        if not arg:
            raise ValueError(f"cache policy {spec!r} needs its window: window:W with W ≥ 1 tokens, e.g. window:256")
        return cls(_int(arg, "W", spec))

    @property
    def spec(self) -> str:
        return f"window:{self.window}"

    def max_live(self, context: int) -> int:
        return max(1, min(self.window, context))

    def flash_prefill(self) -> dict:
        return {"window_size": self.window}


@register_policy
@dataclasses.dataclass(frozen=True)
class Sinks(CachePolicy):
    """StreamingLLM: S sink positions in slots of their own, and a ring of at least W entries.

    Attributes:
      sinks: S ≥ 0 sink tokens; window: W ≥ 1.
    """

    sinks: int
    window: int
    name: ClassVar[str] = "sinks"
    form: ClassVar[str] = "sinks:S+W"

    @classmethod
    def parse(cls, arg: str, spec: str) -> Sinks:
        if "+" not in arg:
            raise ValueError(f"cache policy {spec!r} needs sinks and window: sinks:S+W (S sink tokens, a window of "
                             f"W), e.g. sinks:4+252")
        s, _, w = arg.partition("+")
        return cls(_int(s, "S", spec, minimum=0), _int(w, "W", spec))

    @property
    def spec(self) -> str:
        return f"sinks:{self.sinks}+{self.window}"

    @property
    def pinned(self) -> int:
        return self.sinks

    @property
    def pin_slots(self) -> int:
        """S rounded up to a power of two ≥ ``PIN_BLOCK`` (the decode kernel reads the sink slots as one block), or
        0 when S = 0."""
        return max(PIN_BLOCK, 1 << (self.sinks - 1).bit_length()) if self.sinks else 0

    def max_live(self, context: int) -> int:
        return max(1, min(self.sinks + self.window, context))

    def capacity(self, slots: int, block: int = RING_BLOCK) -> int:
        """The sink slots (``pin_slots``) and a ring of the other slots − S entries rounded up to a multiple of
        ``block`` (at least one: a decode step writes every token to the ring)."""
        return self.pin_slots + round_up(slots - self.sinks, block)


def policy_forms() -> str:
    """The accepted policy forms, every registered policy included (the error messages name them)."""
    return ", ".join(cls.form for cls in POLICIES.values())


POLICY_FORMS = policy_forms()  # the built-in forms, at import (``policy_forms()`` also lists those registered later)


def parse_policy(spec) -> CachePolicy:
    """Parse ``dense``, ``dcp``, ``acp``, ``acp:LOG_EPS``, ``window:W`` or ``sinks:S+W`` (any registered
    ``name[:arg]``), or pass a ``CachePolicy`` through.

    Raises:
      ValueError: an unknown policy or bad numbers (one line naming the accepted forms).
    """
    if isinstance(spec, CachePolicy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"cache policy must be a string ({policy_forms()}), got {type(spec).__name__}")
    text = spec.strip().lower()
    name, _, arg = text.partition(":")
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown cache policy {spec!r}; expected one of: {policy_forms()}")
    return cls.parse(arg, spec)


__all__ = ["ACP", "CachePolicy", "DCP", "DEFAULT_LOG_EPSILON", "Dense", "HeuristicEvictionWarning", "POLICIES",
           "POLICY_FORMS", "RING_BLOCK", "Sinks", "Window", "parse_policy", "policy_forms", "register_policy", "round_up"]
