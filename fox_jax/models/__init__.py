"""Language models: FoX / Transformer (LLaMA)."""

from fox_jax.models.lm import Block, LanguageModel, count_params, init_params

__all__ = ["Block", "LanguageModel", "count_params", "init_params"]
