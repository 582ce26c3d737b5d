"""The kernels of one decode step as XLA compiles them for an H200, on a machine without a GPU.

The ``generate`` program of a model is compiled ahead of time for a CUDA target described by hand (an H200:
132 SMs, sm_90, 4.8 TB/s; ``H200_TARGET``), with nothing run: the XLA GPU compiler makes its fusion, GEMM and
Pallas (Triton) decisions as on the device, only without autotuning (default GEMM tilings). This lists the
kernels of the decode loop's body — fusions, GEMMs, custom calls (the Pallas decode kernel), copies — per layer
and by kind. A decode step at small batch costs ~1.2–5 µs per kernel whatever its work (benchmarks/NOTES.md,
"Decode step"), so the count is the fixed part of its time; on the H200 the profile of 2026-12-02 counted 313
(dense) and 349 (acp) kernels per step for FoX (Pro) 125M, this check 334 for the same acp program before the
cuts of 2026-12-04. Times still need the device (``run_gpu.sh`` stages ``profile-decode``, ``decode``).

Needs JAX's CUDA plugin next to the CPU jaxlib (a separate environment; ~3 GB of NVIDIA wheels, no driver):

    python3 -m venv /tmp/cu && /tmp/cu/bin/pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')" \\
        flax optax tokenizers safetensors
    PYTHONPATH=. /tmp/cu/bin/python benchmarks/checks/decode_kernels.py --model fox-pro:125M --policy acp \\
        --batch 8 --prompt 2048 --slots 256 [--layer 0] [--json out.json]
    PYTHONPATH=. /tmp/cu/bin/python benchmarks/checks/decode_kernels.py --model fox-llama:125M --policy acp \\
        --batch 2 --prompt 16384 --score     # eval --cache's program: its compile time

``CUDA_VISIBLE_DEVICES=-1`` and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` are set here (no device, no driver); the ops
pick their GPU implementations (``jax.default_backend`` reads "gpu" in this process: the Pallas kernels lower
for Triton, not in interpret mode). The prefill and the preamble are compiled too but not counted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# An H200 as the XLA GPU compiler sees it (stream_executor GpuTargetConfigProto, text form).
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150000000000 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 9 patch: 0 }
device_description_str: "NVIDIA H200"
"""

try:  # jax ≥ 0.11 asks the device for the Triton target when lowering a Pallas kernel: tell it the H200's
    from jax._src.pallas.triton import gpu_info as _gpu_info

    _gpu_info.get_gpu_info = lambda: _gpu_info.get_gpu_info_from_version(_gpu_info.GpuVersion.H200)
except (ImportError, AttributeError):  # jax 0.10 takes the compute capability from the lowering platform
    pass

_SKIP = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id", "replica-id",
         "fusion-done"}  # (an async fusion is one kernel: its ``fusion-start``)


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in hlo.split("\n"):
        if line and not line.startswith(" ") and "{" in line and "(" in line:
            name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[name] = []
        elif name is not None and line.startswith("  "):
            comps[name].append(line.strip())
    return comps


def _opcode(line: str) -> str | None:
    if " = " not in line:
        return None
    rhs = line.split(" = ", 1)[1]
    if rhs.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rhs):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
        rest = rhs[i + 1:].lstrip()
    else:
        rest = rhs.split(" ", 1)[1] if " " in rhs else ""
    m = re.match(r"([a-z][\w-]*)\(", rest)
    return m.group(1) if m else None


def kernel_lines(comps: dict, comp: str, *, enter_while: bool = False):
    """(opcode, line) of every kernel of computation ``comp`` in schedule order: calls (command buffers) entered,
    and with ``enter_while`` loop bodies too (once each); parameters, tuples, bitcasts and the like skipped."""
    for op, line, _ in counted_kernel_lines(comps, comp, enter_while=enter_while):
        yield op, line


def counted_kernel_lines(comps: dict, comp: str, *, enter_while: bool = False, launches: int = 1):
    """As ``kernel_lines``, with the times each kernel runs per call of ``comp``: (opcode, line, launches); a
    loop body's kernels run its known trip count times (XLA's ``known_trip_count``; 1 when it has none)."""
    for line in comps.get(comp, []):
        op = _opcode(line)
        if op is None or op in _SKIP or 'custom_call_target="AllocateBuffer"' in line:  # an allocation: no kernel
            continue
        if op == "call" or (enter_while and op == "while"):
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line) if op == "while" else None
            yield from counted_kernel_lines(comps, re.search(r"(?:to_apply|body)=%?([\w.\-]+)", line).group(1),
                                            enter_while=enter_while,
                                            launches=launches * (int(trips.group(1)) if trips else 1))
            continue
        yield op, line, launches


def kernel_kind(op: str, line: str) -> str:
    """A kernel's kind: a fusion's kind (GEMM fusions as "gemm"), "custom-call:<target>", else the opcode."""
    if op == "fusion":
        callee = re.search(r"calls=%?([\w.\-]+)", line).group(1)
        return "gemm" if "gemm" in callee or "gemm" in line.split(" = ")[0] else re.search(r"kind=(\w+)", line).group(1)
    if op == "custom-call":
        return "custom-call:" + re.search(r'custom_call_target="([^"]+)"', line).group(1)
    return op


def step_kernels(hlo: str) -> list[dict]:
    """The kernels of the largest while body of an optimized GPU HLO module (the decode loop), in schedule order:
    [{"kind", "name", "shape", "op"}]; calls (command buffers) are entered, fusions and custom calls are one
    kernel each (GEMM fusions as "gemm")."""
    comps = _computations(hlo)

    def walk(comp: str) -> list[dict]:
        out = []
        for op, line in kernel_lines(comps, comp):
            name = re.search(r'op_name="([^"]+)"', line)
            out.append(dict(kind=kernel_kind(op, line), name=line.split(" = ")[0].lstrip("%"),
                            shape=line.split(" = ", 1)[1].split(" ")[0],
                            op=name.group(1).split("/body/")[-1] if name else ""))
        return out

    bodies = [walk(re.search(r"body=%?([\w.\-]+)", ln).group(1)) for lines in comps.values() for ln in lines
              if _opcode(ln) == "while"]
    if not bodies:
        raise ValueError("no while loop in the module")
    # the decode loop: the body that runs the decode attention kernel (a prefill scan over chunks runs the masked
    # chunk path), else the largest
    decode = [b for b in bodies if any("decode_attention" in k["op"] for k in b)]
    return max(decode or bodies, key=len)


def _layer(op: str) -> str:
    m = re.search(r"/(layers_\d+|h_\d+)/", "/" + op)
    return m.group(1) if m else "(outside the layers)"


def on_h200():
    """``abstract``: a tree's shapes placed on the described H200 (``H200_TARGET``, one device, nothing allocated);
    from here on the ops choose their GPU implementations (``jax.default_backend`` reads "gpu")."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET, topology="1x1x1")
    mesh = topologies.make_mesh(topology, (1,), ("d",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    jax.default_backend = lambda: "gpu"  # the ops' implementation choices are the GPU's (nothing runs here)
    return lambda tree: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), tree)


def _h200_model(model_spec: str, overrides: tuple):
    """(model, abstract params, ``abstract``: ``on_h200``'s placement) — nothing allocated."""
    abstract = on_h200()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import fox_jax.models  # noqa: F401
    from bench_decode import model_config

    cfg = model_config(model_spec, list(overrides)).replace(dtype="bfloat16")
    return cfg.build(), abstract(jax.eval_shape(cfg.init_params, jax.random.PRNGKey(0))), abstract


def compile_generate(model_spec: str, policy: str, batch: int, prompt: int, new_tokens: int, slots: int | None,
                     overrides: tuple = ()):
    """The optimized HLO text of ``fox_jax.decoding.generate``'s program for an H200, compiled without a device."""
    from fox_jax.cache.policies import parse_policy
    from fox_jax.decoding import generation as gen
    from fox_jax.decoding import min_slots

    model, params, abstract = _h200_model(model_spec, overrides)
    pol = parse_policy(policy)
    context = prompt + new_tokens - 1
    with jax.default_device(jax.devices("cpu")[0]):  # the preamble builds concrete (empty) caches
        padded, caches, chunk = gen._fresh_caches(model, jnp.zeros((batch, prompt), jnp.int32), pol,
                                                  slots or min_slots(pol, context), None, 512, context)
    scalar, key = abstract(jax.ShapeDtypeStruct((), jnp.int32)), abstract(jax.ShapeDtypeStruct((2,), jnp.uint32))
    lowered = gen._generate.lower(model, params, abstract(padded), abstract(caches), key, chunk, new_tokens, 0.0,
                                  None, None, (), gen.cast_plan(model, params, caches), gen.STEPS_PER_CHECK,
                                  scalar)
    return lowered.compile().as_text()


def compile_score(model_spec: str, policy: str, batch: int, context: int, slots: int | None,
                  overrides: tuple = ()) -> str:
    """The optimized HLO text of ``eval --cache POLICY``'s program (``token_losses_under_policy``: the chunked
    prefill over ``context`` tokens, teacher-forced) for an H200, compiled without a device."""
    from fox_jax.cache.policies import parse_policy
    from fox_jax.decoding import generation as gen

    model, params, abstract = _h200_model(model_spec, overrides)
    with jax.default_device(jax.devices("cpu")[0]):
        padded, caches, chunk = gen._fresh_caches(model, jnp.zeros((batch, context), jnp.int32), parse_policy(policy),
                                                  slots, None, 512, context)
        plan = gen.cast_plan(model, params, caches)
    last = abstract(jax.ShapeDtypeStruct((batch,), jnp.int32))
    return gen._score.lower(model, params, abstract(padded), abstract(caches), chunk, plan, last).compile().as_text()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="fox-pro:125M", help="gpt2 or ARCH:SIZE (random init, as bench_decode.py)")
    p.add_argument("--policy", default="acp")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--slots", type=int, help="pool per row and head (default: the policy's need)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model config overrides (kv_heads=4)")
    p.add_argument("--layer", help="list the kernels of this layer (layers_0, h_0, ...) one per line")
    p.add_argument("--json", help="write the counts and the kernel list here")
    p.add_argument("--no-fold-norms", action="store_true",
                   help="leave each block's input norm out of its projections (generation.FOLD_INPUT_NORMS = False; "
                        "on by default)")
    p.add_argument("--fuse-mlp", action="store_true",
                   help="each block's MLP norm and SwiGLU as one op (generation.FUSE_DECODE_MLP)")
    p.add_argument("--project-out", action="store_true",
                   help="each FoX layer's output projection inside its decode kernel (generation.FUSE_OUTPUT_PROJ)")
    p.add_argument("--score", action="store_true",
                   help="compile eval --cache's program over --prompt tokens instead (no decode loop) and print its "
                        "compile time and its Triton fusions' tiles (XLA's generic Triton emitter)")
    args = p.parse_args(argv)
    from fox_jax.decoding import generation as gen

    gen.FOLD_INPUT_NORMS, gen.FUSE_DECODE_MLP = not args.no_fold_norms, args.fuse_mlp
    gen.FUSE_OUTPUT_PROJ = args.project_out
    t0 = time.perf_counter()
    if args.score:
        hlo = compile_score(args.model, args.policy, args.batch, args.prompt, args.slots, tuple(args.set))
        tiles = collections.Counter(re.findall(r'"output_tiles":\[\{"sizes":\[([^]]*)\]', hlo))
        print(f"{args.model} {args.policy} B{args.batch} context {args.prompt}: eval --cache's program compiled in "
              f"{time.perf_counter() - t0:.1f} s (no device); Triton fusions by output tile: "
              f"{', '.join(f'{n} × [{t}]' for t, n in tiles.most_common()) or 'none'}")
        return 0
    kernels = step_kernels(compile_generate(args.model, args.policy, args.batch, args.prompt, args.new_tokens,
                                            args.slots, tuple(args.set)))
    per_layer = collections.Counter(_layer(k["op"]) for k in kernels)
    layers = sorted((n for n in per_layer if n != "(outside the layers)"), key=lambda n: int(n.split("_")[1]))
    kinds = collections.Counter(k["kind"] for k in kernels)
    print(f"{args.model} {args.policy} B{args.batch} prompt {args.prompt}: {len(kernels)} kernels per decode step "
          f"({', '.join(f'{n} {k}' for k, n in kinds.most_common())}); per layer "
          f"{sorted(set(per_layer[n] for n in layers))}, outside the layers {per_layer['(outside the layers)']} "
          f"(compiled in {time.perf_counter() - t0:.0f} s, no device)")
    if args.layer:
        for k in kernels:
            if _layer(k["op"]) == args.layer:
                print(f"  {k['kind']:<34} {k['shape'][:34]:<34} {k['op'].split(args.layer + '/')[-1][:70]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, policy=args.policy, batch=args.batch, prompt=args.prompt,
                           kernels_per_step=len(kernels), per_layer=dict(per_layer), kinds=dict(kinds),
                           jax=jax.__version__, kernels=kernels), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
