"""``hyperpodctl``: inspect and steer a running elastic job through its store.

Everything goes through the job's store (``--rdzv-backend``/``--rdzv-endpoint``/
``--rdzv-id``/``--rdzv-conf``, the same values and ``PET_*`` variables the job was
launched with); ``hyperpodctl`` never hosts an embedded store, it only connects.

* ``status``: members in group-rank order, world size, round, standbys, leaving and
  lost nodes, the pending scale event, the operator cap, and recent decisions.
* ``cap N`` / ``uncap``: bound the job to at most ``N`` replicas (key ``ctl/cap``).
* ``yield K``: give back ``K`` replicas now (a cap ``K`` below the current size).
* ``events``: the job's decision history, optionally followed as it grows.

Reading the records (:func:`read_job`) is separate from interpreting them
(:func:`job_status`, a pure function), so every rule here is testable without a store.
The key layout is the one documented in :mod:`hyperpodrun.elastic_rendezvous`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from enum import Enum
from typing import Annotated, Any

import typer

from hyperpodrun import __version__
from hyperpodrun.config import parse_rdzv_conf
from hyperpodrun.errors import ConfigError, HyperpodrunError
from hyperpodrun.store import Store, create_store, job_prefix, resolve_backend

__all__ = [
    "CAP_KEY",
    "ConnectionSettings",
    "CtlError",
    "FollowEnd",
    "HistoryEntry",
    "JobClosedError",
    "JobRecords",
    "JobStatus",
    "Member",
    "MemberState",
    "NoSuchJobError",
    "PendingEvent",
    "app",
    "cap_after_yield",
    "follow_history",
    "format_history_entry",
    "job_exists",
    "job_status",
    "main",
    "parse_history",
    "read_job",
    "render_status",
    "set_cap",
    "yield_replicas",
]

# Keys under the job prefix (see hyperpodrun.elastic_rendezvous).
NODES_PREFIX = "nodes/"
ROUND_KEY = "round"
EVENT_KEY = "event"
CLOSED_KEY = "closed"
HISTORY_KEY = "history"
CAP_KEY = "ctl/cap"

DEFAULT_PORTS = {"etcd": 2379, "embedded": 29400}
_WATCH_SLICE = 30.0  # seconds of one change wait while following the history


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


# --------------------------------------------------------------------------- connection


@dataclass(frozen=True, kw_only=True)
class ConnectionSettings:
    """How to reach a job's store; ``endpoint`` empty means ``127.0.0.1`` at the backend's port."""

    backend: str
    endpoint: str
    run_id: str
    conf: Mapping[str, str] = field(default_factory=dict)
    timeout: float = 10.0

    def __post_init__(self) -> None:
        kind = resolve_backend(self.backend)  # StoreConfigError names the flag
        job_prefix(self.run_id)  # StoreConfigError: not a valid --rdzv-id
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ConfigError(f"--store-timeout: must be a number of seconds > 0, got {self.timeout!r}")
        if not self.endpoint.strip():
            object.__setattr__(self, "endpoint", f"127.0.0.1:{DEFAULT_PORTS[kind]}")

    def connect(self) -> Store:
        """A client of the job's store; never hosts one (an embedded store lives in an agent)."""
        embedded = resolve_backend(self.backend) == "embedded"
        return create_store(
            self.backend,
            self.endpoint,
            run_id=self.run_id,
            conf=dict(self.conf),
            host=False if embedded else None,  # etcd is never hosted; host= must stay unset
            timeout=self.timeout,
        )


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, kw_only=True)
class JobRecords:
    """The job's keys as stored, JSON-decoded (``cap`` is the ``ctl/cap`` value's ``cap``)."""

    nodes: Mapping[str, Mapping[str, Any]]
    round: Mapping[str, Any] | None
    event: Mapping[str, Any] | None
    cap: int | None
    closed: Mapping[str, Any] | None
    history: tuple[Mapping[str, Any], ...]


def _decode(key: str, raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise CtlError(f"key {key!r} of the job does not hold JSON (written by another program?)") from None


def read_job(store: Store) -> JobRecords:
    """Read every record ``status`` needs (one request per key; each is self-consistent)."""
    nodes = {key[len(NODES_PREFIX) :]: _decode(key, e.value) for key, e in store.get_prefix(NODES_PREFIX).items()}
    values: dict[str, Any] = {}
    for key in (ROUND_KEY, EVENT_KEY, CAP_KEY, CLOSED_KEY, HISTORY_KEY):
        entry = store.get(key)
        values[key] = _decode(key, entry.value) if entry is not None else None
    return JobRecords(
        nodes=nodes,
        round=values[ROUND_KEY],
        event=values[EVENT_KEY],
        cap=_cap_value(values[CAP_KEY]),
        closed=values[CLOSED_KEY],
        history=tuple(values[HISTORY_KEY] or ()),
    )


def _cap_value(record: Any) -> int | None:
    """``{"cap": N}`` -> N; ``{"cap": null}``, no record or a malformed one -> None."""
    cap = record.get("cap") if isinstance(record, dict) else None
    return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0 else None


def job_exists(records: JobRecords) -> bool:
    return records.round is not None or bool(records.nodes)


# --------------------------------------------------------------------------- status model


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
    kind: str  # save: ranks save at target_step and exit; stop: ranks are stopped at once
    action: str
    reason: str
    target_step: int | None  # None: waiting for the members' acks; -1: not cooperative, stopping
    next_members: tuple[str, ...] | None  # None: no next round decided (e.g. waiting for lost nodes)
    decided_at: float | None


@dataclass(frozen=True, kw_only=True)
class HistoryEntry:
    """One decision of the job (a new round or a scale event), as the decider recorded it."""

    ts: float
    round: int
    what: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    """What ``hyperpodctl status`` reports, interpreted from :class:`JobRecords` by :func:`job_status`."""

    run_id: str
    endpoint: str
    state: str  # forming | running | halted | succeeded | failed
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
    closed: Mapping[str, Any] | None
    history: tuple[HistoryEntry, ...]
    addresses: Mapping[str, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int | None:
        """Ranks in the current round (members x nproc per node), when nproc is known."""
        return len(self.members) * self.nproc_per_node if self.nproc_per_node is not None else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["world_size"] = self.world_size
        out["members"] = [{**asdict(m), "state": m.state.value} for m in self.members]
        out["closed"] = dict(self.closed) if self.closed is not None else None
        out["addresses"] = dict(self.addresses)
        return out


def parse_history(items: Any) -> tuple[HistoryEntry, ...]:
    """The ``history`` record's entries (malformed ones are skipped)."""
    out = []
    for item in items if isinstance(items, (list, tuple)) else ():
        try:
            entry = HistoryEntry(
                ts=float(item["ts"]), round=int(item["round"]), what=str(item["what"]), reason=str(item.get("reason", ""))
            )
        except (TypeError, KeyError, ValueError):
            continue
        out.append(entry)
    return tuple(out)


def _nproc(records: JobRecords, members: list[str]) -> int | None:
    """nproc per node from the node records (every node of a job runs the same number of ranks)."""
    for node_id in [*members, *sorted(records.nodes)]:
        value = records.nodes.get(node_id, {}).get("nproc")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _pending(records: JobRecords) -> PendingEvent | None:
    ev, rnd = records.event, records.round
    if not ev or not rnd or ev.get("round") != rnd.get("round") or ev.get("complete"):
        return None
    nxt = ev.get("next")
    return PendingEvent(
        event_id=int(ev.get("id", 0)),
        kind=str(ev.get("kind", "")),
        action=str(ev.get("action", "")),
        reason=str(ev.get("reason", "")),
        target_step=ev.get("target"),
        next_members=tuple(nxt) if nxt is not None else None,
        decided_at=ev.get("decided_at"),
    )


def job_status(records: JobRecords, *, run_id: str, endpoint: str) -> JobStatus:
    """Interpret the job's records; raises :class:`NoSuchJobError` when there is no job."""
    if not job_exists(records):
        raise NoSuchJobError(run_id, endpoint)
    rnd = records.round or {}
    nodes = records.nodes
    member_ids = [str(m) for m in rnd.get("members", [])]
    nproc = _nproc(records, member_ids)
    members = []
    for group_rank, node_id in enumerate(member_ids):
        record = nodes.get(node_id)
        if record is None:
            state = MemberState.LOST
        else:
            state = MemberState.LEAVING if record.get("leaving") else MemberState.ALIVE
        ranks = (group_rank * nproc, (group_rank + 1) * nproc - 1) if nproc is not None else (None, None)
        addr = record.get("addr") if record else None
        members.append(Member(group_rank=group_rank, node_id=node_id, addr=addr, state=state, first_rank=ranks[0], last_rank=ranks[1]))
    member_set = set(member_ids)
    standbys = tuple(n for n in sorted(nodes) if n not in member_set and not nodes[n].get("leaving"))
    leaving = tuple(n for n in sorted(nodes) if nodes[n].get("leaving"))
    lost = tuple(m.node_id for m in members if m.state is MemberState.LOST)
    pending = _pending(records)
    state, detail = _summary(records, pending, len(nodes))
    master = f"{rnd['master_addr']}:{rnd['master_port']}" if rnd.get("master_addr") and rnd.get("master_port") else None
    return JobStatus(
        run_id=run_id,
        endpoint=endpoint,
        state=state,
        detail=detail,
        round=int(rnd.get("round", 0)),
        round_reason=rnd.get("reason"),
        members=tuple(members),
        nproc_per_node=nproc,
        master=master,
        restarts=int(rnd.get("restarts", 0)),
        standbys=standbys,
        leaving=leaving,
        lost=lost,
        alive_nodes=len(nodes),
        pending_event=pending,
        cap=records.cap,
        closed=records.closed,
        history=parse_history(records.history),
        addresses={n: str(r.get("addr", "")) for n, r in nodes.items()},
    )


def _summary(records: JobRecords, pending: PendingEvent | None, alive: int) -> tuple[str, str]:
    closed, rnd = records.closed, records.round
    if closed:
        status = str(closed.get("status", "failed"))
        return status, str(closed.get("message", ""))
    if rnd is None:
        return "forming", f"waiting for the first round ({alive} node(s) alive)"
    if rnd.get("state") == "halted":
        if rnd.get("failure"):
            return "halted", f"stopped after a rank failure: {rnd['failure']}"
        if rnd.get("insufficient"):
            return "halted", "stopped for lack of nodes (or by the cap); waiting until an allowed size can be formed"
        return "halted", "stopped after a lost node or a failure; waiting for nodes"
    if pending is not None:
        return "running", f"scale event {pending.event_id} in progress: {pending.reason}"
    return "running", str(rnd.get("why", ""))


# --------------------------------------------------------------------------- rendering


def _time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def format_history_entry(entry: HistoryEntry) -> str:
    return f"{_time(entry.ts)}  round {entry.round:<4d} {entry.what}: {entry.reason}"


def _target(event: PendingEvent) -> str:
    if event.kind == "stop":
        return "ranks stopped at once"
    if event.target_step is None:
        return "waiting for the members' acks"
    if event.target_step < 0:
        return "ranks do not call elastic_event_detected(): stopping them"
    return f"ranks save and exit at step {event.target_step}"


def _row(label: str, value: str) -> str:
    return f"{label + ':' if label else '':<13}{value}"


def render_status(status: JobStatus, *, history: int = 10) -> str:
    """The human-readable ``status`` report; ``history`` = how many recent decisions to show."""
    s = status
    lines = [f"job {s.run_id} at {s.endpoint}", _row("state", s.state + (f" ({s.detail})" if s.detail else ""))]
    if s.round:
        lines.append(_row("round", f"{s.round}" + (f" ({s.round_reason})" if s.round_reason else "") + f", restarts {s.restarts}"))
    if s.nproc_per_node is not None:
        lines.append(_row("world size", f"{s.world_size} ({len(s.members)} node(s) x {s.nproc_per_node} rank(s))"))
    else:
        lines.append(_row("world size", f"unknown ({len(s.members)} node(s); the node records do not say nproc per node)"))
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
    ev = s.pending_event
    if ev is None:
        lines.append(_row("scale event", "none pending"))
    else:
        nxt = ", ".join(ev.next_members) if ev.next_members else ("none (halt)" if ev.next_members == () else "not decided")
        lines.append(_row("scale event", f"{ev.event_id} ({ev.kind}, {ev.action}) decided {_time(ev.decided_at)}: {_target(ev)}"))
        lines.append(_row("", f"next members: {nxt}"))
        lines.append(_row("", f"reason: {ev.reason}"))
    lines.append(_row("closed", f"{s.closed.get('status')}: {s.closed.get('message', '')}" if s.closed else "no"))
    recent = s.history[-history:] if history > 0 else ()
    lines.append(_row("history", f"last {len(recent)} of {len(s.history)} decision(s)"))
    lines.extend(f"  {format_history_entry(e)}" for e in recent)
    return "\n".join(lines)


def _nodes(ids: tuple[str, ...], addresses: Mapping[str, str]) -> str:
    if not ids:
        return "none"
    return ", ".join(f"{n} ({addresses[n]})" if addresses.get(n) else n for n in ids)


# --------------------------------------------------------------------------- cap


def _require_open(records: JobRecords, settings: ConnectionSettings) -> None:
    if not job_exists(records):
        raise NoSuchJobError(settings.run_id, settings.endpoint)
    if records.closed:
        raise JobClosedError(
            f"job {settings.run_id} has ended ({records.closed.get('status')}); there is nothing to steer"
        )


def set_cap(store: Store, settings: ConnectionSettings, cap: int | None) -> JobRecords:
    """Cap the job at ``cap`` replicas (``None`` lifts the cap); returns the records read before."""
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise ConfigError(f"cap: must be an integer >= 0, got {cap!r}")
    records = read_job(store)
    _require_open(records, settings)
    if cap is None:
        store.delete(CAP_KEY)
    else:
        store.put(CAP_KEY, json.dumps({"cap": cap}).encode())
    return records


def cap_after_yield(*, members: int, current_cap: int | None, count: int) -> int:
    """The cap that gives back ``count`` replicas: below the current size and below any existing cap."""
    if count < 1:
        raise ConfigError(f"yield: COUNT must be >= 1, got {count}")
    base = members if current_cap is None else min(members, current_cap)
    if count > base:
        raise ConfigError(f"yield {count}: the job runs {base} replica(s), it cannot give back {count}")
    return base - count


def yield_replicas(store: Store, settings: ConnectionSettings, count: int, *, attempts: int = 5) -> tuple[int, JobRecords]:
    """Set the cap ``count`` below the job's size, atomically against concurrent caps.

    Returns the new cap and the records it was computed from.
    """
    for _ in range(attempts):
        entry = store.get(CAP_KEY)
        records = read_job(store)
        _require_open(records, settings)
        if records.round is None:
            raise CtlError(f"job {settings.run_id} has not started a round yet; use 'hyperpodctl cap N' to bound it")
        current = _cap_value(_decode(CAP_KEY, entry.value)) if entry is not None else None
        cap = cap_after_yield(members=len(records.round.get("members", [])), current_cap=current, count=count)
        revision = entry.revision if entry is not None else 0
        if store.compare_and_swap(CAP_KEY, json.dumps({"cap": cap}).encode(), expected_revision=revision):
            return cap, records
    raise CtlError(f"yield: {CAP_KEY} kept changing under concurrent writers ({attempts} attempts); try again")


# --------------------------------------------------------------------------- history


class FollowEnd(str, Enum):
    CLOSED = "closed"
    TIMEOUT = "timeout"


def follow_history(
    store: Store,
    *,
    timeout: float,
    emit: Callable[[HistoryEntry], None],
    clock: Callable[[], float] = time.monotonic,
) -> tuple[FollowEnd, Mapping[str, Any] | None]:
    """Emit every history entry, then new ones as deciders append them.

    Ends when the job closes (returns its ``closed`` record) or after ``timeout`` seconds.
    The history is a bounded list, so entries are recognised by content, not position.
    """
    if not timeout > 0:
        raise ConfigError(f"--timeout: must be > 0 seconds, got {timeout!r}")
    deadline = clock() + timeout
    seen: set[tuple[float, int, str, str]] = set()
    revision = store.current_revision()
    while True:
        closed = store.get(CLOSED_KEY)  # before the history: what was written before closing is printed
        entry = store.get(HISTORY_KEY)
        for item in parse_history(_decode(HISTORY_KEY, entry.value) if entry is not None else ()):
            key = (item.ts, item.round, item.what, item.reason)
            if key not in seen:
                seen.add(key)
                emit(item)
        if closed is not None:
            return FollowEnd.CLOSED, _decode(CLOSED_KEY, closed.value)
        remaining = deadline - clock()
        if remaining <= 0:
            return FollowEnd.TIMEOUT, None
        # Bounded waits: a long-quiet watch stream is re-opened rather than trusted for an hour.
        revision = store.wait_for_change("", after_revision=revision, timeout=min(remaining, _WATCH_SLICE)) or revision


# --------------------------------------------------------------------------- CLI

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Inspect and steer hyperpodrun jobs through their rendezvous store.",
)

_CONN = "Connection (the values the job was launched with)"


def _opt(*names: str, env: str | None = None, help: str, **kw):
    spellings: list[str] = []
    for n in names:
        spellings.append(n)
        if n.startswith("--") and "-" in n[2:]:
            spellings.append("--" + n[2:].replace("-", "_"))
    return typer.Option(*spellings, envvar=env, show_envvar=env is not None, help=help, rich_help_panel=_CONN, **kw)


Backend = Annotated[str, _opt("--rdzv-backend", env="PET_RDZV_BACKEND", help="etcd, or c10d/embedded (an agent hosts the store).")]
Endpoint = Annotated[str, _opt("--rdzv-endpoint", env="PET_RDZV_ENDPOINT", help="HOST:PORT of the store (etcd: a comma-separated list); default 127.0.0.1 at the backend's port.", show_default=False)]
RunId = Annotated[str, _opt("--rdzv-id", env="PET_RDZV_ID", help="The job's --rdzv-id.", show_default=False)]
Conf = Annotated[str, _opt("--rdzv-conf", env="PET_RDZV_CONF", help="key=value,... (etcd TLS/auth: cacert, cert, key, protocol, user, password); other keys are ignored.")]
StoreTimeout = Annotated[float, _opt("--store-timeout", help="Seconds to keep trying to reach the store.")]


def _settings(backend: str, endpoint: str, run_id: str, conf: str, timeout: float) -> ConnectionSettings:
    return ConnectionSettings(backend=backend, endpoint=endpoint, run_id=run_id, conf=parse_rdzv_conf(conf), timeout=timeout)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hyperpodctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")] = False,
) -> None:
    """Inspect and steer hyperpodrun jobs through their rendezvous store."""


@app.command()
def status(
    rdzv_id: RunId,
    rdzv_backend: Backend = "etcd",
    rdzv_endpoint: Endpoint = "",
    rdzv_conf: Conf = "",
    store_timeout: StoreTimeout = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (every field, full history).")] = False,
    history: Annotated[int, typer.Option("--history", min=0, help="Recent decisions to show.")] = 10,
) -> None:
    """Members, world size, round, standbys, pending scale event, cap and recent decisions."""
    settings = _settings(rdzv_backend, rdzv_endpoint, rdzv_id, rdzv_conf, store_timeout)
    with settings.connect() as store:
        result = job_status(read_job(store), run_id=settings.run_id, endpoint=settings.endpoint)
    typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else render_status(result, history=history))


@app.command()
def cap(
    replicas: Annotated[int, typer.Argument(min=0, help="Most replicas (nodes) the job may run at.", show_default=False)],
    rdzv_id: RunId,
    rdzv_backend: Backend = "etcd",
    rdzv_endpoint: Endpoint = "",
    rdzv_conf: Conf = "",
    store_timeout: StoreTimeout = 10.0,
) -> None:
    """Cap the job at REPLICAS; a larger job shrinks to the largest allowed size <= REPLICAS."""
    settings = _settings(rdzv_backend, rdzv_endpoint, rdzv_id, rdzv_conf, store_timeout)
    with settings.connect() as store:
        records = set_cap(store, settings, replicas)
    typer.echo(_cap_message(settings.run_id, replicas, records))


@app.command()
def uncap(
    rdzv_id: RunId,
    rdzv_backend: Backend = "etcd",
    rdzv_endpoint: Endpoint = "",
    rdzv_conf: Conf = "",
    store_timeout: StoreTimeout = 10.0,
) -> None:
    """Lift the cap: the job may grow to its maximum again."""
    settings = _settings(rdzv_backend, rdzv_endpoint, rdzv_id, rdzv_conf, store_timeout)
    with settings.connect() as store:
        records = set_cap(store, settings, None)
    was = f" (was {records.cap})" if records.cap is not None else " (there was none)"
    typer.echo(f"job {settings.run_id}: cap lifted{was}; the job may grow to its maximum replica count")


@app.command("yield")
def yield_(
    count: Annotated[int, typer.Argument(min=1, help="Replicas (nodes) to give back now.", show_default=False)],
    rdzv_id: RunId,
    rdzv_backend: Backend = "etcd",
    rdzv_endpoint: Endpoint = "",
    rdzv_conf: Conf = "",
    store_timeout: StoreTimeout = 10.0,
) -> None:
    """Give back COUNT replicas now: sets the cap COUNT below the current size (or the current cap)."""
    settings = _settings(rdzv_backend, rdzv_endpoint, rdzv_id, rdzv_conf, store_timeout)
    with settings.connect() as store:
        new_cap, records = yield_replicas(store, settings, count)
    typer.echo(_cap_message(settings.run_id, new_cap, records))


@app.command()
def events(
    rdzv_id: RunId,
    rdzv_backend: Backend = "etcd",
    rdzv_endpoint: Endpoint = "",
    rdzv_conf: Conf = "",
    store_timeout: StoreTimeout = 10.0,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new decisions until the job ends or --timeout.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to follow before giving up (with --follow).")] = 3600.0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """The job's decisions (rounds and scale events) with their reasons, oldest first."""
    settings = _settings(rdzv_backend, rdzv_endpoint, rdzv_id, rdzv_conf, store_timeout)
    if follow and not timeout > 0:
        raise ConfigError(f"--timeout: must be > 0 seconds, got {timeout:g}")

    def emit(entry: HistoryEntry) -> None:
        typer.echo(json.dumps(asdict(entry)) if as_json else format_history_entry(entry))

    with settings.connect() as store:
        records = read_job(store)
        if not job_exists(records):
            raise NoSuchJobError(settings.run_id, settings.endpoint)
        if not follow:
            for entry in parse_history(records.history):
                emit(entry)
            return
        end, closed = follow_history(store, timeout=timeout, emit=emit)
    if end is FollowEnd.TIMEOUT:
        print(f"hyperpodctl: stopped following after --timeout {timeout:g}s; the job is still open", file=sys.stderr)
    else:
        print(f"hyperpodctl: job {settings.run_id} ended: {closed.get('status')}: {closed.get('message', '')}", file=sys.stderr)


def _cap_message(run_id: str, cap: int, records: JobRecords) -> str:
    size = len(records.round.get("members", [])) if records.round else 0
    text = f"job {run_id}: cap set to {cap} replica(s)"
    if records.round is None:
        return text + "; the job has not started yet and will start with at most that many"
    if cap == 0:
        return text + f" (running {size}); its ranks save and stop, and it waits until the cap is raised"
    if cap < size:
        return (
            text + f"; shrinking from {size} to the largest allowed replica count <= {cap} "
            "(if none is allowed, e.g. below minReplicas, the job saves, stops and waits)"
        )
    return text + f"; running {size}, so nothing changes now: the job will not grow beyond {cap}"


# --------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``hyperpodctl``): returns the process exit status."""
    from hyperpodrun.cli import run_app

    return run_app(app, "hyperpodctl", argv)


if __name__ == "__main__":
    sys.exit(main())
