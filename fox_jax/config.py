"""Configuration: numeric field ranges, and the model configs of both families with their presets.

* ``Range`` / ``check_ranges``: what every config dataclass checks in ``__post_init__`` (these model
  configs and the training configs of ``fox_jax.train.config``).
* ``ModelConfig`` / ``preset``: FoX and Transformer (LLaMA, Pro) language models (``fox_jax.models.lm``).
* ``GPT2Config`` / ``gpt2_preset``: GPT-2 with optional DCP (``fox_jax.models.gpt2``).
* ``MODEL_TYPES`` / ``config_from_dict``: a saved model config back from its ``model_type`` tag.

Both model configs implement ``fox_jax.models.family.ModelFamily``. This module imports nothing of the
project and no JAX, so every layer may use it and the CLI's ``--help`` stays fast; the methods that need
JAX reach the Flax modules through ``register_family`` (see ``FamilyConfig``).

Architectures (``ModelConfig.arch``, docs/design/fox_acp.md §2):

* ``fox-llama``          FoX (LLaMA): forgetting attention, no RoPE, SwiGLU ratio 4.
* ``transformer-llama``  Transformer (LLaMA): softmax attention with RoPE (base 500000), SwiGLU ratio 4.
* ``fox-pro``            FoX (Pro): FoX (LLaMA) + QK-norm, output gate + output norm, KV-shift, SwiGLU ratio 3.5.
* ``transformer-pro``    Transformer (Pro): FoX (Pro) without forget gate and with RoPE.

Sizes (``preset``) follow §2.5 of the spec (125M/360M/760M; the labels count non-embedding parameters plus
one 50257 x d_model matrix) plus a ``tiny`` size that trains on a laptop CPU in minutes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, ClassVar

GPT2_VOCAB = 50257
REMAT_POLICIES = ("none", "full", "dots")  # ModelFamily.remat: no remat, save only block inputs, save matmul and attention outputs
DTYPES = ("float32", "bfloat16", "float16")  # compute dtype names (params are always float32)
DCP_IMPLS = ("auto", "xla", "pallas")  # dcp_impl: fox_jax.ops.context_pruning.IMPLEMENTATIONS
LOSS_IMPLS = ("logits", "chunked")  # ModelConfig.loss_impl


# Errors that name config fields ----------------------------------------------------------------

class FieldError(ValueError):
    """A ``ValueError`` about config fields: ``keys`` are the fields its message names, as written there
    (``steps``, ``optim.lr``, ``ModelConfig.d_model``), so a front end can name them its own way:
    ``fox-jax`` names the flag the user gave (``--steps``) or the ``key=value`` key (``renamed``)."""

    def __init__(self, message: str, *keys: str):
        super().__init__(message)
        self.keys = keys

    def renamed(self, name: Callable[[str], str | None]) -> str:
        """The message with each of ``keys`` replaced by ``name(key)`` (kept where that is None) wherever it
        stands as a whole name (not inside ``optim.warmup_steps`` or a path for ``steps``): a message names each
        of its keys only as the field."""
        text = str(self)
        for key in self.keys:
            new = name(key)
            if new is not None and new != key:
                text = re.sub(rf"(?<![\w./-]){re.escape(key)}(?![\w/])", lambda _: new, text)
        return text


def one_of(choices) -> str:
    """``choices`` for a message: ``a, b, c``."""
    return ", ".join(map(str, choices))


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
        return f"unset or {text}" if self.optional else text


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
      FieldError: ``"<prefix><field> must be <range>, got <value>"`` for the first field out of range.
    """
    for name, allowed in type(obj).RANGES.items():
        value = getattr(obj, name)
        if not allowed.accepts(value):
            raise FieldError(f"{prefix}{name} must be {allowed.describe()}, got {value!r}", prefix + name)


# Model families: the configs (jax-free) -----------------------------------------------------------

_FAMILY_MODULES: dict[str, Any] = {}


def register_family(model_type: str, modules: Any) -> None:
    """Register the jax side of a model family (a ``fox_jax.models.family.FamilyModules``) under its
    ``model_type``; ``fox_jax.models.lm`` and ``fox_jax.models.gpt2`` do this when imported."""
    _FAMILY_MODULES[model_type] = modules


def family_modules(model_type: str) -> Any:
    """The registered ``FamilyModules`` of ``model_type``.

    Raises:
      RuntimeError: nothing registered (``fox_jax.models`` was never imported).
    """
    if model_type not in _FAMILY_MODULES:
        raise RuntimeError(f"no model modules registered for model_type {model_type!r}: import fox_jax.models "
                           "(it registers the FoX/Transformer and GPT-2 modules)")
    return _FAMILY_MODULES[model_type]


class FamilyConfig:
    """The ``ModelFamily`` methods both families share (a mixin of the frozen config dataclasses).

    The methods that need JAX (``build``, ``init_params``, ``add_dcp_params``, ``init_cache``) are carried
    out by the family's ``FamilyModules``, which ``fox_jax.models`` registers with ``register_family``
    when it is imported; this module stays importable without JAX (``fox-jax --help`` imports it).

    Subclasses set ``model_type``, ``LAYER_PREFIX`` (params key of layer i is ``f"{LAYER_PREFIX}{i}"``)
    and ``LEGACY_KEYS`` (old field name -> new one, accepted by ``from_dict``).
    """

    model_type: ClassVar[str]
    LAYER_PREFIX: ClassVar[str]
    LEGACY_KEYS: ClassVar[dict[str, str]] = {}

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(f"{self.LAYER_PREFIX}{i}" for i in range(self.n_layers))

    def with_remat(self, policy: str):
        """The config with ``remat=policy``.

        Raises:
          ValueError: a policy not in ``REMAT_POLICIES``.
        """
        return self.replace(remat=policy)

    # The jax side (``fox_jax.models``: the Flax module, parameter init, DCP surgery, caches) --------
    def build(self):
        """The Flax module of this config: ``apply({"params": p}, tokens, segment_ids=None, positions=None,
        cache=None, *, alpha=None) -> ModelOutput`` (``fox_jax.models.family``)."""
        return family_modules(self.model_type).build(self)

    def init_params(self, rng, seq_len: int = 8) -> dict:
        """Fresh float32 parameters of ``self.build()`` as a plain nested dict (``FamilyModules.init_params``)."""
        return family_modules(self.model_type).init_params(self, rng, seq_len)

    def add_dcp_params(self, params: dict, rng, *, interaction_dim: int | None = None,
                       beta_init: float | None = None):
        """(the config with DCP, params with fresh interaction parameters) of a dense model
        (``FamilyModules.add_dcp_params``, docs/design/dcp.md §1.1, §4)."""
        return family_modules(self.model_type).add_dcp_params(self, params, rng, interaction_dim=interaction_dim,
                                                              beta_init=beta_init)

    def init_cache(self, batch_size: int, slots, *, policy="dense", seq_start=None,
                   max_context: int | None = None) -> tuple:
        """Empty per-layer decoding caches (``fox_jax.cache.SlotKVCache``) with ``slots`` per row under the
        cache ``policy`` (the family's ``FamilyModules.init_cache``)."""
        return family_modules(self.model_type).init_cache(self, batch_size, slots, policy=policy,
                                                          seq_start=seq_start, max_context=max_context)

    def cache_layout(self) -> dict:
        """What this model's decoding caches store and a cache policy may rely on (``FamilyModules.cache_layout``:
        n_heads, kv_heads, head_dim, forget_gate, kv_shift, interaction_dim, qk_norm), e.g. for
        ``CachePolicy.provable(cfg.cache_layout())``."""
        return family_modules(self.model_type).cache_layout(self)

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, **dataclasses.asdict(self)}

    @classmethod
    def current_names(cls, d: dict) -> dict:
        """A copy of ``d`` (config fields) with the legacy names of ``LEGACY_KEYS`` renamed and a boolean
        ``remat`` mapped to a policy (True -> "full", False -> "none").

        Raises:
          ValueError: a field given under both its old and its new name.
        """
        d = dict(d)
        for old, new in cls.LEGACY_KEYS.items():
            if old in d:
                if new in d:
                    raise ValueError(f"{cls.__name__}: both {old!r} and its new name {new!r} given")
                d[new] = d.pop(old)
        if isinstance(d.get("remat"), bool):
            d["remat"] = "full" if d["remat"] else "none"
        return d

    @classmethod
    def from_dict(cls, d: dict):
        """The config of ``to_dict`` output; also reads dicts without ``model_type`` and with the legacy
        names of ``LEGACY_KEYS`` (and GPT-2's boolean ``remat``: True -> "full", False -> "none").

        Raises:
          ValueError: a ``model_type`` of another family, a field given under both its old and new name,
            unknown fields, or values the config refuses.
        """
        d = cls.current_names(d)
        model_type = d.pop("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(f"{cls.__name__}.from_dict: model_type must be {cls.model_type!r}, got {model_type!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}.from_dict: unknown field(s) {', '.join(unknown)}")
        return cls(**d)


def check_remat(remat: Any, owner: str) -> None:
    """Raise ValueError unless ``remat`` is one of ``REMAT_POLICIES`` (``owner`` names the config)."""
    if remat not in REMAT_POLICIES:
        raise FieldError(f"{owner}.remat must be one of {one_of(REMAT_POLICIES)}, got {remat!r}", f"{owner}.remat")


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
        or ``"dots"`` (default: save the matmul and attention outputs, recompute the rest; with
        ``scan_layers`` the scanned body then stacks only those, not every elementwise intermediate).
      scan_layers: the training and scoring forward (no cache) runs the blocks as one ``jax.lax.scan``
        over their stacked parameters, so the step compiles one block whatever ``n_layers``
        (``fox_jax.models.family.scan_blocks``). Same values, same parameter layout (``layers_{i}``);
        decoding with a cache, ``init`` and ``capture_intermediates`` unroll. On by default: on one H200
        (2026-12-05, one call) the 760M FoX (Pro) step at 16k with ``remat="dots"`` compiles in 23.3 s
        instead of 140.4 s and runs at 464.7 ms against 466.8 ms unrolled without remat, in 21.0 instead
        of 30.0 GiB of XLA temp memory; scanned without remat it is slower (525 ms, 68 GiB)
        (benchmarks/NOTES.md, "Scanned layers"). On a CPU the tiny preset trains ~13% slower than
        unrolled without remat (7.1k against 8.2k tokens/s on 2 cores, the same losses):
        ``scan_layers=False, remat="none"`` there.
      dcp: Dynamic Context Pruning (docs/design/dcp.md §1): every attention layer gets bias-free float32
        interaction projections ``q_int``/``k_int`` [d, r] of its normed input and a scalar bias
        ``beta``; the cumulative keep log-mask is added to every head's logits (``dcp_attention``).
        A DCP model's ``apply`` needs ``alpha`` and fills ``ModelOutput.aux`` (see ``LanguageModel``).
        Not combinable with ``adaptive_threshold`` (ACP); decodes with the ``dcp`` cache policy (α = ∞).
      interaction_dim: r, width of the interaction queries/keys (64, the paper's recipe, §1.1).
      dcp_beta_init: initial β of every layer (2.0, the reference train.py default, §1.1).
      dcp_impl: ``implementation`` of ``dcp_attention`` (``DCP_IMPLS``): ``"auto"`` (default: the
        Pallas kernels on GPU, the blockwise XLA code elsewhere), ``"xla"`` or ``"pallas"`` (the
        kernels; interpret mode off GPU). Changes speed only, not the math.
      vocab_pad_multiple: the untied LM-head matmul runs on the vocabulary padded with zero columns
        to a multiple of this (128: 50257 -> 50304, aligned shapes for the GPU matmuls); the logits
        are sliced back to ``vocab_size``, so outputs, parameters and gradients are unchanged. 1 = no
        padding (the previous behaviour). Ignored with ``tie_embeddings``.
      loss_impl: how training/evaluation (``fox_jax.train.loop.LMTask``) compute the next-token loss:
        ``"logits"`` (the model's logits in the compute dtype, cast to float32, optax's cross-entropy;
        the previous behaviour) or ``"chunked"`` (``fox_jax.ops.cross_entropy.lm_head_cross_entropy``:
        LM head and cross-entropy fused, float32 logits one chunk of tokens at a time, no [tokens, V]
        float32 logits or gradient). ``"chunked"`` needs an untied head and no DCP (else ``"logits"``
        is used).
      loss_chunk: tokens per chunk of ``loss_impl="chunked"``.

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
    remat: str = "dots"
    scan_layers: bool = True
    dcp: bool = False
    interaction_dim: int = 64
    dcp_beta_init: float = 2.0
    dcp_impl: str = "auto"
    vocab_pad_multiple: int = 128
    loss_impl: str = "logits"
    loss_chunk: int = 8192

    model_type: ClassVar[str] = "lm"
    LAYER_PREFIX: ClassVar[str] = "layers_"
    RANGES: ClassVar[dict[str, Range]] = dict(
        vocab_size=POSITIVE_INT, d_model=POSITIVE_INT, n_layers=POSITIVE_INT, n_heads=POSITIVE_INT,
        n_kv_heads=Range(1, integer=True, optional=True), head_dim=Range(1, integer=True, optional=True),
        hidden_ratio=POSITIVE, mlp_dim=Range(1, integer=True, optional=True), rope_base=Range(1, lo_open=True),
        norm_eps=POSITIVE, init_std=POSITIVE, attention_block=POSITIVE_INT, interaction_dim=POSITIVE_INT,
        dcp_beta_init=FINITE, vocab_pad_multiple=POSITIVE_INT, loss_chunk=POSITIVE_INT)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise FieldError(f"ModelConfig.arch must be one of {one_of(ARCHS)}, got {self.arch!r}", "ModelConfig.arch")
        check_ranges(self, "ModelConfig.")
        threshold = self.adaptive_threshold
        if not (threshold is None or threshold == "auto" if isinstance(threshold, (str, type(None)))
                else Range(hi=0).accepts(threshold)):
            raise ValueError("ModelConfig.adaptive_threshold must be None, 'auto' or a finite number <= 0 (a log "
                             f"decay threshold), got {self.adaptive_threshold!r}")
        if self.n_heads % self.kv_heads:
            raise FieldError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of ModelConfig.n_kv_heads ({self.kv_heads})",
                "ModelConfig.n_heads", "ModelConfig.n_kv_heads")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise FieldError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by ModelConfig.n_heads ({self.n_heads}) "
                "unless ModelConfig.head_dim is given", "ModelConfig.d_model", "ModelConfig.n_heads",
                "ModelConfig.head_dim")
        if self.use_rope and self.dim_per_head % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.dim_per_head}")
        check_remat(self.remat, "ModelConfig")
        if self.dtype not in DTYPES:
            raise FieldError(f"ModelConfig.dtype must be float32, bfloat16 or float16, got {self.dtype!r}",
                             "ModelConfig.dtype")
        if not isinstance(self.dcp, bool):
            raise ValueError(f"ModelConfig.dcp must be a bool, got {self.dcp!r}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"ModelConfig.scan_layers must be a bool, got {self.scan_layers!r}")
        if self.dcp_impl not in DCP_IMPLS:
            raise FieldError(f"ModelConfig.dcp_impl must be one of {one_of(DCP_IMPLS)}, got {self.dcp_impl!r}",
                             "ModelConfig.dcp_impl")
        if self.loss_impl not in LOSS_IMPLS:
            raise FieldError(f"ModelConfig.loss_impl must be one of {one_of(LOSS_IMPLS)}, got {self.loss_impl!r}",
                             "ModelConfig.loss_impl")
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

    # ModelFamily (build, init_params, add_dcp_params, init_cache: FamilyConfig) ------------------
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
        raise ValueError(f"unknown model size {size!r}; expected one of {one_of(SIZES)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {one_of(ARCHS)}")
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


SPARSE_PATTERNS = ("local", "strided", "sinks")


def parse_sparse_pattern(pattern: str, *, name: str = "sparse_pattern") -> tuple[str, int, int]:
    """``"local:W"`` / ``"strided:S"`` / ``"sinks:S+W"`` -> ``(kind, size, sinks)``.

    Args:
      pattern: the pattern string: a kind of ``SPARSE_PATTERNS``, a colon, a positive int (``sinks``: the
        number of sink tokens S ≥ 0, a plus sign, the window W ≥ 1, as the ``sinks:S+W`` cache policy).
      name: the argument name used in error messages.

    Returns:
      (kind, size, sinks): kind "local", "strided" or "sinks"; size the window W or stride S (int ≥ 1);
      sinks the number of sink tokens (0 for local and strided).

    Raises:
      ValueError: not a string of that form (names ``name`` and the expected form).
    """
    expected = ("expected 'local:W', 'strided:S' or 'sinks:S+W' with positive ints W/S (sinks: S >= 0), e.g. "
                "'local:256', 'strided:64', 'sinks:4+252'")
    if not isinstance(pattern, str) or pattern.count(":") != 1:
        raise ValueError(f"{name} must be a string; {expected}; got {pattern!r}")
    kind, size = pattern.split(":")
    kind = kind.strip()
    if kind not in SPARSE_PATTERNS:
        raise ValueError(f"{name}: unknown pattern kind {kind!r}; {expected}; got {pattern!r}")
    parts = size.split("+") if kind == "sinks" else [size]
    if len(parts) != (2 if kind == "sinks" else 1):
        raise ValueError(f"{name}: {size!r} is not of the form S+W; {expected}; got {pattern!r}")
    try:
        values = [int(v) for v in parts]
    except ValueError:
        raise ValueError(f"{name}: {size!r} is not an int; {expected}; got {pattern!r}") from None
    sinks, value = (values[0], values[1]) if kind == "sinks" else (0, values[0])
    if value < 1 or sinks < 0:
        raise ValueError(f"{name}: the window/stride must be >= 1 (and sinks >= 0); {expected}; got {pattern!r}")
    return kind, value, sinks


@dataclasses.dataclass(frozen=True)
class GPT2Config(FamilyConfig):
    """Hyper-parameters of GPT-2 plus the DCP fields (field names shared with ``ModelConfig``).

    Hugging Face's names (``n_layer``, ``n_head``, ``n_embd``, ``n_inner``, ``layer_norm_epsilon``) and
    the old ``beta_init`` / boolean ``remat`` are accepted by ``from_dict`` (``LEGACY_KEYS``); HF's
    ``config.json`` keeps its own names (``fox_jax.models.hf_gpt2``).

    Attributes:
      n_layers, n_heads, d_model: depth, heads, width d (d_model divisible by n_heads).
      vocab_size: token ids accepted (50257 for the GPT-2 BPE).
      n_positions: learned positions, the maximum sequence length (1024).
      mlp_dim: MLP width; ``None`` means 4·d_model (``mlp_hidden`` is the width used).
      norm_eps: LayerNorm ε (1e-5).
      init_std: std of the N(0, std) initialiser (0.02); residual projections (``c_proj``) use
        std/√(2·n_layers), as HF does.
      dtype: compute dtype name ("float32", "bfloat16", "float16"); params are float32. LayerNorm,
        the interaction branch, the mask and the logits are float32 in every case.
      attention_impl: ``implementation`` of ``fox_jax.ops.forgetting_attention`` for the dense
        (non-DCP) path ("auto", "xla", "dense", ...).
      attention_block: tile size of the blockwise DCP attention (``dcp_attention``).
      remat: rematerialisation of each block in the backward pass: "none", "full" (save only the
        block inputs) or "dots" (default: save the matmul and attention outputs).
      scan_layers: the forward without a cache runs the blocks as one ``jax.lax.scan`` (as
        ``ModelConfig.scan_layers``, on by default for the same reason; same values and parameter
        layout ``h_{i}``).
      dcp: Dynamic Context Pruning on (adds q_int, k_int, β per layer; ``apply`` needs ``alpha``).
      interaction_dim: r, width of the interaction queries/keys (64 in the paper's recipe).
      dcp_beta_init: initial β of every layer (2.0, the reference train.py default).
      dcp_impl: ``implementation`` of ``dcp_attention`` for the DCP and sparse-pattern paths
        (``DCP_IMPLS``): ``"auto"`` (default: Pallas kernels on GPU, blockwise XLA elsewhere),
        ``"xla"`` or ``"pallas"`` (kernels; interpret mode off GPU).
      sparse_pattern: ``None`` (default: full causal attention), or a fixed sparse attention pattern
        for a dense model: ``"local:W"``, ``"strided:S"`` or ``"sinks:S+W"`` (see the module docstring of
        ``fox_jax.models.gpt2`` and ``sparse_pattern_log_mask``). Not combinable with ``dcp``; training and
        prefill only (no decoding cache). Not stored in HF checkpoints: pass it as an override
        (``load_hf_gpt2(path, sparse_pattern="local:256")``).

    Raises:
      ValueError: from ``__post_init__``, naming the field: a numeric field outside ``RANGES``, an unknown
        choice, or an inconsistent combination (d_model not divisible by n_heads, DCP with a pattern).
    """

    n_layers: int = 12
    n_heads: int = 12
    d_model: int = 768
    vocab_size: int = GPT2_VOCAB
    n_positions: int = 1024
    mlp_dim: int | None = None
    norm_eps: float = 1e-5
    init_std: float = 0.02
    dtype: str = "float32"
    attention_impl: str = "auto"
    attention_block: int = 128
    remat: str = "dots"
    scan_layers: bool = True
    dcp: bool = False
    interaction_dim: int = 64
    dcp_beta_init: float = 2.0
    sparse_pattern: str | None = None
    dcp_impl: str = "auto"

    model_type: ClassVar[str] = "gpt2"
    LAYER_PREFIX: ClassVar[str] = "h_"
    LEGACY_KEYS: ClassVar[dict[str, str]] = dict(
        n_layer="n_layers", n_head="n_heads", n_embd="d_model", n_inner="mlp_dim", layer_norm_epsilon="norm_eps",
        beta_init="dcp_beta_init")
    RANGES: ClassVar[dict[str, Range]] = dict(
        n_layers=POSITIVE_INT, n_heads=POSITIVE_INT, d_model=POSITIVE_INT, vocab_size=POSITIVE_INT,
        n_positions=POSITIVE_INT, mlp_dim=Range(1, integer=True, optional=True), norm_eps=POSITIVE,
        init_std=POSITIVE, attention_block=POSITIVE_INT, interaction_dim=POSITIVE_INT, dcp_beta_init=FINITE)

    def __post_init__(self):
        check_ranges(self, "GPT2Config.")
        if self.d_model % self.n_heads:
            raise FieldError(f"GPT2Config.d_model ({self.d_model}) must be divisible by GPT2Config.n_heads "
                             f"({self.n_heads})", "GPT2Config.d_model", "GPT2Config.n_heads")
        if self.dtype not in DTYPES:
            raise FieldError(f"GPT2Config.dtype must be one of {one_of(DTYPES)}, got {self.dtype!r}", "GPT2Config.dtype")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"GPT2Config.scan_layers must be a bool, got {self.scan_layers!r}")
        check_remat(self.remat, "GPT2Config")
        if self.sparse_pattern is not None:
            parse_sparse_pattern(self.sparse_pattern, name="GPT2Config.sparse_pattern")
            if self.dcp:
                raise ValueError(f"GPT2Config.sparse_pattern={self.sparse_pattern!r} needs dcp=False: a fixed "
                                 "pattern replaces the learned DCP mask (use one or the other)")
        if self.dcp_impl not in DCP_IMPLS:
            raise FieldError(f"GPT2Config.dcp_impl must be one of {one_of(DCP_IMPLS)}, got {self.dcp_impl!r}",
                             "GPT2Config.dcp_impl")

    @property
    def dim_per_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_dim or 4 * self.d_model

    @property
    def max_positions(self) -> int:
        return self.n_positions

    # ModelFamily (build, init_params, add_dcp_params, init_cache: FamilyConfig) ------------------
    def param_count(self) -> int:
        """Exact parameter count of the model this config builds (tied head counted once)."""
        d, f, n = self.d_model, self.mlp_hidden, self.n_layers
        per_layer = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        if self.dcp:
            per_layer += 2 * d * self.interaction_dim + 1
        return (self.vocab_size + self.n_positions) * d + n * per_layer + 2 * d

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token, dense-equivalent, as ``ModelConfig.flops_per_token``: 2N + 2·n_layers·d·L.

        N counts every parameter but the position embedding (the tied head is a matmul with the token
        embedding); the attention term uses the causal average context L/2 for both QKᵀ and PV. With
        DCP the keep logits q_int·k_intᵀ add n_layers·r·L. Training costs 3x this.
        """
        n = self.param_count() - self.n_positions * self.d_model
        flops = 2.0 * n + 2.0 * self.n_layers * self.d_model * seq_len
        if self.dcp:
            flops += float(self.n_layers * self.interaction_dim * seq_len)
        return flops


GPT2_SIZES = {
    "gpt2": dict(n_layers=12, n_heads=12, d_model=768),
    "gpt2-medium": dict(n_layers=24, n_heads=16, d_model=1024),
    "gpt2-large": dict(n_layers=36, n_heads=20, d_model=1280),
    "gpt2-xl": dict(n_layers=48, n_heads=25, d_model=1600),
}


def gpt2_preset(name: str = "gpt2", **overrides) -> GPT2Config:
    """The config of a released GPT-2 size (docs/design/dcp.md §4: small/medium/large/XL).

    Raises:
      ValueError: unknown name (one of ``GPT2_SIZES``).
    """
    if name not in GPT2_SIZES:
        raise ValueError(f"unknown GPT-2 size {name!r}; expected one of {one_of(GPT2_SIZES)}")
    return GPT2Config(**{**GPT2_SIZES[name], **overrides})


MODEL_TYPES: dict[str, type] = {"lm": ModelConfig, "gpt2": GPT2Config}


def config_from_dict(d: dict) -> ModelConfig | GPT2Config:
    """The model config of a ``to_dict`` dict, by its ``model_type`` ("lm" when the dict has none).

    Raises:
      ValueError: an unknown ``model_type`` (the message lists ``MODEL_TYPES``), or fields the config
        refuses (see ``FamilyConfig.from_dict``).
    """
    model_type = d.get("model_type", "lm")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {one_of(MODEL_TYPES)}, got {model_type!r}")
    return MODEL_TYPES[model_type].from_dict(d)
