"""The README's Python API snippet runs as written (with a one-layer tiny model instead of 125M, for speed)."""

from pathlib import Path

import pytest

from fox_jax.cache.policies import HeuristicEvictionWarning

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_snippet_runs():
    text = README.read_text()
    block = text.split("## Python API")[1].split("```python")[1].split("```")[0]
    assert 'preset("125M", "fox-llama", dtype="bfloat16")' in block
    namespace = {}
    # the tiny model with one layer (the snippet's calls are eager: each layer adds compilations, not checks)
    exec(block.replace('preset("125M", "fox-llama", dtype="bfloat16")',
                       'preset("tiny", "fox-llama", dtype="bfloat16", n_layers=1)'), namespace)
    assert namespace["logits"].shape == (2, 512, 50257)
    assert namespace["o"].shape == namespace["q"].shape


@pytest.mark.slow
def test_readme_generation_snippet_runs(tmp_path, monkeypatch, capsys):
    """The README's generation snippet runs as written on a run of the README's first command (shortened to
    3 steps of a one-layer tiny model on a small text, so the continuation is noise: only its length is
    checked)."""
    from fox_jax.train import cli

    text = README.read_text()
    block = text.split("## Train, evaluate, generate")[1].split("```python")[1].split("```")[0]
    assert 'open_run("runs/tiny")' in block
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n<|endoftext|>\n".join(f.read_text() for f in sorted(README.parent.glob("fox_jax/ops/*.py"))))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--preset", "tiny", "--workdir", "runs/tiny", "--no-progress", "--steps", "3",
                     "log_every=1", "eval_every=0", "model.n_layers=1", "--data", str(corpus)]) == 0
    assert "note: the run's 3 steps are no longer than its warmup (warmup_steps 30)" in capsys.readouterr().err
    namespace = {}
    with pytest.warns(HeuristicEvictionWarning, match="heuristic"):  # acp on the tiny preset (no QK-norm): README says so
        exec(block, namespace)
    assert len(namespace["out"].tokens[0]) == 60
