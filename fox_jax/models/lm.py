"""FoX and Transformer language models (docs/design/fox_acp.md §2): the config, the presets, the modules.

    tokens → embed → N × [x + Attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] → RMSNorm → LM head

Untied embeddings, no biases except the forget gate's, no dropout, every matrix ~ N(0, 0.02).

Architectures (``ModelConfig.arch``):

* ``fox-llama``          FoX (LLaMA): forgetting attention, no RoPE, SwiGLU ratio 4.
* ``transformer-llama``  Transformer (LLaMA): softmax attention with RoPE (base 500000), SwiGLU ratio 4.
* ``fox-pro``            FoX (Pro): FoX (LLaMA) + QK-norm, output gate + output norm, KV-shift, SwiGLU ratio 3.5.
* ``transformer-pro``    Transformer (Pro): FoX (Pro) without forget gate and with RoPE.

Sizes (``preset``) follow §2.5 of the spec (125M/360M/760M; the labels count non-embedding parameters plus
one 50257 x d_model matrix) plus a ``tiny`` size that trains on a laptop CPU in minutes.

With ``ModelConfig.dcp`` every attention layer also prunes its context dynamically (docs/design/dcp.md §1;
see ``ForgettingAttentionLayer``), and the model fills ``ModelOutput.aux`` as ``GPT2`` does::

    out = LanguageModel(cfg).apply({"params": p}, tokens, segment_ids=seg, alpha=alpha)
    loss = ce(out.logits, targets) + gamma * out.aux["sparsity_loss"]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from fox_jax.config import (DTYPES, FINITE, GPT2_VOCAB, POSITIVE, POSITIVE_INT, Range,
                            check_ranges)
from fox_jax.decoding.cache import new_layer_cache
from fox_jax.models.family import FamilyConfig, ModelOutput, check_remat, dcp_aux, remat_block
from fox_jax.nn.attention import ForgettingAttentionLayer, LayerOutput
from fox_jax.nn.layers import RMSNorm, SwiGLU, normal_init

ARCHS = ("fox-llama", "transformer-llama", "fox-pro", "transformer-pro")
SIZES = ("tiny", "125M", "360M", "760M")


@dataclasses.dataclass(frozen=True)
class ModelConfig(FamilyConfig):
    """Hyper-parameters of a FoX / Transformer language model.

    Attributes:
      arch: one of ``ARCHS``.
      vocab_size: number of token ids the embedding accepts (the tokenizer's vocabulary, possibly padded).
      d_model: residual width d.
      n_layers: number of pre-norm blocks.
      n_heads: query heads H.
      n_kv_heads: key/value heads (GQA); ``None`` means ``n_heads``.
      head_dim: per-head width D; ``None`` means ``d_model // n_heads``.
      hidden_ratio: SwiGLU width factor; the MLP width is ``256*ceil(int(d*ratio*2/3)/256)`` (§2.1)
        unless ``mlp_dim`` is given.
      mlp_dim: explicit MLP width I (overrides ``hidden_ratio``).
      use_fgate: forget gate on (FoX) or off (Transformer).
      use_rope: rotary embeddings (Transformer baselines).
      rope_base: RoPE base (500000 in the paper's Transformer).
      qk_norm: per-head RMSNorm (eps 1e-5) of q and k (Pro).
      qk_norm_shared: one D-sized QK-norm scale shared by all heads (the paper's released runs).
      output_gate: o ← RMSNorm_head(o)·w ⊙ σ(W_g x) before W_o (Pro; the norm is ``output_norm``).
      output_norm: per-head RMSNorm of the attention output (eps ``norm_eps``).
      kv_shift: data-dependent token shift of keys and values, k_t = α_t k̃_{t−1} + (1 − α_t) k̃_t (Pro).
      norm_eps: RMSNorm epsilon (1e-6).
      init_std: std of the N(0, std) initialiser of every linear and the embedding (0.02).
      tie_embeddings: share the embedding with the LM head (the paper's models do not).
      dtype: compute dtype name (``"float32"`` or ``"bfloat16"``); params are always float32.
      attention_impl: ``implementation`` passed to ``fox_jax.ops.forgetting_attention``.
      attention_block: block size of the blockwise XLA attention.
      adaptive_threshold: ACP threshold passed to the op (``None`` = off, ``"auto"``, or a float <= 0).
      remat: activation rematerialisation per block: ``"none"``, ``"full"`` (save only block inputs)
        or ``"dots"`` (save matmul outputs, recompute the rest).
      dcp: Dynamic Context Pruning (docs/design/dcp.md §1): every attention layer gets bias-free float32
        interaction projections ``q_int``/``k_int`` [d, r] of its normed input and a scalar bias
        ``beta``; the cumulative keep log-mask is added to every head's logits (``dcp_attention``).
        A DCP model's ``apply`` needs ``alpha`` and fills ``ModelOutput.aux`` (see ``LanguageModel``).
        Not combinable with ``adaptive_threshold`` (ACP); decoding with caches is not implemented.
      interaction_dim: r, width of the interaction queries/keys (64, the paper's recipe, §1.1).
      dcp_beta_init: initial β of every layer (2.0, the reference train.py default, §1.1).
      dcp_impl: ``implementation`` of ``dcp_attention``: ``"xla"`` (blockwise, default) or ``"pallas"``
        (the Pallas kernels with the mask; interpret mode off GPU; not yet timed on a GPU).

    Raises:
      ValueError: from ``__post_init__``, naming the field: a numeric field outside ``RANGES``, an unknown
        choice, or an inconsistent combination (e.g. d_model not divisible by n_heads).
    """

    arch: str = "fox-llama"
    vocab_size: int = GPT2_VOCAB
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None
    head_dim: int | None = None
    hidden_ratio: float = 4.0
    mlp_dim: int | None = None
    use_fgate: bool = True
    use_rope: bool = False
    rope_base: float = 500000.0
    qk_norm: bool = False
    qk_norm_shared: bool = False
    output_gate: bool = False
    output_norm: bool = False
    kv_shift: bool = False
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_embeddings: bool = False
    dtype: str = "float32"
    attention_impl: str = "auto"
    attention_block: int = 128
    adaptive_threshold: Any = None
    remat: str = "none"
    dcp: bool = False
    interaction_dim: int = 64
    dcp_beta_init: float = 2.0
    dcp_impl: str = "xla"

    model_type: ClassVar[str] = "lm"
    LAYER_PREFIX: ClassVar[str] = "layers_"
    RANGES: ClassVar[dict[str, Range]] = dict(
        vocab_size=POSITIVE_INT, d_model=POSITIVE_INT, n_layers=POSITIVE_INT, n_heads=POSITIVE_INT,
        n_kv_heads=Range(1, integer=True, optional=True), head_dim=Range(1, integer=True, optional=True),
        hidden_ratio=POSITIVE, mlp_dim=Range(1, integer=True, optional=True), rope_base=Range(1, lo_open=True),
        norm_eps=POSITIVE, init_std=POSITIVE, attention_block=POSITIVE_INT, interaction_dim=POSITIVE_INT,
        dcp_beta_init=FINITE)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"ModelConfig.arch must be one of {ARCHS}, got {self.arch!r}")
        check_ranges(self, "ModelConfig.")
        threshold = self.adaptive_threshold
        if not (threshold is None or threshold == "auto" if isinstance(threshold, (str, type(None)))
                else Range(hi=0).accepts(threshold)):
            raise ValueError("ModelConfig.adaptive_threshold must be None, 'auto' or a finite number <= 0 (a log "
                             f"decay threshold), got {self.adaptive_threshold!r}")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads})")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                "unless head_dim is given")
        if self.use_rope and self.dim_per_head % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.dim_per_head}")
        check_remat(self.remat, "ModelConfig")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.dcp, bool):
            raise ValueError(f"ModelConfig.dcp must be a bool, got {self.dcp!r}")
        if self.dcp_impl not in ("xla", "pallas"):
            raise ValueError(f"ModelConfig.dcp_impl must be 'xla' or 'pallas', got {self.dcp_impl!r}")
        if self.dcp and self.adaptive_threshold is not None:
            raise ValueError("ModelConfig.adaptive_threshold (ACP) cannot be combined with dcp=True: DCP "
                             "attention (dcp_attention) does not implement ACP block pruning; set "
                             "adaptive_threshold=None")

    # Derived quantities -----------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        if self.mlp_dim is not None:
            return self.mlp_dim
        return 256 * math.ceil(int(self.d_model * self.hidden_ratio * 2 / 3) / 256)

    @property
    def max_positions(self) -> None:
        return None  # no learned positions: any length

    # ModelFamily ----------------------------------------------------------------------------------
    def build(self) -> LanguageModel:
        return LanguageModel(self)

    def param_count(self, *, include_embedding: bool = True, include_head: bool = True) -> int:
        """Exact number of parameters of the model this config builds (closed form, no init)."""
        d, h, hkv, dh, f = self.d_model, self.n_heads, self.kv_heads, self.dim_per_head, self.mlp_hidden
        attn = d * h * dh + 2 * d * hkv * dh + h * dh * d
        if self.use_fgate:
            attn += d * h + h
        if self.qk_norm:
            attn += dh * 2 if self.qk_norm_shared else (h + hkv) * dh
        if self.output_gate:
            attn += d * h * dh
        if self.output_norm:
            attn += h * dh
        if self.kv_shift:
            attn += 2 * d * hkv
        if self.dcp:
            attn += 2 * d * self.interaction_dim + 1  # q_int, k_int [d, r] and β
        mlp = d * 2 * f + f * d
        per_layer = attn + mlp + 2 * d
        n = self.n_layers * per_layer + d  # + final norm
        if include_embedding:
            n += self.vocab_size * d
        if include_head and not self.tie_embeddings:
            n += self.vocab_size * d
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token, dense-equivalent (spec §2.5): 2N + 2 n_layer d_attn L.

        N counts every matmul parameter (non-embedding params plus the LM head); the attention
        term uses the causal average context L/2 for both QK^T and PV (= 2 * n_layer * H*D * L).
        Training costs 3x this (forward + backward). With ``dcp`` the q_int/k_int projections are in N
        and the keep logits q_int·k_intᵀ add n_layer·r·L (causal average, no P·V analogue).
        """
        n = self.param_count(include_embedding=False, include_head=True)
        if self.tie_embeddings:
            n += self.vocab_size * self.d_model
        flops = 2.0 * n + 2.0 * self.n_layers * self.n_heads * self.dim_per_head * seq_len
        if self.dcp:
            flops += float(self.n_layers * self.interaction_dim * seq_len)
        return flops


    def init_cache(self, batch_size: int, capacity: int, *, seq_start=None, packed: bool = False) -> tuple:
        """Empty dense caches, one ``LayerKVCache`` per layer (k/v of ``kv_heads`` heads, forget gates for
        FoX, KV-shift states for Pro).

        Args:
          batch_size, capacity: B and C (C ≥ 1 columns).
          seq_start: optional [B] int left pads per row.
          packed: must be False (packed caches are DCP GPT-2's).

        Raises:
          NotImplementedError: a DCP config (decoding a DCP LanguageModel is not implemented).
          ValueError: ``packed``, a bad capacity or seq_start.
        """
        if self.dcp:
            raise NotImplementedError("decoding with caches is not implemented for DCP LanguageModels "
                                      "(ModelConfig.dcp=True); call the model on the full sequence")
        if packed:
            raise ValueError("packed (DCP) caches exist for GPT-2 with dcp=True only")
        layer = new_layer_cache(batch_size, capacity, n_heads=self.n_heads, kv_heads=self.kv_heads,
                                head_dim=self.dim_per_head, dtype=jnp.dtype(self.dtype), forget_gate=self.use_fgate,
                                kv_shift=self.kv_shift, seq_start=seq_start)
        return (layer,) * self.n_layers


_SIZES = {
    # name: (n_layers, d_model, n_heads, head_dim for transformer at this size)
    "tiny": dict(n_layers=4, d_model=128, n_heads=4),
    "125M": dict(n_layers=12, d_model=768, n_heads=12),
    "360M": dict(n_layers=24, d_model=1024, n_heads=16),
    "760M": dict(n_layers=24, d_model=1536, n_heads=24),
}


def preset(size: str = "125M", arch: str = "fox-llama", **overrides) -> ModelConfig:
    """A model config for one of ``SIZES`` and one of ``ARCHS`` (docs/design/fox_acp.md §2.5).

    The 760M Transformer uses 12 heads of dim 128 as in the paper; every other size uses head_dim 64
    (tiny: 4 heads of 32). ``overrides`` replace any field.

    Raises:
      ValueError: unknown size or arch.
    """
    if size not in _SIZES:
        raise ValueError(f"unknown model size {size!r}; expected one of {SIZES}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    kw: dict[str, Any] = dict(_SIZES[size])
    fox = arch.startswith("fox")
    pro = arch.endswith("pro")
    kw.update(arch=arch, use_fgate=fox, use_rope=not fox, hidden_ratio=3.5 if pro else 4.0,
              qk_norm=pro, output_gate=pro, output_norm=pro, kv_shift=pro)
    if size == "760M" and not fox:
        kw["n_heads"] = 12
    if size == "tiny":
        kw.update(vocab_size=GPT2_VOCAB)
    kw.update(overrides)
    return ModelConfig(**kw)


class Block(nn.Module):
    """One pre-norm block: h = x + Attn(RMSNorm(x)); out = h + MLP(RMSNorm(h)).

    Call args as ``ForgettingAttentionLayer`` (x is the residual stream here). Returns
    ``LayerOutput(out [B, T, d], cache: the updated ``LayerKVCache`` or None, log_mask: DCP's log I
    [B, T, T] float32 or None)``.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None, cache=None, alpha=None) -> LayerOutput:
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        h = RMSNorm(cfg.norm_eps, dtype, name="attn_norm")(x)
        attn = ForgettingAttentionLayer(cfg, name="attn")(h, segment_ids, positions, cache, alpha)
        x = x + attn.x
        h = RMSNorm(cfg.norm_eps, dtype, name="mlp_norm")(x)
        return attn.replace(x=x + SwiGLU(cfg.mlp_hidden, cfg.init_std, dtype, name="mlp")(h))


class LanguageModel(nn.Module):
    """A decoder-only LM: FoX (LLaMA) or Transformer (LLaMA), chosen by ``cfg.arch``.

    Call args:
      tokens: [B, T] int32 token ids (< cfg.vocab_size).
      segment_ids: [B, T] int32 or None: packed documents (attention never crosses them).
      positions: [B, T] int32 or None: position inside each document (used by RoPE only).
      cache: optional tuple of ``n_layers`` ``fox_jax.decoding.LayerKVCache`` (incremental decoding,
        ``fox_jax.decoding.generation``; ``cfg.init_cache``); then segment_ids and positions must be
        None. The T ≥ 1 tokens are appended to the cache (a prefill on a fresh cache, a chunk or a
        decode step on a live one); any split of a sequence gives the logits of one pass. Not
        supported with DCP.
      alpha: keyword-only, DCP only (as ``GPT2``): required when ``cfg.dcp``, ignored otherwise. α of
        the α-sigmoid (docs/design/dcp.md §2): a Python float ≥ 1, ``float('inf')`` for the inference step
        mask, or a traced float32 scalar (e.g. from ``cosine_alpha_schedule``; no recompile per value).
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
        a chunk that does not fit the cache capacity; DCP without ``alpha``.
      NotImplementedError: a cache with DCP (decoding a DCP LanguageModel is not implemented).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None, cache=None, *, alpha=None) -> ModelOutput:
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
        # decoding never differentiates; alpha goes positionally: nn.remat traces positional args
        block_cls = remat_block(Block, cfg.remat if cache is None else "none")
        outs = []
        for i, name in enumerate(cfg.layer_names):
            out = block_cls(cfg, name=name)(x, segment_ids, positions, None if cache is None else cache[i],
                                            alpha if cfg.dcp else None)
            x = out.x
            outs.append(out)
        x = RMSNorm(cfg.norm_eps, dtype, name="final_norm")(x)
        if cfg.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                              kernel_init=normal_init(cfg.init_std), name="lm_head")(x)
        if cfg.dcp:
            return ModelOutput(logits.astype(jnp.float32),
                               aux=dcp_aux(jnp.stack([o.log_mask for o in outs]), segment_ids))
        return ModelOutput(logits, cache=None if cache is None else tuple(o.cache for o in outs))


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
