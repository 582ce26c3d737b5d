"""α-sigmoid (2-class α-entmax) and the α schedule against independent references (docs/design/dcp.md §2)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.ops.alpha_sigmoid import (
    SIGMOID_TOLERANCE,
    alpha_sigmoid,
    alpha_sigmoid_step,
    cosine_alpha_schedule,
    log_alpha_sigmoid,
)


def x64():
    """A float64 context on both JAX versions of the project."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # older JAX

    return enable_x64()


def entmax_tau_bisect(x: np.ndarray, alpha: float, n_iter: int = 200) -> np.ndarray:
    """Generic α-entmax over the last axis by bisection on τ (float64, written for this test).

    p_i = [(α−1)·x_i − τ]_+^{1/(α−1)}, τ such that Σ p = 1. The bracket: τ ≤ max − 1 gives Σp ≥ 1,
    τ ≥ max − (1/d)^{α−1} gives Σp ≤ 1.
    """
    x = np.asarray(x, np.float64) * (alpha - 1.0)
    d = x.shape[-1]
    mx = x.max(axis=-1, keepdims=True)
    lo, hi = mx - 1.0, mx - (1.0 / d) ** (alpha - 1.0)
    for _ in range(n_iter):
        tau = 0.5 * (lo + hi)
        mass = (np.clip(x - tau, 0.0, None) ** (1.0 / (alpha - 1.0))).sum(axis=-1, keepdims=True)
        lo, hi = np.where(mass >= 1.0, tau, lo), np.where(mass >= 1.0, hi, tau)
    p = np.clip(x - 0.5 * (lo + hi), 0.0, None) ** (1.0 / (alpha - 1.0))
    return p / p.sum(axis=-1, keepdims=True)


def ref_sigma(z: np.ndarray, alpha: float) -> np.ndarray:
    z = np.asarray(z, np.float64)
    pair = np.stack([z, np.zeros_like(z)], axis=-1)
    return entmax_tau_bisect(pair, alpha)[..., 0]


def implicit_sigma(z: np.ndarray, alpha: float, n_iter: int = 400) -> np.ndarray:
    """σ_α for z ≤ 0 inside the support from the implicit equation, by bisection on p (float64).

    Solves (p^a + 1 − (1−p)^a)/a = z + 1/a, a = α − 1 — the root equation g(p) = z written relative
    to the support edge so that tiny p keep their relative precision (the τ form cannot resolve
    them: it needs (x − τ) = p^a, far below float64's resolution near the edge for large α).
    """
    a = alpha - 1.0
    target = np.asarray(z, np.float64) + 1.0 / a
    lo, hi = np.zeros_like(target), np.full_like(target, 0.5)
    for _ in range(n_iter):
        p = 0.5 * (lo + hi)
        val = (p**a - np.expm1(a * np.log1p(-p))) / a
        lo, hi = np.where(val < target, p, lo), np.where(val < target, hi, p)
    return 0.5 * (lo + hi)


def interior(alpha, n=41, frac=0.98, cap=60.0):
    """n points inside the support, |z| ≤ frac/(α−1) and ≤ cap (beyond, σ_α underflows)."""
    e = min(frac / (alpha - 1.0), cap)
    return np.linspace(-e, e, n)


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------

def test_closed_form_alpha_2_is_sparsemax():
    z = np.linspace(-3, 3, 61, dtype=np.float32)
    got = np.asarray(alpha_sigmoid(jnp.asarray(z), 2.0))
    np.testing.assert_allclose(got, np.clip((z.astype(np.float64) + 1) / 2, 0, 1), atol=1e-7, rtol=1e-6)


def test_closed_form_alpha_3():
    z = np.linspace(-1, 1, 81, dtype=np.float32)
    got = np.asarray(alpha_sigmoid(jnp.asarray(z), 3.0))
    np.testing.assert_allclose(got, np.clip(z.astype(np.float64) + 0.5, 0, 1), atol=1e-7, rtol=1e-6)


def test_closed_form_alpha_1_5():
    z = np.linspace(-1.99, 1.99, 81)
    want = ((z + np.sqrt(8 - z**2)) / 4) ** 2
    got = np.asarray(alpha_sigmoid(jnp.asarray(z, jnp.float32), 1.5))
    np.testing.assert_allclose(got, want, atol=1e-7, rtol=2e-6)


@pytest.mark.parametrize("alpha", [1.002, 1.01, 1.028, 1.2, 1.5, 2.0, 2.5, 3.42, 4.5, 8.0, 32.0])
def test_matches_generic_entmax_bisection(alpha):
    z = np.concatenate([interior(alpha, 81, 0.999), interior(alpha, 21, 0.05)])
    want = ref_sigma(z, alpha)
    # Compare where the τ reference is well conditioned: (x − τ) = min(p, 1−p)^{α−1} ≫ float64 eps.
    ok = np.minimum(want, 1 - want) ** (alpha - 1) > 1e-10
    assert ok.sum() >= 2  # few at α = 32, where the τ form is ill-conditioned almost everywhere
    got = np.asarray(alpha_sigmoid(jnp.asarray(z, jnp.float32), alpha))
    np.testing.assert_allclose(got[ok], want[ok], atol=2e-7, rtol=1e-5)
    # The two float64 references agree with each other there.
    neg = ok & (z <= 0)
    np.testing.assert_allclose(implicit_sigma(z[neg], alpha), want[neg], rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("alpha", [1.01, 1.028, 1.5, 2.0, 4.5, 8.0, 32.0])
def test_log_matches_reference_in_the_tail(alpha):
    # Relative precision of tiny keep probabilities (down to 1e-38) near the lower support edge.
    a = alpha - 1.0
    e = 1.0 / a
    p = np.concatenate([np.geomspace(1e-38, 1e-4, 25), np.geomspace(1e-4, 0.45, 15)])
    z = (-e + (p**a - np.expm1(a * np.log1p(-p))) / a).astype(np.float32)  # g(p), edge-relative
    z = z[(z.astype(np.float64) + e) > 1e-4 * e]  # float32 z must resolve the distance to the edge
    assert z.size >= 12
    p_ref = implicit_sigma(z.astype(np.float64), alpha)  # reference at the float32 inputs
    want = np.log(p_ref)
    got = np.asarray(log_alpha_sigmoid(jnp.asarray(z), alpha))
    # float32 rounds the support edge e = 1/(α−1) itself (relative 6e-8), which moves log p by
    # δe·dlog p/dz — large right at the edge; allow that on top of a 1e-5 relative error.
    dlogp_dz = 1.0 / (p_ref**a + p_ref * (1 - p_ref) ** (a - 1))
    tol = 1e-5 + 1e-5 * np.abs(want) + 4 * 6e-8 * e * dlogp_dz
    assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want) / tol)


def test_float64_precision():
    with x64():
        for alpha in (1.3, 2.0, 5.0, 8.0, 32.0):
            z = interior(alpha, 41)
            got = np.asarray(alpha_sigmoid(jnp.asarray(z, jnp.float64), alpha))
            assert got.dtype == np.float64
            neg = z < 0  # (at z = 0 the edge-relative reference is ill-conditioned for large α)
            np.testing.assert_allclose(got[neg], implicit_sigma(z[neg], alpha), rtol=1e-12, atol=1e-300)
            pos = z > 0
            np.testing.assert_allclose(1 - got[pos], implicit_sigma(-z[pos], alpha), rtol=1e-9)
            want = ref_sigma(z, alpha)
            ok = np.minimum(want, 1 - want) ** (alpha - 1) > 1e-3  # where the τ form is conditioned
            np.testing.assert_allclose(got[ok], want[ok], rtol=1e-11)


@pytest.mark.parametrize("alpha", [1 + 1e-4, 1.01])
def test_approaches_sigmoid(alpha):
    z = np.linspace(-8, 8, 81).astype(np.float32)
    got = np.asarray(alpha_sigmoid(jnp.asarray(z), alpha))
    want = np.asarray(jax.nn.sigmoid(jnp.asarray(z)))
    if alpha - 1 < SIGMOID_TOLERANCE:
        np.testing.assert_array_equal(got, want)  # the documented sigmoid branch
    else:
        np.testing.assert_allclose(got, want, atol=5 * (alpha - 1))  # O(α − 1) deviation
        assert np.abs(got - want).max() > 1e-4  # and it is the entmax, not the sigmoid


@pytest.mark.parametrize("alpha", [1.2, 1.5, 2.0, 3.0, 8.0, 32.0])
def test_exact_zero_one_outside_support_and_symmetry(alpha):
    e = 1.0 / (alpha - 1.0)
    z = np.array([e, 1.0001 * e, 2 * e, 1e6, np.inf], np.float32)
    hi = np.asarray(alpha_sigmoid(jnp.asarray(z), alpha))
    lo = np.asarray(alpha_sigmoid(jnp.asarray(-z), alpha))
    np.testing.assert_array_equal(hi, 1.0)
    np.testing.assert_array_equal(lo, 0.0)
    assert np.all(np.isneginf(np.asarray(log_alpha_sigmoid(jnp.asarray(-z), alpha))))
    np.testing.assert_array_equal(np.asarray(log_alpha_sigmoid(jnp.asarray(z), alpha)), 0.0)
    zin = jnp.asarray(interior(alpha, 31), jnp.float32)
    np.testing.assert_allclose(alpha_sigmoid(-zin, alpha), 1 - alpha_sigmoid(zin, alpha), atol=1e-7)
    assert float(alpha_sigmoid(jnp.zeros(()), alpha)) == pytest.approx(0.5, abs=1e-7)
    s = np.asarray(alpha_sigmoid(zin, alpha))
    assert np.all(np.diff(s) >= 0) and np.all((s >= 0) & (s <= 1))
    assert np.all(np.isfinite(np.asarray(log_alpha_sigmoid(zin, alpha))))  # inside: p > 0


def test_step_function():
    z = jnp.asarray([-1.0, -1e-30, 0.0, 1e-30, 2.0])
    want = np.array([0, 0, 0, 1, 1], np.float32)  # z = 0 drops, as in the reference code
    np.testing.assert_array_equal(alpha_sigmoid(z, float("inf")), want)
    np.testing.assert_array_equal(alpha_sigmoid_step(z), want)
    np.testing.assert_array_equal(log_alpha_sigmoid(z, float("inf")), np.where(want > 0, 0.0, -np.inf))
    np.testing.assert_array_equal(jax.grad(lambda x: alpha_sigmoid(x, float("inf")).sum())(z), 0.0)


def test_traced_alpha_selects_every_branch():
    f = jax.jit(lambda x, a: (alpha_sigmoid(x, a), log_alpha_sigmoid(x, a)))
    z = jnp.linspace(-3, 3, 25)
    for alpha in (1.0, 1 + 1e-4, 1.5, 2.0, 8.0, float("inf")):
        p, lp = f(z, jnp.float32(alpha))
        np.testing.assert_allclose(p, alpha_sigmoid(z, alpha), atol=1e-7)
        np.testing.assert_allclose(lp, log_alpha_sigmoid(z, alpha), atol=1e-6)
    g = jax.jit(jax.grad(lambda x, a: jnp.sum(log_alpha_sigmoid(x, a) + alpha_sigmoid(x, a))))
    for alpha in (1.0, 1.5, 8.0, float("inf")):
        assert np.all(np.isfinite(g(z, jnp.float32(alpha))))


def test_dtypes_and_errors():
    assert alpha_sigmoid(jnp.zeros(3, jnp.bfloat16), 2.0).dtype == jnp.float32
    with pytest.raises(ValueError, match="alpha"):
        alpha_sigmoid(jnp.zeros(3), 0.5)
    with pytest.raises(ValueError, match="alpha"):
        alpha_sigmoid(jnp.zeros(3), float("nan"))
    with pytest.raises(ValueError, match="scalar"):
        jax.jit(lambda a: alpha_sigmoid(jnp.zeros(3), a))(jnp.ones(2))
    with pytest.raises(ValueError, match="floating"):
        alpha_sigmoid(jnp.zeros(3, jnp.int32), 2.0)
    with pytest.raises(ValueError, match="n_iter"):
        alpha_sigmoid(jnp.zeros(3), 2.0, n_iter=0)


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [1.0011, 1.01, 1.028, 1.5, 2.0, 3.0, 8.0, 32.0])
def test_gradient_matches_finite_differences_float64(alpha):
    with x64():
        z = jnp.asarray(interior(alpha, 23, 0.95, cap=30.0), jnp.float64)
        slope = jax.vmap(jax.grad(lambda x: alpha_sigmoid(x, alpha)))(z)
        h = 1e-7 / jnp.maximum(1.0, slope)  # σ_32 is nearly a step at 0 (slope 2^29)
        for fn in (alpha_sigmoid, log_alpha_sigmoid):
            grad = jax.vmap(jax.grad(lambda x: fn(x, alpha)))(z)
            fd = (fn(z + h, alpha) - fn(z - h, alpha)) / (2 * h)
            np.testing.assert_allclose(np.asarray(grad), np.asarray(fd), rtol=1e-5, atol=1e-8)
        # The closed-form derivative 1/(p^{α−2} + (1−p)^{α−2}), symmetric in z (use the small p).
        p = np.asarray(alpha_sigmoid(-jnp.abs(z), alpha))
        want = 1.0 / (p ** (alpha - 2) + (1 - p) ** (alpha - 2))
        np.testing.assert_allclose(np.asarray(jax.vmap(jax.grad(lambda x: alpha_sigmoid(x, alpha)))(z)),
                                   want, rtol=1e-10)


def test_gradient_float32_against_reference():
    # float32 gradient vs the float64 reference derivative computed from the reference probabilities.
    for alpha in (1.028, 2.5, 8.0):
        z = interior(alpha, 31, 0.9)
        p = implicit_sigma(-np.abs(z), alpha)  # the smaller probability; the derivative is even
        want = 1.0 / (p ** (alpha - 2) + (1 - p) ** (alpha - 2))
        got = jax.vmap(jax.grad(lambda x: alpha_sigmoid(x, alpha)))(jnp.asarray(z, jnp.float32))
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("alpha", [1.01, 1.5, 2.0, 2.5, 8.0, 32.0])
def test_gradient_zero_outside_and_finite_at_the_edge(alpha):
    e = np.float32(1.0 / (alpha - 1.0))
    up, down = np.float32(1 + 1e-6), np.float32(1 - 1e-6)
    edge = np.array([e * up, -e * up, 2 * e, -2 * e,  # outside: zero gradient
                     e, -e, np.nextafter(e, np.float32(0)), -np.nextafter(e, np.float32(0)),
                     e * down, -e * down, 0.0], np.float32)
    for fn in (alpha_sigmoid, log_alpha_sigmoid):
        g = np.asarray(jax.vmap(jax.grad(lambda x: fn(x, alpha)))(jnp.asarray(edge)))
        assert np.all(np.isfinite(g)), (fn.__name__, g)
        np.testing.assert_array_equal(g[:4], 0.0)
        assert np.all(g >= 0)
    # Through a where-masked consumer (the mask's double where) as well.
    g = jax.grad(lambda x: jnp.sum(jnp.where(x > -e, log_alpha_sigmoid(x, alpha), -92.0)))(jnp.asarray(edge))
    assert np.all(np.isfinite(np.asarray(g)))


# ---------------------------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------------------------

def test_cosine_schedule_values():
    sched = cosine_alpha_schedule()  # cosine 1 -> 8 over 25k steps (the published recipe)
    assert float(sched(0)) == pytest.approx(1.0, abs=1e-6)
    assert float(sched(1000)) == pytest.approx(1.028, abs=5e-4)
    assert float(sched(4300)) == pytest.approx(1.50, abs=5e-3)
    assert float(sched(10000)) == pytest.approx(3.42, abs=5e-3)
    assert float(sched(12500)) == pytest.approx(4.5, abs=1e-5)
    assert float(sched(20000)) == pytest.approx(7.33, abs=5e-3)
    assert float(sched(25000)) == pytest.approx(8.0, abs=1e-6)
    assert float(sched(100000)) == pytest.approx(8.0, abs=1e-6)
    # Exact formula, traced steps.
    steps = jnp.arange(0, 30000, 997)
    want = np.where(np.asarray(steps) < 25000,
                    8 + 0.5 * (1 + 1e-8 - 8) * (1 + np.cos(np.pi * np.asarray(steps) / 25000)), 8.0)
    np.testing.assert_allclose(jax.jit(sched)(steps), want, rtol=1e-6)
    with pytest.raises(ValueError):
        cosine_alpha_schedule(steps=0)
    with pytest.raises(ValueError):
        cosine_alpha_schedule(init=0.5)
    assert math.isclose(float(cosine_alpha_schedule(2.0, 4.0, 10)(5)), 3.0, rel_tol=1e-6)


# ---------------------------------------------------------------------------------------------
# Every α from 1 to ∞, against an arbitrary-precision reference
# ---------------------------------------------------------------------------------------------

ALPHA_GRID = [1.0, 1.5, 2.0, 4.0, 10.0, 50.0, 100.0, 128.0, 200.0, 1000.0, 1e4]
F32_MAX = float(np.finfo(np.float32).max)


def decimal_sigma(z: float, alpha: float):
    """(σ_α(z), log σ_α(z), dσ/dz, d log σ/dz) as floats, in 60-digit decimal arithmetic.

    The smaller class probability q = σ_α(−|z|) is the root of (1−q)^a − q^a = a·|z| (a = α − 1,
    docs/design/dcp.md §2.2), found by bisection on log q ∈ [−3000, log ½] (no underflow: decimal exponents
    reach far below 2^−(α−1) at α = 1e4). Slopes 1/(p^{α−2} + (1−p)^{α−2}) and that over p (§2.2).
    """
    import decimal

    ctx = decimal.Context(prec=60, Emin=-10**8, Emax=10**8)
    D = ctx.create_decimal
    zd = D(float(z))
    one = D(1)
    if alpha == 1.0:
        p = one / (one + (-zd).exp(ctx))
        return float(p), float(p.ln(ctx)), float(p * (one - p)), float(one - p)
    a = D(alpha) - one
    u = -abs(zd)
    if u <= -one / a:
        q = D(0)
    elif u == 0:
        q = D("0.5")
    else:
        def power(x, y):
            return (y * x.ln(ctx)).exp(ctx)

        lo, hi = D(-3000), D("0.5").ln(ctx)
        for _ in range(110):  # bracket width 3000·2^−110 ≈ 2e−30 in log q
            t = (lo + hi) / 2
            qq = t.exp(ctx)
            if power(one - qq, a) - power(qq, a) > -a * u:
                lo = t  # (1−q)^a − q^a decreases in q: the root is above
            else:
                hi = t
        q = ((lo + hi) / 2).exp(ctx)
    p = one - q if zd > 0 else q
    if q == 0:
        return float(p), (0.0 if p == 1 else -math.inf), 0.0, 0.0
    slope = one / ((D(alpha) - 2) * p.ln(ctx)).exp(ctx).__add__(((D(alpha) - 2) * (one - p).ln(ctx)).exp(ctx))
    return float(p), float(p.ln(ctx)), float(slope), float(slope / p)


def alpha_grid_points(alpha):
    """z = 0, ±tiny (float32 normal numbers), ±inside, ±just inside/outside the edge, ±5."""
    pos = [1e-37, 1e-30, 1e-10]
    if alpha > 1.0:
        e = 1.0 / (alpha - 1.0)
        pos += [1e-3 * e, 0.3 * e, 0.5 * e, 0.9 * e, (1 - 1e-3) * e, (1 + 1e-3) * e]
    pos += [0.7, 5.0]
    z = np.array(sorted(set(pos)), np.float32)
    return np.concatenate([-z[::-1], [0.0], z]).astype(np.float32)


def symmetry_points(alpha):
    """±z on a geometric grid from 1e-37 and a linear grid from 0, both to 1.2× the support edge."""
    e = 1.0 / (alpha - 1.0) if alpha > 1.0 else 30.0
    mag = np.concatenate([np.geomspace(1e-37, 1.2 * e, 300), np.linspace(0.0, 1.2 * e, 301)])
    return np.unique(np.concatenate([-mag, mag]).astype(np.float32))


@functools.lru_cache(maxsize=None)
def every_alpha_outputs(alpha):
    """(grid z, symmetry z, outputs) for the two every-α tests below, computed by ONE compiled program per α
    (each concrete α is its own program; the two tests share it instead of compiling four): on the grid z
    σ, log σ and both slopes (jit + vmap of grad); on the symmetry z σ(z) and σ(−z) (jit + vmap), log σ(z);
    σ at a 0-d zero."""
    zg, zs = alpha_grid_points(alpha), symmetry_points(alpha)
    slope = lambda fn: jax.vmap(jax.grad(lambda x: fn(x, alpha)))  # noqa: E731
    sig = jax.vmap(lambda x: alpha_sigmoid(x, alpha))

    def outputs(zg, zs):
        return dict(p=alpha_sigmoid(zg, alpha), lp=log_alpha_sigmoid(zg, alpha), dp=slope(alpha_sigmoid)(zg),
                    dlp=slope(log_alpha_sigmoid)(zg), sym_p=sig(zs), sym_p_neg=sig(-zs),
                    sym_lp=log_alpha_sigmoid(zs, alpha), half=alpha_sigmoid(jnp.zeros(()), alpha))

    out = jax.jit(outputs)(jnp.asarray(zg), jnp.asarray(zs))
    return zg, zs, {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.slow
@pytest.mark.parametrize("alpha", ALPHA_GRID)
def test_values_and_slopes_every_alpha(alpha):
    z, _, out = every_alpha_outputs(alpha)
    ref = np.array([decimal_sigma(float(x), alpha) for x in z])  # [n, 4] float64
    p_ref, lp_ref, dp_ref, dlp_ref = ref.T
    p, lp, dp, dlp = out["p"], out["lp"], out["dp"], out["dlp"]
    # Tolerances (float32 result vs the exact value at the same float32 z):
    #  p: 1.5e-7 absolute (~1 ulp of 1; the root is solved to ~1 ulp of log q, then p = 1 − q rounds);
    #  log p: 1e-5 relative (max(1, |log p|)); slopes: 1e-4 relative — the log slope at (1 − 1e-3)·e
    #  moves by ~6e-5 under the ½-ulp float32 rounding of the support edge 1/(α−1) the code uses.
    #  Exact slopes above float32's range (z = 0 and |z| < ~1e-37 for α ≳ 130, where σ_α climbs from
    #  ~0 to ~1) are returned as float32's largest finite value.
    np.testing.assert_allclose(p, p_ref, atol=1.5e-7, rtol=0)
    finite = np.isfinite(lp_ref)
    np.testing.assert_array_equal(np.isfinite(lp), finite)  # −inf exactly where σ_α = 0
    lp_err = np.abs(lp[finite] - lp_ref[finite]) / np.maximum(1.0, np.abs(lp_ref[finite]))
    assert lp_err.max() <= 1e-5, (z[finite][np.argmax(lp_err)], lp_err.max())
    for got, want in ((dp, dp_ref), (dlp, dlp_ref)):
        assert np.all(np.isfinite(got)) and np.all(got >= 0)
        np.testing.assert_allclose(got, np.minimum(want, F32_MAX), rtol=1e-4, atol=0)
    e = 1.0 / (alpha - 1.0) if alpha > 1.0 else np.inf
    outside = np.abs(z.astype(np.float64)) >= e
    assert outside.sum() >= (0 if alpha == 1.0 else 4)
    np.testing.assert_array_equal(p[outside], (z[outside] > 0).astype(np.float32))  # exact 0 / 1
    np.testing.assert_array_equal(dp[outside], 0.0)
    np.testing.assert_array_equal(dlp[outside], 0.0)
    assert p[z == 0] == 0.5


@pytest.mark.parametrize("alpha", ALPHA_GRID)
def test_symmetry_monotone_half_every_alpha(alpha):
    _, z, out = every_alpha_outputs(alpha)
    p = out["sym_p"]
    assert np.all(np.diff(p) >= 0) and p.min() >= 0 and p.max() <= 1
    np.testing.assert_allclose(out["sym_p_neg"], 1.0 - p, atol=1.2e-7, rtol=0)  # 1 ulp of 1
    assert out["half"].shape == () and float(out["half"]) == 0.5
    lp = out["sym_lp"]
    assert np.all(lp[1:] >= lp[:-1])  # (−inf entries compare fine, unlike their differences)


def test_traced_alpha_large_and_infinite():
    """A schedule to a large α: one traced computation gives the concrete-α values up to α = ∞."""
    z = jnp.asarray(alpha_grid_points(1000.0))
    f = jax.jit(lambda x, a: (alpha_sigmoid(x, a), jax.vmap(jax.grad(lambda y: log_alpha_sigmoid(y, a)))(x)))
    for alpha in (50.0, 128.0, 1000.0, 1e4, float("inf")):
        p, g = f(z, jnp.float32(alpha))
        np.testing.assert_allclose(p, alpha_sigmoid(z, alpha), atol=1.2e-7, rtol=0)
        assert np.all(np.isfinite(np.asarray(g)))


def test_alpha_to_infinity_limit():
    """σ_α(z) → 1[z > 0] for z ≠ 0 (exactly once |z| ≥ 1/(α−1)), σ_α(0) = ½ for every finite α;
    α = inf is the inference-time step function, which maps z = 0 to 0 (docs/design/dcp.md §2.5)."""
    z = jnp.asarray([-5.0, -1e-3, -1e-4, 1e-4, 1e-3, 5.0])
    step = (np.asarray(z) > 0).astype(np.float32)
    for alpha in (1e4 + 1, 1e6, 1e30):
        np.testing.assert_array_equal(alpha_sigmoid(z, alpha), step)
        assert float(alpha_sigmoid(jnp.zeros(()), alpha)) == 0.5
        assert np.isfinite(float(jax.grad(lambda x: alpha_sigmoid(x, alpha))(0.0)))
    np.testing.assert_array_equal(alpha_sigmoid(z, float("inf")), step)
    assert float(alpha_sigmoid(jnp.zeros(()), float("inf"))) == 0.0
    np.testing.assert_array_equal(jax.vmap(jax.grad(lambda x: alpha_sigmoid(x, float("inf"))))(z), 0.0)
