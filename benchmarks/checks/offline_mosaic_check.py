"""Registers, spills and barriers of the Mosaic GPU attention kernels for sm_90a, on a machine without a GPU.

The forward, dQ and dK/dV kernels (``implementation="mosaic"``) of one attention shape are compiled for the
H200 described in ``decode_kernels.H200_TARGET``: JAX's CUDA plugin lowers each Mosaic kernel to PTX and runs
``ptxas`` at XLA compile time, with no device. ``MOSAIC_GPU_DUMP_PTXAS`` / ``MOSAIC_GPU_DUMP_PTX`` /
``MOSAIC_GPU_DUMP_TO`` (read by the plugin) write each kernel's ``ptxas -v`` report and PTX; this script sets
them, parses the reports and prints one line per kernel: registers at launch, the compute warpgroups' register
budget after ``setmaxnreg``, spill stores / loads, stack frame, wgmma instructions. The kernels are named by
compile order (forward, then the backward's dQ and dK/dV kernels, as ``mosaic_backward`` calls them; the forward
is confirmed by its source locations). The Triton kernels' counterpart is ``offline_triton_check.py``.

Needs the CUDA-plugin environment of ``decode_kernels.py`` (``/tmp/cu``):

    PYTHONPATH=. /tmp/cu/bin/python benchmarks/checks/offline_mosaic_check.py --shape 1x16384x16x128 \\
        [--config bwd_block_k=128,stages=3] [--keep /tmp/mosaic_dump]
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_kernels import on_h200  # noqa: E402  (sets the no-device environment)

KERNELS = ("forward", "dq", "dkv")  # the plugin's compile order of one fwd+bwd program


def parse_ptxas(text: str) -> dict:
    """The numbers of one ``ptxas -v`` report: registers, spill_stores, spill_loads, stack (bytes), barriers."""
    def num(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else None
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame"),
            "barriers": num(r"used (\d+) barriers")}


def parse_ptx(text: str) -> dict:
    """From a kernel's PTX: the ``setmaxnreg`` budgets (compute warpgroups' increase, memory warpgroup's
    decrease) and the number of ``wgmma.mma_async`` instructions."""
    inc = re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", text)
    dec = re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", text)
    return {"maxnreg_compute": max(map(int, inc)) if inc else None,
            "maxnreg_memory": min(map(int, dec)) if dec else None,
            "wgmma": len(re.findall(r"wgmma\.mma_async", text))}


def compile_kernels(shape: tuple[int, int, int, int], overrides: dict, dump: str) -> tuple[float, bool]:
    """Compile fwd+bwd of Mosaic forgetting attention at ``shape`` (B, T, H, D; bf16) for the described H200,
    dumping the kernels' PTX and ptxas reports into ``dump``; returns the compile seconds and whether the
    backward took dQ from the dK/dV kernel (``bwd_fused_dq``: no dQ kernel)."""
    os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=dump)
    abstract = on_h200()
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from fox_jax.kernels import default_mosaic_config
    from fox_jax.ops import pallas as fpallas

    fpallas.mosaic_supported = lambda q, k: None  # its check is for running; lowering needs no device
    b, t, h, d = shape
    base = default_mosaic_config(64 if d <= 64 else 128, t)
    overrides = {k: bool(v) if isinstance(getattr(base, k, None), bool) else v for k, v in overrides.items()}
    mosaic = dataclasses.replace(base, **overrides)  # flags as 0/1
    config = dataclasses.replace(fpallas.resolve_config(d, t, t, None, False), mosaic=mosaic)

    def loss(q, k, v, lf):
        o = fpallas.attention(q, k, v, jnp.cumsum(lf, axis=1), None, None, None, scale=d ** -0.5, config=config,
                              implementation="mosaic")
        return jnp.sum(o.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    args = abstract([x, x, x, jax.ShapeDtypeStruct((b, t, h), jnp.float32)])
    t0 = time.time()
    jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower().compile()
    return time.time() - t0, mosaic.bwd_fused_dq


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1x16384x24x64", help="BxTxHxD (default: the 760M layer)")
    p.add_argument("--config", default="", metavar="KEY=VALUE,...",
                   help="MosaicConfig fields over the head dim's default, e.g. bwd_block_k=128,bwd_stages=3 "
                   "(flags as 0 / 1: bwd_pingpong=1)")
    p.add_argument("--keep", help="dump folder to keep (default: a temporary one)")
    args = p.parse_args(argv)
    try:
        shape = tuple(int(s) for s in args.shape.split("x"))
        assert len(shape) == 4 and min(shape) > 0
    except (ValueError, AssertionError):
        p.error(f"--shape must be BxTxHxD with four positive integers, got {args.shape!r}")
    overrides = {}
    for item in filter(None, args.config.split(",")):
        key, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            p.error(f"--config entries must be KEY=INTEGER, got {item!r}")
        overrides[key] = int(value)
    dump = args.keep or tempfile.mkdtemp(prefix="mosaic_dump_")
    os.makedirs(dump, exist_ok=True)
    for old in glob.glob(os.path.join(dump, "entry_*")):
        os.remove(old)
    try:
        secs, fused_dq = compile_kernels(shape, overrides, dump)
    except (TypeError, ValueError) as e:  # an unknown MosaicConfig field or a value it refuses
        p.error(f"--config {args.config!r}: {e}")
    reports = sorted(glob.glob(os.path.join(dump, "entry_*.ptxas")), key=lambda f: int(re.findall(r"\d+", f)[-1]))
    print(f"Mosaic kernels at B{shape[0]} T{shape[1]} H{shape[2]} D{shape[3]}"
          f"{' with ' + args.config if args.config else ''}: compiled in {secs:.1f} s, no device ({dump})")
    kernels = ("forward", "dkv") if fused_dq else KERNELS  # fused: no dQ kernel
    for name, report in zip(kernels, reports):
        info = parse_ptxas(open(report).read())
        info.update(parse_ptx(open(report[:-len("ptxas")] + "ptx").read()))
        print(f"  {name:8s} {info['registers']} registers at launch, compute warpgroups {info['maxnreg_compute']}, "
              f"memory warpgroup {info['maxnreg_memory']}; spills {info['spill_stores']} B stored / "
              f"{info['spill_loads']} B loaded, stack {info['stack']} B; {info['wgmma']} wgmma")
    if len(reports) != len(kernels):
        print(f"  expected {len(kernels)} kernels, found {len(reports)} reports")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
