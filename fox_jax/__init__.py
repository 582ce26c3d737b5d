"""fox_jax: the Forgetting Transformer (FoX) in JAX/Flax, with Adaptive Computation Pruning (ACP)
and Dynamic Context Pruning (DCP).

Public surface:
  fox_jax.ops.forgetting_attention    the attention op (xla / pallas / cudnn / dense implementations)
  fox_jax.ops.decode_attention        one query per row over a ring KV cache's live range (xla / pallas / cudnn)
  fox_jax.ops.acp                     ACP thresholds, block ranges, pruning statistics
  fox_jax.ops.alpha_sigmoid, fox_jax.ops.context_pruning   DCP building blocks
  fox_jax.config.ModelConfig, preset  model configuration and the paper's sizes (also GPT2Config)
  fox_jax.models.LanguageModel        FoX / Transformer (LLaMA, Pro) language models (Flax Linen)
  fox_jax.models.GPT2, load_hf_gpt2   GPT-2 (optionally with DCP) and Hugging Face import/export
  fox_jax.cache                       the slot-pool KV cache and its policies, below the models
  fox_jax.decoding                    the decoding engine (generate, prefill, scoring), above the models
  fox_jax.sharding                    device meshes and logical-axis rules
"""

__version__ = "0.1.0"
