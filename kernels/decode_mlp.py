"""A decode step's SwiGLU block as one Pallas kernel: RMSNorm → gate/up → silu(gate) ⊙ up → down.

One ``pl.pallas_call`` written against the Triton lowering on GPU and run with ``interpret=True`` elsewhere.
Imports nothing from ``fox_jax`` but the decode attention kernel's block constants: arrays in, arrays out. The
public op is ``fox_jax.ops.decode_mlp`` (checks, dispatch, the XLA path).

Why: a decode step multiplies M ≤ 64 rows by each weight matrix, and at that size every XLA kernel costs a
floor of ~2–3 µs whatever it reads (benchmarks/NOTES.md, "Decode GEMMs against their floor"). XLA runs this block
as four of them (the norm, the gate/up GEMM, silu ⊙ up, the down GEMM with its split-K partials) and the residual
add as a fifth. Here it is one launch, split over the hidden axis: program j of P = hidden / block_h

1. sums the squares of its M rows of x (a few KB, read by every program: no cross-program reduction) for
   r = rsqrt(mean(x²) + eps),
2. multiplies x̂ = r · x · s (rounded to the weights' dtype, as the model's norm output) by its block_h gate and
   up columns, streamed over d in chunks of block_k (float32 accumulation),
3. takes silu(gate) ⊙ up of its block_h hidden units, each factor rounded to the weights' dtype where the model's
   GEMM output is and the product rounded once more (the model's ``swiglu`` in that dtype),
4. multiplies that [M, block_h] by its block_h rows of the down projection, block_n output columns at a time,
   and writes a float32 partial [M, d].

The caller sums the P partials; XLA fuses that sum into the residual add that follows (as it sums its own
split-K GEMMs' partials), so the block's weights are read once, by P programs side by side, and what else reaches
HBM is P · M · d float32 partials. The sum over hidden runs in another order than a GEMM's: the same value up to
float32 rounding before the output's rounding to its dtype.

Layouts of the gate/up weights: [d, 2·hidden] as ``SwiGLU.gate_proj`` stores them (gate columns, then up; each
program reads block_h columns of every row: strided), or [2, hidden, d] (``transposed``: each hidden unit's d
weights contiguous; a copy made once before a decode loop). The down projection is [hidden, d] as stored (each
program's rows contiguous).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fox_jax.kernels.decode_attention import MIN_BLOCK, _pow2_at_least

MAX_ROWS = 64  # a decode step's rows: one [Mp ≤ 64, ·] tile per matmul


@dataclasses.dataclass(frozen=True)
class MlpConfig:
    """The kernel's tiling (hashable: static). block_h: hidden units per program (the grid is hidden / block_h
    programs, each writing one float32 partial of the output); block_k: the d chunk of the gate/up loop; block_n:
    output columns per chunk of the down projection; all powers of two ≥ 16. num_warps / num_stages: Triton's."""

    block_h: int = 32
    block_k: int = 256
    block_n: int = 256
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_h", "block_k", "block_n"):
            v = getattr(self, name)
            if v < MIN_BLOCK or v & (v - 1):
                raise ValueError(f"MlpConfig.{name} must be a power of two ≥ {MIN_BLOCK}, got {v}")


def default_mlp_config(d: int, hidden: int) -> MlpConfig | None:
    """The tiling for d_model ``d`` and ``hidden`` units, or None where none fits (d not a multiple of 16, hidden
    not of 16): block_k and block_n the largest powers of two ≤ 256 dividing d, block_h the largest ≤ 32 dividing
    hidden (the best of 20 tilings at FoX (Pro) 125M on an H100, 2026-12-06: block_h 32, block_k 256, 4 warps;
    benchmarks/results/decode/decode_mlp_stack_h100_1206.json)."""
    def largest(n: int, at_most: int) -> int | None:
        b = at_most
        while b >= MIN_BLOCK and n % b:
            b //= 2
        return b if b >= MIN_BLOCK else None

    bk, bn, bh = largest(d, 256), largest(d, 256), largest(hidden, 32)
    if None in (bk, bn, bh):
        return None
    return MlpConfig(block_h=bh, block_k=bk, block_n=bn)


def fits(config: MlpConfig, m: int, d: int, hidden: int) -> str | None:
    """None when ``config`` tiles M rows, d and hidden, else what does not (for an error message)."""
    if not 1 <= m <= MAX_ROWS:
        return f"1 ≤ M ≤ {MAX_ROWS} rows (got {m})"
    for dim, n, block in (("d", d, "block_k"), ("d", d, "block_n"), ("hidden", hidden, "block_h")):
        if n % getattr(config, block):
            return f"{dim} = {n} a multiple of {block} = {getattr(config, block)}"
    return None


def _kernel(x_ref, s_ref, wgu_ref, wd_ref, o_ref, *, m: int, m_pad: int, d: int, hidden: int, eps: float,
            transposed: bool, cfg: MlpConfig):
    bk, bh, bn = cfg.block_k, cfg.block_h, cfg.block_n
    f32, dt = jnp.float32, wd_ref.dtype
    prec = lax.Precision.HIGHEST if dt == jnp.float32 else None  # float32: IEEE dots (Triton's default is TF32)
    row_ok = lax.broadcasted_iota(jnp.int32, (m_pad, 1), 0) < m
    h0 = pl.multiple_of(pl.program_id(0) * bh, bh)

    def x_chunk(i):  # [Mp, bk] float32 (rows ≥ M read as 0)
        k0 = pl.multiple_of(i * bk, bk)
        return pltriton.load(x_ref.at[:, pl.ds(k0, bk)], mask=row_ok, other=0.0).astype(f32)

    # r first, as the model's norm: the rows are normalised before the matmul (summing x² inside the gate/up loop
    # and scaling the sums by r instead was slower on an H100, 14.8 against 11.4 µs per layer: benchmarks/NOTES.md)
    sq = lax.fori_loop(0, d // bk, lambda i, acc: acc + jnp.sum(x_chunk(i) * x_chunk(i), axis=1),
                       jnp.zeros((m_pad,), f32))
    r = lax.rsqrt(sq / d + eps)

    def gate_up(i, accs):
        k0 = pl.multiple_of(i * bk, bk)
        xc = x_chunk(i)
        xn = (xc * r[:, None] * s_ref[pl.ds(k0, bk)][None, :]).astype(dt)
        if transposed:  # [2, hidden, d]
            wg = wgu_ref[0, pl.ds(h0, bh), pl.ds(k0, bk)].T
            wu = wgu_ref[1, pl.ds(h0, bh), pl.ds(k0, bk)].T
        else:  # [d, 2·hidden]
            wg = wgu_ref[pl.ds(k0, bk), pl.ds(h0, bh)]
            wu = wgu_ref[pl.ds(k0, bk), pl.ds(hidden + h0, bh)]
        return (accs[0] + jnp.dot(xn, wg, precision=prec, preferred_element_type=f32),
                accs[1] + jnp.dot(xn, wu, precision=prec, preferred_element_type=f32))

    zero = jnp.zeros((m_pad, bh), f32)
    g, u = lax.fori_loop(0, d // bk, gate_up, (zero, zero))
    g, u = g.astype(dt).astype(f32), u.astype(dt).astype(f32)
    act = (g * jax.nn.sigmoid(g)).astype(dt).astype(f32)
    hid = (act * u).astype(dt)  # [Mp, bh]

    def down(i, carry):
        n0 = pl.multiple_of(i * bn, bn)
        part = jnp.dot(hid, wd_ref[pl.ds(h0, bh), pl.ds(n0, bn)], precision=prec, preferred_element_type=f32)
        pltriton.store(o_ref.at[:, pl.ds(n0, bn)], part, mask=row_ok)
        return carry

    lax.fori_loop(0, d // bn, down, 0)


def swiglu_partials(x, norm_scale, w_gate_up, w_down, *, eps: float, config: MlpConfig,
                    interpret: bool) -> jax.Array:
    """The kernel (shapes unchecked: ``fox_jax.ops.decode_mlp`` checks them).

    Args:
      x: [M, d] the block's residual rows (any float dtype; the norm runs in float32), M ≤ ``MAX_ROWS``.
      norm_scale: [d] the RMSNorm's scale (float32).
      w_gate_up: [d, 2·hidden] (gate columns, then up) or [2, hidden, d]; w_down: [hidden, d]; the same dtype,
        which the matmuls run in (float32: IEEE-exact dots).
      eps: the RMSNorm's eps. config: tiling that ``fits`` these shapes. interpret: interpret mode (CPU).
    Returns:
      [hidden / block_h, M, d] float32 partials; their sum over axis 0 is
      down(silu(x̂·W_gate) ⊙ (x̂·W_up)) with x̂ = RMSNorm(x)·s.
    """
    m, d = x.shape
    hidden = w_down.shape[0]
    m_pad = _pow2_at_least(m, MIN_BLOCK)
    p = hidden // config.block_h
    kernel = functools.partial(_kernel, m=m, m_pad=m_pad, d=d, hidden=hidden, eps=float(eps),
                               transposed=w_gate_up.ndim == 3, cfg=config)
    return pl.pallas_call(
        kernel,
        grid=(p,),
        # x and each partial as a block of Mp ≥ M rows (rows ≥ M masked: no padding copy); the weights whole (each
        # program offsets its own hidden slice)
        in_specs=[pl.BlockSpec((m_pad, d), lambda j: (0, 0)), pl.no_block_spec, pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.BlockSpec((None, m_pad, d), lambda j: (j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((p, m, d), jnp.float32),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=config.num_warps,
                                                                      num_stages=config.num_stages),
        interpret=interpret,
        name="fox_decode_swiglu",
    )(x, norm_scale.astype(jnp.float32), w_gate_up, w_down)


__all__ = ["MAX_ROWS", "MlpConfig", "default_mlp_config", "fits", "swiglu_partials"]
