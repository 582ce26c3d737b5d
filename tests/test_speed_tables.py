"""benchmarks/plots/speed_tables.py on small synthetic benchmark JSON (issue 22's two tables)."""

import json

from plots import speed_tables  # benchmarks/ is on the tests' path (pyproject.toml)

DEVICE = "NVIDIA H100 80GB HBM3"


def _attention(tmp_path, fox=9.0):
    impls = {"cudnn": 7.5, "mosaic": fox, "mosaic-seg": 9.3, "mosaic-acp": 2.0, "fox-triton": 12.0,
             "fox-triton-acp": 4.0}
    doc = {"versions": {"device": DEVICE, "jax": "0.11.2"},
           "results": [{"shape": {"B": 1, "T": 16384, "H": 16, "D": 128}, "acp_fraction_skipped": {"fwd": 0.8},
                        "impls": {k: {"fwd": v / 3, "fwd_bwd": v, "bwd": 2 * v / 3} for k, v in impls.items()}},
                       {"shape": {"B": 8, "T": 2048, "H": 16, "D": 128},
                        "impls": {"cudnn": {"fwd_bwd": 1.2}, "pallas": {"fwd_bwd": 1.8}}}]}
    path = tmp_path / "attention.json"
    path.write_text(json.dumps(doc))
    return path


def _dcp(tmp_path):
    rows = [{"shape": {"B": 1, "T": 16384, "H": 16, "D": 128}, "target_sparsity": s, "sparsity": s + 0.01,
             "ms": {"pallas|fwd_bwd": ms, "dense pallas (no mask)|fwd_bwd": 11.0},
             "ratio_vs_dense": {"pallas|fwd_bwd": ms / 11.0}}
            for s, ms in ((0.5, 12.0), (0.9, 4.5))]
    path = tmp_path / "dcp.json"
    path.write_text(json.dumps({"versions": {"device": DEVICE}, "rows": rows}))
    return path


def _train(tmp_path, name, step_ms, acp=False, params_from="init", device=DEVICE, **extra):
    row = {"arch": "fox-pro", "size": "760M", "seq_len": 16384, "acp": acp, "batch": 1, "step_ms": step_ms,
           "tokens_per_sec": 16384 / step_ms * 1e3, "mfu": 0.3, "compile_s": 19.0, "params_from": params_from,
           **extra}
    path = tmp_path / name
    path.write_text(json.dumps({"meta": {"device": device, "jax": "0.11.2"},
                                "rows": [row, {"arch": "fox-pro", "size": "125M", "error": "OOM"}]}))
    return path


def test_rows_carry_the_issue_keys_and_ratios(tmp_path, capsys):
    out = tmp_path / "out"
    assert speed_tables.main(["--attention", str(_attention(tmp_path)), "--dcp", str(_dcp(tmp_path)),
                              "--train", str(_train(tmp_path, "t.json", 430.0)), "--out-dir", str(out)]) == 0
    att = json.loads((out / "attention_h100.json").read_text())
    big = next(r for r in att if r["T"] == 16384)
    assert (big["fox_ms"], big["fox_impl"], big["cudnn_ms"], big["fox_seg_ms"]) == (9.0, "mosaic", 7.5, 9.3)
    assert (big["fox_acp_ms"], big["official_ms"], big["official_acp_ms"]) == (2.0, 12.0, 4.0)
    assert big["dcp_ms"] == {"0.5": 12.0, "0.9": 4.5} and big["dcp_sparsity"] == {"0.5": 0.51, "0.9": 0.91}
    assert big["fox_over_cudnn"] == 1.2 and big["acp_over_official_acp"] == 0.5
    assert big["dcp_over_fox"] == {"0.5": 12.0 / 9.0, "0.9": 0.5}
    assert big["dcp_over_dense_pallas"] == {"0.5": 12.0 / 11.0, "0.9": 4.5 / 11.0}  # bench_dcp's own dense
    small = next(r for r in att if r["T"] == 2048)  # no Mosaic timing: the Triton kernels are "auto" there
    assert small["fox_impl"] == "pallas" and small["fox_ms"] == 1.8 and small["official_ms"] is None
    assert small["dcp_ms"] is None
    train = json.loads((out / "train_h100.json").read_text())
    assert len(train) == 1  # the error row is left out
    assert {"arch", "size", "seq_len", "acp", "mfu", "tokens_per_s", "step_ms", "compile_s"} <= set(train[0])
    printed = capsys.readouterr().out
    assert "| B1 T16384 H16 D128 | 7.500 | 9.000 | 1.20 |" in printed
    assert "NVIDIA H100 80GB HBM3; jax" in printed  # each table says where it was measured


def test_merge_grows_the_tables_over_calls(tmp_path):
    out = tmp_path / "out"
    speed_tables.main(["--train", str(_train(tmp_path, "a.json", 480.0)), "--out-dir", str(out)])
    speed_tables.main(["--train", str(_train(tmp_path, "b.json", 240.0, acp=True, params_from="/run")),
                       "--out-dir", str(out), "--merge"])
    speed_tables.main(["--train", str(_train(tmp_path, "c.json", 430.0)), "--out-dir", str(out), "--merge"])
    rows = json.loads((out / "train_h100.json").read_text())
    assert sorted(r["step_ms"] for r in rows) == [240.0, 430.0]  # the re-measured row replaced, the other kept
    assert "| fox-pro | 760M | 16384 | auto | trained | 240.0 |" in (out / "speed_h100.md").read_text()


def test_rows_of_a_merged_file_keep_their_tree_call_and_date(tmp_path, capsys):
    path = _train(tmp_path, "merged.json", 481.0, tree="abc", call="15:57", date="2026-12-01")
    assert speed_tables.main(["--train", str(path), "--out-dir", str(tmp_path / "o"), "--date", "2030-01-01"]) == 0
    row = json.loads((tmp_path / "o" / "train_h100.json").read_text())[0]
    assert (row["tree"], row["call"], row["date"]) == ("abc", "15:57", "2026-12-01")
    assert "| abc | 15:57 |" in capsys.readouterr().out


def test_bad_input_is_one_line_naming_the_flag(tmp_path, capsys):
    out = ["--out-dir", str(tmp_path / "o")]
    assert speed_tables.main(["--train", str(tmp_path / "none.json"), *out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("--train: ") and err.strip().endswith("no such file") and err.count("\n") == 1
    assert speed_tables.main(["--attention", str(_train(tmp_path, "t.json", 430.0)), *out]) == 2  # a train file
    assert "not bench_attention.py output" in capsys.readouterr().err
    (tmp_path / "rows.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    assert speed_tables.main(["--train", str(tmp_path / "rows.jsonl"), *out]) == 2
    assert "--train: " in (err := capsys.readouterr().err) and "not a JSON document" in err
    assert speed_tables.main(["--train", str(tmp_path), *out]) == 2  # a folder
    assert "not a file" in capsys.readouterr().err
    assert speed_tables.main(["--dcp", str(_dcp(tmp_path)), "--train", str(_train(tmp_path, "t.json", 430.0)),
                              *out]) == 2
    assert "--dcp: " in capsys.readouterr().err
    other = _train(tmp_path, "h200.json", 400.0, device="NVIDIA H200")  # two devices: never one mislabelled table
    assert speed_tables.main(["--attention", str(_attention(tmp_path)), "--train", str(other), *out]) == 2
    assert "different devices" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing written on refusal
    assert speed_tables.main(["--out-dir", str(tmp_path)]) == 2
    assert "--attention or --train" in capsys.readouterr().err
