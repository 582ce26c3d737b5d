"""Hopper (sm_90) Mosaic GPU kernels for forgetting attention (``implementation="mosaic"``).

    o_i = Σ_{visible j} softmax_j(scale·q_i·k_j + Λ_i − Λ_j) v_j          (docs/design/fox_acp.md §1.1)

Three kernels: the forward (``mosaic_flash_forward``), dQ (``mosaic_flash_backward_dq``) and dK/dV
(``mosaic_flash_backward_dkv``); ``mosaic_forward`` / ``mosaic_backward`` pad the op's arrays and call them.
The backward's section below says how it differs from the forward.

The forward is a FlashAttention-3 style kernel written with ``jax.experimental.pallas.mosaic_gpu``: one CTA per
(head, tile of 2·block_q query rows, batch row) with three warpgroups. Warpgroups 0 and 1 each own
block_q query rows; they compute S = Q·Kᵀ and O += P·V with ``wgmma`` (float32 accumulators) and
take turns on the tensor cores (a "schedule" barrier: one does its softmax while the other
multiplies). Warpgroup 2 streams the key blocks of the tile's range with TMA into ``stages`` shared
memory slots, each with a produced and a consumed barrier. (``MosaicConfig.forward_wgs`` = 3: three compute
warpgroups of block_q rows each, taking turns in rotation, and warpgroup 3 streams.)

The decay enters the logits in float32 and base 2: s = q·k·scale·log2(e) + Λ_i·log2(e) − Λ_j·log2(e);
the query-side Λ is loaded once per warpgroup as a row vector, the key-side Λ travels with each key
block (TMA into shared memory, then a column vector in the WGMMA layout).

Tile skipping is data: per (b, h, tile) the key-block range [lo, hi) — seq_start, ACP, document
bounds, window and causal end, the ``fox_jax.ops.tiles.TileVisits`` row ranges at the tiling
(2·block_q, block_k) — is read from memory by all three warpgroups, so skipped blocks are never
loaded. Each compute warpgroup runs the blocks of the range in three loops: masked blocks before
seq_start's edge, unmasked blocks, masked blocks on its causal diagonal. With segment ids the unmasked
loop covers only the blocks inside its rows' document (``document_runs``: per block of rows, the run of
key blocks with the rows' one id), the blocks around them are masked; with a window every block is.
Then it only releases the blocks it does not need (the other warpgroup's causal tail), so that the
producer never waits forever.

The softmax of the unmasked blocks runs in a fixed frame where one is provable (``static_frames``, bfloat16 with
≥ ``STATIC_FRAME_MIN_KEYS`` keys, no window): their keys are all at or before the warpgroup's first row, so by
Cauchy–Schwarz every logit there (without the row term Λ_i) is below F = max‖q‖·max‖k‖·scale·log2 e + 1 − min Λ_j·log2 e, and p = exp2(s − F)
needs one multiply-add and an exp2 per score — no running max, no rescaling of the accumulator (the masked blocks
start their running max at F).

Rows with no visible key output 0 with lse = −inf. Layout: q [B, Tq, H, D], k/v [B, Tk, Hkv, D] as the op takes
them (GQA: key head = h // (H / Hkv)); Tq a multiple of 2·block_q, Tk of block_k, D a multiple of 64 (the wrappers
pad). Like every Mosaic GPU kernel they need an sm_90 GPU to run;
off-GPU it can only be lowered (``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))``),
which checks shapes, layouts and the wgmma constraints. It imports nothing from fox_jax.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
_M_INIT = -1e30  # running-max start: finite, so exp2(m_old − m_new) is never (−inf) − (−inf)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tiling of the Mosaic kernels (hashable: usable as a static argument). ``default_mosaic_config(head_dim)``
    gives the measured defaults per head dim; a config built by hand starts from the field defaults below (for
    one field changed, ``dataclasses.replace(default_mosaic_config(d), ...)``).

    Attributes:
      block_q: forward query rows per compute warpgroup (a multiple of 64; a CTA's tile is
        forward_wgs·block_q rows).
      block_k: forward keys per block (a multiple of 64, ≤ 256).
      stages: shared-memory slots of the forward's key/value pipeline (≥ 2).
      backward: run the backward with the Mosaic dQ and dK/dV kernels (False: the Triton kernels).
      bwd_block_q, bwd_block_k: the backward's block: the dQ kernel holds 2·bwd_block_q query rows and
        streams bwd_block_k keys; the dK/dV kernel holds 2·bwd_block_k keys and streams bwd_block_q rows.
      bwd_stages: shared-memory slots of the backward pipelines.
      bwd_pingpong: the backward's two compute warpgroups half a step apart on a schedule barrier (the forward's
        ping-pong; ``_turns``), S with dP and dV with dK issued as one wgmma group each. Measured on an H100
        (2026-12-06): backward −4.4% at D128 (T2048, T8192), even at T16384 D128, +5.6% at D64, where one warp per
        scheduler is left for the element-wise phase; so ``default_mosaic_config`` turns it on for head dim 128
        (off by default here).
      static_frame: the forward's unmasked blocks in a fixed softmax frame where the logits are provably below it
        (``static_frames``): no running max, no rescaling, one multiply-add and an exp2 per score there; for
        bfloat16 inputs with ≥ ``STATIC_FRAME_MIN_KEYS`` keys and no window (elsewhere the running max alone).
        Measured on an H100 (2026-12-06): forward −12% to −20% at T ≥ 4096 (fwd+bwd −2% to −6%).
      bwd_fused_dq: dQ from the dK/dV kernel, without the dQ kernel (which computes S, P and dP again): each step
        keeps dSᵀ in shared memory and dQ is added to a float32 buffer with TMA reduce-add stores
        (``mosaic_flash_backward_dkv``); five matmuls per block pair instead of seven. Its form follows
        ``bwd_pingpong``: with it, the step after, each compute warpgroup adds half of dQ's columns for that
        query block over the CTA's 2·bwd_block_k keys (the turns order the exchange of dSᵀ; at D = 64 K, Q and
        dSᵀ in 64-byte swizzle: a warpgroup reads 32 of K's columns); without it, each warpgroup adds all of
        dQ's columns over its own bwd_block_k keys in the step itself (two adds per block, no turns; built
        2026-12-07 for D = 64, where the ping-pong alone costs 5.6%). dQ's float32 sums then come
        in an order that varies from run to run. Under ACP dQ visits the
        dK/dV kernel's tiles (both within the bound). The query-side decay gradient Σ_j dS_ij (zero in exact
        arithmetic: a row constant does not move a softmax) is added the same way: it cancels the key side's share
        of Δ's rounding (Δ from the bf16 output), which would otherwise sum up in dlog f's reverse cumsum. Both
        sides' sums come from the bf16 dSᵀ times a column of ones (small wgmmas), the same values, so they cancel
        as the two kernels' float32 sums do (which needs bwd_block_q == bwd_block_k). Measured on an H100
        (2026-12-07, ``checks/mosaic_ab.py``, B1 T16384, the halves form): fwd+bwd −3.7% dense and −2.1% under ACP
        at D128 (every fused timing below every two-kernel one), +8% and +9% at D64 in the halves form; at D64 in
        the own-keys form −5.7% dense and −6.9% under ACP (B1 T16384 H24), −8.0% and −5.8% (B4 T4096 H32), against
        the dQ kernel; slower than the dQ kernel below 4096 query rows at D128 (``FUSED_DQ_MIN_QUERIES``). So
        ``default_mosaic_config`` turns it on from 4096 query rows (off by default here; at D = 128 with the
        ping-pong, at D = 64 in the own-keys form), except when ``XLA_FLAGS`` asks for deterministic ops, and
        with jax ≥ 0.11 only (with 0.10 it does not compose with ``jax.vmap``). A config built by hand with
        ``bwd_fused_dq=True`` alone gets the own-keys form (``bwd_pingpong`` is off by default here), which at
        D = 128 spills (its 64 × 128 dQ accumulator): there set ``bwd_pingpong=True`` too. dQ and dlog f are
        reproducible to float32 summation order (relative ~1e-6), not bit for bit.
      forward_wgs: the forward's compute warpgroups per CTA, 2 or 3 (a CTA's tile is forward_wgs·block_q query
        rows; with 3 a CTA runs four warpgroups). With 3 (FlashAttention-3's forward tile at head dim ≤ 64: 192
        rows) each key block loaded serves 1.5× the rows, and the CTA's fixed cost (q load, pipeline fill, the
        epilogue's stores) is shared by 1.5× the work; the three take turns in rotation (``FORWARD3_TURNS``)
        instead of the ping-pong, with the register budgets ``REGISTERS["forward3"]`` (160 / 24 at D = 64: its
        loops spill nothing, ptxas for sm_90a; at D = 128 the accumulators do not fit, so ``mosaic_forward``
        refuses it). Each row visits the same key blocks in the same order as with 2, so dense outputs are bitwise
        the same; under ACP a tile's range spans 1.5× the rows and skips a few blocks fewer (within the same
        bound). Built 2026-12-08 for the
        D64 forward's gap at B4 T4096 H32 (0.80 against cuDNN's 0.71 ms on an H100) and measured slower there
        (H100, ``checks/mosaic_ab.py --variants forward_3wg``): forward 0.838 against 0.785 ms dense (+7%), 0.586
        against 0.506 under ACP (+16%); fwd+bwd +1.3% / +4.6%, in its first form, without turns. So off by
        default; the turns in rotation (built the same day, their absence being the likeliest cause, with the
        padding to 192 rows, +3% at T4096, and under ACP the wider tiles' ranges) have not run on a GPU yet.
    """

    block_q: int = 64
    block_k: int = 128
    stages: int = 2
    backward: bool = True
    bwd_block_q: int = 64
    bwd_block_k: int = 64
    bwd_stages: int = 2
    bwd_pingpong: bool = False
    static_frame: bool = True
    bwd_fused_dq: bool = False
    forward_wgs: int = 2

    def __post_init__(self):
        for name in ("block_q", "bwd_block_q", "bwd_block_k"):
            if getattr(self, name) < 64 or getattr(self, name) % 64:
                raise ValueError(f"MosaicConfig.{name} must be a positive multiple of 64, got {getattr(self, name)}")
        if self.block_k < 64 or self.block_k % 64 or self.block_k > 256:
            raise ValueError(f"MosaicConfig.block_k must be a multiple of 64 in [64, 256], got {self.block_k}")
        for name in ("backward", "bwd_pingpong", "static_frame", "bwd_fused_dq"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MosaicConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if type(self.forward_wgs) is not int or self.forward_wgs not in (2, 3):
            raise ValueError(f"MosaicConfig.forward_wgs must be 2 or 3, got {self.forward_wgs!r}")
        if self.stages < 2 or self.bwd_stages < 2:
            raise ValueError(f"MosaicConfig.stages and bwd_stages must be ≥ 2, got {self.stages}, {self.bwd_stages}")
        if self.bwd_fused_dq and self.bwd_block_q != self.bwd_block_k:  # dS's sums against one column of ones
            raise ValueError(f"MosaicConfig.bwd_fused_dq needs bwd_block_q == bwd_block_k, got {self.bwd_block_q} "
                             f"and {self.bwd_block_k}")

    @property
    def tile_q(self) -> int:
        """Forward query rows per CTA (``forward_wgs`` compute warpgroups)."""
        return self.forward_wgs * self.block_q

    @property
    def dq_tiling(self) -> tuple[int, int]:
        """(query rows, keys) of one tile of the dQ kernel's loop ranges."""
        return 2 * self.bwd_block_q, self.bwd_block_k

    @property
    def dkv_tiling(self) -> tuple[int, int]:
        """(query rows, keys) of one tile of the dK/dV kernel's loop ranges."""
        return self.bwd_block_q, 2 * self.bwd_block_k


# whether a custom_vmap may hold the fused-dQ kernel's aliased accumulator refs (``_batch_folded``): jax 0.10 cannot
# discharge their state inside one
_VMAP_FOLDS_REFS = jax.__version_info__ >= (0, 11)
# dQ from the dK/dV kernel as the default where it composes with jax.vmap, which is also where it was measured
FUSED_DQ_BY_DEFAULT = _VMAP_FOLDS_REFS
# ... from this many query rows on: shorter, it was slower than the dQ kernel (its fwd+bwd against the dQ kernel's,
# H100, jax 0.11.2, H16 D128, 2026-12-07, results/attention/h100_fused_dq_by_length_1207.json: T1024 +5.4% dense;
# T2048 +0.4–0.8% dense, +3.7% ACP; T4096 −2.4% dense, ±1% ACP; T8192 −4.6% dense, ±1% ACP; T16384 −3.7% dense,
# −2.1% ACP; at D64 in the own-keys form, H100, 2026-12-07 21:19, results/attention/h100_lean_step_ab_1207.json:
# T4096 H32 −8.0% dense, −5.8% ACP; T16384 H24 −5.7% dense, −6.9% ACP)
FUSED_DQ_MIN_QUERIES = 4096
# the two backward kernels' decay-gradient sums (Σ_j dS_ij in the dQ kernel, Σ_i dS_ij in the dK/dV kernel) as
# wgmmas of the bf16 dS with a column of ones, accumulated across the loop in a (64, 8) float32 accumulator and
# reduced once, in place of a float32 row sum of every step's dS (~30 adds and 4 shuffles a thread per step, ~10%
# of each kernel's unmasked step at D64: 334 and 363 SASS instructions, ptxas for sm_90a). As the fused dQ does
# (``MosaicConfig.bwd_fused_dq``, which always sums this way): both sides sum the same bf16 values, so they still
# cancel in dlog f's reverse cumsum. Measured alone (H100, jax 0.11.2, 2026-12-07 21:18, D64 two kernels, fwd+bwd
# against the plain step, results/attention/h100_lean_step_ab_1207.json): B1 T16384 H24 +0.0% dense, −2.2% ACP;
# B4 T4096 H32 −1.3% dense, −1.4% ACP; with ``DELTA_IN_ACCUMULATOR`` below (the lean step) −4.0 to −5.2%: on.
SUMS_BY_WGMMA = True
# dP − Δ (dS = P ∘ (dP − Δ)) as the wgmma that adds dO·Vᵀ to an accumulator holding −Δ (the kernels take −Δ), in
# place of a zeroed accumulator (whose 32 register moves a thread ptxas left in the dQ kernel's step) and a
# subtraction per score: at D64, with ``SUMS_BY_WGMMA``, the unmasked steps 302 → 269 (dQ) and 332 → 290 (dK/dV)
# SASS instructions, no spills (ptxas for sm_90a). Not in the fused dQ's halves form (the D128 default from 4096
# rows), whose loop it made spill. Rounding: the tensor core's float32 accumulation instead of one float32
# subtraction. With ``SUMS_BY_WGMMA`` (the lean step; H100, 2026-12-07 21:18, D64 two kernels, fwd+bwd against the
# plain step): B1 T16384 H24 −4.2% dense, −5.2% ACP; B4 T4096 H32 −4.3% dense, −4.0% ACP: on.
DELTA_IN_ACCUMULATOR = True
# the forward's three compute warpgroups (``MosaicConfig.forward_wgs`` = 3) take turns issuing their scores' wgmma in
# rotation (FlashAttention-3's scheduler barrier among three): warpgroup w waits on turn barrier w, issues, arrives on
# w + 1 mod 3; every warpgroup takes one turn per block of the tile's range (its own or one it releases), so the
# phases stay in step. Without it (False) the three issue when ready: measured slower than two warpgroups with the
# ping-pong (H100, 2026-12-08, B4 T4096 H32 D64: forward +7% dense, +16% ACP). Built the same day offline, not yet
# run on a GPU.
FORWARD3_TURNS = True


def deterministic_ops_requested() -> bool:
    """Whether ``XLA_FLAGS`` asks XLA for run-to-run reproducible GPU results (``--xla_gpu_deterministic_ops`` or
    ``--xla_gpu_exclude_nondeterministic_ops``, bare or ``=true``); read at each call (jit traces read it once)."""
    flags = os.environ.get("XLA_FLAGS", "")
    return re.search(r"--xla_gpu_(deterministic_ops|exclude_nondeterministic_ops)(=(true|1))?(\s|$)", flags) is not None


def default_mosaic_config(head_dim: int, q_len: int | None = None) -> MosaicConfig:
    """The measured defaults for a head dim (64 or 128 after padding) and a query length (``q_len`` rows; None: a
    long one): forward 64-row warpgroups, 128-key blocks, three pipeline stages at D = 64, two at D = 128 (shared
    memory: 2 q tiles + stages × (k + v)); at D = 128 the backward's ping-pong (``MosaicConfig.bwd_pingpong``); and,
    with jax ≥ 0.11 (``FUSED_DQ_BY_DEFAULT``) and from ``FUSED_DQ_MIN_QUERIES`` query rows on, dQ from the dK/dV
    kernel (``bwd_fused_dq``: column halves at D = 128, each warpgroup's own keys at D = 64), unless ``XLA_FLAGS``
    asks for reproducible results (``deterministic_ops_requested``): then the dQ kernel, whose dQ is bitwise the
    same from run to run. Raises ValueError for other head dims."""
    if head_dim not in (64, 128):
        raise ValueError(f"default_mosaic_config: head_dim must be 64 or 128 (the padded head dim), got {head_dim!r}")
    long_enough = q_len is None or q_len >= FUSED_DQ_MIN_QUERIES
    return MosaicConfig(64, 128, 3 if head_dim == 64 else 2, bwd_pingpong=head_dim == 128,
                        bwd_fused_dq=long_enough and FUSED_DQ_BY_DEFAULT and not deterministic_ops_requested())


def smem_bytes(config: MosaicConfig, head_dim: int, itemsize: int = 2) -> int:
    """Shared memory of the largest of the kernels, allocation by allocation as the kernels ask for it (with segment
    ids), each rounded up to ``SMEM_ALIGNMENT`` as Pallas places them; the barriers (a few hundred bytes) not
    counted. Forward: q tiles, k/v slots, Λ/segment slots, lse; backward: two resident tiles per warpgroup, two
    streamed tiles per slot, vectors (and the fused dQ's or ``SUMS_BY_WGMMA``'s tiles)."""
    def alloc(*sizes):
        return sum(_round_up(size, SMEM_ALIGNMENT) for size in sizes)

    d, w = head_dim, itemsize
    bq, bk, st = config.block_q, config.block_k, config.stages
    wgs = config.forward_wgs
    fwd = alloc(wgs * bq * d * w, st * bk * d * w, st * bk * d * w, st * bk * 4, st * bk * 4, wgs * bq * 4)
    if not config.backward:
        return fwd
    bq, bk, st = config.bwd_block_q, config.bwd_block_k, config.bwd_stages
    fused, halves = config.bwd_fused_dq, config.bwd_fused_dq and config.bwd_pingpong
    dq = alloc(2 * bq * d * w, 2 * bq * d * w, st * bk * d * w, st * bk * d * w, st * bk * 4, st * bk * 4,
               2 * bq * 4, 2 * 8 * bk * w if SUMS_BY_WGMMA else 0)
    dkv = alloc(2 * bk * d * w, 2 * bk * d * w, st * bq * d * w, st * bq * d * w, st * bq * 4, st * bq * 4,
                st * bq * 4, 2 * bk * 4, 2 * 8 * bq * w if SUMS_BY_WGMMA or fused else 0)
    if fused:  # per warpgroup dSᵀ of two blocks (ping-pong; else one), the query sums, dQ's float32 columns
        dkv += alloc(2 * (2 if halves else 1) * bk * bq * w, 2 * bq * 4, 2 * bq * (d // 2 if halves else d) * 4)
    return max(fwd, dkv) if fused else max(fwd, dq, dkv)


SMEM_ALIGNMENT = 1024  # bytes: where Pallas Mosaic GPU places each shared-memory allocation
SMEM_LIMIT = 227 * 1024  # per CTA on sm_90

# setmaxnreg budgets per kernel and padded head dim, (each compute warpgroup, the memory warpgroup): a CTA of 384
# threads launches with 168 registers a thread (the 64K file), so 2·128·c + 128·m ≤ 64,512. The dK/dV kernel's
# compute warpgroups hold dK and dV (64 × D float32 each) with Sᵀ and dPᵀ: at D128 and 232 / 40 it spills 92 B,
# some in its masked loop; 240 / 24 leaves its loops free of spills (ptxas for sm_90a, offline_mosaic_check.py) and
# was 2–3% faster under ACP at 16k, the same dense (H100, 2026-12-07, checks/mosaic_ab.py --variants dkv_regs_240).
# At D64 nothing spills at 232 / 40 and 240 / 24 was 1–2% slower (the memory warpgroup's 24 registers).
# "forward3": the forward with three compute warpgroups (``MosaicConfig.forward_wgs``), 512 threads launched with 128
# registers, 3·128·c + 128·m ≤ 65,536: 160 / 24 at D64 spills 8 B without turns, 28 B with ``FORWARD3_TURNS`` (values
# stored in the prologue, loaded for the epilogue), none in a loop; its unmasked loop 368 / 373 SASS instructions
# against the two warpgroups' 377 (ptxas for sm_90a, B4 T4096 H32, 2026-12-08).
REGISTERS = {"forward": {64: (232, 40), 128: (232, 40)}, "dq": {64: (232, 40), 128: (232, 40)},
             "dkv": {64: (232, 40), 128: (240, 24)}, "forward3": {64: (160, 24)}}


def _row(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _col(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def _products(shape, pairs, take_turn=None, last_init=None):
    """A·Bᵀ for each (A, B) of ``pairs`` (shared-memory refs), issued as one wgmma group into float32
    accumulators of ``shape`` and read back in the WGMMA layout; ``take_turn()`` (the ping-pong's turn) runs
    between issuing and waiting; ``last_init``: the last pair's accumulator's initial value (WGMMA layout; None:
    zeros), which its product is added to. Returns one value per pair."""
    def issue(*accs):
        for acc, (a, b) in zip(accs, pairs):
            plgpu.wgmma(acc, a, plgpu.transpose_ref(b, (1, 0)))
        if take_turn is not None:
            take_turn()

    def issue_and_read(*accs):
        issue(*accs)
        return tuple(acc[...] for acc in accs)

    if last_init is None:
        return pl.run_scoped(issue_and_read, *(plgpu.ACC(shape, jnp.float32) for _ in pairs))
    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    return pl.run_state(lambda accs: issue(*accs))(
        tuple(plgpu.ACC.init(zeros) for _ in pairs[1:]) + (plgpu.ACC.init(last_init),))


STATIC_FRAME_RANGE = 90.0  # log2 units: the frame may sit at most this far above a row's diagonal logit
# The frame's cost is a pass over q and k (their largest norms) and its gain grows with the keys per row:
# measured on an H100 (2026-12-06) forward −12% to −20% from T = 4096, +3% at B8 T2048 D128.
STATIC_FRAME_MIN_KEYS = 4096


def static_frames(q, k, lam_q2, lam_k2, *, scale: float, offset: int, block_q: int):
    """The forward's fixed softmax frame per (batch row, head, block of ``block_q`` query rows), or +inf.

    Every key j ≤ row0 (the block's first row, absolute; the forward's unmasked blocks hold only such keys) has
    a logit, in the kernel's form and base 2, s_ij = q_i·k_j·scale·log2 e − Λ_j·log2 e (the row term Λ_i is left
    out), and by Cauchy–Schwarz s_ij ≤ U − min_{j' ≤ row0} Λ_j'·log2 e = F with U = max‖q‖·max‖k‖·scale·log2 e + 1
    (the norms' maxima over the sequence, per batch row and head; the + 1 is a margin over the kernel's float32
    sums, so exp2(s − F) ≤ 1/2). So F serves as the softmax's fixed max: no overflow, no running max, for any
    gates (the prefix minimum is Λ itself when log f ≤ 0). The diagonal key of a row is always visible and its
    logit is ≥ F − (2U + max_i(Λ_i − min Λ)·log2 e), so the row's largest term is ≥ 2^−(that distance); float32
    and bfloat16 reach 2^−126, so while the distance is ≤ ``STATIC_FRAME_RANGE`` (90) a term is lost only below
    2^−36 of the row's largest. Past it (large logits, or gates that grow) the block gets +inf: the running max.

    Args:
      q: [B, Tq, H, D], k: [B, Tk, Hkv, D] (padded, any float dtype); lam_q2 [B, H, Tq], lam_k2 [B, H, Tk]: Λ·log2 e
      (padded); scale: logit scale; offset: absolute position of query row 0; block_q: rows per block (Tq a
      multiple of it).
    Returns:
      [B, H, Tq / block_q] float32: F, or +inf where the block keeps the running max.
    """
    b, tq, h, _ = q.shape
    hkv, tk = k.shape[2], k.shape[1]
    norm = lambda x: jnp.sqrt(jnp.max(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1), axis=1))  # noqa: E731
    u = norm(q) * jnp.repeat(norm(k), h // hkv, axis=1) * (abs(float(scale)) * LOG2E) + 1.0  # [B, H]
    rows = jnp.minimum(offset + jnp.arange(0, tq, block_q), tk - 1)
    floor = lax.cummin(lam_k2, axis=2)[:, :, rows]  # [B, H, blocks]: min Λ·log2 e over keys ≤ row0
    rise = jnp.max(lam_q2.reshape(b, h, tq // block_q, block_q), axis=-1) - floor  # ≤ 0 when log f ≤ 0
    frame = u[:, :, None] - floor
    ok = 2.0 * u[:, :, None] + jnp.maximum(rise, 0.0) <= STATIC_FRAME_RANGE
    return jnp.where(ok, frame, jnp.inf).astype(jnp.float32)


def mosaic_flash_forward(q, k, v, lam_q2, lam_k2, kv_lo, kv_hi, seq_start, seg_q, seg_k, *, offset: int,
                         scale: float, config: MosaicConfig, window_size: int | None = None, frames=None,
                         heads=None):
    """The kernel on padded arrays.

    Args:
      q: [B, Tq, H, D] bfloat16/float16, Tq a multiple of ``config.tile_q``, D a multiple of 64;
      k, v: [B, Tk, Hkv, D] (same dtype), Tk a multiple of ``config.block_k``;
      lam_q2: [B, H, Tq] float32, Λ of each query row times log2(e); lam_k2: [B, H, Tk] float32;
      kv_lo, kv_hi: [B, H, Tq / tile_q] int32, the key-block range of each tile (hi ≤ Tk / block_k);
      seq_start: [B] int32 (keys before it are invisible); seg_q [B, Tq], seg_k [B, Tk] int32 or None;
      offset: absolute position of query row 0 (unpadded Tk − Tq); scale: logit scale;
      window_size: None or W: row r sees keys j > r − W;
      frames: None, or [B, H, Tq / block_q] float32 from ``static_frames`` (not with a window): the unmasked
        blocks of a warpgroup whose frame is finite run in that fixed frame;
      heads: None, or [H] int32, the head each row of the grid runs (``head_order``; None: in order).
    Returns:
      o [B, Tq, H, D] in q.dtype and lse2 [B, H, Tq] float32 in base 2 (−inf for empty rows).
    """
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    bq, bk, stages = config.block_q, config.block_k, config.stages
    group = h // hkv
    n_tiles = tq // config.tile_q
    n_wg = config.forward_wgs  # compute warpgroups; warpgroup n_wg loads
    pingpong = n_wg == 2       # the turns pair two warpgroups ...
    round_robin = n_wg == 3 and FORWARD3_TURNS  # ... or pass among three
    registers = REGISTERS["forward" if n_wg == 2 else "forward3"][d]
    dtype = q.dtype
    segments = seg_q is not None
    always_mask = window_size is not None
    qk_scale = float(scale) * LOG2E
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    use_frames = frames is not None
    if use_frames and always_mask:
        raise ValueError("mosaic_flash_forward: frames need unmasked blocks; a window masks every block")

    def kernel(q_ref, k_ref, v_ref, lq_ref, lk_ref, lo_ref, hi_ref, ss_ref, hd_ref, *rest):
        fr_ref, rest = (rest[0], rest[1:]) if use_frames else (None, rest)
        if segments:
            sq_ref, sk_ref, dlo_ref, dhi_ref, o_ref, lse_ref, scoped = rest
        else:
            sq_ref = sk_ref = dlo_ref = dhi_ref = None
            o_ref, lse_ref, scoped = rest
        (q_smem2, k_smem, v_smem, lk_smem, sk_smem, lse_smem2), (k_full, v_full, q_full), \
            (k_free, v_free), schedule = scoped
        bi, row = lax.axis_index("batch"), lax.axis_index("heads")
        head = row if heads is None else hd_ref[row]  # without a head order no load: the grid as before
        ti = _longest_first("q_tiles", n_tiles)
        wg = lax.axis_index("wg")
        n_lo = lo_ref[bi, head, ti]
        n_tile = jnp.maximum(hi_ref[bi, head, ti], n_lo)

        take_turn = _turns(schedule) if pingpong else (lambda: None)
        # three warpgroups: warpgroup w waits for its turn (barrier w) before issuing its scores' wgmma and hands the
        # turn on (barrier w + 1 mod 3) once they are issued, so the three issue in rotation
        my_turn = (lambda: plgpu.barrier_wait(schedule.at[wg])) if round_robin else (lambda: None)
        pass_turn = (lambda: plgpu.barrier_arrive(schedule.at[lax.rem(wg + 1, jnp.int32(n_wg))])) if round_robin \
            else (lambda: None)

        def slot_of(n):
            return lax.rem(n - n_lo, jnp.int32(stages))

        @pl.when(wg < n_wg)
        def _compute():
            plgpu.set_max_registers(registers[0], action="increase")
            q_smem = q_smem2.at[wg]
            q_base = ti * config.tile_q + wg * bq
            row0 = offset + q_base  # absolute position of this warpgroup's first row
            n_hi = jnp.clip(pl.cdiv(row0 + bq, jnp.int32(bk)), n_lo, n_tile)
            n_full = jnp.clip(lax.div(row0 + 1, jnp.int32(bk)), n_lo, n_hi)  # below: no causal mask
            ss = ss_ref[bi]
            n_edge = jnp.clip(pl.cdiv(ss, jnp.int32(bk)), n_lo, n_full)      # below: seq_start mask
            u_lo, u_hi = _unmasked(n_edge, n_full, dlo_ref, dhi_ref, bi, n_wg * ti + wg)
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_base, bq), head], q_smem, q_full.at[wg])
            lq = plgpu.load(lq_ref.at[bi, head, pl.ds(q_base, bq)], (), layout=row_layout, optimized=False)
            sq = None if sq_ref is None else plgpu.load(sq_ref.at[bi, pl.ds(q_base, bq)], (), layout=row_layout,
                                                               optimized=False)
            plgpu.barrier_wait(q_full.at[wg])

            # the fixed frame F of this warpgroup's rows (static_frames): the running max starts there, and the
            # unmasked blocks, whose logits are all ≤ F, skip the max and the rescaling; +inf: no frame
            frame = fr_ref[bi, head, n_wg * ti + wg] if use_frames else None
            static = None if frame is None else frame < jnp.inf
            m0 = _M_INIT if frame is None else jnp.where(static, frame, _M_INIT)
            m_i = plgpu.layout_cast(jnp.full((bq,), m0, jnp.float32), row_layout)
            l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
            acc = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(n_hi > n_lo)
            def _():
                plgpu.barrier_wait(k_full.at[0])

            if pingpong:
                pl.when(wg == 1)(take_turn)
            if round_robin:  # the first turn is warpgroup 0's
                pl.when(wg == n_wg - 1)(lambda: plgpu.barrier_arrive(schedule.at[0]))

            def step(n, carry, masked: bool, fixed: bool = False):
                acc, m_i, l_i = carry
                slot = slot_of(n)

                my_turn()
                s, = _products((bq, bk), [(q_smem, k_smem.at[slot])],
                               take_turn if pingpong else (pass_turn if round_robin else None))
                lk = plgpu.load(lk_smem.at[slot], (), layout=col_layout)
                sk = plgpu.load(sk_smem.at[slot], (), layout=col_layout) if masked and segments else None
                plgpu.barrier_arrive(k_free.at[slot])
                shape = (bq, bk)
                if fixed:  # in the frame (m_i = F on every row): p = exp2(s − F), F folded into the column term
                    p = jnp.exp2(s * qk_scale - _col(lk + frame, shape))
                    m_new = m_i
                    l_i = l_i + p.sum(axis=1)
                else:
                    # the query's Λ_i is one constant per row: the softmax does not see it, so the loop leaves it
                    # out (one subtraction per score fewer) and the lse gets it at the end
                    s = s * qk_scale - _col(lk, shape)
                    if masked:
                        r = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
                        c = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + n * bk
                        vis = (c <= r) & (c >= ss)
                        if window_size is not None:
                            vis = vis & (r - c < window_size)
                        if sk is not None:
                            vis = vis & (_row(sq, shape) == _col(sk, shape))
                        s = jnp.where(vis, s, -jnp.inf)
                    m_new = jnp.maximum(m_i, s.max(axis=1))
                    alpha = jnp.exp2(m_i - m_new)
                    p = jnp.exp2(s - _row(m_new, shape))
                    acc = acc * _row(alpha, acc.shape)
                    l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                if pingpong:
                    plgpu.barrier_arrive(schedule)  # softmax done
                plgpu.barrier_wait(v_full.at[slot])
                if pingpong:
                    plgpu.barrier_wait(schedule)    # tensor cores free

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                    @pl.when(n + 1 < n_hi)
                    def _():
                        plgpu.barrier_wait(k_full.at[slot_of(n + 1)])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            def release(n, _):  # a block another warpgroup needs and this one does not
                slot = slot_of(n)
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                take_turn()
                take_turn()
                my_turn()  # (three warpgroups: one turn a block)
                pass_turn()

            carry = (acc, m_i, l_i)
            masked = functools.partial(step, masked=True)
            if always_mask:
                carry = lax.fori_loop(n_lo, n_hi, masked, carry)
            else:
                # the blocks before u_hi hold keys ≤ row0 only: their logits are ≤ F, the max stays F through
                # the first loop, and the fixed-frame loop runs the unmasked ones where this warpgroup has a frame
                carry = lax.fori_loop(n_lo, u_lo, masked, carry)
                u_mid = u_lo if static is None else jnp.where(static, u_hi, u_lo)
                if static is not None:
                    carry = lax.fori_loop(u_lo, u_mid, functools.partial(step, masked=False, fixed=True), carry)
                carry = lax.fori_loop(u_mid, u_hi, functools.partial(step, masked=False), carry)
                carry = lax.fori_loop(u_hi, n_hi, masked, carry)
            acc, m_i, l_i = carry
            lax.fori_loop(n_hi, n_tile, release, None)
            if pingpong:
                pl.when(wg == 0)(take_turn)

            seen = l_i > 0
            inv = 1.0 / jnp.where(seen, l_i, 1.0)
            q_smem[...] = (acc * _row(inv, acc.shape)).astype(dtype)
            lse_smem = lse_smem2.at[wg]
            lse_smem[...] = jnp.where(seen, m_i + jnp.log(jnp.where(seen, l_i, 1.0)) * LOG2E + lq, -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[bi, pl.ds(q_base, bq), head])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, head, pl.ds(q_base, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == n_wg)
        def _memory():
            plgpu.set_max_registers(registers[1], action="decrease")
            kv_head = lax.div(head, jnp.int32(group))

            def fetch(n, slot):
                keys = (bi, pl.ds(n * bk, bk), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_full.at[slot])
                plgpu.copy_gmem_to_smem(lk_ref.at[bi, head, pl.ds(n * bk, bk)], lk_smem.at[slot], k_full.at[slot])
                if sk_ref is not None:
                    plgpu.copy_gmem_to_smem(sk_ref.at[bi, pl.ds(n * bk, bk)], sk_smem.at[slot], k_full.at[slot])
                return keys

            for i in range(stages):
                @pl.when(n_lo + i < n_tile)
                def _():
                    keys = fetch(n_lo + i, i)
                    plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[i], v_full.at[i])

            @pl.loop(n_lo + stages, n_tile)
            def _(n):
                slot = slot_of(n)
                plgpu.barrier_wait(k_free.at[slot])
                keys = fetch(n, slot)
                plgpu.barrier_wait(v_free.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_full.at[slot])

    def entry(*refs):
        smem = (
            plgpu.SMEM((n_wg, bq, d), dtype, transforms=_swizzled()),
            plgpu.SMEM((stages, bk, d), dtype, transforms=_swizzled()),
            plgpu.SMEM((stages, bk, d), dtype, transforms=_swizzled()),
            plgpu.SMEM((stages, bk), jnp.float32),
            plgpu.SMEM((stages, bk), jnp.int32) if segments else None,
            plgpu.SMEM((n_wg, bq), jnp.float32),
        )
        k_arrivals = 3 if segments else 2  # k, its Λ (and segment ids) land on one barrier
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped),
            smem,
            (plgpu.Barrier(num_arrivals=k_arrivals, num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=n_wg)),
            (plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),) * 2,
            # the ping-pong's schedule; with three warpgroups one turn barrier each (unused without FORWARD3_TURNS)
            plgpu.Barrier(num_arrivals=2) if pingpong else plgpu.Barrier(num_barriers=n_wg),
            collective_axes="wg",
        )

    args = [q, k, v, lam_q2, lam_k2, kv_lo, kv_hi, seq_start, _heads(heads, h)] + ([frames] if use_frames else [])
    if segments:
        args += [seg_q, seg_k, *document_runs(seg_q, seg_k, bq, bk)]
    o, lse2 = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, h, tq), jnp.float32)),
        grid=(h, n_tiles, b),
        grid_names=("heads", "q_tiles", "batch"),
        num_threads=n_wg + 1,
        thread_name="wg",
        compiler_params=_params(),
    )(*args)
    return o, lse2


def head_order(lo, hi, *, group: int = 1):
    """The order in which the grid runs the heads: the most work first, where the tiles' block ranges differ
    per head (ACP); None where they do not.

    The hardware starts CTAs in grid order, a head's tiles together (they share its keys in L2). With ACP a head's
    work is set by its gates (a long-memory head keeps every block, a short one a few), so a long head late in the
    grid leaves a tail of its long tiles running on a few SMs after the rest is done; heads in decreasing work put
    the short heads' tiles last, where they fill the tail. GQA: the heads of one key/value head stay together (its
    keys in L2), ordered by their group's work, then by their own. A heuristic for the schedule only: every order
    gives the same output.

    Args:
      lo, hi: int32 block ranges, each broadcastable to [B, H, n] (``TileVisits.row_ranges()`` /
        ``col_ranges()``); a head axis of size 1 means every head has the same ranges.
      group: query heads per key/value head.
    Returns:
      [H] int32, a permutation of the heads, or None.
    """
    if lo.ndim != 3 or hi.ndim != 3 or max(lo.shape[1], hi.shape[1]) == 1:
        return None
    lo, hi = jnp.broadcast_arrays(lo.astype(jnp.int32), hi.astype(jnp.int32))
    work = jnp.sum(jnp.maximum(hi - lo, 0), axis=(0, 2))  # [H]: blocks over the batch rows and tiles
    group_work = jnp.repeat(work.reshape(-1, group).sum(axis=1), group)
    heads = jnp.arange(work.shape[0], dtype=jnp.int32)
    return jnp.lexsort((heads, -work, -group_work)).astype(jnp.int32)  # the last key sorts first


def _heads(heads, h: int):
    """The kernels' head-order input: ``heads``, or (unread) the identity."""
    return jnp.arange(h, dtype=jnp.int32) if heads is None else heads


def _round_up(a: int, m: int) -> int:
    return -(-a // m) * m


def _pad_axis(x, axis: int, new_len: int, value=0, edge: bool = False):
    pad = new_len - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, mode="edge") if edge else jnp.pad(x, widths, constant_values=value)


def document_runs(seg_rows, seg_cols, rows: int, cols: int):
    """Per block of ``rows`` rows, the run of column blocks that lie wholly inside the rows' one document.

    A tile whose rows and columns all carry one id needs no document mask (only the causal, seq_start and
    padding ones, which the kernels bound separately: ``clip_run``), so the kernels run it without one. Packed
    documents (ids constant on runs) make those tiles a contiguous run of column blocks per row block: the
    interior of the document. Block sparsity as data, like the tile ranges.

    Args:
      seg_rows: [B, R] int32, R a multiple of ``rows``; seg_cols: [B, C] int32, C a multiple of ``cols``
        (padding carries ids no real position has: −1 for rows, −2 for columns).
    Returns:
      (lo, hi): [B, R / rows] int32 each; the column blocks [lo, hi) hold the rows' id only (the first such
      run where ids recur out of order), lo = hi = C / cols where the row block spans two ids or none match.
    """
    b = seg_rows.shape[0]
    r = seg_rows.reshape(b, -1, rows)
    c = seg_cols.reshape(b, -1, cols)
    r_id, c_id = r.min(-1), c.min(-1)
    same = ((r_id == r.max(-1))[:, :, None] & (c_id == c.max(-1))[:, None, :]
            & (r_id[:, :, None] == c_id[:, None, :]))
    n = same.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    lo = jnp.min(jnp.where(same, idx, n), axis=-1)
    hi = jnp.min(jnp.where(~same & (idx > lo[..., None]), idx, n), axis=-1)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def mosaic_forward(q, k, v, lam, seq_start, segment_ids, row_ranges, *, scale: float, config: MosaicConfig,
                   window_size: int | None = None):
    """Forgetting-attention forward with the Mosaic kernel on unpadded arrays.

    Args:
      q: [B, Tq, H, D] bfloat16/float16 (D ≤ 128); k, v: [B, Tk, Hkv, D] (Tq ≤ Tk, bottom-right aligned);
      lam: [B, Tk, H] float32 Λ (cumsum of log f, zero before seq_start);
      seq_start: [B] int32; segment_ids: [B, Tk] int32 or None;
      row_ranges: (lo, hi) int32, each broadcastable to [B, H, ceil(Tq / config.tile_q)], the key-block
        range of each tile (``TileVisits.row_ranges()`` at the tiling (tile_q, block_k));
      scale: logit scale; config: ``MosaicConfig``; window_size: None or a static W.
    Returns:
      o [B, Tq, H, D] in q.dtype, lse [B, H, Tq] float32 (natural log, −inf for empty rows).
    Raises:
      ValueError: a dtype other than bfloat16/float16, D > 128, three forward warpgroups at D > 64, or a tiling
        over the shared memory.
    """
    b, tq, h, d = q.shape
    tk = k.shape[1]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"the Mosaic kernel takes bfloat16 or float16 q, k, v of one dtype, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if d > 128:
        raise ValueError(f"the Mosaic kernel takes head_dim ≤ 128, got {d}")
    d_pad = _round_up(d, 64)
    if config.forward_wgs == 3 and d_pad not in REGISTERS["forward3"]:
        raise ValueError(f"MosaicConfig.forward_wgs=3 takes head_dim ≤ 64 (three warpgroups' accumulators do not fit "
                         f"the registers at 128), got {d}")
    if smem_bytes(config, d_pad) > SMEM_LIMIT:
        raise ValueError(f"{config} needs {smem_bytes(config, d_pad)} bytes of shared memory at D={d_pad}, "
                         f"over {SMEM_LIMIT}")
    tq_pad, tk_pad = _round_up(tq, config.tile_q), _round_up(tk, config.block_k)
    n_tiles = tq_pad // config.tile_q
    qp = _pad_axis(_pad_axis(q, 3, d_pad), 1, tq_pad)
    kp = _pad_axis(_pad_axis(k, 3, d_pad), 1, tk_pad)
    vp = _pad_axis(_pad_axis(v, 3, d_pad), 1, tk_pad)
    lam2 = lam.astype(jnp.float32).transpose(0, 2, 1) * LOG2E  # [B, H, Tk]
    lam_q2 = _pad_axis(lam2[:, :, tk - tq:], 2, tq_pad, edge=True)
    lam_k2 = _pad_axis(lam2, 2, tk_pad, edge=True)
    heads = head_order(*row_ranges, group=h // k.shape[2])
    lo, hi = (jnp.broadcast_to(x.astype(jnp.int32), (b, h, n_tiles)) for x in row_ranges)
    seg_q = seg_k = None
    if segment_ids is not None:
        seg_q = _pad_axis(segment_ids[:, tk - tq:].astype(jnp.int32), 1, tq_pad, value=-1)
        seg_k = _pad_axis(segment_ids.astype(jnp.int32), 1, tk_pad, value=-2)
    frames = None  # bfloat16 only: fp16's 5-bit exponent cannot hold P far below 1 (it flushes to zero)
    framed = config.static_frame and window_size is None and q.dtype == jnp.bfloat16
    if framed and tk >= STATIC_FRAME_MIN_KEYS:
        frames = static_frames(qp, kp, lam_q2, lam_k2, scale=scale, offset=tk - tq, block_q=config.block_q)
    o, lse2 = mosaic_flash_forward(qp, kp, vp, lam_q2, lam_k2, lo, hi, seq_start.astype(jnp.int32), seg_q, seg_k,
                                   offset=tk - tq, scale=scale, config=config, window_size=window_size,
                                   frames=frames, heads=heads)
    lse = jnp.where(jnp.isfinite(lse2), lse2 / LOG2E, -jnp.inf)
    return o[:, :tq, :, :d], lse[:, :, :tq]


# ---------------------------------------------------------------------------------------------------
# Backward: a dQ kernel (query tiles over key blocks) and a dK/dV kernel (key tiles over query blocks)
# ---------------------------------------------------------------------------------------------------
#
# Both have the forward's shape: one CTA per (head, tile, batch row), warpgroups 0 and 1 each own half of
# the tile (kept in shared memory), warpgroup 2 streams the other side's blocks through ``stages`` slots.
# Every compute warpgroup waits on every block of the tile's range in order (the blocks outside its own
# range are waited on and released at once), so a slot is never refilled before both have let it go.
# With ``pingpong`` (``MosaicConfig.bwd_pingpong``, on in ``default_mosaic_config`` at D = 128) a step is two wgmma groups around
# the element-wise work: the score-side matmuls (S and dP) issued together, then P, dS and the Λ row sums, then
# the gradient matmuls (dQ; or dV and dK) issued together, and the two compute warpgroups take turns on a
# schedule barrier half a step apart (``_turns``), as in the forward, so that one's element-wise work runs while
# the other's matmuls hold the tensor cores. Without it each warpgroup issues its matmuls as their inputs are
# ready and both run their element-wise work at once (faster at D = 64, where the element-wise phase of one
# warpgroup alone leaves each scheduler a single warp).
# P is recomputed from the forward's lse: P = exp2(s·scale·log2 e + (Λ_i − lse_i)·log2 e − Λ_j·log2 e), the row term
# Λ_i − lse_i one vector (``lq_lse2``, made once by ``mosaic_backward``): two operations per score before the
# exponential; dS = P ⊙ (dO·Vᵀ − δ), δ = rowsum(O ⊙ dO).


def _produce(n_lo, n_tile, stages: int, full, free, fetch):
    """Memory warpgroup: ``fetch(n, slot)`` for every block n of [n_lo, n_tile), slot (n − n_lo) mod stages,
    each slot refilled only after both compute warpgroups released it."""
    for i in range(stages):
        @pl.when(n_lo + i < n_tile)
        def _():
            fetch(n_lo + i, i)

    @pl.loop(n_lo + stages, n_tile)
    def _(n):
        slot = lax.rem(n - n_lo, jnp.int32(stages))
        plgpu.barrier_wait(free.at[slot])
        fetch(n, slot)


def _consume(n_lo, n_tile, phases, stages: int, full, free, step, carry, idle=None, step_releases=False):
    """Compute warpgroup: ``step(n, slot, carry, masked)`` over consecutive ``phases`` [(start, stop, masked)]
    inside [n_lo, n_tile); the blocks of the range before the first and after the last phase are waited on
    and released without work, ``idle(n)`` once for each (the schedule barrier's turns a step would take).
    ``step_releases``: the step arrives on ``free`` itself (as soon as its last read of the slot is done)."""
    def slot_of(n):
        return lax.rem(n - n_lo, jnp.int32(stages))

    def release(n, c):
        slot = slot_of(n)
        plgpu.barrier_wait(full.at[slot])
        plgpu.barrier_arrive(free.at[slot])
        if idle is not None:
            idle(n)
        return c

    def work(masked):
        def body(n, c):
            slot = slot_of(n)
            plgpu.barrier_wait(full.at[slot])
            c = step(n, slot, c, masked)
            if not step_releases:
                plgpu.barrier_arrive(free.at[slot])
            return c
        return body

    carry = lax.fori_loop(n_lo, phases[0][0], release, carry)
    for start, stop, masked in phases:
        carry = lax.fori_loop(start, stop, work(masked), carry)
    return lax.fori_loop(phases[-1][1], n_tile, release, carry)


def _longest_first(axis_name: str, n: int):
    """The query tile a CTA runs, longest causal rows first. Pallas hands the grid's last axis to CUDA's x (the
    fastest), so with ``grid=(heads, q_tiles, batch)`` a head's query tiles start in axis order; counted from the
    end, each head's longest tiles start first and the grid ends on short ones instead of a tail of long ones
    (load balance, as FlashAttention-3 and our Triton kernels order them; dK/dV's key tile 0 is already its
    longest). Data-independent: only the order of the CTAs changes."""
    return n - 1 - lax.axis_index(axis_name)


def _turns(schedule):
    """``take_turn()`` on the compute warpgroups' schedule barrier (two arrivals): both warpgroups arrive, then
    both go on. A step takes two turns — after issuing its score matmuls, and after its element-wise work, before
    the next matmuls — and warpgroup 1 takes one turn before its first block (warpgroup 0 one after its last), so
    the two run half a step apart: one's element-wise work overlaps the other's matmuls (ping-pong). A block a
    warpgroup only releases takes the same two turns."""
    def take_turn():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)
    return take_turn


def clip_run(start, stop, run_lo, run_hi):
    """A block's document run [run_lo, run_hi) (``document_runs``) clipped to [start, stop), the blocks free of
    every other mask (causal, seq_start, window, padding): the blocks a loop may run unmasked. An empty range
    inside [start, stop] where they do not meet; needs start ≤ stop. int32 scalars (the Mosaic and the Triton
    kernels)."""
    lo = jnp.minimum(jnp.maximum(run_lo, start), stop)
    return lo, jnp.minimum(jnp.maximum(run_hi, lo), stop)


def _unmasked(start, stop, dlo_ref, dhi_ref, bi, block):
    """The blocks a compute warpgroup runs without a mask: [start, stop) (past the seq_start edge, before the
    causal diagonal), with segment ids ``clip_run`` of its rows' document run (row ``block`` of batch row
    ``bi``)."""
    if dlo_ref is None:
        return start, stop
    return clip_run(start, stop, dlo_ref[bi, block], dhi_ref[bi, block])


def _visible(r, c, ss, window_size, seg_r=None, seg_c=None):
    """Element mask: key position c visible from query position r (causal, seq_start, window, documents)."""
    vis = (c <= r) & (c >= ss)
    if window_size is not None:
        vis = vis & (r - c < window_size)
    if seg_r is not None:
        vis = vis & (seg_r == seg_c)
    return vis


def _opaque(x):
    """``x`` through ``lax.optimization_barrier``: what is computed from it inside a loop stays in the loop. The wgmma
    descriptors of a warpgroup's resident tiles (K, V) are loop invariants; hoisted, they hold ~2 registers each
    across the loop, and in the fused-dQ dK/dV kernel that spilled them (432 B at D128, reloaded in every step;
    none with this, ptxas for sm_90a)."""
    return lax.optimization_barrier(x)


def _swizzled(cols: int = 64):
    """Tiles of 8 rows × ``cols`` 16-bit elements, swizzled over their 2·cols bytes (64 columns: 128 B)."""
    return plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(2 * cols)


def _ones(n: int, dtype):
    """A column of n ones stored transposed, (8, n) with row 0 ones and zeros below: a wgmma's B operand (n × 8)
    that turns A·B into A's row sums in column 0 of an (m, 8) accumulator (``SUMS_BY_WGMMA``, the fused dQ)."""
    return jnp.zeros((8, n), dtype).at[0].set(1)


def _params():
    return plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane)


def mosaic_flash_backward_dq(q, k, v, do, lq_lse2, lam_k2, neg_delta, kv_lo, kv_hi, seq_start, seg_q, seg_k, *,
                             offset: int, scale: float, block_q: int, block_k: int, stages: int,
                             window_size: int | None = None, pingpong: bool = False, heads=None,
                             wgmma_sums: bool = False, delta_in_acc: bool = False):
    """dQ and the query-side decay gradient Σ_j dS_ij on padded arrays.

    Args:
      as ``mosaic_flash_forward``, plus do [B, Tq, H, D] (q.dtype); lq_lse2 [B, H, Tq] float32: the query rows'
      Λ minus their lse, base 2 (Λ·log2 e − lse·log2 e; −inf on empty rows), in place of the forward's lam_q2;
      neg_delta [B, H, Tq] float32 (−Δ = −rowsum(o·do)); kv_lo, kv_hi [B, H, Tq / (2·block_q)] the key-block
      ranges at the tiling (2·block_q, block_k); pingpong: ``MosaicConfig.bwd_pingpong``; heads: as the forward's;
      wgmma_sums: ``SUMS_BY_WGMMA`` (Σ_j dS_ij of the bf16 dS, by the tensor cores); delta_in_acc:
      ``DELTA_IN_ACCUMULATOR`` (dP − Δ from the wgmma that adds dO·Vᵀ to −Δ).
    Returns:
      dq [B, Tq, H, D] in q.dtype and dΛ_q [B, H, Tq] float32.
    """
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    bq, bk = block_q, block_k
    group = h // hkv
    dtype = q.dtype
    segments = seg_q is not None
    always_mask = window_size is not None
    qk_scale = float(scale) * LOG2E
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    n_tiles = tq // (2 * bq)

    def kernel(q_ref, k_ref, v_ref, do_ref, lq_ref, lk_ref, dl_ref, lo_ref, hi_ref, ss_ref, hd_ref, *rest):
        *rest, dq_ref, dlq_ref, scoped = rest
        ones_ref = rest.pop() if wgmma_sums else None
        sq_ref, sk_ref, dlo_ref, dhi_ref = rest if segments else (None,) * 4
        (q_smem2, do_smem2, k_smem, v_smem, lk_smem, sk_smem, out_smem2, ones_smem), \
            (res_full, full, free, *schedule) = scoped
        take_turn = _turns(*schedule) if pingpong else None
        bi, row, ti = lax.axis_index("batch"), lax.axis_index("heads"), _longest_first("q_tiles", n_tiles)
        head = row if heads is None else hd_ref[row]
        wg = lax.axis_index("wg")
        n_lo = lo_ref[bi, head, ti]
        n_tile = jnp.maximum(hi_ref[bi, head, ti], n_lo)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(REGISTERS["dq"][d][0], action="increase")
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            q_base = ti * (2 * bq) + wg * bq
            row0 = offset + q_base
            rows = (bi, pl.ds(q_base, bq), head)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, res_full.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, res_full.at[wg])
            if wgmma_sums:
                plgpu.copy_gmem_to_smem(ones_ref, ones_smem.at[wg], res_full.at[wg])
            vec = (bi, head, pl.ds(q_base, bq))
            lq = plgpu.load(lq_ref.at[vec], (), layout=row_layout, optimized=False)  # Λ − lse, base 2
            neg_dl = plgpu.load(dl_ref.at[vec], (), layout=row_layout, optimized=False)  # −Δ
            sq = None if sq_ref is None else plgpu.load(sq_ref.at[bi, pl.ds(q_base, bq)], (), layout=row_layout,
                                                         optimized=False)
            ss = ss_ref[bi]
            n_hi = jnp.clip(pl.cdiv(row0 + bq, jnp.int32(bk)), n_lo, n_tile)
            n_full = jnp.clip(lax.div(row0 + 1, jnp.int32(bk)), n_lo, n_hi)
            n_edge = jnp.clip(pl.cdiv(ss, jnp.int32(bk)), n_lo, n_full)
            u_lo, u_hi = _unmasked(n_edge, n_full, dlo_ref, dhi_ref, bi, 2 * ti + wg)
            plgpu.barrier_wait(res_full.at[wg])
            shape = (bq, bk)

            def step(n, slot, carry, masked):
                dq_acc, dlq = carry

                qk, dov = (q_smem, k_smem.at[slot]), (do_smem, v_smem.at[slot])  # S = Q·Kᵀ, dP = dO·Vᵀ
                neg_dl_tile = _row(neg_dl, shape)  # delta_in_acc: dP's initial value, dP − Δ_i from the wgmma
                if pingpong:
                    s, dp_less_delta = _products(shape, [qk, dov], take_turn,
                                                 last_init=neg_dl_tile if delta_in_acc else None)
                else:
                    s, = _products(shape, [qk])
                lk = plgpu.load(lk_smem.at[slot], (), layout=col_layout)
                s = s * qk_scale + _row(lq, shape) - _col(lk, shape)
                if masked:
                    r = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
                    c = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + n * bk
                    sk = None if sk_smem is None else _col(plgpu.load(sk_smem.at[slot], (), layout=col_layout), shape)
                    s = jnp.where(_visible(r, c, ss, window_size, None if sq is None else _row(sq, shape), sk),
                                  s, -jnp.inf)
                p = jnp.exp2(s)
                if not pingpong:  # dP after P: each warpgroup at its own pace
                    dp_less_delta, = _products(shape, [dov], last_init=neg_dl_tile if delta_in_acc else None)
                if not delta_in_acc:
                    dp_less_delta = dp_less_delta + neg_dl_tile
                ds = p * dp_less_delta
                if wgmma_sums:  # Σ_j dS_ij: dS times a column of ones, in dQ's wgmma group (``dlq`` (bq, 8))
                    ds16 = ds.astype(dtype)
                else:
                    ds16, dlq = ds.astype(dtype), dlq + ds.sum(axis=1)
                if pingpong:
                    ds16, dlq = lax.optimization_barrier((ds16, dlq))
                    plgpu.barrier_arrive(schedule[0])  # element-wise work done
                    plgpu.barrier_wait(schedule[0])    # tensor cores free

                def dsk(refs):
                    acc_ref, *sums_ref = refs
                    plgpu.wgmma(acc_ref, ds16, k_smem.at[slot])
                    if wgmma_sums:
                        plgpu.wgmma(sums_ref[0], ds16, plgpu.transpose_ref(ones_smem.at[wg], (1, 0)))

                accs = (plgpu.ACC.init(dq_acc),) + ((plgpu.ACC.init(dlq),) if wgmma_sums else ())
                dq_acc, *sums = pl.run_state(dsk)(accs)
                return dq_acc, sums[0] if wgmma_sums else dlq

            dq0 = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
            # Σ_j dS_ij; wgmma_sums: in column 0 of a (bq, 8) wgmma accumulator, the other columns zeros
            dl0 = plgpu.layout_cast(jnp.zeros((bq, 8) if wgmma_sums else (bq,), jnp.float32),
                                    plgpu.Layout.WGMMA if wgmma_sums else row_layout)
            phases = [(n_lo, n_hi, True)] if always_mask else [
                (n_lo, u_lo, True), (u_lo, u_hi, False), (u_hi, n_hi, True)]
            if pingpong:
                pl.when(wg == 1)(take_turn)
            dq_acc, dlq = _consume(n_lo, n_tile, phases, stages, full, free, step, (dq0, dl0),
                                   idle=(lambda n: (take_turn(), take_turn())) if pingpong else None)
            if pingpong:
                pl.when(wg == 0)(take_turn)
            q_smem[...] = (dq_acc * float(scale)).astype(dtype)
            out_smem = out_smem2.at[wg]
            out_smem[...] = dlq.sum(axis=1) if wgmma_sums else dlq
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
            plgpu.copy_smem_to_gmem(out_smem, dlq_ref.at[vec])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(REGISTERS["dq"][d][1], action="decrease")
            kv_head = lax.div(head, jnp.int32(group))

            def fetch(n, slot):
                keys = (bi, pl.ds(n * bk, bk), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], full.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], full.at[slot])
                plgpu.copy_gmem_to_smem(lk_ref.at[bi, head, pl.ds(n * bk, bk)], lk_smem.at[slot], full.at[slot])
                if sk_ref is not None:
                    plgpu.copy_gmem_to_smem(sk_ref.at[bi, pl.ds(n * bk, bk)], sk_smem.at[slot], full.at[slot])

            _produce(n_lo, n_tile, stages, full, free, fetch)

    def entry(*refs):
        smem = (
            plgpu.SMEM((2, bq, d), dtype, transforms=_swizzled()),
            plgpu.SMEM((2, bq, d), dtype, transforms=_swizzled()),
            plgpu.SMEM((stages, bk, d), dtype, transforms=_swizzled()),
            plgpu.SMEM((stages, bk, d), dtype, transforms=_swizzled()),
            plgpu.SMEM((stages, bk), jnp.float32),
            plgpu.SMEM((stages, bk), jnp.int32) if segments else None,
            plgpu.SMEM((2, bq), jnp.float32),
            # wgmma_sums: per warpgroup a column of ones (stored transposed: 8 × bk, row 0 ones)
            plgpu.SMEM((2, 8, bk), dtype, transforms=_swizzled()) if wgmma_sums else None,
        )
        barriers = (plgpu.Barrier(num_arrivals=3 if wgmma_sums else 2, num_barriers=2),  # Q, dO (and the ones)
                    plgpu.Barrier(num_arrivals=4 if segments else 3, num_barriers=stages),
                    plgpu.Barrier(num_arrivals=2, num_barriers=stages)) + ((plgpu.Barrier(num_arrivals=2),) if pingpong else ())
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, barriers, collective_axes="wg")

    args = [q, k, v, do, lq_lse2, lam_k2, neg_delta, kv_lo, kv_hi, seq_start, _heads(heads, h)]
    if segments:
        args += [seg_q, seg_k, *document_runs(seg_q, seg_k, bq, bk)]
    if wgmma_sums:
        args.append(_ones(bk, dtype))
    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, h, tq), jnp.float32)),
        grid=(h, n_tiles, b), grid_names=("heads", "q_tiles", "batch"),
        num_threads=3, thread_name="wg", compiler_params=_params(),
    )(*args)


def mosaic_flash_backward_dkv(q, k, v, do, lq_lse2, lam_k2, neg_delta, q_lo, q_hi, seq_start, seg_q, seg_k, *,
                              offset: int, scale: float, block_q: int, block_k: int, stages: int,
                              window_size: int | None = None, pingpong: bool = False, heads=None,
                              fused_dq: bool = False, wgmma_sums: bool = False, delta_in_acc: bool = False):
    """dK, dV per query head and the key-side decay gradient −Σ_i dS_ij on padded arrays; with ``fused_dq`` dQ too.

    Args:
      as ``mosaic_flash_backward_dq``; Tk a multiple of 2·block_k, Tq of block_q; q_lo, q_hi
      [B, H, Tk / (2·block_k)]: the query-block ranges (``TileVisits.col_ranges()`` at the tiling
      (block_q, 2·block_k)); fused_dq: ``MosaicConfig.bwd_fused_dq``, its form following ``pingpong``: each
      step writes dSᵀ to shared memory; with ``pingpong`` one step later each compute warpgroup adds its half of
      dQ's columns, dS·K over both warpgroups' keys (the turns order the exchange of dSᵀ), and without it each
      adds all of dQ's columns over its own keys in the step itself (two adds per block, no turns); either to a
      float32 accumulator in global memory with a TMA reduce-add store (the scale applied once, to the sum);
      wgmma_sums: ``SUMS_BY_WGMMA`` (Σ_i dS_ij of the bf16 dSᵀ, by the tensor cores; always with ``fused_dq``);
      delta_in_acc: ``DELTA_IN_ACCUMULATOR`` (dPᵀ − Δ from the wgmma that adds V·dOᵀ to −Δ; not in the halves form).
    Returns:
      dk, dv [B, Tk, H, D] in k.dtype, per *query* head (GQA: the caller sums each group), and
      dΛ_k [B, H, Tk] float32; with ``fused_dq`` also dq [B, Tq, H, D] and dΛ_q [B, H, Tq] float32, summed over
      the key tiles in an order that varies from run to run (and dΛ_k, dΛ_q both sums of the bf16 dS).
    """
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    bq, bk = block_q, block_k
    group = h // hkv
    dtype = q.dtype
    segments = seg_q is not None
    always_mask = window_size is not None
    qk_scale = float(scale) * LOG2E
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    if fused_dq and bq != bk:  # one ones tile serves both sides' sums (K = bq for the keys', bk for the queries')
        raise ValueError(f"mosaic_flash_backward_dkv: fused_dq needs block_q == block_k, got {bq} and {bk}")
    wgmma_sums = wgmma_sums or fused_dq  # the fused dQ's query side sums the bf16 dS: so must the key side
    halves = fused_dq and pingpong  # dQ's column halves over both warpgroups' keys, a step later
    own_keys = fused_dq and not pingpong  # all of dQ's columns over the warpgroup's own keys, in the step
    dh = d // 2 if halves else d  # fused_dq: the dQ columns each compute warpgroup adds
    # halves: K is read in column halves, so its swizzle tiles are dh wide (below 64: K, Q and dSᵀ, which meet
    # K in wgmma, in 64-byte swizzle)
    k_cols = min(dh, 64) if halves else 64

    def kernel(q_ref, k_ref, v_ref, do_ref, lq_ref, lk_ref, dl_ref, lo_ref, hi_ref, ss_ref, hd_ref, *rest):
        *rest, scoped = rest
        rest, (dk_ref, dv_ref, dlk_ref) = rest[:-3], rest[-3:]
        dqa_ref = dlqa_ref = None
        if fused_dq:  # the zeroed float32 accumulators (``jax.new_ref`` operands), after the other inputs
            *rest, dqa_ref, dlqa_ref = rest
        ones_ref = rest.pop() if wgmma_sums else None
        sq_ref, sk_ref, dlo_ref, dhi_ref = rest if segments else (None,) * 4
        (k_smem2, v_smem2, q_smem, do_smem, lq_smem, dl_smem, sq_smem, out_smem2, ds_smem, ones_smem, dsum_smem,
         dq_smem), \
            (res_full, full, free, *schedule) = scoped
        take_turn = _turns(*schedule) if pingpong else None
        bi, row, ti = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("k_tiles")
        head = row if heads is None else hd_ref[row]
        wg = lax.axis_index("wg")
        kv_head = lax.div(head, jnp.int32(group))
        m_lo = lo_ref[bi, head, ti]
        m_tile = jnp.maximum(hi_ref[bi, head, ti], m_lo)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(REGISTERS["dkv"][d][0], action="increase")
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            k0 = ti * (2 * bk) + wg * bk
            keys = (bi, pl.ds(k0, bk), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem, res_full.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem, res_full.at[wg])
            if wgmma_sums:
                plgpu.copy_gmem_to_smem(ones_ref, ones_smem.at[wg], res_full.at[wg])
            lk = plgpu.load(lk_ref.at[bi, head, pl.ds(k0, bk)], (), layout=row_layout, optimized=False)
            sk = None if sk_ref is None else plgpu.load(sk_ref.at[bi, pl.ds(k0, bk)], (), layout=row_layout,
                                                         optimized=False)
            ss = ss_ref[bi]
            # this warpgroup's query blocks: from the one holding its first key's position (causal), none if
            # all its keys are before seq_start; blocks below m_full cross its causal diagonal
            m_begin = jnp.clip(lax.div(jnp.maximum(k0 - offset, 0), jnp.int32(bq)), m_lo, m_tile)
            m_begin = jnp.where(k0 + bk <= ss, m_tile, m_begin)
            m_full = jnp.clip(pl.cdiv(jnp.maximum(k0 + bk - 1 - offset, 0), jnp.int32(bq)), m_begin, m_tile)
            m_full = jnp.where(k0 < ss, m_tile, m_full)  # keys straddling seq_start: mask every block
            u_lo, u_hi = _unmasked(m_full, m_tile, dlo_ref, dhi_ref, bi, 2 * ti + wg)
            plgpu.barrier_wait(res_full.at[wg])
            if halves:  # dq_half reads the other warpgroup's K too
                plgpu.barrier_wait(res_full.at[1 - wg])
            shape = (bk, bq)

            def buf_of(m):  # halves: dSᵀ of query block m in slot (m − m_lo) mod 2 of each warpgroup
                return lax.rem(m - m_lo, jnp.int32(2))

            def add_to_dq(m, dq, sums, cols):
                """fused_dq: dq (unscaled: the scale is applied once to the sum, outside the kernel) and the
                query-side sums (a (bq, 8) accumulator whose column 0 holds them) of query block m added to the
                float32 accumulators, dQ's columns ``cols``, by TMA reduce-add stores from this warpgroup's
                staging tiles. The query-side decay gradient is zero in exact arithmetic, but it
                cancels the key side's share of Δ's rounding (Δ from the bf16 output), as the dQ kernel's sums do."""
                out = dq_smem.at[wg]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous block's stores have read them
                out[...] = dq
                dsum_smem.at[wg][...] = sums.sum(axis=1)  # the ones are column 0's: the others add zeros
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out, dqa_ref.at[bi, pl.ds(m * bq, bq), head, cols], reduction_op="add")
                plgpu.copy_smem_to_gmem(dsum_smem.at[wg], dlqa_ref.at[bi, head, pl.ds(m * bq, bq)],
                                        reduction_op="add")

            def dq_half(m):
                """halves: this warpgroup's columns [wg·d/2, (wg + 1)·d/2) of dQ's query block m,
                Σ_j dS_ij k_j over both warpgroups' keys (dSᵀ read transposed from shared memory), and the
                query-side sums Σ_j dS_ij over this warpgroup's keys (the same dSᵀ times a column of ones: no
                reduction across the warpgroup's threads), each added to its float32 accumulator by a TMA
                reduce-add store."""
                w = _opaque(wg)
                cols, b_ = pl.ds(pl.multiple_of(w * dh, dh), dh), buf_of(m)

                def product(acc_ref, sums_ref):
                    for j in range(2):
                        plgpu.wgmma(acc_ref, plgpu.transpose_ref(ds_smem.at[j, b_], (1, 0)), k_smem2.at[j, :, cols])
                    plgpu.wgmma(sums_ref, plgpu.transpose_ref(ds_smem.at[w, b_], (1, 0)),
                                plgpu.transpose_ref(ones_smem.at[w], (1, 0)))
                    return acc_ref[...], sums_ref[...]

                dq, sums = pl.run_scoped(product, plgpu.ACC((bq, dh), jnp.float32), plgpu.ACC((bq, 8), jnp.float32))
                add_to_dq(m, dq, sums, cols)

            def add_dq(m):
                """halves, after the turn that ends a step's element-wise work: this warpgroup's dQ columns of
                the previous block. Both warpgroups' dSᵀ of it are written (warpgroup 1 wrote its own before the
                turn warpgroup 0 has just passed, warpgroup 0 a turn before that), and no one overwrites them
                before both have passed the next turn, by which time these products are done."""
                pl.when(m > m_lo)(lambda: dq_half(m - 1))

            def put_ds(m, dst16):
                """halves: dSᵀ of query block m to shared memory (slot (m − m_lo) mod 2)."""
                ds_smem.at[wg, buf_of(m)][...] = dst16
                plgpu.commit_smem()

            def step(m, slot, carry, masked):
                dk_acc, dv_acc, dlk = carry

                k_res, v_res = k_smem, v_smem
                # the ones' (fused: and K's, V's) descriptors made in the loop, not held across it (registers)
                w = _opaque(wg) if fused_dq or (pingpong and wgmma_sums) else wg
                if fused_dq:
                    k_res, v_res = k_smem2.at[w], v_smem2.at[w]
                kq = (k_res, q_smem.at[slot])  # Sᵀ = K·Qᵀ (and with ping-pong dPᵀ = V·dOᵀ in the same group)

                def neg_dl_tile():  # −Δ as columns, loaded where it is used (before the products: more registers)
                    return _col(plgpu.load(dl_smem.at[slot], (), layout=col_layout), shape)

                # delta_in_acc: −Δ as dPᵀ's initial value, dPᵀ − Δ from the wgmma (not with halves: there it made
                # the fused loop spill at D128, ptxas for sm_90a)
                in_acc = delta_in_acc and not halves
                if pingpong:
                    st, dpt_less_delta = _products(shape, [kq, (v_res, do_smem.at[slot])], take_turn,
                                                   last_init=neg_dl_tile() if in_acc else None)
                else:
                    st, = _products(shape, [kq])
                lq = plgpu.load(lq_smem.at[slot], (), layout=col_layout)  # Λ − lse, base 2
                st = st * qk_scale + _col(lq, shape) - _row(lk, shape)
                if masked:
                    c = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + k0
                    r = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + (offset + m * bq)
                    sq = None if sq_smem is None else _col(plgpu.load(sq_smem.at[slot], (), layout=col_layout), shape)
                    st = jnp.where(_visible(r, c, ss, window_size, sq, None if sk is None else _row(sk, shape)),
                                   st, -jnp.inf)
                pt = jnp.exp2(st)
                if not pingpong:  # dV with dPᵀ, then dK: each warpgroup at its own pace
                    def dv_dp(refs):
                        dv_ref_, dpt_ref = refs
                        plgpu.wgmma(dv_ref_, pt.astype(dtype), do_smem.at[slot])
                        plgpu.wgmma(dpt_ref, v_res, plgpu.transpose_ref(do_smem.at[slot], (1, 0)))

                    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
                    dv_acc, dpt_less_delta = pl.run_state(dv_dp)((plgpu.ACC.init(dv_acc),
                                                                  plgpu.ACC.init(neg_dl_tile() if in_acc else zeros)))
                    if not in_acc:
                        dpt_less_delta = dpt_less_delta + neg_dl_tile()
                    dst = pt * dpt_less_delta

                    if own_keys:
                        return own_keys_dk_dq(m, slot, dst.astype(dtype), dk_acc, dv_acc, dlk)
                    dst16 = dst.astype(dtype)

                    def dsq(refs):
                        dk_ref_, *sums_ref = refs
                        plgpu.wgmma(dk_ref_, dst16, q_smem.at[slot])
                        if wgmma_sums:  # Σ_i dS_ij as dSᵀ times a column of ones (``dlk`` (bk, 8))
                            plgpu.wgmma(sums_ref[0], dst16, plgpu.transpose_ref(ones_smem.at[w], (1, 0)))

                    if not wgmma_sums:
                        return pl.run_state(dsq)((plgpu.ACC.init(dk_acc),))[0], dv_acc, dlk - dst.sum(axis=1)
                    dk_acc, dlk = pl.run_state(dsq)((plgpu.ACC.init(dk_acc), plgpu.ACC.init(dlk)))
                    return dk_acc, dv_acc, dlk

                if not in_acc:  # −Δ after exp2 (added before it, right after the products, D128's loops spilled more)
                    dpt_less_delta = dpt_less_delta + neg_dl_tile()
                dst = pt * dpt_less_delta
                if wgmma_sums:  # the key-side sums below (with fused_dq: the same bf16 dSᵀ as the query side's)
                    pt16, dst16 = lax.optimization_barrier((pt.astype(dtype), dst.astype(dtype)))
                else:
                    pt16, dst16, dlk = lax.optimization_barrier((pt.astype(dtype), dst.astype(dtype),
                                                                 dlk - dst.sum(axis=1)))
                plgpu.barrier_arrive(schedule[0])  # element-wise work done
                plgpu.barrier_wait(schedule[0])    # tensor cores free
                if fused_dq:
                    put_ds(m, dst16)

                def dv_dk(refs):  # dV += Pᵀ·dO and dK += dSᵀ·Q, one wgmma group
                    dv_ref_, dk_ref_, *sums_ref = refs
                    plgpu.wgmma(dv_ref_, pt16, do_smem.at[slot])
                    plgpu.wgmma(dk_ref_, dst16, q_smem.at[slot])
                    if wgmma_sums:  # Σ_i dS_ij as dSᵀ times a column of ones: the bf16 values the query side sums,
                        # so the two cancel in dlog f's reverse cumsum as float32 sums of float32 values would
                        plgpu.wgmma(sums_ref[0], dst16, plgpu.transpose_ref(ones_smem.at[w], (1, 0)))

                accs = (plgpu.ACC.init(dv_acc), plgpu.ACC.init(dk_acc))
                if wgmma_sums:  # the key sums accumulate across the steps (``dlk``: (bk, 8), column 0's)
                    accs += (plgpu.ACC.init(dlk),)
                dv_acc, dk_acc, *key_sums = pl.run_state(dv_dk)(accs)
                if wgmma_sums:
                    dlk, = key_sums
                if fused_dq:  # the slot's Q and dO are read: the loader may refill it while dQ is added
                    plgpu.barrier_arrive(free.at[slot])
                    add_dq(m)
                return dk_acc, dv_acc, dlk

            def own_keys_dk_dq(m, slot, dst16, dk_acc, dv_acc, dlk):
                """fused_dq without the ping-pong: dK += dSᵀ·Q and this warpgroup's share of query block m's dQ,
                dS·K over its own keys and all of dQ's columns (dSᵀ read transposed from shared memory, one slot:
                the previous step waited for its products, so they have read it), with both sides' sums of dS from
                the same bf16 dSᵀ times a column of ones (they cancel in dlog f's reverse cumsum; the key side's
                accumulate in ``dlk`` across the steps), in one wgmma group; then dQ and the query-side sums are
                added (``add_to_dq``)."""
                w = _opaque(wg)  # the descriptors made here, not held across the loop
                ds_ref = ds_smem.at[w, 0]
                ds_ref[...] = dst16
                plgpu.commit_smem()
                ds, ones = plgpu.transpose_ref(ds_ref, (1, 0)), plgpu.transpose_ref(ones_smem.at[w], (1, 0))

                def dk_dq(refs):
                    dk_ref_, dq_ref_, key_sums_ref, query_sums_ref = refs
                    plgpu.wgmma(dk_ref_, dst16, q_smem.at[slot])
                    plgpu.wgmma(key_sums_ref, dst16, ones)
                    plgpu.wgmma(dq_ref_, ds, k_smem2.at[w])
                    plgpu.wgmma(query_sums_ref, ds, ones)

                zeros = lambda *dims: plgpu.layout_cast(jnp.zeros(dims, jnp.float32), plgpu.Layout.WGMMA)  # noqa: E731
                dk_acc, dq, key_sums, query_sums = pl.run_state(dk_dq)(
                    (plgpu.ACC.init(dk_acc), plgpu.ACC.init(zeros(bq, d)), plgpu.ACC.init(dlk),
                     plgpu.ACC.init(zeros(bq, 8))))
                plgpu.barrier_arrive(free.at[slot])  # the slot's Q and dO are read
                add_to_dq(m, dq, query_sums, slice(None))
                return dk_acc, dv_acc, key_sums

            def idle(m):
                """A block this warpgroup does not visit: the turns a step takes; with halves zeros for its
                dSᵀ and its share of the previous block's dQ, as a step does."""
                take_turn()
                take_turn()
                if halves:
                    put_ds(m, plgpu.layout_cast(jnp.zeros(shape, dtype), plgpu.Layout.WGMMA))
                    add_dq(m)

            acc0 = plgpu.layout_cast(jnp.zeros((bk, d), jnp.float32), plgpu.Layout.WGMMA)
            # −Σ_i dS_ij; wgmma_sums: +Σ_i dS_ij in column 0 of a (bk, 8) wgmma accumulator, negated at the end
            dl0 = plgpu.layout_cast(jnp.zeros((bk, 8) if wgmma_sums else (bk,), jnp.float32),
                                    plgpu.Layout.WGMMA if wgmma_sums else row_layout)
            phases = [(m_begin, m_tile, True)] if always_mask else [
                (m_begin, u_lo, True), (u_lo, u_hi, False), (u_hi, m_tile, True)]
            if pingpong:
                pl.when(wg == 1)(take_turn)
            dk_acc, dv_acc, dlk = _consume(m_lo, m_tile, phases, stages, full, free, step, (acc0, acc0, dl0),
                                           idle=idle if pingpong else None, step_releases=fused_dq)
            if pingpong:
                pl.when(wg == 0)(take_turn)
            if halves:  # the last block's dQ once both have written its dSᵀ; then K is free to take dK
                take_turn()
                add_dq(m_tile)
                take_turn()
            k_smem[...] = (dk_acc * float(scale)).astype(dtype)
            v_smem[...] = dv_acc.astype(dtype)
            out_smem = out_smem2.at[wg]
            out_smem[...] = -dlk.sum(axis=1) if wgmma_sums else dlk
            plgpu.commit_smem()
            out_rows = (bi, pl.ds(k0, bk), head)
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[out_rows])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[out_rows])
            plgpu.copy_smem_to_gmem(out_smem, dlk_ref.at[bi, head, pl.ds(k0, bk)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(REGISTERS["dkv"][d][1], action="decrease")

            def fetch(m, slot):
                rows = (bi, pl.ds(m * bq, bq), head)
                vec = (bi, head, pl.ds(m * bq, bq))
                plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], full.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], full.at[slot])
                plgpu.copy_gmem_to_smem(lq_ref.at[vec], lq_smem.at[slot], full.at[slot])
                plgpu.copy_gmem_to_smem(dl_ref.at[vec], dl_smem.at[slot], full.at[slot])
                if sq_ref is not None:
                    plgpu.copy_gmem_to_smem(sq_ref.at[bi, pl.ds(m * bq, bq)], sq_smem.at[slot], full.at[slot])

            _produce(m_lo, m_tile, stages, full, free, fetch)

    def entry(*refs):
        smem = (
            plgpu.SMEM((2, bk, d), dtype, transforms=_swizzled(k_cols)),
            plgpu.SMEM((2, bk, d), dtype, transforms=_swizzled()),
            plgpu.SMEM((stages, bq, d), dtype, transforms=_swizzled(k_cols)),
            plgpu.SMEM((stages, bq, d), dtype, transforms=_swizzled()),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((stages, bq), jnp.int32) if segments else None,
            plgpu.SMEM((2, bk), jnp.float32),
            # fused_dq: dSᵀ of two consecutive blocks per warpgroup (of one with own_keys); per warpgroup a column
            # of ones (stored transposed: 8 × bk, row 0 ones), the query-side sums and the float32 dQ columns
            plgpu.SMEM((2, 2 if halves else 1, bk, bq), dtype, transforms=_swizzled(k_cols)) if fused_dq else None,
            plgpu.SMEM((2, 8, bq), dtype, transforms=_swizzled(k_cols)) if wgmma_sums else None,
            plgpu.SMEM((2, bq), jnp.float32) if fused_dq else None,
            plgpu.SMEM((2, bq, dh), jnp.float32, transforms=(plgpu.TilingTransform((8, 32)),
                                                              plgpu.SwizzleTransform(128))) if fused_dq else None,
        )
        barriers = (plgpu.Barrier(num_arrivals=3 if wgmma_sums else 2, num_barriers=2),  # K, V (and the ones)
                    plgpu.Barrier(num_arrivals=5 if segments else 4, num_barriers=stages),
                    plgpu.Barrier(num_arrivals=2, num_barriers=stages)) + ((plgpu.Barrier(num_arrivals=2),) if pingpong else ())
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, barriers, collective_axes="wg")

    args = [q, k, v, do, lq_lse2, lam_k2, neg_delta, q_lo, q_hi, seq_start, _heads(heads, h)]
    if segments:
        args += [seg_q, seg_k, *document_runs(seg_k, seg_q, bk, bq)]
    out = jax.ShapeDtypeStruct((b, tk, h, d), dtype)
    out_type = (out, out, jax.ShapeDtypeStruct((b, h, tk), jnp.float32))
    mesh = dict(grid=(h, tk // (2 * bk), b), grid_names=("heads", "k_tiles", "batch"), num_threads=3,
                thread_name="wg")
    if wgmma_sums:
        args.append(_ones(bq, dtype))
    if not fused_dq:
        return plgpu.kernel(entry, out_type=out_type, compiler_params=_params(), **mesh)(*args)
    # the zeroed accumulators the kernel adds into: Refs, passed aliased in and out (``pl.kernel``)
    dq_acc = jax.new_ref(jnp.zeros((b, tq, h, d), jnp.float32))
    dlq_acc = jax.new_ref(jnp.zeros((b, h, tq), jnp.float32))
    dk, dv, dlk = pl.kernel(entry, out_type=out_type, mesh=plgpu.Mesh(**mesh), compiler_params=_params())(
        *args, dq_acc, dlq_acc)
    return dk, dv, dlk, dq_acc[...] * float(scale), dlq_acc[...]


def _batch_folded(fn):
    """``fn`` (arrays, or None, whose leading axis is the batch; returning such arrays) under ``jax.vmap``: the
    vmapped axis is folded into the batch axis (unbatched arguments broadcast along it) and split off the outputs.
    For the fused-dQ backward, whose ``pl.kernel`` with aliased accumulators has no batching rule in jax 0.10 /
    0.11 (the other kernels' ``plgpu.kernel`` has one). jax 0.10 cannot discharge that kernel's state inside a
    custom_vmap: there ``fn`` is returned as it is (and does not compose with vmap)."""
    if not _VMAP_FOLDS_REFS:
        return fn
    fn = jax.custom_batching.custom_vmap(fn)

    @fn.def_vmap
    def _rule(axis_size, in_batched, *args):
        def fold(x, batched):
            x = x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            return x.reshape(axis_size * x.shape[1], *x.shape[2:])

        outs = fn(*jax.tree_util.tree_map(fold, args, tuple(in_batched)))
        outs = jax.tree_util.tree_map(lambda y: y.reshape(axis_size, -1, *y.shape[1:]), outs)
        return outs, jax.tree_util.tree_map(lambda _: True, outs)
    return fn


def mosaic_backward(q, k, v, lam, seq_start, segment_ids, dq_ranges, dkv_ranges, o, lse, do, *, scale: float,
                    config: MosaicConfig, window_size: int | None = None):
    """Gradients of ``mosaic_forward``'s o with respect to q, k, v and Λ, with the Mosaic backward kernels.

    Args:
      q, k, v, lam, seq_start, segment_ids, scale, config, window_size: as ``mosaic_forward``;
      dq_ranges: (lo, hi) key-block ranges, broadcastable to [B, H, ceil(Tq / (2·bwd_block_q))]
        (``TileVisits.row_ranges()`` at the tiling (2·bwd_block_q, bwd_block_k));
      dkv_ranges: (lo, hi) query-block ranges, broadcastable to [B, H, ceil(Tk / (2·bwd_block_k))]
        (``TileVisits.col_ranges()`` at the tiling (bwd_block_q, 2·bwd_block_k));
      o [B, Tq, H, D] and lse [B, H, Tq] (natural log) from the forward; do: the cotangent of o.
    Returns:
      dq [B, Tq, H, D], dk, dv [B, Tk, Hkv, D] (input dtypes) and dΛ [B, Tk, H] float32
      (= Σ_j dS_tj − Σ_i dS_it; the caller's cumsum turns it into d log f).
    """
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    bq, bk, stages = config.bwd_block_q, config.bwd_block_k, config.bwd_stages
    d_pad = _round_up(d, 64)
    tq_pad = _round_up(tq, 2 * bq)  # the dQ tiles hold 2·bq rows, the dK/dV kernel streams bq-row blocks
    tk_pad = _round_up(tk, 2 * bk)  # the dK/dV tiles hold 2·bk keys, the dQ kernel streams bk-key blocks
    pad = lambda x, t: _pad_axis(_pad_axis(x, 3, d_pad), 1, t)  # noqa: E731
    qp, dop = pad(q, tq_pad), pad(do.astype(q.dtype), tq_pad)
    kp, vp = pad(k, tk_pad), pad(v, tk_pad)
    lam2 = lam.astype(jnp.float32).transpose(0, 2, 1) * LOG2E
    lam_q2 = _pad_axis(lam2[:, :, tk - tq:], 2, tq_pad, edge=True)
    lam_k2 = _pad_axis(lam2, 2, tk_pad, edge=True)
    neg_delta = -jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))  # −Δ
    neg_delta = _pad_axis(neg_delta, 2, tq_pad)
    lse2 = _pad_axis(jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf), 2, tq_pad, value=jnp.inf)
    lq_lse2 = lam_q2 - lse2  # the row term of P = exp2(s·scale·log2 e + Λ_i·log2 e − Λ_j·log2 e − lse_i·log2 e)
    seg_q = seg_k = None
    if segment_ids is not None:
        seg_q = _pad_axis(segment_ids[:, tk - tq:].astype(jnp.int32), 1, tq_pad, value=-1)
        seg_k = _pad_axis(segment_ids.astype(jnp.int32), 1, tk_pad, value=-2)
    ss = seq_start.astype(jnp.int32)
    common = dict(offset=tk - tq, scale=scale, block_q=bq, block_k=bk, stages=stages, window_size=window_size,
                  pingpong=config.bwd_pingpong, wgmma_sums=SUMS_BY_WGMMA, delta_in_acc=DELTA_IN_ACCUMULATOR)
    dkv_lo, dkv_hi = (jnp.broadcast_to(x.astype(jnp.int32), (b, h, tk_pad // (2 * bk))) for x in dkv_ranges)
    dkv_heads = head_order(*dkv_ranges, group=h // hkv)
    if config.bwd_fused_dq:  # dQ from the dK/dV kernel (MosaicConfig.bwd_fused_dq): no dQ kernel
        per_head = dkv_heads is not None  # the ranges differ per head: run the heads in decreasing work

        def fused(qp, kp, vp, dop, lq_lse2, lam_k2, neg_delta, lo, hi, ss, seg_q, seg_k):  # the batch axis leading
            heads = head_order(lo, hi, group=h // hkv) if per_head else None  # under vmap: over the folded batch
            return mosaic_flash_backward_dkv(qp, kp, vp, dop, lq_lse2, lam_k2, neg_delta, lo, hi, ss, seg_q, seg_k,
                                             **common, heads=heads, fused_dq=True)

        dk, dv, dlam_k, dq, dlam_q = _batch_folded(fused)(qp, kp, vp, dop, lq_lse2, lam_k2, neg_delta, dkv_lo, dkv_hi,
                                                          ss, seg_q, seg_k)
    else:
        lo, hi = (jnp.broadcast_to(x.astype(jnp.int32), (b, h, tq_pad // (2 * bq))) for x in dq_ranges)
        dq, dlam_q = mosaic_flash_backward_dq(qp, kp, vp, dop, lq_lse2, lam_k2, neg_delta, lo, hi, ss, seg_q, seg_k,
                                              **common, heads=head_order(*dq_ranges, group=h // hkv))
        dk, dv, dlam_k = mosaic_flash_backward_dkv(qp, kp, vp, dop, lq_lse2, lam_k2, neg_delta, dkv_lo, dkv_hi, ss,
                                                   seg_q, seg_k, **common, heads=dkv_heads)
    dq, dk, dv = dq[:, :tq, :, :d].astype(q.dtype), dk[:, :tk, :, :d], dv[:, :tk, :, :d]
    if h != hkv:  # GQA: sum the query heads of each key/value head in float32
        dk = dk.astype(jnp.float32).reshape(b, tk, hkv, h // hkv, d).sum(axis=3)
        dv = dv.astype(jnp.float32).reshape(b, tk, hkv, h // hkv, d).sum(axis=3)
    dlam = dlam_k[:, :, :tk].at[:, :, tk - tq:].add(dlam_q[:, :, :tq])
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), dlam.transpose(0, 2, 1)
