"""Pallas kernels. They take arrays and block ranges and return arrays; they import nothing from fox_jax."""

from fox_jax.kernels.decode_attention import DecodeConfig, default_decode_config, flash_decode
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
from fox_jax.kernels.forgetting_attention_mgpu import MosaicConfig, default_mosaic_config, mosaic_forward

__all__ = [
    "DecodeConfig",
    "KernelConfig",
    "MosaicConfig",
    "TileConfig",
    "attention_backward",
    "attention_forward",
    "default_config",
    "default_decode_config",
    "default_mosaic_config",
    "flash_backward_dkv",
    "flash_backward_dq",
    "flash_decode",
    "flash_forward",
    "mosaic_forward",
    "padded_head_dim",
    "resolve_tiles",
]
