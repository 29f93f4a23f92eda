"""The example's default text corpus: the Python language reference, as shipped.

Every CPython installation carries ``pydoc_data.topics``, the text of the language
reference topics that ``help()`` shows (``help("assert")``, ``help("with")``, ...):
about 80 documents and roughly 460 KB of English prose and code written for people.
It needs no download and no extra package, so the fine-tune runs on a fresh machine
with nothing but the project installed, and it is real text a byte-level model can
visibly learn: the ``tiny`` preset goes from ~5.3 to below 2.5 nats per byte in 200
AdamW steps of 8 x 256 bytes at lr 3e-3.

Licence: the Python documentation is distributed under the Python Software Foundation
License Version 2 (examples and recipes additionally under the Zero-Clause BSD
licence), as stated in CPython's ``Doc/license.rst``; it may be redistributed and
used for training with that notice kept. Nothing is copied into this repository: the
text is read from the interpreter that runs the example.

The exact text depends on the Python version (each release updates the reference),
so a token dataset built from it should be keyed on the file's fingerprint, as
``elastic_events.data.dataset.build_token_dataset`` does.

Usage::

    paths = write_default_corpus(run_dir / "corpus")   # [.../python-reference.jsonl]
    build_token_dataset(paths, run_dir / "tokens", ByteTokenizer(), seq_len=256)
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

__all__ = ["CORPUS_FILE", "CorpusError", "default_corpus_documents", "write_default_corpus"]

CORPUS_FILE = "python-reference.jsonl"


class CorpusError(RuntimeError):
    """The default corpus cannot be produced on this interpreter."""


def default_corpus_documents() -> list[str]:
    """The reference topics, one document each, in a stable (sorted by topic) order."""
    try:
        topics = importlib.import_module("pydoc_data.topics").topics
    except ImportError as exc:
        raise CorpusError(
            "pydoc_data.topics is missing from this Python installation (some distributions "
            "split it out; Debian ships it in libpython3.X-stdlib); pass your own corpus files"
        ) from exc
    documents = [topics[name].strip() for name in sorted(topics)]
    return [doc for doc in documents if doc]


def write_default_corpus(out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the corpus as JSON lines (``{"text": ...}`` per document) into ``out_dir``.

    Returns the written paths. A file that already holds exactly this text is left
    untouched (so its modification time, and any dataset keyed on it, stays valid);
    otherwise it is replaced atomically.
    """
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / CORPUS_FILE
    content = "".join(
        json.dumps({"text": doc}, ensure_ascii=False) + "\n" for doc in default_corpus_documents()
    ).encode("utf-8")
    if not (target.is_file() and target.read_bytes() == content):
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(content)
        os.replace(tmp, target)
    return [target]
