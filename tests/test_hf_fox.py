"""Official FoX checkpoints in and out (fox_jax.models.hf_fox).

The fixtures in tests/fixtures/official_fox/<variant>/ were written once by
tests/fixtures/make_official_fox.py with the official model code (float32, CPU): the official
checkpoint (config.json, model.safetensors from its save_pretrained) and io.npz with the input ids and
the official logits. These tests need neither the official code nor ../shared.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from fox_jax.models import LanguageModel, ModelConfig, load_official_fox, save_official_fox
from fox_jax.models.hf_fox import (FOX_MODEL_TYPE, TRANSFORMER_MODEL_TYPE, config_from_official,
                                   config_to_official, params_from_official, params_to_official)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "official_fox")
VARIANTS = {"fox_llama": "fox-llama", "fox_pro": "fox-pro", "transformer_pro": "transformer-pro",
            "transformer_llama": "transformer-llama"}
# float32 logits of two float32 implementations of the same model (O(1)-sized weights, logits up to ~4.5):
# they differ only in the order of the fp32 accumulations (matmuls, norms, softmax), ~1e-6 measured;
# 1e-5 absolute leaves a margin for other BLAS builds and is far below any mapping error (>1e-2).
ATOL = 1e-5


def _logits(cfg, params, tokens):
    return np.asarray(LanguageModel(cfg).apply({"params": params}, tokens).logits, np.float32)


def _shapes(tree):
    return jax.tree_util.tree_map(lambda x: tuple(x.shape), tree)


def _hf(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_official_logits(variant):
    path = os.path.join(FIXTURES, variant)
    cfg, params = load_official_fox(path)
    assert cfg.arch == VARIANTS[variant]
    assert _shapes(params) == _shapes(cfg.init_params(jax.random.PRNGKey(0)))
    io = np.load(os.path.join(path, "io.npz"))
    np.testing.assert_allclose(_logits(cfg, params, io["input_ids"]), io["logits"], rtol=0, atol=ATOL)


def test_fixture_configs_cover_the_variants():
    assert config_from_official(_hf(os.path.join(FIXTURES, "transformer_llama"))).kv_heads == 1  # GQA
    pro = config_from_official(_hf(os.path.join(FIXTURES, "transformer_pro")))
    assert pro.qk_norm_shared and pro.use_rope and not pro.use_fgate and pro.kv_shift
    fox = config_from_official(_hf(os.path.join(FIXTURES, "fox_pro")))
    assert fox.use_fgate and not fox.use_rope and not fox.qk_norm_shared and fox.output_gate and fox.output_norm


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_round_trip_is_exact(variant, tmp_path):
    src = os.path.join(FIXTURES, variant)
    cfg, params = load_official_fox(src)
    save_official_fox(cfg, params, tmp_path)
    cfg2, params2 = load_official_fox(tmp_path)
    assert cfg2 == cfg
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                           params, params2)
    # The written tensors are the official ones, bit for bit, under the same names.
    original, written = load_file(os.path.join(src, "model.safetensors")), load_file(tmp_path / "model.safetensors")
    assert sorted(written) == sorted(original)
    for name in original:
        np.testing.assert_array_equal(written[name], original[name], err_msg=name)
    hf, hf2 = _hf(src), _hf(tmp_path)
    for key in set(hf2) - {"max_position_embeddings", "fuse_cross_entropy", "transformers_version", "dtype"}:
        assert hf2[key] == hf[key], key


def _random_params(cfg, seed=0):
    params = cfg.init_params(jax.random.PRNGKey(seed))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


_SMALL = dict(vocab_size=96, d_model=32, n_layers=2, n_heads=2, mlp_dim=48)


@pytest.mark.parametrize("arch,extra,model_type", [
    ("fox-llama", {}, FOX_MODEL_TYPE),
    ("fox-pro", {"tie_embeddings": True}, FOX_MODEL_TYPE),
    ("transformer-pro", {"qk_norm_shared": True}, FOX_MODEL_TYPE),
    ("transformer-llama", {"n_heads": 4, "n_kv_heads": 2, "mlp_dim": None, "hidden_ratio": 3.5},
     TRANSFORMER_MODEL_TYPE),
])
@pytest.mark.slow
def test_export_then_load_gives_identical_logits(arch, extra, model_type, tmp_path):
    from fox_jax.models import preset

    cfg = preset("tiny", arch, **dict(_SMALL, **extra))
    params = _random_params(cfg)
    save_official_fox(cfg, params, tmp_path)
    hf = _hf(tmp_path)
    assert hf["model_type"] == model_type
    names = set(load_file(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in names) == (not cfg.tie_embeddings)
    cfg2, params2 = load_official_fox(tmp_path)
    assert cfg2 == cfg
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 12)).astype(np.int32)
    np.testing.assert_array_equal(_logits(cfg2, params2, tokens), _logits(cfg, params, tokens))


def test_transformer_llama_fits_the_fox_class_too(tmp_path):
    from fox_jax.models import preset

    cfg = preset("tiny", "transformer-llama", **_SMALL)
    params = _random_params(cfg)
    save_official_fox(cfg, params, tmp_path, model_type=FOX_MODEL_TYPE)
    hf = _hf(tmp_path)
    assert hf["model_type"] == FOX_MODEL_TYPE and hf["fgate_type"] == "none" and hf["use_rope"]
    cfg2, params2 = load_official_fox(tmp_path)
    assert cfg2 == cfg
    assert _shapes(params2) == _shapes(params)


def test_pytorch_bin_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    src = os.path.join(FIXTURES, "fox_pro")
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    torch.save({k: torch.from_numpy(v.copy()) for k, v in load_file(os.path.join(src, "model.safetensors")).items()},
               tmp_path / "pytorch_model.bin")
    cfg, params = load_official_fox(src)
    cfg2, params2 = load_official_fox(tmp_path)
    assert cfg2 == cfg
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                           params, params2)


# --- config mapping ---------------------------------------------------------------------------

def _fox_config(**kw):
    return dict({"model_type": FOX_MODEL_TYPE, "vocab_size": 64, "hidden_size": 32, "num_heads": 2,
                 "num_hidden_layers": 1}, **kw)


def test_config_defaults_and_mlp_width():
    # The official MLP width: 256 * ceil(int(d * ratio * 2/3) / 256) unless intermediate_size is given.
    assert config_from_official(_fox_config(hidden_size=768, num_heads=12)).mlp_hidden == 2048
    assert config_from_official(_fox_config(hidden_size=1536, num_heads=24, hidden_ratio=3.5)).mlp_hidden == 3584
    assert config_from_official(_fox_config(hidden_ratio=None, intermediate_size=40)).mlp_hidden == 40
    cfg = config_from_official(_fox_config())
    assert (cfg.arch, cfg.use_fgate, cfg.use_rope, cfg.norm_eps, cfg.adaptive_threshold) == (
        "fox-llama", True, False, 1e-6, None)
    tcfg = config_from_official({"model_type": TRANSFORMER_MODEL_TYPE, "hidden_size": 32, "num_heads": 2})
    assert (tcfg.arch, tcfg.use_rope, tcfg.rope_base) == ("transformer-llama", True, 500000.0)


def test_acp_tolerance_maps_to_auto():
    cfg = config_from_official(_fox_config(log_pruning_tolerance=-10.0))
    assert cfg.adaptive_threshold == "auto"
    assert config_to_official(cfg)["log_pruning_tolerance"] == -10.0


@pytest.mark.parametrize("field,value,extra", [
    ("fgate_type", "bias_only", {}),
    ("fgate_type", "fixed", {}),
    ("fgate_bias_init", True, {}),
    ("decay_time_min", 4.0, {}),
    ("ogate_act", "silu", {"use_output_gate": True}),
    ("hidden_act", "sigmoid", {}),
    ("use_k_shift", True, {"use_v_shift": False}),
    ("num_kv_heads", 1, {}),
    ("log_pruning_tolerance", -5.0, {}),
    ("hidden_size", 30, {"num_heads": 4}),
])
def test_unsupported_config_field_is_refused(field, value, extra):
    with pytest.raises(ValueError, match=field):
        config_from_official(_fox_config(**{field: value}, **extra))


def test_transformer_window_size_is_refused():
    with pytest.raises(ValueError, match="window_size"):
        config_from_official({"model_type": TRANSFORMER_MODEL_TYPE, "hidden_size": 32, "num_heads": 2,
                              "window_size": 512})


def test_unknown_model_type_and_field():
    with pytest.raises(ValueError, match="model_type"):
        config_from_official({"model_type": "llama", "hidden_size": 32, "num_heads": 2})
    with pytest.warns(UserWarning, match="new_option"):
        config_from_official(_fox_config(new_option=1))


@pytest.mark.parametrize("cfg,match", [
    (ModelConfig(**_SMALL, dcp=True), "dcp"),
    (ModelConfig(**_SMALL, head_dim=8), "head_dim"),
    (ModelConfig(**dict(_SMALL, n_heads=4), n_kv_heads=2), "n_kv_heads"),
    (ModelConfig(**_SMALL, adaptive_threshold=-20.0), "adaptive_threshold"),
])
def test_unrepresentable_config_is_refused_on_export(cfg, match):
    with pytest.raises(ValueError, match=match):
        config_to_official(cfg)


def test_fox_config_cannot_use_the_transformer_class():
    with pytest.raises(ValueError, match=FOX_MODEL_TYPE):
        config_to_official(ModelConfig(**_SMALL), model_type=TRANSFORMER_MODEL_TYPE)


# --- strict weights ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fox_pro():
    path = os.path.join(FIXTURES, "fox_pro")
    return load_official_fox(path)[0], load_file(os.path.join(path, "model.safetensors"))


def test_missing_tensor(fox_pro):
    cfg, state = fox_pro
    state = dict(state)
    del state["model.layers.1.attn.k_proj.shift_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.attn\.k_proj\.shift_proj\.weight"):
        params_from_official(state, cfg)


def test_unexpected_tensor(fox_pro):
    cfg, state = fox_pro
    state = dict(state, **{"model.layers.0.attn.fgate_bias": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.attn\.fgate_bias"):
        params_from_official(state, cfg)


def test_shape_mismatch(fox_pro, tmp_path):
    cfg, state = fox_pro
    src = os.path.join(FIXTURES, "fox_pro")
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    state = dict(state)
    state["model.layers.0.mlp.down_proj.weight"] = np.zeros((32, 65), np.float32)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*\(32, 65\)"):
        load_official_fox(tmp_path)


def test_tied_head_must_equal_embedding(fox_pro):
    cfg, state = fox_pro
    tied = cfg.replace(tie_embeddings=True)
    state = dict(state)
    state["lm_head.weight"] = state["model.embeddings.weight"].copy()
    params = params_from_official(state, tied)
    assert "lm_head" not in params
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="lm_head.weight"):
        params_from_official(state, tied)


def test_export_rejects_extra_or_missing_params(fox_pro):
    cfg, state = fox_pro
    params = params_from_official(state, cfg)
    extra = dict(params, layers_0=dict(params["layers_0"], attn=dict(params["layers_0"]["attn"], beta=np.zeros(()))))
    with pytest.raises(ValueError, match="layers_0/attn/beta"):
        params_to_official(cfg, extra)
    missing = dict(params)
    del missing["lm_head"]
    with pytest.raises(ValueError, match="lm_head/kernel"):
        params_to_official(cfg, missing)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_official_fox(tmp_path)
    shutil.copy(os.path.join(FIXTURES, "fox_llama", "config.json"), tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_official_fox(tmp_path)
