"""Made-up benchmark events, as ``scale_events.py`` and ``failures.py`` record them, for tests of their summaries."""

from __future__ import annotations

from typing import Any


def event(
    kind: str, downtime: float, lost: int, *, mode: str | None = None, moved: int | None = None
) -> dict[str, Any]:
    """One recovered event: ``downtime`` s with one 0.5 s step in it, ``lost`` steps redone, detected in 1 s;
    ``mode`` (in-place or restart) for hyperpodrun's, with ``moved`` bytes sent between ranks."""
    return {
        "kind": kind,
        "outcome": "ok",
        "downtime_s": downtime,
        "pause_s": downtime - 0.5,
        "steps_lost": lost,
        "lost_time_s": downtime + 0.5 * lost,
        "detect_s": 1.0,
        **({"mode": mode, "bytes_moved": moved} if mode else {}),
    }
