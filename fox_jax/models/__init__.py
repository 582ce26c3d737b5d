"""Language models: FoX / Transformer (LLaMA, Pro) and GPT-2 (with Dynamic Context Pruning).

Both families implement ``ModelFamily`` (``fox_jax.models.family``) and return ``ModelOutput``.
``MODEL_TYPES`` maps the ``model_type`` tag of a saved config to its class; ``config_from_dict`` reads one.
"""

from fox_jax.models.family import FamilyConfig, ModelFamily, ModelOutput
from fox_jax.models.gpt2 import GPT2, GPT2Config, gpt2_preset
from fox_jax.models.hf_fox import load_official_fox, save_official_fox
from fox_jax.models.hf_gpt2 import load_hf_gpt2, save_hf_gpt2
from fox_jax.models.lm import ARCHS, SIZES, Block, LanguageModel, ModelConfig, count_params, preset

MODEL_TYPES: dict[str, type] = {"lm": ModelConfig, "gpt2": GPT2Config}


def config_from_dict(d: dict) -> ModelConfig | GPT2Config:
    """The model config of a ``to_dict`` dict, by its ``model_type`` ("lm" when the dict has none).

    Raises:
      ValueError: an unknown ``model_type`` (the message lists ``MODEL_TYPES``), or fields the config
        refuses (see ``FamilyConfig.from_dict``).
    """
    model_type = d.get("model_type", "lm")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {tuple(MODEL_TYPES)}, got {model_type!r}")
    return MODEL_TYPES[model_type].from_dict(d)


__all__ = ["ARCHS", "Block", "FamilyConfig", "GPT2", "GPT2Config", "LanguageModel", "MODEL_TYPES", "ModelConfig",
           "ModelFamily", "ModelOutput", "SIZES", "config_from_dict", "count_params", "gpt2_preset",
           "load_hf_gpt2", "load_official_fox", "preset", "save_hf_gpt2", "save_official_fox"]
