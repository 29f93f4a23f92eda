"""What one agent has in flight while its ranks run: the monitor's state, its transitions and its decisions.

The agent's monitor (:meth:`hyperpodrun.agent.Agent._monitor`) watches one group of ranks through
one or more rounds. Its state is one :class:`InFlight` value, replaced at each transition (it is
frozen); its :attr:`~InFlight.phase` names where it is. Phases (``MonitorPhase``) and transitions::

    IDLE --(a directive SAVE_AND_EXIT / RECONFIGURE)----------> PUBLISHED   (published)
    IDLE --(a local rank failed, repaired in place)-----------> REPAIRING   (replaced)
    IDLE --(a local rank failed, not repaired in place)-------> FAILED      (failure_stopped)
    IDLE --(a hung rank, repaired in place: culprits killed)--> KILLED      (culprits_killed)
    IDLE --(a hung rank, not repaired in place)---------------> HUNG        (declared_hung)
    KILLED --(the killed ranks show as failed)----------------> REPAIRING   (replaced)
    REPAIRING --(the decider's repair RECONFIGURE)------------> PUBLISHED   (published)
    ADMITTING / PUBLISHED --(every local rank READY in it)----> IDLE        (moved: the next round, same group)
    ADMITTING / PUBLISHED --(a RECONFIGURE whose rank failed,
        the ranks exited, the graceful timeout passed)-------> the round ends for this node (event_end)
    PUBLISHED (a repair) --(a rank blocked in the broken group,
        or a killed culprit)---------------------------------> PUBLISHED, killed and then replaced
    PUBLISHED (a scale RECONFIGURE) --(a local rank failed)--> PUBLISHED, replaced (its replacement is
                                                                admitted by the same event)
    any --(STOP or EXIT)--------------------------------------> the round ends for this node (stopped now)

A group starts IDLE (:meth:`InFlight.idle`) or, for a standby's parked ranks given an admission,
ADMITTING (:meth:`InFlight.admitting`). Every decision below is a pure function of the state, the
time and what the agent observed (the group's state, the ranks' control-channel progress): the agent
carries the decisions out (writes the control channel, starts and stops ranks, talks to the store).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from elastic_events.control import CAP_HOLD, RankPhase, RankProgress
from hyperpodrun.progress import LateRanks
from hyperpodrun.rendezvous import Directive, DirectiveKind, LocalStatus
from hyperpodrun.supervisor import WorkerState

__all__ = ["Answer", "EventEnd", "InFlight", "MonitorPhase", "answer", "event_end", "local_status"]


class MonitorPhase(str, Enum):
    """Where one node's monitor is (see the module's transition table)."""

    IDLE = "idle"  # the ranks train, nothing in flight: hangs are watched and a spare kept
    ADMITTING = "admitting"  # this standby's parked ranks were given the round's admission
    PUBLISHED = "published"  # a cooperative event is on the control channel: the ranks act at its target
    REPAIRING = "repairing"  # failed local ranks were replaced, parked; the repair is not published yet
    KILLED = "killed"  # hung or blocked local ranks were killed, to be replaced like a crash
    HUNG = "hung"  # a hung group was stopped (not repaired in place): reported as failed
    FAILED = "failed"  # a failed rank's siblings were stopped (not repaired in place): the decider ends the round


@dataclass(frozen=True, kw_only=True)
class InFlight:
    """The event in flight on one node and the local failure being handled, for one group of ranks."""

    event: Directive | None = None  # the cooperative event on the control channel (SAVE_AND_EXIT, RECONFIGURE)
    admission: bool = False  # ``event`` admits parked ranks (written before the monitor began)
    published: float = 0.0  # when ``event`` was written (the agent's clock)
    deadline: float = 0.0  # when the ranks must have acted on ``event`` (the graceful shutdown timeout)
    late: LateRanks | None = None  # ranks that had passed ``event``'s target when it was written
    replaced: str | None = None  # the failure whose ranks were replaced parked, until a RECONFIGURE moves them
    killed: str | None = None  # why hung or blocked ranks were killed, until they are replaced
    hung: str | None = None  # why the group was declared hung and stopped (not repaired in place)
    failure_stopped: bool = False  # a rank failed and its siblings were stopped (not repaired in place)

    # -- the phase -------------------------------------------------------------------

    @property
    def phase(self) -> MonitorPhase:
        if self.event is not None:
            return MonitorPhase.ADMITTING if self.admission else MonitorPhase.PUBLISHED
        if self.hung is not None:
            return MonitorPhase.HUNG
        if self.failure_stopped:
            return MonitorPhase.FAILED
        if self.killed is not None:
            return MonitorPhase.KILLED
        if self.replaced is not None:
            return MonitorPhase.REPAIRING
        return MonitorPhase.IDLE

    # -- transitions -----------------------------------------------------------------

    @classmethod
    def idle(cls) -> InFlight:
        """A group just started for a round."""
        return cls()

    @classmethod
    def admitting(cls, admission: Directive, *, now: float, graceful: float) -> InFlight:
        """Parked ranks given the round's admitting ``admission`` at ``now``."""
        return cls(event=admission, admission=True, published=now, deadline=now + graceful)

    def publish(self, event: Directive, *, now: float, graceful: float, late: LateRanks | None) -> InFlight:
        """``event`` written on the control channel at ``now``; ``late``: the ranks already past its target."""
        return dataclasses.replace(
            self, event=event, admission=False, published=now, deadline=now + graceful, late=late
        )

    def moved(self) -> InFlight:
        """Every local rank moved into the RECONFIGURE event's round: nothing in flight, the repair done."""
        return dataclasses.replace(self, event=None, admission=False, late=None, replaced=None)

    def late_settled(self) -> InFlight:
        """The late ranks acted on the event, or their grace is over."""
        return dataclasses.replace(self, late=None)

    def replace_failed(self, failure: str) -> InFlight:
        """The failed local ranks were replaced, parked, because of ``failure``."""
        return dataclasses.replace(self, replaced=failure, killed=None, hung=None)

    def stop_failed(self) -> InFlight:
        """A rank failed and the job does not repair in place: its siblings were stopped."""
        return dataclasses.replace(self, failure_stopped=True)

    def culprits_killed(self, why: str) -> InFlight:
        """Hung or blocked local ranks were killed: they are replaced once they show as failed."""
        return dataclasses.replace(self, killed=why)

    def declared_hung(self, why: str) -> InFlight:
        """The group was declared hung and stopped."""
        return dataclasses.replace(self, hung=why)

    # -- decisions -------------------------------------------------------------------

    @property
    def acts_on_failure(self) -> bool:
        """Whether a failed local rank is acted on now: with nothing in flight; during a repair, a rank
        this agent killed (blocked in the broken group); during a scale RECONFIGURE this node stays in,
        any (its replacement is admitted by that event while the survivors take its group at once).
        The ranks of a node that leaves in the event are on their way out: a failure is their exit."""
        if self.failure_stopped:
            return False
        ev = self.event
        if ev is None:
            return True
        rescued = ev.repair and self.killed is not None
        scaling = ev.kind == DirectiveKind.RECONFIGURE and not ev.repair and not ev.leaves
        return rescued or scaling

    def watches_hang(self, state: WorkerState) -> bool:
        """Whether hangs are looked for (and a spare kept): healthy ranks, nothing in flight or being handled."""
        return self.event is None and state == WorkerState.HEALTHY and self.hung is None and self.killed is None

    def watches_broken_group(self, state: WorkerState) -> bool:
        """Whether ranks still blocked in a repaired round's broken group are looked for."""
        return self.event is not None and self.event.repair and state == WorkerState.HEALTHY and self.killed is None


class Answer(str, Enum):
    """What the monitor does with a directive the rendezvous returned."""

    PUBLISH = "publish"  # put it on the control channel (SAVE_AND_EXIT, RECONFIGURE)
    STOP_NOW = "stop_now"  # stop the ranks at once (STOP, EXIT)
    IGNORE = "ignore"  # an event is in flight already: one at a time


def answer(flight: InFlight, directive: Directive) -> Answer:
    if directive.kind in (DirectiveKind.EXIT, DirectiveKind.STOP):
        return Answer.STOP_NOW
    return Answer.IGNORE if flight.event is not None else Answer.PUBLISH


class EventEnd(str, Enum):
    """How the event in flight ends for this node."""

    MOVED = "moved"  # every local rank runs in the RECONFIGURE event's round: the group goes on
    FELL_BACK = "fell_back"  # a local rank reported FAILED while moving rounds: the ranks stop, a restart follows
    LEFT = "left"  # the ranks exited (a SAVE_AND_EXIT's save, a leaving node, a failure)
    TIMED_OUT = "timed_out"  # they did not, within the graceful shutdown timeout: they are killed


#: A rank's phases once it runs in the round it moved to.
_IN_ROUND = (RankPhase.READY, RankPhase.RUNNING, RankPhase.HOLDING)


def event_end(flight: InFlight, *, now: float, state: WorkerState, progress: Sequence[RankProgress]) -> EventEnd | None:
    """How the event in flight ends now; None: it goes on (or nothing is in flight)."""
    ev = flight.event
    if ev is None:
        return None
    reconfigure = ev.kind == DirectiveKind.RECONFIGURE
    if state == WorkerState.HEALTHY and reconfigure and moved_in_place(ev, progress):
        return EventEnd.MOVED
    if reconfigure and any(p.phase == RankPhase.FAILED for p in progress):
        return EventEnd.FELL_BACK
    if state != WorkerState.HEALTHY:
        return EventEnd.LEFT
    return EventEnd.TIMED_OUT if now > flight.deadline else None


def moved_in_place(event: Directive, progress: Sequence[RankProgress]) -> bool:
    """Every local rank runs in the RECONFIGURE ``event``'s round (a leaving node's ranks never do)."""
    if event.kind != DirectiveKind.RECONFIGURE or event.leaves:
        return False
    return all(p.round == event.next_round and p.phase in _IN_ROUND for p in progress)


def local_status(
    flight: InFlight,
    *,
    state: WorkerState,
    progress: Sequence[RankProgress],
    steps: tuple[int, ...],
    step_times: tuple[float, ...],
    failure: str | None,
    finished: bool,
) -> LocalStatus:
    """What this node tells the rendezvous at a poll. ``failure``: the first failed rank's summary."""
    return LocalStatus(
        group_state=WorkerState.FAILED if flight.hung else state,
        steps=steps,
        step_times=step_times,  # a rank replaced to be repaired in place declares again once it runs
        reconfigurable=all(p.reconfigurable for p in progress) or flight.replaced is not None,
        can_hold=all(p.capabilities & CAP_HOLD for p in progress),
        failure=flight.replaced or flight.hung or failure,
        repairing=flight.replaced is not None,
        peer_failed=any(p.phase == RankPhase.RECOVERING for p in progress),
        finished=finished,
    )
