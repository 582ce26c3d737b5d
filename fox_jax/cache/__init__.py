"""KV caches and cached attention, below the models (``fox_jax.models`` and ``fox_jax.nn`` use them;
``fox_jax.decoding`` drives them from above).

Caches are explicit pytrees, one per layer, made by the model config's ``init_cache`` and passed to and
returned by the models (``model.apply(..., tokens, cache=caches).cache``):

  LayerKVCache    dense, fixed capacity: k, v, per-column cumulative forget gates, KV-shift states (dense.py)
  PackedKVCache   DCP: live slots only, recycled, pruned per layer with the step mask (packed.py)

Both implement ``KVCache``, the part of a cache that decoding reads without asking which kind it holds.
"""

from __future__ import annotations

from typing import Protocol

import jax

from fox_jax.cache.dense import LayerKVCache, decode_attention
from fox_jax.cache.packed import PackedKVCache, resize_packed_cache


class KVCache(Protocol):
    """What every per-layer cache offers (``LayerKVCache``, ``PackedKVCache``).

    Attributes:
      length: tokens appended so far (left pads included).
      seq_start: [B] int32 left pads per row.
      capacity: C, the columns (dense) or slots (packed) allocated per row; the cache never grows.
      token_bytes: bytes one entry of one row takes (k and v, plus the per-entry side arrays).
    """

    length: jax.Array
    seq_start: jax.Array

    @property
    def capacity(self) -> int: ...

    def live_count(self) -> jax.Array:
        """[B] int32 entries held per row (dense: real tokens; packed: the kept slots)."""

    @property
    def token_bytes(self) -> int: ...

    @staticmethod
    def check_room(caches, n_tokens: int = 1) -> None:
        """Raise ValueError when ``n_tokens`` more tokens cannot be appended (the message names the capacity)."""


__all__ = ["KVCache", "LayerKVCache", "PackedKVCache", "decode_attention", "resize_packed_cache"]
