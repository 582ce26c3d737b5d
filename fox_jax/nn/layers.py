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

from fox_jax.ops.head_ops import layer_norm, rms_norm
from fox_jax.sharding import constrain

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
        return rms_norm(x, scale, self.eps, self.dtype)


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
        return layer_norm(x, scale, bias, self.eps, self.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate) ⊙ up) with a fused ``gate_proj``: d → 2·hidden (no biases).

    ``gate_proj``'s kernel is stored [d, 2·hidden] (gate columns, then up columns; the official FoX layout) and
    applied as [d, 2, hidden]: one matmul whose output keeps (gate, up) on an axis of its own, so under a
    ``tensor`` mesh the hidden axis is split the same way for both halves and for ``down_proj``'s rows
    (``fox_jax.sharding.constrain``): the product and its gradient stay on each device, as in Megatron's
    column-then-row parallel MLP. Sharded by its stored [d, 2·hidden] layout, the gate and up halves would
    sit on different devices and every layer would exchange [B, T, hidden] activations, forward and backward;
    the constraint moves the kernel instead (all-to-alls of the [d, 2·hidden] weights: weight-sized, not
    activation-sized). Without a mesh it is a reshape.
    """

    hidden: int
    init_std: float = 0.02
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, split_hidden: bool = True) -> jax.Array:
        """x [..., d] → [..., d] in ``dtype``. ``split_hidden``: lay the kernel out by the hidden axis under a
        mesh (training, scoring); False on a decode step, where moving the weights every step would cost
        more than the few activations it saves."""
        d = x.shape[-1]
        kernel, _ = DenseParams(2 * self.hidden, init_std=self.init_std, name="gate_proj")(d)
        pairs = kernel.astype(self.dtype).reshape(d, 2, self.hidden)
        if split_hidden:
            pairs = constrain(pairs, ("embed", None, "mlp"))
        h = jax.lax.dot_general(x.astype(self.dtype), pairs, (((x.ndim - 1,), (0,)), ((), ())))
        down = nn.Dense(d, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32,
                        kernel_init=normal_init(self.init_std), name="down_proj")
        return down(swiglu(h))


@jax.custom_vjp
def swiglu(h: jax.Array) -> jax.Array:
    """silu(gate) ⊙ up of the fused projection h [..., 2, hidden] (axis −2: gate, up), in h's dtype:
    [..., hidden].

    The backward returns dh as one [..., 2, hidden] array computed in float32 (each half reads the other
    half through a reversal of the (gate, up) axis), so no concatenation of d_gate and d_up is materialised
    before the projection's weight gradient (autodiff of the two halves writes one: a copy of the
    [B·T, 2·hidden] cotangent per layer in the training step)."""
    return nn.silu(h[..., 0, :]) * h[..., 1, :]


def _swiglu_fwd(h):
    return swiglu(h), h


def _swiglu_bwd(h, g):
    pair = h.astype(jnp.float32)  # [..., (gate, up), hidden]
    other = pair[..., ::-1, :]    # [..., (up, gate), hidden]
    is_gate = jax.lax.broadcasted_iota(jnp.int32, pair.shape, pair.ndim - 2) == 0
    gate, up = jnp.where(is_gate, pair, other), jnp.where(is_gate, other, pair)
    sig = jax.nn.sigmoid(gate)
    g = g.astype(jnp.float32)[..., None, :]
    d = jnp.where(is_gate, g * up * sig * (1.0 + gate * (1.0 - sig)), g * gate * sig)
    return (d.astype(h.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


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


def fused_dense(x: jax.Array, weights: list[tuple], dtype: Dtype, *, packed: bool = False):
    """``[nn.Dense(n)(x) for each (kernel, bias)]`` computed as one matmul of ``x`` [..., d_in] with the
    kernels concatenated along their output axis (one GEMM launch instead of one per projection: a decode
    step is launch-bound), in ``dtype`` as ``nn.Dense(dtype=dtype)``. ``weights``: the ``DenseParams`` outputs,
    (kernel [d_in, n], bias [n] or None) per projection. Each output [..., n_i] is in ``dtype``; biases are added
    after the split. Same parameters as separate ``nn.Dense`` layers. The
    attention layer uses it when decoding only: kernels sharded by different head axes over ``tensor`` would be
    resharded by the concatenation, and with B·T rows per matmul a launch costs nothing. With ``packed`` returns
    (the outputs, the whole [..., Σ features] output they are slices of, biases added): a kernel that reads several
    of them takes the one buffer (a slice passed on its own is a copy kernel per decode step)."""
    kernel = jnp.concatenate([k.astype(dtype) for k, _ in weights], axis=1)
    rows = math.prod(x.shape[:-1])
    bias = None
    if any(b is not None for _, b in weights):
        bias = jnp.concatenate([jnp.zeros((k.shape[1],), dtype) if b is None else b.astype(dtype)
                                for k, b in weights])
    if jnp.dtype(dtype) == jnp.float32 and rows <= SMALL_F32_ROWS and kernel.shape[1] <= SMALL_F32_FEATURES:
        # a few float32 outputs of a decode step (gates, shifts): multiply-and-sum is one reduction kernel into
        # which XLA can fuse the concatenation, where the GEMM took a copy of the concatenated kernels every step
        # (not hoisted out of the decode loop on the H200) and a launch that costs more than the work. The biases
        # join the sum as one more input row (x extended by a 1): the concatenated bias then fuses too (added
        # after the sum it was a kernel of its own per step).
        xs, ks = x.astype(dtype)[..., :, None], kernel
        if bias is not None:
            xs = jnp.concatenate([xs, jnp.ones((*x.shape[:-1], 1, 1), dtype)], axis=-2)
            ks = jnp.concatenate([kernel, bias[None]], axis=0)
        y = jnp.sum(xs * ks, axis=-2)
    else:
        y = jax.lax.dot_general(x.astype(dtype), kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if bias is not None:
            y = y + bias
    sizes = [k.shape[1] for k, _ in weights]
    outs = jnp.split(y, list(np.cumsum(sizes)[:-1]), axis=-1) if len(sizes) > 1 else [y]
    return (outs, y) if packed else outs


def split_dense(x: jax.Array, kernel: jax.Array, dtype: Dtype, parts: int) -> jax.Array:
    """x · kernel as ``parts`` float32 partial sums over consecutive slices of the inner dimension (a split-K made
    explicit, as one batched GEMM): [parts, ..., n], whose sum over axis 0 is ``nn.Dense(n, use_bias=False,
    dtype=dtype)``'s product before its rounding to ``dtype``. A decode step's small GEMM is split this way by XLA
    itself (its autotuner picks split-K for few rows), and then reduced by a kernel of its own; made explicit, the
    partial sums can go to a kernel that adds them while it loads them (the decode kernel's ``rows``), so the
    reduction costs no launch.

    Args:
      x: [..., d_in]; kernel: [d_in, n] (cast to ``dtype``, as x); parts: S ≥ 1 dividing d_in.
    Returns:
      [S, ..., n] float32.
    Raises:
      ValueError: S < 1 or S not dividing d_in.
    """
    d_in, n = kernel.shape
    if parts < 1 or d_in % parts:
        raise ValueError(f"split_dense: parts must be ≥ 1 and divide d_in={d_in}, got {parts}")
    xs = x.astype(dtype).reshape(-1, parts, d_in // parts)                                   # [M, S, d_in / S]
    ws = kernel.astype(dtype).reshape(parts, d_in // parts, n)                              # [S, d_in / S, n]
    y = jax.lax.dot_general(xs, ws, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.float32)  # [S, M, n]
    return y.reshape(parts, *x.shape[:-1], n)


class HeadNormScale(nn.Module):
    """The scale of a per-head RMSNorm (QK-norm, the Pro output norm): ``scale`` [H, D] float32, or one [D] shared by
    all heads, initialised to 1. The norm itself is ``fox_jax.ops.head_ops.rms_norm``, applied by the attention
    layer's ``HeadOps`` (inside the decode kernel when decoding)."""

    shared: bool = False

    @nn.compact
    def __call__(self, heads: int, dim: int) -> jax.Array:
        return self.param("scale", nn.initializers.ones, (dim,) if self.shared else (heads, dim), jnp.float32)
