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
``--size`` / ``--scan`` form looks at the profiled shape itself.
"""

from __future__ import annotations

import argparse
import collections
import re

import jax
import jax.numpy as jnp

from fox_jax.models import preset


def _walk(jaxpr, path, out):
    """(path of primitive names, pallas kernel name) for every pallas_call in a closed jaxpr, recursively."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            kname = str(eqn.params.get("name_and_src_info", eqn.params.get("name", "?"))).split(" ")[0]
            out.append(("/".join(path), kname))
        for v in eqn.params.values():
            subs = v if isinstance(v, (list, tuple)) else [v]
            for sub in subs:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    _walk(inner, path + [name], out)
                elif hasattr(sub, "eqns"):
                    _walk(sub, path + [name], out)


def _while_bodies(hlo: str) -> dict[str, str]:
    """{computation name: its text} for the computations that are some while loop's body in HLO text."""
    names = set(re.findall(r"\bbody=%?([\w.\-]+)", hlo))
    comps = {}
    for block in re.split(r"\n(?=\S)", hlo):  # computations start at column 0
        m = re.match(r"%?([\w.\-]+)\s", block)
        if m and m.group(1) in names:
            comps[m.group(1)] = block
    return comps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", default="pallas")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--size", default="tiny", help="a fox-pro preset size (tiny: 2 small layers, --layers)")
    ap.add_argument("--scan", choices=("both", "on", "off"), default="both")
    args = ap.parse_args(argv)
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    for impl in args.impls.split(","):
        for scan in {"both": (False, True), "on": (True,), "off": (False,)}[args.scan]:
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
