"""Blockwise (flash-style) attention in pure JAX: forgetting attention (``implementation="xla"``) and
DCP attention (``context_pruning.dcp_attention``), one core.

The same algorithm as the Pallas kernels (kernels/forgetting_attention.py), written with XLA ops so it
runs everywhere and CPU CI covers the block logic. The logits of a (query i, key j) pair are

    s_ij = scale·q_i·k_j [+ log I_ij] [+ Λ_i − Λ_j]

with the optional DCP log mask log I [B, Tq, Tk] (shared by the heads, docs/design/dcp.md §1.4) and
the optional forgetting-attention decay, Λ = cumsum(log f) (docs/design/fox_acp.md §1.1).

* forward: for each query block (sequentially, ``lax.map``) a ``fori_loop`` over the key blocks it
  visits, with an online softmax in float32; the log-sum-exp is saved. Memory is
  O(B·H·block_q·block_k) per step, never O(T²) (the mask itself is the caller's).
* backward (``jax.custom_vjp``): δ_i = Σ o_i·do_i, then a dQ pass (query blocks over key blocks) and a
  dK/dV pass (key blocks over query blocks). The decay gradient dΛ_t = Σ_j dS_tj − Σ_i dS_it comes
  from the row sums (dQ pass) and column sums (dK/dV pass) of dS (fox_acp.md §1.6); the caller
  differentiates Λ = cumsum(log f), which XLA turns into a float32 reverse cumsum. The mask gradient
  d log I = Σ_h dS comes from the dQ pass.
* which tiles are visited: ``fox_jax.ops.tiles.TileVisits`` (causal, seq_start, sliding window, ACP,
  document bounds, DCP live tiles). The loops are shared by the batch rows and heads (a tile is visited if any of them
  needs it, ``TileVisits.schedule``); the tiles a particular (b, h) does not need are masked out
  exactly (``TileVisits.tile_kept``), so the result equals a kernel that does not compute them.

Pairs that are not visible (causal, sliding window, seq_start, same document) or whose logit is −inf weigh exactly 0;
rows with no such pair output 0 and carry lse = −inf; no NaN or inf enters a matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fox_jax.ops._common import dot_precision, name_attention_residuals, pad_axis, round_up
from fox_jax.ops.tiles import TileVisits

_NEG_INF = float("-inf")


class _Geometry:
    """Static block geometry of one call."""

    def __init__(self, tq, tk, h, hkv, block_q, block_k):
        self.tq, self.tk, self.h, self.hkv = tq, tk, h, hkv
        self.group = h // hkv
        self.bq = min(block_q, round_up(tq, 8))
        self.bk = min(block_k, round_up(tk, 8))
        self.nq, self.nk = -(-tq // self.bq), -(-tk // self.bk)
        self.tq_pad, self.tk_pad = self.nq * self.bq, self.nk * self.bk
        self.offset = tk - tq


def block_sizes(tq: int, tk: int, block_q: int = 128, block_k: int = 128) -> tuple[int, int]:
    """The tile sizes ``blockwise_attention`` uses for these lengths (blocks shrink to round_up(T, 8))."""
    g = _Geometry(tq, tk, 1, 1, block_q, block_k)
    return g.bq, g.bk


def _slice(x, start, size, axis=1):
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


class _Blocks:
    """The inputs padded to whole tiles (padded queries and keys are masked out) and sliced by block."""

    def __init__(self, q, k, v, lam, log_mask, segment_ids, g: _Geometry):
        self.g = g
        self.q, self.k, self.v = pad_axis(q, 1, g.tq_pad), pad_axis(k, 1, g.tk_pad), pad_axis(v, 1, g.tk_pad)
        self.lam_q = self.lam_k = self.mask = self.seg_q = self.seg_k = None
        if lam is not None:  # Λ [B, Tk, H] -> [B, H, T_pad] for the queries and the keys; padding 0
            lam_t = lam.transpose(0, 2, 1)
            self.lam_q = pad_axis(lam_t[:, :, g.offset:], 2, g.tq_pad)
            self.lam_k = pad_axis(lam_t, 2, g.tk_pad)
        if log_mask is not None:
            self.mask = pad_axis(pad_axis(log_mask, 1, g.tq_pad), 2, g.tk_pad)
        if segment_ids is not None:
            self.seg_q = pad_axis(segment_ids[:, g.offset:], 1, g.tq_pad, value=-1)
            self.seg_k = pad_axis(segment_ids, 1, g.tk_pad, value=-2)

    def rows(self, x, m, axis=1):
        return None if x is None else _slice(x, m * self.g.bq, self.g.bq, axis)

    def cols(self, x, n, axis=1):
        return None if x is None else _slice(x, n * self.g.bk, self.g.bk, axis)

    def mask_tile(self, m, n):
        """[B, bq, bk] float32 log mask of tile (m, n), or None."""
        return None if self.mask is None else self.cols(self.rows(self.mask, m), n, axis=2)


def _tile_mask(g: _Geometry, m, n, visits: TileVisits, seg_q_blk, seg_k_blk, by_rows: bool):
    """[B, H or 1, bq, bk] visibility of tile (m, n): causal, in range, inside the sliding window,
    after seq_start, same document, and kept by ACP / DCP (``TileVisits.tile_kept``)."""
    qpos = g.offset + m * g.bq + jnp.arange(g.bq)
    kpos = n * g.bk + jnp.arange(g.bk)
    mask = (qpos[:, None] >= kpos[None, :]) & (kpos[None, :] < g.tk) & (qpos[:, None] < g.tk)
    if visits.window_size is not None:
        mask = mask & (qpos[:, None] - kpos[None, :] < visits.window_size)
    mask = mask[None, None]  # [1, 1, bq, bk]
    if visits.seq_start is not None:
        mask = mask & (kpos[None, None, None, :] >= visits.seq_start[:, None, None, None])
    if seg_q_blk is not None:
        mask = mask & (seg_q_blk[:, None, :, None] == seg_k_blk[:, None, None, :])
    keep = visits.tile_kept(m, n, by_rows=by_rows)
    if keep is not None:
        mask = mask & keep[:, :, None, None]
    return mask


def _scores(g: _Geometry, q_blk, k_blk, scale, mask_blk, lq_blk, lk_blk):
    """s = scale·q·kᵀ [+ log I] [+ Λ_i − Λ_j] in float32, [B, H, bq, bk]."""
    if g.group > 1:
        k_blk = jnp.repeat(k_blk, g.group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q_blk, k_blk, preferred_element_type=jnp.float32,
                   precision=dot_precision(q_blk.dtype))
    s = s * scale
    if mask_blk is not None:
        s = s + mask_blk[:, None]
    if lq_blk is not None:
        s = s + (lq_blk[..., :, None] - lk_blk[..., None, :])
    return s


def _repeat_kv(x, g: _Geometry):
    return jnp.repeat(x, g.group, axis=2) if g.group > 1 else x


def _forward(q, k, v, lam, log_mask, segment_ids, visits: TileVisits, scale):
    b, tq, h, d = q.shape
    g = _Geometry(tq, k.shape[1], h, k.shape[2], visits.block_q, visits.block_k)
    x = _Blocks(q, k, v, lam, log_mask, segment_ids, g)
    kv_idx, kv_cnt, _, _ = visits.schedule()
    prec = dot_precision(q.dtype)

    def one_query_block(m):
        q_blk, lq_blk, seg_q_blk = x.rows(x.q, m), x.rows(x.lam_q, m, axis=2), x.rows(x.seg_q, m)

        def body(i, carry):
            m_i, l_i, acc = carry
            n = kv_idx[m, i]
            s = _scores(g, q_blk, x.cols(x.k, n), scale, x.mask_tile(m, n), lq_blk, x.cols(x.lam_k, n, axis=2))
            s = jnp.where(_tile_mask(g, m, n, visits, seg_q_blk, x.cols(x.seg_k, n), True), s, _NEG_INF)
            m_new = jnp.maximum(m_i, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m_i - m_safe)
            pv = jnp.einsum("bhqk,bkhd->bhqd", p.astype(v.dtype), _repeat_kv(x.cols(x.v, n), g),
                            preferred_element_type=jnp.float32, precision=prec)
            return m_new, l_i * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

        init = (jnp.full((b, h, g.bq), _NEG_INF, jnp.float32), jnp.zeros((b, h, g.bq), jnp.float32),
                jnp.zeros((b, h, g.bq, d), jnp.float32))
        m_i, l_i, acc = lax.fori_loop(0, kv_cnt[m], body, init)
        empty = l_i == 0.0
        o = acc / jnp.where(empty, 1.0, l_i)[..., None]
        lse = jnp.where(empty, _NEG_INF, m_i + jnp.log(jnp.where(empty, 1.0, l_i)))
        return o.transpose(0, 2, 1, 3).astype(q.dtype), lse.transpose(0, 2, 1)

    o, lse = lax.map(one_query_block, jnp.arange(g.nq))  # [nq, B, bq, H, D], [nq, B, bq, H]
    o = o.transpose(1, 0, 2, 3, 4).reshape(b, g.tq_pad, h, d)[:, :tq]
    lse = lse.transpose(1, 0, 2, 3).reshape(b, g.tq_pad, h)[:, :tq]
    return o, lse


def _backward(q, k, v, lam, log_mask, segment_ids, visits: TileVisits, o, lse, do, scale):
    """(dq, dk, dv, dΛ or None, dlog_mask or None); dΛ_t = Σ_j dS_tj (t as a query) − Σ_i dS_it
    (t as a key), float32 [B, Tk, H]; dlog_mask = Σ_h dS, float32 [B, Tq, Tk]."""
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = _Geometry(tq, tk, h, hkv, visits.block_q, visits.block_k)
    x = _Blocks(q, k, v, lam, log_mask, segment_ids, g)
    kv_idx, kv_cnt, q_idx, q_cnt = visits.schedule()
    gated, masked = lam is not None, log_mask is not None
    prec = dot_precision(q.dtype)
    delta = pad_axis(jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1), 1, g.tq_pad)  # [B, Tq, H]
    lse_p = pad_axis(jnp.where(jnp.isfinite(lse), lse, 0.0), 1, g.tq_pad)
    dop = pad_axis(do, 1, g.tq_pad)

    def tile(m, n, q_blk, do_blk, lq_blk, seg_q_blk, k_blk, v_blk, lk_blk, seg_k_blk, by_rows):
        """p and dS = p·(dP − δ) of tile (m, n), [B, H, bq, bk] float32."""
        s = _scores(g, q_blk, k_blk, scale, x.mask_tile(m, n), lq_blk, lk_blk)
        s = jnp.where(_tile_mask(g, m, n, visits, seg_q_blk, seg_k_blk, by_rows), s, _NEG_INF)
        p = jnp.exp(s - x.rows(lse_p, m).transpose(0, 2, 1)[..., None])
        dp = jnp.einsum("bqhd,bkhd->bhqk", do_blk, _repeat_kv(v_blk, g), preferred_element_type=jnp.float32,
                        precision=prec)
        return p, p * (dp - x.rows(delta, m).transpose(0, 2, 1)[..., None])

    def query_side(m):  # query block m of q, dO, Λ and the segment ids
        return x.rows(x.q, m), x.rows(dop, m), x.rows(x.lam_q, m, axis=2), x.rows(x.seg_q, m)

    def key_side(n):  # key block n of k, v, Λ and the segment ids
        return x.cols(x.k, n), x.cols(x.v, n), x.cols(x.lam_k, n, axis=2), x.cols(x.seg_k, n)

    # dQ, the query-side decay gradient and dlogI: query blocks over their key blocks -------------
    def dq_block(m):
        qs = query_side(m)

        def body(i, carry):
            n = kv_idx[m, i]
            ks = key_side(n)
            _, ds = tile(m, n, *qs, *ks, True)
            out = [carry[0] + jnp.einsum("bhqk,bkhd->bqhd", ds.astype(k.dtype), _repeat_kv(ks[0], g),
                                         preferred_element_type=jnp.float32, precision=prec)]
            if gated:  # Λ_i as a query: row sums of dS
                out.append(carry[len(out)] + jnp.sum(ds, axis=-1))
            if masked:  # the mask is shared by the heads: Σ_h dS
                out.append(lax.dynamic_update_slice_in_dim(carry[len(out)], jnp.sum(ds, axis=1), n * g.bk, axis=2))
            return tuple(out)

        init = [jnp.zeros((b, g.bq, h, d), jnp.float32)]
        if gated:
            init.append(jnp.zeros((b, h, g.bq), jnp.float32))
        if masked:
            init.append(jnp.zeros((b, g.bq, g.tk_pad), jnp.float32))
        out = lax.fori_loop(0, kv_cnt[m], body, tuple(init))
        return (out[0] * scale,) + tuple(out[1:])

    dq_out = lax.map(dq_block, jnp.arange(g.nq))
    dq = dq_out[0].transpose(1, 0, 2, 3, 4).reshape(b, g.tq_pad, h, d)[:, :tq]

    # dK, dV and the key-side decay gradient: key blocks over their query blocks -------------------
    def dkv_block(n):
        ks = key_side(n)

        def body(i, carry):
            m = q_idx[n, i]
            qs = query_side(m)
            p, ds = tile(m, n, *qs, *ks, False)
            dv = carry[1] + jnp.einsum("bhqk,bqhd->bkhd", p.astype(do.dtype), qs[1],
                                       preferred_element_type=jnp.float32, precision=prec)
            dk = carry[0] + jnp.einsum("bhqk,bqhd->bkhd", ds.astype(q.dtype), qs[0],
                                       preferred_element_type=jnp.float32, precision=prec)
            if gated:  # Λ_j as a key: column sums of dS (subtracted below)
                return dk, dv, carry[2] + jnp.sum(ds, axis=2)
            return dk, dv

        init = (jnp.zeros((b, g.bk, h, d), jnp.float32), jnp.zeros((b, g.bk, h, d), jnp.float32))
        if gated:
            init = init + (jnp.zeros((b, h, g.bk), jnp.float32),)
        out = lax.fori_loop(0, q_cnt[n], body, init)
        dk, dv = out[0], out[1]
        if g.group > 1:  # GQA: sum the query heads of each key/value head, in float32
            dk = dk.reshape(b, g.bk, hkv, g.group, d).sum(axis=3)
            dv = dv.reshape(b, g.bk, hkv, g.group, d).sum(axis=3)
        return (dk * scale, dv) + tuple(out[2:])

    dkv_out = lax.map(dkv_block, jnp.arange(g.nk))
    dk = dkv_out[0].transpose(1, 0, 2, 3, 4).reshape(b, g.tk_pad, hkv, d)[:, :tk]
    dv = dkv_out[1].transpose(1, 0, 2, 3, 4).reshape(b, g.tk_pad, hkv, d)[:, :tk]
    dlam = dmask = None
    if gated:
        row = dq_out[1].transpose(1, 0, 3, 2).reshape(b, g.tq_pad, h)[:, :tq]   # Σ_j dS_ij
        col = dkv_out[2].transpose(1, 0, 3, 2).reshape(b, g.tk_pad, h)[:, :tk]  # Σ_i dS_ij
        dlam = (-col).at[:, g.offset:].add(row)
    if masked:
        dmask = dq_out[-1].transpose(1, 0, 2, 3).reshape(b, g.tq_pad, g.tk_pad)[:, :tq, :tk]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dlam, dmask


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def blockwise_attention(q, k, v, lam, log_mask, segment_ids, visits, scale):
    """Blockwise attention with an optional decay Λ and an optional additive log mask.

        o_i = Σ_{visible j} softmax_j(scale·q_i·k_j [+ log I_ij] [+ Λ_i − Λ_j]) v_j

    Args:
      q: [B, Tq, H, D] float32 / bfloat16 / float16; k, v: [B, Tk, Hkv, D] (H a multiple of Hkv,
        Tq ≤ Tk, queries bottom-right aligned).
      lam: [B, Tk, H] float32 Λ (cumsum of log f, zeroed before seq_start), or None (no decay term).
      log_mask: [B, Tq, Tk] float32 additive mask shared by the heads (DCP log I; −inf allowed and
        then weighs exactly 0), or None.
      segment_ids: [B, Tk] int32 or None: query i sees key j only if their ids are equal.
      visits: ``TileVisits`` whose block sizes are ``block_sizes(Tq, Tk, ...)`` (it also carries
        seq_start, the sliding window, ACP ranges and DCP live tiles, which mask exactly).
      scale: logit scale (static).

    Returns:
      [B, Tq, H, D] in q's dtype. Differentiable in q, k, v, lam and log_mask (float32 gradients for
      the last two); rows with no visible pair of finite logit output 0.
    """
    return _forward(q, k, v, lam, log_mask, segment_ids, visits, scale)[0]


def _fwd(q, k, v, lam, log_mask, segment_ids, visits, scale):
    o, lse = name_attention_residuals(*_forward(q, k, v, lam, log_mask, segment_ids, visits, scale))
    return o, (q, k, v, lam, log_mask, segment_ids, visits, o, lse)


def _bwd(scale, res, do):
    q, k, v, lam, log_mask, segment_ids, visits, o, lse = res
    dq, dk, dv, dlam, dmask = _backward(q, k, v, lam, log_mask, segment_ids, visits, o, lse, do, scale)
    return dq, dk, dv, dlam, dmask, None, None


blockwise_attention.defvjp(_fwd, _bwd)
