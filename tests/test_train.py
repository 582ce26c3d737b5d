"""Training loop, checkpoints, exact resume, evaluation and the CLI (CPU, small models)."""

import json
import os
from pathlib import Path

import pytest

from fox_jax.train import cli, config as config_lib, data as data_lib, loop
from fox_jax.train.checkpoints import CheckpointError

from _stopping_iterator import StoppingIterator

SHARED = Path(os.environ.get("FOX_JAX_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def small_config(corpus_dir, steps=8, **kw) -> config_lib.ExperimentConfig:
    cfg = config_lib.preset("tiny")
    cfg = config_lib.apply_overrides(cfg, [
        f"data.train={corpus_dir}", "data.seq_len=32", "model.n_layers=2", "model.d_model=32", "model.n_heads=2",
        "model.attention_block=16", f"steps={steps}", "batch_size=4", "log_every=1", "eval_every=4",
        "ckpt_every=4", "eval_batches=2", "optim.warmup_steps=2",
    ])
    return config_lib.apply_overrides(cfg, [f"{k}={v}" for k, v in kw.items()])


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    # a small real corpus: some of this repository's own Python source, one document per file
    root = Path(__file__).resolve().parents[1]
    files = sorted(root.glob("fox_jax/**/*.py")) + sorted(root.glob("train/*.py"))
    for i, f in enumerate(files):
        (d / f"doc{i:03d}.txt").write_text(f.read_text())
    return d


def read_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def run8(corpus_dir, tmp_path_factory):
    """(workdir, RunResult) of ``small_config(steps=8)``: evaluations and checkpoints at steps 4 and 8 (the
    tests that resume or damage it work on a copy)."""
    workdir = tmp_path_factory.mktemp("run8") / "run"
    return workdir, loop.train(small_config(corpus_dir, steps=8), str(workdir), progress=False)


def copy_run(src: Path, dst: Path, last_step: int | None = None) -> Path:
    """A copy of the run ``src`` at ``dst``; ``last_step``: without the checkpoints after it."""
    import shutil

    shutil.copytree(src, dst)
    for p in (dst / "checkpoints").iterdir():
        if last_step is not None and p.name.isdigit() and int(p.name) > last_step:
            shutil.rmtree(p)
    return dst


def test_grad_accum_step_equals_the_whole_batch_step():
    """``grad_accum=2`` (two micro-batches of 2 rows, their gradients averaged) and ``grad_accum=1`` (one
    micro-batch of 4) take the same step on one batch of 4 unpadded rows: the loss is a mean over equally many
    tokens per micro-batch, so the means agree. float32 sums in another order: 1e-6 relative."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    cfg = config_lib.apply_overrides(config_lib.preset("tiny"), [
        "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.attention_block=16", "batch_size=4"])
    optimizer = loop.make_optimizer(cfg)
    state = loop.init_state(cfg, jax.random.PRNGKey(0), optimizer)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 17), 0, cfg.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": jnp.ones((4, 16), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(16), (4, 16))}
    model = cfg.model.build()
    out = [jax.jit(loop.make_train_step(loop.LMTask(cfg), model, optimizer, n))(state, batch, {}) for n in (1, 2)]
    (s1, m1), (s2, m2) = out
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-5)
    assert float(m1["grad_norm"]) > 0
    for a, b in zip(jax.tree_util.tree_leaves(s1.params), jax.tree_util.tree_leaves(s2.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_train_step_gpu_compiler_options_are_known_to_xla():
    """The XLA options the training loop compiles its step with on GPU (``loop.train_step_compiler_options``) are
    options this jaxlib knows: compiling with them here fails on a misspelt or retired name (as an unknown one
    does), so a jaxlib upgrade that drops one shows in the CPU suite, not on the device. The CPU step gets none."""
    import jax
    import jax.numpy as jnp

    options = loop.train_step_compiler_options("gpu")
    assert options and loop.train_step_compiler_options("cpu") == {}
    assert float(jax.jit(lambda x: x.sum(), compiler_options=options)(jnp.ones(3))) == 3.0
    with pytest.raises(Exception, match="No such compile option"):
        jax.jit(lambda x: x.sum(), compiler_options={"xla_gpu_no_such_option_here": True})(jnp.ones(3))


@pytest.mark.slow
def test_train_eval_and_metrics(run8, tmp_path):
    workdir, result = run8
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows] == list(range(0, 9))
    assert set(rows[0]) == {"step", "val_loss", "val_ppl"}  # evaluation before the first step
    rows = rows[1:]
    for r in rows:
        assert {"step", "loss", "lr", "tokens_per_sec", "grad_norm"} <= set(r)
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [4, 8] and all("val_ppl" in r for r in evals)
    assert result.val_loss == pytest.approx(evals[-1]["val_loss"])
    assert any(p.name.startswith("events") for p in (workdir / "tb").iterdir())
    from fox_jax.train import evaluate
    report = evaluate.evaluate_run(str(copy_run(workdir, tmp_path / "run")), num_docs=4)
    assert report["step"] == 8 and report["val_ppl"] > 1
    assert os.path.exists(report["per_position_png"])
    assert len(report["per_position_loss"]) == 32


class Interrupt(Exception):
    pass


def _interrupt():
    raise Interrupt()


@pytest.mark.slow
def test_resumed_run_matches_uninterrupted(corpus_dir, run8, tmp_path, monkeypatch):
    cfg = small_config(corpus_dir, steps=8)
    full = {r["step"]: r["loss"] for r in read_metrics(run8[0])[1:]}  # the uninterrupted run of cfg

    real = data_lib.make_train_iterator

    def crashing_iterator(*a, **kw):  # the run dies while fetching the 6th batch
        return StoppingIterator(real(*a, **kw), 5, _interrupt)

    monkeypatch.setattr(data_lib, "make_train_iterator", crashing_iterator)
    with pytest.raises(Interrupt):
        loop.train(cfg, str(tmp_path / "resumed"), progress=False)
    monkeypatch.setattr(data_lib, "make_train_iterator", real)
    with pytest.raises(FileExistsError, match="--resume"):
        loop.train(cfg, str(tmp_path / "resumed"), progress=False)
    loop.train(cfg, str(tmp_path / "resumed"), resume=True, progress=False)
    resumed = {}
    for r in read_metrics(tmp_path / "resumed")[1:]:
        resumed[r["step"]] = r["loss"]  # steps 1-4 from the first run, 5-8 after the resume
    assert sorted(resumed) == list(range(1, 9))
    assert resumed == full  # bit-identical losses


def test_resume_refuses_changed_model_and_keeps_checkpoint(corpus_dir, run8, tmp_path):
    cfg = small_config(corpus_dir, steps=4)
    copy_run(run8[0], tmp_path / "run", last_step=4)  # a run of cfg: the same steps 1-4, checkpoint 4
    changed = config_lib.apply_overrides(cfg, ["model.n_layers=3"])
    with pytest.raises(ValueError, match="model.n_layers"):
        loop.train(changed, str(tmp_path / "run"), resume=True, progress=False)
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir()


def test_corrupt_checkpoint_is_reported_not_destroyed(corpus_dir, run8, tmp_path):
    cfg = small_config(corpus_dir, steps=4)
    copy_run(run8[0], tmp_path / "run", last_step=4)  # a run of cfg: the same steps 1-4, checkpoint 4
    ckpt = tmp_path / "run" / "checkpoints" / "4" / "state"
    victims = [p for p in ckpt.rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert victims
    for p in victims:
        p.write_bytes(b"\x00garbage")
    before = sorted(str(p) for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(CheckpointError, match="step 4"):
        loop.train(config_lib.apply_overrides(cfg, ["steps=6"]), str(tmp_path / "run"), resume=True,
                      progress=False)
    assert sorted(str(p) for p in (tmp_path / "run").rglob("*")) == before


def test_cli_errors_are_one_line(corpus_dir, tmp_path, capsys):
    assert cli.main(["train", "--workdir", str(tmp_path / "x"), "--data", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--data" in err and "does not exist" in err
    assert cli.main(["train", "--workdir", str(tmp_path / "x"), "--data", str(corpus_dir), "--seq-len", "1"]) == 2
    assert "error: --seq-len must be at least 2" in capsys.readouterr().err  # the flag given
    assert cli.main(["train", "--workdir", str(tmp_path / "x"), "model.nonsense=3"]) == 2
    assert "unknown config field" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    assert cli.main(["train", "--workdir", str(tmp_path / "y"), "--data", str(empty)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert cli.main(["eval", "--workdir", str(tmp_path / "nothing")]) == 2
    assert "config.json" in capsys.readouterr().err


def _slice_corpus(src: Path, dst: Path, n_docs: int) -> None:
    """The first ``n_docs`` books of a Gutenberg shard (whole books, separator lines kept)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    out, docs = [], 0
    with open(src) as f:
        for line in f:
            out.append(line)
            if line.strip() == "<|endoftext|>":
                docs += 1
                if docs == n_docs:
                    break
    dst.write_text("".join(out))


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "corpus").is_dir(), reason="../shared/data is absent (set FOX_JAX_SHARED_DATA)")
def test_cli_on_gutenberg_slice_val_loss_falls(tmp_path, capsys):
    train_file = tmp_path / "train" / "books.txt"
    val_file = tmp_path / "val" / "books.txt"
    _slice_corpus(SHARED / "corpus" / "gutenberg_train_00.txt", train_file, 3)
    _slice_corpus(SHARED / "corpus_val" / "gutenberg_val.txt", val_file, 1)
    workdir = tmp_path / "run"
    argv = ["train", "--workdir", str(workdir), "--data", str(train_file.parent), "--val-data", str(val_file.parent),
            "--tokenizer", str(SHARED / "tokenizers" / "gpt2"), "--steps", "16", "--seq-len", "64",
            "--batch-size", "4", "--no-progress", "model.n_layers=2", "model.d_model=64", "model.n_heads=2",
            "eval_every=8", "eval_batches=2", "optim.lr=6e-3", "optim.warmup_steps=3"]
    assert cli.main(argv) == 0
    evals = [r["val_loss"] for r in read_metrics(workdir) if "val_loss" in r]
    assert len(evals) == 3  # steps 0, 8, 16
    # observed 10.83 (ln 50257) -> 9.58, 8.89: 1.9 nats in 16 steps of 4 x 64 tokens at lr 6e-3 (the
    # execution of the 50257-way head dominates this test at -O0: batch 8 at lr 3e-3 took twice as long)
    assert evals[-1] < evals[0] - 1.0, evals
    assert cli.main(["eval", "--workdir", str(workdir), "--num-docs", "1"]) == 0
    assert "val_ppl" in capsys.readouterr().out


@pytest.fixture(scope="module")
def cli_run(corpus_dir, tmp_path_factory):
    """An 8-step CLI run with checkpoints at steps 4 and 8 (copied by the tests that damage it)."""
    workdir = tmp_path_factory.mktemp("cli_run") / "run"
    assert cli.main(["train", "--workdir", str(workdir), "--data", str(corpus_dir), "--seq-len", "32",
                     "--batch-size", "4", "--steps", "8", "--no-progress", "model.n_layers=2", "model.d_model=32",
                     "model.n_heads=2", "model.attention_block=16", "log_every=1", "eval_every=4", "ckpt_every=4",
                     "eval_batches=2", "optim.warmup_steps=2", "async_checkpoints=false"]) == 0
    return workdir


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["metadata", "array"])
def test_corrupt_latest_checkpoint_names_the_intact_step_and_the_command(cli_run, victim, tmp_path, capsys):
    import shlex
    import shutil

    workdir = tmp_path / "run"
    shutil.copytree(cli_run, workdir)
    state = workdir / "checkpoints" / "8" / "state"
    if victim == "metadata":
        _truncate(state / "_METADATA")
    else:  # the largest array-data file of the OCDBT store
        _truncate(max((p for p in state.rglob("*") if p.is_file() and "ocdbt" in str(p.parent)),
                      key=lambda p: p.stat().st_size))
    capsys.readouterr()
    argv = ["train", "--workdir", str(workdir), "--resume", "--steps", "10", "--no-progress"]
    assert cli.main(argv) == 2
    # orbax may log tracebacks of its reader tasks on stderr; the error itself is one line
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fox-jax train: error:")]
    assert len(err) == 1, err
    err = err[0]
    assert "step 8" in err and "is corrupt" in err and "does not match" not in err and "step 4 is intact" in err
    assert ("metadata" if victim == "metadata" else "arrays") in err
    assert (workdir / "checkpoints" / "8").is_dir() and (workdir / "checkpoints" / "4").is_dir()  # kept
    command = shlex.split(err.split("continue from it with ", 1)[1])
    assert command[0] == "fox-jax" and command[-2:] == ["--resume-step", "4"]
    assert cli.main(command[1:]) == 0  # the printed command resumes from step 4
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 11))  # each step once
    original = {r["step"]: r["loss"] for r in read_metrics(cli_run) if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in rows if "loss" in r}
    # steps 5-8 are recomputed from step 4's state: the schedule now spans 10 steps, so compare step 5's
    # loss (computed with step 4's params, before any update under the new schedule): bit-identical
    assert resumed[5] == original[5]
    assert (workdir / "checkpoints_set_aside" / "8").is_dir()  # the corrupt step is moved, not deleted
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())[-1] == 10


def test_shape_mismatch_against_a_readable_checkpoint_is_not_corruption(cli_run):
    import jax

    from fox_jax.train.checkpoints import Checkpointer, CorruptCheckpointError

    cfg = config_lib.load_json(cli_run / "config.json")
    other = config_lib.apply_overrides(cfg, ["model.d_model=64"])
    abstract = jax.eval_shape(lambda: loop.init_state(other, jax.random.PRNGKey(0), loop.make_optimizer(other)))
    ckpt = Checkpointer(str(cli_run / "checkpoints"), async_save=False, create=False)
    try:
        with pytest.raises(CheckpointError, match="does not match this model/config: .* has shape") as e:
            ckpt.restore(8, abstract)
        assert not isinstance(e.value, CorruptCheckpointError)
    finally:
        ckpt.close()


def test_resume_refuses_a_preset_that_describes_another_model(cli_run, tmp_path, capsys):
    import shutil

    workdir = tmp_path / "run"
    shutil.copytree(cli_run, workdir)
    before = sorted(str(p) for p in workdir.rglob("*"))
    capsys.readouterr()
    assert cli.main(["train", "--preset", "125M", "--workdir", str(workdir), "--resume", "--steps", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--preset 125M" in err and "model.d_model" in err and "model.n_layers" in err
    assert cli.main(["train", "--arch", "fox-pro", "--workdir", str(workdir), "--resume", "--steps", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--arch fox-pro" in err and "model.qk_norm" in err
    assert sorted(str(p) for p in workdir.rglob("*")) == before  # nothing written
    # the preset the run was trained with (and its model overrides) is accepted
    # (--steps 10: the program the corrupt-checkpoint tests' resumes compiled, a compilation-cache hit)
    assert cli.main(["train", "--preset", "tiny", "--workdir", str(workdir), "--resume", "--steps", "10",
                     "--no-progress", "model.n_layers=2", "model.d_model=32", "model.n_heads=2",
                     "model.attention_block=16"]) == 0
    assert "recomputed for the new steps" in capsys.readouterr().err  # stretch, the default, says so (stderr)


def test_cli_resume_with_rewarm(cli_run, tmp_path, capsys):
    """An 8-step run resumed to 10 steps with --resume-schedule rewarm: the line, config.json and the logged
    learning rates follow the rewarmed schedule (a 2-step segment warms up over 1 step: steps 9 and 10 run at
    0 and the peak)."""
    import shutil

    workdir = tmp_path / "run"
    shutil.copytree(cli_run, workdir)
    capsys.readouterr()
    assert cli.main(["train", "--workdir", str(workdir), "--resume", "--steps", "10", "--resume-schedule", "rewarm",
                     "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "--resume with --steps 10 (the run had 8)" in err and "warming up again" in err
    cfg = config_lib.load_json(workdir / "config.json")
    assert cfg.optim.schedule_segments == ("0:8", "8") and cfg.optim.resume_schedule == "rewarm"
    rows = {r["step"]: r for r in read_metrics(workdir) if "lr" in r}
    assert rows[9]["lr"] == 0.0 and rows[10]["lr"] == pytest.approx(cfg.optim.lr)
