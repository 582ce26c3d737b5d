"""A decode step's residual add and LayerNorm as one op, the added projections as partial sums: XLA or one kernel.

    x' = x + Σ_i round(round(Σ_s P_i[s]) + b_i),      h = LayerNorm(x') · γ + β

with round(·) the compute dtype's rounding: term i is ``nn.Dense``'s output (its GEMM's float32 accumulation
rounded once, then its bias added in the compute dtype) given as the float32 partial sums P_i [S_i, ..., d] of that
GEMM over a split of its inner dimension (``fox_jax.nn.layers.split_dense``) and the bias b_i; x and x' are the
float32 residual stream. That is GPT-2's ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))`` around a norm, for the
few rows of a decode step (``fox_jax.models.gpt2.DECODE_RESIDUAL``). ``implementation="pallas"`` runs
``fox_jax.kernels.residual_norm`` (one launch that writes x' and h); ``"xla"`` computes it as the model writes it;
``"auto"`` picks the kernel on GPU where no mesh of several devices is ambient (a ``pallas_call`` is opaque to the
SPMD partitioner), else XLA. Made for inference: the kernel has no gradient.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fox_jax.kernels import residual_norm as kr
from fox_jax.ops.head_ops import layer_norm
from fox_jax.sharding import kernel_mesh

RESIDUAL_NORM_IMPLEMENTATIONS = ("auto", "xla", "pallas")


def _xla(x, terms, scale, bias, eps: float, dtype):
    """The model's arithmetic: x [..., d] float32 plus each term in order, then the LayerNorm."""
    x = x.astype(jnp.float32)
    for parts, b in terms:
        y = jnp.sum(parts, axis=0).astype(dtype)
        if b is not None:
            y = y + b.astype(dtype)
        x = x + y.astype(jnp.float32)
    return x, layer_norm(x, scale, bias, eps, dtype)


def residual_layer_norm(x: jax.Array, terms: tuple, scale: jax.Array, bias: jax.Array, *, eps: float, dtype: Any,
                        implementation: str = "auto") -> tuple[jax.Array, jax.Array]:
    """x' = x + Σ_i (Σ_s P_i[s] + b_i) and h = LayerNorm(x') (module docstring for the rounding).

    Args:
      x: [..., d] float32 residual stream.
      terms: a tuple of (P_i [S_i, ..., d] float32 partial sums, b_i [d] or None), added to x in this order.
      scale, bias: [d] float32, the LayerNorm's γ and β; eps: its eps (a Python float).
      dtype: the compute dtype: each term is rounded to it, h is returned in it.
      implementation: ``"auto"``, ``"xla"`` or ``"pallas"`` (the Triton kernel; interpret mode off GPU).
    Returns:
      (x' [..., d] float32, h [..., d] in ``dtype``).
    Raises:
      ValueError: an unknown implementation; terms or parameters whose shapes do not match x; ``"pallas"`` with d
        not a multiple of 16.
    """
    if implementation not in RESIDUAL_NORM_IMPLEMENTATIONS:
        raise ValueError(f"residual_layer_norm: implementation must be one of {RESIDUAL_NORM_IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    d = x.shape[-1]
    for parts, b in terms:
        if parts.ndim != x.ndim + 1 or parts.shape[1:] != x.shape or (b is not None and b.shape != (d,)):
            raise ValueError(f"residual_layer_norm: each term must be (partial sums [S, {', '.join(map(str, x.shape))}]"
                             f", bias [{d}] or None), got ({list(parts.shape)}, "
                             f"{None if b is None else list(b.shape)})")
    if scale.shape != (d,) or bias.shape != (d,):
        raise ValueError(f"residual_layer_norm: scale and bias must be [{d}], got {list(scale.shape)} and "
                         f"{list(bias.shape)}")
    fits = d % 16 == 0
    if implementation == "pallas" and not fits:
        raise ValueError(f"residual_layer_norm: implementation='pallas' needs d a multiple of 16, got {d}")
    if implementation == "auto":
        mesh = kernel_mesh()
        on_gpu = jax.default_backend() == "gpu" and (mesh is None or mesh.size == 1)
        implementation = "pallas" if on_gpu and fits else "xla"
    if implementation == "xla":
        return _xla(x, terms, scale, bias, float(eps), dtype)
    lead = x.shape[:-1]
    flat = tuple((p.reshape(p.shape[0], -1, d), b) for p, b in terms)
    x2, h = kr.residual_layer_norm(x.astype(jnp.float32).reshape(-1, d), flat, scale, bias, eps=float(eps),
                                   dtype=dtype, interpret=jax.default_backend() != "gpu")
    return x2.reshape(*lead, d), h.reshape(*lead, d)


__all__ = ["RESIDUAL_NORM_IMPLEMENTATIONS", "residual_layer_norm"]
