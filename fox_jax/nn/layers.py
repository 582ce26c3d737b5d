"""Building blocks shared by the FoX and Transformer models (docs/design/fox_acp.md §2.1).

All modules are Flax Linen, keep float32 parameters and compute in ``dtype``.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Dtype = Any


def normal_init(std: float):
    return nn.initializers.normal(stddev=std)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · w, computed in float32; ``scale`` [d] initialised to 1."""

    eps: float = 1e-6
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(self.dtype)


class LayerNorm(nn.Module):
    """y = (x − mean(x)) / sqrt(mean((x − mean(x))²) + eps) · scale + bias, in float32 (Ba et al. 2016).

    The parameters are ``scale`` and ``bias`` [d] float32 (initialised to 1 and 0), as in ``flax.linen.LayerNorm``,
    so checkpoints and the GPT-2 weight map are the same. The variance is taken in two passes over the centred x
    (flax takes E[x²] − E[x]² in one multi-output reduction): the same value up to float32 rounding, and on GPU
    XLA emits the whole norm as one fused kernel instead of a reduction followed by the normalisation (a decode
    step of GPT-2 runs two per layer; benchmarks/checks/decode_kernels.py).
    """

    eps: float = 1e-5
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (d,), jnp.float32)
        xf = x.astype(jnp.float32)
        xc = xf - jnp.mean(xf, axis=-1, keepdims=True)
        y = xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + self.eps)
        return (y * scale + bias).astype(self.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate) ⊙ up) with a fused ``gate_proj``: d → 2·hidden (no biases)."""

    hidden: int
    init_std: float = 0.02
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32,
                                         kernel_init=normal_init(self.init_std), name=name)
        gate, up = jnp.split(dense(2 * self.hidden, "gate_proj")(x), 2, axis=-1)
        return dense(x.shape[-1], "down_proj")(nn.silu(gate) * up)


class DenseParams(nn.Module):
    """The parameters of a Flax ``nn.Dense`` without its matmul: ``kernel`` [d_in, features] float32 (normal
    init, std ``init_std``) and, with ``use_bias``, ``bias`` [features] float32 (zeros), created under the
    same names, shapes and initialisers as ``nn.Dense``, so checkpoints and inits are the same. Returns
    ``(kernel, bias or None)``; ``fused_dense`` applies several of them to one input as one matmul."""

    features: int
    use_bias: bool = False
    init_std: float = 0.02

    @nn.compact
    def __call__(self, d_in: int):
        kernel = self.param("kernel", normal_init(self.init_std), (d_in, self.features), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32) \
            if self.use_bias else None
        return kernel, bias


SMALL_F32_ROWS, SMALL_F32_FEATURES = 64, 256  # fused_dense: float32 outputs this small are a reduction


def fused_dense(x: jax.Array, projections: list[DenseParams], dtype: Dtype) -> list[jax.Array]:
    """``[nn.Dense(p.features)(x) for p in projections]`` computed as one matmul of ``x`` [..., d_in] with the
    kernels concatenated along their output axis (one GEMM launch instead of one per projection: a decode
    step is launch-bound), in ``dtype`` as ``nn.Dense(dtype=dtype)``. Each output [..., features_i] is in
    ``dtype``; biases are added after the split. Same parameters as separate ``nn.Dense`` layers. The
    attention layer uses it when decoding only: kernels sharded by different head axes over ``tensor`` would be
    resharded by the concatenation, and with B·T rows per matmul a launch costs nothing."""
    weights = [p(x.shape[-1]) for p in projections]
    # each kernel cast on its own (the decode loop's ``precast`` then does it once, before the loop)
    kernel = jnp.concatenate([k.astype(dtype) for k, _ in weights], axis=1)
    rows = math.prod(x.shape[:-1])
    if jnp.dtype(dtype) == jnp.float32 and rows <= SMALL_F32_ROWS and kernel.shape[1] <= SMALL_F32_FEATURES:
        # a few float32 outputs of a decode step (gates, shifts): multiply-and-sum is one reduction kernel into
        # which XLA can fuse the concatenation, where the GEMM took a copy of the concatenated kernels every step
        # (not hoisted out of the decode loop on the H200) and a launch that costs more than the work
        y = jnp.sum(x.astype(dtype)[..., :, None] * kernel, axis=-2)
    else:
        y = jax.lax.dot_general(x.astype(dtype), kernel, (((x.ndim - 1,), (0,)), ((), ())))
    sizes = [p.features for p in projections]
    outs = jnp.split(y, list(np.cumsum(sizes)[:-1]), axis=-1) if len(sizes) > 1 else [y]
    return [o if b is None else o + b.astype(dtype) for o, (_, b) in zip(outs, weights)]


def apply_rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary embedding, non-interleaved halves (as FLA / LLaMA), computed in float32.

    Args:
      x: [B, T, H, D] with D even; positions: [B, T] int (may be negative under left padding).
    Returns:
      [B, T, H, D] in x's dtype.
    """
    d = x.shape[-1]
    inv_freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class HeadRMSNorm(nn.Module):
    """RMSNorm over head_dim of [..., H, D] with a per-head scale [H, D] (or one [D] scale shared by
    all heads), computed in float32. Used for QK-norm (eps 1e-5) and the Pro output norm (eps 1e-6)."""

    eps: float = 1e-5
    shared: bool = False
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape[-1:] if self.shared else x.shape[-2:]
        scale = self.param("scale", nn.initializers.ones, shape, jnp.float32)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(self.dtype)


def kv_shift(raw: jax.Array, alpha: jax.Array, *, state: jax.Array | None = None,
             segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Data-dependent token shift (FoX Pro "KV-shift", paper Eq. 14):

        x_t = α_t · x̃_{t−1} + (1 − α_t) · x̃_t,   x̃_{−1} = ``state`` (zeros by default)

    Args:
      raw: [B, T, H, D] unshifted projections x̃.
      alpha: [B, T, H] float32 mixing weights in (0, 1).
      state: [B, H, D] the unshifted projection of the token before this chunk (a continuation that
        starts from the state of the previous chunk equals one pass over both), or None for zeros.
      segment_ids: [B, T] int or None: the shift never crosses a document boundary (the first token of
        a segment sees zeros; the first token of the chunk sees ``state``).
    Returns:
      (shifted [B, T, H, D] in raw's dtype, new state [B, H, D] = raw[:, -1]).
    """
    if state is None:
        state = jnp.zeros_like(raw[:, 0])
    prev = jnp.concatenate([state[:, None].astype(raw.dtype), raw[:, :-1]], axis=1)
    if segment_ids is not None:
        boundary = jnp.concatenate(
            [jnp.zeros_like(segment_ids[:, :1], dtype=bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
        prev = jnp.where(boundary[:, :, None, None], 0, prev)
    a = alpha[..., None]
    out = a * prev.astype(jnp.float32) + (1.0 - a) * raw.astype(jnp.float32)
    return out.astype(raw.dtype), raw[:, -1]
