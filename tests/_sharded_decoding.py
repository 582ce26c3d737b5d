"""Run in a subprocess with 8 simulated CPU devices by tests/test_sharded_decoding.py (not collected by pytest).

Generates and scores with a tiny FoX (Pro, GQA) model unsharded and sharded (the library: dense over a data mesh,
acp's per-head rings over a data x fsdp x tensor mesh; each pair one compile of generate and of scoring), then runs
``fox-jax generate`` and ``fox-jax eval --cache`` on a tiny run with and without ``--mesh data=8`` (3 prompts /
documents: padded), and prints the results as one JSON line.
"""

import contextlib
import io
import json
import tempfile
from pathlib import Path

import jax
import numpy as np

from fox_jax.decoding import generate, token_losses_under_policy
from fox_jax.models import preset
from fox_jax.sharding import make_mesh

# (policy, mesh): dense (one ring) with rows over data; acp (rings with per-head starts, kv heads split over
# tensor) with rows over data x fsdp and heads over tensor: every cache layout and every mesh axis once
CASES = (("dense", "data=8"), ("acp", "data=2,fsdp=2,tensor=2"))


def cli(argv) -> list[str]:
    """stdout lines of ``fox-jax ARGV`` (which must succeed)."""
    from fox_jax.train import cli as cli_lib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_lib.main(argv) == 0, argv
    return out.getvalue().splitlines()


def commands() -> dict:
    """generate and eval --cache on a tiny run (its params scaled x3, see below), with and without --mesh."""
    from test_runs import _config, _save, _state

    root = Path(tempfile.mkdtemp())
    corpus = root / "corpus"
    corpus.mkdir()
    for i, f in enumerate(sorted(Path(__file__).resolve().parents[1].glob("fox_jax/models/*.py"))):
        (corpus / f"doc{i}.txt").write_text(f.read_text())
    cfg = _config(corpus)
    from fox_jax.train import config as config_lib

    config_lib.save_json(cfg, root / "config.json")
    params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, cfg.model.init_params(jax.random.PRNGKey(0)))
    _save(root, [(1, _state(cfg.model, params, cfg, 1))])
    out = {}
    for name, extra in (("one", []), ("mesh", ["--mesh", "data=8"])):
        lines = cli(["generate", str(root), "--prompt", "import os", "--prompt", "x = 1", "--prompt", "def f(",
                     "--max-new-tokens", "5", "--no-stop", *extra])
        out[f"generate|{name}"] = {"text": lines[:-1], "summary": json.loads(lines[-1])}
        lines = cli(["eval", "--workdir", str(root), "--cache", "window:4", "--num-docs", "3", "data.val_fraction=0.5",
                     *extra])
        out[f"eval|{name}"] = json.loads(lines[-1])
    return out


def pallas_case(model, params, prompt, seq_start) -> dict:
    """The fused decode step through the Pallas decode kernel (interpret mode: "auto" made to pick it, as on a GPU)
    with and without a mesh — acp (per-head rings in head groups: rows split) under data=8, window:16 (one ring of
    every head: rows and heads split) under data=4,tensor=2, the latter also with W_o in the kernel
    (``FUSE_OUTPUT_PROJ``: each shard's heads' shares, summed over the tensor axis), and a GPT-2 whose c_attn reaches
    the kernel as partial sums and a bias (``DECODE_QKV = "parts"``: the rows laid out per shard on their own axis)
    under data=4,tensor=2 — gives the same tokens."""
    import importlib

    from fox_jax.decoding import generation
    from fox_jax.models import GPT2Config

    from fox_jax.kernels import decode_attention as dk

    ops = importlib.import_module("fox_jax.ops.decode_attention")
    resolve, flash, seen = ops.resolve_decode_implementation, dk.flash_decode, []
    ops.resolve_decode_implementation = lambda impl, *a, **kw: "pallas" if impl == "auto" else resolve(impl, *a, **kw)
    dk.flash_decode = lambda *a, **kw: seen.append(kw.get("step")) or flash(*a, **kw)
    equal = {}
    try:
        for policy, mesh, proj in (("acp", "data=8", False), ("window:16", "data=4,tensor=2", False),
                                   ("window:16", "data=4,tensor=2", True)):
            kw = dict(max_new_tokens=6, policy=policy, seq_start=seq_start, prefill_chunk=8)
            ref = generate(model, params, prompt, **kw)
            generation.FUSE_OUTPUT_PROJ = proj
            jax.clear_caches()
            gen = generate(model, params, prompt, mesh=make_mesh(mesh), **kw)
            generation.FUSE_OUTPUT_PROJ = False
            equal[f"{policy}|{mesh}" + ("|proj" if proj else "")] = \
                np.asarray(ref.tokens).tolist() == np.asarray(gen.tokens).tolist()
        gcfg = GPT2Config(n_layers=2, d_model=64, n_heads=4, vocab_size=64, n_positions=64)
        gmodel = gcfg.build()
        gparams = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, gcfg.init_params(jax.random.PRNGKey(1)))
        kw = dict(max_new_tokens=6, policy="window:16", seq_start=seq_start, prefill_chunk=8)
        ref = generate(gmodel, gparams, prompt, **kw)
        gen = generate(gmodel, gparams, prompt, mesh=make_mesh("data=4,tensor=2"), **kw)  # (DECODE_QKV "parts")
        equal["gpt2|window:16|data=4,tensor=2|parts"] = np.asarray(ref.tokens).tolist() == np.asarray(gen.tokens).tolist()
    finally:
        ops.resolve_decode_implementation, dk.flash_decode = resolve, flash
        generation.FUSE_OUTPUT_PROJ = False
    return {"equal": equal, "fused_calls": sum(s is not None for s in seen),
            "projecting_calls": sum(s is not None and s.o_proj is not None for s in seen),
            "partial_row_calls": sum(s is not None and s.rows.ndim == 4 and s.row_bias is not None for s in seen)}


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    cfg = preset("tiny", "fox-pro", vocab_size=64, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2)
    params = cfg.init_params(jax.random.PRNGKey(0))
    # sharper logits than at init, so greedy argmax ties (which a different summation order could flip) are rare
    params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    model = cfg.build()
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 64, (8, 12)).astype(np.int32)
    seq_start = np.asarray([0, 3, 0, 5, 1, 0, 2, 0], np.int32)
    text = rng.integers(1, 64, (8, 20)).astype(np.int32)
    out = {}
    for policy, spec in CASES:
        kw = dict(max_new_tokens=6, policy=policy, seq_start=seq_start, prefill_chunk=8)
        ref = generate(model, params, prompt, **kw)
        ref_nll, _ = token_losses_under_policy(model, params, text, policy=policy, prefill_chunk=8)
        out[policy] = {"tokens": np.asarray(ref.tokens).tolist(), "nll": np.asarray(ref_nll).tolist()}
        mesh = make_mesh(spec)
        gen = generate(model, params, prompt, mesh=mesh, **kw)
        nll, overflow = token_losses_under_policy(model, params, text, policy=policy, prefill_chunk=8, mesh=mesh)
        k = gen.caches[0].groups[0].k
        out[f"{policy}|{spec}"] = {"tokens": np.asarray(gen.tokens).tolist(), "nll": np.asarray(nll).tolist(),
                                   "overflow": int(np.max(np.asarray(overflow))),
                                   "k_spec": str(k.sharding.spec), "k_shards": len(k.addressable_shards),
                                   "k_shard_shape": list(k.addressable_shards[0].data.shape)}
    out["pallas"] = pallas_case(model, params, prompt, seq_start)
    try:
        generate(model, params, prompt[:3], max_new_tokens=2, mesh=make_mesh("data=8"))
    except ValueError as e:
        out["indivisible"] = str(e)
    out.update(commands())
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
