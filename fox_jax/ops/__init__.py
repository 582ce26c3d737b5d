"""Pure ops: forgetting attention (public op, dense reference, ACP helpers)."""

from fox_jax.ops import acp
from fox_jax.ops.forgetting_attention import IMPLEMENTATIONS, forgetting_attention
from fox_jax.ops.reference import attention_mask, decay_cumsum, forgetting_attention_reference

__all__ = [
    "IMPLEMENTATIONS",
    "acp",
    "attention_mask",
    "decay_cumsum",
    "forgetting_attention",
    "forgetting_attention_reference",
]
