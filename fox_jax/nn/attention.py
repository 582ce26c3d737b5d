"""The attention layer of FoX and of the Transformer baselines (specs/fox_acp.md §2.1–2.4)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fox_jax.config import ModelConfig
from fox_jax.nn.layers import apply_rope, normal_init
from fox_jax.ops import acp, forgetting_attention


class ForgettingAttentionLayer(nn.Module):
    """q/k/v projections, forget gate, forgetting attention, output projection.

    FoX (LLaMA): no RoPE; one forget-gate logit per head from ``fgate_proj`` (d → H, with bias,
    bias initialised to 0 so f ≈ 0.5 at init); log f = log_sigmoid(logit) in float32.
    Transformer (LLaMA): no forget gate, RoPE on q and k.

    Call args:
      x: [B, T, d] normed hidden states (compute dtype).
      segment_ids: [B, T] int or None (packed documents).
      positions: [B, T] int positions inside each document (RoPE only), default arange.
    Returns:
      [B, T, d] in the compute dtype. With ACP on, sows ``acp_fraction_skipped`` (a float32 scalar,
      fraction of causal tiles skipped) into the ``intermediates`` collection.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        b, t, _ = x.shape
        h, hkv, dh = cfg.n_heads, cfg.kv_heads, cfg.dim_per_head
        dense = lambda n, name, bias=False, dt=dtype: nn.Dense(
            n, use_bias=bias, dtype=dt, param_dtype=jnp.float32, kernel_init=normal_init(cfg.init_std), name=name)
        q = dense(h * dh, "q_proj")(x).reshape(b, t, h, dh)
        k = dense(hkv * dh, "k_proj")(x).reshape(b, t, hkv, dh)
        v = dense(hkv * dh, "v_proj")(x).reshape(b, t, hkv, dh)
        if cfg.use_rope:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(t), (b, t))
            q = apply_rope(q, positions, cfg.rope_base)
            k = apply_rope(k, positions, cfg.rope_base)
        log_fgate = None
        if cfg.use_fgate:
            logits = dense(h, "fgate_proj", bias=True, dt=jnp.float32)(x.astype(jnp.float32))
            log_fgate = jax.nn.log_sigmoid(logits)  # [B, T, H] float32
        threshold = cfg.adaptive_threshold
        o = forgetting_attention(
            q, k, v, log_fgate, segment_ids=segment_ids, adaptive_threshold=threshold,
            implementation=cfg.attention_impl, block_q=cfg.attention_block, block_k=cfg.attention_block)
        if threshold is not None and log_fgate is not None:
            self._sow_pruning(q, k, log_fgate, threshold)
        return dense(cfg.d_model, "o_proj")(o.reshape(b, t, h * dh))

    def _sow_pruning(self, q, k, log_fgate, threshold):
        cfg = self.cfg
        t = q.shape[1]
        bq = bk = min(cfg.attention_block, -(-t // 8) * 8)
        lam = jax.lax.stop_gradient(jnp.cumsum(log_fgate, axis=1))
        delta = acp.resolve_threshold(threshold, q, k, cfg.dim_per_head ** -0.5)
        starts = acp.kv_block_start(lam, delta, tq=t, block_q=bq, block_k=bk)
        stats = acp.pruning_stats(starts, tq=t, tk=t, block_q=bq, block_k=bk)
        self.sow("intermediates", "acp_fraction_skipped", stats["fraction_skipped"])
