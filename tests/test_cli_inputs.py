"""Bad command-line input and config values: one-line errors naming the field, overrides anywhere on the
command line, and test collection without the optional test dependencies (CPU, no training)."""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fox_jax.models import ARCHS, SIZES, ModelConfig
from fox_jax.models.gpt2 import GPT2Config, gpt2_preset
from fox_jax.train import cli, config as config_lib

ROOT = Path(__file__).resolve().parents[1]

# (override, field named in the error): values that cannot be meant, one per numeric field of ExperimentConfig
BAD_TRAIN_OVERRIDES = [
    ("optim.lr=-1", "optim.lr"), ("optim.lr=0", "optim.lr"), ("optim.lr=nan", "optim.lr"),
    ("optim.warmup_steps=-1", "optim.warmup_steps"), ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio"),
    ("optim.b1=1", "optim.b1"), ("optim.b2=-0.1", "optim.b2"), ("optim.eps=0", "optim.eps"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"), ("optim.clip_norm=-1", "optim.clip_norm"),
    ("data.seq_len=-4", "data.seq_len"), ("data.val_fraction=1", "data.val_fraction"),
    ("data.val_fraction=-0.1", "data.val_fraction"), ("data.seed=-1", "data.seed"), ("data.max_docs=-2", "data.max_docs"),
    ("steps=0", "steps"), ("batch_size=-16", "batch_size"), ("grad_accum=0", "grad_accum"), ("seed=-3", "seed"),
    ("log_every=0", "log_every"), ("eval_every=-1", "eval_every"), ("eval_batches=0", "eval_batches"),
    ("ckpt_every=-5", "ckpt_every"), ("keep_checkpoints=0", "keep_checkpoints"),
    ("model.d_model=-8", "model.d_model"), ("model.n_kv_heads=0", "model.n_kv_heads"),
    ("model.hidden_ratio=0", "model.hidden_ratio"), ("model.rope_base=1", "model.rope_base"),
    ("model.norm_eps=0", "model.norm_eps"), ("model.init_std=-0.02", "model.init_std"),
    ("model.mlp_dim=-1", "model.mlp_dim"), ("model.adaptive_threshold=0.5", "ModelConfig.adaptive_threshold"),
    ("model.dcp_beta_init=inf", "model.dcp_beta_init"),
]

# flags of finetune-dcp / pretrain-gpt2 with a value out of range: the error names the flag
BAD_FINETUNE_FLAGS = [
    ["--lr", "-1"], ["--lr", "0"], ["--warmup-steps", "-1"], ["--weight-decay", "-1"], ["--clip-norm", "-1"],
    ["--interaction-lr", "0"], ["--gamma", "-1"], ["--interaction-dim", "0"], ["--beta-init", "nan"],
    ["--alpha-init", "0.5"], ["--alpha-final", "0"], ["--alpha-steps", "0"], ["--steps", "-1"], ["--batch-size", "0"],
    ["--seed", "-1"], ["--data-seed", "-1"], ["--seq-len", "-3"], ["--log-every", "0"], ["--eval-every", "-1"],
    ["--eval-batches", "0"], ["--ckpt-every", "-5"],
]

DCP_FLAGS = {"--interaction-lr", "--gamma", "--interaction-dim", "--beta-init", "--alpha-init", "--alpha-final",
             "--alpha-steps"}  # finetune-dcp only


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"fox-jax {command}: error: "), err
    return err


@pytest.mark.parametrize("override,field", BAD_TRAIN_OVERRIDES, ids=[o for o, _ in BAD_TRAIN_OVERRIDES])
def test_train_refuses_out_of_range_values(override, field, tmp_path, capsys):
    # --data names a missing path: even a config that passed would stop before training
    assert cli.main(["train", "--workdir", str(tmp_path / "run"), "--data", str(tmp_path / "missing"),
                     "--no-progress", override]) == 2
    assert f"{field} must be" in _one_line_error(capsys, "train")
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.parametrize("flags", BAD_FINETUNE_FLAGS, ids=[" ".join(f) for f in BAD_FINETUNE_FLAGS])
def test_finetune_and_pretrain_refuse_out_of_range_values(flags, tmp_path, capsys):
    src = tmp_path / "hf"
    src.mkdir()  # never read: the config is refused first
    common = ["--workdir", str(tmp_path / "run"), "--tokenizer", str(src), "--no-progress", *flags]
    assert cli.main(["finetune-dcp", "--hf-gpt2", str(src), *common]) == 2
    assert _one_line_error(capsys, "finetune-dcp").startswith(f"fox-jax finetune-dcp: error: {flags[0]} must be ")
    if flags[0] not in DCP_FLAGS:
        assert cli.main(["pretrain-gpt2", "--n-layer", "2", "--n-embd", "64", "--n-head", "4", *common]) == 2
        assert _one_line_error(capsys, "pretrain-gpt2").startswith(f"fox-jax pretrain-gpt2: error: {flags[0]} must be ")
    assert not (tmp_path / "run").exists()


# (arguments, the error): a bad value names the flag the user typed, or the key of a key=value override;
# "unset" for None, choices as a list
NAMED_ERRORS = [
    (["--steps", "-5"], "--steps must be an int >= 1, got -5"),
    (["steps=-5"], "steps must be an int >= 1, got -5"),
    (["--batch-size", "0"], "--batch-size must be an int >= 1, got 0"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["optim.lr=0", "--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),  # the flag wins, and is named
    (["--warmup-steps", "-1"], "--warmup-steps must be unset or an int >= 0, got -1"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps must be unset or an int >= 0, got -1"),
    (["--grad-accum", "3"], "--batch-size (16) must be a multiple of --grad-accum (3)"),
    (["--seq-len", "1"], "--seq-len must be at least 2 (or 0: the model's length), got 1"),
    (["--arch", "foo"], "--arch must be one of fox-llama, transformer-llama, fox-pro, transformer-pro; got 'foo'"),
    (["optim.schedule=linear"], "optim.schedule must be one of cosine, constant, got 'linear'"),
    (["model.n_heads=3"], "model.d_model (128) must be divisible by model.n_heads (3) unless model.head_dim is given"),
]


@pytest.mark.parametrize("args,message", NAMED_ERRORS, ids=[" ".join(a) for a, _ in NAMED_ERRORS])
def test_train_errors_name_the_flag_given(args, message, tmp_path, capsys):
    assert cli.main(["train", "--workdir", str(tmp_path / "run"), "--data", str(tmp_path / "missing"), *args]) == 2
    assert _one_line_error(capsys, "train") == f"fox-jax train: error: {message}"


def test_field_errors_rename_whole_names_only():
    from fox_jax.config import FieldError

    e = FieldError("steps 3: /runs/steps/a (optim.warmup_steps 9, resume_steps 2) is at step 12; give steps above 12",
                   "steps")
    assert e.renamed({"steps": "--steps"}.get) == (
        "--steps 3: /runs/steps/a (optim.warmup_steps 9, resume_steps 2) is at step 12; give --steps above 12")
    assert e.renamed(lambda key: None) == str(e)


def test_eval_refuses_out_of_range_overrides(tmp_path, capsys):
    config_lib.save_json(config_lib.preset("tiny"), tmp_path / "config.json")
    for override, field in [("data.val_fraction=2", "data.val_fraction"), ("batch_size=0", "batch_size"),
                            ("eval_batches=-1", "eval_batches"), ("data.seq_len=-1", "data.seq_len")]:
        assert cli.main(["eval", "--workdir", str(tmp_path), override]) == 2
        assert f"{field} must be" in _one_line_error(capsys, "eval")


def test_model_configs_refuse_out_of_range_values():
    for kw, field in [(dict(norm_eps=-1.0), "norm_eps"), (dict(head_dim=0), "head_dim"),
                      (dict(n_layers=True), "n_layers"), (dict(hidden_ratio=float("nan")), "hidden_ratio")]:
        with pytest.raises(ValueError, match=f"ModelConfig.{field} must be"):
            ModelConfig(**kw)
    for kw, field in [(dict(norm_eps=0.0), "norm_eps"), (dict(init_std=-1.0), "init_std"),
                      (dict(dcp_beta_init=float("inf")), "dcp_beta_init"), (dict(mlp_dim=0), "mlp_dim")]:
        with pytest.raises(ValueError, match=f"GPT2Config.{field} must be"):
            GPT2Config(**kw)


def test_defaults_and_presets_validate():
    for size in SIZES:
        for arch in ARCHS:
            config_lib.from_dict(config_lib.to_dict(config_lib.preset(size, arch)))  # the JSON round trip too
    ModelConfig(**dataclasses.asdict(ModelConfig()))
    for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        gpt2_preset(name)
    config_lib.finetune_defaults()
    config_lib.gpt2_defaults(gpt2_preset("gpt2")).resolved()
    # boundary values that are meant: 0 = never / off / all, None = resolved later
    config_lib.apply_overrides(config_lib.preset("tiny"), [
        "eval_every=0", "ckpt_every=0", "optim.warmup_steps=0", "optim.min_lr_ratio=1", "optim.weight_decay=0",
        "data.val_fraction=0", "data.max_docs=0", "model.adaptive_threshold=auto", "model.adaptive_threshold=-3"])
    config_lib.apply_overrides(config_lib.finetune_defaults(), [
        "optim.clip_norm=0", "dcp.gamma=0", "eval_every=0", "ckpt_every=0", "optim.warmup_steps=0",
        "dcp.alpha_init=1", "dcp.alpha_final=1"])


def test_remat_none_is_the_policy_named_none():
    """``--remat none`` / ``model.remat=none`` turn the default ``dots`` off: a str field keeps the word "none"
    (an Optional field still reads it as None)."""
    cfg = config_lib.apply_overrides(config_lib.preset("tiny"), cli.explicit_overrides(cli.parse_args(
        ["train", "--workdir", "w", "--remat", "none", "model.adaptive_threshold=none"])))
    assert cfg.model.remat == "none" and cfg.model.adaptive_threshold is None
    assert config_lib.apply_overrides(config_lib.preset("tiny"), ["model.remat=NONE"]).model.remat == "none"
    assert config_lib.preset("tiny").model.remat == "dots"


def test_overrides_anywhere_on_the_command_line(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    args = cli.parse_args(["train", "--workdir", "w", "steps=3", "--no-progress", "model.n_layers=2", "--data",
                           str(corpus), "optim.lr=1e-3", "--steps", "4", "eval_every=0"])
    assert args.overrides == ["steps=3", "model.n_layers=2", "optim.lr=1e-3", "eval_every=0"]
    assert args.data == [str(corpus)] and args.steps == 4 and args.no_progress
    args = cli.parse_args(["eval", "--workdir", "w", "data.seq_len=64", "--num-docs", "2", "batch_size=2"])
    assert args.overrides == ["data.seq_len=64", "batch_size=2"] and args.num_docs == 2
    cfg = config_lib.apply_overrides(config_lib.preset("tiny"), cli.explicit_overrides(cli.parse_args(
        ["train", "--workdir", "w", "model.n_layers=3", "--no-progress", "model.d_model=64"])))
    assert (cfg.model.n_layers, cfg.model.d_model) == (3, 64)


def test_unknown_tokens_are_one_line_errors(tmp_path, capsys):
    assert cli.main(["train", "--workdir", str(tmp_path / "w"), "a.b=1", "--no-progress", "--bogus", "3"]) == 2
    err = _one_line_error(capsys, "train")
    assert "'--bogus'" in err and "key=value" in err
    assert cli.main(["finetune-dcp", "--workdir", str(tmp_path / "w"), "--hf-gpt2", str(tmp_path), "lr=1"]) == 2
    assert "'lr=1'" in _one_line_error(capsys, "finetune-dcp")
    assert not (tmp_path / "w").exists()


def test_argparse_errors_are_one_line(tmp_path, capsys):
    """A flag's value of the wrong type, a flag without its value and a missing required flag: one line naming
    the flag (argparse's usage text is not printed), exit 2, nothing written."""
    for argv, want in ((["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
                       (["--lr"], "argument --lr: expected one argument")):
        assert cli.main(["train", "--workdir", str(tmp_path / "w"), *argv]) == 2
        assert want in _one_line_error(capsys, "train")
    assert cli.main(["eval"]) == 2
    assert "the following arguments are required: --workdir" in _one_line_error(capsys, "eval")
    assert not (tmp_path / "w").exists()


def test_collection_survives_missing_optional_test_dependencies():
    """``pytest -m gpu`` on a machine with only the package installed: modules that need nbformat,
    nbclient, torch, transformers or hypothesis skip instead of breaking the collection of the others."""
    blocked = ("nbformat", "nbclient", "torch", "transformers", "hypothesis")
    code = f"""
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Blocker())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                      "-p", "no:xdist", {str(ROOT / 'tests')!r}]))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not re.search(r"\b\d+ errors?\b|^ERROR", result.stdout, re.M), result.stdout[-3000:]
