"""benchmarks/bench_scaling.py: the weak-scaling rows (one-device baseline, efficiency, errors, merging, the table)
with a stand-in for the timed step, and the one-device mesh it builds (no compile: cheap)."""

import argparse
import json
import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_scaling as bs  # noqa: E402

from fox_jax.sharding import make_mesh, parse_mesh  # noqa: E402


def test_rows_scale_the_work_and_divide_by_the_baseline(monkeypatch):
    """Per (config, ACP): the baseline runs on ``jax.devices()[:1]`` with the tokens of one device, each mesh on all
    N devices with N times as many; efficiency = tokens/s / (N × the baseline's); a failing mesh is a row with its
    error and no efficiency, and the command goes on; ACP is skipped for a model without forget gates."""
    monkeypatch.setattr(jax, "device_count", lambda: 4)
    calls = []

    def fake(arch, size, seq, acp, batch_tokens, steps, warmup, remat, mesh, dtype, *, model_overrides, devices):
        calls.append((arch, acp, mesh, batch_tokens, None if devices is None else len(devices)))
        if mesh == "fsdp=2,tensor=2":
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        speed = {"data=1": 1000.0, "data=4": 3800.0}[mesh]
        return dict(arch=arch, size=size, seq_len=seq, acp=acp, batch=batch_tokens // seq, tokens_per_sec=speed,
                    mfu=0.3, devices=99)

    rows = bs.scaling_rows([("fox-pro", "125M", 2048), ("transformer-pro", "125M", 2048)],
                           ["data=4", "fsdp=2,tensor=2"], [False, True], 16384, 2, 1, bench=fake, log=lambda s: None)
    assert calls[:3] == [("fox-pro", False, "data=1", 16384, 1), ("fox-pro", False, "data=4", 65536, None),
                         ("fox-pro", False, "fsdp=2,tensor=2", 65536, None)]
    assert [(c[0], c[1]) for c in calls].count(("transformer-pro", True)) == 0  # no ACP without forget gates
    assert len(rows) == 9
    base, dp, oom = rows[:3]
    assert (base["devices"], base["efficiency"], base["tokens_per_s"]) == (1, 1.0, 1000.0)
    assert dp["devices"] == 4 and dp["efficiency"] == pytest.approx(3800 / 4000) and dp["baseline_tokens_per_s"] == 1000
    assert "tokens_per_sec" not in dp and set(bs.ROW_KEY) <= set(dp)
    assert oom["error"].startswith("RuntimeError: RESOURCE_EXHAUSTED") and oom["efficiency"] is None
    text = bs.table(rows)
    assert "| fox-pro 125M | 2048 | off | 4 | data=4 | 32 | 3,800 | 30.0% | 95.0% |" in text
    assert "RESOURCE_EXHAUSTED" in text


def test_merge_replaces_rows_by_key_and_bad_arguments(tmp_path):
    old = [dict(arch="a", size="s", seq_len=1, acp=False, mesh="data=4", tokens_per_s=1.0),
           dict(arch="a", size="s", seq_len=1, acp=False, mesh="data=1", tokens_per_s=2.0)]
    new = [dict(arch="a", size="s", seq_len=1, acp=False, mesh="data=4", tokens_per_s=3.0)]
    assert [r["tokens_per_s"] for r in bs.merge_rows(old, new)] == [2.0, 3.0]
    with pytest.raises(ValueError, match=r"--configs: expected arch:size:seq_len"):
        bs.parse_config("fox-pro:760M")
    with pytest.raises(SystemExit):  # argparse's one line (stderr), naming the flag
        bs.main(["--meshes", "model=4", "--out", str(tmp_path / "x.json")])
    args = lambda *a: argparse.Namespace(**{**dict(  # noqa: E731
        configs=[], generate=[], meshes=["data=4"], generate_meshes=None, generate_policies="dense",
        generate_rows_per_device=8), **dict(a)})
    with pytest.raises(ValueError, match=r"^--meshes: unknown axis 'model'"):
        bs.checked(args(("configs", ["fox-pro:125M:2048"]), ("meshes", ["model=4"])))
    with pytest.raises(ValueError, match=r"^--generate: expected"):  # named before the (unused) training meshes
        bs.checked(args(("generate", ["fox-pro:125M"]), ("meshes", ["data=64"])))
    with pytest.raises(ValueError, match=r"^--generate-meshes: 'tensor=1' does not split the rows"):
        bs.checked(args(("generate", ["gpt2:896"]), ("generate_meshes", ["tensor=1"])))
    with pytest.raises(ValueError, match=r"^--generate-policies: "):
        bs.checked(args(("generate", ["gpt2:896"]), ("generate_policies", "dense,nope")))
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"rows": [dict(old[0], devices=4, batch=8, mfu=None, efficiency=0.5)]}))
    assert bs.main(["--table", str(path)]) == 0


def test_one_device_mesh_beside_all_devices():
    """``make_mesh(spec, devices)``: a mesh over a subset (the baseline's one device), sized by it."""
    mesh = make_mesh("data=1", jax.devices()[:1])
    assert mesh.size == 1 and dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    assert parse_mesh(None, 4) == {"data": 4, "fsdp": 1, "tensor": 1}
    with pytest.raises(ValueError, match=r"needs 2 devices, have 1"):
        make_mesh("data=2", jax.devices()[:1])


def test_generation_rows_scale_the_rows_and_divide_by_the_baseline(monkeypatch):
    """``--generate``: per (model, prompt, policy) the one-device row with the rows of one device, then each mesh with
    N times as many; tokens_per_s is the decode rate, step_ms per decode step; a failing mesh is an error row; the
    rows merge by task and policy beside training rows of the same model, and the table names the policy."""
    monkeypatch.setattr(jax, "device_count", lambda: 4)
    calls = []

    def fake(model_spec, prompt, policy, batch, mesh, devices):
        calls.append((model_spec, policy, batch, mesh, None if devices is None else len(devices)))
        if mesh == "fsdp=4":
            return dict(error="RESOURCE_EXHAUSTED: out of memory")
        rate = {"data=1": 100.0, "data=4": 380.0}[mesh] * (2 if policy == "acp" else 1)
        return dict(decode_tokens_per_sec=rate, tokens_per_sec=rate / 2, seconds=1.0, prefill_seconds=0.5, overflow=0)

    rows = bs.generate_rows([bs.parse_generate("fox-pro:125M:8192")], ["data=4", "fsdp=4"], ["dense", "acp"], 8, 11, 1,
                            log=lambda s: None, measure=fake)
    assert calls[:3] == [("fox-pro:125M", "dense", 8, "data=1", 1), ("fox-pro:125M", "dense", 32, "data=4", None),
                         ("fox-pro:125M", "dense", 32, "fsdp=4", None)]
    base, dp, oom = rows[3:]  # acp
    assert (base["task"], base["policy"], base["acp"], base["efficiency"]) == ("generate", "acp", True, 1.0)
    assert dp["tokens_per_s"] == 760.0 and dp["efficiency"] == pytest.approx(0.95) and dp["step_ms"] == 50.0
    assert oom["error"].startswith("RuntimeError: RESOURCE_EXHAUSTED") and oom["efficiency"] is None
    train = dict(arch="fox-pro", size="125M", seq_len=8192, acp=True, mesh="data=4", tokens_per_s=1.0)  # no task key
    merged = bs.merge_rows([train, dict(dp, tokens_per_s=1.0)], [dp])
    assert len(merged) == 2 and merged[-1]["tokens_per_s"] == 760.0
    assert "| fox-pro 125M generate | 8192 | acp | 4 | data=4 | 32 | 760 | – | 95.0% |" in bs.table(rows)
    assert bs.parse_generate("gpt2:896") == ("gpt2", 896)
    for bad in ("fox-pro:125M", "fox-pro:8192", "gpt2:x"):
        with pytest.raises(ValueError, match=r"--generate: expected arch:size:prompt or gpt2:prompt"):
            bs.parse_generate(bad)
