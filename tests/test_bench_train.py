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
