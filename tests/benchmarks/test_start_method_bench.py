"""Keep ``benchmarks/start_method.py`` working: the script end to end in ``--smoke``.

Two spawn/forkserver pairs of a 2-rank job whose second rank is killed after step 3 and restarted:
every run trains to its end after a restart, and every figure has its paired ratio. No timing
thresholds: the machine's speed is not tested.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMOKE_TIMEOUT_S = 300


def test_start_method_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "start_method.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "start_method_smoke.json").read_text())
    runs = data["samples"]["runs"]
    assert sorted((r["rep"], r["method"]) for r in runs) == [
        (0, "forkserver"),
        (0, "spawn"),
        (1, "forkserver"),
        (1, "spawn"),
    ]
    assert len({r["victim"] for r in runs}) == 4  # each run killed a rank of its own
    for r in runs:
        assert 0 < r["start_s"] and 0 < r["restart_s"] and 0 < r["cpu_s"], r
    for figure in ("start_s", "restart_s", "cpu_s"):
        ci = data["summary"][f"{figure}_ratio_ci"]
        assert ci["n"] == 2 and math.isfinite(ci["ratio"]) and ci["ci_low"] <= ci["ratio"] <= ci["ci_high"], (
            figure,
            ci,
        )
    assert (tmp_path / "summary" / "start_method_smoke.json").is_file()
