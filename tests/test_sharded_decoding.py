"""Sharded generation and scoring (``generate(mesh=...)``, ``token_losses_under_policy(mesh=...)``, ``--mesh`` of
``fox-jax generate`` and ``eval --cache``) equal the unsharded ones, on 8 simulated CPU devices in a subprocess
(so the device count of the rest of the suite is untouched); and the caches' logical axes (one device).

Tolerances: greedy tokens must be equal (the test model's weights are scaled x3 so that near-ties of the
argmax, which another float32 summation order could flip, are unlikely). Losses differ only by the order of
float32 reductions (sharded matmuls over heads and the embedding): observed ≤ 3e-6 on losses ≈ 4; we allow
1e-5 absolute, and 1e-5 relative on perplexities.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from fox_jax.models import GPT2Config, preset

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("policy", ["dense", "dcp", "acp", "window:4"])
def test_every_cache_array_has_logical_axes_of_its_rank(policy):
    """``logical_axes()`` mirrors the cache: one name (or None) per dimension of every array, batch first."""
    fox = preset("tiny", "fox-pro", vocab_size=64, n_layers=1, n_kv_heads=2, dcp=policy == "dcp", interaction_dim=8)
    gpt2 = GPT2Config(n_layers=1, n_heads=2, d_model=16, vocab_size=50, n_positions=32, dcp=policy == "dcp",
                      interaction_dim=8)
    for cfg in (fox, gpt2):
        if policy == "acp" and cfg is gpt2:
            continue  # acp needs a forget gate
        slots = ((3, 5),) if policy == "acp" else 6  # acp: two per-head groups
        for cache in cfg.init_cache(4, slots, policy=policy):
            pairs = jax.tree_util.tree_map(lambda x, names: (x.shape, names), cache, cache.logical_axes())
            pairs = jax.tree_util.tree_leaves(pairs, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                                              and isinstance(x[0], tuple))
            assert len(pairs) == len(jax.tree_util.tree_leaves(cache)) >= 6
            for shape, names in pairs:
                names = (None,) * len(shape) if names is None else names
                assert len(names) == len(shape), (policy, shape, names)
                if len(shape) >= 1 and shape[0] == 4:
                    assert names[0] == "batch", (policy, shape, names)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")  # conftest's flags (-O0) too
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_sharded_decoding.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("policy,mesh", [("dense", "data=8"), ("acp", "data=2,fsdp=2,tensor=2")])  # as _sharded_decoding
def test_sharded_generation_and_scoring_equal_unsharded(sharded, policy, mesh):
    ref, got = sharded[policy], sharded[f"{policy}|{mesh}"]
    assert got["tokens"] == ref["tokens"]
    np.testing.assert_allclose(got["nll"], ref["nll"], rtol=0, atol=1e-5)
    assert got["overflow"] == 0 and got["k_shards"] == 8
    # the caches stay sharded through the decode loop: rows over data (x fsdp), kv heads over tensor
    assert got["k_spec"] == ("P('data',)" if mesh == "data=8" else "P(('data', 'fsdp'), 'tensor')")


@pytest.mark.slow
def test_the_pallas_decode_step_runs_per_shard(sharded):
    """The fused step through the Pallas decode kernel (as on a GPU; interpret mode here) gives the unsharded tokens:
    acp under data=8 (rows split), window:16 under data=4,tensor=2 (rows and heads), also with W_o in the kernel (each
    shard's share of o·W_o, summed over tensor), and GPT-2's c_attn as partial sums with its bias (``DECODE_QKV``,
    laid out per shard) under data=4,tensor=2; that the kernel then runs per shard, with nothing gathered, is
    test_sharding's decode cases."""
    assert sharded["pallas"]["equal"] == {"acp|data=8": True, "window:16|data=4,tensor=2": True,
                                          "window:16|data=4,tensor=2|proj": True,
                                          "gpt2|window:16|data=4,tensor=2|parts": True}
    assert sharded["pallas"]["fused_calls"] >= 4 and sharded["pallas"]["projecting_calls"] >= 2
    assert sharded["pallas"]["partial_row_calls"] >= 2  # GPT-2's c_attn as partial sums, per shard


@pytest.mark.slow
def test_a_batch_the_mesh_does_not_divide(sharded):
    assert sharded["indivisible"].startswith("mesh: the batch of 3 rows does not split over the mesh's data x fsdp "
                                             "= 8 devices")


@pytest.mark.slow
def test_commands_with_mesh_pad_and_equal_one_device(sharded):
    one, mesh = sharded["generate|one"], sharded["generate|mesh"]
    assert mesh["text"] == one["text"] and mesh["summary"]["batch"] == 3 and mesh["summary"]["new_tokens"] == [5] * 3
    assert mesh["summary"]["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1} and mesh["summary"]["padded_rows"] == 5
    assert "mesh" not in one["summary"]
    for key in ("prompt_tokens", "slots", "kv_bytes_allocated", "kv_bytes_live", "kv_bytes_peak_live",
                "mean_live_tokens_per_layer", "overflow"):  # the prompts' rows only, not the padding
        assert mesh["summary"][key] == one["summary"][key], key
    one, mesh = sharded["eval|one"], sharded["eval|mesh"]
    assert mesh["num_docs"] == one["num_docs"] == 3 and mesh["dense_tokens"] == one["dense_tokens"]
    for key in ("dense_ppl", "policy_ppl"):
        assert mesh[key] == pytest.approx(one[key], rel=1e-5)
