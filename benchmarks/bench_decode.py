"""Decoding speed and KV-cache memory: dense cache vs the DCP packed (pruned) cache, GPT-2 with DCP.

For each prompt length, ``fox_jax.decoding.generate`` runs the same model twice:
  dense   ``packed=False``: every token stays cached (C = prompt + new − 1 columns), no pruning
  packed  ``packed=True``: DCP step-mask pruning; the cache holds live slots only and is resized by the
          host every ``--chunk`` steps (power-of-two buckets ≥ 64)

Reported per run (median of ``--repeats`` after one warm-up run that compiles everything):
  tokens/s         B·N / wall time of generate (prefill + decode loop + host resizes, greedy)
  decode tok/s     B·(N−1) / (generate time − prefill time)
  KV live          bytes of the cached tokens (k, v; k_int for packed), final and mean over the steps
  KV allocated     bytes of the cache buffers at the end (capacity × batch × per-token bytes)
  live tokens      mean live tokens per layer and row at the last step; sparsity = 1 − live/context

Without ``--checkpoint`` the DCP weights are random: q_int/k_int ~ N(0, 1/d) and β = ``--beta`` for
every layer, which prunes at an arbitrary but reproducible rate (``--beta`` sets how much). Real
speedups need a trained DCP model (``--checkpoint``, a directory written by
``fox_jax.models.save_hf_gpt2``) and a GPU; on CPU this only checks that the measurement is right.

Usage:
  python benchmarks/bench_decode.py --quick                         # CPU smoke run, tiny model
  python benchmarks/bench_decode.py --size gpt2 --prompt-lengths 256 512 896 --new-tokens 128 --batch 8
  python benchmarks/bench_decode.py --checkpoint ckpt/gpt2-dcp --out results/decode.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fox_jax.decoding import cache_bytes, generate, prefill  # noqa: E402
from fox_jax.models import load_hf_gpt2  # noqa: E402
from fox_jax.models.gpt2 import GPT2, GPT2Config, gpt2_preset  # noqa: E402

QUICK_CONFIG = dict(n_layers=2, d_model=128, n_heads=4, n_positions=512, interaction_dim=32)


def build_model(args) -> tuple[GPT2, dict]:
    """The DCP GPT-2 under test: a checkpoint, or a random init with pruning interaction weights."""
    if args.checkpoint:
        cfg, params = load_hf_gpt2(args.checkpoint, dcp=True, rng=jax.random.PRNGKey(0), dtype=args.dtype)
        return GPT2(cfg), params
    cfg = (GPT2Config(**QUICK_CONFIG, dtype=args.dtype, dcp=True) if args.quick
           else gpt2_preset(args.size, dtype=args.dtype, dcp=True))
    params = cfg.init_params(jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    for name in cfg.layer_names:
        attn = params[name]["attn"]
        for name in ("q_int", "k_int"):
            shape = attn[name]["kernel"].shape
            attn[name]["kernel"] = jnp.asarray(rng.standard_normal(shape) / math.sqrt(cfg.d_model), jnp.float32)
        attn["beta"] = jnp.asarray(args.beta, jnp.float32)
    return GPT2(cfg), params


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after one warm-up, and the last result."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def bench_one(model, params, prompt_len: int, args, packed: bool) -> dict:
    cfg = model.cfg
    prompt = jax.random.randint(jax.random.PRNGKey(1), (args.batch, prompt_len), 0, cfg.vocab_size)
    n = args.new_tokens
    seconds, out = timed(lambda: generate(model, params, prompt, max_new_tokens=n, packed=packed,
                                          chunk_size=args.chunk), args.repeats)
    prefill_s, _ = timed(lambda: prefill(model, params, prompt, capacity=prompt_len if packed else prompt_len + n - 1,
                                         packed=packed), args.repeats)
    token_bytes = np.asarray([c.token_bytes for c in out.caches])          # [L]
    live = np.asarray(out.live_counts)                                      # [N, L, B]
    live_bytes_per_step = (live.sum(axis=2) * token_bytes[None]).sum(axis=1)
    mem = cache_bytes(out.caches)
    context = prompt_len + n - 1
    return dict(
        prompt_len=prompt_len, new_tokens=n, batch=args.batch, cache="packed" if packed else "dense",
        seconds=seconds, prefill_seconds=prefill_s,
        tokens_per_sec=args.batch * n / seconds,
        decode_tokens_per_sec=args.batch * (n - 1) / max(seconds - prefill_s, 1e-9),
        kv_live_bytes_final=mem["live"], kv_live_bytes_mean=float(live_bytes_per_step.mean()),
        kv_allocated_bytes=mem["allocated"], capacity=out.caches[0].capacity,
        live_tokens_final=float(live[-1].mean()), sparsity_final=1.0 - float(live[-1].mean()) / context,
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="gpt2", help="GPT-2 preset (gpt2, gpt2-medium, ...) for random weights")
    p.add_argument("--checkpoint", default=None, help="HF-format GPT-2 directory with DCP weights")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[256, 512, 896])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--beta", type=float, default=1.5, help="β of every layer for random DCP weights")
    p.add_argument("--chunk", type=int, default=64, help="decode steps between packed-cache resizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="bench_decode.json")
    p.add_argument("--quick", action="store_true", help="CPU smoke run with a tiny model")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_lengths, args.new_tokens, args.batch, args.repeats, args.dtype, args.chunk = (
            [64, 192], 24, 2, 3, "float32", 16)
    model, params = build_model(args)
    rows = []
    for prompt_len in args.prompt_lengths:
        for packed in (False, True):
            row = bench_one(model, params, prompt_len, args, packed)
            rows.append(row)
            print(json.dumps(row), flush=True)

    print("\n| prompt | new | B | cache | tokens/s | decode tok/s | KV live final | KV live mean | KV allocated "
          "| live tok/layer | sparsity |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mib = lambda x: f"{x / 2**20:.2f} MiB"
    for r in rows:
        print(f"| {r['prompt_len']} | {r['new_tokens']} | {r['batch']} | {r['cache']} | {r['tokens_per_sec']:,.1f} | "
              f"{r['decode_tokens_per_sec']:,.1f} | {mib(r['kv_live_bytes_final'])} | {mib(r['kv_live_bytes_mean'])} | "
              f"{mib(r['kv_allocated_bytes'])} | {r['live_tokens_final']:.1f} | {100 * r['sparsity_final']:.0f}% |")
    meta = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
                python=platform.python_version(), dtype=args.dtype, checkpoint=args.checkpoint,
                model=dict(n_layer=model.cfg.n_layers, n_embd=model.cfg.d_model, n_head=model.cfg.n_heads,
                           interaction_dim=model.cfg.interaction_dim),
                beta=None if args.checkpoint else args.beta, chunk=args.chunk, repeats=args.repeats)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
