"""KV storage per layer: rings indexed by column and a slot pool; one cache for every family and policy.

Per layer a ``SlotKVCache`` holds the key/value heads in one or more **groups** of equal capacity C (entries
per row and head, allocated once: the KV budget, a multiple of ``RING_BLOCK``). A "slot" is one token entry
(vLLM's sense), not a request row. Keys are stored after RoPE / QK-norm / KV-shift and GPT-2's positions are in
the input, so attention never reads the slot order. Which storage a policy gets is its ``storage``
(``fox_jax.cache.policies``):

* ``RingGroup`` (dense, window, sinks, acp): the key of column c lives in slot c mod C (the shared column
  counter ``length`` aligns left-padded rows), and what is live is a suffix [start, length) per row, or per
  (row, key/value head) for ``acp``: one int per table is the whole eviction state. A decode step writes every
  row at slot ``length mod C`` (no allocation search) and reads [start, length] in one call,
  ``fox_jax.ops.decode_attention_append`` (the Pallas kernel writes the entry in place while it reads; elsewhere a
  ``dynamic_update_slice`` then the read). ``sinks:S+W`` puts positions < S in pinned slots in front of the
  ring (P = S rounded up to a power of two ≥ 16, ``CachePolicy.pin_slots``; the ring is the other C − P slots),
  which the same op reads with the ring. A suffix longer than the ring overwrites its oldest entries: ``overflow``
  counts them.
* ``PoolGroup`` (dcp): any key may be dropped, so a slot table of positions (−1: free); a chunk's survivors go
  to the lowest free slots (the highest occupied slot stays near the peak live count) and ``hi`` (1 + the
  highest occupied slot) bounds each row's read.

A call appends a chunk of T ≥ 1 tokens (a prefill chunk, a continuation, or one decode step), in three named
steps per group: **visibility** (the policy's rule, ``fox_jax.cache.visibility``), **placement** (which
entries the rule frees and where the chunk's survivors go; what did not fit is counted in ``overflow``, and
the results are then not the policy's) and **attention** (a decode step writes first and reads through the
decode op; a chunk of T > 1 reads the cache as it was and itself, a two-part softmax, or on a fresh cache the
flash op when the policy has a ``flash_prefill`` form). Every policy is monotone, so the output equals a full
recomputation under the policy's mask. For FoX the decay Λ_i − Λ_j comes from Λ stored per entry as a float32
pair (``fox_jax.cache.decay``).

Nothing here assumes that the rows started together beyond the shared column counter: a row's state is its
``seq_start``, its ring ``start`` (or pool table), its Λ / KV-shift carry and its running norms, so a row can
be refilled while the others decode (continuous batching): ``SlotKVCache.insert_row`` puts a request prefilled
alone in a one-row cache into a row of the batch (``fox_jax.decoding.batching``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from fox_jax.cache.decay import accumulate_log_fgate
from fox_jax.cache.policies import RING_BLOCK, CachePolicy, parse_policy
from fox_jax.cache.visibility import Chunk, Keys, LayerFacts, Rule, rule_for
from fox_jax.ops._common import check_seq_start, dot_precision
from fox_jax.ops.decode_attention import DecodeStep, PinnedSlots, decode_attention, decode_attention_append
from fox_jax.ops.head_ops import HeadOps, head_epilogue, head_prologue
from fox_jax.ops.forgetting_attention import forgetting_attention

KV_AXES = ("batch", "kv_heads", None, None)  # k, v [B, n, C, D] and Λ [B, n, G, C]


class _Entries:
    """What both storages share: fields k, v [B, n, C, D], lam_hi/lam_lo [B, n, G, C] or None, peak, heads."""

    @property
    def slots(self) -> int:
        """C, the entries per row and key/value head."""
        return self.k.shape[2]

    @property
    def entry_bytes(self) -> float:
        """Bytes of one (entry, key/value head): k, v and the Λ pairs of its query heads (DCP's k_int counted
        per head share)."""
        n, d = self.k.shape[1], self.k.shape[3]
        gates = 0 if self.lam_hi is None else self.lam_hi.shape[2] * 8
        k_int = getattr(self, "k_int", None)
        return 2 * d * self.k.dtype.itemsize + gates + (0 if k_int is None else k_int.shape[2] * 4 / n)

    def held(self, cache) -> jax.Array:
        """[B] float32 live (entry, key/value head) pairs per row."""
        live = self.live(cache.length, cache.seq_start)
        return jnp.sum(live, axis=1, dtype=jnp.float32) * (self.k.shape[1] // live.shape[1])


def _decay(lam_q, lam_k) -> jax.Array:
    """Λ_query − Λ_key from float32 pairs: lam_q (hi, lo) [B, n, G, T], lam_k [B, n, G, S] -> [B, n, G, T, S]."""
    return (lam_q[0][..., None] - lam_k[0][..., None, :]) + (lam_q[1][..., None] - lam_k[1][..., None, :])


@flax.struct.dataclass
class RingGroup(_Entries):
    """Ring buffers of a group of key/value heads (module docstring).

    Attributes:
      k, v: [B, n, C, D] compute dtype; the key of column c in slot P + (c mod (C − P)) (P = ``pin_slots``), a
        pinned position p < ``pinned`` also in slot p.
      lam_hi, lam_lo: [B, n, G, C] float32 Λ = hi + lo of the entry in each slot for each query head, or None.
      start: [B, nt] int32, the first live column per row (nt = 1) or per (row, key/value head) (nt = n,
        ``acp``): the ring holds [start, length); ≥ seq_start + pinned.
      peak: [B, nt] int32, the most entries each row has held per table so far (``calibrate_slots`` takes the
        maximum over rows).
      overflow: [B, nt] int32, the entries each table could not hold although the policy kept them (tokens).
      ``start``, ``peak`` and ``overflow`` are updated together elementwise (a decode step spends no reduction on
      its bookkeeping; ``SlotKVCache.overflow`` sums on reading).
      heads: the layer's key/value heads of this group (static); pinned: S of ``sinks:S+W`` (static); pin_slots:
        P ≥ S, the slots in front of the ring that hold them (static; ``CachePolicy.pin_slots``).
    """

    k: jax.Array
    v: jax.Array
    lam_hi: jax.Array | None
    lam_lo: jax.Array | None
    start: jax.Array
    peak: jax.Array
    overflow: jax.Array
    heads: tuple = flax.struct.field(pytree_node=False)
    pinned: int = flax.struct.field(pytree_node=False, default=0)
    pin_slots: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def ring(self) -> int:
        """The ring's capacity: C − ``pin_slots``."""
        return self.slots - self.pin_slots

    @classmethod
    def empty(cls, batch: int, capacity: int, heads: tuple, *, head_dim: int, g: int, dtype, forget_gate: bool,
              policy: CachePolicy, seq_start: jax.Array, **_) -> RingGroup:
        n = len(heads)
        nt = n if policy.per_head else 1
        lam = (lambda: jnp.zeros((batch, n, g, capacity), jnp.float32)) if forget_gate else (lambda: None)
        start = jnp.broadcast_to((seq_start + policy.pinned)[:, None], (batch, nt)).astype(jnp.int32)
        return cls(jnp.zeros((batch, n, capacity, head_dim), dtype), jnp.zeros((batch, n, capacity, head_dim), dtype),
                   lam(), lam(), start, jnp.zeros((batch, nt), jnp.int32), jnp.zeros((batch, nt), jnp.int32), heads,
                   policy.pinned, policy.pin_slots)

    def columns(self, length, seq_start) -> jax.Array:
        """[B or 1, 1, C] int32: the column each slot holds (the latest written one; meaningful where held);
        the same for every row unless there are pinned slots."""
        p, n = self.pin_slots, self.ring
        ring = length - 1 - jnp.mod(length - 1 - jnp.arange(n, dtype=jnp.int32), n)
        if not p:
            return ring[None, None]
        pinned = seq_start[:, None] + jnp.arange(p, dtype=jnp.int32)
        return jnp.concatenate([pinned, jnp.broadcast_to(ring, (pinned.shape[0], n))], axis=1)[:, None]

    def held_mask(self, length, seq_start) -> jax.Array:
        """[B, nt, C] bool: the slots that hold a live key."""
        col = self.columns(length, seq_start)
        live = col >= self.start[..., None]
        if not self.pin_slots:
            return live
        slot = jnp.arange(self.slots)[None, None]
        return jnp.where(slot < self.pin_slots, (slot < self.pinned) & (col < length), live)

    def live(self, length, seq_start) -> jax.Array:
        """[B, nt] int32 live entries per table."""
        pinned = jnp.clip(length - seq_start, 0, self.pinned)[:, None]
        return jnp.maximum(length - self.start, 0) + pinned

    def held_positions(self, cache) -> jax.Array:
        """[B, nt, C] int32 position of the key each slot holds, −1 where it holds none."""
        col = self.columns(cache.length, cache.seq_start)
        return jnp.where(self.held_mask(cache.length, cache.seq_start), col - cache.seq_start[:, None, None], -1)

    def logical_axes(self) -> RingGroup:
        axes = lambda x: None if x is None else KV_AXES  # noqa: E731
        tables = ("batch", "kv_heads" if self.start.shape[1] > 1 else None)
        return self.replace(k=KV_AXES, v=KV_AXES, lam_hi=axes(self.lam_hi), lam_lo=axes(self.lam_lo), start=tables,
                            peak=tables, overflow=tables)

    def shift_columns(self, shift) -> RingGroup:
        """The group with every key moved from column c to column c + ``shift`` (int32 scalar ≥ 0, may be traced):
        the ring's slots rolled by shift mod (C − P) (column c lives in slot P + c mod (C − P), P = ``pin_slots``),
        ``start`` advanced by ``shift``; the pinned slots hold positions and stay."""
        p = self.pin_slots
        s = jnp.mod(shift, self.ring)

        def roll(x, axis):
            if x is None:
                return None
            if not p:
                return jnp.roll(x, s, axis=axis)
            head, tail = jnp.split(x, [p], axis=axis)
            return jnp.concatenate([head, jnp.roll(tail, s, axis=axis)], axis=axis)

        return self.replace(k=roll(self.k, 2), v=roll(self.v, 2), lam_hi=roll(self.lam_hi, 3),
                            lam_lo=roll(self.lam_lo, 3), start=self.start + shift)

    def append(self, step: _Step, q, k, v, lam):
        """Visibility, placement and attention of a chunk for this group. q [B, T, n, G, D]; k, v [B, T, n, D];
        lam: (hi, lo) [B, T, n, G] or None. Returns (o [B, T, n, G, D] float32 or None, the updated group)."""
        lam_q = None if lam is None else tuple(x.transpose(0, 2, 3, 1) for x in lam)              # [B, n, G, T]
        if q.shape[1] == 1 and step.attend:  # a decode step: the write and the read in one op
            return self.decode_step(step, q, k, v, lam_q)[:2]
        keys = self._keys(step.cache, lam_q)
        start_t = self._visible_from(step, keys)
        new = self._place(step, k, v, lam_q, start_t)
        if not step.attend:
            return None, new
        return self._attend(step, keys, start_t, q, k, v), new

    def decode_step(self, step: _Step, q, k, v, lam_q, raw: DecodeStep | None = None) -> tuple:
        """A decode step of a ring (and its pinned slots): the write, the read and the ring's tables in one op
        (``decode_attention_append``; its Pallas kernel does all three). q [B, 1, n, G, D]; k, v [B, 1, n, D]; lam_q
        (hi, lo) [B, n, G, 1] or None. With ``raw`` (a ``DecodeStep``; this group may hold some of the layer's kv heads,
        ``raw.heads``, while its carries are the layer's) q, k, v are the raw projections and the op does the layer's
        per-head work and Λ. Returns (o [B, 1, n, G, D]
        float32, the updated group, the op's (shift state, Λ) with ``raw`` or None)."""
        floor = None if self.lam_hi is None or self.start.shape[1] != len(self.heads) else \
            step.rule.decay_floor(step.cache.policy, step.aux, step.chunk, self.heads)  # per-head tables only
        if floor is not None:  # the op applies the rule while it reads (acp), from the ring's start
            lo = jnp.int32(0)
        else:  # the rule's first visible column; the op takes the maximum with the ring's start
            if raw is not None and raw.log_fgate is not None:  # the rule's own decays (XLA drops them where unread)
                lam_q = tuple(x[..., None] for x in raw.step_lam(step.cache.length + 1, q.shape[3]))
            first = step.rule.first_visible(step.cache.policy, step.aux, step.chunk,
                                            self._keys(step.cache, lam_q))[..., -1]             # [B or 1, nt or 1]
            lo = first.reshape(()) if first.size == 1 else jnp.broadcast_to(first, (q.shape[0], first.shape[1]))
        return self._write_read(step, q, k, v, lam_q, lo, floor, raw)

    def _keys(self, cache, lam_q) -> Keys:
        """What the slots hold before the chunk, and the chunk's decays, as the rule sees them."""
        length, seq = cache.length, cache.seq_start
        decay = lambda lam_k: None if lam_q is None else _decay(lam_q, lam_k)  # noqa: E731
        return Keys(self.heads, self.columns(length, seq), self.held_mask(length, seq),
                    decay((self.lam_hi, self.lam_lo)), decay(lam_q), None)

    def _visible_from(self, step: _Step, keys: Keys) -> jax.Array:
        """Visibility: [B, nt, T] the first column each query sees; a key once hidden stays hidden (a running
        maximum over the queries, from the ring's ``start``)."""
        first = step.rule.first_visible(step.cache.policy, step.aux, step.chunk, keys)
        start_t = jnp.maximum(first, self.start[..., None])
        return lax.cummax(start_t, axis=2) if start_t.shape[2] > 1 else start_t

    def _place(self, step: _Step, k, v, lam_q, start_t) -> RingGroup:
        """Placement: the ring keeps its last C − P columns (P = ``pin_slots``; what the rule kept beyond them
        overflowed, counted); the chunk is written at slot P + (column mod (C − P)), a decode step with one
        ``dynamic_update_slice`` for every row, sink positions also to their pinned slots."""
        cache, chunk = step.cache, step.chunk
        b, t, n, _ = k.shape
        length, c, p, sinks = cache.length, self.slots, self.pin_slots, self.pinned
        ring = self.ring
        kt, vt = (x.transpose(0, 2, 1, 3) for x in (k, v))                                       # [B, n, T, D]
        pos = chunk.pos
        if t == 1 and not p:
            slot = p + jnp.mod(length, ring)
            put = lambda buf, x, axis: lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), slot, axis=axis)  # noqa: E731
            new = self.replace(k=put(self.k, kt, 2), v=put(self.v, vt, 2))
            if lam_q is not None:
                new = new.replace(lam_hi=put(self.lam_hi, lam_q[0], 3), lam_lo=put(self.lam_lo, lam_q[1], 3))
        elif t == 1:  # the ring slot and, for a sink position, its pinned slot: one scatter per buffer
            rows = jnp.arange(b)[:, None]
            pin = jnp.where((pos[:, 0] >= 0) & (pos[:, 0] < sinks), pos[:, 0], c)                 # c: dropped
            slots = jnp.stack([jnp.broadcast_to(p + jnp.mod(length, ring), (b,)), pin], axis=1)   # [B, 2]
            put_kv = lambda buf, x: buf.at[rows, :, slots].set(x[:, None, :, 0].astype(buf.dtype), mode="drop")  # noqa: E731
            new = self.replace(k=put_kv(self.k, kt), v=put_kv(self.v, vt))
            if lam_q is not None:
                put_lam = lambda buf, x: buf.at[rows, :, :, slots].set(x[:, None, ..., 0], mode="drop")  # noqa: E731
                new = new.replace(lam_hi=put_lam(self.lam_hi, lam_q[0]), lam_lo=put_lam(self.lam_lo, lam_q[1]))
        else:
            slot = jnp.where(chunk.cols >= length + t - ring, p + jnp.mod(chunk.cols, ring), c)       # [T]
            if p:
                slot = jnp.where((pos >= 0) & (pos < sinks), pos, slot[None])                      # [B, T]
                rows, hs = jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None]
                sn = jnp.broadcast_to(slot[:, None], (b, n, t))
                put = lambda buf, x: buf.at[rows, hs, sn].set(x.astype(buf.dtype), mode="drop")      # noqa: E731
                put_lam = lambda buf, x: buf.at[rows, hs, :, sn].set(x.transpose(0, 1, 3, 2), mode="drop")  # noqa: E731
            else:
                put = lambda buf, x: buf.at[:, :, slot].set(x.astype(buf.dtype), mode="drop")         # noqa: E731
                put_lam = lambda buf, x: buf.at[:, :, :, slot].set(x, mode="drop")                   # noqa: E731
            new = self.replace(k=put(self.k, kt), v=put(self.v, vt))
            if lam_q is not None:
                new = new.replace(lam_hi=put_lam(self.lam_hi, lam_q[0]), lam_lo=put_lam(self.lam_lo, lam_q[1]))
        return new._advance(step, start_t, t)

    def _advance(self, step: _Step, start_t, t: int) -> RingGroup:
        """The tables after T columns: the ring keeps its last C − P columns (what the rule kept beyond them overflowed,
        counted per table), ``peak`` follows the live count; elementwise over [B, nt]."""
        length, seq_start, p = step.cache.length, step.cache.seq_start, self.pinned
        wanted = start_t[..., -1]
        new_start = jnp.maximum(wanted, length + t - self.ring)
        live = jnp.maximum(length + t - new_start, 0) + jnp.clip(length + t - seq_start, 0, p)[:, None]
        return self.replace(start=new_start, peak=jnp.maximum(self.peak, live),
                            overflow=self.overflow + (new_start - wanted))

    def _write_read(self, step: _Step, q, k, v, lam_q, lo, floor=None, raw=None) -> tuple:
        """A decode step: its entry written at ring slot P + (``length`` mod (C − P)) (and at a pinned position to its
        pinned slot), the ring read from max(``lo``, start) (with ``floor``, the rule's ``decay_floor``: from the
        first key above it) to ``length`` with the pinned positions written so far, and start / peak / overflow
        advanced, by one op (``decode_attention_append``: in the Pallas kernel, without update or bookkeeping
        kernels); with ``raw`` (a ``DecodeStep``) it also does the layer's per-head work.
        Returns (o [B, 1, n, G, D] float32, the updated group, the op's (shift state, Λ) or None)."""
        hi = (step.cache.length + 1).astype(jnp.int32)
        lam_new = None if lam_q is None or raw is not None else (lam_q[0][..., 0], lam_q[1][..., 0])  # [B, n, G]
        res = decode_attention_append(
            q[:, 0], self.k.astype(q.dtype), self.v.astype(q.dtype), k[:, 0].astype(q.dtype), v[:, 0].astype(q.dtype),
            lo=lo, hi=hi, lam_q=lam_new, lam_k=None if self.lam_hi is None else (self.lam_hi, self.lam_lo),
            lam_new=lam_new, decay_floor=floor, sm_scale=step.chunk.scale, step=raw,
            ring_tables=(self.start, self.peak, self.overflow),
            pinned=PinnedSlots(self.pinned, self.pin_slots, step.cache.seq_start) if self.pin_slots else None)
        start, peak, overflow = res.tables
        new = self.replace(k=res.k.astype(self.k.dtype), v=res.v.astype(self.v.dtype), start=start, peak=peak,
                           overflow=overflow)
        if res.lam_k is not None:
            new = new.replace(lam_hi=res.lam_k[0], lam_lo=res.lam_k[1])
        return res.o[:, None].astype(jnp.float32), new, res.carry

    def _attend(self, step: _Step, keys: Keys, start_t, q, k, v) -> jax.Array:
        """Attention of a chunk of T > 1: the ring as it was (pinned slots, and columns ≥ each query's start)
        and the chunk's own keys. Returns [B, T, n, G, D] float32."""
        chunk, t = step.chunk, q.shape[1]
        pinned_slot = (jnp.arange(self.slots) < self.pinned)[None, None, None]
        vis_old = keys.held[:, :, None, :] & (pinned_slot | (keys.col[:, :, None, :] >= start_t[..., None]))
        causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
        sink = (chunk.pos >= 0) & (chunk.pos < self.pinned)
        vis_new = causal & chunk.real[:, None, None, :] & (sink[:, None, None, :]
                                                         | (chunk.cols[None, None, None, :] >= start_t[..., None]))
        kt, vt = (x.transpose(0, 2, 1, 3).astype(self.k.dtype) for x in (k, v))
        return _attend_chunk(q, self.k, self.v, kt, vt, vis_old[:, :, None], vis_new[:, :, None], keys.decay_old,
                             keys.decay_new, chunk.scale)


@flax.struct.dataclass
class PoolGroup(_Entries):
    """A slot pool of a group of key/value heads (per-row tables; module docstring).

    Attributes:
      k, v: [B, n, C, D] compute dtype; meaningful where ``pos`` ≥ 0.
      lam_hi, lam_lo: [B, n, G, C] float32 Λ pairs of the entry in each slot, or None.
      pos: [B, 1, C] int32 position held by each slot (−1: free).
      k_int: [B, C, r] float32 DCP interaction keys, or None.
      count: [B, 1] int32 occupied slots per row; hi: [B] int32, 1 + the highest occupied slot (the read bound).
      peak: [B, 1] int32, the most slots each row has held so far; overflow: [B, 1] int32, the survivors it had no
        slot for (tokens). heads: as ``RingGroup``.
    """

    k: jax.Array
    v: jax.Array
    lam_hi: jax.Array | None
    lam_lo: jax.Array | None
    pos: jax.Array
    k_int: jax.Array | None
    count: jax.Array
    hi: jax.Array
    peak: jax.Array
    overflow: jax.Array
    heads: tuple = flax.struct.field(pytree_node=False)

    @classmethod
    def empty(cls, batch: int, capacity: int, heads: tuple, *, head_dim: int, g: int, dtype, forget_gate: bool,
              policy: CachePolicy, interaction_dim: int | None = None, **_) -> PoolGroup:
        n = len(heads)
        lam = (lambda: jnp.zeros((batch, n, g, capacity), jnp.float32)) if forget_gate else (lambda: None)
        k_int = (jnp.zeros((batch, capacity, interaction_dim), jnp.float32)
                 if "interaction_dim" in policy.needs else None)
        return cls(jnp.zeros((batch, n, capacity, head_dim), dtype), jnp.zeros((batch, n, capacity, head_dim), dtype),
                   lam(), lam(), jnp.full((batch, 1, capacity), -1, jnp.int32), k_int,
                   jnp.zeros((batch, 1), jnp.int32), jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, 1), jnp.int32),
                   jnp.zeros((batch, 1), jnp.int32), heads)

    def live(self, length, seq_start) -> jax.Array:
        return self.count

    def held_positions(self, cache) -> jax.Array:
        return self.pos

    def logical_axes(self) -> PoolGroup:
        axes = lambda x: None if x is None else KV_AXES  # noqa: E731
        return self.replace(k=KV_AXES, v=KV_AXES, lam_hi=axes(self.lam_hi), lam_lo=axes(self.lam_lo),
                            pos=("batch", None, None), k_int=None if self.k_int is None else ("batch", None, None),
                            count=("batch", None), hi=("batch",), peak=("batch", None), overflow=("batch", None))

    def shift_columns(self, shift) -> PoolGroup:
        """The group with its keys moved by ``shift`` columns: the pool's table holds positions, so unchanged."""
        return self

    def append(self, step: _Step, q, k, v, lam):
        """As ``RingGroup.append``, for a pool."""
        lam_q = None if lam is None else tuple(x.transpose(0, 2, 3, 1) for x in lam)              # [B, n, G, T]
        keys = self._keys(step.cache, lam_q)
        vis_old, vis_new = self._visibility(step, keys)
        new = self._place(step, k, v, lam_q, vis_old, vis_new)
        if q.shape[1] == 1:
            return self._read(step, new, q, lam_q), new
        kt, vt = (x.transpose(0, 2, 1, 3).astype(self.k.dtype) for x in (k, v))
        return _attend_chunk(q, self.k, self.v, kt, vt, vis_old, vis_new, keys.decay_old, keys.decay_new,
                             step.chunk.scale), new

    def _keys(self, cache, lam_q) -> Keys:
        decay = lambda lam_k: None if lam_q is None else _decay(lam_q, lam_k)  # noqa: E731
        return Keys(self.heads, self.pos + cache.seq_start[:, None, None], self.pos >= 0,
                    decay((self.lam_hi, self.lam_lo)), decay(lam_q), self.k_int)

    def _visibility(self, step: _Step, keys: Keys) -> tuple[jax.Array, jax.Array]:
        """Visibility: the rule's masks within what is held, causal and real: (vis_old [B, ·, ·, T, S],
        vis_new [B, ·, ·, T, T])."""
        chunk = step.chunk
        t = chunk.cols.shape[0]
        rule_old, rule_new = step.rule.masks(step.cache.policy, step.aux, chunk, keys)
        causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
        return keys.held[:, :, None, None, :] & rule_old, causal & chunk.real[:, None, None, None, :] & rule_new

    def _place(self, step: _Step, k, v, lam_q, vis_old, vis_new) -> PoolGroup:
        """Placement: the slots hold what the chunk's last query sees (a row keeps a token while any head
        does); the survivors go to the lowest free slots (``_allocate``); ``hi`` follows the highest."""
        chunk = step.chunk
        b, t, n, _ = k.shape
        g, s = vis_old.shape[2], self.slots
        last = lambda x, keys_: jnp.any(jnp.broadcast_to(x[..., -1, :], (b, n, g, keys_)), axis=(1, 2))[:, None]  # noqa: E731
        keep_old, keep_new = last(vis_old, s), last(vis_new, t)                                   # [B, 1, S | T]
        slot, _, dropped, count = _allocate(self.pos, keep_old, keep_new)
        rows, hs = jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None]
        sn = jnp.broadcast_to(slot, (b, n, t))
        put = lambda buf, x: buf.at[rows, hs, sn].set(x.transpose(0, 2, 1, 3).astype(buf.dtype), mode="drop")  # noqa: E731
        put_lam = lambda buf, x: buf.at[rows, hs, :, sn].set(x.transpose(0, 1, 3, 2), mode="drop")  # noqa: E731
        pos = jnp.where(keep_old, self.pos, -1).at[rows, jnp.zeros_like(rows), slot].set(
            jnp.broadcast_to(chunk.pos[:, None], slot.shape), mode="drop")
        new = self.replace(
            k=put(self.k, k), v=put(self.v, v), pos=pos, count=count,
            hi=jnp.max(jnp.where(pos >= 0, jnp.arange(s, dtype=jnp.int32) + 1, 0), axis=(1, 2)),
            peak=jnp.maximum(self.peak, count), overflow=self.overflow + dropped[:, None],
            lam_hi=None if lam_q is None else put_lam(self.lam_hi, lam_q[0]),
            lam_lo=None if lam_q is None else put_lam(self.lam_lo, lam_q[1]),
            k_int=None if self.k_int is None else self.k_int.at[rows[:, :, 0], slot[:, 0]].set(
                chunk.facts.k_int.astype(jnp.float32), mode="drop"))
        return new

    def _read(self, step: _Step, new: PoolGroup, q, lam_q) -> jax.Array:
        """Attention of a decode step after its write (the token's slot was free or made room): the row's
        [0, hi) through the decode op, masked by occupancy. Returns [B, 1, n, G, D] float32."""
        o = decode_attention(q[:, 0], new.k.astype(q.dtype), new.v.astype(q.dtype), lo=jnp.int32(0), hi=new.hi[:, None],
                             valid=new.pos >= 0, lam_q=None if lam_q is None else (lam_q[0][..., 0], lam_q[1][..., 0]),
                             lam_k=None if lam_q is None else (new.lam_hi, new.lam_lo), sm_scale=step.chunk.scale)
        return o[:, None].astype(jnp.float32)


def _allocate(pos, keep_old, keep_new):
    """Where a pool's survivors go: (slot [B, 1, T] (S: not placed), placed [B, 1, T], dropped [B], count [B, 1]).

    The k-th survivor of the chunk takes the k-th free slot, lowest first; without room the oldest surplus
    survivors of a chunk are dropped, and a decode step (T = 1) takes the slot of the oldest cached token."""
    s, t = pos.shape[2], keep_new.shape[2]
    free = ~keep_old
    if t == 1:  # one reduction picks the slot: the lowest free one, else the oldest cached token
        big = jnp.int32(2 ** 30)
        slot0 = jnp.argmax(jnp.where(free, big - jnp.arange(s), -pos), axis=2)[..., None]     # kept: positions ≥ 0
        full = keep_new & ~jnp.take_along_axis(free, slot0, axis=2)
        slot = jnp.where(keep_new, slot0, s)
        dropped = jnp.sum(full, axis=(1, 2), dtype=jnp.int32)
        count = jnp.sum(keep_old, axis=2, dtype=jnp.int32) + jnp.sum(keep_new & ~full, axis=2, dtype=jnp.int32)
        return slot, keep_new, dropped, count
    n_free = jnp.sum(free, axis=2, keepdims=True)
    rank = jnp.cumsum(keep_new, axis=2) - 1                                                   # token order
    surplus = jnp.maximum(jnp.sum(keep_new, axis=2, keepdims=True) - n_free, 0)
    placed = keep_new & (rank >= surplus)                                                     # the newest fit
    order = jnp.argsort(~free, axis=2, stable=True)
    slot = jnp.where(placed, jnp.take_along_axis(order, jnp.clip(rank - surplus, 0, s - 1), axis=2), s)
    count = jnp.sum(keep_old, axis=2, dtype=jnp.int32) + jnp.sum(placed, axis=2, dtype=jnp.int32)
    return slot, placed, jnp.sum(surplus, axis=(1, 2), dtype=jnp.int32), count


def _attend_chunk(q, k_old, v_old, k_new, v_new, vis_old, vis_new, bias_old, bias_new, scale):
    """A chunk's attention over the cached entries as they were and its own keys: one softmax over the two
    parts (no concatenation). q [B, T, n, G, D]; k/v_old [B, n, S, D]; k/v_new [B, n, T, D]; vis and bias
    broadcastable to [B, n, G, T, S | T] (bias None without gates). Returns [B, T, n, G, D] float32."""
    qt = q.transpose(0, 2, 3, 1, 4)                                                          # [B, n, G, T, D]
    prec = dot_precision(q.dtype)
    dot = lambda keys: jnp.einsum("bngtd,bnsd->bngts", qt, keys.astype(q.dtype), preferred_element_type=jnp.float32,
                                  precision=prec) * scale
    mix = lambda w, vals: jnp.einsum("bngts,bnsd->bngtd", w.astype(vals.dtype), vals,
                                     preferred_element_type=jnp.float32, precision=prec)
    s_old, s_new = dot(k_old), dot(k_new)
    if bias_old is not None:
        s_old, s_new = s_old + bias_old, s_new + bias_new
    s_old, s_new = jnp.where(vis_old, s_old, -jnp.inf), jnp.where(vis_new, s_new, -jnp.inf)
    m = jnp.maximum(jnp.max(s_old, axis=-1, keepdims=True), jnp.max(s_new, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w_old, w_new = jnp.exp(s_old - m), jnp.exp(s_new - m)
    l = jnp.sum(w_old, axis=-1, keepdims=True) + jnp.sum(w_new, axis=-1, keepdims=True)
    l = jnp.where(l > 0, l, 1.0)
    return (mix(w_old / l, v_old) + mix(w_new / l, v_new)).transpose(0, 3, 1, 2, 4)


STORAGES = {"ring": RingGroup, "pool": PoolGroup}


class _Step(NamedTuple):
    """One layer call as the groups see it: the cache before it, the policy's rule and its per-layer output,
    the chunk, and whether the groups attend (False: the flash op already did)."""

    cache: Any
    rule: Rule
    aux: Any
    chunk: Chunk
    attend: bool


@flax.struct.dataclass
class SlotKVCache:
    """Decoding state of one attention layer (module docstring).

    Attributes:
      groups: the layer's ``RingGroup``s or ``PoolGroup``s (their ``heads`` partition the key/value heads).
      length: int32 scalar, columns fed so far including left pads (the next token's column), shared by rows.
      seq_start: [B] int32 left pads per row; the token in column c has position c − seq_start.
      lam_hi, lam_lo: [B, H] float32 Λ of the last token fed (the pair carried into the next chunk), or None.
      kv_shift: [B, 2, Hkv, D] the unshifted k and v projections of the last token (KV-shift), or None: one
        buffer, so a decode step writes its carry with one kernel (``k_shift`` / ``v_shift`` read its halves).
      state: the policy rule's per-layer state (``fox_jax.cache.visibility``; acp: the running maxima of
        the q and k norms without QK-norm, the threshold from the first chunk's QK-norm bound with it), or None.
      policy: the ``CachePolicy`` (static).
      max_context: N, the longest context this cache serves (static; ``acp``'s threshold uses it).
      provable: whether the policy's promise holds for this model (static; ``CachePolicy.provable``).
      fresh: nothing has been fed yet (static): a first chunk of a policy with a ``flash_prefill`` form then
        runs the flash attention op over itself instead of the masked path.
    """

    groups: tuple
    length: jax.Array
    seq_start: jax.Array
    lam_hi: jax.Array | None
    lam_lo: jax.Array | None
    kv_shift: jax.Array | None
    state: Any
    policy: CachePolicy = flax.struct.field(pytree_node=False)
    max_context: int = flax.struct.field(pytree_node=False)
    provable: bool = flax.struct.field(pytree_node=False, default=True)
    fresh: bool = flax.struct.field(pytree_node=False, default=True)

    @property
    def kv_heads(self) -> int:
        return sum(g.k.shape[1] for g in self.groups)

    @property
    def k_shift(self) -> jax.Array | None:
        """[B, Hkv, D] the KV-shift carry of the keys, or None."""
        return None if self.kv_shift is None else self.kv_shift[:, 0]

    @property
    def v_shift(self) -> jax.Array | None:
        """[B, Hkv, D] the KV-shift carry of the values, or None."""
        return None if self.kv_shift is None else self.kv_shift[:, 1]

    @property
    def overflow(self) -> jax.Array:
        """[B] int32 entries the storage could not hold although the policy kept them (tokens; for per-head tables,
        tokens × heads): the groups' per-table counts summed (kept per table, so a decode step adds elementwise)."""
        return sum(jnp.sum(g.overflow, axis=1) for g in self.groups)

    @property
    def capacity(self) -> int:
        """The largest capacity of a group (the most tokens one head can hold)."""
        return max(g.slots for g in self.groups)

    def live_count(self) -> jax.Array:
        """[B] float32 live tokens per row, averaged over the key/value heads."""
        return sum(g.held(self) for g in self.groups) / self.kv_heads

    def live_bytes(self) -> jax.Array:
        """[B] float32 bytes of the live entries per row."""
        return sum(g.held(self) * g.entry_bytes for g in self.groups)

    def allocated_bytes(self) -> int:
        """Bytes the storage holds for all rows (k, v, Λ, k_int; slot tables and ring starts excluded)."""
        return int(sum(math.prod(g.k.shape[:3]) * g.entry_bytes for g in self.groups))

    def logical_axes(self) -> SlotKVCache:
        """The cache with a tuple of logical axis names (``fox_jax.sharding``) in place of every array, e.g.
        k/v [B, n, C, D] -> ("batch", "kv_heads", None, None); None fields stay None. Map it with
        ``jax.tree.map(f, cache.logical_axes(), is_leaf=lambda x: isinstance(x, tuple))``."""
        gates = None if self.lam_hi is None else ("batch", "heads")
        shift = None if self.kv_shift is None else ("batch", None, "kv_heads", None)
        return self.replace(groups=tuple(g.logical_axes() for g in self.groups), length=(), seq_start=("batch",),
                            lam_hi=gates, lam_lo=gates, kv_shift=shift,
                            state=rule_for(self.policy).state_axes(self.state))

    def insert_row(self, row, source: SlotKVCache) -> SlotKVCache:
        """This cache with row ``row`` replaced by the only row of ``source`` (continuous batching: a request
        prefilled alone joins a batch that is decoding).

        ``source`` is a one-row cache of the same layout (policy, groups and capacities; made by the same
        ``init_cache`` with batch 1) that was fed ``source.length`` ≤ ``self.length`` columns. Its column c becomes
        column c + ``self.length`` − ``source.length`` here, so the row's next token takes the shared next column
        ``self.length``: ``seq_start`` and the ring starts move by that shift and the ring slots roll with it
        (``RingGroup.shift_columns``; a pool's table holds positions and is copied as is). Every per-row leaf
        (those with a "batch" axis in ``logical_axes``: k, v, Λ, tables, the Λ / KV-shift carries, overflow, the
        rule's state such as acp's threshold or running norm maxima) of row ``row`` is overwritten, so nothing
        of the row's previous request remains, except ``peak`` (the most entries the row has ever held, for
        ``calibrate_slots``): the maximum of both; the shared leaves keep this cache's values (``length``,
        ``max_context``). Positions, and so the row's logits, are those of ``source``: decoding the row here
        equals decoding ``source`` on its own.

        Args:
          row: int32 scalar in [0, B) (may be traced). source: the one-row cache.

        Returns:
          The updated cache (``fresh`` as this one's).

        Raises:
          ValueError: ``source`` of another layout or more than one row (static checks; a ``source.length``
            > ``self.length`` cannot be checked under ``jit``: it must not happen).
        """
        if source.seq_start.shape[0] != 1:
            raise ValueError(f"source must be a one-row cache, got batch {source.seq_start.shape[0]}")
        layout = lambda c: (c.policy, tuple((type(g), g.heads, g.k.shape[1:]) for g in c.groups))  # noqa: E731
        if layout(source) != layout(self):
            raise ValueError("source must have this cache's policy and group layout (the same init_cache, batch 1)")
        shift = (self.length - source.length).astype(jnp.int32)
        moved = source.replace(groups=tuple(g.shift_columns(shift) for g in source.groups),
                               seq_start=source.seq_start + shift, length=self.length,
                               max_context=self.max_context, fresh=self.fresh)

        def put(mine, theirs, axes):
            if "batch" not in axes:
                return mine
            return lax.dynamic_update_slice_in_dim(mine, theirs.astype(mine.dtype), row, axis=axes.index("batch"))

        peaks = [jnp.maximum(lax.dynamic_index_in_dim(g.peak, row, keepdims=True), s.peak)
                 for g, s in zip(self.groups, moved.groups)]
        moved = moved.replace(groups=tuple(s.replace(peak=p) for s, p in zip(moved.groups, peaks)))
        return jax.tree.map(put, self, moved, self.logical_axes())  # the axes tree: a tuple per array of ours


def _split_slots(slots, kv_heads: int, policy: CachePolicy, block: int) -> list[tuple[int, tuple[int, ...]]]:
    """[(capacity, kv heads)] groups from ``slots``: an int (one group) or, for per-head policies, a sequence of
    Hkv ints (heads whose capacities round to the same value share a group)."""
    if isinstance(slots, int) and not isinstance(slots, bool):
        if slots < 1:
            raise ValueError(f"slots must be positive ints, got {slots!r}")
        return [(policy.capacity(slots, block), tuple(range(kv_heads)))]
    counts = tuple(slots)
    if not policy.per_head or len(counts) != kv_heads:
        raise ValueError(f"slots must be an int{' or ' + str(kv_heads) + ' ints (one per key/value head)' if policy.per_head else ''}"
                         f", got {slots!r}")
    if not all(isinstance(c, int) and c >= 1 for c in counts):
        raise ValueError(f"slots must be positive ints, got {slots!r}")
    groups: dict[int, list[int]] = {}
    for h, c in enumerate(counts):
        groups.setdefault(policy.capacity(c, block), []).append(h)
    return [(c, tuple(hs)) for c, hs in sorted(groups.items())]


def new_slot_cache(batch: int, slots, *, n_heads: int, kv_heads: int, head_dim: int, dtype, forget_gate: bool,
                   kv_shift: bool, interaction_dim: int | None = None, qk_norm: bool = False, policy: Any = "dense",
                   max_context: int | None = None, seq_start=None, block: int = RING_BLOCK) -> SlotKVCache:
    """An empty ``SlotKVCache`` for one layer, with the storage its policy wants.

    Args:
      batch: B.
      slots: entries per row (an int), or for a per-head policy (``acp``) one count per key/value head (a
        sequence of Hkv ints; heads of equal capacity share a group). Each is rounded up by
        ``policy.capacity`` (a multiple of ``block``).
      n_heads, kv_heads, head_dim: H, Hkv, D. dtype: compute dtype of k/v.
      forget_gate: store Λ (FoX). kv_shift: store the KV-shift carry (Pro). interaction_dim: r of a DCP model.
      qk_norm: the model has QK-norm (``acp`` is then provable).
      policy: a ``CachePolicy`` or its string form.
      max_context: N, the most keys a query can see (``acp``'s threshold); default the largest capacity.
      seq_start: optional [B] int left pads per row.
      block: capacities are multiples of it: the decode kernel's key block (``RING_BLOCK``); only the
        storage's own tests use another value.

    Raises:
      ValueError: bad slots, a policy the model cannot run (``policy.check``), a bad seq_start.
    Warns:
      ``HeuristicEvictionWarning`` when the policy runs without its guarantee (``acp`` without QK-norm).
    """
    policy = parse_policy(policy)
    layout = dict(n_heads=n_heads, kv_heads=kv_heads, head_dim=head_dim, forget_gate=forget_gate, kv_shift=kv_shift,
                  interaction_dim=interaction_dim, qk_norm=qk_norm)
    policy.check(layout)
    seq_start = check_seq_start(seq_start, batch)
    storage = STORAGES[policy.storage]
    groups = tuple(storage.empty(batch, c, heads, head_dim=head_dim, g=n_heads // kv_heads, dtype=dtype,
                                 forget_gate=forget_gate, policy=policy, seq_start=seq_start,
                                 interaction_dim=interaction_dim)
                   for c, heads in _split_slots(slots, kv_heads, policy, block))
    carry = jnp.zeros((batch, 2, kv_heads, head_dim), dtype) if kv_shift else None
    last = (lambda: jnp.zeros((batch, n_heads), jnp.float32)) if forget_gate else (lambda: None)
    capacity = max(g.slots for g in groups)
    return SlotKVCache(groups, jnp.zeros((), jnp.int32), seq_start, last(), last(), carry,
                       rule_for(policy).init_state(policy, batch, layout), policy,
                       capacity if max_context is None else int(max_context), policy.provable(layout))


def cache_columns(cache: SlotKVCache, t: int) -> jax.Array:
    """Columns [T] int32 a chunk of T tokens occupies: ``length`` .. ``length`` + T − 1 (positions are
    ``columns[None] − cache.seq_start[:, None]``, negative on left pads)."""
    return cache.length + jnp.arange(t, dtype=jnp.int32)


def _merge_heads(outs, groups, shape) -> jax.Array:
    """The groups' outputs [(heads index, o [B, T, n, G, D])] as one [B, T, Hkv, G, D] float32 array."""
    if len(outs) == 1 and groups[0].heads == tuple(range(shape[2])):
        return outs[0][1]
    o = jnp.zeros(shape, jnp.float32)
    for idx, og in outs:
        o = o.at[:, :, idx].set(og)
    return o


def fuses_step(cache: SlotKVCache, t: int, rope: bool) -> bool:
    """Whether ``slot_attention`` hands a call of T = ``t`` tokens with ``head_ops`` to the decode op's fused step (the
    layer's per-head work inside the decode kernel): a decode step (T = 1) without RoPE, on ring groups, whose rule
    needs no q / k values (``Rule.needs_qk``). A layer asks before it chooses what to hand over (static)."""
    return (t == 1 and not rope and not rule_for(cache.policy).needs_qk(cache.state)
            and all(isinstance(group, RingGroup) for group in cache.groups))


def slot_attention(cache: SlotKVCache, q: jax.Array, k: jax.Array, v: jax.Array, log_fgate: jax.Array | None, *,
                   head_ops: HeadOps | None = None, facts: LayerFacts | None = None,
                   sm_scale: float | None = None) -> tuple[jax.Array, SlotKVCache]:
    """Append a chunk of T ≥ 1 tokens to the cache and attend with it under the cache's policy.

    o_i = Σ_j softmax_j(scale·q_i·k_j + Λ_i − Λ_j) v_j over the keys j ≤ i the policy lets query i see
    (FoX Eq. 4–6; Λ ≡ 0 without forget gates), j ranging over the live entries and the chunk.

    Args:
      cache: the layer's ``SlotKVCache``.
      q: [B, T, H, D]; k, v: [B, T, Hkv, D]: ready for attention (shifted, normed, rotated at the positions
        ``cache.length + arange(T) − seq_start``) without ``head_ops``; with it the raw projections.
      log_fgate: [B, T, H] float32 log forget gates, or None (must match the cache); pads are ignored.
      head_ops: the layer's per-head work around attention (``fox_jax.ops.head_ops.HeadOps``), or None: the
        prologue (KV-shift from the cache's carry, which is then updated; QK-norm; RoPE at the cache's positions)
        before attention and the epilogue (output norm and gate) after. A decode step (T = 1) without RoPE, on ring
        groups, whose rule needs no q / k values (``Rule.needs_qk``), hands it to the decode op
        of each head group (its Pallas kernel does it all: no kernels of their own; the carries pass from group to
        group); elsewhere ``head_prologue`` / ``head_epilogue`` run here.
      facts: the model facts the policy's rule may need (``LayerFacts``: acp the QK-norm logit bound, dcp
        q_int / k_int / β).
      sm_scale: logit scale, default 1/√D.

    Returns:
      (o [B, T, H, D] in q's dtype, after ``head_ops``'s epilogue — with ``head_ops.o_proj`` the projected [B, T, N],
      on a fused step from the kernel's per-head float32 shares summed here; the updated cache).

    Raises:
      ValueError: gates that do not match the cache; a KV-shift in ``head_ops`` for a cache without its carry;
        facts the policy needs but did not get.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    policy = cache.policy
    if (log_fgate is None) != (cache.lam_hi is None):
        raise ValueError("log_fgate must be given exactly when the cache stores forget gates")
    if head_ops is not None and head_ops.shifts and cache.kv_shift is None:
        raise ValueError("head_ops shifts k and v but the cache keeps no KV-shift carry (make it with kv_shift=True)")
    scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    cols = cache_columns(cache, t)
    pos = cols[None, :] - cache.seq_start[:, None]                                              # [B, T]
    real = pos >= 0
    rule = rule_for(policy)
    fused = head_ops is not None and fuses_step(cache, t, head_ops.rope_base is not None)
    kv_carry = cache.kv_shift
    if head_ops is not None and not fused:
        shift_state = None
        if head_ops.shifts:  # the cached state is the previous token's, unless that is a pad (or none)
            after_pad = (pos[:, 0] <= 0)[:, None, None]
            shift_state = (jnp.where(after_pad, 0, cache.k_shift), jnp.where(after_pad, 0, cache.v_shift))
        q, k, v, new_shift = head_prologue(head_ops, q, k, v, positions=pos, segment_ids=real.astype(jnp.int32),
                                           state=shift_state)  # the shift never reads a pad
        if new_shift is not None:
            kv_carry = jnp.stack([x.astype(cache.kv_shift.dtype) for x in new_shift], axis=1)
    lam = None
    if log_fgate is not None:  # (unused by a fused step, whose op accumulates Λ: XLA drops it)
        lam = accumulate_log_fgate(cache.lam_hi, cache.lam_lo, jnp.where(real[..., None], log_fgate, 0.0))
    chunk = Chunk(cols, pos, real, cache.seq_start, q, k, lam, LayerFacts() if facts is None else facts, scale,
                  cache.max_context, cache.fresh)
    aux, state = rule.prepare(policy, cache.state, chunk)
    flash = policy.flash_prefill()  # a first chunk on a fresh cache: the flash op over the chunk itself
    use_flash = cache.fresh and t > 1 and flash is not None and len(cache.groups) == 1
    step = _Step(cache, rule, aux, chunk, not use_flash)
    qg = q.reshape(b, t, hkv, g, d)
    if fused:  # the decode op does the layer's per-head work, Λ and the carries (chained through the head groups)
        shift = cache.kv_shift
        lam_now = None if lam is None else (cache.lam_hi.reshape(b, hkv, g), cache.lam_lo.reshape(b, hkv, g))
        gates = None if log_fgate is None else log_fgate.reshape(b, hkv, g)
        outs, groups = [], []
        for group in cache.groups:
            idx, whole = jnp.asarray(group.heads), group.heads == tuple(range(hkv))
            pick = (lambda x: x) if whole else (lambda x: jnp.take(x, idx, axis=2))  # noqa: E731 (unread: rows)
            raw = DecodeStep(head_ops, cache.seq_start, shift, gates, lam_now, heads=None if whole else group.heads,
                             kv_heads=None if whole else hkv)
            og, new, (new_shift, new_lam) = group.decode_step(step, pick(qg), pick(k), pick(v), None, raw)
            shift = shift if new_shift is None else new_shift
            lam_now = lam_now if new_lam is None else new_lam
            outs.append((idx, og))
            groups.append(new)
        new_cache = cache.replace(
            groups=tuple(groups), length=cache.length + 1, state=state,
            lam_hi=None if lam_now is None else lam_now[0].reshape(b, h),
            lam_lo=None if lam_now is None else lam_now[1].reshape(b, h),
            kv_shift=None if shift is None else shift.astype(cache.kv_shift.dtype), fresh=False)
        if head_ops.o_proj is not None:  # each group's [B, 1, S, N] shares of o·W_o, summed
            return sum(jnp.sum(og, axis=2) for _, og in outs).astype(q.dtype), new_cache
        return _merge_heads(outs, cache.groups, (b, 1, hkv, g, d)).reshape(b, 1, h, d).astype(q.dtype), new_cache
    if use_flash:
        o = forgetting_attention(q, k.astype(q.dtype), v.astype(q.dtype), log_fgate, seq_start=cache.seq_start,
                                 sm_scale=scale, **flash)
    lam_g = None if lam is None else tuple(x.reshape(b, t, hkv, g) for x in lam)
    outs, groups = [], []
    for group in cache.groups:
        idx = jnp.asarray(group.heads)
        whole = group.heads == tuple(range(hkv))
        pick = (lambda x: x) if whole else (lambda x: jnp.take(x, idx, axis=2))
        og, new = group.append(step, pick(qg), pick(k), pick(v),
                               None if lam_g is None else tuple(pick(x) for x in lam_g))
        outs.append((idx, og))
        groups.append(new)
    if step.attend:
        o = _merge_heads(outs, cache.groups, (b, t, hkv, g, d)).reshape(b, t, h, d)
    o = o.astype(q.dtype)
    if head_ops is not None:
        o = head_epilogue(head_ops, o)
    new_cache = cache.replace(
        groups=tuple(groups), length=cache.length + t, state=state,
        lam_hi=None if lam is None else lam[0][:, -1], lam_lo=None if lam is None else lam[1][:, -1],
        kv_shift=kv_carry, fresh=False)
    return o, new_cache


__all__ = ["PoolGroup", "RingGroup", "STORAGES", "SlotKVCache", "cache_columns", "fuses_step", "new_slot_cache",
           "slot_attention"]
