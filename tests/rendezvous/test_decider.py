"""The decider's protocol as a pure function: records and a time in, compare-and-swap writes out.

Each defect of the old protocol has a test here that failed on the code before the fix
(named in the docstring); none sleeps or pads a step.
"""

from __future__ import annotations

import json

import pytest

from elastic_events.control import ControlReader, ControlWriter
from elastic_events.control import EventKind as ChannelKind
from hyperpodrun.config import RestartMode
from hyperpodrun.policy import ElasticPolicy
from hyperpodrun.progress import LateRanks, StepRates, missed_target
from hyperpodrun.rendezvous.api import LocalStatus
from hyperpodrun.rendezvous.decider import DeciderContext, DeciderMemory, JobSnapshot, plan
from hyperpodrun.rendezvous.local_time import event_key, made_key
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
)
from hyperpodrun.supervisor import WorkerState

NOW = 1_000.0


def ctx(**kw) -> DeciderContext:
    policy = ElasticPolicy(min_replicas=1, max_replicas=3, scaling_timeout=0.0, min_stable_period=0.0)
    base = dict(
        policy=policy, nproc_per_node=2, max_restarts=0, lease_ttl=5.0, ack_timeout=30.0, propagation=1.0, tick=0.2
    )
    return DeciderContext(**{**base, **kw})


def node(name: str, *, port: int = 40000, leaving: bool = False, parked: bool = False) -> NodeRecord:
    return NodeRecord(addr=f"10.0.0.{ord(name[-1]) - 96}", port=port, nproc=2, leaving=leaving, parked=parked)


def running(*members: str, round_no: int = 3) -> RoundRecord:
    return RoundRecord(
        round=round_no, members=members, master_addr="10.0.0.1", master_port=40000, events=((NOW - 100, len(members)),)
    )


def event(
    *, next_members=("a", "b"), target=None, mode=EventMode.RESTART, kind=EventKind.JOIN, decided_at=NOW - 1.0
) -> EventRecord:
    return EventRecord(
        id=5, round=3, kind=kind, mode=mode, next_members=next_members, reason="r", decided_at=decided_at, target=target
    )


def watching(*events: EventRecord) -> DeciderMemory:
    """The memory of the decider that made ``events`` at their ``decided_at`` (on its own clock)."""
    seen = {key(ev.id): ev.decided_at for ev in events for key in (event_key, made_key)}
    return DeciderMemory(seen=seen)


def decoded(write) -> dict:
    return json.loads(write.value)


def evolve_event(record: dict) -> EventRecord:
    return decode(EventRecord, Keys.EVENT, json.dumps(record).encode())


def ack(step: int, step_time: float, **kw) -> AckRecord:
    return AckRecord(
        step=step, step_time=step_time, cooperative=kw.pop("cooperative", True), port=kw.pop("port", 41000), **kw
    )


# --------------------------------------------------------------------------- target step


def test_target_waits_for_unknown_step_rates_instead_of_guessing() -> None:
    """Defect 2: with one member's rate unknown the old code set the target 10,000 steps ahead."""
    snap = JobSnapshot(
        nodes={"a": node("a"), "b": node("b")}, round=running("a"), event=event(), acks={"a": ack(7, 0.0)}
    )
    assert plan(snap, watching(snap.event), NOW, ctx()).writes == ()  # deferred, bounded by ack_timeout
    known = JobSnapshot(nodes=snap.nodes, round=snap.round, event=snap.event, acks={"a": ack(9, 0.1)})
    (write,) = plan(known, watching(snap.event), NOW, ctx()).writes
    # 1 s of propagation plus the 1 s since the decision, at 0.1 s per step: 20 steps of margin
    assert write.key == Keys.EVENT and decoded(write)["target"] == 9 + 2 + 20


def test_a_target_is_budgeted_from_the_newest_acks_when_the_decider_watched_them_arrive() -> None:
    """Found by CI: a join waited seconds for the joiner to park, then took the target from node a's first ack
    plus all the time since the decision, at the step rate of the joiner's busy start-up; once the joiner was
    parked, a's rank ran several times faster and passed the target before its agent wrote it. Members now
    re-ack while an event waits; an ack the decider saw arrive is at most a tick old, whatever the event's age."""
    parked = {"a": node("a"), "b": node("b", parked=True)}
    old = event(next_members=("a", "b"), decided_at=NOW - 8.0)
    first = JobSnapshot(
        nodes={"a": node("a"), "b": node("b")},
        round=running("a"),
        event=old,
        acks={"a": ack(100, 0.01, reconfigurable=True)},
    )
    waiting = plan(first, watching(old), NOW - 5.0, ctx())  # b is not parked yet: wait, and note a's ack
    assert waiting.writes == () and waiting.memory.acks_seen == {"a": (5, 0, NOW - 5.0)}
    fresh = JobSnapshot(
        nodes=parked, round=running("a"), event=old, acks={"a": ack(900, 0.002, reconfigurable=True, seq=9)}
    )
    (write,) = plan(fresh, waiting.memory, NOW, ctx()).writes
    # 1 s of propagation plus a tick, at the fastest 2 ms per step: 600 steps past 900, not 8 s worth (4,500)
    assert decoded(write)["target"] == 900 + 2 + 600
    stale = JobSnapshot(nodes=parked, round=running("a"), event=old, acks={"a": ack(100, 0.01, reconfigurable=True)})
    (write,) = plan(stale, waiting.memory, NOW, ctx()).writes  # the same ack, seen 5 s ago: budget its age
    assert decoded(write)["target"] == 100 + 2 + 620
    (write,) = plan(fresh, watching(old), NOW, ctx()).writes  # made the event, never watched the ack: its age
    assert decoded(write)["target"] == 900 + 2 + 4500
    (write,) = plan(fresh, DeciderMemory(), NOW, ctx()).writes  # took over: at most the re-ack interval (0.9 s)
    assert decoded(write)["target"] == 900 + 2 + 950


def test_an_event_whose_members_all_lapsed_stops_instead_of_targeting() -> None:
    """Found under load: every member's lease had lapsed, the standby deciding crashed on no acks."""
    snap = JobSnapshot(nodes={"c": node("c")}, round=running("a"), event=event(next_members=("a", "c")))
    (write,) = plan(snap, DeciderMemory(), NOW, ctx()).writes
    assert decoded(write)["mode"] == "stop" and decoded(write)["target"] == -1


def test_a_rate_that_never_becomes_known_is_waited_for_a_bounded_time() -> None:
    """Ranks held still (a test's gate, a long first step) report no rate; waiting the whole ack
    timeout for one outlasted such holds, and the job went on without its event."""
    held = JobSnapshot(
        nodes={"a": node("a")},
        round=running("a"),
        event=event(next_members=("a",), decided_at=NOW - 2.9),
        acks={"a": ack(4, 0.0)},
    )
    assert plan(held, watching(held.event), NOW, ctx()).writes == ()  # within 3 propagation budgets: wait
    snap = JobSnapshot(
        nodes={"a": node("a")},
        round=running("a"),
        event=event(next_members=("a",), decided_at=NOW - 3.1),
        acks={"a": ack(4, 0.0)},
    )
    (write,) = plan(snap, watching(snap.event), NOW, ctx()).writes
    assert decoded(write)["target"] == 4 + 2 + 2  # steps take at least 3 s: (1 + 3.1) / 3 -> a margin of two steps


def test_step_rate_is_the_fastest_recent_interval_so_a_checkpoint_step_does_not_shrink_the_margin() -> None:
    """Defect 2: the old rate came from the last interval alone; a 5 s checkpoint step made ranks look slow."""
    from elastic_events.control import RankProgress

    rates = StepRates(1)
    for step, t in [(1, 0.0), (2, 0.1), (3, 0.2), (4, 5.2)]:  # the last step saved a checkpoint
        steps, times = rates.update([RankProgress(step=step, time=100.0 + t, acked_event=0)])
    assert steps == (4,) and times == (pytest.approx(0.1),)


def test_a_node_is_cooperative_only_when_every_local_rank_calls_the_api() -> None:
    """Defect 3: one rank of a node calling elastic_event_detected() made the whole node count."""
    assert not LocalStatus(group_state=WorkerState.HEALTHY, steps=(12, 0), step_times=(0.1, 0.0)).cooperative
    assert LocalStatus(group_state=WorkerState.HEALTHY, steps=(12, 11), step_times=(0.1, 0.1)).cooperative
    snap = JobSnapshot(
        nodes={"a": node("a")},
        round=running("a"),
        event=event(next_members=("a",)),
        acks={"a": ack(12, 0.1, cooperative=False)},
    )
    (write,) = plan(snap, DeciderMemory(), NOW, ctx()).writes
    assert decoded(write)["mode"] == "stop" and decoded(write)["target"] == -1


def test_a_rank_that_passed_the_target_before_it_was_published_is_detected(tmp_path) -> None:
    """Defect 1: a rank past the target when it was written never saw the event and the job stalled."""
    writer = ControlWriter(tmp_path / "ctl", nproc=2)
    ranks = [ControlReader(tmp_path / "ctl", r) for r in range(2)]
    for _ in range(10):  # both ranks at step 10 when the agent read progress ...
        for r in ranks:
            r.check()
    ranks[1].check()  # ... and rank 1 took step 11 before the agent wrote target 11
    writer.publish(event_id=5, target_step=11, kind=ChannelKind.SAVE_AND_EXIT, round=4, world_size=4)
    assert missed_target(writer.progress(), 5, 11) == [1]
    assert ranks[0].check() is True  # rank 0 acts at step 11 ...
    assert missed_target(writer.progress(), 5, 11) == [1]  # ... which does not hide rank 1's miss


@pytest.mark.parametrize(
    ("mode", "kind"), [(EventMode.RECONFIGURE, "reconfigure"), (EventMode.RESTART, "save_and_exit")]
)
def test_a_member_whose_ranks_outran_the_target_still_publishes_it(mode, kind) -> None:
    """Found by CI: a CPU freed by the joiner's start-up tripled the step rate, the rank passed the target
    before its agent learnt it, and the member turned the in-place join into a restart from scratch."""
    from hyperpodrun.rendezvous.elastic import ElasticRendezvous

    rdzv = ElasticRendezvous(None, context=ctx(), local_addr="10.0.0.1", join_timeout=1.0, node_id="a")  # type: ignore[arg-type]
    targeted = EventRecord(
        **{
            **event(next_members=("a", "c"), target=40, mode=mode).__dict__,
            "master_addr": "10.0.0.1",
            "master_port": 41000,
        }
    )
    status = LocalStatus(group_state=WorkerState.HEALTHY, steps=(52, 51), step_times=(0.001, 0.001))
    directive = rdzv._follow_event(targeted, status)
    assert (directive.kind.value, directive.target_step, directive.event_id) == (
        kind,
        40,
        5,
    )  # the ranks act one step late


def test_a_member_re_acks_with_its_fresh_step_while_the_event_waits_to_be_targeted() -> None:
    from hyperpodrun.rendezvous.elastic import ElasticRendezvous

    class Puts:
        def __init__(self) -> None:
            self.acks: list[AckRecord] = []

        def put(self, key: str, value: bytes, **_) -> int:
            self.acks.append(decode(AckRecord, key, value))
            return len(self.acks)

    store, now = Puts(), [NOW]
    rdzv = ElasticRendezvous(
        store, context=ctx(), local_addr="127.0.0.1", join_timeout=1.0, node_id="a", clock=lambda: now[0]
    )  # type: ignore[arg-type]
    waiting = event(next_members=("a", "c"))
    for t, step in [
        (0.0, 10),
        (0.3, 40),
        (0.6, 70),
        (1.3, 140),
    ]:  # polled every tick; propagation 1 s: re-ack every 0.5 s
        now[0] = NOW + t
        rdzv._follow_event(waiting, LocalStatus(group_state=WorkerState.HEALTHY, steps=(step,), step_times=(0.01,)))
    assert [(a.seq, a.step) for a in store.acks] == [(0, 10), (1, 70), (2, 140)]
    assert len({a.port for a in store.acks}) == 1  # the port it offers for the next round stays the same


def test_ranks_that_were_all_past_the_target_act_together_at_their_next_step(tmp_path) -> None:
    writer = ControlWriter(tmp_path / "ctl", nproc=2)
    ranks = [ControlReader(tmp_path / "ctl", r) for r in range(2)]
    for _ in range(10):
        for r in ranks:
            r.check()
    writer.publish(
        event_id=5,
        target_step=8,
        kind=ChannelKind.RECONFIGURE,
        round=4,
        world_size=2,
        group_rank=0,
        group_world_size=1,
        master_addr="10.0.0.1",
        master_port=41000,
    )
    late = LateRanks.after_publish(5, missed_target(writer.progress(), 5, 8), now=NOW, slowest_step_s=0.001)
    assert late is not None and late.ranks == (0, 1) and late.stuck(writer.progress(), NOW) is None
    assert [r.check() for r in ranks] == [True, True]  # both at step 11
    assert late.stuck(writer.progress(), NOW + 0.01) == []  # resolved: the event goes on in place


def test_a_late_rank_behind_one_that_acted_in_time_stops_the_event_after_a_grace(tmp_path) -> None:
    """Rank 1 checked step 11 just before target 11 was written, rank 0 just after: rank 0 acts and
    leaves the group, rank 1 waits in step 12's collective for it and never checks again."""
    writer = ControlWriter(tmp_path / "ctl", nproc=2)
    ranks = [ControlReader(tmp_path / "ctl", r) for r in range(2)]
    for _ in range(10):
        for r in ranks:
            r.check()
    ranks[1].check()
    writer.publish(event_id=5, target_step=11, kind=ChannelKind.SAVE_AND_EXIT, round=4, world_size=4)
    late = LateRanks.after_publish(5, missed_target(writer.progress(), 5, 11), now=NOW, slowest_step_s=0.5)
    assert ranks[0].check() is True
    assert late.stuck(writer.progress(), NOW + 1.9) is None  # four step times of 0.5 s: still waiting
    assert late.stuck(writer.progress(), NOW + 2.1) == [1]  # the agent stops the event
    assert LateRanks.after_publish(5, [], now=NOW, slowest_step_s=0.5) is None  # nobody late: nothing to watch


def test_reconfigure_mode_only_when_every_member_declared_the_in_process_api() -> None:
    acks = {"a": ack(3, 0.1, reconfigurable=True), "b": ack(3, 0.1, reconfigurable=False)}
    snap = JobSnapshot(
        nodes={"a": node("a"), "b": node("b"), "c": node("c")},
        round=running("a", "b"),
        event=event(next_members=("a", "b", "c")),
        acks=acks,
    )
    assert decoded(plan(snap, DeciderMemory(), NOW, ctx()).writes[0])["mode"] == "restart"
    all_in = {k: AckRecord(**{**v.__dict__, "reconfigurable": True}) for k, v in acks.items()}
    snap = JobSnapshot(nodes=snap.nodes, round=snap.round, event=snap.event, acks=all_in)
    assert plan(snap, DeciderMemory(), NOW, ctx()).writes == ()  # joiner c's ranks are not parked yet: wait
    snap = JobSnapshot(
        nodes={**snap.nodes, "c": node("c", parked=True)}, round=snap.round, event=snap.event, acks=all_in
    )
    written = decoded(plan(snap, DeciderMemory(), NOW, ctx()).writes[0])
    assert written["mode"] == "reconfigure" and (written["master_addr"], written["master_port"]) == ("10.0.0.1", 41000)
    forced = decoded(plan(snap, DeciderMemory(), NOW, ctx(restart_mode=RestartMode.PROCESS)).writes[0])
    assert forced["mode"] == "restart"


# --------------------------------------------------------------------------- next round


def test_a_next_member_killed_during_the_save_is_never_published() -> None:
    """Defect 4: the old decider published the precomputed membership, dead node included."""
    snap = JobSnapshot(
        nodes={"a": node("a")},  # b's lease expired while the ranks were saving
        round=running("a", "b"),
        event=event(target=40),
        stopped={"a": StoppedRecord(ok=True)},
    )
    writes = plan(snap, DeciderMemory(), NOW, ctx()).writes
    assert [w.key for w in writes] == [Keys.EVENT, Keys.ROUND]
    halted = decoded(writes[1])
    assert halted["state"] == RoundState.HALTED.value and halted["halt_kind"] == EventKind.NODE_LOST.value
    # the next tick's start rules form the round from the live nodes only
    after = JobSnapshot(
        nodes=snap.nodes,
        round=RoundRecord(
            **{
                **running("a", "b").__dict__,
                "state": RoundState.HALTED,
                "halt_kind": EventKind.NODE_LOST,
                "halted_at": NOW,
            }
        ),
        event=EventRecord(**{**snap.event.__dict__, "complete": True}),
    )
    policy = ElasticPolicy(
        min_replicas=1, max_replicas=3, scaling_timeout=0.0, min_stable_period=0.0, faulty_scale_down_timeout=0.0
    )
    (write,) = plan(after, DeciderMemory(lost_since={"b": NOW - 1}), NOW, ctx(policy=policy)).writes
    assert decoded(write)["members"] == ["a"] and decoded(write)["state"] == "running"


def test_each_round_gets_the_port_its_head_published_for_it() -> None:
    """Defect 5: the port chosen at join was reused for every round (a collision repeated on every restart)."""
    snap = JobSnapshot(
        nodes={"a": node("a", port=45001), "b": node("b", port=45002)},
        round=running("a", "b"),
        event=event(next_members=("a", "b"), target=40),
        stopped={"a": StoppedRecord(ok=True), "b": StoppedRecord(ok=True)},
    )
    nxt = decoded(plan(snap, DeciderMemory(), NOW, ctx()).writes[1])
    assert (nxt["round"], nxt["master_addr"], nxt["master_port"]) == (4, "10.0.0.1", 45001)
    assert nxt["master_port"] != running("a", "b").master_port


def test_a_joiner_whose_lease_lapses_mid_reconfiguration_is_waited_for_one_lease_ttl_then_stops_the_event() -> None:
    """Found in a loaded test run: the joiner's agent missed its keep-alives, its lease lapsed and it registered
    again 0.3 s later, but the in-place join had been stopped at once and every rank restarted."""
    gone = JobSnapshot(
        nodes={"a": node("a")},
        round=running("a"),
        event=event(next_members=("a", "c"), target=40, mode=EventMode.RECONFIGURE),
    )
    waiting = plan(gone, DeciderMemory(), NOW, ctx())
    assert waiting.writes == () and "one lease ttl" in waiting.waiting_for
    back = JobSnapshot(**{**gone.__dict__, "nodes": {"a": node("a"), "c": node("c")}})
    assert all(
        w.key != Keys.EVENT or decoded(w)["mode"] != "stop" for w in plan(back, waiting.memory, NOW + 1, ctx()).writes
    )
    (write,) = plan(gone, waiting.memory, NOW + 5.0, ctx()).writes  # still gone one lease ttl later
    assert decoded(write)["mode"] == "stop" and "vanished" in decoded(write)["reason"]
    failed = JobSnapshot(**{**gone.__dict__, "failed": {"a": FailedRecord(message="x", repairable=True, peer=True)}})
    (write,) = plan(failed, DeciderMemory(), NOW, ctx()).writes  # a failed collective: no reason to wait
    assert decoded(write)["mode"] == "stop"


def test_stop_event_waits_for_every_live_member_then_halts() -> None:
    snap = JobSnapshot(
        nodes={"a": node("a"), "b": node("b")},
        round=running("a", "b"),
        event=event(mode=EventMode.STOP, next_members=None, kind=EventKind.RANK_FAILURE),
        stopped={"a": StoppedRecord(ok=False)},
    )
    assert plan(snap, DeciderMemory(), NOW, ctx()).writes == ()
    done = JobSnapshot(**{**snap.__dict__, "stopped": {"a": StoppedRecord(ok=False), "b": StoppedRecord(ok=False)}})
    writes = plan(done, DeciderMemory(), NOW, ctx()).writes
    assert decoded(writes[1])["halt_kind"] == "rank_failure"


@pytest.mark.parametrize(
    ("leaving", "standbys", "cap", "kind"),
    [(False, ("c",), None, "join"), (True, (), None, "leave"), (False, (), 1, "yield")],
)
def test_the_event_says_why(leaving: bool, standbys: tuple[str, ...], cap: int | None, kind: str) -> None:
    nodes = {"a": node("a"), "b": node("b", leaving=leaving), **{s: node(s) for s in standbys}}
    snap = JobSnapshot(nodes=nodes, round=running("a", "b"), cap=cap)
    mem = DeciderMemory(first_seen={n: NOW - 100 for n in nodes}, capacity_since=NOW - 100)
    (write,) = plan(snap, mem, NOW, ctx()).writes
    assert write.key == Keys.EVENT and decoded(write)["kind"] == kind and decoded(write)["mode"] == "restart"


def test_an_in_place_node_polling_between_the_deciders_two_writes_keeps_its_ranks() -> None:
    """Found by the soak (yield then uncap): the event was complete, the round not yet published, and the
    freshly admitted node stopped its ranks; the others then hung in a group missing it."""
    from hyperpodrun.rendezvous.api import Directive, DirectiveKind
    from hyperpodrun.rendezvous.elastic import ElasticRendezvous

    rdzv = ElasticRendezvous(None, context=ctx(), local_addr="10.0.0.3", join_timeout=1.0, node_id="c")  # type: ignore[arg-type]
    rdzv.entered_in_place(
        Directive(
            kind=DirectiveKind.RECONFIGURE,
            event_id=5,
            next_round=4,
            group_rank=1,
            group_world_size=2,
            master_addr="10.0.0.1",
            master_port=41000,
            members=("a", "c"),
        )
    )
    done = EventRecord(
        **{**event(next_members=("a", "c"), target=40, mode=EventMode.RECONFIGURE).__dict__, "complete": True}
    )
    assert rdzv._left_behind(running("a"), done, 4) is None  # round 3 still current: the decider is mid-publish
    assert rdzv._left_behind(running("a", "c", round_no=4), done, 4) is None  # published
    halted = RoundRecord(**{**running("a").__dict__, "state": RoundState.HALTED, "halt_kind": EventKind.NODE_LOST})
    assert rdzv._left_behind(halted, done, 4).kind is DirectiveKind.STOP  # never published: stop
    assert (
        rdzv._left_behind(running("a", "c", round_no=5), None, 4).kind is DirectiveKind.STOP
    )  # fell back to a restart


# --------------------------------------------------------------------------- failures repaired in place


def in_process(*members: str, restarts: int = 0) -> RoundRecord:
    return RoundRecord(
        round=3,
        members=members,
        master_addr="10.0.0.1",
        master_port=40000,
        events=((NOW - 100, len(members)),),
        inprocess=True,
        restarts=restarts,
    )


@pytest.mark.parametrize(
    ("inprocess", "repairable", "restarts", "mode"),
    [
        (True, True, 0, "reconfigure"),  # repaired in place, at once
        (True, False, 0, "stop"),  # the node could not restart its rank parked
        (False, True, 0, "stop"),  # some rank does not use the in-process API
        (True, True, 3, "stop"),  # --max-restarts used up: the job fails as torchrun's would
    ],
)
def test_a_rank_failure_is_repaired_in_place_only_where_it_can_be(
    inprocess: bool, repairable: bool, restarts: int, mode: str
) -> None:
    rnd = in_process("a", "b", restarts=restarts) if inprocess else running("a", "b")
    snap = JobSnapshot(
        nodes={"a": node("a"), "b": node("b")},
        round=rnd,
        failed={"b": FailedRecord(message="rank 3 killed", repairable=repairable)},
    )
    (write,) = plan(snap, DeciderMemory(), NOW, ctx(max_restarts=3)).writes
    ev = decoded(write)
    assert (ev["kind"], ev["mode"]) == ("rank_failure", mode)
    assert ev["next_members"] == (["a", "b"] if mode == "reconfigure" else None)


def test_a_repair_is_targeted_at_once_on_a_fresh_port_of_a_surviving_head() -> None:
    """No step to agree on (the ranks stopped at the failed collective), and no rate to wait for."""
    ev = event(kind=EventKind.RANK_FAILURE, mode=EventMode.RECONFIGURE)
    snap = JobSnapshot(
        nodes={"a": node("a"), "b": node("b")},
        round=in_process("a", "b"),
        event=ev,
        acks={"a": ack(0, 0.0, port=43210), "b": ack(0, 0.0, cooperative=False)},
    )
    (write,) = plan(snap, DeciderMemory(), NOW, ctx()).writes
    targeted = decoded(write)
    assert targeted["target"] == 0 and targeted["mode"] == "reconfigure"
    assert (targeted["master_addr"], targeted["master_port"]) == ("10.0.0.1", 43210)


@pytest.mark.parametrize(
    ("kind", "next_members", "parked", "repaired_into"),
    [
        (EventKind.JOIN, ("a", "b", "c"), True, ["a", "b", "c"]),  # the joiner is parked: admitted in the repair
        (EventKind.JOIN, ("a", "b", "c"), False, ["a", "b"]),  # still starting: not waited for, it joins later
        (EventKind.LEAVE, ("a",), False, ["a"]),  # the leaver leaves in the repair
    ],
)
def test_a_rank_failure_while_a_scale_event_waits_to_be_targeted_turns_it_into_the_repair(
    kind, next_members, parked, repaired_into
) -> None:
    """Found by test_a_rank_killed_while_a_join_is_pending: the join waited 9 s for its joiner to park while
    the survivors, their collective failed, waited in recover() for it: the failure's repair waited too."""
    nodes = {"a": node("a"), "b": node("b"), "c": node("c", parked=parked)}
    ev = event(kind=kind, mode=EventMode.RESTART, next_members=next_members, decided_at=NOW - 0.2)
    failed = {"b": FailedRecord(message="rank 1 was killed by SIGKILL", repairable=True)}
    acks = {"a": ack(40, 0.01, reconfigurable=True), "b": ack(38, 0.01, reconfigurable=True)}
    snap = JobSnapshot(nodes=nodes, round=in_process("a", "b"), event=ev, acks=acks, failed=failed)
    (write,) = plan(snap, DeciderMemory(), NOW, ctx(max_restarts=3)).writes
    targeted = decoded(write)
    assert (targeted["kind"], targeted["mode"], targeted["target"]) == ("rank_failure", "reconfigure", 0)
    assert targeted["next_members"] == repaired_into and targeted["id"] == ev.id
    assert f"with {kind.value} event 5" in targeted["reason"] and "SIGKILL" in targeted["failure"]
    quiet = JobSnapshot(
        nodes=nodes, round=in_process("a", "b"), event=ev, acks=acks
    )  # no failure: the event waits or targets as before
    assert all(decoded(w)["kind"] == kind.value for w in plan(quiet, DeciderMemory(), NOW, ctx()).writes)


def test_a_lost_node_is_left_out_of_the_repaired_round_without_waiting_for_it() -> None:
    """The restart path waits faulty_scale_down_timeout for a lost node; in place the survivors cannot step
    without a new group, so it is re-formed at once (the lost node may come back later as a joiner)."""
    snap = JobSnapshot(nodes={"a": node("a"), "c": node("c")}, round=in_process("a", "b", "c"))
    mem = DeciderMemory(lost_since={"b": NOW - 1.0})
    (write,) = plan(snap, mem, NOW, ctx()).writes
    ev = decoded(write)
    assert (ev["kind"], ev["mode"], ev["next_members"]) == ("node_lost", "reconfigure", ["a", "c"])
    restarting = JobSnapshot(nodes=snap.nodes, round=running("a", "b", "c"))
    assert decoded(plan(restarting, mem, NOW, ctx()).writes[0])["mode"] == "stop"  # the restart path is unchanged


def test_a_completed_repair_publishes_an_in_process_round_and_counts_a_restart() -> None:
    ev = event(kind=EventKind.RANK_FAILURE, mode=EventMode.RECONFIGURE, target=0)
    stopped = {m: StoppedRecord(ok=True, reconfigured=True) for m in ("a", "b")}
    snap = JobSnapshot(nodes={"a": node("a"), "b": node("b")}, round=in_process("a", "b"), event=ev, stopped=stopped)
    complete, published = plan(snap, DeciderMemory(), NOW, ctx()).writes
    rnd = decoded(published)
    assert decoded(complete)["complete"] and rnd["inprocess"] and rnd["restarts"] == 1 and rnd["reason"] == "failure"


def test_a_peer_failure_report_repairs_at_once_and_leaves_out_a_member_that_does_not_answer() -> None:
    """kill -9 of a node: its lease outlives it (10 s by default), but the survivors' collectives failed at
    once. The repair waits one propagation budget for acks, then goes on without the silent member."""
    nodes = {"a": node("a"), "b": node("b"), "c": node("c")}
    peer = FailedRecord(message="a collective failed on a", repairable=True, peer=True)
    (write,) = plan(
        JobSnapshot(nodes=nodes, round=in_process("a", "b", "c"), failed={"a": peer}), DeciderMemory(), NOW, ctx()
    ).writes
    created = decoded(write)
    assert (created["kind"], created["mode"], created["next_members"]) == ("node_lost", "reconfigure", ["a", "b", "c"])
    ev = event(kind=EventKind.NODE_LOST, mode=EventMode.RECONFIGURE, next_members=("a", "b", "c"), decided_at=NOW - 0.5)
    acks = {"a": ack(0, 0.0), "c": ack(0, 0.0)}
    waiting = JobSnapshot(nodes=nodes, round=in_process("a", "b", "c"), event=ev, acks=acks)
    assert plan(waiting, watching(ev), NOW, ctx()).writes == ()  # b may still answer within the budget (1 s)
    repair = plan(waiting, watching(ev), NOW + 1.0, ctx())
    (targeted,) = repair.writes
    assert decoded(targeted)["next_members"] == ["a", "c"] and decoded(targeted)["target"] == 0
    # b's lease outlives its agent: found in the soak, the next join admitted it as a standby and stalled
    later = JobSnapshot(nodes={**nodes, "d": node("d", parked=True)}, round=in_process("a", "c"))
    (join,) = plan(later, repair.memory, NOW + 2.0, ctx()).writes
    assert decoded(join)["kind"] == "join" and decoded(join)["next_members"] == ["a", "c", "d"]
    back = JobSnapshot(nodes={**nodes, "b": node("b", parked=True)}, round=in_process("a", "c"))  # b registered anew
    (rejoin,) = plan(back, repair.memory, NOW + 2.0, ctx()).writes
    assert decoded(rejoin)["next_members"] == ["a", "c", "b"]
    done = JobSnapshot(
        nodes=nodes,
        round=in_process("a", "b", "c"),
        event=evolve_event(decoded(targeted)),
        stopped={m: StoppedRecord(ok=True, reconfigured=True) for m in ("a", "c")},
    )
    complete, published = plan(done, DeciderMemory(), NOW + 2.0, ctx()).writes  # b is not waited for
    assert decoded(published)["members"] == ["a", "c"] and decoded(published)["restarts"] == 0


@pytest.mark.parametrize(
    ("elapsed", "failed_on", "left_out"),
    [
        (0.45, ("a", "c"), False),  # within half the budget: b may still be reading the event
        (0.55, ("a", "c"), True),  # everyone else saw the collective break and acked; b said nothing
        (0.55, ("a",), False),  # c acked but has not seen the failure yet: no evidence against b
        (0.55, ("a", "b", "c"), False),  # b's agent reported: it is alive, give it the whole budget
        (1.05, ("a",), True),  # the budget is spent: silent members are left out whatever was reported
    ],
)
def test_a_member_silent_while_every_other_reported_the_failure_is_left_out_after_half_the_budget(
    elapsed: float, failed_on: tuple[str, ...], left_out: bool
) -> None:
    """A node loss paid the whole propagation budget (1 s of a 2.15 s repair, failures benchmark) waiting for
    the ack of an agent that died with its ranks."""
    nodes = {"a": node("a"), "b": node("b"), "c": node("c")}
    ev = event(
        kind=EventKind.NODE_LOST, mode=EventMode.RECONFIGURE, next_members=("a", "b", "c"), decided_at=NOW - elapsed
    )
    failed = {m: FailedRecord(message=f"a collective failed on {m}", repairable=True, peer=True) for m in failed_on}
    snap = JobSnapshot(
        nodes=nodes, round=in_process("a", "b", "c"), event=ev, acks={"a": ack(0, 0.0), "c": ack(0, 0.0)}, failed=failed
    )
    writes = plan(snap, watching(ev), NOW, ctx()).writes
    if not left_out:
        assert writes == ()
        return
    (targeted,) = writes
    assert decoded(targeted)["next_members"] == ["a", "c"] and decoded(targeted)["target"] == 0
    assert f"left out ['b']: no answer within {min(elapsed, 1.0):.2g}s" in decoded(targeted)["reason"]


def test_a_repair_nobody_has_answered_yet_waits_its_whole_budget() -> None:
    """No ack and no report: silence is no evidence against anyone (the early leave-out would stop the repair)."""
    ev = event(kind=EventKind.NODE_LOST, mode=EventMode.RECONFIGURE, next_members=("a", "b"), decided_at=NOW - 0.55)
    snap = JobSnapshot(nodes={"a": node("a"), "b": node("b")}, round=in_process("a", "b"), event=ev)
    assert plan(snap, DeciderMemory(), NOW, ctx()).writes == ()


def test_a_member_whose_lease_expires_while_the_repair_waits_for_acks_is_left_out() -> None:
    """Found with a sharded model's lost-node test: b's lease expired 1.4 s after its kill, while the repair
    waited for acks; b was no longer live, so not "missing", and the repair was targeted with b in its next
    round, which then stopped every rank ("vanished during the in-place reconfiguration") and restarted."""
    ev = event(kind=EventKind.NODE_LOST, mode=EventMode.RECONFIGURE, next_members=("a", "b"), decided_at=NOW - 0.4)
    snap = JobSnapshot(nodes={"a": node("a")}, round=in_process("a", "b"), event=ev, acks={"a": ack(0, 0.0)})
    (targeted,) = plan(snap, DeciderMemory(), NOW, ctx()).writes
    assert decoded(targeted)["next_members"] == ["a"] and decoded(targeted)["target"] == 0
    assert "left out ['b']: gone" in decoded(targeted)["reason"]


def test_a_repair_made_from_the_survivors_reports_is_named_after_the_crash_reported_since() -> None:
    """Found by the crash test: a survivor's failed collective reached the decider before the crashed rank's
    node reported, and the event was logged as a lost node."""
    nodes = {"a": node("a"), "b": node("b")}
    ev = event(kind=EventKind.NODE_LOST, mode=EventMode.RECONFIGURE, next_members=("a", "b"))
    failed = {
        "a": FailedRecord(message="a collective failed on a", repairable=True, peer=True),
        "b": FailedRecord(message="rank 1 was killed by SIGKILL", repairable=True),
    }
    snap = JobSnapshot(
        nodes=nodes, round=in_process("a", "b"), event=ev, acks={"a": ack(0, 0.0), "b": ack(0, 0.0)}, failed=failed
    )
    (write,) = plan(snap, DeciderMemory(), NOW, ctx(max_restarts=1)).writes
    assert (decoded(write)["kind"], decoded(write)["target"], decoded(write)["failure"]) == (
        "rank_failure",
        0,
        "rank 1 was killed by SIGKILL",
    )
    (stopped,) = plan(snap, DeciderMemory(), NOW, ctx(max_restarts=0)).writes
    assert decoded(stopped)["mode"] == "stop"  # a crash counts against --max-restarts however it was first seen


def test_no_scale_event_once_training_finished_on_a_member_and_each_new_standby_is_said_once() -> None:
    """A standby admitted after the end of training would train the job again from its end (issue 21's
    reproductions): while a member's training is finished, the decider writes nothing."""
    nodes = {"a": node("a"), "b": node("b"), "c": node("c")}
    mem = DeciderMemory(first_seen={n: NOW - 100 for n in nodes}, capacity_since=NOW - 100)
    ready = JobSnapshot(nodes=nodes, round=running("a", "b"))
    (write,) = plan(ready, mem, NOW, ctx()).writes  # the control: c is admitted while training goes on
    assert write.key == Keys.EVENT and decoded(write)["kind"] == "join"
    held = plan(JobSnapshot(nodes=nodes, round=running("a", "b"), finished=frozenset({"b"})), mem, NOW, ctx())
    assert held.writes == () and "training finished on b" in held.waiting_for
    (note,) = held.notes
    assert note.event == "scale_held" and note.fields == {"standbys": ("c",)}
    again = plan(JobSnapshot(nodes=nodes, round=running("a", "b"), finished=frozenset({"b"})), held.memory, NOW, ctx())
    assert again.writes == () and again.notes == ()  # said once
    more = {**nodes, "d": node("d")}
    later = plan(JobSnapshot(nodes=more, round=running("a", "b"), finished=frozenset({"b"})), held.memory, NOW, ctx())
    assert later.writes == () and [n.fields for n in later.notes] == [{"standbys": ("c", "d")}]
