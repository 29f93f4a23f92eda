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
round halts and the start rules pick the next membership from the live nodes. A halted
round whose members are all alive and staying restarts at the same membership.

A store outage longer than the lease ttl lapses every lease at once. A decider whose own
record is missing decides nothing; once it is back, it gives the other members one lease
ttl to register again before it counts a missing one lost, unless a rank reported a failure.
"""

from __future__ import annotations

import dataclasses

from hyperpodrun.config import RestartMode
from hyperpodrun.policy import Action, ClusterView, Decision, NodeState, decide
from hyperpodrun.rendezvous.api import RestartReason
from hyperpodrun.rendezvous.event_driver import drive_event
from hyperpodrun.rendezvous.hold import next_from_held
from hyperpodrun.rendezvous.local_time import event_key, halt_key, made_key, observe, scale_events
from hyperpodrun.rendezvous.plans import (
    DeciderContext,
    DeciderMemory,
    JobSnapshot,
    Note,
    Plan,
    Write,
    choose_target_step,
    publish_round,
    repairs_in_place,
)
from hyperpodrun.rendezvous.records import (
    ClosedRecord,
    EventKind,
    EventMode,
    EventRecord,
    JobOutcome,
    Keys,
    RoundRecord,
    RoundState,
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


def plan(snap: JobSnapshot, mem: DeciderMemory, now: float, ctx: DeciderContext, *, decider: str | None = None) -> Plan:
    """The writes that move the job on from ``snap`` at time ``now`` (none: nothing to do yet).

    ``now`` is the decider's own monotonic clock: no time written by another node is compared with it.
    ``decider``: the node this decider runs on. While its own record is missing its lease lapsed (the store
    was out of reach) and it decides nothing; for a lease ttl after the record is back, a member whose record
    is missing with no failure reported is taken for a lapse like its own, not a lost node (None: no such rule).
    """
    ev, rnd = snap.event, snap.round
    mem = dataclasses.replace(mem, seen=observe(mem.seen, round=rnd, event=ev, now=now))
    if decider is not None:
        mem, blind = _own_lapse(snap, mem, now, ctx, decider)
        if blind:
            return Plan(memory=mem, waiting_for=blind)
    if ev is not None and rnd is not None and ev.round == rnd.round and not ev.complete:
        return drive_event(snap, ev, rnd, now, ctx, mem)
    if rnd is not None and rnd.state is RoundState.RUNNING and (lapse := _lapse_explains(snap, rnd, mem, now)):
        return Plan(memory=mem, waiting_for=lapse)
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
        in_place = repairs_in_place(rnd, ctx)
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
        if rnd is None or rnd.state is RoundState.RUNNING or not view.members:
            return Plan(memory=mem, waiting_for=decision.reason)
        # halted with every member alive and staying: nothing trains, so no growth gate is waited for
        halted_by = rnd.halt_kind.value if rnd.halt_kind is not None else "halted"
        decision = Decision(
            Action.RESTART,
            view.members,
            f"round {rnd.round} halted ({halted_by}) and every member is alive: restarting at the same membership",
        )
    if decision.action is Action.INSUFFICIENT:
        if rnd is None or rnd.state is not RoundState.RUNNING:
            return Plan(memory=mem, waiting_for=decision.reason)
        survivors = _survivors(snap, rnd)
        if survivors and repairs_in_place(rnd, ctx):  # below the minimum: the survivors keep the state (.hold)
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
        if repairs_in_place(rnd, ctx):  # the survivors cannot step without a new group: re-form it now
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
        if kind is EventKind.NODE_LOST and repairs_in_place(rnd, ctx) and decision.members[0] in snap.nodes:
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
    return publish_round(snap, decision.members, now, mem, decision.reason, reason)


def _own_lapse(
    snap: JobSnapshot, mem: DeciderMemory, now: float, ctx: DeciderContext, decider: str
) -> tuple[DeciderMemory, str]:
    """The memory with this decider's own lapse noted, and why it decides nothing now ("" : it decides).

    A decider that reads the store right after an outage may find every lease lapsed, its own too, before any
    agent (itself included) registered again: it would take every member for lost. Once its record is back, the
    others get one lease ttl (and a tick) to register again before a missing record counts as a lost node.
    """
    if decider not in snap.nodes:
        why = f"this node's record ({decider}) is gone: its lease lapsed; deciding again once it registers"
        return dataclasses.replace(mem, lapsed=True), why
    if mem.lapsed:
        return dataclasses.replace(mem, lapsed=False, lapse_grace_until=now + ctx.lease_ttl + ctx.tick), ""
    return mem, ""


def _lapse_explains(snap: JobSnapshot, rnd: RoundRecord, mem: DeciderMemory, now: float) -> str:
    """Why the running round's missing members are waited for ("" : they are not), within the grace that
    follows this decider's own lapse (:func:`_own_lapse`); a failure reported by any rank ends it."""
    gone = [m for m in rnd.members if m not in snap.nodes]
    if not gone or snap.failed or mem.lapse_grace_until is None or now >= mem.lapse_grace_until:
        return ""
    return (
        f"member(s) {', '.join(gone)} have no record, as this node had none after its lease lapsed, and no rank "
        f"reported a failure: waiting until t={mem.lapse_grace_until:.3f} for them to register again"
    )


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
        lapsed=mem.lapsed,
        lapse_grace_until=mem.lapse_grace_until,
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
    return publish_round(
        snap, rnd.members, now, mem, f"rank failure: {failure}", RestartReason.FAILURE, count_restart=True
    )
