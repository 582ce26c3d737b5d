"""``--resume`` with another ``--steps``: the learning-rate schedule under ``optim.resume_schedule`` (stretch,
continue, rewarm) and the line that says how the rate moves (a resumed CLI run: tests/test_train.py)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.train import cli, config as config_lib, loop


def _cfg(steps, **optim):
    cfg = config_lib.preset("tiny")
    return dataclasses.replace(cfg, steps=steps, optim=dataclasses.replace(cfg.optim, **optim)).resolved()


def _lrs(cfg, n):
    return np.asarray(jax.vmap(loop.make_schedule(cfg))(jnp.arange(n)))


def test_resume_schedules(capsys):
    saved = _cfg(300)
    old = _lrs(saved, 600)
    # stretch (default): the cosine is recomputed for 600 steps, so the rate jumps at the resume step
    stretch = loop.resume_schedule(saved, _cfg(600), 300)
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("warning: ") and "--resume-schedule continue" in err  # on stderr, as eval's
    assert "step 300 ran at lr 1.02e-07, step 301 runs at 0.00162" in err
    assert stretch.optim.schedule_segments == ()
    np.testing.assert_allclose(_lrs(stretch, 600), _lrs(_cfg(600), 600))
    # continue: the old schedule, held at its end value (0 here: 300 steps at lr 0, a warning that says so)
    cont = loop.resume_schedule(saved, _cfg(600, resume_schedule="continue"), 300)
    err = capsys.readouterr().err
    assert cont.optim.schedule_segments == ("0:300",) and err.startswith("warning: ")
    assert "ends at 0 at step 300: the 300 steps after it train at lr 0" in err
    np.testing.assert_array_equal(_lrs(cont, 600), old)
    # rewarm: the old schedule up to the resume step, then warmup from 0 and a cosine to step 600
    rewarm = loop.resume_schedule(saved, _cfg(600, resume_schedule="rewarm"), 300)
    err = capsys.readouterr().err
    assert rewarm.optim.schedule_segments == ("0:300", "300")
    assert err.startswith("note: ") and "warming up again from 0 over 30 steps (optim.resume_schedule=rewarm)" in err
    lrs = _lrs(rewarm, 600)
    np.testing.assert_array_equal(lrs[:300], old[:300])
    np.testing.assert_allclose(lrs[300:], _lrs(_cfg(300), 300), rtol=1e-6)  # the warmup + cosine, shifted
    # rewarm on an extension shorter than twice the warmup: its decay would be shorter than the warmup, and the
    # line says so with the warmup it uses (cut to fit when the extension is shorter than warmup_steps)
    warmup = saved.optim.warmup_steps
    for extra, used in ((2 * warmup - 1, warmup), (warmup // 2, warmup // 2 - 1)):
        short = loop.resume_schedule(saved, _cfg(300 + extra, resume_schedule="rewarm"), 300)
        err = capsys.readouterr().err
        assert err.startswith("warning: ") and f"warming up again from 0 over {used} steps" in err, err
        assert f"{extra} more steps leave only {extra - used} after that warmup (fewer than warmup_steps " \
               f"{warmup}), too few for the decay" in err and f"give --steps {300 + 2 * warmup} or more" in err
        assert (f"cut to fit the {extra} steps left" in err) == (used < warmup)
    assert _lrs(short, 300 + warmup // 2)[-1] > 0.5 * saved.optim.lr
    loop.resume_schedule(saved, _cfg(300 + 2 * warmup, resume_schedule="rewarm"), 300)
    assert capsys.readouterr().err.startswith("note: ")  # twice the warmup: a decay as long as the warmup
    # a resume of the same length (after a crash) keeps the segments and prints nothing
    again = loop.resume_schedule(rewarm, dataclasses.replace(rewarm), 450)
    assert again.optim.schedule_segments == ("0:300", "300") and capsys.readouterr() == ("", "")
    # --resume-step back before a restart drops the abandoned segment
    back = loop.resume_schedule(rewarm, dataclasses.replace(rewarm), 200)
    assert back.optim.schedule_segments == ("0:300",)


def _workdir(tmp_path, cfg, step, lr=None):
    """A run directory as far as a resume reads it before any data: config.json, checkpoints/<step>/ (empty:
    the refusal comes before a checkpoint is read), and metrics.jsonl with the lr of ``step``."""
    config_lib.save_json(cfg, tmp_path / "config.json")
    (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
    if lr is not None:
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": step - 1, "lr": 1.0}) + "\n"
                                                + json.dumps({"step": step, "lr": lr}) + "\n")
    return tmp_path


def test_a_resume_with_fewer_steps_is_refused_and_changes_nothing(tmp_path, capsys):
    """A finished 300-step run resumed with --steps 200 used to rewrite config.json to 200 steps, and a later
    --resume --steps 600 then said "the run had 200" and "step 300 ran at lr 0"."""
    run = _workdir(tmp_path, config_lib.preset("tiny"), 300)
    before = (run / "config.json").read_text()
    for argv, named in (["--steps", "200"], "--steps 200"), (["steps=200"], "steps 200"):
        code = cli.main(["train", "--workdir", str(run), "--resume", "--no-progress", *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err == (f"fox-jax train: error: {named}: the run in {run} is at step 300 already (its "
                                     f"latest checkpoint); give {named.split()[0]} above 300 to train it further "
                                     "(config.json and the checkpoints are left as they are)")
        assert (run / "config.json").read_text() == before


def test_a_resume_reports_the_rate_the_run_trained_at(tmp_path, capsys):
    """The line's "step N ran at" is the logged rate; a config.json shortened by an earlier version (steps below
    its checkpoint) is read as a run at least that long."""
    saved = _cfg(200)
    run = _workdir(tmp_path, saved, 300, lr=1.02e-07)
    cfg = loop.resumed(saved, dataclasses.replace(saved, steps=600), str(run), 300)
    err = capsys.readouterr().err
    assert "(the run had 300)" in err and "step 300 ran at lr 1.02e-07, step 301 runs at 0.00162" in err, err
    assert cfg.steps == 600
    with pytest.raises(config_lib.FieldError, match=r"^steps 250: .* is at step 300 already \(--resume-step 300\)"):
        loop.resumed(saved, dataclasses.replace(saved, steps=250), str(run), 300, by_resume_step=True)


def test_a_run_no_longer_than_its_warmup_gets_a_note():
    """--steps 5 on the tiny preset (warmup 30) only warms up and ends at the peak rate: a note says so."""
    short = _cfg(5)
    note = loop.short_run_note(short, float(_lrs(short, 5)[-1]))
    assert note == ("note: the run's 5 steps are no longer than its warmup (warmup_steps 30): the learning rate only "
                    "rises and the last step runs at 0.003 (100% of the peak lr 0.003), with no decay; for a short run "
                    "give a smaller --warmup-steps (e.g. 1, 8% of the steps)")
    assert loop.short_run_note(_cfg(32), 0.0) is None and loop.short_run_note(_cfg(31), 0.003) is not None
    assert loop.short_run_note(_cfg(5, warmup_steps=0), 0.003) is None


@pytest.mark.parametrize("segments", [("1",), ("0:0",), ("0", "0"), ("0", "x")])
def test_bad_segments_name_the_field(segments):
    with pytest.raises(ValueError, match="optim.schedule_segments"):
        config_lib.OptimConfig(schedule_segments=segments)
    with pytest.raises(ValueError, match="optim.resume_schedule must be one of stretch, continue, rewarm"):
        config_lib.OptimConfig(resume_schedule="restart")
