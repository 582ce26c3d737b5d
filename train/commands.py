"""The argparse parser of every ``fox-jax`` command, built without importing jax.

``--help`` and argument errors answer at once: this module imports only the standard library and the
config dataclasses (``fox_jax.train.config``, ``fox_jax.config``). Each command stores its handler as
``"module:function"`` (``args.handler``); ``fox_jax.train.cli`` imports it only when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from fox_jax.train import config as config_lib

ZEROSHOT_TASKS = ("lambada", "piqa", "winogrande", "hellaswag", "arc_easy", "arc_challenge", "copa", "boolq")
DEFAULT_CURVE_SPARSITIES = (0.25, 0.5, 0.75, 0.9)  # dcp-eval: extra local/strided target sparsities
DCP_NAME = "dcp_interaction.safetensors"  # = fox_jax.models.hf_gpt2.DCP_NAME (checked by the tests)
PRESETS = ("tiny", "125M", "360M", "760M")
_FINETUNE = "fox_jax.train.finetune_dcp:"


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the generated epilog's layout; wraps the flags' help as usual."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=30, width=110)


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


def config_fields_epilog(cfg: config_lib.ExperimentConfig, title: str) -> str:
    """Every ``key=value`` field of ``cfg`` with its value, by section (generated from the dataclasses)."""
    top, sections = [], []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            items = [f"{f.name}.{g.name}={_value(getattr(v, g.name))}" for g in dataclasses.fields(v)]
            sections.append((f"{f.name}.*", items))
        else:
            top.append(f"{f.name}={_value(v)}")
    lines = [title]
    for name, items in [("loop", top)] + sections:
        lines.append(textwrap.fill(" ".join(items), width=106, initial_indent=f"  {name + ':':<9} ",
                                   subsequent_indent=" " * 12, break_on_hyphens=False))
    return "\n".join(lines)


# train and eval --------------------------------------------------------------------------------

def _add_common(p: argparse.ArgumentParser, *, evaluating: bool = False,
                defaults: config_lib.ExperimentConfig | None = None) -> None:
    """Flags of train and eval; ``defaults``: the config whose values the help names (train)."""
    d = defaults
    run = "the run's"
    p.add_argument("--workdir", required=True, help="run directory (config.json, checkpoints/, metrics.jsonl, tb/)")
    p.add_argument("--data", nargs="+", help="text: files, directories or globs of .txt/.jsonl, or a directory "
                   "written by 'python -m fox_jax.train.data' (its tokenizer/ is then the default --tokenizer); default: "
                   + ("the run's data" if evaluating else "the Python standard library source"))
    p.add_argument("--val-data", nargs="+", help="validation text (default: "
                   + ("the run's" if evaluating else f"hold out data.val_fraction={d.data.val_fraction:g} of --data")
                   + ")")
    p.add_argument("--tokenizer", help="'bytes', a dir with GPT-2 vocab.json + merges.txt, or a tokenizer.json "
                   f"(default: {run if evaluating else d.data.tokenizer})")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: "
                   + (run if evaluating else f"the preset's; tiny {d.data.seq_len}") + ")")
    p.add_argument("--batch-size", type=int, help="sequences per step, global (default: "
                   + (run if evaluating else f"the preset's; tiny {d.batch_size}") + ")")
    p.add_argument("--mesh", help="device mesh, e.g. data=2,fsdp=2,tensor=1 (default: all devices on data)")
    p.add_argument("--partitioner", choices=("auto", "shardy", "gspmd"),
                   help="XLA SPMD partitioner (default auto: GSPMD on multi-GPU meshes; docs/multi_gpu.md)")
    g = p.add_argument_group("multi-host (one process per host; see docs/multi_gpu.md)")
    g.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() (auto-detects SLURM / Open MPI / cloud TPU env)")
    g.add_argument("--coordinator", help="HOST:PORT of process 0 (default: auto-detection)")
    g.add_argument("--num-processes", type=int, help="number of processes (with --coordinator)")
    g.add_argument("--process-id", type=int, help="this process's id (with --coordinator)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help=("overrides of data.* and batch settings, e.g. data.seq_len=4096 (the model is fixed by "
                         "the checkpoint)") if evaluating else "config overrides, e.g. model.n_layers=6 optim.lr=1e-3 "
                   "(every field is listed below)")


# finetune-dcp, pretrain-gpt2, zeroshot, dcp-eval --------------------------------------------------

def _add_run_flags(f, d: config_lib.FinetuneConfig, *, pretrain: bool = False) -> None:
    """Flags shared by ``finetune-dcp`` and ``pretrain-gpt2`` (data, optimizer, loop)."""
    f.add_argument("--workdir", required=True, help="run directory (checkpoints/, metrics.jsonl; hf/ for GPT-2)")
    f.add_argument("--data", nargs="+", help="training text: files, directories or globs (.txt/.jsonl), or a "
                   "directory written by 'python -m fox_jax.train.data'"
                   + ("" if pretrain else " (default for --from-run: the run's training text)"))
    f.add_argument("--val-data", nargs="+", help="validation text (default: hold out a fraction of --data"
                   + (")" if pretrain else "; for --from-run without --data: the run's validation text)"))
    f.add_argument("--tokenizer", help="GPT-2 tokenizer: a directory with vocab.json + merges.txt" + (
        " (required)" if pretrain else " (default: --hf-gpt2 if it holds them; for --from-run: the run's "
        "tokenizer, and any other must fit the run's vocabulary)"))
    f.add_argument("--seq-len", type=int, help="tokens per sequence (default: n_positions"
                   + (")" if pretrain else "; for --from-run: the run's seq_len)"))
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
    f.add_argument("--resume-step", type=int, help="with --resume: continue from this checkpoint step instead of "
                   "the latest (the later checkpoints are moved to <workdir>/checkpoints_set_aside)")
    f.add_argument("--no-progress", action="store_true", help="log lines only, no progress bar")


def _add_finetune_dcp(sub) -> None:
    """``fox-jax finetune-dcp`` and ``fox-jax pretrain-gpt2`` (handlers in ``fox_jax.train.finetune_dcp``)."""
    d = config_lib.FinetuneConfig()
    f = sub.add_parser("finetune-dcp", help="Dynamic Context Pruning fine-tuning of a Hugging Face GPT-2 or of "
                       "a FoX/Transformer run", description="Dynamic Context Pruning fine-tuning of a pretrained "
                       "model: a Hugging Face GPT-2 (--hf-gpt2; the final model is exported to <workdir>/hf) or a "
                       "FoX/Transformer run of 'fox-jax train' (--from-run; the fine-tuned model stays in "
                       "<workdir>/checkpoints). Continue a run with --workdir DIR --resume.")
    src = f.add_mutually_exclusive_group()
    src.add_argument("--hf-gpt2", help="pretrained HF GPT-2 directory (config.json + model.safetensors)")
    src.add_argument("--from-run", help="a 'fox-jax train' run directory (config.json + checkpoints/; FoX or "
                     "Transformer, any arch) to add DCP to; ACP is turned off")
    f.add_argument("--from-step", type=int, help="checkpoint step of --from-run (default: its latest)")
    _add_run_flags(f, d)
    f.add_argument("--interaction-lr", type=float, help="learning rate of q_int, k_int, β (default: --lr)")
    f.add_argument("--gamma", type=float, help=f"sparsity strength γ (default {d.gamma:g})")
    f.add_argument("--gamma-normalization", choices=config_lib.GAMMA_NORMALIZATIONS,
                   help="'code': γ as in the reference code (mean over the (T-1)xT slice, γ_eff≈γ/2); "
                        "'causal': γ on the mean over causal pairs (paper). Default code")
    f.add_argument("--interaction-dim", type=int, help=f"r (default {d.interaction_dim})")
    f.add_argument("--beta-init", type=float, help=f"initial β (default {d.beta_init:g})")
    f.add_argument("--alpha-init", type=float, help=f"α at step 0 (default {d.alpha_init:g})")
    f.add_argument("--alpha-final", type=float, help=f"final α (default {d.alpha_final:g})")
    f.add_argument("--alpha-steps", type=int, help="length of the cosine α ramp (default: --steps)")
    f.add_argument("--dcp-impl", choices=("xla", "pallas"),
                   help="DCP attention: blockwise XLA (default) or the Pallas kernels (not yet timed on a GPU)")
    f.set_defaults(handler=_FINETUNE + "cmd_finetune_dcp", distributed=False, coordinator=None, num_processes=None, process_id=None)

    p = dataclasses.replace(d, **config_lib.PRETRAIN_DEFAULTS)
    g = sub.add_parser("pretrain-gpt2", help="train a dense GPT-2 from a random init (the base model for DCP)")
    _add_run_flags(g, p, pretrain=True)
    g.add_argument("--size", help="released GPT-2 shape to start from: gpt2 | gpt2-medium | gpt2-large | gpt2-xl "
                   "(default gpt2); the flags below override it (on --resume they must describe the saved model)")
    for name in ("n_layer", "n_head", "n_embd", "n_positions"):
        g.add_argument("--" + name.replace("_", "-"), type=int, help=f"GPT2Config.{name}")
    g.set_defaults(handler=_FINETUNE + "cmd_pretrain_gpt2", distributed=False, coordinator=None, num_processes=None,
                   process_id=None, hf_gpt2=None, from_run=None, from_step=None)


def _add_zeroshot(sub) -> None:
    """``fox-jax zeroshot`` (handler ``fox_jax.train.zeroshot.cmd_zeroshot``)."""
    z = sub.add_parser("zeroshot", help="zero-shot accuracy (LAMBADA, PIQA, WinoGrande, HellaSwag, ARC, ...)",
                       formatter_class=_Formatter,
                       description="Zero-shot log-likelihood scoring of a model on local task files (JSONL).")
    src = z.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="a run of 'fox-jax train' (FoX/Transformer) or 'fox-jax finetune-dcp', or a "
                     "Hugging Face GPT-2 / official FoX directory (official FoX: give --max-length)")
    src.add_argument("--hf-gpt2", help="a Hugging Face GPT-2 directory (config.json + model.safetensors)")
    z.add_argument("--dcp", action="store_true", help="a DCP model (GPT-2, or a FoX/Transformer finetune-dcp "
                   "--from-run run) with its interaction params and the α=∞ step mask (default: dense "
                   "attention, DCP params ignored)")
    z.add_argument("--step", type=int, help="checkpoint step for --workdir (default: latest)")
    z.add_argument("--tasks", default="all", help=f"comma-separated: {','.join(ZEROSHOT_TASKS)} (default all)")
    z.add_argument("--limit", type=int, help="score only the first N examples of each task")
    z.add_argument("--eval-dir", help="directory of the eval sets (default: ../shared/data/eval)")
    z.add_argument("--tokenizer", help="tokenizer spec (default: the run's, or the files in --hf-gpt2)")
    z.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default 8)")
    z.add_argument("--max-length", type=int, help="context in tokens (default: n_positions / the run's seq_len)")
    z.add_argument("--output", help="JSON output (default: <workdir>/eval/zeroshot[_dcp].json or "
                   "<hf dir>/zeroshot[_dcp].json)")
    z.add_argument("--no-progress", action="store_true", help="no progress bars")
    z.set_defaults(handler="fox_jax.train.zeroshot:cmd_zeroshot", distributed=False, coordinator=None, num_processes=None, process_id=None)


def _add_dcp_eval(sub) -> None:
    """``fox-jax dcp-eval`` (handler ``fox_jax.train.dcp_eval.cmd_dcp_eval``)."""
    e = sub.add_parser("dcp-eval", help="DCP evaluation: ppl vs sparsity against dense/local/strided, drop plots, "
                                        "context switch")
    e.add_argument("--dense", required=True, help="the dense base model: a HF GPT-2 directory")
    e.add_argument("--runs", nargs="+", required=True,
                   help="DCP models: 'fox-jax finetune-dcp' run directories or HF dirs with " + DCP_NAME)
    e.add_argument("--data", nargs="+", help="text files/dirs/globs; with --val-data only used to satisfy the loader "
                   "(default: the --val-data files); without --val-data, validation documents are held out of it "
                   "as in finetune-dcp")
    e.add_argument("--val-data", nargs="+", help="validation text (recommended: ../shared/data/corpus_val)")
    e.add_argument("--tokenizer", help="GPT-2 tokenizer directory (default: --dense if it holds vocab.json + "
                   "merges.txt, else the first run's)")
    e.add_argument("--seq-len", type=int, help="tokens per window T (default: the dense model's n_positions)")
    e.add_argument("--num-batches", type=int, default=8, help="validation batches (default 8)")
    e.add_argument("--batch-size", type=int, default=4, help="windows per batch (default 4)")
    e.add_argument("--data-seed", type=int, default=0, help="seed of the held-out split without --val-data (default 0)")
    e.add_argument("--curve-sparsities", default=",".join(str(s) for s in DEFAULT_CURVE_SPARSITIES),
                   help="extra target sparsities for the local/strided curves, comma-separated ('' for none; "
                        "default %(default)s)")
    e.add_argument("--text", help="text file for the drop plots (default: the first validation document)")
    e.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype of the trunk (the DCP mask is float32 always; default float32)")
    e.add_argument("--out", required=True, help="output directory")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(handler="fox_jax.train.dcp_eval:cmd_dcp_eval", distributed=False, coordinator=None, num_processes=None, process_id=None)


def _add_train(sub) -> None:
    """``fox-jax train`` (handler ``fox_jax.train.cli.cmd_train``); its epilog lists every config field."""
    tiny = config_lib.preset("tiny")
    epilog = config_fields_epilog(tiny, (
        "config fields: set any of them with key=value anywhere on the command line (e.g. model.n_layers=6\n"
        "optim.lr=1e-3 heartbeat_secs=30). The values below are those of --preset tiny; 125M/360M/760M change\n"
        "model.* (sizes, bfloat16, GPT-2 vocabulary), data.seq_len (2048), optim.lr/warmup_steps and the loop\n"
        "(steps, batch_size, intervals). Ranges and meanings: train/config.py and fox_jax/models/lm.py."))
    t = sub.add_parser("train", help="train a model", formatter_class=_Formatter, epilog=epilog,
                       description="Train a FoX / Transformer language model; writes config.json, checkpoints/, "
                       "metrics.jsonl, loss.png and tb/ in --workdir.")
    t.add_argument("--preset", help=f"{' | '.join(PRESETS)} (default tiny; on --resume it must describe the "
                   "saved run's model)")
    t.add_argument("--arch", help="fox-llama (default) | transformer-llama | fox-pro | transformer-pro")
    t.add_argument("--steps", type=int, help=f"optimizer steps (default: the preset's; tiny {tiny.steps})")
    t.add_argument("--resume", action="store_true", help="continue the run in --workdir from its last checkpoint")
    t.add_argument("--resume-step", type=int, help="with --resume: continue from this checkpoint step instead of "
                   "the latest (the later checkpoints are moved to <workdir>/checkpoints_set_aside)")
    t.add_argument("--no-progress", action="store_true",
                   help="log lines only, no progress bar (none is drawn anyway when stderr is not a terminal; "
                        f"then a heartbeat line comes every heartbeat_secs={tiny.heartbeat_secs:g} s between "
                        "the log lines)")
    _add_common(t, defaults=tiny)
    t.set_defaults(handler="fox_jax.train.cli:cmd_train")


def _add_eval(sub) -> None:
    """``fox-jax eval`` (handler ``fox_jax.train.cli.cmd_eval``)."""
    e = sub.add_parser("eval", help="evaluate a trained model: val loss, perplexity, per-position loss",
                       formatter_class=_Formatter,
                       description="Evaluate a run's checkpoint: validation loss and perplexity, and the loss at "
                       "each position (JSON + PNG in <workdir>/eval/).")
    e.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    e.add_argument("--num-batches", type=int, default=None, help="validation batches (default: the run's "
                   "eval_batches)")
    e.add_argument("--num-docs", type=int, default=64, help="documents for the per-position loss (default 64)")
    e.add_argument("--no-progress", action="store_true", help="accepted like in the other commands (eval prints no bars)")
    _add_common(e, evaluating=True)
    e.set_defaults(handler="fox_jax.train.cli:cmd_eval")


def build_parser() -> argparse.ArgumentParser:
    """The whole ``fox-jax`` parser (imports no jax; ``args.handler`` names the command's function)."""
    parser = argparse.ArgumentParser(prog="fox-jax", description="Train and evaluate FoX / Transformer language "
                                     "models.", epilog=_EXAMPLES, formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_eval(sub)
    _add_finetune_dcp(sub)
    _add_zeroshot(sub)
    _add_dcp_eval(sub)
    return parser


_EXAMPLES = """examples:
  fox-jax train --preset tiny --workdir runs/tiny                 # built-in corpus, CPU-friendly
  fox-jax train --preset 125M --data DIR --val-data DIR --tokenizer DIR --workdir runs/fox125m
  fox-jax train --workdir runs/tiny --resume --steps 600          # continue (and extend) a run
  fox-jax eval  --workdir runs/tiny                               # val loss/ppl + per-position loss
  fox-jax train --help                                            # every flag and config field

Any config field can be overridden with key=value arguments anywhere on the command line, e.g.
model.n_layers=6 optim.lr=1e-3 data.seed=3. More: docs/cli.md."""
