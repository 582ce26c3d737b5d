"""Neural-network building blocks (Flax Linen)."""

from fox_jax.nn.layers import RMSNorm, SwiGLU, apply_rope
from fox_jax.nn.attention import ForgettingAttentionLayer, LayerOutput

__all__ = ["ForgettingAttentionLayer", "LayerOutput", "RMSNorm", "SwiGLU", "apply_rope"]
