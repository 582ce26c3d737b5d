"""Zero-shot scoring (train/zeroshot.py): alignment of the batched scorer, acc vs acc_norm, the task loaders
on the real eval files, the model adapters against transformers, and the ``fox-jax zeroshot`` CLI."""

import json
import math
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from fox_jax.train import cli, zeroshot
from fox_jax.train.tokenizers import ByteTokenizer

SHARED = Path(os.environ.get("FOX_JAX_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
EVAL_DIR = SHARED / "eval"
GPT2_TOKENIZER = SHARED / "tokenizers" / "gpt2"
TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=50257, n_positions=128)  # transformers' names

needs_eval = pytest.mark.skipif(not EVAL_DIR.is_dir(), reason=f"{EVAL_DIR} is absent (set FOX_JAX_SHARED_DATA)")
needs_tokenizer = pytest.mark.skipif(not (GPT2_TOKENIZER / "vocab.json").is_file(),
                                     reason="GPT-2 tokenizer absent (set FOX_JAX_SHARED_DATA)")


def id_scorer(tokens, lengths):
    """log p(next) = −id/1000 of the predicted token: a continuation scores −Σ ids / 1000 exactly."""
    lp = -tokens[:, 1:].astype(np.float64) / 1000.0
    return lp, tokens[:, 1:] % 2 == 0  # greedy iff the target id is even


# Scoring core -------------------------------------------------------------------------------------

def test_score_requests_alignment_padding_and_truncation():
    rng = np.random.default_rng(0)
    requests = [(rng.integers(1, 200, n_ctx), rng.integers(1, 200, n_cont))
                for n_ctx, n_cont in [(1, 1), (5, 3), (40, 2), (17, 17), (3, 9), (200, 4)]]
    calls = []

    def scorer(tokens, lengths):
        calls.append(tokens.shape)
        assert tokens.dtype == np.int32 and lengths.dtype == np.int32
        for row, n in zip(tokens, lengths):
            assert np.all(row[n:] == 7)  # right padding with pad_id
        return id_scorer(tokens, lengths)

    ll, greedy = zeroshot.score_requests(scorer, requests, batch_size=4, max_length=64, pad_id=7, progress=False)
    for (ctx, cont), got, g in zip(requests, ll, greedy):
        assert got == pytest.approx(-cont.sum() / 1000.0)
        assert g == bool(np.all(cont % 2 == 0))
    assert all(b == 4 for b, _ in calls)                       # filler rows keep one batch shape
    assert all(t - 1 in (16, 32, 64) for _, t in calls)         # bucketed lengths, ≤ max_length + 1
    long_cont = np.arange(1, 71)  # longer than max_length: scored on its last 64 tokens
    ll, _ = zeroshot.score_requests(scorer, [(np.ones(2), long_cont)], max_length=64, pad_id=7, progress=False)
    assert ll[0] == pytest.approx(-long_cont[-64:].sum() / 1000.0)


class _Words:
    """A fake tokenizer: one token per character (ids = code points), eot 0."""
    eot_id = 0

    def encode_batch(self, texts):
        return [np.array([ord(c) for c in t], np.uint32) for t in texts]


def test_handcrafted_multiple_choice_acc_vs_acc_norm():
    # log p = -1 per token except 'z' (-5): a long cheap choice loses on total log-likelihood but
    # wins once divided by its length (acc_norm), as in lm-eval.
    def scorer(tokens, lengths):
        tgt = tokens[:, 1:]
        return np.where(tgt == ord("z"), -5.0, -1.0), None

    examples = [
        zeroshot._mc("Q: pick one\nA:", ["aaaaaaaa", "b"], 0),   # acc picks "b" (-2 > -9), acc_norm "aaaaaaaa"
        zeroshot._mc("Q: avoid z\nA:", ["zz", "cc"], 1),          # both pick "cc"
    ]
    task = zeroshot.TASK_REGISTRY["piqa"]
    requests = zeroshot.encode_pairs(_Words(), [p for ex in examples for p in ex.pairs])
    assert [len(c) for _, c in requests] == [9, 2, 3, 3]          # " " + choice
    ll, greedy = zeroshot.score_requests(scorer, requests, batch_size=3, progress=False)
    np.testing.assert_allclose(ll, [-9, -2, -11, -3])
    res = zeroshot.compute_metrics(task, examples, ll, greedy)
    assert res["n"] == 2 and res["acc"] == 0.5 and res["acc_norm"] == 1.0
    assert res["acc_stderr"] == pytest.approx(0.5)


def test_lambada_metrics_and_encode_pairs():
    examples = [zeroshot.Example((("The cat sat on the", " mat"),), 0, ("mat",)),
                zeroshot.Example((("", " x"),), 0, ("x",))]
    tok = ByteTokenizer()
    requests = zeroshot.encode_pairs(tok, [ex.pairs[0] for ex in examples])
    assert bytes(requests[0][1].astype(np.uint8)) == b" mat"
    assert list(requests[1][0]) == [tok.eot_id]                   # empty context -> <|endoftext|>
    moved = zeroshot.encode_pairs(tok, [("Answer: ", "yes")])[0]  # trailing space goes to the continuation
    assert bytes(moved[1].astype(np.uint8)) == b" yes"
    ll, greedy = zeroshot.score_requests(id_scorer, requests, progress=False)
    res = zeroshot.compute_metrics(zeroshot.TASK_REGISTRY["lambada"], examples, ll, greedy)
    assert res["acc"] == 0.5  # " mat": 'm' = 109 is odd -> not greedy; " x": 32 and 120 even -> greedy
    assert res["ppl"] == pytest.approx(math.exp(-np.mean(ll)))
    assert zeroshot.parse_tasks("all") == list(zeroshot.TASKS)
    assert zeroshot.parse_tasks("ARC-Easy, piqa") == ["arc_easy", "piqa"]
    with pytest.raises(ValueError, match="unknown task"):
        zeroshot.parse_tasks("piqa,mmlu")


# Loaders on the real files --------------------------------------------------------------------------

EXPECTED = {"lambada": (5153, 1), "piqa": (1838, 2), "winogrande": (1267, 2), "hellaswag": (1000, 4),
            "arc_easy": (570, None), "arc_challenge": (299, None), "copa": (100, 2), "boolq": (3270, 2)}


@needs_eval
@pytest.mark.parametrize("name", list(zeroshot.TASKS))
def test_loaders_parse_the_real_files(name):
    task = zeroshot.TASK_REGISTRY[name]
    examples = task.load(EVAL_DIR)
    n, n_choices = EXPECTED[name]
    assert len(examples) == n
    golds = set()
    for ex in examples:
        assert n_choices is None and 3 <= len(ex.pairs) <= 5 or len(ex.pairs) == n_choices
        assert 0 <= ex.gold < len(ex.pairs) and len(ex.choice_texts) == len(ex.pairs)
        for context, continuation in ex.pairs:
            assert isinstance(context, str) and context.strip()
            assert continuation.startswith(" ") and continuation.strip()
        golds.add(ex.gold)
    if name != "lambada":
        assert len(golds) > 1  # answers are not all in one position


@needs_eval
def test_loader_prompts_match_lm_eval():
    wino = zeroshot.load_winogrande(EVAL_DIR)[0]
    assert wino.pairs == (("Sarah was a much better surgeon than Maria so Sarah", " always got the easier cases."),
                          ("Sarah was a much better surgeon than Maria so Maria", " always got the easier cases."))
    assert wino.gold == 1
    hs = zeroshot.load_hellaswag(EVAL_DIR)[0]
    assert hs.pairs[0][0] == ("Pole vault: Pole vault is a sport where you run with a pole and stop and swing "
                              "your body. A few women")
    assert hs.gold == 3
    piqa = zeroshot.load_piqa(EVAL_DIR)[0]
    assert piqa.pairs[0][0] == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert piqa.gold == 0
    copa = zeroshot.load_copa(EVAL_DIR)[0]
    assert copa.pairs == (("The man turned on the faucet therefore", " the toilet filled with water."),
                          ("The man turned on the faucet therefore", " water flowed from the spout."))
    lam = zeroshot.load_lambada(EVAL_DIR)[0]
    assert lam.pairs[0][1] == " signs" and lam.pairs[0][0].endswith("I don't care about")
    arc = zeroshot.load_arc_easy(EVAL_DIR)[0]
    assert arc.gold == 0 and arc.pairs[0][1] == " cellular telephone"
    boolq = zeroshot.load_boolq(EVAL_DIR)[0]
    assert boolq.pairs[0][0].endswith("\nQuestion: does ethanol take more energy make that produces?\nAnswer:")
    assert [c for _, c in boolq.pairs] == [" no", " yes"] and boolq.gold == 0


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="lambada_test.jsonl"):
        zeroshot.load_lambada(tmp_path)
    (tmp_path / "copa").mkdir()
    (tmp_path / "copa" / "copa_validation.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="copa_validation.jsonl:1"):
        zeroshot.load_copa(tmp_path)


# Model adapters ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random transformers GPT-2 saved as safetensors, with the GPT-2 tokenizer files when present."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import shutil

    import torch

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY)).eval()
    path = tmp_path_factory.mktemp("hf_gpt2")
    model.save_pretrained(path)
    if (GPT2_TOKENIZER / "vocab.json").is_file():
        for name in ("vocab.json", "merges.txt"):
            shutil.copyfile(GPT2_TOKENIZER / name, path / name)
    return path


@pytest.mark.slow
def test_gpt2_scorer_matches_transformers_and_dcp_keep_all(hf_dir):
    import torch
    import transformers

    from fox_jax.models.hf_gpt2 import load_hf_gpt2

    rng = np.random.default_rng(1)
    requests = [(rng.integers(0, 50257, n), rng.integers(0, 50257, k)) for n, k in [(3, 2), (30, 5), (200, 3), (9, 1)]]
    cfg, params = load_hf_gpt2(hf_dir, dcp=False)
    ll, greedy = zeroshot.score_requests(zeroshot.ModelScorer(cfg, params), requests, batch_size=2,
                                         max_length=cfg.n_positions, progress=False)
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    for (ctx, cont), got, g in zip(requests, ll, greedy):
        row = np.concatenate([ctx, cont])[-(cfg.n_positions + 1):]
        with torch.no_grad():
            logits = model(torch.tensor(row[None, :-1])).logits[0].double()
        logp = torch.log_softmax(logits, -1)[-len(cont):]
        target = torch.tensor(cont)
        assert got == pytest.approx(float(logp.gather(1, target[:, None]).sum()), abs=2e-3)
        assert g == bool((logp.argmax(-1) == target).all())
    # DCP with β far above the support edge keeps every pair: same scores, sparsity exactly 0.
    dcfg, dparams = cfg.add_dcp_params(params, jax.random.PRNGKey(0), interaction_dim=8, beta_init=50.0)
    scorer = zeroshot.ModelScorer(dcfg, dparams)
    ll_dcp, _ = zeroshot.score_requests(scorer, requests, batch_size=2, max_length=cfg.n_positions, progress=False)
    np.testing.assert_allclose(ll_dcp, ll, rtol=1e-5, atol=1e-3)
    assert scorer.stats()["sparsity"] == 0.0 and set(scorer.stats()) == {"sparsity", "sparsity_layer_0",
                                                                          "sparsity_layer_1"}
    # β = −50: every earlier token is dropped; sparsity counts only pairs of real (unpadded) tokens.
    for i in range(dcfg.n_layers):
        dparams[f"h_{i}"]["attn"]["beta"] = np.float32(-50.0)
    scorer = zeroshot.ModelScorer(dcfg, dparams)
    zeroshot.score_requests(scorer, requests, batch_size=2, max_length=cfg.n_positions, progress=False)
    assert scorer.stats()["sparsity"] == 1.0


def test_language_model_scorer_shapes():
    from fox_jax.models import preset

    cfg = preset("tiny", "fox-llama", vocab_size=300, n_layers=1, d_model=32, n_heads=2)
    scorer = zeroshot.ModelScorer(cfg, cfg.init_params(jax.random.PRNGKey(0)))
    tokens = np.random.default_rng(0).integers(0, 300, (3, 17)).astype(np.int32)
    lp, greedy = scorer(tokens, np.full(3, 17, np.int32))
    assert lp.shape == (3, 16) and greedy.shape == (3, 16) and greedy.dtype == bool
    assert np.all(lp <= 0) and np.all(np.isfinite(lp))


# CLI ----------------------------------------------------------------------------------------------------

@needs_eval
@needs_tokenizer
def test_cli_hf_gpt2_limit_4(hf_dir, tmp_path, capsys):
    out = tmp_path / "zs.json"
    assert cli.main(["zeroshot", "--hf-gpt2", str(hf_dir), "--limit", "4", "--eval-dir", str(EVAL_DIR),
                     "--output", str(out), "--no-progress", "--batch-size", "4"]) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert set(report["results"]) == set(zeroshot.TASKS) and report["dcp"] is False
    for name, res in report["results"].items():
        assert res["n"] == 4 and 0.0 <= res["acc"] <= 1.0 and name in table
    assert report["results"]["lambada"]["ppl"] > 1.0
    assert "acc_norm" in report["results"]["hellaswag"] and "acc_norm" not in report["results"]["winogrande"]
    # --dcp on a dense checkpoint, unknown tasks: one-line errors, exit code 2
    assert cli.main(["zeroshot", "--hf-gpt2", str(hf_dir), "--dcp", "--tasks", "piqa"]) == 2
    assert "dcp_interaction.safetensors" in capsys.readouterr().err
    assert cli.main(["zeroshot", "--hf-gpt2", str(hf_dir), "--tasks", "mmlu", "--eval-dir", str(EVAL_DIR)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown task" in err


@needs_eval
def test_cli_workdir_language_model(tmp_path, capsys):
    from fox_jax.train import config as config_lib, loop
    from fox_jax.train.checkpoints import Checkpointer

    cfg = config_lib.apply_overrides(config_lib.preset("tiny"), [
        "data.tokenizer=bytes", "data.seq_len=64", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
        "model.vocab_size=257"])
    workdir = tmp_path / "run"
    workdir.mkdir()
    config_lib.save_json(cfg, workdir / "config.json")
    state = loop.init_state(cfg, jax.random.PRNGKey(0), loop.make_optimizer(cfg))
    ckpt = Checkpointer(str(workdir / "checkpoints"), async_save=False)
    ckpt.save(0, state, {}, force=True)
    ckpt.close()
    assert cli.main(["zeroshot", "--workdir", str(workdir), "--tasks", "copa,winogrande", "--limit", "3",
                     "--eval-dir", str(EVAL_DIR), "--no-progress"]) == 0
    report = json.loads((workdir / "eval" / "zeroshot.json").read_text())
    assert report["model"] == "fox-llama" and report["max_length"] == 64
    assert report["results"]["copa"]["n"] == 3 and report["results"]["winogrande"]["n"] == 3
    assert cli.main(["zeroshot", "--workdir", str(workdir), "--dcp", "--eval-dir", str(EVAL_DIR)]) == 2
    assert "LanguageModel has no DCP" in capsys.readouterr().err


def test_table_columns_fit_a_huge_perplexity():
    """The printed table stays aligned when a barely trained model's perplexity has seven digits."""
    from fox_jax.train.zeroshot import format_table

    lines = format_table({"lambada_openai": {"n": 100, "acc": 0.0, "acc_stderr": 0.0, "ppl": 1234567.891},
                          "piqa": {"n": 1838, "acc": 0.55, "acc_stderr": 0.01}}).splitlines()
    value_end = lines[0].index("value") + len("value")
    for line in lines[2:]:
        assert line[:value_end].rstrip()[-1].isdigit() and (len(line) == value_end or line[value_end] == " "), line
    assert "1.235e+06" in lines[3]
