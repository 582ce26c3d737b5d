"""One-off GPU check of the sliding window (not part of the suite): Triton kernels vs the f32 reference."""
import time
import jax, jax.numpy as jnp, numpy as np
from fox_jax.ops import forgetting_attention, forgetting_attention_reference
print(jax.__version__, jax.devices(), flush=True)

def inputs(b, tq, tk, h, hkv, d, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (b, tq, h, d)).astype(dtype)
    k = jax.random.normal(ks[1], (b, tk, hkv, d)).astype(dtype)
    v = jax.random.normal(ks[2], (b, tk, hkv, d)).astype(dtype)
    lf = jax.nn.log_sigmoid(jax.random.uniform(ks[3], (b, tk, h), minval=0., maxval=5.))
    w = jax.random.normal(ks[4], (b, tq, h, d))
    return q, k, v, lf, w

def vg(fn, q, k, v, lf, w):
    def loss(*a):
        o = fn(*a)
        return jnp.sum(o.astype(jnp.float32) * w), o
    (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, lf)
    return [o] + list(g)

TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 3e-2)}
fails = 0
for (b, tq, tk, h, hkv, d), dtype in [((2, 300, 517, 4, 2, 64), jnp.float32), ((2, 1000, 1000, 4, 2, 128), jnp.bfloat16),
                                      ((1, 77, 77, 2, 1, 128), jnp.float32), ((1, 1, 300, 4, 4, 64), jnp.bfloat16)]:
    q, k, v, lf, w = inputs(b, tq, tk, h, hkv, d, dtype)
    t = np.arange(tk)
    seg = jnp.asarray(np.stack([(t >= tk // 3 + 5 * i).astype(np.int32) + (t >= 2 * tk // 3 - i) for i in range(b)]))
    ss = jnp.asarray([0, 13][:b], jnp.int32)
    for W in (1, 3, 64, 257, 100000):
        for kw in ({}, dict(seq_start=ss, segment_ids=seg)):
            f32 = lambda x: x.astype(jnp.float32)
            ref = vg(lambda *a: forgetting_attention_reference(*a, window_size=W, **kw), f32(q), f32(k), f32(v), lf, w)
            for impl in ("pallas", "xla"):
                got = vg(lambda *a: forgetting_attention(*a, window_size=W, implementation=impl, **kw), q, k, v, lf, w)
                errs = []
                for name, a, r, tol in zip(("o", "dq", "dk", "dv", "dlf"), got, ref, (TOL[dtype][0],) + (TOL[dtype][1],) * 4):
                    a, r = np.asarray(f32(a)), np.asarray(r)
                    scale = max(float(np.abs(r).max()), 1e-3)
                    err = float(np.abs(a - r).max())
                    ok = np.isfinite(a).all() and err <= tol * scale + 1e-5
                    errs.append(f"{name}:{err / scale:.1e}{'' if ok else '!!'}")
                    fails += not ok
                print((b, tq, tk, h, hkv, d), dtype.__name__, "W", W, list(kw), impl, " ".join(errs), flush=True)
    # W ≥ Tk is bit-identical to no window
    for impl in ("pallas", "xla"):
        a = vg(lambda *x: forgetting_attention(*x, window_size=tk, implementation=impl), q, k, v, lf, w)
        bb = vg(lambda *x: forgetting_attention(*x, implementation=impl), q, k, v, lf, w)
        same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, bb))
        fails += not same
        print("W=Tk bitwise", impl, same, flush=True)

# speed: fwd+bwd, bf16, D=128, B=1, H=16, T=8192
b, t, h, d = 1, 8192, 16, 128
q, k, v, lf, w = inputs(b, t, t, h, h, d, jnp.bfloat16)
for W in (None, 4096, 1024, 256):
    f = jax.jit(jax.grad(lambda q, k, v, lf: jnp.sum(forgetting_attention(q, k, v, lf, window_size=W,
                                                                           implementation="pallas").astype(jnp.float32)),
                         argnums=(0, 1, 2, 3)))
    jax.block_until_ready(f(q, k, v, lf))
    ts = []
    for _ in range(10):
        t0 = time.perf_counter(); jax.block_until_ready(f(q, k, v, lf)); ts.append(time.perf_counter() - t0)
    print(f"pallas fwd+bwd T={t} W={W}: {1e3 * np.median(ts):.2f} ms", flush=True)
print("FAILS", fails)
