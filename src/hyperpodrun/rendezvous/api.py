"""The rendezvous interface the agent drives, and the values it exchanges with it.

The agent runs one loop for every kind of job (see :mod:`hyperpodrun.agent`)::

    rdzv.join()
    while True:
        round = rdzv.next_round(timeout)          # membership, ranks, master address of the round
        start the ranks
        while directive is None:
            directive = rdzv.poll(LocalStatus)    # every monitor tick
        act on the directive (stop, save and exit, reconfigure, exit); rdzv.report_stopped(...)

:class:`~hyperpodrun.rendezvous.static.StaticRendezvous` (torchrun's fixed membership) and
:class:`~hyperpodrun.rendezvous.elastic.ElasticRendezvous` (store-backed) implement it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from elastic_events.contract import GroupAssignment, RestartReason
from hyperpodrun.errors import RendezvousError
from hyperpodrun.rendezvous.records import REPAIR_KINDS, EventKind
from hyperpodrun.supervisor import WorkerState


@dataclass(frozen=True, kw_only=True)
class RoundInfo:
    round: int
    assignment: GroupAssignment
    members: tuple[str, ...]
    reason: RestartReason = RestartReason.START
    restarts: int = 0  # failure restarts used by the job so far (TORCHELASTIC_RESTART_COUNT)
    admission: Directive | None = None  # admitted in place (RECONFIGURE) into a running job


class DirectiveKind(str, Enum):
    """What the agent must do with its running ranks.

    SAVE_AND_EXIT and RECONFIGURE go to the ranks over the control channel with a target
    step; STOP and EXIT are carried out by the agent at once.
    """

    SAVE_AND_EXIT = "save_and_exit"  # ranks save at target_step and exit; restarted at the new size
    RECONFIGURE = "reconfigure"  # ranks rebuild their process group in place at target_step
    STOP = "stop"  # stop the ranks now (lost node, failed rank, ranks that do not cooperate)
    EXIT = "exit"  # the job is over for this node: exit with exit_code


@dataclass(frozen=True, kw_only=True)
class Directive:
    kind: DirectiveKind
    event_id: int = 0
    event_kind: EventKind | None = None
    target_step: int = -1
    next_round: int = 0
    world_size: int = -1
    reason: str = ""
    exit_code: int = 0
    # RECONFIGURE: this node's place in the next round (group_rank -1: it leaves the job).
    group_rank: int = -1
    group_world_size: int = 0
    master_addr: str = ""
    master_port: int = 0
    members: tuple[str, ...] = ()  # RECONFIGURE: the next round's nodes in group-rank order
    hold: bool = False  # RECONFIGURE: the next round is below the minimum; its ranks save and hold the state
    from_held: bool = False  # RECONFIGURE from a held round: its ranks do not step, they act at once

    @property
    def repair(self) -> bool:
        """A RECONFIGURE that repairs a failure: acted on at once, survivors may be a step apart."""
        return self.kind == DirectiveKind.RECONFIGURE and self.event_kind in REPAIR_KINDS

    @property
    def leaves(self) -> bool:
        """A RECONFIGURE whose next round does not hold this node: its ranks leave the job."""
        return self.kind == DirectiveKind.RECONFIGURE and self.group_rank < 0


@dataclass(frozen=True, kw_only=True)
class LocalStatus:
    """What the agent tells the rendezvous on every tick."""

    group_state: WorkerState
    steps: tuple[int, ...]  # each local rank's count of elastic_event_detected() calls
    step_times: tuple[float, ...]  # each local rank's recent fastest seconds per step (0: not known yet)
    reconfigurable: bool = False  # every local rank declared the in-process API
    can_hold: bool = False  # every local rank holds the state below the minimum (elastic_events.rounds.hold)
    failure: str | None = None
    repairing: bool = False  # ``failure``'s ranks were restarted parked, to be repaired in place
    peer_failed: bool = False  # a local rank's collective failed (a peer died or hung); it waits for the repair
    finished: bool = False  # a local rank's training finished (ElasticTraining.finish, a framework's end)

    @property
    def cooperative(self) -> bool:
        """Every local rank calls ``elastic_event_detected()`` (one rank that does not would hang the others);
        a rank replaced to be repaired in place has not yet, but did before and is parked until admitted."""
        stepping = all(s > 0 for s in self.steps) or self.repairing
        return bool(self.steps) and stepping and self.group_state == WorkerState.HEALTHY


class RendezvousHandler(ABC):
    """One node's view of the job's membership."""

    @property
    @abstractmethod
    def node_id(self) -> str: ...

    @property
    def local_addr(self) -> str | None:
        """This node's address on the route to the store (None: no store, e.g. static membership)."""
        return None

    @property
    def lease_lost(self) -> bool:
        """Whether this node lost its membership (elastic jobs only)."""
        return False

    @property
    def leaving(self) -> bool:
        """Whether this node asked to leave the job (elastic jobs only)."""
        return False

    @property
    def elastic(self) -> bool:
        """Whether membership changes during the job: SIGTERM then means "leave at the next agreed step"."""
        return False

    @property
    def tick(self) -> float:
        """Seconds between store polls while ranks run."""
        return 0.2

    @property
    def in_process(self) -> bool:
        """Whether this node's current round reconfigures in place (every rank declared the API)."""
        return False

    @property
    def repairs_in_place(self) -> bool:
        """Whether a failed rank of this node's current round is replaced in place rather than the job
        restarted: the decider's own rule (:func:`hyperpodrun.rendezvous.plans.repairs_in_place`)."""
        return False

    @property
    def graceful_timeout(self) -> float:
        """Seconds ranks get to reach the target step and leave the round."""
        return 120.0

    def join(self) -> None:  # noqa: B027 - optional hook
        """Become known to the job (before the first round)."""

    @abstractmethod
    def next_round(self, *, timeout: float, prewarm: Callable[[], bool] | None = None) -> RoundInfo:
        """Block until this node is a member of a new round; raises RendezvousTimeoutError or RendezvousClosedError.

        ``prewarm`` is called while this node waits as a standby of a job whose ranks reconfigure in
        place: the agent starts its ranks parked (once) and answers whether they are parked yet, so
        the node is admitted only when admission costs no process start.
        """

    def entered_in_place(self, directive: Directive) -> RoundInfo:
        """The round a RECONFIGURE directive moved this node's running ranks into."""
        raise RendezvousError(f"{type(self).__name__}: static membership never reconfigures in place")

    @abstractmethod
    def poll(self, status: LocalStatus) -> Directive | None:
        """Called every monitor tick while this node's ranks run; a directive ends or changes the round."""

    def report_failure(self, message: str, *, repairable: bool) -> None:  # noqa: B027
        """This node's ranks failed, or are about to: the agent is killing ranks it found hung. Said before the
        kill, so that the job reads the failure as this node's and not as a silent node's when its peers'
        collectives fail on the killed ranks first (``poll`` says it too, once its ranks have exited)."""

    def report_stopped(self, event_id: int, *, ok: bool, reconfigured: bool = False) -> None:  # noqa: B027
        """This node's ranks have left the round of ``event_id`` (or moved to the next one in place)."""

    def request_leave(self) -> None:  # noqa: B027
        """Leave the job at the next agreed step (elastic jobs)."""

    def rejoin(self) -> None:  # noqa: B027
        """Register again after the membership lease expired (elastic jobs)."""

    def shutdown(self, *, succeeded: bool) -> None:  # noqa: B027 - optional hook
        """Leave the job for good (the agent is exiting)."""
