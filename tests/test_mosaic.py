"""Tests of ``implementation="mosaic"``: the Hopper Mosaic GPU kernels (kernels/forgetting_attention_mgpu.py):
the forward, dQ and dK/dV kernels (or, with ``MosaicConfig(backward=False)``, the Triton backward kernels).

The Mosaic kernel cannot run off an sm_90 GPU (Mosaic GPU has no interpret mode for warp-specialised
kernels), so on CPU:
* the whole op (forward kernel + dQ, dK/dV kernels) is *lowered* for CUDA over a grid of options — the
  Mosaic lowering runs in Python and checks layouts, wgmma shapes, barrier and TMA arguments, so an
  API or layout mistake fails here, not first on the GPU;
* the algorithm (the same tiles, 2·block_q rows × block_k keys, the same skip rule: TileVisits row
  ranges; masks on the seq_start edge, the causal diagonal, document edges (the interior tiles of a document,
  ``document_runs``, run unmasked: checked against a brute force here), every tile with a window)
  is the blockwise XLA path at the Mosaic tiling, checked against the dense float32 oracle;
* the op's refusals (CPU, float32, D > 128) and what `"auto"` picks on a (faked) Hopper device.
``-m gpu`` runs the kernel on the H200 against the dense float32 oracle (outputs and all four
gradients) over awkward shapes, and checks ACP(δ = −∞) is bitwise dense.

Tolerances as tests/test_pallas.py (relative to the reference's max magnitude): bf16 2e-2 output,
3e-2 gradients; fp16 1e-2 / 1.5e-2 — P is rounded to the input dtype before the P·V matmul.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from fox_jax.kernels import MosaicConfig, default_mosaic_config
from fox_jax.kernels import forgetting_attention_mgpu as mgpu
from fox_jax.ops import forgetting_attention, forgetting_attention_reference
from fox_jax.ops import acp as acp_lib
from fox_jax.ops import pallas as fpallas
from fox_jax.ops.reference import decay_cumsum
from fox_jax.ops.tiles import tile_visits

from _attention_checks import TOL as _TOL, assert_close as _assert_close, inputs as _inputs  # noqa: E402
from _attention_checks import check_against_reference as _check_against_reference  # noqa: E402
from _attention_checks import value_and_grads as _value_and_grads  # noqa: E402


def _segments(b, tk, cuts):
    t = jnp.arange(tk)
    return jnp.broadcast_to(sum((t >= c).astype(jnp.int32) for c in cuts), (b, tk))


# ---------------------------------------------------------------------------------------------------
# CPU: lowering for CUDA
# ---------------------------------------------------------------------------------------------------


def _lower_op(b, tq, tk, h, hkv, d, dtype, *, seq_start=True, segments=False, acp=False, window_size=None,
              config=None):
    cfg = fpallas.resolve_config(d, tq, tk, None, interpret=False)
    cfg = dataclasses.replace(cfg, mosaic=config or mgpu.default_mosaic_config(64 if d <= 64 else 128))

    def loss(q, k, v, lam, ss, seg, delta):
        visits = fpallas.kernel_visits(cfg, tq, tk, seq_start=ss, lam=lam if acp else None,
                                       delta=delta if acp else None, segment_ids=seg, window_size=window_size)
        o = fpallas.kernel_attention(q, k, v, lam, None, seg, visits, None, d ** -0.5, cfg, False)
        return jnp.sum(o.astype(jnp.float32))

    args = [jax.ShapeDtypeStruct((b, tq, h, d), dtype), jax.ShapeDtypeStruct((b, tk, hkv, d), dtype),
            jax.ShapeDtypeStruct((b, tk, hkv, d), dtype), jax.ShapeDtypeStruct((b, tk, h), jnp.float32),
            jax.ShapeDtypeStruct((b,), jnp.int32) if seq_start else None,
            jax.ShapeDtypeStruct((b, tk), jnp.int32) if segments else None,
            jax.ShapeDtypeStruct((b, h), jnp.float32)]
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    return jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("b,tq,tk,h,hkv,d,dtype,opts", [
    pytest.param(2, 1000, 1000, 4, 2, 64, jnp.bfloat16, dict(acp=True), id="d64-gqa-acp-seqstart"),
    pytest.param(1, 700, 1300, 2, 2, 128, jnp.bfloat16, dict(segments=True), id="d128-tq<tk-segments"),
    pytest.param(1, 256, 256, 2, 1, 128, jnp.float16, dict(seq_start=False), id="d128-fp16-mqa"),
    pytest.param(2, 300, 300, 2, 2, 48, jnp.bfloat16, dict(window_size=100), id="d48-padded-window"),
    pytest.param(1, 512, 512, 2, 2, 64, jnp.bfloat16,
                 dict(config=MosaicConfig(128, 64, 4, bwd_block_q=128, bwd_stages=3)), id="d64-bq128-bk64"),
    pytest.param(2, 1000, 1000, 4, 2, 128, jnp.bfloat16, dict(acp=True, segments=True,
                 config=MosaicConfig(backward=False)), id="d128-triton-backward"),
    pytest.param(2, 600, 600, 2, 2, 64, jnp.bfloat16, dict(segments=True, config=MosaicConfig(bwd_pingpong=True)),
                 id="d64-pingpong-segments"),
    pytest.param(1, 512, 512, 2, 2, 128, jnp.bfloat16, dict(window_size=200, config=MosaicConfig(64, 128, 2)),
                 id="d128-no-pingpong-window"),
    # ≥ STATIC_FRAME_MIN_KEYS keys: the forward with its fixed-frame loop (and documents, ACP around it)
    pytest.param(1, 4096, 4096, 2, 2, 64, jnp.bfloat16, dict(acp=True, segments=True), id="d64-t4096-static-frame"),
    # dQ inside the dK/dV kernel (TMA reduce-add stores), in its two forms: column halves over both warpgroups'
    # keys (with the ping-pong: GQA with ACP at D128, Tq < Tk with documents) and each warpgroup's own keys
    # (without: ACP at D64, fp16 with a window at D128)
    pytest.param(2, 1000, 1000, 4, 2, 128, jnp.bfloat16,
                 dict(acp=True, config=MosaicConfig(bwd_fused_dq=True, bwd_pingpong=True)), id="d128-gqa-acp-fused-dq"),
    pytest.param(2, 600, 600, 4, 4, 64, jnp.bfloat16, dict(acp=True, config=MosaicConfig(bwd_fused_dq=True)),
                 id="d64-acp-fused-dq-own-keys"),
    pytest.param(1, 700, 1300, 2, 2, 96, jnp.bfloat16,
                 dict(segments=True, config=MosaicConfig(bwd_fused_dq=True, bwd_pingpong=True)),
                 id="d96-tq<tk-segments-fused-dq"),
    pytest.param(1, 512, 512, 2, 2, 128, jnp.float16, dict(window_size=200, config=MosaicConfig(bwd_fused_dq=True)),
                 id="d128-fp16-window-fused-dq-own-keys"),
    # three forward warpgroups (192-row tiles; T not a multiple of them), documents, ACP, GQA
    pytest.param(2, 1000, 1000, 4, 2, 64, jnp.bfloat16, dict(acp=True, segments=True, config=MosaicConfig(
        64, 128, 3, forward_wgs=3)), id="d64-gqa-acp-segments-three-warpgroups"),
])
def test_op_lowers_for_cuda(b, tq, tk, h, hkv, d, dtype, opts):
    """Forward and backward lower for CUDA here: three Mosaic GPU kernels (forward, dQ, dK/dV), two with dQ in
    the dK/dV kernel (``bwd_fused_dq``, the default at D128: its TMA reduce-add stores into aliased float32
    accumulators), or the Mosaic forward with the two Triton backward kernels (``MosaicConfig(backward=False)``)."""
    text = _lower_op(b, tq, tk, h, hkv, d, dtype, **opts)
    calls = text.count("stablehlo.custom_call @mosaic_gpu")
    forward = re.search(r"custom_call @mosaic_gpu\w*\(([^)]*)\)", text).group(1)  # the first call: the forward
    framed = (dtype == jnp.bfloat16 and tk >= mgpu.STATIC_FRAME_MIN_KEYS and opts.get("window_size") is None
              and (opts.get("config") or MosaicConfig()).static_frame)
    # q, k, v, Λ_q, Λ_k, the ranges, seq_start, the head order (+ frames, + ids and runs)
    assert forward.count("%") == 9 + framed + 4 * bool(opts.get("segments")), forward
    triton = text.count("__gpu$xla.gpu.triton")
    config = opts.get("config") or default_mosaic_config(64 if d <= 64 else 128)
    if not config.backward:
        assert (calls, triton) == (1, 2), (calls, triton)
    elif config.bwd_fused_dq:
        assert (calls, triton) == (2, 0), (calls, triton)
        # the reduce-add stores, into the float32 accumulators (dQ, the query-side dΛ) aliased in and out
        assert "cp.reduce.async.bulk" in text and text.count("stablehlo.output_operand_alias<") == 2
    else:
        assert (calls, triton) == (3, 0), (calls, triton)


@pytest.mark.parametrize("d", [64, 128])
def test_default_backward_composes_with_vmap_and_scan(d):
    """The default kernels' gradients lower for CUDA under ``jax.vmap`` (per-example gradients, ensembles) and inside
    a ``lax.scan`` of checkpointed layers (``scan_layers``): with dQ from the dK/dV kernel (the default with
    jax ≥ 0.11: the halves form at D128, own keys at D64) the vmapped axis is folded into the batch
    (``_batch_folded``: its kernel has no batching rule) —
    two kernels under vmap (forward, fused backward), else three; the scan's body adds the recomputed forward."""
    b, t, h = 1, 512, 2
    cfg = fpallas.resolve_config(d, t, t, None, interpret=False)  # on a Hopper GPU with the head dim's defaults:
    cfg = dataclasses.replace(cfg, mosaic=default_mosaic_config(d))
    fused = cfg.mosaic.bwd_fused_dq
    assert fused is mgpu.FUSED_DQ_BY_DEFAULT and cfg.mosaic.bwd_pingpong is (d == 128)

    def attention(q, k, v, lam):
        visits = fpallas.kernel_visits(cfg, t, t, seq_start=None, lam=None, delta=None, segment_ids=None,
                                       window_size=None)
        return fpallas.kernel_attention(q, k, v, lam, None, None, visits, None, d ** -0.5, cfg, False)

    def vmapped(q, k, v, lam):
        return jnp.sum(jax.vmap(attention)(q, k, v, lam).astype(jnp.float32))

    def scanned(q, k, v, lam):
        def layer(x, _):
            return jax.checkpoint(attention)(x, k, v, lam).astype(x.dtype), None
        return jnp.sum(lax.scan(layer, q, None, length=3)[0].astype(jnp.float32))

    def kernels(loss, *shapes):
        args = [jax.ShapeDtypeStruct(s, dt) for s, dt in shapes]
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower(lowering_platforms=("cuda",))
        return text.as_text().count("@mosaic_gpu")

    x, lam = ((b, t, h, d), jnp.bfloat16), ((b, t, h), jnp.float32)
    xv, lamv = ((3, b, t, h, d), jnp.bfloat16), ((3, b, t, h), jnp.float32)
    assert kernels(vmapped, xv, xv, xv, lamv) == (2 if fused else 3)
    assert kernels(scanned, x, x, x, lam) == (3 if fused else 4)


def test_forward_outputs_are_read_through_a_barrier():
    """The forward kernel's o reaches its readers (the layer's output, the backward's residual) only through
    ``jax.lax.optimization_barrier`` (``ops.pallas._apart``): with ``scan_layers`` XLA 0.11's dynamic-slice fusion
    otherwise clones the kernel into the stacking of the residual (two forward kernels per layer on the H200)."""
    text = _lower_op(1, 256, 256, 2, 2, 64, jnp.bfloat16)
    forward = re.search(r"(%\w+):2 = stablehlo\.custom_call @mosaic_gpu", text).group(1)
    readers = [line for line in text.splitlines() if f"{forward}#0" in line and " = " in line
               and not line.strip().startswith(f"{forward}:")]
    assert readers and all("stablehlo.optimization_barrier" in line for line in readers), readers


@pytest.mark.parametrize("rows,cols", [(64, 128), (128, 64)])
def test_document_runs_are_the_blocks_inside_the_rows_document(rows, cols):
    """``document_runs`` (which tiles the kernels run without a document mask) against a brute force: every
    block of the run holds only the rows' id, the run is the first such run and is maximal, and row blocks
    spanning two documents (or padding) get none. Packed documents with cuts on and off block edges, one
    short document, padding ids, and one batch row whose ids recur out of order."""
    t = 1024
    packed = _segments(1, t, (100, 128, 640, 650, 896))[0]
    recur = jnp.where((jnp.arange(t) >= 256) & (jnp.arange(t) < 512), 7, 3)  # 3, 7, 3: two runs of id 3
    seg = jnp.stack([packed, recur]).astype(jnp.int32)
    seg_rows, seg_cols = seg.at[:, -32:].set(-1), seg.at[:, -32:].set(-2)
    lo, hi = mgpu.document_runs(seg_rows, seg_cols, rows, cols)
    r, c = np.asarray(seg_rows).reshape(2, -1, rows), np.asarray(seg_cols).reshape(2, -1, cols)
    n = c.shape[1]
    found = 0
    for b in range(2):
        for i in range(r.shape[1]):
            same = [len(set(r[b, i])) == 1 and set(c[b, j]) == set(r[b, i]) for j in range(n)]
            first = same.index(True) if any(same) else n
            end = first
            while end < n and same[end]:
                end += 1
            assert (int(lo[b, i]), int(hi[b, i])) == (first, end), (b, i)
            found += end - first
    assert found > 0  # the cases hold interior tiles


def test_head_order_puts_the_most_work_first():
    """``head_order``: None where every head has the same ranges (no head axis); otherwise a permutation with the
    heads of most blocks (summed over batch rows and tiles) first, ties in head order, and with GQA each key/value
    head's query heads together, groups by their total."""
    assert mgpu.head_order(jnp.zeros((2, 1, 8), jnp.int32), jnp.ones((2, 1, 8), jnp.int32)) is None
    blocks = jnp.asarray([3, 9, 1, 9, 5, 0], jnp.int32)  # per head, the same in both batch rows and every tile
    lo = jnp.zeros((2, 6, 4), jnp.int32)
    hi = jnp.broadcast_to(blocks[None, :, None], (2, 6, 4))
    assert mgpu.head_order(lo, hi).tolist() == [1, 3, 4, 0, 2, 5]
    # groups of 2: (3, 9) = 12, (1, 9) = 10, (5, 0) = 5
    assert mgpu.head_order(lo, hi, group=2).tolist() == [1, 0, 3, 2, 4, 5]
    # empty ranges (hi < lo) count as no work, not negative: blocks − 5 → [0, 4, 0, 4, 0, 0]
    assert mgpu.head_order(lo + 5, hi).tolist() == [1, 3, 0, 2, 4, 5]


def test_config_checks_and_smem_budget(monkeypatch):
    with pytest.raises(ValueError, match="block_q"):
        MosaicConfig(96, 128, 2)
    with pytest.raises(ValueError, match="block_k"):
        MosaicConfig(64, 512, 2)
    with pytest.raises(ValueError, match="stages"):
        MosaicConfig(64, 128, 1)
    with pytest.raises(ValueError, match="bwd_block_k"):
        MosaicConfig(bwd_block_k=32)
    assert MosaicConfig().dq_tiling == (128, 64) and MosaicConfig().dkv_tiling == (64, 128)
    for d in (64, 128):
        assert mgpu.smem_bytes(default_mosaic_config(d), d) <= mgpu.SMEM_LIMIT
        monkeypatch.setattr(mgpu, "SUMS_BY_WGMMA", True)  # (its ones tiles fit too)
        assert mgpu.smem_bytes(dataclasses.replace(default_mosaic_config(d), bwd_fused_dq=False), d) <= mgpu.SMEM_LIMIT
        monkeypatch.undo()
    # each allocation from a 1 KiB boundary: the forward at D64 holds q 16 KiB, k and v 32 KiB each, and Λ, the
    # segment ids (1 KiB each) and lse (512 B, counted as 1 KiB)
    assert mgpu.smem_bytes(MosaicConfig(backward=False), 64) == (16 + 64 + 3) * 1024
    # the backward's ping-pong where it was measured faster (D128), not at D64 (slower there)
    assert default_mosaic_config(128).bwd_pingpong and not default_mosaic_config(64).bwd_pingpong
    with pytest.raises(ValueError, match="bwd_pingpong"):
        MosaicConfig(bwd_pingpong="yes")
    with pytest.raises(ValueError, match="static_frame"):
        MosaicConfig(static_frame=1)
    with pytest.raises(ValueError, match="bwd_fused_dq"):
        MosaicConfig(bwd_fused_dq=1)
    with pytest.raises(ValueError, match="bwd_fused_dq needs bwd_block_q == bwd_block_k"):
        MosaicConfig(bwd_fused_dq=True, bwd_block_k=128)
    for wgs in (1, 4, True, 2.0):
        with pytest.raises(ValueError, match="forward_wgs must be 2 or 3"):
            MosaicConfig(forward_wgs=wgs)
    three = MosaicConfig(64, 128, 3, forward_wgs=3)  # a fourth warpgroup's q tile and lse row more
    assert three.tile_q == 192 and default_mosaic_config(64).forward_wgs == 2
    assert mgpu.smem_bytes(three, 64) - mgpu.smem_bytes(dataclasses.replace(three, forward_wgs=2), 64) <= (8 + 1) * 1024
    for d, pingpong in itertools.product((64, 128), (False, True)):  # dQ in the dK/dV kernel, either form, fits
        cfg = dataclasses.replace(default_mosaic_config(d), bwd_fused_dq=True, bwd_pingpong=pingpong)
        assert mgpu.smem_bytes(cfg, d) <= mgpu.SMEM_LIMIT, (d, pingpong)
    # ... and is the default with jax ≥ 0.11 (FUSED_DQ_BY_DEFAULT; measured faster at both head dims, in the halves
    # form at D128, in the own-keys form at D64), but for XLA's determinism flags: then the dQ kernel, reproducible
    # bit for bit
    for d in (64, 128):
        assert default_mosaic_config(d).bwd_fused_dq is mgpu.FUSED_DQ_BY_DEFAULT
        assert default_mosaic_config(d).bwd_pingpong is (d == 128)
    # ... from FUSED_DQ_MIN_QUERIES query rows on (shorter, the dQ kernel was faster), which the op passes; checked
    # with the version gate forced on, so that jax 0.10 checks the rule too
    monkeypatch.setattr(mgpu, "FUSED_DQ_BY_DEFAULT", True)
    n = mgpu.FUSED_DQ_MIN_QUERIES
    assert default_mosaic_config(128, n).bwd_fused_dq and default_mosaic_config(128).bwd_fused_dq
    assert not default_mosaic_config(128, n - 1).bwd_fused_dq and not default_mosaic_config(64, n - 1).bwd_fused_dq
    assert default_mosaic_config(64, n).bwd_fused_dq
    monkeypatch.setattr(fpallas, "mosaic_supported", lambda q, k: None)
    for t in (n - 1, n):
        x = jnp.zeros((1, t, 1, 128), jnp.bfloat16)
        chosen = fpallas._with_mosaic(fpallas.resolve_config(128, t, t), x, x, interpret=False).mosaic
        assert chosen == default_mosaic_config(128, t) and chosen.bwd_fused_dq is (t >= n)
    for flags, fused in [("--xla_gpu_deterministic_ops", False), ("--a=1 --xla_gpu_deterministic_ops=true", False),
                         ("--xla_gpu_exclude_nondeterministic_ops=true --b=2", False),
                         ("--xla_gpu_deterministic_ops=false", True), ("--xla_backend_optimization_level=0", True)]:
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert mgpu.deterministic_ops_requested() is not fused, flags
        assert default_mosaic_config(128).bwd_fused_dq is (fused and mgpu.FUSED_DQ_BY_DEFAULT), flags
    for d in (0, 96, 256):
        with pytest.raises(ValueError, match="head_dim must be 64 or 128"):
            default_mosaic_config(d)
    q = jnp.zeros((1, 256, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        mgpu.mosaic_forward(q, q, q, jnp.zeros((1, 256, 1)), jnp.zeros((1,), jnp.int32), None,
                            (jnp.zeros((1, 1, 1), jnp.int32),) * 2, scale=1.0, config=MosaicConfig(128, 256, 4))


def test_op_refuses_what_the_kernel_does_not_cover():
    q, k, v, lf, _ = _inputs(1, 64, 64, 2, 2, 64, jnp.bfloat16)
    if jax.default_backend() != "gpu":
        with pytest.raises(NotImplementedError, match="Hopper"):
            forgetting_attention(q, k, v, lf, implementation="mosaic")
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
        forgetting_attention(q32, k32, v32, lf, implementation="mosaic")
    with pytest.raises(ValueError, match="forward_wgs=3 takes head_dim ≤ 64"):
        x = jnp.zeros((1, 192, 1, 128), jnp.bfloat16)
        mgpu.mosaic_forward(x, x, x, jnp.zeros((1, 192, 1)), jnp.zeros((1,), jnp.int32), None,
                            (jnp.zeros((1, 1, 1), jnp.int32),) * 2, scale=1.0, config=MosaicConfig(forward_wgs=3))
    with pytest.raises(ValueError, match="head_dim ≤ 128"):
        mgpu.mosaic_forward(jnp.zeros((1, 128, 1, 256), jnp.bfloat16), jnp.zeros((1, 128, 1, 256), jnp.bfloat16),
                            jnp.zeros((1, 128, 1, 256), jnp.bfloat16), jnp.zeros((1, 128, 1)),
                            jnp.zeros((1,), jnp.int32), None, (jnp.zeros((1, 1, 1), jnp.int32),) * 2, scale=1.0,
                            config=MosaicConfig())


@pytest.mark.parametrize("gates", ["forget", "tight", "growing", "growing-fast", "large-logits"])
def test_static_frames_bound_every_unmasked_logit(gates):
    """``static_frames``: F bounds the kernel-form logit s_ij = q_i·k_j·scale·log2 e − Λ_j·log2 e of every row of a
    block and every key j ≤ the block's first row (the keys of the forward's unmasked blocks), for any gates, with
    no slack beyond its + 1 where the bound is attained; finite frames stay within STATIC_FRAME_RANGE of every row's
    diagonal logit, and +inf (the running max) comes where they could not. A frame below one of those logits would
    overflow exp2 in the kernel, a missing fallback would underflow terms that count."""
    b, tq, tk, h, hkv, d, bq = 2, 256, 320, 4, 2, 64, 64
    q, k, _, lf, _ = _inputs(b, tq, tk, h, hkv, d, jnp.float32, seed=5)
    if gates == "tight":  # no decay and q_200 = k_10, both of the largest norm: the bound is attained (up to + 1)
        lf = jnp.zeros_like(lf)
        top = 2.0 * q[:, 200, ::h // hkv]
        q, k = q.at[:, 200, ::h // hkv].set(top), k.at[:, 10].set(top)
    if gates == "growing":  # log f > 0 on a stretch: Λ rises there (not a forget gate, but the op takes it)
        lf = lf.at[:, 120:130].set(1.0)
    if gates == "growing-fast":
        lf = lf.at[:, 250:270].set(2.0)
    if gates == "large-logits":
        q = 8.0 * q
    lam2 = decay_cumsum(lf).transpose(0, 2, 1) * mgpu.LOG2E  # [B, H, Tk]
    offset, scale = tk - tq, d ** -0.5
    frames = mgpu.static_frames(q, k, lam2[:, :, offset:], lam2, scale=scale, offset=offset, block_q=bq)
    assert frames.shape == (b, h, tq // bq)
    kh = jnp.repeat(k, h // hkv, axis=2)
    s = jnp.einsum("bihd,bjhd->bhij", q, kh) * scale * mgpu.LOG2E - lam2[:, :, None, :]  # [B, H, Tq, Tk]
    row0 = offset + jnp.arange(tq) // bq * bq  # each row's block start
    keys = jnp.arange(tk)[None, :] <= row0[:, None]
    worst = jnp.max(jnp.where(keys, s, -jnp.inf).reshape(b, h, tq // bq, bq, tk), axis=(3, 4))
    finite = np.isfinite(np.asarray(frames))
    assert np.all(np.asarray(worst)[finite] <= np.asarray(frames)[finite])
    diag = jnp.diagonal(s[:, :, :, offset:], axis1=2, axis2=3).reshape(b, h, tq // bq, bq).min(-1)
    assert np.all(np.asarray(frames - diag)[finite] <= mgpu.STATIC_FRAME_RANGE)
    if gates == "tight":
        assert float(jnp.min(frames - worst)) <= 1.0 + 1e-3  # attained at q_200·k_10: no slack beyond the + 1
    if gates in ("forget", "tight", "growing"):
        assert finite.all()  # moderate logits, a moderate rise: every block gets a frame
    elif gates == "large-logits":
        assert not finite.any()  # 2U ≈ 1,300 > 90: the running max everywhere
    else:
        assert finite.any() and not finite.all()  # the blocks just past the rise fall back


# ---------------------------------------------------------------------------------------------------
# CPU: the algorithm at the kernel's tiling (blockwise XLA path)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("tq,tk,hkv,seq_start,segments,threshold,wgs", [
    pytest.param(300, 300, 2, (0, 77), None, None, 2, id="seqstart-edge"),
    pytest.param(200, 333, 1, (140, 0), (100, 250), None, 2, id="tq<tk-mqa-segments"),
    pytest.param(384, 384, 2, None, None, "auto", 2, id="acp-auto"),
    pytest.param(500, 500, 2, (0, 77), (230,), "auto", 3, id="acp-auto-seqstart-segments-three-warpgroups"),
])
def test_kernel_tiling_blockwise_matches_reference(tq, tk, hkv, seq_start, segments, threshold, wgs):
    """The blockwise path at the Mosaic forward's tiles (128 query rows × 128 keys; 192 rows with three forward
    warpgroups) and skip rules equals the dense float32 oracle (outputs and gradients): the algorithm the kernel
    runs, covered on CPU."""
    cfg = dataclasses.replace(default_mosaic_config(64), forward_wgs=wgs)
    b, h, d = 2, 4, 64
    q, k, v, lf, w = _inputs(b, tq, tk, h, hkv, d, jnp.float32, seed=tq + tk)
    if threshold is not None:  # rows of norm √D (as with QK-norm) so that the "auto" bound holds
        q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) * d ** 0.5 for x in (q, k))
        lf = 8.0 * lf  # forget fast enough that whole 128 × 128 tiles fall under δ
    kw = dict(seq_start=None if seq_start is None else jnp.asarray(seq_start, jnp.int32),
              segment_ids=None if segments is None else _segments(b, tk, segments))
    o, grads = _value_and_grads(lambda *a: forgetting_attention(
        *a, implementation="xla", block_q=cfg.tile_q, block_k=cfg.block_k, adaptive_threshold=threshold, **kw),
        q, k, v, lf, w)
    o_ref, grads_ref = _value_and_grads(lambda *a: forgetting_attention_reference(*a, **kw), q, k, v, lf, w)
    # dense: float32 summation order only. ACP "auto": the pruned weight per row is ≤ ε = e^-10 (fox_acp.md §5),
    # so the output moves by ≤ 2ε·max|v| ≈ 4e-4 at most; gradients within the same order.
    tol = 2e-5 if threshold is None else 1e-3
    _assert_close("o", o, o_ref, tol)
    for name, g, gr in zip(("dq", "dk", "dv", "dlog_fgate"), grads, grads_ref):
        _assert_close(name, g, gr, tol)
    if threshold is not None:  # and the tiling really skips tiles on these gates
        lam = decay_cumsum(lf)
        delta = acp_lib.resolve_threshold("auto", q, k, d ** -0.5)
        lo, hi = tile_visits(tq, tk, cfg.tile_q, cfg.block_k, lam=lam, delta=delta).row_ranges()
        full_lo, full_hi = tile_visits(tq, tk, cfg.tile_q, cfg.block_k).row_ranges()
        assert int(jnp.sum(jnp.maximum(hi - lo, 0))) < int(jnp.sum(jnp.broadcast_to(full_hi - full_lo, lo.shape)))


# ---------------------------------------------------------------------------------------------------
# GPU (H200): the kernel itself
# ---------------------------------------------------------------------------------------------------

_GPU_CASES = [
    pytest.param(1, 2048, 2048, 4, 4, 64, jnp.bfloat16, None, None, id="T2048-D64"),
    pytest.param(1, 4096, 4096, 2, 2, 128, jnp.bfloat16, None, None, id="T4096-D128"),
    pytest.param(2, 1000, 1500, 4, 2, 128, jnp.bfloat16, (0, 333), (500, 1200), id="T1500-D128-gqa-seqstart-seg"),
    pytest.param(2, 777, 777, 4, 4, 64, jnp.bfloat16, (100, 0), None, id="T777-D64-seqstart"),
    pytest.param(1, 333, 333, 4, 1, 64, jnp.float16, None, None, id="T333-D64-fp16-mqa"),
    pytest.param(1, 100, 900, 2, 2, 96, jnp.bfloat16, (50,), None, id="T100of900-D96"),
    # documents: cuts on and off block edges, a 24-token one; the unmasked interiors (document_runs)
    pytest.param(1, 4096, 4096, 4, 4, 64, jnp.bfloat16, None, (1000, 1024, 2500, 2560, 2584),
                 id="T4096-D64-docs"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b,tq,tk,h,hkv,d,dtype,seq_start,segments", _GPU_CASES)
def test_gpu_mosaic_matches_reference(b, tq, tk, h, hkv, d, dtype, seq_start, segments):
    if fpallas.mosaic_supported(jnp.zeros((1,), dtype), jnp.zeros((1,), dtype)) is not None:
        pytest.skip("needs a Hopper GPU")
    q, k, v, lf, w = _inputs(b, tq, tk, h, hkv, d, dtype, seed=tk + d)
    kw = dict(seq_start=None if seq_start is None else jnp.asarray(seq_start, jnp.int32),
              segment_ids=None if segments is None else _segments(b, tk, segments))
    o, _ = _check_against_reference("mosaic", q, k, v, lf, w, dtype, **kw)
    o_pallas = forgetting_attention(q, k, v, lf, implementation="pallas", **kw)
    _assert_close("o vs pallas", o, o_pallas, _TOL[dtype][0])


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [1.0, 8.0], ids=["frame", "large-logits-running-max"])
def test_gpu_mosaic_static_frame_equals_the_running_max(q_scale):
    """``MosaicConfig.static_frame`` (the forward's unmasked blocks in a fixed frame) against the running max only
    and the float32 oracle: same outputs and gradients up to P's rounding; with 8× logits no block gets a frame
    (the fallback path)."""
    if fpallas.mosaic_supported(jnp.zeros((1,), jnp.bfloat16), jnp.zeros((1,), jnp.bfloat16)) is not None:
        pytest.skip("needs a Hopper GPU")
    b, t, h, hkv, d = 1, 4500, 4, 2, 64  # ≥ STATIC_FRAME_MIN_KEYS keys, not a multiple of the blocks
    assert t >= mgpu.STATIC_FRAME_MIN_KEYS
    q, k, v, lf, w = _inputs(b, t, t, h, hkv, d, jnp.bfloat16, seed=13)
    q = (q.astype(jnp.float32) * q_scale).astype(jnp.bfloat16)
    ss = jnp.asarray([300], jnp.int32)
    base = fpallas.resolve_config(d, t, t)
    # the path each case is meant to take: frames where 2U (+ no rise: forget gates) fits STATIC_FRAME_RANGE
    norm = lambda x: float(jnp.max(jnp.linalg.norm(x.astype(jnp.float32), axis=-1)))  # noqa: E731
    u = norm(q) * norm(k) * d ** -0.5 * mgpu.LOG2E + 1.0
    assert (2 * u <= mgpu.STATIC_FRAME_RANGE) == (q_scale == 1.0), u

    def run(static):
        cfg = dataclasses.replace(base, mosaic=dataclasses.replace(default_mosaic_config(d), static_frame=static))
        return _value_and_grads(lambda q_, k_, v_, lf_: fpallas.attention(
            q_, k_, v_, decay_cumsum(lf_, ss), ss, None, None, scale=d ** -0.5, implementation="mosaic",
            config=cfg), q, k, v, lf, w)

    (o, grads), (o_rm, grads_rm) = run(True), run(False)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    o_ref, grads_ref = _value_and_grads(lambda *a: forgetting_attention_reference(*a, seq_start=ss),
                                        f32(q), f32(k), f32(v), lf, w)
    tol_o, tol_g = _TOL[jnp.bfloat16]
    _assert_close("o vs running max", o, o_rm, tol_o)
    _assert_close("o", o, o_ref, tol_o)
    for name, g, g_rm, gr in zip(("dq", "dk", "dv", "dlog_fgate"), grads, grads_rm, grads_ref):
        _assert_close(name + " vs running max", g, g_rm, tol_g)
        _assert_close(name, g, gr, tol_g)


def _gpu_backward_case(b, t, h, hkv, d, seq_start, segments, threshold, window, *, seed):
    """A GPU backward comparison at bf16 (skipped without a Hopper GPU): ``run(mosaic_config)`` → (o, (dq, dk, dv,
    dlog f)) of the op with the Mosaic kernels in that config (a new trace per call: module switches read then
    apply), and the float32 oracle's gradients. ``threshold``: None or an ``adaptive_threshold`` (ACP)."""
    if fpallas.mosaic_supported(jnp.zeros((1,), jnp.bfloat16), jnp.zeros((1,), jnp.bfloat16)) is not None:
        pytest.skip("needs a Hopper GPU")
    q, k, v, lf, w = _inputs(b, t, t, h, hkv, d, jnp.bfloat16, seed=seed)
    ss = jnp.zeros((b,), jnp.int32) if seq_start is None else jnp.asarray(seq_start, jnp.int32)
    seg = None if segments is None else _segments(b, t, segments)
    delta = None if threshold is None else acp_lib.resolve_threshold(threshold, q, k, d ** -0.5)
    base = fpallas.resolve_config(d, t, t)

    def run(mosaic):
        cfg = dataclasses.replace(base, mosaic=mosaic)
        return _value_and_grads(lambda q_, k_, v_, lf_: fpallas.attention(
            q_, k_, v_, decay_cumsum(lf_, ss), ss, seg, delta, scale=d ** -0.5, implementation="mosaic",
            config=cfg, window_size=window), q, k, v, lf, w)

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    _, grads_ref = _value_and_grads(
        lambda *a: forgetting_attention_reference(*a, seq_start=ss, segment_ids=seg, window_size=window),
        f32(q), f32(k), f32(v), lf, w)
    return run, grads_ref


@pytest.mark.gpu
@pytest.mark.parametrize("b,t,h,hkv,d,seq_start,segments,threshold,window,stages,pingpong", [
    pytest.param(1, 2048, 4, 4, 128, None, None, None, None, 2, True, id="T2048"),
    pytest.param(2, 1500, 4, 2, 96, (0, 333), (500, 1200), None, None, 2, True, id="T1500-D96-gqa-seqstart-docs"),
    pytest.param(1, 4096, 4, 2, 128, None, None, "auto", None, 2, True, id="T4096-gqa-acp"),
    pytest.param(1, 2048, 4, 4, 64, (100,), (700, 1500), "auto", None, 2, True,
                 id="T2048-D64-seqstart-docs-acp-halves"),
    pytest.param(1, 1000, 2, 2, 128, None, None, None, 300, 2, False, id="T1000-window-own-keys"),
    pytest.param(2, 1500, 4, 2, 64, (0, 333), (500, 1200), "auto", None, 3, False,
                 id="T1500-D64-gqa-docs-acp-3stages-own-keys"),
])
def test_gpu_mosaic_fused_dq_matches_the_dq_kernel(b, t, h, hkv, d, seq_start, segments, threshold, window, stages,
                                                  pingpong):
    """``MosaicConfig.bwd_fused_dq`` (dQ and the query-side dΛ added by the dK/dV kernel with TMA reduce-add stores,
    no dQ kernel) against the dQ kernel and the float32 oracle: the same gradients up to float32 summation order
    and dQ's rounding (the bf16 tolerance of ``_TOL``; dK and dV come from the same kernel either way). dlog f at
    T1500 D96 is the case that needs the query-side dΛ (without it: 3.4% of the scale at t = 0). Under ACP
    the two forms visit their own kernels' tiles, both within the bound: compared with the oracle and each other at
    the same tolerance. ``stages``: the fused kernel's backward stages (three fit at D64 only); ``pingpong``: its form
    (``bwd_pingpong``: dQ's column halves over both warpgroups' keys; without: each warpgroup's own keys)."""
    run, grads_ref = _gpu_backward_case(b, t, h, hkv, d, seq_start, segments, threshold, window, seed=t + d)
    plain = default_mosaic_config(64 if d <= 64 else 128)
    o, grads = run(dataclasses.replace(plain, bwd_fused_dq=True, bwd_stages=stages, bwd_pingpong=pingpong))
    o_k, grads_k = run(dataclasses.replace(plain, bwd_fused_dq=False))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    tol_g = _TOL[jnp.bfloat16][1]
    np.testing.assert_array_equal(np.asarray(f32(o)), np.asarray(f32(o_k)))  # the same forward
    for name, g, g_k, gr in zip(("dq", "dk", "dv", "dlog_fgate"), grads, grads_k, grads_ref):
        _assert_close(name + " vs the dQ kernel", g, g_k, tol_g)
        _assert_close(name, g, gr, tol_g)


@pytest.mark.gpu
@pytest.mark.parametrize("b,t,h,hkv,d,seq_start,segments,threshold,window,delta_in_acc", [
    pytest.param(2, 1500, 4, 2, 64, (0, 333), (500, 1200), "auto", None, True, id="T1500-D64-gqa-seqstart-docs-acp"),
    pytest.param(2, 1500, 4, 2, 96, (0, 333), (500, 1200), None, None, True,
                 id="T1500-D96-pingpong-gqa-seqstart-docs"),
    pytest.param(1, 1000, 2, 2, 128, None, None, None, 300, False, id="T1000-D128-pingpong-window-sums-only"),
])
def test_gpu_mosaic_lean_step_matches_the_plain_step(monkeypatch, b, t, h, hkv, d, seq_start, segments, threshold,
                                                     window, delta_in_acc):
    """The two backward kernels with ``SUMS_BY_WGMMA`` (the decay-gradient sums of the bf16 dS by the tensor cores)
    and ``DELTA_IN_ACCUMULATOR`` (dP − Δ from a wgmma into −Δ) against the plain step and the float32 oracle, with
    and without the ping-pong (D64: off, D96 and D128: on). With the sums alone dQ, dK and dV are the same products
    (bitwise equal); every gradient stays within the bf16 tolerance of ``_TOL`` — dlog f is the one that would show
    sums that do not cancel in its reverse cumsum (T1500 D96 with documents and seq_start: 3.4% of the scale at
    t = 0 when one side's sums were missing)."""
    run, grads_ref = _gpu_backward_case(b, t, h, hkv, d, seq_start, segments, threshold, window, seed=t + d + 1)
    two_kernels = dataclasses.replace(default_mosaic_config(64 if d <= 64 else 128), bwd_fused_dq=False)

    def run_step(lean):
        monkeypatch.setattr(mgpu, "SUMS_BY_WGMMA", lean)
        monkeypatch.setattr(mgpu, "DELTA_IN_ACCUMULATOR", lean and delta_in_acc)
        return run(two_kernels)

    (o, grads), (o_f, grads_f) = run_step(True), run_step(False)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(f32(o)), np.asarray(f32(o_f)))
    for name, g, g_f, gr in zip(("dq", "dk", "dv", "dlog_fgate"), grads, grads_f, grads_ref):
        if name != "dlog_fgate" and not delta_in_acc:
            np.testing.assert_array_equal(np.asarray(f32(g)), np.asarray(f32(g_f)), err_msg=name)
        _assert_close(name + " vs the plain step", g, g_f, _TOL[jnp.bfloat16][1])
        _assert_close(name, g, gr, _TOL[jnp.bfloat16][1])


@pytest.mark.gpu
@pytest.mark.parametrize("b,t,h,hkv,seq_start,segments,threshold,turns", [
    pytest.param(1, 2048, 4, 4, None, None, None, True, id="T2048"),
    pytest.param(1, 2048, 4, 4, None, None, None, False, id="T2048-no-turns"),
    pytest.param(2, 1500, 4, 2, (0, 333), (500, 1200), "auto", True, id="T1500-gqa-seqstart-docs-acp"),
    pytest.param(1, 4500, 2, 2, (300,), None, None, True, id="T4500-seqstart-static-frame"),
])
def test_gpu_mosaic_three_forward_warpgroups(monkeypatch, b, t, h, hkv, seq_start, segments, threshold, turns):
    """``MosaicConfig.forward_wgs=3`` (192-row tiles; turns in rotation, or none: ``FORWARD3_TURNS``) at D64
    against two warpgroups and the float32 oracle. Dense, each row visits the same key blocks in the same order: o
    bitwise, and the gradients too where the backward is the dQ kernel's (below FUSED_DQ_MIN_QUERIES; the fused
    dQ's sums come in a varying order). Under ACP the 192-row tiles skip other blocks: the oracle's tolerances."""
    monkeypatch.setattr(mgpu, "FORWARD3_TURNS", turns)
    run, grads_ref = _gpu_backward_case(b, t, h, hkv, 64, seq_start, segments, threshold, None, seed=t + 3)
    two = default_mosaic_config(64, t)
    (o2, grads2), (o3, grads3) = run(two), run(dataclasses.replace(two, forward_wgs=3))
    tol_o, tol_g = _TOL[jnp.bfloat16]
    if threshold is None:
        assert bool(jnp.array_equal(o3, o2)), float(jnp.max(jnp.abs(o3.astype(jnp.float32) - o2)))
        if not two.bwd_fused_dq:
            for name, g3, g2 in zip(("dq", "dk", "dv", "dlog_fgate"), grads3, grads2):
                assert bool(jnp.array_equal(g3, g2)), name
    _assert_close("o vs two warpgroups", o3, o2, tol_o)
    for name, g, gr in zip(("dq", "dk", "dv", "dlog_fgate"), grads3, grads_ref):
        _assert_close(name, g, gr, tol_g)


@pytest.mark.gpu
def test_gpu_mosaic_window():
    if fpallas.mosaic_supported(jnp.zeros((1,), jnp.bfloat16), jnp.zeros((1,), jnp.bfloat16)) is not None:
        pytest.skip("needs a Hopper GPU")
    q, k, v, lf, w = _inputs(1, 1000, 1000, 2, 2, 128, jnp.bfloat16, seed=3)
    _check_against_reference("mosaic", q, k, v, lf, w, jnp.bfloat16, window_size=300)


def _assert_same_run(run_a, run_b, *, fused_dq: bool):
    """(o, (dq, dk, dv, dlog f)) of two runs that visit the same blocks: bitwise equal, but for dQ and dlog f when
    dQ comes from the dK/dV kernel (``bwd_fused_dq``): their float32 reduce-adds land in a run-dependent order, so
    those two agree to float32 summation (relative 1e-5 of each array's scale)."""
    names = ("o", "dq", "dk", "dv", "dlog_fgate")
    for name, a, b in zip(names, jax.tree_util.tree_leaves(run_a), jax.tree_util.tree_leaves(run_b)):
        a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
        if fused_dq and name in ("dq", "dlog_fgate"):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(b).max()), err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, name)


@pytest.mark.gpu
def test_gpu_mosaic_acp_minus_inf_is_bitwise_dense():
    if fpallas.mosaic_supported(jnp.zeros((1,), jnp.bfloat16), jnp.zeros((1,), jnp.bfloat16)) is not None:
        pytest.skip("needs a Hopper GPU")
    q, k, v, lf, w = _inputs(1, 4096, 4096, 4, 4, 128, jnp.bfloat16, seed=7)
    run = lambda thr: _value_and_grads(lambda *a: forgetting_attention(  # noqa: E731
        *a, adaptive_threshold=thr, implementation="mosaic"), q, k, v, lf, w)
    base, minus_inf = run(None), run(-jnp.inf)
    _assert_same_run(base, minus_inf, fused_dq=default_mosaic_config(128, 4096).bwd_fused_dq)


@pytest.mark.gpu
def test_gpu_mosaic_acp_heads_in_order_of_work(monkeypatch):
    """ACP with gates that differ per head (a permuted spread of memories, GQA): the grid runs the heads of most
    work first (``head_order``, not the identity here); o and all four gradients are bitwise those of the heads in
    order (``_assert_same_run``), and within the bf16 tolerance of the float32 oracle (ACP drops at most ε of each
    row's weight)."""
    if fpallas.mosaic_supported(jnp.zeros((1,), jnp.bfloat16), jnp.zeros((1,), jnp.bfloat16)) is not None:
        pytest.skip("needs a Hopper GPU")
    b, t, h, hkv, d = 2, 3000, 8, 4, 128
    q, k, v, _, w = _inputs(b, t, t, h, hkv, d, jnp.bfloat16, seed=11)
    memory = jnp.asarray([2.0, 7.0, 0.0, 5.0, 8.0, 1.0, 4.0, 3.0])  # gate logits per head: long and short memories
    lf = jax.nn.log_sigmoid(memory + jax.random.normal(jax.random.PRNGKey(2), (b, t, h)))
    delta = acp_lib.resolve_threshold("auto", q, k, d ** -0.5)
    cfg = fpallas.resolve_config(d, t, t)
    visits = fpallas.kernel_visits(cfg, t, t, lam=decay_cumsum(lf), delta=delta)
    order = mgpu.head_order(*visits.fwd.row_ranges(), group=h // hkv)
    assert order is not None and order.tolist() != list(range(h)), order

    def run():
        return _value_and_grads(lambda *a: forgetting_attention(*a, adaptive_threshold="auto",
                                                                implementation="mosaic"), q, k, v, lf, w)

    by_work = run()
    monkeypatch.setattr(mgpu, "head_order", lambda *a, **kw: None)
    in_order = run()
    _assert_same_run(by_work, in_order, fused_dq=default_mosaic_config(d, t).bwd_fused_dq)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    o_ref, grads_ref = _value_and_grads(forgetting_attention_reference, f32(q), f32(k), f32(v), lf, w)
    tol_o, tol_g = _TOL[jnp.bfloat16]
    _assert_close("o", by_work[0], o_ref, tol_o)
    for name, g, gr in zip(("dq", "dk", "dv", "dlog_fgate"), by_work[1], grads_ref):
        _assert_close(name, g, gr, tol_g)


@pytest.mark.gpu
def test_gpu_mosaic_forward_with_triton_backward():
    """``MosaicConfig(backward=False)``: the Mosaic forward's lse feeds the Triton backward kernels."""
    if fpallas.mosaic_supported(jnp.zeros((1,), jnp.bfloat16), jnp.zeros((1,), jnp.bfloat16)) is not None:
        pytest.skip("needs a Hopper GPU")
    b, t, h, hkv, d = 2, 1100, 4, 2, 128
    q, k, v, lf, w = _inputs(b, t, t, h, hkv, d, jnp.bfloat16, seed=11)
    ss = jnp.asarray([0, 200], jnp.int32)
    cfg = dataclasses.replace(fpallas.resolve_config(d, t, t), mosaic=MosaicConfig(backward=False))
    o, grads = _value_and_grads(lambda q_, k_, v_, lf_: fpallas.attention(
        q_, k_, v_, decay_cumsum(lf_, ss), ss, None, None, scale=d ** -0.5, implementation="mosaic", config=cfg),
        q, k, v, lf, w)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    o_ref, grads_ref = _value_and_grads(lambda *a: forgetting_attention_reference(*a, seq_start=ss),
                                        f32(q), f32(k), f32(v), lf, w)
    _assert_close("o", o, o_ref, 2e-2)
    for name, g, gr in zip(("dq", "dk", "dv", "dlog_fgate"), grads, grads_ref):
        _assert_close(name, g, gr, 3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("impl,target", [("mosaic", "mosaic_gpu"), ("pallas", "__gpu$xla.gpu.triton")])
def test_gpu_scanned_train_step_runs_the_forward_kernel_once_per_layer(impl, target):
    """A 2-layer FoX (Pro) train step with ``scan_layers``, compiled for the GPU: the forward loop's body holds one
    attention kernel call (the forward), the backward's two (dQ, dK/dV). Without ``ops.pallas._apart`` XLA 0.11 put
    a clone of the Mosaic forward kernel in the forward body (found offline for a described H200 and on the
    device); the Triton kernels (``pallas``), which it did not clone, go through the same barrier."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    if impl == "mosaic" and fpallas.mosaic_supported(jnp.zeros((1,), jnp.bfloat16),
                                                     jnp.zeros((1,), jnp.bfloat16)) is not None:
        pytest.skip("needs a Hopper GPU")
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "checks"))
    import check_scan_grad

    from fox_jax.models import preset
    from fox_jax.train import config as config_lib
    from fox_jax.train.loop import LMTask, init_state, make_optimizer, make_train_step

    model_cfg = preset("125M", "fox-pro", n_layers=2, scan_layers=True, attention_impl=impl, dtype="bfloat16")
    cfg = config_lib.ExperimentConfig(model=model_cfg, steps=10, batch_size=1)
    optimizer = make_optimizer(cfg)
    state = jax.eval_shape(lambda: init_state(cfg, jax.random.PRNGKey(0), optimizer))
    step = make_train_step(LMTask(cfg), model_cfg.build(), optimizer, 1)
    tokens = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens, "segment_ids": tokens, "positions": tokens}
    hlo = jax.jit(lambda s, b: step(s, b, {})).lower(state, batch).compile().as_text()
    counts = [body.count(f'custom_call_target="{target}') for body in check_scan_grad._while_bodies(hlo).values()]
    # (a loop around both layer loops, if XLA keeps one, holds all three)
    assert set(counts) - {0, 3} == {1, 2}, counts


def test_auto_picks_mosaic_only_where_it_runs(monkeypatch):
    """``implementation="auto"`` resolves to the Mosaic kernels on a Hopper GPU for bf16/fp16, D ≤ 128 and
    Tq ≥ 128, and to the Triton kernels for anything else (float32, D > 128, decoding-length queries,
    another GPU); cuDNN keeps plain causal attention. The device is faked: only the choice is tested."""
    from fox_jax.ops import resolve_implementation

    class Dev:
        device_kind = "NVIDIA H200"

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [Dev()])
    bf = lambda *s: jnp.zeros(s, jnp.bfloat16)  # noqa: E731
    assert fpallas.mosaic_auto_ok(bf(1, 128, 2, 64), bf(1, 128, 2, 64))
    assert not fpallas.mosaic_auto_ok(bf(1, 1, 2, 64), bf(1, 900, 2, 64))            # decoding
    assert not fpallas.mosaic_auto_ok(bf(1, 512, 2, 256), bf(1, 512, 2, 256))         # D > 128
    f32 = jnp.zeros((1, 512, 2, 64), jnp.float32)
    assert not fpallas.mosaic_auto_ok(f32, f32)
    assert resolve_implementation("auto", mosaic_ok=True) == "mosaic"
    assert resolve_implementation("auto", cudnn_ok=True, mosaic_ok=True) == "cudnn"
    assert resolve_implementation("auto") == "pallas"
    assert resolve_implementation("pallas", mosaic_ok=True) == "pallas"
    assert fpallas.forward_tiling("mosaic", 64, 4096, 4096) == (128, 128)
    Dev.device_kind = "NVIDIA A100-SXM4-80GB"
    assert not fpallas.mosaic_auto_ok(bf(1, 512, 2, 64), bf(1, 512, 2, 64))


def test_mosaic_ab_variants_change_the_kernels_and_are_undone(monkeypatch):
    """benchmarks/checks/mosaic_ab.py: each variant changes what the op lowers to under ACP (the head order's input,
    the kernels' exit waits, register budgets, dQ in the dK/dV kernel, the forward's warpgroups), and ``patched``
    puts the module back, after an error too."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "checks"))
    import mosaic_ab

    shape = (1, 1000, 1000, 4, 2, 128, jnp.bfloat16)
    base = _lower_op(*shape, acp=True)
    state = lambda: (mgpu.head_order, mgpu.plgpu, dict(mgpu.REGISTERS), mgpu.mosaic_backward,  # noqa: E731
                     mgpu.SUMS_BY_WGMMA, mgpu.DELTA_IN_ACCUMULATOR, mgpu.default_mosaic_config, mgpu.FORWARD3_TURNS)
    originals = state()
    d64 = shape[:5] + (64, jnp.bfloat16)  # dkv_regs_240 is D128's default; three fused stages fit at D64 only
    lowered = {}
    for variant in mosaic_ab.PATCHES:
        if variant == "dq_kernel" and not mgpu.FUSED_DQ_BY_DEFAULT:
            continue  # the dQ kernel is then the default at both head dims (checked below)
        at_d64 = ("dkv_regs_240", "fused_dq", "fused_dq_3stages", "fused_dq_halves", "plain_step", "plain_delta",
                  "forward_3wg", "forward_3wg_no_turns")
        s = d64 if variant in at_d64 else shape
        b = base if s is shape else _lower_op(*s, acp=True)
        with mosaic_ab.patched(variant):
            lowered[variant] = _lower_op(*s, acp=True)
            assert lowered[variant] != b, variant
        assert state() == originals, variant
    assert lowered["fused_dq_3stages"] != lowered["fused_dq"] != lowered["fused_dq_halves"]  # D64: own keys, halves
    assert lowered["forward_3wg"] != lowered["forward_3wg_no_turns"]
    two_kernels = dataclasses.replace(default_mosaic_config(128), bwd_fused_dq=False)  # with the ping-pong
    with mosaic_ab.patched("plain_step"):  # (the fused dQ sums by wgmma whatever the switch)
        plain = _lower_op(*shape, acp=True, config=two_kernels)
    assert plain != _lower_op(*shape, acp=True, config=two_kernels)
    with pytest.raises(RuntimeError), mosaic_ab.patched("dkv_regs_232"):
        raise RuntimeError
    assert state() == originals
    with mosaic_ab.patched("base"):
        assert _lower_op(*shape, acp=True) == base
    # the timed functions themselves trace anew under each patch (jax caches a traced function by its identity)
    x = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
    args = (x, x, x, jax.ShapeDtypeStruct((1, 512, 2), jnp.float32), x)
    monkeypatch.setattr(fpallas, "mosaic_supported", lambda q, k: None)  # a check for running; lowering needs none
    counts = {}
    for variant in ("base", "dq_kernel", "fused_dq"):
        with mosaic_ab.patched(variant):
            fwd_bwd = mosaic_ab.functions(128, True)[1]
            counts[variant] = fwd_bwd.trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("@mosaic_gpu")
    # 512 query rows: the default is the dQ kernel there (below FUSED_DQ_MIN_QUERIES), so base and dq_kernel agree
    assert counts == dict(base=3, dq_kernel=3, fused_dq=2), counts


@pytest.mark.parametrize("spec,ok", [
    ("64x128x3", True), ("64x128x3x64x64x2", True), ("64x128x3x64x64x2p", True), ("64x128x2x0x64x2", True),
    ("64x128x3p", False), ("64x128", False), ("64x128x3x64x64", False), ("64xAx3", False), ("96x128x2", False),
    ("64x128x3x64x32x2p", False)])
def test_bench_mosaic_sweep_specs(spec, ok):
    """bench_attention.py --mosaic-sweep: tilings with an optional ``p`` (the backward's ping-pong) become
    MosaicConfigs; a malformed spec, or one MosaicConfig refuses (block sizes not multiples of 64), is one error
    naming the flag, before anything is timed."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import bench_attention

    def error(msg):
        raise ValueError(msg)

    if not ok:
        with pytest.raises(ValueError, match="--mosaic-sweep"):
            bench_attention.parse_mosaic_configs(spec, "--mosaic-sweep", error)
        return
    mc, = bench_attention.parse_mosaic_configs(spec, "--mosaic-sweep", error)
    assert mc.bwd_pingpong == spec.endswith("p")
    assert (mc.block_q, mc.block_k, mc.stages) == (64, 128, int(spec.split("x")[2].rstrip("p")))
    if spec.startswith("64x128x2x0"):
        assert not mc.backward
