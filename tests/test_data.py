"""Tests of fox_jax.train.tokenizers and fox_jax.train.data: reading, tokenizing, caching, splitting, packing,
iterating."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from fox_jax.train.config import DataConfig
from fox_jax.train.data import (
    default_corpus_files, doc_starts, document_windows, load_corpus, make_train_iterator,
    make_val_batches, pack_windows, prepare_tokens, read_documents, resolve_paths,
)
from fox_jax.train.tokenizers import ByteTokenizer, load_tokenizer

SEP = "<|endoftext|>"
SHARED_DATA = Path(os.environ.get("FOX_JAX_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
GPT2_DIR = SHARED_DATA / "tokenizers" / "gpt2"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FOX_JAX_CACHE", str(tmp_path / "cache"))


def make_docs(n: int, length: int = 300) -> list[str]:
    """``n`` distinct documents of about ``length`` characters."""
    return [(f"doc {i:03d}: " + "the quick brown fox jumps. " * (length // 27 + 1))[:length] for i in range(n)]


def write_txt(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(d + f"\n{SEP}\n" for d in docs))
    return path


def docs_of(tokens: np.ndarray, tok=ByteTokenizer()) -> list[str]:
    """Decode a byte-tokenizer stream back into its documents."""
    starts = list(doc_starts(tokens, tok.eot_id)) + [len(tokens)]
    return [tok.decode(tokens[a + 1:b]) for a, b in zip(starts[:-1], starts[1:])]


# Tokenizers ------------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("bytes")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("bytes", 257, 256)
    text = "héllo wörld ✓\n\ttabs"
    (ids,) = tok.encode_batch([text])
    assert ids.dtype == np.uint32 and list(ids[:2]) == [104, 0xC3]
    assert tok.decode(ids) == text
    assert tok.decode([104, 256, 105]) == f"h{SEP}i"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([300])


def test_gpt2_tokenizer_known_ids():
    if not GPT2_DIR.is_dir():
        pytest.skip(f"shared data not found at {GPT2_DIR} (set FOX_JAX_SHARED_DATA)")
    tok = load_tokenizer(str(GPT2_DIR))
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    assert tok.name.startswith("gpt2-bpe-") and tok.name == load_tokenizer(str(GPT2_DIR)).name
    hello, other = tok.encode_batch(["Hello world", " The quick brown fox"])
    assert list(hello) == [15496, 995]
    assert list(other) == [383, 2068, 7586, 21831]
    assert tok.decode(other) == " The quick brown fox"
    assert tok.decode([50256]) == SEP


def test_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "a": 1, "b": 2}
    lib = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    lib.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    lib.save(str(tmp_path / "noeot.json"))
    with pytest.raises(ValueError, match="no special token"):
        load_tokenizer(str(tmp_path / "noeot.json"))
    lib.add_special_tokens([SEP])
    (tmp_path / "dir").mkdir()
    lib.save(str(tmp_path / "dir" / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "dir"))
    assert (tok.vocab_size, tok.eot_id) == (4, 3)
    assert [list(x) for x in tok.encode_batch(["a b", "b c"])] == [[1, 2], [2, 0]]


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer.*no such file"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--tokenizer.*neither vocab.json"):
        load_tokenizer(str(tmp_path))


# Files and documents ---------------------------------------------------------------------------

def test_read_documents_splits_on_separator_lines(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text(f"{SEP}\nfirst doc\nline two\n\n{SEP}\n   \n{SEP}\nnot {SEP} a separator\n{SEP}\n"
                 f"{SEP}\nlast doc without separator\n")
    assert read_documents([f]) == ["first doc\nline two\n", f"not {SEP} a separator", "last doc without separator"]
    g = tmp_path / "crlf.txt"
    g.write_bytes(b"one\r\n<|endoftext|>\r\ntwo\r\n")
    assert read_documents([g]) == ["one", "two"]
    docs = make_docs(3)
    assert read_documents([write_txt(tmp_path / "b.txt", docs)]) == docs  # the exact shard format
    assert read_documents([tmp_path / "b.txt"], separator="@@") == ["".join(d + f"\n{SEP}\n" for d in docs)[:-1]]


def test_read_documents_jsonl(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text(json.dumps({"text": "one\nline", "id": 1}) + "\n\n" + json.dumps({"body": "x", "text": ""}) + "\n"
                 + json.dumps({"text": "two"}) + "\n")
    assert read_documents([f]) == ["one\nline", "two"]
    g = tmp_path / "b.jsonl"
    g.write_text(json.dumps({"body": "one"}) + "\n")
    assert read_documents([g], text_field="body") == ["one"]
    with pytest.raises(ValueError, match=r"b\.jsonl:1: .*'text'"):
        read_documents([g])
    g.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"b\.jsonl:2: invalid JSON"):
        read_documents([g])


def test_resolve_paths(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("d/b.txt", "d/sub/a.txt", "d/manifest.jsonl", "d/.hidden.txt", "d/notes.md"):
        (tmp_path / name).write_text("x")
    txt = [tmp_path / "d" / "b.txt", tmp_path / "d" / "sub" / "a.txt"]
    assert resolve_paths([str(tmp_path / "d")], arg_name="--data") == sorted(txt, key=str)
    assert resolve_paths([str(tmp_path / "d" / "*.jsonl"), str(tmp_path / "d" / "b.txt")], arg_name="--data") == [
        tmp_path / "d" / "b.txt", tmp_path / "d" / "manifest.jsonl"]
    assert resolve_paths([str(tmp_path / "d" / "**" / "*.txt")], arg_name="--data") == sorted(txt, key=str)
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "x.jsonl").write_text("{}")
    assert resolve_paths([str(tmp_path / "j")], arg_name="--data") == [tmp_path / "j" / "x.jsonl"]
    with pytest.raises(FileNotFoundError, match="--val-data .*no such file"):
        resolve_paths([str(tmp_path / "nope.txt")], arg_name="--val-data")
    with pytest.raises(FileNotFoundError, match="--data .*matches no file"):
        resolve_paths([str(tmp_path / "*.nothing")], arg_name="--data")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="--data .*no .txt or .jsonl"):
        resolve_paths([str(tmp_path / "empty")], arg_name="--data")


def test_default_corpus_files():
    files = default_corpus_files()
    assert len(files) > 100 and files == sorted(files, key=str)
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)


# Corpus ----------------------------------------------------------------------------------------

def test_empty_and_tiny_corpora_raise(tmp_path):
    write_txt(tmp_path / "seps.txt", ["", "  "])
    with pytest.raises(ValueError, match="--data: .*hold no documents"):
        load_corpus(DataConfig(train=(str(tmp_path / "seps.txt"),), seq_len=8))
    write_txt(tmp_path / "one.txt", make_docs(1))
    with pytest.raises(ValueError, match=r"1 document.*at least 2: separate the documents of a \.txt file by a line "
                                         r"<\|endoftext\|>") as e:
        load_corpus(DataConfig(train=(str(tmp_path / "one.txt"),), seq_len=8))
    assert "max_docs" not in str(e.value)  # it cannot help here
    write_txt(tmp_path / "two.txt", make_docs(2, length=50))
    with pytest.raises(ValueError, match=r"the training text has \d+ tokens, but data.seq_len 4096 needs"):
        load_corpus(DataConfig(train=(str(tmp_path / "two.txt"),), seq_len=4096))
    with pytest.raises(FileNotFoundError, match="--data"):
        load_corpus(DataConfig(train=(str(tmp_path / "missing"),)))


def test_val_split_is_disjoint_and_seeded(tmp_path):
    docs = make_docs(40)
    (tmp_path / "train").mkdir()
    write_txt(tmp_path / "train" / "a.txt", docs[:25])
    write_txt(tmp_path / "train" / "b.txt", docs[25:])
    cfg = DataConfig(train=(str(tmp_path / "train"),), seq_len=16, val_fraction=0.1)
    corpus = load_corpus(cfg)
    train, val = docs_of(corpus.train_tokens), docs_of(corpus.val_tokens)
    assert len(val) == 4 and not set(train) & set(val) and sorted(train + val) == sorted(docs)
    assert docs_of(load_corpus(cfg).val_tokens) == val
    assert docs_of(load_corpus(DataConfig(train=cfg.train, seq_len=16, seed=1)).val_tokens) != val
    small = load_corpus(DataConfig(train=cfg.train, seq_len=16, max_docs=10, val_fraction=0.0))
    assert len(docs_of(small.train_tokens)) == 9 and len(docs_of(small.val_tokens)) == 1
    # separate validation files: all training documents are kept
    write_txt(tmp_path / "val.txt", make_docs(3, length=100))
    sep_val = load_corpus(DataConfig(train=cfg.train, val=(str(tmp_path / "val.txt"),), seq_len=16))
    assert sorted(docs_of(sep_val.train_tokens)) == sorted(docs)
    assert docs_of(sep_val.val_tokens) == make_docs(3, length=100)


def test_cache_is_used_and_corruption_is_rebuilt(tmp_path, monkeypatch):
    write_txt(tmp_path / "a.txt", make_docs(10))
    cfg = DataConfig(train=(str(tmp_path / "a.txt"),), seq_len=16)
    first = load_corpus(cfg).train_tokens
    (cache_file,) = (tmp_path / "cache" / "tokens").glob("*.npy")

    import fox_jax.train.data
    real_read = fox_jax.train.data.read_documents
    monkeypatch.setattr(fox_jax.train.data, "read_documents", lambda *a, **k: pytest.fail("cache not used"))
    np.testing.assert_array_equal(load_corpus(cfg).train_tokens, first)

    monkeypatch.setattr(fox_jax.train.data, "read_documents", real_read)
    for corrupt in (lambda b: b[: len(b) // 2], lambda b: b[:-1] + bytes([b[-1] ^ 1]), lambda b: b"garbage"):
        cache_file.write_bytes(corrupt(cache_file.read_bytes()))
        with pytest.warns(RuntimeWarning, match="corrupt"):
            np.testing.assert_array_equal(load_corpus(cfg).train_tokens, first)
        np.testing.assert_array_equal(load_corpus(cfg).train_tokens, first)  # rebuilt: no warning now


def test_cache_key_follows_file_changes(tmp_path):
    f = write_txt(tmp_path / "a.txt", make_docs(4))
    cfg = DataConfig(train=(str(f),), seq_len=16)
    before = load_corpus(cfg)
    write_txt(f, make_docs(5))
    after = load_corpus(cfg)
    assert len(docs_of(after.train_tokens)) + len(docs_of(after.val_tokens)) == 5
    assert len(after.train_tokens) > len(before.train_tokens)


def test_prepare_tokens_round_trip(tmp_path):
    write_txt(tmp_path / "a.txt", make_docs(20))
    cfg = DataConfig(train=(str(tmp_path / "a.txt"),), seq_len=16)
    corpus = load_corpus(cfg)
    out = prepare_tokens(cfg, tmp_path / "prepared")
    assert np.load(out / "train.npy").dtype == np.uint16
    again = load_corpus(DataConfig(train=(str(out),), seq_len=32, seed=5))
    np.testing.assert_array_equal(again.train_tokens, corpus.train_tokens)
    np.testing.assert_array_equal(again.val_tokens, corpus.val_tokens)
    single = load_corpus(DataConfig(train=(str(out / "train.npy"),), val=(str(out / "val.npy"),), seq_len=16))
    np.testing.assert_array_equal(single.train_tokens, corpus.train_tokens)
    if GPT2_DIR.is_dir():
        with pytest.raises(ValueError, match="was tokenized with 'bytes'"):
            load_corpus(DataConfig(train=(str(out),), tokenizer=str(GPT2_DIR)))
    with pytest.raises(ValueError, match="pass it as the only --data path"):
        load_corpus(DataConfig(train=(str(out), str(tmp_path / "a.txt"))))


# Packing and batches ---------------------------------------------------------------------------

def test_pack_windows_segments_and_positions():
    eot = 9
    tokens = np.array([9, 1, 2, 3, 9, 4, 5, 9, 6, 9, 7, 8, 1], np.uint16)
    batch = pack_windows(tokens, [0, 1, 2], seq_len=4, eot_id=eot)
    assert all(v.dtype == np.int32 and v.shape == (3, 4) for v in batch.values())
    np.testing.assert_array_equal(batch["inputs"], [[9, 1, 2, 3], [9, 4, 5, 9], [6, 9, 7, 8]])
    np.testing.assert_array_equal(batch["targets"], [[1, 2, 3, 9], [4, 5, 9, 6], [9, 7, 8, 1]])
    np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 1], [1, 1, 1, 2], [1, 2, 2, 2]])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 3], [0, 1, 2, 0], [0, 0, 1, 2]])


@pytest.fixture
def corpus(tmp_path):
    write_txt(tmp_path / "a.txt", make_docs(30, length=200))
    return load_corpus(DataConfig(train=(str(tmp_path / "a.txt"),), seq_len=32, seed=3))


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_train_iterator_is_deterministic(corpus):
    a, b = make_train_iterator(corpus, 8), make_train_iterator(corpus, 8)
    batches = take(a, 5)
    assert_same_batches(batches, take(b, 5))
    assert batches[0]["inputs"].shape == (8, 32)
    other = make_train_iterator(load_corpus(dataclasses.replace(corpus.config, seed=4)), 8)
    assert not np.array_equal(next(other)["inputs"], batches[0]["inputs"])
    # rows are windows of the stream, in a shuffled order
    first = pack_windows(corpus.train_tokens, np.arange(8), seq_len=32, eot_id=256)
    assert not np.array_equal(first["inputs"], batches[0]["inputs"])
    for it in (a, b, other):
        it.close()


def test_train_iterator_epochs_cover_windows_and_reshuffle(corpus):
    n = corpus.num_train_windows
    it = make_train_iterator(corpus, 1)
    starts = [int(next(it)["targets"][0, 0]) for _ in range(2 * n)]
    it.close()
    windows = pack_windows(corpus.train_tokens, np.arange(n), seq_len=32, eot_id=256)["targets"][:, 0]
    assert sorted(starts[:n]) == sorted(windows.tolist()) == sorted(starts[n:])
    assert starts[:n] != starts[n:]


def test_resume_gives_the_same_batches(corpus):
    it = make_train_iterator(corpus, 4)
    take(it, 7)
    state = json.loads(json.dumps(it.get_state()))  # stored as JSON in the checkpoint
    expected = take(it, 6)
    restored = make_train_iterator(corpus, 4)
    restored.set_state(state)
    assert_same_batches(take(restored, 6), expected)
    with pytest.raises(ValueError, match="batch_size=4 \\(now 8\\)"):
        make_train_iterator(corpus, 8).set_state(state)
    for i in (it, restored):
        i.close()


def test_processes_split_the_global_batch(corpus):
    whole = take(make_train_iterator(corpus, 8), 3)
    parts = [take(make_train_iterator(corpus, 8, process_index=p, process_count=2), 3) for p in range(2)]
    for b in range(3):
        for p in range(2):
            np.testing.assert_array_equal(parts[p][b]["inputs"], whole[b]["inputs"][p::2])
    with pytest.raises(ValueError, match="multiple of process_count"):
        make_train_iterator(corpus, 7, process_count=2)


def test_make_val_batches(corpus):
    n_windows = corpus.num_val_windows
    batches = make_val_batches(corpus, 2, 1000)
    assert len(batches) == n_windows // 2
    expected = pack_windows(corpus.val_tokens, np.arange(4), seq_len=32, eot_id=256)
    np.testing.assert_array_equal(np.concatenate([b["inputs"] for b in batches[:2]]), expected["inputs"])
    assert_same_batches(make_val_batches(corpus, 2, 2), batches[:2])
    with pytest.raises(ValueError, match="fewer than one batch"):
        make_val_batches(corpus, n_windows + 1, 1)


def test_document_windows_mask(tmp_path):
    docs = ["ab", "x" * 50, "hello"]
    write_txt(tmp_path / "v.txt", docs)
    write_txt(tmp_path / "t.txt", make_docs(3))
    cfg = DataConfig(train=(str(tmp_path / "t.txt"),), val=(str(tmp_path / "v.txt"),), seq_len=8)
    w = document_windows(cfg, 10)
    assert w["inputs"].shape == (3, 8) and w["mask"].dtype == np.float32
    np.testing.assert_array_equal(w["inputs"][0], [256, 97, 98, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(w["targets"][0], [97, 98, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(w["mask"], [[1, 1, 0, 0, 0, 0, 0, 0], [1] * 8, [1, 1, 1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(w["segment_ids"][0], [1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(w["inputs"][1], [256] + [120] * 7)
    np.testing.assert_array_equal(w["targets"][1], [120] * 8)
    np.testing.assert_array_equal(w["positions"], np.tile(np.arange(8), (3, 1)))
    assert document_windows(cfg, 2)["inputs"].shape == (2, 8)
