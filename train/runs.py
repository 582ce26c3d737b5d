"""One reader for every kind of run directory: ``open_run(path, step=None) -> Run``.

Formats (the first that matches wins; ``FORMATS`` lists them):

======================  ===============================================================  =================
kind                    files                                                            parameters
======================  ===============================================================  =================
``"train"``             ``config.json`` (an ``ExperimentConfig``, written by             ``checkpoints/``
                        ``fox-jax train``)                                               (orbax)
``"finetune"``          ``config.json`` with a ``dcp`` section (an ``ExperimentConfig``,    ``checkpoints/``
                        written by ``fox-jax finetune-dcp``), or the earlier layout:       (orbax)
                        ``finetune_config.json`` (flat fields) + ``model_config.json``
                        (the model and its ``model_type``: "gpt2", the default, or "lm")
``"hf-gpt2"``           a Hugging Face GPT-2 directory: ``config.json`` (``model_type``   safetensors
                        "gpt2") + weights; DCP when ``dcp_interaction.safetensors`` is     (``load_hf_gpt2``)
                        there
``"hf-fox"``            an official FoX / Transformer directory: ``config.json``          safetensors
                        (``model_type`` in ``hf_fox.MODEL_TYPES``) + weights               (``load_official_fox``)
======================  ===============================================================  =================

``open_run`` reads configs and lists checkpoint steps only; ``Run.load_params()`` reads the parameters
and nothing else: from a checkpoint it restores ``state.params`` alone (orbax partial restore,
``Checkpointer.restore_params``), so no optimizer is built and no optimizer state is read.

Adding a format is one function ``(absolute directory) -> Run | None`` (None: not this format)
registered with ``@_format("what it expects")``; its ``Run`` names the loader of its parameters.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax

from fox_jax.models import ModelFamily, config_from_dict
from fox_jax.models.hf_fox import MODEL_TYPES as FOX_MODEL_TYPES, config_from_official, load_official_fox
from fox_jax.models.hf_gpt2 import (CONFIG_NAME as HF_CONFIG_NAME, DCP_CONFIG_KEY, DCP_NAME, PYTORCH_NAME,
                                    SAFETENSORS_INDEX_NAME, SAFETENSORS_NAME, config_from_hf, load_hf_gpt2)
from fox_jax.train import config as config_lib
from fox_jax.train.checkpoints import Checkpointer, CheckpointError
from fox_jax.train.config import DataConfig

TRAIN_CONFIG = "config.json"
FINETUNE_CONFIG = "finetune_config.json"
MODEL_CONFIG = "model_config.json"
CHECKPOINTS = "checkpoints"


@dataclasses.dataclass(frozen=True)
class Run:
    """A run directory as ``open_run`` read it.

    Attributes:
      kind: "train", "finetune", "hf-gpt2" or "hf-fox" (see the module docstring).
      path: the absolute directory.
      model: its model config (``ModelConfig`` or ``GPT2Config``, DCP fields included), as saved.
      tokenizer: the tokenizer spec of ``fox_jax.train.tokenizers.load_tokenizer`` the run used
        (a Hugging Face directory: itself when it holds ``vocab.json`` + ``merges.txt`` or
        ``tokenizer.json``), or None when it names none.
      data: its ``DataConfig`` (training / validation text, seq_len), or None (Hugging Face directories).
      seq_len: its training length in tokens, or None (Hugging Face directories).
      steps: the checkpoint steps, ascending (empty: none saved yet); None for a format without checkpoints.
      step: the chosen checkpoint step (None when there is none).
      config: the run's own config (an ``ExperimentConfig`` for "train" and "finetune"; earlier
        fine-tune layouts are converted), or the Hugging Face ``config.json`` dict.
      what: a few words for messages ("a 'fox-jax train' run", ...).
    """

    kind: str
    path: str
    model: ModelFamily
    tokenizer: str | None
    data: DataConfig | None
    seq_len: int | None
    steps: tuple[int, ...] | None
    step: int | None
    config: Any
    what: str
    loader: Callable[["Run"], dict] = dataclasses.field(repr=False, compare=False)
    subset: bool = dataclasses.field(default=False, repr=False)  # the checkpoint holds more params (DCP)

    def load_params(self) -> dict:
        """The float32 params pytree of ``self.model`` (at ``self.step`` for checkpointed runs).

        Raises:
          CorruptCheckpointError: the step's parameter arrays cannot be read (names an intact older step).
          CheckpointError: no checkpoint at all, or one whose parameters do not match ``self.model``.
          FileNotFoundError / ValueError: missing or mismatched Hugging Face weights.
        """
        return self.loader(self)

    def without_dcp(self) -> "Run":
        """The dense part of a DCP model (the model with ``dcp=False``; ``load_params`` then leaves the
        interaction parameters unread). The run itself when its model has no DCP."""
        if not self.model.dcp:
            return self
        return dataclasses.replace(self, model=self.model.replace(dcp=False), subset=True)


def open_run(path: str | os.PathLike, *, step: int | None = None, flag: str | None = None,
             step_flag: str | None = None) -> Run:
    """Read the run directory ``path`` (any format of the module docstring) and choose its ``step``.

    Args:
      path: the directory.
      step: checkpoint step (None: the latest); only for formats with checkpoints.
      flag: the command-line flag that gave ``path`` (e.g. "--from-run"), to start the messages with.
      step_flag: the flag that gave ``step`` (e.g. "--step"), to start the messages about ``step`` with.

    Returns:
      ``Run`` (no parameters are read yet: ``Run.load_params``).

    Raises:
      FileNotFoundError: no such directory, or a file its format needs is missing.
      ValueError: a directory in none of the formats (names what is expected), a config that cannot be
        read, a Hugging Face ``model_type`` fox_jax does not read, or a ``step`` for a format without
        checkpoints.
      CheckpointError: no checkpoint for ``step`` (names the available steps). A run without checkpoints
        opens (``step`` None); its ``load_params`` raises CheckpointError.
    """
    path = os.path.abspath(os.fspath(path))
    prefix = f"{flag} " if flag else ""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{prefix}{path}: no such directory; expected {_expected()}")
    for _, reader in FORMATS:
        try:
            run = reader(path)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{prefix}{e}") from None
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{prefix}{path}: {e}") from None
        if run is not None:
            return _at_step(run, step, prefix, step_flag)
    raise ValueError(f"{prefix}{path} is not a run directory: expected {_expected()}")


def _at_step(run: Run, step: int | None, prefix: str, step_flag: str | None) -> Run:
    where = f"{step_flag}: " if step_flag else f"{prefix}{run.path}: "
    if run.steps is None:
        if step is not None:
            raise ValueError(f"{where}{run.path} is {run.what}, which has no checkpoint steps (got step {step})"
                             if step_flag else
                             f"{prefix}{run.path} is {run.what}, which has no checkpoint steps (got step {step})")
        return run
    if step is None:
        return dataclasses.replace(run, step=run.steps[-1] if run.steps else None)
    if step not in run.steps:
        raise CheckpointError(f"{where}no checkpoint for step {step} in "
                              f"{os.path.join(run.path, CHECKPOINTS)}; available steps: "
                              f"{', '.join(map(str, run.steps)) or 'none'}")
    return dataclasses.replace(run, step=step)


# The formats -----------------------------------------------------------------------------------------

FORMATS: list[tuple[str, Callable[[str], Run | None]]] = []


def _format(expected: str):
    """Register a reader ``(absolute directory) -> Run | None``; ``expected`` describes the format's
    files for the error of a directory that matches none."""
    def register(reader):
        FORMATS.append((expected, reader))
        return reader
    return register


def _expected() -> str:
    return "; or ".join(expected for expected, _ in FORMATS)


@_format("a 'fox-jax finetune-dcp' run (config.json with a dcp section, or finetune_config.json + "
         "model_config.json; + checkpoints/)")
def _finetune_run(path: str) -> Run | None:
    raw = _read_json(os.path.join(path, TRAIN_CONFIG))
    if isinstance(raw, dict) and isinstance(raw.get("dcp"), dict):
        cfg = config_lib.from_dict(raw)
    elif os.path.isfile(os.path.join(path, FINETUNE_CONFIG)):
        cfg = read_finetune_config(path)
    else:
        return None
    return Run("finetune", path, cfg.model, cfg.data.tokenizer or None, cfg.data, cfg.data.seq_len,
               _checkpoint_steps(path), None, cfg, "a 'fox-jax finetune-dcp' run", _restore_params)


@_format("a 'fox-jax train' run (config.json with model/data/optim + checkpoints/)")
def _train_run(path: str) -> Run | None:
    raw = _read_json(os.path.join(path, TRAIN_CONFIG))
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        return None
    cfg = config_lib.from_dict(raw)
    return Run("train", path, cfg.model, cfg.data.tokenizer, cfg.data, cfg.data.seq_len, _checkpoint_steps(path),
               None, cfg, "a 'fox-jax train' run", _restore_params)


@_format("a Hugging Face directory of GPT-2 or official FoX/Transformer (config.json + model.safetensors)")
def _hf_dir(path: str) -> Run | None:
    hf = _read_json(os.path.join(path, HF_CONFIG_NAME))
    if not isinstance(hf, dict) or not isinstance(hf.get("model_type"), str) or not any(
            os.path.isfile(os.path.join(path, n)) for n in (SAFETENSORS_NAME, SAFETENSORS_INDEX_NAME, PYTORCH_NAME)):
        return None
    tokenizer = path if (all(os.path.isfile(os.path.join(path, n)) for n in ("vocab.json", "merges.txt"))
                         or os.path.isfile(os.path.join(path, "tokenizer.json"))) else None
    model_type = hf["model_type"]
    if model_type == "gpt2":  # DCP when the interaction file is there (its r and β are in config.json)
        has_dcp = os.path.isfile(os.path.join(path, DCP_NAME))
        model = config_from_hf(hf if has_dcp else {k: v for k, v in hf.items() if k != DCP_CONFIG_KEY})
        return Run("hf-gpt2", path, model, tokenizer, None, None, None, None, hf,
                   "a Hugging Face GPT-2 directory", lambda run: load_hf_gpt2(run.path, dcp=run.model.dcp)[1])
    if model_type in FOX_MODEL_TYPES:
        return Run("hf-fox", path, config_from_official(hf), tokenizer, None, None, None, None, hf,
                   "an official FoX/Transformer directory", lambda run: load_official_fox(run.path)[1])
    raise ValueError(f"a Hugging Face directory of model_type {model_type!r}; fox_jax reads 'gpt2' and "
                     f"{', '.join(repr(t) for t in FOX_MODEL_TYPES)}")


# Reading the pieces ------------------------------------------------------------------------------------

def _read_json(path: str) -> Any:
    """The parsed JSON file, or None when there is no such file. Raises ValueError for invalid JSON."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.path.basename(path)} is not valid JSON ({e})") from None


def read_finetune_config(workdir: str) -> config_lib.ExperimentConfig:
    """The config of a fine-tune run of the earlier layout (``finetune_config.json``: flat fields, and
    ``model_config.json``) as an ``ExperimentConfig``.

    Raises:
      FileNotFoundError: no such file. ValueError: unknown fields or out-of-range values.
    """
    path = os.path.join(workdir, FINETUNE_CONFIG)
    d = _read_json(path)
    if d is None:
        raise FileNotFoundError(f"{path} not found (every 'fox-jax finetune-dcp' run directory holds it)")
    return finetune_config_from_dict(d, read_model_config(workdir))


_OPTIM = ("lr", "warmup_steps", "b1", "b2", "eps", "weight_decay", "clip_norm")
_DCP = ("hf_gpt2", "from_run", "from_step", "gamma", "gamma_normalization", "interaction_lr", "alpha_init",
        "alpha_final", "alpha_steps")
_LOOP = ("steps", "batch_size", "seed", "log_every", "eval_every", "eval_batches", "ckpt_every", "keep_checkpoints",
         "async_checkpoints")
_IN_MODEL = ("interaction_dim", "beta_init", "dtype", "remat", "dcp_impl", "init_config")  # in model_config.json


def finetune_config_from_dict(d: dict, model: Any) -> config_lib.ExperimentConfig:
    """An ``ExperimentConfig`` from the flat ``finetune_config.json`` fields of the earlier layout and its
    ``model``. Raises ValueError for unknown fields."""
    unknown = sorted(set(d) - set(_OPTIM + _DCP + _LOOP + _IN_MODEL + ("data", "dcp", "lr_decay")))
    if unknown:
        raise ValueError(f"{FINETUNE_CONFIG}: unknown field(s) {', '.join(unknown)}")
    cosine = d.get("lr_decay") == "cosine"
    optim = config_lib.OptimConfig(**{k: d[k] for k in _OPTIM if k in d}, schedule="cosine" if cosine else "constant",
                                   min_lr_ratio=0.1 if cosine else 0.0)
    dcp = config_lib.DCPConfig(**{k: d[k] for k in _DCP if k in d}) if d.get("dcp", True) else None
    data = config_lib._build(DataConfig, d.get("data") or {})
    return config_lib.ExperimentConfig(model=model, data=data, optim=optim, dcp=dcp,
                                       **{k: d[k] for k in _LOOP if k in d})


def read_model_config(workdir: str) -> ModelFamily:
    """The model config (with DCP) of a fine-tune run's ``model_config.json``: a ``GPT2Config``
    (``model_type`` "gpt2", or none: files written before it existed) or a ``ModelConfig`` ("lm").

    Raises:
      FileNotFoundError: no such file. ValueError: an unknown ``model_type`` or bad fields.
    """
    path = os.path.join(workdir, MODEL_CONFIG)
    d = _read_json(path)
    if d is None:
        raise FileNotFoundError(f"{path} not found (every 'fox-jax finetune-dcp' run directory holds it)")
    try:
        return config_from_dict({"model_type": "gpt2", **d})  # old GPT-2 field names are read too
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _checkpoint_steps(path: str) -> tuple[int, ...]:
    ckpt_dir = os.path.join(path, CHECKPOINTS)
    if not os.path.isdir(ckpt_dir):
        return ()
    ckpt = Checkpointer(ckpt_dir, async_save=False, create=False)
    try:
        return tuple(ckpt.all_steps())
    finally:
        ckpt.close()


def _restore_params(run: Run) -> dict:
    """The params of a checkpointed run at ``run.step``: ``state.params`` only (``restore_params``)."""
    if run.step is None:
        raise CheckpointError(f"{run.path} is {run.what} without checkpoints (no step in "
                              f"{os.path.join(run.path, CHECKPOINTS)}): train first, or pass another run")
    abstract = jax.eval_shape(lambda: run.model.init_params(jax.random.PRNGKey(0)))
    ckpt = Checkpointer(os.path.join(run.path, CHECKPOINTS), async_save=False, create=False)
    try:
        return ckpt.restore_params(run.step, abstract, subset=run.subset)
    finally:
        ckpt.close()
