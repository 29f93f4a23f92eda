"""Hang detection: a rank that made no progress on the control channel for too long.

Every call of ``elastic_event_detected()`` stamps the rank's slot with the host's monotonic clock; a rank
whose stamp is older than the hang limit, while no scale event is pending, is hung (a
deadlocked collective, stuck I/O, a SIGSTOPped process). The limit is ``--hang-timeout``,
or, by default, ten times the slowest step seen, never below a minute. The decision is a
pure function of the progress and the time; the agent dumps the ranks' stacks and treats
the hang as a failure.

In a synchronous job one hung rank stops every rank: the others wait in a collective for
it. Where failures are repaired in place, only the culprits are killed (:func:`culprits`),
so that the waiting ranks keep the state the replacement is hydrated from.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from elastic_events.control import RankPhase, RankProgress

__all__ = ["HangPolicy", "HangReport", "culprits", "hung_ranks", "progress_clock"]


def progress_clock() -> float:
    """The clock the ranks stamp their progress with (the host's monotonic clock, shared by its
    processes): hang limits are measured on it, so a step of the wall clock never makes a rank hung."""
    return time.monotonic()


#: Process states (psutil's names) of a rank that cannot be merely waiting for a peer.
STUCK_STATES = frozenset({"stopped", "tracing-stop", "disk-sleep"})

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


@dataclass(frozen=True, kw_only=True)
class HangReport:
    """What the agent says of hung local ranks: one line for the user and the ``rank_hung`` record's fields."""

    line: str
    record: dict[str, object]

    @classmethod
    def of(
        cls,
        progress: Sequence[RankProgress],
        hung: Sequence[int],
        *,
        now: float,
        limit: float,
        rank: int,
        pid: int | None,
        log_file: str,
    ) -> HangReport:
        """The report on ``hung`` (local ranks; the first one is named: global ``rank``, ``pid``, ``log_file``)."""
        r = hung[0]
        idle = now - progress[r].time
        line = (
            f"rank {rank} (local rank {r}, pid {pid}) made no progress for {idle:.0f}s at step {progress[r].step} "
            f"(hang timeout {limit:g}s); Python stacks of every local rank in their logs: {log_file}"
        )
        record: dict[str, object] = dict(
            rank=rank,
            local_ranks=list(hung),
            step=progress[r].step,
            idle_s=round(idle, 3),
            hang_timeout=limit,
            log_file=log_file,
        )
        return cls(line=line, record=record)


def culprits(hung: Sequence[int], *, idle: dict[int, float], states: dict[int, str], limit: float) -> tuple[int, ...]:
    """The hung ranks to kill: those stopped or in uninterruptible I/O at once; ranks that are only
    waiting (most likely in a collective, for a peer that is the real culprit) once they have been
    idle for a second limit, which gives the culprit's own agent time to act."""
    stuck = tuple(r for r in hung if states.get(r) in STUCK_STATES)
    return stuck or tuple(r for r in hung if idle[r] > 2 * limit)


def dump_stacks(pids: list[int], *, wait: Callable[[float], object]) -> None:
    """Have ranks write their Python stacks to their logs (faulthandler, registered by elastic_events, on
    SIGUSR1; SIGCONT so that a SIGSTOPped rank dumps too), then ``wait`` a second for the dumps to land."""
    for pid in pids:
        for sig in (signal.SIGUSR1, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    wait(1.0)
