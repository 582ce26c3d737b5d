"""Adaptive Computation Pruning (ACP): thresholds, block ranges and pruning statistics.

specs/fox_acp.md §5. With every logit bounded, |scale·q_i·k_j| ≤ U, dropping all (i, j) whose decay
D_ij = Λ_i − Λ_j is below

    δ = −(2U + log N) + log ε                                                   (§5.1)

removes at most ε of the attention weight of any query (N = key length). Because Λ is non-increasing,
the largest decay of a (query block, key block) tile sits at (its first query row r, its last key
column c'), so a tile is skipped iff Λ_r − Λ_c' < δ (§5.3). The skipped tiles form a staircase in the
lower-left of the causal triangle:

* forward / dQ: query block m visits key blocks ``[kv_start[m], causal_end[m])``;
* dK/dV: key block n visits query blocks ``[causal_start[n], q_end[n])``.

All index arrays are computed here, vectorised, from block-level Λ; kernels only consume them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

DEFAULT_LOG_EPSILON = -10.0


def threshold_from_bound(u: jax.Array, key_len: int, log_epsilon: float = DEFAULT_LOG_EPSILON) -> jax.Array:
    """δ = −(2U + log N) + log ε (specs/fox_acp.md §5.1), elementwise in U (float32)."""
    return -(2.0 * jnp.asarray(u, jnp.float32) + math.log(key_len)) + log_epsilon


def auto_threshold(
    q: jax.Array, k: jax.Array, sm_scale: float, log_epsilon: float = DEFAULT_LOG_EPSILON
) -> jax.Array:
    """The ``"auto"`` threshold: U_{b,h} = scale · max_i‖q_i‖ · max_j‖k_j‖ from the actual tensors.

    Args:
      q: [B, Tq, H, D]; k: [B, Tk, Hkv, D] (H a multiple of Hkv).
    Returns:
      [B, H] float32 δ, treated as a constant (no gradient).
    """
    q = jax.lax.stop_gradient(q).astype(jnp.float32)
    k = jax.lax.stop_gradient(k).astype(jnp.float32)
    qn = jnp.sqrt(jnp.max(jnp.sum(q * q, axis=-1), axis=1))  # [B, H]
    kn = jnp.sqrt(jnp.max(jnp.sum(k * k, axis=-1), axis=1))  # [B, Hkv]
    kn = jnp.repeat(kn, q.shape[2] // k.shape[2], axis=1)
    return threshold_from_bound(sm_scale * qn * kn, k.shape[1], log_epsilon)


def qk_norm_threshold(
    q_norm_weight: jax.Array,
    k_norm_weight: jax.Array,
    key_len: int,
    *,
    sm_scale: float | None = None,
    log_epsilon: float = DEFAULT_LOG_EPSILON,
) -> jax.Array:
    """Weight-based bound for QK-norm models (specs/fox_acp.md §5.2).

    After RMS normalisation ‖q‖ ≤ √D·max|w_q| (eps only shrinks it), so
    U_h = scale · D · max|w_q,h| · max|w_k,h|  (= √D·max|w_q,h|·max|w_k,h| at scale 1/√D).

    Args:
      q_norm_weight, k_norm_weight: [H, D] per-head scales, or [D] shared across heads.
      key_len: N, the number of keys.
    Returns:
      [H] float32 δ (or a scalar for shared weights); broadcast it to [B, H].
    """
    d = q_norm_weight.shape[-1]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    wq = jnp.max(jnp.abs(jax.lax.stop_gradient(q_norm_weight).astype(jnp.float32)), axis=-1)
    wk = jnp.max(jnp.abs(jax.lax.stop_gradient(k_norm_weight).astype(jnp.float32)), axis=-1)
    return threshold_from_bound(scale * d * wq * wk, key_len, log_epsilon)


def resolve_threshold(
    adaptive_threshold: Any,
    q: jax.Array,
    k: jax.Array,
    sm_scale: float,
    log_epsilon: float = DEFAULT_LOG_EPSILON,
) -> jax.Array | None:
    """Turn the op's ``adaptive_threshold`` argument into a [B, H] float32 δ ≤ 0 (or None).

    Accepts None, ``"auto"``, a Python float, or an array broadcastable to [B, H]. δ is clipped to
    ≤ 0 so that tiles touching the diagonal (decay 0) are never pruned.

    Raises:
      ValueError: an unknown string or an array that does not broadcast to [B, H].
    """
    if adaptive_threshold is None:
        return None
    b, h = q.shape[0], q.shape[2]
    if isinstance(adaptive_threshold, str):
        if adaptive_threshold != "auto":
            raise ValueError(
                f"adaptive_threshold must be None, 'auto', a float or an array broadcastable to [B, H]; "
                f"got the string {adaptive_threshold!r}")
        delta = auto_threshold(q, k, sm_scale, log_epsilon)
    else:
        delta = jnp.asarray(adaptive_threshold, jnp.float32)
        try:
            delta = jnp.broadcast_to(delta, (b, h))
        except ValueError:
            raise ValueError(
                f"adaptive_threshold of shape {delta.shape} does not broadcast to [B, H] = {(b, h)}") from None
    return jnp.minimum(jax.lax.stop_gradient(delta), 0.0)


def _row_starts(tq: int, tk: int, block_q: int) -> jax.Array:
    """Absolute position of the first query row of each query block (bottom-right alignment)."""
    nq = -(-tq // block_q)
    return (tk - tq) + jnp.arange(nq) * block_q


def _col_ends(tk: int, block_k: int) -> jax.Array:
    nk = -(-tk // block_k)
    return jnp.minimum(jnp.arange(nk) * block_k + block_k - 1, tk - 1)


def kv_block_start(lam: jax.Array, delta: jax.Array, *, tq: int, block_q: int, block_k: int) -> jax.Array:
    """First key block each query block must visit (forward and dQ).

    Args:
      lam: [B, Tk, H] float32 Λ.
      delta: [B, H] float32 threshold (≤ 0).
      tq: number of queries (queries are the last tq positions).
    Returns:
      [B, H, nq] int32, nq = ceil(tq / block_q): the number of leading key blocks whose tile
      decay Λ_r − Λ_c' is below δ (a prefix, because the decay grows with the key block).
    """
    tk = lam.shape[1]
    lam_bh = lam.transpose(0, 2, 1)  # [B, H, Tk]
    lam_r = lam_bh[:, :, _row_starts(tq, tk, block_q)]  # [B, H, nq]
    lam_c = lam_bh[:, :, _col_ends(tk, block_k)]  # [B, H, nk]
    pruned = (lam_r[..., :, None] - lam_c[..., None, :]) < delta[..., None, None]
    return jnp.sum(pruned, axis=-1, dtype=jnp.int32)


def q_block_end(lam: jax.Array, delta: jax.Array, *, tq: int, block_q: int, block_k: int) -> jax.Array:
    """One past the last query block each key block must visit (dK/dV).

    Uses the same tile test as ``kv_block_start`` (tile (m, n) is computed iff
    Λ_{r_m} − Λ_{c'_n} ≥ δ), so with equal block sizes both backward passes see the same tiles.

    Returns:
      [B, H, nk] int32 in [0, nq].
    """
    tk = lam.shape[1]
    lam_bh = lam.transpose(0, 2, 1)
    lam_r = lam_bh[:, :, _row_starts(tq, tk, block_q)]  # [B, H, nq]
    lam_c = lam_bh[:, :, _col_ends(tk, block_k)]  # [B, H, nk]
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
