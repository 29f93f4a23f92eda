"""The decider: one scale-event step as a pure function of the job's records and the time.

One agent at a time decides for the job (it holds the leased ``decider`` key). Each tick
it reads a :class:`JobSnapshot`, calls :func:`plan`, and hands the resulting
compare-and-swap writes to the executor (:func:`execute`), which stops at the first write
that loses a race: the next tick re-reads and plans again. :func:`plan` reads no clock and
does no I/O, so every rule of the protocol is tested by passing records and a time.

An event runs through these steps (``EventRecord``)::

    decided (target None) --every live member acked, rates known--> targeted (target >= 0)
        |                                  |--a rank does not cooperate--> mode STOP
        |--no ack within ack_timeout--> mode STOP
    targeted / STOP --every live member stopped (or deadline)--> complete
        --> next round published with the live next members, or the round HALTED

In a round that runs in-process, failures are repaired in place: a rank failure (its node
restarted the failed ranks parked), a member whose ranks saw a collective fail (a peer died
or hung: the first sign of a lost node, long before its lease expires) or a lost node makes a
RECONFIGURE event of kind ``rank_failure`` / ``node_lost`` at once. It waits one propagation
budget for the acks of the live members (a fresh master port; a member that does not answer
is left out of the repaired round; half a budget when every other member reported the failure
and the silent one nothing) and is targeted at step 0: the survivors already stopped
stepping at the failed collective, so there is no step to agree on.

A next member that vanished between decision and completion is never published: the
round halts and the start rules pick the next membership from the live nodes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hyperpodrun.config import RestartMode
from hyperpodrun.policy import Action, ClusterView, Decision, ElasticPolicy, NodeState, decide
from hyperpodrun.rendezvous.api import RestartReason
from hyperpodrun.rendezvous.hold import holds, next_from_held
from hyperpodrun.rendezvous.local_time import event_key, halt_key, made_key, observe, round_key, scale_events
from hyperpodrun.rendezvous.records import (
    REPAIR_KINDS,
    AckRecord,
    ClosedRecord,
    EventKind,
    EventMode,
    EventRecord,
    FailedRecord,
    JobOutcome,
    Keys,
    NodeRecord,
    RoundRecord,
    RoundState,
    StoppedRecord,
    encode,
    evolve,
)

__all__ = [
    "DeciderContext",
    "DeciderMemory",
    "JobSnapshot",
    "Note",
    "Plan",
    "RestartMode",
    "Write",
    "choose_target_step",
    "plan",
]


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


def plan(snap: JobSnapshot, mem: DeciderMemory, now: float, ctx: DeciderContext) -> Plan:
    """The writes that move the job on from ``snap`` at time ``now`` (none: nothing to do yet).

    ``now`` is the decider's own monotonic clock: no time written by another node is compared with it.
    """
    ev, rnd = snap.event, snap.round
    mem = dataclasses.replace(mem, seen=observe(mem.seen, round=rnd, event=ev, now=now))
    if ev is not None and rnd is not None and ev.round == rnd.round and not ev.complete:
        return _drive_event(snap, ev, rnd, now, ctx, mem)
    if rnd is not None and rnd.state is RoundState.RUNNING and rnd.held:
        return _plan_held(snap, rnd, now, ctx, mem)
    if rnd is not None and rnd.state is RoundState.RUNNING:
        if rnd.members and all(m in snap.done for m in rnd.members):
            closed = ClosedRecord(status=JobOutcome.SUCCEEDED, message="all ranks exited 0")
            return Plan(
                writes=(Write(Keys.CLOSED, encode(closed), 0),),
                memory=mem,
                notes=(Note(round=rnd.round, what="job succeeded", reason=closed.message, event="job_succeeded"),),
            )
        in_place = _repairs_in_place(rnd, ctx)
        if snap.failed and not (
            in_place and any(m not in snap.nodes for m in rnd.members)
        ):  # a lost member: the policy's rules below
            crashed = [f for f in snap.failed.values() if not f.peer]
            message = (crashed or list(snap.failed.values()))[0].message
            if (
                in_place
                and all(f.repairable for f in snap.failed.values())
                and (not crashed or rnd.restarts < ctx.max_restarts)
            ):
                kind = (
                    EventKind.RANK_FAILURE if crashed else EventKind.NODE_LOST
                )  # no rank died here: a node elsewhere did
                return _new_event(
                    snap,
                    rnd,
                    now,
                    mem,
                    kind=kind,
                    mode=EventMode.RECONFIGURE,
                    next_members=rnd.members,
                    reason=f"{'rank failure' if crashed else 'peer failure'}, repaired in place: {message}",
                    failure=message,
                )
            return _new_event(
                snap,
                rnd,
                now,
                mem,
                kind=EventKind.RANK_FAILURE,
                mode=EventMode.STOP,
                next_members=None,
                reason=f"rank failure: {message}",
                failure=message,
            )
        if (
            not rnd.inprocess
            and ctx.restart_mode is RestartMode.AUTO
            and all(m in snap.nodes and snap.nodes[m].reconfigurable for m in rnd.members)
        ):  # standbys now pre-warm their ranks, so an admission costs no process start
            marked = evolve(rnd, inprocess=True)
            note = Note(
                round=rnd.round,
                what=f"round {rnd.round} runs in-process",
                reason="every rank declared the in-process API",
                event="round_in_process",
            )
            return Plan(writes=(Write(Keys.ROUND, encode(marked), snap.round_rev),), notes=(note,), memory=mem)
    if rnd is not None and rnd.state is RoundState.HALTED and rnd.halt_kind is EventKind.RANK_FAILURE:
        after = _after_failure(snap, rnd, now, ctx, mem)
        if after is not None:
            return after
    if rnd is not None and rnd.state is RoundState.RUNNING and snap.finished:
        # training finished on some member: a joiner admitted now would train the job again from its end
        why = f"training finished on {', '.join(sorted(snap.finished))}: no scale event, waiting for the ranks to exit"
        held = (rnd.round, tuple(sorted(n for n in snap.nodes if n not in rnd.members)))
        if mem.held == held:
            return Plan(memory=mem, waiting_for=why)
        note = Note(
            round=rnd.round, what="scale events held", reason=why, event="scale_held", fields={"standbys": held[1]}
        )
        return Plan(memory=dataclasses.replace(mem, held=held), notes=(note,), waiting_for=why)
    mem, view = _view(snap, mem, now, ctx)
    decision = decide(
        ctx.policy,
        view,
        now,
        nproc_per_node=ctx.nproc_per_node,
        max_world_size=ctx.max_world_size,
        last_call=ctx.last_call_timeout,
    )
    if decision.action is Action.NONE:
        return Plan(memory=mem, waiting_for=decision.reason)
    if decision.action is Action.INSUFFICIENT:
        if rnd is None or rnd.state is not RoundState.RUNNING:
            return Plan(memory=mem, waiting_for=decision.reason)
        survivors = _survivors(snap, rnd)
        if survivors and _repairs_in_place(rnd, ctx):  # below the minimum: the survivors keep the state (.hold)
            gone = any(m not in snap.nodes for m in rnd.members)
            leaving = any(snap.nodes[m].leaving for m in rnd.members if m in snap.nodes)
            return _new_event(
                snap,
                rnd,
                now,
                mem,
                kind=EventKind.NODE_LOST if gone else EventKind.LEAVE if leaving else EventKind.YIELD,
                mode=EventMode.RECONFIGURE if gone else EventMode.RESTART,
                next_members=survivors,
                reason=f"{decision.reason}; the survivors save and hold the state until nodes join",
                hold=True,
            )
        return _new_event(
            snap,
            rnd,
            now,
            mem,
            kind=EventKind.INSUFFICIENT,
            mode=EventMode.RESTART,
            next_members=None,
            reason=decision.reason,
        )
    if decision.action is Action.WAIT_FOR_LOST:
        if rnd is None or rnd.state is not RoundState.RUNNING:  # halted: wait for lost members to return or time out
            return Plan(memory=mem, waiting_for=decision.reason)
        if _repairs_in_place(rnd, ctx):  # the survivors cannot step without a new group: re-form it now
            reshape = decide(
                ctx.policy,
                dataclasses.replace(view, lost_since={}),
                now,
                nproc_per_node=ctx.nproc_per_node,
                max_world_size=ctx.max_world_size,
            )
            repaired = bool(reshape.members) and reshape.members[0] in snap.nodes
            survivors = () if repaired or reshape.action is not Action.INSUFFICIENT else _survivors(snap, rnd)
            if repaired or survivors:  # too few survivors: they save and hold the state (.hold)
                return _new_event(
                    snap,
                    rnd,
                    now,
                    mem,
                    kind=EventKind.NODE_LOST,
                    mode=EventMode.RECONFIGURE,
                    next_members=reshape.members or survivors,
                    reason=f"lost member(s) repaired in place: {reshape.reason}"
                    + ("; the survivors save and hold the state until nodes join" if survivors else ""),
                    hold=bool(survivors),
                )
        return _new_event(
            snap,
            rnd,
            now,
            mem,
            kind=EventKind.NODE_LOST,
            mode=EventMode.STOP,
            next_members=None,
            reason=decision.reason,
        )
    if rnd is not None and rnd.state is RoundState.RUNNING:
        kind = _event_kind(snap, rnd, decision)
        mode = EventMode.STOP if kind is EventKind.NODE_LOST else EventMode.RESTART
        if kind is EventKind.NODE_LOST and _repairs_in_place(rnd, ctx) and decision.members[0] in snap.nodes:
            mode = EventMode.RECONFIGURE
        return _new_event(
            snap, rnd, now, mem, kind=kind, mode=mode, next_members=decision.members, reason=decision.reason
        )
    if rnd is None:
        reason = RestartReason.START
    elif rnd.halt_kind in (EventKind.RANK_FAILURE, EventKind.NODE_LOST):
        reason = RestartReason.FAILURE
    else:
        reason = RestartReason.SCALE
    return _publish_round(snap, decision.members, now, mem, decision.reason, reason)


def _repairs_in_place(rnd: RoundRecord, ctx: DeciderContext) -> bool:
    """Whether the round's failures are repaired in place (every rank declared the in-process API; a held
    round's are not: its state is saved, :mod:`.hold`)."""
    return rnd.inprocess and ctx.restart_mode is RestartMode.AUTO and not rnd.held


def _survivors(snap: JobSnapshot, rnd: RoundRecord) -> tuple[str, ...]:
    """The round's members that are alive and not leaving, when all of them can hold the state (else none)."""
    alive = tuple(m for m in rnd.members if m in snap.nodes and not snap.nodes[m].leaving)
    return alive if all(snap.nodes[m].can_hold for m in alive) else ()


def _plan_held(snap: JobSnapshot, rnd: RoundRecord, now: float, ctx: DeciderContext, mem: DeciderMemory) -> Plan:
    """A held round (:mod:`.hold`): resume it in place once nodes join, let leavers go, halt when one is lost."""
    mem, view = _view(snap, mem, now, ctx)
    decision = decide(ctx.policy, view, now, nproc_per_node=ctx.nproc_per_node, max_world_size=ctx.max_world_size)
    step = next_from_held(rnd, decision, snap.nodes, ctx.policy, failed=bool(snap.failed))
    if step is None:
        return Plan(memory=mem, waiting_for=f"round {rnd.round} holds the state: {decision.reason}")
    return _new_event(
        snap,
        rnd,
        now,
        mem,
        kind=step.kind,
        mode=step.mode,
        next_members=step.next_members,
        reason=step.reason,
        hold=step.hold,
    )


def _event_kind(snap: JobSnapshot, rnd: RoundRecord, decision: Decision) -> EventKind:
    if any(m not in snap.nodes for m in rnd.members):
        return EventKind.NODE_LOST
    if any(snap.nodes[m].leaving for m in rnd.members):
        return EventKind.LEAVE
    if decision.action is Action.SCALE_UP:
        return EventKind.JOIN
    return EventKind.YIELD


def _view(snap: JobSnapshot, mem: DeciderMemory, now: float, ctx: DeciderContext) -> tuple[DeciderMemory, ClusterView]:
    rnd = snap.round
    left_out = {n: r for n, r in mem.left_out.items() if snap.nodes.get(n) == r}  # until it registers anew or expires
    first_seen = {n: mem.first_seen.get(n, now) for n in snap.nodes}
    members: tuple[str, ...] = rnd.members if rnd is not None else ()
    lost_since = {m: mem.lost_since.get(m, now) for m in members if m not in snap.nodes}
    alive = {n: NodeState(n, first_seen[n], r.leaving) for n, r in snap.nodes.items() if n not in left_out}
    standbys = [n for n in alive if n not in members and not alive[n].leaving]
    capacity_since = (mem.capacity_since if mem.capacity_since is not None else now) if standbys else None
    first_min = mem.first_min_reached_at
    if first_min is None and len(alive) >= ctx.policy.min_replicas:
        first_min = now
    new_mem = DeciderMemory(
        first_seen=first_seen,
        lost_since=lost_since,
        capacity_since=capacity_since,
        first_min_reached_at=first_min,
        left_out=left_out,
        seen=mem.seen,
        wall_offset=mem.wall_offset,
    )
    if rnd is not None and rnd.state is RoundState.HALTED and rnd.halt_kind is EventKind.INSUFFICIENT:
        members = ()  # halted for lack of nodes: the start rules apply again
    view = ClusterView(
        round=rnd.round if rnd is not None else 0,
        members=members,
        alive=alive,
        lost_since={m: t for m, t in lost_since.items() if m in members},
        last_events=scale_events(rnd, mem.seen, now),
        cap=snap.cap,
        capacity_since=capacity_since,
        first_min_reached_at=first_min,
    )
    return new_mem, view


def _new_event(
    snap: JobSnapshot,
    rnd: RoundRecord,
    now: float,
    mem: DeciderMemory,
    *,
    kind: EventKind,
    mode: EventMode,
    next_members: tuple[str, ...] | None,
    reason: str,
    failure: str | None = None,
    hold: bool = False,
) -> Plan:
    ev = EventRecord(
        id=(snap.event.id if snap.event else 0) + 1,
        round=rnd.round,
        kind=kind,
        mode=mode,
        next_members=next_members,
        reason=reason,
        decided_at=now + mem.wall_offset,
        failure=failure,
        hold=hold,
    )
    note = Note(
        round=rnd.round,
        what=f"event {ev.id} ({kind.value}, {mode.value})",
        reason=reason,
        event="scale_decided",
        fields={
            "event_id": ev.id,
            "kind": kind.value,
            "mode": mode.value,
            "next_members": list(next_members) if next_members is not None else None,
        },
    )
    mem = dataclasses.replace(mem, seen={**mem.seen, event_key(ev.id): now, made_key(ev.id): now})
    return Plan(writes=(Write(Keys.EVENT, encode(ev), snap.event_rev),), notes=(note,), memory=mem)


def _drive_event(
    snap: JobSnapshot, ev: EventRecord, rnd: RoundRecord, now: float, ctx: DeciderContext, mem: DeciderMemory
) -> Plan:
    live = [m for m in rnd.members if m in snap.nodes]
    if ev.mode is not EventMode.STOP and ev.target is None:
        return _target_event(snap, ev, live, now, ctx, mem)
    gone = [m for m in ev.next_members or () if m not in snap.nodes]
    if ev.mode is EventMode.RECONFIGURE and gone:  # the new group can never form: stop everyone now
        return _update(
            snap,
            evolve(ev, mode=EventMode.STOP, reason=f"{ev.reason}; {gone} vanished during the in-place reconfiguration"),
            mem,
        )
    reporting = live + _joiners(snap, ev, rnd)
    if ev.mode is EventMode.RECONFIGURE and ev.kind in REPAIR_KINDS:  # a member left out of the repair is gone
        reporting = [m for m in ev.next_members or () if m in snap.nodes]
    waiting = [m for m in reporting if m not in snap.stopped]
    deadline = mem.seen.get(event_key(ev.id), now) + ctx.policy.graceful_shutdown_timeout + ctx.ack_timeout
    if waiting and now < deadline:
        return Plan(memory=mem, waiting_for=f"event {ev.id}: waiting for {len(waiting)} member(s) to stop")
    return _finish_event(snap, ev, rnd, now, mem)


def _target_event(
    snap: JobSnapshot, ev: EventRecord, live: list[str], now: float, ctx: DeciderContext, mem: DeciderMemory
) -> Plan:
    """Every live member acked: agree on the step (or stop ranks that do not cooperate)."""
    elapsed = now - mem.seen.get(event_key(ev.id), now)
    if not live:  # every member's lease lapsed (a store outage): nobody can act at a step
        return _update(snap, evolve(ev, mode=EventMode.STOP, target=-1, reason=ev.reason + "; no member is alive"), mem)
    acks = {m: snap.acks[m] for m in live if m in snap.acks}
    missing = [m for m in live if m not in acks]
    mem, age = _watch_acks(ev, acks, mem, now, ctx)
    if snap.failed and ev.kind not in REPAIR_KINDS and snap.round is not None and _repairs_in_place(snap.round, ctx):
        # survivors wait in recover(): no step to agree on, no joiner to wait for
        ev = _superseded_by_repair(snap, snap.round, ev)
    if ev.mode is EventMode.RECONFIGURE and ev.kind in REPAIR_KINDS:
        return _target_repair(snap, ev, acks, missing, elapsed, ctx, mem)
    if missing:
        if elapsed <= ctx.ack_timeout:
            return Plan(memory=mem, waiting_for=f"event {ev.id}: waiting for acks from {missing}")
        reason = ev.reason + f"; no ack from {missing} within {ctx.ack_timeout:g}s"
        return _update(snap, evolve(ev, mode=EventMode.STOP, reason=reason), mem)
    if not all(a.cooperative for a in acks.values()):
        reason = ev.reason + "; ranks do not call elastic_event_detected() on every rank"
        return _update(snap, evolve(ev, mode=EventMode.STOP, target=-1, reason=reason), mem)
    held = snap.round is not None and snap.round.held  # its ranks hold the state, they do not step: act at once
    times = [a.step_time for a in acks.values() if a.step_time > 0]
    rate_wait = min(ctx.ack_timeout, RATE_WAIT_PROPAGATIONS * ctx.propagation)
    if len(times) < len(acks) and not held:
        if elapsed <= rate_wait:  # defer (bounded) until every member knows its step rate
            return Plan(memory=mem, waiting_for=f"event {ev.id}: waiting for the ranks' step rate")
        times.append(rate_wait)  # no second step seen within the bound: steps are at least that slow
    # Ranks kept stepping since they acked: budget for the oldest ack's age (at most the event's).
    target = (
        0
        if held
        else choose_target_step([a.step for a in acks.values()], times, propagation=ctx.propagation + max(0.0, age))
    )
    mode = ev.mode
    master_addr, master_port = "", 0
    if ev.next_members:
        head = ev.next_members[0]
        node = snap.nodes.get(head)
        if node is not None:
            master_addr = node.addr
            master_port = acks[head].port if head in acks and acks[head].port else node.port
        if (
            ctx.restart_mode is RestartMode.AUTO
            and ev.kind in (EventKind.JOIN, EventKind.LEAVE, EventKind.YIELD)
            and all(a.reconfigurable for a in acks.values())
            and head in acks  # rank 0 of the next round must be a survivor holding the state
        ):
            mode = EventMode.RECONFIGURE
            cold = [m for m in ev.next_members if m not in acks and m in snap.nodes and not snap.nodes[m].parked]
            if cold and elapsed <= ctx.ack_timeout:  # survivors would wait in the new group for their start-up
                return Plan(memory=mem, waiting_for=f"event {ev.id}: waiting for {cold} to park their ranks")
    if ev.hold and mode is not EventMode.RECONFIGURE:  # ranks that save and exit hold nothing: the round halts
        ev = evolve(ev, next_members=None, hold=False, reason=ev.reason + "; not every rank can hold it: saved instead")
    how = "ranks reconfigure in place" if mode is EventMode.RECONFIGURE else "ranks save and restart"
    note = Note(
        round=ev.round,
        what=f"event {ev.id} ({ev.kind.value}, {mode.value})",
        reason=f"{how} at step {target}",
        event="scale_targeted",
        fields={"event_id": ev.id, "kind": ev.kind.value, "mode": mode.value, "target_step": target},
    )
    updated = _update(snap, evolve(ev, target=target, mode=mode, master_addr=master_addr, master_port=master_port), mem)
    return Plan(writes=updated.writes, notes=(note,), memory=mem)


def _superseded_by_repair(snap: JobSnapshot, rnd: RoundRecord, ev: EventRecord) -> EventRecord:
    """A scale event not targeted yet when a rank failed: it becomes the failure's repair, in place.

    Its survivors stopped at the failed collective and wait for a repaired group, so it is targeted at
    once, like any repair: a leaver is left out as the scale event would have, a joiner whose ranks are
    parked is admitted in it, one still starting is not waited for (it joins in an event of its own).
    """
    crashed = [f for f in snap.failed.values() if not f.peer]
    message = (crashed or list(snap.failed.values()))[0].message
    kind = EventKind.RANK_FAILURE if crashed else EventKind.NODE_LOST
    nxt = tuple(
        m for m in ev.next_members or rnd.members if m in rnd.members or (m in snap.nodes and snap.nodes[m].parked)
    )
    reason = f"{'rank failure' if crashed else 'peer failure'}, repaired in place with {ev.kind.value} event {ev.id}: {message}"
    return evolve(ev, kind=kind, mode=EventMode.RECONFIGURE, next_members=nxt, failure=message, reason=reason)


def _watch_acks(
    ev: EventRecord, acks: Mapping[str, AckRecord], mem: DeciderMemory, now: float, ctx: DeciderContext
) -> tuple[DeciderMemory, float]:
    """Note when each ack was first seen; the age of the oldest one (members re-ack while an event waits).

    An ack this decider has watched since an earlier ack of the same event is at most a tick older
    than when it was first seen; one it never watched may be as old as the event, when this decider
    made the event (it knows the age on its own clock), and otherwise (it took over) as old as the
    interval at which a live member re-acks a waiting event."""
    seen = {m: v for m, v in mem.acks_seen.items() if v[0] == ev.id}
    made = mem.seen.get(made_key(ev.id))
    unwatched = now - made if made is not None else ctx.propagation / 2 + 2 * ctx.tick
    ages = []
    for m, a in acks.items():
        prev = seen.get(m)
        if prev is None:
            seen[m] = (ev.id, a.seq, now)
            ages.append(unwatched)
        elif prev[1] != a.seq:
            seen[m] = (ev.id, a.seq, now)
            ages.append(ctx.tick)
        else:
            ages.append(now - prev[2] + ctx.tick)
    return dataclasses.replace(mem, acks_seen=seen), max(ages, default=unwatched)


def _target_repair(
    snap: JobSnapshot,
    ev: EventRecord,
    acks: Mapping[str, AckRecord],
    missing: Sequence[str],
    elapsed: float,
    ctx: DeciderContext,
    mem: DeciderMemory,
) -> Plan:
    """A failure repaired in place: at once (step 0), rank 0 on the first surviving member's fresh port.

    Members get one propagation budget to answer; one that does not (its lease has not expired yet,
    but its agent is gone with its ranks) is left out of the repaired round, after half the budget
    when it is silent while every other member reported the failure (:func:`_silent_since_the_failure`).
    """
    if missing and elapsed <= ctx.propagation and not _silent_since_the_failure(snap, acks, missing, elapsed, ctx):
        return Plan(memory=mem, waiting_for=f"event {ev.id}: waiting for acks from {missing}")
    crashed = [f for f in snap.failed.values() if not f.peer]
    if crashed and ev.kind is EventKind.NODE_LOST and not missing:  # made from the survivors' reports; a rank died
        ev = evolve(
            ev,
            kind=EventKind.RANK_FAILURE,
            failure=crashed[0].message,
            reason=f"rank failure, repaired in place: {crashed[0].message}",
        )
        if snap.round is not None and snap.round.restarts >= ctx.max_restarts:
            return _update(
                snap,
                evolve(
                    ev, mode=EventMode.STOP, target=-1, reason=f"{ev.reason}; --max-restarts {ctx.max_restarts} used up"
                ),
                mem,
            )
    vanished = [m for m in ev.next_members or () if m not in snap.nodes]  # its lease expired meanwhile
    nxt = tuple(m for m in ev.next_members or () if m not in missing and m not in vanished)
    reason = ev.reason + (
        f"; left out {missing}: no answer within {min(elapsed, ctx.propagation):.2g}s" if missing else ""
    )
    reason += f"; left out {vanished}: gone" if vanished else ""
    if not nxt:
        return _update(snap, evolve(ev, mode=EventMode.STOP, target=-1, reason=f"{reason}; no member is left"), mem)
    if holds(nxt, ctx.policy) and not ev.hold and not all(m in snap.nodes and snap.nodes[m].can_hold for m in nxt):
        return _update(
            snap,
            evolve(ev, mode=EventMode.STOP, target=-1, reason=f"{reason}; {len(nxt)} node(s) is not an allowed size"),
            mem,
        )
    if holds(nxt, ctx.policy) and not ev.hold:  # too few to train: the survivors save and hold the state (.hold)
        ev = evolve(ev, hold=True)
        reason += f"; {len(nxt)} node(s) is not an allowed size: the survivors save and hold the state until nodes join"

    head = nxt[0]
    if head not in acks:
        return _update(
            snap,
            evolve(ev, mode=EventMode.STOP, reason=f"{reason}; rank 0 of the repaired round would not be a survivor"),
            mem,
        )
    cold = [m for m in nxt if m not in acks and m in snap.nodes and not snap.nodes[m].parked]
    if cold and elapsed <= ctx.ack_timeout:  # a standby refills the lost node's place: wait for it to park
        return Plan(memory=mem, waiting_for=f"event {ev.id}: waiting for {cold} to park their ranks")
    master_port = acks[head].port or snap.nodes[head].port
    note = Note(
        round=ev.round,
        what=f"event {ev.id} ({ev.kind.value}, reconfigure)",
        reason="ranks repair their group in place",
        event="scale_targeted",
        fields={"event_id": ev.id, "kind": ev.kind.value, "mode": EventMode.RECONFIGURE.value, "target_step": 0},
    )
    updated = _update(
        snap,
        evolve(
            ev, target=0, next_members=nxt, reason=reason, master_addr=snap.nodes[head].addr, master_port=master_port
        ),
        mem,
    )
    left_out = {**mem.left_out, **{m: snap.nodes[m] for m in missing if m in snap.nodes}}
    return Plan(writes=updated.writes, notes=(note,), memory=dataclasses.replace(mem, left_out=left_out))


def _silent_since_the_failure(
    snap: JobSnapshot, acks: Mapping[str, AckRecord], missing: Sequence[str], elapsed: float, ctx: DeciderContext
) -> bool:
    """Whether the members that have not answered a repair are gone, before its propagation budget ends.

    A lost node's agent died with its ranks; its lease outlives it. Every other member reported a
    collective of its ranks broken and acked; a silent member reported nothing this round. Had its
    agent been alive, its ranks shared the broken collective (it reports within ``URGENT_POLL_S``
    of them) or one of them crashed (it reports that), and it acks within a tick of reading the
    event. So once every answering member saw the failure and ``SILENT_GRACE`` of the budget (at
    least two ticks) has passed, the silent members are left out: a node loss costs half a
    budget less downtime (failures benchmark: 1 s of a 2.15 s repair was this wait).
    """
    if elapsed <= max(2 * ctx.tick, SILENT_GRACE * ctx.propagation):
        return False
    return bool(acks) and not any(m in snap.failed for m in missing) and all(m in snap.failed for m in acks)


def _joiners(snap: JobSnapshot, ev: EventRecord, rnd: RoundRecord) -> list[str]:
    """Live standbys a RECONFIGURE event admits: they report too, once their ranks run in the new round."""
    if ev.mode is not EventMode.RECONFIGURE or ev.target is None or not ev.next_members:
        return []
    return [m for m in ev.next_members if m not in rnd.members and m in snap.nodes]


def _update(snap: JobSnapshot, ev: EventRecord, mem: DeciderMemory) -> Plan:
    return Plan(writes=(Write(Keys.EVENT, encode(ev), snap.event_rev),), memory=mem)


def _finish_event(snap: JobSnapshot, ev: EventRecord, rnd: RoundRecord, now: float, mem: DeciderMemory) -> Plan:
    """Every live member's ranks left the round: publish the next round, or halt."""
    complete = Write(Keys.EVENT, encode(evolve(ev, complete=True)), snap.event_rev)
    nxt = ev.next_members
    if ev.mode is EventMode.RECONFIGURE and nxt and all(m in snap.nodes for m in nxt):
        if all(m in snap.stopped and snap.stopped[m].reconfigured for m in nxt):
            repaired = ev.kind in REPAIR_KINDS
            published = _publish_round(
                snap,
                nxt,
                now,
                mem,
                ev.reason,
                RestartReason.FAILURE if repaired else RestartReason.SCALE,
                mode=ev.mode,
                master=(ev.master_addr, ev.master_port),
                inprocess=True,
                count_restart=ev.kind is EventKind.RANK_FAILURE,
                held=ev.hold,
            )
        elif ev.hold:  # a survivor could not move in place: nothing is held; the round halts for lack of nodes
            halted = evolve(rnd, state=RoundState.HALTED, halt_kind=EventKind.INSUFFICIENT, halted_at=now)
            note = Note(round=rnd.round, what=f"round {rnd.round} halted (insufficient)", reason=ev.reason)
            return Plan(writes=(complete, Write(Keys.ROUND, encode(halted), snap.round_rev)), notes=(note,), memory=mem)
        else:  # some node could not move in place: every rank restarts; the skipped number tells the others
            failed = [m for m in nxt if not (m in snap.stopped and snap.stopped[m].reconfigured)]
            why = f"{ev.reason}; in-place reconfiguration failed on {failed}: restarting the ranks"
            published = _publish_round(snap, nxt, now, mem, why, RestartReason.SCALE, number=ev.next_round + 1)
        return Plan(writes=(complete, *published.writes), notes=published.notes, memory=mem)
    if nxt and all(m in snap.nodes for m in nxt):
        reason = RestartReason.FAILURE if ev.mode is EventMode.STOP else RestartReason.SCALE
        published = _publish_round(
            snap, nxt, now, mem, ev.reason, reason, mode=ev.mode, master=(ev.master_addr, ev.master_port)
        )
        return Plan(writes=(complete, *published.writes), notes=published.notes, memory=mem)
    halt_kind = ev.kind
    if nxt:  # a next member vanished since the decision: let the start rules choose from the live nodes
        halt_kind = EventKind.NODE_LOST
    # Every member's agent answered a rank failure's stop: none was lost with it, so no lease ttl to wait.
    answered = ev.kind is EventKind.RANK_FAILURE and all(m in snap.stopped for m in rnd.members)
    halted = evolve(
        rnd,
        state=RoundState.HALTED,
        halt_kind=halt_kind,
        failure=ev.failure,
        halted_at=now + mem.wall_offset,
        failure_answered=answered,
    )
    note = Note(round=rnd.round, what=f"round {rnd.round} halted ({halt_kind.value})", reason=ev.reason)
    mem = dataclasses.replace(mem, seen={**mem.seen, halt_key(rnd.round): now})
    return Plan(writes=(complete, Write(Keys.ROUND, encode(halted), snap.round_rev)), notes=(note,), memory=mem)


def _after_failure(
    snap: JobSnapshot, rnd: RoundRecord, now: float, ctx: DeciderContext, mem: DeciderMemory
) -> Plan | None:
    """Halted after a rank failure. Unless every member answered the failure's stop, wait one lease ttl:
    if a member vanished meanwhile, the failure was collateral damage of a lost node (the policy handles
    it, no restart is counted: None); otherwise restart the same members, counting a restart, or close
    the job when none are left."""
    if any(m not in snap.nodes for m in rnd.members):
        return None
    if not rnd.failure_answered and now < mem.seen.get(halt_key(rnd.round), now) + ctx.lease_ttl + ctx.tick:
        return Plan(memory=mem, waiting_for="rank failure: waiting one lease ttl to tell it from a node loss")
    failure = rnd.failure or "rank failed"
    if rnd.restarts >= ctx.max_restarts:
        suffix = f" (after {rnd.restarts} restart{'s' * (rnd.restarts != 1)})" if rnd.restarts else ""
        closed = ClosedRecord(status=JobOutcome.FAILED, message=failure + suffix)
        note = Note(round=rnd.round, what="job failed", reason=failure, event="job_failed")
        return Plan(writes=(Write(Keys.CLOSED, encode(closed), 0),), notes=(note,), memory=mem)
    return _publish_round(
        snap, rnd.members, now, mem, f"rank failure: {failure}", RestartReason.FAILURE, count_restart=True
    )


def _publish_round(
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
