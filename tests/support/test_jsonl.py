"""The harness's JSON-lines reader against a writer caught mid-line (a CI failure of 24 November)."""

from __future__ import annotations

import json
from pathlib import Path

from support.jsonl import read_jsonl


def test_a_half_written_last_line_is_not_a_record_yet(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    assert read_jsonl(path) == []
    path.write_text(json.dumps({"step": 1, "world": 2}) + "\n" + '{"step": 2585, "world": 2, "ts": 179556')
    assert read_jsonl(path) == [{"step": 1, "world": 2}]
    with path.open("a") as f:
        f.write(".5}\n")
    assert read_jsonl(path) == [{"step": 1, "world": 2}, {"step": 2585, "world": 2, "ts": 179556.5}]
