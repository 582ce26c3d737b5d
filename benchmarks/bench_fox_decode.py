"""Decoding speed of the FoX / Transformer language models with the dense KV cache.

Times ``fox_jax.decoding.generate`` (greedy) and ``prefill`` alone for one model at several prompt lengths; the
decode rate is B·(N−1) / (generate − prefill). Random weights: speed does not depend on them. Uses only
``generate``, ``prefill``, ``LanguageModel`` and ``ModelConfig.init_params``.

Usage:
  python benchmarks/bench_fox_decode.py --quick                      # CPU smoke run, tiny model
  python benchmarks/bench_fox_decode.py --preset 125M --arch fox-pro --prompt-lengths 1024 4096 --out d.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fox_jax.decoding import generate, prefill  # noqa: E402
from fox_jax.models import LanguageModel, preset  # noqa: E402


def _median_time(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="125M")
    p.add_argument("--arch", default="fox-pro")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="bench_fox_decode.json")
    p.add_argument("--quick", action="store_true", help="CPU smoke run with the tiny model")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.prompt_lengths, args.new_tokens, args.batch, args.repeats = "tiny", [32], 8, 2, 1
    cfg = preset(args.preset, args.arch, dtype=args.dtype)
    model = LanguageModel(cfg)
    params = cfg.init_params(jax.random.PRNGKey(0))
    rows = []
    for t in args.prompt_lengths:
        prompts = jax.random.randint(jax.random.PRNGKey(t), (args.batch, t), 0, cfg.vocab_size)
        capacity = t + args.new_tokens
        gen_s = _median_time(lambda: generate(model, params, prompts, max_new_tokens=args.new_tokens,
                                              cache_capacity=capacity).tokens, args.repeats)
        pre_s = _median_time(lambda: prefill(model, params, prompts, capacity=capacity)[0], args.repeats)
        decode = args.batch * (args.new_tokens - 1) / max(gen_s - pre_s, 1e-9)
        rows.append({"prompt": t, "new_tokens": args.new_tokens, "batch": args.batch, "generate_s": gen_s,
                     "prefill_s": pre_s, "decode_tokens_per_s": decode})
        print(f"{args.preset} {args.arch} B{args.batch} prompt {t}: generate {gen_s * 1e3:.1f} ms, prefill "
              f"{pre_s * 1e3:.1f} ms, decode {decode:,.0f} tokens/s", flush=True)
    out = {"device": str(jax.devices()[0]), "jax": jax.__version__, "python": platform.python_version(),
           "preset": args.preset, "arch": args.arch, "dtype": args.dtype, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
