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
    Triton launch knobs (num_stages = software-pipelined K/V block loads in flight).
    """

    block_k: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

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
class _Geom:
    group: int  # G
    group_pad: int  # Gp
    n_blocks: int  # C // bk
    block_k: int
    num_splits: int
    chunks: tuple[tuple[int, int], ...]
    scale: float
    has_lam: bool
    has_valid: bool
    exact_dot: bool  # float32 inputs: IEEE matmuls (Triton's default for float32 is TF32)
    append: bool = False  # the step's own key comes in separately and is written to the ring here
    has_floor: bool = False  # a decay floor per query head hides the ring's oldest keys (ACP); first visible out


def _dot(a, b, contract_a: int, contract_b: int, exact: bool):
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                           precision=lax.Precision.HIGHEST if exact else None,
                           preferred_element_type=jnp.float32)


def _decode_kernel(*refs, g: _Geom):
    refs = list(refs)
    lo_ref, hi_ref, q_ref, k_ref, v_ref = refs[:5]
    rest = refs[5:]
    lam_refs = (rest.pop(0), rest.pop(0), rest.pop(0), rest.pop(0)) if g.has_lam else None
    valid_ref = rest.pop(0) if g.has_valid else None
    floor_ref = rest.pop(0) if g.has_floor else None
    if g.append:
        new_refs = [rest.pop(0) for _ in range(4 if g.has_lam else 2)]  # k_new, v_new[, Λ_new hi, lo]
        ring_out = rest[-len(new_refs):]                                 # k, v[, Λ hi, lo]: the aliased ring
        rest = rest[:-len(new_refs)]
    first_ref = rest.pop() if g.has_floor else None  # the first visible key, per (row, key/value head)
    out_refs = rest  # (o,) with one split, else (o, m, l)
    bk, gp = g.block_k, g.group_pad

    rows = lax.broadcasted_iota(jnp.int32, (gp, 1), 0)
    row_ok = rows < g.group
    cap = g.n_blocks * bk
    lo = jnp.maximum(lo_ref[()], 0)
    if g.has_floor:  # the ring's start before this step: ≤ C held keys before the new one, the oldest in its slot
        lo = jnp.maximum(lo, hi_ref[()] - 1 - cap)
        hi = jnp.maximum(hi_ref[()], lo)  # 0 ≤ hi − lo ≤ C + 1
    else:
        hi = jnp.minimum(jnp.maximum(hi_ref[()], lo), lo + cap)  # 0 ≤ hi − lo ≤ C
    if g.append:
        # the step's key is logical key hi − 1, in registers: the ring is read over [lo, hi − 1) only, so no
        # program loads the slot this one writes (every key of that range lies less than C before hi − 1)
        slot = lax.rem(jnp.maximum(hi_ref[()] - 1, 0), g.n_blocks * bk)
        with_new = hi > lo
        hi = jnp.where(with_new, hi - 1, lo)
    qs = [pltriton.load(q_ref.at[:, pl.ds(off, size)], mask=row_ok, other=0.0) for off, size in g.chunks]
    if g.has_lam:
        lq_hi_ref, lq_lo_ref, lk_hi_ref, lk_lo_ref = lam_refs
        lq_hi = pltriton.load(lq_hi_ref.at[:], mask=row_ok[:, 0], other=0.0)
        lq_lo = pltriton.load(lq_lo_ref.at[:], mask=row_ok[:, 0], other=0.0)

    def decay_block(start):  # [Gp or 1, bk] float32 Λ_q − Λ_k of the block at physical slot ``start``
        if g.group == 1:  # one row of Λ_k per block, broadcast over the (padding) rows
            lk_hi = lk_hi_ref[pl.ds(start, bk)][None, :]
            lk_lo = lk_lo_ref[pl.ds(start, bk)][None, :]
        else:
            lk_hi = pltriton.load(lk_hi_ref.at[:, pl.ds(start, bk)], mask=row_ok, other=0.0)
            lk_lo = pltriton.load(lk_lo_ref.at[:, pl.ds(start, bk)], mask=row_ok, other=0.0)
        return (lq_hi[:, None] - lk_hi) + (lq_lo[:, None] - lk_lo)

    if g.has_floor:  # ACP: the range starts after the last key below the floor for every query head of the group
        # Split 0 also tests the oldest key (hi − C, whose slot it overwrites with the new key after this pass: the
        # test counts for ``first``, i.e. for the ring's overflow); no other program loads that slot's value.
        scan_lo = jnp.where(pl.program_id(1) == 0, lo, jnp.maximum(lo, hi + 1 - cap))
        first = _first_above_floor(g, floor_ref, first_ref, decay_block, scan_lo, lo, hi, row_ok)
        lo = jnp.maximum(first, hi + 1 - cap)  # the oldest key is never read: its slot receives the new key
        hi = jnp.maximum(hi, lo)

    # This program's share of the logical blocks [n_first, n_end): equal shares of the live blocks.
    n_first = lax.div(lo, bk)
    n_end = jnp.where(hi > lo, lax.div(hi + (bk - 1), bk), n_first)
    per = lax.div(n_end - n_first + (g.num_splits - 1), g.num_splits)
    start_n = jnp.minimum(n_first + pl.program_id(1) * per, n_end)
    end_n = jnp.minimum(start_n + per, n_end)

    def step(n, carry, masked: bool):
        accs, m_i, l_i = carry
        start = pl.multiple_of(lax.rem(n, g.n_blocks) * bk, bk)  # physical slot of logical key n·bk
        s = None
        for q, (off, size) in zip(qs, g.chunks):
            part = _dot(q, k_ref[pl.ds(start, bk), pl.ds(off, size)], 1, 1, g.exact_dot)
            s = part if s is None else s + part
        s = s * g.scale
        if g.has_lam:
            s = s + decay_block(start)
        if masked:
            kpos = n * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            keep = (kpos >= lo) & (kpos < hi)
            if g.has_valid:
                keep = keep & valid_ref[pl.ds(start, bk)][None, :]
            s = jnp.where(keep, s, _NEG_INF)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        m_base = jnp.where(m_new == _NEG_INF, 0.0, m_new) if masked else m_new
        m_base = m_base * LOG2E
        alpha = jnp.exp2(m_i * LOG2E - m_base)
        p = jnp.exp2(s * LOG2E - m_base[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        new_accs = []
        for acc, (off, size) in zip(accs, g.chunks):
            v = v_ref[pl.ds(start, bk), pl.ds(off, size)]
            new_accs.append(acc * alpha[:, None] + _dot(p.astype(v.dtype), v, 1, 0, g.exact_dot))
        return tuple(new_accs), m_new, l_new

    carry = (tuple(jnp.zeros((gp, size), jnp.float32) for _, size in g.chunks),
             jnp.full((gp,), _NEG_INF, jnp.float32), jnp.zeros((gp,), jnp.float32))
    masked_step = functools.partial(step, masked=True)
    if g.has_valid:  # every block needs the slot mask
        carry = lax.fori_loop(start_n, end_n, masked_step, carry)
    else:  # blocks [full_lo, full_hi) lie inside [lo, hi): no element mask
        full_a = jnp.clip(lax.div(lo + (bk - 1), bk), start_n, end_n)
        full_b = jnp.clip(lax.div(hi, bk), full_a, end_n)
        carry = lax.fori_loop(start_n, full_a, masked_step, carry)
        carry = lax.fori_loop(full_a, full_b, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(full_b, end_n, masked_step, carry)
    accs, m_i, l_i = carry
    if g.append:
        accs, m_i, l_i = _append_new_key(g, qs, new_refs, ring_out, slot, with_new, accs, m_i, l_i,
                                         lq=(lq_hi, lq_lo) if g.has_lam else None, row_ok=row_ok)

    if g.num_splits == 1:
        (o_ref,) = out_refs
        inv = jnp.where(l_i == 0.0, 0.0, 1.0 / jnp.where(l_i == 0.0, 1.0, l_i))
        for acc, (off, size) in zip(accs, g.chunks):
            pltriton.store(o_ref.at[:, pl.ds(off, size)], (acc * inv[:, None]).astype(o_ref.dtype), mask=row_ok)
    else:
        o_ref, m_ref, l_ref = out_refs
        for acc, (off, size) in zip(accs, g.chunks):
            pltriton.store(o_ref.at[:, pl.ds(off, size)], acc, mask=row_ok)
        pltriton.store(m_ref.at[:], m_i, mask=row_ok[:, 0])
        pltriton.store(l_ref.at[:], l_i, mask=row_ok[:, 0])


def _first_above_floor(g: _Geom, floor_ref, first_ref, decay_block, scan_lo, lo, hi, row_ok):
    """The decay floor (ACP's eviction): key j of [scan_lo, hi) is hidden when Λ_q − Λ_k,j < floor for every query
    head of the group; it and every older key leave the range [lo, hi), which starts at ``first`` = max(lo, last
    hidden + 1). A pass over the Λ_k blocks of the range (every split the same; 8 bytes per key and query head,
    against 2·D·itemsize of K and V), in the same float32 form as the scores' decay. Split 0 writes ``first`` to
    ``first_ref``; returns it."""
    bk = g.block_k
    floor = pltriton.load(floor_ref.at[:], mask=row_ok[:, 0], other=0.0)

    def scan(n, last):
        kpos = n * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        below = (decay_block(pl.multiple_of(lax.rem(n, g.n_blocks) * bk, bk)) < floor[:, None]) | ~row_ok
        hidden = (jnp.min(below.astype(jnp.int32), axis=0) > 0)[None, :] & (kpos >= scan_lo) & (kpos < hi)
        return jnp.maximum(last, jnp.max(jnp.where(hidden, kpos, -1)))

    n_end = jnp.where(hi > scan_lo, lax.div(hi + (bk - 1), bk), lax.div(scan_lo, bk))
    first = jnp.maximum(lo, lax.fori_loop(lax.div(scan_lo, bk), n_end, scan, jnp.int32(-1)) + 1)
    pltriton.store(first_ref.at[pl.ds(0, 1)], jnp.full((1,), first, jnp.int32), mask=jnp.full((1,), pl.program_id(1) == 0))
    return first


def _append_new_key(g: _Geom, qs, new_refs, ring_out, slot, with_new, accs, m_i, l_i, *, lq, row_ok):
    """Append mode: the step's own key (its k, v and Λ from ``new_refs``) joins split 0's online softmax as one
    more column, and split 0 writes it to ring slot ``slot`` (the aliased outputs ``ring_out``). Returns the
    updated (accs, m, l)."""
    first = pl.program_id(1) == 0
    k_new = [pltriton.load(new_refs[0].at[pl.ds(off, size)]) for off, size in g.chunks]
    v_new = [pltriton.load(new_refs[1].at[pl.ds(off, size)]) for off, size in g.chunks]
    s = None
    for q, kn in zip(qs, k_new):
        part = jnp.sum(q.astype(jnp.float32) * kn.astype(jnp.float32)[None, :], axis=1)
        s = part if s is None else s + part
    s = s * g.scale
    if g.has_lam:  # one Λ per query head of the group ([1] with G = 1: what the ring's row stores)
        load = (lambda ref: pltriton.load(ref.at[pl.ds(0, 1)])) if g.group == 1 else \
            (lambda ref: pltriton.load(ref.at[:], mask=row_ok[:, 0], other=0.0))  # noqa: E731
        ln_hi, ln_lo = load(new_refs[2]), load(new_refs[3])
        s = s + ((lq[0] - ln_hi) + (lq[1] - ln_lo))
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
    for ref, x in zip(ring_out[:2], (k_new, v_new)):
        for xc, (off, size) in zip(x, g.chunks):
            pltriton.store(ref.at[pl.ds(slot, 1), pl.ds(off, size)], xc[None, :],
                           mask=jnp.full((1, size), first))
    if g.has_lam:
        for ref, x in zip(ring_out[2:], (ln_hi, ln_lo)):
            if g.group == 1:
                pltriton.store(ref.at[pl.ds(slot, 1)], x, mask=jnp.full((1,), first))
            else:
                pltriton.store(ref.at[:, pl.ds(slot, 1)], x[:, None], mask=row_ok & first)
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


def flash_decode(q, k, v, lo, hi, valid=None, lam_q=None, lam_k=None, *, scale: float,
                 config: DecodeConfig, interpret: bool, append=None, decay_floor=None):
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
    Returns:
      [B, Hkv, G, D] in q.dtype (0 for a query with no visible key); with ``append`` (o, k, v, lam_k) with the
      entry written (lam_k None without Λ); with ``decay_floor`` the tuple (or o) followed by ``first`` [B, Hkv]
      int32.
    """
    b, hkv, grp, d = q.shape
    cap = k.shape[2]
    bk, ns = config.block_k, config.num_splits
    if cap % bk:
        raise ValueError(f"the ring capacity C={cap} must be a multiple of block_k={bk}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be ≤ {MAX_HEAD_DIM} for the Pallas decode kernel, got {d}")
    d_run = -(-d // MIN_BLOCK) * MIN_BLOCK
    if append is not None and (d_run != d or valid is not None):
        raise ValueError("append needs head_dim a multiple of 16 and no valid mask (a ring without pinned slots)")
    if decay_floor is not None and (lam_k is None or valid is not None or append is None):
        raise ValueError("decay_floor needs lam_q / lam_k, append and no valid mask (a ring's decode step)")
    if d_run != d:  # zero columns change nothing; this copies K and V (see the module docstring)
        pad = [(0, 0)] * 3 + [(0, d_run - d)]
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    bh = b * hkv
    gp = _pow2_at_least(grp, MIN_BLOCK)
    has_lam, has_valid = lam_k is not None, valid is not None
    geom = _Geom(group=grp, group_pad=gp, n_blocks=cap // bk, block_k=bk, num_splits=ns,
                 chunks=head_dim_chunks(d_run), scale=float(scale), has_lam=has_lam, has_valid=has_valid,
                 exact_dot=q.dtype == jnp.float32, append=append is not None, has_floor=decay_floor is not None)

    # [B, Hkv, ...] → [B·Hkv, ...] are free reshapes; the G axis is read in blocks of Gp rows (rows ≥ G
    # masked: no padding copies).
    (lo_arg, lo_spec), (hi_arg, hi_spec) = _range_operand(lo, b, hkv), _range_operand(hi, b, hkv)
    in_specs = [lo_spec, hi_spec,
                pl.BlockSpec((None, gp, d_run), lambda i, s: (i, 0, 0)),
                pl.BlockSpec((None, cap, d_run), lambda i, s: (i, 0, 0)),
                pl.BlockSpec((None, cap, d_run), lambda i, s: (i, 0, 0))]
    args = [lo_arg, hi_arg, q.reshape(bh, grp, d_run), k.reshape(bh, cap, d_run), v.reshape(bh, cap, d_run)]
    if has_lam:
        in_specs += [pl.BlockSpec((None, gp), lambda i, s: (i, 0))] * 2
        args += [x.reshape(bh, grp).astype(jnp.float32) for x in lam_q]
        if grp == 1:  # [B·Hkv, C]: the kernel loads one row per block
            in_specs += [pl.BlockSpec((None, cap), lambda i, s: (i, 0))] * 2
            args += [x.reshape(bh, cap).astype(jnp.float32) for x in lam_k]
        else:
            in_specs += [pl.BlockSpec((None, gp, cap), lambda i, s: (i, 0, 0))] * 2
            args += [x.reshape(bh, grp, cap).astype(jnp.float32) for x in lam_k]
    if has_valid:
        if valid.shape[1] == 1:
            in_specs.append(pl.BlockSpec((None, cap), lambda i, s: (lax.div(i, hkv), 0)))
            args.append(valid.reshape(b, cap))
        else:
            in_specs.append(pl.BlockSpec((None, cap), lambda i, s: (i, 0)))
            args.append(valid.reshape(bh, cap))
    if decay_floor is not None:
        in_specs.append(pl.BlockSpec((None, gp), lambda i, s: (i, 0)))
        args.append(decay_floor.reshape(bh, grp).astype(jnp.float32))
    if ns == 1:
        out_specs = [pl.BlockSpec((None, gp, d_run), lambda i, s: (i, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((bh, grp, d_run), q.dtype)]
    else:
        out_specs = [pl.BlockSpec((None, None, gp, d_run), lambda i, s: (i, s, 0, 0)),
                     pl.BlockSpec((None, None, gp), lambda i, s: (i, s, 0)),
                     pl.BlockSpec((None, None, gp), lambda i, s: (i, s, 0))]
        out_shape = [jax.ShapeDtypeStruct((bh, ns, grp, d_run), jnp.float32),
                     jax.ShapeDtypeStruct((bh, ns, grp), jnp.float32),
                     jax.ShapeDtypeStruct((bh, ns, grp), jnp.float32)]
    if decay_floor is not None:  # the first visible key per (row, key/value head), written by split 0
        out_specs.append(pl.BlockSpec((None, 1), lambda i, s: (i, 0)))
        out_shape.append(jax.ShapeDtypeStruct((bh, 1), jnp.int32))
    aliases = {}
    if append is not None:  # the step's entry in, the ring's buffers out in place
        k_new, v_new, lam_new = append
        ring = [(3, in_specs[3]), (4, in_specs[4])]  # args 3, 4: k, v; 7, 8: Λ_k hi, lo (after q's pair)
        in_specs += [pl.BlockSpec((None, d_run), lambda i, s: (i, 0))] * 2
        args += [k_new.reshape(bh, d_run).astype(q.dtype), v_new.reshape(bh, d_run).astype(q.dtype)]
        if has_lam:
            in_specs += [pl.BlockSpec((None, gp), lambda i, s: (i, 0))] * 2
            args += [x.reshape(bh, grp).astype(jnp.float32) for x in lam_new]
            ring += [(7, in_specs[7]), (8, in_specs[8])]
        for arg_index, spec in ring:
            aliases[arg_index] = len(out_shape)
            out_specs.append(spec)
            out_shape.append(jax.ShapeDtypeStruct(args[arg_index].shape, args[arg_index].dtype))
    outs = pl.pallas_call(
        functools.partial(_decode_kernel, g=geom),
        grid=(bh, ns),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=config.num_warps,
                                                                      num_stages=config.num_stages),
        interpret=interpret,
        name="fox_decode_attention",
    )(*args)
    n_o = 1 if ns == 1 else 3
    o = outs[0] if ns == 1 else combine_splits(*outs[:3], q.dtype)
    o = o.reshape(b, hkv, grp, d_run)[..., :d]
    first = None
    if decay_floor is not None:
        first = outs[n_o].reshape(b, hkv)
        n_o += 1
    if append is None:
        return o if first is None else (o, first)
    ring_out = outs[n_o:]
    k_out, v_out = (x.reshape(k.shape) for x in ring_out[:2])
    lam_out = tuple(x.reshape(lam_k[0].shape) for x in ring_out[2:]) if has_lam else None
    return (o, k_out, v_out, lam_out) if first is None else (o, k_out, v_out, lam_out, first)


__all__ = ["DecodeConfig", "SHARED_LIMIT", "combine_splits", "default_decode_config", "flash_decode", "head_dim_chunks",
           "largest_block_k"]
