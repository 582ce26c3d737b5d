"""Where a decode step spends its device time: a ``jax.profiler`` trace of ``fox_jax.decoding.generate``.

For each cache policy, the same model and prompts are generated twice by one compiled program, each in its own trace:
stopped after the first sample (``generate(steps=1)``: the prefill) and with all ``--new-tokens N``. The difference of the two,
divided by the N − 1 decode steps, is the decode step: its wall time, its kernels (count and time per
category, the categories of ``profile_step.py``), and the top kernels and JAX ops by time. The bound is the
bytes a step must read (the weights once, the live KV once) at ``--bandwidth`` TB/s (default the device's HBM peak).

    python benchmarks/profile_decode.py --model gpt2 --batch 32 --prompt 896 --new-tokens 128 \\
        --policies dense,window:256 --out $OUT/profile_decode.json
    python benchmarks/profile_decode.py --quick        # CPU smoke run (tiny model; "kernels" are XLA CPU thunks)

``--kernel-variants``: the same profile once per variant of the Pallas decode kernel, each a fresh compile (a
few layers are enough: ``--set n_layers=4``), to choose its launch settings and to price what it fuses. A variant
is ``name`` or ``name:key=value,...`` with keys of ``kernels.decode_attention.DecodeConfig`` (num_warps,
num_stages, block_k, num_splits: replacing the default tiling; fold_floor, late_writes, early_epilogue: 0 or 1),
``gates=xla`` (the gate logits computed by
XLA and read by the kernel, as for a d_model that is not a multiple of 16, instead of inside the kernel),
``head=stored`` (the untied LM head multiplied as stored, [d, V] with unaligned rows, instead of the copy padded to
128 columns that ``decode_variables`` makes once), ``norm=folded`` / ``norm=applied`` (each block's input RMSNorm
folded into its attention's projections and applied by the decode kernel as a row scale, or a kernel of its own
before the QKV GEMM: ``fox_jax.decoding.generation.FOLD_INPUT_NORMS``, on by default; ``gates=xla`` applies it),
``mlp=fused`` / ``mlp=xla`` (each block's MLP norm and SwiGLU as one Pallas kernel, ``fox_jax.ops.decode_mlp``, or
XLA's four: ``generation.FUSE_DECODE_MLP``, off by default) with the fused kernel's tiling as ``mlp_block_h=16``,
``mlp_block_k``, ``mlp_block_n``, ``mlp_num_warps``, ``mlp_num_stages``:

    python benchmarks/profile_decode.py --model fox-pro:125M --set n_layers=4 --batch 8 --prompt 2048 \\
        --new-tokens 64 --slots 128 --policies acp --kernel-variants base w2:num_warps=2 nofold:fold_floor=0 \\
        xla-gates:gates=xla stored-head:head=stored folded-norm:norm=folded --out $OUT/profile_decode_variants.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from fox_jax.cache.policies import parse_policy
from fox_jax.decoding import cache_bytes, generate, min_slots
from fox_jax.decoding import generation as gen
from fox_jax.kernels import decode_attention as dk
from fox_jax.kernels import decode_mlp as km

decode_op = importlib.import_module("fox_jax.ops.decode_attention")  # the module (fox_jax.ops exports the function)
gpt2_model = importlib.import_module("fox_jax.models.gpt2")

# sibling scripts (benchmarks/ is on sys.path when this file runs as a script)
from bench_decode import bound_bandwidth, model_config, weight_bytes_read
from profile_step import CATEGORIES, parse_hlo, summarize, trace_calls


def _hlo_text(model, params, tokens, policy, slots, new_tokens: int, steps_per_check: int,
              prefill_chunk: int) -> str:
    """The optimized HLO of the generate program (the same preamble as ``generate``)."""
    padded, caches, chunk = gen._fresh_caches(model, tokens, policy, slots, None, prefill_chunk,
                                              tokens.shape[1] + new_tokens - 1)
    lowered = gen._generate.lower(model, params, padded, caches, jax.random.PRNGKey(0), chunk, new_tokens,
                                  0.0, None, None, (), gen.cast_plan(model, params, caches), steps_per_check,
                                  jnp.int32(new_tokens))
    return lowered.compile().as_text()


def profile_policy(model, params, tokens, spec: str, new_tokens: int, repeats: int, top: int,
                   bandwidth_tb_s: float, weight_bytes: int, pool: int | None = None,
                   slot_multiple: int | None = None, steps_per_check: int = gen.STEPS_PER_CHECK,
                   prefill_chunk: int = 512) -> dict:
    policy = parse_policy(spec)
    # the same pool for both programs (the one N new tokens need, or --slots for a data-dependent policy), so
    # their prefills are the same work
    slots = min_slots(policy, tokens.shape[1] + new_tokens - 1)
    if pool is not None and not policy.fixed_budget:
        slots = min(pool, slots)
    if slot_multiple:  # a larger ring never wraps: the same tokens, a pool the kernel's block_k divides
        slots = -(-slots // slot_multiple) * slot_multiple
    # one program: n = 1 stops it after the first sample (generate's steps), n = N runs every decode step
    run = lambda n: generate(model, params, tokens, max_new_tokens=new_tokens, policy=policy, slots=slots, steps=n,
                              steps_per_check=steps_per_check, prefill_chunk=prefill_chunk)
    t0 = time.perf_counter()
    jax.block_until_ready(run(new_tokens).tokens)  # compile (and one run)
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(run(1).tokens)  # the same program; its first call at n = 1 is not timed either
    walls = {1: [], new_tokens: []}
    for _ in range(repeats):
        for n in walls:
            t0 = time.perf_counter()
            jax.block_until_ready(run(n).tokens)
            walls[n].append(time.perf_counter() - t0)
    step_ms = (statistics.median(walls[new_tokens]) - statistics.median(walls[1])) / (new_tokens - 1) * 1e3
    out = run(new_tokens)
    kv = cache_bytes(out.caches)
    infos = parse_hlo(_hlo_text(model, params, tokens, policy, slots, new_tokens, steps_per_check, prefill_chunk))
    summaries = {}
    for n in (1, new_tokens):
        events, _, source = trace_calls(lambda: run(n).tokens, 1)
        summaries[n] = (summarize(events, 1, infos, None, 10 ** 6), len(events), source)
    (s1, n1, _), (sn, nn, source) = summaries[1], summaries[new_tokens]
    steps = new_tokens - 1
    per_cat = {c: (sn["per_step_ms"][c] - s1["per_step_ms"][c]) / steps for c in CATEGORIES}

    def diff(rows_n, rows_1, key):
        base = {r[key]: r for r in rows_1}
        rows = []
        for r in rows_n:
            b = base.get(r[key], {"ms": 0.0, "calls": 0})
            rows.append(dict(r, ms=(r["ms"] - b["ms"]) / steps, calls=(r["calls"] - b["calls"]) / steps))
        return sorted([r for r in rows if r["calls"] > 0.5], key=lambda r: -r["ms"])[:top]

    live = kv["live"]
    bound_ms = (weight_bytes + live) / (bandwidth_tb_s * 1e12) * 1e3
    return dict(policy=policy.spec, step_ms=step_ms, compile_s=compile_s, kernels_per_step=(nn - n1) / steps,
                device_ms_per_step=sum(per_cat.values()), per_step_ms=per_cat,
                kernels=diff(sn["kernels"], s1["kernels"], "kernel"), ops=diff(sn["ops"], s1["ops"], "jax_op"),
                kv_bytes_allocated=kv["allocated"], kv_bytes_live=live, weight_bytes=weight_bytes,
                bound_ms=bound_ms, slots=slots, overflow=int(jax.numpy.asarray(out.overflow).max()),
                live_tokens=float(jax.numpy.asarray(out.live_counts)[-1].mean()), trace_source=source,
                walls_s={str(k): v for k, v in walls.items()},
                # the generated tokens' digest: two variants (or XLA_FLAGS) that change no value give the same one
                tokens_sha256=hashlib.sha256(np.asarray(out.tokens).tobytes()).hexdigest()[:16])


def parse_kernel_variant(spec: str) -> tuple[str, dict]:
    """``"name"`` or ``"name:key=value,..."`` -> (name, settings); keys: DecodeConfig fields, ``gates``, ``head``,
    ``norm``, ``mlp``, ``proj``, ``qkv`` (GPT-2's ``DECODE_QKV``).

    Raises:
      ValueError: an unknown key or a bad value (an int for the DecodeConfig tilings, 0 or 1 for its switches).
    """
    name, _, rest = spec.partition(":")
    fields = {f.name for f in dataclasses.fields(dk.DecodeConfig)} | {
        "mlp_" + f.name for f in dataclasses.fields(km.MlpConfig)}
    switches = {f.name for f in dataclasses.fields(dk.DecodeConfig) if f.type in (bool, "bool")} | {
        "mlp_" + f.name for f in dataclasses.fields(km.MlpConfig) if f.type in (bool, "bool")}
    choices = {"gates": ("xla", "kernel"), "head": ("stored", "padded"), "norm": ("folded", "applied"),
               "mlp": ("fused", "xla"), "proj": ("kernel", "xla"), "qkv": ("plain", "parts")}
    settings = {}
    for item in [x for x in rest.split(",") if x]:
        key, eq, value = item.partition("=")
        if not eq or (key not in fields and key not in choices):
            raise ValueError(f"--kernel-variants {spec!r}: expected key=value with key in "
                             f"{', '.join(sorted(fields | set(choices)))}, got {item!r}")
        if key in choices:
            if value not in choices[key]:
                raise ValueError(f"--kernel-variants {spec!r}: {key} takes {' or '.join(choices[key])}, got {value!r}")
            settings[key] = value
        elif key in switches:
            if value not in ("0", "1"):
                raise ValueError(f"--kernel-variants {spec!r}: {key} takes 0 or 1, got {value!r}")
            settings[key] = value == "1"
        else:
            try:
                settings[key] = int(value)
            except ValueError:
                raise ValueError(f"--kernel-variants {spec!r}: {key} takes an int, got {value!r}") from None
    return name, settings


@contextlib.contextmanager
def kernel_variant(settings: dict):
    """The decode kernel as ``settings`` says while the block runs (module functions wrapped; jit caches cleared
    on entry and exit so that every program is traced again)."""
    tiling = {k: v for k, v in settings.items() if k not in ("gates", "head", "norm", "mlp", "proj", "qkv") and
              not k.startswith("mlp_")}
    mlp_tiling = {k[len("mlp_"):]: v for k, v in settings.items() if k.startswith("mlp_")}
    saved = (dk.default_decode_config, decode_op._step_arrays, gen.head_table, gen.gate_tables, gen.FOLD_INPUT_NORMS,
             gen.FUSE_DECODE_MLP, km.default_mlp_config, gen.FUSE_OUTPUT_PROJ, gpt2_model.DECODE_QKV)
    base_config, base_arrays, _, base_tables, _, _, base_mlp_config, _, _ = saved

    def config(*args, **kwargs):
        return dataclasses.replace(base_config(*args, **kwargs), **tiling)

    def mlp_config(*args, **kwargs):
        return dataclasses.replace(base_mlp_config(*args, **kwargs), **mlp_tiling)

    def arrays(step, *args, **kwargs):
        out = base_arrays(step, *args, **kwargs)
        if out.gate_x is None:
            return out
        return dataclasses.replace(out, gate_x=None, gate_w=None, gate_table=None,
                                   gate_rows=step.ops.gate_logits(len(out.gate_w))[:, 0])

    jax.clear_caches()
    dk.default_decode_config = config
    if settings.get("gates") == "xla":
        decode_op._step_arrays = arrays
    if settings.get("head") == "stored":
        gen.head_table = lambda params: {}
    if "norm" in settings:
        gen.FOLD_INPUT_NORMS = settings["norm"] == "folded"
    if "mlp" in settings:
        gen.FUSE_DECODE_MLP = settings["mlp"] == "fused"
    if "proj" in settings:
        gen.FUSE_OUTPUT_PROJ = settings["proj"] == "kernel"
    if "qkv" in settings:
        gpt2_model.DECODE_QKV = settings["qkv"]
    km.default_mlp_config = mlp_config
    if settings.get("gates") == "xla":  # (a folded norm needs the kernel to read x for the gate logits)
        gen.gate_tables = lambda params, folded_norms=False, project_out=False: base_tables(params)
    try:
        yield
    finally:
        (dk.default_decode_config, decode_op._step_arrays, gen.head_table, gen.gate_tables,
         gen.FOLD_INPUT_NORMS, gen.FUSE_DECODE_MLP, km.default_mlp_config, gen.FUSE_OUTPUT_PROJ,
         gpt2_model.DECODE_QKV) = saved
        jax.clear_caches()


def print_report(row: dict) -> None:
    variant = f" [{row['variant']}]" if "variant" in row else ""
    print(f"\n== {row['policy']}{variant}: {row['step_ms']:.3f} ms/step wall, {row['device_ms_per_step']:.3f} ms device, "
          f"compiled in {row['compile_s']:.0f} s, "
          f"{row['kernels_per_step']:.0f} kernels/step, bound {row['bound_ms']:.3f} ms "
          f"(weights {row['weight_bytes'] / 2**20:.0f} MiB + live KV {row['kv_bytes_live'] / 2**20:.0f} MiB; "
          f"allocated {row['kv_bytes_allocated'] / 2**20:.0f} MiB); tokens {row['tokens_sha256']}")
    if row["step_ms"] < 0 or row["device_ms_per_step"] < 0:
        print("  (a negative time: a difference of two runs — wall: of two medians; device: of two traces — noise at "
              "this size; use more --new-tokens and --repeats)")
    print("  " + "  ".join(f"{c} {row['per_step_ms'][c]:.3f}" for c in CATEGORIES))
    print(f"  {'ms/step':>8} {'calls':>6}  {'category':<11} JAX op")
    for r in row["ops"]:
        print(f"  {r['ms']:8.4f} {r['calls']:6.1f}  {r['category']:<11} {r['jax_op'][:110]}")
    print(f"  {'ms/step':>8} {'calls':>6}  {'category':<11} kernel (its HLO op where the name differs)")
    for r in row["kernels"][:10]:
        hlo = r["hlo_op"] if r["hlo_op"] != r["kernel"] else ""
        tiling = f"  [{r['shape']} {r['tiling']}]" if r.get("tiling") else ""  # XLA's GEMM tiles (autotuned)
        print(f"  {r['ms']:8.4f} {r['calls']:6.1f}  {r['category']:<11} {r['kernel'][:60]} {hlo[:40]}{tiling}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", help="gpt2 or ARCH:SIZE (random init, as bench_decode.py)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--policies", default="dense,window:256")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=896)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--slots", type=int, help="pool per row and head of the data-dependent policies (acp, dcp); "
                   "default the full context. Check the row's overflow: 0 means the pool held every live key")
    p.add_argument("--slot-multiple", type=int,
                   help="round every policy's pool up to a multiple of this (e.g. 128, for the kernel variant "
                        "block_k=128 on a dense or window ring, whose default pool is a multiple of 64)")
    p.add_argument("--steps-per-check", type=int, default=gen.STEPS_PER_CHECK, metavar="K",
                   help=f"generate's steps_per_check (default {gen.STEPS_PER_CHECK}; 1: the end checked every step)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="C",
                   help="generate's prefill_chunk (default 512): the prefill's GEMMs have B·C rows; a small C shortens "
                        "an exhaustive GEMM autotuning of the whole program and leaves the decode step as it is")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--param-dtype", default="float32", choices=("bfloat16", "float32"),
                   help="dtype the parameters are stored in (float32: as init_params / checkpoints give them)")
    p.add_argument("--bandwidth", type=float, help="TB/s of the bound (default the device's HBM peak; 4.8 where "
                   "unknown)")
    p.add_argument("--kernel-variants", nargs="*", default=[], metavar="NAME[:KEY=VALUE,...]",
                   help="profile once per variant of the Pallas decode kernel (see the module docstring)")
    p.add_argument("--out", default="profile_decode.json")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny model and short prompts")
    args = p.parse_args(argv)
    if args.steps_per_check < 1:
        p.error(f"--steps-per-check: expected an int ≥ 1, got {args.steps_per_check}")
    if args.prefill_chunk < 1:
        p.error(f"--prefill-chunk: expected an int ≥ 1, got {args.prefill_chunk}")
    if args.slot_multiple is not None and args.slot_multiple < 1:
        p.error(f"--slot-multiple: expected a positive int, got {args.slot_multiple}")
    try:
        variants = [parse_kernel_variant(v) for v in args.kernel_variants] or [(None, {})]
    except ValueError as e:
        p.error(str(e))
    if args.quick:
        print("--quick: a CPU smoke run of the tool; its times are noise, and off a GPU the decode step runs XLA's "
              "path, so the kernel's tilings and switches in --kernel-variants change nothing")
        args.set = args.set or ["n_layers=2", "d_model=64", "n_heads=2", "vocab_size=256"]
        args.batch, args.prompt, args.new_tokens, args.repeats = 2, 16, 6, 3
    args.bandwidth = bound_bandwidth(args.bandwidth)
    cfg = model_config(args.model, args.set).replace(dtype=args.dtype)
    params = cfg.init_params(jax.random.PRNGKey(0))
    if args.param_dtype != "float32":  # every parameter stored in the compute dtype (gates and norms too)
        params = jax.tree_util.tree_map(lambda x: x.astype(args.param_dtype), params)
    weight_bytes = weight_bytes_read(cfg, params, args.dtype)  # as bench_decode.py's bound: what a step reads
    model = cfg.build()
    tokens = jax.random.randint(jax.random.PRNGKey(1), (args.batch, args.prompt), 0, cfg.vocab_size, jnp.int32)
    def holds(tree, key) -> bool:  # ``key`` anywhere in a nested dict
        return isinstance(tree, dict) and (key in tree or any(holds(v, key) for v in tree.values()))

    applies = {"mlp": lambda: bool(gen.mlp_tables(params)),
               "norm": lambda: holds(gen.gate_tables(params, folded_norms=True), "folded")}
    for name, settings in variants:
        idle = [f"{k}={settings[k]}" for k in ("mlp", "norm") if k in settings and not applies[k]()]
        if idle:
            print(f"note: variant {name}: {', '.join(idle)} does not apply to {args.model} (no RMSNorm + SwiGLU block, "
                  f"or no gate projections to fold into): it measures the base program")
    rows = []
    for name, settings in variants:
        with kernel_variant(settings):
            for spec in [s for s in args.policies.split(",") if s]:
                row = profile_policy(model, params, tokens, spec, args.new_tokens, args.repeats, args.top,
                                     args.bandwidth, weight_bytes, args.slots, args.slot_multiple,
                                     args.steps_per_check, args.prefill_chunk)
                row.update(model=args.model, set=args.set, batch=args.batch, prompt=args.prompt,
                           new_tokens=args.new_tokens, bandwidth_tb_s=args.bandwidth,
                           steps_per_check=args.steps_per_check, prefill_chunk=args.prefill_chunk)
                if name is not None:
                    row.update(variant=name, kernel_settings=settings)
                print_report(row)
                rows.append(row)
                meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                            python=platform.python_version(), dtype=args.dtype, param_dtype=args.param_dtype,
                            xla_flags=os.environ.get("XLA_FLAGS", ""), date=time.strftime("%Y-%m-%d %H:%M:%S"))
                with open(args.out, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if len(variants) > 1:
        print(f"\n{'variant':<14} {'policy':<12} {'ms/step':>8} {'device':>8} {'attention':>9} {'kernels':>7} tokens")
        for r in rows:
            print(f"{r['variant']:<14} {r['policy']:<12} {r['step_ms']:8.3f} {r['device_ms_per_step']:8.3f} "
                  f"{r['per_step_ms']['attention']:9.4f} {r['kernels_per_step']:7.0f} {r['tokens_sha256']}")
    print(f"\nwrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
