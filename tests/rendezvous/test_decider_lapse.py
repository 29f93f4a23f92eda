"""A store outage lets every lease lapse: the decider that reads the store again must not take the members
(itself included) for lost nodes, and a round halted meanwhile must not be left halted.

Found in a CI rehearsal (``tests/elastic/test_store_outage.py``, etcd frozen past the lease ttl, two nodes
in place): node a's decider read the store before its own agent had registered again, decided a
``node_lost`` STOP naming itself and b, and the halted round, both members alive, was then never restarted.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator

import pytest

from hyperpodrun.policy import ElasticPolicy
from hyperpodrun.rendezvous.decider import DeciderContext, DeciderMemory, JobSnapshot, plan
from hyperpodrun.rendezvous.decider_seat import DeciderSeat
from hyperpodrun.rendezvous.records import (
    EventKind,
    FailedRecord,
    Keys,
    NodeRecord,
    RoundRecord,
    RoundState,
    encode,
)
from hyperpodrun.store import Store, create_store

NOW = 1_000.0
LEASE_TTL = 5.0
TICK = 0.2


def ctx() -> DeciderContext:
    policy = ElasticPolicy(min_replicas=1, max_replicas=3, scaling_timeout=0.0, min_stable_period=0.0)
    return DeciderContext(
        policy=policy,
        nproc_per_node=1,
        max_restarts=3,
        lease_ttl=LEASE_TTL,
        ack_timeout=30.0,
        propagation=1.0,
        tick=TICK,
    )


def node(name: str) -> NodeRecord:
    return NodeRecord(addr="127.0.0.1", port=40000 + ord(name[-1]), nproc=1, reconfigurable=True, can_hold=True)


def round_of(*members: str, inprocess: bool = True, **kw) -> RoundRecord:
    return RoundRecord(
        round=3,
        members=members,
        master_addr="127.0.0.1",
        master_port=40097,
        events=((NOW - 100, len(members)),),
        inprocess=inprocess,
        **kw,
    )


def decoded(write) -> dict:
    return json.loads(write.value)


@pytest.mark.parametrize("registered", [(), ("b",)], ids=["no_record", "only_the_other"])
@pytest.mark.parametrize("inprocess", [True, False], ids=["in_place", "restart"])
def test_a_decider_without_its_own_record_decides_nothing(registered: tuple[str, ...], inprocess: bool) -> None:
    """The rehearsal's failure: before the fix this wrote a node_lost event naming a (the decider) and b."""
    snap = JobSnapshot(nodes={n: node(n) for n in registered}, round=round_of("a", "b", inprocess=inprocess))
    result = plan(snap, DeciderMemory(), NOW, ctx(), decider="a")
    assert result.writes == ()
    assert result.memory.lapsed and "this node's record (a) is gone" in result.waiting_for


@pytest.mark.parametrize("inprocess", [True, False], ids=["in_place", "restart"])
def test_after_its_own_lapse_the_decider_gives_the_others_one_lease_ttl_to_register_again(inprocess: bool) -> None:
    mem = DeciderMemory(lapsed=True)
    lone = JobSnapshot(nodes={"a": node("a")}, round=round_of("a", "b", inprocess=inprocess))
    first = plan(lone, mem, NOW, ctx(), decider="a")
    assert first.writes == () and not first.memory.lapsed
    grace_end = NOW + LEASE_TTL + TICK
    assert first.memory.lapse_grace_until == grace_end and f"t={grace_end:.3f}" in first.waiting_for
    later = plan(lone, first.memory, grace_end - 0.01, ctx(), decider="a")
    assert later.writes == () and "member(s) b have no record" in later.waiting_for
    back = JobSnapshot(nodes={"a": node("a"), "b": node("b")}, round=lone.round)
    writes = plan(back, later.memory, grace_end - 0.01, ctx(), decider="a").writes
    assert all(w.key != Keys.EVENT for w in writes)  # b is back: no event (a restart-path round is marked in place)
    # b never came back: past the grace it is a lost node like any other
    (write,) = plan(lone, later.memory, grace_end, ctx(), decider="a").writes
    ev = decoded(write)
    assert ev["kind"] == "node_lost"
    assert (ev["mode"], ev["next_members"]) == (("reconfigure", ["a"]) if inprocess else ("stop", None))


def test_a_failure_reported_within_the_grace_is_repaired_at_once() -> None:
    """The grace only covers records missing with no other sign: a rank's reported failure is one."""
    failed = {"a": FailedRecord(message="a collective failed on a: a peer died or hung", repairable=True, peer=True)}
    snap = JobSnapshot(nodes={"a": node("a")}, round=round_of("a", "b"), failed=failed)
    mem = DeciderMemory(lapse_grace_until=NOW + LEASE_TTL, lost_since={"b": NOW - 0.5})
    (write,) = plan(snap, mem, NOW, ctx(), decider="a").writes
    ev = decoded(write)
    assert (ev["kind"], ev["mode"], ev["next_members"]) == ("node_lost", "reconfigure", ["a"])


@pytest.mark.parametrize("halt_kind", [EventKind.NODE_LOST, EventKind.LEAVE])
def test_a_halted_round_whose_members_are_all_alive_restarts_them(halt_kind: EventKind) -> None:
    """The rehearsal's second fault: the decider that took over (no memory of the members' absence) saw the
    halted round's members alive and read the job as "running at 2 replica(s); no standby node"."""
    halted = round_of("a", "b", state=RoundState.HALTED, halt_kind=halt_kind, halted_at=NOW - 1.0)
    snap = JobSnapshot(nodes={"a": node("a"), "b": node("b")}, round=halted)
    (write,) = plan(snap, DeciderMemory(), NOW, ctx()).writes
    nxt = decoded(write)
    assert (nxt["round"], nxt["members"], nxt["state"]) == (4, ["a", "b"], "running")
    assert nxt["reason"] == ("failure" if halt_kind is EventKind.NODE_LOST else "scale")
    assert f"round 3 halted ({halt_kind.value}) and every member is alive" in nxt["why"]


# --------------------------------------------------------------------------- the seat on a real store


@pytest.fixture
def store() -> Iterator[Store]:
    with contextlib.closing(
        create_store("c10d", "127.0.0.1:0", run_id=f"lapse-{uuid.uuid4().hex[:8]}", conf={}, host=True, timeout=10.0)
    ) as s:
        yield s


def seat_of(store: Store, node_id: str, clock: list[float] | None = None) -> DeciderSeat:
    """``node_id``'s seat; its clock reads ``clock[0]`` (NOW when not given)."""
    lease = store.grant_lease(LEASE_TTL)
    now = clock if clock is not None else [NOW]
    return DeciderSeat(store, context=ctx(), node_id=node_id, events=None, clock=lambda: now[0], lease=lambda: lease)


def test_the_seat_decides_nothing_over_a_store_whose_leases_all_lapsed(store: Store) -> None:
    """The rehearsal's store right after etcd resumed: the round of a and b in place, neither node record,
    the decider key still a's. The seat writes no event; a's record back alone starts the grace, not a repair."""
    store.put(Keys.ROUND, encode(round_of("a", "b")))
    seat = seat_of(store, "a")
    assert seat.claim()
    assert not seat.decide() and store.get(Keys.EVENT) is None
    assert "this node's record (a) is gone" in seat.waiting_for
    store.put(Keys.node("a"), encode(node("a")))
    assert not seat.decide() and store.get(Keys.EVENT) is None
    assert "member(s) b have no record" in seat.waiting_for


def test_a_seat_told_of_its_agents_lapse_waits_for_the_other_members(store: Store) -> None:
    """b's agent registered again first; b then takes the seat of a, whose record is still missing: told of its
    own lapse (``ElasticRendezvous.rejoin``), b waits for a instead of repairing the round without it."""
    store.put(Keys.ROUND, encode(round_of("a", "b")))
    store.put(Keys.node("b"), encode(node("b")))
    seat = seat_of(store, "b")
    seat.note_lapse()
    assert seat.claim()
    assert not seat.decide() and store.get(Keys.EVENT) is None
    assert (
        f"member(s) a have no record, as this node had none after its lease lapsed, and no rank reported a "
        f"failure: waiting until t={NOW + LEASE_TTL + TICK:.3f}" in seat.waiting_for
    )
    untold = seat_of(store, "b")  # the same read without the lapse: a is a lost node, repaired in place at once
    untold.decide()
    assert decoded(store.get(Keys.EVENT))["kind"] == "node_lost"


def test_the_grace_runs_from_the_agents_lapse_not_from_the_seats_next_decision(store: Store) -> None:
    """A node whose agent registered again long before it took the seat gives a missing member no grace."""
    store.put(Keys.ROUND, encode(round_of("a", "b")))
    store.put(Keys.node("b"), encode(node("b")))
    clock = [NOW]
    seat = seat_of(store, "b", clock)
    seat.note_lapse()
    clock[0] = NOW + LEASE_TTL + TICK  # one lease ttl later, b takes the seat: a is a lost node
    assert seat.claim()
    seat.decide()
    assert decoded(store.get(Keys.EVENT))["kind"] == "node_lost"
