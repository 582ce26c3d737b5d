"""The training loop of every training command (``fox-jax train``, ``pretrain-gpt2``, ``finetune-dcp``).

``run(cfg, task, workdir)`` owns what every run needs: the workdir and resume checks, the mesh and the
sharding of the state and the batches, gradient accumulation, multi-host process gating, the metric
cadence (first-step timing, NaN check), evaluation, orbax checkpoints with exact resume, metrics.jsonl
(truncated on resume to the restored step) / TensorBoard / the loss curve, the progress bar or heartbeat,
and closing everything in ``finally``. A ``Task`` supplies what differs between commands: the initial
parameters, the loss and its metrics, the evaluation metrics, per-step host scalars (passed to the jitted
step as float32 arguments, so no value recompiles), the optimizer's per-parameter learning rates, the
log columns and a hook at the end. ``LMTask`` is language-model pretraining of any model family
(FoX / Transformer, GPT-2); ``fox_jax.train.finetune_dcp.DCPTask`` is DCP fine-tuning.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from fox_jax.models import count_params
from fox_jax.ops.cross_entropy import lm_head_cross_entropy
from fox_jax.sharding import batch_sharding, make_mesh, select_partitioner, state_shardings, under_mesh
from fox_jax.train import config as config_lib
from fox_jax.train import data as data_lib
from fox_jax.train.checkpoints import Checkpointer
from fox_jax.train.metrics import MetricWriter, device_peak_flops, format_log_line, plot_loss_curve
from fox_jax.train.progress import Heartbeat, bars_shown, progress_bar
from fox_jax.train.tokenizers import load_tokenizer


class TrainState(flax.struct.PyTreeNode):
    """Everything that changes during training (all arrays: checkpointed and restored exactly)."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


# Optimiser ------------------------------------------------------------------------------------

def weight_decay_mask(params) -> Any:
    """True for linear kernels and embeddings; False for every norm scale (block norms, QK-norm,
    output norm — some are 2-D) and every bias (docs/design/fox_acp.md §2.3, pitfall 9)."""
    def decays(path, _):
        return getattr(path[-1], "key", None) in ("kernel", "embedding")
    return jax.tree_util.tree_map_with_path(decays, params)


def make_schedule(cfg: config_lib.ExperimentConfig) -> optax.Schedule:
    """Linear warmup 0 → lr over ``warmup_steps``, then (``optim.schedule``) a cosine decay to
    ``min_lr_ratio·lr`` at ``steps``, or constant. A run resumed with ``optim.resume_schedule`` continue or
    rewarm has several segments (``optim.schedule_segments``), each this schedule from its start to its end
    (``optax.join_schedules``)."""
    o = cfg.optim

    def one(length: int) -> optax.Schedule:
        if o.schedule == "constant":
            return optax.linear_schedule(0.0, o.lr, o.warmup_steps) if o.warmup_steps else optax.constant_schedule(o.lr)
        warmup = min(o.warmup_steps or 0, max(length - 1, 0))
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=o.lr, warmup_steps=warmup,
            decay_steps=max(length, warmup + 1), end_value=o.lr * o.min_lr_ratio)

    segments = o.segments(cfg.steps)
    if len(segments) == 1:
        return one(segments[0][1])
    return optax.join_schedules([one(end - start) for start, end in segments], [start for start, _ in segments[1:]])


def resume_schedule(saved: config_lib.ExperimentConfig, cfg: config_lib.ExperimentConfig,
                    step: int, ran_at: float | None = None) -> config_lib.ExperimentConfig:
    """The config a resume at ``step`` continues with when ``--steps`` changed: ``optim.schedule_segments`` set
    for ``optim.resume_schedule`` (continue: the old schedule's last segment keeps its end; rewarm: besides, a
    new segment starts at ``step``; stretch: unchanged, the schedule follows the new steps), and a line on
    stderr saying how the learning rate moves at ``step`` (``ran_at``: the rate step ``step`` ran at, as
    logged in metrics.jsonl; default: the saved schedule's). The line is a ``warning:`` when the rate jumps
    by more than 10% of the peak (stretch), when steps will train at lr 0 (continue past the end of a cosine
    to 0), or when a rewarm leaves a decay shorter than its warmup (an extension shorter than twice
    ``warmup_steps``); else a ``note:``. Segments that start after ``step`` (a continuation abandoned by
    ``--resume-step``) are dropped. Unchanged steps, or none left to train: ``cfg`` as it is."""
    o = cfg.optim
    kept = tuple(e for e in o.schedule_segments if int(str(e).partition(":")[0]) <= step)
    if kept != o.schedule_segments:
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(o, schedule_segments=kept))
    if saved.steps == cfg.steps or step >= cfg.steps:
        return cfg
    segments = [f"{a}:{b}" for a, b in dataclasses.replace(saved.optim, schedule_segments=kept).segments(saved.steps)]
    if o.resume_schedule == "continue":
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, schedule_segments=tuple(segments)))
    elif o.resume_schedule == "rewarm":
        if int(segments[-1].partition(":")[0]) == step:
            segments = segments[:-1]
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, schedule_segments=(*segments, str(step))))
    with jax.default_device(jax.devices("cpu")[0]):
        before = float(make_schedule(saved)(max(step - 1, 0))) if ran_at is None else ran_at
        after = float(make_schedule(cfg)(step))
        last = float(make_schedule(cfg)(cfg.steps - 1))
    left = cfg.steps - step
    warmup = min(o.warmup_steps or 0, max(left - 1, 0))  # make_schedule's: a warmup fits in the steps left
    cut = f"; warmup_steps {o.warmup_steps}, cut to fit the {left} steps left" if warmup < (o.warmup_steps or 0) else ""
    what = {"stretch": "recomputed for the new steps (optim.resume_schedule=stretch)",
            "continue": "the old one (optim.resume_schedule=continue)",
            "rewarm": f"warming up again from 0 over {warmup} steps (optim.resume_schedule=rewarm{cut})"}
    msg = (f"--resume with --steps {cfg.steps} (the run had {saved.steps}): the learning-rate schedule is "
           f"{what[o.resume_schedule]}; step {step} ran at lr {before:.3g}, step {step + 1} runs at {after:.3g}")
    warn = abs(after - before) > 0.1 * o.lr  # a jump of more than 10% of the peak
    if o.resume_schedule == "stretch":
        msg += "; --resume-schedule continue keeps the old schedule, rewarm warms up again"
    elif o.resume_schedule == "continue" and o.schedule == "cosine" and o.min_lr_ratio == 0:
        end = int(segments[-1].partition(":")[2])
        msg += (f" (its cosine ends at 0 at step {end}: the {cfg.steps - max(end, step)} steps after it train at lr 0; "
                "--resume-schedule rewarm warms up again)")
        warn = True
    elif o.resume_schedule == "rewarm" and o.schedule == "cosine" and left - warmup < (o.warmup_steps or 0):
        msg += (f"; but {left} more steps leave only {left - warmup} after that warmup (fewer than warmup_steps "
                f"{o.warmup_steps}), too few for the decay: "
                f"the last step runs at lr {last:.3g} ({last / o.lr:.0%} of the peak); give --steps "
                f"{step + 2 * o.warmup_steps} or more (twice the warmup past step {step}), a smaller --warmup-steps, "
                "or --resume-schedule continue")
        warn = True
    else:
        warn = False  # continue / rewarm: the rate moves as asked
    stderr_line(("warning: " if warn else "note: ") + msg)
    return cfg


def short_run_note(cfg: config_lib.ExperimentConfig, last: float) -> str | None:
    """The note of a run no longer than its warmup (``last``: the learning rate of its last step), else None:
    such a run only warms up and ends at (or, constant, below) the peak rate, with no decay."""
    o = cfg.optim
    if not o.warmup_steps or o.warmup_steps < cfg.steps - 1:
        return None
    return (f"note: the run's {cfg.steps} steps are no longer than its warmup (warmup_steps {o.warmup_steps}): the "
            f"learning rate only rises and the last step runs at {last:.3g} ({last / o.lr:.0%} of the peak lr "
            f"{o.lr:g}), with no decay; for a short run give a smaller --warmup-steps (e.g. "
            f"{math.ceil(0.08 * cfg.steps)}, 8% of the steps)")


def make_optimizer(cfg: config_lib.ExperimentConfig,
                   lr_scales: tuple[Callable[[Any], Any], dict[str, float]] | None = None
                   ) -> optax.GradientTransformation:
    """Clip (global norm; ``clip_norm`` 0 = off) → AdamW (``make_schedule``; decay on kernels and
    embeddings only).

    ``lr_scales``: (labels, {label: factor}) — ``labels(params)`` gives each leaf a label; the Adam step of
    a leaf labelled ``label`` is scaled by ``factor`` (``optax.multi_transform``; label ``"default"`` is
    unscaled), the decoupled weight decay is not.
    """
    o = cfg.optim
    clip = optax.clip_by_global_norm(o.clip_norm) if o.clip_norm > 0 else optax.identity()
    schedule = make_schedule(cfg)
    if not lr_scales:
        return optax.chain(clip, optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                                             mask=weight_decay_mask))
    labels, factors = lr_scales
    adam = optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps)
    parts = {"default": adam, **{k: optax.chain(adam, optax.scale(f)) for k, f in factors.items()}}
    return optax.chain(clip, optax.chain(optax.multi_transform(parts, labels),
                                         optax.add_decayed_weights(o.weight_decay, weight_decay_mask),
                                         optax.scale_by_learning_rate(schedule)))


# Tasks -----------------------------------------------------------------------------------------------

def masked_mean(losses, batch):
    """(mean of ``losses`` over the batch's ``mask`` (all tokens without one), number of tokens)."""
    mask = batch.get("mask")
    if mask is None:
        return jnp.mean(losses), jnp.asarray(losses.size, jnp.float32)
    mask = mask.astype(jnp.float32)
    n = jnp.sum(mask)
    return jnp.sum(losses * mask) / jnp.maximum(n, 1.0), n


def next_token_ce(logits: jax.Array, batch: dict) -> jax.Array:
    """Per-token cross-entropy [B, T] float32 of logits [B, T, V] (any dtype) against ``batch["targets"]``:
    logsumexp(logits) − logits[target], the target's logit as a masked sum over V. Its gradient is
    softmax − one-hot as a select inside the softmax's fusion; the log-softmax-and-gather form (optax's) writes a
    float32 [B, T, V] log-softmax and scatters into it in the backward (760M at 16k: 13 GB less traffic and
    1.5 GiB less temp memory per step, ``benchmarks/checks/train_kernels.py``)."""
    logits = logits.astype(jnp.float32)
    hit = jnp.arange(logits.shape[-1], dtype=jnp.int32) == batch["targets"][..., None]
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)


def uses_chunked_loss(model_cfg) -> bool:
    """Whether the loss fuses the LM head (``ModelConfig.loss_impl == "chunked"``: an untied head, no DCP)."""
    return (getattr(model_cfg, "loss_impl", "logits") == "chunked" and not getattr(model_cfg, "dcp", False)
            and not getattr(model_cfg, "tie_embeddings", True))


def chunked_token_losses(model_cfg, params, out, batch) -> jax.Array:
    """Per-token cross-entropy [B, T] float32 from ``out.hidden`` (``return_hidden=True``) and the LM head
    ``params["lm_head"]["kernel"]``, fused and chunked (``fox_jax.ops.cross_entropy.lm_head_cross_entropy``)."""
    return lm_head_cross_entropy(out.hidden, params["lm_head"]["kernel"], batch["targets"],
                                 chunk_size=model_cfg.loss_chunk, pad_multiple=model_cfg.vocab_pad_multiple)


def token_losses(model, params, batch) -> jax.Array:
    """Per-token cross-entropy [B, T] in float32 (next-token prediction; ``ModelConfig.loss_impl`` decides
    whether through the logits or fused with the LM head)."""
    chunked = uses_chunked_loss(getattr(model, "cfg", None))
    kw = dict(return_hidden=True) if chunked else {}
    out = model.apply({"params": params}, batch["inputs"], batch.get("segment_ids"), batch.get("positions"), **kw)
    if chunked:
        return chunked_token_losses(model.cfg, params, out, batch)
    return next_token_ce(out.logits, batch)


class LMTask:
    """Next-token language-model training of ``cfg.model`` (any model family) from a random init.

    The methods a task has (override them in a subclass; ``fox_jax.train.finetune_dcp.DCPTask``):

    * ``check_vocab(cfg, tokenizer, fixed)``: the config whose model fits the tokenizer.
    * ``init_params(cfg, rng)``: the float32 parameters of a fresh run (computed once, before the step compiles).
    * ``lr_scales(cfg)``: per-leaf learning-rate factors for ``make_optimizer`` (None = one rate).
    * ``host_scalars(step)``: the float32 scalars step ``step`` (0-based) runs with (traced, no recompile).
    * ``loss(model, params, batch, scalars) -> (loss, metrics)``, ``param_metrics(params)`` after the update.
    * ``eval_step(model, params, batch) -> sums`` and ``eval_metrics(sums, n_batches) -> val columns``.
    * ``row(metrics, scalars)``: the metrics.jsonl columns of one step.
    * ``describe(cfg)``: the start line; ``on_finish(cfg, state, corpus, workdir) -> {"hf_dir": ...}``.
    """

    name = "train"

    def __init__(self, cfg: config_lib.ExperimentConfig):
        model = cfg.model
        self.collect_acp = getattr(model, "adaptive_threshold", None) is not None and getattr(model, "use_fgate", False)

    def check_vocab(self, cfg, tokenizer, fixed: bool):
        """The model's vocabulary becomes the tokenizer's (``fixed``: check that it covers it)."""
        vocab = tokenizer.vocab_size
        if fixed:
            if cfg.model.vocab_size < vocab:
                raise ValueError(
                    f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary ({vocab}); "
                    f"drop the override or set model.vocab_size>={vocab}")
            return cfg
        return dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=vocab))

    def init_params(self, cfg, rng):
        return cfg.model.init_params(rng)

    @staticmethod
    def lr_scales(cfg):
        return None

    def host_scalars(self, step: int) -> dict[str, np.float32]:
        return {}

    def loss(self, model, params, batch, scalars):
        kw = dict(mutable=["intermediates"]) if self.collect_acp else {}
        chunked = uses_chunked_loss(getattr(model, "cfg", None))
        if chunked:
            kw["return_hidden"] = True
        out = model.apply({"params": params}, batch["inputs"], batch.get("segment_ids"), batch.get("positions"), **kw)
        metrics = {}
        if self.collect_acp:
            out, inter = out
            fractions = jax.tree_util.tree_leaves(inter)
            metrics["acp_fraction_skipped"] = jnp.mean(jnp.stack(fractions)) if fractions else jnp.zeros((), jnp.float32)
        losses = chunked_token_losses(model.cfg, params, out, batch) if chunked else next_token_ce(out.logits, batch)
        return masked_mean(losses, batch)[0], metrics

    def param_metrics(self, params) -> dict:
        return {}

    def eval_step(self, model, params, batch) -> dict:
        mean, n = masked_mean(token_losses(model, params, batch), batch)
        return {"loss_sum": mean * n, "tokens": n}

    @staticmethod
    def eval_metrics(sums: dict, n_batches: int) -> dict[str, float]:
        loss = float(sums["loss_sum"]) / max(float(sums["tokens"]), 1.0)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    def row(self, metrics: dict, scalars: dict) -> dict[str, float]:
        return {k: float(v) for k, v in metrics.items()}

    def describe(self, cfg) -> str:
        m = cfg.model
        return f"training {getattr(m, 'arch', m.model_type)} ({m.n_layers} layers, d={m.d_model})"

    def on_finish(self, cfg, state, corpus, workdir) -> dict:
        """GPT-2: the final model as a Hugging Face directory (``<workdir>/hf``)."""
        if cfg.model.model_type != "gpt2" or jax.process_index() != 0:
            return {}
        hf_dir = export_hf(workdir, cfg.model, state.params, corpus.tokenizer)
        log(f"exported the model to {hf_dir} (Hugging Face GPT-2 format)")
        return {"hf_dir": hf_dir}


def export_hf(workdir: str, model_cfg, params, tokenizer) -> str:
    """Write ``<workdir>/hf``: ``save_hf_gpt2`` (DCP params in ``dcp_interaction.safetensors``) plus the
    tokenizer's files, so ``fox-jax zeroshot --hf-gpt2 <workdir>/hf`` needs no ``--tokenizer``."""
    from fox_jax.models.hf_gpt2 import save_hf_gpt2

    hf_dir = os.path.join(workdir, "hf")
    save_hf_gpt2(model_cfg.with_remat("none"), jax.device_get(params), hf_dir)
    for f in getattr(tokenizer, "files", ()):
        shutil.copyfile(f, os.path.join(hf_dir, os.path.basename(f)))
    return hf_dir


# Steps ----------------------------------------------------------------------------------------------

# XLA options of the train step's compile on GPU. ``xla_gpu_enable_dus_accumulator_zero_init_elimination`` (default
# off in XLA): a loop's stacked outputs that every iteration writes in full (the scanned layers' saved residuals
# and stacked gradients) are allocated without their zero fill. Measured on an H100 (2026-12-06, one process, same
# init and data; benchmarks/results/train/h100_train_dus_1206.json): 760M FoX (Pro) at 16k 396.8 / 396.5 → 390.3 ms
# per step, Transformer (Pro) 364.7 / 366.3 → 360.9 ms. The compiled programs differ only in those fills (offline
# for an H200: 13 zero-fill fusions and their copies become 28 uninitialised allocations, every other fusion the
# same); the loss after a few steps varies between GPU processes by ~1e-4 relative with or without it.
GPU_TRAIN_STEP_XLA_OPTIONS = {"xla_gpu_enable_dus_accumulator_zero_init_elimination": True}


def train_step_compiler_options(backend: str | None = None) -> dict:
    """The ``compiler_options`` for ``jax.jit`` of a train step on ``backend`` (default: JAX's default backend):
    ``GPU_TRAIN_STEP_XLA_OPTIONS`` on "gpu", none elsewhere."""
    return dict(GPU_TRAIN_STEP_XLA_OPTIONS) if (backend or jax.default_backend()) == "gpu" else {}


def make_train_step(task, model, optimizer, grad_accum: int):
    """A pure ``(state, batch, scalars) -> (state, metrics)``; the batch's leading dim is split into
    ``grad_accum`` micro-batches whose gradients and metrics are averaged (a ``lax.scan``); ``scalars``
    (``task.host_scalars``) are traced float32 arguments."""
    grad_fn = jax.value_and_grad(lambda p, mb, sc: task.loss(model, p, mb, sc), has_aux=True)

    def step_fn(state: TrainState, batch, scalars):
        micro = jax.tree_util.tree_map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)
        first = jax.tree_util.tree_map(lambda x: x[0], micro)
        (_, metric_shapes), _ = jax.eval_shape(grad_fn, state.params, first, scalars)

        def accumulate(carry, mb):
            g_sum, l_sum, m_sum = carry
            (loss, metrics), grads = grad_fn(state.params, mb, scalars)
            add = lambda a, b: jax.tree_util.tree_map(jnp.add, a, b)  # noqa: E731
            return (add(g_sum, grads), l_sum + loss, add(m_sum, metrics)), None

        zeros = lambda tree: jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), tree)  # noqa: E731
        init = (zeros(state.params), jnp.zeros((), jnp.float32), zeros(metric_shapes))
        (grads, loss, metrics), _ = jax.lax.scan(accumulate, init, micro)
        grads = jax.tree_util.tree_map(lambda g: g / grad_accum, grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**jax.tree_util.tree_map(lambda m: m / grad_accum, metrics), "loss": loss / grad_accum,
                   "grad_norm": optax.tree.norm(grads), **task.param_metrics(params)}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step_fn


def init_state(cfg: config_lib.ExperimentConfig, model_rng: jax.Array, optimizer, params=None) -> TrainState:
    """Step 0: ``params`` (default: a fresh init of ``cfg.model`` from ``model_rng``) and their optimizer state."""
    params = cfg.model.init_params(model_rng) if params is None else params
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                      rng=jax.random.fold_in(model_rng, 1))


def to_global(batch: dict, sharding) -> dict:
    """Host numpy batch (this process's rows) → global jax arrays sharded over the data axis."""
    def put(x):
        x = np.asarray(x)
        if sharding is None:
            return jnp.asarray(x)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, x)
    return {k: put(v) for k, v in batch.items()}


def evaluate(task, eval_fn, params, batches, sharding=None) -> dict[str, float]:
    """``task.eval_metrics`` of the sums of ``eval_fn`` (float64 on the host) over ``batches``."""
    sums: dict[str, Any] = {}
    for batch in batches:
        for k, v in eval_fn(params, to_global(batch, sharding)).items():
            sums[k] = sums.get(k, 0.0) + np.asarray(v, np.float64)
    return task.eval_metrics(sums, len(batches))


# The run -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class RunResult:
    """What ``run`` returns: the workdir, the last step, the training loss per step, the final validation
    metrics (None when no evaluation ran), the final ``TrainState`` and the HF export (GPT-2) or None."""

    workdir: str
    final_step: int
    losses: dict[int, float]
    val: dict[str, float] | None
    state: Any = None
    hf_dir: str | None = None

    @property
    def val_loss(self) -> float | None:
        return None if self.val is None else self.val["val_loss"]


RESUMABLE = config_lib.RESUMABLE


def resumed(saved: config_lib.ExperimentConfig, given: config_lib.ExperimentConfig, workdir: str, step: int, *,
            by_resume_step: bool = False) -> config_lib.ExperimentConfig:
    """The config a resume of the run in ``workdir`` (saved config ``saved``) at checkpoint ``step`` continues
    with: ``resume_config``, then ``resume_schedule`` against the schedule the run trained with (its lr at
    ``step`` as metrics.jsonl logged it).

    Raises:
      FieldError: ``steps`` that would end the run at ``step`` or before it (fewer steps than it trained, or
        as many, when that changes its length): nothing is written (``by_resume_step``: ``step`` came from
        ``--resume-step``, as the message says). ValueError: as ``resume_config``.
    """
    cfg = resume_config(saved, given).resolved()
    if cfg.steps < step or cfg.steps == step != saved.steps:  # would end the run where it is, or before
        at = f"--resume-step {step}" if by_resume_step else "its latest checkpoint"
        raise config_lib.FieldError(
            f"steps {cfg.steps}: the run in {workdir} is at step {step} already ({at}); give steps above "
            f"{step} to train it further (config.json and the checkpoints are left as they are)", "steps")
    history = saved.resolved()  # the schedule the run trained with, at least to its checkpoint (a config.json
    if history.steps < step:    # that an earlier version shortened on a resume with fewer --steps says less)
        history = dataclasses.replace(history, steps=step)
    return resume_schedule(history, cfg, step, logged_lr(workdir, step))


def has_checkpoints(workdir: str) -> bool:
    """Whether ``<workdir>/checkpoints`` holds a step directory."""
    ckpt_dir = os.path.join(workdir, "checkpoints")
    return os.path.isdir(ckpt_dir) and any(name.isdigit() for name in os.listdir(ckpt_dir))


def resume_config(saved: config_lib.ExperimentConfig, given: config_lib.ExperimentConfig) -> config_lib.ExperimentConfig:
    """The config a resume continues with: the saved run's, with ``RESUMABLE`` fields from ``given``.

    Fields ``given`` leaves to be resolved (None, and the model's vocabulary, which the tokenizer sets)
    are not compared, nor ``optim.schedule_segments`` (the saved run's schedule history; ``resume_schedule``).

    Raises:
      ValueError: ``given`` differs from the saved run's outside ``RESUMABLE`` (``config_lib.check_resume``).
    """
    a, b = config_lib.to_dict(saved), config_lib.to_dict(given)
    b["model"]["vocab_size"] = a["model"]["vocab_size"]
    b["optim"]["schedule_segments"] = a["optim"].get("schedule_segments", ())  # the run's history (resume_schedule)

    def fill(x, y):  # None in y: taken from x
        return {k: (fill(x.get(k, {}), v) if isinstance(v, dict) and isinstance(x.get(k), dict)
                    else x.get(k) if v is None and k in x else v) for k, v in y.items()}

    b = fill(a, b)
    config_lib.check_resume(a, b, RESUMABLE)
    for key in RESUMABLE:
        *path, name = key.split(".")
        src, dst = b, a
        for p in path:
            src, dst = src.get(p) or {}, dst.get(p)
        if isinstance(dst, dict) and name in src:
            dst[name] = src[name]
    return config_lib.from_dict(a)


def run(cfg: config_lib.ExperimentConfig, workdir: str, task: Callable[[Any], Any] = LMTask, *, resume: bool = False,
        resume_step: int | None = None, explicit_vocab: bool = False, progress: bool = True) -> RunResult:
    """Train ``cfg`` in ``workdir`` with the task ``task(cfg)`` (built from the final config: resolved and,
    on a resume, the saved run's).

    A workdir that already holds checkpoints is only continued with ``resume=True``; its saved
    config then wins (except ``RESUMABLE``: ``steps``, the logging/eval/checkpoint intervals, the mesh
    and the partitioner, and the DCP kernels, which may change). ``resume_step`` continues from that
    checkpoint instead of the latest; the checkpoints after it are moved to
    ``<workdir>/checkpoints_set_aside/`` (nothing is deleted). ``explicit_vocab``: ``model.vocab_size``
    was given (checked against the tokenizer instead of set from it).

    Raises:
      ValueError: bad config or data, a changed config on resume, ``resume_step`` without ``resume``.
      CorruptCheckpointError: the checkpoint to resume from cannot be read (names an intact older step).
      CheckpointError: a mismatched checkpoint, or no checkpoint ``resume_step``.
      FileExistsError: checkpoints exist and ``resume`` is False.
      FloatingPointError: the loss became NaN/inf.
    """
    workdir = os.path.abspath(workdir)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    cfg_path = os.path.join(workdir, config_lib.CONFIG_NAME)
    has_ckpt = has_checkpoints(workdir)
    if has_ckpt and not resume:
        raise FileExistsError(
            f"{workdir} already holds checkpoints; pass --resume to continue that run, or choose another --workdir")
    if resume_step is not None and not (resume and has_ckpt):
        raise ValueError(f"--resume-step {resume_step} needs --resume and a run with checkpoints in {ckpt_dir}")
    if resume and not has_ckpt:
        log(f"--resume: no checkpoint in {ckpt_dir}; starting a new run")
    if has_ckpt and os.path.exists(cfg_path):
        saved = config_lib.load_json(cfg_path)
        step = resume_step if resume_step is not None else max(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())
        cfg = resumed(saved, cfg, workdir, step, by_resume_step=resume_step is not None)
    cfg = cfg.resolved()
    task = task(cfg)

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    cfg = task.check_vocab(cfg, tokenizer, explicit_vocab or has_ckpt)  # before the text is read
    corpus = data_lib.load_corpus(cfg.data, tokenizer=tokenizer)
    mesh = make_mesh(cfg.mesh or None)
    partitioner = select_partitioner(mesh, cfg.partitioner)
    n_data = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.batch_size % (n_data * cfg.grad_accum):
        raise ValueError(
            f"batch_size ({cfg.batch_size}) must be divisible by grad_accum ({cfg.grad_accum}) x data-parallel "
            f"devices ({n_data})")
    pid, n_proc = jax.process_index(), jax.process_count()
    val_batches = data_lib.make_val_batches(corpus, cfg.batch_size, cfg.eval_batches, process_index=pid,
                                            process_count=n_proc)
    os.makedirs(workdir, exist_ok=True)
    if pid == 0:  # written once the config is known to work
        config_lib.save_json(cfg, cfg_path)

    model = cfg.model.build()
    optimizer = make_optimizer(cfg, task.lr_scales(cfg))
    rng = jax.random.PRNGKey(cfg.seed)
    abstract = jax.eval_shape(lambda: init_state(cfg, rng, optimizer))
    state_sharding = state_shardings(mesh, abstract)
    data_sharding = batch_sharding(mesh)

    ckpt = Checkpointer(ckpt_dir, keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoints)
    train_iter = data_lib.make_train_iterator(corpus, cfg.batch_size, process_index=pid, process_count=n_proc)
    if has_ckpt:
        abstract_sharded = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sharding)
        state, data_state = ckpt.restore(resume_step, abstract_sharded)
        train_iter.set_state(data_state)
        set_aside_later(ckpt, int(state.step), workdir)
        log(f"resumed from {ckpt_dir} at step {int(state.step)}"
            + (f"; the run has all its {cfg.steps} steps already (pass --steps N > {cfg.steps} to train further)"
               if int(state.step) >= cfg.steps else ""))
    else:
        # eager init, then placement: XLA compiles a jitted init of a 100M+ model's RNG very slowly on GPU
        state = jax.device_put(init_state(cfg, rng, optimizer, task.init_params(cfg, rng)), state_sharding)
    start_step = int(state.step)

    step_fn = under_mesh(mesh, jax.jit(make_train_step(task, model, optimizer, cfg.grad_accum),
                                       in_shardings=(state_sharding, data_sharding, None),
                                       out_shardings=(state_sharding, None), donate_argnums=(0,),
                                       compiler_options=train_step_compiler_options() or None))
    eval_fn = under_mesh(mesh, jax.jit(lambda p, b: task.eval_step(model, p, b),
                                       in_shardings=(state_sharding.params, data_sharding)))
    with jax.default_device(jax.devices("cpu")[0]):  # on the host: no device round trip per row
        lrs = np.asarray(jax.vmap(make_schedule(cfg))(jnp.arange(cfg.steps)), np.float32)
    note = None if has_ckpt else short_run_note(cfg, float(lrs[-1]))
    if note:
        stderr_line(note)

    seq_len = cfg.data.seq_len
    tokens_per_step = cfg.batch_size * seq_len
    flops_per_step = 3.0 * cfg.model.flops_per_token(seq_len) * tokens_per_step
    peak = device_peak_flops(cfg.model.dtype)
    n_dev = jax.device_count()
    log(f"{task.describe(cfg)}: {count_params(state.params) / 1e6:.2f}M parameters; "
        f"seq_len {seq_len}, batch {cfg.batch_size}; data: {corpus.summary()}; "
        f"{n_dev} x {jax.devices()[0].device_kind}"
        + (f" (mesh {dict(mesh.shape)}, {partitioner} partitioner)" if mesh.size > 1 else "")
        + f"; workdir {workdir}")

    writer = MetricWriter(workdir, truncate_after=start_step if has_ckpt else -1)
    losses: dict[int, float] = {}
    val = None
    pending: list[tuple[int, dict, dict]] = []
    main_process = pid == 0
    bar = progress_bar(total=cfg.steps, initial=start_step, progress=progress and main_process, desc=task.name,
                       unit="step")
    heartbeat = Heartbeat(cfg.steps, cfg.heartbeat_secs, start_step=start_step,
                          enabled=main_process and not bars_shown(progress))
    curve_png = os.path.join(workdir, "loss.png")
    step = start_step
    try:
        if start_step == 0 and cfg.eval_every > 0:  # the starting point of the validation curve
            val = evaluate(task, eval_fn, state.params, val_batches, data_sharding)
            writer.write(0, val)
            log(format_log_line(0, cfg.steps, val))
            _plot(writer, curve_png)
            heartbeat.reset()
        t_last, step_last, first_rate = time.perf_counter(), start_step, None
        while step < cfg.steps:
            scalars = task.host_scalars(step)
            batch = to_global(next(train_iter), data_sharding)
            state, metrics = step_fn(state, batch, scalars)
            step += 1
            if step == start_step + 1:  # the first step compiles: time it on its own
                jax.block_until_ready(metrics)
                now = time.perf_counter()
                first_rate = tokens_per_step / max(now - t_last, 1e-9)
                t_last, step_last = now, step
            pending.append((step, scalars, metrics))
            is_eval = cfg.eval_every > 0 and step % cfg.eval_every == 0 or step == cfg.steps
            if step % cfg.log_every == 0 or is_eval:
                fetched = jax.device_get([m for _, _, m in pending])
                now = time.perf_counter()
                rate = (step - step_last) * tokens_per_step / max(now - t_last, 1e-9) if step > step_last else None
                t_last, step_last = now, step
                for (s, sc, _), m in zip(pending, fetched):
                    row = task.row(m, sc)
                    row["lr"] = float(lrs[s - 1])
                    r = first_rate if s == start_step + 1 or rate is None else rate
                    row["tokens_per_sec"] = r  # the first step's includes compilation
                    row["tflops"] = r / tokens_per_step * flops_per_step / 1e12
                    if peak:
                        row["mfu"] = r / tokens_per_step * flops_per_step / (peak * n_dev)
                    losses[s] = row["loss"]
                    if not math.isfinite(row["loss"]):
                        raise FloatingPointError(f"loss became {row['loss']} at step {s}; lower optim.lr or check "
                                                 "the data")
                    if s != step:
                        writer.write(s, row)
                pending = []
                if is_eval:
                    val = evaluate(task, eval_fn, state.params, val_batches, data_sharding)
                    row.update(val)
                    t_last = time.perf_counter()  # evaluation time is not training throughput
                writer.write(step, row)
                if is_eval:
                    _plot(writer, curve_png)
                bar.set_postfix(loss=f"{row['loss']:.3f}", refresh=False)
                log(format_log_line(step, cfg.steps, row))
                heartbeat.reset()
            bar.update(1)
            heartbeat.tick(step)
            if cfg.ckpt_every > 0 and step % cfg.ckpt_every == 0 and step != cfg.steps:
                ckpt.save(step, state, train_iter.get_state())
        if ckpt.latest_step() != step:
            ckpt.save(step, state, train_iter.get_state(), force=True)
        _plot(writer, curve_png)
    finally:
        bar.close()
        if hasattr(train_iter, "close"):
            train_iter.close()
        ckpt.close()  # waits for the last asynchronous save
        writer.close()
    extra = task.on_finish(cfg, state, corpus, workdir)
    return RunResult(workdir, step, losses, val, state, extra.get("hf_dir"))


def train(cfg: config_lib.ExperimentConfig, workdir: str, **kw) -> RunResult:
    """``run(cfg, workdir, LMTask, **kw)``: language-model pretraining (``fox-jax train``)."""
    return run(cfg, workdir, LMTask, **kw)


def set_aside_later(ckpt: Checkpointer, step: int, workdir: str) -> None:
    """After a resume from an earlier step, move the later checkpoints out of the way (not deleted)."""
    destination = os.path.join(workdir, "checkpoints_set_aside")
    later = ckpt.set_aside_after(step, destination)
    if later:
        log(f"resuming from step {step}: moved the later checkpoint(s) {later} to {destination}")


def _plot(writer: MetricWriter, path: str) -> None:
    """The loss curve of ``metrics.jsonl`` (process 0 only)."""
    if writer.enabled:
        plot_loss_curve(writer.path, path)


def log(msg: str) -> None:
    """A line on the console (process 0 only), above the progress bar when one is drawn."""
    if jax.process_index() == 0:
        tqdm.write(msg)


def stderr_line(msg: str) -> None:
    """A ``warning: ...`` / ``note: ...`` line on stderr (process 0 only), above the progress bar."""
    if jax.process_index() == 0:
        tqdm.write(msg, file=sys.stderr)


def logged_lr(workdir: str, step: int) -> float | None:
    """The learning rate step ``step`` ran at, as ``<workdir>/metrics.jsonl`` logged it (None: not logged)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    found = None
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("step") == step and isinstance(row.get("lr"), (int, float)):
                found = float(row["lr"])
    return found
