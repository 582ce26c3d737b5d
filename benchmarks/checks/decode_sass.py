"""The decode attention kernel's machine code for sm_90, without a GPU: registers, spills, shared memory, and the
count of its barriers and loads, per ``DecodeConfig`` variant.

The kernel of a pruned decode step is latency-bound (96 programs of a chain each for FoX (Pro) 125M at B8): its time
is the length of that chain, not its bytes. Each cross-warp reduction and each layout conversion in Triton's code is
a round trip through shared memory behind a ``BAR.SYNC``, so the barriers a program passes before its attention
loop's first asynchronous K/V copy (``LDGSTS``) are a proxy for the prologue's length that needs no device. It is a
weak one: time a variant on the GPU (``profile_decode.py --kernel-variants``) before taking it. On 2026-12-07 the
gate pass in one reduction took the FoX (Pro) step's prologue from 31 barriers to 14 and its kernel only from 8.7 to
8.5 µs a layer (H100): at ~15 ns a barrier costs little; the chain's memory round trips are the rest.

Lowers ``flash_decode`` for CUDA on this CPU machine in one of three forms (the call the models make), captures the
Triton IR and compiles it with Triton for sm_90 (``_triton_sm90.py``, shared with ``offline_triton_check.py``), and
disassembles it with the bundled ``nvdisasm``. Needs ``pip install
triton==3.6.0`` (the CPU wheel works; nothing runs on a device).

    python benchmarks/checks/decode_sass.py                                  # FoX (Pro) 125M acp step, B8, C 128
    python benchmarks/checks/decode_sass.py --form window --capacity 256 --kernel-variants base w2:num_warps=2
    python benchmarks/checks/decode_sass.py --form plain --batch 32 --capacity 1024 --timeline

``--timeline`` prints the SASS condensed to its loads, stores, barriers, shuffles, tensor-core and special-function
instructions in order (``[n]`` = n other instructions).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from fox_jax.kernels import decode_attention as dk

from _triton_sm90 import captured_triton_ir, compile_sm90  # a sibling module (benchmarks/checks/ on sys.path)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from profile_decode import parse_kernel_variant  # noqa: E402  (benchmarks/: the variants' one parser)

FORMS = ("acp", "window", "plain")
_KEY_OPS = ("LDG", "LDGSTS", "BAR", "SHFL", "MUFU", "HMMA", "STG", "BRA", "LDS", "STS", "DEPBAR", "EXIT")


def capture_ttir(config: dk.DecodeConfig, form: str, b: int, hkv: int, grp: int, d: int, d_in: int, cap: int) -> str:
    """Triton IR (text) of the decode kernel of one call in ``form``: ``acp`` (the fused step of FoX (Pro): raw
    projection rows, KV-shift, QK-norm, Λ, the folded input norm, output norm and gate, the ring's tables, ACP's
    decay floor), ``window`` (the same without the floor), ``plain`` (GPT-2's: q, the new k and v, no Λ)."""
    sds = jax.ShapeDtypeStruct
    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    pair = lambda *shape: (sds(shape, f32),) * 2  # noqa: E731
    f = functools.partial(dk.flash_decode, scale=d ** -0.5, config=config, interpret=False)
    q, k, v = sds((b, hkv, grp, d), bf16), sds((b, hkv, cap, d), bf16), sds((b, hkv, cap, d), bf16)
    kn, vn = sds((b, hkv, d), bf16), sds((b, hkv, d), bf16)
    with captured_triton_ir() as captured:
        if form == "plain":
            jax.jit(lambda q, k, v, lo, hi, kn, vn: f(q, k, v, lo, hi, append=(kn, vn, None))).trace(
                q, k, v, sds((b, hkv), i32), sds((), i32), kn, vn).lower(lowering_platforms=("cuda",))
        else:
            step = dk.StepArrays(
                rows=sds((b, 2 * hkv * grp + 2 * hkv, d), bf16), seq_start=sds((b,), i32), gate_x=sds((b, d_in), bf16),
                gate_w=tuple((sds((d_in, n), f32), bias) for n, bias in
                             ((hkv, None), (hkv, None), (hkv * grp, sds((hkv * grp,), f32)))),
                shift_state=sds((b, 2, hkv, d), bf16), q_scale=sds((hkv, grp, d), f32), k_scale=sds((hkv, d), f32),
                lam_prev=pair(b, hkv, grp), o_scale=sds((hkv, grp, d), f32), o_gate=True, x_norm_eps=1e-5)
            floor = sds((b, hkv, grp), f32) if form == "acp" else None
            jax.jit(lambda q, k, v, lo, hi, lk, kn, vn, fl, st, tb: f(
                q, k, v, lo, hi, None, None, lk, append=(kn, vn, None), decay_floor=fl, step=st, tables=tb)).trace(
                q, k, v, sds((b, hkv), i32), sds((), i32), pair(b, hkv, grp, cap), kn, vn, floor, step,
                (sds((b, hkv), i32),) * 3).lower(lowering_platforms=("cuda",))
    if len(captured) != 1:
        raise RuntimeError(f"expected one Triton kernel, captured {len(captured)}")
    return captured[0]


def sass_ops(sass: str) -> list[str]:
    """The opcodes of a disassembly (predicates dropped), in order."""
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ops.append(m.group(1))
    return ops


def timeline(ops: list[str]) -> str:
    """The opcodes condensed: the key ones (their base name, ×n for a run), ``[n]`` for n others."""
    seq = []
    for op in ops:
        base = op.split(".")[0]
        key = base if base in _KEY_OPS else "."
        if seq and seq[-1][0] == key:
            seq[-1][1] += 1
        else:
            seq.append([key, 1])
    return " ".join(f"[{n}]" if k == "." else (k if n == 1 else f"{k}x{n}") for k, n in seq)


def analyse(ir: str, config: dk.DecodeConfig, tmp: str) -> dict:
    """Compile ``ir`` for sm_90 and count what the program passes."""
    kernel, report, cubin, tools = compile_sm90(ir, config.num_warps, config.num_stages, tmp)
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                          check=True).stdout
    ops = sass_ops(sass)
    first_copy = next((i for i, op in enumerate(ops) if op.startswith("LDGSTS")), len(ops))
    return dict(registers=int(regs.group(1)) if regs else None, spill_bytes=int(spills.group(1)) if spills else 0,
                shared_bytes=int(kernel.metadata.shared), instructions=len(ops),
                barriers=sum(op.startswith("BAR.SYNC") for op in ops),
                barriers_before_loop=sum(op.startswith("BAR.SYNC") for op in ops[:first_copy]),
                instructions_before_loop=first_copy, shuffles=sum(op.startswith("SHFL") for op in ops),
                global_loads=sum(op.startswith("LDG") and not op.startswith("LDGSTS") for op in ops),
                async_copies=sum(op.startswith("LDGSTS") for op in ops), timeline=timeline(ops))


def parse_variant(spec: str) -> tuple[str, dict]:
    """``name`` or ``name:key=value,...`` as ``profile_decode.py --kernel-variants`` reads it, keys of ``DecodeConfig``
    only (the others change the step around the kernel, not its code).

    Raises:
      ValueError: an unknown key, a bad value, or a key that is not the kernel's.
    """
    name, settings = parse_kernel_variant(spec)
    fields = {f.name for f in dataclasses.fields(dk.DecodeConfig)}
    other = sorted(set(settings) - fields)
    if other:
        raise ValueError(f"--kernel-variants {spec!r}: {', '.join(other)} not a key of the decode kernel's "
                         f"DecodeConfig ({', '.join(sorted(fields))})")
    return name, settings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--form", choices=FORMS, default="acp", help="the call: acp / window (FoX (Pro)'s fused step), "
                    "plain (GPT-2's)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=12)
    ap.add_argument("--group", type=int, default=1, help="query heads per key/value head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=768, help="the gate projections' input (the fused step)")
    ap.add_argument("--capacity", type=int, default=128, help="ring slots per (row, key/value head)")
    ap.add_argument("--kernel-variants", nargs="*", default=["base"], metavar="NAME[:KEY=VALUE,...]",
                    help="DecodeConfig changes from the GPU default of this shape, one row each")
    ap.add_argument("--timeline", action="store_true", help="print each variant's condensed SASS")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    base = dk.default_decode_config(args.batch * args.kv_heads, args.capacity, head_dim=args.head_dim,
                                    group=args.group, lam=args.form != "plain")
    variants = []
    for spec in args.kernel_variants:  # every variant checked before the first compile
        try:
            name, settings = parse_variant(spec)
            variants.append((name, dataclasses.replace(base, **settings)))
        except ValueError as e:
            ap.error(str(e))
    rows = []
    print(f"{'variant':<12} {'regs':>4} {'spill':>5} {'smem KB':>7} {'instr':>6} {'BAR':>4} {'BAR<loop':>8} "
          f"{'instr<loop':>10} {'SHFL':>5} {'LDG':>4} {'LDGSTS':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in variants:
            ir = capture_ttir(config, args.form, args.batch, args.kv_heads, args.group, args.head_dim, args.d_model,
                              args.capacity)
            row = dict(variant=name, form=args.form, config=dataclasses.asdict(config), **analyse(ir, config, tmp))
            rows.append(row)
            print(f"{name:<12} {row['registers']:>4} {row['spill_bytes']:>5} {row['shared_bytes'] / 1024:>7.1f} "
                  f"{row['instructions']:>6} {row['barriers']:>4} {row['barriers_before_loop']:>8} "
                  f"{row['instructions_before_loop']:>10} {row['shuffles']:>5} {row['global_loads']:>4} "
                  f"{row['async_copies']:>6}")
            if args.timeline:
                print("  " + row["timeline"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(jax=jax.__version__, shape=dict(form=args.form, batch=args.batch, kv_heads=args.kv_heads,
                                                           group=args.group, head_dim=args.head_dim,
                                                           capacity=args.capacity), rows=rows), fh, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
