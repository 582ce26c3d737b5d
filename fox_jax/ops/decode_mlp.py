"""A decode step's SwiGLU block, RMSNorm included, as one op: XLA's four kernels or one Pallas kernel.

    y = down(silu(x̂ · W_gate) ⊙ (x̂ · W_up)),   x̂ = RMSNorm(x) · s = x · rsqrt(mean(x²) + eps) · s

(the pre-norm block of ``fox_jax.models.lm.Block``: Shazeer 2020's SwiGLU after Zhang & Sennrich 2019's RMSNorm),
for the few rows of a decode step. ``implementation="pallas"`` runs ``fox_jax.kernels.decode_mlp`` (one launch,
split over the hidden axis; the partials' sum is left to XLA, which fuses it into the residual add that follows);
``"xla"`` computes it as the model writes it; ``"auto"`` picks the kernel on GPU where its tiling fits and no
mesh of several devices is ambient (a ``pallas_call`` is opaque to the SPMD partitioner), else XLA. Inference
only: the kernel has no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fox_jax.kernels import decode_mlp as km
from fox_jax.sharding import kernel_mesh

DECODE_MLP_IMPLEMENTATIONS = ("auto", "xla", "pallas")


def _xla(x, norm_scale, w_gate_up, w_down, eps: float) -> jax.Array:
    """The model's arithmetic (``RMSNorm``, ``SwiGLU``): x [N, d] → [N, d] in the weights' dtype."""
    dt = w_down.dtype
    xf = x.astype(jnp.float32)
    xn = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * norm_scale).astype(dt)
    if w_gate_up.ndim == 3:  # [2, hidden, d]
        gate, up = (jax.lax.dot_general(xn, w_gate_up[i], (((1,), (1,)), ((), ()))) for i in (0, 1))
    else:  # [d, 2·hidden]
        hidden = w_down.shape[0]
        gu = xn @ w_gate_up
        gate, up = gu[:, :hidden], gu[:, hidden:]
    return (jax.nn.silu(gate) * up) @ w_down


def resolve_decode_mlp_implementation(implementation: str, rows: int, d: int, hidden: int,
                                      config: km.MlpConfig | None) -> str:
    """``implementation`` with ``"auto"`` resolved (see the module docstring).

    Raises:
      ValueError: an unknown implementation; ``"pallas"`` for shapes the tiling does not fit.
    """
    if implementation not in DECODE_MLP_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {DECODE_MLP_IMPLEMENTATIONS}, got {implementation!r}")
    why = "d and hidden multiples of 16" if config is None else km.fits(config, rows, d, hidden)
    if implementation == "pallas" and why is not None:
        raise ValueError(f"implementation='pallas' needs {why}")
    if implementation == "auto":
        mesh = kernel_mesh()
        on_gpu = jax.default_backend() == "gpu" and (mesh is None or mesh.size == 1)
        return "pallas" if on_gpu and why is None else "xla"
    return implementation


def decode_swiglu(x: jax.Array, norm_scale: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, eps: float,
                  implementation: str = "auto", config: km.MlpConfig | None = None) -> jax.Array:
    """The pre-norm SwiGLU block of a decode step (module docstring), without the residual add.

    Args:
      x: [B, T, d] the block's residual stream (any float dtype), B·T ≤ 64 rows for the kernel.
      norm_scale: [d] float32, the RMSNorm's scale s.
      w_gate_up: [d, 2·hidden] (``SwiGLU.gate_proj`` as stored: gate columns, then up) or [2, hidden, d]
        (``swiglu_table``: each hidden unit's weights contiguous, the layout the kernel reads fastest).
      w_down: [hidden, d], the same dtype as w_gate_up: the dtype the matmuls run in and of the result.
      eps: the RMSNorm's eps.
      implementation: "auto", "xla" or "pallas" (interpret mode off GPU).
      config: the kernel's tiling (default ``default_mlp_config(d, hidden)``).
    Returns:
      [B, T, d] in w_down's dtype: the block's output before the residual add (the kernel's float32 partials summed
      and rounded once, where XLA rounds its GEMM's output).
    Raises:
      ValueError: shapes or dtypes that do not match; an unknown implementation; "pallas" where its tiling does not
        fit.
    """
    b, t, d = x.shape
    hidden = w_down.shape[0]
    want_gu = {(d, 2 * hidden), (2, hidden, d)}
    if norm_scale.shape != (d,) or w_down.shape != (hidden, d) or tuple(w_gate_up.shape) not in want_gu:
        raise ValueError(f"decode_swiglu: x [B, T, d], norm_scale [d], w_gate_up [d, 2·hidden] or [2, hidden, d] and "
                         f"w_down [hidden, d]; got x {list(x.shape)}, norm_scale {list(norm_scale.shape)}, w_gate_up "
                         f"{list(w_gate_up.shape)}, w_down {list(w_down.shape)}")
    if w_gate_up.dtype != w_down.dtype:
        raise ValueError(f"decode_swiglu: w_gate_up and w_down must share a dtype, got {w_gate_up.dtype} and "
                         f"{w_down.dtype}")
    config = config if config is not None else km.default_mlp_config(d, hidden)
    impl = resolve_decode_mlp_implementation(implementation, b * t, d, hidden, config)
    rows = x.reshape(b * t, d)
    if impl == "xla":
        y = _xla(rows, norm_scale, w_gate_up, w_down, eps)
    else:
        partials = km.swiglu_partials(rows, norm_scale, w_gate_up, w_down, eps=eps, config=config,
                                      interpret=jax.default_backend() != "gpu")
        # summed in the caller's shape: no reshape between the sum and the residual add that XLA fuses it into
        return jnp.sum(partials.reshape(-1, b, t, d), axis=0).astype(w_down.dtype)
    return y.reshape(b, t, d)


def swiglu_table(w_gate_up: jax.Array) -> jax.Array:
    """[d, 2·hidden] (gate columns, then up) → [2, hidden, d]: the layout ``decode_swiglu``'s kernel reads each
    hidden unit's weights from contiguously. Made once before a decode loop (``fox_jax.models.lm.mlp_tables``)."""
    d, n = w_gate_up.shape
    return jnp.transpose(w_gate_up.reshape(d, 2, n // 2), (1, 2, 0))


__all__ = ["DECODE_MLP_IMPLEMENTATIONS", "decode_swiglu", "resolve_decode_mlp_implementation", "swiglu_table"]
