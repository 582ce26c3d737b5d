"""``fox-jax zeroshot``: zero-shot evaluation by the log-likelihood of answer choices (lm-eval style).

Every model in the library is scored through one small protocol, a **scorer**::

    scorer(tokens, lengths) -> logprobs                      or  (logprobs, greedy)
      tokens   int32 [B, T]   right-padded rows; row b holds lengths[b] real tokens, then padding
      lengths  int32 [B]      real tokens per row (0 for filler rows of the last batch)
      logprobs float  [B, T-1] log p(tokens[:, t+1] | tokens[:, :t+1]) (values on padding are ignored)
      greedy   bool   [B, T-1] tokens[:, t+1] == argmax of that prediction (needed for LAMBADA accuracy)

The model is run on ``tokens[:, :-1]`` (so T − 1 ≤ its context), exactly as lm-eval feeds
``(context + continuation)[:-1]``. Right padding is harmless because every model here is causal.
Adapter: ``ModelScorer`` (any model family: FoX / Transformer ``fox_jax.models.LanguageModel`` or
``fox_jax.models.GPT2``); it runs a DCP model (a ``fox-jax finetune-dcp`` run, with ``--dcp``) with the inference step mask α = ∞, which also measures the pair sparsity of the scored text.
Any function with the signature above works too (a fake one is used in the tests).

Tasks and prompts follow lm-evaluation-harness (the files are in ``../shared/data/eval``; see its
PROVENANCE.md):

=============  ===========================================  ==========================================
task           prompt (context → continuations)              metrics
=============  ===========================================  ==========================================
lambada        text minus its last word → " " + last word    acc (greedy: every target token is the
               (OpenAI detokenised test set, 5,153)          argmax), ppl = exp(−mean log-likelihood)
piqa           "Question: {goal}\\nAnswer:" → " " + sol1/2    acc, acc_norm
winogrande     sentence up to "_" with each option →         acc (partial scoring: the same
               " " + the rest of the sentence                continuation under two contexts)
hellaswag      "{label}: {ctx_a} {Ctx_b}" (cleaned) →        acc, acc_norm (1,000-example subset:
               " " + ending                                  not comparable to the full val set)
arc_easy,      "Question: {question}\\nAnswer:" → " " + text  acc, acc_norm (validation split)
arc_challenge
copa           premise without its "." + " because" /        acc
               " therefore" → " " + choice (first letter
               lower-cased)
boolq          "{passage}\\nQuestion: {question}?\\nAnswer:"   acc
               → " no" / " yes"
=============  ===========================================  ==========================================

acc picks the choice with the largest total log-likelihood; acc_norm divides it by the choice's length
in characters first (lm-eval's ``acc_norm``). Ties go to the first choice. ``*_stderr`` is the standard
error of the mean over examples. Contexts and continuations are tokenized like lm-eval's
``_encode_pair``: trailing spaces of the context move to the continuation, the pair is encoded as one
string and the continuation is what follows the context's tokens; an empty context becomes the
``<|endoftext|>`` token. Sequences longer than ``max_length + 1`` tokens lose context from the left.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from fox_jax.train import config as config_lib
from fox_jax.train.commands import ZEROSHOT_TASKS as TASKS
from fox_jax.train.progress import progress_bar

Scorer = Callable[[np.ndarray, np.ndarray], Any]


# ---------------------------------------------------------------------------------------------
# Examples and loaders
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Example:
    """One evaluation item: a (context, continuation) pair per choice and the index of the right one.

    Attributes:
      pairs: ``((context, continuation), ...)``, one per choice (LAMBADA: one pair, the target).
      gold: index of the correct choice (0 for LAMBADA).
      choice_texts: the choice strings whose character length ``acc_norm`` divides by (lm-eval's
        ``doc_to_choice`` outputs, without the leading delimiter).
    """

    pairs: tuple[tuple[str, str], ...]
    gold: int
    choice_texts: tuple[str, ...]


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass --eval-dir pointing at shared/data/eval")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
    return rows


def _mc(context: str, choices: Sequence[str], gold: int) -> Example:
    if not 0 <= gold < len(choices):
        raise ValueError(f"gold index {gold} outside the {len(choices)} choices")
    return Example(tuple((context, " " + c) for c in choices), int(gold), tuple(choices))


def load_lambada(eval_dir: str | Path) -> list[Example]:
    """LAMBADA (OpenAI version): ``lambada/lambada_test.jsonl`` records ``{"text"}``; the target is the
    last space-separated word. Raises FileNotFoundError / ValueError for a missing or malformed file."""
    out = []
    for row in _read_jsonl(Path(eval_dir) / "lambada" / "lambada_test.jsonl"):
        context, _, word = row["text"].rpartition(" ")
        out.append(Example(((context, " " + word),), 0, (word,)))
    return out


def load_piqa(eval_dir: str | Path) -> list[Example]:
    """PIQA validation: ``piqa/valid.jsonl`` (goal, sol1, sol2) with labels in ``piqa/valid-labels.lst``.

    Raises:
      FileNotFoundError: a file is missing. ValueError: the label file has another number of lines.
    """
    d = Path(eval_dir) / "piqa"
    rows = _read_jsonl(d / "valid.jsonl")
    labels_path = d / "valid-labels.lst"
    if not labels_path.is_file():
        raise FileNotFoundError(f"{labels_path} not found (PIQA labels)")
    labels = [int(x) for x in labels_path.read_text().split()]
    if len(labels) != len(rows):
        raise ValueError(f"{labels_path} has {len(labels)} labels for {len(rows)} PIQA examples")
    return [_mc(f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], y) for r, y in zip(rows, labels)]


def load_winogrande(eval_dir: str | Path) -> list[Example]:
    """WinoGrande (xl) validation, partial scoring: each option fills the blank in the *context*, and
    the shared continuation " " + (the sentence after "_") is scored under both."""
    out = []
    for r in _read_jsonl(Path(eval_dir) / "winogrande" / "winogrande_xl_validation.jsonl"):
        sentence = r["sentence"]
        idx = sentence.index("_")
        target = " " + sentence[idx + 1:].strip()
        contexts = [sentence[:idx] + r["option1"], sentence[:idx] + r["option2"]]
        out.append(Example(tuple((c, target) for c in contexts), {"1": 0, "2": 1}[str(r["answer"])],
                           tuple(contexts)))
    return out


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def load_hellaswag(eval_dir: str | Path) -> list[Example]:
    """HellaSwag validation subset (1,000 examples) in the official format (ctx_a, ctx_b, endings, label)."""
    out = []
    for r in _read_jsonl(Path(eval_dir) / "hellaswag" / "hellaswag_val_subset1000.jsonl"):
        ctx = r["ctx_a"] + " " + r["ctx_b"].capitalize()
        query = _hellaswag_clean(r["activity_label"] + ": " + ctx)
        out.append(_mc(query, [_hellaswag_clean(e) for e in r["endings"]], int(r["label"])))
    return out


def _load_arc(path: Path) -> list[Example]:
    out = []
    for r in _read_jsonl(path):
        labels = list(r["choices"]["label"])
        if r["answerKey"] not in labels:
            raise ValueError(f"{path}: answerKey {r['answerKey']!r} of {r.get('id')} is not among {labels}")
        out.append(_mc(f"Question: {r['question']}\nAnswer:", list(r["choices"]["text"]),
                       labels.index(r["answerKey"])))
    return out


def load_arc_easy(eval_dir: str | Path) -> list[Example]:
    """ARC-Easy validation split (570): question, choices{text,label}, answerKey."""
    return _load_arc(Path(eval_dir) / "arc_easy" / "arc_easy_validation.jsonl")


def load_arc_challenge(eval_dir: str | Path) -> list[Example]:
    """ARC-Challenge validation split (299)."""
    return _load_arc(Path(eval_dir) / "arc_challenge" / "arc_challenge_validation.jsonl")


def load_copa(eval_dir: str | Path) -> list[Example]:
    """COPA validation (100): premise, choice1/2, question ("cause"/"effect"), label."""
    out = []
    for r in _read_jsonl(Path(eval_dir) / "copa" / "copa_validation.jsonl"):
        connector = {"cause": "because", "effect": "therefore"}[r["question"]]
        context = r["premise"].strip()[:-1] + f" {connector}"
        choices = [c[0].lower() + c[1:] for c in (r["choice1"], r["choice2"])]
        out.append(_mc(context, choices, int(r["label"])))
    return out


def load_boolq(eval_dir: str | Path) -> list[Example]:
    """BoolQ validation (3,270): passage, question, answer (bool); choices " no" / " yes"."""
    return [_mc(f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:", ["no", "yes"], int(bool(r["answer"])))
            for r in _read_jsonl(Path(eval_dir) / "boolq" / "boolq_validation.jsonl")]


@dataclasses.dataclass(frozen=True)
class Task:
    """A zero-shot task: how to load it and which metrics it reports."""

    name: str
    load: Callable[[str | Path], list[Example]]
    metrics: tuple[str, ...]


TASK_REGISTRY: dict[str, Task] = {
    "lambada": Task("lambada", load_lambada, ("acc", "ppl")),
    "piqa": Task("piqa", load_piqa, ("acc", "acc_norm")),
    "winogrande": Task("winogrande", load_winogrande, ("acc",)),
    "hellaswag": Task("hellaswag", load_hellaswag, ("acc", "acc_norm")),
    "arc_easy": Task("arc_easy", load_arc_easy, ("acc", "acc_norm")),
    "arc_challenge": Task("arc_challenge", load_arc_challenge, ("acc", "acc_norm")),
    "copa": Task("copa", load_copa, ("acc",)),
    "boolq": Task("boolq", load_boolq, ("acc",)),
}


def parse_tasks(spec: str) -> list[str]:
    """``"lambada,piqa"`` or ``"all"`` -> task names.

    Raises:
      ValueError: an unknown or empty task list.
    """
    names = [t.strip().lower().replace("-", "_") for t in spec.split(",") if t.strip()]
    if names == ["all"]:
        return list(TASKS)
    unknown = [n for n in names if n not in TASK_REGISTRY]
    if unknown or not names:
        raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(TASKS)} or 'all'")
    return names


# ---------------------------------------------------------------------------------------------
# Tokenization and batched scoring
# ---------------------------------------------------------------------------------------------

def encode_pairs(tokenizer, pairs: Sequence[tuple[str, str]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids of (context, continuation) pairs, as lm-eval's ``_encode_pair``.

    Args:
      tokenizer: a ``fox_jax.train.tokenizers.Tokenizer`` (``encode_batch``, ``eot_id``).
      pairs: (context, continuation) strings.

    Returns:
      list of (context ids, continuation ids), int32 1-D arrays; an empty context is ``[eot_id]``.

    Raises:
      ValueError: a continuation that encodes to no token.
    """
    contexts, wholes = [], []
    for context, continuation in pairs:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        contexts.append(context)
        wholes.append(context + continuation)
    ctx_ids = tokenizer.encode_batch(contexts)
    whole_ids = tokenizer.encode_batch(wholes)
    out = []
    for context, ctx, whole in zip(contexts, ctx_ids, whole_ids):
        ctx = np.asarray(ctx, np.int32)
        cont = np.asarray(whole, np.int32)[len(ctx):]
        if not len(cont):
            raise ValueError(f"a continuation encodes to no token (context {context[-40:]!r})")
        if not len(ctx):
            ctx = np.asarray([tokenizer.eot_id], np.int32)
        out.append((ctx, cont))
    return out


def bucket_length(n: int, max_length: int) -> int:
    """Padded model-input length: the next power of two ≥ n (at least 16), capped at max_length."""
    return min(max(16, 1 << max(n - 1, 0).bit_length()), max_length)


def score_requests(
    scorer: Scorer,
    requests: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    batch_size: int = 8,
    max_length: int = 1024,
    pad_id: int = 0,
    progress: bool = True,
    desc: str = "scoring",
) -> tuple[np.ndarray, np.ndarray | None]:
    """Log-likelihood of each continuation given its context, in padded batches.

    Each request becomes the row ``(context + continuation)[-(max_length + 1):]`` (left truncation; a
    continuation longer than ``max_length`` tokens is scored on its last ``max_length`` tokens only,
    see ``evaluate_tasks``); rows are sorted longest first, right-padded with ``pad_id`` to a bucketed
    length (powers of two, so few shapes are compiled) and the batch is filled up to ``batch_size`` rows
    with empty rows.

    Args:
      scorer: see the module docstring.
      requests: (context ids, continuation ids) int arrays.
      batch_size: rows per scorer call.
      max_length: the model's context (input tokens per row).
      pad_id: token id used for padding (any valid id).
      progress: a tqdm bar (drawn only when stderr is a terminal).
      desc: the bar's label.

    Returns:
      (loglik [N] float64, greedy [N] bool or None when the scorer gives no greedy flags).

    Raises:
      ValueError: batch_size/max_length < 1, or a scorer output of the wrong shape.
    """
    if batch_size < 1 or max_length < 1:
        raise ValueError(f"batch_size and max_length must be positive, got {batch_size}, {max_length}")
    rows, cont_lens = [], []
    for ctx, cont in requests:
        rows.append(np.concatenate([np.asarray(ctx, np.int32), np.asarray(cont, np.int32)])[-(max_length + 1):])
        cont_lens.append(min(len(cont), max_length))  # an over-long continuation: only its last tokens
    n = len(rows)
    loglik = np.zeros(n, np.float64)
    greedy: np.ndarray | None = np.zeros(n, bool)
    order = sorted(range(n), key=lambda i: -len(rows[i]))
    with progress_bar(total=n, desc=desc, unit="req", progress=progress, leave=False) as bar:
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            t = bucket_length(max(len(rows[i]) for i in idx) - 1, max_length) + 1
            tokens = np.full((batch_size, t), pad_id, np.int32)
            lengths = np.zeros(batch_size, np.int32)
            for r, i in enumerate(idx):
                tokens[r, :len(rows[i])] = rows[i]
                lengths[r] = len(rows[i])
            out = scorer(tokens, lengths)
            lp, gr = (out if isinstance(out, tuple) else (out, None))
            lp = np.asarray(lp, np.float64)
            if lp.shape != (batch_size, t - 1):
                raise ValueError(f"the scorer returned log-probs of shape {lp.shape}, expected {(batch_size, t - 1)}")
            if gr is None:
                greedy = None
            else:
                gr = np.asarray(gr, bool)
            for r, i in enumerate(idx):
                m, k = len(rows[i]), cont_lens[i]
                # targets m-k .. m-1 are predicted at positions m-k-1 .. m-2
                loglik[i] = lp[r, m - k - 1:m - 1].sum()
                if greedy is not None:
                    greedy[i] = bool(np.all(gr[r, m - k - 1:m - 1]))
            bar.update(len(idx))
    return loglik, greedy


def _stderr(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")


def compute_metrics(task: Task, examples: Sequence[Example], loglik: np.ndarray,
                    greedy: np.ndarray | None) -> dict[str, float]:
    """Metrics of one task from per-pair log-likelihoods (flattened in example, then choice order).

    Returns:
      ``{"n": examples, metric: value, metric + "_stderr": ...}``; LAMBADA ``acc`` is NaN when the
      scorer gave no greedy flags.
    """
    out: dict[str, float] = {"n": len(examples)}
    if "ppl" in task.metrics:  # one pair per example
        correct = greedy.astype(np.float64) if greedy is not None else np.full(len(examples), np.nan)
        out["acc"], out["acc_stderr"] = float(np.mean(correct)), _stderr(correct)
        out["ppl"] = float(math.exp(-np.mean(loglik)))
        return out
    acc, acc_norm, pos = [], [], 0
    for ex in examples:
        lls = loglik[pos:pos + len(ex.pairs)]
        pos += len(ex.pairs)
        lengths = np.array([max(len(c), 1) for c in ex.choice_texts], np.float64)
        acc.append(float(np.argmax(lls) == ex.gold))
        acc_norm.append(float(np.argmax(lls / lengths) == ex.gold))
    for name, values in (("acc", acc), ("acc_norm", acc_norm)):
        if name in task.metrics:
            values = np.asarray(values)
            out[name], out[name + "_stderr"] = float(np.mean(values)), _stderr(values)
    return out


def evaluate_tasks(
    scorer: Scorer,
    tokenizer,
    tasks: Sequence[str],
    eval_dir: str | Path,
    *,
    limit: int | None = None,
    batch_size: int = 8,
    max_length: int = 1024,
    progress: bool = True,
) -> dict[str, dict[str, float]]:
    """Run zero-shot tasks with one scorer.

    Args:
      scorer: see the module docstring. If it has ``reset_stats()`` / ``stats() -> dict`` (as
        ``ModelScorer`` with DCP does), they are called around each task and the stats are added to its
        results (e.g. ``sparsity``).
      tokenizer: ``fox_jax.train.tokenizers.Tokenizer`` matching the model.
      tasks: names from ``TASKS``.
      eval_dir: the directory of the eval sets (``shared/data/eval``).
      limit: score only the first ``limit`` examples of each task (None: all).
      batch_size, max_length: see ``score_requests``.
      progress: tqdm bars (drawn only when stderr is a terminal).

    Returns:
      ``{task: {"n": ..., metric: value, ...}}``; ``truncated_continuations`` counts continuations longer
      than ``max_length`` tokens, scored on their last ``max_length`` tokens only (lm-eval refuses them).

    Raises:
      FileNotFoundError: a task's file is missing. ValueError: an unknown task or a bad limit.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be positive, got {limit}")
    results = {}
    for name in tasks:
        if name not in TASK_REGISTRY:
            raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
        task = TASK_REGISTRY[name]
        examples = task.load(eval_dir)
        if limit is not None:
            examples = examples[:limit]
        requests = encode_pairs(tokenizer, [p for ex in examples for p in ex.pairs])
        if hasattr(scorer, "reset_stats"):
            scorer.reset_stats()
        loglik, greedy = score_requests(scorer, requests, batch_size=batch_size, max_length=max_length,
                                        pad_id=tokenizer.eot_id, progress=progress, desc=name)
        results[name] = compute_metrics(task, examples, loglik, greedy)
        n_long = sum(len(cont) > max_length for _, cont in requests)
        if n_long:  # happens only for tiny contexts (e.g. a PIQA solution has 246 GPT-2 tokens)
            results[name]["truncated_continuations"] = n_long
        if hasattr(scorer, "stats"):
            results[name].update(scorer.stats())
    return results


def format_table(results: dict[str, dict[str, float]]) -> str:
    """A plain-text table: task | n | metric | value | stderr (accuracies in %), its columns as wide as their
    widest entry (a perplexity of a barely trained model can have 7 digits)."""
    rows = []
    for task, res in results.items():
        first = True
        for key, value in res.items():
            if key in ("n", "truncated_continuations") or key.endswith("_stderr") or key.startswith("sparsity_layer_"):
                continue
            pct = key.startswith("acc") or key == "sparsity"
            shown = f"{100 * value:.2f}" if pct else (f"{value:.3f}" if abs(value) < 1e6 else f"{value:.4g}")
            err = res.get(key + "_stderr")
            err_s = f"{100 * err:.2f}" if err is not None and math.isfinite(err) else ""
            rows.append((task if first else "", str(res["n"]) if first else "", key, shown, err_s))
            first = False
    head = ("task", "n", "metric", "value", "stderr")
    w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]
    fmt = lambda r: f"{r[0]:<{w[0]}} {r[1]:>{w[1]}}  {r[2]:<{w[2]}} {r[3]:>{w[3]}} {r[4]:>{w[4]}}".rstrip()  # noqa: E731
    return "\n".join([fmt(head), "-" * (sum(w) + 5)] + [fmt(r) for r in rows])


# ---------------------------------------------------------------------------------------------
# Model adapters
# ---------------------------------------------------------------------------------------------

def _next_token_scores(logits, targets):
    """log p(target) [B, T] float32 and greedy flags [B, T] from logits [B, T, V]."""
    import jax
    import jax.numpy as jnp

    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - lse, jnp.argmax(logits, axis=-1) == targets


def _dropped_pairs(log_masks, lengths):
    """DCP pair counts of right-padded rows (docs/design/dcp.md §3.2).

    Args:
      log_masks: [L, B, T, T] float32 log I of every layer (the model's ``aux["log_masks"]``).
      lengths: [B] int32 real tokens per row of the scored ``tokens`` (the inputs hold lengths − 1).

    Returns:
      (dropped [L] float32: causal pairs of real inputs whose log I is at the floor, per layer;
      pairs: float32 scalar, the number of such causal pairs per layer).
    """
    import jax.numpy as jnp

    from fox_jax.ops.context_pruning import LOG_FLOOR

    t = log_masks.shape[-1]
    valid = jnp.arange(t)[None, :] < (lengths - 1)[:, None]                  # [B, T] real inputs
    pairs = (jnp.tril(jnp.ones((t, t), bool), k=-1)[None]
             & valid[:, :, None] & valid[:, None, :])                           # [B, T, T]
    dropped = jnp.sum((log_masks <= LOG_FLOOR) & pairs[None], axis=(1, 2, 3))
    return dropped.astype(jnp.float32), jnp.sum(pairs).astype(jnp.float32)


class _Scorer:
    """A jitted ``(tokens [N, L], lengths [N]) -> (log p of each next token, greedy hit)`` scorer over a
    model's ``forward(params, inputs) -> (logits, log masks [L, N, T, T] or None)``. For DCP models
    ``stats()`` gives the pair sparsity (docs/design/dcp.md §3.2) of the text scored since the last
    ``reset_stats()``: the fraction of causal (query, key) pairs of real (non-padding) input tokens that
    the mask drops, overall (``sparsity``, mean over layers) and per layer (``sparsity_layer_{i}``)."""

    def __init__(self, forward, params, *, dcp: bool, n_layer: int):
        import jax
        import jax.numpy as jnp

        self.dcp, self.n_layer, self.params = dcp, n_layer, params

        def fn(p, tokens, lengths):
            logits, log_masks = forward(p, tokens[:, :-1])
            lp, greedy = _next_token_scores(logits, tokens[:, 1:])
            if log_masks is None:
                return lp, greedy, jnp.zeros((n_layer,), jnp.float32), jnp.zeros((), jnp.float32)
            return (lp, greedy, *_dropped_pairs(log_masks, lengths))

        self._fn = jax.jit(fn)
        self.reset_stats()

    def reset_stats(self) -> None:
        self._dropped = np.zeros(self.n_layer, np.float64)
        self._pairs = 0.0

    def stats(self) -> dict[str, float]:
        if not self.dcp:
            return {}
        per_layer = self._dropped / max(self._pairs, 1.0)
        out = {"sparsity": float(per_layer.mean())}
        out.update({f"sparsity_layer_{i}": float(v) for i, v in enumerate(per_layer)})
        return out

    def __call__(self, tokens: np.ndarray, lengths: np.ndarray):
        lp, greedy, dropped, pairs = self._fn(self.params, tokens, np.asarray(lengths, np.int32))
        self._dropped += np.asarray(dropped, np.float64)
        self._pairs += float(pairs)
        return np.asarray(lp), np.asarray(greedy)


class ModelScorer(_Scorer):
    """Scorer for the params of any fox_jax model family (``LanguageModel``: FoX / Transformer, or
    ``GPT2``): dense, or DCP (``cfg.dcp``: a ``fox-jax finetune-dcp`` model) with a fixed α (default ∞,
    the inference step mask of docs/design/dcp.md §2.5); see ``_Scorer`` for ``stats()``.

    Args:
      cfg: its ``ModelFamily`` config (``fox_jax.models.ModelConfig`` or ``GPT2Config``).
      params: the params pytree.
      alpha: α for DCP models (ignored when ``cfg.dcp`` is False).
    """

    def __init__(self, cfg, params, *, alpha: float = float("inf")):
        model = cfg.build()

        def forward(p, inputs):
            out = model.apply({"params": p}, inputs, alpha=alpha if cfg.dcp else None)
            return out.logits, (out.aux["log_masks"] if cfg.dcp else None)

        super().__init__(forward, params, dcp=cfg.dcp, n_layer=cfg.n_layers)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def default_eval_dir() -> Path:
    """``eval/`` of the shared data: ``$FOX_JAX_SHARED_DATA/eval``, else ``<checkout>/../shared/data/eval``."""
    return config_lib.shared_data_dir()[0] / "eval"


def load_scorer(args) -> tuple[Scorer, Any, int, dict]:
    """(scorer, tokenizer, max_length, description) for the model named by the CLI arguments: any run
    ``fox_jax.train.runs.open_run`` reads (``--workdir``), or a Hugging Face GPT-2 (``--hf-gpt2``).
    Without ``--dcp`` a DCP model is scored dense (its interaction parameters are not read).

    Raises:
      FileNotFoundError / ValueError: a missing directory, config or tokenizer; --dcp for a model without
        DCP; a tokenizer with more ids than the model's vocabulary; no --max-length for a model without a
        training length (an official FoX directory).
      CheckpointError: no checkpoint (for --step), or a corrupt one.
    """
    from fox_jax.models.hf_gpt2 import DCP_NAME
    from fox_jax.train.runs import open_run
    from fox_jax.train.tokenizers import load_tokenizer

    flag, source = ("--hf-gpt2", args.hf_gpt2) if args.hf_gpt2 else ("--workdir", args.workdir)
    run = open_run(source, step=args.step, flag=flag, step_flag="--step")
    if args.hf_gpt2 and run.kind != "hf-gpt2":
        raise ValueError(f"--hf-gpt2 {source} is {run.what}, not a Hugging Face GPT-2 directory (use --workdir)")
    if args.dcp and not run.model.dcp:
        why = {"hf-gpt2": f"{source} has no {DCP_NAME} (not a DCP model; drop --dcp)",
               "train": "this 'fox-jax train' LanguageModel has no DCP params (add them with 'fox-jax finetune-dcp "
                        "--from-run')"}.get(run.kind, f"{source} ({run.what}) has no DCP params; drop --dcp")
        raise ValueError(f"--dcp needs a DCP model: {why}")
    run = run if args.dcp else run.without_dcp()
    tokenizer_spec = args.tokenizer or run.tokenizer
    if tokenizer_spec is None:
        raise ValueError(f"--tokenizer is needed: {source} names none (no vocab.json + merges.txt or tokenizer.json)")
    params = run.load_params()
    scorer = ModelScorer(run.model, params)
    hard_max = run.model.max_positions  # GPT-2's n_positions; None: no limit (the run's seq_len by default)
    max_length = run.seq_len if hard_max is None else hard_max
    model_name = "gpt2" if run.model.model_type == "gpt2" else run.model.arch
    desc = {"model": model_name, "source": source, **({} if run.step is None else {"step": run.step}),
            "dcp": run.model.dcp}
    tokenizer = load_tokenizer(tokenizer_spec)
    if tokenizer.vocab_size > run.model.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only {run.model.vocab_size}; "
                         "pass the --tokenizer the model was trained with")
    if args.max_length is not None:
        if args.max_length < 1 or (hard_max is not None and args.max_length > hard_max):
            raise ValueError(f"--max-length must be in [1, {hard_max or 'inf'}] (GPT-2 n_positions), "
                             f"got {args.max_length}")
        max_length = args.max_length
    elif max_length is None:
        raise ValueError(f"--max-length is needed: {source} ({run.what}) records no training length")
    desc["tokenizer"] = tokenizer.name
    return scorer, tokenizer, max_length, desc


def resolve_eval_dir(args) -> Path:
    """``--eval-dir``, else ``default_eval_dir()``. Raises FileNotFoundError (naming --eval-dir) when absent."""
    eval_dir = Path(args.eval_dir) if args.eval_dir else default_eval_dir()
    if not eval_dir.is_dir():
        where = "" if args.eval_dir else f" ({config_lib.shared_data_dir()[1]})"
        raise FileNotFoundError(f"--eval-dir {eval_dir}{where}: no such directory (the shared/data/eval sets); pass "
                                f"--eval-dir DIR or set {config_lib.SHARED_DATA_ENV} to the shared data directory")
    return eval_dir


def write_report(args, desc: dict, report: dict, results: dict[str, dict[str, float]], *, stem: str = "zeroshot") -> Path:
    """Write ``{**desc, **report, "results": results}`` as JSON to ``--output``, else next to the run's other
    evaluations (``<workdir>/eval/<stem>[_dcp].json`` for runs with checkpoints, ``<dir>/<stem>[_dcp].json``
    for a Hugging Face directory); print the table and the path. Returns the path."""
    suffix = "_dcp" if desc["dcp"] else ""
    if args.output:
        output = Path(args.output)
    elif "step" in desc:  # a run with checkpoints: next to its other evaluations
        output = Path(desc["source"]) / "eval" / f"{stem}{suffix}.json"
    else:  # a Hugging Face directory
        output = Path(desc["source"]) / f"{stem}{suffix}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({**desc, **report, "results": results}, indent=2) + "\n")
    print(format_table(results))
    print(f"wrote {output}")
    sys.stdout.flush()
    return output


def cmd_zeroshot(args) -> int:
    """The ``fox-jax zeroshot`` handler (``--harness fox-jax``, the default): print a table and write the JSON
    report. ``--harness lm-eval`` runs ``fox_jax.train.lm_eval_model.cmd_zeroshot_lm_eval`` instead."""
    tasks = parse_tasks(args.tasks)  # --batch-size, --limit, --max-length: checked by the parser (positive ints)
    eval_dir = resolve_eval_dir(args)
    scorer, tokenizer, max_length, desc = load_scorer(args)
    results = evaluate_tasks(scorer, tokenizer, tasks, eval_dir, limit=args.limit, batch_size=args.batch_size,
                             max_length=max_length, progress=not args.no_progress)
    write_report(args, desc, {"max_length": max_length, "limit": args.limit, "eval_dir": str(eval_dir)}, results)
    return 0
