"""Decoding: the caches against an independent numpy reference for every cache policy (property based), ring
wrap-around and per-head ACP starts, ACP's ε bound, the heuristic ACP's independence of the chunking, float32
decays at 64k tokens; the policy objects; the engine (``fox_jax.decoding``) against the models' full forward for
every family and policy, precast weights, and ``generate``'s options and errors.

Tolerances: float32 everywhere with HIGHEST-precision matmuls (``fox_jax.ops._common.dot_precision``). The
layer-level references are float64 and see O(1) logits over ≤ 25 keys, so the caches' float32 softmax is
~1e-7 off (the ``reference`` checks of the author measured ≤ 3e-7): 1e-5 leaves room without hiding a wrong
mask (one key more or less moves an output by ~1e-1). Model-level comparisons add the same terms in another
order (tiles, chunks, the ring layout), ~1e-6 apart on logits of std ~0.1: 1e-4, as before the engine change.
"""

import dataclasses
import functools
import sys
import math
import re
import warnings
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.cache.decay import accumulate_log_fgate
from fox_jax.cache.policies import (ACP, DCP, DEFAULT_LOG_EPSILON, POLICIES, POLICY_FORMS, RING_BLOCK,
                                    HeuristicEvictionWarning, Sinks, Window, parse_policy, register_policy)
from fox_jax.cache.slots import PoolGroup, RingGroup, new_slot_cache, slot_attention
from fox_jax.cache import visibility
from fox_jax.cache.visibility import RULES, ACPRule, LayerFacts, Rule, last_hidden, register_rule, rule_for
from fox_jax.decoding import (decode_step, extend, generate, init_cache, live_counts, prefill,
                              token_losses_under_policy)
from fox_jax.decoding import generation
from fox_jax.models import LanguageModel, preset
from fox_jax.models.gpt2 import GPT2, GPT2Config
from fox_jax.nn.attention import fold_input_norms, gate_tables
from fox_jax.ops import acp as acp_ops
from fox_jax.ops import forgetting_attention
from fox_jax.ops.decode_attention import decode_attention

try:  # the property test needs hypothesis; without it that one test skips and the module still collects
    from hypothesis import HealthCheck, given, settings, strategies as st
except ModuleNotFoundError:  # pragma: no cover
    given = None

VOCAB = 97
PADS = np.array([0, 3, 5])  # left pads of a batch of 3
INF = float("inf")


# =============================================================================================
# The policy objects (jax-free) and the decode attention op
# =============================================================================================

def test_policies_answer_what_the_engine_asks():
    """Every registered policy has a rule, parses back from its spec, and answers the engine's questions."""
    assert set(RULES) == set(POLICIES.values())
    for spec in ("dense", "dcp", "acp", "acp:-4.5", "window:7", "sinks:4+12"):
        policy = parse_policy(spec)
        assert parse_policy(policy.spec) == policy and str(policy) == spec and parse_policy(policy) is policy
    dense, window, sinks, dcp, acp = map(parse_policy, ("dense", "window:7", "sinks:4+12", "dcp", "acp"))
    assert [p.fixed_budget for p in (dense, window, sinks, dcp, acp)] == [True, True, True, False, False]
    assert [p.per_head for p in (dense, window, sinks, dcp, acp)] == [False, False, False, False, True]
    assert [p.storage for p in (dense, window, sinks, dcp, acp)] == ["ring", "ring", "ring", "pool", "ring"]
    assert [p.forward_exact for p in (dense, window, sinks, dcp, acp)] == [True, False, False, True, False]
    assert (dense.flash_prefill(), window.flash_prefill(), sinks.flash_prefill(), acp.flash_prefill()) == (
        {}, {"window_size": 7}, None, None)
    assert [p.max_live(100) for p in (dense, window, sinks, dcp, acp)] == [100, 7, 16, 100, 100]
    assert [p.max_live(5) for p in (window, sinks)] == [5, 5] and sinks.pinned == 4 and window.pinned == 0
    assert dense.capacity(65) == 128 and dense.capacity(1) == RING_BLOCK and sinks.capacity(3, block=1) == 17
    # the sink slots: a power of two ≥ 16 in front of a ring of the other slots − S, a multiple of the block
    assert sinks.pin_slots == 16 and sinks.capacity(300) == 16 + 320 and window.pin_slots == 0
    assert parse_policy("sinks:20+4").pin_slots == 32 and parse_policy("sinks:0+4").pin_slots == 0
    fox, pro, gpt2 = (dict(forget_gate=True, qk_norm=False, interaction_dim=None),
                      dict(forget_gate=True, qk_norm=True, interaction_dim=8),
                      dict(forget_gate=False, qk_norm=False, interaction_dim=None))
    assert acp.provable(pro) and not acp.provable(fox) and all(p.provable(fox) for p in (dense, window, dcp))
    assert acp.missing(gpt2) is not None and dcp.missing(fox) is not None and dcp.missing(pro) is None
    with pytest.raises(ValueError, match="forget gate"):
        acp.check(gpt2)
    with pytest.raises(ValueError, match="DCP"):
        dcp.check(fox)
    with pytest.warns(HeuristicEvictionWarning, match="heuristic"):
        acp.check(fox)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acp.check(pro)  # provable: no warning
    for bad in ("lru", "window:0", "dense:3", "sinks:-1+4"):
        with pytest.raises(ValueError) as err:
            parse_policy(bad)
        assert POLICY_FORMS in str(err.value)
    for bad, form in (("sinks:4", "sinks:S+W"), ("window", "window:W")):  # the form of the policy named
        with pytest.raises(ValueError, match=re.escape(repr(bad)) + " needs .*" + re.escape(form)):
            parse_policy(bad)
    with pytest.raises(ValueError, match="log ε < 0"):
        parse_policy("acp:1")


def test_decode_attention_reads_its_range_across_the_wrap():
    """``decode_attention`` over a ring: logical key i in slot i mod C, only [lo, hi) read (here across the
    wrap, per (row, head), an empty range gives 0), ``valid`` masks slots, the decay pair is added."""
    rng = np.random.default_rng(0)
    b, hkv, g, c, d = 2, 2, 3, 8, 4
    q = rng.standard_normal((b, hkv, g, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, hkv, c, d)).astype(np.float32) for _ in range(2))
    lam_q = [rng.uniform(-3, 0, (b, hkv, g)).astype(np.float32) for _ in range(2)]
    lam_k = [rng.uniform(-3, 0, (b, hkv, g, c)).astype(np.float32) for _ in range(2)]
    lo, hi = np.array([[5, 9], [0, 3]]), np.array([[11, 14], [8, 3]])                 # row 1 head 1: empty
    valid = rng.uniform(size=(b, 1, c)) < 0.8
    o = np.asarray(decode_attention(*map(jnp.asarray, (q, k, v)), lo=jnp.asarray(lo), hi=jnp.asarray(hi),
                                    valid=jnp.asarray(valid), lam_q=tuple(map(jnp.asarray, lam_q)),
                                    lam_k=tuple(map(jnp.asarray, lam_k))))
    for r in range(b):
        for n in range(hkv):
            slots = [i % c for i in range(lo[r, n], hi[r, n]) if valid[r, 0, i % c]]
            if not slots:
                np.testing.assert_array_equal(o[r, n], 0.0)
                continue
            s = q[r, n].astype(np.float64) @ k[r, n, slots].T / np.sqrt(d)
            s += (lam_q[0][r, n][:, None] - lam_k[0][r, n][:, slots]) + (lam_q[1][r, n][:, None] - lam_k[1][r, n][:, slots])
            w = np.exp(s - s.max(1, keepdims=True))
            np.testing.assert_allclose(o[r, n], (w / w.sum(1, keepdims=True)) @ v[r, n, slots], atol=1e-6)


# =============================================================================================
# Layer level: slot_attention (fox_jax.cache.slots) against a numpy reference of each policy
# =============================================================================================

attend = jax.jit(slot_attention)  # one compile per (policy, storage layout, chunk length)
B, H, D, R_INT = 2, 4, 4, 4       # rows, query heads, head dim, DCP interaction dim


def reference_visibility(policy, pos, lam=None, delta=None, z=None, hkv=None):
    """[B, T, T, H'] bool, query column i sees key column j, from the rules of ``fox_jax.cache.policies``
    alone (H' = H for acp, else 1). Whole sequence at once, float64; pads never see nor are seen.

    pos [B, T] token positions (negative on left pads); lam [B, T, H] Λ; delta: the ACP threshold, [H] or per
    query [B, T, H]; hkv: key/value heads (acp); z [B, T, T] DCP keep logits (queries on axis 1)."""
    policy = parse_policy(policy)
    real = pos >= 0
    t = pos.shape[1]
    pi, pj = pos[:, :, None], pos[:, None, :]
    vis = real[:, :, None] & real[:, None, :] & (pj <= pi)
    if isinstance(policy, Window):
        vis &= pi - pj < policy.window
    elif isinstance(policy, Sinks):
        vis &= (pj < policy.sinks) | (pi - pj < policy.window)
    elif isinstance(policy, DCP):  # j survives query i iff every query n ∈ (j, i] voted z_{n,j} > 0
        vote_drop = (z <= 0) & (np.arange(t)[:, None] > np.arange(t)[None, :])[None]
        vis &= ~np.logical_or.accumulate(vote_drop, axis=1)
    if isinstance(policy, ACPWindow):  # the extension example: acp within a window
        vis &= pi - pj < policy.window
    vis = vis[..., None]
    if isinstance(policy, ACP):  # query n hides j when Λ_n − Λ_j < δ_n for every query head of the kv head;
        delta = np.asarray(delta)  # once hidden, hidden for every later query
        delta = delta[:, :, None, :] if delta.ndim == 3 else delta[None, None, None, :]
        hidden = (lam[:, :, None, :] - lam[:, None, :, :]) < delta                       # [B, n, j, H]
        hidden = hidden.reshape(*hidden.shape[:3], hkv, -1).all(-1)                      # [B, n, j, Hkv]
        hidden &= (np.arange(t)[:, None] > np.arange(t)[None, :])[None, :, :, None]
        vis = vis & ~np.logical_or.accumulate(hidden, axis=1)
        vis = np.repeat(vis, H // hkv, axis=3)
    return vis


def reference_attention(q, k, v, lam, vis):
    """o_i = Σ_j softmax_j(q_i·k_j/√D + Λ_i − Λ_j) v_j over the visible j (float64; 0 if none)."""
    d = q.shape[3]
    g = q.shape[2] // k.shape[2]
    kh, vh = np.repeat(k, g, axis=2).astype(np.float64), np.repeat(v, g, axis=2).astype(np.float64)
    s = np.einsum("bihd,bjhd->bijh", q.astype(np.float64), kh) / np.sqrt(d)
    if lam is not None:
        s = s + lam[:, :, None, :] - lam[:, None, :, :]
    vis = np.broadcast_to(vis, s.shape)
    m = np.max(np.where(vis, s, -np.inf), axis=2, keepdims=True)
    w = np.where(vis, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    w = w / np.maximum(w.sum(axis=2, keepdims=True), 1e-300)
    return np.einsum("bijh,bjhd->bihd", w, vh)


def reference_retained(vis, pos, fed, hkv):
    """What the policy says a cache holds after ``fed`` columns, [B][Hkv] sets of positions: what the last
    fed query sees; with per-head visibility (acp) per key/value head."""
    g = vis.shape[3] // hkv
    out = []
    for r in range(pos.shape[0]):
        cols = [j for j in range(fed) if pos[r, j] >= 0]
        heads = []
        for n in range(hkv):
            hs = range(n * g, (n + 1) * g) if vis.shape[3] > 1 else [0]
            heads.append({int(pos[r, j]) for j in cols if any(vis[r, fed - 1, j, h] for h in hs)})
        out.append(heads)
    return out


def acp_bound(delta, n, log_eps=DEFAULT_LOG_EPSILON):
    """(U [H] float32, the δ the ACP rule forms from it in float64): U = (log ε − log N − δ)/2, so that
    δ = −(2U + log N) + log ε (the layer-level tests pick δ and hand the rule the bound; U is arithmetic here)."""
    u = ((log_eps - math.log(n) - np.asarray(delta, np.float64)) / 2).astype(np.float32)
    return u, np.minimum(-(2 * u.astype(np.float64) + math.log(n)) + log_eps, 0.0)


def check_slot_cache(policy, hkv, gates, chunks, pads, slots, seed):
    """Feed random q/k/v (and gates, δ, DCP logits) in ``chunks`` through a fresh cache (capacities as asked:
    ``block=1``) and check, after every chunk, the invariants of ``fox_jax.cache.slots`` against the numpy
    reference:

    (a) every slot that holds a key holds a distinct real position < the tokens fed;
    (b) live count ≤ capacity (and ``live_count()`` is the mean over key/value heads);
    (c) the held positions are exactly what the policy lets the last query see (``reference_retained``);
        after an overflow they stay a subset of it;
    (d) until a row overflows its outputs equal the reference (1e-5, module docstring), and its overflow
        counter is > 0 exactly when the policy wanted more tokens than the capacity, by the surplus; a chunk
        of T > 1 that overflows still attended to the cache as it was (a decode step writes first);
    (e) placement: a pool (dcp) fills its lowest free slots (the highest occupied slot < the peak live count
        so far); a ring holds column c in slot P + (c mod (C − P)) and a sink position p in slot p (P = pin_slots);
        the groups' ``peak`` is the peak live count over the rows;
    (f) each held slot stores the k/v (Λ pair, DCP k_int) of the token at its position;
    (g) with per-head tables (acp) each key/value head keeps its own set (its own ring ``start``): (c) is
        checked per head;
    (h) ``cache_bytes``: allocated = every entry of every row and head, live = the held entries, each entry
        k + v (+ the Λ pairs of its query heads, + DCP's k_int per head share).

    Returns [B] bool, whether each row overflowed."""
    policy = parse_policy(policy)
    rng = np.random.default_rng(seed)
    t = sum(chunks)
    pos = np.arange(t)[None] - pads[:, None]
    real = pos >= 0
    q = rng.standard_normal((B, t, H, D)).astype(np.float32)
    k = rng.standard_normal((B, t, hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, t, hkv, D)).astype(np.float32)
    lf = lam = delta = z = facts = None
    if gates:  # f ∈ (0.3, 1): Λ falls by ~0.4 per token
        lf = np.log(rng.uniform(0.3, 1.0, (B, t, H))).astype(np.float32)
        lam = np.cumsum(np.where(real[..., None], lf, 0).astype(np.float64), axis=1)
    causal = real[:, :, None] & real[:, None, :] & (pos[:, None, :] <= pos[:, :, None])
    if isinstance(policy, ACP):  # δ ∈ (−3, −0.2): keys are evicted 1 to ~8 tokens after they were written
        delta = -rng.uniform(0.2, 3.0, H)
        decay = lam[:, :, None, :] - lam[:, None, :, :]
        for h in range(H):  # keep every decay clear of δ by more than float32 noise, so the test is exact
            while np.min(np.abs(decay[..., h][causal] - delta[h])) < 1e-4:
                delta[h] -= 3e-4
        u, delta = acp_bound(delta, t)
        facts = LayerFacts(logit_bound=jnp.asarray(u))
    if isinstance(policy, DCP):
        q_int = rng.standard_normal((B, t, R_INT)).astype(np.float32)
        k_int = rng.standard_normal((B, t, R_INT)).astype(np.float32)
        beta = float(rng.uniform(-0.5, 1.5))
        dot = np.einsum("bir,bjr->bij", q_int.astype(np.float64), k_int) / np.sqrt(R_INT)
        while np.min(np.abs(dot + beta)) < 1e-4:  # no vote within float32 noise of 0
            beta += 3e-4
        z = dot + beta
    vis = reference_visibility(policy, pos, lam, delta, z, hkv)
    ref = reference_attention(q, k, v, lam, vis)

    cache = new_slot_cache(B, slots, n_heads=H, kv_heads=hkv, head_dim=D, dtype=jnp.float32, forget_gate=gates,
                           kv_shift=False, interaction_dim=R_INT if isinstance(policy, DCP) else None, qk_norm=True,
                           policy=policy, seq_start=pads, max_context=t, block=1)
    per_head = policy.per_head
    head_slots = [next(g.slots for g in cache.groups if n in g.heads) for n in range(hkv)]
    assert sorted(n for g in cache.groups for n in g.heads) == list(range(hkv))
    assert all(isinstance(g, PoolGroup if isinstance(policy, DCP) else RingGroup) for g in cache.groups)
    overflowed = np.zeros(B, bool)
    last_overflow = np.zeros(B, int)
    peak = np.zeros((B, hkv), int)
    c0 = 0
    for c in chunks:
        sl = slice(c0, c0 + c)
        if isinstance(policy, DCP):
            facts = LayerFacts(q_int=jnp.asarray(q_int[:, sl]), k_int=jnp.asarray(k_int[:, sl]), beta=jnp.float32(beta))
        o, cache = attend(cache, jnp.asarray(q[:, sl]), jnp.asarray(k[:, sl]), jnp.asarray(v[:, sl]),
                          None if lf is None else jnp.asarray(lf[:, sl]), facts=facts)
        fed = c0 = c0 + c
        o = np.asarray(o)
        assert np.all(np.isfinite(o))
        assert int(cache.length) == fed
        want = reference_retained(vis, pos, fed, hkv)
        over, live = np.asarray(cache.overflow), np.asarray(cache.live_count())
        for r in range(B):
            held = {}
            for g in cache.groups:
                table = np.asarray(g.held_positions(cache))[r]                             # [nt, C]
                assert table.shape == (len(g.heads) if per_head else 1, g.slots)
                for ni, n in enumerate(g.heads):
                    col = table[ni if per_head else 0]
                    occ = np.flatnonzero(col >= 0)
                    held_pos = col[occ]
                    assert len(set(held_pos.tolist())) == len(held_pos), "(a) a position held twice"
                    assert np.all(held_pos < fed - pads[r]), "(a) a position not fed yet"
                    assert len(held_pos) <= g.slots                                            # (b)
                    peak[r, n] = max(peak[r, n], len(held_pos))
                    if isinstance(g, PoolGroup):
                        assert len(occ) == 0 or occ.max() < peak[r, n], "(e) not lowest-free-first"
                    else:
                        pin, ring = g.pin_slots, g.slots - g.pin_slots
                        np.testing.assert_array_equal(occ, np.where(held_pos < g.pinned, held_pos,
                                                                    pin + (held_pos + pads[r]) % ring), "(e) ring slot")
                    cols = held_pos + pads[r]                                                  # (f)
                    np.testing.assert_array_equal(np.asarray(g.k)[r, ni, occ], k[r, cols, n])    # [n, S, D]
                    np.testing.assert_array_equal(np.asarray(g.v)[r, ni, occ], v[r, cols, n])
                    if gates:  # the pair carries ~2⁻⁴⁴ relative (decay.py); |Λ| ≤ ~25 here
                        gq = H // hkv
                        pair = np.asarray(g.lam_hi, np.float64)[r, ni][:, occ] + np.asarray(g.lam_lo)[r, ni][:, occ]
                        np.testing.assert_allclose(pair.T, lam[r, cols, n * gq:(n + 1) * gq], atol=1e-9, rtol=0)
                    if isinstance(policy, DCP):
                        np.testing.assert_array_equal(np.asarray(g.k_int)[r, occ], k_int[r, cols])
                    held[n] = set(held_pos.tolist())
            assert live[r] == pytest.approx(np.mean([len(held[n]) for n in range(hkv)]))      # (b)
            for n in range(hkv):
                assert held[n] <= want[r][n], ("(c) holds a token the policy hides", r, n)
            if overflowed[r]:
                assert over[r] >= last_overflow[r] > 0
            else:
                surplus = [max(len(want[r][n]) - head_slots[n], 0) for n in range(hkv)]
                expected = sum(surplus) if per_head else surplus[0]
                assert over[r] == expected, ("(d) overflow counter", r, int(over[r]), surplus)
                if expected == 0 or c > 1:  # a chunk attends to the cache as it was: still the policy's
                    mask = real[r, sl]
                    np.testing.assert_allclose(o[r][mask], ref[r, sl][mask], atol=1e-5, rtol=0,
                                               err_msg=f"(d) outputs of row {r}, columns {sl}")
                if expected == 0:
                    for n in range(hkv):
                        assert held[n] == want[r][n], ("(c)/(g) live set", r, n, held[n], want[r][n])
                overflowed[r] = expected > 0
            last_overflow[r] = over[r]
        entry = 2 * D * 4 + (8 * (H // hkv) if gates else 0) + (R_INT * 4 / hkv if isinstance(policy, DCP) else 0)
        held_entries = sum(int((np.asarray(g.held_positions(cache)) >= 0).sum()) * (len(g.heads) if not per_head
                                                                                     else 1) for g in cache.groups)
        assert generation.cache_bytes([cache]) == {  # (h)
            "allocated": int(round(B * sum(len(g.heads) * g.slots for g in cache.groups) * entry)),
            "live": int(round(held_entries * entry))}
        for g in cache.groups:  # (e) the recorded peak: the most any row held, per table
            want_peak = [peak[:, n].max() for n in g.heads] if per_head else [peak[:, list(g.heads)].max()]
            np.testing.assert_array_equal(np.asarray(g.peak).max(axis=0), want_peak)
        if gates:  # the carry into the next chunk: Λ of the last column
            carry = np.asarray(cache.lam_hi, np.float64) + np.asarray(cache.lam_lo)
            np.testing.assert_allclose(carry, lam[:, fed - 1], atol=1e-9, rtol=0)
    return overflowed


CACHE_KINDS = ("dense", "window", "sinks", "dcp", "acp")

if given is not None:
    @st.composite
    def slot_cache_cases(draw, kind):
        """(policy, Hkv, gates, chunk sizes, left pads, capacities, seed) for a policy of ``kind``: W and S
        random (acp's δ and dcp's votes come from the seed), GQA (H = 4, Hkv = 2) or not (Hkv = 4), 2–7 pushes
        of 1–3 tokens, up to 4 left pads, capacities from below to above the policy's ``max_live`` (rings wrap;
        acp: also one capacity per key/value head; sinks: 16 sink slots, none at S = 0, and a ring of at least one)."""
        if kind == "window":
            policy = f"window:{draw(st.integers(1, 5))}"
        elif kind == "sinks":
            policy = f"sinks:{draw(st.integers(0, 3))}+{draw(st.integers(1, 4))}"
        else:
            policy = kind
        hkv = draw(st.sampled_from([2, 4]))
        gates = kind == "acp" or draw(st.booleans())
        chunks = tuple(draw(st.lists(st.integers(1, 3), min_size=2, max_size=7)))
        t = sum(chunks)
        pads = np.array(draw(st.lists(st.integers(0, min(4, t - 1)), min_size=B, max_size=B)))
        need = parse_policy(policy).max_live(t - int(pads.min()))
        if kind in ("dcp", "acp"):  # max_live is the context; what they keep is data-dependent
            count = lambda: draw(st.sampled_from([need, need + 1, max(1, need // 2), max(1, need // 4), 1]))
        else:  # ≥ max_live never overflows; fewer slots overflow once the context is long enough
            count = lambda: max(1, need + draw(st.integers(-3, 2)))
        slots = tuple(count() for _ in range(hkv)) if kind == "acp" and draw(st.booleans()) else count()
        return policy, hkv, gates, chunks, pads, slots, draw(st.integers(0, 2 ** 32 - 1))

    @pytest.mark.slow
    @pytest.mark.parametrize("kind", CACHE_KINDS)
    @settings(max_examples=3, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_slot_cache_invariants_for_random_chunks_and_policies(kind, data):
        """``check_slot_cache`` on random cases, 3 per policy kind (15 in all: each case compiles its chunk
        lengths; derandomised: the same cases on every run, the first of each kind hypothesis's simplest)."""
        check_slot_cache(*data.draw(slot_cache_cases(kind), label="case"))
else:  # pragma: no cover
    @pytest.mark.parametrize("kind", CACHE_KINDS)
    def test_slot_cache_invariants_for_random_chunks_and_policies(kind):
        pytest.skip("needs hypothesis")


def test_slot_cache_fixed_case():
    """``check_slot_cache`` without hypothesis: acp with per-head capacities whose equal values group
    non-adjacent heads (9, 4, 9, 4), a prefill, decode steps and chunks, pads; the 4-entry rings wrap and
    overflow."""
    assert check_slot_cache("acp", 4, True, (5, 1, 1, 5, 1, 1), np.array([0, 3]), (9, 4, 9, 4), 11).any()


@dataclasses.dataclass(frozen=True)
class ACPWindow(ACP):
    """docs/inference.md's example of a new policy: acp, and at most the last W tokens."""

    window: int = 1024
    name: ClassVar[str] = "acpwin"
    form: ClassVar[str] = "acpwin:W"

    @classmethod
    def parse(cls, arg: str, spec: str) -> "ACPWindow":
        return cls(window=int(arg))

    @property
    def spec(self) -> str:
        return f"acpwin:{self.window}"

    def max_live(self, context: int) -> int:
        return max(1, min(self.window, context))


class ACPWindowRule(ACPRule):
    def first_visible(self, policy, delta, chunk, keys):
        return jnp.maximum(super().first_visible(policy, delta, chunk, keys), chunk.cols - (policy.window - 1))


def test_a_new_policy_is_a_class_and_a_rule():
    """The example of docs/inference.md ("Adding a cache policy"): registered with ``register_policy`` and
    ``register_rule`` (two files in the library; here, this module), it parses (and an unknown policy's error lists
    its form) and runs through ``check_slot_cache`` (ring wrap, per-head starts, overflow, outputs against the
    reference)."""
    try:
        register_policy(ACPWindow)
        register_rule(ACPWindow)(ACPWindowRule)
        policy = parse_policy("acpwin:4")
        assert policy == ACPWindow(window=4) and rule_for(policy).__class__ is ACPWindowRule
        with pytest.raises(ValueError, match=re.escape(ACPWindow.form)):  # the errors list it among the forms
            parse_policy("lru")
        check_slot_cache(policy, 2, True, (5, 1, 1, 5, 1, 1), np.array([0, 3]), (5, 3), 12)
    finally:
        POLICIES.pop("acpwin", None)
        RULES.pop(ACPWindow, None)


@pytest.mark.parametrize("policy,slots,chunks", [("window:5", 5, (7, 1, 1, 1, 8) + (1,) * 12),
                                                 ("sinks:2+3", 6, (7, 1, 1, 1, 8) + (1,) * 12),
                                                 ("sinks:2+3", 6, (1,) * 14),  # sinks written by decode steps
                                                 ("dense", 64, (40, 1, 1, 24, 1, 1))])
def test_rings_wrap_many_times(policy, slots, chunks):
    """``check_slot_cache`` through prefill chunks and decode steps: rings of exactly W (window:5) and of 4
    behind 2 pinned slots (sinks:2+3) wrap 5–7 times in 30 columns (also from the first token on, one step at a
    time: a step writes its ring slot and, at a sink position, its pinned slot in one scatter); a dense ring of 64
    overflows at 68 columns and keeps the newest 64."""
    over = check_slot_cache(policy, 2, True, chunks, np.array([0, 3]), slots, 5)
    assert over.tolist() == [policy == "dense"] * 2


ACP_CHUNKS = (8, 1, 1) * 4  # prefills and decode steps; the ACP tests share the compiled shapes
ACP_T = sum(ACP_CHUNKS)


def feed(cache, chunks, *arrays, facts=None):
    """Feed [B, T, ...] arrays chunk by chunk; returns (outputs [B, T, ...] numpy, the cache)."""
    res, c0 = [], 0
    for c in chunks:
        o, cache = attend(cache, *(None if x is None else jnp.asarray(x[:, c0:c0 + c]) for x in arrays), facts=facts)
        res.append(np.asarray(o))
        c0 += c
    return np.concatenate(res, axis=1), cache


@pytest.mark.slow
def test_acp_eviction_stays_within_epsilon_of_dense():
    """ACP's bound (docs/design/fox_acp.md §5.1) at the layer: with |scale·q_i·k_j| ≤ U (here q and k are
    rescaled to norms ≤ 1.5 and 2, D = 4, so U = 1.5·2/√4 = 1.5) and δ = −(2U + log N) + log ε for N ≥ the
    keys a query can see, query i's weight on an evicted key j (Λ_i − Λ_j < δ) is
    e^{s_ij + Λ_i − Λ_j} / Σ ≤ e^{U + δ} / e^{−U} (the query sees itself with decay 0), so the dropped
    weight ρ_i ≤ N·e^{2U + δ} = ε. A key/value head keeps a key while any of its query heads sees it, which
    only lowers ρ. The dense output is (1 − ρ)·o_acp + ρ·ō_dropped (o_acp renormalises the kept weights), so
    |o_acp − o_dense| = ρ·|o_acp − ō_dropped| ≤ 2ε·max|v| elementwise."""
    rng = np.random.default_rng(3)
    t, hkv, log_eps, chunks = ACP_T, 2, -4.0, ACP_CHUNKS
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = (1.5 * unit(rng.standard_normal((B, t, H, D))) * rng.uniform(0.2, 1.0, (B, t, H, 1))).astype(np.float32)
    k = (2.0 * unit(rng.standard_normal((B, t, hkv, D))) * rng.uniform(0.2, 1.0, (B, t, hkv, 1))).astype(np.float32)
    v = rng.standard_normal((B, t, hkv, D)).astype(np.float32)
    # fast to never forgetting heads: keys leave after ~8, ~15, ~45 tokens, or stay
    lf = np.log(rng.uniform([0.1, 0.3, 0.6, 0.97], [0.5, 0.8, 1.0, 1.0], (B, t, H))).astype(np.float32)
    u = np.full((H,), 1.5 * 2.0 / np.sqrt(D), np.float32)
    outs = {}
    for policy in ("dense", f"acp:{log_eps:g}"):
        cache = new_slot_cache(B, t, n_heads=H, kv_heads=hkv, head_dim=D, dtype=jnp.float32, forget_gate=True,
                               kv_shift=False, qk_norm=True, policy=policy, max_context=t)
        outs[policy], cache = feed(cache, chunks, q, k, v, lf, facts=LayerFacts(logit_bound=jnp.asarray(u)))
        if policy != "dense":
            held = np.asarray(cache.groups[0].held_positions(cache) >= 0).sum(2)   # [B, Hkv]: per-head suffixes
            assert np.all(held[:, 0] < t / 2) and np.all(held[:, 1] == t)  # kv head 1 reads a head that never forgets
            # δ came from the first chunk's bound and stays in the cache: a later step needs no facts (so a
            # decode step recomputes nothing from the QK-norm weights)
            np.testing.assert_allclose(cache.state.delta, np.broadcast_to(acp_ops.threshold_from_bound(u, t, log_eps),
                                                                          (B, H)), rtol=1e-6)
            attend(cache, *(jnp.asarray(x[:, :1]) for x in (q, k, v, lf)))
    # the dropped weight per query head, from the dense float64 weights
    pos = np.broadcast_to(np.arange(t), (B, t))
    lam = np.cumsum(lf.astype(np.float64), axis=1)
    causal = reference_visibility("dense", pos)
    seen = reference_visibility("acp", pos, lam, acp_ops.threshold_from_bound(u, t, log_eps), hkv=hkv)
    s = np.einsum("bihd,bjhd->bijh", q.astype(np.float64), np.repeat(k, H // hkv, 2)) / np.sqrt(D)
    s = np.where(causal, s + lam[:, :, None] - lam[:, None], -np.inf)
    w = np.exp(s - s.max(axis=2, keepdims=True))
    rho = (w * ~seen).sum(2) / w.sum(2)
    eps = np.exp(log_eps)
    assert 0.0 < rho.max() <= eps
    bound = 2 * eps * np.abs(v).max()
    diff = np.abs(outs["acp:-4"] - outs["dense"])
    assert diff.max() <= bound + 1e-6, (diff.max(), bound)  # + float32 noise of the two runs
    assert diff.max() > 1e-5  # the eviction is visible, so the bound is not vacuous here


def test_acp_never_evicts_without_forgetting():
    """All forget gates 1 (log f = 0): every decay is 0 ≥ δ, so ACP keeps every token and equals dense."""
    rng = np.random.default_rng(4)
    t, hkv, pads = ACP_T, 2, np.array([0, 2])
    q, k, v = (rng.standard_normal((B, t, h, D)).astype(np.float32) for h in (H, hkv, hkv))
    lf = np.zeros((B, t, H), np.float32)
    u = np.full((H,), 5.0, np.float32)  # δ as aggressive as a bound gets: ε = e^{-0.1}
    outs = {}
    for policy in ("dense", "acp:-0.1"):
        cache = new_slot_cache(B, t, n_heads=H, kv_heads=hkv, head_dim=D, dtype=jnp.float32, forget_gate=True,
                               kv_shift=False, qk_norm=True, policy=policy, seq_start=pads, max_context=t)
        outs[policy], cache = feed(cache, ACP_CHUNKS, q, k, v, lf, facts=LayerFacts(logit_bound=jnp.asarray(u)))
        np.testing.assert_array_equal(cache.live_count(), np.maximum(t - pads, 0))
    # the same masks; dense's first chunk runs the flash op (another summation order): a few ulp apart
    np.testing.assert_allclose(outs["acp:-0.1"], outs["dense"], atol=1e-6, rtol=0)


def test_calibrated_per_head_capacities_hold_the_live_sets():
    """``calibrate_slots`` from the per-head peaks of an acp run: the key/value head whose query heads forget
    fast gets one block, the one that never forgets its whole context, each a multiple of ``RING_BLOCK``;
    the same sequence fed with those capacities overflows nowhere, gives the same outputs and allocates less."""
    rng = np.random.default_rng(8)
    t, hkv, chunks = 70, 2, (35, 35)
    q, k, v = (rng.standard_normal((B, t, h, D)).astype(np.float32) for h in (H, hkv, hkv))
    lf = np.log(rng.uniform([0.1, 0.1, 1.0, 1.0], [0.5, 0.5, 1.0, 1.0], (B, t, H))).astype(np.float32)
    facts = LayerFacts(logit_bound=jnp.ones((H,), jnp.float32))
    make = lambda slots: new_slot_cache(B, slots, n_heads=H, kv_heads=hkv, head_dim=D, dtype=jnp.float32,  # noqa: E731
                                        forget_gate=True, kv_shift=False, qk_norm=True, policy="acp", max_context=t)
    full, cache = feed(make(t), chunks, q, k, v, lf, facts=facts)
    slots = generation.calibrate_slots([cache])[0]
    assert slots == (RING_BLOCK, 2 * RING_BLOCK)  # ⌈1.1 · 70⌉ → 128
    fit, fitted = feed(make(slots), chunks, q, k, v, lf, facts=facts)
    assert int(fitted.overflow.max()) == 0 and [g.slots for g in fitted.groups] == list(slots)
    np.testing.assert_allclose(fit, full, atol=1e-6, rtol=0)
    assert fitted.allocated_bytes() < cache.allocated_bytes()


def heuristic_delta(q, k, pads, n, log_eps):
    """δ [B, T, H] of the heuristic acp rule from its definition: U_n = max_{m ≤ n}‖q_m‖ · max_{m ≤ n}‖k_m‖/√D
    over real tokens (per query head and its key/value head), δ_n = min(−(2U_n + log N) + log ε, 0)."""
    t = q.shape[1]
    real = (np.arange(t)[None] >= pads[:, None])[..., None]
    qn = np.maximum.accumulate(np.where(real, np.linalg.norm(q.astype(np.float64), axis=-1), 0), axis=1)
    kn = np.maximum.accumulate(np.where(real, np.linalg.norm(k.astype(np.float64), axis=-1), 0), axis=1)
    u = qn * np.repeat(kn, q.shape[2] // k.shape[2], axis=2) / np.sqrt(q.shape[3])
    return np.minimum(-(2 * u + math.log(n)) + log_eps, 0.0)


@pytest.mark.parametrize("key_block", [None, 16])
def test_heuristic_acp_is_independent_of_the_chunking(key_block, monkeypatch):
    """acp without QK-norm (a heuristic; the cache warns once): δ_n comes from the running maxima of the q and
    k norms kept in the cache and the rule is cumulative, so feeding 70 columns in chunks of 7 or in one pass
    gives the same outputs to float32 rounding (≤ 1e-6 here; the earlier per-chunk bound moved them by ~1e-3)
    and the same live sets, equal to the float64 reference of the rule. Heads forget fast, so the rule does
    evict. With ``key_block`` 16 the rule reads the 70 slots 16 at a time (``visibility.last_hidden``'s loop,
    the last block overlapping), as it does past ``KEY_BLOCK`` slots: the same live sets."""
    if key_block is not None:
        monkeypatch.setattr(visibility, "KEY_BLOCK", key_block)
    rng = np.random.default_rng(7)
    t, hkv, pads, log_eps = 70, 2, np.array([0, 3]), -3.0
    q, k, v = (rng.standard_normal((B, t, h, D)).astype(np.float32) for h in (H, hkv, hkv))
    lf = np.log(rng.uniform([0.1, 0.3, 0.7, 0.9], [0.5, 0.8, 1.0, 1.0], (B, t, H))).astype(np.float32)
    real = np.arange(t)[None] >= pads[:, None]
    lam = np.cumsum(np.where(real[..., None], lf, 0).astype(np.float64), axis=1)
    delta = heuristic_delta(q, k, pads, t, log_eps)
    pos = np.arange(t)[None] - pads[:, None]
    causal = (pos[:, None, :] <= pos[:, :, None]) & (pos[:, None, :] >= 0)
    decay = lam[:, :, None, :] - lam[:, None, :, :]
    assert np.min(np.abs(decay - delta[:, :, None, :])[causal]) > 1e-5  # no decision within float32 noise of δ
    ref = reference_attention(q, k, v, lam, reference_visibility("acp", pos, lam, delta, hkv=hkv))
    outs, lives = [], []
    for chunks in ((7,) * 10, (t,)):  # chunks of 1, 7, 64 and one pass, of a model: the model-level test
        with pytest.warns(HeuristicEvictionWarning):
            cache = new_slot_cache(B, t, n_heads=H, kv_heads=hkv, head_dim=D, dtype=jnp.float32, forget_gate=True,
                                   kv_shift=False, qk_norm=False, policy=f"acp:{log_eps:g}", seq_start=pads,
                                   max_context=t)
        assert not cache.provable and cache.state is not None
        o, cache = feed(cache, chunks, q, k, v, lf)
        outs.append(np.where(real[..., None, None], o, 0))
        lives.append(np.asarray(cache.live_count()))
    np.testing.assert_allclose(outs[-1], np.where(real[..., None, None], ref, 0), atol=1e-5)
    for o, live in zip(outs[:-1], lives[:-1]):
        np.testing.assert_allclose(o, outs[-1], atol=1e-6, rtol=0)
        np.testing.assert_array_equal(live, lives[-1])
    assert np.all(lives[-1] < t - pads - 5)  # it evicts


def test_last_hidden_in_blocks_equals_one_reduction():
    """``visibility.last_hidden`` over S slots in blocks (a loop; 64 does not divide 200, so the last block
    overlaps) equals the one [T, S] reduction, with GQA (all query heads must hide a slot), slots not held,
    per-row columns (row 0 in slot order, as an unwrapped ring; row 1 permuted), rows where nothing is hidden
    (NEG) and rows where everything is (the answer in the last block)."""
    rng = np.random.default_rng(3)
    b, n, g, t, s = 2, 3, 2, 5, 200
    decay = jnp.asarray(-rng.exponential(3.0, (b, n, g, t, s)).astype(np.float32))
    d = jnp.asarray(-rng.exponential(3.0, (b, n, g, t)).astype(np.float32))
    d = d.at[0, 0, :, 0].set(-1e9).at[0, 1, :, 2].set(1e9).at[1, 2, :, 3].set(1e9)
    held = jnp.asarray(rng.random((b, 1, s)) < 0.8)
    col = jnp.asarray(np.stack([np.arange(s), rng.permutation(s)])[:, None].astype(np.int32))
    one = last_hidden(decay, d, held, col, block=s)
    np.testing.assert_array_equal(last_hidden(decay, d, held, col, block=64), one)
    assert one[0, 0, 0] == visibility.NEG and np.all(np.asarray(one) > visibility.NEG - 1)
    assert one[0, 1, 2] == np.max(np.where(held[0, 0], col[0, 0], -1)) > 192  # every held slot hidden
    assert len(np.unique(np.asarray(one))) > 10  # varied: the maxima are not all one column


def test_window_policy_equals_the_ops_sliding_window():
    """window:W on a ring of exactly W entries (prefill, steps, chunks; GQA, gates, left pads) equals the
    attention op's own sliding window, ``forgetting_attention(..., window_size=W)``, over the whole sequence."""
    rng = np.random.default_rng(6)
    t, hkv, w, pads = 13, 2, 4, np.array([0, 3])
    q, k, v = (rng.standard_normal((B, t, h, D)).astype(np.float32) for h in (H, hkv, hkv))
    lf = np.log(rng.uniform(0.3, 1.0, (B, t, H))).astype(np.float32)
    ref = np.asarray(forgetting_attention(*(jnp.asarray(x) for x in (q, k, v, lf)), window_size=w,
                                          seq_start=jnp.asarray(pads), implementation="xla"))
    cache = new_slot_cache(B, w, n_heads=H, kv_heads=hkv, head_dim=D, dtype=jnp.float32, forget_gate=True,
                           kv_shift=False, policy=f"window:{w}", seq_start=pads, block=1)
    assert cache.capacity == w
    res, c0 = [], 0
    for c in (5, 1, 1, 5, 1):
        o, cache = attend(cache, *(jnp.asarray(x[:, c0:c0 + c]) for x in (q, k, v, lf)))
        res.append(np.asarray(o))
        c0 += c
        np.testing.assert_array_equal(cache.live_count(), np.minimum(np.maximum(c0 - pads, 0), w))
    mask = real(t, pads)[..., None]
    np.testing.assert_allclose(np.where(mask, np.concatenate(res, axis=1), 0), np.where(mask, ref, 0), atol=1e-5)
    assert int(cache.overflow.max()) == 0


@pytest.mark.slow
def test_decode_decay_float32_accurate_at_64k_tokens():
    """64k tokens, one key/value head read by two query heads (a fast and a slow forgetter), D = 8: the cache
    holds Λ_j as float32 pairs (``accumulate_log_fgate``), and decode steps over the 64k ring entries match a
    float64 numpy reference, although |Λ| reaches ~655 where float32's spacing is 6e-5."""
    n, steps, d = 65536, 3, 8
    rng = np.random.default_rng(0)
    log_fgate = np.stack([rng.uniform(-0.02, 0.0, n), rng.uniform(-2e-4, 0.0, n)], -1)[None].astype(np.float32)
    q = rng.standard_normal((1, n, 2, d)).astype(np.float32)
    k = rng.standard_normal((1, n, 1, d)).astype(np.float32)
    v = rng.standard_normal((1, n, 1, d)).astype(np.float32)
    lam64 = np.cumsum(log_fgate[0].astype(np.float64), axis=0)  # [n, H]
    p = n - steps  # the first p tokens as a prefill would store them (column j in slot j), then steps

    @jax.jit  # one program (eager, the 64k-token accumulation and fills compile ~190 single ops)
    def filled(log_fgate, k, v):
        zero = jnp.zeros((1, 2), jnp.float32)
        hi, lo = accumulate_log_fgate(zero, zero, log_fgate)                          # [1, p, 2]
        cache = new_slot_cache(1, n, n_heads=2, kv_heads=1, head_dim=d, dtype=jnp.float32, forget_gate=True,
                               kv_shift=False)
        fill = lambda buf, x: buf.at[..., :p].set(x.astype(buf.dtype))                # the slot axis last
        fill_kv = lambda buf, x: buf.at[:, :, :p].set(x.transpose(0, 2, 1, 3))        # [B, n, S, D]
        g = cache.groups[0]
        g = g.replace(k=fill_kv(g.k, k), v=fill_kv(g.v, v), lam_hi=fill(g.lam_hi, hi.transpose(0, 2, 1)[:, None]),
                      lam_lo=fill(g.lam_lo, lo.transpose(0, 2, 1)[:, None]))
        return cache.replace(groups=(g,), length=jnp.asarray(p, jnp.int32), lam_hi=hi[:, -1], lam_lo=lo[:, -1],
                             fresh=False)

    cache = filled(*(jnp.asarray(x[:, :p]) for x in (log_fgate, k, v)))
    assert cache.capacity == n
    step = jax.jit(slot_attention)
    for c in range(p, n):
        o, cache = step(cache, jnp.asarray(q[:, c:c + 1]), jnp.asarray(k[:, c:c + 1]), jnp.asarray(v[:, c:c + 1]),
                        jnp.asarray(log_fgate[:, c:c + 1]))
        decay64 = lam64[c] - lam64[:c + 1]                                  # [c + 1, H]
        s64 = np.einsum("hd,jd->jh", q[0, c].astype(np.float64), k[0, :c + 1, 0]) / np.sqrt(d) + decay64
        w64 = np.exp(s64 - s64.max(0))
        o64 = np.einsum("jh,jd->hd", w64 / w64.sum(0), v[0, :c + 1, 0])
        # float32 softmax over 65k keys and a float32 product with V: ~1e-7 relative per term. A float32 Λ
        # (off by 6e-5 at |Λ| ≈ 655) would move the weights of the fast head by 6e-5 relative: ≫ 2e-6.
        np.testing.assert_allclose(np.asarray(o[0, 0]), o64, atol=2e-6, rtol=0, err_msg=f"column {c}")
    g = cache.groups[0]
    assert int(cache.length) == n and int(cache.live_count()[0]) == n and int(cache.overflow[0]) == 0
    # the decay the cache forms, (hi_i − hi_j) + (lo_i − lo_j), from the stored pairs (slot j = token j)
    decay = np.asarray(jax.jit(lambda c, g: (c.lam_hi[:, :, None] - g.lam_hi[:, 0]) + (c.lam_lo[:, :, None] - g.lam_lo[:, 0]))(
        cache, g))[0].T
    # relative 1e-6 of the decay itself (float32 rounds it to 6e-8 relative); the decay of the newest
    # slots is ~1e-2, where a float32 Λ of ~655 would be off by 6e-5 (1e-2 relative)
    np.testing.assert_allclose(decay, lam64[-1] - lam64, rtol=1e-6, atol=1e-9)


@pytest.mark.filterwarnings("ignore::fox_jax.cache.policies.HeuristicEvictionWarning")  # acp without QK-norm
def test_cache_logical_axes():
    """``logical_axes()``: a tuple of logical names per array, one name per dimension, for every storage."""
    for policy, kw in (("acp", dict(forget_gate=True, kv_shift=True)), ("dcp", dict(forget_gate=True, kv_shift=False,
                                                                                  interaction_dim=R_INT))):
        cache = new_slot_cache(B, (8, 70) if policy == "acp" else 8, n_heads=H, kv_heads=2, head_dim=D,
                               dtype=jnp.float32, qk_norm=False, policy=policy, **kw)
        axes = cache.logical_axes()
        is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)  # noqa: E731
        arrays = jax.tree.leaves(cache)
        names = jax.tree.leaves(axes, is_leaf=is_axes)
        assert len(arrays) == len(names) and all(len(a.shape) == len(n) for a, n in zip(arrays, names))
        assert axes.groups[0].k == ("batch", "kv_heads", None, None) and axes.seq_start == ("batch",)


# =============================================================================================
# Model level: every family, the engine against the full forward
# =============================================================================================

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


def real(t, pads=PADS):
    """[B, T, 1] bool, the non-pad positions."""
    return (np.arange(t)[None] >= pads[:, None])[..., None]


def make_dcp_prune(params, names, betas, int_std=0.5, seed=5):
    """Interaction weights that actually prune (init has β = 2, tiny q_int/k_int)."""
    rng = np.random.default_rng(seed)
    for name, beta in zip(names, betas):
        attn = params[name]["attn"]
        for w in ("q_int", "k_int"):
            attn[w]["kernel"] = jnp.asarray(int_std * rng.standard_normal(attn[w]["kernel"].shape), jnp.float32)
        attn["beta"] = jnp.asarray(beta, jnp.float32)
    return params


ARCHS = ["fox-llama", "fox-pro", "transformer-llama", "transformer-pro"]


@functools.lru_cache(maxsize=None)
def tiny_lm(arch, dcp=False, fgate_bias=None, betas=(1.5, 2.5), n_layers=1):
    """A LanguageModel of ``n_layers`` (d = 32, 4 heads; Pro with GQA, 2 key/value heads). ``dcp``: with pruning
    interaction weights (one β per layer); ``fgate_bias``: forget-gate biases (−2: f ≈ 0.12, the cache forgets
    fast). One layer by default: most of the suite's time is XLA compiling these models, and a layer's program
    is what the tests compare; the ``fox-dcp`` family has 2 layers (layer-by-layer caches, per-layer live sets
    with two β, the engine's multi-layer paths)."""
    cfg = preset("tiny", arch, vocab_size=VOCAB, d_model=32, n_layers=n_layers, n_heads=4,
                 n_kv_heads=2 if arch.endswith("pro") else None, dcp=dcp, interaction_dim=16)
    params = random_params(lambda: cfg.init_params(jax.random.PRNGKey(0)))
    if dcp:
        params = make_dcp_prune(params, cfg.layer_names, betas)
    if fgate_bias is not None:
        for name in cfg.layer_names:
            gate = params[name]["attn"]["fgate_proj"]
            gate["bias"] = gate["bias"] + fgate_bias
    return LanguageModel(cfg), params


@functools.lru_cache(maxsize=None)
def tiny_gpt2(betas=(1.5, 2.5)):
    """A one-layer GPT-2 with DCP whose interaction weights actually prune."""
    cfg = GPT2Config(n_layers=1, d_model=32, n_heads=4, vocab_size=VOCAB, n_positions=64, dcp=True,
                     interaction_dim=16)
    params = random_params(lambda: GPT2(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32),
                                                  alpha=1.0)["params"])
    return GPT2(cfg), make_dcp_prune(params, cfg.layer_names, betas)


@functools.lru_cache(maxsize=None)
def plain_gpt2():
    """The DCP GPT-2's weights without the interaction parameters: a dense GPT-2."""
    model, params = tiny_gpt2()
    plain = GPT2(model.cfg.replace(dcp=False))
    plain_params = {k: ({**v, "attn": {n: w for n, w in v["attn"].items() if n in ("c_attn", "c_proj")}}
                        if k.startswith("h_") else v) for k, v in params.items()}
    return plain, plain_params


@functools.partial(jax.jit, static_argnums=0)
def _full_forward(model, params, tokens, pads):
    """Full-sequence forward of a left-padded batch: pads form their own segment, positions start at 0
    at the first real token (GPT-2: clamped to 0 on pads); DCP at α = ∞ (the inference step mask)."""
    positions = jnp.arange(tokens.shape[1])[None] - jnp.asarray(pads)[:, None]
    if isinstance(model, GPT2):
        positions = jnp.maximum(positions, 0)
    out = model.apply({"params": params}, tokens, segment_ids=(jnp.arange(tokens.shape[1])[None] >= pads[:, None])
                      .astype(jnp.int32), positions=positions, alpha=INF if model.cfg.dcp else None)
    return out.logits.astype(jnp.float32), out.aux.get("log_masks")


def full_forward(model, params, tokens, pads=PADS):
    """(logits [B, T, V] float32, DCP keep mask I [L, B, T, T] bool or None) of the training path."""
    logits, log_masks = _full_forward(model, params, tokens, jnp.asarray(pads))
    return logits, None if log_masks is None else np.asarray(log_masks) == 0.0


FAMILIES = [*ARCHS, "gpt2", "gpt2-dcp", "fox-dcp"]


def family_model(family):
    """(model, params, policy) of a family: the DCP ones decode under ``dcp``, the others ``dense``."""
    if family == "gpt2":
        return (*plain_gpt2(), "dense")
    if family == "gpt2-dcp":
        return (*tiny_gpt2(), "dcp")
    if family == "fox-dcp":  # FoX Pro (GQA, KV-shift, QK-norm) with DCP, 2 layers (β 1.5 and 2.5)
        return (*tiny_lm("fox-pro", dcp=True, n_layers=2), "dcp")
    return (*tiny_lm(family), "dense")


def live_positions(cache, b):
    """Sorted positions a per-row-table cache holds for row b."""
    pos = np.asarray(cache.groups[0].held_positions(cache))[b, 0]
    return sorted(int(p) for p in pos[pos >= 0])


def expected_live(keep, layer, b, c, pads=PADS):
    """Positions the DCP step mask keeps for query column c of row b (the training path's log I)."""
    return [j - pads[b] for j in range(pads[b], c + 1) if keep[layer, b, c, j]]


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decoding_equals_full_forward(family):
    """A prefill and decode steps equal the training path for every architecture (FoX / Transformer, LLaMA
    / Pro with GQA and KV-shift, GPT-2) and for DCP models under ``dcp`` (the step mask, α = ∞)."""
    model, params, policy = family_model(family)
    t, p = 12, 6
    tokens = padded_batch(t)
    full, keep = full_forward(model, params, tokens)
    assert float(jnp.std(full)) > 0.05  # logits are not trivially equal
    if keep is not None:
        assert 0.2 < 1 - keep[:, 0, -1, :].mean() < 0.95  # the weights do prune

    logits, caches = prefill(model, params, tokens[:, :p], seq_start=PADS, slots=t, policy=policy)
    np.testing.assert_allclose(np.where(real(p), logits, 0), np.where(real(p), full[:, :p], 0), atol=1e-4)
    for c in range(p, t):
        step_logits, caches = decode_step(model, params, caches, tokens[:, c])
        np.testing.assert_allclose(step_logits, full[:, c], atol=1e-4, err_msg=f"column {c}")
        if keep is not None:
            for layer, cache in enumerate(caches):
                assert [live_positions(cache, b) for b in range(3)] == [
                    expected_live(keep, layer, b, c) for b in range(3)], (layer, c)
    assert int(caches[0].length) == t
    if keep is None:
        np.testing.assert_array_equal(live_counts(caches), np.broadcast_to(t - PADS, (len(caches), 3)))
    assert int(jnp.max(jnp.stack([c.overflow for c in caches]))) == 0


@pytest.mark.parametrize("policy,t,p,slots,splits", [("dense", 12, 6, None, 1), ("acp", 12, 6, None, 1),
                                                     ("acp:-1000", 72, 62, None, 1), ("window:20", 40, 30, None, 1),
                                                     ("acp:-1000", 72, 62, ((64, 128, 64, 128),), 1),
                                                     ("acp:-1000", 72, 62, ((64, 128, 64, 128),), 2),
                                                     ("sinks:3+20", 12, 6, None, 1), ("sinks:4+60", 80, 70, None, 2)])
def test_pallas_decode_steps_equal_the_xla_path(policy, t, p, slots, splits, monkeypatch):
    """The decode steps through the Pallas kernel in append mode (interpret mode here; on a GPU the engine's
    default: the step's entry written into the ring by the kernel while it reads; acp's decay floor applied there;
    the raw projections in, with the KV-shift, QK-norm, Λ accumulation, output norm and gate done in the kernel)
    give the XLA path's logits and the same caches, on FoX (Pro) with GQA, KV-shift and Λ pairs; dense also equals
    the full forward; acp at ε = e^-1000 keeps every key, so its 64-slot ring fills and drops its oldest key at
    every step (the kernel gets the ring's old start: C + 1 keys with the new one); a window moves the ring's start
    (the kernel advances the ring's start, peak and overflow in place); sinks read their pinned slots with the ring
    (the kernel's pinned block), from the first steps on (left-padded rows write their sink positions in decode
    steps: into the pinned and the ring slot) and with a ring that wraps behind them; per-head capacities (64, 128, 64, 128
    slots: two interleaved head groups, one full) run one kernel per group, the KV-shift and Λ carries passed from group
    to group; with 2 splits the output norm and gate follow the combine and each group's Λ comes back from its kernel
    as a new array, scattered into the layer's carry. The XLA
    path itself, fused (the op does the layer's work) and unfused (the layer's work before the op), agrees to 1e-6.
    Tolerance: float32, summation order only (the split softmax; the gate logits, computed by the kernel from their
    projections), 1e-5 in the logits; the caches as ``_assert_same_caches``. (On the H200 the dense comparison with
    the full forward failed at 1e-4 under TF32 GEMMs, max 1.1e-3; hence full precision here.)"""
    with jax.default_matmul_precision("highest"):  # on a GPU too: float32 GEMMs in full precision, not TF32
        _pallas_decode_steps_equal_the_xla_path(policy, t, p, slots, splits, monkeypatch)


def _pallas_decode_steps_equal_the_xla_path(policy, t, p, slots, splits, monkeypatch):
    """``test_pallas_decode_steps_equal_the_xla_path``'s body (under its matmul precision)."""
    dec = sys.modules["fox_jax.ops.decode_attention"]  # the module (fox_jax.ops exports its function by that name)
    cfg = preset("tiny", "fox-pro", vocab_size=VOCAB, d_model=64, n_layers=1, n_heads=4,  # D = 16:
                 n_kv_heads=2 if slots is None else 4)  # per-head capacities: groups of heads (0, 2) and (1, 3)
    model, params = LanguageModel(cfg), random_params(lambda: cfg.init_params(jax.random.PRNGKey(0)))  # the kernel's
    tokens = padded_batch(t)

    def run():
        logits, caches = prefill(model, params, tokens[:, :p], seq_start=PADS, slots=slots or min(t, 64),
                                 policy=policy)
        assert len(caches[0].groups) == (1 if slots is None else 2)
        steps = []
        for c in range(p, t):
            step_logits, caches = decode_step(model, params, caches, tokens[:, c])
            steps.append(np.asarray(step_logits))
        return np.stack(steps), caches

    ref, ref_caches = run()
    with monkeypatch.context() as m:  # the XLA path unfused (the layer's work before the op, as a rule reading q, k)
        for cls in (Rule, ACPRule):
            m.setattr(cls, "needs_qk", lambda self, state: True)
        jax.clear_caches()
        unfused, unfused_caches = run()
    np.testing.assert_allclose(unfused, ref, atol=1e-6)
    _assert_same_caches(unfused_caches, ref_caches)  # (on the H200 the two XLA programs' Λ pairs differ by ulps)
    monkeypatch.setattr(dec, "resolve_decode_implementation", lambda impl, q, k, **kw: "pallas")
    if splits > 1:  # (interpret mode picks one split)
        config = dec.dk.default_decode_config
        monkeypatch.setattr(dec.dk, "default_decode_config",
                            lambda *a, **kw: config(*a, **{**kw, "num_splits": kw.get("num_splits") or splits}))
    traced = []
    flash = dec.dk.flash_decode
    monkeypatch.setattr(dec.dk, "flash_decode",
                        lambda *a, **kw: traced.append((kw.get("append"), kw.get("decay_floor"), kw.get("step"),
                                                        kw.get("pinned"))) or flash(*a, **kw))
    jax.clear_caches()  # the jitted steps retrace with the kernel
    got, caches = run()
    assert traced and all(a is not None for a, *_ in traced)  # the append mode ran
    assert all((f is not None) == policy.startswith("acp") for _, f, *_ in traced)  # acp's rule applied in the kernel
    assert all((pin is not None) == policy.startswith("sinks") for *_, pin in traced)  # the sink slots read there
    # the layer's per-head work in the kernel too: KV-shift, QK-norm, Λ; the output norm and gate (one split here)
    assert all(s is not None and s.shift_state is not None and s.q_scale is not None and s.lam_prev is not None
               and s.gate_x is not None and ((s.o_scale is not None and s.o_gate) == (splits == 1))
               for _, _, s, _ in traced)
    assert all((s.group_heads is None) == (slots is None) for _, _, s, _ in traced)  # a head group: its layer heads
    if t > 64 and policy.startswith("acp"):
        assert int(jnp.max(jnp.stack([c.overflow for c in caches]))) > 0  # the ring was full
    np.testing.assert_allclose(got, ref, atol=1e-5)
    if policy == "dense":
        np.testing.assert_allclose(got, np.asarray(full_forward(model, params, tokens)[0][:, p:]).transpose(1, 0, 2),
                                   atol=1e-4)
    _assert_same_caches(caches, ref_caches)  # the ring written by the kernel


@pytest.mark.parametrize("policy", ["dense", "window:5", "sinks:2+5"])
def test_gpt2_decode_kernel_reads_c_attn_in_place(policy, monkeypatch):
    """GPT-2's decode step (``DECODE_QKV = "parts"``) hands c_attn to the decode kernel (interpret mode here) as
    ``QKV_PARTS`` float32 partial sums over a split of d_model and the bias, which the kernel adds as it loads them:
    the steps give the logits and caches of the XLA path with q, k, v apart ("plain"), on a ring that a window and
    sinks move and wrap, and dense equals the full forward. Tolerance: float32, summation order only (the split's
    partial sums, the split softmax), 1e-5."""
    gpt2_module = sys.modules["fox_jax.models.gpt2"]
    dec = sys.modules["fox_jax.ops.decode_attention"]
    model = GPT2(GPT2Config(n_layers=1, d_model=64, n_heads=4, vocab_size=VOCAB, n_positions=64))
    params = random_params(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"])
    t, p = 14, 6
    tokens = padded_batch(t)

    def run():
        jax.clear_caches()
        logits, caches = prefill(model, params, tokens[:, :p], seq_start=PADS, slots=16, policy=policy)
        steps = []
        for c in range(p, t):
            step_logits, caches = decode_step(model, params, caches, tokens[:, c])
            steps.append(np.asarray(step_logits))
        return np.stack(steps), caches

    with jax.default_matmul_precision("highest"):
        monkeypatch.setattr(gpt2_module, "DECODE_QKV", "plain")
        ref, ref_caches = run()
        monkeypatch.setattr(gpt2_module, "DECODE_QKV", "parts")
        monkeypatch.setattr(dec, "resolve_decode_implementation", lambda impl, q, k, **kw: "pallas")
        traced = []
        flash = dec.dk.flash_decode
        monkeypatch.setattr(dec.dk, "flash_decode", lambda *a, **kw: traced.append(kw.get("step")) or flash(*a, **kw))
        got, caches = run()
    assert traced and all(s is not None for s in traced)  # the fused step: the kernel read c_attn's output
    assert all(s.rows.shape[0] == gpt2_module.QKV_PARTS and s.rows.dtype == jnp.float32 and s.row_bias is not None
               for s in traced)
    np.testing.assert_allclose(got, ref, atol=1e-5)
    if policy == "dense":
        with jax.default_matmul_precision("highest"):
            full = np.asarray(full_forward(model, params, tokens)[0][:, p:]).transpose(1, 0, 2)
        np.testing.assert_allclose(got, full, atol=1e-4)
    _assert_same_caches(caches, ref_caches)


@pytest.mark.parametrize("arch", ["fox-pro", "fox-llama"])
def test_gate_tables_feed_the_decode_kernel(arch, monkeypatch):
    """``gate_tables`` finds every layer's gate projections — KV-shift and forget gates in FoX (Pro), forget gates
    alone in FoX (LLaMA), whose Hkv (2 of 4 heads, GQA) it reads from the projections' widths — and lays them out
    as the decode kernel's ``gate_table``; a decode step applied with them (as ``generate``'s loop does) hands the
    kernel the prepared table and gives bitwise the logits and caches of the step without them, where the kernel
    builds the same table itself. The greedy tokens of ``generate`` (which applies them) equal the XLA path's."""
    dec = sys.modules["fox_jax.ops.decode_attention"]
    cfg = preset("tiny", arch, vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    model, params = LanguageModel(cfg), random_params(lambda: cfg.init_params(jax.random.PRNGKey(0)))
    tables = gate_tables(params)["decode"]
    assert sorted(tables) == ["layers_0", "layers_1"]
    for name, layer in tables.items():
        attn = params[name]["attn"]
        names = [n for n in ("k_shift_proj", "v_shift_proj", "fgate_proj") if n in attn]
        assert len(names) == (3 if arch == "fox-pro" else 1)
        want = dec.gate_table(tuple((attn[n]["kernel"], attn[n].get("bias")) for n in names), 2)
        rows = (2 if arch == "fox-pro" else 0) + 2  # the shifts, then G = 2 forget gates per kv head (a power of 2)
        assert layer["attn"]["gate_table"][0].shape == (2, rows, 64)
        for x, y in zip(layer["attn"]["gate_table"], want):
            np.testing.assert_array_equal(x, y)
    tokens = padded_batch(10)
    greedy = generate(model, params, tokens, max_new_tokens=3).tokens  # the XLA path
    monkeypatch.setattr(dec, "resolve_decode_implementation", lambda impl, q, k, **kw: "pallas")
    seen = []
    flash = dec.dk.flash_decode
    monkeypatch.setattr(dec.dk, "flash_decode", lambda *a, **kw: seen.append(kw["step"].gate_table) or flash(*a, **kw))
    jax.clear_caches()
    _, caches = prefill(model, params, tokens[:, :8], seq_start=PADS, slots=16, policy="dense")
    step = lambda variables: model.apply(variables, tokens[:, 8:9], cache=caches)  # noqa: E731
    with_tables, without = step({"params": params, "decode": tables}), step({"params": params})
    assert len(seen) == 4 and all(t is not None for t in seen[:2]) and all(t is None for t in seen[2:])
    np.testing.assert_array_equal(with_tables.logits, without.logits)
    for a, b in zip(jax.tree.leaves(with_tables.cache), jax.tree.leaves(without.cache)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(generate(model, params, tokens, max_new_tokens=3).tokens, greedy)


def _prefilled_fox_pro(n_layers: int, policy: str):
    """A tiny FoX (Pro) (d 64, GQA 4/2, random parameters) after an 8-token prefill of ``padded_batch(10)`` under
    ``policy``: (cfg, model, params, tokens, caches, the decode loop's cast plan)."""
    cfg = preset("tiny", "fox-pro", vocab_size=VOCAB, d_model=64, n_layers=n_layers, n_heads=4, n_kv_heads=2)
    model, params = LanguageModel(cfg), random_params(lambda: cfg.init_params(jax.random.PRNGKey(0)))
    tokens = padded_batch(10)
    _, caches = prefill(model, params, tokens[:, :8], seq_start=PADS, slots=16, policy=policy)
    return cfg, model, params, tokens, caches, generation.cast_plan(model, params, caches)


@pytest.mark.parametrize("policy", ["window:6", "acp"])
def test_decode_variables_fold_the_input_norm(policy, monkeypatch):
    """``decode_variables(..., fold_norms=True)`` folds each block's input RMSNorm scale s into its attention's
    input projections in place (``fold_input_norms``: s ⊙ W of q, k, v, the output gate and the gate projections, the
    norm's scale then ones; no copy of a weight) and marks the layer (``gate_tables(..., folded_norms=True)``), and a
    fused decode step multiplies the un-normalised residual by them, the kernel applying the norm as a row scale
    (``HeadOps.x_norm_eps``): the step's logits and caches equal the step applied without the mark (1e-5 in float32:
    r · (x · (s ⊙ W)) against (r·x·1) · (s ⊙ W), summation order only) and the unfolded model's step (1e-5), through
    the XLA path and through the Pallas kernel (interpret), which gets the residual; a prefill chunk (T > 1) runs the
    model's own path on the folded weights (1e-5 of the unfolded). A fold that forgot the row scale would be off by
    the residual's RMS, one that forgot s by the scale's spread (over 5% here, asserted)."""
    dec = sys.modules["fox_jax.ops.decode_attention"]
    cfg, model, params, tokens, caches, plan = _prefilled_fox_pro(1, policy)
    unfolded = generation.decode_variables(params, plan, fold_norms=False)
    assert "folded" not in unfolded["decode"]["layers_0"]["attn"]
    variables = generation.decode_variables(params, plan, fold_norms=True)
    attn = variables["decode"]["layers_0"]["attn"]
    assert attn["folded"]["gate_table"] is attn["gate_table"]  # a mark: nothing copied
    scale = params["layers_0"]["attn_norm"]["scale"]
    assert float(jnp.max(jnp.abs(scale - 1.0))) > 0.05  # a scale to fold (random_params)
    for name in ("q_proj", "fgate_proj", "k_shift_proj"):
        np.testing.assert_allclose(variables["params"]["layers_0"]["attn"][name]["kernel"],
                                   scale[:, None] * params["layers_0"]["attn"][name]["kernel"], rtol=1e-6)
    np.testing.assert_array_equal(variables["params"]["layers_0"]["attn_norm"]["scale"], np.ones_like(scale))
    np.testing.assert_array_equal(variables["params"]["layers_0"]["attn"]["o_proj"]["kernel"],
                                  params["layers_0"]["attn"]["o_proj"]["kernel"])
    extra = {"layers_0": {**params["layers_0"], "attn": {**params["layers_0"]["attn"], "x_proj": {"kernel": scale}}}}
    with pytest.raises(ValueError, match=r"fold_input_norms: /layers_0/attn has projections \['x_proj'\]"):
        fold_input_norms(extra)  # a projection it does not know is not left unfolded silently
    plain = {**variables, "decode": {"layers_0": {"attn": {k: v for k, v in attn.items() if k != "folded"}}}}
    seen = []
    flash = dec.dk.flash_decode
    monkeypatch.setattr(dec.dk, "flash_decode", lambda *a, **kw: seen.append(kw["step"].x_norm_eps) or flash(*a, **kw))
    step = jax.jit(lambda v: model.apply(v, tokens[:, 8:9], cache=caches))
    for impl in ("xla", "pallas"):
        monkeypatch.setattr(dec, "resolve_decode_implementation", lambda *a, impl=impl, **kw: impl)
        jax.clear_caches()
        seen.clear()
        got, want = step(variables), step(plain)
        assert seen == ([] if impl == "xla" else [cfg.norm_eps, None]), (impl, seen)
        np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, err_msg=impl)
        np.testing.assert_allclose(got.logits, step(unfolded).logits, atol=1e-5, err_msg=impl)
        _assert_same_caches(got.cache, want.cache)
    chunk = jax.jit(lambda v: model.apply(v, tokens[:, 8:], cache=caches).logits)  # T = 2: no fused fold
    np.testing.assert_array_equal(chunk(variables), chunk(plain))
    np.testing.assert_allclose(chunk(variables), chunk(unfolded), atol=1e-5)



@pytest.mark.parametrize("policy", ["window:6", "acp"])
def test_decode_variables_project_the_output(policy, monkeypatch):
    """``decode_variables(..., project_out=True)`` marks each FoX attention layer with its own ``o_proj`` kernel (no
    copy) and a fused decode step then hands W_o to the decode op (``HeadOps.o_proj``): the Pallas kernel
    (interpret) projects each program's heads and the step sums the float32 shares, the op's XLA path projects with
    one GEMM. The step's logits and caches equal the step without the mark (1e-5: float32 summation order; 3e-3 on
    GPU, where XLA's float32 GEMM runs in TF32 and the kernel's dot in IEEE float32), with the folded input norm too;
    a prefill chunk (T = 2) does not use it (bit for bit). A kernel that left out a head's share or a head's rows of
    W_o would move the logits by that head's part of the output (checked in test_decode_attention)."""
    dec = sys.modules["fox_jax.ops.decode_attention"]
    cfg, model, params, tokens, caches, plan = _prefilled_fox_pro(2, policy)
    assert "project_out" not in generation.decode_variables(params, plan)["decode"]["layers_0"]["attn"]
    marked = generation.decode_variables(params, plan, project_out=True)
    assert marked["decode"]["layers_1"]["attn"]["project_out"] is marked["params"]["layers_1"]["attn"]["o_proj"][
        "kernel"]  # a mark: nothing copied
    plain = generation.decode_variables(params, plan)
    seen = []
    flash = dec.dk.flash_decode
    monkeypatch.setattr(dec.dk, "flash_decode",
                        lambda *a, **kw: seen.append(kw["step"].o_proj is not None) or flash(*a, **kw))
    step = jax.jit(lambda v: model.apply(v, tokens[:, 8:9], cache=caches))
    atol = 1e-5 if jax.default_backend() != "gpu" else 3e-3
    for impl in ("xla", "pallas"):
        monkeypatch.setattr(dec, "resolve_decode_implementation", lambda *a, impl=impl, **kw: impl)
        jax.clear_caches()
        seen.clear()
        got, want = step(marked), step(plain)
        assert seen == ([] if impl == "xla" else [True] * cfg.n_layers + [False] * cfg.n_layers), (impl, seen)
        np.testing.assert_allclose(got.logits, want.logits, atol=atol, rtol=0, err_msg=impl)
        if jax.default_backend() != "gpu":
            _assert_same_caches(got.cache, want.cache)
    unfolded = generation.decode_variables(params, plan, fold_norms=False, project_out=True)
    np.testing.assert_allclose(step(unfolded).logits, step(plain).logits, atol=atol, rtol=0)
    chunk = jax.jit(lambda v: model.apply(v, tokens[:, 8:], cache=caches).logits)  # T = 2: the layer's own GEMM
    np.testing.assert_array_equal(chunk(marked), chunk(plain))


@pytest.mark.parametrize("policy", ["window:6", "acp"])
def test_decode_variables_fuse_the_mlp(policy, monkeypatch):
    """``decode_variables(..., fuse_mlp=True)`` adds each block's gate/up weights for the fused MLP (``mlp_tables``:
    the cast kernel itself, or transposed [2, hidden, d]) and a decode step (T = 1) then runs the block's MLP norm and
    SwiGLU as one op (``decode_swiglu``): its logits and caches equal the step without the entry, bit for bit through
    the op's XLA path (the model's arithmetic) and to 1e-5 through the Pallas kernel (interpret; float32 summation
    order; 3e-3 on GPU, where XLA's own float32 matmuls run in TF32), which the step does call; a prefill chunk
    (T > 1) does not use it, and the default adds nothing (``FUSE_DECODE_MLP``). Together with the folded input norm the same holds. A kernel that dropped the norm's
    scale would be off by ~30% (test_decode_mlp)."""
    dm = sys.modules["fox_jax.ops.decode_mlp"]
    cfg, model, params, tokens, caches, plan = _prefilled_fox_pro(2, policy)
    assert "mlp_step" not in generation.decode_variables(params, plan)["decode"]["layers_1"]
    fused = generation.decode_variables(params, plan, fuse_mlp=True)
    assert fused["decode"]["layers_1"]["mlp_step"]["gate_up"] is fused["params"]["layers_1"]["mlp"]["gate_proj"][
        "kernel"]  # no copy
    transposed = generation.mlp_tables(fused["params"], transposed=True)["decode"]["layers_1"]["mlp_step"]["gate_up"]
    kernel = params["layers_1"]["mlp"]["gate_proj"]["kernel"]
    np.testing.assert_array_equal(transposed[1, 5], kernel[:, cfg.mlp_hidden + 5])  # up unit 5's d weights
    plain = generation.decode_variables(params, plan)
    calls = []
    kernel_fn = dm.km.swiglu_partials
    monkeypatch.setattr(dm.km, "swiglu_partials", lambda *a, **kw: calls.append(1) or kernel_fn(*a, **kw))
    step = jax.jit(lambda v: model.apply(v, tokens[:, 8:9], cache=caches))
    # (on GPU XLA's float32 matmuls run in TF32, the kernel's in IEEE float32: ~1e-3 apart there)
    with_transposed = {**fused, "decode": generation._merged(fused["decode"], {"layers_0": {"mlp_step": {
        "gate_up": generation.mlp_tables(fused["params"], transposed=True)["decode"]["layers_0"]["mlp_step"][
            "gate_up"]}}})}
    for impl, atol in (("xla", 0.0), ("pallas", 1e-5 if jax.default_backend() != "gpu" else 3e-3)):
        monkeypatch.setattr(dm, "resolve_decode_mlp_implementation", lambda *a, impl=impl, **kw: impl)
        jax.clear_caches()
        calls.clear()
        got, want = step(fused), step(plain)
        np.testing.assert_allclose(step(with_transposed).logits, got.logits, atol=1e-6, rtol=0)  # layer 0 transposed
        assert len(calls) == (0 if impl == "xla" else 2 * cfg.n_layers), (impl, calls)
        np.testing.assert_allclose(got.logits, want.logits, atol=atol, rtol=0, err_msg=impl)
        if impl == "xla" or jax.default_backend() != "gpu":  # (on GPU the TF32 difference reaches the next layer's Λ)
            _assert_same_caches(got.cache, want.cache)
    both = generation.decode_variables(params, plan, fold_norms=True, fuse_mlp=True)
    assert {"mlp_step", "attn"} <= set(both["decode"]["layers_0"]) and "folded" in both["decode"]["layers_0"]["attn"]
    np.testing.assert_allclose(step(both).logits, step(plain).logits, atol=2e-5 if jax.default_backend() != "gpu"
                               else 3e-3, rtol=0)
    chunk = jax.jit(lambda v: model.apply(v, tokens[:, 8:], cache=caches).logits)  # T = 2: the model's own MLP
    calls.clear()
    np.testing.assert_array_equal(chunk(fused), chunk(plain))
    assert not calls

def test_decode_variables_pad_the_untied_head_once():
    """``decode_variables`` (what ``generate`` and ``serve`` apply the model with) holds the untied LM head cast as
    the plan says and zero-padded to 128 columns (VOCAB = 97: rows aligned), which ``LMHead`` multiplies by and
    slices back (a head doubled there doubles the logits): a decode step's logits are V wide and equal the step's
    without it (the same products, the extra columns are zeros; a bfloat16 model, whose plan casts the head); GPT-2's
    tied head has none."""
    cfg = preset("tiny", "fox-pro", vocab_size=VOCAB, d_model=64, n_layers=1, n_heads=4, dtype="bfloat16")
    model, params = LanguageModel(cfg), random_params(lambda: cfg.init_params(jax.random.PRNGKey(0)))
    tokens = padded_batch(9)
    _, caches = prefill(model, params, tokens[:, :8], seq_start=PADS, slots=16, policy="dense")
    variables = generation.decode_variables(params, generation.cast_plan(model, params, caches))
    head = variables["decode"]["lm_head"]["kernel"]
    assert head.shape == (64, 128) and head.dtype == jnp.bfloat16
    np.testing.assert_array_equal(head[:, VOCAB:], 0)
    step = jax.jit(lambda v: model.apply(v, tokens[:, 8:9], cache=caches).logits)  # (eager: 10 s of op compiles)
    with_head = step(variables)
    without = step({"params": variables["params"], "decode": {k: x for k, x in variables["decode"].items()
                                                               if k != "lm_head"}})
    assert with_head.shape == (3, 1, VOCAB)
    doubled = step({**variables, "decode": {**variables["decode"], "lm_head": {"kernel": head * 2}}})
    np.testing.assert_allclose(np.asarray(doubled, np.float32), 2 * np.asarray(with_head, np.float32), rtol=1e-2)
    np.testing.assert_allclose(np.asarray(with_head, np.float32), np.asarray(without, np.float32), rtol=1e-6,
                               atol=1e-6)
    gpt2 = GPT2(GPT2Config(vocab_size=VOCAB, n_positions=32, d_model=32, n_layers=1, n_heads=2))
    gparams = gpt2.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    assert "decode" not in generation.decode_variables(gparams, (None,) * len(jax.tree.leaves(gparams)))


def _assert_same_caches(got, want):
    """Every leaf of two lists of caches to 1e-6, Λ as its pair's value (hi + lo in float64) to 1e-5: the kernel
    computes the gate logits from their projections in another float32 summation order than XLA (and on a GPU two
    XLA programs may too), so each step's log f differs by an ulp or so, and a pair's hi by an ulp of Λ (|Λ| ≈ 30:
    2e-6), its lo taking the rest."""
    def split(c):
        lam = [(x.lam_hi, x.lam_lo) for x in (c, *c.groups) if getattr(x, "lam_hi", None) is not None]
        drop = lambda x: x.replace(lam_hi=None, lam_lo=None) if hasattr(x, "lam_hi") else x  # noqa: E731
        return lam, drop(c).replace(groups=tuple(drop(g) for g in c.groups))

    for a, b_ in zip(got, want):
        (lam_a, rest_a), (lam_b, rest_b) = split(a), split(b_)
        assert len(lam_a) == len(lam_b)
        for (ha, la), (hb, lb) in zip(lam_a, lam_b):
            np.testing.assert_allclose(np.asarray(ha, np.float64) + np.asarray(la, np.float64),
                                       np.asarray(hb, np.float64) + np.asarray(lb, np.float64), atol=1e-5, rtol=0)
        for x, y in zip(jax.tree.leaves(rest_a), jax.tree.leaves(rest_b)):
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=1e-6)


# A split of 12 tokens whose first chunks hold only left pads for rows 1 and 2 (PADS = 0, 3, 5), so that
# chunks start before, at and after seq_start, then a chunk on the live cache (the prefill-and-steps split is
# the incremental test's; this one shares its compiled 6-token chunk)
SPLIT = (2, 3, 1, 6)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["fox-pro", "gpt2-dcp"])  # KV-shift / GQA / Λ; DCP live sets, GPT-2 positions
def test_chunks_on_a_live_cache_equal_the_full_forward(family):
    model, params, policy = family_model(family)
    t = sum(SPLIT)
    tokens = padded_batch(t)
    full, keep = full_forward(model, params, tokens)
    caches = init_cache(model, 3, t, seq_start=PADS, policy=policy)
    c = 0
    for n in SPLIT:
        logits, caches = extend(model, params, caches, tokens[:, c:c + n])
        assert logits.shape == (3, n, VOCAB)
        mask = real(c + n)[:, c:]
        np.testing.assert_allclose(np.where(mask, logits, 0), np.where(mask, full[:, c:c + n], 0), atol=1e-4,
                                   err_msg=f"columns {c}..{c + n - 1}")
        c += n
        assert int(caches[0].length) == c
        if keep is not None:  # the cache holds exactly what the one-pass step mask keeps
            for layer, cache in enumerate(caches):
                for b in range(3):
                    assert live_positions(cache, b) == (expected_live(keep, layer, b, c - 1) if c > PADS[b]
                                                        else []), (layer, b, c)
        else:
            np.testing.assert_array_equal(live_counts(caches)[0], np.maximum(c - PADS, 0))


def test_kv_shift_continuation_is_exact():
    """Decoding token by token leaves exactly the cache a single prefill over all tokens builds: the same
    ring entries (column c in slot c), shifted keys/values per slot, Λ pairs, and the shift states (the last
    unshifted projections)."""
    model, params = tiny_lm("fox-pro")
    t, p = 12, 6
    tokens = padded_batch(t)
    _, caches = prefill(model, params, tokens[:, :p], seq_start=PADS, slots=t)
    for c in range(p, t):
        _, caches = decode_step(model, params, caches, tokens[:, c])
    _, one_pass = prefill(model, params, tokens, seq_start=PADS, slots=t)
    for mine, ref in zip(caches, one_pass):
        assert mine.k_shift is not None and mine.lam_hi is not None
        (g,), (r,) = mine.groups, ref.groups
        table = np.asarray(g.held_positions(mine))[:, 0]                                 # [B, C]
        np.testing.assert_array_equal(table, r.held_positions(ref)[:, 0])
        s = np.arange(g.slots)[None]
        np.testing.assert_array_equal(table, np.where((s >= PADS[:, None]) & (s < t), s - PADS[:, None], -1))
        held = table >= 0                                                                # [B, S]
        keep = held[:, None, :, None]                                                    # k, v: [B, n, S, D]
        for name in ("k", "v"):
            np.testing.assert_allclose(np.where(keep, getattr(g, name), 0), np.where(keep, getattr(r, name), 0),
                                       atol=1e-5, err_msg=name)
        keep = held[:, None, None, :]                                                    # Λ: [B, n, G, S]
        lam = lambda c: np.where(keep, np.asarray(c.lam_hi, np.float64) + np.asarray(c.lam_lo, np.float64), 0)
        np.testing.assert_allclose(lam(g), lam(r), atol=1e-6)
        np.testing.assert_allclose(mine.k_shift, ref.k_shift, atol=1e-5)
        np.testing.assert_allclose(mine.v_shift, ref.v_shift, atol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def apply_with_cache(model, params, tokens, caches):
    """The protocol itself, no engine helper (jitted: eager Flax would compile op by op)."""
    return model.apply({"params": params}, tokens, cache=caches)


def test_decode_step_compiles_once():
    model, params = tiny_lm("fox-llama")
    tokens = padded_batch(12)
    _, caches = prefill(model, params, tokens[:, :6], seq_start=PADS, slots=12)
    _, caches = decode_step(model, params, caches, tokens[:, 6])
    compiled = generation._forward._cache_size()
    for c in range(7, 12):
        _, caches = decode_step(model, params, caches, tokens[:, c])
    assert generation._forward._cache_size() == compiled


def test_chunk_through_model_apply_continues_the_cache():
    """The protocol itself (no engine helper): a chunk on a prefilled FoX (Pro) cache attends over the
    cached tokens and appends at column ``length``."""
    model, params = tiny_lm("fox-pro")
    tokens = padded_batch(12)
    full, _ = full_forward(model, params, tokens)
    _, caches = prefill(model, params, tokens[:, :6], seq_start=PADS, slots=12)
    out = apply_with_cache(model, params, tokens[:, 6:12], caches)
    np.testing.assert_allclose(out.logits, full[:, 6:12], atol=1e-4)
    assert int(out.cache[0].length) == 12


def test_ring_overflow_raises_or_counts():
    """A dense ring does not grow: ``extend`` refuses a chunk that does not fit; the model call itself (no
    host check) keeps the newest columns and counts the rest: a chunk or a decode step overwrites the oldest
    entries (``dcp``'s pool and ``acp``'s rings count overflow the same way; the layer-level tests check the
    counter for every policy)."""
    model, params = tiny_lm("fox-llama")
    tokens = padded_batch(RING_BLOCK + 4)
    _, caches = prefill(model, params, tokens[:, :RING_BLOCK - 2], seq_start=PADS, slots=RING_BLOCK - 2)
    assert caches[0].capacity == RING_BLOCK
    with pytest.raises(ValueError, match="full"):
        extend(model, params, caches, tokens[:, RING_BLOCK - 2:RING_BLOCK + 3])
    out = apply_with_cache(model, params, tokens[:, RING_BLOCK - 2:RING_BLOCK + 3], caches)
    # 67 − PADS real tokens for 64 entries: row 0 drops positions 0..2, row 1 fits exactly, row 2 fits
    for cache in out.cache:
        np.testing.assert_array_equal(cache.overflow, [3, 0, 0])
        assert live_positions(cache, 0) == list(range(3, RING_BLOCK + 3))
    np.testing.assert_array_equal(live_counts(out.cache)[0], [RING_BLOCK, RING_BLOCK, RING_BLOCK - 2])
    step = apply_with_cache(model, params, tokens[:, RING_BLOCK + 3:RING_BLOCK + 4], out.cache)
    np.testing.assert_array_equal(step.cache[0].overflow, [4, 1, 0])
    assert live_positions(step.cache[0], 1) == list(range(1, RING_BLOCK + 1))  # position 0 made room


def primitive_eqns(jaxpr) -> list:
    """Every equation of a (closed) jaxpr, sub-jaxprs (pjit, cond, loops, custom_jvp) included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    eqns = []
    for eqn in jaxpr.eqns:
        eqns.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    eqns += primitive_eqns(sub)
    return eqns


@pytest.mark.parametrize("family,policy", [("fox-llama", "dense"), ("fox-pro", "acp"), ("fox-pro", "sinks:2+3"),
                                           ("fox-dcp", "dcp"), ("gpt2-dcp", "dcp")])
def test_decode_step_does_not_loop_over_the_cache(family, policy):
    """One decode step on a live cache reads each slot's stored k, v and Λ_j directly: no loop (scan, while)
    and no sort at all (a pool's lowest free slot is an argmax; a ring's slot is ``length mod C``), a
    cumulative op (DCP's votes) runs over the chunk (one token), never over the slots."""
    model, params, _ = family_model(family)
    slots = 8
    caches = init_cache(model, 3, slots, policy=policy, seq_start=PADS, max_context=16)
    caches = tuple(c.replace(fresh=False) for c in caches)  # as after a prefill
    jaxpr = jax.make_jaxpr(lambda p, c, tok: model.apply({"params": p}, tok, cache=c))(
        params, caches, jnp.zeros((3, 1), jnp.int32))
    eqns = primitive_eqns(jaxpr)
    names = {e.primitive.name for e in eqns}
    assert "dot_general" in names  # the walk does see the attention
    assert not names & {"scan", "while", "sort", "cumlogsumexp", "reduce_window_sum", "reduce_window"}, sorted(names)
    cumulative = [e for e in eqns if e.primitive.name in ("cumsum", "cumprod", "cummax", "cummin")]
    for e in cumulative:
        assert e.invars[0].aval.shape[e.params["axis"]] == 1, (e.primitive.name, e.invars[0].aval.shape)


# ---------------------------------------------------------------------------------------------
# DCP: the cache against the training path at α = ∞
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt2-dcp", "fox-dcp"])
def test_dcp_cache_frees_and_reuses_slots(family):
    """The dcp cache holds exactly the training mask's survivors (checked in the incremental test); here:
    a decode step writes the new token into the lowest slot free after that step's evictions, and slots
    freed earlier are reused."""
    model, params, _ = family_model(family)
    t, p = 12, 6
    tokens = padded_batch(t)
    _, caches = prefill(model, params, tokens[:, :p], seq_start=PADS, slots=t, policy="dcp")
    size = caches[0].capacity
    for layer in range(len(caches)):  # the prefill writes its survivors into the first slots, in token order
        pos = np.asarray(caches[layer].groups[0].pos)[:, 0]
        live = (pos >= 0).sum(1, keepdims=True)
        np.testing.assert_array_equal(pos >= 0, np.arange(size)[None] < live)
        np.testing.assert_array_equal(caches[layer].groups[0].hi, live[:, 0])  # the read bound
        assert all(list(row[:n]) == sorted(row[:n]) for row, n in zip(pos, live[:, 0]))
    reused = 0
    ever_used = [np.asarray(c.groups[0].pos)[:, 0] >= 0 for c in caches]
    for c in range(p, t):
        before = [np.asarray(cache.groups[0].pos)[:, 0] for cache in caches]
        _, caches = decode_step(model, params, caches, tokens[:, c])
        for layer, cache in enumerate(caches):
            after = np.asarray(cache.groups[0].pos)[:, 0]
            for b in range(3):
                slot = int(np.flatnonzero(after[b] == c - PADS[b])[0])
                free = [s for s in range(size) if before[layer][b, s] < 0 or before[layer][b, s] not in after[b]]
                assert slot == min(free), (layer, b, c)
                assert int(cache.groups[0].hi[b]) == int(np.flatnonzero(after[b] >= 0).max()) + 1
                reused += bool(ever_used[layer][b, slot])
                ever_used[layer][b, slot] = True
    assert reused > 0


def assert_greedy(reference, prompt, generated, pads=PADS):
    """Greedy decoding is self-consistent: each token is the argmax of the full-sequence logits of the
    left-padded prompt plus the tokens before it (one teacher-forced forward of everything generation fed,
    the prompt and all samples but the last, checks them all)."""
    seq = jnp.concatenate([prompt, generated[:, :-1]], axis=1)
    logits = reference(seq, pads)
    t, n = prompt.shape[1], generated.shape[1]
    np.testing.assert_array_equal(generated, jnp.argmax(logits[:, t - 1:t - 1 + n], axis=-1))
    return logits


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2-dcp", "fox-dcp"])
def test_generate_dcp_equals_the_training_path(family):
    """DCP generation (chunked prefill + decode loop) equals the training path at α = ∞, token for token,
    with live counts equal to the step mask's; a pool of the peak live count (rounded up to ``RING_BLOCK``)
    changes nothing (pools of exactly the peak: the layer-level property test)."""
    model, params, _ = family_model(family)
    prompt = padded_batch(8)
    n = 16
    out = generate(model, params, prompt, max_new_tokens=n, seq_start=PADS, policy="dcp", prefill_chunk=3)
    assert_greedy(lambda seq, pads: full_forward(model, params, seq, pads)[0], prompt, out.tokens)
    # live counts per step = the training-path keep mask of the row that produced each token
    seq = jnp.concatenate([prompt, out.tokens[:, :-1]], axis=1)   # what generation fed (as assert_greedy)
    _, keep = full_forward(model, params, seq)
    cols = np.arange(seq.shape[1])
    keep &= (cols >= PADS[:, None])[None, :, None, :]  # pads are never cached
    keep &= (cols[None, :] <= cols[:, None])[None, None]  # causal (log I is 0 above the diagonal)
    expected = keep.sum(-1)[:, :, 7:7 + n].transpose(2, 0, 1)  # [n, L, B]
    np.testing.assert_array_equal(out.live_counts, expected)
    assert out.live_counts[-1].max() < 8 + n - 1  # pruned: fewer live tokens than a dense cache holds
    assert int(out.overflow.max()) == 0
    if family == "gpt2-dcp":  # the KV budget: the peak live count at any chunk boundary fits
        # boundaries: the prefill chunks (the prompt is left-padded to 9 columns: columns 1, 4, 7), then
        # every decode step (columns 8 .. 22)
        counts = keep.sum(-1)                                                     # [L, B, T]
        peak = int(counts[:, :, [1, 4] + list(range(7, 7 + n))].max())
        assert peak < 8 + n - 1
        fit = generate(model, params, prompt, max_new_tokens=n, seq_start=PADS, policy="dcp", prefill_chunk=3,
                       slots=peak)
        np.testing.assert_array_equal(fit.tokens, out.tokens)
        np.testing.assert_array_equal(fit.live_counts, out.live_counts)
        assert int(fit.overflow.max()) == 0 and fit.caches[0].capacity == -(-peak // RING_BLOCK) * RING_BLOCK


@pytest.mark.slow
def test_dcp_large_beta_equals_dense_decoding():
    model, params = tiny_gpt2(betas=(1e4, 1e4))
    t, p = 12, 6
    tokens = padded_batch(t)
    _, pruned = prefill(model, params, tokens[:, :p], seq_start=PADS, slots=t, policy="dcp")
    _, dense = prefill(model, params, tokens[:, :p], seq_start=PADS, slots=t, policy="dense")
    for c in range(p, t):
        pruned_logits, pruned = decode_step(model, params, pruned, tokens[:, c])
        dense_logits, dense = decode_step(model, params, dense, tokens[:, c])
        np.testing.assert_allclose(pruned_logits, dense_logits, atol=1e-5)
    np.testing.assert_array_equal(live_counts(pruned), np.broadcast_to(t - PADS, (len(pruned), 3)))
    # and the dense cache equals the model without DCP (the same weights minus the interaction)
    plain = GPT2(model.cfg.replace(dcp=False))
    plain_params = {k: ({**v, "attn": {n: w for n, w in v["attn"].items() if n in ("c_attn", "c_proj")}}
                        if k.startswith("h_") else v) for k, v in params.items()}
    full, _ = full_forward(plain, plain_params, tokens)
    np.testing.assert_allclose(dense_logits, full[:, -1], atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Every policy: generation equals a full recomputation under the policy's mask
# ---------------------------------------------------------------------------------------------

def policy_attention(policy, calls):
    """A stand-in for ``forgetting_attention`` (the training path's attention op) that applies ``policy``'s
    mask to the whole sequence at once, written from the rules of ``fox_jax.cache.policies``: positions come
    from the segments (pads are segment 0), Λ = cumsum(log f), and acp's δ is the forward's own QK-norm
    bound (``adaptive_threshold="auto"``: N = the sequence length, log ε = −10) moved to the policy's log ε
    (δ is affine in log ε); a key/value head hides a key once all its query heads do, for good. Pad queries
    see themselves only, so nothing turns NaN."""
    policy = parse_policy(policy)

    def attention(q, k, v, log_fgate, *, segment_ids, adaptive_threshold=None, **_):
        calls.append(policy.spec)
        b, t, h, d = q.shape
        hkv = k.shape[2]
        k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
        is_real = segment_ids > 0
        pos = jnp.cumsum(segment_ids, axis=1) - 1
        pi, pj = pos[:, :, None, None], pos[:, None, :, None]
        diag = (jnp.arange(t)[:, None] == jnp.arange(t)[None, :])[None, :, :, None]
        vis = is_real[:, :, None, None] & is_real[:, None, :, None] & (pj <= pi)
        if isinstance(policy, Window):
            vis &= pi - pj < policy.window
        elif isinstance(policy, Sinks):
            vis &= (pj < policy.sinks) | (pi - pj < policy.window)
        s = jnp.einsum("bihd,bjhd->bijh", q, k, precision=jax.lax.Precision.HIGHEST).astype(jnp.float32) * d ** -0.5
        if log_fgate is not None:
            lam = jnp.cumsum(jnp.where(is_real[..., None], log_fgate, 0.0), axis=1)
            decay = lam[:, :, None, :] - lam[:, None, :, :]
            s = s + decay
            if isinstance(policy, ACP):  # a key/value head hides j once every query head of it does
                delta = adaptive_threshold - DEFAULT_LOG_EPSILON + policy.log_epsilon   # [B, H]
                hidden = (decay < delta[:, None, None, :]).reshape(b, t, t, hkv, h // hkv).all(-1)
                hidden &= (jnp.arange(t)[:, None] > jnp.arange(t)[None, :])[None, :, :, None]
                vis &= ~jnp.repeat(jnp.cumsum(hidden, axis=1) > 0, h // hkv, axis=3)   # hidden for later queries
        w = jax.nn.softmax(jnp.where(vis | (diag & ~is_real[:, :, None, None]), s, -jnp.inf), axis=2)
        return jnp.einsum("bijh,bjhd->bihd", w, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
                          ).astype(q.dtype)

    return attention


def window_attention(window, calls):
    """The attention op itself with its sliding window, ``forgetting_attention(..., window_size=W)``."""
    def attention(*args, **kw):
        calls.append("window")
        return forgetting_attention(*args, window_size=window, **kw)
    return attention


def masked_forward(model, params, tokens, policy, monkeypatch, pads=PADS, op=policy_attention):
    """Logits of the training path of ``model`` with ``op(policy, calls)`` in place of its attention op."""
    calls = []
    if isinstance(model, GPT2):
        monkeypatch.setattr("fox_jax.models.gpt2.forgetting_attention", op(policy, calls))
    else:
        monkeypatch.setattr("fox_jax.nn.attention.forgetting_attention", op(policy, calls))
        if model.cfg.qk_norm:  # the forward then hands the op the QK-norm bound δ
            model = LanguageModel(model.cfg.replace(adaptive_threshold="auto"))
    t = tokens.shape[1]
    positions = jnp.arange(t)[None] - jnp.asarray(pads)[:, None]
    forward = jax.jit(lambda p: model.apply({"params": p}, tokens, segment_ids=(positions >= 0).astype(jnp.int32),
                                            positions=jnp.maximum(positions, 0) if isinstance(model, GPT2)
                                            else positions).logits)   # a fresh jit: traced with the stand-in
    logits = np.asarray(forward(params), np.float32)
    monkeypatch.undo()
    assert len(calls) == model.cfg.n_layers  # every layer ran the stand-in
    return logits


POLICY_CASES = [("fox-pro", "window:3"), ("fox-pro", "sinks:2+3"), ("fox-pro", "acp:-2")]  # forgets fast here


@pytest.mark.slow
@pytest.mark.parametrize("family,policy", POLICY_CASES)
def test_generation_equals_recomputation_under_the_policy(family, policy, monkeypatch):
    """Greedy ``generate`` (chunked prefill, decode loop, freed and reused slots) equals the argmax of a
    teacher-forced recomputation of the whole sequence in one chunk under the policy (``prefill``), which
    equals an independent reference: the training forward with the policy's mask (``policy_attention``),
    for window:W also with the attention op's sliding window (``window_size=W``); GPT-2's training-path
    ``local:W`` pattern: ``test_gpt2_local_pattern_decodes_as_window``. Teacher-forced scoring under
    the policy in other chunks (``token_losses_under_policy``, acp) gives the same losses; live counts are the
    policy's (window: W, sinks: S + W; acp: fewer than fed)."""
    # forget gates f ≈ 0.12: the QK-norm bound (δ ≈ −11.5 at N = 15, ε = e⁻²) evicts
    model, params = tiny_lm(family, fgate_bias=-2.0)
    prompt, n = padded_batch(8), 8
    out = generate(model, params, prompt, max_new_tokens=n, seq_start=PADS, policy=policy, prefill_chunk=3)
    seq = jnp.concatenate([prompt, out.tokens[:, :-1]], axis=1)    # everything generation fed: 15 columns
    t = seq.shape[1]
    if policy.startswith("acp"):  # one-token chunks: the first sets δ on a fresh cache, outside the scan
        one = generate(model, params, prompt, max_new_tokens=n, seq_start=PADS, policy=policy, prefill_chunk=1)
        np.testing.assert_array_equal(one.tokens, out.tokens)
        np.testing.assert_array_equal(one.live_counts, out.live_counts)
    logits, caches = prefill(model, params, seq, policy=policy, seq_start=PADS, max_context=t)
    np.testing.assert_array_equal(out.tokens, np.argmax(logits[:, 7:], axis=-1))
    assert int(out.overflow.max()) == 0 and int(caches[0].overflow.max()) == 0
    mask = real(t)
    # one pass each, the same float32 terms in another order: ≤ 4e-7 apart (measured); the policies move
    # these logits by 4e-2 (window, sinks) and 6e-5 (acp:-2, whose ε bound keeps the change small) from
    # dense, so 1e-5 tells the policy's mask from any other
    np.testing.assert_allclose(np.where(mask, masked_forward(model, params, seq, policy, monkeypatch), 0),
                               np.where(mask, logits, 0), atol=1e-5)
    pol = parse_policy(policy)
    if isinstance(pol, Window):  # and the training path with the op's own sliding window
        np.testing.assert_allclose(np.where(mask, masked_forward(model, params, seq, pol.window, monkeypatch,
                                                                 op=window_attention), 0),
                                   np.where(mask, logits, 0), atol=1e-5)
    fed = 8 - PADS[None, None] + np.arange(n)[:, None, None]             # [n, 1, B] before each sample
    if isinstance(pol, ACP):
        assert np.all(out.live_counts <= fed) and np.all(out.live_counts[-1, :, 0] < fed[-1, 0, 0])  # evicts
    else:
        np.testing.assert_array_equal(out.live_counts, np.broadcast_to(np.minimum(fed, pol.max_live(t)),
                                                                       out.live_counts.shape))
    if isinstance(pol, ACP):  # the scoring path (prefill chunks of 4) gives the same losses
        nll, overflow = token_losses_under_policy(model, params, seq, policy=policy, seq_start=PADS,
                                                  prefill_chunk=4)
        lp = jax.nn.log_softmax(logits, axis=-1)
        ref = -np.take_along_axis(np.asarray(lp[:, :-1]), np.asarray(seq[:, 1:, None]), axis=-1)[..., 0]
        np.testing.assert_allclose(np.where(real(t)[:, :-1, 0], nll, 0), np.where(real(t)[:, :-1, 0], ref, 0),
                                   atol=1e-4)
        assert int(overflow.max()) == 0
        last = out.tokens[:, -1]  # with the token after the last: T predictions, the last one scored too
        nll_t, _ = token_losses_under_policy(model, params, seq, policy=policy, seq_start=PADS, prefill_chunk=4,
                                             next_tokens=last)
        assert nll_t.shape == seq.shape
        np.testing.assert_allclose(nll_t[:, :-1], nll, atol=1e-6)
        np.testing.assert_allclose(nll_t[:, -1], -np.take_along_axis(np.asarray(lp[:, -1]), np.asarray(last)[:, None],
                                                                     axis=-1)[:, 0], atol=1e-4)


@pytest.mark.slow
def test_gpt2_local_pattern_decodes_as_window():
    """A GPT-2 trained with the fixed ``local:W`` pattern (the DCP paper's baseline) decodes under
    ``window:W`` on a pool of W slots: a prefill and decode steps equal its training path."""
    model, params = plain_gpt2()
    local = GPT2(model.cfg.replace(sparse_pattern="local:4"))
    t, p = 12, 6
    tokens = padded_batch(t)
    full, _ = full_forward(local, params, tokens)
    assert np.abs(np.where(real(t), full - full_forward(model, params, tokens)[0], 0)).max() > 1e-2  # not dense
    logits, caches = prefill(model, params, tokens[:, :p], seq_start=PADS, policy="window:4")
    np.testing.assert_allclose(np.where(real(p), logits, 0), np.where(real(p), full[:, :p], 0), atol=1e-5)
    assert caches[0].capacity == RING_BLOCK  # a ring of W = 4 rounded up to the decode kernel's block
    for c in range(p, t):
        step_logits, caches = decode_step(model, params, caches, tokens[:, c])
        np.testing.assert_allclose(step_logits, full[:, c], atol=1e-5, err_msg=f"column {c}")
        np.testing.assert_array_equal(live_counts(caches)[0], np.minimum(c + 1 - PADS, 4))


# ---------------------------------------------------------------------------------------------
# generate: sampling, stop tokens, padding, errors
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def greedy(arch, fgate_bias=None, n=7):
    """Greedy generation of 7 tokens from the 6-token left-padded prompt (shared: one compile), in blocks of 3
    decode steps (``steps_per_check``: the 6 steps after the first sample are two blocks)."""
    model, params = tiny_lm(arch, fgate_bias=fgate_bias)
    return generate(model, params, padded_batch(6), max_new_tokens=n, seq_start=PADS, steps_per_check=3)


@pytest.mark.parametrize("arch", ["fox-pro", "transformer-llama"])
def test_generate_greedy(arch):
    model, params = tiny_lm(arch)
    prompt, n = padded_batch(6), 7
    out = greedy(arch)
    assert_greedy(lambda seq, pads: full_forward(model, params, seq, pads)[0], prompt, out.tokens)
    assert out.live_counts.shape == (n, model.cfg.n_layers, 3)
    np.testing.assert_array_equal(out.live_counts[:, 0, :], 6 - PADS[None] + np.arange(n)[:, None])
    np.testing.assert_array_equal(out.lengths, [n] * 3)
    assert int(out.overflow.max()) == 0 and [int(c.length) for c in out.caches] == [6 + n - 1] * len(out.caches)
    # steps = k: the same compiled program stops after k samples (the first k tokens, then −1); k = 5 is one
    # block of 3 steps and one step alone
    part = generate(model, params, prompt, max_new_tokens=n, seq_start=PADS, steps=5, steps_per_check=3)
    np.testing.assert_array_equal(part.tokens[:, :5], out.tokens[:, :5])
    assert np.all(np.asarray(part.tokens[:, 5:]) == -1)
    assert [int(c.length) for c in part.caches] == [6 + 5 - 1] * len(part.caches)  # the loop's one counter, set back
    np.testing.assert_array_equal(part.lengths, [5] * 3)


@pytest.mark.slow
def test_generate_sampling():
    """Sampling through ``generate`` (one compiled program: temperature 1.5, top_k = 3, top_p = 0.5) is
    reproducible, does sample (not the greedy tokens), and every token lies in the nucleus that the full
    forward's logits give: the top 3, then the most likely of those while the mass of the more likely ones
    (renormalised over the 3, at temperature 1.5) is < 0.5 — so both filters reach the sampler (the
    logits are near-uniform: the 3rd token, outside the nucleus, would be drawn ~1/3 of the time without
    top_p; ~48 tokens would be in play without top_k). The filters themselves, a tiny top_p, top_k = 1 and
    top_p = 1: ``test_sample_logits_filters``."""
    model, params = tiny_lm("fox-pro")
    prompt, n = padded_batch(6), 7
    out = greedy("fox-pro")
    kw = dict(max_new_tokens=n, seq_start=PADS, temperature=1.5, top_k=3, top_p=0.5, rng=jax.random.PRNGKey(7))
    sampled = np.asarray(generate(model, params, prompt, **kw).tokens)
    np.testing.assert_array_equal(sampled, generate(model, params, prompt, **kw).tokens)
    assert not np.array_equal(sampled, out.tokens)  # it does sample
    logits, _ = full_forward(model, params, jnp.concatenate([prompt, sampled[:, :-1]], axis=1))
    top = np.asarray(logits[:, 5:], np.float64) / 1.5                       # [B, n, V]
    order = np.argsort(-top, axis=-1)[..., :3]
    p3 = np.exp(np.take_along_axis(top, order, axis=-1))
    p3 /= p3.sum(-1, keepdims=True)
    before = np.cumsum(p3, axis=-1) - p3                                    # mass of the more likely ones
    assert np.min(np.abs(before - 0.5)) > 1e-3  # no token within float32 noise of the cut
    nucleus = np.where(before < 0.5, order, -1)
    assert np.any(nucleus == -1)  # top_p does cut inside the top 3
    assert all(int(sampled[b, i]) in nucleus[b, i] for b in range(3) for i in range(n)), (sampled, nucleus)


def test_sample_logits_filters():
    """top_p = p samples from the smallest set of most likely tokens whose probability reaches p: a token
    whose more likely tokens already hold ≥ p of the mass is never drawn, every other one is (p is kept
    clear of the partial sums 0.4, 0.65, 0.8, … and 0.5, 0.7, 0.82, …, so float32 cannot flip a token).
    top_p = 1 filters nothing; top_k = 1 is greedy whatever the temperature."""
    probs = np.array([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04], [0.05, 0.12, 0.5, 0.03, 0.2, 0.1]])
    logits = jnp.log(jnp.asarray(probs, jnp.float32)) * 2.0           # temperature 2 restores probs
    many = jnp.tile(logits, (4000, 1))                                  # 4000 independent draws per row
    draw = lambda p: np.asarray(generation.sample_logits(many, jax.random.PRNGKey(0), temperature=2.0,
                                                         top_p=p)).reshape(4000, 2)
    for top_p, nucleus in ((0.45, [{0, 1}, {2}]), (0.75, [{0, 1, 2}, {2, 4, 1}]), (0.85, [{0, 1, 2, 3}, {2, 4, 1, 5}])):
        samples = draw(top_p)
        for b in range(2):
            assert set(samples[:, b].tolist()) == nucleus[b], (top_p, b)
    np.testing.assert_array_equal(draw(1.0), draw(None))  # top_p = 1 filters nothing
    greedy_draws = generation.sample_logits(many, jax.random.PRNGKey(1), temperature=5.0, top_k=1)
    np.testing.assert_array_equal(greedy_draws, jnp.argmax(many, axis=-1))


@pytest.mark.slow
def test_generate_stop_tokens():
    """A row stops at its first stop token (kept), later entries are −1, lengths count the stop token; the
    other rows go on, and the loop ends once every row has stopped (the caches were fed no further)."""
    model, params = tiny_lm("fox-pro")
    prompt, n = padded_batch(6), 7
    free = np.asarray(greedy("fox-pro").tokens)
    stops = (int(free[0, 1]), int(free[1, 4]), int(free[2, 2]))  # rows stop by steps 1, 4 and 2
    out = generate(model, params, prompt, max_new_tokens=n, seq_start=PADS, stop_tokens=stops)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    for b in range(3):
        hits = np.flatnonzero(np.isin(free[b], stops))
        length = int(hits[0]) + 1 if len(hits) else n
        assert lengths[b] == length, (b, lengths)
        np.testing.assert_array_equal(tokens[b, :length], free[b, :length])
        assert np.all(tokens[b, length:] == -1)
    assert lengths[0] <= 2 and lengths[1] <= 5 and lengths[2] <= 3
    last = int(lengths.max())
    assert last < n and len(set(lengths.tolist())) > 1  # rows stop at different steps, all before n
    # the loop ended once the last row stopped: fed were the prompt and all samples but the last
    assert int(out.caches[0].length) == 6 + last - 1
    np.testing.assert_array_equal(out.live_counts[last:], np.broadcast_to(out.live_counts[last - 1],
                                                                         out.live_counts[last:].shape))
    # in blocks of 3 steps the end is checked at samples 4 and 7: the same tokens, and the caches were fed on,
    # masked, to the end of the block in which the last row stopped
    blocks = generate(model, params, prompt, max_new_tokens=n, seq_start=PADS, stop_tokens=stops, steps_per_check=3)
    np.testing.assert_array_equal(blocks.tokens, tokens)
    np.testing.assert_array_equal(blocks.lengths, lengths)
    assert int(blocks.caches[0].length) == 6 + (4 if last <= 4 else 7) - 1


@pytest.mark.slow
def test_generate_left_padded_row_equals_the_single_row():
    """A row of a left-padded batch generates what the row alone, unpadded, generates: here the row with 5
    pads, whose one-token prompt goes straight to the decode loop."""
    model, params = tiny_lm("fox-pro")
    prompt = padded_batch(6)
    batch = greedy("fox-pro")
    alone = generate(model, params, prompt[2:, 5:], max_new_tokens=7)
    np.testing.assert_array_equal(alone.tokens[0], batch.tokens[2])
    np.testing.assert_array_equal(alone.live_counts[:, :, 0], batch.live_counts[:, :, 2])


def test_generate_and_input_errors():
    model, params = tiny_lm("fox-llama")
    tokens = padded_batch(6)
    for bad in (0, 5, 2.0):
        with pytest.raises(ValueError, match="steps must be"):
            generate(model, params, tokens, max_new_tokens=4, steps=bad)
    for bad in (0, 2.0):
        with pytest.raises(ValueError, match="steps_per_check must be"):
            generate(model, params, tokens, max_new_tokens=4, steps_per_check=bad)
    with pytest.raises(ValueError, match="too small"):
        prefill(model, params, tokens, slots=5)
    with pytest.raises(ValueError, match="too small"):
        generate(model, params, tokens, max_new_tokens=4, slots=8)          # dense needs 6 + 4 − 1 = 9
    with pytest.raises(ValueError, match="too small"):
        generate(model, params, tokens, max_new_tokens=4, policy="window:4", slots=3)   # window:4 keeps 4
    with pytest.raises(ValueError, match="too small"):
        generate(model, params, tokens, max_new_tokens=4, policy="sinks:2+4", slots=5)  # sinks:2+4 keeps 6
    with pytest.raises(ValueError, match="seq_start"):
        prefill(model, params, tokens, seq_start=np.array([0, 6, 1]))
    for bad in ("lru", "window:0", "sinks:4", "window"):
        with pytest.raises(ValueError) as err:
            generate(model, params, tokens, max_new_tokens=2, policy=bad)
        # the message names the forms, or the form of the policy it names
        assert POLICY_FORMS in str(err.value) or f"{bad!r} needs" in str(err.value)
    with pytest.raises(ValueError, match="log ε < 0"):
        generate(model, params, tokens, max_new_tokens=2, policy="acp:1")
    with pytest.raises(ValueError, match="DCP"):
        generate(model, params, tokens, max_new_tokens=2, policy="dcp")      # no interaction weights
    transformer, t_params = tiny_lm("transformer-llama")
    with pytest.raises(ValueError, match="forget gate"):
        generate(transformer, t_params, tokens, max_new_tokens=2, policy="acp")
    gpt2, g_params = plain_gpt2()
    with pytest.raises(ValueError, match="forget gate"):
        generate(gpt2, g_params, tokens, max_new_tokens=2, policy="acp")
    with pytest.raises(ValueError, match="positions"):
        generate(gpt2, g_params, tokens, max_new_tokens=60)                  # 6 + 59 > 64
    with pytest.raises(ValueError, match="rng"):
        generate(model, params, tokens, max_new_tokens=2, temperature=1.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, params, tokens, max_new_tokens=2, temperature=1.0, top_p=0.0, rng=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, params, tokens, max_new_tokens=0)
    longer = padded_batch(12)
    _, caches = prefill(model, params, longer[:, :6], seq_start=PADS, slots=12)   # a ring of 64
    _, caches = decode_step(model, params, caches, longer[:, 6])
    caches = tuple(c.replace(length=c.length + RING_BLOCK - 7) for c in caches)  # as if 64 columns were fed
    with pytest.raises(ValueError, match="full"):  # the dense ring does not grow
        decode_step(model, params, caches, longer[:, 0])
    with pytest.raises(ValueError, match="segment_ids"):
        model.apply({"params": params}, tokens, segment_ids=jnp.zeros_like(tokens), cache=init_cache(model, 3, 8))


# ---------------------------------------------------------------------------------------------
# The decode loop's work: precast weights; a heuristic acp that does not depend on the chunking; provability
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["fox-pro", "gpt2-dcp"])
def test_precast_weights_give_bit_identical_logits(family):
    """With bf16 compute, the weights the model casts to bf16 at every call are cast once before the loop
    (``cast_plan`` / ``precast``): the matrices of the bf16 layers (and the embedding / LM head), never the
    float32 ones (forget gate, KV-shift, DCP interaction, norms, β). A step with precast weights gives the same
    logits bit for bit and converts no parameter any more."""
    model, params, policy = family_model(family)
    model = type(model)(model.cfg.replace(dtype="bfloat16"))
    caches = init_cache(model, 3, 16, policy=policy, seq_start=PADS, max_context=16)
    tokens = padded_batch(1)
    plan = generation.cast_plan(model, params, caches)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    cast = {p for p, dt in zip(paths, plan) if dt is not None}
    assert set(dt for dt in plan if dt is not None) == {"bfloat16"}
    first = model.cfg.layer_names[0]
    proj = ("c_attn", "c_fc") if family.startswith("gpt2") else ("q_proj", "o_proj", "gate_proj")
    assert all(any(first in p and name in p for p in cast) for name in proj), sorted(cast)
    keep32 = ("q_int", "k_int", "beta", "ln_") if family.startswith("gpt2") else (
        "fgate_proj", "k_shift_proj", "q_int", "norm", "beta")
    assert not any(name in p for p in cast for name in keep32), sorted(cast)
    raw, _ = generation._forward(model, params, tokens, caches)
    pre = generation.precast(params, plan)
    fast, _ = generation._forward(model, pre, tokens, caches)
    np.testing.assert_array_equal(np.asarray(raw), np.asarray(fast))
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens, cache=caches).logits)(pre).jaxpr
    param_vars = {id(v) for v in jaxpr.invars[:len(plan)]}
    assert not [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
                and id(e.invars[0]) in param_vars and e.params["new_dtype"] == jnp.bfloat16]


def test_heuristic_acp_logits_do_not_depend_on_the_chunking():
    """FoX (LLaMA) has no QK-norm, so ``acp`` is a heuristic (the cache says so: ``provable`` False, one
    warning): its threshold comes from the running maxima of the q and k norms kept in the cache, so the
    logits of 71 tokens fed in chunks of 1 and 7 and in one pass agree to float32 rounding (1e-5; the
    per-chunk estimate of the earlier engine moved them by 1.5e-4 to 1.9e-3), with the same live counts, and
    the cache does evict (forget gates f ≈ 0.12)."""
    model, params = tiny_lm("fox-llama", fgate_bias=-2.0)
    t = 71                                       # 10·7 + 1: decode steps, chunks on a live cache, a fresh prefill
    tokens = padded_batch(t)
    runs = []
    for chunk in (1, 7, t):
        with pytest.warns(HeuristicEvictionWarning, match="heuristic"):
            caches = init_cache(model, 3, t, policy="acp:-4", seq_start=PADS, max_context=t)
        assert not caches[0].provable
        logits = []
        for c in range(0, t, chunk):
            out, caches = extend(model, params, caches, tokens[:, c:c + chunk])
            logits.append(np.asarray(out))
        runs.append((np.concatenate(logits, axis=1), np.asarray(live_counts(caches))))
    mask = real(t)
    for logits, lives in runs[:-1]:
        np.testing.assert_allclose(np.where(mask, logits, 0), np.where(mask, runs[-1][0], 0), atol=1e-5)
        np.testing.assert_array_equal(lives, runs[-1][1])
    assert np.all(runs[-1][1] < (t - PADS)[None] / 2)  # it evicts


def test_caches_say_whether_the_policy_is_provable():
    """``provable`` of the caches (and so of ``Generation``): acp on FoX (Pro) is provable (QK-norm bound), on
    FoX (LLaMA) a heuristic, which ``init_cache`` warns about; every other policy's rule is exact."""
    for arch, policy, want in (("fox-pro", "acp", True), ("fox-llama", "acp", False), ("fox-llama", "window:4", True)):
        model, _ = tiny_lm(arch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            caches = init_cache(model, 3, 8, policy=policy)
        assert any(issubclass(w.category, HeuristicEvictionWarning) for w in caught) is not want
        assert all(c.provable is want for c in caches)
        assert parse_policy(policy).provable(model.cfg.cache_layout()) is want
    assert greedy("fox-pro").provable is True
