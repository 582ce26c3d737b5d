"""Helpers shared by the attention ops: input validation and tile padding."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

QKV_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


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


def check_segment_ids(segment_ids, b: int, tk: int) -> None:
    if segment_ids is not None and (
            segment_ids.shape != (b, tk) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(
            f"segment_ids must be an int array of shape [B, Tk] = {(b, tk)}, got {segment_ids.dtype}{segment_ids.shape}")


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
