"""The model-family interface: both configs implement ``ModelFamily`` and both models return ``ModelOutput``."""

import collections
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.cache.policies import RING_BLOCK
from fox_jax.cache.slots import SlotKVCache
from fox_jax.models import MODEL_TYPES, GPT2Config, ModelConfig, ModelOutput, config_from_dict, preset
from fox_jax.nn.attention import LayerOutput

VOCAB = 61


def lm_cfg(**kw):
    return preset("tiny", "fox-pro", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, attention_block=16, **kw)


def gpt2_cfg(**kw):
    return GPT2Config(n_layers=2, n_heads=2, d_model=32, vocab_size=VOCAB, n_positions=32, attention_block=16, **kw)


FAMILIES = {"lm": lm_cfg, "gpt2": gpt2_cfg}


def init(cfg, seed=0):
    """``cfg.init_params`` compiled as one program (eagerly, XLA compiles each op of the init separately)."""
    return jax.jit(cfg.init_params)(jax.random.PRNGKey(seed))


def logits_fn(cfg, **kw):
    """The jitted ``apply(...).logits`` of ``cfg``'s model: params, tokens -> logits."""
    model = cfg.build()
    return jax.jit(lambda p, t: model.apply({"params": p}, t, **kw).logits)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_call_returns_model_output(family):
    """Every call returns a ``ModelOutput`` (a pytree: jit returns it, grad sees through it)."""
    cfg = FAMILIES[family]()
    params = init(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, VOCAB)
    model = cfg.build()
    dense = jax.jit(lambda p, t: model.apply({"params": p}, t))(params, tokens)
    assert isinstance(dense, ModelOutput) and dense.cache is None and dense.aux == {}
    assert dense.logits.shape == (2, 12, VOCAB)
    # dense and DCP with the same weights, and a decoding cache: the same output type
    dcp_cfg, dcp_params = cfg.add_dcp_params(params, jax.random.PRNGKey(2), interaction_dim=8, beta_init=1e4)
    dcp_model = dcp_cfg.build()
    dcp = jax.jit(lambda p, t: dcp_model.apply({"params": p}, t, alpha=float("inf")))(dcp_params, tokens)
    assert isinstance(dcp, ModelOutput) and dcp.cache is None
    assert dcp.logits.dtype == jnp.float32 and set(dcp.aux) == {"log_masks", "sparsity", "sparsity_loss"}
    assert dcp.aux["log_masks"].shape == (2, 2, 12, 12) and dcp.aux["sparsity"].shape == (2,)
    np.testing.assert_allclose(dcp.logits, dense.logits, atol=1e-4)  # β₀ = 1e4 keeps every pair
    caches = cfg.init_cache(2, 16)
    assert len(caches) == cfg.n_layers and all(isinstance(c, SlotKVCache) for c in caches)
    assert all(c.policy.spec == "dense" and c.capacity == RING_BLOCK for c in caches)  # 16 rounded up
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, cache=c))(params, tokens[:, :5], caches)
    assert isinstance(step, ModelOutput) and step.aux == {} and len(step.cache) == cfg.n_layers
    assert int(step.cache[0].length) == 5
    np.testing.assert_allclose(step.logits, dense.logits[:, :5], atol=1e-4)
    grads = jax.jit(jax.grad(lambda p: jnp.mean(model.apply({"params": p}, tokens).logits)))(params)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params)


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_and_layers_return_layer_output(family):
    cfg = FAMILIES[family]()
    params = init(cfg)
    model = cfg.build()
    _, state = jax.jit(lambda p, t: model.apply({"params": p}, t, capture_intermediates=True))(
        params, jnp.zeros((1, 6), jnp.int32))
    outs = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, LayerOutput))
    attn = [o for o in outs if isinstance(o, LayerOutput)]
    assert len(attn) == 2 * cfg.n_layers  # every block and every attention layer
    assert all(o.cache is None and o.log_mask is None and o.x.shape == (1, 6, cfg.d_model) for o in attn)


@pytest.mark.parametrize("family", FAMILIES)
def test_dcp_and_acp_caches(family):
    """Both families decode a DCP model under ``dcp`` (the caches store the interaction keys) with the same
    output type; ``dcp`` needs DCP weights, ``acp`` a forget gate (FoX), unknown policies name the forms."""
    cfg = FAMILIES[family](dcp=True, interaction_dim=8)
    params = init(cfg)
    caches = cfg.init_cache(2, 8, policy="dcp")
    assert all(isinstance(c, SlotKVCache) and c.policy.spec == "dcp" for c in caches)
    assert all(g.k_int is not None and g.k_int.shape == (2, RING_BLOCK, 8) for c in caches for g in c.groups)
    model = cfg.build()
    out = jax.jit(lambda p, t, c: model.apply({"params": p}, t, cache=c))(params, jnp.zeros((2, 4), jnp.int32), caches)
    assert isinstance(out, ModelOutput) and out.aux == {} and out.logits.dtype == jnp.float32
    assert all(isinstance(c, SlotKVCache) and int(c.length) == 4 for c in out.cache)
    # a dense cache for the same DCP model (its unpruned baseline) stores no interaction keys
    assert all(getattr(g, "k_int", None) is None for c in cfg.init_cache(2, 8) for g in c.groups)
    with pytest.raises(ValueError, match="DCP"):
        FAMILIES[family]().init_cache(2, 8, policy="dcp")
    with pytest.raises(ValueError, match="dense, dcp, acp"):
        cfg.init_cache(2, 8, policy="lru")
    if family == "gpt2":
        with pytest.raises(ValueError, match="forget gate"):
            cfg.init_cache(2, 8, policy="acp")
        return
    # acp: one ring start per (row, key/value head); one capacity per key/value head makes head groups
    plain = FAMILIES[family]()
    caches = plain.init_cache(2, 8, policy="acp", max_context=32)
    assert all(c.max_context == 32 and c.groups[0].start.shape == (2, plain.kv_heads) for c in caches)
    grouped = plain.init_cache(2, [(4, 100)] * plain.n_layers, policy="acp")
    assert [g.slots for g in grouped[0].groups] == [RING_BLOCK, 2 * RING_BLOCK] and grouped[0].capacity == 128
    with pytest.raises(ValueError, match="forget gate"):
        preset("tiny", "transformer-pro", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2).init_cache(
            2, 8, policy="acp")


@pytest.mark.parametrize("family", FAMILIES)
def test_config_dict_round_trip(family):
    cfg = FAMILIES[family](dcp=True, interaction_dim=8, remat="dots")
    d = cfg.to_dict()
    assert d["model_type"] == family == cfg.model_type and MODEL_TYPES[family] is type(cfg)
    assert config_from_dict(json.loads(json.dumps(d))) == cfg
    assert type(cfg).from_dict(d) == cfg
    with pytest.raises(ValueError, match="unknown field"):
        type(cfg).from_dict({**d, "n_layerz": 3})
    other = "gpt2" if family == "lm" else "lm"
    with pytest.raises(ValueError, match="model_type"):
        type(cfg).from_dict({**d, "model_type": other})
    with pytest.raises(ValueError, match="model_type"):
        config_from_dict({**d, "model_type": "llama"})


def test_config_from_dict_defaults_and_legacy_gpt2_names():
    lm = ModelConfig(n_layers=3)
    assert config_from_dict(dataclasses.asdict(lm)) == lm  # no tag: a ModelConfig
    legacy = {"model_type": "gpt2", "n_layer": 3, "n_head": 2, "n_embd": 16, "n_inner": 40,
              "layer_norm_epsilon": 1e-6, "beta_init": 1.5, "remat": True, "n_positions": 64, "vocab_size": 50,
              "dcp": True}
    cfg = config_from_dict(legacy)
    assert cfg == GPT2Config(n_layers=3, n_heads=2, d_model=16, mlp_dim=40, norm_eps=1e-6, dcp_beta_init=1.5,
                             remat="full", n_positions=64, vocab_size=50, dcp=True)
    assert cfg.mlp_hidden == 40 and cfg.dim_per_head == 8
    assert config_from_dict({**legacy, "remat": False}).remat == "none"
    assert GPT2Config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="both"):
        GPT2Config.from_dict({"n_layer": 2, "n_layers": 2})


@pytest.mark.parametrize("family", FAMILIES)
def test_protocol_methods(family):
    cfg = FAMILIES[family]()
    prefix = {"lm": "layers_", "gpt2": "h_"}[family]
    assert cfg.layer_names == (f"{prefix}0", f"{prefix}1")
    params = init(cfg)
    assert set(cfg.layer_names) <= set(params)
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == cfg.param_count()
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    for policy in ("none", "full", "dots"):
        assert cfg.with_remat(policy).remat == policy
    with pytest.raises(ValueError, match="remat"):
        cfg.with_remat("some")
    # FLOPs: 2N + 2·n_layers·d_attn·L, plus n_layers·r·L with DCP
    f1, f2 = cfg.flops_per_token(100), cfg.flops_per_token(200)
    assert f2 - f1 == pytest.approx(2 * cfg.n_layers * cfg.n_heads * cfg.dim_per_head * 100)
    new_cfg, new = cfg.add_dcp_params(params, jax.random.PRNGKey(1), interaction_dim=4, beta_init=3.0)
    assert new_cfg == cfg.replace(dcp=True, interaction_dim=4, dcp_beta_init=3.0)
    assert new_cfg.flops_per_token(100) - cfg.flops_per_token(100) == pytest.approx(
        2 * cfg.n_layers * 2 * cfg.d_model * 4 + 2 * cfg.n_layers + cfg.n_layers * 4 * 100)
    for name in cfg.layer_names:
        attn = new[name]["attn"]
        assert attn["q_int"]["kernel"].shape == (cfg.d_model, 4) and float(attn["beta"]) == 3.0
    assert sum(x.size for x in jax.tree_util.tree_leaves(new)) == new_cfg.param_count()
    with pytest.raises(ValueError, match="already"):
        new_cfg.add_dcp_params(new, jax.random.PRNGKey(1))
    # remat changes no parameter and no output
    tokens = jnp.ones((1, 5), jnp.int32)
    for policy in ("full", "dots"):
        np.testing.assert_allclose(logits_fn(cfg.with_remat(policy))(params, tokens),
                                   logits_fn(cfg)(params, tokens), atol=1e-6)


SCAN_CASES = {  # family, config overrides, mutable collections, apply kwargs
    "lm-acp-sown": ("lm", dict(adaptive_threshold="auto"), ["intermediates", "gates"], {}),
    "lm-dcp-remat": ("lm", dict(dcp=True, interaction_dim=8, remat="dots"), [], dict(alpha=3.0)),
    "gpt2-pattern-remat": ("gpt2", dict(sparse_pattern="local:5", remat="full"), [], {}),
    "gpt2-dcp": ("gpt2", dict(dcp=True, interaction_dim=8), [], dict(alpha=3.0)),
}


@pytest.mark.parametrize("case", sorted(SCAN_CASES))
def test_scanned_layers_equal_the_unrolled_loop(case):
    """``scan_layers``: the blocks as one ``lax.scan`` over their stacked parameters give the
    unrolled loop's logits, aux (DCP masks, sparsity, loss), sown collections under each layer's name and
    gradients, with the same ``layers_{i}`` / ``h_{i}`` parameters; remat inside the scanned body too.
    Tolerance: the same float32 ops in the same order, so 1e-6 (observed: equal bitwise)."""
    family, kw, mutable, call = SCAN_CASES[case]
    cfg = FAMILIES[family](**kw)
    params = init(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 13), 0, VOCAB)

    def run(scan):
        model = cfg.replace(scan_layers=scan).build()

        def loss(p):
            out = model.apply({"params": p}, tokens, mutable=mutable or False, **call)
            out, state = out if mutable else (out, {})
            aux = sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(out.aux))
            return jnp.mean(out.logits.astype(jnp.float32) ** 2) + 1e-3 * aux, (out, state)

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (l_s, (o_s, st_s)), g_s = run(True)
    (l_u, (o_u, st_u)), g_u = run(False)
    assert set(o_s.aux) == set(o_u.aux) and (not mutable or st_s)
    for a, b in [(o_s.logits, o_u.logits), (o_s.aux, o_u.aux), (st_s, st_u), (g_s, g_u)]:
        assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-6)
    if mutable:  # under each layer's name, as the unrolled loop sows
        assert set(st_s["intermediates"]) == set(cfg.layer_names) == set(st_s["gates"])
    with pytest.raises(ValueError, match="scan_layers must be a bool"):
        cfg.replace(scan_layers="yes")


def test_scan_stacks_the_matrices_in_the_compute_dtype(monkeypatch):
    """A bf16 model's float32 matrices, which every block only multiplies in bf16, enter the scan already cast
    (the stack and its gradient move half the bytes), while what a block uses in float32 (norm scales, the forget
    gate) stays float32; and the loss, logits and float32 gradients equal, bit for bit, those of the scan that
    stacks everything in float32 and casts inside the body (the hoisting switched off)."""
    import fox_jax.models.family as family

    cfg = lm_cfg(dtype="bfloat16", remat="dots")
    params, tokens = init(cfg), jax.random.randint(jax.random.PRNGKey(1), (2, 13), 0, VOCAB)
    model = cfg.build()

    def loss(p):
        logits = model.apply({"params": p}, tokens).logits
        return jnp.mean(logits.astype(jnp.float32) ** 2), logits

    fresh = lambda: lambda p: loss(p)  # noqa: E731  (a new function each time: no trace or compile cache hit)

    def scanned():  # (dtype, ndim) of the scan's per-layer inputs: the stacked parameters
        (scan,) = [e for e in jax.make_jaxpr(fresh())(params).jaxpr.eqns if e.primitive.name == "scan"]
        xs = scan.invars[scan.params["num_consts"] + scan.params["num_carry"]:]
        return collections.Counter((v.aval.dtype.name, v.aval.ndim) for v in xs)

    layer = params[cfg.layer_names[0]]
    matrices = sum(1 for a in jax.tree_util.tree_leaves(layer) if a.ndim == 2 and min(a.shape) >= cfg.d_model // 2)
    hoisted_inputs = scanned()
    assert hoisted_inputs[("bfloat16", 3)] == matrices == 7, hoisted_inputs  # q, k, v, o, output gate, gate/up, down
    assert hoisted_inputs[("float32", 2)] > 0 and hoisted_inputs[("bfloat16", 2)] == 0, hoisted_inputs  # vectors
    hoisted = jax.jit(jax.value_and_grad(fresh(), has_aux=True))(params)

    monkeypatch.setattr(family, "_block_casts", lambda block, p, x, args: jax.tree_util.tree_map(lambda _: None, p))
    assert scanned()[("bfloat16", 3)] == 0  # switched off: every parameter stacked in float32
    inside = jax.jit(jax.value_and_grad(fresh(), has_aux=True))(params)
    for x, y in zip(jax.tree_util.tree_leaves(hoisted), jax.tree_util.tree_leaves(inside), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("scan", [False, True])
def test_dots_remat_saves_the_attention_outputs(scan):
    """remat "dots" saves each layer's attention output and row log-sum-exp (``ATTENTION_RESIDUALS``) next to the
    matmul outputs, so the backward reads them instead of rerunning the attention forward (its kernel included;
    the recomputed forward is then dead code). Unrolled: one named residual of each per layer; scanned: one stacked
    [L, ...] residual of each shape (the names do not survive the scan)."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    cfg = lm_cfg(remat="dots", scan_layers=scan)
    params, tokens = init(cfg), jnp.ones((1, 9), jnp.int32)
    model = cfg.build()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda p: jnp.mean(model.apply({"params": p}, tokens).logits), params)
    lines = out.getvalue().splitlines()
    h, d = cfg.n_heads, cfg.dim_per_head
    if scan:
        assert any(f"f32[{cfg.n_layers},1,9,{h},{d}] output of scan" in ln for ln in lines), lines
        assert any(f"f32[{cfg.n_layers},1,9,{h}] output of scan" in ln for ln in lines), lines
    else:
        for name in ("attention_out", "attention_lse"):
            assert sum(f"named '{name}'" in ln for ln in lines) == cfg.n_layers, (name, lines)
