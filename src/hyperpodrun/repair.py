"""The agent's side of failures repaired in place: replacing failed ranks, spare ranks, hung culprits.

In a round that runs in-process (every rank uses ``ElasticTraining``), a failed local rank is
replaced alone, parked, while its siblings and the other nodes' ranks keep their processes and
state (they wait in ``recover()``); the decider then makes the repair event. A spare
(:mod:`elastic_events.rounds.spare`) kept beside the ranks takes the first failed rank's place without a
process start. A hung rank is killed alone when it is the culprit (:func:`~hyperpodrun.hang.culprits`)
and then repaired like a crash.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from elastic_events.control import SNAPSHOT_WRITING, ControlWriter, RankPhase, RankProgress
from elastic_events.rounds.spare import spare_command
from hyperpodrun.config import LaunchConfig
from hyperpodrun.events import EventLog, EventType
from hyperpodrun.hang import culprits
from hyperpodrun.logs import RankLogs
from hyperpodrun.progress import grace_s
from hyperpodrun.supervisor import WorkerGroup, WorkerState

__all__ = ["InPlaceRepair", "poll_interval", "spares_for", "stuck_in_broken_group"]

#: A parked rank's log files and environment: (directory, local rank) -> (logs, env).
RankSetup = Callable[[Path, int], tuple[RankLogs, dict[str, str]]]

SPARE_CHECK_S = 1.0  # how often the agent looks whether a spare is due

#: How long after a repair is published a rank may stay blocked in the broken group before it is
#: killed and replaced: in its slowest recent step times, and at least ``STUCK_GRACE_MIN_S``.
STUCK_GRACE_STEPS = 4
STUCK_GRACE_MIN_S = 3.0

#: How long a blocked rank may take to write its hand-off before it is replaced without it.
HANDOFF_WRITE_S = 60.0

#: How often an agent reads the store while a failure is reported and its repair not yet published.
URGENT_POLL_S = 0.03


def poll_interval(*, repairing: bool, peer_failed: bool, pending: bool, tick: float) -> float:
    """Seconds until the agent reads the store again.

    A repair takes two rounds of reads before the ranks hear of it (every member acks the
    decider's event, then the decider targets it), so at the usual tick the survivors of a
    crash waited 0.4 s for bookkeeping (failures benchmark). While a failure is in flight on
    this node (a rank replaced, or ranks waiting in ``recover()``) and nothing is published
    yet, it reads every ``URGENT_POLL_S``: a few dozen reads per node per failure.
    """
    return URGENT_POLL_S if (repairing or peer_failed) and not pending else tick


#: A rank training: since its start (RUNNING), or since it last moved rounds in place (READY).
_TRAINING = (RankPhase.RUNNING, RankPhase.READY)


def stuck_in_broken_group(
    progress: Sequence[RankProgress], *, next_round: int, waited: float, slowest_step_s: float
) -> list[int]:
    """Local ranks still training in the broken round ``waited`` seconds after its repair was published.

    A survivor learns that a peer died when a collective fails. Each rank's repair watch
    (``elastic_events.rounds.abort``) shuts the broken round's connections down when the repair is
    published, which ends a collective blocked on a live peer; now and then a survivor blocked in
    DDP's backward still never returns (cause not found). One still training in the old round after a
    few step times is blocked for good: its node replaces it, and it is hydrated with the other
    newcomers. Its watch hands its state off first (``elastic_events.rounds.handoff``): a rank that has
    handed it off is replaced at once, one writing it is waited for (up to ``HANDOFF_WRITE_S``).
    """
    grace = grace_s(slowest_step_s, steps=STUCK_GRACE_STEPS, floor_s=STUCK_GRACE_MIN_S)
    writing = grace + HANDOFF_WRITE_S
    return [
        r
        for r, p in enumerate(progress)
        if p.phase in _TRAINING
        and p.round != next_round
        and (p.snapshot_step >= 0 or waited > (writing if p.snapshot_step == SNAPSHOT_WRITING else grace))
    ]


def spares_for(config: LaunchConfig) -> int:
    """Spare slots this node's control channel needs (a binary entrypoint cannot be pre-started)."""
    return 0 if config.no_python else config.spare_ranks


class InPlaceRepair:
    """What one agent does about its failed ranks while the job repairs failures in place."""

    def __init__(
        self,
        config: LaunchConfig,
        *,
        control: ControlWriter,
        events: EventLog,
        new_attempt: Callable[[], Path],
        rank_setup: RankSetup,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._clock = clock
        self._control, self._events = control, events
        self._new_attempt, self._rank_setup = new_attempt, rank_setup
        self._spares = spares_for(config)
        self._spare_checked = 0.0
        self._spare_announced: int | None = None  # pid of the spare whose readiness was logged

    def replace_failed(self, group: WorkerGroup, *, cause: str | None) -> tuple[WorkerState, str]:
        """Replace the failed local ranks, parked (the spare first); their siblings keep their state.

        ``cause``: why they failed when the agent knows better than their exit (it killed them as hung).
        Returns the group's state after it and the failure being repaired."""
        failures = group.failures()
        root = failures[0]
        what = cause or root.summary()
        self._events.emit(EventType.WORKER_FAILED, **root.record(), repaired_in_place=True)
        attempt_dir = self._new_attempt()
        pids = {}
        for failure in failures:
            self._control.reset_rank(failure.local_rank, acked_event=0)
            # The spare, parked with torch imported or still importing it: either way further along than a new
            # process (a failure soon after a repair finds the next spare starting); it reads the assignment when parked.
            if group.spare_running:
                self._control.assign_spare(0, failure.local_rank)
                pids[failure.global_rank] = group.promote_spare(failure.local_rank)
                continue
            logs, env = self._rank_setup(attempt_dir, failure.local_rank)
            pids[failure.global_rank] = group.replace(failure.local_rank, rank_env=env, logs=logs)
        self._events.emit(
            EventType.RANKS_REPLACED,
            ranks=sorted(pids),
            pids=list(pids.values()),
            reason=what,
            log_dir=str(attempt_dir),
        )
        _say(
            f"{what}; repairing in place: rank(s) {sorted(pids)} replaced, parked (pid {list(pids.values())}); "
            "the other ranks keep their state"
        )
        return group.poll(), what

    def kill_culprits(self, group: WorkerGroup, hung: Sequence[int]) -> None:
        """Kill only the hung ranks: their peers' collectives fail and they wait for the repair."""
        pids = group.pids
        for local_rank in hung:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pids[local_rank], signal.SIGKILL)

    def culprits(
        self, group: WorkerGroup, hung: Sequence[int], progress: Sequence[RankProgress], *, now: float, limit: float
    ) -> tuple[int, ...]:
        pids = group.pids
        return culprits(
            hung,
            idle={r: now - progress[r].time for r in hung},
            states={r: _status(pids[r]) for r in hung},
            limit=limit,
        )

    def keep_spare(self, group: WorkerGroup, *, repairing: bool, in_place: Callable[[], bool]) -> None:
        """Keep a spare beside the ranks of a job repaired in place (checked at most every second);
        ``repairing``: a failure's ranks are being replaced (its spare was used)."""
        now = self._clock()
        if group.spare_running and self._spare_announced is None and self._control.spare_phase(0) == RankPhase.PARKED:
            self._spare_announced = group.spare_pid
            self._events.emit(EventType.SPARE_READY, pid=group.spare_pid)
        if self._spare_announced is None and group.spare_pid is not None and not group.spare_running:
            self._spares = 0  # it died before it was ready: the failure would repeat
            _say(
                f"the spare rank (pid {group.spare_pid}) exited before it was ready; no spares for this job: see {group.spare_log}"
            )
            group.drop_spare()
        if not self._spares or repairing or group.spare_running or now - self._spare_checked < SPARE_CHECK_S:
            return
        self._spare_checked = now
        if not all(p.reconfigurable for p in self._control.progress()) or not in_place():
            return
        cfg = self.config
        spare_dir = self._new_attempt() / "spare"
        logs, env = self._rank_setup(spare_dir, 0)
        self._control.reset_spare(0)
        command = spare_command(
            cfg.python,
            str(self._control.path),
            self._control.spare_slot(0),
            script=None if cfg.module else cfg.entrypoint,
            module=cfg.entrypoint if cfg.module else None,
            args=cfg.args,
        )
        group.start_spare(command, env=env, logs=logs)
        self._spare_announced = None


def _status(pid: int) -> str:
    """The process state of ``pid`` as psutil names it ("" when it is gone)."""
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return ""


def _say(message: str) -> None:
    print(f"hyperpodrun: {message}", file=sys.stderr, flush=True)
