"""Decode attention: one query per (row, head) against the live range of a ring KV cache.

What the caches call once per decode step and head group: ``decode_attention`` reads after the step's token was
written (slot pools, rings with pinned sink slots); ``decode_attention_append`` (rings: dense, window, acp) writes
and reads in one call. Implementations: ``"xla"`` (masked einsums over the whole ring: the portable path and
the CPU default), ``"pallas"`` (the flash-decoding kernel of kernels/decode_attention.py: reads only
the live blocks), ``"cudnn"`` (cuDNN flash attention with the decay and the range as a bias; GPU,
bf16/fp16) and ``"auto"``. The dense float32 oracle is ``fox_jax.ops.reference.decode_attention_reference``.
In the Pallas kernel ``decode_attention_append`` does both at once, the ring updated in place.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import flax.struct

import jax
import jax.numpy as jnp
import numpy as np

from fox_jax.kernels import decode_attention as dk
from fox_jax.ops._common import QKV_DTYPES, dot_precision
from fox_jax.ops.head_ops import HeadOps, head_epilogue, head_prologue
from fox_jax.ops.decode_shards import DecodeShards

DECODE_IMPLEMENTATIONS = ("auto", "xla", "pallas", "cudnn")

# What "auto" runs on a GPU: the winner of every shape of one H200 run of benchmarks/bench_decode_attention.py
# (2026-12-02, results/decode/decode_attention_h200.json): the Pallas kernel at its default tiling beat XLA and
# cuDNN on all six shapes with a full ring (by up to 1.3× at 32k) and by 3.7× when 256 of 8192 slots are live
# (it reads only the live blocks; XLA and cuDNN read the whole ring).
GPU_AUTO_IMPLEMENTATION = "pallas"

try:  # cuDNN in the ring's own [B, N, S, D] layout (BNSH): no transposed copy of the cache per call
    from jax._src.cudnn import fused_attention_stablehlo as _cudnn_fa  # private; the public API is BTNH only
    _CUDNN_BNTH = "qkv_layout" in inspect.signature(_cudnn_fa.dot_product_attention).parameters
except (ImportError, AttributeError, ValueError, TypeError):  # pragma: no cover - depends on the jax build
    _cudnn_fa, _CUDNN_BNTH = None, False


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _check_pair(name: str, pair, shape: tuple) -> None:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ValueError(f"{name} must be a (hi, lo) pair of float32 arrays of shape {list(shape)}, "
                         f"got {type(pair).__name__}")
    for part, x in zip(("hi", "lo"), pair):
        if tuple(x.shape) != shape or x.dtype != jnp.float32:
            raise ValueError(f"{name} ({part}) must be float32 {list(shape)}, got {x.dtype}{list(x.shape)}")


def _check_inputs(q, k, v, lo, hi, valid, lam_q, lam_k, extra_key: bool = False, evicts: bool = False) -> None:
    """One-line ValueErrors naming the argument and the expected shape / dtype (``extra_key``: hi − lo may be C + 1,
    a decode step's ring start before its eviction; ``evicts``: any lo ≤ hi, the op keeps the last C columns)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, Hkv, G, D] (one query per row and head), got shape {q.shape}")
    if q.dtype not in QKV_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    b, hkv, grp, d = q.shape
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4 or x.shape[:2] != (b, hkv) or x.shape[3] != d:
            raise ValueError(f"{name} must be [B, Hkv, C, D] = [{b}, {hkv}, C, {d}] to match q {list(q.shape)}, "
                             f"got {list(x.shape)}")
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {list(k.shape)}, got {list(v.shape)}")
    cap = k.shape[2]
    if cap < 1:
        raise ValueError(f"k must hold at least one slot (C ≥ 1), got {list(k.shape)}")
    for name, x in (("lo", lo), ("hi", hi)):
        if tuple(jnp.shape(x)) not in ((b, hkv), (b, 1), ()) or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise ValueError(f"{name} must be an int array [B, Hkv] = [{b}, {hkv}], [B, 1] (per row) or a scalar, "
                             f"got {jnp.result_type(x)}{list(jnp.shape(x))}")
    if valid is not None:
        if valid.ndim != 3 or valid.shape[0] != b or valid.shape[1] not in (1, hkv) or valid.shape[2] != cap \
                or valid.dtype != jnp.bool_:
            raise ValueError(f"valid must be bool [B, nt, C] with nt ∈ {{1, Hkv}} = [{b}, 1 or {hkv}, {cap}], "
                             f"got {valid.dtype}{list(valid.shape)}")
    if (lam_q is None) != (lam_k is None):
        raise ValueError("lam_q and lam_k go together (the decay is Λ_query − Λ_key): pass both or neither")
    if lam_q is not None:
        _check_pair("lam_q", lam_q, (b, hkv, grp))
        _check_pair("lam_k", lam_k, (b, hkv, grp, cap))
    if not (_is_tracer(lo) or _is_tracer(hi)):
        lo_np, hi_np = np.asarray(lo).astype(np.int64), np.asarray(hi).astype(np.int64)
        if evicts:
            lo_np = np.maximum(lo_np, 0)
        if (lo_np < 0).any():
            raise ValueError(f"lo must be ≥ 0 (a logical key index), got min {lo_np.min()}")
        n = hi_np - lo_np
        if (n < 0).any() or (not evicts and (n > cap + extra_key).any()):
            raise ValueError(f"hi − lo must lie in [0, {'C + 1' if extra_key else 'C'} = {cap + extra_key}] (the ring "
                             f"holds at most C keys), got values in [{n.min()}, {n.max()}]")


def visible_slots(lo: jax.Array, hi: jax.Array, capacity: int, valid: jax.Array | None = None) -> jax.Array:
    """[B, Hkv, C] bool: physical slot c holds a key of the logical range [lo, hi) (and is ``valid``).

    Slot c holds logical key j ≡ c (mod C) of the range iff (c − lo) mod C < hi − lo. Ranges are
    clamped as the kernel clamps them (lo ≥ 0, 0 ≤ hi − lo ≤ C).
    """
    lo = jnp.maximum(jnp.asarray(lo, jnp.int32), 0)
    n = jnp.clip(jnp.asarray(hi, jnp.int32) - lo, 0, capacity)
    c = jnp.arange(capacity, dtype=jnp.int32)
    vis = jnp.mod(c - lo[..., None], capacity) < n[..., None]
    if valid is not None:
        vis = vis & valid
    return vis


def _decay(lam_q, lam_k):
    """[B, Hkv, G, C] float32 decay Λ_q − Λ_k from the pairs: (q_hi − k_hi) + (q_lo − k_lo)."""
    return (lam_q[0][..., None] - lam_k[0]) + (lam_q[1][..., None] - lam_k[1])


def _xla(q, k, v, lo, hi, valid, lam_q, lam_k, scale):
    """Masked einsums over the whole ring, float32 scores and softmax (the portable path)."""
    prec = dot_precision(q.dtype)
    s = jnp.einsum("bhgd,bhcd->bhgc", q, k, preferred_element_type=jnp.float32, precision=prec) * scale
    if lam_k is not None:
        s = s + _decay(lam_q, lam_k)
    vis = visible_slots(lo, hi, k.shape[2], valid)[:, :, None, :]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    w = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))
    l = jnp.sum(w, axis=-1, keepdims=True)
    o = jnp.einsum("bhgc,bhcd->bhgd", (w / jnp.where(l > 0, l, 1.0)).astype(v.dtype), v,
                   preferred_element_type=jnp.float32, precision=prec)
    return o.astype(q.dtype)


def cudnn_supported(q: jax.Array) -> str | None:
    """None when ``implementation="cudnn"`` takes this call, else what it needs (GPU, bf16/fp16,
    D ≤ 256 and a multiple of 8)."""
    if jax.default_backend() != "gpu":
        return f"a GPU (the backend is {jax.default_backend()!r})"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"bfloat16 or float16 q, k, v (got {q.dtype})"
    if q.shape[-1] > 256 or q.shape[-1] % 8:
        return f"head_dim ≤ 256 and a multiple of 8 (got {q.shape[-1]})"
    return None


def _cudnn(q, k, v, lo, hi, valid, lam_q, lam_k, scale, public_api: bool = False):
    """cuDNN flash attention (one query row): the range, the slot mask and the decay as a [B, H, 1, C]
    bias in q's dtype (masked slots at finfo.min / 2), ``kv_seqlen`` = the highest live physical slot
    of the row (+1) so cuDNN can stop early when the ranges do not wrap. Rows with no visible key are
    zeroed afterwards. The decay rounded to bf16 costs ≤ |Λ_q − Λ_k|·2⁻⁹ per logit (a relative
    weight error ≤ 2⁻⁹/e ≈ 7e-4 at the worst-placed key)."""
    b, hkv, grp, d = q.shape
    cap = k.shape[2]
    vis = visible_slots(lo, hi, cap, valid)  # [B, Hkv, C]
    bias = jnp.zeros((b, hkv, grp, cap), jnp.float32) if lam_k is None else _decay(lam_q, lam_k)
    bias = jnp.where(vis[:, :, None, :], bias, jnp.finfo(q.dtype).min / 2).astype(q.dtype)
    bias = bias.reshape(b, hkv * grp, 1, cap)
    lo32 = jnp.maximum(jnp.asarray(lo, jnp.int32), 0)
    hi32 = jnp.clip(jnp.asarray(hi, jnp.int32), lo32, lo32 + cap)
    wraps = (lo32 // cap) != ((hi32 - 1) // cap)
    top = jnp.where(hi32 > lo32, jnp.where(wraps, cap, jnp.mod(hi32 - 1, cap) + 1), 0)
    kv_len = jnp.maximum(jnp.max(top, axis=1), 1).astype(jnp.int32)  # [B]
    if _CUDNN_BNTH and not public_api:
        o = _cudnn_fa.dot_product_attention(
            q.reshape(b, hkv * grp, 1, d), k, v, bias, None, jnp.ones((b,), jnp.int32), kv_len, scale=scale,
            mask_type=_cudnn_fa.MaskType.PADDING, qkv_layout="BNTH")
        o = o.reshape(b, hkv, grp, d)
    else:  # the public API takes [B, T, N, D]: K and V are transposed (a copy of the ring per call)
        o = jax.nn.dot_product_attention(
            q.reshape(b, 1, hkv * grp, d), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), bias=bias,
            scale=scale, key_value_seq_lengths=kv_len, implementation="cudnn")
        o = o.reshape(b, hkv, grp, d)
    any_vis = jnp.any(vis, axis=-1)[:, :, None, None]
    return jnp.where(any_vis, o, jnp.zeros((), o.dtype))


def gpu_auto_implementation(q: jax.Array, k: jax.Array, *, has_lam: bool, has_valid: bool) -> str:
    """What ``implementation="auto"`` runs on a GPU: ``GPU_AUTO_IMPLEMENTATION`` (set from the H200
    benchmark) when it takes the call, ``"pallas"`` when the kernel does (C a multiple of 16, D ≤ 256),
    else ``"xla"``."""
    del has_lam, has_valid  # the measured choice may depend on them; today it does not
    pallas_ok = k.shape[2] % dk.MIN_BLOCK == 0 and q.shape[-1] <= dk.MAX_HEAD_DIM
    if GPU_AUTO_IMPLEMENTATION == "cudnn" and cudnn_supported(q) is None:
        return "cudnn"
    return "pallas" if pallas_ok else "xla"


def resolve_decode_implementation(implementation: str, q: jax.Array, k: jax.Array, *, has_lam: bool = False,
                                  has_valid: bool = False) -> str:
    """``implementation`` with ``"auto"`` resolved: ``"xla"`` off GPU, ``gpu_auto_implementation`` on GPU.

    Raises:
      ValueError: an unknown implementation.
      NotImplementedError: ``"cudnn"`` where it does not apply (``cudnn_supported``).
    """
    if implementation not in DECODE_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {DECODE_IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "auto":
        if jax.default_backend() != "gpu":
            return "xla"
        return gpu_auto_implementation(q, k, has_lam=has_lam, has_valid=has_valid)
    if implementation == "cudnn":
        why = cudnn_supported(q)
        if why is not None:
            raise NotImplementedError(f"implementation='cudnn' needs {why}; use implementation='auto'")
    return implementation


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    lo: jax.Array,
    hi: jax.Array,
    valid: jax.Array | None = None,
    lam_q: tuple[jax.Array, jax.Array] | None = None,
    lam_k: tuple[jax.Array, jax.Array] | None = None,
    sm_scale: float | None = None,
    implementation: str = "auto",
    block_k: int | None = None,
    num_splits: int | None = None,
) -> jax.Array:
    """Attention of one query per (row, head) over the live range of a ring KV cache (FoX Eq. 4–6).

        o = Σ_{j ∈ [lo, hi), valid} softmax_j(sm_scale · q·k_j + (Λq_hi − Λk_hi,j) + (Λq_lo − Λk_lo,j)) v_j

    Ring convention: logical key index j (a column of the cache) lives in physical slot j mod C; the
    caller's live range is [lo, hi) with 0 ≤ hi − lo ≤ C, so each live key appears once. Λ (the
    cumulative log forget gate, FoX Eq. 4–6) is a float32 pair hi + lo (fox_jax/cache/decay.py) so that
    the decay Λ_q − Λ_k keeps float32 relative precision at |Λ| ≫ 1; without Λ it is plain softmax
    attention. A query with no visible key outputs 0 (never NaN).

    Args:
      q: [B, Hkv, G, D] float32 / bfloat16 / float16: one query per row; G = H // Hkv query heads per
        key/value head (query head h·G + g).
      k, v: [B, Hkv, C, D], q's dtype: ring buffers.
      lo, hi: int, each [B, Hkv], [B, 1] (one per row) or a scalar (every row): the logical range [lo, hi)
        to read; nothing outside it is read by ``"pallas"``, which takes the narrow forms as they are (a
        decode step then materialises no broadcast). Concrete values must satisfy 0 ≤ lo and 0 ≤ hi − lo ≤ C;
        traced values outside are clamped to that (lo < 0 → 0, hi − lo into [0, C]).
      valid: optional [B, nt, C] bool, nt ∈ {1, Hkv}: physical slots that hold a key (slot pools: DCP,
        sinks); nt = 1 is shared by the heads.
      lam_q: optional (hi, lo) pair, each [B, Hkv, G] float32: Λ of the query.
      lam_k: optional (hi, lo) pair, each [B, Hkv, G, C] float32: Λ of the key in each physical slot
        (per query head). Both or neither.
      sm_scale: logit scale, default 1/√D.
      implementation: ``"xla"`` (masked einsums over all C slots, float32 softmax), ``"pallas"``
        (flash-decoding, split over the key range, reading only the live blocks; interpret mode off
        GPU), ``"cudnn"`` (GPU, bf16/fp16: ``jax.nn``'s cuDNN flash attention with the decay and the
        mask as a bias in q's dtype; reads the whole ring up to the highest live slot), ``"auto"``
        (``"xla"`` off GPU; on GPU ``gpu_auto_implementation``).
      block_k: ``"pallas"``: keys per block, a power of two ≥ 16 dividing C (default
        ``fox_jax.kernels.decode_attention.default_decode_config``).
      num_splits: ``"pallas"``: programs per (row, kv head) sharing its live blocks (default: enough
        to fill the GPU).

    Returns:
      [B, Hkv, G, D] in q's dtype. Scores, softmax and accumulation are float32 in every
      implementation; bf16/fp16 inputs round the softmax weights to the input dtype before P·V.

    Raises:
      ValueError: a bad shape / dtype (naming the argument), concrete lo / hi outside the ring, an
        unknown implementation, a block_k that is not a power of two ≥ 16 dividing C, num_splits < 1.
      NotImplementedError: ``"cudnn"`` off GPU or for float32 inputs.
    """
    _check_inputs(q, k, v, lo, hi, valid, lam_q, lam_k)
    impl = resolve_decode_implementation(implementation, q, k, has_lam=lam_k is not None,
                                         has_valid=valid is not None)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    lo = jnp.asarray(lo, jnp.int32)
    hi = jnp.asarray(hi, jnp.int32)
    if impl != "pallas":  # the kernel reads the narrow forms as they are
        lo, hi = (jnp.broadcast_to(x, q.shape[:2]) for x in (lo, hi))
    if impl == "xla":
        return _xla(q, k, v, lo, hi, valid, lam_q, lam_k, scale)
    if impl == "cudnn":
        return _cudnn(q, k, v, lo, hi, valid, lam_q, lam_k, scale)
    shards = DecodeShards.of(q, heads=True)
    config, interpret = _pallas_config(q, k, block_k, num_splits, lam=lam_k is not None, valid=valid is not None,
                                       programs=shards.programs)
    return shards.flash_decode(q, k, v, lo, hi, valid, lam_q, lam_k, scale=scale, config=config, interpret=interpret)


def _pallas_config(q, k, block_k, num_splits, *, lam: bool, valid: bool, pinned_slots: int = 0,
                   programs: int | None = None) -> tuple:
    """(the kernel's ``DecodeConfig``, interpret mode) for these shapes, after checking ``block_k`` / ``num_splits``;
    the ring is the last C − ``pinned_slots`` slots; ``programs``: the (row, kv head) pairs one device runs (default
    B·Hkv; fewer per shard, ``DecodeShards``), from which the default ``num_splits`` fills the GPU.

    Raises:
      ValueError: a block_k that is not a power of two ≥ 16 dividing C, num_splits < 1, head_dim > 256.
    """
    cap = k.shape[2] - pinned_slots
    if block_k is not None and (block_k < dk.MIN_BLOCK or block_k & (block_k - 1) or cap % block_k):
        raise ValueError(f"block_k must be a power of two ≥ {dk.MIN_BLOCK} dividing C = {cap}, got {block_k}")
    if num_splits is not None and (not isinstance(num_splits, (int, np.integer)) or num_splits < 1):
        raise ValueError(f"num_splits must be an int ≥ 1, got {num_splits!r}")
    if q.shape[-1] > dk.MAX_HEAD_DIM:
        raise ValueError(f"implementation='pallas' needs head_dim ≤ {dk.MAX_HEAD_DIM}, got {q.shape[-1]}")
    interpret = jax.default_backend() != "gpu"
    programs = q.shape[0] * q.shape[1] if programs is None else programs
    config = dk.default_decode_config(programs, cap, interpret=interpret, block_k=block_k,
                                      num_splits=None if num_splits is None else int(num_splits),
                                      head_dim=q.shape[-1], itemsize=jnp.dtype(q.dtype).itemsize, group=q.shape[2],
                                      lam=lam, valid=valid)
    return config, interpret


def write_entry(buf: jax.Array, x: jax.Array, hi: jax.Array, axis: int, offset: int = 0) -> jax.Array:
    """``buf`` with ``x`` written at ring slot ``offset`` + (hi − 1) mod (C − ``offset``) of its ``axis`` (C =
    buf.shape[axis]; ``offset``: pinned slots in front of the ring, ``PinnedSlots.slots``) for every row and
    key/value head: one ``dynamic_update_slice`` when ``hi`` is a scalar, else a scatter per row and head. buf
    [B, Hkv, ...] with the slot axis ``axis``; x: buf without that axis; hi as ``decode_attention``'s."""
    ring = buf.shape[axis] - offset
    hi = jnp.asarray(hi, jnp.int32)
    if hi.ndim == 0:
        slot = offset + jnp.mod(jnp.maximum(hi - 1, 0), ring)
        return jax.lax.dynamic_update_slice_in_dim(buf, jnp.expand_dims(x, axis).astype(buf.dtype), slot, axis)
    slot = offset + jnp.mod(jnp.maximum(jnp.broadcast_to(hi, buf.shape[:2]) - 1, 0), ring)      # [B, Hkv]
    return _write_slots(buf, x, slot, axis)


def _write_slots(buf: jax.Array, x: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
    """``buf`` with ``x`` written at slot ``slot`` [B, Hkv] int32 (≥ C: not written) of its ``axis``."""
    moved = jnp.moveaxis(buf, axis, 2)                                                           # [B, Hkv, C, ...]
    rows, heads = jnp.arange(buf.shape[0])[:, None], jnp.arange(buf.shape[1])[None, :]
    return jnp.moveaxis(moved.at[rows, heads, slot].set(x.astype(buf.dtype), mode="drop"), 2, axis)


@flax.struct.dataclass
class PinnedSlots:
    """Positions kept for good in slots of their own in front of a ring (``sinks:S+W``'s sink tokens).

    Slots [0, ``slots``) of the ring buffers hold positions 0 .. ``sinks`` − 1 of each row (position p in slot p;
    position p is column ``seq_start`` + p); the ring is slots [``slots``, C), column c in slot ``slots`` +
    (c mod (C − ``slots``)). A decode step sees the pinned positions written so far as well as its ring range, and
    a step at a pinned position is written to its pinned slot as well as to its ring slot.

    Attributes:
      sinks: S ≥ 0 (static: a pytree's auxiliary data). slots: P ≥ S (static; the Pallas kernel reads the pinned
        slots as one block: a power of two ≥ 16, else the XLA path runs). seq_start: [B] int32, each row's first
        column.
    """

    sinks: int = flax.struct.field(pytree_node=False)
    slots: int = flax.struct.field(pytree_node=False)
    seq_start: jax.Array


class AppendResult(NamedTuple):
    """What ``decode_attention_append`` returns; a part that was not asked for is None.

    Attributes:
      o: [B, Hkv, G, D] in q's dtype; with ``step.ops.o_proj`` [B, S, N] float32 shares of the output projection
        whose sum over S is o·W_o: S = Hkv from the Pallas kernel (one share per program), 1 from XLA
        (``project_heads``). k, v: [B, Hkv, C, D], the ring buffers with the step's entry. lam_k: (hi, lo)
        [B, Hkv, G, C] with the entry's Λ, or None. first: [B, Hkv] int32, the first key above ``decay_floor``.
      carry: with ``step``, (the new KV-shift state [B, 2, Hkv, D] or None, Λ of the step (hi, lo) [B, Hkv, G] or
        None). tables: with ``ring_tables``, the advanced (start, peak, overflow).
    """

    o: jax.Array
    k: jax.Array
    v: jax.Array
    lam_k: tuple | None = None
    first: jax.Array | None = None
    carry: tuple | None = None
    tables: tuple | None = None


@flax.struct.dataclass
class DecodeStep:
    """``decode_attention_append(..., step=)``: a decode step handed over raw, so that the op does the layer's per-head
    work (``HeadOps``: KV-shift, QK-norm, output norm and gate) and Λ's accumulation itself (in the Pallas kernel:
    no kernels of their own around the attention).

    Everything here is the layer's (all its Hkv key/value heads, H = Hkv·G query heads), while the op's q, k, v,
    ring and tables may be one head group of a cache (``heads``).

    Attributes:
      ops: the ``HeadOps`` of the step's token (T = 1: k_shift / v_shift [B, 1, Hkv], o_gate [B, 1, H, D]); no RoPE.
        With ``ops.o_proj`` the op's output is the projection, in shares (``AppendResult.o``).
      seq_start: [B] int32, each row's first column: the token's position is hi − 1 − seq_start (< 0: a pad, whose
        gate is not added; ≤ 0: the shift sees zeros).
      shift_state: [B, 2, Hkv, D] (q's dtype) the raw k̃, ṽ of the previous token (with ``ops.shifts``), or None.
      log_fgate: [B, Hkv, G] float32 log forget gates of the token (with Λ), or None.
      lam_prev: (hi, lo) [B, Hkv, G] float32, Λ of the previous token (with ``log_fgate``), or None.
      heads: None (the op's q holds every kv head of the layer), or the layer's kv head of each of the op's (a
        cache's head group; static). The returned carries are the layer's, with the group's heads updated.
      kv_heads: the layer's Hkv when ``heads`` is given (static).
    """

    ops: HeadOps
    seq_start: jax.Array
    shift_state: jax.Array | None = None
    log_fgate: jax.Array | None = None
    lam_prev: tuple | None = None
    heads: tuple | None = flax.struct.field(pytree_node=False, default=None)
    kv_heads: int | None = flax.struct.field(pytree_node=False, default=None)

    def group_view(self, grp: int) -> tuple:
        """(ops, shift_state, log_fgate, lam_prev) of the op's heads only (XLA selections; as they are without
        ``heads``): the group's HeadOps (no rows), shift state [B, 2, n, D], log f and Λ_prev [B, n, G]."""
        if self.heads is None:
            return self.ops, self.shift_state, self.log_fgate, self.lam_prev
        idx, hkv, ops = jnp.asarray(self.heads), self.kv_heads, self.ops
        per_q = lambda x: x if x is None or x.ndim == 1 else x.reshape(hkv, grp, -1)[idx].reshape(-1, x.shape[-1])  # noqa: E731
        pick = lambda x, axis: None if x is None else jnp.take(x, idx, axis=axis)  # noqa: E731
        o_gate = None if ops.o_gate is None else \
            pick(ops.o_gate.reshape(*ops.o_gate.shape[:2], hkv, grp, -1), 2).reshape(*ops.o_gate.shape[:2], -1,
                                                                                 ops.o_gate.shape[-1])
        o_proj = None if ops.o_proj is None else \
            ops.o_proj.reshape(hkv, grp, *ops.o_proj.shape[1:])[idx].reshape(-1, *ops.o_proj.shape[1:])
        ops = ops.replace(k_shift=pick(ops.k_shift, 2), v_shift=pick(ops.v_shift, 2), q_scale=per_q(ops.q_scale),
                          k_scale=ops.k_scale if ops.k_scale is None or ops.k_scale.ndim == 1 else pick(ops.k_scale, 0),
                          o_scale=per_q(ops.o_scale), o_gate=o_gate, o_proj=o_proj, rows=None, gate_x=None,
                          gate_weights=None)
        lam = None if self.lam_prev is None else tuple(pick(x, 1) for x in self.lam_prev)
        return ops, pick(self.shift_state, 2), pick(self.log_fgate, 1), lam

    def step_lam(self, hi, grp: int) -> tuple | None:
        """Λ of the step for the op's heads, (hi, lo) [B, n, G] float32: Λ_prev + log f as a pair (a pad, position
        hi − 1 − seq_start < 0, adds no gate); None without forget gates. The kernel's float32 form, in XLA."""
        _, _, log_fgate, lam_prev = self.group_view(grp)
        if log_fgate is None:
            return None
        position = jnp.asarray(hi, jnp.int32).reshape(-1) - 1 - self.seq_start                   # [B]
        lf = jnp.where((position >= 0)[:, None, None], log_fgate, 0.0)
        return dk.pair_add(lam_prev, (lf, jnp.zeros_like(lf)))

    def scatter(self, shift, lam) -> tuple:
        """The layer's carries with the op's heads set to ``shift`` [B, 2, n, D] and ``lam`` (hi, lo) [B, n, G]."""
        if self.heads is None:
            return shift, lam
        idx = jnp.asarray(self.heads)
        shift = None if shift is None else self.shift_state.at[:, :, idx].set(shift.astype(self.shift_state.dtype))
        lam = None if lam is None else tuple(full.at[:, idx].set(x) for full, x in zip(self.lam_prev, lam))
        return shift, lam


def _check_step(step: DecodeStep, q, hi, lam_q, lam_k, lam_new) -> None:
    """One-line ValueErrors for ``decode_attention_append``'s ``step``."""
    b, n, grp, d = q.shape
    if step.heads is not None and (step.kv_heads is None or len(step.heads) != n or len(set(step.heads)) != n
                                   or not all(0 <= x < step.kv_heads for x in step.heads)):
        raise ValueError(f"step.heads must name a distinct layer kv head (< step.kv_heads) for each of q's {n}, got "
                         f"{step.heads} of {step.kv_heads}")
    hkv = n if step.heads is None else step.kv_heads  # the layer's
    h = hkv * grp
    ops = step.ops
    if tuple(jnp.shape(hi)) not in ((), (b, 1)):
        raise ValueError(f"with step, hi must be a scalar or [{b}, 1] (a decode step has one position per row), "
                         f"got {list(jnp.shape(hi))}")
    if not isinstance(ops, HeadOps):
        raise ValueError(f"step.ops must be a HeadOps, got {type(ops).__name__}")
    if ops.rope_base is not None:
        raise ValueError("step.ops must not apply RoPE (a decode step's RoPE stays with the layer's XLA path)")
    if tuple(jnp.shape(step.seq_start)) != (b,) or not jnp.issubdtype(jnp.result_type(step.seq_start), jnp.integer):
        raise ValueError(f"step.seq_start must be int [{b}], got "
                         f"{jnp.result_type(step.seq_start)}{list(jnp.shape(step.seq_start))}")
    n_rows = 2 * h + 2 * hkv if ops.o_gate is not None else h + 2 * hkv
    rows = ops.rows
    if rows is not None and (rows.ndim not in (4, 5) or rows.shape[-4:-2] != (b, 1) or rows.shape[-2] < n_rows
                             or rows.shape[-1] != d or (rows.ndim == 5 and rows.dtype != jnp.float32)):
        raise ValueError(f"step.ops.rows must be [{b}, 1, ≥ {n_rows}, {d}] (q, k, v, o gate rows) or float32 partial "
                         f"sums [S, {b}, 1, ≥ {n_rows}, {d}], got {rows.dtype}{list(rows.shape)}")
    if ops.rows_bias is not None and (rows is None or tuple(ops.rows_bias.shape) != tuple(rows.shape[-2:])
                                      or ops.x_norm_eps is not None):
        raise ValueError(f"step.ops.rows_bias must be [R, D] with step.ops.rows [..., R, D] (and no x_norm_eps), got "
                         f"{list(ops.rows_bias.shape)}")
    if rows is not None and rows.ndim == 5 and ops.x_norm_eps is not None:
        raise ValueError("step.ops.rows as partial sums does not go with x_norm_eps")
    if ops.gate_weights is not None:
        x = ops.gate_x
        if x is None or x.ndim != 3 or tuple(x.shape[:2]) != (b, 1):
            raise ValueError(f"step.ops.gate_x must be [{b}, 1, d_in] with gate_weights, got "
                             f"{None if x is None else list(x.shape)}")
        widths = ([hkv, hkv] if ops.shifts else []) + ([h] if step.log_fgate is not None else [])
        ws = tuple(ops.gate_weights)
        if len(ws) != len(widths) or any(
                tuple(k.shape) != (x.shape[2], n) or (bias is not None and tuple(bias.shape) != (n,))
                for (k, bias), n in zip(ws, widths)):
            raise ValueError(f"step.ops.gate_weights must be (kernel [{x.shape[2]}, n], bias [n] or None) for each "
                             f"n = {widths} (the step's k shift, v shift, forget gates), got "
                             f"{[(list(k.shape), None if c is None else list(c.shape)) for k, c in ws]}")
    if ops.x_norm_eps is not None and (ops.rows is None or ops.gate_weights is None
                                       or ops.gate_x.shape[-1] % dk.MIN_BLOCK):
        raise ValueError(f"step.ops.x_norm_eps needs step.ops.rows and gate_x / gate_weights with d_in a multiple of "
                         f"{dk.MIN_BLOCK} (the kernel scales the rows by r from the x it loads)")
    if ops.shifts:
        if ops.v_shift is None or tuple(ops.k_shift.shape) != (b, 1, hkv) or tuple(ops.v_shift.shape) != (b, 1, hkv):
            raise ValueError(f"step.ops.k_shift and v_shift must be float32 [{b}, 1, {hkv}] (one token)")
        if step.shift_state is None or tuple(step.shift_state.shape) != (b, 2, hkv, d):
            raise ValueError(f"step.shift_state must be [{b}, 2, {hkv}, {d}] (the raw k, v of the previous token) "
                             f"with a KV-shift, got {None if step.shift_state is None else list(step.shift_state.shape)}")
    for name, x, shapes in (("q_scale", ops.q_scale, ((h, d), (d,))), ("k_scale", ops.k_scale, ((hkv, d), (d,))),
                            ("o_scale", ops.o_scale, ((h, d), (d,)))):
        if x is not None and tuple(x.shape) not in shapes:
            raise ValueError(f"step.ops.{name} must be [{', '.join(map(str, shapes[0]))}] or [{d}], got {list(x.shape)}")
    if ops.o_gate is not None and tuple(ops.o_gate.shape) != (b, 1, h, d):
        raise ValueError(f"step.ops.o_gate must be [{b}, 1, {h}, {d}] (one token), got {list(ops.o_gate.shape)}")
    if ops.o_proj is not None and (ops.o_proj.ndim != 3 or tuple(ops.o_proj.shape[:2]) != (h, d)):
        raise ValueError(f"step.ops.o_proj must be [{h}, {d}, N] (W_o by query head), got {list(ops.o_proj.shape)}")
    if (step.log_fgate is None) != (lam_k is None) or (step.lam_prev is None) != (step.log_fgate is None):
        raise ValueError("step.log_fgate and step.lam_prev go with lam_k (the step's Λ is computed from them)")
    if step.log_fgate is not None:
        if lam_q is not None or lam_new is not None:
            raise ValueError("with step.log_fgate, lam_q and lam_new must be None (the op computes the step's Λ)")
        if tuple(step.log_fgate.shape) != (b, hkv, grp):
            raise ValueError(f"step.log_fgate must be float32 [{b}, {hkv}, {grp}], got {list(step.log_fgate.shape)}")
        _check_pair("step.lam_prev", step.lam_prev, (b, hkv, grp))


def _step_prologue(step: DecodeStep, q, k_new, v_new, hi):
    """The step's per-head work in XLA (``head_prologue``), in the op's layout: (q [B, n, G, D], k_new, v_new
    [B, n, D] and Λ (hi, lo) [B, n, G] or None for the op's n kv heads; the layer's carries (shift state
    [B, 2, Hkv, D] or None, Λ [B, Hkv, G] or None) with the op's heads updated)."""
    b, n, grp, d = q.shape
    ops, shift_state, _, _ = step.group_view(grp)
    position = jnp.asarray(hi, jnp.int32).reshape(-1) - 1 - step.seq_start                      # [B]
    state = None
    if ops.shifts:
        st = jnp.where((position > 0)[:, None, None, None], shift_state, 0).astype(k_new.dtype)
        state = (st[:, 0], st[:, 1])
    q4, k4, v4, new_state = head_prologue(ops, q.reshape(b, 1, n * grp, d), k_new[:, None], v_new[:, None],
                                          state=state)
    lam = step.step_lam(hi, grp)
    shift = None if new_state is None else jnp.stack(new_state, axis=1).astype(step.shift_state.dtype)
    return q4.reshape(q.shape), k4[:, 0], v4[:, 0], lam, step.scatter(shift, lam)


def _step_epilogue(step: DecodeStep, o, norm_gate: bool = True):
    """The epilogue in XLA on o [B, n, G, D] (the op's heads): the output norm and gate (with ``norm_gate``), then
    with ``step.ops.o_proj`` the op's heads' projection, [B, 1, N] float32 (``project_heads``)."""
    b, n, grp, d = o.shape
    ops = step.group_view(grp)[0]
    if norm_gate:
        o = head_epilogue(ops.replace(o_proj=None), o.reshape(b, 1, n * grp, d)).reshape(o.shape)
    return o if ops.o_proj is None else project_heads(o, ops.o_proj)


def project_heads(o: jax.Array, o_proj: jax.Array) -> jax.Array:
    """The output projection of the op's heads as one GEMM: [B, 1, N] float32 = Σ_{h, g} o[:, h, g] · W[h·G + g] with
    o [B, n, G, D] (compute dtype) and o_proj [n·G, D, N] (W_o by query head), float32 accumulation of products in
    o's dtype, as the layer's ``nn.Dense`` (float32: full-precision products, as the kernel's). (The fused kernel writes
    the same sum in n shares, one per program.)"""
    b, n, grp, d = o.shape
    w = o_proj.reshape(n * grp * d, -1).astype(o.dtype)
    return jnp.dot(o.reshape(b, n * grp * d), w, precision=dot_precision(o.dtype),
                   preferred_element_type=jnp.float32)[:, None]


def _step_arrays(step: DecodeStep, q, k_new, v_new, epilogue: bool) -> dk.StepArrays:
    """The kernel's ``StepArrays`` from ``step`` (the output norm, gate and projection only with ``epilogue``; the
    projection also needs N a multiple of 16, else it follows in XLA): ``ops.rows`` as
    it is, else packed here from the separate arrays (a copy); the gates as their projections (``ops.gate_x``,
    ``ops.gate_weights``: the kernel computes the logits; their XLA form when d_in is not a multiple of 16), else
    packed from the separate arrays (the forget gates as log f)."""
    b, n, grp, d = q.shape
    hkv = n if step.heads is None else step.kv_heads  # the layer's
    ops = step.ops
    gate = ops.o_gate is not None and epilogue
    rows, row_bias = ops.rows, None
    if rows is None:  # (not with a head group: the op runs XLA then)
        parts = [q.reshape(b, hkv * grp, d), k_new, v_new] + ([ops.o_gate.reshape(b, hkv * grp, d)] if gate else [])
        rows = jnp.concatenate([x.astype(q.dtype) for x in parts], axis=1)
    else:
        rows, row_bias = rows[..., 0, :, :], ops.rows_bias  # the one token: [B, R, D] or [S, B, R, D]
    gate_rows, gate_logits, gate_x, gate_w, gate_table = None, True, None, None, None
    members = (2 if ops.shifts else 0) + (1 if step.log_fgate is not None else 0)
    if members:
        if ops.gate_weights is not None and ops.gate_x.shape[-1] % dk.MIN_BLOCK == 0:
            gate_x, gate_w = ops.gate_x[:, 0], tuple(ops.gate_weights)
            gate_table = ops.gate_table
        elif ops.gate_weights is not None:
            gate_rows = ops.gate_logits(members)[:, 0]
        else:
            parts = ([ops.k_shift[:, 0], ops.v_shift[:, 0]] if ops.shifts else []) + \
                ([step.log_fgate.reshape(b, hkv * grp)] if step.log_fgate is not None else [])
            gate_rows, gate_logits = jnp.concatenate([x.astype(jnp.float32) for x in parts], axis=1), False
    per_q = lambda x: None if x is None else jnp.broadcast_to(x, (hkv * grp, d)).reshape(hkv, grp, d)  # noqa: E731
    return dk.StepArrays(
        rows=rows, seq_start=step.seq_start, gate_rows=gate_rows, gate_x=gate_x, gate_w=gate_w, gate_table=gate_table,
        shift_state=step.shift_state if ops.shifts else None,
        q_scale=per_q(ops.q_scale), k_scale=None if ops.k_scale is None else jnp.broadcast_to(ops.k_scale, (hkv, d)),
        lam_prev=step.lam_prev, o_scale=per_q(ops.o_scale) if epilogue else None, o_gate=gate,
        o_proj=ops.o_proj.reshape(hkv, grp, d, -1) if epilogue and kernel_projects(ops) else None, row_bias=row_bias,
        gate_logits=gate_logits, qk_eps=ops.qk_eps, o_eps=ops.o_eps, group_heads=step.heads,
        layer_kv_heads=step.kv_heads, x_norm_eps=ops.x_norm_eps)


def decode_attention_append(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    *,
    lo: jax.Array,
    hi: jax.Array,
    lam_q: tuple[jax.Array, jax.Array] | None = None,
    lam_k: tuple[jax.Array, jax.Array] | None = None,
    lam_new: tuple[jax.Array, jax.Array] | None = None,
    decay_floor: jax.Array | None = None,
    sm_scale: float | None = None,
    implementation: str = "auto",
    block_k: int | None = None,
    num_splits: int | None = None,
    step: DecodeStep | None = None,
    ring_tables: tuple | None = None,
    pinned: PinnedSlots | None = None,
) -> AppendResult:
    """A decode step's write and read of a ring KV cache in one call: the step's entry (``k_new``, ``v_new``,
    ``lam_new``) goes to ring slot (hi − 1) mod C as logical key hi − 1, then ``decode_attention`` over [lo, hi).

    With ``decay_floor`` (ACP's eviction, arXiv 2504.06949 §3: δ per query head) ``lo`` is the ring's start before
    this step's eviction, so up to C held keys precede the new one (hi − lo ≤ C + 1). The range first loses its
    oldest keys: key j of [lo', hi − 1), lo' = max(lo, hi − 1 − C), is hidden when Λ_q − Λ_k,j < decay_floor for
    every query head of its group, and ``first`` = max(lo', the last hidden key + 1) (Λ is non-increasing, so the
    hidden keys are a prefix up to rounding, and a key older than a hidden one is never read); the read starts at
    max(first, hi − C), since key hi − 1 − C gives its slot to the new entry (``first`` < hi − C: that key
    overflowed). The Pallas kernel finds ``first`` in a pass over the Λ_k blocks before its read: no visibility
    kernels before the call.

    ``"pallas"`` does both in the flash-decoding kernel (the entry joins the softmax from registers and one
    program per row and head writes it to the aliased ring: no update kernels before the read); the other
    implementations write with ``write_entry`` and call ``decode_attention``. Same results either way (the
    dense oracle: ``write_entry`` then ``decode_attention_reference``).

    Args:
      q, k, v, lo, hi, lam_q, lam_k, sm_scale, implementation, block_k, num_splits: as ``decode_attention``
        (no ``valid``: a ring without pinned slots); hi ≥ 1 (the entry is key hi − 1); with ``decay_floor``
        hi − lo ≤ C + 1.
      k_new, v_new: [B, Hkv, D] in q's dtype: the step's key and value.
      lam_new: (hi, lo) [B, Hkv, G] float32: Λ of the step's token per query head (with ``lam_k``), or None.
      decay_floor: [B, Hkv, G] float32 (needs ``lam_k``; ≤ 0 to keep the step's own key, whose decay is 0), or None.
      step: None, or a ``DecodeStep``: q, k_new, v_new are then the raw projections, and the op does the layer's
        per-head work around the attention (``step.ops``: KV-shift from ``step.shift_state``, QK-norm; then the
        output norm and gate on o) and Λ of the step from ``step.lam_prev`` + ``step.log_fgate`` (lam_q and lam_new
        None). ``"pallas"`` does it all in its kernel (with several splits the output norm and gate follow the
        combine); the other implementations call ``head_prologue`` / ``head_epilogue`` (fox_jax.ops.head_ops). A
        head group (``step.heads``) without ``step.ops.rows`` runs the XLA path whatever ``implementation`` says
        (the kernel finds a group's q, k, v in the layer's rows).

      ring_tables: None, or the ring's (start, peak, overflow), each int32 [B, nt] with nt ∈ {1, Hkv} (per row or per
        key/value head): ``lo`` is then the first column the policy's rule lets the step see (any int ≤ hi − 1, e.g.
        very negative for "all"), the range starts at max(lo, start) (with ``decay_floor``: the first key above the
        floor from there), the ring keeps its last C columns, and the op advances the tables — start' = the read
        start, peak' = max(peak, hi − start'), overflow' = overflow + (start' − what the policy kept): the Pallas
        kernel in place, so a decode step spends no bookkeeping kernel of its own.
      pinned: None, or ``PinnedSlots`` (``sinks:S+W``): the ring is slots [P, C) of k, v (column c in slot P +
        (c mod (C − P)), and "C" above means C − P), slots [0, P) hold the row's first S positions; the step also
        reads the pinned positions written so far (min(S, hi − seq_start) of them, the step's own included) and, at a
        pinned position, writes its entry to its pinned slot too; with ``ring_tables`` peak' counts them:
        max(peak, max(hi − start', 0) + min(S, max(hi − seq_start, 0))). Not with ``decay_floor``.

    Returns:
      ``AppendResult``: o [B, Hkv, G, D] in q's dtype (with ``step.ops.o_proj``: [B, S, N] float32 shares of o·W_o,
      S = Hkv when the Pallas kernel projects, with one split, else 1); k, v [B, Hkv, C, D] and lam_k (or None) with the entry
      written; ``first`` [B, Hkv] int32 with ``decay_floor``; ``carry`` with ``step`` (shift_state [B, 2, Hkv, D]
      holding the step's raw k, v, or None; Λ (hi, lo) [B, Hkv, G] of the step, or None); ``tables`` with
      ``ring_tables`` (the advanced start, peak, overflow). Absent parts are None.

    Raises:
      ValueError: as ``decode_attention``; k_new / v_new / lam_new / decay_floor of the wrong shape or dtype; a bad
        ``pinned`` (S > P, P ≥ C, seq_start not [B] ints) or one with decay_floor.
    """
    b, hkv, grp, d = q.shape
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if tuple(x.shape) != (b, hkv, d) or x.dtype != q.dtype:
            raise ValueError(f"{name} must be {q.dtype}[{b}, {hkv}, {d}] (the step's entry), got {x.dtype}{list(x.shape)}")
    if (lam_new is None) != (lam_k is None) and (step is None or step.log_fgate is None):
        raise ValueError("lam_new goes with lam_k (the step's Λ is stored with the ring's): pass both or neither")
    if lam_new is not None:
        _check_pair("lam_new", lam_new, (b, hkv, grp))
    if decay_floor is not None:
        if lam_k is None:
            raise ValueError("decay_floor needs lam_q / lam_k (the floor bounds the decay Λ_q − Λ_k)")
        if tuple(decay_floor.shape) != (b, hkv, grp) or decay_floor.dtype != jnp.float32:
            raise ValueError(f"decay_floor must be float32[{b}, {hkv}, {grp}] (one per query head), "
                             f"got {decay_floor.dtype}{list(decay_floor.shape)}")
    if ring_tables is not None:
        if not isinstance(ring_tables, (tuple, list)) or len(ring_tables) != 3:
            raise ValueError("ring_tables must be a (start, peak, overflow) triple of int32 [B, nt] arrays")
        nt = jnp.shape(ring_tables[0])[-1] if jnp.ndim(ring_tables[0]) == 2 else None
        for name, x in zip(("start", "peak", "overflow"), ring_tables):
            if tuple(jnp.shape(x)) not in ((b, 1), (b, hkv)) or jnp.shape(x)[1] != nt \
                    or jnp.result_type(x) != jnp.int32:
                raise ValueError(f"ring_tables ({name}) must be int32 [{b}, 1] or [{b}, {hkv}] like start, "
                                 f"got {jnp.result_type(x)}{list(jnp.shape(x))}")
    pin = 0
    if pinned is not None:
        pin = _check_pinned(pinned, k.shape[2], b)
        if decay_floor is not None:
            raise ValueError("pinned slots do not go with decay_floor (a policy with sinks has no decay floor)")
    if step is not None:
        _check_step(step, q, hi, lam_q, lam_k, lam_new)
        lam_q_chk = step.group_view(grp)[3]  # the op's heads of Λ_prev: stands in for the Λ the op computes
    else:
        lam_q_chk = lam_q
    _check_inputs(q, k, v, lo, hi, None, lam_q_chk, lam_k, extra_key=decay_floor is not None,
                  evicts=ring_tables is not None)
    impl = resolve_decode_implementation(implementation, q, k, has_lam=lam_k is not None)
    kernel_ok = step is None or step.heads is None or step.ops.rows is not None  # a group's rows: the layer's
    pin_ok = pin % dk.MIN_BLOCK == 0 and not pin & (pin - 1)  # the kernel reads the pinned slots as one block
    if impl == "pallas" and d % dk.MIN_BLOCK == 0 and d <= dk.MAX_HEAD_DIM and k.shape[2] % dk.MIN_BLOCK == 0 \
            and kernel_ok and pin_ok:
        scale = d ** -0.5 if sm_scale is None else float(sm_scale)
        shards = DecodeShards.of(q, heads=step is None or step.heads is None)  # a head group reads the layer's rows
        config, interpret = _pallas_config(q, k, block_k, num_splits, lam=lam_k is not None, valid=False,
                                           pinned_slots=pin, programs=shards.programs)
        one_split = config.num_splits == 1
        projected = one_split and step is not None and kernel_projects(step.ops)
        out = list(shards.flash_decode(
            q, k, v, jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32), None, lam_q, lam_k, scale=scale,
            config=config, interpret=interpret, append=(k_new, v_new, lam_new), decay_floor=decay_floor,
            step=None if step is None else _step_arrays(step, q, k_new, v_new, epilogue=one_split),
            tables=None if ring_tables is None else tuple(ring_tables),
            pinned=None if pinned is None else (pinned.sinks, pin, jnp.asarray(pinned.seq_start, jnp.int32))))
        o, k, v, lam_k = out[:4]
        first = out.pop(4) if decay_floor is not None else None
        carry = out.pop(4) if step is not None else None
        tables = out.pop(4) if ring_tables is not None else None
        if step is not None and not one_split:  # the output norm, gate and projection after the splits' combine
            o = _step_epilogue(step, o)
            if carry[1] is not None and step.heads is not None:  # the kernel's Λ of a head group: the layer's
                carry = (carry[0], step.scatter(None, carry[1])[1])
        elif step is not None and step.ops.o_proj is not None and not projected:  # N not a multiple of 16
            o = _step_epilogue(step, o, norm_gate=False)
        return AppendResult(o, k, v, lam_k, first, carry, tables)
    carry = None
    if step is not None:
        q, k_new, v_new, lam_step, carry = _step_prologue(step, q, k_new, v_new, hi)
        if lam_step is not None:
            lam_q = lam_new = lam_step
    cap, hi32 = k.shape[2] - pin, jnp.asarray(hi, jnp.int32)  # the ring's capacity
    lo = jnp.maximum(jnp.asarray(lo, jnp.int32), 0)
    if ring_tables is not None:
        lo = jnp.maximum(lo, ring_tables[0])
    wanted, first = lo, None
    if decay_floor is not None:  # before the write (the oldest key is still in its slot); the step's key untested
        first = first_above_floor(lam_q, lam_k, decay_floor, jnp.maximum(lo, hi32 - 1 - cap), hi32 - 1)
        wanted = first
        lo = jnp.maximum(first, hi32 - cap)
    elif ring_tables is not None:
        lo = jnp.maximum(lo, hi32 - cap)
    tables = None
    if ring_tables is not None:
        _, peak, overflow = ring_tables
        start = jnp.broadcast_to(lo, peak.shape) if lo.shape != peak.shape else lo
        live = hi32 - start
        if pinned is not None:  # and the pinned positions written, the step's own included
            live = jnp.maximum(live, 0) + jnp.clip(hi32 - jnp.asarray(pinned.seq_start, jnp.int32)[:, None], 0,
                                                   pinned.sinks)
        tables = (start, jnp.maximum(peak, live), overflow + (start - jnp.broadcast_to(wanted, peak.shape)))
    k, v = write_entry(k, k_new, hi, 2, pin), write_entry(v, v_new, hi, 2, pin)
    if lam_k is not None:
        lam_k = tuple(write_entry(x, y, hi, 3, pin) for x, y in zip(lam_k, lam_new))
    valid = None
    if pinned is not None:  # every slot, masked: the ring's range and the pinned positions written
        k, v, lam_k, valid = _pinned_write_and_mask(pinned, k, v, lam_k, k_new, v_new, lam_new, lo, hi32)
        lo, hi = jnp.int32(0), jnp.int32(k.shape[2])
    o = decode_attention(q, k, v, lo=lo, hi=hi, valid=valid, lam_q=lam_q, lam_k=lam_k, sm_scale=sm_scale,
                         implementation=impl, block_k=block_k, num_splits=num_splits)
    if step is not None:
        o = _step_epilogue(step, o)
    return AppendResult(o, k, v, lam_k, first, carry, tables)


def _check_pinned(pinned, capacity: int, b: int) -> int:
    """P of ``pinned`` after checking it (one-line ValueErrors naming the field)."""
    if not isinstance(pinned, PinnedSlots):
        raise ValueError(f"pinned must be a PinnedSlots(sinks, slots, seq_start), got {type(pinned).__name__}")
    s, p = pinned.sinks, pinned.slots
    if not (isinstance(s, int) and isinstance(p, int) and 0 <= s <= p < capacity):
        raise ValueError(f"pinned.sinks S and pinned.slots P must be ints with 0 ≤ S ≤ P < C = {capacity}, "
                         f"got S={s!r}, P={p!r}")
    seq = pinned.seq_start
    if tuple(jnp.shape(seq)) != (b,) or not jnp.issubdtype(jnp.result_type(seq), jnp.integer):
        raise ValueError(f"pinned.seq_start must be an int array [B] = [{b}], got "
                         f"{jnp.result_type(seq)}{list(jnp.shape(seq))}")
    return p


def _pinned_write_and_mask(pinned: PinnedSlots, k, v, lam_k, k_new, v_new, lam_new, lo, hi) -> tuple:
    """The XLA path's pinned slots: the step's entry also written to its pinned slot when its position is < S, and
    [B, Hkv, C] the slots a step reads (the ring's [lo, hi) and the pinned positions < min(S, hi − seq_start))."""
    b, hkv, c = k.shape[:3]
    p = pinned.slots
    seq = jnp.asarray(pinned.seq_start, jnp.int32)[:, None]
    lo, hi = (jnp.broadcast_to(jnp.asarray(x, jnp.int32), (b, hkv)) for x in (lo, hi))
    pos = hi - 1 - seq                                                                            # [B, Hkv]
    at = jnp.where((pos >= 0) & (pos < pinned.sinks), pos, c)  # c: not written
    k, v = _write_slots(k, k_new, at, 2), _write_slots(v, v_new, at, 2)
    if lam_k is not None:
        lam_k = tuple(_write_slots(x, y, at, 3) for x, y in zip(lam_k, lam_new))
    slot = jnp.arange(c, dtype=jnp.int32)
    col = hi[..., None] - 1 - jnp.mod(hi[..., None] - 1 - (slot - p), c - p)  # the latest column of each ring slot
    ring = (slot >= p) & (col >= jnp.maximum(lo, 0)[..., None]) & (col < hi[..., None])
    held = slot < jnp.clip(hi - seq, 0, pinned.sinks)[..., None]
    return k, v, lam_k, ring | held


def kernel_projects(ops: HeadOps) -> bool:
    """Whether the Pallas kernel (one split) can take ``ops.o_proj``: N a multiple of 16 (its matmul tiles)."""
    return ops.o_proj is not None and ops.o_proj.shape[-1] % dk.MIN_BLOCK == 0


gate_table = dk.gate_table  # the decode kernel's layout of a layer's gate projections (``HeadOps.gate_table``)


def first_above_floor(lam_q, lam_k, decay_floor, lo, hi) -> jax.Array:
    """[B, Hkv] int32: max(lo, 1 + the last key j of the ring range [lo, hi) with Λ_q − Λ_k,j < decay_floor for every
    query head of its group) — the decay floor of ``decode_attention_append`` over the whole ring, in the kernel's
    float32 form. lam_q, lam_k, decay_floor as there; lo, hi in the narrow forms of ``decode_attention``."""
    b, hkv, _, cap = lam_k[0].shape
    lo = jnp.broadcast_to(jnp.maximum(jnp.asarray(lo, jnp.int32), 0), (b, hkv))
    hi = jnp.broadcast_to(jnp.asarray(hi, jnp.int32), (b, hkv))
    vis = visible_slots(lo, hi, cap)                                                        # [B, Hkv, C]
    hidden = vis & jnp.all(_decay(lam_q, lam_k) < decay_floor[..., None], axis=2)
    col = lo[..., None] + jnp.mod(jnp.arange(cap, dtype=jnp.int32) - lo[..., None], cap)  # logical key per slot
    return jnp.maximum(lo, jnp.max(jnp.where(hidden, col, -1), axis=-1) + 1)


__all__ = ["DECODE_IMPLEMENTATIONS", "GPU_AUTO_IMPLEMENTATION", "AppendResult", "DecodeStep", "PinnedSlots",
           "cudnn_supported", "decode_attention",
           "decode_attention_append", "first_above_floor", "gate_table", "write_entry",
           "gpu_auto_implementation", "resolve_decode_implementation", "visible_slots"]
