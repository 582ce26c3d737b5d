"""Model configuration: one frozen dataclass and the paper's size presets.

Architectures (docs/design/fox_acp.md §2):

* ``fox-llama``          FoX (LLaMA): forgetting attention, no RoPE, SwiGLU ratio 4.
* ``transformer-llama``  Transformer (LLaMA): softmax attention with RoPE (base 500000), SwiGLU ratio 4.
* ``fox-pro``            FoX (Pro): FoX (LLaMA) + QK-norm, output gate + output norm, KV-shift, SwiGLU ratio 3.5.
* ``transformer-pro``    Transformer (Pro): FoX (Pro) without forget gate and with RoPE.

Sizes follow §2.5 of the spec (125M/360M/760M; the labels count non-embedding parameters plus one
50257 x d_model matrix) plus a ``tiny`` size that trains on a laptop CPU in minutes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

ARCHS = ("fox-llama", "transformer-llama", "fox-pro", "transformer-pro")
SIZES = ("tiny", "125M", "360M", "760M")
GPT2_VOCAB = 50257
REMAT_POLICIES = ("none", "full", "dots")


# Numeric ranges of config fields ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric config field accepts.

    Attributes:
      lo, hi: bounds (None = unbounded); ``lo_open`` / ``hi_open`` exclude them.
      integer: the value must be an ``int`` (``bool`` is refused); otherwise an int or a finite float.
      optional: ``None`` is accepted too (a default resolved later).
    """

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    optional: bool = False

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value < self.lo or self.lo_open and value == self.lo):
            return False
        return self.hi is None or not (value > self.hi or self.hi_open and value == self.hi)

    def describe(self) -> str:
        kind = "an int" if self.integer else "a finite number"
        if self.lo is not None and self.hi is not None:
            text = (f"{kind} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                    f"{')' if self.hi_open else ']'}")
        elif self.lo is not None:
            text = f"{kind} {'>' if self.lo_open else '>='} {self.lo:g}"
        elif self.hi is not None:
            text = f"{kind} {'<' if self.hi_open else '<='} {self.hi:g}"
        else:
            text = kind
        return f"None or {text}" if self.optional else text


POSITIVE_INT = Range(1, integer=True)
NON_NEGATIVE_INT = Range(0, integer=True)
POSITIVE = Range(0, lo_open=True)
NON_NEGATIVE = Range(0)
FINITE = Range()


def check_ranges(obj: Any, prefix: str = "") -> None:
    """Check every field named in ``type(obj).RANGES`` (a dict field name -> ``Range``).

    The config dataclasses call this from ``__post_init__``, so every way of building one (presets,
    ``key=value`` overrides, flags, saved JSON) is checked once.

    Raises:
      ValueError: ``"<prefix><field> must be <range>, got <value>"`` for the first field out of range.
    """
    for name, allowed in type(obj).RANGES.items():
        value = getattr(obj, name)
        if not allowed.accepts(value):
            raise ValueError(f"{prefix}{name} must be {allowed.describe()}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
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
        A DCP model's ``apply`` needs ``alpha`` and returns ``(logits, aux)`` (see ``LanguageModel``).
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
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
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

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

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
