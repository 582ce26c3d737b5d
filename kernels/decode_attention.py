"""Flash-decoding Pallas kernel: one query per (row, head) against the live part of a ring KV cache.

One ``pl.pallas_call`` written against the Triton lowering (``pltriton.CompilerParams``) on GPU and run
with ``interpret=True`` elsewhere, plus a small XLA combine. Imports nothing from ``fox_jax``: arrays in,
arrays out. The public op is ``fox_jax.ops.decode_attention`` (argument checks, dispatch, XLA path).

Math (FoX, arXiv 2503.02130 Eq. 4–6, with Λ kept as float32 pairs, fox_jax/cache/decay.py): for the
query of row b, key/value head h, query head g of the group,

    s_j = scale · q·k_j + (Λq_hi − Λk_hi[j]) + (Λq_lo − Λk_lo[j]),   o = Σ_j softmax_j(s_j) v_j

over the logical keys j ∈ [lo[b, h], hi[b, h]) that are valid (``valid`` given: the slot holds a key).
Logical key j lives in physical slot j mod C of the ring (C = capacity). A query with no visible key
outputs 0.

Kernel (flash-decoding, split over the key axis): grid (B·Hkv, num_splits). Program (i, s) takes its
share of the logical *block* range [lo // bk, ceil(hi / bk)) (dynamic loop bounds: only live blocks are
read) and loads each logical block n from physical offset (n mod C/bk)·bk — C is a multiple of bk, so a
block never straddles the wrap. The G query heads of a key/value head go together as the M rows of the
tensor-core matmuls (padded to ``Gp`` = max(16, next power of two ≥ G) with masked loads and stores, no
copies). Online softmax in float32 with exponentials in base 2; the decay added in float32 before the
base change. Blocks entirely inside [lo, hi) run without the element mask (unless ``valid`` is given).
Each split writes an unnormalised partial (o, m, l); the combine is one XLA reduction over the splits.
With one split the kernel writes the normalised output directly (no combine).

Append mode (``flash_decode(..., append=...)``, a decode step of a ring): the step's own entry (k, v, Λ) comes
in as small inputs and is logical key hi − 1; the ring is read over [lo, hi − 1), the entry joins split 0's
online softmax from registers, and split 0's program writes it to slot (hi − 1) mod C of the ring buffers,
which are aliased to outputs (``input_output_aliases``). No program reads that slot (every key of the range
lies less than C before hi − 1, and the blocks that contain the slot's other columns are masked), so the write
races with nothing, and the decode step needs no update kernels before the read.

Pinned slots (``pinned=``, ``sinks:S+W``): the ring is slots [P, C) (logical block n at P + (n mod (C − P)/bk)·bk)
and slots [0, P) hold each row's first S positions; split 0 reads them as one masked block of P keys before the
ring's blocks, and a step at a pinned position is written to its pinned slot too (the ring's start is past every
pinned column, so that key enters the softmax once, from registers).

The fused step (``step=``: the layer's per-head work on the raw projections) and the ring's tables (``tables=``) are
updated in place too: each program reads its carries (raw k̃, ṽ, Λ) and table entries, then a barrier, then the
writes (global memory is not ordered between a program's threads otherwise), after the attention loop
(``DecodeConfig.late_writes``), so that the barrier does not hold back the loop's first loads. Other splits of
the same (row, head) read a carry split 0 may be writing, but their k and v only enter split 0's softmax and ring
write, and Λ is written in place only with one split; a per-row table is written by one program (kv head 0,
split 0), and the others of the row compute the same read start from the old or the new value.

With the output projection (``StepArrays.o_proj``, one split) each program also multiplies its normalised, gated
output by its query heads' rows of W_o and writes that float32 share [N] of o·W_o instead of o; the caller's sum over
the kv heads replaces the layer's output GEMM (a decode step's GEMM of M = B rows costs a launch, not its bytes).

Head dims that are not powers of two but multiples of 16 (48, 80, 96, …) are handled as a sum of
power-of-two column chunks (48 = 32 + 16), so nothing is copied; other head dims are zero-padded to a
multiple of 16 by ``flash_decode`` (a copy of K and V: the caches should use D % 16 == 0).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

LOG2E = math.log2(math.e)
_NEG_INF = float("-inf")
MIN_BLOCK = 16  # tl.dot needs every matmul dimension ≥ 16
MAX_HEAD_DIM = 256
H200_SMS = 132


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the decode kernel (hashable: a static argument).

    block_k: keys per block (a power of two ≥ 16 dividing the capacity C); num_splits: programs per
    (row, key/value head), each taking an equal share of the live blocks; num_warps / num_stages: the
    Triton launch knobs (num_stages = software-pipelined K/V block loads in flight); fold_floor: with ACP's
    decay floor and one split, the floor's pass over Λ_k is the attention loop itself (blocks newest first), not a
    pass of its own before it (the same keys, Λ_k loaded once; the softmax summed in the other order).
    late_writes: the in-place writes of the carries and the ring's tables after the attention loop (one barrier
    there) instead of before it, so that no barrier stands between the program's first loads and the loop's K/V
    loads; early_epilogue: the fused step's output norm scales and output gate logits loaded with the prologue's
    inputs instead of after the loop (one round trip to memory fewer on the program's path). Neither changes a value.
    """

    block_k: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fold_floor: bool = True
    late_writes: bool = True
    early_epilogue: bool = True

    def __post_init__(self):
        if self.block_k < MIN_BLOCK or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k must be a power of two ≥ {MIN_BLOCK}, got {self.block_k}")
        if self.num_splits < 1:
            raise ValueError(f"num_splits must be ≥ 1, got {self.num_splits}")


# GPU defaults from one H200 sweep (benchmarks/bench_decode_attention.py --sweep, 2026-12-02, jax 0.11.2,
# bf16, results in benchmarks/results/decode/): 64-key blocks with 3 loads in flight, and splits so that
# B·Hkv·num_splits ≈ 3 programs per SM (FoX 125M B8 at C 8320: 4 splits 69 µs vs 6 splits 102 µs; GPT-2 B32:
# 1 split 54 µs vs 2 splits 58 µs; 32k ring 214 µs = 3.7 TB/s of K/V).
_GPU_BLOCK_K = 64
_GPU_TARGET_PROGRAMS = 3 * H200_SMS
_GPU_MIN_BLOCKS_PER_SPLIT = 4
SHARED_LIMIT = 220 * 1024  # sm_90 allows 227 KB of shared memory per block
# Interpret mode (CPU tests): 16-key blocks so short rings still give many blocks, wraps and splits.
_INTERPRET_BLOCK_K = 16


def largest_block_k(capacity: int, preferred: int) -> int | None:
    """The largest power of two ≤ ``preferred`` and ≥ 16 that divides ``capacity`` (None if none)."""
    bk = preferred
    while bk >= MIN_BLOCK:
        if capacity % bk == 0:
            return bk
        bk //= 2
    return None


def shared_bytes(config: DecodeConfig, head_dim: int, itemsize: int, group: int = 1, lam: bool = True,
                 valid: bool = False) -> int:
    """Estimated shared memory of the kernel: (num_stages − 1) pipelined buffers (at least one) of a K and a V
    block, the Λ_k pair block (one row when G = 1, else ≥ 16 rows) and the slot mask; within ~10 % of what
    Triton reports for sm_90 (bench_decode_attention.py --offline)."""
    per_stage = config.block_k * head_dim * itemsize * 2
    if lam:
        per_stage += config.block_k * 8 * (1 if group == 1 else max(MIN_BLOCK, group))
    if valid:
        per_stage += config.block_k
    return max(config.num_stages - 1, 1) * per_stage


def default_decode_config(batch_heads: int, capacity: int, *, interpret: bool = False,
                          block_k: int | None = None, num_splits: int | None = None, head_dim: int = 64,
                          itemsize: int = 2, group: int = 1, lam: bool = True,
                          valid: bool = False) -> DecodeConfig:
    """The tiling for B·Hkv = ``batch_heads`` programs over a ring of ``capacity`` keys.

    block_k: the given one, else the largest power of two ≤ 64 (16 in interpret mode) dividing C.
    num_splits: the given one, else ≈ 3 programs per SM of an H200 (132 SMs; measured best, see
    ``_GPU_TARGET_PROGRAMS``) with at least 4 blocks of the capacity per split (1 in interpret mode).
    num_stages: 3, fewer when the pipelined K/V blocks of this head_dim / dtype would not fit the shared
    memory (``shared_bytes`` ≤ ``SHARED_LIMIT``; e.g. float32 at D = 128 with 128-key blocks).

    Raises:
      ValueError: C is not a multiple of 16 (no block size fits the ring).
    """
    if block_k is None:
        block_k = largest_block_k(capacity, _INTERPRET_BLOCK_K if interpret else _GPU_BLOCK_K)
        if block_k is None:
            raise ValueError(f"the ring capacity C must be a multiple of {MIN_BLOCK} for the Pallas decode kernel, "
                             f"got C={capacity}")
    if num_splits is None:
        if interpret:
            num_splits = 1
        else:
            want = _GPU_TARGET_PROGRAMS // max(batch_heads, 1)
            num_splits = max(1, min(want, capacity // (block_k * _GPU_MIN_BLOCKS_PER_SPLIT)))
    config = DecodeConfig(block_k=block_k, num_splits=num_splits)
    while config.num_stages > 1 and shared_bytes(config, head_dim, itemsize, group, lam, valid) > SHARED_LIMIT:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


def head_dim_chunks(d: int) -> tuple[tuple[int, int], ...]:
    """(offset, size) column chunks of a head dim D % 16 == 0, each a power of two ≥ 16 (binary
    decomposition of D: 96 → ((0, 64), (64, 32)))."""
    if d % MIN_BLOCK:
        raise ValueError(f"head_dim must be a multiple of {MIN_BLOCK} here, got {d}")
    chunks, off = [], 0
    for bit in reversed(range(d.bit_length())):
        size = 1 << bit
        if size >= MIN_BLOCK and d - off >= size:
            chunks.append((off, size))
            off += size
    return tuple(chunks)


def _pow2_at_least(x: int, floor: int) -> int:
    return max(floor, 1 << max(0, (x - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class StepGeom:
    """The fused decode step's per-head work (``flash_decode(..., step=)``; static): which parts run, their eps."""

    shift: bool = False  # KV-shift of the step's k and v from the carried raw k̃, ṽ (α = σ(logit))
    q_norm: bool = False  # RMSNorm of q over D times a scale
    k_norm: bool = False  # RMSNorm of the (shifted) k over D times a scale
    gates: bool = False  # Λ of the step = Λ_prev + log f (pairs), the query's and the entry's Λ
    o_norm: bool = False  # RMSNorm of the output over D times a scale (one split only: else after the combine)
    o_gate: bool = False  # output times σ(gate logits) (one split only)
    o_proj: int = 0  # N > 0: the output projected by the layer's W_o rows, a float32 partial [N] per program (one split)
    gate_logits: bool = True  # the forget gates come as logits (log σ taken here), else as log f
    q_heads: int = 1  # H and Hkv of the layer: the rows of ``rows`` are q (H), k (Hkv), v (Hkv), o gate (H)
    kv_heads: int = 1
    group_heads: tuple | None = None  # the layer's kv head of each of this call's kv heads (a cache's head group)
    qk_eps: float = 1e-5
    o_eps: float = 1e-6
    x_norm_eps: float | None = None  # ``rows`` and the gate sums are of the un-normalised x: scaled by its RMS here
    row_parts: int = 0  # S > 0: ``rows`` holds S float32 partial sums per row, summed here (then ``row_dtype``)
    row_dtype: str = ""  # with ``row_parts``: the compute dtype the summed rows are rounded to (q's)
    row_bias: bool = False  # a bias per row of ``rows`` added here, after the sum (never with a row scale)


@dataclasses.dataclass(frozen=True)
class _Geom:
    group: int  # G
    group_pad: int  # Gp
    n_blocks: int  # the ring's blocks: (C − pin_slots) // bk
    block_k: int
    num_splits: int
    chunks: tuple[tuple[int, int], ...]
    scale: float
    has_lam: bool
    has_valid: bool
    exact_dot: bool  # float32 inputs: IEEE matmuls (Triton's default for float32 is TF32)
    append: bool = False  # the step's own key comes in separately and is written to the ring here
    has_floor: bool = False  # a decay floor per query head hides the ring's oldest keys (ACP); first visible out
    fold_floor: bool = False  # the floor's pass is the attention loop (one split; ``DecodeConfig.fold_floor``)
    late_writes: bool = False  # carries and tables written after the attention loop (``DecodeConfig.late_writes``)
    early_epilogue: bool = False  # the output norm / gate operands loaded up front (``DecodeConfig.early_epilogue``)
    step: StepGeom | None = None  # append mode: the raw projections in, the layer's per-head work done here
    tables: int = 0  # append mode: the ring's start / peak / overflow advanced here, per row (1) or per kv head (2)
    kv_heads: int = 1
    sinks: int = 0  # append mode: positions 0 .. sinks − 1 of a row kept in slots [0, pin_slots) (``sinks:S+W``)
    pin_slots: int = 0  # slots in front of the ring (a power of two ≥ 16, read as one block), or 0
    interpret: bool = False  # interpret mode (no barrier there: one thread, in order)
    names: tuple = ()  # the refs in the kernel's order: inputs, then outputs


def pair_add(a: tuple, b: tuple) -> tuple:
    """(a_hi + a_lo) + (b_hi + b_lo) as a normalised float32 pair (double-float addition; arrays of any shape, also
    inside a kernel).

    Knuth's two-sum gives the rounding error of a_hi + b_hi exactly; the low parts are added to it and the result
    renormalised (fast two-sum), so the pair carries ~2⁻⁴⁴ relative precision. Associative to that precision."""
    s = a[0] + b[0]
    bb = s - a[0]
    err = (a[0] - (s - bb)) + (b[0] - bb) + (a[1] + b[1])
    hi = s + err
    return hi, err - (hi - s)


def _dot(a, b, contract_a: int, contract_b: int, exact: bool):
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                           precision=lax.Precision.HIGHEST if exact else None,
                           preferred_element_type=jnp.float32)


def layer_head(j, group_heads: tuple | None):
    """The layer's key/value head of this call's kv head ``j`` (int32, traced): j itself, or ``group_heads[j]`` for a
    head group (a static tuple, so a chain of selects: also usable in a BlockSpec's index map)."""
    if group_heads is None:
        return j
    out = jnp.int32(group_heads[0])
    for n, h in enumerate(group_heads[1:], start=1):
        out = jnp.where(j == n, jnp.int32(h), out)
    return out


def _rms_chunks(xs, scales, eps: float, d: int, dtype):
    """RMSNorm over the head dim of a row block split into column chunks: xs [..., size] float32 each, scales the
    matching float32 chunks (broadcastable); returns the chunks in ``dtype``."""
    ss = None
    for x in xs:
        part = jnp.sum(x * x, axis=-1, keepdims=True)
        ss = part if ss is None else ss + part
    inv = lax.rsqrt(ss / d + eps)
    return [(x * inv * w).astype(dtype) for x, w in zip(xs, scales)]


def _gate_chunk(d_in: int) -> int:
    """The column chunk of ``_gate_logits``' pass: the largest power of two ≤ 256 dividing d_in (a multiple of 16)."""
    size = 256
    while d_in % size:
        size //= 2
    return size


def _gate_logits(r: dict, specs: list, x_norm_eps: float | None = None) -> tuple[list, jax.Array | None]:
    """Fused step: the float32 gate logits a program needs, one [width] vector per spec (member, offset, col, width,
    mask, valid): columns col … col + width − 1 of the gate projection ``member`` (0, 1: the k and v shifts, then
    the forget gates), read from ``gate_rows`` (at offset + col), or computed from the row's x (d_in a multiple of 16)
    and the program's rows of the gate table (``gate_table``: row ``member`` for a shift, rows ``member`` … member +
    G − 1 for the group's forget gates). ``mask`` [width] or None: with a mask only the first ``valid`` (static) lanes
    are filled, the others are 0. With ``x_norm_eps`` x is the un-normalised row and the table holds s ⊙ W (an
    RMSNorm's scale folded in): the same pass sums x² too, and the logits are r · (x · table) + bias with r =
    rsqrt(mean(x²) + eps) = the norm's row scale. Returns (the logits, r as a float32 scalar or None).

    One pass over d_in in equal chunks (``_gate_chunk``), each chunk of x and of the table loaded once and their
    products summed elementwise; then two reductions in all: over the columns, and over the table's rows gathering
    every value the program needs into the lanes of one vector (its gates' sums and biases, and x² — in the table's
    padding row when it has one, else summed beside), which each warp then reads from its own registers. Each
    cross-warp reduction is a round trip through shared memory behind a barrier: a reduction per chunk and a
    gather per gate made the fused step's prologue 31 barriers long for FoX (Pro) 125M, this 14
    (``benchmarks/checks/decode_sass.py``)."""
    if "gate_x" not in r:
        load = lambda ref, m: pltriton.load(ref, mask=m, other=0.0) if m is not None else pltriton.load(ref)  # noqa: E731
        rows = r["gate_rows"]
        return [load(rows.at[pl.ds(offset + col, width)], mask) for _, offset, col, width, mask, _ in specs], None
    d_in, n_rows = r["gate_x"].shape[0], r["gate_wt"].shape[0]
    wanted = [member + j for member, _, _, _, mask, valid in specs for j in range(1 if mask is None else valid)]
    spare = x_norm_eps is not None and max(wanted) + 1 < n_rows  # the table's last row is padding (zeros, bias 0)
    width = _gate_chunk(d_in)
    last_row = lax.broadcasted_iota(jnp.int32, (n_rows, width), 0) == n_rows - 1
    prods = xsq = None
    for off in range(0, d_in, width):
        x = pltriton.load(r["gate_x"].at[pl.ds(off, width)]).astype(jnp.float32)[None, :]
        part = pltriton.load(r["gate_wt"].at[:, pl.ds(off, width)]) * x  # [P, width]
        if spare:
            part = jnp.where(last_row, x * x, part)
        elif x_norm_eps is not None:
            xsq = x * x if xsq is None else xsq + x * x
        prods = part if prods is None else prods + part
    sums = jnp.sum(prods, axis=1)  # [P]
    # lane j ← the sum of row wanted[j] (the specs' rows, then x²'s), lane n + j ← its bias
    wanted += [n_rows - 1] if spare else []
    n = _pow2_at_least(len(wanted), 1)
    rows = lax.broadcasted_iota(jnp.int32, (n_rows, 2 * n), 0)
    lanes = lax.broadcasted_iota(jnp.int32, (n_rows, 2 * n), 1)
    pick = functools.reduce(jnp.logical_or, [(lax.rem(lanes, n) == j) & (rows == m) for j, m in enumerate(wanted)])
    both = jnp.where(lanes < n, sums[:, None], pltriton.load(r["gate_bt"].at[:])[:, None])
    got = jnp.sum(jnp.where(pick, both, 0.0), axis=0)  # [2n], in every warp
    lane = lax.broadcasted_iota(jnp.int32, (2 * n,), 0)
    value = lambda j: jnp.sum(jnp.where(lane == j, got, 0.0))  # noqa: E731  (within a warp)
    row_scale = None
    if x_norm_eps is not None:
        row_scale = lax.rsqrt((value(len(wanted) - 1) if spare else jnp.sum(xsq)) / d_in + x_norm_eps)
    outs, j = [], 0
    for member, _, _, w, mask, valid in specs:
        lanes_w = lax.broadcasted_iota(jnp.int32, (w,), 0)
        vec = jnp.zeros((w,), jnp.float32)
        for i in range(1 if mask is None else valid):  # the member's rows: member, member + 1, … (a group's gates)
            logit = value(j) if row_scale is None else value(j) * row_scale
            vec = jnp.where(lanes_w == i, logit + value(n + j), vec)
            j += 1
        outs.append(vec)
    return outs, row_scale


def gate_table(gate_w: tuple, kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """The fused step's gate projections per key/value head, as each program reads them: (weights [Hkv, P, d_in],
    bias [Hkv, P]) float32, P = the next power of two ≥ the rows: row m the k / v shift of the head (m = 0, 1, with
    shifts), then the G forget gates of its query heads; padding rows 0, a missing bias 0. ``gate_w``: (kernel
    [d_in, n] float32, bias [n] or None) per gate as ``StepArrays.gate_w`` (n = Hkv for a shift, H = Hkv·G for the
    forget gates; query head h·G + g belongs to kv head h)."""
    ws, bs = [], []
    for kernel, bias in gate_w:
        d_in, n = kernel.shape
        ws.append(kernel.astype(jnp.float32).T.reshape(kv_heads, n // kv_heads, d_in))
        bs.append(jnp.zeros((n,), jnp.float32) if bias is None else bias.astype(jnp.float32))
    w = jnp.concatenate(ws, axis=1)
    b = jnp.concatenate([x.reshape(kv_heads, -1) for x in bs], axis=1)
    pad = _pow2_at_least(w.shape[1], 1) - w.shape[1]
    return jnp.pad(w, ((0, 0), (0, pad), (0, 0))), jnp.pad(b, ((0, 0), (0, pad)))


def _step_prologue(g: _Geom, r: dict, row_ok):
    """Fused step: the raw q, k, v of the step made ready for attention, as the layer's ``HeadOps`` does it
    (fox_jax/ops/head_ops.py): KV-shift, QK-norm, and Λ = Λ_prev + log f. The projections are rows of ``rows`` (the
    decode GEMM's output, read in place), the shift and gate logits ``_gate_logits``. Every split computes
    it; split 0 writes the carries (raw k̃, ṽ in place; Λ in place with one split, else to a new array: the other
    splits read Λ_prev while split 0 would overwrite it). Other splits' k and v read a carry split 0 may
    be writing, but they only enter split 0's softmax and ring write. The carries' new values are returned, not
    written: the kernel writes them (``_carry_writes``) after a barrier, once every thread of the program has read
    the carries (global memory is not ordered between a program's threads). With ``x_norm_eps`` the rows are of the un-normalised x and are scaled by its row
    scale r (``_gate_logits``) first. Returns (q chunks [Gp, size], k_new, v_new chunks [size] in the rows' dtype,
    (Λ hi, lo) [Gp] or None, the raw k and v chunks that the shift's carry takes (a pair of lists) or None, r or
    None); ``_carry_writes`` makes the carries' writes of them."""
    st, dt = g.step, _rows_dtype(g, r)
    f32 = jnp.float32
    hkv, head = st.kv_heads, _layer_head_of_program(g)  # this program's kv head in the layer
    qs = _load_rows(g, r, pl.ds(head * g.group, g.group_pad), row_ok)
    ks = _load_rows(g, r, st.q_heads + head)
    vs = _load_rows(g, r, st.q_heads + hkv + head)
    pos = r["hi"][()] - 1 - r["seq_start"][()]  # the step's position (< 0: a pad)
    d = sum(size for _, size in g.chunks)
    # every gate logit of the program in one pass, before anything waits on them: the k and v shifts' of its kv
    # head, then its group's forget gates
    specs = [(which, which * hkv, head, 1, None, 0) for which in ((0, 1) if st.shift else ())]
    if st.gates:
        specs.append((2 if st.shift else 0, 2 * hkv if st.shift else 0, head * g.group, g.group_pad, row_ok[:, 0],
                      g.group))
    logits, row_scale = _gate_logits(r, specs, st.x_norm_eps) if specs else ([], None)
    if row_scale is not None:  # the rows are of the un-normalised x: scaled as the norm would have (in float32)
        qs, ks, vs = ([(x.astype(f32) * row_scale).astype(dt) for x in xs] for xs in (qs, ks, vs))
    if st.row_bias:
        qs = _add_row_bias(g, r, qs, pl.ds(head * g.group, g.group_pad), row_ok)
        ks = _add_row_bias(g, r, ks, st.q_heads + head)
        vs = _add_row_bias(g, r, vs, st.q_heads + hkv + head)
    raw = None
    if st.shift:
        keep = pos > 0  # the first token of a row (and a pad) sees zeros
        raw, out = (ks, vs), []
        for xs, which in ((ks, 0), (vs, 1)):
            a = jax.nn.sigmoid(logits[which])  # [1]: broadcast, no reduction
            shifted = []
            for x, (off, size) in zip(xs, g.chunks):
                prev = pltriton.load(r["shift_state"].at[jnp.int32(which), pl.ds(off, size)]).astype(f32)
                prev = jnp.where(keep, prev, 0.0)
                shifted.append((a * prev + (1.0 - a) * x.astype(f32)).astype(dt))
            out.append(shifted)
        ks, vs = out
    if st.k_norm:
        scales = [pltriton.load(r["k_scale"].at[pl.ds(off, size)]) for off, size in g.chunks]
        ks = _rms_chunks([x.astype(f32) for x in ks], scales, st.qk_eps, d, dt)
    if st.q_norm:
        scales = [pltriton.load(r["q_scale"].at[:, pl.ds(off, size)], mask=row_ok, other=0.0) for off, size in g.chunks]
        qs = [jnp.where(row_ok, x, 0.0).astype(dt) for x in
              _rms_chunks([x.astype(f32) for x in qs], scales, st.qk_eps, d, f32)]
    lam = None
    if st.gates:
        lf = logits[-1]
        if st.gate_logits:
            lf = jax.nn.log_sigmoid(lf)
        lf = jnp.where((pos >= 0) & row_ok[:, 0], lf, 0.0)  # a pad adds no gate
        prev = tuple(pltriton.load(r[n].at[:], mask=row_ok[:, 0], other=0.0) for n in ("lp_hi", "lp_lo"))
        lam = pair_add(prev, (lf, jnp.zeros_like(lf)))
    return qs, ks, vs, lam, raw, row_scale


def _rows_dtype(g: _Geom, r: dict):
    """Fused step: the compute dtype of the step's rows (``rows``' own, or with partial sums ``row_dtype``)."""
    return jnp.dtype(g.step.row_dtype) if g.step.row_parts else r["rows"].dtype


def _load_rows(g: _Geom, r: dict, row, row_ok=None) -> list:
    """Fused step: row(s) ``row`` of ``rows`` (an index, or a ``pl.ds`` of Gp rows masked by ``row_ok``) as head-dim
    chunks in the compute dtype; with ``row_parts`` the S float32 partial sums added in float32 (in order) and rounded
    once, as the layer's GEMM rounds its float32 accumulation."""
    st = g.step
    masked = dict(mask=row_ok, other=0.0) if row_ok is not None else {}
    if not st.row_parts:
        return [pltriton.load(r["rows"].at[row, pl.ds(off, size)], **masked) for off, size in g.chunks]
    out = []
    for off, size in g.chunks:
        acc = pltriton.load(r["rows"].at[jnp.int32(0), row, pl.ds(off, size)], **masked)
        for part in range(1, st.row_parts):
            acc = acc + pltriton.load(r["rows"].at[jnp.int32(part), row, pl.ds(off, size)], **masked)
        out.append(acc.astype(st.row_dtype))
    return out


def _add_row_bias(g: _Geom, r: dict, xs: list, row, row_ok=None) -> list:
    """Fused step: chunks ``xs`` of row(s) ``row`` plus their bias (``row_bias``, in the compute dtype), added in
    float32 and rounded to the compute dtype: ``nn.Dense``'s y + b with y and b in that dtype."""
    masked = dict(mask=row_ok, other=0.0) if row_ok is not None else {}
    dt = xs[0].dtype
    return [(x.astype(jnp.float32) + pltriton.load(r["row_bias"].at[row, pl.ds(off, size)], **masked).astype(
        jnp.float32)).astype(dt) for x, (off, size) in zip(xs, g.chunks)]


def _carry_writes(g: _Geom, r: dict, raw, lam, row_ok) -> list:
    """Fused step: the carries' writes as thunks, split 0's only: the raw k̃, ṽ chunks (``raw``) into the shift's
    carry, Λ (``lam``) in place with one split, else to a new array (the other splits read Λ_prev)."""
    writer = pl.program_id(1) == 0
    writes = []
    for xs, which in zip(raw or (), (0, 1)):
        writes += [functools.partial(pltriton.store, r["shift_out"].at[jnp.int32(which), pl.ds(off, size)], x,
                                     mask=jnp.full((size,), writer)) for x, (off, size) in zip(xs, g.chunks)]
    names = ("lp_hi_out", "lp_lo_out") if g.num_splits == 1 else ("lp_hi_new", "lp_lo_new")  # in place, or not
    if lam is not None and names[0] in r:
        writes += [functools.partial(pltriton.store, r[n].at[:], x, mask=row_ok[:, 0] & writer)
                   for n, x in zip(names, lam)]
    return writes


def _layer_head_of_program(g: _Geom):
    """Fused step: the layer's key/value head of this program (int32, traced)."""
    st = g.step
    n_call = st.kv_heads if st.group_heads is None else len(st.group_heads)
    return layer_head(lax.rem(pl.program_id(0), n_call), st.group_heads)


def _epilogue_operands(g: _Geom, r: dict, row_ok):
    """Fused step, one split: what the epilogue reads, (output norm scale chunks or None, output gate logit chunks
    or None), each [Gp, size]; loaded with the prologue's inputs (``early_epilogue``) or after the loop."""
    st = g.step
    scales = gates = None
    if st.o_norm:
        scales = [pltriton.load(r["o_scale"].at[:, pl.ds(off, size)], mask=row_ok, other=0.0) for off, size in g.chunks]
    if st.o_gate:  # the gate logits: rows 2·Hkv + H + head·G of ``rows``
        first = st.q_heads + 2 * st.kv_heads + _layer_head_of_program(g) * g.group
        gates = _load_rows(g, r, pl.ds(first, g.group_pad), row_ok)
        if st.row_bias:  # (never with a row scale: ``flash_decode`` refuses the pair)
            gates = _add_row_bias(g, r, gates, pl.ds(first, g.group_pad), row_ok)
    return scales, gates


def _step_epilogue(g: _Geom, r: dict, outs, row_ok, operands=None, row_scale=None):
    """Fused step, one split: the output norm and gate on the normalised output chunks (float32 [Gp, size]), with
    ``operands`` from ``_epilogue_operands`` (loaded here when None) and the gate logits scaled by ``row_scale`` (the
    rows' r with ``x_norm_eps``); returns them in the output dtype, rounded where the layer rounds
    (``head_epilogue``)."""
    st, dt = g.step, r["o"].dtype
    f32 = jnp.float32
    scales, gates = operands if operands is not None else _epilogue_operands(g, r, row_ok)
    if gates is not None and row_scale is not None:
        gates = [(x.astype(f32) * row_scale).astype(dt) for x in gates]
    outs = [x.astype(dt).astype(f32) for x in outs]  # the attention output in its dtype, as the layer sees it
    if st.o_norm:
        d = sum(size for _, size in g.chunks)
        outs = [x.astype(f32) for x in _rms_chunks(outs, scales, st.o_eps, d, dt)]
    if st.o_gate:
        outs = [x * jax.nn.sigmoid(gt.astype(f32)).astype(dt).astype(f32) for x, gt in zip(outs, gates)]
    return [x.astype(dt) for x in outs]


PROJ_CHUNK = 256  # output columns of W_o per matmul in ``_project_out`` ([D, 256] of bf16: 64 registers a thread)


def _project_out(g: _Geom, r: dict, outs):
    """Fused step with ``o_proj``: the program's share of the output projection, Σ_g o_g · W_o[g] for its G query
    heads, written as float32 [N] to ``o``. ``outs``: the output chunks [Gp, size] in the compute dtype (rows ≥ G
    unused); each query head's row is picked out by a mask (rows of W_o differ per head) and multiplied on the tensor
    cores with float32 accumulation, N in chunks of ≤ ``PROJ_CHUNK`` columns (power-of-two chunks of N)."""
    rows = lax.broadcasted_iota(jnp.int32, (g.group_pad, 1), 0)
    n_chunks = [(off + j, min(PROJ_CHUNK, size)) for off, size in head_dim_chunks(g.step.o_proj)
                for j in range(0, size, PROJ_CHUNK)]
    for n0, nc in n_chunks:
        acc = None
        for head in range(g.group):
            for x, (off, size) in zip(outs, g.chunks):
                w = pltriton.load(r["o_proj"].at[jnp.int32(head), pl.ds(off, size), pl.ds(n0, nc)])
                part = _dot(jnp.where(rows == head, x, 0).astype(w.dtype), w, 1, 0, g.exact_dot)
                acc = part if acc is None else acc + part
        pltriton.store(r["o"].at[pl.ds(n0, nc)], jnp.sum(acc, axis=0))


def _decode_kernel(*refs, g: _Geom):
    r = dict(zip(g.names, refs))
    bk, gp = g.block_k, g.group_pad
    k_ref, v_ref = r["k"], r["v"]

    rows = lax.broadcasted_iota(jnp.int32, (gp, 1), 0)
    row_ok = rows < g.group
    cap = g.n_blocks * bk
    hi_in = r["hi"][()]
    lo = jnp.maximum(r["lo"][()], 0)
    if g.tables:  # ``lo`` is the rule's first visible column: the ring's start bounds it too
        start, peak, overflow = (jnp.sum(pltriton.load(r[n].at[pl.ds(0, 1)])) for n in ("start", "peak", "overflow"))
        lo = jnp.maximum(lo, start)
    wanted = lo  # what the policy keeps (with a floor: found below)
    if g.has_floor:  # the ring's start before this step: ≤ C held keys before the new one, the oldest in its slot
        lo = jnp.maximum(lo, hi_in - 1 - cap)
        hi = jnp.maximum(hi_in, lo)  # 0 ≤ hi − lo ≤ C + 1
    elif g.tables:  # the ring holds the last C columns: what the policy kept beyond them overflows
        lo = jnp.maximum(lo, hi_in - cap)
        hi = jnp.maximum(hi_in, lo)
    else:
        hi = jnp.minimum(jnp.maximum(hi_in, lo), lo + cap)  # 0 ≤ hi − lo ≤ C
    if g.append:
        # the step's key is logical key hi − 1, in registers: the ring is read over [lo, hi − 1) only, so no
        # program loads the slot this one writes (every key of that range lies less than C before hi − 1)
        slot = g.pin_slots + lax.rem(jnp.maximum(r["hi"][()] - 1, 0), g.n_blocks * bk)
        with_new = hi > lo
        hi = jnp.where(with_new, hi - 1, lo)
    pin_slot = n_pinned = n_held = None
    if g.pin_slots:  # the pinned positions written before this step; the step's own, if pinned, joins from registers
        pos_new = hi_in - 1 - r["seq_start" if g.step is not None else "sink_seq"][()]
        n_pinned = jnp.clip(pos_new, 0, g.sinks)
        n_held = jnp.clip(pos_new + 1, 0, g.sinks)  # after this step
        at_pin = (pos_new >= 0) & (pos_new < g.sinks)  # its ring column is behind the ring's start (≥ seq_start + S)
        with_new = with_new | at_pin
        pin_slot = (jnp.clip(pos_new, 0, g.pin_slots - 1), at_pin)
    lq = lam_new = epilogue = row_scale = None
    writes = []
    if g.step is not None:  # the raw projections: the layer's per-head work here
        if g.early_epilogue and g.num_splits == 1:
            epilogue = _epilogue_operands(g, r, row_ok)
        qs, k_new, v_new, lq, raw, row_scale = _step_prologue(g, r, row_ok)
        writes, lam_new = _carry_writes(g, r, raw, lq, row_ok), lq
    else:
        qs = [pltriton.load(r["q"].at[:, pl.ds(off, size)], mask=row_ok, other=0.0) for off, size in g.chunks]
        if g.has_lam:
            lq = tuple(pltriton.load(r[n].at[:], mask=row_ok[:, 0], other=0.0) for n in ("lq_hi", "lq_lo"))
        if g.append:
            k_new = [pltriton.load(r["k_new"].at[pl.ds(off, size)]) for off, size in g.chunks]
            v_new = [pltriton.load(r["v_new"].at[pl.ds(off, size)]) for off, size in g.chunks]
            if g.has_lam:  # one Λ per query head of the group ([1] with G = 1: what the ring's row stores)
                load = (lambda ref: pltriton.load(ref.at[pl.ds(0, 1)])) if g.group == 1 else \
                    (lambda ref: pltriton.load(ref.at[:], mask=row_ok[:, 0], other=0.0))  # noqa: E731
                lam_new = (load(r["ln_hi"]), load(r["ln_lo"]))

    # Every in-place buffer (carries, tables) is read above by all threads, then written after a barrier: here, or
    # with ``late_writes`` at the end, so that the loop's first K/V loads need not wait for the barrier.
    if (g.tables or writes) and not g.late_writes:
        if not g.interpret:
            pltriton.debug_barrier()
        for write in writes:
            write()
        writes = []

    def decay_block(start, size=bk):  # [Gp or 1, size] float32 Λ_q − Λ_k of the block at physical slot ``start``
        if g.group == 1:  # one row of Λ_k per block, broadcast over the (padding) rows
            lk_hi = r["lk_hi"][pl.ds(start, size)][None, :]
            lk_lo = r["lk_lo"][pl.ds(start, size)][None, :]
        else:
            lk_hi = pltriton.load(r["lk_hi"].at[:, pl.ds(start, size)], mask=row_ok, other=0.0)
            lk_lo = pltriton.load(r["lk_lo"].at[:, pl.ds(start, size)], mask=row_ok, other=0.0)
        return (lq[0][:, None] - lk_hi) + (lq[1][:, None] - lk_lo)

    def physical(n):  # the first slot of the ring's logical block n (the blocks start after the pinned slots)
        return pl.multiple_of(g.pin_slots + lax.rem(n, g.n_blocks) * bk, min(bk, g.pin_slots or bk))

    # ACP's floor with one split (``fold``): the floor's pass over Λ_k is the attention loop itself, blocks newest
    # first (the first hidden key met is the last one; every older key is masked), so Λ_k is loaded once per block.
    fold = g.fold_floor
    if g.has_floor and not fold:  # ACP: the range starts after the last key below the floor for every head of the group
        # Split 0 also tests the oldest key (hi − C, whose slot it overwrites with the new key after this pass: the
        # test counts for ``first``, i.e. for the ring's overflow); no other program loads that slot's value.
        scan_lo = jnp.where(pl.program_id(1) == 0, lo, jnp.maximum(lo, hi + 1 - cap))
        first = _first_above_floor(g, r["floor"], r["first"], decay_block, physical, scan_lo, lo, hi, row_ok)
        lo = jnp.maximum(first, hi + 1 - cap)  # the oldest key is never read: its slot receives the new key
        hi = jnp.maximum(hi, lo)
        wanted = first
    if g.tables and not fold:  # the ring's tables after this step (one writer per table entry; the others read the
        advance = functools.partial(_advance_tables, g, r, lo, wanted, hi_in, peak, overflow, n_held)  # same start)
        if g.late_writes:
            writes.append(advance)
        else:
            advance()

    # This program's share of the logical blocks [n_first, n_end): equal shares of the live blocks.
    n_first = lax.div(lo, bk)
    n_end = jnp.where(hi > lo, lax.div(hi + (bk - 1), bk), n_first)
    per = lax.div(n_end - n_first + (g.num_splits - 1), g.num_splits)
    start_n = jnp.minimum(n_first + pl.program_id(1) * per, n_end)
    end_n = jnp.minimum(start_n + per, n_end)

    def scores(start, n_keys=bk):  # [Gp, n_keys] float32 scale · q·k of the block at physical slot ``start``
        s = None
        for q, (off, size) in zip(qs, g.chunks):
            part = _dot(q, k_ref[pl.ds(start, n_keys), pl.ds(off, size)], 1, 1, g.exact_dot)
            s = part if s is None else s + part
        return s * g.scale

    def accumulate(carry, s, start):  # the online softmax over one block's scores s [Gp, keys] (−inf: masked)
        accs, m_i, l_i = carry
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        m_base = jnp.where(m_new == _NEG_INF, 0.0, m_new) * LOG2E
        alpha = jnp.exp2(m_i * LOG2E - m_base)
        p = jnp.exp2(s * LOG2E - m_base[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        new_accs = []
        for acc, (off, size) in zip(accs, g.chunks):
            v = v_ref[pl.ds(start, s.shape[1]), pl.ds(off, size)]
            new_accs.append(acc * alpha[:, None] + _dot(p.astype(v.dtype), v, 1, 0, g.exact_dot))
        return tuple(new_accs), m_new, l_new

    def step(n, carry):  # block n, its keys outside [lo, hi) (and invalid slots) masked
        start = physical(n)  # physical slot of logical key n·bk
        s = scores(start)
        if g.has_lam:
            s = s + decay_block(start)
        kpos = n * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        keep = (kpos >= lo) & (kpos < hi)
        if g.has_valid:
            keep = keep & r["valid"][pl.ds(start, bk)][None, :]
        return accumulate(carry, jnp.where(keep, s, _NEG_INF), start)

    carry = (tuple(jnp.zeros((gp, size), jnp.float32) for _, size in g.chunks),
             jnp.full((gp,), _NEG_INF, jnp.float32), jnp.zeros((gp,), jnp.float32))
    if g.pin_slots:  # split 0 reads the pinned slots, one block of pin_slots keys
        s = scores(0, g.pin_slots)
        if g.has_lam:
            s = s + decay_block(0, g.pin_slots)
        kpos = lax.broadcasted_iota(jnp.int32, (1, g.pin_slots), 1)
        carry = accumulate(carry, jnp.where((kpos < n_pinned) & (pl.program_id(1) == 0), s, _NEG_INF), 0)
    if fold:
        floor = pltriton.load(r["floor"].at[:], mask=row_ok[:, 0], other=0.0)
        oldest = hi + 1 - cap  # the oldest key is tested (for ``first``, the ring's overflow), never read

        def step_above_floor(i, carry):  # block n_end − 1 − i: newest first
            n = n_end - 1 - i
            start = physical(n)
            decay = decay_block(start)
            kpos = n * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            inside = (kpos >= lo) & (kpos < hi)
            cut = jnp.maximum(carry[3], _last_hidden(decay, floor, kpos, inside, row_ok))
            s = jnp.where(inside & (kpos > cut) & (kpos >= oldest), scores(start) + decay, _NEG_INF)
            return accumulate(carry[:3], s, start) + (cut,)

        carry = lax.fori_loop(0, n_end - n_first, step_above_floor, carry + (jnp.int32(-1),))
        first = jnp.maximum(lo, carry[3] + 1)
        carry = carry[:3]
        pltriton.store(r["first"].at[pl.ds(0, 1)], jnp.full((1,), first, jnp.int32))
        if g.tables:
            advance = functools.partial(_advance_tables, g, r, jnp.maximum(first, oldest), first, hi_in, peak, overflow)
            if g.late_writes:
                writes.append(advance)
            else:
                advance()
    else:  # every block of the share in one loop with the element mask (one software pipeline across the range: three
        # loops — the masked first and last blocks around an unmasked middle — refilled it at both boundaries, which
        # cost a window:256 step 7 µs on an H100, 2026-12-07; the mask keeps every key of a block inside the range)
        carry = lax.fori_loop(start_n, end_n, step, carry)
    accs, m_i, l_i = carry
    if g.append:
        accs, m_i, l_i = _append_new_key(g, r, qs, k_new, v_new, lam_new, slot, with_new, accs, m_i, l_i,
                                         lq=lq, row_ok=row_ok, pin_slot=pin_slot)

    if g.num_splits == 1:
        inv = jnp.where(l_i == 0.0, 0.0, 1.0 / jnp.where(l_i == 0.0, 1.0, l_i))
        outs = [acc * inv[:, None] for acc in accs]
        if g.step is not None:
            outs = _step_epilogue(g, r, outs, row_ok, epilogue, row_scale)
        if g.step is not None and g.step.o_proj:
            _project_out(g, r, outs)
        else:
            for x, (off, size) in zip(outs, g.chunks):
                pltriton.store(r["o"].at[:, pl.ds(off, size)], x.astype(r["o"].dtype), mask=row_ok)
    else:
        for acc, (off, size) in zip(accs, g.chunks):
            pltriton.store(r["o"].at[:, pl.ds(off, size)], acc, mask=row_ok)
        pltriton.store(r["m"].at[:], m_i, mask=row_ok[:, 0])
        pltriton.store(r["l"].at[:], l_i, mask=row_ok[:, 0])
    if writes:  # ``late_writes``: the carries and tables, once every thread has read them
        if not g.interpret:
            pltriton.debug_barrier()
        for write in writes:
            write()


def _advance_tables(g: _Geom, r: dict, start, wanted, hi_in, peak, overflow, n_held=None):
    """Append mode with the ring's tables: start' = the read start (``start``), peak' = max(peak, hi − start') (with
    pinned slots: max(peak, max(hi − start', 0) + ``n_held``, the pinned positions held after this step), overflow' = overflow + (start' − ``wanted``), the keys the policy kept but the ring could not hold (peak and
    overflow as the program read them before its barrier). Split 0 writes (per row: the program of kv head 0). Another
    program reading ``start`` after this write computes the same read start (start' ≥ every bound it took the
    maximum of), and only the writer's peak and overflow are stored."""
    writer = pl.program_id(1) == 0
    if g.tables == 1:
        writer = writer & (lax.rem(pl.program_id(0), g.kv_heads) == 0)
    one = lambda x: jnp.full((1,), x, jnp.int32)  # noqa: E731
    mask = jnp.full((1,), writer)
    pltriton.store(r["start_out"].at[pl.ds(0, 1)], one(start), mask=mask)
    live = hi_in - start
    if n_held is not None:
        live = jnp.maximum(live, 0) + n_held
    pltriton.store(r["peak_out"].at[pl.ds(0, 1)], one(jnp.maximum(peak, live)), mask=mask)
    pltriton.store(r["overflow_out"].at[pl.ds(0, 1)], one(overflow + (start - wanted)), mask=mask)


def _first_above_floor(g: _Geom, floor_ref, first_ref, decay_block, physical, scan_lo, lo, hi, row_ok):
    """The decay floor (ACP's eviction): key j of [scan_lo, hi) is hidden when Λ_q − Λ_k,j < floor for every query
    head of the group; it and every older key leave the range [lo, hi), which starts at ``first`` = max(lo, last
    hidden + 1). A pass over the Λ_k blocks of the range (every split the same; 8 bytes per key and query head,
    against 2·D·itemsize of K and V), in the same float32 form as the scores' decay. Split 0 writes ``first`` to
    ``first_ref``; returns it."""
    bk = g.block_k
    floor = pltriton.load(floor_ref.at[:], mask=row_ok[:, 0], other=0.0)

    def scan(n, last):
        kpos = n * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        decay = decay_block(physical(n))
        return jnp.maximum(last, _last_hidden(decay, floor, kpos, (kpos >= scan_lo) & (kpos < hi), row_ok))

    n_end = jnp.where(hi > scan_lo, lax.div(hi + (bk - 1), bk), lax.div(scan_lo, bk))
    first = jnp.maximum(lo, lax.fori_loop(lax.div(scan_lo, bk), n_end, scan, jnp.int32(-1)) + 1)
    pltriton.store(first_ref.at[pl.ds(0, 1)], jnp.full((1,), first, jnp.int32), mask=jnp.full((1,), pl.program_id(1) == 0))
    return first


def _last_hidden(decay, floor, kpos, inside, row_ok):
    """The last key of a block below the decay floor for every query head of the group: max kpos where
    decay [Gp or 1, bk] < floor [Gp] on every real row and ``inside`` [1, bk], else −1 (int32 scalar)."""
    below = (decay < floor[:, None]) | ~row_ok
    hidden = (jnp.min(below.astype(jnp.int32), axis=0) > 0)[None, :] & inside
    return jnp.max(jnp.where(hidden, kpos, -1))


def _append_new_key(g: _Geom, r: dict, qs, k_new, v_new, lam_new, slot, with_new, accs, m_i, l_i, *, lq, row_ok,
                    pin_slot=None):
    """Append mode: the step's own key (k_new, v_new chunks [size], its Λ ``lam_new``: [1] with G = 1 or [Gp])
    joins split 0's online softmax as one more column, and split 0 writes it to ring slot ``slot`` (the aliased
    outputs ``k_out``, ``v_out``, ``lk_hi_out``, ``lk_lo_out``) and, with ``pin_slot`` = (its pinned slot, whether
    its position is pinned), there too. Returns the updated (accs, m, l)."""
    first = pl.program_id(1) == 0
    s = None
    for q, kn in zip(qs, k_new):
        part = jnp.sum(q.astype(jnp.float32) * kn.astype(jnp.float32)[None, :], axis=1)
        s = part if s is None else s + part
    s = s * g.scale
    if g.has_lam:
        s = s + ((lq[0] - lam_new[0]) + (lq[1] - lam_new[1]))
    s = jnp.where(first & with_new, s, _NEG_INF)
    m_new = jnp.maximum(m_i, s)
    m_base = jnp.where(m_new == _NEG_INF, 0.0, m_new) * LOG2E
    alpha = jnp.exp2(m_i * LOG2E - m_base)
    p = jnp.exp2(s * LOG2E - m_base)
    new_accs = []
    for acc, vn in zip(accs, v_new):  # the weight rounded to v's dtype, as the blocks' P·V
        w = p.astype(vn.dtype).astype(jnp.float32)
        new_accs.append(acc * alpha[:, None] + w[:, None] * vn.astype(jnp.float32)[None, :])
    # the write: one program per (row, key/value head)
    places = [(slot, first)] + ([] if pin_slot is None else [(pin_slot[0], first & pin_slot[1])])
    if g.has_lam and g.group == 1 and lam_new[0].shape[0] != 1:  # the fused step's Λ [Gp]: its one real row
        lam_new = tuple(jnp.full((1,), jnp.sum(jnp.where(row_ok[:, 0], x, 0.0)), jnp.float32) for x in lam_new)
    for at, write in places:
        for name, x in (("k_out", k_new), ("v_out", v_new)):
            for xc, (off, size) in zip(x, g.chunks):
                pltriton.store(r[name].at[pl.ds(at, 1), pl.ds(off, size)], xc[None, :], mask=jnp.full((1, size), write))
        if g.has_lam:
            for name, x in zip(("lk_hi_out", "lk_lo_out"), lam_new):
                if g.group == 1:
                    pltriton.store(r[name].at[pl.ds(at, 1)], x, mask=jnp.full((1,), write))
                else:
                    pltriton.store(r[name].at[:, pl.ds(at, 1)], x[:, None], mask=row_ok & write)
    return tuple(new_accs), m_new, l_i * alpha + p


def combine_splits(o: jax.Array, m: jax.Array, l: jax.Array, dtype) -> jax.Array:
    """The flash-decoding combine (one XLA reduction): partials o [..., S, G, D] (unnormalised, float32),
    m, l [..., S, G] (running max, natural log, and sum of exp(s − m)) → [..., G, D] in ``dtype``; 0
    where no split saw a key."""
    m_max = jnp.max(m, axis=-2, keepdims=True)
    m_max = jnp.where(m_max == _NEG_INF, 0.0, m_max)
    w = jnp.exp(m - m_max)  # 0 for empty splits (m = −inf)
    denom = jnp.sum(w * l, axis=-2)
    num = jnp.sum(w[..., None] * o, axis=-3)
    safe = jnp.where(denom == 0.0, 1.0, denom)
    return jnp.where(denom[..., None] == 0.0, 0.0, num / safe[..., None]).astype(dtype)


def _range_operand(x, b: int, hkv: int):
    """A range bound broadcastable to [B, Hkv] as the kernel reads it, without materialising the broadcast (a decode
    step would otherwise spend a kernel on it per layer): (int32 array, BlockSpec) for grid (B·Hkv, splits)."""
    x = jnp.asarray(x, jnp.int32)
    shape = (1, 1) if x.ndim == 0 else tuple(x.shape)
    if shape == (b, hkv):
        return x.reshape(b * hkv), pl.BlockSpec((None,), lambda i, s: (i,))
    if shape == (b, 1):
        return x.reshape(b), pl.BlockSpec((None,), lambda i, s: (lax.div(i, hkv),))
    if shape == (1, 1):
        return x.reshape(1), pl.BlockSpec((None,), lambda i, s: (0,))
    return jnp.broadcast_to(x.reshape(shape), (b, hkv)).reshape(b * hkv), pl.BlockSpec((None,), lambda i, s: (i,))


@functools.partial(jax.tree_util.register_dataclass,
                   meta_fields=["o_gate", "gate_logits", "qk_eps", "o_eps", "group_heads", "layer_kv_heads",
                                "x_norm_eps"],
                   data_fields=["rows", "seq_start", "gate_rows", "gate_x", "gate_w", "gate_table", "shift_state",
                                "q_scale", "k_scale", "lam_prev", "o_scale", "o_proj", "row_bias"])
@dataclasses.dataclass(frozen=True)
class StepArrays:
    """``flash_decode(..., step=)``: a decode step's raw inputs; a None field: that part is absent (``StepGeom``). The
    kernel then reads the step's q, k, v (and output gate logits) as rows of ``rows`` and does the layer's per-head
    work: KV-shift, QK-norm, Λ = Λ_prev + log f, and with one split the output norm and gate.

    Attributes:
      rows: [B, R, D] (q's dtype): the raw projections as rows, q (H = Hkv·G rows, query head h·G + g), k (Hkv),
        v (Hkv), then with ``o_gate`` the output gate logits (H); further rows are ignored. Or float32 [S, B, R, D]:
        S partial sums of them (the GEMM's inner dimension split in S, as a batched GEMM's output lies: e.g.
        ``fox_jax.nn.layers.split_dense``), which the kernel adds in float32 in order and rounds to q's dtype once
        (not with ``x_norm_eps``): the split's reduction costs no kernel of its own.
      seq_start: [B] int32, each row's first column: the step's position is hi − 1 − seq_start (< 0: a pad, which
        adds no gate; ≤ 0: the shift sees zeros).
      gate_rows: [B, W] float32: with ``shift_state`` the logits of the k and v shift weights α (Hkv each), then
        with ``lam_prev`` the forget gates of the H query heads (logits, or log f when ``gate_logits`` is False);
        further columns are ignored. Or, in their place (then ``gate_rows`` is None):
      gate_x, gate_w: the projections behind those logits, computed here: x [B, d_in] (any float dtype, d_in a
        multiple of 16) and, in the same column order, (kernel [d_in, n] float32, bias [n] float32 or None) of the
        k shift (n = Hkv), the v shift (Hkv), the forget gates (H); logit = x·kernel + bias in float32.
      gate_table: None, or ``gate_table(gate_w, Hkv)`` (the layer's Hkv) made once before a decode loop: the
        kernel reads the projections in that layout (each program its kv head's rows, contiguous) and builds it
        from ``gate_w`` (two small XLA kernels per call) when it is not given; gate_w may then be None.
      shift_state: [B, 2, Hkv, D] (q's dtype), the raw k̃, ṽ of the previous token (returned updated, in place).
      q_scale: [Hkv, G, D] float32; k_scale: [Hkv, D] float32 (QK-norm).
      lam_prev: (hi, lo) [B, Hkv, G] float32, Λ of the previous token (returned updated).
      o_scale: [Hkv, G, D] float32 (one split only). o_gate: the rows hold the output gate logits (one split only).
      o_proj: None, or [Hkv, G, D, N] in q's dtype (one split only; N a multiple of 16): the layer's output projection
        W_o [H·D, N] by query head (rows h·D … h·D + D − 1 of query head h = kv head · G + g). The kernel then writes,
        in place of o, each program's share of o·W_o, Σ_g o_g · W_o[g] [N] in float32 (the dot of o in q's dtype, as
        the layer's GEMM takes it, accumulated in float32): the caller sums the partials over the kv heads (XLA fuses
        that sum into the residual add or the next norm), so the step spends no GEMM launch on the projection.
      gate_logits, qk_eps, o_eps: as ``StepGeom``. group_heads: None, or the layer's kv head of each of this
        call's kv heads (a cache's head group; a tuple of ints): q, k, v, the ring and the tables are the group's,
        while ``rows``, ``gate_rows``, the carries and the scales are the layer's ([B, 2, Hkv, D], [B, Hkv, G],
        [Hkv, ...] with the layer's Hkv). (o_gate, gate_logits, the eps and group_heads are static: a pytree's
        auxiliary data.) layer_kv_heads: the layer's Hkv, with group_heads.
      row_bias: None, or [R, D] in q's dtype: a bias per row of ``rows`` (``nn.Dense``'s, e.g. GPT-2's c_attn), added
        after the sum in float32 and rounded to q's dtype, as the layer adds it (not with ``x_norm_eps``).
      x_norm_eps: None, or the eps of an RMSNorm folded into the projections (static; needs ``gate_x``): ``rows`` and
        ``gate_x`` are then of the un-normalised x, with the norm's scale s in the weights (W' = s ⊙ W, the gate
        table likewise), and the kernel multiplies the q, k, v and output gate rows and the gate sums (before the
        bias) by r = rsqrt(mean(x²) + eps), which it sums from the x it loads anyway: RMSNorm(x)·W = r · (x · W')
        per row, so the step needs no norm kernel before its GEMM.
    """

    rows: jax.Array
    seq_start: jax.Array
    gate_rows: jax.Array | None = None
    gate_x: jax.Array | None = None
    gate_w: tuple | None = None
    gate_table: tuple | None = None
    shift_state: jax.Array | None = None
    q_scale: jax.Array | None = None
    k_scale: jax.Array | None = None
    lam_prev: tuple | None = None
    o_scale: jax.Array | None = None
    o_proj: jax.Array | None = None
    row_bias: jax.Array | None = None
    o_gate: bool = False
    gate_logits: bool = True
    qk_eps: float = 1e-5
    o_eps: float = 1e-6
    group_heads: tuple | None = None
    layer_kv_heads: int | None = None
    x_norm_eps: float | None = None


def flash_decode(q, k, v, lo, hi, valid=None, lam_q=None, lam_k=None, *, scale: float,
                 config: DecodeConfig, interpret: bool, append=None, decay_floor=None, step: StepArrays | None = None,
                 tables=None, pinned=None):
    """Decode attention on a ring cache with the flash-decoding kernel (shapes unchecked: the public
    op ``fox_jax.ops.decode_attention`` checks them).

    Args:
      q: [B, Hkv, G, D] (float32 / bfloat16 / float16); k, v: [B, Hkv, C, D] same dtype, C a multiple
        of ``config.block_k``; D ≤ 256.
      lo, hi: int32 logical key range [lo, hi), each [B, Hkv], [B, 1] (per row) or [] (every row), read per
        program without a broadcast copy; clamped into 0 ≤ lo, 0 ≤ hi − lo ≤ C.
      valid: None or [B, nt, C] bool, nt ∈ {1, Hkv}: slots that hold a key.
      lam_q: None or (hi, lo), each [B, Hkv, G] float32; lam_k: None or (hi, lo), each [B, Hkv, G, C]
        float32 (both or neither).
      scale: logit scale; config: tiling; interpret: interpret mode (CPU).
      append: None, or the step's own entry (k_new, v_new [B, Hkv, D] in q's dtype, lam_new: None or (hi, lo)
        [B, Hkv, G] float32, as ``lam_k``) for a ring whose slot of logical key hi − 1 it is: the kernel reads the
        ring over [lo, hi − 1), adds the entry as key hi − 1 and writes it to slot (hi − 1) mod C of k, v (and
        Λ) in place (``input_output_aliases``: no separate update kernels). Needs D % 16 == 0 and no ``valid``.
      decay_floor: None, or [B, Hkv, G] float32 with Λ and ``append`` (ACP's eviction threshold δ per query head):
        ``lo`` may then be the ring's start before this step, with up to C held keys before the new one (hi − lo
        ≤ C + 1); a key of [max(lo, hi − 1 − C), hi − 1) hidden for every query head of its group (Λ_q − Λ_k <
        floor) leaves the range with every older key, ``first`` = max(that start, last hidden key + 1), and the
        read starts at max(first, hi − C) (the oldest key's slot takes the new key). Needs no ``valid``.
      step: None, or ``StepArrays`` with ``append``: the step's raw projections are rows of ``step.rows`` (q and
        append's k_new, v_new are not read) and the kernel does the layer's per-head work (with ``step.lam_prev``,
        lam_q and lam_new must be None: Λ is computed here). The output norm and gate need one split. The returned
        Λ is ``lam_prev`` updated in place with one split; with several (whose other splits read Λ_prev) a new
        array [B, Hkv, G] of this call's heads (with a head group the caller scatters it into the layer's).
      tables: None, or with ``append`` the ring's (start, peak, overflow), each int32 [B, nt] with nt ∈ {1, Hkv}: then
        ``lo`` is the first column the policy's rule lets the step see, the range starts at max(lo, start) (with a
        floor: the first key above it from there), the ring keeps the last C columns, and the tables advance in place
        (start' = the read start, peak' = max(peak, hi − start'), overflow' = overflow + what the ring could not hold).
      pinned: None, or with ``append`` (S, P, seq_start [B] int32) (``sinks:S+W``; the op's ``PinnedSlots``): slots
        [0, P) of k, v hold each row's positions 0 .. S − 1 (position p in slot p, column seq_start + p; P a power of
        two ≥ 16, read as one block), the ring is slots [P, C) (column c in slot P + (c mod (C − P)); "C" above is
        C − P); split 0 also reads the pinned positions written before the step, a step at a pinned position joins the
        softmax from registers and is written to its pinned slot too, and with ``tables`` peak' = max(peak,
        max(hi − start', 0) + min(S, max(hi − seq_start, 0))). Needs no ``valid`` or ``decay_floor``.
    Returns:
      [B, Hkv, G, D] in q.dtype (0 for a query with no visible key), or with ``step.o_proj`` [B, Hkv, N] float32
      (each kv head's share of o·W_o); with ``append`` (o, k, v, lam_k) with the
      entry written (lam_k None without Λ); with ``decay_floor`` the tuple (or o) followed by ``first`` [B, Hkv]
      int32; with ``step`` followed by (shift_state [B, 2, Hkv, D] or None, Λ (hi, lo) [B, Hkv, G] or None); with
      ``tables`` followed by the advanced (start, peak, overflow).
    """
    b, hkv, grp, d = q.shape
    slots = k.shape[2]
    sinks, pin = (0, 0) if pinned is None else (int(pinned[0]), int(pinned[1]))
    cap = slots - pin  # the ring's capacity
    bk, ns = config.block_k, config.num_splits
    if cap % bk:
        raise ValueError(f"the ring capacity C={cap} must be a multiple of block_k={bk}")
    if pinned is not None and (append is None or valid is not None or decay_floor is not None or sinks > pin
                               or pin < MIN_BLOCK or pin & (pin - 1)):
        raise ValueError(f"pinned needs append, no valid mask or decay floor, and S ≤ P with P a power of two ≥ "
                         f"{MIN_BLOCK}, got S={sinks}, P={pin}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be ≤ {MAX_HEAD_DIM} for the Pallas decode kernel, got {d}")
    d_run = -(-d // MIN_BLOCK) * MIN_BLOCK
    if append is not None and (d_run != d or valid is not None):
        raise ValueError("append needs head_dim a multiple of 16 and no valid mask (a ring without pinned slots)")
    if decay_floor is not None and (lam_k is None or valid is not None or append is None):
        raise ValueError("decay_floor needs lam_q / lam_k, append and no valid mask (a ring's decode step)")
    if step is not None and (append is None or (step.lam_prev is not None) != (lam_k is not None)
                             or (step.lam_prev is not None and (lam_q is not None or append[2] is not None))
                             or (ns > 1 and (step.o_scale is not None or step.o_gate or step.o_proj is not None))):
        raise ValueError("step needs append, lam_prev exactly with lam_k (then no lam_q / lam_new), and one split "
                         "for the output norm, gate and projection")
    if tables is not None and append is None:
        raise ValueError("tables need append (a ring's decode step)")
    if step is not None and step.gate_x is not None:
        members = 2 * (step.shift_state is not None) + (step.lam_prev is not None)
        hkv_l = hkv if step.group_heads is None else step.layer_kv_heads
        d_in = step.gate_x.shape[1]
        rows = (2 if step.shift_state is not None else 0) + grp * (step.lam_prev is not None)
        table = step.gate_table
        if step.gate_rows is not None or d_in % MIN_BLOCK or (
                table is None and (step.gate_w is None or len(step.gate_w) != members)):
            raise ValueError(f"step.gate_x needs no gate_rows, d_in a multiple of {MIN_BLOCK} (got {d_in}) and one "
                             f"projection in gate_w per gate the step uses (k and v shift, forget gates), or "
                             f"gate_table")
        want = ((hkv_l, _pow2_at_least(rows, 1), d_in), (hkv_l, _pow2_at_least(rows, 1)))
        if table is not None and tuple(tuple(x.shape) for x in table) != want:
            raise ValueError(f"step.gate_table must be float32 ({list(want[0])}, {list(want[1])}) (gate_table of the "
                             f"step's {rows} gate rows per kv head), got {[list(x.shape) for x in table]}")
    if step is not None and step.o_proj is not None:
        want = (step.layer_kv_heads if step.group_heads is not None else hkv, grp, d)
        if tuple(step.o_proj.shape[:3]) != want or step.o_proj.ndim != 4 or step.o_proj.shape[3] % MIN_BLOCK:
            raise ValueError(f"step.o_proj must be [{', '.join(map(str, want))}, N] with N a multiple of {MIN_BLOCK} "
                             f"(W_o by query head), got {list(step.o_proj.shape)}")
    if step is not None and step.x_norm_eps is not None and step.gate_x is None:
        raise ValueError("step.x_norm_eps needs step.gate_x (the kernel takes the row scale from the x it loads)")
    if step is not None and (step.rows.ndim not in (3, 4) or (step.rows.ndim == 4 and (
            step.rows.dtype != jnp.float32 or step.x_norm_eps is not None))):
        raise ValueError(f"step.rows must be [B, R, D] in q's dtype or float32 partial sums [S, B, R, D] (not with "
                         f"x_norm_eps), got {step.rows.dtype}{list(step.rows.shape)}")
    if step is not None and step.row_bias is not None and (
            tuple(step.row_bias.shape) != tuple(step.rows.shape[-2:]) or step.x_norm_eps is not None):
        raise ValueError(f"step.row_bias must be [{step.rows.shape[-2]}, {step.rows.shape[-1]}] (one per row of "
                         f"step.rows; not with x_norm_eps), got {list(step.row_bias.shape)}")
    if step is not None and step.group_heads is not None and step.layer_kv_heads is None:
        raise ValueError("step.group_heads needs step.layer_kv_heads (the layer's Hkv)")
    if d_run != d:  # zero columns change nothing; this copies K and V (see the module docstring)
        pad = [(0, 0)] * 3 + [(0, d_run - d)]
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    bh = b * hkv
    gp = _pow2_at_least(grp, MIN_BLOCK)
    has_lam, has_valid = lam_k is not None, valid is not None
    f32 = jnp.float32
    per_group = pl.BlockSpec((None, gp), lambda i, s: (i, 0))   # [B·Hkv, G]: the group's query heads
    per_entry = pl.BlockSpec((None, d_run), lambda i, s: (i, 0))  # [B·Hkv, D]
    ring_spec = pl.BlockSpec((None, slots, d_run), lambda i, s: (i, 0, 0))
    lam_spec = pl.BlockSpec((None, slots), lambda i, s: (i, 0)) if grp == 1 else \
        pl.BlockSpec((None, gp, slots), lambda i, s: (i, 0, 0))
    ins: list = []  # (name, array, BlockSpec), in the kernel's order

    # [B, Hkv, ...] → [B·Hkv, ...] are free reshapes; the G axis is read in blocks of Gp rows (rows ≥ G
    # masked: no padding copies).
    ins += [("lo", *_range_operand(lo, b, hkv)), ("hi", *_range_operand(hi, b, hkv))]
    if step is None:  # (with ``step``: rows of ``step.rows``)
        ins.append(("q", q.reshape(bh, grp, d_run), pl.BlockSpec((None, gp, d_run), lambda i, s: (i, 0, 0))))
    ins += [("k", k.reshape(bh, slots, d_run), ring_spec), ("v", v.reshape(bh, slots, d_run), ring_spec)]
    if lam_q is not None:
        ins += [(n, x.reshape(bh, grp).astype(f32), per_group) for n, x in zip(("lq_hi", "lq_lo"), lam_q)]
    if has_lam:  # G = 1: [B·Hkv, C], the kernel loads one row per block
        shape = (bh, slots) if grp == 1 else (bh, grp, slots)
        ins += [(n, x.reshape(shape).astype(f32), lam_spec) for n, x in zip(("lk_hi", "lk_lo"), lam_k)]
    if has_valid:  # (no pinned slots: cap = C)
        if valid.shape[1] == 1:
            ins.append(("valid", valid.reshape(b, cap), pl.BlockSpec((None, cap), lambda i, s: (lax.div(i, hkv), 0))))
        else:
            ins.append(("valid", valid.reshape(bh, cap), pl.BlockSpec((None, cap), lambda i, s: (i, 0))))
    if pinned is not None and step is None:  # each row's first column (with ``step``: its seq_start)
        ins.append(("sink_seq", jnp.asarray(pinned[2], jnp.int32).reshape(b),
                    pl.BlockSpec((None,), lambda i, s: (lax.div(i, hkv),))))
    if decay_floor is not None:
        ins.append(("floor", decay_floor.reshape(bh, grp).astype(f32), per_group))
    if append is not None and step is None:  # the step's entry in (with ``step``: rows of ``step.rows``)
        k_new, v_new, lam_new = append
        ins += [("k_new", k_new.reshape(bh, d_run).astype(q.dtype), per_entry),
                ("v_new", v_new.reshape(bh, d_run).astype(q.dtype), per_entry)]
        if lam_new is not None:
            ins += [(n, x.reshape(bh, grp).astype(f32), per_group) for n, x in zip(("ln_hi", "ln_lo"), lam_new)]
    geom_step = None
    if step is not None:
        gh = step.group_heads
        hkv_l = hkv if gh is None else step.layer_kv_heads  # the layer's Hkv
        lh = lambda i: layer_head(lax.rem(i, hkv), gh)  # noqa: E731  (this program's kv head in the layer)
        head_of = lambda i, s: (lh(i), 0, 0)  # noqa: E731  (parameters per key/value head)
        of_row = lambda i, s: (lax.div(i, hkv), 0, 0)  # noqa: E731  (a row's whole block)
        n_rows, parts = step.rows.shape[-2], (step.rows.shape[0] if step.rows.ndim == 4 else 0)
        if parts:  # S float32 partial sums per row, summed in the kernel
            ins.append(("rows", step.rows.astype(f32),
                        pl.BlockSpec((parts, None, n_rows, d_run), lambda i, s: (0, lax.div(i, hkv), 0, 0))))
        else:
            ins.append(("rows", step.rows.astype(q.dtype), pl.BlockSpec((None, n_rows, d_run), of_row)))
        if step.row_bias is not None:  # [R, D], whole: each program adds its heads' rows
            ins.append(("row_bias", step.row_bias.astype(q.dtype),
                        pl.BlockSpec((n_rows, d_run), lambda i, s: (0, 0))))
        ins += [
                ("seq_start", jnp.asarray(step.seq_start, jnp.int32).reshape(b),
                 pl.BlockSpec((None,), lambda i, s: (lax.div(i, hkv),)))]
        if step.gate_rows is not None:
            ins.append(("gate_rows", step.gate_rows.astype(f32),
                        pl.BlockSpec((None, step.gate_rows.shape[1]), lambda i, s: (lax.div(i, hkv), 0))))
        if step.gate_x is not None:  # the gate projections: the row's x, the program's kv head's rows of the table
            d_in = step.gate_x.shape[1]
            ins.append(("gate_x", step.gate_x, pl.BlockSpec((None, d_in), lambda i, s: (lax.div(i, hkv), 0))))
            # (built here from gate_w when not given: two small XLA kernels per call)
            table_w, table_b = step.gate_table if step.gate_table is not None else gate_table(step.gate_w, hkv_l)
            ins += [("gate_wt", table_w.astype(f32), pl.BlockSpec((None,) + table_w.shape[1:], head_of)),
                    ("gate_bt", table_b.astype(f32), pl.BlockSpec((None, table_b.shape[1]), lambda i, s: (lh(i), 0)))]
        if step.shift_state is not None:
            ins.append(("shift_state", step.shift_state.astype(q.dtype),
                        pl.BlockSpec((None, 2, None, d_run), lambda i, s: (lax.div(i, hkv), 0, lh(i), 0))))
        if step.q_scale is not None:
            ins.append(("q_scale", step.q_scale.reshape(hkv_l, grp, d_run).astype(f32),
                        pl.BlockSpec((None, gp, d_run), head_of)))
        if step.k_scale is not None:
            ins.append(("k_scale", step.k_scale.reshape(hkv_l, d_run).astype(f32),
                        pl.BlockSpec((None, d_run), lambda i, s: (lh(i), 0))))
        if step.lam_prev is not None:  # [B·Hkv (the layer's), G]: the program's row and layer kv head
            ins += [(n, x.reshape(b * hkv_l, grp).astype(f32),
                     pl.BlockSpec((None, gp), lambda i, s: (lax.div(i, hkv) * hkv_l + lh(i), 0)))
                    for n, x in zip(("lp_hi", "lp_lo"), step.lam_prev)]
        if step.o_scale is not None:
            ins.append(("o_scale", step.o_scale.reshape(hkv_l, grp, d_run).astype(f32),
                        pl.BlockSpec((None, gp, d_run), head_of)))
        n_proj = 0
        if step.o_proj is not None:  # the program's query heads' rows of W_o, [Gp, D, N] (rows ≥ G not read)
            n_proj = step.o_proj.shape[-1]
            ins.append(("o_proj", step.o_proj.astype(q.dtype),
                        pl.BlockSpec((None, gp, d_run, n_proj), lambda i, s: (lh(i), 0, 0, 0))))
        geom_step = StepGeom(shift=step.shift_state is not None, q_norm=step.q_scale is not None,
                             k_norm=step.k_scale is not None, gates=step.lam_prev is not None,
                             o_norm=step.o_scale is not None, o_gate=bool(step.o_gate), o_proj=n_proj,
                             gate_logits=bool(step.gate_logits), q_heads=hkv_l * grp, kv_heads=hkv_l,
                             group_heads=None if gh is None else tuple(int(x) for x in gh),
                             qk_eps=float(step.qk_eps), o_eps=float(step.o_eps),
                             x_norm_eps=None if step.x_norm_eps is None else float(step.x_norm_eps),
                             row_parts=parts, row_dtype=jnp.dtype(q.dtype).name if parts else "",
                             row_bias=step.row_bias is not None)

    nt = 0
    if tables is not None:  # [B, nt] → [B·nt, 1]: one entry per program (per row: the programs of its kv heads)
        nt = tables[0].shape[1]
        row_of = (lambda i, s: (i, 0)) if nt == hkv else (lambda i, s: (lax.div(i, hkv), 0))
        ins += [(n, jnp.asarray(x, jnp.int32).reshape(b * nt, 1), pl.BlockSpec((None, 1), row_of))
                for n, x in zip(("start", "peak", "overflow"), tables)]
    outs: list = []  # (name, ShapeDtypeStruct, BlockSpec, the input it aliases or None)
    if geom_step is not None and geom_step.o_proj:  # (one split) each program's float32 share of o·W_o
        outs.append(("o", jax.ShapeDtypeStruct((bh, geom_step.o_proj), f32),
                     pl.BlockSpec((None, geom_step.o_proj), lambda i, s: (i, 0)), None))
    elif ns == 1:
        outs.append(("o", jax.ShapeDtypeStruct((bh, grp, d_run), q.dtype),
                     pl.BlockSpec((None, gp, d_run), lambda i, s: (i, 0, 0)), None))
    else:
        outs += [("o", jax.ShapeDtypeStruct((bh, ns, grp, d_run), f32),
                  pl.BlockSpec((None, None, gp, d_run), lambda i, s: (i, s, 0, 0)), None),
                 ("m", jax.ShapeDtypeStruct((bh, ns, grp), f32), pl.BlockSpec((None, None, gp), lambda i, s: (i, s, 0)),
                  None),
                 ("l", jax.ShapeDtypeStruct((bh, ns, grp), f32), pl.BlockSpec((None, None, gp), lambda i, s: (i, s, 0)),
                  None)]
    if step is not None and step.lam_prev is not None and ns > 1:  # Λ's carry, this call's heads
        outs += [(n, jax.ShapeDtypeStruct((bh, grp), f32), per_group, None) for n in ("lp_hi_new", "lp_lo_new")]
    if decay_floor is not None:  # the first visible key per (row, key/value head), written by split 0
        outs.append(("first", jax.ShapeDtypeStruct((bh, 1), jnp.int32), pl.BlockSpec((None, 1), lambda i, s: (i, 0)),
                     None))
    spec_of = {n: (x, sp) for n, x, sp in ins}
    aliased = ["k", "v"] + (["lk_hi", "lk_lo"] if has_lam else []) if append is not None else []
    # the step's carries, in place: Λ only with one split (with several every split reads Λ_prev); the ring's tables
    aliased += [n for n in ("shift_state",) + (("lp_hi", "lp_lo") if ns == 1 else ()) + ("start", "peak", "overflow")
                if n in spec_of]
    for n in aliased:
        x, sp = spec_of[n]
        outs.append(({"shift_state": "shift_out"}.get(n, n + "_out"), jax.ShapeDtypeStruct(x.shape, x.dtype), sp, n))
    in_names = [n for n, _, _ in ins]
    aliases = {in_names.index(src): j for j, (_, _, _, src) in enumerate(outs) if src is not None}
    geom = _Geom(group=grp, group_pad=gp, n_blocks=cap // bk, block_k=bk, num_splits=ns,
                 chunks=head_dim_chunks(d_run), scale=float(scale), has_lam=has_lam, has_valid=has_valid,
                 exact_dot=q.dtype == jnp.float32, append=append is not None, has_floor=decay_floor is not None,
                 fold_floor=bool(config.fold_floor) and decay_floor is not None and ns == 1,
                 late_writes=bool(config.late_writes), early_epilogue=bool(config.early_epilogue),
                 step=geom_step, tables=0 if tables is None else (2 if nt == hkv and hkv > 1 else 1), kv_heads=hkv,
                 sinks=sinks, pin_slots=pin, interpret=interpret,
                 names=tuple(in_names + [n for n, *_ in outs]))
    res = pl.pallas_call(
        functools.partial(_decode_kernel, g=geom),
        grid=(bh, ns),
        in_specs=[sp for _, _, sp in ins],
        out_specs=[sp for _, _, sp, _ in outs],
        out_shape=[sh for _, sh, _, _ in outs],
        input_output_aliases=aliases,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=config.num_warps,
                                                                      num_stages=config.num_stages),
        interpret=interpret,
        name="fox_decode_attention",
    )(*[x for _, x, _ in ins])
    res = dict(zip([n for n, *_ in outs], res))
    if geom_step is not None and geom_step.o_proj:
        o = res["o"].reshape(b, hkv, geom_step.o_proj)
    else:
        o = res["o"] if ns == 1 else combine_splits(res["o"], res["m"], res["l"], q.dtype)
        o = o.reshape(b, hkv, grp, d_run)[..., :d]
    first = None if decay_floor is None else res["first"].reshape(b, hkv)
    if append is None:
        return o if first is None else (o, first)
    k_out, v_out = res["k_out"].reshape(k.shape), res["v_out"].reshape(v.shape)
    lam_out = (res["lk_hi_out"].reshape(lam_k[0].shape), res["lk_lo_out"].reshape(lam_k[1].shape)) if has_lam else None
    out = (o, k_out, v_out, lam_out) + (() if first is None else (first,))
    if step is not None:
        shift_out = res.get("shift_out")
        lam_now = None
        if "lp_hi_out" in res:
            lam_now = tuple(res[n].reshape(x.shape) for n, x in zip(("lp_hi_out", "lp_lo_out"), step.lam_prev))
        elif "lp_hi_new" in res:
            lam_now = tuple(res[n].reshape(b, hkv, grp) for n in ("lp_hi_new", "lp_lo_new"))
        out += ((shift_out, lam_now),)
    if tables is not None:
        out += (tuple(res[n + "_out"].reshape(b, nt) for n in ("start", "peak", "overflow")),)
    return out


__all__ = ["DecodeConfig", "SHARED_LIMIT", "StepArrays", "StepGeom", "combine_splits", "default_decode_config",
           "flash_decode", "head_dim_chunks", "largest_block_k", "pair_add"]
