"""``implementation="pallas"``: the portable ``pallas_call`` forgetting-attention kernels.

Glue between the public op (fox_jax.ops.forgetting_attention) and kernels/forgetting_attention.py:
a ``jax.custom_vjp`` over the forward, dQ and dK/dV kernels, the ACP block ranges for each kernel's
own tiling (fox_jax.ops.acp), interpret mode off-GPU, a ``shard_map`` wrapper for batch/head
sharding, and tile-level pruning statistics.

On GPU the kernels are lowered through Pallas' Triton backend (deprecated upstream since jax 0.11;
it prints a warning there). Elsewhere they run with ``interpret=True`` (slow; for tests).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from fox_jax.ops import acp as acp_lib
from fox_jax.kernels import forgetting_attention as fa_kernels
from fox_jax.kernels.forgetting_attention import KernelConfig, TileConfig, default_config, resolve_tiles

__all__ = [
    "KernelConfig",
    "TileConfig",
    "acp_ranges",
    "acp_stats",
    "attention",
    "dcp_attention",
    "default_config",
    "resolve_config",
    "segment_ranges",
    "tile_counts",
    "sharded_attention",
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


def acp_ranges(lam: jax.Array, delta: jax.Array, tq: int, config: KernelConfig):
    """ACP block ranges for each kernel's tiling (docs/design/fox_acp.md §5.3).

    Args:
      lam: [B, Tk, H] float32 Λ; delta: [B, H] float32 threshold; tq: query length;
      config: a resolved config (``resolve_config``).
    Returns:
      (kv_start_fwd [B, H, nq_fwd], kv_start_dq [B, H, nq_dq], q_end_dkv [B, H, nk_dkv]) int32.
    """
    lam = jax.lax.stop_gradient(lam)
    delta = jax.lax.stop_gradient(delta)
    f, q, kv = config.fwd, config.dq, config.dkv
    return (acp_lib.kv_block_start(lam, delta, tq=tq, block_q=f.block_q, block_k=f.block_k),
            acp_lib.kv_block_start(lam, delta, tq=tq, block_q=q.block_q, block_k=q.block_k),
            acp_lib.q_block_end(lam, delta, tq=tq, block_q=kv.block_q, block_k=kv.block_k))


def segment_ranges(segment_ids: jax.Array, tq: int, config: KernelConfig):
    """Document-aware block ranges for each kernel's tiling (``acp.segment_block_bounds``).

    Args:
      segment_ids: [B, Tk] int32; tq: query length; config: a resolved config.
    Returns:
      ((kv_lo, kv_hi) for the forward tiling, (kv_lo, kv_hi) for the dQ tiling — [B, nq] each —,
      (q_lo, q_hi) for the dK/dV tiling — [B, nk] each), int32.
    """
    f, q, kv = config.fwd, config.dq, config.dkv
    fwd = acp_lib.segment_block_bounds(segment_ids, tq=tq, block_q=f.block_q, block_k=f.block_k)[:2]
    dq = acp_lib.segment_block_bounds(segment_ids, tq=tq, block_q=q.block_q, block_k=q.block_k)[:2]
    dkv = acp_lib.segment_block_bounds(segment_ids, tq=tq, block_q=kv.block_q, block_k=kv.block_k)[2:]
    return fwd, dq, dkv


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _attention(q, k, v, lam, seq_start, segment_ids, ranges, seg_ranges, scale, config, interpret):
    kv_start = None if ranges is None else ranges[0]
    o, _ = fa_kernels.attention_forward(q, k, v, lam, seq_start, segment_ids, kv_start, scale=scale,
                                        config=config, interpret=interpret,
                                        seg_bounds=None if seg_ranges is None else seg_ranges[0])
    return o


def _attention_fwd(q, k, v, lam, seq_start, segment_ids, ranges, seg_ranges, scale, config, interpret):
    kv_start = None if ranges is None else ranges[0]
    o, lse = fa_kernels.attention_forward(q, k, v, lam, seq_start, segment_ids, kv_start, scale=scale,
                                          config=config, interpret=interpret,
                                          seg_bounds=None if seg_ranges is None else seg_ranges[0])
    return o, (q, k, v, lam, seq_start, segment_ids, ranges, seg_ranges, o, lse)


def _attention_bwd(scale, config, interpret, res, do):
    q, k, v, lam, seq_start, segment_ids, ranges, seg_ranges, o, lse = res
    kv_start_dq, q_end = (None, None) if ranges is None else ranges[1:]
    sb_dq, sb_dkv = (None, None) if seg_ranges is None else seg_ranges[1:]
    dq, dk, dv, dlam = fa_kernels.attention_backward(
        q, k, v, lam, seq_start, segment_ids, kv_start_dq, q_end, o, lse, do, scale=scale,
        config=config, interpret=interpret, seg_bounds_dq=sb_dq, seg_bounds_dkv=sb_dkv)
    return dq, dk, dv, dlam, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _dcp(q, k, v, lam, log_mask, segment_ids, lives, kept_rows, scale, config, interpret):
    return _dcp_fwd(q, k, v, lam, log_mask, segment_ids, lives, kept_rows, scale, config, interpret)[0]


def _dcp_fwd(q, k, v, lam, log_mask, segment_ids, lives, kept_rows, scale, config, interpret):
    ss = jnp.zeros((q.shape[0],), jnp.int32)
    o, lse = fa_kernels.attention_forward(q, k, v, lam, ss, segment_ids, None, scale=scale, config=config,
                                          interpret=interpret, log_mask=log_mask, live=lives[0])
    # Rows without a kept pair: output 0, and lse = −inf so that every backward kernel sees P = 0 there
    # (the forward's lse of such a row covers only the tiles it visited, not the other kernels' tiles).
    o = jnp.where(kept_rows[:, :, None, None], o, jnp.zeros((), o.dtype))
    lse = jnp.where(kept_rows[:, None, :], lse, -jnp.inf)
    return o, (q, k, v, lam, log_mask, segment_ids, lives, o, lse)


def _dcp_bwd(scale, config, interpret, res, do):
    q, k, v, lam, log_mask, segment_ids, lives, o, lse = res
    ss = jnp.zeros((q.shape[0],), jnp.int32)
    dq, dk, dv, dlam, dmask = fa_kernels.attention_backward(
        q, k, v, lam, ss, segment_ids, None, None, o, lse, do, scale=scale, config=config,
        interpret=interpret, log_mask=log_mask, live_dq=lives[1], live_dkv=lives[2], live_dmask=lives[3])
    return dq, dk, dv, dlam, dmask, None, None, None


_dcp.defvjp(_dcp_fwd, _dcp_bwd)


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
    ``skip_dropped`` every kernel skips its tiles whose visible pairs are all dropped (``context_pruning.dropped_key_blocks`` on each kernel's tiling).
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
    # context_pruning imports this module lazily too
    from fox_jax.ops.context_pruning import dropped_key_blocks, exclude_dropped, rows_with_kept_pair

    if not math.isfinite(floor):
        raise ValueError(f"implementation='pallas' needs a finite floor (the kernels take finite masks), "
                         f"got floor={floor}")
    b, tq, h, d = q.shape
    tk = k.shape[1]
    if interpret is None:
        interpret = _interpret_default()
    config = resolve_config(d, tq, tk, config, interpret)
    if lam is None:  # behind a barrier: a literal zero Λ would be constant-folded (see forgetting_attention)
        lam = jax.lax.optimization_barrier(jnp.zeros((b, tk, h), jnp.float32))
    kept_rows = rows_with_kept_pair(jax.lax.stop_gradient(log_mask), floor, segment_ids)
    log_mask = exclude_dropped(log_mask, floor, floor - 1e30)
    flags = jax.lax.stop_gradient(log_mask) if skip_dropped else jnp.zeros_like(log_mask)

    def live(t: TileConfig):
        return ~dropped_key_blocks(flags, t.block_q, t.block_k, floor=floor if skip_dropped else -jnp.inf,
                                   segment_ids=segment_ids)
    lives = (live(config.fwd), live(config.dq), live(config.dkv), live(fa_kernels.dmask_tile(config)))
    return _dcp(q, k, v, lam, log_mask, segment_ids, lives, kept_rows, scale, config, interpret)


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
      implementation: ``"pallas"``; ``"mosaic"`` raises NotImplementedError (no Hopper kernel here).
      config: tiling (``KernelConfig``); default per head dim and backend.
      interpret: run the kernels in interpret mode; default: when the backend is not GPU.
      segment_skipping: with segment_ids, skip the tiles outside each block's document-aware range
        (``acp.segment_block_bounds``: valid for any ids, tight for packed documents with
        non-decreasing ids). False = mask only (same result, for comparisons).

    Returns:
      [B, Tq, H, D] in q's dtype; differentiable in q, k, v and lam (custom VJP; works under jit,
      vmap and grad).

    Raises:
      NotImplementedError: implementation="mosaic".
      ValueError: D > 256, or shapes that do not match.
    """
    if implementation == "mosaic":
        raise NotImplementedError(
            "implementation='mosaic' (Hopper Mosaic GPU kernel) is not implemented; use 'pallas'")
    if implementation != "pallas":
        raise ValueError(f"fox_jax.ops.pallas.attention: unknown implementation {implementation!r}")
    b, tq, h, d = q.shape
    tk = k.shape[1]
    if lam.shape != (b, tk, h):
        raise ValueError(f"lam must be [B, Tk, H] = {(b, tk, h)}, got {lam.shape}")
    if interpret is None:
        interpret = _interpret_default()
    cfg = resolve_config(d, tq, tk, config, interpret)
    if seq_start is None:
        seq_start = jnp.zeros((b,), jnp.int32)
    seq_start = seq_start.astype(jnp.int32)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    lam = lam.astype(jnp.float32)
    ranges = None
    if delta is not None:
        delta = jnp.broadcast_to(jnp.asarray(delta, jnp.float32), (b, h))
        ranges = acp_ranges(lam, delta, tq, cfg)
    seg_ranges = None
    if segment_ids is not None and segment_skipping:
        seg_ranges = segment_ranges(segment_ids, tq, cfg)
    return _attention(q, k, v, lam, seq_start, segment_ids, ranges, seg_ranges, float(scale), cfg,
                      bool(interpret))


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
    kv_fwd, kv_dq, q_end = acp_ranges(lam, delta, tq, cfg)
    out = {
        "fwd": acp_lib.pruning_stats(kv_fwd, tq=tq, tk=tk, block_q=cfg.fwd.block_q, block_k=cfg.fwd.block_k),
        "dq": acp_lib.pruning_stats(kv_dq, tq=tq, tk=tk, block_q=cfg.dq.block_q, block_k=cfg.dq.block_k),
    }
    # dK/dV: key block n visits query blocks [causal_start(n), q_end(n)); skipped = the rest of the
    # causal range [causal_start(n), nq)
    bq, bk = cfg.dkv.block_q, cfg.dkv.block_k
    nq = -(-tq // bq)
    nk = -(-tk // bk)
    first_col = jnp.arange(nk) * bk
    causal_start = jnp.clip((first_col - (tk - tq)) // bq, 0, nq)
    visible = (nq - causal_start).astype(jnp.float32)  # [nk]
    visited = jnp.clip(q_end - causal_start, 0, None).astype(jnp.float32)
    total = jnp.sum(visible) * b * h
    skipped = total - jnp.sum(jnp.minimum(visited, visible))
    out["dkv"] = {"blocks_total": total, "blocks_skipped": skipped,
                  "fraction_skipped": skipped / jnp.maximum(total, 1.0)}
    return out


def tile_counts(
    batch: int,
    heads: int,
    tq: int,
    tk: int,
    *,
    lam: jax.Array | None = None,
    delta: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    head_dim: int = 128,
    config: KernelConfig | None = None,
    interpret: bool | None = None,
) -> dict[str, dict[str, jax.Array]]:
    """Tiles each Pallas kernel visits for one call, with ACP and document-aware skipping.

    Mirrors the kernels' loop bounds (seq_start skipping is not counted).

    Args:
      batch, heads, tq, tk: B, H, Tq, Tk.
      lam: [B, Tk, H] float32 Λ and delta: [B, H] (broadcastable) threshold — ACP; both or neither.
      segment_ids: [B, Tk] int or None (document-aware skipping as ``attention`` does it).
      head_dim, config, interpret: select the tiling as ``attention`` would.
    Returns:
      {"fwd" | "dq" | "dkv": {"causal": tiles in the causal range, "visited": tiles the kernel runs,
      "fraction_skipped": 1 − visited / causal}} of float32 scalars (summed over batch and heads).
    """
    cfg = resolve_config(head_dim, tq, tk, config, interpret)
    ranges = None
    if lam is not None:
        delta = jnp.broadcast_to(jnp.asarray(delta, jnp.float32), (batch, heads))
        ranges = acp_ranges(lam.astype(jnp.float32), delta, tq, cfg)
    seg = None if segment_ids is None else segment_ranges(segment_ids.astype(jnp.int32), tq, cfg)
    out = {}
    for i, (name, t) in enumerate((("fwd", cfg.fwd), ("dq", cfg.dq))):
        _, end = acp_lib.causal_block_counts(tq, tk, t.block_q, t.block_k)  # [nq]
        lo = jnp.zeros((batch, heads, end.shape[0]), jnp.int32)
        hi = jnp.broadcast_to(end, lo.shape)
        if ranges is not None:
            lo = jnp.maximum(lo, ranges[i])
        if seg is not None:
            lo = jnp.maximum(lo, seg[i][0][:, None, :])
            hi = jnp.minimum(hi, seg[i][1][:, None, :])
        out[name] = (jnp.sum(end).astype(jnp.float32) * batch * heads,
                     jnp.sum(jnp.maximum(hi - lo, 0)).astype(jnp.float32))
    bq, bk = cfg.dkv.block_q, cfg.dkv.block_k
    nq, nk = -(-tq // bq), -(-tk // bk)
    lo = jnp.clip((jnp.arange(nk) * bk - (tk - tq)) // bq, 0, nq).astype(jnp.int32)  # causal start
    lo = jnp.broadcast_to(lo, (batch, heads, nk))
    hi = jnp.full_like(lo, nq)
    if ranges is not None:
        hi = jnp.minimum(hi, ranges[2])
    causal = jnp.sum(nq - lo).astype(jnp.float32)
    if seg is not None:
        lo = jnp.maximum(lo, seg[2][0][:, None, :])
        hi = jnp.minimum(hi, seg[2][1][:, None, :])
    out["dkv"] = (causal, jnp.sum(jnp.maximum(hi - lo, 0)).astype(jnp.float32))
    return {k: {"causal": c, "visited": v, "fraction_skipped": 1.0 - v / jnp.maximum(c, 1.0)}
            for k, (c, v) in out.items()}


def _shard_map(f, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        try:
            return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
        except TypeError:  # older signature
            return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
    from jax.experimental.shard_map import shard_map  # jax < 0.6

    return shard_map(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def sharded_attention(mesh: jax.sharding.Mesh, batch_axis: Any = "data", head_axis: Any = "tensor",
                      **op_kwargs):
    """Wrap the public op with ``implementation="pallas"`` in a ``shard_map`` over batch and heads.

    Pallas calls are opaque to the SPMD partitioner (docs/design/pallas_gpu.md §3): without an explicit
    boundary XLA would all-gather around them. Each device runs the kernels on its local batch rows and
    heads; nothing is communicated (the auto ACP threshold reduces over time and head_dim only).
    Caveat: with jax 0.11.2 on GPUs, the Shardy partitioner segfaults partitioning the backward of this
    shard_map; trace it with GSPMD (``fox_jax.sharding.select_partitioner``, or
    ``JAX_USE_SHARDY_PARTITIONER=false``) — see ``fox_jax.ops.forgetting_attention.kernel_sharding_enabled``.

    Args:
      mesh: the device mesh; batch_axis / head_axis: mesh axis names (or tuples, or None) for the batch
        and head dimensions. H and Hkv must both be divisible by the head-axis size (GQA groups then
        stay on one device).
      **op_kwargs: forwarded to ``fox_jax.ops.forgetting_attention`` (sm_scale, adaptive_threshold as
        None / "auto" / float, log_epsilon, ...).
    Returns:
      ``fn(q, k, v, log_fgate, seq_start=None, segment_ids=None)`` with the public op's shapes,
      q/k/v sharded ``P(batch, None, heads, None)``, log_fgate ``P(batch, None, heads)``, seq_start
      ``P(batch)``, segment_ids ``P(batch, None)``; output sharded like q. Differentiable.
    """
    from jax.sharding import PartitionSpec as P

    if "implementation" in op_kwargs:
        raise ValueError("sharded_attention always uses implementation='pallas'")
    thr = op_kwargs.get("adaptive_threshold")
    if thr is not None and not isinstance(thr, (str, float, int)):
        raise ValueError("sharded_attention: adaptive_threshold must be None, 'auto' or a float")
    qkv_spec = P(batch_axis, None, head_axis, None)
    gate_spec = P(batch_axis, None, head_axis)

    def fn(q, k, v, log_fgate, seq_start=None, segment_ids=None):
        from fox_jax.ops.forgetting_attention import forgetting_attention

        b = q.shape[0]
        if seq_start is None:
            seq_start = jnp.zeros((b,), jnp.int32)
        has_seg = segment_ids is not None

        def local(q, k, v, lf, ss, *seg):
            return forgetting_attention(q, k, v, lf, seq_start=ss, segment_ids=seg[0] if seg else None,
                                        implementation="pallas", **op_kwargs)

        in_specs = (qkv_spec, qkv_spec, qkv_spec, gate_spec, P(batch_axis)) + (
            (P(batch_axis, None),) if has_seg else ())
        args = (q, k, v, log_fgate, seq_start) + ((segment_ids,) if has_seg else ())
        return _shard_map(local, mesh, in_specs, qkv_spec)(*args)

    return fn
