"""The public forgetting-attention op and its implementation dispatch (docs/design/README.md, "The op contract")."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fox_jax.ops import acp as acp_lib
from fox_jax.ops import pallas as pallas_impl
from fox_jax.ops._common import check_attention_inputs, check_seq_start, check_window_size
from fox_jax.ops.blockwise import block_sizes, blockwise_attention
from fox_jax.ops.reference import decay_cumsum, forgetting_attention_reference
from fox_jax.ops.tiles import tile_visits
from fox_jax.sharding import kernel_mesh, per_shard

IMPLEMENTATIONS = ("auto", "xla", "pallas", "mosaic", "dense", "cudnn")


def _check_inputs(q, k, v, log_fgate, seq_start, segment_ids, adaptive_threshold, window_size):
    """Raise on bad inputs; return (``seq_start`` as int32 [B] clamped into [0, Tk − 1] or None,
    ``window_size`` as an int or None)."""
    check_attention_inputs(q, k, v, log_fgate, segment_ids=segment_ids, window_size=window_size)
    acp_lib.check_threshold(adaptive_threshold, q.shape[0], q.shape[2])
    seq_start = None if seq_start is None else check_seq_start(seq_start, q.shape[0], k.shape[1])
    return seq_start, check_window_size(window_size)


def _cudnn_eligible(q, k, log_fgate, seq_start, segment_ids, adaptive_threshold, window_size) -> bool:
    """cuDNN flash attention covers plain causal attention only (no gates, masks, window or pruning)."""
    return (log_fgate is None and seq_start is None and segment_ids is None and adaptive_threshold is None
            and window_size is None and q.shape[1] == k.shape[1] and q.dtype in (jnp.bfloat16, jnp.float16))


def resolve_implementation(implementation: str, cudnn_ok: bool = False, mosaic_ok: bool = False) -> str:
    """The implementation ``forgetting_attention`` runs for ``implementation`` on this backend.

    Args:
      implementation: one of ``IMPLEMENTATIONS``.
      cudnn_ok: whether the call is plain causal attention that cuDNN covers (no gates, seq_start,
        segment ids, window or threshold; Tq == Tk; bf16/fp16).
      mosaic_ok: whether the Hopper Mosaic kernels take the call (``fox_jax.ops.pallas.mosaic_auto_ok``:
        an sm_90 GPU, bf16/fp16, D ≤ 128, Tq ≥ 128).
    Returns:
      ``"auto"`` resolved: on GPU ``"cudnn"`` when eligible, else ``"mosaic"`` when ``mosaic_ok`` (faster
      than the Triton kernels at every measured shape: benchmarks/NOTES.md), else ``"pallas"``; elsewhere
      ``"xla"``; any other name unchanged.
    Raises:
      ValueError: an unknown implementation.
      NotImplementedError: ``"cudnn"`` for a call it does not cover.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "auto":
        if jax.default_backend() != "gpu":
            return "xla"
        return "cudnn" if cudnn_ok else "mosaic" if mosaic_ok else "pallas"
    if implementation == "cudnn" and not cudnn_ok:
        raise NotImplementedError(
            "implementation='cudnn' is plain causal attention: it needs log_fgate=None, no seq_start, "
            "segment_ids, window_size or adaptive_threshold, Tq == Tk and bf16/fp16 inputs")
    return implementation


def _no_forgetting(b: int, tk: int, h: int) -> jax.Array:
    """log f = 0 (no gates, the Transformer baseline) behind an optimization barrier: as a literal
    constant, XLA constant-folds Λ = cumsum(0) and the block bounds derived from it, which took minutes
    of compile time at T = 2048 on the GPU."""
    return jax.lax.optimization_barrier(jnp.zeros((b, tk, h), jnp.float32))


_QKV_AXES = ("batch", None, "heads", None)


def _sharded_args(q, k, v, log_fgate, kwargs) -> dict:
    """The op's array arguments with their logical axes (``fox_jax.sharding.per_shard``): q/k/v and the
    gates split over batch and heads, seq_start and segment_ids over batch, an array threshold over
    [B, H]. The arrays are popped from ``kwargs``; what stays there is static."""
    b, tk, h = q.shape[0], k.shape[1], q.shape[2]
    if log_fgate is None:
        log_fgate = _no_forgetting(b, tk, h)
    args = dict(q=(q, _QKV_AXES), k=(k, _QKV_AXES), v=(v, _QKV_AXES), log_fgate=(log_fgate, ("batch", None, "heads")))
    thr = kwargs.get("adaptive_threshold")
    if thr is not None and not isinstance(thr, (str, float, int)):
        args["adaptive_threshold"] = (jnp.broadcast_to(jnp.asarray(kwargs.pop("adaptive_threshold"), jnp.float32),
                                                       (b, h)), ("batch", "heads"))
    for name, axes in (("seq_start", ("batch",)), ("segment_ids", ("batch", None))):
        if kwargs.get(name) is not None:
            args[name] = (kwargs.pop(name), axes)
    return args


def forgetting_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_fgate: jax.Array | None,
    *,
    sm_scale: float | None = None,
    seq_start: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    adaptive_threshold: Any = None,
    window_size: int | None = None,
    log_epsilon: float = acp_lib.DEFAULT_LOG_EPSILON,
    implementation: str = "auto",
    block_q: int = 128,
    block_k: int = 128,
    kernel_config: Any = None,
) -> jax.Array:
    """Forgetting attention (FoX, arXiv 2503.02130 Eq. 4–6; docs/design/fox_acp.md §1).

        o_i = Σ_{j visible from i} softmax_j(sm_scale · q_i·k_j + Λ_i − Λ_j) v_j,   Λ = cumsum(log f)

    Causal with bottom-right alignment: with Tq ≤ Tk, query i sits at absolute position
    r_i = Tk − Tq + i (decoding with a cache). Λ is accumulated in float32 over the keys. Key j is
    visible from query i iff j ≤ r_i, j ≥ seq_start[b], segment_ids agree, and (with a window)
    r_i − j < window_size.

    Args:
      q: [B, Tq, H, D] float32 / bfloat16 / float16.
      k, v: [B, Tk, Hkv, D], same dtype as q; H must be a multiple of Hkv (GQA).
      log_fgate: [B, Tk, H] float32 log forget gates, one per *query* head; ``None`` means no
        forgetting (plain causal softmax attention, the Transformer baseline). A forget gate gives
        log f ≤ 0, but the op is defined, and ACP stays safe, for any finite values (log f > 0
        amplifies older keys): positive entries are not an error and are not clipped.
      sm_scale: logit scale, default 1/√D.
      seq_start: [B] int, left padding: keys j < seq_start[b] are invisible and their gates are
        zeroed before the cumsum; query rows with no visible key output 0. Valid values lie in
        [0, Tk − 1] (every row keeps at least its last key); concrete values outside raise. Traced
        values (under ``jit``) are clamped into [0, Tk − 1] before any implementation sees them
        (``_common.check_seq_start``): < 0 acts as 0, ≥ Tk as Tk − 1.
      segment_ids: [B, Tk] int, packed documents: query i sees key j only if their ids are equal.
      window_size: None (off) or a Python int W ≥ 1, sliding-window attention (as fla's
        ``window_size``): query i sees key j only if 0 ≤ r_i − j < W, its last W positions
        (W = 1: only itself; W ≥ Tk: plain causal). Static; composes with every other option.
        Λ stays the cumsum over all keys, so the decay Λ_i − Λ_j of the visible keys is unchanged.
        Key tiles entirely outside the window are not visited (``fox_jax.ops.tiles``); not
        available with ``implementation="cudnn"``.
      adaptive_threshold: ACP (arXiv 2504.06949): None (off), ``"auto"`` (U from the actual maximum
        norms of q and k), a float δ, or an array broadcastable to [B, H]. Tiles whose every decay
        Λ_i − Λ_j is below δ are skipped (a bound valid for any gates, ``fox_jax.ops.acp``); with
        the auto threshold the skipped weight per query is ≤ exp(log_epsilon). δ is clipped to ≤ 0
        (+inf acts as 0, the most pruning); −inf prunes nothing; NaN raises (a traced NaN prunes
        nothing). See ``acp.resolve_threshold``.
      log_epsilon: log ε of the auto threshold (default −10).
      implementation: ``"xla"`` (blockwise pure JAX), ``"pallas"`` (pallas_call kernel; interpret mode
        off-GPU), ``"mosaic"`` (the Hopper Mosaic GPU kernels), ``"dense"`` (naive XLA, materialises [B, H, Tq, Tk]),
        ``"cudnn"`` (``jax.nn.dot_product_attention``; plain causal attention only, the Transformer
        baseline) or ``"auto"`` (on GPU: cuDNN when eligible, else Mosaic on Hopper for bf16/fp16,
        D ≤ 128 and Tq ≥ 128, else Pallas; elsewhere XLA; ``resolve_implementation``).
      block_q, block_k: tile sizes of the XLA blockwise implementation.
      kernel_config: tiles of the Pallas kernels (``kernels.KernelConfig``: forward, dQ and dK/dV tiles,
        warps, stages); default: tuned per head dim.

    Sharding: under ``jax.set_mesh(mesh)`` with several devices (``fox_jax.sharding.under_mesh``), the
    Pallas kernels run in a ``shard_map`` — batch over the mesh's batch axes, heads over its head axes
    (``fox_jax.sharding.per_shard``; each where it divides B, resp. H and Hkv) — since a ``pallas_call``
    is opaque to the SPMD partitioner, which would all-gather its inputs and compute every shard on
    every device. The other implementations are partitioned by XLA. ``sharded_attention`` does the same
    for an explicit mesh and axis names. On GPU only while JAX uses the GSPMD partitioner (Shardy
    crashes on the backward with jax 0.11.2): see ``fox_jax.sharding.kernel_sharding_enabled``.

    Returns:
      [B, Tq, H, D] in q's dtype. Differentiable in q, k, v and log_fgate.

    Raises:
      ValueError: wrong ranks, shapes or dtypes (e.g. a bfloat16 log_fgate), Tq > Tk, H not a
        multiple of Hkv, an unknown implementation or threshold, a concrete ``seq_start`` outside
        [0, Tk − 1], a concrete NaN ``adaptive_threshold``, a ``window_size`` that is not None or an
        int ≥ 1.
      NotImplementedError: an implementation not available for these inputs.
    """
    seq_start, window_size = _check_inputs(q, k, v, log_fgate, seq_start, segment_ids, adaptive_threshold,
                                           window_size)
    impl = resolve_implementation(
        implementation, _cudnn_eligible(q, k, log_fgate, seq_start, segment_ids, adaptive_threshold, window_size),
        mosaic_ok=implementation == "auto" and kernel_config is None and pallas_impl.mosaic_auto_ok(q, k))
    kwargs = dict(sm_scale=sm_scale, seq_start=seq_start, segment_ids=segment_ids,
                  adaptive_threshold=adaptive_threshold, window_size=window_size, log_epsilon=log_epsilon, impl=impl,
                  block_q=block_q, block_k=block_k, kernel_config=kernel_config)
    mesh = kernel_mesh() if impl in ("pallas", "mosaic") else None
    if mesh is not None:  # kernels are opaque to the SPMD partitioner: run them per shard
        args = _sharded_args(q, k, v, log_fgate, kwargs)
        return per_shard(lambda **a: _attention(**a, **kwargs), mesh, args, _QKV_AXES)
    return _attention(q, k, v, log_fgate, **kwargs)


def _attention(q, k, v, log_fgate, *, sm_scale, seq_start, segment_ids, adaptive_threshold, window_size,
               log_epsilon, impl, block_q, block_k, kernel_config):
    """The op on checked inputs with a resolved implementation (no mesh handling)."""
    b, tq, h, d = q.shape
    tk = k.shape[1]
    scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
    if log_fgate is None:
        log_fgate = _no_forgetting(b, tk, h)
    delta = acp_lib.resolve_threshold(adaptive_threshold, q, k, scale, log_epsilon)
    if seq_start is not None:
        seq_start = seq_start.astype(jnp.int32)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)

    if impl == "dense":
        out = forgetting_attention_reference(q, k, v, log_fgate, sm_scale=scale, seq_start=seq_start,
                                             segment_ids=segment_ids, prune_threshold=delta,
                                             window_size=window_size)
        return out.astype(q.dtype)
    lam = decay_cumsum(log_fgate, seq_start)
    if impl == "xla":
        bq, bk = block_sizes(tq, tk, block_q, block_k)
        visits = tile_visits(tq, tk, bq, bk, seq_start=seq_start, lam=None if delta is None else lam, delta=delta,
                             segment_ids=segment_ids, window_size=window_size)
        return blockwise_attention(q, k, v, lam, None, segment_ids, visits, scale)
    if impl in ("pallas", "mosaic"):
        return pallas_impl.attention(q, k, v, lam, seq_start, segment_ids, delta, scale=scale,
                                     implementation=impl, config=kernel_config, window_size=window_size)
    raise AssertionError(impl)


def sharded_attention(mesh: jax.sharding.Mesh, batch_axis: Any, head_axis: Any, **op_kwargs):
    """``forgetting_attention`` with ``implementation="pallas"`` in a ``shard_map`` over an explicit
    mesh: batch over ``batch_axis``, heads over ``head_axis``.

    The same per-shard path the op takes under an ambient mesh (``jax.set_mesh``), for a mesh whose
    axes carry other names: each device runs the kernels on its local batch rows and heads; nothing is
    communicated (the auto ACP threshold reduces over time and head_dim only). A dimension the axis
    size does not divide is replicated. Caveat: with jax 0.11.2 on GPUs, the Shardy partitioner
    segfaults partitioning the backward of this shard_map; trace it with GSPMD
    (``fox_jax.sharding.select_partitioner``, or ``JAX_USE_SHARDY_PARTITIONER=false``).

    Args:
      mesh: the device mesh; batch_axis / head_axis: mesh axis names (or tuples, or None) for the batch
        and head dimensions (H and Hkv are split together, so GQA groups stay on one device).
      **op_kwargs: forwarded to ``forgetting_attention`` (sm_scale, adaptive_threshold, log_epsilon, ...).
    Returns:
      ``fn(q, k, v, log_fgate, seq_start=None, segment_ids=None)`` with the public op's shapes,
      q/k/v sharded ``P(batch, None, heads, None)``, log_fgate ``P(batch, None, heads)``, seq_start
      ``P(batch)``, segment_ids ``P(batch, None)``; output sharded like q. Differentiable.
    Raises:
      ValueError: ``implementation`` in op_kwargs.
    """
    if "implementation" in op_kwargs:
        raise ValueError("sharded_attention always uses implementation='pallas'")
    rules = {"batch": batch_axis, "heads": head_axis}

    def fn(q, k, v, log_fgate, seq_start=None, segment_ids=None):
        kwargs = dict(op_kwargs, seq_start=seq_start, segment_ids=segment_ids)
        args = _sharded_args(q, k, v, log_fgate, kwargs)
        return per_shard(lambda **a: forgetting_attention(**a, **kwargs, implementation="pallas"), mesh, args,
                         _QKV_AXES, rules=rules)

    return fn
