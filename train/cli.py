"""``fox-jax``: train and evaluate FoX / Transformer language models.

    fox-jax train --preset tiny --workdir runs/tiny                 # built-in corpus, CPU-friendly
    fox-jax train --preset 125M --data DIR --val-data DIR --tokenizer DIR --workdir runs/fox125m
    fox-jax train --workdir runs/tiny --resume --steps 600          # continue and extend (see --resume-schedule)
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
import warnings

import importlib
import json
import math

from fox_jax.config import ARCHS, FieldError, one_of
from fox_jax.train import config as config_lib
from fox_jax.train.commands import GPT2_FLAGS, PATH_KEYS, MissingExtraError, alias_flags, build_parser, flag_dest


def explicit_overrides(args) -> list[str]:
    """The ``key=value`` overrides of the command line: the positional ones, then the alias flags given
    (``fox_jax.train.commands.alias_flags``; paths made absolute), which win."""
    out = list(getattr(args, "overrides", None) or [])
    for flag, key in alias_flags(args.command):
        value = getattr(args, flag_dest(flag), None)
        if value is None:
            continue
        if key in PATH_KEYS:
            values = [v if v == "bytes" else os.path.abspath(v) for v in (value if isinstance(value, list) else [value])]
            value = ",".join(values)
        out.append(f"{key}={value}")
    data = getattr(args, "data", None)
    if not getattr(args, "tokenizer", None) and data and len(data) == 1 \
            and os.path.isfile(os.path.join(data[0], "meta.json")) and os.path.isdir(os.path.join(data[0], "tokenizer")):
        out.append(f"data.tokenizer={os.path.abspath(os.path.join(data[0], 'tokenizer'))}")  # a pre-tokenized directory
    return out


_MODEL_CLASSES = ("ModelConfig.", "GPT2Config.")  # how the model configs name their fields (fox_jax.config)


def field_namer(args):
    """``name(key)``: how an error of this command line names the config field ``key`` (a ``FieldError``'s
    keys): the flag when the command has one for it (``--steps``), unless the value came from a ``key=value``
    override and not from the flag, which keeps the key; ``model.<field>`` for the model configs'
    ``ModelConfig.<field>``. None (the message unchanged) for commands that take no overrides."""
    if not hasattr(args, "overrides"):
        return lambda key: None
    given = {o.split("=", 1)[0] for o in args.overrides or []}
    flags = {key: flag for flag, key in alias_flags(args.command) if hasattr(args, flag_dest(flag))}

    def name(key: str) -> str:
        for prefix in _MODEL_CLASSES:
            if key.startswith(prefix):
                key = "model." + key.removeprefix(prefix)
        flag = flags.get(key)
        if flag is None or (getattr(args, flag_dest(flag), None) is None and key in given):
            return key
        return flag

    return name


def check_paths(cfg: config_lib.ExperimentConfig) -> None:
    """Raise FileNotFoundError (naming --data / --val-data) for a data path that does not exist."""
    for flag, paths in (("--data", cfg.data.train), ("--val-data", cfg.data.val)):
        for p in paths:
            if not any(ch in p for ch in "*?[") and not os.path.exists(p):
                raise FileNotFoundError(f"{flag}: {p} does not exist; give a file, directory or glob of .txt/.jsonl text")


def print_done(result, extra: str = "") -> None:
    msg = f"done: {result.final_step} steps in {result.workdir}"
    if result.hf_dir:
        msg += f"; model exported to {result.hf_dir}"
    if result.val:
        msg += f"; val_loss {result.val['val_loss']:.4f}, val_ppl {result.val['val_ppl']:.2f}" + extra
    print(msg)


def cmd_train(args) -> int:
    """``fox-jax train`` and ``pretrain-gpt2`` (= ``train --preset gpt2``, with the GPT-2 shape flags)."""
    from fox_jax.train import loop

    gpt2 = getattr(args, "gpt2", False)
    preset, arch = args.preset or ("gpt2" if gpt2 else "tiny"), args.arch or "fox-llama"
    if gpt2 and preset not in config_lib.GPT2_SIZES:
        raise ValueError(f"--size must be one of {', '.join(config_lib.GPT2_SIZES)}; got {preset!r}")
    if arch not in ARCHS:
        raise ValueError(f"--arch must be one of {one_of(ARCHS)}; got {arch!r}")
    overrides = explicit_overrides(args)
    cfg_path = os.path.join(args.workdir, config_lib.CONFIG_NAME)
    if args.resume and loop.has_checkpoints(args.workdir) and os.path.exists(cfg_path):
        saved = config_lib.load_json(cfg_path)
        cfg = config_lib.apply_overrides(saved, overrides)  # flags given now override it
        shape = [o for o in overrides if o.split("=", 1)[0] in {key for _, key in GPT2_FLAGS}]
        if args.preset is not None or args.arch is not None or (gpt2 and shape):  # must describe the saved model
            asked = config_lib.apply_overrides(config_lib.preset(preset, arch), overrides).model
            asked = asked.replace(vocab_size=saved.model.vocab_size)  # resolved from the tokenizer
            names = (("size" if gpt2 else "preset", args.preset), ("arch", args.arch))
            flags = " ".join(f"--{k} {v}" for k, v in names if v) or "the flags given"
            config_lib.check_resume({"model": config_lib.to_dict(saved.model)}, {"model": config_lib.to_dict(asked)},
                                    loop.RESUMABLE, what=f"the model of {flags}")
    else:
        if gpt2 and not args.tokenizer:
            raise ValueError("--tokenizer is required (a directory with GPT-2 vocab.json + merges.txt)")
        cfg = config_lib.apply_overrides(config_lib.preset(preset, arch), overrides)
    check_paths(cfg)
    explicit_vocab = any(o.startswith("model.vocab_size=") for o in overrides)
    result = loop.train(cfg, args.workdir, resume=args.resume, resume_step=args.resume_step,
                        explicit_vocab=explicit_vocab, progress=not args.no_progress)
    print_done(result)
    return 0


def cmd_eval(args) -> int:
    from fox_jax.train import evaluate

    report = evaluate.evaluate_run(args.workdir, overrides=explicit_overrides(args), step=args.step,
                                   num_batches=args.num_batches, num_docs=args.num_docs, cache=args.cache,
                                   kv_slots=args.kv_slots)
    if args.cache is not None:
        print(f"step {report['step']}, document starts ({report['dense_tokens']} next-token predictions in the first "
              f"{report['seq_len']} tokens of {report['num_docs']} validation documents, the tokens of plain eval's "
              f"per-position loss, not of its val_ppl): cache {report['cache']} ppl {report['policy_ppl']:.3f} vs "
              f"dense {report['dense_ppl']:.3f} (ratio {report['ppl_ratio']:.4f})"
              f"{'; OVERFLOW in ' + str(report['policy_overflow_rows']) + ' rows: the pool was too small for the policy' if report['policy_overflow_rows'] else ''}")
        print(json.dumps({k: v for k, v in report.items() if not k.endswith("per_position_loss")}))
        return 0
    print(f"step {report['step']}, packed windows ({report['val_tokens']} tokens of validation windows of "
          f"{report['seq_len']}, documents cut anywhere, as in training): val_loss {report['val_loss']:.4f} | "
          f"val_ppl {report['val_ppl']:.2f}")
    pairs = [(x, c) for x, c in zip(report["per_position_loss"], report["per_position_count"]) if c]
    n = sum(c for _, c in pairs)
    mean = sum(x * c for x, c in pairs) / max(n, 1)
    print(f"step {report['step']}, document starts ({int(n)} next-token predictions in the first {report['seq_len']} "
          f"tokens of {report['num_docs']} validation documents, the tokens eval --cache scores): per-position loss "
          f"mean {mean:.4f} | ppl {math.exp(min(mean, 50.0)):.2f}; by position: {report['per_position_json']} and "
          f"{report['per_position_png']}")
    print("the two differ because they average different tokens (document starts have little context: their loss "
          "is usually the higher)")
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


COMPILE_CACHE_ENV = "FOX_JAX_COMPILE_CACHE"


def compile_cache_dir(environ=os.environ) -> str | None:
    """Where the commands keep JAX's persistent compilation cache (a later run of the same program loads it instead
    of compiling: on GPU the autotuned kernels too): ``$FOX_JAX_COMPILE_CACHE`` ("off" turns it off), else None when
    ``$JAX_COMPILATION_CACHE_DIR`` is set (JAX's own setting stands), else ``$XDG_CACHE_HOME/fox_jax/xla``
    (``~/.cache/fox_jax/xla``). JAX caches the programs that take ≥ 1 s to compile
    (``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``)."""
    value = environ.get(COMPILE_CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "off", "0", "none", "false") else os.path.expanduser(value)
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    return os.path.join(environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fox_jax", "xla")


def enable_compile_cache() -> str | None:
    """Point JAX's persistent compilation cache at ``compile_cache_dir()`` (nothing when that is None); returns it."""
    path = compile_cache_dir()
    if path:
        import jax

        jax.config.update("jax_compilation_cache_dir", path)
    return path


_OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*=")
_STEP_FLAGS = {"train": "--resume-step", "finetune-dcp": "--resume-step", "pretrain-gpt2": "--resume-step",
               "eval": "--step", "zeroshot": "--step", "passkey": "--step", "generate": "--step"}  # how each command picks a checkpoint step


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


def _one_line_for_ours(default):
    """A ``warnings.formatwarning`` that prints fox_jax's own warnings (e.g. ``HeuristicEvictionWarning``) as one
    ``warning: ...`` line, without the library source line that points at no code of the user's."""
    if getattr(default, "_fox_jax", False):
        return default

    def fmt(message, category, filename, lineno, line=None):
        if category.__module__.split(".")[0] == "fox_jax":
            return f"warning: {message}\n"
        return default(message, category, filename, lineno, line)

    fmt._fox_jax = True
    return fmt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    prog = f"fox-jax {command}" if command else "fox-jax"
    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    from fox_jax.train.checkpoints import CheckpointError, CorruptCheckpointError

    warnings.formatwarning = _one_line_for_ours(warnings.formatwarning)
    try:
        init_distributed(args)
        enable_compile_cache()
        module, name = args.handler.split(":")
        return getattr(importlib.import_module(module), name)(args)
    except CorruptCheckpointError as e:
        how = (continue_command(argv, command, e.intact_step)
               if e.intact_step is not None and command in _STEP_FLAGS else None)
        print(f"{prog}: error: {e.describe(how)}", file=sys.stderr)
        return 2
    except FieldError as e:  # names the flag the user gave, or the key=value key
        print(f"{prog}: error: {e.renamed(field_namer(args))}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, FileExistsError, CheckpointError, FloatingPointError,
            MissingExtraError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fox-jax {command}: interrupted; the last checkpoint is kept (continue with --resume)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
