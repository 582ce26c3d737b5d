"""GPT-2 (Flax) against Hugging Face transformers, HF import/export, and the DCP variant."""

import json
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.models.gpt2 import GPT2, GPT2Config, gpt2_preset
from fox_jax.models.hf_gpt2 import DCP_NAME, load_hf_gpt2, save_hf_gpt2

SHARED_DATA = Path(os.environ.get("FOX_JAX_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
GPT2_TOKENIZER_DIR = SHARED_DATA / "tokenizers" / "gpt2"

TINY_HF = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=50257, n_positions=128)  # transformers' names
TINY = dict(n_layers=2, d_model=64, n_heads=4, vocab_size=50257, n_positions=128)


@pytest.fixture(scope="module")
def hf_model():
    """A small randomly initialised transformers GPT2LMHeadModel with non-trivial LN and biases."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_HF)).eval()
    with torch.no_grad():  # HF inits LayerNorm to 1/0 and biases to 0: perturb them all
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_gpt2")
    hf_model.save_pretrained(path)  # safetensors
    assert (path / "model.safetensors").exists()
    return path


@pytest.fixture(scope="module")
def own_dir(tmp_path_factory):
    """A checkpoint written by save_hf_gpt2 from a random init (no torch needed)."""
    cfg = GPT2Config(**TINY)
    params = cfg.init_params(jax.random.PRNGKey(3))
    rng = np.random.default_rng(3)
    params = jax.tree_util.tree_map(  # non-trivial LayerNorm and biases
        lambda x: np.asarray(x) + 0.1 * rng.standard_normal(x.shape, np.float32), params)
    path = tmp_path_factory.mktemp("own_gpt2")
    save_hf_gpt2(cfg, params, path)
    return path


def sample_tokens():
    """[2, T] token ids: real GPT-2 BPE text when the shared tokenizer files exist, else random."""
    if (GPT2_TOKENIZER_DIR / "vocab.json").exists():
        tokenizers = pytest.importorskip("tokenizers")
        tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(
            str(GPT2_TOKENIZER_DIR / "vocab.json"), str(GPT2_TOKENIZER_DIR / "merges.txt")))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        assert tok.encode("Hello world").ids == [15496, 995]  # GPT-2 BPE
        texts = ["The Forgetting Transformer prunes the context it no longer needs, token by token.",
                 "It was the best of times, it was the worst of times, it was the age of wisdom."]
        ids = [tok.encode(t).ids for t in texts]
        n = min(len(i) for i in ids)
        assert n >= 10 and max(max(i) for i in ids) < 50257
        return np.asarray([i[:n] for i in ids], np.int32)
    return np.random.default_rng(0).integers(0, 50257, (2, 21)).astype(np.int32)


def hf_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def test_import_matches_transformers(hf_model, hf_dir):
    cfg, params = load_hf_gpt2(hf_dir)
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.vocab_size, cfg.n_positions) == (2, 4, 64, 50257, 128)
    assert not cfg.dcp and cfg.norm_eps == 1e-5
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == cfg.param_count()
    tokens = sample_tokens()
    out = jax.jit(lambda p, t: GPT2(cfg).apply({"params": p}, t))(params, tokens)
    logits = out.logits
    assert out.aux == {} and out.cache is None and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, hf_logits(hf_model, tokens), atol=1e-4, rtol=1e-4)
    # The tree has exactly the structure of a fresh init.
    fresh = cfg.init_params(jax.random.PRNGKey(0))
    assert jax.tree_util.tree_structure(fresh) == jax.tree_util.tree_structure(params)


@pytest.mark.slow
def test_export_reloads_in_transformers(hf_model, hf_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg, params = load_hf_gpt2(hf_dir)
    params = jax.tree_util.tree_map(lambda x: x * 1.01, params)  # make it differ from the source
    save_hf_gpt2(cfg, params, tmp_path / "out")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    tokens = sample_tokens()
    ours = GPT2(cfg).apply({"params": params}, tokens).logits
    np.testing.assert_allclose(hf_logits(reloaded, tokens), ours, atol=1e-4, rtol=1e-4)
    cfg2, params2 = load_hf_gpt2(tmp_path / "out")
    assert cfg2 == cfg
    jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)


def test_pytorch_bin_checkpoint(hf_model, tmp_path):
    import torch

    # A legacy checkpoint: pytorch_model.bin with the tied lm_head and the old causal-mask buffers.
    hf_model.config.save_pretrained(tmp_path)
    state = dict(hf_model.state_dict())
    assert "lm_head.weight" in state
    for i in range(hf_model.config.n_layer):
        state[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
    torch.save(state, tmp_path / "pytorch_model.bin")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # buffers and the tied head are ignored silently
        cfg, params = load_hf_gpt2(tmp_path)
    tokens = sample_tokens()
    np.testing.assert_allclose(GPT2(cfg).apply({"params": params}, tokens).logits, hf_logits(hf_model, tokens),
                               atol=1e-4, rtol=1e-4)


def test_dcp_round_trip_and_hf_compatibility(hf_model, hf_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg, params = load_hf_gpt2(hf_dir)
    dcfg, dparams = load_hf_gpt2(hf_dir, dcp=True, rng=jax.random.PRNGKey(1), interaction_dim=16)
    assert dcfg.dcp and dcfg.interaction_dim == 16 and dcfg.dcp_beta_init == 2.0
    assert dparams["h_1"]["attn"]["q_int"]["kernel"].shape == (64, 16)
    assert sum(x.size for x in jax.tree_util.tree_leaves(dparams)) == dcfg.param_count()
    save_hf_gpt2(dcfg, dparams, tmp_path / "dcp")
    assert (tmp_path / "dcp" / DCP_NAME).exists()
    assert json.loads((tmp_path / "dcp" / "config.json").read_text())["fox_jax_dcp"]["interaction_dim"] == 16
    cfg_back, params_back = load_hf_gpt2(tmp_path / "dcp")
    assert cfg_back == dcfg
    jax.tree_util.tree_map(np.testing.assert_array_equal, params_back, dparams)
    # The dense part is still a valid HF GPT-2 checkpoint.
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "dcp").eval()
    tokens = sample_tokens()
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(hf_model, tokens), atol=1e-5)
    dense_cfg, _ = load_hf_gpt2(tmp_path / "dcp", dcp=False)
    assert not dense_cfg.dcp
    with pytest.warns(UserWarning, match="dropping the DCP"):
        save_hf_gpt2(dcfg, dparams, tmp_path / "dcp", dcp="drop")
    assert not (tmp_path / "dcp" / DCP_NAME).exists()
    assert not load_hf_gpt2(tmp_path / "dcp")[0].dcp


def test_own_checkpoint_round_trip(own_dir):
    cfg, params = load_hf_gpt2(own_dir)
    assert cfg == GPT2Config(**TINY)
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == cfg.param_count()
    conf = json.loads((own_dir / "config.json").read_text())
    assert conf["model_type"] == "gpt2" and conf["activation_function"] == "gelu_new"
    from safetensors.numpy import load_file

    names = set(load_file(str(own_dir / "model.safetensors")))
    assert "transformer.h.1.attn.c_attn.weight" in names and "lm_head.weight" not in names


def test_bfloat16_checkpoint_loads(own_dir, tmp_path):
    """A bf16 ``model.safetensors`` (written by the safetensors library itself) loads as float32 params equal
    to the stored bf16 values."""
    import shutil

    from safetensors.flax import load_file, save_file

    bf = tmp_path / "bf16"
    bf.mkdir()
    shutil.copyfile(own_dir / "config.json", bf / "config.json")
    tensors = {k: v.astype(jnp.bfloat16) for k, v in load_file(str(own_dir / "model.safetensors")).items()}
    save_file(tensors, str(bf / "model.safetensors"), metadata={"format": "pt"})
    cfg, params = load_hf_gpt2(bf)
    assert cfg == GPT2Config(**TINY)
    kernel = params["h_1"]["attn"]["c_attn"]["kernel"]
    assert kernel.dtype == jnp.float32
    np.testing.assert_array_equal(kernel, np.asarray(tensors["transformer.h.1.attn.c_attn.weight"], np.float32))


@pytest.mark.slow
def test_dcp_model_keep_all_equals_dense_and_trains(own_dir):
    cfg, params = load_hf_gpt2(own_dir)
    dcfg, dparams = cfg.add_dcp_params(params, jax.random.PRNGKey(2), interaction_dim=8, beta_init=50.0)
    tokens = sample_tokens()
    dense = GPT2(cfg).apply({"params": params}, tokens).logits
    model = GPT2(dcfg)
    fwd = jax.jit(lambda p, t, a: model.apply({"params": p}, t, alpha=a))
    for alpha in (float("inf"), 1.5):  # β = 50 ≫ the support edge: every pair is kept exactly
        out = fwd(dparams, tokens, jnp.float32(alpha))
        logits, aux = out.logits, out.aux
        np.testing.assert_allclose(logits, dense, atol=1e-5)
        t = tokens.shape[1]
        assert aux["log_masks"].shape == (2, 2, t, t)
        np.testing.assert_array_equal(aux["sparsity"], 0.0)
        assert float(aux["sparsity_loss"]) == pytest.approx(1.0)
    # β = 0 and the α = 1.5 window: soft drops, finite gradients into every parameter.
    dparams = jax.tree_util.tree_map(lambda x: x, dparams)
    for i in range(dcfg.n_layers):
        dparams[f"h_{i}"]["attn"]["beta"] = jnp.zeros((), jnp.float32)
        dparams[f"h_{i}"]["attn"]["q_int"]["kernel"] = dparams[f"h_{i}"]["attn"]["q_int"]["kernel"] * 50

    def loss(p, alpha):
        out = model.apply({"params": p}, tokens[:, :-1], alpha=alpha)
        logits, aux = out.logits, out.aux
        ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))
        return ce + 0.3 * aux["sparsity_loss"], aux

    (val, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(dparams, jnp.float32(1.5))
    assert np.isfinite(float(val))
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        assert np.all(np.isfinite(np.asarray(g))), path
    attn_g = grads["h_0"]["attn"]
    assert float(jnp.abs(attn_g["q_int"]["kernel"]).max()) > 0 and float(jnp.abs(attn_g["beta"])) > 0
    assert float(aux["sparsity_loss"]) < 1.0
    # The inference step mask drops pairs and the metric sees them.
    aux_inf = fwd(dparams, tokens, jnp.float32(float("inf"))).aux
    assert float(jnp.max(aux_inf["sparsity"])) > 0


@pytest.mark.slow
def test_gpt2_config_and_model_errors():
    cfg = GPT2Config(n_layers=1, n_heads=2, d_model=16, vocab_size=100, n_positions=8, dcp=True, interaction_dim=4)
    params = cfg.init_params(jax.random.PRNGKey(0))
    assert float(params["h_0"]["attn"]["beta"]) == 2.0
    with pytest.raises(ValueError, match="alpha"):
        GPT2(cfg).apply({"params": params}, jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="n_positions"):
        GPT2(cfg).apply({"params": params}, jnp.zeros((1, 9), jnp.int32), alpha=2.0)
    with pytest.raises(ValueError, match="tokens"):
        GPT2(cfg).apply({"params": params}, jnp.zeros((1, 4)), alpha=2.0)
    with pytest.raises(ValueError, match="divisible"):
        GPT2Config(d_model=10, n_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        GPT2Config(dtype="float64")
    with pytest.raises(ValueError, match="already"):
        cfg.add_dcp_params(params, jax.random.PRNGKey(0))
    assert gpt2_preset("gpt2-medium").n_layers == 24
    assert gpt2_preset("gpt2").param_count() == 124439808  # GPT-2 small, tied head
    assert gpt2_preset("gpt2", dcp=True).param_count() - 124439808 == 12 * (2 * 768 * 64 + 1)
    # bfloat16 compute, packed documents and explicit positions run and stay finite.
    bcfg = cfg.replace(dtype="bfloat16")
    seg = jnp.asarray([[0, 0, 0, 1, 1, 1]])
    pos = jnp.asarray([[0, 1, 2, 0, 1, 2]])
    logits = jax.jit(lambda p: GPT2(bcfg).apply({"params": p}, jnp.ones((1, 6), jnp.int32), alpha=1.5,
                                                positions=pos, segment_ids=seg).logits)(params)
    assert logits.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(logits)))


def test_hf_loading_errors(own_dir, tmp_path):
    hf_dir = own_dir
    with pytest.raises(FileNotFoundError, match="directory"):
        load_hf_gpt2(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_gpt2(empty)
    (empty / "config.json").write_text((Path(hf_dir) / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_gpt2(empty)
    # A config that disagrees with the weights.
    bad = tmp_path / "bad"
    bad.mkdir()
    conf = json.loads((Path(hf_dir) / "config.json").read_text())
    conf["n_positions"] = 256
    (bad / "config.json").write_text(json.dumps(conf))
    (bad / "model.safetensors").symlink_to(Path(hf_dir) / "model.safetensors")
    with pytest.raises(ValueError, match="wpe.weight"):
        load_hf_gpt2(bad)
    conf["activation_function"] = "relu"
    (bad / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="activation_function"):
        load_hf_gpt2(bad)
    with pytest.raises(ValueError, match="rng"):
        load_hf_gpt2(hf_dir, dcp=True)
    with pytest.raises(ValueError, match="dcp"):
        save_hf_gpt2(GPT2Config(n_layers=1, n_heads=2, d_model=16), {}, tmp_path / "x", dcp="keep")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_hf_gpt2(hf_dir)  # a clean checkpoint loads without warnings
