"""Analysis of scale-event runs (``scale_events.py``): per-event downtime, steps lost,
phases from the launcher's event log, medians / ratios across launcher variants, the plot.

Everything but the plot is pure and works on plain records (rank 0's ``--metrics``
lines, event-log lines), so it is unit-tested without starting anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import BenchmarkResult, median, pyplot

#: Launcher variants, ours first. ``hyperpodrun``: default ``--restart-mode auto`` (in place
#: when every rank uses ``ElasticTraining``); ``hyperpodrun-restart``: ``--restart-mode process``.
OURS = ("hyperpodrun", "hyperpodrun-restart")
BASELINES = ("torchrun-noshare", "torchrun")
VARIANTS = OURS + BASELINES

#: Event-log records that mark the phases of a scale event, in the order they happen.
INPLACE_PHASES = (
    "scale_decided",
    "workers_signalled",
    "group_torn_down",
    "rendezvous_done",
    "group_up",
    "hydrated",
    "workers_reconfigured",
    "first_step",
)
RESTART_PHASES = (
    "scale_decided",
    "workers_signalled",
    "checkpoint_saved",
    "workers_stopped",
    "rendezvous_done",
    "workers_started",
    "checkpoint_loaded",
    "first_step",
)


def event_phase(index: int, ckpt_every: int) -> int:
    """Where in the checkpoint interval event ``index`` is triggered (after step ``s``, ``s % K``).

    Successive events walk the interval in strides of 7 (coprime with usual intervals), so
    over a scenario the baseline's lost work is sampled across the interval, not at one point.
    """
    return (3 + 7 * index) % ckpt_every if ckpt_every else 0


def step_interval(records: Sequence[dict[str, Any]], *, before_ts: float, world: int, last: int = 6) -> float | None:
    """Median time between consecutive logged steps at ``world`` that ended by ``before_ts``."""
    steady = [r for r in records if r["ts"] <= before_ts and r["world_size"] == world][-last:]
    gaps = [b["ts"] - a["ts"] for a, b in zip(steady, steady[1:]) if b["step"] == a["step"] + 1]
    return median(gaps) if gaps else None


def measure_event(records: list[dict[str, Any]], *, t_event: float, to_world: int) -> dict[str, Any] | None:
    """Downtime and steps lost of one event from rank 0's step log, or None if not recovered yet.

    ``records`` are (ts, step, world_size) dicts in log order. The first record after
    ``t_event`` at ``to_world`` is the first step at the new size; the record before it
    in time is the last step before the change. ``downtime_s`` runs from the end of that
    last step to the end of the first new one (so it holds one step); ``pause_s`` takes a
    normal step (the median interval just before) off it: the time no rank trained.
    """
    after = [r for r in records if r["ts"] > t_event and r["world_size"] == to_world]
    if not after:
        return None
    first_new = after[0]
    before = [r for r in records if r["ts"] < first_new["ts"] and r["world_size"] != to_world]
    if not before:
        return None
    return gap_between(records, max(before, key=lambda r: r["ts"]), first_new)


def lost_time(downtime_s: float, steps_lost: int, step_time_s: float) -> float:
    """Wall time an event cost against a run without it: the downtime less the one step it holds (that
    step was trained: the first after the event), plus every step trained again. The first term is
    :func:`gap_between`'s ``pause_s`` with the run's configured step time in place of the interval
    measured before the event, so that every launcher in a comparison is charged the same step.
    (``downtime + steps_lost x step`` would count the held step as lost too: one step time more for
    every launcher, which flatters the slower one's ratio.)
    """
    return max(0.0, downtime_s - step_time_s) + steps_lost * step_time_s


def gap_between(records: list[dict[str, Any]], last_old: dict[str, Any], first_new: dict[str, Any]) -> dict[str, Any]:
    """Downtime, pause and steps lost between the last step before an event and the first after it."""
    downtime = first_new["ts"] - last_old["ts"]
    interval = step_interval(records, before_ts=last_old["ts"], world=last_old["world_size"])
    return {
        "downtime_s": downtime,
        "step_interval_s": interval,
        "pause_s": max(0.0, downtime - interval) if interval is not None else None,
        "last_old_step": last_old["step"],
        "first_new_step": first_new["step"],
        "steps_lost": max(0, last_old["step"] - (first_new["step"] - 1)),
        "last_old_ts": last_old["ts"],
        "first_new_ts": first_new["ts"],
    }


def hyperpodrun_phases(events: list[dict[str, Any]], t_event: float) -> dict[str, float]:
    """Seconds from the event to the first record of each phase in hyperpodrun's event log.

    Reads from ``t_event`` up to the trainer's ``first_step`` of the new round. A
    ``checkpoint_saved`` counts only once the ranks were signalled: periodic saves
    before that are not part of the event. ``group_torn_down`` and ``hydrated`` also
    bring their own durations (``teardown_s``, ``hydration_own_s``).
    """
    phases: dict[str, float] = {}
    for record in events:
        name = record["event"]
        if record["ts"] <= t_event or name in phases:
            continue
        if name == "checkpoint_saved" and "workers_signalled" not in phases:
            continue
        phases[name] = record["ts"] - t_event
        if name == "group_torn_down" and "seconds" in record:
            phases["teardown_s"] = float(record["seconds"])
        if name == "hydrated" and "seconds" in record:
            phases["hydration_own_s"] = float(record["seconds"])
        if name == "first_step":
            break
    return phases


def bytes_moved(events: list[dict[str, Any]], t_event: float) -> int | None:
    """The bytes the ranks sent between replicas for the event (HSDP: the ``hydrated`` record's ``bytes_moved``
    after ``t_event``; None where the path does not count them)."""
    hydrated = [r for r in events if r["event"] == "hydrated" and r["ts"] > t_event]
    return hydrated[0].get("bytes_moved") if hydrated else None


def moved_by_kind(runs: list[dict[str, Any]]) -> dict[str, dict[str, list[int | None]]]:
    """Each hyperpodrun variant's ``bytes_moved`` per event kind, in event order."""
    out: dict[str, dict[str, list[int | None]]] = {}
    for run in runs:
        for ev in run["events"]:
            if "bytes_moved" in ev:
                out.setdefault(run["variant"], {}).setdefault(ev["kind"], []).append(ev["bytes_moved"])
    return out


def event_mode(events: list[dict[str, Any]], phases: dict[str, float], t_event: float) -> str:
    """``in-place`` when a rendezvous of the event moved ranks in place, else ``restart``.

    Read from the agents' ``rendezvous_done`` records up to the first step of the new
    round (a joiner's agent also logs its admission round, without ``in_place``).
    """
    window_end = t_event + phases.get("first_step", float("inf"))
    done = [r for r in events if t_event < r["ts"] <= window_end and r["event"] == "rendezvous_done"]
    if any(r.get("in_place") for r in done):
        return "in-place"
    return "restart" if done or "workers_started" in phases else "unknown"


#: Spans (start record, end record) of each kind of event, reported as medians.
RESTART_SPANS = {
    "save": ("workers_signalled", "checkpoint_saved"),  # includes running on to the target step: not downtime
    "exit_after_save": ("checkpoint_saved", "workers_stopped"),
    "restart": ("workers_started", "first_step"),  # process start, imports, group, checkpoint load, a step
}
INPLACE_SPANS = {
    "to_target": ("workers_signalled", "group_torn_down"),  # running on to the target step, then teardown
    "group_init": ("group_torn_down", "group_up"),
    "hydration": ("group_up", "hydrated"),
    "to_first_step": ("hydrated", "first_step"),  # one step of the new round
}


def phase_breakdown(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Where each hyperpodrun variant's events spend their time (medians of spans, seconds).

    Only events that took the mode the spans describe are counted (a fallback to a
    restart in the in-process variant counts as a restart).
    """
    out: dict[str, dict[str, float | None]] = {}
    for variant in OURS:
        values: dict[str, list[float]] = {}
        for run in runs:
            if run["variant"] != variant:
                continue
            for ev in run["events"]:
                phases = ev.get("phases_s") or {}
                spans = INPLACE_SPANS if ev.get("mode") == "in-place" else RESTART_SPANS
                for name, (start, end) in spans.items():
                    if start in phases and end in phases:
                        values.setdefault(name, []).append(phases[end] - phases[start])
                for own in ("teardown_s", "hydration_own_s"):
                    if own in phases:
                        values.setdefault(own.removesuffix("_s"), []).append(phases[own])
        if values:
            out[variant] = {f"{name}_median_s": median(v) for name, v in values.items()}
    return out


#: Per-event measurement -> the name of its median in the summary.
_MEDIANS = {
    "downtime_s": "downtime_median_s",
    "pause_s": "pause_median_s",
    "lost_time_s": "lost_time_median_s",
    "steps_lost": "steps_lost_median",
    "detect_s": "detect_median_s",
}


def summarize_events(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per event kind and launcher variant, and ratios of ours to each baseline.

    ``lost_time`` (:func:`lost_time`) is the pause plus the time to recompute the lost steps: the
    training time an event really costs. Ratios are ``downtime_ratio[ours][baseline][kind]``.
    """
    samples: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        for ev in run["events"]:
            slot = samples.setdefault(ev["kind"], {}).setdefault(
                run["variant"], {"outcomes": [], "modes": [], **{m: [] for m in _MEDIANS}}
            )
            slot["outcomes"].append(ev["outcome"])
            if ev.get("mode"):
                slot["modes"].append(ev["mode"])
            if ev["outcome"] == "ok":
                for m in _MEDIANS:
                    if ev.get(m) is not None:
                        slot[m].append(ev[m])
    summary: dict[str, Any] = {
        "by_kind": {},
        "downtime_ratio": {},
        "pause_ratio": {},
        "lost_time_ratio": {},
        "steps_lost_median": {},
    }
    for kind, variants in samples.items():
        by_variant = {
            v: {
                "n": len(s["outcomes"]),
                "ok": s["outcomes"].count("ok"),
                "outcomes": s["outcomes"],
                **({"modes": s["modes"]} if s["modes"] else {}),
                **{name: median(s[m]) if s[m] else None for m, name in _MEDIANS.items()},
            }
            for v, s in variants.items()
        }
        summary["by_kind"][kind] = by_variant
        summary["steps_lost_median"][kind] = {v: s["steps_lost_median"] for v, s in by_variant.items()}
        for metric, ratio in (
            ("downtime_median_s", "downtime_ratio"),
            ("pause_median_s", "pause_ratio"),
            ("lost_time_median_s", "lost_time_ratio"),
        ):
            for ours in OURS:
                mine = by_variant.get(ours, {}).get(metric)
                for theirs in (*BASELINES, *(o for o in OURS if o != ours)):
                    base = by_variant.get(theirs, {}).get(metric)
                    if mine is not None and base:
                        summary[ratio].setdefault(ours, {}).setdefault(theirs, {})[kind] = mine / base
    return summary


def plot(result: BenchmarkResult, runs: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for i, run in enumerate(runs):
        tl = run["timeline"]
        if not tl:
            continue
        t0 = tl[0][0]
        for world, marker in ((1, "."), (2, "^")):
            pts = [(t - t0, step) for t, step, w in tl if w == world]
            ax1.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker,
                color=f"C{i}",
                markersize=3,
                label=f"{run['variant']}, world {world}",
            )
        for ev in run["events"]:
            ax1.axvline(ev["t_event"] - t0, color=f"C{i}", alpha=0.3, linestyle=":")
    ax1.set_xlabel("seconds since the first logged step")
    ax1.set_ylabel("step (rank 0)")
    ax1.set_title("progress: gaps = downtime, steps going back = recomputation (dotted: events)", fontsize=10)
    ax1.legend(fontsize=7, ncol=2)
    ax1.grid(True, alpha=0.3)
    kinds = list(summary["by_kind"])
    width = 0.8 / len(VARIANTS)
    for j, variant in enumerate(VARIANTS):
        stats = [summary["by_kind"][k].get(variant) for k in kinds]
        xs = [x + (j - (len(VARIANTS) - 1) / 2) * width for x in range(len(kinds))]
        lost = [(s or {}).get("lost_time_median_s") or 0 for s in stats]
        down = [(s or {}).get("downtime_median_s") or 0 for s in stats]
        ax2.bar(xs, lost, width, color=f"C{j}", alpha=0.35)
        ax2.bar(xs, down, width, color=f"C{j}", label=variant)
        for x, st in zip(xs, stats):
            if st is not None and st["ok"] == 0:
                ax2.text(
                    x, 0.2, "/".join(sorted(set(st["outcomes"]))), rotation=90, ha="center", va="bottom", fontsize=8
                )
    ax2.set_xticks(range(len(kinds)), kinds)
    ax2.set_ylabel("seconds (median)")
    ax2.set_title("downtime (solid) and + recomputed steps (light)", fontsize=10)
    ax2.legend(fontsize=8)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(
        f"{result.name} ({result.mode}, step time {result.params['timers']['step_time_s']} s, "
        f"checkpoint every {result.params['train']['ckpt_every']} steps)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
