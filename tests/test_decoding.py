"""Incremental decoding: dense caches (FoX / Transformer, GPT-2), the DCP packed cache, generate()."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.models import preset
from fox_jax.decoding import (
    PackedKVCache,
    decode_step,
    extend,
    generate,
    init_cache,
    live_counts,
    prefill,
    resize_packed_cache,
)
from fox_jax.decoding import generation
from fox_jax.cache.dense import LayerKVCache, accumulate_log_fgate, cached_attention, slot_decay
from fox_jax.models import LanguageModel
from fox_jax.models.gpt2 import GPT2, GPT2Config

VOCAB = 97
PADS = np.array([0, 3, 5])  # left pads of a batch of 3
INF = float("inf")


def random_params(init, seed=0, scale=0.05):
    """Params shaped like ``init()`` (traced abstractly, never run): norm scales 1 + noise, every
    other leaf (kernels, biases, gates) noise of std ``scale``. Numpy-filled, so nothing compiles."""
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        base = 1.0 if "scale" in jax.tree_util.keystr(path) else 0.0
        return jnp.asarray(base + scale * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, jax.eval_shape(init))


def padded_batch(t, key=2):
    return jax.random.randint(jax.random.PRNGKey(key), (len(PADS), t), 0, VOCAB)


def real(t):
    """[B, T, 1] bool, the non-pad positions."""
    return (np.arange(t)[None] >= PADS[:, None])[..., None]


# ---------------------------------------------------------------------------------------------
# FoX / Transformer, LLaMA and Pro
# ---------------------------------------------------------------------------------------------

ARCHS = ["fox-llama", "fox-pro", "transformer-llama", "transformer-pro"]


@functools.lru_cache(maxsize=None)
def tiny_lm(arch):
    # Pro variants use GQA (2 key/value heads for 4 query heads) to cover the grouped decode path.
    cfg = preset("tiny", arch, vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4,
                 n_kv_heads=2 if arch.endswith("pro") else None)
    params = random_params(lambda: cfg.init_params(jax.random.PRNGKey(0)))
    return LanguageModel(cfg), params


@functools.partial(jax.jit, static_argnums=0)
def lm_reference(model, params, tokens, pads=PADS):
    """Full-sequence logits of a left-padded batch: pads form their own segment, positions start at
    0 at the first real token."""
    positions = jnp.arange(tokens.shape[1])[None] - jnp.asarray(pads)[:, None]
    return model.apply({"params": params}, tokens, segment_ids=(positions >= 0).astype(jnp.int32),
                       positions=positions).logits


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decoding_equals_full_forward(arch):
    model, params = tiny_lm(arch)
    t, p = 12, 6
    tokens = padded_batch(t)
    full = lm_reference(model, params, tokens)
    assert float(jnp.std(full)) > 0.05  # logits are not trivially equal

    logits, caches = prefill(model, params, tokens[:, :p], seq_start=PADS, capacity=t)
    np.testing.assert_allclose(np.where(real(p), logits, 0), np.where(real(p), full[:, :p], 0), atol=1e-4)
    for c in range(p, t):
        step_logits, caches = decode_step(model, params, caches, tokens[:, c])
        np.testing.assert_allclose(step_logits, full[:, c], atol=1e-4, err_msg=f"column {c}")
    assert int(caches[0].length) == t
    np.testing.assert_array_equal(live_counts(caches), np.broadcast_to(t - PADS, (2, 3)))


def test_kv_shift_continuation_is_exact():
    """Decoding token by token leaves exactly the cache a single prefill over all tokens builds:
    shifted keys/values per column and the shift states (the last unshifted projections)."""
    model, params = tiny_lm("fox-pro")
    t, p = 12, 6
    tokens = padded_batch(t)
    _, caches = prefill(model, params, tokens[:, :p], seq_start=PADS, capacity=t)
    for c in range(p, t):
        _, caches = decode_step(model, params, caches, tokens[:, c])
    _, one_pass = prefill(model, params, tokens, seq_start=PADS, capacity=t)
    for mine, ref in zip(caches, one_pass):
        assert mine.k_shift is not None and mine.lam_hi is not None
        keep = real(t)[..., None]
        for name in ("k", "v"):
            np.testing.assert_allclose(np.where(keep, getattr(mine, name), 0), np.where(keep, getattr(ref, name), 0),
                                       atol=1e-5, err_msg=name)
        lam = lambda c: np.where(real(t), np.asarray(c.lam_hi, np.float64) + np.asarray(c.lam_lo, np.float64), 0)  # Λ = hi + lo
        np.testing.assert_allclose(lam(mine), lam(ref), atol=1e-6)
        np.testing.assert_allclose(mine.k_shift, ref.k_shift, atol=1e-5)
        np.testing.assert_allclose(mine.v_shift, ref.v_shift, atol=1e-5)


def test_decode_step_compiles_once():
    model, params = tiny_lm("fox-llama")
    tokens = padded_batch(12)
    _, caches = prefill(model, params, tokens[:, :6], seq_start=PADS, capacity=12)
    _, caches = decode_step(model, params, caches, tokens[:, 6])
    compiled = generation._forward._cache_size()
    for c in range(7, 12):
        _, caches = decode_step(model, params, caches, tokens[:, c])
    assert generation._forward._cache_size() == compiled


def assert_greedy(reference, prompt, generated, pads=PADS):
    """Greedy decoding is self-consistent: each token is the argmax of the full-sequence logits of the
    left-padded prompt plus the tokens before it (one teacher-forced forward checks them all)."""
    seq = jnp.concatenate([prompt, generated], axis=1)
    logits = reference(seq, pads)
    t, n = prompt.shape[1], generated.shape[1]
    np.testing.assert_array_equal(generated, jnp.argmax(logits[:, t - 1:t - 1 + n], axis=-1))
    return logits


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["fox-pro", "transformer-llama"])
def test_generate_greedy_and_sampling(arch):
    model, params = tiny_lm(arch)
    prompt = padded_batch(6)
    n = 7
    reference = functools.partial(lm_reference, model, params)
    out = generate(model, params, prompt, max_new_tokens=n, seq_start=PADS)
    assert_greedy(reference, prompt, out.tokens)
    assert out.live_counts.shape == (n, 2, 3)
    np.testing.assert_array_equal(out.live_counts[:, 0, :], 6 - PADS[None] + np.arange(n)[:, None])
    # top_k = 1 is greedy whatever the temperature; sampling is reproducible and stays in the top k
    np.testing.assert_array_equal(
        generate(model, params, prompt, max_new_tokens=n, seq_start=PADS, temperature=2.0, top_k=1,
                 rng=jax.random.PRNGKey(0)).tokens, out.tokens)
    kw = dict(max_new_tokens=n, seq_start=PADS, temperature=1.5, top_k=3, rng=jax.random.PRNGKey(7))
    sampled = generate(model, params, prompt, **kw).tokens
    np.testing.assert_array_equal(sampled, generate(model, params, prompt, **kw).tokens)
    logits = reference(jnp.concatenate([prompt, sampled], axis=1))
    top3 = np.asarray(jax.lax.top_k(logits[:, 5:-1], 3)[1])
    assert all(int(sampled[b, i]) in top3[b, i] for b in range(3) for i in range(n))


def test_capacity_and_input_errors():
    model, params = tiny_lm("fox-llama")
    tokens = padded_batch(6)
    with pytest.raises(ValueError, match="capacity"):
        prefill(model, params, tokens, capacity=5)
    with pytest.raises(ValueError, match="seq_start"):
        prefill(model, params, tokens, seq_start=np.array([0, 6, 1]))
    _, caches = prefill(model, params, tokens, seq_start=PADS, capacity=7)
    _, caches = decode_step(model, params, caches, tokens[:, 5])
    with pytest.raises(ValueError, match="full"):  # the dense cache does not grow
        decode_step(model, params, caches, tokens[:, 0])
    with pytest.raises(ValueError, match="cache_capacity"):
        generate(model, params, tokens, max_new_tokens=4, cache_capacity=8)
    with pytest.raises(ValueError, match="rng"):
        generate(model, params, tokens, max_new_tokens=2, temperature=1.0)
    with pytest.raises(ValueError, match="packed"):
        init_cache(model, 3, 8, packed=True)
    with pytest.raises(ValueError, match="segment_ids"):
        model.apply({"params": params}, tokens, segment_ids=jnp.zeros_like(tokens), cache=init_cache(model, 3, 8))
    # a one-token prompt goes straight through the decode path
    one = generate(model, params, tokens[:, :1], max_new_tokens=3)
    assert_greedy(functools.partial(lm_reference, model, params), tokens[:, :1], one.tokens, pads=np.zeros(3, int))


# ---------------------------------------------------------------------------------------------
# GPT-2: dense cache and the DCP packed cache
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def tiny_gpt2(betas=(1.5, 2.5), int_std=0.5):
    """A GPT-2 with DCP whose interaction weights actually prune (init has β = 2, tiny q_int/k_int)."""
    cfg = GPT2Config(n_layers=2, d_model=64, n_heads=4, vocab_size=VOCAB, n_positions=64, dcp=True,
                     interaction_dim=16)
    params = random_params(lambda: GPT2(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32),
                                                  alpha=1.0)["params"])
    rng = np.random.default_rng(5)
    for i, beta in enumerate(betas):
        attn = params[f"h_{i}"]["attn"]
        for name in ("q_int", "k_int"):
            attn[name]["kernel"] = jnp.asarray(int_std * rng.standard_normal(attn[name]["kernel"].shape),
                                               jnp.float32)
        attn["beta"] = jnp.asarray(beta, jnp.float32)
    return GPT2(cfg), params


@functools.partial(jax.jit, static_argnums=0)
def _gpt2_forward(model, params, tokens, pads):
    positions = jnp.arange(tokens.shape[1])[None] - jnp.asarray(pads)[:, None]
    return model.apply({"params": params}, tokens, alpha=INF, segment_ids=(positions >= 0).astype(jnp.int32),
                       positions=jnp.maximum(positions, 0))


def gpt2_reference(model, params, tokens, pads=PADS):
    """Logits and the step keep mask I [L, B, T, T] (bool) of the training path at α = ∞."""
    out = _gpt2_forward(model, params, tokens, pads)
    logits, aux = out.logits, out.aux
    keep = np.asarray(aux["log_masks"]) == 0.0 if "log_masks" in aux else None
    return logits, keep


def live_positions(cache, b):
    return sorted(int(p) for p in np.asarray(cache.positions[b])[np.asarray(cache.occupied[b])])


def test_dcp_packed_cache_matches_training_mask():
    model, params = tiny_gpt2()
    t, p = 20, 8
    tokens = padded_batch(t)
    full, keep = gpt2_reference(model, params, tokens)
    assert 0.3 < 1 - keep[:, 0, -1, :].mean() < 0.95  # the weights do prune

    def check_live_sets(caches, c):
        for layer, cache in enumerate(caches):
            counts = np.asarray(cache.live_count())
            for b in range(3):
                expected = [j - PADS[b] for j in range(PADS[b], c + 1) if keep[layer, b, c, j]]
                assert live_positions(cache, b) == expected, (layer, b, c)
                assert counts[b] == len(expected)

    logits, caches = prefill(model, params, tokens[:, :p], seq_start=PADS, capacity=t, packed=True)
    assert isinstance(caches[0], PackedKVCache)
    np.testing.assert_allclose(np.where(real(p), logits, 0), np.where(real(p), full[:, :p], 0), atol=1e-4)
    check_live_sets(caches, p - 1)
    for layer in range(2):  # the prefill compacts the survivors into the first slots, in token order
        occupied = np.asarray(caches[layer].occupied)
        np.testing.assert_array_equal(occupied, np.arange(t)[None] < occupied.sum(1, keepdims=True))

    reused = 0
    ever_used = [np.asarray(c.occupied).copy() for c in caches]
    for c in range(p, t):
        first_free = [np.argmax(~np.asarray(cache.occupied), axis=1) for cache in caches]
        step_logits, caches = decode_step(model, params, caches, tokens[:, c])
        np.testing.assert_allclose(step_logits, full[:, c], atol=1e-4, err_msg=f"column {c}")
        check_live_sets(caches, c)
        for layer, cache in enumerate(caches):
            for b in range(3):
                slot = int(np.flatnonzero(np.asarray(cache.positions[b]) == c - PADS[b])[0])
                assert slot == first_free[layer][b]  # appended into the first free slot
                reused += bool(ever_used[layer][b, slot])  # a slot freed earlier is recycled
                ever_used[layer][b, slot] = True
    assert reused > 0


def test_dcp_large_beta_equals_dense_decoding():
    model, params = tiny_gpt2(betas=(1e4, 1e4))
    t, p = 14, 6
    tokens = padded_batch(t)
    _, packed = prefill(model, params, tokens[:, :p], seq_start=PADS, capacity=t, packed=True)
    _, dense = prefill(model, params, tokens[:, :p], seq_start=PADS, capacity=t, packed=False)
    for c in range(p, t):
        packed_logits, packed = decode_step(model, params, packed, tokens[:, c])
        dense_logits, dense = decode_step(model, params, dense, tokens[:, c])
        np.testing.assert_allclose(packed_logits, dense_logits, atol=1e-5)
    np.testing.assert_array_equal(live_counts(packed), np.broadcast_to(t - PADS, (2, 3)))
    # and the dense cache equals the model without DCP (the same weights minus the interaction)
    plain = GPT2(model.cfg.replace(dcp=False))
    plain_params = {k: ({**v, "attn": {n: w for n, w in v["attn"].items() if n in ("c_attn", "c_proj")}}
                        if k.startswith("h_") else v) for k, v in params.items()}
    full, _ = gpt2_reference(plain, plain_params, tokens)
    np.testing.assert_allclose(dense_logits, full[:, -1], atol=1e-4)


@pytest.mark.slow
def test_resize_packed_cache_keeps_live_tokens():
    model, params = tiny_gpt2()
    t = 16
    tokens = padded_batch(t)
    _, caches = prefill(model, params, tokens[:, :6], seq_start=PADS, capacity=t, packed=True)
    for c in range(6, 12):
        _, caches = decode_step(model, params, caches, tokens[:, c])
    live = int(jnp.max(live_counts(caches)))
    small = tuple(resize_packed_cache(cache, live + t - 12) for cache in caches)  # room for the rest
    for before, after in zip(caches, small):
        assert after.capacity == live + t - 12 < t
        for b in range(3):
            assert live_positions(after, b) == live_positions(before, b)
            # compacted in token order
            held = np.asarray(after.positions[b])[: int(after.live_count()[b])]
            assert list(held) == sorted(held)
    for c in range(12, t):  # decoding continues identically with the resized cache
        ref_logits, caches = decode_step(model, params, caches, tokens[:, c])
        logits, small = decode_step(model, params, small, tokens[:, c])
        np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
    with pytest.raises(ValueError, match="live count"):
        resize_packed_cache(caches[0], 0)
    full_cache = tuple(resize_packed_cache(cache, int(jnp.max(live_counts(small)))) for cache in small)
    with pytest.raises(ValueError, match="overflow"):
        decode_step(model, params, full_cache, tokens[:, 0])


@pytest.mark.slow
def test_generate_dcp_greedy_with_resizing():
    model, params = tiny_gpt2()
    prompt = padded_batch(8)
    n = 20

    out = generate(model, params, prompt, max_new_tokens=n, seq_start=PADS, chunk_size=6)
    assert_greedy(lambda seq, pads: gpt2_reference(model, params, seq, pads)[0], prompt, out.tokens)
    # live counts per step = the training-path keep mask of the row that produced each token
    seq = jnp.concatenate([prompt, out.tokens], axis=1)
    _, keep = gpt2_reference(model, params, seq)
    cols = np.arange(seq.shape[1])
    keep &= (cols >= PADS[:, None])[None, :, None, :]  # pads are never cached
    keep &= (cols[None, :] <= cols[:, None])[None, None]  # causal (log I is 0 above the diagonal)
    expected = keep.sum(-1)[:, :, 7:7 + n].transpose(2, 0, 1)  # [n, L, B]
    np.testing.assert_array_equal(out.live_counts, expected)
    assert out.live_counts[-1].max() < 8 + n - 1  # pruned: fewer live tokens than a dense cache holds
    # the unpruned dense baseline of the same DCP weights also runs through generate
    dense = generate(model, params, prompt, max_new_tokens=3, seq_start=PADS, packed=False)
    np.testing.assert_array_equal(dense.live_counts[:, 0], 8 - PADS[None] + np.arange(3)[:, None])
    # a capacity limit the live tokens reach raises instead of overflowing
    keep_all_model, keep_all_params = tiny_gpt2(betas=(1e4, 1e4))
    with pytest.raises(ValueError, match="full"):
        generate(keep_all_model, keep_all_params, prompt, max_new_tokens=n, seq_start=PADS, cache_capacity=10)
    with pytest.raises(ValueError, match="positions"):
        generate(model, params, prompt, max_new_tokens=60)


# ---------------------------------------------------------------------------------------------
# Chunks of T ≥ 1 tokens on a live cache (chunked prefill, multi-turn continuation)
# ---------------------------------------------------------------------------------------------

FAMILIES = [*ARCHS, "gpt2-dense", "gpt2-packed"]


@functools.lru_cache(maxsize=None)
def plain_gpt2():
    """The DCP GPT-2's weights without the interaction parameters: a dense GPT-2."""
    model, params = tiny_gpt2()
    plain = GPT2(model.cfg.replace(dcp=False))
    plain_params = {k: ({**v, "attn": {n: w for n, w in v["attn"].items() if n in ("c_attn", "c_proj")}}
                        if k.startswith("h_") else v) for k, v in params.items()}
    return plain, plain_params


def family_model(family):
    """(model, params, packed, reference): reference(tokens) -> (logits, keep mask or None)."""
    if family == "gpt2-packed":
        model, params = tiny_gpt2()
    elif family == "gpt2-dense":
        model, params = plain_gpt2()
    else:
        model, params = tiny_lm(family)
        return model, params, False, lambda tokens: (lm_reference(model, params, tokens), None)
    return model, params, family == "gpt2-packed", lambda tokens: gpt2_reference(model, params, tokens)


# Splits of 14 tokens: a prefill, a chunk, single-token steps; and one whose first chunks hold only
# left pads for rows 1 and 2 (PADS = 0, 3, 5), so that chunks start before, at and after seq_start.
SPLITS = [(6, 4, 1, 1, 1, 1), (2, 3, 1, 5, 1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("split", SPLITS, ids=["prefill-chunk-steps", "chunks-over-pads"])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunks_on_a_live_cache_equal_the_full_forward(family, split):
    model, params, packed, reference = family_model(family)
    t = sum(split)
    tokens = padded_batch(t)
    full, keep = reference(tokens)
    caches = init_cache(model, 3, t, seq_start=PADS, packed=packed)
    c = 0
    for n in split:
        logits, caches = extend(model, params, caches, tokens[:, c:c + n])
        assert logits.shape == (3, n, VOCAB)
        # float32 everywhere with HIGHEST matmuls; the chunked and one-pass computations add the same
        # terms in another order (tiles, rolled layout), ~1e-6 apart: 1e-4 as the other decoding tests
        mask = real(c + n)[:, c:]
        np.testing.assert_allclose(np.where(mask, logits, 0), np.where(mask, full[:, c:c + n], 0), atol=1e-4,
                                   err_msg=f"columns {c}..{c + n - 1}")
        c += n
        assert int(caches[0].length) == c
        if keep is not None:  # the packed cache holds exactly what the one-pass step mask keeps
            for layer, cache in enumerate(caches):
                for b in range(3):
                    expected = [j - PADS[b] for j in range(PADS[b], c) if keep[layer, b, c - 1, j]]
                    assert live_positions(cache, b) == expected, (layer, b, c)
        else:
            np.testing.assert_array_equal(live_counts(caches)[0], np.maximum(c - PADS, 0))


@pytest.mark.slow
def test_chunk_through_model_apply_continues_the_cache():
    """The protocol itself (no generation helper): a chunk on a prefilled FoX (Pro) cache attends
    over the cached tokens and appends at column ``length``."""
    model, params = tiny_lm("fox-pro")
    tokens = padded_batch(10)
    full = lm_reference(model, params, tokens)
    _, caches = prefill(model, params, tokens[:, :6], seq_start=PADS, capacity=10)
    out = model.apply({"params": params}, tokens[:, 6:10], cache=caches)
    logits, caches = out.logits, out.cache
    np.testing.assert_allclose(logits, full[:, 6:10], atol=1e-4)  # tolerance as above
    assert int(caches[0].length) == 10


@pytest.mark.slow
@pytest.mark.parametrize("family", ["fox-pro", "gpt2-dense", "gpt2-packed"])
def test_chunk_that_overflows_the_capacity_raises(family):
    model, params, packed, _ = family_model(family)
    if packed:  # keep every token, so the prefill leaves 6 live tokens in row 0
        model, params = tiny_gpt2(betas=(1e4, 1e4))
    tokens = padded_batch(9)
    _, caches = prefill(model, params, tokens[:, :6], seq_start=PADS, capacity=8, packed=packed)
    with pytest.raises(ValueError, match="capacity 8"):
        extend(model, params, caches, tokens[:, 6:9])
    with pytest.raises(ValueError, match="capacity 8"):  # the model call checks a concrete cache too
        model.apply({"params": params}, tokens[:, 6:9], cache=caches)


# ---------------------------------------------------------------------------------------------
# FoX decode steps: per-slot cumulative log gates (no scan over the cache), float32 accuracy at 64k
# ---------------------------------------------------------------------------------------------

def primitive_names(jaxpr) -> set:
    """Names of every primitive in a (closed) jaxpr, sub-jaxprs (pjit, cond, loops) included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    names |= primitive_names(sub)
    return names


@pytest.mark.parametrize("arch", ["fox-llama", "fox-pro"])
def test_decode_step_does_not_scan_the_cache(arch):
    """A decode step reads each slot's stored Λ_j: no cumulative sum (or any loop) over the capacity."""
    model, params = tiny_lm(arch)
    tokens = padded_batch(8)
    _, caches = prefill(model, params, tokens[:, :6], seq_start=PADS, capacity=8)
    jaxpr = jax.make_jaxpr(lambda p, c, tok: model.apply({"params": p}, tok, cache=c))(params, caches, tokens[:, 6:7])
    names = primitive_names(jaxpr)
    assert "dot_general" in names  # the walk does see the attention
    assert not names & {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "scan", "while",
                        "reduce_window_sum", "reduce_window"}, sorted(names)


@pytest.mark.slow
def test_decode_decay_float32_accurate_at_64k_tokens():
    """64k tokens, one key/value head read by two query heads (a fast and a slow forgetter), D = 8:
    the decay Λ_i − Λ_j that decode steps form from the stored per-slot Λ, and their outputs, match a
    float64 numpy reference, although |Λ| reaches ~655 where float32's spacing is 6e-5."""
    n, steps, d = 65536, 3, 8
    rng = np.random.default_rng(0)
    log_fgate = np.stack([rng.uniform(-0.02, 0.0, n), rng.uniform(-2e-4, 0.0, n)], -1)[None].astype(np.float32)
    q = rng.standard_normal((1, n, 2, d)).astype(np.float32)
    k = rng.standard_normal((1, n, 1, d)).astype(np.float32)
    v = rng.standard_normal((1, n, 1, d)).astype(np.float32)
    lam64 = np.cumsum(log_fgate[0].astype(np.float64), axis=0)  # [n, H]
    p = n - steps  # the first p tokens as one chunk (what a prefill stores), then decode steps
    zero = jnp.zeros((1, 2), jnp.float32)
    lam_hi, lam_lo = accumulate_log_fgate(zero, zero, jnp.asarray(log_fgate[:, :p]))
    pad = lambda x: jnp.pad(jnp.asarray(x), [(0, 0), (0, steps)] + [(0, 0)] * (x.ndim - 2))
    cache = LayerKVCache(k=pad(k[:, :p]), v=pad(v[:, :p]), lam_hi=pad(lam_hi), lam_lo=pad(lam_lo), k_shift=None,
                         v_shift=None, length=jnp.asarray(p, jnp.int32), seq_start=jnp.zeros((1,), jnp.int32))
    for c in range(p, n):
        o, cache = cached_attention(cache, jnp.asarray(q[:, c:c + 1]), jnp.asarray(k[:, c:c + 1]),
                                    jnp.asarray(v[:, c:c + 1]), jnp.asarray(log_fgate[:, c:c + 1]))
        decay64 = lam64[c] - lam64[:c + 1]                                  # [c + 1, H]
        s64 = np.einsum("hd,jd->jh", q[0, c].astype(np.float64), k[0, :c + 1, 0]) / np.sqrt(d) + decay64
        w64 = np.exp(s64 - s64.max(0))
        o64 = np.einsum("jh,jd->hd", w64 / w64.sum(0), v[0, :c + 1, 0])
        # float32 softmax over 65k keys and a float32 product with V: ~1e-7 relative per term
        np.testing.assert_allclose(np.asarray(o[0, 0]), o64, atol=2e-6, rtol=0, err_msg=f"column {c}")
    decay = np.asarray(slot_decay(cache, cache.length - 1))[0]                # [n, H] from the stored Λ_j
    decay64 = lam64[-1] - lam64
    # relative 1e-6 of the decay itself (float32 rounds it to 6e-8 relative); the decay of the newest
    # slots is ~1e-2, where a float32 Λ of ~655 would be off by 6e-5 (1e-2 relative)
    np.testing.assert_allclose(decay, decay64, rtol=1e-6, atol=1e-9)
