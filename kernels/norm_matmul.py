"""Decode-row matmul Pallas kernel: a row norm, the matmul and its epilogue in one launch.

One ``pl.pallas_call`` written against the Triton lowering on GPU and run with ``interpret=True`` elsewhere.
Imports nothing from ``fox_jax``: arrays in, arrays out. The public op is ``fox_jax.ops.norm_matmul`` (argument
checks, dispatch, the XLA form every output is tested against).

A decode step multiplies a few rows (M = the batch) by each weight matrix, and on a GPU each kernel of it costs
~2–3 µs whatever its work (benchmarks/NOTES.md, "Decode GEMMs against their floor"). Before the GEMMs that read a
block's residual stream (the attention input projections, the MLP's first one), XLA runs the norm as a kernel of
its own, and the MLP's activation as another: this kernel does the norm in the matmul's prologue and the bias and
activation in its epilogue.

Math, for x [M, K] and weights W_i [K, n_i] (i = 1..P, one output of Σ n_i columns; the columns of W_i follow
those of W_{i−1}, as a concatenation of the kernels would give, without one):

    x̂ = norm(x) rounded to the compute dtype, norm one of
        "rms":   x / sqrt(mean(x²) + eps) · scale                        (RMSNorm)
        "layer": (x − mean(x)) / sqrt(mean((x − mean(x))²) + eps) · scale + bias     (LayerNorm, two passes)
        None:    x
    y = x̂ · [W_1 … W_P]  (float32 accumulation) rounded to the compute dtype, + b (rounded again), then
        activation None:        y
                   "gelu_tanh": gelu(y) (tanh approximation, GPT-2's)
                   "swiglu":    silu(y[:, :H]) ⊙ y[:, H:]   (one weight [K, 2H]: gate columns, then up columns)

Kernel: grid (N / block_n,) over the output's column blocks (for "swiglu", N = H and each program multiplies the
gate block and the up block at the same columns). Every program first takes the norm's row statistics in float32
from x chunks (x is small and read from L2), then streams its weight columns over K in ``block_k`` chunks,
normalising each x chunk as it goes; with several weights, each program's columns lie inside one of them (every
n_i is a multiple of block_n) and it reads that one only (a branch per weight). Program 0 also writes x̂, for the
layer's other consumers of the normed rows (the float32 gate projections of FoX). The M rows are padded to
``Mp`` = max(16, next power of two) with masked loads and stores (tl.dot needs every dimension ≥ 16), no copies.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MIN_BLOCK = 16  # tl.dot needs every matmul dimension ≥ 16
NORMS = (None, "rms", "layer")
ACTIVATIONS = (None, "gelu_tanh", "swiglu")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiling of the kernel (hashable: a static argument): ``block_n`` output columns per program, ``block_k`` rows
    of the weight per loaded chunk (both powers of two ≥ 16; block_n divides every n_i, block_k divides K), and the
    Triton launch knobs (num_stages = weight chunks in flight)."""

    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    fold_rms: bool = False  # "rms": y = rstd ⊙ ((x·scale) · W), the statistics summed in the matmul's own loop

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < MIN_BLOCK or v & (v - 1):
                raise ValueError(f"{name} must be a power of two ≥ {MIN_BLOCK}, got {v}")


def pow2_at_least(x: int, floor: int = MIN_BLOCK) -> int:
    return max(floor, 1 << max(0, (x - 1).bit_length()))


def largest_block(n: int, preferred: int) -> int | None:
    """The largest power of two ≤ ``preferred`` and ≥ 16 dividing ``n`` (None if none)."""
    b = preferred
    while b >= MIN_BLOCK:
        if n % b == 0:
            return b
        b //= 2
    return None


def default_matmul_config(k: int, widths: tuple[int, ...], activation: str | None = None) -> MatmulConfig | None:
    """The GPU tiling for K input features and weights of ``widths`` columns (for "swiglu": the one weight's 2H),
    or None when no tiling fits (K or a width not a multiple of 16). 32 columns and 128-row chunks were the
    fastest GEMV tiling on the H100 at the decode shapes (benchmarks/results/decode/h100_gemm_floor_1206.json)."""
    cols = (widths[0] // 2,) if activation == "swiglu" else widths
    bn = min((largest_block(n, 32) or 0) for n in cols)
    bk = largest_block(k, 128)
    if not bn or bk is None:
        return None
    return MatmulConfig(block_n=bn, block_k=bk)


def _row_stats(x_ref, rows, *, k: int, bk: int, norm: str, eps: float):
    """(shift [Mp, 1], rstd [Mp, 1]) float32 of the norm: x̂ = (x − shift) · rstd · scale (+ bias). Each pass sums
    [Mp, bk] chunks element-wise and reduces across the lanes once at its end (a reduction per chunk would put a
    cross-thread exchange and a barrier in every iteration of a loop that runs before any weight is read)."""
    mp = rows.shape[0]

    def load(i):
        return pltriton.load(x_ref.at[:, pl.ds(pl.multiple_of(i * bk, bk), bk)], mask=rows, other=0.0).astype(
            jnp.float32)

    def total(f):
        acc = lax.fori_loop(0, k // bk, lambda i, a: a + f(load(i)), jnp.zeros((mp, bk), jnp.float32))
        return jnp.sum(acc, axis=1, keepdims=True)

    if norm == "rms":
        return jnp.zeros((mp, 1), jnp.float32), lax.rsqrt(total(jnp.square) / k + eps)
    mean = total(lambda c: c) / k
    return mean, lax.rsqrt(total(lambda c: jnp.square(c - mean)) / k + eps)


def _kernel(*refs, m: int, k: int, starts: tuple[int, ...], has_bias: tuple[bool, ...], norm: str | None,
            norm_bias: bool, eps: float, activation: str | None, hidden: int, config: MatmulConfig,
            write_normed: bool):
    p = len(starts)
    x_ref, refs = refs[0], refs[1:]
    scale_ref = nb_ref = None
    if norm is not None:
        scale_ref, refs = refs[0], refs[1:]
        if norm_bias:
            nb_ref, refs = refs[0], refs[1:]
    w_refs, refs = refs[:p], refs[p:]
    b_refs = []
    for hb in has_bias:
        b_refs.append(refs[0] if hb else None)
        refs = refs[1:] if hb else refs
    o_ref = refs[0]
    xn_ref = refs[1] if write_normed else None
    bn, bk = config.block_n, config.block_k
    mp = x_ref.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (mp, 1), 0) < m
    j = pl.program_id(0)
    cdt = w_refs[0].dtype
    exact = lax.Precision.HIGHEST if cdt == jnp.float32 else None  # float32: IEEE products, not TF32
    fold = norm == "rms" and config.fold_rms
    if norm is not None and not fold:
        shift, rstd = _row_stats(x_ref, rows, k=k, bk=bk, norm=norm, eps=eps)

    def load_x(i):
        return pltriton.load(x_ref.at[:, pl.ds(pl.multiple_of(i * bk, bk), bk)], mask=rows, other=0.0)

    def normed_chunk(i, xc):
        if norm is None:
            return xc.astype(cdt)
        k0 = pl.multiple_of(i * bk, bk)
        y = xc.astype(jnp.float32)
        if not fold:
            y = (y - shift) * rstd
        y = y * scale_ref[pl.ds(k0, bk)][None, :]
        if nb_ref is not None:
            y = y + nb_ref[pl.ds(k0, bk)][None, :]
        return y.astype(cdt)

    def write_normed_rows(i, xn):
        @pl.when(j == 0)
        def _():
            pltriton.store(xn_ref.at[:, pl.ds(pl.multiple_of(i * bk, bk), bk)], xn.astype(xn_ref.dtype), mask=rows)

    def product(w_ref, cols: tuple[int, ...], write: bool):
        """float32 [Mp, bn] of x̂ times each column block of ``w_ref`` starting at ``cols`` (traced offsets)."""
        def body(i, carry):
            accs, ss = carry
            xc = load_x(i)
            xn = normed_chunk(i, xc)
            if write and not fold:
                write_normed_rows(i, xn)
            if fold:
                ss = ss + jnp.square(xc.astype(jnp.float32))
            k0 = pl.multiple_of(i * bk, bk)
            return tuple(acc + lax.dot_general(xn, w_ref[pl.ds(k0, bk), pl.ds(c, bn)], (((1,), (0,)), ((), ())),
                                               precision=exact, preferred_element_type=jnp.float32)
                         for acc, c in zip(accs, cols)), ss

        zero = tuple(jnp.zeros((mp, bn), jnp.float32) for _ in cols)
        accs, ss = lax.fori_loop(0, k // bk, body, (zero, jnp.zeros((mp, bk) if fold else (1, 1), jnp.float32)))
        if not fold:
            return accs
        # x̂ = rstd ⊙ x·scale: the row factor after the sum (the products' inputs are x·scale rounded, not x̂)
        r = lax.rsqrt(jnp.sum(ss, axis=1, keepdims=True) / k + eps)
        if write:
            @pl.when(j == 0)
            def _():
                def put(i, _):
                    write_normed_rows(i, (load_x(i).astype(jnp.float32) * r * scale_ref[
                        pl.ds(pl.multiple_of(i * bk, bk), bk)][None, :]).astype(cdt))
                    return 0

                lax.fori_loop(0, k // bk, put, 0)
        return tuple(acc * r for acc in accs)

    def store(y):
        pltriton.store(o_ref.at[:, pl.ds(pl.multiple_of(j * bn, bn), bn)], y.astype(o_ref.dtype), mask=rows)

    def add_bias(y, b_ref, c):
        y = y.astype(cdt)
        return y if b_ref is None else (y.astype(jnp.float32) + b_ref[pl.ds(c, bn)][None, :].astype(cdt)).astype(cdt)

    if activation == "swiglu":
        c = pl.multiple_of(j * bn, bn)
        gate, up = product(w_refs[0], (c, c + hidden), write_normed)
        gate, up = add_bias(gate, b_refs[0], c), add_bias(up, b_refs[0], c + hidden)
        g = gate.astype(jnp.float32)
        store((g * jax.nn.sigmoid(g)).astype(cdt).astype(jnp.float32) * up.astype(jnp.float32))
        return
    for w_ref, b_ref, start, end in zip(w_refs, b_refs, starts, starts[1:] + (None,)):
        first = start // bn
        inside = j >= first if end is None else (j >= first) & (j < end // bn)

        @pl.when(inside)
        def _(w_ref=w_ref, b_ref=b_ref, start=start):
            c = pl.multiple_of((j - start // bn) * bn, bn)
            y = add_bias(product(w_ref, (c,), write_normed)[0], b_ref, c)
            if activation == "gelu_tanh":
                f = y.astype(jnp.float32)
                y = 0.5 * f * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (f + 0.044715 * f * f * f)))
            store(y)


@functools.partial(jax.jit, static_argnames=("norm", "eps", "activation", "config", "out_dtype", "write_normed",
                                             "interpret"))
def norm_matmul(x: jax.Array, weights: tuple, biases: tuple, scale: jax.Array | None = None,
                norm_bias: jax.Array | None = None, *, norm: str | None, eps: float = 1e-6,
                activation: str | None = None, config: MatmulConfig, out_dtype, write_normed: bool = False,
                interpret: bool = False):
    """y [M, N] in ``out_dtype`` (and x̂ [M, K] in the weights' dtype with ``write_normed``): the module docstring.

    x [M, K] any float dtype; weights: P arrays [K, n_i] of one compute dtype; biases: P entries, [n_i] float or
    None; scale / norm_bias [K] float32 (the norm's; norm_bias for "layer" only). N = Σ n_i, or n_1 / 2 for
    "swiglu" (P = 1). Shapes are the op's to check (``fox_jax.ops.norm_matmul``): K % block_k == 0, every n_i
    (for "swiglu", n_1 / 2) a multiple of block_n.
    """
    m, k = x.shape
    mp = pow2_at_least(m)
    widths = tuple(w.shape[1] for w in weights)
    hidden = widths[0] // 2 if activation == "swiglu" else 0
    n = hidden if activation == "swiglu" else sum(widths)
    starts = tuple(sum(widths[:i]) for i in range(len(widths)))
    full = lambda shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    ins = [(x, full((mp, k)))]
    if norm is not None:
        ins.append((scale.astype(jnp.float32), full((k,))))
        if norm_bias is not None:
            ins.append((norm_bias.astype(jnp.float32), full((k,))))
    ins += [(w, pl.no_block_spec) for w in weights]
    ins += [(b, pl.no_block_spec) for b in biases if b is not None]
    outs = [(jax.ShapeDtypeStruct((m, n), out_dtype), full((mp, n)))]
    if write_normed:
        outs.append((jax.ShapeDtypeStruct((m, k), weights[0].dtype), full((mp, k))))
    kernel = functools.partial(
        _kernel, m=m, k=k, starts=starts, has_bias=tuple(b is not None for b in biases), norm=norm,
        norm_bias=norm_bias is not None, eps=eps, activation=activation, hidden=hidden, config=config,
        write_normed=write_normed)
    res = pl.pallas_call(
        kernel, grid=(n // config.block_n,), in_specs=[s for _, s in ins], out_specs=[s for _, s in outs],
        out_shape=[sh for sh, _ in outs], interpret=interpret, name="fox_norm_matmul",
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=config.num_warps,
                                                                      num_stages=config.num_stages),
    )(*[a for a, _ in ins])
    return tuple(res) if write_normed else res[0]
