"""The kernels of one training step as XLA compiles them for an H200, on a machine without a GPU, with their bytes.

The train step that ``bench_train.py`` / ``profile_step.py`` time (forward, backward, clipping and the AdamW
update; batch 1 × ``--seq`` tokens, bf16 compute) is compiled ahead of time for the H200 described in
``decode_kernels.H200_TARGET`` (nothing runs, GEMMs are not autotuned, attention is the Pallas (Triton) kernel,
or with ``--set attention_impl=mosaic`` the Mosaic kernels, lowered with their device check bypassed). Every
kernel of the program (fusions, GEMMs, custom calls; a loop body's kernels once per trip: per step) is listed
with the bytes it reads and writes as its HLO shapes say (inside the scanned layers, a fusion's layer slice of a
stacked [L, ...] array and its in-place update of one count what they touch, not the whole array), so the memory-bound
part of a step — norms, casts, concatenations, the loss, the optimizer — can be looked for on the CPU machine:
a fusion's bytes at 4.8 TB/s are the least time it can take. The ranking is by bytes, a lower bound, not a
measurement; ``profile_step.py`` on the device gives the times.

Needs the CUDA-plugin environment of ``decode_kernels.py`` (``/tmp/cu``, with grain for the training stack):

    PYTHONPATH=. /tmp/cu/bin/python benchmarks/checks/train_kernels.py --size 760M --arch fox-pro --seq 16384 \\
        [--set remat=dots scan_layers=true] [--top 40] [--json out.json] [--ptx]

``--ptx`` also reads the PTX that XLA generated for each fusion (an XLA dump into a temporary folder) and lists
the kernels that keep local memory per thread (spills, or arrays indexed at run time) or load 8/16-bit values one
at a time: XLA's codegen is the limit there, not the bytes (the KV-shift backward of the 760M step: 256 B of local
memory and 33 scalar 16/8-bit loads, 0.59 ms per layer on an H100 for ~0.1 ms of bytes; benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_kernels import (  # noqa: E402  (sets the no-device env)
    _computations, _opcode, counted_kernel_lines, kernel_kind, on_h200)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
             "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([\d,]*)\]")


def array_bytes(type_text: str) -> int:
    """Bytes of every array type in an HLO type string ("bf16[2,3]{1,0}", a tuple "(f32[4], s32[])")."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _ITEMSIZE[dtype]
    return total


def _operands(line: str) -> list[str]:
    """The operand names of an HLO instruction line ("%a = f32[2] add(%b, %c), ..." -> ["b", "c"])."""
    op = _opcode(line)
    args = re.search(re.escape(op) + r"\((.*?)\)(?:,|$)", line.split(" = ", 1)[1]) if op else None
    names = [re.sub(r"/\*.*?\*/", "", a).strip().lstrip("%") for a in args.group(1).split(",")] if args else []
    return [a for a in names if a]  # (a long operand list numbers every fifth: "/*index=5*/%a")


def _fusion_bytes(comps: dict, line: str, operands: list[int], output: int) -> int:
    """Bytes a kernel moves: its operands and output as their HLO types say, except inside a fusion an operand
    used only through dynamic-slice / slice (a layer's slice of the scan's stacked [L, ...] weights or residuals)
    counts what the slices hold, and a root dynamic-update-slice (in place: the stacked buffer is aliased) writes
    its update (read through the fusion's other operands) instead of the whole buffer."""
    callee = re.search(r"calls=%?([\w.\-]+)", line)
    if _opcode(line) not in ("fusion", "fusion-start") or not callee:
        return sum(operands) + output
    body = comps.get(callee.group(1), [])
    if _opcode(line) == "fusion-start":  # an async fusion: its start's tuple holds the operands too; count the root
        root = next((ln for ln in body if ln.startswith("ROOT ")), " = ")
        output = array_bytes(root.split(" = ", 1)[1].split(" ")[0])
    shape = {}  # name -> its type text, inside the fused computation
    params = {}
    for ln in body:
        lhs, rhs = ln.replace("ROOT ", "").split(" = ", 1)
        shape[lhs.strip().lstrip("%")] = rhs.split(" ")[0]
        m = re.match(r"\S+ parameter\((\d+)\)", rhs)
        if m:
            params[lhs.strip().lstrip("%")] = int(m.group(1))
    reads = list(operands)
    for name, i in params.items():
        users = [ln for ln in body if name in _operands(ln)] if i < len(reads) else []
        if users and all(_opcode(u) in ("dynamic-slice", "slice") and _operands(u)[0] == name for u in users):
            reads[i] = sum(array_bytes(u.split(" = ", 1)[1].split(" ")[0]) for u in users)
    root = next((ln for ln in body if ln.startswith("ROOT ")), "")
    roots = [ln for ln in body if ln.replace("ROOT ", "").split(" = ")[0].lstrip("%") in _operands(root)] \
        if _opcode(root) == "tuple" else [root]
    for r in roots:
        if _opcode(r) == "dynamic-update-slice":
            buffer, update = _operands(r)[:2]
            if buffer in params and params[buffer] < len(reads):
                reads[params[buffer]] = 0
            output += array_bytes(shape.get(update, "")) - array_bytes(r.split(" = ", 1)[1].split(" ")[0])
    return sum(reads) + output


def kernels_with_bytes(hlo: str) -> list[dict]:
    """Every kernel of an optimized GPU module in schedule order (calls and while bodies entered once):
    [{"kind", "name", "op", "launches", "bytes"}], bytes = operands + outputs from the HLO types
    (``_fusion_bytes``) per launch, launches = the runs per step (a loop body's: its trip count)."""
    comps = _computations(hlo)
    types = {}
    for lines in comps.values():
        for line in lines:
            if " = " in line:
                lhs, rhs = line.split(" = ", 1)
                m = re.match(r"(\(.*?\)|\S+)\s", rhs)
                types[lhs.replace("ROOT ", "").strip().lstrip("%")] = m.group(1) if m else ""
    entry = next(line.split()[1].lstrip("%") for line in hlo.split("\n") if line.startswith("ENTRY"))
    out = []
    for op, line, launches in counted_kernel_lines(comps, entry, enter_while=True):
        lhs = line.split(" = ", 1)[0].replace("ROOT ", "").strip().lstrip("%")
        operands = _operands(line)
        name = re.search(r'op_name="([^"]+)"', line)
        out.append(dict(kind=kernel_kind(op, line), name=lhs, op=name.group(1) if name else "", launches=launches,
                        bytes=_fusion_bytes(comps, line, [array_bytes(types.get(a, "")) for a in operands],
                                            array_bytes(types.get(lhs, "")))))
    return out


def _fold(op: str) -> str:
    """The op path with the layer index and the jit wrapper folded: kernels of the same place in every layer
    group together."""
    op = re.sub(r"(layers|h)_\d+", r"\1_*", op)
    return re.sub(r"^jit\([^)]*\)/(while/body/closed_call/)?", "", op)


def compile_step(size: str, arch: str, seq: int, overrides: list[str]):
    """(optimized HLO text, temp bytes, compile seconds) of the train step for an H200, without a device."""
    abstract = on_h200()
    if "attention_impl=mosaic" in overrides:  # the Mosaic kernels lower without a device; their check is for running
        import fox_jax.ops.pallas as pallas_ops
        pallas_ops.mosaic_supported = lambda q, k: None
        pallas_ops._interpret_default = lambda: False
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from bench_decode import model_config
    from fox_jax.train import config as config_lib
    from fox_jax.train.loop import LMTask, init_state, make_optimizer, make_train_step, train_step_compiler_options

    model_cfg = model_config(f"{arch}:{size}", overrides).replace(dtype="bfloat16")
    cfg = config_lib.ExperimentConfig(model=model_cfg, steps=1000, batch_size=1)
    optimizer = make_optimizer(cfg)
    state = abstract(jax.eval_shape(lambda: init_state(cfg, jax.random.PRNGKey(0), optimizer)))
    step = make_train_step(LMTask(cfg), model_cfg.build(), optimizer, 1)
    tokens = abstract(jax.ShapeDtypeStruct((1, seq), jnp.int32))
    batch = {"inputs": tokens, "targets": tokens, "segment_ids": tokens, "positions": tokens}
    t0 = time.perf_counter()
    compiled = jax.jit(lambda s, b: step(s, b, {}), donate_argnums=(0,),  # the training loop's GPU options
                       compiler_options=train_step_compiler_options("gpu")).lower(state, batch).compile()
    return compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes, time.perf_counter() - t0


def ptx_kernels(dump_dir: str) -> dict[str, dict]:
    """Per kernel (PTX entry name = the HLO fusion's name with "." as "_") of an XLA dump's ``*.ptx``: local memory
    bytes per thread, and global loads and stores split into scalar and vector ones (``.v2`` / ``.v4``), with the
    scalar loads of 8 or 16 bits counted apart."""
    import glob

    out = {}
    for path in glob.glob(os.path.join(dump_dir, "*.ptx")):
        with open(path) as f:
            text = f.read()
        for part in re.split(r"\n\.visible \.entry ", text)[1:]:
            local = re.search(r"__local_depot\d+\[(\d+)\]", part)
            loads = re.findall(r"ld\.global(?:\.nc)?(\.v\d)?\.[bfus](\d+)", part)
            stores = re.findall(r"st\.global(\.v\d)?\.[bfus](\d+)", part)
            out[part.split("(", 1)[0]] = dict(
                local_bytes=int(local.group(1)) if local else 0,
                scalar_loads=sum(1 for vec, _ in loads if not vec),
                narrow_scalar_loads=sum(1 for vec, bits in loads if not vec and int(bits) <= 16),
                vector_loads=sum(1 for vec, _ in loads if vec),
                scalar_stores=sum(1 for vec, _ in stores if not vec), vector_stores=sum(1 for vec, _ in stores if vec))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="760M")
    p.add_argument("--arch", default="fox-pro")
    p.add_argument("--seq", type=int, default=16384, help="tokens per step (batch 1)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model config overrides (remat=dots)")
    p.add_argument("--top", type=int, default=30, help="places to list, by bytes (not GEMMs or attention)")
    p.add_argument("--json", help="write the totals and the ranked places here")
    p.add_argument("--ptx", action="store_true", help="also list the kernels whose PTX keeps local memory or loads "
                                                     "8/16-bit values one at a time")
    args = p.parse_args(argv)
    dump = None
    if args.ptx:  # before the first compile: XLA reads its flags once
        import tempfile

        dump = tempfile.mkdtemp(prefix="train_kernels_ptx_")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={dump} --xla_dump_hlo_module_re=.*lambda.*").strip()
    hlo, temp, secs = compile_step(args.size, args.arch, args.seq, list(args.set))
    kernels = kernels_with_bytes(hlo)
    ms = lambda b: b / HBM_BYTES_PER_S * 1e3  # noqa: E731
    kinds = collections.defaultdict(lambda: [0, 0])
    places = collections.defaultdict(lambda: [0, 0])
    for k in kernels:
        kinds[k["kind"]][0] += k["launches"]
        kinds[k["kind"]][1] += k["bytes"] * k["launches"]
        if k["kind"] != "gemm" and not k["kind"].startswith("custom-call"):
            places[(k["kind"], _fold(k["op"]))][0] += k["launches"]
            places[(k["kind"], _fold(k["op"]))][1] += k["bytes"] * k["launches"]
    per_step = sum(k["launches"] for k in kernels)
    print(f"{args.arch} {args.size} at {args.seq} tokens ({' '.join(args.set) or 'defaults'}): {per_step} kernels "
          f"per step, temp memory {temp / 2**30:.1f} GiB (compiled in {secs:.0f} s, no device, no autotuning)")
    for kind, (n, b) in sorted(kinds.items(), key=lambda x: -x[1][1]):
        print(f"  {kind:<34} {n:5d} kernels {b / 1e9:8.2f} GB ≥ {ms(b):6.1f} ms at 4.8 TB/s")
    ranked = sorted(places.items(), key=lambda x: -x[1][1])
    print("the memory-bound places by bytes (layers folded; ≥ ms at 4.8 TB/s, kernels):")
    for (kind, op), (n, b) in ranked[:args.top]:
        print(f"  {ms(b):6.2f} ms {n:5d}  {kind:<7} {op[:110]}")
    flagged = []
    if dump:
        codegen = ptx_kernels(dump)
        if not codegen:
            print(f"no PTX in the XLA dump {dump} (was XLA initialised before --ptx set its flags?)")
        for k in kernels:
            c = codegen.get(k["name"].replace(".", "_"))
            if c and (c["local_bytes"] or c["narrow_scalar_loads"] >= 16):
                flagged.append(dict(name=k["name"], op=_fold(k["op"]), bytes=k["bytes"], **c))
        print(f"kernels whose PTX keeps local memory or loads ≥ 16 narrow values one at a time ({len(codegen)} "
              f"kernels read; local B per thread, narrow scalar / vector loads):")
        for c in sorted(flagged, key=lambda c: (-c["local_bytes"], -c["bytes"]))[:args.top]:
            print(f"  {c['local_bytes']:4d} B {c['narrow_scalar_loads']:4d} / {c['vector_loads']:3d}  "
                  f"{ms(c['bytes']):6.2f} ms  {c['name'][:36]:<36} {c['op'][:80]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(arch=args.arch, size=args.size, seq=args.seq, overrides=args.set, jax=jax.__version__,
                           kernels_per_step=per_step, kernels_in_program=len(kernels), temp_bytes=temp,
                           kinds={k: dict(kernels=n, bytes=b) for k, (n, b) in kinds.items()},
                           places=[dict(kind=k, op=op, kernels=n, bytes=b) for (k, op), (n, b) in ranked],
                           codegen_flagged=flagged), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
