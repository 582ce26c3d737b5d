"""The argparse parser of every ``fox-jax`` command, built without importing jax.

``--help`` and argument errors answer at once: this module imports only the standard library and the
config dataclasses (``fox_jax.train.config``, ``fox_jax.config``). Each command stores its handler as
``"module:function"`` (``args.handler``); ``fox_jax.train.cli`` imports it only when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import typing

from fox_jax import config as fox_config
from fox_jax.cache.policies import POLICY_FORMS
from fox_jax.train import config as config_lib

ZEROSHOT_TASKS = ("lambada", "piqa", "winogrande", "hellaswag", "arc_easy", "arc_challenge", "copa", "boolq")
# fox-jax zeroshot --harness: the scorer that runs the tasks, as the handler of the command
ZEROSHOT_HARNESSES = {"fox-jax": "fox_jax.train.zeroshot:cmd_zeroshot",
                      "lm-eval": "fox_jax.train.lm_eval_model:cmd_zeroshot_lm_eval"}
DEFAULT_CURVE_SPARSITIES = (0.25, 0.5, 0.75, 0.9)  # dcp-eval: extra local/strided/sinks target sparsities
DCP_NAME = "dcp_interaction.safetensors"  # = fox_jax.models.hf_gpt2.DCP_NAME (checked by the tests)
BYTES_VOCAB = 257  # = fox_jax.train.tokenizers.ByteTokenizer.vocab_size (checked by the tests)


class MissingExtraError(ImportError):
    """An optional dependency a command needs is not installed; the message is one line naming the
    ``pip install`` that adds it (``fox_jax.train.cli`` prints it and exits with 2)."""


class _Harness(argparse.Action):
    """``--harness NAME``: stores NAME and makes ``ZEROSHOT_HARNESSES[NAME]`` the command's handler."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, value)
        namespace.handler = ZEROSHOT_HARNESSES[value]


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the generated epilog's layout; wraps the flags' help as usual, every command's in the same
    column (30: argparse would move it left for a command whose flags are all short)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=30, width=110)
        self._action_max_length = 28  # argparse: help column = min(longest flag + 2, max_help_position)



def _positive(text: str) -> int:
    """argparse type of a count flag: an int ≥ 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value

def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return ",".join(map(str, v)) or "\'\'"
    if v is None:
        return "none"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v) if v != "" else "\'\'"


def config_fields_epilog(cfg: config_lib.ExperimentConfig, title: str, skip: tuple[str, ...] = ()) -> str:
    """Every ``key=value`` field of ``cfg`` with its value, by section (generated from the dataclasses);
    sections named in ``skip`` are left out."""
    top, sections = [], []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name in skip:
            continue
        if dataclasses.is_dataclass(v):
            items = [f"{f.name}.{g.name}={_value(getattr(v, g.name))}" for g in dataclasses.fields(v)]
            sections.append((f"{f.name}.*", items))
        elif v is not None or f.name != "dcp":
            top.append(f"{f.name}={_value(v)}")
    lines = [title]
    for name, items in [("loop", top)] + sections:
        lines.append(textwrap.fill(" ".join(items), width=106, initial_indent=f"  {name + ':':<9} ",
                                   subsequent_indent=" " * 12, break_on_hyphens=False))
    return "\n".join(lines)


# The flags users know, each an alias of one key=value override (flag, config key). Their help is the
# field's entry in its dataclass's docstring plus the command's default.
DATA_FLAGS = (("--data", "data.train"), ("--val-data", "data.val"), ("--tokenizer", "data.tokenizer"),
              ("--seq-len", "data.seq_len"), ("--batch-size", "batch_size"))
MESH_FLAGS = (("--mesh", "mesh"), ("--partitioner", "partitioner"))
RUN_FLAGS = (("--steps", "steps"), ("--grad-accum", "grad_accum"), ("--lr", "optim.lr"),
             ("--warmup-steps", "optim.warmup_steps"), ("--weight-decay", "optim.weight_decay"),
             ("--clip-norm", "optim.clip_norm"), ("--seed", "seed"), ("--data-seed", "data.seed"),
             ("--log-every", "log_every"), ("--eval-every", "eval_every"), ("--eval-batches", "eval_batches"),
             ("--ckpt-every", "ckpt_every"), ("--dtype", "model.dtype"), ("--remat", "model.remat"),
             ("--resume-schedule", "optim.resume_schedule"))
DCP_FLAGS = (("--from-step", "dcp.from_step"), ("--interaction-lr", "dcp.interaction_lr"), ("--gamma", "dcp.gamma"),
             ("--gamma-normalization", "dcp.gamma_normalization"), ("--interaction-dim", "model.interaction_dim"),
             ("--beta-init", "model.dcp_beta_init"), ("--alpha-init", "dcp.alpha_init"),
             ("--alpha-final", "dcp.alpha_final"), ("--alpha-steps", "dcp.alpha_steps"), ("--dcp-impl", "model.dcp_impl"))
SOURCE_FLAGS = (("--hf-gpt2", "dcp.hf_gpt2"), ("--from-run", "dcp.from_run"))
GPT2_FLAGS = (("--n-layer", "model.n_layers"), ("--n-head", "model.n_heads"), ("--n-embd", "model.d_model"),
              ("--n-positions", "model.n_positions"))
PATH_KEYS = ("data.train", "data.val", "data.tokenizer", "dcp.hf_gpt2", "dcp.from_run")  # made absolute
_SECTIONS = {"data": config_lib.DataConfig, "optim": config_lib.OptimConfig, "dcp": config_lib.DCPConfig,
             "model": config_lib.ModelConfig}
_CHOICES = {"partitioner": ("auto", "shardy", "gspmd"), "model.dtype": ("float32", "bfloat16"),
            "optim.resume_schedule": config_lib.RESUME_SCHEDULES,
            "dcp.gamma_normalization": config_lib.GAMMA_NORMALIZATIONS, "model.dcp_impl": fox_config.DCP_IMPLS}
_EXTRA_HELP = {"model.n_positions": "learned positions, the maximum sequence length",
               "data.train": "; or a directory written by 'python -m fox_jax.train.data' (its tokenizer/ is then "
                             "the default --tokenizer)"}


def flag_dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def alias_flags(command: str) -> tuple[tuple[str, str], ...]:
    """The (flag, config key) aliases of a training command."""
    flags = DATA_FLAGS + MESH_FLAGS + RUN_FLAGS
    if command == "finetune-dcp":
        flags += SOURCE_FLAGS + DCP_FLAGS
    if command == "pretrain-gpt2":
        flags += GPT2_FLAGS
    return flags


def _default(cfg, key: str) -> str:
    obj = cfg
    for name in key.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return ""
    return _value(obj)


def _add_aliases(p, flags, defaults: config_lib.ExperimentConfig | None, notes: dict[str, str]) -> None:
    """One flag per alias, its help generated from the field's documentation (``config_lib.field_doc``)."""
    for flag, key in flags:
        *section, name = key.split(".")
        cls = _SECTIONS[section[0]] if section else config_lib.ExperimentConfig
        doc = config_lib.field_doc(cls, name) or _EXTRA_HELP.get(key, "")
        doc = doc.replace("``", "")
        if key in _EXTRA_HELP and doc != _EXTRA_HELP[key]:
            doc = doc.rstrip(".") + _EXTRA_HELP[key]
        default = notes.get(key) or (defaults is not None and _default(defaults, key))
        text = f"{doc} [{key}" + (f"; default {default}]" if default else "]")
        kw: dict = dict(help=text.replace("%", "%%"), dest=flag_dest(flag))
        if key in ("data.train", "data.val"):
            kw.update(nargs="+")
        elif key == "model.remat":
            kw.update(nargs="?", const="full", metavar="POLICY")
        if _CHOICES.get(key):
            kw.update(choices=_CHOICES[key])
        elif "nargs" not in kw:
            kw.update(type=_field_type(cls, name, key))
        p.add_argument(flag, **kw)


def _field_type(cls, name: str, key: str):
    """int / float for a numeric field (``int | None`` included), else str."""
    if key == "model.n_positions":
        return int
    hint = str(typing.get_type_hints(cls).get(name, "str"))
    return int if hint.startswith(("int", "<class 'int'>")) else float if "float" in hint else str


DECODE_MESH_HELP = ("device mesh for sharded decoding, the syntax of train's --mesh: e.g. data=8 or data=4,tensor=2 "
                    "(prompt rows and KV caches over data x fsdp, heads over tensor, parameters by the training "
                    "rules; the batch is padded to a multiple of data x fsdp; see docs/multi_gpu.md). Default: "
                    "one device")


def _add_multihost(p) -> None:
    g = p.add_argument_group("multi-host (one process per host; see docs/multi_gpu.md)")
    g.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() (auto-detects SLURM / Open MPI / cloud TPU env)")
    g.add_argument("--coordinator", help="HOST:PORT of process 0 (default: auto-detection)")
    g.add_argument("--num-processes", type=int, help="number of processes (with --coordinator)")
    g.add_argument("--process-id", type=int, help="this process's id (with --coordinator)")


def _add_run_control(p) -> None:
    p.add_argument("--workdir", required=True, help="run directory (config.json, checkpoints/, metrics.jsonl, "
                   "loss.png, tb/; hf/ for GPT-2)")
    p.add_argument("--resume", action="store_true", help="continue the run in --workdir from its last checkpoint")
    p.add_argument("--resume-step", type=int, help="with --resume: continue from this checkpoint step instead of "
                   "the latest (the later checkpoints are moved to <workdir>/checkpoints_set_aside)")
    p.add_argument("--no-progress", action="store_true",
                   help="log lines only, no progress bar (none is drawn anyway when stderr is not a terminal; "
                        "then a heartbeat line comes every heartbeat_secs between the log lines)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. model.n_layers=6 optim.lr=1e-3 (every field is listed below)")


_OVERRIDES_NOTE = ("config fields: set any of them with key=value anywhere on the command line (e.g. "
                   "model.n_layers=6\noptim.lr=1e-3 heartbeat_secs=30); the flags above are aliases of some. ")


def preset_defaults(tiny: config_lib.ExperimentConfig, flags) -> dict[str, str]:
    """The help's default of each flag whose value differs between the presets: "the preset's (tiny: V)"."""
    presets = [config_lib.preset(name) for name in config_lib.PRESETS]
    return {key: f"the preset's (tiny: {_default(tiny, key) or 'unset'})" for _, key in flags
            if len({_default(p, key) for p in presets}) > 1}


def _add_train(sub) -> None:
    """``fox-jax train`` and its alias ``pretrain-gpt2`` (handler ``fox_jax.train.cli.cmd_train``)."""
    tiny = config_lib.preset("tiny")
    # what a run saves: the model's vocabulary is the tokenizer's (bytes by default) unless given
    tiny = dataclasses.replace(tiny, model=tiny.model.replace(vocab_size=BYTES_VOCAB))
    epilog = config_fields_epilog(tiny, _OVERRIDES_NOTE + (
        "The values\nbelow are those of --preset tiny (model.vocab_size: the tokenizer's, 257 for bytes and 50257 "
        "for GPT-2's,\nunless given); 125M/360M/760M change model.* (sizes, bfloat16, GPT-2 vocabulary), data.seq_len "
        "(2048),\noptim.lr/warmup_steps and the loop (steps, batch_size, intervals); gpt2...gpt2-xl are GPT-2 models "
        "(see\npretrain-gpt2). Ranges and meanings: train/config.py and fox_jax/config.py."))
    t = sub.add_parser("train", help="train a model", formatter_class=_Formatter, epilog=epilog,
                       description="Train a FoX / Transformer language model, or a GPT-2 (--preset gpt2...); "
                       "writes config.json, checkpoints/, metrics.jsonl, loss.png and tb/ in --workdir.")
    t.add_argument("--preset", help=f"{' | '.join(config_lib.PRESETS)} (default tiny; on --resume it must describe "
                   "the saved run's model)")
    t.add_argument("--arch", help="fox-llama (default) | transformer-llama | fox-pro | transformer-pro")
    _add_run_control(t)
    _add_aliases(t, alias_flags("train"), tiny, preset_defaults(tiny, alias_flags("train")))
    _add_multihost(t)
    t.set_defaults(handler="fox_jax.train.cli:cmd_train")

    g = sub.add_parser("pretrain-gpt2", help="train a dense GPT-2 from a random init (the base model for DCP; "
                       "= train --preset gpt2)", formatter_class=_Formatter,
                       epilog=config_fields_epilog(config_lib.gpt2_defaults(), _OVERRIDES_NOTE + (
                           "model.* are the\nfields of GPT2Config (fox_jax/models/gpt2.py)."), skip=("model",)),
                       description="fox-jax train with a GPT-2 model: a released GPT-2 shape (--size) from a random "
                       "init, AdamW (lr 6e-4, beta2 0.95, weight decay 0.1), warmup then cosine to 10%; the final "
                       "model is exported as a Hugging Face directory (<workdir>/hf), the input of finetune-dcp.")
    g.add_argument("--size", dest="preset", help=f"released GPT-2 shape: {' | '.join(config_lib.GPT2_SIZES)} "
                   "(default gpt2); the flags below override it (on --resume they must describe the saved model)")
    _add_run_control(g)
    _add_aliases(g, alias_flags("pretrain-gpt2"), config_lib.gpt2_defaults(),
                 {"data.tokenizer": "none, required", "data.seq_len": "n_positions"})
    _add_multihost(g)
    g.set_defaults(handler="fox_jax.train.cli:cmd_train", arch=None, gpt2=True)


def _add_finetune_dcp(sub) -> None:
    """``fox-jax finetune-dcp`` (handler ``fox_jax.train.finetune_dcp.cmd_finetune_dcp``)."""
    d = config_lib.finetune_defaults()
    f = sub.add_parser("finetune-dcp", help="Dynamic Context Pruning fine-tuning of a Hugging Face GPT-2 or of "
                       "a FoX/Transformer run", formatter_class=_Formatter,
                       epilog=config_fields_epilog(d, _OVERRIDES_NOTE + (
                           "model.* are\nthe pretrained model's (e.g. model.dtype, model.remat, "
                           "model.interaction_dim, model.dcp_beta_init)."), skip=("model",)),
                       description="Dynamic Context Pruning fine-tuning of a pretrained "
                       "model: a Hugging Face GPT-2 (--hf-gpt2; the final model is exported to <workdir>/hf) or a "
                       "FoX/Transformer run of 'fox-jax train' (--from-run; the fine-tuned model stays in "
                       "<workdir>/checkpoints). Continue a run with --workdir DIR --resume.")
    src = f.add_mutually_exclusive_group()
    _add_aliases(src, SOURCE_FLAGS, None, {})
    _add_run_control(f)
    notes = {"data.tokenizer": "--hf-gpt2 if it holds vocab.json + merges.txt; for --from-run the run's",
             "data.seq_len": "n_positions; for --from-run the run's", "data.train": "for --from-run the run's",
             "data.val": "held out of --data; for --from-run the run's", "optim.warmup_steps": "min(2000, 8% of steps)",
             "model.remat": "dots; for --from-run the run's", "dcp.alpha_steps": "--steps",
             "dcp.interaction_lr": "--lr"}
    _add_aliases(f, alias_flags("train") + DCP_FLAGS, d, notes)
    _add_multihost(f)
    f.set_defaults(handler="fox_jax.train.finetune_dcp:cmd_finetune_dcp", preset=None, arch=None)


def _add_zeroshot(sub) -> None:
    """``fox-jax zeroshot`` (handler ``fox_jax.train.zeroshot.cmd_zeroshot``, or with ``--harness lm-eval``
    ``fox_jax.train.lm_eval_model.cmd_zeroshot_lm_eval``)."""
    z = sub.add_parser("zeroshot", help="zero-shot accuracy (LAMBADA, PIQA, WinoGrande, HellaSwag, ARC, ...)",
                       formatter_class=_Formatter,
                       description="Zero-shot log-likelihood scoring of a model on local task files (JSONL), by "
                       "the built-in scorer or by lm-evaluation-harness (--harness lm-eval); same table and JSON.")
    src = z.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="a run of 'fox-jax train' (FoX/Transformer) or 'fox-jax finetune-dcp', or a "
                     "Hugging Face GPT-2 / official FoX directory (official FoX: give --max-length)")
    src.add_argument("--hf-gpt2", help="a Hugging Face GPT-2 directory (config.json + model.safetensors)")
    z.add_argument("--dcp", action="store_true", help="a DCP model (GPT-2, or a FoX/Transformer finetune-dcp "
                   "--from-run run) with its interaction params and the α=∞ step mask (default: dense "
                   "attention, DCP params ignored)")
    z.add_argument("--step", type=int, help="checkpoint step for --workdir (default: latest)")
    z.add_argument("--tasks", default="all", help=f"comma-separated: {','.join(ZEROSHOT_TASKS)} (default all); "
                   "with --harness lm-eval also wikitext2 (rolling log-likelihood)")
    z.add_argument("--harness", choices=tuple(ZEROSHOT_HARNESSES), default="fox-jax", action=_Harness,
                   help="fox-jax: the built-in scorer (no extra dependency; DCP sparsity per task); lm-eval: "
                   "EleutherAI's lm-evaluation-harness on the same local files (pip install -e \".[eval]\"; "
                   "model 'fox_jax', tasks in train/lm_eval_tasks) (default %(default)s)")
    z.add_argument("--limit", type=_positive, help="score only the first N examples of each task")
    z.add_argument("--eval-dir", help="directory of the eval sets (default: ../shared/data/eval)")
    z.add_argument("--tokenizer", help="tokenizer spec (default: the run's, or the files in --hf-gpt2)")
    z.add_argument("--batch-size", type=_positive, default=8, help="sequences per forward pass (default 8)")
    z.add_argument("--max-length", type=_positive, help="context in tokens (default: n_positions / the run's seq_len)")
    z.add_argument("--output", help="JSON output (default: <workdir>/eval/zeroshot[_dcp].json or "
                   "<hf dir>/zeroshot[_dcp].json)")
    z.add_argument("--no-progress", action="store_true", help="no progress bars")
    z.set_defaults(handler="fox_jax.train.zeroshot:cmd_zeroshot", distributed=False, coordinator=None, num_processes=None, process_id=None)


def _add_dcp_eval(sub) -> None:
    """``fox-jax dcp-eval`` (handler ``fox_jax.train.dcp_eval.cmd_dcp_eval``)."""
    e = sub.add_parser("dcp-eval", help="DCP evaluation: ppl vs sparsity against dense/local/strided/sinks and fine-tuned controls, drop plots, "
                                        "context switch", formatter_class=_Formatter,
                       description=textwrap.fill("Score DCP models (--runs) against their dense base model (--dense): "
                       "perplexity against sparsity next to local-window and strided attention at matched sparsity, "
                       "plots of the dropped keys on a text, and the context-switch experiment; writes JSON, markdown "
                       "and PNGs in --out (docs/dcp.md).", width=106))
    e.add_argument("--dense", required=True, help="the dense base model: a HF GPT-2 directory or a 'fox-jax train' "
                   "GPT-2 run")
    e.add_argument("--runs", nargs="+",
                   help="DCP models: 'fox-jax finetune-dcp' run directories or HF dirs with " + DCP_NAME)
    e.add_argument("--controls", nargs="+",
                   help="fine-tuned comparison models, each scored under its own pattern: 'fox-jax train' GPT-2 "
                        "runs fine-tuned dense (the dense control) or with model.sparse_pattern (local:W, "
                        "strided:S, sinks:S+W); at least one of --runs / --controls")
    e.add_argument("--data", nargs="+", help="text files/dirs/globs; with --val-data only used to satisfy the loader "
                   "(default: the --val-data files); without --val-data, validation documents are held out of it "
                   "as in finetune-dcp")
    e.add_argument("--val-data", nargs="+", help="validation text (recommended: ../shared/data/corpus_val)")
    e.add_argument("--tokenizer", help="GPT-2 tokenizer directory (default: --dense if it holds vocab.json + "
                   "merges.txt, else the first run's)")
    e.add_argument("--seq-len", type=_positive, help="tokens per window T (default: the dense model's n_positions)")
    e.add_argument("--num-batches", type=_positive, default=8, help="validation batches (default 8)")
    e.add_argument("--batch-size", type=_positive, default=4, help="windows per batch (default 4)")
    e.add_argument("--data-seed", type=int, default=0, help="seed of the held-out split without --val-data (default 0)")
    e.add_argument("--curve-sparsities", default=",".join(str(s) for s in DEFAULT_CURVE_SPARSITIES),
                   help="extra target sparsities for the local/strided/sinks curves, comma-separated ('' for none; "
                        "default %(default)s)")
    e.add_argument("--text", help="text file for the drop plots (default: the first validation document)")
    e.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype of the trunk (the DCP mask is float32 always; default float32)")
    e.add_argument("--out", required=True, help="output directory")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(handler="fox_jax.train.dcp_eval:cmd_dcp_eval", distributed=False, coordinator=None, num_processes=None, process_id=None)


def _add_eval(sub) -> None:
    """``fox-jax eval`` (handler ``fox_jax.train.cli.cmd_eval``)."""
    e = sub.add_parser("eval", help="evaluate a trained model: val loss, perplexity, per-position loss",
                       formatter_class=_Formatter,
                       description="Evaluate a run's checkpoint: validation loss and perplexity, and the loss at "
                       "each position (JSON + PNG in <workdir>/eval/).")
    e.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    e.add_argument("--num-batches", type=_positive, default=None, help="validation batches (default: the run's "
                   "eval_batches)")
    e.add_argument("--num-docs", type=_positive, default=64, help="documents for the per-position loss (default 64)")
    e.add_argument("--no-progress", action="store_true", help="accepted like in the other commands (eval prints no bars)")
    e.add_argument("--workdir", required=True, help="the run directory (config.json, checkpoints/)")
    e.add_argument("--cache", metavar="POLICY", help="instead: teacher-forced perplexity of the first seq_len tokens "
                   "of --num-docs validation documents under a KV-cache policy (" + POLICY_FORMS + "), exactly as "
                   "generation sees them, next to the dense cache on the same tokens; also for fine-tuned runs")
    e.add_argument("--kv-slots", type=_positive, metavar="N", help="with --cache: KV slots per row and layer, rounded up to a multiple of 64 (sinks: plus its sink slots) (default: "
                   "what the policy can need)")
    _add_aliases(e, DATA_FLAGS + MESH_FLAGS, None, {**{k: "the run's" for _, k in DATA_FLAGS},
                                                     "mesh": "one device; given: batches, --cache's caches and "
                                                             "the parameters are sharded as in training"})
    _add_multihost(e)
    e.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of data.* and batch settings, "
                   "e.g. data.seq_len=4096 (the model is fixed by the checkpoint)")
    e.set_defaults(handler="fox_jax.train.cli:cmd_eval")


def _add_passkey(sub) -> None:
    """``fox-jax passkey`` (handler ``fox_jax.train.passkey.cmd_passkey``)."""
    p = sub.add_parser("passkey", help="passkey retrieval (needle in a haystack) over Gutenberg text: accuracy "
                       "by context length x depth, under a KV-cache policy", formatter_class=_Formatter,
                       description=textwrap.fill("Hide a 5-digit pass key at fractional depths of Gutenberg text (\" The pass key "
                       "is 68231. Remember it. 68231 is the pass key.\"), ask \"What is the pass key? The pass key "
                       "is\" at the end and decode greedily; writes passkey.json (accuracy per length and depth, "
                       "every prompt's answer) and passkey.png (the heatmap) in --out. Prompts are exactly "
                       "LENGTH - 8 tokens: the 8 are the room for the answer. The template: train/passkey.py.", width=106))
    p.add_argument("run", metavar="RUN_DIR_OR_HF_DIR", help="a run of 'fox-jax train' / 'fox-jax finetune-dcp', or a "
                   "Hugging Face GPT-2 / official FoX directory")
    p.add_argument("--lengths", default="256,512,1024", help="context lengths in tokens, prompt + answer, comma-"
                   "separated; each at most the model's positions (GPT-2 n_positions; default %(default)s)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1], comma-separated: 0 the "
                   "start, 1 just before the question (default %(default)s)")
    p.add_argument("--n", type=int, default=4, help="prompts per (length, depth) cell (default %(default)s)")
    p.add_argument("--cache", default="dense", metavar="POLICY", help="KV-cache policy: " + POLICY_FORMS +
                   " (default %(default)s)")
    p.add_argument("--kv-slots", type=_positive, metavar="N", help="KV slots per row per layer, rounded up to a multiple of 64 (sinks: plus its sink slots) (default: what the policy "
                   "can need)")
    p.add_argument("--text", help="haystack text file (default: $FOX_JAX_SHARED_DATA/corpus_val/gutenberg_val.txt)")
    p.add_argument("--out", required=True, help="output directory (passkey.json, passkey.png)")
    p.add_argument("--step", type=int, help="checkpoint step of a run (default: latest)")
    p.add_argument("--tokenizer", help="tokenizer spec (default: the run's, or the files of the HF directory)")
    p.add_argument("--batch-size", type=_positive, default=8, help="prompts per generate call (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the keys and haystack offsets (default %(default)s)")
    p.add_argument("--mesh", help=DECODE_MESH_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none is drawn anyway when stderr is "
                   "not a terminal; then a line on stderr says what runs, and another as a batch starts: the first "
                   "batch of each length, and any other once 30 s have passed since the last line)")
    p.set_defaults(handler="fox_jax.train.passkey:cmd_passkey", distributed=False, coordinator=None, num_processes=None,
                   process_id=None)


def _add_generate(sub) -> None:
    """``fox-jax generate`` (handler ``fox_jax.train.generate.cmd_generate``)."""
    g = sub.add_parser("generate", help="generate text from a run or Hugging Face directory under a KV-cache policy",
                       formatter_class=_Formatter,
                       description=textwrap.fill("Encode the prompts, left-pad them into one batch and decode "
                       "(one jitted prefill + decode loop) under --cache POLICY with a fixed KV pool; prints each "
                       "continuation and one JSON line: tokens/s (compilation included), KV bytes allocated / live "
                       "/ peak live, mean live tokens per layer, overflow (entries the pool had no room for). With "
                       "--kv-budget and more prompts than it holds at once (e.g. a .jsonl --prompt-file), continuous "
                       "batching: as many rows as the budget holds decode together and a waiting prompt takes a "
                       "finished row's place; the JSON line then reports requests/s too.", width=106))
    g.add_argument("run", metavar="RUN_DIR_OR_HF_DIR", help="a run of 'fox-jax train' / 'fox-jax finetune-dcp', or a "
                   "Hugging Face GPT-2 / official FoX directory")
    g.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for a batch); every prompt is "
                   "encoded after an <|endoftext|> token, as every training document starts")
    g.add_argument("--prompt-file", action="append", metavar="FILE", help="a file whose text is one prompt, or a .jsonl "
                   "file of many, one per line: a JSON string or {\"prompt\": TEXT} (repeatable)")
    g.add_argument("--cache", default="dense", metavar="POLICY", help="KV-cache policy: " + POLICY_FORMS +
                   " (default %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), else the sampling temperature")
    g.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=float, help="nucleus sampling: the smallest set of tokens with probability ≥ p")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    g.add_argument("--kv-slots", type=int, metavar="N", help="KV slots per row and layer, rounded up to a multiple of 64 (sinks: plus its sink slots) (default: what the policy "
                   "can need for prompt + new tokens)")
    g.add_argument("--kv-budget", type=float, metavar="GIB", help="GiB of KV for the whole batch: one batch when "
                   "every prompt fits at once, else continuous batching with as many rows as fit (each row's pool: "
                   "--kv-slots, else the policy's need; acp/dcp: calibrated on the first 4 prompts)")
    g.add_argument("--no-stop", action="store_true", help="do not stop at <|endoftext|>")
    g.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill chunk (default %(default)s)")
    g.add_argument("--step", type=int, help="checkpoint step of a run (default: latest)")
    g.add_argument("--tokenizer", help="tokenizer spec (default: the run's, or the files of the HF directory)")
    g.add_argument("--mesh", help=DECODE_MESH_HELP)
    g.add_argument("--no-progress", action="store_true", help="no progress bar (continuous batching)")
    g.set_defaults(handler="fox_jax.train.generate:cmd_generate", distributed=False, coordinator=None,
                   num_processes=None, process_id=None)


class _OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors (a flag's value of the wrong type, a missing value or argument) are
    ``ValueError``s that ``fox-jax`` prints as one line naming the flag, instead of the usage text and the error."""

    def error(self, message):
        raise ValueError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    """The whole ``fox-jax`` parser (imports no jax; ``args.handler`` names the command's function)."""
    parser = _OneLineParser(prog="fox-jax", description="Train and evaluate FoX / Transformer language "
                            "models.", epilog=_EXAMPLES, formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_eval(sub)
    _add_finetune_dcp(sub)
    _add_zeroshot(sub)
    _add_dcp_eval(sub)
    _add_generate(sub)
    _add_passkey(sub)
    return parser


_EXAMPLES = """examples:
  fox-jax train --preset tiny --workdir runs/tiny                 # built-in corpus, CPU-friendly
  fox-jax train --preset 125M --data DIR --val-data DIR --tokenizer DIR --workdir runs/fox125m
  fox-jax train --workdir runs/tiny --resume --steps 600          # continue and extend a run (see --resume-schedule)
  fox-jax eval  --workdir runs/tiny                               # val loss/ppl + per-position loss
  fox-jax generate runs/tiny --prompt "def main(" --temperature 0.8   # tiny run: Python-shaped fragments + a JSON line
  fox-jax eval  --workdir runs/tiny --cache acp                   # perplexity as generation sees it
  fox-jax train --help                                            # every flag and config field

Any config field can be overridden with key=value arguments anywhere on the command line, e.g.
model.n_layers=6 optim.lr=1e-3 data.seed=3. More: docs/cli.md."""
