"""The packed, pruned KV cache of Dynamic Context Pruning (specs/dcp.md §5).

Per layer a ``PackedKVCache`` holds C slots in no particular order; a slot is live iff ``occupied``.
GPT-2's positions are learned and added to the input, so attention does not care where a token sits
and a freed slot can be recycled by the next token (spec §5.1). Decoding follows spec §5.2 with the
inference-time step mask (α = ∞):

* **prefill** (T prompt tokens, left padding hidden by ``seq_start``): the dense step mask
  I = cumprod(step(z)) over the prompt, attention with log I (exactly the training path), then only
  the survivors of the last row, {j : I[T−1, j] = 1}, are stored, compacted into slots 0..n−1 in
  token order (spec §5.3);
* **decode step** (one token): append (k, v, k_int) into the first free slot, keep =
  (q_int·K_intᵀ/√r + β > 0) ∧ occupied, with the new token's own slot always kept, attend over the
  slots with the boolean mask keep, then free every slot not kept, irreversibly and per layer.

Since a token goes to the *first* free slot, its slot index is at most the number of live tokens
before it; C ≥ (max live count) + 1 therefore suffices, and no consolidation is ever needed while
decoding. The cache does not grow by itself: the host sizes it between chunks of decode steps
(``resize_packed_cache``, used by ``fox_jax.decoding.generation.generate``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fox_jax.decoding.cache import check_seq_start, decode_attention
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


def _prefill(cache: PackedKVCache, q, k, v, q_int, k_int, beta, block: int):
    b, t = q.shape[:2]
    if t > cache.capacity:
        raise ValueError(f"the prompt ({t} tokens) does not fit the packed cache capacity {cache.capacity}")
    cols = jnp.arange(t, dtype=jnp.int32)
    real = cols[None, :] >= cache.seq_start[:, None]                       # [B, T]
    log_mask = cumulative_keep_log_mask(keep_logits(q_int, k_int, beta), jnp.inf)
    o = dcp_attention(q, k, v, log_mask, segment_ids=real.astype(jnp.int32), block_q=block, block_k=block)
    # With the step mask log I is exactly 0 (kept) or the floor (dropped).
    alive = (log_mask[:, -1, :] == 0.0) & real                            # I[T−1, j] = 1
    order = jnp.argsort(~alive, axis=1, stable=True)                      # survivors first, in order
    slots = cols[None, :] < jnp.sum(alive, axis=1, keepdims=True)         # [B, T] slot is live
    pack = lambda x, fill=0: pad_axis(_take_slots(x, order), 1, cache.capacity, fill)
    positions = jnp.where(slots, order - cache.seq_start[:, None], -1).astype(jnp.int32)
    new = cache._replace(k=pack(k), v=pack(v), k_int=pack(k_int.astype(jnp.float32)),
                         occupied=pad_axis(slots, 1, cache.capacity, False),
                         positions=pad_axis(positions, 1, cache.capacity, -1), length=jnp.asarray(t, jnp.int32))
    return o, new


def _decode(cache: PackedKVCache, q, k, v, q_int, k_int, beta):
    b = q.shape[0]
    rows = jnp.arange(b)
    slot = jnp.argmax(~cache.occupied, axis=1)                            # first free slot (must exist)
    occupied = cache.occupied.at[rows, slot].set(True)
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
    """DCP attention of a chunk with the packed cache: prefill for T > 1, one decode step for T = 1.

    A prefill restarts the cache (whatever it held is dropped). A decode step needs a free slot in
    every row (live count < C); callers check it on the host (``check_packed_room``), since a traced
    scatter cannot raise.

    Args:
      cache: the layer's ``PackedKVCache``.
      q, k, v: [B, T, H, D] the chunk's heads (compute dtype).
      q_int, k_int: [B, T, r] interaction queries and keys (float32).
      beta: the layer's scalar β.
      block: tile size of the prefill's ``dcp_attention``.

    Returns:
      (o [B, T, H, D] in q's dtype, the updated cache). The prefill's output equals the training path
      at α = ∞; a decode step drops the pruned tokens exactly (weight 0).

    Raises:
      ValueError: a prompt longer than the capacity.
    """
    if q.shape[1] > 1:
        return _prefill(cache, q, k, v, q_int, k_int, beta, block)
    return _decode(cache, q, k, v, q_int, k_int, beta)


def check_packed_room(caches, n_steps: int = 1) -> None:
    """Raise unless every layer and row can take ``n_steps`` more tokens without pruning anything.

    Reads the live counts back to the host (one device sync).

    Raises:
      ValueError: max live count + n_steps > capacity.
    """
    live = int(max(jnp.max(c.live_count()) for c in caches))
    if live + n_steps > caches[0].capacity:
        raise ValueError(f"the packed KV cache may overflow: {live} of {caches[0].capacity} slots live, "
                         f"{n_steps} more steps requested; resize it (resize_packed_cache)")


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
