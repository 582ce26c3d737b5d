"""Decode attention: one new query per row over a ring buffer (or slot pool) of cached keys.

    o_{b,n,g} = Σ_i softmax_i(scale·q_{b,n,g}·k_{b,n,i} + (Λq_{b,n,g} − Λk_{b,n,g,i})) v_{b,n,i}

over the logical keys i ∈ [lo, hi) of row b and key/value head n (FoX Eq. 4–6; no decay term without Λ).
Logical key i lives in physical slot i mod C, so a ring buffer is read across its wrap without a copy. This
is the one function every cache's decode step (T = 1) calls (``fox_jax.cache.slots``).

This build carries the XLA path only (masked einsums over all C slots, float32 softmax): the reference and
the CPU path. The Pallas flash-decoding kernel (split over the key range, partial (o, m, l) combined) and the
cuDNN form plug in behind ``implementation``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fox_jax.ops._common import dot_precision

IMPLEMENTATIONS = ("auto", "xla")


def _check(q, k, v, lo, hi, valid, lam_q, lam_k, implementation) -> None:
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q must be [B, Hkv, G, D] and k/v [B, Hkv, C, D], got q {q.shape}, k {k.shape}")
    b, hkv, g, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, hkv) or k.shape[3] != d:
        raise ValueError(f"k and v must be [B, Hkv, C, D] = [{b}, {hkv}, C, {d}] to match q {q.shape}, "
                         f"got k {k.shape}, v {v.shape}")
    for name, x in (("lo", lo), ("hi", hi)):
        if x.shape != (b, hkv) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an int array [B, Hkv] = {(b, hkv)}, got {x.dtype}{x.shape}")
    c = k.shape[2]
    if valid is not None and (valid.ndim != 3 or valid.shape[0] != b or valid.shape[1] not in (1, hkv)
                              or valid.shape[2] != c or valid.dtype != jnp.bool_):
        raise ValueError(f"valid must be bool [B, 1 or Hkv, C] = [{b}, 1|{hkv}, {c}], got {valid.dtype}{valid.shape}")
    if (lam_q is None) != (lam_k is None):
        raise ValueError("lam_q and lam_k must be given together (the decay of the query and of each key)")
    if lam_q is not None:
        for name, pair, shape in (("lam_q", lam_q, (b, hkv, g)), ("lam_k", lam_k, (b, hkv, g, c))):
            if len(pair) != 2 or any(x.shape != shape or x.dtype != jnp.float32 for x in pair):
                raise ValueError(f"{name} must be a (hi, lo) pair of float32 {list(shape)}, "
                                 f"got {[(x.dtype, x.shape) for x in pair]}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} in this build, got {implementation!r}")


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, lo: jax.Array, hi: jax.Array,
                     valid: jax.Array | None = None, lam_q=None, lam_k=None, sm_scale: float | None = None,
                     implementation: str = "auto", block_k: int | None = None,
                     num_splits: int | None = None) -> jax.Array:
    """Attention of one query per row and head over the keys [lo, hi) of a ring buffer.

    Args:
      q: [B, Hkv, G, D], one query per row; G = H // Hkv query heads per key/value head (compute dtype).
      k, v: [B, Hkv, C, D] ring buffers (compute dtype); logical key index i lives in physical slot i mod C.
      lo, hi: [B, Hkv] int32, the logical range [lo, hi) to read (0 ≤ hi − lo ≤ C; hi ≤ lo reads nothing).
      valid: optional bool [B, nt, C], nt ∈ {1, Hkv}: the physical slots that hold a key (slot pools).
      lam_q: optional (hi, lo) pair, each [B, Hkv, G] float32: Λ of the query (a float32 pair,
        ``fox_jax.cache.decay``); lam_k: the matching pair, each [B, Hkv, G, C]: Λ of the key in each
        slot. The bias (q_hi − k_hi) + (q_lo − k_lo) is added to scale·q·k.
      sm_scale: logit scale, default 1/√D.
      implementation: "xla" (masked einsums over all C, float32 softmax) or "auto" (the XLA path in this
        build).
      block_k, num_splits: tiling of a kernel implementation (ignored by the XLA path).

    Returns:
      o [B, Hkv, G, D] in q's dtype; a query with no visible key outputs 0.

    Raises:
      ValueError: shapes or dtypes that do not match (one line naming the argument), an unknown
        implementation.
    """
    _check(q, k, v, lo, hi, valid, lam_q, lam_k, implementation)
    del block_k, num_splits
    d, c = q.shape[3], k.shape[2]
    scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    hi = hi.astype(jnp.int32)[..., None]
    logical = hi - 1 - jnp.mod(hi - 1 - jnp.arange(c, dtype=jnp.int32), c)   # [B, Hkv, C]: the one in [hi − C, hi)
    mask = logical >= lo.astype(jnp.int32)[..., None]
    if valid is not None:
        mask = mask & valid
    prec = dot_precision(q.dtype)
    scores = jnp.einsum("bngd,bncd->bngc", q, k.astype(q.dtype), preferred_element_type=jnp.float32,
                        precision=prec) * scale
    if lam_q is not None:
        scores = scores + ((lam_q[0][..., None] - lam_k[0]) + (lam_q[1][..., None] - lam_k[1]))
    scores = jnp.where(mask[:, :, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    w = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(w, axis=-1, keepdims=True)
    o = jnp.einsum("bngc,bncd->bngd", (w / jnp.where(l > 0, l, 1.0)).astype(v.dtype), v,
                   preferred_element_type=jnp.float32, precision=prec)
    return o.astype(q.dtype)


__all__ = ["IMPLEMENTATIONS", "decode_attention"]
