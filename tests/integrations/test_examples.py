"""The integration examples run as plain scripts (one process, no launcher) and train."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.launch import clean_env, run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("script", "flag"), [("hf_trainer/train.py", "--output-dir"), ("lightning/train.py", "--ckpt-dir")]
)
def test_example_trains_a_few_steps(script: str, flag: str, tmp_path) -> None:
    proc = run(
        [sys.executable, str(EXAMPLES / script), flag, str(tmp_path), "--max-steps", "4"], timeout=180, env=clean_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "done: 4 steps" in out or "max_steps=4` reached" in out
