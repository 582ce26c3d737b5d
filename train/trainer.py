"""The training loop: optax AdamW, a jitted step with gradient accumulation, orbax checkpoints,
exact resume, periodic evaluation, and a progress bar / log line / metrics.jsonl / TensorBoard.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from fox_jax.models import LanguageModel, count_params
from fox_jax.sharding import batch_sharding, make_mesh, select_partitioner, state_shardings, under_mesh
from fox_jax.train import config as config_lib
from fox_jax.train import data as data_lib
from fox_jax.train.checkpoints import Checkpointer
from fox_jax.train.metrics import MetricWriter, device_peak_flops, format_log_line, plot_loss_curve
from fox_jax.train.progress import Heartbeat, bars_shown, progress_bar


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
    """Linear warmup 0 → lr over ``warmup_steps``, then cosine decay to ``min_lr_ratio·lr`` at ``steps``."""
    o = cfg.optim
    warmup = min(o.warmup_steps, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=warmup,
        decay_steps=max(cfg.steps, warmup + 1), end_value=o.lr * o.min_lr_ratio)


def make_optimizer(cfg: config_lib.ExperimentConfig) -> optax.GradientTransformation:
    o = cfg.optim
    return optax.chain(
        optax.clip_by_global_norm(o.clip_norm),
        optax.adamw(make_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                    mask=weight_decay_mask),
    )


# Loss and steps ----------------------------------------------------------------------------------

def token_losses(model: LanguageModel, params, batch) -> jax.Array:
    """Per-token cross-entropy [B, T] in float32 (next-token prediction)."""
    logits = model.apply({"params": params}, batch["inputs"], batch.get("segment_ids"), batch.get("positions")).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])


def _masked_mean(losses, batch):
    mask = batch.get("mask")
    if mask is None:
        return jnp.mean(losses), jnp.asarray(losses.size, jnp.float32)
    mask = mask.astype(jnp.float32)
    n = jnp.sum(mask)
    return jnp.sum(losses * mask) / jnp.maximum(n, 1.0), n


def make_train_step(model: LanguageModel, optimizer, grad_accum: int, collect_acp: bool = False):
    """A pure ``(state, batch) -> (state, metrics)``; the batch's leading dim is split into
    ``grad_accum`` micro-batches whose gradients are averaged (a ``lax.scan``)."""

    def micro_loss(params, micro):
        if collect_acp:
            out, inter = model.apply({"params": params}, micro["inputs"], micro.get("segment_ids"),
                                     micro.get("positions"), mutable=["intermediates"])
            logits = out.logits
            fractions = jax.tree_util.tree_leaves(inter)
            acp = jnp.mean(jnp.stack(fractions)) if fractions else jnp.zeros((), jnp.float32)
        else:
            logits = model.apply({"params": params}, micro["inputs"], micro.get("segment_ids"),
                                 micro.get("positions")).logits
            acp = jnp.zeros((), jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), micro["targets"])
        loss, _ = _masked_mean(losses, micro)
        return loss, acp

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step_fn(state: TrainState, batch):
        micro = jax.tree_util.tree_map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)

        def accumulate(carry, mb):
            g_sum, l_sum, a_sum = carry
            (loss, acp), grads = grad_fn(state.params, mb)
            g_sum = jax.tree_util.tree_map(jnp.add, g_sum, grads)
            return (g_sum, l_sum + loss, a_sum + acp), None

        zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        (grads, loss, acp), _ = jax.lax.scan(accumulate, init, micro)
        grads = jax.tree_util.tree_map(lambda g: g / grad_accum, grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss / grad_accum, "grad_norm": optax.tree.norm(grads)}
        if collect_acp:
            metrics["acp_fraction_skipped"] = acp / grad_accum
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return step_fn


def make_eval_step(model: LanguageModel):
    """``(params, batch) -> (sum of token losses, number of tokens)``, both float32 scalars."""

    def eval_fn(params, batch):
        losses = token_losses(model, params, batch)
        mean, n = _masked_mean(losses, batch)
        return mean * n, n

    return eval_fn


# Setup helpers ------------------------------------------------------------------------------------

def resolve_vocab(cfg: config_lib.ExperimentConfig, tokenizer, explicit_vocab: bool) -> config_lib.ExperimentConfig:
    """Make the model's vocabulary match the tokenizer (or check an explicit override covers it)."""
    vocab = tokenizer.vocab_size
    if explicit_vocab:
        if cfg.model.vocab_size < vocab:
            raise ValueError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary ({vocab}); "
                f"drop the override or set model.vocab_size>={vocab}")
        return cfg
    return dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=vocab))


def init_state(cfg: config_lib.ExperimentConfig, model_rng: jax.Array, optimizer) -> TrainState:
    params = cfg.model.init_params(model_rng)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                      rng=jax.random.fold_in(model_rng, 1))


def _to_global(batch: dict, sharding) -> dict:
    """Host numpy batch (this process's rows) → global jax arrays sharded over the data axis."""
    def put(x):
        x = np.asarray(x)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, x)
    return {k: put(v) for k, v in batch.items()}


@dataclasses.dataclass
class RunResult:
    workdir: str
    final_step: int
    losses: dict[int, float]
    val_loss: float | None
    state: Any = None  # the final TrainState (params, optimizer state, step, rng)


def train(cfg: config_lib.ExperimentConfig, workdir: str, *, resume: bool = False, resume_step: int | None = None,
          explicit_vocab: bool = False, progress: bool = True) -> RunResult:
    """Train ``cfg`` in ``workdir``.

    A workdir that already holds checkpoints is only continued with ``resume=True``; its saved
    config then wins (except ``RESUMABLE``: ``steps``, the logging/eval/checkpoint intervals and the
    mesh, which may change). ``resume_step`` continues from that checkpoint instead of the latest; the
    checkpoints after it are moved to ``<workdir>/checkpoints_set_aside/`` (nothing is deleted).

    Raises:
      ValueError: bad config or data, a changed config on resume, ``resume_step`` without ``resume``.
      CorruptCheckpointError: the checkpoint to resume from cannot be read (names an intact older step).
      CheckpointError: a mismatched checkpoint, or no checkpoint ``resume_step``.
      FileExistsError: checkpoints exist and ``resume`` is False.
    """
    workdir = os.path.abspath(workdir)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    cfg_path = os.path.join(workdir, "config.json")
    has_ckpt = os.path.isdir(ckpt_dir) and any(name.isdigit() for name in os.listdir(ckpt_dir))
    if has_ckpt and not resume:
        raise FileExistsError(
            f"{workdir} already holds checkpoints; pass --resume to continue that run, or choose another --workdir")
    if resume_step is not None and not (resume and has_ckpt):
        raise ValueError(f"--resume-step {resume_step} needs --resume and a run with checkpoints in {ckpt_dir}")
    if resume and not has_ckpt:
        _log(f"--resume: no checkpoint in {ckpt_dir}; starting a new run")
    if has_ckpt and os.path.exists(cfg_path):
        saved = config_lib.load_json(cfg_path)
        _check_resume_config(saved, cfg)
        cfg = dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=saved.model.vocab_size))

    corpus = data_lib.load_corpus(cfg.data)
    cfg = resolve_vocab(cfg, corpus.tokenizer, explicit_vocab or has_ckpt)
    mesh = make_mesh(cfg.mesh or None)
    partitioner = select_partitioner(mesh, cfg.partitioner)
    n_data = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.batch_size % (n_data * cfg.grad_accum):
        raise ValueError(
            f"batch_size ({cfg.batch_size}) must be divisible by grad_accum ({cfg.grad_accum}) x data-parallel "
            f"devices ({n_data})")
    val_batches = data_lib.make_val_batches(corpus, cfg.batch_size, cfg.eval_batches,
                                            process_index=jax.process_index(), process_count=jax.process_count())
    os.makedirs(workdir, exist_ok=True)
    if jax.process_index() == 0:  # written once the config is known to work
        config_lib.save_json(cfg, cfg_path)

    model = cfg.model.build()
    optimizer = make_optimizer(cfg)
    schedule = make_schedule(cfg)
    rng = jax.random.PRNGKey(cfg.seed)
    abstract = jax.eval_shape(lambda: init_state(cfg, rng, optimizer))
    state_sharding = state_shardings(mesh, abstract)
    data_sharding = batch_sharding(mesh)

    ckpt = Checkpointer(ckpt_dir, keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoints)
    train_iter = data_lib.make_train_iterator(
        corpus, cfg.batch_size, process_index=jax.process_index(), process_count=jax.process_count())
    start_step = 0
    if has_ckpt:
        abstract_sharded = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sharding)
        state, data_state = ckpt.restore(resume_step, abstract_sharded)
        train_iter.set_state(data_state)
        start_step = int(state.step)
        set_aside_later(ckpt, start_step, workdir)
        _log(f"resumed from {ckpt_dir} at step {start_step}")
    else:
        # eager init, then placement: XLA compiles a jitted init of a 100M+ model's RNG very slowly on GPU
        state = jax.device_put(init_state(cfg, rng, optimizer), state_sharding)

    n_params = count_params(state.params)
    collect_acp = cfg.model.adaptive_threshold is not None and cfg.model.use_fgate
    step_fn = under_mesh(mesh, jax.jit(make_train_step(model, optimizer, cfg.grad_accum, collect_acp),
                                       in_shardings=(state_sharding, data_sharding),
                                       out_shardings=(state_sharding, None), donate_argnums=(0,)))
    eval_fn = under_mesh(mesh, jax.jit(make_eval_step(model), in_shardings=(state_sharding.params, data_sharding)))

    tokens_per_step = cfg.batch_size * cfg.data.seq_len
    flops_per_step = 3.0 * cfg.model.flops_per_token(cfg.data.seq_len) * tokens_per_step
    peak = device_peak_flops(cfg.model.dtype)
    n_dev = jax.device_count()
    _log(f"model {cfg.model.arch}: {n_params / 1e6:.2f}M parameters "
         f"({cfg.model.param_count(include_head=False) / 1e6:.2f}M excluding the LM head); "
         f"data: {corpus.summary()}; "
         f"{n_dev} x {jax.devices()[0].device_kind}"
         + (f" (mesh {dict(mesh.shape)}, {partitioner} partitioner)" if mesh.size > 1 else "")
         + f"; workdir {workdir}")

    writer = MetricWriter(workdir, truncate_after=start_step if has_ckpt else -1)
    losses: dict[int, float] = {}
    val_loss = None
    pending: list[tuple[int, dict]] = []
    main_process = jax.process_index() == 0
    bar = progress_bar(total=cfg.steps, initial=start_step, progress=progress and main_process, desc="train",
                       unit="step")
    heartbeat = Heartbeat(cfg.steps, cfg.heartbeat_secs, start_step=start_step,
                          enabled=main_process and not bars_shown(progress))
    curve_png = os.path.join(workdir, "loss.png")
    step = start_step
    try:
        if start_step == 0 and cfg.eval_every > 0:  # the starting point of the validation curve
            val_loss = evaluate_loss(eval_fn, state.params, val_batches, data_sharding)
            row = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
            writer.write(0, row)
            _log(f"step 0/{cfg.steps} | val_loss {val_loss:.4f} (ppl {row['val_ppl']:.2f})")
            _plot(writer, curve_png)
            heartbeat.reset()
        t_last, step_last = time.perf_counter(), start_step
        while step < cfg.steps:
            batch = _to_global(next(train_iter), data_sharding)
            state, metrics = step_fn(state, batch)
            step += 1
            if step == start_step + 1:  # the first step compiles: time it on its own
                jax.block_until_ready(metrics)
                now = time.perf_counter()
                first_step_tok_s = tokens_per_step / max(now - t_last, 1e-9)
                t_last, step_last = now, step
            pending.append((step, metrics))
            is_eval = cfg.eval_every > 0 and step % cfg.eval_every == 0 or step == cfg.steps
            if step % max(cfg.log_every, 1) == 0 or is_eval or step == cfg.steps:
                fetched = jax.device_get([m for _, m in pending])
                now = time.perf_counter()
                tok_s = (step - step_last) * tokens_per_step / max(now - t_last, 1e-9) if step > step_last else None
                t_last, step_last = now, step
                for (s, _), m in zip(pending, fetched):
                    row = {k: float(v) for k, v in m.items()}
                    row["lr"] = float(schedule(s - 1))
                    rate = first_step_tok_s if s == start_step + 1 or tok_s is None else tok_s
                    row["tokens_per_sec"] = rate  # the first step's includes compilation
                    row["tflops"] = rate / tokens_per_step * flops_per_step / 1e12
                    if peak:
                        row["mfu"] = rate / tokens_per_step * flops_per_step / (peak * n_dev)
                    losses[s] = row["loss"]
                    if not math.isfinite(row["loss"]):
                        raise FloatingPointError(f"loss became {row['loss']} at step {s}; lower optim.lr or check the data")
                    if s != step:
                        writer.write(s, row)
                last = row
                pending = []
                if is_eval:
                    val_loss = evaluate_loss(eval_fn, state.params, val_batches, data_sharding)
                    last["val_loss"] = val_loss
                    last["val_ppl"] = math.exp(min(val_loss, 50.0))
                    t_last = time.perf_counter()  # evaluation time is not training throughput
                writer.write(step, last)
                if is_eval:
                    _plot(writer, curve_png)
                bar.set_postfix(loss=f"{last['loss']:.3f}", refresh=False)
                _log(format_log_line(step, cfg.steps, last))
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
    return RunResult(workdir, step, losses, val_loss, state)


def set_aside_later(ckpt: Checkpointer, step: int, workdir: str) -> None:
    """After a resume from an earlier step, move the later checkpoints out of the way (not deleted)."""
    destination = os.path.join(workdir, "checkpoints_set_aside")
    later = ckpt.set_aside_after(step, destination)
    if later:
        _log(f"resuming from step {step}: moved the later checkpoint(s) {later} to {destination}")


def evaluate_loss(eval_fn, params, batches, sharding) -> float:
    total, count = 0.0, 0.0
    for batch in batches:
        s, n = eval_fn(params, _to_global(batch, sharding))
        total += float(s)
        count += float(n)
    return total / max(count, 1.0)


RESUMABLE = config_lib.RESUMABLE + ("mesh", "partitioner")


def _check_resume_config(saved: config_lib.ExperimentConfig, given: config_lib.ExperimentConfig) -> None:
    """Only ``RESUMABLE`` may differ between the saved run and the resumed one (``config_lib.check_resume``)."""
    a, b = config_lib.to_dict(saved), config_lib.to_dict(given)
    b["model"]["vocab_size"] = a["model"]["vocab_size"]  # resolved from the tokenizer at the start
    config_lib.check_resume(a, b, RESUMABLE)


def _plot(writer: MetricWriter, path: str) -> None:
    """The loss curve of ``metrics.jsonl`` (process 0 only)."""
    if writer.enabled:
        plot_loss_curve(writer.path, path)


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        tqdm.write(msg)
