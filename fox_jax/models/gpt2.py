"""GPT-2 in Flax Linen, with optional Dynamic Context Pruning (docs/design/dcp.md §1, §4).

The architecture is Hugging Face's ``GPT2LMHeadModel`` (Radford et al. 2019): learned absolute
positions (n_positions = 1024), pre-norm blocks with LayerNorm (ε = 1e-5), fused ``c_attn``
projection with biases, GELU with the tanh approximation ("gelu_new"), MLP width 4d, a final
LayerNorm and the LM head tied to the token embedding. Dropout is not implemented (the DCP recipe
fine-tunes with dropout 0). Parameter names mirror the HF module names so that
``fox_jax.models.hf_gpt2`` maps checkpoints one to one (HF's Conv1D stores its weight [in, out],
exactly a Flax ``Dense`` kernel):

    wte/embedding [V, d]   wpe/embedding [P, d]   ln_f/{scale, bias}
    h_{i}/ln_1, ln_2/{scale, bias}
    h_{i}/attn/c_attn/{kernel [d, 3d], bias}   h_{i}/attn/c_proj/{kernel [d, d], bias}
    h_{i}/mlp/c_fc/{kernel [d, 4d], bias}      h_{i}/mlp/c_proj/{kernel [4d, d], bias}
    DCP only:  h_{i}/attn/q_int/kernel [d, r]   h_{i}/attn/k_int/kernel [d, r]   h_{i}/attn/beta []

With ``cfg.dcp`` each layer computes, from the same LayerNorm'd input as ``c_attn`` and in float32,
keep logits z = q_int·k_intᵀ/√r + β, the cumulative keep mask log I (α-sigmoid with the ``alpha``
passed to ``apply``) once per layer, and adds it to every head's logits (``dcp_attention``).

With ``cfg.sparse_pattern`` (a dense, non-DCP model) every layer instead adds a **fixed** 0/−inf
log-mask — the local-window and strided baselines of the DCP paper (docs/design/dcp.md §4 "baselines in
paper", §6 attention.png) — through the same ``dcp_attention``, so fully dropped tiles are skipped:

    "local:W"    query i sees keys j with i − W < j ≤ i (its last W keys, itself included)
    "strided:S"  query i sees keys j ≤ i with i − j < S (a local window of S) **or** j ≡ S − 1 (mod S)
                 (every S-th key is a "summary" column visible to all later queries): the local part of
                 Child et al. 2019's "strided" pattern plus the one-column summary (c = 1) of their
                 "fixed" pattern, with summary positions counted from the start of the sequence.
    "sinks:S+W"  query i sees keys j ≤ i with i − j < W **or** j < S: a local window of W plus the first S
                 tokens ("attention sinks", Xiao et al. 2023), the same visibility as the ``sinks:S+W``
                 cache policy, so a model fine-tuned with it decodes exactly under that policy.

Positions are indices in the sequence (0..T−1). All three patterns are monotone in the query (a key that
leaves a query's view never comes back), so like DCP they correspond to a KV cache that frees
entries. ``sparse_pattern_sparsity`` gives the exact fraction of causal pairs dropped and
``match_sparse_pattern`` the window/stride closest to a target sparsity.

Usage (pure functional)::

    params = cfg.init_params(rng)
    out = GPT2(cfg).apply({"params": params}, tokens, alpha=alpha)       # a ModelOutput
    loss = ce(out.logits, targets) + gamma * out.aux["sparsity_loss"]  # DCP fine-tuning
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fox_jax.config import GPT2_SIZES, SPARSE_PATTERNS, GPT2Config, gpt2_preset, parse_sparse_pattern, register_family
from fox_jax.cache.slots import cache_columns, fuses_step, slot_attention
from fox_jax.cache.visibility import LayerFacts
from fox_jax.models.family import (FamilyModules, ModelOutput, dcp_aux, embed_rows, remat_block, rows_only,
                                   scan_applies, scan_blocks)
from fox_jax.nn.attention import LayerOutput
from fox_jax.nn.layers import DenseParams, LayerNorm, split_dense
from fox_jax.ops.context_pruning import cumulative_keep_log_mask, dcp_attention, keep_logits
from fox_jax.ops.forgetting_attention import forgetting_attention
from fox_jax.ops.head_ops import HeadOps


# ---------------------------------------------------------------------------------------------
# Fixed sparse attention patterns (the local-window and strided baselines of DCP, docs/design/dcp.md §4)
# ---------------------------------------------------------------------------------------------

def sparse_pattern_keep(pattern: str, seq_len: int, *, xp=jnp):
    """Which causal (query i, key j) pairs a fixed pattern keeps (module docstring for the rules).

    Args:
      pattern: ``"local:W"`` (keep i − W < j ≤ i), ``"strided:S"`` (keep j ≤ i with i − j < S or
        j mod S = S − 1) or ``"sinks:S+W"`` (keep j ≤ i with i − j < W or j < S).
      seq_len: T, positions 0..T−1 (queries and keys of one sequence).
      xp: ``jax.numpy`` (default, traceable: no [T, T] constant is embedded) or ``numpy``.

    Returns:
      [T, T] bool (queries on axis 0, keys on axis 1); False above the diagonal, True on it.

    Raises:
      ValueError: bad pattern or seq_len < 1.
    """
    kind, size, sinks = parse_sparse_pattern(pattern)
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    i = xp.arange(seq_len)[:, None]
    j = xp.arange(seq_len)[None, :]
    keep = (j <= i) & (i - j < size)
    if kind == "strided":
        keep = keep | ((j <= i) & (j % size == size - 1))
    elif kind == "sinks":
        keep = keep | ((j <= i) & (j < sinks))
    return keep


def sparse_pattern_log_mask(pattern: str, seq_len: int) -> jax.Array:
    """The additive log-mask of a fixed pattern, in the form ``dcp_attention`` takes (docs/design/dcp.md §1.4).

    Args:
      pattern: ``"local:W"``, ``"strided:S"`` or ``"sinks:S+W"`` (``sparse_pattern_keep``).
      seq_len: T.

    Returns:
      [T, T] float32: 0 for kept causal pairs and on/above the diagonal (the causal mask is added by
      the attention op), −inf for dropped pairs — exactly like an eval-mode DCP mask log I.

    Raises:
      ValueError: bad pattern or seq_len.
    """
    keep = sparse_pattern_keep(pattern, seq_len)
    upper = jnp.arange(seq_len)[None, :] >= jnp.arange(seq_len)[:, None]
    return jnp.where(keep | upper, 0.0, -jnp.inf).astype(jnp.float32)


def _kept_pairs(kind: str, size: int, seq_len: int, sinks: int = 0) -> int:
    """Strictly causal pairs (j < i) a pattern keeps, in closed form per query row (exact, int)."""
    i = np.arange(seq_len, dtype=np.int64)
    kept = np.minimum(i, size - 1)                                   # the window j ∈ [i−size+1, i−1]
    if kind == "strided":                                            # columns j ≤ i−S with j ≡ S−1 (mod S)
        kept = kept + np.maximum((i + 1) // size - 1, 0)
    elif kind == "sinks":                                            # sinks j < S left of the window: j ≤ i−W
        kept = kept + np.clip(i - size + 1, 0, sinks)
    return int(kept.sum())


def sparse_pattern_sparsity(pattern: str, seq_len: int) -> float:
    """Exact fraction of strictly causal (query, key) pairs a fixed pattern drops (docs/design/dcp.md §3.2).

        sparsity = 1 − kept / (T(T−1)/2),   kept = Σ_i #{j < i kept for query i}

    the same definition as ``fox_jax.ops.context_pruning.sparsity`` (one sequence, no documents).
    Closed form: local W keeps min(i, W−1) keys before query i; strided S keeps min(i, S−1) window keys
    plus max(⌊(i+1)/S⌋ − 1, 0) summary columns; sinks S+W keeps min(i, W−1) window keys plus
    clip(i − W + 1, 0, S) sinks.

    Args:
      pattern: ``"local:W"``, ``"strided:S"`` or ``"sinks:S+W"``.
      seq_len: T ≥ 1 (0 is returned for T = 1: no causal pair).

    Returns:
      float in [0, 1].

    Raises:
      ValueError: bad pattern or seq_len.
    """
    kind, size, sinks = parse_sparse_pattern(pattern)
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    pairs = seq_len * (seq_len - 1) // 2
    return 0.0 if pairs == 0 else 1.0 - _kept_pairs(kind, size, seq_len, sinks) / pairs


def match_sparse_pattern(kind: str, target: float, seq_len: int, *, sinks: int = 4) -> tuple[str, float]:
    """The window/stride of ``kind`` whose exact sparsity at length T is closest to ``target``.

    Exhaustive over sizes 1..T (``sparse_pattern_sparsity``, O(T²) integer work): local sparsity falls
    monotonically from 1 at W = 1 (only the token itself) to 0 at W = T, so the result is within one
    window step of the target; strided sparsity is 0 at S = 1 (every key is a summary column),
    peaks near S ≈ √(T/2) (≈ 91% at T = 1024) and falls to 0 at S = T, so targets above the peak get
    the sparsest stride; sinks S+W (S fixed) falls with W like local, from slightly below 1 at W = 1.
    Ties go to the larger size (the denser, more local pattern).

    Args:
      kind: "local", "strided" or "sinks".
      target: the sparsity to match, in [0, 1] (e.g. a DCP model's measured sparsity).
      seq_len: T ≥ 2.
      sinks: S of a ``sinks`` pattern (the window W is matched), ≥ 0; unused by the other kinds.

    Returns:
      (pattern string, its exact sparsity).

    Raises:
      ValueError: unknown kind, target outside [0, 1] or not finite, seq_len < 2.
    """
    if kind not in SPARSE_PATTERNS:
        raise ValueError(f"kind must be one of {SPARSE_PATTERNS}, got {kind!r}")
    if not isinstance(target, (int, float, np.floating)) or not 0.0 <= float(target) <= 1.0:
        raise ValueError(f"target must be a sparsity in [0, 1], got {target!r}")
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    if kind == "sinks" and (not isinstance(sinks, (int, np.integer)) or sinks < 0):
        raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")
    pairs = seq_len * (seq_len - 1) // 2
    best = None
    for size in range(1, seq_len + 1):
        sp = 1.0 - _kept_pairs(kind, size, seq_len, sinks if kind == "sinks" else 0) / pairs
        err = abs(sp - float(target))
        if best is None or err <= best[0]:
            best = (err, size, sp)
    return (f"sinks:{sinks}+{best[1]}" if kind == "sinks" else f"{kind}:{best[1]}"), best[2]


def _layer_norm(cfg: GPT2Config, name: str) -> LayerNorm:
    return LayerNorm(eps=cfg.norm_eps, name=name)


def _dense(cfg: GPT2Config, features: int, name: str, *, std: float | None = None, use_bias: bool = True,
           dtype=None) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, dtype=dtype or jnp.dtype(cfg.dtype), param_dtype=jnp.float32,
                    kernel_init=nn.initializers.normal(std if std is not None else cfg.init_std),
                    bias_init=nn.initializers.zeros, name=name)


DECODE_QKV = "parts"
"""How a decode step (T = 1 on a cache whose decode kernel takes the layer's projections: ``fuses_step``) of at most
``PARTS_MAX_ROWS`` rows hands c_attn's output to the decode op: ``"parts"``, c_attn as ``QKV_PARTS`` float32 partial
sums (``split_dense``) and its bias, both added by the decode kernel as it loads them (``HeadOps.rows``,
``HeadOps.rows_bias``), so that no kernel runs between c_attn's GEMM and attention; ``"plain"``, q, k and v as three
arrays (XLA slices c_attn's output into them in a kernel of its own, where its autotuner's split-K reduction and the
bias also go; also the path of larger batches). The same values up to float32 summation order. On an H100
(2026-12-07, B32 896 + 64, one process): 0.786 → 0.765 ms of kernels per step, 131 → 119 kernels, the same tokens
(benchmarks/results/decode/gpt2_qkv_residual_variants_h100_1207.json). A module setting, read when a program is
traced (``benchmarks/profile_decode.py --kernel-variants x:qkv=plain``)."""
QKV_PARTS, PARTS_MAX_ROWS = 4, 64
"""``DECODE_QKV = "parts"``: the split of c_attn's inner dimension (XLA's own split-K pick for GPT-2 124M's B32 step
on an H100) and the most rows (B·T) a decode step uses it for."""


class GPT2Attention(nn.Module):
    """Causal multi-head self-attention, optionally with the DCP interaction mask.

    Input [B, T, d] (LayerNorm'd, compute dtype); returns ``LayerOutput(x [B, T, d], cache, log_mask)``:
    ``log_mask`` is log I [B, T, T] float32 with DCP, the fixed 0/−inf pattern mask with
    ``cfg.sparse_pattern``, else None. With a ``cache`` (decoding, see ``GPT2``) ``cache`` is the updated
    ``fox_jax.cache.SlotKVCache``, whose policy decides what each query sees (``dcp``: the step mask of
    the interaction keys, DCP models only; ``dense`` attends to every token, also for a DCP model).
    """

    cfg: GPT2Config

    @nn.compact
    def __call__(self, x, segment_ids=None, cache=None, alpha=None) -> LayerOutput:
        cfg = self.cfg
        b, t, d = x.shape
        h, dh = cfg.n_heads, cfg.dim_per_head
        ops = None  # a fused decode step's c_attn output as the decode kernel reads it (``DECODE_QKV``)
        rows = (b, t, 3 * h, dh)
        if cache is not None and DECODE_QKV == "parts" and b * t <= PARTS_MAX_ROWS \
                and d % (16 * QKV_PARTS) == 0 and fuses_step(cache, t, False):
            kernel, bias = DenseParams(3 * d, True, cfg.init_std, name="c_attn")(d)
            dtype = jnp.dtype(cfg.dtype)
            bias = bias.astype(dtype)
            parts = split_dense(x, kernel, dtype, QKV_PARTS)                             # [S, B, T, 3d] float32
            qkv = jnp.sum(parts, axis=0).astype(dtype) + bias  # the XLA path's (unread on the kernel's)
            ops = HeadOps(rows=parts.reshape(QKV_PARTS, *rows), rows_bias=bias.reshape(rows[2:]))
        else:
            qkv = _dense(cfg, 3 * d, "c_attn")(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, dh) for a in (q, k, v))
        log_mask = q_int = k_int = beta = None
        if cfg.dcp:
            xf = x.astype(jnp.float32)
            q_int = _dense(cfg, cfg.interaction_dim, "q_int", use_bias=False, dtype=jnp.float32)(xf)
            k_int = _dense(cfg, cfg.interaction_dim, "k_int", use_bias=False, dtype=jnp.float32)(xf)
            beta = self.param("beta", nn.initializers.constant(cfg.dcp_beta_init), (), jnp.float32)
        if cache is not None:  # decoding: the cache's policy decides what each query sees
            o, cache = slot_attention(cache, q, k, v, None, head_ops=ops,
                                      facts=LayerFacts(q_int=q_int, k_int=k_int, beta=beta))
        elif cfg.dcp:
            z = keep_logits(q_int, k_int, beta)                         # [B, T, T] float32
            log_mask = cumulative_keep_log_mask(z, alpha)               # once per layer, all heads
            o = dcp_attention(q, k, v, log_mask, segment_ids=segment_ids,
                              block_q=cfg.attention_block, block_k=cfg.attention_block,
                              implementation=cfg.dcp_impl)
        elif cfg.sparse_pattern is not None:
            # A fixed local/strided pattern as a 0/−inf additive mask; dropped tiles are skipped.
            log_mask = jnp.broadcast_to(sparse_pattern_log_mask(cfg.sparse_pattern, t)[None], (b, t, t))
            o = dcp_attention(q, k, v, log_mask, segment_ids=segment_ids,
                              block_q=cfg.attention_block, block_k=cfg.attention_block,
                              implementation=cfg.dcp_impl)
        else:
            # Plain causal softmax attention: the forgetting-attention op without forget gates.
            o = forgetting_attention(q, k, v, None, segment_ids=segment_ids,
                                     implementation=cfg.attention_impl)
        out = _dense(cfg, d, "c_proj", std=cfg.init_std / math.sqrt(2 * cfg.n_layers))(o.reshape(b, t, d))
        return LayerOutput(out, cache, log_mask)


class GPT2MLP(nn.Module):
    """c_fc -> GELU (tanh approximation, HF "gelu_new") -> c_proj."""

    cfg: GPT2Config

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        y = _dense(cfg, cfg.mlp_hidden, "c_fc")(x)
        y = jax.nn.gelu(y, approximate=True)
        return _dense(cfg, cfg.d_model, "c_proj", std=cfg.init_std / math.sqrt(2 * cfg.n_layers))(y)


class GPT2Block(nn.Module):
    """Pre-norm block: x + attn(ln_1(x)), then + mlp(ln_2(x)). Call args as ``GPT2Attention`` (x the
    float32 residual stream); returns its ``LayerOutput`` with ``x`` the block's output."""

    cfg: GPT2Config

    @nn.compact
    def __call__(self, x, segment_ids=None, cache=None, alpha=None) -> LayerOutput:
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        if cache is None:
            x = rows_only(x)
        attn = GPT2Attention(cfg, name="attn")(_layer_norm(cfg, "ln_1")(x).astype(dtype), segment_ids, cache, alpha)
        x = x + attn.x.astype(x.dtype)
        x = x + GPT2MLP(cfg, name="mlp")(_layer_norm(cfg, "ln_2")(x).astype(dtype)).astype(x.dtype)
        return attn.replace(x=x)


class GPT2(nn.Module):
    """GPT-2 language model (``GPT2LMHeadModel``) with optional DCP.

    ``apply({'params': p}, tokens, segment_ids=None, positions=None, cache=None, *, alpha=None, last_logits=False)``

    Args:
      tokens: [B, T] int token ids, T ≤ n_positions.
      segment_ids: optional [B, T] int, packed documents: no attention across documents.
      positions: optional [B, T] int positions (default 0..T−1; give per-document positions for
        packed sequences).
      cache: optional tuple of ``n_layers`` ``fox_jax.cache.SlotKVCache`` (``fox_jax.decoding``,
        ``cfg.init_cache``), whose policy decides what each query sees (``dcp``: the step mask, α = ∞;
        ``dense``: every token, also for a DCP model). The T ≥ 1 tokens are appended to the cache (a
        prefill on a fresh cache, a chunk or a decode step on a live one); any split of a sequence gives
        the logits of one pass under the policy. Positions come from the cache (column − seq_start, pads
        clamped to 0); positions and segment_ids must be None and alpha None or inf. A fixed
        ``sparse_pattern`` is not applied with a cache (decode such a model with its policy, e.g.
        ``local:W`` with ``window:W``).
      alpha: keyword-only; α of the α-sigmoid (required when ``cfg.dcp`` without a cache; ignored
        otherwise): a Python float, ``float('inf')`` for the inference step mask, or a traced float32
        scalar from ``fox_jax.ops.alpha_sigmoid.cosine_alpha_schedule`` (no recompile per value).
      last_logits: keyword-only; True returns the logits of the last position only ([B, 1, vocab_size]):
        a prefill chunk that samples just the next token skips the head over the other T − 1 positions.

    Returns:
      ``ModelOutput``: ``logits`` [B, T, vocab_size] float32; ``cache`` the updated tuple of caches when
      one was given (else None); ``aux`` ``{}`` without DCP or a sparse pattern (and always with a cache).
        With ``cfg.sparse_pattern``: ``log_masks`` [n_layers, B, T, T] (the fixed 0/−inf mask,
        the same in every layer) and ``sparsity`` [n_layers] (as below; no ``sparsity_loss``). With DCP:
        ``log_masks``      [n_layers, B, T, T] float32 log I per layer (0 kept, ≈ −92.1 dropped),
        ``sparsity``       [n_layers] float32 fraction of causal pairs dropped (no gradient),
        ``sparsity_loss``  float32 scalar: ``sparsity_loss(log_masks, 1.0, normalization="causal",
                           segment_ids=...)`` (0 when T < 3); multiply by γ and add to the CE. For
                           the reference code's normalisation call ``sparsity_loss`` on
                           ``log_masks`` with ``normalization="code"``.

    Raises:
      ValueError: tokens not [B, T] int, T > n_positions, positions/segment_ids of the wrong shape,
        DCP on without alpha; with a cache: the wrong number of layers, positions/segment_ids given,
        a finite alpha.
    """

    cfg: GPT2Config

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None, cache=None, *, alpha=None,
                 last_logits: bool = False) -> ModelOutput:
        cfg = self.cfg
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an int array [B, T], got {tokens.dtype}{tokens.shape}")
        b, t = tokens.shape
        if t > cfg.n_positions:
            raise ValueError(f"sequence length {t} exceeds n_positions={cfg.n_positions} "
                             "(GPT-2 has learned absolute positions)")
        if cache is not None:
            if positions is not None or segment_ids is not None:
                raise ValueError("with a cache, positions and segment_ids must be None (they come from the cache)")
            if len(cache) != cfg.n_layers:
                raise ValueError(f"cache must hold one cache per layer ({cfg.n_layers}), got {len(cache)}")
            if alpha is not None and not (isinstance(alpha, (int, float)) and math.isinf(alpha)):
                raise ValueError(f"decoding uses the step mask: alpha must be None or inf, got {alpha!r}")
            positions = jnp.maximum(cache_columns(cache[0], t)[None, :] - cache[0].seq_start[:, None], 0)
        elif positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        elif positions.shape != (b, t) or not jnp.issubdtype(positions.dtype, jnp.integer):
            raise ValueError(f"positions must be an int array [B, T] = {(b, t)}, got {positions.dtype}{positions.shape}")
        if segment_ids is not None and (segment_ids.shape != (b, t)
                                        or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
            raise ValueError(f"segment_ids must be an int array [B, T] = {(b, t)}, "
                             f"got {segment_ids.dtype}{segment_ids.shape}")
        if cfg.dcp and alpha is None and cache is None:
            raise ValueError("alpha is required when cfg.dcp is True (use float('inf') for inference)")

        dtype = jnp.dtype(cfg.dtype)
        init = nn.initializers.normal(cfg.init_std)
        wte = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                       embedding_init=init, name="wte")
        wpe = nn.Embed(cfg.n_positions, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                       embedding_init=init, name="wpe")
        # The residual stream is kept in float32; sublayers compute in cfg.dtype. Without a cache it is laid out
        # by rows under a mesh (family.rows_only).
        if cache is None:
            x = (embed_rows(wte, tokens, dtype).astype(jnp.float32)
                 + embed_rows(wpe, positions, dtype, rows=None).astype(jnp.float32))
        else:
            x = wte(tokens).astype(jnp.float32) + wpe(positions).astype(jnp.float32)

        if scan_applies(cfg, self, cache):
            x, log_masks = scan_blocks(self, GPT2Block(cfg, parent=None), cfg.layer_names, x,
                                       (segment_ids, None, alpha), cfg.remat)
        else:
            block_cls = remat_block(GPT2Block, cfg.remat if cache is None else "none")  # decoding never differentiates
            outs = []
            for i, name in enumerate(cfg.layer_names):
                out = block_cls(cfg, name=name)(x, segment_ids, None if cache is None else cache[i], alpha)
                x = out.x
                outs.append(out)
            if cache is None and (cfg.dcp or cfg.sparse_pattern is not None):
                log_masks = jnp.stack([o.log_mask for o in outs])
        if last_logits:
            x = x[:, -1:]
        x = _layer_norm(cfg, "ln_f")(x)
        if cache is None:
            x = rows_only(x)
        logits = wte.attend(x.astype(dtype)).astype(jnp.float32)
        if cache is not None:
            return ModelOutput(logits, cache=tuple(o.cache for o in outs))
        if cfg.dcp or cfg.sparse_pattern is not None:
            return ModelOutput(logits, aux=dcp_aux(log_masks, segment_ids, with_loss=cfg.dcp))
        return ModelOutput(logits)


class GPT2Modules(FamilyModules):
    """The JAX side of ``GPT2Config``: ``GPT2`` and the layout of its decoding caches."""

    module = GPT2

    def cache_layout(self, cfg) -> dict:
        """k/v of every head (no GQA, no forget gate, no KV-shift, no QK-norm), k_int with DCP."""
        return dict(n_heads=cfg.n_heads, kv_heads=cfg.n_heads, head_dim=cfg.dim_per_head, forget_gate=False,
                    kv_shift=False, interaction_dim=cfg.interaction_dim if cfg.dcp else None, qk_norm=False)


register_family(GPT2Config.model_type, GPT2Modules())

__all__ = ["GPT2", "GPT2Attention", "GPT2Block", "GPT2Config", "GPT2MLP", "GPT2_SIZES", "SPARSE_PATTERNS", "gpt2_preset",
           "match_sparse_pattern", "parse_sparse_pattern", "sparse_pattern_keep", "sparse_pattern_log_mask",
           "sparse_pattern_sparsity"]
