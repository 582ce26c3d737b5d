"""The decoding engine above the models: ``generate``, prefill / extend / decode steps, and teacher-forced
scoring under a cache policy (``generation``); ``serve``, continuous batching of many prompts under a KV budget
(``batching``). It drives any model family through its config (``init_cache``, ``max_positions``) and
``ModelOutput``; the caches sit below the models in ``fox_jax.cache``, whose names are re-exported here.
"""

from fox_jax.cache.policies import POLICY_FORMS, CachePolicy, parse_policy
from fox_jax.cache.slots import SlotKVCache
from fox_jax.decoding.batching import Completion, RequestRefused, Served, ServingPlan, plan_serving, serve
from fox_jax.decoding.generation import (Generation, cache_bytes, calibrate_slots, cast_plan, decode_step,
                                         decode_variables, extend, generate, init_cache, live_counts, min_slots,
                                         precast, prefill, sample_logits, token_losses_under_policy)

__all__ = ["CachePolicy", "Completion", "Generation", "POLICY_FORMS", "RequestRefused", "Served", "ServingPlan",
           "SlotKVCache", "cache_bytes", "calibrate_slots", "cast_plan", "decode_step", "decode_variables", "extend",
           "generate",
           "init_cache", "live_counts", "min_slots", "parse_policy", "plan_serving", "precast", "prefill",
           "sample_logits", "serve", "token_losses_under_policy"]
