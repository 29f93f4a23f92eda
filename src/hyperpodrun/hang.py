"""Hang detection: a rank that made no progress on the control channel for too long.

Every call of ``elastic_event_detected()`` stamps the rank's slot with the time; a rank
whose stamp is older than the hang limit, while no scale event is pending, is hung (a
deadlocked collective, stuck I/O, a SIGSTOPped process). The limit is ``--hang-timeout``,
or, by default, ten times the slowest step seen, never below a minute. The decision is a
pure function of the progress and the time; the agent dumps the ranks' stacks and treats
the hang as a failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elastic_events.control import RankPhase, RankProgress

__all__ = ["HangPolicy", "hung_ranks"]

#: Phases in which a rank is expected to call elastic_event_detected() every step.
STEPPING = frozenset({RankPhase.STARTING, RankPhase.RUNNING, RankPhase.READY})


@dataclass(frozen=True, kw_only=True)
class HangPolicy:
    """``timeout``: seconds without progress (0: off; None: derived from the step time)."""

    timeout: float | None = None
    floor: float = 60.0
    factor: float = 10.0

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout >= 0:
            raise ValueError(f"--hang-timeout: must be >= 0 seconds (0: off), got {self.timeout!r}")

    def limit(self, slowest_step: float) -> float | None:
        """The seconds without progress that make a rank hung (None: detection is off)."""
        if self.timeout == 0:
            return None
        if self.timeout is not None:
            return self.timeout
        return max(self.floor, self.factor * slowest_step)


def hung_ranks(progress: Sequence[RankProgress], *, now: float, limit: float | None) -> tuple[int, ...]:
    """Local ranks that stepped at least once and have not stepped for more than ``limit`` seconds."""
    if limit is None:
        return ()
    return tuple(
        r for r, p in enumerate(progress) if p.step > 0 and p.time > 0 and p.phase in STEPPING and now - p.time > limit
    )
