"""The LM head and the next-token cross-entropy fused, chunked over tokens (no full float32 logits).

    loss_t = logsumexp_v(z_tv) − z_t,y_t,   z_t = h_t · W   (h_t [d], W [d, V])

``lm_head_cross_entropy`` computes z chunk by chunk (a ``lax.scan`` over token chunks) as a matmul of
``h`` and ``W`` in the compute dtype with float32 accumulation and float32 output, so the [tokens, V]
float32 logits exist one chunk at a time. Its ``jax.custom_vjp`` forms, in the same chunk loop, the
unscaled logit gradient softmax(z) − onehot(y) in the compute dtype; the backward scales by the
per-token cotangent on the cheap side (dh = g · (G Wᵀ), dW = (g · h)ᵀ G) so no [tokens, V] pass
is needed there. ``padded_vocab`` gives the matmul width: V rounded up to a multiple (128 by default)
so that the matmuls run on aligned shapes; the padded columns are zero weights whose logits are
masked to −∞ (they do not change the loss or any gradient).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["lm_head_cross_entropy", "padded_head", "padded_vocab"]


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (``multiple`` ≤ 1: unchanged).

    Raises:
      ValueError: ``vocab_size`` < 1.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if multiple <= 1:
        return vocab_size
    return -(-vocab_size // multiple) * multiple


def padded_head(kernel: jax.Array, dtype, pad_multiple: int) -> jax.Array:
    """The LM-head weight [d, V] cast to ``dtype`` and zero-padded to ``padded_vocab(V, pad_multiple)``
    columns: the matmul operand of ``models.lm.LMHead`` and of ``lm_head_cross_entropy``."""
    vocab = kernel.shape[1]
    vp = padded_vocab(vocab, pad_multiple)
    w = kernel.astype(dtype)
    return jnp.pad(w, ((0, 0), (0, vp - vocab))) if vp > vocab else w


def _chunk_losses(hc, w, tc, vocab: int, with_grad: bool):
    """One chunk: hc [B, c, d], w [d, Vp] (compute dtype), tc [B, c] int32 -> (loss [B, c] float32,
    G = softmax − onehot [B, c, Vp] in hc's dtype, or None)."""
    z = jnp.einsum("bcd,dv->bcv", hc, w, preferred_element_type=jnp.float32)
    vp = w.shape[1]
    col = jax.lax.broadcasted_iota(jnp.int32, (1, 1, vp), 2)
    if vp > vocab:
        z = jnp.where(col < vocab, z, -jnp.inf)
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    lse = m + jnp.log(s)
    hit = col == tc[..., None]
    target_logit = jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
    loss = lse[..., 0] - target_logit
    if not with_grad:
        return loss, None
    g = (e / s - hit.astype(jnp.float32)).astype(hc.dtype)
    return loss, g


def _chunked(hidden, targets, chunk: int):
    """[B, T, ...] -> [n, B, chunk, ...] with T zero-padded to a multiple of ``chunk``."""
    b, t = targets.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hs = jnp.moveaxis(hidden.reshape(b, n, chunk, hidden.shape[-1]), 1, 0)
    ts = jnp.moveaxis(targets.reshape(b, n, chunk), 1, 0)
    return hs, ts, pad


def _unchunk(x, t: int):
    """[n, B, chunk, ...] -> [B, T, ...] (padding dropped)."""
    n, b, c = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(b, n * c, *x.shape[3:])[:, :t]


def _forward(hidden, kernel, targets, chunk, pad_multiple, with_grad):
    b, t, d = hidden.shape
    vocab = kernel.shape[1]
    w = padded_head(kernel, hidden.dtype, pad_multiple)
    hs, ts, _ = _chunked(hidden, targets.astype(jnp.int32), chunk)

    def body(carry, xs):
        loss, g = _chunk_losses(xs[0], w, xs[1], vocab, with_grad)
        return carry, (loss, g)

    if hs.shape[0] == 1:
        loss, g = _chunk_losses(hs[0], w, ts[0], vocab, with_grad)
        losses, grads = loss[None], None if g is None else g[None]
    else:
        _, (losses, grads) = jax.lax.scan(body, None, (hs, ts))
    return _unchunk(losses, t), w, grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_ce(hidden, kernel, targets, chunk, pad_multiple):
    return _forward(hidden, kernel, targets, chunk, pad_multiple, False)[0]


def _fused_ce_fwd(hidden, kernel, targets, chunk, pad_multiple):
    losses, w, grads = _forward(hidden, kernel, targets, chunk, pad_multiple, True)
    # the kernel's width and dtype travel as an empty array (residuals are arrays)
    return losses, (hidden, w, grads, jnp.zeros((0, kernel.shape[1]), kernel.dtype))


def _fused_ce_bwd(chunk, pad_multiple, res, dloss):
    hidden, w, grads, kernel_like = res
    vocab, kernel_dtype = kernel_like.shape[1], kernel_like.dtype
    b, t, d = hidden.shape
    g = _unchunk(grads, t)                                    # [B, T, Vp] compute dtype
    dloss = dloss.astype(jnp.float32)
    dh = jnp.einsum("btv,dv->btd", g, w, preferred_element_type=jnp.float32) * dloss[..., None]
    h_scaled = (hidden.astype(jnp.float32) * dloss[..., None]).astype(hidden.dtype)
    dw = jnp.einsum("btd,btv->dv", h_scaled, g, preferred_element_type=jnp.float32)[:, :vocab]
    return dh.astype(hidden.dtype), dw.astype(kernel_dtype), None


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def lm_head_cross_entropy(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, *,
                          chunk_size: int = 8192, pad_multiple: int = 128) -> jax.Array:
    """Per-token next-token cross-entropy of the LM head ``hidden @ kernel``, fused and chunked.

        loss[b, t] = logsumexp_v(z[b, t, v]) − z[b, t, targets[b, t]],   z = hidden · kernel

    The matmul runs in ``hidden``'s dtype (the model's compute dtype; ``kernel`` is cast to it, as
    ``flax.linen.Dense(dtype=...)`` does) with float32 accumulation and float32 logits; the softmax is
    float32. Unlike ``optax.softmax_cross_entropy_with_integer_labels(logits.astype(float32), ...)`` on
    compute-dtype logits, the logits are not rounded to the compute dtype first (with bfloat16 the
    two differ by about |z| · 2⁻⁹ per logit). Differentiable in ``hidden`` and ``kernel`` (custom VJP;
    the gradient of the kernel is accumulated in float32; ``targets`` gets none).

    Args:
      hidden: [B, T, d] final hidden states (after the final norm), float32 / bfloat16 / float16.
      kernel: [d, V] LM-head weight (float32 master weights, any float dtype).
      targets: [B, T] int token ids in [0, V) (ids outside give an undefined loss, as optax's).
      chunk_size: tokens per chunk, about (B × positions per chunk): the scan runs over chunks of
        max(1, chunk_size // B) positions (T zero-padded to a multiple; padded positions dropped).
        Peak extra memory ≈ B · positions · V_pad · 4 bytes of float32 logits per chunk, plus the
        [B, T, V_pad] logit gradient kept in the compute dtype for the backward.
      pad_multiple: the matmuls use the vocabulary padded to ``padded_vocab(V, pad_multiple)``
        (zero columns, masked out of the softmax); ≤ 1 = no padding.
    Returns:
      [B, T] float32 per-token losses.
    Raises:
      ValueError: ``hidden`` not [B, T, d], ``kernel`` not [d, V] with hidden's d, ``targets`` not [B, T],
        or ``chunk_size`` < 1.
    """
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, T, d], got shape {hidden.shape}")
    b, t, d = hidden.shape
    if kernel.ndim != 2 or kernel.shape[0] != d:
        raise ValueError(f"kernel must be [d, V] with d = {d} (hidden's last dim), got shape {kernel.shape}")
    if targets.shape != (b, t):
        raise ValueError(f"targets must be [B, T] = {(b, t)}, got shape {targets.shape}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    chunk = min(t, max(1, chunk_size // b))
    return _fused_ce(hidden, kernel, targets, chunk, int(pad_multiple))
