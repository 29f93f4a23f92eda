"""The job's records in the store: key layout, typed records and their JSON codec.

Shared by the member side (:mod:`.elastic`), the decider (:mod:`.decider`) and
``hyperpodctl``: a record or key is defined here once. Keys under the job prefix::

    nodes/<id>          leased  NodeRecord      one per agent (address, fresh master port, leaving)
    decider             leased  <id>            which agent runs the policy
    round                       RoundRecord     members, master, state, restarts, event history
    event                       EventRecord     the current round's scale event (the decision record)
    ack/<event>/<id>            AckRecord       a member's ranks' progress when it saw the event
    stopped/<event>/<id>        StoppedRecord   a member's ranks have left the round
    done/<round>/<id>           {}              a member's ranks all exited 0
    failed/<round>/<id>         FailedRecord    a member's rank failed
    closed                      ClosedRecord    the job is over
    history                     [HistoryEntry]  last 50 decisions (hyperpodctl status/events)
    ctl/cap                     CapRecord       operator cap (hyperpodctl cap/yield/uncap)

Decoding is tolerant of fields it does not know (a newer writer) and strict about the
ones it needs: a malformed record raises :class:`RecordError` naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from hyperpodrun.errors import RendezvousError

if TYPE_CHECKING:
    from hyperpodrun.store.base import Entry

__all__ = [
    "AckRecord",
    "CapRecord",
    "ClosedRecord",
    "EventKind",
    "EventMode",
    "EventRecord",
    "FailedRecord",
    "HistoryEntry",
    "JobOutcome",
    "Keys",
    "NodeRecord",
    "REPAIR_KINDS",
    "RecordError",
    "RoundRecord",
    "RoundState",
    "StoppedRecord",
    "cap_of",
    "decode",
    "decode_prefix",
    "encode",
]


class RecordError(RendezvousError):
    """A store key holds something that is not the record it should be."""


class Keys:
    """The key layout under the job prefix."""

    NODES = "nodes/"
    DECIDER = "decider"
    ROUND = "round"
    EVENT = "event"
    CLOSED = "closed"
    HISTORY = "history"
    CAP = "ctl/cap"

    @staticmethod
    def node(node_id: str) -> str:
        return f"nodes/{node_id}"

    @staticmethod
    def acks(event_id: int) -> str:
        return f"ack/{event_id}/"

    @staticmethod
    def stopped(event_id: int) -> str:
        return f"stopped/{event_id}/"

    @staticmethod
    def done(round_no: int) -> str:
        return f"done/{round_no}/"

    @staticmethod
    def failed(round_no: int) -> str:
        return f"failed/{round_no}/"

    @staticmethod
    def finished(round_no: int) -> str:
        """Nodes a rank of which reported its training finished in the round (no event is acted on after it)."""
        return f"finished/{round_no}/"

    @staticmethod
    def leaf(key: str) -> str:
        """The node id at the end of a per-node key (``ack/3/<id>`` -> ``<id>``)."""
        return key.rsplit("/", 1)[1]


class RoundState(str, Enum):
    """A round is RUNNING until an event ends it without a successor: then HALTED.

    Transitions: RUNNING -(event with next members)-> RUNNING (round + 1);
    RUNNING -(event without: failure, insufficient nodes, lost node)-> HALTED;
    HALTED -(policy or failure restart)-> RUNNING (round + 1).
    A RUNNING round may be *held* (``RoundRecord.held``): below the minimum, its ranks hold the state
    without training; its next round (in place, when nodes join) is a RUNNING one again (see :mod:`.hold`).
    """

    RUNNING = "running"
    HALTED = "halted"


class EventKind(str, Enum):
    """Why a scale event happens: the one vocabulary of the agent, decider, event log and hyperpodctl."""

    JOIN = "join"  # standbys admitted
    LEAVE = "leave"  # a member asked to leave (SIGTERM)
    YIELD = "yield"  # operator cap, max world size or a size the policy does not allow
    NODE_LOST = "node_lost"  # a member's lease expired
    RANK_FAILURE = "rank_failure"  # a rank exited non-zero
    INSUFFICIENT = "insufficient"  # too few nodes for any allowed size: stop and wait


#: Failures an in-process round repairs in place (a RECONFIGURE at once, no agreed step: a peer is gone).
REPAIR_KINDS = frozenset({EventKind.RANK_FAILURE, EventKind.NODE_LOST})


class EventMode(str, Enum):
    """How the ranks of surviving members are moved to the next round."""

    RECONFIGURE = "reconfigure"  # at the agreed step, rebuild the process group in place
    RESTART = "restart"  # at the agreed step, save a checkpoint and exit; restarted at the new size
    STOP = "stop"  # stop now (lost node, failed rank, ranks that do not cooperate); resume from checkpoint


class JobOutcome(str, Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"


_R = TypeVar("_R")


@dataclass(frozen=True, kw_only=True)
class NodeRecord:
    addr: str
    port: int  # a port free on this node when written: the master port if it hosts rank 0 next
    nproc: int
    pid: int = 0
    leaving: bool = False
    reconfigurable: bool = False  # every local rank declared the in-process API
    parked: bool = False  # a standby whose pre-warmed ranks wait for admission (imported, model built)
    can_hold: bool = False  # every local rank saves and holds the state below the minimum (.hold)
    settings: dict[str, Any] | None = None  # job_settings(): every node of a job must share them


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    round: int
    members: tuple[str, ...]
    state: RoundState = RoundState.RUNNING
    master_addr: str = ""
    master_port: int = 0
    restarts: int = 0  # failure restarts used so far
    events: tuple[tuple[float, int], ...] = ()  # (time, replicas) of the last rounds started (anti-thrashing)
    reason: str = "start"  # RestartReason of the round's start
    why: str = ""
    halt_kind: EventKind | None = None  # what halted it (HALTED only)
    failure: str | None = None  # the failing rank's message (halted by RANK_FAILURE)
    halted_at: float | None = None
    failure_answered: bool = False  # every member's agent answered the rank failure's stop (none was lost with it)
    mode: EventMode = EventMode.RESTART  # how the round was entered
    inprocess: bool = False  # every member's ranks declared the in-process API: standbys pre-warm
    held: bool = False  # below the minimum: the ranks saved and hold the state, untrained, until nodes join (.hold)


@dataclass(frozen=True, kw_only=True)
class EventRecord:
    """The decision record of one scale event.

    ``target`` is None until every member acked; then the agreed step (``-1``: the ranks do
    not cooperate, they are stopped). ``next_members`` None: no next round is decided (the
    round halts). ``master_addr``/``master_port`` of the next round are fixed with the target,
    so in-place reconfiguration needs no further round trip.
    """

    id: int
    round: int
    kind: EventKind
    mode: EventMode
    next_members: tuple[str, ...] | None
    reason: str
    decided_at: float
    target: int | None = None
    master_addr: str = ""
    master_port: int = 0
    failure: str | None = None
    complete: bool = False
    hold: bool = False  # the next round is below the minimum: its ranks save and hold the state (.hold)

    @property
    def next_round(self) -> int:
        return self.round + 1


@dataclass(frozen=True, kw_only=True)
class AckRecord:
    step: int  # the furthest rank's step
    step_time: float  # the fastest recent seconds per step of the node's ranks; 0: not known yet
    cooperative: bool  # every local rank calls elastic_event_detected()
    reconfigurable: bool = False  # every local rank declared the in-process API
    port: int = 0  # a port free on this node now (the next round's master port if it hosts rank 0)
    seq: int = 0  # the member re-acks (fresh step and rate) while the event waits to be targeted


@dataclass(frozen=True, kw_only=True)
class StoppedRecord:
    ok: bool
    reconfigured: bool = False  # the ranks moved to the next round in place


@dataclass(frozen=True, kw_only=True)
class FailedRecord:
    message: str
    repairable: bool = False  # the node restarted its failed ranks parked, to be repaired in place
    peer: bool = False  # none of the node's ranks died: a collective of theirs failed (a peer elsewhere died or hung)


@dataclass(frozen=True, kw_only=True)
class ClosedRecord:
    status: JobOutcome
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class CapRecord:
    """The operator's bound (``hyperpodctl cap/yield``): at most ``cap`` replicas; None or no key: no cap."""

    cap: int | None = None


def cap_of(raw: bytes | None) -> int | None:
    """The cap a ``ctl/cap`` value sets; None when absent, lifted or malformed (an odd value never stops a job)."""
    try:
        cap = json.loads(raw).get("cap") if raw else None
    except (ValueError, AttributeError):
        return None
    return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0 else None


@dataclass(frozen=True, kw_only=True)
class HistoryEntry:
    ts: float
    round: int
    what: str
    reason: str


def encode(record: Any) -> bytes:
    """A record (or a list of them) as compact JSON."""
    if isinstance(record, list):
        return json.dumps([_plain(r) for r in record], separators=(",", ":")).encode()
    return json.dumps(_plain(record), separators=(",", ":")).encode()


def _plain(record: Any) -> Any:
    return {k: (v.value if isinstance(v, Enum) else v) for k, v in asdict(record).items()}


def decode(cls: type[_R], key: str, raw: bytes | None) -> _R | None:
    """The record of type ``cls`` stored at ``key`` (None when absent)."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        raise RecordError(f"key {key!r} does not hold JSON (written by another program?)") from None
    if not isinstance(data, dict):
        raise RecordError(f"key {key!r}: expected a JSON object, got {type(data).__name__}")
    return from_dict(cls, key, data)


def decode_prefix(cls: type[_R], entries: Mapping[str, Entry]) -> dict[str, _R]:
    """The records of a ``get_prefix`` read by leaf key; a key there without a value is malformed."""
    records: dict[str, _R] = {}
    for key, entry in entries.items():
        record = decode(cls, key, entry.value)
        if record is None:
            raise RecordError(f"key {key!r} holds no {cls.__name__}")
        records[Keys.leaf(key)] = record
    return records


def decode_list(cls: type[_R], key: str, raw: bytes | None) -> list[_R]:
    if not raw:
        return []
    try:
        data = json.loads(raw)
    except ValueError:
        raise RecordError(f"key {key!r} does not hold JSON (written by another program?)") from None
    if not isinstance(data, list):
        raise RecordError(f"key {key!r}: expected a JSON list")
    return [from_dict(cls, key, item) for item in data]


_ENUMS: dict[str, type[Enum]] = {
    "state": RoundState,
    "kind": EventKind,
    "halt_kind": EventKind,
    "mode": EventMode,
    "status": JobOutcome,
}
_TUPLES = {"members", "next_members"}


def from_dict(cls: type[_R], key: str, data: dict[str, Any]) -> _R:
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name not in known:
            continue  # a newer writer's field
        if name in _ENUMS and value is not None:
            try:
                value = _ENUMS[name](value)
            except ValueError:
                raise RecordError(
                    f"key {key!r}: {name}={value!r} is not one of {[e.value for e in _ENUMS[name]]}"
                ) from None
        elif name in _TUPLES and value is not None:
            value = tuple(value)
        elif name == "events":
            value = tuple((float(t), int(d)) for t, d in value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise RecordError(f"key {key!r}: not a {cls.__name__}: {e}") from None


def evolve(record: _R, **changes: Any) -> _R:
    """A copy of a frozen record with some fields changed."""
    return replace(record, **changes)  # type: ignore[type-var]
