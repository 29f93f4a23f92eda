"""Store-backed elastic rendezvous: one node's membership, and the decider when it holds the key.

Every agent joins with a leased ``nodes/<id>`` record (:mod:`.records` has the layout).
One agent at a time is the *decider*, the holder of the leased ``decider`` key (the first
to take it; another takes it within a lease ttl when its holder dies or leaves). It reads
the job's records, plans with the pure :func:`~.decider.plan` and executes the plan's
compare-and-swap writes, so a change of decider mid-event is safe.

The member side of a cooperative event: when the round's event appears, the agent acks
with its ranks' furthest step, fastest step time and a port free on this node; once the
decider has written the target step, :meth:`ElasticRendezvous.poll` returns a
SAVE_AND_EXIT or RECONFIGURE directive that the agent puts on the control channel; the
agent reports ``stopped`` when its ranks have left the round. A STOP event (lost node,
failed rank, ranks that do not cooperate) stops the ranks at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from elastic_events.contract import GroupAssignment
from hyperpodrun.errors import RendezvousClosedError, RendezvousError, RendezvousTimeoutError
from hyperpodrun.events import EventLog, EventType
from hyperpodrun.job_settings import check_join, job_settings
from hyperpodrun.policy import ElasticPolicy
from hyperpodrun.rendezvous.api import (
    Directive,
    DirectiveKind,
    LocalStatus,
    RendezvousHandler,
    RestartReason,
    RoundInfo,
)
from hyperpodrun.rendezvous.decider import DeciderContext
from hyperpodrun.rendezvous.decider_seat import DeciderSeat
from hyperpodrun.rendezvous.plans import repairs_in_place
from hyperpodrun.rendezvous.ports import PortReservation, reserve_anew
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
    decode,
    encode,
)
from hyperpodrun.store import Entry, Lease, LeaseKeeper, Store, StoreError
from hyperpodrun.supervisor import WorkerState

log = logging.getLogger(__name__)


class ElasticRendezvous(RendezvousHandler):
    """One node's membership in an elastic job, over a :class:`Store`."""

    def __init__(
        self,
        store: Store,
        *,
        context: DeciderContext,
        local_addr: str,
        join_timeout: float,
        events: EventLog | None = None,
        clock: Callable[[], float] = time.monotonic,
        node_id: str | None = None,
    ) -> None:
        self.store = store
        self.ctx = context
        self._local_addr = local_addr
        self.join_timeout = join_timeout
        self.events = events
        self.clock = clock
        self._node_id = node_id or f"{socket.gethostname()}-{os.getpid()}"
        self._last_decide = -float("inf")
        self._round: RoundRecord | None = None  # the round this node runs in
        self._handled_event = 0
        self._acked: AckRecord | None = None
        self._acked_event = 0
        self._acked_at = 0.0  # clock() of the last ack
        # The ports named in this node's record and in its last ack, held until replaced (.ports).
        self._node_port: PortReservation | None = None
        self._ack_port: PortReservation | None = None
        self._stopped_reported = 0
        self._failure_reported: int | None = None  # the round whose failure record this node wrote
        self._leaving = False
        self._reconfigurable = False  # this node's ranks declared the in-process API
        self._can_hold = False  # and that they hold the state below the minimum
        self._parked = False  # this standby's pre-warmed ranks are parked, waiting for admission
        self._in_place_event: EventRecord | None = None  # the event this node's ranks moved rounds in place for
        self._keeper: LeaseKeeper | None = None
        self._lease: Lease | None = None
        self._seat = DeciderSeat(
            store, context=context, node_id=self._node_id, events=events, clock=clock, lease=lambda: self._lease
        )

    # -- the handler's properties ------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def local_addr(self) -> str:
        return self._local_addr

    @property
    def policy(self) -> ElasticPolicy:
        return self.ctx.policy

    @property
    def lease_lost(self) -> bool:
        return self._keeper is not None and self._keeper.lost

    @property
    def elastic(self) -> bool:
        return True

    @property
    def tick(self) -> float:
        return self.ctx.tick

    @property
    def graceful_timeout(self) -> float:
        return self.ctx.policy.graceful_shutdown_timeout

    @property
    def in_process(self) -> bool:
        rnd = self._round_now()
        return rnd is not None and rnd.inprocess

    @property
    def repairs_in_place(self) -> bool:
        rnd = self._round_now()
        return rnd is not None and repairs_in_place(rnd, self.ctx)

    def _round_now(self) -> RoundRecord | None:
        """This node's round; read from the store when not known to run in-process yet (the decider marks a
        running round in-process); this node's own record when the store is unreachable or moved on."""
        if self._round is None or self._round.inprocess:
            return self._round
        try:
            rnd = decode(RoundRecord, Keys.ROUND, _value(self.store.get(Keys.ROUND)))
        except StoreError:
            return self._round
        return rnd if rnd is not None and rnd.round == self._round.round else self._round

    @property
    def leaving(self) -> bool:
        return self._leaving

    # -- membership --------------------------------------------------------------------

    def join(self) -> None:
        self._lease = self.store.grant_lease(self.ctx.lease_ttl)
        closed = decode(ClosedRecord, Keys.CLOSED, _value(self.store.get(Keys.CLOSED)))
        if closed is not None:
            raise RendezvousClosedError(
                f"a job with this --rdzv-id already ran and {closed.status.value}; use a new --rdzv-id "
                "(or delete the old job's keys, e.g. etcdctl del --prefix /hyperpodrun/v1/<id>/)",
                status="failed",
            )
        check_join(self.store, self._node_id, self._settings())  # a node that differs is refused
        self._put_node()
        self._keeper = LeaseKeeper(self._lease, on_lost=lambda e: log.warning("membership lease lost: %s", e)).start()

    def _settings(self) -> dict[str, Any]:
        return job_settings(
            nproc_per_node=self.ctx.nproc_per_node, policy=self.ctx.policy, max_world_size=self.ctx.max_world_size
        )

    def rejoin(self) -> None:
        """Register again under a fresh lease after this node's lease expired (a store outage longer
        than the lease ttl). Same node id: a round that still counts this node goes on, and one that
        moved on without it is seen by :meth:`poll` and ends the ranks' round."""
        if self._keeper is not None:
            self._keeper.stop()
        self._lease = self.store.grant_lease(self.ctx.lease_ttl)
        self._put_node()
        self._keeper = LeaseKeeper(self._lease, on_lost=lambda e: log.warning("membership lease lost: %s", e)).start()
        self._seat.note_lapse()
        if self.events:
            self.events.emit(EventType.NODE_REJOINED)

    def _put_node(self) -> None:
        """(Re)write this node's record with a port held for it: the next round's master port if it hosts rank 0.

        The port it replaces is let go: the round that could use it is over (a store still
        listening there keeps listening)."""
        self._node_port = reserve_anew(self._node_port, self._local_addr)
        record = NodeRecord(
            addr=self._local_addr,
            port=self._node_port.port,
            nproc=self.ctx.nproc_per_node,
            pid=os.getpid(),
            leaving=self._leaving,
            reconfigurable=self._reconfigurable,
            can_hold=self._can_hold,
            parked=self._parked,
            settings=self._settings(),
        )
        self.store.put(Keys.node(self._node_id), encode(record), lease=self._lease)

    def request_leave(self) -> None:
        """Graceful leave (SIGTERM): members leave at the next agreed step; standbys at once."""
        if self._leaving:
            return
        self._leaving = True
        self._put_node()
        if self.events:
            self.events.emit(EventType.NODE_LEAVING, node_leaving=self._node_id)

    def shutdown(self, *, succeeded: bool) -> None:
        try:
            if self._keeper is not None:
                self._keeper.stop()
            if self._hosts_store() and self.store.get(Keys.CLOSED) is not None:
                # The job is over: keep the embedded store up until the other agents have read
                # that (they revoke their leases on the way out), or they would see it vanish.
                self._wait_for_others_to_leave(timeout=self.ctx.lease_ttl + 5.0)
            if self._lease is not None:
                self._lease.revoke()
        except StoreError as e:
            log.info("leaving the store: %s", e)
        finally:
            self.store.close()
            for held in (self._node_port, self._ack_port):
                if held is not None:
                    held.release()

    def _hosts_store(self) -> bool:
        """Whether this agent's process hosts the job's (embedded) store."""
        return bool(getattr(getattr(self.store, "inner", self.store), "is_host", False))

    def _wait_for_others_to_leave(self, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            rev = self.store.current_revision()
            others = [k for k in self.store.get_prefix(Keys.NODES) if k != Keys.node(self._node_id)]
            remaining = deadline - time.monotonic()
            if not others:
                return
            if remaining <= 0:
                log.warning("the job is over but %d agent(s) had not left; closing the store", len(others))
                return
            self.store.wait_for_change(Keys.NODES, after_revision=rev, timeout=remaining)

    # -- the agent's entry points --------------------------------------------------------

    def next_round(self, *, timeout: float, prewarm: Callable[[], bool] | None = None) -> RoundInfo:
        """Wait until this node is a member of a running round newer than the last one it ran,
        or a RECONFIGURE event admits it into a running job in place."""
        deadline = time.monotonic() + timeout
        last = self._round.round if self._round else 0
        started = time.monotonic()
        next_line = started + 1.0  # a start that takes a moment says nothing
        while True:
            if self.lease_lost:
                self.rejoin()
            rev = self.store.current_revision()  # before reading: a change after it wakes the wait below
            rnd, _, closed = self._read_round()
            if closed is not None:
                raise RendezvousClosedError(closed.message, status=closed.status.value)
            if self._leaving and not self._is_member(rnd):
                raise RendezvousClosedError("left the job gracefully", status="left")
            decider = self._seat.claim()
            if decider:
                # At most one decision per tick: a burst of N joins costs the decider O(N) reads, not O(N^2).
                coalesce = self._last_decide + self.ctx.tick - time.monotonic()
                if coalesce > 0:
                    self.store.wait_for_change(Keys.ROUND, after_revision=rev, timeout=coalesce)
                    continue
                self._last_decide = time.monotonic()
                if self._seat.decide():
                    rnd, _, _ = self._read_round()
            if (
                rnd is not None
                and rnd.round > last
                and rnd.state is RoundState.RUNNING
                and self._node_id in rnd.members
            ):
                return self._enter(rnd)
            standby_in_process = (
                rnd is not None and rnd.inprocess and rnd.state is RoundState.RUNNING and not self._leaving
            )
            if (
                standby_in_process
                and rnd is not None
                and (admission := self._admission(rnd, self._read_event())) is not None
            ):
                return admission
            if standby_in_process and prewarm is not None and not self._parked and prewarm():
                self._parked = True
                self._put_node()  # the decider admits this node in place only once its ranks are parked
            now = time.monotonic()
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"no round of the job included this node within {timeout:g}s (policy min "
                    f"{self.ctx.policy.min_replicas} node(s); a node past max or below a cap waits as a standby)"
                )
            if now >= next_line:  # at the default log level: minutes of silence look like a hang
                next_line = now + 10.0
                log.warning(
                    "waiting for a round (%.0fs of the %gs join timeout): %s",
                    now - started,
                    timeout,
                    self._seat.waiting_for or "waiting for the job's decider",
                )
            # The decider wakes on any change (joins, acks); the others only when the round changes,
            # so a rendezvous of N nodes costs O(N) store operations in all, not O(N^2).
            # A pre-warmed standby also wakes for the event that admits it (events are few: O(1) per event).
            # The decider re-plans at least every few ticks (its timers); the others wait for the round
            # for up to a lease ttl (a dead decider's key expires by then and one of them takes over), so
            # a long rendezvous does not cost a waiting node a read per second.
            watch = "" if decider or standby_in_process else Keys.ROUND
            patience = self.ctx.tick * 5 if decider or standby_in_process else self.ctx.lease_ttl
            self.store.wait_for_change(watch, after_revision=rev, timeout=min(patience, max(0.0, deadline - now)))
            if standby_in_process and not decider:
                self.store.wait_for_change(
                    Keys.ROUND, after_revision=rev, timeout=self.ctx.tick
                )  # at most one read per tick

    def poll(self, status: LocalStatus) -> Directive | None:
        """Called every monitor tick while this node's ranks run (or have just finished)."""
        rnd, ev, closed = self._read_round(with_event=True)
        if closed is not None:
            code = 0 if closed.status is JobOutcome.SUCCEEDED else 1
            return Directive(kind=DirectiveKind.EXIT, exit_code=code, reason=closed.message)
        if (status.reconfigurable and not self._reconfigurable) or (status.can_hold and not self._can_hold):
            self._reconfigurable = self._reconfigurable or status.reconfigurable
            self._can_hold = self._can_hold or status.can_hold
            self._put_node()  # once: the decider marks the round in-process when every member has
        my_round = self._round.round if self._round else 0
        if (stop := self._left_behind(rnd, ev, my_round)) is not None:
            return stop
        ev = ev if ev is not None and ev.round == my_round else None  # from here: the event of this node's round
        if status.group_state == WorkerState.SUCCEEDED and ev is None:
            self._put_once(Keys.done(my_round) + self._node_id, b"{}")
        if status.finished:
            self._put_once(Keys.finished(my_round) + self._node_id, b"{}")
        if status.group_state == WorkerState.FAILED or status.repairing:
            self.report_failure(status.failure or "rank failed", repairable=status.repairing)
        elif status.peer_failed:  # the first sign of a lost node, long before its lease expires
            failed = FailedRecord(
                message=f"a collective failed on {self._node_id}: a peer died or hung", repairable=True, peer=True
            )
            self._put_once(Keys.failed(my_round) + self._node_id, encode(failed))
        if (
            rnd is not None
            and self._round is not None
            and rnd.round == my_round
            and rnd.inprocess != self._round.inprocess
        ):
            self._round = rnd  # the decider marked the round in-process
        directive = None
        if ev is not None and ev.id > self._handled_event:
            directive = self._follow_event(ev, status)
        elif ev is not None and ev.id == self._handled_event > self._stopped_reported and ev.mode is EventMode.STOP:
            # an event this node is acting on was turned into a stop (e.g. a joiner vanished mid-way)
            directive = Directive(kind=DirectiveKind.STOP, event_id=ev.id, event_kind=ev.kind, reason=ev.reason)
        if self._seat.claim():
            self._seat.decide()
        return directive

    def report_failure(self, message: str, *, repairable: bool) -> None:
        """This node's failure record in its round, once (later calls cost no store operation). It replaces the
        peer failure its other ranks reported first (their collective failed on the rank that died before the
        agent saw it die), so that the job reads a rank failure here, not a node lost elsewhere."""
        my_round = self._round.round if self._round else 0
        if self._failure_reported == my_round:
            return
        key = Keys.failed(my_round) + self._node_id
        failed = encode(FailedRecord(message=message, repairable=repairable))
        if not self.store.compare_and_swap(key, failed, expected_revision=0):
            entry = self.store.get(key)
            if entry is not None and (earlier := decode(FailedRecord, key, entry.value)) is not None and earlier.peer:
                self.store.compare_and_swap(key, failed, expected_revision=entry.revision)
        self._failure_reported = my_round

    def report_stopped(self, event_id: int, *, ok: bool, reconfigured: bool = False) -> None:
        if event_id and event_id > self._stopped_reported:
            self._stopped_reported = event_id
            self._handled_event = max(self._handled_event, event_id)
            if not reconfigured:
                self._put_node()  # a fresh port for the next round before the decider publishes it
            self.store.put(
                Keys.stopped(event_id) + self._node_id, encode(StoppedRecord(ok=ok, reconfigured=reconfigured))
            )

    # -- member side of an event ---------------------------------------------------------

    def _follow_event(self, ev: EventRecord, status: LocalStatus) -> Directive | None:
        base = partial(Directive, event_id=ev.id, event_kind=ev.kind, reason=ev.reason, next_round=ev.next_round)
        if ev.mode is EventMode.STOP and (ev.target is None or ev.target < 0):
            self._handled_event = ev.id
            return base(kind=DirectiveKind.STOP)
        if ev.target is None:
            self._ack(ev, status)
            return None
        self._handled_event = ev.id
        if ev.mode is EventMode.RECONFIGURE and ev.kind in REPAIR_KINDS:
            return self._reconfigure_directive(ev, ev.target)  # at once: the ranks stopped at the failed collective
        # A local rank already past the target (the ranks outran the decider's margin) acts one step
        # late, together with every other late rank of the job; the agent stops the event if one
        # acted in time instead (``hyperpodrun.progress.LateRanks``).
        if ev.mode is EventMode.RECONFIGURE:
            return self._reconfigure_directive(ev, ev.target)
        nxt = ev.next_members or ()
        world = len(nxt) * self.ctx.nproc_per_node if nxt else -1
        return base(kind=DirectiveKind.SAVE_AND_EXIT, target_step=ev.target, world_size=world)

    def _reconfigure_directive(self, ev: EventRecord, target: int) -> Directive:
        """This node's place in a RECONFIGURE event's round, targeted at ``target`` (group rank -1: it leaves)."""
        nxt = ev.next_members or ()
        return Directive(
            kind=DirectiveKind.RECONFIGURE,
            event_id=ev.id,
            event_kind=ev.kind,
            reason=ev.reason,
            next_round=ev.next_round,
            target_step=target,
            world_size=len(nxt) * self.ctx.nproc_per_node if nxt else -1,
            group_rank=nxt.index(self._node_id) if self._node_id in nxt else -1,
            group_world_size=len(nxt),
            master_addr=ev.master_addr,
            master_port=ev.master_port,
            members=nxt,
            hold=ev.hold,
            from_held=self._round is not None and self._round.held,
        )

    def _admission(self, rnd: RoundRecord, ev: EventRecord | None) -> RoundInfo | None:
        """A targeted RECONFIGURE event of the running round that admits this standby in place."""
        if (
            ev is None
            or ev.round != rnd.round
            or ev.complete
            or ev.mode is not EventMode.RECONFIGURE
            or ev.target is None
            or ev.target < 0
            or not ev.next_members
            or self._node_id not in ev.next_members
        ):
            return None
        directive = self._reconfigure_directive(ev, ev.target)
        self._handled_event = ev.id
        self._parked = False
        return dataclasses.replace(self.entered_in_place(directive), admission=directive)

    def _left_behind(self, rnd: RoundRecord | None, ev: EventRecord | None, my_round: int) -> Directive | None:
        """STOP when the job moved on without this node's running ranks: a newer round (an in-place
        reconfiguration fell back to a restart), or an in-place round that was never published."""
        moved_on = rnd is not None and rnd.round > my_round and rnd.state is RoundState.RUNNING
        placed = self._in_place_event
        # The decider completes the event and then publishes the round: two writes, so between them the
        # event is complete and the round not yet written. Only a halted previous round means "never published".
        unpublished = (
            placed is not None
            and ev is not None
            and ev.id == placed.id
            and ev.complete
            and rnd is not None
            and rnd.round == my_round - 1
            and rnd.state is RoundState.HALTED
        )
        if not (moved_on or unpublished):
            return None
        self._in_place_event = None
        why = rnd.why if rnd is not None and rnd.why else "the job moved on without this node's ranks"
        return Directive(kind=DirectiveKind.STOP, event_id=0, reason=f"round {my_round} ended: {why}")

    def _ack(self, ev: EventRecord, status: LocalStatus) -> None:
        """Ack; again when the step rate, unknown at the first ack, has become known (the decider waits for it),
        and every half propagation budget while the event waits to be targeted (e.g. for a joiner to park): a
        target computed from an old step and the rate of a busier moment is one the ranks outrun."""
        step_time = min((t for t in status.step_times if t > 0), default=0.0)
        now = self.clock()
        prev = self._acked if self._acked_event == ev.id else None  # this node's last ack of the event
        if prev is not None:
            rate_known = prev.step_time == 0 and step_time > 0
            if not rate_known and now - self._acked_at < self.ctx.propagation / 2:
                return
        ack = AckRecord(
            step=max(status.steps, default=0),
            step_time=step_time,
            cooperative=status.cooperative,
            reconfigurable=status.reconfigurable,
            port=prev.port if prev is not None else self._new_ack_port(),
            seq=prev.seq + 1 if prev is not None else 0,
        )
        self._acked, self._acked_event, self._acked_at = ack, ev.id, now
        self.store.put(Keys.acks(ev.id) + self._node_id, encode(ack))

    def _new_ack_port(self) -> int:
        """A port held for a new event's ack (its in-place round's master port if this node hosts rank 0)."""
        self._ack_port = reserve_anew(self._ack_port, self._local_addr)
        return self._ack_port.port

    # -- decider -------------------------------------------------------------------------

    # -- helpers -------------------------------------------------------------------------

    def _read_event(self) -> EventRecord | None:
        return decode(EventRecord, Keys.EVENT, _value(self.store.get(Keys.EVENT)))

    def _read_round(
        self, *, with_event: bool = False
    ) -> tuple[RoundRecord | None, EventRecord | None, ClosedRecord | None]:
        """What every node reads each tick: O(1) keys, whatever the size of the job."""
        rnd = decode(RoundRecord, Keys.ROUND, _value(self.store.get(Keys.ROUND)))
        ev = self._read_event() if with_event else None
        closed = decode(ClosedRecord, Keys.CLOSED, _value(self.store.get(Keys.CLOSED)))
        return rnd, ev, closed

    def _is_member(self, rnd: RoundRecord | None) -> bool:
        return rnd is not None and self._node_id in rnd.members and rnd.state is RoundState.RUNNING

    def _put_once(self, key: str, value: bytes) -> None:
        self.store.compare_and_swap(key, value, expected_revision=0)

    def _enter(self, rnd: RoundRecord) -> RoundInfo:
        self._round = rnd
        members = rnd.members
        if self.events:
            self.events.round, self.events.world_size = rnd.round, len(members) * self.ctx.nproc_per_node
        return RoundInfo(
            round=rnd.round,
            assignment=GroupAssignment(
                group_rank=members.index(self._node_id),
                group_world_size=len(members),
                nproc_per_node=self.ctx.nproc_per_node,
                master_addr=rnd.master_addr,
                master_port=int(rnd.master_port),
            ),
            members=tuple(members),
            reason=RestartReason(rnd.reason),
            restarts=rnd.restarts,
        )

    def entered_in_place(self, directive: Directive) -> RoundInfo:
        """The round a RECONFIGURE directive moved this node into, without a rendezvous wait.

        The decider publishes that round once every member reported; this node's ranks are
        already in it, so the agent does not wait for the record.
        """
        if directive.group_rank < 0:
            raise RendezvousError("this node left the job at the reconfiguration")
        rnd = RoundRecord(
            round=directive.next_round,
            members=directive.members,
            master_addr=directive.master_addr,
            master_port=directive.master_port,
            reason=(RestartReason.FAILURE if directive.repair else RestartReason.SCALE).value,
            mode=EventMode.RECONFIGURE,
            inprocess=True,
            held=directive.hold,
        )
        self._round = rnd
        self._in_place_event = EventRecord(
            id=directive.event_id,
            round=directive.next_round - 1,
            kind=directive.event_kind or EventKind.JOIN,
            mode=EventMode.RECONFIGURE,
            next_members=None,
            reason=directive.reason,
            decided_at=0.0,
        )
        if self.events:
            self.events.round, self.events.world_size = rnd.round, directive.world_size
        return RoundInfo(
            round=rnd.round,
            assignment=GroupAssignment(
                group_rank=directive.group_rank,
                group_world_size=directive.group_world_size,
                nproc_per_node=self.ctx.nproc_per_node,
                master_addr=directive.master_addr,
                master_port=directive.master_port,
            ),
            members=directive.members,
            reason=RestartReason.FAILURE if directive.repair else RestartReason.SCALE,
        )


def _value(entry: Entry | None) -> bytes | None:
    return entry.value if entry is not None else None
