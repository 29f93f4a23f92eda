"""``benchmarks/state_scaling.py``'s figures from plain measurements (its ``--smoke`` run end to end is in
``test_benchmarks_quick.py``, with the other scripts').
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def scaling(bench) -> ModuleType:
    return bench("state_scaling")


def _measurement() -> dict[str, Any]:
    steady = {
        "interval": 8,
        "cost_s": 0.02,
        "calib_step_s": 0.5,
        "overhead": 0.005,
        "chosen_at_step": 5,
        "first_step": 6,
        "last_step": 14,
        "step_s": 0.5,
        "snapshot_state_bytes": 3_000,
        "snapshot_held_bytes": 9_000,
        "chain_s": 0.01,
        "peak_rss_bytes": 40_000,
    }
    crash = {"kind": "rank_crash", "outcome": "ok", "downtime_s": 1.5, "pause_s": 1.0, "steps_lost": 3, "interval": 8}
    crash["restored_from"] = "snapshot, 3 step(s) back"
    return {
        "model": "tiny",
        "params": 1_000,
        "hyperpodrun": {
            "steady": steady,
            "events": [crash, {"kind": "node_loss", "outcome": "hang"}],
            "failure": "node loss: 2 steps after it did not happen within 90s\nlast output",
            "join_skipped": None,
            "floor_rss_bytes": 30_000,
        },
        "torchrun": {"steady": {"step_s": 0.45}},
        "hydration": {"nbytes": 12_000_000, "hydration_s": [0.02, 0.03], "broadcast_s": [0.01], "memcpy_s": [0.005]},
    }


def test_size_figures_come_from_the_logs_and_the_baselines(scaling: ModuleType) -> None:
    r = scaling.size_result(_measurement())
    assert r.state_bytes_per_rank == 1_000 * 16 // 4  # fp32 weights, gradients, AdamW's two moments over 4 ranks
    assert r.snapshot_memory_ratio == 3.0 and r.snapshot_mb_per_s == pytest.approx(0.3)
    assert r.throughput_ratio_vs_torchrun == pytest.approx(0.9)  # torchrun's step over ours
    assert r.peak_rss_over_state == 10.0 and r.peak_rss_less_floor_over_state == 2.5
    assert (r.crash_downtime_s, r.crash_steps_redone, r.crash_interval) == (1.5, 3, 8)
    assert r.node_loss_downtime_s is None and r.outcomes == {"rank_crash": "ok", "node_loss": "hang"}
    assert r.hydration_over_broadcast == pytest.approx(0.4) and r.hydration_over_memcpy == pytest.approx(0.2)
    assert r.failure == "node loss: 2 steps after it did not happen within 90s"


def test_restored_from_names_the_snapshot_or_its_absence(scaling: ModuleType) -> None:
    log = [
        {"ts": 1.0, "event": "snapshot_restored", "redone": 9},
        {"ts": 3.0, "event": "group_up"},
        {"ts": 4.0, "event": "snapshot_restored", "redone": 2},
        {"ts": 6.0, "event": "snapshot_unavailable", "reason": "no step at which every shard survived"},
    ]
    assert scaling.restored_from(log, 2.0) == "snapshot, 2 step(s) back"
    assert scaling.restored_from(log, 5.0) == "no snapshot: no step at which every shard survived"
    assert scaling.restored_from(log, 7.0) is None
