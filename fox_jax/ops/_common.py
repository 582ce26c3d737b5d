"""Helpers shared by the attention ops: input validation and tile padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

QKV_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# Names of the attention ops' forward results that their backward reads (``jax.ad_checkpoint.checkpoint_name``):
# the output o and the log-sum-exp of each row. A remat policy that saves them (``fox_jax.models.family``'s "dots")
# keeps the attention forward out of the backward pass; without them it is recomputed there, kernel and all.
ATTENTION_RESIDUALS = ("attention_out", "attention_lse")


def name_attention_residuals(o: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(o, lse) tagged with ``ATTENTION_RESIDUALS`` for remat policies (no effect on values or outside remat)."""
    from jax.ad_checkpoint import checkpoint_name

    return checkpoint_name(o, ATTENTION_RESIDUALS[0]), checkpoint_name(lse, ATTENTION_RESIDUALS[1])


def check_qkv(q, k, v) -> None:
    """q [B, Tq, H, D], k/v [B, Tk, Hkv, D]: ranks, dtypes (f32/bf16/fp16, shared), H % Hkv == 0, Tq ≤ Tk.

    Raises:
      ValueError naming the argument and the expected shape or dtype.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {x.shape}")
        if x.dtype not in QKV_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    b, tq, h, d = q.shape
    _, tk, hkv, dk = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if k.shape[0] != b or dk != d:
        raise ValueError(f"k/v must be [B={b}, Tk, Hkv, D={d}] to match q {q.shape}, got {k.shape}")
    if h % hkv:
        raise ValueError(f"q heads ({h}) must be a multiple of k/v heads ({hkv})")
    if tq > tk:
        raise ValueError(f"query length ({tq}) must not exceed key length ({tk}); queries are the last Tq keys")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def check_attention_inputs(q, k, v, log_fgate, *, segment_ids=None, log_mask=None, window_size=None) -> None:
    """The checks every public attention op makes (``forgetting_attention``, ``dcp_attention``).

    Args:
      q, k, v: as ``check_qkv``.
      log_fgate: None or [B, Tk, H] float32 log forget gates (one per query head).
      segment_ids: None or [B, Tk] int.
      log_mask: None or [B, Tq, Tk] float32 (DCP).
      window_size: None or an int ≥ 1 (sliding window, ``check_window_size``).
    Raises:
      ValueError naming the argument and the expected shape or dtype.
    """
    check_qkv(q, k, v)
    b, tq, h, _ = q.shape
    tk = k.shape[1]
    if log_fgate is not None:
        if log_fgate.shape != (b, tk, h):
            raise ValueError(f"log_fgate must be [B, Tk, H] = {(b, tk, h)} (one gate per query head), "
                             f"got {log_fgate.shape}")
        if log_fgate.dtype != jnp.float32:
            raise ValueError(
                f"log_fgate must be float32 (cast the gate logits to float32 before log_sigmoid), "
                f"got {log_fgate.dtype}")
    if log_mask is not None:
        if log_mask.shape != (b, tq, tk):
            raise ValueError(f"log_mask must be [B, Tq, Tk] = {(b, tq, tk)}, got {log_mask.shape}")
        if log_mask.dtype != jnp.float32:
            raise ValueError(f"log_mask must be float32, got {log_mask.dtype}")
    check_segment_ids(segment_ids, b, tk)
    check_window_size(window_size)


def check_window_size(window_size) -> int | None:
    """A sliding window: None (off) or a Python / NumPy int ≥ 1 (static: it shapes the tile loops).

    Returns:
      ``window_size`` as a Python int, or None.
    Raises:
      ValueError: anything else (bools, floats, arrays, values < 1), naming ``window_size``.
    """
    if window_size is None:
        return None
    if isinstance(window_size, (bool, np.bool_)) or not isinstance(window_size, (int, np.integer)) or window_size < 1:
        raise ValueError(f"window_size must be None or an int ≥ 1 (query i sees keys i − window_size < j ≤ i), "
                         f"got {window_size!r}")
    return int(window_size)


def check_segment_ids(segment_ids, b: int, tk: int) -> None:
    if segment_ids is not None and (
            segment_ids.shape != (b, tk) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(
            f"segment_ids must be an int array of shape [B, Tk] = {(b, tk)}, got {segment_ids.dtype}{segment_ids.shape}")


def check_seq_start(seq_start, batch: int, seq_len: int | None = None) -> jax.Array:
    """Validate left-padding offsets and bring them into range: int32 [B] (zeros for None).

    ``seq_start[b]`` is the number of left pads of row b: keys j < seq_start[b] are invisible. With
    the key length T (``seq_len``) known, the valid range is [0, T): every row keeps at least its
    last key (a row of T pads has no key at all and could only output zeros, which downstream code
    cannot tell from a real output). Concrete values outside the range raise. Traced values (under
    ``jit``, ``vmap``, ``shard_map``) cannot be checked: they are clamped into [0, T − 1], so a value
    below 0 acts as 0 (no padding) and one ≥ T as T − 1 (only the last key visible), the same for
    every consumer since they all read the clamped array.

    Args:
      seq_start: None or [B] int array (or anything ``jnp.asarray`` takes).
      batch: B.
      seq_len: T, the key (prompt) length, or None: then only seq_start ≥ 0 is checked and nothing
        is clamped.
    Returns:
      [B] int32.
    Raises:
      ValueError: wrong shape or a non-integer dtype; a concrete value < 0 or ≥ seq_len (the message
        names the offending rows and values).
    """
    if seq_start is None:
        return jnp.zeros((batch,), jnp.int32)
    seq_start = jnp.asarray(seq_start)
    if seq_start.shape != (batch,) or not jnp.issubdtype(seq_start.dtype, jnp.integer):
        raise ValueError(f"seq_start must be an int array of shape [B] = ({batch},), "
                         f"got {seq_start.dtype}{seq_start.shape}")
    if not isinstance(seq_start, jax.core.Tracer):
        values = np.asarray(seq_start).astype(np.int64)
        bad = (values < 0) if seq_len is None else ((values < 0) | (values >= seq_len))
        if bad.any():
            rows = np.flatnonzero(bad)
            shown = ", ".join(f"seq_start[{i}] = {values[i]}" for i in rows[:8]) + (" ..." if len(rows) > 8 else "")
            valid = "≥ 0" if seq_len is None else f"in [0, {seq_len - 1}] (T = {seq_len} keys; every row needs one)"
            raise ValueError(f"seq_start values must be {valid}, got {shown}")
    seq_start = seq_start.astype(jnp.int32)
    if seq_len is not None:
        seq_start = jnp.clip(seq_start, 0, seq_len - 1)
    return seq_start


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_axis(x, axis: int, new_len: int, value=0):
    """Pad ``x`` at the end of ``axis`` to ``new_len`` with ``value``."""
    pad = new_len - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def dot_precision(dtype):
    """Full float32 matmuls for float32 inputs (tests, CPU); the default (tensor cores) otherwise."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT
