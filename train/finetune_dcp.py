"""``fox-jax finetune-dcp``: Dynamic Context Pruning fine-tuning of a pretrained GPT-2 or FoX/Transformer.

Two sources of the pretrained model (exactly one):

* ``--hf-gpt2 DIR``: a Hugging Face GPT-2 directory (``fox_jax.models.gpt2.GPT2``; the reference setup).
* ``--from-run RUN_DIR`` (optional ``--from-step N``, default the latest checkpoint): a run of
  ``fox-jax train`` (``config.json`` + orbax checkpoints): FoX or Transformer, any arch
  (``fox_jax.models.lm.LanguageModel``). Its params are restored, ``fox_jax.models.lm.add_dcp_params``
  adds the interaction params, and ACP (``adaptive_threshold``) is turned off (DCP cannot be combined
  with it; logged). The data use the run's tokenizer unless ``--tokenizer`` is given, and by default the
  run's training / validation text and ``seq_len``. There is no Hugging Face export: the fine-tuned model
  lives in ``<workdir>/checkpoints`` (read it with ``fox_jax.train.runs.open_run``; the source run is not modified).

Everything else (loss, α schedule, optimizer, metrics, evaluation, checkpoints, exact resume) is the same
for both.

The recipe of the reference code (docs/design/dcp.md §4), as defaults:

* model: the pretrained model plus fresh interaction parameters per layer (q_int, k_int
  [d, r] ~ N(0, 0.02), β = 2.0; r = 64). **All** parameters train; dropout 0; float32 (``--dtype``
  sets the compute dtype of the trunk, also for ``--from-run`` models).
* loss: CE + γ·(sparsity term). γ = 0.3 in the **reference code's normalisation**
  (``--gamma-normalization code``, the default): the code takes γ·mean(I) over the whole (T−1)×T slice,
  whose diagonal and upper triangle are constant ones, so it equals γ·[(T−2)/(2T)·m + const] where m is
  the mean keep probability over the strictly causal pairs of rows 0..T−2 (the model's
  ``aux["sparsity_loss"]``). We add γ_eff·m with γ_eff = γ·(T−2)/(2T) (0.1497 at T = 1024): the same
  gradient as the code, without the constant. ``--gamma-normalization causal`` uses γ_eff = γ (the
  paper's 2/(L·n(n−1)) normalisation); then γ ≈ 0.15 matches the code's 0.3. Packed documents
  (``segment_ids``) count only pairs inside one document. The logged ``sparsity_loss`` is γ_eff·m.
* α: cosine 1 → 8 over the run (``cosine_alpha_schedule(1, 8, alpha_steps)``, ``alpha_steps`` = steps
  by default); α(s) is computed on the host for step s (0-based, as the code sets it at the start of each
  optimizer step) and passed to the jitted step as a float32 scalar argument, so no value recompiles.
* optimizer: AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8, **no weight decay**; linear warmup from 0,
  then **constant**. The code warms up for 2,000 of its 25,000 steps; the default here is
  ``min(2000, ceil(0.08·steps))`` (2,000 for runs of ≥ 25,000 steps, the same fraction for shorter
  ones). Gradient clipping at global norm 1.0 (the code's default is no clipping: pass
  ``--clip-norm 0`` for that). ``--interaction-lr`` optionally gives q_int, k_int and β their own
  learning rate (the update of those leaves is scaled by interaction_lr / lr).
* data: the grain pipeline of ``fox_jax.train.data`` (``--data``, ``--val-data``, ``--tokenizer``: GPT-2's for
  ``--hf-gpt2``, the run's by default for ``--from-run``), packed windows of ``seq_len`` tokens with
  per-document positions and segment ids (GPT-2: ≤ n_positions, default n_positions; ``--from-run``:
  default the run's seq_len); batch 6 (the README's).

Validation (every ``eval_every`` steps and at the end): cross-entropy / perplexity with the **inference
step mask α = ∞**, and the pair sparsity it produces (fraction of causal pairs dropped, docs/design/dcp.md §3.2)
overall and per layer. Training rows log the sparsity of the current soft mask (pairs whose log I hit the
floor, ≈ 0 while α ≈ 1).

Run directory::

    finetune_config.json   the FinetuneConfig (resolved warmup / alpha_steps / from_step)
    model_config.json      the model config with DCP plus ``model_type``: "gpt2" (a GPT2Config) or "lm"
                           (a ModelConfig); rebuilds the parameter structure on resume (files written
                           before ``model_type`` existed are GPT-2)
    checkpoints/<step>/    orbax: TrainState (step, params, AdamW state, rng) + data-iterator position
    metrics.jsonl, tb/     per step: loss, ce, sparsity_loss, sparsity, sparsity_layer_{i}, alpha, lr,
                           grad_norm, beta_mean, tokens_per_sec; at evaluations val_loss, val_ppl,
                           val_sparsity, val_sparsity_layer_{i}
    hf/                    GPT-2 only: the final model, save_hf_gpt2 (model.safetensors +
                           dcp_interaction.safetensors) plus the tokenizer files

``--resume`` continues exactly (same batches, same optimizer state); only ``steps``, the
logging / evaluation / checkpoint intervals and ``--dcp-impl`` (same math, other kernels) may change.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from fox_jax.models import GPT2Config, ModelConfig, ModelFamily, gpt2_preset
from fox_jax.models.hf_gpt2 import load_hf_gpt2, save_hf_gpt2
from fox_jax.ops.alpha_sigmoid import cosine_alpha_schedule
from fox_jax.train import data as data_lib
from fox_jax.train.checkpoints import Checkpointer, CheckpointError
from fox_jax.train import config as config_lib
from fox_jax.train.config import (GAMMA_NORMALIZATIONS, LR_DECAYS, PRETRAIN_DEFAULTS, DataConfig,  # noqa: F401
                                   FinetuneConfig)
from fox_jax.train.metrics import MetricWriter
from fox_jax.train.progress import progress_bar
from fox_jax.train.runs import (FINETUNE_CONFIG as CONFIG_NAME, MODEL_CONFIG as MODEL_CONFIG_NAME, Run,
                                finetune_config_from_dict as config_from_dict, open_run,
                                read_finetune_config as load_config, read_model_config as load_model_config)
from fox_jax.train.trainer import TrainState, set_aside_later, weight_decay_mask

INTERACTION_PARAMS = ("q_int", "k_int", "beta")


# The same rule as fox-jax train, for the fields a fine-tune has (it has no heartbeat); dcp_impl: same math.
RESUMABLE = tuple(k for k in config_lib.RESUMABLE
                  if k in {f.name for f in dataclasses.fields(FinetuneConfig)}) + ("dcp_impl",)


def config_to_dict(cfg: FinetuneConfig) -> dict:
    return dataclasses.asdict(cfg)


def _write_json(obj: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def save_model_config(model_cfg: ModelFamily, workdir: str) -> None:
    """Write ``model_config.json``: the config's ``to_dict`` (its fields plus ``model_type``)."""
    _write_json(model_cfg.to_dict(), os.path.join(workdir, MODEL_CONFIG_NAME))


def open_source_run(run_dir: str, step: int | None = None) -> Run:
    """The ``fox-jax train`` run of ``--from-run`` (``open_run``; ``step`` None: its latest checkpoint),
    checked: a dense FoX / Transformer ``LanguageModel`` with checkpoints.

    Raises:
      FileNotFoundError: no such directory, or no run in it.
      ValueError: another kind of run (a finetune-dcp run, a Hugging Face directory), or a model that
        already has DCP.
      CheckpointError: no checkpoint (for ``step``; names the available steps).
    """
    flag = "--from-run" if step is None else f"--from-run/--from-step {step}"
    run = open_run(run_dir, step=step, flag=flag)
    if run.kind == "finetune":
        raise ValueError(f"--from-run {run_dir} is a 'fox-jax finetune-dcp' run; --from-run takes a 'fox-jax train' "
                         "run (continue a finetune-dcp run with --workdir DIR --resume)")
    if run.kind != "train":
        raise ValueError(f"--from-run {run_dir} is {run.what}; --from-run takes a 'fox-jax train' run "
                         "(for a Hugging Face GPT-2 use --hf-gpt2)")
    if run.model.dcp:
        raise ValueError(f"--from-run {run_dir}: the run's model already has DCP (model.dcp=True); "
                         "finetune-dcp adds DCP to a dense FoX/Transformer run")
    return run


def convert_to_dcp(model_cfg: ModelConfig, params, cfg: "FinetuneConfig") -> tuple[ModelConfig, Any]:
    """A dense ``LanguageModel`` (config, params) → its DCP version for fine-tuning.

    ACP is turned off (``adaptive_threshold=None``, logged), the compute dtype becomes ``cfg.dtype``,
    remat becomes "full" when ``cfg.remat`` (else the run's own policy), and ``add_dcp_params`` adds
    q_int, k_int [d, r] float32 ~ N(0, init_std) and β = ``cfg.beta_init`` to every layer (r =
    ``cfg.interaction_dim``, PRNG key ``cfg.seed``). The dense params are kept unchanged.

    Raises:
      ValueError: via ``add_dcp_params`` / ``ModelConfig`` (bad r or β₀).
    """
    if model_cfg.adaptive_threshold is not None:
        _log(f"--from-run: turning ACP off (adaptive_threshold={model_cfg.adaptive_threshold!r} -> None): "
             "DCP cannot be combined with ACP block pruning")
        model_cfg = model_cfg.replace(adaptive_threshold=None)
    model_cfg = model_cfg.replace(dtype=cfg.dtype, remat="full" if cfg.remat else model_cfg.remat)
    return model_cfg.add_dcp_params(params, jax.random.PRNGKey(cfg.seed), interaction_dim=cfg.interaction_dim,
                                    beta_init=cfg.beta_init)


# Loss, optimizer, steps ---------------------------------------------------------------------------

def effective_gamma(cfg: FinetuneConfig, seq_len: int) -> float:
    """γ_eff multiplying the causal-pair mean keep probability (see the module docstring)."""
    if cfg.gamma_normalization == "code":
        return cfg.gamma * (seq_len - 2) / (2 * seq_len)
    return cfg.gamma


def make_lr_schedule(cfg: FinetuneConfig) -> optax.Schedule:
    """Linear warmup 0 → lr over ``warmup_steps``, then constant (the code's recipe), or with
    ``lr_decay="cosine"`` a cosine decay to 0.1·lr at ``steps`` (pretraining)."""
    if cfg.lr_decay == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup_steps or 0, 1),
                                                  max(cfg.steps, (cfg.warmup_steps or 0) + 1),
                                                  end_value=0.1 * cfg.lr)
    if not cfg.warmup_steps:
        return optax.constant_schedule(cfg.lr)
    return optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)


def _interaction_multipliers(params, factor: float):
    def mult(path, _):
        names = {getattr(p, "key", None) for p in path}
        return factor if names & set(INTERACTION_PARAMS) else 1.0
    return jax.tree_util.tree_map_with_path(mult, params)


def make_optimizer(cfg: FinetuneConfig, params) -> optax.GradientTransformation:
    """Clip (global norm) → AdamW (warmup + constant, decay only on kernels/embeddings when
    weight_decay > 0) → scale of the interaction leaves by ``interaction_lr / lr``."""
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(optax.adamw(make_lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=weight_decay_mask))
    if cfg.interaction_lr is not None and cfg.interaction_lr != cfg.lr:
        multipliers = _interaction_multipliers(params, cfg.interaction_lr / cfg.lr)

        def update(updates, state, params=None):
            return jax.tree_util.tree_map(lambda u, m: u * m, updates, multipliers), state

        parts.append(optax.GradientTransformation(lambda _: optax.EmptyState(), update))
    return optax.chain(*parts)


def _model_inputs(batch):
    return dict(positions=batch["positions"], segment_ids=batch["segment_ids"])


def make_train_step(model, optimizer, gamma_eff: float):
    """``(state, batch, alpha) -> (state, metrics)``; ``alpha`` a float32 scalar (traced: no recompile).

    ``model``: a ``GPT2`` or a ``LanguageModel`` (the ``build()`` of a ``ModelFamily`` config).

    metrics: loss, ce, grad_norm and, for DCP models, sparsity_loss (γ_eff·mean causal keep
    probability), keep_mean, sparsity (mean of the per-layer floored-pair fraction), sparsity_layers [L],
    beta_mean.
    """

    dcp, layer_names = model.cfg.dcp, model.cfg.layer_names

    def loss_fn(params, batch, alpha):
        out = model.apply({"params": params}, batch["inputs"], alpha=alpha, **_model_inputs(batch))
        aux = out.aux
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["targets"]))
        if not dcp:  # dense pretraining: no mask, nothing dropped
            return ce, {"ce": ce}
        keep_mean = aux["sparsity_loss"]
        sp_loss = gamma_eff * keep_mean
        return ce + sp_loss, {"ce": ce, "sparsity_loss": sp_loss, "keep_mean": keep_mean,
                              "sparsity": jnp.mean(aux["sparsity"]), "sparsity_layers": aux["sparsity"]}

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step_fn(state: TrainState, batch, alpha):
        (loss, metrics), grads = grad_fn(state.params, batch, alpha)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        if dcp:
            metrics["beta_mean"] = jnp.mean(jnp.stack([params[name]["attn"]["beta"] for name in layer_names]))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step_fn


def make_eval_step(model):
    """``(params, batch) -> (CE sum, tokens, per-layer sparsity [L])`` with the step mask α = ∞
    (``model``: ``GPT2``, or a DCP ``LanguageModel``)."""
    dcp, n_layer = model.cfg.dcp, model.cfg.n_layers

    def eval_fn(params, batch):
        alpha = float("inf") if dcp else None
        out = model.apply({"params": params}, batch["inputs"], alpha=alpha, **_model_inputs(batch))
        losses = optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["targets"])
        sp = out.aux["sparsity"] if dcp else jnp.zeros((n_layer,), jnp.float32)
        return jnp.sum(losses), jnp.asarray(losses.size, jnp.float32), sp

    return eval_fn


def evaluate(eval_fn, params, batches) -> dict[str, float]:
    """Validation metrics at α = ∞: val_loss, val_ppl, val_sparsity, val_sparsity_layer_{i}."""
    total, count, layers = 0.0, 0.0, []
    for batch in batches:
        s, n, sp = eval_fn(params, {k: jnp.asarray(v) for k, v in batch.items()})
        total += float(s)
        count += float(n)
        layers.append(np.asarray(sp, np.float64))
    loss = total / max(count, 1.0)
    per_layer = np.mean(layers, axis=0)
    out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_sparsity": float(per_layer.mean())}
    out.update({f"val_sparsity_layer_{i}": float(v) for i, v in enumerate(per_layer)})
    return out


def format_log_line(step: int, total: int, m: dict[str, Any]) -> str:
    """``step 10/100 | loss 3.41 | ce 3.30 | sp_loss 0.110 | sparsity 12.3% | α 2.50 | lr 1.00e-04 | ...``."""
    parts = [f"step {step}/{total}"]
    if "loss" in m and "beta_mean" not in m:  # dense training (pretrain-gpt2)
        parts += [f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}", f"gnorm {m['grad_norm']:.3f}"]
    elif "loss" in m:
        parts += [f"loss {m['loss']:.4f}", f"ce {m['ce']:.4f}", f"sp_loss {m['sparsity_loss']:.4f}",
                  f"sparsity {100 * m['sparsity']:.1f}%", f"α {m['alpha']:.3f}", f"β̄ {m['beta_mean']:.3f}",
                  f"lr {m['lr']:.2e}", f"gnorm {m['grad_norm']:.3f}"]
    if m.get("tokens_per_sec") is not None:
        rate = m["tokens_per_sec"]
        parts.append(f"{rate / 1e3:.1f}k tok/s" if rate >= 1e3 else f"{rate:.0f} tok/s")
    if "val_loss" in m and "val_sparsity" not in m:
        parts.append(f"val_loss {m['val_loss']:.4f} (ppl {m['val_ppl']:.2f})")
    elif "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f} (ppl {m['val_ppl']:.2f}, sparsity {100 * m['val_sparsity']:.1f}% "
                     "at α=∞)")
    return " | ".join(parts)


# The run -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class FinetuneResult:
    """What ``finetune`` returns.

    Attributes:
      workdir: the run directory.
      final_step: the last optimizer step.
      val: the final validation metrics (None when no evaluation ran).
      hf_dir: the Hugging Face export (GPT-2), or None for a ``--from-run`` LanguageModel, whose
        fine-tuned model lives in ``<workdir>/checkpoints`` (``fox_jax.train.runs.open_run``).
      model_type: "gpt2" or "lm".
    """

    workdir: str
    final_step: int
    val: dict[str, float] | None
    hf_dir: str | None
    model_type: str = "gpt2"


def _check_resume(saved: FinetuneConfig, given: FinetuneConfig) -> None:
    config_lib.check_resume(config_to_dict(saved), config_to_dict(given), RESUMABLE)


def finetune(cfg: FinetuneConfig, workdir: str, *, resume: bool = False, resume_step: int | None = None,
             progress: bool = True) -> FinetuneResult:
    """DCP fine-tuning of ``cfg.hf_gpt2`` (GPT-2) or ``cfg.from_run`` (a FoX / Transformer run of
    ``fox-jax train``) in ``workdir`` (see the module docstring).

    A workdir with checkpoints is only continued with ``resume=True``; the saved config then wins except
    for ``RESUMABLE`` fields, which are taken from ``cfg``. ``resume_step`` continues from that checkpoint
    instead of the latest (the later ones are moved to ``<workdir>/checkpoints_set_aside/``). ``cfg`` may leave ``warmup_steps`` /
    ``alpha_steps`` None; they are resolved from ``steps`` on a fresh start, as ``from_step`` (the
    run's latest checkpoint) and, for ``from_run``, ``data.seq_len`` 0 (the run's seq_len) and
    ``data.tokenizer`` "" (the run's tokenizer).

    Raises:
      FileExistsError: checkpoints exist and ``resume`` is False.
      FileNotFoundError / ValueError: bad HF directory or run directory, data or config (seq_len >
        n_positions, a tokenizer larger than the model's vocabulary, both or neither of hf_gpt2 /
        from_run, a resume with changed settings).
      CorruptCheckpointError: the checkpoint to resume from cannot be read (names an intact older step).
      CheckpointError: a mismatched checkpoint, or no checkpoint ``resume_step``.
      FloatingPointError: the loss became NaN/inf.
    """
    workdir = os.path.abspath(workdir)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    has_ckpt = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
    if has_ckpt and not resume:
        raise FileExistsError(f"{workdir} already holds checkpoints; pass --resume to continue that run, "
                              "or choose another --workdir")
    if resume_step is not None and not (resume and has_ckpt):
        raise ValueError(f"--resume-step {resume_step} needs --resume and a run with checkpoints in {ckpt_dir}")
    if has_ckpt:
        saved = load_config(workdir)
        given = dataclasses.replace(cfg, warmup_steps=cfg.warmup_steps if cfg.warmup_steps is not None
                                    else saved.warmup_steps,
                                    alpha_steps=cfg.alpha_steps if cfg.alpha_steps is not None else saved.alpha_steps,
                                    from_step=cfg.from_step if cfg.from_step is not None else saved.from_step)
        _check_resume(saved, given)
        cfg = dataclasses.replace(saved, **{k: getattr(cfg, k) for k in RESUMABLE})
        model_cfg = load_model_config(workdir)
        params = None
    else:
        cfg = cfg.validate().resolved()
        if cfg.from_run:
            src = open_source_run(cfg.from_run, cfg.from_step)
            try:
                src_params = src.load_params()
            except CheckpointError as e:
                raise CheckpointError(f"--from-run {cfg.from_run}: {e}") from None
            _log(f"restored {cfg.from_run} at step {src.step} ({src.model.arch}, {src.model.n_layers} layers, "
                 f"d={src.model.d_model}, vocab {src.model.vocab_size}, tokenizer {src.tokenizer})")
            data = cfg.data
            if not data.tokenizer:
                data = dataclasses.replace(data, tokenizer=src.tokenizer)
            if data.seq_len == 0:
                data = dataclasses.replace(data, seq_len=src.seq_len)
            cfg = dataclasses.replace(cfg, from_step=src.step, data=data)
            model_cfg, params = convert_to_dcp(src.model, src_params, cfg)
        elif cfg.init_config is not None:
            model_cfg = GPT2Config.from_dict({**GPT2Config.current_names(cfg.init_config), "dcp": cfg.dcp,
                                              "interaction_dim": cfg.interaction_dim, "dcp_beta_init": cfg.beta_init,
                                              "dtype": cfg.dtype, "remat": "full" if cfg.remat else "none"})
            params = model_cfg.init_params(jax.random.PRNGKey(cfg.seed))
        elif not cfg.hf_gpt2:
            raise ValueError("--hf-gpt2 or --from-run is required: the pretrained model to fine-tune")
        else:
            model_cfg, params = load_hf_gpt2(cfg.hf_gpt2, dcp=cfg.dcp, rng=jax.random.PRNGKey(cfg.seed),
                                             interaction_dim=cfg.interaction_dim, dcp_beta_init=cfg.beta_init,
                                             dtype=cfg.dtype, remat="full" if cfg.remat else "none")
    cfg.validate()
    if cfg.dcp:
        model_cfg = dataclasses.replace(model_cfg, dcp_impl=cfg.dcp_impl)
    max_positions = model_cfg.max_positions
    if cfg.data.seq_len == 0:  # GPT-2 only: a from_run seq_len was resolved above
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=max_positions))
    seq_len = cfg.data.seq_len
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(f"seq_len {seq_len} exceeds the model's n_positions={max_positions} "
                         "(GPT-2 has learned absolute positions)")

    corpus = data_lib.load_corpus(cfg.data)
    if corpus.tokenizer.vocab_size > model_cfg.vocab_size:
        if cfg.from_run:
            raise ValueError(f"--tokenizer {cfg.data.tokenizer} has {corpus.tokenizer.vocab_size} ids but the "
                             f"--from-run model only {model_cfg.vocab_size}; drop --tokenizer to use the run's own")
        raise ValueError(f"the tokenizer has {corpus.tokenizer.vocab_size} ids but the model only "
                         f"{model_cfg.vocab_size}; pass the GPT-2 --tokenizer")
    os.makedirs(workdir, exist_ok=True)
    _write_json(config_to_dict(cfg), os.path.join(workdir, CONFIG_NAME))
    save_model_config(model_cfg, workdir)

    model = model_cfg.build()
    if params is None:
        params = jax.eval_shape(lambda: model_cfg.init_params(jax.random.PRNGKey(0)))
    optimizer = make_optimizer(cfg, params)
    lr_schedule = make_lr_schedule(cfg)
    alpha_schedule = cosine_alpha_schedule(cfg.alpha_init, cfg.alpha_final, cfg.alpha_steps)
    with jax.default_device(jax.devices("cpu")[0]):  # on the host: no device round trip per step
        alphas = np.asarray(alpha_schedule(np.arange(cfg.steps)), np.float32)
        lrs = np.asarray(jax.vmap(lr_schedule)(jnp.arange(cfg.steps)), np.float32)
    gamma_eff = effective_gamma(cfg, seq_len)

    ckpt = Checkpointer(ckpt_dir, keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoints)
    train_iter = data_lib.make_train_iterator(corpus, cfg.batch_size)
    if has_ckpt:
        abstract = jax.eval_shape(lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p,
                                                       opt_state=optimizer.init(p), rng=jax.random.PRNGKey(0)),
                                  params)
        state, data_state = ckpt.restore(resume_step, abstract)
        train_iter.set_state(data_state)
        set_aside_later(ckpt, int(state.step), workdir)
        _log(f"resumed from {ckpt_dir} at step {int(state.step)}")
    else:
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                           rng=jax.random.PRNGKey(cfg.seed))
    start_step = int(state.step)

    step_fn = jax.jit(make_train_step(model, optimizer, gamma_eff), donate_argnums=(0,))
    eval_fn = jax.jit(make_eval_step(model))
    val_batches = data_lib.make_val_batches(corpus, cfg.batch_size, cfg.eval_batches)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state.params))
    source = (f"{cfg.from_run} (step {cfg.from_step}, {model_cfg.arch})" if cfg.from_run
              else cfg.hf_gpt2 or "a random init")
    what = f"DCP fine-tuning of {source}" if cfg.dcp else f"dense training of {source}"
    dcp_desc = (f"r={model_cfg.interaction_dim}, γ={cfg.gamma} ({cfg.gamma_normalization}; γ_eff={gamma_eff:.4f} on "
                f"the causal mean); α {cfg.alpha_init}→{cfg.alpha_final} over {cfg.alpha_steps} steps; " if cfg.dcp else "")
    _log(f"{what}: {model_cfg.n_layers} layers, d={model_cfg.d_model}, {n_params / 1e6:.2f}M parameters; {dcp_desc}"
         f"lr {cfg.lr:g} ({cfg.lr_decay}), warmup {cfg.warmup_steps}; seq_len {seq_len}, batch {cfg.batch_size}; "
         f"data: {corpus.summary()}; workdir {workdir}")

    writer = MetricWriter(workdir, truncate_after=start_step if has_ckpt else -1)
    tokens_per_step = cfg.batch_size * seq_len
    val = None
    bar = progress_bar(total=cfg.steps, initial=start_step, progress=progress, desc="finetune-dcp", unit="step")
    step = start_step
    pending: list[tuple[int, float, dict]] = []
    try:
        if start_step == 0 and cfg.eval_every > 0:
            val = _dense_val(evaluate(eval_fn, state.params, val_batches), cfg.dcp)
            writer.write(0, val)
            _emit(bar, progress, format_log_line(0, cfg.steps, val))
        t_last, step_last, first_rate = time.perf_counter(), start_step, None
        while step < cfg.steps:
            alpha = float(alphas[step])
            batch = {k: jnp.asarray(v) for k, v in next(train_iter).items()}
            state, metrics = step_fn(state, batch, np.float32(alpha))
            step += 1
            if step == start_step + 1:  # the first step includes compilation: time it on its own
                jax.block_until_ready(metrics)
                now = time.perf_counter()
                first_rate = tokens_per_step / max(now - t_last, 1e-9)
                t_last, step_last = now, step
            pending.append((step, alpha, metrics))
            is_eval = (cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == cfg.steps
            if step % max(cfg.log_every, 1) == 0 or is_eval:
                fetched = jax.device_get([m for _, _, m in pending])
                now = time.perf_counter()
                rate = (step - step_last) * tokens_per_step / max(now - t_last, 1e-9) if step > step_last else None
                t_last, step_last = now, step
                for (s, a, _), m in zip(pending, fetched):
                    row = _row(m, a, float(lrs[s - 1]), first_rate if s == start_step + 1 or rate is None else rate)
                    if not math.isfinite(row["loss"]):
                        raise FloatingPointError(f"loss became {row['loss']} at step {s}; lower --lr or --gamma")
                    if s != step:
                        writer.write(s, row)
                pending = []
                if is_eval:
                    val = _dense_val(evaluate(eval_fn, state.params, val_batches), cfg.dcp)
                    row.update(val)
                    t_last = time.perf_counter()  # evaluation time is not training throughput
                writer.write(step, row)
                postfix = dict(ce=f"{row['ce']:.3f}")
                if "alpha" in row:
                    postfix.update(sparsity=f"{100 * row['sparsity']:.1f}%", alpha=f"{row['alpha']:.2f}")
                bar.set_postfix(**postfix, refresh=False)
                _emit(bar, progress, format_log_line(step, cfg.steps, row))
            bar.update(1)
            if cfg.ckpt_every > 0 and step % cfg.ckpt_every == 0 and step != cfg.steps:
                ckpt.save(step, state, train_iter.get_state())
        if ckpt.latest_step() != step:
            ckpt.save(step, state, train_iter.get_state(), force=True)
    finally:
        bar.close()
        train_iter.close()
        ckpt.close()
        writer.close()

    if model_cfg.model_type == "lm":
        _log(f"the fine-tuned {model_cfg.arch} model (DCP) is in {ckpt_dir} (step {step}); there is no Hugging "
             "Face export for FoX/Transformer models: load it with fox_jax.train.runs.open_run")
        return FinetuneResult(workdir, step, val, None, "lm")
    hf_dir = export_hf(workdir, model_cfg, state.params, corpus.tokenizer)
    _log(f"exported the model to {hf_dir} (Hugging Face GPT-2 format)")
    return FinetuneResult(workdir, step, val, hf_dir, "gpt2")


def _dense_val(val: dict, dcp: bool) -> dict:
    """Validation metrics without the (all-zero) sparsity entries when training a dense model."""
    return val if dcp else {k: v for k, v in val.items() if not k.startswith("val_sparsity")}


def _row(m: dict, alpha: float, lr: float, rate) -> dict[str, float]:
    """One metrics.jsonl row: the step's metrics, per-layer sparsity, the α and lr it used, tokens/s."""
    row = {k: float(v) for k, v in m.items() if k != "sparsity_layers"}
    if "sparsity_layers" in m:  # DCP (dense pretraining rows have no mask, α or β)
        row.update({f"sparsity_layer_{i}": float(v) for i, v in enumerate(np.asarray(m["sparsity_layers"]))})
        row["alpha"] = alpha
    row["lr"] = lr
    row["tokens_per_sec"] = rate
    return row


def export_hf(workdir: str, model_cfg: GPT2Config, params, tokenizer) -> str:
    """Write ``<workdir>/hf``: ``save_hf_gpt2`` (DCP params in ``dcp_interaction.safetensors``) plus the
    tokenizer's files, so ``fox-jax zeroshot --hf-gpt2 <workdir>/hf --dcp`` needs no ``--tokenizer``."""
    hf_dir = os.path.join(workdir, "hf")
    save_hf_gpt2(model_cfg.with_remat("none"), jax.device_get(params), hf_dir)
    for f in getattr(tokenizer, "files", ()):
        shutil.copyfile(f, os.path.join(hf_dir, os.path.basename(f)))
    return hf_dir


def _emit(bar, progress: bool, line: str) -> None:
    if progress:
        bar.write(line)
    else:
        _log(line)


def _log(msg: str) -> None:
    tqdm.write(msg)


# Command line ---------------------------------------------------------------------------------------

_FLAG_FIELDS = ("steps", "batch_size", "lr", "interaction_lr", "warmup_steps", "weight_decay", "clip_norm", "gamma",
                "gamma_normalization", "interaction_dim", "beta_init", "alpha_init", "alpha_final", "alpha_steps",
                "dtype", "remat", "seed", "log_every", "eval_every", "eval_batches", "ckpt_every", "dcp_impl")


def config_from_args(args, base: FinetuneConfig | None = None) -> FinetuneConfig:
    """A ``FinetuneConfig`` from the CLI flags given (others from ``base`` or the defaults).

    With ``--from-run`` (fresh start) the data default to the run's: its tokenizer (``DataConfig.tokenizer``
    "" = resolved by ``finetune``), its training / validation text when no --data is given, and its
    seq_len (``seq_len`` 0).

    Raises:
      FileNotFoundError: a --data / --val-data / --from-run path does not exist.
      ValueError: no --tokenizer and none in --hf-gpt2.
    """
    cfg = base or FinetuneConfig()
    kw = {k: getattr(args, k) for k in _FLAG_FIELDS if getattr(args, k, None) is not None}
    if getattr(args, "hf_gpt2", None):
        kw["hf_gpt2"] = os.path.abspath(args.hf_gpt2)
    if getattr(args, "from_run", None):
        kw["from_run"] = os.path.abspath(args.from_run)
    if getattr(args, "from_step", None) is not None:
        kw["from_step"] = args.from_step
    data = cfg.data
    for flag, paths in (("--data", args.data), ("--val-data", args.val_data)):
        for p in paths or ():
            if not any(ch in p for ch in "*?[") and not os.path.exists(p):
                raise FileNotFoundError(f"{flag}: {p} does not exist; give a file, directory or glob of text")
    dkw = {}
    from_run = kw.get("from_run") if base is None else None
    if from_run and not args.data:  # the run's own text
        run_data = open_run(from_run).data
        dkw.update({k: getattr(run_data, k) for k in ("train", "val", "separator", "text_field", "val_fraction",
                                                      "max_docs")})
    if args.data:
        dkw["train"] = tuple(os.path.abspath(p) for p in args.data)
    if args.val_data:
        dkw["val"] = tuple(os.path.abspath(p) for p in args.val_data)
    if args.seq_len is not None:
        dkw["seq_len"] = args.seq_len
    if args.data_seed is not None:
        dkw["seed"] = args.data_seed
    if args.tokenizer:
        dkw["tokenizer"] = args.tokenizer if args.tokenizer == "bytes" else os.path.abspath(args.tokenizer)
    elif from_run:
        dkw["tokenizer"] = ""  # the run's (finetune resolves it)
    elif base is None:
        hf = kw.get("hf_gpt2")
        if hf and os.path.isfile(os.path.join(hf, "vocab.json")) and os.path.isfile(os.path.join(hf, "merges.txt")):
            dkw["tokenizer"] = hf
        else:
            raise ValueError("--tokenizer is required (a directory with GPT-2 vocab.json + merges.txt); "
                             "--hf-gpt2 holds none")
    return dataclasses.replace(cfg, data=dataclasses.replace(data, **dkw), **kw)


def cmd_pretrain_gpt2(args) -> int:
    """The ``fox-jax pretrain-gpt2`` handler: a dense GPT-2 of ``--size`` (+ overrides) from a random init,
    AdamW (lr 6e-4, β₂ 0.95, weight decay 0.1 on kernels/embeddings), warmup + cosine to 10 %; the final
    model is exported as a Hugging Face directory (``<workdir>/hf``), the input of ``finetune-dcp``."""
    cfg_path = os.path.join(args.workdir, CONFIG_NAME)
    shape = {field: getattr(args, flag) for flag, field in (("n_layer", "n_layers"), ("n_head", "n_heads"),
                                                             ("n_embd", "d_model"), ("n_positions", "n_positions"))
             if getattr(args, flag) is not None}
    resuming = args.resume and os.path.exists(cfg_path)
    if resuming and args.size is None and not shape:
        cfg = config_from_args(args, base=load_config(args.workdir))
    else:
        if not resuming and not args.tokenizer:
            raise ValueError("--tokenizer is required (a directory with GPT-2 vocab.json + merges.txt)")
        init_config = dataclasses.asdict(gpt2_preset(args.size or "gpt2", **shape))
        for k in ("dcp", "interaction_dim", "dcp_beta_init", "dtype", "remat", "dcp_impl"):  # set by the run config
            init_config.pop(k)
        if resuming:  # the shape flags must describe the saved model: finetune's resume check compares them
            cfg = config_from_args(args, base=dataclasses.replace(load_config(args.workdir), init_config=init_config))
        else:
            cfg = config_from_args(args, base=FinetuneConfig(**PRETRAIN_DEFAULTS, init_config=init_config))
    result = finetune(cfg, args.workdir, resume=args.resume, resume_step=args.resume_step,
                      progress=not args.no_progress)
    msg = f"done: {result.final_step} steps in {result.workdir}; model exported to {result.hf_dir}"
    if result.val:
        msg += f"; val_loss {result.val['val_loss']:.4f}, val_ppl {result.val['val_ppl']:.2f}"
    print(msg)
    return 0


def cmd_finetune_dcp(args) -> int:
    """The ``fox-jax finetune-dcp`` handler (``--hf-gpt2`` or ``--from-run``; ``--resume``)."""
    cfg_path = os.path.join(args.workdir, CONFIG_NAME)
    if args.hf_gpt2 and args.from_run:  # argparse's group already refuses this; kept for direct callers
        raise ValueError("--hf-gpt2 and --from-run are mutually exclusive: give one pretrained model")
    if args.resume and os.path.exists(cfg_path):
        cfg = config_from_args(args, base=load_config(args.workdir))
    else:
        if args.from_step is not None and not args.from_run:
            raise ValueError("--from-step needs --from-run (the checkpoint step of that run)")
        if args.from_run:
            open_source_run(args.from_run, args.from_step)
        elif not args.hf_gpt2:
            raise ValueError("--hf-gpt2 or --from-run is required: the pretrained model to fine-tune "
                             "(a Hugging Face GPT-2 directory or a 'fox-jax train' run)")
        elif not os.path.isdir(args.hf_gpt2):
            raise FileNotFoundError(f"--hf-gpt2 {args.hf_gpt2}: no such directory")
        cfg = config_from_args(args)
    result = finetune(cfg, args.workdir, resume=args.resume, resume_step=args.resume_step,
                      progress=not args.no_progress)
    if result.hf_dir is None:
        msg = (f"done: {result.final_step} steps in {result.workdir}; the fine-tuned model is in its checkpoints/ "
               "(no Hugging Face export for FoX/Transformer)")
    else:
        msg = f"done: {result.final_step} steps in {result.workdir}; model exported to {result.hf_dir}"
    if result.val:
        msg += (f"; val_loss {result.val['val_loss']:.4f}, val_ppl {result.val['val_ppl']:.2f}, "
                f"sparsity {100 * result.val['val_sparsity']:.1f}% at α=∞")
    print(msg)
    return 0
