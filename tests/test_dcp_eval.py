"""DCP evaluation (train/dcp_eval.py) and the fixed sparse-attention baselines of GPT-2
(``GPT2Config.sparse_pattern``): pattern masks, exact sparsity, matched-sparsity search, masked attention
against a dense reference, block-diagonality, and ``fox-jax dcp-eval`` end to end on tiny models (CPU)."""

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fox_jax.models.gpt2 import (GPT2, GPT2Config, match_sparse_pattern, parse_sparse_pattern, sparse_pattern_keep,
                                 sparse_pattern_log_mask, sparse_pattern_sparsity)
from fox_jax.models.hf_gpt2 import save_hf_gpt2
from fox_jax.ops.context_pruning import dcp_attention
from fox_jax.train import cli, config as config_lib, dcp_eval
from fox_jax.train.checkpoints import Checkpointer

SHARED = Path(os.environ.get("FOX_JAX_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
GPT2_TOKENIZER = SHARED / "tokenizers" / "gpt2"
VAL_BOOKS = SHARED / "corpus_val"
TINY = dict(n_layers=2, n_heads=2, d_model=32, vocab_size=50257, n_positions=64, attention_block=16)


# ---------------------------------------------------------------------------------------------
# Patterns
# ---------------------------------------------------------------------------------------------

def numpy_pattern(kind: str, size: int, t: int, sinks: int = 0) -> np.ndarray:
    """Independent construction with loops: [T, T] bool keep, queries on axis 0."""
    keep = np.zeros((t, t), bool)
    for i in range(t):
        for j in range(i + 1):
            if kind == "local":
                keep[i, j] = j > i - size
            elif kind == "sinks":  # the last `size` keys plus the first `sinks`
                keep[i, j] = j > i - size or j < sinks
            else:  # strided: window of `size` plus the summary columns j = size-1, 2*size-1, ...
                keep[i, j] = (i - j < size) or ((j + 1) % size == 0)
    return keep


def split_pattern(pattern: str) -> tuple[str, int, int]:
    kind, size = pattern.split(":")
    sinks, _, window = size.rpartition("+")
    return kind, int(window), int(sinks or 0)


@pytest.mark.parametrize("t", [1, 2, 7, 33])
@pytest.mark.parametrize("pattern", ["local:1", "local:3", "local:8", "local:40",
                                     "strided:1", "strided:2", "strided:5", "strided:40",
                                     "sinks:0+3", "sinks:2+1", "sinks:3+4", "sinks:40+2"])
def test_pattern_masks_equal_numpy(pattern, t):
    kind, size, sinks = split_pattern(pattern)
    ref = numpy_pattern(kind, size, t, sinks)
    np.testing.assert_array_equal(np.asarray(sparse_pattern_keep(pattern, t)), ref)
    np.testing.assert_array_equal(sparse_pattern_keep(pattern, t, xp=np), ref)
    log_mask = np.asarray(sparse_pattern_log_mask(pattern, t))
    assert log_mask.dtype == np.float32
    upper = np.triu(np.ones((t, t), bool))
    np.testing.assert_array_equal(log_mask == 0, ref | upper)
    assert np.all(np.isneginf(log_mask[~(ref | upper)]))
    strict = np.tril(np.ones((t, t), bool), k=-1)
    expected = 0.0 if t == 1 else 1.0 - (ref & strict).sum() / strict.sum()
    assert sparse_pattern_sparsity(pattern, t) == pytest.approx(expected, abs=1e-12)


def test_pattern_errors():
    for bad in ("foo:3", "local:0", "local", "local:x", "strided:-2", 5, "local:3:4", "sinks:4", "sinks:-1+4",
                "sinks:4+0", "local:1+4", "sinks:1+2+3"):
        with pytest.raises(ValueError, match="sparse_pattern"):
            parse_sparse_pattern(bad)
    with pytest.raises(ValueError, match="GPT2Config.sparse_pattern"):
        GPT2Config(**TINY, sparse_pattern="window:4")
    with pytest.raises(ValueError, match="dcp=False"):
        GPT2Config(**TINY, dcp=True, sparse_pattern="local:4")
    with pytest.raises(ValueError, match="dcp_impl"):
        GPT2Config(**TINY, dcp_impl="cudnn")
    with pytest.raises(ValueError, match="seq_len"):
        sparse_pattern_sparsity("local:4", 0)
    with pytest.raises(ValueError, match="kind"):
        match_sparse_pattern("dilated", 0.5, 64)
    with pytest.raises(ValueError, match="target"):
        match_sparse_pattern("local", 1.5, 64)
    with pytest.raises(ValueError, match="sinks"):
        match_sparse_pattern("sinks", 0.5, 64, sinks=-1)


def _pattern(kind: str, size: int) -> str:
    return f"sinks:4+{size}" if kind == "sinks" else f"{kind}:{size}"


@pytest.mark.parametrize("kind", ["local", "strided", "sinks"])
@pytest.mark.parametrize("t", [64, 1024])
def test_matched_sparsity_within_one_step(kind, t):
    sp = np.array([sparse_pattern_sparsity(_pattern(kind, s), t) for s in range(1, t + 1)])
    peak = int(np.argmax(sp))  # local: size 1; strided: near sqrt(T/2)
    branch = sp[peak:]         # decreasing in the size from the peak on
    assert np.all(np.diff(branch) <= 1e-15)
    for target in np.linspace(0.0, 1.0, 41):
        pattern, got = match_sparse_pattern(kind, float(target), t)
        assert got == pytest.approx(sparse_pattern_sparsity(pattern, t), abs=1e-12)
        if target > branch[0]:  # unreachable: the sparsest pattern of this kind
            assert got == pytest.approx(branch[0])
            continue
        k = int(np.searchsorted(-branch, -target, side="left"))  # branch[k-1] > target >= branch[k]
        step = branch[k - 1] - branch[k] if k > 0 else 0.0
        assert abs(got - target) <= step / 2 + 1e-12 or (k == 0 and got == pytest.approx(branch[0]))


# ---------------------------------------------------------------------------------------------
# Sparse-pattern attention vs a dense masked reference
# ---------------------------------------------------------------------------------------------

def dense_masked_attention(q, k, v, keep):
    """float32 softmax(q·kᵀ/√D) over the kept keys, [B, T, H, D]; keep [T, T] bool."""
    s = jnp.einsum("bihd,bjhd->bhij", q, k, precision="highest") / np.sqrt(q.shape[-1])
    s = jnp.where(keep[None, None], s, -jnp.inf)
    return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(s, axis=-1), v, precision="highest")


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["local:5", "strided:6"])
def test_pattern_attention_matches_dense_reference(pattern):
    b, t, h, d = 2, 40, 2, 8
    kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(x, (b, t, h, d), jnp.float32) for x in (kq, kk, kv))
    cot = jax.random.normal(kc, (b, t, h, d), jnp.float32)
    kind, size = pattern.split(":")
    keep = jnp.asarray(numpy_pattern(kind, int(size), t))
    log_mask = jnp.broadcast_to(sparse_pattern_log_mask(pattern, t)[None], (b, t, t))

    def ours(q, k, v):  # small tiles so that fully dropped tiles are skipped
        return jnp.sum(dcp_attention(q, k, v, log_mask, block_q=8, block_k=8) * cot)

    def ref(q, k, v):
        return jnp.sum(dense_masked_attention(q, k, v, keep) * cot)

    o = dcp_attention(q, k, v, log_mask, block_q=8, block_k=8)
    np.testing.assert_allclose(o, dense_masked_attention(q, k, v, keep), atol=2e-5, rtol=2e-5)
    for g, g_ref in zip(jax.grad(ours, argnums=(0, 1, 2))(q, k, v), jax.grad(ref, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, g_ref, atol=5e-5, rtol=5e-5)


@pytest.fixture(scope="module")
def tiny_params():
    return GPT2Config(**TINY).init_params(jax.random.PRNGKey(1))


@pytest.mark.slow
def test_gpt2_sparse_pattern_model(tiny_params):
    cfg = GPT2Config(**TINY)
    t, w = 40, 6
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, t), 0, 50257)

    def forward(pattern):
        model = GPT2(cfg.replace(sparse_pattern=pattern))
        def logits_aux(p, x):
            out = model.apply({"params": p}, x)
            return out.logits, out.aux

        return model, jax.jit(logits_aux)

    dense_logits, aux = forward(None)[1](tiny_params, tokens)
    assert aux == {}
    # a window covering the whole sequence is dense attention
    full, aux_full = forward(f"local:{t}")[1](tiny_params, tokens)
    np.testing.assert_allclose(full, dense_logits, atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(aux_full["sparsity"], 0.0)
    # with 2 layers of local:W the last position only sees positions > T-1-2(W-1)
    local, apply = forward(f"local:{w}")
    logits, aux = apply(tiny_params, tokens)
    np.testing.assert_allclose(aux["sparsity"], sparse_pattern_sparsity(f"local:{w}", t), atol=1e-6)
    assert aux["log_masks"].shape == (2, 2, t, t)
    far_logits, _ = apply(tiny_params, tokens.at[:, : t - 2 * (w - 1) - 1].set(7))
    near_logits, _ = apply(tiny_params, tokens.at[:, t - 2 * (w - 1) - 1].set(7))
    np.testing.assert_allclose(far_logits[:, -1], logits[:, -1], atol=1e-5)
    assert np.max(np.abs(near_logits[:, -1] - logits[:, -1])) > 1e-4
    # gradients flow (training with a fixed pattern) and are finite
    grads = jax.jit(jax.grad(lambda p: jnp.mean(local.apply({"params": p}, tokens).logits ** 2)))(tiny_params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
    # with a cache the policy decides what a query sees: local:W decodes as window:W (its training visibility),
    # sinks:S+W as the sinks:S+W policy
    def cached_logits(model, policy):  # one compiled program (eager, each op of the cache path compiles alone)
        return jax.jit(lambda p, x: model.apply({"params": p}, x, cache=cfg.init_cache(2, t, policy=policy)).logits)(
            tiny_params, tokens)

    np.testing.assert_allclose(cached_logits(local, f"window:{w}"), logits, atol=1e-4, rtol=1e-4)
    sinks, apply_sinks = forward(f"sinks:3+{w}")
    sink_logits, sink_aux = apply_sinks(tiny_params, tokens)
    np.testing.assert_allclose(sink_aux["sparsity"], sparse_pattern_sparsity(f"sinks:3+{w}", t), atol=1e-6)
    assert np.max(np.abs(sink_logits[:, -1] - logits[:, -1])) > 1e-4  # the sinks are seen
    np.testing.assert_allclose(cached_logits(sinks, f"sinks:3+{w}"), sink_logits, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Drop statistics and block-diagonality on hand-built masks
# ---------------------------------------------------------------------------------------------

def test_block_diagonality_hand_built():
    t, bounds = 6, [0, 2, 4]
    causal = np.tril(np.ones((t, t), bool), k=-1)
    pid = np.array([0, 0, 1, 1, 2, 2])
    block = causal & (pid[None, :] < pid[:, None])          # drop every cross-passage pair
    s = dcp_eval.block_diagonality(block, bounds)
    assert s["n_cross_pairs"] == 12 and s["n_within_pairs"] == 3
    assert s["cross_dropped"] == 1.0 and s["within_dropped"] == 0.0 and s["score"] == 1.0
    assert s["alive_at_end"] == [0.0, 0.0, 1.0]
    none = dcp_eval.block_diagonality(np.zeros((2, t, t), bool), bounds)
    assert none["cross_dropped"] == [0.0, 0.0] and none["score"] == [0.0, 0.0]

    m = np.zeros((t, t), bool)
    m[3, 0] = True     # cross: query in passage 1, key in passage 0
    m[5, 4] = True     # within passage 2
    s = dcp_eval.block_diagonality(m, bounds)
    assert s["cross_dropped"] == pytest.approx(1 / 12)
    assert s["within_dropped"] == pytest.approx(1 / 3)
    assert s["score"] == pytest.approx(1 / 12 - 1 / 3)
    assert s["passage_matrix"][1][0] == pytest.approx(1 / 4)
    assert s["passage_matrix"][2][2] == 1.0 and s["passage_matrix"][0][0] == 0.0
    assert s["passage_matrix"][0][1] is None
    assert s["alive_at_end"] == [1.0, 1.0, 0.5]
    for bad in ([1, 3], [0, 3, 3], [0, 6]):
        with pytest.raises(ValueError, match="boundaries"):
            dcp_eval.block_diagonality(m, bad)


def test_drop_statistics_and_token_classes():
    assert [dcp_eval.token_class(s) for s in (" the", ",", "\n\n", " Borkman", " And", "--", "...")] == \
        ["stopword", "punctuation", "whitespace", "other", "stopword", "punctuation", "punctuation"]
    assert dcp_eval.token_class("<|endoftext|>", special=True) == "special"
    t = 4
    d = np.zeros((1, t, t), bool)
    d[0, 2, 0] = d[0, 3, 0] = True     # token 0 dropped from query 2 on
    d[0, 3, 1] = True                  # token 1 dropped by query 3
    texts, classes = [" the", " cat", ",", " sat"], ["stopword", "other", "punctuation", "other"]
    s = dcp_eval.drop_statistics(d, texts, classes)
    assert s["sparsity"] == [pytest.approx(3 / 6)]
    assert s["drop_fraction"][0] == [pytest.approx(2 / 3), 0.5, 0.0, None]
    assert s["lifetime"][0] == [2, 2, None, None]
    assert s["class_drop_rate"]["stopword"] == [pytest.approx(2 / 3)]
    assert s["class_drop_rate"]["other"] == [pytest.approx(1 / 2)]   # token 1: 1 of 2; token 3: no later query
    assert s["class_drop_rate"]["punctuation"] == [0.0]
    assert s["class_drop_rate"]["whitespace"] is None
    assert [x["pos"] for x in s["most_dropped"][0]] == [0, 1]


# ---------------------------------------------------------------------------------------------
# The CLI end to end
# ---------------------------------------------------------------------------------------------

needs_data = pytest.mark.skipif(not ((GPT2_TOKENIZER / "vocab.json").is_file()
                                     and (VAL_BOOKS / "gutenberg_val.txt").is_file()),
                                reason="shared GPT-2 tokenizer / validation books absent")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_params):
    """A dense HF dir and a DCP finetune-dcp-like run dir (finetune_config.json + model_config.json + hf/),
    random weights; the interaction weights are scaled up so the step mask drops a good share of the pairs."""
    root = tmp_path_factory.mktemp("models")
    cfg = GPT2Config(**TINY)
    save_hf_gpt2(cfg, tiny_params, root / "dense")
    dcp_cfg, dcp_params = cfg.add_dcp_params(tiny_params, jax.random.PRNGKey(3), interaction_dim=16, beta_init=1.0)
    for i in range(cfg.n_layers):
        attn = dcp_params[f"h_{i}"]["attn"]
        attn["q_int"]["kernel"] = attn["q_int"]["kernel"] * 12.0
        attn["k_int"]["kernel"] = attn["k_int"]["kernel"] * 12.0
    run = root / "run_gamma0.5"
    save_hf_gpt2(dcp_cfg, dcp_params, run / "hf")
    config_lib.save_json(config_lib.ExperimentConfig(model=dcp_cfg, data=config_lib.DataConfig(seq_len=64),
                                                     dcp=config_lib.DCPConfig(hf_gpt2=str(root / "dense"), gamma=0.5),
                                                     steps=10), run / "config.json")
    # fine-tuned controls as 'fox-jax train' runs (config.json + an orbax checkpoint of the params): a dense
    # control and a local-window fine-tune, both with the dense weights (so their scores are checkable)
    for name, pattern in (("ft_dense", None), ("ft_local", "local:8")):
        (root / name).mkdir()
        config_lib.save_json(config_lib.ExperimentConfig(model=cfg.replace(sparse_pattern=pattern),
                                                         data=config_lib.DataConfig(seq_len=64), steps=5),
                             root / name / "config.json")
        ckpt = Checkpointer(str(root / name / "checkpoints"), async_save=False)
        ckpt.save(5, {"params": tiny_params}, {})
        ckpt.close()
    return root


@pytest.fixture(scope="module")
def val_text(tmp_path_factory):
    """4 short documents: 3,000 characters from the middle of each of the first 4 validation books."""
    books = [json.loads(line) for line in (VAL_BOOKS / "manifest.jsonl").read_text().splitlines()[:4]]
    raw = (VAL_BOOKS / "gutenberg_val.txt").read_bytes()
    docs = []
    for b in books:
        text = raw[b["byte_offset"]:b["byte_offset"] + b["bytes"]].decode("utf-8")
        mid = len(text) // 2
        docs.append(text[mid:mid + 3000])
    path = tmp_path_factory.mktemp("val") / "val.txt"
    path.write_text("".join(d + "\n<|endoftext|>\n" for d in docs))
    return path


def test_load_run_forms_and_errors(models):
    run = dcp_eval.load_run(str(models / "run_gamma0.5"))
    assert run.cfg.dcp and run.info["gamma"] == 0.5 and run.label == "run_gamma0.5"
    hf = dcp_eval.load_run(str(models / "run_gamma0.5" / "hf"))
    assert hf.cfg.dcp and hf.label == "run_gamma0.5" and hf.info["gamma"] == 0.5
    with pytest.raises(ValueError, match="not a DCP model"):
        dcp_eval.load_run(str(models / "dense"))
    with pytest.raises(ValueError, match="--runs"):
        dcp_eval.load_run(str(models))
    assert not dcp_eval.load_dense(str(models / "run_gamma0.5" / "hf")).cfg.dcp


@pytest.mark.slow
@needs_data
def test_cli_end_to_end(models, val_text, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FOX_JAX_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = ["dcp-eval", "--dense", str(models / "dense"), "--runs", str(models / "run_gamma0.5"),
            "--controls", str(models / "ft_dense"), str(models / "ft_local"),
            "--val-data", str(val_text), "--tokenizer", str(GPT2_TOKENIZER), "--seq-len", "48",
            "--num-batches", "2", "--batch-size", "2", "--curve-sparsities", "0.5", "--out", str(out),
            "--no-progress"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "DCP vs fixed patterns at matched sparsity" in printed
    for name in ("dcp_eval.json", "dcp_eval.md", "ppl_vs_sparsity.png", "drops.json", "context_switch.json",
                 "drops_run_gamma0.5.png", "drop_tokens_run_gamma0.5.png", "context_switch_run_gamma0.5.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = json.loads((out / "dcp_eval.json").read_text())
    assert report["config"]["tokens"] == 2 * 2 * 48
    dense = report["dense"]
    assert dense["sparsity"] == 0.0 and np.isfinite(dense["ppl"]) and dense["ppl"] > 1
    (run,) = report["dcp"]
    assert run["info"]["gamma"] == 0.5 and len(run["sparsity_layers"]) == 2
    assert 0.05 < run["sparsity"] < 0.99
    for kind in ("local", "strided", "sinks"):
        m = run["matched"][kind]
        assert m["pattern"].startswith(kind + ":")
        assert m["nominal_sparsity"] == pytest.approx(match_sparse_pattern(kind, run["sparsity"], 48)[1])
        assert abs(m["sparsity"] - m["nominal_sparsity"]) < 0.05   # packed windows: only doc boundaries differ
        assert np.isfinite(m["ppl"])
        assert len(report["curves"][kind]) >= 1
    assert (out / "dcp_eval.md").read_text().count("|") > 20
    # the controls, each under its own pattern: the dense control holds the dense weights (same ppl), the
    # local fine-tune the exact pattern sparsity on these packed windows
    ft_dense, ft_local = report["controls"]
    assert ft_dense["info"] == {"kind": "dense-ft", "pattern": None, "step": 5} and ft_dense["sparsity"] == 0.0
    assert ft_dense["ppl"] == pytest.approx(dense["ppl"], rel=1e-6)
    assert ft_local["info"]["pattern"] == "local:8" and ft_local["label"] == "ft_local"
    assert ft_local["ppl"] != pytest.approx(dense["ppl"], rel=1e-4)
    assert abs(ft_local["sparsity"] - sparse_pattern_sparsity("local:8", 48)) < 0.05
    assert "fine-tuned pattern | local:8" in printed

    drops = json.loads((out / "drops.json").read_text())["runs"]["run_gamma0.5"]
    assert len(drops["sparsity"]) == 2 and len(drops["drop_fraction"][0]) == drops["seq_len"] == 48
    assert set(drops["class_drop_rate"]) == set(dcp_eval.TOKEN_CLASSES)
    sw = json.loads((out / "context_switch.json").read_text())
    assert sw["passage_boundaries"] == [0, 16, 32]
    scores = sw["runs"]["run_gamma0.5"]
    assert len(scores["cross_dropped"]) == 2 and all(0.0 <= v <= 1.0 for v in scores["cross_dropped"])


@needs_data
def test_cli_errors(models, val_text, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FOX_JAX_CACHE", str(tmp_path / "cache"))
    base = ["dcp-eval", "--dense", str(models / "dense"), "--runs", str(models / "run_gamma0.5"),
            "--tokenizer", str(GPT2_TOKENIZER), "--out", str(tmp_path / "o"), "--no-progress"]
    assert cli.main(base) == 2
    assert "--val-data" in capsys.readouterr().err
    assert cli.main(base + ["--val-data", str(val_text), "--seq-len", "100"]) == 2
    assert "n_positions" in capsys.readouterr().err
    assert cli.main(base + ["--val-data", str(val_text), "--curve-sparsities", "0.5,2"]) == 2
    assert "--curve-sparsities" in capsys.readouterr().err
    assert cli.main(base + ["--val-data", str(val_text), "--controls", str(models / "run_gamma0.5")]) == 2
    assert "--controls" in capsys.readouterr().err
    no_models = [a for a in base if a not in ("--runs", str(models / "run_gamma0.5"))]
    assert cli.main(no_models + ["--val-data", str(val_text)]) == 2
    assert "--runs / --controls: give at least one" in capsys.readouterr().err
