"""Decode-step matmul Pallas kernel: a few rows against a weight matrix read once, norm and epilogue fused.

One ``pl.pallas_call`` written against the Triton lowering (``pltriton.CompilerParams``) on GPU and run
with ``interpret=True`` elsewhere. Imports nothing from ``fox_jax``: arrays in, arrays out. The public op
is ``fox_jax.ops.decode_matmul`` (argument checks, dispatch, the XLA path).

A decode step multiplies M ≤ 64 rows (one token per sequence) by each weight matrix of a layer, so its
matmuls are GEMVs: the bytes of W are the whole cost (a 768 × 3072 bf16 matrix is 4.7 MB, ≈1 µs at
4.8 TB/s), and XLA's GEMMs for such shapes take 2.5–5 µs each plus a split-K reduction kernel, with the
norm before them as a kernel of its own (benchmarks/NOTES.md, decode profile). This kernel computes

    y = epilogue(prologue(x) @ W1 [, prologue(x) @ W2])

    prologue:  x                                         (norm = "none")
               (x · rsqrt(mean(x²) + eps)) · g            (norm = "rms", in float32, then the weight dtype)
               ((x − mean(x)) · rsqrt(var(x) + eps)) · g + b   (norm = "layer")
    epilogue:  + bias, then act(·) (gelu_tanh / silu / none), · (x̂ @ W2 + bias2) when W2 is given
               (gated MLPs), + residual; stored in ``out_dtype``.

Kernel: grid (ceil(N / block_n),). Program j owns the output columns [j·bn, (j+1)·bn) of every row: the
x rows are tiny (M × K ≤ 64 × 8192), so every program reads them (from L2) and computes the norm's
statistics itself — no separate norm kernel, no cross-program reduction, deterministic. It then streams
its K × bn slice of W (and W2) in ``block_k`` chunks (software-pipelined loads), accumulating in float32.
The M rows are padded to 16 (``tl.dot``'s minimum) by masked loads; columns past N are masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MIN_BLOCK = 16
MAX_ROWS = 64
NORMS = ("none", "rms", "layer")
ACTIVATIONS = ("none", "gelu_tanh", "silu")


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiling (hashable: a static argument). block_n: output columns per program (a power of two ≥ 16);
    block_k: contraction chunk (a power of two ≥ 16 dividing K); num_warps / num_stages: Triton's knobs."""

    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < MIN_BLOCK or v & (v - 1):
                raise ValueError(f"{name} must be a power of two ≥ {MIN_BLOCK}, got {v}")


def _pow2_at_least(x: int, floor: int) -> int:
    return max(floor, 1 << max(0, (x - 1).bit_length()))


def default_matmul_config(k: int, n: int, *, interpret: bool = False) -> MatmulConfig:
    """block_k: the largest power of two ≤ 128 dividing K; block_n: 16 when N ≤ 2048 (more programs for the
    narrow matrices: o_proj, down_proj), else 32. Interpret mode: the same block_k (≤ 64), block_n 16."""
    bk = 64 if interpret else 128
    while bk > MIN_BLOCK and k % bk:
        bk //= 2
    if k % bk:
        raise ValueError(f"the contraction dim K must be a multiple of {MIN_BLOCK} for the Pallas decode "
                         f"matmul, got K={k}")
    bn = 16 if interpret or n <= 2048 else 32
    return MatmulConfig(block_n=bn, block_k=bk)


def _act(y, activation: str):
    if activation == "gelu_tanh":
        return jax.nn.gelu(y, approximate=True)
    if activation == "silu":
        return y * jax.nn.sigmoid(y)
    return y


@dataclasses.dataclass(frozen=True)
class _Geom:
    m: int
    m_pad: int
    k: int
    n: int
    block_n: int
    block_k: int
    norm: str
    eps: float
    activation: str
    has_bias: bool
    has_w2: bool
    has_bias2: bool
    has_residual: bool
    exact_dot: bool  # float32 weights: IEEE matmuls (Triton's float32 default is TF32)


def _kernel(*refs, g: _Geom):
    refs = list(refs)
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    ns_ref = refs.pop(0) if g.norm != "none" else None
    nb_ref = refs.pop(0) if g.norm == "layer" else None
    b_ref = refs.pop(0) if g.has_bias else None
    w2_ref = refs.pop(0) if g.has_w2 else None
    b2_ref = refs.pop(0) if g.has_bias2 else None
    r_ref = refs.pop(0) if g.has_residual else None
    (o_ref,) = refs
    bk, bn = g.block_k, g.block_n
    n_chunks = g.k // bk

    rows = lax.broadcasted_iota(jnp.int32, (g.m_pad, 1), 0)
    row_ok = rows < g.m
    col0 = pl.program_id(0) * bn
    cols = col0 + lax.broadcasted_iota(jnp.int32, (1, bn), 1)
    col_ok = cols < g.n

    def x_chunk(i):
        k0 = pl.multiple_of(i * bk, bk)
        return pltriton.load(x_ref.at[:, pl.ds(k0, bk)], mask=row_ok, other=0.0).astype(jnp.float32)

    mean = rstd = None
    if g.norm != "none":
        def stats(i, carry):
            s1, s2 = carry
            xc = x_chunk(i)
            return s1 + jnp.sum(xc, axis=1), s2 + jnp.sum(xc * xc, axis=1)

        zero = jnp.zeros((g.m_pad,), jnp.float32)
        s1, s2 = lax.fori_loop(0, n_chunks, stats, (zero, zero))
        if g.norm == "rms":
            rstd = lax.rsqrt(s2 / g.k + g.eps)
        else:
            mean = s1 / g.k
            var = jnp.maximum(s2 / g.k - mean * mean, 0.0)
            rstd = lax.rsqrt(var + g.eps)

    def body(i, carry):
        k0 = pl.multiple_of(i * bk, bk)
        xc = x_chunk(i)
        if g.norm != "none":
            if mean is not None:
                xc = xc - mean[:, None]
            xc = xc * rstd[:, None] * ns_ref[pl.ds(k0, bk)].astype(jnp.float32)[None, :]
            if nb_ref is not None:
                xc = xc + nb_ref[pl.ds(k0, bk)].astype(jnp.float32)[None, :]
        xc = xc.astype(w_ref.dtype)
        prec = lax.Precision.HIGHEST if g.exact_dot else None
        w = pltriton.load(w_ref.at[pl.ds(k0, bk), pl.ds(col0, bn)], mask=col_ok, other=0.0)
        acc = carry[0] + jnp.dot(xc, w, precision=prec, preferred_element_type=jnp.float32)
        if not g.has_w2:
            return (acc,)
        w2 = pltriton.load(w2_ref.at[pl.ds(k0, bk), pl.ds(col0, bn)], mask=col_ok, other=0.0)
        return acc, carry[1] + jnp.dot(xc, w2, precision=prec, preferred_element_type=jnp.float32)

    init = tuple(jnp.zeros((g.m_pad, bn), jnp.float32) for _ in range(1 + g.has_w2))
    accs = lax.fori_loop(0, n_chunks, body, init)
    y = accs[0]
    if b_ref is not None:
        y = y + pltriton.load(b_ref.at[pl.ds(col0, bn)], mask=col_ok[0], other=0.0).astype(jnp.float32)[None, :]
    y = _act(y, g.activation)
    if g.has_w2:
        y2 = accs[1]
        if b2_ref is not None:
            y2 = y2 + pltriton.load(b2_ref.at[pl.ds(col0, bn)], mask=col_ok[0],
                                    other=0.0).astype(jnp.float32)[None, :]
        y = y * y2
    ok = row_ok & col_ok
    if r_ref is not None:
        y = y + pltriton.load(r_ref.at[:, pl.ds(col0, bn)], mask=ok, other=0.0).astype(jnp.float32)
    pltriton.store(o_ref.at[:, pl.ds(col0, bn)], y.astype(o_ref.dtype), mask=ok)


def fused_matmul(x, w, *, norm: str = "none", norm_scale=None, norm_bias=None, eps: float = 1e-6, bias=None,
                 activation: str = "none", w2=None, bias2=None, residual=None, out_dtype=None,
                 config: MatmulConfig, interpret: bool) -> jax.Array:
    """The fused decode matmul (shapes unchecked: ``fox_jax.ops.decode_matmul`` checks them).

    Args:
      x: [M, K], M ≤ 64 (any float dtype; the norm runs in float32); w, w2: [K, N] (the matmul's dtype: x̂
        is cast to it; float32 weights get IEEE-exact dots); norm_scale, norm_bias: [K]; bias, bias2: [N];
        residual: [M, N]; out_dtype: default w.dtype; config: tiling (K % block_k == 0); interpret: CPU.
    Returns:
      [M, N] in out_dtype.
    """
    m, k = x.shape
    n = w.shape[1]
    if k % config.block_k:
        raise ValueError(f"K={k} must be a multiple of block_k={config.block_k}")
    geom = _Geom(m=m, m_pad=_pow2_at_least(m, MIN_BLOCK), k=k, n=n, block_n=config.block_n,
                 block_k=config.block_k, norm=norm, eps=float(eps), activation=activation,
                 has_bias=bias is not None, has_w2=w2 is not None, has_bias2=bias2 is not None,
                 has_residual=residual is not None, exact_dot=w.dtype == jnp.float32)
    args = [x, w]
    if norm != "none":
        args.append(norm_scale)
    if norm == "layer":
        args.append(norm_bias)
    args += [a for a in (bias, w2, bias2, residual) if a is not None]
    # x, residual and the output as blocks of m_pad ≥ M rows (rows ≥ M masked: no padding copies); the rest
    # whole (the kernel offsets its columns itself, masking those past N)
    rows_spec = lambda cols: pl.BlockSpec((geom.m_pad, cols), lambda j: (0, 0))  # noqa: E731
    in_specs = [rows_spec(k)] + [pl.no_block_spec] * (len(args) - 1 - (residual is not None))
    if residual is not None:
        in_specs.append(rows_spec(n))
    out_dtype = jnp.dtype(out_dtype or w.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, g=geom),
        grid=(pl.cdiv(n, config.block_n),),
        in_specs=in_specs,
        out_specs=rows_spec(n),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=config.num_warps,
                                                                      num_stages=config.num_stages),
        interpret=interpret,
        name="fox_decode_matmul",
    )(*args)


__all__ = ["ACTIVATIONS", "MAX_ROWS", "MatmulConfig", "NORMS", "default_matmul_config", "fused_matmul"]
