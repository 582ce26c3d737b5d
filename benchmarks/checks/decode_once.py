"""One ``generate`` call with no profiler attached: the process to run under ``ncu`` (CUPTI serves one client, so
``profile_decode.py``'s ``jax.profiler`` trace and ``ncu`` cannot share a process: ncu crashed on it, 2026-12-06).

    ncu --clock-control none -k regex:fox_decode -c 4 --set full -o /tmp/dec \\
        python3 benchmarks/checks/decode_once.py --model gpt2 --set n_layers=4 --batch 32 --prompt 896 --policy dense
    ncu --import /tmp/dec.ncu-rep --page details > dec.txt
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_decode import model_config  # noqa: E402

from fox_jax.decoding import generate  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", help="gpt2 or ARCH:SIZE (random init; default %(default)s)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model config overrides (n_layers=4)")
    p.add_argument("--policy", default="dense", help="cache policy, as generate's (default %(default)s)")
    p.add_argument("--batch", type=int, default=32, help="rows (default %(default)s)")
    p.add_argument("--prompt", type=int, default=896, help="prompt tokens per row (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens to sample per row (default %(default)s)")
    p.add_argument("--slots", type=int, default=None, help="KV pool per row (default: the policy's need)")
    a = p.parse_args(argv)
    cfg = model_config(a.model, a.set).replace(dtype="bfloat16")
    params = cfg.init_params(jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (a.batch, a.prompt), 0, cfg.vocab_size, jnp.int32)
    out = generate(cfg.build(), params, tokens, max_new_tokens=a.new_tokens, policy=a.policy, slots=a.slots)
    jax.block_until_ready(out.tokens)
    print(f"{a.model} {a.policy} B{a.batch} {a.prompt}+{a.new_tokens}: {out.tokens.shape} tokens")


if __name__ == "__main__":
    main()
