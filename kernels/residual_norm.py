"""A decode step's residual add and the LayerNorm after it as one Pallas kernel, the added terms as partial sums.

    x' = x + Σ_i round(round(Σ_s P_i[s]) + b_i),      h = LayerNorm(x') = (x' − μ) · rsqrt(var(x') + eps) · γ + β

One ``pl.pallas_call`` written against the Triton lowering on GPU and run with ``interpret=True`` elsewhere.
Imports nothing from ``fox_jax`` but the decode attention kernel's chunking: arrays in, arrays out. The public op
is ``fox_jax.ops.residual_norm`` (checks, dispatch, the XLA path).

Why: in GPT-2's decode step (B32) XLA runs, per layer, the residual add after the MLP and the next layer's ln_1 as
two kernels of ~1.9 µs each on an H100 (the add must write the float32 residual stream, which two later kernels
read, and XLA's LayerNorm fusion cannot also write it), and ln_2 with the attention's residual add as one of
~2.9 µs. Each term i is the float32 partial sums P_i [S_i, M, d] of a projection's GEMM over a split of its inner
dimension (``fox_jax.nn.layers.split_dense``: the split-K XLA's autotuner picks for these GEMMs, made explicit) and
its bias b_i: the kernel adds them as it loads them, rounds the sum to the compute dtype as the GEMM rounds its
float32 accumulation, adds the bias in that dtype as ``nn.Dense`` does, and adds the result to x in float32; then
the LayerNorm in float32 with the two-pass variance of ``fox_jax.nn.layers.LayerNorm``. It writes x' (float32) and
h (compute dtype), so the add and the norm are one launch.

One program per row (M ≤ a few hundred: a decode step's batch), the row in power-of-two column chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fox_jax.kernels.decode_attention import head_dim_chunks


def _kernel(*refs, parts: tuple, biased: tuple, chunks: tuple, d: int, eps: float, dtype):
    x_ref, rest = refs[0], refs[1:]
    terms = []
    for n, has_bias in zip(parts, biased):
        terms.append((rest[0], rest[1] if has_bias else None, n))
        rest = rest[1 + has_bias:]
    g_ref, b_ref, xo_ref, h_ref = rest
    f32 = jnp.float32
    xs = [pltriton.load(x_ref.at[pl.ds(off, size)]).astype(f32) for off, size in chunks]
    for p_ref, bias_ref, n in terms:  # in order: x + t_0 + t_1 + … (the model's residual adds)
        for c, (off, size) in enumerate(chunks):
            acc = pltriton.load(p_ref.at[jnp.int32(0), pl.ds(off, size)])
            for s in range(1, n):
                acc = acc + pltriton.load(p_ref.at[jnp.int32(s), pl.ds(off, size)])
            y = acc.astype(dtype)
            if bias_ref is not None:
                y = (y.astype(f32) + pltriton.load(bias_ref.at[pl.ds(off, size)]).astype(f32)).astype(dtype)
            xs[c] = xs[c] + y.astype(f32)
    mean = sum(jnp.sum(x) for x in xs) / d
    xc = [x - mean for x in xs]
    r = jax.lax.rsqrt(sum(jnp.sum(x * x) for x in xc) / d + eps)
    for x, z, (off, size) in zip(xs, xc, chunks):
        pltriton.store(xo_ref.at[pl.ds(off, size)], x)
        scale = pltriton.load(g_ref.at[pl.ds(off, size)])
        shift = pltriton.load(b_ref.at[pl.ds(off, size)])
        pltriton.store(h_ref.at[pl.ds(off, size)], (z * r * scale + shift).astype(h_ref.dtype))


def residual_layer_norm(x, terms, scale, bias, *, eps: float, dtype, interpret: bool, num_warps: int = 4):
    """The kernel (shapes unchecked: ``fox_jax.ops.residual_norm`` checks them).

    Args:
      x: [M, d] float32, the residual stream (d a multiple of 16).
      terms: a tuple of (P [S, M, d] float32 partial sums, b [d] in ``dtype`` or None), added to x in order.
      scale, bias: [d] float32, the LayerNorm's γ and β. eps: its eps. dtype: the compute dtype (h's, the terms').
      interpret: interpret mode (CPU). num_warps: Triton warps per program.
    Returns:
      (x' [M, d] float32, h [M, d] in ``dtype``).
    """
    m, d = x.shape
    ins, specs = [x], [pl.BlockSpec((None, d), lambda i: (i, 0))]
    for p, b in terms:
        ins.append(p.astype(jnp.float32))
        specs.append(pl.BlockSpec((p.shape[0], None, d), lambda i: (0, i, 0)))
        if b is not None:
            ins.append(b.astype(dtype))
            specs.append(pl.BlockSpec((d,), lambda i: (0,)))
    ins += [scale.astype(jnp.float32), bias.astype(jnp.float32)]
    specs += [pl.BlockSpec((d,), lambda i: (0,))] * 2
    kernel = functools.partial(_kernel, parts=tuple(p.shape[0] for p, _ in terms),
                               biased=tuple(b is not None for _, b in terms), chunks=head_dim_chunks(d), d=d,
                               eps=float(eps), dtype=jnp.dtype(dtype))
    row = pl.BlockSpec((None, d), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        grid=(m,),
        in_specs=specs,
        out_specs=(row, row),
        out_shape=(jax.ShapeDtypeStruct((m, d), jnp.float32), jax.ShapeDtypeStruct((m, d), jnp.dtype(dtype))),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="fox_residual_layer_norm",
    )(*ins)


__all__ = ["residual_layer_norm"]
