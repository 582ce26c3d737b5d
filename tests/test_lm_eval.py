"""lm-evaluation-harness integration (train/lm_eval_model.py, train/lm_eval_tasks/): the ``fox_jax`` model's
log-likelihoods against our own forward, rolling windows, generation with stop strings, the local task files
against the built-in scorer's loaders, and ``fox-jax zeroshot --harness lm-eval``. Skipped without lm-eval
(``pip install -e ".[eval]"``)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from fox_jax.train import cli, lm_eval_model, zeroshot  # noqa: E402
from fox_jax.train.commands import MissingExtraError  # noqa: E402
from fox_jax.train.tokenizers import ByteTokenizer, load_tokenizer  # noqa: E402

SHARED = Path(os.environ.get("FOX_JAX_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
EVAL_DIR = SHARED / "eval"
GPT2_TOKENIZER = SHARED / "tokenizers" / "gpt2"
needs_eval = pytest.mark.skipif(not EVAL_DIR.is_dir(), reason=f"{EVAL_DIR} is absent (set FOX_JAX_SHARED_DATA)")
MAX_LEN = 48
# float32 sums of ≤ 49 log-probs of size ~5.5 (random init): the batched, right-padded and bucketed forward
# differs from the unpadded one only by float32 rounding (~1e-6 relative per term).
ATOL = 2e-4


@pytest.fixture(scope="module")
def tiny():
    """A 1-layer FoX with random params (numpy-filled from the abstract init: nothing compiles)."""
    from fox_jax.models import preset

    cfg = preset("tiny", "fox-llama", vocab_size=257, n_layers=1, d_model=32, n_heads=2)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, leaf: jnp.asarray(("scale" in jax.tree_util.keystr(path)) + 0.3 * rng.standard_normal(leaf.shape),
                                       leaf.dtype), jax.eval_shape(lambda: cfg.init_params(jax.random.PRNGKey(0))))
    return cfg, params


@pytest.fixture(scope="module")
def lm(tiny):
    return lm_eval_model.FoxJaxLM.from_params(*tiny, ByteTokenizer(), max_length=MAX_LEN, batch_size=3,
                                              max_gen_toks=10)


class Latin1(ByteTokenizer):
    """One token per character (Latin-1 code points, eot 256): generated text maps back to its tokens."""

    name = "latin1"

    def encode_batch(self, texts):
        return [np.frombuffer(t.encode("latin-1"), np.uint8).astype(np.uint32) for t in texts]

    def decode(self, ids):
        return "".join("<|endoftext|>" if i == 256 else chr(i) for i in np.asarray(ids).reshape(-1))


@pytest.fixture(scope="module")
def lm_chars(lm):
    return lm_eval_model.FoxJaxLM.from_params(lm.cfg, lm.params, Latin1(), max_length=MAX_LEN, batch_size=3,
                                              max_gen_toks=10)


@pytest.fixture(scope="module")
def forward(tiny):
    """Our own forward, one row at a time: ids [T ≤ 65] -> log-softmax [T - 1, V] (float32). The row is fed
    alone, zero-filled on the right to 64 inputs (one compiled shape; causal, so the filler changes nothing)."""
    cfg, params = tiny
    model = cfg.build()
    fn = jax.jit(lambda p, x: jax.nn.log_softmax(model.apply({"params": p}, x).logits.astype(jnp.float32), -1))

    def run(ids):
        x = np.zeros((1, 64), np.int32)
        x[0, :len(ids) - 1] = ids[:-1]
        return np.asarray(fn(params, x))[0, :len(ids) - 1]
    return run


def req(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def reference_loglik(forward, ctx: str, cont: str) -> tuple[float, bool]:
    """lm-eval's rule for a byte tokenizer written out: trailing spaces move to the continuation, an empty context
    is <|endoftext|>, the row keeps its last MAX_LEN + 1 tokens."""
    n = len(ctx) - len(ctx.rstrip())
    ctx, cont = (ctx[:-n], ctx[-n:] + cont) if n else (ctx, cont)
    c = list(ctx.encode()) or [256]
    k = list(cont.encode())
    row = (c + k)[-(MAX_LEN + 1):]
    lp = forward(row)[-len(k):]
    targets = np.asarray(row[-len(k):])
    return float(lp[np.arange(len(k)), targets].sum()), bool(np.all(lp.argmax(-1) == targets))


PAIRS = [("The cat sat on the", " mat"), ("Question: why?\nAnswer: ", "because"), ("", "Hello world"),
         ("A long context that is longer than the forty-eight bytes of the model's context window", " ok")]


def test_loglikelihood_matches_our_forward(lm, forward):
    got = lm.loglikelihood([req("loglikelihood", c, k) for c, k in PAIRS], disable_tqdm=True)
    for (ctx, cont), (ll, greedy) in zip(PAIRS, got):
        want, want_greedy = reference_loglik(forward, ctx, cont)
        assert ll == pytest.approx(want, abs=ATOL) and greedy == want_greedy


def test_greedy_flag_and_batching(lm, forward):
    ctx = list(b"Once upon a time")
    row = ctx + [0, 0, 0]
    for i in range(3):  # causal: each argmax depends only on the tokens before it (one compiled shape)
        row[len(ctx) + i] = int(forward(row)[len(ctx) + i - 1].argmax())
    cont = row[len(ctx):]
    wrong = cont[:2] + [(cont[2] + 1) % 256]
    requests = [(None, ctx, cont), (None, ctx, wrong), (None, ctx[:5], cont[:1]), (None, ctx, cont[:2])]
    got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [g for _, g in got] == [True, False, bool(forward(ctx[:5] + cont[:1])[-1].argmax() == cont[0]), True]
    # batching and bucketing do not change the results: one row at a time, and in reversed order
    lm_one = lm_eval_model.FoxJaxLM.from_params(lm.cfg, lm.params, ByteTokenizer(), max_length=MAX_LEN, batch_size=1)
    one = lm_one._loglikelihood_tokens(requests[::-1], disable_tqdm=True)[::-1]
    np.testing.assert_allclose([x for x, _ in one], [x for x, _ in got], rtol=0, atol=1e-5)
    assert [g for _, g in one] == [g for _, g in got]


def test_loglikelihood_rolling_windows(lm, forward):
    text = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of " \
           "foolishness, it was the epoch of belief."
    toks = list(text.encode())
    seq = [256] + toks  # <|endoftext|> before the first token
    want = 0.0
    for start in range(0, len(toks), MAX_LEN):  # predictions [start, end) with the MAX_LEN tokens before the last
        end = min(start + MAX_LEN, len(toks))
        window = seq[max(0, end - MAX_LEN):end + 1]
        lp = forward(window)
        targets = np.asarray(seq[start + 1:end + 1])
        want += float(lp[np.arange(len(lp) - len(targets), len(lp)), targets].sum())
    short = "A short text."
    got = lm.loglikelihood_rolling([req("loglikelihood_rolling", text), req("loglikelihood_rolling", short)],
                                   disable_tqdm=True)
    assert len(toks) > 2 * MAX_LEN and got[0] == pytest.approx(want, abs=2 * ATOL)
    assert got[1] == pytest.approx(reference_loglik(forward, "", short)[0], abs=ATOL)


def test_generate_until_batches_and_stop_strings(lm_chars):
    prompts = ["Once upon a", "The end", "Hi"]
    free = lm_chars.generate_until([req("generate_until", p, {"until": []}) for p in prompts], disable_tqdm=True)
    alone = [lm_chars.generate_until([req("generate_until", p, {"until": []})], disable_tqdm=True)[0] for p in prompts]
    assert free == alone  # rows of one batch do not see each other (left padding, seq_start)
    text = free[0]
    assert len(text) == 10 and "<" not in text, text  # max_gen_toks; no <|endoftext|> from these params
    stop = text[2:4]  # two tokens: the row runs on and the text is cut (one compiled program in all)
    cut = lm_chars.generate_until([req("generate_until", prompts[0], {"until": [stop]})], disable_tqdm=True)
    assert cut == [text[:text.index(stop)]]
    with pytest.raises(ValueError, match="unsupported generation argument.*num_beams"):
        lm_chars.generate_until([req("generate_until", "x", {"until": [], "num_beams": 4})], disable_tqdm=True)


@pytest.mark.slow  # a second compiled generate program (the stop tokens are static)
def test_generate_until_one_token_stop_string(lm_chars):
    text = lm_chars.generate_until([req("generate_until", "Once upon a", {"until": []})], disable_tqdm=True)[0]
    cut = lm_chars.generate_until([req("generate_until", "Once upon a", {"until": [text[3]]})], disable_tqdm=True)
    assert cut == [text[:text.index(text[3])]]  # the row stops at that token: the same text


def test_model_argument_errors(tmp_path, tiny):
    with pytest.raises(ValueError, match="run= is required"):
        lm_eval_model.FoxJaxLM()
    with pytest.raises(ValueError, match="batch_size must be an int.*'auto' is not supported"):
        lm_eval_model.FoxJaxLM(run=str(tmp_path), batch_size="auto")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        lm_eval_model.FoxJaxLM(run=str(tmp_path), dtype="float8")
    with pytest.raises(ValueError, match="unknown argument.*pretrained"):
        lm_eval_model.FoxJaxLM(run=str(tmp_path), pretrained="gpt2")
    with pytest.raises(ValueError, match="cache=dcp with a dense config"):
        lm_eval_model.FoxJaxLM.from_params(*tiny, ByteTokenizer(), max_length=8, cache="dcp")
    with pytest.raises(ValueError, match="--tasks: unknown task.*mmlu"):
        lm_eval_model.parse_harness_tasks("piqa,mmlu")
    assert lm_eval_model.parse_harness_tasks("all,wikitext2")[-2:] == ["boolq", "wikitext2"]
    with pytest.raises(FileNotFoundError, match="eval_dir .*nowhere: no such directory"):
        lm_eval_model.task_manager(tmp_path / "nowhere").load(["fox_copa"])


def test_missing_lm_eval_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now fails
    monkeypatch.delitem(sys.modules, "fox_jax.train.lm_eval_model")
    spec = importlib.util.spec_from_file_location("_lm_eval_probe", lm_eval_model.__file__)
    with pytest.raises(MissingExtraError, match=r'pip install -e "\.\[eval\]"'):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert cli.main(["zeroshot", "--harness", "lm-eval", "--workdir", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install -e ".[eval]"' in err


@pytest.mark.skipif(not (GPT2_TOKENIZER / "vocab.json").is_file(),
                    reason="GPT-2 tokenizer absent (set FOX_JAX_SHARED_DATA)")
def test_gpt2_bpe_pairs_match_the_builtin_encoder(tiny):
    from fox_jax.models import preset

    cfg = preset("tiny", "fox-llama", vocab_size=50257, n_layers=1, d_model=8, n_heads=1)
    tok = load_tokenizer(str(GPT2_TOKENIZER))
    lm = lm_eval_model.FoxJaxLM.from_params(cfg, {}, tok, max_length=32)  # encoding needs no params
    pairs = [("Question: Is it?\nAnswer:", " yes"), ("The capital of France is ", "Paris"), ("He said", " hello!")]
    for (ctx, cont), (want_ctx, want_cont) in zip(pairs, zeroshot.encode_pairs(tok, pairs)):
        got_ctx, got_cont = lm._encode_pair(ctx, cont)
        assert got_ctx == want_ctx.tolist() and got_cont == want_cont.tolist()
    assert lm._encode_pair("Answer:", " yes")[1] == [3763] and lm.eot_token_id == 50256
    assert lm.tok_decode(lm.tok_encode("Hello world")) == "Hello world"


@needs_eval
def test_task_files_match_the_builtin_loaders():
    # lm-eval's own prompts on our local files give exactly the (context, continuation) pairs of zeroshot.py
    tm = lm_eval_model.task_manager(EVAL_DIR)
    loaded = tm.load([lm_eval_model.HARNESS_TASKS[n] for n in zeroshot.TASKS])["tasks"]
    tasks = {name.split(":")[-1]: t for name, t in loaded.items()}  # keys may carry a group prefix
    for name in zeroshot.TASKS:
        task = tasks[lm_eval_model.HARNESS_TASKS[name]]
        task.build_all_requests(limit=4)
        examples = zeroshot.TASK_REGISTRY[name].load(EVAL_DIR)[:4]
        by_doc = {}
        for inst in sorted(task.instances, key=lambda i: (i.doc_id, i.idx)):
            by_doc.setdefault(inst.doc_id, []).append(inst.args)
        want = [tuple(map(tuple, ex.pairs)) for ex in examples]
        if name == "copa":  # lm-eval's copa: target_delimiter " " + doc_to_choice's own " " (zeroshot.py: one)
            want = [tuple((c, " " + k) for c, k in pairs) for pairs in want]
        assert [tuple(v) for v in by_doc.values()] == want, name
        if name != "lambada":
            golds = []
            for d in list(task.eval_docs)[:4]:  # as lm-eval reads the gold index of a multiple-choice doc
                g = task.doc_to_text(d) if name == "winogrande" else task.doc_to_target(d)
                golds.append(task.doc_to_choice(d).index(g) if isinstance(g, str) else g)
            assert golds == [ex.gold for ex in examples], name


def _tiny_run(path: Path) -> Path:
    from fox_jax.train import config as config_lib, loop
    from fox_jax.train.checkpoints import Checkpointer

    cfg = config_lib.apply_overrides(config_lib.preset("tiny"), [
        "data.tokenizer=bytes", "data.seq_len=64", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
        "model.vocab_size=257"])
    path.mkdir()
    config_lib.save_json(cfg, path / "config.json")
    ckpt = Checkpointer(str(path / "checkpoints"), async_save=False)
    ckpt.save(0, loop.init_state(cfg, jax.random.PRNGKey(0), loop.make_optimizer(cfg)), {}, force=True)
    ckpt.close()
    return path


@needs_eval
@pytest.mark.slow
def test_cli_harness_matches_the_builtin_scorer(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # what the command sets (kept out of the other tests)
    run = _tiny_run(tmp_path / "run")
    common = ["--workdir", str(run), "--tasks", "lambada,winogrande,piqa,arc_easy", "--limit", "3", "--eval-dir",
              str(EVAL_DIR), "--no-progress"]
    assert cli.main(["zeroshot", *common]) == 0
    assert cli.main(["zeroshot", "--harness", "lm-eval", *common[:3], "lambada,winogrande,piqa,arc_easy,wikitext2",
                     *common[4:]]) == 0
    captured = capsys.readouterr()
    assert "wikitext2" in captured.out
    assert "\r" not in captured.err  # lm-eval's own bars follow --no-progress / the terminal rule too
    ours = json.loads((run / "eval" / "zeroshot.json").read_text())
    harness = json.loads((run / "eval" / "zeroshot_lm_eval.json").read_text())
    assert harness["harness"] == "lm-eval" and harness["max_length"] == ours["max_length"] == 64
    for task, res in ours["results"].items():
        for key, value in res.items():
            if key == "truncated_continuations":  # counted by the built-in scorer; the harness logs a warning
                continue
            assert harness["results"][task][key] == pytest.approx(value, rel=1e-5, abs=1e-9), (task, key)
    wiki = harness["results"]["wikitext2"]
    assert wiki["n"] == 3 and 1.0 < wiki["byte_perplexity"] < 257 and wiki["bits_per_byte"] > 0
