"""DCP interaction mask, sparsity loss/metric, block flags and masked attention (docs/design/dcp.md §1, §3)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.ops.alpha_sigmoid import alpha_sigmoid
from fox_jax.ops.blockwise import block_sizes
from fox_jax.ops.context_pruning import (
    LOG_FLOOR,
    cumulative_keep_log_mask,
    dcp_attention,
    dcp_attention_reference,
    dropped_key_blocks,
    keep_logits,
    sparsity,
    sparsity_loss,
)


def x64():
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


def random_keep(rng, b, t, p_zero=0.15, p_one=0.15):
    """Keep probabilities with exact zeros and ones mixed in."""
    keep = rng.uniform(0.2, 1.0, (b, t, t))
    u = rng.uniform(size=(b, t, t))
    keep[u < p_zero] = 0.0
    keep[u > 1 - p_one] = 1.0
    return keep


def cumprod_log_reference(keep):
    """float64 log(cumprod over queries of Ī with Ī ≡ 1 on and above the diagonal)."""
    t = keep.shape[-1]
    lower = np.tril(np.ones((t, t), bool), -1)
    masked = np.where(lower, keep, 1.0)
    with np.errstate(divide="ignore"):
        return np.log(np.cumprod(masked, axis=1))


# ---------------------------------------------------------------------------------------------
# Keep logits and the cumulative mask
# ---------------------------------------------------------------------------------------------

def test_keep_logits():
    rng = np.random.default_rng(0)
    qi, ki = rng.normal(size=(2, 7, 8)), rng.normal(size=(2, 9, 8))
    z = keep_logits(jnp.asarray(qi, jnp.bfloat16), jnp.asarray(ki, jnp.bfloat16), 2.0)
    assert z.shape == (2, 7, 9) and z.dtype == jnp.float32
    qb = np.asarray(jnp.asarray(qi, jnp.bfloat16).astype(jnp.float32))
    kb = np.asarray(jnp.asarray(ki, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(z, np.einsum("bkr,bjr->bkj", qb, kb) / math.sqrt(8) + 2.0, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="beta"):
        keep_logits(jnp.zeros((1, 3, 4)), jnp.zeros((1, 3, 4)), jnp.zeros(2))
    with pytest.raises(ValueError, match="share"):
        keep_logits(jnp.zeros((1, 3, 4)), jnp.zeros((1, 3, 5)), 0.0)


def test_log_mask_equals_log_cumprod():
    rng = np.random.default_rng(1)
    keep = random_keep(rng, 3, 29)
    ref = cumprod_log_reference(keep)
    got = np.asarray(cumulative_keep_log_mask(jnp.asarray(keep, jnp.float32)))
    assert got.dtype == np.float32 and got.shape == keep.shape
    alive = ref > LOG_FLOOR + 1.0
    np.testing.assert_allclose(got[alive], ref[alive], atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[ref <= LOG_FLOOR], np.float32(LOG_FLOOR))
    assert np.all(got >= np.float32(LOG_FLOOR)) and np.all(got <= 0)
    # Irreversible: once dropped, a key stays dropped for every later query.
    dropped = got <= LOG_FLOOR
    assert np.all(dropped[:, 1:] >= dropped[:, :-1])


def test_log_mask_from_logits_matches_probabilities():
    rng = np.random.default_rng(2)
    z = jnp.asarray(rng.normal(1.0, 1.5, (2, 23, 23)), jnp.float32)
    for alpha in (1.0, 1.028, 1.5, 2.0, 8.0):
        from_logits = np.asarray(cumulative_keep_log_mask(z, alpha))
        ref = cumprod_log_reference(np.asarray(alpha_sigmoid(z, alpha), np.float64))
        alive = ref > LOG_FLOOR + 1.0
        np.testing.assert_allclose(from_logits[alive], ref[alive], atol=5e-5, rtol=1e-5)
        np.testing.assert_array_equal(from_logits[ref < LOG_FLOOR - 1.0], np.float32(LOG_FLOOR))
    step = np.asarray(cumulative_keep_log_mask(z, float("inf")))
    ref = cumprod_log_reference((np.asarray(z) > 0).astype(np.float64))
    np.testing.assert_array_equal(step, np.where(np.isneginf(ref), np.float32(LOG_FLOOR), 0.0))
    exact = np.asarray(cumulative_keep_log_mask(z, float("inf"), floor=-np.inf))
    np.testing.assert_array_equal(exact, ref.astype(np.float32))  # eval mode: 0 / −inf


def test_self_and_future_never_dropped():
    keep = jnp.zeros((2, 11, 11))  # every token votes to drop everything
    lm = np.asarray(cumulative_keep_log_mask(keep))
    t = 11
    np.testing.assert_array_equal(lm[:, np.triu(np.ones((t, t), bool))], 0.0)  # diagonal and above
    np.testing.assert_array_equal(lm[:, np.tril(np.ones((t, t), bool), -1)], np.float32(LOG_FLOOR))
    z = jnp.full((1, 5, 5), -100.0)
    np.testing.assert_array_equal(np.diagonal(np.asarray(cumulative_keep_log_mask(z, 2.0)), axis1=1, axis2=2), 0.0)


def test_log_mask_gradients_finite_everywhere():
    rng = np.random.default_rng(3)
    keep = jnp.asarray(random_keep(rng, 2, 17, p_zero=0.3, p_one=0.3), jnp.float32)
    keep = keep.at[:, 5, :].set(0.0).at[:, :, 3].set(1e-42)  # exact zeros and subnormals
    w = jnp.asarray(rng.normal(size=(2, 17, 17)), jnp.float32)
    # alpha static (a Python float, as in eval code); one program per alpha (eagerly: one per op)
    grad = jax.jit(jax.grad(lambda x, a: jnp.sum(w * cumulative_keep_log_mask(x, a))), static_argnums=1)
    g = grad(keep, None)
    assert np.all(np.isfinite(np.asarray(g)))
    z = jnp.asarray(rng.normal(0.0, 3.0, (2, 17, 17)), jnp.float32)
    z = z.at[:, 4, :].set(-1.0).at[:, :, 6].set(1.0)  # exactly at the α = 2 support edges
    for alpha in (1.0, 1.01, 1.5, 2.0, 8.0, float("inf")):
        g = grad(z, alpha)
        assert np.all(np.isfinite(np.asarray(g))), alpha
    # Traced alpha inside jit as in training.
    f = jax.jit(jax.grad(lambda x, a: jnp.sum(w * cumulative_keep_log_mask(x, a))))
    for alpha in (1.0, 1.5, float("inf")):
        assert np.all(np.isfinite(np.asarray(f(z, jnp.float32(alpha)))))


def test_log_mask_gradient_matches_finite_differences():
    rng = np.random.default_rng(4)
    with x64():
        keep = jnp.asarray(rng.uniform(0.3, 1.0, (1, 9, 9)))
        w = jnp.asarray(rng.normal(size=(1, 9, 9)))
        f = lambda p: jnp.sum(w * cumulative_keep_log_mask(p))  # noqa: E731
        g = np.asarray(jax.grad(f)(keep))
        # Analytic: d/dĪ_{n,j} Σ_k w_{k,j} log I_{k,j} = Σ_{k≥n} w_{k,j} / Ī_{n,j} for j < n.
        wk = np.asarray(w)[0]
        want = np.zeros((9, 9))
        for n in range(9):
            for j in range(n):
                want[n, j] = wk[n:, j].sum() / float(keep[0, n, j])
        np.testing.assert_allclose(g[0], want, rtol=1e-6, atol=1e-9)
        z = jnp.asarray(rng.normal(0.0, 0.5, (1, 9, 9)))
        fz = lambda x: jnp.sum(w * cumulative_keep_log_mask(x, 1.5))  # noqa: E731
        gz = np.asarray(jax.grad(fz)(z))
        eps = 1e-6
        for (n, j) in [(3, 1), (8, 0), (5, 4), (1, 0)]:
            dz = jnp.zeros_like(z).at[0, n, j].set(eps)
            fd = (fz(z + dz) - fz(z - dz)) / (2 * eps)
            np.testing.assert_allclose(gz[0, n, j], float(fd), rtol=1e-5, atol=1e-8)


def test_mask_errors():
    with pytest.raises(ValueError, match="square"):
        cumulative_keep_log_mask(jnp.zeros((1, 3, 4)))
    with pytest.raises(ValueError, match="floating"):
        cumulative_keep_log_mask(jnp.zeros((1, 3, 3), jnp.int32))
    with pytest.raises(ValueError, match="floor"):
        cumulative_keep_log_mask(jnp.zeros((1, 3, 3)), floor=0.0)


# ---------------------------------------------------------------------------------------------
# Sparsity metric and loss
# ---------------------------------------------------------------------------------------------

def test_sparsity_on_handcrafted_mask():
    t = 4
    keep0 = np.ones((1, t, t))
    keep0[0, 2, 0] = 0.0  # token 2 drops token 0 -> (2, 0) and (3, 0) are dropped
    keep1 = np.ones((1, t, t))  # layer 1 keeps everything
    lm = jnp.stack([cumulative_keep_log_mask(jnp.asarray(k, jnp.float32)) for k in (keep0, keep1)])
    assert lm.shape == (2, 1, t, t)
    per_layer, overall = sparsity(lm)
    np.testing.assert_allclose(per_layer, [2 / 6, 0.0], rtol=1e-6)
    assert float(overall) == pytest.approx(1 / 6)
    # One layer as [B, T, T].
    np.testing.assert_allclose(sparsity(lm[0])[0], [2 / 6], rtol=1e-6)
    # Documents [0, 0, 1, 1]: only (1, 0) and (3, 2) are same-document causal pairs; neither dropped.
    seg = jnp.asarray([[0, 0, 1, 1]])
    np.testing.assert_allclose(sparsity(lm, segment_ids=seg)[0], [0.0, 0.0])
    keep2 = np.ones((1, t, t))
    keep2[0, 3, 2] = 0.0
    np.testing.assert_allclose(sparsity(cumulative_keep_log_mask(jnp.asarray(keep2, jnp.float32)),
                                        segment_ids=seg)[0], [0.5])
    # Soft version: 1 − mean I over causal pairs.
    keep3 = np.ones((1, t, t))
    keep3[0, 1, 0] = 0.5  # I[1,0] = I[2,0] = I[3,0] = 0.5
    soft = sparsity(cumulative_keep_log_mask(jnp.asarray(keep3, jnp.float32)), soft=True)[0]
    np.testing.assert_allclose(soft, [1.5 / 6], rtol=1e-6)
    assert float(sparsity(cumulative_keep_log_mask(jnp.asarray(keep3, jnp.float32)))[1]) == 0.0
    # Eval-mode masks with −inf count as dropped too.
    exact = cumulative_keep_log_mask(jnp.asarray(keep0, jnp.float32), floor=-np.inf)
    np.testing.assert_allclose(sparsity(exact)[0], [2 / 6])


def test_sparsity_loss_normalisations():
    rng = np.random.default_rng(5)
    L, B, T = 2, 3, 10
    keep = rng.uniform(0.0, 1.0, (L * B, T, T))
    lm = jax.jit(cumulative_keep_log_mask)(jnp.asarray(keep, jnp.float32)).reshape(L, B, T, T)
    masks = np.exp(np.asarray(lm, np.float64))
    # jitted: one program per call pattern (eagerly, XLA compiles every op on its own); the error checks
    # below call the op itself
    sparsity_loss_ = jax.jit(sparsity_loss, static_argnames="normalization")
    # "causal": mean over j < k for query rows k = 0..T-2.
    pairs = [(k, j) for k in range(T - 1) for j in range(k)]
    assert len(pairs) == (T - 1) * (T - 2) // 2
    causal_mean = np.mean([masks[:, :, k, j] for k, j in pairs])
    assert float(sparsity_loss_(lm, 0.3)) == pytest.approx(0.3 * causal_mean, rel=1e-5)
    # "code": the reference code's γ·mean(I[..., :-1, :]) including the constant upper triangle.
    code = float(sparsity_loss_(lm, 0.3, normalization="code"))
    assert code == pytest.approx(0.3 * masks[..., :-1, :].mean(), rel=1e-5)
    assert code == pytest.approx(0.3 * ((T - 2) / (2 * T) * causal_mean + (T + 2) / (2 * T)), rel=1e-5)
    # Gradients (into the keep probabilities): code == causal with γ_eff = γ (T−2)/(2T).
    def through_mask(fn):
        return jax.jit(jax.grad(lambda p: fn(cumulative_keep_log_mask(p).reshape(L, B, T, T))))(
            jnp.asarray(keep, jnp.float32))

    g_code = through_mask(lambda x: sparsity_loss(x, 0.3, normalization="code"))
    g_causal = through_mask(lambda x: sparsity_loss(x, 0.3 * (T - 2) / (2 * T)))
    np.testing.assert_allclose(g_code, g_causal, rtol=1e-4, atol=1e-9)
    # One layer [B, T, T]; documents restrict the pairs.
    assert float(sparsity_loss_(lm[0], 1.0)) == pytest.approx(
        np.mean([masks[0, :, k, j] for k, j in pairs]), rel=1e-5)
    seg = jnp.asarray(np.repeat([[0] * 5 + [1] * 5], B, axis=0))
    same = [(k, j) for k, j in pairs if (k < 5) == (j < 5)]
    assert float(sparsity_loss_(lm, 1.0, segment_ids=seg)) == pytest.approx(
        np.mean([masks[:, :, k, j] for k, j in same]), rel=1e-5)
    with pytest.raises(ValueError, match="normalization"):
        sparsity_loss(lm, 1.0, normalization="paper")
    with pytest.raises(ValueError, match="segment_ids"):
        sparsity_loss(lm, 1.0, normalization="code", segment_ids=seg)
    with pytest.raises(ValueError, match="T >= 3"):
        sparsity_loss(jnp.zeros((1, 2, 2)), 1.0)
    with pytest.raises(ValueError, match="log_masks"):
        sparsity_loss(jnp.zeros((2, 3)), 1.0)


# ---------------------------------------------------------------------------------------------
# Block flags
# ---------------------------------------------------------------------------------------------

def dense_block_flags(lm, bq, bk, seg=None):
    b, tq, tk = lm.shape
    off = tk - tq
    nq, nk = -(-tq // bq), -(-tk // bk)
    out = np.ones((b, nq, nk), bool)
    for bi in range(b):
        for i in range(tq):
            for j in range(tk):
                visible = off + i >= j and (seg is None or seg[bi, off + i] == seg[bi, j])
                if visible and lm[bi, i, j] > LOG_FLOOR:
                    out[bi, i // bq, j // bk] = False
    return out


def heavy_drop_mask(rng, b, t, beta=-1.0, alpha=2.0, r=8):
    qi = jnp.asarray(rng.normal(size=(b, t, r)), jnp.float32)
    ki = jnp.asarray(rng.normal(size=(b, t, r)), jnp.float32)
    return _heavy_drop_mask(qi, ki, beta, alpha)


@functools.partial(jax.jit, static_argnums=(2, 3))  # one program (eagerly, XLA compiles every op on its own)
def _heavy_drop_mask(qi, ki, beta, alpha):
    z = keep_logits(qi, ki, beta)
    return z, cumulative_keep_log_mask(z, alpha)


def test_dropped_key_blocks_matches_dense_check():
    rng = np.random.default_rng(6)
    _, lm = heavy_drop_mask(rng, 2, 37)
    lm_np = np.asarray(lm)
    flags = jax.jit(dropped_key_blocks, static_argnums=(1, 2))  # one program per tiling (eagerly: one per op)
    for bq, bk in [(8, 8), (16, 8), (5, 7), (64, 64)]:
        got = np.asarray(flags(lm, bq, bk))
        np.testing.assert_array_equal(got, dense_block_flags(lm_np, bq, bk))
    assert dense_block_flags(lm_np, 8, 8)[:, np.tril_indices(5, -1)[0], np.tril_indices(5, -1)[1]].any()
    seg = np.repeat(np.arange(37)[None] // 12, 2, axis=0)
    got = np.asarray(flags(lm, 8, 8, segment_ids=jnp.asarray(seg)))
    np.testing.assert_array_equal(got, dense_block_flags(lm_np, 8, 8, seg))
    # Tq < Tk (bottom-right aligned queries).
    sub = lm_np[:, 20:, :]
    np.testing.assert_array_equal(np.asarray(flags(jnp.asarray(sub), 8, 8)),
                                  dense_block_flags(sub, 8, 8))
    with pytest.raises(ValueError, match="block_q"):
        dropped_key_blocks(lm, 0, 8)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

def qkv(rng, b, tq, tk, h, hkv, d, dtype=jnp.float32):
    q = jnp.asarray(rng.normal(size=(b, tq, h, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, tk, hkv, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, tk, hkv, d)), dtype)
    return q, k, v


def jitted_out_and_grads(fn, argnums):
    """jitted ``(*args) -> (fn(*args), grads of Σ w·fn(*args))``; w a fixed pseudo-random weight."""
    def loss(*a):
        o = fn(*a)
        w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))
        return jnp.sum(w * o), o

    grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(argnums), has_aux=True))
    return lambda *args: (lambda r: (r[0][1], r[1]))(grad(*args))


def out_and_grads(fn, args, argnums):
    """(fn(*args), grads of Σ w·fn(*args)) from one jitted call; w a fixed pseudo-random weight."""
    return jitted_out_and_grads(fn, argnums)(*args)


def assert_grads_close(g, g_ref, names):
    for name, a, ref in zip(names, g, g_ref):
        assert np.all(np.isfinite(np.asarray(a))), name
        np.testing.assert_allclose(a, ref, atol=5e-5 * (1 + float(jnp.abs(ref).max())), rtol=1e-4,
                                   err_msg=name)


@pytest.mark.parametrize("beta,alpha", [(1.0, 1.5), (-1.0, 2.0)])
def test_dcp_attention_matches_dense_with_gradients(beta, alpha):
    # Awkward T (not a multiple of either block); gradients into q, k, v and the mask logits z.
    rng = np.random.default_rng(7)
    b, t, h, d, r = 2, 37, 3, 16, 8
    q, k, v = qkv(rng, b, t, t, h, h, d)
    z = keep_logits(jnp.asarray(rng.normal(size=(b, t, r)), jnp.float32),
                    jnp.asarray(rng.normal(size=(b, t, r)), jnp.float32), beta)

    def run(attn):
        return out_and_grads(lambda q, k, v, z: attn(q, k, v, cumulative_keep_log_mask(z, alpha)),
                             (q, k, v, z), range(4))

    o, g = run(lambda q, k, v, m: dcp_attention(q, k, v, m, block_q=16, block_k=8))
    o_ref, g_ref = run(dcp_attention_reference)
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=2e-5)
    assert_grads_close(g, g_ref, ("q", "k", "v", "z"))
    assert float(jnp.abs(g_ref[3]).max()) > 1e-3  # the mask gradient is exercised


@pytest.mark.slow
def test_dcp_attention_skips_dropped_blocks_exactly():
    rng = np.random.default_rng(8)
    b, t, h, d = 2, 45, 2, 8
    q, k, v = qkv(rng, b, t, t, h, h, d)
    _, lm = heavy_drop_mask(rng, b, t, beta=-2.0)
    bq, bk = block_sizes(t, t, 8, 8)
    flags = np.asarray(jax.jit(dropped_key_blocks, static_argnums=(1, 2))(lm, bq, bk))
    causal = np.tril(np.ones(flags.shape[1:], bool))
    assert (flags & causal).all(axis=0).any(), "the test mask must have skippable causal tiles"
    attn = jax.jit(lambda q, k, v, m: dcp_attention(q, k, v, m, block_q=8, block_k=8))
    o_skip = attn(q, k, v, lm)
    o_full = jax.jit(lambda *a: dcp_attention(*a, block_q=8, block_k=8, skip_dropped=False))(q, k, v, lm)
    np.testing.assert_allclose(o_skip, o_full, atol=1e-6)
    np.testing.assert_allclose(o_skip, jax.jit(dcp_attention_reference)(q, k, v, lm), atol=2e-5)
    # Eval-mode mask with −inf entries: same result, no NaN in values or gradients.
    lm_inf = jnp.asarray(np.where(np.asarray(lm) <= LOG_FLOOR, -np.inf, np.asarray(lm)))
    o_inf, g = out_and_grads(attn, (q, k, v, lm_inf), (0, 3))
    np.testing.assert_allclose(o_inf, o_skip, atol=1e-6)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in g)


def test_dcp_attention_gqa_segments_and_decoding_alignment():
    rng = np.random.default_rng(9)
    b, t, h, hkv, d = 2, 30, 4, 2, 8
    q, k, v = qkv(rng, b, t, t, h, hkv, d)
    _, lm = heavy_drop_mask(rng, b, t, beta=0.0)
    seg = jnp.asarray(np.stack([np.arange(t) // 11, np.arange(t) // 7]))
    o, g = out_and_grads(lambda q, k, v, m: dcp_attention(q, k, v, m, segment_ids=seg, block_q=8, block_k=16),
                         (q, k, v, lm), range(4))
    o_ref, g_ref = out_and_grads(lambda q, k, v, m: dcp_attention_reference(q, k, v, m, segment_ids=seg),
                                 (q, k, v, lm), range(4))
    np.testing.assert_allclose(o, o_ref, atol=2e-5)
    assert_grads_close(g, g_ref, ("q", "k", "v", "log_mask"))
    # Tq < Tk: the last 9 queries over all keys.
    tq = 9
    out = jax.jit(lambda *a: dcp_attention(*a, block_q=8, block_k=8))(q[:, -tq:], k, v, lm[:, -tq:])
    np.testing.assert_allclose(out, jax.jit(dcp_attention_reference)(q[:, -tq:], k, v, lm[:, -tq:]), atol=2e-5)


def test_dcp_attention_bfloat16_and_jit():
    rng = np.random.default_rng(10)
    q, k, v = qkv(rng, 1, 19, 19, 2, 2, 16, jnp.bfloat16)
    _, lm = heavy_drop_mask(rng, 1, 19, beta=0.5)
    out = jax.jit(lambda q, k, v, m: dcp_attention(q, k, v, m, block_q=8, block_k=8))(q, k, v, lm)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), jax.jit(dcp_attention_reference)(q, k, v, lm), atol=3e-2)


def test_dcp_attention_errors():
    q = jnp.zeros((1, 8, 2, 4))
    lm = jnp.zeros((1, 8, 8))
    with pytest.raises(ValueError, match="float32"):
        dcp_attention(q, q, q, lm.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="log_mask"):
        dcp_attention(q, q, q, jnp.zeros((1, 8, 7)))
    with pytest.raises(ValueError, match="multiple"):
        dcp_attention(q, jnp.zeros((1, 8, 3, 4)), jnp.zeros((1, 8, 3, 4)), lm)
    with pytest.raises(ValueError, match="exceed"):
        dcp_attention(jnp.zeros((1, 9, 2, 4)), q, q, jnp.zeros((1, 9, 8)))
    with pytest.raises(ValueError, match="segment_ids"):
        dcp_attention(q, q, q, lm, segment_ids=jnp.zeros((1, 8)))
    with pytest.raises(ValueError, match="block_k"):
        dcp_attention(q, q, q, lm, block_k=0)


# ---------------------------------------------------------------------------------------------
# Attention with forget gates (FoX): the mask plus the decay bias Λ_i − Λ_j
# ---------------------------------------------------------------------------------------------
# Tolerances. Both sides are float32 with HIGHEST-precision matmuls on CPU; they differ only in the
# summation order (online softmax over key tiles vs one dense softmax) and in where Λ_i − Λ_j is
# formed, i.e. a few float32 ulps (~1e-7 relative) per accumulated term. Observed max errors are
# ~1e-6 on outputs and ~2e-6 on gradients whose magnitude is O(1); the checks use
# 2e-5 (outputs) and 5e-5·(1 + max|ref|) + 1e-4 relative (gradients, ``assert_grads_close``), ~10×
# headroom. dlog_fgate is a reverse cumsum over ≤ 40 steps of row/column sums, which adds at most
# ~40 ulps of the largest partial sum and stays inside the same bound.

def random_log_fgate(rng, b, t, h):
    """float32 log σ(x) with x ~ N(1, 2²): gates from ~0.05 to ~1, a realistic FoX spread."""
    return jax.nn.log_sigmoid(jnp.asarray(rng.normal(1.0, 2.0, size=(b, t, h)), jnp.float32))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mha_awkward", "gqa_segments", "decode_alignment"])
def test_dcp_attention_fgate_matches_dense_with_gradients(case):
    rng = np.random.default_rng(11)
    b, tk, h, hkv, d, tq, seg = 2, 37, 3, 3, 16, 37, None
    if case == "gqa_segments":
        tk = tq = 30
        h, hkv = 4, 2
        seg = jnp.asarray(np.stack([np.arange(tk) // 11, np.arange(tk) // 7]))
    elif case == "decode_alignment":
        tq, h, hkv = 13, 4, 2  # Tq < Tk, bottom-right aligned
    q, k, v = qkv(rng, b, tq, tk, h, hkv, d)
    lf = random_log_fgate(rng, b, tk, h)
    _, lm = heavy_drop_mask(rng, b, tk, beta=0.5, alpha=1.5)
    lm = lm[:, tk - tq:]

    def fast(q, k, v, lf, m):
        return dcp_attention(q, k, v, m, lf, segment_ids=seg, block_q=16, block_k=8)

    def ref(q, k, v, lf, m):
        return dcp_attention_reference(q, k, v, m, lf, segment_ids=seg)

    o, g = out_and_grads(fast, (q, k, v, lf, lm), range(5))
    o_ref, g_ref = out_and_grads(ref, (q, k, v, lf, lm), range(5))
    assert o.dtype == jnp.float32 and g[3].dtype == jnp.float32 and g[3].shape == lf.shape
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=2e-5)
    assert_grads_close(g, g_ref, ("q", "k", "v", "log_fgate", "log_mask"))
    assert float(jnp.abs(g_ref[3]).max()) > 1e-2  # the gate gradient is exercised


def test_dcp_attention_reference_is_forgetting_attention_plus_mask():
    # Ties the oracle to reference.py's: with log I = 0 the DCP oracle is forgetting attention, and the
    # blockwise op then equals the public forgetting_attention op too (Tq < Tk, GQA).
    from fox_jax.ops import forgetting_attention
    from fox_jax.ops.reference import forgetting_attention_reference

    rng = np.random.default_rng(12)
    b, tq, tk, h, hkv, d = 2, 11, 26, 4, 2, 8
    q, k, v = qkv(rng, b, tq, tk, h, hkv, d)
    lf = random_log_fgate(rng, b, tk, h)
    zero = jnp.zeros((b, tq, tk), jnp.float32)
    # each call one jitted program (eagerly, XLA compiles every op separately)
    want = jax.jit(forgetting_attention_reference)(q, k, v, lf)
    np.testing.assert_allclose(jax.jit(dcp_attention_reference)(q, k, v, zero, lf), want, atol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda *a: dcp_attention(*a, block_q=8, block_k=8))(q, k, v, zero, lf), want,
                               atol=2e-5)
    np.testing.assert_allclose(jax.jit(lambda *a: forgetting_attention(*a, implementation="xla"))(q, k, v, lf), want,
                               atol=2e-5)


def test_dcp_attention_fgate_zero_gates_equal_ungated_and_skip_is_exact():
    rng = np.random.default_rng(13)
    b, t, h, d = 2, 45, 2, 8
    q, k, v = qkv(rng, b, t, t, h, h, d)
    _, lm = heavy_drop_mask(rng, b, t, beta=-2.0)
    attn = jax.jit(lambda q, k, v, m, lf: dcp_attention(q, k, v, m, lf, block_q=8, block_k=8))
    # log f ≡ 0 adds exactly 0 to every logit: bit-identical to the log_fgate=None path.
    np.testing.assert_array_equal(attn(q, k, v, lm, jnp.zeros((b, t, h), jnp.float32)),
                                  jax.jit(lambda *a: dcp_attention(*a, block_q=8, block_k=8))(q, k, v, lm))
    # Skipping fully dropped tiles stays exact with the decay (it only lowers skipped logits).
    lf = random_log_fgate(rng, b, t, h)
    o_skip = attn(q, k, v, lm, lf)
    o_full = jax.jit(lambda q, k, v, m, lf: dcp_attention(q, k, v, m, lf, block_q=8, block_k=8, skip_dropped=False))(
        q, k, v, lm, lf)
    np.testing.assert_allclose(o_skip, o_full, atol=1e-6)
    np.testing.assert_allclose(o_skip, jax.jit(dcp_attention_reference)(q, k, v, lm, lf), atol=2e-5)


def test_dcp_attention_fgate_bfloat16():
    # bf16 q/k/v (float32 gates and mask). The reference sees the same bf16-rounded inputs in float32;
    # the op casts P to bf16 before P·V and dS to bf16 before dS·K / dSᵀ·Q (8-bit mantissa, relative
    # 2⁻⁹ ≈ 2e-3 per rounding, summed over ≤ 19 keys of O(1) values), and returns bf16 outputs and
    # q/k/v gradients (another 2⁻⁹ relative). Observed: 5e-3 (output), ≤ 1.3e-2 (gradients of max ~2);
    # bounds 3e-2 for the output, 5e-2·(1 + max|ref|) for the gradients (≥ 5× headroom). dlog_fgate and dlog_mask are float32 sums of the
    # same bf16-derived dS and use the same bound.
    rng = np.random.default_rng(14)
    b, t, h, hkv, d = 1, 19, 4, 2, 16
    q, k, v = qkv(rng, b, t, t, h, hkv, d, jnp.bfloat16)
    lf = random_log_fgate(rng, b, t, h)
    _, lm = heavy_drop_mask(rng, b, t, beta=0.5)
    o, g = out_and_grads(lambda q, k, v, lf, m: dcp_attention(q, k, v, m, lf, block_q=8, block_k=8),
                         (q, k, v, lf, lm), range(5))
    assert o.dtype == jnp.bfloat16 and g[0].dtype == jnp.bfloat16 and g[3].dtype == jnp.float32
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    o_ref, g_ref = out_and_grads(lambda q, k, v, lf, m: dcp_attention_reference(q, k, v, m, lf),
                                 (*f32, lf, lm), range(5))
    np.testing.assert_allclose(np.asarray(o, np.float32), o_ref, atol=3e-2)
    for name, a, r in zip(("q", "k", "v", "log_fgate", "log_mask"), g, g_ref):
        a = np.asarray(a, np.float32)
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a, r, atol=5e-2 * (1 + float(jnp.abs(r).max())), err_msg=name)


def test_dcp_attention_fgate_errors():
    q = jnp.zeros((1, 8, 2, 4))
    lm = jnp.zeros((1, 8, 8))
    with pytest.raises(ValueError, match="log_fgate"):
        dcp_attention(q, q, q, lm, jnp.zeros((1, 8, 1)))
    with pytest.raises(ValueError, match="log_fgate must be float32"):
        dcp_attention(q, q, q, lm, jnp.zeros((1, 8, 2), jnp.bfloat16))


@pytest.mark.slow
def test_dropped_pairs_weigh_zero_for_every_tiling():
    """Pairs at the floor weigh exactly 0 and a row with no kept pair outputs 0, for every block size,
    with and without skipping, also with eval-mode −inf masks (where the last row, which sees every
    key, has nothing to fall back on). A weakly kept row (its one kept pair at floor + 1, the rest
    at the floor) attends to that key alone. Tolerances as above."""
    rng = np.random.default_rng(12)
    b, t, h, d = 1, 24, 2, 8
    q, k, v = qkv(rng, b, t, t, h, h, d)
    lm = np.where(rng.uniform(size=(b, t, t)) < 0.4, LOG_FLOOR, -rng.uniform(0, 2, (b, t, t))).astype(np.float32)
    lm[:, 4:8] = LOG_FLOOR   # rows without a kept pair: half of an 8-row tile
    lm[:, t - 1] = LOG_FLOOR
    lm[:, 17] = LOG_FLOOR
    lm[:, 17, 3] = LOG_FLOOR + 1.0  # weakly kept: only key 3 counts
    tilings = (dict(block_q=8, block_k=8), dict(block_q=4, block_k=4), dict(block_q=16, block_k=8),
               dict(block_q=8, block_k=8, skip_dropped=False))
    # one jitted function each, called with both masks (same shapes: traced and compiled once)
    ref_fn = jitted_out_and_grads(dcp_attention_reference, range(4))
    fns = [jitted_out_and_grads(lambda *a, kw=kw: dcp_attention(*a, **kw), range(4)) for kw in tilings]
    for mask in (jnp.asarray(lm), jnp.asarray(np.where(lm <= LOG_FLOOR, -np.inf, lm))):
        o_ref, g_ref = ref_fn(q, k, v, mask)
        np.testing.assert_array_equal(np.asarray(o_ref)[:, [4, 5, 6, 7, t - 1]], 0.0)
        np.testing.assert_allclose(np.asarray(o_ref)[:, 17], np.asarray(v)[:, 3], atol=1e-6)
        for kw, fn in zip(tilings, fns):
            o, g = fn(q, k, v, mask)
            np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=2e-5, err_msg=str(kw))
            assert_grads_close(g, g_ref, ("q", "k", "v", "log_mask"))
