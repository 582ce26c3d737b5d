"""The slot-pool KV cache: one cache for every model family and every policy (docs/design/inference.md).

Per layer a ``SlotKVCache`` owns a fixed pool of S slots per row (the KV memory budget, allocated once);
a slot holds one token's k and v, or is free (``pos`` = −1). Attention never reads the slot order: keys are
stored after RoPE / QK-norm / KV-shift and GPT-2's positions are in the input, so a freed slot is simply
reused by a later token (DCP's batched cache, dcp.md §5.1, without its host-side resizing). What stays is
decided by the ``CachePolicy`` (``fox_jax.cache.policies``): a key the policy hides from the newest query is
freed; policies are monotone, so a freed key would never have been seen again and the cache's output equals
a full recomputation under the policy's mask.

Slot tables are per row for ``dense``, ``dcp``, ``window`` and ``sinks`` (every head keeps the same tokens)
and per (row, key/value head) for ``acp``, whose live sets differ per head. The heads of a layer may be split
into **groups** with their own slot count (``SlotGroup``; ``acp`` gives each head the slots its live window
needs, so memory follows the per-head live sets rather than the longest one).

A call appends a chunk of T ≥ 1 tokens (a prefill chunk, a continuation, or one decode step; the same code):

1. the chunk's queries attend over the occupied slots and the chunk's own keys, each pair through the
   policy's visibility and, for FoX, the decay Λ_i − Λ_j (``lam_hi``/``lam_lo``: Λ as an unevaluated float32
   pair, ``fox_jax.cache.decay``, so decays keep float32 relative precision at any
   length);
2. the slots the chunk's last query no longer sees are freed;
3. the chunk's surviving tokens are written into free slots, lowest first (so the highest
   occupied slot never exceeds the peak live count).

If a row has more survivors than free slots the budget was too small: the oldest surplus survivors of the
chunk are dropped (for a decode step, the oldest cached token makes room) and ``overflow`` counts them; the
engine reports it (results are then not the policy's).

The decode step costs O(S) per row and head: the budget, not the context length. Sizing S from what the
policy can hold (``CachePolicy.max_live``, or the measured live counts of ``dcp``/``acp``) is what makes a
pruned cache both smaller and faster.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from fox_jax.cache.decay import accumulate_log_fgate
from fox_jax.cache.policies import CachePolicy, parse_policy
from fox_jax.ops._common import check_seq_start, dot_precision
from fox_jax.ops.context_pruning import cumulative_keep_log_mask, keep_logits
from fox_jax.ops.forgetting_attention import forgetting_attention


@flax.struct.dataclass
class SlotGroup:
    """The slots of a group of key/value heads in one layer.

    Attributes:
      k, v: [B, n, S, D] in the compute dtype (keys ready for attention; head-major, so attention reads
        them without a transpose); meaningful where ``pos`` ≥ 0.
      pos: [B, nt, S] int32 token position held by each slot (−1: free); nt = 1 (per-row tables: every head
        of the group holds the same tokens) or n (per-head tables, ``acp``).
      lam_hi, lam_lo: [B, n, G, S] float32, Λ_j = hi + lo of the token in each slot for each of the G query
        heads of every key/value head (nats, ≤ 0), or None without forget gates.
      k_int: [B, S, r] float32 DCP interaction keys (per-row tables only), or None.
      live: [B, nt] int32 occupied slots per row and table (kept with the tables, so counting costs nothing).
      peak: [nt] int32, the most slots any row has held in each table so far (sizes a pool:
        ``fox_jax.decoding.calibrate_slots``).
      heads: the key/value heads of the layer this group holds (static).
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    lam_hi: jax.Array | None
    lam_lo: jax.Array | None
    k_int: jax.Array | None
    live: jax.Array
    peak: jax.Array
    heads: tuple = flax.struct.field(pytree_node=False)

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    def held(self) -> jax.Array:
        """[B] float32 live (slot, key/value head) entries per row."""
        return jnp.sum(self.live, axis=1, dtype=jnp.float32) * (self.k.shape[1] // self.pos.shape[1])

    def logical_axes(self) -> "SlotGroup":
        """This group's structure with a tuple of logical axis names per array (``fox_jax.sharding``): batch
        over ``batch``, key/value heads over ``kv_heads`` (per-head slot tables too), the rest replicated."""
        table = ("batch", "kv_heads" if self.pos.shape[1] > 1 else None, None)
        lam = None if self.lam_hi is None else ("batch", "kv_heads", None, None)
        return self.replace(k=("batch", "kv_heads", None, None), v=("batch", "kv_heads", None, None), pos=table,
                            lam_hi=lam, lam_lo=lam, k_int=None if self.k_int is None else ("batch", None, None),
                            live=table[:2], peak=(None,))

    @property
    def entry_bytes(self) -> int:
        """Bytes of one (slot, key/value head) entry: k, v and the Λ pairs of its query heads (k_int
        counted per head share)."""
        n, d = self.k.shape[1], self.k.shape[3]
        gates = 0 if self.lam_hi is None else self.lam_hi.shape[2] * 8
        interaction = 0 if self.k_int is None else self.k_int.shape[2] * 4 / n
        return 2 * d * self.k.dtype.itemsize + gates + interaction


@flax.struct.dataclass
class SlotKVCache:
    """Decoding state of one attention layer (module docstring).

    Attributes:
      groups: the layer's ``SlotGroup``s (their ``heads`` partition the key/value heads).
      length: int32 scalar, tokens fed so far including left pads (the next token's column).
      seq_start: [B] int32 left pads per row; the token in column c has position c − seq_start.
      lam_hi, lam_lo: [B, H] float32 Λ of the last token fed (the pair carried into the next chunk), or None.
      k_shift, v_shift: [B, Hkv, D] the unshifted k/v projections of the last token (KV-shift), or None.
      overflow: [B] int32 entries dropped because the pool had no free slot (tokens; for per-head tables, tokens × heads).
      policy: the ``CachePolicy`` (static).
      max_context: N, the longest context this cache serves (static; ``acp``'s threshold uses it).
      fresh: nothing has been fed yet (static): a first chunk under ``dense`` or ``window`` then runs the
        flash attention op over itself (``fox_jax.ops.forgetting_attention``) instead of the masked pool path.
    """

    groups: tuple
    length: jax.Array
    seq_start: jax.Array
    lam_hi: jax.Array | None
    lam_lo: jax.Array | None
    k_shift: jax.Array | None
    v_shift: jax.Array | None
    overflow: jax.Array
    policy: CachePolicy = flax.struct.field(pytree_node=False)
    max_context: int = flax.struct.field(pytree_node=False)
    fresh: bool = flax.struct.field(pytree_node=False, default=True)

    @property
    def kv_heads(self) -> int:
        return sum(g.k.shape[1] for g in self.groups)

    @property
    def capacity(self) -> int:
        """The largest slot count of a group (the most tokens one head can hold)."""
        return max(g.slots for g in self.groups)

    def logical_axes(self) -> "SlotKVCache":
        """This cache's structure with a tuple of logical axis names per array, e.g. k/v [B, n, S, D] →
        ("batch", "kv_heads", None, None); ``fox_jax.sharding.cache_shardings`` maps them onto a mesh."""
        lam = None if self.lam_hi is None else ("batch", "heads")
        shift = None if self.k_shift is None else ("batch", "kv_heads", None)
        return self.replace(groups=tuple(g.logical_axes() for g in self.groups), length=(), seq_start=("batch",),
                            lam_hi=lam, lam_lo=lam, k_shift=shift, v_shift=shift, overflow=("batch",))

    def live_count(self) -> jax.Array:
        """[B] float32 live tokens per row, averaged over the key/value heads."""
        return sum(g.held() for g in self.groups) / self.kv_heads

    def live_bytes(self) -> jax.Array:
        """[B] float32 bytes of the live entries per row."""
        return sum(g.held() * g.entry_bytes for g in self.groups)

    def allocated_bytes(self) -> int:
        """Bytes the pool holds for all rows (k, v, Λ, k_int; the slot tables excluded)."""
        return int(sum(math.prod(g.k.shape[:3]) * g.entry_bytes for g in self.groups))


def _split_slots(slots, kv_heads: int, per_head: bool) -> list[tuple[int, tuple[int, ...]]]:
    """[(slot count, kv heads)] groups from ``slots``: an int (one group) or, for per-head tables, a
    sequence of Hkv ints (heads with equal counts share a group)."""
    if isinstance(slots, int):
        return [(slots, tuple(range(kv_heads)))]
    counts = tuple(slots)
    if not per_head or len(counts) != kv_heads:
        raise ValueError(f"slots must be an int{' or ' + str(kv_heads) + ' ints (one per key/value head)' if per_head else ''}"
                         f", got {slots!r}")
    groups: dict[int, list[int]] = {}
    for h, c in enumerate(counts):
        groups.setdefault(int(c), []).append(h)
    return [(c, tuple(hs)) for c, hs in sorted(groups.items())]


def new_slot_cache(batch: int, slots, *, n_heads: int, kv_heads: int, head_dim: int, dtype, forget_gate: bool,
                   kv_shift: bool, interaction_dim: int | None = None, policy: Any = "dense",
                   max_context: int | None = None, seq_start=None) -> SlotKVCache:
    """An empty ``SlotKVCache`` for one layer.

    Args:
      batch: B.
      slots: S ≥ 1 slots per row (an int), or for ``acp`` one count per key/value head (a sequence of
        Hkv ints; heads with equal counts share a group).
      n_heads, kv_heads, head_dim: H, Hkv, D.
      dtype: compute dtype of k/v.
      forget_gate: store Λ (FoX); required by ``acp``.
      kv_shift: store the KV-shift carry (Pro).
      interaction_dim: r of a DCP model (stores k_int); required by ``dcp``.
      policy: a ``CachePolicy`` or its string form.
      max_context: N, the most keys a query can see (``acp``'s threshold); default the largest slot count.
      seq_start: optional [B] int left pads per row.

    Raises:
      ValueError: bad slots, a policy the model cannot run (``dcp`` without interaction keys, ``acp``
        without forget gates), a bad seq_start.
    """
    policy = parse_policy(policy)
    if policy.kind == "dcp" and interaction_dim is None:
        raise ValueError("cache policy 'dcp' needs a model trained or fine-tuned with DCP (cfg.dcp=True)")
    if policy.kind == "acp" and not forget_gate:
        raise ValueError("cache policy 'acp' evicts by forget-gate decay and needs a FoX model (a forget gate)")
    groups = []
    g = n_heads // kv_heads
    for count, heads in _split_slots(slots, kv_heads, policy.per_head):
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"slots must be positive ints, got {slots!r}")
        n = len(heads)
        kv = lambda: jnp.zeros((batch, n, count, head_dim), dtype)   # distinct buffers: callers may donate them
        lam = (lambda: jnp.zeros((batch, n, g, count), jnp.float32)) if forget_gate else (lambda: None)
        k_int = None if interaction_dim is None or policy.kind != "dcp" else jnp.zeros((batch, count, interaction_dim),
                                                                                         jnp.float32)
        pos = jnp.full((batch, n if policy.per_head else 1, count), -1, jnp.int32)
        groups.append(SlotGroup(kv(), kv(), pos, lam(), lam(), k_int, jnp.zeros(pos.shape[:2], jnp.int32),
                                jnp.zeros((pos.shape[1],), jnp.int32), heads))
    state = (lambda: jnp.zeros((batch, kv_heads, head_dim), dtype)) if kv_shift else (lambda: None)
    last = (lambda: jnp.zeros((batch, n_heads), jnp.float32)) if forget_gate else (lambda: None)
    capacity = max(c.slots for c in groups)
    return SlotKVCache(tuple(groups), jnp.zeros((), jnp.int32), check_seq_start(seq_start, batch), last(), last(),
                       state(), state(), jnp.zeros((batch,), jnp.int32), policy,
                       capacity if max_context is None else int(max_context))


def cache_columns(cache: SlotKVCache, t: int) -> jax.Array:
    """Columns [T] int32 a chunk of T tokens occupies: ``length`` .. ``length`` + T − 1 (positions are
    ``columns[None] − cache.seq_start[:, None]``, negative on left pads)."""
    return cache.length + jnp.arange(t, dtype=jnp.int32)


def _positional(policy: CachePolicy, p_query, p_key):
    """The policy's visibility from token positions alone (True where it does not depend on them)."""
    if policy.kind == "window":
        return p_query - p_key < policy.window
    if policy.kind == "sinks":
        return (p_key < policy.sinks) | (p_query - p_key < policy.window)
    return jnp.ones((), bool)


def _group_chunk(group: SlotGroup, policy: CachePolicy, q, k, v, p, real, lam, delta, z_old, z_new, k_int, scale,
                 attend: bool = True):
    """One group's attention for a chunk and its updated slots (module docstring, steps 1–3).

    q [B, T, n, G, D]; k, v [B, T, n, D]; p, real [B, T]; lam: (hi, lo) [B, T, n, G] or None; delta
    [B, n, G] or None; z_old [B, T, S], z_new [B, T, T], k_int [B, T, r] (DCP) or None. Scores and masks
    are [B, n, G, T, keys] (masks broadcast over n when the tables are per row and over G). ``attend=False``
    only updates the slots (the caller computed the attention) and returns None for it."""
    b, t, n, gq, d = q.shape
    s = group.slots
    per_head = group.pos.shape[1] > 1
    pos = group.pos                                                          # [B, nt, S]
    pj_old = pos[:, :, None, None, :]                                        # [B, nt, 1, 1, S]
    pj_new = p[:, None, None, None, :]                                       # [B, 1, 1, 1, T]
    # queries: every chunk token, or (attend=False: a positional policy) only the last, whose view is kept
    pq = p if attend else p[:, -1:]
    pi = pq[:, None, None, :, None]                                          # [B, 1, 1, Tq, 1]
    vis_old = (pj_old >= 0) & _positional(policy, pi, pj_old)
    causal = (jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]) if attend else jnp.ones((1, t), bool)
    vis_new = causal & real[:, None, None, None, :] & _positional(policy, pi, pj_new)
    if policy.kind == "dcp":
        vis_old = vis_old & (jnp.cumsum(z_old <= 0, axis=1) == 0)[:, None, None]
        vis_new = vis_new & (cumulative_keep_log_mask(z_new, jnp.inf) == 0.0)[:, None, None]
    bias_old = bias_new = None
    if lam is not None and attend:
        hi, lo = (x.transpose(0, 2, 3, 1) for x in lam)                     # [B, n, G, T]
        bias_old = (hi[..., None] - group.lam_hi[:, :, :, None]) + (lo[..., None] - group.lam_lo[:, :, :, None])
        bias_new = (hi[..., None] - hi[..., None, :]) + (lo[..., None] - lo[..., None, :])
        if policy.kind == "acp":
            vis_old = vis_old & (bias_old >= delta[..., None, None])
            vis_new = vis_new & (bias_new >= delta[..., None, None])

    # retention: the slots hold what the chunk's last query sees (a key/value head keeps a token while any
    # of its query heads does)
    def tables(x, keys):  # [B, n', G', keys] -> [B, nt, keys]
        x = jnp.any(jnp.broadcast_to(x, x.shape[:3] + (keys,)), axis=2)
        return jnp.broadcast_to(x, (b, n, keys)) if per_head else jnp.any(x, axis=1, keepdims=True)
    keep_old = tables(vis_old[:, :, :, -1], s)                               # [B, nt, S]
    keep_new = tables(vis_new[:, :, :, -1], t)                               # [B, nt, T]
    free = ~keep_old
    if t == 1:
        # one reduction picks the slot: the lowest free one, or, when none is free, the oldest cached token
        # (an overflow: it makes room); it also counts what the row holds
        big = jnp.int32(2 ** 30)
        key = jnp.where(free, big - jnp.arange(s), -pos)                     # kept slots hold positions ≥ 0
        slot0 = jnp.argmax(key, axis=2)[..., None]                            # [B, nt, 1]
        full = keep_new & ~jnp.take_along_axis(free, slot0, axis=2)
        placed = keep_new
        slot = jnp.where(placed, slot0, s)
        dropped = jnp.sum(full, axis=(1, 2), dtype=jnp.int32)
        held = jnp.sum(keep_old, axis=2, dtype=jnp.int32) + jnp.sum(placed & ~full, axis=2, dtype=jnp.int32)
    else:  # the k-th survivor to the k-th free slot, lowest first; the oldest surplus survivors are dropped
        n_free = jnp.sum(free, axis=2, keepdims=True)
        rank = jnp.cumsum(keep_new, axis=2) - 1                               # [B, nt, T] token order
        surplus = jnp.maximum(jnp.sum(keep_new, axis=2, keepdims=True) - n_free, 0)
        placed = keep_new & (rank >= surplus)                                 # the newest survivors fit
        dropped = jnp.sum(surplus, axis=(1, 2), dtype=jnp.int32)
        order = jnp.argsort(~free, axis=2, stable=True)
        slot = jnp.where(placed, jnp.take_along_axis(order, jnp.clip(rank - surplus, 0, s - 1), axis=2), s)
        held = jnp.sum(keep_old, axis=2, dtype=jnp.int32) + jnp.sum(placed, axis=2, dtype=jnp.int32)
    rows = jnp.arange(b)[:, None, None]
    heads = jnp.arange(n)[None, :, None]
    slot_n = jnp.broadcast_to(slot, (b, n, t))
    kt, vt = (x.transpose(0, 2, 1, 3).astype(group.k.dtype) for x in (k, v))  # [B, n, T, D]
    put = lambda buf, new: buf.at[rows, heads, slot_n].set(new.astype(buf.dtype), mode="drop")   # [B, n, T, ...]
    put_lam = lambda buf, new: buf.at[rows, heads, :, slot_n].set(new.transpose(0, 2, 1, 3), mode="drop")
    pos = jnp.where(keep_old, pos, -1).at[rows, jnp.arange(slot.shape[1])[None, :, None], slot].set(
        jnp.broadcast_to(p[:, None], slot.shape), mode="drop")
    new = group.replace(
        k=put(group.k, kt), v=put(group.v, vt), pos=pos,
        live=held, peak=jnp.maximum(group.peak, jnp.max(held, axis=0)),
        lam_hi=None if lam is None else put_lam(group.lam_hi, lam[0]),
        lam_lo=None if lam is None else put_lam(group.lam_lo, lam[1]),
        k_int=None if group.k_int is None else group.k_int.at[rows[:, :, 0], slot[:, 0]].set(
            k_int.astype(jnp.float32), mode="drop"))

    if not attend:
        return None, new, dropped
    qt = q.transpose(0, 2, 3, 1, 4)                                          # [B, n, G, T, D]
    prec = dot_precision(q.dtype)
    dot = lambda keys: jnp.einsum("bngtd,bnsd->bngts", qt, keys.astype(q.dtype), preferred_element_type=jnp.float32,
                                  precision=prec) * scale
    mix = lambda w, vals: jnp.einsum("bngts,bnsd->bngtd", w.astype(vals.dtype), vals,
                                     preferred_element_type=jnp.float32, precision=prec)
    if t == 1:
        # a decode step reads the pool after the write (no copy of the pool): the token's own slot was free
        # or invisible to it, so it replaces nothing this query sees (but an overflow eviction)
        is_self = (jnp.arange(s) == slot)[:, :, None, None, :]                 # [B, nt, 1, 1, S]
        scores = dot(new.k)
        if lam is not None:
            scores = scores + jnp.where(is_self, 0.0, bias_old)
        scores = jnp.where(jnp.where(is_self, real[:, None, None, None, :], vis_old), scores, -jnp.inf)
        m = jnp.max(scores, axis=-1, keepdims=True)
        w = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
        l = jnp.sum(w, axis=-1, keepdims=True)
        o = mix(w / jnp.where(l > 0, l, 1.0), new.v)
    else:
        # a chunk reads the pool as it was and its own keys: softmax over the two parts (no concatenation)
        s_old, s_new = dot(group.k), dot(kt)
        if lam is not None:
            s_old, s_new = s_old + bias_old, s_new + bias_new
        s_old, s_new = jnp.where(vis_old, s_old, -jnp.inf), jnp.where(vis_new, s_new, -jnp.inf)
        m = jnp.maximum(jnp.max(s_old, axis=-1, keepdims=True), jnp.max(s_new, axis=-1, keepdims=True))
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        w_old, w_new = jnp.exp(s_old - m), jnp.exp(s_new - m)
        l = jnp.sum(w_old, axis=-1, keepdims=True) + jnp.sum(w_new, axis=-1, keepdims=True)
        l = jnp.where(l > 0, l, 1.0)
        o = mix(w_old / l, group.v) + mix(w_new / l, vt)
    o = o.transpose(0, 3, 1, 2, 4)                                           # [B, T, n, G, D]
    return o.reshape(b, t, n * gq, d), new, dropped


def slot_attention(cache: SlotKVCache, q: jax.Array, k: jax.Array, v: jax.Array, log_fgate: jax.Array | None, *,
                   k_shift: jax.Array | None = None, v_shift: jax.Array | None = None, threshold=None,
                   q_int: jax.Array | None = None, k_int: jax.Array | None = None, beta=None,
                   sm_scale: float | None = None) -> tuple[jax.Array, SlotKVCache]:
    """Append a chunk of T ≥ 1 tokens to the cache and attend with it under the cache's policy.

    o_i = Σ_j softmax_j(scale·q_i·k_j + Λ_i − Λ_j) v_j over the keys j ≤ i the policy lets query i see
    (FoX Eq. 4–6; Λ ≡ 0 without forget gates), j ranging over the live slots and the chunk.

    Args:
      cache: the layer's ``SlotKVCache``.
      q: [B, T, H, D]; k, v: [B, T, Hkv, D], ready for attention (shifted, normed, rotated at the positions
        ``cache.length + arange(T) − seq_start``).
      log_fgate: [B, T, H] float32 log forget gates, or None (must match the cache); pads are ignored.
      k_shift, v_shift: the new KV-shift carry [B, Hkv, D] (stored as given), or None.
      threshold: ``acp``: the ACP threshold δ [B, H] or [H] float32 for N = ``cache.max_context``.
      q_int, k_int: [B, T, r] float32 DCP interaction queries/keys; beta: the layer's β (``dcp`` only).
      sm_scale: logit scale, default 1/√D.

    Returns:
      (o [B, T, H, D] in q's dtype, the updated cache).

    Raises:
      ValueError: gates that do not match the cache, ``acp`` without a threshold, ``dcp`` without q_int/k_int.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    policy = cache.policy
    if (log_fgate is None) != (cache.lam_hi is None):
        raise ValueError("log_fgate must be given exactly when the cache stores forget gates")
    if policy.kind == "acp" and threshold is None:
        raise ValueError("cache policy 'acp' needs the ACP threshold (threshold=[B, H] δ)")
    if policy.kind == "dcp" and (q_int is None or k_int is None or beta is None):
        raise ValueError("cache policy 'dcp' needs q_int, k_int and beta")
    scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    p = cache.length + jnp.arange(t, dtype=jnp.int32)[None, :] - cache.seq_start[:, None]   # [B, T]
    real = p >= 0
    lam = lam_last = None
    if log_fgate is not None:
        hi, lo = accumulate_log_fgate(cache.lam_hi, cache.lam_lo, jnp.where(real[..., None], log_fgate, 0.0))
        lam_last = (hi[:, -1], lo[:, -1])
        lam = (hi.reshape(b, t, hkv, g), lo.reshape(b, t, hkv, g))
    delta = None
    if threshold is not None and policy.kind == "acp":
        delta = jnp.minimum(jnp.broadcast_to(jnp.asarray(threshold, jnp.float32), (b, h)), 0.0).reshape(b, hkv, g)
    qg = q.reshape(b, t, hkv, g, d)
    # a first chunk of a fresh cache under a policy the flash op expresses: the op over the chunk itself
    flash = cache.fresh and t > 1 and policy.kind in ("dense", "window") and len(cache.groups) == 1
    if flash:
        o_flash = forgetting_attention(q, k.astype(q.dtype), v.astype(q.dtype), log_fgate, seq_start=cache.seq_start,
                                       window_size=policy.window if policy.kind == "window" else None,
                                       sm_scale=scale)
    outs, groups, dropped = [], [], jnp.zeros((b,), jnp.int32)
    z_new = None if policy.kind != "dcp" else keep_logits(q_int, k_int, beta)
    for group in cache.groups:
        idx = jnp.asarray(group.heads)
        whole = group.heads == tuple(range(hkv))
        pick = (lambda x: x) if whole else (lambda x: jnp.take(x, idx, axis=2))
        z_old = None if policy.kind != "dcp" else keep_logits(q_int, group.k_int, beta)
        o, new, n_dropped = _group_chunk(
            group, policy, pick(qg), pick(k), pick(v), p, real,
            None if lam is None else (pick(lam[0]), pick(lam[1])),
            None if delta is None else jnp.take(delta, idx, axis=1), z_old, z_new, k_int, scale, attend=not flash)
        outs.append((idx, o))
        groups.append(new)
        dropped = dropped + n_dropped
    if flash:
        o = o_flash
    elif len(outs) == 1 and cache.groups[0].heads == tuple(range(hkv)):
        o = outs[0][1]
    else:
        o = jnp.zeros((b, t, hkv, g, d), jnp.float32)
        for idx, og in outs:
            o = o.at[:, :, idx].set(og.reshape(b, t, len(idx), g, d))
        o = o.reshape(b, t, h, d)
    new_cache = cache.replace(
        groups=tuple(groups), length=cache.length + t, overflow=cache.overflow + dropped,
        lam_hi=None if lam_last is None else lam_last[0], lam_lo=None if lam_last is None else lam_last[1],
        k_shift=k_shift if cache.k_shift is not None else None, v_shift=v_shift if cache.v_shift is not None else None,
        fresh=False)
    return o.astype(q.dtype), new_cache


__all__ = ["SlotGroup", "SlotKVCache", "cache_columns", "new_slot_cache", "slot_attention"]
