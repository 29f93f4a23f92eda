"""Keep ``benchmarks/failures.py`` working: its analysis (``failure_analysis.py``), and the script end to end in ``--smoke``.

The smoke run fails the non-master node of a 2-node hyperpodrun job three times, each after
the repair of the previous failure: kill -9 of its rank, SIGSTOP of its rank (hang), kill -9 of
its launcher's tree (node loss, then a new node joins); it checks that every repair ran in place
and redid at most one step, with sane phases. No timing thresholds: the machine's speed is not tested.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "benchmarks"
SMOKE_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def failures(bench) -> ModuleType:
    """benchmarks/failure_analysis.py as a module (it imports ``common`` and ``scale_analysis`` as the scripts do)."""
    return bench("failure_analysis")


def _steps(*points: tuple[float, int]) -> list[dict[str, float | int]]:
    return [{"ts": ts, "step": step, "world_size": 2} for ts, step in points]


def test_failure_plan_is_seeded_spread_and_leaves_room_for_a_rejoin(failures: ModuleType) -> None:
    draw = dict(seed=3, first=3, min_gap=4, ckpt_every=10)
    kinds = ("rank_crash", "node_loss")
    plan = failures.failure_plan(kinds, 10, at_checkpoints=True, **draw)
    assert plan == failures.failure_plan(kinds, 10, at_checkpoints=True, **draw)  # the same for every variant
    assert [k for k, _ in plan] == list(kinds) * 10
    steps = [s for _, s in plan]
    gaps = [b - a for a, b in zip([3, *steps], steps)]
    assert all(g >= 4 for g in gaps) and all(g >= 4 + failures.REJOIN_STEPS for g in gaps[2::2])  # after a loss
    assert len({s % 10 for s in steps}) >= 5  # spread over the checkpoint interval
    off = [s for _, s in failures.failure_plan(kinds, 10, at_checkpoints=False, **draw)]
    assert all(s % 10 for s in off) and all(b > a for a, b in zip(off, off[1:]))
    with pytest.raises(ValueError, match="min_gap"):
        failures.failure_plan(kinds, 1, seed=0, first=1, min_gap=0, ckpt_every=10, at_checkpoints=True)


def test_measure_failure_reads_downtime_and_redone_steps(failures: ModuleType) -> None:
    # Steps 1-4 every 0.5 s; the kill at 2.05; step 4 was logged 10 ms after it (its collectives had
    # finished); a restart resumed from the checkpoint of step 2 and logged step 3 again at 6.0.
    records = _steps((0.5, 1), (1.0, 2), (1.5, 3), (2.06, 4), (6.0, 3), (6.5, 4))
    m = failures.measure_failure(records, t_event=2.05, grace=0.5)
    assert (m["last_old_step"], m["first_new_step"], m["steps_lost"]) == (4, 3, 2)
    assert m["downtime_s"] == pytest.approx(6.0 - 2.06) and m["to_world"] == 2
    assert m["pause_s"] == pytest.approx(6.0 - 2.06 - 0.5)
    repaired = failures.measure_failure(_steps((0.5, 1), (1.0, 2), (3.0, 3)), t_event=1.2, grace=0.5)
    assert repaired["steps_lost"] == 0 and repaired["downtime_s"] == pytest.approx(2.0)
    assert failures.measure_failure(records[:4], t_event=2.05, grace=0.5) is None  # not recovered yet
    # A hung rank let go for its stack dump took part in steps 4 and 5 before it was killed; the
    # repaired group (up at 7.0) trained step 6 at 8.0.
    hung = _steps((0.5, 1), (1.0, 2), (1.5, 3), (6.5, 4), (7.0, 5), (8.0, 6))
    m = failures.measure_failure(hung, t_event=1.6, grace=0.5, resumed_after=7.0)
    assert (m["last_old_step"], m["first_new_step"], m["steps_lost"]) == (3, 6, 0)
    assert m["downtime_s"] == pytest.approx(6.5)
    assert failures.measure_failure(hung[:5], t_event=1.6, grace=0.5, resumed_after=7.0) is None


def test_repair_mode_counts_a_fallback_to_a_restart(failures: ModuleType) -> None:
    assert failures.repair_mode({"ranks_replaced": 0.1, "group_up": 1.0, "first_step": 1.5}) == "in-place"
    assert failures.repair_mode({"ranks_replaced": 0.1, "workers_started": 61.0}) == "restart"
    assert failures.repair_mode({"scale_decided": 0.3}) == "unknown"


def test_target_report_compares_medians_with_issue_11(failures: ModuleType) -> None:
    summary = {
        "by_kind": {"rank_crash": {"hyperpodrun": {"steps_lost_median": 0, "downtime_median_s": 2.5}}},
        "lost_time_ratio": {"hyperpodrun": {"torchrun": {"rank_crash": 0.15}}},
    }
    report = failures.target_report(summary, kind="rank_crash", baseline="torchrun", hang_timeout_s=5.0)
    assert {name: t["met"] for name, t in report.items()} == {
        "steps_lost_median": True,
        "downtime_median_s": False,
        "lost_time_ratio": True,
    }
    other = failures.target_report(summary, kind="rank_crash", baseline="torchrun-noshare", hang_timeout_s=5.0)
    assert other["lost_time_ratio"] == {"value": None, "target": 0.2, "met": None}
    summary["by_kind"]["hang"] = {
        "hyperpodrun": {"steps_lost_median": 1, "detect_median_s": 5.8, "downtime_median_s": 9}
    }
    hang = failures.target_report(summary, kind="hang", baseline="torchrun", hang_timeout_s=5.0)
    assert hang == {  # a hang is held to its detection (timeout + 1 s), not to the downtime of a crash
        "steps_lost_median": {"value": 1, "target": 1.0, "met": True},
        "detect_median_s": {"value": 5.8, "target": 6.0, "met": True},
    }


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
def test_failures_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        # steps of half the default time: the smoke checks that the script works, not its figures
        [sys.executable, str(BENCH_DIR / "failures.py"), "--smoke", "--step-time", "0.25", "--out", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "failures_smoke.json").read_text())
    assert data["benchmark"] == "failures" and data["baseline"] and (tmp_path / data["plot"]).is_file()
    (run,) = data["samples"]["runs"]
    assert run["variant"] == "hyperpodrun" and run["failure"] is None, run["failure"]
    assert run["exit_codes"] == {"A": None, "B": None}  # no job death: both launchers ran to the end
    assert [(e["kind"], e["outcome"], e["mode"], e["node"], e["to_world"]) for e in run["events"]] == [
        ("rank_crash", "ok", "in-place", "B", 2),
        ("hang", "ok", "in-place", "B", 2),
        ("node_loss", "ok", "in-place", "B", 1),
    ]
    for ev in run["events"]:
        assert ev["steps_lost"] <= 1, ev
        if ev["kind"] != "hang":  # a hung rank let go for its stack dump trains on until it is killed
            # Resumed right after the last logged step, or one later: a step committed by every rank
            # whose logging all-reduce (after it) failed is kept, not redone.
            assert ev["last_old_step"] <= ev["first_new_step"] <= ev["last_old_step"] + 2, ev
        assert 0 < ev["detect_s"] < ev["downtime_s"], ev
        phases = ev["phases_s"]
        repair = ["ranks_replaced"] if ev["kind"] != "node_loss" else []  # a lost node's ranks are not replaced
        order = [phases[p] for p in (*repair, "group_torn_down", "group_up", "hydrated", "first_step")]
        assert order == sorted(order) and order[0] > 0, phases
        assert "workers_started" not in phases and "checkpoint_loaded" not in phases  # nothing restarted or read
        # a crash or a hang waited for the victim node's spare (a lost node takes its spare along)
        spare = (ev["spare_ready"], ev["spare_waited_s"] is not None and ev["spare_waited_s"] >= 0)
        assert spare == ((None, False) if ev["kind"] == "node_loss" else (True, True)), ev
    hang = run["events"][1]
    # not before its timeout, counted from the rank's last step (up to a step before the SIGSTOP)
    assert hang["hang_idle_s"] >= data["params"]["timers"]["hang_timeout_s"], hang
    assert run["events"][2]["rejoin"]["outcome"] == "ok"  # a new node B joined after the loss
    summary = data["summary"]
    assert summary["job_deaths"] == {"hyperpodrun": 0} and summary["modes"]["hyperpodrun"] == ["in-place"] * 3
    for kind in ("rank_crash", "hang", "node_loss"):
        assert summary["by_kind"][kind]["hyperpodrun"]["steps_lost_median"] <= 1
        assert summary["targets"][kind]["steps_lost_median"]["met"] is True
