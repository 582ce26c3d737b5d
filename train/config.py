"""Experiment configuration: frozen dataclasses, presets, and ``key=value`` overrides.

One ``ExperimentConfig`` holds everything a run needs (model, data, optimiser, loop). It is written to
``<workdir>/config.json`` at the start of a run and read back by ``--resume`` and ``fox-jax eval``.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from fox_jax.config import ModelConfig, preset as model_preset


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it becomes batches.

    Attributes:
      train: files, directories or globs of ``.txt`` / ``.jsonl`` text; empty = the built-in corpus
        (the Python standard library source of the running interpreter).
      val: separate validation files; empty = hold out ``val_fraction`` of the training documents.
      tokenizer: ``"bytes"`` (built-in byte-level), a directory with GPT-2 ``vocab.json`` + ``merges.txt``,
        or a ``tokenizer.json`` file / a directory containing one.
      seq_len: tokens per training sequence (inputs; targets are shifted by one).
      separator: a line holding only this string separates documents inside a ``.txt`` file.
      text_field: the field of a ``.jsonl`` record that holds the text.
      val_fraction: fraction of documents held out when ``val`` is empty.
      seed: seed of the shuffle of training sequences (the order is a function of this seed only).
      max_docs: use at most this many documents (0 = all), after a seeded shuffle of the documents.
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


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay (specs/fox_acp.md §3).

    ``weight_decay`` is not applied to norm weights and biases. ``min_lr_ratio`` is the final
    learning rate as a fraction of ``lr`` (the paper decays to 0).
    """

    lr: float = 2e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """A whole run.

    Attributes:
      model: the model (see ``fox_jax.config.ModelConfig``).
      data: the data (see ``DataConfig``).
      optim: the optimiser (see ``OptimConfig``).
      steps: optimiser steps.
      batch_size: sequences per optimiser step (global, across devices and accumulation).
      grad_accum: micro-batches per step; ``batch_size`` must be a multiple of it.
      seed: parameter-init and dropout RNG seed.
      log_every / eval_every / ckpt_every: intervals in steps (0 = never, except the final save/eval).
      eval_batches: validation batches per evaluation.
      keep_checkpoints: how many checkpoints to keep.
      async_checkpoints: save in the background (waits for the last save before exit).
      mesh: device mesh, e.g. ``"data=2,fsdp=2"`` (default: all devices on ``data``).
      partitioner: XLA's SPMD partitioner, ``"auto"`` / ``"shardy"`` / ``"gspmd"``
        (``fox_jax.sharding.select_partitioner``; auto = GSPMD on multi-GPU meshes, where Shardy
        crashes compiling the sharded attention kernels' backward with jax 0.11.2).
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

    def validate(self) -> "ExperimentConfig":
        if self.steps <= 0:
            raise ValueError(f"steps must be positive, got {self.steps}")
        if self.batch_size <= 0 or self.grad_accum <= 0 or self.batch_size % self.grad_accum:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a positive multiple of grad_accum ({self.grad_accum})")
        if self.partitioner not in ("auto", "shardy", "gspmd"):
            raise ValueError(f"partitioner must be auto, shardy or gspmd, got {self.partitioner!r}")
        if self.data.seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {self.data.seq_len}")
        return self


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
