"""Below the minimum the survivors hold the state (rendezvous/hold.py): the decider's rules, records in, writes out.

Before these rules, a leave below --nnodes MIN saved and halted every rank (a later node restarted
the job from the checkpoint), and a lost node below it stopped the survivors without a save (the job
restarted from step 1 when nothing was saved): the issue's Slurm run lost 120 steps that way.
"""

from __future__ import annotations

import json

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
    StoppedRecord,
)

NOW = 1_000.0


def ctx() -> DeciderContext:
    policy = ElasticPolicy(min_replicas=2, max_replicas=3, scaling_timeout=60.0, min_stable_period=60.0)
    return DeciderContext(
        policy=policy, nproc_per_node=1, max_restarts=3, lease_ttl=5.0, ack_timeout=30.0, propagation=1.0, tick=0.2
    )


def node(name: str, *, leaving: bool = False, parked: bool = False, can_hold: bool = True) -> NodeRecord:
    return NodeRecord(
        addr=f"10.0.0.{ord(name) - 96}",
        port=40000,
        nproc=1,
        leaving=leaving,
        parked=parked,
        reconfigurable=True,
        can_hold=can_hold,
    )


def rnd(*members: str, held: bool = False) -> RoundRecord:
    return RoundRecord(
        round=3,
        members=members,
        master_addr="10.0.0.1",
        master_port=40000,
        events=((NOW - 500, len(members)),),
        inprocess=True,
        held=held,
    )


def ack(step: int = 40) -> AckRecord:
    return AckRecord(step=step, step_time=0.0, cooperative=True, reconfigurable=True, port=41000)


def written(result) -> dict:
    (write,) = result.writes
    assert write.key == Keys.EVENT
    return json.loads(write.value)


def test_a_leave_below_the_minimum_moves_the_survivor_into_a_held_round() -> None:
    """Before: an INSUFFICIENT event without next members: every rank saved and exited, the round halted."""
    snap = JobSnapshot(nodes={"a": node("a"), "b": node("b", leaving=True)}, round=rnd("a", "b"))
    ev = written(plan(snap, DeciderMemory(), NOW, ctx()))
    assert (ev["kind"], ev["mode"], ev["next_members"], ev["hold"]) == ("leave", "restart", ["a"], True)


def test_survivors_that_cannot_hold_save_and_halt_as_before() -> None:
    snap = JobSnapshot(nodes={"a": node("a", can_hold=False), "b": node("b", leaving=True)}, round=rnd("a", "b"))
    ev = written(plan(snap, DeciderMemory(), NOW, ctx()))
    assert (ev["kind"], ev["mode"], ev["next_members"], ev["hold"]) == ("insufficient", "restart", None, False)


def test_a_lost_node_below_the_minimum_is_repaired_into_a_held_round_not_stopped() -> None:
    """Before: the repair left the lost node out, found 1 node not an allowed size, and stopped the survivor."""
    repair = EventRecord(
        id=4,
        round=3,
        kind=EventKind.NODE_LOST,
        mode=EventMode.RECONFIGURE,
        next_members=("a", "b"),
        reason="peer failure",
        decided_at=NOW - 2.0,
    )
    snap = JobSnapshot(
        nodes={"a": node("a")},  # b's lease expired
        round=rnd("a", "b"),
        event=repair,
        acks={"a": ack()},
        failed={"a": FailedRecord(message="a collective failed", repairable=True, peer=True)},
    )
    ev = written(plan(snap, DeciderMemory(), NOW, ctx()))
    assert (ev["target"], ev["next_members"], ev["hold"]) == (0, ["a"], True)
    assert "hold the state" in ev["reason"]


def test_a_node_gone_without_a_failure_report_below_the_minimum_is_held_not_stopped() -> None:
    """Its lease expired before any collective failed (the survivors were between steps): WAIT_FOR_LOST,
    and re-forming the group without it leaves too few nodes. Before: a STOP event, nothing saved."""
    snap = JobSnapshot(nodes={"a": node("a")}, round=rnd("a", "b"))
    ev = written(plan(snap, DeciderMemory(lost_since={"b": NOW - 1.0}), NOW, ctx()))
    assert (ev["kind"], ev["mode"], ev["next_members"], ev["hold"]) == ("node_lost", "reconfigure", ["a"], True)


def test_the_held_round_is_published_held() -> None:
    ev = EventRecord(
        id=4,
        round=3,
        kind=EventKind.LEAVE,
        mode=EventMode.RECONFIGURE,
        next_members=("a",),
        reason="r",
        decided_at=NOW - 2.0,
        target=57,
        hold=True,
    )
    snap = JobSnapshot(
        nodes={"a": node("a")}, round=rnd("a", "b"), event=ev, stopped={"a": StoppedRecord(ok=True, reconfigured=True)}
    )
    result = plan(snap, DeciderMemory(), NOW, ctx())
    published = json.loads(next(w.value for w in result.writes if w.key == Keys.ROUND))
    assert (published["round"], published["members"], published["held"]) == (4, ["a"], True)
    assert "holds the state below the minimum" in result.notes[0].what


def test_a_held_round_waits_for_nodes_without_an_event() -> None:
    snap = JobSnapshot(nodes={"a": node("a")}, round=rnd("a", held=True))
    result = plan(snap, DeciderMemory(), NOW, ctx())
    assert result.writes == () and "holds the state" in result.waiting_for


def test_a_parked_standby_refills_a_held_round_at_once_in_place() -> None:
    """No scaling_timeout and no stable period (both 60 s here): the state waits in memory; no step to agree on."""
    snap = JobSnapshot(nodes={"a": node("a"), "c": node("c", parked=True)}, round=rnd("a", held=True))
    ev = written(plan(snap, DeciderMemory(first_seen={"c": NOW}), NOW, ctx()))
    assert (ev["kind"], ev["mode"], ev["next_members"], ev["hold"]) == ("join", "reconfigure", ["a", "c"], False)
    targeted = JobSnapshot(
        nodes=snap.nodes, round=snap.round, event=EventRecord(**{**_record(ev), "decided_at": NOW}), acks={"a": ack()}
    )
    ev = written(plan(targeted, DeciderMemory(), NOW, ctx()))  # step rate unknown (0): not waited for
    assert (ev["target"], ev["mode"], ev["master_addr"]) == (0, "reconfigure", "10.0.0.1")


def test_members_leave_a_held_round_and_the_last_one_ends_it() -> None:
    three = DeciderContext(**{**ctx().__dict__, "policy": ElasticPolicy(min_replicas=3, max_replicas=3)})
    some = JobSnapshot(nodes={"a": node("a"), "b": node("b", leaving=True)}, round=rnd("a", "b", held=True))
    ev = written(plan(some, DeciderMemory(), NOW, three))
    assert (ev["kind"], ev["mode"], ev["next_members"], ev["hold"]) == ("leave", "reconfigure", ["a"], True)
    every = JobSnapshot(nodes={"a": node("a", leaving=True)}, round=rnd("a", held=True))
    ev = written(plan(every, DeciderMemory(), NOW, three))
    assert (ev["kind"], ev["mode"], ev["next_members"], ev["hold"]) == ("insufficient", "reconfigure", [], False)


def test_a_lost_member_of_a_held_round_halts_the_job_on_its_checkpoint() -> None:
    snap = JobSnapshot(nodes={"a": node("a")}, round=rnd("a", "b", held=True))
    ev = written(plan(snap, DeciderMemory(), NOW, ctx()))
    assert (ev["kind"], ev["mode"], ev["next_members"]) == ("insufficient", "stop", None)
    assert "checkpoint saved at the hold" in ev["reason"]


def _record(ev: dict) -> dict:
    tuples = {"next_members"}
    return {
        k: (
            tuple(v)
            if k in tuples and v is not None
            else EventKind(v)
            if k == "kind"
            else EventMode(v)
            if k == "mode"
            else v
        )
        for k, v in ev.items()
    }
