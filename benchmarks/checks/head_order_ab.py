"""ACP's grid with the heads in decreasing work (``head_order``, the default) against the heads in order, in one
process: fwd and fwd+bwd ms of the Mosaic kernels with ``adaptive_threshold="auto"`` on bench_attention's gates
(head h's gate logits centred on 6·h / (H − 1): the long-memory heads last, so in order their long tiles start last).
Each variant is timed twice, alternating (A B A B), and the rows keep both times; the two give the same output
bitwise (``tests/test_mosaic.py::test_gpu_mosaic_acp_heads_in_order_of_work``).

    python3 benchmarks/checks/head_order_ab.py --shapes 1x16384x16x128,1x16384x24x64 --out $OUT/head_order.json  # GPU
"""

from __future__ import annotations

import argparse
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


def timed(shape, repeats: int):
    """{variant: {"fwd": [ms, ...], "fwd_bwd": [ms, ...]}} for one (B, T, H, D)."""
    b, t, h, d = shape
    q, k, v, lf, do = make_inputs(b, t, h, d)
    order = mgpu.head_order
    out = {"by_work": {"fwd": [], "fwd_bwd": []}, "in_order": {"fwd": [], "fwd_bwd": []}}

    def f(q, k, v, lf):
        delta = acp_lib.resolve_threshold("auto", q, k, d ** -0.5)
        return fpallas.attention(q, k, v, decay_cumsum(lf), None, None, delta, scale=d ** -0.5, implementation="mosaic")

    def fb(q, k, v, lf, do):
        return jax.vjp(f, q, k, v, lf)[1](do)

    compiled = {}
    for variant in out:  # trace each variant with its head_order (jit traces once, at the first call)
        mgpu.head_order = order if variant == "by_work" else (lambda *a, **kw: None)
        compiled[variant] = (jax.jit(f), jax.jit(fb))
        compiled[variant][0](q, k, v, lf).block_until_ready()
        jax.block_until_ready(compiled[variant][1](q, k, v, lf, do))
    mgpu.head_order = order
    for _ in range(repeats):
        for variant, (jf, jfb) in compiled.items():
            out[variant]["fwd"].append(time_jax(jf, (q, k, v, lf)))
            out[variant]["fwd_bwd"].append(time_jax(jfb, (q, k, v, lf, do)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x16384x16x128,1x16384x24x64", help="BxTxHxD,... (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=2, help="timings per variant, alternating (default %(default)s)")
    ap.add_argument("--out", default="head_order.json", help="JSON output (default %(default)s)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be ≥ 1, got {args.repeats}")
    shapes = parse_shapes(args.shapes, "--shapes", ap.error)
    rows = []
    for shape in shapes:
        res = timed(shape, args.repeats)
        row = dict(zip("BTHD", shape), **{f"{v}_{m}_ms": [round(x, 4) for x in res[v][m]]
                                          for v in res for m in ("fwd", "fwd_bwd")})
        best = {f"{v}_{m}": min(res[v][m]) for v in res for m in ("fwd", "fwd_bwd")}
        row["fwd_bwd_change"] = round(best["by_work_fwd_bwd"] / best["in_order_fwd_bwd"] - 1, 4)
        print(f"B{shape[0]} T{shape[1]} H{shape[2]} D{shape[3]} ACP: fwd {best['in_order_fwd']:.3f} → "
              f"{best['by_work_fwd']:.3f} ms, fwd+bwd {best['in_order_fwd_bwd']:.3f} → "
              f"{best['by_work_fwd_bwd']:.3f} ms (heads in order → by work; {row['fwd_bwd_change']:+.1%})", flush=True)
        rows.append(row)
        with open(args.out, "w") as fh:
            json.dump(dict(versions=versions(), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
