"""Dense KV caches for incremental decoding (specs/fox_acp.md §2.6).

One ``LayerKVCache`` per attention layer, a plain pytree (NamedTuple) with a fixed capacity C, so the
decode step has static shapes: it compiles once and runs inside ``lax.scan`` / ``lax.while_loop``.
Column c of the cache holds the c-th token fed to the model (left padding included), so the forget-gate
decay between two cached tokens is a plain sum of the gates between their columns.

A call of a model with a cache processes a *chunk* of T tokens (see ``cache_columns``):

* T > 1 is a **prefill**: the chunk (re)starts the cache at column 0, with zero KV-shift states,
  and attends through the public op ``fox_jax.ops.forgetting_attention`` (blockwise, ``seq_start``
  hides the left padding).
* T = 1 is a **decode step**: the token is written at column ``length`` and its single query
  attends over the whole capacity with a validity mask (``decode_attention``). The op itself cannot
  serve this step: its bottom-right alignment would place the query at column C − 1 of the
  fixed-capacity buffer, while it sits at column ``length``.

Capacity: the cache never grows. ``prefill`` needs T ≤ C (checked statically); a decode step needs
``length < C``, which the callers in ``fox_jax.decoding.generation`` check on the host
(``check_room``) before running, since a traced write past the end would be clamped by XLA.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fox_jax.ops._common import dot_precision
from fox_jax.ops.forgetting_attention import forgetting_attention


class LayerKVCache(NamedTuple):
    """Decoding state of one attention layer (FoX, Transformer, or dense GPT-2).

    Attributes:
      k, v: [B, C, Hkv, D] in the compute dtype: keys after KV-shift, QK-norm and RoPE, i.e. exactly
        what attention reads; columns ≥ ``length`` are unused.
      log_fgate: [B, C, H] float32 log forget gates, or None for models without a forget gate.
      k_shift, v_shift: [B, Hkv, D] in the compute dtype, the *unshifted* k/v projections of the last
        token (KV-shift carry, spec §2.6), or None without KV-shift.
      length: int32 scalar, the number of columns filled (the same in every row).
      seq_start: [B] int32, the first real column of each row (the number of left pads); the token in
        column c has position c − seq_start (negative on pads, spec pitfall 10).
    """

    k: jax.Array
    v: jax.Array
    log_fgate: jax.Array | None
    k_shift: jax.Array | None
    v_shift: jax.Array | None
    length: jax.Array
    seq_start: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def live_count(self) -> jax.Array:
        """[B] int32 real (non-pad) tokens held per row."""
        return jnp.maximum(self.length - self.seq_start, 0)

    @property
    def token_bytes(self) -> int:
        """Bytes one cached token takes in this layer (k, v and the forget gates)."""
        gates = 0 if self.log_fgate is None else self.log_fgate.shape[2] * 4
        return 2 * math.prod(self.k.shape[2:]) * self.k.dtype.itemsize + gates


def check_seq_start(seq_start, batch: int, seq_len: int | None = None) -> jax.Array:
    """Validate left-padding offsets and return them as int32 [B] (zeros for None).

    Args:
      seq_start: None or [B] int, the number of left pads of each row.
      batch: B.
      seq_len: the prompt length T, if known: every row needs at least one real token.

    Raises:
      ValueError: wrong shape/dtype; a concrete value < 0 or ≥ seq_len.
    """
    if seq_start is None:
        return jnp.zeros((batch,), jnp.int32)
    seq_start = jnp.asarray(seq_start)
    if seq_start.shape != (batch,) or not jnp.issubdtype(seq_start.dtype, jnp.integer):
        raise ValueError(f"seq_start must be an int array of shape [B] = ({batch},), "
                         f"got {seq_start.dtype}{seq_start.shape}")
    if not isinstance(seq_start, jax.core.Tracer):
        lo, hi = int(seq_start.min()), int(seq_start.max())
        if lo < 0 or (seq_len is not None and hi >= seq_len):
            raise ValueError(f"seq_start values must lie in [0, T) = [0, {seq_len}) so that every row has "
                             f"a real token, got min {lo}, max {hi}")
    return seq_start.astype(jnp.int32)


def new_layer_cache(batch: int, capacity: int, *, n_heads: int, kv_heads: int, head_dim: int, dtype,
                    forget_gate: bool, kv_shift: bool, seq_start=None) -> LayerKVCache:
    """An empty ``LayerKVCache`` (zeros, ``length`` 0).

    Args:
      batch, capacity: B and C (C ≥ 1).
      n_heads, kv_heads, head_dim: H, Hkv, D.
      dtype: compute dtype of k/v and the shift states.
      forget_gate: allocate ``log_fgate`` (FoX).
      kv_shift: allocate the KV-shift states (Pro).
      seq_start: optional [B] int left-padding offsets (see ``check_seq_start``).

    Raises:
      ValueError: capacity < 1 or a bad seq_start.
    """
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"cache capacity must be a positive int, got {capacity!r}")
    kv = jnp.zeros((batch, capacity, kv_heads, head_dim), dtype)
    state = jnp.zeros((batch, kv_heads, head_dim), dtype) if kv_shift else None
    return LayerKVCache(
        k=kv, v=kv,
        log_fgate=jnp.zeros((batch, capacity, n_heads), jnp.float32) if forget_gate else None,
        k_shift=state, v_shift=state,
        length=jnp.zeros((), jnp.int32),
        seq_start=check_seq_start(seq_start, batch))


def cache_columns(cache, t: int) -> jax.Array:
    """Columns [T] int32 that a chunk of T tokens occupies: 0..T−1 for a prefill (T > 1), else ``length``.

    Works for any cache with ``length`` (``LayerKVCache``, ``PackedKVCache``). Token positions are
    ``columns[None] - cache.seq_start[:, None]``.
    """
    if t > 1:
        return jnp.arange(t, dtype=jnp.int32)
    return cache.length[None]


def check_room(caches, n_tokens: int = 1) -> None:
    """Raise if appending ``n_tokens`` single-token steps would overflow a dense cache.

    Reads ``length`` back to the host (one device sync); does nothing while tracing.

    Args:
      caches: one ``LayerKVCache`` or a sequence of them (every layer has the same length).
      n_tokens: decode steps about to run.

    Raises:
      ValueError: length + n_tokens > capacity.
    """
    cache = caches if isinstance(caches, LayerKVCache) else caches[0]
    if isinstance(cache.length, jax.core.Tracer):
        return
    length = int(cache.length)
    if length + n_tokens > cache.capacity:
        raise ValueError(f"the KV cache is full: {length} of {cache.capacity} columns used, {n_tokens} more "
                         f"requested; allocate a larger cache_capacity (the dense cache does not grow)")


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, bias: jax.Array | None = None,
                     *, sm_scale: float | None = None) -> jax.Array:
    """One query per row over a cache of C slots: o = Σ_j softmax_j(scale·q·k_j + bias_j) v_j, j ∈ mask.

    The softmax is float32; the probabilities are cast to v's dtype for the product with V (as in
    the reference op, spec §1.7). GQA: query head h reads k/v head h // (H / Hkv).

    Args:
      q: [B, 1, H, D] float32 / bfloat16 / float16.
      k, v: [B, C, Hkv, D], q's dtype; H a multiple of Hkv.
      mask: [B, C] bool, the slots this query sees.
      bias: optional [B, C, H] float32 logit bias per head (the forget-gate decay).
      sm_scale: logit scale, default 1/√D.

    Returns:
      [B, 1, H, D] in q's dtype; a row without a visible slot outputs 0.

    Raises:
      ValueError: shape mismatches.
    """
    b, tq, h, d = q.shape
    _, c, hkv, _ = k.shape
    if tq != 1 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or h % hkv:
        raise ValueError(f"decode_attention needs q [B, 1, H, D] and k = v [B, C, Hkv, D] with H % Hkv == 0, "
                         f"got q {q.shape}, k {k.shape}, v {v.shape}")
    if mask.shape != (b, c) or mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be bool [B, C] = {(b, c)}, got {mask.dtype}{mask.shape}")
    if bias is not None and (bias.shape != (b, c, h) or bias.dtype != jnp.float32):
        raise ValueError(f"bias must be float32 [B, C, H] = {(b, c, h)}, got {bias.dtype}{bias.shape}")
    scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    g = h // hkv
    prec = dot_precision(q.dtype)
    s = jnp.einsum("bkgd,bckd->bkgc", q.reshape(b, hkv, g, d), k, preferred_element_type=jnp.float32,
                   precision=prec).reshape(b, h, c) * scale
    if bias is not None:
        s = s + bias.transpose(0, 2, 1)
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l > 0, l, 1.0)
    o = jnp.einsum("bkgc,bckd->bkgd", p.reshape(b, hkv, g, c).astype(v.dtype), v,
                   preferred_element_type=jnp.float32, precision=prec)
    return o.reshape(b, 1, h, d).astype(q.dtype)


def forget_gate_decay(log_fgate: jax.Array, visible: jax.Array) -> jax.Array:
    """Decay of each visible slot as seen from the newest one: Σ_{n = j+1}^{last} log f_n (spec §1).

    Computed as an exclusive reverse cumsum in float32 over the visible gates, so no large running
    sums are subtracted from each other.

    Args:
      log_fgate: [B, C, H] float32.
      visible: [B, C] bool; the newest visible column is the query's own, later columns must be False.

    Returns:
      [B, C, H] float32 (0 at the query's own column; garbage-free but meaningless where not visible).
    """
    lf = jnp.where(visible[..., None], log_fgate, 0.0)
    inclusive = lax.cumsum(lf, axis=1, reverse=True)
    return inclusive - lf


def cached_attention(cache: LayerKVCache, q: jax.Array, k: jax.Array, v: jax.Array,
                     log_fgate: jax.Array | None, *, k_shift: jax.Array | None = None,
                     v_shift: jax.Array | None = None, adaptive_threshold=None, implementation: str = "auto",
                     block: int = 128) -> tuple[jax.Array, LayerKVCache]:
    """Write a chunk into the cache and attend with it (prefill for T > 1, decode step for T = 1).

    Args:
      cache: the layer's ``LayerKVCache``.
      q: [B, T, H, D]; k, v: [B, T, Hkv, D] for the chunk, ready for attention (shifted, normed,
        rotated at positions ``cache_columns(cache, T) − seq_start``).
      log_fgate: [B, T, H] float32 or None (must match whether the cache has ``log_fgate``).
      k_shift, v_shift: the new KV-shift states [B, Hkv, D] (the chunk's last unshifted
        projections), or None without KV-shift.
      adaptive_threshold, implementation, block: passed to ``forgetting_attention`` in the prefill
        (ACP prunes the prefill only; a decode step attends densely).

    Returns:
      (o [B, T, H, D] in q's dtype, the updated cache with ``length`` = T (prefill) or + 1).

    Raises:
      ValueError: T > capacity, or forget-gate / shift presence not matching the cache.
    """
    b, t = q.shape[:2]
    if t > cache.capacity:
        raise ValueError(f"the prompt ({t} tokens) does not fit the cache capacity {cache.capacity}")
    if (log_fgate is None) != (cache.log_fgate is None) or (k_shift is None) != (cache.k_shift is None):
        raise ValueError("the cache was built for another model (forget gate / KV-shift presence differs)")
    start = jnp.zeros((), jnp.int32) if t > 1 else cache.length
    write = lambda buf, new: lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), start, axis=1)
    new = cache._replace(
        k=write(cache.k, k), v=write(cache.v, v),
        log_fgate=None if log_fgate is None else write(cache.log_fgate, log_fgate),
        k_shift=k_shift, v_shift=v_shift, length=start + t)
    if t > 1:
        o = forgetting_attention(q, k, v, log_fgate, seq_start=cache.seq_start,
                                 adaptive_threshold=adaptive_threshold, implementation=implementation,
                                 block_q=block, block_k=block)
        return o, new
    cols = jnp.arange(cache.capacity, dtype=jnp.int32)
    visible = (cols[None, :] >= cache.seq_start[:, None]) & (cols[None, :] <= start)
    bias = None if log_fgate is None else forget_gate_decay(new.log_fgate, visible)
    return decode_attention(q, new.k, new.v, visible, bias), new
