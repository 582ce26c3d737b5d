"""How many attention kernels does one training step run per layer, scanned and unrolled? (issue 22)

On the H200 the 760M step with ``scan_layers=True`` ran 4 Mosaic attention kernels per layer where the unrolled
step ran 3 (benchmarks/NOTES.md, "Scanned layers"). This traces ``value_and_grad`` of a small model's loss with
each attention implementation and ``scan_layers`` off and on, counts the ``pallas_call``s by kernel name in the
jaxpr (what JAX asks for, before XLA) and in the compiled HLO's custom calls (what runs), and prints where each
forward kernel sits (the primitive path around it), so a second forward shows up with its cause.

    python benchmarks/checks/check_scan_grad.py                       # pallas (interpret on CPU)
    python benchmarks/checks/check_scan_grad.py --impls mosaic,pallas # on a Hopper GPU
    # the profiled program's shape (760M FoX (Pro), 16k, scanned only): the custom calls of each while body
    python benchmarks/checks/check_scan_grad.py --impls mosaic --size 760M --seq 16384 --scan on

The 2-layer check on the H200 (2026-12-03) found one forward call per layer in both forms, while the 760M
profile's forward loop ran 48 Mosaic launches per step (2 per layer, each at the forward kernel's time): the
``--size`` / ``--scan`` form looks at the profiled shape itself. ``--train-step`` traces the program the profile
times (``fox_jax.train.loop.make_train_step``: loss, gradient, clipping, AdamW) and prints the kernels of each scan
body in its jaxpr; with ``--trace-only`` it stops there, so it runs on the CPU machine for the Mosaic kernels too
(their availability check is bypassed: nothing is lowered):

    python benchmarks/checks/check_scan_grad.py --train-step --trace-only --impls mosaic --size 760M --seq 16384
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re

import jax
import jax.numpy as jnp

from fox_jax.models import preset


_KERNELS = ("pallas_call", "mpmd_map")  # a Pallas (Triton) kernel; a Mosaic GPU kernel


def _subjaxprs(eqn):
    """The jaxprs inside an equation's parameters (loop bodies, calls, branches)."""
    for v in eqn.params.values():
        for sub in (v if isinstance(v, (list, tuple)) else [v]):
            inner = getattr(sub, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                yield inner
            elif hasattr(sub, "eqns"):
                yield sub


def _walk(jaxpr, path, out):
    """(path of primitive names, kernel name) for every kernel call in a closed jaxpr, recursively."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _KERNELS:
            kname = str(eqn.params.get("name_and_src_info", eqn.params.get("name", "?"))).split(" ")[0] \
                if name == "pallas_call" else "mosaic"  # (a Mosaic kernel's jaxpr names no kernel)
            out.append(("/".join(path), kname))
        for sub in _subjaxprs(eqn):
            _walk(sub, path + [name], out)


def _while_bodies(hlo: str) -> dict[str, str]:
    """{computation name: its text} for the computations that are some while loop's body in HLO text, each with
    the text of every computation it calls (fusions, command buffers, async wrappers), transitively: a custom call
    launched by one loop iteration is in its body's text wherever XLA nested it."""
    comps = {}
    for block in re.split(r"\n(?=\S)", hlo):  # computations start at column 0
        m = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s", block)
        if m:
            comps[m.group(1)] = block
    calls = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|called_computations)="
                       r"\{?([%\w.\-, ]+)\}?")

    def closure(name: str, seen: set[str]) -> str:
        seen.add(name)
        text = comps.get(name, "")
        parts = [text]
        for group in calls.findall(text):
            for callee in (c.strip().lstrip("%") for c in group.split(",")):
                if callee and callee not in seen:
                    parts.append(closure(callee, seen))
        return "\n".join(parts)

    return {name: closure(name, set()) for name in set(re.findall(r"\bbody=%?([\w.\-]+)", hlo)) if name in comps}


def _scan_report(jaxpr, depth=0) -> list[str]:
    """A line per scan in the jaxpr (nested scans indented): its length and the kernel calls of its body."""
    lines = []
    for eqn in jaxpr.eqns:
        subs = list(_subjaxprs(eqn))
        if eqn.primitive.name == "scan":
            found = []
            _walk(subs[0], [], found)
            lines.append(f"{'  ' * depth}scan of {eqn.params['length']}: {dict(collections.Counter(k for _, k in found))}")
        for sub in subs:
            lines += _scan_report(sub, depth + (eqn.primitive.name == "scan"))
    return lines


def train_step_report(impl: str, size: str, seq: int, scan: bool, trace_only: bool,
                      hlo_out: str | None = None) -> None:
    """The kernels per scan body of the train step's jaxpr (and, unless ``trace_only``, of the compiled HLO's while
    bodies) for FoX (Pro) ``size`` at ``seq`` tokens, bf16, batch 1."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from bench_decode import model_config
    from fox_jax.train import config as config_lib
    from fox_jax.train.loop import LMTask, init_state, make_optimizer, make_train_step

    if trace_only and impl == "mosaic":  # tracing needs no device; the op's availability check is for running
        import fox_jax.ops.pallas as pallas_ops
        pallas_ops.mosaic_supported = lambda q, k: None
        pallas_ops._interpret_default = lambda: False
        jax.default_backend = lambda: "gpu"
    model_cfg = model_config(f"fox-pro:{size}", [f"scan_layers={str(scan).lower()}",
                                                 f"attention_impl={impl}"]).replace(dtype="bfloat16")
    cfg = config_lib.ExperimentConfig(model=model_cfg, steps=1000, batch_size=1)
    optimizer = make_optimizer(cfg)
    state = jax.eval_shape(lambda: init_state(cfg, jax.random.PRNGKey(0), optimizer))
    step = make_train_step(LMTask(cfg), model_cfg.build(), optimizer, 1)
    tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens, "segment_ids": tokens, "positions": tokens}
    fn = lambda s, b: step(s, b, {})  # noqa: E731
    print(f"== train step, {impl}, fox-pro {size}, {seq} tokens, scan_layers={scan}", flush=True)
    for line in _scan_report(jax.make_jaxpr(fn)(state, batch).jaxpr):
        print("   jaxpr " + line)
    if trace_only:
        return
    hlo = jax.jit(fn).lower(state, batch).compile().as_text()
    if hlo_out:
        with gzip.open(hlo_out, "wt") as f:
            f.write(hlo)
        print(f"   wrote the optimized HLO to {hlo_out}")
    for comp, body in _while_bodies(hlo).items():
        targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', body))
        if targets:
            print(f"   HLO while body {comp}: custom calls {dict(targets)}")
            for line in _kernel_calls(body):
                print(f"      {line}")


def _kernel_calls(text: str) -> list[str]:
    """One line per attention custom call (Mosaic or Triton) in HLO text: its instruction name, the computation
    it sits in, its result types, operand count and the tail of its op_name — so two calls of one loop body say
    whether they are one kernel twice (same results and operands; e.g. a clone inside a ``dynamic-slice-fusion``
    computation, which XLA 0.11 made of the Mosaic forward) or two different kernels (dQ and dK/dV)."""
    out, comp = [], "?"
    for line in text.splitlines():
        header = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s", line)
        if header:  # a computation starts at column 0
            comp = header.group(1)
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = (\(.*?\)|\S+) custom-call\((.*?)\), custom_call_target=\"([^\"]+)\"", line)
        if m and ("mosaic" in m.group(4) or "triton" in m.group(4)):
            op = re.search(r'op_name="([^"]+)"', line)
            out.append(f"{m.group(1)} in {comp}: {m.group(2)[:120]} <- {m.group(3).count('%')} operands "
                       f"[{m.group(4)}] {op.group(1)[-90:] if op else ''}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", default="pallas")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--size", default="tiny", help="a fox-pro preset size (tiny: 2 small layers, --layers)")
    ap.add_argument("--scan", choices=("both", "on", "off"), default="both")
    ap.add_argument("--train-step", action="store_true", help="the profiled program (make_train_step), not a plain loss")
    ap.add_argument("--trace-only", action="store_true", help="with --train-step: the jaxpr only (no compile)")
    ap.add_argument("--hlo-out", help="with --train-step: also write the compiled program's HLO text here (gzip)")
    args = ap.parse_args(argv)
    scans = {"both": (False, True), "on": (True,), "off": (False,)}[args.scan]
    if args.train_step:
        for impl in args.impls.split(","):
            for scan in scans:
                train_step_report(impl, args.size, args.seq, scan, args.trace_only, args.hlo_out)
        return
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    for impl in args.impls.split(","):
        for scan in scans:
            shape = dict(vocab_size=256, n_layers=args.layers) if args.size == "tiny" else {}
            cfg = preset(args.size, "fox-pro", attention_impl=impl, scan_layers=scan, remat="none", dtype=dtype,
                         **shape)
            model, params = cfg.build(), cfg.init_params(jax.random.PRNGKey(0))
            tokens = jnp.ones((1, args.seq), jnp.int32)

            def loss(p):
                logits = model.apply({"params": p}, tokens).logits
                return jnp.mean(jnp.square(logits.astype(jnp.float32)))

            step = jax.value_and_grad(loss)
            found = []
            _walk(jax.make_jaxpr(step)(params).jaxpr, [], found)
            hlo = jax.jit(step).lower(params).compile().as_text()
            calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))
            print(f"== {impl} scan_layers={scan}: jaxpr kernels {dict(collections.Counter(k for _, k in found))}; "
                  f"HLO custom calls {dict(calls)}; HLO while loops {hlo.count(' while(')}", flush=True)
            for comp, body in _while_bodies(hlo).items():  # what each loop iteration launches
                targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', body))
                print(f"   while body {comp}: custom calls {dict(targets)}")
            for path, k in found:
                print(f"   {k:28s} in {path or '(top)'}")


if __name__ == "__main__":
    main()
