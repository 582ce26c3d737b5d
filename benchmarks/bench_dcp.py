"""DCP attention speed: ``dcp_attention`` blockwise XLA vs the Pallas kernels, at several mask sparsities.

For each shape and target sparsity, a DCP mask is built the way the models build it
(``cumulative_keep_log_mask(keep_logits(q_int, k_int, β), α=∞)``, r = 64) with β found by bisection
so that the fraction of causal pairs dropped is near the target; then fwd and fwd+bwd (gradients into
q, k, v, the mask and the gates) of both implementations are timed side by side, with dense Pallas
forgetting attention (no mask) as the reference point: the table ends with DCP Pallas / dense Pallas
ratios (the target: ≤ 1 at ≥ 50 % sparsity). Prints the table, writes JSON (device, versions, shapes,
achieved sparsity, fraction of the causal tiles each Pallas kernel skips, the ratios).

    python benchmarks/bench_dcp.py --out $OUT/dcp.json
    python benchmarks/bench_dcp.py --quick --out /tmp/dcp.json      # CPU smoke run (interpret mode)

``--grid-orders`` adds the Pallas path in both grid orders (``KernelConfig.interleave_heads``): the heads of one
block in consecutive programs, which then share the layer's one mask (a float32 [B, Tq, Tk] array, as many bytes
per tile as K and V at D = 64) in L2, or the blocks of one head consecutive. ``resolve_dcp_config`` picks the
first when one batch row's mask exceeds ``DCP_INTERLEAVE_MASK_BYTES`` (the plain "pallas" row is that default).
``--all-masked`` adds the Pallas path with every listed tile element-masked
(``KernelConfig.dcp_unmasked_interior=False``), to measure what the unmasked interior loop buys;
``--no-xla`` leaves out the (slow) blockwise XLA path.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from fox_jax.ops import forgetting_attention
from fox_jax.ops import pallas as fpallas
from fox_jax.ops.context_pruning import (
    LOG_FLOOR,
    cumulative_keep_log_mask,
    dcp_attention,
    dropped_key_blocks,
    keep_logits,
    sparsity,
)
from fox_jax.kernels.forgetting_attention import dmask_tile

from bench_attention import fmt, fwd_flops, log, parse_shapes, time_jax, versions  # a sibling script (benchmarks/ on sys.path)

SHAPES = [(8, 1024, 12, 64), (4, 2048, 16, 128), (1, 8192, 16, 128)]
QUICK_SHAPES = [(1, 64, 2, 32)]
SPARSITIES = [0.5, 0.9]


def make_mask(b: int, t: int, target: float, seed: int = 0):
    """(log_mask [b, t, t] float32 at α=∞, achieved sparsity) for a β bisected towards ``target``."""
    rng = np.random.default_rng(seed)
    qi = jnp.asarray(rng.normal(size=(b, t, 64)) / 8.0, jnp.float32)
    ki = jnp.asarray(rng.normal(size=(b, t, 64)) / 8.0, jnp.float32)
    build = jax.jit(lambda beta: cumulative_keep_log_mask(keep_logits(qi, ki, beta), float("inf")))
    lo, hi = -10.0, 10.0  # sparsity decreases with β
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        s = float(sparsity(build(mid))[1])
        lo, hi = (mid, hi) if s > target else (lo, mid)
    lm = build(0.5 * (lo + hi))
    return lm, float(sparsity(lm)[1])


def _with_config(q, k, v, m, lf, *, d: int, config):
    """``dcp_attention``'s Pallas path under an explicit ``KernelConfig``."""
    return fpallas.dcp_attention(q, k, v, m, jnp.cumsum(lf, axis=1), None, scale=d ** -0.5, floor=LOG_FLOOR,
                                 config=config)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--quick", action="store_true",
                    help="one tiny shape (CPU, interpret mode); without it the shapes are GPU-sized (run on a GPU)")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated BxTxHxD (batch, tokens, heads, head dim), e.g. 8x1024x12x64,4x2048x16x128; "
                         "default " + ",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--sparsities", default=None,
                    help="comma-separated target fractions of the causal (query, key) pairs dropped, default 0.5,0.9")
    ap.add_argument("--grid-orders", action="store_true",
                    help="also time the Pallas path with the heads of a block consecutive (the mask shared in L2) "
                         "and with the blocks of a head consecutive")
    ap.add_argument("--all-masked", action="store_true",
                    help="also time the Pallas path with every listed tile element-masked")
    ap.add_argument("--no-xla", action="store_true", help="leave out the blockwise XLA path")
    args = ap.parse_args(argv)
    shapes = (parse_shapes(args.shapes, "--shapes", ap.error) if args.shapes
              else QUICK_SHAPES if args.quick else SHAPES)
    targets = SPARSITIES
    if args.sparsities:
        try:
            targets = [float(x) for x in args.sparsities.split(",")]
        except ValueError:
            targets = []
        if not targets or not all(0.0 < x < 1.0 for x in targets):
            ap.error(f"--sparsities: expected fractions in (0, 1) separated by commas, got {args.sparsities!r}")
    info = versions()
    log(json.dumps(info))
    rows = []

    def write(impls: dict, final: bool) -> None:  # after every row, so a cut run keeps what was measured
        lines = ["| B×T×H×D | sparsity | " + " | ".join(f"{n} {m}" for n in impls for m in ("fwd", "fwd+bwd")) + " |",
                 "|---" * (2 + 2 * len(impls)) + "|"]
        for r in rows:
            s = r["shape"]
            fl = r["flops_fwd_dense"]
            cells = [fmt(r["ms"].get(f"{n}|{m}"), None if r["ms"].get(f"{n}|{m}") is None else
                         fl * (1.0 if m == "fwd" else 3.5) / r["ms"][f"{n}|{m}"] / 1e9)
                     for n in impls for m in ("fwd", "fwd_bwd")]
            shape = f"{s['B']}×{s['T']}×{s['H']}×{s['D']}"
            lines.append(f"| {shape} | {100 * r['sparsity']:.0f}% | " + " | ".join(cells) + " |")
        ratio_names = [n for n in impls if n.startswith("pallas")]
        lines += ["", "| B×T×H×D | sparsity | tiles skipped fwd/dq/dkv | "
                  + " | ".join(f"{n} / dense {m}" for n in ratio_names for m in ("fwd", "fwd+bwd")) + " |",
                  "|---" * (3 + 2 * len(ratio_names)) + "|"]
        for r in rows:
            s = r["shape"]
            sk = r["causal_tiles_skipped"]
            cells = [("—" if r["ratio_vs_dense"].get(f"{n}|{m}") is None else f"{r['ratio_vs_dense'][f'{n}|{m}']:.2f}×")
                     for n in ratio_names for m in ("fwd", "fwd_bwd")]
            lines.append(f"| {s['B']}×{s['T']}×{s['H']}×{s['D']} | {100 * r['sparsity']:.0f}% | "
                         f"{100 * sk['fwd']:.0f}/{100 * sk['dq']:.0f}/{100 * sk['dkv']:.0f}% | " + " | ".join(cells) + " |")
        table = "\n".join(lines)
        if final:
            log("\nms (dense-equivalent TFLOP/s: the dense causal FLOPs, whatever the mask drops)\n" + table)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(versions=info, rows=rows, markdown=table), f, indent=1)

    for b, t, h, d in shapes:
        rng = np.random.default_rng(1)
        q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.bfloat16) for _ in range(3))
        lf = jax.nn.log_sigmoid(jnp.asarray(rng.normal(3.0, 1.0, size=(b, t, h)), jnp.float32))
        do = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.bfloat16)
        dense = lambda q, k, v, m, lf: forgetting_attention(q, k, v, lf, implementation="pallas")  # noqa: E731
        impls = {} if args.no_xla else {"xla": lambda q, k, v, m, lf: dcp_attention(q, k, v, m, lf,
                                                                                     implementation="xla")}
        impls["pallas"] = lambda q, k, v, m, lf: dcp_attention(q, k, v, m, lf, implementation="pallas")
        variants = ({"pallas heads interleaved": dict(interleave_heads=True),
                     "pallas heads apart": dict(interleave_heads=False)} if args.grid_orders else {})
        variants.update({"pallas all masked": dict(dcp_unmasked_interior=False)} if args.all_masked else {})
        for name, change in variants.items():  # the Pallas path with one KernelConfig field changed
            impls[name] = functools.partial(_with_config, d=d,
                                            config=dataclasses.replace(fpallas.resolve_dcp_config(d, t, t), **change))
        impls["dense pallas (no mask)"] = dense
        for target in targets:
            lm, achieved = make_mask(b, t, target)
            cfg = fpallas.resolve_config(d, t, t)
            skipped = {}
            for name, tile in (("fwd", cfg.fwd), ("dq", cfg.dq), ("dkv", cfg.dkv), ("dlogI", dmask_tile(cfg))):
                flagged = dropped_key_blocks(lm, tile.block_q, tile.block_k)
                causal = ~dropped_key_blocks(jnp.zeros_like(lm), tile.block_q, tile.block_k, floor=-jnp.inf)
                skipped[name] = float(jnp.sum(flagged & causal) / jnp.sum(causal))
            row = dict(shape=dict(B=b, T=t, H=h, D=d), target_sparsity=target, sparsity=achieved,
                       causal_tiles_skipped=skipped, flops_fwd_dense=fwd_flops(b, t, h, d), ms={})
            for name, fn in impls.items():
                fwd = jax.jit(fn)

                def fwd_bwd(q, k, v, m, lf, _fn=fn):
                    out, vjp = jax.vjp(_fn, q, k, v, m, lf)
                    return vjp(do)
                for mode, f in (("fwd", fwd), ("fwd_bwd", jax.jit(fwd_bwd))):
                    try:
                        row["ms"][f"{name}|{mode}"] = time_jax(f, (q, k, v, lm, lf), target_s=0.3, min_reps=3)
                    except Exception as e:  # noqa: BLE001 - OOM or unsupported: record and go on
                        row["ms"][f"{name}|{mode}"] = None
                        row.setdefault("errors", {})[f"{name}|{mode}"] = f"{type(e).__name__}: {str(e)[:200]}"
            dense_ms = {m: row["ms"].get(f"dense pallas (no mask)|{m}") for m in ("fwd", "fwd_bwd")}
            row["ratio_vs_dense"] = {f"{n}|{m}": (None if row["ms"].get(f"{n}|{m}") is None or not dense_ms[m]
                                                  else row["ms"][f"{n}|{m}"] / dense_ms[m])
                                     for n in impls if n.startswith("pallas") for m in ("fwd", "fwd_bwd")}
            log(json.dumps(row))
            rows.append(row)
            write(impls, final=False)
    write(impls, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
