"""What ``hyperpodctl status`` reports, as a pure function of the job's typed records.

:class:`JobRecords` holds the job's keys as :mod:`hyperpodrun.rendezvous.records` decodes
them (read from a store by :func:`hyperpodrun.ctl.job.read_job`); :func:`job_status`
interprets them and :func:`render_status` prints the result. Neither touches a store or
a clock, so every rule here is tested by passing records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any

from hyperpodrun.errors import HyperpodrunError
from hyperpodrun.rendezvous.records import (
    ClosedRecord,
    EventKind,
    EventMode,
    EventRecord,
    HistoryEntry,
    NodeRecord,
    RoundRecord,
    RoundState,
)

__all__ = [
    "CtlError",
    "JobClosedError",
    "JobRecords",
    "JobState",
    "JobStatus",
    "Member",
    "MemberState",
    "NoSuchJobError",
    "PendingEvent",
    "format_history_entry",
    "job_exists",
    "job_status",
    "render_status",
]


# --------------------------------------------------------------------------- errors


class CtlError(HyperpodrunError):
    """An operator request cannot be carried out (the job's state does not allow it)."""


class NoSuchJobError(CtlError):
    """The store holds no round and no node of the job."""

    def __init__(self, run_id: str, endpoint: str) -> None:
        super().__init__(f"no job with --rdzv-id {run_id} at {endpoint} (no round and no node records)")
        self.run_id = run_id
        self.endpoint = endpoint


class JobClosedError(CtlError):
    """The job has ended; it can no longer be steered."""


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, kw_only=True)
class JobRecords:
    """The job's keys as stored, decoded (``cap``: what ``ctl/cap`` sets, None: no cap)."""

    nodes: Mapping[str, NodeRecord]
    round: RoundRecord | None
    event: EventRecord | None
    cap: int | None
    closed: ClosedRecord | None
    history: tuple[HistoryEntry, ...]


def job_exists(records: JobRecords) -> bool:
    return records.round is not None or bool(records.nodes)


# --------------------------------------------------------------------------- status model


class JobState(str, Enum):
    FORMING = "forming"  # no round yet
    RUNNING = "running"
    HALTED = "halted"  # the round stopped without a successor; waiting for nodes or a restart
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class MemberState(str, Enum):
    """A member's node as its record (lease) shows it."""

    ALIVE = "alive"
    LEAVING = "leaving"  # asked to leave (SIGTERM); leaves at the next agreed step
    LOST = "lost"  # its lease expired: the job waits faulty_scale_down_timeout, then shrinks


@dataclass(frozen=True, kw_only=True)
class Member:
    """One node of the current round, in group-rank order."""

    group_rank: int
    node_id: str
    addr: str | None
    state: MemberState
    first_rank: int | None = None  # global ranks first_rank .. last_rank, when nproc is known
    last_rank: int | None = None


@dataclass(frozen=True, kw_only=True)
class PendingEvent:
    """A scale event of the current round that has not completed yet."""

    event_id: int
    kind: EventKind  # why: join, leave, yield, node_lost, rank_failure, insufficient
    mode: EventMode  # how the ranks move on: reconfigure in place, restart (save and exit), stop
    reason: str
    target_step: int | None  # None: waiting for the members' acks; -1: not cooperative, stopped
    next_members: tuple[str, ...] | None  # None: no next round decided (the round halts)
    next_master: str | None  # rank 0's address of the next round, fixed with the target
    decided_at: float

    @property
    def ranks(self) -> str:
        """What the members' ranks do for this event."""
        if self.mode is EventMode.STOP:
            if self.target_step is not None and self.target_step < 0:
                return "ranks stopped at once (not every rank calls elastic_event_detected())"
            return "ranks stopped at once"
        if self.target_step is None:
            return "waiting for the members' acks"
        if self.mode is EventMode.RECONFIGURE:
            return f"ranks reconfigure in place at step {self.target_step}"
        return f"ranks save and exit at step {self.target_step}"


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    """What ``hyperpodctl status`` reports, interpreted from :class:`JobRecords` by :func:`job_status`."""

    run_id: str
    endpoint: str
    state: JobState
    detail: str
    round: int
    round_reason: str | None
    members: tuple[Member, ...]
    nproc_per_node: int | None
    master: str | None
    restarts: int
    standbys: tuple[str, ...]
    leaving: tuple[str, ...]
    lost: tuple[str, ...]
    alive_nodes: int
    pending_event: PendingEvent | None
    cap: int | None
    closed: ClosedRecord | None
    history: tuple[HistoryEntry, ...]
    addresses: Mapping[str, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int | None:
        """Ranks in the current round (members x nproc per node), when nproc is known."""
        return len(self.members) * self.nproc_per_node if self.nproc_per_node is not None else None

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready values (enums as their values)."""
        out = asdict(self)
        out["state"] = self.state.value
        out["world_size"] = self.world_size
        out["members"] = [{**asdict(m), "state": m.state.value} for m in self.members]
        ev = self.pending_event
        if ev is not None:
            out["pending_event"] = {**asdict(ev), "kind": ev.kind.value, "mode": ev.mode.value, "ranks": ev.ranks}
        out["closed"] = {"status": self.closed.status.value, "message": self.closed.message} if self.closed else None
        out["addresses"] = dict(self.addresses)
        return out


def _nproc(records: JobRecords, members: tuple[str, ...]) -> int | None:
    """nproc per node from the live node records (every node of a job runs the same number of ranks)."""
    for node_id in [*members, *sorted(records.nodes)]:
        node = records.nodes.get(node_id)
        if node is not None and node.nproc > 0:
            return node.nproc
    return None


def _pending(records: JobRecords) -> PendingEvent | None:
    ev, rnd = records.event, records.round
    if ev is None or rnd is None or ev.round != rnd.round or ev.complete:
        return None
    return PendingEvent(
        event_id=ev.id,
        kind=ev.kind,
        mode=ev.mode,
        reason=ev.reason,
        target_step=ev.target,
        next_members=ev.next_members,
        decided_at=ev.decided_at,
        next_master=f"{ev.master_addr}:{ev.master_port}" if ev.master_addr and ev.master_port else None,
    )


def _member_state(node: NodeRecord | None) -> MemberState:
    if node is None:
        return MemberState.LOST
    return MemberState.LEAVING if node.leaving else MemberState.ALIVE


def job_status(records: JobRecords, *, run_id: str, endpoint: str) -> JobStatus:
    """Interpret the job's records; raises :class:`NoSuchJobError` when there is no job."""
    if not job_exists(records):
        raise NoSuchJobError(run_id, endpoint)
    rnd, nodes = records.round, records.nodes
    member_ids = rnd.members if rnd is not None else ()
    nproc = _nproc(records, member_ids)
    members = []
    for group_rank, node_id in enumerate(member_ids):
        node = nodes.get(node_id)
        first, last = (group_rank * nproc, (group_rank + 1) * nproc - 1) if nproc is not None else (None, None)
        members.append(
            Member(
                group_rank=group_rank,
                node_id=node_id,
                addr=node.addr if node else None,
                state=_member_state(node),
                first_rank=first,
                last_rank=last,
            )
        )
    pending = _pending(records)
    state, detail = _summary(records, pending)
    return JobStatus(
        run_id=run_id,
        endpoint=endpoint,
        state=state,
        detail=detail,
        round=rnd.round if rnd is not None else 0,
        round_reason=rnd.reason if rnd is not None else None,
        members=tuple(members),
        nproc_per_node=nproc,
        master=f"{rnd.master_addr}:{rnd.master_port}"
        if rnd is not None and rnd.master_addr and rnd.master_port
        else None,
        restarts=rnd.restarts if rnd is not None else 0,
        standbys=tuple(n for n in sorted(nodes) if n not in member_ids and not nodes[n].leaving),
        leaving=tuple(n for n in sorted(nodes) if nodes[n].leaving),
        lost=tuple(m.node_id for m in members if m.state is MemberState.LOST),
        alive_nodes=len(nodes),
        pending_event=pending,
        cap=records.cap,
        closed=records.closed,
        history=records.history,
        addresses={n: r.addr for n, r in nodes.items()},
    )


def _summary(records: JobRecords, pending: PendingEvent | None) -> tuple[JobState, str]:
    closed, rnd = records.closed, records.round
    if closed is not None:
        return JobState(closed.status.value), closed.message
    if rnd is None:
        return JobState.FORMING, f"waiting for the first round ({len(records.nodes)} node(s) alive)"
    if rnd.state is RoundState.HALTED:
        if rnd.halt_kind is EventKind.RANK_FAILURE:
            return JobState.HALTED, f"stopped after a rank failure: {rnd.failure or 'rank failed'}"
        if rnd.halt_kind is EventKind.INSUFFICIENT:
            return (
                JobState.HALTED,
                "stopped for lack of nodes (or by the cap); waiting until an allowed size can be formed",
            )
        return JobState.HALTED, "stopped after a lost node or a failure; waiting for nodes"
    if pending is not None:
        return JobState.RUNNING, f"scale event {pending.event_id} in progress: {pending.reason}"
    return JobState.RUNNING, rnd.why


# --------------------------------------------------------------------------- rendering


def _time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def format_history_entry(entry: HistoryEntry) -> str:
    return f"{_time(entry.ts)}  round {entry.round:<4d} {entry.what}: {entry.reason}"


def _row(label: str, value: str) -> str:
    return f"{label + ':' if label else '':<13}{value}"


def _nodes(ids: tuple[str, ...], addresses: Mapping[str, str]) -> str:
    if not ids:
        return "none"
    return ", ".join(f"{n} ({addresses[n]})" if addresses.get(n) else n for n in ids)


def _event_lines(ev: PendingEvent | None) -> list[str]:
    if ev is None:
        return [_row("scale event", "none pending")]
    if ev.next_members is None:
        nxt = "not decided (the round halts)"
    else:
        nxt = ", ".join(ev.next_members) or "none (halt)"
        if ev.next_master:
            nxt += f" (master {ev.next_master})"
    return [
        _row(
            "scale event",
            f"{ev.event_id} ({ev.kind.value}, {ev.mode.value}) decided {_time(ev.decided_at)}: {ev.ranks}",
        ),
        _row("", f"next members: {nxt}"),
        _row("", f"reason: {ev.reason}"),
    ]


def render_status(status: JobStatus, *, history: int = 10) -> str:
    """The human-readable ``status`` report; ``history`` = how many recent decisions to show."""
    s = status
    lines = [f"job {s.run_id} at {s.endpoint}", _row("state", s.state.value + (f" ({s.detail})" if s.detail else ""))]
    if s.round:
        lines.append(
            _row(
                "round", f"{s.round}" + (f" ({s.round_reason})" if s.round_reason else "") + f", restarts {s.restarts}"
            )
        )
    if s.nproc_per_node is not None:
        lines.append(_row("world size", f"{s.world_size} ({len(s.members)} node(s) x {s.nproc_per_node} rank(s))"))
    else:
        lines.append(
            _row("world size", f"unknown ({len(s.members)} node(s); the node records do not say nproc per node)")
        )
    if s.master:
        lines.append(_row("master", s.master))
    lines.append(_row("members", f"{len(s.members)}" + (", in group-rank order" if s.members else "")))
    for m in s.members:
        ranks = f"ranks {m.first_rank}-{m.last_rank}" if m.first_rank is not None else ""
        lines.append(f"  {m.group_rank:>4d}  {m.node_id:<28} {m.addr or '-':<16} {ranks:<14} {m.state.value}".rstrip())
    lines.append(_row("standby", _nodes(s.standbys, s.addresses)))
    lines.append(_row("leaving", _nodes(s.leaving, s.addresses)))
    if s.lost:
        lines.append(_row("lost", ", ".join(s.lost)))
    lines.append(_row("cap", f"{s.cap} replica(s) (hyperpodctl uncap lifts it)" if s.cap is not None else "none"))
    lines.extend(_event_lines(s.pending_event))
    lines.append(_row("closed", f"{s.closed.status.value}: {s.closed.message}" if s.closed else "no"))
    recent = s.history[-history:] if history > 0 else ()
    lines.append(_row("history", f"last {len(recent)} of {len(s.history)} decision(s)"))
    lines.extend(f"  {format_history_entry(e)}" for e in recent)
    return "\n".join(lines)
