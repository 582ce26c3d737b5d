"""Incremental decoding: KV caches (dense and DCP-pruned) and ``generate``.

Caches are explicit pytrees, one per layer, passed to and returned by the models
(``model.apply(..., tokens, cache=caches) -> (logits, caches)``):

  LayerKVCache    dense, fixed capacity: k, v, per-column cumulative forget gates, KV-shift states (cache.py)
  PackedKVCache   DCP: live slots only, recycled, pruned per layer with the step mask (packed_cache.py)

``generation`` (prefill, decode_step, generate, init_cache, ...) imports the models, which import the
caches; its names are loaded on first access to keep the import graph acyclic.
"""

from fox_jax.decoding.cache import LayerKVCache, decode_attention
from fox_jax.decoding.packed_cache import PackedKVCache, resize_packed_cache

_GENERATION = ("Generation", "cache_bytes", "decode_step", "extend", "generate", "init_cache", "live_counts",
               "prefill", "sample_logits")

__all__ = ["LayerKVCache", "PackedKVCache", "decode_attention", "resize_packed_cache", *_GENERATION]


def __getattr__(name):
    if name in _GENERATION:
        from fox_jax.decoding import generation

        return getattr(generation, name)
    raise AttributeError(f"module 'fox_jax.decoding' has no attribute {name!r}")
