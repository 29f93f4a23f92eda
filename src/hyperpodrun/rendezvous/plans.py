"""The decider's vocabulary: what it reads (:class:`JobSnapshot`), what it remembers on its own clock
(:class:`DeciderMemory`), what it returns (:class:`Plan`: compare-and-swap :class:`Write` s and :class:`Note` s),
and the rules both halves of the decider share (:mod:`.decider`: a round without an event in flight;
:mod:`.event_driver`: an event in flight).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hyperpodrun.config import RestartMode
from hyperpodrun.policy import ElasticPolicy
from hyperpodrun.rendezvous.api import RestartReason
from hyperpodrun.rendezvous.local_time import round_key
from hyperpodrun.rendezvous.records import (
    AckRecord,
    EventMode,
    EventRecord,
    FailedRecord,
    Keys,
    NodeRecord,
    RoundRecord,
    StoppedRecord,
    encode,
)

#: The share of the propagation budget after which a repair leaves out members that stayed silent while
#: every other member reported the failure and acked (:func:`_silent_since_the_failure`).
SILENT_GRACE = 0.5

#: How long (in propagation budgets) the decider waits for a member's unknown step rate: ranks that
#: took no second step in that time step slowly enough for a margin of a few steps.
RATE_WAIT_PROPAGATIONS = 3


def choose_target_step(steps: Sequence[int], step_times: Sequence[float], *, propagation: float) -> int:
    """The step at which every rank acts: ahead of the furthest rank by the propagation delay.

    ``steps`` are the members' furthest steps as acked, ``step_times`` their fastest recent
    seconds per step (all > 0), ``propagation`` the worst-case seconds from now until
    every agent has written the target into its ranks' control channel. Synchronous data
    parallelism keeps ranks within a step of each other, so ``max(steps) + 2 +
    ceil(propagation / fastest)`` is reached by no rank before it has learnt the target.
    """
    if not steps:
        raise ValueError("choose_target_step needs at least one member's step")
    if not step_times or min(step_times) <= 0:
        raise ValueError(f"choose_target_step needs known step times > 0, got {list(step_times)}")
    return max(steps) + 2 + math.ceil(propagation / min(step_times))


@dataclass(frozen=True, kw_only=True)
class DeciderContext:
    """What the decider knows besides the records: the job's settings."""

    policy: ElasticPolicy
    nproc_per_node: int
    max_restarts: int
    lease_ttl: float
    ack_timeout: float
    propagation: float
    tick: float
    max_world_size: int | None = None
    restart_mode: RestartMode = RestartMode.AUTO
    last_call_timeout: float | None = None  # the wait for more nodes at start (None: the policy's scaling_timeout)


@dataclass(frozen=True, kw_only=True)
class JobSnapshot:
    """The records the decider reads in one tick, with the revisions its writes compare against."""

    nodes: Mapping[str, NodeRecord]
    round: RoundRecord | None = None
    round_rev: int = 0
    event: EventRecord | None = None
    event_rev: int = 0
    acks: Mapping[str, AckRecord] = field(default_factory=dict)  # of the pending event
    stopped: Mapping[str, StoppedRecord] = field(default_factory=dict)  # of the pending event
    done: frozenset[str] = frozenset()  # of the running round
    finished: frozenset[str] = frozenset()  # nodes whose training finished in the running round
    failed: Mapping[str, FailedRecord] = field(default_factory=dict)  # of the running round
    cap: int | None = None


@dataclass(frozen=True, kw_only=True)
class DeciderMemory:
    """Decider-local observations, on this agent's clock (no cross-node clock skew)."""

    first_seen: Mapping[str, float] = field(default_factory=dict)
    lost_since: Mapping[str, float] = field(default_factory=dict)
    capacity_since: float | None = None
    first_min_reached_at: float | None = None
    # Members left out of a repair for not answering, with their node record then: while the record is
    # unchanged (a dead agent's lease outlives it) the node is not alive to the policy (no standby).
    left_out: Mapping[str, NodeRecord] = field(default_factory=dict)
    # The acks of the pending event as first seen: node -> (event id, ack seq, time first seen).
    acks_seen: Mapping[str, tuple[int, int, float]] = field(default_factory=dict)
    # When this decider first saw the records that start its timers (:mod:`.local_time`).
    seen: Mapping[str, float] = field(default_factory=dict)
    # Seconds from ``now`` to the wall clock, for the times written into records for people; no decision reads it.
    wall_offset: float = 0.0
    # the round whose scale events are held because its training finished, and the standbys held off (said once each)
    held: tuple[int, tuple[str, ...]] | None = None
    # This decider found its own record gone (its lease lapsed: the store was out of reach for a lease ttl); the
    # grace below starts once the record is back.
    lapsed: bool = False
    # Until when a member's missing record, with no failure reported, is taken for a lapse like this decider's
    # own (every lease lapses in a store outage) rather than a lost node (:func:`.decider.plan`); also set when
    # this node's agent registers again (:meth:`.decider_seat.DeciderSeat.note_lapse`).
    lapse_grace_until: float | None = None


@dataclass(frozen=True)
class Write:
    """Compare-and-swap ``key`` from ``expected_revision`` (0: must not exist) to ``value``."""

    key: str
    value: bytes
    expected_revision: int


@dataclass(frozen=True, kw_only=True)
class Note:
    """What to tell people once the writes succeeded: a log line, a history entry, an event record."""

    round: int
    what: str
    reason: str
    event: str | None = None  # hyperpodrun.events.EventType value
    fields: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Plan:
    writes: tuple[Write, ...] = ()
    notes: tuple[Note, ...] = ()
    memory: DeciderMemory = field(default_factory=DeciderMemory)
    waiting_for: str = ""  # the policy's reason when nothing happens (progress messages)


# --------------------------------------------------------------------------- plan


def repairs_in_place(rnd: RoundRecord, ctx: DeciderContext) -> bool:
    """Whether the round's failures are repaired in place (every rank declared the in-process API; a held
    round's are not: its state is saved, :mod:`.hold`)."""
    return rnd.inprocess and ctx.restart_mode is RestartMode.AUTO and not rnd.held


def publish_round(
    snap: JobSnapshot,
    members: Sequence[str],
    now: float,
    mem: DeciderMemory,
    why: str,
    reason: RestartReason,
    *,
    count_restart: bool = False,
    mode: EventMode = EventMode.RESTART,
    master: tuple[str, int] = ("", 0),
    inprocess: bool = False,
    number: int | None = None,
    held: bool = False,
) -> Plan:
    rnd = snap.round
    head = snap.nodes[members[0]]
    master_addr, master_port = master if master[1] else (head.addr, head.port)
    events = ((rnd.events if rnd is not None else ()) + ((now + mem.wall_offset, len(members)),))[-16:]
    new = RoundRecord(
        round=number or (rnd.round if rnd is not None else 0) + 1,
        members=tuple(members),
        master_addr=master_addr,
        master_port=master_port,
        restarts=(rnd.restarts if rnd is not None else 0) + int(count_restart),
        events=events,
        reason=reason.value,
        why=why,
        mode=mode if mode is EventMode.RECONFIGURE else EventMode.RESTART,
        inprocess=inprocess,
        held=held,
    )
    world = len(members) * head.nproc
    what = f"round {new.round}: {len(members)} node(s), world {world}"
    if held:
        what = f"round {new.round} holds the state below the minimum: {len(members)} node(s) ({', '.join(members)})"
    note = Note(round=new.round, what=what, reason=why)
    mem = dataclasses.replace(mem, seen={**mem.seen, round_key(new.round): now})
    return Plan(writes=(Write(Keys.ROUND, encode(new), snap.round_rev),), notes=(note,), memory=mem)
