"""FoX and Transformer language models (docs/design/fox_acp.md §2).

    tokens → embed → N × [x + Attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] → RMSNorm → LM head

Untied embeddings, no biases except the forget gate's, no dropout, every matrix ~ N(0, 0.02).

With ``ModelConfig.dcp`` every attention layer also prunes its context dynamically (docs/design/dcp.md §1;
see ``ForgettingAttentionLayer``), and the model follows ``fox_jax.models.gpt2.GPT2``'s DCP interface::

    logits, aux = LanguageModel(cfg).apply({"params": p}, tokens, alpha=alpha, segment_ids=seg)
    loss = ce(logits, targets) + gamma * aux["sparsity_loss"]
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fox_jax.config import ModelConfig
from fox_jax.nn.attention import ForgettingAttentionLayer
from fox_jax.nn.layers import RMSNorm, SwiGLU, normal_init
from fox_jax.ops.context_pruning import sparsity, sparsity_loss, with_interaction_params


class Block(nn.Module):
    """One pre-norm block: h = x + Attn(RMSNorm(x)); out = h + MLP(RMSNorm(h)).

    With a ``cache`` (a ``LayerKVCache``, see ``ForgettingAttentionLayer``) returns (out, new cache);
    with DCP (``cfg.dcp``, ``alpha`` required) returns (out, log I [B, T, T] float32 of the layer).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None, cache=None, alpha=None):
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        h = RMSNorm(cfg.norm_eps, dtype, name="attn_norm")(x)
        a = ForgettingAttentionLayer(cfg, name="attn")(h, segment_ids, positions, cache, alpha)
        aux = None
        if cache is not None or cfg.dcp:
            a, aux = a  # the updated cache, or the DCP log-mask
        x = x + a
        h = RMSNorm(cfg.norm_eps, dtype, name="mlp_norm")(x)
        out = x + SwiGLU(cfg.mlp_hidden, cfg.init_std, dtype, name="mlp")(h)
        return out if aux is None else (out, aux)


class LanguageModel(nn.Module):
    """A decoder-only LM: FoX (LLaMA) or Transformer (LLaMA), chosen by ``cfg.arch``.

    Call args:
      tokens: [B, T] int32 token ids (< cfg.vocab_size).
      segment_ids: [B, T] int32 or None: packed documents (attention never crosses them).
      positions: [B, T] int32 or None: position inside each document (used by RoPE only).
      cache: optional tuple of ``n_layers`` ``fox_jax.decoding.LayerKVCache`` (incremental decoding,
        ``fox_jax.decoding.generation``); then segment_ids and positions must be None. The T ≥ 1
        tokens are appended to the cache (a prefill on a fresh cache, a chunk or a decode step on a
        live one); any split of a sequence gives the logits of one pass. Not supported with DCP.
      alpha: keyword-only, DCP only (as ``GPT2``): required when ``cfg.dcp``, ignored otherwise. α of
        the α-sigmoid (docs/design/dcp.md §2): a Python float ≥ 1, ``float('inf')`` for the inference step
        mask, or a traced float32 scalar (e.g. from ``cosine_alpha_schedule``; no recompile per value).
    Returns:
      Without DCP: logits [B, T, vocab_size] in the compute dtype (cast to float32 for the loss); with
      a cache, (logits, the updated tuple of caches).
      With DCP: (logits [B, T, vocab_size] **float32**, aux), exactly ``GPT2``'s aux:
        ``log_masks``      [n_layers, B, T, T] float32 log I per layer (0 kept, ≈ −92.1 dropped),
        ``sparsity``       [n_layers] float32 fraction of causal pairs dropped (no gradient, §3.2),
        ``sparsity_loss``  float32 scalar ``sparsity_loss(log_masks, 1.0, normalization="causal",
                           segment_ids=...)`` (§3.1; 0 when T < 3): multiply by γ and add to the CE.
    Raises:
      ValueError: a cache with the wrong number of layers, or together with segment_ids/positions;
        a chunk that does not fit the cache capacity; DCP without ``alpha``.
      NotImplementedError: a cache with DCP (decoding a DCP LanguageModel is not implemented).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None, cache=None, *, alpha=None):
        cfg = self.cfg
        if cfg.dcp and cache is not None:
            raise NotImplementedError("decoding with caches is not implemented for DCP LanguageModels "
                                      "(ModelConfig.dcp=True); call the model on the full sequence")
        if cfg.dcp and alpha is None:
            raise ValueError("alpha is required when ModelConfig.dcp is True (use float('inf') for inference)")
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
        log_masks = []
        for i in range(cfg.n_layers):
            if cfg.dcp:  # alpha positionally: nn.remat traces positional args
                x, log_mask = block_cls(cfg, name=f"layers_{i}")(x, segment_ids, positions, None, alpha)
                log_masks.append(log_mask)
            elif cache is None:
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
        if cfg.dcp:
            return logits.astype(jnp.float32), dcp_aux(jnp.stack(log_masks), segment_ids)
        return logits if cache is None else (logits, tuple(new_cache))


def dcp_aux(log_masks: jax.Array, segment_ids: jax.Array | None = None) -> dict[str, Any]:
    """The DCP outputs of a forward pass, as ``GPT2`` returns them (docs/design/dcp.md §3).

    Args:
      log_masks: [L, B, T, T] float32 log I of every layer.
      segment_ids: optional [B, T] int, packed documents (only pairs inside a document count).

    Returns:
      {"log_masks": log_masks, "sparsity": [L] float32 (stop-gradient), "sparsity_loss": float32
      scalar, γ = 1, "causal" normalisation, 0 when T < 3}.
    """
    t = log_masks.shape[-1]
    return {
        "log_masks": log_masks,
        "sparsity": jax.lax.stop_gradient(sparsity(log_masks, segment_ids=segment_ids)[0]),
        "sparsity_loss": (sparsity_loss(log_masks, 1.0, segment_ids=segment_ids)
                          if t >= 3 else jnp.zeros((), jnp.float32)),
    }


def init_params(cfg: ModelConfig, rng: jax.Array, seq_len: int = 8) -> dict:
    """Float32 parameters of ``LanguageModel(cfg)`` as a plain nested dict (no Flax boxing).

    DCP models are initialised with alpha = 1 (the value does not affect the parameters)."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    kw = {"alpha": 1.0} if cfg.dcp else {}
    return LanguageModel(cfg).init(rng, tokens, **kw)["params"]


def add_dcp_params(cfg: ModelConfig, params: dict, rng: jax.Array, *, interaction_dim: int | None = None,
                   beta_init: float | None = None) -> tuple[ModelConfig, dict]:
    """Add fresh DCP parameters to a pretrained dense FoX/Transformer LM (docs/design/dcp.md §1.1, §4).

    Every layer gets ``layers_{i}/attn/q_int/kernel`` and ``layers_{i}/attn/k_int/kernel`` [d, r]
    float32 ~ N(0, cfg.init_std) (the reference code's effective N(0, 0.02) init) and the scalar
    ``layers_{i}/attn/beta`` = β₀ (2.0 by default). Existing weights are kept (same objects); the input
    pytree is not modified. The same as ``fox_jax.models.gpt2.add_dcp_params`` for GPT-2.

    Args:
      cfg: the dense model's config (``dcp`` False).
      params: its params (``init_params`` layout: ``layers_{i}/attn/...``).
      rng: PRNG key for the interaction weights.
      interaction_dim: r (default ``cfg.interaction_dim``, 64).
      beta_init: β₀ (default ``cfg.dcp_beta_init``, 2.0).

    Returns:
      (cfg with dcp=True and the chosen r/β₀, new params pytree).

    Raises:
      ValueError: cfg already has DCP, cfg has ACP on (``adaptive_threshold``), bad r/β₀ (via
        ``ModelConfig``), or params lack a layer ``layers_{i}/attn``.
    """
    if cfg.dcp:
        raise ValueError("add_dcp_params: cfg already has dcp=True")
    new_cfg = cfg.replace(
        dcp=True,
        interaction_dim=cfg.interaction_dim if interaction_dim is None else interaction_dim,
        dcp_beta_init=cfg.dcp_beta_init if beta_init is None else beta_init)
    out = with_interaction_params(params, [f"layers_{i}" for i in range(new_cfg.n_layers)],
                                  d_model=new_cfg.d_model, interaction_dim=new_cfg.interaction_dim,
                                  init_std=new_cfg.init_std, beta_init=new_cfg.dcp_beta_init, rng=rng)
    return new_cfg, out


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
