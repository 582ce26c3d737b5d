"""Incremental decoding above the models: prefill, decode steps and ``generate``.

``generation`` (prefill, decode_step, extend, generate, init_cache, ...) drives any model family through
its config (``init_cache``, ``max_positions``) and ``ModelOutput``. The caches themselves, and the cached
attention the models call, sit below the models in ``fox_jax.cache``; their names are re-exported here.
"""

from fox_jax.cache import KVCache, LayerKVCache, PackedKVCache, decode_attention, resize_packed_cache
from fox_jax.decoding.generation import (Generation, cache_bytes, decode_step, extend, generate, init_cache,
                                         live_counts, prefill, sample_logits)

__all__ = ["Generation", "KVCache", "LayerKVCache", "PackedKVCache", "cache_bytes", "decode_attention", "decode_step",
           "extend", "generate", "init_cache", "live_counts", "prefill", "resize_packed_cache", "sample_logits"]
