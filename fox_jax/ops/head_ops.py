"""The per-head work of an attention layer around its attention op: ``HeadOps`` and its XLA forms.

Before attention (the prologue, docs/design/fox_acp.md §2.3, FoX Pro): the KV-shift of k and v (FoX paper
Eq. 14), the QK RMSNorm over head_dim, RoPE. After attention (the epilogue): the output RMSNorm over head_dim
and the output gate σ(g). Every step is local to one (token, head), so a decode step can do them all inside its
attention kernel (``fox_jax.ops.decode_attention.decode_attention_append(..., step=)``; the Pallas kernel
of kernels/decode_attention.py): the layer hands the raw projections and a ``HeadOps``, and the caches
(``fox_jax.cache.slots.slot_attention``) apply it with ``head_prologue`` / ``head_epilogue`` wherever the kernel
does not. The layer without a cache calls the same two functions, so the math has one XLA form.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from fox_jax.ops._common import dot_precision


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
    """r = rsqrt(mean(x²) + eps) over the last axis: [..., 1] float32 (RMSNorm's row scale, Zhang & Sennrich 2019)."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: Any) -> jax.Array:
    """y = x / sqrt(mean(x²) + eps) · scale over the last axis, in float32, returned in ``dtype``.

    x: [..., D] any float dtype; scale: broadcastable to x (e.g. [H, D] per head or [D] shared), float32."""
    return (x.astype(jnp.float32) * rms_scale(x, eps) * scale).astype(dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float, dtype: Any) -> jax.Array:
    """y = (x − mean(x)) / sqrt(mean((x − mean(x))²) + eps) · scale + bias over the last axis (Ba et al. 2016), in
    float32 with the variance taken in two passes over the centred x, returned in ``dtype``. x: [..., D] any float
    dtype; scale, bias: [D] float32."""
    xf = x.astype(jnp.float32)
    xc = xf - jnp.mean(xf, axis=-1, keepdims=True)
    y = xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
    return (y * scale + bias).astype(dtype)


def kv_shift(raw: jax.Array, alpha: jax.Array, *, state: jax.Array | None = None,
             segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Data-dependent token shift (FoX Pro "KV-shift", paper Eq. 14):

        x_t = α_t · x̃_{t−1} + (1 − α_t) · x̃_t,   x̃_{−1} = ``state`` (zeros by default)

    computed in float32 and rounded to raw's dtype once. Its backward is written out (``_shift_mix``):
    dα_t = Σ_d g_t·(x̃_{t−1} − x̃_t) as one plain reduction over x̃ and x̃_{t−1} materialised (one reduction, where
    autodiff takes two; g in the output's dtype, as JAX defines the cotangent of a bf16 output) and dx̃ in float32,
    rounded once.

    Args:
      raw: [B, T, H, D] unshifted projections x̃.
      alpha: [B, T, H] float32 mixing weights in (0, 1).
      state: [B, H, D] the unshifted projection of the token before this chunk (a continuation that
        starts from the state of the previous chunk equals one pass over both), or None for zeros.
      segment_ids: [B, T] int or None: the shift never crosses a document boundary (the first token of
        a segment sees zeros; the first token of the chunk sees ``state``).
    Returns:
      (shifted [B, T, H, D] in raw's dtype, new state [B, H, D] = raw[:, -1]).
    """
    state = jnp.zeros_like(raw[:, 0]) if state is None else state.astype(raw.dtype)
    boundary = jnp.zeros(raw.shape[:2], bool) if segment_ids is None else jnp.concatenate(
        [jnp.zeros_like(segment_ids[:, :1], dtype=bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return _shift_mix(raw, alpha.astype(jnp.float32), state, boundary), raw[:, -1]


def _previous(raw: jax.Array, state: jax.Array, boundary: jax.Array) -> jax.Array:
    """x̃_{t−1} [B, T, H, D]: ``state`` before the first token, zeros where a document starts (``boundary``)."""
    prev = jnp.concatenate([state[:, None], raw[:, :-1]], axis=1)
    return jnp.where(boundary[:, :, None, None], 0, prev)


@jax.custom_vjp
def _shift_mix(raw, alpha, state, boundary):
    a = alpha[..., None]
    out = a * _previous(raw, state, boundary).astype(jnp.float32) + (1.0 - a) * raw.astype(jnp.float32)
    return jax.lax.optimization_barrier(out.astype(raw.dtype))


def _shift_mix_fwd(raw, alpha, state, boundary):
    return _shift_mix(raw, alpha, state, boundary), (raw, alpha, state, boundary)


def _shift_mix_bwd(res, g):
    raw, alpha, state, boundary = res
    # x̃ and x̃_{t−1} materialised, and the row sums fed from behind barriers: XLA otherwise fuses the shifted reads
    # into one multi-output reduction with the row sums and dx̃ (or, with x̃ alone behind a barrier, with the
    # recomputed norm that produces x̃), whose code keeps local memory per thread and loads the shifted operands
    # 16 bits at a time (benchmarks/bench_kv_shift.py; checks/train_kernels.py --ptx flags such kernels). g_rows is
    # the cotangent as JAX defines it (raw's dtype); in the fused form XLA on a GPU kept a float32 cotangent's extra
    # precision instead (dα then differs by its bf16 rounding, ~2⁻⁹ per term: benchmarks/NOTES.md, 2026-12-06)
    g_rows, raw_rows = jax.lax.optimization_barrier((g, raw))
    prev = jax.lax.optimization_barrier(_previous(raw_rows, state, boundary))
    d_alpha = jnp.sum(g_rows.astype(jnp.float32) * (prev.astype(jnp.float32) - raw_rows.astype(jnp.float32)),
                      axis=-1)
    g = g.astype(jnp.float32)
    a = alpha[..., None]
    g_prev = jnp.where(boundary[:, :, None, None], 0.0, a * g)  # the cotangent of x̃_{t−1}, which is x̃ one row up
    d_raw = (1.0 - a) * g + jnp.concatenate([g_prev[:, 1:], jnp.zeros_like(g_prev[:, :1])], axis=1)
    return d_raw.astype(raw.dtype), d_alpha, g_prev[:, 0].astype(state.dtype), None


_shift_mix.defvjp(_shift_mix_fwd, _shift_mix_bwd)


def apply_rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary embedding, non-interleaved halves (as FLA / LLaMA), computed in float32.

    Args:
      x: [B, T, H, D] with D even; positions: [B, T] int (may be negative under left padding).
    Returns:
      [B, T, H, D] in x's dtype.
    """
    d = x.shape[-1]
    inv_freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


@flax.struct.dataclass
class HeadOps:
    """What a layer does per head around attention, as data (every field optional; None: the step is absent).

    Prologue, in this order: KV-shift k_t = α_t k̃_{t−1} + (1 − α_t) k̃_t with α = σ(logit) (and the same for v),
    QK-norm q ← RMSNorm(q)·q_scale, k ← RMSNorm(k)·k_scale (eps ``qk_eps``), RoPE (``rope_base``). Epilogue:
    o ← RMSNorm(o)·o_scale (eps ``o_eps``), then o ← o · σ(o_gate). Norms and gates in float32; each result is
    rounded to the compute dtype where the layer's modules round it (after the shift, after each norm, σ(g) and
    the product).

    Attributes:
      k_shift, v_shift: [B, T, Hkv] float32 logits of the shift weights α (KV-shift), or None.
      q_scale: [H, D] or [D] float32; k_scale: [Hkv, D] or [D] float32 (QK-norm scales), or None.
      o_scale: [H, D] or [D] float32 (output norm), or None. o_gate: [B, T, H, D] logits in the compute dtype, or
        None.
      o_proj: [H, D, N] in the compute dtype, or None: the layer's output projection W_o [H·D, N] by query head,
        applied last — the epilogue then returns o·W_o [B, T, N] (float32 accumulation, in o's dtype; float32
        products at full precision) — so that a fused decode step can do it inside its kernel (each program its heads' share,
        summed by the caller: no GEMM launch of its own).
      rows: [B, T, R, D] in the compute dtype, or None: the same raw projections as one array, q (H rows), k (Hkv),
        v (Hkv), then the o_gate logits (H) (further rows ignored): the decode GEMM's output, which a kernel reads in
        place (the separate q, k, v, o_gate are slices of it: each passed on its own would be a copy). Or float32
        [S, B, T, R, D]: S partial sums of them over a split of the GEMM's inner dimension
        (``fox_jax.nn.layers.split_dense``), which the kernel adds and rounds to the compute dtype, so that the split
        needs no reduction kernel (not with ``x_norm_eps``).
      rows_bias: [R, D] in the compute dtype, or None: a bias per row of ``rows`` (not yet added there), which the
        kernel adds after the sum as ``nn.Dense`` adds its bias (in float32, rounded to the compute dtype). The
        separate q, k, v, o_gate have it already.
      gate_x, gate_weights: the float32 projections behind the shift and forget-gate logits, as data, or None: the
        layer's input x [B, T, d_in] (any float dtype) and, in column order, (kernel [d_in, n] float32, bias [n]
        float32 or None) of k_shift and v_shift (n = Hkv each, with a shift), then of the forget gates (n = H, with
        forget gates): one member per gate the layer has. A kernel computes the logits it reads (logit =
        x·kernel + bias in float32; log f = log σ(logit) is taken by the reader), so they cost no kernel of their
        own per step; ``gate_logits`` is their XLA form.
      gate_table: None, or the same projections laid out per key/value head for the decode kernel
        (``fox_jax.ops.decode_attention.gate_table``), made once before a decode loop (``gate_tables``); the kernel
        otherwise re-arranges ``gate_weights`` on every call.
      qk_eps, o_eps: the norms' eps (static). rope_base: RoPE's base, or None for no RoPE (static).
      x_norm_eps: None, or the eps of the layer's input RMSNorm, folded (static): ``rows`` and ``gate_x`` are then
        of the un-normalised x, the norm's scale s is in the weights behind them (W' = s ⊙ W, for ``gate_weights``
        and ``gate_table`` too), and their reader multiplies each row by r = rsqrt(mean(x²) + eps): RMSNorm (Zhang &
        Sennrich 2019) is a row scale times s, so RMSNorm(x)·W = r · (x · W'). The decode kernel sums r from the x
        it loads for the gate logits, so a decode step spends no norm kernel before its GEMM. The separate q, k, v, o_gate,
        k_shift and v_shift stay normalised (the XLA forms); ``gate_logits`` applies r.
    """

    k_shift: jax.Array | None = None
    v_shift: jax.Array | None = None
    q_scale: jax.Array | None = None
    k_scale: jax.Array | None = None
    o_scale: jax.Array | None = None
    o_gate: jax.Array | None = None
    o_proj: jax.Array | None = None
    rows: jax.Array | None = None
    rows_bias: jax.Array | None = None
    gate_x: jax.Array | None = None
    gate_weights: tuple | None = None
    gate_table: tuple | None = None
    qk_eps: float = flax.struct.field(pytree_node=False, default=1e-5)
    o_eps: float = flax.struct.field(pytree_node=False, default=1e-6)
    rope_base: float | None = flax.struct.field(pytree_node=False, default=None)
    x_norm_eps: float | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def shifts(self) -> bool:
        """The prologue shifts k and v (a KV-shift carry is kept between calls)."""
        return self.k_shift is not None

    def gate_logits(self, members: int) -> jax.Array:
        """The first ``members`` projections of ``gate_weights`` in XLA: [B, T, Σ n] float32, x·kernel + bias
        (float32, full precision; the kernel's columns equal these to float32 summation order); with ``x_norm_eps``
        r · (x·kernel) + bias."""
        x = self.gate_x.astype(jnp.float32)
        row_scale = 1.0 if self.x_norm_eps is None else rms_scale(x, self.x_norm_eps)
        outs = []
        for kernel, bias in self.gate_weights[:members]:
            y = row_scale * jnp.einsum("btd,dn->btn", x, kernel.astype(jnp.float32),
                                       precision=jax.lax.Precision.HIGHEST)
            outs.append(y if bias is None else y + bias.astype(jnp.float32))
        return jnp.concatenate(outs, axis=-1)


def head_prologue(ops: HeadOps, q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array | None = None,
                  segment_ids: jax.Array | None = None, state: tuple | None = None) -> tuple:
    """``ops``'s prologue in XLA: (q, k, v ready for attention, the new KV-shift state or None).

    Args:
      q: [B, T, H, D]; k, v: [B, T, Hkv, D] raw projections (compute dtype).
      positions: [B, T] int, RoPE's positions (default arange T); segment_ids: [B, T] int or None (the shift never
        crosses a boundary); state: (k̃, ṽ) [B, Hkv, D] each, the raw k and v of the token before the chunk
        (None: zeros).
    Returns:
      (q, k, v in their dtypes, (k̃, ṽ) of the chunk's last token, or None without a shift).
    """
    new_state = None  # (each step under its own name scope: profiles attribute its kernels as the modules' did)
    if ops.shifts:
        k_state, v_state = (None, None) if state is None else state
        with jax.named_scope("kv_shift"):
            k, k_last = kv_shift(k, jax.nn.sigmoid(ops.k_shift), state=k_state, segment_ids=segment_ids)
            v, v_last = kv_shift(v, jax.nn.sigmoid(ops.v_shift), state=v_state, segment_ids=segment_ids)
        new_state = (k_last, v_last)
    if ops.q_scale is not None:
        with jax.named_scope("q_norm"):
            q = rms_norm(q, ops.q_scale, ops.qk_eps, q.dtype)
    if ops.k_scale is not None:
        with jax.named_scope("k_norm"):
            k = rms_norm(k, ops.k_scale, ops.qk_eps, k.dtype)
    if ops.rope_base is not None:
        b, t = q.shape[:2]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        with jax.named_scope("rope"):
            q, k = apply_rope(q, positions, ops.rope_base), apply_rope(k, positions, ops.rope_base)
    return q, k, v, new_state


def head_epilogue(ops: HeadOps, o: jax.Array) -> jax.Array:
    """``ops``'s epilogue in XLA: o [B, T, H, D] (compute dtype) → the output norm and gate applied, same shape and
    dtype; with ``ops.o_proj`` then projected, [B, T, N] in o's dtype."""
    if ops.o_scale is not None:
        with jax.named_scope("o_norm"):
            o = rms_norm(o, ops.o_scale, ops.o_eps, o.dtype)
    if ops.o_gate is not None:
        with jax.named_scope("o_gate"):
            o = o * jax.nn.sigmoid(ops.o_gate.astype(o.dtype))
    if ops.o_proj is not None:
        with jax.named_scope("o_proj"):
            o = jnp.einsum("bthd,hdn->btn", o, ops.o_proj.astype(o.dtype), precision=dot_precision(o.dtype),
                           preferred_element_type=jnp.float32).astype(o.dtype)
    return o


__all__ = ["HeadOps", "apply_rope", "head_epilogue", "head_prologue", "kv_shift", "rms_norm"]
