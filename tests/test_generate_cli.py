"""``fox-jax generate`` and ``fox-jax eval --cache`` on a checkpointed run (the CLI end to end, CPU)."""

import json

import numpy as np
import pytest

from fox_jax.decoding import generate
from fox_jax.train import cli
from fox_jax.train.tokenizers import load_tokenizer
from test_runs import corpus, train_run  # noqa: F401 (pytest fixtures)


def _summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dense", "window:8", "sinks:2+6", "acp"])
def test_generate_command_prints_text_and_one_json_line(train_run, capsys, policy):  # noqa: F811
    run, cfg, params = train_run
    argv = ["generate", str(run), "--prompt", "import os", "--prompt", "x = 1", "--cache", policy,
            "--max-new-tokens", "6", "--no-stop"]
    assert cli.main(argv) == 0
    s = _summary(capsys)
    assert s["command"] == "generate" and s["cache"] == policy and s["batch"] == 2 and s["new_tokens"] == [6, 6]
    assert s["overflow"] == [0, 0] and s["tokens_per_s"] > 0
    assert 0 < s["kv_bytes_live"] <= s["kv_bytes_peak_live"] <= s["kv_bytes_allocated"]
    assert len(s["mean_live_tokens_per_layer"]) == cfg.model.n_layers
    if policy.startswith("window"):
        assert max(s["mean_live_tokens_per_layer"]) <= 8 and s["slots"] == 8
    # the same tokens as the Python API on the same checkpoint (step 4, the latest)
    tok = load_tokenizer(cfg.data.tokenizer)
    ids = tok.encode_batch(["import os", "x = 1"])
    width = max(map(len, ids))
    prompt = np.full((2, width), tok.eot_id, np.int32)
    for i, x in enumerate(ids):
        prompt[i, width - len(x):] = x
    want = generate(cfg.model.build(), params[4], prompt, max_new_tokens=6, policy=policy,
                    seq_start=[width - len(x) for x in ids])
    assert s["new_tokens"] == np.asarray(want.lengths).tolist()


def test_generate_command_errors(train_run, capsys, tmp_path):  # noqa: F811
    run = str(train_run[0])

    def error(argv) -> str:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    assert "unknown cache policy 'lru'" in error(["generate", run, "--prompt", "a", "--cache", "lru"])
    assert "too small for one sequence" in error(["generate", run, "--prompt", "a", "--cache", "window:16",
                                                 "--kv-slots", "4"])
    assert "too small for one sequence" in error(["generate", run, "--prompt", "a", "--kv-budget", "1e-9"])
    assert "needs a DCP model" in error(["generate", run, "--prompt", "a", "--cache", "dcp"])
    assert "at least one --prompt" in error(["generate", run])
    assert "--prompt-file" in error(["generate", run, "--prompt-file", str(tmp_path / "nope.txt")])
    assert "--max-new-tokens must be a positive int" in error(["generate", run, "--prompt", "a", "--max-new-tokens", "0"])


@pytest.mark.slow
def test_eval_cache_scores_the_policy_next_to_dense(train_run, capsys):  # noqa: F811
    run = str(train_run[0])
    assert cli.main(["eval", "--workdir", run, "--cache", "window:4", "--num-docs", "2"]) == 0
    s = _summary(capsys)
    assert s["cache"] == "window:4" and 1 <= s["num_docs"] <= 2 and s["dense_tokens"] == s["policy_tokens"] > 0
    assert s["policy_overflow_rows"] == 0 and s["ppl_ratio"] == pytest.approx(s["policy_ppl"] / s["dense_ppl"])
    assert s["policy_ppl"] != s["dense_ppl"]  # a 4-token window changes the predictions of a 16-token context
    assert cli.main(["eval", "--workdir", run, "--cache", "dense", "--num-docs", "2"]) == 0
    s = _summary(capsys)
    assert s["ppl_ratio"] == 1.0
