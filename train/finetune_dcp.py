"""``fox-jax finetune-dcp``: Dynamic Context Pruning fine-tuning of a pretrained Hugging Face GPT-2.

The recipe of the reference code (specs/dcp.md §4), as defaults:

* model: the HF GPT-2 of ``--hf-gpt2`` plus fresh interaction parameters per layer (q_int, k_int
  [d, r] ~ N(0, 0.02), β = 2.0; r = 64). **All** parameters train; dropout 0; float32.
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
* data: the grain pipeline of ``train.data`` (``--data``, ``--val-data``, a GPT-2 ``--tokenizer``),
  packed windows of ``seq_len`` ≤ n_positions tokens (default n_positions) with per-document positions
  and segment ids; batch 6 (the README's).

Validation (every ``eval_every`` steps and at the end): cross-entropy / perplexity with the **inference
step mask α = ∞**, and the pair sparsity it produces (fraction of causal pairs dropped, specs/dcp.md §3.2)
overall and per layer. Training rows log the sparsity of the current soft mask (pairs whose log I hit the
floor, ≈ 0 while α ≈ 1).

Run directory::

    finetune_config.json   the FinetuneConfig (resolved warmup / alpha_steps)
    model_config.json      the GPT2Config with DCP (rebuilds the parameter structure on resume)
    checkpoints/<step>/    orbax: TrainState (step, params, AdamW state, rng) + data-iterator position
    metrics.jsonl, tb/     per step: loss, ce, sparsity_loss, sparsity, sparsity_layer_{i}, alpha, lr,
                           grad_norm, beta_mean, tokens_per_sec; at evaluations val_loss, val_ppl,
                           val_sparsity, val_sparsity_layer_{i}
    hf/                    the final model: save_hf_gpt2 (model.safetensors + dcp_interaction.safetensors)
                           plus the tokenizer files

``--resume`` continues exactly (same batches, same optimizer state); only ``steps`` and the
logging / evaluation / checkpoint intervals may change.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from fox_jax.models.gpt2 import GPT2, GPT2Config, gpt2_preset, init_gpt2
from fox_jax.models.hf_gpt2 import load_hf_gpt2, save_hf_gpt2
from fox_jax.ops.alpha_sigmoid import cosine_alpha_schedule
from train import data as data_lib
from train.checkpoints import Checkpointer, restore_run
from train.config import DataConfig
from train.metrics import MetricWriter
from train.trainer import TrainState, weight_decay_mask

CONFIG_NAME = "finetune_config.json"
MODEL_CONFIG_NAME = "model_config.json"
INTERACTION_PARAMS = ("q_int", "k_int", "beta")
GAMMA_NORMALIZATIONS = ("code", "causal")
LR_DECAYS = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """A DCP fine-tuning run (defaults: the reference recipe, specs/dcp.md §4; see the module docstring).

    Attributes:
      hf_gpt2: the pretrained HF GPT-2 directory.
      data: ``DataConfig`` (tokenizer must be GPT-2's; ``seq_len`` 0 = the model's n_positions).
      steps, batch_size: optimizer steps and sequences per step.
      lr, warmup_steps (None = min(2000, ceil(0.08·steps))), weight_decay, b1, b2, eps, clip_norm
        (0 = off): AdamW, linear warmup then constant.
      interaction_lr: learning rate of q_int, k_int, β (None = lr).
      gamma, gamma_normalization: sparsity strength and its normalisation ("code" or "causal").
      interaction_dim, beta_init: r and β₀ of the fresh interaction parameters.
      alpha_init, alpha_final, alpha_steps (None = steps): the cosine α schedule.
      dtype: compute dtype of the GPT-2 trunk ("float32" as the code; the mask is float32 always).
      remat: rematerialise blocks in the backward pass.
      seed: seed of the interaction-parameter init (the data order has its own ``data.seed``).
      log_every, eval_every, eval_batches, ckpt_every, keep_checkpoints, async_checkpoints: the loop.
    """

    hf_gpt2: str = ""
    data: DataConfig = DataConfig(seq_len=0)
    steps: int = 25000
    batch_size: int = 6
    lr: float = 1e-4
    warmup_steps: int | None = None
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float = 1.0
    interaction_lr: float | None = None
    gamma: float = 0.3
    gamma_normalization: str = "code"
    interaction_dim: int = 64
    beta_init: float = 2.0
    alpha_init: float = 1.0
    alpha_final: float = 8.0
    alpha_steps: int | None = None
    dtype: str = "float32"
    remat: bool = False
    seed: int = 42
    log_every: int = 10
    eval_every: int = 1000
    eval_batches: int = 11
    ckpt_every: int = 1000
    keep_checkpoints: int = 3
    async_checkpoints: bool = True
    dcp: bool = True
    init_config: dict | None = None
    lr_decay: str = "constant"

    def resolved(self) -> "FinetuneConfig":
        """Fill ``warmup_steps`` and ``alpha_steps`` from ``steps`` (stored, so a resume with more steps
        keeps the schedules)."""
        kw = {}
        if self.warmup_steps is None:
            kw["warmup_steps"] = min(2000, math.ceil(0.08 * self.steps))
        if self.alpha_steps is None:
            kw["alpha_steps"] = self.steps
        return dataclasses.replace(self, **kw)

    def validate(self) -> "FinetuneConfig":
        """Raises ValueError naming the first bad field."""
        checks = [
            (self.steps > 0, f"steps must be positive, got {self.steps}"),
            (self.batch_size > 0, f"batch_size must be positive, got {self.batch_size}"),
            (self.lr > 0, f"lr must be positive, got {self.lr}"),
            (self.interaction_lr is None or self.interaction_lr > 0,
             f"interaction_lr must be positive, got {self.interaction_lr}"),
            (self.warmup_steps is None or self.warmup_steps >= 0,
             f"warmup_steps must be >= 0, got {self.warmup_steps}"),
            (self.gamma >= 0, f"gamma must be >= 0, got {self.gamma}"),
            (self.gamma_normalization in GAMMA_NORMALIZATIONS,
             f"gamma_normalization must be one of {GAMMA_NORMALIZATIONS}, got {self.gamma_normalization!r}"),
            (self.alpha_init >= 1 and self.alpha_final >= 1,
             f"alpha_init and alpha_final must be >= 1, got {self.alpha_init}, {self.alpha_final}"),
            (self.alpha_steps is None or self.alpha_steps > 0, f"alpha_steps must be positive, got {self.alpha_steps}"),
            (self.clip_norm >= 0, f"clip_norm must be >= 0 (0 = off), got {self.clip_norm}"),
            (self.lr_decay in LR_DECAYS, f"lr_decay must be one of {LR_DECAYS}, got {self.lr_decay!r}"),
            (self.init_config is None or isinstance(self.init_config, dict),
             f"init_config must be None or a dict of GPT2Config fields, got {self.init_config!r}"),
            (self.data.seq_len == 0 or self.data.seq_len >= 3,
             f"seq_len must be at least 3 (the sparsity loss needs causal pairs), got {self.data.seq_len}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        return self


RESUMABLE = ("steps", "log_every", "eval_every", "eval_batches", "ckpt_every", "keep_checkpoints",
             "async_checkpoints")


def config_to_dict(cfg: FinetuneConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> FinetuneConfig:
    """Inverse of ``config_to_dict`` (lists become tuples). Raises ValueError for unknown fields."""
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{CONFIG_NAME}: unknown field(s) {', '.join(unknown)}")
    data = dict(d.get("data") or {})
    hints = typing.get_type_hints(DataConfig)
    for k, v in data.items():
        if isinstance(v, list) and typing.get_origin(hints.get(k)) is tuple:
            data[k] = tuple(v)
    return FinetuneConfig(**{**d, "data": DataConfig(**data)})


def load_config(workdir: str) -> FinetuneConfig:
    """The ``finetune_config.json`` of a run. Raises FileNotFoundError when absent."""
    path = os.path.join(workdir, CONFIG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found; --workdir must be a directory written by 'fox-jax finetune-dcp'")
    with open(path) as f:
        return config_from_dict(json.load(f))


def _write_json(obj: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def load_model_config(workdir: str) -> GPT2Config:
    """The ``GPT2Config`` (with DCP) saved in a run. Raises FileNotFoundError when absent."""
    path = os.path.join(workdir, MODEL_CONFIG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found; --workdir must be a directory written by 'fox-jax finetune-dcp'")
    with open(path) as f:
        return GPT2Config(**json.load(f))


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


def make_train_step(model: GPT2, optimizer, gamma_eff: float):
    """``(state, batch, alpha) -> (state, metrics)``; ``alpha`` a float32 scalar (traced: no recompile).

    metrics: loss, ce, sparsity_loss (γ_eff·mean causal keep probability), keep_mean, sparsity (mean of
    the per-layer floored-pair fraction), sparsity_layers [L], grad_norm, beta_mean.
    """

    def loss_fn(params, batch, alpha):
        logits, aux = model.apply({"params": params}, batch["inputs"], alpha=alpha, **_model_inputs(batch))
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]))
        if not model.config.dcp:  # dense pretraining: no mask, nothing dropped
            zero = jnp.zeros((), jnp.float32)
            return ce, (ce, zero, jnp.ones((), jnp.float32), jnp.zeros((model.config.n_layer,), jnp.float32))
        keep_mean = aux["sparsity_loss"]
        sp_loss = gamma_eff * keep_mean
        return ce + sp_loss, (ce, sp_loss, keep_mean, aux["sparsity"])

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step_fn(state: TrainState, batch, alpha):
        (loss, (ce, sp_loss, keep_mean, sp_layers)), grads = grad_fn(state.params, batch, alpha)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        betas = [params[f"h_{i}"]["attn"].get("beta", jnp.full((), jnp.nan)) for i in range(model.config.n_layer)]
        metrics = {"loss": loss, "ce": ce, "sparsity_loss": sp_loss, "keep_mean": keep_mean,
                   "sparsity": jnp.mean(sp_layers), "sparsity_layers": sp_layers,
                   "grad_norm": optax.tree.norm(grads), "beta_mean": jnp.mean(jnp.stack(betas))}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step_fn


def make_eval_step(model: GPT2):
    """``(params, batch) -> (CE sum, tokens, per-layer sparsity [L])`` with the step mask α = ∞."""

    def eval_fn(params, batch):
        alpha = float("inf") if model.config.dcp else None
        logits, aux = model.apply({"params": params}, batch["inputs"], alpha=alpha, **_model_inputs(batch))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        sp = aux["sparsity"] if model.config.dcp else jnp.zeros((model.config.n_layer,), jnp.float32)
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
    if "loss" in m and math.isnan(m.get("beta_mean", 0.0)):  # dense training (pretrain-gpt2)
        parts += [f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}", f"gnorm {m['grad_norm']:.3f}"]
    elif "loss" in m:
        parts += [f"loss {m['loss']:.4f}", f"ce {m['ce']:.4f}", f"sp_loss {m['sparsity_loss']:.4f}",
                  f"sparsity {100 * m['sparsity']:.1f}%", f"α {m['alpha']:.3f}", f"β̄ {m['beta_mean']:.3f}",
                  f"lr {m['lr']:.2e}", f"gnorm {m['grad_norm']:.3f}"]
    if m.get("tokens_per_sec") is not None:
        rate = m["tokens_per_sec"]
        parts.append(f"{rate / 1e3:.1f}k tok/s" if rate >= 1e3 else f"{rate:.0f} tok/s")
    if "val_loss" in m and "beta_mean" in m and math.isnan(m["beta_mean"]):
        parts.append(f"val_loss {m['val_loss']:.4f} (ppl {m['val_ppl']:.2f})")
    elif "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f} (ppl {m['val_ppl']:.2f}, sparsity {100 * m['val_sparsity']:.1f}% "
                     "at α=∞)")
    return " | ".join(parts)


# The run -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class FinetuneResult:
    workdir: str
    final_step: int
    val: dict[str, float] | None
    hf_dir: str


def _check_resume(saved: FinetuneConfig, given: FinetuneConfig) -> None:
    a, b = config_to_dict(saved), config_to_dict(given)
    diff = sorted(k for k in a if k not in RESUMABLE and a[k] != b.get(k))
    if diff:
        raise ValueError(f"--resume: {', '.join(diff)} differ from the saved run's; only {', '.join(RESUMABLE)} "
                         "may change when resuming (or use a new --workdir)")


def finetune(cfg: FinetuneConfig, workdir: str, *, resume: bool = False, progress: bool = True) -> FinetuneResult:
    """DCP fine-tuning of ``cfg.hf_gpt2`` in ``workdir`` (see the module docstring).

    A workdir with checkpoints is only continued with ``resume=True``; the saved config then wins except
    for ``RESUMABLE`` fields, which are taken from ``cfg``. ``cfg`` may leave ``warmup_steps`` /
    ``alpha_steps`` None; they are resolved from ``steps`` on a fresh start.

    Raises:
      FileExistsError: checkpoints exist and ``resume`` is False.
      FileNotFoundError / ValueError: bad HF directory, data or config (seq_len > n_positions, a
        tokenizer larger than the model's vocabulary, a resume with changed settings).
      CheckpointError: an unreadable or mismatched checkpoint.
      FloatingPointError: the loss became NaN/inf.
    """
    workdir = os.path.abspath(workdir)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    has_ckpt = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
    if has_ckpt and not resume:
        raise FileExistsError(f"{workdir} already holds checkpoints; pass --resume to continue that run, "
                              "or choose another --workdir")
    if has_ckpt:
        saved = load_config(workdir)
        given = dataclasses.replace(cfg, warmup_steps=cfg.warmup_steps if cfg.warmup_steps is not None
                                    else saved.warmup_steps,
                                    alpha_steps=cfg.alpha_steps if cfg.alpha_steps is not None else saved.alpha_steps)
        _check_resume(saved, given)
        cfg = dataclasses.replace(saved, **{k: getattr(cfg, k) for k in RESUMABLE})
        model_cfg = load_model_config(workdir)
        params = None
    else:
        cfg = cfg.validate().resolved()
        if cfg.init_config is not None:
            model_cfg = GPT2Config(**{**cfg.init_config, "dcp": cfg.dcp, "interaction_dim": cfg.interaction_dim,
                                      "beta_init": cfg.beta_init, "dtype": cfg.dtype, "remat": cfg.remat})
            params = init_gpt2(model_cfg, jax.random.PRNGKey(cfg.seed))
        elif not cfg.hf_gpt2:
            raise ValueError("--hf-gpt2 is required: the pretrained GPT-2 directory to fine-tune")
        else:
            model_cfg, params = load_hf_gpt2(cfg.hf_gpt2, dcp=cfg.dcp, rng=jax.random.PRNGKey(cfg.seed),
                                             interaction_dim=cfg.interaction_dim, beta_init=cfg.beta_init,
                                             dtype=cfg.dtype, remat=cfg.remat)
    cfg.validate()
    if cfg.data.seq_len == 0:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=model_cfg.n_positions))
    seq_len = cfg.data.seq_len
    if seq_len > model_cfg.n_positions:
        raise ValueError(f"seq_len {seq_len} exceeds the model's n_positions={model_cfg.n_positions} "
                         "(GPT-2 has learned absolute positions)")

    corpus = data_lib.load_corpus(cfg.data)
    if corpus.tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the tokenizer has {corpus.tokenizer.vocab_size} ids but the model only "
                         f"{model_cfg.vocab_size}; pass the GPT-2 --tokenizer")
    os.makedirs(workdir, exist_ok=True)
    _write_json(config_to_dict(cfg), os.path.join(workdir, CONFIG_NAME))
    _write_json(dataclasses.asdict(model_cfg), os.path.join(workdir, MODEL_CONFIG_NAME))

    model = GPT2(model_cfg)
    if params is None:
        params = jax.eval_shape(lambda: init_gpt2(model_cfg, jax.random.PRNGKey(0)))
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
        state, data_state = ckpt.restore(None, abstract)
        train_iter.set_state(data_state)
        _log(f"resumed from {ckpt_dir} at step {int(state.step)}")
    else:
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                           rng=jax.random.PRNGKey(cfg.seed))
    start_step = int(state.step)

    step_fn = jax.jit(make_train_step(model, optimizer, gamma_eff), donate_argnums=(0,))
    eval_fn = jax.jit(make_eval_step(model))
    val_batches = data_lib.make_val_batches(corpus, cfg.batch_size, cfg.eval_batches)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state.params))
    what = (f"DCP fine-tuning of {cfg.hf_gpt2 or 'a random init'}" if cfg.dcp
            else f"dense training of {cfg.hf_gpt2 or 'a random init'}")
    dcp_desc = (f"r={model_cfg.interaction_dim}, γ={cfg.gamma} ({cfg.gamma_normalization}; γ_eff={gamma_eff:.4f} on "
                f"the causal mean); α {cfg.alpha_init}→{cfg.alpha_final} over {cfg.alpha_steps} steps; " if cfg.dcp else "")
    _log(f"{what}: {model_cfg.n_layer} layers, d={model_cfg.n_embd}, {n_params / 1e6:.2f}M parameters; {dcp_desc}"
         f"lr {cfg.lr:g} ({cfg.lr_decay}), warmup {cfg.warmup_steps}; seq_len {seq_len}, batch {cfg.batch_size}; "
         f"data: {corpus.summary()}; workdir {workdir}")

    writer = MetricWriter(workdir)
    tokens_per_step = cfg.batch_size * seq_len
    val = None
    bar = tqdm(total=cfg.steps, initial=start_step, disable=not progress, desc="finetune-dcp", unit="step",
               dynamic_ncols=True)
    step = start_step
    pending: list[tuple[int, float, dict]] = []
    try:
        if start_step == 0 and cfg.eval_every > 0:
            val = evaluate(eval_fn, state.params, val_batches)
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
                    val = evaluate(eval_fn, state.params, val_batches)
                    row.update(val)
                    t_last = time.perf_counter()  # evaluation time is not training throughput
                writer.write(step, row)
                bar.set_postfix(ce=f"{row['ce']:.3f}", sparsity=f"{100 * row['sparsity']:.1f}%",
                                alpha=f"{row['alpha']:.2f}", refresh=False)
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

    hf_dir = export_hf(workdir, model_cfg, state.params, corpus.tokenizer)
    _log(f"exported the model to {hf_dir} (Hugging Face GPT-2 format)")
    return FinetuneResult(workdir, step, val, hf_dir)


def _row(m: dict, alpha: float, lr: float, rate) -> dict[str, float]:
    """One metrics.jsonl row: the step's metrics, per-layer sparsity, the α and lr it used, tokens/s."""
    row = {k: float(v) for k, v in m.items() if k != "sparsity_layers"}
    row.update({f"sparsity_layer_{i}": float(v) for i, v in enumerate(np.asarray(m["sparsity_layers"]))})
    row["alpha"] = alpha
    row["lr"] = lr
    row["tokens_per_sec"] = rate
    return row


def export_hf(workdir: str, model_cfg: GPT2Config, params, tokenizer) -> str:
    """Write ``<workdir>/hf``: ``save_hf_gpt2`` (DCP params in ``dcp_interaction.safetensors``) plus the
    tokenizer's files, so ``fox-jax zeroshot --hf-gpt2 <workdir>/hf --dcp`` needs no ``--tokenizer``."""
    hf_dir = os.path.join(workdir, "hf")
    save_hf_gpt2(model_cfg.replace(remat=False), jax.device_get(params), hf_dir)
    for f in getattr(tokenizer, "files", ()):
        shutil.copyfile(f, os.path.join(hf_dir, os.path.basename(f)))
    return hf_dir


def load_finetuned(workdir: str, *, step: int | None = None,
                   dcp: bool = True) -> tuple[GPT2Config, Any, int, FinetuneConfig]:
    """Params of a finetune-dcp run's checkpoint (latest or ``step``).

    Args:
      workdir: the run directory.
      step: checkpoint step (None: latest).
      dcp: keep the DCP parameters (False: the dense GPT-2 part, config with dcp=False).

    Returns:
      (GPT2Config, params, step, FinetuneConfig).

    Raises:
      FileNotFoundError: not a finetune-dcp run. CheckpointError: no / bad checkpoint.
    """
    cfg = load_config(workdir)
    model_cfg = load_model_config(workdir).replace(remat=False)
    abstract_params = jax.eval_shape(lambda: init_gpt2(model_cfg, jax.random.PRNGKey(0)))
    optimizer = make_optimizer(cfg, abstract_params)
    abstract = jax.eval_shape(lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p,
                                                   opt_state=optimizer.init(p), rng=jax.random.PRNGKey(0)),
                              abstract_params)
    state = restore_run(workdir, abstract, step)
    params = state.params
    if not dcp:
        model_cfg = model_cfg.replace(dcp=False)
        params = {k: ({**v, "attn": {n: w for n, w in v["attn"].items() if n not in INTERACTION_PARAMS}}
                      if k.startswith("h_") else v) for k, v in params.items()}
    return model_cfg, params, int(state.step), cfg


def _emit(bar, progress: bool, line: str) -> None:
    if progress:
        bar.write(line)
    else:
        _log(line)


def _log(msg: str) -> None:
    tqdm.write(msg)


# Command line ---------------------------------------------------------------------------------------

def _add_run_flags(f, d: FinetuneConfig) -> None:
    """Flags shared by ``finetune-dcp`` and ``pretrain-gpt2`` (data, optimizer, loop)."""
    f.add_argument("--workdir", required=True, help="run directory (checkpoints/, metrics.jsonl, hf/)")
    f.add_argument("--data", nargs="+", help="training text: files, directories or globs (.txt/.jsonl/.npy)")
    f.add_argument("--val-data", nargs="+", help="validation text (default: hold out a fraction of --data)")
    f.add_argument("--tokenizer", help="GPT-2 tokenizer: a directory with vocab.json + merges.txt "
                   "(default: --hf-gpt2 if it holds them)")
    f.add_argument("--seq-len", type=int, help="tokens per sequence (default: n_positions)")
    f.add_argument("--batch-size", type=int, help=f"sequences per step (default {d.batch_size})")
    f.add_argument("--steps", type=int, help=f"optimizer steps (default {d.steps})")
    f.add_argument("--lr", type=float, help=f"AdamW learning rate (default {d.lr:g})")
    f.add_argument("--warmup-steps", type=int, help="linear warmup steps (default min(2000, 8%% of steps))")
    f.add_argument("--weight-decay", type=float, help=f"AdamW weight decay (default {d.weight_decay:g})")
    f.add_argument("--clip-norm", type=float,
                   help=f"gradient clipping by global norm, 0 = off (default {d.clip_norm:g})")
    f.add_argument("--dtype", choices=("float32", "bfloat16"), help=f"compute dtype of the trunk (default {d.dtype})")
    f.add_argument("--remat", action="store_true", default=None, help="rematerialise blocks (saves memory)")
    f.add_argument("--seed", type=int, help=f"seed of the parameter init (default {d.seed})")
    f.add_argument("--data-seed", type=int, help="seed of the data order and split (default 0)")
    f.add_argument("--log-every", type=int, help=f"default {d.log_every}")
    f.add_argument("--eval-every", type=int, help=f"validation interval, 0 = only at the end (default {d.eval_every})")
    f.add_argument("--eval-batches", type=int, help=f"validation batches (default {d.eval_batches})")
    f.add_argument("--ckpt-every", type=int, help=f"checkpoint interval (default {d.ckpt_every})")
    f.add_argument("--resume", action="store_true", help="continue the run in --workdir from its last checkpoint")
    f.add_argument("--no-progress", action="store_true", help="log lines only, no progress bar")


# ``fox-jax pretrain-gpt2``: the same loop, dense, from a random init, with pretraining defaults.
PRETRAIN_DEFAULTS = dict(dcp=False, lr=6e-4, weight_decay=0.1, b2=0.95, lr_decay="cosine", batch_size=8,
                         steps=5000, eval_every=500, ckpt_every=500)


def add_subparser(sub) -> None:
    """Register ``fox-jax finetune-dcp`` (handler ``cmd_finetune_dcp``) and ``fox-jax pretrain-gpt2``
    (handler ``cmd_pretrain_gpt2``)."""
    d = FinetuneConfig()
    f = sub.add_parser("finetune-dcp", help="Dynamic Context Pruning fine-tuning of a Hugging Face GPT-2")
    f.add_argument("--hf-gpt2", help="pretrained HF GPT-2 directory (config.json + model.safetensors)")
    _add_run_flags(f, d)
    f.add_argument("--interaction-lr", type=float, help="learning rate of q_int, k_int, β (default: --lr)")
    f.add_argument("--gamma", type=float, help=f"sparsity strength γ (default {d.gamma:g})")
    f.add_argument("--gamma-normalization", choices=GAMMA_NORMALIZATIONS,
                   help="'code': γ as in the reference code (mean over the (T-1)xT slice, γ_eff≈γ/2); "
                        "'causal': γ on the mean over causal pairs (paper). Default code")
    f.add_argument("--interaction-dim", type=int, help=f"r (default {d.interaction_dim})")
    f.add_argument("--beta-init", type=float, help=f"initial β (default {d.beta_init:g})")
    f.add_argument("--alpha-init", type=float, help=f"α at step 0 (default {d.alpha_init:g})")
    f.add_argument("--alpha-final", type=float, help=f"final α (default {d.alpha_final:g})")
    f.add_argument("--alpha-steps", type=int, help="length of the cosine α ramp (default: --steps)")
    f.set_defaults(handler=cmd_finetune_dcp, distributed=False, coordinator=None, num_processes=None, process_id=None)

    p = dataclasses.replace(d, **PRETRAIN_DEFAULTS)
    g = sub.add_parser("pretrain-gpt2", help="train a dense GPT-2 from a random init (the base model for DCP)")
    _add_run_flags(g, p)
    g.add_argument("--size", default="gpt2", help="released GPT-2 shape to start from: "
                   "gpt2 | gpt2-medium | gpt2-large | gpt2-xl (default gpt2); the flags below override it")
    for name in ("n_layer", "n_head", "n_embd", "n_positions"):
        g.add_argument("--" + name.replace("_", "-"), type=int, help=f"GPT2Config.{name}")
    g.set_defaults(handler=cmd_pretrain_gpt2, distributed=False, coordinator=None, num_processes=None,
                   process_id=None, hf_gpt2=None)


_FLAG_FIELDS = ("steps", "batch_size", "lr", "interaction_lr", "warmup_steps", "weight_decay", "clip_norm", "gamma",
                "gamma_normalization", "interaction_dim", "beta_init", "alpha_init", "alpha_final", "alpha_steps",
                "dtype", "remat", "seed", "log_every", "eval_every", "eval_batches", "ckpt_every")


def config_from_args(args, base: FinetuneConfig | None = None) -> FinetuneConfig:
    """A ``FinetuneConfig`` from the CLI flags given (others from ``base`` or the defaults).

    Raises:
      FileNotFoundError: a --data / --val-data path does not exist.
      ValueError: no --tokenizer and none in --hf-gpt2.
    """
    cfg = base or FinetuneConfig()
    kw = {k: getattr(args, k) for k in _FLAG_FIELDS if getattr(args, k, None) is not None}
    if getattr(args, "hf_gpt2", None):
        kw["hf_gpt2"] = os.path.abspath(args.hf_gpt2)
    data = cfg.data
    for flag, paths in (("--data", args.data), ("--val-data", args.val_data)):
        for p in paths or ():
            if not any(ch in p for ch in "*?[") and not os.path.exists(p):
                raise FileNotFoundError(f"{flag}: {p} does not exist; give a file, directory or glob of text")
    dkw = {}
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
    if args.resume and os.path.exists(cfg_path):
        cfg = config_from_args(args, base=load_config(args.workdir))
    else:
        if not args.tokenizer:
            raise ValueError("--tokenizer is required (a directory with GPT-2 vocab.json + merges.txt)")
        shape = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "n_positions")
                 if getattr(args, k) is not None}
        init_config = dataclasses.asdict(gpt2_preset(args.size, **shape))
        for k in ("dcp", "interaction_dim", "beta_init", "dtype", "remat"):  # set by the run config
            init_config.pop(k)
        cfg = config_from_args(args, base=FinetuneConfig(**PRETRAIN_DEFAULTS, init_config=init_config))
    result = finetune(cfg, args.workdir, resume=args.resume, progress=not args.no_progress)
    msg = f"done: {result.final_step} steps in {result.workdir}; model exported to {result.hf_dir}"
    if result.val:
        msg += f"; val_loss {result.val['val_loss']:.4f}, val_ppl {result.val['val_ppl']:.2f}"
    print(msg)
    return 0


def cmd_finetune_dcp(args) -> int:
    """The ``fox-jax finetune-dcp`` handler."""
    cfg_path = os.path.join(args.workdir, CONFIG_NAME)
    if args.resume and os.path.exists(cfg_path):
        cfg = config_from_args(args, base=load_config(args.workdir))
    else:
        if not args.hf_gpt2:
            raise ValueError("--hf-gpt2 is required: the pretrained GPT-2 directory to fine-tune")
        if not os.path.isdir(args.hf_gpt2):
            raise FileNotFoundError(f"--hf-gpt2 {args.hf_gpt2}: no such directory")
        cfg = config_from_args(args)
    result = finetune(cfg, args.workdir, resume=args.resume, progress=not args.no_progress)
    msg = f"done: {result.final_step} steps in {result.workdir}; model exported to {result.hf_dir}"
    if result.val:
        msg += (f"; val_loss {result.val['val_loss']:.4f}, val_ppl {result.val['val_ppl']:.2f}, "
                f"sparsity {100 * result.val['val_sparsity']:.1f}% at α=∞")
    print(msg)
    return 0
