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
  learning rate (``optax.multi_transform``: their Adam step is scaled by interaction_lr / lr; the weight
  decay is not).
* data: the grain pipeline of ``fox_jax.train.data`` (``--data``, ``--val-data``, ``--tokenizer``: GPT-2's for
  ``--hf-gpt2``, the run's by default for ``--from-run``), packed windows of ``seq_len`` tokens with
  per-document positions and segment ids (GPT-2: ≤ n_positions, default n_positions; ``--from-run``:
  default the run's seq_len); batch 6 (the README's).

Validation (every ``eval_every`` steps and at the end): cross-entropy / perplexity with the **inference
step mask α = ∞**, and the pair sparsity it produces (fraction of causal pairs dropped, docs/design/dcp.md §3.2)
overall and per layer. Training rows log the sparsity of the current soft mask (pairs whose log I hit the
floor, ≈ 0 while α ≈ 1).

The run is ``fox_jax.train.loop.run`` with the ``DCPTask`` below, so it has what pretraining has: a
device mesh (``--mesh``), gradient accumulation, multi-host, the same log line, metrics.jsonl (truncated
to the restored step on a resume) and exact resume. Run directory::

    config.json            the ExperimentConfig: model (the pretrained model with DCP, ``model_type`` "gpt2"
                           or "lm"), data, optim, dcp (the source, γ, α; resolved warmup / alpha_steps /
                           from_step) and the loop
    checkpoints/<step>/    orbax: TrainState (step, params, AdamW state, rng) + data-iterator position
    metrics.jsonl, tb/     per step: loss, ce, sparsity_loss, keep_mean, sparsity, sparsity_layer_{i}, alpha,
                           lr, grad_norm, beta_mean, tokens_per_sec, tflops; at evaluations val_loss, val_ppl,
                           val_sparsity, val_sparsity_layer_{i}
    hf/                    GPT-2 only: the final model, save_hf_gpt2 (model.safetensors +
                           dcp_interaction.safetensors) plus the tokenizer files

``--resume`` continues exactly (same batches, same optimizer state); only ``steps``, the
logging / evaluation / checkpoint intervals, the mesh and ``--dcp-impl`` (same math, other kernels) may change.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fox_jax.ops.alpha_sigmoid import cosine_alpha_schedule
from fox_jax.train import config as config_lib
from fox_jax.train.checkpoints import CheckpointError
from fox_jax.train.cli import check_paths, explicit_overrides, print_done
from fox_jax.train.loop import LMTask, RunResult, evaluate, has_checkpoints, log, masked_mean, next_token_ce, run
from fox_jax.train.runs import open_run

INTERACTION_PARAMS = ("q_int", "k_int", "beta")


def effective_gamma(dcp: config_lib.DCPConfig, seq_len: int) -> float:
    """γ_eff multiplying the causal-pair mean keep probability (see the module docstring)."""
    if dcp.gamma_normalization == "code":
        return dcp.gamma * (seq_len - 2) / (2 * seq_len)
    return dcp.gamma


def interaction_labels(params) -> Any:
    """"interaction" for q_int, k_int and β, "default" for every other leaf (``optax.multi_transform``)."""
    def label(path, _):
        names = {getattr(p, "key", None) for p in path}
        return "interaction" if names & set(INTERACTION_PARAMS) else "default"
    return jax.tree_util.tree_map_with_path(label, params)


# The pretrained model -------------------------------------------------------------------------------

def source_run(path: str, step: int | None = None):
    """The ``--from-run`` source: a ``fox-jax train`` run of a dense FoX / Transformer (``runs.open_run``).

    Raises:
      FileNotFoundError / ValueError: no such run, another kind of run, or a model that already has DCP.
      CheckpointError: no checkpoint (for ``step``).
    """
    run = open_run(path, step=step, flag="--from-run" if step is None else f"--from-run/--from-step {step}")
    if run.kind != "train":
        hint = (" (continue a finetune-dcp run with --workdir DIR --resume)" if run.kind == "finetune"
                else " (for a Hugging Face GPT-2 use --hf-gpt2)")
        raise ValueError(f"--from-run {path} is {run.what}; --from-run takes a 'fox-jax train' run{hint}")
    if run.model.dcp:
        raise ValueError(f"--from-run {path}: the run's model already has DCP (model.dcp=True); "
                         "finetune-dcp adds DCP to a dense FoX/Transformer run")
    if run.step is None:
        raise CheckpointError(f"--from-run {path}: no checkpoint in {path}/checkpoints")
    return run


def convert_to_dcp(model_cfg, model_overrides: list[str] = ()):
    """A dense pretrained model's config → the config fine-tuned: DCP on, ACP off (``adaptive_threshold``
    None, logged: DCP cannot be combined with it), compute dtype float32, then ``model.*`` overrides
    (``model.dtype``, ``model.remat``, ``model.interaction_dim``, ``model.dcp_beta_init``, ``model.dcp_impl``).

    Raises:
      ValueError: a bad override (naming the field).
    """
    if getattr(model_cfg, "adaptive_threshold", None) is not None:
        log(f"--from-run: turning ACP off (adaptive_threshold={model_cfg.adaptive_threshold!r} -> None): "
            "DCP cannot be combined with ACP block pruning")
        model_cfg = model_cfg.replace(adaptive_threshold=None)
    model_cfg = model_cfg.replace(dcp=True, dtype="float32")
    return config_lib.apply_overrides(config_lib.ExperimentConfig(model=model_cfg), list(model_overrides)).model


def with_source(cfg: config_lib.ExperimentConfig, overrides: list[str]) -> config_lib.ExperimentConfig:
    """``cfg`` (a fresh fine-tune, every value checked) with the pretrained model of ``cfg.dcp`` as its model
    section (``convert_to_dcp`` with the ``model.*`` overrides) and the defaults taken from the source:
    for ``--hf-gpt2`` the tokenizer in that directory; for ``--from-run`` the run's tokenizer, text (without
    --data), seq_len and latest checkpoint step.

    Raises:
      FileNotFoundError / ValueError: no or a bad source; no --tokenizer for a HF directory without one.
      CheckpointError: no checkpoint ``--from-step`` in the run.
    """
    d, data = cfg.dcp, cfg.data
    given = {o.split("=", 1)[0] for o in overrides}
    model_overrides = [o for o in overrides if o.startswith("model.")]
    if d.from_run:
        run = source_run(d.from_run, d.from_step)
        exp = run.config
        if "data.train" not in given:  # the run's own text
            data = dataclasses.replace(data, **{k: getattr(exp.data, k) for k in (
                "train", "val", "separator", "text_field", "val_fraction", "max_docs")})
        if "data.tokenizer" not in given:
            data = dataclasses.replace(data, tokenizer=exp.data.tokenizer)
        if data.seq_len == 0:
            data = dataclasses.replace(data, seq_len=exp.data.seq_len)
        model = convert_to_dcp(exp.model, model_overrides)
        d = dataclasses.replace(d, from_step=run.step)
    elif d.hf_gpt2:
        from fox_jax.models.hf_gpt2 import DCP_CONFIG_KEY, config_from_hf, read_config

        if not os.path.isdir(d.hf_gpt2):
            raise FileNotFoundError(f"--hf-gpt2 {d.hf_gpt2}: no such directory")
        if "data.tokenizer" not in given:
            if not all(os.path.isfile(os.path.join(d.hf_gpt2, f)) for f in ("vocab.json", "merges.txt")):
                raise ValueError("--tokenizer is required (a directory with GPT-2 vocab.json + merges.txt); "
                                 "--hf-gpt2 holds none")
            data = dataclasses.replace(data, tokenizer=d.hf_gpt2)
        hf = {k: v for k, v in read_config(d.hf_gpt2, "GPT-2").items() if k != DCP_CONFIG_KEY}
        model = convert_to_dcp(config_from_hf(hf), model_overrides)
    else:
        raise ValueError("--hf-gpt2 or --from-run is required: the pretrained model to fine-tune "
                         "(a Hugging Face GPT-2 directory or a 'fox-jax train' run)")
    return dataclasses.replace(cfg, model=model, data=data, dcp=d)


# The task -------------------------------------------------------------------------------------------

class DCPTask(LMTask):
    """DCP fine-tuning on the loop: CE + γ_eff·(mean causal keep probability), α(step) from the host, the
    interaction learning rate, sparsity metrics, validation at α = ∞, and the HF export (GPT-2)."""

    name = "finetune-dcp"

    def __init__(self, cfg: config_lib.ExperimentConfig):
        super().__init__(cfg)
        d = cfg.dcp
        self.gamma_eff = effective_gamma(d, cfg.data.seq_len)
        self.layer_names = cfg.model.layer_names
        with jax.default_device(jax.devices("cpu")[0]):  # on the host: no device round trip per step
            schedule = cosine_alpha_schedule(d.alpha_init, d.alpha_final, d.alpha_steps)
            self.alphas = np.asarray(schedule(np.arange(cfg.steps)), np.float32)

    def check_vocab(self, cfg, tokenizer, fixed: bool):
        """The pretrained model's vocabulary is fixed: the tokenizer must fit in it."""
        if tokenizer.vocab_size > cfg.model.vocab_size:
            if cfg.dcp.from_run:
                raise ValueError(f"--tokenizer {cfg.data.tokenizer} has {tokenizer.vocab_size} ids but the "
                                 f"--from-run model only {cfg.model.vocab_size}; drop --tokenizer to use the run's own")
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                             f"{cfg.model.vocab_size}; pass the GPT-2 --tokenizer")
        return cfg

    def init_params(self, cfg, rng):
        """The pretrained params plus fresh interaction params from ``rng`` (no source: a random init)."""
        d, model = cfg.dcp, cfg.model
        if d.from_run:
            run = source_run(d.from_run, d.from_step)
            params = run.load_params()
            log(f"restored {d.from_run} at step {run.step} ({getattr(run.model, 'arch', run.model.model_type)}, {run.model.n_layers} layers, "
                f"d={run.model.d_model}, vocab {run.model.vocab_size}, tokenizer {run.tokenizer})")
        elif d.hf_gpt2:
            from fox_jax.models.hf_gpt2 import load_hf_gpt2

            loaded, params = load_hf_gpt2(d.hf_gpt2)  # with its DCP params, if it has them
            if loaded.dcp:
                return params
        else:
            return model.init_params(rng)
        return model.replace(dcp=False).add_dcp_params(params, rng, interaction_dim=model.interaction_dim,
                                                       beta_init=model.dcp_beta_init)[1]

    @staticmethod
    def lr_scales(cfg):
        lr, ilr = cfg.optim.lr, cfg.dcp.interaction_lr
        return None if ilr is None or ilr == lr else (interaction_labels, {"interaction": ilr / lr})

    def host_scalars(self, step: int) -> dict[str, np.float32]:
        # γ_eff is traced too: fine-tunes at several γ run one compiled program (the persistent cache serves it)
        return {"alpha": self.alphas[step], "gamma_eff": np.float32(self.gamma_eff)}

    def loss(self, model, params, batch, scalars):
        out = model.apply({"params": params}, batch["inputs"], batch.get("segment_ids"), batch.get("positions"),
                          alpha=scalars["alpha"])
        losses = next_token_ce(out.logits, batch)
        ce = masked_mean(losses, batch)[0]
        keep_mean = out.aux["sparsity_loss"]
        sp_loss = scalars["gamma_eff"] * keep_mean
        return ce + sp_loss, {"ce": ce, "sparsity_loss": sp_loss, "keep_mean": keep_mean,
                              "sparsity": jnp.mean(out.aux["sparsity"]), "sparsity_layers": out.aux["sparsity"]}

    def param_metrics(self, params) -> dict:
        return {"beta_mean": jnp.mean(jnp.stack([params[name]["attn"]["beta"] for name in self.layer_names]))}

    def eval_step(self, model, params, batch) -> dict:
        return eval_sums(model, len(self.layer_names), params, batch)

    @staticmethod
    def eval_metrics(sums: dict, n_batches: int) -> dict[str, float]:
        """val_loss, val_ppl, val_sparsity and val_sparsity_layer_{i} (the mean over batches)."""
        out = LMTask.eval_metrics(sums, n_batches)
        per_layer = np.asarray(sums["sparsity"]) / max(n_batches, 1)
        out["val_sparsity"] = float(per_layer.mean())
        out.update({f"val_sparsity_layer_{i}": float(v) for i, v in enumerate(per_layer)})
        return out

    def row(self, metrics: dict, scalars: dict) -> dict[str, float]:
        row = {k: float(v) for k, v in metrics.items() if k != "sparsity_layers"}
        row.update({f"sparsity_layer_{i}": float(v) for i, v in enumerate(np.asarray(metrics["sparsity_layers"]))})
        row["alpha"] = float(scalars["alpha"])
        return row

    def describe(self, cfg) -> str:
        d, m, o = cfg.dcp, cfg.model, cfg.optim
        source = (f"{d.from_run} (step {d.from_step}, {getattr(m, 'arch', m.model_type)})" if d.from_run else d.hf_gpt2 or "a random init")
        return (f"DCP fine-tuning of {source}: {m.n_layers} layers, d={m.d_model}; r={m.interaction_dim}, "
                f"γ={d.gamma} ({d.gamma_normalization}; γ_eff={self.gamma_eff:.4f} on the causal mean); α "
                f"{d.alpha_init}→{d.alpha_final} over {d.alpha_steps} steps; lr {o.lr:g} ({o.schedule}), warmup "
                f"{o.warmup_steps}")

    def on_finish(self, cfg, state, corpus, workdir) -> dict:
        if cfg.model.model_type == "gpt2":
            return super().on_finish(cfg, state, corpus, workdir)
        log(f"the fine-tuned {cfg.model.arch} model (DCP) is in {workdir}/checkpoints (step {int(state.step)}); "
            "there is no Hugging Face export for FoX/Transformer models: load it with "
            "fox_jax.train.runs.open_run(workdir).load_params()")
        return {}


def eval_sums(model, n_layers: int, params, batch) -> dict:
    """One validation batch at the inference step mask α = ∞: CE sum, tokens and the per-layer pair sparsity
    [L] (zeros for a dense model)."""
    out = model.apply({"params": params}, batch["inputs"], batch.get("segment_ids"), batch.get("positions"),
                      alpha=float("inf"))
    losses = next_token_ce(out.logits, batch)
    sparsity = out.aux.get("sparsity", jnp.zeros((n_layers,), jnp.float32))
    return {"loss_sum": jnp.sum(losses), "tokens": jnp.asarray(losses.size, jnp.float32), "sparsity": sparsity}


def evaluate_at_inf(model_cfg, params, batches) -> dict[str, float]:
    """``DCPTask.eval_metrics`` of a model (dense, DCP or a fixed sparse pattern) on ``batches``."""
    model = model_cfg.with_remat("none").build()
    fn = jax.jit(lambda p, b: eval_sums(model, model_cfg.n_layers, p, b))
    return evaluate(DCPTask, fn, params, list(batches))


# Runs -------------------------------------------------------------------------------------------------

def finetune(cfg: config_lib.ExperimentConfig, workdir: str, **kw) -> RunResult:
    """``run(cfg, workdir, DCPTask, **kw)``: DCP fine-tuning of ``cfg.dcp``'s source (``with_source``), or of
    a random init of ``cfg.model`` (DCP on) when the source is empty."""
    return run(cfg, workdir, DCPTask, **kw)


def cmd_finetune_dcp(args) -> int:
    """The ``fox-jax finetune-dcp`` handler (``--hf-gpt2`` or ``--from-run``; ``--resume``)."""
    overrides = explicit_overrides(args)
    cfg_path = os.path.join(args.workdir, config_lib.CONFIG_NAME)
    if args.resume and has_checkpoints(args.workdir) and os.path.exists(cfg_path):
        cfg = config_lib.apply_overrides(config_lib.load_json(cfg_path), overrides)  # flags given now override it
    else:
        cfg = config_lib.apply_overrides(config_lib.finetune_defaults(), overrides)  # checks every value first
        cfg = with_source(cfg, overrides)
    check_paths(cfg)
    result = finetune(cfg, args.workdir, resume=args.resume, resume_step=args.resume_step,
                      progress=not args.no_progress)
    extra = f", sparsity {100 * result.val['val_sparsity']:.1f}% at α=∞" if result.val else ""
    print_done(result, extra)
    return 0
