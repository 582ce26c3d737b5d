"""Portable Pallas kernels for forgetting attention (FoX) with block-level ACP skipping.

Three ``pl.pallas_call`` kernels (four with DCP) written against the Triton lowering
(``pltriton.CompilerParams``) on GPU and run with ``interpret=True`` elsewhere. They import nothing
from ``fox_jax``: they take arrays and block ranges and return arrays (docs/README.md, "Repository layout").

Math (docs/design/fox_acp.md §1, §4): with Λ the float32 cumulative log forget gate,

    s_ij = scale · q_i·k_j + (Λ_i − Λ_j),   o_i = Σ_j softmax_j(s_ij) v_j   (visible j only)

* forward  — grid (query block, head, batch); online softmax in float32, exponentials in base 2
  (``exp2(s·log2 e − m·log2 e)``), the decay Λ_i − Λ_j added in float32 *before* the base change (it is
  formed exactly as the dense reference forms it). Saves lse in natural log. Rows with no visible key
  give o = 0 and lse = −inf, never NaN.
* dQ       — grid (query block, head, batch); recomputes P from lse; dq = scale·Σ_j dS_ij k_j and the
  query-side decay gradient Σ_j dS_ij (float32).
* dK/dV    — grid (key block, head, batch), one program per *query* head (GQA: the wrapper sums the
  group in float32); dk = scale·Σ_i dS_ij q_i, dv = Σ_i P_ij do_i and the key-side decay gradient
  −Σ_i dS_ij (float32). Scores are formed transposed ([key, query]) so no register tile is transposed.

No atomics, nothing T×T in memory. Skipping is done with loop bounds, never with masking:

* causal: query block m visits key blocks [lo, causal_end(m)); key block n visits query blocks
  [causal_start(n), hi);
* left padding: key blocks entirely before ``seq_start[b]`` are never visited (lo = seq_start // bk;
  such key blocks run an empty query loop in dK/dV and write zeros);
* sliding window (static ``window_size`` W: query row r sees keys r − W < j ≤ r): query block m
  starts at key block (r_m − W + 1) // bk, r_m its first row; key block n stops after the query
  block holding row c_n + W − 1, c_n its last column;
* ACP (arXiv 2504.06949): forward and dQ take ``kv_start[b, h, m]`` (first key block to visit) and
  dK/dV takes ``q_end[b, h, n]`` (one past the last query block), int32, computed by the caller with
  each kernel's own block sizes. Tiles outside are never loaded.

Element masks (causal diagonal, key padding, seq_start boundary, window edge, segment ids) are applied
only on the tiles that need them: each key loop is split into a masked boundary part and an unmasked interior part.
With segment ids the unmasked part is further narrowed to the tiles wholly inside the block's one document
(``document_runs``: per block, the run of blocks on the other side holding only its id, computed from the ids
by the wrappers), the tiles on document edges are masked; document-aware skipping — per-block segment id ranges,
``seg_bounds`` — drops the tiles before the first and after the last block that shares an id.

DCP (Dynamic Context Pruning, docs/design/dcp.md §1.4): all three kernels optionally add a log mask shared by
the heads, ``log_mask[b, i, j]`` (float32, natural log, [B, Tq_pad, Tk_pad]; the dK/dV kernel reads its
transpose), to the scores. They then visit a compacted tile list instead of their loop ranges (the
block-sparse layout of splash attention's ``MaskInfo``, docs/design/pallas_gpu.md §2.4): per (b, query
block) the ascending live key blocks and their count (forward, dQ), per (b, key block) the live query
blocks (dK/dV), built by the caller per kernel tiling in XLA. The loop is ``for i in range(count)``
over ``idx[i]`` with no per-tile branch (a ``lax.cond`` per tile kept Triton from pipelining the
loads). Each list holds the tiles that need the element mask (causal diagonal, key padding, seq_start
or window edge, document boundary) first, then the fully visible ones; the two parts run as two loops,
masked and unmasked, as in the dense path. A fourth kernel, dlogI (grid (query block, key block, batch), heads
looped inside), writes the mask gradient Σ_h dS[b, h, i, j] one tile at a time: O(B·T²) like the mask
itself, never per head.

Layouts: q/o/do ``[B, Tq_pad, H, D]``, k/v ``[B, Tk_pad, Hkv, D]`` (the model's layout, no transposes),
per-row float32 vectors ``[B, H, T_pad]``. ``attention_forward`` / ``attention_backward`` below do the
padding (any length, any head dim ≤ 256) and call the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fox_jax.kernels.forgetting_attention_mgpu import MosaicConfig, clip_run, document_runs

LOG2E = math.log2(math.e)
_NEG_INF = float("-inf")
_POS_INF = float("inf")
MAX_HEAD_DIM = 256
MIN_BLOCK = 16  # tl.dot needs every matmul dimension ≥ 16


# ---------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tiling of one kernel: ``block_q`` query rows × ``block_k`` key columns per tile (powers of two,
    ≥ 16), and the Triton launch knobs.

    ``interleave_heads``: this kernel's grid order (see ``_spec_factory``); None = inherit
    ``KernelConfig.interleave_heads`` (whose None means: interleave exactly when ACP ranges are given).
    Grid order only reorders programs: results are bit-identical either way.
    """

    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    interleave_heads: bool | None = None

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            val = getattr(self, name)
            if val < MIN_BLOCK or val & (val - 1):
                raise ValueError(f"{name} must be a power of two ≥ {MIN_BLOCK}, got {val}")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tilings of the forward, dQ and dK/dV kernels (hashable: usable as a static argument).

    ``interleave_heads``: grid order of all three kernels (see ``_spec_factory``); None = interleave
    exactly when ACP ranges are given (per-head work then differs a lot and the heavy heads must not
    all run last). A kernel's own ``TileConfig.interleave_heads`` (when not None) overrides it, e.g.
    block-major forward with an interleaved dense backward:
    ``KernelConfig(fwd, replace(dq, interleave_heads=True), replace(dkv, interleave_heads=True))``.
    """

    fwd: TileConfig
    dq: TileConfig
    dkv: TileConfig
    interleave_heads: bool | None = None
    interleave_bwd_from: int | None = None
    dcp_unmasked_interior: bool = True
    mosaic: MosaicConfig | None = None

    # mosaic: run with the Hopper Mosaic GPU kernels (kernels/forgetting_attention_mgpu.py) at their own
    # tilings instead of the Triton kernels (the forward always; the backward when mosaic.backward).

    # dcp_unmasked_interior: with a DCP mask, the tile lists the caller builds put the fully visible
    # tiles in an unmasked loop after the masked ones (False: every listed tile gets the element mask;
    # same result, one loop — for comparisons).
    # interleave_bwd_from: when the grid order is otherwise unset, the dense dQ and dK/dV kernels
    # interleave heads for Tk ≥ this length (None: never). Measured at D=128 on an H200: −6 % backward
    # at T=16384, but +1–4 % at T ≤ 8192 (benchmarks/NOTES.md, "Backward sweep").


# Tuned on one H200 (jax 0.11.2, Triton lowering) by three sweeps of benchmarks/bench_attention.py
# starting from the official FoX kernel's H100/H200 table (docs/design/fox_acp.md §4.4); see
# benchmarks/NOTES.md. D=64: 4-warp tiles, 3 pipeline stages. D=128 (round 3, swept at B8 T2048 and
# B2 T8192): a 64×64 forward tile (−6 % forward at T=2048), 128-row 8-warp dQ tiles (−6 % dQ at
# T=8192), dK/dV 64×128 with 4 stages (−4 % at T=8192, bitwise deterministic over repeats). D=256 is
# only compile-checked (sm_90, no spills in fwd/dQ). Keys: head dim upper bound.
_GPU_CONFIGS = {
    64: KernelConfig(fwd=TileConfig(128, 64, 4, 3), dq=TileConfig(128, 64, 4, 3),
                     dkv=TileConfig(64, 64, 4, 3)),
    128: KernelConfig(fwd=TileConfig(64, 64, 4, 3), dq=TileConfig(128, 64, 8, 3),
                      dkv=TileConfig(64, 128, 8, 4), interleave_bwd_from=16384),
    256: KernelConfig(fwd=TileConfig(64, 64, 8, 2), dq=TileConfig(64, 32, 8, 2),
                      dkv=TileConfig(32, 64, 8, 2)),
}

# Interpret mode (CPU): small, deliberately different tiles per kernel so that the CPU tests exercise
# multi-block loops, boundary tiles and kernel-specific ACP ranges on short sequences.
_INTERPRET_CONFIG = KernelConfig(fwd=TileConfig(32, 16), dq=TileConfig(16, 32), dkv=TileConfig(32, 16))


def default_config(head_dim: int, *, interpret: bool = False) -> KernelConfig:
    """The default tiling for a (padded) head dim; ``interpret`` selects the small CPU tiling."""
    if interpret:
        return _INTERPRET_CONFIG
    for bound in sorted(_GPU_CONFIGS):
        if head_dim <= bound:
            return _GPU_CONFIGS[bound]
    raise ValueError(f"head_dim must be ≤ {MAX_HEAD_DIM}, got {head_dim}")


def padded_head_dim(head_dim: int) -> int:
    """Head dim the kernels run at: the next power of two ≥ 16 (zero padding is exact)."""
    if head_dim < 1 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}] for the Pallas kernels, got {head_dim}")
    return max(MIN_BLOCK, pl.next_power_of_2(head_dim))


def _fit(block: int, length: int) -> int:
    return min(block, max(MIN_BLOCK, pl.next_power_of_2(length)))


def resolve_tiles(config: KernelConfig, tq: int, tk: int) -> KernelConfig:
    """Clamp each kernel's blocks to the sequence lengths (short sequences use smaller tiles).

    Callers that compute ACP ranges must use the blocks of the *resolved* config."""
    def one(t: TileConfig) -> TileConfig:
        return dataclasses.replace(t, block_q=_fit(t.block_q, tq), block_k=_fit(t.block_k, tk))
    return dataclasses.replace(config, fwd=one(config.fwd), dq=one(config.dq), dkv=one(config.dkv))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _compiler_params(t: TileConfig, interpret: bool):
    if interpret:
        return None
    return pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)


@dataclasses.dataclass(frozen=True)
class _Geom:
    """Static geometry shared by the kernels of one call."""

    tq: int  # real query length
    tk: int  # real key length
    h: int
    group: int  # H // Hkv
    scale: float
    has_seg: bool
    has_acp: bool
    has_sb: bool = False  # document-aware block bounds given (segment ids only)
    has_mask: bool = False  # DCP log mask (+ compacted tile lists) given
    window_size: int | None = None  # sliding window: row r sees keys r − W < j ≤ r

    @property
    def offset(self) -> int:  # bottom-right alignment: query i sits at absolute position offset + i
        return self.tk - self.tq


def _geom(tq, tk, h, hkv, scale, seg_q, ranges, seg_bounds, log_mask=None, tiles=None, window_size=None) -> _Geom:
    if seg_bounds is not None and seg_q is None:
        raise ValueError("seg_bounds (document-aware skipping) need segment ids")
    if (log_mask is None) != (tiles is None):
        raise ValueError("log_mask and its tiles (per-tile live flags or compacted tile lists) go together")
    return _Geom(tq, tk, h, h // hkv, float(scale), seg_q is not None, ranges is not None,
                 seg_bounds is not None, log_mask is not None, window_size)


def _dot(a, b, contract_a: int = 1, contract_b: int = 0):
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _kv_head(h, group: int):
    return h if group == 1 else lax.div(h, group)


def _spec_factory(interleave_heads: bool):
    """BlockSpec builder over index maps written as fn(block, head, batch).

    Grid order (blocks, heads, batch) — consecutive programs are the blocks of one head (K/V or Q/dO
    shared in L2) — or, with ``interleave_heads``, (heads, blocks, batch): consecutive programs are
    the heads of one block, which balances the load when per-head work differs (ACP)."""
    def spec(block_shape, fn):
        if interleave_heads:
            return pl.BlockSpec(block_shape, lambda j, i, z: fn(i, j, z))
        return pl.BlockSpec(block_shape, fn)
    return spec


def _grid(n_blocks: int, h: int, b: int, interleave_heads: bool):
    return (h, n_blocks, b) if interleave_heads else (n_blocks, h, b)


def _block_id(interleave_heads: bool):
    return pl.program_id(1 if interleave_heads else 0)


# ---------------------------------------------------------------------------------------------------
# Forward kernel
# ---------------------------------------------------------------------------------------------------


def _key_loop_bounds(g: _Geom, m, bq: int, bk: int, ss, acp_lo, seg_lo=None, seg_hi=None):
    """Key-block loop pieces for query block m: (lo, lo_full, mid, hi).

    Blocks [lo, min(lo_full, mid)) and [max(mid, lo), hi) need element masks, [lo_full, mid) not:
    lo skips blocks before seq_start and before the window of the block's first row (and ACP-pruned
    ones), lo_full = lo + 1 when block lo straddles seq_start, or later, the first block inside the
    window of the block's last row; mid is the first block that crosses the causal diagonal of the
    block's first row, hi is
    one past the block holding the last visible column. ``seg_lo``/``seg_hi`` (document-aware
    skipping, segment ids only) narrow [lo, hi); with segment ids ``clip_run`` then narrows
    the unmasked part to the block's document.
    """
    r0 = g.offset + m * bq  # first (absolute) row of the block; always < tk
    r_last = jnp.minimum(r0 + (bq - 1), g.tk - 1)
    hi = lax.div(r_last, bk) + 1
    lo = lax.div(ss, bk)
    if g.window_size is not None:
        lo = jnp.maximum(lo, lax.div(jnp.maximum(r0 - (g.window_size - 1), 0), bk))
    if acp_lo is not None:
        lo = jnp.maximum(lo, acp_lo)
    if seg_lo is not None:
        lo = jnp.maximum(lo, seg_lo)
        hi = jnp.minimum(hi, seg_hi)
    lo = jnp.minimum(lo, hi)
    lo_full = lo + (lo * bk < ss).astype(jnp.int32)
    if g.window_size is not None:  # blocks crossing the window edge of some row are masked
        lo_full = jnp.maximum(lo_full, lax.div(jnp.maximum(r_last - (g.window_size - 1), 0) + (bk - 1), bk))
    mid = lax.div(r0 + 1, bk)
    return lo, lo_full, mid, hi


def _row_block_scores(g, q, lq, qpos, ss, sq, k_ref, lk_ref, sk_ref, start, bk: int, masked: bool, k=None,
                      mask_ref=None):
    """Scores of one query block against key block [start, start + bk) (forward and dQ kernels):
    scale·q·kᵀ + (Λ_i − Λ_j) [+ log I_ij, DCP] in float32, and on boundary tiles (``masked``) −inf
    outside the causal, length, seq_start, window and segment masks."""
    if k is None:
        k = k_ref[pl.ds(start, bk), :]
    lk = lk_ref[pl.ds(start, bk)]
    s = _dot(q, k, 1, 1) * g.scale + (lq[:, None] - lk[None, :])
    if mask_ref is not None:
        s = s + mask_ref[:, pl.ds(start, bk)]
    if masked:
        kpos = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        mask = (kpos <= qpos) & (kpos < g.tk) & (kpos >= ss)
        if g.window_size is not None:
            mask = mask & (qpos - kpos < g.window_size)
        if g.has_seg:
            mask = mask & (sq[:, None] == sk_ref[pl.ds(start, bk)][None, :])
        s = jnp.where(mask, s, _NEG_INF)
    return s


def _query_block_setup(g: _Geom, rest: list, bq: int, bk: int, nq: int, interleave: bool, q_ref, lq_ref, ss_ref):
    """Shared prologue of the forward and dQ kernels (one query block against a loop over key blocks).

    Pops the optional inputs (ACP start, document bounds, segment ids and document runs, DCP mask and
    tile list) from ``rest`` in the order ``_query_side_optional_inputs`` passes them, leaving the outputs
    there, and returns (q, lq, ss, sq, sk_ref, qpos, bounds, dcp) with bounds = ``_key_loop_bounds`` of
    this block plus, with segment ids, its unmasked document interior (``clip_run``), and
    dcp = (mask_ref [bq, Tk_pad], (idx_ref [nk_pow2], n_masked_ref [], count_ref [])) or (None, None).
    """
    lo_ref = rest.pop(0) if g.has_acp else None
    slo_ref, shi_ref = (rest.pop(0), rest.pop(0)) if g.has_sb else (None, None)
    sq_ref, sk_ref, rlo_ref, rhi_ref = [rest.pop(0) for _ in range(4)] if g.has_seg else (None,) * 4
    dcp = (rest.pop(0), (rest.pop(0), rest.pop(0), rest.pop(0))) if g.has_mask else (None, None)
    m = nq - 1 - _block_id(interleave)  # longest rows first (causal load balance)
    ss = ss_ref[()]
    sq = sq_ref[...] if g.has_seg else None
    qpos = g.offset + m * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    bounds = _key_loop_bounds(g, m, bq, bk, ss, None if lo_ref is None else lo_ref[()],
                              None if slo_ref is None else slo_ref[()], None if shi_ref is None else shi_ref[()])
    if g.has_seg:
        lo, lo_full, mid, hi = bounds
        lower = jnp.minimum(lo_full, hi)
        bounds += clip_run(lower, jnp.maximum(lower, jnp.minimum(mid, hi)), rlo_ref[()], rhi_ref[()])
    return q_ref[...], lq_ref[...], ss, sq, sk_ref, qpos, bounds, dcp


def _run_tile_list(step, carry, tile_list):
    """DCP: two loops over a compacted tile list (idx_ref, n_masked_ref, count_ref) —
    ``step(idx[i], masked=True)`` for i < n_masked (tiles on the causal diagonal, the key padding,
    the seq_start or window edge or a document boundary: full element mask), then
    ``step(idx[i], masked=False)`` for n_masked ≤ i < count (fully visible tiles). No per-tile branch,
    so the loads of the next tile can be pipelined."""
    idx_ref, n_masked_ref, count_ref = tile_list
    n_masked = n_masked_ref[()]
    carry = lax.fori_loop(0, n_masked, lambda i, c: step(idx_ref[i], c, masked=True), carry)
    return lax.fori_loop(n_masked, count_ref[()], lambda i, c: step(idx_ref[i], c, masked=False), carry)


def _run_key_loops(g: _Geom, step, carry, bounds, tile_list=None):
    """The key-block loops of a query block: masked [lo, min(lo_full, mid)), unmasked [lo_full, mid),
    masked [max(mid, lo), hi) — with segment ids masked [lo, a), unmasked [a, b), masked [b, hi), [a, b)
    the document interior. With ``tile_list`` (DCP: the live key blocks in the loop range,
    ``_run_tile_list``), the loops over the list."""
    if tile_list is not None:
        return _run_tile_list(step, carry, tile_list)
    lo, lo_full, mid, hi = bounds[:4]
    masked_step = functools.partial(step, masked=True)
    if g.has_seg:
        a, b = bounds[4:]
        carry = lax.fori_loop(lo, a, masked_step, carry)
        carry = lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
        return lax.fori_loop(b, hi, masked_step, carry)
    carry = lax.fori_loop(lo, jnp.minimum(lo_full, mid), masked_step, carry)
    carry = lax.fori_loop(lo_full, mid, functools.partial(step, masked=False), carry)
    return lax.fori_loop(jnp.maximum(mid, lo), hi, masked_step, carry)


def _fwd_kernel(*refs, g: _Geom, bq: int, bk: int, nq: int, interleave: bool):
    refs = list(refs)
    q_ref, k_ref, v_ref, lq_ref, lk_ref, ss_ref = refs[:6]
    rest = refs[6:]
    q, lq, ss, sq, sk_ref, qpos, bounds, (mask_ref, tile_list) = _query_block_setup(
        g, rest, bq, bk, nq, interleave, q_ref, lq_ref, ss_ref)
    o_ref, lse_ref = rest
    d = q.shape[-1]

    def step(n, carry, masked):
        acc, m_i, l_i = carry
        start = pl.multiple_of(n * bk, bk)
        v = v_ref[pl.ds(start, bk), :]
        s = _row_block_scores(g, q, lq, qpos, ss, sq, k_ref, lk_ref, sk_ref, start, bk, masked, mask_ref=mask_ref)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        m_base = jnp.where(m_new == _NEG_INF, 0.0, m_new) if masked else m_new
        if mask_ref is None:
            m_base = m_base * LOG2E
            alpha = jnp.exp2(m_i * LOG2E - m_base)
            p = jnp.exp2(s * LOG2E - m_base[:, None])
        else:  # DCP: dropped pairs carry finite scores near −1e30, and while a row has seen only those, the
            # running max is one of them: s·log2e − m·log2e (contracted to an FMA by the compiler) would keep the
            # ~1e23 rounding error of m·log2e there (2^1e23 = inf, then inf·0 = NaN). The difference first is
            # exact for such near-equal values (Sterbenz) and ≤ 0: alpha, p ∈ [0, 1].
            alpha = jnp.exp2((m_i - m_base) * LOG2E)
            p = jnp.exp2((s - m_base[:, None]) * LOG2E)
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l_new

    carry = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), _NEG_INF, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    acc, m_i, l_i = _run_key_loops(g, step, carry, bounds, tile_list)
    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    o_ref[...] = (acc * (1.0 / l_safe)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, _NEG_INF, m_i + jnp.log(l_safe))


def _tile_list_specs(spec, blk, tile_list):
    """BlockSpecs of a compacted tile list (idx [B, Hl, n_blocks, L_pow2], n_masked and count
    [B, Hl, n_blocks]) for the program of (block, head, batch): Hl = 1 (lists shared by the heads) or
    H (per head, with ACP)."""
    idx = tile_list[0]
    per_head = idx.shape[1] > 1

    def head(j):
        return j if per_head else 0
    return [spec((None, None, None, idx.shape[-1]), lambda i, j, z: (z, head(j), blk(i), 0)),
            spec((None, None, None), lambda i, j, z: (z, head(j), blk(i))),
            spec((None, None, None), lambda i, j, z: (z, head(j), blk(i)))]


def _query_side_optional_inputs(spec, qblk, bq: int, bk: int, tk_pad: int, kv_start, seg_bounds, seg_q, seg_k,
                                log_mask=None, tile_list=None):
    """BlockSpecs and arrays of the optional inputs of the query-block kernels (forward and dQ), in the
    order the kernels pop them: the ACP key-block start of each query block, the document-aware key
    block range (lo, hi) of each query block, the query and key segment ids and each query block's
    document run of key blocks (``document_runs``), then the DCP log mask [B, Tq_pad, Tk_pad] and the
    key-block list (idx [B, Hl, nq, nk_pow2], n_masked, count [B, Hl, nq])."""
    specs, args = [], []
    if kv_start is not None:
        specs.append(spec((None, None, None), lambda i, j, z: (z, j, qblk(i))))
        args.append(kv_start)
    if seg_bounds is not None:
        specs += [spec((None, None), lambda i, j, z: (z, qblk(i)))] * 2
        args += list(seg_bounds)
    if seg_q is not None:
        specs += [spec((None, bq), lambda i, j, z: (z, qblk(i))), spec((None, tk_pad), lambda i, j, z: (z, 0))]
        specs += [spec((None, None), lambda i, j, z: (z, qblk(i)))] * 2
        args += [seg_q, seg_k, *document_runs(seg_q, seg_k, bq, bk)]
    if log_mask is not None:
        specs += [spec((None, bq, tk_pad), lambda i, j, z: (z, qblk(i), 0))] + _tile_list_specs(spec, qblk, tile_list)
        args += [log_mask, *tile_list]
    return specs, args


def flash_forward(q, k, v, lam_q, lam_k, seq_start, kv_start, seg_q, seg_k, *, tq: int, tk: int,
                  scale: float, tile: TileConfig, interpret: bool,
                  interleave_heads: bool = False, seg_bounds=None, log_mask=None, kv_list=None,
                  window_size=None):
    """Forward kernel on padded inputs.

    Args:
      q: [B, Tq_pad, H, D]; k, v: [B, Tk_pad, Hkv, D] (D a power of two ≥ 16; Tq_pad, Tk_pad multiples
        of the tile's blocks); lam_q: [B, H, Tq_pad] float32 Λ at the query rows; lam_k: [B, H, Tk_pad];
        seq_start: [B] int32; kv_start: [B, H, ceil(tq/block_q)] int32 or None (ACP);
        seg_q: [B, Tq_pad] / seg_k: [B, Tk_pad] int32 or None;
        seg_bounds: None or (kv_lo, kv_hi), each [B, ceil(tq/block_q)] int32 — document-aware skipping
        (``fox_jax.ops.acp.segment_block_bounds`` with this tile's blocks); only with segment ids.
        log_mask: None or [B, Tq_pad, Tk_pad] float32 DCP log mask (finite), added to every head's
        scores; kv_list: with it, (idx [B, Hl, ceil(tq/block_q), nk_pow2], n_masked, count
        [B, Hl, ceil(tq/block_q)]) int32, Hl ∈ {1, H}: query block m visits exactly the key blocks
        idx[b, h, m, :count[b, h, m]] (this tile's blocks; each < ceil(tk/block_k); nk_pow2 a power of
        two ≥ 1) instead of its loop ranges, the first n_masked with the element mask (causal,
        padding, seq_start, window, segments) and the rest without it — so those must be fully
        visible. Both or neither.
      tq, tk: real lengths; scale: logit scale.
    Returns:
      o [B, Tq_pad, H, D] in q.dtype and lse [B, H, Tq_pad] float32 (natural log; −inf for empty rows).
      Rows ≥ ceil(tq/block_q)·block_q are not written.
    """
    b, tq_pad, h, d = q.shape
    tk_pad, hkv = k.shape[1], k.shape[2]
    bq, bk = tile.block_q, tile.block_k
    nq = _cdiv(tq, bq)
    g = _geom(tq, tk, h, hkv, scale, seg_q, kv_start, seg_bounds, log_mask, kv_list, window_size)
    grp = g.group
    spec = _spec_factory(interleave_heads)

    def qblk(i):
        return nq - 1 - i

    in_specs = [
        spec((None, bq, None, d), lambda i, j, z: (z, qblk(i), j, 0)),
        spec((None, tk_pad, None, d), lambda i, j, z: (z, 0, _kv_head(j, grp), 0)),
        spec((None, tk_pad, None, d), lambda i, j, z: (z, 0, _kv_head(j, grp), 0)),
        spec((None, None, bq), lambda i, j, z: (z, j, qblk(i))),
        spec((None, None, tk_pad), lambda i, j, z: (z, j, 0)),
        spec((None,), lambda i, j, z: (z,)),
    ]
    args = [q, k, v, lam_q, lam_k, seq_start]
    extra_specs, extra_args = _query_side_optional_inputs(spec, qblk, bq, bk, tk_pad, kv_start, seg_bounds,
                                                          seg_q, seg_k, log_mask, kv_list)
    in_specs += extra_specs
    args += extra_args
    return pl.pallas_call(
        functools.partial(_fwd_kernel, g=g, bq=bq, bk=bk, nq=nq, interleave=interleave_heads),
        grid=_grid(nq, h, b, interleave_heads),
        in_specs=in_specs,
        out_specs=[spec((None, bq, None, d), lambda i, j, z: (z, qblk(i), j, 0)),
                   spec((None, None, bq), lambda i, j, z: (z, j, qblk(i)))],
        out_shape=[jax.ShapeDtypeStruct((b, tq_pad, h, d), q.dtype),
                   jax.ShapeDtypeStruct((b, h, tq_pad), jnp.float32)],
        compiler_params=_compiler_params(tile, interpret),
        interpret=interpret,
        name="fox_attention_fwd",
    )(*args)


# ---------------------------------------------------------------------------------------------------
# dQ kernel
# ---------------------------------------------------------------------------------------------------


def _dq_kernel(*refs, g: _Geom, bq: int, bk: int, nq: int, interleave: bool):
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lq_ref, lk_ref, lse_ref, dl_ref, ss_ref = refs[:9]
    rest = refs[9:]
    q, lq, ss, sq, sk_ref, qpos, bounds, (mask_ref, tile_list) = _query_block_setup(
        g, rest, bq, bk, nq, interleave, q_ref, lq_ref, ss_ref)
    dq_ref, dlq_ref = rest
    d = q.shape[-1]
    do = do_ref[...]
    lse2 = lse_ref[...]  # base-2 lse; +inf for rows with no visible key (P = 0 there)
    delta = dl_ref[...]

    def step(n, carry, masked):
        dq, dlq = carry
        start = pl.multiple_of(n * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        s = _row_block_scores(g, q, lq, qpos, ss, sq, k_ref, lk_ref, sk_ref, start, bk, masked, k=k,
                              mask_ref=mask_ref)
        p = jnp.exp2(s * LOG2E - lse2[:, None])
        dp = _dot(do, v, 1, 1)
        ds = p * (dp - delta[:, None])
        dq = dq + _dot(ds.astype(k.dtype), k)
        return dq, dlq + jnp.sum(ds, axis=1)

    dq, dlq = _run_key_loops(g, step, (jnp.zeros((bq, d), jnp.float32), jnp.zeros((bq,), jnp.float32)), bounds,
                             tile_list)
    dq_ref[...] = (dq * g.scale).astype(dq_ref.dtype)
    dlq_ref[...] = dlq


def flash_backward_dq(q, k, v, do, lam_q, lam_k, lse2, delta, seq_start, kv_start, seg_q, seg_k, *,
                      tq: int, tk: int, scale: float, tile: TileConfig, interpret: bool,
                      interleave_heads: bool = False, seg_bounds=None, log_mask=None, kv_list=None,
                      window_size=None):
    """dQ kernel on padded inputs (shapes as in ``flash_forward``; do like q).

    Args:
      lse2: [B, H, Tq_pad] float32 lse·log2(e), +inf for empty and padded rows.
      delta: [B, H, Tq_pad] float32 rowsum(o·do), 0 on padded rows.
      kv_start: [B, H, ceil(tq/block_q)] int32 or None (ACP, computed with this tile's blocks).
      seg_bounds: None or (kv_lo, kv_hi) [B, ceil(tq/block_q)] int32 (as in ``flash_forward``).
      log_mask, kv_list: DCP mask and this tile's key-block lists (as in ``flash_forward``).
    Returns:
      dq [B, Tq_pad, H, D] in q.dtype and the query-side decay gradient Σ_j dS_ij [B, H, Tq_pad] f32.
    """
    b, tq_pad, h, d = q.shape
    tk_pad, hkv = k.shape[1], k.shape[2]
    bq, bk = tile.block_q, tile.block_k
    nq = _cdiv(tq, bq)
    g = _geom(tq, tk, h, hkv, scale, seg_q, kv_start, seg_bounds, log_mask, kv_list, window_size)
    grp = g.group
    spec = _spec_factory(interleave_heads)

    def qblk(i):
        return nq - 1 - i

    qspec = spec((None, bq, None, d), lambda i, j, z: (z, qblk(i), j, 0))
    kvspec = spec((None, tk_pad, None, d), lambda i, j, z: (z, 0, _kv_head(j, grp), 0))
    rowspec = spec((None, None, bq), lambda i, j, z: (z, j, qblk(i)))
    in_specs = [qspec, kvspec, kvspec, qspec, rowspec,
                spec((None, None, tk_pad), lambda i, j, z: (z, j, 0)),
                rowspec, rowspec, spec((None,), lambda i, j, z: (z,))]
    args = [q, k, v, do, lam_q, lam_k, lse2, delta, seq_start]
    extra_specs, extra_args = _query_side_optional_inputs(spec, qblk, bq, bk, tk_pad, kv_start, seg_bounds,
                                                          seg_q, seg_k, log_mask, kv_list)
    in_specs += extra_specs
    args += extra_args
    return pl.pallas_call(
        functools.partial(_dq_kernel, g=g, bq=bq, bk=bk, nq=nq, interleave=interleave_heads),
        grid=_grid(nq, h, b, interleave_heads),
        in_specs=in_specs,
        out_specs=[qspec, rowspec],
        out_shape=[jax.ShapeDtypeStruct((b, tq_pad, h, d), q.dtype),
                   jax.ShapeDtypeStruct((b, h, tq_pad), jnp.float32)],
        compiler_params=_compiler_params(tile, interpret),
        interpret=interpret,
        name="fox_attention_bwd_dq",
    )(*args)


# ---------------------------------------------------------------------------------------------------
# dK/dV kernel
# ---------------------------------------------------------------------------------------------------


def _dkv_kernel(*refs, g: _Geom, bq: int, bk: int, interleave: bool):
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lq_ref, lk_ref, lse_ref, dl_ref, ss_ref = refs[:9]
    rest = refs[9:]
    hi_ref = rest.pop(0) if g.has_acp else None
    slo_ref, shi_ref = (rest.pop(0), rest.pop(0)) if g.has_sb else (None, None)
    sq_ref, sk_ref, rlo_ref, rhi_ref = [rest.pop(0) for _ in range(4)] if g.has_seg else (None,) * 4
    mask_t_ref, tile_list = (rest.pop(0), (rest.pop(0), rest.pop(0), rest.pop(0))) if g.has_mask else (None, None)
    dk_ref, dv_ref, dlk_ref = rest

    n = _block_id(interleave)
    d = k_ref.shape[-1]
    nq = _cdiv(g.tq, bq)
    k = k_ref[...]
    v = v_ref[...]
    lk = lk_ref[...]
    ss = ss_ref[()]
    sk = sk_ref[...] if g.has_seg else None
    c0 = n * bk
    c_last = c0 + (bk - 1)
    kpos = c0 + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)

    lo = lax.div(jnp.maximum(c0 - g.offset, 0), bq)  # first query block that sees column c0
    hi = jnp.int32(nq) if hi_ref is None else jnp.minimum(hi_ref[()], nq)
    if slo_ref is not None:  # document-aware skipping
        lo = jnp.maximum(lo, slo_ref[()])
        hi = jnp.minimum(hi, shi_ref[()])
    if g.window_size is not None:  # rows past c_last + W − 1 see no column of this block
        hi = jnp.minimum(hi, lax.div(jnp.maximum(c_last + (g.window_size - 1) - g.offset + bq, 0), bq))
    hi = jnp.where(c0 + bk <= ss, lo, hi)  # key block entirely before seq_start: nothing to do
    hi = jnp.maximum(hi, lo)
    # query blocks [lo, mid) cross the diagonal of this key block; all blocks are boundary blocks
    # when the key block straddles seq_start or the end of the keys
    mid = lax.div(jnp.maximum(c_last - g.offset, 0) + (bq - 1), bq)
    mid = jnp.where((c0 < ss) | (c_last >= g.tk), hi, jnp.minimum(mid, hi))
    full = hi  # query blocks [full, hi) hold a (real) row past the window of column c0: masked as well
    if g.window_size is not None:
        full = jnp.where(c0 + g.window_size >= g.tk, nq, lax.div(jnp.maximum(c0 + g.window_size - g.offset, 0), bq))
        full = jnp.minimum(full, hi)

    def step(mi, carry, masked):
        dk, dv, dlk = carry
        start = pl.multiple_of(mi * bq, bq)
        q = q_ref[pl.ds(start, bq), :]
        do = do_ref[pl.ds(start, bq), :]
        lq = lq_ref[pl.ds(start, bq)]
        lse2 = lse_ref[pl.ds(start, bq)]
        delta = dl_ref[pl.ds(start, bq)]
        st = _dot(k, q, 1, 1) * g.scale + (lq[None, :] - lk[:, None])  # [bk, bq]
        if mask_t_ref is not None:
            st = st + mask_t_ref[:, pl.ds(start, bq)]
        if masked:
            qpos = g.offset + start + lax.broadcasted_iota(jnp.int32, (1, bq), 1)
            mask = (kpos <= qpos) & (kpos < g.tk) & (kpos >= ss)
            if g.window_size is not None:
                mask = mask & (qpos - kpos < g.window_size)
            if g.has_seg:
                mask = mask & (sk[:, None] == sq_ref[pl.ds(start, bq)][None, :])
            st = jnp.where(mask, st, _NEG_INF)
        pt = jnp.exp2(st * LOG2E - lse2[None, :])
        dv = dv + _dot(pt.astype(do.dtype), do)
        dpt = _dot(v, do, 1, 1)
        dst = pt * (dpt - delta[None, :])
        dk = dk + _dot(dst.astype(q.dtype), q)
        return dk, dv, dlk - jnp.sum(dst, axis=1)

    carry = (jnp.zeros((bk, d), jnp.float32), jnp.zeros((bk, d), jnp.float32),
             jnp.zeros((bk,), jnp.float32))
    masked_step = functools.partial(step, masked=True)
    if tile_list is not None:  # DCP: the live query blocks of this key block
        carry = _run_tile_list(step, carry, tile_list)
    elif g.has_seg:  # masked [lo, a), the document interior [a, b) unmasked, masked [b, hi)
        lower = jnp.maximum(mid, lo)
        a, b = clip_run(lower, jnp.maximum(lower, full), rlo_ref[()], rhi_ref[()])
        carry = lax.fori_loop(lo, a, masked_step, carry)
        carry = lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(b, hi, masked_step, carry)
    else:
        carry = lax.fori_loop(lo, mid, masked_step, carry)
        carry = lax.fori_loop(jnp.maximum(mid, lo), full, functools.partial(step, masked=False), carry)
        if g.window_size is not None:
            carry = lax.fori_loop(jnp.maximum(jnp.maximum(full, mid), lo), hi, masked_step, carry)
    dk, dv, dlk = carry
    dk_ref[...] = (dk * g.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    dlk_ref[...] = dlk


def flash_backward_dkv(q, k, v, do, lam_q, lam_k, lse2, delta, seq_start, q_end, seg_q, seg_k, *,
                       tq: int, tk: int, scale: float, tile: TileConfig, interpret: bool,
                       interleave_heads: bool = False, seg_bounds=None, log_mask_t=None, q_list=None,
                       window_size=None):
    """dK/dV kernel on padded inputs (shapes as in ``flash_backward_dq``).

    Args:
      q_end: [B, H, ceil(tk/block_k)] int32 or None (ACP): one past the last query block each key
        block visits, computed with this tile's blocks.
      seg_bounds: None or (q_lo, q_hi), each [B, ceil(tk/block_k)] int32: document-aware query-block
        range of each key block (``segment_block_bounds`` with this tile's blocks; segment ids only).
      log_mask_t: None or [B, Tk_pad, Tq_pad] float32, the DCP log mask transposed; q_list: with it,
        (idx [B, Hl, ceil(tk/block_k), nq_pow2], n_masked, count [B, Hl, ceil(tk/block_k)]) int32,
        Hl ∈ {1, H}: key block n visits exactly the query blocks idx[b, h, n, :count[b, h, n]] (this
        tile's blocks) instead of its loop range, the first n_masked with the element mask (as in
        ``flash_forward``).
    Returns:
      dk, dv [B, Tk_pad, H, D] per *query* head (in k.dtype without GQA, float32 with GQA, for the
      caller's group sum) and the key-side decay gradient −Σ_i dS_ij [B, H, Tk_pad] float32.
    """
    b, tq_pad, h, d = q.shape
    tk_pad, hkv = k.shape[1], k.shape[2]
    bq, bk = tile.block_q, tile.block_k
    nk = _cdiv(tk, bk)
    g = _geom(tq, tk, h, hkv, scale, seg_q, q_end, seg_bounds, log_mask_t, q_list, window_size)
    grp = g.group
    spec = _spec_factory(interleave_heads)

    qspec = spec((None, tq_pad, None, d), lambda i, j, z: (z, 0, j, 0))
    kvspec = spec((None, bk, None, d), lambda i, j, z: (z, i, _kv_head(j, grp), 0))
    qrow = spec((None, None, tq_pad), lambda i, j, z: (z, j, 0))
    krow = spec((None, None, bk), lambda i, j, z: (z, j, i))
    in_specs = [qspec, kvspec, kvspec, qspec, qrow, krow, qrow, qrow,
                spec((None,), lambda i, j, z: (z,))]
    args = [q, k, v, do, lam_q, lam_k, lse2, delta, seq_start]
    if q_end is not None:
        in_specs.append(spec((None, None, None), lambda i, j, z: (z, j, i)))
        args.append(q_end)
    if seg_bounds is not None:
        in_specs += [spec((None, None), lambda i, j, z: (z, i))] * 2
        args += list(seg_bounds)
    if seg_q is not None:
        in_specs += [spec((None, tq_pad), lambda i, j, z: (z, 0)),
                     spec((None, bk), lambda i, j, z: (z, i))] + [spec((None, None), lambda i, j, z: (z, i))] * 2
        args += [seg_q, seg_k, *document_runs(seg_k, seg_q, bk, bq)]
    if log_mask_t is not None:
        in_specs += [spec((None, bk, tq_pad), lambda i, j, z: (z, i, 0))] + _tile_list_specs(spec, lambda i: i,
                                                                                             q_list)
        args += [log_mask_t, *q_list]
    out_dtype = k.dtype if grp == 1 else jnp.float32
    out_kv = spec((None, bk, None, d), lambda i, j, z: (z, i, j, 0))
    return pl.pallas_call(
        functools.partial(_dkv_kernel, g=g, bq=bq, bk=bk, interleave=interleave_heads),
        grid=_grid(nk, h, b, interleave_heads),
        in_specs=in_specs,
        out_specs=[out_kv, out_kv, krow],
        out_shape=[jax.ShapeDtypeStruct((b, tk_pad, h, d), out_dtype),
                   jax.ShapeDtypeStruct((b, tk_pad, h, d), out_dtype),
                   jax.ShapeDtypeStruct((b, h, tk_pad), jnp.float32)],
        compiler_params=_compiler_params(tile, interpret),
        interpret=interpret,
        name="fox_attention_bwd_dkv",
    )(*args)


# ---------------------------------------------------------------------------------------------------
# DCP mask-gradient kernel
# ---------------------------------------------------------------------------------------------------


def _dmask_kernel(*refs, g: _Geom, bq: int, bk: int):
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lq_ref, lk_ref, lse_ref, dl_ref, ss_ref, mask_ref, live_ref = refs[:11]
    rest = refs[11:]
    sq_ref, sk_ref = (rest.pop(0), rest.pop(0)) if g.has_seg else (None, None)
    (dm_ref,) = rest
    m, n = pl.program_id(0), pl.program_id(1)
    ss = ss_ref[()]
    r0 = g.offset + m * bq
    qpos = r0 + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    kpos = n * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    vis = (kpos <= qpos) & (kpos < g.tk) & (kpos >= ss)
    if g.window_size is not None:
        vis = vis & (qpos - kpos < g.window_size)
    if g.has_seg:
        vis = vis & (sq_ref[...][:, None] == sk_ref[...][None, :])
    r_last = jnp.minimum(r0 + (bq - 1), g.tk - 1)
    run = (live_ref[()] != 0) & (n * bk <= r_last) & ((n + 1) * bk > ss)
    log_mask = mask_ref[...]

    def head(hh, acc):
        kh = _kv_head(hh, g.group)
        q, do = q_ref[:, hh, :], do_ref[:, hh, :]
        k, v = k_ref[:, kh, :], v_ref[:, kh, :]
        s = _dot(q, k, 1, 1) * g.scale + (lq_ref[hh, :][:, None] - lk_ref[hh, :][None, :]) + log_mask
        s = jnp.where(vis, s, _NEG_INF)
        p = jnp.exp2(s * LOG2E - lse_ref[hh, :][:, None])
        dp = _dot(do, v, 1, 1)
        return acc + p * (dp - dl_ref[hh, :][:, None])

    zeros = jnp.zeros((bq, bk), jnp.float32)
    dm_ref[...] = lax.cond(run, lambda: lax.fori_loop(0, g.h, head, zeros), lambda: zeros)


def dmask_tile(config: KernelConfig) -> TileConfig:
    """Tiling of the DCP mask-gradient kernel: at most 64×64 (dividing the dQ tile, hence the padded
    lengths), 4 warps, 2 stages. Its loop over heads pipelines q, do, k and v tiles; with the dQ tile
    (128×64, 3 stages) it needed 288 KB of shared memory at D=128 (Triton 3.6, sm_90 — over the 227 KB
    limit), with this one 128 KB (benchmarks/NOTES.md, "DCP kernels")."""
    return TileConfig(min(config.dq.block_q, 64), min(config.dq.block_k, 64), num_warps=4, num_stages=2)


def flash_backward_dmask(q, k, v, do, lam_q, lam_k, lse2, delta, seq_start, seg_q, seg_k, log_mask, live, *,
                         tq: int, tk: int, scale: float, tile: TileConfig, interpret: bool, window_size=None):
    """Gradient of the DCP log mask on padded inputs: dlogI[b, i, j] = Σ_h dS[b, h, i, j].

    Grid (query block, key block, batch); each program loops over the heads and writes one float32
    tile (zeros for tiles that are above the diagonal, before seq_start or not live), so the result is
    O(B·T²), like the mask, never per head.

    Args:
      as ``flash_backward_dq`` (q/do [B, Tq_pad, H, D], k/v [B, Tk_pad, Hkv, D], lam_q/lse2/delta
      [B, H, Tq_pad], lam_k [B, H, Tk_pad], seq_start [B], seg_q/seg_k or None); log_mask
      [B, Tq_pad, Tk_pad] float32; live [B, ≥ceil(tq/block_q), ≥ceil(tk/block_k)] int32 per-tile flags
      of this tile's blocks.
    Returns:
      [B, Tq_pad, Tk_pad] float32.
    """
    b, tq_pad, h, d = q.shape
    tk_pad, hkv = k.shape[1], k.shape[2]
    bq, bk = tile.block_q, tile.block_k
    g = _geom(tq, tk, h, hkv, scale, seg_q, None, None, log_mask, live, window_size)
    in_specs = [pl.BlockSpec((None, bq, h, d), lambda m, n, z: (z, m, 0, 0)),
                pl.BlockSpec((None, bk, hkv, d), lambda m, n, z: (z, n, 0, 0)),
                pl.BlockSpec((None, bk, hkv, d), lambda m, n, z: (z, n, 0, 0)),
                pl.BlockSpec((None, bq, h, d), lambda m, n, z: (z, m, 0, 0)),
                pl.BlockSpec((None, h, bq), lambda m, n, z: (z, 0, m)),
                pl.BlockSpec((None, h, bk), lambda m, n, z: (z, 0, n)),
                pl.BlockSpec((None, h, bq), lambda m, n, z: (z, 0, m)),
                pl.BlockSpec((None, h, bq), lambda m, n, z: (z, 0, m)),
                pl.BlockSpec((None,), lambda m, n, z: (z,)),
                pl.BlockSpec((None, bq, bk), lambda m, n, z: (z, m, n)),
                pl.BlockSpec((None, None, None), lambda m, n, z: (z, m, n))]
    args = [q, k, v, do, lam_q, lam_k, lse2, delta, seq_start, log_mask, live]
    if seg_q is not None:
        in_specs += [pl.BlockSpec((None, bq), lambda m, n, z: (z, m)),
                     pl.BlockSpec((None, bk), lambda m, n, z: (z, n))]
        args += [seg_q, seg_k]
    return pl.pallas_call(
        functools.partial(_dmask_kernel, g=g, bq=bq, bk=bk),
        grid=(_cdiv(tq, bq), _cdiv(tk, bk), b),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bq, bk), lambda m, n, z: (z, m, n)),
        out_shape=jax.ShapeDtypeStruct((b, tq_pad, tk_pad), jnp.float32),
        compiler_params=_compiler_params(tile, interpret),
        interpret=interpret,
        name="fox_attention_bwd_dlogi",
    )(*args)


# ---------------------------------------------------------------------------------------------------
# Padding wrappers
# ---------------------------------------------------------------------------------------------------


def _pad_to(x, axis: int, new_len: int, mode: str = "constant", value=0):
    pad = new_len - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


@dataclasses.dataclass(frozen=True)
class _Padded:
    tq: int
    tk: int
    tq_pad: int
    tk_pad: int
    d: int
    d_pad: int


def _plan(q, k, config: KernelConfig) -> _Padded:
    tq, d = q.shape[1], q.shape[3]
    tk = k.shape[1]
    tiles = (config.fwd, config.dq, config.dkv)
    tq_pad = _round_up(tq, max(t.block_q for t in tiles))
    tk_pad = _round_up(tk, max(t.block_k for t in tiles))
    return _Padded(tq, tk, tq_pad, tk_pad, d, padded_head_dim(d))


def _pad_inputs(q, k, v, lam, segment_ids, p: _Padded):
    """Pad to the kernels' layouts; Λ goes to [B, H, T] (float32)."""
    q = _pad_to(_pad_to(q, 3, p.d_pad), 1, p.tq_pad)
    k = _pad_to(_pad_to(k, 3, p.d_pad), 1, p.tk_pad)
    v = _pad_to(_pad_to(v, 3, p.d_pad), 1, p.tk_pad)
    lam_bh = lam.astype(jnp.float32).transpose(0, 2, 1)  # [B, H, Tk]
    lam_q = _pad_to(lam_bh[:, :, p.tk - p.tq:], 2, p.tq_pad, mode="edge")
    lam_k = _pad_to(lam_bh, 2, p.tk_pad, mode="edge")
    if segment_ids is None:
        seg_q = seg_k = None
    else:
        seg_q = _pad_to(segment_ids[:, p.tk - p.tq:].astype(jnp.int32), 1, p.tq_pad, value=-1)
        seg_k = _pad_to(segment_ids.astype(jnp.int32), 1, p.tk_pad, value=-2)
    return q, k, v, lam_q, lam_k, seg_q, seg_k


def _interleave(config: KernelConfig, tile: TileConfig, ranges, *, backward: bool = False, tk: int = 0) -> bool:
    """Grid order of one kernel: its tile's setting, else the config's, else interleaved iff ACP ranges
    are given or (backward kernels) Tk ≥ ``config.interleave_bwd_from``."""
    if tile.interleave_heads is not None:
        return bool(tile.interleave_heads)
    if config.interleave_heads is not None:
        return bool(config.interleave_heads)
    if ranges is not None:
        return True
    return backward and config.interleave_bwd_from is not None and tk >= config.interleave_bwd_from


def _pad_list(tile_list, b: int, n_blocks: int, name: str):
    """A compacted tile list (idx [1 or B, Hl, n_blocks, L], n_masked and count [1 or B, Hl, n_blocks])
    as int32 [B, Hl, n_blocks, L_pow2] and [B, Hl, n_blocks] (the index row zero-padded to a power of
    two for the kernels' row loads)."""
    if not isinstance(tile_list, (tuple, list)) or len(tile_list) != 3:
        raise ValueError(f"{name} must be a triple (idx, n_masked, count), got {type(tile_list).__name__}")
    idx, n_masked, count = (jnp.asarray(x) for x in tile_list)
    if (idx.ndim != 4 or idx.shape[2] != n_blocks or idx.shape[0] not in (1, b)
            or count.shape != idx.shape[:3] or n_masked.shape != idx.shape[:3]):
        raise ValueError(f"{name}: idx must be [B, Hl, {n_blocks}, L] and n_masked, count [B, Hl, {n_blocks}], "
                         f"got {idx.shape}, {n_masked.shape} and {count.shape}")
    hl, length = idx.shape[1], idx.shape[3]
    idx = _pad_to(jnp.broadcast_to(idx.astype(jnp.int32), (b, hl, n_blocks, length)), 3,
                  1 << max(length - 1, 0).bit_length())
    return (idx,) + tuple(jnp.broadcast_to(x.astype(jnp.int32), (b, hl, n_blocks)) for x in (n_masked, count))


def _pad_mask(log_mask, p: _Padded):
    return _pad_to(_pad_to(log_mask.astype(jnp.float32), 1, p.tq_pad), 2, p.tk_pad)


def _check_config(config: KernelConfig, tq: int, tk: int):
    resolved = resolve_tiles(config, tq, tk)
    if resolved != config:
        raise ValueError("pass a config resolved with resolve_tiles(config, tq, tk)")


def attention_forward(q, k, v, lam, seq_start, segment_ids, kv_start, *, scale: float,
                      config: KernelConfig, interpret: bool, seg_bounds=None, log_mask=None, kv_list=None,
                      window_size=None):
    """Forgetting-attention forward on unpadded arrays.

    Args:
      q: [B, Tq, H, D]; k, v: [B, Tk, Hkv, D] (Tq ≤ Tk, bottom-right aligned; D ≤ 256, zero-padded to
        a power of two ≥ 16); lam: [B, Tk, H] float32 Λ (already masked before seq_start and
        cumsummed); seq_start: [B] int32; segment_ids: [B, Tk] int32 or None;
        kv_start: [B, H, ceil(Tq/config.fwd.block_q)] int32 or None (ACP);
        config: a config already passed through ``resolve_tiles``;
        seg_bounds: None or (kv_lo, kv_hi) [B, ceil(Tq/config.fwd.block_q)] int32, document-aware
        block skipping (``fox_jax.ops.acp.segment_block_bounds`` for the forward tiling); needs
        segment_ids. Without it, segment ids are handled by masking alone.
        log_mask: None or [B, Tq, Tk] float32 DCP log mask (finite; shared by the heads);
        kv_list: with it, (idx [B or 1, Hl, nq, L], n_masked, count [B or 1, Hl, nq]) int (nq =
        ceil(Tq/config.fwd.block_q), Hl ∈ {1, H}, L ≥ 1): query block m visits exactly the key blocks
        idx[b, h, m, :count[b, h, m]] (forward tiling, each < ceil(Tk/config.fwd.block_k)), the first
        n_masked with the element mask, the others (which must be fully visible) without — no
        per-tile branch (``fox_jax.ops.tiles.TileVisits.key_lists``).
        window_size: None or a static int W ≥ 1, sliding window: query row r (absolute position)
        sees keys r − W < j ≤ r; the kernels skip the key blocks outside it and mask its edge.
    Returns:
      o [B, Tq, H, D] in q.dtype, lse [B, H, Tq] float32 (natural log, −inf for empty rows).
    """
    _check_config(config, q.shape[1], k.shape[1])
    p = _plan(q, k, config)
    qp, kp, vp, lam_q, lam_k, seg_q, seg_k = _pad_inputs(q, k, v, lam, segment_ids, p)
    mask = None if log_mask is None else _pad_mask(log_mask, p)
    o, lse = flash_forward(qp, kp, vp, lam_q, lam_k, seq_start.astype(jnp.int32), kv_start, seg_q,
                           seg_k, tq=p.tq, tk=p.tk, scale=scale, tile=config.fwd, interpret=interpret,
                           interleave_heads=_interleave(config, config.fwd, kv_start), seg_bounds=seg_bounds,
                           log_mask=mask, window_size=window_size,
                           kv_list=None if kv_list is None else _pad_list(kv_list, q.shape[0],
                                                                         _cdiv(p.tq, config.fwd.block_q), "kv_list"))
    return o[:, :p.tq, :, :p.d], lse[:, :, :p.tq]


def attention_backward(q, k, v, lam, seq_start, segment_ids, kv_start_dq, q_end_dkv, o, lse, do, *,
                       scale: float, config: KernelConfig, interpret: bool, seg_bounds_dq=None,
                       seg_bounds_dkv=None, log_mask=None, kv_list_dq=None, q_list_dkv=None, live_dmask=None,
                       window_size=None):
    """Gradients of ``attention_forward``'s o with respect to q, k, v and Λ.

    Args:
      as ``attention_forward``, plus o [B, Tq, H, D] and lse [B, H, Tq] from it, the cotangent
      do [B, Tq, H, D], kv_start_dq [B, H, ceil(Tq/config.dq.block_q)] and
      q_end_dkv [B, H, ceil(Tk/config.dkv.block_k)] (ACP ranges for the dQ and dK/dV tilings, or None);
      seg_bounds_dq = (kv_lo, kv_hi) [B, ceil(Tq/config.dq.block_q)] and
      seg_bounds_dkv = (q_lo, q_hi) [B, ceil(Tk/config.dkv.block_k)] int32 or None (document-aware
      skipping for the dQ / dK/dV tilings, ``segment_block_bounds``; need segment_ids);
      log_mask [B, Tq, Tk] (DCP) with kv_list_dq (idx [B or 1, Hl, ceil(Tq/config.dq.block_q), L],
      n_masked, count [B or 1, Hl, ceil(Tq/config.dq.block_q)]: the key blocks each dQ query block
      visits, as ``kv_list`` of ``attention_forward``), q_list_dkv (idx [B or 1, Hl,
      ceil(Tk/config.dkv.block_k), L], n_masked, count: the query blocks each dK/dV key block visits,
      ``TileVisits.query_lists``) and
      live_dmask [B, ceil(Tq/bq), ceil(Tk/bk)] bool/int, the live tiles of the mask-gradient tiling
      (``dmask_tile``).
    Returns:
      dq [B, Tq, H, D], dk, dv [B, Tk, Hkv, D] (input dtypes) and dΛ [B, Tk, H] float32
      (= Σ_j dS_tj − Σ_i dS_it; the caller's cumsum turns it into d log f by a reverse cumsum); with
      ``log_mask`` also d log_mask [B, Tq, Tk] float32 (= Σ_h dS).
    """
    _check_config(config, q.shape[1], k.shape[1])
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    p = _plan(q, k, config)
    qp, kp, vp, lam_q, lam_k, seg_q, seg_k = _pad_inputs(q, k, v, lam, segment_ids, p)
    dop = _pad_to(_pad_to(do.astype(q.dtype), 3, p.d_pad), 1, p.tq_pad)
    # δ_i = Σ_d o·do from the rounded output (as the official kernel does), 0 on padded rows
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    delta = _pad_to(delta, 2, p.tq_pad)
    lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, _POS_INF)  # empty rows: P = 2^(s − ∞) = 0
    lse2 = _pad_to(lse2, 2, p.tq_pad, value=_POS_INF)
    ss = seq_start.astype(jnp.int32)
    common = dict(tq=p.tq, tk=p.tk, scale=scale, interpret=interpret, window_size=window_size)
    mask = mask_t = None
    if log_mask is not None:
        mask = _pad_mask(log_mask, p)
        mask_t = jnp.swapaxes(mask, 1, 2)
    dq, dlam_q = flash_backward_dq(qp, kp, vp, dop, lam_q, lam_k, lse2, delta, ss, kv_start_dq,
                                   seg_q, seg_k, tile=config.dq,
                                   interleave_heads=_interleave(config, config.dq, kv_start_dq, backward=True,
                                                                tk=p.tk),
                                   seg_bounds=seg_bounds_dq, log_mask=mask,
                                   kv_list=None if mask is None else _pad_list(kv_list_dq, b, _cdiv(tq, config.dq.block_q),
                                                                               "kv_list_dq"), **common)
    dk, dv, dlam_k = flash_backward_dkv(qp, kp, vp, dop, lam_q, lam_k, lse2, delta, ss, q_end_dkv,
                                        seg_q, seg_k, tile=config.dkv,
                                        interleave_heads=_interleave(config, config.dkv, q_end_dkv,
                                                                     backward=True, tk=p.tk),
                                        seg_bounds=seg_bounds_dkv, log_mask_t=mask_t,
                                        q_list=None if mask is None else _pad_list(q_list_dkv, b,
                                                                                   _cdiv(p.tk, config.dkv.block_k),
                                                                                   "q_list_dkv"),
                                        **common)
    dq = dq[:, :tq, :, :d]
    dk = dk[:, :p.tk, :, :d]
    dv = dv[:, :p.tk, :, :d]
    if h != hkv:  # GQA: sum the query heads of each key/value head in float32
        dk = dk.reshape(b, p.tk, hkv, h // hkv, d).sum(axis=3)
        dv = dv.reshape(b, p.tk, hkv, h // hkv, d).sum(axis=3)
    dlam = dlam_k[:, :, :p.tk]
    dlam = dlam.at[:, :, p.tk - tq:].add(dlam_q[:, :, :tq])
    grads = (dq, dk.astype(k.dtype), dv.astype(v.dtype), dlam.transpose(0, 2, 1))
    if mask is None:
        return grads
    dmask = flash_backward_dmask(qp, kp, vp, dop, lam_q, lam_k, lse2, delta, ss, seg_q, seg_k, mask,
                                 live_dmask.astype(jnp.int32), tile=dmask_tile(config), **common)
    return grads + (dmask[:, :tq, :p.tk],)
