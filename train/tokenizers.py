"""Tokenizers: the built-in byte tokenizer and Hugging Face ``tokenizers`` files (GPT-2 BPE, tokenizer.json).

Every tokenizer has the same small interface (``Tokenizer``):

- ``name``: stable identifier, used in cache keys and written next to pre-tokenized data. For file-based
  tokenizers it holds a hash of the files' contents, so it does not depend on where the files live.
- ``vocab_size``: embedding rows needed (largest id + 1).
- ``eot_id``: id of ``<|endoftext|>``, used both as document separator and as BOS (as in FoX/LongCrawl64).
- ``files``: the files that define the tokenizer (empty for ``bytes``); ``fox_jax.train.data.prepare_tokens`` copies them.
- ``encode_batch(texts) -> list[np.ndarray]``: one uint32 array of ids per text; no BOS/EOS is added.
- ``decode(ids) -> str``.

File-based tokenizers read ``vocab_size``/``eot_id`` straight from the JSON files and import the
``tokenizers`` library only on the first ``encode_batch``/``decode``: a machine that only trains on
pre-tokenized data does not need the library.

``load_tokenizer(spec)`` maps the ``--tokenizer`` / ``data.tokenizer`` string to one of them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

EOT_TOKEN = "<|endoftext|>"


class Tokenizer(Protocol):
    """What the data pipeline and the evaluators need from a tokenizer."""

    name: str
    vocab_size: int
    eot_id: int
    files: tuple[Path, ...]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text: a list of uint32 arrays ``[len_i]``, no special tokens added."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of a 1-D sequence of ids."""
        ...


class ByteTokenizer:
    """UTF-8 bytes: ids 0..255 are the bytes, id 256 is ``<|endoftext|>``; ``vocab_size = 257``."""

    name = "bytes"
    vocab_size = 257
    eot_id = 256
    files: tuple[Path, ...] = ()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """UTF-8 bytes of each text as uint32 arrays (unencodable lone surrogates become ``?``)."""
        return [np.frombuffer(t.encode("utf-8", errors="replace"), np.uint8).astype(np.uint32) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Bytes -> text (invalid UTF-8 becomes U+FFFD); the eot id decodes to ``<|endoftext|>``.

        Raises:
          ValueError: an id outside ``[0, 257)``.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"ByteTokenizer.decode: id {int(bad[0])} is outside [0, {self.vocab_size})")
        out, start = [], 0
        for pos in np.flatnonzero(ids == self.eot_id):
            out.append(bytes(ids[start:pos].astype(np.uint8)).decode("utf-8", errors="replace"))
            out.append(EOT_TOKEN)
            start = pos + 1
        out.append(bytes(ids[start:].astype(np.uint8)).decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A tokenizer of the Hugging Face ``tokenizers`` library, built from GPT-2 ``vocab.json`` + ``merges.txt``
    (byte-level BPE with GPT-2's ids; ``<|endoftext|>`` is an ordinary vocabulary entry, so the literal
    string in a text is split into ordinary tokens) or from a ``tokenizer.json`` (special tokens as that
    file defines them). Use ``from_gpt2_files`` / ``from_tokenizer_json``; both raise ``ValueError`` when
    the files hold no ``<|endoftext|>`` token.
    """

    def __init__(self, *, name: str, vocab_size: int, eot_id: int, files: tuple[Path, ...]):
        self.name = name
        self.vocab_size = vocab_size
        self.eot_id = eot_id
        self.files = files
        self._tokenizer = None  # the ``tokenizers.Tokenizer``, built on first use

    @classmethod
    def from_gpt2_files(cls, directory: str | Path) -> "HFTokenizer":
        """GPT-2 byte-level BPE from ``directory/vocab.json`` + ``directory/merges.txt`` (50,257 ids, eot 50,256)."""
        directory = Path(directory)
        vocab_path, merges_path = directory / "vocab.json", directory / "merges.txt"
        vocab = _read_json(vocab_path)
        if not isinstance(vocab, dict) or not vocab:
            raise ValueError(f"{vocab_path}: expected a JSON object mapping tokens to ids")
        if EOT_TOKEN not in vocab:
            raise ValueError(f"{vocab_path}: the vocabulary has no special token {EOT_TOKEN!r} (needed as eot/BOS)")
        return cls(name=f"gpt2-bpe-{_digest(vocab_path, merges_path)}", vocab_size=max(vocab.values()) + 1,
                   eot_id=int(vocab[EOT_TOKEN]), files=(vocab_path, merges_path))

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> "HFTokenizer":
        """Any ``tokenizer.json``; ``eot_id`` is the id of its ``<|endoftext|>`` (added token or vocabulary entry)."""
        path = Path(path)
        spec = _read_json(path)
        model = spec.get("model") if isinstance(spec, dict) else None
        if not isinstance(model, dict) or "vocab" not in model:
            raise ValueError(f"{path}: not a tokenizers 'tokenizer.json' (no model.vocab); for GPT-2's "
                             "vocab.json + merges.txt pass the directory that holds them")
        # BPE/WordPiece/WordLevel store {token: id}; Unigram stores [[piece, score], ...] with id = index.
        vocab = model["vocab"]
        ids = dict(vocab) if isinstance(vocab, dict) else {piece: i for i, (piece, _score) in enumerate(vocab)}
        ids.update({t["content"]: int(t["id"]) for t in spec.get("added_tokens") or []})
        if EOT_TOKEN not in ids:
            raise ValueError(f"{path}: the tokenizer has no special token {EOT_TOKEN!r} (needed as eot/BOS); "
                             f"add it as an added token")
        return cls(name=f"tokenizer-json-{_digest(path)}", vocab_size=max(ids.values()) + 1,
                   eot_id=int(ids[EOT_TOKEN]), files=(path,))

    def _library_tokenizer(self):
        if self._tokenizer is None:
            import tokenizers  # the Hugging Face library (this module is fox_jax.train.tokenizers)

            if len(self.files) == 2:
                vocab_path, merges_path = self.files
                tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(str(vocab_path), str(merges_path)))
                tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
                tok.decoder = tokenizers.decoders.ByteLevel()
            else:
                tok = tokenizers.Tokenizer.from_file(str(self.files[0]))
            self._tokenizer = tok
        return self._tokenizer

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text (uint32), encoded in parallel by the library; no special tokens added."""
        tok = self._library_tokenizer()
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # *_fast (no offsets) needs tokenizers>=0.20
        return [np.array(e.ids, dtype=np.uint32) for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of the ids; special tokens are kept (eot decodes to ``<|endoftext|>``)."""
        return self._library_tokenizer().decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                                skip_special_tokens=False)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by ``--tokenizer`` / ``data.tokenizer``.

    Args:
      spec: ``"bytes"``; a directory holding GPT-2 ``vocab.json`` + ``merges.txt``; a ``tokenizer.json`` file,
        or a directory holding one (``vocab.json`` + ``merges.txt`` win when a directory has both).

    Raises:
      ValueError: ``spec`` is none of these, or the files are malformed or lack ``<|endoftext|>``.
    """
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    expected = ("expected 'bytes', a directory with GPT-2 vocab.json + merges.txt, "
                "or a tokenizer.json file (or a directory containing one)")
    if path.is_dir():
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return HFTokenizer.from_gpt2_files(path)
        if (path / "tokenizer.json").is_file():
            return HFTokenizer.from_tokenizer_json(path / "tokenizer.json")
        raise ValueError(f"--tokenizer {spec!r}: the directory holds neither vocab.json + merges.txt "
                         f"nor tokenizer.json; {expected}")
    if path.is_file() and path.suffix == ".json":
        return HFTokenizer.from_tokenizer_json(path)
    what = "no such file or directory" if not path.exists() else "not a tokenizer file"
    raise ValueError(f"--tokenizer {spec!r}: {what}; {expected}")


def _read_json(path: Path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read tokenizer file ({e})") from None


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:12]
