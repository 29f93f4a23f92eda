"""The decider's seat on one node: the leased ``decider`` key, and the read-plan-execute tick of its holder.

One agent at a time decides for the job (:mod:`.decider`); :class:`DeciderSeat` is where an
:class:`~hyperpodrun.rendezvous.elastic.ElasticRendezvous` takes that role: :meth:`DeciderSeat.claim`
takes or checks the key (it dies with its holder's lease), :meth:`DeciderSeat.decide` reads the job's
records (:meth:`DeciderSeat.read_job`), plans, and applies the plan's compare-and-swap writes, then
tells people what was decided (log line, the job's history, the event log).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from hyperpodrun.events import EventLog
from hyperpodrun.rendezvous.decider import DeciderContext, DeciderMemory, JobSnapshot, Plan, plan
from hyperpodrun.rendezvous.records import (
    REPAIR_KINDS,
    AckRecord,
    EventMode,
    EventRecord,
    FailedRecord,
    HistoryEntry,
    Keys,
    NodeRecord,
    RoundRecord,
    RoundState,
    StoppedRecord,
    cap_of,
    decode,
    decode_list,
    decode_prefix,
    encode,
)
from hyperpodrun.store import Entry, Lease, Store

log = logging.getLogger(__name__)

#: Decisions kept in the job's history (shown by hyperpodctl).
HISTORY_KEEP = 50

__all__ = ["DeciderSeat"]


class DeciderSeat:
    """One node's seat at the decider's table (see the module)."""

    def __init__(
        self,
        store: Store,
        *,
        context: DeciderContext,
        node_id: str,
        events: EventLog | None,
        clock: Callable[[], float],
        lease: Callable[[], Lease | None],
    ) -> None:
        self.store, self.ctx, self._node_id, self.events, self.clock = store, context, node_id, events, clock
        self._lease = lease
        self.memory = DeciderMemory()
        self.waiting_for = ""  # what the last plan waits for (progress lines)

    def claim(self) -> bool:
        """Whether this node decides for the job: it holds the leased ``decider`` key, or takes it when free.

        The key dies with its holder's lease (crash, kill -9, graceful exit), so another
        node takes over within one lease ttl; everything a decider needs is in the store.
        """
        entry = self.store.get(Keys.DECIDER)
        if entry is not None:
            return entry.value.decode() == self._node_id
        return self.store.compare_and_swap(
            Keys.DECIDER, self._node_id.encode(), expected_revision=0, lease=self._lease()
        )

    def note_lapse(self) -> None:
        """This node's lease lapsed and its agent registered again: other members' records may be missing for
        the same reason for one lease ttl from now, and are not taken for lost nodes meanwhile (:func:`.decider.plan`)."""
        grace_until = self.clock() + self.ctx.lease_ttl + self.ctx.tick
        self.memory = dataclasses.replace(self.memory, lapse_grace_until=grace_until)

    def decide(self) -> bool:
        """One decider tick: read, plan, execute. Whether anything was written."""
        snap = self.read_job()
        now = self.clock()
        self.memory = dataclasses.replace(self.memory, wall_offset=time.time() - now)
        result = plan(snap, self.memory, now, self.ctx, decider=self._node_id)
        self.memory = result.memory
        self.waiting_for = result.waiting_for
        return self._execute(result)

    def read_job(self) -> JobSnapshot:
        """What the decider reads: O(1) keys plus the node records, and the current event's acks or stops."""
        nodes = decode_prefix(NodeRecord, self.store.get_prefix(Keys.NODES))
        rnd_entry, ev_entry = self.store.get(Keys.ROUND), self.store.get(Keys.EVENT)
        rnd = decode(RoundRecord, Keys.ROUND, _value(rnd_entry))
        ev = decode(EventRecord, Keys.EVENT, _value(ev_entry))
        cap_entry = self.store.get(Keys.CAP)
        cap = cap_of(cap_entry.value) if cap_entry is not None else None
        acks: dict[str, AckRecord] = {}
        stopped: dict[str, StoppedRecord] = {}
        failed: dict[str, FailedRecord] = {}
        done: frozenset[str] = frozenset()
        finished: frozenset[str] = frozenset()
        if ev is not None and rnd is not None and ev.round == rnd.round and not ev.complete:  # a pending event
            if ev.target is None and ev.mode is not EventMode.STOP:
                acks = decode_prefix(AckRecord, self.store.get_prefix(Keys.acks(ev.id)))
                # a rank's crash reported after its peers' failed collectives names a repair; in a round that repairs
                # in place, a failure turns a scale event still waiting for acks or joiners into its repair
                if ev.kind in REPAIR_KINDS or rnd.inprocess:
                    failed = decode_prefix(FailedRecord, self.store.get_prefix(Keys.failed(rnd.round)))
            else:
                stopped = decode_prefix(StoppedRecord, self.store.get_prefix(Keys.stopped(ev.id)))
        elif rnd is not None and rnd.state is RoundState.RUNNING:
            done = frozenset(Keys.leaf(k) for k in self.store.get_prefix(Keys.done(rnd.round)))
            finished = frozenset(Keys.leaf(k) for k in self.store.get_prefix(Keys.finished(rnd.round)))
            failed = decode_prefix(FailedRecord, self.store.get_prefix(Keys.failed(rnd.round)))
        return JobSnapshot(
            nodes=nodes,
            round=rnd,
            round_rev=rnd_entry.revision if rnd_entry else 0,
            event=ev,
            event_rev=ev_entry.revision if ev_entry else 0,
            acks=acks,
            stopped=stopped,
            done=done,
            finished=finished,
            failed=failed,
            cap=cap,
        )

    def _execute(self, result: Plan) -> bool:
        """Apply the plan's writes in order; stop at the first that lost a race (the next tick re-plans)."""
        for write in result.writes:
            if not self.store.compare_and_swap(write.key, write.value, expected_revision=write.expected_revision):
                return False
        for note in result.notes:
            log.warning("%s: %s", note.what, note.reason)
            self._record(note.round, note.what, note.reason)
            if self.events and note.event:
                self.events.emit(note.event, reason=note.reason, **note.fields)
        return bool(result.writes)

    def _record(self, round_no: int, what: str, reason: str) -> None:
        """Append to the job's bounded decision history (read by ``hyperpodctl status``)."""
        for _ in range(5):  # CAS retry: only deciders write here, so contention is rare
            entry = self.store.get(Keys.HISTORY)
            items = decode_list(HistoryEntry, Keys.HISTORY, _value(entry))
            items = (items + [HistoryEntry(ts=time.time(), round=round_no, what=what, reason=reason)])[-HISTORY_KEEP:]
            if self.store.compare_and_swap(
                Keys.HISTORY, encode(items), expected_revision=entry.revision if entry else 0
            ):
                return


def _value(entry: Entry | None) -> bytes | None:
    return entry.value if entry is not None else None
