"""Where a training step spends its device time: a ``jax.profiler`` trace of the real train step, summed
per kernel category, per step.

For each config (``arch:size:seq_len``, as ``bench_train.py``) and each variant (ModelConfig overrides,
e.g. the LM-head padding or the chunked loss off and on) it jits the train step of
``fox_jax.train.loop`` (AdamW, clipping, bf16 compute, float32 master weights) on synthetic tokens,
compiles it, warms up, traces ``--steps`` steps into a temporary directory, parses the trace that
``jax.profiler`` wrote (``*.trace.json.gz``, else ``perfetto_trace.json.gz``) and prints per step:
wall time, device time per category, and the top kernels with their HLO instruction, the JAX op that
produced it and the source line (from the compiled HLO's metadata).

Categories (first match wins; a kernel's text is its name, its HLO op name and opcode, and for a
fusion the opcodes inside it):
  attention    the Pallas kernels of kernels/forgetting_attention.py (``*_kernel``), Mosaic, cuDNN/fmha
  gemm         cuBLAS / nvjet / cutlass kernels, XLA gemm (Triton dot) fusions, dots, convolutions
  concatenate  fusions whose root is a concatenate
  reduction    reduction fusions (XLA ``*reduce*`` kernels) and reduce / reduce-window ops
  copy         copies, transposes, memcpy / memset, dynamic-update-slice, pads and slices
  elementwise  other (loop) fusions and single elementwise ops
  other        anything else (scatter, gather, sort, rng, ...)

    python benchmarks/profile_step.py --configs fox-pro:760M:16384 fox-pro:760M:2048 --batch-tokens 16384 \\
        --variants old:vocab_pad_multiple=1,loss_impl=logits new --out profile.json
    python benchmarks/profile_step.py --quick     # CPU smoke run (tiny model; the "kernels" are XLA CPU thunks)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

CATEGORIES = ("attention", "gemm", "concatenate", "reduction", "copy", "elementwise", "other")


# Variants ----------------------------------------------------------------------------------------

def parse_variant(spec: str) -> tuple[str, dict]:
    """``"name"`` or ``"name:key=value,key=value"`` -> (name, ModelConfig overrides).

    Values are parsed as int, float, true/false/none, else kept as strings.

    Raises:
      ValueError: an entry without ``=``.
    """
    name, _, rest = spec.partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        if "=" not in item:
            raise ValueError(f"variant {spec!r}: expected key=value entries after 'name:', got {item!r}")
        key, value = item.split("=", 1)
        overrides[key.strip()] = _parse_value(value.strip())
    return name or "default", overrides


def _parse_value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


# The step ----------------------------------------------------------------------------------------

def build_step(arch: str, size: str, seq_len: int, batch_tokens: int, dtype: str, remat: str, overrides: dict):
    """(compiled step, state, batch, model config, batch size, compile seconds, optimized HLO text) of the
    train step ``bench_train.py`` times, on one device."""
    from fox_jax.models import preset
    from fox_jax.train import config as config_lib
    from fox_jax.train.loop import LMTask, init_state, make_optimizer, make_train_step, train_step_compiler_options

    kw = dict(dtype=dtype) if remat is None else dict(dtype=dtype, remat=remat)  # None: the model's default
    if size == "tiny":
        kw["vocab_size"] = 257
    kw.update(overrides)
    model_cfg = preset(size, arch, **kw)
    batch = max(1, batch_tokens // seq_len)
    cfg = config_lib.ExperimentConfig(model=model_cfg, steps=1000, batch_size=batch)
    optimizer = make_optimizer(cfg)
    rng = jax.random.PRNGKey(0)
    state = jax.device_put(init_state(cfg, rng, optimizer))  # eager init (see train/loop.py)
    train_step = make_train_step(LMTask(cfg), model_cfg.build(), optimizer, 1)
    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (batch, seq_len + 1), dtype=np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": np.ones((batch, seq_len), np.int32),
            "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy()}
    data = jax.device_put(data)
    t0 = time.perf_counter()
    compiled = jax.jit(lambda s, b: train_step(s, b, {}), donate_argnums=(0,),
                       compiler_options=train_step_compiler_options() or None).lower(state, data).compile()
    compile_s = time.perf_counter() - t0
    try:
        hlo_text = compiled.as_text()
    except Exception:  # noqa: BLE001 - the text is only used for names
        hlo_text = ""
    return compiled, state, data, model_cfg, batch, compile_s, hlo_text


def trace_steps(compiled, state, data, steps: int, warmup: int, trace_dir: str):
    """Warm up, then trace ``steps`` synchronised steps into ``trace_dir``. Returns (state, wall ms list)."""
    for _ in range(warmup):
        state, m = compiled(state, data)
    jax.block_until_ready(m)
    walls = []
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                t = time.perf_counter()
                state, m = compiled(state, data)
                jax.block_until_ready(m)
                walls.append((time.perf_counter() - t) * 1e3)
    return state, walls


def trace_calls(fn, iters: int) -> tuple[list["KernelEvent"], list[float], str]:
    """Call ``fn()`` (already compiled) ``iters`` times under ``jax.profiler.trace``, each call synchronised.
    Returns (the trace's kernel events, the wall seconds of each call, where the events came from: ``device_events``).

    Raises:
      TraceError: the profiler wrote nothing readable (``find_trace``)."""
    walls = []
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(iters):
                t = time.perf_counter()
                jax.block_until_ready(fn())
                walls.append(time.perf_counter() - t)
        events, source = device_events(load_trace(find_trace(tmp)))
    return events, walls, source


# The trace -----------------------------------------------------------------------------------------

class TraceError(RuntimeError):
    """The profiler wrote nothing this script can read (the message says what was found)."""


def find_trace(trace_dir: str) -> str:
    """The chrome-format trace ``jax.profiler.trace`` wrote under ``trace_dir``.

    Prefers ``plugins/profile/<run>/<host>.trace.json.gz``, then ``perfetto_trace.json.gz``.

    Raises:
      TraceError: neither exists (e.g. only an ``.xplane.pb``: this jax writes no JSON trace; run with a
        jax that does, or convert the xplane with xprof's ``xspace_to_tool_data(..., "trace_viewer")``).
    """
    for pattern in ("**/*.trace.json.gz", "**/perfetto_trace.json.gz", "**/*.trace.json"):
        found = sorted(glob.glob(os.path.join(trace_dir, pattern), recursive=True))
        if found:
            return found[-1]
    xplanes = sorted(glob.glob(os.path.join(trace_dir, "**/*.xplane.pb"), recursive=True))
    if xplanes:
        converted = _convert_xplane(xplanes[-1])
        if converted:
            return converted
    listing = [os.path.relpath(p, trace_dir) for p in glob.glob(os.path.join(trace_dir, "**/*"), recursive=True)]
    raise TraceError(f"no *.trace.json.gz or perfetto_trace.json.gz under {trace_dir} (found: {listing or 'nothing'}); "
                     "jax.profiler.trace(create_perfetto_trace=True) writes one on jax 0.4.x-0.10; an xplane.pb "
                     "alone needs xprof (pip install xprof) to convert")


def _convert_xplane(path: str) -> str | None:
    """Convert an xplane.pb to a trace JSON with xprof / tensorboard-plugin-profile, when installed."""
    for mod in ("xprof.convert.raw_to_tool_data", "tensorboard_plugin_profile.convert.raw_to_tool_data"):
        try:
            conv = __import__(mod, fromlist=["xspace_to_tool_data"])
            data, _ = conv.xspace_to_tool_data([path], "trace_viewer", {})
        except Exception:  # noqa: BLE001 - optional converters
            continue
        out = path.replace(".xplane.pb", ".converted.trace.json.gz")
        with gzip.open(out, "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())
        return out
    return None


def load_trace(path: str) -> dict:
    """The JSON object of a (gzipped) chrome trace."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


@dataclasses.dataclass
class KernelEvent:
    name: str      # the kernel (GPU) or thunk (CPU) name
    hlo_op: str    # the HLO instruction it belongs to ("" when the trace does not say)
    module: str    # the HLO module ("" when the trace does not say)
    dur_us: float


def device_events(trace: dict) -> tuple[list[KernelEvent], str]:
    """The kernel events of a trace and where they came from (``"gpu"`` or ``"cpu"``).

    GPU: complete events on the ``Stream ...`` threads of ``/device:GPU:*`` processes (the derived
    "XLA Ops" / "XLA Modules" lines are skipped, so nothing is counted twice; a trace without stream
    threads falls back to the "XLA Ops" line, source ``"gpu-xla-ops"``). CPU (no GPU process):
    the XLA CPU thunks, i.e. host events carrying an ``hlo_op`` argument.

    Raises:
      TraceError: no such events at all.
    """
    events = trace.get("traceEvents", [])
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    gpu_pids = {pid for pid, name in procs.items() if re.search(r"/device:(GPU|gpu)", name)}
    out = []
    if gpu_pids:
        # kernels live on the "Stream #N" threads; a trace without them falls back to the "XLA Ops" line
        for wanted, source in (("stream", "gpu"), ("xla ops", "gpu-xla-ops")):
            for e in events:
                if e.get("ph") != "X" or e.get("pid") not in gpu_pids:
                    continue
                tname = threads.get((e.get("pid"), e.get("tid")), "")
                if not tname.lower().startswith(wanted):
                    continue
                args = e.get("args") or {}
                hlo_op = str(args.get("hlo_op", "")) or (str(e.get("name", "")) if wanted == "xla ops" else "")
                out.append(KernelEvent(str(e.get("name", "")), hlo_op, str(args.get("hlo_module", "")),
                                       float(e.get("dur", 0.0))))
            if out:
                break
    else:
        for e in events:
            args = e.get("args") or {}
            if e.get("ph") != "X" or "hlo_op" not in args or str(e.get("name", "")).startswith("end: "):
                continue
            out.append(KernelEvent(str(e.get("name", "")), str(args["hlo_op"]), str(args.get("hlo_module", "")),
                                   float(e.get("dur", 0.0))))
        source = "cpu"
    if not out:
        raise TraceError(f"the trace has no device kernel events (processes: {sorted(set(procs.values()))})")
    return out, source


# The compiled HLO: what each instruction is ---------------------------------------------------------

@dataclasses.dataclass
class HloInfo:
    opcode: str
    shape: str
    op_name: str = ""
    source: str = ""
    fused_ops: tuple[str, ...] = ()
    root: str = ""
    target: str = ""
    tiling: str = ""  # a Triton GEMM fusion's tiles as XLA chose them (autotuned on the device), ``gemm_tiling``


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")


def parse_hlo(text: str) -> dict[str, HloInfo]:
    """Instruction name -> ``HloInfo`` from an optimized HLO module's text (``compiled.as_text()``).

    For a fusion: the opcodes inside its fused computation and the root's opcode. ``source`` is the
    innermost stack frame in this project's files, when the text carries stack frames.
    """
    if not text:
        return {}
    files, funcs, locs, frames = {}, {}, {}, {}
    section = None
    comps: dict[str, list[str]] = {}
    roots: dict[str, str] = {}
    dot_k: dict[str, str] = {}
    infos: dict[str, HloInfo] = {}
    current = None
    for line in text.splitlines():
        head = line.strip()
        if head in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = head
            continue
        if section and re.match(r"^\d+ ", head):
            key, _, val = head.partition(" ")
            if section == "FileNames":
                files[int(key)] = val.strip('"')
            elif section == "FunctionNames":
                funcs[int(key)] = val.strip('"')
            elif section == "FileLocations":
                m = re.search(r"file_name_id=(\d+).*?line=(\d+)", val)
                if m:
                    locs[int(key)] = (int(m.group(1)), int(m.group(2)))
            elif section == "StackFrames":
                m = re.search(r"file_location_id=(\d+)\s+parent_frame_id=(\d+)", val)
                if m:
                    frames[int(key)] = (int(m.group(1)), int(m.group(2)))
            continue
        m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?.*\{\s*$", head)
        if m and "=" not in head.split("{")[0]:
            section, current = None, m.group(1)
            comps[current] = []
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        section = None
        name, shape, opcode, rest = m.groups()
        info = HloInfo(opcode=opcode, shape=shape.split("{")[0])
        mm = re.search(r'op_name="([^"]*)"', rest)
        if mm:
            info.op_name = mm.group(1)
        mm = re.search(r'custom_call_target="([^"]*)"', rest)
        if mm:
            info.target = mm.group(1)
        mm = re.search(r"calls=%?([\w.\-]+)", rest)
        if mm:
            info.root = "calls:" + mm.group(1)
        mm = re.search(r"stack_frame_id=(\d+)", rest)
        if mm:
            info.source = mm.group(1)
        if opcode == "fusion":  # XLA's GEMMs are fusions (custom calls and other ops carry no Triton tiling)
            info.tiling = gemm_tiling(rest)
        infos[name] = info
        if current is not None:
            comps[current].append(opcode)
            mm = re.search(r'backend_config=\{"sizes":\[([^\]]*)\]', rest) if opcode == "dot" else None
            if mm:  # a nested GEMM fusion's dot: its contracting tile (block_k)
                dot_k[current] = mm.group(1).replace('"', "")
            if line.lstrip().startswith("ROOT"):
                roots[current] = opcode
    for info in infos.values():
        if info.root.startswith("calls:"):
            comp = info.root[len("calls:"):]
            info.fused_ops = tuple(sorted(set(comps.get(comp, ()))))
            info.root = roots.get(comp, "")
            if info.tiling and comp in dot_k and " k" not in info.tiling:
                info.tiling += f" k{dot_k[comp]}"
        if info.source:
            info.source = _source_line(int(info.source), frames, locs, files)
    return infos


def gemm_tiling(attrs: str) -> str:
    """A Triton GEMM fusion's tiling from its HLO attributes (the text after the opcode), ``""`` for anything else.

    XLA's autotuner picks it on the device (offline compiles get the defaults). Read from the fusion's
    ``backend_config`` JSON, in either of its two forms: ``triton_gemm_config`` (block_m/n/k, split_k, stages,
    warps) and the nested-fusion form of jax ≥ 0.10, ``block_level_fusion_config`` (output tile sizes; the
    contracting tile is on the nested dot, added by ``parse_hlo`` as ``k…``). E.g. ``"tile 8x16 w2 s1 k128"``; a
    split over K shows as a leading output dimension of the float32 partials (``shape``)."""
    at = attrs.find("backend_config={")
    if at < 0:
        return ""
    try:  # the JSON object that follows (other attributes may come after it)
        cfg = json.JSONDecoder().raw_decode(attrs, at + len("backend_config="))[0]["fusion_backend_config"]
    except (ValueError, KeyError, TypeError):
        return ""
    if "gemm" not in str(cfg.get("kind", "")):
        return ""
    c = cfg.get("triton_gemm_config")
    if c:
        return (f"tile {c.get('block_m', '?')}x{c.get('block_n', '?')} k{c.get('block_k', '?')} "
                f"split{c.get('split_k', '1')} w{c.get('num_warps', '?')} s{c.get('num_stages', '?')}")
    c = cfg.get("block_level_fusion_config")
    if not c:
        return ""
    tiles = c.get("output_tiles") or [{}]
    size = "x".join(str(v) for v in tiles[0].get("sizes", ["?"]))
    return f"tile {size} w{c.get('num_warps', '?')} s{c.get('num_stages', '?')}"


def _source_line(frame: int, frames, locs, files) -> str:
    """The innermost frame of this project (fox_jax/, kernels/, train/) as ``path:line``, else the
    innermost frame. XLA prints ``parent_frame_id`` one above the parent's key (jax 0.10); both readings
    are tried, so a printer without the offset works too."""
    first = ""
    for offset in (-1, 0):
        f, seen = frame, set()
        while f in frames and f not in seen:
            seen.add(f)
            loc, parent = frames[f]
            if loc in locs:
                fid, line = locs[loc]
                path = files.get(fid, "?")
                where = f"{_short_path(path)}:{line}"
                first = first or where
                if re.search(r"/(fox_jax|kernels|train)/", path):
                    return where
            f = parent + offset
    return first


def _short_path(path: str) -> str:
    m = re.search(r"((fox_jax|kernels|train|benchmarks|tests)/.*)$", path)
    return m.group(1) if m else os.path.basename(path)


def _lookup(infos: dict[str, HloInfo], ev: KernelEvent) -> tuple[str, HloInfo | None]:
    """(HLO instruction name, info) of a kernel event (its ``hlo_op``, else its name, '_N' read as '.N')."""
    for cand in (ev.hlo_op, ev.name, re.sub(r"_(\d+)$", r".\1", ev.name)):
        if cand and cand in infos:
            return cand, infos[cand]
    return ev.hlo_op or ev.name, None


def attention_kernel_names() -> tuple[str, ...]:
    """The Pallas kernel function names of kernels/forgetting_attention.py (``*_kernel``)."""
    try:
        from fox_jax.kernels import forgetting_attention as fa
        names = tuple(n for n in dir(fa) if n.endswith("_kernel") and callable(getattr(fa, n)))
    except Exception:  # noqa: BLE001 - the names are a heuristic
        names = ()
    return names or ("_fwd_kernel", "_dq_kernel", "_dkv_kernel", "_dmask_kernel")


_MOVES = {"copy", "transpose", "pad", "slice", "dynamic-slice", "dynamic-update-slice", "bitcast", "reshape",
          "broadcast", "parameter", "constant", "tuple", "get-tuple-element", "iota"}


def categorize(name: str, hlo_op: str, info: HloInfo | None, attention_names=None) -> str:
    """One of ``CATEGORIES`` for a kernel (see the module docstring for the rules).

    With the compiled HLO's ``info`` the instruction decides (opcode, custom-call target, a fusion's root
    and the opcodes inside it); without it the kernel and HLO op names do (XLA names fusions after their
    kind and root, e.g. ``loop_add_fusion``, ``input_reduce_fusion``, ``gemm_fusion_dot``).
    """
    attention_names = attention_names or attention_kernel_names()
    text = f"{name} {hlo_op}".lower()
    if any(k.lower().lstrip("_") in text for k in attention_names) or re.search(
            r"mosaic|fmha|cudnn|flash|pallas|decode_attention", text):  # decode_attention: the decode kernel
        return "attention"
    if info is not None:
        target = info.target.lower()
        fused = set(info.fused_ops)
        if info.opcode == "custom-call":
            if "triton" in target and "gemm" not in target:
                return "attention"  # Pallas (Triton) calls; XLA's own Triton gemms are fusions
            if re.search(r"gemm|cublas|matmul", target):
                return "gemm"
            if "cudnn" in target or "fmha" in target:
                return "attention"
            return "other"
        if info.opcode in ("dot", "convolution") or "dot" in fused or "convolution" in fused or "gemm" in text:
            return "gemm"
        if info.opcode == "concatenate" or info.root == "concatenate" or "concatenate" in fused or (
                info.op_name.endswith("/concatenate") and (info.opcode in _MOVES or fused <= _MOVES)):
            return "concatenate"
        if info.opcode in ("reduce", "reduce-window") or fused & {"reduce", "reduce-window"}:
            return "reduction"
        if info.opcode in ("scatter", "gather", "sort", "rng-bit-generator", "while", "conditional") or fused & {
                "scatter", "gather", "sort"}:
            return "other"
        if info.opcode in _MOVES or info.opcode == "fusion" and fused and fused <= _MOVES:
            return "copy"
        return "elementwise"
    if re.search(r"gemm|nvjet|cublas|cutlass|xmma|matmul|sm90_|sm80_|ampere_|hopper_|\bdot\b|dot[._]", text):
        return "gemm"
    if "concatenate" in text:
        return "concatenate"
    if "reduc" in text:
        return "reduction"
    if re.search(r"copy|transpose|memcpy|memset|dynamic[-_]update[-_]slice", text):
        return "copy"
    if re.search(r"scatter|gather|sort|rng", text):
        return "other"
    if re.search(r"fusion|loop_|wrapped_|elementwise", text):
        return "elementwise"
    return "other"


def summarize(events: list[KernelEvent], n_steps: int, infos: dict[str, HloInfo], module: str | None = None,
              top: int = 20) -> dict:
    """Device time per step by category, the top kernels and the top JAX ops (layer index folded).

    Args:
      events: ``device_events``; n_steps: the steps traced; infos: ``parse_hlo`` of the step's module;
      module: keep only events of HLO modules whose name starts with this (None/"" = all events);
      top: rows of each ranking.
    Returns:
      {"per_step_ms": {category: ms}, "total_ms": ms, "kernels": [...], "ops": [...], "n_events": n}.
    """
    if module:
        kept = [e for e in events if not e.module or e.module.startswith(module)]
        events = kept or events
    names = attention_kernel_names()
    per_cat = collections.Counter()
    per_kernel: dict[tuple[str, str], dict] = {}
    per_op: dict[str, dict] = {}
    for ev in events:
        op, info = _lookup(infos, ev)
        cat = categorize(ev.name, op, info, names)
        ms = ev.dur_us / 1e3 / n_steps
        per_cat[cat] += ms
        row = per_kernel.setdefault((ev.name, op), dict(
            kernel=ev.name, hlo_op=op, category=cat, ms=0.0, calls=0,
            opcode=info.opcode if info else "", shape=info.shape if info else "",
            fused_ops=",".join(info.fused_ops) if info else "",
            op_name=info.op_name if info else "", source=info.source if info else "",
            tiling=info.tiling if info else ""))
        row["ms"] += ms
        row["calls"] += 1 / n_steps
        jax_op = _fold_layers(info.op_name) if info and info.op_name else f"({op})"
        r2 = per_op.setdefault(jax_op, dict(jax_op=jax_op, category=cat, ms=0.0, calls=0,
                                            source=info.source if info else ""))
        r2["ms"] += ms
        r2["calls"] += 1 / n_steps
    kernels = sorted(per_kernel.values(), key=lambda r: -r["ms"])[:top]
    ops = sorted(per_op.values(), key=lambda r: -r["ms"])[:top]
    return dict(per_step_ms={c: per_cat.get(c, 0.0) for c in CATEGORIES}, total_ms=sum(per_cat.values()),
                kernels=kernels, ops=ops, n_events=len(events))


def _fold_layers(op_name: str) -> str:
    s = re.sub(r"layers_\d+", "layers_*", op_name)
    s = re.sub(r"^jit\([^)]*\)/", "", s)
    return s.replace("while/body/closed_call/", "")


# Main -----------------------------------------------------------------------------------------------

def profile_one(arch, size, seq_len, variant, overrides, args) -> dict:
    compiled, state, data, model_cfg, batch, compile_s, hlo_text = build_step(
        arch, size, seq_len, args.batch_tokens, args.dtype, args.remat, overrides)
    infos = parse_hlo(hlo_text)
    module = _module_name(hlo_text)
    trace_dir = tempfile.mkdtemp(prefix="profile_step_")
    try:
        state, walls = trace_steps(compiled, state, data, args.steps, args.warmup, trace_dir)
        path = find_trace(trace_dir)
        events, source = device_events(load_trace(path))
        if args.keep_trace:
            os.makedirs(args.keep_trace, exist_ok=True)
            dst = os.path.join(args.keep_trace, f"{arch}_{size}_{seq_len}_{variant}" + os.path.basename(path)[-14:])
            shutil.copyfile(path, dst)
    finally:
        if not args.keep_trace:
            shutil.rmtree(trace_dir, ignore_errors=True)
    summary = summarize(events, args.steps, infos, module, args.top)
    step_ms = statistics.median(walls)
    try:  # XLA's buffer assignment: the step's temporaries (activations, logits, ...) in GiB
        temp_gib = compiled.memory_analysis().temp_size_in_bytes / 2**30
    except Exception:  # noqa: BLE001 - not every backend reports it
        temp_gib = None
    flops = 3 * model_cfg.flops_per_token(seq_len) * batch * seq_len
    from fox_jax.train.metrics import device_peak_flops
    peak = device_peak_flops(args.dtype)
    return dict(arch=arch, size=size, seq_len=seq_len, batch=batch, variant=variant, overrides=overrides,
                step_ms=step_ms, wall_ms=walls, compile_s=compile_s, mfu=flops / (step_ms / 1e3) / peak if peak else None,
                temp_gib=temp_gib, trace_source=source, hlo_module=module, **summary)


def _module_name(text: str) -> str:
    m = re.match(r"HloModule\s+([\w.\-]+)", text or "")
    return m.group(1) if m else ""


def print_report(rows: list[dict]) -> None:
    ok = [r for r in rows if "error" not in r]
    for r in rows:
        if "error" in r:
            print(f"\n{r['arch']}:{r['size']}:{r['seq_len']} [{r['variant']}]: {r['error']}")
    if not ok:
        return
    head = [f"{r['arch']}:{r['size']}:{r['seq_len']}x{r['batch']} [{r['variant']}]" for r in ok]
    print("\n| per step (ms) | " + " | ".join(head) + " |")
    print("|---|" + "---|" * len(ok))
    print("| wall (median) | " + " | ".join(f"{r['step_ms']:.1f}" for r in ok) + " |")
    print("| MFU | " + " | ".join(f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "–" for r in ok) + " |")
    print("| device total | " + " | ".join(f"{r['total_ms']:.1f}" for r in ok) + " |")
    print("| temp memory (GiB) | " + " | ".join(f"{r['temp_gib']:.2f}" if r.get("temp_gib") is not None else "–"
                                            for r in ok) + " |")
    for c in CATEGORIES:
        print(f"| {c} | " + " | ".join(f"{r['per_step_ms'][c]:.2f}" for r in ok) + " |")
    for r in ok:
        print(f"\nTop kernels, {r['arch']}:{r['size']}:{r['seq_len']}x{r['batch']} [{r['variant']}] "
              f"({r['trace_source']} trace, {r['n_events']} events):")
        print("| ms/step | calls | category | kernel | HLO op | shape | JAX op | source |")
        print("|---|---|---|---|---|---|---|---|")
        for k in r["kernels"]:
            print(f"| {k['ms']:.3f} | {k['calls']:.0f} | {k['category']} | {k['kernel'][:48]} | {k['hlo_op'][:40]} | "
                  f"{k['shape'][:40]}{' ' + k['tiling'] if k.get('tiling') else ''} | {_fold_layers(k['op_name'])[-70:]} | "
                  f"{k['source']} |")
        print("\nTop JAX ops (layers folded):")
        print("| ms/step | kernels/step | category | JAX op | source |")
        print("|---|---|---|---|---|")
        for o in r["ops"]:
            print(f"| {o['ms']:.3f} | {o['calls']:.0f} | {o['category']} | {o['jax_op'][-90:]} | {o['source']} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=["fox-pro:760M:16384"], help="arch:size:seq_len entries")
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per step (batch = this // seq_len)")
    p.add_argument("--variants", nargs="+", default=["default"],
                   help="name or name:key=value,... (ModelConfig overrides), e.g. "
                        "old:vocab_pad_multiple=1,loss_impl=logits new:loss_impl=chunked")
    p.add_argument("--steps", type=int, default=3, help="steps traced")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--remat", default=None, choices=("none", "full", "dots"),
                   help="activation rematerialisation (default: the model config's, dots)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--keep-trace", default=None, help="copy each trace JSON into this folder")
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--quick", action="store_true", help="CPU smoke run with the tiny model")
    args = p.parse_args(argv)
    if args.quick:
        args.configs, args.batch_tokens, args.steps, args.warmup, args.dtype = (
            ["fox-pro:tiny:64"], 128, 2, 1, "float32")
    variants = [parse_variant(v) for v in args.variants]
    meta = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
                jaxlib=getattr(jax.lib, "__version__", None) or _version("jaxlib"), flax=_version("flax"),
                optax=_version("optax"), python=platform.python_version(), dtype=args.dtype,
                remat=args.remat, steps=args.steps, warmup=args.warmup, batch_tokens=args.batch_tokens,
                argv=sys.argv[1:] if argv is None else list(argv))
    rows = []
    for entry in args.configs:
        arch, size, seq = entry.split(":")
        for name, overrides in variants:
            try:
                row = profile_one(arch, size, int(seq), name, overrides, args)
            except TraceError:
                raise
            except Exception as e:  # OOM or unsupported: record and go on
                row = dict(arch=arch, size=size, seq_len=int(seq), variant=name, overrides=overrides,
                           error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            brief = {k: v for k, v in row.items() if k not in ("kernels", "ops", "wall_ms")}
            print(json.dumps(brief), flush=True)
            print_report([row])  # each row's tables as soon as it is measured: a run cut short keeps them
            if args.out:  # and the JSON after every row
                with open(args.out, "w") as f:
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if len(rows) > 1:
        print_report(rows)
    return rows


def _version(pkg: str):
    try:
        from importlib.metadata import version
        return version(pkg)
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    main()
