"""Scheduling choices of the Mosaic kernels against the kernels as they are, in one process: fwd and fwd+bwd ms
with ``adaptive_threshold="auto"`` (or dense, ``--dense``) on bench_attention's gates (head h's gate logits centred
on 6·h / (H − 1): the long-memory heads last). Each variant is the kernels (``base``) with one choice changed, timed
alternating with ``base`` (A B A B); the rows keep every time. The scheduling variants give the same output bitwise
(the choices only move work in time); ``fused_dq`` changes dQ's summation order, ``plain_step`` dlog f's and
dS's rounding, ``plain_delta`` dS's rounding, ``forward_3wg`` under ACP the blocks skipped.

Variants:
  heads_in_order    the grid runs the heads in order, not in decreasing work (``head_order`` → None)
  exit_after_reads  each CTA exits once its output stores have read shared memory, without waiting for the writes
                    to reach memory (``plgpu.wait_smem_to_gmem(0, wait_read_only=True)`` at the kernels' ends, as
                    jax's Hopper matmul does)
  dkv_regs_232      the dK/dV kernel's register budgets 232 / 40 at both head dims (``REGISTERS``; D128's default is
                    240 / 24, with which its loops spill nothing)
  dkv_regs_240      240 / 24 at both head dims (D64's default is 232 / 40)
  fused_dq          dQ from the dK/dV kernel, no dQ kernel (``MosaicConfig.bwd_fused_dq``; the default from 4096
                    query rows, at D128 since 2026-12-07 17:30, at D64 since 21:45), in the form the head dim's
                    ping-pong gives: at D128 column halves over both warpgroups' keys, at D64 each warpgroup's own
                    keys; not bitwise: dQ's float32 sums come in another order
  fused_dq_halves   the column-halves form (with the ping-pong) at either head dim (D64's fused form until 12-07)
  fused_dq_own_keys the own-keys form (without the ping-pong) at either head dim (at D128 it spills)
  dq_kernel         the dQ kernel (``bwd_fused_dq=False``; the default below 4096 query rows, and with jax 0.10)
  fused_dq_3stages  ``fused_dq`` with three backward stages where they fit in shared memory (D ≤ 64; at D128 the
                    same as ``fused_dq``)
  plain_step        the backward step before the lean one (``SUMS_BY_WGMMA`` and ``DELTA_IN_ACCUMULATOR`` off, on
                    since 2026-12-07 21:45): the two kernels' decay-gradient sums as float32 row sums of every
                    step's dS (the fused dQ sums by wgmma whatever the switch), and dP − Δ by a subtraction per
                    score; not bitwise: dlog f sums other values, dS rounds otherwise
  plain_delta       ``DELTA_IN_ACCUMULATOR`` alone off: dP − Δ by a subtraction per score (the halves form of the
                    fused dQ always subtracts: there the same kernels)
  forward_3wg       the forward with three compute warpgroups (``MosaicConfig.forward_wgs`` = 3: 192-row tiles,
                    turns in rotation, ``FORWARD3_TURNS``) at head dim 64 (D128 as it is: it does not fit there);
                    dense outputs bitwise the same, under ACP the tiles' ranges span 192 rows
  forward_3wg_no_turns  the same without turns (the form timed on 2026-12-08, B4 T4096 H32 on an H100: forward +7%
                    dense, +16% ACP)

    python3 benchmarks/checks/mosaic_ab.py --shapes 1x16384x16x128,1x16384x24x64 --out $OUT/mosaic_ab.json  # GPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_attention import make_inputs, parse_shapes, time_jax, versions  # noqa: E402

from fox_jax.kernels import forgetting_attention_mgpu as mgpu  # noqa: E402
from fox_jax.ops import acp as acp_lib  # noqa: E402
from fox_jax.ops import pallas as fpallas  # noqa: E402
from fox_jax.ops.reference import decay_cumsum  # noqa: E402


class _ReadOnlyWaits:
    """``plgpu`` whose ``wait_smem_to_gmem`` waits for the reads only (the variant ``exit_after_reads``)."""

    def __init__(self, plgpu):
        self._plgpu = plgpu

    def __getattr__(self, name):
        return getattr(self._plgpu, name)

    def wait_smem_to_gmem(self, n, wait_read_only=False):  # noqa: ARG002
        return self._plgpu.wait_smem_to_gmem(n, wait_read_only=True)


def _dq_from(backward, fused: bool = True, stages: int | None = None, pingpong: bool | None = None):
    """``mosaic_backward`` with ``MosaicConfig.bwd_fused_dq`` = ``fused`` (with ``stages`` backward stages where
    they fit; ``pingpong``: the fused form's ``bwd_pingpong``, None: the config's)."""
    def run(*args, config, **kwargs):
        if not fused:
            return backward(*args, config=dataclasses.replace(config, bwd_fused_dq=False), **kwargs)
        fused_config = dataclasses.replace(config, bwd_fused_dq=True, bwd_pingpong=(
            config.bwd_pingpong if pingpong is None else pingpong))
        deeper = dataclasses.replace(fused_config, bwd_stages=stages or fused_config.bwd_stages)
        d_pad = -(-args[0].shape[-1] // 64) * 64  # the kernels pad the head dim to 64s
        config = deeper if mgpu.smem_bytes(deeper, d_pad) <= mgpu.SMEM_LIMIT else fused_config
        return backward(*args, config=config, **kwargs)
    return run


def _forward_wgs(wgs: int):
    """``default_mosaic_config`` with ``forward_wgs`` = ``wgs`` at head dim 64 (D128 as it is)."""
    def patch(original):
        def config(head_dim, q_len=None):
            chosen = original(head_dim, q_len)
            return dataclasses.replace(chosen, forward_wgs=wgs) if head_dim == 64 else chosen
        return config
    return patch


def _registers(**budgets):
    """``REGISTERS`` with each named kernel's budget the same at both head dims."""
    return lambda original: dict(original, **{kernel: {64: b, 128: b} for kernel, b in budgets.items()})


PATCHES = {
    "heads_in_order": [("head_order", lambda original: (lambda *a, **kw: None))],
    "exit_after_reads": [("plgpu", _ReadOnlyWaits)],
    "dkv_regs_232": [("REGISTERS", _registers(dkv=(232, 40)))],
    "dkv_regs_240": [("REGISTERS", _registers(dkv=(240, 24)))],
    "fused_dq": [("mosaic_backward", _dq_from)],
    "fused_dq_3stages": [("mosaic_backward", lambda backward: _dq_from(backward, stages=3))],
    "fused_dq_halves": [("mosaic_backward", lambda backward: _dq_from(backward, pingpong=True))],
    "fused_dq_own_keys": [("mosaic_backward", lambda backward: _dq_from(backward, pingpong=False))],
    "dq_kernel": [("mosaic_backward", lambda backward: _dq_from(backward, fused=False))],
    "plain_step": [("SUMS_BY_WGMMA", lambda original: False), ("DELTA_IN_ACCUMULATOR", lambda original: False)],
    "plain_delta": [("DELTA_IN_ACCUMULATOR", lambda original: False)],
    "forward_3wg": [("default_mosaic_config", _forward_wgs(3))],
    "forward_3wg_no_turns": [("default_mosaic_config", _forward_wgs(3)), ("FORWARD3_TURNS", lambda original: False)],
}


@contextlib.contextmanager
def patched(variant: str):
    """The kernels' module with ``variant``'s choice while the block runs (``"base"``: as it is); jit traces the
    kernels at a function's first call, so call it inside. Restored on exit, also after an error."""
    if variant == "base":
        yield
        return
    originals = [(attr, getattr(mgpu, attr)) for attr, _ in PATCHES[variant]]
    try:
        for (attr, patch), (_, original) in zip(PATCHES[variant], originals):
            setattr(mgpu, attr, patch(original))
        yield
    finally:
        for attr, original in originals:
            setattr(mgpu, attr, original)


def functions(d: int, acp: bool):
    """The jitted forward (q, k, v, log_fgate) and fwd+bwd (…, do) at head dim ``d``: new function objects at
    every call, because jax caches a traced function by its identity — a second ``jax.jit`` of the same function
    would run the first variant's executable whatever the patch (the 12-07 runs of this script before 11:45 UTC
    timed the base against itself)."""
    def f(q, k, v, lf):
        delta = acp_lib.resolve_threshold("auto", q, k, d ** -0.5) if acp else None
        return fpallas.attention(q, k, v, decay_cumsum(lf), None, None, delta, scale=d ** -0.5, implementation="mosaic",
                                 interpret=False)

    def fb(q, k, v, lf, do):
        return jax.vjp(f, q, k, v, lf)[1](do)
    return jax.jit(f), jax.jit(fb)


def timed(shape, variants, acp: bool, repeats: int):
    """{variant: {"fwd": [ms, ...], "fwd_bwd": [ms, ...]}} for one (B, T, H, D), ``base`` first."""
    b, t, h, d = shape
    q, k, v, lf, do = make_inputs(b, t, h, d)
    compiled = {}
    for variant in ("base", *variants):  # each variant's functions trace (at their first call) under its patch
        with patched(variant):
            compiled[variant] = functions(d, acp)
            jax.block_until_ready(compiled[variant][0](q, k, v, lf))
            jax.block_until_ready(compiled[variant][1](q, k, v, lf, do))
    out = {variant: {"fwd": [], "fwd_bwd": []} for variant in compiled}
    for _ in range(repeats):
        for variant, (jf, jfb) in compiled.items():
            out[variant]["fwd"].append(time_jax(jf, (q, k, v, lf)))
            out[variant]["fwd_bwd"].append(time_jax(jfb, (q, k, v, lf, do)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x16384x16x128,1x16384x24x64", help="BxTxHxD,... (default %(default)s)")
    ap.add_argument("--variants", default=",".join(PATCHES), help="comma-separated, from: " + ", ".join(PATCHES))
    ap.add_argument("--dense", action="store_true", help="no ACP (default: adaptive_threshold='auto')")
    ap.add_argument("--repeats", type=int, default=2, help="timings per variant, alternating (default %(default)s)")
    ap.add_argument("--out", default="mosaic_ab.json", help="JSON output (default %(default)s)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be ≥ 1, got {args.repeats}")
    variants = [x for x in args.variants.split(",") if x]
    unknown = [x for x in variants if x not in PATCHES]
    if unknown or not variants:
        ap.error(f"--variants: expected names from {', '.join(PATCHES)}, got {args.variants!r}")
    shapes = parse_shapes(args.shapes, "--shapes", ap.error)
    rows = []
    for shape in shapes:
        res = timed(shape, variants, not args.dense, args.repeats)
        best = {(v, m): min(res[v][m]) for v in res for m in ("fwd", "fwd_bwd")}
        for variant in variants:
            row = dict(zip("BTHD", shape), acp=not args.dense, variant=variant,
                       **{f"{v}_{m}_ms": [round(x, 4) for x in res[v][m]] for v in ("base", variant)
                          for m in ("fwd", "fwd_bwd")})
            row["base_vs_variant_fwd_bwd"] = round(best["base", "fwd_bwd"] / best[variant, "fwd_bwd"] - 1, 4)
            slower = best[variant, "fwd_bwd"] / best["base", "fwd_bwd"] - 1
            base_times = res["base"]["fwd_bwd"]
            row["base_spread_fwd_bwd"] = round(max(base_times) / min(base_times) - 1, 4)  # the base against itself
            b_, t_, h_, d_ = shape
            print(f"B{b_} T{t_} H{h_} D{d_}{'' if args.dense else ' ACP'} {variant}: fwd {best[variant, 'fwd']:.3f} "
                  f"vs base {best['base', 'fwd']:.3f} ms, fwd+bwd {best[variant, 'fwd_bwd']:.3f} vs base "
                  f"{best['base', 'fwd_bwd']:.3f} ms ({slower:+.1%}: + is slower; the base's "
                  f"own timings {row['base_spread_fwd_bwd']:.1%} apart)", flush=True)
            rows.append(row)
        with open(args.out, "w") as fh:
            json.dump(dict(versions=versions(), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
