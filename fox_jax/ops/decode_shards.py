"""The Pallas decode attention kernel under a mesh: how ``fox_jax.ops.decode_attention`` splits its calls per shard.

A ``pallas_call`` is opaque to XLA's SPMD partitioner, which would gather a decode step's whole cache to every device
around it and run every row everywhere. Under an ambient mesh (``fox_jax.sharding.kernel_mesh``) the kernel runs in a
``shard_map`` instead (``fox_jax.sharding.per_shard``): rows over the mesh's batch axes, key/value heads over its head
axes where they divide; a fused decode step's GEMM rows and gate projections are first laid out shard by shard.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from fox_jax.kernels import decode_attention as dk
from fox_jax.sharding import kernel_mesh, per_shard, shard_count, shard_plan


# the StepArrays fields with a batch dimension, leading (rows as partial sums [S, B, R, D]: second); the others
# (scales, gate weights and tables, the rows' bias) are the layer's
_STEP_ROW_FIELDS = ("rows", "seq_start", "gate_rows", "gate_x", "shift_state", "lam_prev")
# the StepArrays fields per key/value head, and the axis of their heads (rows and gate_rows: once laid out per shard;
# rows as partial sums: one axis later)
_STEP_HEAD_AXIS = dict(rows=1, gate_rows=1, gate_table=0, shift_state=2, q_scale=0, k_scale=0, lam_prev=1, o_scale=0,
                       o_proj=0, row_bias=0)


def _shard_major(blocks: list[tuple[int, int]], hkv: int, shards: int) -> np.ndarray:
    """Indices that reorder per-head blocks shard after shard: ``blocks`` (offset, width per kv head) of a layout
    [block 0 of every kv head, block 1 of every kv head, ...]; the result holds for each of ``shards`` consecutive
    groups of Hkv / shards heads its part of every block, in the blocks' order."""
    n = hkv // shards
    return np.concatenate([off + np.arange(r * n * w, (r + 1) * n * w) for r in range(shards) for off, w in blocks])


def _step_for_shards(step: dk.StepArrays, hkv: int, grp: int, shards: int) -> tuple[dk.StepArrays, dk.StepArrays]:
    """(``step`` laid out for ``shards`` key/value-head shards, its logical axes). The GEMM rows (q: G per kv head,
    k, v, the output gate's G) and the gate logits (k and v shift, G forget gates) are reordered so that each shard's
    heads are one contiguous block in the kernel's own layout, and the gate projections become their per-head table
    (``gate_table``): then every per-head field splits along ``"heads"`` and every per-row field along ``"batch"``.
    One shard (``shards`` 1): the fields as they are, heads whole."""
    if shards > 1:
        h = hkv * grp
        rows = [(0, grp), (h, 1), (h + hkv, 1)] + ([(h + 2 * hkv, grp)] if step.o_gate else [])
        order = _shard_major(rows, hkv, shards)
        step = dataclasses.replace(step, rows=step.rows[..., order, :],
                                   row_bias=None if step.row_bias is None else step.row_bias[order])
        if step.gate_rows is not None:
            shifts = [(0, 1), (hkv, 1)] if step.shift_state is not None else []
            forget = [(2 * hkv if shifts else 0, grp)] if step.lam_prev is not None else []
            step = dataclasses.replace(step, gate_rows=step.gate_rows[:, _shard_major(shifts + forget, hkv, shards)])
        if step.gate_x is not None:
            table = step.gate_table if step.gate_table is not None else dk.gate_table(step.gate_w, hkv)
            step = dataclasses.replace(step, gate_table=table, gate_w=None)
    leaves, tree = jax.tree_util.tree_flatten_with_path(step)

    def axes(field: str, x) -> tuple:
        names = [None] * x.ndim
        parts = field == "rows" and x.ndim == 4  # partial sums [S, B, R, D]
        if field in _STEP_ROW_FIELDS:
            names[1 if parts else 0] = "batch"
        if shards > 1 and field in _STEP_HEAD_AXIS:
            names[_STEP_HEAD_AXIS[field] + parts] = "heads"
        return tuple(names)

    return step, tree.unflatten([axes(path[0].name, x) for path, x in leaves])


class DecodeShards(NamedTuple):
    """How the Pallas decode kernel is split under an ambient mesh (``fox_jax.sharding.kernel_mesh``): a
    ``pallas_call`` is opaque to the SPMD partitioner, which would gather the cache around it and run every row on
    every device; per shard, rows go over the mesh's batch axes and key/value heads over its head axes, where they
    divide B, resp. Hkv (a fused step's GEMM rows and gate projections laid out per shard first,
    ``_step_for_shards``; not for a cache's head group, whose rows are the layer's).

    Attributes:
      mesh: the mesh, or None (no mesh, or nothing divides: a direct call). kv_shards: shards of the key/value heads
        (1: heads whole). programs: the (row, kv head) pairs of one shard (the kernel's default ``num_splits`` fills
        the GPU with them).
    """

    mesh: object
    kv_shards: int
    programs: int

    @classmethod
    def of(cls, q: jax.Array, *, heads: bool) -> "DecodeShards":
        b, hkv = q.shape[:2]
        mesh = kernel_mesh()
        if mesh is None:
            return cls(None, 1, b * hkv)
        plan = shard_plan(mesh, {"q": (q, ("batch", "heads" if heads else None, None, None))})
        rows, kv_heads = (n // shard_count(mesh, plan.get(name)) for n, name in ((b, "batch"), (hkv, "heads")))
        return cls(mesh if rows * kv_heads < b * hkv else None, hkv // kv_heads, rows * kv_heads)

    def flash_decode(self, q, k, v, lo, hi, valid=None, lam_q=None, lam_k=None, *, append=None, decay_floor=None,
                     step=None, tables=None, pinned=None, **static):
        """``dk.flash_decode`` (same arguments and results), per shard when ``mesh`` is set."""
        if self.mesh is None:
            return dk.flash_decode(q, k, v, lo, hi, valid, lam_q, lam_k, append=append, decay_floor=decay_floor,
                                   step=step, tables=tables, pinned=pinned, **static)
        b, hkv, grp = q.shape[:3]
        head = "heads" if self.kv_shards > 1 else None

        def axes(x):  # [B, Hkv or 1, ...] (q, the ring, Λ, lo / hi / tables / valid per row and head), or a scalar
            if x.ndim == 0:
                return ()
            return ("batch",) + ((head if x.shape[1] == hkv else None),) * (x.ndim > 1) + (None,) * (x.ndim - 2)

        arrays = dict(q=q, k=k, v=v, lo=lo, hi=hi, valid=valid, lam_q=lam_q, lam_k=lam_k, append=append,
                      decay_floor=decay_floor, tables=tables)
        args = {name: (x, jax.tree_util.tree_map(axes, x)) for name, x in arrays.items() if x is not None}
        if step is not None:
            args["step"] = _step_for_shards(step, hkv, grp, self.kv_shards)
        if pinned is not None:  # (S, P) are static
            args["pin_start"] = (pinned[2], ("batch",))

        def local(pin_start=None, **a):
            return dk.flash_decode(**a, pinned=None if pinned is None else (pinned[0], pinned[1], pin_start), **static)

        out = jax.eval_shape(local, **{name: x for name, (x, _) in args.items()})
        out_axes = jax.tree_util.tree_map(axes, out)
        if step is not None:  # (o, k, v, Λ, [first], carries, ...): the carried shift state has its heads on axis 2
            at = 4 + (decay_floor is not None)
            shift = None if out[at][0] is None else ("batch", None, head, None)
            out_axes = out_axes[:at] + ((shift, out_axes[at][1]),) + out_axes[at + 1:]
        return per_shard(local, self.mesh, args, out_axes)
