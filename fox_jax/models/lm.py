"""FoX and Transformer language models (specs/fox_acp.md §2).

    tokens → embed → N × [x + Attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] → RMSNorm → LM head

Untied embeddings, no biases except the forget gate's, no dropout, every matrix ~ N(0, 0.02).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fox_jax.config import ModelConfig
from fox_jax.nn.attention import ForgettingAttentionLayer
from fox_jax.nn.layers import RMSNorm, SwiGLU, normal_init


class Block(nn.Module):
    """One pre-norm block: h = x + Attn(RMSNorm(x)); out = h + MLP(RMSNorm(h)).

    With a ``cache`` (a ``LayerKVCache``, see ``ForgettingAttentionLayer``) returns (out, new cache).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None, cache=None):
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        h = RMSNorm(cfg.norm_eps, dtype, name="attn_norm")(x)
        a = ForgettingAttentionLayer(cfg, name="attn")(h, segment_ids, positions, cache)
        if cache is not None:
            a, cache = a
        x = x + a
        h = RMSNorm(cfg.norm_eps, dtype, name="mlp_norm")(x)
        out = x + SwiGLU(cfg.mlp_hidden, cfg.init_std, dtype, name="mlp")(h)
        return out if cache is None else (out, cache)


class LanguageModel(nn.Module):
    """A decoder-only LM: FoX (LLaMA) or Transformer (LLaMA), chosen by ``cfg.arch``.

    Call args:
      tokens: [B, T] int32 token ids (< cfg.vocab_size).
      segment_ids: [B, T] int32 or None: packed documents (attention never crosses them).
      positions: [B, T] int32 or None: position inside each document (used by RoPE only).
      cache: optional tuple of ``n_layers`` ``fox_jax.decoding.LayerKVCache`` (incremental decoding,
        ``fox_jax.decoding.generation``); then segment_ids and positions must be None. T > 1 tokens
        are a prefill that restarts the cache; T = 1 is one decode step.
    Returns:
      logits [B, T, vocab_size] in the compute dtype (cast to float32 for the loss); with a cache,
      (logits, the updated tuple of caches).
    Raises:
      ValueError: a cache with the wrong number of layers, or together with segment_ids/positions.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None, cache=None):
        cfg = self.cfg
        if cache is not None and len(cache) != cfg.n_layers:
            raise ValueError(f"cache must hold one LayerKVCache per layer ({cfg.n_layers}), got {len(cache)}")
        dtype = jnp.dtype(cfg.dtype)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                         embedding_init=normal_init(cfg.init_std), name="embed")
        x = embed(tokens)
        block_cls = Block
        if cfg.remat != "none" and cache is None:  # decoding never differentiates
            policy = (jax.checkpoint_policies.nothing_saveable if cfg.remat == "full"
                      else jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
            block_cls = nn.remat(Block, policy=policy)
        new_cache = []
        for i in range(cfg.n_layers):
            if cache is None:
                x = block_cls(cfg, name=f"layers_{i}")(x, segment_ids, positions)
            else:
                x, layer_cache = block_cls(cfg, name=f"layers_{i}")(x, segment_ids, positions, cache[i])
                new_cache.append(layer_cache)
        x = RMSNorm(cfg.norm_eps, dtype, name="final_norm")(x)
        if cfg.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                              kernel_init=normal_init(cfg.init_std), name="lm_head")(x)
        return logits if cache is None else (logits, tuple(new_cache))


def init_params(cfg: ModelConfig, rng: jax.Array, seq_len: int = 8) -> dict:
    """Float32 parameters of ``LanguageModel(cfg)`` as a plain nested dict (no Flax boxing)."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    return LanguageModel(cfg).init(rng, tokens)["params"]


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
