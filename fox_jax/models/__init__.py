"""Language models: FoX / Transformer (LLaMA, Pro) and GPT-2 (with Dynamic Context Pruning)."""

from fox_jax.models.gpt2 import GPT2, GPT2Config
from fox_jax.models.hf_fox import load_official_fox, save_official_fox
from fox_jax.models.hf_gpt2 import load_hf_gpt2, save_hf_gpt2
from fox_jax.models.lm import Block, LanguageModel, count_params, init_params

__all__ = ["Block", "GPT2", "GPT2Config", "LanguageModel", "count_params", "init_params", "load_hf_gpt2",
           "load_official_fox", "save_hf_gpt2", "save_official_fox"]
