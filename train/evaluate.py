"""``fox-jax eval``: validation loss / perplexity and per-token loss by position (FoX paper Fig. 2).

Two views of the validation text:

* ``val_loss`` / ``val_ppl``: mean next-token loss over packed validation windows of ``seq_len`` tokens
  (the same batches as during training; windows start anywhere inside documents).
* per-position loss: one window per validation document, starting at the document's first token, so
  position i means "the i-th token of a document" (its mean differs from ``val_loss``, which mixes
  positions). Longer ``--seq-len`` than in training measures length extrapolation.

Writes ``<workdir>/eval/step_<N>_len_<L>.json`` (summary + per-position loss) and
``per_position_loss_step_<N>_len_<L>.png``.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from fox_jax.sharding import (batch_sharding, data_parallel_size, make_mesh, select_partitioner, state_shardings,
                              under_mesh)
from fox_jax.train import config as config_lib
from fox_jax.train import data as data_lib
from fox_jax.train.runs import open_run
from fox_jax.train.loop import LMTask, evaluate, to_global, token_losses


def pad_rows(batch: dict, multiple: int) -> dict:
    """Rows of a dict of [B, ...] arrays padded to a multiple of ``multiple`` with copies of the last row, whose
    ``mask`` (when there is one) is zero: so a batch splits over a mesh's data axes (``--mesh``)."""
    b = next(iter(batch.values())).shape[0]
    extra = -b % multiple
    if not extra:
        return batch
    out = {k: np.concatenate([v, np.repeat(v[-1:], extra, axis=0)]) for k, v in batch.items()}
    if "mask" in out:
        out["mask"][b:] = 0
    return out


def per_position_loss(model, params, windows: dict, batch_size: int, mesh=None):
    """Mean loss at each position over documents: ([T] float64 mean, [T] counts); sharded over ``mesh``
    (rows over data × fsdp) when given."""
    loss_fn = jax.jit(lambda p, b: token_losses(model, p, b))
    sharding, multiple = None, 1
    if mesh is not None:
        loss_fn, sharding, multiple = under_mesh(mesh, loss_fn), batch_sharding(mesh), data_parallel_size(mesh)
    n = windows["inputs"].shape[0]
    total = np.zeros(windows["inputs"].shape[1])
    count = np.zeros_like(total)
    for i in range(0, n, batch_size):
        batch = pad_rows({k: v[i:i + batch_size] for k, v in windows.items()}, multiple)
        losses = np.asarray(loss_fn(params, to_global({k: v for k, v in batch.items() if k != "mask"}, sharding)))
        mask = batch["mask"].astype(np.float64)
        total += (losses * mask).sum(0)
        count += mask.sum(0)
    return total / np.maximum(count, 1), count


def log_binned(mean: np.ndarray, count: np.ndarray, bins_per_decade: int = 12):
    """Token-weighted mean loss in log-spaced position bins: (bin centre positions, bin means)."""
    pos = np.arange(1, len(mean) + 1)
    edges = np.unique(np.round(np.logspace(0, np.log10(len(mean) + 1),
                                           int(bins_per_decade * np.log10(len(mean) + 1)) + 2)).astype(int))
    centres, values = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (pos >= lo) & (pos < hi) & (count > 0)
        if sel.any():
            w = count[sel]
            centres.append(float(np.exp(np.mean(np.log(pos[sel])))))
            values.append(float(np.sum(mean[sel] * w) / np.sum(w)))
    return np.asarray(centres), np.asarray(values)


def plot_per_position(path: str, mean: np.ndarray, count: np.ndarray, title: str,
                      train_len: int | None = None) -> None:
    """Per-token loss against position (log axis), raw and averaged in log-spaced bins; a dashed line
    marks the training length when the evaluation is longer (length extrapolation, FoX paper Fig. 2)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = np.arange(1, len(mean) + 1)
    valid = count > 0
    centres, binned = log_binned(mean, count)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(pos[valid], mean[valid], alpha=0.3, lw=0.8, label="per position")
    ax.plot(centres, binned, "o-", lw=2, ms=3, label="mean over log-spaced bins")
    if train_len is not None and train_len < len(mean):
        ax.axvline(train_len, ls="--", color="gray", lw=1, label=f"training length {train_len}")
    ax.set_xscale("log")
    ax.set_xlabel("token position in the document")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def policy_loss(model, params, windows: dict, batch_size: int, policy, slots=None, prefill_chunk: int = 512,
                mesh=None):
    """Per-position loss of the document windows under a cache policy (``token_losses_under_policy``: the
    visibility prefill + decode have; sharded over ``mesh`` when given, the last batch padded to a multiple of
    its data × fsdp size): ([T] float64 mean, [T] counts, rows that overflowed, [n_rows] live tokens per layer
    each row's cache holds after its last token). The tokens are those of ``per_position_loss``: every target
    of the windows, the last one included."""
    from fox_jax.decoding import token_losses_under_policy

    multiple = 1 if mesh is None else data_parallel_size(mesh)
    total, count, overflowed = np.zeros(windows["inputs"].shape[1]), np.zeros(windows["inputs"].shape[1]), 0
    live = []
    for i in range(0, windows["inputs"].shape[0], batch_size):
        inputs = windows["inputs"][i:i + batch_size]
        rows = pad_rows({"inputs": inputs, "next": windows["targets"][i:i + batch_size, -1],
                         "mask": windows["mask"][i:i + batch_size].astype(np.float64)}, multiple)
        nll, overflow, row_live = token_losses_under_policy(
            model, params, jnp.asarray(rows["inputs"]), policy=policy, slots=slots, prefill_chunk=prefill_chunk,
            mesh=mesh, next_tokens=jnp.asarray(rows["next"]), with_live=True)
        total += (np.asarray(nll, np.float64) * rows["mask"]).sum(0)
        count += rows["mask"].sum(0)
        overflowed += int(np.sum(np.asarray(overflow)[:len(inputs)] > 0))
        live.append(np.asarray(row_live, np.float64).mean(0)[:len(inputs)])
    return total / np.maximum(count, 1), count, overflowed, np.concatenate(live)


def evaluate_policy(run, cfg, params, *, policy, slots=None, num_docs: int = 64, prefill_chunk: int = 512,
                    mesh=None) -> dict:
    """Teacher-forced perplexity of the first ``seq_len`` tokens of validation documents under a cache
    policy next to the dense cache on the same tokens (``fox-jax eval --cache``; sharded over ``mesh`` when
    given); ``provable`` says whether the policy's promise holds for the model (False: ``acp`` without QK-norm,
    a heuristic)."""
    from fox_jax.cache.policies import parse_policy

    parsed = parse_policy(policy)
    spec = parsed.spec
    corpus = data_lib.load_corpus(cfg.data, splits=("val",))
    windows = data_lib.document_windows(corpus, num_docs)
    model = cfg.model.build()
    out = {"step": run.step, "seq_len": cfg.data.seq_len, "num_docs": int(windows["inputs"].shape[0]), "cache": spec,
           "slots": slots, "provable": parsed.provable(cfg.model.cache_layout())}
    for name, pol, sl in (("dense", "dense", None), ("policy", spec, slots)):
        if name == "policy" and spec == "dense" and slots is None:
            out.update({k.replace("dense", "policy"): v for k, v in out.items() if k.startswith("dense")})
            break
        mean, count, overflowed, live = policy_loss(model, params, windows, cfg.batch_size, pol, sl, prefill_chunk,
                                                    mesh)
        loss = float(np.sum(mean * count) / max(np.sum(count), 1))
        out.update({f"{name}_loss": loss, f"{name}_ppl": math.exp(min(loss, 50.0)), f"{name}_tokens": int(count.sum()),
                    f"{name}_overflow_rows": overflowed,
                    f"{name}_live_tokens": float(live.mean()),
                    # of the T tokens each row's cache saw (right padding included), the fraction not held at the end
                    f"{name}_evicted_fraction": float(1.0 - live.sum() / windows["inputs"].size),
                    f"{name}_per_position_loss": [float(x) if c > 0 else None for x, c in zip(mean, count)]})
    out["ppl_ratio"] = out["policy_ppl"] / out["dense_ppl"]
    return out


def evaluate_run(workdir: str, *, overrides: list[str] | None = None, step: int | None = None,
                 num_batches: int | None = None, num_docs: int = 64, cache: str | None = None,
                 kv_slots: int | None = None) -> dict:
    """Evaluate the checkpoint of a run: validation loss/perplexity and per-position loss.

    ``overrides`` may change the data (e.g. ``data.val=...``, ``data.seq_len=4096`` for length
    extrapolation) but not the model. Only the parameters are restored (``fox_jax.train.runs``: no
    optimizer state is read).

    With ``cache`` (a cache policy, ``fox_jax.cache.policies``) it instead scores the first ``seq_len``
    tokens of ``num_docs`` validation documents teacher-forced under that policy (the visibility generation
    has, ``kv_slots`` per row and layer) and under the dense cache (``evaluate_policy``); fine-tuned runs
    are accepted then.

    Raises:
      FileNotFoundError: ``workdir`` is no run. ValueError: a run of another kind than ``fox-jax train``
        (or a fine-tune, with ``cache``), overrides eval does not take, a bad cache policy. CheckpointError: no checkpoint (for ``step``), or a corrupt one.
    """
    run = open_run(workdir, step=step, flag="--workdir", step_flag="--step")
    if run.kind != "train" and not (cache is not None and run.kind == "finetune"):
        raise ValueError(f"--workdir {workdir} is {run.what}; eval reads 'fox-jax train' runs (score fine-tuned "
                         "and Hugging Face models with 'fox-jax zeroshot' or 'fox-jax dcp-eval')")
    model_overrides = [o for o in overrides or [] if o.startswith("model.")]
    if model_overrides:
        raise ValueError(f"eval cannot change the model ({', '.join(model_overrides)}): the checkpoint fixes it; "
                         "only data.* and batch settings may be overridden")
    ignored = [o for o in overrides or [] if not o.startswith(("data.", "batch_size=", "eval_batches=", "mesh=",
                                                               "partitioner="))]
    if ignored:
        raise ValueError(f"eval takes only data.*, batch_size, eval_batches, mesh and partitioner overrides; "
                         f"{', '.join(ignored)} would have no effect")
    train_len = run.seq_len
    cfg = config_lib.apply_overrides(run.config, overrides or [])
    # the mesh only when given now (--mesh / mesh=): the run's own is the training machine's
    mesh = None
    if any(o.startswith("mesh=") for o in overrides or []):
        mesh = make_mesh(cfg.mesh or None)
        select_partitioner(mesh, cfg.partitioner)
    if cache is not None:  # the policy's perplexity next to the dense cache's, on the same document windows
        from fox_jax.train.generate import parse_cache_flag

        policy = parse_cache_flag(cache)  # a bad spec: before any parameter is read
        missing = policy.missing(cfg.model.cache_layout())
        if missing is not None:
            raise ValueError(f"--cache {policy.spec} needs {missing}; {workdir} ({run.what}) is not one")
        from fox_jax.train.generate import check_kv_slots

        check_kv_slots(kv_slots, policy, cfg.data.seq_len or train_len, f"seq_len {cfg.data.seq_len or train_len}")
        report = evaluate_policy(run, cfg, run.load_params(), policy=policy, slots=kv_slots, num_docs=num_docs,
                                 mesh=mesh)
        out_dir = os.path.join(workdir, "eval")
        os.makedirs(out_dir, exist_ok=True)
        name = policy.spec.replace(":", "-").replace("+", "-")
        report["json"] = os.path.join(out_dir, f"cache_{name}_step_{run.step}_len_{cfg.data.seq_len}.json")
        with open(report["json"], "w") as f:
            json.dump(report, f)
        return report
    params, ckpt_step = run.load_params(), run.step
    corpus = data_lib.load_corpus(cfg.data, splits=("val",))
    if corpus.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer has {corpus.tokenizer.vocab_size} ids but the model only {cfg.model.vocab_size}; "
                         "evaluate with the tokenizer the model was trained with")
    model = cfg.model.build()
    batches = data_lib.make_val_batches(corpus, cfg.batch_size, num_batches or cfg.eval_batches)
    task = LMTask(cfg)
    eval_fn, sharding = jax.jit(lambda p, b: task.eval_step(model, p, b)), None
    if mesh is not None:
        if cfg.batch_size % data_parallel_size(mesh):
            raise ValueError(f"--batch-size {cfg.batch_size} does not split over the --mesh's data x fsdp = "
                             f"{data_parallel_size(mesh)} devices; pass a multiple of it")
        params = jax.device_put(params, state_shardings(mesh, params))
        eval_fn, sharding = under_mesh(mesh, eval_fn), batch_sharding(mesh)
    val_loss = evaluate(task, eval_fn, params, batches, sharding)["val_loss"]
    n_tokens = int(sum(b["targets"].size for b in batches))
    windows = data_lib.document_windows(corpus, num_docs)
    mean, count = per_position_loss(model, params, windows, cfg.batch_size, mesh)

    out_dir = os.path.join(workdir, "eval")
    os.makedirs(out_dir, exist_ok=True)
    report = {
        "step": ckpt_step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)), "val_tokens": n_tokens,
        "seq_len": cfg.data.seq_len, "num_docs": int(windows["inputs"].shape[0]),
        "per_position_loss": [float(x) if c > 0 else None for x, c in zip(mean, count)],
        "per_position_count": count.astype(int).tolist(),
    }
    stem = f"step_{ckpt_step}_len_{cfg.data.seq_len}"
    json_path = os.path.join(out_dir, f"{stem}.json")
    png_path = os.path.join(out_dir, f"per_position_loss_{stem}.png")
    with open(json_path, "w") as f:
        json.dump(report, f)
    plot_per_position(png_path, mean, count,
                      f"{cfg.model.arch}, step {ckpt_step}: loss by position\n"
                      f"(first {cfg.data.seq_len} tokens of {report['num_docs']} validation documents)", train_len)
    report.update(per_position_json=json_path, per_position_png=png_path)
    return report
