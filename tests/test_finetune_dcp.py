"""``fox-jax finetune-dcp`` (train/finetune_dcp.py, a task on train/loop.py) on small self-made models and text
(CPU): a random-init GPT-2 saved as a Hugging Face directory and a FoX run of ``fox-jax train``, both with the
byte tokenizer: metrics, α schedule, sparsity, HF export, exact resume (also after a SIGKILL), sharded vs
unsharded runs, errors. With ../shared/data (the GPT-2 tokenizer, eval sets) and the ``hf`` extra, more:
the export loads in transformers, zero-shot on the runs, pretraining a GPT-2 on BPE text."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.ops.alpha_sigmoid import cosine_alpha_schedule
from fox_jax.ops.context_pruning import sparsity_loss
from fox_jax.train import cli, config as config_lib, finetune_dcp
from fox_jax.train.runs import open_run

# an end-to-end module (docs/setup.md): its tests train and fine-tune runs (module fixtures), so the whole module
# is outside the quick subset
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FOX_JAX_SHARED_DATA", ROOT.parent / "shared" / "data"))
GPT2_TOKENIZER = SHARED / "tokenizers" / "gpt2"
needs_gpt2_tokenizer = pytest.mark.skipif(
    not (GPT2_TOKENIZER / "vocab.json").is_file(),
    reason="the GPT-2 tokenizer of ../shared/data is absent (set FOX_JAX_SHARED_DATA)")
TINY = dict(n_layers=2, d_model=64, n_heads=4, vocab_size=257, n_positions=128)  # 257: the byte tokenizer
STEPS = 10


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random-init GPT-2 written as a Hugging Face directory (config.json + model.safetensors)."""
    from fox_jax.models.gpt2 import GPT2Config
    from fox_jax.models.hf_gpt2 import save_hf_gpt2

    cfg = GPT2Config(**TINY)
    path = tmp_path_factory.mktemp("hf_gpt2")
    save_hf_gpt2(cfg, cfg.init_params(jax.random.PRNGKey(0)), path)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~60 KB of this repository's source, split into train/val directories."""
    text = "".join(p.read_text() for p in sorted(ROOT.glob("train/*.py")))[:60_000]
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
            "--val-data", str(corpus / "val"), "--tokenizer", "bytes", "--seq-len", "64",
            "--batch-size", "4", "--log-every", "1", "--eval-every", "5", "--eval-batches", "2", "--gamma", "5",
            "--interaction-lr", "0.3", "--alpha-steps", str(STEPS), "--warmup-steps", "1", "--no-progress", *extra]


def read_rows(workdir):
    rows = {}
    with open(Path(workdir) / "metrics.jsonl") as f:
        for line in f:
            r = json.loads(line)
            rows.setdefault(r["step"], {}).update(r)
    return rows


def finetuned(workdir, dcp: bool = True):
    """(model config, params, step, ExperimentConfig) of a run's latest checkpoint (``dcp=False``: the dense part)."""
    run = open_run(workdir)
    run = run if dcp else run.without_dcp()
    return run.model, run.load_params(), run.step, run.config


def saved_config(workdir) -> dict:
    return json.loads((Path(workdir) / "config.json").read_text())


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
    saved = saved_config(full_run)
    assert saved["dcp"]["alpha_steps"] == STEPS and saved["optim"]["warmup_steps"] == 1
    assert saved["data"]["seq_len"] == 64 and saved["model"]["model_type"] == "gpt2" and saved["model"]["dcp"]


def test_export_holds_the_checkpoints_model(full_run):
    from fox_jax.models.hf_gpt2 import DCP_NAME, load_hf_gpt2

    hf = full_run / "hf"
    assert (hf / DCP_NAME).is_file()
    cfg, params, step, _ = finetuned(str(full_run))
    assert step == STEPS and cfg.dcp
    cfg_hf, params_hf = load_hf_gpt2(hf)  # the DCP model comes back from the export
    assert cfg_hf.dcp and cfg_hf.interaction_dim == 64
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params_hf)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_loads_in_transformers(full_run):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    model = transformers.GPT2LMHeadModel.from_pretrained(full_run / "hf").eval()
    tokens = np.random.default_rng(0).integers(0, TINY["vocab_size"], (1, 24))
    dense_cfg, dense_params, _, _ = finetuned(str(full_run), dcp=False)
    ours = dense_cfg.build().apply({"params": dense_params}, jnp.asarray(tokens, jnp.int32)).logits
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
    cfg = config_lib.DCPConfig(gamma=0.3, gamma_normalization="code")
    gamma_eff = finetune_dcp.effective_gamma(cfg, t)
    assert gamma_eff == pytest.approx(0.3 * (t - 2) / (2 * t))
    assert finetune_dcp.effective_gamma(config_lib.DCPConfig(gamma=0.3, gamma_normalization="causal"), t) == 0.3
    x = -jnp.abs(jax.random.normal(jax.random.PRNGKey(0), (2, 3, t, t)))
    lower = jnp.tril(jnp.ones((t, t), bool), k=-1)
    masks = lambda v: jnp.where(lower, v, 0.0)  # log I: 0 on and above the diagonal  # noqa: E731
    g_code = jax.grad(lambda v: sparsity_loss(masks(v), 0.3, normalization="code"))(x)
    g_ours = jax.grad(lambda v: gamma_eff * sparsity_loss(masks(v), 1.0))(x)
    np.testing.assert_allclose(np.asarray(g_code), np.asarray(g_ours), rtol=1e-5, atol=1e-9)


def test_zeroshot_on_the_finetuned_run(full_run, capsys):
    eval_dir = SHARED / "eval"
    if not eval_dir.is_dir():
        pytest.skip(f"{eval_dir} is absent (set FOX_JAX_SHARED_DATA)")
    for extra, name in (([], "zeroshot.json"), (["--dcp"], "zeroshot_dcp.json")):
        assert cli.main(["zeroshot", "--workdir", str(full_run), "--tasks", "piqa", "--limit", "2",
                         "--eval-dir", str(eval_dir), "--no-progress", *extra]) == 0
        report = json.loads((full_run / "eval" / name).read_text())
        assert report["step"] == STEPS and report["results"]["piqa"]["n"] == 2
        assert ("sparsity" in report["results"]["piqa"]) == bool(extra)


PRETRAIN_SHAPE = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--n-positions", "64"]
PRETRAIN_STEPS = 12


@pytest.fixture(scope="module")
def pretrain_run(corpus, tmp_path_factory):
    """A 12-step ``fox-jax pretrain-gpt2`` run (2 layers, d 64); the test that resumes it works on a copy."""
    workdir = tmp_path_factory.mktemp("pretrain") / "pre"
    assert cli.main(["pretrain-gpt2", "--workdir", str(workdir), *PRETRAIN_SHAPE, "--data", str(corpus / "train"),
                     "--val-data", str(corpus / "val"), "--tokenizer", "bytes", "--steps", str(PRETRAIN_STEPS),
                     "--batch-size", "4", "--warmup-steps", "2", "--lr", "3e-3", "--log-every", "1",
                     "--eval-every", "0", "--eval-batches", "2", "--no-progress"]) == 0
    return workdir


def test_pretrain_gpt2_trains_dense_and_exports_a_finetunable_model(pretrain_run):
    """``fox-jax pretrain-gpt2``: random init of the requested shape, dense (no interaction params), the
    loss falls, the LR follows warmup + cosine to 10 %, and the HF export is what finetune-dcp loads."""
    from fox_jax.models.hf_gpt2 import load_hf_gpt2

    workdir, steps = pretrain_run, PRETRAIN_STEPS
    rows = read_rows(workdir)
    lrs = [rows[s]["lr"] for s in range(1, steps + 1)]                 # row s used lr(s - 1)
    assert lrs[:3] == pytest.approx([0.0, 1.5e-3, 3e-3], rel=1e-5)     # linear warmup over 2 steps
    assert 3e-4 < lrs[-1] < 4e-4                                       # cosine, ending at 0.1·lr at `steps`
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))                # decreasing after the warmup
    assert rows[steps]["loss"] < rows[1]["loss"] - 0.5                 # it learns (5.6 nats = ln 257 at first)
    assert "val_loss" in rows[steps] and not {"sparsity", "alpha", "beta_mean"} & set(rows[steps])  # dense rows
    assert "NaN" not in (workdir / "metrics.jsonl").read_text()
    cfg, params = load_hf_gpt2(workdir / "hf")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_positions, cfg.dcp) == (2, 64, 4, 64, False)
    assert "q_int" not in params["h_0"]["attn"]
    saved = saved_config(workdir)
    assert saved["dcp"] is None and saved["model"]["model_type"] == "gpt2" and saved["model"]["d_model"] == 64
    assert saved["optim"]["schedule"] == "cosine" and saved["optim"]["min_lr_ratio"] == 0.1


def test_pretrain_gpt2_resume_refuses_another_shape(pretrain_run, tmp_path, capsys):
    import shutil

    workdir = tmp_path / "pre"
    shutil.copytree(pretrain_run, workdir)
    shape = PRETRAIN_SHAPE
    before = sorted(str(p) for p in workdir.rglob("*"))
    for flags, needle in [(["--n-layer", "3"], "model.n_layers"), (["--size", "gpt2-medium"], "model.d_model")]:
        assert cli.main(["pretrain-gpt2", "--workdir", str(workdir), "--resume", "--steps", "20", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err and "--resume" in err, err
    assert cli.main(["pretrain-gpt2", "--workdir", str(workdir), "--resume", "--resume-step", "1", "--steps", "20"]) == 2
    assert "no checkpoint for step 1" in capsys.readouterr().err
    assert sorted(str(p) for p in workdir.rglob("*")) == before
    # the same shape is accepted
    assert cli.main(["pretrain-gpt2", "--workdir", str(workdir), "--resume", *shape, "--steps", str(PRETRAIN_STEPS + 1),
                     "--no-progress"]) == 0


# --from-run: a FoX run of ``fox-jax train`` as the pretrained model ----------------------------------------

LM_STEPS = 6
LM_SEQ = 32


@pytest.fixture(scope="module")
def fox_run(corpus, tmp_path_factory):
    """A tiny FoX (LLaMA) run of fox-jax train (byte tokenizer, 2 steps) on the corpus fixture's text; ACP on
    (a float threshold) so that the conversion must turn it off."""
    from fox_jax.train import loop

    cfg = config_lib.apply_overrides(config_lib.preset("tiny"), [
        f"data.train={corpus / 'train'}", f"data.val={corpus / 'val'}", f"data.seq_len={LM_SEQ}",
        "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.attention_block=16",
        "model.adaptive_threshold=-30.0", "steps=2", "batch_size=4", "log_every=1", "eval_every=0",
        "ckpt_every=0", "eval_batches=1", "optim.warmup_steps=1", "async_checkpoints=false"])
    workdir = tmp_path_factory.mktemp("fox") / "run"
    loop.train(cfg, str(workdir), progress=False)
    return workdir


def lm_argv(run, workdir, *extra):
    # no --data / --tokenizer / --seq-len: the run's text, byte tokenizer and seq_len
    return ["finetune-dcp", "--workdir", str(workdir), "--from-run", str(run), "--batch-size", "4", "--log-every",
            "1", "--eval-every", "3", "--eval-batches", "2", "--gamma", "5", "--interaction-lr", "0.3",
            "--interaction-dim", "16", "--alpha-steps", str(LM_STEPS), "--warmup-steps", "1", "--no-progress",
            *extra]


@pytest.fixture(scope="module")
def lm_full_run(fox_run, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("runs") / "lm_full"
    assert cli.main(lm_argv(fox_run, workdir, "--steps", str(LM_STEPS))) == 0
    return workdir


def test_from_run_metrics_and_sparsity(lm_full_run, fox_run):
    rows = read_rows(lm_full_run)
    assert sorted(rows) == list(range(LM_STEPS + 1))
    assert [s for s in rows if "val_loss" in rows[s]] == [0, 3, 6]
    assert rows[0]["val_sparsity"] == 0.0  # β = 2 keeps every pair at the start
    schedule = cosine_alpha_schedule(1.0, 8.0, LM_STEPS)
    for s in range(1, LM_STEPS + 1):
        r = rows[s]
        assert {"loss", "ce", "sparsity_loss", "sparsity", "sparsity_layer_0", "sparsity_layer_1", "alpha",
                "lr", "grad_norm", "beta_mean"} <= set(r)
        assert all(np.isfinite(r[k]) for k in ("loss", "ce", "sparsity", "alpha", "beta_mean", "grad_norm")), r
        assert r["alpha"] == pytest.approx(float(schedule(s - 1)))
        assert r["loss"] == pytest.approx(r["ce"] + r["sparsity_loss"], rel=1e-5)
    assert rows[1]["beta_mean"] == pytest.approx(2.0)  # the update of step 1 has lr 0 (warmup)
    assert rows[LM_STEPS]["beta_mean"] < rows[1]["beta_mean"]
    assert rows[LM_STEPS]["sparsity"] > 0.05 and rows[LM_STEPS]["val_sparsity"] > 0.05
    saved = saved_config(lm_full_run)
    assert saved["dcp"]["from_run"] == str(fox_run) and saved["dcp"]["from_step"] == 2 and saved["dcp"]["hf_gpt2"] == ""
    assert saved["data"]["seq_len"] == LM_SEQ and saved["data"]["tokenizer"] == "bytes"  # the run's
    model_cfg = saved["model"]
    assert model_cfg["model_type"] == "lm" and model_cfg["dcp"] is True
    assert model_cfg["adaptive_threshold"] is None and model_cfg["interaction_dim"] == 16
    assert not (lm_full_run / "hf").exists()  # no HF export for FoX/Transformer


def _flat(tree):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_from_run_starts_from_the_run_and_resumes_exactly(lm_full_run, fox_run, tmp_path, capsys):
    from fox_jax.models import ModelConfig

    source = open_run(fox_run)
    src, src_step = source.load_params(), source.step
    assert source.kind == "train" and src_step == 2
    workdir = tmp_path / "lm_resumed"
    assert cli.main(lm_argv(fox_run, workdir, "--steps", "1")) == 0
    # step 1 ran with lr 0 (warmup from 0): its checkpoint holds the fine-tuning's initial params
    cfg, params, step, ft = finetuned(str(workdir))
    assert isinstance(cfg, ModelConfig) and cfg.dcp and step == 1 and ft.dcp.from_run == str(fox_run)
    flat = _flat(params)
    dense = {k: v for k, v in flat.items() if not any(n in k for n in finetune_dcp.INTERACTION_PARAMS)}
    src_flat = _flat(src)
    assert dense.keys() == src_flat.keys()
    for k, v in src_flat.items():
        np.testing.assert_array_equal(dense[k], v, err_msg=k)
    assert flat["['layers_1']['attn']['q_int']['kernel']"].shape == (32, 16)
    assert float(flat["['layers_0']['attn']['beta']"]) == 2.0
    dense_cfg, dense_params, _, _ = finetuned(str(workdir), dcp=False)
    assert not dense_cfg.dcp and _flat(dense_params).keys() == src_flat.keys()
    assert "no Hugging Face export" in capsys.readouterr().out
    # continue to the end: the same losses as the uninterrupted run
    assert cli.main(["finetune-dcp", "--workdir", str(workdir), "--resume", "--steps", str(LM_STEPS),
                     "--no-progress"]) == 0
    full, resumed = read_rows(lm_full_run), read_rows(workdir)
    assert sorted(resumed) == sorted(full)
    for s in range(1, LM_STEPS + 1):
        assert resumed[s]["loss"] == full[s]["loss"] and resumed[s]["beta_mean"] == full[s]["beta_mean"], s
    assert resumed[LM_STEPS]["val_loss"] == full[LM_STEPS]["val_loss"]


TIMING = {"tokens_per_sec", "tflops", "mfu"}


def test_killed_run_resumes_with_each_row_once(lm_full_run, fox_run, tmp_path):
    """A fine-tune SIGKILLed after step 4 (last checkpoint: step 3) and resumed: metrics.jsonl holds each step
    exactly once, with the values of the uninterrupted run."""
    workdir = tmp_path / "killed"
    args = lm_argv(fox_run, workdir, "--steps", str(LM_STEPS), "--ckpt-every", "3", "async_checkpoints=false")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_blocking_finetune.py"), "4", *args], env=env,
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while 4 not in (read_rows(workdir) if (workdir / "metrics.jsonl").is_file() else {}):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [3]
    assert cli.main(["finetune-dcp", "--workdir", str(workdir), "--resume", "--no-progress"]) == 0
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(LM_STEPS + 1))
    full = read_rows(lm_full_run)
    for r in lines:
        assert {k: v for k, v in r.items() if k not in TIMING} == {k: v for k, v in full[r["step"]].items()
                                                                    if k not in TIMING}, r["step"]


def test_from_run_cli_errors(fox_run, tmp_path, capsys):
    hf_dir = tmp_path / "hf"  # never read: both errors come before it is opened
    assert cli.main(["finetune-dcp", "--workdir", str(tmp_path / "a"), "--hf-gpt2", str(hf_dir), "--from-run",
                     str(fox_run)]) == 2  # argparse's mutually exclusive group, as one line
    err = capsys.readouterr().err
    assert "--from-run" in err and "--hf-gpt2" in err and "not allowed" in err and len(err.strip().splitlines()) == 1
    import tokenizers  # a tokenizer with more ids (301) than the run's model (257)

    big = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(300)} | {"[UNK]": 300},
                                                           unk_token="[UNK]"))
    big.add_special_tokens(["<|endoftext|>"])
    big.save(str(tmp_path / "big.json"))
    cases = [
        (lm_argv(fox_run, tmp_path / "b", "--tokenizer", str(tmp_path / "big.json")), "--tokenizer"),
        (lm_argv(tmp_path / "nope", tmp_path / "c"), "--from-run"),
        (lm_argv(fox_run, tmp_path / "d", "--from-step", "7"), "--from-step 7"),
        (["finetune-dcp", "--workdir", str(tmp_path / "e"), "--hf-gpt2", str(hf_dir), "--from-step", "1"],
         "--from-step"),
    ]
    for args, needle in cases:
        assert cli.main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    with pytest.raises(ValueError, match="mutually exclusive"):
        config_lib.DCPConfig(hf_gpt2="x", from_run="y")


def test_zeroshot_on_a_from_run_model(lm_full_run):
    eval_dir = SHARED / "eval"
    if not eval_dir.is_dir():
        pytest.skip(f"{eval_dir} is absent (set FOX_JAX_SHARED_DATA)")
    for extra, name in (([], "zeroshot.json"), (["--dcp"], "zeroshot_dcp.json")):
        assert cli.main(["zeroshot", "--workdir", str(lm_full_run), "--tasks", "copa", "--limit", "2",
                         "--eval-dir", str(eval_dir), "--no-progress", "--batch-size", "4", *extra]) == 0
        report = json.loads((lm_full_run / "eval" / name).read_text())
        assert report["model"] == "fox-llama" and report["step"] == LM_STEPS and report["max_length"] == LM_SEQ
        assert report["results"]["copa"]["n"] == 2 and report["dcp"] is bool(extra)
        assert ("sparsity" in report["results"]["copa"]) == bool(extra)


def test_dcp_eval_refuses_a_from_run_model_clearly(lm_full_run):
    """dcp-eval's fixed-pattern baselines are GPT-2 only: a FoX fine-tuning run gets a one-line reason."""
    from fox_jax.train import dcp_eval

    with pytest.raises(ValueError, match="from-run"):
        dcp_eval.load_run(str(lm_full_run))


def test_pallas_dcp_impl_follows_the_xla_run(full_run, hf_dir, corpus, tmp_path):
    """``--dcp-impl pallas`` (interpret mode here) trains the same model: the losses match the default
    blockwise run to 1e-4 relative (float32; tiles and summation order differ, and a few optimizer steps
    amplify ~1e-6 differences slightly). Two Pallas steps (step 1 runs at lr 0, so step 2's update is the
    first from the Pallas gradients); step 3, resumed on the XLA path, computes its loss with those params."""
    workdir = tmp_path / "pallas"
    assert cli.main(argv(hf_dir, corpus, workdir, "--steps", "2", "--dcp-impl", "pallas")) == 0
    assert saved_config(workdir)["model"]["dcp_impl"] == "pallas"
    ref, got = read_rows(full_run), read_rows(workdir)
    for step in (1, 2):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-4), step
        assert got[step]["sparsity"] == pytest.approx(ref[step]["sparsity"], abs=1e-4), step
    # the implementation may change on --resume (same math): step 3 on the XLA path, after the Pallas update
    assert cli.main(argv(hf_dir, corpus, workdir, "--steps", "3", "--dcp-impl", "xla", "--resume")) == 0
    assert read_rows(workdir)[3]["loss"] == pytest.approx(ref[3]["loss"], rel=1e-4)


def test_sharded_and_unsharded_finetunes_agree(fox_run, tmp_path):
    """The DCP fine-tune of the FoX run on 8 simulated CPU devices (a subprocess; mesh data=2, fsdp=2,
    tensor=2: the batch over 4 devices, parameters over fsdp and tensor) and on one device agree for 3 steps
    (step 1 at lr 0, then two updates; step 3 already runs at α = 2.75 with half the pairs dropped, gnorm ~18).

    The meshes change only the order of float32 reductions: the batch gradient is a sum of per-device partial
    sums, the fsdp/tensor-sharded matmuls sum their contraction in pieces. The interaction parameters amplify
    those ~1e-7 relative differences: their Adam step (learning rate 0.3) divides the gradient by its own
    running RMS, so an element whose gradient is small moves by up to 0.3 per step whatever its size, and once
    pairs are dropped the α-sigmoid mask (steeper as α grows) feeds differences in z back into the loss. Measured (the
    runs are deterministic, the same numbers every time): after 3 steps the loss and CE to 1.7e-7 relative,
    the sparsity term to 3.3e-7, the gradient norm to 2.1e-6, β̄ exactly, the trunk's parameters to 7.5e-9 and
    the interaction parameters to 8.9e-6 (median 1.2e-7). A 4th step (α = 4.5, 94 % dropped) grows the
    interaction parameters' difference to 3.4e-4 (196 of 512 elements over 1e-5) and the gradient norm's to
    3.4e-4: the drift is amplified step by step, so the comparison stops at 3 steps. Allowed: 1e-6, 1e-6,
    5e-6, 5e-5 (relative), 1e-6 (absolute) and 5e-5 (absolute; 5x the largest observed).
    """
    steps = ["--steps", "3", "--ckpt-every", "0"]
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")  # conftest's flags (-O0) too
    sharded = subprocess.Popen([sys.executable, "-m", "fox_jax.train.cli",
                                *lm_argv(fox_run, tmp_path / "sharded", *steps, "--mesh", "data=2,fsdp=2,tensor=2")],
                               env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert cli.main(lm_argv(fox_run, tmp_path / "single", *steps)) == 0
    out, err = sharded.communicate(timeout=900)
    assert sharded.returncode == 0, err[-3000:]
    assert "mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in out
    one, eight = read_rows(tmp_path / "single"), read_rows(tmp_path / "sharded")
    assert sorted(one) == sorted(eight) == list(range(4))
    assert one[3]["sparsity"] > 0.2  # the steep-mask regime is reached within the compared steps
    for s in range(1, 4):
        for k, rel in (("loss", 1e-6), ("ce", 1e-6), ("sparsity_loss", 5e-6), ("beta_mean", 1e-6),
                       ("grad_norm", 5e-5)):
            assert eight[s][k] == pytest.approx(one[s][k], rel=rel), (s, k)
        assert eight[s]["sparsity"] == pytest.approx(one[s]["sparsity"], abs=1e-5), s
    assert eight[3]["val_loss"] == pytest.approx(one[3]["val_loss"], rel=1e-6)
    _, p1, _, _ = finetuned(str(tmp_path / "single"))
    _, p8, _, _ = finetuned(str(tmp_path / "sharded"))
    f1, f8 = _flat(p1), _flat(p8)
    assert f1.keys() == f8.keys()
    for k in f1:
        interaction = any(n in k for n in finetune_dcp.INTERACTION_PARAMS)
        np.testing.assert_allclose(f8[k], f1[k], rtol=0, atol=5e-5 if interaction else 1e-6, err_msg=k)
