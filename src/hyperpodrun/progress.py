"""The ranks' progress as the agent reads it off the control channel."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from elastic_events.control import RankProgress


class StepRates:
    """Seconds per step of each local rank, from successive control-channel readings.

    A rank's rate is the fastest of its recent intervals: one slow step (a checkpoint, an
    evaluation) must not make the agent think ranks are slow, or the target step it agrees
    on would be too close and a fast rank would pass it before learning it.
    """

    WINDOW = 8

    def __init__(self, nproc: int) -> None:
        self._last: list[RankProgress | None] = [None] * nproc
        self._recent: list[deque[float]] = [deque(maxlen=self.WINDOW) for _ in range(nproc)]

    def update(self, progress: list[RankProgress]) -> tuple[tuple[int, ...], tuple[float, ...]]:
        for r, p in enumerate(progress):
            last = self._last[r]
            if last is not None and p.step > last.step and p.time > last.time > 0:
                self._recent[r].append((p.time - last.time) / (p.step - last.step))
            if last is None or p.step != last.step:
                self._last[r] = p
        return tuple(p.step for p in progress), tuple(min(q, default=0.0) for q in self._recent)

    @property
    def slowest(self) -> float:
        """The slowest recent seconds per step of any rank (0: not known yet)."""
        return max((max(q) for q in self._recent if q), default=0.0)


def missed_target(progress: list[RankProgress], event_id: int, target_step: int) -> list[int]:
    """Local ranks that are at or past ``target_step`` without having acted on ``event_id``."""
    return [r for r, p in enumerate(progress) if p.step >= target_step and p.acked_event != event_id]


def grace_s(slowest_step_s: float, *, steps: float, floor_s: float) -> float:
    """``steps`` of the slowest rank's step times, and never less than ``floor_s``: how long a rank may
    take to do what it does once per step (act on an event, notice a failed collective)."""
    return max(floor_s, steps * slowest_step_s)


#: How long a rank that was past an event's target step when it was written may take to act on it
#: at its next step, in its slowest recent step times (and at least ``LATE_GRACE_MIN_S``).
LATE_GRACE_STEPS = 4
LATE_GRACE_MIN_S = 1.0


@dataclass(frozen=True)
class LateRanks:
    """Local ranks that had passed an event's target step when the agent wrote it.

    A rank acts at the first step at or past the target (``ControlReader.check``), so a late
    rank acts one step after the others' target. That is safe when every rank of the job was
    late (data parallelism keeps ranks in lockstep: they all act at the same later step), and a
    deadlock when some rank acted at the target in time: the late rank is then blocked in the next
    step's collective and never checks again. So a late rank that has not acted within a few of
    its step times means the event must stop instead.
    """

    event_id: int
    ranks: tuple[int, ...]
    deadline: float  # monotonic

    @classmethod
    def after_publish(cls, event_id: int, ranks: list[int], *, now: float, slowest_step_s: float) -> LateRanks | None:
        if not ranks:
            return None
        return cls(
            event_id, tuple(ranks), now + grace_s(slowest_step_s, steps=LATE_GRACE_STEPS, floor_s=LATE_GRACE_MIN_S)
        )

    def stuck(self, progress: list[RankProgress], now: float) -> list[int] | None:
        """The late ranks that never acted, once the grace is over; None while it lasts; [] when all acted."""
        waiting = [r for r in self.ranks if progress[r].acked_event != self.event_id]
        if waiting and now <= self.deadline:
            return None
        return waiting
