"""Decode attention speed: µs per call, GB/s of live K/V and the fraction of HBM bandwidth, per implementation.

One query per (row, head) against a ring KV cache (``fox_jax.ops.decode_attention``), bf16 q/k/v, float32
Λ pairs where the model has a forget gate. Implementations:
  xla           masked einsums over the whole ring (reads all C slots)
  pallas        the flash-decoding kernel (kernels/decode_attention.py) at its default tiling: reads only the
                live blocks
  cudnn         the op's cuDNN path (decay and range as a [B, H, 1, C] bias; the ring's own BNSH layout when
                jax's private cuDNN entry takes it, else the public API)
  cudnn-public  jax.nn.dot_product_attention(implementation="cudnn") on transposed K/V (BTNH): what the
                public API costs (a copy of the ring per call)

Timing: one jitted ``fori_loop`` chains ``--chain`` calls (the next query depends on the previous output through
q + 0·o, so nothing is hoisted or merged), run until ≥ 0.3 s has passed (3 runs with --quick); µs = median wall
time / chain. Each iteration adds one tiny elementwise kernel and the loop's own cost, as in a decode step (the
output feeds the next op); ``loop_overhead_us`` is that cost measured alone (the chain without attention), so
``us − loop_overhead_us`` is the op. GB/s and bw_frac use ``us`` (conservative).
GB/s = bytes of live K and V (Σ over rows and kv heads of live keys × D × 2 bytes × 2) / time; ``bw_frac``
divides by ``--bandwidth`` (H200: 4.8 TB/s). Every row is checked against the float32 oracle
(``max_err``, relative to max |o|; bf16 → ~1e-2 expected).

Shapes (``SHAPES``): GPT-2 124M (B32, H12, D64, C1024, no gate), FoX 125M at 8k and 32k (B8, H12, D64,
C 8320 / 32896, Λ pairs), ACP-like short live ranges in a big ring (256 live of C 8192, wrapped), a
DCP-like slot pool (per-head ``valid`` mask), GQA (B8, H32, Hkv8, D128, C4096, Λ pairs).

``--sweep``: the Pallas kernel over block_k × num_splits (num_warps 4, num_stages 3), then num_warps ×
num_stages at the best pair, per shape; the best config per shape and the winner per shape are printed and
stored (``best_pallas``, ``winners``) so that the defaults in kernels/decode_attention.py
(``_GPU_BLOCK_K``, ``_GPU_TARGET_PROGRAMS``, ``_GPU_MIN_BLOCKS_PER_SPLIT``) and
``fox_jax.ops.decode_attention.GPU_AUTO_IMPLEMENTATION`` can be set from one run.

``--offline``: no GPU: compiles the kernel's Triton IR for sm_90 (``pip install triton==3.6.0``) at every
sweep candidate and prints shared memory, registers and spills (candidates over 227 KB cannot run).

    python benchmarks/bench_decode_attention.py --out $OUT/decode_attention.json            # GPU, ~2 min
    python benchmarks/bench_decode_attention.py --sweep --out $OUT/decode_attention_sweep.json
    python benchmarks/bench_decode_attention.py --quick --out /tmp/q.json                   # CPU plumbing
    python benchmarks/bench_decode_attention.py --offline                                   # CPU, sm_90 resources

JSON: {"versions": {...}, "rows": [{shape, B, H, Hkv, G, D, C, live_keys, lam, valid, impl, block_k,
num_splits, num_warps, num_stages, us, loop_overhead_us, live_kv_bytes, gbps, bw_frac, max_err, error}], "winners": {shape:
impl}, "best_pallas": {shape: {block_k, num_splits, num_warps, num_stages, us}}}.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import functools
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


from fox_jax.kernels import decode_attention as dk  # noqa: E402
from fox_jax.ops import decode_attention, decode_attention_reference  # noqa: E402
from fox_jax.ops.decode_attention import _cudnn as cudnn_decode  # noqa: E402
from fox_jax.ops.decode_attention import cudnn_supported  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    b: int
    h: int
    hkv: int
    d: int
    cap: int
    live: int | None = None  # keys per (row, kv head); None = the whole ring
    lam: bool = True
    valid: bool = False  # a per-head slot mask (DCP-like pool), 70 % of the slots valid


SHAPES = [
    Shape("gpt2-124m-C1024", 32, 12, 12, 64, 1024, lam=False),
    Shape("fox-125m-C8320", 8, 12, 12, 64, 8320),
    Shape("fox-125m-C32896", 8, 12, 12, 64, 32896),
    Shape("acp-256-of-C8192", 8, 12, 12, 64, 8192, live=256),
    Shape("dcp-pool-C4096", 8, 12, 12, 64, 4096, valid=True),
    Shape("gqa-H32-Hkv8-D128-C4096", 8, 32, 8, 128, 4096),
]
QUICK_SHAPES = [Shape("quick-gqa", 2, 4, 2, 32, 96, live=40)]
IMPLS = ("xla", "pallas", "cudnn", "cudnn-public")
SWEEP_BLOCK_K = (32, 64, 128, 256)
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32)
SWEEP_WARPS_STAGES = ((4, 2), (4, 3), (4, 4), (8, 3), (2, 3))


def log(*a):
    print(*a, flush=True)


def _uniform(shape, seed: int) -> jax.Array:
    """Deterministic float32 values in [0, 1) from an integer hash of the element index (cheap to compile
    everywhere, unlike jax.random's threefry on CPU)."""
    x = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape) * jnp.uint32(2654435761) + jnp.uint32(seed)
    for shift, mult in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = (x ^ (x >> shift)) * jnp.uint32(mult)
    x = x ^ (x >> 16)
    return (x >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def make_inputs(s: Shape, dtype=jnp.bfloat16, seed=0):
    """q [B, Hkv, G, D], k, v [B, Hkv, C, D] (uniform, unit variance) and the op's keyword arguments: live
    ranges that start anywhere in the ring (most wrap), Λ pairs, a slot mask."""
    grp = s.h // s.hkv
    sym = lambda shape, i: ((_uniform(shape, 7919 * seed + i) - 0.5) * np.sqrt(12.0)).astype(dtype)  # noqa: E731
    q = sym((s.b, s.hkv, grp, s.d), 1)
    k = sym((s.b, s.hkv, s.cap, s.d), 2)
    v = sym((s.b, s.hkv, s.cap, s.d), 3)
    live = s.cap if s.live is None else s.live
    lo = 3 * s.cap + (_uniform((s.b, s.hkv), 4) * s.cap).astype(jnp.int32)
    kw = dict(lo=lo, hi=lo + live)
    if s.lam:  # Λ ≈ −600 at the query, keys decaying by up to 8 nats
        lq = -600.0 + _uniform((s.b, s.hkv, grp), 5)
        lk = lq[..., None] + 8.0 * _uniform((s.b, s.hkv, grp, s.cap), 6)
        kw["lam_q"] = (lq, jnp.zeros_like(lq))
        kw["lam_k"] = (lk, jnp.zeros_like(lk))
    if s.valid:
        kw["valid"] = _uniform((s.b, s.hkv, s.cap), 7) < 0.7
    return q, k, v, kw


def live_kv_bytes(s: Shape, itemsize: int = 2) -> int:
    live = s.cap if s.live is None else s.live
    return s.b * s.hkv * live * s.d * itemsize * 2


def _cudnn_public(q, k, v, *, lo, hi, valid=None, lam_q=None, lam_k=None):
    return cudnn_decode(q, k, v, lo, hi, valid, lam_q, lam_k, q.shape[-1] ** -0.5, public_api=True)


def op_fn(impl: str, config: dk.DecodeConfig | None = None):
    """fn(q, k, v, **kw) -> o for an implementation (a Pallas config: block_k / splits / warps / stages)."""
    if impl == "cudnn-public":
        return _cudnn_public
    if impl == "pallas" and config is not None:
        def f(q, k, v, *, lo, hi, valid=None, lam_q=None, lam_k=None):
            return dk.flash_decode(q, k, v, lo, hi, valid, lam_q, lam_k, scale=q.shape[-1] ** -0.5, config=config,
                                   interpret=jax.default_backend() != "gpu")
        return f
    return functools.partial(decode_attention, implementation=impl)


def chained(fn, n: int):
    """jit(q, k, v, kw) running ``fn`` n times in a ``fori_loop``, each query depending on the previous
    output (q + 0·o: nothing is hoisted or merged). One call site, so each config lowers once."""
    def run(q, k, v, kw):
        def body(_, carry):
            q_i, o = carry
            q_i = (q_i.astype(jnp.float32) + 0.0 * o.astype(jnp.float32)).astype(q.dtype)
            return q_i, fn(q_i, k, v, **kw).astype(q.dtype)
        return jax.lax.fori_loop(0, n, body, (q, jnp.zeros_like(q)))[1]
    return jax.jit(run)


def loop_overhead_us(args, n: int, target_s: float) -> float:
    """µs per iteration of the same chain with no attention (the q update alone): the loop's own cost."""
    def body(_, carry):
        q_i, o = carry
        q_i = (q_i.astype(jnp.float32) + 0.0 * o.astype(jnp.float32)).astype(q_i.dtype)
        return q_i, q_i * 2
    q = args[0]
    f = jax.jit(lambda q: jax.lax.fori_loop(0, n, body, (q, jnp.zeros_like(q)))[1])
    return time_us(f.lower(q).compile(), (q,), n, target_s)


def time_us(compiled, args, n: int, target_s: float = 0.3, max_reps: int = 50) -> float:
    """Median wall µs per call of a compiled chain of n calls (≥ 3 runs, then until target_s)."""
    jax.block_until_ready(compiled(*args))
    times = []
    t_end = time.perf_counter() + target_s
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < max_reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times)) / n


def compile_all(jobs: dict, workers: int) -> dict:
    """{key: (jitted, args)} → {key: compiled or the exception}, compiled concurrently."""
    def one(item):
        key, (fn, args) = item
        try:
            return key, fn.lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - recorded per row
            return key, e
    with cf.ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
        return dict(ex.map(one, jobs.items()))


def _short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def sweep_candidates(s: Shape, stage: int, best=None):
    """Pallas configs of the sweep: stage 1 block_k × num_splits at (4 warps, 3 stages) — block_k dividing C,
    splits ≤ the blocks of the live range; stage 2 warps × stages at the best (block_k, num_splits)."""
    live = s.cap if s.live is None else s.live
    if stage == 1:
        cands = [dk.DecodeConfig(bk, ns, 4, 3) for bk in SWEEP_BLOCK_K if s.cap % bk == 0
                 for ns in SWEEP_SPLITS if ns <= max(1, -(-live // bk))]
    else:
        cands = [dk.DecodeConfig(best.block_k, best.num_splits, w, st) for w, st in SWEEP_WARPS_STAGES]
    return [c for c in cands if shared_estimate(s, c) <= dk.SHARED_LIMIT]


def shared_estimate(s: Shape, c: dk.DecodeConfig) -> int:
    """The kernel's shared-memory estimate for this shape (bf16 K/V): ``dk.shared_bytes``."""
    return dk.shared_bytes(c, s.d, 2, s.h // s.hkv, s.lam, s.valid)


def run_rows(shapes, impls, configs_for, n_chain, workers, bandwidth, check=True, target_s=0.3):
    """Compile everything of a shape concurrently, then time one by one. ``configs_for(shape)`` gives extra
    Pallas configs ("pallas@..." rows)."""
    rows = []
    for s in shapes:
        q, k, v, kw = make_inputs(s)
        args = (q, k, v, kw)
        jobs = {}
        for impl in impls:
            if impl.startswith("cudnn") and cudnn_supported(q) is not None:
                rows.append(_row(s, impl, None, error=f"skipped: cudnn needs {cudnn_supported(q)}"))
                continue
            jobs[(impl, None)] = (chained(op_fn(impl), n_chain), args)
        for cfg in configs_for(s):
            jobs[("pallas", cfg)] = (chained(op_fn("pallas", cfg), n_chain), args)
        t0 = time.perf_counter()
        compiled = compile_all(jobs, workers)
        log(f"[{s.name}] compiled {len(jobs)} in {time.perf_counter() - t0:.1f}s")
        ref = jax.jit(decode_attention_reference)(q, k, v, **kw) if check else None
        overhead = loop_overhead_us(args, n_chain, target_s)
        for (impl, cfg), c in compiled.items():
            if isinstance(c, Exception):
                rows.append(_row(s, impl, cfg, error=_short_error(c)))
                log(f"  {impl:13s} {_cfg_str(cfg):18s} ERROR {_short_error(c)}")
                continue
            try:
                us = time_us(c, args, n_chain, target_s)
                err = None
                if check:  # the chain's output is the op's: q + 0·o = q
                    o = c(*args)
                    err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref)) / jnp.maximum(1.0, jnp.max(jnp.abs(ref))))
                rows.append(_row(s, impl, cfg, us=us, max_err=err, bandwidth=bandwidth, overhead=overhead))
                r = rows[-1]
                log(f"  {impl:13s} {_cfg_str(cfg):18s} {us:9.1f} us {r['gbps']:8.1f} GB/s  {100 * r['bw_frac']:5.1f}% "
                    f"err {err if err is None else f'{err:.1e}'}")
            except Exception as e:  # noqa: BLE001
                rows.append(_row(s, impl, cfg, error=_short_error(e)))
                log(f"  {impl:13s} {_cfg_str(cfg):18s} ERROR {_short_error(e)}")
    return rows


def _cfg_str(cfg) -> str:
    return "default" if cfg is None else f"bk{cfg.block_k} s{cfg.num_splits} w{cfg.num_warps} st{cfg.num_stages}"


def _row(s: Shape, impl, cfg, us=None, max_err=None, error=None, bandwidth=4.8e12, overhead=None):
    resolved = cfg
    if impl == "pallas" and cfg is None:
        resolved = dk.default_decode_config(s.b * s.hkv, s.cap, interpret=jax.default_backend() != "gpu")
    nbytes = live_kv_bytes(s)
    gbps = None if us is None else nbytes / (us * 1e-6) / 1e9
    return dict(shape=s.name, B=s.b, H=s.h, Hkv=s.hkv, G=s.h // s.hkv, D=s.d, C=s.cap,
                live_keys=s.cap if s.live is None else s.live, lam=s.lam, valid=s.valid,
                impl=impl if cfg is None else "pallas-sweep",
                block_k=None if resolved is None else resolved.block_k,
                num_splits=None if resolved is None else resolved.num_splits,
                num_warps=None if resolved is None else resolved.num_warps,
                num_stages=None if resolved is None else resolved.num_stages,
                us=us, loop_overhead_us=overhead, live_kv_bytes=nbytes, gbps=gbps,
                bw_frac=None if gbps is None else gbps * 1e9 / bandwidth,
                max_err=max_err, error=error)


def summarize(rows):
    winners, best = {}, {}
    for name in dict.fromkeys(r["shape"] for r in rows):
        ok = [r for r in rows if r["shape"] == name and r["us"] is not None]
        if not ok:
            continue
        w = min(ok, key=lambda r: r["us"])
        winners[name] = "pallas" if w["impl"] == "pallas-sweep" else w["impl"]
        pallas = [r for r in ok if r["impl"] in ("pallas", "pallas-sweep")]
        if pallas:
            p = min(pallas, key=lambda r: r["us"])
            best[name] = {k: p[k] for k in ("block_k", "num_splits", "num_warps", "num_stages", "us")}
    return winners, best


def markdown(rows, winners):
    out = ["| shape | impl | block_k | splits | warps | stages | µs | µs − loop | GB/s | % of HBM | max err |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["impl"] == "pallas-sweep":
            continue
        if r["us"] is None:
            out.append(f"| {r['shape']} | {r['impl']} | | | | | {r['error']} | | | | |")
            continue
        mark = " **(winner)**" if winners.get(r["shape"]) == r["impl"] else ""
        err = "" if r["max_err"] is None else f"{r['max_err']:.1e}"
        out.append(f"| {r['shape']} | {r['impl']}{mark} | {r['block_k'] or ''} | {r['num_splits'] or ''} | "
                   f"{r['num_warps'] or ''} | {r['num_stages'] or ''} | {r['us']:.1f} | "
                   f"{r['us'] - r['loop_overhead_us']:.1f} | "
                   f"{r['gbps']:.0f} | "
                   f"{100 * r['bw_frac']:.1f} | {err} |")
    return "\n".join(out)


def versions():
    v = dict(python=platform.python_version(), jax=jax.__version__, backend=jax.default_backend(),
             device=str(jax.devices()[0].device_kind))
    try:
        import jaxlib
        v["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    return v


def offline(shapes) -> int:
    """sm_90 shared memory / registers / spills of every sweep candidate, without a GPU."""
    import glob
    import subprocess
    import tempfile

    import jax._src.pallas.triton.lowering as triton_lowering
    import jax._src.pallas.triton.pallas_call_registration as triton_registration
    import triton
    from triton.backends.compiler import GPUTarget

    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))[0]
    seen = set()
    for s in shapes:
        q, k, v, kw = (jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x for x in
                       jax.eval_shape(lambda: make_inputs(dataclasses.replace(s, b=1))))
        kw = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), kw)
        cands = sweep_candidates(s, 1)
        cands += [c for c in sweep_candidates(s, 2, dk.DecodeConfig(64, 2)) if c not in cands]
        for cfg in cands:
            key = (s.h // s.hkv, s.d, s.lam, s.valid, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.num_splits > 1)
            if key in seen:
                continue
            seen.add(key)
            captured = []
            original = triton_lowering.lower_jaxpr_to_triton_module

            def capture(*a, _orig=original, **kwargs):
                result = _orig(*a, **kwargs)
                captured.append(result.module.operation.get_asm(enable_debug_info=False))
                return result

            triton_registration.lowering.lower_jaxpr_to_triton_module = capture
            try:
                f = functools.partial(dk.flash_decode, scale=0.125, config=cfg, interpret=False)
                jax.jit(lambda q, k, v, kw, _f=f: _f(q, k, v, kw["lo"], kw["hi"], kw.get("valid"), kw.get("lam_q"),
                                                     kw.get("lam_k"))).trace(q, k, v, kw).lower(
                    lowering_platforms=("cuda",))
            finally:
                triton_registration.lowering.lower_jaxpr_to_triton_module = original
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "k.ttir")
                with open(path, "w") as fh:
                    fh.write(captured[0])
                kern = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
                with open(os.path.join(tmp, "k.ptx"), "w") as fh:
                    fh.write(kern.asm["ptx"])
                out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", os.path.join(tmp, "k.ptx"), "-o",
                                      os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
            info = " ".join(line.split(":", 1)[-1].strip() for line in out.stderr.splitlines()
                            if "spill" in line or "registers" in line)
            log(f"G={s.h // s.hkv} D={s.d} lam={int(s.lam)} valid={int(s.valid)} bk{cfg.block_k} w{cfg.num_warps} "
                f"st{cfg.num_stages} {'split' if cfg.num_splits > 1 else 'single'}: shared "
                f"{kern.metadata.shared / 1024:.0f} KB | {info}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON output path (required unless --offline)")
    ap.add_argument("--quick", action="store_true", help="one tiny shape on CPU (interpret mode): the plumbing")
    ap.add_argument("--sweep", action="store_true", help="also sweep the Pallas tiling per shape")
    ap.add_argument("--offline", action="store_true", help="no GPU: sm_90 resources of the sweep candidates")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--chain", type=int, default=None, help="calls per timed jit (default 16; 1 with --quick)")
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="HBM bytes/s for bw_frac (H200: 4.8e12)")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    pool = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        names = args.shapes.split(",")
        unknown = [n for n in names if n not in {s.name for s in pool}]
        if unknown:
            ap.error(f"--shapes: unknown {unknown}; known: {[s.name for s in pool]}")
        pool = [s for s in pool if s.name in names]
    if args.offline:
        return offline(pool)
    if args.out is None:
        ap.error("--out is required (JSON output path)")
    impls = [i for i in args.impls.split(",") if i]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        ap.error(f"--impls: unknown {bad}; known: {list(IMPLS)}")
    n_chain = args.chain or (1 if args.quick else 16)
    log(f"versions: {versions()}")
    target_s = 0.0 if args.quick else 0.3
    rows = run_rows(pool, impls, lambda s: [], n_chain, args.workers, args.bandwidth, target_s=target_s)
    if args.sweep:
        for s in pool:
            stage1 = run_rows([s], [], lambda s: sweep_candidates(s, 1), n_chain, args.workers, args.bandwidth,
                              check=False, target_s=target_s)
            ok = [r for r in stage1 if r["us"] is not None]
            rows += stage1
            if ok:
                b = min(ok, key=lambda r: r["us"])
                best = dk.DecodeConfig(b["block_k"], b["num_splits"], 4, 3)
                rows += run_rows([s], [], lambda s, _b=best: [c for c in sweep_candidates(s, 2, _b) if c != _b],
                                 n_chain, args.workers, args.bandwidth, check=False, target_s=target_s)
    winners, best = summarize(rows)
    log("\n" + markdown(rows, winners))
    log(f"\nwinners: {winners}\nbest pallas: {json.dumps(best)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(versions=versions(), chain=n_chain, bandwidth=args.bandwidth, rows=rows, winners=winners,
                       best_pallas=best), f, indent=1)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
