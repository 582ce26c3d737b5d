"""``--resume`` with another ``--steps``: the learning-rate schedule under ``optim.resume_schedule`` (stretch,
continue, rewarm) and the line that says how the rate moves (a resumed CLI run: tests/test_train.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.train import config as config_lib, loop


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
    out = capsys.readouterr().out
    assert stretch.optim.schedule_segments == () and "warning:" in out and "--resume-schedule continue" in out
    assert "step 300 ran at lr 1.02e-07, step 301 runs at 0.00162" in out
    np.testing.assert_allclose(_lrs(stretch, 600), _lrs(_cfg(600), 600))
    # continue: the old schedule, held at its end value (0 here: the line says so)
    cont = loop.resume_schedule(saved, _cfg(600, resume_schedule="continue"), 300)
    out = capsys.readouterr().out
    assert cont.optim.schedule_segments == ("0:300",) and "warning:" not in out and "ends at 0 at step 300: the steps after it train at lr 0" in out
    np.testing.assert_array_equal(_lrs(cont, 600), old)
    # rewarm: the old schedule up to the resume step, then warmup from 0 and a cosine to step 600
    rewarm = loop.resume_schedule(saved, _cfg(600, resume_schedule="rewarm"), 300)
    assert rewarm.optim.schedule_segments == ("0:300", "300") and "warming up again" in capsys.readouterr().out
    lrs = _lrs(rewarm, 600)
    np.testing.assert_array_equal(lrs[:300], old[:300])
    np.testing.assert_allclose(lrs[300:], _lrs(_cfg(300), 300), rtol=1e-6)  # the warmup + cosine, shifted
    assert "no room to decay" not in capsys.readouterr().out
    # rewarm on an extension shorter than the warmup: it would end near the peak, and says so
    warmup = saved.optim.warmup_steps
    short = loop.resume_schedule(saved, _cfg(300 + warmup // 2, resume_schedule="rewarm"), 300)
    out = capsys.readouterr().out
    assert out.startswith("warning:") and "leave no room to decay" in out and "--warmup-steps" in out
    assert _lrs(short, 300 + warmup // 2)[-1] > 0.5 * saved.optim.lr
    # a resume of the same length (after a crash) keeps the segments and prints nothing
    again = loop.resume_schedule(rewarm, dataclasses.replace(rewarm), 450)
    assert again.optim.schedule_segments == ("0:300", "300") and capsys.readouterr().out == ""
    # --resume-step back before a restart drops the abandoned segment
    back = loop.resume_schedule(rewarm, dataclasses.replace(rewarm), 200)
    assert back.optim.schedule_segments == ("0:300",)


@pytest.mark.parametrize("segments", [("1",), ("0:0",), ("0", "0"), ("0", "x")])
def test_bad_segments_name_the_field(segments):
    with pytest.raises(ValueError, match="optim.schedule_segments"):
        config_lib.OptimConfig(schedule_segments=segments)
    with pytest.raises(ValueError, match="--resume-schedule"):
        config_lib.OptimConfig(resume_schedule="restart")
