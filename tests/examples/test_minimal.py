"""examples/minimal: the torchrun loop and its elastic twin, which says how many lines it changes."""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

import pytest

from support.launch import clean_env, hyperpodrun_cmd, run

MINIMAL = Path(__file__).resolve().parents[2] / "examples" / "minimal"


def _body(name: str) -> list[str]:
    lines = (MINIMAL / name).read_text().splitlines()
    return lines[lines.index("import argparse") :]


def test_the_elastic_twin_states_the_lines_it_changes() -> None:
    diff = list(difflib.unified_diff(_body("train_torchrun.py"), _body("train_elastic.py"), lineterm="", n=0))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    claim = re.search(r"(\d+) lines in, (\d+) out", (MINIMAL / "train_elastic.py").read_text().splitlines()[0])
    assert claim is not None and (int(claim[1]), int(claim[2])) == (added, removed)


@pytest.mark.parametrize("launch", ["plain", "hyperpodrun"])
def test_the_elastic_twin_trains_as_a_plain_script_and_under_hyperpodrun(launch: str) -> None:
    script = [str(MINIMAL / "train_elastic.py"), "--steps", "12"]
    cmd = (
        [sys.executable, *script]
        if launch == "plain"
        else hyperpodrun_cmd("--standalone", "--nproc-per-node", "2", *script)
    )
    proc = run(cmd, timeout=180, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    world = 1 if launch == "plain" else 2
    assert f"done: 12 steps at world size {world}" in proc.stdout
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0] / 4
