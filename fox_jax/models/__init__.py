"""Language models: FoX / Transformer (LLaMA, Pro) and GPT-2 (with Dynamic Context Pruning).

Both families implement ``ModelFamily`` (``fox_jax.models.family``) and return ``ModelOutput``.
``MODEL_TYPES`` maps the ``model_type`` tag of a saved config to its class; ``config_from_dict`` reads one.
"""

from fox_jax.config import MODEL_TYPES, FamilyConfig, config_from_dict
from fox_jax.models.family import FamilyModules, ModelFamily, ModelOutput
from fox_jax.models.gpt2 import GPT2, GPT2Config, gpt2_preset
from fox_jax.models.hf_fox import load_official_fox, save_official_fox
from fox_jax.models.hf_gpt2 import load_hf_gpt2, save_hf_gpt2
from fox_jax.models.lm import ARCHS, SIZES, Block, LanguageModel, ModelConfig, count_params, preset

__all__ = ["ARCHS", "Block", "FamilyConfig", "FamilyModules", "GPT2", "GPT2Config", "LanguageModel", "MODEL_TYPES", "ModelConfig",
           "ModelFamily", "ModelOutput", "SIZES", "config_from_dict", "count_params", "gpt2_preset",
           "load_hf_gpt2", "load_official_fox", "preset", "save_hf_gpt2", "save_official_fox"]
