"""benchmarks/plots/plot_quality.py on a small synthetic results folder of quality.sh's table plan."""

import json
from pathlib import Path

import pytest
from plots import plot_quality  # benchmarks/ is on the tests' path (pyproject.toml)


def _res(label, ppl, sparsity, **kw):
    return dict(label=label, val_loss=1.0, ppl=ppl, sparsity=sparsity, sparsity_layers=[sparsity], **kw)


def _results(tmp_path: Path) -> Path:
    r = tmp_path / "q"
    (r / "table").mkdir(parents=True)
    matched = {"local": _res(None, 90.0, 0.6, pattern="local:230", nominal_sparsity=0.6),
               "strided": _res(None, 95.0, 0.61, pattern="strided:20", nominal_sparsity=0.61),
               "sinks": _res(None, 88.0, 0.6, pattern="sinks:4+226", nominal_sparsity=0.6)}
    report = {"config": {"seq_len": 1024, "tokens": 4096},
              "dense": _res("dense", 60.0, 0.0, info={"kind": "dense", "step": 2000}),
              "dcp": [_res("dcp_g0.1", 62.0, 0.6, info={"gamma": 0.1, "steps": 100}, matched=matched)],
              "controls": [_res("ftdense", 58.0, 0.0, info={"kind": "dense-ft", "pattern": None, "step": 2100}),
                           _res("ft_local_230", 70.0, 0.6, info={"kind": "pattern", "pattern": "local:230",
                                                                  "step": 2100}),
                           _res("ft_strided_20", 75.0, 0.61, info={"kind": "pattern", "pattern": "strided:20",
                                                                    "step": 2100})]}
    (r / "table" / "dcp_eval.json").write_text(json.dumps(report))
    for label, acc, policy in (("ftdense", 0.5, "dense"), ("ft_local_230", 0.25, "window:230"), ("dcp_g0.1", 0.5, "dcp")):
        (r / "table_passkey" / label).mkdir(parents=True)
        (r / "table_passkey" / label / "passkey.json").write_text(json.dumps(
            {"mean_accuracy": acc, "policy": policy, "lengths": [256, 1024], "depths": [0, 1], "n": 2}))
    (r / "env.json").write_text(json.dumps({"device": "NVIDIA H200", "jax": "0.11.2"}))
    return r


def test_rows_plot_and_merge(tmp_path):
    mod = plot_quality
    r = _results(tmp_path)
    rows = {(x["method"], x["fine_tuned"]): x for x in mod.collect_rows(str(r), model="gpt2-124M", stage="s1")}
    assert set(rows) == {("dense", False), ("dcp:g0.1", True), ("dense-ft", True), ("window:230", True),
                         ("strided:20", True), ("window:230", False), ("strided:20", False), ("sinks:4+226", False)}
    # ratios to the dense fine-tuning control on the same windows; passkey where it ran, None for strided
    assert rows["dcp:g0.1", True]["ppl_ratio"] == pytest.approx(62.0 / 58.0, abs=1e-5)
    assert rows["dcp:g0.1", True]["ppl_ratio_to"] == "dense-ft" and rows["dcp:g0.1", True]["gamma"] == 0.1
    assert rows["dense-ft", True]["ppl_ratio"] == 1.0 and rows["dense-ft", True]["passkey_acc"] == 0.5
    assert rows["window:230", True]["passkey_acc"] == 0.25 and rows["window:230", True]["pattern"] == "local:230"
    assert rows["strided:20", True]["passkey_acc"] is None and rows["window:230", False]["passkey_acc"] is None
    assert rows["dense", False]["device"] == "NVIDIA H200" and rows["dense", False]["context"] == 1024
    for row in rows.values():
        for key in ("model", "method", "context", "sparsity", "ppl", "ppl_ratio", "passkey_acc"):
            assert key in row

    out = tmp_path / "out"
    rows_file = out / "quality_h200.json"
    out.mkdir()
    rows_file.write_text(json.dumps([{"key": "other", "model": "fox", "method": "acp", "fine_tuned": False,
                                      "context": 8192, "sparsity": 0.5, "ppl": 50.0, "ppl_ratio": 1.0,
                                      "ppl_ratio_to": "dense", "passkey_acc": None, "stage": "fox"}]))
    assert mod.main([str(r), "--stage", "s1", "--rows", str(rows_file)]) == 0
    assert mod.main([str(r), "--stage", "s1", "--rows", str(rows_file)]) == 0  # same key: replaced, not added
    merged = json.loads(rows_file.read_text())
    assert len(merged) == 1 + len(rows)
    assert (out / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "quality.md").read_text()
    assert "| gpt2-124M | 1024 | dcp:g0.1 | yes |" in md
    # a fixed pattern fine-tuned with its own pattern and the same pattern on the pretrained weights: two rows
    assert "| gpt2-124M | 1024 | window:230 | yes (own pattern) | 60.0 | 70.00 |" in md
    assert "| gpt2-124M | 1024 | window:230 | no | 60.0 | 90.00 |" in md
    # a second stage merged later: its rows come first (the newest stage is the table's first group)
    assert mod.main([str(r), "--stage", "s2", "--rows", str(rows_file)]) == 0
    lines = [ln for ln in (out / "quality.md").read_text().splitlines() if ln.startswith("| gpt2-124M")]
    assert [ln.split(" | ")[-1] for ln in lines] == ["s2 |"] * len(rows) + ["s1 |"] * len(rows)


def test_policy_names():
    mod = plot_quality
    assert mod.method_of("local:64") == "window:64" and mod.method_of("sinks:4+60") == "sinks:4+60"
    assert [mod.decode_policy(m) for m in ("dense-ft", "dcp:g0.3", "window:64", "sinks:4+60", "strided:8")] == \
        ["dense", "dcp", "window:64", "sinks:4+60", None]


def test_fox_rows_from_an_inference_summary(tmp_path):
    """A FoX inference-plan folder (summary.json of plot_inference.py): one row per (policy, context), the
    eviction fraction as sparsity, the passkey accuracy at that length, ratios to the dense cache."""
    mod = plot_quality
    r = tmp_path / "fox"
    r.mkdir()
    quality = [dict(model="fox", policy="acp", ctx=8192, val_ppl=50.05, val_loss=3.9, ppl_ratio=1.0001,
                    evicted_fraction=0.93, live_tokens=573.4, provable=True, num_docs=4, tokens=32764, status="ok"),
               dict(model="fox", policy="window:256", ctx=8192, val_ppl=52.0, ppl_ratio=1.04, evicted_fraction=0.96875,
                    live_tokens=256.0, provable=True, status="ok"),
               dict(model="fox", policy="dense", ctx=8192, val_ppl=50.0, val_loss=3.89, status="ok",
                    companion_of="acp"),
               dict(model="fox", policy="acp", ctx=2048, val_ppl=None, status="timeout"),
               dict(model="pre", policy="window:256", ctx=1024, val_ppl=120.0, ppl_ratio=1.1, status="ok")]
    passkey = [dict(model="fox", policy="acp", accuracy=0.75, by_length={"2048": 1.0, "8192": 0.5, "16384": 0.25}),
               dict(model="fox", policy="dense", accuracy=0.75, by_length={"8192": 0.5})]
    (r / "summary.json").write_text(json.dumps({"meta": {"env": {"device": "NVIDIA H200", "jax": "0.11.2"}},
                                                "quality": quality, "passkey": passkey}))
    all_rows = mod.collect_fox_rows(str(r), model="fox-pro-125M", stage="fox-pro")
    # a passkey length without an evaluation at that context (none, or timed out: 2048) is a row of its own
    assert sorted((x["method"], x["context"], x["passkey_acc"]) for x in all_rows if x["ppl"] is None) == \
        [("acp", 2048, 1.0), ("acp", 16384, 0.25)]
    rows = {x["method"]: x for x in all_rows if x["ppl"] is not None}
    assert set(rows) == {"acp", "window:256", "dense"}  # the timed-out row and the GPT-2 row are not FoX rows
    acp = rows["acp"]
    assert (acp["context"], acp["sparsity"], acp["ppl_ratio"], acp["passkey_acc"]) == (8192, 0.93, 1.0001, 0.5)
    assert acp["provable"] is True and acp["live_tokens"] == 573.4 and not acp["fine_tuned"]
    assert rows["dense"]["sparsity"] == 0.0 and rows["dense"]["ppl_ratio"] == 1.0
    assert rows["window:256"]["passkey_acc"] is None  # passkey did not run for it
    out = tmp_path / "out"
    assert mod.main([str(r), "--model", "fox-pro-125M", "--stage", "fox-pro", "--rows", str(out / "rows.json"),
                     "--out-dir", str(out)]) == 0
    assert "| fox-pro-125M | 8192 | acp | no | 93.0 | 50.05 | 1.00010 (to dense) | 50 | fox-pro |" in \
        (out / "quality.md").read_text()
    # the figure: a panel for the evaluated context only, none for the passkey-only lengths (2048, 16384)
    assert mod._panels(all_rows) == [("fox-pro-125M", 8192, "fox-pro")]
