"""A decode step's MLP block as one Pallas kernel: norm → input projection → activation → down projection.

Two blocks (``BLOCKS``): "swiglu", RMSNorm → gate/up → silu(gate) ⊙ up → down (FoX, LLaMA), and "gelu", LayerNorm
→ c_fc + bias → GELU (tanh approximation) → c_proj (GPT-2; the down projection's bias is added by the caller).
One ``pl.pallas_call`` written against the Triton lowering on GPU and run with ``interpret=True`` elsewhere.
Imports nothing from ``fox_jax`` but the decode attention kernel's block constants: arrays in, arrays out. The
public ops are in ``fox_jax.ops.decode_mlp`` (checks, dispatch, the XLA paths).

Why: a decode step multiplies M ≤ 64 rows by each weight matrix, and at that size every XLA kernel costs a
floor of ~2–3 µs whatever it reads (benchmarks/NOTES.md, "Decode GEMMs against their floor"). XLA runs this block
as four of them (the norm, the input GEMM, the activation, the down GEMM with its split-K partials) and the
residual add as a fifth. Here it is one launch, split over the hidden axis: program j of P = hidden / block_h

1. takes its M rows' statistics (a few KB of x, read by every program: no cross-program reduction): r =
   rsqrt(mean(x²) + eps), or for LayerNorm the mean and r of the centred rows,
2. multiplies the normed rows (rounded to the weights' dtype, as the model's norm output) by its block_h columns of
   the input projection (gate and up for SwiGLU), streamed over d in chunks of block_k (float32 accumulation),
3. applies the activation to its block_h hidden units, rounding to the weights' dtype where the model's GEMM
   output and bias add are,
4. multiplies that [M, block_h] by its block_h rows of the down projection, block_n output columns at a time,
   and writes a float32 partial [M, d].

With ``MlpConfig.unroll`` the three loops are straight-line code whose loads (x, every weight chunk of the program)
are all issued before the first multiply: one memory round trip per program instead of a chain of them.

The caller sums the P partials; XLA fuses that sum with what follows, so the block's weights are read once, by P
programs side by side, and what else reaches memory is P · M · d float32 partials. The sum over hidden runs in
another order than a GEMM's: the same value up to float32 rounding before the output's rounding to its dtype.

Layouts of SwiGLU's gate/up weights: [d, 2·hidden] as ``SwiGLU.gate_proj`` stores them (gate columns, then up; each
program reads block_h columns of every row: strided), or [2, hidden, d] (``transposed``: each hidden unit's d
weights contiguous; a copy made once before a decode loop). GELU's c_fc is [d, hidden] as stored. The down
projection is [hidden, d] as stored (each program's rows contiguous).
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
    # the norm's statistics summed in the gate/up loop and r applied to the sums (x·s rounded instead of r·x·s; one
    # dependent round of loads fewer): an experiment for the next device session, off
    one_pass: bool = False
    # straight-line code instead of the three loops, every load (x, the scale, all gate/up and down chunks) issued
    # before the first multiply: one memory round trip per program instead of a chain of them, for the registers of
    # a program's whole weight slice (block_h · 3 · d values); num_stages does not apply. An experiment, off
    unroll: bool = False

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


BLOCKS = ("swiglu", "gelu")  # the MLP blocks the kernel runs (``_kernel``'s ``block``)


def _kernel(*refs, names: tuple, m: int, m_pad: int, d: int, hidden: int, eps: float, transposed: bool,
            block: str, cfg: MlpConfig):
    """One program: hidden units h0 … h0 + block_h of the block, its float32 partial [Mp, d] of the output.

    ``block`` "swiglu": RMSNorm (scale s), gate/up without biases, silu(gate) ⊙ up (FoX, LLaMA); "gelu": LayerNorm
    (scale s, bias ``norm_bias``), the up projection with its bias ``b_in``, GELU with the tanh approximation (GPT-2's
    ``c_fc``, "gelu_new"). The down projection's bias, if any, is the caller's (added once, not per partial)."""
    r = dict(zip(names, refs))
    x_ref, w_ref, wd_ref, o_ref = r["x"], r["w_in"], r["w_down"], r["out"]
    bk, bh, bn = cfg.block_k, cfg.block_h, cfg.block_n
    f32, dt = jnp.float32, wd_ref.dtype
    prec = lax.Precision.HIGHEST if dt == jnp.float32 else None  # float32: IEEE dots (Triton's default is TF32)
    row_ok = lax.broadcasted_iota(jnp.int32, (m_pad, 1), 0) < m
    h0 = pl.multiple_of(pl.program_id(0) * bh, bh)
    gated = block == "swiglu"

    def x_chunk(k0):  # [Mp, bk] float32 of columns k0 … k0 + bk (rows ≥ M read as 0)
        return pltriton.load(x_ref.at[:, pl.ds(k0, bk)], mask=row_ok, other=0.0).astype(f32)

    def weights(k0):  # the input projection's chunks [bk, bh] of d rows k0 … k0 + bk: (gate, up) or (up,)
        if not gated:  # [d, hidden]
            return (w_ref[pl.ds(k0, bk), pl.ds(h0, bh)],)
        if transposed:  # [2, hidden, d]
            return (w_ref[0, pl.ds(h0, bh), pl.ds(k0, bk)].T, w_ref[1, pl.ds(h0, bh), pl.ds(k0, bk)].T)
        return w_ref[pl.ds(k0, bk), pl.ds(h0, bh)], w_ref[pl.ds(k0, bk), pl.ds(hidden + h0, bh)]  # [d, 2·hidden]

    def normed(xc, k0, mean, row_scale):  # the norm's output chunk in the weights' dtype, as the model rounds it
        y = (xc - mean) * row_scale * r["norm_scale"][pl.ds(k0, bk)][None, :]
        return (y if gated else y + r["norm_bias"][pl.ds(k0, bk)][None, :]).astype(dt)

    def activation(accs, sq):  # the input projection's sums [Mp, bh] each → the hidden activations [Mp, bh] in dt
        rounded = lambda v: v.astype(dt).astype(f32)  # noqa: E731  (the GEMM's output dtype, as the model's)
        if not gated:
            u = rounded(rounded(accs[0]) + rounded(r["b_in"][pl.ds(h0, bh)][None, :]))  # Dense: x·W, + b in dt
            return jax.nn.gelu(u, approximate=True).astype(dt)
        g, u = accs
        if cfg.one_pass:
            row_scale = lax.rsqrt(sq / d + eps)[:, None]
            g, u = g * row_scale, u * row_scale
        g, u = rounded(g), rounded(u)
        return (rounded(g * jax.nn.sigmoid(g)) * u).astype(dt)

    def dot(a, b):
        return jnp.dot(a, b, precision=prec, preferred_element_type=f32)

    def store(n0, part):
        pltriton.store(o_ref.at[:, pl.ds(n0, bn)], part, mask=row_ok)

    def stats(sx, sq):  # (mean, r) from the rows' sum and sum of (centred, for LayerNorm) squares
        return (sx / d)[:, None] if not gated else 0.0, lax.rsqrt(sq / d + eps)[:, None]

    zeros_m = jnp.zeros((m_pad,), f32)
    zero = jnp.zeros((m_pad, bh), f32)
    n_acc = 2 if gated else 1
    if cfg.unroll:  # every load first, then the arithmetic in the loops' order (the same sums, the same roundings)
        ks, ns = range(0, d, bk), range(0, d, bn)
        xs = [x_chunk(k0) for k0 in ks]
        ws = [weights(k0) for k0 in ks]
        wds = [wd_ref[pl.ds(h0, bh), pl.ds(n0, bn)] for n0 in ns]
        mean = 0.0
        if not gated:
            mean, _ = stats(sum((jnp.sum(xc, axis=1) for xc in xs), zeros_m), zeros_m)
        sq = sum((jnp.sum((xc - mean) * (xc - mean), axis=1) for xc in xs), zeros_m)
        _, row_scale = stats(zeros_m, sq)
        if cfg.one_pass:
            row_scale = 1.0
        accs = (zero,) * n_acc
        for k0, xc, wc in zip(ks, xs, ws):
            xn = normed(xc, k0, mean, row_scale)
            accs = tuple(a + dot(xn, w) for a, w in zip(accs, wc))
        hid = activation(accs, sq)
        for n0, wd in zip(ns, wds):
            store(n0, dot(hid, wd))
        return

    def chunk_sum(fn):  # Σ over d of fn(x chunk) [Mp]
        return lax.fori_loop(0, d // bk, lambda i, acc: acc + fn(x_chunk(pl.multiple_of(i * bk, bk))), zeros_m)

    mean, row_scale = 0.0, 1.0
    if not gated:
        mean, _ = stats(chunk_sum(lambda xc: jnp.sum(xc, axis=1)), zeros_m)
    if not cfg.one_pass:  # the norm's statistics first, as the model's norm: rows normalised before the matmul
        _, row_scale = stats(zeros_m, chunk_sum(lambda xc: jnp.sum((xc - mean) * (xc - mean), axis=1)))

    def project(i, carry):
        accs, sq = carry
        k0 = pl.multiple_of(i * bk, bk)
        xc = x_chunk(k0)
        xn = normed(xc, k0, mean, row_scale)
        accs = tuple(a + dot(xn, w) for a, w in zip(accs, weights(k0)))
        return accs, sq + jnp.sum(xc * xc, axis=1) if cfg.one_pass else sq

    accs, sq = lax.fori_loop(0, d // bk, project, ((zero,) * n_acc, zeros_m))
    hid = activation(accs, sq)

    def down(i, carry):
        n0 = pl.multiple_of(i * bn, bn)
        store(n0, dot(hid, wd_ref[pl.ds(h0, bh), pl.ds(n0, bn)]))
        return carry

    lax.fori_loop(0, d // bn, down, 0)


def mlp_partials(x, norm_scale, w_in, w_down, *, eps: float, config: MlpConfig, interpret: bool,
                 block: str = "swiglu", norm_bias=None, b_in=None) -> jax.Array:
    """The kernel (shapes unchecked: ``fox_jax.ops.decode_mlp`` checks them).

    Args:
      x: [M, d] the block's residual rows (any float dtype; the norm runs in float32), M ≤ ``MAX_ROWS``.
      norm_scale: [d] the norm's scale (float32); norm_bias: [d] the LayerNorm's bias ("gelu"; float32).
      w_in: "swiglu": [d, 2·hidden] (gate columns, then up) or [2, hidden, d]; "gelu": [d, hidden] (``c_fc``).
      b_in: [hidden] the up projection's bias ("gelu"; float32). w_down: [hidden, d], w_in's dtype, which the
        matmuls run in (float32: IEEE-exact dots).
      eps: the norm's eps. config: tiling that ``fits`` these shapes. interpret: interpret mode (CPU).
      block: "swiglu" (RMSNorm, silu(gate) ⊙ up) or "gelu" (LayerNorm, GELU tanh).
    Returns:
      [hidden / block_h, M, d] float32 partials; their sum over axis 0 is down(silu(x̂·W_gate) ⊙ (x̂·W_up)) with
      x̂ = RMSNorm(x)·s ("swiglu"), or down(gelu(x̂·W_in + b_in)) with x̂ = LayerNorm(x)·s + b ("gelu"), without
      the down projection's bias.
    Raises:
      ValueError: an unknown block, or its inputs missing or extra; ``one_pass`` with "gelu".
    """
    if block not in BLOCKS:
        raise ValueError(f"mlp_partials: block must be one of {BLOCKS}, got {block!r}")
    gelu = block == "gelu"
    if (norm_bias is None or b_in is None) == gelu or (norm_bias is None) != (b_in is None):
        raise ValueError("mlp_partials: norm_bias and b_in are given with block='gelu' and only then")
    if gelu and config.one_pass:
        raise ValueError("mlp_partials: MlpConfig.one_pass is for the RMSNorm ('swiglu'), not LayerNorm")
    m, d = x.shape
    hidden = w_down.shape[0]
    m_pad = _pow2_at_least(m, MIN_BLOCK)
    p = hidden // config.block_h
    named = [("x", x), ("norm_scale", norm_scale.astype(jnp.float32))]
    if gelu:
        named.append(("norm_bias", norm_bias.astype(jnp.float32)))
    named += [("w_in", w_in), ("w_down", w_down)]
    if gelu:
        named.append(("b_in", b_in.astype(jnp.float32)))
    names = tuple(n for n, _ in named) + ("out",)
    kernel = functools.partial(_kernel, names=names, m=m, m_pad=m_pad, d=d, hidden=hidden, eps=float(eps),
                               transposed=w_in.ndim == 3, block=block, cfg=config)
    return pl.pallas_call(
        kernel,
        grid=(p,),
        # x and each partial as a block of Mp ≥ M rows (rows ≥ M masked: no padding copy); the rest whole (each
        # program offsets its own hidden slice)
        in_specs=[pl.BlockSpec((m_pad, d), lambda j: (0, 0))] + [pl.no_block_spec] * (len(named) - 1),
        out_specs=pl.BlockSpec((None, m_pad, d), lambda j: (j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((p, m, d), jnp.float32),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=config.num_warps,
                                                                      num_stages=config.num_stages),
        interpret=interpret,
        name=f"fox_decode_{block}",
    )(*(a for _, a in named))


def swiglu_partials(x, norm_scale, w_gate_up, w_down, *, eps: float, config: MlpConfig,
                    interpret: bool) -> jax.Array:
    """``mlp_partials`` of the SwiGLU block (RMSNorm, no biases)."""
    return mlp_partials(x, norm_scale, w_gate_up, w_down, eps=eps, config=config, interpret=interpret)


__all__ = ["BLOCKS", "MAX_ROWS", "MlpConfig", "default_mlp_config", "fits", "mlp_partials", "swiglu_partials"]
