"""The KV-shift backward alone, in variants, at one layer's shape: before 2026-12-06 the largest non-GEMM kernel of the
760M FoX (Pro) training step (0.59 ms per layer on an H100 for ~0.35 GB of operands, ~0.1 ms at the card's
bandwidth; benchmarks/NOTES.md, issue 22 of the project's tracker).

The step's fusion takes both shifted tensors (k with a float32 cotangent from the QK-norm's backward, v with a
bf16 one) and writes dk̃, dṽ (bf16) and dα_k, dα_v (float32 row sums over D). Variants, each checked against
``current`` and a float32 oracle before it is timed:

* ``current``: ``fox_jax.ops.head_ops.kv_shift`` as it is: x̃ and x̃_{t−1} materialised behind
  ``lax.optimization_barrier`` s in the backward, the row sums fed from behind them, and the forward's output behind
  a barrier too, so XLA puts no shifted read into a multi-output reduction (in the whole step it otherwise moves
  them into the recomputed k_norm's reduction: ``checks/train_kernels.py --ptx``).
* ``fused``: the written-out backward of d145d47 to 2026-12-06 (one pass over the cotangent, no barriers). XLA
  compiles it to one multi-output reduction that keeps 256–384 B of local memory per thread and loads the shifted
  operands 16 bits at a time: on an H100 1.03 ms against ``current``'s 0.29 at the 760M shape
  (``results/train/h100_kv_shift_1206.json``, where ``current`` was this form and ``split`` today's).
* ``autodiff``: the plain forward under autodiff (the tree before d145d47).

    PYTHONPATH=. python3 benchmarks/bench_kv_shift.py [--shape 1x16384x24x64] [--out kv_shift.json]

Inputs: k̃, ṽ bf16 [B, T, H, D], α float32 [B, T, H], one document boundary, cotangents g_k float32 and g_v bf16.
Prints, per variant, ms per backward of both tensors (median wall time of jitted calls), the floor of its bytes at
``--bandwidth``, and the largest difference |a − b| / (1 + |b|) from ``current`` and from a float32 oracle (plain
autodiff of the shift on float32 copies of the inputs; the rows also give it per output, ``err_vs_oracle``). The
measure is harsh on dα, a sum over D with cancellation: ``current`` rounds g_k to bf16 (JAX's cotangent of a bf16
output) before the row sum, which moves dα_k by up to ~7e-2 of it at the 760M shape (2⁻⁹ per term), while XLA on a
GPU keeps ``fused``'s g_k in float32; on the CPU both round. bf16 rounding of the outputs is ~1e-2; ``autodiff``
rounds twice. ``--out`` writes the rows as a JSON list.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

from fox_jax.ops import head_ops

from bench_attention import parse_shapes, time_jax  # a sibling script (benchmarks/ on sys.path)


def _plain(raw, alpha, state, boundary):
    a = alpha[..., None]
    prev = head_ops._previous(raw, state, boundary).astype(jnp.float32)
    return (a * prev + (1.0 - a) * raw.astype(jnp.float32)).astype(raw.dtype)


@jax.custom_vjp
def _fused(raw, alpha, state, boundary):
    return _plain(raw, alpha, state, boundary)


def _fused_fwd(raw, alpha, state, boundary):
    return _plain(raw, alpha, state, boundary), (raw, alpha, state, boundary)


def _fused_bwd(res, g):
    raw, alpha, state, boundary = res
    g = g.astype(jnp.float32)
    prev = head_ops._previous(raw, state, boundary).astype(jnp.float32)
    d_alpha = jnp.sum(g * (prev - raw.astype(jnp.float32)), axis=-1)
    a = alpha[..., None]
    g_prev = jnp.where(boundary[:, :, None, None], 0.0, a * g)
    d_raw = (1.0 - a) * g + jnp.concatenate([g_prev[:, 1:], jnp.zeros_like(g_prev[:, :1])], axis=1)
    return d_raw.astype(raw.dtype), d_alpha, g_prev[:, 0].astype(state.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)


VARIANTS = {"current": head_ops._shift_mix, "fused": _fused, "autodiff": _plain}
OUTPUTS = ("dk", "dalpha_k", "dv", "dalpha_v")


def _rel_diff(a, b) -> float:
    """max |a − b| / (1 + |b|) in float32."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b) / (1 + jnp.abs(b))))


def shift_fn(variant):
    fn = VARIANTS[variant]

    def shift(raw, alpha, boundary):
        return fn(raw, alpha, jnp.zeros_like(raw[:, 0]), boundary)
    return shift


def backward(variant):
    """(k̃, ṽ, α_k, α_v, boundary, g_k f32, g_v bf16) -> (dk̃, dṽ, dα_k, dα_v), as the step's fusion sees them."""
    shift = shift_fn(variant)

    def f(k, v, ak, av, boundary, gk, gv):
        _, vjp_k = jax.vjp(lambda x, a: shift(x, a, boundary).astype(jnp.float32), k, ak)
        _, vjp_v = jax.vjp(lambda x, a: shift(x, a, boundary), v, av)
        return (*vjp_k(gk), *vjp_v(gv))
    return jax.jit(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1x16384x24x64", help="BxTxHxD (default: the 760M layer, 1x16384x24x64)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="which to time (default: all)")
    ap.add_argument("--bandwidth", type=float, default=3.35e12,
                    help="bytes/s for the floor (default 3.35e12, an H100 SXM; an H200: 4.8e12)")
    ap.add_argument("--out", help="write the rows here as a JSON list")
    args = ap.parse_args(argv)
    (b, t, h, d), = parse_shapes(args.shape, "--shape", ap.error)
    if not args.bandwidth > 0:
        ap.error(f"--bandwidth: expected bytes/s > 0, got {args.bandwidth}")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"--out: the folder of {args.out!r} does not exist")
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    k = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
    v = jax.random.normal(keys[1], (b, t, h, d), jnp.bfloat16)
    ak = jax.nn.sigmoid(jax.random.normal(keys[2], (b, t, h)))
    av = jax.nn.sigmoid(jax.random.normal(keys[3], (b, t, h)))
    boundary = jnp.zeros((b, t), bool).at[:, t // 3].set(True)
    gk = jax.random.normal(keys[4], (b, t, h, d), jnp.float32)
    gv = jax.random.normal(keys[5], (b, t, h, d), jnp.bfloat16)
    inputs = (k, v, ak, av, boundary, gk, gv)
    n = b * t * h * d
    floor_bytes = n * (2 + 2 + 4 + 2) + n * (2 + 2)  # read k̃, ṽ, g_k, g_v; write dk̃, dṽ (the α rows are small)
    ref = backward("current")(*inputs)
    f32 = [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in inputs]
    oracle = backward("autodiff")(*f32)  # float32 throughout: no rounding but the inputs'
    rows = []
    for variant in args.variants:
        fn = backward(variant)
        out = fn(*inputs)
        err = max(_rel_diff(a, r) for a, r in zip(out, ref))
        vs_oracle = {name: _rel_diff(a, r) for name, a, r in zip(OUTPUTS, out, oracle)}
        ms = time_jax(fn, inputs)
        row = {"variant": variant, "shape": args.shape, "ms": ms, "floor_ms": 1e3 * floor_bytes / args.bandwidth,
               "max_rel_err_vs_current": err, "max_rel_err_vs_oracle": max(vs_oracle.values()),
               "err_vs_oracle": vs_oracle, "device": jax.devices()[0].device_kind, "jax": jax.__version__}
        rows.append(row)
        print(f"{variant:10s} {ms:8.4f} ms   floor {row['floor_ms']:.4f} ms   max rel diff from current {err:.1e}, "
              f"from the float32 oracle {row['max_rel_err_vs_oracle']:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
