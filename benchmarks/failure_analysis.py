"""Analysis of failure runs (``failures.py``): the failure plan, downtime and steps lost of one
failure from rank 0's step log, repair modes, medians per kind, issue 11's targets.

Pure functions of plain records (rank 0's ``--metrics`` lines, event-log phases), unit-tested
without starting anything.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from common import median
from scale_analysis import OURS, gap_between

#: Steps added to the gap after a node loss: the new node starts and joins before the next failure.
REJOIN_STEPS = 24
#: Issue 11's targets, reported (never asserted): in-place steps lost, downtime, lost time / torchrun's.
TARGETS = {"steps_lost_median": 1.0, "downtime_median_s": 2.0, "lost_time_ratio": 0.2}


def failure_plan(
    kinds: Sequence[str], count: int, *, seed: int, first: int, min_gap: int, ckpt_every: int, at_checkpoints: bool
) -> list[tuple[str, int]]:
    """``count`` failures of each kind, in turn, at increasing steps: gaps of ``min_gap`` (plus
    :data:`REJOIN_STEPS` after a node loss, for the new node to join) and a seeded draw across
    the checkpoint interval.

    The same seed gives every variant the same steps, so the restarting variants' lost work
    (back to the last checkpoint) is sampled across the interval, not at one point of it.
    Without ``at_checkpoints`` a step that saves a checkpoint is moved one step on (a failure
    seen at such a step lands inside the save).
    """
    if count < 0 or first < 1 or min_gap < 1:
        raise ValueError(f"count must be >= 0, first and min_gap >= 1, got {count}, {first}, {min_gap}")
    rng = random.Random(seed)
    plan: list[tuple[str, int]] = []
    step = first
    for i in range(count * len(kinds)):
        step += (
            min_gap + rng.randrange(max(1, ckpt_every)) + (REJOIN_STEPS if plan and plan[-1][0] == "node_loss" else 0)
        )
        if not at_checkpoints and ckpt_every and step % ckpt_every == 0:
            step += 1
        plan.append((kinds[i % len(kinds)], step))
    return plan


def measure_failure(
    records: list[dict[str, Any]], *, t_event: float, grace: float, resumed_after: float | None = None
) -> dict[str, Any] | None:
    """Downtime and steps lost of one failure from rank 0's step log, or None if not recovered yet.

    The last record logged by ``t_event + grace`` is the last step before the failure (a step
    whose collectives finished before the kill is logged within milliseconds; with a minimum
    step time ``grace`` no step begun after the kill can end that early). The first step after
    the recovery is the next record, or with ``resumed_after`` (when the launcher's log says the
    job was repaired or restarted) the first record after that time: steps a hung rank still
    took part in before it was killed are not the recovery.
    """
    before = [i for i, r in enumerate(records) if r["ts"] <= t_event + grace]
    if not before:
        return None
    after = [r for r in records[before[-1] + 1 :] if resumed_after is None or r["ts"] > resumed_after]
    if not after:
        return None
    return {**gap_between(records, records[before[-1]], after[0]), "to_world": after[0]["world_size"]}


#: hyperpodrun's records of a job running again after a failure: a repaired group, restarted ranks.
RESUMED_RECORDS = ("group_up", "workers_started")


def repair_mode(phases: dict[str, float]) -> str:
    """``in-place`` when the survivors went on in process (the failed rank replaced alone, or a lost
    node left out), ``restart`` when every rank restarted (also a repair that fell back to a restart)."""
    if "workers_started" in phases:
        return "restart"
    return "in-place" if "ranks_replaced" in phases or "group_up" in phases else "unknown"


def phase_medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per hyperpodrun variant and failure kind, the median offset from the failure of each phase record (s)."""
    values: dict[str, dict[str, dict[str, list[float]]]] = {}
    for run in runs:
        if run["variant"] not in OURS:
            continue
        for ev in run["events"]:
            for name, t in (ev.get("phases_s") or {}).items():
                values.setdefault(run["variant"], {}).setdefault(ev["kind"], {}).setdefault(name, []).append(t)
    return {
        variant: {kind: {name: median(v) for name, v in phases.items()} for kind, phases in by_kind.items()}
        for variant, by_kind in values.items()
    }


def rejoin_summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant, how the new node's join after each node loss went: modes, median downtime and steps lost."""
    out = {}
    for run in runs:
        joins = [ev["rejoin"] for ev in run["events"] if ev.get("rejoin", {}).get("outcome") == "ok"]
        if joins:
            down = [j["downtime_s"] for j in joins if j["downtime_s"] is not None]
            lost = [j["steps_lost"] for j in joins if j["steps_lost"] is not None]
            out[run["variant"]] = {
                "n": len(joins),
                "modes": [j["mode"] for j in joins],
                "downtime_median_s": median(down) if down else None,
                "steps_lost_median": median(lost) if lost else None,
            }
    return out


def target_report(summary: dict[str, Any], *, kind: str, baseline: str, hang_timeout_s: float) -> dict[str, Any]:
    """Issue 11's targets against the in-place variant's medians for ``kind``: value, target, met.

    A hang is not held to the downtime target (its detection alone takes ``hang_timeout_s``) but
    to detection within the hang timeout + 1 s, and then a repair like a crash.
    """
    ours = summary["by_kind"].get(kind, {}).get("hyperpodrun", {})
    values = {
        "steps_lost_median": (ours.get("steps_lost_median"), TARGETS["steps_lost_median"]),
        "downtime_median_s": (ours.get("downtime_median_s"), TARGETS["downtime_median_s"]),
        "lost_time_ratio": (
            summary["lost_time_ratio"].get("hyperpodrun", {}).get(baseline, {}).get(kind),
            TARGETS["lost_time_ratio"],
        ),
    }
    if kind == "hang":
        values = {
            "steps_lost_median": values["steps_lost_median"],
            "detect_median_s": (ours.get("detect_median_s"), hang_timeout_s + 1.0),
        }
    return {
        name: {"value": v, "target": target, "met": None if v is None else v <= target}
        for name, (v, target) in values.items()
    }
