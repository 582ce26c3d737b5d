"""benchmarks/bench_decode.py's rows in issue 20's keys: the bound, ms per step, the merge of several calls and
the ratios to dense across them (pure Python: no model runs)."""

import json
import math

import pytest

from bench_decode import issue_row, markdown_rows, write_rows


def bench_row(policy, batch, seconds, prefill, live_mean, mode="equal-batch", **kw):
    return dict(mode=mode, policy=policy, provable=True, prompt_len=100, new_tokens=11, batch=batch,
                seconds=seconds, prefill_seconds=prefill, tokens_per_sec=batch * 11 / seconds,
                decode_tokens_per_sec=batch * 10 / (seconds - prefill), kv_allocated_bytes=4 * live_mean,
                kv_live_bytes=live_mean, kv_live_bytes_mean=live_mean, capacity=128.0, live_tokens_mean=5.0,
                sparsity_final=0.5, overflow=0, **kw)


def test_issue_rows_bound_step_and_merge(tmp_path):
    dev = dict(device="cpu", jax="x", dtype="bfloat16", date="d")
    # 10 decode steps in 0.5 − 0.1 s: 40 ms a step; the bound reads 3.6e9 + 1.2e9 bytes at 4.8 TB/s: 1 ms
    dense = issue_row(bench_row("dense", 8, 0.5, 0.1, 1.2e9), "m", int(3.6e9), 4.8, dev)
    assert dense["ms_per_step"] == pytest.approx(40.0)
    assert dense["bound_ms_per_step"] == pytest.approx(1.0)
    assert dense["bound_tokens_per_s"] == pytest.approx(8 / 1e-3)
    assert dense["fraction_of_bound"] == pytest.approx(1.0 / 40.0)
    assert {"model", "policy", "batch", "prompt", "new_tokens", "decode_tokens_per_s", "tokens_per_s",
            "bound_tokens_per_s", "kv_bytes_allocated", "kv_bytes_live", "ms_per_step"} <= set(dense)
    path = tmp_path / "rows.json"
    write_rows(str(path), [dense])
    # a later call: acp at the same shape (its ratios come from the first call's dense row) and an error row
    acp = issue_row(bench_row("acp", 8, 0.3, 0.1, 0.1e9), "m", int(3.6e9), 4.8, dev)
    err = issue_row(dict(mode="kv-budget", policy="sinks:4+252", prompt_len=100, error="OOM"), "m", 1, 4.8, dev)
    write_rows(str(path), [acp, err])
    rows = {r["policy"]: r for r in json.loads(path.read_text())}
    assert set(rows) == {"dense", "acp", "sinks:4+252"}
    assert rows["acp"]["step_vs_dense"] == pytest.approx(20.0 / 40.0)
    assert rows["acp"]["decode_vs_dense"] == pytest.approx(2.0)
    assert rows["sinks:4+252"]["decode_vs_dense"] is None and rows["sinks:4+252"]["error"] == "OOM"
    # the same key again replaces, never duplicates
    write_rows(str(path), [issue_row(bench_row("acp", 8, 0.2, 0.1, 0.1e9), "m", int(3.6e9), 4.8, dev)])
    rows = json.loads(path.read_text())
    assert len(rows) == 3 and [r["ms_per_step"] for r in rows if r["policy"] == "acp"] == [pytest.approx(10.0)]
    table = markdown_rows(str(path)).splitlines()
    assert len(table) == 2 + 3 and "| acp | 8 |" in table[3] and "error: OOM" in table[4]


def test_rows_file_empty_or_not_a_list(tmp_path):
    from bench_decode import parse_args, read_rows

    empty = tmp_path / "empty.json"
    empty.write_text("")  # what DECODE_ROWS=/dev/null leaves: no rows, not an error
    assert read_rows(str(empty)) == [] and read_rows(str(tmp_path / "missing.json")) == []
    write_rows(str(empty), [dict(model="m", mode="equal-batch", policy="acp", prompt=8)])
    assert [r["policy"] for r in json.loads(empty.read_text())] == ["acp"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"policy": "dense"}')
    with pytest.raises(SystemExit, match="--rows-out .*bad.json: expected a JSON list"):
        parse_args(["--rows-out", str(bad)])  # refused before anything compiles
    assert bad.read_text() == '{"policy": "dense"}'


def test_the_bound_reads_the_device_bandwidth(monkeypatch):
    from types import SimpleNamespace

    from bench_decode import bound_bandwidth, parse_args
    from fox_jax.train.metrics import device_peak_bandwidth

    card = lambda kind: SimpleNamespace(device_kind=kind)  # noqa: E731
    assert device_peak_bandwidth(card("NVIDIA H200")) == 4.8e12
    assert device_peak_bandwidth(card("NVIDIA H100 80GB HBM3")) == 3.35e12  # SXM
    assert device_peak_bandwidth(card("NVIDIA H100 PCIe")) == 2.0e12  # not the SXM card's figure
    assert device_peak_bandwidth(card("cpu")) is None
    assert bound_bandwidth(3.0) == 3.0
    monkeypatch.setattr("fox_jax.train.metrics.device_peak_bandwidth", lambda: 3.35e12)
    assert bound_bandwidth(None) == 3.35  # the device's
    monkeypatch.setattr("fox_jax.train.metrics.device_peak_bandwidth", lambda: None)
    assert bound_bandwidth(None) == 4.8  # no figure (a CPU): the H200's
    with pytest.raises(SystemExit, match="--bandwidth"):
        parse_args(["--bandwidth", "0"])


def test_bench_decode_device_times_quick_run(tmp_path):
    # --device-times: each equal-batch row also gets the kernels' time per decode step from two traces (here the
    # CPU's thunks); budget rows are not traced; the docs' table shows the column and its ratio to dense
    import bench_decode

    rows_out = tmp_path / "rows.json"
    bench_decode.main(["--quick", "--device-times", "--policies", "dense,window:16", "--out", str(tmp_path / "b.json"),
                       "--rows-out", str(rows_out)])
    rows = json.loads(rows_out.read_text())
    equal = [r for r in rows if r["mode"] == "equal-batch"]
    assert {r["policy"] for r in equal} == {"dense", "window:16"}
    assert all(math.isfinite(r["device_ms_per_step"]) and r["device_time_source"] == "cpu" for r in equal)
    assert all(r["device_ms_per_step"] is None for r in rows if r["mode"] == "kv-budget")
    window = next(r for r in equal if r["policy"] == "window:16")
    dense = next(r for r in equal if r["policy"] == "dense")
    assert window["device_step_vs_dense"] == pytest.approx(window["device_ms_per_step"] / dense["device_ms_per_step"])
    header, _, *lines = markdown_rows(str(rows_out)).splitlines()
    assert "| device ms/step |" in header and "×dense device step" in header
    assert all(line.count("|") == header.count("|") for line in lines)


def test_profile_decode_quick_run(tmp_path):
    # benchmarks/profile_decode.py end to end: the trace is read, the step's kernels counted, the bound's
    # bandwidth recorded (the device's figure; a CPU has none: the H200's)
    import profile_decode
    from bench_decode import bound_bandwidth

    out = tmp_path / "p.json"
    profile_decode.main(["--quick", "--model", "fox-pro:tiny", "--policies", "acp", "--slot-multiple", "128",
                         "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["slots"] == 128 and row["overflow"] == 0  # the pool (21 by default here) rounded up to the multiple
    assert row["policy"] == "acp" and row["bandwidth_tb_s"] == bound_bandwidth(None)
    # device time per step is the difference of two traces (N steps minus 1): on a loaded CPU its sign is noise
    # (−0.45 ms once in the suite, the host's elementwise events of the 1-step run being slower), so only finite
    assert row["kernels_per_step"] > 0 and math.isfinite(row["device_ms_per_step"]) and row["compile_s"] > 0
    assert set(row["per_step_ms"]) >= {"attention", "gemm", "elementwise"}


def test_profile_decode_kernel_variants_are_checked(capsys):
    """``profile_decode.py --kernel-variants``: tilings take ints, the kernel's switches 0 or 1, ``gates`` / ``head``
    their words; anything else is refused in one line naming the flag, before a model is built."""
    import profile_decode

    assert profile_decode.parse_kernel_variant("v:num_warps=2,late_writes=0,early_epilogue=1,gates=xla") == (
        "v", {"num_warps": 2, "late_writes": False, "early_epilogue": True, "gates": "xla"})
    for spec, why in (("v:late_writes=2", "late_writes takes 0 or 1"), ("v:num_warps=two", "num_warps takes an int"),
                      ("v:head=tied", "head takes stored or padded"), ("v:warps=2", "expected key=value with key in")):
        with pytest.raises(SystemExit):
            profile_decode.main(["--kernel-variants", spec])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert ": error: --kernel-variants" in err and why in err, err


def test_mesh_flag_is_checked_before_anything_runs():
    """``--mesh`` (sharded decoding): a mesh these devices cannot form, one that does not split --equal-batch, and a
    KV budget beside it are refused in one line naming the flag (no model loaded); sharded rows keep their mesh."""
    from bench_decode import parse_args

    for argv, flag in ((["--mesh", "data=2"], "--mesh: .* needs 2 devices, have 1"),
                       (["--mesh", "model=1"], "--mesh: unknown axis 'model'"),
                       (["--mesh", "data=1", "--kv-budget", "1"], "--kv-budget: not with --mesh"),
                       (["--mesh", "fsdp=1", "--equal-batch", "4"], None)):
        if flag is None:
            assert parse_args(argv).mesh == "fsdp=1"
            continue
        with pytest.raises(SystemExit, match=flag):
            parse_args(argv)
    row = issue_row(bench_row("dense", 8, 1.0, 0.5, 10, mesh="data=4", devices=4), "m", 100, 4.8, {})
    assert (row["mesh"], row["devices"]) == ("data=4", 4)
    assert "mesh" not in issue_row(bench_row("dense", 8, 1.0, 0.5, 10), "m", 100, 4.8, {})
