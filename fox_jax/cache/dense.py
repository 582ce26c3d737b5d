"""Dense KV caches for incremental decoding (docs/design/fox_acp.md §2.6).

One ``LayerKVCache`` per attention layer, a plain pytree (NamedTuple) with a fixed capacity C, so the
decode step has static shapes: it compiles once and runs inside ``lax.scan`` / ``lax.while_loop``.
Column c of the cache holds the c-th token fed to the model (left padding included).

A call of a model with a cache **appends a chunk** of T ≥ 1 tokens at columns
``length .. length + T − 1`` (``cache_columns``); a fresh cache has ``length`` 0, so a prefill is the
first chunk. Every chunk continues exactly where the previous one stopped: its queries see the cached
keys and the chunk's own keys causally, the forget-gate decay runs across the boundary, and the KV-shift
of its first token starts from the cached shift state. Any split of a sequence into chunks gives the
logits of one forward pass over the whole sequence.

* T > 1 (prefill, chunked prefill, continuation): the public op ``fox_jax.ops.forgetting_attention``
  over the whole buffer, rolled so that the chunk's last column is the op's last key (the op's
  bottom-right alignment, Tq ≤ Tk) and the unused columns come first, hidden together with the left
  pads by ``seq_start`` (the op does not visit those key blocks).
* T = 1 (decode step): the token's single query attends over the whole capacity with a validity mask
  (``decode_attention``); no roll, no scan.

Forget gates: each column stores its cumulative log forget gate Λ_j = Σ_{n ≤ j} log f_n (pads
contribute 0), written once when the token is appended, so a decode step forms the decay Λ_i − Λ_j of
every slot with one subtraction (``slot_decay``): O(1) work per slot beyond the attention itself.
|Λ| grows without bound (−0.01 per token is −655 at 64k tokens, where float32's spacing is 6e-5, i.e.
a relative error of 1e-2 on the decay 0.01 of a neighbour), so Λ is kept as an unevaluated float32
pair Λ = hi + lo (double-float arithmetic: ``accumulate_log_fgate`` adds gates with an error-free
two-sum), and Λ_i − Λ_j = (hi_i − hi_j) + (lo_i − lo_j) carries ~float32 relative precision on every
decay, however long the sequence.

Capacity: the cache never grows. A chunk needs ``length + T ≤ C``: ``T ≤ C`` is checked statically;
``length`` is checked where it is concrete (an eager call) and by the callers in
``fox_jax.decoding.generation`` on the host (``check_room``) before a jitted call, since a traced write
past the end would be clamped by XLA.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fox_jax.ops._common import check_seq_start, dot_precision
from fox_jax.ops.forgetting_attention import forgetting_attention


class LayerKVCache(NamedTuple):
    """Decoding state of one attention layer (FoX, Transformer, or dense GPT-2).

    Attributes:
      k, v: [B, C, Hkv, D] in the compute dtype: keys after KV-shift, QK-norm and RoPE, i.e. exactly
        what attention reads; columns ≥ ``length`` are unused.
      lam_hi, lam_lo: [B, C, H] float32, the cumulative log forget gate of each column as the pair
        Λ_j = lam_hi + lam_lo (nats, ≤ 0; 0 on left pads), or None for models without a forget gate.
      k_shift, v_shift: [B, Hkv, D] in the compute dtype, the *unshifted* k/v projections of the last
        token (KV-shift carry, spec §2.6), or None without KV-shift.
      length: int32 scalar, the number of columns filled (the same in every row).
      seq_start: [B] int32, the first real column of each row (the number of left pads); the token in
        column c has position c − seq_start (negative on pads, spec pitfall 10).
    """

    k: jax.Array
    v: jax.Array
    lam_hi: jax.Array | None
    lam_lo: jax.Array | None
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
        """Bytes one cached token takes in this layer (k, v and the two float32 halves of Λ)."""
        gates = 0 if self.lam_hi is None else self.lam_hi.shape[2] * 8
        return 2 * math.prod(self.k.shape[2:]) * self.k.dtype.itemsize + gates

    @staticmethod
    def check_room(caches, n_tokens: int = 1) -> None:
        """``check_room``: raise if appending ``n_tokens`` would overflow the dense caches."""
        check_room(caches, n_tokens)


def new_layer_cache(batch: int, capacity: int, *, n_heads: int, kv_heads: int, head_dim: int, dtype,
                    forget_gate: bool, kv_shift: bool, seq_start=None) -> LayerKVCache:
    """An empty ``LayerKVCache`` (zeros, ``length`` 0).

    Args:
      batch, capacity: B and C (C ≥ 1).
      n_heads, kv_heads, head_dim: H, Hkv, D.
      dtype: compute dtype of k/v and the shift states.
      forget_gate: allocate ``lam_hi`` / ``lam_lo`` (FoX).
      kv_shift: allocate the KV-shift states (Pro).
      seq_start: optional [B] int left-padding offsets (see ``check_seq_start``).

    Raises:
      ValueError: capacity < 1 or a bad seq_start.
    """
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"cache capacity must be a positive int, got {capacity!r}")
    kv = jnp.zeros((batch, capacity, kv_heads, head_dim), dtype)
    state = jnp.zeros((batch, kv_heads, head_dim), dtype) if kv_shift else None
    lam = jnp.zeros((batch, capacity, n_heads), jnp.float32) if forget_gate else None
    return LayerKVCache(
        k=kv, v=kv, lam_hi=lam, lam_lo=lam,
        k_shift=state, v_shift=state,
        length=jnp.zeros((), jnp.int32),
        seq_start=check_seq_start(seq_start, batch))



def cache_columns(cache, t: int) -> jax.Array:
    """Columns [T] int32 that a chunk of T tokens occupies: ``length`` .. ``length`` + T − 1.

    Works for any cache with ``length`` (``LayerKVCache``, ``PackedKVCache``). Token positions are
    ``columns[None] - cache.seq_start[:, None]`` (negative on left pads).
    """
    return cache.length + jnp.arange(t, dtype=jnp.int32)


def check_room(caches, n_tokens: int = 1) -> None:
    """Raise if appending ``n_tokens`` tokens (one chunk or single steps) would overflow a dense cache.

    ``n_tokens`` ≤ capacity is checked always; ``length + n_tokens`` ≤ capacity when ``length`` is
    concrete (it reads ``length`` back to the host, one device sync; nothing while tracing).

    Args:
      caches: one ``LayerKVCache`` or a sequence of them (every layer has the same length).
      n_tokens: tokens about to be appended.

    Raises:
      ValueError: length + n_tokens > capacity (the message names the capacity).
    """
    cache = caches if isinstance(caches, LayerKVCache) else caches[0]
    length = None if isinstance(cache.length, jax.core.Tracer) else int(cache.length)
    if n_tokens > cache.capacity or (length is not None and length + n_tokens > cache.capacity):
        used = "?" if length is None else length
        raise ValueError(f"the KV cache is full: {used} columns used of capacity {cache.capacity}, {n_tokens} "
                         f"more requested; allocate a larger cache_capacity (the dense cache does not grow)")


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


def _pair_add(a: tuple, b: tuple) -> tuple:
    """(a_hi + a_lo) + (b_hi + b_lo) as a normalised float32 pair (double-float addition).

    Knuth's two-sum gives the rounding error of a_hi + b_hi exactly; the low parts are added to it and
    the result renormalised (fast two-sum), so the pair carries ~2⁻⁴⁴ relative precision. Associative
    to that precision, hence usable in ``lax.associative_scan``.
    """
    s = a[0] + b[0]
    bb = s - a[0]
    err = (a[0] - (s - bb)) + (b[0] - bb) + (a[1] + b[1])
    hi = s + err
    return hi, err - (hi - s)


def accumulate_log_fgate(prev_hi: jax.Array, prev_lo: jax.Array, log_fgate: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Λ of each token of a chunk: Λ_t = Λ_prev + Σ_{n ≤ t} log f_n (docs/design/fox_acp.md §1.1), as pairs.

    Args:
      prev_hi, prev_lo: [B, H] float32, Λ of the token before the chunk (zeros for none).
      log_fgate: [B, T, H] float32 log forget gates of the chunk (0 for left pads).

    Returns:
      (hi, lo), each [B, T, H] float32 with Λ_t = hi + lo to ~2⁻⁴⁴ relative (a parallel prefix
      scan of ``_pair_add``, O(T) work).
    """
    scanned = lax.associative_scan(_pair_add, (log_fgate, jnp.zeros_like(log_fgate)), axis=1)
    return _pair_add((prev_hi[:, None], prev_lo[:, None]), scanned)


def slot_decay(cache: LayerKVCache, column) -> jax.Array:
    """The decay Λ_i − Λ_j (nats, ≤ 0 for j ≤ i) of every slot j as seen from the token in ``column`` i.

    (hi_i − hi_j) + (lo_i − lo_j): one subtraction per slot and head, no scan over the cache; float32
    relative precision on each decay however large |Λ| is.

    Args:
      cache: a ``LayerKVCache`` with forget gates.
      column: int32 scalar (traced or not), a filled column.

    Returns:
      [B, C, H] float32; meaningless at unused columns and at columns after ``column``.
    """
    hi = lax.dynamic_index_in_dim(cache.lam_hi, column, axis=1, keepdims=True)
    lo = lax.dynamic_index_in_dim(cache.lam_lo, column, axis=1, keepdims=True)
    return (hi - cache.lam_hi) + (lo - cache.lam_lo)


def _log_fgate_of(cache: LayerKVCache) -> jax.Array:
    """[B, C, H] float32 log f_j = Λ_j − Λ_{j−1} (Λ_{−1} = 0) from the stored pairs, for the op."""
    shifted = lambda x: jnp.pad(x[:, :-1], ((0, 0), (1, 0), (0, 0)))
    return (cache.lam_hi - shifted(cache.lam_hi)) + (cache.lam_lo - shifted(cache.lam_lo))


def cached_attention(cache: LayerKVCache, q: jax.Array, k: jax.Array, v: jax.Array,
                     log_fgate: jax.Array | None, *, k_shift: jax.Array | None = None,
                     v_shift: jax.Array | None = None, adaptive_threshold=None, implementation: str = "auto",
                     block: int = 128) -> tuple[jax.Array, LayerKVCache]:
    """Append a chunk of T ≥ 1 tokens to the cache and attend with it (module docstring).

    o_i = Σ_j softmax_j(scale·q_i·k_j + Λ_i − Λ_j) v_j over the columns j ∈ [seq_start, i], i the
    chunk's columns ``length`` .. ``length`` + T − 1 (FoX Eq. 4–6; without gates Λ ≡ 0).

    Args:
      cache: the layer's ``LayerKVCache``.
      q: [B, T, H, D]; k, v: [B, T, Hkv, D] for the chunk, ready for attention (shifted, normed,
        rotated at positions ``cache_columns(cache, T) − seq_start``).
      log_fgate: [B, T, H] float32 or None (must match whether the cache has forget gates); values
        at left-pad columns are ignored (taken as 0).
      k_shift, v_shift: the new KV-shift states [B, Hkv, D] (the chunk's last unshifted
        projections), or None without KV-shift.
      adaptive_threshold, implementation, block: passed to ``forgetting_attention`` for T > 1 (ACP
        prunes chunks; a decode step attends densely).

    Returns:
      (o [B, T, H, D] in q's dtype, the updated cache with ``length`` + T).

    Raises:
      ValueError: the chunk does not fit the capacity (``check_room``: always for T > C, for
        ``length`` + T > C when ``length`` is concrete); forget-gate / shift presence not matching the
        cache.
    """
    b, t = q.shape[:2]
    check_room(cache, t)
    if (log_fgate is None) != (cache.lam_hi is None) or (k_shift is None) != (cache.k_shift is None):
        raise ValueError("the cache was built for another model (forget gate / KV-shift presence differs)")
    start = cache.length
    write = lambda buf, new: lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), start, axis=1)
    lam_hi = lam_lo = None
    if log_fgate is not None:
        real = cache_columns(cache, t)[None, :] >= cache.seq_start[:, None]
        prev = lambda x: jnp.where(start > 0, lax.dynamic_index_in_dim(x, jnp.maximum(start - 1, 0), axis=1,
                                                                       keepdims=False), 0.0)
        hi, lo = accumulate_log_fgate(prev(cache.lam_hi), prev(cache.lam_lo),
                                      jnp.where(real[..., None], log_fgate, 0.0))
        lam_hi, lam_lo = write(cache.lam_hi, hi), write(cache.lam_lo, lo)
    new = cache._replace(k=write(cache.k, k), v=write(cache.v, v), lam_hi=lam_hi, lam_lo=lam_lo,
                         k_shift=k_shift, v_shift=v_shift, length=start + t)
    if t == 1:
        cols = jnp.arange(cache.capacity, dtype=jnp.int32)
        visible = (cols[None, :] >= cache.seq_start[:, None]) & (cols[None, :] <= start)
        bias = None if log_fgate is None else slot_decay(new, start)
        return decode_attention(q, new.k, new.v, visible, bias), new
    # Roll the buffer so that the chunk ends at the last key: queries sit bottom-right as the op
    # expects; the unused columns wrap to the front and, with the pads, fall before seq_start.
    shift = cache.capacity - new.length
    roll = lambda x: jnp.roll(x, shift, axis=1)
    o = forgetting_attention(q, roll(new.k), roll(new.v), None if log_fgate is None else roll(_log_fgate_of(new)),
                             seq_start=cache.seq_start + shift, adaptive_threshold=adaptive_threshold,
                             implementation=implementation, block_q=block, block_k=block)
    return o, new
