"""Weak scaling of training over the devices of one host, against one device, in one command (issue 24).

For each ``arch:size:seq_len`` and ACP setting, the real train step (``bench_train.bench_one``: AdamW, clipping,
bf16 compute; ``gpt2-dcp:124M:1024`` is the DCP fine-tune's step of GPT-2 124M) is timed first on one device (a mesh over ``jax.devices()[:1]``) with ``--tokens-per-device``
tokens per step, then on every mesh of ``--meshes`` over all N devices with N times as many (weak scaling: the
same work per device). Each row's ``efficiency`` is its tokens/s over N × the one-device tokens/s of the same
config in the same process (1.0 for the baseline row itself); MFU is per device, as ``bench_train.py``'s.

    python benchmarks/bench_scaling.py --out $OUT/scaling_h200.json        # on nvidia-h200-x4: the issue's table
    python benchmarks/bench_scaling.py --configs fox-pro:125M:2048 --meshes data=4 --acp off --merge \\
        --out $OUT/scaling_h200.json                                       # a part of it, rows merged by key
    python benchmarks/bench_scaling.py --table benchmarks/results/scaling/scaling_h200.json   # the markdown table
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/bench_scaling.py --quick  # CPU smoke run

A row: ``devices``, ``mesh``, ``arch``, ``size``, ``seq_len``, ``acp``, ``tokens_per_s``, ``mfu``, ``efficiency``,
and ``batch``, ``step_ms``, ``compile_s``, ``loss`` (after the timed steps), ``baseline_tokens_per_s``. A config
that fails on a mesh (out of memory, say) gets a row with ``error`` and the command goes on. Whether the losses of
a sharded step equal one device's is the tests' business (tests/test_sharding.py: 8 simulated devices, every mesh
form), not this timing's.

Generation (``--generate MODEL:PROMPT``, e.g. ``fox-pro:125M:8192`` or ``gpt2:896``; ``task: "generate"`` rows): for
each policy of ``--generate-policies``, ``fox_jax.decoding.generate`` of random prompts (random weights, greedy,
``--generate-new-tokens``) with ``--generate-rows-per-device`` rows on one device, then on each mesh of
``--generate-meshes`` (default ``data=N``) with N times as many rows split over its data × fsdp axes — the rows'
caches and the decode kernel per shard (``bench_decode.Bench``: median of ``--generate-repeats``, the pool of
acp/dcp calibrated on one device). ``tokens_per_s`` is the decode rate (B·(N−1) / (generate − prefill)),
``efficiency`` against the one-device row as above, ``policy`` and ``step_ms`` (per decode step) besides.

    python benchmarks/bench_scaling.py --configs --generate fox-pro:125M:8192 gpt2:896 --merge \
        --out $OUT/scaling_h200.json                                       # generation only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import jax

from bench_train import bench_one, parse_config
from fox_jax.sharding import parse_mesh
from profile_step import parse_variant

ROW_KEY = ("task", "arch", "size", "seq_len", "acp", "policy", "mesh")
DEFAULT_GENERATE_POLICIES = ("dense", "acp")
DEFAULT_CONFIGS = ("fox-pro:760M:16384", "fox-pro:125M:2048", "gpt2-dcp:124M:1024")  # gpt2-dcp: bench_train.experiment
DEFAULT_MESHES = ("data=4", "fsdp=4", "data=2,fsdp=2", "fsdp=2,tensor=2")


def scaling_rows(configs, meshes, acps, tokens_per_device: int, steps: int, warmup: int, *, dtype: str = "bfloat16",
                 remat: str | None = None, overrides: dict | None = None, bench=bench_one, log=print) -> list[dict]:
    """The rows of every (config, ACP) pair: the one-device baseline, then each mesh over all devices, each with
    its ``efficiency`` against that baseline. ``bench``: ``bench_train.bench_one``'s signature (a stand-in in tests)."""
    n = jax.device_count()
    rows = []
    for arch, size, seq in configs:
        for acp in acps:
            if acp and not arch.startswith("fox"):
                continue
            base = None
            for mesh, devices in [("data=1", jax.devices()[:1])] + [(m, None) for m in meshes]:
                k = 1 if devices is not None else n
                try:
                    row = bench(arch, size, seq, acp, tokens_per_device * k, steps, warmup, remat, mesh, dtype,
                                model_overrides=overrides, devices=devices)
                except Exception as e:  # out of memory or unsupported: recorded, the command goes on
                    row = dict(arch=arch, size=size, seq_len=seq, acp=acp, mesh=mesh, devices=k,
                               error=f"{type(e).__name__}: {str(e)[:300]}")
                row = dict(row, task="train", policy=None, mesh=mesh, devices=k, tokens_per_s=row.get("tokens_per_sec"))
                row.pop("tokens_per_sec", None)
                if devices is not None:
                    base = row.get("tokens_per_s")
                row["baseline_tokens_per_s"] = base
                row["efficiency"] = row["tokens_per_s"] / (k * base) if row["tokens_per_s"] and base else None
                rows.append(row)
                log(json.dumps(row))
    return rows


def parse_generate(entry: str) -> tuple[str, int]:
    """``"arch:size:prompt"`` or ``"gpt2[-medium...]:prompt"`` -> (bench_decode's --model, prompt length).
    Raises ValueError naming ``--generate``."""
    model, _, prompt = entry.rpartition(":")
    if not prompt.isdigit() or not model or (not model.startswith("gpt2") and model.count(":") != 1):
        raise ValueError(f"--generate: expected arch:size:prompt or gpt2:prompt (e.g. fox-pro:125M:8192), got {entry!r}")
    return model, int(prompt)


def generate_rows(entries, meshes, policies, rows_per_device: int, new_tokens: int, repeats: int, *,
                  dtype: str = "bfloat16", log=print, measure=None) -> list[dict]:
    """Weak scaling of generation: per (model, prompt, policy) the one-device row, then each mesh over all devices with
    N times the rows, each with its ``efficiency``. ``measure(model_spec, prompt, policy, batch, mesh, devices)``
    returns bench_decode's row (a stand-in in tests; default: ``bench_decode.bench_equal`` on a shared ``Bench``)."""
    n = jax.device_count()
    rows, benches = [], {}

    def measure_decode(model_spec, prompt, policy, batch, mesh, devices):
        import bench_decode as bd

        from fox_jax.sharding import kernel_sharding_enabled, make_mesh, select_partitioner

        if model_spec not in benches:
            args = bd.parse_args(["--model", model_spec, "--policies", ",".join(policies), "--new-tokens",
                                  str(new_tokens), "--prompt-lengths", str(prompt), "--equal-batch", "1",
                                  "--repeats", str(repeats), "--dtype", dtype])
            model, params, _ = bd.load_model(args)
            benches[model_spec] = bd.Bench(model, params, bd.Prompts(model.cfg.vocab_size), args)
        bench = benches[model_spec]
        bench.args.equal_batch, bench.args.mesh, bench.mesh = batch, mesh, make_mesh(mesh, devices)
        partitioner = select_partitioner(bench.mesh)  # GSPMD on multi-GPU meshes: the decode kernel per shard
        return dict(bd.bench_equal(bench, policy, prompt), partitioner=partitioner,
                    kernels_sharded=kernel_sharding_enabled() and bench.mesh.size > 1)

    measure = measure or measure_decode
    for model_spec, prompt in entries:
        arch, _, size = model_spec.partition(":")
        for policy in policies:
            base = None
            for mesh, devices in [("data=1", jax.devices()[:1])] + [(m, None) for m in meshes]:
                k = 1 if devices is not None else n
                row = dict(task="generate", arch=arch, size=size or None, seq_len=prompt, acp=policy == "acp",
                           policy=policy, mesh=mesh, devices=k, batch=rows_per_device * k, new_tokens=new_tokens)
                try:
                    r = measure(model_spec, prompt, policy, rows_per_device * k, mesh, devices)
                    if r.get("error"):
                        raise RuntimeError(r["error"])
                    steps = r["seconds"] - r["prefill_seconds"] if r.get("prefill_seconds") is not None else None
                    row.update(tokens_per_s=r.get("decode_tokens_per_sec"),
                               generate_tokens_per_s=r.get("tokens_per_sec"), prefill_s=r.get("prefill_seconds"),
                               step_ms=None if not steps or new_tokens < 2 else 1e3 * steps / (new_tokens - 1),
                               overflow=r.get("overflow"), kv_bytes_allocated=r.get("kv_allocated_bytes"),
                               partitioner=r.get("partitioner"), kernels_sharded=r.get("kernels_sharded"))
                except Exception as e:  # out of memory or unsupported: recorded, the command goes on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                if devices is not None:
                    base = row.get("tokens_per_s")
                row["baseline_tokens_per_s"] = base
                row["efficiency"] = row["tokens_per_s"] / (k * base) if row.get("tokens_per_s") and base else None
                rows.append(row)
                log(json.dumps(row))
    return rows


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each row of ``new`` replacing the row of the same ``ROW_KEY`` (or appended; a row without
    ``task`` is a training row)."""
    key = lambda r: tuple(r.get(k, "train" if k == "task" else None) for k in ROW_KEY)  # noqa: E731
    fresh = {key(r): r for r in new}
    kept = [r for r in old if key(r) not in fresh]
    return kept + list(new)


def table(rows: list[dict]) -> str:
    """The markdown table of the rows (README / docs)."""
    out = ["| model | context | ACP | devices | mesh | batch | tokens/s | MFU | efficiency |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        model = f"{r['arch']} {r['size']}" if r.get("size") else r["arch"]
        what = "on" if r["acp"] else "off"
        if r.get("task") == "generate":  # the policy in the ACP column
            model, what = f"{model} generate", r["policy"]
        head = f"| {model} | {r['seq_len']} | {what} | {r['devices']} | {r['mesh']} |"
        if r.get("error"):
            out.append(f"{head} – | {r['error'][:60]} | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "–"
        eff = f"{100 * r['efficiency']:.1f}%" if r.get("efficiency") else "–"
        out.append(f"{head} {r['batch']} | {r['tokens_per_s']:,.0f} | {mfu} | {eff} |")
    return "\n".join(out)


def _meshes(flag: str, specs) -> list[dict]:
    """parse_mesh of each spec, its errors naming ``flag``."""
    try:
        return [parse_mesh(m) for m in specs]
    except ValueError as e:
        raise ValueError(str(e).replace("--mesh:", f"{flag}:", 1)) from None


def checked(args) -> tuple[list, list, list, list]:
    """(training configs, generation entries, generation meshes, policies) from the flags, checked.

    Raises:
      ValueError: one line naming the flag (a bad entry, a mesh these devices cannot form or that does not split
        the generation rows, an unknown policy).
    """
    from fox_jax.cache.policies import parse_policy

    configs = [parse_config(c) for c in args.configs]
    generate = [parse_generate(g) for g in args.generate]
    try:
        policies = [parse_policy(p).spec for p in args.generate_policies.split(",") if p]
    except ValueError as e:
        raise ValueError(f"--generate-policies: {e}") from None
    if configs:
        _meshes("--meshes", args.meshes)
    gen_meshes = args.generate_meshes or [f"data={jax.device_count()}"]
    if generate:
        for mesh, sizes in zip(gen_meshes, _meshes("--generate-meshes", gen_meshes)):
            if sizes["data"] * sizes["fsdp"] == 1:
                raise ValueError(f"--generate-meshes: {mesh!r} does not split the rows (generation shards them over "
                                 "data x fsdp)")
    if args.generate_rows_per_device < 1:
        raise ValueError(f"--generate-rows-per-device: expected an int >= 1, got {args.generate_rows_per_device}")
    return configs, generate, gen_meshes, policies


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="*", default=list(DEFAULT_CONFIGS),
                   help="arch:size:seq_len entries of the training rows (none: no training rows)")
    p.add_argument("--generate", nargs="*", default=[], metavar="MODEL:PROMPT",
                   help="generation rows: arch:size:prompt or gpt2:prompt entries (e.g. fox-pro:125M:8192 gpt2:896)")
    p.add_argument("--generate-policies", default=",".join(DEFAULT_GENERATE_POLICIES),
                   help="comma-separated cache policies of the generation rows (default dense,acp)")
    p.add_argument("--generate-meshes", nargs="+", help="meshes of the generation rows (default data=N)")
    p.add_argument("--generate-rows-per-device", type=int, default=8)
    p.add_argument("--generate-new-tokens", type=int, default=128)
    p.add_argument("--generate-repeats", type=int, default=3)
    p.add_argument("--meshes", nargs="+", default=list(DEFAULT_MESHES),
                   help="meshes over all devices (data=4, fsdp=2,tensor=2, ...)")
    p.add_argument("--acp", choices=["off", "on", "both"], default="both",
                   help="ACP of the training rows (the generation rows' policies: --generate-policies)")
    p.add_argument("--tokens-per-device", type=int, default=16384, help="tokens per step and device")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--remat", default=None, choices=("none", "full", "dots"),
                   help="activation rematerialisation (default: the model config's, dots)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--overrides", default="", metavar="KEY=VALUE,...", help="ModelConfig overrides (bench_train.py)")
    p.add_argument("--out", default="scaling.json")
    p.add_argument("--merge", action="store_true", help="merge into --out's rows (by model, ACP and mesh)")
    p.add_argument("--table", metavar="FILE", help="print the markdown table of FILE's rows and exit")
    p.add_argument("--quick", action="store_true", help="CPU smoke run (its own configs: the tiny model, float32, "
                   "2 steps; with several devices tiny generation rows too): checks the command, its timings mean "
                   "nothing")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)["rows"]))
        return 0
    overrides = parse_variant(f"overrides:{args.overrides}")[1]
    if args.quick:
        n = jax.device_count()
        args.configs, args.tokens_per_device, args.steps, args.warmup, args.dtype = ["fox-pro:tiny:64"], 128, 2, 1, \
            "float32"
        args.meshes = [m for m in (f"data={n}", f"fsdp={n}") if n > 1] or ["data=1"]
        if n > 1:  # and generation, rows over all devices
            args.generate, args.generate_new_tokens, args.generate_repeats = ["fox-pro:tiny:32"], 4, 1
            args.generate_rows_per_device = 2
    try:
        configs, generate, gen_meshes, policies = checked(args)
    except ValueError as e:  # one line naming the flag, before anything compiles
        p.error(str(e))
    acps = {"off": [False], "on": [True], "both": [False, True]}[args.acp]
    rows = scaling_rows(configs, args.meshes, acps, args.tokens_per_device, args.steps, args.warmup,
                        dtype=args.dtype, remat=args.remat, overrides=overrides)
    if generate:
        rows += generate_rows(generate, gen_meshes, policies, args.generate_rows_per_device,
                              args.generate_new_tokens, args.generate_repeats, dtype=args.dtype)
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            rows = merge_rows(json.load(f)["rows"], rows)
    meta = dict(device=jax.devices()[0].device_kind, n_devices=jax.device_count(), jax=jax.__version__,
                python=platform.python_version(), dtype=args.dtype, tokens_per_device=args.tokens_per_device)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("\n" + table(rows))
    if args.quick:
        print("(--quick: a CPU smoke run of the command; its timings, and so its efficiencies, are noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
