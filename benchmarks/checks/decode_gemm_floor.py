"""How fast can a decode-step matmul be on this GPU? Kernel times of the decode GEMMs against their read floor.

A decode step multiplies M = 8 (FoX (Pro) 125M at B8) or M = 32 (GPT-2 at B32) rows by each weight matrix, so
its cost should be reading the weights. In the H200 profile of 2026-12-05 the four GEMMs of a FoX layer took
4.6 / 4.5 / 3.4 / 2.7 µs for 4.7 / 5.5 / 2.8 / 1.2 MB (≤ 30% of 4.8 TB/s): 0.18 ms of the 0.39 ms `acp` step. This
probe asks, per shape and in one process, how far each form is from the floor of reading the same bytes:

* ``xla_kn``   x @ W, W [K, N] bf16 as the models store it (XLA's GEMM: Triton or cuBLAS, autotuned);
* ``xla_nk``   the same product with the weight stored transposed, W^T [N, K] (a layout ``decode_variables``
               could prepare once per ``generate``), so that each output column is one contiguous row;
* ``floor``    a float32 row sum of W^T (a reduction kernel reading the same bytes: what one pass over the weight
               costs here, launch included);
* ``gemv_*``   a Pallas (Triton) GEMV over W^T: each program ``bn`` rows of W^T (contiguous) times x, streamed
               over K in ``bk`` chunks (a tiling sweep).

Each form runs as a chain of C copies of the matmul with distinct weights (≥ 256 MB in all: no copy stays in
the 50 MB L2) inside one jitted program, traced with ``jax.profiler``: ``kernel_us`` is the mean GPU kernel time per
matmul from the trace (no launch gaps), ``wall_us`` the program's wall time per matmul (gaps included). Rows are
checked against float32 before they are timed.

    python3 benchmarks/checks/decode_gemm_floor.py --out $OUT/gemm_floor.json         # GPU, ~2 min
    python3 benchmarks/checks/decode_gemm_floor.py --quick                              # CPU: correctness only

Rows: ``{"shape", "m", "k", "n", "form", "kernel_us", "wall_us", "kernels", "weight_bytes", "bound_us", device, jax}``;
``bound_us`` is the weight bytes at the device's peak bandwidth (4.8 TB/s H200, 3.35 TB/s H100).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_decode import bound_bandwidth  # noqa: E402
from profile_step import trace_calls  # noqa: E402

# tl.dot needs every matmul dimension ≥ 16 (x's rows are padded to it by masked loads): as the decode attention kernel
from fox_jax.kernels.decode_attention import MIN_BLOCK, _pow2_at_least  # noqa: E402

# (name, M, K, N): the decode GEMMs of FoX (Pro) 125M at B8 and GPT-2 124M at B32
SHAPES = [("fox_qkv", 8, 768, 3072), ("fox_mlp_in", 8, 768, 3584), ("fox_mlp_out", 8, 1792, 768),
          ("fox_o", 8, 768, 768), ("gpt2_qkv", 32, 768, 2304), ("gpt2_fc", 32, 768, 3072),
          ("gpt2_proj", 32, 3072, 768), ("head", 8, 768, 50304)]
TILINGS = [(16, 256, 4, 3), (32, 256, 4, 3), (16, 512, 4, 2), (32, 128, 4, 4), (64, 128, 4, 4), (16, 128, 2, 4)]


def gemv_nk(x, wt, *, bn: int, bk: int, warps: int, stages: int, interpret: bool):
    """y [M, N] = x [M, K] · W^T[N, K]ᵀ in x.dtype (float32 accumulation); N % bn == 0, K % bk == 0."""
    m, k = x.shape
    n = wt.shape[0]
    mp = _pow2_at_least(m, MIN_BLOCK)

    def kernel(x_ref, w_ref, o_ref):
        rows = lax.broadcasted_iota(jnp.int32, (mp, 1), 0) < m
        j = pl.program_id(0)

        def body(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            xc = pltriton.load(x_ref.at[:, pl.ds(k0, bk)], mask=rows, other=0.0)
            w = w_ref[pl.ds(pl.multiple_of(j * bn, bn), bn), pl.ds(k0, bk)]
            return acc + lax.dot_general(xc, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, k // bk, body, jnp.zeros((mp, bn), jnp.float32))
        pltriton.store(o_ref.at[:, pl.ds(pl.multiple_of(j * bn, bn), bn)], acc.astype(o_ref.dtype), mask=rows)

    full = lambda shape: pl.BlockSpec(shape, lambda j: (0, 0))  # noqa: E731
    return pl.pallas_call(
        kernel, grid=(n // bn,), in_specs=[full((mp, k)), pl.no_block_spec], out_specs=full((mp, n)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype), interpret=interpret, name="fox_decode_gemv",
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=stages),
    )(x, wt)


def forms(interpret: bool):
    out = {"xla_kn": lambda x, w, wt: x @ w,
           "xla_nk": lambda x, w, wt: lax.dot_general(x, wt, (((1,), (1,)), ((), ()))),
           "floor": lambda x, w, wt: jnp.sum(wt.astype(jnp.float32) * x[0, 0].astype(jnp.float32), axis=1)[None, :]}
    for bn, bk, warps, stages in TILINGS:
        out[f"gemv_{bn}x{bk}w{warps}s{stages}"] = functools.partial(
            lambda x, w, wt, **kw: gemv_nk(x, wt, **kw), bn=bn, bk=bk, warps=warps, stages=stages,
            interpret=interpret)
    return out


def chain(form, x, ws, wts):
    """Every copy's product, each fed by the previous one's first element (nothing hoisted or merged)."""
    acc = x
    for w, wt in zip(ws, wts):
        y = form(acc, w, wt)
        acc = x + (y[:, :1] * 1e-3).astype(x.dtype)
    return acc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                    help="comma-separated names of SHAPES (default: all: %(default)s)")
    ap.add_argument("--forms", default=None, help="comma-separated forms: xla_kn, xla_nk, floor, gemv_BNxBKwWsS "
                    "(default: all; the gemv tilings are TILINGS)")
    ap.add_argument("--mbytes", type=float, default=256.0, help="weights per chain, MB (default 256: past L2)")
    ap.add_argument("--iters", type=int, default=5, help="traced calls of each chain (default 5)")
    ap.add_argument("--out", default=None, help="JSON rows here (default: printed only)")
    ap.add_argument("--quick", action="store_true", help="CPU: interpret mode, each form checked against float32 on "
                    "one small copy, nothing timed (floor is not a product: listed, not checked)")
    a = ap.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    dtype = jnp.bfloat16
    all_forms = forms(interpret)
    names = a.forms.split(",") if a.forms else list(all_forms)
    known = {s[0] for s in SHAPES}
    for flag, given, valid in (("--shapes", a.shapes.split(","), known), ("--forms", names, set(all_forms))):
        bad = [x for x in given if x not in valid]
        if bad:
            ap.error(f"{flag}: unknown {', '.join(bad)} (expected names from {', '.join(sorted(valid))})")
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__)
    bw = bound_bandwidth(None) * 1e12  # the device's HBM peak (4.8 TB/s where unknown)
    rows = []
    rng = np.random.default_rng(0)
    for shape in a.shapes.split(","):
        name, m, k, n = next(s for s in SHAPES if s[0] == shape)
        if a.quick:
            k, n = min(k, 256), min(n, 256)
        wbytes = k * n * 2
        copies = 2 if a.quick else max(2, int(a.mbytes * 1e6 // wbytes))
        ws = [jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), dtype) for _ in range(copies)]
        wts = [jnp.asarray(np.asarray(w, np.float32).T, dtype) for w in ws]
        x = jnp.asarray(rng.normal(size=(m, k)), dtype)
        want = np.asarray(x, np.float32) @ np.asarray(ws[0], np.float32)
        for fname in names:
            form = all_forms[fname]
            if fname.startswith("gemv"):
                bn, bk = (int(v) for v in fname[5:].split("w")[0].split("x"))
                if n % bn or k % bk:
                    print(f"# {shape} {fname}: skipped (N={n} or K={k} not a multiple of its tiling)", flush=True)
                    continue
            fn = jax.jit(lambda x, ws, wts, form=form: chain(form, x, ws, wts))
            try:  # a wrong kernel could be fast: each form must give the product (bf16 rounding: 2^-7)
                if fname != "floor":
                    got = np.asarray(form(x, ws[0], wts[0]), np.float32)
                    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                    if not err < 2 ** -7:
                        raise AssertionError(f"{shape} {fname}: relative error {err:.3g} ≥ 2^-7 against float32")
                if a.quick:
                    print(f"{shape} {fname}: {'ok' if fname != 'floor' else 'not a product (unchecked)'}",
                          flush=True)
                    continue
                jax.block_until_ready(fn(x, ws, wts))
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001 - a tiling Triton rejects: recorded, skipped
                print(f"# {shape} {fname}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            events, walls, _ = trace_calls(lambda: fn(x, ws, wts), a.iters)
            by_name = collections.Counter()
            for e in events:
                by_name[e.name] += e.dur_us
            total = sum(by_name.values())
            row = dict(shape=shape, m=m, k=k, n=n, form=fname, copies=copies,
                       kernel_us=total / (a.iters * copies), wall_us=min(walls) * 1e6 / copies,
                       kernels=len(events) / (a.iters * copies), weight_bytes=wbytes, bound_us=wbytes / bw * 1e6,
                       top=[(kn[:60], round(us / (a.iters * copies), 3)) for kn, us in by_name.most_common(3)],
                       **meta)
            rows.append(row)
            print(f"{shape:12s} {fname:18s} kernel {row['kernel_us']:7.2f} µs  wall {row['wall_us']:7.2f} µs  "
                  f"bound {row['bound_us']:5.2f}  kernels/op {row['kernels']:.1f}  {row['top'][:2]}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
