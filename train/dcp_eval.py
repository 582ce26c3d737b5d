"""``fox-jax dcp-eval``: the Dynamic Context Pruning evaluation (docs/design/dcp.md §3.2, §4, §6).

For a dense base GPT-2 and one or more DCP fine-tuned runs (``fox-jax finetune-dcp`` run directories, or
HF directories with ``dcp_interaction.safetensors``), on the **same validation windows** (the first
``num_batches × batch_size`` windows of the validation stream, ``fox_jax.train.data.make_val_batches``):

1. **Perplexity vs sparsity.** Validation loss / perplexity and pair sparsity (fraction of causal
   (query, key) pairs dropped, docs/design/dcp.md §3.2; overall = mean over layers, and per layer) of the dense
   model and of every DCP run, with the inference step mask α = ∞ (``finetune_dcp.evaluate_at_inf``:
   the fine-tuning run's own validation). For every DCP run, the dense model
   with a **fixed local-window**, a **fixed strided** and a **sinks + window** pattern
   (``GPT2Config.sparse_pattern``) at the matched sparsity (``match_sparse_pattern``: the window/stride whose
   exact sparsity at length T is closest to the run's measured sparsity), plus a grid of extra sparsities
   (``--curve-sparsities``) to draw the baseline curves. These baselines are the dense base model with the
   pattern applied at inference, **not fine-tuned** with it. The paper's fine-tuned baselines are
   ``--controls``: 'fox-jax train' runs fine-tuned with their own ``model.sparse_pattern`` (or dense: the
   dense fine-tuning control), each scored under its own pattern on the same windows.
   Windows that span two documents use ``segment_ids`` (no attention across documents) for every model,
   and sparsity counts only pairs inside one document, so a baseline's measured sparsity can differ
   slightly from its nominal (single-sequence) value; both are reported.
2. **Which tokens each layer drops** (§6), for a sample text (the first validation document, or
   ``--text``): per-layer T×T step-mask images, a per-layer token-level view (for each token, the fraction
   of later queries for which it is dropped) with the tokens dropped most/earliest, and the drop rate by
   token class (``token_class``: special / whitespace / punctuation / stopword / other).
3. **Context switch** (§6): three unrelated passages (three validation documents, each ~T/3 tokens from
   the middle of the document, concatenated without separators, positions 0..T−1, no segment ids);
   per-layer step masks with the passage boundaries, and ``block_diagonality``: the fraction of
   cross-passage causal pairs (query in passage p, key in an earlier passage) dropped vs the fraction of
   within-passage pairs dropped. A block-diagonal mask drops (nearly) all cross pairs.

Outputs in ``--out``::

    dcp_eval.json           config, per model: val_loss, ppl, sparsity, sparsity_layers; per DCP run the
                            matched local/strided/sinks baselines; per control (--controls) its
                            scores under its own pattern; the baseline curves
    dcp_eval.md             the markdown tables (also printed)
    ppl_vs_sparsity.png     dense, DCP points, fine-tuned controls, local/strided/sinks curves
    drops_<run>.png         per-layer step masks of the sample text (kept / dropped / not causal)
    drop_tokens_<run>.png   per-layer drop fraction per token, drop rate by class, most-dropped tokens
    drops.json              per run and layer: sparsity, drop rate by token class, most-dropped tokens
    context_switch_<run>.png  per-layer step masks of the 3-passage sequence with boundaries, scores
    context_switch.json     per run and layer: cross / within drop fractions, 3×3 passage matrix

Usage::

    fox-jax dcp-eval --dense HF_GPT2_DIR --runs RUN_DIR [RUN_DIR ...] --val-data VAL.txt \\
        --tokenizer TOKENIZER_DIR --seq-len 1024 --num-batches 8 --out OUT_DIR
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import string
import unicodedata
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from fox_jax.models.gpt2 import GPT2Config, SPARSE_PATTERNS, match_sparse_pattern, sparse_pattern_log_mask
from fox_jax.models.hf_gpt2 import DCP_NAME
from fox_jax.ops.context_pruning import LOG_FLOOR, sparsity
from fox_jax.train import data as data_lib
from fox_jax.train import finetune_dcp
from fox_jax.train.commands import DEFAULT_CURVE_SPARSITIES
from fox_jax.train.config import DataConfig
from fox_jax.train.progress import progress_bar
from fox_jax.train.runs import Run, open_run
from fox_jax.train.tokenizers import load_tokenizer

TOKEN_CLASSES = ("special", "whitespace", "punctuation", "stopword", "other")

# English function words ("stopword-like" tokens): articles, pronouns, auxiliaries, prepositions,
# conjunctions and a few frequent adverbs. Deliberately small and fixed so the statistic is reproducible.
STOPWORDS = frozenset("""
a an the this that these those
i me my mine we us our ours you your yours he him his she her hers it its they them their theirs
who whom whose which what
am is are was were be been being have has had having do does did done shall will would should can could
may might must
of in on at by for with about against between into through during before after above below to from up
down out off over under again further
and but or nor so yet if then than because as until while
not no only very too also just there here when where why how all any both each few more most other some
such own same
""".split())


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class EvalModel:
    """A model to evaluate.

    Attributes:
      label: short unique name (file names, table rows).
      path: where it was loaded from.
      cfg: its ``GPT2Config`` (``dcp`` True for DCP runs).
      params: float32 params pytree.
      info: extra facts for the report (``kind``: "dense" / "dcp"; ``gamma``, ``gamma_normalization``,
        ``steps`` of a finetune-dcp run when known).
    """

    label: str
    path: str
    cfg: GPT2Config
    params: Any
    info: dict


def _is_finetune_run(path: str) -> bool:
    try:
        return open_run(path).kind == "finetune"
    except (FileNotFoundError, ValueError):
        return False


def _run_info(run: Run) -> dict:
    """γ and friends of a finetune-dcp run (empty for other kinds)."""
    if run.kind != "finetune" or run.config.dcp is None:
        return {}
    ft = run.config
    return {"gamma": ft.dcp.gamma, "gamma_normalization": ft.dcp.gamma_normalization, "steps": ft.steps,
            "seq_len": run.seq_len, "tokenizer": run.tokenizer}


def _gpt2_run(path: str, flag: str) -> Run:
    """A dense GPT-2 model: a HF GPT-2 directory (DCP parameters, if any, are not read) or a 'fox-jax train'
    run of the GPT-2 family (its latest checkpoint)."""
    run = open_run(path, flag=flag)
    if run.kind == "hf-gpt2":
        return run.without_dcp()
    if run.kind == "train" and run.model.model_type == "gpt2" and not run.model.dcp:
        return run
    raise ValueError(f"{flag} {path} is {run.what}; expected a HF GPT-2 directory or a 'fox-jax train' run of "
                     "GPT-2 (--preset gpt2)")


def load_dense(path: str, *, dtype: str = "float32") -> EvalModel:
    """The dense base model: a HF GPT-2 directory (DCP parameters, if any, are not read) or a 'fox-jax train'
    GPT-2 run (latest checkpoint; a ``sparse_pattern`` in its config is dropped: the base is scored dense).

    Raises:
      FileNotFoundError: ``--dense`` is no directory, or one without config.json / weights.
      ValueError: another kind of run.
    """
    run = _gpt2_run(path, "--dense")
    cfg = run.model.replace(dtype=dtype, sparse_pattern=None)
    return EvalModel("dense", run.path, cfg, run.load_params(), {"kind": "dense", "step": run.step})


def load_control(path: str, *, dtype: str = "float32") -> EvalModel:
    """A fine-tuned comparison model (``--controls``): a GPT-2 fine-tuned dense (the dense control) or with a
    fixed ``sparse_pattern`` (the paper's fine-tuned local / strided / sinks baselines), scored under its own
    pattern: a 'fox-jax train' run (pattern from its config.json) or a HF GPT-2 directory (dense).

    Raises:
      FileNotFoundError: no such directory, or no run in it.
      ValueError: not a dense GPT-2 run (e.g. a DCP run: pass it with --runs).
    """
    run = _gpt2_run(path, "--controls")
    pattern = run.model.sparse_pattern
    info = {"kind": "pattern" if pattern else "dense-ft", "pattern": pattern, "step": run.step}
    return EvalModel(os.path.basename(os.path.normpath(run.path)), os.path.abspath(path),
                     run.model.replace(dtype=dtype), run.load_params(), info)


def load_run(path: str, *, dtype: str = "float32") -> EvalModel:
    """A DCP model from a finetune-dcp run directory (its ``hf/`` export, else its latest checkpoint) or from
    a HF directory holding ``dcp_interaction.safetensors``.

    Raises:
      FileNotFoundError: no such directory, or no run in it.
      ValueError: neither a GPT-2 finetune-dcp run nor a HF directory with DCP parameters.
    """
    run = open_run(path, flag="--runs")
    name = os.path.basename(run.path)
    info = _run_info(run)
    if run.kind == "finetune":
        if run.model.model_type != "gpt2":
            raise ValueError(f"--runs {run.path}: a DCP fine-tuning of a FoX/Transformer run (--from-run); dcp-eval "
                             "compares GPT-2 models against their fixed-pattern baselines only — score it with "
                             "'fox-jax zeroshot --workdir RUN --dcp' or its own validation in metrics.jsonl")
        hf_sub = os.path.join(run.path, "hf")
        if os.path.isfile(os.path.join(hf_sub, DCP_NAME)):  # the export, when there is one
            run = open_run(hf_sub, flag="--runs")
            info["source"] = "hf"
        else:
            info.update(source="checkpoint", step=run.step)
    elif run.kind == "hf-gpt2":
        if not run.model.dcp:
            raise ValueError(f"--runs {run.path}: a HF GPT-2 directory without {DCP_NAME} is not a DCP model "
                             "(pass dense models with --dense)")
        parent = os.path.dirname(run.path)
        if name == "hf" and _is_finetune_run(parent):  # a finetune-dcp run's export
            name, info = os.path.basename(parent), _run_info(open_run(parent, flag="--runs"))
        info["source"] = "hf"
    else:
        raise ValueError(f"--runs {run.path} is {run.what}; expected a 'fox-jax finetune-dcp' run directory "
                         f"(config.json with a dcp section) or a HF GPT-2 directory with {DCP_NAME}")
    info["kind"] = "dcp"
    return EvalModel(name, os.path.abspath(path), run.model.replace(dtype=dtype), run.load_params(), info)


def _unique_labels(models: Sequence[EvalModel]) -> None:
    seen: dict[str, int] = {}
    for m in models:
        n = seen.get(m.label, 0)
        seen[m.label] = n + 1
        if n:
            m.label = f"{m.label}_{n + 1}"


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"


def _display(m: EvalModel) -> str:
    g = m.info.get("gamma")
    return f"{m.label} (γ={g:g})" if g is not None else m.label


# ---------------------------------------------------------------------------------------------
# Perplexity and sparsity on the validation windows
# ---------------------------------------------------------------------------------------------

def pattern_sparsity_on_batches(pattern: str, batches: Sequence[dict]) -> float:
    """Measured sparsity of a fixed pattern on packed validation batches (docs/design/dcp.md §3.2).

    The pattern mask does not depend on the weights, so this is ``context_pruning.sparsity`` of
    ``sparse_pattern_log_mask`` with each batch's ``segment_ids`` (only pairs inside one document count),
    averaged over batches like ``finetune_dcp.evaluate_at_inf`` averages a DCP model's sparsity.

    Returns:
      float in [0, 1].
    """
    values = []
    for batch in batches:
        seg = jnp.asarray(batch["segment_ids"])
        b, t = seg.shape
        log_mask = jnp.broadcast_to(sparse_pattern_log_mask(pattern, t)[None], (b, t, t))
        values.append(float(sparsity(log_mask, segment_ids=seg)[1]))
    return float(np.mean(values))


def evaluate_model(cfg: GPT2Config, params, batches: Sequence[dict], *, desc: str = "eval",
                   progress: bool = True) -> dict:
    """Validation loss, perplexity and pair sparsity of one model (DCP: step mask α = ∞), with
    ``finetune_dcp.evaluate_at_inf`` (fixed patterns: ``pattern_sparsity_on_batches``).

    Args:
      cfg: the model config (dense, DCP, or dense with ``sparse_pattern``).
      params: its params.
      batches: ``fox_jax.train.data.make_val_batches`` output (int32 [B, T] inputs/targets/positions/segment_ids).
      desc, progress: the progress bar.

    Returns:
      ``{"val_loss": nats/token, "ppl": exp(val_loss), "sparsity": mean over layers,
      "sparsity_layers": [L]}`` (sparsity in [0, 1]; 0 for a dense model).
    """
    val = finetune_dcp.evaluate_at_inf(cfg, params,
                                       progress_bar(batches, desc=desc, unit="batch", leave=False, progress=progress))
    out = {"val_loss": val["val_loss"], "ppl": val["val_ppl"], "sparsity": val["val_sparsity"],
           "sparsity_layers": [val[f"val_sparsity_layer_{i}"] for i in range(cfg.n_layers)]}
    if cfg.sparse_pattern is not None:  # the same fixed mask in every layer
        sp = pattern_sparsity_on_batches(cfg.sparse_pattern, batches)
        out.update(sparsity=sp, sparsity_layers=[sp] * cfg.n_layers)
    return out


# ---------------------------------------------------------------------------------------------
# Step masks, token classes, drop statistics
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _log_masks_fn(cfg: GPT2Config):
    model = cfg.build()
    return jax.jit(lambda p, x: model.apply({"params": p}, x, alpha=float("inf")).aux["log_masks"])


def step_masks(cfg: GPT2Config, params, tokens: np.ndarray) -> np.ndarray:
    """Which causal pairs each layer of a DCP model drops for one sequence (step mask α = ∞, §2.5).

    Args:
      cfg: a DCP ``GPT2Config``.
      params: its params.
      tokens: [T] int token ids, 2 ≤ T ≤ n_positions (positions 0..T−1, one document).

    Returns:
      [L, T, T] bool, ``dropped[l, k, j]`` True iff query k no longer sees key j in layer l (j < k only;
      False on and above the diagonal).

    Raises:
      ValueError: not a DCP config, tokens not 1-D or of a bad length.
    """
    if not cfg.dcp:
        raise ValueError("step_masks needs a DCP model (cfg.dcp=True)")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not 2 <= len(tokens) <= cfg.n_positions:
        raise ValueError(f"tokens must be [T] with 2 <= T <= n_positions={cfg.n_positions}, got shape {tokens.shape}")
    log_masks = np.asarray(_log_masks_fn(cfg.with_remat("none"))(params, jnp.asarray(tokens[None].astype(np.int32))))
    log_masks = log_masks[:, 0]
    t = len(tokens)
    return (log_masks <= LOG_FLOOR) & np.tril(np.ones((t, t), bool), k=-1)[None]


def token_class(text: str, *, special: bool = False) -> str:
    """The class of one decoded token for the drop statistics.

    ``special``: a special token (``<|endoftext|>``); ``whitespace``: only whitespace (newlines, spaces);
    ``punctuation``: after stripping whitespace, only Unicode punctuation (P*) or symbol (S*) characters;
    ``stopword``: after stripping whitespace and lower-casing, in ``STOPWORDS``; ``other``: the rest
    (content words and word pieces).
    """
    if special:
        return "special"
    s = text.strip()
    if not s:
        return "whitespace"
    if all(c in string.punctuation or unicodedata.category(c)[0] in "PS" for c in s):
        return "punctuation"
    if s.lower() in STOPWORDS:
        return "stopword"
    return "other"


def drop_statistics(dropped: np.ndarray, token_texts: Sequence[str], classes: Sequence[str], *,
                    top: int = 15) -> dict:
    """Per-layer statistics of a step mask (docs/design/dcp.md §6).

    Args:
      dropped: [L, T, T] bool from ``step_masks`` (query k, key j).
      token_texts: T decoded tokens.
      classes: T token classes (``token_class``).
      top: how many most-dropped tokens to list per layer.

    Returns:
      dict with, per layer (lists of length L): ``sparsity`` (fraction of causal pairs dropped);
      ``drop_fraction`` [L][T] (for key j, the fraction of later queries k > j that do not see it; None for
      the last token); ``lifetime`` [L][T] (first dropping query minus j, None if never dropped);
      ``class_drop_rate`` {class: [L]} (dropped causal pairs whose key has that class / such pairs; None
      when the class is absent); ``class_token_count`` {class: n}; ``most_dropped`` [L] lists of
      {pos, text, class, drop_fraction, lifetime}, sorted by drop fraction (desc), then lifetime (asc).

    Raises:
      ValueError: mismatched lengths.
    """
    dropped = np.asarray(dropped, bool)
    if dropped.ndim != 3 or dropped.shape[1] != dropped.shape[2]:
        raise ValueError(f"dropped must be [L, T, T] bool, got {dropped.shape}")
    n_layer, t, _ = dropped.shape
    if len(token_texts) != t or len(classes) != t:
        raise ValueError(f"token_texts and classes must have T={t} entries, got {len(token_texts)}, {len(classes)}")
    later = (t - 1 - np.arange(t)).astype(np.float64)                      # queries after key j
    n_drop = dropped.sum(axis=1).astype(np.float64)                         # [L, T] over queries
    frac = np.where(later > 0, n_drop / np.maximum(later, 1), np.nan)
    any_drop = dropped.any(axis=1)
    first = np.where(any_drop, np.argmax(dropped, axis=1), -1)              # [L, T] first dropping query
    lifetime = np.where(any_drop, first - np.arange(t)[None], -1)
    pairs = max(t * (t - 1) // 2, 1)
    cls = np.asarray(classes)
    out: dict[str, Any] = {
        "seq_len": t,
        "sparsity": [float(dropped[i].sum() / pairs) for i in range(n_layer)],
        "drop_fraction": [[None if np.isnan(v) else round(float(v), 6) for v in row] for row in frac],
        "lifetime": [[None if v < 0 else int(v) for v in row] for row in lifetime],
        "class_token_count": {c: int(np.sum(cls == c)) for c in TOKEN_CLASSES},
        "class_drop_rate": {},
        "most_dropped": [],
    }
    for c in TOKEN_CLASSES:
        sel = cls == c
        n_pairs = float(np.sum(later[sel]))
        out["class_drop_rate"][c] = ([float(n_drop[i][sel].sum() / n_pairs) for i in range(n_layer)]
                                     if n_pairs else None)
    for i in range(n_layer):
        cand = [j for j in range(t - 1) if n_drop[i, j] > 0]
        cand.sort(key=lambda j: (-frac[i, j], lifetime[i, j], j))
        out["most_dropped"].append([{"pos": j, "text": token_texts[j], "class": classes[j],
                                     "drop_fraction": round(float(frac[i, j]), 4), "lifetime": int(lifetime[i, j])}
                                    for j in cand[:top]])
    return out


def block_diagonality(dropped: np.ndarray, boundaries: Sequence[int]) -> dict:
    """How block-diagonal a step mask is, for a sequence of concatenated passages (context switch, §6).

    Passage p covers positions [boundaries[p], boundaries[p+1]) (the last one runs to T). A causal pair
    (query k, key j < k) is **cross** when j lies in an earlier passage than k, **within** when both lie in
    the same passage.

    Args:
      dropped: [L, T, T] or [T, T] bool (query k, key j), True = dropped.
      boundaries: passage start positions, strictly increasing, starting at 0, all < T.

    Returns:
      dict of per-layer lists (length L; plain floats for a [T, T] input): ``cross_dropped`` (fraction of
      cross pairs dropped, None without cross pairs), ``within_dropped`` (fraction of within pairs
      dropped), ``score`` = cross_dropped − within_dropped (1 for a perfectly block-diagonal mask that
      drops nothing inside passages, 0 when the mask ignores passages), ``passage_matrix`` [P][P] (fraction
      of causal pairs dropped with the query in passage p and the key in passage q ≤ p; None for q > p),
      ``alive_at_end`` [P] (fraction of passage q's tokens still visible to the last query), and
      ``n_cross_pairs`` / ``n_within_pairs``.

    Raises:
      ValueError: bad shapes or boundaries.
    """
    d = np.asarray(dropped, bool)
    single = d.ndim == 2
    if single:
        d = d[None]
    if d.ndim != 3 or d.shape[1] != d.shape[2]:
        raise ValueError(f"dropped must be [L, T, T] or [T, T], got {np.shape(dropped)}")
    t = d.shape[1]
    b = [int(x) for x in boundaries]
    if not b or b[0] != 0 or any(y <= x for x, y in zip(b, b[1:])) or b[-1] >= t:
        raise ValueError(f"boundaries must start at 0, increase strictly and stay below T={t}, got {list(boundaries)}")
    pid = np.searchsorted(np.asarray(b), np.arange(t), side="right") - 1     # passage of each position
    causal = np.tril(np.ones((t, t), bool), k=-1)
    cross = causal & (pid[None, :] < pid[:, None])
    within = causal & (pid[None, :] == pid[:, None])
    n_p = len(b)

    def frac(mask):
        n = mask.sum()
        return [float((d[i] & mask).sum() / n) if n else None for i in range(d.shape[0])]

    cross_f, within_f = frac(cross), frac(within)
    matrix = []
    for i in range(d.shape[0]):
        rows = []
        for p in range(n_p):
            row = []
            for q in range(n_p):
                m = causal & (pid[:, None] == p) & (pid[None, :] == q)
                row.append(float((d[i] & m).sum() / m.sum()) if q <= p and m.sum() else None)
            rows.append(row)
        matrix.append(rows)
    alive = [[float(1.0 - d[i, t - 1, pid == q].mean()) for q in range(n_p)] for i in range(d.shape[0])]
    score = [None if c is None or w is None else c - w for c, w in zip(cross_f, within_f)]
    out = {"cross_dropped": cross_f, "within_dropped": within_f, "score": score, "passage_matrix": matrix,
           "alive_at_end": alive, "n_cross_pairs": int(cross.sum()), "n_within_pairs": int(within.sum()),
           "boundaries": b}
    if single:
        for k in ("cross_dropped", "within_dropped", "score", "passage_matrix", "alive_at_end"):
            out[k] = out[k][0]
    return out


# ---------------------------------------------------------------------------------------------
# Sample texts
# ---------------------------------------------------------------------------------------------

def sample_tokens(corpus: data_lib.Corpus, seq_len: int, text_file: str | None = None) -> np.ndarray:
    """The drop-plot text: ``[eot] + text`` of ``text_file`` (or the first validation document), first
    ``seq_len`` tokens.

    Raises:
      FileNotFoundError: ``text_file`` missing. ValueError: fewer than 2 tokens.
    """
    eot = corpus.tokenizer.eot_id
    if text_file:
        if not os.path.isfile(text_file):
            raise FileNotFoundError(f"--text {text_file}: no such file")
        with open(text_file, encoding="utf-8") as f:
            ids = corpus.tokenizer.encode_batch([f.read()])[0]
        tokens = np.concatenate([[eot], ids])[:seq_len]
    else:
        w = data_lib.document_windows(corpus, 1)
        tokens = w["inputs"][0][w["segment_ids"][0] == 1]
    if len(tokens) < 2:
        raise ValueError(f"the sample text has {len(tokens)} token(s); need at least 2 (--text)")
    return tokens.astype(np.int32)


def context_switch_tokens(corpus: data_lib.Corpus, seq_len: int,
                          n_passages: int = 3) -> tuple[np.ndarray, list[int]]:
    """``n_passages`` unrelated passages concatenated: validation documents 0, 1, 2, … (those long enough), each
    contributing ~T/n tokens from the **middle** of the document (past title pages and credits), without
    separators.

    Returns:
      (tokens [T] int32 with T = seq_len, passage start positions [n_passages]).

    Raises:
      ValueError: fewer than ``n_passages`` validation documents with enough tokens, or seq_len < 2·n_passages.
    """
    if seq_len < 2 * n_passages:
        raise ValueError(f"seq_len must be >= {2 * n_passages} for {n_passages} passages, got {seq_len}")
    val, eot = corpus.val_tokens, corpus.tokenizer.eot_id
    starts = data_lib.doc_starts(val, eot)
    ends = np.append(starts[1:], len(val))
    lengths = [seq_len // n_passages] * (n_passages - 1)
    lengths.append(seq_len - sum(lengths))
    need = max(lengths)
    docs = []
    for s, e in zip(starts, ends):
        doc = val[s + 1 if val[s] == eot else s:e]
        if len(doc) >= need:
            docs.append(doc)
        if len(docs) == n_passages:
            break
    if len(docs) < n_passages:
        raise ValueError(f"the context-switch experiment needs {n_passages} validation documents of at least {need} "
                         f"tokens, found {len(docs)}; pass more --val-data or a smaller --seq-len")
    parts, bounds, pos = [], [], 0
    for doc, n in zip(docs, lengths):
        off = (len(doc) - n) // 2
        parts.append(doc[off:off + n])
        bounds.append(pos)
        pos += n
    return np.concatenate(parts).astype(np.int32), bounds


def _token_texts(tokenizer, tokens: np.ndarray) -> tuple[list[str], list[str]]:
    texts = [tokenizer.decode([int(x)]) for x in tokens]
    classes = [token_class(s, special=int(x) == tokenizer.eot_id) for s, x in zip(texts, tokens)]
    return texts, classes


# ---------------------------------------------------------------------------------------------
# Plots (matplotlib Figure objects, Agg rendering; no pyplot global state)
# ---------------------------------------------------------------------------------------------

_MASK_COLORS = ("#e9e9e9", "#1f3b73", "#f4a261")  # not causal, kept, dropped


def _figure(**kw):
    from matplotlib.figure import Figure

    return Figure(**kw)


def _mask_image(ax, dropped_layer: np.ndarray) -> None:
    from matplotlib.colors import ListedColormap

    t = dropped_layer.shape[0]
    img = np.where(np.tril(np.ones((t, t), bool)), np.where(dropped_layer, 2, 1), 0)
    ax.imshow(img, cmap=ListedColormap(_MASK_COLORS), vmin=0, vmax=2, interpolation="nearest")
    ax.set_xlabel("key position", fontsize=7)
    ax.set_ylabel("query position", fontsize=7)
    ax.tick_params(labelsize=6)


def _grid(n: int, extra: int = 0) -> tuple[int, int]:
    ncols = min(n + extra, 4)
    return -(-(n + extra) // ncols), ncols


def _mask_legend(fig) -> None:
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=c, label=l) for c, l in zip(_MASK_COLORS, ("not causal", "kept", "dropped"))],
               loc="outside lower center", ncol=3, fontsize=8)


def plot_step_masks(dropped: np.ndarray, path: str, *, title: str, boundaries: Sequence[int] | None = None,
                    scores: dict | None = None) -> None:
    """Per-layer T×T step-mask images (kept / dropped / not causal), optional passage boundaries and a
    cross-vs-within bar panel (``scores`` from ``block_diagonality``). Writes a PNG."""
    n_layer, t, _ = dropped.shape
    extra = 1 if scores is not None else 0
    nrows, ncols = _grid(n_layer, extra)
    fig = _figure(figsize=(3.2 * ncols, 3.2 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    pairs = max(t * (t - 1) // 2, 1)
    for i in range(n_layer):
        ax = axes[i]
        _mask_image(ax, dropped[i])
        sub = f"layer {i}: {100 * dropped[i].sum() / pairs:.1f}% dropped"
        if scores is not None and scores["cross_dropped"][i] is not None:
            sub += f"\ncross {100 * scores['cross_dropped'][i]:.0f}% / within {100 * scores['within_dropped'][i]:.0f}%"
        ax.set_title(sub, fontsize=8)
        for bnd in boundaries or ():
            if bnd > 0:
                ax.axhline(bnd - 0.5, color="red", lw=0.8, ls="--")
                ax.axvline(bnd - 0.5, color="red", lw=0.8, ls="--")
    if scores is not None:
        ax = axes[n_layer]
        x = np.arange(n_layer)
        cross = [np.nan if v is None else 100 * v for v in scores["cross_dropped"]]
        within = [np.nan if v is None else 100 * v for v in scores["within_dropped"]]
        ax.bar(x - 0.2, cross, 0.4, label="cross-passage", color="#c0392b")
        ax.bar(x + 0.2, within, 0.4, label="within-passage", color="#2e86c1")
        ax.set_xticks(x)
        ax.set_xlabel("layer", fontsize=7)
        ax.set_ylabel("% of causal pairs dropped", fontsize=7)
        ax.set_ylim(0, 100)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=6)
        ax.set_title("block-diagonality", fontsize=8)
    for ax in axes[n_layer + extra:]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    _mask_legend(fig)
    fig.savefig(path, dpi=110)


def plot_drop_tokens(stats: dict, tokens_text: Sequence[str], path: str, *, title: str, n_show: int = 8) -> None:
    """Token-level view: [L, T] heatmap of each token's drop fraction, drop rate by token class per layer,
    and the most-dropped tokens of every layer with their text. Writes a PNG."""
    frac = np.array([[np.nan if v is None else v for v in row] for row in stats["drop_fraction"]], float)
    n_layer, t = frac.shape
    fig = _figure(figsize=(12, 4.5 + 0.28 * n_layer + 0.18 * n_layer), layout="constrained")
    gs = fig.add_gridspec(3, 1, height_ratios=(1.2 + 0.08 * n_layer, 1.3, 0.35 + 0.16 * n_layer))
    ax = fig.add_subplot(gs[0])
    im = ax.imshow(frac, aspect="auto", cmap="magma_r", vmin=0, vmax=1, interpolation="nearest")
    fig.colorbar(im, ax=ax, label="fraction of later queries\nthat dropped the token", shrink=0.9)
    ax.set_ylabel("layer")
    ax.set_yticks(np.arange(n_layer))
    ax.set_xlabel("token position")
    if t <= 96:
        ax.set_xticks(np.arange(t))
        ax.set_xticklabels([repr(s)[1:-1] for s in tokens_text], rotation=90, fontsize=5)
    ax.set_title("per-token drop fraction", fontsize=9)

    ax = fig.add_subplot(gs[1])
    x = np.arange(n_layer)
    present = [c for c in TOKEN_CLASSES if stats["class_drop_rate"][c] is not None]
    width = 0.8 / max(len(present), 1)
    for n, c in enumerate(present):
        ax.bar(x + (n - (len(present) - 1) / 2) * width, [100 * v for v in stats["class_drop_rate"][c]], width,
               label=f"{c} ({stats['class_token_count'][c]} tokens)")
    ax.set_xticks(x)
    ax.set_xlabel("layer")
    ax.set_ylabel("% of (query, key) pairs dropped")
    ax.set_ylim(0, 120)
    ax.set_yticks([0, 25, 50, 75, 100])
    ax.legend(fontsize=7, ncol=min(len(present), 5), loc="upper center")
    ax.set_title("drop rate by key token class", fontsize=9)

    ax = fig.add_subplot(gs[2])
    ax.axis("off")
    lines = []
    for i, items in enumerate(stats["most_dropped"]):
        shown = "  ".join(f"{repr(d['text'])}@{d['pos']}:{d['drop_fraction']:.2f}" for d in items[:n_show])
        lines.append(f"L{i:<2} {shown or '(none dropped)'}")
    ax.text(0, 1, "most dropped tokens (text@position: drop fraction), earliest first on ties\n" + "\n".join(lines),
            va="top", ha="left", family="monospace", fontsize=6.5, transform=ax.transAxes)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)


def plot_ppl_vs_sparsity(report: dict, path: str) -> None:
    """Perplexity (log scale) vs sparsity (%): dense, the DCP runs, the fine-tuned controls, the fixed-pattern curves. Writes a PNG."""
    fig = _figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    dense = report["dense"]
    ax.axhline(dense["ppl"], color="gray", ls=":", lw=1)
    ax.plot([0.0], [dense["ppl"]], "k*", ms=12, label=f"dense ({dense['ppl']:.2f})")
    styles = {"local": ("#2e86c1", "o"), "strided": ("#27ae60", "s"), "sinks": ("#8e44ad", "^")}
    for kind in SPARSE_PATTERNS:
        pts = [(0.0, dense["ppl"])] + [(100 * p["sparsity"], p["ppl"]) for p in report["curves"][kind]]
        pts.sort()
        color, marker = styles[kind]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, ms=4, lw=1.2,
                label=f"{kind} (fixed, dense weights)")
    for run in report["dcp"]:
        ax.plot([100 * run["sparsity"]], [run["ppl"]], "D", color="#c0392b", ms=8)
        ax.annotate(run["display"], (100 * run["sparsity"], run["ppl"]), textcoords="offset points",
                    xytext=(5, 5), fontsize=7)
    ax.plot([], [], "D", color="#c0392b", label="DCP (α=∞)")
    for run in report.get("controls", ()):
        kind = (run["info"]["pattern"] or "dense").split(":")[0]
        color, marker = styles.get(kind, ("k", "*"))
        ax.plot([100 * run["sparsity"]], [run["ppl"]], marker, color=color, ms=11, mfc="none", mew=2)
        ax.annotate(run["label"], (100 * run["sparsity"], run["ppl"]), textcoords="offset points", xytext=(5, -10),
                    fontsize=7)
    if report.get("controls"):
        ax.plot([], [], "o", color="gray", ms=9, mfc="none", mew=2, label="fine-tuned with its pattern (hollow)")
    ppls = [dense["ppl"]] + [r["ppl"] for r in report["dcp"]] + [p["ppl"] for k in SPARSE_PATTERNS
                                                                 for p in report["curves"][k]]
    ppls += [r["ppl"] for r in report.get("controls", ())]
    if max(ppls) / min(ppls) > 3:  # log scale only when the range calls for it
        from matplotlib.ticker import ScalarFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("sparsity: % of causal (query, key) pairs dropped")
    ax.set_ylabel("validation perplexity")
    ax.set_xlim(-2, 100)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    cfg = report["config"]
    ax.set_title(f"perplexity vs sparsity (T={cfg['seq_len']}, {cfg['tokens']:,} target tokens)", fontsize=10)
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

def format_tables(report: dict) -> str:
    """The markdown tables: every evaluated model, the matched comparison, per-layer DCP sparsity."""
    dense_ppl = report["dense"]["ppl"]

    def row(name, kind, setting, r, nominal=None):
        nom = "" if nominal is None else f" ({100 * nominal:.1f})"
        return (f"| {name} | {kind} | {setting} | {100 * r['sparsity']:.1f}{nom} | {r['val_loss']:.4f} | "
                f"{r['ppl']:.2f} | {r['ppl'] - dense_ppl:+.2f} |")

    lines = ["| model | kind | setting | sparsity % (nominal) | val loss | ppl | Δppl vs dense |",
             "|---|---|---|---:|---:|---:|---:|",
             row("dense", "dense", "full causal", report["dense"])]
    for run in report["dcp"]:
        g = run["info"].get("gamma")
        lines.append(row(run["label"], "DCP", "α=∞" + (f", γ={g:g}" if g is not None else ""), run))
    for run in report.get("controls", ()):
        lines.append(row(run["label"], "fine-tuned " + ("dense" if run["info"]["pattern"] is None else "pattern"),
                         run["info"]["pattern"] or "full causal", run))
    for kind in SPARSE_PATTERNS:
        for p in report["curves"][kind]:
            lines.append(row("dense weights", kind, p["pattern"], p, p["nominal_sparsity"]))
    out = ["## All models", "", *lines, "", "## DCP vs fixed patterns at matched sparsity (dense weights)", "",
           "| DCP run | DCP sparsity % | DCP ppl | " + " | ".join(f"{k} | {k} sparsity % | {k} ppl"
                                                          for k in SPARSE_PATTERNS) + " |",
           "|---|---:|---:|" + "---|---:|---:|" * len(SPARSE_PATTERNS)]
    for run in (r for r in report["dcp"] if r["matched"]):
        out.append(f"| {run['display']} | {100 * run['sparsity']:.1f} | {run['ppl']:.2f} | " + " | ".join(
            f"{m['pattern']} | {100 * m['sparsity']:.1f} | {m['ppl']:.2f}"
            for m in (run["matched"][k] for k in SPARSE_PATTERNS)) + " |")
    if report["dcp"]:
        n_layer = len(report["dcp"][0]["sparsity_layers"])
        out += ["", "## DCP sparsity per layer (%)", "",
                "| DCP run | " + " | ".join(f"L{i}" for i in range(n_layer)) + " |",
                "|---|" + "---:|" * n_layer]
        for run in report["dcp"]:
            out.append(f"| {run['display']} | " + " | ".join(f"{100 * v:.1f}" for v in run["sparsity_layers"]) + " |")
    out += ["", f"Dense ppl {dense_ppl:.2f}. Sparsity = fraction of causal (query, key) pairs dropped, mean over "
            "layers (step mask α=∞ for DCP); 'dense weights' rows are the dense model with a fixed pattern, "
            "not fine-tuned; 'fine-tuned' rows (--controls) were fine-tuned with their own pattern."]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# The evaluation
# ---------------------------------------------------------------------------------------------

def parse_sparsities(spec: str | Sequence[float] | None) -> list[float]:
    """``"0.25,0.5"`` (or a list) -> sorted unique floats in [0, 1]; ``""``/None -> [].

    Raises:
      ValueError: an entry that is not a number in [0, 1] (names ``--curve-sparsities``).
    """
    if spec is None:
        return []
    items = [s for s in spec.split(",") if s.strip()] if isinstance(spec, str) else list(spec)
    out = []
    for s in items:
        try:
            v = float(s)
        except (TypeError, ValueError):
            raise ValueError(f"--curve-sparsities: {s!r} is not a number; "
                             "expected comma-separated values in [0, 1]") from None
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"--curve-sparsities: {v} is outside [0, 1]")
        out.append(v)
    return sorted(set(out))


def run_dcp_eval(dense: EvalModel, runs: Sequence[EvalModel], data_cfg: DataConfig, out_dir: str, *,
                 batch_size: int = 4, num_batches: int = 8,
                 curve_sparsities: Sequence[float] = DEFAULT_CURVE_SPARSITIES,
                 text_file: str | None = None, progress: bool = True,
                 controls: Sequence[EvalModel] = ()) -> dict:
    """The whole evaluation (module docstring); writes every output file to ``out_dir``.

    Args:
      dense: the base model (``load_dense``).
      runs: the DCP models (``load_run``); at least one of ``runs`` and ``controls``.
      data_cfg: validation data (``seq_len`` = T, the tokenizer).
      out_dir: output directory (created).
      batch_size, num_batches: the validation windows (the same for every model).
      curve_sparsities: extra target sparsities for the local/strided/sinks curves.
      text_file: the drop-plot text (default: the first validation document).
      progress: tqdm bars (drawn only when stderr is a terminal).
      controls: fine-tuned comparison models (``load_control``: dense control, fixed-pattern fine-tunes),
        each scored under its own pattern on the same windows.

    Returns:
      the report dict written to ``dcp_eval.json``.

    Raises:
      ValueError: no runs, bad sizes, models of different vocabularies, T > n_positions of a model, a
        tokenizer with more ids than a model, not enough validation data.
    """
    if not runs and not controls:
        raise ValueError("--runs / --controls: at least one DCP run or fine-tuned control is needed")
    if batch_size < 1 or num_batches < 1:
        raise ValueError(f"--batch-size and --num-batches must be positive, got {batch_size}, {num_batches}")
    models = [dense, *runs, *controls]
    _unique_labels(models)
    t = data_cfg.seq_len
    for m in models:
        if t > m.cfg.n_positions:
            raise ValueError(f"--seq-len {t} exceeds n_positions={m.cfg.n_positions} of {m.path}")
        if m.cfg.vocab_size != dense.cfg.vocab_size:
            raise ValueError(f"{m.path} has vocab_size {m.cfg.vocab_size}, the dense model {dense.cfg.vocab_size}: "
                             "the models must share a tokenizer")
    if t < 3:
        raise ValueError(f"--seq-len must be at least 3, got {t}")
    corpus = data_lib.load_corpus(data_cfg)
    if corpus.tokenizer.vocab_size > dense.cfg.vocab_size:
        raise ValueError(f"the tokenizer has {corpus.tokenizer.vocab_size} ids but the models only "
                         f"{dense.cfg.vocab_size}; pass the GPT-2 --tokenizer")
    batches = data_lib.make_val_batches(corpus, batch_size, num_batches)
    os.makedirs(out_dir, exist_ok=True)

    # 1. ppl vs sparsity ---------------------------------------------------------------------------
    pattern_cache: dict[str, dict] = {}

    def eval_pattern(pattern: str, nominal: float) -> dict:
        if pattern not in pattern_cache:
            res = evaluate_model(dense.cfg.replace(sparse_pattern=pattern), dense.params, batches,
                                 desc=pattern, progress=progress)
            pattern_cache[pattern] = {"pattern": pattern, "nominal_sparsity": nominal, **res}
        return pattern_cache[pattern]

    n_evals = 1 + len(runs) + len(controls) + len(SPARSE_PATTERNS) * (len(runs) + len(curve_sparsities))
    bar = progress_bar(total=n_evals, desc="dcp-eval", unit="model", progress=progress)
    dense_res = evaluate_model(dense.cfg, dense.params, batches, desc="dense", progress=progress)
    bar.update(1)
    run_results = []
    for run in runs:
        res = evaluate_model(run.cfg, run.params, batches, desc=run.label, progress=progress)
        bar.update(1)
        run_results.append({"label": run.label, "display": _display(run), "path": run.path, "info": run.info,
                            **res, "matched": {}})
    control_results = []
    for run in controls:
        res = evaluate_model(run.cfg, run.params, batches, desc=run.label, progress=progress)
        bar.update(1)
        control_results.append({"label": run.label, "display": run.label, "path": run.path, "info": run.info, **res})
    tokens = sum(int(np.asarray(b["targets"]).size) for b in batches)
    report = {
        "config": {"seq_len": t, "batch_size": batch_size, "num_batches": len(batches), "tokens": tokens,
                   "val_data": list(data_cfg.val) or list(data_cfg.train), "tokenizer": corpus.tokenizer.name,
                   "curve_sparsities": list(curve_sparsities), "alpha": "inf",
                   "sparsity_definition": "fraction of strictly causal (query, key) pairs dropped, within documents, "
                                          "mean over layers (docs/design/dcp.md §3.2)",
                   "baselines": "dense model weights with a fixed GPT2Config.sparse_pattern, not fine-tuned; "
                                "local:W keeps i-W<j<=i; strided:S keeps i-j<S or j%S==S-1; sinks:S+W keeps "
                                "i-j<W or j<S",
                   "controls": "fine-tuned models (--controls) scored under their own sparse_pattern"},
        "dense": {"label": dense.label, "path": dense.path, "info": dense.info, **dense_res},
        "dcp": run_results,
        "controls": control_results,
        "curves": {kind: [] for kind in SPARSE_PATTERNS},
    }
    # the models' own scores are written before the baselines are computed: a run cut later keeps them
    _write_report(report, out_dir)

    for run in run_results:  # the untuned baselines at each DCP run's sparsity
        for kind in SPARSE_PATTERNS:
            pattern, nominal = match_sparse_pattern(kind, run["sparsity"], t)
            run["matched"][kind] = {**eval_pattern(pattern, nominal), "target_sparsity": run["sparsity"]}
            if abs(nominal - run["sparsity"]) > 0.02:
                tqdm.write(f"dcp-eval: {run['label']}: no {kind} pattern reaches sparsity {100 * run['sparsity']:.1f}% "
                           f"at T={t}; closest is {pattern} ({100 * nominal:.1f}%)")
            bar.update(1)
    for target in curve_sparsities:
        for kind in SPARSE_PATTERNS:
            eval_pattern(*match_sparse_pattern(kind, target, t))
            bar.update(1)
    bar.close()
    report["curves"] = {kind: sorted((p for p in pattern_cache.values() if p["pattern"].startswith(kind + ":")),
                                     key=lambda p: p["nominal_sparsity"]) for kind in SPARSE_PATTERNS}

    # written now and again at the end, so a run killed during the plots keeps its perplexity tables
    _write_report(report, out_dir)

    # 2. drop plots and 3. context switch ------------------------------------------------------------
    sample = sample_tokens(corpus, t, text_file)
    sample_text, sample_cls = _token_texts(corpus.tokenizer, sample)
    switch, bounds = context_switch_tokens(corpus, t)
    drops, switches = {}, {}
    for run in progress_bar(runs, desc="drop plots", unit="run", progress=progress):
        slug = _slug(run.label)
        dropped = step_masks(run.cfg, run.params, sample)
        stats = drop_statistics(dropped, sample_text, sample_cls)
        plot_step_masks(dropped, os.path.join(out_dir, f"drops_{slug}.png"),
                        title=f"{_display(run)}: step masks (α=∞) of the sample text, T={len(sample)}")
        plot_drop_tokens(stats, sample_text, os.path.join(out_dir, f"drop_tokens_{slug}.png"),
                         title=f"{_display(run)}: which tokens each layer drops")
        drops[run.label] = {**stats, "tokens": sample_text, "token_ids": [int(x) for x in sample]}

        dropped_sw = step_masks(run.cfg, run.params, switch)
        scores = block_diagonality(dropped_sw, bounds)
        plot_step_masks(dropped_sw, os.path.join(out_dir, f"context_switch_{slug}.png"),
                        title=f"{_display(run)}: context switch (3 unrelated passages, boundaries dashed)",
                        boundaries=bounds, scores=scores)
        switches[run.label] = {**scores, "sparsity": [float(dropped_sw[i].sum() / (t * (t - 1) // 2))
                                                      for i in range(len(dropped_sw))],
                               "passage_starts_text": [corpus.tokenizer.decode(switch[b:b + 12]) for b in bounds]}

    _write_json({"sample_text": corpus.tokenizer.decode(sample), "text_file": text_file,
                 "token_classes": "special / whitespace / punctuation (Unicode P*, S*) / stopword (fox_jax.train.dcp_eval."
                                  "STOPWORDS) / other", "runs": drops}, os.path.join(out_dir, "drops.json"))
    _write_json({"seq_len": t, "passage_boundaries": bounds, "runs": switches},
                os.path.join(out_dir, "context_switch.json"))
    report["outputs"] = {"drops": "drops.json", "context_switch": "context_switch.json",
                         "plot": "ppl_vs_sparsity.png", "table": "dcp_eval.md"}
    report["context_switch_summary"] = {k: {"cross_dropped": v["cross_dropped"], "within_dropped": v["within_dropped"]}
                                        for k, v in switches.items()}
    report["tables"] = _write_report(report, out_dir)
    return report


def _write_report(report: dict, out_dir: str) -> str:
    """dcp_eval.json, ppl_vs_sparsity.png and dcp_eval.md from ``report``; returns the markdown tables."""
    _write_json(report, os.path.join(out_dir, "dcp_eval.json"))
    plot_ppl_vs_sparsity(report, os.path.join(out_dir, "ppl_vs_sparsity.png"))
    tables = format_tables(report)
    with open(os.path.join(out_dir, "dcp_eval.md"), "w") as f:
        f.write("# DCP evaluation\n\n" + tables + "\n")
    return tables


def _write_json(obj: dict, path: str) -> None:
    def default(o):
        if isinstance(o, (np.floating, np.integer)):
            return o.item()
        raise TypeError(f"not JSON serialisable: {type(o)}")

    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=default, allow_nan=False)
        f.write("\n")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _tokenizer_spec(args, dense: EvalModel, runs: Sequence[EvalModel]) -> str:
    if args.tokenizer:
        return args.tokenizer if args.tokenizer == "bytes" else os.path.abspath(args.tokenizer)
    for d in [dense.path] + [os.path.join(r.path, "hf") for r in runs] + [r.path for r in runs]:
        if os.path.isfile(os.path.join(d, "vocab.json")) and os.path.isfile(os.path.join(d, "merges.txt")):
            return d
    for r in runs:
        if r.info.get("tokenizer"):
            return r.info["tokenizer"]
    raise ValueError("--tokenizer is required (a directory with GPT-2 vocab.json + merges.txt); neither --dense "
                     "nor the runs hold one")


def cmd_dcp_eval(args) -> int:
    """The ``fox-jax dcp-eval`` handler: print the tables and write the outputs to ``--out``."""
    if not args.runs and not args.controls:  # before any model is read
        raise ValueError("--runs / --controls: give at least one DCP run or fine-tuned control")
    if not args.val_data and not args.data:
        raise ValueError("--val-data (or --data) is required: the validation text")
    for flag, paths in (("--data", args.data), ("--val-data", args.val_data)):
        for p in paths or ():
            if not any(ch in p for ch in "*?[") and not os.path.exists(p):
                raise FileNotFoundError(f"{flag}: {p} does not exist; give a file, directory or glob of text")
    curve = parse_sparsities(args.curve_sparsities)
    dense = load_dense(args.dense, dtype=args.dtype)
    runs = [load_run(p, dtype=args.dtype) for p in args.runs or ()]
    controls = [load_control(p, dtype=args.dtype) for p in args.controls or ()]
    seq_len = args.seq_len if args.seq_len is not None else dense.cfg.n_positions
    train_files = tuple(os.path.abspath(p) for p in (args.data or args.val_data))
    val_files = tuple(os.path.abspath(p) for p in args.val_data or ())
    data_cfg = DataConfig(train=train_files, val=val_files, tokenizer=_tokenizer_spec(args, dense, runs),
                          seq_len=seq_len, seed=args.data_seed)
    load_tokenizer(data_cfg.tokenizer)  # a clear error before any data is read
    report = run_dcp_eval(dense, runs, data_cfg, args.out, batch_size=args.batch_size, num_batches=args.num_batches,
                          curve_sparsities=curve, text_file=args.text, progress=not args.no_progress,
                          controls=controls)
    print(report["tables"])
    print(f"wrote {os.path.abspath(args.out)}: dcp_eval.json, dcp_eval.md, ppl_vs_sparsity.png, drops.json, "
          "context_switch.json and per-run drops_/drop_tokens_/context_switch_ PNGs")
    return 0
