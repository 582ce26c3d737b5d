"""The packed, pruned KV cache of Dynamic Context Pruning (docs/design/dcp.md §5).

Per layer a ``PackedKVCache`` holds C slots in no particular order; a slot is live iff ``occupied``.
GPT-2's positions are learned and added to the input, so attention does not care where a token sits
and a freed slot can be recycled by a later token (spec §5.1). Decoding follows spec §5.2 with the
inference-time step mask (α = ∞), I[i, j] = Π_{n = j+1..i} step(z_{n, j}), z = q_int·k_intᵀ/√r + β:
a key dropped by one query is dropped for every later one, so the cache keeps exactly the keys the
newest query still sees, {j : I[last, j] = 1}.

A call appends a **chunk** of T ≥ 1 tokens (columns ``length`` .. ``length`` + T − 1; a prefill is the
first chunk of a fresh cache), so that any split of a sequence keeps what one pass over it keeps:

* T > 1: the chunk's queries see the live slots that every chunk query up to them keeps, and the
  chunk's own keys through the cumulative step mask among the chunk; attention with that mask
  (``dcp_attention``, −inf for dropped pairs, left pads hidden); then the cached slots the last query
  dropped are freed and the chunk's survivors written into the slots that were free before the
  chunk, lowest first, in token order (a fresh cache: compacted into slots 0..n−1, spec §5.3);
* T = 1 (decode step): append (k, v, k_int) into the first free slot, keep =
  (q_int·K_intᵀ/√r + β > 0) ∧ occupied, with the new token's own slot always kept, attend over the
  slots with the boolean mask keep, then free every slot not kept, irreversibly and per layer.

A chunk of T tokens writes its survivors into the slots free before it, so it needs live count + T ≤ C
(``check_packed_room``); in particular a token's slot index is at most the number of live tokens before
it and no consolidation is ever needed while decoding. The cache does not grow by itself: the host
sizes it between chunks of decode steps (``resize_packed_cache``, used by
``fox_jax.decoding.generation.generate``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fox_jax.cache.dense import cache_columns, decode_attention
from fox_jax.ops._common import check_seq_start
from fox_jax.ops._common import pad_axis
from fox_jax.ops.context_pruning import cumulative_keep_log_mask, dcp_attention, keep_logits


class PackedKVCache(NamedTuple):
    """Decoding state of one DCP attention layer.

    Attributes:
      k, v: [B, C, H, D] in the compute dtype; meaningful only in occupied slots.
      k_int: [B, C, r] float32 interaction keys.
      occupied: [B, C] bool, the live slots.
      positions: [B, C] int32 token position held by each slot, −1 for a free slot (interpretability:
        which tokens survive).
      length: int32 scalar, tokens fed so far including left pads (the next token's column).
      seq_start: [B] int32 left pads per row; the token in column c has position c − seq_start.
    """

    k: jax.Array
    v: jax.Array
    k_int: jax.Array
    occupied: jax.Array
    positions: jax.Array
    length: jax.Array
    seq_start: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def live_count(self) -> jax.Array:
        """[B] int32 live slots per row."""
        return jnp.sum(self.occupied, axis=1, dtype=jnp.int32)

    @property
    def token_bytes(self) -> int:
        """Bytes one cached token takes in this layer (k, v and k_int)."""
        return 2 * math.prod(self.k.shape[2:]) * self.k.dtype.itemsize + self.k_int.shape[2] * 4

    @staticmethod
    def check_room(caches, n_tokens: int = 1) -> None:
        """``check_packed_room``: raise unless every layer and row can take ``n_tokens`` more tokens."""
        check_packed_room(caches, n_tokens)


def new_packed_cache(batch: int, capacity: int, *, n_heads: int, head_dim: int, interaction_dim: int, dtype,
                     seq_start=None) -> PackedKVCache:
    """An empty ``PackedKVCache`` with C = ``capacity`` free slots.

    Raises:
      ValueError: capacity < 1 or a bad seq_start.
    """
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"cache capacity must be a positive int, got {capacity!r}")
    kv = jnp.zeros((batch, capacity, n_heads, head_dim), dtype)
    return PackedKVCache(
        k=kv, v=kv, k_int=jnp.zeros((batch, capacity, interaction_dim), jnp.float32),
        occupied=jnp.zeros((batch, capacity), bool), positions=jnp.full((batch, capacity), -1, jnp.int32),
        length=jnp.zeros((), jnp.int32), seq_start=check_seq_start(seq_start, batch))


def _take_slots(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b, i], ...] for x [B, T, ...] and index [B, N]."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def _chunk(cache: PackedKVCache, q, k, v, q_int, k_int, beta, block: int):
    b, t = q.shape[:2]
    c = cache.capacity
    rows = jnp.arange(b)[:, None]
    cols = cache_columns(cache, t)
    real = cols[None, :] >= cache.seq_start[:, None]                       # [B, T] not a left pad
    z = keep_logits(q_int, jnp.concatenate([cache.k_int, k_int.astype(jnp.float32)], axis=1), beta)
    # a live slot is kept by chunk query i iff every chunk query up to i keeps it (step(z) = z > 0)
    keep_slots = cache.occupied[:, None, :] & (jnp.cumsum(z[:, :, :c] <= 0, axis=1) == 0)
    keep_chunk = (cumulative_keep_log_mask(z[:, :, c:], jnp.inf) == 0.0) & real[:, None, :]
    keep = jnp.concatenate([keep_slots, keep_chunk], axis=2)               # [B, T, C + T]
    o = dcp_attention(q, jnp.concatenate([cache.k, k.astype(cache.k.dtype)], axis=1),
                      jnp.concatenate([cache.v, v.astype(cache.v.dtype)], axis=1),
                      jnp.where(keep, 0.0, -jnp.inf), block_q=block, block_k=block)
    survives, new_survives = keep[:, -1, :c], keep[:, -1, c:]              # I[last, j] = 1
    # the chunk's survivors go, in token order, to the slots free before the chunk, lowest first
    free = jnp.argsort(cache.occupied, axis=1, stable=True)               # [B, C] free slots first
    rank = jnp.cumsum(new_survives, axis=1) - 1
    n_free = c - jnp.sum(cache.occupied, axis=1, keepdims=True)
    slot = jnp.where(new_survives & (rank < n_free), _take_slots(free, jnp.clip(rank, 0, c - 1)), c)
    put = lambda buf, new: buf.at[rows, slot].set(new.astype(buf.dtype), mode="drop")
    new = PackedKVCache(
        k=put(cache.k, k), v=put(cache.v, v), k_int=put(cache.k_int, k_int),
        occupied=put(survives, jnp.ones_like(new_survives)),
        positions=put(jnp.where(survives, cache.positions, -1),
                      jnp.broadcast_to(cols[None, :] - cache.seq_start[:, None], (b, t))),
        length=cache.length + t, seq_start=cache.seq_start)
    return o, new


def _decode(cache: PackedKVCache, q, k, v, q_int, k_int, beta):
    b = q.shape[0]
    rows = jnp.arange(b)
    slot = jnp.argmax(~cache.occupied, axis=1)                            # first free slot (must exist)
    is_real = cache.length >= cache.seq_start                             # [B] not a left pad
    occupied = cache.occupied.at[rows, slot].set(is_real)
    k_all = cache.k.at[rows, slot].set(k[:, 0])
    v_all = cache.v.at[rows, slot].set(v[:, 0])
    k_int_all = cache.k_int.at[rows, slot].set(k_int[:, 0].astype(jnp.float32))
    positions = cache.positions.at[rows, slot].set(cache.length - cache.seq_start)
    is_self = jnp.arange(cache.capacity)[None, :] == slot[:, None]
    keep = ((keep_logits(q_int, k_int_all, beta)[:, 0] > 0) | is_self) & occupied   # step(z) = z > 0
    o = decode_attention(q, k_all, v_all, keep)
    new = PackedKVCache(k=k_all, v=v_all, k_int=k_int_all, occupied=keep,
                        positions=jnp.where(keep, positions, -1), length=cache.length + 1,
                        seq_start=cache.seq_start)
    return o, new


def packed_attention(cache: PackedKVCache, q: jax.Array, k: jax.Array, v: jax.Array, q_int: jax.Array,
                     k_int: jax.Array, beta, *, block: int = 128) -> tuple[jax.Array, PackedKVCache]:
    """DCP attention of a chunk of T ≥ 1 tokens appended to the packed cache (module docstring).

    The chunk needs live count + T ≤ C in every row (``check_packed_room``: T ≤ C always, the live
    count when the cache is concrete; inside ``jit`` callers check it on the host, since a traced
    scatter cannot raise).

    Args:
      cache: the layer's ``PackedKVCache``.
      q, k, v: [B, T, H, D] the chunk's heads (compute dtype).
      q_int, k_int: [B, T, r] interaction queries and keys (float32).
      beta: the layer's scalar β.
      block: tile size of a chunk's ``dcp_attention``.

    Returns:
      (o [B, T, H, D] in q's dtype, the updated cache). Outputs and the kept set equal the training
      path at α = ∞ over the whole sequence; pruned tokens get weight exactly 0.

    Raises:
      ValueError: the chunk may not fit the capacity.
    """
    check_packed_room(cache, q.shape[1])
    if q.shape[1] > 1:
        return _chunk(cache, q, k, v, q_int, k_int, beta, block)
    return _decode(cache, q, k, v, q_int, k_int, beta)


def check_packed_room(caches, n_tokens: int = 1) -> None:
    """Raise unless every layer and row can take ``n_tokens`` more tokens without pruning anything.

    ``n_tokens`` ≤ C is checked always; the live counts when they are concrete (read back to the
    host, one device sync; nothing while tracing).

    Args:
      caches: one ``PackedKVCache`` or a sequence of them.
      n_tokens: tokens about to be appended (one chunk or single steps).

    Raises:
      ValueError: max live count + n_tokens > capacity (the message names the capacity).
    """
    caches = (caches,) if isinstance(caches, PackedKVCache) else tuple(caches)
    capacity = caches[0].capacity
    live = None
    if not any(isinstance(c.occupied, jax.core.Tracer) for c in caches):
        live = int(max(jnp.max(c.live_count()) for c in caches))
    if n_tokens > capacity or (live is not None and live + n_tokens > capacity):
        raise ValueError(f"the packed KV cache may overflow: {'?' if live is None else live} live slots of "
                         f"capacity {capacity}, {n_tokens} more tokens requested; resize it (resize_packed_cache)")


def resize_packed_cache(cache: PackedKVCache, capacity: int) -> PackedKVCache:
    """Compact the live slots to the front in token order and set C = ``capacity``.

    Shrinking frees memory; growing pads with free slots. Changing C recompiles the jitted decode
    step once per distinct capacity (use a few bucket sizes).

    Raises:
      ValueError: capacity smaller than the live count of some row (checked on the host).
    """
    live = int(jnp.max(cache.live_count()))
    if not isinstance(capacity, int) or capacity < max(live, 1):
        raise ValueError(f"capacity must be an int ≥ the live count {live} (and ≥ 1), got {capacity!r}")
    sort_key = jnp.where(cache.occupied, cache.positions, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(sort_key, axis=1)[:, :capacity]

    def fit(x, fill):
        x = _take_slots(x, order)
        return pad_axis(x, 1, capacity, fill) if capacity > x.shape[1] else x

    return cache._replace(k=fit(cache.k, 0), v=fit(cache.v, 0), k_int=fit(cache.k_int, 0),
                          occupied=fit(cache.occupied, False), positions=fit(cache.positions, -1))
