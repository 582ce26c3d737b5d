"""Text corpora -> packed, shuffled, resumable token batches (grain).

Pipeline::

    files (--data / data.train)  --read_documents-->  documents (str)
        --tokenize_documents-->  token stream  [eot] doc0  [eot] doc1 ...   (cached on disk)
        --load_corpus-->  Corpus(tokenizer, train_tokens, val_tokens)      (seeded doc subset + val split)
        --make_train_iterator-->  grain: shuffled windows of seq_len + 1 tokens, batched, repeated forever

Public API (``data`` is a ``Corpus`` or a ``DataConfig``; a ``DataConfig`` is loaded with ``load_corpus``,
which is cheap once the token cache exists, so pass the ``Corpus`` when you have one):

- ``load_corpus(data_cfg, *, tokenizer=None) -> Corpus``
- ``make_train_iterator(data, batch_size, *, tokenizer=None, process_index=0, process_count=1) -> TrainIterator``
- ``make_val_batches(data, batch_size, num_batches, *, tokenizer=None, process_index=0, process_count=1)
  -> list[Batch]``
- ``document_windows(data, num_docs, *, tokenizer=None) -> dict[str, np.ndarray]`` (per-position loss)
- ``prepare_tokens(data_cfg, out_dir) -> Path`` (also ``python -m fox_jax.train.data OUT_DIR --data ... --tokenizer ...``)
- building blocks: ``resolve_paths``, ``read_documents``, ``default_corpus_files``, ``tokenize_documents``,
  ``doc_starts``, ``pack_windows``, ``token_dtype``.

Batches (``Batch``) are dicts of host numpy arrays, ``B = batch_size // process_count`` rows of ``T = seq_len``:

- ``inputs``  int32 ``[B, T]``: tokens ``w[:-1]`` of a window ``w`` of ``T + 1`` consecutive stream tokens.
- ``targets`` int32 ``[B, T]``: ``w[1:]`` (the next token; the last token of a document predicts the next eot).
- ``segment_ids`` int32 ``[B, T]``: 1, 2, ... within a row; a new segment starts at every eot in ``inputs``.
  Attention must not cross segments (pass them as ``segment_ids`` to the attention op).
- ``positions`` int32 ``[B, T]``: position inside the segment: 0 at each eot and at the row start (a row that
  starts inside a document counts from 0 there).

Documents: every document is tokenized as ``[eot] + tokens(doc)`` (eot doubles as BOS, as in FoX/LongCrawl64),
so a document starts at every eot token of a stream (``doc_starts``). ``.txt`` files hold documents separated
by lines equal to ``data.separator``; ``.jsonl`` files one document per record (field ``data.text_field``);
pre-tokenized ``.npy`` streams (from ``prepare_tokens``) are used as they are. With no ``data.train`` the corpus
is the Python standard library source of the running interpreter (``default_corpus_files``).

Splits: ``data.max_docs`` keeps a subset of the training documents and, when ``data.val`` is empty,
``data.val_fraction`` of the kept documents (at least 1, leaving at least 1) are held out for validation.
Both use one permutation of the documents seeded by ``data.seed``, so validation documents never appear in
training. ``data.seed`` also seeds the order of the training windows: a different shuffle each epoch, and the
same batches for the same seed, batch size, process count, data and grain version.

Cache: the token stream of a list of text files is saved with ``np.save`` under ``$FOX_JAX_CACHE/tokens``
(default ``~/.cache/fox_jax/tokens``), keyed by the files' paths, sizes and mtimes, the tokenizer name, the
separator and the text field (splits are made after loading, so changing seed/max_docs/val_fraction reuses it).
A sidecar JSON holds the length, dtype and SHA-256 of the stream; a cache entry that fails to load or to match
is reported with a ``RuntimeWarning`` and rebuilt, never used.

Iterator state: ``TrainIterator.get_state()`` is a small JSON-serialisable dict (grain's position plus the
pipeline parameters); ``set_state`` refuses a state written for a different pipeline (seed, seq_len, batch
size, process count, data). The trainer stores the state with orbax's ``JsonSave`` next to the
model state.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import grain
import numpy as np

from fox_jax.train.config import DataConfig, FieldError
from fox_jax.train.progress import bars_shown, progress_bar
from fox_jax.train.tokenizers import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]

_CACHE_VERSION = 1
_PREPARED_FORMAT = "fox_jax.tokens/1"
_TEXT_SUFFIXES = (".txt", ".jsonl")
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_PROGRESS_MIN_CHARS = 16_000_000  # show a progress bar when tokenizing more text than this
_CHUNK_CHARS = 8_000_000  # characters per encode_batch call


# Files and documents ---------------------------------------------------------------------------

def resolve_paths(specs: Sequence[str], *, arg_name: str) -> list[Path]:
    """Expand file, directory and glob specs into a sorted, de-duplicated list of files.

    A file is taken as given (``.jsonl``: JSON lines, ``.npy``: token stream, anything else: plain text).
    A directory contributes its ``.txt`` files, searched recursively, or, when it holds none, its ``.jsonl``
    files (so a ``manifest.jsonl`` next to ``.txt`` shards is not read as text); hidden entries are skipped.
    A glob (``*``, ``?``, ``[``; ``**`` recurses) contributes every file it matches, expanding directories.

    Args:
      specs: the paths as given on the command line / in ``data.train`` or ``data.val``.
      arg_name: the argument name used in error messages (``"--data"`` or ``"--val-data"``).

    Raises:
      FileNotFoundError: a path does not exist or a glob matches nothing.
      ValueError: a directory holds no ``.txt``/``.jsonl`` file, or is a ``prepare_tokens`` directory
        given together with other paths.
    """
    files: set[Path] = set()
    for spec in specs:
        path = Path(spec).expanduser()
        if any(c in spec for c in "*?["):
            matches = sorted(Path(m) for m in glob.glob(str(path), recursive=True))
            if not matches:
                raise FileNotFoundError(f"{arg_name} {spec!r}: the pattern matches no file; check the path")
            for m in matches:
                files.update(_directory_files(m, spec, arg_name) if m.is_dir() else [m])
        elif path.is_dir():
            files.update(_directory_files(path, spec, arg_name))
        elif path.is_file():
            files.add(path)
        else:
            raise FileNotFoundError(f"{arg_name} {spec!r}: no such file or directory; pass text files "
                                    f"(.txt/.jsonl), directories or globs")
    return sorted((f.resolve() for f in files), key=str)


def _directory_files(directory: Path, spec: str, arg_name: str) -> list[Path]:
    if _prepared_meta(directory) is not None:
        raise ValueError(f"{arg_name} {spec!r} is a prepare_tokens directory; pass it as the only {arg_name} path")
    visible = [p for p in directory.rglob("*")
               if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)]
    for suffix in _TEXT_SUFFIXES:
        found = [p for p in visible if p.suffix == suffix]
        if found:
            return found
    raise ValueError(f"{arg_name} {spec!r}: the directory holds no .txt or .jsonl files; "
                     f"pass the text files or a glob")


def read_documents(files: Sequence[str | Path], separator: str = "<|endoftext|>",
                   text_field: str = "text") -> list[str]:
    """The documents of text files, in file order.

    ``.jsonl``: one document per non-blank line, the string ``record[text_field]``. Any other file: plain text
    split at lines equal to ``separator``; the line break before each separator line belongs to neither
    document, so ``doc + "\\n" + separator + "\\n"`` reads back as ``doc``. Empty and whitespace-only
    documents are dropped. Invalid UTF-8 is decoded with U+FFFD replacement characters.

    Raises:
      ValueError: a ``.jsonl`` line is not valid JSON, not an object, or lacks a string ``text_field``
        (the message gives ``file:line``); a ``.npy`` file is given (it is not text); ``separator`` is empty.
    """
    if not separator:
        raise ValueError("data.separator must be a non-empty string")
    split = re.compile(rf"^{re.escape(separator)}$\n?", re.MULTILINE)
    docs: list[str] = []
    for file in map(Path, files):
        if file.suffix == ".npy":
            raise ValueError(f"{file}: a .npy token file is not text; pass token files and text files separately")
        if file.suffix == ".jsonl":
            docs.extend(_read_jsonl(file, text_field))
            continue
        for part in split.split(file.read_text(encoding="utf-8", errors="replace")):
            doc = part[:-1] if part.endswith("\n") else part
            if doc.strip():
                docs.append(doc)
    return docs


def _read_jsonl(file: Path, text_field: str) -> Iterable[str]:
    with open(file, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{file}:{lineno}: the record has no string field {text_field!r}; "
                                 f"set data.text_field to the field that holds the text")
            if text.strip():
                yield text


def default_corpus_files() -> list[Path]:
    """The built-in corpus: every ``.py`` file of the running interpreter's standard library
    (``sysconfig.get_paths()["stdlib"]``), one document per file, sorted by path.

    ``site-packages``/``dist-packages``, ``__pycache__`` and the test directories (``test``, ``tests``,
    ``idle_test``) are skipped. About 12 MB / 730 files for CPython 3.11; it differs between Python versions,
    so runs on the default corpus are only comparable on the same interpreter.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith(".")]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=str)


# Tokens ----------------------------------------------------------------------------------------

def token_dtype(vocab_size: int) -> np.dtype:
    """Storage dtype of a token stream: uint16 when every id fits (``vocab_size <= 65536``), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def tokenize_documents(docs: Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    """Concatenate ``[eot] + tokens(doc)`` over the documents.

    Documents are encoded in chunks of about 8 M characters with ``tokenizer.encode_batch`` (parallel for
    the ``tokenizers`` library); a tqdm bar is shown for more than 16 M characters.

    Returns:
      ``[sum(1 + len(tokens(doc)))]`` array of ``token_dtype(tokenizer.vocab_size)``.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    total = sum(len(d) for d in docs)
    pieces = []
    if total >= _PROGRESS_MIN_CHARS and not bars_shown():  # no bar in logs: say why it is quiet
        print(f"tokenizing {total / 1e6:.0f} M characters (about a minute per 100 MB; cached afterwards)",
              file=sys.stderr, flush=True)
    with progress_bar(total=total, unit="char", unit_scale=True, desc="tokenizing",
                      progress=total >= _PROGRESS_MIN_CHARS) as bar:
        for chunk in _chunks(docs, _CHUNK_CHARS):
            for ids in tokenizer.encode_batch(chunk):
                piece = np.empty(len(ids) + 1, dtype)
                piece[0] = tokenizer.eot_id
                piece[1:] = ids
                pieces.append(piece)
            bar.update(sum(len(d) for d in chunk))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype)


def _chunks(docs: Sequence[str], max_chars: int) -> Iterable[list[str]]:
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= max_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def doc_starts(tokens: np.ndarray, eot_id: int) -> np.ndarray:
    """Start offsets (int64 ``[num_docs]``) of the documents of a stream: every eot position, plus 0 when
    the stream does not start with eot (a leading partial document)."""
    starts = np.flatnonzero(tokens == eot_id)
    if len(tokens) and tokens[0] != eot_id:
        starts = np.concatenate([[0], starts])
    return starts.astype(np.int64)


def _cache_dir() -> Path:
    return Path(os.environ.get("FOX_JAX_CACHE") or "~/.cache/fox_jax").expanduser() / "tokens"


def _cached_tokens(files: Sequence[Path], tokenizer: Tokenizer, cfg: DataConfig, arg_name: str) -> np.ndarray:
    """``tokenize_documents(read_documents(files))``, through the on-disk cache."""
    entries = [[str(f), st.st_size, st.st_mtime_ns] for f, st in ((f, f.stat()) for f in files)]
    key = json.dumps({"version": _CACHE_VERSION, "files": entries, "tokenizer": tokenizer.name,
                      "separator": cfg.separator, "text_field": cfg.text_field})
    path = _cache_dir() / f"{tokenizer.name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.npy"
    tokens = _read_cache(path, token_dtype(tokenizer.vocab_size))
    if tokens is not None:
        log.info("loaded %d tokens of %d file(s) from the cache %s", len(tokens), len(files), path)
        return tokens
    t0 = time.perf_counter()
    docs = read_documents(files, cfg.separator, cfg.text_field)
    if not docs:
        raise ValueError(f"{arg_name}: the {len(files)} file(s) hold no documents (they are empty or hold only "
                         f"separators / blank texts); pass files with text")
    tokens = tokenize_documents(docs, tokenizer)
    log.info("tokenized %d documents of %d file(s) into %d tokens in %.1f s", len(docs), len(files),
             len(tokens), time.perf_counter() - t0)
    _write_cache(path, tokens)
    return tokens


def _read_cache(path: Path, dtype: np.dtype) -> np.ndarray | None:
    """The cached stream, or None when absent; a corrupt entry is reported (RuntimeWarning) and ignored."""
    meta_path = path.with_suffix(".json")
    if not path.exists() and not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        tokens = np.load(path, allow_pickle=False)
        if tokens.dtype != dtype or tokens.shape != (meta["num_tokens"],):
            problem = f"dtype/shape {tokens.dtype}{list(tokens.shape)} != {dtype}[{meta['num_tokens']}]"
        elif hashlib.sha256(tokens.tobytes()).hexdigest() != meta["sha256"]:
            problem = "checksum mismatch"
        else:
            return tokens
    except Exception as e:  # any failure to read the entry means: rebuild it
        problem = f"{type(e).__name__}: {e}"
    warnings.warn(f"token cache {path} is corrupt ({problem}); re-tokenizing", RuntimeWarning, stacklevel=3)
    return None


def _write_cache(path: Path, tokens: np.ndarray) -> None:
    """Write the stream, then its sidecar JSON, each atomically (tmp file + rename)."""
    meta = {"num_tokens": int(len(tokens)), "dtype": tokens.dtype.name,
            "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, lambda f: np.save(f, tokens))
        _atomic_write(path.with_suffix(".json"), lambda f: f.write(json.dumps(meta).encode()))
    except OSError as e:
        warnings.warn(f"cannot write the token cache {path} ({e}); continuing without it", RuntimeWarning,
                      stacklevel=3)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def _prepared_meta(directory: Path) -> dict | None:
    """The meta.json of a ``prepare_tokens`` directory, or None when ``directory`` is not one."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == _PREPARED_FORMAT else None


def _load_token_file(path: Path, tokenizer: Tokenizer, arg_name: str) -> np.ndarray:
    """A 1-D integer .npy stream, checked against the vocabulary and cast to ``token_dtype``."""
    try:
        tokens = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{arg_name} {str(path)!r}: not a readable .npy token file ({e})") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or not len(tokens):
        raise ValueError(f"{arg_name} {str(path)!r}: expected a non-empty 1-D integer token array, "
                         f"got {tokens.dtype}{list(tokens.shape)}")
    if tokens.min() < 0 or tokens.max() >= tokenizer.vocab_size:
        raise ValueError(f"{arg_name} {str(path)!r}: token ids span [{tokens.min()}, {tokens.max()}] but the "
                         f"tokenizer {tokenizer.name!r} has vocab_size {tokenizer.vocab_size}; "
                         f"pass the --tokenizer the file was made with")
    return tokens.astype(token_dtype(tokenizer.vocab_size), copy=False)


def _read_split(specs: Sequence[str], split: str, tokenizer: Tokenizer, cfg: DataConfig) -> np.ndarray:
    """The whole token stream of ``data.train`` (split ``"train"``) or ``data.val`` (``"val"``)."""
    arg_name = "--data" if split == "train" else "--val-data"
    if len(specs) == 1 and (meta := _prepared_meta(Path(specs[0]).expanduser())) is not None:
        if meta["tokenizer"] != tokenizer.name:
            raise ValueError(f"{arg_name} {specs[0]!r} was tokenized with {meta['tokenizer']!r}, but --tokenizer "
                             f"{cfg.tokenizer!r} is {tokenizer.name!r}; pass --tokenizer {specs[0]}/tokenizer "
                             f"(or 'bytes' if that is what it was made with)")
        return _load_token_file(Path(specs[0]).expanduser() / f"{split}.npy", tokenizer, arg_name)
    files = resolve_paths(specs, arg_name=arg_name) if specs else default_corpus_files()
    token_files = [f for f in files if f.suffix == ".npy"]
    if not token_files:
        return _cached_tokens(files, tokenizer, cfg, arg_name)
    if len(token_files) != len(files):
        raise ValueError(f"{arg_name}: cannot mix pre-tokenized .npy files with text files")
    return np.concatenate([_load_token_file(f, tokenizer, arg_name) for f in token_files])


# Corpus ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """Tokenized training and validation streams.

    Attributes:
      tokenizer: the tokenizer (``vocab_size``, ``eot_id``, ``decode`` for samples).
      train_tokens: ``[N_train]`` uint16/uint32 (``token_dtype``): ``[eot] doc [eot] doc ...``.
      val_tokens: ``[N_val]``, same format, disjoint documents.
      config: the ``DataConfig`` it was loaded from (``seq_len`` and ``seed`` drive the batching).
    """

    tokenizer: Tokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    config: DataConfig

    @property
    def num_train_windows(self) -> int:
        """Training windows (sequences) per epoch: ``(N_train - 1) // seq_len``."""
        return (len(self.train_tokens) - 1) // self.config.seq_len

    @property
    def num_val_windows(self) -> int:
        """Validation windows: ``(N_val - 1) // seq_len``."""
        return (len(self.val_tokens) - 1) // self.config.seq_len

    def summary(self) -> str:
        """One line: documents, tokens and windows of both splits."""
        eot = self.tokenizer.eot_id
        return (f"train {len(doc_starts(self.train_tokens, eot))} docs / {len(self.train_tokens):,} tokens / "
                f"{self.num_train_windows:,} windows; val {len(doc_starts(self.val_tokens, eot))} docs / "
                f"{len(self.val_tokens):,} tokens; tokenizer {self.tokenizer.name} (vocab {self.tokenizer.vocab_size})")


def load_corpus(data_cfg: DataConfig, *, tokenizer: Tokenizer | None = None,
                splits: tuple[str, ...] = ("train", "val")) -> Corpus:
    """Read, tokenize (cached), subset and split the data described by ``data_cfg``.

    Args:
      data_cfg: the ``DataConfig``; see the module docstring for sources, splits and caching.
      tokenizer: an already loaded tokenizer; default ``load_tokenizer(data_cfg.tokenizer)``.
      splits: the streams that must hold a window of ``seq_len + 1`` tokens ("train", "val"; evaluation
        reads only "val").

    Raises:
      FileNotFoundError / ValueError: bad paths (naming ``--data``/``--val-data``), malformed files, a bad
        tokenizer, fewer than 2 documents to split, a stream shorter than ``seq_len + 1`` tokens, or
        invalid ``seq_len``/``val_fraction``/``max_docs``.
    """
    cfg = data_cfg
    if cfg.seq_len < 1:
        raise ValueError(f"data.seq_len must be positive, got {cfg.seq_len}")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in [0, 1), got {cfg.val_fraction}")
    if cfg.max_docs < 0:
        raise ValueError(f"data.max_docs must be >= 0 (0 = all), got {cfg.max_docs}")
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
    everything = _read_split(cfg.train, "train", tok, cfg)
    starts = doc_starts(everything, tok.eot_id)
    order = np.random.default_rng(cfg.seed).permutation(len(starts))
    if cfg.max_docs:
        order = order[:cfg.max_docs]

    prepared = _prepared_meta(Path(cfg.train[0]).expanduser()) if len(cfg.train) == 1 else None
    if cfg.val:
        train, val = _take_docs(everything, starts, order), _read_split(cfg.val, "val", tok, cfg)
    elif prepared is not None:
        train, val = _take_docs(everything, starts, order), _read_split(cfg.train, "val", tok, cfg)
    else:
        if len(order) < 2 <= len(starts):
            raise ValueError(f"--data: data.max_docs={cfg.max_docs} keeps {len(order)} of the {len(starts)} documents, "
                             "and holding out validation documents needs at least 2: raise data.max_docs or pass --val-data")
        if len(order) < 2:
            raise ValueError(f"--data: the corpus has {len(order)} document(s), and holding out validation "
                             f"documents needs at least 2: separate the documents of a .txt file by a line "
                             f"{cfg.separator} (data.separator), give one file per document (a directory or a "
                             f"glob), or pass --val-data")
        n_val = min(max(1, round(cfg.val_fraction * len(order))), len(order) - 1)
        train = _take_docs(everything, starts, order[n_val:])
        val = _take_docs(everything, starts, order[:n_val])

    held_out = "" if cfg.val or prepared is not None else " (held out of the training text)"
    for split, what, arg, tokens in (("train", "training text", "--data", train),
                                     ("val", f"validation text{held_out}", "--val-data", val)):
        if split in splits and len(tokens) < cfg.seq_len + 1:
            raise FieldError(f"the {what} has {len(tokens):,} tokens, but data.seq_len {cfg.seq_len} needs at least "
                             f"{cfg.seq_len + 1:,} (a window and its next token); pass more text ({arg}) or a smaller "
                             "data.seq_len", "data.seq_len")
    corpus = Corpus(tokenizer=tok, train_tokens=train, val_tokens=val, config=cfg)
    log.info("corpus: %s", corpus.summary())
    return corpus


def _take_docs(tokens: np.ndarray, starts: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
    """The documents ``doc_ids`` of a stream, in stream order."""
    keep = np.zeros(len(starts), bool)
    keep[doc_ids] = True
    if keep.all():
        return tokens
    return tokens[np.repeat(keep, np.diff(np.append(starts, len(tokens))))]


def _as_corpus(data: Corpus | DataConfig, tokenizer: Tokenizer | None) -> Corpus:
    return data if isinstance(data, Corpus) else load_corpus(data, tokenizer=tokenizer)


# Batches ---------------------------------------------------------------------------------------

def pack_windows(tokens: np.ndarray, window_ids: Sequence[int] | np.ndarray, *, seq_len: int,
                 eot_id: int) -> Batch:
    """Training examples from windows ``tokens[i*seq_len : i*seq_len + seq_len + 1]``.

    Args:
      tokens: ``[N]`` integer token stream.
      window_ids: ``[B]`` window indices, each ``< (N - 1) // seq_len``.
      seq_len: ``T``.
      eot_id: the document-start token.

    Returns:
      ``Batch`` with int32 ``inputs``, ``targets``, ``segment_ids``, ``positions`` of shape ``[B, T]``
      (see the module docstring).
    """
    starts = np.asarray(window_ids, np.int64) * seq_len
    windows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    inputs = windows[:, :-1]
    is_start = inputs == eot_id
    is_start[:, 0] = True
    index = np.arange(seq_len, dtype=np.int32)
    segment_start = np.maximum.accumulate(np.where(is_start, index, 0), axis=1)
    return {"inputs": inputs, "targets": windows[:, 1:],
            "segment_ids": np.cumsum(is_start, axis=1, dtype=np.int32),
            "positions": (index - segment_start).astype(np.int32)}


def _check_batch(batch_size: int, process_index: int, process_count: int) -> None:
    if batch_size < 1 or process_count < 1 or batch_size % process_count:
        raise ValueError(f"batch_size ({batch_size}) must be a positive multiple of process_count ({process_count})")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")


class TrainIterator:
    """Endless iterator over training ``Batch``es (a grain ``DatasetIterator`` plus its pipeline parameters).

    ``get_state()`` returns ``{"grain": <grain's state>, "pipeline": {...}}`` (JSON-serialisable; the same on
    every process, so one copy can be stored); ``set_state(state)`` moves to that position.
    """

    def __init__(self, dataset: grain.IterDataset, pipeline: dict[str, int]):
        self._iterator = iter(dataset)
        self.pipeline = pipeline

    def __iter__(self) -> "TrainIterator":
        return self

    def __next__(self) -> Batch:
        return next(self._iterator)

    def get_state(self) -> dict:
        return {"grain": self._iterator.get_state(), "pipeline": dict(self.pipeline)}

    def set_state(self, state: dict) -> None:
        """Restore a position saved by ``get_state``.

        Raises:
          ValueError: the state was saved for another pipeline (names the parameters that differ).
        """
        saved = state.get("pipeline", {})
        diff = [f"{k}={saved.get(k)} (now {v})" for k, v in self.pipeline.items() if saved.get(k) != v]
        if diff or "grain" not in state:
            raise ValueError(f"the data iterator state belongs to another data pipeline (saved with "
                             f"{', '.join(diff) or 'no grain state'}); resume with the same data config and batch size")
        self._iterator.set_state(state["grain"])

    def close(self) -> None:
        """Stop grain's prefetch threads."""
        self._iterator.close()


def make_train_iterator(data: Corpus | DataConfig, batch_size: int, *, tokenizer: Tokenizer | None = None,
                        process_index: int = 0, process_count: int = 1) -> TrainIterator:
    """Shuffled, endlessly repeated training batches for this process.

    The windows ``0 .. corpus.num_train_windows - 1`` are shuffled with ``data.seed`` (reshuffled each epoch),
    and element ``j`` of that global order goes to process ``j % process_count``; global batch ``b`` is
    elements ``[b * batch_size, (b + 1) * batch_size)``, i.e. the union of the processes' ``b``-th batches.

    Args:
      data: a ``Corpus``, or a ``DataConfig`` to load.
      batch_size: global sequences per batch; each process gets ``batch_size // process_count`` rows.
      tokenizer: only used to load a ``DataConfig``.
      process_index, process_count: this host's slice (``jax.process_index()``, ``jax.process_count()``).

    Returns:
      ``TrainIterator`` yielding ``Batch`` dicts of int32 ``[batch_size // process_count, seq_len]`` arrays.

    Raises:
      ValueError: ``batch_size`` not a positive multiple of ``process_count``, or a bad ``process_index``.
    """
    _check_batch(batch_size, process_index, process_count)
    corpus = _as_corpus(data, tokenizer)
    cfg = corpus.config
    ds = grain.MapDataset.range(corpus.num_train_windows).shuffle(seed=cfg.seed).repeat()
    ds = ds[process_index::process_count].batch(batch_size // process_count, drop_remainder=True)
    ds = ds.map(lambda ids: pack_windows(corpus.train_tokens, ids, seq_len=cfg.seq_len,
                                         eot_id=corpus.tokenizer.eot_id))
    pipeline = {"seed": cfg.seed, "seq_len": cfg.seq_len, "batch_size": batch_size,
                "process_count": process_count, "num_windows": corpus.num_train_windows,
                "num_tokens": len(corpus.train_tokens)}
    return TrainIterator(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)), pipeline)


def make_val_batches(data: Corpus | DataConfig, batch_size: int, num_batches: int, *,
                     tokenizer: Tokenizer | None = None, process_index: int = 0,
                     process_count: int = 1) -> list[Batch]:
    """The first ``num_batches * batch_size`` windows of the validation stream, in order, as batches.

    Fewer batches are returned when the stream is shorter (only full batches). Rows are split between
    processes like ``make_train_iterator``'s.

    Returns:
      list of ``Batch`` (int32 ``[batch_size // process_count, seq_len]`` arrays), at least one.

    Raises:
      ValueError: ``num_batches < 1``, a bad batch size / process index, or fewer than ``batch_size``
        validation windows.
    """
    _check_batch(batch_size, process_index, process_count)
    if num_batches < 1:
        raise ValueError(f"num_batches must be positive, got {num_batches}")
    corpus = _as_corpus(data, tokenizer)
    seq_len = corpus.config.seq_len
    available = corpus.num_val_windows // batch_size
    if not available:
        raise ValueError(f"the validation stream has {len(corpus.val_tokens)} tokens = {corpus.num_val_windows} "
                         f"windows of seq_len {seq_len}, fewer than one batch of {batch_size}; use a smaller "
                         f"batch size or seq_len, or more validation data")
    rows = np.arange(batch_size)[process_index::process_count]
    return [pack_windows(corpus.val_tokens, b * batch_size + rows, seq_len=seq_len, eot_id=corpus.tokenizer.eot_id)
            for b in range(min(num_batches, available))]


def document_windows(data: Corpus | DataConfig, num_docs: int, *,
                     tokenizer: Tokenizer | None = None) -> dict[str, np.ndarray]:
    """The first ``seq_len`` tokens of each of the first ``num_docs`` validation documents, for loss by position.

    Row ``i`` holds document ``i`` from its start: ``inputs = ([eot] + doc)[:T]``, ``targets`` shifted by one,
    zero-padded to ``T = seq_len`` (documents shorter than ``T`` are kept and masked).

    Returns:
      dict of ``[D, T]`` arrays, ``D = min(num_docs, validation documents)``: int32 ``inputs``, ``targets``,
      ``segment_ids`` (1 on real inputs, 0 on padding), ``positions`` (``arange(T)``), and float32 ``mask``
      (1 where ``targets`` is a token of the row's document, 0 after its end).

    Raises:
      ValueError: ``num_docs < 1``.
    """
    if num_docs < 1:
        raise ValueError(f"num_docs must be positive, got {num_docs}")
    corpus = _as_corpus(data, tokenizer)
    seq_len, val = corpus.config.seq_len, corpus.val_tokens
    starts = doc_starts(val, corpus.tokenizer.eot_id)
    ends = np.append(starts[1:], len(val))
    n = min(num_docs, len(starts))
    out = {k: np.zeros((n, seq_len), np.int32) for k in ("inputs", "targets", "segment_ids")}
    out["mask"] = np.zeros((n, seq_len), np.float32)
    for i in range(n):
        doc = val[starts[i]:min(ends[i], starts[i] + seq_len + 1)]
        n_in, n_tgt = min(len(doc), seq_len), len(doc) - 1
        out["inputs"][i, :n_in] = doc[:n_in]
        out["segment_ids"][i, :n_in] = 1
        out["targets"][i, :n_tgt] = doc[1:]
        out["mask"][i, :n_tgt] = 1.0
    out["positions"] = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (n, seq_len)).copy()
    return out


# Pre-tokenized data ----------------------------------------------------------------------------

def prepare_tokens(data_cfg: DataConfig, out_dir: str | Path) -> Path:
    """Tokenize and split once, and write the result to carry to another machine.

    Writes ``out_dir/train.npy`` and ``out_dir/val.npy`` (``token_dtype``: uint16 for GPT-2), the tokenizer's
    files under ``out_dir/tokenizer/`` (none for ``bytes``), and ``out_dir/meta.json`` (format, tokenizer name,
    vocab size, eot id, token counts, the ``DataConfig``). Train elsewhere with ``data.train=<out_dir>``
    (``data.val`` empty: ``val.npy`` is used) and ``data.tokenizer=<out_dir>/tokenizer`` (or ``bytes``).
    ``seq_len`` and ``seed`` of the later run are free; ``max_docs`` then subsets the training documents.

    Returns:
      ``Path(out_dir)``.
    """
    corpus = load_corpus(data_cfg)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "train.npy", corpus.train_tokens)
    np.save(out / "val.npy", corpus.val_tokens)
    tok = corpus.tokenizer
    if tok.files:
        (out / "tokenizer").mkdir(exist_ok=True)
        for f in tok.files:
            shutil.copyfile(f, out / "tokenizer" / Path(f).name)
    meta = {"format": _PREPARED_FORMAT, "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
            "dtype": corpus.train_tokens.dtype.name, "train_tokens": len(corpus.train_tokens),
            "val_tokens": len(corpus.val_tokens), "data_config": dataclasses.asdict(data_cfg)}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fox_jax.train.data OUT_DIR --data ... [--val-data ...] --tokenizer ...``: run ``prepare_tokens``."""
    defaults = DataConfig()
    p = argparse.ArgumentParser(prog="python -m fox_jax.train.data", description=prepare_tokens.__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--data", nargs="*", default=[], help="text files/dirs/globs (default: Python stdlib)")
    p.add_argument("--val-data", nargs="*", default=[], help="validation files (default: hold out documents)")
    p.add_argument("--tokenizer", default=defaults.tokenizer)
    p.add_argument("--val-fraction", type=float, default=defaults.val_fraction)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--max-docs", type=int, default=defaults.max_docs)
    p.add_argument("--separator", default=defaults.separator)
    p.add_argument("--text-field", default=defaults.text_field)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = DataConfig(train=tuple(args.data), val=tuple(args.val_data), tokenizer=args.tokenizer,
                     val_fraction=args.val_fraction, seed=args.seed, max_docs=args.max_docs,
                     separator=args.separator, text_field=args.text_field)
    try:
        out = prepare_tokens(cfg, args.out_dir)
    except (OSError, ValueError) as e:
        p.error(str(e))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
