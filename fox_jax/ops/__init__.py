"""Pure ops: forgetting attention (public op, dense reference, ACP helpers), decode attention over a ring cache, and
the per-head work around attention (``HeadOps``)."""

from fox_jax.ops import acp, context_pruning, tiles
from fox_jax.ops.alpha_sigmoid import alpha_sigmoid, alpha_sigmoid_step, cosine_alpha_schedule
from fox_jax.ops.decode_attention import (DECODE_IMPLEMENTATIONS, AppendResult, DecodeStep, PinnedSlots,
                                          decode_attention, decode_attention_append)
from fox_jax.ops.forgetting_attention import (IMPLEMENTATIONS, forgetting_attention, resolve_implementation,
                                              sharded_attention)
from fox_jax.ops.head_ops import HeadOps, head_epilogue, head_prologue
from fox_jax.ops.reference import (attention_mask, decay_cumsum, decode_attention_reference,
                                   forgetting_attention_reference)

__all__ = [
    "AppendResult",
    "DECODE_IMPLEMENTATIONS",
    "DecodeStep",
    "HeadOps",
    "IMPLEMENTATIONS",
    "PinnedSlots",
    "acp",
    "alpha_sigmoid",
    "alpha_sigmoid_step",
    "context_pruning",
    "cosine_alpha_schedule",
    "attention_mask",
    "decay_cumsum",
    "decode_attention",
    "decode_attention_append",
    "decode_attention_reference",
    "forgetting_attention",
    "forgetting_attention_reference",
    "head_epilogue",
    "head_prologue",
    "resolve_implementation",
    "sharded_attention",
    "tiles",
]
