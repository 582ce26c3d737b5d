"""Dynamic Context Pruning in the FoX / Transformer language models (docs/design/dcp.md §1, §3;
docs/design/fox_acp.md §2): config fields, parameters, the layer's mask and attention, the model's aux."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fox_jax.nn.attention as attention_mod
from fox_jax.models import ModelConfig, preset
from fox_jax.models.lm import LanguageModel, count_params
from fox_jax.nn.attention import ForgettingAttentionLayer
from fox_jax.ops.context_pruning import LOG_FLOOR, dcp_attention_reference

DCP_ARCHS = ["fox-llama", "fox-pro", "transformer-llama"]
VOCAB, T = 64, 13  # T is not a multiple of the 8-wide attention tiles


def tiny(arch, **kw):
    """2 layers, d = 32, 4 query heads over 2 KV heads (GQA), r = 8, 8-wide DCP tiles."""
    base = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention_block=8,
                interaction_dim=8)
    return preset("tiny", arch, **{**base, **kw})


def tokens_and_segments(seed=0, b=2):
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (b, T), 0, VOCAB)
    seg = jnp.asarray(np.stack([np.zeros(T, int), np.arange(T) // 6]), jnp.int32)[:b]
    return tokens, seg


def init(cfg, seed=0):
    """``cfg.init_params`` compiled as one program (eagerly, XLA compiles each op of the init separately)."""
    return jax.jit(cfg.init_params)(jax.random.PRNGKey(seed))


def apply_fn(cfg, **kw):
    """``LanguageModel(cfg).apply`` jitted: (params, *args) -> ModelOutput (``kw``: static options)."""
    model = LanguageModel(cfg)
    return jax.jit(lambda p, *a: model.apply({"params": p}, *a, **kw))


def abstract_count(cfg):
    return count_params(jax.eval_shape(lambda: cfg.init_params(jax.random.PRNGKey(0))))


# ---------------------------------------------------------------------------------------------
# Config and parameters
# ---------------------------------------------------------------------------------------------

def test_config_fields_and_validation():
    cfg = ModelConfig()
    assert (cfg.dcp, cfg.interaction_dim, cfg.dcp_beta_init) == (False, 64, 2.0)
    for kw, match in [(dict(interaction_dim=0), "interaction_dim"), (dict(interaction_dim=True), "interaction_dim"),
                      (dict(interaction_dim=8.0), "interaction_dim"), (dict(dcp_beta_init=math.nan), "dcp_beta_init"),
                      (dict(dcp_beta_init="2"), "dcp_beta_init"), (dict(dcp=1), "dcp must be a bool"),
                      (dict(dcp=True, adaptive_threshold="auto"), "adaptive_threshold"),
                      (dict(dcp=True, adaptive_threshold=-5.0), "adaptive_threshold")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig(**kw)
    ModelConfig(dcp=False, adaptive_threshold="auto")  # ACP alone stays valid


@pytest.mark.parametrize("arch", ["fox-llama", "fox-pro", "transformer-llama", "transformer-pro"])
def test_param_count_off_unchanged_and_on_exact(arch):
    cfg = tiny(arch)
    on = cfg.replace(dcp=True)
    assert cfg.param_count() == abstract_count(cfg)
    assert on.param_count() == abstract_count(on)
    assert on.param_count() - cfg.param_count() == cfg.n_layers * (2 * cfg.d_model * cfg.interaction_dim + 1)
    # The paper's 125M FoX count does not move with DCP off (r, β₀ are inert then).
    big = preset("125M", arch)
    assert big.param_count() == big.replace(interaction_dim=7, dcp_beta_init=-1.0).param_count()


def test_added_params_initialised_as_specified():
    cfg = tiny("fox-llama")
    params = init(cfg)
    new_cfg, new = cfg.add_dcp_params(params, jax.random.PRNGKey(1))
    assert new_cfg == cfg.replace(dcp=True)
    # Same structure and shapes as a DCP model initialised from scratch.
    fresh = init(new_cfg)
    shapes = lambda p: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), p)
    assert shapes(new) == shapes(fresh)
    d, r = cfg.d_model, cfg.interaction_dim
    kernels = []
    for i in range(cfg.n_layers):
        attn = new[f"layers_{i}"]["attn"]
        assert attn["beta"].shape == () and attn["beta"].dtype == jnp.float32 and float(attn["beta"]) == 2.0
        assert float(fresh[f"layers_{i}"]["attn"]["beta"]) == 2.0
        for name in ("q_int", "k_int"):
            assert attn[name]["kernel"].shape == (d, r) and attn[name]["kernel"].dtype == jnp.float32
            kernels.append(np.asarray(attn[name]["kernel"]))
        # Existing weights are kept, the input pytree is untouched.
        assert attn["q_proj"]["kernel"] is params[f"layers_{i}"]["attn"]["q_proj"]["kernel"]
        assert "q_int" not in params[f"layers_{i}"]["attn"]
    w = np.concatenate([k.ravel() for k in kernels])  # 4·256 draws of N(0, 0.02²)
    assert abs(w.std() / cfg.init_std - 1.0) < 0.1 and abs(w.mean()) < 0.1 * cfg.init_std
    assert not np.allclose(kernels[0], kernels[1])  # independent keys per projection
    c2, p2 = cfg.add_dcp_params(params, jax.random.PRNGKey(1), interaction_dim=4, beta_init=5.0)
    assert c2.interaction_dim == 4 and p2["layers_0"]["attn"]["k_int"]["kernel"].shape == (d, 4)
    assert float(p2["layers_1"]["attn"]["beta"]) == 5.0
    with pytest.raises(ValueError, match="already"):
        new_cfg.add_dcp_params(new, jax.random.PRNGKey(1))
    with pytest.raises(ValueError, match="layers_1"):
        cfg.add_dcp_params({"layers_0": params["layers_0"]}, jax.random.PRNGKey(1))


# ---------------------------------------------------------------------------------------------
# Behaviour
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("arch", ["fox-pro", "transformer-llama"])
def test_huge_beta_keeps_everything_and_equals_dense_model(arch):
    # fox-pro and transformer-llama: the DCP attention with and without forget gates (fox-pro's blocks are
    # fox-llama's plus QK-norm, KV-shift and the output gate, so fox-llama adds no path; it runs with DCP in
    # the other tests of this file)
    # β = 1e4: log σ_α(z) = 0 exactly in float32 for every α, so log I ≡ 0 and the DCP model is the
    # dense model with the same weights. Tolerance 1e-5: blockwise dcp_attention vs the dense model's
    # attention op, both float32 (a few ulps of O(1) logits after two layers).
    cfg = tiny(arch)
    params = init(cfg)
    dcp_cfg, dcp_params = cfg.add_dcp_params(params, jax.random.PRNGKey(1), beta_init=1e4)
    tokens, seg = tokens_and_segments()
    want = apply_fn(cfg)(params, tokens, seg).logits
    for alpha in (1.0, float("inf")):
        out = apply_fn(dcp_cfg, alpha=alpha)(dcp_params, tokens, seg)
        logits, aux = out.logits, out.aux
        assert logits.dtype == jnp.float32 and logits.shape == (2, T, VOCAB)
        np.testing.assert_allclose(logits, want, atol=1e-5, rtol=1e-5)
        assert aux["log_masks"].shape == (cfg.n_layers, 2, T, T) and aux["log_masks"].dtype == jnp.float32
        np.testing.assert_array_equal(aux["log_masks"], 0.0)
        np.testing.assert_array_equal(aux["sparsity"], np.zeros(cfg.n_layers))
        np.testing.assert_allclose(aux["sparsity_loss"], 1.0, rtol=1e-6)  # mean keep probability


@pytest.mark.parametrize("arch", DCP_ARCHS)
def test_hand_set_interaction_gives_known_mask_and_dense_reference(arch, monkeypatch):
    # q_int = a·x₀, k_int = b·x₁ (one nonzero weight each), β = 0, a·b/√r = 1: z_{k,j} = x₀[k]·x₁[j].
    # With x₀ ≡ 1 and x₁[j] = ±1, at α = ∞ every later query drops key j iff x₁[j] = −1, so
    #   log I_{k,j} = LOG_FLOOR if j < k and x₁[j] = −1, else 0.
    # The layer must return that mask and equal the dense oracle (docs/design/fox_acp.md §1.7 plus the
    # additive mask) applied to the layer's own q, k, v and log f (FoX) / no gate (Transformer).
    cfg = tiny(arch)
    dcp_cfg = cfg.replace(dcp=True)
    r = cfg.interaction_dim
    rng = np.random.default_rng(0)
    b = 2
    x = rng.normal(size=(b, T, cfg.d_model)).astype(np.float32)
    sign = np.where(rng.uniform(size=(b, T)) < 0.5, -1.0, 1.0).astype(np.float32)
    x[..., 0], x[..., 1] = 1.0, sign
    x = jnp.asarray(x)
    _, seg = tokens_and_segments(b=b)
    layer = ForgettingAttentionLayer(dcp_cfg)
    params = layer.init(jax.random.PRNGKey(0), x, seg, None, None, 1.0)["params"]
    scale = r ** 0.25
    params = dict(params, beta=jnp.zeros((), jnp.float32),
                  q_int={"kernel": jnp.zeros((cfg.d_model, r)).at[0, 0].set(scale)},
                  k_int={"kernel": jnp.zeros((cfg.d_model, r)).at[1, 0].set(scale)})
    res = layer.apply({"params": params}, x, seg, None, None, float("inf"))
    out, log_mask = res.x, res.log_mask
    assert res.cache is None
    lower = np.tril(np.ones((T, T), bool), -1)[None]
    known = np.where(lower & (sign[:, None, :] < 0), np.float32(LOG_FLOOR), np.float32(0.0))
    np.testing.assert_array_equal(log_mask, known)
    causal_pairs = known[:, lower[0]]
    assert (causal_pairs == 0).any() and (causal_pairs < 0).any()  # both kept and dropped pairs

    seen = {}

    def oracle(q, k, v, log_fgate, *, segment_ids=None, **_):
        seen["log_fgate"] = log_fgate
        return dcp_attention_reference(q, k, v, jnp.asarray(known), log_fgate, segment_ids=segment_ids)

    monkeypatch.setattr(attention_mod, "forgetting_attention", oracle)
    dense_params = {k: v for k, v in params.items() if k not in ("q_int", "k_int", "beta")}
    want = ForgettingAttentionLayer(cfg).apply({"params": dense_params}, x, seg).x
    assert (seen["log_fgate"] is None) == (not cfg.use_fgate)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", DCP_ARCHS)
def test_gradients_finite_and_reach_interaction_params(arch):
    # Soft mask (α = 1.5, traced), default β₀ = 2 plus a negative shift so pairs really get dropped;
    # the fine-tuning loss CE + γ·sparsity_loss, as train/finetune_dcp.py builds it. fox-pro runs
    # with remat to exercise the rematerialised block path with a traced α.
    cfg = tiny(arch, dcp=True, remat="full" if arch == "fox-pro" else "none")
    params = init(cfg)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x - 2.5 if path[-1].key == "beta" else x, params)
    tokens, seg = tokens_and_segments()
    model = LanguageModel(cfg)

    @jax.jit
    def loss_and_grad(params, alpha):
        def loss_fn(p):
            out = model.apply({"params": p}, tokens, seg, alpha=alpha)
            logits, aux = out.logits, out.aux
            ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]))
            return ce + 0.3 * aux["sparsity_loss"], aux
        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    (loss, aux), grads = loss_and_grad(params, jnp.float32(1.5))
    assert np.isfinite(float(loss))
    assert 0.0 < float(jnp.mean(aux["sparsity"])) < 1.0 or float(jnp.min(aux["log_masks"])) < -1.0
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.all(np.isfinite(np.asarray(g))), jax.tree_util.keystr(path)
    for i in range(cfg.n_layers):
        attn = grads[f"layers_{i}"]["attn"]
        for name in ("q_int", "k_int"):
            assert float(jnp.abs(attn[name]["kernel"]).max()) > 0.0, (i, name)
        assert float(jnp.abs(attn["beta"])) > 0.0
        if cfg.use_fgate:
            assert float(jnp.abs(attn["fgate_proj"]["kernel"]).max()) > 0.0


def test_alpha_required_and_decoding_uses_the_step_mask():
    cfg = tiny("fox-llama", dcp=True)
    params = init(cfg)
    tokens, _ = tokens_and_segments()
    model = LanguageModel(cfg)
    with pytest.raises(ValueError, match="alpha"):  # raised while tracing: no need to run it
        jax.eval_shape(lambda p, t: model.apply({"params": p}, t), params, tokens)
    # with a cache a DCP model decodes at α = ∞ (no alpha needed): the training path's logits at α = ∞
    out = jax.jit(lambda p, t, c: model.apply({"params": p}, t, cache=c))(
        params, tokens, cfg.init_cache(tokens.shape[0], T, policy="dcp"))
    want = apply_fn(cfg, alpha=float("inf"))(params, tokens).logits
    assert out.logits.dtype == jnp.float32 and len(out.cache) == cfg.n_layers
    np.testing.assert_allclose(out.logits, want, atol=1e-4, rtol=1e-4)  # float32, two summation orders
    # A dense model ignores alpha; its output has no aux.
    dense = tiny("fox-llama")
    out = apply_fn(dense, alpha=1.0)(init(dense), tokens)
    assert out.logits.shape == (2, T, VOCAB) and out.aux == {} and out.cache is None
