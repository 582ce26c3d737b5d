"""Out-of-contract inputs of the public op: positive log forget gates with ACP, ``seq_start`` out of
range, non-finite ACP thresholds. Each input either raises a clear error (concrete values) or has one
documented meaning shared by every implementation (traced values, under ``jit`` / ``vmap``).

The Pallas kernels run in interpret mode on CPU (tests/test_pallas.py explains their small tiles).

Tolerances: float32 everywhere. Outputs of two implementations (or of the op and the dense float32
oracle) differ only by the summation order of O(T) float32 terms: atol 2e-5 on O(1) values
(tests/test_ops.py). With the auto ACP threshold the pruned weight per query is ≤ ε = e^-10, so the
ACP output moves by ≤ 2ε·max|v| (dropping mass m and renormalising moves o by ≤ 2m·max|v|), plus the
same float32 noise.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.ops import acp, decay_cumsum, forgetting_attention, forgetting_attention_reference

IMPLS = ["xla", "pallas"]


def _normal(shape, n, seed=0):
    return [jax.random.normal(kk, shape, jnp.float32) for kk in jax.random.split(jax.random.PRNGKey(seed), n)]


# Case 1: positive log forget gates with ACP ----------------------------------------------------------

def _rising_gates():
    """The issue's inputs: Λ falls for 128 steps (log f = −1), then rises again (log f = +1)."""
    q, k, v = _normal((1, 256, 1, 16), 3)
    lf = jnp.concatenate([jnp.full((1, 128, 1), -1.0), jnp.full((1, 128, 1), 1.0)], axis=1)
    return q, k, v, lf


@pytest.mark.parametrize("impl", IMPLS)
def test_acp_with_positive_gates_stays_within_epsilon(impl):
    q, k, v, lf = _rising_gates()
    kw = dict(implementation=impl, block_q=32, block_k=32)
    op = lambda **extra: jax.jit(lambda *a: forgetting_attention(*a, **kw, **extra))  # noqa: E731 (not op by op)
    dense = op()(q, k, v, lf)
    # the gates are out of the documented range (log f ≤ 0), but the op is still defined and exact
    np.testing.assert_allclose(dense, jax.jit(forgetting_attention_reference)(q, k, v, lf), atol=2e-5, rtol=0)
    out = op(adaptive_threshold="auto")(q, k, v, lf)
    bound = 2 * math.exp(acp.DEFAULT_LOG_EPSILON) * float(jnp.max(jnp.abs(v)))
    assert float(jnp.max(jnp.abs(out - dense))) <= bound + 2e-5


@pytest.mark.parametrize("block_q, block_k, tq", [(16, 16, 100), (32, 16, 70), (16, 32, 100), (8, 8, 1)])
def test_acp_block_ranges_prune_only_tiles_below_threshold(block_q, block_k, tq):
    """For gates of either sign, every tile outside the ranges has all its decays Λ_i − Λ_j < δ, and
    the forward (kv_start) and dK/dV (q_end) ranges describe the same tiles."""
    b, tk, h = 2, 100, 3
    lf = jax.random.uniform(jax.random.PRNGKey(4), (b, tk, h), jnp.float32, -3.0, 1.5)
    lam_j = decay_cumsum(lf, jnp.asarray([0, 9], jnp.int32))
    delta = jnp.asarray([[-4.0, -8.0, -15.0], [-2.0, -6.0, -30.0]])
    kv_start = np.asarray(acp.kv_block_start(lam_j, delta, tq=tq, block_q=block_q, block_k=block_k))
    q_end = np.asarray(acp.q_block_end(lam_j, delta, tq=tq, block_q=block_q, block_k=block_k))
    lam, delta = np.asarray(lam_j), np.asarray(delta)
    off, nq, nk = tk - tq, -(-tq // block_q), -(-tk // block_k)
    pruned_tiles = 0
    for bi in range(b):
        for hi in range(h):
            for m in range(nq):
                rows = lam[bi, off + m * block_q: off + min((m + 1) * block_q, tq), hi]
                for n in range(nk):
                    cols = lam[bi, n * block_k: (n + 1) * block_k, hi]
                    skipped = n < kv_start[bi, hi, m]
                    assert skipped == (m >= q_end[bi, hi, n]), (bi, hi, m, n)
                    if skipped:
                        pruned_tiles += 1
                        assert rows.max() - cols.min() < delta[bi, hi], (bi, hi, m, n)
    if tq > 1:
        assert pruned_tiles > 0  # the threshold really prunes


@pytest.mark.slow
@pytest.mark.parametrize("tq, tk, block_q, block_k", [(100, 100, 16, 16), (37, 130, 32, 16), (1, 77, 8, 16),
                                                      (256, 256, 64, 32)])
def test_acp_block_ranges_on_nonpositive_gates_are_the_official_tile_test(tq, tk, block_q, block_k):
    """With log f ≤ 0 (Λ non-increasing) the ranges are exactly those of the official kernel's test
    Λ_r − Λ_c' < δ (docs/design/fox_acp.md §5.3; r the tile's first query row, c' its last key column):
    the bound for arbitrary gates costs no pruning on real models."""
    b, h = 2, 4
    logits = jax.random.uniform(jax.random.PRNGKey(tq), (b, tk, h), jnp.float32, 0.0, 10.0)
    lam = decay_cumsum(jax.nn.log_sigmoid(logits), jnp.asarray([0, min(13, tk - 1)], jnp.int32))
    delta = jnp.asarray([[-0.5, -3.0, -10.0, -40.0], [-1e-3, -2.0, -8.0, -jnp.inf]])
    lam_np, d_np = np.asarray(lam), np.asarray(delta)
    nq, nk = -(-tq // block_q), -(-tk // block_k)
    r = (tk - tq) + np.arange(nq) * block_q
    c = np.minimum(np.arange(nk) * block_k + block_k - 1, tk - 1)
    decay = lam_np[:, r, :][:, :, None, :] - lam_np[:, c, :][:, None, :, :]  # [B, nq, nk, H]
    pruned = decay < d_np[:, None, None, :]
    want_start = pruned.sum(axis=2).transpose(0, 2, 1)  # [B, H, nq]
    want_end = (~pruned).sum(axis=1).transpose(0, 2, 1)  # [B, H, nk]
    np.testing.assert_array_equal(acp.kv_block_start(lam, delta, tq=tq, block_q=block_q, block_k=block_k),
                                  want_start)
    np.testing.assert_array_equal(acp.q_block_end(lam, delta, tq=tq, block_q=block_q, block_k=block_k),
                                  want_end)


# Case 2: seq_start out of range ----------------------------------------------------------------------

def _small(t=16):
    q, k, v = _normal((2, t, 2, 8), 3, seed=1)
    return q, k, v, jnp.full((2, t, 2), -0.1, jnp.float32)


@pytest.mark.parametrize("impl", IMPLS + ["dense"])
@pytest.mark.parametrize("seq_start, shown", [([-3, 0], "seq_start[0] = -3"), ([0, 16], "seq_start[1] = 16"),
                                              ([0, 21], "seq_start[1] = 21")])
def test_concrete_seq_start_out_of_range_raises(impl, seq_start, shown):
    q, k, v, lf = _small()
    with pytest.raises(ValueError, match=r"seq_start values must be in \[0, 15\].*" + shown.replace("[", r"\[")):
        forgetting_attention(q, k, v, lf, seq_start=jnp.asarray(seq_start, jnp.int32), implementation=impl)


@pytest.mark.parametrize("impl", IMPLS + ["dense"])
def test_seq_start_range_edges_match_reference(impl):
    q, k, v, lf = _small()
    ss = jnp.asarray([0, 15], jnp.int32)  # 15 = Tk − 1: only the last key (and query) of row 1 is live
    out = forgetting_attention(q, k, v, lf, seq_start=ss, implementation=impl)
    np.testing.assert_allclose(out, forgetting_attention_reference(q, k, v, lf, seq_start=ss), atol=2e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS + ["dense"])
def test_traced_seq_start_is_clamped_into_range_for_every_implementation(impl):
    """Under jit the values cannot be checked: −3 acts as 0, 16 and 21 as Tk − 1 = 15 (outputs and
    gradients), whatever the implementation."""
    q, k, v, lf = _small()
    w = _normal(q.shape, 1, seed=2)[0]

    def loss(fn, ss):  # seq_start is an argument of the jitted function: traced
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * w), argnums=(0, 1, 2, 3)))(q, k, v, lf, ss)

    def op(*a):
        return forgetting_attention(*a[:4], seq_start=a[4], implementation=impl)

    def ref(*a):
        return forgetting_attention_reference(*a[:4], seq_start=a[4])

    for raw, clamped in (([-3, 16], [0, 15]), ([21, 0], [15, 0])):
        got = loss(op, jnp.asarray(raw, jnp.int32))
        want = loss(ref, jnp.asarray(clamped, jnp.int32))
        for a, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(a, r, atol=1e-4, rtol=0)  # gradients: tests/test_ops.py tolerance
    # vmap over a stack of seq_start vectors traces them too
    stack = jnp.asarray([[-3, 16], [0, 15]], jnp.int32)
    outs = jax.vmap(lambda ss: op(q, k, v, lf, ss))(stack)
    want = forgetting_attention_reference(q, k, v, lf, seq_start=jnp.asarray([0, 15], jnp.int32))
    for o in outs:
        np.testing.assert_allclose(o, want, atol=2e-5, rtol=0)


def test_check_seq_start_helper():
    from fox_jax.ops._common import check_seq_start

    assert check_seq_start(None, 3).tolist() == [0, 0, 0]
    assert check_seq_start(np.array([0, 4]), 2, 5).dtype == jnp.int32
    with pytest.raises(ValueError, match=r"seq_start\[1\] = -1"):
        check_seq_start(np.array([0, -1]), 2)  # without a length only negatives are out of range
    with pytest.raises(ValueError, match="shape"):
        check_seq_start(np.array([0.0, 1.0]), 2)
    clamped = jax.jit(lambda s: check_seq_start(s, 2, 5))(jnp.asarray([-7, 9], jnp.int32))
    assert clamped.tolist() == [0, 4]


# Case 5: non-finite ACP thresholds ---------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("threshold, where", [(float("nan"), r"\(got NaN\)"),
                                              (np.array([[-3.0, np.nan], [-3.0, -3.0]]), r"index \(0, 1\)"),
                                              (np.array([np.nan, -1.0]), r"index \(0,\)")])
def test_concrete_nan_threshold_raises(impl, threshold, where):
    q, k, v, lf = _small()
    with pytest.raises(ValueError, match="adaptive_threshold must not be NaN.*" + where):
        forgetting_attention(q, k, v, lf, adaptive_threshold=threshold, implementation=impl)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_traced_nan_threshold_prunes_nothing(impl):
    """Under jit a NaN threshold cannot be checked: it prunes nothing, exactly like −inf (outputs and
    gradients; a NaN compared false everywhere and left dK/dV loops empty)."""
    q, k, v, lf = _small(64)
    lf = jnp.full_like(lf, -2.0)  # fast forgetting: a finite δ would prune
    w = _normal(q.shape, 1, seed=3)[0]

    def run(thr):
        f = lambda q_, k_, v_, lf_, t: jnp.sum(forgetting_attention(  # noqa: E731
            q_, k_, v_, lf_, adaptive_threshold=t, implementation=impl, block_q=8, block_k=8) * w)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(q, k, v, lf, thr)

    nan = run(jnp.full((2, 2), jnp.nan))
    off = run(jnp.full((2, 2), -jnp.inf))
    for a, b in zip(jax.tree_util.tree_leaves(nan), jax.tree_util.tree_leaves(off)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.max(jnp.abs(off[1][1]))) > 0  # dk really flows


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_infinite_thresholds(impl):
    """+inf is clipped to 0 (the most pruning: only tiles holding a zero decay are kept); −inf
    prunes nothing (bit-identical to no ACP)."""
    q, k, v, lf = _small(64)
    lf = jnp.full_like(lf, -2.0)
    kw = dict(implementation=impl, block_q=8, block_k=8)
    none = forgetting_attention(q, k, v, lf, **kw)
    np.testing.assert_array_equal(forgetting_attention(q, k, v, lf, adaptive_threshold=-math.inf, **kw), none)
    pos = forgetting_attention(q, k, v, lf, adaptive_threshold=math.inf, **kw)
    np.testing.assert_array_equal(pos, forgetting_attention(q, k, v, lf, adaptive_threshold=0.0, **kw))
    assert float(jnp.max(jnp.abs(pos - none))) > 1e-3  # δ = 0 really prunes
