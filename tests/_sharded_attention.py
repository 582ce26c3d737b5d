"""Subprocess of tests/test_sharding.py (4 simulated CPU devices): the Pallas ops (forgetting attention, DCP
attention) under an ambient mesh run per shard (a shard_map in the trace) and match the unsharded XLA path, values
and gradients, under the Shardy and the GSPMD partitioner; the decode attention kernel (a ring's append step, the
fused FoX (Pro) step, a slot pool's read) runs per shard and equals its unsharded call; the SwiGLU MLP under a tensor
mesh exchanges no activations, and under fsdp no collective moves activations (the weights are gathered instead)."""

import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fox_jax.models import LanguageModel, preset
from fox_jax.ops import forgetting_attention
from fox_jax.ops.context_pruning import LOG_FLOOR, dcp_attention
from fox_jax.sharding import make_mesh, under_mesh


def op_case(mesh_spec, threshold, with_seq_start):
    r = np.random.default_rng(0)
    b, t, h, hkv, d = 4, 40, 4, 2, 32
    q = jnp.asarray(r.standard_normal((b, t, h, d)), jnp.float32)
    k, v = (jnp.asarray(r.standard_normal((b, t, hkv, d)), jnp.float32) for _ in range(2))
    lf = jnp.asarray(-r.uniform(0, 0.3, (b, t, h)), jnp.float32)
    seg = jnp.asarray(np.repeat(np.array([[0] * 17 + [1] * 23]), b, 0), jnp.int32)
    ss = jnp.asarray([0, 3, 0, 5], jnp.int32) if with_seq_start else None
    thr = jnp.asarray(r.uniform(-12, -6, (b, h)), jnp.float32) if threshold == "array" else threshold

    def loss(q, k, v, lf, impl):
        o = forgetting_attention(q, k, v, lf, segment_ids=seg, seq_start=ss, adaptive_threshold=thr,
                                 implementation=impl)
        return jnp.sum(o * jnp.cos(o))

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    ref = jax.jit(grad, static_argnums=4)(q, k, v, lf, "xla")
    f = under_mesh(make_mesh(mesh_spec), jax.jit(grad, static_argnums=4))
    with jax.set_mesh(make_mesh(mesh_spec)):
        traced = "shard_map" in str(jax.jit(grad, static_argnums=4).trace(q, k, v, lf, "pallas").jaxpr)
    out = f(q, k, v, lf, "pallas")
    errs = [float(jnp.max(jnp.abs(a - b_))) for a, b_ in zip((out[0],) + out[1], (ref[0],) + ref[1])]
    return dict(shard_map=traced, max_err=max(errs))


def dcp_case(mesh_spec, gated):
    """DCP attention (mask shared by the heads, packed documents, Tq < Tk, GQA), with and without gates."""
    r = np.random.default_rng(1)
    b, tq, tk, h, hkv, d = 4, 29, 40, 4, 2, 32
    q = jnp.asarray(r.standard_normal((b, tq, h, d)), jnp.float32)
    k, v = (jnp.asarray(r.standard_normal((b, tk, hkv, d)), jnp.float32) for _ in range(2))
    lf = jnp.asarray(-r.uniform(0, 0.3, (b, tk, h)), jnp.float32)
    # about half of the pairs dropped (at the floor), rows differing so the shards' tile lists differ
    mask = jnp.asarray(np.where(r.uniform(size=(b, tq, tk)) < 0.5, LOG_FLOOR, -r.uniform(0, 1, (b, tq, tk))),
                       jnp.float32)
    seg = jnp.asarray(np.repeat(np.array([[0] * 17 + [1] * 23]), b, 0), jnp.int32)

    def loss(q, k, v, mask, lf, impl):
        o = dcp_attention(q, k, v, mask, lf if gated else None, segment_ids=seg, implementation=impl)
        return jnp.sum(o * jnp.cos(o))

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
    ref = jax.jit(grad, static_argnums=5)(q, k, v, mask, lf, "xla")
    with jax.set_mesh(make_mesh(mesh_spec)):
        traced = "shard_map" in str(jax.jit(grad, static_argnums=5).trace(q, k, v, mask, lf, "pallas").jaxpr)
    out = under_mesh(make_mesh(mesh_spec), jax.jit(grad, static_argnums=5))(q, k, v, mask, lf, "pallas")
    # relative to each output's scale (at least 1): the loss (|L| ≈ 116) is summed over 4 shards, another order
    errs = [float(jnp.max(jnp.abs(a - b_)) / max(1.0, float(jnp.max(jnp.abs(b_)))))
            for a, b_ in zip((out[0],) + out[1], (ref[0],) + ref[1])]
    return dict(shard_map=traced, max_err=max(errs))


def decode_case(mesh_spec, kind):
    """The Pallas decode kernel (interpret mode) under ``mesh_spec``: ``append`` (a ring's step with Λ, ACP's decay
    floor and per-head tables: rows over data, kv heads over tensor), ``pinned`` (``sinks``' pinned slots in front of
    the ring, per-row tables), ``step`` / ``step-logits`` (FoX (Pro)'s fused step, the gate
    projections done in the kernel or their logits by XLA: the GEMM rows and gates laid out per shard, then rows and
    heads split) or ``pool`` (``decode_attention`` with a per-head valid mask) against the same call without a
    mesh; counts the compiled program's all-gathers (none: nothing is
    gathered around the kernel)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_decode_attention import _lambda_pairs, _step_case

    from fox_jax.ops import decode_attention, decode_attention_append
    from fox_jax.ops.decode_attention import DecodeStep

    r = np.random.default_rng(2)
    b, hkv, grp, d, cap = 4, 2, 2, 32, 64
    k, v = (jnp.asarray(r.standard_normal((b, hkv, cap, d)), jnp.float32) for _ in range(2))
    lam_q, lam_k = _lambda_pairs(r, grp, cap, b, hkv)
    hi = jnp.asarray([[cap + 9], [40], [2 * cap + 3], [17]], jnp.int32)  # per row: wrapped, partial, short
    if kind == "pool":
        valid = jnp.asarray(r.random((b, hkv, cap)) > 0.3)
        f = jax.jit(functools.partial(decode_attention, implementation="pallas"))
        args, kw = (jnp.asarray(r.standard_normal((b, hkv, grp, d)), jnp.float32), k, v), dict(
            lo=jnp.int32(0), hi=jnp.int32(cap), valid=valid, lam_q=lam_q, lam_k=lam_k)
    else:
        start = hi - 30 + jnp.asarray(r.integers(0, 8, (b, hkv)), jnp.int32)
        kw = dict(lo=jnp.full((b, 1), -(2 ** 30), jnp.int32), hi=hi, lam_k=lam_k,
                  ring_tables=(start, jnp.zeros((b, hkv), jnp.int32), jnp.zeros((b, hkv), jnp.int32)))
        if kind == "pinned":  # sinks:5+W: 16 pinned slots in front of a 48-slot ring, per-row tables
            from fox_jax.ops.decode_attention import PinnedSlots

            seq = jnp.asarray([0, 3, 1, 2], jnp.int32)
            kw.update(lo=hi - 40, ring_tables=tuple(x[:, :1] for x in kw["ring_tables"]),
                      pinned=PinnedSlots(5, 16, seq))
            kw["ring_tables"] = (seq[:, None] + 5, *kw["ring_tables"][1:])
        if kind.startswith("step"):  # step: the gate projections in the kernel; step-logits: their logits from XLA
            ops, q, k_new, v_new, shift_state, log_fgate, lam_prev = _step_case(
                grp, d, jnp.float32, False, seed=3, b=b, hkv=hkv, d_in=48 if kind == "step" else 40)
            kw["step"] = DecodeStep(ops, jnp.asarray([0, 3, 0, 5], jnp.int32), shift_state, log_fgate, lam_prev)
        else:
            q = jnp.asarray(r.standard_normal((b, hkv, grp, d)), jnp.float32)
            k_new, v_new = (jnp.asarray(r.standard_normal((b, hkv, d)), jnp.float32) for _ in range(2))
            lam_new = (lam_q[0] - 0.05, lam_q[1])
            kw.update(lam_q=lam_new, lam_new=lam_new)
            if kind == "append":
                kw["decay_floor"] = jnp.full((b, hkv, grp), -2.0, jnp.float32)
        f = jax.jit(functools.partial(decode_attention_append, implementation="pallas"))
        args = (q, k, v, k_new, v_new)
    ref = f(*args, **kw)
    mesh = make_mesh(mesh_spec)
    with jax.set_mesh(mesh):
        traced = "shard_map" in str(f.trace(*args, **kw).jaxpr)
        gathers = f.lower(*args, **kw).compile().as_text().count("all-gather")
    got = under_mesh(mesh, f)(*args, **kw)
    pairs = list(zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)))
    return dict(shard_map=traced, gathers=gathers, leaves=len(pairs),
                max_err=max(float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b_, jnp.float32))))
                            for a, b_ in pairs),
                o_spec=str((got if kind == "pool" else got.o).sharding.spec))


def model_case():
    cfg = preset("tiny", "fox-pro", vocab_size=64, n_layers=1, attention_impl="pallas", dtype="float32")
    model = LanguageModel(cfg)
    tokens = jnp.zeros((4, 16), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens)["params"])  # only traced
    fn = jax.jit(lambda p, x: model.apply({"params": p}, x).logits)
    with jax.set_mesh(make_mesh("data=2,tensor=2")):
        inside = "shard_map" in str(fn.trace(params, tokens).jaxpr)
    outside = "shard_map" in str(fn.trace(params, tokens).jaxpr)
    return dict(inside=inside, outside=outside)


def activation_collectives(mesh_spec: str, kinds: tuple[str, ...], where: str = "") -> int:
    """The collectives of ``kinds`` that move activations (arrays with the 24-token axis; the weights have none) in
    the compiled gradient of a FoX (Pro) loss under ``mesh_spec`` (parameters sharded by the training rules,
    scanned layers as in training), counted where the op name contains ``where``. Compiled only."""
    import re

    from fox_jax.sharding import state_shardings

    cfg = preset("tiny", "fox-pro", vocab_size=64, n_layers=1, attention_impl="pallas", dtype="float32")
    model = LanguageModel(cfg)
    mesh = make_mesh(mesh_spec)
    tokens = jax.ShapeDtypeStruct((4, 24), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((4, 24), jnp.int32))["params"])
    params = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params,
                                    state_shardings(mesh, params))
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(model.apply({"params": p}, x).logits ** 2)))
    with jax.set_mesh(mesh):
        hlo = grad.lower(params, tokens).compile().as_text()
    op = re.compile(r"= (.*?) (" + "|".join(kinds) + r")(-start)?\(")
    alone = re.compile(r"replica_groups=\{(\{\d+\},?)+\}")  # one device per group: nothing moves
    return sum(1 for line in hlo.splitlines() if (m := op.search(line)) and where in line and not alone.search(line)
               and re.search(r"\[[\d,]*\b24\b[\d,]*\]", m.group(1)))


if __name__ == "__main__":
    out = {f"{m}|{t}|{s}": op_case(m, t, s) for m, t, s in
           (("data=2,tensor=2", None, False), ("fsdp=4", "auto", True), ("data=4", "array", True),
            ("tensor=4", None, False))}
    out["dcp|data=2,tensor=2|gated"] = dcp_case("data=2,tensor=2", True)
    out["dcp|data=4"] = dcp_case("data=4", False)
    out["decode|data=2,tensor=2|append"] = decode_case("data=2,tensor=2", "append")
    out["decode|data=4|step"] = decode_case("data=4", "step")
    out["decode|data=2,tensor=2|step"] = decode_case("data=2,tensor=2", "step")
    out["decode|data=2,tensor=2|step-logits"] = decode_case("data=2,tensor=2", "step-logits")
    out["decode|data=2,tensor=2|pool"] = decode_case("data=2,tensor=2", "pool")
    out["decode|data=4|pinned"] = decode_case("data=4", "pinned")
    out["model"] = model_case()
    # SwiGLU under tensor: no exchange of the MLP's activations; under fsdp: no activation collective at all
    out["mlp"] = activation_collectives("data=2,tensor=2", ("collective-permute", "all-gather"), "/mlp/")
    out["fsdp"] = activation_collectives("fsdp=4", ("collective-permute", "all-gather", "all-reduce",
                                                    "reduce-scatter", "all-to-all"))
    # the partitioner picked for multi-GPU meshes (fox_jax.sharding.select_partitioner): same results
    jax.config.update("jax_use_shardy_partitioner", False)
    out["gspmd|data=2,tensor=2"] = op_case("data=2,tensor=2", "auto", True)
    jax.config.update("jax_use_shardy_partitioner", True)
    os.environ["FOX_JAX_SHARD_KERNELS"] = "0"  # switched off (the GPU default): XLA replicates the kernels
    out["off|data=2,tensor=2"] = op_case("data=2,tensor=2", None, False)
    print("RESULT " + json.dumps(out))
    sys.stdout.flush()
