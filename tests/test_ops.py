"""The forgetting-attention op (xla blockwise + dense) against the dense float32 reference.

Tolerances: float32 inputs are compared at atol 2e-5 (outputs) / 1e-4 (gradients): the blockwise
online softmax reorders float32 sums of O(T) terms, so errors are a few ulps of O(1) values. bf16
and fp16 inputs are compared with the reference evaluated on the *same rounded inputs*; the only
extra error is rounding P (≤ 2^-8 relative for bf16, 2^-11 for fp16) before the P·V and dS·K
matmuls, hence atol 3e-2 (bf16) and 5e-3 (fp16) on O(1) outputs and gradients.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.ops import acp, attention_mask, decay_cumsum, forgetting_attention, forgetting_attention_reference, tiles

TOL = {jnp.float32: (2e-5, 1e-4), jnp.bfloat16: (3e-2, 3e-2), jnp.float16: (5e-3, 5e-3)}


def make_inputs(b, tq, tk, h, hkv, d, dtype=jnp.float32, seed=0, gate_range=(0.0, 5.0)):
    """Random q, k, v (``dtype``) and float32 log forget gates log σ(U(gate_range)). Drawn with numpy:
    jax.random compiles its sampler once per new shape (~1 s of XLA per test here)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, tq, h, d), np.float32), dtype)
    k = jnp.asarray(rng.standard_normal((b, tk, hkv, d), np.float32), dtype)
    v = jnp.asarray(rng.standard_normal((b, tk, hkv, d), np.float32), dtype)
    logits = rng.uniform(*gate_range, size=(b, tk, h))
    return q, k, v, jnp.asarray(-np.logaddexp(0.0, -logits), jnp.float32)  # log σ, float32


def cotangent(shape, seed=1):
    """Fixed random weights of the loss Σ w·o (numpy, as ``make_inputs``)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def packed_segments(b, tk, seed=0):
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, tk), np.int32)
    for i in range(b):
        cuts = np.sort(rng.choice(np.arange(1, tk), size=3, replace=False))
        seg[i] = np.searchsorted(cuts, np.arange(tk), side="right") + 1
    return jnp.asarray(seg)


def out_and_grads(fn, q, k, v, lf, cot):
    """``fn``'s output and ``grads`` (into q, k, v, log_fgate) compiled as one program (eagerly, XLA compiles
    every op of the forward and of the backward separately)."""
    def loss(*a):
        o = fn(*a)
        return jnp.sum(o.astype(jnp.float32) * cot), o

    (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, lf)
    return o, g


SHAPES = [
    # b, tq, tk, h, hkv, d
    (2, 100, 100, 4, 4, 16),   # not a multiple of the block
    (1, 37, 130, 4, 2, 32),    # Tq < Tk, GQA
    (2, 64, 64, 2, 1, 8),      # exact blocks, MQA
    (1, 1, 77, 2, 2, 16),      # single decoding query
]


# Every shape and every mask variant, each variant on two shapes (plain: one here, and against the reference
# in test_composes_with_jit_vmap_grad); the full 4 × 4 product compiled 16 op + 16 reference programs for
# the same code paths.
XLA_CASES = [(SHAPES[0], "plain"), (SHAPES[0], "both"), (SHAPES[1], "segments"), (SHAPES[1], "both"),
             (SHAPES[2], "seq_start"), (SHAPES[3], "seq_start"), (SHAPES[3], "segments")]


@pytest.mark.slow
@pytest.mark.parametrize("shape, variant", XLA_CASES, ids=lambda c: c if isinstance(c, str) else "x".join(map(str, c)))
def test_xla_matches_reference_f32(shape, variant):
    b, tq, tk, h, hkv, d = shape
    q, k, v, lf = make_inputs(*shape, seed=XLA_CASES.index((shape, variant)))
    kw = {}
    if variant in ("segments", "both"):
        kw["segment_ids"] = packed_segments(b, tk)
    if variant in ("seq_start", "both"):
        kw["seq_start"] = jnp.asarray([min(7, tk - 1), 0][:b] if b > 1 else [5], jnp.int32)
    cot = cotangent(q.shape, 1)
    out, g = out_and_grads(lambda *a: forgetting_attention(*a, implementation="xla", block_q=32, block_k=16, **kw),
                           q, k, v, lf, cot)
    ref, gr = out_and_grads(lambda *a: forgetting_attention_reference(*a, **kw), q, k, v, lf, cot)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    for name, a, r in zip("qkvf", g, gr):
        np.testing.assert_allclose(a, r, atol=1e-4, rtol=0, err_msg=f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_xla_low_precision(dtype):
    shape = (2, 90, 150, 4, 2, 32)
    q, k, v, lf = make_inputs(*shape, dtype=dtype, seed=3)
    seg = packed_segments(2, 150, seed=4)
    cot = cotangent(q.shape, 2)
    out, g = out_and_grads(lambda *a: forgetting_attention(*a, segment_ids=seg, implementation="xla", block_q=32,
                                                           block_k=32), q, k, v, lf, cot)
    assert out.dtype == dtype
    ref, gr = out_and_grads(lambda *a: forgetting_attention_reference(*a, segment_ids=seg), q, k, v, lf, cot)
    atol_o, atol_g = TOL[dtype]
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=atol_o, rtol=0)
    for name, a, r in zip("qkvf", g, gr):
        a, r = np.asarray(a, np.float32), np.asarray(r)  # numpy: no XLA compilation per shape
        scale = float(np.max(np.abs(r)))
        err = float(np.max(np.abs(a - r)))
        assert err <= atol_g * max(scale, 1.0), f"d{name}: {err} vs scale {scale}"


def test_dense_implementation_and_no_forgetting():
    q, k, v, lf = make_inputs(1, 40, 40, 2, 2, 16)

    @jax.jit  # one program (eagerly, XLA compiles every op on its own)
    def run(q, k, v, lf):
        return (forgetting_attention(q, k, v, lf, implementation="dense"), forgetting_attention_reference(q, k, v, lf),
                forgetting_attention(q, k, v, None, implementation="xla", block_q=16, block_k=16),
                jax.nn.dot_product_attention(q, k, v, is_causal=True))

    dense, ref, out, ref_softmax = run(q, k, v, lf)
    np.testing.assert_allclose(dense, ref, atol=1e-6)
    # log_fgate=None is plain causal softmax attention
    np.testing.assert_allclose(out, ref_softmax, atol=2e-5)


def test_empty_rows_are_zero_and_finite():
    """Queries before seq_start see no key: output 0, gradients finite (no NaN from -inf - -inf)."""
    q, k, v, lf = make_inputs(2, 48, 48, 2, 2, 16)
    seq_start = jnp.asarray([20, 47], jnp.int32)
    out, g = out_and_grads(lambda *a: forgetting_attention(*a, seq_start=seq_start, implementation="xla", block_q=16,
                                                           block_k=16), q, k, v, lf, jnp.ones(q.shape))
    out, g = np.asarray(out), [np.asarray(x) for x in g]
    assert np.all(out[0, :20] == 0) and np.all(out[1, :47] == 0)
    for x in g:
        assert np.all(np.isfinite(x))
    # gates before seq_start do not matter: their gradient is exactly zero
    assert np.all(g[3][0, :20] == 0)


def test_decay_gradient_is_reverse_cumsum():
    rng = np.random.default_rng(0)
    lf = jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((1, 10, 1))), jnp.float32)
    w = rng.standard_normal((1, 10, 1)).astype(np.float32)
    g = jax.jit(jax.grad(lambda x: jnp.sum(decay_cumsum(x) * w)))(lf)
    np.testing.assert_allclose(g, np.flip(np.cumsum(np.flip(w, 1), 1), 1), atol=1e-6)


@pytest.mark.slow
def test_composes_with_jit_vmap_grad():
    q, k, v, lf = make_inputs(3, 33, 33, 2, 2, 8)
    f = lambda q, k, v, lf: forgetting_attention(q[None], k[None], v[None], lf[None], implementation="xla",
                                                 block_q=16, block_k=16)[0]
    out = jax.jit(jax.vmap(f))(q, k, v, lf)
    g = jax.jit(jax.vmap(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=3)))(q, k, v, lf)
    (_, ref), gr = jax.jit(jax.value_and_grad(  # the reference's output and dlog_fgate, one program
        lambda x: (lambda o: (jnp.sum(o), o))(forgetting_attention_reference(q, k, v, x)), has_aux=True))(lf)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_allclose(g, gr, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(log_fgate_dtype=jnp.bfloat16), "log_fgate must be float32"),
        (dict(tq=50, tk=40), "must not exceed key length"),
        (dict(h=3, hkv=2), "multiple of k/v heads"),
        (dict(implementation="cuda"), "implementation must be one of"),
        (dict(adaptive_threshold="sometimes"), "adaptive_threshold"),
        (dict(seq_start=jnp.zeros((3,), jnp.int32)), "seq_start"),
        (dict(window_size=0), "window_size"),
        (dict(window_size=-3), "window_size"),
        (dict(window_size=2.5), "window_size"),
        (dict(window_size=True), "window_size"),
        (dict(window_size=jnp.asarray(4)), "window_size"),
        (dict(window_size=0, implementation="pallas"), "window_size"),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    tq, tk = kwargs.pop("tq", 8), kwargs.pop("tk", 8)
    h, hkv = kwargs.pop("h", 2), kwargs.pop("hkv", 2)
    q, k, v, lf = make_inputs(1, tq, tk, h, hkv, 8)
    lf = lf.astype(kwargs.pop("log_fgate_dtype", jnp.float32))
    with pytest.raises(ValueError, match=match):
        forgetting_attention(q, k, v, lf, **kwargs)


def test_bad_rank_raises():
    q, k, v, lf = make_inputs(1, 8, 8, 2, 2, 8)
    with pytest.raises(ValueError, match="q must be"):
        forgetting_attention(q[0], k, v, lf)


# ACP ------------------------------------------------------------------------------------------------

def tile_masked_reference(q, k, v, lf, delta, bq, bk, window_size=None, lam=None):
    """Dense float32 attention with exactly the tiles ACP keeps (independent of the block loops); ``lam``:
    decay_cumsum(lf) when already computed."""
    b, tq, h, d = q.shape
    tk = k.shape[1]
    lam = np.asarray(decay_cumsum(lf) if lam is None else lam)
    delta = np.asarray(delta)
    keep = np.ones((b, h, tq, tk), bool)
    off = tk - tq
    for m in range(-(-tq // bq)):
        r = off + m * bq
        for n in range(-(-tk // bk)):
            c = min(n * bk + bk - 1, tk - 1)
            pruned = (lam[:, r, :] - lam[:, c, :]) < delta  # [b, h]
            keep[:, :, m * bq:(m + 1) * bq, n * bk:(n + 1) * bk] &= ~pruned[:, :, None, None]
    group = h // k.shape[2]
    kf, vf = np.repeat(np.asarray(k, np.float64), group, 2), np.repeat(np.asarray(v, np.float64), group, 2)
    s = np.einsum("bihd,bjhd->bhij", np.asarray(q, np.float64), kf) / math.sqrt(d)
    lam_bh = lam.transpose(0, 2, 1).astype(np.float64)
    s = s + lam_bh[:, :, off:, None] - lam_bh[:, :, None, :]
    off_ = np.arange(tq)[:, None] + off - np.arange(tk)[None, :]  # r_i − j
    mask = ((off_ >= 0) & (off_ < (window_size or tk + 1)))[None, None] & keep
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", p, vf)


def test_acp_skips_exactly_the_pruned_tiles():
    q, k, v, lf = make_inputs(2, 70, 100, 4, 2, 16, seed=5, gate_range=(-3.0, 1.0))
    delta = jnp.asarray([[-4.0, -8.0, -12.0, -1e9], [-2.0, -6.0, -20.0, -30.0]])
    out, lam, starts = jax.jit(lambda q, k, v, lf, delta: (  # one program (eagerly: one per op)
        forgetting_attention(q, k, v, lf, adaptive_threshold=delta, implementation="xla", block_q=16, block_k=16),
        decay_cumsum(lf), acp.kv_block_start(decay_cumsum(lf), delta, tq=70, block_q=16, block_k=16)))(
        q, k, v, lf, delta)
    ref = tile_masked_reference(q, k, v, lf, delta, 16, 16, lam=lam)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    assert int(jnp.sum(starts)) > 0  # some tiles really were skipped


@pytest.mark.slow
def test_acp_minus_inf_is_bitwise_dense():
    q, k, v, lf = make_inputs(1, 50, 50, 2, 2, 16)
    kw = dict(implementation="xla", block_q=16, block_k=16)
    cot = jnp.ones(q.shape)
    dense, g_dense = out_and_grads(lambda *a: forgetting_attention(*a, **kw), q, k, v, lf, cot)
    pruned, g_pruned = out_and_grads(lambda *a: forgetting_attention(*a, adaptive_threshold=-jnp.inf, **kw),
                                     q, k, v, lf, cot)
    assert np.array_equal(np.asarray(dense), np.asarray(pruned))
    for a, b_ in zip(g_dense, g_pruned):
        assert np.array_equal(np.asarray(a), np.asarray(b_))


@pytest.mark.slow
def test_acp_auto_guarantee():
    """With the auto threshold the pruned weight per query is ≤ ε, so |o_acp − o| ≤ 2ε·max|v|
    (dropping mass m and renormalising moves o by at most 2m·max|v|); gradients agree within
    a tolerance of the same order (2e-3 on O(1) gradients, dominated by float32 noise)."""
    b, t, h, d = 1, 256, 2, 16
    q, k, v, _ = make_inputs(b, t, t, h, h, d, seed=7)
    lf = jnp.full((b, t, h), -3.0, jnp.float32)  # fast-forgetting heads: most tiles prunable
    kw = dict(implementation="xla", block_q=16, block_k=16)
    log_eps = -10.0
    cot = cotangent(q.shape, 3)
    dense, g_dense = out_and_grads(lambda *a: forgetting_attention(*a, **kw), q, k, v, lf, cot)
    out, g_auto = out_and_grads(lambda *a: forgetting_attention(*a, adaptive_threshold="auto", log_epsilon=log_eps,
                                                                **kw), q, k, v, lf, cot)
    stats = jax.jit(lambda q, k, lf: acp.pruning_stats(acp.kv_block_start(  # one program (eagerly: one per op)
        decay_cumsum(lf), acp.resolve_threshold("auto", q, k, d ** -0.5, log_eps), tq=t, block_q=16, block_k=16),
        tq=t, tk=t, block_q=16, block_k=16))(q, k, lf)
    assert float(stats["fraction_skipped"]) > 0.5, stats
    bound = 2 * math.exp(log_eps) * float(np.max(np.abs(np.asarray(v))))
    assert float(np.max(np.abs(np.asarray(out) - np.asarray(dense)))) <= bound + 1e-6
    for a, r in zip(g_auto, g_dense):
        np.testing.assert_allclose(a, r, atol=2e-3)


def test_qk_norm_threshold_matches_formula():
    wq = jnp.ones((3, 64)).at[1, 5].set(2.0)
    wk = jnp.ones((3, 64))
    delta = acp.qk_norm_threshold(wq, wk, key_len=16384)
    expected = -(2 * 8.0 + math.log(16384)) - 10.0  # spec §5.1 example: U = √64 = 8 → δ = −35.7
    np.testing.assert_allclose(delta[0], expected, rtol=1e-6)
    np.testing.assert_allclose(delta[1], -(2 * 16.0 + math.log(16384)) - 10.0, rtol=1e-6)


def test_no_gate_path_keeps_lambda_out_of_constant_folding():
    """Without gates (Transformer) the Pallas path must not hand XLA a literal all-zero Λ: on the GPU it
    constant-folded cumsum(0) and the block bounds for minutes. The zeros sit behind an optimization
    barrier, visible in the lowered program."""
    q = jnp.zeros((1, 64, 2, 16), jnp.float32)
    text = jax.jit(lambda q: forgetting_attention(q, q, q, None, implementation="pallas")).lower(q).as_text()
    assert "optimization_barrier" in text


# Sliding window ---------------------------------------------------------------------------------------

WINDOWS = [1, 3, 37, 1000]  # 1: the diagonal only; 1000 ≥ Tk: plain causal


def window_kwargs(variant, b, tk):
    """(gated, op kwargs): "masked" = forget gates, seq_start and packed documents (every mask of the op
    at once); "no_gates" = log_fgate=None alone (sliding-window softmax attention)."""
    if variant == "no_gates":
        return False, {}
    return True, dict(seq_start=jnp.asarray([min(7, tk - 1), 0][:b], jnp.int32), segment_ids=packed_segments(b, tk))


def check_window_against_reference(q, k, v, lf, window_size, impl, atol_o, atol_g, gated=True, **kw):
    """Output and gradients (q, k, v and, when ``gated``, log_fgate; else the op gets log_fgate=None and
    the reference zeros) of the op vs the float32 reference on the same (rounded) inputs: max abs
    error ≤ atol · max(1, max |reference|)."""
    blocks = dict(block_q=32, block_k=16) if impl == "xla" else {}
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    def op(q, k, v, lf):
        return forgetting_attention(q, k, v, lf if gated else None, window_size=window_size, implementation=impl,
                                    **blocks, **kw)

    lf = lf if gated else jnp.zeros(lf.shape, jnp.float32)
    cot = cotangent(q.shape, 1)
    out, g = out_and_grads(op, q, k, v, lf, cot)
    assert out.dtype == q.dtype
    ref, gr = out_and_grads(lambda *a: forgetting_attention_reference(*a, window_size=window_size, **kw),
                            f32(q), f32(k), f32(v), lf, cot)
    n = 5 if gated else 4
    for name, a, r, atol in list(zip("oqkvf", (out,) + g, (ref,) + gr, (atol_o,) + (atol_g,) * 4))[:n]:
        a, r = np.asarray(a, np.float32), np.asarray(r)  # numpy: no XLA compilation per shape
        err = float(np.max(np.abs(a - r)))
        assert err <= atol * max(1.0, float(np.max(np.abs(r)))), f"{'' if name == 'o' else 'd'}{name}: {err}"


def test_window_mask_is_the_last_window_size_keys():
    m = np.asarray(attention_mask(4, 6, window_size=2))[0]
    want = np.zeros((4, 6), bool)
    for i in range(4):  # query i sits at key position 2 + i and sees itself and the key before it
        want[i, 1 + i: 3 + i] = True
    np.testing.assert_array_equal(m, want)
    np.testing.assert_array_equal(np.asarray(attention_mask(4, 6, window_size=6)), np.asarray(attention_mask(4, 6)))
    q, k, v, lf = make_inputs(1, 20, 30, 2, 1, 8)
    dense, ref = jax.jit(lambda *a: (forgetting_attention(*a, window_size=5, implementation="dense"),
                                     forgetting_attention_reference(*a, window_size=5)))(q, k, v, lf)
    np.testing.assert_allclose(dense, ref, atol=1e-6)


@pytest.mark.parametrize("window_size", [3, 37])
def test_window_xla_matches_reference_quick(window_size):
    q, k, v, lf = make_inputs(2, 45, 70, 4, 2, 16, seed=window_size)
    _, kw = window_kwargs("masked", 2, 70)
    check_window_against_reference(q, k, v, lf, window_size, "xla", 2e-5, 1e-4, **kw)


# Every window with both variants, every shape (the full 4 shapes × 4 windows × 2 variants compiled 32 op + 32
# reference programs for the same code paths); masked at W = 3 and 37: test_window_xla_matches_reference_quick
# (Tq < Tk, GQA, not a multiple of the blocks).
WINDOW_CASES = [(SHAPES[0], 1, "masked"), (SHAPES[0], 37, "no_gates"), (SHAPES[1], 1000, "no_gates"),
                (SHAPES[2], 1, "no_gates"), (SHAPES[3], 1000, "masked"), (SHAPES[3], 3, "no_gates")]
assert {(w, v) for _, w, v in WINDOW_CASES} | {(3, "masked"), (37, "masked")} == {
    (w, v) for w in WINDOWS for v in ("masked", "no_gates")}


@pytest.mark.slow
@pytest.mark.parametrize("shape, window_size, variant", WINDOW_CASES,
                         ids=lambda c: c if isinstance(c, (str, int)) else "x".join(map(str, c)))
def test_window_xla_matches_reference_f32(shape, window_size, variant):
    b, tq, tk, h, hkv, d = shape
    q, k, v, lf = make_inputs(*shape, seed=WINDOW_CASES.index((shape, window_size, variant)))
    gated, kw = window_kwargs(variant, b, tk)
    check_window_against_reference(q, k, v, lf, window_size, "xla", 2e-5, 1e-4, gated=gated, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("window_size", [37])  # W = 3 in bf16: test_window_pallas_matches_reference
def test_window_xla_bf16(window_size):
    shape = (2, 90, 150, 4, 2, 32)
    q, k, v, lf = make_inputs(*shape, dtype=jnp.bfloat16, seed=5)
    _, kw = window_kwargs("masked", 2, 150)
    check_window_against_reference(q, k, v, lf, window_size, "xla", *TOL[jnp.bfloat16], **kw)


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    # shape, window, variant, dtype. The kernels' CPU tiles are 32×16 / 16×32 / 32×16 (tests/test_pallas.py):
    # W = 61 leaves tiles inside the window of every row (the unmasked loops) next to the masked edge.
    ((2, 45, 70, 4, 2, 16), 37, "masked", jnp.float32),
    ((1, 100, 100, 2, 2, 16), 61, "no_gates", jnp.float32),
    ((2, 100, 100, 2, 1, 16), 3, "masked", jnp.bfloat16),
], ids=["f32-tq<tk-gqa-seqstart-seg-w37", "f32-nogates-w61", "bf16-mqa-seqstart-seg-w3"])
def test_window_pallas_matches_reference(case):
    shape, window_size, variant, dtype = case
    q, k, v, lf = make_inputs(*shape, dtype=dtype, seed=window_size)
    gated, kw = window_kwargs(variant, shape[0], shape[2])
    check_window_against_reference(q, k, v, lf, window_size, "pallas", *TOL[dtype], gated=gated, **kw)


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_window_at_least_tk_is_no_window(impl):
    """W ≥ Tk hides nothing: same tiles, a mask that is all true, bit-identical outputs and gradients."""
    q, k, v, lf = make_inputs(2, 40, 50, 2, 1, 16, seed=11)
    kw = dict(implementation=impl, block_q=16, block_k=16, seq_start=jnp.asarray([0, 9], jnp.int32))
    cot = cotangent(q.shape, 4)
    o, g = out_and_grads(lambda *a: forgetting_attention(*a, **kw), q, k, v, lf, cot)
    want = [o, *g]
    # W = Tk, the boundary, and W ≫ Tk (the kernel clamps the window to the keys it has), on both paths
    for w in (50, 10_000):
        o, g = out_and_grads(lambda *a: forgetting_attention(*a, window_size=w, **kw), q, k, v, lf, cot)
        got = [o, *g]
        for name, a, b_ in zip("oqkvf", got, want):
            assert np.array_equal(np.asarray(a), np.asarray(b_)), (w, name)


def test_window_with_acp_skips_both():
    """ACP and the window together: the result is dense attention over the window restricted to the
    tiles ACP keeps, and the key-block range of each query block starts at the later of the two."""
    q, k, v, lf = make_inputs(2, 70, 100, 4, 2, 16, seed=5, gate_range=(-3.0, 1.0))
    delta = jnp.asarray([[-4.0, -8.0, -12.0, -1e9], [-2.0, -6.0, -20.0, -30.0]])

    @jax.jit  # one program (eagerly: one per op)
    def run(q, k, v, lf, delta):
        out = forgetting_attention(q, k, v, lf, adaptive_threshold=delta, window_size=37, implementation="xla",
                                   block_q=16, block_k=16)
        lam = decay_cumsum(lf)
        lo_acp, _ = tiles.tile_visits(70, 100, 16, 16, lam=lam, delta=delta).row_ranges()
        lo_win, _ = tiles.tile_visits(70, 100, 16, 16, window_size=37).row_ranges()
        lo_both, _ = tiles.tile_visits(70, 100, 16, 16, lam=lam, delta=delta, window_size=37).row_ranges()
        return out, lam, lo_acp, lo_win, lo_both

    out, lam, lo_acp, lo_win, lo_both = run(q, k, v, lf, delta)
    np.testing.assert_allclose(out, tile_masked_reference(q, k, v, lf, delta, 16, 16, window_size=37, lam=lam),
                               atol=2e-5)
    np.testing.assert_array_equal(lo_both, np.maximum(lo_acp, lo_win))
    assert np.any(lo_acp > lo_win) and np.any(lo_win > lo_acp)


def test_window_not_for_cudnn():
    q, k, v, _ = make_inputs(1, 16, 16, 2, 2, 8, dtype=jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="window_size"):
        forgetting_attention(q, k, v, None, window_size=4, implementation="cudnn")
