"""hyperpodctl against a real etcd and a real embedded store (parametrised over both).

The job's keys are written with the store API as typed records encoded by
:mod:`hyperpodrun.rendezvous.records` (the layout the rendezvous uses); one test runs a
real :class:`ElasticRendezvous` decider so that a drift between what the rendezvous writes
and what ``hyperpodctl`` reads fails here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hyperpodrun.ctl import (
    FollowEnd,
    HistoryEntry,
    JobRecords,
    MemberState,
    NoSuchJobError,
    cap_after_yield,
    follow_history,
    job_status,
    main,
    render_status,
)
from hyperpodrun.errors import ConfigError
from hyperpodrun.rendezvous.records import (
    CapRecord,
    ClosedRecord,
    EventKind,
    EventMode,
    EventRecord,
    JobOutcome,
    Keys,
    NodeRecord,
    RoundRecord,
    RoundState,
    encode,
)
from hyperpodrun.store import EmbeddedStoreServer, Store, create_store
from hyperpodrun.store.auth import new_secret
from support.etcd import EtcdServer
from support.launch import clean_env
from support.ports import free_port

BACKENDS = ["etcd", "embedded"]
CAP_KEY = Keys.CAP


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@dataclass
class Job:
    """A job's store (one client, as an agent would hold) and the flags that reach it."""

    backend: str
    endpoint: str
    run_id: str
    store: Store

    def flags(self) -> list[str]:
        return ["--rdzv-backend", self.backend, "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id]

    def put(self, key: str, record: object) -> None:
        """Write a typed record (or a list of them) as the rendezvous does."""
        self.store.put(key, encode(record))

    def get(self, key: str) -> object:
        entry = self.store.get(key)
        return None if entry is None else json.loads(entry.value)


@pytest.fixture(params=BACKENDS)
def job(request: pytest.FixtureRequest) -> Iterator[Job]:
    run_id = f"ctl-{uuid.uuid4().hex[:10]}"
    with contextlib.ExitStack() as stack:
        if request.param == "etcd":
            endpoint = request.getfixturevalue("etcd_server").endpoint
        else:
            # as an agent hosts it: a secret of its own, published for this user's agents and hyperpodctl
            server = EmbeddedStoreServer("127.0.0.1", 0, secret=new_secret(), publish_secret=True)
            endpoint = stack.enter_context(server).endpoint
        host = False if request.param == "embedded" else None
        store = create_store(request.param, endpoint, run_id=run_id, conf={}, host=host, timeout=10.0)
        stack.callback(store.close)
        yield Job(request.param, endpoint, run_id, store)


def ctl(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


HISTORY = [
    {"ts": 1700000000.0, "round": 1, "what": "round 1: 3 node(s), world 6", "reason": "starting with 3 replica(s)"},
    {"ts": 1700000100.0, "round": 1, "what": "event 1 (leave, restart)", "reason": "member(s) leaving: node-b"},
]
HISTORY_RECORDS = [HistoryEntry(**h) for h in HISTORY]
SUCCEEDED = ClosedRecord(status=JobOutcome.SUCCEEDED, message="all ranks exited 0")


def node(addr: str, *, leaving: bool = False, nproc: int = 2) -> NodeRecord:
    return NodeRecord(addr=addr, port=29500, nproc=nproc, leaving=leaving)


def running_round(members: tuple[str, ...] = ("node-a",), **changes: object) -> RoundRecord:
    fields = dict(round=1, members=members, master_addr="10.0.0.1", master_port=1)
    return RoundRecord(**{**fields, **changes})


def leave_event(**changes: object) -> EventRecord:
    """Round 4's leave of node-b, restarting the ranks at step 1234."""
    fields = dict(
        id=7,
        round=4,
        kind=EventKind.LEAVE,
        mode=EventMode.RESTART,
        next_members=("node-a", "node-d"),
        reason="member(s) leaving: node-b",
        decided_at=1700000200.0,
        target=1234,
    )
    return EventRecord(**{**fields, **changes})


def populate_running_job(job: Job, *, nodes: bool = True) -> None:
    """Round 4 of members a, b (leaving), c (lost); standby d; a pending leave event; a cap.

    ``nodes=False``: every node record has gone (their leases expired), so nproc is unknown.
    """
    if nodes:
        job.put(Keys.node("node-a"), NodeRecord(addr="10.0.0.1", port=29500, nproc=2))
        job.put(Keys.node("node-b"), NodeRecord(addr="10.0.0.2", port=29501, nproc=2, leaving=True))
        job.put(Keys.node("node-d"), NodeRecord(addr="10.0.0.4", port=29503, nproc=2))
    job.put(
        Keys.ROUND,
        RoundRecord(
            round=4,
            members=("node-a", "node-b", "node-c"),
            master_addr="10.0.0.1",
            master_port=29500,
            restarts=1,
            reason="scale",
            why="grew",
        ),
    )
    job.put(Keys.EVENT, leave_event())
    job.put(CAP_KEY, CapRecord(cap=5))
    job.put(Keys.HISTORY, HISTORY_RECORDS)


# --------------------------------------------------------------------------- status


def test_status_reports_members_world_standbys_event_cap_and_history(job: Job, capsys) -> None:
    populate_running_job(job)
    code, out, err = ctl(capsys, "status", *job.flags())
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"job {job.run_id} at {job.endpoint}"
    assert "state:       running (scale event 7 in progress: member(s) leaving: node-b)" in lines
    assert "round:       4 (scale), restarts 1" in lines
    assert "world size:  6 (3 node(s) x 2 rank(s))" in lines
    assert "master:      10.0.0.1:29500" in lines
    table = lines[
        lines.index("members:     3, in group-rank order") + 1 : lines.index("standby:     node-d (10.0.0.4)")
    ]
    assert [line.split() for line in table] == [
        ["0", "node-a", "10.0.0.1", "ranks", "0-1", "alive"],
        ["1", "node-b", "10.0.0.2", "ranks", "2-3", "leaving"],
        ["2", "node-c", "-", "ranks", "4-5", "lost"],
    ]
    assert "leaving:     node-b (10.0.0.2)" in lines
    assert "lost:        node-c" in lines
    assert "cap:         5 replica(s) (hyperpodctl uncap lifts it)" in lines
    event = lines.index(next(line for line in lines if line.startswith("scale event: 7 (leave, restart)")))
    assert lines[event].endswith("ranks save and exit at step 1234")
    assert lines[event + 1 : event + 3] == [
        "             next members: node-a, node-d",
        "             reason: member(s) leaving: node-b",
    ]
    assert "closed:      no" in lines
    assert "history:     last 2 of 2 decision(s)" in lines
    assert lines[-2].endswith("round 1    round 1: 3 node(s), world 6: starting with 3 replica(s)")
    assert lines[-1].endswith("round 1    event 1 (leave, restart): member(s) leaving: node-b")
    limited = ctl(capsys, "status", "--history", "1", *job.flags())[1].splitlines()
    assert "history:     last 1 of 2 decision(s)" in limited and limited[-1] == lines[-1]


def test_status_json_has_every_field(job: Job, capsys) -> None:
    populate_running_job(job)
    code, out, err = ctl(capsys, "status", "--json", *job.flags())
    assert code == 0, err
    data = json.loads(out)
    assert data["state"] == "running" and data["round"] == 4 and data["restarts"] == 1
    assert [(m["group_rank"], m["node_id"], m["state"], m["first_rank"], m["last_rank"]) for m in data["members"]] == [
        (0, "node-a", "alive", 0, 1),
        (1, "node-b", "leaving", 2, 3),
        (2, "node-c", "lost", 4, 5),
    ]
    assert data["nproc_per_node"] == 2 and data["world_size"] == 6
    assert data["standbys"] == ["node-d"] and data["leaving"] == ["node-b"] and data["lost"] == ["node-c"]
    assert data["cap"] == 5 and data["closed"] is None
    assert data["pending_event"] == {
        "event_id": 7,
        "kind": "leave",
        "mode": "restart",
        "ranks": "ranks save and exit at step 1234",
        "reason": "member(s) leaving: node-b",
        "target_step": 1234,
        "next_members": ["node-a", "node-d"],
        "next_master": None,
        "decided_at": 1700000200.0,
    }
    assert data["history"] == HISTORY


def test_status_without_node_records_shows_node_counts(job: Job, capsys) -> None:
    populate_running_job(job, nodes=False)
    code, out, err = ctl(capsys, "status", *job.flags())
    assert code == 0, err
    assert "world size:  unknown (3 node(s); the node records do not say nproc per node)" in out.splitlines()
    data = json.loads(ctl(capsys, "status", "--json", *job.flags())[1])
    assert data["world_size"] is None and data["nproc_per_node"] is None
    assert [m["first_rank"] for m in data["members"]] == [None, None, None]


def test_status_of_a_forming_and_of_a_closed_job(job: Job, capsys) -> None:
    job.put(Keys.node("node-a"), node("10.0.0.1", nproc=4))
    data = json.loads(ctl(capsys, "status", "--json", *job.flags())[1])
    assert (data["state"], data["round"], data["members"], data["standbys"]) == ("forming", 0, [], ["node-a"])
    assert data["detail"] == "waiting for the first round (1 node(s) alive)"
    job.put(Keys.ROUND, running_round())
    job.put(Keys.CLOSED, ClosedRecord(status=JobOutcome.FAILED, message="rank 3 exited with code 1"))
    code, out, _ = ctl(capsys, "status", *job.flags())
    assert code == 0
    assert "state:       failed (rank 3 exited with code 1)" in out.splitlines()
    assert "closed:      failed: rank 3 exited with code 1" in out.splitlines()


@pytest.mark.parametrize(
    ("halted", "detail"),
    [
        (
            {"halt_kind": EventKind.INSUFFICIENT},
            "stopped for lack of nodes (or by the cap); waiting until an allowed size can be formed",
        ),
        (
            {"halt_kind": EventKind.RANK_FAILURE, "failure": "rank 1 exited with code 3"},
            "stopped after a rank failure: rank 1 exited with code 3",
        ),
        ({"halt_kind": EventKind.NODE_LOST}, "stopped after a lost node or a failure; waiting for nodes"),
    ],
)
def test_status_of_a_halted_job(job: Job, capsys, halted: dict, detail: str) -> None:
    job.put(Keys.node("node-a"), node("10.0.0.1"))
    job.put(Keys.ROUND, running_round(round=2, state=RoundState.HALTED, halted_at=1700000300.0, **halted))
    kind = halted["halt_kind"]
    ev = EventRecord(
        id=3, round=2, kind=kind, mode=EventMode.STOP, next_members=None, reason="x", decided_at=1.0, complete=True
    )
    job.put(Keys.EVENT, ev)
    data = json.loads(ctl(capsys, "status", "--json", *job.flags())[1])
    assert (data["state"], data["detail"], data["pending_event"]) == ("halted", detail, None)


@pytest.mark.parametrize(
    ("event", "pending"),
    [
        (None, None),
        (leave_event(id=2, round=3, next_members=("a",), target=9), None),
        (leave_event(id=4, next_members=("a",), target=9, complete=True), None),
        (leave_event(id=4, kind=EventKind.JOIN, next_members=("a", "b"), target=None), (4, None, ("a", "b"))),
        (
            leave_event(id=5, kind=EventKind.NODE_LOST, mode=EventMode.STOP, next_members=None, target=None),
            (5, None, None),
        ),
    ],
)
def test_only_an_incomplete_event_of_the_current_round_is_pending(
    event: EventRecord | None, pending: tuple | None
) -> None:
    records = JobRecords(
        nodes={"a": node("h")},
        round=running_round(("a",), round=4),
        event=event,
        cap=None,
        closed=None,
        history=(),
    )
    status = job_status(records, run_id="j", endpoint="e:1")
    ev = status.pending_event
    assert (None if ev is None else (ev.event_id, ev.target_step, ev.next_members)) == pending
    assert status.members[0].state is MemberState.ALIVE


@pytest.mark.parametrize(
    ("kind", "mode", "target", "ranks"),
    [
        (EventKind.JOIN, EventMode.RESTART, None, "waiting for the members' acks"),
        (EventKind.JOIN, EventMode.RESTART, 40, "ranks save and exit at step 40"),
        (EventKind.YIELD, EventMode.RECONFIGURE, 41, "ranks reconfigure in place at step 41"),
        (EventKind.NODE_LOST, EventMode.STOP, None, "ranks stopped at once"),
        (EventKind.LEAVE, EventMode.STOP, -1, "ranks stopped at once (not every rank calls elastic_event_detected())"),
    ],
)
def test_pending_event_says_what_the_ranks_do(kind: EventKind, mode: EventMode, target: int | None, ranks: str) -> None:
    ev = leave_event(
        round=1, kind=kind, mode=mode, target=target, master_addr="10.0.0.4" if target else "", master_port=29503
    )
    records = JobRecords(
        nodes={"node-a": node("10.0.0.1")}, round=running_round(), event=ev, cap=None, closed=None, history=()
    )
    status = job_status(records, run_id="j", endpoint="e:1")
    assert status.pending_event is not None and status.pending_event.ranks == ranks
    line = next(line for line in render_status(status).splitlines() if line.startswith("scale event:"))
    assert line.startswith(f"scale event: 7 ({kind.value}, {mode.value}) decided ") and line.endswith(f": {ranks}")
    nxt = "             next members: node-a, node-d" + (" (master 10.0.0.4:29503)" if target else "")
    assert nxt in render_status(status).splitlines()
    assert status.to_dict()["pending_event"]["ranks"] == ranks


def test_job_status_of_no_records_is_no_such_job() -> None:
    records = JobRecords(nodes={}, round=None, event=None, cap=3, closed=None, history=())
    with pytest.raises(NoSuchJobError, match="no job with --rdzv-id j at e:1"):
        job_status(records, run_id="j", endpoint="e:1")


# --------------------------------------------------------------------------- cap, uncap, yield


def test_cap_and_uncap_write_the_control_key(job: Job, capsys) -> None:
    populate_running_job(job)
    code, out, err = ctl(capsys, "cap", "2", *job.flags())
    assert code == 0, err
    assert job.get(CAP_KEY) == {"cap": 2}
    assert "cap set to 2 replica(s); shrinking from 3 to the largest allowed replica count <= 2" in out
    code, out, _ = ctl(capsys, "cap", "8", *job.flags())
    assert code == 0 and job.get(CAP_KEY) == {"cap": 8}
    assert "nothing changes now: the job will not grow beyond 8" in out
    code, out, _ = ctl(capsys, "uncap", *job.flags())
    assert code == 0 and job.get(CAP_KEY) is None
    assert "cap lifted (was 8)" in out
    assert json.loads(ctl(capsys, "status", "--json", *job.flags())[1])["cap"] is None


@pytest.mark.parametrize(("existing", "count", "expected"), [(None, 1, 2), (None, 3, 0), (2, 1, 1), (9, 2, 1)])
def test_yield_caps_below_the_current_size(job: Job, capsys, existing: int | None, count: int, expected: int) -> None:
    populate_running_job(job)  # 3 members
    job.store.delete(CAP_KEY)
    if existing is not None:
        job.put(CAP_KEY, CapRecord(cap=existing))
    code, out, err = ctl(capsys, "yield", str(count), *job.flags())
    assert code == 0, err
    assert job.get(CAP_KEY) == {"cap": expected}
    assert f"cap set to {expected} replica(s)" in out


def test_yield_more_than_the_job_has_is_refused_and_writes_nothing(job: Job, capsys) -> None:
    populate_running_job(job)
    code, out, err = ctl(capsys, "yield", "4", *job.flags())
    assert code == 2 and out == ""
    assert err.strip() == "hyperpodctl: error: yield 4: the job runs 3 replica(s), it cannot give back 4"
    assert job.get(CAP_KEY) == {"cap": 5}


def test_steering_a_closed_job_is_refused(job: Job, capsys) -> None:
    populate_running_job(job)
    job.put(Keys.CLOSED, SUCCEEDED)
    for args in (["cap", "1"], ["uncap"], ["yield", "1"]):
        code, _, err = ctl(capsys, *args, *job.flags())
        assert code == 1
        assert err.strip() == f"hyperpodctl: error: job {job.run_id} has ended (succeeded); there is nothing to steer"
    assert job.get(CAP_KEY) == {"cap": 5}


def test_yield_before_the_first_round_is_refused(job: Job, capsys) -> None:
    job.put(Keys.node("node-a"), node("10.0.0.1"))
    code, _, err = ctl(capsys, "yield", "1", *job.flags())
    assert code == 1 and "has not started a round yet" in err
    assert job.get(CAP_KEY) is None


@pytest.mark.parametrize(
    ("members", "cap", "count", "expected"),
    [(4, None, 1, 3), (4, None, 4, 0), (4, 2, 1, 1), (4, 6, 1, 3), (1, None, 1, 0)],
)
def test_cap_after_yield(members: int, cap: int | None, count: int, expected: int) -> None:
    assert cap_after_yield(members=members, current_cap=cap, count=count) == expected


@pytest.mark.parametrize(("members", "cap", "count"), [(3, None, 4), (4, 1, 2), (2, None, 0)])
def test_cap_after_yield_rejects(members: int, cap: int | None, count: int) -> None:
    with pytest.raises(ConfigError):
        cap_after_yield(members=members, current_cap=cap, count=count)


# --------------------------------------------------------------------------- events


def test_events_prints_the_history(job: Job, capsys) -> None:
    populate_running_job(job)
    code, out, err = ctl(capsys, "events", *job.flags())
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("round 1    round 1: 3 node(s), world 6: starting with 3 replica(s)")
    code, out, _ = ctl(capsys, "events", "--json", *job.flags())
    assert [json.loads(line) for line in out.splitlines()] == HISTORY


def test_follow_prints_new_decisions_until_the_job_closes(job: Job) -> None:
    populate_running_job(job)
    seen: list[HistoryEntry] = []
    newer = HistoryEntry(ts=1700000300.0, round=5, what="round 5: 2 node(s), world 4", reason="node-b left")

    def emit(entry: HistoryEntry) -> None:
        seen.append(entry)
        if len(seen) == len(HISTORY):  # the follower has printed the backlog: the job moves on
            job.put(Keys.HISTORY, [*HISTORY_RECORDS[1:], newer])  # bounded list: the oldest entry drops out
            job.put(Keys.CLOSED, SUCCEEDED)

    end, closed = follow_history(job.store, timeout=60.0, emit=emit)
    assert end is FollowEnd.CLOSED and closed == SUCCEEDED
    assert [(e.round, e.what) for e in seen] == [(h.round, h.what) for h in [*HISTORY_RECORDS, newer]]


def test_follow_ends_at_its_timeout(job: Job, capsys) -> None:
    populate_running_job(job)
    code, out, err = ctl(capsys, "events", "--follow", "--timeout", "0.5", *job.flags())
    assert code == 0
    assert len(out.splitlines()) == 2
    assert "stopped following after --timeout 0.5s; the job is still open" in err


# --------------------------------------------------------------------------- errors


def test_no_such_job(job: Job, capsys) -> None:
    code, out, err = ctl(capsys, "status", *job.flags())
    assert code == 1 and out == ""
    assert err.strip() == (
        f"hyperpodctl: error: no job with --rdzv-id {job.run_id} at {job.endpoint} (no round and no node records)"
    )
    code, _, err = ctl(capsys, "cap", "1", *job.flags())
    assert code == 1 and "no job with --rdzv-id" in err
    assert job.get(CAP_KEY) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_unreachable_store_names_the_endpoint(backend: str, capsys) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    code, out, err = ctl(
        capsys,
        "status",
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "j",
        "--store-timeout",
        "0.5",
    )
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyperpodctl: error: ")
    assert f"at {endpoint} is unreachable" in lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["status"], "Missing option '--rdzv-id'"),
        (["status", "--rdzv-id", "a/b"], "--rdzv-id 'a/b' is not a valid job id"),
        (["status", "--rdzv-id", "j", "--rdzv-backend", "zookeeper"], "unknown --rdzv-backend 'zookeeper'"),
        (["status", "--rdzv-id", "j", "--rdzv-conf", "cacert"], "--rdzv-conf: expected key=value"),
        (["status", "--rdzv-id", "j", "--rdzv-conf", "lease_tll=5"], "--rdzv-conf: unknown key 'lease_tll'"),
        (["status", "--rdzv-id", "j", "--rdzv-conf", "lease_ttl=soon"], "--rdzv-conf lease_ttl: expected seconds"),
        (
            ["status", "--rdzv-id", "j", "--rdzv-backend", "c10d", "--rdzv-conf", "cacert=/x"],
            "applies only to --rdzv-backend etcd",
        ),
        (["status", "--rdzv-id", "j", "--store-timeout", "0"], "--store-timeout: must be a number of seconds > 0"),
        (["cap", "--rdzv-id", "j", "--", "-1"], "Invalid value for 'replicas'"),
        (["cap", "many", "--rdzv-id", "j"], "Invalid value for 'replicas'"),
        (["yield", "0", "--rdzv-id", "j"], "Invalid value for 'count'"),
        (["events", "--follow", "--timeout", "0", "--rdzv-id", "j"], "--timeout: must be > 0 seconds"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], expected: str, capsys) -> None:
    code, out, err = ctl(capsys, *args)  # rejected before connecting: no store runs at the default endpoint
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyperpodctl: error: ") and expected in lines[0]
    assert out == ""


# --------------------------------------------------------------------------- real rendezvous, real process


def test_reads_what_a_real_rendezvous_writes(etcd_server: EtcdServer, capsys) -> None:
    """One decider agent forms round 1; status shows it; a cap lands where the decider reads it."""
    from hyperpodrun.config import RendezvousSettings
    from hyperpodrun.policy import ElasticPolicy
    from hyperpodrun.rendezvous.decider import DeciderContext
    from hyperpodrun.rendezvous.elastic import ElasticRendezvous
    from hyperpodrun.rendezvous.records import cap_of

    run_id = f"ctl-{uuid.uuid4().hex[:10]}"
    settings = RendezvousSettings(lease_ttl=5.0)
    store = create_store("etcd", etcd_server.endpoint, run_id=run_id, conf={}, timeout=settings.store_timeout)
    context = DeciderContext(
        policy=ElasticPolicy(min_replicas=1, max_replicas=1),
        nproc_per_node=2,
        max_restarts=0,
        lease_ttl=settings.lease_ttl,
        ack_timeout=settings.ack_timeout,
        propagation=settings.propagation,
        tick=settings.tick,
    )
    rdzv = ElasticRendezvous(store, context=context, local_addr="127.0.0.1", join_timeout=60.0, node_id="agent-0")
    try:
        rdzv.join()
        rnd = rdzv.next_round(timeout=60.0)
        assert rnd.round == 1 and rnd.members == ("agent-0",)
        flags = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id]
        # The job's own --rdzv-conf works unchanged: the rendezvous' settings are accepted and ignored.
        code, out, err = ctl(capsys, "status", "--json", *flags, "--rdzv-conf", "lease_ttl=5,timeout=60")
        assert code == 0, err
        data = json.loads(out)
        assert data["state"] == "running" and data["round"] == 1 and data["round_reason"] == "start"
        assert [(m["node_id"], m["addr"], m["state"]) for m in data["members"]] == [("agent-0", "127.0.0.1", "alive")]
        assert data["world_size"] == 2 and data["nproc_per_node"] == 2
        assert [h["what"] for h in data["history"]] == ["round 1: 1 node(s), world 2"]
        assert ctl(capsys, "yield", "1", *flags)[0] == 0
        assert json.loads(rdzv.store.get(CAP_KEY).value) == {"cap": 0}
        assert cap_of(rdzv.store.get(CAP_KEY).value) == 0  # what the decider reads
    finally:
        rdzv.shutdown(succeeded=True)


def test_python_dash_m_entry_point(job: Job) -> None:
    populate_running_job(job)
    proc = subprocess.run(
        [sys.executable, "-m", "hyperpodrun.ctl", "status", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(PET_RDZV_BACKEND=job.backend, PET_RDZV_ENDPOINT=job.endpoint, PET_RDZV_ID=job.run_id),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["round"] == 4
    version = subprocess.run(
        [sys.executable, "-m", "hyperpodrun.ctl", "--version"], capture_output=True, text=True, timeout=120
    )
    from hyperpodrun import __version__

    assert version.returncode == 0 and version.stdout.strip() == f"hyperpodctl {__version__}"


# --------------------------------------------------------------------------- the docs stay true to the code

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _table_rows(text: str) -> dict[str, list[str]]:
    """The cells of markdown table rows whose first cell is code, keyed by its first word."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0].replace("`", "").split(" ")[0]] = cells
    assert rows, "no table rows"
    return rows


def _shown(value: object) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def test_policy_reference_matches_the_code() -> None:
    import typer

    from hyperpodrun import cli
    from hyperpodrun.policy import ElasticPolicy
    from hyperpodrun.policy_file import FILE_KEYS

    rows = _table_rows((DOCS / "elastic_policy.md").read_text())
    flags = {o for p in typer.main.get_command(cli.app).params for o in p.opts}
    defaults = {f.name: f.default for f in dataclasses.fields(ElasticPolicy) if f.init}
    for key, name in FILE_KEYS.items():
        _, flag, default, _ = rows[key]
        expected = "required" if defaults[name] is dataclasses.MISSING else _shown(defaults[name])
        assert default == expected, (key, default, expected)
        documented_flag = flag.replace("`", "").split(" ")[0]
        if documented_flag == "file":
            assert f"--{name.replace('_', '-')}" not in flags, f"{key}: the CLI has a flag; document it"
        else:
            assert documented_flag in flags, f"{key}: documented flag {documented_flag} does not exist"


def test_rdzv_conf_reference_matches_the_code() -> None:
    from hyperpodrun.config import RendezvousSettings
    from hyperpodrun.store import STORE_CONF_KEYS

    rows = _table_rows((DOCS / "elastic_policy.md").read_text())
    for f in dataclasses.fields(RendezvousSettings):
        assert rows[f.name][1] == _shown(f.default), f.name
    documented = {k for cells in rows.values() for k in cells[0].replace("`", "").split(", ")}
    assert set(STORE_CONF_KEYS) <= documented
