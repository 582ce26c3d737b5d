"""Data loading for the fox_jax lm-eval tasks: the YAML files next to this one read local files only.

Each task names its files relative to the eval-set directory (``dataset_kwargs``: ``data_files`` for JSON
lines, read by Hugging Face ``datasets``' ``json`` builder; ``text_file`` for WikiText-2's raw text), and
``custom_dataset: !function fox_tasks.load_local`` resolves them against that directory:

1. ``eval_dir`` from lm-eval's task metadata (``--metadata '{"eval_dir": "DIR"}'`` on lm-eval's command line,
   ``TaskManager(metadata={"eval_dir": ...})`` from Python; ``fox-jax zeroshot --harness lm-eval`` passes
   its ``--eval-dir``);
2. else ``fox_jax.train.zeroshot.default_eval_dir()``: ``$FOX_JAX_SHARED_DATA/eval``, else
   ``<checkout>/../shared/data/eval``.

Prompts, targets and metrics are lm-eval's own: the YAML files call the functions of lm-eval's built-in
tasks (``lm_eval.tasks.<task>``), re-exported here because ``!function`` resolves next to the YAML file.
No hub access: the files are the ones ``../shared/data/PROVENANCE.md`` describes.
"""

from __future__ import annotations

from pathlib import Path

import datasets
from lm_eval.tasks.hellaswag.utils import process_docs as hellaswag_process_docs  # noqa: F401
from lm_eval.tasks.super_glue.copa.utils import (doc_to_choice as copa_doc_to_choice,  # noqa: F401
                                                 doc_to_target as copa_doc_to_target,
                                                 doc_to_text as copa_doc_to_text)
from lm_eval.tasks.wikitext.preprocess_wikitext import (process_results as wikitext_process_results,  # noqa: F401
                                                        wikitext_detokenizer)
from lm_eval.tasks.winogrande.preprocess_winogrande import (doc_to_choice as winogrande_doc_to_choice,  # noqa: F401
                                                            doc_to_target as winogrande_doc_to_target,
                                                            doc_to_text as winogrande_doc_to_text)

from fox_jax.train.zeroshot import default_eval_dir


def _eval_dir(eval_dir: str | None) -> Path:
    path = Path(eval_dir) if eval_dir else default_eval_dir()
    if not path.is_dir():
        raise FileNotFoundError(f"eval_dir {path}: no such directory (the shared/data/eval sets); pass "
                                "--metadata '{\"eval_dir\": \"DIR\"}' to lm_eval or set FOX_JAX_SHARED_DATA")
    return path


def _file(root: Path, name: str) -> str:
    path = root / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (eval_dir {root} lacks this task's file)")
    return str(path)


def wikitext_pages(text: str) -> list[str]:
    """WikiText raw text -> its articles: a page starts at a level-1 heading line `` = Title = `` (not
    `` = = Section = = ``) and holds the lines up to the next one, joined by newlines (the page split of the
    ``EleutherAI/wikitext_document_level`` data lm-eval's ``wikitext`` task reads; 62 pages in
    wiki.test.raw)."""
    pages, lines = [], []
    for line in text.split("\n"):
        s = line.strip()
        if s.startswith("= ") and s.endswith(" =") and not s.startswith("= ="):
            if "".join(lines).strip():
                pages.append("\n".join(lines))
            lines = []
        lines.append(line)
    if "".join(lines).strip():
        pages.append("\n".join(lines))
    return pages


def load_local(data_files: dict | None = None, labels_file: str | None = None, text_file: str | None = None,
               eval_dir: str | None = None, **_metadata) -> dict:
    """lm-eval ``custom_dataset``: the task's splits from local files.

    Args:
      data_files: ``{split: JSON-lines file}``, relative to the eval directory.
      labels_file: a file of one integer label per line, aligned with the single split's rows (PIQA's
        ``valid-labels.lst``); added as the column ``label``.
      text_file: instead of ``data_files``: WikiText raw text, split into ``{"page"}`` rows (``wikitext_pages``),
        returned as the split ``test``.
      eval_dir: the eval-set directory (see the module docstring); other metadata is ignored.

    Returns:
      ``{split: datasets.Dataset}``.

    Raises:
      FileNotFoundError: no eval directory or a missing file. ValueError: labels that do not line up.
    """
    root = _eval_dir(eval_dir)
    if text_file is not None:
        pages = wikitext_pages(Path(_file(root, text_file)).read_text(encoding="utf-8"))
        return {"test": datasets.Dataset.from_dict({"page": pages})}
    if not data_files:
        raise ValueError("a fox_jax lm-eval task needs dataset_kwargs.data_files or dataset_kwargs.text_file")
    out = dict(datasets.load_dataset("json", data_files={split: _file(root, f) for split, f in data_files.items()}))
    if labels_file is not None:
        (split,) = out
        labels = [int(x) for x in Path(_file(root, labels_file)).read_text().split()]
        if len(labels) != len(out[split]):
            raise ValueError(f"{labels_file} has {len(labels)} labels for {len(out[split])} rows of {split}")
        out[split] = out[split].add_column("label", labels)
    return out
