"""Run the Pallas forgetting attention (fwd+bwd) twice on identical inputs and compare bit for bit.

A moving result between identical runs means a race in a kernel. Also compares dense Pallas with
ACP at threshold −inf (same tiles, different code path). Prints one line per check; exit 1 on mismatch.

    python benchmarks/checks/check_determinism.py --shape 1x16384x16x128 --repeats 3
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from fox_jax.ops import forgetting_attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1x16384x16x128")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    b, t, h, d = map(int, args.shape.split("x"))
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q, k, v = (jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(jnp.bfloat16) for kk in ks[:3])
    mu = jnp.linspace(0.0, 6.0, h)
    lf = jax.nn.log_sigmoid(mu + jax.random.normal(ks[3], (b, t, h)))
    do = jax.random.normal(ks[4], (b, t, h, d), jnp.float32).astype(jnp.bfloat16)

    def run(threshold):
        f = lambda q, k, v, lf: forgetting_attention(q, k, v, lf, implementation="pallas",
                                                     adaptive_threshold=threshold)
        o, vjp = jax.vjp(f, q, k, v, lf)
        return [x.astype(jnp.float32) for x in (o, *vjp(do))]

    step = jax.jit(lambda: run(None))
    host = lambda xs: [np.asarray(x) for x in xs]
    first = host(step())
    ok = True
    for i in range(1, args.repeats):
        again = host(step())
        diffs = [float(np.max(np.abs(a - b_))) for a, b_ in zip(first, again)]
        same = all(np.array_equal(a, b_) for a, b_ in zip(first, again))
        ok &= same
        print(f"repeat {i}: bitwise equal={same} max|diff| o,dq,dk,dv,df = {diffs}", flush=True)
    acp = host(jax.jit(lambda: run(-jnp.inf))())
    diffs = [float(np.max(np.abs(a - b_))) for a, b_ in zip(first, acp)]
    print(f"ACP(-inf) vs dense: bitwise equal={all(np.array_equal(a, b_) for a, b_ in zip(first, acp))} "
          f"max|diff| = {diffs}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
