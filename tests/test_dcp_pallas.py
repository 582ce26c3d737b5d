"""DCP attention on the Pallas kernels (``dcp_attention(..., implementation="pallas")``), interpret mode
on CPU: outputs and the gradients into q, k, v, the log mask and the forget gates against the dense
float32 oracle, tile skipping, and the CUDA (Triton) lowering of all four kernels.

Tolerances: as tests/test_context_pruning.py (float32 on both sides, different summation order and tile
order): 2e-5 on outputs, 5e-5·(1 + max|ref|) absolute + 1e-4 relative on gradients; bfloat16 inputs
3e-2 on O(1) outputs (bf16 has 8 mantissa bits; P is rounded to bf16 before P·V as on the GPU).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.ops import pallas as fpallas
from fox_jax.ops.context_pruning import (
    LOG_FLOOR,
    cumulative_keep_log_mask,
    dcp_attention,
    dcp_attention_reference,
    dropped_key_blocks,
    exclude_dropped,
    keep_logits,
    visible_pairs,
)
from fox_jax.ops.reference import decay_cumsum
from fox_jax.ops.tiles import TileVisits


def _inputs(rng, b, tq, tk, h, hkv, d, dtype=jnp.float32, beta=0.5, alpha=1.5):
    q = jnp.asarray(rng.normal(size=(b, tq, h, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, tk, hkv, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, tk, hkv, d)), dtype)
    z = keep_logits(jnp.asarray(rng.normal(size=(b, tk, 8)), jnp.float32),
                    jnp.asarray(rng.normal(size=(b, tk, 8)), jnp.float32), beta)
    log_mask = cumulative_keep_log_mask(z, alpha)[:, tk - tq:]
    log_fgate = jax.nn.log_sigmoid(jnp.asarray(rng.normal(1.0, 2.0, size=(b, tk, h)), jnp.float32))
    return q, k, v, log_mask, log_fgate


def _out_and_grads(fn, args):
    def loss(*a):
        o = fn(*a)
        w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))
        return jnp.sum(w * o.astype(jnp.float32)), o

    (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return o, g


CASES = {  # b, tq, tk, h, hkv, d, gates, segments (MHA at an awkward T, gated, with gradients:
    # test_rows_without_kept_pair_agree_across_implementations_and_tilings)
    "gqa_segments": (2, 30, 30, 4, 2, 8, False, True),
    "decode_alignment_gated": (2, 13, 37, 4, 2, 16, True, False),
    "d64_gated_segments": (1, 50, 50, 2, 1, 64, True, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_pallas_dcp_matches_dense_with_gradients(case):
    b, tq, tk, h, hkv, d, gated, segmented = CASES[case]
    rng = np.random.default_rng(21)
    q, k, v, lm, lf = _inputs(rng, b, tq, tk, h, hkv, d)
    seg = jnp.asarray(np.stack([np.arange(tk) // 11, np.arange(tk) // 7])[:b]) if segmented else None
    args = (q, k, v, lm) + ((lf,) if gated else ())

    def fast(q, k, v, m, *lf):
        return dcp_attention(q, k, v, m, *lf, segment_ids=seg, implementation="pallas")

    def ref(q, k, v, m, *lf):
        return dcp_attention_reference(q, k, v, m, *lf, segment_ids=seg)

    o, g = _out_and_grads(fast, args)
    o_ref, g_ref = _out_and_grads(ref, args)
    assert o.shape == q.shape and o.dtype == q.dtype
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=2e-5)
    for name, a, r in zip(("q", "k", "v", "log_mask", "log_fgate"), g, g_ref):
        assert np.all(np.isfinite(np.asarray(a))), name
        np.testing.assert_allclose(a, r, atol=5e-5 * (1 + float(jnp.abs(r).max())), rtol=1e-4, err_msg=name)
    assert float(jnp.abs(g_ref[3]).max()) > 1e-3  # the mask gradient is exercised


@pytest.mark.slow
def test_pallas_dcp_equals_xla_blockwise_and_bfloat16():
    rng = np.random.default_rng(22)
    q, k, v, lm, lf = _inputs(rng, 2, 41, 41, 2, 2, 32)
    xla = jax.jit(lambda *a: dcp_attention(*a, block_q=16, block_k=8))(q, k, v, lm, lf)
    pallas = jax.jit(lambda *a: dcp_attention(*a, implementation="pallas"))  # one compilation per dtype
    pal = pallas(q, k, v, lm, lf)
    np.testing.assert_allclose(pal, xla, atol=2e-5)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = pallas(qb, kb, vb, lm, lf)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), jax.jit(dcp_attention_reference)(qb, kb, vb, lm, lf),
                               atol=3e-2)


def test_pallas_dcp_never_loads_dropped_tiles():
    """Keys of a tile every kernel flags as dropped are poisoned with NaN: rows of that query block stay
    finite with skipping (the tile is never loaded) and turn NaN without it (the test can fail)."""
    rng = np.random.default_rng(23)
    b, t, h, d = 1, 96, 2, 16
    q, k, v, lm, _ = _inputs(rng, b, t, t, h, h, d, beta=-2.0, alpha=2.0)
    cfg = fpallas.resolve_config(d, t, t)
    fwd = cfg.fwd
    flags = np.asarray(dropped_key_blocks(lm, fwd.block_q, fwd.block_k))[0]
    m, n = next((m, n) for m in range(flags.shape[0]) for n in range(m * fwd.block_q // fwd.block_k)
                if flags[m, n])  # a causal, fully dropped tile of the forward tiling
    keys = slice(n * fwd.block_k, (n + 1) * fwd.block_k)
    rows = slice(m * fwd.block_q, min((m + 1) * fwd.block_q, t))
    v_bad = v.at[:, keys].set(jnp.nan)
    o_skip = jax.jit(lambda *a: dcp_attention(*a, implementation="pallas"))(q, k, v_bad, lm)
    o_full = jax.jit(lambda *a: dcp_attention(*a, implementation="pallas", skip_dropped=False))(q, k, v_bad, lm)
    assert np.all(np.isfinite(np.asarray(o_skip[:, rows])))
    assert np.any(np.isnan(np.asarray(o_full[:, rows])))
    np.testing.assert_allclose(o_skip[:, rows], jax.jit(dcp_attention_reference)(q, k, v, lm)[:, rows], atol=2e-5)


def test_pallas_dcp_errors():
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="implementation"):
        dcp_attention(q, q, q, jnp.zeros((1, 8, 8)), implementation="cudnn")
    with pytest.raises(ValueError, match="finite floor"):
        dcp_attention(q, q, q, jnp.zeros((1, 8, 8)), implementation="pallas", floor=-jnp.inf)


@pytest.mark.parametrize("d", [64, 128])
def test_pallas_dcp_lowers_to_triton(d):
    """The GPU path (default tiles, interpret=False) lowers for CUDA on this CPU machine: four Triton
    kernels (forward, dQ, dK/dV, dlogI) in the gradient of a packed, gated, GQA call."""
    b, t, h, hkv = 2, 1000, 8, 4

    def loss(q, k, v, m, lam, seg):
        o = fpallas.dcp_attention(q, k, v, m, lam, seg, scale=d ** -0.5, floor=LOG_FLOOR, interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    shapes = [((b, t, h, d), jnp.bfloat16), ((b, t, hkv, d), jnp.bfloat16), ((b, t, hkv, d), jnp.bfloat16),
              ((b, t, t), jnp.float32), ((b, t, h), jnp.float32), ((b, t), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, dt) for s, dt in shapes]
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 4


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_pallas_dcp_matches_xla(d):
    """On the GPU (Triton lowering, default tiles): bf16 inputs, gated, packed; outputs and gradients
    of the Pallas path against the blockwise XLA path on the same inputs. Tolerance: both round P to
    bf16 before P·V, in different tile orders: 2e-2 on O(1) outputs, 2e-2·(1 + max|ref|) on gradients."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(d)
    b, t, h, hkv = 2, 1000, 4, 2
    q, k, v, lm, lf = _inputs(rng, b, t, t, h, hkv, d, jnp.bfloat16, beta=-0.5, alpha=4.0)
    seg = jnp.asarray(np.repeat((np.arange(t) >= 600).astype(np.int32)[None], b, 0))
    args = (q, k, v, lm, lf)
    got = _out_and_grads(lambda *a: dcp_attention(*a, segment_ids=seg, implementation="pallas"), args)
    want = _out_and_grads(lambda *a: dcp_attention(*a, segment_ids=seg), args)
    for name, a, r in zip(("o", "q", "k", "v", "log_mask", "log_fgate"), (got[0], *got[1]), (want[0], *want[1])):
        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a, r, atol=2e-2 * (1 + np.abs(r).max()), err_msg=name)


@pytest.mark.slow
def test_bench_dcp_quick(tmp_path):
    """benchmarks/bench_dcp.py --quick runs on CPU and writes its JSON (--no-xla: the Pallas rows; the XLA
    row would compile and time the blockwise op again, which the tests above check)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dcp.py"
    spec = importlib.util.spec_from_file_location("bench_dcp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "dcp.json"
    assert mod.main(["--quick", "--no-xla", "--grid-orders", "--sparsities", "0.9", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert 0.8 < row["sparsity"] < 1.0
    assert set(row["ms"]) == {f"{n}|{m}" for n in ("pallas", "pallas heads interleaved", "pallas heads apart",
                                                                     "dense pallas (no mask)")
                              for m in ("fwd", "fwd_bwd")}
    assert all(ms is not None and ms > 0 for ms in row["ms"].values())


@pytest.mark.parametrize("argv", [["--shapes", "1x64x2"], ["--shapes", "1x64x2x16,8"], ["--sparsities", "1.5"],
                                  ["--sparsities", "0.5,x"]])
def test_bench_dcp_refuses_bad_shapes_and_sparsities(argv, capsys, tmp_path):
    """bench_dcp.py: a malformed --shapes entry or a sparsity outside (0, 1) is a one-line error naming the flag
    (it was a traceback, or a run labelled 100%)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dcp.py"
    spec = importlib.util.spec_from_file_location("bench_dcp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as e:
        mod.main(["--quick", "--no-xla", "--out", str(tmp_path / "x.json"), *argv])
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_dcp_config_interleaves_heads_where_the_mask_leaves_l2():
    """``resolve_dcp_config``'s default grid order: the heads of a block consecutive once one batch row's float32
    mask (4·Tq·Tk bytes) exceeds ``DCP_INTERLEAVE_MASK_BYTES``, on a GPU and in interpret mode alike; the
    D > 64 backward's two stages on a GPU only; a config given is kept as it is."""
    import dataclasses

    from fox_jax.ops import pallas as fpallas

    limit = fpallas.DCP_INTERLEAVE_MASK_BYTES
    for interpret in (False, True):
        assert fpallas.resolve_dcp_config(64, 16384, 16384, interpret=interpret).interleave_heads is True
        assert fpallas.resolve_dcp_config(64, 2048, 2048, interpret=interpret).interleave_heads is None
        t = int((limit / 4) ** 0.5)
        assert fpallas.resolve_dcp_config(64, t, t, interpret=interpret).interleave_heads is None
        assert fpallas.resolve_dcp_config(64, t + 1, t + 1, interpret=interpret).interleave_heads is True
    gpu = fpallas.resolve_dcp_config(128, 16384, 16384, interpret=False)
    assert gpu.dq.num_stages <= 2 and gpu.dkv.num_stages <= 2
    given = dataclasses.replace(fpallas.resolve_config(64, 16384, 16384, interpret=False), interleave_heads=False)
    assert fpallas.resolve_dcp_config(64, 16384, 16384, given, interpret=False).interleave_heads is False


def _mask_with_empty_rows(rng, b, t):
    """log I with random kept values, random dropped pairs, and query rows whose every visible key is
    at the floor (diagonal included): rows 8..15 (one whole 8-row tile; half of a 16-row tile), row 21
    alone (its tiles are partly live for every block size) and the last row."""
    lm = np.where(rng.uniform(size=(b, t, t)) < 0.3, LOG_FLOOR, -rng.uniform(0.0, 3.0, (b, t, t)))
    lm[:, 8:16] = LOG_FLOOR
    lm[:, 21] = LOG_FLOOR
    lm[:, t - 1] = LOG_FLOOR
    return jnp.asarray(lm, jnp.float32), np.array(sorted({*range(8, 16), 21, t - 1}))


@pytest.mark.slow
def test_rows_without_kept_pair_agree_across_implementations_and_tilings():
    """Every implementation and tiling: dropped pairs weigh 0, and a row whose every visible key is at
    the floor outputs 0 — whether its tiles are wholly dropped (skipped) or only partly (visited) —
    with all five gradients finite and equal to the dense reference's. Tolerances as the module's."""
    rng = np.random.default_rng(24)
    b, t, h, d = 2, 40, 2, 16
    q, k, v, _, lf = _inputs(rng, b, t, t, h, h, d)
    lm, empty = _mask_with_empty_rows(rng, b, t)
    args = (q, k, v, lm, lf)
    o_ref, g_ref = _out_and_grads(dcp_attention_reference, args)
    np.testing.assert_array_equal(np.asarray(o_ref)[:, empty], 0.0)
    np.testing.assert_array_equal(np.asarray(g_ref[0])[:, empty], 0.0)  # dq of the empty rows
    assert float(jnp.abs(g_ref[3]).max()) > 1e-3 and float(jnp.abs(g_ref[4]).max()) > 1e-3
    flags = np.asarray(dropped_key_blocks(lm, 8, 8))
    assert flags[:, 1, :2].all() and not flags[:, 2, :2].all()  # rows 8..15 skipped at 8x8, row 21 not
    # XLA 16x8 and 8x8 without skipping on such masks (empty rows, a weakly kept row, −inf masks): the
    # same block loops without gates in test_context_pruning.py::test_dropped_pairs_weigh_zero_for_every_tiling,
    # and with gates at 16x8 in its test_dcp_attention_fgate_matches_dense_with_gradients
    impls = {f"xla {bq}x{bk}": dict(block_q=bq, block_k=bk) for bq, bk in [(8, 8), (8, 16), (32, 32), (128, 128)]}
    impls["pallas"] = dict(implementation="pallas")
    impls["pallas no skipping"] = dict(implementation="pallas", skip_dropped=False)
    for name, kw in impls.items():
        o, g = _out_and_grads(lambda *a, kw=kw: dcp_attention(*a, **kw), args)
        np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=2e-5, err_msg=name)
        np.testing.assert_array_equal(np.asarray(o)[:, empty], 0.0, err_msg=name)
        for gname, a, r in zip(("q", "k", "v", "log_mask", "log_fgate"), g, g_ref):
            assert np.all(np.isfinite(np.asarray(a))), (name, gname)
            np.testing.assert_allclose(a, r, atol=5e-5 * (1 + float(jnp.abs(r).max())), rtol=1e-4,
                                       err_msg=f"{name} d{gname}")


# The kernels' tile lists at the kernel level: seq_start and a sliding window too -----------------------

def _extra_visible(tq, tk, seq_start, segment_ids, window_size):
    """[B, Tq, Tk] bool: causal (bottom-right), same document, keys ≥ seq_start, inside the window."""
    vis = np.asarray(visible_pairs(tq, tk, None if segment_ids is None else jnp.asarray(segment_ids)))
    vis = vis & (np.arange(tk)[None, None, :] >= np.asarray(seq_start)[:, None, None])
    if window_size is not None:
        lag = (tk - tq + np.arange(tq))[:, None] - np.arange(tk)[None, :]
        vis = vis & (lag < window_size)[None]
    return vis


def _kernel_dense(q, k, v, log_fgate, log_mask, keep):
    """Dense float32 oracle over the pairs ``keep`` [B, Tq, Tk] (visible and kept); rows without one are 0."""
    b, tq, h, d = q.shape
    tk, group = k.shape[1], h // k.shape[2]
    kf, vf = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))
    s = jnp.einsum("bihd,bjhd->bhij", q.astype(jnp.float32), kf, precision=jax.lax.Precision.HIGHEST) * d ** -0.5
    lam = decay_cumsum(log_fgate).transpose(0, 2, 1)
    s = s + lam[:, :, tk - tq:, None] - lam[:, :, None, :] + log_mask[:, None]
    keep = jnp.asarray(keep)[:, None]
    p = jax.nn.softmax(jnp.where(keep, s, jnp.finfo(jnp.float32).min), axis=-1) * keep
    return jnp.einsum("bhij,bjhd->bihd", p, vf, precision=jax.lax.Precision.HIGHEST)


def _structured_mask(rng, b, tq, tk):
    """log I with the old keys of late queries mostly dropped (whole tiles die), random drops elsewhere,
    soft kept values, and one query row with every key dropped."""
    lag = (tk - tq + np.arange(tq))[:, None] - np.arange(tk)[None, :]
    drop = np.where(lag[None] > 24, rng.uniform(size=(b, tq, tk)) < 0.97, rng.uniform(size=(b, tq, tk)) < 0.2)
    lm = np.where(drop, LOG_FLOOR, -rng.uniform(0.0, 3.0, (b, tq, tk)))
    lm[:, tq // 2] = LOG_FLOOR
    return jnp.asarray(lm, jnp.float32)


KERNEL_CASES = {  # dtype, window_size, dcp_unmasked_interior, interleave_heads (grid order)
    "f32": (jnp.float32, None, True, None),
    "f32_window": (jnp.float32, 40, True, None),
    "f32_all_tiles_masked": (jnp.float32, None, False, None),
    "f32_heads_interleaved": (jnp.float32, None, True, True),
    "bf16": (jnp.bfloat16, None, True, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
def test_kernel_tile_lists_match_dense_with_gradients(case):
    """``kernel_attention`` with DCP tile lists, GQA, Tq < Tk (neither a multiple of the blocks), packed
    documents, seq_start and (one case) a window, interpret mode, against the dense float32 oracle:
    outputs and gradients into q, k, v, log_fgate and the mask. Checks that the case has skipped tiles,
    listed tiles without the element mask (except the all-masked case) and an all-dropped row.

    Tolerances: float32 as the module's; bfloat16 inputs (q, k, v, o, dq, dk, dv in bf16, P rounded to
    bf16 before each matmul as on the GPU) 3e-2 on O(1) outputs and 1e-2·(1 + max|ref|) on gradients,
    against the oracle on the same bf16-rounded inputs (measured: 8e-3 on outputs, at most 1.2e-2 on
    gradients whose max|ref| is 10–20, i.e. 4–10× inside)."""
    dtype, window, split, interleave = KERNEL_CASES[case]
    b, tq, tk, h, hkv, d = 2, 45, 61, 4, 2, 16
    rng = np.random.default_rng(31)
    q = jnp.asarray(rng.normal(size=(b, tq, h, d)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(b, tk, hkv, d)), dtype) for _ in range(2))
    lf = jax.nn.log_sigmoid(jnp.asarray(rng.normal(2.0, 1.0, size=(b, tk, h)), jnp.float32))
    lm = _structured_mask(rng, b, tq, tk)
    ss = jnp.asarray([0, 9], jnp.int32)
    seg = np.stack([np.arange(tk) >= 16, np.zeros(tk, bool)]).astype(np.int32)  # two documents; one
    keep = _extra_visible(tq, tk, np.asarray(ss), seg, window) & (np.asarray(lm) > LOG_FLOOR)
    kept_rows = jnp.asarray(keep.any(axis=-1))
    assert not np.asarray(kept_rows).all()  # an all-dropped row (it outputs 0)
    config = dataclasses.replace(fpallas.resolve_config(d, tq, tk), dcp_unmasked_interior=split,
                                 interleave_heads=interleave)
    visits = fpallas.kernel_visits(config, tq, tk, seq_start=ss, segment_ids=jnp.asarray(seg), log_mask=lm,
                                   floor=LOG_FLOOR, window_size=window)
    _, n_masked, count = (np.asarray(x) for x in visits.fwd.key_lists(jnp.asarray(seg), masked_first=split))
    causal = np.asarray(TileVisits(tq, tk, config.fwd.block_q, config.fwd.block_k).visited())
    assert count.sum() < causal.sum() * b  # some causal tiles are skipped
    assert (n_masked < count).any() == split  # some listed tiles run without the element mask

    def fast(q, k, v, lf, m):
        m = exclude_dropped(m, LOG_FLOOR, LOG_FLOOR - 1e30)
        return fpallas.kernel_attention(q, k, v, decay_cumsum(lf), m, jnp.asarray(seg), visits, kept_rows,
                                        d ** -0.5, config, True)

    args = (q, k, v, lf, lm)
    o, g = _out_and_grads(fast, args)
    o_ref, g_ref = _out_and_grads(lambda *a: _kernel_dense(*a, keep), args)
    assert o.dtype == dtype
    np.testing.assert_array_equal(np.asarray(o)[~np.asarray(kept_rows)], 0.0)
    o_tol, g_tol, g_rtol = (2e-5, 5e-5, 1e-4) if dtype == jnp.float32 else (3e-2, 1e-2, 0.0)
    np.testing.assert_allclose(np.asarray(o, np.float32), o_ref, atol=o_tol, rtol=o_tol)
    for name, a, r in zip(("q", "k", "v", "log_fgate", "log_mask"), g, g_ref):
        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a, r, atol=g_tol * (1 + float(np.abs(r).max())), rtol=g_rtol, err_msg=name)
    assert float(jnp.abs(g_ref[4]).max()) > 1e-3  # the mask gradient is exercised


@pytest.mark.gpu
@pytest.mark.parametrize("masked_first", [True, False])
def test_gpu_kernel_rows_whose_first_tiles_hold_only_dropped_pairs(masked_first):
    """On the GPU (Triton lowering, default tiles), both tile orders: keys older than a lag of 300 are
    dropped, so a late row's oldest listed tile holds only dropped pairs (its neighbours in the block keep
    some) and the forward's running max starts at a dropped score near -1e30. A base change written as one
    FMA (s·log2e − m·log2e) keeps m·log2e's rounding error (~1e23) and returned NaN there (found in
    interpret mode, 2026-12-02). Outputs and gradients against the dense float32 oracle; tolerances as
    test_gpu_pallas_dcp_matches_xla (bf16 inputs)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    b, t, h, hkv, d = 1, 900, 4, 2, 64
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.bfloat16) for n in (h, hkv, hkv))
    lf = jax.nn.log_sigmoid(jnp.asarray(rng.normal(3.0, 1.0, size=(b, t, h)), jnp.float32))
    lag = np.arange(t)[:, None] - np.arange(t)[None, :]
    drop = (lag > 300) | (rng.uniform(size=(b, t, t)) < 0.2)
    lm = jnp.asarray(np.where(drop, LOG_FLOOR, -rng.uniform(0.0, 3.0, (b, t, t))), jnp.float32)
    keep = np.asarray(visible_pairs(t, t, None)) & (np.asarray(lm) > LOG_FLOOR)
    kept_rows = jnp.asarray(keep.any(axis=-1))
    config = dataclasses.replace(fpallas.resolve_config(d, t, t), dcp_unmasked_interior=masked_first)
    visits = fpallas.kernel_visits(config, t, t, log_mask=lm, floor=LOG_FLOOR)

    def fast(q, k, v, lf, m):
        m = exclude_dropped(m, LOG_FLOOR, LOG_FLOOR - 1e30)
        return fpallas.kernel_attention(q, k, v, decay_cumsum(lf), m, None, visits, kept_rows, d ** -0.5,
                                        config, False)

    args = (q, k, v, lf, lm)
    o, g = _out_and_grads(fast, args)
    o_ref, g_ref = _out_and_grads(lambda *a: _kernel_dense(*a, keep), args)
    for name, a, r in zip(("o", "q", "k", "v", "log_fgate", "log_mask"), (o, *g), (o_ref, *g_ref)):
        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a, r, atol=2e-2 * (1 + np.abs(r).max()), err_msg=name)


def test_auto_implementation_and_config_values(monkeypatch):
    """``implementation="auto"`` (the default of the op and of both model configs) is Pallas on a GPU
    for a finite floor and D ≤ 256, XLA otherwise; saved configs with "xla" / "pallas" still load."""
    from fox_jax import config as fox_config
    from fox_jax.ops.context_pruning import IMPLEMENTATIONS, resolve_implementation

    assert fox_config.DCP_IMPLS == IMPLEMENTATIONS
    assert resolve_implementation("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")
    assert resolve_implementation("pallas") == "pallas" and resolve_implementation("xla") == "xla"
    with pytest.raises(ValueError, match="implementation"):
        resolve_implementation("cudnn")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_implementation("auto") == "pallas"
    assert resolve_implementation("auto", floor=-jnp.inf) == "xla"
    assert resolve_implementation("auto", head_dim=512) == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert resolve_implementation("auto") == "xla"
    for cls in (fox_config.ModelConfig, fox_config.GPT2Config):
        assert cls().dcp_impl == "auto"
        for impl in ("xla", "pallas"):
            saved = {**cls().to_dict(), "dcp_impl": impl}
            assert fox_config.config_from_dict(saved).dcp_impl == impl
        with pytest.raises(ValueError, match="dcp_impl"):
            cls(dcp_impl="cudnn")
