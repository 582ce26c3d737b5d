"""Model shapes, parameter counts (docs/design/fox_acp.md §2.5), equivalences, and jit/vmap/grad composability."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.models import LanguageModel, ModelConfig, count_params, preset

# (size, arch) -> parameters incl. one 50257 x d embedding, from the spec table (millions, 0.1 precision)
SPEC_COUNTS = {
    ("125M", "fox-llama"): 123.7,
    ("360M", "fox-llama"): 360.2,
    ("760M", "fox-llama"): 757.6,
    ("760M", "transformer-llama"): 756.7,  # paper Table 6: 756M
    ("125M", "fox-pro"): 123.9,
    ("360M", "fox-pro"): 367.3,
    ("760M", "fox-pro"): 759.5,
    ("760M", "transformer-pro"): 757.7,  # paper Table 6: 757M
}


@pytest.mark.parametrize("size_arch", sorted(SPEC_COUNTS), ids=lambda x: "-".join(x))
def test_paper_parameter_counts(size_arch):
    cfg = preset(*size_arch)
    shapes = jax.eval_shape(lambda: cfg.init_params(jax.random.PRNGKey(0)))
    built = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
    assert built == cfg.param_count()
    assert round(cfg.param_count(include_head=False) / 1e6, 1) == SPEC_COUNTS[size_arch]


def test_mlp_width_and_heads():
    assert preset("125M").mlp_hidden == 2048
    assert preset("360M").mlp_hidden == 2816
    assert preset("760M").mlp_hidden == 4096
    assert preset("760M", "transformer-llama").n_heads == 12
    assert preset("760M", "transformer-llama").dim_per_head == 128


def test_flops_formula():
    cfg = preset("760M")
    n = cfg.param_count(include_embedding=False)  # non-embedding + LM head (matmul params)
    assert cfg.flops_per_token(16384) == pytest.approx(2 * n + 2 * 24 * 1536 * 16384)


# the model tests' size: 2 layers, d_model 64, 4 heads of 16 (the "tiny" preset is 4 layers of 128)
SMALL = dict(n_layers=2, d_model=64, n_heads=4)
# one layer for the tests of a per-layer property that read only layers_0 (segment/position resets, KV-shift,
# ACP thresholds and fractions): a second identical Block adds only compile time (the layers are unrolled)
ONE_LAYER = dict(SMALL, n_layers=1)


def init(cfg, seed=0):
    """``cfg.init_params`` compiled as one program (eagerly, XLA compiles each op of the init separately)."""
    return jax.jit(cfg.init_params)(jax.random.PRNGKey(seed))


def apply_fn(cfg, **kw):
    """``LanguageModel(cfg).apply`` jitted: (params, *args) -> its output (``kw``: static options)."""
    model = LanguageModel(cfg)
    return jax.jit(lambda p, *a: model.apply({"params": p}, *a, **kw))


def logits_fn(cfg):
    f = apply_fn(cfg)
    return lambda p, *a: f(p, *a).logits


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny", vocab_size=97, **SMALL)
    return cfg, init(cfg)


@pytest.mark.slow
def test_forward_shapes_and_dtypes(tiny):
    cfg, params = tiny
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 45), 0, 97)
    logits = logits_fn(cfg)(params, tokens)
    assert logits.shape == (3, 45, 97) and logits.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    bf = cfg.replace(dtype="bfloat16")
    assert logits_fn(bf)(params, tokens).dtype == jnp.bfloat16
    assert "fgate_proj" in params["layers_0"]["attn"]
    assert np.all(np.asarray(params["layers_0"]["attn"]["fgate_proj"]["bias"]) == 0)  # f ≈ 0.5 at init


@pytest.mark.slow
def test_causality_and_segments(tiny):
    cfg, params = tiny
    logits = logits_fn(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (1, 40), 0, 97)
    base = logits(params, tokens)
    changed = logits(params, tokens.at[0, 30].set((tokens[0, 30] + 1) % 97))
    np.testing.assert_allclose(base[0, :30], changed[0, :30], atol=1e-5)  # the past ignores the future
    assert not np.allclose(base[0, 30:], changed[0, 30:])
    # a packed second document is processed as if it stood alone
    seg = jnp.concatenate([jnp.ones((1, 25), jnp.int32), 2 * jnp.ones((1, 15), jnp.int32)], 1)
    packed = logits(params, tokens, seg)
    alone = logits(params, tokens[:, 25:])
    np.testing.assert_allclose(packed[0, 25:], alone[0], atol=1e-4)


def _assert_second_document_as_if_alone(cfg, params, vocab: int, first: int, length: int = 30):
    """Two packed documents (segment ids, positions restarting): the second one's logits equal those of
    running it alone (no attention, RoPE offset or KV-shift carry across the boundary)."""
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, length), 0, vocab)
    seg = jnp.concatenate([jnp.ones((1, first), jnp.int32), 2 * jnp.ones((1, length - first), jnp.int32)], 1)
    pos = jnp.concatenate([jnp.arange(first), jnp.arange(length - first)])[None]
    logits = logits_fn(cfg)
    packed = logits(params, tokens, seg, pos)
    alone = logits(params, tokens[:, first:])
    np.testing.assert_allclose(packed[0, first:], alone[0], atol=1e-4)


@pytest.mark.slow
def test_transformer_rope_positions_reset_per_segment():
    cfg = preset("tiny", "transformer-llama", vocab_size=50, **ONE_LAYER)
    _assert_second_document_as_if_alone(cfg, init(cfg), 50, 12)


@pytest.mark.slow
def test_xla_and_dense_attention_agree(tiny):
    cfg, params = tiny
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 70), 0, 97)
    a = logits_fn(cfg.replace(attention_impl="xla", attention_block=32))(params, tokens)
    b = logits_fn(cfg.replace(attention_impl="dense"))(params, tokens)
    np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.slow
def test_jit_vmap_grad(tiny):
    cfg, params = tiny
    model = LanguageModel(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(4), (4, 33), 0, 97)

    def loss(p, t):
        logits = model.apply({"params": p}, t[None]).logits[0]
        return jnp.mean(jax.nn.logsumexp(logits[:-1], -1) - jnp.take_along_axis(logits[:-1], t[1:, None], -1)[:, 0])

    per_example = jax.jit(jax.vmap(loss, in_axes=(None, 0)))(params, tokens)
    assert per_example.shape == (4,)
    g = jax.jit(jax.grad(lambda p: jnp.mean(jax.vmap(loss, in_axes=(None, 0))(p, tokens))))(params)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(params)
    gnorm = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree_util.tree_leaves(g))))
    assert np.isfinite(gnorm) and gnorm > 0
    # the forget gate receives gradient
    assert float(jnp.abs(g["layers_0"]["attn"]["fgate_proj"]["kernel"]).sum()) > 0


@pytest.mark.slow
def test_acp_in_model_sows_fraction(tiny):
    cfg, params = tiny
    tokens = jax.random.randint(jax.random.PRNGKey(5), (1, 64), 0, 97)
    out, inter = apply_fn(cfg.replace(adaptive_threshold="auto", attention_block=16),
                          mutable=["intermediates"])(params, tokens)
    logits = out.logits
    fractions = jax.tree_util.tree_leaves(inter)
    assert len(fractions) == cfg.n_layers
    dense = logits_fn(cfg)(params, tokens)
    np.testing.assert_allclose(logits, dense, atol=1e-3)


def test_config_validation():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3, d_model=64)
    with pytest.raises(ValueError, match="arch"):
        ModelConfig(arch="mamba")
    with pytest.raises(ValueError, match="unknown model size"):
        preset("1B")
    cfg = preset("tiny", vocab_size=11)
    assert count_params(jax.eval_shape(cfg.init_params, jax.random.PRNGKey(0))) == cfg.param_count()


@pytest.mark.slow
def test_kv_shift_continuation_matches_single_pass():
    from fox_jax.ops.head_ops import kv_shift
    raw = jax.random.normal(jax.random.PRNGKey(0), (2, 20, 3, 4))
    alpha = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(1), (2, 20, 3)))
    full, last = kv_shift(raw, alpha)
    first, state = kv_shift(raw[:, :12], alpha[:, :12])
    second, last2 = kv_shift(raw[:, 12:], alpha[:, 12:], state=state)
    np.testing.assert_allclose(jnp.concatenate([first, second], 1), full, atol=1e-6)
    np.testing.assert_allclose(last2, last)
    np.testing.assert_allclose(full[:, 0], (1 - alpha[:, 0, :, None]) * raw[:, 0], atol=1e-6)  # zeros before t=0
    seg = jnp.asarray([[1] * 7 + [2] * 13] * 2)
    packed, _ = kv_shift(raw, alpha, segment_ids=seg)
    alone, _ = kv_shift(raw[:, 7:], alpha[:, 7:])
    np.testing.assert_allclose(packed[:, 7:], alone, atol=1e-6)  # never shifts across documents


def _kv_shift_oracle(raw, alpha, state, segment_ids):
    """Eq. 14 written out per token in float64 (numpy): the oracle of kv_shift's values."""
    raw, alpha, state = (np.asarray(x, np.float64) for x in (raw, alpha, state))
    out = np.empty_like(raw)
    for t in range(raw.shape[1]):
        prev = state if t == 0 else raw[:, t - 1]
        if segment_ids is not None and t > 0:
            prev = np.where((segment_ids[:, t] != segment_ids[:, t - 1])[:, None, None], 0.0, prev)
        out[:, t] = alpha[:, t, :, None] * prev + (1 - alpha[:, t, :, None]) * raw[:, t]
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["one-doc", "packed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_shift_gradients_match_autodiff_of_the_oracle(packed, dtype):
    """kv_shift's written-out backward (one reduction for dα, dx̃ rounded once) against autodiff of Eq. 14 in
    float32, into raw, α and the carried state, with document starts inside the chunk and at its first token.
    Tolerances: float32 5e-6 (summation order over D); bfloat16 inputs give a bfloat16 output and dx̃, so the
    comparison is at bf16's resolution (2⁻⁸ relative) and dα, accumulated in float32, at 2e-2 absolute over D=4."""
    from fox_jax.ops.head_ops import kv_shift
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    dt = jnp.dtype(dtype)
    raw = jax.random.normal(ks[0], (2, 11, 3, 4)).astype(dt)
    alpha = jax.nn.sigmoid(jax.random.normal(ks[1], (2, 11, 3)))
    state = jax.random.normal(ks[2], (2, 3, 4)).astype(dt)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3], [4] * 11]) if packed else None
    w = jax.random.normal(ks[3], raw.shape)

    def plain(r, a, s):  # the same math for autodiff: float32 throughout
        prev = jnp.concatenate([s[:, None], r[:, :-1]], axis=1)
        if seg is not None:
            prev = jnp.where(jnp.concatenate([jnp.zeros((2, 1), bool), seg[:, 1:] != seg[:, :-1]], 1)[..., None, None],
                             0.0, prev)
        return a[..., None] * prev + (1 - a[..., None]) * r

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    out, last = kv_shift(raw, alpha, state=state, segment_ids=seg)
    assert out.dtype == dt and last.dtype == dt
    tol = dict(atol=5e-6, rtol=5e-6) if dtype == "float32" else dict(atol=2e-2, rtol=1e-2)
    np.testing.assert_allclose(f32(out), _kv_shift_oracle(f32(raw), alpha, f32(state), seg), **tol)
    ours = jax.grad(lambda r, a, s: jnp.sum(f32(kv_shift(r, a, state=s, segment_ids=seg)[0]) * w),
                    argnums=(0, 1, 2))(raw, alpha, state)
    ref = jax.grad(lambda r, a, s: jnp.sum(plain(r, a, s) * w), argnums=(0, 1, 2))(f32(raw), alpha, f32(state))
    for name, a, b in zip(("raw", "alpha", "state"), ours, ref):
        np.testing.assert_allclose(f32(a), b, **tol, err_msg=name)


def test_kv_shift_keeps_its_shifted_reads_behind_barriers():
    """The forward's output and, in the backward, x̃ with the cotangent and x̃_{t−1} go through
    ``lax.optimization_barrier`` (three barriers in the program of the value and the gradient): without them XLA compiles the shifted
    reads into multi-output reductions that keep local memory on a GPU (the 760M step: 415.0 → 406.8 ms with them,
    benchmarks/NOTES.md). A structural check; the GPU code itself is read by ``checks/train_kernels.py --ptx``."""
    from fox_jax.ops.head_ops import kv_shift
    raw = jnp.zeros((1, 8, 2, 4), jnp.bfloat16)
    alpha = jnp.full((1, 8, 2), 0.5)
    loss = lambda r, a: jnp.sum(kv_shift(r, a)[0].astype(jnp.float32))  # noqa: E731
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(raw, alpha).as_text()
    assert text.count("stablehlo.optimization_barrier") == 3, text.count("stablehlo.optimization_barrier")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swiglu_gradient_matches_autodiff_of_the_split_form(dtype):
    """swiglu's backward (one [.., 2, hidden] array, computed in float32) against autodiff of
    silu(gate)·up written with two slices, in float32. bf16: the output and dh are rounded to bf16 (2⁻⁸)."""
    from fox_jax.nn.layers import swiglu
    h = (3 * jax.random.normal(jax.random.PRNGKey(5), (2, 3, 2, 5))).astype(dtype)
    w = jax.random.normal(jax.random.PRNGKey(6), (2, 3, 5))

    def plain(h):
        gate, up = h[..., 0, :], h[..., 1, :]
        return gate * jax.nn.sigmoid(gate) * up

    tol = dict(atol=1e-6, rtol=1e-6) if dtype == "float32" else dict(atol=3e-2, rtol=1e-2)
    hf = h.astype(jnp.float32)
    np.testing.assert_allclose(swiglu(h).astype(jnp.float32), plain(hf), **tol)
    ours = jax.grad(lambda h: jnp.sum(swiglu(h).astype(jnp.float32) * w))(h)
    assert ours.dtype == h.dtype
    np.testing.assert_allclose(ours.astype(jnp.float32), jax.grad(lambda h: jnp.sum(plain(h) * w))(hf), **tol)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["fox-pro", "transformer-pro"])
def test_pro_models_run_and_respect_segments(arch):
    cfg = preset("tiny", arch, vocab_size=61, **ONE_LAYER)
    params = init(cfg)
    attn = params["layers_0"]["attn"]
    assert {"q_norm", "k_norm", "o_norm", "ogate_proj", "k_shift_proj", "v_shift_proj"} <= set(attn)
    assert ("fgate_proj" in attn) == (arch == "fox-pro")
    _assert_second_document_as_if_alone(cfg, params, 61, 10)


@pytest.mark.slow
def test_pro_acp_threshold_comes_from_qk_norm_weights():
    """QK-norm bounds every logit by √D·max|w_q|·max|w_k|, so ACP with "auto" uses the weights."""
    from fox_jax.ops import acp
    cfg = preset("tiny", "fox-pro", vocab_size=61, adaptive_threshold="auto", attention_block=16, **ONE_LAYER)
    params = init(cfg)
    # strongly forgetting gates so that tiles really are pruned
    params["layers_0"]["attn"]["fgate_proj"]["bias"] = jnp.full((cfg.n_heads,), -4.0)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 128), 0, 61)
    out, inter = apply_fn(cfg, mutable=["intermediates"])(params, tokens)
    pruned = out.logits
    dense = logits_fn(cfg.replace(adaptive_threshold=None))(params, tokens)
    fraction = float(inter["intermediates"]["layers_0"]["attn"]["acp_fraction_skipped"][0])
    assert fraction > 0.3
    np.testing.assert_allclose(pruned, dense, atol=1e-3)
    delta = acp.qk_norm_threshold(jnp.ones((4, 32)), jnp.ones((4, 32)), 128)
    np.testing.assert_allclose(delta, -(2 * 32 ** 0.5 + np.log(128)) - 10.0, rtol=1e-6)


def test_weight_decay_mask_excludes_norms_and_biases():
    from fox_jax.train.loop import weight_decay_mask
    params = jax.eval_shape(preset("tiny", "fox-pro", vocab_size=61, **SMALL).init_params, jax.random.PRNGKey(0))
    mask = weight_decay_mask(params)
    attn = mask["layers_0"]["attn"]
    assert attn["q_proj"]["kernel"] and attn["fgate_proj"]["kernel"] and mask["embed"]["embedding"]
    assert not attn["q_norm"]["scale"] and not attn["o_norm"]["scale"] and not attn["fgate_proj"]["bias"]
    assert not mask["layers_0"]["attn_norm"]["scale"] and not mask["final_norm"]["scale"]


@pytest.mark.slow
def test_acp_fraction_in_the_log_is_measured_at_the_running_kernels_tiles():
    """The sown ``acp_fraction_skipped`` uses the Pallas forward kernel's tiling when the layer runs the
    kernel, and ``attention_block`` tiles on the XLA path (the two tilings skip different fractions)."""
    from fox_jax.ops import acp, pallas as pallas_ops
    cfg = preset("tiny", "fox-llama", vocab_size=61, adaptive_threshold=-8.0, attention_block=64, **ONE_LAYER)
    params = init(cfg)
    params["layers_0"]["attn"]["fgate_proj"]["bias"] = jnp.full((cfg.n_heads,), -3.0)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 96), 0, 61)
    fractions = {}
    for impl in ("pallas", "xla"):
        _, inter = apply_fn(cfg.replace(attention_impl=impl), mutable=["intermediates"])(params, tokens)
        fractions[impl] = float(inter["intermediates"]["layers_0"]["attn"]["acp_fraction_skipped"][0])
    # the layer's Λ from its own log forget gates (sown into the "gates" collection on request)
    _, state = apply_fn(cfg, mutable=["gates"])(params, tokens)
    lam = jnp.cumsum(state["gates"]["layers_0"]["attn"]["log_fgate"][0], axis=1)
    delta = jnp.full((1, cfg.n_heads), -8.0)
    want_pallas = pallas_ops.acp_stats(lam, delta, 96, head_dim=cfg.dim_per_head)["fwd"]["fraction_skipped"]
    starts = acp.kv_block_start(lam, delta, tq=96, block_q=64, block_k=64)
    want_xla = acp.pruning_stats(starts, tq=96, tk=96, block_q=64, block_k=64)["fraction_skipped"]
    assert fractions["pallas"] == pytest.approx(float(want_pallas), abs=1e-6)
    assert fractions["xla"] == pytest.approx(float(want_xla), abs=1e-6)
    assert fractions["pallas"] != fractions["xla"]


@pytest.mark.parametrize("dtype,lead", [("float32", (2, 7)), ("float32", (3, 30)), ("bfloat16", (2, 7))])
def test_fused_dense_is_separate_dense_layers(dtype, lead):
    """``fused_dense`` (one matmul over concatenated kernels) = one ``nn.Dense`` per projection: the same
    parameter names, shapes and initial values, and the same outputs and input/kernel gradients. float32:
    1e-6 (only the summation order may differ: 14 rows take the multiply-and-sum form, 90 the matmul);
    bfloat16 outputs: one bf16 ulp (2^-8 relative)."""
    import flax.linen as nn

    from fox_jax.nn.layers import DenseParams, fused_dense, normal_init

    sizes = [(24, False), (8, True), (5, False)]  # an odd size and a bias among them
    dt = jnp.dtype(dtype)

    class Separate(nn.Module):
        @nn.compact
        def __call__(self, x):
            return [nn.Dense(n, use_bias=b, dtype=dt, param_dtype=jnp.float32, kernel_init=normal_init(0.3),
                             name=f"p{i}")(x) for i, (n, b) in enumerate(sizes)]

    class Fused(nn.Module):
        @nn.compact
        def __call__(self, x):
            return fused_dense(x, [DenseParams(n, b, 0.3, name=f"p{i}")(x.shape[-1]) for i, (n, b) in enumerate(sizes)],
                               dt)

    x = jax.random.normal(jax.random.PRNGKey(1), (*lead, 16), jnp.float32).astype(dt)
    p_sep = Separate().init(jax.random.PRNGKey(0), x)["params"]
    p_fus = Fused().init(jax.random.PRNGKey(0), x)["params"]
    jax.tree_util.tree_map(np.testing.assert_array_equal, p_sep, p_fus)  # also checks the tree structure
    p_sep = jax.tree_util.tree_map(lambda a: a + 0.1, p_sep)  # nonzero biases

    def loss(module):
        return lambda p, x: sum(jnp.sum(jnp.sin(y.astype(jnp.float32))) for y in module.apply({"params": p}, x))

    atol = 1e-6 if dtype == "float32" else 2e-2
    for a, b in zip(Separate().apply({"params": p_sep}, x), Fused().apply({"params": p_sep}, x)):
        assert a.dtype == b.dtype == dt and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol, rtol=atol)
    g_sep = jax.jit(jax.grad(loss(Separate()), argnums=(0, 1)))(p_sep, x)
    g_fus = jax.jit(jax.grad(loss(Fused()), argnums=(0, 1)))(p_sep, x)
    for a, b in zip(jax.tree_util.tree_leaves(g_sep), jax.tree_util.tree_leaves(g_fus)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=10 * atol, rtol=10 * atol)


@pytest.mark.parametrize("dtype,parts", [("float32", 4), ("bfloat16", 3)])
def test_split_dense_partial_sums_are_the_dense_product(dtype, parts):
    """``split_dense``: S float32 partial sums over consecutive slices of d_in, shaped [S, ..., n], whose sum is the
    product ``nn.Dense`` computes (float32: 1e-5, summation order; bfloat16 inputs: the same product of the rounded
    operands, accumulated in float32); each part is its own slice's product; an S that does not divide d_in is
    refused in one line."""
    from fox_jax.nn.layers import split_dense

    dt = jnp.dtype(dtype)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 24), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(2), (24, 10), jnp.float32)
    with jax.default_matmul_precision("highest"):
        got = split_dense(x, w, dt, parts)
        xr, wr = x.astype(dt).astype(jnp.float32), w.astype(dt).astype(jnp.float32)
        want = jnp.einsum("btd,dn->btn", xr, wr)
        k = 24 // parts
        first = jnp.einsum("btd,dn->btn", xr[..., :k], wr[:k])
    assert got.shape == (parts, 2, 3, 10) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got.sum(0)), np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(first), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="parts must be ≥ 1 and divide d_in=24, got 5"):
        split_dense(x, w, dt, 5)


def test_layer_norm_is_flax_layer_norm():
    """``fox_jax.nn.layers.LayerNorm`` (two-pass variance: one fused kernel on GPU) = ``flax.linen.LayerNorm``
    (E[x²] − E[x]²): the same parameter tree and initial values; outputs and input/parameter gradients within 1e-5
    relative (float32 rounding of the two variance forms) on rows with a large mean, where the one-pass form loses
    digits (gradients within 1e-4); bfloat16 input, float32 output."""
    import flax.linen as nn

    from fox_jax.nn.layers import LayerNorm

    x = (jax.random.normal(jax.random.PRNGKey(1), (3, 5, 48), jnp.float32) * 2.0 + 30.0).astype(jnp.bfloat16)
    ours, ref = LayerNorm(eps=1e-5), nn.LayerNorm(epsilon=1e-5, dtype=jnp.float32, param_dtype=jnp.float32)
    p = ours.init(jax.random.PRNGKey(0), x)["params"]
    jax.tree_util.tree_map(np.testing.assert_array_equal, p, ref.init(jax.random.PRNGKey(0), x)["params"])
    p = {"scale": p["scale"] + jnp.linspace(-0.5, 0.5, 48), "bias": p["bias"] + 0.25}
    y, y_ref = ours.apply({"params": p}, x), ref.apply({"params": p}, x)
    assert y.dtype == jnp.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)

    def loss(module):
        return lambda p, x: jnp.sum(jnp.sin(module.apply({"params": p}, x)))

    xf = x.astype(jnp.float32)
    for a, b in zip(jax.tree_util.tree_leaves(jax.grad(loss(ours), argnums=(0, 1))(p, xf)),
                    jax.tree_util.tree_leaves(jax.grad(loss(ref), argnums=(0, 1))(p, xf))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_init_params_leaves_the_threefry_setting_as_it_was():
    """``init_params`` switches JAX's threefry CUDA-kernel lowering on for its own program only (a global
    left on would change every later jitted program of the user's); its values are those of ``model.init`` jitted."""
    cfg = preset("tiny", "fox-pro")
    before = jax.config.jax_threefry_gpu_kernel_lowering
    params = cfg.init_params(jax.random.PRNGKey(3))
    assert jax.config.jax_threefry_gpu_kernel_lowering == before
    tokens = jnp.zeros((1, 8), jnp.int32)
    plain = jax.jit(lambda k: cfg.build().init(k, tokens)["params"])(jax.random.PRNGKey(3))
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["fox-pro", "transformer-llama"])
def test_gpu_init_params_threefry_kernel_is_bitwise_the_expansion(arch):
    """On GPU the threefry kernel (init_params) and XLA's inline expansion (a plain jit of ``model.init``)
    draw the same bits: the parameters are equal bit for bit, so seeds keep their weights."""
    cfg = preset("tiny", arch)
    tokens = jnp.zeros((1, 8), jnp.int32)
    plain = jax.jit(lambda k: cfg.build().init(k, tokens)["params"])(jax.random.PRNGKey(5))
    jax.tree_util.tree_map(np.testing.assert_array_equal, cfg.init_params(jax.random.PRNGKey(5)), plain)
