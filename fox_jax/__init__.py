"""fox_jax: the Forgetting Transformer (FoX) in JAX/Flax, with Adaptive Computation Pruning.

Public surface:
  fox_jax.ops.forgetting_attention   the attention op (xla / pallas / dense implementations)
  fox_jax.config.ModelConfig, preset the model configuration and the paper's sizes
  fox_jax.models.LanguageModel       FoX / Transformer language models (Flax Linen)
"""

__version__ = "0.1.0"
