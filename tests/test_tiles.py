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
from fox_jax.ops import forgetting_attention, forgetting_attention_reference
from fox_jax.ops.blockwise import blockwise_attention
from fox_jax.ops.reference import decay_cumsum
from fox_jax.ops.tiles import TileVisits, compact_tiles, dropped_key_blocks, tile_visits, visible_pairs

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


def _dense_window(tq, tk, window_size):
    """[1, Tq, Tk] bool: the sliding window, 0 ≤ (Tk − Tq + i) − j < window_size."""
    lag = (tk - tq + np.arange(tq))[:, None] - np.arange(tk)[None, :]
    return ((lag >= 0) & (lag < window_size))[None]


def _gates(rng, b=B, t=T, h=H):
    return jnp.asarray(np.log(rng.uniform(0.3, 1.0, (b, t, h))), jnp.float32)


def _acp_kept(lam, delta, tq, bq, bk):
    """[B, H, nq, nk] bool: tiles whose largest decay Λ_i − Λ_j over in-range positions reaches δ (Λ
    non-increasing, so the envelopes are Λ itself)."""
    tk = lam.shape[1]
    lam_np = np.asarray(lam).transpose(0, 2, 1)  # [B, H, Tk]
    decay = lam_np[:, :, tk - tq:, None] - lam_np[:, :, None, :]
    nq, nk = -(-tq // bq), -(-tk // bk)
    top = np.full((*lam_np.shape[:2], nq * bq, nk * bk), -np.inf)
    top[..., :tq, :tk] = decay
    return top.reshape(*lam_np.shape[:2], nq, bq, nk, bk).max(axis=(3, 5)) >= np.asarray(delta)[:, :, None, None]


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

    @jax.jit  # one compilation per set of constraints (eagerly: one per op)
    def _visited(**kw):
        return tile_visits(tq, tk, bq, bk, **kw).visited()

    def visited(**kw):
        return np.asarray(_visited(**kw))

    causal = _tiles(_dense_visible(tq, tk), bq, bk)[:, None]
    np.testing.assert_array_equal(visited(), causal)
    np.testing.assert_array_equal(visited(seq_start=jnp.asarray(ss)), _tiles(_dense_visible(tq, tk, ss), bq, bk)[:, None])
    np.testing.assert_array_equal(visited(segment_ids=jnp.asarray(seg)),
                                  _tiles(_dense_visible(tq, tk, segment_ids=seg), bq, bk)[:, None])
    # ACP: a tile is kept iff its largest decay Λ_i − Λ_j over in-range positions reaches δ
    kept = _acp_kept(lam, delta, tq, bq, bk)
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
    config = fpallas.resolve_config(16, T, T)

    @jax.jit  # one program (eagerly, XLA compiles every op on its own)
    def described(lam, seg):
        counts = fpallas.tile_counts(B, H, T, T, lam=lam, delta=-1.0, segment_ids=seg, head_dim=16)
        visited, full = {}, {}
        for name in ("fwd", "dq", "dkv"):
            t = getattr(config, name)
            v = tile_visits(T, T, t.block_q, t.block_k, lam=lam, delta=jnp.full((B, H), -1.0), segment_ids=seg)
            visited[name] = jnp.broadcast_to(v.visited(), (B, H, v.nq, v.nk))
            full[name] = TileVisits(T, T, t.block_q, t.block_k).visited()
        return counts, visited, full

    counts, visited, full = described(lam, seg)
    for name in ("fwd", "dq", "dkv"):
        assert float(counts[name]["visited"]) == float(np.sum(visited[name]))
        assert float(counts[name]["causal"]) == float(np.sum(full[name])) * B * H


# Sliding window -------------------------------------------------------------------------------------

@pytest.mark.parametrize("tq,bq,bk", [(64, 16, 16), (64, 16, 8), (37, 8, 16), (50, 32, 16)])
@pytest.mark.parametrize("window_size", [1, 3, 37, 64, 1000])
def test_window_visits_equal_the_dense_masks(tq, bq, bk, window_size):
    """The window alone: the row ranges (forward, dQ) and the column ranges (dK/dV) each describe
    exactly the tiles holding a pair inside the window; with seq_start, documents and ACP as well, the
    visited tiles are exactly those holding a pair that counts (packed documents)."""
    rng = np.random.default_rng(3)
    tk = T
    want = _tiles(_dense_window(tq, tk, window_size), bq, bk)[:, None]  # [1, 1, nq, nk]
    v = tile_visits(tq, tk, bq, bk, window_size=window_size)
    m, n = np.arange(v.nq)[:, None], np.arange(v.nk)[None, :]
    lo, hi = (np.asarray(x) for x in v.row_ranges())
    np.testing.assert_array_equal((n >= lo[..., :, None]) & (n < hi[..., :, None]), want)
    lo, hi = (np.asarray(x) for x in v.col_ranges())
    np.testing.assert_array_equal((m >= lo[..., None, :]) & (m < hi[..., None, :]), want)
    np.testing.assert_array_equal(np.asarray(v.visited()), want)

    ss = np.array([0, 21])
    seg = np.stack([np.arange(tk) // 11, np.arange(tk) // 23])
    lam = decay_cumsum(_gates(rng))
    delta = jnp.asarray([[-1.0, -3.0], [-2.0, -0.5]], jnp.float32)
    both = tile_visits(tq, tk, bq, bk, seq_start=jnp.asarray(ss), lam=lam, delta=delta,
                       segment_ids=jnp.asarray(seg), window_size=window_size).visited()
    needed = _tiles(_dense_visible(tq, tk, ss, seg) & _dense_window(tq, tk, window_size), bq, bk)[:, None]
    np.testing.assert_array_equal(np.asarray(both), needed & _acp_kept(lam, delta, tq, bq, bk))


def test_window_skips_the_tiles_outside_it():
    """T = 256, 16×16 tiles, W = 37: query block m holds keys [16m − 36, 16m + 15], i.e. key blocks
    m − 3 … m, so the loops visit min(m + 1, 4) tiles per query block (58 in all) instead of the
    causal m + 1 (136); the blockwise schedule and the Pallas tile counts are those loops."""
    t, blk, w = 256, 16, 37
    v = tile_visits(t, t, blk, blk, window_size=w)
    kv_idx, kv_cnt, q_idx, q_cnt = (np.asarray(x) for x in v.schedule())
    m = np.arange(t // blk)
    np.testing.assert_array_equal(kv_cnt, np.minimum(m + 1, 4))
    np.testing.assert_array_equal(q_cnt, np.minimum(t // blk - m, 4))
    for i in m:
        np.testing.assert_array_equal(kv_idx[i, :kv_cnt[i]], np.arange(max(i - 3, 0), i + 1))
        np.testing.assert_array_equal(q_idx[i, :q_cnt[i]], np.arange(i, min(i + 4, t // blk)))
    assert int(np.sum(np.asarray(v.visited()))) == 58
    assert int(np.sum(np.asarray(TileVisits(t, t, blk, blk).visited()))) == 136
    counts = fpallas.tile_counts(1, 1, t, t, window_size=w, head_dim=16)
    config = fpallas.resolve_config(16, t, t)
    for name in ("fwd", "dq", "dkv"):
        c = getattr(config, name)
        visited = tile_visits(t, t, c.block_q, c.block_k, window_size=w).visited()
        assert float(counts[name]["visited"]) == float(np.sum(visited))
        assert float(counts[name]["fraction_skipped"]) > 0.4, (name, counts[name])


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_window_never_loads_the_keys_before_it(impl):
    """Tq < Tk: the first query (key position 80) with W = 17 sees keys ≥ 64, so keys [0, 64) — whole
    key tiles at every tiling used here — are seen by no query. Poisoned with NaN, they leave the
    output and the gradients finite and equal to the clean reference, with zero dk/dv there: their
    tiles are never loaded (masking alone would multiply NaN by 0)."""
    rng = np.random.default_rng(4)
    tq, tk, w = 16, 96, 17
    q = jnp.asarray(rng.normal(size=(1, tq, H, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, tk, H, 16)), jnp.float32) for _ in range(2))
    lf = _gates(rng, 1, tk)
    poison = jnp.arange(tk)[None, :, None, None] < 64
    kw = dict(block_q=16, block_k=16) if impl == "xla" else {}

    def op(*a):
        return forgetting_attention(*a, window_size=w, implementation=impl, **kw)

    o, g = _value_and_grads(op, (q, jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v), lf))
    want_o, want_g = _value_and_grads(lambda *a: forgetting_attention_reference(*a, window_size=w), (q, k, v, lf))
    np.testing.assert_allclose(o, want_o, rtol=2e-5, atol=2e-5 * float(jnp.abs(want_o).max()))
    for name, a, r in zip(("q", "k", "v", "log_fgate"), g, want_g):
        np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-5 * float(jnp.abs(r).max()), err_msg=f"d{name}")
    assert not np.any(np.asarray(g[1][:, :64])) and not np.any(np.asarray(g[2][:, :64]))


# Compacted tile lists (the DCP loops of the Pallas kernels) -----------------------------------------

def _np_lists(flags, first=None):
    """Numpy reference of ``compact_tiles``: per row, the True indices with ``first`` ascending, then the
    others ascending; (lists as Python lists, n_first, count)."""
    flags = np.asarray(flags, bool)
    first = np.ones_like(flags) if first is None else np.broadcast_to(np.asarray(first, bool), flags.shape)
    rows = flags.reshape(-1, flags.shape[-1])
    fr = first.reshape(rows.shape)
    lists = [list(np.flatnonzero(r & f)) + list(np.flatnonzero(r & ~f)) for r, f in zip(rows, fr)]
    n_first = np.array([np.sum(r & f) for r, f in zip(rows, fr)]).reshape(flags.shape[:-1])
    return lists, n_first, rows.sum(axis=1).reshape(flags.shape[:-1])


def _check_lists(got, flags, first=None):
    idx, n_first, count = (np.asarray(x) for x in got)
    lists, want_first, want_count = _np_lists(flags, first)
    np.testing.assert_array_equal(count, want_count)
    np.testing.assert_array_equal(n_first, want_first)
    flat = idx.reshape(-1, idx.shape[-1])
    for row, want, c in zip(flat, lists, want_count.reshape(-1)):
        assert list(row[:c]) == want
        assert np.all(row[c:] == 0)  # padding: a valid index that is never visited


@pytest.mark.parametrize("n", [1, 5, 16, 33])
def test_compact_tiles_match_numpy(n):
    """Random live maps with all-dead and all-live rows, with and without a 'masked first' split, under
    jit and vmap: the ascending live indices, the split point and the count."""
    rng = np.random.default_rng(n)
    flags = rng.uniform(size=(3, 4, n)) < 0.5
    flags[0, 0] = False  # an all-dead row
    flags[0, 1] = True  # an all-live row
    first = rng.uniform(size=(3, 1, n)) < 0.4  # broadcast over the second axis
    # one jitted program for the three forms (eagerly, XLA compiles every op of the vmapped form on its own)
    plain, split, vmapped = jax.jit(lambda f, fi, fb: (compact_tiles(f), compact_tiles(f, fi),
                                                       jax.vmap(compact_tiles)(f, fb)))(
        jnp.asarray(flags), jnp.asarray(first), jnp.asarray(np.broadcast_to(first, flags.shape)))
    _check_lists(plain, flags)
    _check_lists(split, flags, first)
    _check_lists(vmapped, flags, first)
    with pytest.raises(ValueError, match="at least one axis"):
        compact_tiles(jnp.asarray(True))


def _hidden_tiles(tq, tk, bq, bk, seq_start, segment_ids, window_size):
    """[B, nq, nk] brute force: tiles holding a (real row, any column) pair the geometry hides."""
    vis = _dense_visible(tq, tk, seq_start, segment_ids)
    if window_size is not None:
        vis = vis & _dense_window(tq, tk, window_size)
    nq, nk = -(-tq // bq), -(-tk // bk)
    hidden = np.ones((vis.shape[0], nq * bq, nk * bk), bool)
    hidden[:, :tq, :tk] = ~vis
    hidden[:, tq:, :] = False  # padded rows do not count
    return hidden.reshape(-1, nq, bq, nk, bk).any(axis=(2, 4))


# every geometry without a window and with one of the two windows (each window on two geometries)
@pytest.mark.parametrize("tq,tk,bq,bk,window_size", [
    (64, 64, 16, 16, None), (64, 64, 16, 16, 19), (37, 37, 8, 16, None), (37, 37, 8, 16, 40),
    (20, 50, 16, 8, None), (20, 50, 16, 8, 19), (50, 50, 32, 16, None), (50, 50, 32, 16, 40)])
def test_tile_lists_follow_the_visits(tq, tk, bq, bk, window_size):
    """``key_lists`` / ``query_lists`` list exactly the visited tiles (seq_start, documents, window and
    DCP live tiles together; awkward lengths, Tq < Tk), the ones with a hidden pair first; and
    ``element_masked`` equals the brute-force set of tiles holding a hidden pair."""
    rng = np.random.default_rng(tq + tk)
    ss = jnp.asarray([0, 13], jnp.int32)
    seg = np.stack([np.arange(tk) // 11, np.zeros(tk, int)])  # packed documents; one document
    lm = jnp.asarray(np.where(rng.uniform(size=(B, tq, tk)) < 0.7, -100.0, -1.0), jnp.float32)

    @jax.jit  # one compilation for all of it (eagerly, every op of the description compiles on its own)
    def described(ss, seg, lm):
        visits = tile_visits(tq, tk, bq, bk, seq_start=ss, segment_ids=seg, log_mask=lm, window_size=window_size)
        return dict(masked=visits.element_masked(seg), visited=visits.visited(), keys=visits.key_lists(seg),
                    queries=visits.query_lists(seg), keys_unsplit=visits.key_lists(seg, masked_first=False),
                    masked_geo=visits.element_masked())

    got = described(ss, jnp.asarray(seg), lm)
    hidden = _hidden_tiles(tq, tk, bq, bk, np.asarray(ss), seg, window_size)
    np.testing.assert_array_equal(got["masked"], hidden)
    assert np.any(hidden[1]) and (window_size is not None or np.any(~hidden[1]))  # both kinds occur
    vis = np.asarray(got["visited"])
    _check_lists(got["keys"], vis, hidden[:, None])
    _check_lists(got["queries"], np.swapaxes(vis, -1, -2), np.swapaxes(hidden, -1, -2)[:, None])
    _check_lists(got["keys_unsplit"], vis)
    # without documents only the geometry counts
    hidden_geo = _hidden_tiles(tq, tk, bq, bk, np.asarray(ss), None, window_size)
    np.testing.assert_array_equal(got["masked_geo"], hidden_geo)
