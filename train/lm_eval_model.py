"""fox_jax models in EleutherAI's lm-evaluation-harness: the registered model ``fox_jax`` and local task files.

Importing this module registers ``FoxJaxLM`` with lm-eval as ``fox_jax``. lm-eval finds models only through
its registry (it has no plugin entry points), so its own ``lm_eval`` script does not know ``fox_jax``;
``python -m fox_jax.train.lm_eval_model ARGS`` is that script with the model registered and our task folder
on ``--include_path`` (the same flags)::

    python -m fox_jax.train.lm_eval_model --model fox_jax --model_args run=runs/tiny,batch_size=16 \\
        --tasks fox_zeroshot,fox_wikitext2 --limit 100

From Python: ``lm_eval.simple_evaluate(model=FoxJaxLM(run="runs/tiny"), tasks=[...], task_manager=task_manager())``.
``fox-jax zeroshot --harness lm-eval`` runs the same and prints the table of ``fox-jax zeroshot``.

Model arguments (``--model_args k=v,...`` or ``FoxJaxLM(**kwargs)``):

==============  ====================================================================================
``run``         a run of ``fox-jax train`` / ``finetune-dcp``, or a Hugging Face GPT-2 / official FoX
                directory (anything ``fox_jax.train.runs.open_run`` reads); required
``step``        checkpoint step (default: the latest)
``batch_size``  rows per forward pass / generate call (``FoxJaxLM`` default 8; on lm-eval's command line
                ``--batch_size``, default 1, unless ``--model_args`` gives it)
``cache``       KV-cache policy of ``generate_until`` (``dense``, ``dcp``, ``acp``, ``acp:LOG_EPS``,
                ``window:W``, ``sinks:S+W``; default dense). ``dcp`` also scores log-likelihoods with the
                DCP model (its α = ∞ step mask); every other policy keeps the dense weights, and
                log-likelihood requests always run the full forward (the policy shapes generation only)
``dtype``       compute dtype ``float32`` or ``bfloat16`` (default: the run's); parameters stay float32
``max_length``  context in tokens (default: GPT-2's n_positions, else the run's training seq_len)
``max_gen_toks``  default tokens per generation when a task gives none (default 256)
``tokenizer``   tokenizer spec (default: the run's)
``prefill_chunk``  prompt tokens per prefill chunk for chunked policies (default 512)
``seed``        sampling seed for tasks that sample (default 0)
==============  ====================================================================================

Requests, as lm-eval's Hugging Face model handles them:

- ``loglikelihood``: lm-eval's ``TemplateLM`` encodes (context, continuation) pairs (trailing spaces of the
  context move to the continuation; an empty context is ``<|endoftext|>``); the rows
  ``(context + continuation)[-(max_length + 1):]`` are scored by ``zeroshot.score_requests`` (sorted longest
  first, right-padded to power-of-two lengths, ``batch_size`` rows per call: few compiled shapes) with
  ``zeroshot.ModelScorer``'s jitted forward. Returns (sum of the continuation's log-probs, whether every
  continuation token is the argmax). A continuation longer than ``max_length`` tokens is scored on its last
  ``max_length`` tokens, with a warning (lm-eval's HF model stops with an assertion).
- ``loglikelihood_rolling``: the text's tokens in disjoint windows of ``max_length`` predictions, each
  window with as much preceding context as fits (lm-eval's ``get_rolling_token_windows`` with
  ``context_len=1``, ``<|endoftext|>`` before the first token); the sum over all tokens.
- ``generate_until``: prompts left-truncated to ``max_length − max_gen_toks`` tokens, left-padded to a
  power-of-two width (the KV pool sized for that width, so batches share one compiled program), decoded by ``fox_jax.decoding.generate`` under ``cache`` (greedy unless the task sets
  ``do_sample``/``temperature``; ``top_k``/``top_p`` pass through); rows stop at ``<|endoftext|>`` and at
  stop strings that are one token; the text is cut at the first stop string (lm-eval's ``until``).

Raises ``MissingExtraError`` (an ``ImportError``; one line naming ``pip install -e ".[eval]"``) when lm-eval
is not installed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

import numpy as np

from fox_jax.train.commands import ZEROSHOT_TASKS, MissingExtraError

try:
    import lm_eval
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
except ImportError as e:  # the optional extra
    raise MissingExtraError(f'lm-eval is not installed ({e}); install it with: pip install -e ".[eval]"') from None

from fox_jax.train.zeroshot import ModelScorer, bucket_length, score_requests

logger = logging.getLogger("fox_jax.lm_eval")

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
"""The folder of our task YAML files (``--include_path``): ``fox_lambada``, ``fox_piqa``, ``fox_winogrande``,
``fox_hellaswag``, ``fox_arc_easy``, ``fox_arc_challenge``, ``fox_copa``, ``fox_boolq`` (group
``fox_zeroshot``) and ``fox_wikitext2``, reading ``../shared/data/eval`` (``lm_eval_tasks/fox_tasks.py``)."""

DTYPES = ("float32", "bfloat16")
HARNESS_TASKS = {**{name: f"fox_{name}" for name in ZEROSHOT_TASKS}, "wikitext2": "fox_wikitext2"}
"""``fox-jax zeroshot --tasks`` names -> our lm-eval task names."""
_SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "top_p"}


def task_manager(eval_dir: str | Path | None = None, *, include_defaults: bool = False):
    """An lm-eval ``TaskManager`` with our task folder (``TASKS_DIR``) reading ``eval_dir`` (default:
    ``zeroshot.default_eval_dir()``); ``include_defaults`` adds lm-eval's built-in tasks (they read the hub)."""
    from lm_eval.tasks import TaskManager

    metadata = {} if eval_dir is None else {"eval_dir": str(eval_dir)}
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=include_defaults, metadata=metadata)


@register_model("fox_jax")
class FoxJaxLM(TemplateLM):
    """A fox_jax model for lm-eval (``--model fox_jax``); arguments and request handling: module docstring.

    Raises:
      ValueError / FileNotFoundError / CheckpointError: a bad argument (named as ``name=``), or a run
        ``open_run`` cannot read.
    """

    def __init__(self, run: str | None = None, step: int | None = None, batch_size: int | str | None = 8,
                 cache: str = "dense", dtype: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, tokenizer: str | None = None, prefill_chunk: int = 512, seed: int = 0,
                 max_batch_size: int | None = None, device: str | None = None, **unknown):
        super().__init__()
        from fox_jax.cache.policies import parse_policy
        from fox_jax.train.generate import load_for_decoding

        if unknown:
            raise ValueError(f"fox_jax model: unknown argument(s) {', '.join(sorted(unknown))}; expected run, step, "
                             "batch_size, cache, dtype, max_length, max_gen_toks, tokenizer, prefill_chunk, seed")
        if not run:
            raise ValueError("fox_jax model: run= is required (a run or Hugging Face directory), e.g. "
                             "--model_args run=runs/tiny")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"fox_jax model: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        for name, value in (("batch_size", batch_size), ("max_gen_toks", max_gen_toks),
                            ("prefill_chunk", prefill_chunk), ("max_length", max_length)):
            if value is not None:
                _positive_int(value, name)  # before the (slow) model load
        policy = parse_policy(cache)
        step = None if step is None else _positive_int(step, "step", minimum=0)
        opened, tok = load_for_decoding(str(run), step=step, policy=policy.spec, tokenizer=tokenizer,
                                        step_flag="fox_jax model: step", flag="fox_jax model: run")
        if dtype is not None:
            opened = dataclasses.replace(opened, model=opened.model.replace(dtype=dtype))
        if max_length is None:  # GPT-2's n_positions, else the training length
            max_length = opened.model.max_positions or opened.seq_len
            if max_length is None:
                raise ValueError(f"fox_jax model: max_length= is needed: {run} ({opened.what}) records no "
                                 "training length")
        self._setup(opened.model, opened.load_params(), tok, max_length=max_length, batch_size=batch_size,
                    policy=policy, max_gen_toks=max_gen_toks, prefill_chunk=prefill_chunk, seed=seed)
        self.run = opened

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "FoxJaxLM":
        """``--model_args k=v,...``; see ``create_from_arg_obj``."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "FoxJaxLM":
        """The model of ``arg_dict``; lm-eval's own settings (``--batch_size``, ``--device``, ...) fill in only
        what ``arg_dict`` leaves out (lm-eval's base class would pass ``batch_size`` twice)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def from_params(cls, cfg, params, tokenizer, *, max_length: int | None = None, batch_size: int = 8,
                    cache: str = "dense", max_gen_toks: int = 256, prefill_chunk: int = 512,
                    seed: int = 0) -> "FoxJaxLM":
        """The LM of a model in memory (e.g. during training), without a run directory.

        Args:
          cfg, params: a ``ModelFamily`` config and its params pytree, as the model runs: a DCP config
            (``cfg.dcp``) exactly when ``cache="dcp"``.
          tokenizer: a ``fox_jax.train.tokenizers.Tokenizer``.
          max_length: context in tokens (default: ``cfg.max_positions``; required for models without one).
          batch_size, cache, max_gen_toks, prefill_chunk, seed: as the model arguments of the module docstring.

        Raises:
          ValueError: a bad argument, a cache policy that does not match ``cfg.dcp``, a tokenizer with more
            ids than the model.
        """
        from fox_jax.cache.policies import parse_policy

        policy = parse_policy(cache)
        if ("interaction_dim" in policy.needs) != bool(cfg.dcp):
            raise ValueError(f"fox_jax model: cache={policy.spec} with a {'DCP' if cfg.dcp else 'dense'} config; "
                             "cache=dcp runs a DCP config, every other policy a dense one (cfg.replace(dcp=False) "
                             "and its dense params)")
        if max_length is None:
            max_length = cfg.max_positions
            if max_length is None:
                raise ValueError("fox_jax model: max_length= is needed (the model has no position limit)")
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm._setup(cfg, params, tokenizer, max_length=max_length, batch_size=batch_size, policy=policy,
                  max_gen_toks=max_gen_toks, prefill_chunk=prefill_chunk, seed=seed)
        lm.run = None
        return lm

    def _setup(self, cfg, params, tokenizer, *, max_length, batch_size, policy, max_gen_toks, prefill_chunk,
               seed) -> None:
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"fox_jax model: the tokenizer has {tokenizer.vocab_size} ids but the model only "
                             f"{cfg.vocab_size}; pass the tokenizer= the model was trained with")
        max_length = _positive_int(max_length, "max_length")
        if cfg.max_positions is not None and max_length > cfg.max_positions:
            raise ValueError(f"fox_jax model: max_length must be ≤ {cfg.max_positions} (GPT-2 n_positions), "
                             f"got {max_length}")
        self.cfg, self.params, self._tok, self._max_length, self.policy = cfg, params, tokenizer, max_length, policy
        self.batch_size = _positive_int(8 if batch_size is None else batch_size, "batch_size")
        self.max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")
        self.prefill_chunk = _positive_int(prefill_chunk, "prefill_chunk")
        self.seed = int(seed)
        self.model = cfg.build()
        self.scorer = ModelScorer(cfg, params)
        self._warned_policy = False

    # -- what TemplateLM needs ---------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return int(self._tok.eot_id)

    @property
    def max_length(self) -> int:
        """Tokens the model sees per forward pass (``max_length=``)."""
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self._tok.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of ``string``; no special tokens are ever added (fox_jax tokenizers add none)."""
        return [int(i) for i in self._tok.encode_batch([string])[0]]

    def tok_decode(self, tokens) -> str:
        return self._tok.decode(np.asarray(tokens, np.int64))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``[((context, continuation) or None, context ids, continuation ids)]`` -> ``[(log-likelihood, greedy)]``."""
        self._note_policy()
        pairs = [(np.asarray(ctx, np.int32), np.asarray(cont, np.int32)) for _, ctx, cont in requests]
        n_long = sum(len(cont) > self.max_length for _, cont in pairs)
        if n_long:
            logger.warning("fox_jax: %d continuation(s) longer than max_length=%d tokens are scored on their last "
                           "%d tokens only", n_long, self.max_length, self.max_length)
        loglik, greedy = score_requests(self.scorer, pairs, batch_size=self.batch_size, max_length=self.max_length,
                                        pad_id=self.eot_token_id, progress=not disable_tqdm, desc="loglikelihood")
        out = []
        for (key, _, _), ll, g in zip(requests, loglik, greedy):
            answer = (float(ll), bool(g))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each text (``Instance.args == (text,)``) over rolling windows."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = np.zeros(len(requests), np.float64)
        if windows:
            np.add.at(totals, owner, [ll for ll, _ in self._loglikelihood_tokens(windows, disable_tqdm)])
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, float(total))
        return [float(t) for t in totals]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations of ``Instance.args == (context, gen_kwargs)`` under the ``cache`` policy."""
        import jax

        from fox_jax.decoding import generate, min_slots
        from fox_jax.train.progress import progress_bar

        eos = self.tok_decode([self.eot_token_id])
        collator = Collator([req.args for req in requests], sort_fn=lambda a: (-len(a[0]), a[0]),
                            group_by="gen_kwargs", group_fn=lambda a: a[1])
        out = []
        with progress_bar(total=len(requests), desc="generate_until", unit="req", progress=not disable_tqdm,
                          leave=False) as bar:
            for chunk in collator.get_batched(n=self.batch_size):
                contexts, all_kwargs = zip(*chunk)
                kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_new = _positive_int(kwargs.pop("max_gen_toks"), "max_gen_toks")
                other = set(kwargs) - _SAMPLING_KEYS
                if other:
                    raise ValueError(f"fox_jax generate_until: unsupported generation argument(s) "
                                     f"{', '.join(sorted(other))}; supported: until, max_gen_toks, "
                                     f"{', '.join(sorted(_SAMPLING_KEYS))}")
                # do_sample without a temperature samples at 1 (as Hugging Face's generate does)
                temperature = float(kwargs.get("temperature", 1.0)) if kwargs.get("do_sample") else 0.0
                room = self.max_length - max_new
                if room < 1:
                    raise ValueError(f"fox_jax generate_until: max_gen_toks={max_new} leaves no room for a prompt in "
                                     f"max_length={self.max_length}")
                ids = [np.asarray(x, np.int32)[-room:] for x in self._tok.encode_batch(list(contexts))]
                ids = [x if len(x) else np.asarray([self.eot_token_id], np.int32) for x in ids]
                width = bucket_length(max(len(x) for x in ids), room)
                rows = self.batch_size  # filler rows keep one compiled shape
                tokens = np.full((rows, width), self.eot_token_id, np.int32)
                seq_start = np.zeros(rows, np.int32)
                for i, x in enumerate(ids + [ids[0]] * (rows - len(ids))):
                    tokens[i, width - len(x):] = x
                    seq_start[i] = width - len(x)
                stops = {self.eot_token_id}
                for s in until:  # a one-token stop string: stopping there is exact (the text is cut anyway)
                    enc = self._tok.encode_batch([s])[0] if s else []
                    if len(enc) == 1:
                        stops.add(int(enc[0]))
                # the pool for the padded width (not the batch's longest prompt): one compiled program per width
                slots = min_slots(self.policy, width + max_new - 1)
                gen = generate(self.model, self.params, tokens, max_new_tokens=max_new, policy=self.policy,
                               slots=slots, seq_start=seq_start, temperature=temperature, top_k=kwargs.get("top_k"),
                               top_p=kwargs.get("top_p"), stop_tokens=tuple(sorted(stops)),
                               rng=jax.random.PRNGKey(self.seed), prefill_chunk=self.prefill_chunk)
                new, lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
                for i, (context, gen_kwargs) in enumerate(chunk):
                    text = postprocess_generated_text(self.tok_decode(new[i, :lengths[i]]), until, None)
                    self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                    out.append(text)
                bar.update(len(chunk))
        return collator.get_original(out)

    def _note_policy(self) -> None:
        if not self.policy.forward_exact and not self._warned_policy:
            logger.warning("fox_jax: cache=%s shapes generate_until only; log-likelihood requests run the full "
                           "(dense) forward", self.policy.spec)
            self._warned_policy = True

    def get_model_info(self) -> dict:
        """Written into lm-eval's results (``config.model_info``)."""
        cfg, run = self.cfg, self.run
        return {"fox_jax_run": run and run.path, "step": run and run.step, "kind": run and run.kind,
                "model": "gpt2" if cfg.model_type == "gpt2" else cfg.arch, "dtype": cfg.dtype, "dcp": cfg.dcp,
                "cache": self.policy.spec, "max_length": self.max_length, "tokenizer": self._tok.name,
                "lm_eval_version": lm_eval.__version__}


def _positive_int(value, name: str, minimum: int = 1) -> int:
    """``value`` (an int, or digits as lm-eval's command line passes them) as an int ≥ ``minimum``."""
    ok = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and value.strip().isdigit())
    if not ok or int(value) < minimum:
        what = "'auto' is not supported, give a number" if str(value).startswith("auto") else f"got {value!r}"
        raise ValueError(f"fox_jax model: {name} must be an int ≥ {minimum}; {what}")
    return int(value)


def parse_harness_tasks(spec: str) -> list[str]:
    """``--tasks`` of ``fox-jax zeroshot --harness lm-eval``: names of ``HARNESS_TASKS``; ``all`` stands for the
    eight tasks of the built-in scorer (``all,wikitext2`` adds WikiText-2).

    Raises:
      ValueError: an unknown or empty task list (one line naming --tasks).
    """
    names = []
    for t in (t.strip().lower().replace("-", "_") for t in spec.split(",") if t.strip()):
        names += list(ZEROSHOT_TASKS) if t == "all" else [t]
    unknown = [n for n in names if n not in HARNESS_TASKS]
    if unknown or not names:
        raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(HARNESS_TASKS)} or 'all'")
    return list(dict.fromkeys(names))


def harness_results(out: dict, names) -> dict[str, dict[str, float]]:
    """lm-eval's ``simple_evaluate`` output -> ``{task: {"n": docs, metric: value, metric_stderr: ...}}`` in the
    keys of ``fox-jax zeroshot`` (``perplexity`` -> ``ppl``; WikiText-2: ``word_perplexity``,
    ``byte_perplexity``, ``bits_per_byte``). A stderr lm-eval did not compute is NaN."""
    results = {}
    for name in names:
        task = HARNESS_TASKS[name]
        row = {"n": int(out["n-samples"][task]["effective"])}
        for key, value in out["results"][task].items():
            metric, _, filt = key.partition(",")
            if filt != "none":
                continue
            metric = metric.replace("perplexity_stderr", "ppl_stderr") if metric.startswith("perplexity") else metric
            metric = "ppl" if metric == "perplexity" else metric
            row[metric] = float(value) if isinstance(value, (int, float)) else float("nan")
        results[name] = row
    return results


class _NoCustomDatasetHint(logging.Filter):
    """Drops lm-eval's hint, repeated for every task with a ``custom_dataset``, that ``--metadata`` passes
    kwargs to it (``fox-jax zeroshot`` passes ``eval_dir`` itself)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def cmd_zeroshot_lm_eval(args) -> int:
    """The ``fox-jax zeroshot --harness lm-eval`` handler: lm-eval's ``simple_evaluate`` with ``FoxJaxLM`` on our
    task files; prints the table of ``fox-jax zeroshot`` and writes ``zeroshot_lm_eval[_dcp].json`` (the report
    of ``fox-jax zeroshot`` plus ``harness`` and ``lm_eval_version``)."""
    from fox_jax.train.runs import open_run
    from fox_jax.train.zeroshot import resolve_eval_dir, write_report

    names = parse_harness_tasks(args.tasks)  # the count flags: checked by the parser (positive ints)
    eval_dir = resolve_eval_dir(args)
    flag, source = ("--hf-gpt2", args.hf_gpt2) if args.hf_gpt2 else ("--workdir", args.workdir)
    opened = open_run(source, step=args.step, flag=flag, step_flag="--step")  # flag-named errors before the model loads
    if args.hf_gpt2 and opened.kind != "hf-gpt2":
        raise ValueError(f"--hf-gpt2 {source} is {opened.what}, not a Hugging Face GPT-2 directory (use --workdir)")
    if args.dcp and not opened.model.dcp:
        raise ValueError(f"--dcp needs a DCP model: {source} ({opened.what}) has no DCP parameters")
    lm = FoxJaxLM(run=source, step=args.step, batch_size=args.batch_size, cache="dcp" if args.dcp else "dense",
                  max_length=args.max_length, tokenizer=args.tokenizer)
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # lm-eval's bootstrap stderr in-process: no fork under JAX
    from fox_jax.train.progress import foreign_bars
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # the table is the output; lm-eval's warnings stay
    logging.getLogger("lm_eval.api.task").addFilter(_NoCustomDatasetHint())
    with foreign_bars(not getattr(args, "no_progress", False)):  # lm-eval's bars: only on a terminal, as ours
        out = lm_eval.simple_evaluate(model=lm, tasks=[HARNESS_TASKS[n] for n in names], limit=args.limit,
                                      task_manager=task_manager(eval_dir), log_samples=False)
    cfg = lm.cfg
    desc = {"model": "gpt2" if cfg.model_type == "gpt2" else cfg.arch, "source": source,
            **({} if lm.run.step is None else {"step": lm.run.step}), "dcp": cfg.dcp, "tokenizer": lm.tokenizer_name}
    write_report(args, desc, {"max_length": lm.max_length, "limit": args.limit, "eval_dir": str(eval_dir),
                              "harness": "lm-eval", "lm_eval_version": lm_eval.__version__},
                 harness_results(out, names), stem="zeroshot_lm_eval")
    return 0


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with ``fox_jax`` registered; adds ``--include_path TASKS_DIR`` when absent."""
    from lm_eval.__main__ import cli_evaluate

    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # lm-eval's bootstrap stderr in-process: no fork under JAX
    from fox_jax.train.progress import foreign_bars
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not any(a.split("=")[0] == "--include_path" for a in argv):
        argv += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm_eval", *argv]
    with foreign_bars():  # lm-eval's bars: only on a terminal, as ours
        cli_evaluate()


__all__ = ["DTYPES", "FoxJaxLM", "HARNESS_TASKS", "TASKS_DIR", "cmd_zeroshot_lm_eval", "harness_results", "main",
           "parse_harness_tasks", "task_manager"]

if __name__ == "__main__":
    main()
