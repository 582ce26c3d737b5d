"""``fox-jax generate`` and ``fox-jax eval --cache`` on a checkpointed run (the CLI end to end, CPU)."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from fox_jax.cache.policies import RING_BLOCK, HeuristicEvictionWarning
from fox_jax.decoding import generate, plan_serving
from fox_jax.train import cli
from fox_jax.train.evaluate import evaluate_run
from fox_jax.train.tokenizers import load_tokenizer
from test_runs import corpus, train_run  # noqa: F401 (pytest fixtures)


def _summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def documented_fields() -> dict[str, set[str]]:
    """The fields of the table "The JSON line of generate" in docs/cli.md, by mode ("batch", "serve")."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    section = text.split("### The JSON line of `generate`", 1)[1].split("\n#", 1)[0]
    out = {"batch": set(), "serve": set()}
    for row in re.findall(r"^\| (`.+?) \| ([^|]+) \|", section, re.M):
        for mode in out:
            if mode in row[1] or "both" in row[1]:
                out[mode] |= set(re.findall(r"`(\w+)`", row[0]))
    return out


def test_the_json_table_of_generate_is_complete():
    """Every field that generate's JSON line has (the keys written by train/generate.py) is in the docs'
    table, for the mode that writes it; the runs below check the lines they print against it too."""
    fields = documented_fields()
    source = (Path(__file__).resolve().parents[1] / "train" / "generate.py").read_text()
    for mode in ("batch", "serve"):
        block = source.split(f'"mode": "{mode}"', 1)[1].split("_finish(summary", 1)[0]
        written = set(re.findall(r'"(\w+)": ', block)) | {"command", "mode"}
        assert len(written) > 15 and written - fields[mode] == set(), f"undocumented {mode} fields (docs/cli.md)"


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["window:8", "acp"])  # a positional ring (rounded up to a block) and acp's
@pytest.mark.filterwarnings("ignore::fox_jax.cache.policies.HeuristicEvictionWarning")  # acp on the tiny run: asserted below (provable)
def test_generate_command_prints_text_and_one_json_line(train_run, capsys, policy):  # noqa: F811
    """``--cache`` reaches the engine: the summary's numbers and the Python API's tokens on the checkpoint.
    --cache parses with ``parse_policy`` (every form: test_decoding); dense through the command: the
    --prompt-file tests below; sinks: the engine tests of test_decoding and test_batching."""
    run, cfg, params = train_run
    argv = ["generate", str(run), "--prompt", "import os", "--prompt", "x = 1", "--cache", policy,
            "--max-new-tokens", "6", "--no-stop"]
    assert cli.main(argv) == 0
    s = _summary(capsys)
    assert s["command"] == "generate" and s["cache"] == policy and s["batch"] == 2 and s["new_tokens"] == [6, 6]
    assert set(s) <= documented_fields()["batch"], set(s) - documented_fields()["batch"]
    assert s["overflow"] == [0, 0] and s["tokens_per_s"] > 0
    assert 0 < s["kv_bytes_live"] <= s["kv_bytes_peak_live"] <= s["kv_bytes_allocated"]
    assert len(s["mean_live_tokens_per_layer"]) == cfg.model.n_layers
    # acp is provable only with QK-norm (the heuristic warns on stderr); the positional rules always are
    assert s["provable"] is (cfg.model.qk_norm if policy == "acp" else True)
    if policy.startswith("window"):  # a ring of W = 8 entries, rounded up to the decode kernel's block
        assert max(s["mean_live_tokens_per_layer"]) <= 8 and s["slots"] == RING_BLOCK
    # the same tokens as the Python API on the same checkpoint (step 4, the latest), prompts after <|endoftext|>
    tok = load_tokenizer(cfg.data.tokenizer)
    ids = [[tok.eot_id, *x] for x in tok.encode_batch(["import os", "x = 1"])]
    assert s["prompt_tokens"] == [len(x) for x in ids]
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
    assert "--kv-slots 4 is too small: --cache window:16 holds up to 16" in error(
        ["generate", run, "--prompt", "a", "--cache", "window:16", "--kv-slots", "4"])
    assert "--prompt #1: 2 + 64 tokens need" in error(["generate", run, "--prompt", "a", "--kv-budget", "1e-9"])
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "a"}\n\n["b"]\n')
    assert f"--prompt-file {jsonl} line 3: expected a JSON string or object" in error(["generate", run, "--prompt-file",
                                                                            str(jsonl)])
    jsonl.write_text('{"prompt": "a"}\n{"prompt": "' + "long " * 40 + '"}\n')  # 201 tokens with <|endoftext|>: a ring of 256
    assert f"--prompt-file {jsonl} line 2: 201 + 4 tokens need" in error(
        ["generate", run, "--prompt-file", str(jsonl), "--max-new-tokens", "4", "--kv-budget", "3e-5"])
    (tmp_path / "blank.jsonl").write_text("\n")
    assert "holds no prompt" in error(["generate", run, "--prompt-file", str(tmp_path / "blank.jsonl")])
    assert "needs a DCP model" in error(["generate", run, "--prompt", "a", "--cache", "dcp"])
    assert "at least one --prompt" in error(["generate", run])
    assert "--prompt-file" in error(["generate", run, "--prompt-file", str(tmp_path / "nope.txt")])
    (tmp_path / "empty.txt").write_text("\n")
    assert f"--prompt-file {tmp_path / 'empty.txt'} is empty" in error(["generate", run, "--prompt-file",
                                                                        str(tmp_path / "empty.txt")])
    assert "--max-new-tokens must be a positive int" in error(["generate", run, "--prompt", "a", "--max-new-tokens", "0"])
    # sampling flags are checked as flags, before anything is read
    assert "--top-p must be in (0, 1], got 1.5" in error(["generate", run, "--prompt", "a", "--temperature", "1",
                                                          "--top-p", "1.5"])
    assert "--top-k must be a positive int" in error(["generate", run, "--prompt", "a", "--temperature", "1",
                                                      "--top-k", "0"])
    assert "--top-k must be at most the model's 257 token ids" in error(["generate", run, "--prompt", "a",
                                                                        "--temperature", "1", "--top-k", "300"])
    assert "--temperature must be ≥ 0" in error(["generate", run, "--prompt", "a", "--temperature", "-1"])
    assert "--top-p samples, but --temperature 0 decodes greedily" in error(["generate", run, "--prompt", "a",
                                                                            "--top-p", "0.9"])
    assert "--mesh: unknown axis 'model'" in error(["generate", run, "--prompt", "a", "--mesh", "model=2"])
    # the flag the user gave, in the error of a bad value
    assert error(["generate", run, "--prompt", "a", "--cache", "window:abc"]).startswith(
        "fox-jax generate: error: --cache 'window:abc': W must be an int")
    assert error(["generate", run, "--prompt", "a", "--step", "7"]) == (
        f"fox-jax generate: error: --step: no checkpoint for step 7 in {run}/checkpoints; available steps: 2, 4")
    assert error(["generate", run, "--prompt-file", str(tmp_path)]) == (
        f"fox-jax generate: error: --prompt-file {tmp_path} is a directory; give a file: its text is one prompt, or "
        "a .jsonl file of one prompt per line")


def test_eval_errors_name_the_flags(train_run, capsys):  # noqa: F811
    run = str(train_run[0])

    def error(argv) -> str:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err.removeprefix("fox-jax eval: error: ")

    assert error(["eval", "--workdir", run, "--step", "7"]) == (
        f"--step: no checkpoint for step 7 in {run}/checkpoints; available steps: 2, 4")
    assert error(["eval", "--workdir", run, "--cache", "window:abc"]).startswith("--cache 'window:abc': W must be")
    assert error(["eval", "--workdir", run, "--cache", "lru"]).startswith("--cache: unknown cache policy 'lru'")
    # eval reads only the validation text: the error names it and the flag (the key for a key=value override)
    err = error(["eval", "--workdir", run, "--seq-len", "100000000"])
    assert re.fullmatch(r"the validation text \(held out of the training text\) has [\d,]+ tokens, but --seq-len "
                        r"100000000 needs at least 100,000,001 \(a window and its next token\); pass more text "
                        r"\(--val-data\) or a smaller --seq-len", err), err
    err = error(["eval", "--workdir", run, "data.seq_len=100000000"])
    assert "but data.seq_len 100000000 needs" in err and "a smaller data.seq_len" in err


def _serve_under_budget(train_run, tmp_path):  # noqa: F811
    """A .jsonl --prompt-file of 5 prompts (JSON strings and {"prompt": ...} objects) and the argv of a greedy
    generate of 6 tokens each; with the --kv-budget of 2.5 rows (those prompts, dense) that serves them."""
    run, cfg, params = train_run
    texts = ["import os", "x = 1", "def f(a):", "print(", "class A:"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t} if i % 2 else t) for i, t in enumerate(texts)) + "\n\n")
    tok = load_tokenizer(cfg.data.tokenizer)
    ids = [[tok.eot_id, *x] for x in tok.encode_batch(texts)]
    row = plan_serving(cfg.model.build(), params[4], ids, max_new_tokens=6).row_bytes
    argv = ["generate", str(run), "--prompt-file", str(prompts), "--max-new-tokens", "6", "--no-stop"]
    return texts, ids, row, argv, ["--kv-budget", repr(2.5 * row / 2 ** 30)]


def test_generate_prompt_file_serves_under_a_kv_budget(train_run, capsys, tmp_path):  # noqa: F811
    """5 prompts under a --kv-budget of 2.5 rows: continuous batching over 2 rows, each continuation printed
    under its prompt in file order, a progress bar over the requests on stderr, the JSON line's serving numbers
    (the tokens equal generating each prompt alone: test_batching; the same text as one batch: the slow test
    below). Under a budget of 40 rows the 5 prompts run as one batch of 5 rows of the same pool (it had filled the
    budget: 8× the memory)."""
    texts, ids, row, argv, budget = _serve_under_budget(train_run, tmp_path)
    assert cli.main(argv + budget) == 0
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    assert "\r" not in out.err  # the serve bar is drawn on a terminal only
    for i, (text, x) in enumerate(zip(texts, ids), start=1):  # numbered from 1, as the errors (--prompt #1)
        at = lines.index(f"--- prompt {i} ({len(x)} tokens) ---")
        assert lines[at + 1] == text and lines[at + 2] == "--- generated (6 tokens) ---"
    s = json.loads(lines[-1])
    assert s["mode"] == "serve" and s["requests"] == 5 and s["batch"] == 2 and s["new_tokens"] == [6] * 5
    assert set(s) <= documented_fields()["serve"], set(s) - documented_fields()["serve"]
    assert s["prompt_tokens"] == [len(x) for x in ids] and s["kv_bytes_allocated"] == 2 * row
    assert s["requests_per_s"] > 0 and s["tokens_per_s"] > 0 and s["decode_tokens_per_s"] > 0
    assert 0 < s["kv_bytes_live_mean"] < s["kv_bytes_allocated"] and s["overflow"] == [0] * 5 and s["provable"]
    # a budget that holds every prompt: one batch whose rows get the pool serve gives a row, not the whole budget
    assert cli.main(argv + ["--kv-budget", repr(40 * row / 2 ** 30), "--no-progress"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["mode"] == "batch" and s["kv_bytes_allocated"] == 5 * row, (s["mode"], s["kv_bytes_allocated"], row)


@pytest.mark.slow
def test_generate_prompt_file_serves_the_text_of_one_batch(train_run, capsys, tmp_path):  # noqa: F811
    """The continuations printed by continuous batching (2 rows) equal those of decoding the 5 prompts in one
    batch (no budget)."""
    _, _, _, argv, budget = _serve_under_budget(train_run, tmp_path)
    assert cli.main(argv + budget + ["--no-progress"]) == 0
    served = capsys.readouterr().out.strip().splitlines()
    assert cli.main(argv) == 0
    batch = capsys.readouterr().out.strip().splitlines()
    assert json.loads(served[-1])["mode"] == "serve" and json.loads(batch[-1])["mode"] == "batch"
    assert served[:-1] == batch[:-1]


@pytest.mark.slow
def test_eval_cache_scores_the_policy_next_to_dense(train_run, capsys):  # noqa: F811
    run = str(train_run[0])
    assert cli.main(["eval", "--workdir", run, "--cache", "window:4", "--num-docs", "2"]) == 0
    out = capsys.readouterr().out
    assert "document starts" in out.splitlines()[0] and "not of its val_ppl" in out  # names its tokens
    s = json.loads(out.strip().splitlines()[-1])
    assert s["cache"] == "window:4" and 1 <= s["num_docs"] <= 2 and s["dense_tokens"] == s["policy_tokens"] > 0
    assert s["policy_overflow_rows"] == 0 and s["ppl_ratio"] == pytest.approx(s["policy_ppl"] / s["dense_ppl"])
    assert s["provable"] is True
    assert s["policy_ppl"] != s["dense_ppl"]  # a 4-token window changes the predictions of a 16-token context
    # what the caches hold after each window's last token: all T for dense, the 4 newest for the window
    t = s["seq_len"]
    assert s["dense_live_tokens"] == t and s["dense_evicted_fraction"] == 0.0
    assert s["policy_live_tokens"] == 4 and s["policy_evicted_fraction"] == pytest.approx(1 - 4 / t, abs=1e-12)
    assert cli.main(["eval", "--workdir", run, "--cache", "dense", "--num-docs", "2"]) == 0
    s = _summary(capsys)
    assert s["ppl_ratio"] == 1.0


def test_generate_names_max_new_tokens_beyond_the_positions(tmp_path, capsys):
    """A GPT-2 of 64 learned positions (zero weights, nothing compiled): the error names the flag."""
    import jax

    from fox_jax.models import GPT2Config
    from fox_jax.models.hf_gpt2 import save_hf_gpt2
    from test_runs import GPT2_TINY

    cfg = GPT2Config(**GPT2_TINY)
    params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(cfg.init_params, jax.random.PRNGKey(0)))
    save_hf_gpt2(cfg, params, tmp_path / "hf")
    assert cli.main(["generate", str(tmp_path / "hf"), "--tokenizer", "bytes", "--prompt", "abc",
                     "--max-new-tokens", "100"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the longest prompt (4 tokens with <|endoftext|>) and --max-new-tokens 100 " \
        "need 103 positions; the model has 64" in err, err


def _heuristic_warning(record):
    hits = [w for w in record if issubclass(w.category, HeuristicEvictionWarning)]
    assert len(hits) == 1, [str(w.message) for w in record]
    return hits[0]


def test_acp_heuristic_warning_names_the_callers_line(train_run, tmp_path):  # noqa: F811
    """acp on the tiny FoX (no QK-norm) warns that it is a heuristic; the warning names the line of the user's
    call, through fox_jax.decoding.generate and through evaluate_run(cache=...) (the Python side of
    ``fox-jax eval --cache``), not a file of fox_jax."""
    run, cfg, params = train_run
    with pytest.warns(HeuristicEvictionWarning) as record:
        generate(cfg.model.build(), params[4], [[256, 105, 109]], max_new_tokens=1, policy="acp")
    assert _heuristic_warning(record).filename == __file__
    with pytest.warns(HeuristicEvictionWarning) as record:
        evaluate_run(str(run), cache="acp", num_docs=1)
    assert _heuristic_warning(record).filename == __file__
