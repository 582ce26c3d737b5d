"""Neural-network building blocks (Flax Linen)."""

from fox_jax.nn.layers import RMSNorm, SwiGLU, apply_rope
from fox_jax.nn.attention import ForgettingAttentionLayer

__all__ = ["ForgettingAttentionLayer", "RMSNorm", "SwiGLU", "apply_rope"]
