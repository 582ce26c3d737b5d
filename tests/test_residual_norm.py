"""``fox_jax.ops.residual_norm``: the residual add of partial sums and the LayerNorm after it, XLA and the kernel.

The kernel runs in interpret mode on a CPU; on a GPU the same tests run its Triton lowering (they carry no ``gpu``
mark: ``python -m pytest tests/test_residual_norm.py`` there)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.ops.residual_norm import residual_layer_norm

EPS = 1e-5


def _case(seed: int, lead: tuple, d: int, parts: tuple, biased: tuple, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(*lead, d)) * 4.0 + 1.5, jnp.float32)  # a mean far from 0: the two-pass variance
    terms = tuple((jnp.asarray(rng.normal(size=(s, *lead, d)), jnp.float32),
                   jnp.asarray(rng.normal(size=d), dtype) if b else None) for s, b in zip(parts, biased))
    scale = jnp.asarray(rng.normal(size=d), jnp.float32)
    bias = jnp.asarray(rng.normal(size=d), jnp.float32)
    return x, terms, scale, bias


def _reference(x, terms, scale, bias, dtype):
    """float64 with the compute dtype's roundings where the model rounds (each term's sum, its bias add)."""
    x = np.asarray(x, np.float64)
    for parts, b in terms:
        y = np.asarray(jnp.asarray(np.asarray(parts, np.float64).sum(0), jnp.float32).astype(dtype), np.float64)
        if b is not None:
            y = np.asarray(jnp.asarray(y + np.asarray(b, np.float64), jnp.float32).astype(dtype), np.float64)
        x = x + y
    xc = x - x.mean(-1, keepdims=True)
    h = xc / np.sqrt((xc * xc).mean(-1, keepdims=True) + EPS) * np.asarray(scale, np.float64) + np.asarray(bias,
                                                                                                        np.float64)
    return x, h


@pytest.mark.parametrize("lead,d,parts,biased,dtype", [
    ((5,), 96, (3, 2), (True, False), jnp.float32),        # d = 64 + 32 (two column chunks), a term without bias
    ((2, 1, 3), 64, (8,), (True,), jnp.bfloat16),          # leading dims; bf16 roundings
    ((4,), 48, (), (), jnp.bfloat16),                       # no term: the norm alone
])
def test_kernel_and_xla_equal_the_reference(lead, d, parts, biased, dtype):
    """The XLA form and the kernel give x' and h of a float64 reference that rounds where the model rounds, and each
    other's. Tolerances: x' to float32 summation order (1e-5 relative to |x| ≲ 20); h in float32 1e-5, in bfloat16 one
    unit in the last place (2⁻⁸ relative, the output's own rounding; the kernel and XLA agree exactly or to that)."""
    x, terms, scale, bias = _case(0, lead, d, parts, biased, dtype)
    want_x, want_h = _reference(x, terms, scale, bias, dtype)
    outs = {impl: residual_layer_norm(x, terms, scale, bias, eps=EPS, dtype=dtype, implementation=impl)
            for impl in ("xla", "pallas")}
    h_tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    for impl, (got_x, got_h) in outs.items():
        assert got_x.dtype == jnp.float32 and got_h.dtype == dtype and got_h.shape == (*lead, d), impl
        np.testing.assert_allclose(np.asarray(got_x), want_x, rtol=1e-5, atol=1e-4, err_msg=impl)
        np.testing.assert_allclose(np.asarray(got_h, np.float64), want_h, **h_tol, err_msg=impl)
    np.testing.assert_allclose(np.asarray(outs["pallas"][0]), np.asarray(outs["xla"][0]), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(outs["pallas"][1], np.float32), np.asarray(outs["xla"][1], np.float32),
                               **h_tol)


def test_bad_input_is_refused_with_one_line():
    x, terms, scale, bias = _case(1, (3,), 40, (2,), (True,), jnp.float32)
    with pytest.raises(ValueError, match="implementation must be one of"):
        residual_layer_norm(x, terms, scale, bias, eps=EPS, dtype=jnp.float32, implementation="triton")
    with pytest.raises(ValueError, match=r"each term must be \(partial sums \[S, 3, 40\]"):
        residual_layer_norm(x, ((terms[0][0][:, :2], None),), scale, bias, eps=EPS, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"scale and bias must be \[40\]"):
        residual_layer_norm(x, terms, scale[:8], bias, eps=EPS, dtype=jnp.float32)
    with pytest.raises(ValueError, match="needs d a multiple of 16, got 40"):
        residual_layer_norm(x, terms, scale, bias, eps=EPS, dtype=jnp.float32, implementation="pallas")
    # "auto" off a GPU is the XLA form
    a = residual_layer_norm(x, terms, scale, bias, eps=EPS, dtype=jnp.float32)
    b = residual_layer_norm(x, terms, scale, bias, eps=EPS, dtype=jnp.float32, implementation="xla")
    assert jax.default_backend() != "cpu" or all(np.array_equal(u, v) for u, v in zip(a, b))
