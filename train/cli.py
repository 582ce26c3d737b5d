"""``fox-jax``: train and evaluate FoX / Transformer language models.

    fox-jax train --preset tiny --workdir runs/tiny                 # built-in corpus, CPU-friendly
    fox-jax train --preset 125M --data DIR --val-data DIR --tokenizer DIR --workdir runs/fox125m
    fox-jax train --workdir runs/tiny --resume --steps 600          # continue (and extend) a run
    fox-jax eval  --workdir runs/tiny                               # val loss/ppl + per-position loss

Any config field can be overridden with ``key=value`` arguments anywhere on the command line, e.g.
``model.n_layers=6 optim.lr=1e-3 data.seed=3`` (see ``train/config.py``). Errors are one line that
says what to do.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

from fox_jax.train import config as config_lib


def _add_common(p: argparse.ArgumentParser, *, evaluating: bool = False) -> None:
    p.add_argument("--workdir", required=True, help="run directory (config.json, checkpoints/, metrics.jsonl, tb/)")
    p.add_argument("--data", nargs="+", help="text: files, directories or globs of .txt/.jsonl, or a directory "
                   "written by 'python -m fox_jax.train.data' (its tokenizer/ is then the default --tokenizer); default: "
                   + ("the run's data" if evaluating else "the Python standard library source"))
    p.add_argument("--val-data", nargs="+", help="validation text (default: hold out a fraction of --data)")
    p.add_argument("--tokenizer", help="'bytes', a dir with GPT-2 vocab.json + merges.txt, or a tokenizer.json")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, help="sequences per step (global)")
    p.add_argument("--mesh", help="device mesh, e.g. data=2,fsdp=2,tensor=1 (default: all devices on data)")
    p.add_argument("--partitioner", choices=("auto", "shardy", "gspmd"),
                   help="XLA SPMD partitioner (default auto: GSPMD on multi-GPU meshes; README, 'Several GPUs and hosts')")
    d = p.add_argument_group("multi-host (one process per host; see README)")
    d.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() (auto-detects SLURM / Open MPI / cloud TPU env)")
    d.add_argument("--coordinator", help="HOST:PORT of process 0 (instead of auto-detection)")
    d.add_argument("--num-processes", type=int, help="number of processes (with --coordinator)")
    d.add_argument("--process-id", type=int, help="this process's id (with --coordinator)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help=("overrides of data.* and batch settings, e.g. data.seq_len=4096 (the model is fixed by "
                         "the checkpoint)") if evaluating else "config overrides, e.g. model.n_layers=6 optim.lr=1e-3")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fox-jax", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model")
    t.add_argument("--preset", help="tiny | 125M | 360M | 760M (default tiny; on --resume it must describe the "
                   "saved run's model)")
    t.add_argument("--arch", help="fox-llama (default) | transformer-llama | fox-pro | transformer-pro")
    t.add_argument("--steps", type=int, help="optimizer steps")
    t.add_argument("--resume", action="store_true", help="continue the run in --workdir from its last checkpoint")
    t.add_argument("--resume-step", type=int, help="with --resume: continue from this checkpoint step instead of "
                   "the latest (the later checkpoints are moved to <workdir>/checkpoints_set_aside)")
    t.add_argument("--no-progress", action="store_true", help="log lines only, no progress bar")
    _add_common(t)

    e = sub.add_parser("eval", help="evaluate a trained model: val loss, perplexity, per-position loss")
    e.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    e.add_argument("--num-batches", type=int, default=None, help="validation batches (default: eval_batches)")
    e.add_argument("--num-docs", type=int, default=64, help="documents for the per-position loss")
    e.add_argument("--no-progress", action="store_true", help="accepted like in the other commands (eval prints no bars)")
    _add_common(e, evaluating=True)

    from fox_jax.train import dcp_eval, finetune_dcp, zeroshot  # handlers: cmd_finetune_dcp, cmd_zeroshot, cmd_dcp_eval
    finetune_dcp.add_subparser(sub)
    zeroshot.add_subparser(sub)
    dcp_eval.add_subparser(sub)
    return parser


def _explicit_overrides(args) -> list[str]:
    """CLI flags → ``key=value`` overrides (only the flags actually given)."""
    out = list(args.overrides or [])
    if args.data:
        out.append("data.train=" + ",".join(args.data))
    if args.val_data:
        out.append("data.val=" + ",".join(args.val_data))
    if args.tokenizer:
        out.append(f"data.tokenizer={args.tokenizer}")
    elif args.data and len(args.data) == 1 and os.path.isfile(os.path.join(args.data[0], "meta.json")) \
            and os.path.isdir(os.path.join(args.data[0], "tokenizer")):
        out.append(f"data.tokenizer={os.path.join(args.data[0], 'tokenizer')}")  # a pre-tokenized directory
    if args.seq_len is not None:
        out.append(f"data.seq_len={args.seq_len}")
    if args.batch_size is not None:
        out.append(f"batch_size={args.batch_size}")
    if args.mesh:
        out.append(f"mesh={args.mesh}")
    if getattr(args, "partitioner", None):
        out.append(f"partitioner={args.partitioner}")
    if getattr(args, "steps", None) is not None:
        out.append(f"steps={args.steps}")
    return out


def _check_paths(cfg: config_lib.ExperimentConfig) -> None:
    for flag, paths in (("--data", cfg.data.train), ("--val-data", cfg.data.val)):
        for p in paths:
            if not any(ch in p for ch in "*?[") and not os.path.exists(p):
                raise FileNotFoundError(f"{flag}: {p} does not exist; give a file, directory or glob of .txt/.jsonl text")


def cmd_train(args) -> int:
    from fox_jax.train import trainer

    overrides = _explicit_overrides(args)
    cfg_path = os.path.join(args.workdir, "config.json")
    ckpt_dir = os.path.join(args.workdir, "checkpoints")
    has_ckpt = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
    preset, arch = args.preset or "tiny", args.arch or "fox-llama"
    if preset not in ("tiny", "125M", "360M", "760M"):
        raise ValueError(f"--preset must be one of tiny, 125M, 360M, 760M; got {preset!r}")
    if args.resume and has_ckpt and os.path.exists(cfg_path):
        cfg = config_lib.apply_overrides(config_lib.load_json(cfg_path), overrides)  # flags given now override it
        if args.preset is not None or args.arch is not None:  # they must describe the saved run's model
            asked = config_lib.apply_overrides(config_lib.preset(preset, arch), overrides).model
            asked = asked.replace(vocab_size=cfg.model.vocab_size)  # resolved from the tokenizer
            flags = " ".join(f"--{k} {v}" for k, v in (("preset", args.preset), ("arch", args.arch)) if v)
            config_lib.check_resume({"model": config_lib.to_dict(cfg.model)}, {"model": config_lib.to_dict(asked)},
                                    trainer.RESUMABLE, what=f"the model of {flags}")
    else:
        cfg = config_lib.apply_overrides(config_lib.preset(preset, arch), overrides)
    _check_paths(cfg)
    explicit_vocab = any(o.startswith("model.vocab_size=") for o in overrides)
    result = trainer.train(cfg, args.workdir, resume=args.resume, resume_step=args.resume_step,
                           explicit_vocab=explicit_vocab, progress=not args.no_progress)
    msg = f"done: {result.final_step} steps in {result.workdir}"
    if result.val_loss is not None:
        import math
        msg += f"; val_loss {result.val_loss:.4f}, val_ppl {math.exp(min(result.val_loss, 50)):.2f}"
    print(msg)
    return 0


def cmd_eval(args) -> int:
    from fox_jax.train import evaluate

    report = evaluate.evaluate_run(args.workdir, overrides=_explicit_overrides(args), step=args.step,
                                   num_batches=args.num_batches, num_docs=args.num_docs)
    print(f"step {report['step']}, seq_len {report['seq_len']}: val_loss {report['val_loss']:.4f} | "
          f"val_ppl {report['val_ppl']:.2f} | {report['val_tokens']} tokens")
    print(f"per-position loss: {report['per_position_json']} and {report['per_position_png']}")
    return 0


def init_distributed(args) -> None:
    """Start multi-host JAX before any device is touched (``jax.distributed.initialize``).

    ``--distributed`` alone lets JAX read the cluster environment (SLURM: SLURM_JOB_ID, SLURM_NTASKS,
    SLURM_PROCID, ...; Open MPI: OMPI_* variables). ``--coordinator HOST:PORT --num-processes N
    --process-id I`` set it explicitly (the same values also come from JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID).
    """
    coordinator = args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not (args.distributed or coordinator):
        return
    import jax

    kwargs = {}
    if coordinator:
        num = args.num_processes if args.num_processes is not None else os.environ.get("JAX_NUM_PROCESSES")
        pid = args.process_id if args.process_id is not None else os.environ.get("JAX_PROCESS_ID")
        if num is None or pid is None:
            raise ValueError("--coordinator needs --num-processes and --process-id (or JAX_NUM_PROCESSES/JAX_PROCESS_ID)")
        kwargs = dict(coordinator_address=coordinator, num_processes=int(num), process_id=int(pid))
    jax.distributed.initialize(**kwargs)


_OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*=")
_STEP_FLAGS = {"train": "--resume-step", "finetune-dcp": "--resume-step", "pretrain-gpt2": "--resume-step",
               "eval": "--step", "zeroshot": "--step"}  # how each command picks a checkpoint step


def _is_override(token: str) -> bool:
    """``section.field=value`` whose first name is a field of ``ExperimentConfig``."""
    import dataclasses

    return bool(_OVERRIDE.match(token)) and token.split("=", 1)[0].split(".")[0] in {
        f.name for f in dataclasses.fields(config_lib.ExperimentConfig)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; ``key=value`` overrides may stand anywhere (also between or after flags, or after
    the values of ``--data`` / ``--val-data``), in the order given.

    Raises:
      ValueError: a token that is neither a flag of the command nor (for commands that take overrides)
        a ``key=value`` override.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    takes_overrides = hasattr(args, "overrides")
    found = list(args.overrides or []) if takes_overrides else []
    if takes_overrides:
        for name in ("data", "val_data"):  # nargs="+" swallows the overrides that follow the paths
            values = getattr(args, name)
            if values:
                moved = [v for v in values if _is_override(v) and not os.path.exists(v)]
                setattr(args, name, [v for v in values if v not in moved] or None)
                found += moved
        found += [t for t in extra if _is_override(t)]
        extra = [t for t in extra if not _is_override(t)]
        position = {t: i for i, t in reversed(list(enumerate(argv)))}
        args.overrides = sorted(found, key=lambda t: position.get(t, len(argv)))
    if extra:
        what = "a flag of this command or a key=value override" if takes_overrides else "a flag of this command"
        raise ValueError(f"unrecognized argument {extra[0]!r}: not {what} (see fox-jax {args.command} --help)")
    return args


def continue_command(argv: list[str], command: str, step: int) -> str:
    """``argv`` as a shell command that continues from checkpoint ``step`` (``--resume-step`` with
    ``--resume`` for the training commands, ``--step`` for eval / zeroshot)."""
    flag = _STEP_FLAGS[command]
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == flag:
            skip = True
        elif not token.startswith(flag + "="):
            out.append(token)
    if flag == "--resume-step" and "--resume" not in out:
        out.append("--resume")
    return "fox-jax " + shlex.join(out + [flag, str(step)])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    from fox_jax.train.checkpoints import CheckpointError, CorruptCheckpointError

    try:
        args = parse_args(argv)
        init_distributed(args)
        if args.command == "train":
            return cmd_train(args)
        if hasattr(args, "handler"):  # finetune-dcp, zeroshot
            return args.handler(args)
        return cmd_eval(args)
    except CorruptCheckpointError as e:
        how = (continue_command(argv, command, e.intact_step)
               if e.intact_step is not None and command in _STEP_FLAGS else None)
        print(f"fox-jax {command}: error: {e.describe(how)}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, FileExistsError, CheckpointError, FloatingPointError) as e:
        print(f"fox-jax {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fox-jax {command}: interrupted; the last checkpoint is kept (continue with --resume)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
