"""KV caches below the models (``fox_jax.models`` and ``fox_jax.nn`` call them; ``fox_jax.decoding`` drives them).

One cache for every model family and every policy, an explicit pytree per layer made by the model config's
``init_cache`` and passed to and returned by the models (``model.apply(..., tokens, cache=caches).cache``):

  SlotKVCache   a fixed pool of slots per row (the KV budget); freed slots are reused (slots.py)
  CachePolicy   what a query sees and so what the cache frees: dense, dcp, acp, window:W, sinks:S+W
                (policies.py, jax-free)
  decay.py      Λ as float32 pairs, so decays stay accurate at any length

Importing this package imports no jax (the CLI parses ``--cache`` policies before jax loads): the cache
itself is ``fox_jax.cache.slots`` (also re-exported by ``fox_jax.decoding``).
"""

from fox_jax.cache.policies import POLICY_FORMS, CachePolicy, parse_policy

__all__ = ["CachePolicy", "POLICY_FORMS", "parse_policy"]
