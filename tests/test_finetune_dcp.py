"""``fox-jax finetune-dcp`` (train/finetune_dcp.py) on a tiny random GPT-2 (CPU): metrics, α schedule,
sparsity, HF export, exact resume, errors, and zero-shot on the run."""

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.ops.alpha_sigmoid import cosine_alpha_schedule
from fox_jax.ops.context_pruning import sparsity_loss
from train import cli, finetune_dcp

SHARED = Path(os.environ.get("FOX_JAX_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
GPT2_TOKENIZER = SHARED / "tokenizers" / "gpt2"
TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=50257, n_positions=128)
STEPS = 10

pytestmark = pytest.mark.skipif(not (GPT2_TOKENIZER / "vocab.json").is_file(), reason="GPT-2 tokenizer absent")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY))
    path = tmp_path_factory.mktemp("hf_gpt2")
    model.save_pretrained(path)  # safetensors
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~60 KB of real text split into train/val: the first held-out Gutenberg book, else this repo's source."""
    val_books = SHARED / "corpus_val" / "gutenberg_val.txt"
    if val_books.is_file():
        with open(val_books, encoding="utf-8") as f:
            text = f.read(60_000)
    else:
        root = Path(__file__).resolve().parents[1]
        text = "".join(p.read_text() for p in sorted(root.glob("train/*.py")))[:60_000]
    d = tmp_path_factory.mktemp("corpus")
    cut = int(len(text) * 0.8)
    (d / "train").mkdir()
    (d / "val").mkdir()
    (d / "train" / "a.txt").write_text(text[:cut])
    (d / "val" / "a.txt").write_text(text[cut:])
    return d


def argv(hf_dir, corpus, workdir, *extra):
    # a large γ and a high interaction learning rate make sparsity appear within a few steps
    return ["finetune-dcp", "--workdir", str(workdir), "--hf-gpt2", str(hf_dir), "--data", str(corpus / "train"),
            "--val-data", str(corpus / "val"), "--tokenizer", str(GPT2_TOKENIZER), "--seq-len", "64",
            "--batch-size", "4", "--log-every", "1", "--eval-every", "5", "--eval-batches", "2", "--gamma", "5",
            "--interaction-lr", "0.3", "--alpha-steps", str(STEPS), "--warmup-steps", "1", "--no-progress", *extra]


def read_rows(workdir):
    rows = {}
    with open(Path(workdir) / "metrics.jsonl") as f:
        for line in f:
            r = json.loads(line)
            rows.setdefault(r["step"], {}).update(r)
    return rows


@pytest.fixture(scope="module")
def full_run(hf_dir, corpus, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("runs") / "full"
    assert cli.main(argv(hf_dir, corpus, workdir, "--steps", str(STEPS))) == 0
    return workdir


def test_metrics_alpha_schedule_and_sparsity(full_run):
    rows = read_rows(full_run)
    assert sorted(rows) == list(range(STEPS + 1))
    assert {"val_loss", "val_ppl", "val_sparsity", "val_sparsity_layer_0", "val_sparsity_layer_1"} <= set(rows[0])
    assert rows[0]["val_sparsity"] == 0.0  # β = 2 keeps every pair under the step mask at the start
    schedule = cosine_alpha_schedule(1.0, 8.0, STEPS)
    for s in range(1, STEPS + 1):
        r = rows[s]
        assert {"loss", "ce", "sparsity_loss", "sparsity", "sparsity_layer_0", "sparsity_layer_1", "alpha",
                "lr", "grad_norm", "tokens_per_sec", "beta_mean"} <= set(r)
        assert r["alpha"] == pytest.approx(float(schedule(s - 1)))  # step s runs with α(s − 1)
        assert r["loss"] == pytest.approx(r["ce"] + r["sparsity_loss"], rel=1e-5)
        assert r["lr"] == (0.0 if s == 1 else pytest.approx(1e-4))  # 1 warmup step, then constant
    assert rows[1]["alpha"] == 1.0 and rows[STEPS]["alpha"] > 7.5
    assert [s for s in rows if "val_loss" in rows[s]] == [0, 5, 10]
    # the sparsity term pushes β down and drops pairs, in training (soft mask) and at α = ∞
    assert rows[STEPS]["beta_mean"] < rows[1]["beta_mean"]
    assert rows[STEPS]["sparsity"] > 0.1 and rows[STEPS]["val_sparsity"] > 0.1
    assert rows[STEPS]["sparsity_loss"] < rows[1]["sparsity_loss"]
    saved = json.loads((full_run / "finetune_config.json").read_text())
    assert saved["alpha_steps"] == STEPS and saved["warmup_steps"] == 1 and saved["data"]["seq_len"] == 64


def test_export_loads_in_transformers(full_run):
    import torch
    import transformers

    from fox_jax.models.gpt2 import GPT2
    from fox_jax.models.hf_gpt2 import DCP_NAME, load_hf_gpt2

    hf = full_run / "hf"
    assert (hf / DCP_NAME).is_file() and (hf / "vocab.json").is_file()
    model = transformers.GPT2LMHeadModel.from_pretrained(hf).eval()
    cfg, params, step, _ = finetune_dcp.load_finetuned(str(full_run))
    assert step == STEPS and cfg.dcp
    cfg_hf, params_hf = load_hf_gpt2(hf)  # the DCP model comes back from the export
    assert cfg_hf.dcp and cfg_hf.interaction_dim == 64
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params_hf)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.random.default_rng(0).integers(0, 50257, (1, 24))
    dense_cfg, dense_params, _, _ = finetune_dcp.load_finetuned(str(full_run), dcp=False)
    ours = GPT2(dense_cfg).apply({"params": dense_params}, jnp.asarray(tokens, jnp.int32))[0]
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-3)


def test_resume_continues_exactly(full_run, hf_dir, corpus, tmp_path, capsys):
    workdir = tmp_path / "resumed"
    assert cli.main(argv(hf_dir, corpus, workdir, "--steps", "5")) == 0
    assert cli.main(argv(hf_dir, corpus, workdir, "--steps", "10")) == 2  # checkpoints exist: needs --resume
    assert "--resume" in capsys.readouterr().err
    assert cli.main(["finetune-dcp", "--workdir", str(workdir), "--resume", "--gamma", "1"]) == 2
    assert "gamma" in capsys.readouterr().err
    assert cli.main(["finetune-dcp", "--workdir", str(workdir), "--resume", "--steps", str(STEPS),
                     "--no-progress"]) == 0
    full, resumed = read_rows(full_run), read_rows(workdir)
    assert sorted(resumed) == sorted(full)
    for s in range(1, STEPS + 1):  # bit-identical after the restart
        assert resumed[s]["loss"] == full[s]["loss"] and resumed[s]["alpha"] == full[s]["alpha"], s
    assert resumed[STEPS]["val_loss"] == full[STEPS]["val_loss"]


def test_cli_errors_are_one_line(hf_dir, corpus, tmp_path, capsys):
    cases = [
        (argv(hf_dir, corpus, tmp_path / "a", "--seq-len", "512"), "n_positions"),
        (["finetune-dcp", "--workdir", str(tmp_path / "b"), "--hf-gpt2", str(tmp_path / "nope")], "--hf-gpt2"),
        (argv(hf_dir, corpus, tmp_path / "c", "--gamma-normalization", "causal", "--gamma", "-1"), "gamma"),
        (["finetune-dcp", "--workdir", str(tmp_path / "d"), "--hf-gpt2", str(hf_dir), "--data",
          str(corpus / "train")], "--tokenizer"),
    ]
    for args, needle in cases:
        assert cli.main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err


def test_gamma_code_normalisation_has_the_codes_gradient():
    """γ_eff·(causal mean) has the same gradient as the reference code's γ·mean over the (T−1)×T slice."""
    t = 16
    cfg = finetune_dcp.FinetuneConfig(gamma=0.3, gamma_normalization="code")
    gamma_eff = finetune_dcp.effective_gamma(cfg, t)
    assert gamma_eff == pytest.approx(0.3 * (t - 2) / (2 * t))
    assert finetune_dcp.effective_gamma(cfg.__class__(gamma=0.3, gamma_normalization="causal"), t) == 0.3
    x = -jnp.abs(jax.random.normal(jax.random.PRNGKey(0), (2, 3, t, t)))
    lower = jnp.tril(jnp.ones((t, t), bool), k=-1)
    masks = lambda v: jnp.where(lower, v, 0.0)  # log I: 0 on and above the diagonal  # noqa: E731
    g_code = jax.grad(lambda v: sparsity_loss(masks(v), 0.3, normalization="code"))(x)
    g_ours = jax.grad(lambda v: gamma_eff * sparsity_loss(masks(v), 1.0))(x)
    np.testing.assert_allclose(np.asarray(g_code), np.asarray(g_ours), rtol=1e-5, atol=1e-9)


def test_zeroshot_on_the_finetuned_run(full_run, capsys):
    eval_dir = SHARED / "eval"
    if not eval_dir.is_dir():
        pytest.skip("../shared/data/eval is absent")
    for extra, name in (([], "zeroshot.json"), (["--dcp"], "zeroshot_dcp.json")):
        assert cli.main(["zeroshot", "--workdir", str(full_run), "--tasks", "piqa", "--limit", "2",
                         "--eval-dir", str(eval_dir), "--no-progress", *extra]) == 0
        report = json.loads((full_run / "eval" / name).read_text())
        assert report["step"] == STEPS and report["results"]["piqa"]["n"] == 2
        assert ("sparsity" in report["results"]["piqa"]) == bool(extra)


def test_pretrain_gpt2_trains_dense_and_exports_a_finetunable_model(corpus, tmp_path):
    """``fox-jax pretrain-gpt2``: random init of the requested shape, dense (no interaction params), the
    loss falls, the LR follows warmup + cosine to 10 %, and the HF export is what finetune-dcp loads."""
    from fox_jax.models.hf_gpt2 import load_hf_gpt2

    workdir = tmp_path / "pre"
    steps = 12
    assert cli.main(["pretrain-gpt2", "--workdir", str(workdir), "--n-layer", "2", "--n-embd", "64", "--n-head", "4",
                     "--n-positions", "64", "--data", str(corpus / "train"), "--val-data", str(corpus / "val"),
                     "--tokenizer", str(GPT2_TOKENIZER), "--steps", str(steps), "--batch-size", "4",
                     "--warmup-steps", "2", "--lr", "3e-3", "--log-every", "1", "--eval-every", "0",
                     "--eval-batches", "2", "--no-progress"]) == 0
    rows = read_rows(workdir)
    lrs = [rows[s]["lr"] for s in range(1, steps + 1)]                 # row s used lr(s - 1)
    assert lrs[:3] == pytest.approx([0.0, 1.5e-3, 3e-3], rel=1e-5)     # linear warmup over 2 steps
    assert 3e-4 < lrs[-1] < 4e-4                                       # cosine, ending at 0.1·lr at `steps`
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))                # decreasing after the warmup
    assert rows[steps]["loss"] < rows[1]["loss"] - 0.5                 # it learns (10.8 → ~7 nats)
    assert rows[steps]["sparsity"] == 0.0 and "val_loss" in rows[steps]
    cfg, params = load_hf_gpt2(workdir / "hf")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_positions, cfg.dcp) == (2, 64, 4, 64, False)
    assert "q_int" not in params["h_0"]["attn"]
    saved = json.loads((workdir / "finetune_config.json").read_text())
    assert saved["dcp"] is False and saved["init_config"]["n_embd"] == 64 and saved["lr_decay"] == "cosine"
