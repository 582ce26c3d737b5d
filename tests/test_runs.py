"""``fox_jax.train.runs``: every run format through ``open_run``, its errors, and params-only restores."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fox_jax.models import GPT2Config, ModelConfig
from fox_jax.models.hf_fox import save_official_fox
from fox_jax.models.hf_gpt2 import DCP_NAME, save_hf_gpt2
from fox_jax.train import config as config_lib, evaluate, loop
from fox_jax.train.checkpoints import Checkpointer, CheckpointError, CorruptCheckpointError
from fox_jax.train.runs import open_run

GPT2_TINY = dict(n_layers=2, n_heads=2, d_model=32, n_positions=64, vocab_size=300)


def _config(corpus: Path) -> config_lib.ExperimentConfig:
    return config_lib.apply_overrides(config_lib.preset("tiny"), [
        f"data.train={corpus}", "data.tokenizer=bytes", "data.seq_len=16", "model.vocab_size=257",
        "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.attention_block=16", "batch_size=2",
        "eval_batches=1"])


def _state(cfg: ModelConfig | GPT2Config, params, opt_cfg: config_lib.ExperimentConfig, step: int):
    optimizer = loop.make_optimizer(opt_cfg)
    return loop.TrainState(step=np.int32(step), params=params, opt_state=optimizer.init(params),
                              rng=jax.random.PRNGKey(step))


def _save(run_dir: Path, steps_and_states, *, ocdbt: bool = True) -> None:
    """Checkpoints as ``Checkpointer.save`` writes them; ``ocdbt=False``: one directory per array (so
    single arrays can be damaged)."""
    if ocdbt:
        ckpt = Checkpointer(str(run_dir / "checkpoints"), async_save=False)
        for step, state in steps_and_states:
            ckpt.save(step, state, {}, force=True)
        ckpt.close()
        return
    manager = ocp.CheckpointManager(
        str(run_dir / "checkpoints"), options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
        item_names=("state", "data"), item_handlers={"state": ocp.StandardCheckpointHandler(use_ocdbt=False)})
    for step, state in steps_and_states:
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({})))
    manager.wait_until_finished()
    manager.close()


def _save_model_config(model_cfg, run_dir: str) -> None:
    """``model_config.json`` of the earlier fine-tune layout: the model's fields and its ``model_type``."""
    (Path(run_dir) / "model_config.json").write_text(json.dumps(model_cfg.to_dict()))


def _leaves(tree) -> dict:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_same(a, b) -> None:
    la, lb = _leaves(a), _leaves(b)
    assert la.keys() == lb.keys()
    for k in la:
        np.testing.assert_array_equal(la[k], lb[k], err_msg=k)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    root = Path(__file__).resolve().parents[1]
    for i, f in enumerate(sorted(root.glob("fox_jax/models/*.py"))):
        (d / f"doc{i}.txt").write_text(f.read_text())
    return d


@pytest.fixture(scope="module")
def train_run(tmp_path_factory, corpus):
    """A 'fox-jax train' run with checkpoints at steps 2 and 4 (different params)."""
    run = tmp_path_factory.mktemp("train_run")
    cfg = _config(corpus)
    config_lib.save_json(cfg, run / "config.json")
    states = {s: loop.init_state(cfg, jax.random.PRNGKey(s), loop.make_optimizer(cfg)) for s in (2, 4)}
    _save(run, [(s, st.replace(step=np.int32(s))) for s, st in states.items()])
    return run, cfg, {s: st.params for s, st in states.items()}


@pytest.fixture(scope="module")
def finetune_run(tmp_path_factory, corpus, train_run):
    """A 'fox-jax finetune-dcp --from-run' run of the earlier layout: finetune_config.json (flat fields) +
    model_config.json (a FoX with DCP)."""
    src, exp, params = train_run
    run = tmp_path_factory.mktemp("finetune_run")
    model_cfg, dcp_params = exp.model.add_dcp_params(params[4], jax.random.PRNGKey(1), interaction_dim=8)
    ft = dict(from_run=str(src), from_step=4, data=dataclasses.asdict(exp.data), gamma=0.5, steps=3, lr=1e-4)
    (run / "finetune_config.json").write_text(json.dumps(ft))
    _save_model_config(model_cfg, str(run))
    _save(run, [(3, _state(model_cfg, dcp_params, exp, 3))])
    return run, model_cfg, dcp_params


def test_train_run(train_run):
    path, cfg, params = train_run
    run = open_run(path)
    assert (run.kind, run.path, run.steps, run.step) == ("train", str(path), (2, 4), 4)
    assert run.model == cfg.model and run.config == cfg and run.data == cfg.data
    assert run.tokenizer == "bytes" and run.seq_len == 16
    _assert_same(run.load_params(), params[4])
    _assert_same(open_run(path, step=2).load_params(), params[2])
    assert run.without_dcp() is run


def test_finetune_run_and_its_dense_part(finetune_run, train_run):
    path, model_cfg, dcp_params = finetune_run
    run = open_run(path)
    assert (run.kind, run.steps, run.step, run.model) == ("finetune", (3,), 3, model_cfg)
    assert run.config.dcp.gamma == 0.5 and run.tokenizer == "bytes" and run.seq_len == 16
    _assert_same(run.load_params(), dcp_params)
    dense = run.without_dcp()
    assert not dense.model.dcp and dense.step == 3
    _assert_same(dense.load_params(), train_run[2][4])  # the interaction params are left unread


def test_finetune_run_of_gpt2_without_model_type(tmp_path, train_run):
    """model_config.json files without model_type are GPT-2's."""
    cfg = GPT2Config(**GPT2_TINY)
    params = cfg.init_params(jax.random.PRNGKey(0))
    (tmp_path / "finetune_config.json").write_text(json.dumps({"hf_gpt2": "x", "data": {"tokenizer": "bytes"}}))
    (tmp_path / "model_config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    _save(tmp_path, [(1, _state(cfg, params, train_run[1], 1))])
    run = open_run(tmp_path)
    assert run.model == cfg and run.tokenizer == "bytes"
    _assert_same(run.load_params(), params)


def test_hf_gpt2_with_and_without_dcp(tmp_path):
    cfg = GPT2Config(**GPT2_TINY)
    params = cfg.init_params(jax.random.PRNGKey(0))
    save_hf_gpt2(cfg, params, tmp_path / "dense")
    run = open_run(tmp_path / "dense")
    assert (run.kind, run.steps, run.step, run.data, run.tokenizer) == ("hf-gpt2", None, None, None, None)
    assert run.model == cfg
    _assert_same(run.load_params(), params)
    dcp_cfg, dcp_params = cfg.add_dcp_params(params, jax.random.PRNGKey(1), interaction_dim=8, beta_init=1.5)
    save_hf_gpt2(dcp_cfg, dcp_params, tmp_path / "dcp")
    (tmp_path / "dcp" / "tokenizer.json").write_text("{}")
    run = open_run(tmp_path / "dcp")
    assert run.model == dcp_cfg and run.tokenizer == str(tmp_path / "dcp")
    _assert_same(run.load_params(), dcp_params)
    dense = run.without_dcp()
    assert dense.model == dcp_cfg.replace(dcp=False)
    _assert_same(dense.load_params(), params)
    (tmp_path / "dcp" / DCP_NAME).unlink()  # without the file the directory is a dense GPT-2
    assert not open_run(tmp_path / "dcp").model.dcp


def test_official_fox_dir(tmp_path, train_run):
    _, exp, params = train_run
    save_official_fox(exp.model, params[4], tmp_path)
    run = open_run(tmp_path)
    assert (run.kind, run.steps, run.data, run.seq_len) == ("hf-fox", None, None, None)
    assert run.model.n_layers == exp.model.n_layers and run.model.use_fgate
    _assert_same(run.load_params(), params[4])


def test_errors_are_one_line_and_say_what_was_expected(tmp_path, train_run):
    path = train_run[0]
    with pytest.raises(FileNotFoundError, match=r"--workdir .*nope: no such directory; expected .*config\.json"):
        open_run(tmp_path / "nope", flag="--workdir")
    with pytest.raises(ValueError, match=r"is not a run directory: expected .*finetune_config\.json.*config\.json"
                                         r".*Hugging Face"):
        open_run(tmp_path)
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 3 .*available steps: 2, 4$"):
        open_run(path, step=3)
    hf = tmp_path / "hf"
    save_hf_gpt2(GPT2Config(**GPT2_TINY), GPT2Config(**GPT2_TINY).init_params(jax.random.PRNGKey(0)), hf)
    with pytest.raises(ValueError, match="Hugging Face GPT-2 directory, which has no checkpoint steps"):
        open_run(hf, step=1)
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        open_run(hf)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        open_run(tmp_path)


def test_run_without_checkpoints_opens_and_refuses_to_load(tmp_path, train_run):
    config_lib.save_json(train_run[1], tmp_path / "config.json")
    run = open_run(tmp_path)
    assert run.steps == () and run.step is None and run.seq_len == 16
    with pytest.raises(CheckpointError, match="without checkpoints"):
        run.load_params()
    with pytest.raises(CheckpointError, match="available steps: none"):
        open_run(tmp_path, step=1)


def test_mismatched_and_corrupt_checkpoints(tmp_path, train_run):
    import shutil

    shutil.copytree(train_run[0], tmp_path / "run")
    run_dir = tmp_path / "run"
    other = config_lib.apply_overrides(train_run[1], ["model.d_model=64"])
    config_lib.save_json(other, run_dir / "config.json")
    with pytest.raises(CheckpointError, match="does not match this model/config: .* has shape") as e:
        open_run(run_dir).load_params()
    assert not isinstance(e.value, CorruptCheckpointError)
    config_lib.save_json(train_run[1], run_dir / "config.json")
    for p in (run_dir / "checkpoints" / "4" / "state").rglob("*"):
        if p.is_file() and p.stat().st_size > 0:
            p.write_bytes(b"\x00garbage")
    with pytest.raises(CorruptCheckpointError, match="step 4 .* is corrupt .*step 2 is intact") as e:
        open_run(run_dir).load_params()
    assert e.value.intact_step == 2
    _assert_same(open_run(run_dir, step=2).load_params(), train_run[2][2])


def test_evaluation_reads_no_optimizer_state(tmp_path, corpus):
    """A checkpoint whose optimizer state is unreadable (its array files are garbage) still evaluates:
    only the params are restored. The full restore of the same step fails, so the damage is real."""
    cfg = _config(corpus)
    config_lib.save_json(cfg, tmp_path / "config.json")
    state = loop.init_state(cfg, jax.random.PRNGKey(0), loop.make_optimizer(cfg))
    _save(tmp_path, [(4, state.replace(step=np.int32(4)))], ocdbt=False)
    state_dir = tmp_path / "checkpoints" / "4" / "state"
    damaged = [p for d in state_dir.glob("opt_state.*") for p in d.iterdir() if not p.name.startswith(".")]
    assert damaged and not any(p.name.startswith("params.") for p in damaged)
    for p in damaged:
        p.write_bytes(b"\x00garbage")
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), async_save=False, create=False)
    try:
        abstract = jax.eval_shape(lambda: state)
        with pytest.raises(CorruptCheckpointError, match="arrays cannot be read"):
            ckpt.restore(4, abstract)
    finally:
        ckpt.close()
    _assert_same(open_run(tmp_path).load_params(), state.params)
    report = evaluate.evaluate_run(str(tmp_path), num_batches=1, num_docs=2)
    assert report["step"] == 4 and np.isfinite(report["val_loss"])
