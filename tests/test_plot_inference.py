"""benchmarks/plots/plot_inference.py on a small synthetic results folder of quality.sh."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("plot_inference", ROOT / "benchmarks" / "plots" / "plot_inference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench_row(mode, policy, prompt, batch, slots, tps, decode):
    return dict(mode=mode, policy=policy, prompt_len=prompt, new_tokens=128, batch=batch, slots=slots,
                tokens_per_sec=tps, decode_tokens_per_sec=decode, kv_row_bytes=slots * 36864.0,
                kv_allocated_bytes=batch * slots * 36864, kv_live_bytes=batch * slots * 30000,
                live_tokens_final=slots * 0.8, sparsity_final=0.5, overflow=0)


def _results(tmp_path: Path) -> Path:
    r = tmp_path / "inference"
    for d in ("runs/pre", "runs/dcp_g0.3", "quality", "passkey/pre__dense", "bench"):
        (r / d).mkdir(parents=True)
    (r / "models.txt").write_text("pre /tmp/x/gpt2 gpt2\ndcp_g0.3 /tmp/x/dcp gpt2-dcp\n")
    (r / "runs/pre/metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 4.0, "val_ppl": 60.0, "val_loss": 4.1}) + "\n")
    (r / "runs/dcp_g0.3/metrics.jsonl").write_text(
        json.dumps({"step": 12, "loss": 4.2, "val_ppl": 70.0, "val_sparsity": 0.7}) + "\n")
    (r / "runs/dcp_g0.3/config.json").write_text(json.dumps({"dcp": {"gamma": 0.3}, "model": {"model_type": "gpt2"}}))
    jobs = []
    for model, policy, ppl, dense in (("pre", "window:256", 75.5, 61.0), ("dcp_g0.3", "dcp", 70.2, 65.0)):
        log = f"quality/{model}__{policy.replace(':', '_')}__1024.log"
        line = dict(step=10, seq_len=1024, num_docs=16, cache=policy, policy_ppl=ppl, dense_ppl=dense,
                    policy_loss=4.3, dense_loss=4.1, ppl_ratio=ppl / dense, policy_overflow_rows=0)
        (r / log).write_text(f"step 10, 16 documents x 1024 tokens: cache {policy} ppl {ppl} vs dense {dense}\n"
                             + json.dumps(line) + "\n")
        jobs.append(dict(kind="eval", model=model, policy=policy, ctx="1024", rc=0, seconds=9, log=log))
    (r / "quality/pre__sinks_4p252__1024.log").write_text("Traceback\nValueError: something went wrong\n")
    jobs.append(dict(kind="eval", model="pre", policy="sinks:4+252", ctx="1024", rc=1, seconds=3,
                     log="quality/pre__sinks_4p252__1024.log"))
    (r / "passkey/pre__dense.log").write_text(json.dumps({"command": "passkey", "policy": "dense", "accuracy": 0.75}) + "\n")
    (r / "passkey/pre__dense/passkey.json").write_text(json.dumps(
        {"lengths": [256, 1024], "depths": [0, 1], "accuracy": [[1.0, 1.0], [0.5, 0.5]], "mean_accuracy": 0.75}))
    jobs.append(dict(kind="passkey", model="pre", policy="dense", ctx="256,1024", rc=0, seconds=5,
                     log="passkey/pre__dense.log"))
    (r / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in jobs))
    pre_rows = [_bench_row("equal-batch", "dense", 896, 32, 1024, 8000.0, 9000.0),
                _bench_row("kv-budget", "dense", 896, 56, 1024, 12000.0, 14000.0),
                _bench_row("equal-batch", "window:256", 896, 32, 256, 9000.0, 11000.0),
                _bench_row("kv-budget", "window:256", 896, 227, 256, 30000.0, 40000.0)]
    (r / "bench/pre.json").write_text(json.dumps({"meta": {"device": "H200"}, "rows": pre_rows}))
    (r / "bench/dcp_g0.3.json").write_text(json.dumps({"meta": {}, "rows": [
        _bench_row("kv-budget", "dcp", 896, 200, 320, 25000.0, 33000.0),
        {"mode": "equal-batch", "policy": "dcp", "prompt_len": 896, "error": "ValueError: x"}]}))
    (r / "stages.jsonl").write_text(json.dumps({"stage": "pretrain", "start_s": 1, "end_s": 100, "budget_s": 140, "rc": 0}) + "\n")
    (r / "env.json").write_text(json.dumps({"device": "NVIDIA H200", "jax": "0.11.2", "flax": "0.12.10"}))
    return r


def test_collect_join_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    mod = _module()
    results = _results(tmp_path)
    summary = mod.main([str(results), "--out-dir", str(tmp_path / "out")])
    rows = {(r["model"], r["policy"]): r for r in summary["table"]}
    assert set(rows) == {("pre", "dense"), ("pre", "window:256"), ("pre", "sinks:4+252"), ("dcp_g0.3", "dcp"),
                         ("dcp_g0.3", "dense")}
    # dense ppl comes with every eval --cache (same documents)
    assert rows[("pre", "dense")]["val_ppl"] == 61.0 and rows[("dcp_g0.3", "dense")]["val_ppl"] == 65.0
    assert rows[("pre", "window:256")]["val_ppl"] == 75.5
    assert rows[("pre", "dense")]["passkey"] == 0.75
    assert rows[("pre", "window:256")]["budget_x_dense"] == pytest.approx(30000 / 12000)
    assert rows[("pre", "window:256")]["kv_less_x"] == pytest.approx(1024 / 256)
    # the dcp model's ratios are taken against the base model's dense row (same mode and prompt)
    assert rows[("dcp_g0.3", "dcp")]["budget_x_dense"] == pytest.approx(25000 / 12000)
    assert rows[("dcp_g0.3", "dcp")]["speed_from"] == "dcp_g0.3"
    # a dense policy on the dcp model borrows the base model's dense speed; a failed eval is reported
    assert rows[("dcp_g0.3", "dense")]["speed_from"] == "pre"
    assert rows[("pre", "sinks:4+252")]["quality_status"].startswith("error: ValueError")
    assert summary["models"]["dcp_g0.3"]["train"]["val_sparsity"] == 0.7
    assert summary["passkey"][0]["by_length"] == {"256": 1.0, "1024": 0.5}
    out = tmp_path / "out"
    assert (out / "inference.png").stat().st_size > 0
    md = (out / "summary.md").read_text()
    assert "| pre | window:256 | 1,024 | 75.50 | 1.238 |" in md
    # the summary JSON alone reproduces the same table
    again = mod.main([str(out / "summary.json"), "--out-dir", str(tmp_path / "again")])
    assert again["table"] == summary["table"]
