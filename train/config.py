"""Experiment configuration: frozen dataclasses, presets, and ``key=value`` overrides.

One ``ExperimentConfig`` holds everything a run needs (model, data, optimiser, loop). It is written to
``<workdir>/config.json`` at the start of a run and read back by ``--resume`` and ``fox-jax eval``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from pathlib import Path
from typing import Any, ClassVar

from fox_jax.config import (NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE, POSITIVE_INT, FieldError, ModelConfig, Range,
                            check_ranges, config_from_dict, gpt2_preset, one_of, preset as model_preset)


SHARED_DATA_ENV = "FOX_JAX_SHARED_DATA"
CHECKOUT_SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # <checkout>/../shared/data


def shared_data_dir() -> tuple[Path, str]:
    """(the shared data directory, where it came from): ``$FOX_JAX_SHARED_DATA`` when set, else the checkout's
    sibling ``../shared/data`` (corpus/, corpus_val/, eval/, long/; it may not exist: callers check)."""
    env = os.environ.get(SHARED_DATA_ENV)
    if env:
        return Path(env), f"{SHARED_DATA_ENV}={env}"
    return CHECKOUT_SHARED_DATA, f"{SHARED_DATA_ENV} not set, so the checkout's ../shared/data"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it becomes batches.

    Attributes:
      train: files, directories or globs of ``.txt`` / ``.jsonl`` text; empty = the built-in corpus
        (the Python standard library source of the running interpreter).
      val: separate validation files; empty = hold out ``val_fraction`` of the training documents.
      tokenizer: ``"bytes"`` (built-in byte-level), a directory with GPT-2 ``vocab.json`` + ``merges.txt``,
        or a ``tokenizer.json`` file / a directory containing one.
      seq_len: tokens per training sequence (inputs; targets are shifted by one); 0 = the model's length
        (GPT-2's n_positions; ``finetune-dcp --from-run``: the run's seq_len).
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
    """AdamW with linear warmup from 0, then a cosine decay or a constant rate (docs/design/fox_acp.md §3).

    Attributes:
      lr: peak learning rate (the top of the warmup; the cosine decays from it).
      warmup_steps: steps of the linear warmup from 0 to lr: a number (the tiny preset's 30 = 10% of its 300
        steps; 125M/360M/760M: 100), or unset (optim.warmup_steps=none; null in a config file; the GPT-2 presets
        and finetune-dcp) = min(2000, ceil(0.08·steps)), fixed when the run starts and stored in its config (a
        resume keeps that number; what the rate does after a resume with more --steps: --resume-schedule). A run
        no longer than its warmup ends at the peak rate, with no decay (a note says so).
      schedule: after the warmup, "cosine" (decay to min_lr_ratio·lr at ``steps``) or "constant".
      min_lr_ratio: the final learning rate of the cosine decay as a fraction of lr (the paper decays to 0).
      b1, b2, eps: Adam's moment decays and epsilon.
      weight_decay: decoupled weight decay, not applied to norm weights and biases.
      clip_norm: gradient clipping by global norm; 0 = off.
      resume_schedule: what a ``--resume`` with another ``--steps`` does to the schedule: "stretch"
        (recompute it for the new steps: the rate jumps to the longer cosine's value at the resume step),
        "continue" (keep the old schedule; past its end the rate stays at min_lr_ratio·lr) or "rewarm" (a
        new warmup from 0 at the resume step, then the cosine to the new steps).
      schedule_segments: written by ``--resume`` with continue / rewarm (leave it to them): entries "START"
        or "START:END"; segment i runs from START to the next segment's START, warming up over warmup_steps
        and decaying until END (default: steps). Empty = one segment from step 0.

    Every numeric field is checked against ``RANGES`` on construction (ValueError naming ``optim.<field>``).
    """

    lr: float = 2e-3
    warmup_steps: int | None = 50
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    resume_schedule: str = "stretch"
    schedule_segments: tuple[str, ...] = ()

    RANGES: ClassVar[dict[str, Range]] = dict(
        lr=POSITIVE, warmup_steps=Range(0, integer=True, optional=True), min_lr_ratio=Range(0, 1),
        b1=Range(0, 1, hi_open=True), b2=Range(0, 1, hi_open=True), eps=POSITIVE, weight_decay=NON_NEGATIVE,
        clip_norm=NON_NEGATIVE)

    def __post_init__(self):
        check_ranges(self, "optim.")
        if self.schedule not in LR_SCHEDULES:
            raise FieldError(f"optim.schedule must be one of {one_of(LR_SCHEDULES)}, got {self.schedule!r}",
                             "optim.schedule")
        if self.resume_schedule not in RESUME_SCHEDULES:
            raise FieldError(f"optim.resume_schedule must be one of {one_of(RESUME_SCHEDULES)}, "
                             f"got {self.resume_schedule!r}", "optim.resume_schedule")
        self.segments(None)

    def segments(self, steps: int | None) -> list[tuple[int, int | None]]:
        """``schedule_segments`` as [(start, end)] (end None: ``steps``); [(0, steps)] when empty.

        Raises:
          ValueError: a malformed entry, a first start other than 0, starts not increasing, an end ≤ its start.
        """
        out: list[tuple[int, int | None]] = []
        for entry in self.schedule_segments or ("0",):
            start, _, end = str(entry).partition(":")
            try:
                seg = (int(start), int(end) if end else None)
            except ValueError:
                seg = (-1, None)
            if seg[0] < 0 or (seg[1] is not None and seg[1] <= seg[0]) or (out and seg[0] <= out[-1][0]) \
                    or (not out and seg[0] != 0):
                raise FieldError(f"optim.schedule_segments: bad entry {entry!r} in {self.schedule_segments!r}; "
                                 "expected START or START:END with END > START, starts increasing from 0",
                                 "optim.schedule_segments")
            out.append(seg)
        return [(a, steps if b is None else b) for a, b in out]


LR_SCHEDULES = ("cosine", "constant")
RESUME_SCHEDULES = ("stretch", "continue", "rewarm")
GAMMA_NORMALIZATIONS = ("code", "causal")


@dataclasses.dataclass(frozen=True)
class DCPConfig:
    """Dynamic Context Pruning fine-tuning (``fox-jax finetune-dcp``; the reference recipe, docs/design/dcp.md §4).

    The model section of a fine-tuning run is the pretrained model's with DCP on (``model.dcp``,
    ``model.interaction_dim`` r, ``model.dcp_beta_init`` β₀, ``model.dcp_impl``, ``model.dtype``,
    ``model.remat``); this section says where that model comes from and how the sparsity is trained.

    Attributes:
      hf_gpt2: the pretrained Hugging Face GPT-2 directory (exclusive with ``from_run``).
      from_run: a ``fox-jax train`` run directory (FoX / Transformer) to start from.
      from_step: checkpoint step of ``from_run`` (None = its latest; the step used is stored).
      gamma: sparsity strength γ.
      gamma_normalization: "code" (the reference code's mean over the (T-1)xT slice, γ_eff = γ·(T-2)/(2T))
        or "causal" (the paper's mean over causal pairs, γ_eff = γ).
      interaction_lr: learning rate of q_int, k_int and β (None = optim.lr); their Adam step is scaled
        by interaction_lr / lr, the weight decay is not.
      alpha_init, alpha_final: the cosine α schedule's first and last value.
      alpha_steps: length of the α ramp (None = steps; resolved and stored).

    Every numeric field is checked against ``RANGES`` on construction (ValueError naming ``dcp.<field>``);
    ``ExperimentConfig`` checks the combinations.
    """

    hf_gpt2: str = ""
    from_run: str = ""
    from_step: int | None = None
    gamma: float = 0.3
    gamma_normalization: str = "code"
    interaction_lr: float | None = None
    alpha_init: float = 1.0
    alpha_final: float = 8.0
    alpha_steps: int | None = None

    RANGES: ClassVar[dict[str, Range]] = dict(
        from_step=Range(0, integer=True, optional=True), gamma=NON_NEGATIVE,
        interaction_lr=Range(0, lo_open=True, optional=True), alpha_init=Range(1), alpha_final=Range(1),
        alpha_steps=Range(1, integer=True, optional=True))

    def __post_init__(self):
        check_ranges(self, "dcp.")
        checks = [
            (self.gamma_normalization in GAMMA_NORMALIZATIONS,
             f"dcp.gamma_normalization must be one of {one_of(GAMMA_NORMALIZATIONS)}, got {self.gamma_normalization!r}"),
            (not (self.hf_gpt2 and self.from_run),
             "--hf-gpt2 and --from-run are mutually exclusive: give one pretrained model"),
            (self.from_step is None or self.from_run, "--from-step needs --from-run (the checkpoint step of that run)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """A whole run of ``fox-jax train`` / ``pretrain-gpt2`` / ``finetune-dcp``.

    Attributes:
      model: the model: a ``fox_jax.config.ModelConfig`` (FoX / Transformer, ``model_type`` "lm") or a
        ``fox_jax.models.gpt2.GPT2Config`` ("gpt2").
      data: the data (see ``DataConfig``).
      optim: the optimiser (see ``OptimConfig``).
      dcp: DCP fine-tuning (``DCPConfig``; None for pretraining).
      steps: optimiser steps.
      batch_size: sequences per optimiser step (global, across devices and accumulation).
      grad_accum: micro-batches per step; ``batch_size`` must be a multiple of it.
      seed: parameter-init RNG seed (fine-tuning: of the fresh interaction parameters).
      log_every: logging interval in steps.
      eval_every / ckpt_every: intervals in steps (0 = never, except the final save/eval).
      eval_batches: validation batches per evaluation.
      keep_checkpoints: how many checkpoints to keep.
      async_checkpoints: save in the background (waits for the last save before exit).
      mesh: device mesh, e.g. ``"data=2,fsdp=2"`` (training default: all devices on ``data``).
      partitioner: XLA's SPMD partitioner, ``"auto"`` / ``"shardy"`` / ``"gspmd"``
        (``fox_jax.sharding.select_partitioner``; auto = GSPMD on multi-GPU meshes, where Shardy
        crashes compiling the sharded attention kernels' backward with jax 0.11.2).
      heartbeat_secs: where no progress bar is drawn (stderr not a terminal, or ``--no-progress``), a
        line with the step, the elapsed time and the ETA every this many seconds between log lines
        (0 = none).

    Raises:
      ValueError: on construction, naming the field: a numeric field outside ``RANGES`` (here and in
        each section), ``batch_size`` not a multiple of ``grad_accum``, an unknown ``partitioner``,
        ``data.seq_len`` 1 (or < 3 with DCP).
    """

    model: Any = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    dcp: DCPConfig | None = None
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
            raise FieldError(f"batch_size ({self.batch_size}) must be a multiple of grad_accum ({self.grad_accum})",
                             "batch_size", "grad_accum")
        if self.partitioner not in ("auto", "shardy", "gspmd"):
            raise FieldError(f"partitioner must be auto, shardy or gspmd, got {self.partitioner!r}", "partitioner")
        least = 3 if self.dcp is not None else 2  # the sparsity loss needs causal pairs
        if 0 < self.data.seq_len < least:
            raise FieldError(f"data.seq_len must be at least {least} (or 0: the model's length), "
                             f"got {self.data.seq_len}", "data.seq_len")

    def resolved(self) -> "ExperimentConfig":
        """The defaults that depend on other fields filled in (stored in config.json, so a resume with
        more steps keeps the schedules): ``optim.warmup_steps`` None = min(2000, ceil(0.08·steps)),
        ``dcp.alpha_steps`` None = steps, ``data.seq_len`` 0 = the model's ``n_positions`` (GPT-2).

        Raises:
          ValueError: ``data.seq_len`` 0 for a model without a fixed length, or above GPT-2's n_positions.
        """
        cfg = self
        if cfg.optim.warmup_steps is None:
            cfg = dataclasses.replace(cfg, optim=dataclasses.replace(
                cfg.optim, warmup_steps=min(2000, math.ceil(0.08 * cfg.steps))))
        if cfg.dcp is not None and cfg.dcp.alpha_steps is None:
            cfg = dataclasses.replace(cfg, dcp=dataclasses.replace(cfg.dcp, alpha_steps=cfg.steps))
        n_positions = getattr(cfg.model, "n_positions", None)  # GPT-2's learned positions
        if cfg.data.seq_len == 0:
            if n_positions is None:
                raise FieldError("data.seq_len must be given (0 means the model's n_positions, which only "
                                 "GPT-2 has)", "data.seq_len")
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=n_positions))
        if n_positions is not None and cfg.data.seq_len > n_positions:
            raise FieldError(f"data.seq_len {cfg.data.seq_len} exceeds the model's n_positions={n_positions} "
                             "(GPT-2 has learned absolute positions)", "data.seq_len")
        return cfg


# Presets ---------------------------------------------------------------------------------------

GPT2_SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
PRESETS = ("tiny", "125M", "360M", "760M") + GPT2_SIZES


def preset(name: str = "tiny", arch: str = "fox-llama") -> ExperimentConfig:
    """Experiment presets. ``tiny`` trains on a CPU in a few minutes with the byte tokenizer;
    ``125M``/``360M``/``760M`` are the paper's sizes with GPT-2 vocabulary (scaled-down step counts:
    override ``steps``/``batch_size`` for real runs). ``gpt2`` ... ``gpt2-xl``: a dense GPT-2 of a
    released shape from a random init (``fox-jax pretrain-gpt2``, the base model for DCP): AdamW lr 6e-4,
    β₂ 0.95, weight decay 0.1, warmup then cosine to 10 %; ``arch`` does not apply.

    Raises:
      ValueError: an unknown name.
    """
    if name in GPT2_SIZES:

        return gpt2_defaults(gpt2_preset(name))
    if name not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}; got {name!r}")
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


def gpt2_defaults(model: Any = None) -> ExperimentConfig:
    """The GPT-2 presets' run (``model``: their GPT2Config; default a placeholder, for the help text)."""
    return ExperimentConfig(
        model=model if model is not None else ModelConfig(), data=DataConfig(seq_len=0),
        optim=OptimConfig(lr=6e-4, warmup_steps=None, min_lr_ratio=0.1, b2=0.95, weight_decay=0.1),
        steps=5000, batch_size=8, seed=42, eval_every=500, eval_batches=11, ckpt_every=500)


def finetune_defaults(model: Any = None) -> ExperimentConfig:
    """The ``fox-jax finetune-dcp`` defaults (the reference recipe, docs/design/dcp.md §4): AdamW lr 1e-4,
    betas (0.9, 0.999), no weight decay, warmup min(2000, 8 % of steps) then constant, clipping at 1.0,
    batch 6, 25,000 steps, γ 0.3, α 1 → 8. ``model``: the pretrained model with DCP (default: a
    placeholder ``ModelConfig``, replaced once the source is read)."""
    return ExperimentConfig(
        model=model if model is not None else ModelConfig(), data=DataConfig(seq_len=0),
        optim=OptimConfig(lr=1e-4, warmup_steps=None, schedule="constant", b2=0.999, weight_decay=0.0),
        dcp=DCPConfig(), steps=25000, batch_size=6, seed=42, log_every=10, eval_every=1000, eval_batches=11,
        ckpt_every=1000)


# Resuming ------------------------------------------------------------------------------------------

# The one rule of ``--resume`` (every training command): only the length of the run, the loop's intervals
# and the settings that do not change the math (the mesh, the partitioner, the DCP attention kernels) may
# change. Entries are config keys; a section name covers its fields.
RESUMABLE = ("steps", "log_every", "eval_every", "eval_batches", "ckpt_every", "keep_checkpoints",
             "async_checkpoints", "heartbeat_secs", "mesh", "partitioner", "model.dcp_impl", "optim.resume_schedule")


def check_resume(saved: dict, given: dict, resumable: tuple[str, ...] = RESUMABLE, *, what: str = "this config") -> None:
    """Refuse a resume whose config differs from the saved run's outside ``resumable``.

    ``saved`` / ``given``: nested dicts of the config (``to_dict``); sections are compared field by field.

    Raises:
      ValueError: one line naming the differing fields (``model.n_layers``, ...) and what may change.
    """
    diff = sorted(k for k in _diff_keys(saved, given)
                  if not any(k == r or k.startswith(r + ".") for r in resumable))
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

CONFIG_NAME = "config.json"


def to_dict(cfg: Any) -> dict:
    """A config (or a section) as a nested dict; a model section carries its ``model_type``."""
    if hasattr(cfg, "to_dict") and not isinstance(cfg, ExperimentConfig):
        return cfg.to_dict()
    return {f.name: (to_dict(v) if dataclasses.is_dataclass(v := getattr(cfg, f.name)) else v)
            for f in dataclasses.fields(cfg)}


def model_from_dict(d: dict) -> Any:
    """A model config from its dict: ``model_type`` "lm" (or none) → ``ModelConfig``, else the family's
    class (``fox_jax.config.config_from_dict``)."""
    if d.get("model_type", "lm") == "lm":
        return _build(ModelConfig, {k: v for k, v in d.items() if k != "model_type"})
    return config_from_dict(d)


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
        section = _section_type(hints[f.name])
        if f.name == "model" and cls is ExperimentConfig:
            v = model_from_dict(v)
        elif section is not None and v is not None:
            v = _build(section, v)
        elif isinstance(v, list):
            v = tuple(v)
        kw[f.name] = v
    return cls(**kw)


def _section_type(hint):
    """The dataclass of a section hint (``DataConfig``, ``DCPConfig | None``), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    dcs = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
    return dcs[0] if dcs else None


def save_json(cfg: ExperimentConfig, path) -> None:
    with open(path, "w") as f:
        json.dump(to_dict(cfg), f, indent=2, sort_keys=True)
        f.write("\n")


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
        # a plain str field keeps the word: remat=none is the policy named "none", not a missing value
        return text.lower() if type_hint is str and current is not None else None
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
    ``dcp.gamma=0.5``, ``steps=500``. Lists are comma-separated (``data.train=a.txt,b.txt``). A section
    that is None (``dcp`` of a pretraining config) starts from its defaults.

    Raises:
      ValueError: malformed override, unknown field, or a value of the wrong type.
    """
    updates: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form key=value (e.g. model.n_layers=6)")
        key, text = item.split("=", 1)
        try:
            _set_path(cfg, key.strip().split("."), text, key, updates)
        except ValueError as e:
            raise ValueError(f"{e} (in {item!r})") from None
    # one rebuild per section, so fields validated together (d_model / n_heads) may change together
    return _rebuild(cfg, updates)


def _section(obj, name: str):
    """The section ``name`` of ``obj`` (its defaults when it is None), or None for a plain field."""
    current = getattr(obj, name)
    if dataclasses.is_dataclass(current):
        return current
    section = _section_type(typing.get_type_hints(type(obj))[name])
    return section() if section is not None and current is None else None


def _rebuild(obj, updates: dict):
    return dataclasses.replace(obj, **{k: _rebuild(_section(obj, k), v) if isinstance(v, dict)
                                       and _section(obj, k) is not None else v
                                       for k, v in updates.items()})


def _set_path(obj, path, text, full_key, updates: dict) -> None:
    name = path[0]
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if name not in fields:
        raise ValueError(
            f"unknown config field {full_key!r}; {type(obj).__name__} has: {', '.join(sorted(fields))}")
    section = _section(obj, name)
    if len(path) > 1:
        if section is None:
            raise ValueError(f"config field {full_key!r}: {name} is not a section")
        _set_path(section, path[1:], text, full_key, updates.setdefault(name, {}))
        return
    if section is not None:
        raise ValueError(f"config field {full_key!r} is a section; set one of its fields, e.g. {name}.<field>=...")
    current = getattr(obj, name)
    hint = typing.get_type_hints(type(obj))[name]
    try:
        value = _parse_value(text, current, hint)
    except ValueError as e:
        raise ValueError(f"bad value for {full_key!r}: {e}") from None
    updates[name] = value


def field_doc(cls, name: str) -> str:
    """The ``Attributes:`` entry of field ``name`` in the docstring of ``cls`` ("" when none): the help
    text of the command-line flags (``fox_jax.train.commands``)."""
    text, current = {}, None
    for line in (cls.__doc__ or "").split("Attributes:", 1)[-1].splitlines()[1:]:
        stripped = line.strip()
        if not stripped or stripped.endswith(":") and " " not in stripped:
            if current is not None and not stripped:
                break
            continue
        head, sep, rest = stripped.partition(": ")
        names = [n.strip() for n in head.replace(" / ", ", ").split(",")]
        if sep and line.startswith("      ") and not line.startswith("        ") \
                and all(n.isidentifier() for n in names):
            current = names
            for n in names:
                text[n] = rest
        elif current is not None:
            for n in current:
                text[n] += " " + stripped
    return " ".join(text.get(name, "").split())
