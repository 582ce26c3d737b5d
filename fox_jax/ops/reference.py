"""Dense float32 oracles for forgetting attention (docs/design/fox_acp.md §1.7).

These materialise the [B, H, Tq, Tk] logits and exist for tests and for tiny problems only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def decay_cumsum(log_fgate: jax.Array, seq_start: jax.Array | None = None) -> jax.Array:
    """Λ = cumsum(log f) over time, in float32, with log f zeroed before ``seq_start``.

    Args:
      log_fgate: [B, Tk, H] float32 log forget gates (≤ 0).
      seq_start: optional [B] int; gates of positions t < seq_start[b] are set to 0 before the sum
        (the official op does this so masked values do not affect the cumsum's precision).

    Returns:
      [B, Tk, H] float32 Λ. The reverse-mode derivative is a float32 reverse cumulative sum
      (``jax.lax.cumsum(..., reverse=True)``), not "total minus cumsum".
    """
    lf = log_fgate.astype(jnp.float32)
    if seq_start is not None:
        t = jnp.arange(lf.shape[1])
        lf = jnp.where(t[None, :, None] >= seq_start[:, None, None], lf, 0.0)
    return jnp.cumsum(lf, axis=1)


def attention_mask(
    tq: int,
    tk: int,
    *,
    seq_start: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    window_size: int | None = None,
    batch: int = 1,
) -> jax.Array:
    """Boolean visibility mask [B, Tq, Tk]: causal with bottom-right alignment (query i sits at
    absolute position Tk − Tq + i), keys before ``seq_start`` invisible, no attention across
    ``segment_ids``, and with ``window_size`` W only the last W keys: 0 ≤ (Tk − Tq + i) − j < W."""
    offset = tk - tq
    qpos = offset + jnp.arange(tq)
    kpos = jnp.arange(tk)
    mask = (qpos[:, None] >= kpos[None, :])[None]
    if window_size is not None:
        mask = mask & (qpos[:, None] - kpos[None, :] < window_size)[None]
    mask = jnp.broadcast_to(mask, (batch, tq, tk))
    if seq_start is not None:
        mask = mask & (kpos[None, None, :] >= seq_start[:, None, None])
    if segment_ids is not None:
        seg_q = segment_ids[:, offset:]
        mask = mask & (seg_q[:, :, None] == segment_ids[:, None, :])
    return mask


def forgetting_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_fgate: jax.Array,
    *,
    sm_scale: float | None = None,
    seq_start: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    prune_threshold: jax.Array | None = None,
    window_size: int | None = None,
) -> jax.Array:
    """Dense forgetting attention, everything in float32 (the test oracle).

    o_i = Σ_j softmax_j(scale·q_i·k_j + Λ_i − Λ_j) v_j over visible j (docs/design/fox_acp.md §1.1).

    Args:
      q: [B, Tq, H, D]; k, v: [B, Tk, Hkv, D] with H a multiple of Hkv; log_fgate: [B, Tk, H].
      sm_scale: logit scale, default 1/√D.
      seq_start: [B] int, left padding; segment_ids: [B, Tk] int, packed documents.
      prune_threshold: optional [B, H] float32; (i, j) with Λ_i − Λ_j < threshold are dropped
        *elementwise* (the ideal ACP result that block pruning approximates from above).
      window_size: optional int W ≥ 1, sliding window: query i (at absolute position Tk − Tq + i)
        sees key j only if 0 ≤ (Tk − Tq + i) − j < W.

    Returns:
      [B, Tq, H, D] float32. Rows with no visible key are 0.
    """
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    group = h // hkv
    qf = q.astype(jnp.float32)
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    lam = decay_cumsum(log_fgate, seq_start)  # [B, Tk, H]
    lam_q = lam[:, tk - tq:]
    s = jnp.einsum("bihd,bjhd->bhij", qf, kf, precision=jax.lax.Precision.HIGHEST) * scale
    decay = lam_q.transpose(0, 2, 1)[:, :, :, None] - lam.transpose(0, 2, 1)[:, :, None, :]
    s = s + decay
    mask = attention_mask(tq, tk, seq_start=seq_start, segment_ids=segment_ids, window_size=window_size,
                          batch=b)[:, None]
    if prune_threshold is not None:
        mask = mask & (decay >= prune_threshold[:, :, None, None])
    s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1) * mask  # empty rows: uniform * 0 = 0, finite gradients
    return jnp.einsum("bhij,bjhd->bihd", p, vf, precision=jax.lax.Precision.HIGHEST)


def decode_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    lo: jax.Array,
    hi: jax.Array,
    valid: jax.Array | None = None,
    lam_q: tuple[jax.Array, jax.Array] | None = None,
    lam_k: tuple[jax.Array, jax.Array] | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
    """Dense float32 oracle of ``fox_jax.ops.decode_attention`` (one query per row and head over a ring).

    Independent of the op's paths: it gathers the live keys of each (row, kv head) in *logical* order
    (key j of [lo, hi) from slot j mod C) and takes a plain softmax over them,

        o = Σ_j softmax_j(scale·q·k_j + (Λq_hi − Λk_hi,j) + (Λq_lo − Λk_lo,j)) v_j      (FoX Eq. 4–6)

    Args:
      q: [B, Hkv, G, D]; k, v: [B, Hkv, C, D]; lo, hi: [B, Hkv] int with 0 ≤ lo, 0 ≤ hi − lo ≤ C;
      valid: optional [B, nt, C] bool (nt ∈ {1, Hkv}); lam_q: optional (hi, lo) pair of [B, Hkv, G]
      float32; lam_k: optional (hi, lo) pair of [B, Hkv, G, C] float32; sm_scale: default 1/√D.

    Returns:
      [B, Hkv, G, D] float32; 0 for a query with no visible key.
    """
    b, hkv, grp, d = q.shape
    cap = k.shape[2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    lo = jnp.asarray(lo, jnp.int32)
    t = jnp.arange(cap, dtype=jnp.int32)
    slot = (lo[..., None] + t) % cap                                     # [B, Hkv, C]: slot of the t-th live key
    live = t < (jnp.asarray(hi, jnp.int32) - lo)[..., None]
    if valid is not None:
        live = live & jnp.take_along_axis(jnp.broadcast_to(valid, (b, hkv, cap)), slot, axis=2)
    gather = lambda x: jnp.take_along_axis(x.astype(jnp.float32), slot[..., None], axis=2)  # noqa: E731
    kk, vv = gather(k), gather(v)                                       # [B, Hkv, C, D] in logical order
    s = jnp.einsum("bhgd,bhtd->bhgt", q.astype(jnp.float32), kk, precision=jax.lax.Precision.HIGHEST) * scale
    if lam_k is not None:
        lk_hi, lk_lo = (jnp.take_along_axis(x, slot[:, :, None, :], axis=3) for x in lam_k)
        s = s + ((lam_q[0][..., None] - lk_hi) + (lam_q[1][..., None] - lk_lo))
    mask = live[:, :, None, :]
    p = jax.nn.softmax(jnp.where(mask, s, jnp.finfo(jnp.float32).min), axis=-1) * mask  # no key: 0
    return jnp.einsum("bhgt,bhtd->bhgd", p, vv, precision=jax.lax.Precision.HIGHEST)
