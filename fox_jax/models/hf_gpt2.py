"""Import and export Hugging Face GPT-2 checkpoints for ``fox_jax.models.gpt2.GPT2``.

A HF GPT-2 directory holds ``config.json`` and the weights in ``model.safetensors`` (or a sharded
``model.safetensors.index.json``, or the legacy ``pytorch_model.bin``). Loading works from local
files only; nothing is downloaded.

Weight mapping (HF name, with or without the ``transformer.`` prefix -> Flax path). HF's ``Conv1D``
stores its weight as [in, out], which is exactly a Flax ``Dense`` kernel, so no transpose is needed:

    wte.weight [V, d]                -> wte/embedding
    wpe.weight [P, d]                -> wpe/embedding
    h.{i}.ln_1.{weight, bias}        -> h_{i}/ln_1/{scale, bias}     (also ln_2, ln_f)
    h.{i}.attn.c_attn.{weight, bias} -> h_{i}/attn/c_attn/{kernel, bias}
    h.{i}.attn.c_proj.{weight, bias} -> h_{i}/attn/c_proj/{kernel, bias}
    h.{i}.mlp.c_fc.{weight, bias}    -> h_{i}/mlp/c_fc/{kernel, bias}
    h.{i}.mlp.c_proj.{weight, bias}  -> h_{i}/mlp/c_proj/{kernel, bias}

Ignored on import: the causal-mask buffers ``h.{i}.attn.bias`` / ``h.{i}.attn.masked_bias`` of old
checkpoints, and ``lm_head.weight`` (checked to equal ``wte.weight``: the head is tied).

DCP parameters (q_int, k_int, β per layer) are not part of HF GPT-2. Decision: ``save_hf_gpt2``
writes them **separately** to ``dcp_interaction.safetensors`` next to ``model.safetensors``, with
names ``h.{i}.attn.q_int.weight`` [d, r], ``h.{i}.attn.k_int.weight`` [d, r] (Conv1D layout
[in, out]) and ``h.{i}.attn.int_bias`` [1] (the reference code's name for β), and records r and β₀
under the ``"fox_jax_dcp"`` key of ``config.json``. The directory therefore stays a valid HF GPT-2
checkpoint (``GPT2LMHeadModel.from_pretrained`` loads the dense part and ignores the extra key and
file), and ``load_hf_gpt2`` restores the DCP model from it. ``dcp="drop"`` omits them with a warning.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

import jax
import numpy as np
from safetensors.flax import load_file as _load_safetensors
from safetensors.numpy import save_file as _save_safetensors

from fox_jax.models.gpt2 import GPT2Config

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
PYTORCH_NAME = "pytorch_model.bin"
DCP_NAME = "dcp_interaction.safetensors"
DCP_CONFIG_KEY = "fox_jax_dcp"

_SUPPORTED_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
_IGNORED = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")


# ---------------------------------------------------------------------------------------------
# Reading tensors
# ---------------------------------------------------------------------------------------------

def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as host numpy arrays in their stored dtype (bfloat16 as
    ``ml_dtypes.bfloat16``). Read by safetensors' flax loader, which knows every dtype JAX has, on the
    CPU device (a checkpoint never passes through accelerator memory)."""
    with jax.default_device(jax.devices("cpu")[0]):
        return {name: np.asarray(arr) for name, arr in _load_safetensors(path).items()}


def _read_pytorch_bin(path: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            f"{path} is a PyTorch checkpoint and reading it needs torch, which is not installed. "
            "Install torch (CPU build is enough) or convert the checkpoint to model.safetensors.") from e
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {name: t.detach().to(torch.float32).numpy() if t.is_floating_point() else t.numpy()
            for name, t in state.items()}


def read_config(path: str, what: str = "model") -> dict:
    """``config.json`` of a Hugging Face-style checkpoint directory, as a dict.

    Raises:
      FileNotFoundError: ``path`` is no directory or has no ``config.json`` (``what`` names the model).
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{what} checkpoint directory not found: {path}")
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} not found (a {what} checkpoint directory needs config.json)")
    with open(config_path) as f:
        return json.load(f)


def read_weights(path: str, what: str = "model") -> dict[str, np.ndarray]:
    """The tensors of a Hugging Face-style checkpoint directory as numpy arrays: ``model.safetensors``, a
    sharded ``model.safetensors.index.json``, or ``pytorch_model.bin`` (needs torch), in that order.

    Raises:
      FileNotFoundError: none of them in ``path`` (``what`` names the model in the message), or a shard
        named by the index is missing.
    """
    st = os.path.join(path, SAFETENSORS_NAME)
    index = os.path.join(path, SAFETENSORS_INDEX_NAME)
    pt = os.path.join(path, PYTORCH_NAME)
    if os.path.isfile(st):
        return _read_safetensors(st)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise FileNotFoundError(f"{index} names shard {shard!r}, which is missing from {path}")
            tensors.update(_read_safetensors(shard_path))
        return tensors
    if os.path.isfile(pt):
        return _read_pytorch_bin(pt)
    raise FileNotFoundError(
        f"no {what} weights in {path}: expected {SAFETENSORS_NAME}, {SAFETENSORS_INDEX_NAME} or {PYTORCH_NAME}")


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

def config_from_hf(hf: dict, **overrides: Any) -> GPT2Config:
    """``GPT2Config`` from a HF GPT-2 ``config.json`` dict.

    Dropout probabilities are ignored (the model has no dropout). DCP fields come from the
    ``"fox_jax_dcp"`` entry when present.

    Raises:
      ValueError: not a GPT-2 config, or a GPT-2 variant this model does not implement (an activation
        other than the tanh GELU, ``scale_attn_by_inverse_layer_idx``, unscaled attention, untied
        embeddings).
    """
    model_type = hf.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise ValueError(f"config.json has model_type={model_type!r}; only 'gpt2' is supported")
    act = hf.get("activation_function", "gelu_new")
    if act not in _SUPPORTED_ACTIVATIONS:
        raise ValueError(f"activation_function={act!r} is not supported (expected one of {_SUPPORTED_ACTIVATIONS})")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        raise ValueError("scale_attn_by_inverse_layer_idx=True is not supported")
    if not hf.get("scale_attn_weights", True):
        raise ValueError("scale_attn_weights=False is not supported")
    if not hf.get("tie_word_embeddings", True):
        raise ValueError("tie_word_embeddings=False is not supported (GPT2 ties the LM head to wte)")
    kw: dict[str, Any] = dict(
        n_layers=hf.get("n_layer", 12), n_heads=hf.get("n_head", 12), d_model=hf.get("n_embd", 768),
        vocab_size=hf.get("vocab_size", 50257), n_positions=hf.get("n_positions", 1024),
        mlp_dim=hf.get("n_inner"), norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        init_std=float(hf.get("initializer_range", 0.02)))
    dcp = hf.get(DCP_CONFIG_KEY)
    if dcp:
        kw.update(dcp=True, interaction_dim=int(dcp["interaction_dim"]), dcp_beta_init=float(dcp["beta_init"]))
    kw.update(GPT2Config.current_names(overrides))
    return GPT2Config(**kw)


def config_to_hf(cfg: GPT2Config) -> dict:
    """A HF ``config.json`` dict for ``cfg`` (``GPT2LMHeadModel``; DCP fields under "fox_jax_dcp")."""
    hf = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_embd": cfg.d_model,
        "n_positions": cfg.n_positions,
        "n_ctx": cfg.n_positions,
        "n_inner": cfg.mlp_dim,
        "vocab_size": cfg.vocab_size,
        "layer_norm_epsilon": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": 50256 if cfg.vocab_size > 50256 else None,
        "eos_token_id": 50256 if cfg.vocab_size > 50256 else None,
        "dtype": "float32",
    }
    if cfg.dcp:
        hf[DCP_CONFIG_KEY] = {"interaction_dim": cfg.interaction_dim, "beta_init": cfg.dcp_beta_init}
    return hf


# ---------------------------------------------------------------------------------------------
# Name mapping
# ---------------------------------------------------------------------------------------------

def _expected_shapes(cfg: GPT2Config) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """HF name -> (Flax path, shape) for the dense GPT-2 weights."""
    d, f = cfg.d_model, cfg.mlp_hidden
    out = {
        "wte.weight": (("wte", "embedding"), (cfg.vocab_size, d)),
        "wpe.weight": (("wpe", "embedding"), (cfg.n_positions, d)),
        "ln_f.weight": (("ln_f", "scale"), (d,)),
        "ln_f.bias": (("ln_f", "bias"), (d,)),
    }
    for i, fl in enumerate(cfg.layer_names):
        h = f"h.{i}."
        out.update({
            h + "ln_1.weight": ((fl, "ln_1", "scale"), (d,)),
            h + "ln_1.bias": ((fl, "ln_1", "bias"), (d,)),
            h + "ln_2.weight": ((fl, "ln_2", "scale"), (d,)),
            h + "ln_2.bias": ((fl, "ln_2", "bias"), (d,)),
            h + "attn.c_attn.weight": ((fl, "attn", "c_attn", "kernel"), (d, 3 * d)),
            h + "attn.c_attn.bias": ((fl, "attn", "c_attn", "bias"), (3 * d,)),
            h + "attn.c_proj.weight": ((fl, "attn", "c_proj", "kernel"), (d, d)),
            h + "attn.c_proj.bias": ((fl, "attn", "c_proj", "bias"), (d,)),
            h + "mlp.c_fc.weight": ((fl, "mlp", "c_fc", "kernel"), (d, f)),
            h + "mlp.c_fc.bias": ((fl, "mlp", "c_fc", "bias"), (f,)),
            h + "mlp.c_proj.weight": ((fl, "mlp", "c_proj", "kernel"), (f, d)),
            h + "mlp.c_proj.bias": ((fl, "mlp", "c_proj", "bias"), (d,)),
        })
    return out


def _dcp_expected_shapes(cfg: GPT2Config) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    d, r = cfg.d_model, cfg.interaction_dim
    out = {}
    for i, fl in enumerate(cfg.layer_names):
        h = f"h.{i}.attn."
        out[h + "q_int.weight"] = ((fl, "attn", "q_int", "kernel"), (d, r))
        out[h + "k_int.weight"] = ((fl, "attn", "k_int", "kernel"), (d, r))
        out[h + "int_bias"] = ((fl, "attn", "beta"), (1,))  # stored [1], a scalar in the model
    return out


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            raise KeyError("/".join(path))
        tree = tree[key]
    return tree


def _fill(params: dict, tensors: dict[str, np.ndarray], expected: dict, source: str) -> None:
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} expected tensor(s), e.g. {missing[:5]}")
    for name, (path, shape) in expected.items():
        arr = tensors[name]
        if tuple(arr.shape) != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape} "
                             "from config.json")
        arr = np.asarray(arr, dtype=np.float32)
        if path[-1] == "beta":
            arr = arr.reshape(())
        _set(params, path, jax.numpy.asarray(arr))


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

def load_hf_gpt2(
    path: str | os.PathLike,
    *,
    dcp: bool | None = None,
    rng: jax.Array | None = None,
    **config_overrides: Any,
) -> tuple[GPT2Config, dict]:
    """Load a Hugging Face GPT-2 checkpoint directory into ``(GPT2Config, params)``.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or a sharded
        ``model.safetensors.index.json``, or ``pytorch_model.bin``, which needs torch).
      dcp: ``None`` (default): DCP parameters are loaded if the directory has
        ``dcp_interaction.safetensors``. ``True``: the returned model has DCP; if the file is absent,
        fresh interaction parameters are initialised from ``rng`` (``GPT2Config.add_dcp_params``:
        N(0, 0.02), β = dcp_beta_init) — the start of DCP fine-tuning. ``False``: DCP parameters are not loaded.
      rng: PRNG key, needed only for ``dcp=True`` without a saved DCP file.
      **config_overrides: ``GPT2Config`` fields to set (e.g. ``dtype="bfloat16"``,
        ``interaction_dim=64``, ``dcp_beta_init=2.0`` for fresh DCP params; the legacy names of
        ``GPT2Config.LEGACY_KEYS`` are accepted).

    Returns:
      (config, params): params is the float32 pytree of ``GPT2(config)`` (fp16/bf16 checkpoints are
      upcast).

    Raises:
      FileNotFoundError: the directory, ``config.json`` or the weights are missing.
      ValueError: an unsupported GPT-2 variant, missing tensors, or shapes that disagree with
        ``config.json``; a ``lm_head.weight`` that differs from ``wte.weight``; ``dcp=True`` with
        neither a DCP file nor ``rng``.
      ImportError: a ``pytorch_model.bin`` checkpoint without torch installed.
    """
    path = os.fspath(path)
    hf = read_config(path, "GPT-2")
    dcp_path = os.path.join(path, DCP_NAME)
    has_dcp_file = os.path.isfile(dcp_path)
    want_dcp = has_dcp_file if dcp is None else bool(dcp)
    dcp_info = hf.get(DCP_CONFIG_KEY) or {}
    config_overrides = GPT2Config.current_names(config_overrides)
    dcp_overrides = {k: config_overrides.pop(k) for k in ("interaction_dim", "dcp_beta_init") if k in config_overrides}
    cfg = config_from_hf({k: v for k, v in hf.items() if k != DCP_CONFIG_KEY}, **config_overrides)

    raw = read_weights(path, "GPT-2")
    tensors = {(name[len("transformer."):] if name.startswith("transformer.") else name): arr
               for name, arr in raw.items()}
    expected = _expected_shapes(cfg)
    params: dict = {}
    _fill(params, tensors, expected, path)
    if "lm_head.weight" in tensors:
        head = np.asarray(tensors["lm_head.weight"], np.float32)
        if (head.shape != (cfg.vocab_size, cfg.d_model)
                or not np.array_equal(head, np.asarray(params["wte"]["embedding"]))):
            raise ValueError(f"{path}: lm_head.weight differs from wte.weight; untied heads are not supported")
    unexpected = sorted(n for n in tensors if n not in expected and n != "lm_head.weight" and not _IGNORED.match(n))
    if unexpected:
        warnings.warn(f"load_hf_gpt2: ignoring {len(unexpected)} unexpected tensor(s) in {path}, "
                      f"e.g. {unexpected[:5]}", stacklevel=2)

    if want_dcp and has_dcp_file:
        dcp_tensors = _read_safetensors(dcp_path)
        r = dcp_info.get("interaction_dim")
        if r is None:  # no config entry: take r from the tensors
            r = dcp_tensors["h.0.attn.q_int.weight"].shape[1] if "h.0.attn.q_int.weight" in dcp_tensors else cfg.interaction_dim
        cfg = cfg.replace(dcp=True, interaction_dim=int(r),
                          dcp_beta_init=float(dcp_info.get("beta_init", cfg.dcp_beta_init)), **dcp_overrides)
        _fill(params, dcp_tensors, _dcp_expected_shapes(cfg), dcp_path)
    elif want_dcp:
        if rng is None:
            raise ValueError(f"dcp=True but {dcp_path} does not exist: pass rng to initialise fresh "
                             "interaction parameters")
        cfg, params = cfg.add_dcp_params(params, rng, interaction_dim=dcp_overrides.get("interaction_dim"),
                                         beta_init=dcp_overrides.get("dcp_beta_init"))
    return cfg, params


def save_hf_gpt2(cfg: GPT2Config, params: dict, path: str | os.PathLike, *, dcp: str = "separate") -> None:
    """Write ``params`` of ``GPT2(cfg)`` as a Hugging Face GPT-2 checkpoint directory.

    Writes ``config.json`` and ``model.safetensors`` (float32, the names ``save_pretrained`` of
    ``GPT2LMHeadModel`` uses — ``transformer.`` prefix, no ``lm_head.weight`` since it is tied —
    and metadata ``{"format": "pt"}``),
    loadable by ``transformers.GPT2LMHeadModel.from_pretrained`` and by ``load_hf_gpt2``. With DCP:
    ``dcp="separate"`` (default) also writes ``dcp_interaction.safetensors`` and the
    ``"fox_jax_dcp"`` config entry (see the module docstring); ``dcp="drop"`` writes a plain GPT-2
    and warns that the interaction parameters were dropped.

    Args:
      cfg: the model config.
      params: the params pytree (any float dtype; saved as float32).
      path: output directory (created if needed; existing files of these names are overwritten).
      dcp: ``"separate"`` or ``"drop"``.

    Raises:
      ValueError: unknown ``dcp`` mode; params missing a tensor or with a shape that disagrees with cfg.
    """
    if dcp not in ("separate", "drop"):
        raise ValueError(f"dcp must be 'separate' or 'drop', got {dcp!r}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)

    def collect(expected):
        out = {}
        for name, (fpath, shape) in expected.items():
            try:
                arr = np.asarray(_get(params, fpath), dtype=np.float32)
            except KeyError:
                raise ValueError(f"params lack {'/'.join(fpath)} (needed for {name})") from None
            if fpath[-1] == "beta" and arr.shape == ():
                arr = arr.reshape(1)
            if arr.shape != shape:
                raise ValueError(f"params {'/'.join(fpath)} has shape {arr.shape}, expected {shape}")
            out[name] = np.ascontiguousarray(arr)
        return out

    save_cfg = cfg
    if cfg.dcp and dcp == "drop":
        warnings.warn("save_hf_gpt2: dropping the DCP interaction parameters (q_int, k_int, beta); "
                      "the saved model is a plain GPT-2", stacklevel=2)
        save_cfg = cfg.replace(dcp=False)
    dense = {"transformer." + name: arr for name, arr in collect(_expected_shapes(cfg)).items()}
    _save_safetensors(dense, os.path.join(path, SAFETENSORS_NAME), metadata={"format": "pt"})
    dcp_path = os.path.join(path, DCP_NAME)
    if save_cfg.dcp:
        _save_safetensors(collect(_dcp_expected_shapes(cfg)), dcp_path, metadata={"format": "pt"})
    elif os.path.exists(dcp_path):
        os.remove(dcp_path)  # a stale file would turn the plain model into a DCP one on load
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(config_to_hf(save_cfg), f, indent=2, sort_keys=True)
        f.write("\n")
