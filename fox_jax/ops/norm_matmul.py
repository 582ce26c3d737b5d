"""A row norm, the projections that read it and their activation, as one op: ``norm_matmul``, and ``RowNorm``.

A decode step multiplies B rows by each weight matrix, and on a GPU each kernel of it costs ~2–3 µs whatever its
work (benchmarks/NOTES.md "Decode GEMMs against their floor"): the norm before a block's input projections and the
MLP's activation after them were kernels of their own. ``norm_matmul`` takes the rows before their norm
(``RowNorm``: the norm as data, made by ``fox_jax.nn.layers.RMSNorm`` / ``LayerNorm`` with ``lazy=True``) and runs
norm, matmul, bias and activation in one Pallas kernel (kernels/norm_matmul.py) on a GPU when the rows are few, and
as the same XLA ops the modules run otherwise.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from fox_jax.kernels import norm_matmul as nk

NORM_MATMUL_IMPLEMENTATIONS = ("auto", "xla", "pallas")
MAX_KERNEL_ROWS = 64  # "auto" runs the kernel up to this many rows (a decode step); a prefill chunk is a GEMM's work


@flax.struct.dataclass
class RowNorm:
    """A norm over the last axis, not yet applied: the rows ``x`` and what normalises them.

    ``value()`` is the norm as ``fox_jax.nn.layers.RMSNorm`` / ``LayerNorm`` compute it (float32, rounded to
    ``dtype``); ``norm_matmul`` can apply it inside the matmul that reads it instead.

    Attributes:
      x: [..., d] the rows (any float dtype).
      scale: [d] float32. bias: [d] float32 ("layer") or None.
      kind: "rms" (x / sqrt(mean(x²) + eps) · scale) or "layer" ((x − mean) / sqrt(var + eps) · scale + bias,
        var = mean((x − mean)²)), static. eps: static. dtype: the normed rows' dtype, static.
    """

    x: jax.Array
    scale: jax.Array
    bias: jax.Array | None = None
    kind: str = flax.struct.field(pytree_node=False, default="rms")
    eps: float = flax.struct.field(pytree_node=False, default=1e-6)
    dtype: Any = flax.struct.field(pytree_node=False, default=jnp.float32)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.x.shape

    def value(self) -> jax.Array:
        """The normed rows [..., d] in ``dtype``."""
        xf = self.x.astype(jnp.float32)
        if self.kind == "rms":
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
            return (y * self.scale).astype(self.dtype)
        xc = xf - jnp.mean(xf, axis=-1, keepdims=True)
        y = xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale + self.bias).astype(self.dtype)


def _xla(x, weights, dtype, activation):
    """The modules' ops: (norm), one matmul of the concatenated kernels in ``dtype``, + bias, activation."""
    xn = x.value() if isinstance(x, RowNorm) else x.astype(dtype)
    kernel = jnp.concatenate([w.astype(dtype) for w, _ in weights], axis=1) if len(weights) > 1 \
        else weights[0][0].astype(dtype)
    y = jax.lax.dot_general(xn.astype(dtype), kernel, (((xn.ndim - 1,), (0,)), ((), ())))
    if any(b is not None for _, b in weights):
        y = y + jnp.concatenate([jnp.zeros((w.shape[1],), dtype) if b is None else b.astype(dtype)
                                 for w, b in weights])
    if activation == "gelu_tanh":
        y = jax.nn.gelu(y, approximate=True)
    elif activation == "swiglu":
        hidden = y.shape[-1] // 2
        y = jax.nn.silu(y[..., :hidden]) * y[..., hidden:]
    return y, xn.astype(dtype)


def kernel_supported(x, weights, dtype, activation) -> str | None:
    """None when the Pallas kernel takes this call, else what it needs."""
    if jax.default_backend() != "gpu":
        return f"a GPU (the backend is {jax.default_backend()!r})"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"a bfloat16 or float16 compute dtype (got {jnp.dtype(dtype).name})"
    rows = math.prod(x.shape[:-1])
    if rows > MAX_KERNEL_ROWS:
        return f"at most {MAX_KERNEL_ROWS} rows (got {rows})"
    if nk.default_matmul_config(x.shape[-1], tuple(w.shape[1] for w, _ in weights), activation) is None:
        return "d_in and every output width (for swiglu, half of it) multiples of 16"
    return None


def norm_matmul(x: jax.Array | RowNorm, weights: list[tuple], dtype, *, activation: str | None = None,
                implementation: str = "auto", config: nk.MatmulConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """``act(norm(x) · [W_1 … W_P] + [b_1 … b_P])`` with the norm, the matmul and the activation in one kernel.

    The same numbers as the modules' ops (``RowNorm.value()``, ``fused_dense``'s one matmul of the concatenated
    kernels in ``dtype``, the bias in ``dtype``, the activation) up to float32 summation order and the rounding of
    intermediate results to ``dtype`` (the kernel keeps the activation's inputs in float32 after rounding them).

    Args:
      x: [..., d] rows, or a ``RowNorm`` of them (the norm applied first).
      weights: P pairs (kernel [d, n_i] float, bias [n_i] float or None), as ``fox_jax.nn.layers.DenseParams``
        returns them; the output's columns are theirs in order (no concatenation is made on the kernel's path).
      dtype: the compute dtype (the matmul's inputs and the outputs).
      activation: None; "gelu_tanh" (GPT-2's GELU); "swiglu": silu(y[..., :H]) ⊙ y[..., H:] of a single
        weight of 2H columns (gate, then up), as ``fox_jax.nn.layers.swiglu``.
      implementation: "auto" (the Pallas kernel on a GPU when ``kernel_supported``, else "xla"), "xla" or
        "pallas" (interpret mode off GPU: for tests).
      config: the kernel's tiling (default ``default_matmul_config``).
    Returns:
      (y [..., N] in ``dtype``, N = Σ n_i or H for "swiglu"; the normed rows [..., d] in ``dtype``: x itself cast
      when x is not a ``RowNorm``).
    Raises:
      ValueError: an unknown implementation or activation; "swiglu" with more than one weight or an odd width;
        weights whose input size is not d; "pallas" with shapes no tiling fits.
    """
    if implementation not in NORM_MATMUL_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {NORM_MATMUL_IMPLEMENTATIONS}, got {implementation!r}")
    if activation not in nk.ACTIVATIONS:
        raise ValueError(f"activation must be one of {nk.ACTIVATIONS}, got {activation!r}")
    if not weights:
        raise ValueError("norm_matmul needs at least one weight")
    d = x.shape[-1]
    if any(w.shape[0] != d for w, _ in weights):
        raise ValueError(f"every kernel must be [{d}, n] for rows of {d} features, got "
                         f"{[tuple(w.shape) for w, _ in weights]}")
    if activation == "swiglu" and (len(weights) != 1 or weights[0][0].shape[1] % 2):
        raise ValueError("activation='swiglu' takes one weight of 2H columns (gate, then up), got widths "
                         f"{[w.shape[1] for w, _ in weights]}")
    if implementation == "auto":
        implementation = "pallas" if kernel_supported(x, weights, dtype, activation) is None else "xla"
    if implementation == "xla":
        return _xla(x, weights, dtype, activation)
    widths = tuple(w.shape[1] for w, _ in weights)
    config = config or nk.default_matmul_config(d, widths, activation)
    if config is None:
        raise ValueError(f"implementation='pallas' needs d_in and every output width (for swiglu, half of it) "
                         f"multiples of 16, got d_in {d}, widths {widths}")
    rows = x.x if isinstance(x, RowNorm) else x
    lead = rows.shape[:-1]
    norm = x.kind if isinstance(x, RowNorm) else None
    y, xn = nk.norm_matmul(
        rows.reshape(-1, d), tuple(w.astype(dtype) for w, _ in weights), tuple(b for _, b in weights),
        x.scale if norm else None, x.bias if norm == "layer" else None, norm=norm,
        eps=float(x.eps) if norm else 1e-6, activation=activation, config=config, out_dtype=jnp.dtype(dtype),
        write_normed=True, interpret=jax.default_backend() != "gpu")
    return y.reshape(*lead, y.shape[-1]), xn.reshape(*lead, d)


__all__ = ["MAX_KERNEL_ROWS", "NORM_MATMUL_IMPLEMENTATIONS", "RowNorm", "kernel_supported", "norm_matmul"]
