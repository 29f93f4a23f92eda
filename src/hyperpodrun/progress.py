"""The ranks' progress as the agent reads it off the control channel."""

from __future__ import annotations

from collections import deque

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
