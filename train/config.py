"""Experiment configuration: frozen dataclasses, presets, and ``key=value`` overrides.

One ``ExperimentConfig`` holds everything a run needs (model, data, optimiser, loop). It is written to
``<workdir>/config.json`` at the start of a run and read back by ``--resume`` and ``fox-jax eval``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from typing import Any, ClassVar

from fox_jax.config import FINITE, NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE, POSITIVE_INT, Range, check_ranges
from fox_jax.models.lm import ModelConfig, preset as model_preset


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it becomes batches.

    Attributes:
      train: files, directories or globs of ``.txt`` / ``.jsonl`` text; empty = the built-in corpus
        (the Python standard library source of the running interpreter).
      val: separate validation files; empty = hold out ``val_fraction`` of the training documents.
      tokenizer: ``"bytes"`` (built-in byte-level), a directory with GPT-2 ``vocab.json`` + ``merges.txt``,
        or a ``tokenizer.json`` file / a directory containing one.
      seq_len: tokens per training sequence (inputs; targets are shifted by one); 0 only for
        ``finetune-dcp`` (= the model's length).
      separator: a line holding only this string separates documents inside a ``.txt`` file.
      text_field: the field of a ``.jsonl`` record that holds the text.
      val_fraction: fraction of documents held out when ``val`` is empty.
      seed: seed of the shuffle of training sequences (the order is a function of this seed only).
      max_docs: use at most this many documents (0 = all), after a seeded shuffle of the documents.

    Every numeric field is checked against ``RANGES`` on construction (ValueError naming ``data.<field>``).
    """

    train: tuple[str, ...] = ()
    val: tuple[str, ...] = ()
    tokenizer: str = "bytes"
    seq_len: int = 256
    separator: str = "<|endoftext|>"
    text_field: str = "text"
    val_fraction: float = 0.05
    seed: int = 0
    max_docs: int = 0

    RANGES: ClassVar[dict[str, Range]] = dict(seq_len=NON_NEGATIVE_INT, val_fraction=Range(0, 1, hi_open=True),
                                              seed=NON_NEGATIVE_INT, max_docs=NON_NEGATIVE_INT)

    def __post_init__(self):
        check_ranges(self, "data.")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay (docs/design/fox_acp.md §3).

    ``weight_decay`` is not applied to norm weights and biases. ``min_lr_ratio`` is the final
    learning rate as a fraction of ``lr`` (the paper decays to 0). Every field is checked against
    ``RANGES`` on construction (ValueError naming ``optim.<field>``): lr, eps and clip_norm > 0,
    warmup_steps >= 0, min_lr_ratio in [0, 1], b1 and b2 in [0, 1), weight_decay >= 0.
    """

    lr: float = 2e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0

    RANGES: ClassVar[dict[str, Range]] = dict(
        lr=POSITIVE, warmup_steps=NON_NEGATIVE_INT, min_lr_ratio=Range(0, 1), b1=Range(0, 1, hi_open=True),
        b2=Range(0, 1, hi_open=True), eps=POSITIVE, weight_decay=NON_NEGATIVE, clip_norm=POSITIVE)

    def __post_init__(self):
        check_ranges(self, "optim.")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """A whole run.

    Attributes:
      model: the model (see ``fox_jax.models.ModelConfig``).
      data: the data (see ``DataConfig``).
      optim: the optimiser (see ``OptimConfig``).
      steps: optimiser steps.
      batch_size: sequences per optimiser step (global, across devices and accumulation).
      grad_accum: micro-batches per step; ``batch_size`` must be a multiple of it.
      seed: parameter-init and dropout RNG seed.
      log_every: logging interval in steps.
      eval_every / ckpt_every: intervals in steps (0 = never, except the final save/eval).
      eval_batches: validation batches per evaluation.
      keep_checkpoints: how many checkpoints to keep.
      async_checkpoints: save in the background (waits for the last save before exit).
      mesh: device mesh, e.g. ``"data=2,fsdp=2"`` (default: all devices on ``data``).
      partitioner: XLA's SPMD partitioner, ``"auto"`` / ``"shardy"`` / ``"gspmd"``
        (``fox_jax.sharding.select_partitioner``; auto = GSPMD on multi-GPU meshes, where Shardy
        crashes compiling the sharded attention kernels' backward with jax 0.11.2).
      heartbeat_secs: where no progress bar is drawn (stderr not a terminal, or ``--no-progress``), a
        line with the step, the elapsed time and the ETA every this many seconds between log lines
        (0 = none).

    Raises:
      ValueError: on construction, naming the field: a numeric field outside ``RANGES`` (here and in
        each section), ``batch_size`` not a multiple of ``grad_accum``, an unknown ``partitioner``, or
        ``data.seq_len`` < 2.
    """

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_every: int = 100
    keep_checkpoints: int = 3
    async_checkpoints: bool = True
    mesh: str = ""
    partitioner: str = "auto"
    heartbeat_secs: float = 60.0

    RANGES: ClassVar[dict[str, Range]] = dict(
        steps=POSITIVE_INT, batch_size=POSITIVE_INT, grad_accum=POSITIVE_INT, seed=NON_NEGATIVE_INT,
        log_every=POSITIVE_INT, eval_every=NON_NEGATIVE_INT, eval_batches=POSITIVE_INT, ckpt_every=NON_NEGATIVE_INT,
        keep_checkpoints=POSITIVE_INT, heartbeat_secs=NON_NEGATIVE)

    def __post_init__(self):
        check_ranges(self)
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of grad_accum ({self.grad_accum})")
        if self.partitioner not in ("auto", "shardy", "gspmd"):
            raise ValueError(f"partitioner must be auto, shardy or gspmd, got {self.partitioner!r}")
        if self.data.seq_len < 2:
            raise ValueError(f"data.seq_len must be at least 2, got {self.data.seq_len}")


# DCP fine-tuning (``fox-jax finetune-dcp``, ``pretrain-gpt2``) ---------------------------------------

GAMMA_NORMALIZATIONS = ("code", "causal")
LR_DECAYS = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """A DCP fine-tuning run of ``fox-jax finetune-dcp`` / ``pretrain-gpt2`` (defaults: the reference recipe, docs/design/dcp.md §4).

    Attributes:
      hf_gpt2: the pretrained HF GPT-2 directory (exclusive with ``from_run``).
      from_run: a ``fox-jax train`` run directory (FoX / Transformer ``LanguageModel``) to start from
        (exclusive with ``hf_gpt2``).
      from_step: checkpoint step of ``from_run`` (None = its latest; the step used is stored here).
      data: ``DataConfig`` (``--hf-gpt2``: the tokenizer must be GPT-2's; ``--from-run``: a tokenizer of at
        most the run's vocabulary, "" = the run's). ``seq_len`` 0 = the model's n_positions (GPT-2) or
        the run's seq_len (``from_run``).
      steps, batch_size: optimizer steps and sequences per step.
      lr, warmup_steps (None = min(2000, ceil(0.08·steps))), weight_decay, b1, b2, eps, clip_norm
        (0 = off): AdamW, linear warmup then constant.
      interaction_lr: learning rate of q_int, k_int, β (None = lr).
      gamma, gamma_normalization: sparsity strength and its normalisation ("code" or "causal").
      interaction_dim, beta_init: r and β₀ of the fresh interaction parameters.
      alpha_init, alpha_final, alpha_steps (None = steps): the cosine α schedule.
      dtype: compute dtype of the trunk ("float32" as the code; the mask is float32 always).
      remat: rematerialise blocks in the backward pass (``from_run``: remat "full"; False keeps the
        run's own policy).
      seed: seed of the interaction-parameter init (the data order has its own ``data.seed``).
      log_every, eval_every, eval_batches, ckpt_every, keep_checkpoints, async_checkpoints: the loop.
      dcp_impl: ``dcp_attention`` implementation, "xla" (blockwise) or "pallas" (kernels).

    Every numeric field is checked against ``RANGES`` on construction (ValueError naming the field, e.g.
    lr > 0, warmup_steps >= 0, b1 and b2 in [0, 1), alpha_init >= 1, intervals >= 0); ``validate``
    checks the combinations.
    """

    hf_gpt2: str = ""
    from_run: str = ""
    from_step: int | None = None
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
    dcp_impl: str = "xla"

    RANGES: ClassVar[dict[str, Range]] = dict(
        from_step=Range(0, integer=True, optional=True), steps=POSITIVE_INT, batch_size=POSITIVE_INT, lr=POSITIVE,
        warmup_steps=Range(0, integer=True, optional=True), weight_decay=NON_NEGATIVE,
        b1=Range(0, 1, hi_open=True), b2=Range(0, 1, hi_open=True), eps=POSITIVE, clip_norm=NON_NEGATIVE,
        interaction_lr=Range(0, lo_open=True, optional=True), gamma=NON_NEGATIVE, interaction_dim=POSITIVE_INT,
        beta_init=FINITE, alpha_init=Range(1), alpha_final=Range(1), alpha_steps=Range(1, integer=True, optional=True),
        seed=NON_NEGATIVE_INT, log_every=POSITIVE_INT, eval_every=NON_NEGATIVE_INT, eval_batches=POSITIVE_INT,
        ckpt_every=NON_NEGATIVE_INT, keep_checkpoints=POSITIVE_INT)

    def __post_init__(self):
        check_ranges(self)

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
        """The combinations of fields and the choices (the numeric ranges are checked on construction).
        Raises ValueError naming the first bad field."""
        checks = [
            (self.gamma_normalization in GAMMA_NORMALIZATIONS,
             f"gamma_normalization must be one of {GAMMA_NORMALIZATIONS}, got {self.gamma_normalization!r}"),
            (self.lr_decay in LR_DECAYS, f"lr_decay must be one of {LR_DECAYS}, got {self.lr_decay!r}"),
            (self.dcp_impl in ("xla", "pallas"), f"dcp_impl must be 'xla' or 'pallas', got {self.dcp_impl!r}"),
            (self.init_config is None or isinstance(self.init_config, dict),
             f"init_config must be None or a dict of GPT2Config fields, got {self.init_config!r}"),
            (not (self.hf_gpt2 and self.from_run),
             "--hf-gpt2 and --from-run are mutually exclusive: give one pretrained model"),
            (not (self.init_config is not None and self.from_run),
             "--from-run cannot be combined with a random init (init_config)"),
            (self.from_step is None or self.from_run,
             "--from-step needs --from-run (the checkpoint step of that run)"),
            (self.from_run == "" or self.dcp, "--from-run is for DCP fine-tuning (dcp=True)"),
            (self.data.seq_len == 0 or self.data.seq_len >= 3,
             f"seq_len must be at least 3 (the sparsity loss needs causal pairs), got {self.data.seq_len}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        return self


# ``fox-jax pretrain-gpt2``: the same loop, dense, from a random init, with pretraining defaults.
PRETRAIN_DEFAULTS = dict(dcp=False, lr=6e-4, weight_decay=0.1, b2=0.95, lr_decay="cosine", batch_size=8,
                         steps=5000, eval_every=500, ckpt_every=500)


# Presets ---------------------------------------------------------------------------------------

def preset(name: str = "tiny", arch: str = "fox-llama") -> ExperimentConfig:
    """Experiment presets. ``tiny`` trains on a CPU in a few minutes with the byte tokenizer;
    ``125M``/``360M``/``760M`` are the paper's sizes with GPT-2 vocabulary (scaled-down step counts:
    override ``steps``/``batch_size`` for real runs)."""
    if name == "tiny":
        model = model_preset("tiny", arch, vocab_size=384, attention_block=64)
        return ExperimentConfig(
            model=model,
            data=DataConfig(seq_len=256, tokenizer="bytes"),
            optim=OptimConfig(lr=3e-3, warmup_steps=30),
            steps=300, batch_size=16, eval_every=100, ckpt_every=100, log_every=10, eval_batches=8,
        )
    model = model_preset(name, arch, dtype="bfloat16")
    lr = 1e-3 if name == "760M" else 2e-3
    return ExperimentConfig(
        model=model,
        data=DataConfig(seq_len=2048),
        optim=OptimConfig(lr=lr, warmup_steps=100),
        steps=1000, batch_size=32, eval_every=250, ckpt_every=250, log_every=10, eval_batches=16,
    )


# Resuming ------------------------------------------------------------------------------------------

# The one rule of ``--resume`` (train, finetune-dcp, pretrain-gpt2): only the length of the run and the
# loop's intervals may change (each command adds the settings that do not change the math, e.g. the mesh).
RESUMABLE = ("steps", "log_every", "eval_every", "eval_batches", "ckpt_every", "keep_checkpoints",
             "async_checkpoints", "heartbeat_secs")


def check_resume(saved: dict, given: dict, resumable: tuple[str, ...] = RESUMABLE, *, what: str = "this config") -> None:
    """Refuse a resume whose config differs from the saved run's outside ``resumable`` (top-level keys).

    ``saved`` / ``given``: nested dicts of the config (``to_dict``); sections are compared field by field.

    Raises:
      ValueError: one line naming the differing fields (``model.n_layers``, ...) and what may change.
    """
    diff = sorted(k for k in _diff_keys(saved, given) if k.split(".")[0] not in resumable)
    if diff:
        raise ValueError(f"--resume: {what} differs from the saved run's in {', '.join(diff)}; only "
                         f"{', '.join(resumable)} may change when resuming (or use a new --workdir)")


def _diff_keys(a: dict, b: dict, prefix: str = ""):
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            yield from _diff_keys(x, y, f"{prefix}{k}.")
        elif x != y:
            yield prefix + k


# Serialisation and overrides -------------------------------------------------------------------

def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> ExperimentConfig:
    """Inverse of ``to_dict`` (used to read ``config.json``)."""
    return _build(ExperimentConfig, d)


def _build(cls, d):
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        v = d[f.name]
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            v = _build(t, v)
        elif isinstance(v, list):
            v = tuple(v)
        kw[f.name] = v
    return cls(**kw)


def save_json(cfg: ExperimentConfig, path) -> None:
    with open(path, "w") as f:
        json.dump(to_dict(cfg), f, indent=2, sort_keys=True)


def load_json(path) -> ExperimentConfig:
    with open(path) as f:
        return from_dict(json.load(f))


def _parse_value(text: str, current: Any, type_hint) -> Any:
    origin = typing.get_origin(type_hint)
    if origin is tuple or isinstance(current, tuple):
        return tuple(x for x in text.split(",") if x)
    if isinstance(current, bool) or type_hint is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean, got {text!r}")
    if text.lower() in ("none", "null"):
        return None
    if isinstance(current, int) and not isinstance(current, bool):
        return int(text)
    if isinstance(current, float):
        return float(text)
    if current is None:
        # Optional[...] fields: try int, then float, then keep the string.
        for conv in (int, float):
            try:
                return conv(text)
            except ValueError:
                pass
    return text


def apply_overrides(cfg: ExperimentConfig, overrides: list[str]) -> ExperimentConfig:
    """Apply ``section.field=value`` overrides, e.g. ``model.n_layers=6``, ``optim.lr=1e-3``,
    ``steps=500``. Lists are comma-separated (``data.train=a.txt,b.txt``).

    Raises:
      ValueError: malformed override, unknown field, or a value of the wrong type.
    """
    updates: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form key=value (e.g. model.n_layers=6)")
        key, text = item.split("=", 1)
        _set_path(cfg, key.strip().split("."), text, key, updates)
    # one rebuild per section, so fields validated together (d_model / n_heads) may change together
    return _rebuild(cfg, updates)


def _rebuild(obj, updates: dict):
    return dataclasses.replace(obj, **{k: _rebuild(getattr(obj, k), v) if isinstance(v, dict)
                                       and dataclasses.is_dataclass(getattr(obj, k)) else v
                                       for k, v in updates.items()})


def _set_path(obj, path, text, full_key, updates: dict) -> None:
    name = path[0]
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if name not in fields:
        raise ValueError(
            f"unknown config field {full_key!r}; {type(obj).__name__} has: {', '.join(sorted(fields))}")
    current = getattr(obj, name)
    if len(path) > 1:
        if not dataclasses.is_dataclass(current):
            raise ValueError(f"config field {full_key!r}: {name} is not a section")
        _set_path(current, path[1:], text, full_key, updates.setdefault(name, {}))
        return
    if dataclasses.is_dataclass(current):
        raise ValueError(f"config field {full_key!r} is a section; set one of its fields, e.g. {name}.<field>=...")
    hint = typing.get_type_hints(type(obj))[name]
    try:
        value = _parse_value(text, current, hint)
    except ValueError as e:
        raise ValueError(f"bad value for {full_key!r}: {e}") from None
    updates[name] = value
