"""benchmarks/plot_experiment.py on the committed H200 experiment runs (benchmarks/results/experiment_small)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "results" / "experiment_small"


def _module():
    spec = importlib.util.spec_from_file_location("plot_experiment", ROOT / "benchmarks" / "plot_experiment.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plots_and_table_from_run_directories(tmp_path, capsys):
    mod = _module()
    runs = [str(RUNS / n) for n in ("fox-pro", "fox-pro-acp", "fox-llama", "transformer-pro")]
    assert mod.main(runs + ["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acp.png", "per_position.png", "val_loss.png"]
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("| fox-pro-acp "))
    assert "| 250 | 16.4 | 4.6040 | 99.9 |" in row and row.endswith("| 64.5% |")     # from metrics.jsonl
    assert next(line for line in lines if line.startswith("| transformer-pro ")).endswith("| – | – |")
