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
import sys
import tempfile

import jax
import jax.numpy as jnp

from fox_jax.ops import pallas as fpallas
from fox_jax.ops.context_pruning import LOG_FLOOR
from fox_jax.kernels.forgetting_attention import dmask_tile

from _triton_sm90 import captured_triton_ir, compile_sm90  # a sibling module (benchmarks/checks/ on sys.path)


def capture_ttir(d: int, dcp: bool, b: int = 2, t: int = 2048, h: int = 8) -> list[str]:
    """Triton IR (text) of every kernel in the gradient of one call, in lowering order."""
    def loss(q, k, v, m, lam):
        if dcp:
            o = fpallas.dcp_attention(q, k, v, m, lam, None, scale=d ** -0.5, floor=LOG_FLOOR, interpret=False)
        else:
            o = fpallas.attention(q, k, v, lam, None, None, None, scale=d ** -0.5, interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    args = [jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)] * 3 + [
        jax.ShapeDtypeStruct((b, t, t), jnp.float32), jax.ShapeDtypeStruct((b, t, h), jnp.float32)]
    argnums = (0, 1, 2, 3, 4) if dcp else (0, 1, 2, 4)
    with captured_triton_ir() as captured:
        jax.jit(jax.grad(loss, argnums=argnums)).trace(*args).lower(lowering_platforms=("cuda",))
    return captured


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=128, help="head dim")
    ap.add_argument("--dcp", action="store_true", help="the DCP variants (mask + dlogI kernel)")
    args = ap.parse_args(argv)
    resolve = fpallas.resolve_dcp_config if args.dcp else fpallas.resolve_config
    cfg = resolve(args.d, 2048, 2048, interpret=False)
    tiles = [("fwd", cfg.fwd), ("dq", cfg.dq), ("dkv", cfg.dkv)] + ([("dlogI", dmask_tile(cfg))] if args.dcp else [])
    with tempfile.TemporaryDirectory() as tmp:
        for (name, tile), ir in zip(tiles, capture_ttir(args.d, args.dcp)):
            kernel, report, _, _ = compile_sm90(ir, tile.num_warps, tile.num_stages, tmp)
            info = " ".join(line.strip() for line in report.splitlines() if "spill" in line or "registers" in line)
            print(f"D={args.d} {name:5s} tile {tile.block_q}x{tile.block_k} warps {tile.num_warps} stages "
                  f"{tile.num_stages}: shared {kernel.metadata.shared / 1024:.0f} KB | {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
