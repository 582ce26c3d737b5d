"""The α-sigmoid: the exact 2-class α-entmax, and the α schedule (docs/design/dcp.md §2).

    σ_α(z) = α-entmax([z, 0])₁,      α-entmax(x)_i = [(α−1)·x_i − τ]_+^{1/(α−1)},  Σ_i p_i = 1.

Closed description used here (docs/design/dcp.md §2.2): with a = α − 1 and e = 1/a,

* σ_α(z) = 0 exactly for z ≤ −e and 1 exactly for z ≥ e (the support edge);
* inside, p = σ_α(z) is the unique root in (0, 1) of  g(p) = (p^a − (1−p)^a)/a = z;
* σ_α(−z) = 1 − σ_α(z); α → 1 gives the logistic sigmoid, α = 2 sparsemax (clip((z+1)/2, 0, 1)),
  α → ∞ the step function;
* dp/dz = 1 / (p^{α−2} + (1−p)^{α−2}) inside the support, 0 outside.

Numerics. The root is found by bisection (``lax.fori_loop``, 30 iterations in float32) on s = log q,
where q = σ_α(−|z|) ≤ ½ is the *smaller* of the two class probabilities, with the comparison
g(eˢ) < u written in one of two rearranged forms that keep every term's relative precision and stay
in range for every α (near q = ½ the powers q^{α−1}, (1−q)^{α−1} ≈ 2^{1−α} underflow float32 from
α ≈ 128 on, so the centre form works in log space):

    centre (|z| ≤ e/2):  (α−1)·log(1−q) + log(1 − e^{(α−1)·logit q})  vs  log((α−1)·|z|)
    tail   (|z| > e/2):  (q^{α−1} − expm1((α−1)·log1p(−q)))/(α−1)    vs  e − |z|  (exact, Sterbenz)

and polished by one Newton step on the same residual. Bisecting on log q keeps a relative (not
absolute) precision for tiny keep probabilities, so ``log_alpha_sigmoid`` — what the context-pruning
mask needs — is accurate far into the tail; p = 1 − q is used for z > 0, and σ_α(0) = ½ exactly.
α = 2 uses the closed form clip((z+1)/2, 0, 1) when α is concrete. When α − 1 < 1e-3
(float32(1 + 1e-8) == 1, the fp32 pitfall of the reference schedule, §2.4) the bisection is
replaced by ``jax.nn.sigmoid``, whose deviation from σ_α is then O(α−1).

Large α and the limit α → ∞. For z ≠ 0, σ_α(z) is exactly 1[z > 0] as soon as |z| ≥ 1/(α−1); σ_α(0)
= ½ for every finite α; inside the shrinking window σ_α climbs from 0 to 1 ever more steeply (the
slope at 0 is 2^{α−3}). So the pointwise limit is the step function with value ½ at 0. ``alpha = inf``
gives the inference-time step function z > 0 of the reference code (§2.5), which maps z = 0 to 0
("drop") so that the dense mask and the decode cache's keep decision agree exactly.

Gradients come from a ``jax.custom_jvp`` (no differentiation through the loop), evaluated in log
space; they are exactly 0 outside the support, and where the exact slope exceeds the dtype's range
(float32: only |z| ≲ 1e-37 for α ≳ 130, including z = 0) it is capped at the dtype's largest finite
value. No gradient flows to α, which is a schedule, not a parameter (as in the reference code).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

SIGMOID_TOLERANCE = 1e-3
"""Below α − 1 = 1e-3, σ_α is computed as ``jax.nn.sigmoid``."""

DEFAULT_N_ITER_F32 = 30
DEFAULT_N_ITER_F64 = 64


def _compute_dtype(x: jax.Array):
    """float32 for every float input narrower than 64 bits; float64 stays float64 (x64 tests)."""
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def _check_alpha(alpha: Any) -> tuple[jax.Array | None, float | None]:
    """Return (traced alpha, concrete value or None); raise for a concrete invalid alpha."""
    try:
        value = float(alpha)  # Python numbers and concrete scalar arrays
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        value = None
    if value is not None:
        if math.isnan(value) or value < 1.0:
            raise ValueError(f"alpha must be >= 1 (or inf for the step function), got {value}")
        return None, value
    alpha = jnp.asarray(alpha)
    if alpha.shape != ():
        raise ValueError(f"alpha must be a scalar, got shape {alpha.shape}")
    return alpha, None


def _log1mexp(x: jax.Array) -> jax.Array:
    """log(1 − eˣ) for x ≤ 0, accurate on the whole range (−inf at x = 0)."""
    return jnp.where(x > -math.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def _bisect_log_smaller(u: jax.Array, a: jax.Array, n_iter: int) -> tuple[jax.Array, jax.Array]:
    """log q with q = σ_α(u), for u ≤ 0 strictly inside the support (u > −1/a), by bisection on log q.

    The root of g(q) = (q^a − (1−q)^a)/a = u lies in s = log q ∈ (−∞, log ½]. Two algebraically equal
    forms of the comparison "g(eˢ) < u" keep every term's relative precision and stay in range for
    every a (no term underflows, e.g. (1−q)^a ≈ 2^−a near q = ½ for large α):

    * centre (u ≥ −e/2, e = 1/a), in log space:
          a·log(1−q) + log(1 − e^{a·logit q})  >  log(−a·u)
      (stable near α = 1, near q = ½, and for α → ∞, where the a·log(1−q) term is O(a));
    * tail (u < −e/2):  g + e = (q^a − expm1(a·log1p(−q))) / a  <  u + e  (u + e exact by Sterbenz),
      so q keeps its relative precision right up to the support edge.

    The bracket starts at lo, a log below the dtype's smallest subnormal; roots under it (q
    underflows) are reported by the returned ``underflow`` mask. After ``n_iter`` halvings one
    Newton step on the same residual (clipped to the final bracket) polishes the root.

    Returns:
      (log q, underflow): same shape as u.
    """
    dtype = u.dtype
    lo_value = -105.0 if dtype == jnp.float32 else -746.0  # exp(lo) underflows to 0 in the dtype
    edge = 1.0 / a
    tail = u < -0.5 * edge
    # Centre target log(−a·u) (−inf at u = 0, where the root is log ½); tail target u + e.
    target = jnp.where(tail, u + edge, jnp.log(-a * u))

    def residual(s):
        """Increasing in s in both forms; the root is where it crosses 0."""
        l1q = jnp.log1p(-jnp.exp(s))
        centre = target - (a * l1q + _log1mexp(a * (s - l1q)))
        tail_form = (jnp.exp(a * s) - jnp.expm1(a * l1q)) / a - target
        return jnp.where(tail, tail_form, centre)

    def dresidual_ds(s):
        q = jnp.exp(s)
        l1q = jnp.log1p(-q)
        # centre: (a/(1−q))·(q + 1/expm1(−a·logit q));  tail: q·dg/dq = q^{α−1} + q·(1−q)^{α−2}
        centre = a / (1.0 - q) * (q + 1.0 / jnp.expm1(-a * (s - l1q)))
        tail_form = jnp.exp(a * s) + jnp.exp(s + (a - 1.0) * l1q)
        return jnp.where(tail, tail_form, centre)

    lo = jnp.full(u.shape, lo_value, dtype)
    hi = jnp.full(u.shape, -math.log(2.0), dtype)
    underflow = residual(lo) >= 0

    def body(_, bracket):
        lo, hi = bracket
        mid = 0.5 * (lo + hi)
        below = residual(mid) < 0  # the root is above mid
        return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

    lo, hi = lax.fori_loop(0, n_iter, body, (lo, hi))
    mid = 0.5 * (lo + hi)
    newton = mid - residual(mid) / dresidual_ds(mid)
    return jnp.clip(jnp.where(jnp.isfinite(newton), newton, mid), lo, hi), underflow


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _entmax2(x: jax.Array, alpha: jax.Array, n_iter: int) -> tuple[jax.Array, jax.Array]:
    """(p, log p) for finite α with α − 1 ≥ SIGMOID_TOLERANCE; x in the compute dtype, alpha scalar."""
    p, logp, _ = _entmax2_parts(x, alpha, n_iter)
    return p, logp


@functools.partial(jax.jit, static_argnums=2)  # one compilation per shape, whatever the α
def _entmax2_parts(x, alpha, n_iter):
    a = (alpha - 1.0).astype(x.dtype)
    edge = 1.0 / a
    u = -jnp.abs(x)
    centre = u == 0  # σ_α(0) = ½ exactly, by symmetry (also where 1/a underflows)
    inside = (u > -edge) & ~centre
    u_safe = jnp.where(inside, u, -0.25 * edge)  # any interior point; result is discarded
    log_q, underflow = _bisect_log_smaller(u_safe, a, n_iter)
    inside = inside & ~underflow  # q below the smallest subnormal: exactly 0, like outside
    log_q = jnp.where(centre, -math.log(2.0), log_q)
    inside = inside | centre
    q = jnp.where(inside, jnp.exp(log_q), 0.0)
    log_q = jnp.where(inside, log_q, -jnp.inf)
    log_1mq = jnp.log1p(-q)
    pos = x > 0
    p = jnp.where(pos, 1.0 - q, q)
    logp = jnp.where(pos, log_1mq, log_q)
    log1mp = jnp.where(pos, log_q, log_1mq)
    return p, logp, (inside, log1mp, a)


@_entmax2.defjvp
def _entmax2_defjvp(n_iter, primals, tangents):
    x, alpha = primals
    dx, _ = tangents  # no gradient flows to alpha (a schedule)
    p, logp, (inside, log1mp, a) = _entmax2_parts(x, alpha, n_iter)
    lp = jnp.where(inside, logp, -math.log(2.0))
    l1mp = jnp.where(inside, log1mp, -math.log(2.0))
    b = a - 1.0  # α − 2
    # dp/dz = 1 / (p^{α−2} + (1−p)^{α−2});   d log p/dz = (dp/dz)/p = 1 / (p^{α−1} + p·(1−p)^{α−2}),
    # in log space (the powers underflow for large α) and capped at the dtype's largest finite value
    # (reached only where σ_α climbs from ~0 to ~1 within |z| ≲ 1e-38, e.g. at z = 0 for α ≳ 130).
    big = jnp.finfo(x.dtype).max
    dp_dz = jnp.minimum(jnp.exp(-jnp.logaddexp(b * lp, b * l1mp)), big)
    dlogp_dz = jnp.minimum(jnp.exp(-jnp.logaddexp(a * lp, lp + b * l1mp)), big)
    zero = jnp.zeros_like(x)
    dp_dz, dlogp_dz = jnp.where(inside, dp_dz, zero), jnp.where(inside, dlogp_dz, zero)  # 0 outside
    return (p, logp), (dp_dz * dx, dlogp_dz * dx)


def _alpha_sigmoid_both(x, alpha, n_iter):
    """(p, log p) of σ_α(x) for any valid alpha (Python/concrete or traced)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array, got {x.dtype}")
    dtype = _compute_dtype(x)
    x = x.astype(dtype)
    if n_iter is None:
        n_iter = DEFAULT_N_ITER_F64 if dtype == jnp.float64 else DEFAULT_N_ITER_F32
    if not isinstance(n_iter, int) or n_iter <= 0:
        raise ValueError(f"n_iter must be a positive int, got {n_iter!r}")
    traced, value = _check_alpha(alpha)

    def step():
        keep = x > 0
        return keep.astype(dtype), jnp.where(keep, 0.0, -jnp.inf).astype(dtype)

    def sigmoid():
        return jax.nn.sigmoid(x), jax.nn.log_sigmoid(x)

    def sparsemax():  # α = 2 closed form clip((x+1)/2, 0, 1); slopes ½ and 1/(x+1) inside, 0 outside
        inside = jnp.abs(x) < 1.0
        p = jnp.where(inside, 0.5 * (x + 1.0), jnp.where(x > 0, 1.0, 0.0).astype(dtype))
        return p, jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)

    if value is not None:  # concrete alpha: pick one branch at trace time
        if math.isinf(value):
            return step()
        if value - 1.0 < SIGMOID_TOLERANCE:
            return sigmoid()
        if value == 2.0:
            return sparsemax()
        return _entmax2(x, jnp.asarray(value, dtype), n_iter)

    # Traced alpha (scheduled during training): every branch runs; safe alphas keep them finite.
    alpha = lax.stop_gradient(traced.astype(dtype))
    is_inf = jnp.isinf(alpha)
    is_sig = (alpha - 1.0 < SIGMOID_TOLERANCE) & ~is_inf
    alpha_safe = jnp.where(is_inf | is_sig, jnp.asarray(2.0, dtype), alpha)
    p_e, lp_e = _entmax2(x, alpha_safe, n_iter)
    p_s, lp_s = sigmoid()
    p_t, lp_t = step()
    p = jnp.where(is_inf, p_t, jnp.where(is_sig, p_s, p_e))
    logp = jnp.where(is_inf, lp_t, jnp.where(is_sig, lp_s, lp_e))
    return p, logp


def alpha_sigmoid(x: jax.Array, alpha: Any, *, n_iter: int | None = None) -> jax.Array:
    """σ_α(x) = α-entmax([x, 0])₁, the keep probability of Dynamic Context Pruning (docs/design/dcp.md §2).

    Exact 2-class α-entmax: 0 exactly for x ≤ −1/(α−1), 1 exactly for x ≥ 1/(α−1), otherwise the
    root p ∈ (0, 1) of (p^{α−1} − (1−p)^{α−1})/(α−1) = x (found by bisection, §2.2/§2.6).

    Args:
      x: float array of any shape (float32 recommended; bfloat16/float16 are computed in float32,
        float64 stays float64 with 64 bisection iterations).
      alpha: α ≥ 1. A Python float, a concrete scalar, or a *traced* scalar (scheduled during
        training, no recompile per value). ``float('inf')`` selects the inference step function
        (x > 0). For α − 1 < 1e-3 the result is ``jax.nn.sigmoid(x)`` (the α → 1 limit; the error is
        O(α − 1)). A traced alpha cannot be validated: values below 1 give the sigmoid too, NaN
        gives NaN; with a traced alpha all three branches are computed and one is selected.
      n_iter: bisection iterations; default 30 for float32 (relative precision ~1e-7 in the smaller
        class probability), 64 for float64.

    Returns:
      Array of x's shape, float32 (float64 for float64 input), in [0, 1]; values that underflow the
      dtype are exactly 0 (derivative 0).
      Differentiable in x: dσ/dx = 1/(σ^{α−2} + (1−σ)^{α−2}) inside the support (capped at the
      dtype's largest finite value, reached near z = 0 for α ≳ 130 in float32), 0 outside and for
      the step function. No gradient flows to alpha. Valid for every α ≥ 1: σ_α(0) = ½ for finite
      α, and alpha = inf (step, z = 0 → 0) is the α → ∞ limit away from z = 0.

    Raises:
      ValueError: x not floating point; alpha concrete and < 1 or NaN; alpha not a scalar;
        n_iter not a positive int.
    """
    return _alpha_sigmoid_both(x, alpha, n_iter)[0]


def log_alpha_sigmoid(x: jax.Array, alpha: Any, *, n_iter: int | None = None) -> jax.Array:
    """log σ_α(x), accurate in the tail (the log keep probability of the DCP mask, docs/design/dcp.md §1.5).

    Same arguments, dtypes and errors as ``alpha_sigmoid``. Returns −inf exactly where σ_α(x) = 0
    (x ≤ −1/(α−1), or x ≤ 0 for α = inf) or where σ_α(x) underflows the dtype (below ~1e-45 in
    float32, log σ < −103), with a zero derivative there. Inside the support
    d log σ/dx = 1/(σ^{α−1} + σ·(1−σ)^{α−2}), computed from log σ so it stays finite (it grows like
    1/((α−1)(x + 1/(α−1))) towards the lower support edge, as the exact derivative does).
    """
    return _alpha_sigmoid_both(x, alpha, n_iter)[1]


def alpha_sigmoid_step(x: jax.Array) -> jax.Array:
    """The inference-time keep decision σ_∞(x) = 1[x > 0] as float32 (docs/design/dcp.md §2.5).

    x = 0 maps to 0 ("drop"), as in the reference code. Gradient 0.
    """
    return alpha_sigmoid(x, float("inf"))


def cosine_alpha_schedule(init: float = 1.0, final: float = 8.0, steps: int = 25000,
                          *, init_offset: float = 1e-8) -> Callable[[Any], jax.Array]:
    """Cosine α schedule of the reference code's ``cosine_1_8_25000`` (docs/design/dcp.md §2.4), optax style.

        α(s) = final + ½·(init + init_offset − final)·(1 + cos(π·s/steps))   for s < steps,
        α(s) = final                                                           for s ≥ steps.

    Sample values (defaults): α(1000) = 1.028, α(4300) = 1.50, α(10000) = 3.42, α(12500) = 4.5,
    α(25000) = 8. ``init_offset`` is the code's 1e-8, which float32 rounds away; α − 1 < 1e-3 is
    handled by ``alpha_sigmoid`` as the plain sigmoid, so the offset is harmless either way.

    Args:
      init, final: α at step 0 and from ``steps`` on (init ≥ 1).
      steps: length of the cosine ramp (> 0).
      init_offset: added to ``init`` (the reference code's 1e-8).

    Returns:
      ``schedule(step) -> alpha``: step an int or int array (traced is fine); returns float32 α.

    Raises:
      ValueError: steps ≤ 0 or init < 1 or final < 1.
    """
    if not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if init < 1.0 or final < 1.0:
        raise ValueError(f"init and final must be >= 1, got init={init}, final={final}")
    start = float(init) + float(init_offset)

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        frac = jnp.clip(s / steps, 0.0, 1.0)
        return (final + 0.5 * (start - final) * (1.0 + jnp.cos(jnp.pi * frac))).astype(jnp.float32)

    return schedule
