"""Dynamic Context Pruning (DCP): the interaction mask, the sparsity loss and masked attention.

Anagnostidis et al., *Dynamic Context Pruning for Efficient and Interpretable Autoregressive
Transformers*, NeurIPS 2023 (arXiv 2305.15805); docs/design/dcp.md §1 and §3. Per attention layer:

    z_{k,j} = ⟨q_int_k, k_int_j⟩ / √r + β                 keep logits            (§1.2)
    Ī_{k,j} = σ_α(z_{k,j})  for j < k,   1 for j ≥ k       keep probabilities     (§1.2, §2)
    I_{k,j} = Π_{n=j+1..k} Ī_{n,j}                          cumulative keep mask   (§1.3)
    A = softmax(QKᵀ/√d_h + log I + causal)                  shared by all heads    (§1.4)

Query k drops key j once any token n ∈ (j, k] voted to drop it; the drop is irreversible, which is
what lets a decoder free j's KV entry. The self pair (j = k) is always kept.

Everything here works on log I in float32 ("log space", §1.5): log I = cumsum over queries of
log Ī, floored at ``LOG_FLOOR`` = log(1e-40) ≈ −92.1 (the reference code's ``log(I + 1e-40)``), with
double-``where`` logs so values *and* gradients stay finite for exact zeros. One [B, T, T] mask per
layer is computed once and shared by every head; ``dcp_attention`` consumes it blockwise and never
materialises [B, H, T, T]. The mask itself is O(B·T²) per layer (as in the reference code, whose float
mask rules out FlashAttention), which is why T stays ≤ 1024 for GPT-2.

``dcp_attention`` also takes FoX forget gates (``log_fgate``): the logits then get the decay bias
Λ_i − Λ_j of forgetting attention (docs/design/fox_acp.md §1.1) on top of log I, so the same op serves
GPT-2, the Transformer baselines (no gate) and FoX (``fox_jax.nn.attention``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fox_jax.kernels import forgetting_attention as fa_kernels
from fox_jax.ops import pallas as pallas_impl
from fox_jax.ops._common import check_attention_inputs
from fox_jax.ops.alpha_sigmoid import log_alpha_sigmoid
from fox_jax.ops.blockwise import block_sizes, blockwise_attention
from fox_jax.ops.reference import decay_cumsum
from fox_jax.sharding import kernel_mesh, per_shard
from fox_jax.ops.tiles import (  # noqa: F401  (dropped_key_blocks: part of the DCP API)
    LOG_FLOOR,
    dropped_key_blocks,
    exclude_dropped,
    tile_visits,
    visible_pairs,
)

NORMALIZATIONS = ("causal", "code")
IMPLEMENTATIONS = ("auto", "xla", "pallas")
"""``dcp_attention``'s ``implementation`` values (also ``ModelConfig.dcp_impl`` / ``GPT2Config.dcp_impl``)."""
_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# The interaction mask
# ---------------------------------------------------------------------------------------------

def with_interaction_params(params: dict, layer_names, *, d_model: int, interaction_dim: int, init_std: float,
                            beta_init: float, rng: jax.Array) -> dict:
    """``params`` with fresh DCP interaction parameters in every ``<layer>/attn`` (docs/design/dcp.md §1.1, §4):
    ``q_int/kernel`` and ``k_int/kernel`` [d_model, interaction_dim] float32 ~ N(0, init_std) and the
    scalar ``beta`` = beta_init. Shared by the models' ``add_dcp_params``; the input is not modified.

    Raises:
      ValueError: a layer name without an ``attn`` sub-tree in ``params``.
    """
    out = dict(params)
    layer_names = list(layer_names)
    keys = jax.random.split(rng, 2 * len(layer_names))
    for i, name in enumerate(layer_names):
        if name not in out or "attn" not in out[name]:
            raise ValueError(f"add_dcp_params: params have no layer {name}/attn")
        attn = dict(out[name]["attn"])
        shape = (d_model, interaction_dim)
        attn["q_int"] = {"kernel": init_std * jax.random.normal(keys[2 * i], shape, jnp.float32)}
        attn["k_int"] = {"kernel": init_std * jax.random.normal(keys[2 * i + 1], shape, jnp.float32)}
        attn["beta"] = jnp.asarray(beta_init, jnp.float32)
        out[name] = {**out[name], "attn": attn}
    return out


def keep_logits(q_int: jax.Array, k_int: jax.Array, beta: Any) -> jax.Array:
    """Keep logits z_{k,j} = ⟨q_int_k, k_int_j⟩/√r + β (docs/design/dcp.md §1.2), in float32.

    Args:
      q_int: [B, Tq, r] interaction queries (any float dtype; cast to float32).
      k_int: [B, Tk, r] interaction keys.
      beta: scalar interaction bias β of the layer (a float or a shape-() array, e.g. a parameter).

    Returns:
      [B, Tq, Tk] float32 z (queries on axis 1, keys on axis 2). Positive means "keep".

    Raises:
      ValueError: wrong ranks, batch or r mismatch, non-scalar beta.
    """
    if q_int.ndim != 3 or k_int.ndim != 3:
        raise ValueError(f"q_int and k_int must be [B, T, r], got {q_int.shape} and {k_int.shape}")
    if q_int.shape[0] != k_int.shape[0] or q_int.shape[2] != k_int.shape[2]:
        raise ValueError(f"q_int {q_int.shape} and k_int {k_int.shape} must share batch and r")
    beta = jnp.asarray(beta, jnp.float32)
    if beta.shape != ():
        raise ValueError(f"beta must be a scalar, got shape {beta.shape}")
    r = q_int.shape[2]
    z = jnp.einsum("bkr,bjr->bkj", q_int.astype(jnp.float32), k_int.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
    return z * (1.0 / math.sqrt(r)) + beta


def _safe_log(p: jax.Array, floor: float) -> jax.Array:
    """log p for p > tiny, ``floor`` otherwise, with finite values and gradients (double where)."""
    tiny = jnp.finfo(p.dtype).tiny
    ok = p > tiny
    return jnp.where(ok, jnp.log(jnp.where(ok, p, 1.0)), floor)


def cumulative_keep_log_mask(keep: jax.Array, alpha: Any = None, *, floor: float = LOG_FLOOR) -> jax.Array:
    """log I_{k,j} = Σ_{n=j+1..k} log Ī_{n,j}, floored at ``floor`` (docs/design/dcp.md §1.3, §1.5).

    Two input forms:

    * ``alpha is None``: ``keep`` holds the keep probabilities Ī ∈ [0, 1]. Factors below float32's
      smallest normal count as 0 (log = ``floor``); the derivative 1/Ī is bounded by ~1e38.
    * ``alpha`` given: ``keep`` holds the keep logits z (``keep_logits``) and
      log Ī = ``log_alpha_sigmoid(z, alpha)`` is used directly, which is exact in the tail and has a
      bounded-by-construction derivative. This is the form to train with; ``alpha=inf`` gives the
      inference-time step mask (0 or ``floor``).

    Only strictly-causal entries (j < k) are used: the diagonal and upper triangle of Ī are treated as
    1, so the result is 0 there (the token never drops itself; the caller adds the causal mask).
    Factors ≤ ``floor`` and partial sums ≤ ``floor`` are clamped to ``floor`` with a zero gradient,
    which equals the reference code's log(cumprod(Ī) + 1e-40) up to that floor (the code's I < 1e-40
    are the same "dropped"). ``floor=-inf`` gives the exact eval-mode mask (−inf for dropped pairs).

    Args:
      keep: [B, T, T] float (queries on axis 1, keys on axis 2), probabilities or logits; computed
        in float32 (bfloat16/float16 are upcast; keep this path out of half precision, §1.5).
      alpha: None, or α for ``log_alpha_sigmoid`` (Python float, inf, or a traced scalar).
      floor: the log value of a dropped pair (default log(1e-40) ≈ −92.1), ≤ −1.

    Returns:
      [B, T, T] float32 log I (float64 for float64 input), in [floor, 0]; differentiable in
      ``keep`` with finite gradients everywhere, including exact zeros and ones of Ī.

    Raises:
      ValueError: keep not [B, T, T] with a square last two axes, not floating point, or floor > −1.
    """
    if keep.ndim != 3 or keep.shape[1] != keep.shape[2]:
        raise ValueError(f"keep must be [B, T, T] (queries x keys, square), got {keep.shape}")
    if not jnp.issubdtype(keep.dtype, jnp.floating):
        raise ValueError(f"keep must be a floating-point array, got {keep.dtype}")
    if floor > -1.0:
        raise ValueError(f"floor must be <= -1 (a log of a near-zero keep), got {floor}")
    t = keep.shape[1]
    dtype = jnp.float64 if keep.dtype == jnp.float64 else jnp.float32
    if alpha is None:
        lp = _safe_log(keep.astype(dtype), floor)
    else:
        lp = log_alpha_sigmoid(keep.astype(dtype), alpha)
        lp = jnp.where(lp > floor, lp, floor)  # −inf (exact zero) and deep tails -> floor, grad 0
    strictly_lower = jnp.tril(jnp.ones((t, t), bool), k=-1)
    lp = jnp.where(strictly_lower[None], lp, 0.0)
    cs = jnp.cumsum(lp, axis=1)  # along the query axis: Σ_{n ≤ k} for column j, zero for n ≤ j
    return jnp.where(cs > floor, cs, floor).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Sparsity: the regulariser and the metric
# ---------------------------------------------------------------------------------------------

def _pair_weights(t: int, *, exclude_last_row: bool, segment_ids: jax.Array | None) -> jax.Array:
    """[1 or B, T, T] bool: strictly causal pairs (j < k), optionally without row T−1 / across docs."""
    w = jnp.tril(jnp.ones((t, t), bool), k=-1)
    if exclude_last_row:
        w = w & (jnp.arange(t) < t - 1)[:, None]
    w = w[None]
    if segment_ids is not None:
        w = w & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return w


def _check_stack(log_masks: jax.Array, name: str = "log_masks") -> None:
    if log_masks.ndim not in (3, 4) or log_masks.shape[-1] != log_masks.shape[-2]:
        raise ValueError(f"{name} must be [L, B, T, T] or [B, T, T] (square), got {log_masks.shape}")


def _check_segments(segment_ids, log_masks):
    if segment_ids is None:
        return None
    b, t = log_masks.shape[-3], log_masks.shape[-1]
    if segment_ids.shape != (b, t) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be an int array of shape [B, T] = {(b, t)}, "
                         f"got {segment_ids.dtype}{segment_ids.shape}")
    return segment_ids


def sparsity_loss(
    log_masks: jax.Array,
    gamma: Any,
    *,
    normalization: str = "causal",
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """The DCP sparsity regulariser γ·mean(I) (docs/design/dcp.md §3.1), from log masks.

    I = exp(log I) (a floored pair contributes e^−92 ≈ 0). Two normalisations:

    * ``"causal"`` (default, recommended): γ times the mean of I over the **strictly causal pairs
      (j < k) of the query rows k = 0 … T−2**, averaged over layers and batch (and, with
      ``segment_ids``, only over pairs inside one document). The last query row is excluded because
      it predicts nothing after the target shift (as in the code). Per layer and row this is
      (T−1)(T−2)/2 pairs, i.e. the paper's γ·2/(L·n(n−1))·Σ_ℓ Σ_k Σ_{j<k} I^ℓ_{k,j} with n = T−1
      predicting rows.
    * ``"code"``: reproduces the reference code exactly, γ·mean(I[..., :T−1, :]) over the whole
      (T−1)×T slice, whose diagonal and upper triangle are the constant 1. Its value is
      γ·[(T−2)/(2T)·m + (T+2)/(2T)] with m the ``"causal"`` mean, so its *gradient* equals that of
      ``"causal"`` with γ_eff = γ·(T−2)/(2T) ≈ γ/2 (0.1497 for the code's γ = 0.3 at T = 1024). Use
      this flag, or γ_causal ≈ γ_code/2, to compare γ values with the paper/code.

    Args:
      log_masks: [L, B, T, T] (stacked layers) or [B, T, T] float32 log I from
        ``cumulative_keep_log_mask``.
      gamma: γ, the sparsity strength (float or scalar array).
      normalization: ``"causal"`` or ``"code"``.
      segment_ids: optional [B, T] int, packed documents (``"causal"`` only).

    Returns:
      float32 scalar loss term (add it to the cross-entropy). Differentiable in log_masks.

    Raises:
      ValueError: bad shapes, unknown normalization, T < 3 with ``"causal"``, segment_ids with
        ``"code"``.
    """
    _check_stack(log_masks)
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    segment_ids = _check_segments(segment_ids, log_masks)
    t = log_masks.shape[-1]
    masks = jnp.exp(log_masks.astype(jnp.float32))
    gamma = jnp.asarray(gamma, jnp.float32)
    if normalization == "code":
        if segment_ids is not None:
            raise ValueError("segment_ids are not supported with normalization='code' (the code has none)")
        return gamma * jnp.mean(masks[..., : t - 1, :])
    if t < 3:
        raise ValueError(f"normalization='causal' needs T >= 3 (strictly causal pairs before the last row), got T={t}")
    w = _pair_weights(t, exclude_last_row=True, segment_ids=segment_ids)  # [1 or B, T, T]
    w = jnp.broadcast_to(w, masks.shape[-3:]).astype(jnp.float32)
    n_layers = 1 if masks.ndim == 3 else masks.shape[0]
    total = jnp.sum(masks * w)
    count = jnp.maximum(jnp.sum(w) * n_layers, 1.0)
    return gamma * total / count


def sparsity(
    log_masks: jax.Array,
    *,
    floor: float = LOG_FLOOR,
    segment_ids: jax.Array | None = None,
    soft: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Fraction of causal (query, key) pairs dropped, per layer and overall (docs/design/dcp.md §3.2).

        sparsity_ℓ = #{(b, k, j): j < k, log I^ℓ_{k,j} ≤ floor} / (B·T(T−1)/2)

    over **all** query rows (including the last) and strictly causal pairs (the diagonal is never
    dropped and is not counted); with ``segment_ids`` only pairs inside one document count. With the
    step function (α = inf, the recommended evaluation) a pair is either kept (log I = 0) or dropped
    (log I = floor), and this equals 1 − mean(I), i.e. the average fraction of each layer's KV cache
    freed over a full-length generation. ``soft=True`` returns 1 − mean(I) for soft masks instead.

    Args:
      log_masks: [L, B, T, T] or [B, T, T] (one layer) float32 log I.
      floor: values ≤ floor count as dropped (LOG_FLOOR; use −inf for exact eval-mode masks, which
        also works with the default).
      segment_ids: optional [B, T] int.
      soft: 1 − mean(exp(log I)) instead of the dropped count.

    Returns:
      (per_layer [L] float32, overall float32 scalar = mean over layers); L = 1 for a [B, T, T] input.
      0 when there is no causal pair (T = 1). Not meant to be differentiated (use ``sparsity_loss``).

    Raises:
      ValueError: bad shapes.
    """
    _check_stack(log_masks)
    segment_ids = _check_segments(segment_ids, log_masks)
    lm = log_masks if log_masks.ndim == 4 else log_masks[None]
    t = lm.shape[-1]
    w = jnp.broadcast_to(_pair_weights(t, exclude_last_row=False, segment_ids=segment_ids), lm.shape[1:])
    w = w.astype(jnp.float32)
    if soft:
        dropped = 1.0 - jnp.exp(lm.astype(jnp.float32))
    else:
        dropped = (lm <= floor).astype(jnp.float32)
    per_layer = jnp.sum(dropped * w, axis=(1, 2, 3)) / jnp.maximum(jnp.sum(w), 1.0)
    return per_layer, jnp.mean(per_layer)


# ---------------------------------------------------------------------------------------------
# Attention with the shared additive mask
# ---------------------------------------------------------------------------------------------

def dcp_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_mask: jax.Array,
    log_fgate: jax.Array | None = None,
    *,
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
    floor: float = LOG_FLOOR,
) -> jax.Array:
    """Dense float32 oracle: softmax(scale·QKᵀ + log I [+ Λ_i − Λ_j] + causal)·V, log I shared by heads.

    Materialises [B, H, Tq, Tk]; for tests and tiny problems. Shapes, alignment and the dropped-pair
    rule as in ``dcp_attention``: pairs with log I ≤ ``floor`` weigh 0, and rows with no kept visible
    pair (or no visible key) are 0. The decay term with ``log_fgate`` [B, Tk, H] is built exactly as
    in ``fox_jax.ops.reference.forgetting_attention_reference`` (float32 ``decay_cumsum``,
    docs/design/fox_acp.md §1.7). Returns [B, Tq, H, D] float32.
    """
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    group = h // hkv
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    s = jnp.einsum("bihd,bjhd->bhij", q.astype(jnp.float32), kf, precision=lax.Precision.HIGHEST)
    s = s * scale
    if log_fgate is not None:
        lam = decay_cumsum(log_fgate).transpose(0, 2, 1)  # [B, H, Tk] float32
        s = s + (lam[:, :, tk - tq:, None] - lam[:, :, None, :])
    s = s + log_mask.astype(jnp.float32)[:, None]
    vis = (visible_pairs(tq, tk, segment_ids) & (log_mask > floor))[:, None]  # visible and kept
    s = jnp.where(vis, s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1) * vis
    return jnp.einsum("bhij,bjhd->bihd", p, vf, precision=lax.Precision.HIGHEST)


def resolve_implementation(implementation: str, *, floor: float = LOG_FLOOR, head_dim: int = 128) -> str:
    """The implementation ``dcp_attention`` runs for ``implementation`` on this backend.

    Args:
      implementation: one of ``IMPLEMENTATIONS``.
      floor: the dropped threshold of the call (the Pallas kernels need a finite one).
      head_dim: D of the call (the Pallas kernels take D ≤ 256).
    Returns:
      ``"auto"`` resolved: ``"pallas"`` when the default backend is a GPU, ``floor`` is finite and
      D ≤ 256, else ``"xla"``; ``"xla"`` and ``"pallas"`` unchanged.
    Raises:
      ValueError: an unknown implementation.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation != "auto":
        return implementation
    pallas_ok = (jax.default_backend() == "gpu" and math.isfinite(floor)
                 and head_dim <= fa_kernels.MAX_HEAD_DIM)
    return "pallas" if pallas_ok else "xla"


def dcp_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_mask: jax.Array,
    log_fgate: jax.Array | None = None,
    *,
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
    block_q: int = 128,
    block_k: int = 128,
    skip_dropped: bool = True,
    floor: float = LOG_FLOOR,
    implementation: str = "auto",
) -> jax.Array:
    """Causal attention with the DCP mask shared by all heads, blockwise (docs/design/dcp.md §1.4).

        o_i = Σ_j softmax_j(sm_scale·q_i·k_j + log I_{i,j} [+ Λ_i − Λ_j]) v_j   over visible j

    (visible: causal, same document). With ``log_fgate`` (FoX) the forgetting-attention decay bias
    Λ_i − Λ_j, Λ = float32 cumsum over time of log f (docs/design/fox_acp.md §1.1), is added per head exactly
    as in ``forgetting_attention``; ``log_fgate=None`` is plain softmax attention plus the mask (GPT-2,
    Transformer baselines) and runs the very same computation as before the gate was supported.

    Flash-style, on the blockwise core of forgetting attention (``fox_jax.ops.blockwise``): queries in
    blocks, an online float32 softmax over the key blocks, a ``jax.custom_vjp`` backward with a
    dQ/dlogI pass and a dK/dV pass. It never materialises
    [B, H, Tq, Tk]: per step it holds one [B, H, block_q, block_k] tile; the [B, Tq, Tk] mask (and its
    gradient) is O(B·T²) — one per layer, shared by the heads, like the reference code's float mask.

    Dropped pairs (one definition for every implementation, tiling and ``skip_dropped``): a visible
    pair with log I ≤ ``floor`` is *dropped* and gets weight exactly 0, as if log I were −inf; its
    mask gradient is 0. A query row with **no kept visible pair** (every visible log I ≤ floor)
    outputs 0 and passes zero gradients to q, k, v, log_mask and log_fgate — like a row with no
    visible key. Masks from ``cumulative_keep_log_mask`` keep the diagonal (log I = 0: a token never
    drops itself, docs/design/dcp.md §1.4), so such rows only arise from direct calls. Against the
    reference code's additive log(I + 1e-40), excluding a dropped pair changes the softmax by its
    weight relative to the diagonal's, e^{floor + Δ} with Δ the difference of the two pairs' other
    logit terms (≈ 1e-40 for Δ ≈ 0; the forget-gate decay Λ_i − Λ_j ≤ 0 only lowers it).

    Block skipping (``skip_dropped``): tiles flagged by ``dropped_key_blocks`` (every visible pair
    dropped: the live tiles of ``fox_jax.ops.tiles.TileVisits``) are not visited in the forward or
    backward pass — a tile is visited if it is live for any batch row, and masked out exactly for the
    rows where it is dropped. As dropped pairs weigh
    exactly 0, skipping changes only the speed, not the result.

    Args:
      q: [B, Tq, H, D] float32 / bfloat16 / float16.
      k, v: [B, Tk, Hkv, D], q's dtype; H a multiple of Hkv. Tq ≤ Tk, queries aligned bottom-right
        (query i at absolute position Tk − Tq + i).
      log_mask: [B, Tq, Tk] float32 additive mask log I (``cumulative_keep_log_mask``); −inf allowed.
      log_fgate: optional [B, Tk, H] float32 log forget gates (≤ 0), one per *query* head, in nats;
        Λ = cumsum(log_fgate) over all Tk keys, query i uses Λ at absolute position Tk − Tq + i.
        Gradient (docs/design/fox_acp.md §1.6): the custom backward returns dΛ_t = Σ_j dS_tj − Σ_i dS_it
        (row sums minus column sums of dS, float32), and autodiff of the float32 ``jnp.cumsum``
        turns it into dlog f_s = Σ_{t≥s} dΛ_t (a float32 reverse cumsum, no "total minus cumsum").
      segment_ids: optional [B, Tk] int, packed documents (no attention across documents).
      sm_scale: logit scale, default 1/√D.
      block_q, block_k: tile sizes (T need not be a multiple; blocks shrink to round_up(T, 8)).
      skip_dropped: skip fully dropped tiles (else only the causal triangle is skipped); same result.
      floor: pairs with log I ≤ floor are dropped (weight 0; default log(1e-40), the floor of
        ``cumulative_keep_log_mask``; −inf drops only the −inf pairs).
      implementation: ``"auto"`` (default: ``resolve_implementation`` — ``"pallas"`` on GPU when
        ``floor`` is finite and D ≤ 256, else ``"xla"``), ``"xla"`` (this blockwise pure-JAX code;
        ``block_q``/``block_k`` apply) or ``"pallas"`` (the forgetting-attention Pallas kernels with the
        mask added to every head's scores; each kernel loops over a compacted list of its live tiles,
        ``fox_jax.ops.tiles.TileVisits.key_lists``/``query_lists``, and a fourth kernel writes the
        mask gradient; tiles from ``fox_jax.kernels.forgetting_attention.default_config``; interpret
        mode off GPU; ``floor`` must then be finite). On an H200 the Pallas path was 10–25× faster
        than the XLA one (benchmarks/bench_dcp.py).

    Sharding: under ``jax.set_mesh(mesh)`` with several devices the Pallas kernels run per shard, as those of
    ``forgetting_attention`` (``fox_jax.sharding.per_shard``: batch over the mesh's batch axes, heads over its
    head axes, each where it divides; the mask is split with the batch). The XLA path is partitioned by XLA.

    Returns:
      [B, Tq, H, D] in q's dtype. Differentiable in q, k, v, log_mask and log_fgate (float32
      gradients for the last two).

    Raises:
      ValueError: wrong ranks, shapes or dtypes (e.g. a bfloat16 log_mask or log_fgate), Tq > Tk,
        H not a multiple of Hkv, bad block sizes, an unknown implementation, a non-finite floor with
        "pallas".
    """
    check_attention_inputs(q, k, v, log_fgate, segment_ids=segment_ids, log_mask=log_mask)
    implementation = resolve_implementation(implementation, floor=floor, head_dim=q.shape[-1])
    for name, val in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    _, tq, _, d = q.shape
    tk = k.shape[1]
    # Λ [B, Tk, H] float32; its VJP is a reverse cumsum
    lam = None if log_fgate is None else jnp.cumsum(log_fgate, axis=1)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    if implementation == "pallas":
        def kernels(q, k, v, log_mask, lam=None, segment_ids=None):
            return pallas_impl.dcp_attention(q, k, v, log_mask, lam, segment_ids, scale=scale, floor=floor,
                                             skip_dropped=skip_dropped)

        mesh = kernel_mesh()
        if mesh is None:
            return kernels(q, k, v, log_mask, lam, segment_ids)
        # opaque to the SPMD partitioner, as the forgetting-attention kernels: run them per shard (batch, heads);
        # each shard builds the live-tile lists of its own rows, which skips the same or more tiles (same result)
        qkv = ("batch", None, "heads", None)
        args = dict(q=(q, qkv), k=(k, qkv), v=(v, qkv), log_mask=(log_mask, ("batch", None, None)))
        if lam is not None:
            args["lam"] = (lam, ("batch", None, "heads"))
        if segment_ids is not None:
            args["segment_ids"] = (segment_ids, ("batch", None))
        return per_shard(kernels, mesh, args, qkv)
    bq, bk = block_sizes(tq, tk, block_q, block_k)
    visits = tile_visits(tq, tk, bq, bk, segment_ids=segment_ids, log_mask=log_mask, floor=floor,
                         skip_dropped=skip_dropped)
    log_mask = exclude_dropped(log_mask, floor, _NEG_INF)  # dropped pairs weigh exactly 0
    return blockwise_attention(q, k, v, lam, log_mask, segment_ids, visits, scale)
