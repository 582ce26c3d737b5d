"""benchmarks/bench_train.py --params-from: the timed steps start from a trained run's parameters."""

import json

import pytest

from fox_jax.train import cli


@pytest.mark.slow
def test_params_from_a_run(tmp_path):
    """A 2-step tiny FoX (Pro) run's parameters feed the quick benchmark (the row names the run, its loss is not
    a fresh init's on the same tokens); a config of
    other shapes (Transformer (Pro)) gets an error row naming the flag and the first array that differs, and a
    directory that is no run is refused by name."""
    import bench_train  # benchmarks/ is on the tests' path (pyproject.toml)

    run = tmp_path / "run"
    assert cli.main(["train", "--preset", "tiny", "--arch", "fox-pro", "--workdir", str(run), "--steps", "2",
                     "--no-progress", "--eval-every", "0"]) == 0
    out = tmp_path / "rows.json"
    bench_train.main(["--quick", "--acp", "both", "--params-from", str(run), "--out", str(out)])
    rows = {(r["arch"], r["acp"]): r for r in json.loads(out.read_text())["rows"]}
    for acp in (False, True):
        assert rows[("fox-pro", acp)]["params_from"] == str(run) and "error" not in rows[("fox-pro", acp)]
    fresh = tmp_path / "fresh.json"
    bench_train.main(["--quick", "--acp", "off", "--out", str(fresh)])
    (init,) = [r for r in json.loads(fresh.read_text())["rows"] if r["arch"] == "fox-pro"]
    assert init["params_from"] == "init" and init["loss"] != rows[("fox-pro", False)]["loss"]  # the run's weights
    err = rows[("transformer-pro", False)]["error"]
    assert err.startswith("ValueError: --params-from") and "same arch and size" in err
    with pytest.raises(FileNotFoundError, match="--params-from"):
        bench_train.trained_params(str(tmp_path / "nothing"), None)


def test_gpt2_dcp_rows_time_the_dcp_finetune_step(tmp_path):
    """``gpt2-dcp:SIZE:T`` (issue 24's DCP fine-tune row): GPT-2 with fresh interaction weights under the DCP
    fine-tune's task (``DCPTask``: the log mask, the sparsity regulariser, α of step 0 as a traced scalar), here
    shrunk by --overrides to two small layers; its bad forms are refused by name, before anything compiles."""
    import bench_train

    from fox_jax.train.finetune_dcp import DCPTask

    cfg, task = bench_train.experiment("gpt2-dcp", "124M", 128, False, 2, dict(dtype="float32"))
    assert isinstance(task, DCPTask) and cfg.model.dcp and cfg.data.seq_len == 128 and set(task.host_scalars(0)) == {
        "alpha", "gamma_eff"}
    for size, seq, acp, what in (("7B", 128, False, "takes size 124M"), ("124M", 128, True, "no ACP"),
                                 ("124M", 2048, False, "reads at most 1024 tokens")):
        with pytest.raises(ValueError, match=what):
            bench_train.experiment("gpt2-dcp", size, seq, acp, 2, {})
    out = tmp_path / "rows.json"
    bench_train.main(["--configs", "gpt2-dcp:124M:64", "--steps", "1", "--warmup", "0", "--batch-tokens", "128",
                      "--dtype", "float32", "--overrides", "n_layers=1,d_model=64,n_heads=2", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row and row["arch"] == "gpt2-dcp" and row["batch"] == 2 and row["loss"] > 0
