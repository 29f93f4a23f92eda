"""The decider measures every duration on its own clock: a record's time written by another node
(another decider, skewed by minutes) never shortens or lengthens a wait, and a rank failure every
member answered is reported without waiting a lease ttl. Each test failed on the code that
compared ``now`` with ``decided_at``, ``halted_at`` and the rounds' recorded times."""

from __future__ import annotations

import json
import time

import pytest

from hyperpodrun.policy import ElasticPolicy
from hyperpodrun.rendezvous.decider import DeciderContext, DeciderMemory, JobSnapshot, plan
from hyperpodrun.rendezvous.records import (
    AckRecord,
    EventKind,
    EventMode,
    EventRecord,
    FailedRecord,
    Keys,
    NodeRecord,
    RoundRecord,
    RoundState,
    StoppedRecord,
    decode,
    evolve,
)

NOW = 5_000.0
SKEW = 600.0


def ctx(**policy) -> DeciderContext:
    base = dict(min_replicas=1, max_replicas=3, scaling_timeout=0.0, min_stable_period=0.0)
    return DeciderContext(
        policy=ElasticPolicy(**{**base, **policy}),
        nproc_per_node=1,
        max_restarts=0,
        lease_ttl=10.0,
        ack_timeout=30.0,
        propagation=1.0,
        tick=0.2,
    )


def node(name: str) -> NodeRecord:
    return NodeRecord(addr=f"10.0.0.{ord(name) - 96}", port=40000, nproc=1)


def event(decided_at: float, **kw) -> EventRecord:
    base = dict(id=7, round=2, kind=EventKind.JOIN, mode=EventMode.RESTART, next_members=("a", "b"), reason="r")
    return EventRecord(decided_at=decided_at, **{**base, **kw})


def round_of(*members: str, events=((NOW - 1000.0, 1),), **kw) -> RoundRecord:
    return RoundRecord(round=2, members=members, master_addr="10.0.0.1", master_port=40000, events=events, **kw)


def written(plan_) -> list[dict]:
    return [json.loads(w.value) for w in plan_.writes]


@pytest.mark.parametrize("skew", [SKEW, -SKEW], ids=["writer-ahead", "writer-behind"])
def test_the_ack_timeout_runs_on_the_deciders_clock_whatever_the_writers_clock_said(skew: float) -> None:
    """A decider 600 s behind the event's writer waited 630 s for a missing ack; 600 s ahead, it gave up at once."""
    snap = JobSnapshot(
        nodes={"a": node("a"), "b": node("b")},
        round=round_of("a", "b"),
        event=event(NOW + skew, kind=EventKind.YIELD, next_members=("a",)),
        acks={"a": AckRecord(step=5, step_time=0.1, cooperative=True)},
    )
    first = plan(snap, DeciderMemory(), NOW, ctx())
    assert first.writes == ()  # took over the event now: the 30 s ack timeout starts now
    assert plan(snap, first.memory, NOW + 29.0, ctx()).writes == ()
    (stop,) = written(plan(snap, first.memory, NOW + 31.0, ctx()))
    assert stop["mode"] == "stop" and "no ack from ['b'] within 30s" in stop["reason"]


def test_a_target_step_is_not_pushed_late_by_a_writer_whose_clock_was_behind() -> None:
    """600 s between the event's writer and the decider made a target 6,000 steps late at 0.1 s per step."""
    acks = {m: AckRecord(step=100, step_time=0.1, cooperative=True) for m in ("a", "b")}
    snap = JobSnapshot(
        nodes={"a": node("a"), "b": node("b")}, round=round_of("a", "b"), event=event(NOW - SKEW), acks=acks
    )
    (targeted,) = written(plan(snap, DeciderMemory(), NOW, ctx()))
    # 1 s of propagation plus at most the 0.9 s re-ack interval of an ack it never watched, at 0.1 s per step
    assert targeted["target"] == 100 + 2 + 19


def test_the_stop_deadline_of_an_event_runs_on_the_deciders_clock() -> None:
    """Members that never report their ranks stopped are waited for graceful + ack timeout, measured here."""
    ev = event(NOW + SKEW, mode=EventMode.STOP, target=-1, kind=EventKind.YIELD, next_members=("a",))
    snap = JobSnapshot(nodes={"a": node("a"), "b": node("b")}, round=round_of("a", "b"), event=ev)
    memory = plan(snap, DeciderMemory(), NOW, ctx(graceful_shutdown_timeout=10.0)).memory
    assert plan(snap, memory, NOW + 39.0, ctx(graceful_shutdown_timeout=10.0)).writes == ()
    complete, _ = written(plan(snap, memory, NOW + 41.0, ctx(graceful_shutdown_timeout=10.0)))
    assert complete["complete"] is True


def test_a_scale_up_waits_the_stable_period_from_when_this_decider_saw_the_round() -> None:
    """The last round's start, written 600 s 'in the future' by a skewed decider, held scale-ups for 10 minutes."""
    policy = dict(min_stable_period=60.0)
    snap = JobSnapshot(
        nodes={"a": node("a"), "b": node("b")}, round=round_of("a", events=((NOW + SKEW, 1),)), event=None
    )
    first = plan(snap, DeciderMemory(), NOW, ctx(**policy))
    assert first.writes == ()  # the round is new to this decider: its stable period starts now
    (join,) = written(plan(snap, first.memory, NOW + 61.0, ctx(**policy)))
    assert join["kind"] == "join" and join["next_members"] == ["a", "b"]


def test_recorded_scale_events_keep_their_spacing_and_order_on_the_deciders_clock() -> None:
    from hyperpodrun.rendezvous.local_time import round_key, scale_events

    rnd = round_of("a", events=((100.0, 1), (40.0, 2), (130.0, 1)))  # written by deciders with different clocks
    events = scale_events(rnd, {round_key(2): NOW}, NOW + 5)
    assert [e.at for e in events] == [NOW - 90.0, NOW - 90.0, NOW]  # in order, the newest when first seen
    assert [e.replicas for e in events] == [1, 2, 1]


def _failed_round() -> JobSnapshot:
    failure = FailedRecord(message="rank 1 exited with code 1")
    return JobSnapshot(nodes={"a": node("a"), "b": node("b")}, round=round_of("a", "b"), failed={"b": failure})


def test_a_rank_failure_every_member_answered_closes_the_job_at_once() -> None:
    """A failure was reported only after one lease ttl (10 s), as a rendezvous timeout with a short join timeout."""
    (stop,) = written(plan(_failed_round(), DeciderMemory(), NOW, ctx()))
    assert (stop["kind"], stop["mode"]) == ("rank_failure", "stop")
    ev = decode(EventRecord, Keys.EVENT, json.dumps(stop).encode())
    answered = JobSnapshot(
        nodes={"a": node("a"), "b": node("b")},
        round=round_of("a", "b"),
        event=ev,
        stopped={m: StoppedRecord(ok=False) for m in ("a", "b")},
    )
    complete, halted = written(plan(answered, DeciderMemory(), NOW + 0.4, ctx()))
    assert complete["complete"] and halted["state"] == "halted" and halted["failure_answered"] is True
    after = JobSnapshot(
        nodes=answered.nodes,
        round=decode(RoundRecord, Keys.ROUND, json.dumps(halted).encode()),
        event=evolve(ev, complete=True),
    )
    (closed,) = written(plan(after, DeciderMemory(), NOW + 0.6, ctx()))
    assert closed == {"status": "failed", "message": "rank 1 exited with code 1"}


def test_a_failure_a_member_did_not_answer_still_waits_a_lease_ttl_measured_here() -> None:
    """A member that never answered may be a lost node whose loss killed the rank: wait to tell."""
    halted = round_of(
        "a", "b", state=RoundState.HALTED, halt_kind=EventKind.RANK_FAILURE, failure="boom", halted_at=NOW - 999
    )
    snap = JobSnapshot(nodes={"a": node("a"), "b": node("b")}, round=halted)
    first = plan(snap, DeciderMemory(), NOW, ctx())
    assert first.writes == ()  # halted_at 999 s ago on another clock: not a reason to skip the wait
    (closed,) = written(plan(snap, first.memory, NOW + 10.3, ctx()))
    assert closed["status"] == "failed"


def test_the_deciders_clock_is_the_monotonic_one() -> None:
    """The decider measures its timers on it; records carry wall-clock times only for people to read."""
    from hyperpodrun.rendezvous.elastic import ElasticRendezvous

    rdzv = ElasticRendezvous(None, context=ctx(), local_addr="127.0.0.1", join_timeout=1.0, node_id="a")  # type: ignore[arg-type]
    assert abs(rdzv.clock() - time.monotonic()) < 1.0
