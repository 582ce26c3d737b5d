"""Incremental decoding: KV caches (dense and DCP-pruned) and ``generate``.

Caches are explicit pytrees, one per layer, made by the model config's ``init_cache`` and passed to and
returned by the models (``model.apply(..., tokens, cache=caches).cache``):

  LayerKVCache    dense, fixed capacity: k, v, per-column cumulative forget gates, KV-shift states (cache.py)
  PackedKVCache   DCP: live slots only, recycled, pruned per layer with the step mask (packed_cache.py)

``generation`` (prefill, decode_step, generate, init_cache, ...) drives any model through that interface.
"""

from fox_jax.decoding.cache import LayerKVCache, decode_attention
from fox_jax.decoding.generation import (Generation, cache_bytes, decode_step, extend, generate, init_cache,
                                         live_counts, prefill, sample_logits)
from fox_jax.decoding.packed_cache import PackedKVCache, resize_packed_cache

__all__ = ["Generation", "LayerKVCache", "PackedKVCache", "cache_bytes", "decode_attention", "decode_step", "extend",
           "generate", "init_cache", "live_counts", "prefill", "resize_packed_cache", "sample_logits"]
