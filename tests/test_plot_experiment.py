"""benchmarks/plots/plot_experiment.py on the committed H200 experiment runs (benchmarks/results/quality/h200_archs)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "results" / "quality" / "h200_archs"


def _module():
    spec = importlib.util.spec_from_file_location("plot_experiment", ROOT / "benchmarks/plots/plot_experiment.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plots_and_table_from_run_directories(tmp_path, capsys):
    mod = _module()
    runs = [str(RUNS / n) for n in ("fox-pro", "fox-pro-acp", "fox-llama", "transformer-pro")]
    assert mod.main(runs + ["--out", str(tmp_path), "--reference", "transformer-pro"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "acp.png", "per_position.png", "per_position_vs_transformer-pro.png", "val_loss.png"]
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("| fox-pro-acp "))
    assert "| 300 | 19.7 | 4.4647 | 86.9 |" in row and row.endswith("| 68.1% |")     # from metrics.jsonl
    assert next(line for line in lines if line.startswith("| transformer-pro ")).endswith("| – |")


def test_binned_per_position_weights_by_count():
    mod = _module()
    n = 100
    xs, ys = mod.binned_per_position(dict(per_position_loss=[2.0] * n, per_position_count=[3] * n))
    assert xs == sorted(xs) and xs[0] == 1.0 and len(xs) < n and all(y == 2.0 for y in ys)
    # the last bin (several positions, among them the last) is dominated by the last position's count;
    # a missing (None) and a NaN loss are left out even with huge counts (else the mean would be ~3.5)
    loss, count = [1.0] * n, [1] * n
    loss[-1], count[-1] = 7.0, 10**6
    loss[-2], count[-2] = None, 10**6
    loss[-3], count[-3] = float("nan"), 10**6
    xs, ys = mod.binned_per_position(dict(per_position_loss=loss, per_position_count=count))
    assert 7.0 - 1e-3 < ys[-1] < 7.0 and xs[-1] < n  # a weighted mean of several positions, not position n alone
