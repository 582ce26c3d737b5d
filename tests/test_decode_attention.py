"""Tests of ``fox_jax.ops.decode_attention`` (one query per row and head over a ring KV cache).

Every implementation is compared with the dense float32 oracle ``decode_attention_reference``, which
gathers the live keys in logical order (an independent formulation of the ring convention). On CPU the
Pallas kernel runs in interpret mode with 16-key blocks (``default_decode_config(interpret=True)``), so
small rings (C = 48–96, not all powers of two) still give multi-block loops, wraps and splits. One call
carries six awkward (row, head) ranges at once (``_ranges``): empty, a full ring that wraps, shorter than
a block, a short range across the wrap, block-aligned, and from column 0 with an unaligned end.
``-m gpu`` runs the Triton-lowered kernel and the cuDNN path on decode-sized shapes.

Tolerances (max abs error relative to the oracle's max |o|, ``_tol``):
* float32 inputs: the implementations compute in float32 like the oracle (IEEE matmuls: the kernel asks
  Triton for ``precision=HIGHEST``); only the summation order differs → 2e-6 (measured ≤ 5e-7).
  Tight on purpose: dropping the low part of the Λ pairs at |Λ| ≈ 600 moves outputs by ~1e-5
  (``test_lambda_pairs_matter`` checks that this tolerance sees it).
* bfloat16 inputs: the oracle runs in float32 on the same rounded inputs; the implementations round the
  softmax weights to bf16 before P·V (2⁻⁸ relative per term) → 1e-2.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.cache.policies import PIN_BLOCK, RING_BLOCK
from fox_jax.kernels import decode_attention as dk
from fox_jax.ops import decode_attention, decode_attention_append, decode_attention_reference
from fox_jax.ops.decode_attention import PinnedSlots, resolve_decode_implementation, visible_slots, write_entry

_B, _HKV = 2, 3


def _ranges(cap: int) -> tuple[np.ndarray, np.ndarray]:
    """[B=2, Hkv=3] logical ranges [lo, hi) for a ring of capacity C (a multiple of 16, ≥ 48)."""
    lo = np.array([[37, 2 * cap + 5, cap + 3],
                   [2 * cap - 5, 16, 0]], np.int32)
    hi = np.array([[37, 3 * cap + 5, cap + 10],           # empty | full ring, wraps | 7 keys inside a block
                   [2 * cap + 6, 16 + 32, cap - 7]], np.int32)  # 11 keys across the wrap | 2 aligned blocks | [0, C − 7)
    return lo, hi


def _inputs(cap, grp, d, dtype, lam: bool, valid_nt: int | None, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((_B, _HKV, grp, d)).astype(np.float32)
    k = rng.standard_normal((_B, _HKV, cap, d)).astype(np.float32)
    v = rng.standard_normal((_B, _HKV, cap, d)).astype(np.float32)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    lo, hi = _ranges(cap)
    kw = dict(lo=jnp.asarray(lo), hi=jnp.asarray(hi))
    if lam:
        kw["lam_q"], kw["lam_k"] = _lambda_pairs(rng, grp, cap)
    if valid_nt is not None:
        valid = rng.random((_B, valid_nt, cap)) > 0.3
        if valid_nt > 1:
            valid[1, 2] = False  # a non-empty range with no valid slot: output 0
        kw["valid"] = jnp.asarray(valid)
    return q, k, v, kw


def _lambda_pairs(rng, grp: int, cap: int, b: int = _B, hkv: int = _HKV):
    """Λ pairs at |Λ| ≈ 600 (float32 spacing 6e-5 there): hi = float32 value, lo = a residual up to half
    a spacing, so the decay (Λq_hi − Λk_hi) + (Λq_lo − Λk_lo) needs both parts. Decays of the keys
    spread over [−4, 0] so many keys matter."""
    half_ulp = float(np.spacing(np.float32(600.0))) / 2
    q_true = -600.0 + rng.uniform(-0.5, 0.5, (b, hkv, grp))
    k_true = q_true[..., None] + rng.uniform(0.0, 4.0, (b, hkv, grp, cap))
    pair = lambda x: (x.astype(np.float32), (x - x.astype(np.float32).astype(np.float64)).astype(np.float32))  # noqa: E731
    qh, ql = pair(q_true + rng.uniform(-half_ulp, half_ulp, q_true.shape))
    kh, kl = pair(k_true + rng.uniform(-half_ulp, half_ulp, k_true.shape))
    return (jnp.asarray(qh), jnp.asarray(ql)), (jnp.asarray(kh), jnp.asarray(kl))


def _tol(dtype) -> float:
    return 2e-6 if dtype == jnp.float32 else 1e-2


def _err(o, ref) -> float:
    o, ref = np.asarray(o, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(o - ref)) / max(1.0, np.max(np.abs(ref))))


@functools.lru_cache(maxsize=None)
def _jitted(implementation: str, block_k, num_splits):
    return jax.jit(functools.partial(decode_attention, implementation=implementation, block_k=block_k,
                                     num_splits=num_splits))


# cap, G, D, dtype, Λ pairs, valid nt, splits (None: the interpret default, 1)
_CASES = [
    pytest.param(80, 1, 64, jnp.float32, True, None, None, id="G1-D64-f32-lam-C80"),
    pytest.param(48, 2, 48, jnp.float32, False, 1, 3, id="G2-D48-f32-valid1-3splits"),
    pytest.param(80, 4, 96, jnp.bfloat16, True, 3, 2, id="G4-D96-bf16-lam-validHkv-2splits"),
    pytest.param(64, 6, 64, jnp.bfloat16, True, None, 4, id="G6-D64-bf16-lam-4splits"),
    pytest.param(96, 4, 64, jnp.float32, True, 3, 5, id="G4-D64-f32-lam-validHkv-5splits"),
]


@pytest.mark.parametrize("cap,grp,d,dtype,lam,valid_nt,splits", _CASES)
def test_matches_reference(cap, grp, d, dtype, lam, valid_nt, splits):
    q, k, v, kw = _inputs(cap, grp, d, dtype, lam, valid_nt, seed=cap + grp + d)
    ref = decode_attention_reference(q, k, v, **kw)
    assert float(jnp.max(jnp.abs(ref[0, 0]))) == 0.0  # the empty range
    if valid_nt == _HKV:
        assert float(jnp.max(jnp.abs(ref[1, 2]))) == 0.0  # a range with no valid slot
    for impl in ("xla", "pallas"):
        o = _jitted(impl, None, splits)(q, k, v, **kw)
        assert o.shape == q.shape and o.dtype == q.dtype, impl
        err = _err(o, ref)
        assert err <= _tol(dtype), f"{impl}: max error {err:.2e} > {_tol(dtype):.0e}"
        np.testing.assert_array_equal(np.asarray(o[0, 0], np.float32), 0.0)  # exactly 0, never NaN


def test_narrow_range_forms():
    """lo / hi as [B, 1] (one range per row, as a ring's shared start) or scalars (as a decode step's length + 1) give
    what their broadcast [B, Hkv] gives, in every implementation (the kernel reads them without a broadcast copy);
    a start past hi (the kernel clamps it) is an empty range. Wrong forms name the argument."""
    q, k, v, kw = _inputs(64, 2, 32, jnp.float32, True, None, seed=3)
    lo = jnp.asarray([[70], [200]], jnp.int32)  # row 1 starts past hi: nothing to read
    hi = jnp.int32(120)
    full = dict(kw, lo=jnp.broadcast_to(lo, (_B, _HKV)), hi=jnp.minimum(jnp.full((_B, _HKV), hi), 120))
    ref = decode_attention_reference(q, k, v, **dict(full, lo=jnp.minimum(full["lo"], full["hi"])))
    assert float(jnp.max(jnp.abs(ref[1]))) == 0.0
    for impl in ("xla", "pallas"):
        o = _jitted(impl, None, 2)(q, k, v, **dict(kw, lo=jnp.minimum(lo, hi), hi=hi))
        assert _err(o, ref) <= _tol(jnp.float32), impl
    o = _jitted("pallas", None, 2)(q, k, v, **dict(kw, lo=lo, hi=hi))  # unclamped start: the kernel clamps
    assert _err(o, ref) <= _tol(jnp.float32)
    with pytest.raises(ValueError, match=r"lo must be an int array \[B, Hkv\] = \[2, 3\], \[B, 1\]"):
        decode_attention(q, k, v, **dict(kw, lo=jnp.zeros((_B,), jnp.int32), hi=hi))


# cap, G, D, dtype, Λ pairs, splits, per-row hi
_APPEND_CASES = [
    pytest.param(64, 1, 64, jnp.float32, True, 1, False, id="G1-f32-lam-1split"),
    pytest.param(80, 4, 32, jnp.bfloat16, True, 3, False, id="G4-bf16-lam-3splits"),
    pytest.param(48, 2, 48, jnp.float32, False, 2, True, id="G2-D48-f32-perrow-hi-2splits"),
]


@pytest.mark.parametrize("cap,grp,d,dtype,lam,splits,per_row", _APPEND_CASES)
def test_append_writes_then_reads(cap, grp, d, dtype, lam, splits, per_row):
    """``decode_attention_append``: the Pallas kernel (the step's entry from registers, written to the aliased
    ring by one program per row and head) gives the oracle's output for "write the entry at slot (hi − 1) mod C,
    then read [lo, hi)", and exactly the written ring (every other slot untouched), for ranges that wrap, start
    inside a block, fill the ring, or hold only the new key; the XLA path equals the oracle too."""
    rng = np.random.default_rng(cap + grp)
    q, k, v, kw = _inputs(cap, grp, d, dtype, lam, None, seed=cap + d)
    hi = jnp.asarray([[3 * cap + 5], [cap + 40]], jnp.int32) if per_row else jnp.int32(2 * cap + 21)
    hi_full = jnp.broadcast_to(hi, (_B, _HKV))
    n = np.array([[cap, 1, 17], [cap - 3, 40, 2]])  # full ring | only the new key | ... (≤ C keys)
    lo = hi_full - jnp.asarray(n, jnp.int32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((_B, _HKV, d)), dtype) for _ in range(2))
    extra = {}
    if lam:
        lq = kw["lam_q"]
        extra = dict(lam_q=lq, lam_k=kw["lam_k"], lam_new=lq)  # the step's Λ is its query's
    written_k, written_v = write_entry(k, k_new, hi, 2), write_entry(v, v_new, hi, 2)
    written_lam = tuple(write_entry(x, y, hi, 3) for x, y in zip(kw["lam_k"], extra["lam_new"])) if lam else None
    ref = decode_attention_reference(q, written_k, written_v, lo=lo, hi=hi_full, lam_q=extra.get("lam_q"),
                                     lam_k=written_lam)
    for impl in ("xla", "pallas"):
        o, k2, v2, lam2, *_ = jax.jit(functools.partial(decode_attention_append, implementation=impl, num_splits=splits))(
            q, k, v, k_new, v_new, lo=lo, hi=hi, **extra)
        assert _err(o, ref) <= _tol(dtype), impl
        np.testing.assert_array_equal(np.asarray(k2, np.float32), np.asarray(written_k, np.float32), err_msg=impl)
        np.testing.assert_array_equal(np.asarray(v2, np.float32), np.asarray(written_v, np.float32), err_msg=impl)
        if lam:
            for a, b_ in zip(lam2, written_lam):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b_), err_msg=impl)
        else:
            assert lam2 is None
    with pytest.raises(ValueError, match=r"k_new must be"):
        decode_attention_append(q, k, v, k_new[:, :1], v_new, lo=lo, hi=hi, **extra)


def test_lambda_pairs_matter():
    """The float32 tolerance sees the low parts of the Λ pairs: an op given Λ without them is off by
    more than 5× the tolerance, so a path that dropped them would fail ``test_matches_reference``."""
    q, k, v, kw = _inputs(80, 1, 64, jnp.float32, True, None)
    ref = decode_attention_reference(q, k, v, **kw)
    hi_only = dict(kw, lam_q=(kw["lam_q"][0], jnp.zeros_like(kw["lam_q"][1])),
                   lam_k=(kw["lam_k"][0], jnp.zeros_like(kw["lam_k"][1])))
    assert _err(_jitted("xla", None, None)(q, k, v, **hi_only), ref) > 5 * _tol(jnp.float32)


def test_visible_slots_and_reference_agree_on_the_ring():
    """``visible_slots`` (the XLA path's physical mask) and the oracle's logical gather count the same
    keys for every range of ``_ranges`` (including hi − lo = C and the empty range)."""
    lo, hi = _ranges(48)
    vis = np.asarray(visible_slots(jnp.asarray(lo), jnp.asarray(hi), 48))
    np.testing.assert_array_equal(vis.sum(-1), hi - lo)
    c = np.arange(48)
    for b in range(_B):
        for h in range(_HKV):
            np.testing.assert_array_equal(np.flatnonzero(vis[b, h]), np.sort(np.arange(lo[b, h], hi[b, h]) % 48))
    assert not vis[0, 0].any() and vis[0, 1].all() and c[vis[1, 0]].tolist() == [*range(6), *range(43, 48)]


def test_auto_and_errors():
    q, k, v, kw = _inputs(48, 2, 32, jnp.float32, False, None)
    if jax.default_backend() != "gpu":
        assert resolve_decode_implementation("auto", q, k) == "xla"
        with pytest.raises(NotImplementedError, match="implementation='cudnn' needs a GPU"):
            decode_attention(q, k, v, implementation="cudnn", **kw)
    bad = [
        (dict(q=q[0]), "q must be"),
        (dict(k=k[:, :2]), "k must be"),
        (dict(v=v.astype(jnp.bfloat16)), "v must have q's dtype"),
        (dict(lo=kw["lo"][:, :2]), "lo must be an int array"),
        (dict(hi=kw["hi"].astype(jnp.float32)), "hi must be an int array"),
        (dict(lo=kw["lo"] - 100), "lo must be ≥ 0"),
        (dict(hi=kw["lo"] + 49), r"hi − lo must lie in \[0, C = 48\]"),
        (dict(valid=jnp.ones((_B, 2, 48), bool)), "valid must be bool"),
        (dict(valid=jnp.ones((_B, 1, 48), jnp.int32)), "valid must be bool"),
        (dict(lam_q=(jnp.zeros((_B, _HKV, 2)),) * 2), "lam_q and lam_k go together"),
        (dict(lam_q=(jnp.zeros((_B, _HKV, 2)),) * 2, lam_k=(jnp.zeros((_B, _HKV, 2, 47)),) * 2),
         r"lam_k \(hi\) must be float32"),
        (dict(implementation="triton"), "implementation must be one of"),
        (dict(implementation="pallas", block_k=32), "block_k must be a power of two ≥ 16 dividing C = 48"),
        (dict(implementation="pallas", num_splits=0), "num_splits must be an int ≥ 1"),
    ]
    for override, msg in bad:
        args = dict(q=q, k=k, v=v, **kw)
        args.update(override)
        with pytest.raises(ValueError, match=msg):
            decode_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_head_dim_chunks_and_config():
    assert dk.head_dim_chunks(96) == ((0, 64), (64, 32))
    assert dk.head_dim_chunks(48) == ((0, 32), (32, 16))
    assert dk.head_dim_chunks(128) == ((0, 128),)
    assert dk.head_dim_chunks(112) == ((0, 64), (64, 32), (96, 16))
    assert dk.largest_block_k(8320, 128) == 128 and dk.largest_block_k(8320, 256) == 128
    assert dk.largest_block_k(80, 64) == 16 and dk.largest_block_k(40, 64) is None
    with pytest.raises(ValueError, match="multiple of 16"):
        dk.default_decode_config(8, 40)
    gpu = dk.default_decode_config(8 * 12, 8320)  # FoX 125M, B8: ≈ 3 programs per SM (the H200 sweep's best)
    assert gpu == dk.DecodeConfig(64, 4, 4, 3)
    assert dk.default_decode_config(32 * 12, 1024).num_splits == 1
    # float32 K/V at D = 128 in 128-key blocks: 3 stages would ask for ~300 KB of shared memory (failed on the
    # H200); fewer stages fit
    big = dk.default_decode_config(8, 4096, block_k=128, head_dim=128, itemsize=4)
    assert big.num_stages < 3 and dk.shared_bytes(big, 128, 4) <= dk.SHARED_LIMIT
    assert dk.default_decode_config(4, 48, interpret=True) == dk.DecodeConfig(16, 1)
    # the cache policies (jax-free) size sink slots by the kernel's smallest block: the two constants agree
    assert PIN_BLOCK == dk.MIN_BLOCK and RING_BLOCK % dk.MIN_BLOCK == 0


def _floor_case(rng, cap, grp, lo, hi):
    """Λ pairs at |Λ| ≈ 600 whose decay falls with the key's age at a rate per query head (logical key j of the
    ring [lo, hi) lives in slot j mod C), and the floors that hide the oldest part of each range for every head
    of its group; one key in the middle of row 1, head 0 decays below every floor (a hidden key that is not at
    the front: the keys before it leave with it). [B, Hkv] = [2, 3]. Returns (lam_q, lam_k, decay_floor)."""
    b, hkv = lo.shape
    rate = rng.uniform(0.05, 0.2, (b, hkv, grp))
    age = np.zeros((b, hkv, cap))
    for r in range(b):
        for h in range(hkv):
            for j in range(max(hi[r, h] - cap, 0), hi[r, h]):
                age[r, h, j % cap] = hi[r, h] - 1 - j
    q_true = -600.0 + rng.uniform(-0.5, 0.5, (b, hkv, grp))
    k_true = q_true[..., None] + rate[..., None] * age[:, :, None, :]
    mid = (lo[1, 0] + hi[1, 0]) // 2
    k_true[1, 0, :, mid % cap] += 50.0
    split = lambda x: (jnp.asarray(x, jnp.float32), jnp.asarray(x - x.astype(np.float32), jnp.float32))  # noqa: E731
    # hides the keys older than m steps (for every head of the group): row 0, head 2 only its two oldest keys (all
    # in the range's first block)
    m = np.array([[5.5, 3.5, (hi[0, 2] - lo[0, 2]) - 2.5], [6.5, 20.5, 4.5]])[:b, :hkv]
    return split(q_true), split(k_true), jnp.asarray(-rate * m[..., None], jnp.float32)


def _first_oracle(lam_q, lam_k, floor, lo, hi):
    """max(lo, 1 + the last key of [lo, hi) below the floor for every head of its group), the decay in the kernel's
    float32 form, by loops."""
    qh, ql, kh, kl = (np.asarray(x) for x in (*lam_q, *lam_k))
    cap = kh.shape[-1]
    first = np.array(lo, np.int64)
    for r, h in np.ndindex(*lo.shape):
        for j in range(lo[r, h], hi[r, h]):
            c = j % cap
            decay = (qh[r, h] - kh[r, h, :, c]) + (ql[r, h] - kl[r, h, :, c])
            if np.all(decay < np.asarray(floor)[r, h]):
                first[r, h] = j + 1
    return first


@pytest.mark.parametrize("grp,dtype,splits,fold", [(1, jnp.float32, 1, True), (1, jnp.float32, 1, False),
                                                   (4, jnp.bfloat16, 1, True), (4, jnp.bfloat16, 3, True),
                                                   (2, jnp.float32, 2, True)])
def test_append_decay_floor(grp, dtype, splits, fold, monkeypatch):
    """``decode_attention_append(..., decay_floor=δ)`` (ACP's eviction in the decode op): the first visible key
    equals the loop oracle (the last key below δ for every query head of the group, plus one — a hidden key in
    the middle takes the older keys with it), exactly, in the Pallas kernel (interpret) and the XLA path, for
    ranges that wrap, hold C keys before the new one (the ring's start before its eviction: the oldest key is
    tested, then its slot takes the new key) or only the new key; the output is the oracle's read of
    [max(first, hi − C), hi) after the write, the ring is written exactly; δ = −inf hides nothing (and a full ring
    then drops its oldest key). With one split the kernel folds the floor's pass into the attention loop (blocks
    newest first; ``DecodeConfig.fold_floor``), and also runs it as a pass of its own (``fold``: False); several
    splits always make the pass. Bad floors name the argument."""
    config = dk.default_decode_config
    monkeypatch.setattr(dk, "default_decode_config",
                        lambda *a, **kw: dataclasses.replace(config(*a, **kw), fold_floor=fold))
    cap, d = 80, 32
    rng = np.random.default_rng(grp)
    q, k, v, _ = _inputs(cap, grp, d, dtype, False, None, seed=grp)
    hi = jnp.int32(2 * cap + 21)
    n = np.array([[cap + 1, 1, 30], [cap - 3, 45, cap + 1]])  # C keys + the new one | only the new key | ...
    lo = np.int32(hi) - n
    lam_q, lam_k, floor = _floor_case(rng, cap, grp, lo, np.full_like(lo, int(hi) - 1))
    k_new, v_new = (jnp.asarray(rng.standard_normal((_B, _HKV, d)), dtype) for _ in range(2))
    first = _first_oracle(lam_q, lam_k, floor, lo, np.full_like(lo, int(hi) - 1))
    assert (first > lo).sum() >= 3 and first[1, 0] > (lo[1, 0] + int(hi)) // 2  # the case hides keys, mid-ring too
    assert first[0, 2] == lo[0, 2] + 2
    written_k, written_v = write_entry(k, k_new, hi, 2), write_entry(v, v_new, hi, 2)
    written_lam = tuple(write_entry(x, y, hi, 3) for x, y in zip(lam_k, lam_q))
    read = lambda start: decode_attention_reference(  # noqa: E731
        q, written_k, written_v, lo=jnp.asarray(np.maximum(start, int(hi) - cap), jnp.int32),
        hi=jnp.full((_B, _HKV), hi), lam_q=lam_q, lam_k=written_lam)
    ref, ref_none = read(first), read(lo)
    call = dict(lo=jnp.asarray(lo), hi=hi, lam_q=lam_q, lam_k=lam_k, lam_new=lam_q)
    for impl in ("xla", "pallas"):
        f = jax.jit(functools.partial(decode_attention_append, implementation=impl, num_splits=splits))
        o, k2, v2, lam2, got, *_ = f(q, k, v, k_new, v_new, decay_floor=floor, **call)
        np.testing.assert_array_equal(np.asarray(got), first, err_msg=impl)
        assert _err(o, ref) <= _tol(dtype), impl
        np.testing.assert_array_equal(np.asarray(k2, np.float32), np.asarray(written_k, np.float32), err_msg=impl)
        for a, b_ in zip(lam2, written_lam):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b_), err_msg=impl)
        res = f(q, k, v, k_new, v_new, decay_floor=jnp.full_like(floor, -jnp.inf), **call)
        o_none, none_hidden = res.o, res.first
        np.testing.assert_array_equal(np.asarray(none_hidden), lo, err_msg=impl)
        assert _err(o_none, ref_none) <= _tol(dtype), impl
    # eagerly (concrete bounds are checked): C + 1 keys with the new one are allowed with a floor, not without
    eager = decode_attention_append(q, k, v, k_new, v_new, decay_floor=floor, implementation="xla", **call).first
    np.testing.assert_array_equal(np.asarray(eager), first)
    with pytest.raises(ValueError, match=r"hi − lo must lie in \[0, C = 80\]"):
        decode_attention_append(q, k, v, k_new, v_new, implementation="xla", **call)
    with pytest.raises(ValueError, match=r"decay_floor must be float32\[2, 3, " + str(grp) + r"\]"):
        decode_attention_append(q, k, v, k_new, v_new, decay_floor=floor[..., :1, :1].astype(jnp.float32)
                                if grp > 1 else floor[:, :1], **call)
    with pytest.raises(ValueError, match=r"decay_floor needs lam_q / lam_k"):
        decode_attention_append(q, k, v, k_new, v_new, lo=jnp.asarray(lo), hi=hi, decay_floor=floor)


@pytest.mark.parametrize("splits,late", [(1, True), (2, True), (1, False)])
def test_append_advances_the_ring_tables(splits, late, monkeypatch):
    """``decode_attention_append(..., ring_tables=(start, peak, overflow))``: ``lo`` is the rule's first visible column
    and the op reads from max(lo, start, hi − C), or with a decay floor from the first key above it from the ring's
    start; the tables advance to start' = the read start, peak' = max(peak, hi − start'), overflow' = overflow +
    (start' − what the policy kept) — per row (nt = 1: a window's rule, a dense ring that overflows, a start ahead of
    the rule) and per key/value head (acp's floor, a full ring whose oldest key overflows); the Pallas kernel (in
    place; its writes after the attention loop, ``DecodeConfig.late_writes``, or before it) and the XLA path equal this
    loop oracle exactly, and the output the dense read of the kept range."""
    config = dk.default_decode_config
    monkeypatch.setattr(dk, "default_decode_config",
                        lambda *a, **kw: dataclasses.replace(config(*a, **kw), late_writes=late))
    cap, d, grp = 80, 32, 2
    rng = np.random.default_rng(7)
    q, k, v, _ = _inputs(cap, grp, d, jnp.float32, False, None, seed=7)
    k_new, v_new = (jnp.asarray(rng.standard_normal((_B, _HKV, d)), jnp.float32) for _ in range(2))
    hi = 2 * cap + 21
    written = lambda buf, x, axis=2: write_entry(buf, x, jnp.int32(hi), axis)  # noqa: E731
    read = lambda start, lam_q=None, lam_k=None: decode_attention_reference(  # noqa: E731
        q, written(k, k_new), written(v, v_new), lo=jnp.asarray(start, jnp.int32), hi=jnp.full((_B, _HKV), hi, jnp.int32),
        lam_q=lam_q, lam_k=None if lam_k is None else tuple(written(x, y, 3) for x, y in zip(lam_k, lam_q)))
    # per row: a window of 30 (row 0's start behind it), row 1's start ahead of it; then "dense" (lo very negative):
    # row 0's start keeps more than C columns (overflow), row 1's start is inside the ring
    for lo, start in ((jnp.int32(hi - 30), np.array([[hi - 60], [hi - 12]])),
                      (jnp.int32(-(2 ** 30)), np.array([[hi - cap - 9], [hi - 40]]))):
        peak, overflow = np.array([[7], [70]]), np.array([[3], [0]])
        wanted = np.maximum(np.maximum(np.asarray(lo), 0), start)
        new_start = np.maximum(wanted, hi - cap)
        tables = (new_start, np.maximum(peak, hi - new_start), overflow + new_start - wanted)
        ref = read(np.broadcast_to(new_start, (_B, _HKV)))
        for impl in ("xla", "pallas"):
            res = jax.jit(functools.partial(decode_attention_append, implementation=impl, num_splits=splits))(
                q, k, v, k_new, v_new, lo=lo, hi=jnp.int32(hi),
                ring_tables=tuple(jnp.asarray(x, jnp.int32) for x in (start, peak, overflow)))
            for got, want in zip(res.tables, tables):
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=impl)
            assert _err(res.o, ref) <= _tol(jnp.float32), impl
    # per key/value head, with acp's floor: the ring's start is the only bound (lo = 0)
    n = np.array([[cap + 1, 1, 30], [cap - 3, 45, cap + 1]])
    start = hi - n
    lam_q, lam_k, floor = _floor_case(rng, cap, grp, start, np.full_like(start, hi - 1))
    floor = floor.at[0, 0].set(-jnp.inf)  # row 0, head 0: C keys before the new one, none hidden
    first = _first_oracle(lam_q, lam_k, floor, start, np.full_like(start, hi - 1))
    new_start = np.maximum(first, hi - cap)
    peak, overflow = rng.integers(0, 90, (2, _B, _HKV))
    tables = (new_start, np.maximum(peak, hi - new_start), overflow + new_start - first)
    assert (new_start > first).any()  # a full ring whose oldest key the floor kept: it overflows
    ref = read(new_start, lam_q, lam_k)
    for impl in ("xla", "pallas"):
        res = jax.jit(functools.partial(decode_attention_append, implementation=impl, num_splits=splits))(
            q, k, v, k_new, v_new, lo=jnp.int32(0), hi=jnp.int32(hi), lam_q=lam_q, lam_k=lam_k, lam_new=lam_q,
            decay_floor=floor, ring_tables=tuple(jnp.asarray(x, jnp.int32) for x in (start, peak, overflow)))
        np.testing.assert_array_equal(np.asarray(res.first), first, err_msg=impl)
        for got, want in zip(res.tables, tables):
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=impl)
        assert _err(res.o, ref) <= _tol(jnp.float32), impl
    with pytest.raises(ValueError, match=r"ring_tables \(peak\) must be int32 \[2, 1\] or \[2, 3\]"):
        decode_attention_append(q, k, v, k_new, v_new, lo=jnp.int32(0), hi=jnp.int32(hi),
                                ring_tables=(jnp.zeros((_B, 1), jnp.int32), jnp.zeros((_B,), jnp.int32),
                                             jnp.zeros((_B, 1), jnp.int32)))


@pytest.mark.parametrize("grp,dtype,lam,splits", [(1, jnp.float32, True, 1), (2, jnp.float32, False, 2),
                                                  (4, jnp.bfloat16, True, 1)])
def test_append_pinned_slots(grp, dtype, lam, splits):
    """``decode_attention_append(..., pinned=PinnedSlots(S, P, seq_start))`` (``sinks:S+W``): the ring is slots
    [P, C) (column c in slot P + c mod (C − P)) and slots [0, P) hold each row's first S positions. Against a numpy
    oracle of the rule (the written buffers, the slots a step reads, the advanced tables), at three steps: row 1
    (seq_start 3) writing a pinned position while row 0 (seq_start 0) writes its first ring-only one, row 0 on a
    left pad (hi − 1 < seq_start: nothing pinned nor visible but the ring's start), and a wrapped ring long after,
    with per-row tables and a window rule. The Pallas kernel (P read as one 16-slot block, the ring's blocks behind
    it) and the XLA path equal the oracle: buffers exactly, outputs at ``_tol``; stale pinned slots beyond the
    positions written are never read (they hold random values)."""
    sinks, pin, ring, d, window = 5, 16, 48, 32, 40
    cap = pin + ring
    rng = np.random.default_rng(grp)
    q, k, v, kw = _inputs(cap, grp, d, dtype, lam, None, seed=11 + grp)
    seq = np.array([0, 3], np.int32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((_B, _HKV, d)), dtype) for _ in range(2))
    lam_kw = dict(lam_q=kw["lam_q"], lam_k=kw["lam_k"], lam_new=kw["lam_q"]) if lam else {}
    for hi in (7, 3, 5 * ring + 9):
        start = seq[:, None] + sinks                     # the ring's start: never a pinned position
        peak, overflow = rng.integers(0, 3, (_B, 1)), rng.integers(0, 60, (_B, 1))  # peak' from this step's count
        lo_rule = hi - window
        # the oracle: the writes, the tables, then the slots read
        pos = hi - 1 - seq                                                                          # [B]
        bufs = [np.array(x, np.float32) for x in (k, v)]
        lams = [np.array(x) for x in kw["lam_k"]] if lam else []
        ring_slot = pin + (hi - 1) % ring
        for r in range(_B):
            slots_r = [ring_slot] + ([pos[r]] if 0 <= pos[r] < sinks else [])
            for sl in slots_r:
                for buf, new in zip(bufs, (k_new, v_new)):
                    buf[r, :, sl] = np.asarray(new, np.float32)[r]
                for lbuf, new in zip(lams, kw["lam_q"] if lam else ()):
                    lbuf[r, :, :, sl] = np.asarray(new)[r]
        wanted = np.maximum(np.maximum(lo_rule, 0), start)
        new_start = np.maximum(wanted, hi - ring)
        held = np.clip(hi - seq, 0, sinks)[:, None]
        tables = (new_start, np.maximum(peak, np.maximum(hi - new_start, 0) + held), overflow + new_start - wanted)
        slot = np.arange(cap)
        col = hi - 1 - (hi - 1 - (slot - pin)) % ring
        valid = ((slot >= pin) & (col >= new_start) & (col < hi)) | (slot < held)                 # [B, C]
        assert valid[:, :pin].any() and (hi == 3 or valid[:, pin:].any())
        ref = decode_attention_reference(
            q, jnp.asarray(bufs[0], dtype), jnp.asarray(bufs[1], dtype), lo=jnp.zeros((_B, _HKV), jnp.int32),
            hi=jnp.full((_B, _HKV), cap, jnp.int32), valid=jnp.asarray(valid[:, None]),
            lam_q=kw["lam_q"] if lam else None, lam_k=tuple(jnp.asarray(x) for x in lams) if lam else None)
        for impl in ("xla", "pallas"):
            res = jax.jit(functools.partial(decode_attention_append, implementation=impl, num_splits=splits))(
                q, k, v, k_new, v_new, lo=jnp.int32(lo_rule), hi=jnp.int32(hi), **lam_kw,
                ring_tables=tuple(jnp.asarray(x, jnp.int32) for x in (start, peak, overflow)),
                pinned=PinnedSlots(sinks, pin, jnp.asarray(seq)))
            msg = f"{impl} hi={hi}"
            assert _err(res.o, ref) <= _tol(dtype), msg
            for got, want in zip((res.k, res.v), bufs):
                np.testing.assert_array_equal(np.asarray(got, np.float32), want, err_msg=msg)
            for got, want in zip(res.lam_k or (), lams):
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=msg)
            for got, want in zip(res.tables, tables):
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=msg)
    with pytest.raises(ValueError, match=r"pinned.sinks S and pinned.slots P must be ints"):
        decode_attention_append(q, k, v, k_new, v_new, lo=jnp.int32(0), hi=jnp.int32(9),
                                pinned=PinnedSlots(sinks, cap, jnp.asarray(seq)))
    with pytest.raises(ValueError, match=r"pinned.seq_start must be an int array \[B\] = \[2\]"):
        decode_attention_append(q, k, v, k_new, v_new, lo=jnp.int32(0), hi=jnp.int32(9),
                                pinned=PinnedSlots(sinks, pin, jnp.zeros((3,), jnp.int32)))


def _step_case(grp, d, dtype, shared_k_scale: bool, seed: int, b: int = _B, hkv: int = _HKV, d_in: int = 48):
    """A decode step handed over raw (``DecodeStep``): the GEMM-shaped rows (q, k, v, output gate logits), the shift
    and forget-gate projections (x [B, 1, d_in] and their weights; the logits from them in XLA), the carries and the norm scales, for B rows and Hkv key/value heads."""
    from fox_jax.ops.head_ops import HeadOps

    rng = np.random.default_rng(seed)
    h = hkv * grp
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    rows = normal(b, 1, 2 * h + 2 * hkv + 1, d).astype(dtype)  # one row more than read: ignored
    weights = tuple((normal(d_in, n) / np.sqrt(d_in), bias) for n, bias in  # logits of order 1
                    ((hkv, None), (hkv, None), (h, normal(h))))
    scale = lambda *shape: 1.0 + 0.3 * normal(*shape)  # noqa: E731
    ops = HeadOps(q_scale=scale(h, d), k_scale=scale(d) if shared_k_scale else scale(hkv, d), o_scale=scale(h, d),
                  o_gate=rows[:, :, h + 2 * hkv:2 * h + 2 * hkv], rows=rows, gate_x=normal(b, 1, d_in).astype(dtype),
                  gate_weights=weights, o_eps=1e-6)
    logits = ops.gate_logits(3)
    ops = ops.replace(k_shift=logits[..., :hkv], v_shift=logits[..., hkv:2 * hkv])
    log_fgate = jax.nn.log_sigmoid(logits[:, 0, 2 * hkv:]).reshape(b, hkv, grp)
    lam_prev = _lambda_pairs(rng, grp, 16, b, hkv)[0]
    shift_state = normal(b, 2, hkv, d).astype(dtype)
    q = rows[:, 0, :h].reshape(b, hkv, grp, d)
    k_new, v_new = rows[:, 0, h:h + hkv], rows[:, 0, h + hkv:h + 2 * hkv]
    return ops, q, k_new, v_new, shift_state, log_fgate, lam_prev


@pytest.mark.parametrize("grp,d,dtype,splits,shared,pos0,d_in,late", [(1, 32, jnp.float32, 1, False, 0, 48, True),
                                                                      (4, 48, jnp.bfloat16, 1, True, 0, 40, True),
                                                                      (2, 32, jnp.float32, 3, False, -2, 64, True),
                                                                      (1, 32, jnp.float32, 1, False, 0, 48, False)])
def test_append_step_does_the_layers_work(grp, d, dtype, splits, shared, pos0, d_in, late, monkeypatch):
    """``decode_attention_append(..., step=DecodeStep)``: the raw projections in (the decode GEMM's rows, read in
    place by the kernel, or packed by the op; the gate logits computed by the kernel from their projections, by XLA
    where d_in is not a multiple of 16, or packed by the op), the layer's per-head work done by the op — KV-shift from the carry
    (zeros at position 0 and on a left pad), QK-norm, Λ = Λ_prev + log σ(logit) as pairs (no gate on a pad),
    attention over the ring with the entry,
    output norm and gate (after the combine with several splits) — equals ``head_prologue``, the oracle and
    ``head_epilogue`` in XLA, and writes the ring, the shift carry (the step's raw k, v) and Λ. Tolerances: the
    outputs twice ``_tol`` (after the attention the output norm and gate round to the dtype three times: in bf16
    2–3 ulps of 2⁻⁸ more); the carried raw k, v exactly; Λ to 1e-6 (log σ in the kernel vs XLA: an ulp of the gate);
    the ring's k, v entries to an ulp of their dtype (the norm's rsqrt). ``late``: the kernel's carries written after
    its attention loop and the epilogue's operands loaded up front (the defaults), or neither."""
    from fox_jax.ops.decode_attention import DecodeStep
    from fox_jax.ops.head_ops import head_epilogue, head_prologue

    config = dk.default_decode_config
    monkeypatch.setattr(dk, "default_decode_config", lambda *a, **kw: dataclasses.replace(
        config(*a, **kw), late_writes=late, early_epilogue=late))

    cap = 80
    ops, q, k_new, v_new, shift_state, log_fgate, lam_prev = _step_case(grp, d, dtype, shared, seed=grp + d,
                                                                        d_in=d_in)
    _, k, v, kw = _inputs(cap, grp, d, dtype, True, None, seed=grp)
    lam_k = kw["lam_k"]
    hi = jnp.int32(2 * cap + 21)
    pos = np.array([pos0, 40])  # row 0 at position 0, or a left pad (−2); row 1 at 40
    seq_start = jnp.asarray(int(hi) - 1 - pos, jnp.int32)
    lo = jnp.asarray(np.int32(hi) - np.array([[cap, 1, 17], [cap - 3, 40, 2]]), jnp.int32)
    # the oracle: the layer's work in XLA, the dense read of the written ring, the epilogue
    h = _HKV * grp
    keep = jnp.asarray(pos > 0)[:, None, None]  # the shift sees zeros at position 0 and on a pad
    state = (jnp.where(keep, shift_state[:, 0], 0), jnp.where(keep, shift_state[:, 1], 0))
    qp, kp, vp, _ = head_prologue(ops, q.reshape(_B, 1, h, d), k_new[:, None], v_new[:, None], state=state)
    qp, kp, vp = qp.reshape(q.shape), kp[:, 0], vp[:, 0]
    gate = jnp.where(jnp.asarray(pos >= 0)[:, None, None], log_fgate, 0.0)  # a pad adds no gate
    lam_now = dk.pair_add(lam_prev, (gate, jnp.zeros_like(gate)))
    ring_k, ring_v = write_entry(k, kp, hi, 2), write_entry(v, vp, hi, 2)
    ring_lam = tuple(write_entry(x, y, hi, 3) for x, y in zip(lam_k, lam_now))
    ref = decode_attention_reference(qp, ring_k, ring_v, lo=lo, hi=jnp.broadcast_to(hi, lo.shape), lam_q=lam_now,
                                     lam_k=ring_lam)
    ref = head_epilogue(ops, ref.reshape(_B, 1, h, d)).reshape(q.shape)
    ulp = 1e-6 if dtype == jnp.float32 else 2 ** -7
    for impl, packed in (("xla", True), ("pallas", True), ("pallas", False)):
        step = DecodeStep(ops if packed else ops.replace(rows=None, gate_x=None, gate_weights=None), seq_start,
                          shift_state, log_fgate, lam_prev)
        f = jax.jit(functools.partial(decode_attention_append, implementation=impl, num_splits=splits))
        o, k2, v2, lam2, _, (shift2, lam_got), _ = f(q, k, v, k_new, v_new, lo=lo, hi=hi, lam_k=lam_k, step=step)
        what = f"{impl}, rows {'in place' if packed else 'packed by the op'}"
        assert o.dtype == q.dtype and _err(o, ref) <= 2 * _tol(dtype), (what, _err(o, ref))
        np.testing.assert_array_equal(np.asarray(shift2, np.float32),
                                      np.asarray(jnp.stack([k_new, v_new], 1), np.float32), err_msg=what)
        got = np.asarray(lam_got[0], np.float64) + np.asarray(lam_got[1], np.float64)
        want = np.asarray(lam_now[0], np.float64) + np.asarray(lam_now[1], np.float64)
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0, err_msg=what)
        for a, b_ in ((k2, ring_k), (v2, ring_v)):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b_, np.float32), atol=4 * ulp,
                                       rtol=2 * ulp, err_msg=what)
        for a, b_ in zip(lam2, ring_lam):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=1e-6, rtol=0, err_msg=what)
    with pytest.raises(ValueError, match=r"with step.log_fgate, lam_q and lam_new must be None"):
        decode_attention_append(q, k, v, k_new, v_new, lo=lo, hi=hi, lam_k=lam_k, lam_q=lam_prev, lam_new=lam_prev,
                                step=DecodeStep(ops, seq_start, shift_state, log_fgate, lam_prev))
    with pytest.raises(ValueError, match=r"step.shift_state must be \[2, 2, 3, " + str(d) + r"\]"):
        decode_attention_append(q, k, v, k_new, v_new, lo=lo, hi=hi, lam_k=lam_k,
                                step=DecodeStep(ops, seq_start, None, log_fgate, lam_prev))


@pytest.mark.parametrize("grp,dtype,splits", [(1, jnp.float32, 1), (2, jnp.bfloat16, 1), (1, jnp.float32, 3)])
def test_append_step_with_the_norm_folded(grp, dtype, splits):
    """``HeadOps.x_norm_eps``: the decode GEMM's rows and the gate projections' input are of the un-normalised x,
    with the input RMSNorm's scale s folded into the weights (W' = s ⊙ W); the kernel (interpret) scales the q, k, v
    and output gate rows and the gate sums by r = rsqrt(mean(x²) + eps), which it takes from the x it loads, and
    equals the same step handed over normalised (rows = r · raw rows, x̂ = r·x·s with the weights W): the output
    within twice ``_tol`` (in bf16 the raw rows are rounded once more: an ulp of 2⁻⁸ before the norms), the ring's
    entries and the carried raw k, v to two ulps of the dtype, Λ to 1e-5 in float32 (the gate sums in another order:
    r after the sum) and 5e-3 in bf16 (both steps' gate inputs, x and x̂, are rounded to bf16, 2⁻⁹ of each of a
    logit's 48 products, and Λ adds that step's log f). Without ``gate_x`` (nothing to take r from) the op refuses
    it in one line."""
    from fox_jax.ops.decode_attention import DecodeStep

    cap, d, d_in, eps = 80, 32, 48, 1e-5
    ops, q, k_new, v_new, shift_state, _, lam_prev = _step_case(grp, d, dtype, False, seed=11 + grp, d_in=d_in)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((_B, 1, d_in)) * 3.0, jnp.float32)  # the residual: not of unit RMS
    s = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d_in), jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)                     # [B, 1, 1]
    raw = (ops.rows.astype(jnp.float32) / r[..., None]).astype(dtype)                   # the GEMM's rows on x
    rows = (raw.astype(jnp.float32) * r[..., None]).astype(dtype)                       # what the norm would give
    h = _HKV * grp
    normed = ops.replace(rows=rows, o_gate=rows[:, :, h + 2 * _HKV:2 * h + 2 * _HKV], gate_x=(x * r * s).astype(dtype))
    logits = normed.gate_logits(3)
    normed = normed.replace(k_shift=logits[..., :_HKV], v_shift=logits[..., _HKV:2 * _HKV])
    log_fgate = jax.nn.log_sigmoid(logits[:, 0, 2 * _HKV:]).reshape(_B, _HKV, grp)
    folded = normed.replace(rows=raw, gate_x=x.astype(dtype), x_norm_eps=eps,
                            gate_weights=tuple((s[:, None] * w, bias) for w, bias in normed.gate_weights))
    # the folded gate logits (XLA form) equal the normalised ones: in bf16 up to x̂'s rounding
    np.testing.assert_allclose(np.asarray(folded.gate_logits(3)), np.asarray(logits),
                               atol=1e-5 if dtype == jnp.float32 else 5e-2, rtol=0)
    q, k_new, v_new = (rows[:, 0, :h].reshape(_B, _HKV, grp, d), rows[:, 0, h:h + _HKV],
                       rows[:, 0, h + _HKV:h + 2 * _HKV])
    _, k, v, kw = _inputs(cap, grp, d, dtype, True, None, seed=grp)
    hi = jnp.int32(2 * cap + 21)
    seq_start = jnp.asarray(int(hi) - 1 - np.array([0, 40]), jnp.int32)
    lo = jnp.asarray(np.int32(hi) - np.array([[cap, 1, 17], [cap - 3, 40, 2]]), jnp.int32)
    f = jax.jit(functools.partial(decode_attention_append, implementation="pallas", num_splits=splits))
    run = lambda o: f(q, k, v, k_new, v_new, lo=lo, hi=hi, lam_k=kw["lam_k"],  # noqa: E731
                      step=DecodeStep(o, seq_start, shift_state, log_fgate, lam_prev))
    want, got = run(normed), run(folded)
    ulp = 1e-6 if dtype == jnp.float32 else 2 ** -7
    assert _err(got.o, want.o) <= 2 * _tol(dtype), _err(got.o, want.o)
    for a, b_ in ((got.k, want.k), (got.v, want.v), (got.carry[0], want.carry[0])):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b_, np.float32), atol=4 * ulp, rtol=2 * ulp)
    pair = lambda t: np.asarray(t[0], np.float64) + np.asarray(t[1], np.float64)  # noqa: E731
    np.testing.assert_allclose(pair(got.carry[1]), pair(want.carry[1]), atol=1e-5 if dtype == jnp.float32 else 5e-3,
                               rtol=0)
    with pytest.raises(ValueError, match=r"step.ops.x_norm_eps needs step.ops.rows and gate_x"):
        run(folded.replace(gate_x=None, gate_weights=None))


@pytest.mark.parametrize("grp,dtype,splits,n_out,group", [(1, jnp.float32, 1, 48, None), (2, jnp.bfloat16, 1, 32, None),
                                                         (2, jnp.float32, 3, 48, None), (1, jnp.float32, 1, 40, None),
                                                         (1, jnp.float32, 1, 48, (2, 0))])
def test_append_step_projects_the_output(grp, dtype, splits, n_out, group):
    """``HeadOps.o_proj`` (W_o [H, D, N] by query head): the fused step returns o·W_o as float32 shares [B, S, N]
    whose sum equals the unprojected step's output (after the output norm and gate) times W_o in float32 — the
    kernel (interpret) projecting each program's heads with one split (S = Hkv), XLA after the combine with 3 splits
    and where N is not a multiple of 16 (S = 1), and a head group (2 of the 3 kv heads: the layer's W_o rows of the
    group's heads). Tolerance: float32 2e-6 of the output scale (summation order); bf16 2⁻⁸ · 4 (the projection
    reads the output rounded to bf16 once, as the layer's GEMM, then sums D·G products in float32)."""
    from fox_jax.ops.decode_attention import DecodeStep

    cap, d = 80, 32
    ops, q, k_new, v_new, shift_state, log_fgate, lam_prev = _step_case(grp, d, dtype, False, seed=5 + grp, d_in=48)
    _, k, v, kw = _inputs(cap, grp, d, dtype, True, None, seed=grp)
    lam_k = kw["lam_k"]
    h = _HKV * grp
    w = jnp.asarray(np.random.default_rng(9).standard_normal((h, d, n_out)) / np.sqrt(h * d), dtype)
    hi = jnp.int32(2 * cap + 21)
    seq_start = jnp.asarray(int(hi) - 1 - np.array([3, 40]), jnp.int32)
    lo = jnp.asarray(np.int32(hi) - np.array([[cap, 1, 17], [cap - 3, 40, 2]]), jnp.int32)
    if group is not None:  # the call's q, ring and Λ are the group's, the rows, scales and W_o the layer's
        idx = jnp.asarray(group)
        q, k_new, v_new, k, v, lo = (jnp.take(x, idx, axis=1) for x in (q, k_new, v_new, k, v, lo))
        lam_k = tuple(jnp.take(x, idx, axis=1) for x in lam_k)
    heads = dict(heads=group, kv_heads=None if group is None else _HKV)
    f = jax.jit(functools.partial(decode_attention_append, implementation="pallas", num_splits=splits))
    plain = f(q, k, v, k_new, v_new, lo=lo, hi=hi, lam_k=lam_k,
              step=DecodeStep(ops, seq_start, shift_state, log_fgate, lam_prev, **heads))
    got = f(q, k, v, k_new, v_new, lo=lo, hi=hi, lam_k=lam_k,
            step=DecodeStep(ops.replace(o_proj=w), seq_start, shift_state, log_fgate, lam_prev, **heads))
    n = q.shape[1]
    rows = w.reshape(_HKV, grp, d, n_out)[jnp.asarray(group if group is not None else range(_HKV))]
    want = jnp.einsum("bngd,ngdm->bm", plain.o.astype(jnp.float32), rows.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    shares = 1 if splits > 1 or n_out % 16 else n
    assert got.o.dtype == jnp.float32 and got.o.shape == (_B, shares, n_out), (got.o.dtype, got.o.shape)
    tol = 2e-6 if dtype == jnp.float32 else 4 * 2 ** -8
    assert _err(jnp.sum(got.o, axis=1), want) <= tol, _err(jnp.sum(got.o, axis=1), want)
    for a, b_ in ((got.k, plain.k), (got.v, plain.v), (got.carry[0], plain.carry[0])):  # the rest is the same step
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b_, np.float32))
    with pytest.raises(ValueError, match=r"step.ops.o_proj must be \[" + str(h) + ", " + str(d) + r", N\]"):
        f(q, k, v, k_new, v_new, lo=lo, hi=hi, lam_k=lam_k,
          step=DecodeStep(ops.replace(o_proj=w[:, :-1]), seq_start, shift_state, log_fgate, lam_prev, **heads))


def test_kernel_lowers_to_triton_for_cuda():
    """The GPU path (interpret=False) lowers for CUDA on this CPU machine — Pallas → Triton IR — with Λ
    pairs and a per-head slot mask (G = 6, D = 96 as two column chunks, 4 splits), with Λ at G = 1 (one
    row per block, one split), and without Λ with a shared slot mask, ACP's decode step (append and decay floor)
    with and without the fused per-head work (``StepArrays``: gate logits computed in the kernel, or read from
    ``gate_rows`` with a head group; with one split the output projection too) and the ring's tables, and a ring behind pinned sink slots, so a change that
    breaks the Triton lowering fails here, not first on the GPU."""
    sds = jax.ShapeDtypeStruct
    b, hkv, cap = 2, 2, 1024

    def lower(grp, d, config, lam, valid_nt):
        f = functools.partial(dk.flash_decode, scale=0.125, config=config, interpret=False)
        args = [sds((b, hkv, grp, d), jnp.bfloat16), sds((b, hkv, cap, d), jnp.bfloat16),
                sds((b, hkv, cap, d), jnp.bfloat16), sds((b, hkv), jnp.int32), sds((b, hkv), jnp.int32),
                None if valid_nt is None else sds((b, valid_nt, cap), jnp.bool_),
                (sds((b, hkv, grp), jnp.float32),) * 2 if lam else None,
                (sds((b, hkv, grp, cap), jnp.float32),) * 2 if lam else None]
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    assert lower(6, 96, dk.DecodeConfig(64, 4), True, hkv).count("__gpu$xla.gpu.triton") == 1
    assert lower(1, 64, dk.DecodeConfig(128, 1), True, None).count("__gpu$xla.gpu.triton") == 1
    assert lower(2, 128, dk.DecodeConfig(32, 2), False, 1).count("__gpu$xla.gpu.triton") == 1
    for grp, config in ((1, dk.DecodeConfig(64, 1)), (3, dk.DecodeConfig(64, 2)),  # ACP's decode step: append + floor
                        (1, dk.DecodeConfig(64, 1, late_writes=False, early_epilogue=False))):  # (the writes first)
        pair = lambda *shape: (sds(shape, jnp.float32),) * 2  # noqa: E731
        f = functools.partial(dk.flash_decode, scale=0.125, config=config, interpret=False)
        text = jax.jit(lambda q, k, v, lo, hi, lq, lk, kn, vn, fl: f(q, k, v, lo, hi, None, lq, lk, append=(kn, vn, lq),
                                                                     decay_floor=fl)).trace(
            sds((b, hkv, grp, 64), jnp.bfloat16), sds((b, hkv, 256, 64), jnp.bfloat16),
            sds((b, hkv, 256, 64), jnp.bfloat16), sds((b, hkv), jnp.int32), sds((), jnp.int32), pair(b, hkv, grp),
            pair(b, hkv, grp, 256), sds((b, hkv, 64), jnp.bfloat16), sds((b, hkv, 64), jnp.bfloat16),
            sds((b, hkv, grp), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
        # the fused step: raw rows in, KV-shift, QK-norm, Λ, output norm and gate (one split) in the kernel
        step = dk.StepArrays(rows=sds((b, 2 * hkv * grp + 2 * hkv, 64), jnp.bfloat16), seq_start=sds((b,), jnp.int32),
                             gate_x=sds((b, 48), jnp.bfloat16),  # the gate projections: d_in 48 = 32 + 16
                             gate_w=tuple((sds((48, n), jnp.float32), bias) for n, bias in
                                          ((hkv, None), (hkv, None), (hkv * grp, sds((hkv * grp,), jnp.float32)))),
                             shift_state=sds((b, 2, hkv, 64), jnp.bfloat16), q_scale=sds((hkv, grp, 64), jnp.float32),
                             k_scale=sds((hkv, 64), jnp.float32), lam_prev=pair(b, hkv, grp),
                             o_scale=sds((hkv, grp, 64), jnp.float32) if config.num_splits == 1 else None,
                             o_proj=sds((hkv, grp, 64, 768), jnp.bfloat16) if config.num_splits == 1 else None,
                             o_gate=False)  # (W_o of N = 768 = 3 chunks of 256: FoX 125M's)
        one = config.num_splits == 1  # (the flags stay static: the arrays alone are traced)
        text = jax.jit(lambda q, k, v, lo, hi, lk, kn, vn, fl, st, tb: f(
            q, k, v, lo, hi, None, None, lk, append=(kn, vn, None), decay_floor=fl,
            step=dataclasses.replace(st, o_gate=one, x_norm_eps=1e-5 if one else None),  # (the folded input norm)
            tables=tb)).trace(sds((b, hkv, grp, 64), jnp.bfloat16), sds((b, hkv, 256, 64), jnp.bfloat16),
                               sds((b, hkv, 256, 64), jnp.bfloat16), sds((b, hkv), jnp.int32), sds((), jnp.int32),
                               pair(b, hkv, grp, 256), sds((b, hkv, 64), jnp.bfloat16),
                               sds((b, hkv, 64), jnp.bfloat16), sds((b, hkv, grp), jnp.float32), step,
                               (sds((b, hkv), jnp.int32),) * 3).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
        # a head group: the call holds the layer's kv heads 1 and 0, in that order (its rows, scales and carries
        # are the layer's; the table lookup is a select chain in the index maps)
        text = jax.jit(lambda q, k, v, lo, hi, lk, kn, vn, fl, st, tb: f(
            q, k, v, lo, hi, None, None, lk, append=(kn, vn, None), decay_floor=fl,
            step=dataclasses.replace(st, o_gate=one, group_heads=(1, 0), layer_kv_heads=hkv, gate_x=None, gate_w=None,
                                     gate_rows=jnp.zeros((b, 2 * hkv + hkv * grp), jnp.float32)),
            tables=tb)).trace(
            sds((b, 2, grp, 64), jnp.bfloat16), sds((b, 2, 256, 64), jnp.bfloat16), sds((b, 2, 256, 64), jnp.bfloat16),
            sds((b, 2), jnp.int32), sds((), jnp.int32), pair(b, 2, grp, 256), sds((b, 2, 64), jnp.bfloat16),
            sds((b, 2, 64), jnp.bfloat16), sds((b, 2, grp), jnp.float32), step,
            (sds((b, 2), jnp.int32),) * 3).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
    for grp, config in ((1, dk.DecodeConfig(64, 1)), (3, dk.DecodeConfig(64, 2))):  # sinks: 16 slots + a ring of 256
        f = functools.partial(dk.flash_decode, scale=0.125, config=config, interpret=False)
        text = jax.jit(lambda q, k, v, hi, lq, lk, kn, vn, tb, seq: f(
            q, k, v, jnp.int32(0), hi, None, lq, lk, append=(kn, vn, lq), tables=tb, pinned=(4, 16, seq))).trace(
            sds((b, hkv, grp, 64), jnp.bfloat16), sds((b, hkv, 272, 64), jnp.bfloat16),
            sds((b, hkv, 272, 64), jnp.bfloat16), sds((), jnp.int32), pair(b, hkv, grp), pair(b, hkv, grp, 272),
            sds((b, hkv, 64), jnp.bfloat16), sds((b, hkv, 64), jnp.bfloat16), (sds((b, 1), jnp.int32),) * 3,
            sds((b,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1


# --------------------------------------------------------------------------------------------------
# GPU: the Triton-lowered kernel and cuDNN (run on the H200 with `pytest -m gpu`)
# --------------------------------------------------------------------------------------------------

# B, Hkv, G, D, C, Λ pairs, valid nt, block_k, num_splits
_GPU_CASES = [
    pytest.param(8, 12, 1, 64, 8320, True, None, None, None, id="fox125m-C8320-default"),
    pytest.param(4, 8, 4, 128, 4096, True, None, 128, 3, id="gqa-D128-bk128-3splits"),
    pytest.param(4, 4, 2, 96, 1024, True, 4, 64, 1, id="D96-validHkv-1split"),
    pytest.param(32, 12, 1, 64, 1024, False, 1, None, None, id="gpt2-valid1"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b,hkv,grp,d,cap,lam,valid_nt,block_k,splits", _GPU_CASES)
def test_gpu_matches_reference(b, hkv, grp, d, cap, lam, valid_nt, block_k, splits):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, k, v, kw = _gpu_inputs(b, hkv, grp, d, cap, lam, valid_nt)
    ref = decode_attention_reference(q, k, v, **kw)
    o = jax.jit(functools.partial(decode_attention, implementation="pallas", block_k=block_k,
                                  num_splits=splits))(q, k, v, **kw)
    assert _err(o, ref) <= 1e-2
    o32 = jax.jit(functools.partial(decode_attention, implementation="pallas", block_k=block_k, num_splits=splits))(
        *(x.astype(jnp.float32) for x in (q, k, v)), **kw)
    assert _err(o32, ref) <= 1e-5  # float32, sums over up to 8k keys


def _gpu_inputs(b, hkv, grp, d, cap, lam, valid_nt):
    rng = np.random.default_rng(cap + d)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
               for s in ((b, hkv, grp, d), (b, hkv, cap, d), (b, hkv, cap, d)))
    n = rng.integers(0, cap + 1, (b, hkv))
    n[0, 0], n[-1, -1] = 0, cap
    lo = rng.integers(0, 3 * cap, (b, hkv))
    kw = dict(lo=jnp.asarray(lo, jnp.int32), hi=jnp.asarray(lo + n, jnp.int32))
    if lam:
        q_true = -600.0 + rng.uniform(-0.5, 0.5, (b, hkv, grp))
        k_true = q_true[..., None] + rng.uniform(0.0, 8.0, (b, hkv, grp, cap))
        split = lambda x: (jnp.asarray(x, jnp.float32), jnp.asarray(x - x.astype(np.float32), jnp.float32))  # noqa: E731
        kw["lam_q"], kw["lam_k"] = split(q_true), split(k_true)
    if valid_nt is not None:
        kw["valid"] = jnp.asarray(rng.random((b, valid_nt, cap)) > 0.3)
    return q, k, v, kw


@pytest.mark.gpu
@pytest.mark.parametrize("b,hkv,grp,d,cap,lam,valid_nt,block_k,splits", [c for c in _GPU_CASES if c.values[6] is None])
def test_gpu_append_matches_reference(b, hkv, grp, d, cap, lam, valid_nt, block_k, splits):
    """The Triton-lowered append mode (the step's entry from registers, written to the aliased ring in place) on
    decode shapes: the oracle's output of "write, then read", and exactly the written ring."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, k, v, kw = _gpu_inputs(b, hkv, grp, d, cap, lam, valid_nt)
    rng = np.random.default_rng(7)
    hi = jnp.int32(5 * cap + 3)
    lo = hi - jnp.asarray(rng.integers(1, cap + 1, (b, hkv)), jnp.int32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((b, hkv, d)), jnp.bfloat16) for _ in range(2))
    extra = dict(lam_q=kw["lam_q"], lam_k=kw["lam_k"], lam_new=kw["lam_q"]) if lam else {}
    wk, wv = write_entry(k, k_new, hi, 2), write_entry(v, v_new, hi, 2)
    wl = tuple(write_entry(x, y, hi, 3) for x, y in zip(kw["lam_k"], kw["lam_q"])) if lam else None
    ref = decode_attention_reference(q, wk, wv, lo=lo, hi=jnp.broadcast_to(hi, (b, hkv)), lam_q=extra.get("lam_q"),
                                     lam_k=wl)
    o, k2, v2, l2, *_ = jax.jit(functools.partial(decode_attention_append, implementation="pallas", block_k=block_k,
                                              num_splits=splits))(q, k, v, k_new, v_new, lo=lo, hi=hi, **extra)
    assert _err(o, ref) <= 1e-2
    np.testing.assert_array_equal(np.asarray(k2, np.float32), np.asarray(wk, np.float32))
    np.testing.assert_array_equal(np.asarray(v2, np.float32), np.asarray(wv, np.float32))
    if lam:
        for a, b_ in zip(l2, wl):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


@pytest.mark.gpu
@pytest.mark.parametrize("b,hkv,grp,cap,splits", [(8, 12, 1, 256, None), (4, 8, 4, 1024, 3)])
def test_gpu_append_decay_floor(b, hkv, grp, cap, splits):
    """acp's decode step on the device (the Triton-lowered append mode with a decay floor): ``first`` equals the
    vectorised oracle exactly and the output the oracle's read of [max(first, hi − C), hi) after the write, for
    rings holding C keys before the new one (the oldest tested, then overwritten) and shorter ones; FoX 125M's
    acp ring (B8, 12 heads, 256 slots) and a GQA shape with 3 splits."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(cap)
    d = 64
    q, k, v, k_new, v_new = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in
                             ((b, hkv, grp, d), (b, hkv, cap, d), (b, hkv, cap, d), (b, hkv, d), (b, hkv, d)))
    hi = 7 * cap + 5
    n = rng.integers(1, cap + 2, (b, hkv))
    n[0, 0] = cap + 1
    lo = hi - n
    col = hi - 1 - ((hi - 1 - np.arange(cap)) % cap + cap) % cap  # logical key held by each slot: [hi-1-C, hi-1)
    col = np.where(col >= hi - 1, col - cap, col)
    age = (hi - 2 - col).astype(np.float64)                                           # [C], 0 for the newest
    rate = rng.uniform(0.05, 0.2, (b, hkv, grp))
    q_true = -600.0 + rng.uniform(-0.5, 0.5, (b, hkv, grp))
    k_true = q_true[..., None] + rate[..., None] * age
    split = lambda x: (jnp.asarray(x, jnp.float32), jnp.asarray(x - x.astype(np.float32), jnp.float32))  # noqa: E731
    lam_q, lam_k = split(q_true), split(k_true)
    floor = jnp.asarray(-rate * rng.uniform(2.0, cap, (b, hkv, 1)), jnp.float32)
    decay = (np.asarray(lam_q[0])[..., None] - np.asarray(lam_k[0])) + (np.asarray(lam_q[1])[..., None]
                                                                         - np.asarray(lam_k[1]))
    ring_lo = np.maximum(lo, hi - 1 - cap)
    hidden = np.all(decay < np.asarray(floor)[..., None], axis=2) & (col >= ring_lo[..., None])
    first = np.maximum(ring_lo, np.max(np.where(hidden, col, -1), axis=-1) + 1)
    o, k2, _, _, got, *_ = jax.jit(functools.partial(decode_attention_append, implementation="pallas", num_splits=splits))(
        q, k, v, k_new, v_new, lo=jnp.asarray(lo, jnp.int32), hi=jnp.int32(hi), lam_q=lam_q, lam_k=lam_k,
        lam_new=lam_q, decay_floor=floor)
    np.testing.assert_array_equal(np.asarray(got), first)
    wl = tuple(write_entry(x, y, hi, 3) for x, y in zip(lam_k, lam_q))
    ref = decode_attention_reference(q, write_entry(k, k_new, hi, 2), write_entry(v, v_new, hi, 2),
                                     lo=jnp.asarray(np.maximum(first, hi - cap), jnp.int32),
                                     hi=jnp.full((b, hkv), hi, jnp.int32), lam_q=lam_q, lam_k=wl)
    assert _err(o, ref) <= 1e-2
    np.testing.assert_array_equal(np.asarray(k2, np.float32), np.asarray(write_entry(k, k_new, hi, 2), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("b,hkv,grp,cap,splits,group", [(8, 12, 1, 256, None, None), (4, 8, 4, 1024, 3, None),
                                                        (8, 12, 1, 256, None, (1, 4, 11))])
def test_gpu_append_step_equals_the_xla_path(b, hkv, grp, cap, splits, group):
    """FoX (Pro)'s fused decode step on the device (``DecodeStep``: the Triton kernel reads the GEMM's rows and does
    the KV-shift, QK-norm, Λ, output norm and gate) equals the XLA path of the same call (``head_prologue``, masked
    einsums, ``head_epilogue``): output within 2e-2 of the output scale (bf16's 1e-2 and the epilogue's roundings),
    the carried raw k, v exactly, Λ (a pair's value) to 1e-5: the kernel sums the forget-gate logit's 768 products
    in another float32 order than XLA (≈ √768 · 2⁻²⁴ ≈ 2e-6 of a logit of order 1; on the H200 each pair's hi and
    lo parts differed by an ulp of Λ, 1.2e-6, in opposite directions); FoX 125M's shape (B8, 12 heads, one split: the epilogue in the kernel)
    and a GQA shape with 3 splits (the epilogue and Λ after the combine); a head group (3 of the 12 kv heads: the
    call's ring and q are the group's, the rows, scales and carries the layer's, updated at the group's heads)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from fox_jax.ops.decode_attention import DecodeStep

    d = 64
    ops, q, k_new, v_new, shift_state, log_fgate, lam_prev = _step_case(grp, d, jnp.bfloat16, False, cap, b, hkv,
                                                                        d_in=768)  # FoX 125M: 512 + 256
    n = hkv if group is None else len(group)
    if group is not None:
        q, k_new, v_new = (jnp.take(x, jnp.asarray(group), axis=1) for x in (q, k_new, v_new))
    rng = np.random.default_rng(cap)
    k, v = (jnp.asarray(rng.standard_normal((b, n, cap, d)), jnp.bfloat16) for _ in range(2))
    lam_k = _lambda_pairs(rng, grp, cap, b, n)[1]
    hi = jnp.int32(5 * cap + 3)
    lo = jnp.asarray(int(hi) - rng.integers(1, cap + 1, (b, n)), jnp.int32)
    seq_start = jnp.asarray(rng.integers(int(hi) - 3 * cap, int(hi), (b,)), jnp.int32).at[0].set(int(hi) - 1)
    step = DecodeStep(ops, seq_start, shift_state, log_fgate, lam_prev, heads=group,
                      kv_heads=None if group is None else hkv)
    outs = {impl: jax.jit(functools.partial(decode_attention_append, implementation=impl, num_splits=splits))(
        q, k, v, k_new, v_new, lo=lo, hi=hi, lam_k=lam_k, step=step) for impl in ("xla", "pallas")}
    (o_x, k_x, _, _, _, (sh_x, l_x), _), (o_p, k_p, _, _, _, (sh_p, l_p), _) = outs["xla"], outs["pallas"]
    assert _err(o_p, o_x) <= 2e-2  # the attention's 1e-2 and the epilogue's bf16 roundings (2–3 ulps of 2⁻⁸)
    np.testing.assert_array_equal(np.asarray(sh_p, np.float32), np.asarray(sh_x, np.float32))
    pair = lambda x: np.asarray(x[0], np.float64) + np.asarray(x[1], np.float64)  # noqa: E731  (a pair's value)
    np.testing.assert_allclose(pair(l_p), pair(l_x), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(k_p, np.float32), np.asarray(k_x, np.float32), atol=2e-2, rtol=2 ** -7)


@pytest.mark.gpu
@pytest.mark.parametrize("nt,splits", [(1, None), (1, 3), (12, 3)])
def test_gpu_append_ring_tables_equal_the_xla_path(nt, splits):
    """The ring's tables advanced in place on the device (one writer per entry: per row the program of kv head 0 of
    split 0, though every program of the row reads its start) equal the XLA path exactly, with starts that keep
    more than C columns (overflow) and starts inside the ring; B8, 12 kv heads, a 256-slot ring."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    b, hkv, grp, d, cap = 8, 12, 1, 64, 256
    rng = np.random.default_rng(nt)
    q, k, v, k_new, v_new = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in
                             ((b, hkv, grp, d), (b, hkv, cap, d), (b, hkv, cap, d), (b, hkv, d), (b, hkv, d)))
    hi = 9 * cap + 7
    start = jnp.asarray(hi - rng.integers(1, 2 * cap, (b, nt)), jnp.int32)
    peak, overflow = (jnp.asarray(rng.integers(0, 300, (b, nt)), jnp.int32) for _ in range(2))
    outs = [jax.jit(functools.partial(decode_attention_append, implementation=impl, num_splits=splits))(
        q, k, v, k_new, v_new, lo=jnp.int32(hi - 200), hi=jnp.int32(hi), ring_tables=(start, peak, overflow))
        for impl in ("xla", "pallas")]
    for a, b_ in zip(outs[0].tables, outs[1].tables):
        np.testing.assert_array_equal(np.asarray(b_), np.asarray(a))
    assert _err(outs[1].o, outs[0].o) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 3])
def test_gpu_append_pinned_slots_equal_the_xla_path(splits):
    """``sinks:4+252`` on the device (B8, 12 kv heads, bf16, Λ pairs): 16 pinned slots in front of a 256-slot ring,
    rows whose step writes a pinned position, rows on a left pad and rows long past the sinks; the kernel's output,
    buffers and tables equal the XLA path's (output at bf16's 1e-2, the rest exactly)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    b, hkv, grp, d, pin, ring = 8, 12, 1, 64, 16, 256
    rng = np.random.default_rng(3)
    q, k, v, k_new, v_new = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in
                             ((b, hkv, grp, d), (b, hkv, pin + ring, d), (b, hkv, pin + ring, d), (b, hkv, d),
                              (b, hkv, d)))
    lam_q, lam_k = _lambda_pairs(rng, grp, pin + ring, b, hkv)
    for hi, seq in ((5, np.array([0, 1, 2, 3, 4, 5, 6, 0])), (3 * ring + 11, np.arange(b) * 3)):
        start = jnp.asarray(seq[:, None] + 4, jnp.int32)
        peak, overflow = (jnp.asarray(rng.integers(0, 3, (b, 1)), jnp.int32) for _ in range(2))
        outs = [jax.jit(functools.partial(decode_attention_append, implementation=impl, num_splits=splits))(
            q, k, v, k_new, v_new, lo=jnp.int32(hi - 252), hi=jnp.int32(hi), lam_q=lam_q, lam_k=lam_k, lam_new=lam_q,
            ring_tables=(start, peak, overflow), pinned=PinnedSlots(4, pin, jnp.asarray(seq, jnp.int32)))
            for impl in ("xla", "pallas")]
        for a, b_ in zip([*outs[0].tables, outs[0].k, outs[0].v, *outs[0].lam_k],
                         [*outs[1].tables, outs[1].k, outs[1].v, *outs[1].lam_k]):
            np.testing.assert_array_equal(np.asarray(b_, np.float32), np.asarray(a, np.float32))
        assert _err(outs[1].o, outs[0].o) <= 1e-2, hi


@pytest.mark.gpu
@pytest.mark.parametrize("b,hkv,grp,d,cap,lam,valid_nt,block_k,splits", _GPU_CASES)
def test_gpu_cudnn_matches_reference(b, hkv, grp, d, cap, lam, valid_nt, block_k, splits):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, k, v, kw = _gpu_inputs(b, hkv, grp, d, cap, lam, valid_nt)
    ref = decode_attention_reference(q, k, v, **kw)
    o = jax.jit(functools.partial(decode_attention, implementation="cudnn"))(q, k, v, **kw)
    assert _err(o, ref) <= 1e-2  # the decay as a bf16 bias: ≤ 7e-4 relative weight error (_cudnn)


def test_bench_quick(tmp_path, monkeypatch):
    """benchmarks/bench_decode_attention.py --quick runs the kernel (interpret mode) on CPU, checks it
    against the oracle and writes its JSON rows; the sweep's candidates fit the ring."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_decode_attention.py"
    spec = importlib.util.spec_from_file_location("bench_decode_attention", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "q.json"
    assert bench.main(["--quick", "--impls", "pallas", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["impl"] == "pallas" and row["us"] > 0 and row["max_err"] <= 1e-2 and row["error"] is None
    assert data["winners"] == {"quick-gqa": "pallas"}
    fox = next(s for s in bench.SHAPES if s.name == "fox-125m-C8320")
    cands = bench.sweep_candidates(fox, 1)
    assert all(fox.cap % c.block_k == 0 for c in cands) and {c.block_k for c in cands} == {32, 64, 128}
    acp = next(s for s in bench.SHAPES if s.name.startswith("acp"))
    assert max(c.num_splits for c in bench.sweep_candidates(acp, 1) if c.block_k == 64) == 4  # 256 live keys


def test_decode_sass_tool_parses_and_condenses(monkeypatch):
    """``benchmarks/checks/decode_sass.py``'s pure parts: opcodes read from an ``nvdisasm`` listing (predicates
    dropped, addresses required), condensed into the timeline, and variants parsed as DecodeConfig fields with
    one-line errors naming the flag (``profile_decode.py``'s parser, the kernel's keys only)."""
    import importlib.util
    import pathlib
    checks = pathlib.Path(__file__).parents[1] / "benchmarks" / "checks"
    monkeypatch.syspath_prepend(str(checks))  # its sibling module, as when run as a script
    spec = importlib.util.spec_from_file_location("decode_sass", checks / "decode_sass.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    listing = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R24, desc[UR12][R2.64] ;
        /*0020*/              @!P4 LDG.E.64 R82, desc[UR12][R82.64] ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   LDGSTS.E.BYPASS.128 [R5], desc[UR12][R6.64] ;
        /*0050*/                   IMAD R2, R3, R4, RZ ;
        /*0060*/                   IMAD R2, R3, R4, RZ ;
        .L_x_3:
        /*0070*/                   EXIT ;"""
    ops = mod.sass_ops(listing)
    assert ops == ["LDC", "LDG.E.128", "LDG.E.64", "BAR.SYNC.DEFER_BLOCKING", "LDGSTS.E.BYPASS.128", "IMAD", "IMAD",
                   "EXIT"]
    assert mod.timeline(ops) == "[1] LDGx2 BAR LDGSTS [2] EXIT"
    assert mod.parse_variant("w2:num_warps=2,fold_floor=0") == ("w2", {"num_warps": 2, "fold_floor": False})
    with pytest.raises(ValueError, match="--kernel-variants 'x:warps=2': expected key=value with key in"):
        mod.parse_variant("x:warps=2")
    with pytest.raises(ValueError, match="num_warps takes an int"):
        mod.parse_variant("x:num_warps=four")
    with pytest.raises(ValueError, match="fold_floor takes 0 or 1, got '2'"):
        mod.parse_variant("x:fold_floor=2")
    with pytest.raises(ValueError, match="norm not a key of the decode kernel's DecodeConfig"):
        mod.parse_variant("x:norm=applied")  # profile_decode's step switch: not the kernel's code
    with pytest.raises(SystemExit):  # argparse's one-line error, before anything compiles
        mod.main(["--kernel-variants", "x:block_k=48"])
