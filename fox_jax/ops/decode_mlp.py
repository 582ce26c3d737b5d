"""A decode step's SwiGLU block, RMSNorm included, as one op: XLA's four kernels or one Pallas kernel.

    y = down(silu(x̂ · W_gate) ⊙ (x̂ · W_up)),   x̂ = RMSNorm(x) · s = x · rsqrt(mean(x²) + eps) · s

(the pre-norm block of ``fox_jax.models.lm.Block``: Shazeer 2020's SwiGLU after Zhang & Sennrich 2019's RMSNorm),
for the few rows of a decode step. ``implementation="pallas"`` runs ``fox_jax.kernels.decode_mlp`` (one launch,
split over the hidden axis; the partials' sum is left to XLA, which fuses it into the residual add that follows);
``"xla"`` computes it as the model writes it; ``"auto"`` picks the kernel on GPU where its tiling fits and no
mesh of several devices is ambient (a ``pallas_call`` is opaque to the SPMD partitioner), else XLA. Made for
inference; under ``jax.grad`` the kernel's gradient is the XLA form's (a custom VJP).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fox_jax.kernels import decode_mlp as km
from fox_jax.ops.head_ops import rms_norm
from fox_jax.sharding import kernel_mesh

DECODE_MLP_IMPLEMENTATIONS = ("auto", "xla", "pallas")


def _xla(x, norm_scale, w_gate_up, w_down, eps: float) -> jax.Array:
    """The model's arithmetic (``RMSNorm``, ``SwiGLU``): x [N, d] → [N, d] in the weights' dtype."""
    dt = w_down.dtype
    xn = rms_norm(x, norm_scale, eps, dt)
    if w_gate_up.ndim == 3:  # [2, hidden, d]
        gate, up = (jax.lax.dot_general(xn, w_gate_up[i], (((1,), (1,)), ((), ()))) for i in (0, 1))
    else:  # [d, 2·hidden]
        hidden = w_down.shape[0]
        gu = xn @ w_gate_up
        gate, up = gu[:, :hidden], gu[:, hidden:]
    return (jax.nn.silu(gate) * up) @ w_down


def resolve_decode_mlp_implementation(implementation: str, rows: int, d: int, hidden: int,
                                      config: km.MlpConfig | None, static_eps: bool = True) -> str:
    """``implementation`` with ``"auto"`` resolved (see the module docstring; a traced eps runs XLA).

    Raises:
      ValueError: an unknown implementation; ``"pallas"`` for shapes the tiling does not fit or a traced eps.
    """
    if implementation not in DECODE_MLP_IMPLEMENTATIONS:
        raise ValueError(f"decode_swiglu: implementation must be one of {DECODE_MLP_IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    why = f"d and hidden multiples of 16 (got d = {d}, hidden = {hidden})" if config is None else km.fits(
        config, rows, d, hidden)
    if why is None and not static_eps:
        why = "eps a Python float (the kernel's constant), got a traced value"
    if implementation == "pallas" and why is not None:
        raise ValueError(f"decode_swiglu: implementation='pallas' needs {why}")
    if implementation == "auto":
        mesh = kernel_mesh()
        on_gpu = jax.default_backend() == "gpu" and (mesh is None or mesh.size == 1)
        return "pallas" if on_gpu and why is None else "xla"
    return implementation


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _pallas(rows, norm_scale, w_gate_up, w_down, eps: float, config: km.MlpConfig) -> jax.Array:
    """The kernel's partials summed: [N, d] float32. Differentiable through the XLA form's VJP (the same function)."""
    partials = km.swiglu_partials(rows, norm_scale, w_gate_up, w_down, eps=eps, config=config,
                                  interpret=jax.default_backend() != "gpu")
    return jnp.sum(partials, axis=0)


def _pallas_fwd(rows, norm_scale, w_gate_up, w_down, eps, config):
    return _pallas(rows, norm_scale, w_gate_up, w_down, eps, config), (rows, norm_scale, w_gate_up, w_down)


def _pallas_bwd(eps, config, res, dy):
    _, vjp = jax.vjp(lambda *a: _xla(*a, eps).astype(jnp.float32), *res)
    return vjp(dy)


_pallas.defvjp(_pallas_fwd, _pallas_bwd)


def decode_swiglu(x: jax.Array, norm_scale: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, eps: float,
                  implementation: str = "auto", config: km.MlpConfig | None = None) -> jax.Array:
    """The pre-norm SwiGLU block of a decode step (module docstring), without the residual add.

    Args:
      x: [B, T, d] the block's residual stream (a float dtype), B·T ≤ 64 rows for the kernel.
      norm_scale: [d] the RMSNorm's scale s (float; applied in float32).
      w_gate_up: [d, 2·hidden] (``SwiGLU.gate_proj`` as stored: gate columns, then up) or [2, hidden, d]
        (``swiglu_table``: each hidden unit's weights contiguous).
      w_down: [hidden, d], the same float dtype as w_gate_up: the dtype the matmuls run in and of the result.
      eps: the RMSNorm's eps ≥ 0; a Python float for the kernel (a traced eps runs XLA under "auto").
      implementation: "auto", "xla" or "pallas" (interpret mode off GPU).
      config: the kernel's tiling, a ``fox_jax.kernels.decode_mlp.MlpConfig`` (default
        ``default_mlp_config(d, hidden)``).
    Returns:
      [B, T, d] in w_down's dtype: the block's output before the residual add. "xla" is the model's arithmetic
      (``RMSNorm`` then ``SwiGLU``: the same values run alone; inside a larger jitted program XLA may keep excess
      precision elsewhere, an ulp of bf16); "pallas" sums the kernel's float32 partials and rounds once, where XLA
      rounds its GEMM's output. Differentiable: the kernel's gradient is the XLA form's.
    Raises:
      ValueError: shapes, ranks or dtypes that do not match, eps < 0, an unknown implementation, "pallas" where its
        tiling does not fit or eps is traced. TypeError: a config that is not an ``MlpConfig``.
    """
    if jnp.ndim(x) != 3:
        raise ValueError(f"decode_swiglu: x must be [B, T, d], got shape {list(jnp.shape(x))}")
    b, t, d = x.shape
    if jnp.ndim(w_down) != 2:
        raise ValueError(f"decode_swiglu: w_down must be [hidden, d], got shape {list(jnp.shape(w_down))}")
    hidden = w_down.shape[0]
    want_gu = {(d, 2 * hidden), (2, hidden, d)}
    if jnp.shape(norm_scale) != (d,) or w_down.shape != (hidden, d) or tuple(w_gate_up.shape) not in want_gu:
        raise ValueError(f"decode_swiglu: x [B, T, d], norm_scale [d], w_gate_up [d, 2·hidden] or [2, hidden, d] and "
                         f"w_down [hidden, d]; got x {list(x.shape)}, norm_scale {list(jnp.shape(norm_scale))}, "
                         f"w_gate_up {list(w_gate_up.shape)}, w_down {list(w_down.shape)}")
    for name, a in (("x", x), ("norm_scale", norm_scale), ("w_down", w_down)):
        if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
            raise ValueError(f"decode_swiglu: {name} must be a float array, got {jnp.result_type(a)}")
    if w_gate_up.dtype != w_down.dtype:
        raise ValueError(f"decode_swiglu: w_gate_up and w_down must share a dtype, got {w_gate_up.dtype} and "
                         f"{w_down.dtype}")
    static_eps = isinstance(eps, (int, float))
    if static_eps and not eps >= 0:
        raise ValueError(f"decode_swiglu: eps must be ≥ 0, got {eps}")
    if config is not None and not isinstance(config, km.MlpConfig):
        raise TypeError(f"decode_swiglu: config must be a fox_jax.kernels.decode_mlp.MlpConfig, got "
                        f"{type(config).__name__}")
    config = config if config is not None else km.default_mlp_config(d, hidden)
    impl = resolve_decode_mlp_implementation(implementation, b * t, d, hidden, config, static_eps)
    rows = x.reshape(b * t, d)
    norm_scale = norm_scale.astype(jnp.float32)
    if impl == "xla":
        return _xla(rows, norm_scale, w_gate_up, w_down, eps).reshape(b, t, d)
    return _pallas(rows, norm_scale, w_gate_up, w_down, float(eps), config).reshape(b, t, d).astype(w_down.dtype)


def swiglu_table(w_gate_up: jax.Array) -> jax.Array:
    """[d, 2·hidden] (gate columns, then up) → [2, hidden, d]: the layout ``decode_swiglu``'s kernel reads each
    hidden unit's weights from contiguously. Made once before a decode loop (``fox_jax.models.lm.mlp_tables``)."""
    d, n = w_gate_up.shape
    return jnp.transpose(w_gate_up.reshape(d, 2, n // 2), (1, 2, 0))


__all__ = ["DECODE_MLP_IMPLEMENTATIONS", "decode_swiglu", "resolve_decode_mlp_implementation", "swiglu_table"]
