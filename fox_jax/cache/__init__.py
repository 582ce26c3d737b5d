"""KV caches below the models (``fox_jax.models`` and ``fox_jax.nn`` call them; ``fox_jax.decoding`` drives them).

One cache for every model family and every policy, an explicit pytree per layer made by the model config's
``init_cache`` and passed to and returned by the models (``model.apply(..., tokens, cache=caches).cache``):

  CachePolicy    one class per policy (dense, dcp, acp, window:W, sinks:S+W): what the engine asks of a
                 policy, and the storage it wants (policies.py, jax-free; ``parse_policy`` reads the registry)
  visibility.py  one visibility rule per policy class (jax), fed with model facts (``LayerFacts``)
  SlotKVCache    the storage per layer: rings indexed by column (dense, window, sinks, acp per head) or a slot
                 pool (dcp), and the attention of a chunk (slots.py)
  decay.py       Λ as float32 pairs, so decays stay accurate at any length

Importing this package imports no jax (the CLI parses ``--cache`` policies before jax loads): the cache
itself is ``fox_jax.cache.slots`` (also re-exported by ``fox_jax.decoding``).
"""

from fox_jax.cache.policies import (POLICIES, POLICY_FORMS, RING_BLOCK, CachePolicy, HeuristicEvictionWarning,
                                    parse_policy)

__all__ = ["CachePolicy", "HeuristicEvictionWarning", "POLICIES", "POLICY_FORMS", "RING_BLOCK", "parse_policy"]
