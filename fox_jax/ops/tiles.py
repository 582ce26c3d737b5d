"""Which (query block, key block) tiles attention visits: one description for every implementation.

Forgetting attention is computed tile by tile (block_q queries × block_k keys). A tile is *visited*
(loaded and computed) only when it can hold a pair that counts; every constraint below removes tiles,
never adds them, and the pairs of a visited tile are still masked exactly, so visiting a superset of
the needed tiles changes nothing but the speed. The constraints (the role splash attention's
``MaskInfo`` plays):

* causal with bottom-right alignment (query i at absolute position Tk − Tq + i);
* ``seq_start`` [B] (left padding): key blocks entirely before it;
* a sliding window (``window_size`` W, static): key blocks entirely before the window of the query
  block's first row (query block m visits key blocks ≥ (r_m − W + 1) // block_k, r_m its first
  absolute row), and for each key block the query blocks entirely past the window of its last column;
* ACP (``fox_jax.ops.acp``, docs/design/fox_acp.md §5.3): per (b, h) the pruned staircase, as
  ``kv_start`` [B, H, nq] (first key block of each query block) and ``q_end`` [B, H, nk] (one past
  the last query block of each key block);
* document bounds (``acp.segment_block_bounds``): per b the key-block range of each query block and
  the query-block range of each key block whose segment ids can meet;
* DCP live tiles (docs/design/dcp.md §1.4): per b the tiles holding a visible pair whose log mask is
  above the floor (``dropped_key_blocks`` negated).

``TileVisits`` holds them for one tiling; ``tile_visits`` builds it. The blockwise XLA path
(``fox_jax.ops.blockwise``) visits the union over batch rows and heads of the described tiles, in
ascending order (``TileVisits.schedule``), and masks the rest exactly; the Pallas glue
(``fox_jax.ops.pallas``) builds one per kernel tiling and hands the arrays to the kernels, which loop
over the ranges per (b, h) — or, with a DCP mask, over compacted lists of the visited tiles
(``compact_tiles``, ``TileVisits.key_lists`` / ``query_lists``: per block the ascending live tiles, those
that need the element mask first, ``TileVisits.element_masked``), with no per-tile branch.

Also here, since the kernels' glue and the DCP op share it: the dropped-pair rule of a DCP log mask
(``exclude_dropped``, ``rows_with_kept_pair``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from fox_jax.ops import acp as acp_lib

LOG_FLOOR = math.log(1e-40)
"""≈ −92.103: log of the reference code's 1e-40; a fully dropped (query, key) pair gets this bias."""


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["seq_start", "kv_start", "q_end", "segments", "live"],
                   meta_fields=["tq", "tk", "block_q", "block_k", "window_size"])
@dataclasses.dataclass(frozen=True)
class TileVisits:
    """The tiles of one tiling (``block_q`` × ``block_k``) that attention must visit (a pytree).

    nq = ceil(tq / block_q), nk = ceil(tk / block_k). Every array field is optional (None: that
    constraint is absent); all int32 except ``live``.

    Attributes:
      tq, tk, block_q, block_k: static lengths and tile sizes.
      seq_start: [B] left padding; key blocks n with (n + 1)·block_k ≤ seq_start[b] are skipped.
      window_size: static int W or None, sliding window: query i (absolute position r) sees key j
        only if r − j < W, so key blocks entirely before the window of a block's rows are skipped.
      kv_start: [B, H, nq] ACP: query block m visits key blocks ≥ kv_start[b, h, m].
      q_end: [B, H, nk] ACP: key block n visits query blocks < q_end[b, h, n] (the same tiles).
      segments: (kv_lo, kv_hi [B, nq], q_lo, q_hi [B, nk]) document bounds: query block m visits key
        blocks [kv_lo, kv_hi), key block n query blocks [q_lo, q_hi).
      live: [B, nq, nk] bool, DCP: tiles holding a kept visible pair.
    """

    tq: int
    tk: int
    block_q: int
    block_k: int
    seq_start: jax.Array | None = None
    kv_start: jax.Array | None = None
    q_end: jax.Array | None = None
    segments: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None
    live: jax.Array | None = None
    window_size: int | None = None

    @property
    def nq(self) -> int:
        return -(-self.tq // self.block_q)

    @property
    def nk(self) -> int:
        return -(-self.tk // self.block_k)

    def row_ranges(self) -> tuple[jax.Array, jax.Array]:
        """Key-block range [lo, hi) of each query block, as the forward and dQ loops run it.

        Returns:
          (lo, hi) int32, each [1 or B, 1 or H, nq]: causal ∩ seq_start ∩ window ∩ ACP ∩ document
          bounds (``live`` is not a range; see ``visited``).
        """
        _, hi = acp_lib.causal_block_counts(self.tq, self.tk, self.block_q, self.block_k)
        hi = hi[None, None]
        lo = jnp.zeros_like(hi)
        if self.window_size is not None:  # keys < r − W + 1 (r the block's first row) are seen by none of it
            first_row = (self.tk - self.tq) + jnp.arange(self.nq, dtype=jnp.int32) * self.block_q
            lo = jnp.maximum(lo, jnp.maximum(first_row - (self.window_size - 1), 0) // self.block_k)
        if self.seq_start is not None:
            lo = jnp.maximum(lo, (self.seq_start // self.block_k)[:, None, None])
        if self.kv_start is not None:
            lo = jnp.maximum(lo, self.kv_start)
        if self.segments is not None:
            lo = jnp.maximum(lo, self.segments[0][:, None])
            hi = jnp.minimum(hi, self.segments[1][:, None])
        return lo, hi

    def col_ranges(self) -> tuple[jax.Array, jax.Array]:
        """Query-block range [lo, hi) of each key block, as the dK/dV loop runs it.

        Returns:
          (lo, hi) int32, each [1 or B, 1 or H, nk].
        """
        first_col = jnp.arange(self.nk, dtype=jnp.int32) * self.block_k
        lo = jnp.clip((first_col - (self.tk - self.tq)) // self.block_q, 0, self.nq)[None, None]
        hi = jnp.full_like(lo, self.nq)
        if self.window_size is not None:  # rows > c + W − 1 (c the block's last column) see none of it
            last_row = first_col + (self.block_k - 1) + (self.window_size - 1) - (self.tk - self.tq)
            hi = jnp.minimum(hi, jnp.clip(last_row // self.block_q + 1, 0, self.nq))
        if self.seq_start is not None:  # key blocks entirely before seq_start see no query
            hi = jnp.where(first_col + self.block_k <= self.seq_start[:, None, None], 0, hi)
        if self.q_end is not None:
            hi = jnp.minimum(hi, self.q_end)
        if self.segments is not None:
            lo = jnp.maximum(lo, self.segments[2][:, None])
            hi = jnp.minimum(hi, self.segments[3][:, None])
        return lo, hi

    def visited(self) -> jax.Array:
        """[1 or B, 1 or H, nq, nk] bool: the tiles to visit for each batch row and head (the row
        ranges ∩ the column ranges ∩ ``live``). Exact for causal, seq_start, window, ACP and DCP; for
        documents, tight when the segment ids are non-decreasing (packed documents)."""
        m = jnp.arange(self.nq, dtype=jnp.int32)[:, None]
        n = jnp.arange(self.nk, dtype=jnp.int32)[None, :]
        lo, hi = self.row_ranges()
        vis = (n >= lo[..., :, None]) & (n < hi[..., :, None])
        lo, hi = self.col_ranges()
        vis = vis & (m >= lo[..., None, :]) & (m < hi[..., None, :])
        if self.live is not None:
            vis = vis & self.live[:, None]
        return vis

    def schedule(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The loops of the blockwise XLA path: a tile is visited if ``visited`` holds for any batch
        row or head (the loop is shared by them; the others are masked by ``tile_kept``).

        Returns:
          (kv_idx [nq, nk], kv_cnt [nq], q_idx [nk, nq], q_cnt [nk]) int32: query block m visits key
          blocks kv_idx[m, :kv_cnt[m]] (ascending), key block n query blocks q_idx[n, :q_cnt[n]].
        """
        vis = jnp.any(self.visited(), axis=(0, 1))  # [nq, nk]
        kv_idx = jnp.argsort(~vis, axis=1, stable=True).astype(jnp.int32)
        q_idx = jnp.argsort(~vis.T, axis=1, stable=True).astype(jnp.int32)
        return kv_idx, jnp.sum(vis, axis=1, dtype=jnp.int32), q_idx, jnp.sum(vis, axis=0, dtype=jnp.int32)

    def element_masked(self, segment_ids: jax.Array | None = None) -> jax.Array:
        """[1 or B, nq, nk] bool: the tiles that hold a pair hidden by the geometry — the causal diagonal,
        key padding (columns ≥ tk), the seq_start boundary, the window edge, or (with ``segment_ids``
        [B, Tk] int) more than one document — and so need the element mask. The others are fully
        visible: every (real row, column) pair counts, and only the DCP log mask itself differs.
        Computed from the block bounds (no [T, T] array); rows past tq are padding and do not count."""
        offset = self.tk - self.tq
        m = jnp.arange(self.nq, dtype=jnp.int32)[:, None]
        n = jnp.arange(self.nk, dtype=jnp.int32)[None, :]
        r0 = offset + m * self.block_q  # first absolute row of the query block
        r_last = jnp.minimum(r0 + (self.block_q - 1), self.tk - 1)
        c0 = n * self.block_k
        c_last = c0 + (self.block_k - 1)
        hidden = (c_last > r0) | (c_last >= self.tk)
        if self.window_size is not None:
            hidden = hidden | (r_last - c0 >= self.window_size)
        hidden = hidden[None]
        if self.seq_start is not None:
            hidden = hidden | (c0 < self.seq_start[:, None, None])
        if segment_ids is not None:
            hidden = hidden | ~_one_document_tiles(segment_ids, self.tq, self.block_q, self.block_k)
        return hidden

    def key_lists(self, segment_ids: jax.Array | None = None, *,
                  masked_first: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The visited tiles of each query block as a compacted list (the DCP loops of the forward and
        dQ kernels): ``compact_tiles(visited, first=element_masked)``.

        Args:
          segment_ids: [B, Tk] int or None, for ``element_masked``.
          masked_first: False: every listed tile counts as masked (n_masked = count).
        Returns:
          (idx [1 or B, 1 or H, nq, nk], n_masked, count [1 or B, 1 or H, nq]) int32: query block m
          visits key blocks idx[..., m, :count[..., m]]; the first n_masked of them need the element
          mask, the rest are fully visible; each part ascending (the rest of the row is 0).
        """
        first = self.element_masked(segment_ids)[:, None] if masked_first else None
        return compact_tiles(self.visited(), first)

    def query_lists(self, segment_ids: jax.Array | None = None, *,
                    masked_first: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The visited tiles of each key block as a compacted list (the DCP loop of the dK/dV kernel).

        Returns:
          (idx [1 or B, 1 or H, nk, nq], n_masked, count [1 or B, 1 or H, nk]) int32: key block n
          visits query blocks idx[..., n, :count[..., n]], the first n_masked with the element mask
          (as ``key_lists``, transposed).
        """
        first = None
        if masked_first:
            first = jnp.swapaxes(self.element_masked(segment_ids), -1, -2)[:, None]
        return compact_tiles(jnp.swapaxes(self.visited(), -1, -2), first)

    def tile_kept(self, m, n, *, by_rows: bool) -> jax.Array | None:
        """[B, H or 1] bool: whether tile (m, n) is kept by ACP and DCP for each batch row and head
        (None: no such constraint). ``by_rows``: test ACP with ``kv_start`` (forward, dQ), else with
        ``q_end`` (dK/dV), so that each pass masks exactly the tiles its own ranges describe."""
        keep = None
        if by_rows and self.kv_start is not None:
            keep = n >= self.kv_start[:, :, m]
        if not by_rows and self.q_end is not None:
            keep = m < self.q_end[:, :, n]
        if self.live is not None:
            live = self.live[:, m, n][:, None]
            keep = live if keep is None else keep & live
        return keep


def compact_tiles(flags: jax.Array, first: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Compact per-tile flags into index lists: the positions of the True entries of each row, ascending.

    With ``first``, the True entries whose ``first`` flag is set come first (ascending), then the
    others (ascending) — e.g. the tiles that need the element mask, then the fully visible ones.
    A cumsum and a scatter (O(n) per row; no sort, no host sync; works under jit, vmap and
    ``shard_map``). The kernels loop ``for i in range(count): visit(idx[i])`` with no per-tile branch.

    Args:
      flags: [..., n] bool (or int, nonzero = True), e.g. ``TileVisits.visited()``.
      first: None or bool broadcastable with ``flags`` (the result has their broadcast shape).
    Returns:
      (idx [..., n], n_first [...], count [...]) int32: idx[..., :count] holds the indices of the
      True entries, those with ``first`` in idx[..., :n_first]; idx[..., count:] is 0 (a valid
      index, never visited). n_first = count without ``first``.
    Raises:
      ValueError: ``flags`` of rank 0.
    """
    if flags.ndim == 0:
        raise ValueError("compact_tiles: flags must have at least one axis, got a scalar")
    flags = flags.astype(bool)
    if first is not None:
        flags, first = jnp.broadcast_arrays(flags, jnp.asarray(first, bool))
    first_flags = flags if first is None else flags & first
    *lead, n = flags.shape
    rows = flags.reshape(-1, n)
    rows_first = first_flags.reshape(-1, n)
    pos_first = jnp.cumsum(rows_first, axis=1, dtype=jnp.int32)  # 1-based slot among the first entries
    n_first = pos_first[:, -1:] if n else jnp.zeros((rows.shape[0], 1), jnp.int32)
    pos_rest = n_first + jnp.cumsum(rows & ~rows_first, axis=1, dtype=jnp.int32)
    dest = jnp.where(rows_first, pos_first - 1, jnp.where(rows, pos_rest - 1, n))  # n: out of range, dropped
    row_ids = jnp.arange(rows.shape[0], dtype=jnp.int32)[:, None]
    src = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), rows.shape)
    idx = jnp.zeros(rows.shape, jnp.int32).at[row_ids, dest].set(src, mode="drop")
    count = jnp.sum(rows, axis=1, dtype=jnp.int32)
    return idx.reshape(*lead, n), n_first[:, 0].reshape(lead), count.reshape(lead)


def _one_document_tiles(segment_ids: jax.Array, tq: int, block_q: int, block_k: int) -> jax.Array:
    """[B, nq, nk] bool: tiles whose real query rows and real key columns all share one segment id
    (queries are the last tq of the Tk ids)."""
    seg = segment_ids.astype(jnp.int32)
    b, tk = seg.shape

    def block_min_max(x, blk):
        nb = -(-x.shape[1] // blk)
        pad = nb * blk - x.shape[1]
        lo = jnp.pad(x, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).max).reshape(b, nb, blk)
        hi = jnp.pad(x, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).min).reshape(b, nb, blk)
        return lo.min(axis=2), hi.max(axis=2)

    q_lo, q_hi = block_min_max(seg[:, tk - tq:], block_q)
    k_lo, k_hi = block_min_max(seg, block_k)
    return ((q_lo == q_hi)[:, :, None] & (k_lo == k_hi)[:, None, :] & (q_lo[:, :, None] == k_lo[:, None, :]))


def tile_visits(
    tq: int,
    tk: int,
    block_q: int,
    block_k: int,
    *,
    seq_start: jax.Array | None = None,
    lam: jax.Array | None = None,
    delta: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    log_mask: jax.Array | None = None,
    floor: float = LOG_FLOOR,
    skip_dropped: bool = True,
    window_size: int | None = None,
) -> TileVisits:
    """The tiles attention must visit at this tiling (no gradient flows through any of it).

    Args:
      tq, tk: query and key lengths (queries are the last tq positions); block_q, block_k: the tile.
      seq_start: [B] int32 left padding, or None.
      lam, delta: ACP, both or neither: [B, Tk, H] float32 Λ and the [B, H] float32 threshold
        (resolved, ≤ 0; ``acp.resolve_threshold``).
      segment_ids: [B, Tk] int32 or None: document bounds; with ``log_mask`` they only enter the
        live tiles (which then already exclude the other documents' tiles).
      log_mask: [B, Tq, Tk] float32 DCP log mask, or None: live tiles = those holding a visible pair
        with log I > ``floor`` (``dropped_key_blocks``); with ``skip_dropped=False`` every tile
        holding a visible pair is live.
      window_size: static int W ≥ 1 or None: sliding window (query at absolute position r sees keys
        r − W < j ≤ r); the implementations mask it elementwise on the visited tiles.
    Returns:
      ``TileVisits``.
    Raises:
      ValueError: only one of lam and delta.
    """
    if (lam is None) != (delta is None):
        raise ValueError("tile_visits: pass both lam and delta (ACP) or neither")
    kv_start = q_end = segments = live = None
    if delta is not None:
        lam = jax.lax.stop_gradient(lam).astype(jnp.float32)
        delta = jax.lax.stop_gradient(delta)
        kv_start = acp_lib.kv_block_start(lam, delta, tq=tq, block_q=block_q, block_k=block_k)
        q_end = acp_lib.q_block_end(lam, delta, tq=tq, block_q=block_q, block_k=block_k)
    if log_mask is not None:
        if not skip_dropped:
            log_mask, floor = jnp.zeros_like(log_mask), -jnp.inf
        live = ~dropped_key_blocks(jax.lax.stop_gradient(log_mask), block_q, block_k, floor=floor,
                                   segment_ids=segment_ids)
    elif segment_ids is not None:
        segments = acp_lib.segment_block_bounds(segment_ids, tq=tq, block_q=block_q, block_k=block_k)
    return TileVisits(tq, tk, block_q, block_k, seq_start=seq_start, kv_start=kv_start, q_end=q_end,
                      segments=segments, live=live, window_size=window_size)


# ---------------------------------------------------------------------------------------------------
# DCP: dropped pairs, live tiles and rows without a kept pair
# ---------------------------------------------------------------------------------------------------

def visible_pairs(tq: int, tk: int, segment_ids: jax.Array | None) -> jax.Array:
    """[1 or B, Tq, Tk] bool: causal with bottom-right alignment, same document."""
    offset = tk - tq
    vis = ((offset + jnp.arange(tq))[:, None] >= jnp.arange(tk)[None, :])[None]
    if segment_ids is not None:
        vis = vis & (segment_ids[:, offset:, None] == segment_ids[:, None, :])
    return vis


def dropped_key_blocks(
    log_mask: jax.Array,
    block_q: int,
    block_k: int,
    *,
    floor: float = LOG_FLOOR,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Which (query block, key block) tiles hold no visible kept pair: attention may skip them.

    tile (m, n) is flagged iff every visible pair in it — causal with bottom-right alignment
    (query i at absolute position Tk − Tq + i), inside [0, Tq)×[0, Tk), same document when
    ``segment_ids`` is given — has log I ≤ ``floor``. Tiles with no visible pair at all (above the
    diagonal, or the padded remainder) are flagged too (vacuously). Computed once per layer from the
    shared mask and used for every head. Dropped pairs weigh exactly 0 (``exclude_dropped``), so
    skipping a flagged tile changes nothing but the speed.

    Args:
      log_mask: [B, Tq, Tk] float32 log I of one layer.
      block_q, block_k: tile sizes (positive ints; T need not be a multiple).
      floor: values ≤ floor count as dropped.
      segment_ids: optional [B, Tk] int, packed documents.

    Returns:
      [B, ceil(Tq/block_q), ceil(Tk/block_k)] bool.

    Raises:
      ValueError: log_mask not rank 3, bad block sizes or segment_ids shape.
    """
    if log_mask.ndim != 3:
        raise ValueError(f"log_mask must be [B, Tq, Tk], got {log_mask.shape}")
    for name, v in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    b, tq, tk = log_mask.shape
    if segment_ids is not None and (segment_ids.shape != (b, tk)
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"segment_ids must be an int array of shape [B, Tk] = {(b, tk)}, "
                         f"got {segment_ids.dtype}{segment_ids.shape}")
    nq, nk = -(-tq // block_q), -(-tk // block_k)
    ignorable = (log_mask <= floor) | ~visible_pairs(tq, tk, segment_ids)
    ignorable = jnp.pad(ignorable, ((0, 0), (0, nq * block_q - tq), (0, nk * block_k - tk)),
                        constant_values=True)
    return jnp.all(ignorable.reshape(b, nq, block_q, nk, block_k), axis=(2, 4))


def exclude_dropped(log_mask: jax.Array, floor: float, dropped_value: float) -> jax.Array:
    """log_mask with every dropped pair (log I ≤ floor) set to ``dropped_value`` (−inf, or a finite
    value far below every kept logit for kernels that need finite inputs); zero gradient there."""
    return jnp.where(log_mask > floor, log_mask, dropped_value)


def rows_with_kept_pair(log_mask: jax.Array, floor: float, segment_ids: jax.Array | None = None) -> jax.Array:
    """[B, Tq] bool: query rows with at least one visible pair log I > floor (the others output 0)."""
    tq, tk = log_mask.shape[1:]
    return jnp.any((log_mask > floor) & visible_pairs(tq, tk, segment_ids), axis=-1)
