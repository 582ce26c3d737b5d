"""The decode step's norm + projection (+ activation): ``fox_jax.ops.norm_matmul``'s kernel against its XLA form.

At the decode shapes of FoX (Pro) 125M (B8: attention input projections q, k, v, o-gate after RMSNorm; the SwiGLU
projection) and GPT-2 124M (B32: c_attn after LayerNorm with biases; c_fc with GELU), each form runs as a chain of C
copies with distinct weights (≥ 256 MB in all: no copy stays in the 50 MB L2) inside one jitted program, traced with
``jax.profiler``: ``kernel_us`` is the GPU kernel time per copy from the trace (its kernels, plus the chain's
~1.2 µs add, the same in every form), ``wall_us`` the program's wall time per copy (launch gaps included). Forms:

* ``xla``            the op's XLA form, i.e. the modules' ops: the norm (one kernel), XLA's GEMM, the activation;
* ``BNxBKwWsS[f]``   the Pallas kernel with that ``MatmulConfig`` (block_n, block_k, num_warps, num_stages; ``f``:
                     ``fold_rms``), ``kernel`` its default.

Each form is checked against float32 before it is timed (2⁻⁶ of max |y|: bf16 rounding, here and there).

    python3 benchmarks/bench_norm_matmul.py --out $OUT/norm_matmul.json            # GPU, ~1 min
    python3 benchmarks/bench_norm_matmul.py --quick                                  # CPU: correctness only

Rows: ``{"shape", "m", "k", "widths", "norm", "activation", "form", "kernel_us", "wall_us", "kernels",
"weight_bytes", "bound_us", device, jax}``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import bound_bandwidth  # noqa: E402
from profile_step import trace_calls  # noqa: E402

from fox_jax.kernels.norm_matmul import MatmulConfig, default_matmul_config  # noqa: E402
from fox_jax.ops.norm_matmul import RowNorm, norm_matmul  # noqa: E402

# (name, M, K, widths, norm, activation, bias, x dtype)
SHAPES = [("fox_qkvo", 8, 768, (768, 768, 768, 768), "rms", None, False, jnp.bfloat16),
          ("fox_mlp", 8, 768, (3584,), "rms", "swiglu", False, jnp.bfloat16),
          ("gpt2_c_attn", 32, 768, (2304,), "layer", None, True, jnp.float32),
          ("gpt2_c_fc", 32, 768, (3072,), "layer", "gelu_tanh", True, jnp.float32)]
DEFAULT_FORMS = "xla,kernel,32x128w4s4f,32x256w4s3,64x128w4s3,16x128w2s4,32x128w8s4,32x64w4s4"


def parse_form(form: str) -> MatmulConfig | None:
    """None for ``xla`` / ``kernel``, else the ``MatmulConfig`` of ``BNxBKwWsS[f]``.

    Raises: ValueError naming ``--forms`` for anything else."""
    if form in ("xla", "kernel"):
        return None
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(f?)", form)
    if not m:
        raise ValueError(f"--forms: expected xla, kernel or BNxBKwWsS[f] (e.g. 32x128w4s4), got {form!r}")
    bn, bk, w, st, f = m.groups()
    return MatmulConfig(int(bn), int(bk), int(w), int(st), fold_rms=bool(f))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated (default: %(default)s)")
    ap.add_argument("--forms", default=DEFAULT_FORMS, help="comma-separated forms (default: %(default)s)")
    ap.add_argument("--mbytes", type=float, default=256.0, help="weights per chain, MB (default 256: past L2)")
    ap.add_argument("--iters", type=int, default=5, help="traced calls of each chain (default 5)")
    ap.add_argument("--out", default=None, help="JSON rows here (default: printed only)")
    ap.add_argument("--quick", action="store_true", help="CPU: interpret mode, small shapes, each form checked "
                    "against float32, nothing timed")
    a = ap.parse_args(argv)
    known = {s[0]: s for s in SHAPES}
    shapes = a.shapes.split(",")
    bad = [s for s in shapes if s not in known]
    if bad:
        ap.error(f"--shapes: unknown {', '.join(bad)} (expected names from {', '.join(known)})")
    forms = a.forms.split(",")
    try:
        configs = {f: parse_form(f) for f in forms}
    except ValueError as e:
        ap.error(str(e))
    bw = bound_bandwidth(None) * 1e12
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__)
    rng = np.random.default_rng(0)
    rows = []
    for shape in shapes:
        _, m, k, widths, kind, act, bias, xdt = known[shape]
        if a.quick:
            k, widths = 256, tuple(min(w, 128) for w in widths)
        wbytes = k * sum(widths) * 2
        copies = 2 if a.quick else max(2, int(a.mbytes * 1e6 // wbytes))
        ws = [[(jnp.asarray(rng.normal(size=(k, n)) / math.sqrt(k), jnp.bfloat16),
                jnp.asarray(rng.normal(size=n), jnp.float32) if bias else None) for n in widths] for _ in range(copies)]
        scale = jnp.asarray(1 + 0.2 * rng.normal(size=k), jnp.float32)
        nbias = jnp.asarray(0.1 * rng.normal(size=k), jnp.float32) if kind == "layer" else None
        x = jnp.asarray(rng.normal(size=(m, k)) * 2, xdt)

        def apply(xin, weights, form):
            impl = "xla" if form == "xla" else "pallas"
            return norm_matmul(RowNorm(xin, scale, nbias, kind, 1e-5, jnp.dtype(jnp.bfloat16)), weights, jnp.bfloat16,
                               activation=act, implementation=impl, config=configs[form])[0]

        want = np.asarray(norm_matmul(RowNorm(x, scale, nbias, kind, 1e-5, jnp.dtype(jnp.float32)), ws[0], jnp.float32,
                                      activation=act, implementation="xla")[0], np.float32)  # float32 throughout
        for form in forms:
            cfg = configs[form] or default_matmul_config(k, widths, act)
            cols = (widths[0] // 2,) if act == "swiglu" else widths
            if form != "xla" and (k % cfg.block_k or any(n % cfg.block_n for n in cols)):
                print(f"# {shape} {form}: skipped (K={k} or a width not a multiple of its tiling)", flush=True)
                continue

            def chain(x, ws, form=form):
                acc = x
                for weights in ws:
                    y = apply(acc, weights, form)
                    acc = x + (y[:, :1] * 1e-3).astype(x.dtype)
                return acc

            fn = jax.jit(chain)
            try:
                got = np.asarray(jax.jit(lambda x, w, form=form: apply(x, w, form))(x, ws[0]), np.float32)
                err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                if not err < 2 ** -6:
                    raise AssertionError(f"{shape} {form}: relative error {err:.3g} ≥ 2^-6 against float32")
                if a.quick:
                    print(f"{shape} {form}: ok ({err:.2g})", flush=True)
                    continue
                jax.block_until_ready(fn(x, ws))
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001 - a tiling Triton rejects: recorded, skipped
                print(f"# {shape} {form}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            events, walls = trace_calls(lambda: fn(x, ws), a.iters)
            by_name = collections.Counter()
            for e in events:
                by_name[e.name] += e.dur_us
            row = dict(shape=shape, m=m, k=k, widths=list(widths), norm=kind, activation=act, form=form,
                       config=None if form == "xla" else dataclasses.asdict(cfg), copies=copies,
                       kernel_us=sum(by_name.values()) / (a.iters * copies), wall_us=min(walls) * 1e6 / copies,
                       kernels=len(events) / (a.iters * copies), weight_bytes=wbytes, bound_us=wbytes / bw * 1e6,
                       top=[(kn[:60], round(us / (a.iters * copies), 3)) for kn, us in by_name.most_common(4)], **meta)
            rows.append(row)
            print(f"{shape:12s} {form:14s} kernel {row['kernel_us']:7.2f} µs  wall {row['wall_us']:7.2f} µs  "
                  f"bound {row['bound_us']:5.2f}  kernels/op {row['kernels']:.1f}  {row['top'][:3]}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
