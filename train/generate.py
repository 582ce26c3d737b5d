"""``fox-jax generate``: text from a run directory or a Hugging Face directory under a KV-cache policy.

Prompts come from ``--prompt`` (repeatable) and ``--prompt-file`` (repeatable: a ``.jsonl`` file holds one
prompt per line, a JSON string or a ``{"prompt": TEXT}`` object; any other file is one prompt); they are
encoded after an ``<|endoftext|>`` token (every training document starts with one).

* One batch (no ``--kv-budget``, or every prompt fits it at once): the prompts are left-padded into one batch and
  decoded by ``fox_jax.decoding.generate`` (one jitted prefill + decode loop) under ``--cache POLICY`` with a pool
  of ``--kv-slots`` slots per row and layer, else the policy's need (under ``--kv-budget``: the pool continuous
  batching would give each row, ``acp`` / ``dcp`` calibrated on the first 4 prompts).
* Continuous batching (``--kv-budget`` GiB and more prompts than it holds at once): ``fox_jax.decoding.serve``
  decodes as many rows as the budget holds with the pool each row needs (``--kv-slots``, else the policy's need;
  ``acp`` / ``dcp``: calibrated on the first 4 prompts) and admits the next prompt whenever a row finishes. Every
  prompt's continuation is the one it would get alone; a prompt that can never fit is refused (one line naming
  its flag, file and line).

Prints each continuation, then one JSON line: requests, batch, requests/s, tokens/s, KV bytes, overflow, and
whether the policy's promise is ``provable`` for the model (``acp`` without QK-norm is a heuristic; a warning on
stderr says so too). ``--mesh`` shards the batch and the caches over devices (one batch only:
``fox_jax.decoding.generate(mesh=...)``; the batch is filled to a multiple of data × fsdp with copies of the last
prompt, whose outputs are dropped).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from fox_jax.train.progress import bars_shown


def check_kv_slots(slots: int | None, policy, fed: int, what: str) -> None:
    """Raise a ValueError naming --kv-slots when a fixed-budget policy needs more than ``slots`` for ``fed``
    tokens (``what`` says where they come from); None (the default pool) passes."""
    from fox_jax.decoding import min_slots

    need = min_slots(policy, fed)
    if slots is not None and policy.fixed_budget and slots < need:
        raise ValueError(f"--kv-slots {slots} is too small: --cache {policy.spec} holds up to {need} tokens per row "
                         f"and layer for {what}; give --kv-slots ≥ {need} or leave it out")


def parse_cache_flag(spec: str, flag: str = "--cache"):
    """``parse_policy(spec)`` for a command-line flag: its ValueError names ``flag`` ("--cache 'window:abc': W
    must be an int ≥ 1, ...", "--cache: unknown cache policy 'lru'; ...")."""
    from fox_jax.cache.policies import parse_policy

    try:
        return parse_policy(spec)
    except ValueError as e:
        text = str(e)
        if text.startswith("cache policy "):
            raise ValueError(f"{flag} {text.removeprefix('cache policy ')}") from None
        raise ValueError(f"{flag}: {text}") from None


def load_for_decoding(path: str, *, step: int | None, policy: str, tokenizer: str | None, check=None,
                      step_flag: str = "--step", flag: str = "RUN_DIR_OR_HF_DIR"):
    """(run, tokenizer) of a run or Hugging Face directory for decoding under ``policy``: a DCP model keeps
    its interaction weights only for ``dcp`` (every other policy runs its dense part). ``check(run)``, if
    given, runs before the tokenizer is looked for (argument checks that need only the config).
    ``step_flag`` names ``step`` in the errors, ``flag`` the argument that gave ``path`` (the command line's
    positional, by default).

    Raises:
      ValueError: an unknown policy, ``dcp`` on a model without DCP, no tokenizer, a tokenizer with more
        ids than the model. FileNotFoundError / CheckpointError: as ``open_run``.
    """
    from fox_jax.cache.policies import parse_policy
    from fox_jax.train.runs import open_run
    from fox_jax.train.tokenizers import load_tokenizer

    spec = parse_policy(policy)
    run = open_run(path, step=step, flag=flag, step_flag=step_flag)
    if "interaction_dim" in spec.needs:  # the policy reads DCP's interaction keys
        if not run.model.dcp:
            raise ValueError(f"--cache {spec.spec} needs a DCP model; {path} ({run.what}) has no DCP parameters")
    else:
        run = run.without_dcp()
    if check is not None:
        check(run)
    tokenizer_spec = tokenizer or run.tokenizer
    if tokenizer_spec is None:
        raise ValueError(f"--tokenizer is needed: {path} names none (no vocab.json + merges.txt or tokenizer.json)")
    tok = load_tokenizer(tokenizer_spec)
    if tok.vocab_size > run.model.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids but the model only {run.model.vocab_size}; "
                         "pass the --tokenizer the model was trained with")
    return run, tok


def check_sampling_flags(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """The sampling flags of ``fox-jax generate``, checked before anything is read.

    Raises:
      ValueError: ``--temperature`` < 0, ``--top-k`` < 1, ``--top-p`` outside (0, 1], or ``--top-k`` /
        ``--top-p`` with greedy decoding (``--temperature 0``), which would ignore them.
    """
    if not temperature >= 0:
        raise ValueError(f"--temperature must be ≥ 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k must be a positive int, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError(f"{'--top-k' if top_k is not None else '--top-p'} samples, but --temperature 0 decodes "
                         "greedily; give a --temperature > 0 (e.g. 0.8)")


def read_prompts(texts, files) -> tuple[list[str], list[str]]:
    """(prompts, their names for errors) from ``--prompt`` texts and ``--prompt-file`` paths: a ``.jsonl`` file
    holds one prompt per non-blank line, a JSON string or a ``{"prompt": TEXT}`` object (named "--prompt-file F
    line N"), any other file is one prompt (its whole text: a chapter, a source file).

    Raises:
      FileNotFoundError: a missing file. ValueError: a directory, an empty file, a line that is not such an
        object.
    """
    prompts, names = [], []
    for i, text in enumerate(texts or []):
        prompts.append(text)
        names.append(f"--prompt #{i + 1}")
    for f in files or []:
        p = Path(f)
        if p.is_dir():
            raise ValueError(f"--prompt-file {f} is a directory; give a file: its text is one prompt, or a .jsonl "
                             "file of one prompt per line")
        if not p.is_file():
            raise FileNotFoundError(f"--prompt-file {f}: no such file")
        text = p.read_text(encoding="utf-8")
        if p.suffix != ".jsonl":
            if not text.strip():
                raise ValueError(f"--prompt-file {f} is empty (to generate from <|endoftext|> alone pass --prompt '')")
            prompts.append(text)
            names.append(f"--prompt-file {f}")
            continue
        before = len(prompts)
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                obj = e
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                obj = obj["prompt"]
            if not isinstance(obj, str):
                raise ValueError(f"--prompt-file {f} line {n}: expected a JSON string or object {{\"prompt\": TEXT}} "
                                 f"(a .jsonl file holds one prompt per line), got {line.strip()[:60]!r}")
            prompts.append(obj)
            names.append(f"--prompt-file {f} line {n}")
        if len(prompts) == before:
            raise ValueError(f"--prompt-file {f} holds no prompt (one per line: a JSON string, or {{\"prompt\": TEXT}})")
    if not prompts:
        raise ValueError("give at least one --prompt TEXT or --prompt-file FILE")
    return prompts, names


def cmd_generate(args) -> int:
    """The ``fox-jax generate`` handler."""
    import jax

    from fox_jax.decoding import cache_bytes, generate, plan_serving
    from fox_jax.sharding import data_parallel_size, make_mesh, select_partitioner

    prompts, names = read_prompts(args.prompt, args.prompt_file)
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--kv-slots", args.kv_slots),
                        ("--prefill-chunk", args.prefill_chunk)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be a positive int, got {value}")
    if args.kv_budget is not None and not args.kv_budget > 0:
        raise ValueError(f"--kv-budget must be a positive number of GiB, got {args.kv_budget}")
    check_sampling_flags(args.temperature, args.top_k, args.top_p)
    policy = parse_cache_flag(args.cache)
    mesh = make_mesh(args.mesh) if args.mesh else None   # a bad --mesh: before any file is read
    if mesh is not None:
        select_partitioner(mesh, "auto")  # as training: GSPMD on multi-GPU meshes, so the kernels run per shard
    run, tok = load_for_decoding(args.run, step=args.step, policy=policy.spec, tokenizer=args.tokenizer)
    cfg = run.model
    if args.top_k is not None and args.top_k > cfg.vocab_size:
        raise ValueError(f"--top-k must be at most the model's {cfg.vocab_size} token ids, got {args.top_k}")
    # every prompt starts with <|endoftext|>, as every training document does (fox_jax.train.data)
    ids = [np.asarray([tok.eot_id, *x], np.int32) for x in tok.encode_batch(prompts)]
    stops = () if args.no_stop else (tok.eot_id,)
    params = run.load_params()
    model = cfg.build()
    if args.kv_budget is not None:  # continuous batching when the budget does not hold every prompt at once
        plan = plan_serving(model, params, ids, max_new_tokens=args.max_new_tokens, policy=policy,
                            kv_budget=args.kv_budget * 2 ** 30, slots=args.kv_slots,
                            calibrate=0 if policy.fixed_budget or args.kv_slots else CALIBRATE_PROMPTS,
                            prefill_chunk=args.prefill_chunk, stop_tokens=stops, names=names,
                            budget_name="--kv-budget")
        if plan.batch < len(ids):
            if mesh is not None:
                raise ValueError(f"--mesh decodes one batch; --kv-budget {args.kv_budget} GiB holds {plan.batch} of "
                                 f"the {len(ids)} prompts at once (continuous batching runs on one device)")
            return _serve(args, model, params, tok, cfg, policy, prompts, ids, stops, plan)
    rows, longest = len(ids), max(len(x) for x in ids)
    if cfg.max_positions is not None and longest + args.max_new_tokens - 1 > cfg.max_positions:
        raise ValueError(f"the longest prompt ({longest} tokens with <|endoftext|>) and --max-new-tokens "
                         f"{args.max_new_tokens} need {longest + args.max_new_tokens - 1} positions; the model has "
                         f"{cfg.max_positions}: shorten the prompt or lower --max-new-tokens")
    if mesh is not None:  # rows over data x fsdp: fill the batch with copies of the last prompt (dropped below)
        ids += [ids[-1]] * (-rows % data_parallel_size(mesh))
    width = max(len(x) for x in ids)
    tokens = np.full((len(ids), width), tok.eot_id, np.int32)
    for i, x in enumerate(ids):
        tokens[i, width - len(x):] = x
    seq_start = np.asarray([width - len(x) for x in ids], np.int32)
    slots = args.kv_slots
    check_kv_slots(slots, policy, width + args.max_new_tokens - 1,
                   f"the longest prompt ({width} tokens) + --max-new-tokens {args.max_new_tokens} − 1")
    if args.kv_budget is not None and slots is None:  # every prompt fits: the pool serve would give a row (the
        slots = plan.slots  # policy's need, or acp / dcp's calibrated pool), not the whole budget
    kwargs = dict(max_new_tokens=args.max_new_tokens, policy=policy, slots=slots, seq_start=seq_start,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop_tokens=stops,
                  rng=jax.random.PRNGKey(args.seed), prefill_chunk=args.prefill_chunk, mesh=mesh)
    start = time.perf_counter()
    out = generate(model, params, tokens, **kwargs)
    new_tokens = np.asarray(out.tokens)[:rows]
    seconds = time.perf_counter() - start
    lengths = np.asarray(out.lengths)[:rows]
    ids = ids[:rows]
    for i, prompt in enumerate(prompts):
        _print_continuation(i, prompt, ids[i], new_tokens[i, :lengths[i]].tolist(), tok.eot_id, tok)
    live = np.asarray(out.live_counts)[:, :, :rows]                    # [N, L, B]
    per_token = np.asarray([c.groups[0].entry_bytes * c.kv_heads for c in out.caches])  # bytes per live token
    steps = max(int(lengths.max()), 1)
    summary = {
        "command": "generate", "mode": "batch", "model": _model_name(cfg), "cache": policy.spec,
        "requests": rows, "batch": len(ids), "prompt_tokens": [len(x) for x in ids], "new_tokens": lengths.tolist(),
        "seconds": round(seconds, 3), "compile_included": True, "requests_per_s": round(rows / seconds, 3),
        "tokens_per_s": round(float(lengths.sum()) / seconds, 1),
        "slots": out.caches[0].capacity,
        # the prompts' rows only (without the copies that fill a --mesh batch)
        "kv_bytes_allocated": cache_bytes(out.caches)["allocated"] * rows // len(tokens),
        "kv_bytes_live": int(round(sum(float(np.asarray(c.live_bytes())[:rows].sum()) for c in out.caches))),
        "kv_bytes_peak_live": int((live[:steps] * per_token[None, :, None]).sum(axis=(1, 2)).max()),
        "mean_live_tokens_per_layer": [round(float(x), 1) for x in live[steps - 1].mean(axis=1)],
        "overflow": np.asarray(out.overflow)[:rows].tolist(),
        "provable": out.provable,
        **({"mesh": dict(mesh.shape), "padded_rows": len(tokens) - rows} if mesh is not None else {}),
    }
    _finish(summary, policy)
    return 0


CALIBRATE_PROMPTS = 4  # acp / dcp under --kv-budget without --kv-slots: the pool from generating the first prompts


def _model_name(cfg) -> str:
    return cfg.model_type if cfg.model_type == "gpt2" else cfg.arch


def _print_continuation(i: int, prompt: str, ids, tokens, eot: int, tok) -> None:
    text = tok.decode([t for t in tokens if t != eot])
    print(f"--- prompt {i + 1} ({len(ids)} tokens) ---\n{prompt}\n--- generated ({len(tokens)} tokens) ---\n{text}")


def _finish(summary: dict, policy) -> None:
    """The overflow warning (stderr) and the JSON line."""
    if any(summary["overflow"]):
        print(f"warning: the KV pool ({summary['slots']} slots per row) was too small for cache policy {policy.spec}: "
              "entries were dropped, so the text is not exactly the policy's (raise --kv-slots / --kv-budget)",
              file=sys.stderr)
    print(json.dumps(summary))
    sys.stdout.flush()


def _serve(args, model, params, tok, cfg, policy, prompts, ids, stops, plan) -> int:
    """Continuous batching (``fox_jax.decoding.serve``) of prompts that the --kv-budget does not hold at once."""
    import jax

    from fox_jax.decoding import serve

    out = serve(model, params, ids, max_new_tokens=args.max_new_tokens, policy=policy, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, stop_tokens=stops, rng=jax.random.PRNGKey(args.seed),
                prefill_chunk=args.prefill_chunk, plan=plan, progress=bars_shown(not args.no_progress))
    for c in out.completions:
        _print_continuation(c.index, prompts[c.index], ids[c.index], c.tokens.tolist(), tok.eot_id, tok)
    s = out.summary
    summary = {
        "command": "generate", "mode": "serve", "model": _model_name(cfg), "cache": policy.spec,
        "requests": s["requests"], "batch": s["batch"], "prompt_tokens": [len(x) for x in ids],
        "new_tokens": [len(c.tokens) for c in out.completions], "seconds": round(s["seconds"], 3),
        "compile_included": True, "requests_per_s": round(s["requests_per_s"], 3),
        "tokens_per_s": round(s["tokens_per_s"], 1),
        "decode_tokens_per_s": None if s["decode_tokens_per_s"] is None else round(s["decode_tokens_per_s"], 1),
        "prefill_seconds": round(s["prefill_seconds"], 3), "decode_seconds": round(s["decode_seconds"], 3),
        "slots": s["slots"], "slots_rule": s["slots_rule"], "kv_budget_bytes": int(s["kv_budget_bytes"]),
        "kv_bytes_allocated": s["kv_bytes_allocated"], "kv_bytes_row": s["kv_bytes_row"],
        "kv_bytes_live_mean": int(round(s["kv_bytes_live_mean"])),
        "mean_live_tokens": [round(c.live_tokens_mean, 1) for c in out.completions],
        "overflow": s["overflow"], "provable": s["provable"],
    }
    _finish(summary, policy)
    return 0


__all__ = ["check_kv_slots", "check_sampling_flags", "cmd_generate", "load_for_decoding", "parse_cache_flag", "read_prompts"]
