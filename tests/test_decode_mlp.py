"""Tests of ``fox_jax.ops.decode_mlp`` (a decode step's RMSNorm + SwiGLU block as one op) and its Pallas kernel.

The kernel (interpret mode on CPU, the Triton lowering on GPU with ``-m gpu``) is compared with a float64 NumPy
oracle of the same block, and the op's XLA path with the model's own modules (``RMSNorm`` then ``SwiGLU``), on
shapes the kernel must handle: 3 rows (padded to a 16-row tile by masked loads), hidden = 96 (three 32-unit
programs, not a power of two), d = 64 in two gate/up chunks and two output chunks, both gate/up layouts.

Tolerances (max abs error relative to the oracle's max |y|):
* float32: IEEE dots (the kernel asks Triton for ``precision=HIGHEST``) in another summation order → 1e-5
  (measured ~1e-7); an RMSNorm scale left out moves y by ~30% (s = 1 + 0.3·N(0, 1)), r by the rows' RMS (3×).
* bfloat16: the kernel rounds the normed rows, gate, up, silu(gate) and the product to bf16 where the model does,
  the oracle only the inputs → 3·2⁻⁸ (a few bf16 roundings of the 2·96 + 96 terms' factors), against the op's XLA
  path (the model's arithmetic, the same roundings) → 2⁻⁷ (an ulp of the rounded factors in either order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.kernels import decode_mlp as km
from fox_jax.nn.layers import RMSNorm, SwiGLU
from fox_jax.ops.decode_mlp import decode_swiglu, swiglu_table

_M, _D, _HIDDEN, _EPS = 3, 64, 96, 1e-6
_CONFIG = km.MlpConfig(block_h=32, block_k=32, block_n=32)  # 3 programs, 2 gate/up chunks, 2 output chunks


def _case(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((1, _M, _D)) * 3.0, dtype)  # a residual stream: not of unit RMS
    s = jnp.asarray(1.0 + 0.3 * rng.standard_normal(_D), jnp.float32)
    w_gu = jnp.asarray(rng.standard_normal((_D, 2 * _HIDDEN)) / np.sqrt(_D), dtype)
    w_down = jnp.asarray(rng.standard_normal((_HIDDEN, _D)) / np.sqrt(_HIDDEN), dtype)
    return x, s, w_gu, w_down


def _oracle(x, s, w_gu, w_down) -> np.ndarray:
    """float64 RMSNorm → gate/up → silu(gate)·up → down on the (rounded) inputs."""
    x, s, w_gu, w_down = (np.asarray(a, np.float64) for a in (x, s, w_gu, w_down))
    xn = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + _EPS) * s
    gu = xn @ w_gu
    gate, up = gu[..., :_HIDDEN], gu[..., _HIDDEN:]
    return (gate / (1.0 + np.exp(-gate)) * up) @ w_down


def _err(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_matches_the_oracle(dtype, transposed):
    x, s, w_gu, w_down = _case(dtype)
    w = swiglu_table(w_gu) if transposed else w_gu
    got = decode_swiglu(x, s, w, w_down, eps=_EPS, implementation="pallas", config=_CONFIG)
    assert got.shape == x.shape and got.dtype == dtype
    want = _oracle(x, s, w_gu, w_down)
    assert _err(got, want) <= (1e-5 if dtype == jnp.float32 else 3 * 2 ** -8), _err(got, want)
    if dtype == jnp.bfloat16:  # the model's arithmetic, the same roundings
        xla = decode_swiglu(x, s, w, w_down, eps=_EPS, implementation="xla")
        assert _err(got, np.asarray(xla, np.float64)) <= 2 ** -7
    # the kernel's partials: one per 32-unit slice, each the slice's share of the output
    partials = km.swiglu_partials(x[0], s, w, w_down, eps=_EPS, config=_CONFIG, interpret=True)
    assert partials.shape == (_HIDDEN // 32, _M, _D) and partials.dtype == jnp.float32
    if dtype == jnp.float32:
        x64 = np.asarray(x[0], np.float64)
        xn = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + _EPS) * np.asarray(s, np.float64)
        gu = xn @ np.asarray(w_gu, np.float64)
        act = gu[:, :_HIDDEN] / (1 + np.exp(-gu[:, :_HIDDEN])) * gu[:, _HIDDEN:]
        second = act[:, 32:64] @ np.asarray(w_down, np.float64)[32:64]
        np.testing.assert_allclose(partials[1], second, atol=1e-5 * np.max(np.abs(second)), rtol=0)


def test_xla_path_is_the_models_block():
    """The op's XLA path is ``RMSNorm`` then ``SwiGLU`` (their parameters as the model stores them), bit for bit in
    both layouts when each runs alone (inside a larger jitted program XLA may keep excess bf16 precision elsewhere)."""
    x, s, w_gu, w_down = _case(jnp.bfloat16, seed=1)
    params = {"norm": {"scale": s}, "mlp": {"gate_proj": {"kernel": w_gu.astype(jnp.float32)},
                                            "down_proj": {"kernel": w_down.astype(jnp.float32)}}}
    h = RMSNorm(_EPS, jnp.bfloat16).apply({"params": params["norm"]}, x)
    want = SwiGLU(_HIDDEN, dtype=jnp.bfloat16).apply({"params": params["mlp"]}, h, False)
    for w in (w_gu, swiglu_table(w_gu)):
        got = decode_swiglu(x, s, w, w_down, eps=_EPS, implementation="xla")
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_bad_input_is_refused_in_one_line():
    x, s, w_gu, w_down = _case(jnp.float32)
    with pytest.raises(ValueError, match=r"w_gate_up \[d, 2·hidden\] or \[2, hidden, d\]"):
        decode_swiglu(x, s, w_gu[:, :-1], w_down, eps=_EPS)
    with pytest.raises(ValueError, match="must share a dtype"):
        decode_swiglu(x, s, w_gu.astype(jnp.bfloat16), w_down, eps=_EPS)
    with pytest.raises(ValueError, match="implementation must be one of"):
        decode_swiglu(x, s, w_gu, w_down, eps=_EPS, implementation="triton")
    with pytest.raises(ValueError, match=r"needs hidden = 96 a multiple of block_h = 64"):
        decode_swiglu(x, s, w_gu, w_down, eps=_EPS, implementation="pallas",
                      config=km.MlpConfig(block_h=64, block_k=32, block_n=32))
    with pytest.raises(ValueError, match=r"needs 1 ≤ M ≤ 64 rows \(got 65\)"):
        decode_swiglu(jnp.zeros((5, 13, _D)), s, w_gu, w_down, eps=_EPS, implementation="pallas")
    with pytest.raises(ValueError, match=r"decode_swiglu: x must be \[B, T, d\], got shape \[3, 64\]"):
        decode_swiglu(x[0], s, w_gu, w_down, eps=_EPS)
    with pytest.raises(ValueError, match="decode_swiglu: x must be a float array, got int32"):
        decode_swiglu(x.astype(jnp.int32), s, w_gu, w_down, eps=_EPS)
    with pytest.raises(ValueError, match="decode_swiglu: eps must be ≥ 0, got -1"):
        decode_swiglu(x, s, w_gu, w_down, eps=-1)
    with pytest.raises(TypeError, match="config must be a fox_jax.kernels.decode_mlp.MlpConfig, got dict"):
        decode_swiglu(x, s, w_gu, w_down, eps=_EPS, config={})
    with pytest.raises(ValueError, match=r"needs d and hidden multiples of 16 \(got d = 40, hidden = 96\)"):
        decode_swiglu(x[..., :40], s[:40], w_gu[:40], w_down[:, :40], eps=_EPS, implementation="pallas")
    with pytest.raises(ValueError, match="needs eps a Python float"):  # a traced eps: the kernel's eps is a constant
        jax.jit(lambda e: decode_swiglu(x, s, w_gu, w_down, eps=e, implementation="pallas", config=_CONFIG))(1e-6)
    traced = jax.jit(lambda e: decode_swiglu(x, s, w_gu, w_down, eps=e, config=_CONFIG))(_EPS)  # "auto": XLA
    np.testing.assert_allclose(traced, decode_swiglu(x, s, w_gu, w_down, eps=_EPS, implementation="xla"), atol=1e-6)
    with pytest.raises(ValueError, match="MlpConfig.block_h must be a power of two"):
        km.MlpConfig(block_h=24)
    assert km.default_mlp_config(768, 1792) == km.MlpConfig(block_h=32, block_k=256, block_n=256)
    assert km.default_mlp_config(40, 96) is None  # d not a multiple of 16: the op's "auto" runs XLA


def test_gradient_through_the_kernel_is_the_xla_forms():
    """Under ``jax.grad`` the kernel's path differentiates as the XLA form does (a custom VJP: the same function), so a
    model that calls it on GPU still trains: the gradients of all four inputs equal the XLA path's (float32)."""
    x, s, w_gu, w_down = _case(jnp.float32, seed=3)
    probe = jnp.asarray(np.random.default_rng(4).standard_normal((1, _M, _D)), jnp.float32)
    loss = lambda impl: lambda *a: jnp.sum(probe * decode_swiglu(*a, eps=_EPS, implementation=impl,  # noqa: E731
                                                                  config=_CONFIG))
    got = jax.grad(loss("pallas"), argnums=(0, 1, 2, 3))(x, s, w_gu, w_down)
    want = jax.grad(loss("xla"), argnums=(0, 1, 2, 3))(x, s, w_gu, w_down)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(w))))


def test_kernel_lowers_to_triton_for_cuda():
    """The GPU path (interpret=False) lowers for CUDA on this CPU machine — Pallas → Triton IR — in both layouts and
    at FoX (Pro) 125M's shape (M = 8, d = 768, hidden = 1792), so a change that breaks the lowering
    fails here."""
    sds = jax.ShapeDtypeStruct
    base = km.default_mlp_config(768, 1792)
    for cfg, w_gu in ((base, sds((768, 3584), jnp.bfloat16)), (base, sds((2, 1792, 768), jnp.bfloat16))):
        f = jax.jit(lambda x, s, a, b: km.swiglu_partials(x, s, a, b, eps=1e-6, config=cfg, interpret=False))
        text = f.trace(sds((8, 768), jnp.bfloat16), sds((768,), jnp.float32), w_gu,
                       sds((1792, 768), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
        assert "fox_decode_swiglu" in text


@pytest.mark.gpu
def test_kernel_on_gpu_matches_xla():
    """The Triton-lowered kernel at FoX (Pro) 125M's decode shape against the op's XLA path (bf16, 2⁻⁷ relative:
    the same roundings, another summation order)."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((8, 1, 768)) * 3.0, jnp.bfloat16)
    s = jnp.asarray(1.0 + 0.3 * rng.standard_normal(768), jnp.float32)
    w_gu = jnp.asarray(rng.standard_normal((768, 3584)) / np.sqrt(768), jnp.bfloat16)
    w_down = jnp.asarray(rng.standard_normal((1792, 768)) / np.sqrt(1792), jnp.bfloat16)
    want = np.asarray(decode_swiglu(x, s, w_gu, w_down, eps=_EPS, implementation="xla"), np.float64)
    for w in (w_gu, swiglu_table(w_gu)):
        got = decode_swiglu(x, s, w, w_down, eps=_EPS, implementation="pallas")
        assert _err(got, want) <= 2 ** -7, _err(got, want)
