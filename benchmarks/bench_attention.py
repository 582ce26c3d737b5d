"""Forgetting-attention speed: fwd, bwd and fwd+bwd ms (median) and TFLOP/s, side by side.

Implementations (all bf16 q/k/v, float32 log forget gates):
  cudnn         jax.nn.dot_product_attention(implementation="cudnn", is_causal=True) — plain causal
                attention, no gates (the speed bar)
  xla-dense     fox_jax forgetting_attention(implementation="dense"): materialises [B, H, T, T]
  xla-blockwise fox_jax forgetting_attention(implementation="xla")
  pallas        fox_jax forgetting_attention(implementation="pallas")
  pallas-acp    same with adaptive_threshold="auto"
  pallas-acp-trained  same, on the log forget gates of a trained FoX (--gates-from RUN_DIR; TrainedGates)
  mosaic        fox_jax forgetting_attention(implementation="mosaic"): the Hopper Mosaic GPU forward and
                backward kernels
  mosaic-acp    same with adaptive_threshold="auto"
  mosaic-nopp, mosaic-acp-nopp   the same two with the backward's ping-pong off (``MosaicConfig.bwd_pingpong``:
                on by default at D = 128, where it measured +4.6% for ACP at 16k)
  mosaic-dq-kernel, mosaic-acp-dq-kernel   the same two with the dQ kernel (``MosaicConfig.bwd_fused_dq`` off:
                dQ from the dK/dV kernel is D = 128's default since 2026-12-07; at D = 64 these equal mosaic)
  pallas-seg, mosaic-seg  pallas / mosaic with segment ids of one document per row (all ones), as the train
                step passes them: the cost of the segment mask where no tile needs it (checked equal to the
                impl without ids)
  fla           fla-core's PyTorch/Triton parallel_forgetting_attn (if importable), same process
  fox-triton    the official FoX Triton kernel (PyTorch), loaded by path from --fox-triton DIR (a copy for
                benchmarking only; never imported by the package), same process
  fox-triton-acp  same with adaptive_threshold="auto"
  torch-cudnn   torch SDPA with the cuDNN backend, plain causal (no gates)

Inputs follow docs/design/anchors_h200.md: per-head forget-gate logits ~ N(μ_h, 1), μ_h evenly spaced in
[0, 6] across heads; q/k rows normalised to L2 norm √D (as with QK-norm), so the ACP auto bound holds.
FLOPs: fwd = 2·B·H·T²·D (causal half of 4·B·H·T²·D), fwd+bwd = 3.5 × fwd, bwd = 2.5 × fwd. For ACP the
dense-equivalent TFLOP/s count skipped work too; "executed" TFLOP/s scale by the tiles actually run.
bwd time = (fwd+bwd) − fwd.

Usage:
  python benchmarks/bench_attention.py --out results.json            # GPU, the four anchor shapes
  python benchmarks/bench_attention.py --quick --out /tmp/q.json     # CPU smoke run (interpret mode)
  python benchmarks/bench_attention.py --sweep ...                    # first tune the Pallas tiles
  python benchmarks/bench_attention.py --bwd-sweep --out bwd.json     # backward grid order / stages
  python benchmarks/bench_attention.py --gates-from RUN_DIR ...       # + gates of a trained FoX
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import itertools
import json
import math
import os
import platform
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from fox_jax.ops import forgetting_attention
from fox_jax.ops import acp as acp_lib
from fox_jax.ops import pallas as fpallas
from fox_jax.ops.reference import decay_cumsum
from fox_jax.kernels import forgetting_attention as fk
from fox_jax.kernels.forgetting_attention import KernelConfig, TileConfig

ANCHOR_SHAPES = [  # (B, T, H, D)
    (4, 4096, 32, 64),
    (8, 2048, 16, 128),
    (2, 8192, 16, 128),
    (1, 16384, 16, 128),
]
QUICK_SHAPES = [(1, 64, 2, 32), (1, 96, 2, 64)]
IMPLS = ["cudnn", "xla-dense", "xla-blockwise", "pallas", "pallas-acp", "fla"]  # + "pallas-acp-trained"
TORCH_IMPLS = ("fla", "fox-triton", "fox-triton-acp", "torch-cudnn")  # timed with triton.testing.do_bench
# grid-order variants (KernelConfig.interleave_heads), for tuning runs
VARIANTS = {"pallas-heads": ("pallas", True), "pallas-acp-blocks": ("pallas-acp", False)}
# forgetting_attention's arguments per implementation name (the rest of the names are built in jax_fns)
OP_KWARGS = {"dense": dict(implementation="dense"), "xla-dense": dict(implementation="dense"),
             "xla-blockwise": dict(implementation="xla"), "pallas": dict(implementation="pallas"),
             "pallas-acp": dict(implementation="pallas", adaptive_threshold="auto"),
             "mosaic": dict(implementation="mosaic"),
             "mosaic-acp": dict(implementation="mosaic", adaptive_threshold="auto"),
             "pallas-acp-trained": dict(implementation="pallas", adaptive_threshold="auto"),
             # segment ids of one document per row (all ones), as the train step passes them: the price of
             # the segment mask on tiles that need none
             "pallas-seg": dict(implementation="pallas", one_document=True),
             "mosaic-seg": dict(implementation="mosaic", one_document=True)}
# name → (the implementation it varies, MosaicConfig fields over the head dim's default)
MOSAIC_VARIANTS = {"mosaic-triton-bwd": ("mosaic", dict(backward=False)),  # the Mosaic forward, Triton backward
                   "mosaic-nopp": ("mosaic", dict(bwd_pingpong=False)),       # the backward's ping-pong off
                   "mosaic-acp-nopp": ("mosaic-acp", dict(bwd_pingpong=False)),
                   "mosaic-dq-kernel": ("mosaic", dict(bwd_fused_dq=False)),  # dQ from its own kernel
                   "mosaic-acp-dq-kernel": ("mosaic-acp", dict(bwd_fused_dq=False))}
ALL_IMPLS = ["cudnn", *OP_KWARGS, "pallas-default", "pallas-prev", *MOSAIC_VARIANTS, *VARIANTS, *TORCH_IMPLS]
# "pallas-default": the library's default tiles even when --sweep picked others (side-by-side check);
# "pallas-prev": the previous (round 2) D=128 defaults, to compare against the current ones in one run
PREV_D128 = KernelConfig(fwd=TileConfig(128, 64, 8, 3), dq=TileConfig(64, 64, 4, 2),
                         dkv=TileConfig(64, 128, 8, 4), interleave_bwd_from=16384)

# Tile candidates for --sweep: (block_q, block_k, num_warps, num_stages); all compile without
# exceeding shared memory for sm_90 (checked offline with Triton 3.6; see benchmarks/NOTES.md).
SWEEP = {  # rounds 1–3 and their results: benchmarks/NOTES.md; the first entry is the default
    64: {
        "fwd": [(128, 64, 4, 3), (128, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 32, 4, 3)],
        "dq": [(64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (32, 64, 4, 3), (128, 64, 4, 3)],
        "dkv": [(64, 64, 4, 3), (64, 64, 4, 4), (32, 64, 4, 3), (64, 64, 8, 3), (32, 128, 4, 3)],
    },
    128: {
        # round 3 appended larger tiles for the short, wide B8 T2048 shape (--sweep-shapes)
        "fwd": [(64, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 4), (128, 64, 8, 4), (64, 32, 4, 3),
                (128, 128, 8, 2), (128, 64, 4, 3), (128, 32, 4, 3)],
        "dq": [(128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (32, 64, 4, 3),
               (64, 32, 4, 4), (64, 128, 8, 3), (128, 32, 8, 3)],
        "dkv": [(64, 128, 8, 4), (64, 128, 8, 3), (32, 64, 4, 3), (32, 64, 4, 4), (64, 64, 4, 2),
                (128, 64, 8, 2), (64, 64, 4, 3)],
    },
}
SWEEP_SHAPES = {64: (4, 4096, 32, 64), 128: (2, 8192, 16, 128)}


def log(*a):
    print(*a, flush=True)


def fwd_flops(b, t, h, d):
    return 2.0 * b * h * t * t * d


# --------------------------------------------------------------------------------------------------
# inputs and timing
# --------------------------------------------------------------------------------------------------


def make_inputs(b, t, h, d, seed=0, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32)
    k = jax.random.normal(ks[1], (b, t, h, d), jnp.float32)
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) * math.sqrt(d)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True) * math.sqrt(d)
    v = jax.random.normal(ks[2], (b, t, h, d), jnp.float32)
    mu = jnp.linspace(0.0, 6.0, h)
    lf = jax.nn.log_sigmoid(mu[None, None, :] + jax.random.normal(ks[3], (b, t, h)))
    do = jax.random.normal(ks[4], (b, t, h, d), jnp.float32)
    cast = lambda x: x.astype(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), lf.astype(jnp.float32), cast(do)


def parse_shapes(text: str, flag: str, error) -> list[tuple[int, int, int, int]]:
    """``"BxTxHxD,..."`` as [(B, T, H, D), ...] of positive ints; anything else goes to ``error`` (an argparse
    parser's ``error``: one line naming ``flag``)."""
    shapes = []
    for item in text.split(","):
        dims = item.strip().split("x")
        if len(dims) != 4 or not all(x.isdigit() and int(x) > 0 for x in dims):
            error(f"{flag}: expected BxTxHxD (four positive integers, e.g. 1x16384x24x64), got {item.strip()!r}")
        shapes.append(tuple(int(x) for x in dims))
    return shapes


def parse_mosaic_configs(text: str, flag: str, error) -> list:
    """``--mosaic-sweep``'s ``"BQxBKxST[xBBQxBBKxBST[p]],..."`` as ``MosaicConfig`` s: the forward's block_q,
    block_k and stages, then the backward's (BBQ = 0: the Triton backward), ``p`` at the end for the backward's
    ping-pong (``bwd_pingpong``; off otherwise, whatever ``default_mosaic_config`` would pick); the backward with
    its dQ kernel (``bwd_fused_dq`` off, whatever the default). Anything else, or a
    tiling ``MosaicConfig`` refuses, goes to ``error`` (an argparse parser's: one line naming ``flag``)."""
    from fox_jax.kernels import MosaicConfig
    configs = []
    for item in text.split(","):
        spec = item.strip()
        pingpong = spec.endswith("p")
        dims = (spec[:-1] if pingpong else spec).split("x")
        if len(dims) not in (3, 6) or not all(x.isdigit() for x in dims) or (pingpong and len(dims) != 6):
            error(f"{flag}: expected BQxBKxST or BQxBKxSTxBBQxBBKxBST with an optional p (e.g. 64x128x3x64x64x2p), "
                  f"got {spec!r}")
        x = [int(y) for y in dims]
        try:
            configs.append(MosaicConfig(*x) if len(x) == 3 else MosaicConfig(
                *x[:3], backward=x[3] > 0, bwd_block_q=x[3] or 64, bwd_block_k=x[4], bwd_stages=x[5],
                bwd_pingpong=pingpong))
        except ValueError as e:
            error(f"{flag}: {spec!r}: {e}")
    return configs


def _block(x):
    jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)
    return x


def time_jax(fn, args, target_s=0.4, max_reps=30, min_reps=3):
    """Median wall time (ms) of fn(*args) over reps; each rep dispatches n_inner calls asynchronously."""
    _block(fn(*args))
    t0 = time.perf_counter()
    _block(fn(*args))
    single = time.perf_counter() - t0
    n_inner = max(1, min(20, int(0.02 / max(single, 1e-6))))
    reps = int(max(min_reps, min(max_reps, target_s / max(single * n_inner, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(n_inner):
            out = fn(*args)
        _block(out)
        times.append((time.perf_counter() - t0) / n_inner)
    return 1e3 * float(np.median(times))


def is_oom(e: BaseException) -> bool:
    s = f"{type(e).__name__}: {e}"
    return any(x in s for x in ("RESOURCE_EXHAUSTED", "out of memory", "OutOfMemory", "Out of memory"))


# --------------------------------------------------------------------------------------------------
# JAX implementations
# --------------------------------------------------------------------------------------------------


def jax_fns(impl, d, config=None, t=None):
    """(fwd(q, k, v, lf), fwd_bwd(q, k, v, lf, do)) for one implementation (``t``: the sequence length, for the
    Mosaic variants' defaults; None: a long one)."""
    scale = d ** -0.5
    if impl == "pallas-default":
        impl, config = "pallas", None
    if impl == "pallas-prev":
        impl, config = "pallas", (PREV_D128 if 64 < d <= 128 else None)
    if impl in VARIANTS:
        impl, inter = VARIANTS[impl]
        base = config if config is not None else fpallas.resolve_config(d, 16384, 16384)
        config = dataclasses.replace(base, interleave_heads=inter)
    if impl in MOSAIC_VARIANTS:  # the head dim's default MosaicConfig with some fields changed
        from fox_jax.kernels import default_mosaic_config
        impl, fields = MOSAIC_VARIANTS[impl]
        base = config if config is not None else fpallas.resolve_config(d, 16384, 16384, None, False)
        mc = dataclasses.replace(default_mosaic_config(64 if d <= 64 else 128, t), **fields)
        config = dataclasses.replace(base, mosaic=mc)
    if impl == "cudnn":
        def f(q, k, v, lf):
            del lf
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
        argnums = (0, 1, 2)
    else:
        kw = OP_KWARGS[impl]
        if impl.startswith(("pallas", "mosaic")) and config is not None and "one_document" not in kw:
            def f(q, k, v, lf, _kw=kw):
                lam = decay_cumsum(lf)
                delta = None
                if "adaptive_threshold" in _kw:
                    delta = acp_lib.resolve_threshold("auto", q, k, scale)
                return fpallas.attention(q, k, v, lam, None, None, delta, scale=scale, config=config,
                                         implementation="mosaic" if _kw["implementation"] == "mosaic" else "pallas")
        else:
            def f(q, k, v, lf, _kw=kw):
                _kw = dict(_kw)
                if _kw.pop("one_document", False):
                    _kw["segment_ids"] = jnp.ones(q.shape[:2], jnp.int32)
                return forgetting_attention(q, k, v, lf, sm_scale=scale, **_kw)
        argnums = (0, 1, 2, 3)

    def fwd_bwd(q, k, v, lf, do):
        args = (q, k, v, lf)
        diff = [args[i] for i in argnums]

        def g(*dargs):
            full = list(args)
            for i, a in zip(argnums, dargs):
                full[i] = a
            return f(*full)

        _, vjp = jax.vjp(g, *diff)
        return vjp(do)

    return jax.jit(f), jax.jit(fwd_bwd)


def compile_all(jobs, workers):
    """jobs: {key: (jitted_fn, args)} → {key: compiled or exception}; compiles concurrently."""
    def one(item):
        key, (fn, args) = item
        try:
            return key, fn.lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - recorded per implementation
            return key, e
    with cf.ThreadPoolExecutor(max_workers=workers) as ex:
        return dict(ex.map(one, jobs.items()))


# --------------------------------------------------------------------------------------------------
# fla-core (PyTorch / Triton)
# --------------------------------------------------------------------------------------------------


def fla_available():
    try:
        import torch
        from fla.ops.forgetting_attn import parallel_forgetting_attn  # noqa: F401
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def load_fox_triton(path):
    """The official FoX op from a directory holding its forgetting_attention.py (benchmark use only)."""
    import importlib.util

    file = os.path.join(path, "forgetting_attention.py") if os.path.isdir(path) else path
    spec = importlib.util.spec_from_file_location("fox_triton_official", file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.forgetting_attention


def bench_torch(impl, arrays, d, fox_triton=None):
    """fwd and fwd+bwd ms (triton.testing.do_bench medians) of a PyTorch implementation."""
    import torch
    import triton

    q, k, v, lf, do = (torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda() for x in arrays)
    q, k, v, do = (x.to(torch.bfloat16) for x in (q, k, v, do))
    scale = d ** -0.5
    if impl == "fla":
        from fla.ops.forgetting_attn import parallel_forgetting_attn
        op, inputs = (lambda q, k, v, lf: parallel_forgetting_attn(q, k, v, lf, scale=scale)), (q, k, v, lf)
    elif impl in ("fox-triton", "fox-triton-acp"):
        thr = "auto" if impl == "fox-triton-acp" else None
        op = lambda q, k, v, lf: fox_triton(q, k, v, lf, head_first=False, sm_scale=scale,  # noqa: E731
                                            adaptive_threshold=thr)
        inputs = (q, k, v, lf)
    elif impl == "torch-cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        do = do.transpose(1, 2).contiguous()

        def op(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        inputs = (qt, kt, vt)
    else:
        raise ValueError(impl)
    for x in inputs:
        x.requires_grad_(True)
    res = {}
    try:
        res["fwd"] = float(triton.testing.do_bench(lambda: op(*inputs), warmup=25, rep=100, return_mode="median"))

        def fwd_bwd():
            return torch.autograd.grad(op(*inputs), inputs, do)
        res["fwd_bwd"] = float(triton.testing.do_bench(fwd_bwd, warmup=25, rep=100, return_mode="median"))
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    del q, k, v, lf, do, inputs
    torch.cuda.empty_cache()
    return res


def mosaic_sweep(shapes, configs, acp_modes=(False,)):
    """fwd and fwd+bwd ms of the Mosaic kernels per (shape, MosaicConfig, ACP off / "auto" for each of
    ``acp_modes``), one row each: for picking tilings (TFLOP/s dense-equivalent under ACP)."""
    rows = []
    for (b, t, h, d) in shapes:
        q, k, v, lf, do = make_inputs(b, t, h, d)
        for mc, acp in itertools.product(configs, acp_modes):
            base = fpallas.resolve_config(d, t, t, None, False)
            cfg = dataclasses.replace(base, mosaic=mc)

            def f(q, k, v, lf, _cfg=cfg, _acp=acp):
                delta = acp_lib.resolve_threshold("auto", q, k, d ** -0.5) if _acp else None
                return fpallas.attention(q, k, v, decay_cumsum(lf), None, None, delta, scale=d ** -0.5,
                                         implementation="mosaic", config=_cfg)

            def fb(q, k, v, lf, do, _f=f):
                return jax.vjp(_f, q, k, v, lf)[1](do)
            row = dict(shape=dict(B=b, T=t, H=h, D=d), config=dataclasses.asdict(mc), acp=acp)
            fl = fwd_flops(b, t, h, d)
            for mode, fn, args in (("fwd", f, (q, k, v, lf)), ("fwd_bwd", fb, (q, k, v, lf, do))):
                try:
                    row[mode] = time_jax(jax.jit(fn), args)
                    row[f"tflops_{mode}"] = (1.0 if mode == "fwd" else 3.5) * fl / row[mode] / 1e9
                except Exception as e:  # noqa: BLE001
                    row[f"{mode}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"   mosaic sweep B{b} T{t} H{h} D{d} {mc}{' acp' if acp else ''}: fwd {row.get('fwd', row.get('fwd_error'))} "
                f"fwd+bwd {row.get('fwd_bwd', row.get('fwd_bwd_error'))}")
            rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------
# tile sweep
# --------------------------------------------------------------------------------------------------


def sweep_tiles(workers, quick=False, shapes=None):
    """Time each kernel alone over SWEEP's candidates at ``shapes`` ({D: (B, T, H, D)}, default
    SWEEP_SHAPES; only these Ds are swept when given); returns {D: KernelConfig of the fastest}."""
    best, table = {}, []
    interpret = jax.default_backend() != "gpu"
    for d, cands in SWEEP.items():
        if shapes is not None and d not in shapes:
            continue
        b, t, h, _ = (1, 64, 2, d) if quick else (shapes or SWEEP_SHAPES)[d]
        q, k, v, lf, do = make_inputs(b, t, h, d, seed=1)
        lam = decay_cumsum(lf)
        scale = d ** -0.5
        ref_cfg = fpallas.resolve_config(d, t, t, None, interpret)
        o, lse = jax.jit(lambda q, k, v, lam: fk.attention_forward(
            q, k, v, lam, jnp.zeros((b,), jnp.int32), None, None, scale=scale, config=ref_cfg,
            interpret=interpret))(q, k, v, lam)
        lam_bh = lam.transpose(0, 2, 1)
        ss = jnp.zeros((b,), jnp.int32)
        lse2 = lse * fk.LOG2E
        delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1).transpose(0, 2, 1)
        jobs = {}
        for kind, lst in cands.items():
            for c in (lst[:2] if quick else lst):
                tile = TileConfig(*c)
                tile = dataclasses.replace(tile, block_q=min(tile.block_q, t), block_k=min(tile.block_k, t))
                common = dict(tq=t, tk=t, scale=scale, tile=tile, interpret=interpret)
                if kind == "fwd":
                    fn = jax.jit(lambda q, k, v, _c=common: fk.flash_forward(
                        q, k, v, lam_bh, lam_bh, ss, None, None, None, **_c))
                    args = (q, k, v)
                elif kind == "dq":
                    fn = jax.jit(lambda q, k, v, do, _c=common: fk.flash_backward_dq(
                        q, k, v, do, lam_bh, lam_bh, lse2, delta, ss, None, None, None, **_c))
                    args = (q, k, v, do)
                else:
                    fn = jax.jit(lambda q, k, v, do, _c=common: fk.flash_backward_dkv(
                        q, k, v, do, lam_bh, lam_bh, lse2, delta, ss, None, None, None, **_c))
                    args = (q, k, v, do)
                jobs[(kind, c)] = (fn, args)
        t0 = time.perf_counter()
        compiled = compile_all(jobs, workers)
        log(f"[sweep] D={d}: compiled {len(jobs)} variants in {time.perf_counter() - t0:.1f}s")
        chosen = {}
        for (kind, c), exe in compiled.items():
            args = jobs[(kind, c)][1]
            if isinstance(exe, Exception):
                ms, err = None, f"{type(exe).__name__}: {str(exe)[:160]}"
            else:
                try:
                    ms, err = time_jax(exe, args, target_s=0.25), None
                except Exception as e:  # noqa: BLE001
                    ms, err = None, f"{type(e).__name__}: {str(e)[:160]}"
            flops = fwd_flops(b, t, h, d) * (1.0 if kind == "fwd" else 1.25)  # bwd 2.5× split in two
            row = dict(d=d, shape=[b, t, h, d], kernel=kind, tile=list(c), ms=ms, tflops=None if ms is None else flops / ms / 1e9,
                       error=err)
            table.append(row)
            log(f"[sweep] D={d} {kind:4s} {c}: " + (f"{ms:.3f} ms" if ms is not None else f"FAILED {err}"))
            if ms is not None and (kind not in chosen or ms < chosen[kind][1]):
                chosen[kind] = (c, ms)
        if all(kk in chosen for kk in ("fwd", "dq", "dkv")):
            best[d] = KernelConfig(*(TileConfig(*chosen[kk][0]) for kk in ("fwd", "dq", "dkv")))
            log(f"[sweep] D={d} best: {best[d]}")
    return best, table


# --------------------------------------------------------------------------------------------------
# gates from a trained FoX (--gates-from RUN_DIR)
# --------------------------------------------------------------------------------------------------


class TrainedGates:
    """Per-token log forget gates of a trained FoX run, for the benchmark's shapes.

    Reads the run with ``fox_jax.train.runs.open_run`` (a ``fox-jax train`` run, or the dense part of a
    FoX ``finetune-dcp --from-run`` run; the latest checkpoint, or ``step``; parameters only), takes the
    first ``T + 1`` tokens of its validation stream as one packed window
    (``fox_jax.train.data.pack_windows``: segment ids and positions as in validation), runs the model once and
    captures every layer's log forget gates (the attention layers sow them into the ``gates`` collection
    when it is mutable; log f = log_sigmoid(logit), float32, exactly as the attention layer forms it).

    * Validation text shorter than T + 1 tokens is repeated (``np.resize``); ``info["tiled"]`` says so.
    * T may exceed the run's training length: FoX has no positional encoding and the gates are
      per-token, so the model just runs at length T (the gates then show length extrapolation).
    * The model runs with ``remat="none"`` and ``attention_impl`` = "pallas" on GPU, "xla"
      elsewhere (parameters unchanged; other implementations only differ by float rounding).
    * Mapping to the benchmark's [B, T, H]: the trained model's (layer, head) pairs are flattened
      layer-major, p = layer·H_model + head, and cycled over the benchmark's flattened (batch row,
      head) slots: slot (b, h) gets pair (b·H + h) mod (L·H_model). All batch rows use the same token
      window. q/k/v stay the synthetic √D-normalised ones (the auto ACP bound is then the anchors').

    Raises:
      FileNotFoundError: no run in RUN_DIR; ValueError: a run without a FoX model and data config (a
        GPT-2 or Hugging Face directory), or a model without a forget gate; CheckpointError: no checkpoint.
    """

    def __init__(self, run_dir: str, step: int | None = None):
        from fox_jax.models import ModelConfig
        from fox_jax.models import LanguageModel
        from fox_jax.train import data as data_lib
        from fox_jax.train.runs import open_run

        run = open_run(run_dir, step=step, flag="--gates-from").without_dcp()
        if not isinstance(run.model, ModelConfig) or run.data is None:
            raise ValueError(f"--gates-from {run_dir} is {run.what}; it needs a FoX run with its data config "
                             "('fox-jax train' or 'fox-jax finetune-dcp --from-run')")
        if not run.model.use_fgate:
            raise ValueError(f"{run_dir}: arch {run.model.arch!r} has no forget gate")
        self.params, self.step = run.load_params(), run.step
        self.corpus = data_lib.load_corpus(run.data)
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
        self.model_cfg = dataclasses.replace(run.model, remat="none", attention_impl=impl)
        self.model = LanguageModel(self.model_cfg)
        self.pack = data_lib.pack_windows
        self.run_dir, self.train_len = run_dir, run.seq_len
        self._cache = {}

    def window(self, t: int):
        """(packed batch of one window of length t as numpy [1, t] arrays, tiled?)."""
        val = np.asarray(self.corpus.val_tokens)
        tiled = len(val) < t + 1
        tokens = np.resize(val, t + 1) if tiled else val[:t + 1]
        batch = self.pack(tokens, [0], seq_len=t, eot_id=self.corpus.tokenizer.eot_id)
        return batch, tiled

    def layer_gates(self, t: int):
        """[L, t, H_model] float32 log forget gates of the validation window of length t."""
        if t not in self._cache:
            batch, tiled = self.window(t)

            def capture(tokens, seg, pos):
                _, state = self.model.apply({"params": self.params}, tokens, seg, pos, mutable=["gates"])
                gates = [state["gates"][f"layers_{i}"]["attn"]["log_fgate"][0][0] for i in range(self.model_cfg.n_layers)]
                return jnp.stack(gates).astype(jnp.float32)  # [L, t, H_model]

            gates = jax.jit(capture)(*(jnp.asarray(batch[kk]) for kk in ("inputs", "segment_ids", "positions")))
            self._cache[t] = (gates, dict(tiled=bool(tiled), n_documents=int(batch["segment_ids"].max())))
        return self._cache[t]

    def gates(self, b: int, t: int, h: int):
        """([b, t, h] float32 log forget gates, info dict) for a benchmark shape (mapping: class doc)."""
        g, win = self.layer_gates(t)
        n_layers, _, hm = g.shape
        pairs = [((bb * h + hh) % (n_layers * hm)) for bb in range(b) for hh in range(h)]
        idx = np.asarray(pairs).reshape(b, h)
        flat = jnp.moveaxis(g, 1, -1).reshape(n_layers * hm, t)  # row l·H_model + head
        out = flat[jnp.asarray(idx)].transpose(0, 2, 1)  # [b, h, t] → [b, t, h]
        info = dict(run_dir=self.run_dir, step=self.step, train_seq_len=self.train_len, T=t,
                    model_layers=n_layers, model_heads=hm, **win,
                    slots=[[int(p // hm), int(p % hm)] for p in idx.reshape(-1)],
                    mean_log_fgate=float(jnp.mean(out)))
        return out, info


# --------------------------------------------------------------------------------------------------
# backward grid-order / pipeline-stage sweep (dense pallas, fwd+bwd) with a determinism check
# --------------------------------------------------------------------------------------------------


def _bwd_interleaved(cfg):
    return dataclasses.replace(cfg, dq=dataclasses.replace(cfg.dq, interleave_heads=True),
                               dkv=dataclasses.replace(cfg.dkv, interleave_heads=True))


def _dkv_4stage(cfg):
    return dataclasses.replace(cfg, dkv=dataclasses.replace(cfg.dkv, num_stages=4))


BWD_VARIANTS = {  # name → KernelConfig transform of the default (dense: every kernel block-major)
    "a-defaults": lambda c: c,
    "b-bwd-interleaved": _bwd_interleaved,
    "c-dkv-4stage": _dkv_4stage,
    "d-both": lambda c: _dkv_4stage(_bwd_interleaved(c)),
}
BWD_SWEEP_SHAPES = [s for s in ANCHOR_SHAPES if s[3] == 128]
BWD_SWEEP_QUICK = [(1, 64, 2, 128)]


def _leaves_equal(a, b):
    """(bitwise equal, max |a − b|) over all leaves (compared as float32; bit patterns via uint)."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    equal = all(bool(jnp.array_equal(jax.lax.bitcast_convert_type(x, jnp.uint16 if x.dtype.itemsize == 2
                                                                    else jnp.uint32),
                                      jax.lax.bitcast_convert_type(y, jnp.uint16 if y.dtype.itemsize == 2
                                                                   else jnp.uint32)))
                for x, y in zip(la, lb))
    return equal, max(_max_err(x, y) for x, y in zip(la, lb))


def bwd_sweep(shapes, workers, repeats=3, rounds=2):
    """Dense pallas fwd+bwd under BWD_VARIANTS (default tiles otherwise), per shape.

    Times each variant ``rounds`` times, alternating variants (median per round, best round kept), and
    checks determinism: every variant's output (o-cotangent gradients dq, dk, dv, dlog_fgate) is compared
    bitwise with variant (a), and "c-dkv-4stage" and "d-both" are re-run ``repeats`` − 1 more times on
    the same inputs and compared bitwise with their first run (a moving result is a race).
    Returns a list of per-shape dicts (JSON-ready)."""
    interpret = jax.default_backend() != "gpu"
    out = []
    for (b, t, h, d) in shapes:
        log(f"== bwd-sweep B{b} T{t} H{h} D{d}")
        q, k, v, lf, do = make_inputs(b, t, h, d)
        base = fpallas.resolve_config(d, t, t, None, interpret)
        jobs, cfgs = {}, {}
        for name, tr in BWD_VARIANTS.items():
            cfgs[name] = tr(base)
            f, fb = jax_fns("pallas", d, cfgs[name])
            jobs[(name, "fwd_bwd")] = (fb, (q, k, v, lf, do))
            if name == "a-defaults":
                jobs[(name, "fwd")] = (f, (q, k, v, lf))
        t0 = time.perf_counter()
        compiled = compile_all(jobs, workers)
        log(f"   compiled {len(jobs)} functions in {time.perf_counter() - t0:.1f}s")
        res = dict(shape=dict(B=b, T=t, H=h, D=d), variants={}, checks={})
        errors = {key: f"{type(e).__name__}: {str(e)[:300]}" for key, e in compiled.items()
                  if isinstance(e, Exception)}
        for key, err in errors.items():
            log(f"   {key} FAILED {err}")
            res["variants"].setdefault(key[0], {})[f"{key[1]}_error"] = err
        ok = {key: exe for key, exe in compiled.items() if key not in errors}
        times = {key: [] for key in ok}
        for _ in range(rounds):
            for key, exe in ok.items():
                times[key].append(time_jax(exe, jobs[key][1], target_s=0.4, min_reps=5))
        fwd_ms = min(times[("a-defaults", "fwd")]) if ("a-defaults", "fwd") in times else None
        res["fwd_ms_defaults"] = fwd_ms
        first = {}
        for name in BWD_VARIANTS:
            key = (name, "fwd_bwd")
            if key not in ok:
                continue
            ms = min(times[key])
            r = res["variants"].setdefault(name, {})
            r.update(config=dataclasses.asdict(cfgs[name]), fwd_bwd_ms=ms, fwd_bwd_ms_rounds=times[key],
                     bwd_ms=None if fwd_ms is None else ms - fwd_ms)
            first[name] = jax.device_get(ok[key](*jobs[key][1]))
            if name in ("c-dkv-4stage", "d-both"):
                same = []
                for _ in range(repeats - 1):
                    again = jax.device_get(ok[key](*jobs[key][1]))
                    same.append(_leaves_equal(first[name], again)[0])
                res["checks"][f"{name}_repeat_bitwise_equal"] = same
        if "a-defaults" in first:
            ref = res["variants"]["a-defaults"]["fwd_bwd_ms"]
            for name, grads in first.items():
                eq, err = _leaves_equal(first["a-defaults"], grads)
                res["checks"][f"{name}_vs_a_bitwise_equal"] = eq
                res["checks"][f"{name}_vs_a_max_abs"] = err
                res["variants"][name]["speedup_vs_a"] = ref / res["variants"][name]["fwd_bwd_ms"]
        for name, r in res["variants"].items():
            if "fwd_bwd_ms" in r:
                log(f"   {name:18s} fwd+bwd {r['fwd_bwd_ms']:8.3f} ms  bwd {r['bwd_ms'] or 0:8.3f} ms  "
                    f"×{r.get('speedup_vs_a', 1.0):.3f} vs a")
        log(f"   checks: {res['checks']}")
        out.append(res)
    return out


def bwd_sweep_markdown(results):
    names = list(BWD_VARIANTS)
    lines = ["| variant | " + " | ".join(f"B{r['shape']['B']} T{r['shape']['T']}" for r in results) + " |",
             "|---|" + "---|" * len(results)]
    for name in names:
        cells = []
        for r in results:
            x = r["variants"].get(name, {})
            cells.append("–" if "fwd_bwd_ms" not in x else
                         f"{x['fwd_bwd_ms']:.3f} (bwd {x['bwd_ms'] or 0:.3f}, ×{x.get('speedup_vs_a', 1):.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("\nfwd+bwd ms (bwd = fwd+bwd − fwd of the defaults; speed-up vs a). Determinism: " + "; ".join(
        f"T{r['shape']['T']}: " + ", ".join(f"{k}={v}" for k, v in r["checks"].items() if "bitwise" in k)
        for r in results))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# main benchmark
# --------------------------------------------------------------------------------------------------


@jax.jit
def ideal_prunable_fraction(lam, delta):
    """Fraction of causal (i, j) pairs with Λ_i − Λ_j < δ (element-level ACP, as in the anchors).

    Λ is non-increasing, so the pruned keys of row i are a prefix: #{j : −Λ_j < δ − Λ_i}, found by a
    binary search per row (O(T log T), no T×T array). lam: [B, T, H]; delta: [B, H]."""
    t = lam.shape[1]
    neg = -lam.transpose(0, 2, 1)  # [B, H, T], non-decreasing
    thr = delta[:, :, None] - lam.transpose(0, 2, 1)  # prune j iff −Λ_j < δ − Λ_i
    count = jax.vmap(jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="left")))(neg, thr)
    count = jnp.minimum(count, jnp.arange(1, t + 1))
    # summed in float32: the int32 sum overflows past 2³¹ pairs (B1 H24 T16384 has 3.2e9, and printed −0.501)
    return jnp.sum(count.astype(jnp.float32)) / (lam.shape[0] * lam.shape[2] * t * (t + 1) / 2)


def _max_err(a, b):
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def run(shapes, impls, workers, configs, skip_dense_bwd_above, trained=None, fox_triton=None):
    """Benchmark ``impls`` on ``shapes``; ``trained`` (a ``TrainedGates``) enables "pallas-acp-trained"
    (ACP "auto" on the trained model's gates instead of the synthetic ones)."""
    results = []
    for (b, t, h, d) in shapes:
        log(f"== B{b} T{t} H{h} D{d}")
        arrays = make_inputs(b, t, h, d)
        q, k, v, lf, do = arrays
        fl = fwd_flops(b, t, h, d)
        interpret = jax.default_backend() != "gpu"
        # sweep results are keyed by head-dim bound (64, 128): use the smallest bound ≥ D
        config = next((configs[key] for key in sorted(configs) if d <= key), None) if configs else None
        cfg = fpallas.resolve_config(d, t, t, config, interpret)
        delta = acp_lib.resolve_threshold("auto", q, k, d ** -0.5)
        stats = jax.device_get(fpallas.acp_stats(decay_cumsum(lf), delta, t, head_dim=d, config=cfg,
                                                 interpret=interpret))
        ideal = float(ideal_prunable_fraction(decay_cumsum(lf), delta))
        frac = {kk: float(s["fraction_skipped"]) for kk, s in stats.items()}
        shape_res = dict(shape=dict(B=b, T=t, H=h, D=d), flops_fwd=fl, acp_fraction_skipped=frac,
                         acp_ideal_prunable=ideal, pallas_config=dataclasses.asdict(cfg), impls={})
        lf_tr, frac_tr = None, None
        if trained is not None and "pallas-acp-trained" in impls:
            lf_tr, info = trained.gates(b, t, h)
            lam_tr = decay_cumsum(lf_tr)
            st = jax.device_get(fpallas.acp_stats(lam_tr, delta, t, head_dim=d, config=cfg, interpret=interpret))
            frac_tr = {kk: float(s["fraction_skipped"]) for kk, s in st.items()}
            shape_res.update(acp_trained_fraction_skipped=frac_tr,
                             acp_trained_ideal_prunable=float(ideal_prunable_fraction(lam_tr, delta)),
                             trained_gates=info)
            log(f"   trained gates ({info['model_layers']}×{info['model_heads']} (layer, head) pairs, "
                f"{'tiled' if info['tiled'] else 'one'} validation window): ACP skips {frac_tr} "
                f"(synthetic {frac})")
        jobs = {}
        for impl in impls:
            if impl in TORCH_IMPLS:
                continue
            if impl == "pallas-acp-trained" and lf_tr is None:
                shape_res["impls"][impl] = dict(error="needs --gates-from RUN_DIR")
                continue
            if impl == "cudnn" and jax.default_backend() != "gpu":
                shape_res["impls"][impl] = dict(error="cuDNN needs a GPU")
                continue
            f, fb = jax_fns(impl, d, config, t)
            gates = lf_tr if impl == "pallas-acp-trained" else lf
            jobs[(impl, "fwd")] = (f, (q, k, v, gates))
            if not (impl == "xla-dense" and t > skip_dense_bwd_above):
                jobs[(impl, "fwd_bwd")] = (fb, (q, k, v, gates, do))
        t0 = time.perf_counter()
        compiled = compile_all(jobs, workers)
        log(f"   compiled {len(jobs)} functions in {time.perf_counter() - t0:.1f}s")
        outs = {}
        for (impl, mode), exe in compiled.items():
            r = shape_res["impls"].setdefault(impl, {})
            if isinstance(exe, Exception):
                r[mode] = None
                r[f"{mode}_error"] = ("OOM" if is_oom(exe) else f"{type(exe).__name__}: {str(exe)[:200]}")
                log(f"   {impl:14s} {mode:8s} FAILED {r[f'{mode}_error']}")
                continue
            args = jobs[(impl, mode)][1]
            try:
                slow = impl in ("xla-dense", "xla-blockwise")
                ms = time_jax(exe, args, target_s=0.3 if slow else 0.5, min_reps=2 if slow else 5)
                r[mode] = ms
                if impl in ("pallas", "pallas-default", "pallas-prev", "pallas-acp", "pallas-acp-trained", "xla-blockwise",
                            "mosaic", "mosaic-acp", "pallas-seg", "mosaic-seg", *MOSAIC_VARIANTS, *VARIANTS):
                    outs[(impl, mode)] = exe(*args)
                log(f"   {impl:14s} {mode:8s} {ms:9.3f} ms")
            except Exception as e:  # noqa: BLE001
                r[mode] = None
                r[f"{mode}_error"] = "OOM" if is_oom(e) else f"{type(e).__name__}: {str(e)[:200]}"
                log(f"   {impl:14s} {mode:8s} FAILED {r[f'{mode}_error']}")
            del exe
        # cross-checks on the benchmark shapes: pallas vs XLA blockwise (same algorithm)
        checks = {}
        for mode in ("fwd", "fwd_bwd"):
            if ("pallas", mode) in outs and ("xla-blockwise", mode) in outs:
                a, bb = outs[("pallas", mode)], outs[("xla-blockwise", mode)]
                checks[f"pallas_vs_xla_{mode}_max_abs"] = max(
                    _max_err(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(bb)))
            if ("pallas", mode) in outs and ("pallas-acp", mode) in outs:
                a, bb = outs[("pallas", mode)], outs[("pallas-acp", mode)]
                checks[f"pallas_acp_vs_dense_{mode}_max_abs"] = max(
                    _max_err(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(bb)))
            bases = {"mosaic": "pallas", "mosaic-acp": "pallas-acp", "pallas-seg": "pallas", "mosaic-seg": "mosaic",
                     **{name: base for name, (base, _) in MOSAIC_VARIANTS.items()}}
            for other, base in bases.items():
                if (base, mode) in outs and (other, mode) in outs:
                    a, bb = outs[(base, mode)], outs[(other, mode)]
                    checks[f"{other}_vs_{base}_{mode}_max_abs"] = max(
                        _max_err(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(bb)))
            if ("pallas", mode) in outs and ("pallas-prev", mode) in outs:
                a, bb = outs[("pallas", mode)], outs[("pallas-prev", mode)]
                checks[f"pallas_vs_prev_tiles_{mode}_max_abs"] = max(
                    _max_err(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(bb)))
            for var, (base, _) in VARIANTS.items():
                if (var, mode) in outs and (base, mode) in outs:
                    a, bb = outs[(var, mode)], outs[(base, mode)]
                    checks[f"{var}_vs_{base}_{mode}_max_abs"] = max(_max_err(x, y) for x, y in zip(
                        jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(bb)))
            nonfinite = [impl for (impl, m), o in outs.items() if m == mode and not all(
                bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree_util.tree_leaves(o))]
            if nonfinite:
                checks[f"nonfinite_{mode}"] = nonfinite
        shape_res["checks"] = checks
        if checks:
            log(f"   checks: {checks}")
        del outs
        for impl in [i for i in impls if i in TORCH_IMPLS]:
            if impl == "fla" and not fla_available():
                shape_res["impls"]["fla"] = dict(error="fla-core / torch CUDA not importable")
            elif impl.startswith("fox-triton") and fox_triton is None:
                shape_res["impls"][impl] = dict(error="needs --fox-triton DIR")
            else:
                try:
                    shape_res["impls"][impl] = bench_torch(impl, arrays, d, fox_triton)
                except Exception as e:  # noqa: BLE001
                    shape_res["impls"][impl] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
            log(f"   {impl:14s} {shape_res['impls'][impl]}")
        for impl, r in shape_res["impls"].items():
            fwd, fb = r.get("fwd"), r.get("fwd_bwd")
            r["bwd"] = None if fwd is None or fb is None else fb - fwd
            r["tflops_fwd"] = None if fwd is None else fl / fwd / 1e9
            r["tflops_fwd_bwd"] = None if fb is None else 3.5 * fl / fb / 1e9
            r["tflops_bwd"] = None if r["bwd"] is None or r["bwd"] <= 0 else 2.5 * fl / r["bwd"] / 1e9
            if impl.startswith("pallas-acp"):
                fr = frac_tr if impl == "pallas-acp-trained" else frac
                if fr is None:
                    continue
                ex_f = 1.0 - fr["fwd"]
                ex_b = 1.0 - 0.5 * (fr["dq"] + fr["dkv"])
                r["executed_tflops_fwd"] = None if fwd is None else r["tflops_fwd"] * ex_f
                r["executed_tflops_fwd_bwd"] = None if fb is None else 3.5 * fl * (ex_f + 2.5 * ex_b) / 3.5 / fb / 1e9
        results.append(shape_res)
    return results


def fmt(ms, tf):
    return "–" if ms is None else f"{ms:.3f} ({tf:.1f})"


def markdown(results, impls):
    lines = []
    heads = [f"B{r['shape']['B']} T{r['shape']['T']} H{r['shape']['H']} D{r['shape']['D']}" for r in results]
    for mode, tkey in (("fwd", "tflops_fwd"), ("bwd", "tflops_bwd"), ("fwd_bwd", "tflops_fwd_bwd")):
        lines.append(f"\n### {mode}: ms (TFLOP/s{', dense-equivalent for ACP' if mode != 'bwd' else ''})\n")
        lines.append("| implementation | " + " | ".join(heads) + " |")
        lines.append("|---|" + "---|" * len(heads))
        for impl in impls:
            cells = []
            for r in results:
                x = r["impls"].get(impl, {})
                cells.append(fmt(x.get(mode), x.get(tkey) or 0.0))
            lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    lines.append("\nACP tiles skipped (fwd / dq / dkv): " + "; ".join(
        f"T{r['shape']['T']}: " + "/".join(f"{r['acp_fraction_skipped'][kk]:.3f}" for kk in ("fwd", "dq", "dkv"))
        + f" (ideal element-level {r['acp_ideal_prunable']:.3f})" for r in results))
    trained = [r for r in results if "acp_trained_fraction_skipped" in r]
    if trained:
        info = trained[0]["trained_gates"]
        lines.append(
            f"\nACP tiles skipped with gates from the trained FoX {info['run_dir']} (step {info['step']}, "
            f"trained at T={info['train_seq_len']}, {info['model_layers']} layers × {info['model_heads']} heads cycled "
            f"over the benchmark's (batch, head) slots; one validation window"
            f"{', tiled' if any(r['trained_gates']['tiled'] for r in trained) else ''}) (fwd / dq / dkv): "
            + "; ".join(f"T{r['shape']['T']}: " + "/".join(
                f"{r['acp_trained_fraction_skipped'][kk]:.3f}" for kk in ("fwd", "dq", "dkv"))
                + f" (ideal element-level {r['acp_trained_ideal_prunable']:.3f})" for r in trained))
    return "\n".join(lines)


def versions():
    v = dict(python=platform.python_version(), jax=jax.__version__, backend=jax.default_backend(),
             device=str(jax.devices()[0].device_kind))
    try:
        import jaxlib
        v["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    for mod in ("torch", "triton", "fla"):
        try:
            m = __import__(mod)
            v[mod] = getattr(m, "__version__", "?")
        except Exception:  # noqa: BLE001
            v[mod] = None
    return v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run, interpret mode)")
    ap.add_argument("--sweep", action="store_true", help="tune the Pallas tiles first and use the best")
    ap.add_argument("--bwd-sweep", action="store_true",
                    help="only compare the dense backward variants (BWD_VARIANTS: defaults, interleaved "
                         "backward grid, 4-stage dK/dV, both) at the D=128 anchor shapes (or --shapes), with "
                         "bitwise determinism checks; then exit")
    ap.add_argument("--repeats", type=int, default=3, help="--bwd-sweep: runs of the 4-stage variants compared bitwise")
    ap.add_argument("--sweep-shapes", default=None, metavar="BxTxHxD,...",
                    help="--sweep at these shapes (one per head dim) instead of SWEEP_SHAPES")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--shapes", default=None, help="e.g. 4x4096x32x64,2x8192x16x128")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--gates-from", default=None, metavar="RUN_DIR",
                    help="a training run (fox-jax train workdir): add the row pallas-acp-trained, ACP 'auto' "
                         "on that model's log forget gates of one validation window (see TrainedGates)")
    ap.add_argument("--gates-step", type=int, default=None, help="checkpoint step for --gates-from (latest)")
    ap.add_argument("--fox-triton", default=None, metavar="DIR",
                    help="directory of the official FoX Triton kernel's forgetting_attention.py (benchmark-only copy, "
                         "e.g. ../shared/anchors/fox_triton): enables fox-triton and fox-triton-acp")
    ap.add_argument("--mosaic-sweep", default=None, metavar="BQxBKxST[xBBQxBBKxBST[p]],...",
                    help="first time the Mosaic kernels at these tilings on --shapes: forward block_q x block_k x "
                         "stages, then the backward's (BBQ = 0: the Triton backward), p: the backward's ping-pong, "
                         "e.g. 64x128x3x64x64x2,64x128x3x64x64x2p")
    ap.add_argument("--sweep-acp", choices=["off", "on", "both"], default="off",
                    help="--mosaic-sweep: time each tiling without ACP (off), with adaptive_threshold='auto' (on), "
                         "or both")
    ap.add_argument("--skip-dense-bwd-above", type=int, default=8192,
                    help="skip xla-dense fwd+bwd above this T (its logits do not fit)")
    args = ap.parse_args(argv)
    impls = [x for x in args.impls.split(",") if x]
    unknown = [x for x in impls if x not in ALL_IMPLS]
    if unknown:
        ap.error(f"--impls: unknown {', '.join(unknown)}; expected names from {', '.join(ALL_IMPLS)}")
    if args.shapes:
        shapes = parse_shapes(args.shapes, "--shapes", ap.error)
    else:
        shapes = QUICK_SHAPES if args.quick else ANCHOR_SHAPES
    info = versions()
    log(json.dumps(info))
    out = dict(versions=info, flop_convention="fwd = 2·B·H·T²·D (causal); fwd+bwd = 3.5×fwd; bwd = 2.5×fwd",
               timing="median wall time of async-dispatched jitted calls; bwd = (fwd+bwd) − fwd; "
                      "PyTorch implementations (fla, fox-triton, torch-cudnn) via triton.testing.do_bench (median)")
    if args.bwd_sweep:
        if not args.shapes:
            shapes = BWD_SWEEP_QUICK if args.quick else BWD_SWEEP_SHAPES
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        t0 = time.perf_counter()
        out["bwd_sweep"] = []
        for shape in shapes:  # write the JSON after every shape so a timeout keeps what was measured
            try:
                out["bwd_sweep"] += bwd_sweep([shape], args.workers, repeats=args.repeats)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                out.setdefault("errors", []).append(dict(shape=shape, error=traceback.format_exc()[-2000:]))
            out["markdown"] = bwd_sweep_markdown(out["bwd_sweep"])
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1, default=str)
        log(out["markdown"])
        log(f"bwd sweep done in {time.perf_counter() - t0:.1f}s")
        return
    trained = None
    if args.gates_from:
        trained = TrainedGates(args.gates_from, args.gates_step)
        if "pallas-acp-trained" not in impls:
            impls.append("pallas-acp-trained")
    fox_triton = None
    if args.fox_triton:
        try:
            fox_triton = load_fox_triton(args.fox_triton)
        except Exception as e:  # noqa: BLE001  (no torch/triton here: its rows say why)
            out["fox_triton_error"] = f"{type(e).__name__}: {e}"
            log(f"official FoX kernel not loadable: {out['fox_triton_error']}")
    if args.mosaic_sweep:
        out["mosaic_sweep"] = mosaic_sweep(shapes, parse_mosaic_configs(args.mosaic_sweep, "--mosaic-sweep", ap.error),
                                           {"off": (False,), "on": (True,), "both": (False, True)}[args.sweep_acp])
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        if not impls:
            return
    configs = {}
    if args.sweep:
        try:
            sweep_shapes = None
            if args.sweep_shapes:
                sweep_shapes = {}
                for spec in args.sweep_shapes.split(","):
                    bb, tt, hh, dd = (int(y) for y in spec.split("x"))
                    sweep_shapes[dd] = (bb, tt, hh, dd)
            configs, table = sweep_tiles(args.workers, quick=args.quick, shapes=sweep_shapes)
            out["sweep"] = table
            out["sweep_best"] = {str(d): dataclasses.asdict(c) for d, c in configs.items()}
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            out["sweep_error"] = traceback.format_exc()[-2000:]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    results = []
    for shape in shapes:  # write the JSON after every shape so a timeout keeps what was measured
        try:
            results += run([shape], impls, args.workers, configs, args.skip_dense_bwd_above, trained, fox_triton)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            out.setdefault("errors", []).append(dict(shape=shape, error=traceback.format_exc()[-2000:]))
        out["results"] = results
        out["markdown"] = markdown(results, impls)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    log(out["markdown"])


if __name__ == "__main__":
    main()
