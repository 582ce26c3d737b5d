"""Where one attention fwd+bwd's time goes, kernel by kernel (a ``jax.profiler`` trace of bench_attention's jitted
fwd+bwd): the Mosaic / Triton kernels against the XLA work around them (Λ's cumsum and its transposes, the
padding, δ, ACP's tile ranges, the backward's row terms and GQA sums). The question it answers (issue 22): how much
of ``mosaic-acp``'s time at 16k is outside the kernels' pruned work.

    python3 benchmarks/checks/attention_trace.py --shapes 1x16384x16x128,1x16384x24x64 --impls mosaic,mosaic-acp \\
        --out $OUT/attention_trace.json                                   # GPU, ~1 min

Rows: ``{"shape", "impl", "ms", "kernels": [[name, ms per call, count per call], ...]}``, ms from the trace (the
kernels' sum: gaps between kernels not included).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_attention import jax_fns, make_inputs, parse_shapes  # noqa: E402
from profile_step import trace_calls  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x16384x16x128,1x16384x24x64", help="BxTxHxD,... (default %(default)s)")
    ap.add_argument("--impls", default="mosaic,mosaic-acp",
                    help="bench_attention.py's JAX implementations, e.g. cudnn,mosaic,mosaic-acp (default %(default)s)")
    ap.add_argument("--iters", type=int, default=5, help="traced fwd+bwd calls (default 5)")
    ap.add_argument("--top", type=int, default=12, help="kernels printed per row (default 12; the JSON has all)")
    ap.add_argument("--out", default=None, help="JSON rows here (default: printed only)")
    a = ap.parse_args(argv)
    rows = []
    for b, t, h, d in parse_shapes(a.shapes, "--shapes", ap.error):
        q, k, v, lf, do = make_inputs(b, t, h, d)
        for impl in a.impls.split(","):
            _, fwd_bwd = jax_fns(impl, d, t=t)
            args = (q, k, v, lf, do)
            jax.block_until_ready(fwd_bwd(*args))
            events, _, _ = trace_calls(lambda: fwd_bwd(*args), a.iters)
            us, n = collections.Counter(), collections.Counter()
            for e in events:
                us[e.name] += e.dur_us
                n[e.name] += 1
            total = sum(us.values()) / a.iters / 1e3
            kernels = [[name[:80], u / a.iters / 1e3, n[name] / a.iters] for name, u in us.most_common()]
            rows.append(dict(shape=f"{b}x{t}x{h}x{d}", impl=impl, ms=total, kernels=kernels,
                             device=jax.devices()[0].device_kind, jax=jax.__version__))
            print(f"{rows[-1]['shape']} {impl}: {total:.3f} ms of kernels per fwd+bwd, "
                  f"{len(events) / a.iters:.0f} kernels")
            for name, ms, cnt in kernels[:a.top]:
                print(f"   {ms:8.4f} ms  x{cnt:<4.0f} {name}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
