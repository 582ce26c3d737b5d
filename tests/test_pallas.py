"""Tests of the portable Pallas forgetting-attention kernels (``implementation="pallas"``).

On CPU the kernels run in interpret mode with small, per-kernel different tiles (fwd 32×16, dQ 16×32,
dK/dV 32×16; fox_jax.kernels.forgetting_attention._INTERPRET_CONFIG), so short awkward lengths still exercise
multi-block loops, boundary tiles, padding and kernel-specific ACP ranges. ``-m gpu`` runs the real
Triton-lowered kernels on larger shapes.

Tolerances (max abs error, relative to the reference's max magnitude ``scale``):
* float32 inputs: the kernels compute in float32 like the dense float32 oracle; only the summation
  order differs → 2e-5·scale + 1e-5 (measured ~1e-7 relative).
* bfloat16 / float16 inputs: compared against the oracle run in float32 on the *same rounded inputs*;
  the kernels round P and dS to the input dtype before the tensor-core matmuls (as FlashAttention
  and the official FoX kernel do), i.e. relative errors of ~2^-8 (bf16) / 2^-11 (fp16) per term →
  2e-2·scale (bf16) and 1e-2·scale (fp16) for the output, 3e-2·scale / 1.5e-2·scale for gradients.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.ops import acp as acp_lib
from fox_jax.ops import forgetting_attention, forgetting_attention_reference
from fox_jax.ops import pallas as fpallas
from fox_jax.ops.reference import decay_cumsum
from fox_jax.kernels.forgetting_attention import KernelConfig, TileConfig

from _attention_checks import assert_close as _assert_close  # noqa: E402
from _attention_checks import check_against_reference, value_and_grads as _value_and_grads  # noqa: E402


def _inputs(b, tq, tk, h, hkv, d, dtype, seed=0, gate_lo=0.0, gate_hi=5.0):
    """``_attention_checks.inputs`` drawn with numpy: jax.random compiles its samplers once per new shape
    (~1 s of XLA per test here). q, k, v in ``dtype``; float32 log σ(U(gate_lo, gate_hi)) gates; float32
    cotangent weights w."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, tq, h, d), np.float32), dtype)
    k = jnp.asarray(rng.standard_normal((b, tk, hkv, d), np.float32), dtype)
    v = jnp.asarray(rng.standard_normal((b, tk, hkv, d), np.float32), dtype)
    lf = jnp.asarray(-np.logaddexp(0.0, -rng.uniform(gate_lo, gate_hi, (b, tk, h))), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, tq, h, d), np.float32))
    return q, k, v, lf, w

def _check_pallas_against_reference(q, k, v, lf, w, dtype, **kw):
    """``check_against_reference`` for ``implementation="pallas"``."""
    return check_against_reference("pallas", q, k, v, lf, w, dtype, **kw)


# b, tq, tk, h, hkv, d, dtype, seq_start, segments (plain d32: the decode case; odd lengths over several
# blocks: d128, d48, bf16, fp16)
_CASES = [
    pytest.param(2, 45, 70, 4, 2, 64, jnp.float32, (0, 19), True, id="f32-d64-tq<tk-gqa-seqstart-seg"),
    pytest.param(1, 20, 40, 2, 2, 32, jnp.float32, (25,), False, id="f32-empty-rows"),
    pytest.param(1, 1, 29, 2, 1, 32, jnp.float32, None, False, id="f32-decode-tq1-gqa"),
    pytest.param(1, 33, 33, 1, 1, 128, jnp.float32, (3,), False, id="f32-d128"),
    pytest.param(1, 30, 30, 2, 2, 48, jnp.float32, None, True, id="f32-d48-padded-headdim"),
    pytest.param(2, 50, 50, 4, 2, 64, jnp.bfloat16, (0, 9), False, id="bf16-gqa-seqstart"),
    pytest.param(2, 40, 47, 2, 2, 32, jnp.float16, None, True, id="fp16-tq<tk-seg"),
    # documents of ~50 keys over 16/32-wide blocks: tiles wholly inside a document run unmasked (document_runs)
    pytest.param(2, 160, 160, 2, 1, 32, jnp.float32, (0, 20), True, id="f32-long-docs-interior"),
]


@pytest.mark.slow
@pytest.mark.parametrize("b,tq,tk,h,hkv,d,dtype,seq_start,segments", _CASES)
def test_matches_dense_reference(b, tq, tk, h, hkv, d, dtype, seq_start, segments):
    q, k, v, lf, w = _inputs(b, tq, tk, h, hkv, d, dtype, seed=tq + d)
    ss = None if seq_start is None else jnp.asarray(seq_start, jnp.int32)
    seg = None
    if segments:  # three packed documents per row, boundaries differ across the batch
        t = jnp.arange(tk)
        seg = jnp.stack([(t >= tk // 3 + 2 * i).astype(jnp.int32) + (t >= (2 * tk) // 3 - i) for i in range(b)])
    o, grads = _check_pallas_against_reference(q, k, v, lf, w, dtype, seq_start=ss, segment_ids=seg)
    assert o.dtype == dtype and o.shape == (b, tq, h, d)
    if ss is not None:  # keys before seq_start get exactly zero gradient; empty rows output 0
        for g in grads[1:3]:
            for i, s in enumerate(seq_start):
                assert not np.any(np.asarray(g[i, :s], np.float32))
        qpos = (tk - tq) + np.arange(tq)
        for i, s in enumerate(seq_start):
            assert not np.any(np.asarray(o[i, qpos < s], np.float32))


def _acp_inputs(b=1, t=256, h=4, d=32, seed=3):
    """Synthetic gates as in docs/design/anchors_h200.md: per-head gate logits ~ N(μ_h, 1), μ_h evenly spaced
    in [0, 3]; q/k rows normalised to norm √D (so U = scale·√D·√D and the auto bound is valid)."""
    rng = np.random.default_rng(seed)  # numpy: no XLA compilation per shape
    q = rng.standard_normal((b, t, h, d))
    k = rng.standard_normal((b, t, h, d))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * d ** 0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True) * d ** 0.5
    v = rng.standard_normal((b, t, h, d))
    mu = np.linspace(0.0, 3.0, h)
    lf = -np.logaddexp(0.0, -(mu[None, None, :] + rng.standard_normal((b, t, h))))  # log σ
    w = rng.standard_normal((b, t, h, d))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, lf, w))


def test_acp_minus_inf_threshold_is_bit_identical():
    q, k, v, lf, w = _inputs(2, 41, 41, 2, 2, 32, jnp.bfloat16, seed=7)
    ss = jnp.array([0, 5], jnp.int32)
    base = _value_and_grads(lambda *a: forgetting_attention(*a, seq_start=ss, implementation="pallas"),
                            q, k, v, lf, w)
    inf = _value_and_grads(lambda *a: forgetting_attention(
        *a, seq_start=ss, adaptive_threshold=-jnp.inf, implementation="pallas"), q, k, v, lf, w)
    for a, b in zip(jax.tree_util.tree_leaves(base), jax.tree_util.tree_leaves(inf)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_acp_auto_threshold_within_epsilon_bound():
    q, k, v, lf, w = _acp_inputs()
    t = q.shape[1]
    o_dense, g_dense = _value_and_grads(
        lambda *a: forgetting_attention(*a, implementation="pallas"), q, k, v, lf, w)
    o_acp, g_acp = _value_and_grads(
        lambda *a: forgetting_attention(*a, adaptive_threshold="auto", implementation="pallas"),
        q, k, v, lf, w)
    # some tiles really were skipped
    delta = acp_lib.resolve_threshold("auto", q, k, q.shape[-1] ** -0.5)
    stats = fpallas.acp_stats(decay_cumsum(lf), delta, t, head_dim=q.shape[-1])
    for kernel in ("fwd", "dq", "dkv"):
        assert float(stats[kernel]["fraction_skipped"]) > 0.2, stats
    # |o_acp − o_dense| ≤ 2ε·max|v| per row (pruned weight ≤ ε; ε = e^-10), plus float32 noise
    eps = np.exp(acp_lib.DEFAULT_LOG_EPSILON)
    vmax = np.max(np.abs(np.asarray(v)), axis=(1, 3))  # [B, H]
    err = np.max(np.abs(np.asarray(o_acp) - np.asarray(o_dense)), axis=-1)  # [B, T, H]
    assert np.all(err <= 2 * eps * vmax[:, None, :] + 1e-5), float(np.max(err))
    # gradients: the pruned tiles carry ≤ ε of the attention weight
    for name, a, b in zip(("dq", "dk", "dv", "dlog_fgate"), g_acp, g_dense):
        _assert_close(name, a, b, 1e-3)


@pytest.mark.slow
def test_acp_fixed_threshold_matches_xla_blockwise():
    """Aggressive δ: the same tiles are skipped by both implementations when the blocks are equal."""
    q, k, v, lf, w = _inputs(2, 70, 90, 4, 2, 32, jnp.float32, seed=11, gate_lo=-1.0, gate_hi=2.0)
    ss = jnp.array([0, 13], jnp.int32)
    bq, bk = 16, 32
    tile = TileConfig(bq, bk)
    cfg = KernelConfig(fwd=tile, dq=tile, dkv=tile)
    delta = jnp.full((2, 4), -3.0, jnp.float32)
    scale = 32 ** -0.5

    def pallas_fn(q, k, v, lf):
        lam = decay_cumsum(lf, ss)
        return fpallas.attention(q, k, v, lam, ss, None, delta, scale=scale, config=cfg)

    def xla_fn(q, k, v, lf):
        return forgetting_attention(q, k, v, lf, seq_start=ss, adaptive_threshold=-3.0, implementation="xla",
                                    block_q=bq, block_k=bk)

    o_p, g_p = _value_and_grads(pallas_fn, q, k, v, lf, w)
    o_x, g_x = _value_and_grads(xla_fn, q, k, v, lf, w)
    o_dense = jax.jit(lambda *a: forgetting_attention_reference(*a, seq_start=ss))(q, k, v, lf)
    assert float(np.max(np.abs(np.asarray(o_p) - np.asarray(o_dense)))) > 1e-3  # the threshold really prunes
    _assert_close("o", o_p, o_x, 2e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dlog_fgate"), g_p, g_x):
        _assert_close(name, a, b, 2e-5)


@pytest.mark.slow
def test_grid_order_does_not_change_results():
    """Interleaving heads in the grid (the default with ACP) only reorders programs."""
    q, k, v, lf, w = _inputs(2, 50, 50, 4, 2, 32, jnp.bfloat16, seed=13)
    ss = jnp.array([3, 0], jnp.int32)
    lam = decay_cumsum(lf, ss)
    delta = jnp.full((2, 4), -6.0)
    from fox_jax.kernels.forgetting_attention import _interleave

    base = fpallas.resolve_config(32, 50, 50)
    outs = []
    per_kernel = dataclasses.replace(  # forward block-major, backward interleaved (per-kernel order)
        base, interleave_heads=False, dq=dataclasses.replace(base.dq, interleave_heads=True),
        dkv=dataclasses.replace(base.dkv, interleave_heads=True))
    # every kernel block-major, then every kernel interleaved (fwd and dQ from the config-wide setting, dK/dV
    # from its own); the mixed per_kernel config is checked through _interleave below
    all_interleaved = dataclasses.replace(base, interleave_heads=True,
                                          dkv=dataclasses.replace(base.dkv, interleave_heads=True))
    assert all(_interleave(all_interleaved, t, None) for t in (base.fwd, base.dq, all_interleaved.dkv))
    for cfg in (dataclasses.replace(base, interleave_heads=False), all_interleaved):
        outs.append(_value_and_grads(lambda q_, k_, v_, lam_: fpallas.attention(
            q_, k_, v_, lam_, ss, None, delta, scale=0.2, config=cfg), q, k, v, lam, w))
    for other in outs[1:]:
        for a, b in zip(jax.tree_util.tree_leaves(outs[0]), jax.tree_util.tree_leaves(other)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the per-kernel setting wins over the config-wide one
    assert [_interleave(per_kernel, t, None) for t in (per_kernel.fwd, per_kernel.dq, per_kernel.dkv)] == [
        False, True, True]
    assert _interleave(base, base.fwd, object()) and not _interleave(base, base.fwd, None)


@pytest.mark.slow
def test_vmap_jit_grad():
    q, k, v, lf, w = _inputs(2, 24, 24, 2, 2, 32, jnp.float32, seed=5)
    lam = decay_cumsum(lf)
    ss = jnp.zeros((2,), jnp.int32)
    delta = jnp.full((2, 2), -4.0)
    scale = 0.2

    def one(q, k, v, lam, ss, delta):  # unbatched over a leading "layer" axis via vmap
        return fpallas.attention(q, k, v, lam, ss, None, delta, scale=scale)

    stack = lambda x: jnp.stack([x, x[::-1] * 0.5])  # noqa: E731
    args = (stack(q), stack(k), stack(v), stack(lam), stack(ss), stack(delta))
    loss = lambda *a: jnp.sum(jax.vmap(one)(*a) ** 2)  # noqa: E731
    val, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args)
    single = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(one(*a) ** 2), argnums=(0, 1, 2, 3)))  # no vmap
    for i in range(2):
        sl = [x[i] for x in args]
        val_i, grads_i = single(*sl)
        for a, b in zip(grads, grads_i):
            np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert np.isfinite(float(val))


def test_acp_stats_and_errors():
    _, _, _, lf, _ = _acp_inputs(t=128)
    lam = decay_cumsum(lf)
    stats = fpallas.acp_stats(lam, -20.0, 128, head_dim=32)
    for kernel, s in stats.items():
        f = float(s["fraction_skipped"])
        assert 0.0 < f < 1.0, (kernel, f)
        assert float(s["blocks_skipped"]) <= float(s["blocks_total"])
    none = fpallas.acp_stats(lam, -jnp.inf, 128, head_dim=32)
    assert all(float(s["blocks_skipped"]) == 0.0 for s in none.values())

    q, k, v, lf, _ = _inputs(1, 16, 16, 1, 1, 320, jnp.float32)
    with pytest.raises(ValueError, match="head_dim"):
        forgetting_attention(q, k, v, lf, implementation="pallas")
    with pytest.raises(NotImplementedError):
        forgetting_attention(q[..., :32], k[..., :32], v[..., :32], lf, implementation="mosaic")
    with pytest.raises(ValueError, match="power of two"):
        TileConfig(24, 32)


def _packed_segments(lengths_per_row):
    """[B, T] int32 segment ids of packed documents (non-decreasing) from per-row document lengths."""
    return jnp.asarray(np.stack([np.repeat(np.arange(len(ls)), ls) for ls in lengths_per_row]), jnp.int32)


# documents per row (awkward lengths, several per tile and tiles inside one document), Tq < Tk, GQA
_DOC_CASES = [
    pytest.param(None, id="dense"),
    pytest.param(-10.0, id="acp"),
]


@pytest.mark.slow
@pytest.mark.parametrize("threshold", _DOC_CASES)
def test_document_skipping_matches_reference(threshold):
    b, tq, tk, h, hkv, d = 2, 70, 101, 4, 2, 32
    q, k, v, lf, w = _inputs(b, tq, tk, h, hkv, d, jnp.float32, seed=21, gate_lo=-1.0, gate_hi=3.0)
    seg = _packed_segments([[5, 27, 3, 1, 40, 25], [60, 9, 32]])
    ss = jnp.array([0, 4], jnp.int32)
    kw = dict(seq_start=ss, segment_ids=seg, adaptive_threshold=threshold)
    counts = fpallas.tile_counts(b, h, tq, tk, segment_ids=seg, head_dim=d)
    for kernel, c in counts.items():  # the documents really remove tiles
        assert float(c["visited"]) < float(c["causal"]), (kernel, c)
    o, grads = _value_and_grads(lambda *a: forgetting_attention(*a, implementation="pallas", **kw),
                                q, k, v, lf, w)
    if threshold is None:  # the dense float32 oracle
        o_ref, grads_ref = _value_and_grads(
            lambda *a: forgetting_attention_reference(*a, seq_start=ss, segment_ids=seg), q, k, v, lf, w)
        assert float(np.max(np.abs(np.asarray(o)))) > 0.1
    else:  # ACP changes the result: compare with the same kernels without document skipping (the
        # skipped tiles are fully masked, so bit-identical) and with the XLA path on the same tiles
        scale = d ** -0.5
        lam = decay_cumsum(lf, ss)
        delta = jnp.full((b, h), threshold, jnp.float32)
        tile = TileConfig(16, 32)
        cfg = KernelConfig(fwd=tile, dq=tile, dkv=tile)
        run = lambda skip: _value_and_grads(lambda q_, k_, v_, lam_: fpallas.attention(  # noqa: E731
            q_, k_, v_, lam_, ss, seg, delta, scale=scale, config=cfg, segment_skipping=skip), q, k, v, lam, w)
        with_skip, without = run(True), run(False)
        for a, c in zip(jax.tree_util.tree_leaves(with_skip), jax.tree_util.tree_leaves(without)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        acp_counts = fpallas.tile_counts(b, h, tq, tk, lam=lam, delta=delta, segment_ids=seg, head_dim=d,
                                         config=cfg)
        acp_only = fpallas.tile_counts(b, h, tq, tk, lam=lam, delta=delta, head_dim=d, config=cfg)
        for kernel in ("fwd", "dq", "dkv"):  # ACP and documents combine (max of starts, min of ends)
            assert float(acp_counts[kernel]["visited"]) < float(acp_only[kernel]["visited"])
        o_ref, grads_ref = _value_and_grads(lambda *a: forgetting_attention(
            *a, implementation="xla", block_q=16, block_k=32, **kw), q, k, v, lf, w)
    _assert_close("o", o, o_ref, 2e-5)
    for name, g, gr in zip(("dq", "dk", "dv", "dlog_fgate"), grads, grads_ref):
        _assert_close(name, g, gr, 2e-5)


@pytest.mark.slow
def test_document_skipping_never_loads_skipped_tiles():
    """Keys of a document that no query belongs to (Tq < Tk) are poisoned with NaN: with document
    skipping their tiles are never loaded (finite results equal to the clean oracle, zero dk/dv);
    masking alone would multiply NaN by 0. Also: arbitrary (non-monotone) ids stay exact."""
    b, tq, tk, h, d = 1, 40, 96, 2, 32
    q, k, v, lf, w = _inputs(b, tq, tk, h, h, d, jnp.float32, seed=23)
    seg = _packed_segments([[32, 20, 17, 27]])  # doc 0 = keys [0, 32): block-aligned for every tiling
    poison = jnp.arange(tk)[None, :, None, None] < 32
    kp, vp = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    o, grads = _value_and_grads(lambda *a: forgetting_attention(*a, segment_ids=seg, implementation="pallas"),
                                q, kp, vp, lf, w)
    o_ref, grads_ref = _value_and_grads(lambda *a: forgetting_attention_reference(*a, segment_ids=seg),
                                        q, k, v, lf, w)
    _assert_close("o", o, o_ref, 2e-5)
    for name, g, gr in zip(("dq", "dk", "dv", "dlog_fgate"), grads, grads_ref):
        _assert_close(name, g, gr, 2e-5)
    assert not np.any(np.asarray(grads[1][:, :32])) and not np.any(np.asarray(grads[2][:, :32]))
    # non-monotone ids (a document that resumes later): skipping is still exact
    seg2 = jnp.asarray(np.concatenate([np.zeros(30), np.ones(25), np.zeros(20), 2 * np.ones(21)])[None],
                       jnp.int32)
    o2, grads2 = _value_and_grads(lambda *a: forgetting_attention(
        *a, segment_ids=seg2, implementation="pallas"), q, k, v, lf, w)
    o2_ref, grads2_ref = _value_and_grads(lambda *a: forgetting_attention_reference(*a, segment_ids=seg2),
                                          q, k, v, lf, w)
    _assert_close("o", o2, o2_ref, 2e-5)
    for name, g, gr in zip(("dq", "dk", "dv", "dlog_fgate"), grads2, grads2_ref):
        _assert_close(name, g, gr, 2e-5)


def test_segment_block_bounds():
    """The document-aware ranges against a brute-force tile test (any ids, Tq < Tk, ragged blocks)."""
    rng = np.random.default_rng(0)
    packed = np.repeat(np.arange(6), [7, 1, 13, 20, 2, 17])[None]
    shuffled = rng.integers(0, 4, size=(1, 60))
    for ids in (packed, shuffled):
        tk = ids.shape[1]
        for tq, bq, bk in ((tk, 16, 8), (37, 8, 16)):
            kv_lo, kv_hi, q_lo, q_hi = (np.asarray(x) for x in acp_lib.segment_block_bounds(
                jnp.asarray(ids, jnp.int32), tq=tq, block_q=bq, block_k=bk))
            qi = ids[0, tk - tq:]
            nq, nk = -(-tq // bq), -(-tk // bk)
            share = np.array([[bool(set(qi[m * bq:(m + 1) * bq]) & set(ids[0, n * bk:(n + 1) * bk]))
                               for n in range(nk)] for m in range(nq)])
            for m in range(nq):  # every tile with a shared id lies inside the ranges
                for n in range(nk):
                    if share[m, n]:
                        assert kv_lo[0, m] <= n < kv_hi[0, m] and q_lo[0, n] <= m < q_hi[0, n]
            if ids is packed:  # tight for packed documents: the ranges hold only sharing tiles
                assert all(share[m, kv_lo[0, m]:kv_hi[0, m]].all() for m in range(nq))
                assert all(share[q_lo[0, n]:q_hi[0, n], n].all() for n in range(nk))


@pytest.mark.slow
def test_bench_gates_from_a_run(tmp_path):
    """bench_attention.py --gates-from: a tiny FoX run (T=32; its checkpoint written as ``fox-jax train``
    writes it, without training: the reader is under test, not the trainer), gates captured at the quick
    shapes' longer T; slot (0, 0) equals layer 0 / head 0's log_fgate computed by hand."""
    from pathlib import Path

    from fox_jax.models import LanguageModel  # noqa: F401  (model import before the bench)
    from fox_jax.nn.layers import RMSNorm
    from fox_jax.train import config as config_lib, loop
    from test_runs import _save

    root = Path(__file__).resolve().parents[1]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, f in enumerate(sorted(root.glob("fox_jax/**/*.py"))[:24]):
        (corpus / f"doc{i:03d}.txt").write_text(f.read_text())
    cfg = config_lib.apply_overrides(config_lib.preset("tiny"), [
        f"data.train={corpus}", "data.seq_len=32", "model.n_layers=2", "model.d_model=32", "model.n_heads=2",
        "model.attention_block=16", "batch_size=2", "eval_batches=1"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config_lib.save_json(cfg, run_dir / "config.json")
    state = loop.init_state(cfg, jax.random.PRNGKey(0), loop.make_optimizer(cfg))
    _save(run_dir, [(2, state.replace(step=np.int32(2)))])

    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import bench_attention as bench
    finally:
        sys.path.pop(0)
    tg = bench.TrainedGates(str(run_dir))
    b, t, h = 2, 64, 3  # 6 slots cycle over the 2 × 2 (layer, head) pairs
    gates, info = tg.gates(b, t, h)
    assert gates.shape == (b, t, h) and gates.dtype == jnp.float32
    assert info["slots"][:5] == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 0]] and not info["tiled"]
    assert bool(jnp.all(gates < 0))
    # by hand: layer 0's gate = log_sigmoid(fgate_proj(attn_norm(embed(tokens))))
    batch, _ = tg.window(t)
    p = tg.params
    x = p["embed"]["embedding"][jnp.asarray(batch["inputs"])].astype(jnp.dtype(tg.model_cfg.dtype))
    x = RMSNorm(tg.model_cfg.norm_eps, jnp.dtype(tg.model_cfg.dtype)).apply(
        {"params": p["layers_0"]["attn_norm"]}, x)
    fg = p["layers_0"]["attn"]["fgate_proj"]
    want = jax.nn.log_sigmoid(x.astype(jnp.float32) @ fg["kernel"] + fg["bias"])[0]  # [T, H_model]
    np.testing.assert_allclose(np.asarray(gates[0, :, 0]), np.asarray(want[:, 0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gates[1, :, 1]), np.asarray(want[:, 0]), rtol=1e-5, atol=1e-6)
    assert tg.window(len(tg.corpus.val_tokens) + 5)[1]  # short validation text is tiled

    out = tmp_path / "bench.json"
    # no --impls: --gates-from alone adds the pallas-acp-trained row (the synthetic-gate rows would only
    # compile and time the same kernels again)
    bench.main(["--quick", "--impls", "", "--gates-from", str(run_dir), "--out", str(out),
                "--shapes", "1x64x2x32", "--workers", "1"])
    res = json.loads(out.read_text())
    r = res["results"][0]
    assert set(r["acp_trained_fraction_skipped"]) == {"fwd", "dq", "dkv"} and set(r["impls"]) == {"pallas-acp-trained"}
    assert r["trained_gates"]["train_seq_len"] == 32 and r["trained_gates"]["T"] == 64
    assert r["impls"]["pallas-acp-trained"]["fwd_bwd"] > 0
    assert "pallas-acp-trained" in res["markdown"] and "trained FoX" in res["markdown"]


_SHARDED_SCRIPT = textwrap.dedent("""
    import json, os
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from fox_jax.ops import forgetting_attention
    from fox_jax.ops import sharded_attention
    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "tensor"))
    rng = np.random.default_rng(0)  # numpy: no XLA compilation of samplers
    b, t, h, hkv, d = 2, 24, 4, 2, 32
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, t, h, d), (b, t, hkv, d), (b, t, hkv, d)))
    lf = jnp.asarray(-np.logaddexp(0.0, -rng.uniform(0.0, 4.0, (b, t, h))), jnp.float32)
    ss = jnp.array([0, 3], jnp.int32)
    fn = sharded_attention(mesh, "data", "tensor", adaptive_threshold="auto")
    loss = lambda f: (lambda q, k, v, lf: (lambda o: (jnp.sum(o ** 2), o))(f(q, k, v, lf)))
    grad = lambda f: jax.jit(jax.value_and_grad(loss(f), argnums=(0, 1, 2, 3), has_aux=True))
    sharded = grad(lambda *a: fn(*a, seq_start=ss))
    plain = grad(lambda *a: forgetting_attention(*a, seq_start=ss, adaptive_threshold="auto", implementation="pallas"))
    ((v1, out), g1), ((v2, _), g2) = sharded(q, k, v, lf), plain(q, k, v, lf)  # out: the sharded op's output
    errs = [float(abs(v1 - v2) / abs(v2))] + [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
            for a, b in zip(g1, g2)]
    print(json.dumps({"errs": errs, "n_shards": len(out.sharding.device_set)}))
""")


@pytest.mark.slow
def test_sharded_attention_subprocess():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    res = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["n_shards"] == 4
    assert max(out["errs"]) < 1e-5, out  # relative: loss, then dq, dk, dv, dlog_fgate


# --------------------------------------------------------------------------------------------------
# GPU: the real Triton-lowered kernels (run on the H200 with `pytest -m gpu`)
# --------------------------------------------------------------------------------------------------

_GPU_CASES = [
    pytest.param(1, 2048, 2048, 4, 4, 64, None, False, id="T2048-D64"),
    pytest.param(1, 4096, 4096, 2, 2, 128, None, False, id="T4096-D128"),
    pytest.param(2, 1000, 1500, 4, 2, 128, (0, 333), True, id="T1500-D128-gqa-seqstart-seg"),
    pytest.param(2, 777, 777, 4, 4, 64, (100, 0), False, id="T777-D64-seqstart"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b,tq,tk,h,hkv,d,seq_start,segments", _GPU_CASES)
def test_gpu_kernels_match_reference(b, tq, tk, h, hkv, d, seq_start, segments):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    dtype = jnp.bfloat16
    q, k, v, lf, w = _inputs(b, tq, tk, h, hkv, d, dtype, seed=tk + d)
    ss = None if seq_start is None else jnp.asarray(seq_start, jnp.int32)
    seg = None
    if segments:
        t = jnp.arange(tk)
        seg = jnp.broadcast_to(((t >= 500).astype(jnp.int32) + (t >= 1200)), (b, tk))
    _check_pallas_against_reference(q, k, v, lf, w, dtype, seq_start=ss, segment_ids=seg)


@pytest.mark.gpu
def test_gpu_acp_auto_and_minus_inf():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, k, v, lf, w = _acp_inputs(b=1, t=4096, h=8, d=128)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    run = lambda thr: _value_and_grads(lambda *a: forgetting_attention(  # noqa: E731
        *a, adaptive_threshold=thr, implementation="pallas"), q, k, v, lf, w)
    base, minus_inf, auto = run(None), run(-jnp.inf), run("auto")
    for a, b in zip(jax.tree_util.tree_leaves(base), jax.tree_util.tree_leaves(minus_inf)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    _assert_close("o", auto[0], base[0], 2e-2)
    for name, a, b in zip(("dq", "dk", "dv", "dlog_fgate"), auto[1], base[1]):
        _assert_close(name, a, b, 3e-2)


def test_grid_order_rule_of_the_default_configs():
    """The D=128 default interleaves the dense backward from Tk = 16384 on (measured −6 % there, a loss
    below); the forward stays block-major; ACP ranges or explicit settings take precedence."""
    import dataclasses

    from fox_jax.kernels.forgetting_attention import _interleave, default_config

    c = default_config(128)
    assert c.interleave_bwd_from == 16384 and c.dkv.num_stages == 4
    assert not _interleave(c, c.fwd, None, tk=32768)
    assert not _interleave(c, c.dq, None, backward=True, tk=8192)
    assert _interleave(c, c.dq, None, backward=True, tk=16384) and _interleave(c, c.dkv, None, backward=True, tk=16384)
    assert _interleave(c, c.fwd, object())                                   # ACP ranges
    assert not _interleave(dataclasses.replace(c, interleave_heads=False), c.dkv, None, backward=True, tk=16384)
    assert _interleave(c, dataclasses.replace(c.fwd, interleave_heads=True), None)
    assert default_config(64).interleave_bwd_from is None


@pytest.mark.parametrize("d, window_size", [(64, None), (128, None), (256, None), (128, 300)])
def test_kernels_lower_to_triton_for_cuda(d, window_size):
    """The GPU path (default tiles, interpret=False) lowers for CUDA on this CPU machine — Pallas →
    Triton IR of the forward, dQ and dK/dV kernels with ACP ranges, seq_start and document skipping
    (and a sliding window) — so a change that breaks the Triton lowering fails here, not first on the GPU."""
    b, t, h, hkv = 2, 1000, 4, 2

    def loss(q, k, v, lam, ss, seg, delta):
        o = fpallas.attention(q, k, v, lam, ss, seg, delta, scale=d ** -0.5, interpret=False, window_size=window_size)
        return jnp.sum(o.astype(jnp.float32))

    shapes = [((b, t, h, d), jnp.bfloat16), ((b, t, hkv, d), jnp.bfloat16), ((b, t, hkv, d), jnp.bfloat16),
              ((b, t, h), jnp.float32), ((b,), jnp.int32), ((b, t), jnp.int32), ((b, h), jnp.float32)]
    args = [jax.ShapeDtypeStruct(s, dt) for s, dt in shapes]
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 3


def test_bench_ideal_prunable_fraction_past_int32():
    """bench_attention.ideal_prunable_fraction at the 760M layer's size (B1 H24 T16384: 3.2e9 causal pairs, more
    than an int32 sum holds; it once printed −0.501): with Λ falling by 1 per token and δ = −5.5, row i keeps its
    last 6 keys (Λ_i − Λ_j = j − i ≥ −5), so the pruned fraction is 1 − (6·T − 15) / (T(T+1)/2) exactly."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import bench_attention as bench
    finally:
        sys.path.pop(0)
    b, t, h = 1, 16384, 24
    lam = -jnp.broadcast_to(jnp.arange(t, dtype=jnp.float32)[None, :, None], (b, t, h))
    got = float(bench.ideal_prunable_fraction(lam, jnp.full((b, h), -5.5)))
    want = 1 - (6 * t - 15) / (t * (t + 1) / 2)
    assert abs(got - want) < 1e-6, (got, want)
