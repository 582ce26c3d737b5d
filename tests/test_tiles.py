"""The tile-visit description (``fox_jax.ops.tiles.TileVisits``): checked by brute force against the
dense pair masks, and honoured alike by the blockwise XLA path and the Pallas glue (interpret mode).

Tolerances: float32 on both sides in different tile orders, as tests/test_pallas.py: 2e-5 relative to
the reference's largest magnitude on outputs and gradients.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.kernels.forgetting_attention import KernelConfig, TileConfig
from fox_jax.ops import pallas as fpallas
from fox_jax.ops.blockwise import blockwise_attention
from fox_jax.ops.reference import decay_cumsum
from fox_jax.ops.tiles import TileVisits, dropped_key_blocks, tile_visits, visible_pairs

B, T, H, BQ, BK = 2, 64, 2, 16, 16


def _tiles(pairs, bq, bk):
    """[..., Tq, Tk] bool -> [..., nq, nk]: the tiles holding at least one True pair."""
    *lead, tq, tk = pairs.shape
    nq, nk = -(-tq // bq), -(-tk // bk)
    p = np.zeros((*lead, nq * bq, nk * bk), bool)
    p[..., :tq, :tk] = pairs
    return p.reshape(*lead, nq, bq, nk, bk).any(axis=(-3, -1))


def _dense_visible(tq, tk, seq_start=None, segment_ids=None):
    """[B or 1, Tq, Tk] bool: causal (bottom-right), after seq_start, same document."""
    vis = np.asarray(visible_pairs(tq, tk, None if segment_ids is None else jnp.asarray(segment_ids)))
    if seq_start is not None:
        vis = vis & (np.arange(tk)[None, None, :] >= np.asarray(seq_start)[:, None, None])
    return vis


def _gates(rng, b=B, t=T, h=H):
    return jnp.asarray(np.log(rng.uniform(0.3, 1.0, (b, t, h))), jnp.float32)


@pytest.mark.parametrize("tq,bq,bk", [(64, 16, 16), (64, 16, 8), (37, 8, 16), (50, 32, 16)])
def test_visits_equal_the_dense_masks(tq, bq, bk):
    """Each constraint on its own equals the tiles that hold a pair of its dense mask; all together,
    every tile holding a pair that counts is visited and nothing outside the causal triangle is."""
    rng = np.random.default_rng(0)
    tk = T
    ss = np.array([0, 21])
    seg = np.stack([np.arange(tk) // 11, np.arange(tk) // 23])  # packed documents (non-decreasing)
    lam = decay_cumsum(_gates(rng))
    delta = jnp.asarray([[-1.0, -3.0], [-2.0, -0.5]], jnp.float32)

    def visited(**kw):
        return np.asarray(tile_visits(tq, tk, bq, bk, **kw).visited())

    causal = _tiles(_dense_visible(tq, tk), bq, bk)[:, None]
    np.testing.assert_array_equal(visited(), causal)
    np.testing.assert_array_equal(visited(seq_start=jnp.asarray(ss)), _tiles(_dense_visible(tq, tk, ss), bq, bk)[:, None])
    np.testing.assert_array_equal(visited(segment_ids=jnp.asarray(seg)),
                                  _tiles(_dense_visible(tq, tk, segment_ids=seg), bq, bk)[:, None])
    # ACP: a tile is kept iff its largest decay Λ_i − Λ_j over in-range positions reaches δ (Λ is
    # non-increasing here, so the envelopes are Λ itself)
    lam_np = np.asarray(lam).transpose(0, 2, 1)  # [B, H, Tk]
    decay = lam_np[:, :, tk - tq:, None] - lam_np[:, :, None, :]
    nq, nk = -(-tq // bq), -(-tk // bk)
    top = np.full((B, H, nq * bq, nk * bk), -np.inf)
    top[..., :tq, :tk] = decay
    kept = top.reshape(B, H, nq, bq, nk, bk).max(axis=(3, 5)) >= np.asarray(delta)[:, :, None, None]
    np.testing.assert_array_equal(visited(lam=lam, delta=delta), causal & kept)
    # DCP: live tiles are the tiles holding a visible pair above the floor
    lm = jnp.asarray(np.where(rng.uniform(size=(B, tq, tk)) < 0.9, -100.0, -1.0), jnp.float32)
    live = ~np.asarray(dropped_key_blocks(lm, bq, bk, segment_ids=jnp.asarray(seg)))
    np.testing.assert_array_equal(visited(log_mask=lm, segment_ids=jnp.asarray(seg)), live[:, None])
    np.testing.assert_array_equal(
        live, _tiles(_dense_visible(tq, tk, segment_ids=seg) & (np.asarray(lm) > -92.0), bq, bk))
    # everything together: sound (no tile with a counting pair is missed) and inside the causal triangle
    both = visited(seq_start=jnp.asarray(ss), lam=lam, delta=delta, segment_ids=jnp.asarray(seg))
    needed = _tiles(_dense_visible(tq, tk, ss, seg), bq, bk)[:, None] & kept
    assert np.all(both >= needed) and not np.any(both & ~causal)
    assert np.array_equal(both, needed)  # and tight for packed documents


def _staircase(rng, n):
    """A random ACP-like description: per (b, h) a non-decreasing first key block ≤ the diagonal one,
    as kv_start, and the same tiles as q_end."""
    kv_start = np.minimum(np.sort(rng.integers(0, n, (B, H, n)), axis=-1), np.arange(n))
    q_end = (np.arange(n)[None, None, None, :] >= kv_start[..., :, None]).sum(axis=-2)  # [B, H, nk]
    return jnp.asarray(kv_start, jnp.int32), jnp.asarray(q_end, jnp.int32)


def _dense_attention(q, k, v, lam, keep_pairs, log_mask=None):
    s = jnp.einsum("bihd,bjhd->bhij", q, k, precision=jax.lax.Precision.HIGHEST) * q.shape[-1] ** -0.5
    lt = lam.transpose(0, 2, 1)
    s = s + lt[:, :, :, None] - lt[:, :, None, :]
    if log_mask is not None:
        s = s + log_mask[:, None]
    s = jnp.where(keep_pairs, s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1) * keep_pairs  # rows without a pair (before seq_start) output 0
    return jnp.einsum("bhij,bjhd->bihd", p, v, precision=jax.lax.Precision.HIGHEST)


def _value_and_grads(fn, args):
    """(output, gradients of Σ w·output) with fixed weights w."""
    w = jnp.cos(jnp.arange(np.prod(args[0].shape), dtype=jnp.float32).reshape(args[0].shape))

    def loss(*a):
        o = fn(*a)
        return jnp.sum(w * o), o

    (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return o, g


@pytest.mark.parametrize("with_mask", [False, True], ids=["acp_segments_seq_start", "dcp_live"])
def test_xla_path_and_pallas_glue_visit_the_same_tiles(with_mask):
    """One hand-made description, fed to both: the XLA core and the Pallas kernels leave out exactly its
    unvisited tiles (which here do hold visible pairs, so leaving them out shows in the result), and
    agree with a dense softmax masked to the described tiles, values and gradients."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, H, 16)), jnp.float32) for _ in range(3))
    lam = decay_cumsum(_gates(rng))
    seg = jnp.asarray(np.stack([np.arange(T) // 40, np.arange(T) // 70]), jnp.int32)
    ss = None if with_mask else jnp.asarray([0, 5], jnp.int32)
    n = T // BQ
    if with_mask:
        log_mask = jnp.asarray(-rng.uniform(0.0, 3.0, (B, T, T)), jnp.float32)
        live = rng.uniform(size=(B, n, n)) < 0.6
        live[:, np.arange(n), np.arange(n)] = True  # keep the diagonal: no empty rows
        base = tile_visits(T, T, BQ, BK, segment_ids=seg, log_mask=log_mask)
        visits = dataclasses.replace(base, live=jnp.asarray(live) & base.live)
    else:
        log_mask = None
        kv_start, q_end = _staircase(rng, n)
        visits = dataclasses.replace(tile_visits(T, T, BQ, BK, seq_start=ss, segment_ids=seg), kv_start=kv_start,
                                     q_end=q_end)
    tiles = np.asarray(visits.visited())
    pairs = np.repeat(np.repeat(np.broadcast_to(tiles, (B, H, n, n)), BQ, axis=2), BK, axis=3)
    keep_pairs = jnp.asarray(pairs & _dense_visible(T, T, ss, np.asarray(seg))[:, None])
    needed = _tiles(_dense_visible(T, T, ss, np.asarray(seg)), BQ, BK)[:, None]
    assert np.any(needed & ~tiles)  # some tiles with visible pairs are left out

    tile = TileConfig(BQ, BK)
    config = KernelConfig(fwd=tile, dq=tile, dkv=tile)
    kernel_visits = fpallas.KernelVisits(visits, visits, visits, visits if with_mask else None)
    scale = 16 ** -0.5
    args = (q, k, v, lam) + ((log_mask,) if with_mask else ())

    def xla(q, k, v, lam, *m):
        return blockwise_attention(q, k, v, lam, m[0] if m else None, seg, visits, scale)

    def pallas(q, k, v, lam, *m):
        return fpallas.kernel_attention(q, k, v, lam, m[0] if m else None, seg, kernel_visits, None, scale, config,
                                        True)

    def dense(q, k, v, lam, *m):
        return _dense_attention(q, k, v, lam, keep_pairs, m[0] if m else None)

    want_o, want_g = _value_and_grads(dense, args)
    for name, fn in (("xla", xla), ("pallas", pallas)):
        o, g = _value_and_grads(fn, args)
        np.testing.assert_allclose(o, want_o, rtol=2e-5, atol=2e-5 * float(jnp.abs(want_o).max()), err_msg=name)
        for arg, a, r in zip(("q", "k", "v", "lam", "log_mask"), g, want_g):
            np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-5 * float(jnp.abs(r).max()), err_msg=f"{name} d{arg}")


def test_pallas_tile_counts_follow_the_description():
    """``pallas.tile_counts`` counts the loops of ``TileVisits`` at each kernel's tiling."""
    rng = np.random.default_rng(2)
    lam = decay_cumsum(_gates(rng))
    seg = jnp.asarray(np.stack([np.arange(T) // 11, np.arange(T) // 23]), jnp.int32)
    counts = fpallas.tile_counts(B, H, T, T, lam=lam, delta=-1.0, segment_ids=seg, head_dim=16)
    config = fpallas.resolve_config(16, T, T)
    for name in ("fwd", "dq", "dkv"):
        t = getattr(config, name)
        v = tile_visits(T, T, t.block_q, t.block_k, lam=lam, delta=jnp.full((B, H), -1.0), segment_ids=seg)
        assert float(counts[name]["visited"]) == float(np.sum(np.broadcast_to(v.visited(), (B, H, v.nq, v.nk))))
        full = TileVisits(T, T, t.block_q, t.block_k).visited()
        assert float(counts[name]["causal"]) == float(np.sum(full)) * B * H
