"""``fox-jax``: train and evaluate FoX / Transformer language models.

    fox-jax train --preset tiny --workdir runs/tiny                 # built-in corpus, CPU-friendly
    fox-jax train --preset 125M --data DIR --val-data DIR --tokenizer DIR --workdir runs/fox125m
    fox-jax train --workdir runs/tiny --resume --steps 600          # continue (and extend) a run
    fox-jax eval  --workdir runs/tiny                               # val loss/ppl + per-position loss

Any config field can be overridden with ``key=value`` arguments anywhere on the command line, e.g.
``model.n_layers=6 optim.lr=1e-3 data.seed=3`` (see ``train/config.py``). Errors are one line that
says what to do. The parser (``fox_jax.train.commands``) imports no jax, so ``--help`` and argument errors
answer at once; a command's handler (and jax) is imported only when it runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

import importlib

from fox_jax.train import config as config_lib
from fox_jax.train.commands import build_parser


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
    pairs = [(x, c) for x, c in zip(report["per_position_loss"], report["per_position_count"]) if c]
    mean = sum(x * c for x, c in pairs) / max(sum(c for _, c in pairs), 1)
    print(f"per-position loss (mean {mean:.4f} over {report['num_docs']} documents): {report['per_position_json']} "
          f"and {report['per_position_png']}")
    print("why the two means differ: they average different tokens. val_loss covers every token of the packed "
          "validation windows (documents cut anywhere, several per window, like the training batches); the "
          f"per-position loss covers only the first {report['seq_len']} tokens of {report['num_docs']} documents, "
          "read from each document's first token, so it counts each document's opening positions (little "
          "context) and only those documents")
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
    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"fox-jax {command}: error: {e}", file=sys.stderr)
        return 2
    from fox_jax.train.checkpoints import CheckpointError, CorruptCheckpointError

    try:
        init_distributed(args)
        module, name = args.handler.split(":")
        return getattr(importlib.import_module(module), name)(args)
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
