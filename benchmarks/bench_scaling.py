"""Weak scaling of training over the devices of one host, against one device, in one command (issue 24).

For each ``arch:size:seq_len`` and ACP setting, the real train step (``bench_train.bench_one``: AdamW, clipping,
bf16 compute) is timed first on one device (a mesh over ``jax.devices()[:1]``) with ``--tokens-per-device``
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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import jax

from bench_train import bench_one
from fox_jax.sharding import parse_mesh
from profile_step import parse_variant

ROW_KEY = ("arch", "size", "seq_len", "acp", "mesh")
DEFAULT_CONFIGS = ("fox-pro:760M:16384", "fox-pro:125M:2048")
DEFAULT_MESHES = ("data=4", "fsdp=4", "data=2,fsdp=2", "fsdp=2,tensor=2")


def parse_config(entry: str) -> tuple[str, str, int]:
    """``"arch:size:seq_len"`` -> (arch, size, seq_len). Raises ValueError naming ``--configs``."""
    parts = entry.split(":")
    if len(parts) != 3 or not parts[2].isdigit():
        raise ValueError(f"--configs: expected arch:size:seq_len (e.g. fox-pro:760M:16384), got {entry!r}")
    return parts[0], parts[1], int(parts[2])


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
                row = dict(row, mesh=mesh, devices=k, tokens_per_s=row.get("tokens_per_sec"))
                row.pop("tokens_per_sec", None)
                if devices is not None:
                    base = row.get("tokens_per_s")
                row["baseline_tokens_per_s"] = base
                row["efficiency"] = row["tokens_per_s"] / (k * base) if row["tokens_per_s"] and base else None
                rows.append(row)
                log(json.dumps(row))
    return rows


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each row of ``new`` replacing the row of the same ``ROW_KEY`` (or appended)."""
    key = lambda r: tuple(r.get(k) for k in ROW_KEY)  # noqa: E731
    fresh = {key(r): r for r in new}
    kept = [r for r in old if key(r) not in fresh]
    return kept + list(new)


def table(rows: list[dict]) -> str:
    """The markdown table of the rows (README / docs)."""
    out = ["| model | context | ACP | devices | mesh | batch | tokens/s | MFU | efficiency |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        model = f"{r['arch']} {r['size']}"
        head = f"| {model} | {r['seq_len']} | {'on' if r['acp'] else 'off'} | {r['devices']} | {r['mesh']} |"
        if r.get("error"):
            out.append(f"{head} – | {r['error'][:60]} | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "–"
        eff = f"{100 * r['efficiency']:.1f}%" if r.get("efficiency") else "–"
        out.append(f"{head} {r['batch']} | {r['tokens_per_s']:,.0f} | {mfu} | {eff} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="arch:size:seq_len entries")
    p.add_argument("--meshes", nargs="+", default=list(DEFAULT_MESHES),
                   help="meshes over all devices (data=4, fsdp=2,tensor=2, ...)")
    p.add_argument("--acp", choices=["off", "on", "both"], default="both")
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
    p.add_argument("--quick", action="store_true", help="CPU smoke run: the tiny model, float32, 2 steps")
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
    configs = [parse_config(c) for c in args.configs]
    for mesh in args.meshes:
        parse_mesh(mesh)  # a bad --meshes entry fails here, before any compile
    acps = {"off": [False], "on": [True], "both": [False, True]}[args.acp]
    rows = scaling_rows(configs, args.meshes, acps, args.tokens_per_device, args.steps, args.warmup,
                        dtype=args.dtype, remat=args.remat, overrides=overrides)
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            rows = merge_rows(json.load(f)["rows"], rows)
    meta = dict(device=jax.devices()[0].device_kind, n_devices=jax.device_count(), jax=jax.__version__,
                python=platform.python_version(), dtype=args.dtype, tokens_per_device=args.tokens_per_device)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
