"""Pallas kernels. They take arrays and block ranges and return arrays; they import nothing from fox_jax."""

from fox_jax.kernels.forgetting_attention import (
    KernelConfig,
    TileConfig,
    attention_backward,
    attention_forward,
    default_config,
    flash_backward_dkv,
    flash_backward_dq,
    flash_forward,
    padded_head_dim,
    resolve_tiles,
)

__all__ = [
    "KernelConfig",
    "TileConfig",
    "attention_backward",
    "attention_forward",
    "default_config",
    "flash_backward_dkv",
    "flash_backward_dq",
    "flash_forward",
    "padded_head_dim",
    "resolve_tiles",
]
