"""The CLI's responsiveness and output: --help without jax, progress in logs (no bars, heartbeats),
the loss-curve PNG and eval's explanation of its two means."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fox_jax.train import cli, commands, metrics, progress, zeroshot

HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "grain", "torch", "numpy", "tensorflow")
COMMANDS = ("", "train", "eval", "zeroshot", "finetune-dcp", "pretrain-gpt2", "dcp-eval")

_PROBE = """
import json, sys
from fox_jax.train import cli
for command in {commands!r}:
    try:
        cli.parse_args(([command] if command else []) + ["--help"])
    except SystemExit:
        pass
try:
    cli.parse_args(["train", "--workdir", "x", "--bogus"])
except ValueError:
    pass
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}})))
"""


def test_every_help_and_argument_error_imports_no_jax():
    out = subprocess.run([sys.executable, "-c", _PROBE.format(commands=COMMANDS)], capture_output=True, text=True,
                         check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_help_wall_time_is_reported(capsys):
    times = {}
    for command in COMMANDS:
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "fox_jax.train.cli", *([command] if command else []), "--help"],
                             capture_output=True, text=True)
        times[command or "(top level)"] = time.perf_counter() - t0
        assert run.returncode == 0 and "usage: fox-jax" in run.stdout, run.stderr
    with capsys.disabled():
        print("\n--help wall time: " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))


def test_train_help_lists_every_config_field_with_its_default(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["train", "--help"])
    text = capsys.readouterr().out
    from fox_jax.train import config as config_lib
    import dataclasses

    tiny = config_lib.preset("tiny")
    for f in dataclasses.fields(tiny):
        v = getattr(tiny, f.name)
        if dataclasses.is_dataclass(v):
            for g in dataclasses.fields(v):
                assert f"{f.name}.{g.name}=" in text
        else:
            assert f"{f.name}=" in text
    assert "model.n_layers=4" in text and "optim.lr=0.003" in text and "heartbeat_secs=60" in text
    assert "model.vocab_size=257" in text  # what the tiny run saves (the byte tokenizer's)
    # a flag whose default differs between the presets says so, with tiny's value; one the presets share, plainly
    for key, tiny_value in (("steps", 300), ("optim.lr", 0.003), ("optim.warmup_steps", 30), ("eval_every", 100),
                            ("model.dtype", "float32")):
        assert re.search(rf"\[{re.escape(key)};\s+default\s+the\s+preset's\s+\(tiny:\s+{tiny_value}\)\]", text), key
    assert re.search(r"\[optim.weight_decay;\s+default 0.1\]", text)
    assert re.search(r"the\s+tiny\s+preset's\s+30\s+=\s+10%\s+of\s+its\s+300", text)  # --warmup-steps: next to its formula


def test_every_command_help_has_one_layout(capsys):
    """Every command's help (the top level's too) puts the flags' text in one column, however short its flags."""
    columns = {}
    for command in (*COMMANDS, "generate", "passkey"):
        with pytest.raises(SystemExit):
            cli.parse_args(([command] if command else []) + ["--help"])
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  -h, --help"))
        columns[command] = line.index("show this help")
    assert set(columns.values()) == {30}, columns


def test_parser_constants_match_the_handlers():
    from fox_jax.models.hf_gpt2 import DCP_NAME
    from fox_jax.train.tokenizers import ByteTokenizer

    assert commands.DCP_NAME == DCP_NAME
    assert commands.BYTES_VOCAB == ByteTokenizer.vocab_size
    assert zeroshot.TASKS == commands.ZEROSHOT_TASKS


def test_log_line_shows_tflops_only_with_a_known_peak():
    row = {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 1e4, "tflops": 0.01}
    assert "TFLOP/s" not in metrics.format_log_line(1, 10, row)
    assert "MFU" not in metrics.format_log_line(1, 10, {**row, "mfu": None})
    line = metrics.format_log_line(1, 10, {**row, "tflops": 300.0, "mfu": 0.3})
    assert "300.00 TFLOP/s" in line and "MFU 30.0%" in line


def test_heartbeat_lines_at_the_interval():
    clock = [0.0]
    lines = []
    hb = progress.Heartbeat(100, 60, start_step=10, write=lines.append, clock=lambda: clock[0])
    for step, t in ((11, 30), (12, 61), (13, 90), (14, 125)):
        clock[0] = t
        hb.tick(step)
    assert lines == ["step 12/100 | 61 s elapsed | ETA 44.7 min", "step 14/100 | 2.1 min elapsed | ETA 44.8 min"]
    clock[0] = 200
    hb.reset()
    clock[0] = 230
    hb.tick(15)
    assert len(lines) == 2  # 30 s after the last log line
    silent = progress.Heartbeat(100, 0, write=lines.append, clock=lambda: clock[0])
    clock[0] = 1e6
    silent.tick(50)
    assert len(lines) == 2


def test_zeroshot_writes_no_carriage_return_when_not_a_terminal(capsys):
    requests = [(np.arange(1, 4), np.arange(4, 6)) for _ in range(5)]
    zeroshot.score_requests(lambda t, n: (-t[:, 1:] / 1000.0, None), requests, batch_size=2, progress=True)
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "\r" not in captured.out


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 6-step CLI run, output captured (not a terminal), heartbeats every millisecond."""
    root = Path(__file__).resolve().parents[1]
    corpus = tmp_path_factory.mktemp("corpus")
    for i, f in enumerate(sorted(root.glob("train/*.py"))):
        (corpus / f"doc{i:02d}.txt").write_text(f.read_text())
    workdir = tmp_path_factory.mktemp("run") / "tiny"
    argv = ["train", "--workdir", str(workdir), "--data", str(corpus), "--seq-len", "32", "--batch-size", "4",
            "--steps", "6", "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.attention_block=16",
            "log_every=100", "eval_every=3", "ckpt_every=0", "eval_batches=1", "optim.warmup_steps=2",
            "heartbeat_secs=0.001", "async_checkpoints=false"]
    return workdir, argv


@pytest.mark.slow
def test_train_log_has_heartbeats_no_bar_and_a_loss_png(tiny_run, capsys):
    workdir, argv = tiny_run
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "\r" not in out
    beats = [line for line in out.splitlines() if line.startswith("step ") and "elapsed" in line]
    assert beats and all(" | ETA " in line for line in beats if not line.startswith("step 6/")), out
    assert "TFLOP/s" not in out  # CPU: no known peak
    png = workdir / "loss.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert not list(workdir.glob("*.tmp.png"))
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert all("tflops" in r for r in rows if "loss" in r)  # the raw number stays in metrics.jsonl

    assert cli.main(["eval", "--workdir", str(workdir), "--num-docs", "2", "--num-batches", "1"]) == 0
    text = capsys.readouterr().out
    assert "they average different tokens" in text and "packed windows" in text
    assert "the tokens eval --cache scores" in text and "document starts" in text
    # eval --cache scores the same predictions: its dense row equals plain eval's per-position numbers
    plain = re.search(r"\((\d+) next-token predictions.*per-position loss mean ([\d.]+)", text)
    assert cli.main(["eval", "--workdir", str(workdir), "--num-docs", "2", "--cache", "dense"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["dense_tokens"] == int(plain.group(1))
    assert report["dense_loss"] == pytest.approx(float(plain.group(2)), abs=2e-4)  # printed to 4 decimals


def test_commands_keep_a_compilation_cache(tmp_path, monkeypatch):
    """A later run of the same program loads it from JAX's persistent compilation cache: ``FOX_JAX_COMPILE_CACHE``
    (a folder, or "off"), else JAX's own ``JAX_COMPILATION_CACHE_DIR`` stands, else ``$XDG_CACHE_HOME/fox_jax/xla``;
    every command points JAX at it before it runs (here: one that then fails on a missing run)."""
    assert cli.compile_cache_dir({"FOX_JAX_COMPILE_CACHE": "off", "JAX_COMPILATION_CACHE_DIR": "/x"}) is None
    assert cli.compile_cache_dir({"FOX_JAX_COMPILE_CACHE": "~/c"}) == str(Path.home() / "c")
    assert cli.compile_cache_dir({"JAX_COMPILATION_CACHE_DIR": "/x"}) is None
    assert cli.compile_cache_dir({"XDG_CACHE_HOME": "/xdg"}) == "/xdg/fox_jax/xla"
    import jax

    seen = []
    real = jax.config.update
    monkeypatch.setattr(jax.config, "update", lambda name, value: seen.append((name, value)) if
                        name == "jax_compilation_cache_dir" else real(name, value))
    monkeypatch.setenv("FOX_JAX_COMPILE_CACHE", str(tmp_path / "xla"))
    assert cli.main(["eval", "--workdir", str(tmp_path / "no_run")]) == 2
    assert seen == [("jax_compilation_cache_dir", str(tmp_path / "xla"))]
    monkeypatch.setenv("FOX_JAX_COMPILE_CACHE", "off")
    seen.clear()
    assert cli.main(["eval", "--workdir", str(tmp_path / "no_run")]) == 2
    assert seen == []
