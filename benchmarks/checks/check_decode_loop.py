"""Does the compiled generate program move weight-sized work out of its loops? (fused projections, precast)

The attention layer concatenates its projection kernels (``fox_jax.nn.layers.fused_dense``) and the decode loop
casts the weights once (``precast``); both rely on the kernels being loop-invariant, so XLA's loop-invariant code
motion must hoist the concatenation out of the prefill scan and the decode ``while``. This compiles the generate
program of a small model and lists every concatenate / convert inside a loop body whose result is weight-shaped
([d_model, n] or [n, d_model]), except inside a GEMM fusion, where the concatenation is how the matmul reads its
operands (on the H200 XLA fuses the kernels' concatenation into the projection's Triton GEMM: no copy). Exit 1
when there is one: every step would then re-read and re-write the weights.

    python benchmarks/checks/check_decode_loop.py                       # fox-pro:tiny, any backend
    python benchmarks/checks/check_decode_loop.py --model fox-pro:125M --policy acp
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp

import fox_jax.models  # noqa: F401
from fox_jax.cache.policies import parse_policy
from fox_jax.config import ARCHS, SIZES, preset
from fox_jax.decoding import generation as gen
from fox_jax.decoding import min_slots


def loop_ops(hlo: str, d_model: int) -> list[str]:
    """Weight-shaped ([d_model, n] or [n, d_model]) concatenate/convert instructions reachable from a while body
    (fusions included); activations and caches have a batch axis first and more than two axes or B < d_model rows."""
    comps, name = {}, None
    for line in hlo.split("\n"):
        if line and not line.startswith(" ") and "{" in line:
            name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    ref = re.compile(r"(?:calls|body|to_apply|condition|branch_computations)=\{?%?([\w.\-]+)")
    todo = [m for lines in comps.values() for ln in lines if " while(" in ln
            for m in re.findall(r"body=%?([\w.\-]+)", ln)]
    seen, found = set(), []
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        if "gemm_fusion" in c or "triton_gemm" in c:
            continue  # a concatenate inside a GEMM fusion is how the matmul reads its operands, not a copy
        for ln in comps[c]:
            todo += ref.findall(ln)
            m = re.search(r"= (\w+)\[([\d,]*)\]\S* (concatenate|convert)\(", ln)
            dims = [int(d) for d in m.group(2).split(",")] if m and m.group(2) else []
            if len(dims) == 2 and d_model in dims and min(dims) >= d_model // 4:
                found.append(f"{c}: {ln.strip()[:160]}")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="fox-pro:tiny", help="ARCH:SIZE (random init)")
    p.add_argument("--policy", default="dense")
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=8)
    args = p.parse_args(argv)
    arch, _, size = args.model.partition(":")
    if arch not in ARCHS or size not in SIZES:
        p.error(f"--model: expected ARCH:SIZE with ARCH in {', '.join(ARCHS)} and SIZE in {', '.join(SIZES)}")
    cfg = preset(size, arch, dtype="bfloat16")
    params, model = cfg.init_params(jax.random.PRNGKey(0)), cfg.build()
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, args.prompt), 0, cfg.vocab_size, jnp.int32)
    policy, context = parse_policy(args.policy), args.prompt + args.new_tokens - 1
    padded, caches, chunk = gen._fresh_caches(model, tokens, policy, min_slots(policy, context), None, 512, context)
    hlo = gen._generate.lower(model, params, padded, caches, jax.random.PRNGKey(0), chunk, args.new_tokens, 0.0,
                              None, None, (), gen.cast_plan(model, params, caches), gen.STEPS_PER_CHECK,
                              jnp.int32(args.new_tokens)).compile().as_text()
    found = loop_ops(hlo, cfg.d_model)
    print(f"{jax.devices()[0].device_kind}: {len(found)} weight-sized concatenate/convert in loop bodies "
          f"({args.model}, {args.policy})")
    for f in found[:20]:
        print("  " + f)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
