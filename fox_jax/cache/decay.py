"""Cumulative log forget gates Λ as unevaluated float32 pairs (double-float arithmetic).

|Λ| grows without bound (−0.01 per token is −655 at 64k tokens, where float32's spacing is 6e-5, i.e. a
relative error of 1e-2 on the decay 0.01 of a neighbour), so the caches keep Λ_j = hi + lo as a float32
pair: ``accumulate_log_fgate`` adds gates with an error-free two-sum, and a decay Λ_i − Λ_j =
(hi_i − hi_j) + (lo_i − lo_j) carries ~float32 relative precision however long the sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fox_jax.kernels.decode_attention import pair_add  # the kernel's double-float add, also used in XLA


def accumulate_log_fgate(prev_hi: jax.Array, prev_lo: jax.Array, log_fgate: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Λ of each token of a chunk: Λ_t = Λ_prev + Σ_{n ≤ t} log f_n (docs/design/fox_acp.md §1.1), as pairs.

    Args:
      prev_hi, prev_lo: [B, H] float32, Λ of the token before the chunk (zeros for none).
      log_fgate: [B, T, H] float32 log forget gates of the chunk (0 for left pads).

    Returns:
      (hi, lo), each [B, T, H] float32 with Λ_t = hi + lo to ~2⁻⁴⁴ relative (a parallel prefix
      scan of ``pair_add``, O(T) work).
    """
    scanned = lax.associative_scan(pair_add, (log_fgate, jnp.zeros_like(log_fgate)), axis=1)
    return pair_add((prev_hi[:, None], prev_lo[:, None]), scanned)


__all__ = ["accumulate_log_fgate"]
