"""Sharded training on 8 simulated CPU devices (in a subprocess, so the device count of the rest of
the suite is untouched): different meshes give the same losses, and a checkpoint saved on one mesh
restores onto another and continues with the losses of the uninterrupted run.

Tolerance: the meshes only change the order of float32 reductions (gradient all-reduce, sharded
matmuls), so losses agree to ~1e-6 relative; we allow 2e-5.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jax

import jax.numpy as jnp
import numpy as np

from fox_jax.models import preset
from fox_jax.models.gpt2 import GPT2Config
from fox_jax.sharding import (MESH_AXES, PARAM_RULES, make_mesh, param_logical_axes, parse_mesh,
                              select_partitioner, state_shardings)

ROOT = Path(__file__).resolve().parents[1]


def test_parse_mesh_errors():
    with pytest.raises(ValueError, match="unknown axis"):
        parse_mesh("model=2")
    with pytest.raises(ValueError, match="devices"):
        parse_mesh("data=3")


def test_select_partitioner():
    """auto keeps JAX's default off GPU (one CPU device here); explicit choices set the JAX flag."""
    before = jax.config.jax_use_shardy_partitioner
    mesh = make_mesh(None)
    try:
        with pytest.raises(ValueError, match="partitioner must be one of"):
            select_partitioner(mesh, "xla")
        assert select_partitioner(mesh, "auto") == ("shardy" if before else "gspmd")
        assert select_partitioner(mesh, "gspmd") == "gspmd" and not jax.config.jax_use_shardy_partitioner
        assert select_partitioner(mesh, "shardy") == "shardy" and jax.config.jax_use_shardy_partitioner
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)


def _model_params():
    """(name, abstract params) of every model family and variant whose parameter names differ (shapes
    through ``jax.eval_shape``: the rules only read names and numbers of dimensions; nothing compiles)."""
    rng = jax.random.PRNGKey(0)
    out = []
    for arch in ("fox-llama", "fox-pro", "transformer-llama", "transformer-pro"):
        cfg = preset("tiny", arch, vocab_size=64, n_layers=1)
        out.append((arch, jax.eval_shape(cfg.init_params, rng)))
    cfg = preset("tiny", "fox-pro", vocab_size=64, n_layers=1, n_kv_heads=2, qk_norm_shared=True,
                 tie_embeddings=True)
    out.append(("fox-pro-gqa-shared-tied", jax.eval_shape(cfg.init_params, rng)))
    lm = preset("tiny", "fox-llama", vocab_size=64, n_layers=1)
    out.append(("fox-llama-dcp", jax.eval_shape(lambda r: lm.add_dcp_params(lm.init_params(r), r)[1], rng)))
    g = GPT2Config(n_layers=1, n_heads=2, d_model=16, vocab_size=50, n_positions=32)
    out.append(("gpt2", jax.eval_shape(g.init_params, rng)))
    out.append(("gpt2-dcp", jax.eval_shape(lambda r: g.add_dcp_params(g.init_params(r), r)[1], rng)))
    return out


@pytest.mark.parametrize("name,params", _model_params(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_matrix_of_every_model_has_a_sharding_rule(name, params):
    """Every parameter of >= 2 dimensions matches a rule with its number of dimensions (the call raises
    otherwise) that names at least one logical axis (no matrix is replicated by omission)."""
    used = set()
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        axes = param_logical_axes(path, x.ndim)
        assert len(axes) == x.ndim
        if x.ndim >= 2:
            assert any(a is not None for a in axes), (name, jax.tree_util.keystr(path))
            used.add(path)
    assert used


def test_a_parameter_without_a_rule_is_an_error():
    params = {"layers_0": {"attn": {"renamed_proj": {"kernel": jnp.zeros((4, 4))}}}}
    with pytest.raises(ValueError, match="no sharding rule .*layers_0/attn/renamed_proj/kernel"):
        state_shardings(make_mesh(None), params)
    [(path, _)] = jax.tree_util.tree_flatten_with_path({"q_proj": {"kernel": jnp.zeros((2, 2, 2))}})[0]
    with pytest.raises(ValueError, match="has 2 axes but parameter .* has 3 dimensions"):
        param_logical_axes(path, 3)
    [(path, _)] = jax.tree_util.tree_flatten_with_path({"x": {"bias": jnp.zeros(3)}})[0]
    assert param_logical_axes(path, 1) == (None,)  # 0-D / 1-D leaves of any name are replicated


def test_rules_name_only_known_logical_axes():
    from fox_jax.sharding import LOGICAL_AXIS_RULES

    for key, axes in PARAM_RULES.items():
        assert all(a is None or a in LOGICAL_AXIS_RULES for a in axes), key


def test_mesh_comes_from_jax_make_mesh():
    mesh = make_mesh(None)
    assert mesh.axis_names == MESH_AXES and mesh.devices.size == jax.device_count()
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 3
    np.testing.assert_array_equal(mesh.devices, jax.make_mesh((jax.device_count(), 1, 1), MESH_AXES,
                                                              axis_types=mesh.axis_types).devices)


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus")
    for i, f in enumerate(sorted(ROOT.glob("fox_jax/**/*.py"))):
        (corpus / f"doc{i:03d}.txt").write_text(f.read_text())
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")  # conftest's flags (-O0) too
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_sharded_runs.py"), str(corpus),
                           str(tmp_path_factory.mktemp("runs"))], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_meshes_agree(sharded_results):
    ref = sharded_results["dp8"]
    assert sorted(map(int, ref)) == list(range(1, 7))
    for name in ("fsdp", "tp"):
        for step, loss in ref.items():
            assert sharded_results[name][step] == pytest.approx(loss, rel=2e-5), (name, step)
    assert sharded_results["dp8_sharded_params"]["n"] == 0  # pure data parallel: replicated
    assert sharded_results["fsdp_sharded_params"]["n"] > 0
    assert sharded_results["tp_sharded_params"]["n"] > 0


@pytest.mark.slow
def test_checkpoint_restores_onto_another_mesh(sharded_results):
    remesh, ref = sharded_results["remesh"], sharded_results["fsdp"]
    assert sorted(map(int, remesh)) == [4, 5, 6]  # steps after the resume
    for step, loss in remesh.items():
        assert loss == pytest.approx(ref[step], rel=2e-5), step


@pytest.mark.slow
def test_pallas_attention_runs_per_shard_under_a_mesh():
    """Under ``jax.set_mesh`` the Pallas ops (forgetting attention; DCP attention, ``dcp|`` cases) are wrapped in a
    shard_map (batch over data/fsdp, heads over tensor; with tensor=4 and Hkv=2 nothing divides, so it is left to
    XLA), and their values and gradients (DCP: the mask's too) equal the unsharded XLA path; the decode kernel
    (``decode|`` cases: a ring's append step, sinks' pinned slots, the fused FoX (Pro) step, a pool's read) equals
    its unsharded call with nothing gathered around it (observed: bitwise, or 6e-8 where a shard's fewer rows give
    the kernel another default split of the keys, so another float32 combine); a model traced under the mesh contains
    the shard_map; the SwiGLU MLP under data=2,tensor=2 exchanges no activations and under fsdp=4 no collective
    moves activations. Tolerance:
    float32, different tiling and summation order only (observed ~1e-5 on O(10) gradients); 1e-4 (the DCP cases
    relative to each output's scale, at least 1: their loss of |L| ≈ 116 is summed over the shards in another
    order, 1.6e-4 absolute, 1.4e-6 relative)."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")  # conftest's flags (-O0) too
    env.pop("FOX_JAX_SHARD_KERNELS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_sharded_attention.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    assert res.pop("model") == {"inside": True, "outside": False}
    # SwiGLU under tensor=2: gate and up split by the hidden axis alike (the kernel is moved instead), so no
    # collective-permute or all-gather of the MLP's activations (with the halves on different devices, as the
    # stored [d, 2·hidden] layout shards them, there were several per layer)
    assert res.pop("mlp") == 0
    # under fsdp=4 the residual stream is split by rows only (fox_jax.models.lm): every weight is gathered where it
    # is used and no collective moves activations (unconstrained, XLA split d of the activations and exchanged
    # them around every matmul: 3.5 GB of collectives per step against 82 MB on 8 devices at 1024 tokens)
    assert res.pop("fsdp") == 0
    # the decode kernel per shard: nothing gathered around it, the outputs left sharded (rows over data, kv heads over
    # tensor: a fused step's GEMM rows and gates laid out per shard), every output (o, ring, Λ, first key, carries,
    # tables) equal
    for case, want in (("decode|data=2,tensor=2|append", ("P('data', 'tensor')", 9)),
                       ("decode|data=4|step", ("P('data',)", 11)),
                       ("decode|data=2,tensor=2|step", ("P('data', 'tensor')", 11)),
                       ("decode|data=2,tensor=2|step-logits", ("P('data', 'tensor')", 11)),
                       ("decode|data=2,tensor=2|pool", ("P('data', 'tensor')", 1)),
                       ("decode|data=4|pinned", ("P('data',)", 8))):
        assert res[case]["gathers"] == 0 and (res[case]["o_spec"], res[case]["leaves"]) == want, (case, res[case])
    for case, r in res.items():
        assert r["max_err"] < 1e-4, (case, r)
        assert r["shard_map"] == (not case.startswith(("tensor=4", "off|"))), case
