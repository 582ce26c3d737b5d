"""The fused, chunked LM-head cross-entropy (fox_jax.ops.cross_entropy) and the padded LM head, against
the previous path (the model's logits, optax's cross-entropy), in float32 and bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fox_jax.models import preset
from fox_jax.ops.cross_entropy import lm_head_cross_entropy, padded_vocab
from fox_jax.train import config as config_lib
from fox_jax.train.loop import LMTask, token_losses

B, T, D, V = 3, 37, 24, 203  # awkward: T and V prime, V not a multiple of any pad


def _inputs(dtype, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = jax.random.normal(k[0], (B, T, D)).astype(dtype)
    w = 0.3 * jax.random.normal(k[1], (D, V), jnp.float32)
    t = jax.random.randint(k[2], (B, T), 0, V)
    cot = jax.random.uniform(k[3], (B, T))  # a per-token cotangent, not only the mean
    return h, w, t, cot


def _reference(h, w, t):
    """The same math unfused: f32 logits of the compute-dtype matmul, optax's cross-entropy."""
    z = jnp.einsum("btd,dv->btv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(z, t)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def test_padded_vocab():
    assert padded_vocab(50257, 128) == 50304 and padded_vocab(50304, 128) == 50304
    assert padded_vocab(203, 1) == 203 and padded_vocab(203, 64) == 256
    with pytest.raises(ValueError):
        padded_vocab(0, 128)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunk,pad", [(8192, 128), (40, 128), (7, 1), (1, 64)])
def test_matches_unfused(dtype, chunk, pad):
    """Losses and gradients equal the unfused computation of the same math.

    float32: only summation order differs (tolerance 1e-5 relative). bfloat16: the losses come from the
    same f32 logits (1e-5); the fused backward rounds the logit gradient softmax − onehot to bfloat16
    once (relative 2⁻⁹) and dh is bfloat16 either way, so gradients agree to 2e-2 of their largest entry.
    """
    h, w, t, cot = _inputs(dtype)
    fused = lambda h, w: jnp.sum(lm_head_cross_entropy(h, w, t, chunk_size=chunk, pad_multiple=pad) * cot)  # noqa: E731
    ref = lambda h, w: jnp.sum(_reference(h, w, t) * cot)  # noqa: E731
    l1, (dh1, dw1) = jax.value_and_grad(fused, (0, 1))(h, w)
    l2, (dh2, dw2) = jax.value_and_grad(ref, (0, 1))(h, w)
    losses = lm_head_cross_entropy(h, w, t, chunk_size=chunk, pad_multiple=pad)
    assert losses.shape == (B, T) and losses.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(losses), np.asarray(_reference(h, w, t)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
    assert dh1.dtype == h.dtype and dw1.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert _rel(dh1, dh2) < tol and _rel(dw1, dw2) < tol


def test_jit_and_errors():
    h, w, t, _ = _inputs(jnp.float32)
    out = jax.jit(lambda h, w: lm_head_cross_entropy(h, w, t, chunk_size=50))(h, w)
    np.testing.assert_allclose(np.asarray(out), np.asarray(_reference(h, w, t)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="hidden"):
        lm_head_cross_entropy(h[0], w, t)
    with pytest.raises(ValueError, match="kernel"):
        lm_head_cross_entropy(h, w.T, t)
    with pytest.raises(ValueError, match="targets"):
        lm_head_cross_entropy(h, w, t[:, 1:])
    with pytest.raises(ValueError, match="chunk_size"):
        lm_head_cross_entropy(h, w, t, chunk_size=0)


# a FoX (Pro) of 2 layers, d_model 64: what matters is the LM head, [64, 257] (384 columns when padded)
MODEL = dict(vocab_size=257, n_layers=1, d_model=64, n_heads=2)  # one layer: the head and the loss are under test
OLD = dict(vocab_pad_multiple=1, loss_impl="logits")


def _model(dtype="float32", **overrides):
    return preset("tiny", "fox-pro", dtype=dtype, **MODEL, **overrides)


@pytest.fixture(scope="module")
def params_and_batch():
    """float32 params of the old path's model and a batch. Padding and the loss change no parameter
    (test_padded_head_logits_and_params checks it), so every variant uses these."""
    params = jax.jit(_model(**OLD).init_params)(jax.random.PRNGKey(0))
    toks = np.random.default_rng(1).integers(0, 257, (2, 46))
    return params, {"inputs": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:])}


def _loss_and_grads(params, batch, dtype, **overrides):
    m = _model(dtype, **overrides)
    task, model = LMTask(config_lib.ExperimentConfig(model=m, steps=10, batch_size=2)), m.build()

    @jax.jit
    def run(params, batch):
        (loss, _), grads = jax.value_and_grad(lambda p: task.loss(model, p, batch, {}), has_aux=True)(params)
        return loss, grads, token_losses(model, params, batch)

    return run(params, batch)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_losses_equal_the_old_path(dtype, params_and_batch):
    """LMTask's loss and gradients with the padded head, and with the chunked loss, against the old path.

    Padded head: the zero columns change no logit; float32 and bfloat16 agree to summation order (1e-5).
    Chunked: float32 agrees to 1e-5. bfloat16: the old path rounds the logits to bfloat16 before the
    float32 softmax (|z|·2⁻⁹ per logit, ~1e-4 on the loss here) and rounds the scaled logit gradient to
    bfloat16; the new one keeps float32 logits: losses agree to 1e-3, gradients to 3e-2 of their largest
    entry per parameter.
    """
    l0, g0, tl0 = _loss_and_grads(*params_and_batch, dtype, **OLD)
    lp, gp, tlp = _loss_and_grads(*params_and_batch, dtype, vocab_pad_multiple=128, loss_impl="logits")
    lc, gc, tlc = _loss_and_grads(*params_and_batch, dtype, vocab_pad_multiple=128, loss_impl="chunked",
                                  loss_chunk=30)
    assert jax.tree_util.tree_structure(g0) == jax.tree_util.tree_structure(gc)
    np.testing.assert_allclose(float(lp), float(l0), rtol=1e-5)
    assert max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(_rel, gp, g0))) < 1e-5
    tol_l, tol_g = (1e-5, 1e-5) if dtype == "float32" else (1e-3, 3e-2)
    np.testing.assert_allclose(float(lc), float(l0), rtol=tol_l)
    np.testing.assert_allclose(np.asarray(tlc), np.asarray(tl0), rtol=tol_l, atol=tol_l * 10)
    assert max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(_rel, gc, g0))) < tol_g


def test_padded_head_logits_and_params(params_and_batch):
    params, batch = params_and_batch
    model0, model1 = _model(**OLD).build(), _model().build()
    padded = jax.jit(_model().init_params)(jax.random.PRNGKey(0))  # the padded head's init: the same params
    assert jax.tree_util.tree_map(jnp.shape, params) == jax.tree_util.tree_map(jnp.shape, padded)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, padded)
    assert params["lm_head"]["kernel"].shape == (MODEL["d_model"], 257)
    a, b, out = jax.jit(lambda p, x: (model0.apply({"params": p}, x).logits, model1.apply({"params": p}, x).logits,
                                      model1.apply({"params": p}, x, return_hidden=True)))(params, batch["inputs"])
    assert a.shape == b.shape == (2, 45, 257)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert out.logits is None and out.hidden.shape == (2, 45, MODEL["d_model"])


def test_config_checks():
    with pytest.raises(ValueError, match="loss_impl"):
        preset("tiny", "fox-pro", loss_impl="fused")
    with pytest.raises(ValueError, match="vocab_pad_multiple"):
        preset("tiny", "fox-pro", vocab_pad_multiple=0)
    m = _model(dcp=True)
    params = jax.eval_shape(m.init_params, jax.random.PRNGKey(0))  # the check is at trace time
    with pytest.raises(ValueError, match="return_hidden"):
        jax.eval_shape(lambda p: m.build().apply({"params": p}, jnp.zeros((1, 8), jnp.int32), alpha=1.0,
                                                 return_hidden=True), params)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_next_token_ce_is_optax_cross_entropy(dtype):
    """``next_token_ce`` (logsumexp − the target's logit as a masked sum) = optax's log-softmax-and-gather, value and
    gradient (a per-token cotangent), targets at both ends of the vocabulary; logits of either dtype are taken in
    float32. Tolerance: float32 rounding of the two orders, 1e-5 relative (values up to ~10)."""
    from fox_jax.train.loop import next_token_ce

    k = jax.random.split(jax.random.PRNGKey(4), 3)
    z = (4.0 * jax.random.normal(k[0], (B, T, V))).astype(dtype)
    t = jax.random.randint(k[1], (B, T), 0, V).at[0, :2].set(jnp.array([0, V - 1]))
    cot = jax.random.uniform(k[2], (B, T))
    ours = lambda z: next_token_ce(z, {"targets": t})  # noqa: E731
    ref = lambda z: optax.softmax_cross_entropy_with_integer_labels(z.astype(jnp.float32), t)  # noqa: E731
    np.testing.assert_allclose(ours(z), ref(z), rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda z: jnp.sum(ours(z) * cot))(z)
    g_ref = jax.grad(lambda z: jnp.sum(ref(z) * cot))(z)
    assert g.dtype == dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32), rtol=1e-5,
                               atol=1e-6 if dtype == jnp.float32 else 1e-2)
