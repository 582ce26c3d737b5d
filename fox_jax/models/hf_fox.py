"""Import and export the official FoX checkpoints (zhixuan-lin/forgetting-transformer) for
``fox_jax.models.LanguageModel``.

The official repository saves its models in the Hugging Face layout: a directory with ``config.json``
and ``model.safetensors`` (or ``pytorch_model.bin``). Two official model types exist:

* ``"forgetting_transformer-project_fox"`` (``ForgettingTransformerForCausalLM``): FoX (LLaMA), FoX (Pro)
  and the Transformer (Pro) baseline (``fgate_type="none"``, ``use_rope=True``);
* ``"transformer-project_fox"`` (``TransformerForCausalLM``): the Transformer (LLaMA) baseline.

Config mapping (official field -> ``ModelConfig`` field):

    vocab_size -> vocab_size            hidden_size -> d_model          num_hidden_layers -> n_layers
    num_heads -> n_heads                num_kv_heads -> n_kv_heads (Transformer type only; FoX: None)
    hidden_ratio -> hidden_ratio (None = 4)                  intermediate_size -> mlp_dim
    norm_eps -> norm_eps                initializer_range -> init_std   tie_word_embeddings -> tie_embeddings
    use_rope -> use_rope                rope_base -> rope_base
    fgate_type "full"/"none" -> use_fgate True/False     qk_norm -> qk_norm
    qk_norm_share_param_across_head -> qk_norm_shared    use_output_gate -> output_gate
    use_output_norm -> output_norm      use_k_shift = use_v_shift -> kv_shift
    log_pruning_tolerance None / -10.0 -> adaptive_threshold None / "auto" (log ε = −10, docs/design/fox_acp.md §5)

Refused with a ``ValueError`` naming the field (fox_jax has no equivalent): ``fgate_type`` "bias_only" or
"fixed", ``fgate_bias_init``, ``decay_time_min`` / ``decay_time_max``, ``ogate_act`` "silu" (with an
output gate), ``hidden_act`` other than "swish" (FoX type), ``use_k_shift`` != ``use_v_shift``,
``num_kv_heads`` on the FoX type (the official FoX layer raises on it too), ``window_size`` on the
Transformer type (sliding-window attention), ``log_pruning_tolerance`` other than None / −10,
``hidden_size`` not divisible by ``num_heads``. Fields that do not change the logits are not read:
``max_position_embeddings`` (size of the rotary table), ``window_size`` on the FoX type (unused there),
``elementwise_affine``, ``attention_bias`` and ``hidden_act`` on the Transformer type (unused by the
official model code), ``fuse_norm``, ``fuse_cross_entropy``, ``use_cache``, token ids, and the generic
Hugging Face fields. Any other key is unknown and warned about.

Weight mapping (official name -> Flax path of ``init_params``; a PyTorch ``Linear`` weight [out, in] is
the transpose of a Flax ``Dense`` kernel [in, out]; per-head norm scales [H·D] are reshaped to [H, D]):

    model.embeddings.weight [V, d]                  -> embed/embedding [V, d]
    model.norm.weight [d]                           -> final_norm/scale
    lm_head.weight [V, d]                           -> lm_head/kernel [d, V]  (absent or equal to the
                                                       embedding when tie_word_embeddings)
    model.layers.{i}.attn_norm.weight / mlp_norm.weight -> layers_{i}/attn_norm/scale, mlp_norm/scale
    model.layers.{i}.mlp.gate_proj.weight [2I, d]   -> layers_{i}/mlp/gate_proj/kernel [d, 2I]
    model.layers.{i}.mlp.down_proj.weight [d, I]    -> layers_{i}/mlp/down_proj/kernel [I, d]
    model.layers.{i}.attn.{q,o}_proj.weight         -> layers_{i}/attn/{q,o}_proj/kernel
    model.layers.{i}.attn.{k,v}_proj.weight         -> layers_{i}/attn/{k,v}_proj/kernel
      (KV-shift: attn.{k,v}_proj.linear.weight, and attn.{k,v}_proj.shift_proj.weight [H, d]
       -> layers_{i}/attn/{k,v}_shift_proj/kernel [d, H])
    model.layers.{i}.attn.fgate_proj.{weight, bias} -> layers_{i}/attn/fgate_proj/{kernel, bias}
    model.layers.{i}.attn.ogate_proj.weight         -> layers_{i}/attn/ogate_proj/kernel
    model.layers.{i}.attn.output_norm.weight [H·D]  -> layers_{i}/attn/o_norm/scale [H, D]
    model.layers.{i}.attn.{q,k}_norm.weight [H·D]   -> layers_{i}/attn/{q,k}_norm/scale [H, D]
      (qk_norm_share_param_across_head: [D] -> [D])

Loading is strict: a missing or unexpected tensor, or a shape that disagrees with ``config.json``, is a
``ValueError`` naming the tensor.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fox_jax.models.lm import ModelConfig
from fox_jax.models.hf_gpt2 import (CONFIG_NAME, PYTORCH_NAME, SAFETENSORS_INDEX_NAME, SAFETENSORS_NAME,
                                    read_config, read_weights)

FOX_MODEL_TYPE = "forgetting_transformer-project_fox"
TRANSFORMER_MODEL_TYPE = "transformer-project_fox"
MODEL_TYPES = (FOX_MODEL_TYPE, TRANSFORMER_MODEL_TYPE)
_ARCHITECTURES = {FOX_MODEL_TYPE: "ForgettingTransformerForCausalLM",
                  TRANSFORMER_MODEL_TYPE: "TransformerForCausalLM"}
ACP_LOG_TOLERANCE = -10.0  # the official recommendation, fox_jax's "auto" threshold (acp.DEFAULT_LOG_EPSILON)

# Fields each official config class defines (the FoX class adds its own to the Transformer's).
_COMMON_FIELDS = (
    "vocab_size", "hidden_size", "hidden_ratio", "intermediate_size", "num_hidden_layers", "num_heads",
    "num_kv_heads", "hidden_act", "window_size", "max_position_embeddings", "initializer_range",
    "elementwise_affine", "norm_eps", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
    "tie_word_embeddings", "attention_bias", "fuse_norm", "fuse_cross_entropy", "rope_base", "use_rope")
_FOX_FIELDS = _COMMON_FIELDS + (
    "use_output_gate", "ogate_act", "fgate_type", "fgate_bias_init", "decay_time_min", "decay_time_max",
    "use_output_norm", "qk_norm", "qk_norm_share_param_across_head", "use_k_shift", "use_v_shift",
    "log_pruning_tolerance")
# Generic Hugging Face PretrainedConfig keys: they never change the model's logits.
_GENERIC_FIELDS = frozenset((
    "model_type", "architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype",
    "auto_map", "return_dict", "output_hidden_states", "output_attentions", "use_return_dict",
    "torchscript", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "chunk_size_feed_forward", "pruned_heads", "id2label", "label2id", "problem_type", "tokenizer_class",
    "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params", "finetuning_task",
    "cross_attention_hidden_size", "tf_legacy_loss", "use_bfloat16", "num_labels", "_attn_implementation",
    "_attn_implementation_autoset", "_commit_hash", "output_scores", "return_dict_in_generate",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens"))


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

def config_from_official(hf_config: dict, **overrides: Any) -> ModelConfig:
    """``ModelConfig`` from an official ``config.json`` dict (see the module docstring for the mapping).

    Args:
      hf_config: the parsed ``config.json`` (``model_type`` one of ``MODEL_TYPES``; a missing field takes
        the official class's default).
      **overrides: ``ModelConfig`` fields to set afterwards (runtime options such as ``dtype``,
        ``attention_impl``, ``remat``).

    Returns:
      The config; ``arch`` is ``fox-*`` with a forget gate, ``transformer-*`` without, ``*-pro`` when any
      Pro component (QK-norm, output gate or norm, KV-shift) is on.

    Raises:
      ValueError: an unknown ``model_type``, or an official option fox_jax cannot represent (the message
        names the field).
    """
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json has model_type={model_type!r}; expected one of {MODEL_TYPES}")
    fox = model_type == FOX_MODEL_TYPE
    known = _FOX_FIELDS if fox else _COMMON_FIELDS
    unknown = sorted(k for k in hf_config if k not in known and k not in _GENERIC_FIELDS)
    if unknown:
        warnings.warn(f"config_from_official: ignoring unknown config field(s) {unknown}", stacklevel=2)
    get = lambda name, default: default if hf_config.get(name) is None else hf_config[name]

    def refuse(name, value, why):
        raise ValueError(f"official config field {name}={value!r} is not supported: {why}")

    hidden, heads = int(get("hidden_size", 2048)), int(get("num_heads", 32))
    if hidden % heads:
        refuse("hidden_size", hidden, f"it must be divisible by num_heads ({heads}): the official head "
               "dimension is hidden_size // num_heads")
    kv_heads = hf_config.get("num_kv_heads")
    if kv_heads is not None and fox:
        refuse("num_kv_heads", kv_heads, "the official FoX layer has no GQA (it raises NotImplementedError)")
    if not fox and hf_config.get("window_size") is not None:
        refuse("window_size", hf_config["window_size"], "fox_jax models have no sliding-window "
               "layers (the attention op has window_size; to decode with a window use the cache policy window:W)")
    kw: dict[str, Any] = dict(
        vocab_size=int(get("vocab_size", 32000)), d_model=hidden, n_layers=int(get("num_hidden_layers", 24)),
        n_heads=heads, n_kv_heads=None if kv_heads is None or int(kv_heads) == heads else int(kv_heads),
        hidden_ratio=float(get("hidden_ratio", 4)),
        mlp_dim=None if hf_config.get("intermediate_size") is None else int(hf_config["intermediate_size"]),
        norm_eps=float(get("norm_eps", 1e-6)), init_std=float(get("initializer_range", 0.02)),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        use_rope=bool(get("use_rope", not fox)), rope_base=float(get("rope_base", 500000.0)),
        use_fgate=False)
    if fox:
        act = get("hidden_act", "swish")
        if act != "swish":
            refuse("hidden_act", act, "only the SwiGLU MLP ('swish') is implemented")
        fgate_type = get("fgate_type", "full")
        if fgate_type not in ("full", "none"):
            refuse("fgate_type", fgate_type, "only the data-dependent ('full') forget gate or none is implemented")
        if get("fgate_bias_init", False):
            refuse("fgate_bias_init", True, "only used by the 'bias_only'/'fixed' forget gates")
        for name in ("decay_time_min", "decay_time_max"):
            if hf_config.get(name) is not None:
                refuse(name, hf_config[name], "only used by the 'bias_only'/'fixed' forget gates")
        k_shift, v_shift = bool(get("use_k_shift", False)), bool(get("use_v_shift", False))
        if k_shift != v_shift:
            refuse("use_k_shift", k_shift, f"fox_jax shifts keys and values together (use_v_shift={v_shift})")
        output_gate = bool(get("use_output_gate", False))
        if output_gate and get("ogate_act", "sigmoid") != "sigmoid":
            refuse("ogate_act", hf_config["ogate_act"], "only the sigmoid output gate is implemented")
        tolerance = hf_config.get("log_pruning_tolerance")
        if tolerance is not None and float(tolerance) != ACP_LOG_TOLERANCE:
            refuse("log_pruning_tolerance", tolerance,
                   f"fox_jax's adaptive threshold 'auto' uses log ε = {ACP_LOG_TOLERANCE} (or None: no pruning)")
        kw.update(use_fgate=fgate_type == "full", kv_shift=k_shift, output_gate=output_gate,
                  output_norm=bool(get("use_output_norm", False)), qk_norm=bool(get("qk_norm", False)),
                  qk_norm_shared=bool(get("qk_norm_share_param_across_head", False)),
                  adaptive_threshold=None if tolerance is None else "auto")
    pro = any(kw.get(k, False) for k in ("qk_norm", "output_gate", "output_norm", "kv_shift"))
    kw["arch"] = ("fox" if kw["use_fgate"] else "transformer") + ("-pro" if pro else "-llama")
    kw.update(overrides)
    return ModelConfig(**kw)


def config_to_official(cfg: ModelConfig, *, model_type: str | None = None) -> dict:
    """The official ``config.json`` dict for ``cfg`` (every field of the official config class).

    Args:
      cfg: the model config.
      model_type: ``None`` (default): ``"transformer-project_fox"`` for a plain Transformer (no forget
        gate, no Pro component), ``"forgetting_transformer-project_fox"`` otherwise. Either string forces
        that class (a plain Transformer also fits the FoX class, as ``fgate_type="none"``).

    Raises:
      ValueError: cfg uses something the official classes do not have (DCP, a head_dim other than
        d_model // n_heads, GQA in the FoX class, a fixed-float ACP threshold, any component of the FoX
        class in the Transformer class).
    """
    pro = cfg.qk_norm or cfg.output_gate or cfg.output_norm or cfg.kv_shift
    if model_type is None:
        model_type = FOX_MODEL_TYPE if (cfg.use_fgate or pro) else TRANSFORMER_MODEL_TYPE
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    if cfg.dcp:
        raise ValueError("ModelConfig.dcp=True: the official models have no Dynamic Context Pruning parameters")
    if cfg.d_model % cfg.n_heads or cfg.dim_per_head != cfg.d_model // cfg.n_heads:
        raise ValueError(f"ModelConfig.head_dim={cfg.head_dim}: the official models use hidden_size // "
                         f"num_heads = {cfg.d_model // cfg.n_heads} (d_model {cfg.d_model}, n_heads {cfg.n_heads})")
    threshold = cfg.adaptive_threshold
    if threshold is not None and not (isinstance(threshold, str) and threshold == "auto"):
        raise ValueError(f"ModelConfig.adaptive_threshold={threshold!r}: the official config only has "
                         "log_pruning_tolerance (the 'auto' threshold); use 'auto' or None")
    hf: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [_ARCHITECTURES[model_type]],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "hidden_ratio": cfg.hidden_ratio,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_heads": cfg.n_heads,
        "num_kv_heads": None if cfg.kv_heads == cfg.n_heads else cfg.kv_heads,
        "hidden_act": "swish",
        "window_size": None,
        "max_position_embeddings": 2048,
        "initializer_range": cfg.init_std,
        "elementwise_affine": True,
        "norm_eps": cfg.norm_eps,
        "use_cache": True,
        "pad_token_id": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "fuse_norm": True,
        "fuse_cross_entropy": True,
        "rope_base": cfg.rope_base,
        "use_rope": cfg.use_rope,
    }
    if model_type == TRANSFORMER_MODEL_TYPE:
        if cfg.use_fgate or pro or threshold is not None:
            raise ValueError(f"model_type {TRANSFORMER_MODEL_TYPE!r} has no forget gate, Pro components or ACP "
                             f"(cfg.arch={cfg.arch!r}); use {FOX_MODEL_TYPE!r}")
        return hf
    if cfg.kv_heads != cfg.n_heads:
        raise ValueError(f"ModelConfig.n_kv_heads={cfg.n_kv_heads}: the official FoX class has no GQA")
    hf.update({
        "use_output_gate": cfg.output_gate,
        "ogate_act": "sigmoid",
        "fgate_type": "full" if cfg.use_fgate else "none",
        "fgate_bias_init": False,
        "decay_time_min": None,
        "decay_time_max": None,
        "use_output_norm": cfg.output_norm,
        "qk_norm": cfg.qk_norm,
        "qk_norm_share_param_across_head": cfg.qk_norm_shared,
        "use_k_shift": cfg.kv_shift,
        "use_v_shift": cfg.kv_shift,
        "log_pruning_tolerance": None if threshold is None else ACP_LOG_TOLERANCE,
    })
    return hf


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

def _expected(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]]:
    """Official name -> (Flax path, official shape, Flax shape). 2-D official weights other than the
    embedding are ``Linear`` weights (transposed); 1-D ones reshape to the Flax shape."""
    d, v, f = cfg.d_model, cfg.vocab_size, cfg.mlp_hidden
    h, hkv, dh = cfg.n_heads, cfg.kv_heads, cfg.dim_per_head
    linear = lambda name, path, n_out, n_in: {name: (path, (n_out, n_in), (n_in, n_out))}
    out = {
        "model.embeddings.weight": (("embed", "embedding"), (v, d), (v, d)),
        "model.norm.weight": (("final_norm", "scale"), (d,), (d,)),
    }
    if not cfg.tie_embeddings:
        out.update(linear("lm_head.weight", ("lm_head", "kernel"), v, d))
    for i in range(cfg.n_layers):
        o, fl = f"model.layers.{i}.", f"layers_{i}"
        a = (fl, "attn")
        out[o + "attn_norm.weight"] = ((fl, "attn_norm", "scale"), (d,), (d,))
        out[o + "mlp_norm.weight"] = ((fl, "mlp_norm", "scale"), (d,), (d,))
        out.update(linear(o + "mlp.gate_proj.weight", (fl, "mlp", "gate_proj", "kernel"), 2 * f, d))
        out.update(linear(o + "mlp.down_proj.weight", (fl, "mlp", "down_proj", "kernel"), d, f))
        out.update(linear(o + "attn.q_proj.weight", a + ("q_proj", "kernel"), h * dh, d))
        out.update(linear(o + "attn.o_proj.weight", a + ("o_proj", "kernel"), d, h * dh))
        for x in ("k", "v"):
            if cfg.kv_shift:
                out.update(linear(o + f"attn.{x}_proj.linear.weight", a + (f"{x}_proj", "kernel"), hkv * dh, d))
                out.update(linear(o + f"attn.{x}_proj.shift_proj.weight", a + (f"{x}_shift_proj", "kernel"), hkv, d))
            else:
                out.update(linear(o + f"attn.{x}_proj.weight", a + (f"{x}_proj", "kernel"), hkv * dh, d))
        if cfg.use_fgate:
            out.update(linear(o + "attn.fgate_proj.weight", a + ("fgate_proj", "kernel"), h, d))
            out[o + "attn.fgate_proj.bias"] = (a + ("fgate_proj", "bias"), (h,), (h,))
        if cfg.output_gate:
            out.update(linear(o + "attn.ogate_proj.weight", a + ("ogate_proj", "kernel"), h * dh, d))
        if cfg.output_norm:
            out[o + "attn.output_norm.weight"] = (a + ("o_norm", "scale"), (h * dh,), (h, dh))
        if cfg.qk_norm:
            for x, heads in (("q", h), ("k", hkv)):
                shape = (dh,) if cfg.qk_norm_shared else (heads, dh)
                out[o + f"attn.{x}_norm.weight"] = (a + (f"{x}_norm", "scale"), (math.prod(shape),), shape)
    return out


def _check_supported(cfg: ModelConfig) -> None:
    if cfg.dcp:
        raise ValueError("ModelConfig.dcp=True: the official models have no Dynamic Context Pruning parameters")


def params_from_official(state_dict: dict[str, Any], cfg: ModelConfig, *, source: str = "state_dict") -> dict:
    """Flax params of ``LanguageModel(cfg)`` from an official state dict.

    Args:
      state_dict: official tensor name -> array ([out, in] ``Linear`` weights; numpy, torch CPU tensors
        or anything ``np.asarray`` takes; any float dtype).
      cfg: the config (``config_from_official`` of the checkpoint's config.json).
      source: a name for error messages (e.g. the checkpoint path).

    Returns:
      The float32 params pytree (nested dicts of ``jax.Array``), the layout ``init_params(cfg)`` gives.

    Raises:
      ValueError: a missing or unexpected tensor, a shape that disagrees with cfg (each names the tensor),
        a tied head whose ``lm_head.weight`` differs from the embedding, or a DCP cfg.
    """
    _check_supported(cfg)
    tensors = {name: _to_numpy(arr) for name, arr in state_dict.items()}
    expected = _expected(cfg)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} tensor(s) the config needs: {missing[:8]}")
    extra = [name for name in tensors if name not in expected]
    if cfg.tie_embeddings and "lm_head.weight" in extra:
        head, emb = tensors["lm_head.weight"], tensors["model.embeddings.weight"]
        if head.shape != emb.shape or not np.array_equal(head, emb):
            raise ValueError(f"{source}: tie_word_embeddings is true but lm_head.weight differs from "
                             "model.embeddings.weight")
        extra.remove("lm_head.weight")
    if extra:
        raise ValueError(f"{source} has {len(extra)} tensor(s) the config does not use: {sorted(extra)[:8]}")
    params: dict = {}
    for name, (path, official_shape, flax_shape) in expected.items():
        arr = tensors[name]
        if tuple(arr.shape) != official_shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected "
                             f"{official_shape} from the config")
        arr = arr.astype(np.float32)
        arr = arr.T if len(official_shape) == 2 and name != "model.embeddings.weight" else arr.reshape(flax_shape)
        _set(params, path, jnp.asarray(arr))
    return params


def params_to_official(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """The official state dict (float32 numpy, C-contiguous) of ``LanguageModel(cfg)`` params.

    Raises:
      ValueError: params lack a tensor, have one cfg does not use (e.g. DCP parameters), or a shape that
        disagrees with cfg (each names the Flax path).
    """
    _check_supported(cfg)
    expected = _expected(cfg)
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    wanted = {"/".join(path) for path, _, _ in expected.values()}
    extra = sorted(set(flat) - wanted)
    if extra:
        raise ValueError(f"params have {len(extra)} leaf/leaves the official format has no tensor for: {extra[:8]}")
    out = {}
    for name, (path, official_shape, flax_shape) in expected.items():
        key = "/".join(path)
        if key not in flat:
            raise ValueError(f"params lack {key} (needed for {name})")
        arr = np.asarray(flat[key], dtype=np.float32)
        if arr.shape != flax_shape:
            raise ValueError(f"params {key} has shape {arr.shape}, expected {flax_shape}")
        arr = arr.T if len(official_shape) == 2 and name != "model.embeddings.weight" else arr.reshape(official_shape)
        out[name] = np.ascontiguousarray(arr)
    return out


def _to_numpy(arr) -> np.ndarray:
    if hasattr(arr, "detach"):  # a torch tensor
        import torch

        t = arr.detach().cpu()
        return (t.to(torch.float32) if t.is_floating_point() else t).numpy()
    return np.asarray(arr)


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

def load_official_fox(path: str | os.PathLike, **config_overrides: Any) -> tuple[ModelConfig, dict]:
    """Load an official FoX / Transformer checkpoint directory into ``(ModelConfig, params)``.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or a sharded
        ``model.safetensors.index.json``, or ``pytorch_model.bin``, which needs torch).
      **config_overrides: ``ModelConfig`` fields to set (runtime options: ``dtype``, ``attention_impl``,
        ``attention_block``, ``remat``, ``adaptive_threshold``).

    Returns:
      (config, params): params is the float32 pytree of ``LanguageModel(config)`` (fp16/bf16 checkpoints
      are upcast); ``LanguageModel(config).apply({"params": params}, tokens)`` gives the official logits.

    Raises:
      FileNotFoundError: the directory, ``config.json`` or the weights are missing.
      ValueError: an unsupported official option (names the config field), a missing or unexpected
        tensor or a shape mismatch (names the tensor).
      ImportError: a ``pytorch_model.bin`` checkpoint without torch installed.
    """
    path = os.fspath(path)
    cfg = config_from_official(read_config(path, "official FoX"), **config_overrides)
    return cfg, params_from_official(read_weights(path, "FoX"), cfg, source=path)


def save_official_fox(cfg: ModelConfig, params: dict, path: str | os.PathLike, *,
                      model_type: str | None = None) -> None:
    """Write ``params`` of ``LanguageModel(cfg)`` as an official checkpoint directory.

    Writes ``config.json`` (``config_to_official``: the official field names and ``model_type``) and
    ``model.safetensors`` (float32, the official tensor names, metadata ``{"format": "pt"}``), which the
    official ``ForgettingTransformerForCausalLM`` / ``TransformerForCausalLM`` load and
    ``load_official_fox`` reads back to the same config and params. A tied head writes no
    ``lm_head.weight``. A ``pytorch_model.bin`` or sharded index left in ``path`` is removed, so that
    the directory holds one set of weights.

    Args:
      cfg: the model config.
      params: its params pytree (any float dtype; saved as float32).
      path: output directory (created if needed; existing files of these names are overwritten).
      model_type: see ``config_to_official``.

    Raises:
      ValueError: cfg is not representable in the official format (see ``config_to_official``), or params
        lack a tensor, have an extra one, or a shape that disagrees with cfg.
    """
    from safetensors.numpy import save_file

    hf = config_to_official(cfg, model_type=model_type)
    tensors = params_to_official(cfg, params)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, SAFETENSORS_NAME), metadata={"format": "pt"})
    for stale in (PYTORCH_NAME, SAFETENSORS_INDEX_NAME):
        if os.path.exists(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
        f.write("\n")
