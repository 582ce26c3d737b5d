"""FoX and Transformer language models (docs/design/fox_acp.md §2): the Flax modules of ``ModelConfig``.

    tokens → embed → N × [x + Attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] → RMSNorm → LM head

Untied embeddings, no biases except the forget gate's, no dropout, every matrix ~ N(0, 0.02).

The config, the architectures and the size presets are in ``fox_jax.config`` (``ModelConfig``, ``preset``).

With ``ModelConfig.dcp`` every attention layer also prunes its context dynamically (docs/design/dcp.md §1;
see ``ForgettingAttentionLayer``), and the model fills ``ModelOutput.aux`` as ``GPT2`` does::

    out = LanguageModel(cfg).apply({"params": p}, tokens, segment_ids=seg, alpha=alpha)
    loss = ce(out.logits, targets) + gamma * out.aux["sparsity_loss"]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fox_jax.config import ARCHS, SIZES, ModelConfig, preset, register_family
from fox_jax.models.family import (FamilyModules, ModelOutput, dcp_aux, embed_rows, remat_block, rows_only,
                                   scan_applies, scan_blocks)
from fox_jax.nn.attention import ForgettingAttentionLayer, LayerOutput
from fox_jax.nn.layers import RMSNorm, SwiGLU, normal_init
from fox_jax.ops.cross_entropy import padded_head
from fox_jax.ops.decode_mlp import decode_swiglu, swiglu_table


class Block(nn.Module):
    """One pre-norm block: h = x + Attn(RMSNorm(x)); out = h + MLP(RMSNorm(h)).

    Call args as ``ForgettingAttentionLayer`` (x is the residual stream here). Returns
    ``LayerOutput(out [B, T, d], cache: the updated ``SlotKVCache`` or None, log_mask: DCP's log I
    [B, T, T] float32 or None)``.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None, cache=None, alpha=None) -> LayerOutput:
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        if cache is None:
            x = rows_only(x)
        h = RMSNorm(cfg.norm_eps, dtype, name="attn_norm")(x)
        # with a cache the layer also gets x itself: a decode step may fold this norm into its projections
        attn = ForgettingAttentionLayer(cfg, name="attn")(h, segment_ids, positions, cache, alpha,
                                                          residual=None if cache is None else x)
        x = x + attn.x
        if cache is not None and x.shape[1] == 1 and self.has_variable("decode", "mlp_step"):
            # a decode step with the block's MLP in the decode layout (``mlp_tables``): norm and MLP as one op
            p = self.variables["params"]
            y = decode_swiglu(x, p["mlp_norm"]["scale"], self.get_variable("decode", "mlp_step")["gate_up"],
                              p["mlp"]["down_proj"]["kernel"].astype(dtype), eps=cfg.norm_eps)
            return attn.replace(x=x + y)
        h = RMSNorm(cfg.norm_eps, dtype, name="mlp_norm")(x)
        return attn.replace(x=x + SwiGLU(cfg.mlp_hidden, cfg.init_std, dtype, name="mlp")(h, cache is None))


class LMHead(nn.Module):
    """The untied LM head: logits = x · W, W [d, vocab_size] float32 (param ``kernel``, as ``nn.Dense``).

    The matmul runs in ``dtype`` on W zero-padded to ``padded_vocab(vocab_size, pad_multiple)`` columns
    (aligned GPU matmul shapes; ``fox_jax.ops.cross_entropy.padded_head``) and the logits are sliced
    back: the values equal ``nn.Dense``'s. Applied with a ``"decode"`` collection holding this module's ``kernel``
    (``head_table``: a decode loop's head, cast and padded once) it multiplies by that one instead (no gradient
    reaches the parameter through it: a collection for inference loops only).

    Call args: x [B, T, d]. Returns: [B, T, vocab_size] in ``dtype``.
    """

    vocab_size: int
    init_std: float = 0.02
    dtype: Any = jnp.float32
    pad_multiple: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", normal_init(self.init_std), (x.shape[-1], self.vocab_size), jnp.float32)
        if self.has_variable("decode", "kernel"):  # a decode loop's head, padded once before the loop (head_table)
            w = self.get_variable("decode", "kernel").astype(self.dtype)
        else:
            w = padded_head(kernel, self.dtype, self.pad_multiple)
        y = jax.lax.dot_general(x.astype(self.dtype), w, (((x.ndim - 1,), (0,)), ((), ())))
        return y[..., :self.vocab_size] if w.shape[1] > self.vocab_size else y


def mlp_tables(params, transposed: bool = False) -> dict:
    """The ``"decode"`` variables of the blocks' MLPs: for each block with an RMSNorm ``mlp_norm`` and a ``SwiGLU``
    ``mlp``, ``{"mlp_step": {"gate_up": W}}`` at the block's path, W the ``gate_proj`` kernel of ``params`` (pass the
    parameters cast as the decode loop applies them): the same array, [d, 2·hidden] (no copy), or with ``transposed``
    a copy [2, hidden, d] (``swiglu_table``; on an H100 the kernel read both layouts equally fast). With it a decode
    step (T = 1) runs the block's norm and MLP as one op (``fox_jax.ops.decode_mlp.decode_swiglu``: one Pallas kernel
    on GPU instead of XLA's four), the same numbers up to float32 summation order. Returns {} for a model without
    such blocks."""
    def walk(tree):
        if not isinstance(tree, Mapping):
            return {}
        out = {k: sub for k, v in tree.items() if (sub := walk(v))}
        mlp, norm = tree.get("mlp"), tree.get("mlp_norm")
        if isinstance(mlp, Mapping) and isinstance(norm, Mapping) and "scale" in norm and "gate_proj" in mlp:
            kernel = mlp["gate_proj"]["kernel"]
            out["mlp_step"] = {"gate_up": swiglu_table(kernel) if transposed else kernel}
        return out

    tables = walk(params)
    return {"decode": tables} if tables else {}


def head_table(params, pad_multiple: int = 128) -> dict:
    """The ``"decode"`` variable of an untied LM head: ``params["lm_head"]["kernel"]`` [d, V] in its own dtype,
    zero-padded to ``padded_vocab(V, pad_multiple)`` columns. Made once before a decode loop from the cast parameters
    (``fox_jax.decoding.decode_variables``), so that every step's head matmul reads rows that start 16-byte aligned
    (V = 50257 bf16 columns do not) without copying the head per step; ``LMHead`` multiplies by it and slices the
    logits back to V (the same numbers). Returns {} for a model without an untied head."""
    head = params.get("lm_head") if hasattr(params, "get") else None
    if not head or "kernel" not in head:
        return {}
    kernel = head["kernel"]
    return {"decode": {"lm_head": {"kernel": padded_head(kernel, kernel.dtype, pad_multiple)}}}


class LanguageModel(nn.Module):
    """A decoder-only LM: FoX (LLaMA) or Transformer (LLaMA), chosen by ``cfg.arch``.

    Call args:
      tokens: [B, T] int32 token ids (< cfg.vocab_size).
      segment_ids: [B, T] int32 or None: packed documents (attention never crosses them).
      positions: [B, T] int32 or None: position inside each document (used by RoPE only).
      cache: optional tuple of ``n_layers`` ``fox_jax.cache.SlotKVCache`` (incremental decoding,
        ``fox_jax.decoding``; ``cfg.init_cache``); then segment_ids and positions must be None. The
        T ≥ 1 tokens are appended to the cache (a prefill on a fresh cache, a chunk or a decode step on
        a live one) and see what the cache's policy lets them see; any split of a sequence gives the
        logits of one pass under that policy. DCP models decode with α = ∞ (alpha is ignored).
      alpha: keyword-only, DCP only (as ``GPT2``): required when ``cfg.dcp``, ignored otherwise. α of
        the α-sigmoid (docs/design/dcp.md §2): a Python float ≥ 1, ``float('inf')`` for the inference step
        mask, or a traced float32 scalar (e.g. from ``cosine_alpha_schedule``; no recompile per value).
      return_hidden: keyword-only; True skips the LM head and returns ``ModelOutput(logits=None,
        hidden=[B, T, d] final-normed hidden states in the compute dtype)``, for a loss that applies the
        head itself (``fox_jax.ops.cross_entropy.lm_head_cross_entropy`` with ``params["lm_head"]
        ["kernel"]``). Not with a cache or DCP.
      last_logits: keyword-only; True returns the logits of the last position only ([B, 1, vocab_size]):
        a prefill chunk that samples just the next token skips the head over the other T − 1 positions
        (the norm and head act per position, so the values equal the full call's last column).
    Returns:
      ``ModelOutput``: ``logits`` [B, T, vocab_size] in the compute dtype (cast to float32 for the
      loss), **float32** with DCP; ``cache`` the updated tuple of caches when one was given (else None);
      ``aux`` {} without DCP, with DCP exactly ``GPT2``'s:
        ``log_masks``      [n_layers, B, T, T] float32 log I per layer (0 kept, ≈ −92.1 dropped),
        ``sparsity``       [n_layers] float32 fraction of causal pairs dropped (no gradient, §3.2),
        ``sparsity_loss``  float32 scalar ``sparsity_loss(log_masks, 1.0, normalization="causal",
                           segment_ids=...)`` (§3.1; 0 when T < 3): multiply by γ and add to the CE.
    Raises:
      ValueError: a cache with the wrong number of layers, or together with segment_ids/positions;
        DCP without ``alpha`` and without a cache; ``return_hidden`` with a cache or DCP.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None, cache=None, *, alpha=None,
                 return_hidden: bool = False, last_logits: bool = False) -> ModelOutput:
        cfg = self.cfg
        if return_hidden and (cache is not None or cfg.dcp):
            raise ValueError("return_hidden=True is for training losses: not with a cache or a DCP model")
        if cfg.dcp and alpha is None and cache is None:
            raise ValueError("alpha is required when ModelConfig.dcp is True (use float('inf') for inference)")
        if cache is not None and len(cache) != cfg.n_layers:
            raise ValueError(f"cache must hold one cache per layer ({cfg.n_layers}), got {len(cache)}")
        dtype = jnp.dtype(cfg.dtype)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                         embedding_init=normal_init(cfg.init_std), name="embed")
        x = embed(tokens) if cache is not None else embed_rows(embed, tokens, dtype)  # rows only: family.rows_only
        layer_alpha = alpha if cfg.dcp else None
        if scan_applies(cfg, self, cache):
            x, log_masks = scan_blocks(self, Block(cfg, parent=None), cfg.layer_names, x,
                                       (segment_ids, positions, None, layer_alpha), cfg.remat)
        else:
            # decoding never differentiates; alpha goes positionally: nn.remat traces positional args
            block_cls = remat_block(Block, cfg.remat if cache is None else "none")
            outs = []
            for i, name in enumerate(cfg.layer_names):
                out = block_cls(cfg, name=name)(x, segment_ids, positions, None if cache is None else cache[i],
                                                layer_alpha)
                x = out.x
                outs.append(out)
            log_masks = jnp.stack([o.log_mask for o in outs]) if cfg.dcp and cache is None else None
        if last_logits:
            x = x[:, -1:]
        x = RMSNorm(cfg.norm_eps, dtype, name="final_norm")(x)
        if cache is None:
            x = rows_only(x)
        if return_hidden:
            return ModelOutput(None, hidden=x)
        if cfg.tie_embeddings:
            logits = embed.attend(x)
        else:
            # decoding multiplies by the head as stored: no per-step copy of a padded head (the padding only
            # aligns the training matmul's shapes)
            logits = LMHead(cfg.vocab_size, cfg.init_std, dtype, 1 if cache is not None else cfg.vocab_pad_multiple,
                            name="lm_head")(x)
        if cache is not None:  # decoding: no DCP masks (the cache's policy applied them); DCP logits are float32
            return ModelOutput(logits.astype(jnp.float32) if cfg.dcp else logits, cache=tuple(o.cache for o in outs))
        if cfg.dcp:
            return ModelOutput(logits.astype(jnp.float32), aux=dcp_aux(log_masks, segment_ids))
        return ModelOutput(logits)


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


class LanguageModelModules(FamilyModules):
    """The JAX side of ``ModelConfig``: ``LanguageModel`` and its dense decoding caches."""

    module = LanguageModel

    def cache_layout(self, cfg) -> dict:
        """k/v of ``kv_heads`` heads, forget gates for FoX, KV-shift states for Pro, k_int with DCP, and
        whether the logits are bounded by QK-norm weights."""
        return dict(n_heads=cfg.n_heads, kv_heads=cfg.kv_heads, head_dim=cfg.dim_per_head,
                    forget_gate=cfg.use_fgate, kv_shift=cfg.kv_shift,
                    interaction_dim=cfg.interaction_dim if cfg.dcp else None, qk_norm=cfg.qk_norm)


register_family(ModelConfig.model_type, LanguageModelModules())

__all__ = ["ARCHS", "SIZES", "Block", "LMHead", "LanguageModel", "ModelConfig", "count_params", "preset"]
