"""TEMPORARY (deleted when the model-family interface lands on main): the ModelFamily methods on the
current configs, so the loop can be written against the interface now."""

import dataclasses
from typing import Any

import flax
import jax

import fox_jax.models as models
from fox_jax.config import ModelConfig
from fox_jax.models import gpt2 as gpt2_lib
from fox_jax.models import lm as lm_lib
from fox_jax.models.gpt2 import GPT2, GPT2Config


@flax.struct.dataclass
class ModelOutput:
    logits: Any
    cache: Any = None
    aux: dict = flax.struct.field(default_factory=dict)


class _Wrapped:
    def __init__(self, module):
        self.module = module
        self.cfg = getattr(module, "cfg", None) or module.config

    def apply(self, variables, tokens, segment_ids=None, positions=None, cache=None, *, alpha=None, **kw):
        if isinstance(self.module, GPT2):
            out = self.module.apply(variables, tokens, alpha=alpha, positions=positions, segment_ids=segment_ids, **kw)
        elif self.cfg.dcp:
            out = self.module.apply(variables, tokens, segment_ids, positions, alpha=alpha, **kw)
        else:
            out = self.module.apply(variables, tokens, segment_ids, positions, **kw)
        state = None
        if kw.get("mutable"):
            out, state = out
        if isinstance(out, tuple):
            res = ModelOutput(out[0], aux=out[1])
        else:
            res = ModelOutput(out)
        return (res, state) if kw.get("mutable") else res


ModelConfig.model_type = "lm"
GPT2Config.model_type = "gpt2"
ModelConfig.build = lambda self: _Wrapped(lm_lib.LanguageModel(self))
GPT2Config.build = lambda self: _Wrapped(GPT2(self))
ModelConfig.init_params = lambda self, rng, seq_len=8: lm_lib.init_params(self, rng, seq_len)
GPT2Config.init_params = lambda self, rng, seq_len=8: gpt2_lib.init_gpt2(self, rng)
ModelConfig.layer_names = property(lambda self: tuple(f"layers_{i}" for i in range(self.n_layers)))
GPT2Config.layer_names = property(lambda self: tuple(f"h_{i}" for i in range(self.n_layer)))
GPT2Config.n_layers = property(lambda self: self.n_layer)
GPT2Config.d_model = property(lambda self: self.n_embd)
GPT2Config.dcp_beta_init = property(lambda self: self.beta_init)
ModelConfig.with_remat = lambda self, policy: self.replace(remat=policy)
GPT2Config.with_remat = lambda self, policy: self.replace(remat=policy != "none")
GPT2Config.flops_per_token = lambda self, t: 2 * 12 * self.n_layer * self.n_embd ** 2 + 2 * self.n_layer * t * self.n_embd
GPT2Config.param_count = lambda self, include_head=True: 12 * self.n_layer * self.n_embd ** 2
ModelConfig.add_dcp_params = lambda self, params, rng, **kw: lm_lib.add_dcp_params(self, params, rng, **kw)
GPT2Config.add_dcp_params = lambda self, params, rng, **kw: gpt2_lib.add_dcp_params(self, params, rng, **kw)
ModelConfig.to_dict = lambda self: {"model_type": "lm", **dataclasses.asdict(self)}
GPT2Config.to_dict = lambda self: {"model_type": "gpt2", **dataclasses.asdict(self)}


def config_from_dict(d):
    d = dict(d)
    t = d.pop("model_type", "lm")
    return ModelConfig(**d) if t == "lm" else GPT2Config(**d)


models.config_from_dict = config_from_dict
models.ModelOutput = ModelOutput
