"""``fox-jax passkey``: prompt construction, scoring, run_passkey end to end on a tiny random model, the
heatmap, and the command (on a tiny checkpointed run) with its error paths."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import pytest

from fox_jax import decoding
from fox_jax.models import GPT2Config
from fox_jax.models.hf_gpt2 import save_hf_gpt2
from fox_jax.train import cli, config as config_lib, passkey as pk
from fox_jax.train.tokenizers import ByteTokenizer, load_tokenizer
from test_cli_ux import HEAVY, _PROBE
from test_runs import GPT2_TINY, corpus, train_run  # noqa: F401 (corpus, train_run: pytest fixtures)

SHARED = Path(os.environ.get("FOX_JAX_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
GUTENBERG = SHARED / "corpus_val" / "gutenberg_val.txt"
GPT2_BPE = SHARED / "tokenizers" / "gpt2"
needs_shared = pytest.mark.skipif(not (GUTENBERG.is_file() and (GPT2_BPE / "vocab.json").is_file()),
                                  reason="needs the shared data (set FOX_JAX_SHARED_DATA)")

BYTES = ByteTokenizer()
_WORDS = ("cat", "river", "lamp", "stone", "garden", "horse", "window", "bread", "cloud", "letter")


def synthetic_text(n_sentences: int = 200) -> str:
    """Short sentences of ~25-40 bytes each, hard-wrapped lines and a book separator, like the corpus."""
    rng = np.random.default_rng(0)
    sentences = [f"The {_WORDS[a]} saw a {_WORDS[b]} near the {_WORDS[c]}." for a, b, c in
                 rng.integers(0, len(_WORDS), (n_sentences, 3))]
    half = n_sentences // 2
    return "\n".join(sentences[:half]) + "\n<|endoftext|>\n" + "  ".join(sentences[half:]) + "\n<|endoftext|>\n"


TEXT = synthetic_text()
MAX_SENTENCE = max(len(s) for s in re.findall(r"[^.]*\.", pk.normalize_text(TEXT)))  # bytes = tokens


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("haystack") / "haystack.txt"
    path.write_text(TEXT)
    return path


def _sentence_ends(text: str) -> int:
    return len(re.findall(r"[.!?][\"')\]’”]*(\s|$)", text))


def _pieces(ex, tokenizer):
    """(filler ids, needle text, question text) of an example, cut at its recorded positions."""
    ids = ex.prompt_ids
    needle = ids[ex.needle_pos:ex.needle_pos + ex.needle_len]
    filler = np.concatenate([ids[:ex.needle_pos], ids[ex.needle_pos + ex.needle_len:ex.needle_len + ex.filler_len]])
    return filler, tokenizer.decode(needle), tokenizer.decode(ids[ex.needle_len + ex.filler_len:])


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.8, 1.0])
def test_prompts_on_synthetic_text(depth):
    examples = pk.make_passkey_prompts(TEXT, BYTES, context_len=300, depth=depth, n=4, seed=3)
    assert len(examples) == 4
    for ex in examples:
        assert len(ex.prompt_ids) == 300 - pk.RESERVE and ex.prompt_ids.dtype == np.int32
        assert re.fullmatch(r"[1-9]\d{4}", ex.answer)
        assert BYTES.decode(ex.answer_ids) == " " + ex.answer and ex.max_new_tokens == len(ex.answer_ids) + 2
        filler, needle, question = _pieces(ex, BYTES)
        assert needle == pk.NEEDLE.format(key=ex.answer) and question == pk.QUESTION
        assert len(filler) == ex.filler_len == 300 - pk.RESERVE - ex.needle_len - len(question)
        text = BYTES.decode(ex.prompt_ids)
        assert text.count(ex.answer) == 2 and "<|endoftext|>" not in text and "\n" not in text[:-len(pk.QUESTION)]
        # the needle sits at a sentence boundary within one sentence of the asked depth
        target = round(depth * ex.filler_len)
        assert abs(ex.needle_pos - target) <= MAX_SENTENCE
        between = BYTES.decode(filler[min(target, ex.needle_pos):max(target, ex.needle_pos)])
        assert between.count(".") <= 1 and _sentence_ends(between) <= 1
        assert ex.depth_actual == pytest.approx(ex.needle_pos / ex.filler_len)
        if depth == 0.0:
            assert ex.needle_pos == 0 and text.startswith(pk.NEEDLE.format(key=ex.answer))
        elif depth == 1.0:
            assert ex.needle_pos == ex.filler_len and text.endswith(pk.NEEDLE.format(key=ex.answer) + pk.QUESTION)
        else:
            assert BYTES.decode(filler[:ex.needle_pos]).endswith(".")  # a whole sentence before the needle
            assert BYTES.decode(filler[ex.needle_pos:])[:1] == " "


def test_prompts_are_deterministic_and_share_haystacks_across_depths():
    def make(**kw):
        return pk.make_passkey_prompts(TEXT, BYTES, **{"context_len": 256, "depth": 0.5, "n": 3, "seed": 7, **kw})

    a, b = make(), make()
    assert all(np.array_equal(x.prompt_ids, y.prompt_ids) and x.answer == y.answer for x, y in zip(a, b))
    other = make(seed=8)
    assert [x.answer for x in a] != [x.answer for x in other]
    deep = make(depth=1.0)  # same keys and haystack offsets, only the needle moves
    assert [(x.answer, x.offset) for x in a] == [(x.answer, x.offset) for x in deep]
    assert len({x.answer for x in a}) == 3
    assert [x.answer for x in make(context_len=300)] != [x.answer for x in a]


def test_a_tiny_text_is_read_cyclically():
    examples = pk.make_passkey_prompts("Tiny text. Again.", BYTES, context_len=400, depth=0.5, n=1, seed=0)
    assert len(examples[0].prompt_ids) == 400 - pk.RESERVE
    assert "Tiny text. Again. Tiny text." in BYTES.decode(examples[0].prompt_ids)


@needs_shared
def test_prompts_on_gutenberg_with_gpt2_bpe():
    tok = load_tokenizer(str(GPT2_BPE))
    text = GUTENBERG.read_text()
    for length in (256, 1024):
        for depth in (0.0, 0.5, 1.0):
            for ex in pk.make_passkey_prompts(text, tok, context_len=length, depth=depth, n=2, seed=0):
                assert len(ex.prompt_ids) == length - pk.RESERVE and ex.max_new_tokens <= pk.RESERVE
                assert tok.decode(ex.answer_ids) == " " + ex.answer
                _, needle, question = _pieces(ex, tok)
                assert needle == pk.NEEDLE.format(key=ex.answer) and question == pk.QUESTION
                filler = _pieces(ex, tok)[0]
                target = round(depth * ex.filler_len)
                assert _sentence_ends(tok.decode(filler[min(target, ex.needle_pos):max(target, ex.needle_pos)])) <= 1
                assert "<|endoftext|>" not in tok.decode(ex.prompt_ids)


def test_prompt_errors():
    kw = dict(context_len=300, n=1, seed=0)
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
        pk.make_passkey_prompts(TEXT, BYTES, depth=1.5, **kw)
    with pytest.raises(ValueError, match="n must be a positive int"):
        pk.make_passkey_prompts(TEXT, BYTES, depth=0.5, **{**kw, "n": 0})
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        pk.make_passkey_prompts(TEXT, BYTES, depth=0.5, **{**kw, "seed": -1})
    with pytest.raises(ValueError, match=r"context_len 64 is too short .* use ≥ \d+"):
        pk.make_passkey_prompts(TEXT, BYTES, depth=0.5, **{**kw, "context_len": 64})
    with pytest.raises(ValueError, match="reserve must be ≥ 8"):
        pk.make_passkey_prompts(TEXT, BYTES, depth=0.5, reserve=4, **kw)
    with pytest.raises(ValueError, match="empty"):
        pk.make_passkey_prompts(" \n<|endoftext|>\n", BYTES, depth=0.5, **kw)


# ---------------------------------------------------------------------------------------------
# Scoring and batching
# ---------------------------------------------------------------------------------------------

def test_score():
    assert pk.score(" 68231. Remember", "68231") == {"prediction": "68231", "exact": True, "digit_accuracy": 1.0}
    assert pk.score(" 68213", "68231") == {"prediction": "68213", "exact": False, "digit_accuracy": 0.6}
    assert pk.score(" 1 is 68231", "68231")["exact"]  # the first 5-digit number
    assert pk.score(" 682319", "68231") == {"prediction": "682319", "exact": False, "digit_accuracy": 1.0}
    assert pk.score(" 682", "68231") == {"prediction": "682", "exact": False, "digit_accuracy": 0.6}
    assert pk.score(" the key", "68231") == {"prediction": "", "exact": False, "digit_accuracy": 0.0}


def test_left_pad():
    tokens, seq_start = pk.left_pad([np.array([1, 2, 3]), np.array([4])], pad_id=9, batch_size=3)
    np.testing.assert_array_equal(tokens, [[1, 2, 3], [9, 9, 4], [9, 9, 4]])
    np.testing.assert_array_equal(seq_start, [0, 2, 2])


# ---------------------------------------------------------------------------------------------
# run_passkey and the heatmap
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(train_run):  # noqa: F811 (the imported fixture)
    """The tiny FoX of test_runs (1 layer, d_model 32, byte tokenizer), random init."""
    _, cfg, params = train_run
    return cfg.model.build(), params[4]


def _check_result(result, lengths, depths, n):
    assert (result["lengths"], result["depths"], result["n"]) == (lengths, depths, n)
    for key in ("accuracy", "digit_accuracy"):
        arr = np.asarray(result[key])
        assert arr.shape == (len(lengths), len(depths)) and ((0 <= arr) & (arr <= 1)).all()
    assert len(result["records"]) == len(lengths) * len(depths) * n
    assert all(r["prompt_tokens"] == r["length"] - pk.RESERVE for r in result["records"])
    json.dumps(result)  # JSON-able


@pytest.mark.slow
def test_run_passkey_on_a_tiny_random_model(tiny_model, tmp_path):
    model, params = tiny_model
    lengths, depths = [144, 160], [0.0, 1.0]
    # 12 prompts in batches of 5: one batch holds both lengths (left pads), the last one is filled up
    result = pk.run_passkey(model, params, BYTES, TEXT, lengths=lengths, depths=depths, n_per_cell=3,
                            batch_size=5, seed=0, progress=False)
    _check_result(result, lengths, depths, 3)
    assert result["policy"] == "dense" and result["slots"] is None and result["max_new_tokens"] == 8
    assert result["provable"] is True
    assert all(len(r["generated"].encode()) <= 8 * 3 for r in result["records"])
    pk.plot_heatmap(result, tmp_path / "h.png")
    data = (tmp_path / "h.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    table = pk.format_table(result)
    assert "cache dense" in table and "144" in table and "mean" in table


class FakeGeneration(NamedTuple):
    tokens: np.ndarray
    live_counts: np.ndarray
    overflow: np.ndarray


def fake_engine(calls: list, answer: str = " {key}."):
    """A fake ``generate`` with issue 12's signature that reads the key out of each row's real tokens and
    writes ``answer`` (``{key}``: the key); each call appended to ``calls``."""

    def fake_generate(model, params, prompt_tokens, *, max_new_tokens, policy="dense", slots=None, seq_start=None,
                      temperature=0.0, top_k=None, top_p=None, stop_tokens=(), rng=None, prefill_chunk=512):
        tokens, seq_start = np.asarray(prompt_tokens), np.asarray(seq_start)
        calls.append((tokens.shape, policy, slots, max_new_tokens, seq_start.copy()))
        out = np.full((len(tokens), max_new_tokens), -1, np.int32)
        for b, row in enumerate(tokens):
            assert (row[:seq_start[b]] == BYTES.eot_id).all()
            key = re.search(r"pass key is (\d{5})", BYTES.decode(row[seq_start[b]:])).group(1)
            ids = BYTES.encode_batch([answer.format(key=key)])[0][:max_new_tokens]
            out[b, :len(ids)] = ids
        return FakeGeneration(out, np.zeros((max_new_tokens, 1, len(tokens)), np.int32), np.zeros(len(tokens), np.int32))

    return fake_generate


FAKE_GPT2 = type("M", (), {"cfg": GPT2Config(**{**GPT2_TINY, "n_positions": 256})})()


def test_run_passkey_passes_the_policy_and_left_pads(monkeypatch):
    """A fake engine with issue 12's signature that reads the key out of each row's real tokens."""
    calls = []
    monkeypatch.setattr(decoding, "generate", fake_engine(calls))
    model = FAKE_GPT2
    result = pk.run_passkey(model, None, BYTES, TEXT, lengths=[200, 256], depths=[0.25, 0.75], n_per_cell=2,
                            policy="window:32", slots=40, batch_size=3, progress=False)
    _check_result(result, [200, 256], [0.25, 0.75], 2)
    assert result["accuracy"] == [[1.0, 1.0], [1.0, 1.0]] and result["mean_digit_accuracy"] == 1.0
    assert result["policy"] == "window:32" and result["slots"] == 40 and result["provable"] is True
    assert [c[1:4] for c in calls] == [("window:32", 40, 8)] * 3
    assert calls[0][0] == (3, 248) and list(calls[1][4]) == [0, 56, 56]  # lengths mixed: left pads
    assert result["overflow_rows"] == 0 and all(r["overflow"] == 0 for r in result["records"])
    assert result["answers_with_digits"] == 1.0 and "100% of the answers hold any digit." in pk.format_table(result)
    with pytest.raises(ValueError, match=r"context length 300 is longer than the model's 256 positions "
                                         r"\(cfg.max_positions\)"):
        pk.run_passkey(model, None, BYTES, TEXT, lengths=[300], depths=[0.5], n_per_cell=1, progress=False)


def test_run_passkey_reports_progress_on_stderr_without_a_terminal(monkeypatch, capsys):
    """stderr captured (not a terminal): no bar (no carriage return), a line saying what runs, then one as a
    batch starts: every batch when each takes longer than ``heartbeat_secs``, else the first of each length;
    ``heartbeat_secs=0``: silent. Lengths beyond ``train_len``: one warning. The fake engine writes no digits:
    digit accuracy 0, and the line under the table says why (once)."""
    monkeypatch.setattr(decoding, "generate", fake_engine([], answer=" I do not know."))
    kwargs = dict(lengths=[200, 256], depths=[0.5], n_per_cell=4, policy="window:32", batch_size=3)
    result = pk.run_passkey(FAKE_GPT2, None, BYTES, TEXT, heartbeat_secs=1e-9, **kwargs)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.strip().splitlines()
    assert lines[0] == ("passkey (window:32): 8 prompts in 3 batches of 3, the longest (256 tokens) first; a line as "
                        "a batch starts, for the first of each length and otherwise once 1e-09 s have passed")
    assert [line.split(" | ")[:2] for line in lines[1:]] == [
        ["passkey (window:32): batch 1/3: 3 prompts at length 256", "0/8 prompts done"],
        ["passkey (window:32): batch 2/3: 3 prompts at lengths 256, 200", "3/8 prompts done"],
        ["passkey (window:32): batch 3/3: 2 prompts at length 200", "6/8 prompts done"]]
    assert all(" elapsed" in line for line in lines[1:]) and " | ETA " not in lines[1] and " | ETA " in lines[-1]
    # batches faster than the interval: a line at each new length only; the warning of lengths past training
    pk.run_passkey(FAKE_GPT2, None, BYTES, TEXT, heartbeat_secs=1e9, train_len=200, **kwargs)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == ("warning: context length 256 exceeds the 200 tokens the model was trained on (a test of "
                        "extrapolation): long prompts take memory and time, each batch of 3 prefilling and caching up "
                        "to 256 tokens per prompt")
    assert [line.split(" | ")[0] for line in lines[2:]] == ["passkey (window:32): batch 1/3: 3 prompts at length 256",
                                                             "passkey (window:32): batch 3/3: 2 prompts at length 200"]
    pk.run_passkey(FAKE_GPT2, None, BYTES, TEXT, heartbeat_secs=0, **kwargs)
    assert capsys.readouterr().err == ""
    assert result["mean_digit_accuracy"] == 0.0 and result["answers_with_digits"] == 0.0
    table = pk.format_table(result)
    assert "0% of the answers hold any digit: the model writes no digits after the question, so its digit " \
           "accuracy is 0, below the chance level of a guess." in table
    assert table.count("chance") + table.count("Chance") == 2  # the level once, and the line that points at it


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

def test_help_and_argument_errors_import_no_jax():
    out = subprocess.run([sys.executable, "-c", _PROBE.format(commands=("passkey",))], capture_output=True,
                         text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


@pytest.mark.slow
def test_cli_on_a_tiny_run(train_run, text_file, tmp_path, capsys):  # noqa: F811
    run = train_run[0]
    out = tmp_path / "out"
    # the shapes of test_run_passkey_on_a_tiny_random_model: nothing new to compile
    argv = ["passkey", str(run), "--lengths", "144,160", "--depths", "0,1", "--n", "3", "--text", str(text_file),
            "--out", str(out), "--batch-size", "5", "--no-progress"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    stdout = captured.out.strip().splitlines()
    summary = json.loads(stdout[-1])
    assert summary["command"] == "passkey" and summary["policy"] == "dense" and summary["prompts"] == 12 and 0 <= summary["accuracy"] <= 1
    assert summary["provable"] is True
    assert any(line.startswith("passkey retrieval, cache dense") for line in stdout)
    at = next(i for i, line in enumerate(stdout) if line.startswith("digit accuracy "))
    assert "of the answers hold any digit" in stdout[at]
    assert "exact 1 time in 90,000" in stdout[at + 1] and "--cache dense" in stdout[at + 1]  # chance, what models score
    # --no-progress (and stderr captured): no bar, the line that says what runs on stderr
    assert "\r" not in captured.err and "passkey (dense): 12 prompts in 3 batches of 5, the longest (160 tokens) " \
        "first" in captured.err
    assert "warning: context lengths 144, 160 exceed the 16 tokens the model was trained on" in captured.err
    report = json.loads((out / "passkey.json").read_text())
    assert summary["answers_with_digits"] == round(report["answers_with_digits"], 4)
    _check_result(report, [144, 160], [0.0, 1.0], 3)
    assert report["step"] == 4 and report["source"] == str(run) and report["text"] == str(text_file)
    assert report["max_positions"] is None and report["train_seq_len"] == 16
    assert (out / "passkey.png").read_bytes()[:4] == b"\x89PNG"
    assert summary["json"] == str(out / "passkey.json") and summary["png"] == str(out / "passkey.png")


def _error(argv, capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_cli_errors(train_run, text_file, tmp_path, capsys, monkeypatch):  # noqa: F811
    run, out = str(train_run[0]), str(tmp_path / "out")
    base = ["passkey", run, "--out", out, "--text", str(text_file)]
    assert "--depths: depths must be in [0, 1]" in _error(base + ["--depths", "0,2"], capsys)
    assert "--lengths: expected comma-separated ints" in _error(base + ["--lengths", "1k"], capsys)
    assert "--n must be positive" in _error(base + ["--n", "0"], capsys)
    assert "--lengths: a context length is given twice" in _error(base + ["--lengths", "144,144"], capsys)
    assert "--text" in _error(["passkey", run, "--out", out, "--text", str(tmp_path / "nope.txt")], capsys)
    # a bad length is named before a missing text file is looked for
    assert "--lengths: context lengths must be positive ints, got -1" in _error(
        ["passkey", run, "--out", out, "--text", str(tmp_path / "nope.txt"), "--lengths", "128,-1"], capsys)
    monkeypatch.delenv("FOX_JAX_SHARED_DATA", raising=False)  # then the checkout's ../shared/data
    if config_lib.CHECKOUT_SHARED_DATA.joinpath(*pk.DEFAULT_TEXT).is_file():
        assert pk.default_text_path() == config_lib.CHECKOUT_SHARED_DATA.joinpath(*pk.DEFAULT_TEXT)
    monkeypatch.setattr(config_lib, "CHECKOUT_SHARED_DATA", tmp_path / "no_checkout_data")
    err = _error(["passkey", run, "--out", out], capsys)
    assert "no_checkout_data" in err and "FOX_JAX_SHARED_DATA not set" in err and "--text" in err
    monkeypatch.setenv("FOX_JAX_SHARED_DATA", str(tmp_path))
    err = _error(["passkey", run, "--out", out], capsys)
    assert "gutenberg_val.txt not found (FOX_JAX_SHARED_DATA=" in err
    err = _error(["passkey", str(tmp_path / "norun"), "--out", out, "--text", str(text_file)], capsys)
    assert "error: RUN_DIR_OR_HF_DIR " in err and "norun: no such directory" in err  # the argument as in --help
    assert "unknown cache policy 'lru'" in _error(base + ["--cache", "lru"], capsys)
    assert _error(base + ["--cache", "window:abc"], capsys).startswith(
        "fox-jax passkey: error: --cache 'window:abc': W must be an int")
    assert _error(base + ["--step", "7"], capsys) == (
        f"fox-jax passkey: error: --step: no checkpoint for step 7 in {run}/checkpoints; available steps: 2, 4")
    assert _error(["passkey", run, "--out", out, "--text", str(tmp_path)], capsys) == (
        f"fox-jax passkey: error: --text {tmp_path} is a directory; give a text file (the haystack)")
    assert not os.path.exists(out)


def test_cli_lengths_beyond_the_models_positions(tmp_path, text_file, capsys):
    cfg = GPT2Config(**GPT2_TINY)  # 64 learned positions; zero weights (shapes traced, nothing compiled)
    params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(cfg.init_params, jax.random.PRNGKey(0)))
    save_hf_gpt2(cfg, params, tmp_path / "hf")
    argv = ["passkey", str(tmp_path / "hf"), "--lengths", "64,128", "--out", str(tmp_path / "out"),
            "--text", str(text_file)]
    err = _error(argv, capsys)
    assert "--lengths: context length 128 is longer than the model's 64 positions (cfg.max_positions)" in err
    err = _error(argv[:3] + ["64"] + argv[4:], capsys)  # within the positions, but the HF dir names no tokenizer
    assert "--tokenizer is needed" in err
