"""Shared memory, registers and spills of the Pallas kernels for sm_90, without a GPU.

Lowers the gradient of the op for CUDA on this (CPU) machine, captures the Triton IR of every kernel
(``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module``, a private JAX function), compiles
it with Triton for sm_90 (num_warps / num_stages of the default tiles) and runs the bundled
``ptxas -v``. Needs ``pip install triton==3.6.0`` (CPU wheels work; nothing runs on a device).
Results of session 3 are in benchmarks/NOTES.md ("DCP kernels").

    python benchmarks/checks/offline_triton_check.py --d 128            # forward, dQ, dK/dV
    python benchmarks/checks/offline_triton_check.py --d 128 --dcp      # + the DCP mask and the dlogI kernel
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

import jax._src.pallas.triton.lowering as triton_lowering
import jax._src.pallas.triton.pallas_call_registration as triton_registration

from fox_jax.ops import pallas as fpallas
from fox_jax.ops.context_pruning import LOG_FLOOR
from fox_jax.kernels.forgetting_attention import dmask_tile


def capture_ttir(d: int, dcp: bool, b: int = 2, t: int = 2048, h: int = 8) -> list[str]:
    """Triton IR (text) of every kernel in the gradient of one call, in lowering order."""
    captured = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    triton_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        def loss(q, k, v, m, lam):
            if dcp:
                o = fpallas.dcp_attention(q, k, v, m, lam, None, scale=d ** -0.5, floor=LOG_FLOOR, interpret=False)
            else:
                o = fpallas.attention(q, k, v, lam, None, None, None, scale=d ** -0.5, interpret=False)
            return jnp.sum(o.astype(jnp.float32))

        args = [jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)] * 3 + [
            jax.ShapeDtypeStruct((b, t, t), jnp.float32), jax.ShapeDtypeStruct((b, t, h), jnp.float32)]
        argnums = (0, 1, 2, 3, 4) if dcp else (0, 1, 2, 4)
        jax.jit(jax.grad(loss, argnums=argnums)).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        triton_registration.lowering.lower_jaxpr_to_triton_module = original
    return captured


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=128, help="head dim")
    ap.add_argument("--dcp", action="store_true", help="the DCP variants (mask + dlogI kernel)")
    args = ap.parse_args(argv)
    import triton
    from triton.backends.compiler import GPUTarget

    resolve = fpallas.resolve_dcp_config if args.dcp else fpallas.resolve_config
    cfg = resolve(args.d, 2048, 2048, interpret=False)
    tiles = [("fwd", cfg.fwd), ("dq", cfg.dq), ("dkv", cfg.dkv)] + ([("dlogI", dmask_tile(cfg))] if args.dcp else [])
    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))[0]
    with tempfile.TemporaryDirectory() as tmp:
        for (name, tile), ir in zip(tiles, capture_ttir(args.d, args.dcp)):
            path = os.path.join(tmp, f"{name}.ttir")
            with open(path, "w") as f:
                f.write(ir)
            kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=tile.num_warps, num_stages=tile.num_stages))
            with open(os.path.join(tmp, "k.ptx"), "w") as f:
                f.write(kernel.asm["ptx"])
            out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", os.path.join(tmp, "k.ptx"), "-o",
                                  os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
            info = " ".join(line.strip() for line in out.stderr.splitlines() if "spill" in line or "registers" in line)
            print(f"D={args.d} {name:5s} tile {tile.block_q}x{tile.block_k} warps {tile.num_warps} stages "
                  f"{tile.num_stages}: shared {kernel.metadata.shared / 1024:.0f} KB | {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
