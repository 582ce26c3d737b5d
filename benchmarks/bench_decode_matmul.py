"""Decode-step matmuls side by side: XLA (norm + dot + epilogue as the models write them) vs the fused Pallas
kernel (fox_jax.kernels.decode_matmul), on the shapes of a decode step.

Two measurements, each inside one jitted ``fori_loop`` (no dispatch in the timing):
* ``op``: one matmul R times in a chain (its output feeds the next input through a scalar, so nothing is
  hoisted), µs per call; the Pallas kernel over a small tiling sweep, the best kept;
* ``stack``: the non-attention part of L decode layers (pre-norm → QKV; o_proj + residual; pre-norm →
  gated or GELU MLP + residual), R steps, µs per layer, with the best tiling of each op.

    python3 benchmarks/bench_decode_matmul.py --out results/decode/decode_matmul_h200.json   # GPU
    python3 benchmarks/bench_decode_matmul.py --quick                                          # CPU smoke

Rows: ``{"model", "op", "m", "k", "n", "impl", "config", "us", "weight_bytes", "bound_us", ...}``; bound_us is
the weight bytes at 4.8 TB/s (H200).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from fox_jax.kernels.decode_matmul import MatmulConfig, default_matmul_config, fused_matmul

HBM_BYTES_PER_S = 4.8e12

# (model, M rows, d_model, QKV(+gates) width, MLP hidden, gated MLP)
MODELS = {
    "fox-pro-125M": (8, 768, 3072, 1792, True),  # q, k, v, output gate; SwiGLU 1792
    "gpt2-124M": (32, 768, 2304, 3072, False),   # q, k, v; GELU 3072
}


def _ops(model: str):
    m, d, qkv, hid, gated = MODELS[model]
    ops = {"qkv": dict(k=d, n=qkv, norm="rms" if gated else "layer"),
           "o_proj": dict(k=d, n=d, residual=True),
           "mlp_in": dict(k=d, n=hid, norm="rms" if gated else "layer", gated=gated,
                          activation="silu" if gated else "gelu_tanh"),
           "mlp_out": dict(k=hid, n=d, residual=True)}
    return m, ops


def _params(rng, k, n, spec, dtype):
    p = {"w": jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), dtype)}
    if spec.get("gated"):
        p["w2"] = jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), dtype)
    if spec.get("norm"):
        p["g"] = jnp.asarray(1 + 0.1 * rng.normal(size=(k,)), jnp.float32)
        if spec["norm"] == "layer":
            p["b"] = jnp.asarray(0.1 * rng.normal(size=(k,)), jnp.float32)
            p["bias"] = jnp.asarray(0.1 * rng.normal(size=(n,)), jnp.float32)
    return p


def xla_op(x, p, spec, r=None):
    """The op as the models write it (XLA fuses what it can)."""
    h = x.astype(jnp.float32)
    if spec.get("norm") == "rms":
        h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * p["g"]
    elif spec.get("norm") == "layer":
        mu = jnp.mean(h, -1, keepdims=True)
        h = (h - mu) * jax.lax.rsqrt(jnp.mean(jnp.square(h - mu), -1, keepdims=True) + 1e-5) * p["g"] + p["b"]
    h = h.astype(p["w"].dtype)
    y = (h @ p["w"]).astype(jnp.float32)
    if "bias" in p:
        y = y + p["bias"]
    act = spec.get("activation", "none")
    if act == "silu":
        y = jax.nn.silu(y)
    elif act == "gelu_tanh":
        y = jax.nn.gelu(y, approximate=True)
    if "w2" in p:
        y = y * (h @ p["w2"]).astype(jnp.float32)
    if r is not None:
        y = y + r.astype(jnp.float32)
    return y.astype(x.dtype)


def pallas_op(x, p, spec, r=None, *, config, interpret):
    return fused_matmul(x, p["w"], norm=spec.get("norm") or "none", norm_scale=p.get("g"), norm_bias=p.get("b"),
                        eps=1e-5 if spec.get("norm") == "layer" else 1e-6, bias=p.get("bias"),
                        activation=spec.get("activation", "none"), w2=p.get("w2"), residual=r,
                        out_dtype=x.dtype, config=config, interpret=interpret)


def _time(fn, *args, reps: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def time_op(op, x, p, spec, r, iters: int, reps: int) -> float:
    """µs per call of op in a chain of ``iters`` (the output's first element feeds the next input)."""
    def run(x, p, r):
        def body(_, x):
            y = op(x, p, spec, r)
            return x + (y[0, 0] * 1e-6).astype(x.dtype)
        return jax.lax.fori_loop(0, iters, body, x)
    return _time(jax.jit(run), x, p, r, reps=reps) / iters * 1e6


def time_stack(ops, impl_of, x, params, layers: int, iters: int, reps: int) -> float:
    """µs per layer of the non-attention decode layer (attention replaced by the first d columns of QKV)."""
    d = x.shape[1]

    def layer(x, p):
        qkv = impl_of("qkv")(x, p["qkv"], ops["qkv"])
        x = impl_of("o_proj")(qkv[:, :d], p["o_proj"], ops["o_proj"], x)
        h = impl_of("mlp_in")(x, p["mlp_in"], ops["mlp_in"])
        return impl_of("mlp_out")(h, p["mlp_out"], ops["mlp_out"], x)

    def run(x, params):
        def body(_, x):
            for p in params:
                x = layer(x, p)
            return x
        return jax.lax.fori_loop(0, iters, body, x)
    return _time(jax.jit(run), x, params, reps=reps) / (iters * layers) * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run (interpret mode, tiny loops)")
    args = ap.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    if args.quick:
        args.layers, args.iters, args.reps = 1, 2, 1
    dtype = jnp.bfloat16 if not interpret else jnp.float32
    sweep = ([MatmulConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
              for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (4,) for s in (4,)]
             if not interpret else [None])
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, python=platform.python_version(),
                dtype=jnp.dtype(dtype).name, layers=args.layers, iters=args.iters)
    rows = []
    rng = np.random.default_rng(0)
    for model in args.models.split(","):
        m, ops = _ops(model)
        d = MODELS[model][1]
        best = {}
        for name, spec in ops.items():
            k, n = spec["k"], spec["n"]
            p = _params(rng, k, n, spec, dtype)
            x = jnp.asarray(rng.normal(size=(m, k)), dtype)
            r = jnp.asarray(rng.normal(size=(m, n)), dtype) if spec.get("residual") else None
            wbytes = sum(v.size * v.dtype.itemsize for key, v in p.items() if key in ("w", "w2"))
            base = dict(model=model, op=name, m=m, k=k, n=n, weight_bytes=wbytes,
                        bound_us=wbytes / HBM_BYTES_PER_S * 1e6, **meta)
            us = time_op(xla_op, x, p, spec, r, args.iters, args.reps)
            rows.append(dict(base, impl="xla", config=None, us=us))
            print(json.dumps(rows[-1]), flush=True)
            cands = []
            for cfg in sweep:
                cfg = cfg or default_matmul_config(k, n, interpret=interpret)
                if k % cfg.block_k:
                    continue
                try:
                    fn = lambda x, p, spec, r, cfg=cfg: pallas_op(x, p, spec, r, config=cfg, interpret=interpret)  # noqa: E731
                    cands.append((time_op(fn, x, p, spec, r, args.iters, args.reps), cfg))
                except Exception as e:  # a tiling Triton rejects: recorded, skipped
                    print(f"# {model} {name} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            us, cfg = min(cands, key=lambda c: c[0])
            best[name] = cfg
            rows.append(dict(base, impl="pallas", config=cfg.__dict__, us=us,
                             sweep=[dict(c.__dict__, us=t) for t, c in cands]))
            print(json.dumps({k_: v for k_, v in rows[-1].items() if k_ != "sweep"}), flush=True)
        params = [{name: _params(rng, s["k"], s["n"], s, dtype) for name, s in ops.items()}
                  for _ in range(args.layers)]
        x = jnp.asarray(rng.normal(size=(m, d)), dtype)
        wbytes = sum(v.size * v.dtype.itemsize for p in params[0].values() for key, v in p.items()
                     if key in ("w", "w2"))
        for impl in ("xla", "pallas"):
            def impl_of(name, impl=impl):
                if impl == "xla":
                    return xla_op
                return lambda x, p, spec, r=None, cfg=best[name]: pallas_op(x, p, spec, r, config=cfg,
                                                                             interpret=interpret)
            us = time_stack(ops, impl_of, x, params, args.layers, args.iters, args.reps)
            rows.append(dict(model=model, op="stack", m=m, k=d, n=d, impl=impl, us=us, weight_bytes=wbytes,
                             bound_us=wbytes / HBM_BYTES_PER_S * 1e6, **meta,
                             config={k_: v.__dict__ for k_, v in best.items()} if impl == "pallas" else None))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| model | op | M×K×N | XLA µs | Pallas µs | bound µs |\n|---|---|---|---|---|---|")
    for r in rows:
        if r["impl"] == "xla":
            pal = next(q for q in rows if q["impl"] == "pallas" and q["model"] == r["model"] and q["op"] == r["op"])
            print(f"| {r['model']} | {r['op']} | {r['m']}×{r['k']}×{r['n']} | {r['us']:.2f} | {pal['us']:.2f} | "
                  f"{r['bound_us']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
