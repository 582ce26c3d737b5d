"""``implementation="pallas"``: the portable ``pallas_call`` forgetting-attention kernels.

Glue between the public ops (``fox_jax.ops.forgetting_attention``, ``context_pruning.dcp_attention``)
and kernels/forgetting_attention.py: one ``jax.custom_vjp`` over the forward, dQ, dK/dV (and, with a
DCP mask, dlogI) kernels; the tiles each kernel visits (``fox_jax.ops.tiles.TileVisits``, one per
kernel tiling); interpret mode off-GPU; tile-level statistics. Running the kernels per shard under a
mesh is ``fox_jax.sharding.per_shard``'s job.

On GPU the kernels are lowered through Pallas' Triton backend (deprecated upstream since jax 0.11;
it prints a warning there). Elsewhere they run with ``interpret=True`` (slow; for tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fox_jax.kernels import forgetting_attention as fa_kernels
from fox_jax.kernels import forgetting_attention_mgpu as mgpu_kernels
from fox_jax.kernels.forgetting_attention import KernelConfig, TileConfig, default_config, resolve_tiles
from fox_jax.ops._common import name_attention_residuals
from fox_jax.ops.tiles import TileVisits, exclude_dropped, rows_with_kept_pair, tile_visits

__all__ = [
    "KernelConfig",
    "KernelVisits",
    "TileConfig",
    "acp_stats",
    "attention",
    "dcp_attention",
    "default_config",
    "kernel_attention",
    "forward_tiling",
    "kernel_visits",
    "mosaic_auto_ok",
    "mosaic_supported",
    "resolve_config",
    "resolve_dcp_config",
    "tile_counts",
]


def _interpret_default() -> bool:
    return jax.default_backend() != "gpu"


def resolve_config(head_dim: int, tq: int, tk: int, config: KernelConfig | None = None,
                   interpret: bool | None = None) -> KernelConfig:
    """The tiling the kernels will actually use for these shapes (blocks clamped to the lengths).

    Args:
      head_dim: D (padded internally to a power of two ≥ 16; must be ≤ 256).
      tq, tk: query and key lengths.
      config: explicit tiling, default ``fox_jax.kernels.forgetting_attention.default_config``.
      interpret: default ``jax.default_backend() != "gpu"``.
    Raises:
      ValueError: head_dim > 256.
    """
    if interpret is None:
        interpret = _interpret_default()
    if config is None:
        config = default_config(fa_kernels.padded_head_dim(head_dim), interpret=interpret)
    else:
        fa_kernels.padded_head_dim(head_dim)  # validates
    return resolve_tiles(config, tq, tk)


# A DCP layer's mask is one float32 [Tq, Tk] array per batch row, read by every head. Past this size (an H100's or
# H200's L2 is 50 MB) the heads of one block run in consecutive programs, so that they read each mask tile while it
# is in L2, instead of each head streaming the whole mask (measured on an H100, fwd+bwd at 50% dropped: −13% at
# B1 T16384 H24 D64, −5% at B1 T8192 H16 D128, no change at T ≤ 2048; benchmarks/NOTES.md, "Done on 2026-12-06").
DCP_INTERLEAVE_MASK_BYTES = 48 * 2**20


def resolve_dcp_config(head_dim: int, tq: int, tk: int, config: KernelConfig | None = None,
                       interpret: bool | None = None) -> KernelConfig:
    """``resolve_config`` for the kernels with a DCP mask: by default the dense tiling, but at most two
    pipeline stages in the D > 64 backward kernels (the mask tiles of their tile-list loops are
    software-pipelined too, and with the dense default's 3–4 stages the D = 128 dK/dV kernel asks for
    290 KB of shared memory: sm_90 has 227 KB; benchmarks/checks/offline_triton_check.py --dcp), and the
    heads interleaved in the grid (``KernelConfig.interleave_heads``) when one batch row's mask, 4·Tq·Tk
    bytes, exceeds ``DCP_INTERLEAVE_MASK_BYTES``. A ``config`` given is used as it is."""
    if interpret is None:
        interpret = _interpret_default()
    d_pad = fa_kernels.padded_head_dim(head_dim)
    if config is None:
        base = default_config(d_pad, interpret=interpret)
        if not interpret and d_pad > 64:
            base = dataclasses.replace(base, dq=dataclasses.replace(base.dq, num_stages=min(base.dq.num_stages, 2)),
                                       dkv=dataclasses.replace(base.dkv, num_stages=min(base.dkv.num_stages, 2)))
        if 4 * tq * tk > DCP_INTERLEAVE_MASK_BYTES:
            base = dataclasses.replace(base, interleave_heads=True)
        config = base
    return resolve_config(head_dim, tq, tk, config, interpret)


class KernelVisits(NamedTuple):
    """The tiles each kernel visits, at its own tiling (``TileVisits``); ``dmask`` only with a DCP mask."""

    fwd: TileVisits
    dq: TileVisits
    dkv: TileVisits
    dmask: TileVisits | None = None


def kernel_visits(config: KernelConfig, tq: int, tk: int, **visits) -> KernelVisits:
    """``fox_jax.ops.tiles.tile_visits(tq, tk, block_q, block_k, **visits)`` for every kernel's tiling.

    Args:
      config: a resolved config (``resolve_config``).
      **visits: seq_start, lam and delta (ACP), segment_ids, log_mask / floor / skip_dropped (DCP),
        window_size.
    """
    def at(t: TileConfig | tuple[int, int]) -> TileVisits:
        block_q, block_k = (t.block_q, t.block_k) if isinstance(t, TileConfig) else t
        return tile_visits(tq, tk, block_q, block_k, **visits)

    dmask = None if visits.get("log_mask") is None else at(fa_kernels.dmask_tile(config))
    fwd, dq, dkv = config.fwd, config.dq, config.dkv
    if config.mosaic is not None:  # the Mosaic kernels' loop ranges are per tile of all compute warpgroups
        mc = config.mosaic  # (rows, keys) pairs: a tile of three warpgroups has 192 rows, no Triton TileConfig
        fwd = (mc.tile_q, mc.block_k)
        if mc.backward:
            dq, dkv = mc.dq_tiling, mc.dkv_tiling
    return KernelVisits(at(fwd), at(dq), at(dkv), dmask)


def _seq_start(t: TileVisits, b: int) -> jax.Array:
    return jnp.zeros((b,), jnp.int32) if t.seq_start is None else t.seq_start


def _bounds(t: TileVisits, rows: bool):
    """The document bounds of a kernel's loops: (kv_lo, kv_hi) for the query-block loops, else (q_lo, q_hi)."""
    if t.segments is None:
        return None
    return t.segments[:2] if rows else t.segments[2:]


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def kernel_attention(q, k, v, lam, log_mask, segment_ids, visits, kept_rows, scale, config, interpret):
    """The kernels behind one ``jax.custom_vjp``, visiting the tiles ``visits`` describes.

        o_i = Σ_{visible j} softmax_j(scale·q_i·k_j [+ log I_ij] + Λ_i − Λ_j) v_j

    ``attention`` and ``dcp_attention`` prepare the arguments; call it directly only with a
    description of your own.

    Args:
      q: [B, Tq, H, D]; k, v: [B, Tk, Hkv, D] (Tq ≤ Tk, bottom-right aligned; D ≤ 256).
      lam: [B, Tk, H] float32 Λ (zeros for no decay).
      log_mask: [B, Tq, Tk] float32 finite DCP mask, or None.
      segment_ids: [B, Tk] int32 or None.
      visits: ``KernelVisits`` at the tilings of ``config`` (``dmask`` with a mask). seq_start and
        window_size are read from ``visits.fwd`` (None: no left padding, no window).
      kept_rows: [B, Tq] bool or None: rows to keep; the others output 0 and get zero gradients.
      scale: logit scale; config: a resolved ``KernelConfig``; interpret: interpret mode (static).
    Returns:
      [B, Tq, H, D] in q's dtype; differentiable in q, k, v, lam and log_mask.
    """
    return _kernels_fwd(q, k, v, lam, log_mask, segment_ids, visits, kept_rows, scale, config, interpret)[0]


def _tile_lists(t: TileVisits, rows: bool, log_mask, segment_ids, config: KernelConfig):
    """DCP: the compacted tile lists of a kernel's loops (``TileVisits.key_lists`` for the query-block
    kernels, ``query_lists`` for dK/dV; masked tiles first, unless ``config.dcp_unmasked_interior`` is
    off), or None without a mask (the kernels then loop over ranges)."""
    if log_mask is None:
        return None
    lists = t.key_lists if rows else t.query_lists
    return lists(segment_ids, masked_first=config.dcp_unmasked_interior)


def _kernels_fwd(q, k, v, lam, log_mask, segment_ids, visits, kept_rows, scale, config, interpret):
    f = visits.fwd
    if config.mosaic is not None:
        if log_mask is not None or interpret:
            raise NotImplementedError("the Mosaic forward runs on a Hopper GPU, without a DCP mask")
        o, lse = mgpu_kernels.mosaic_forward(q, k, v, lam, _seq_start(f, q.shape[0]), segment_ids, f.row_ranges(),
                                             scale=scale, config=config.mosaic, window_size=f.window_size)
        o, lse = name_attention_residuals(*_apart(o, lse))
        return o, (q, k, v, lam, log_mask, segment_ids, visits, o, lse)
    o, lse = fa_kernels.attention_forward(q, k, v, lam, _seq_start(f, q.shape[0]), segment_ids, f.kv_start,
                                          scale=scale, config=config, interpret=interpret,
                                          seg_bounds=_bounds(f, True), log_mask=log_mask,
                                          kv_list=_tile_lists(f, True, log_mask, segment_ids, config), window_size=f.window_size)
    if kept_rows is not None:
        # Rows without a kept pair: output 0, and lse = −inf so that every backward kernel sees P = 0
        # there (the forward's lse of such a row covers only the tiles it visited, not the other kernels').
        o = jnp.where(kept_rows[:, :, None, None], o, jnp.zeros((), o.dtype))
        lse = jnp.where(kept_rows[:, None, :], lse, -jnp.inf)
    o, lse = name_attention_residuals(*_apart(o, lse))
    return o, (q, k, v, lam, log_mask, segment_ids, visits, o, lse)


def _apart(o, lse):
    """The forward kernel's (o, lse) through ``jax.lax.optimization_barrier``, before anything reads them.

    Under ``scan_layers`` each layer's residuals (o and lse; with remat "dots" their named copies) are written
    into stacked [L, ...] buffers. XLA 0.11's dynamic-slice fusion (``--xla_gpu_enable_dynamic_slice_fusion``, on
    by default) fuses such a write into the custom call that made the value, and since o is also read by the
    rest of the layer it does so by cloning the Mosaic kernel: two forward kernels per layer (the 760M FoX (Pro)
    at 16k on an H200: ~78 ms of the scanned step; benchmarks/NOTES.md, "Scanned layers"). With the barrier
    between the kernel and every reader the compiled loop holds one forward call (XLA 0.11.2, compiled for an
    H200 offline) and the write is a plain copy (o of the 760M at 16k: 50 MB per layer). Values and gradients
    are unchanged."""
    return jax.lax.optimization_barrier((o, lse))


def _kernels_bwd(scale, config, interpret, res, do):
    q, k, v, lam, log_mask, segment_ids, visits, o, lse = res
    dq_t, dkv_t = visits.dq, visits.dkv
    if config.mosaic is not None and config.mosaic.backward:
        grads = mgpu_kernels.mosaic_backward(
            q, k, v, lam, _seq_start(visits.fwd, q.shape[0]), segment_ids, dq_t.row_ranges(), dkv_t.col_ranges(),
            o, lse, do, scale=scale, config=config.mosaic, window_size=visits.fwd.window_size)
        return grads + (None, None, None, None)
    grads = fa_kernels.attention_backward(
        q, k, v, lam, _seq_start(visits.fwd, q.shape[0]), segment_ids, dq_t.kv_start, dkv_t.q_end, o, lse, do,
        scale=scale, config=config, interpret=interpret, seg_bounds_dq=_bounds(dq_t, True),
        seg_bounds_dkv=_bounds(dkv_t, False), log_mask=log_mask, kv_list_dq=_tile_lists(dq_t, True, log_mask, segment_ids, config),
        q_list_dkv=_tile_lists(dkv_t, False, log_mask, segment_ids, config),
        live_dmask=None if visits.dmask is None else visits.dmask.live, window_size=visits.fwd.window_size)
    dmask = None if log_mask is None else grads[4]
    return grads[:4] + (dmask, None, None, None)


kernel_attention.defvjp(_kernels_fwd, _kernels_bwd)


def dcp_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_mask: jax.Array,
    lam: jax.Array | None,
    segment_ids: jax.Array | None,
    *,
    scale: float,
    floor: float,
    skip_dropped: bool = True,
    config: KernelConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention with a DCP log mask shared by the heads, on the Pallas kernels (docs/design/dcp.md §1.4).

        o_i = Σ_{visible j} softmax_j(scale·q_i·k_j + log I_ij [+ Λ_i − Λ_j]) v_j

    The public entry is ``fox_jax.ops.dcp_attention(..., implementation="pallas")``, which checks the
    inputs. Dropped pairs (log I ≤ ``floor``) weigh exactly 0 and rows with no kept visible pair
    output 0 with zero gradients, as in the XLA path (``context_pruning.dcp_attention``): the kernels
    see dropped pairs at floor − 1e30 (finite, so exp underflows to 0 next to any kept pair), and the
    rows without a kept pair are zeroed here, with lse = −inf for the backward kernels. With
    ``skip_dropped`` every kernel skips its tiles whose visible pairs are all dropped (the live tiles
    of ``kernel_visits``: ``tiles.dropped_key_blocks`` on each kernel's tiling).
    The mask gradient Σ_h dS comes from a fourth kernel, one float32 tile at a time.

    Args:
      q: [B, Tq, H, D]; k, v: [B, Tk, Hkv, D] (Tq ≤ Tk, bottom-right aligned; D ≤ 256).
      log_mask: [B, Tq, Tk] float32; lam: [B, Tk, H] float32 Λ (FoX) or None (no decay);
      segment_ids: [B, Tk] int32 or None.
      scale: logit scale; floor: finite dropped threshold of log I.
      skip_dropped: False visits every causal tile (same result).
      config, interpret: as ``attention``.
    Returns:
      [B, Tq, H, D] in q's dtype; differentiable in q, k, v, log_mask and lam.
    Raises:
      ValueError: a non-finite ``floor``; D > 256.
    """
    if not math.isfinite(floor):
        raise ValueError(f"implementation='pallas' needs a finite floor (the kernels take finite masks), "
                         f"got floor={floor}")
    b, tq, h, d = q.shape
    tk = k.shape[1]
    if interpret is None:
        interpret = _interpret_default()
    config = resolve_dcp_config(d, tq, tk, config, interpret)
    if lam is None:  # behind a barrier: a literal zero Λ would be constant-folded (see forgetting_attention)
        lam = jax.lax.optimization_barrier(jnp.zeros((b, tk, h), jnp.float32))
    kept_rows = rows_with_kept_pair(jax.lax.stop_gradient(log_mask), floor, segment_ids)
    visits = kernel_visits(config, tq, tk, segment_ids=segment_ids, log_mask=log_mask, floor=floor,
                           skip_dropped=skip_dropped)
    log_mask = exclude_dropped(log_mask, floor, floor - 1e30)
    return kernel_attention(q, k, v, lam, log_mask, segment_ids, visits, kept_rows, scale, config, interpret)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lam: jax.Array,
    seq_start: jax.Array | None,
    segment_ids: jax.Array | None,
    delta: jax.Array | None,
    *,
    scale: float,
    implementation: str = "pallas",
    config: KernelConfig | None = None,
    interpret: bool | None = None,
    segment_skipping: bool = True,
    window_size: int | None = None,
) -> jax.Array:
    """Forgetting attention on a precomputed decay Λ with the Pallas kernels.

        o_i = Σ_{visible j} softmax_j(scale·q_i·k_j + Λ_i − Λ_j) v_j      (docs/design/fox_acp.md §1.1)

    Args:
      q: [B, Tq, H, D] float32 / bfloat16 / float16; k, v: [B, Tk, Hkv, D] (H a multiple of Hkv,
        Tq ≤ Tk, queries bottom-right aligned). D ≤ 256 (non powers of two are zero-padded).
      lam: [B, Tk, H] float32 Λ = cumsum(log f), log f already zeroed before seq_start.
      seq_start: [B] int (left padding) or None; segment_ids: [B, Tk] int or None.
      delta: [B, H] float32 ACP threshold (already resolved, ≤ 0) or None (no pruning).
      scale: logit scale.
      implementation: ``"pallas"`` (the Triton kernels) or ``"mosaic"`` (the Hopper Mosaic GPU kernels of
        kernels/forgetting_attention_mgpu.py; bf16/fp16, D ≤ 128, an sm_90 GPU; with
        ``MosaicConfig(backward=False)`` in ``config.mosaic`` the backward is the Triton one).
      config: tiling (``KernelConfig``); default per head dim and backend.
      interpret: run the kernels in interpret mode; default: when the backend is not GPU.
      segment_skipping: with segment_ids, skip the tiles outside each block's document-aware range
        (``acp.segment_block_bounds``: valid for any ids, tight for packed documents with
        non-decreasing ids). False = mask only (same result, for comparisons).
      window_size: None or a static int W ≥ 1, sliding window: query i (absolute position
        r = Tk − Tq + i) sees keys r − W < j ≤ r; key tiles outside it are skipped.

    Returns:
      [B, Tq, H, D] in q's dtype; differentiable in q, k, v and lam (custom VJP; works under jit,
      vmap and grad).

    Raises:
      NotImplementedError: implementation="mosaic" off a Hopper GPU, in interpret mode, or for float32
        inputs or D > 128.
      ValueError: D > 256, or shapes that do not match.
    """
    if implementation not in ("pallas", "mosaic"):
        raise ValueError(f"fox_jax.ops.pallas.attention: unknown implementation {implementation!r}")
    b, tq, h, d = q.shape
    tk = k.shape[1]
    if lam.shape != (b, tk, h):
        raise ValueError(f"lam must be [B, Tk, H] = {(b, tk, h)}, got {lam.shape}")
    if interpret is None:
        interpret = _interpret_default()
    cfg = resolve_config(d, tq, tk, config, interpret)
    if implementation == "mosaic":
        cfg = _with_mosaic(cfg, q, k, interpret)
    if seq_start is None:
        seq_start = jnp.zeros((b,), jnp.int32)
    seq_start = seq_start.astype(jnp.int32)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    lam = lam.astype(jnp.float32)
    if delta is not None:
        delta = jnp.broadcast_to(jnp.asarray(delta, jnp.float32), (b, h))
    visits = kernel_visits(cfg, tq, tk, seq_start=seq_start, lam=None if delta is None else lam, delta=delta,
                           segment_ids=segment_ids if segment_skipping else None, window_size=window_size)
    return kernel_attention(q, k, v, lam, None, segment_ids, visits, None, float(scale), cfg, bool(interpret))


def mosaic_supported(q: jax.Array, k: jax.Array) -> str | None:
    """None when the Mosaic kernels take these inputs, else why not (dtype, head dim, device)."""
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"bfloat16 or float16 q, k, v (got {q.dtype}, {k.dtype})"
    if q.shape[-1] > 128:
        return f"head_dim ≤ 128 (got {q.shape[-1]})"
    if jax.default_backend() != "gpu":
        return f"a Hopper GPU (the backend is {jax.default_backend()!r})"
    kind = str(jax.devices()[0].device_kind)
    if not any(name in kind for name in ("H100", "H200", "H800", "H20", "GH200")):
        return f"a Hopper (sm_90) GPU (got {kind!r})"
    return None


def mosaic_auto_ok(q: jax.Array, k: jax.Array) -> bool:
    """Whether ``implementation="auto"`` runs the Mosaic kernels: ``mosaic_supported`` and at least one
    forward tile of queries (Tq ≥ 128; shorter calls, such as decoding, stay on the Triton kernels)."""
    return q.shape[1] >= 128 and mosaic_supported(q, k) is None


def forward_tiling(implementation: str, head_dim: int, tq: int, tk: int) -> tuple[int, int]:
    """(block_q, block_k) of the forward's skip ranges for a resolved ``"pallas"`` / ``"mosaic"`` call
    with the default tiling (ACP statistics are computed at it)."""
    if implementation == "mosaic":
        mc = mgpu_kernels.default_mosaic_config(-(-head_dim // 64) * 64)
        return mc.tile_q, mc.block_k
    fwd = resolve_config(head_dim, tq, tk).fwd
    return fwd.block_q, fwd.block_k


def _with_mosaic(cfg: KernelConfig, q, k, interpret: bool) -> KernelConfig:
    """``cfg`` with the Mosaic kernels switched on (their default tiling unless ``cfg.mosaic`` sets one)."""
    why = mosaic_supported(q, k)
    if why is None and interpret:
        why = "interpret=False (it has no interpret mode)"
    if why is not None:
        raise NotImplementedError(f"implementation='mosaic' (the Hopper Mosaic GPU kernels) needs {why}; "
                                  "use implementation='auto' (or 'pallas')")
    if cfg.mosaic is not None:
        return cfg
    d_pad = -(-q.shape[-1] // 64) * 64
    return dataclasses.replace(cfg, mosaic=mgpu_kernels.default_mosaic_config(d_pad, q.shape[1]))


def _visit_counts(visits: KernelVisits, batch: int, heads: int) -> dict[str, tuple[jax.Array, jax.Array]]:
    """{"fwd" | "dq" | "dkv": (causal tiles, visited tiles)} over batch and heads, float32: the loop
    ranges of each kernel (query blocks over key blocks, dK/dV the other way round)."""
    def tiles(ranges):
        lo, hi = ranges
        return jnp.sum(jnp.broadcast_to(jnp.maximum(hi - lo, 0), (batch, heads, lo.shape[-1]))).astype(jnp.float32)

    out = {}
    for name in ("fwd", "dq", "dkv"):
        t = getattr(visits, name)
        causal = TileVisits(t.tq, t.tk, t.block_q, t.block_k)
        if name == "dkv":
            out[name] = tiles(causal.col_ranges()), tiles(t.col_ranges())
        else:
            out[name] = tiles(causal.row_ranges()), tiles(t.row_ranges())
    return out


def acp_stats(
    lam: jax.Array,
    delta: jax.Array,
    tq: int,
    *,
    head_dim: int = 128,
    config: KernelConfig | None = None,
    interpret: bool | None = None,
) -> dict[str, dict[str, jax.Array]]:
    """Tile-level ACP pruning statistics of the Pallas kernels for one call.

    Args:
      lam: [B, Tk, H] float32 Λ; delta: [B, H] (or broadcastable) float32 threshold; tq: query length;
      head_dim, config, interpret: select the tiling as ``attention`` would.
    Returns:
      {"fwd": ..., "dq": ..., "dkv": ...}, each a dict of float32 scalars ``blocks_total`` (causal
      tiles over batch and heads), ``blocks_skipped`` and ``fraction_skipped`` (seq_start skipping
      not counted).
    """
    b, tk, h = lam.shape
    cfg = resolve_config(head_dim, tq, tk, config, interpret)
    delta = jnp.broadcast_to(jnp.asarray(delta, jnp.float32), (b, h))
    counts = _visit_counts(kernel_visits(cfg, tq, tk, lam=lam, delta=delta), b, h)
    return {name: {"blocks_total": total, "blocks_skipped": total - visited,
                   "fraction_skipped": (total - visited) / jnp.maximum(total, 1.0)}
            for name, (total, visited) in counts.items()}


def tile_counts(
    batch: int,
    heads: int,
    tq: int,
    tk: int,
    *,
    lam: jax.Array | None = None,
    delta: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    window_size: int | None = None,
    head_dim: int = 128,
    config: KernelConfig | None = None,
    interpret: bool | None = None,
) -> dict[str, dict[str, jax.Array]]:
    """Tiles each Pallas kernel visits for one call, with ACP, document-aware and window skipping.

    Mirrors the kernels' loop bounds (seq_start skipping is not counted).

    Args:
      batch, heads, tq, tk: B, H, Tq, Tk.
      lam: [B, Tk, H] float32 Λ and delta: [B, H] (broadcastable) threshold — ACP; both or neither.
      segment_ids: [B, Tk] int or None (document-aware skipping as ``attention`` does it).
      window_size: None or int W ≥ 1 (sliding window, as ``attention``).
      head_dim, config, interpret: select the tiling as ``attention`` would.
    Returns:
      {"fwd" | "dq" | "dkv": {"causal": tiles in the causal range, "visited": tiles the kernel runs,
      "fraction_skipped": 1 − visited / causal}} of float32 scalars (summed over batch and heads).
    """
    cfg = resolve_config(head_dim, tq, tk, config, interpret)
    if lam is not None:
        lam = lam.astype(jnp.float32)
        delta = jnp.broadcast_to(jnp.asarray(delta, jnp.float32), (batch, heads))
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    counts = _visit_counts(kernel_visits(cfg, tq, tk, lam=lam, delta=delta, segment_ids=seg, window_size=window_size),
                           batch, heads)
    return {name: {"causal": c, "visited": v, "fraction_skipped": 1.0 - v / jnp.maximum(c, 1.0)}
            for name, (c, v) in counts.items()}
