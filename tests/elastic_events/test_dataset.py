"""Memory-mapped token dataset: tokenise once, reopen without tokenising, never reuse a partial build."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from elastic_events.data.dataset import (
    ByteTokenizer,
    DatasetBuildError,
    DatasetError,
    DatasetLockTimeoutError,
    TokenDataset,
    build_token_dataset,
)

DOCS = ["hello world", "second\ndocument", "ünïcode ✓"]


class CountingTokenizer(ByteTokenizer):
    def __init__(self, name: str = ByteTokenizer.name, fail_after: int | None = None) -> None:
        self.name = name
        self.calls = 0
        self.fail_after = fail_after

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("tokenizer crashed mid-build")
        return super().encode(text)


class WideTokenizer(ByteTokenizer):
    """A vocabulary that does not fit uint16."""

    name = "wide-test"
    vocab_size = 70_000
    eos_id = 69_999

    def encode(self, text: str) -> list[int]:
        return [66_000 + b for b in text.encode()]


def expected_tokens(docs: list[str], tok: ByteTokenizer | None = None) -> list[int]:
    tok = tok or ByteTokenizer()
    out: list[int] = []
    for doc in docs:
        out += tok.encode(doc) + [tok.eos_id]
    return out


@pytest.fixture
def sources(tmp_path: Path) -> list[Path]:
    txt = tmp_path / "a.txt"
    txt.write_text(f"{DOCS[0]}\n\n\n{DOCS[1]}\n", encoding="utf-8")
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(json.dumps({"text": DOCS[2], "id": 7}) + "\n\n", encoding="utf-8")
    return [txt, jsonl]


def all_tokens(ds: TokenDataset) -> np.ndarray:
    return np.fromfile(ds._dir / "tokens.bin", dtype=ds.dtype)


def test_build_contents_and_samples(tmp_path: Path, sources: list[Path]) -> None:
    ds = build_token_dataset(sources, tmp_path / "out", ByteTokenizer(), seq_len=4)
    want = expected_tokens(DOCS)
    assert all_tokens(ds).tolist() == want
    assert ds.dtype == np.uint16
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert (meta["count"], meta["documents"], meta["seq_len"], meta["dtype"]) == (len(want), 3, 4, "uint16")
    assert meta["tokenizer"] == "byte-utf8-v1"
    assert [s["path"] for s in meta["fingerprint"]["sources"]] == [str(p.resolve()) for p in sources]
    assert len(ds) == (len(want) - 1) // 4
    for i in (0, 3, len(ds) - 1):
        item = ds[i]
        assert item["input_ids"].tolist() == want[4 * i : 4 * i + 4]
        assert item["labels"].tolist() == want[4 * i + 1 : 4 * i + 5]
        assert item["input_ids"].dtype == item["labels"].dtype == torch.int64
        assert int(item["sample_id"]) == i
    with pytest.raises(IndexError, match=f"sample {len(ds)} out of range"):
        ds[len(ds)]
    assert ByteTokenizer().decode(ds[0]["input_ids"].tolist()) == "hell"


def test_txt_whole_file_is_one_document(tmp_path: Path, sources: list[Path]) -> None:
    ds = build_token_dataset(sources[:1], tmp_path / "out", ByteTokenizer(), seq_len=2, txt_documents="file")
    assert all_tokens(ds).tolist() == expected_tokens([sources[0].read_text()])


def test_reopen_does_not_tokenise_and_other_seq_len_reuses_tokens(tmp_path: Path, sources: list[Path]) -> None:
    first_tok = CountingTokenizer()
    first = build_token_dataset(sources, tmp_path / "out", first_tok, seq_len=4)
    assert first_tok.calls == 3
    mtime = (tmp_path / "out" / "tokens.bin").stat().st_mtime_ns
    again_tok = CountingTokenizer()
    again = build_token_dataset(sources, tmp_path / "out", again_tok, seq_len=4)
    assert again_tok.calls == 0
    assert (tmp_path / "out" / "tokens.bin").stat().st_mtime_ns == mtime
    assert [again[i]["input_ids"].tolist() for i in range(len(again))] == [
        first[i]["input_ids"].tolist() for i in range(len(first))
    ]
    longer = build_token_dataset(sources, tmp_path / "out", again_tok, seq_len=8)
    assert again_tok.calls == 0
    assert longer[1]["input_ids"].tolist() == expected_tokens(DOCS)[8:16]


@pytest.mark.parametrize("change", ["source_content", "tokenizer_name", "fingerprint_mode"])
def test_mismatch_rebuilds(tmp_path: Path, sources: list[Path], change: str) -> None:
    build_token_dataset(sources, tmp_path / "out", ByteTokenizer(), seq_len=4)
    tok, kwargs = CountingTokenizer(), {}
    docs = list(DOCS)
    if change == "source_content":
        sources[1].write_text(json.dumps({"text": "changed!"}) + "\n", encoding="utf-8")
        docs[2] = "changed!"
    elif change == "tokenizer_name":
        tok = CountingTokenizer(name="byte-utf8-v2")
    else:
        kwargs = {"fingerprint": "content"}
    ds = build_token_dataset(sources, tmp_path / "out", tok, seq_len=4, **kwargs)
    assert tok.calls == 3
    assert all_tokens(ds).tolist() == expected_tokens(docs)


def test_content_fingerprint_survives_touch(tmp_path: Path, sources: list[Path]) -> None:
    build_token_dataset(sources, tmp_path / "out", ByteTokenizer(), seq_len=4, fingerprint="content")
    os.utime(sources[0], ns=(1, 1))
    tok = CountingTokenizer()
    build_token_dataset(sources, tmp_path / "out", tok, seq_len=4, fingerprint="content")
    assert tok.calls == 0
    build_token_dataset(sources, tmp_path / "out", tok, seq_len=4)  # stat fingerprint: differs from content
    assert tok.calls == 3


@pytest.mark.parametrize("damage", ["truncate_tokens", "delete_meta", "garbage_meta", "delete_tokens"])
def test_damaged_build_is_rebuilt(tmp_path: Path, sources: list[Path], damage: str) -> None:
    out = tmp_path / "out"
    build_token_dataset(sources, out, ByteTokenizer(), seq_len=4)
    if damage == "truncate_tokens":
        with open(out / "tokens.bin", "r+b") as f:
            f.truncate(10)
    elif damage == "delete_meta":
        (out / "meta.json").unlink()
    elif damage == "garbage_meta":
        (out / "meta.json").write_text('{"dtype": "uint16", "cou')
    else:
        (out / "tokens.bin").unlink()
    with pytest.raises(DatasetError, match="holds no complete token dataset"):
        TokenDataset(out)
    tok = CountingTokenizer()
    ds = build_token_dataset(sources, out, tok, seq_len=4)
    assert tok.calls == 3
    assert all_tokens(ds).tolist() == expected_tokens(DOCS)


def test_interrupted_build_leaves_nothing_reusable(tmp_path: Path, sources: list[Path]) -> None:
    out = tmp_path / "out"
    build_token_dataset(sources, out, ByteTokenizer(), seq_len=4)
    sources[0].write_text("new first\n\nnew second\n", encoding="utf-8")  # forces a rebuild...
    with pytest.raises(RuntimeError, match="tokenizer crashed mid-build"):
        build_token_dataset(sources, out, CountingTokenizer(fail_after=1), seq_len=4)  # ...that dies
    assert not (out / "meta.json").exists()
    assert not list(out.glob("*.tmp.*"))
    (out / "tokens.bin.tmp.999999").write_bytes(b"\x00" * 6)  # as left by a killed builder
    with pytest.raises(DatasetError):
        TokenDataset(out)
    tok = CountingTokenizer()
    ds = build_token_dataset(sources, out, tok, seq_len=4)
    assert tok.calls == 3
    assert all_tokens(ds).tolist() == expected_tokens(["new first", "new second", DOCS[2]])
    assert not list(out.glob("*.tmp.*"))


def test_large_vocabulary_uses_uint32(tmp_path: Path, sources: list[Path]) -> None:
    ds = build_token_dataset(sources[:1], tmp_path / "out", WideTokenizer(), seq_len=3)
    assert ds.dtype == np.uint32
    assert all_tokens(ds).tolist() == expected_tokens(DOCS[:2], WideTokenizer())
    assert ds[0]["input_ids"].tolist() == [66_000 + b for b in b"hel"]


@pytest.mark.parametrize(
    ("name", "content", "pattern"),
    [
        ("bad.jsonl", '{"text": "ok"}\n{"text": \n', r"bad.jsonl:2: not valid JSON"),
        ("bad.jsonl", '{"body": "x"}\n', r"bad.jsonl:1: expected an object with a string field 'text'"),
        ("doc.md", "# title\n", r"unsupported source type '.md'"),
    ],
)
def test_malformed_sources(tmp_path: Path, name: str, content: str, pattern: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(DatasetBuildError, match=pattern):
        build_token_dataset([tmp_path / name], tmp_path / "out", ByteTokenizer(), seq_len=2)
    assert not (tmp_path / "out" / "meta.json").exists()


def test_argument_errors(tmp_path: Path, sources: list[Path]) -> None:
    with pytest.raises(DatasetBuildError, match="seq_len must be a positive int, got 0"):
        build_token_dataset(sources, tmp_path / "out", ByteTokenizer(), seq_len=0)
    with pytest.raises(DatasetBuildError, match="does not exist"):
        build_token_dataset([tmp_path / "missing.txt"], tmp_path / "out", ByteTokenizer(), seq_len=2)
    with pytest.raises(DatasetBuildError, match="source_paths is empty"):
        build_token_dataset([], tmp_path / "out", ByteTokenizer(), seq_len=2)

    class OutOfRange(ByteTokenizer):
        def encode(self, text: str) -> list[int]:
            return [300]

    with pytest.raises(DatasetBuildError, match=r"ids outside \[0, vocab_size=258\)"):
        build_token_dataset(sources, tmp_path / "out", OutOfRange(), seq_len=2)
    with pytest.raises(DatasetError, match="too few for one sample of seq_len=1000"):
        build_token_dataset(sources, tmp_path / "out", ByteTokenizer(), seq_len=1000)


def test_dataset_pickles_without_its_memory_map(tmp_path: Path, sources: list[Path]) -> None:
    ds = build_token_dataset(sources, tmp_path / "out", ByteTokenizer(), seq_len=4)
    before = ds[2]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._tokens is None
    assert len(pickle.dumps(ds)) < 4096
    assert clone[2]["labels"].tolist() == before["labels"].tolist()


def test_build_lock_wait_times_out(tmp_path: Path, sources: list[Path]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".build.lock", "a+") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)  # another builder holds the lock
        with pytest.raises(DatasetLockTimeoutError, match=r"build lock .*\.build\.lock"):
            build_token_dataset(sources, out, ByteTokenizer(), seq_len=4, lock_timeout=0.2)
