"""Visibility rules (jax): for each cache policy class, which cached keys the queries of a chunk see.

A rule answers in the form its policy's storage needs (``CachePolicy.storage``, ``fox_jax.cache.slots``):

* ring policies (dense, window, sinks, acp) keep a *suffix* of the context per row (or per key/value head):
  ``first_visible`` gives, for each query of the chunk, the first column it sees. The storage makes it
  cumulative (a key once hidden stays hidden: a running maximum over the queries and the cache's ``start``),
  clamps it to the row's first position (plus the ``pinned`` sink positions, which stay visible) and reads
  [start, length) of its ring;
* pool policies (dcp) may hide any key: ``masks`` gives (vis_old [B, ·, ·, T, S], vis_new [B, ·, ·, T, T]),
  which the storage combines with its occupancy, causality and padding.

``prepare`` runs once per layer call before the head groups (e.g. acp's threshold per query and head) and may
update a per-layer ``state`` the rule keeps in the cache (``init_state``; acp without QK-norm keeps the running
maxima of the q and k norms). A new policy is a class in ``fox_jax.cache.policies`` and a rule here,
registered with ``@register_rule(ThePolicy)``.

What the layer hands over is ``LayerFacts`` (model facts, never policy decisions): the QK-norm logit bound
and DCP's interaction queries, keys and β.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fox_jax.cache.policies import ACP, DCP, CachePolicy, Dense, Sinks, Window
from fox_jax.ops.acp import threshold_from_bound
from fox_jax.ops.context_pruning import cumulative_keep_log_mask, keep_logits

NEG = -(2 ** 30)  # "no column": below every column a cache uses, and safe to add 1 to


class LayerFacts(NamedTuple):
    """Model facts an attention layer hands its cache with each chunk (all optional).

    Attributes:
      logit_bound: [H] float32 U_h with |scale·q·k| ≤ U_h for every pair, from the QK-norm weights
        (``fox_jax.ops.acp.qk_norm_logit_bound``), or None (no static bound: no QK-norm).
      q_int, k_int: [B, T, r] float32 DCP interaction queries and keys of the chunk; beta: the layer's β.
    """

    logit_bound: jax.Array | None = None
    q_int: jax.Array | None = None
    k_int: jax.Array | None = None
    beta: jax.Array | None = None


class Chunk(NamedTuple):
    """A chunk of T ≥ 1 tokens appended to one layer's cache, as every rule may read it.

    Attributes:
      cols: [T] int32 columns; pos: [B, T] int32 positions (negative on left pads); real: [B, T] bool.
      seq_start: [B] int32. q: [B, T, H, D], k: [B, T, Hkv, D]: ready for attention — except on a fused decode step
        (``fox_jax.cache.slots.slot_attention`` with ``HeadOps``, when the rule's ``needs_qk`` is False), where they
        are the raw projections and only their shapes are meaningful.
      lam: (hi, lo) Λ of the chunk's tokens, each [B, T, H] float32, or None without forget gates.
      facts: ``LayerFacts``. scale: the logit scale. max_context: N, the most keys a query can see.
      fresh: the cache had been fed nothing before this chunk (static).
    """

    cols: jax.Array
    pos: jax.Array
    real: jax.Array
    seq_start: jax.Array
    q: jax.Array
    k: jax.Array
    lam: Any
    facts: LayerFacts
    scale: float
    max_context: int
    fresh: bool = True


class Keys(NamedTuple):
    """One head group's cached entries and the chunk's decays, as a rule sees them.

    Attributes:
      heads: the group's key/value heads (static tuple, indices into Hkv).
      col: [B or 1, 1, S] int32, the column each slot holds (meaningful where ``held``).
      held: [B, nt, S] bool, the slots that hold a key (nt = 1: per-row tables, nt = n: per head).
      decay_old: [B, n, G, T, S] float32 Λ_query − Λ_slot, or None; decay_new: [B, n, G, T, T], or None.
      k_int: [B, S, r] float32 DCP interaction keys of the slots (pools of ``dcp``), or None.
    """

    heads: tuple
    col: jax.Array
    held: jax.Array
    decay_old: jax.Array | None
    decay_new: jax.Array | None
    k_int: jax.Array | None


class Rule:
    """How one policy class decides visibility (see the module docstring). Subclasses override
    ``first_visible`` (ring storage) or ``masks`` (pool storage) and, if they keep state, the rest."""

    def init_state(self, policy: CachePolicy, batch: int, layout: dict) -> Any:
        """The per-layer state kept in the cache (a pytree), or None."""
        return None

    def state_axes(self, state: Any) -> Any:
        """Logical axis names of ``state`` (same structure, a tuple per array)."""
        return None

    def prepare(self, policy: CachePolicy, state: Any, chunk: Chunk) -> tuple[Any, Any]:
        """(aux, new state): per-layer work before the head groups; ``aux`` goes to the per-group calls."""
        return None, state

    def needs_qk(self, state: Any) -> bool:
        """Whether any method of the rule reads the values of the chunk's q and k (then a decode step computes them
        ready for attention in XLA; else the decode op may get the raw projections and do the layer's per-head work
        in its kernel: ``Chunk.q`` / ``Chunk.k`` are raw there; ``fox_jax.cache.slots.slot_attention``). A rule
        that reads them must say so here."""
        return False

    def first_visible(self, policy: CachePolicy, aux: Any, chunk: Chunk, keys: Keys) -> jax.Array:
        """Ring policies: [B or 1, nt or 1, T] int32, the first column each query would see by itself."""
        raise NotImplementedError(f"{type(policy).__name__} has no suffix rule (its storage is a pool)")

    def masks(self, policy: CachePolicy, aux: Any, chunk: Chunk, keys: Keys) -> tuple[jax.Array, jax.Array]:
        """Pool policies: (vis_old, vis_new) broadcastable to [B, n, G, T, S] and [B, n, G, T, T]."""
        raise NotImplementedError(f"{type(policy).__name__} has no mask rule (its storage is a ring)")

    def decay_floor(self, policy: CachePolicy, aux: Any, chunk: Chunk, heads: tuple) -> jax.Array | None:
        """Ring policies whose ``first_visible`` for one query is "one past the last held key whose decay is below
        a floor for every query head of its group": that floor, [B, n, G] float32 for the key/value heads
        ``heads`` (a decode step hands it to ``decode_attention_append``, whose kernel applies it while it reads);
        None for every other rule, and for a subclass that overrides ``first_visible`` (its own rule then runs)."""
        return None


RULES: dict[type, Rule] = {}


def register_rule(policy_cls: type[CachePolicy]):
    """Class decorator: the rule of ``policy_cls`` (an instance is registered)."""
    def wrap(rule_cls: type[Rule]) -> type[Rule]:
        RULES[policy_cls] = rule_cls()
        return rule_cls
    return wrap


def rule_for(policy: CachePolicy) -> Rule:
    """The registered rule of ``policy``'s class.

    Raises:
      TypeError: a policy class without a rule.
    """
    rule = RULES.get(type(policy))
    if rule is None:
        raise TypeError(f"no visibility rule registered for {type(policy).__name__} (fox_jax.cache.visibility)")
    return rule


@register_rule(Dense)
class DenseRule(Rule):
    """Every earlier token: nothing hidden (the storage bounds it by the row's first position)."""

    def first_visible(self, policy, aux, chunk, keys):
        return jnp.full((1, 1, chunk.cols.shape[0]), NEG, jnp.int32)


@register_rule(Window)
class WindowRule(Rule):
    """p_i − p_j < W: the first visible column is c_i − W + 1."""

    def first_visible(self, policy, aux, chunk, keys):
        return (chunk.cols - (policy.window - 1))[None, None]


@register_rule(Sinks)
class SinksRule(WindowRule):
    """p_j < S or p_i − p_j < W: the window's suffix; the S sink positions are the storage's pinned slots."""


class NormMaxima(NamedTuple):
    """Running maxima of the observed norms (acp without QK-norm): q [B, H], k [B, Hkv] float32."""

    q: jax.Array
    k: jax.Array


class ProvenThreshold(NamedTuple):
    """acp with QK-norm: δ [B, H] float32 per row and query head, set from the layer's logit bound by a fresh
    cache's first chunk and by every chunk of several tokens (the same value; −∞: not set, hides nothing); a
    decode step reads it, so it recomputes nothing from the weights. Per row, so a row refilled while others
    decode can set its own."""

    delta: jax.Array


KEY_BLOCK = 1024  # slots per step of ``last_hidden``'s loop


def last_hidden(decay: jax.Array, d: jax.Array, held: jax.Array, col: jax.Array, *,
                block: int | None = None) -> jax.Array:
    """For each query, the last column of a held slot that acp hides: max of ``col`` over the slots where
    ``held`` and ``decay < d`` for every query head of the group (``NEG`` where none).

    Args:
      decay: [B, n, G, T, S] float32 Λ_query − Λ_slot; d: [B, n, G, T] float32 δ per query and query head;
      held: [B, nt, S] bool; col: [B or 1, 1, S] int32 (``Keys``).
      block: (default ``KEY_BLOCK``) with S > block the slots are taken ``block`` at a time in a loop (same
        values: a running maximum; the last block overlaps the one before it when block does not divide S).
        As one [T, S] reduction XLA 0.11 compiles it for the GPU as a Triton fusion whose tile spans all S
        slots, and its compile time grows faster than S: 183 s for one such reduction at T = 512, S = 16384
        (6 s at 4096), so the heuristic acp's evaluation of a 125M FoX (LLaMA) at 16k compiled for minutes
        (issue 21); in blocks of 1024 it takes 0.6 s.
    Returns:
      [B, n, T] int32.
    """
    def part(dec, hl, cl):
        hidden = jnp.all(dec < d[..., None], axis=2) & hl[:, :, None, :]
        return jnp.max(jnp.where(hidden, cl[:, :, None, :], NEG), axis=-1)

    s, block = decay.shape[-1], KEY_BLOCK if block is None else block
    if s <= block:
        return part(decay, held, col)

    def take(x, i):
        return lax.dynamic_slice_in_dim(x, jnp.minimum(i * block, s - block), block, axis=x.ndim - 1)

    def body(i, acc):
        return jnp.maximum(acc, part(take(decay, i), take(held, i), take(col, i)))

    return lax.fori_loop(1, -(-s // block), body, part(take(decay, 0), take(held, 0), take(col, 0)))


@register_rule(ACP)
class ACPRule(Rule):
    """Λ_n − Λ_j ≥ δ_n for every query n ∈ (j, i], for some query head of the key/value head.

    δ_n = min(−(2U_n + log N) + log ε, 0) per query head: U from the layer's logit bound (QK-norm: provable)
    or, without one, U_n = scale·max_{m ≤ n}‖q_m‖·max_{m ≤ n}‖k_m‖ from the running maxima kept in the cache
    (a heuristic that depends only on the tokens up to n, so any chunking gives the same visibility). Query n
    hides every key j with Λ_n − Λ_j < δ_n for all query heads of the key/value head; Λ is non-increasing, so
    those keys are a prefix and ``first_visible`` is one past the last of them. The state is ``NormMaxima``
    (heuristic) or ``ProvenThreshold`` (provable: δ from the bound, set by the prefill's chunks; the weights do
    not change while a cache is filled).
    """

    def init_state(self, policy, batch, layout):
        if policy.provable(layout):
            return ProvenThreshold(jnp.full((batch, layout["n_heads"]), -jnp.inf, jnp.float32))
        return NormMaxima(jnp.zeros((batch, layout["n_heads"]), jnp.float32),
                          jnp.zeros((batch, layout["kv_heads"]), jnp.float32))

    def state_axes(self, state):
        if isinstance(state, ProvenThreshold):
            return ProvenThreshold(("batch", "heads"))
        return None if state is None else NormMaxima(("batch", "heads"), ("batch", "kv_heads"))

    def needs_qk(self, state):
        return isinstance(state, NormMaxima)  # the heuristic's running norm maxima

    def prepare(self, policy, state, chunk):
        """δ [B, T, H] float32 for every query of the chunk, and the updated state."""
        b, t, h, _ = chunk.q.shape
        if chunk.lam is None:
            raise ValueError("cache policy 'acp' needs forget gates (log_fgate)")
        threshold = lambda u: jnp.minimum(threshold_from_bound(u, chunk.max_context, policy.log_epsilon), 0.0)  # noqa: E731
        if isinstance(state, NormMaxima):
            norm = lambda x: jnp.where(chunk.real[..., None], jnp.sqrt(jnp.sum(jnp.square(  # noqa: E731
                lax.stop_gradient(x).astype(jnp.float32)), axis=-1)), 0.0)
            qn, kn = norm(chunk.q), norm(chunk.k)                                  # [B, T, H], [B, T, Hkv]
            if t > 1:
                qn, kn = lax.cummax(qn, axis=1), lax.cummax(kn, axis=1)
            qn, kn = jnp.maximum(state.q[:, None], qn), jnp.maximum(state.k[:, None], kn)
            return threshold(chunk.scale * qn * jnp.repeat(kn, h // kn.shape[2], axis=2)), NormMaxima(qn[:, -1],
                                                                                                    kn[:, -1])
        # δ from the bound on a fresh cache, and on every chunk of several tokens that has the bound (the same δ:
        # the weights are fixed, so a prefill's chunks may all run in one scan without a fresh first chunk); a
        # decode step reads the stored δ
        if chunk.fresh or state is None or (t > 1 and chunk.facts.logit_bound is not None):
            if chunk.facts.logit_bound is None:
                raise ValueError("cache policy 'acp' needs the layer's logit bound (QK-norm) or a cache made for a "
                                 "model without QK-norm (which keeps running maxima of the q and k norms)")
            delta = threshold(jnp.broadcast_to(jnp.asarray(chunk.facts.logit_bound, jnp.float32), (b, h)))
            state = None if state is None else ProvenThreshold(delta)
        else:
            delta = state.delta
        return jnp.broadcast_to(delta[:, None], (b, t, h)), state

    def decay_floor(self, policy, delta, chunk, heads):
        if type(self).first_visible is not ACPRule.first_visible:
            return None  # a subclass with its own first_visible: the floor alone is not its rule
        b, t, h = delta.shape
        hkv = chunk.k.shape[2]
        floor = delta[:, -1].reshape(b, hkv, h // hkv)
        if heads == tuple(range(heads[0], heads[-1] + 1)):  # contiguous heads (all of them, usually): a slice
            return floor[:, heads[0]:heads[-1] + 1]
        return floor[:, jnp.asarray(heads)]

    def first_visible(self, policy, delta, chunk, keys):
        b, t, h = delta.shape
        hkv = chunk.k.shape[2]
        d = delta.reshape(b, t, hkv, h // hkv)[:, :, jnp.asarray(keys.heads)].transpose(0, 2, 3, 1)  # [B, n, G, T]
        last_old = last_hidden(keys.decay_old, d, keys.held, keys.col)                               # [B, n, T]
        earlier = jnp.arange(t)[:, None] > jnp.arange(t)[None, :]                                   # key j < query
        hidden_new = jnp.all(keys.decay_new < d[..., None], axis=2) & earlier & chunk.real[:, None, None, :]
        last_new = jnp.max(jnp.where(hidden_new, chunk.cols, NEG), axis=-1)                          # [B, n, T]
        return jnp.maximum(last_old, last_new) + 1


@register_rule(DCP)
class DCPRule(Rule):
    """Key j survives query i iff every query n ∈ (j, i] voted keep: z_{n,j} = q_int·k_int/√r + β > 0."""

    def prepare(self, policy, state, chunk):
        f = chunk.facts
        if f.q_int is None or f.k_int is None or f.beta is None:
            raise ValueError("cache policy 'dcp' needs the layer's q_int, k_int and beta (LayerFacts)")
        return None, state

    def masks(self, policy, aux, chunk, keys):
        f = chunk.facts
        z_old = keep_logits(f.q_int, keys.k_int, f.beta)                       # [B, T, S]
        vis_old = (jnp.cumsum(z_old <= 0, axis=1) == 0)[:, None, None]        # every query so far kept it
        vis_new = (cumulative_keep_log_mask(keep_logits(f.q_int, f.k_int, f.beta), jnp.inf) == 0.0)[:, None, None]
        return vis_old, vis_new


__all__ = ["Chunk", "Keys", "LayerFacts", "NEG", "NormMaxima", "ProvenThreshold", "RULES", "Rule", "last_hidden",
           "register_rule", "rule_for"]
