"""Tests of ``fox_jax.ops.norm_matmul`` (a row norm, the projections that read it and their activation in one kernel).

The Pallas kernel (interpret mode on CPU, Triton-lowered with ``-m gpu``) is compared with a float64 numpy oracle
written here from the formulas (not with the op's XLA form alone), and with the XLA form the modules run; the
models' decode steps through the kernel are compared with their XLA path.

Tolerances:
* against the float64 oracle, which rounds the normed rows to the compute dtype at the same point as the modules
  (the matmul's inputs are then the same numbers): the kernel sums in float32 (~1e-6 relative) and rounds y to the
  compute dtype (bf16: 2⁻⁹ relative, half an ulp) before the bias and again after it and after the activation →
  3·2⁻⁸ of max |y| for bf16, 1e-5 for float32;
* kernel against the XLA form: the same rounding points except inside the activations (XLA's elementwise chain) →
  2⁻⁷ of max |y| in bf16 (measured ≤ 5e-4), 1e-5 in float32. The normed rows: the row statistics' summation order
  (a flipped rounding: one bf16 ulp, 2⁻⁸) → 2⁻⁸ in bf16, 1e-6 in float32.
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.kernels.norm_matmul import MatmulConfig, default_matmul_config
from fox_jax.ops.norm_matmul import RowNorm, kernel_supported, norm_matmul


def _oracle(x, weights, kind, scale, nbias, eps, act, dtype):
    """float64 numpy: (y, normed rows), the normed rows rounded to ``dtype`` as the modules round them."""
    xf = np.asarray(x, np.float64)
    if kind == "rms":
        xn = xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + eps) * np.asarray(scale, np.float64)
    elif kind == "layer":
        xc = xf - xf.mean(-1, keepdims=True)
        xn = xc / np.sqrt(np.mean(xc * xc, -1, keepdims=True) + eps) * np.asarray(scale, np.float64) + nbias
    else:
        xn = xf
    xn = np.asarray(jnp.asarray(xn, jnp.float32).astype(dtype), np.float64)
    w = np.concatenate([np.asarray(jnp.asarray(k).astype(dtype), np.float64) for k, _ in weights], 1)
    y = xn @ w
    if any(b is not None for _, b in weights):
        y = y + np.concatenate([np.zeros(k.shape[1]) if b is None else np.asarray(jnp.asarray(b).astype(dtype),
                                                                                  np.float64) for k, b in weights])
    if act == "gelu_tanh":
        y = 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))
    elif act == "swiglu":
        h = y.shape[-1] // 2
        y = y[..., :h] / (1 + np.exp(-y[..., :h])) * y[..., h:]
    return y, xn


def _case(m, d, widths, kind, bias, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, d)) * 3.0 + (1.5 if kind == "layer" else 0.0), dtype)
    weights = [(jnp.asarray(rng.normal(size=(d, n)) / math.sqrt(d), jnp.float32),
                jnp.asarray(rng.normal(size=n), jnp.float32) if bias and i != 1 else None)
               for i, n in enumerate(widths)]
    scale = jnp.asarray(1.0 + 0.3 * rng.normal(size=d), jnp.float32)
    nbias = jnp.asarray(0.2 * rng.normal(size=d), jnp.float32) if kind == "layer" else None
    rows = x if kind is None else RowNorm(x, scale, nbias, kind, 1e-5, jnp.dtype(dtype))
    return x, weights, scale, nbias, rows


def _err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# (rows, d, widths, norm, bias, activation): M not a power of two (5, 3) or 1; several weights with and without
# biases whose columns follow each other; K and widths not powers of two (96, 48)
_CASES = [
    pytest.param(5, 96, (64, 32, 48), "rms", False, None, id="rms-3-weights"),
    pytest.param(3, 64, (96,), "layer", True, "gelu_tanh", id="layer-gelu"),
    pytest.param(1, 96, (128,), "rms", False, "swiglu", id="rms-swiglu-1-row"),
    pytest.param(5, 64, (32, 48), "layer", True, None, id="layer-2-weights-bias"),
    pytest.param(4, 48, (64,), None, True, "gelu_tanh", id="no-norm"),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,d,widths,kind,bias,act", _CASES)
def test_kernel_matches_oracle_and_xla(m, d, widths, kind, bias, act, dtype):
    x, weights, scale, nbias, rows = _case(m, d, widths, kind, bias, dtype)
    config = MatmulConfig(block_n=16, block_k=16)  # several column blocks per weight, several K chunks
    y, xn = norm_matmul(rows, weights, dtype, activation=act, implementation="pallas", config=config)
    y_xla, xn_xla = norm_matmul(rows, weights, dtype, activation=act, implementation="xla")
    want, want_xn = _oracle(x, weights, kind, scale, nbias, 1e-5, act, dtype)
    n = want.shape[-1]
    assert y.shape == (m, n) and y.dtype == dtype and xn.shape == (m, d) and xn.dtype == dtype
    bf16 = dtype == jnp.bfloat16
    assert _err(y, want) <= (3 * 2 ** -8 if bf16 else 1e-5)
    assert _err(y, y_xla) <= (2 ** -7 if bf16 else 1e-5)
    assert _err(xn, xn_xla) <= (2 ** -8 if bf16 else 1e-6)  # the row statistics' summation order
    assert _err(xn, want_xn) <= (2 ** -8 if bf16 else 1e-6)


@pytest.mark.parametrize("act", [None, "swiglu"])
def test_folded_rms_matches_oracle(act):
    """``fold_rms``: the products take x·scale rounded to bf16 and the row factor 1/rms after the sum, where the
    modules round x̂ = x/rms·scale: the same relative rounding (2⁻⁹), at another point → the oracle's tolerance."""
    widths = (128,) if act else (64, 32, 48)
    x, weights, scale, nbias, rows = _case(5, 96, widths, "rms", False, jnp.bfloat16, seed=3)
    y, xn = norm_matmul(rows, weights, jnp.bfloat16, activation=act, implementation="pallas",
                        config=MatmulConfig(16, 32, fold_rms=True))
    want, want_xn = _oracle(x, weights, "rms", scale, nbias, 1e-5, act, jnp.bfloat16)
    assert _err(y, want) <= 3 * 2 ** -8
    assert _err(xn, want_xn) <= 2 ** -8


def test_the_tolerance_sees_a_wrong_norm():
    """The oracle tolerance above fails for an eps of 1e-2 instead of 1e-5 on rows of small norm, and for a LayerNorm
    whose bias is left out: it can catch a norm applied wrongly."""
    x, weights, scale, nbias, _ = _case(5, 64, (32,), "layer", False, jnp.float32)
    small = x * 0.05
    want, _ = _oracle(small, weights, "layer", scale, nbias, 1e-5, None, jnp.float32)
    wrong_eps = RowNorm(small, scale, nbias, "layer", 1e-2, jnp.dtype(jnp.float32))
    no_bias = RowNorm(small, scale, jnp.zeros_like(nbias), "layer", 1e-5, jnp.dtype(jnp.float32))
    for rows in (wrong_eps, no_bias):
        y, _ = norm_matmul(rows, weights, jnp.float32, implementation="pallas", config=MatmulConfig(16, 16))
        assert _err(y, want) > 1e-3


def test_default_tiling_and_dispatch():
    assert default_matmul_config(768, (768, 768, 768, 768)) == MatmulConfig(block_n=32, block_k=128)
    assert default_matmul_config(768, (3584,), "swiglu") == MatmulConfig(block_n=32, block_k=128)
    assert default_matmul_config(1600, (4800,)) == MatmulConfig(block_n=32, block_k=64)  # GPT-2 XL
    assert default_matmul_config(100, (64,)) is None and default_matmul_config(64, (40,)) is None
    x = jnp.zeros((8, 768), jnp.bfloat16)
    why = kernel_supported(x, [(jnp.zeros((768, 64)), None)], jnp.bfloat16, None)
    assert (why is None) == (jax.default_backend() == "gpu")
    if jax.default_backend() == "gpu":
        assert "rows" in kernel_supported(jnp.zeros((65, 768)), [(jnp.zeros((768, 64)), None)], jnp.bfloat16, None)
        assert "float16" in kernel_supported(x, [(jnp.zeros((768, 64)), None)], jnp.float32, None)


def test_errors_name_the_argument():
    x = jnp.zeros((2, 32))
    w = [(jnp.zeros((32, 32)), None)]
    with pytest.raises(ValueError, match="implementation"):
        norm_matmul(x, w, jnp.float32, implementation="triton")
    with pytest.raises(ValueError, match="activation"):
        norm_matmul(x, w, jnp.float32, activation="relu")
    with pytest.raises(ValueError, match=r"\[32, n\]"):
        norm_matmul(x, [(jnp.zeros((16, 32)), None)], jnp.float32)
    with pytest.raises(ValueError, match="swiglu"):
        norm_matmul(x, w + w, jnp.float32, activation="swiglu")
    with pytest.raises(ValueError, match="multiples of 16"):
        norm_matmul(jnp.zeros((2, 40)), [(jnp.zeros((40, 32)), None)], jnp.float32, implementation="pallas")


@pytest.mark.parametrize("family", ["fox-pro", "gpt2"])
def test_decode_steps_through_the_kernel_equal_the_xla_path(family, monkeypatch):
    """A bf16 model's prefill and decode steps with every block norm inside the projections' kernel (``auto`` made to
    take it: interpret mode here) give the logits of its XLA path: FoX (Pro) with GQA (q, k, v, o-gate as four
    weights whose columns the attention kernel reads as rows; the float32 gate projections from the kernel's normed
    rows) and its SwiGLU; GPT-2 with LayerNorm, biases and GELU. Tolerance: bf16 rounding of the activations at other
    points (≤ 2⁻⁸ relative per value) carried through one layer → 2⁻⁵ of max |logit| (a wrong column, bias or norm
    moves the logits by O(max |logit|))."""
    from test_decoding import PADS, padded_batch, plain_gpt2, tiny_lm

    from fox_jax.decoding import decode_step, prefill
    from fox_jax.kernels.norm_matmul import default_matmul_config

    model, params = plain_gpt2() if family == "gpt2" else tiny_lm("fox-pro")
    model = type(model)(model.cfg.replace(dtype="bfloat16"))
    tokens = padded_batch(10)
    ops = sys.modules["fox_jax.ops.norm_matmul"]
    calls = []

    def run():
        logits, caches = prefill(model, params, tokens[:, :7], seq_start=PADS, slots=10)
        out = [logits[:, -1]]
        for c in range(7, 10):
            step, caches = decode_step(model, params, caches, tokens[:, c])
            out.append(step)
        return np.stack([np.asarray(o, np.float32) for o in out])

    want = run()

    def supported(x, weights, dtype, activation):  # as on a GPU: the tiling decides
        fits = default_matmul_config(x.shape[-1], tuple(w.shape[1] for w, _ in weights), activation) is not None
        calls.append(fits)
        return None if fits else "no tiling"

    monkeypatch.setattr(ops, "kernel_supported", supported)
    jax.clear_caches()
    got = run()
    assert calls and all(calls)  # every projection after a norm ran the kernel
    assert _err(got, want) <= 2 ** -5


@pytest.mark.gpu
@pytest.mark.parametrize("m,d,widths,act,kind", [
    pytest.param(8, 768, (768, 768, 768, 768), None, "rms", id="fox-125M-qkvo"),
    pytest.param(8, 768, (3584,), "swiglu", "rms", id="fox-125M-mlp"),
    pytest.param(32, 768, (2304,), None, "layer", id="gpt2-c_attn"),
    pytest.param(32, 768, (3072,), "gelu_tanh", "layer", id="gpt2-c_fc"),
    pytest.param(3, 1536, (1536, 512, 512, 1536), None, "rms", id="fox-760M-gqa-3-rows"),
])
def test_gpu_kernel_matches_oracle(m, d, widths, act, kind):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    x, weights, scale, nbias, rows = _case(m, d, widths, kind, kind == "layer", jnp.bfloat16)
    y, xn = jax.jit(lambda r, w: norm_matmul(r, w, jnp.bfloat16, activation=act, implementation="pallas"))(
        rows, weights)
    want, want_xn = _oracle(x, weights, kind, scale, nbias, 1e-5, act, jnp.bfloat16)
    assert _err(y, want) <= 3 * 2 ** -8
    assert _err(xn, want_xn) <= 2 ** -8
