"""``fox-jax passkey``: passkey retrieval (needle in a haystack) over Gutenberg text, offline.

A 5-digit pass key is hidden at a fractional depth of a long run of ordinary book text, and the model is
asked for it at the end (the passkey task of Mohtashami & Jaggi 2023, arXiv 2305.16300, with real text as
the haystack, as in the needle-in-a-haystack tests of long-context papers). Accuracy over
(context length × depth) is the heatmap those papers show; under a KV-cache policy (``--cache``) it shows
what the policy forgets.

Prompt (``make_passkey_prompts``), built on the token level from separately encoded pieces::

    FILLER[:k] + NEEDLE + FILLER[k:] + QUESTION          answer: ANSWER
    NEEDLE   = " The pass key is {key}. Remember it. {key} is the pass key."
    QUESTION = "\\n\\nWhat is the pass key? The pass key is"
    ANSWER   = " {key}"                                   {key}: 5 random digits, the first not 0

* FILLER: consecutive text of the haystack (the file with its ``<|endoftext|>`` separators removed and
  every run of whitespace made one space) from a seeded random character offset, moved forward to the
  next space (so the filler starts with a whole word), read cyclically (the text's end joins its start),
  cut to the exact number of tokens (its last token may end inside a word).
* k: the depth. ``depth`` 0 puts the needle first, 1 just before the question; in between the needle goes
  at the sentence boundary nearest to ``round(depth · len(FILLER))`` (a token ending in ``.``, ``!`` or
  ``?``, closing quotes or brackets allowed, followed by a token that starts with whitespace; searched
  within ``BOUNDARY_WINDOW`` tokens, else the exact token). So the needle is never more than one
  sentence away from the asked depth and never splits a sentence of the filler.
* Length: every prompt is exactly ``context_len − reserve`` tokens (``reserve`` = ``RESERVE`` = 8 by
  default): the reserve is the room for the generated tokens, so prompt and answer together stay within
  ``context_len`` (a model with ``context_len`` positions can decode the whole answer).
* Seeds: the keys and the offsets of the examples of one context length come from
  ``(seed, context_len)`` and not from the depth, so the depths of one row of the heatmap hide the same
  keys in the same haystacks; only the needle moves.

Scoring (``score``): the prediction is the first 5-digit number in the generated text (else its first
number); ``exact`` when it equals the key, ``digit_accuracy`` the fraction of the key's 5 positions it
matches.

``run_passkey`` generates greedily ``max(answer tokens) + 2`` tokens per prompt with
``fox_jax.decoding.generate`` under a cache policy (issue 12's ``policy=`` / ``slots=``), in left-padded
batches (``seq_start`` = the pads of each row), longest prompts first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from fox_jax.cache.policies import parse_policy
from fox_jax.train import config as config_lib
from fox_jax.train.progress import bars_shown, elapsed_eta, progress_bar
from fox_jax.train.tokenizers import EOT_TOKEN

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER = " {key}"
DIGITS = 5
RESERVE = 8  # tokens of context_len left for the generated answer (a byte tokenizer needs 6 + 2)
BOUNDARY_WINDOW = 256  # tokens searched on either side of the asked depth for a sentence boundary
DEFAULT_TEXT = ("corpus_val", "gutenberg_val.txt")  # under the shared data directory
JSON_NAME, PNG_NAME = "passkey.json", "passkey.png"

HEARTBEAT_SECS = 30.0  # where no bar is drawn: a line as a batch starts once this many seconds passed since the last

_SENTENCE_END = re.compile(r"[.!?][\"')\]’”]*\s*$")
_NUMBER = re.compile(r"\d+")


@dataclasses.dataclass(frozen=True, eq=False)
class PasskeyExample:
    """One passkey prompt (see the module docstring for the template).

    Attributes:
      context_len: the context length asked for; ``len(prompt_ids) == context_len − reserve``.
      depth: the depth asked for, in [0, 1].
      index: the example's index in its context length (its key and offset depend on it, not on depth).
      prompt_ids: int32 [T] the prompt's tokens.
      answer: the key, ``DIGITS`` digit characters.
      answer_ids: int32 [A] the tokens of ``ANSWER`` (a space, then the key).
      needle_pos: index in ``prompt_ids`` of the needle's first token (= filler tokens before it).
      needle_len: the needle's tokens.
      filler_len: filler tokens in the prompt.
      depth_actual: ``needle_pos / filler_len`` (the depth after moving to a sentence boundary).
      offset: character offset of the filler in the normalised haystack.
    """

    context_len: int
    depth: float
    index: int
    prompt_ids: np.ndarray
    answer: str
    answer_ids: np.ndarray
    needle_pos: int
    needle_len: int
    filler_len: int
    depth_actual: float
    offset: int

    @property
    def max_new_tokens(self) -> int:
        """Tokens to generate for this example: its answer's tokens + 2."""
        return len(self.answer_ids) + 2


def normalize_text(text: str) -> str:
    """The haystack: ``text`` without ``<|endoftext|>`` separators, every whitespace run one space.

    Idempotent. Raises ValueError for a text without any word."""
    out = " ".join(text.replace(EOT_TOKEN, " ").split())
    if not out:
        raise ValueError("the passkey text is empty (no words to use as filler)")
    return out


def _encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode_batch([text])[0], np.int64).astype(np.int32)


def _cyclic_slice(s: str, start: int, n_chars: int) -> str:
    """``n_chars`` characters of ``s`` from ``start``, going on at the start of ``s`` after its end
    (joined by one space)."""
    s = s + " "
    out, pos = [], start % len(s)
    while n_chars > 0:
        piece = s[pos:pos + n_chars]
        out.append(piece)
        n_chars -= len(piece)
        pos = 0
    return "".join(out)


def _filler(tokenizer, haystack: str, offset: int, n_tokens: int) -> np.ndarray:
    """``n_tokens`` tokens of the haystack read from the first space at or after ``offset`` (so the first
    token is a whole word with its leading space, like every other word of the filler)."""
    space = haystack.find(" ", offset)
    start = 0 if space < 0 else space
    n_chars = 8 * n_tokens + 64
    while True:
        ids = _encode(tokenizer, _cyclic_slice(haystack, start, n_chars))
        if len(ids) > n_tokens or n_chars > 64 * n_tokens + 4096:  # one extra token: the last may be cut
            break
        n_chars *= 2
    if len(ids) < n_tokens:
        raise ValueError(f"the passkey text gives only {len(ids)} tokens for a filler of {n_tokens}")
    return ids[:n_tokens]


def _sentence_boundary(tokenizer, filler: np.ndarray, target: int) -> int:
    """The sentence boundary (index into ``filler``: a sentence ends right before it) nearest to
    ``target``; ties go to the earlier one. 0 and ``len(filler)`` always count; other boundaries are
    searched within ``BOUNDARY_WINDOW`` tokens; none there: ``target`` itself."""
    f = len(filler)
    lo, hi = max(0, target - BOUNDARY_WINDOW), min(f, target + BOUNDARY_WINDOW)
    pieces = {j: tokenizer.decode(filler[j:j + 1]) for j in range(max(0, lo - 1), min(f, hi + 1))}
    candidates = [j for j in (0, f) if lo <= j <= hi]
    candidates += [j for j in range(max(1, lo), min(f - 1, hi) + 1)
                   if _SENTENCE_END.search(pieces[j - 1]) and pieces[j][:1].isspace()]
    if not candidates:
        return target
    return min(candidates, key=lambda j: (abs(j - target), j))


def make_passkey_prompts(text: str, tokenizer, *, context_len: int, depth: float, n: int, seed: int,
                         reserve: int = RESERVE) -> list[PasskeyExample]:
    """``n`` passkey prompts of ``context_len − reserve`` tokens with the needle at ``depth``.

    See the module docstring for the template, the filler, the depth rule and the seeds. Deterministic
    given (text, tokenizer, context_len, depth, n, seed, reserve); the keys and offsets do not depend on
    ``depth``.

    Args:
      text: the haystack text (e.g. Gutenberg books; normalised with ``normalize_text``).
      tokenizer: a ``fox_jax.train.tokenizers.Tokenizer``.
      context_len: tokens of prompt + generated answer.
      depth: where the needle goes, 0 (first) .. 1 (just before the question).
      n: prompts to make.
      seed: non-negative int.
      reserve: tokens left at the end of ``context_len`` for the generation (≥ answer tokens + 2).

    Returns:
      list of ``PasskeyExample``.

    Raises:
      ValueError: depth outside [0, 1], n < 1, a negative seed, a context too short for needle and
        question, an answer needing more than ``reserve − 2`` tokens, an empty text.
    """
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth must be in [0, 1] (0: the start, 1: just before the question), got {depth}")
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if not isinstance(context_len, (int, np.integer)) or context_len < 1:
        raise ValueError(f"context_len must be a positive int, got {context_len!r}")
    haystack = normalize_text(text)
    rng = np.random.default_rng([int(seed), int(context_len)])
    question = _encode(tokenizer, QUESTION)
    prompt_len = int(context_len) - reserve
    out = []
    for i in range(n):
        key = str(int(rng.integers(10 ** (DIGITS - 1), 10 ** DIGITS)))
        offset = int(rng.integers(0, len(haystack)))
        needle = _encode(tokenizer, NEEDLE.format(key=key))
        answer = _encode(tokenizer, ANSWER.format(key=key))
        if len(answer) + 2 > reserve:
            raise ValueError(f"the answer {ANSWER.format(key=key)!r} is {len(answer)} tokens; reserve must be "
                             f"≥ {len(answer) + 2}, got {reserve}")
        n_filler = prompt_len - len(needle) - len(question)
        if n_filler < 0:
            raise ValueError(f"context_len {context_len} is too short for the needle ({len(needle)} tokens), "
                             f"the question ({len(question)}) and the answer's reserve ({reserve}): use ≥ "
                             f"{len(needle) + len(question) + reserve}")
        filler = _filler(tokenizer, haystack, offset, n_filler) if n_filler else np.zeros(0, np.int32)
        k = _sentence_boundary(tokenizer, filler, int(round(float(depth) * n_filler))) if n_filler else 0
        ids = np.concatenate([filler[:k], needle, filler[k:], question]).astype(np.int32)
        out.append(PasskeyExample(int(context_len), float(depth), i, ids, key, answer, k, len(needle), n_filler,
                                  k / n_filler if n_filler else float(depth), offset))
    return out


def score(generated_text: str, answer: str) -> dict:
    """Score one generation against the key.

    The prediction is the first number of ``len(answer)`` digits in the text (a maximal run of digits:
    "123456" is no 5-digit number); when there is none, the first number of any length (partial credit for
    ``digit_accuracy``); "" when the text holds no digit.

    Returns:
      ``{"prediction": str, "exact": prediction == answer, "digit_accuracy": fraction of the answer's
      positions where the prediction has the same digit (0 .. 1)}``.
    """
    numbers = _NUMBER.findall(generated_text)
    pred = next((x for x in numbers if len(x) == len(answer)), numbers[0] if numbers else "")
    hits = sum(a == b for a, b in zip(pred, answer))
    return {"prediction": pred, "exact": pred == answer, "digit_accuracy": hits / len(answer) if answer else 0.0}


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------

def policy_spec(policy) -> str:
    """The canonical string of a cache policy (``CachePolicy.spec``); ValueError for an unknown one."""
    return parse_policy(policy).spec


def _check_lengths(lengths: Sequence[int], limit: int | None, flag: str = "lengths") -> list[int]:
    out = []
    for length in lengths:
        if not isinstance(length, (int, np.integer)) or length < 1:
            raise ValueError(f"{flag}: context lengths must be positive ints, got {length!r}")
        if limit is not None and length > limit:
            raise ValueError(f"{flag}: context length {length} is longer than the model's {limit} positions "
                             f"(cfg.max_positions); use lengths ≤ {limit}")
        out.append(int(length))
    if not out:
        raise ValueError(f"{flag}: give at least one context length")
    if len(set(out)) < len(out):
        raise ValueError(f"{flag}: a context length is given twice: {out}")
    return out


def _check_depths(depths: Sequence[float], flag: str = "depths") -> list[float]:
    out = [float(d) for d in depths]
    if not out or any(not 0.0 <= d <= 1.0 for d in out):
        raise ValueError(f"{flag}: depths must be in [0, 1] (0: the start, 1: just before the question), got "
                         f"{list(depths)}")
    if len(set(out)) < len(out):
        raise ValueError(f"{flag}: a depth is given twice: {out}")
    return out


def left_pad(rows: Sequence[np.ndarray], pad_id: int, batch_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded batch of token rows: (tokens [B, T] int32, seq_start [B] int32 = pads per row).

    ``batch_size`` > len(rows) fills the batch with copies of the last row (their outputs are dropped),
    so every batch of a run has one shape."""
    rows = list(rows) + [rows[-1]] * max(0, (batch_size or 0) - len(rows))
    t = max(len(r) for r in rows)
    tokens = np.full((len(rows), t), pad_id, np.int32)
    seq_start = np.zeros(len(rows), np.int32)
    for b, r in enumerate(rows):
        seq_start[b] = t - len(r)
        tokens[b, t - len(r):] = r
    return tokens, seq_start


def _decode_generated(tokenizer, ids: np.ndarray) -> str:
    """Text of generated ids: the engine's -1 entries (after a stop token) and everything from the first
    eot on are dropped."""
    ids = np.asarray(ids).reshape(-1)
    ids = ids[:np.argmax(ids < 0)] if (ids < 0).any() else ids
    eot = np.flatnonzero(ids == tokenizer.eot_id)
    return tokenizer.decode(ids[:eot[0]] if eot.size else ids)


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_passkey(model, params, tokenizer, text: str, *, lengths: Sequence[int], depths: Sequence[float],
                n_per_cell: int, policy="dense", slots: int | None = None, batch_size: int = 8, seed: int = 0,
                reserve: int = RESERVE, progress: bool = True, mesh=None,
                heartbeat_secs: float = HEARTBEAT_SECS, train_len: int | None = None) -> dict:
    """Passkey accuracy of a model over (context length × depth), greedy decoding under a cache policy.

    Every cell (length, depth) holds ``n_per_cell`` prompts of ``make_passkey_prompts``. All prompts are
    generated in batches of ``batch_size`` rows, longest first, left-padded (``seq_start`` = the pads of
    each row; a short last batch is filled with copies of its last row), with
    ``fox_jax.decoding.generate(model, params, tokens, max_new_tokens=max(answer tokens) + 2,
    policy=policy, slots=slots, seq_start=seq_start)`` (temperature 0).

    Args:
      model: a fox_jax model module (``cfg.build()``: ``LanguageModel`` or ``GPT2``).
      params: its params.
      tokenizer: the model's ``fox_jax.train.tokenizers.Tokenizer``.
      text: the haystack text.
      lengths: context lengths in tokens (prompt + answer; each ≤ ``model.cfg.max_positions`` when set).
      depths: needle depths in [0, 1].
      n_per_cell: prompts per (length, depth).
      policy: a cache policy (spec string or ``CachePolicy`` of issue 12), e.g. "dense", "window:256".
      slots: KV slots per row per layer (None: what the policy can need).
      batch_size: rows per ``generate`` call.
      seed: the prompts' seed.
      reserve: see ``make_passkey_prompts``.
      progress: a tqdm bar over the prompts (drawn only when stderr is a terminal).
      heartbeat_secs: where no bar is drawn (stderr not a terminal, or ``progress`` False), a line on stderr
        when the run starts and then one as a batch starts, ``passkey (dense): batch 3/6: 8 prompts at length
        4096 | 16/48 prompts done | 4.2 min elapsed | ETA 8.1 min``, for the first batch of each length and
        for any other once ``heartbeat_secs`` have passed since the last line: so a batch that runs long has
        been announced (the one before it took that long, or it starts a length). The ETA extrapolates from
        the longest prompts, which run first, so it errs long. 0: no lines.
      mesh: a ``jax.sharding.Mesh`` to decode on (``generate(mesh=...)``); each batch is filled to a multiple
        of its data × fsdp size (copies of the last row, dropped).
      train_len: the model's training length in tokens, if known: lengths beyond it get a warning on stderr
        (extrapolation is a fair test, but long prompts take memory and time), once the prompts are built.

    Returns:
      JSON-able dict: ``policy`` (spec string), ``slots``, ``lengths``, ``depths``, ``n`` (per cell),
      ``accuracy`` and ``digit_accuracy`` ([len(lengths)][len(depths)] fractions), ``mean_accuracy``,
      ``mean_digit_accuracy``, ``answers_with_digits`` (the fraction of generations that hold any digit: a
      model that writes none scores 0 digit accuracy, below chance), ``max_new_tokens``, ``reserve``, ``seed``,
      ``provable`` (whether the policy's
      promise holds for the model: False for ``acp`` without QK-norm, a heuristic), ``overflow_rows`` (rows whose
      policy ran out of slots, when the engine reports it; their results are not the policy's) and
      ``records``: one dict per prompt (length, depth, index, answer, prediction, generated, exact,
      digit_accuracy, prompt_tokens, needle_pos, depth_actual, offset, live_tokens: mean over layers of
      the KV entries held after the last token, overflow when reported).

    Raises:
      ValueError: a length beyond the model's positions (names ``cfg.max_positions``), bad depths,
        n_per_cell or batch_size < 1, a policy the engine does not run; see ``make_passkey_prompts``.
    """
    from fox_jax.decoding import generate

    cfg = getattr(model, "cfg", None)
    lengths = _check_lengths(lengths, getattr(cfg, "max_positions", None))
    depths = _check_depths(depths)
    if not isinstance(n_per_cell, (int, np.integer)) or n_per_cell < 1:
        raise ValueError(f"n_per_cell must be a positive int, got {n_per_cell!r}")
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    engine = {"policy": policy, "slots": slots, **({} if mesh is None else {"mesh": mesh})}
    fill = batch_size
    if mesh is not None:
        from fox_jax.sharding import data_parallel_size

        fill = -(-batch_size // data_parallel_size(mesh)) * data_parallel_size(mesh)
    haystack = normalize_text(text)
    examples = [ex for length in lengths for depth in depths
                for ex in make_passkey_prompts(haystack, tokenizer, context_len=length, depth=depth, n=n_per_cell,
                                               seed=seed, reserve=reserve)]
    max_new = max(ex.max_new_tokens for ex in examples)  # ≤ reserve: prompt + answer fit in each length
    longer = [n for n in lengths if train_len and n > train_len]
    if longer:
        _stderr_line(f"warning: context length{'s' if len(longer) > 1 else ''} {', '.join(map(str, longer))} "
                     f"exceed{'' if len(longer) > 1 else 's'} the {train_len} tokens the model was trained on (a test of "
                     f"extrapolation): long prompts take memory and time, each batch of {batch_size} prefilling and "
                     f"caching up to {max(longer):,} tokens per prompt")
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i].prompt_ids))
    records: list[dict | None] = [None] * len(examples)
    name = f"passkey ({policy_spec(policy)})"
    lines = heartbeat_secs > 0 and not bars_shown(progress)  # no bar in logs: a line as the batches start
    n_batches = -(-len(examples) // batch_size)
    if lines:
        _stderr_line(f"{name}: {len(examples)} prompts in {n_batches} batch{'es' if n_batches > 1 else ''} of "
                     f"{batch_size}, the longest ({max(lengths)} tokens) first; a line as a batch starts, for the "
                     f"first of each length and otherwise once {heartbeat_secs:g} s have passed")
    done, t0, last, previous = 0, time.monotonic(), None, None
    with progress_bar(total=len(examples), desc=name, unit="prompt", progress=progress, leave=False) as bar:
        for b, start in enumerate(range(0, len(order), batch_size)):
            idx = order[start:start + batch_size]
            at = sorted({examples[i].context_len for i in idx}, reverse=True)
            now = time.monotonic()
            if lines and (at[0] != previous or now - last >= heartbeat_secs):
                _stderr_line(f"{name}: batch {b + 1}/{n_batches}: {len(idx)} prompt{'s' if len(idx) > 1 else ''} at "
                             f"length{'s' if len(at) > 1 else ''} {', '.join(map(str, at))} | {done}/{len(examples)} "
                             f"prompts done | {elapsed_eta(now - t0, done, len(examples))}")
                last = now
            previous = at[0]
            tokens, seq_start = left_pad([examples[i].prompt_ids for i in idx], tokenizer.eot_id, fill)
            gen = generate(model, params, tokens, max_new_tokens=max_new, seq_start=seq_start, **engine)
            out = np.asarray(gen.tokens)
            live = np.asarray(gen.live_counts)[-1].mean(axis=0)  # [B]: mean over layers after the last token
            overflow = getattr(gen, "overflow", None)
            overflow = None if overflow is None else np.asarray(overflow)
            for r, i in enumerate(idx):
                ex = examples[i]
                generated = _decode_generated(tokenizer, out[r])
                rec = {"length": ex.context_len, "depth": ex.depth, "index": ex.index, "answer": ex.answer,
                       **score(generated, ex.answer), "generated": generated, "prompt_tokens": len(ex.prompt_ids),
                       "needle_pos": ex.needle_pos, "depth_actual": round(ex.depth_actual, 4), "offset": ex.offset,
                       "live_tokens": float(live[r])}
                if overflow is not None:
                    rec["overflow"] = int(overflow[r])
                records[i] = rec
            bar.update(len(idx))
            done += len(idx)
    acc = np.zeros((len(lengths), len(depths)))
    dacc = np.zeros_like(acc)
    for rec in records:
        li, di = lengths.index(rec["length"]), depths.index(rec["depth"])
        acc[li, di] += rec["exact"] / n_per_cell
        dacc[li, di] += rec["digit_accuracy"] / n_per_cell
    provable = None if cfg is None else parse_policy(policy).provable(cfg.cache_layout())
    result = {"policy": policy_spec(policy), "provable": provable, "slots": slots, "lengths": lengths, "depths": depths,
              "n": int(n_per_cell),
              "accuracy": acc.round(6).tolist(), "digit_accuracy": dacc.round(6).tolist(),
              "mean_accuracy": float(acc.mean()), "mean_digit_accuracy": float(dacc.mean()),
              "answers_with_digits": float(np.mean([rec["prediction"] != "" for rec in records])),
              "max_new_tokens": max_new, "reserve": reserve, "seed": int(seed), "batch_size": int(batch_size)}
    if any("overflow" in rec for rec in records):
        result["overflow_rows"] = sum(rec["overflow"] > 0 for rec in records)
    result["records"] = records
    return result


# ---------------------------------------------------------------------------------------------
# Report: table and heatmap
# ---------------------------------------------------------------------------------------------

def format_table(result: dict) -> str:
    """Exact-match accuracy (%) per context length (rows) and depth (columns), with the row means."""
    depths = result["depths"]
    corner = "length \\ depth"
    head = f"{corner:>14} " + " ".join(f"{d:>6.2f}" for d in depths) + f" {'mean':>7}"
    heuristic = " (a heuristic on this model: not provable)" if result.get("provable") is False else ""
    lines = [f"passkey retrieval, cache {result['policy']}{heuristic}: exact-match accuracy (%), {result['n']} prompts "
             "per cell",
             head, "-" * len(head)]
    for length, row in zip(result["lengths"], result["accuracy"]):
        lines.append(f"{length:>14} " + " ".join(f"{100 * a:>6.1f}" for a in row) + f" {100 * np.mean(row):>7.1f}")
    lines.append(f"{'mean':>14} " + " ".join(f"{100 * a:>6.1f}" for a in np.mean(result["accuracy"], axis=0))
                 + f" {100 * result['mean_accuracy']:>7.1f}")
    lines.append(digits_line(result))
    lines.append(CHANCE_NOTE)
    return "\n".join(lines)


def digits_line(result: dict) -> str:
    """The line under the table: the mean digit accuracy and the fraction of answers that hold any digit
    (``answers_with_digits``; a result without it, from before, gets the first part only)."""
    line = f"digit accuracy {100 * result['mean_digit_accuracy']:.1f}% (the fraction of the key's {DIGITS} digits right)"
    with_digits = result.get("answers_with_digits")
    if with_digits is None:
        return line + "."
    line += f"; {100 * with_digits:.0f}% of the answers hold any digit"
    if with_digits == 0:
        return line + (": the model writes no digits after the question, so its digit accuracy is 0, below the "
                       "chance level of a guess.")
    return line + "."


# What the numbers of a run mean (printed under the table).
CHANCE_NOTE = ("Chance: a random 5-digit guess is exact 1 time in 90,000 (0.001%) and gets about 10% of the digits "
               "right. What models score: retrieval needs a model that learned to copy from far back in its context; "
               "small or briefly trained models (the tiny preset, or a GPT-2-size model after a few thousand steps) "
               "score 0% exact "
               "everywhere, which is no bug. Digit accuracy well above 10%, or exact hits at depth 1 (the needle just "
               "before the question), show that copying works; to see what a cache policy loses, compare it with "
               "--cache dense on the same model.")


def plot_heatmap(result: dict, path: str | os.PathLike) -> None:
    """Accuracy over (context length × depth) as a PNG heatmap (matplotlib, Agg; no pyplot state).

    x: context length (tokens), y: needle depth (0 at the top), colour: exact-match accuracy 0..1
    (red → green), each cell annotated with its accuracy in %; title with the cache policy."""
    from matplotlib.figure import Figure

    acc = np.asarray(result["accuracy"], np.float64).T  # [depth, length]
    lengths, depths = result["lengths"], result["depths"]
    fig = Figure(figsize=(max(4.5, 1.0 * len(lengths) + 2.5), max(3.0, 0.55 * len(depths) + 1.8)))
    ax = fig.subplots()
    img = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    for (di, li), a in np.ndenumerate(acc):
        ax.text(li, di, f"{100 * a:.0f}", ha="center", va="center", fontsize=8,
                color="white" if a < 0.15 or a > 0.85 else "black")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (0 = start, 1 = end)")
    slots = f", {result['slots']} slots" if result.get("slots") else ""
    model = f"{result['model']} step {result['step']}, " if result.get("model") else ""
    ax.set_title(f"passkey retrieval, {model}cache {result['policy']}{slots} (n = {result['n']} per cell)", fontsize=9)
    fig.colorbar(img, ax=ax, label="exact-match accuracy")
    fig.tight_layout()
    path = os.fspath(path)
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def default_text_path() -> Path:
    """``corpus_val/gutenberg_val.txt`` of the shared data (``fox_jax.train.config.shared_data_dir``:
    ``$FOX_JAX_SHARED_DATA``, else the checkout's ``../shared/data``).

    Raises:
      FileNotFoundError: the file is not there (names the directory tried, the variable and --text)."""
    root, origin = config_lib.shared_data_dir()
    path = root.joinpath(*DEFAULT_TEXT)
    if not path.is_file():
        raise FileNotFoundError(f"no --text given and {path} not found ({origin}): pass --text FILE, or set "
                                f"{config_lib.SHARED_DATA_ENV} to the shared data directory (the one holding "
                                f"{'/'.join(DEFAULT_TEXT)})")
    return path


def _parse_list(spec: str, kind, flag: str) -> list:
    try:
        out = [kind(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated {kind.__name__}s, got {spec!r}") from None
    if not out:
        raise ValueError(f"{flag}: give at least one value")
    return out


def cmd_passkey(args) -> int:
    """The ``fox-jax passkey`` handler: writes ``passkey.json`` + ``passkey.png`` in ``--out`` and prints a
    table and one JSON summary line."""
    from fox_jax.train.generate import load_for_decoding, parse_cache_flag

    lengths = _check_lengths(_parse_list(args.lengths, int, "--lengths"), None, "--lengths")  # (the limit: below)
    depths = _check_depths(_parse_list(args.depths, float, "--depths"), "--depths")
    for flag, value in (("--n", args.n), ("--batch-size", args.batch_size), ("--kv-slots", args.kv_slots)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be positive, got {value}")
    if args.seed < 0:
        raise ValueError(f"--seed must be non-negative, got {args.seed}")

    policy = parse_cache_flag(args.cache).spec  # an unknown policy: ValueError before reading anything
    mesh = None
    if args.mesh:
        from fox_jax.sharding import make_mesh, select_partitioner

        mesh = make_mesh(args.mesh)
        select_partitioner(mesh, "auto")  # as training: GSPMD on multi-GPU meshes, so the kernels run per shard
    text_path = Path(args.text) if args.text else default_text_path()
    if text_path.is_dir():
        raise ValueError(f"--text {text_path} is a directory; give a text file (the haystack)")
    if not text_path.is_file():
        raise FileNotFoundError(f"--text {text_path}: no such file")
    run, tokenizer = load_for_decoding(  # the lengths are checked before anything else is read
        args.run, step=args.step, policy=policy, tokenizer=args.tokenizer,
        check=lambda r: _check_lengths(lengths, r.model.max_positions, "--lengths"))
    text = text_path.read_text(encoding="utf-8")
    params = run.load_params()
    try:
        result = run_passkey(run.model.build(), params, tokenizer, text, lengths=lengths, depths=depths,
                             n_per_cell=args.n, policy=policy, slots=args.kv_slots, batch_size=args.batch_size,
                             seed=args.seed, progress=not args.no_progress, mesh=mesh, train_len=run.seq_len)
    except ValueError as e:  # a length too short for the needle: name the flag
        if str(e).startswith("context_len "):
            raise ValueError("--lengths " + str(e).removeprefix("context_len ")) from None
        raise
    model_name = "gpt2" if run.model.model_type == "gpt2" else run.model.arch
    desc = {"model": model_name, "source": run.path, **({} if run.step is None else {"step": run.step}),
            "train_seq_len": run.seq_len, "max_positions": run.model.max_positions, "tokenizer": tokenizer.name,
            "text": str(text_path)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {**desc, **result}
    json_path, png_path = out / JSON_NAME, out / PNG_NAME
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, json_path)
    plot_heatmap(result, png_path)
    print(format_table(result))
    summary = {"command": "passkey", "policy": policy, "provable": result["provable"], "slots": args.kv_slots,
               "accuracy": round(result["mean_accuracy"], 4),
               "digit_accuracy": round(result["mean_digit_accuracy"], 4),
               "answers_with_digits": round(result["answers_with_digits"], 4),
               "prompts": len(result["records"]), "lengths": lengths, "depths": depths,
               **({"overflow_rows": result["overflow_rows"]} if "overflow_rows" in result else {}),
               "json": str(json_path), "png": str(png_path)}
    print(json.dumps(summary))
    sys.stdout.flush()
    return 0


__all__ = ["PasskeyExample", "make_passkey_prompts", "score", "run_passkey", "plot_heatmap", "format_table",
           "normalize_text", "left_pad", "default_text_path", "cmd_passkey", "NEEDLE", "QUESTION", "ANSWER",
           "RESERVE"]
