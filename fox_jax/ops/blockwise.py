"""Blockwise (flash-style) forgetting attention in pure JAX: ``implementation="xla"``.

The same algorithm as the Pallas kernels (kernels/forgetting_attention.py), written with XLA ops so it
runs everywhere and CPU CI covers the block logic:

* forward: for each query block (sequentially, ``lax.map``) a ``fori_loop`` over the key blocks
  ``[lo, causal_end)`` with an online softmax in float32; the decay Λ_i − Λ_j is added in float32;
  the log-sum-exp is saved. Memory is O(B·H·block_q·block_k) per step, never O(T²).
* backward (``jax.custom_vjp``): δ_i = Σ o_i·do_i, then a dQ pass (query blocks over key blocks) and a
  dK/dV pass (key blocks over query blocks); the decay gradient dΛ_t = Σ_j dS_tj − Σ_i dS_it comes from
  the row sums (dQ pass) and column sums (dK/dV pass) of dS. The caller differentiates Λ = cumsum(log f),
  which XLA turns into a float32 reverse cumsum.
* ACP: ``kv_start`` [B, H, nq] / ``q_end`` [B, H, nk] (fox_jax.ops.acp) skip the pruned tiles. The loop
  bounds are shared by the batch and heads of one block (min/max over them); tiles pruned for a
  particular (b, h) are masked out exactly, so the result equals a kernel that does not compute them.
* segment ids: document-aware skipping with the Pallas kernels' rule (``acp.segment_block_bounds``:
  tiles before the first / after the last block whose segment-id range meets the query (key) block's
  are not visited; min/max over the batch as for ACP). Valid for any ids, tight for packed documents.

Rows with no visible key output 0 and carry lse = −inf; no NaN or inf enters a matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fox_jax.ops import acp as _acp
from fox_jax.ops._common import dot_precision as _dot_precision, pad_axis as _pad_axis, round_up as _round_up

_NEG_INF = float("-inf")


class _Geometry:
    """Static block geometry of one call."""

    def __init__(self, tq, tk, h, hkv, block_q, block_k):
        self.tq, self.tk, self.h, self.hkv = tq, tk, h, hkv
        self.group = h // hkv
        self.bq = min(block_q, _round_up(tq, 8))
        self.bk = min(block_k, _round_up(tk, 8))
        self.nq = -(-tq // self.bq)
        self.nk = -(-tk // self.bk)
        self.offset = tk - tq

    def causal_end(self, m):
        """One past the last key block query block m can see (traced int)."""
        last_row = jnp.minimum(self.offset + (m + 1) * self.bq - 1, self.tk - 1)
        return jnp.minimum(last_row // self.bk + 1, self.nk)

    def causal_q_start(self, n):
        """First query block that can see key block n (traced int)."""
        first_col = n * self.bk
        return jnp.clip((first_col - self.offset) // self.bq, 0, self.nq)


def _tile_mask(g: _Geometry, m, n, seq_start, seg_q_blk, seg_k_blk, kv_start_bh, q_end_bh):
    """[B, H or 1, bq, bk] visibility of tile (m, n)."""
    qpos = g.offset + m * g.bq + jnp.arange(g.bq)
    kpos = n * g.bk + jnp.arange(g.bk)
    mask = (qpos[:, None] >= kpos[None, :]) & (kpos[None, :] < g.tk) & (qpos[:, None] < g.tk)
    mask = mask[None, None]  # [1, 1, bq, bk]
    mask = mask & (kpos[None, None, None, :] >= seq_start[:, None, None, None])
    if seg_q_blk is not None:
        mask = mask & (seg_q_blk[:, None, :, None] == seg_k_blk[:, None, None, :])
    if kv_start_bh is not None:  # ACP, forward/dQ orientation: [B, H]
        mask = mask & (n >= kv_start_bh)[:, :, None, None]
    if q_end_bh is not None:  # ACP, dK/dV orientation: [B, H]
        mask = mask & (m < q_end_bh)[:, :, None, None]
    return mask


def _scores(q_blk, k_blk, lam_q_blk, lam_k_blk, scale, group):
    """s = scale·q·kᵀ + Λ_i − Λ_j in float32, [B, H, bq, bk]."""
    if group > 1:
        k_blk = jnp.repeat(k_blk, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q_blk, k_blk, preferred_element_type=jnp.float32,
                   precision=_dot_precision(q_blk.dtype))
    decay = lam_q_blk.transpose(0, 2, 1)[:, :, :, None] - lam_k_blk.transpose(0, 2, 1)[:, :, None, :]
    return s * scale + decay


def _slice(x, start, size, axis=1):
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _prepare(q, k, v, lam, segment_ids, g: _Geometry):
    tq_pad, tk_pad = g.nq * g.bq, g.nk * g.bk
    lam_q = lam[:, g.offset:]
    qp = _pad_axis(q, 1, tq_pad)
    lam_qp = _pad_axis(lam_q, 1, tq_pad)
    kp = _pad_axis(k, 1, tk_pad)
    vp = _pad_axis(v, 1, tk_pad)
    lam_kp = _pad_axis(lam, 1, tk_pad)
    if segment_ids is not None:
        seg_q = _pad_axis(segment_ids[:, g.offset:], 1, tq_pad, value=-1)
        seg_k = _pad_axis(segment_ids, 1, tk_pad, value=-2)
    else:
        seg_q = seg_k = None
    return qp, kp, vp, lam_qp, lam_kp, seg_q, seg_k


def _segment_bounds(segment_ids, g: _Geometry):
    """(kv_lo, kv_hi [B, nq], q_lo, q_hi [B, nk]) int32 document-aware block ranges, or None."""
    if segment_ids is None:
        return None
    return _acp.segment_block_bounds(segment_ids, tq=g.tq, block_q=g.bq, block_k=g.bk)


def _forward(q, k, v, lam, seq_start, segment_ids, kv_start, scale, block_q, block_k):
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = _Geometry(tq, tk, h, hkv, block_q, block_k)
    qp, kp, vp, lam_qp, lam_kp, seg_q, seg_k = _prepare(q, k, v, lam, segment_ids, g)
    prec = _dot_precision(q.dtype)
    min_seq_block = jnp.min(seq_start) // g.bk
    sb = _segment_bounds(segment_ids, g)

    def one_query_block(m):
        q_blk = _slice(qp, m * g.bq, g.bq)
        lam_q_blk = _slice(lam_qp, m * g.bq, g.bq)
        seg_q_blk = None if seg_q is None else _slice(seg_q, m * g.bq, g.bq)
        start_bh = None if kv_start is None else kv_start[:, :, m]
        lo = min_seq_block if start_bh is None else jnp.maximum(min_seq_block, jnp.min(start_bh))
        hi = g.causal_end(m)
        if sb is not None:
            lo = jnp.maximum(lo, jnp.min(sb[0][:, m]))
            hi = jnp.minimum(hi, jnp.max(sb[1][:, m]))

        def body(n, carry):
            m_i, l_i, acc = carry
            k_blk = _slice(kp, n * g.bk, g.bk)
            v_blk = _slice(vp, n * g.bk, g.bk)
            lam_k_blk = _slice(lam_kp, n * g.bk, g.bk)
            seg_k_blk = None if seg_k is None else _slice(seg_k, n * g.bk, g.bk)
            s = _scores(q_blk, k_blk, lam_q_blk, lam_k_blk, scale, g.group)
            mask = _tile_mask(g, m, n, seq_start, seg_q_blk, seg_k_blk, start_bh, None)
            s = jnp.where(mask, s, _NEG_INF)
            m_new = jnp.maximum(m_i, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m_i - m_safe)
            l_new = l_i * alpha + jnp.sum(p, axis=-1)
            v_rep = jnp.repeat(v_blk, g.group, axis=2) if g.group > 1 else v_blk
            pv = jnp.einsum("bhqk,bkhd->bhqd", p.astype(v.dtype), v_rep,
                            preferred_element_type=jnp.float32, precision=prec)
            return m_new, l_new, acc * alpha[..., None] + pv

        init = (jnp.full((b, h, g.bq), _NEG_INF, jnp.float32), jnp.zeros((b, h, g.bq), jnp.float32),
                jnp.zeros((b, h, g.bq, d), jnp.float32))
        m_i, l_i, acc = lax.fori_loop(lo, hi, body, init)
        empty = l_i == 0.0
        o = acc / jnp.where(empty, 1.0, l_i)[..., None]
        lse = jnp.where(empty, _NEG_INF, m_i + jnp.log(jnp.where(empty, 1.0, l_i)))
        return o.transpose(0, 2, 1, 3).astype(q.dtype), lse.transpose(0, 2, 1)

    o, lse = lax.map(one_query_block, jnp.arange(g.nq))  # [nq, B, bq, H, D], [nq, B, bq, H]
    o = o.transpose(1, 0, 2, 3, 4).reshape(b, g.nq * g.bq, h, d)[:, :tq]
    lse = lse.transpose(1, 0, 2, 3).reshape(b, g.nq * g.bq, h)[:, :tq]
    return o, lse


def _backward(q, k, v, lam, seq_start, segment_ids, kv_start, q_end, o, lse, do, scale, block_q, block_k):
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = _Geometry(tq, tk, h, hkv, block_q, block_k)
    qp, kp, vp, lam_qp, lam_kp, seg_q, seg_k = _prepare(q, k, v, lam, segment_ids, g)
    prec = _dot_precision(q.dtype)
    tq_pad = g.nq * g.bq
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, Tq, H]
    delta = _pad_axis(delta, 1, tq_pad)
    lse_safe = _pad_axis(jnp.where(jnp.isfinite(lse), lse, 0.0), 1, tq_pad)
    dop = _pad_axis(do, 1, tq_pad)
    min_seq_block = jnp.min(seq_start) // g.bk
    sb = _segment_bounds(segment_ids, g)

    def probs(m, n, q_blk, k_blk, lam_q_blk, lam_k_blk, lse_blk, seg_q_blk, seg_k_blk, start_bh, end_bh):
        s = _scores(q_blk, k_blk, lam_q_blk, lam_k_blk, scale, g.group)
        mask = _tile_mask(g, m, n, seq_start, seg_q_blk, seg_k_blk, start_bh, end_bh)
        s = jnp.where(mask, s, _NEG_INF)
        return jnp.exp(s - lse_blk.transpose(0, 2, 1)[..., None])  # [B, H, bq, bk]

    # dQ (and the query-side decay gradient): query blocks over key blocks ------------------------
    def dq_block(m):
        q_blk = _slice(qp, m * g.bq, g.bq)
        do_blk = _slice(dop, m * g.bq, g.bq)
        lam_q_blk = _slice(lam_qp, m * g.bq, g.bq)
        lse_blk = _slice(lse_safe, m * g.bq, g.bq)
        delta_blk = _slice(delta, m * g.bq, g.bq).transpose(0, 2, 1)  # [B, H, bq]
        seg_q_blk = None if seg_q is None else _slice(seg_q, m * g.bq, g.bq)
        start_bh = None if kv_start is None else kv_start[:, :, m]
        lo = min_seq_block if start_bh is None else jnp.maximum(min_seq_block, jnp.min(start_bh))
        hi = g.causal_end(m)
        if sb is not None:
            lo = jnp.maximum(lo, jnp.min(sb[0][:, m]))
            hi = jnp.minimum(hi, jnp.max(sb[1][:, m]))

        def body(n, carry):
            dq, dlam = carry
            k_blk = _slice(kp, n * g.bk, g.bk)
            v_blk = _slice(vp, n * g.bk, g.bk)
            lam_k_blk = _slice(lam_kp, n * g.bk, g.bk)
            seg_k_blk = None if seg_k is None else _slice(seg_k, n * g.bk, g.bk)
            p = probs(m, n, q_blk, k_blk, lam_q_blk, lam_k_blk, lse_blk, seg_q_blk, seg_k_blk, start_bh, None)
            v_rep = jnp.repeat(v_blk, g.group, axis=2) if g.group > 1 else v_blk
            k_rep = jnp.repeat(k_blk, g.group, axis=2) if g.group > 1 else k_blk
            dp = jnp.einsum("bqhd,bkhd->bhqk", do_blk, v_rep, preferred_element_type=jnp.float32,
                            precision=prec)
            ds = p * (dp - delta_blk[..., None])
            dq = dq + jnp.einsum("bhqk,bkhd->bqhd", ds.astype(k.dtype), k_rep,
                                 preferred_element_type=jnp.float32, precision=prec)
            return dq, dlam + jnp.sum(ds, axis=-1)

        init = (jnp.zeros((b, g.bq, h, d), jnp.float32), jnp.zeros((b, h, g.bq), jnp.float32))
        dq, dlam = lax.fori_loop(lo, hi, body, init)
        return dq * scale, dlam.transpose(0, 2, 1)

    dq, dlam_q = lax.map(dq_block, jnp.arange(g.nq))
    dq = dq.transpose(1, 0, 2, 3, 4).reshape(b, tq_pad, h, d)[:, :tq]
    dlam_q = dlam_q.transpose(1, 0, 2, 3).reshape(b, tq_pad, h)[:, :tq]

    # dK/dV (and the key-side decay gradient): key blocks over query blocks -----------------------
    def dkv_block(n):
        k_blk = _slice(kp, n * g.bk, g.bk)
        v_blk = _slice(vp, n * g.bk, g.bk)
        lam_k_blk = _slice(lam_kp, n * g.bk, g.bk)
        seg_k_blk = None if seg_k is None else _slice(seg_k, n * g.bk, g.bk)
        end_bh = None if q_end is None else q_end[:, :, n]
        hi = g.nq if end_bh is None else jnp.max(end_bh)
        # key blocks entirely before every row's seq_start see no query: an empty loop
        hi = jnp.where(n < min_seq_block, 0, hi)
        lo = g.causal_q_start(n)
        if sb is not None:
            lo = jnp.maximum(lo, jnp.min(sb[2][:, n]))
            hi = jnp.minimum(hi, jnp.max(sb[3][:, n]))

        def body(m, carry):
            dk, dv, dlam = carry
            q_blk = _slice(qp, m * g.bq, g.bq)
            do_blk = _slice(dop, m * g.bq, g.bq)
            lam_q_blk = _slice(lam_qp, m * g.bq, g.bq)
            lse_blk = _slice(lse_safe, m * g.bq, g.bq)
            delta_blk = _slice(delta, m * g.bq, g.bq).transpose(0, 2, 1)
            seg_q_blk = None if seg_q is None else _slice(seg_q, m * g.bq, g.bq)
            p = probs(m, n, q_blk, k_blk, lam_q_blk, lam_k_blk, lse_blk, seg_q_blk, seg_k_blk, None, end_bh)
            v_rep = jnp.repeat(v_blk, g.group, axis=2) if g.group > 1 else v_blk
            dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p.astype(do.dtype), do_blk,
                                 preferred_element_type=jnp.float32, precision=prec)
            dp = jnp.einsum("bqhd,bkhd->bhqk", do_blk, v_rep, preferred_element_type=jnp.float32,
                            precision=prec)
            ds = p * (dp - delta_blk[..., None])
            dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds.astype(q.dtype), q_blk,
                                 preferred_element_type=jnp.float32, precision=prec)
            return dk, dv, dlam - jnp.sum(ds, axis=-2)

        init = (jnp.zeros((b, g.bk, h, d), jnp.float32), jnp.zeros((b, g.bk, h, d), jnp.float32),
                jnp.zeros((b, h, g.bk), jnp.float32))
        dk, dv, dlam = lax.fori_loop(lo, hi, body, init)
        if g.group > 1:  # GQA: sum the query heads of each key/value head, in float32
            dk = dk.reshape(b, g.bk, hkv, g.group, d).sum(axis=3)
            dv = dv.reshape(b, g.bk, hkv, g.group, d).sum(axis=3)
        return dk * scale, dv, dlam.transpose(0, 2, 1)

    dk, dv, dlam_k = lax.map(dkv_block, jnp.arange(g.nk))
    tk_pad = g.nk * g.bk
    dk = dk.transpose(1, 0, 2, 3, 4).reshape(b, tk_pad, hkv, d)[:, :tk]
    dv = dv.transpose(1, 0, 2, 3, 4).reshape(b, tk_pad, hkv, d)[:, :tk]
    dlam = dlam_k.transpose(1, 0, 2, 3).reshape(b, tk_pad, h)[:, :tk]
    dlam = dlam.at[:, g.offset:].add(dlam_q)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dlam


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def blockwise_attention(q, k, v, lam, seq_start, segment_ids, acp_ranges, scale, block_q, block_k):
    """Blockwise forgetting attention on a precomputed decay Λ.

    Args:
      q: [B, Tq, H, D]; k, v: [B, Tk, Hkv, D]; lam: [B, Tk, H] float32 Λ (cumsum of log f).
      seq_start: [B] int32 (zeros when unused).
      segment_ids: [B, Tk] int32 or None.
      acp_ranges: None or a pair (kv_start [B, H, nq], q_end [B, H, nk]) int32 from fox_jax.ops.acp,
        computed with the same ``block_q`` / ``block_k``.
      scale: logit scale; block_q, block_k: tile sizes (static).

    Returns:
      [B, Tq, H, D] in q's dtype. Differentiable in q, k, v and lam.
    """
    kv_start = None if acp_ranges is None else acp_ranges[0]
    return _forward(q, k, v, lam, seq_start, segment_ids, kv_start, scale, block_q, block_k)[0]


def _fwd(q, k, v, lam, seq_start, segment_ids, acp_ranges, scale, block_q, block_k):
    kv_start = None if acp_ranges is None else acp_ranges[0]
    o, lse = _forward(q, k, v, lam, seq_start, segment_ids, kv_start, scale, block_q, block_k)
    return o, (q, k, v, lam, seq_start, segment_ids, acp_ranges, o, lse)


def _bwd(scale, block_q, block_k, res, do):
    q, k, v, lam, seq_start, segment_ids, acp_ranges, o, lse = res
    kv_start, q_end = (None, None) if acp_ranges is None else acp_ranges
    dq, dk, dv, dlam = _backward(q, k, v, lam, seq_start, segment_ids, kv_start, q_end, o, lse, do,
                                 scale, block_q, block_k)
    return dq, dk, dv, dlam, None, None, None


blockwise_attention.defvjp(_fwd, _bwd)


def block_sizes(tq: int, tk: int, block_q: int, block_k: int) -> tuple[int, int]:
    """The tile sizes ``blockwise_attention`` actually uses for these lengths."""
    g = _Geometry(tq, tk, 1, 1, block_q, block_k)
    return g.bq, g.bk
