"""Continuous batching (``fox_jax.decoding.batching``): a row of the cache refilled with a request prefilled
alone (``SlotKVCache.insert_row``), ``serve`` against generating each request alone for every storage (dense
ring, window ring, per-head acp rings that wrap, the dcp pool) with stop tokens finishing rows early and rows
refilled, request-keyed sampling (window), the budget → batch arithmetic, and the refusals.

Tolerances: the cache-level check compares float32 attention outputs of the same keys held in other slots (sums
in another order): 1e-6 on O(1) outputs. Model level: greedy tokens exactly, live counts to 1e-4 (means of
float32 counts); logits are not compared (another slot order and more left pads: ~1e-6 apart, see the module).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.cache.slots import new_slot_cache, slot_attention
from fox_jax.cache.visibility import LayerFacts
from fox_jax.decoding import RequestRefused, cache_bytes, generate, init_cache, min_slots, plan_serving, serve
from test_decoding import VOCAB, plain_gpt2, tiny_lm

attend = jax.jit(slot_attention)
insert = jax.jit(lambda cache, row, source: cache.insert_row(row, source))


# =============================================================================================
# The cache: insert_row
# =============================================================================================

@pytest.mark.parametrize("policy", ["sinks:2+5", "acp", "dcp"])
@pytest.mark.filterwarnings("ignore::fox_jax.cache.policies.HeuristicEvictionWarning")  # acp without QK-norm
def test_insert_row_moves_a_row_to_the_batch_columns(policy):
    """A one-row cache fed 9 columns (1 pad, then 8 decode steps) put into row 1 of a 2-row cache that is at
    column 22 (a shift of 13: not a multiple of any ring, so the slots roll): row 1 then holds the same positions
    with the same k and Λ per position, row 0 is untouched, and the next decode step of row 1 outputs what the
    one-row cache outputs (1e-6). Single steps only: two compiles (the chunk paths do not touch insert_row)."""
    rng = np.random.default_rng(0)
    h, hkv, d, r = 4, 2, 4, 4
    kw = dict(n_heads=h, kv_heads=hkv, head_dim=d, dtype=jnp.float32, qk_norm=False, block=8, max_context=40,
              forget_gate=policy != "dcp", kv_shift=False, interaction_dim=r if policy == "dcp" else None)
    slots = 8 if policy != "dcp" else 16                       # ring of 8 - 2 sinks: wraps; acp evicts fast

    def inputs(b, t):
        x = dict(q=rng.standard_normal((b, t, h, d)), k=rng.standard_normal((b, t, hkv, d)),
                 v=rng.standard_normal((b, t, hkv, d)), g=rng.uniform(-1.5, -0.5, (b, t, h)))
        x = {n: jnp.asarray(a, jnp.float32) for n, a in x.items()}
        facts = LayerFacts(q_int=jnp.asarray(rng.standard_normal((b, t, r)), jnp.float32),
                           k_int=jnp.asarray(rng.standard_normal((b, t, r)), jnp.float32),
                           beta=jnp.float32(1.0)) if policy == "dcp" else None
        return x, facts

    def step(cache, x, facts):
        return attend(cache, x["q"], x["k"], x["v"], None if policy == "dcp" else x["g"], facts=facts)

    one = new_slot_cache(1, slots, policy=policy, seq_start=jnp.asarray([1]), **kw)
    for _ in range(9):
        _, one = step(one, *inputs(1, 1))
    batch = new_slot_cache(2, slots, policy=policy, **kw)
    for _ in range(22):
        _, batch = step(batch, *inputs(2, 1))
    assert int(batch.length) == 22 and int(one.length) == 9
    merged = insert(batch, 1, one)
    assert int(merged.length) == 22 and int(merged.seq_start[1]) == 1 + 13 and int(merged.seq_start[0]) == 0

    def held(cache, row):  # {position: (k per kv head, Λ hi)} of the held slots of a row
        out = {}
        for g in cache.groups:
            pos = np.asarray(g.held_positions(cache))[row]                 # [nt, C]
            k = np.asarray(g.k)[row]                                       # [n, C, D]
            for n in range(k.shape[0]):
                for s in np.flatnonzero(pos[min(n, pos.shape[0] - 1)] >= 0):
                    lam = None if g.lam_hi is None else np.asarray(g.lam_hi)[row, n, :, s]
                    out[(g.heads[n], int(pos[min(n, pos.shape[0] - 1), s]))] = (k[n, s], lam)
        return out

    want, got = held(one, 0), held(merged, 1)
    assert want and sorted(want) == sorted(got)
    for key in want:
        np.testing.assert_array_equal(want[key][0], got[key][0])
        if want[key][1] is not None:
            np.testing.assert_array_equal(want[key][1], got[key][1])
    assert sorted(held(batch, 0)) == sorted(held(merged, 0))
    x, facts = inputs(2, 1)
    o_merged, _ = step(merged, x, facts)
    x1 = {n: a[1:] for n, a in x.items()}
    o_one, _ = step(one, x1, None if facts is None else LayerFacts(q_int=facts.q_int[1:], k_int=facts.k_int[1:],
                                                                    beta=facts.beta))
    np.testing.assert_allclose(np.asarray(o_merged[1]), np.asarray(o_one[0]), atol=1e-6)
    with pytest.raises(ValueError, match="one-row"):
        batch.insert_row(0, batch)


# =============================================================================================
# serve
# =============================================================================================

LENGTHS = (70, 5, 33, 90, 1, 64, 41)   # one prefill bucket (128 columns); the longest context 94 > 64 slots
N_NEW = 5


def _prompts(lengths=LENGTHS, seed=0):
    rs = np.random.default_rng(seed)
    return [rs.integers(0, VOCAB, n).astype(np.int32) for n in lengths]


def _left_padded(prompts, width=None):
    width = max(len(p) for p in prompts) if width is None else width
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = p
    return tokens, np.asarray([width - len(p) for p in prompts], np.int32)


CASES = {  # policy -> (model, params, pool, steps_per_check, sampling)
    "dense": lambda: (*tiny_lm("fox-pro"), {}, 4, {}),                   # a ring of 128: wraps from column 128 on
    "window:8": lambda: (*tiny_lm("fox-pro"), {}, 1, dict(temperature=1.0, top_k=8)),      # a ring of 64; sampled
    # the heuristic; per-head rings calibrated on request 0: 64 < 94 (they wrap)
    "acp": lambda: (*tiny_lm("fox-llama", fgate_bias=-2.0), dict(calibrate=1), 1, {}),
    "dcp": lambda: (*tiny_lm("fox-pro", dcp=True), dict(slots=64), 1, {}),   # a slot pool of 64 < 94
}


@pytest.mark.parametrize("policy", [pytest.param(p, marks=pytest.mark.slow) if p == "dcp" else p for p in CASES])
@pytest.mark.filterwarnings("ignore::fox_jax.cache.policies.HeuristicEvictionWarning")  # acp without QK-norm
def test_serve_equals_generating_each_request_alone(policy):
    """7 requests of 1-90 tokens through 2 rows (a KV budget of 2.5 rows): every request's tokens and live counts
    equal generating it alone (a batch of one, left-padded to the serving width of 128: one compile for all seven; key
    fold_in(rng, q) for request q; a pool that never overflows, so the policy's own output) up to a stop token that finishes some requests early (generate's stop
    semantics: the tokens up to the first stop); each request is completed exactly once, in request order, and
    rows were refilled (fewer decode steps than the requests' steps one after another). Greedy except
    window:8, which samples (top-k 8, temperature 1): a sampled token equals the one alone only if both the
    logits and the request's key (its id and token index, not its row) are right. Dense decodes in blocks of 4
    steps, so finished rows step on (masked) inside a block. acp's pool is calibrated on the first request (the
    calibration run is the reference's program, left-padded to the serving width: no extra compile)."""
    model, params, pool, steps, sampling = CASES[policy]()
    prompts = _prompts()
    rng = jax.random.PRNGKey(11)
    kw = dict(max_new_tokens=N_NEW, policy=policy, prefill_chunk=128, rng=rng, **sampling)
    plan = plan_serving(model, params, prompts, max_new_tokens=N_NEW, policy=policy, prefill_chunk=128, **pool)
    if "calibrate" in pool:
        assert plan.slots_rule.startswith("calibrated") and len(plan.slots) == model.cfg.n_layers and all(
            isinstance(c, tuple) and len(c) == 4 and all(x % 64 == 0 for x in c) for c in plan.slots)
    tokens, pads = _left_padded(prompts, plan.width)
    full = min_slots(policy, plan.max_context)
    alone = [generate(model, params, tokens[q:q + 1], seq_start=pads[q:q + 1], slots=full,
                      max_context=plan.max_context, **{**kw, "rng": jax.random.fold_in(rng, q)})
             for q in range(len(prompts))]
    free = np.concatenate([np.asarray(g.tokens) for g in alone])                              # [7, N]
    ref_live = np.concatenate([np.asarray(g.live_counts) for g in alone], axis=2)             # [N, layers, 7]
    stop = next(int(t) for t in free[:, :2].ravel() if not all(t in row for row in free))  # stops some rows only
    lengths = np.asarray([list(row).index(stop) + 1 if stop in row else N_NEW for row in free])
    row = jax.eval_shape(lambda: init_cache(model, 1, plan.slots, policy=policy))        # shapes: nothing allocated
    row_bytes = sum(c.allocated_bytes() for c in row)
    out = serve(model, params, prompts, slots=plan.slots if pool else None, kv_budget=2.5 * row_bytes, stop_tokens=(stop,),
                steps_per_check=steps, **kw)
    s = out.summary
    assert s["batch"] == 2 and s["requests"] == len(prompts) and s["kv_bytes_row"] == row_bytes
    assert s["kv_bytes_allocated"] == 2 * row_bytes and s["provable"] is (policy != "acp")
    assert [c.index for c in out.completions] == list(range(len(prompts)))
    for c in out.completions:
        n = lengths[c.index]
        np.testing.assert_array_equal(c.tokens, free[c.index, :n], err_msg=f"request {c.index}")
        np.testing.assert_allclose(c.live_tokens_mean, ref_live[:n, :, c.index].mean(), rtol=1e-4)
        assert c.overflow == 0
    assert lengths.min() < N_NEW and s["generated_tokens"] == lengths.sum()
    assert s["decode_steps"] < (lengths - 1).sum() and s["tokens_per_s"] > 0 and s["requests_per_s"] > 0
    assert s["overflow"] == [0] * len(prompts) and 0 < s["kv_bytes_live_mean"] < s["kv_bytes_allocated"]
    if pool:
        assert s["slots"] < max(LENGTHS) + N_NEW - 1  # the acp rings wrap, the dcp pool reuses freed slots


def test_plan_serving_budget_batch_and_refusals():
    """The batch is floor(budget / one row's allocated KV), at most the requests (and batch_size); a request
    whose own pool does not fit the budget, a fixed pool too small for it, or too many positions is refused
    by name before anything runs (nothing is compiled here: the bytes come from the caches' shapes); a given
    pool larger than the budget names the budget. (The acp calibration: test_serve_equals_...[acp].)"""
    model, params = tiny_lm("fox-pro")
    prompts = _prompts()
    kw = dict(max_new_tokens=N_NEW, prefill_chunk=64)
    plan = plan_serving(model, params, prompts, policy="window:8", **kw)
    row = cache_bytes(init_cache(model, 1, 8, policy="window:8"))["allocated"]
    assert plan.row_bytes == row and plan.batch == len(prompts) and plan.width == 128
    assert plan_serving(model, params, prompts, policy="window:8", kv_budget=3.99 * row, **kw).batch == 3
    assert plan_serving(model, params, prompts, policy="window:8", kv_budget=99 * row, **kw).batch == len(prompts)
    assert plan_serving(model, params, prompts, policy="window:8", kv_budget=99 * row, batch_size=4, **kw).batch == 4
    dense = plan_serving(model, params, prompts, **kw)                       # the longest context: 94 -> 128 slots
    assert dense.slots == max(LENGTHS) + N_NEW - 1 and dense.max_context == 94
    assert dense.row_bytes == cache_bytes(init_cache(model, 1, 94))["allocated"]
    names = [f"line {i + 1}" for i in range(len(prompts))]
    # each request's own ring: 64 slots for contexts ≤ 64, 128 above; the first that does not fit is named
    with pytest.raises(RequestRefused, match=r"^line 1: 70 \+ 5 tokens need .* GiB of KV per row under dense; "
                                             r"kv_budget .* GiB holds none$") as err:
        plan_serving(model, params, prompts, kv_budget=0.75 * dense.row_bytes, names=names, **kw)
    assert err.value.index == 0
    with pytest.raises(RequestRefused, match=r"^request 0: 70 \+ 5 tokens need 74 KV slots .* holds 64$"):
        plan_serving(model, params, prompts, slots=64, **kw)
    with pytest.raises(ValueError, match=r"^kv_budget .* GiB holds no row: one row's pool \(given\) takes "):
        plan_serving(model, params, prompts, slots=128, kv_budget=0.5 * dense.row_bytes, **kw)
    gpt2, gpt2_params = plain_gpt2()                                          # 64 learned positions
    with pytest.raises(RequestRefused, match=r"^request 1: 62 \+ 5 tokens need 66 positions; the model has 64$"):
        plan_serving(gpt2, gpt2_params, _prompts((3, 62)), **kw)
    for bad, match in ((dict(kv_budget=0), "kv_budget"), (dict(batch_size=0), "batch_size"),
                       (dict(names=["a"]), "names")):
        with pytest.raises(ValueError, match=match):
            plan_serving(model, params, prompts, **kw, **bad)
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty"):
        plan_serving(model, params, [prompts[0], []], **kw)
