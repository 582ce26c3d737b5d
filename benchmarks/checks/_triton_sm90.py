"""Pallas (Triton) kernels compiled for sm_90 on a machine without a GPU: the shared part of the offline checks
(``offline_triton_check.py``, ``decode_sass.py``). Needs ``pip install triton==3.6.0`` (the CPU wheel works)."""

from __future__ import annotations

import contextlib
import os
import subprocess

import jax._src.pallas.triton.lowering as triton_lowering
import jax._src.pallas.triton.pallas_call_registration as triton_registration


@contextlib.contextmanager
def captured_triton_ir(debug_info: bool = False):
    """While the block runs, every Pallas Triton kernel lowered (``lower(lowering_platforms=("cuda",))``) appends its
    Triton IR (text) to the yielded list, in lowering order. Hooks a private JAX function
    (``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module``)."""
    captured: list[str] = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=debug_info))
        return result

    triton_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield captured
    finally:
        triton_registration.lowering.lower_jaxpr_to_triton_module = original


def compile_sm90(ir: str, num_warps: int, num_stages: int, tmp: str) -> tuple:
    """Compile Triton IR for sm_90 and assemble it with the bundled ``ptxas -v``: (the Triton kernel, ptxas's report
    (its stderr), the cubin's path under ``tmp``, the folder of the bundled CUDA tools)."""
    import triton
    from triton.backends.compiler import GPUTarget

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    path = os.path.join(tmp, "k.ttir")
    with open(path, "w") as fh:
        fh.write(ir)
    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
    with open(ptx, "w") as fh:
        fh.write(kernel.asm["ptx"])
    out = subprocess.run([os.path.join(tools, "ptxas"), "-v", "--gpu-name=sm_90a", ptx, "-o", cubin],
                         capture_output=True, text=True, check=True)
    return kernel, out.stderr, cubin, tools
