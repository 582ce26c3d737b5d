"""Adaptive Computation Pruning (ACP): thresholds, block ranges and pruning statistics.

docs/design/fox_acp.md §5. With every logit bounded, |scale·q_i·k_j| ≤ U, dropping all (i, j) whose decay
D_ij = Λ_i − Λ_j is below

    δ = −(2U + log N) + log ε                                                   (§5.1)

removes at most ε of the attention weight of any query (N = key length). The bound holds for any set
of dropped pairs with D < δ, so a (query block, key block) tile may be skipped only if *every* decay
in it is below δ. The tile test bounds the largest decay with monotone envelopes of Λ,

    Λ⁺_i = max_{i' ≥ i} Λ_i'  (non-increasing, ≥ Λ_i),   Λ⁻_j = min_{j' ≤ j} Λ_j'  (non-increasing, ≤ Λ_j),

so that max over the tile of Λ_i − Λ_j ≤ Λ⁺_r − Λ⁻_c' (r its first query row, c' its last key
column) and a tile is skipped iff Λ⁺_r − Λ⁻_c' < δ. This is valid for *any* gates. With log f ≤ 0
(the contract: Λ non-increasing) both envelopes equal Λ and the test is the official kernel's
Λ_r − Λ_c' < δ (§5.3), tile for tile; with positive gates it only prunes less. Both envelopes are
non-increasing, so the skipped tiles always form a staircase in the lower-left of the causal
triangle:

* forward / dQ: query block m visits key blocks ``[kv_start[m], causal_end[m])``;
* dK/dV: key block n visits query blocks ``[causal_start[n], q_end[n])``.

All index arrays are computed here, vectorised, from block-level Λ; kernels only consume them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_LOG_EPSILON = -10.0


def threshold_from_bound(u: jax.Array, key_len: int, log_epsilon: float = DEFAULT_LOG_EPSILON) -> jax.Array:
    """δ = −(2U + log N) + log ε (docs/design/fox_acp.md §5.1), elementwise in U (float32)."""
    return -(2.0 * jnp.asarray(u, jnp.float32) + math.log(key_len)) + log_epsilon


def logit_bound(q: jax.Array, k: jax.Array, sm_scale: float) -> jax.Array:
    """U_{b,h} = scale · max_i‖q_i‖ · max_j‖k_j‖ from the actual tensors, a bound on |scale·q_i·k_j|
    over these q and k only (docs/design/fox_acp.md §5.2, the no-QK-norm case).

    Args:
      q: [B, Tq, H, D]; k: [B, Tk, Hkv, D] (H a multiple of Hkv).
    Returns:
      [B, H] float32 U (no gradient).
    """
    q = jax.lax.stop_gradient(q).astype(jnp.float32)
    k = jax.lax.stop_gradient(k).astype(jnp.float32)
    qn = jnp.sqrt(jnp.max(jnp.sum(q * q, axis=-1), axis=1))  # [B, H]
    kn = jnp.sqrt(jnp.max(jnp.sum(k * k, axis=-1), axis=1))  # [B, Hkv]
    return sm_scale * qn * jnp.repeat(kn, q.shape[2] // k.shape[2], axis=1)


def auto_threshold(
    q: jax.Array, k: jax.Array, sm_scale: float, log_epsilon: float = DEFAULT_LOG_EPSILON
) -> jax.Array:
    """The ``"auto"`` threshold: δ from U = ``logit_bound(q, k)`` and N = Tk.

    Args:
      q: [B, Tq, H, D]; k: [B, Tk, Hkv, D] (H a multiple of Hkv).
    Returns:
      [B, H] float32 δ, treated as a constant (no gradient).
    """
    return threshold_from_bound(logit_bound(q, k, sm_scale), k.shape[1], log_epsilon)


def qk_norm_logit_bound(q_norm_weight: jax.Array, k_norm_weight: jax.Array, *,
                        sm_scale: float | None = None) -> jax.Array:
    """The logit bound of a QK-norm model from its norm weights (docs/design/fox_acp.md §5.2).

    After RMS normalisation ‖q‖ ≤ √D·max|w_q| (eps only shrinks it), so for every pair of tokens
    |scale·q·k| ≤ U_h = scale · D · max|w_q,h| · max|w_k,h|  (= √D·max|w_q,h|·max|w_k,h| at scale 1/√D).

    Args:
      q_norm_weight, k_norm_weight: [H, D] per-head scales, or [D] shared across heads.
    Returns:
      [H] float32 U (or a scalar for shared weights), no gradient.
    """
    d = q_norm_weight.shape[-1]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    wq = jnp.max(jnp.abs(jax.lax.stop_gradient(q_norm_weight).astype(jnp.float32)), axis=-1)
    wk = jnp.max(jnp.abs(jax.lax.stop_gradient(k_norm_weight).astype(jnp.float32)), axis=-1)
    return scale * d * wq * wk


def qk_norm_threshold(
    q_norm_weight: jax.Array,
    k_norm_weight: jax.Array,
    key_len: int,
    *,
    sm_scale: float | None = None,
    log_epsilon: float = DEFAULT_LOG_EPSILON,
) -> jax.Array:
    """Weight-based threshold for QK-norm models: δ from ``qk_norm_logit_bound`` and N = ``key_len``.

    Args:
      q_norm_weight, k_norm_weight: [H, D] per-head scales, or [D] shared across heads.
      key_len: N, the number of keys.
    Returns:
      [H] float32 δ (or a scalar for shared weights); broadcast it to [B, H].
    """
    return threshold_from_bound(qk_norm_logit_bound(q_norm_weight, k_norm_weight, sm_scale=sm_scale), key_len,
                                log_epsilon)


THRESHOLD_FORMS = "None, 'auto', a float or an array broadcastable to [B, H]"


def check_threshold(adaptive_threshold: Any, batch: int, heads: int) -> None:
    """Validate the op's ``adaptive_threshold`` argument (see ``resolve_threshold`` for its meaning).

    Concrete values are checked for NaN; traced values (under ``jit``, ``vmap``, ``shard_map``) only
    for their shape, and a traced NaN prunes nothing (``resolve_threshold``).

    Raises:
      ValueError: an unknown string; a non-numeric value; an array that does not broadcast to
        [B, H]; a concrete NaN (δ = NaN would compare false everywhere and silently prune nothing).
    """
    if adaptive_threshold is None:
        return
    if isinstance(adaptive_threshold, str):
        if adaptive_threshold != "auto":
            raise ValueError(f"adaptive_threshold must be {THRESHOLD_FORMS}; got the string {adaptive_threshold!r}")
        return
    try:
        delta = jnp.asarray(adaptive_threshold)
    except TypeError:
        raise ValueError(f"adaptive_threshold must be {THRESHOLD_FORMS}; got {adaptive_threshold!r}") from None
    if not (jnp.issubdtype(delta.dtype, jnp.floating) or jnp.issubdtype(delta.dtype, jnp.integer)):
        raise ValueError(f"adaptive_threshold must be real numbers ({THRESHOLD_FORMS}); got dtype {delta.dtype}")
    try:
        fits = jnp.broadcast_shapes(delta.shape, (batch, heads)) == (batch, heads)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"adaptive_threshold of shape {delta.shape} does not broadcast to [B, H] = {(batch, heads)}")
    if not isinstance(delta, jax.core.Tracer):
        nan = np.isnan(np.asarray(delta, np.float32))
        if nan.any():
            where = "" if delta.ndim == 0 else f" at index {tuple(int(i) for i in np.argwhere(nan)[0])}"
            raise ValueError(f"adaptive_threshold must not be NaN (got NaN{where}); use None or -inf to prune "
                             f"nothing")


def resolve_threshold(
    adaptive_threshold: Any,
    q: jax.Array,
    k: jax.Array,
    sm_scale: float,
    log_epsilon: float = DEFAULT_LOG_EPSILON,
) -> jax.Array | None:
    """Turn the op's ``adaptive_threshold`` argument into a [B, H] float32 δ ≤ 0 (or None).

    Accepts None (no pruning), ``"auto"`` (``auto_threshold``), a Python float, or an array
    broadcastable to [B, H]. A tile is skipped iff every decay in it is below δ (module docstring), so:

    * δ is clipped to ≤ 0: tiles holding a pair of decay 0 (the diagonal) are never pruned, and any
      δ ≥ 0, +inf included, is the most aggressive setting δ = 0;
    * δ = −inf prunes nothing (bit-identical to None);
    * a NaN raises for concrete values (``check_threshold``); a traced NaN (under ``jit``), or an auto
      threshold made NaN by non-finite q or k, is replaced by −inf: it prunes nothing.

    Raises:
      ValueError: as ``check_threshold``.
    """
    if adaptive_threshold is None:
        return None
    b, h = q.shape[0], q.shape[2]
    check_threshold(adaptive_threshold, b, h)
    if isinstance(adaptive_threshold, str):
        delta = auto_threshold(q, k, sm_scale, log_epsilon)
    else:
        delta = jnp.broadcast_to(jnp.asarray(adaptive_threshold, jnp.float32), (b, h))
    delta = jax.lax.stop_gradient(delta)
    return jnp.minimum(jnp.where(jnp.isnan(delta), -jnp.inf, delta), 0.0)


def _row_starts(tq: int, tk: int, block_q: int) -> jax.Array:
    """Absolute position of the first query row of each query block (bottom-right alignment)."""
    nq = -(-tq // block_q)
    return (tk - tq) + jnp.arange(nq) * block_q


def _col_ends(tk: int, block_k: int) -> jax.Array:
    nk = -(-tk // block_k)
    return jnp.minimum(jnp.arange(nk) * block_k + block_k - 1, tk - 1)


def _tile_envelopes(lam: jax.Array, tq: int, block_q: int, block_k: int) -> tuple[jax.Array, jax.Array]:
    """(Λ⁺ at each query block's first row [B, H, nq], Λ⁻ at each key block's last column [B, H, nk]).

    Λ⁺_i = max_{i' ≥ i} Λ_i' and Λ⁻_j = min_{j' ≤ j} Λ_j' (module docstring): Λ⁺_r − Λ⁻_c' bounds every
    decay of tile (m, n) for any Λ, and both are non-increasing along their blocks. For a
    non-increasing Λ they are Λ itself, bit for bit.
    """
    tk = lam.shape[1]
    lam_bh = lam.transpose(0, 2, 1)  # [B, H, Tk]
    upper = jax.lax.cummax(lam_bh, axis=2, reverse=True)
    lower = jax.lax.cummin(lam_bh, axis=2)
    return upper[:, :, _row_starts(tq, tk, block_q)], lower[:, :, _col_ends(tk, block_k)]


def kv_block_start(lam: jax.Array, delta: jax.Array, *, tq: int, block_q: int, block_k: int) -> jax.Array:
    """First key block each query block must visit (forward and dQ).

    Args:
      lam: [B, Tk, H] float32 Λ (any values; non-increasing when log f ≤ 0).
      delta: [B, H] float32 threshold (≤ 0).
      tq: number of queries (queries are the last tq positions).
    Returns:
      [B, H, nq] int32, nq = ceil(tq / block_q): the number of leading key blocks whose tile test
      Λ⁺_r − Λ⁻_c' < δ holds, i.e. whose every decay is below δ (a prefix, because the bound grows
      with the key block).
    """
    lam_r, lam_c = _tile_envelopes(lam, tq, block_q, block_k)
    pruned = (lam_r[..., :, None] - lam_c[..., None, :]) < delta[..., None, None]
    return jnp.sum(pruned, axis=-1, dtype=jnp.int32)


def q_block_end(lam: jax.Array, delta: jax.Array, *, tq: int, block_q: int, block_k: int) -> jax.Array:
    """One past the last query block each key block must visit (dK/dV).

    Uses the same tile test as ``kv_block_start`` (tile (m, n) is computed iff
    Λ⁺_{r_m} − Λ⁻_{c'_n} ≥ δ), so with equal block sizes both backward passes see the same tiles.

    Returns:
      [B, H, nk] int32 in [0, nq].
    """
    lam_r, lam_c = _tile_envelopes(lam, tq, block_q, block_k)
    kept = (lam_r[..., None, :] - lam_c[..., :, None]) >= delta[..., None, None]  # [B, H, nk, nq]
    return jnp.sum(kept, axis=-1, dtype=jnp.int32)


def causal_block_counts(tq: int, tk: int, block_q: int, block_k: int) -> tuple[jax.Array, jax.Array]:
    """Causal key-block range per query block: (first block, one past the last) — [nq] int32 each.

    The first block is 0; the end is ceil((last query row + 1) / block_k), capped at nk.
    """
    nk = -(-tk // block_k)
    rows = _row_starts(tq, tk, block_q)
    last_row = jnp.minimum(rows + block_q - 1, tk - 1)
    end = jnp.minimum(last_row // block_k + 1, nk)
    return jnp.zeros_like(end), end.astype(jnp.int32)


def pruning_stats(kv_start: jax.Array, *, tq: int, tk: int, block_q: int, block_k: int) -> dict[str, jax.Array]:
    """Tile-level pruning statistics of one attention call.

    Args:
      kv_start: [B, H, nq] from ``kv_block_start``.
    Returns:
      dict of float32 scalars: ``blocks_total`` (causal tiles over all batch rows and heads),
      ``blocks_skipped`` and ``fraction_skipped``. Every tile costs the same (4·block_q·block_k·D
      FLOPs forward), so ``fraction_skipped`` is also the fraction of attention FLOPs saved. Tiles
      skipped because of ``seq_start`` are not counted.
    """
    _, end = causal_block_counts(tq, tk, block_q, block_k)
    skipped = jnp.minimum(kv_start, end[None, None, :]).astype(jnp.float32)
    total = jnp.sum(end).astype(jnp.float32) * kv_start.shape[0] * kv_start.shape[1]
    n_skipped = jnp.sum(skipped)
    return {
        "blocks_total": total,
        "blocks_skipped": n_skipped,
        "fraction_skipped": n_skipped / jnp.maximum(total, 1.0),
    }


# ---------------------------------------------------------------------------------------------------
# Document-aware block skipping (segment ids)
# ---------------------------------------------------------------------------------------------------

_I32_MAX = 2 ** 31 - 1
_I32_MIN = -(2 ** 31)


def _block_min_max(ids: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Per-block min and max of ``ids`` [B, T] over blocks of ``block`` positions → [B, ceil(T/block)]
    each (the ragged last block only over its real positions)."""
    b, t = ids.shape
    n = -(-t // block)
    pad = n * block - t
    lo = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=_I32_MAX).reshape(b, n, block)
    hi = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=_I32_MIN).reshape(b, n, block)
    return jnp.min(lo, axis=-1), jnp.max(hi, axis=-1)


def segment_block_bounds(segment_ids: jax.Array, *, tq: int, block_q: int, block_k: int):
    """Block ranges that document-aware skipping may restrict each kernel's loop to.

    A (query block, key block) tile can hold a visible pair only if some query and some key of it
    carry the same segment id, which requires the id ranges [min, max] of the two blocks to
    intersect. Tiles whose ranges do not intersect hold no visible pair and may be skipped. The loops
    are contiguous, so only the non-intersecting tiles *before the first* and *after the last*
    intersecting tile of each row/column of blocks are skipped; non-intersecting tiles in between are
    computed (fully masked: exact, just not skipped).

    * Valid for **any** int segment ids (masking stays exact; skipping only removes tiles with no
      shared id).
    * Tight for packed documents (ids non-decreasing along the sequence, the trainer's layout): the
      intersecting key blocks of a query block are then exactly one contiguous run, so every tile
      without a visible pair outside the causal range is skipped. Ids that are not monotone (e.g.
      alternating documents) skip less but are never wrong.

    Args:
      segment_ids: [B, Tk] int32 (queries are the last ``tq`` positions, bottom-right aligned).
      tq: number of queries; block_q, block_k: the kernel's tile (any positive ints).
    Returns:
      (kv_lo [B, nq], kv_hi [B, nq], q_lo [B, nk], q_hi [B, nk]) int32, nq = ceil(tq/block_q),
      nk = ceil(Tk/block_k): query block m needs key blocks [kv_lo[m], kv_hi[m]) only, key block n
      needs query blocks [q_lo[n], q_hi[n]) only. A block that intersects nothing gets an empty range
      (lo = the block count, hi = 0): intersect it with the causal / ACP range with max/min and
      clamp hi ≥ lo.
    """
    ids = jax.lax.stop_gradient(segment_ids).astype(jnp.int32)
    tk = ids.shape[1]
    qmin, qmax = _block_min_max(ids[:, tk - tq:], block_q)  # [B, nq]
    kmin, kmax = _block_min_max(ids, block_k)  # [B, nk]
    nq, nk = qmin.shape[1], kmin.shape[1]
    meet = (qmin[:, :, None] <= kmax[:, None, :]) & (kmin[:, None, :] <= qmax[:, :, None])  # [B, nq, nk]

    def first_last(m, size):  # first True index (size if none) and one past the last (0 if none)
        idx = jnp.arange(size, dtype=jnp.int32)
        first = jnp.min(jnp.where(m, idx, size), axis=-1)
        last = jnp.max(jnp.where(m, idx + 1, 0), axis=-1)
        return first.astype(jnp.int32), last.astype(jnp.int32)

    kv_lo, kv_hi = first_last(meet, nk)
    q_lo, q_hi = first_last(meet.transpose(0, 2, 1), nq)
    return kv_lo, kv_hi, q_lo, q_hi
