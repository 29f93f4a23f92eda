"""The decider's half for an event in flight: acks, the target step, the stops, the next round.

:func:`drive_event` is called by :func:`~hyperpodrun.rendezvous.decider.plan` while the job's event is
not complete; like it, it reads no clock and does no I/O (see :mod:`.decider` for the event's steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from hyperpodrun.config import RestartMode
from hyperpodrun.rendezvous.api import RestartReason
from hyperpodrun.rendezvous.hold import holds
from hyperpodrun.rendezvous.local_time import event_key, gone_key, halt_key, made_key
from hyperpodrun.rendezvous.plans import (
    RATE_WAIT_PROPAGATIONS,
    SILENT_GRACE,
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
    REPAIR_KINDS,
    AckRecord,
    EventKind,
    EventMode,
    EventRecord,
    Keys,
    RoundRecord,
    RoundState,
    encode,
    evolve,
)

__all__ = ["drive_event"]


def drive_event(
    snap: JobSnapshot, ev: EventRecord, rnd: RoundRecord, now: float, ctx: DeciderContext, mem: DeciderMemory
) -> Plan:
    live = [m for m in rnd.members if m in snap.nodes]
    if ev.mode is not EventMode.STOP and ev.target is None:
        return _target_event(snap, ev, live, now, ctx, mem)
    gone = [m for m in ev.next_members or () if m not in snap.nodes]
    if ev.mode is EventMode.RECONFIGURE and gone:  # the new group cannot form without them
        since = mem.seen.get(gone_key(ev.id), now)
        if not snap.failed and now < since + ctx.lease_ttl:  # a lapsed lease: its agent registers again at once
            mem = dataclasses.replace(mem, seen={**mem.seen, gone_key(ev.id): since})
            return Plan(memory=mem, waiting_for=f"event {ev.id}: {gone} gone with no failure reported: one lease ttl")
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
    if snap.failed and ev.kind not in REPAIR_KINDS and snap.round is not None and repairs_in_place(snap.round, ctx):
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
            published = publish_round(
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
            published = publish_round(snap, nxt, now, mem, why, RestartReason.SCALE, number=ev.next_round + 1)
        return Plan(writes=(complete, *published.writes), notes=published.notes, memory=mem)
    if nxt and all(m in snap.nodes for m in nxt):
        reason = RestartReason.FAILURE if ev.mode is EventMode.STOP else RestartReason.SCALE
        published = publish_round(
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
