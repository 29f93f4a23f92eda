"""A memory-mapped token dataset that is tokenised once, not at every restart.

:func:`build_token_dataset` tokenises text sources into one flat binary file of
token ids (``tokens.bin``: ``uint16`` when every id fits, i.e. a vocabulary of at
most 65536, else ``uint32``)
and a metadata file (``meta.json``: dtype, token count, seq_len, tokenizer name,
and a fingerprint of the sources). A later call with the same sources and
tokenizer finds a matching fingerprint and opens the files without tokenising;
any mismatch, and any missing, truncated or unreadable file, rebuilds. A build
writes temporary files and renames them into place (``meta.json`` last, after the
old one was removed), so a build interrupted at any point is never reused.
Concurrent builders on one host (every rank of a node) serialise on a lock file
(``flock``; on a shared filesystem without working locks let one rank build first
and the others open the result after a barrier).

Sources: ``.txt`` (documents separated by blank lines, or the whole file as one
document with ``txt_documents="file"``) and ``.jsonl`` (one JSON object per line,
the document in field ``text``). Every document is followed by the tokenizer's
end-of-sequence id.

:class:`TokenDataset` reads the token file through ``numpy.memmap``; sample ``i`` is
the window ``tokens[i*seq_len : (i+1)*seq_len + 1]`` as ``input_ids`` (all but the
last token) and ``labels`` (all but the first: next-token targets)::

    tokenizer = ByteTokenizer()
    dataset = build_token_dataset(["corpus.jsonl"], "/data/corpus-bytes", tokenizer, seq_len=512)
    sampler = ElasticSampler(len(dataset), global_batch=64, micro_batch=8)
    loader = StatefulDataLoader(dataset, batch_sampler=sampler, num_workers=2)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import operator
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "ByteTokenizer",
    "DatasetBuildError",
    "DatasetError",
    "DatasetLockTimeoutError",
    "Tokenizer",
    "TokenDataset",
    "build_token_dataset",
]

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"
LOCK_FILE = ".build.lock"
_WRITE_CHUNK = 1 << 20  # tokens buffered before a write


class DatasetError(RuntimeError):
    """A token dataset cannot be opened."""


class DatasetBuildError(DatasetError):
    """The sources cannot be tokenised (unreadable, malformed, or out-of-vocabulary ids)."""


class DatasetLockTimeoutError(DatasetError, TimeoutError):
    """Another process held the build lock for longer than the timeout."""


@runtime_checkable
class Tokenizer(Protocol):
    """What :func:`build_token_dataset` needs of a tokenizer."""

    @property
    def name(self) -> str: ...  # identifies the vocabulary and rules: part of the fingerprint

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0-255) plus end-of-sequence (256) and padding (257).

    Needs no vocabulary file; good for tests and tiny models.
    """

    name = "byte-utf8-v1"
    vocab_size = 258
    eos_id = 256
    pad_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------- sources
def _read_documents(path: Path, txt_documents: str, text_field: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetBuildError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from exc
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise DatasetBuildError(f"{path}:{line_no}: expected an object with a string field {text_field!r}")
                yield record[text_field]
    elif suffix == ".txt":
        with path.open(encoding="utf-8") as f:
            if txt_documents == "file":
                yield f.read()
                return
            paragraph: list[str] = []
            for line in f:
                if line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "".join(paragraph).rstrip("\n")
                    paragraph = []
            if paragraph:
                yield "".join(paragraph).rstrip("\n")
    else:
        raise DatasetBuildError(f"{path}: unsupported source type {suffix!r} (expected .txt or .jsonl)")


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _fingerprint(paths: Sequence[Path], tokenizer: Tokenizer, options: dict[str, Any], content: bool) -> dict[str, Any]:
    sources = []
    for path in paths:
        stat = path.stat()
        entry: dict[str, Any] = {"path": str(path), "size": stat.st_size}
        if content:
            digest = hashlib.sha256()
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            entry["sha256"] = digest.hexdigest()
        else:
            entry["mtime_ns"] = stat.st_mtime_ns
        sources.append(entry)
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "options": options,
        "sources": sources,
    }


# ------------------------------------------------------------------------ build
@contextlib.contextmanager
def _build_lock(out_dir: Path, timeout: float) -> Iterator[None]:
    deadline = time.monotonic() + timeout
    with open(out_dir / LOCK_FILE, "a+") as handle:
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise DatasetLockTimeoutError(
                        f"timed out after {timeout:.0f}s waiting for the build lock {out_dir / LOCK_FILE} "
                        "(another process is building this dataset)"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _read_meta(out_dir: Path) -> dict[str, Any] | None:
    """The metadata of a complete build in ``out_dir``, or None if there is none."""
    try:
        meta = json.loads((out_dir / META_FILE).read_text(encoding="utf-8"))
        dtype = np.dtype(meta["dtype"])
        count, seq_len = int(meta["count"]), int(meta["seq_len"])
        size = (out_dir / TOKENS_FILE).stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(meta.get("fingerprint"), dict) or seq_len <= 0 or size != count * dtype.itemsize:
        return None
    return meta


def _write_tokens(
    paths: Sequence[Path], tokenizer: Tokenizer, tmp_path: Path, dtype: np.dtype, txt_documents: str, text_field: str
) -> tuple[int, int]:
    count = documents = 0
    buffer: list[int] = []
    limit = tokenizer.vocab_size
    with tmp_path.open("wb") as out:
        for path in paths:
            for text in _read_documents(path, txt_documents, text_field):
                ids = tokenizer.encode(text)
                if ids and (min(ids) < 0 or max(ids) >= limit):
                    raise DatasetBuildError(
                        f"{path}: tokenizer {tokenizer.name!r} returned ids outside [0, vocab_size={limit})"
                    )
                buffer.extend(ids)
                buffer.append(tokenizer.eos_id)
                documents += 1
                if len(buffer) >= _WRITE_CHUNK:
                    out.write(np.asarray(buffer, dtype=dtype).tobytes())
                    count += len(buffer)
                    buffer.clear()
        out.write(np.asarray(buffer, dtype=dtype).tobytes())
        count += len(buffer)
        out.flush()
        os.fsync(out.fileno())
    return count, documents


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_token_dataset(
    source_paths: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    txt_documents: Literal["blank_line", "file"] = "blank_line",
    text_field: str = "text",
    fingerprint: Literal["stat", "content"] = "stat",
    lock_timeout: float = 600.0,
) -> TokenDataset:
    """Tokenise ``source_paths`` into ``out_dir`` unless an identical build is there.

    ``fingerprint="stat"`` identifies a source by path, size and mtime (cheap);
    ``"content"`` by a SHA-256 of its bytes (survives copies that reset mtimes).
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise DatasetBuildError(f"seq_len must be a positive int, got {seq_len!r}")
    if txt_documents not in ("blank_line", "file"):
        raise DatasetBuildError(f"txt_documents must be 'blank_line' or 'file', got {txt_documents!r}")
    if fingerprint not in ("stat", "content"):
        raise DatasetBuildError(f"fingerprint must be 'stat' or 'content', got {fingerprint!r}")
    if not isinstance(tokenizer, Tokenizer):
        raise DatasetBuildError(f"tokenizer {tokenizer!r} lacks name, vocab_size, eos_id, encode or decode")
    if not source_paths:
        raise DatasetBuildError("source_paths is empty")
    paths = [Path(p).resolve() for p in source_paths]
    for path in paths:
        if not path.is_file():
            raise DatasetBuildError(f"source {path} does not exist or is not a file")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    options = {"txt_documents": txt_documents, "text_field": text_field}
    wanted = _fingerprint(paths, tokenizer, options, content=fingerprint == "content")

    with _build_lock(out, lock_timeout):
        meta = _read_meta(out)
        if meta is None or meta["fingerprint"] != wanted:
            (out / META_FILE).unlink(missing_ok=True)  # from here on no build in out_dir is valid
            for stale in [*out.glob(f"{TOKENS_FILE}.tmp.*"), *out.glob(f"{META_FILE}.tmp.*")]:
                stale.unlink(missing_ok=True)  # left by a builder that died; we hold the lock
            dtype = _token_dtype(tokenizer.vocab_size)
            tmp = out / f"{TOKENS_FILE}.tmp.{os.getpid()}"
            try:
                count, documents = _write_tokens(paths, tokenizer, tmp, dtype, txt_documents, text_field)
                os.replace(tmp, out / TOKENS_FILE)
            finally:
                tmp.unlink(missing_ok=True)
            meta = {
                "dtype": dtype.name,
                "count": count,
                "documents": documents,
                "seq_len": seq_len,
                "vocab_size": tokenizer.vocab_size,
                "tokenizer": tokenizer.name,
                "fingerprint": wanted,
            }
            _fsync_dir(out)
            _atomic_write_text(out / META_FILE, json.dumps(meta, indent=1, sort_keys=True))
            _fsync_dir(out)
    return TokenDataset(out, seq_len)


# ---------------------------------------------------------------------- dataset
class TokenDataset(Dataset[dict[str, torch.Tensor]]):
    """Fixed-length next-token samples over a built token file, memory-mapped.

    ``seq_len`` defaults to the one recorded at build time. The memory map is
    opened lazily in each process, so the dataset pickles cheaply to loader workers.
    """

    def __init__(self, out_dir: str | os.PathLike[str], seq_len: int | None = None) -> None:
        self._dir = Path(out_dir)
        meta = _read_meta(self._dir)
        if meta is None:
            raise DatasetError(
                f"{self._dir} holds no complete token dataset ({META_FILE} missing or unreadable, or "
                f"{TOKENS_FILE} of the wrong size): build it with build_token_dataset()"
            )
        self.meta: dict[str, Any] = meta
        seq_len = int(meta["seq_len"]) if seq_len is None else seq_len
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise DatasetError(f"seq_len must be a positive int, got {seq_len!r}")
        self.seq_len = seq_len
        self.dtype = np.dtype(meta["dtype"])
        self.num_tokens = int(meta["count"])
        self._len = max(0, (self.num_tokens - 1) // seq_len)
        if self._len == 0:
            raise DatasetError(
                f"{self._dir} holds {self.num_tokens} tokens, too few for one sample of seq_len={seq_len} "
                f"(needs {seq_len + 1})"
            )
        self._tokens: np.memmap | None = None

    def _memmap(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = np.memmap(self._dir / TOKENS_FILE, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tokens"] = None
        return state

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = operator.index(index)
        if not 0 <= index < self._len:
            raise IndexError(f"sample {index} out of range for a dataset of {self._len} samples")
        start = index * self.seq_len
        window = torch.from_numpy(self._memmap()[start : start + self.seq_len + 1].astype(np.int64))
        return {
            "input_ids": window[:-1],
            "labels": window[1:],
            "sample_id": torch.tensor(index, dtype=torch.int64),
        }
