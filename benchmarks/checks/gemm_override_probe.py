"""One decode-shaped GEMM chain timed under one Triton tiling forced through XLA's autotuner override file.

A probe for benchmarks/NOTES.md item 10: XLA's choice of tiles for the M = 8 GEMMs of a decode step, against
tilings forced one at a time (``--config BM,BN,BK,STAGES,WARPS`` writes a one-entry TritonGemmConfigsProto and
passes it as this program's ``xla_gpu_gemm_autotuner_override_file``; none: XLA's own choice). One process per
tiling (XLA's in-process autotune results are keyed by the fusion, not by the options). Prints one JSON line:
µs per GEMM and its row sum (wall time of a jitted chain of L of them, dispatch amortised) and the tile XLA compiled.

    python3 benchmarks/checks/gemm_override_probe.py --shape 8x768x3072 [--config 16,8,256,4,2]
"""
import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from profile_step import parse_hlo  # noqa: E402

from fox_jax.train.metrics import device_peak_bandwidth  # noqa: E402  (the bound's rate: the device's HBM peak)


def ints(sep: str, count: int, what: str):
    def parse(text: str):
        try:
            vals = tuple(int(v) for v in text.split(sep))
        except ValueError:
            vals = ()
        if len(vals) != count or min(vals) < 1:
            raise argparse.ArgumentTypeError(f"expected {what} ({count} positive integers joined by '{sep}'), got {text!r}")
        return vals
    return parse


p = argparse.ArgumentParser()
p.add_argument("--shape", default=(8, 768, 3072), type=ints("x", 3, "MxKxN"), help="MxKxN: x [M, K] @ W [K, N]")
p.add_argument("--config", default=None, type=ints(",", 5, "block_m,block_n,block_k,num_stages,num_warps"),
               help="block_m,block_n,block_k,num_stages,num_warps (block_m tiles W's columns, block_n x's rows)")
p.add_argument("--layers", type=int, default=24)
p.add_argument("--iters", type=int, default=200)
a = p.parse_args()
m, k, n = a.shape
opts = {}
if a.config:
    bm, bn, bk, st, w = a.config
    f = tempfile.NamedTemporaryFile("w", suffix=".txtpb", delete=False)
    f.write(f"config {{ block_m: {bm} block_n: {bn} block_k: {bk} num_stages: {st} num_warps: {w} num_ctas: 1 }}\n")
    f.close()
    opts["xla_gpu_gemm_autotuner_override_file"] = f.name
ws = [jax.random.normal(jax.random.PRNGKey(i), (k, n), jnp.bfloat16) for i in range(a.layers)]
x = jax.random.normal(jax.random.PRNGKey(99), (m, k), jnp.bfloat16)


def chain(x, ws):
    for w in ws:  # every output column feeds the next input (a row sum: no column of W can be sliced away)
        y = x @ w
        x = (x.astype(jnp.float32) + 1e-3 * y.astype(jnp.float32).sum(axis=1, keepdims=True)).astype(x.dtype)
    return x


t0 = time.perf_counter()
fn = jax.jit(chain).lower(x, ws).compile(compiler_options=opts)
compile_s = time.perf_counter() - t0
if opts:
    os.unlink(opts["xla_gpu_gemm_autotuner_override_file"])
tiles = sorted({i.tiling for i in parse_hlo(fn.as_text()).values() if i.tiling})  # what XLA compiled (profile_step)
for _ in range(5):
    fn(x, ws).block_until_ready()
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(a.iters):
        out = fn(x, ws)
    out.block_until_ready()
    best = min(best, (time.perf_counter() - t0) / a.iters / a.layers * 1e6)
kind = jax.devices()[0].device_kind
rate = device_peak_bandwidth()  # W's bytes at the HBM's rate (None off a known GPU)
print(json.dumps({"shape": "x".join(map(str, a.shape)), "config": ",".join(map(str, a.config or ())) or "xla",
                  "us_per_gemm": round(best, 3), "compile_s": round(compile_s, 1), "tiles": tiles,
                  "bound_us": rate and round(2 * k * n / rate * 1e6, 3), "device": kind}))
