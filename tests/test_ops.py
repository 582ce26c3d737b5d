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
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, tq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, tk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, tk, hkv, d), jnp.float32).astype(dtype)
    logits = jax.random.uniform(ks[3], (b, tk, h), jnp.float32, *gate_range)
    return q, k, v, jax.nn.log_sigmoid(logits)


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


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("variant", ["plain", "segments", "seq_start", "both"])
def test_xla_matches_reference_f32(shape, variant):
    b, tq, tk, h, hkv, d = shape
    q, k, v, lf = make_inputs(*shape, seed=hash((shape, variant)) % 1000)
    kw = {}
    if variant in ("segments", "both"):
        kw["segment_ids"] = packed_segments(b, tk)
    if variant in ("seq_start", "both"):
        kw["seq_start"] = jnp.asarray([min(7, tk - 1), 0][:b] if b > 1 else [5], jnp.int32)
    cot = jax.random.normal(jax.random.PRNGKey(1), q.shape)
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
    cot = jax.random.normal(jax.random.PRNGKey(2), q.shape)
    out, g = out_and_grads(lambda *a: forgetting_attention(*a, segment_ids=seg, implementation="xla", block_q=32,
                                                           block_k=32), q, k, v, lf, cot)
    assert out.dtype == dtype
    ref, gr = out_and_grads(lambda *a: forgetting_attention_reference(*a, segment_ids=seg), q, k, v, lf, cot)
    atol_o, atol_g = TOL[dtype]
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=atol_o, rtol=0)
    for name, a, r in zip("qkvf", g, gr):
        scale = float(jnp.max(jnp.abs(r)))
        err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - r)))
        assert err <= atol_g * max(scale, 1.0), f"d{name}: {err} vs scale {scale}"


def test_dense_implementation_and_no_forgetting():
    q, k, v, lf = make_inputs(1, 40, 40, 2, 2, 16)
    np.testing.assert_allclose(forgetting_attention(q, k, v, lf, implementation="dense"),
                               forgetting_attention_reference(q, k, v, lf), atol=1e-6)
    # log_fgate=None is plain causal softmax attention
    out = forgetting_attention(q, k, v, None, implementation="xla", block_q=16, block_k=16)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(out, ref, atol=2e-5)


def test_empty_rows_are_zero_and_finite():
    """Queries before seq_start see no key: output 0, gradients finite (no NaN from -inf - -inf)."""
    q, k, v, lf = make_inputs(2, 48, 48, 2, 2, 16)
    seq_start = jnp.asarray([20, 47], jnp.int32)
    out, g = out_and_grads(lambda *a: forgetting_attention(*a, seq_start=seq_start, implementation="xla", block_q=16,
                                                           block_k=16), q, k, v, lf, jnp.ones(q.shape))
    assert np.all(np.asarray(out[0, :20]) == 0) and np.all(np.asarray(out[1, :47]) == 0)
    for x in g:
        assert np.all(np.isfinite(np.asarray(x)))
    # gates before seq_start do not matter: their gradient is exactly zero
    assert np.all(np.asarray(g[3][0, :20]) == 0)


def test_decay_gradient_is_reverse_cumsum():
    lf = jax.nn.log_sigmoid(jax.random.normal(jax.random.PRNGKey(0), (1, 10, 1)))
    w = jax.random.normal(jax.random.PRNGKey(1), (1, 10, 1))
    g = jax.grad(lambda x: jnp.sum(decay_cumsum(x) * w))(lf)
    np.testing.assert_allclose(g, jnp.flip(jnp.cumsum(jnp.flip(w, 1), 1), 1), atol=1e-6)


@pytest.mark.slow
def test_composes_with_jit_vmap_grad():
    q, k, v, lf = make_inputs(3, 33, 33, 2, 2, 8)
    f = lambda q, k, v, lf: forgetting_attention(q[None], k[None], v[None], lf[None], implementation="xla",
                                                 block_q=16, block_k=16)[0]
    out = jax.jit(jax.vmap(f))(q, k, v, lf)
    np.testing.assert_allclose(out, forgetting_attention_reference(q, k, v, lf), atol=2e-5)
    g = jax.jit(jax.vmap(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=3)))(q, k, v, lf)
    gr = jax.grad(lambda x: jnp.sum(forgetting_attention_reference(q, k, v, x)))(lf)
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

def tile_masked_reference(q, k, v, lf, delta, bq, bk, window_size=None):
    """Dense float32 attention with exactly the tiles ACP keeps (independent of the block loops)."""
    b, tq, h, d = q.shape
    tk = k.shape[1]
    lam = np.asarray(decay_cumsum(lf))
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
    mask = np.asarray(attention_mask(tq, tk, window_size=window_size, batch=b))[:, None] & keep
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", p, vf)


def test_acp_skips_exactly_the_pruned_tiles():
    q, k, v, lf = make_inputs(2, 70, 100, 4, 2, 16, seed=5, gate_range=(-3.0, 1.0))
    delta = jnp.asarray([[-4.0, -8.0, -12.0, -1e9], [-2.0, -6.0, -20.0, -30.0]])
    out = forgetting_attention(q, k, v, lf, adaptive_threshold=delta, implementation="xla", block_q=16, block_k=16)
    ref = tile_masked_reference(q, k, v, lf, delta, 16, 16)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    starts = acp.kv_block_start(decay_cumsum(lf), delta, tq=70, block_q=16, block_k=16)
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
    cot = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    dense, g_dense = out_and_grads(lambda *a: forgetting_attention(*a, **kw), q, k, v, lf, cot)
    out, g_auto = out_and_grads(lambda *a: forgetting_attention(*a, adaptive_threshold="auto", log_epsilon=log_eps,
                                                                **kw), q, k, v, lf, cot)
    delta = acp.resolve_threshold("auto", q, k, d ** -0.5, log_eps)
    stats = acp.pruning_stats(acp.kv_block_start(decay_cumsum(lf), delta, tq=t, block_q=16, block_k=16),
                              tq=t, tk=t, block_q=16, block_k=16)
    assert float(stats["fraction_skipped"]) > 0.5, stats
    bound = 2 * math.exp(log_eps) * float(jnp.max(jnp.abs(v)))
    assert float(jnp.max(jnp.abs(out - dense))) <= bound + 1e-6
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
    cot = jax.random.normal(jax.random.PRNGKey(1), q.shape)
    out, g = out_and_grads(op, q, k, v, lf, cot)
    assert out.dtype == q.dtype
    ref, gr = out_and_grads(lambda *a: forgetting_attention_reference(*a, window_size=window_size, **kw),
                            f32(q), f32(k), f32(v), lf, cot)
    n = 5 if gated else 4
    for name, a, r, atol in list(zip("oqkvf", (out,) + g, (ref,) + gr, (atol_o,) + (atol_g,) * 4))[:n]:
        err = float(jnp.max(jnp.abs(f32(a) - r)))
        assert err <= atol * max(1.0, float(jnp.max(jnp.abs(r)))), f"{'' if name == 'o' else 'd'}{name}: {err}"


def test_window_mask_is_the_last_window_size_keys():
    m = np.asarray(attention_mask(4, 6, window_size=2))[0]
    want = np.zeros((4, 6), bool)
    for i in range(4):  # query i sits at key position 2 + i and sees itself and the key before it
        want[i, 1 + i: 3 + i] = True
    np.testing.assert_array_equal(m, want)
    np.testing.assert_array_equal(np.asarray(attention_mask(4, 6, window_size=6)), np.asarray(attention_mask(4, 6)))
    q, k, v, lf = make_inputs(1, 20, 30, 2, 1, 8)
    np.testing.assert_allclose(forgetting_attention(q, k, v, lf, window_size=5, implementation="dense"),
                               forgetting_attention_reference(q, k, v, lf, window_size=5), atol=1e-6)


@pytest.mark.parametrize("window_size", [3, 37])
def test_window_xla_matches_reference_quick(window_size):
    q, k, v, lf = make_inputs(2, 45, 70, 4, 2, 16, seed=window_size)
    _, kw = window_kwargs("masked", 2, 70)
    check_window_against_reference(q, k, v, lf, window_size, "xla", 2e-5, 1e-4, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("window_size", WINDOWS)
@pytest.mark.parametrize("variant", ["masked", "no_gates"])
def test_window_xla_matches_reference_f32(shape, window_size, variant):
    b, tq, tk, h, hkv, d = shape
    q, k, v, lf = make_inputs(*shape, seed=hash((shape, window_size)) % 1000)
    gated, kw = window_kwargs(variant, b, tk)
    check_window_against_reference(q, k, v, lf, window_size, "xla", 2e-5, 1e-4, gated=gated, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("window_size", [3, 37])
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
    cot = jax.random.normal(jax.random.PRNGKey(4), q.shape)
    o, g = out_and_grads(lambda *a: forgetting_attention(*a, **kw), q, k, v, lf, cot)
    want = [o, *g]
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
    out = forgetting_attention(q, k, v, lf, adaptive_threshold=delta, window_size=37, implementation="xla",
                               block_q=16, block_k=16)
    np.testing.assert_allclose(out, tile_masked_reference(q, k, v, lf, delta, 16, 16, window_size=37), atol=2e-5)
    lam = decay_cumsum(lf)
    lo_acp, _ = tiles.tile_visits(70, 100, 16, 16, lam=lam, delta=delta).row_ranges()
    lo_win, _ = tiles.tile_visits(70, 100, 16, 16, window_size=37).row_ranges()
    lo_both, _ = tiles.tile_visits(70, 100, 16, 16, lam=lam, delta=delta, window_size=37).row_ranges()
    np.testing.assert_array_equal(lo_both, np.maximum(lo_acp, lo_win))
    assert np.any(lo_acp > lo_win) and np.any(lo_win > lo_acp)


def test_window_not_for_cudnn():
    q, k, v, _ = make_inputs(1, 16, 16, 2, 2, 8, dtype=jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="window_size"):
        forgetting_attention(q, k, v, None, window_size=4, implementation="cudnn")
