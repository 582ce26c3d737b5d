"""Building blocks shared by the FoX and Transformer models (specs/fox_acp.md §2.1).

All modules are Flax Linen, keep float32 parameters and compute in ``dtype``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

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
