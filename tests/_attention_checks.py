"""Helpers shared by the attention-kernel tests (tests/test_pallas.py, tests/test_mosaic.py): random inputs, the
value and gradients of a weighted-sum loss, and the max-error check relative to the reference's magnitude.

Tolerances (``TOL[dtype]`` = (output, gradients), relative to the reference's max magnitude): float32 only
the summation order differs from the float32 oracle; bf16 / fp16 kernels round P and dS to the input dtype
before the tensor-core matmuls (as FlashAttention and the official FoX kernel do), ~2^-8 / 2^-11 per term.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fox_jax.ops import forgetting_attention, forgetting_attention_reference

TOL = {  # (output, gradients), relative to the reference's max magnitude
    jnp.float32: (2e-5, 2e-5),
    jnp.bfloat16: (2e-2, 3e-2),
    jnp.float16: (1e-2, 1.5e-2),
}


def inputs(b, tq, tk, h, hkv, d, dtype, seed=0, gate_lo=0.0, gate_hi=5.0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (b, tq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, tk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, tk, hkv, d), jnp.float32).astype(dtype)
    logits = jax.random.uniform(ks[3], (b, tk, h), minval=gate_lo, maxval=gate_hi)
    lf = jax.nn.log_sigmoid(logits)  # float32
    w = jax.random.normal(ks[4], (b, tq, h, d), jnp.float32)  # cotangent weights of the loss
    return q, k, v, lf, w


def value_and_grads(fn, q, k, v, lf, w):
    def loss(q, k, v, lf):
        o = fn(q, k, v, lf)
        return jnp.sum(o.astype(jnp.float32) * w), o

    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, lf)
    return o, grads


def assert_close(name, got, want, tol):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    scale = max(float(np.max(np.abs(want))), 1e-3)
    err = float(np.max(np.abs(got - want)))
    assert err <= tol * scale + 1e-5, f"{name}: max err {err:.3e} > {tol:.1e} × {scale:.3e}"


def check_against_reference(implementation, q, k, v, lf, w, dtype, **kw):
    """``forgetting_attention(implementation=...)``'s output and q/k/v/log_fgate gradients vs the float32 oracle
    on the same (rounded) inputs, within ``TOL[dtype]``; returns the implementation's (o, grads)."""
    o, grads = value_and_grads(lambda *a: forgetting_attention(*a, implementation=implementation, **kw),
                               q, k, v, lf, w)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    o_ref, grads_ref = value_and_grads(
        lambda q_, k_, v_, lf_: forgetting_attention_reference(q_, k_, v_, lf_, **kw), f32(q), f32(k), f32(v), lf, w)
    tol_o, tol_g = TOL[dtype]
    assert_close("o", o, o_ref, tol_o)
    for name, g, gr in zip(("dq", "dk", "dv", "dlog_fgate"), grads, grads_ref):
        assert_close(name, g, gr, tol_g)
    return o, grads
