"""The public forgetting-attention op and its implementation dispatch (docs/design/README.md, "The op contract")."""

from __future__ import annotations

import os

from typing import Any

import jax
import jax.numpy as jnp

from fox_jax.ops import acp as acp_lib
from fox_jax.ops._common import check_qkv, check_segment_ids, check_seq_start
from fox_jax.ops.blockwise import blockwise_attention, block_sizes
from fox_jax.ops.reference import decay_cumsum, forgetting_attention_reference

IMPLEMENTATIONS = ("auto", "xla", "pallas", "mosaic", "dense", "cudnn")
def _check_inputs(q, k, v, log_fgate, seq_start, segment_ids, adaptive_threshold):
    """Raise on bad inputs; return ``seq_start`` as int32 [B] clamped into [0, Tk − 1] (or None)."""
    check_qkv(q, k, v)
    b, tq, h, _ = q.shape
    tk = k.shape[1]
    if log_fgate is not None:
        if log_fgate.shape != (b, tk, h):
            raise ValueError(f"log_fgate must be [B, Tk, H] = {(b, tk, h)}, got {log_fgate.shape}")
        if log_fgate.dtype != jnp.float32:
            raise ValueError(
                f"log_fgate must be float32 (cast the gate logits to float32 before log_sigmoid), "
                f"got {log_fgate.dtype}")
    check_segment_ids(segment_ids, b, tk)
    acp_lib.check_threshold(adaptive_threshold, b, h)
    return None if seq_start is None else check_seq_start(seq_start, b, tk)


def _cudnn_eligible(q, k, log_fgate, seq_start, segment_ids, adaptive_threshold) -> bool:
    """cuDNN flash attention covers plain causal attention only (no gates, masks or pruning)."""
    return (log_fgate is None and seq_start is None and segment_ids is None and adaptive_threshold is None
            and q.shape[1] == k.shape[1] and q.dtype in (jnp.bfloat16, jnp.float16))


def _resolve_impl(implementation: str, cudnn_ok: bool) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "auto":
        if jax.default_backend() != "gpu":
            return "xla"
        return "cudnn" if cudnn_ok else ("pallas" if _pallas_available() else "xla")
    if implementation == "cudnn" and not cudnn_ok:
        raise NotImplementedError(
            "implementation='cudnn' is plain causal attention: it needs log_fgate=None, no seq_start, "
            "segment_ids or adaptive_threshold, Tq == Tk and bf16/fp16 inputs")
    return implementation


def _pallas_available() -> bool:
    try:
        from fox_jax.ops import pallas  # noqa: F401
    except ImportError:
        return False
    return True


def _no_forgetting(b: int, tk: int, h: int) -> jax.Array:
    """log f = 0 (no gates, the Transformer baseline) behind an optimization barrier: as a literal
    constant, XLA constant-folds Λ = cumsum(0) and the block bounds derived from it, which took minutes
    of compile time at T = 2048 on the GPU."""
    return jax.lax.optimization_barrier(jnp.zeros((b, tk, h), jnp.float32))


BATCH_MESH_AXES = ("data", "fsdp")
HEAD_MESH_AXES = ("tensor",)


SHARD_KERNELS_ENV = "FOX_JAX_SHARD_KERNELS"


def kernel_sharding_enabled() -> bool:
    """Whether the Pallas kernels run per shard under an ambient mesh (see ``forgetting_attention``).

    ``FOX_JAX_SHARD_KERNELS=1`` / ``0`` forces it on / off. Default: on, except on GPU backends while
    JAX's Shardy partitioner is selected: with jax 0.11.2 it segfaults (in its ``shardy-xla`` pass)
    partitioning the *backward* of the kernels' ``shard_map`` on 2 H200s — also with both backward kernels
    replaced by zeros, so the glue, not the Triton compile — while the GSPMD partitioner compiles and
    runs it (benchmarks/NOTES.md, "Multi-GPU"). ``fox_jax.sharding.select_partitioner`` picks GSPMD for
    multi-GPU meshes. Off, a multi-device step is still correct: XLA all-gathers around the kernels and
    every device computes all rows (760M FoX (Pro) at 16k: 64 % weak-scaling efficiency on 2 H200s).

    Raises:
      ValueError: ``FOX_JAX_SHARD_KERNELS`` set to something other than 0 or 1.
    """
    flag = os.environ.get(SHARD_KERNELS_ENV)
    if flag is not None and flag.strip() != "":
        if flag.strip() not in ("0", "1"):
            raise ValueError(f"{SHARD_KERNELS_ENV} must be 0 or 1, got {flag!r}")
        return flag.strip() == "1"
    return jax.default_backend() != "gpu" or not getattr(jax.config, "jax_use_shardy_partitioner", False)


def _ambient_mesh():
    """The mesh set with ``jax.set_mesh`` when it spans several devices, kernel sharding is enabled and
    we are not already inside a ``shard_map`` (manual axes); else None."""
    if not kernel_sharding_enabled():
        return None
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    if mesh is None or getattr(mesh, "empty", True) or mesh.size <= 1:
        return None
    manual = getattr(getattr(jax.sharding, "AxisType", None), "Manual", None)
    if manual is not None and any(t == manual for t in getattr(mesh, "axis_types", ())):
        return None
    return mesh


def _mesh_axes(mesh, names, *dims) -> tuple[str, ...] | None:
    """The axes of ``names`` present in ``mesh`` with size > 1, if their product divides every dim."""
    axes = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    if not axes or any(n % size for n in dims):
        return None
    return axes


def _per_shard(mesh, q, k, v, log_fgate, kwargs):
    """Run the op in a ``shard_map``: batch over the mesh's data/fsdp axes, heads over tensor (each only
    where it divides B, resp. H and Hkv; otherwise that dimension is replicated). Every shard computes
    its own rows and heads; nothing is communicated (the auto ACP threshold reduces over T and D)."""
    from jax.sharding import PartitionSpec as P

    from fox_jax.ops.pallas import _shard_map

    b, tk, h = q.shape[0], k.shape[1], q.shape[2]
    bax = _mesh_axes(mesh, BATCH_MESH_AXES, b)
    hax = _mesh_axes(mesh, HEAD_MESH_AXES, h, k.shape[2])
    if bax is None and hax is None:
        return _attention(q, k, v, log_fgate, **kwargs)  # nothing divides: XLA replicates the call
    if log_fgate is None:
        log_fgate = _no_forgetting(b, tk, h)
    thr = kwargs.pop("adaptive_threshold")
    arrays = dict(log_fgate=(log_fgate, P(bax, None, hax)))
    if thr is not None and not isinstance(thr, (str, float, int)):
        arrays["adaptive_threshold"] = (jnp.broadcast_to(jnp.asarray(thr, jnp.float32), (b, h)), P(bax, hax))
    else:
        kwargs["adaptive_threshold"] = thr
    for name, spec in (("seq_start", P(bax)), ("segment_ids", P(bax, None))):
        if kwargs[name] is not None:
            arrays[name] = (kwargs.pop(name), spec)
    names = tuple(arrays)
    qkv = P(bax, None, hax, None)

    def local(q, k, v, *rest):
        return _attention(q, k, v, **dict(zip(names, rest)), **kwargs)

    fn = _shard_map(local, mesh, (qkv, qkv, qkv) + tuple(spec for _, spec in arrays.values()), qkv)
    return fn(q, k, v, *(a for a, _ in arrays.values()))


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
    log_epsilon: float = acp_lib.DEFAULT_LOG_EPSILON,
    implementation: str = "auto",
    block_q: int = 128,
    block_k: int = 128,
    kernel_config: Any = None,
) -> jax.Array:
    """Forgetting attention (FoX, arXiv 2503.02130 Eq. 4–6; docs/design/fox_acp.md §1).

        o_i = Σ_{j visible from i} softmax_j(sm_scale · q_i·k_j + Λ_i − Λ_j) v_j,   Λ = cumsum(log f)

    Causal with bottom-right alignment: with Tq ≤ Tk, query i sits at absolute position Tk − Tq + i
    (decoding with a cache). Λ is accumulated in float32 over the keys.

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
      adaptive_threshold: ACP (arXiv 2504.06949): None (off), ``"auto"`` (U from the actual maximum
        norms of q and k), a float δ, or an array broadcastable to [B, H]. Tiles whose every decay
        Λ_i − Λ_j is below δ are skipped (a bound valid for any gates, ``fox_jax.ops.acp``); with
        the auto threshold the skipped weight per query is ≤ exp(log_epsilon). δ is clipped to ≤ 0
        (+inf acts as 0, the most pruning); −inf prunes nothing; NaN raises (a traced NaN prunes
        nothing). See ``acp.resolve_threshold``.
      log_epsilon: log ε of the auto threshold (default −10).
      implementation: ``"xla"`` (blockwise pure JAX), ``"pallas"`` (pallas_call kernel; interpret mode
        off-GPU), ``"mosaic"`` (Hopper kernel), ``"dense"`` (naive XLA, materialises [B, H, Tq, Tk]),
        ``"cudnn"`` (``jax.nn.dot_product_attention``; plain causal attention only, the Transformer
        baseline) or ``"auto"`` (cuDNN when eligible on GPU, else Pallas on GPU, else XLA).
      block_q, block_k: tile sizes of the XLA blockwise implementation.
      kernel_config: tiles of the Pallas kernels (``kernels.KernelConfig``: forward, dQ and dK/dV tiles,
        warps, stages); default: tuned per head dim.

    Sharding: under ``jax.set_mesh(mesh)`` with several devices (``fox_jax.sharding.under_mesh``), the
    Pallas kernels run in a ``shard_map`` — batch over the mesh axes ``data``/``fsdp``, heads over
    ``tensor`` (each where it divides B, resp. H and Hkv) — since a ``pallas_call`` is opaque to the SPMD
    partitioner, which would all-gather its inputs and compute every shard on every device. The other
    implementations are partitioned by XLA. ``fox_jax.ops.pallas.sharded_attention`` does the same for an
    explicit mesh and axis names. On GPU only while JAX uses the GSPMD partitioner (Shardy crashes on
    the backward with jax 0.11.2): see ``kernel_sharding_enabled``.

    Returns:
      [B, Tq, H, D] in q's dtype. Differentiable in q, k, v and log_fgate.

    Raises:
      ValueError: wrong ranks, shapes or dtypes (e.g. a bfloat16 log_fgate), Tq > Tk, H not a
        multiple of Hkv, an unknown implementation or threshold, a concrete ``seq_start`` outside
        [0, Tk − 1], a concrete NaN ``adaptive_threshold``.
      NotImplementedError: an implementation not available for these inputs.
    """
    seq_start = _check_inputs(q, k, v, log_fgate, seq_start, segment_ids, adaptive_threshold)
    impl = _resolve_impl(implementation,
                         _cudnn_eligible(q, k, log_fgate, seq_start, segment_ids, adaptive_threshold))
    kwargs = dict(sm_scale=sm_scale, seq_start=seq_start, segment_ids=segment_ids,
                  adaptive_threshold=adaptive_threshold, log_epsilon=log_epsilon, impl=impl, block_q=block_q,
                  block_k=block_k, kernel_config=kernel_config)
    mesh = _ambient_mesh() if impl in ("pallas", "mosaic") else None
    if mesh is not None:  # kernels are opaque to the SPMD partitioner: run them per shard
        return _per_shard(mesh, q, k, v, log_fgate, kwargs)
    return _attention(q, k, v, log_fgate, **kwargs)


def _attention(q, k, v, log_fgate, *, sm_scale, seq_start, segment_ids, adaptive_threshold, log_epsilon, impl,
               block_q, block_k, kernel_config):
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
                                             segment_ids=segment_ids, prune_threshold=delta)
        return out.astype(q.dtype)
    lam = decay_cumsum(log_fgate, seq_start)
    if seq_start is None:
        seq_start = jnp.zeros((b,), jnp.int32)
    if impl == "xla":
        bq, bk = block_sizes(tq, tk, block_q, block_k)
        ranges = None
        if delta is not None:
            lam_c = jax.lax.stop_gradient(lam)
            ranges = (acp_lib.kv_block_start(lam_c, delta, tq=tq, block_q=bq, block_k=bk),
                      acp_lib.q_block_end(lam_c, delta, tq=tq, block_q=bq, block_k=bk))
        return blockwise_attention(q, k, v, lam, seq_start, segment_ids, ranges, scale, bq, bk)
    if impl in ("pallas", "mosaic"):
        try:
            from fox_jax.ops import pallas as pallas_impl
        except ImportError as e:  # pragma: no cover - depends on the install
            raise NotImplementedError(f"implementation={impl!r} is not available: {e}") from e
        return pallas_impl.attention(q, k, v, lam, seq_start, segment_ids, delta, scale=scale,
                                     implementation=impl, config=kernel_config)
    raise AssertionError(impl)
