"""Every rule of the pure elastic decision function, with timer boundaries, plus properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperpodrun.policy import (
    MEMBERSHIP_ACTIONS,
    Action,
    ClusterView,
    ClusterViewError,
    Decision,
    ElasticPolicy,
    NodeState,
    ScaleEvent,
    decide,
)

# Timers: scaling 10 s, lost nodes 20 s, stable period 5 s doubling within 100 s up to 40 s.
POLICY = ElasticPolicy(
    min_replicas=2,
    max_replicas=6,
    scaling_timeout=10,
    faulty_scale_down_timeout=20,
    min_stable_period=5,
    backoff_window=100,
    backoff_factor=2,
    max_backoff=40,
)
_TIMERS = dict(scaling_timeout=10, min_stable_period=5, max_backoff=40)
STEP = ElasticPolicy(min_replicas=2, max_replicas=6, replica_increment_step=2, **_TIMERS)
DISCRETE = ElasticPolicy(min_replicas=1, max_replicas=8, replica_discrete_values=(2, 4, 8), **_TIMERS)


def nodes(*specs: str | tuple) -> dict[str, NodeState]:
    """``"a"`` -> a joined at 0; ``("a", 5.0)`` -> joined at 5; ``("a", 5.0, True)`` -> leaving."""
    out = {}
    for spec in specs:
        node_id, joined, leaving = (spec, 0.0, False) if isinstance(spec, str) else (*spec, False)[:3]
        out[node_id] = NodeState(node_id, joined, leaving)
    return out


def before_start(*alive: str | tuple, first_min: float | None = 0.0, cap: int | None = None) -> ClusterView:
    return ClusterView(round=0, members=(), alive=nodes(*alive), lost_since={}, cap=cap, first_min_reached_at=first_min)


def running(
    members: tuple[str, ...],
    *,
    alive: tuple = (),
    lost: dict[str, float] | None = None,
    events: tuple[tuple[float, int], ...] = (),
    cap: int | None = None,
    capacity_since: float | None = None,
) -> ClusterView:
    """Members are alive (joined at 0) unless lost or listed with their own spec in ``alive``;
    ``events`` are (time, replicas) of the past rounds, oldest first."""
    lost = lost or {}
    state = nodes(*(m for m in members if m not in lost))
    state.update(nodes(*alive))
    return ClusterView(
        round=1,
        members=members,
        alive=state,
        lost_since=lost,
        last_events=tuple(ScaleEvent(at, n) for at, n in events),
        cap=cap,
        capacity_since=capacity_since,
    )


# --------------------------------------------------------------------------- before start


@pytest.mark.parametrize(
    ("policy", "view", "now", "action", "members", "recheck"),
    [
        # Below the smallest allowed size: wait for nodes.
        (POLICY, before_start("a", first_min=None), 0.0, Action.INSUFFICIENT, (), None),
        # Enough for max: start at once, in join order, ignoring first_min.
        (POLICY, before_start(*"fedcba", first_min=None), 0.0, Action.START, tuple("abcdef"), None),
        # More than max: the latest joiner stays a standby.
        (
            POLICY,
            before_start(("z", 0.0), *((f"n{i}", 1.0) for i in range(6))),
            0.0,
            Action.START,
            ("z", "n0", "n1", "n2", "n3", "n4"),
            None,
        ),
        # Between min and max: the torchrun "last call" wait of scaling_timeout from first_min.
        (POLICY, before_start("a", "b", "c", first_min=100.0), 109.999, Action.NONE, (), 110.0),
        (POLICY, before_start("a", "b", "c", first_min=100.0), 110.0, Action.START, ("a", "b", "c"), None),
        (POLICY, before_start("a", "b", "c", first_min=100.0), 111.0, Action.START, ("a", "b", "c"), None),
        # Start order is join time, then node id.
        (POLICY, before_start(("b", 1.0), ("c", 0.0), ("a", 1.0)), 10.0, Action.START, ("c", "a", "b"), None),
        # A node that asked to leave is not started.
        (POLICY, before_start("a", ("b", 0.0, True)), 50.0, Action.INSUFFICIENT, (), None),
        # The cap is the ceiling: reaching it starts at once.
        (POLICY, before_start("a", "b", "c", "d", cap=3, first_min=None), 0.0, Action.START, ("a", "b", "c"), None),
        (POLICY, before_start("a", "b", cap=1), 50.0, Action.INSUFFICIENT, (), None),
        # Step sizes: 5 nodes after the wait start 4.
        (STEP, before_start(*"abcde"), 10.0, Action.START, tuple("abcd"), None),
        (STEP, before_start(*"abcde"), 9.0, Action.NONE, (), 10.0),
    ],
)
def test_start_rules(policy, view, now, action, members, recheck) -> None:
    decision = decide(policy, view, now)
    assert (decision.action, decision.members, decision.recheck_at) == (action, members, recheck)


def test_insufficient_reason_says_how_many_are_missing() -> None:
    decision = decide(DISCRETE, before_start(("a", 0.0), ("b", 0.0, True)), 0.0)
    assert decision.action is Action.INSUFFICIENT
    assert "1 usable node(s), 1 more needed for the smallest allowed replica count 2" in decision.reason


def test_insufficient_reason_names_the_cap() -> None:
    decision = decide(POLICY, before_start("a", "b", cap=1), 0.0)
    assert "operator cap 1 admits no allowed replica count (the smallest is 2)" in decision.reason


def test_waiting_to_start_requires_first_min_reached_at() -> None:
    with pytest.raises(ClusterViewError, match="first_min_reached_at is None"):
        decide(POLICY, before_start("a", "b", first_min=None), 0.0)


def test_resume_after_insufficient_uses_start_rules() -> None:
    view = ClusterView(round=4, members=(), alive=nodes(*"abcdefg"), lost_since={})
    decision = decide(POLICY, view, 0.0)
    assert (decision.action, decision.members) == (Action.START, tuple("abcdef"))


# --------------------------------------------------------------------------- running: forced changes


@pytest.mark.parametrize(
    ("policy", "view", "now", "action", "members"),
    [
        # A leaving member is dropped at once, even right after a scale event.
        (
            POLICY,
            running(("a", "b", "c"), alive=(("b", 0.0, True),), events=((100.0, 3),)),
            100.0,
            Action.SCALE_DOWN,
            ("a", "c"),
        ),
        # A standby replaces it: same size, new member last, order of the others kept.
        (
            POLICY,
            running(("a", "b", "c"), alive=(("b", 0.0, True), ("s", 50.0))),
            51.0,
            Action.SCALE_DOWN,
            ("a", "c", "s"),
        ),
        # Refill never grows past the current size: growth is a gated scale-up.
        (
            POLICY,
            running(("a", "b", "c"), alive=(("b", 0.0, True), "s", "t", "u")),
            100.0,
            Action.SCALE_DOWN,
            ("a", "c", "s"),
        ),
        # Rank 0 leaving: the next existing member becomes rank 0, not the standby.
        (POLICY, running(("a", "b", "c"), alive=(("a", 0.0, True), "s")), 1.0, Action.SCALE_DOWN, ("b", "c", "s")),
        # Discrete sizes: 3 healthy of 4 round down to 2, dropping the highest group ranks.
        (DISCRETE, running(("a", "b", "c", "d"), alive=(("b", 0.0, True),)), 1.0, Action.SCALE_DOWN, ("a", "c")),
        # Below min with no standby: the job must wait for nodes.
        (POLICY, running(("a", "b"), alive=(("b", 0.0, True),)), 1.0, Action.INSUFFICIENT, ()),
        # A member gone without being reported lost (lease revoked) is dropped at once.
        (
            POLICY,
            ClusterView(round=2, members=("a", "b", "c"), alive=nodes("a", "c"), lost_since={}),
            1.0,
            Action.SCALE_DOWN,
            ("a", "c"),
        ),
        # Cap below the current size: shrink at once, regardless of anti-thrashing.
        (
            POLICY,
            running(tuple("abcde"), cap=3, events=((99.0, 4), (100.0, 5))),
            100.0,
            Action.SCALE_DOWN,
            ("a", "b", "c"),
        ),
        (STEP, running(tuple("abcd"), cap=3), 1.0, Action.SCALE_DOWN, ("a", "b")),
        (POLICY, running(("a", "b", "c"), cap=1), 1.0, Action.INSUFFICIENT, ()),
        # A current size that is not allowed (policy changed across a resume) is reshaped at once.
        (STEP, running(("a", "b", "c")), 1.0, Action.SCALE_DOWN, ("a", "b")),
        (POLICY, running(("a",), alive=(("s", 3.0), ("t", 4.0))), 1.0, Action.SCALE_DOWN, ("a", "s")),
        # Leaving plus a pending lost member: one reshape drops both.
        (
            POLICY,
            running(("a", "b", "c", "d"), alive=(("b", 0.0, True),), lost={"c": 100.0}),
            101.0,
            Action.SCALE_DOWN,
            ("a", "d"),
        ),
    ],
)
def test_forced_changes(policy, view, now, action, members) -> None:
    decision = decide(policy, view, now)
    assert (decision.action, decision.members, decision.recheck_at) == (action, members, None)


@pytest.mark.parametrize(
    ("now", "action", "members", "recheck"),
    [
        (100.0, Action.WAIT_FOR_LOST, (), 120.0),
        (119.999, Action.WAIT_FOR_LOST, (), 120.0),
        (120.0, Action.SCALE_DOWN, ("a", "c", "s"), None),
        (121.0, Action.SCALE_DOWN, ("a", "c", "s"), None),
    ],
)
def test_lost_member_timer_then_refill(now, action, members, recheck) -> None:
    view = running(("a", "b", "c"), lost={"b": 100.0}, alive=(("s", 5.0),))
    decision = decide(POLICY, view, now)
    assert (decision.action, decision.members, decision.recheck_at) == (action, members, recheck)


def test_lost_members_wait_for_the_earliest_deadline_and_insufficient_says_why() -> None:
    view = running(("a", "b", "c"), lost={"b": 100.0, "c": 90.0})
    wait = decide(POLICY, view, 105.0)
    assert (wait.action, wait.recheck_at) == (Action.WAIT_FOR_LOST, 110.0)
    assert "b, c" in wait.reason
    shrink = decide(POLICY, view, 110.0)
    assert shrink.action is Action.INSUFFICIENT
    assert "1 usable node(s), 1 more needed" in shrink.reason


def test_lost_member_that_came_back_restarts_same_membership() -> None:
    view = running(("a", "b", "c"), lost={"b": 100.0}, alive=(("b", 110.0),))
    decision = decide(POLICY, view, 110.0)
    assert (decision.action, decision.members) == (Action.RESTART, ("a", "b", "c"))


def test_lost_member_came_back_while_another_is_still_lost_keeps_waiting() -> None:
    view = running(("a", "b", "c"), lost={"b": 100.0, "c": 105.0}, alive=(("b", 110.0),))
    decision = decide(POLICY, view, 110.0)
    assert (decision.action, decision.recheck_at) == (Action.WAIT_FOR_LOST, 125.0)


def test_returned_member_and_ready_scale_up_combine_into_one_scale_up() -> None:
    view = running(("a", "b"), lost={"b": 100.0}, alive=(("b", 110.0), ("s", 0.0)))
    decision = decide(POLICY, view, 110.0)
    assert (decision.action, decision.members) == (Action.SCALE_UP, ("a", "b", "s"))
    assert "came back" in decision.reason


# --------------------------------------------------------------------------- running: scale-up


def test_steady_state_without_standbys() -> None:
    decision = decide(POLICY, running(("a", "b", "c")), 1000.0)
    assert (decision.action, decision.members, decision.recheck_at) == (Action.NONE, (), None)
    assert "no standby node" in decision.reason


@pytest.mark.parametrize(
    ("now", "capacity_since", "action", "members", "recheck"),
    [
        (109.999, None, Action.NONE, (), 110.0),
        (110.0, None, Action.SCALE_UP, ("a", "b", "s"), None),
        (111.0, None, Action.SCALE_UP, ("a", "b", "s"), None),
        (110.0, 105.0, Action.NONE, (), 115.0),  # the caller's capacity_since is later than the join
        (115.0, 105.0, Action.SCALE_UP, ("a", "b", "s"), None),
        (110.0, 50.0, Action.SCALE_UP, ("a", "b", "s"), None),  # an earlier capacity_since does not help
    ],
)
def test_scale_up_waits_for_scaling_timeout(now, capacity_since, action, members, recheck) -> None:
    view = running(("a", "b"), alive=(("s", 100.0),), capacity_since=capacity_since)
    decision = decide(POLICY, view, now)
    assert (decision.action, decision.members, decision.recheck_at) == (action, members, recheck)


def test_scale_up_takes_the_largest_stable_size_newcomers_by_join_time() -> None:
    view = running(("a", "b"), alive=(("t", 3.0), ("s", 3.0), ("r", 0.0), ("late", 100.0)))
    decision = decide(POLICY, view, 50.0)
    assert (decision.action, decision.members) == (Action.SCALE_UP, ("a", "b", "r", "s", "t"))


@pytest.mark.parametrize(
    ("standbys", "action", "members"),
    [
        (("s",), Action.NONE, ()),  # 3 is not an allowed size with step 2
        (("s", "t"), Action.SCALE_UP, ("a", "b", "s", "t")),
        (("s", "t", "u"), Action.SCALE_UP, ("a", "b", "s", "t")),
    ],
)
def test_scale_up_respects_step(standbys, action, members) -> None:
    decision = decide(STEP, running(("a", "b"), alive=standbys), 100.0)
    assert (decision.action, decision.members) == (action, members)


@pytest.mark.parametrize(
    ("events", "now", "action", "recheck"),
    [
        (((90.0, 2),), 94.999, Action.NONE, 95.0),  # base period 5 s
        (((90.0, 2),), 95.0, Action.SCALE_UP, None),
        (((50.0, 1), (90.0, 2)), 95.0, Action.SCALE_UP, None),  # growth after growth: still the base
        (((10.0, 2), (50.0, 3), (90.0, 2)), 99.0, Action.NONE, 100.0),  # a reversal within the window: 10 s
        (((10.0, 2), (50.0, 3), (90.0, 2)), 100.0, Action.SCALE_UP, None),
        # Up and down four times: 5 * 2^4 = 80, capped at 40.
        (((0.0, 3), (10.0, 2), (20.0, 3), (30.0, 2), (40.0, 3), (90.0, 2)), 129.0, Action.NONE, 130.0),
        (((0.0, 3), (10.0, 2), (20.0, 3), (30.0, 2), (40.0, 3), (90.0, 2)), 130.0, Action.SCALE_UP, None),
        (((0.0, 2), (5.0, 3), (106.0, 2)), 110.999, Action.NONE, 111.0),  # reversal further apart than the window
    ],
)
def test_anti_thrashing_backoff_delays_scale_up(events, now, action, recheck) -> None:
    view = running(("a", "b"), alive=("s",), events=events)
    decision = decide(POLICY, view, now)
    assert (decision.action, decision.recheck_at) == (action, recheck)
    if action is Action.NONE:
        assert "held back" in decision.reason


def test_recheck_is_the_later_of_capacity_and_backoff() -> None:
    view = running(("a", "b"), alive=(("s", 100.0),), events=((50.0, 2), (80.0, 3), (105.0, 2)))
    decision = decide(POLICY, view, 106.0)
    assert (decision.action, decision.recheck_at) == (Action.NONE, 115.0)  # 105 + 5 x 2 (a reversal) > 100 + 10


def test_cap_then_lift() -> None:
    capped = running(tuple("abcd"), cap=2)
    down = decide(POLICY, capped, 100.0)
    assert (down.action, down.members) == (Action.SCALE_DOWN, ("a", "b"))
    # c and d are now standbys; with the cap in place there is nothing to do.
    after = running(("a", "b"), alive=("c", "d"), cap=2, events=((100.0, 2),))
    assert decide(POLICY, after, 200.0).action is Action.NONE
    lifted = running(("a", "b"), alive=("c", "d"), events=((100.0, 2),))
    held = decide(POLICY, lifted, 104.0)
    assert (held.action, held.recheck_at) == (Action.NONE, 105.0)
    up = decide(POLICY, lifted, 105.0)
    assert (up.action, up.members) == (Action.SCALE_UP, ("a", "b", "c", "d"))
    partial = decide(POLICY, running(("a", "b"), alive=("c", "d"), cap=3, events=((100.0, 2),)), 105.0)
    assert partial.members == ("a", "b", "c")


@pytest.mark.parametrize(
    ("members", "nproc", "max_world", "action", "expected"),
    [
        (("a", "b"), 4, 13, Action.SCALE_UP, ("a", "b", "s")),  # 13 // 4 = 3 replicas
        (("a", "b"), 4, 11, Action.NONE, ()),  # 2 replicas already fill it
        (("a", "b", "c", "d"), 4, 12, Action.SCALE_DOWN, ("a", "b", "c")),  # shrink to fit
        (("a", "b"), 8, 12, Action.INSUFFICIENT, ()),  # even min does not fit
        (("a", "b"), 1, None, Action.SCALE_UP, ("a", "b", "s", "t", "u", "v")),
    ],
)
def test_max_world_size_filters_sizes(members, nproc, max_world, action, expected) -> None:
    view = running(members, alive=("s", "t", "u", "v"))
    decision = decide(POLICY, view, 100.0, nproc_per_node=nproc, max_world_size=max_world)
    assert (decision.action, decision.members) == (action, expected)


def test_decide_is_pure() -> None:
    view = running(("a", "b"), alive=(("s", 100.0),), events=((95.0, 2),), lost={})
    first = decide(POLICY, view, 104.0)
    assert first == decide(POLICY, view, 104.0)
    assert view.members == ("a", "b") and set(view.alive) == {"a", "b", "s"}


# --------------------------------------------------------------------------- contracts


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(round=-1, members=(), alive={}, lost_since={}), "round must be an integer >= 0"),
        (dict(round=1, members=("a", "a"), alive={}, lost_since={}), "duplicates"),
        (dict(round=0, members=("a",), alive={}, lost_since={}), "must be empty in round 0"),
        (dict(round=1, members=("a",), alive={"b": NodeState("a", 0.0)}, lost_since={}), "holds the state of 'a'"),
        (dict(round=1, members=("a",), alive={}, lost_since={"x": 1.0}), "'x', which is not a member"),
        (dict(round=1, members=("a",), alive={}, lost_since={"a": math.nan}), "lost_since['a']"),
        (
            dict(
                round=1, members=("a",), alive={}, lost_since={}, last_events=(ScaleEvent(2.0, 1), ScaleEvent(1.0, 1))
            ),
            "oldest first",
        ),
        (dict(round=1, members=("a",), alive={}, lost_since={}, last_events=(2.0,)), "must hold ScaleEvent records"),
        (dict(round=1, members=("a",), alive={}, lost_since={}, cap=-1), "cap must be None or an integer >= 0"),
        (dict(round=0, members=(), alive={}, lost_since={}, capacity_since=math.inf), "capacity_since"),
    ],
)
def test_cluster_view_validation(kwargs, fragment) -> None:
    with pytest.raises(ClusterViewError) as info:
        ClusterView(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(nproc_per_node=0), "nproc_per_node must be an integer >= 1"),
        (dict(max_world_size=0), "max_world_size must be None or an integer >= 1"),
    ],
)
def test_decide_rejects_bad_arguments(kwargs, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        decide(POLICY, before_start("a"), 0.0, **kwargs)


def test_decision_members_match_action() -> None:
    with pytest.raises(ValueError, match="members must be non-empty exactly for"):
        Decision(Action.START, ())
    with pytest.raises(ValueError, match="members must be non-empty exactly for"):
        Decision(Action.NONE, ("a",))


# --------------------------------------------------------------------------- properties


@st.composite
def policies(draw) -> ElasticPolicy:
    lo = draw(st.integers(1, 4))
    hi = draw(st.integers(lo, 8))
    mode = draw(st.sampled_from(["all", "step", "discrete"]))
    kwargs = dict(
        min_replicas=lo,
        max_replicas=hi,
        scaling_timeout=draw(st.sampled_from([0.0, 10.0])),
        faulty_scale_down_timeout=draw(st.sampled_from([0.0, 20.0])),
        min_stable_period=5.0,
        backoff_window=100.0,
        max_backoff=40.0,
    )
    if mode == "step":
        kwargs["replica_increment_step"] = draw(st.integers(1, 3))
    elif mode == "discrete":
        values = draw(st.sets(st.integers(lo, hi), min_size=1))
        kwargs["replica_discrete_values"] = tuple(sorted(values))
    return ElasticPolicy(**kwargs)


times = st.floats(0.0, 100.0, allow_nan=False).map(lambda t: round(t, 1))


@st.composite
def views(draw) -> ClusterView:
    ids = [f"n{i}" for i in range(draw(st.integers(0, 9)))]
    alive = {i: NodeState(i, draw(times), draw(st.booleans())) for i in ids if draw(st.booleans())}
    started = draw(st.booleans())
    members: tuple[str, ...] = tuple(draw(st.permutations(ids))[: draw(st.integers(1, 9))]) if started and ids else ()
    lost = {}
    for m in members:
        # A member that is not alive is lost (timer running) or departed; an alive one may have come back.
        if draw(st.booleans()):
            lost[m] = draw(times)
    events = tuple(ScaleEvent(t, draw(st.integers(1, 9))) for t in sorted(draw(st.lists(times, max_size=4))))
    return ClusterView(
        round=1 if members else 0,
        members=members,
        alive=alive,
        lost_since=lost,
        last_events=events,
        cap=draw(st.none() | st.integers(0, 9)),
        capacity_since=draw(st.none() | times),
        first_min_reached_at=draw(times),
    )


@settings(max_examples=300, deadline=None)
@given(
    policy=policies(),
    view=views(),
    now=st.floats(0.0, 200.0, allow_nan=False),
    nproc=st.integers(1, 4),
    max_world=st.none() | st.integers(1, 32),
)
def test_decisions_are_always_valid(policy, view, now, nproc, max_world) -> None:
    decision = decide(policy, view, now, nproc_per_node=nproc, max_world_size=max_world)
    new = decision.members
    if decision.action in MEMBERSHIP_ACTIONS:
        assert len(new) in policy.allowed_sizes()
        assert view.cap is None or len(new) <= view.cap
        assert max_world is None or len(new) * nproc <= max_world
        assert all(m in view.alive and not view.alive[m].leaving for m in new)
        kept = tuple(m for m in view.members if m in new)
        assert new[: len(kept)] == kept, "existing members must come first, in their order"
        newcomers = [view.alive[m] for m in new[len(kept) :]]
        assert newcomers == sorted(newcomers, key=lambda s: (s.joined_at, s.node_id))
        if kept:
            assert new[0] == kept[0], "rank 0 must be an existing member"
    if decision.action is Action.RESTART:
        assert new == view.members
    if decision.action is Action.SCALE_UP:
        assert len(new) > len(view.members)
    if decision.action is Action.SCALE_DOWN:
        assert len(new) <= max(len(view.members), policy.allowed_sizes()[0])
    if decision.recheck_at is not None:
        assert decision.recheck_at > now
        # Nothing changes before recheck_at on an unchanged view.
        midway = decide(policy, view, (now + decision.recheck_at) / 2, nproc_per_node=nproc, max_world_size=max_world)
        assert (midway.action, midway.members, midway.recheck_at) == (
            decision.action,
            decision.members,
            decision.recheck_at,
        )
