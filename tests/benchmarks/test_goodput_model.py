"""The goodput model of ``benchmarks/goodput_model.py``: its formulas on hand-computed cases, its validation,
and the script end to end in ``--smoke``. No projected value is asserted beyond the hand-computed cases."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "benchmarks"


@pytest.fixture(scope="module")
def gm(bench) -> ModuleType:
    """The module, imported from benchmarks/ as the scripts import ``common``."""
    return bench("goodput_model")


@pytest.fixture(scope="module")
def cluster(gm: ModuleType) -> Any:
    return gm.cluster_from(gm.load_measured())[0]


def job(gm: ModuleType, **over: Any) -> Any:
    kw: dict[str, Any] = {
        "gpus": 1024,
        "steps": 1000,
        "step_time_s": 5.0,
        "state_bytes_per_gpu": 10e9,
        "failure_rate_per_gpu_s": gm.LLAMA3_RATE_PER_GPU_S,
    }
    return gm.Job(**{**kw, **over})


def test_llama3_rate_is_419_in_54_days_on_16384_gpus(gm: ModuleType) -> None:
    assert gm.LLAMA3_RATE_PER_GPU_S == pytest.approx(419 / (54 * 86400 * 16384))
    # one interruption every 185.6 min on the whole machine
    assert 1 / (gm.LLAMA3_RATE_PER_GPU_S * 16384) / 60 == pytest.approx(185.58, abs=0.01)


def test_young_daly_interval_on_a_hand_computed_case(gm: ModuleType) -> None:
    # C = 50 s, M = 4 h = 14,400 s: sqrt(2 * 50 * 14,400) = sqrt(1,440,000) = 1,200 s
    assert gm.young_daly_interval_s(50.0, 14_400.0) == pytest.approx(1200.0)
    assert gm.young_daly_interval_s(8.0, 1.0) == pytest.approx(4.0)


def test_expected_wall_time_on_a_hand_computed_case(gm: ModuleType) -> None:
    # 1,000 steps of 2 s + 0.5 s overhead = 2,500 s; one failure per 1,000 s, each 100 s down + 50 s redone:
    # 2,500 / (1 - 0.15) = 2,941.18 s; goodput = 2,000 / 2,941.18 = 0.68
    cost = gm.StrategyCost(strategy=gm.IN_PLACE, downtime_s=100.0, redo_s=50.0, overhead_per_step_s=0.5)
    wall = gm.expected_wall_time_s(steps=1000, step_time_s=2.0, failures_per_s=1e-3, cost=cost)
    assert wall == pytest.approx(2500 / 0.85)
    j = gm.Job(gpus=10, steps=1000, step_time_s=2.0, state_bytes_per_gpu=0.0, failure_rate_per_gpu_s=1e-4)
    assert gm.goodput(j, cost) == pytest.approx(2000 / (2500 / 0.85))
    # failures faster than repairs: the job never finishes
    assert gm.expected_wall_time_s(steps=1, step_time_s=1.0, failures_per_s=0.01, cost=cost) == math.inf
    assert gm.goodput(dataclasses.replace(j, failure_rate_per_gpu_s=1e-3), cost) == 0.0


def test_goodput_is_one_without_failures_or_overhead(gm: ModuleType, cluster: Any) -> None:
    cost = gm.StrategyCost(strategy=gm.RESTART, downtime_s=300.0, redo_s=900.0, overhead_per_step_s=0.0)
    assert gm.goodput(job(gm, failure_rate_per_gpu_s=0.0), cost) == 1.0
    # torchft's quorum is a cost per step, failures or not; the others pay nothing without failures
    # (with no failures Young/Daly's interval is the whole job: one checkpoint's write over all its steps)
    j = job(gm, failure_rate_per_gpu_s=0.0, state_bytes_per_gpu=0.0)
    for strategy in (gm.IN_PLACE, gm.RESTART):
        assert gm.goodput(j, gm.COSTS[strategy](j, cluster)) == pytest.approx(1.0, abs=1e-6)


def test_goodput_falls_with_the_gpus(gm: ModuleType, cluster: Any) -> None:
    rows = gm.project(cluster, step_time_s=5.0, state_bytes_per_gpu=10e9, gpus=(64, 256, 1024, 4096, 16384))
    assert {r["strategy"] for r in rows} == set(gm.STRATEGIES) and len(rows) == 15
    for strategy in gm.STRATEGIES:
        mine = [r for r in rows if r["strategy"] == strategy]
        assert [r["gpus"] for r in mine] == [64, 256, 1024, 4096, 16384]
        # unrounded: the table rounds, and torchft-like's goodput moves in the fourth decimal
        jobs = [gm.projected_job(n, step_time_s=5.0, state_bytes_per_gpu=10e9) for n in (64, 256, 1024, 4096, 16384)]
        goodputs = [gm.goodput(j, gm.COSTS[strategy](j, cluster)) for j in jobs]
        assert all(a > b for a, b in zip(goodputs, goodputs[1:])), (strategy, goodputs)
        assert all(0.0 < g < 1.0 for g in goodputs)
        assert [r["goodput"] for r in mine] == [round(g, 6) for g in goodputs]
        mtbf = [r["mtbf_min"] for r in mine]
        assert all(a > b for a, b in zip(mtbf, mtbf[1:]))
        # failures per day and MTBF describe the same rate
        for r in mine:
            assert r["failures_per_day"] * r["mtbf_min"] == pytest.approx(1440.0, rel=1e-3)


def test_restart_uses_young_daly_and_half_the_interval_is_redone(gm: ModuleType, cluster: Any) -> None:
    j = job(gm)
    cost = gm.checkpoint_restart_cost(j, cluster)
    write_s = cost.parts["checkpoint_write_s"]
    every = cost.parts["checkpoint_every_steps"]
    assert every == round(gm.young_daly_interval_s(write_s, 1 / j.failures_per_s) / j.step_time_s)
    assert cost.redo_s == pytest.approx(every * j.step_time_s / 2)
    assert cost.overhead_per_step_s == pytest.approx(write_s / every)
    fixed = gm.checkpoint_restart_cost(j, cluster, every_steps=100)
    assert fixed.redo_s == pytest.approx(50 * j.step_time_s)


@pytest.mark.parametrize(
    ("cls", "field", "value", "message"),
    [
        ("Job", "gpus", 0, "must be > 0"),
        ("Job", "gpus", 2.5, "must be an integer"),
        ("Job", "step_time_s", -1.0, "must be > 0"),
        ("Job", "failure_rate_per_gpu_s", -1e-9, "must be >= 0"),
        ("Job", "state_bytes_per_gpu", math.nan, "must be finite"),
        ("Job", "steps", True, "must be an integer"),
        ("Cluster", "snapshot_gb_s", 0.0, "must be > 0"),
        ("Cluster", "snapshot_budget", 1.5, "must be in (0, 1)"),
        ("Cluster", "process_restart_s", "120", "must be a number"),
        ("Cluster", "gpus_per_replica_group", 0, "must be > 0"),
    ],
)
def test_invalid_inputs_raise_naming_the_field(
    gm: ModuleType, cluster: Any, cls: str, field: str, value: object, message: str
) -> None:
    good = job(gm) if cls == "Job" else cluster
    with pytest.raises(gm.GoodputModelError, match=re.escape(f"{cls}.{field} {message}")) as info:
        dataclasses.replace(good, **{field: value})
    assert info.value.field == f"{cls}.{field}"


def test_invalid_strategy_and_formula_arguments_raise(gm: ModuleType) -> None:
    with pytest.raises(gm.GoodputModelError, match="StrategyCost.strategy"):
        gm.StrategyCost(strategy="retry", downtime_s=1.0, redo_s=1.0, overhead_per_step_s=0.0)
    with pytest.raises(gm.GoodputModelError, match="StrategyCost.redo_s must be >= 0"):
        gm.StrategyCost(strategy=gm.TORCHFT, downtime_s=1.0, redo_s=-1.0, overhead_per_step_s=0.0)
    with pytest.raises(gm.GoodputModelError, match="young_daly_interval_s.mtbf_s must be > 0"):
        gm.young_daly_interval_s(10.0, 0.0)


def test_smoke_writes_the_projection_and_the_clockwork_check(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "goodput_model.py"), "--smoke", "--out", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "wrote" in proc.stdout and "Clockwork" in proc.stdout
    data = json.loads((tmp_path / "goodput_model_smoke.json").read_text())
    assert data["benchmark"] == "goodput_model" and data["mode"] == "smoke" and "Clockwork" in data["baseline"]
    summary = json.loads((tmp_path / "summary" / "goodput_model_smoke.json").read_text())
    s = summary["summary"]
    assert s == data["summary"] and "samples" not in summary
    for key in ("projection", "clockwork", "inputs", "assumptions"):
        assert s[key], key
    assert {(r["gpus"], r["strategy"]) for r in s["projection"]} == {
        (n, st) for n in (64, 256, 1024, 4096, 16384) for st in ("in-place", "checkpoint-restart", "torchft-like")
    }
    for r in s["projection"]:
        assert {"gpus", "strategy", "goodput", "failures_per_day", "mtbf_min"} <= r.keys()
    published = {r["strategy"]: r["published_min"] for r in s["clockwork"]}
    assert published == {"in-place": 405.0, "checkpoint-restart": 818.0, "torchft-like": 930.0}
    for r in s["clockwork"]:
        assert r["ratio"] == pytest.approx(r["model_min"] / r["published_min"], rel=1e-2)
    assert all("source" in v and "value" in v for v in s["inputs"].values())
    assert any("Clockwork" in n and "ratio" in n for n in summary["notes"])
