"""Neural-network building blocks (Flax Linen)."""

from fox_jax.nn.layers import RMSNorm, SwiGLU
from fox_jax.ops.head_ops import apply_rope
from fox_jax.nn.attention import ForgettingAttentionLayer, LayerOutput

__all__ = ["ForgettingAttentionLayer", "LayerOutput", "RMSNorm", "SwiGLU", "apply_rope"]
